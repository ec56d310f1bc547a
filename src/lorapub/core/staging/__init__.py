"""The engine-side staging of adapter versions as a pure machine: its commands, replies and effects
(:mod:`.messages`) and its transitions (:mod:`.machine`). The engine drives it
(``lorapub.sglang_patch.staging.EngineStaging``, inside the SGLang server and lorapub's double); nothing
here does I/O or reads a clock. See docs/design.md, "Engine-side staging".
"""

from lorapub.core.staging import machine, messages

__all__ = ["machine", "messages"]

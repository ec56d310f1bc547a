"""Engine-side staging of adapter versions: begin / bucket / end / cleanup / release, in the engine.
It runs inside the SGLang server process (lorapub's patch adds its routes) and inside lorapub's
contract double, one implementation for both, on the standard library, ``lorapub.core``,
``lorapub.wire`` and torch only: a pure state machine (:mod:`.machine`) that
:class:`EngineStaging` (:mod:`.engine`) drives, thin receivers, landings and the server glue.
See docs/design.md, "Engine-side staging".
"""

from __future__ import annotations

from lorapub.sglang_patch.staging.buffers import Buffer, close_all
from lorapub.sglang_patch.staging.claims import CLAIM_SUFFIX
from lorapub.sglang_patch.staging.engine import (
    DEFAULT_IDLE_S,
    IDLE_ENV,
    EngineHooks,
    EngineStaging,
    idle_timeout_setting,
    logger,
    managed_prefix_of,
)
from lorapub.sglang_patch.staging.server import (
    SGLangHooks,
    for_server,
    max_loaded_loras,
    starlette_json,
    starlette_receive,
)

__all__ = [
    "CLAIM_SUFFIX", "DEFAULT_IDLE_S", "IDLE_ENV", "Buffer", "EngineHooks", "EngineStaging", "SGLangHooks",
    "close_all", "for_server", "idle_timeout_setting", "logger", "managed_prefix_of", "max_loaded_loras",
    "starlette_json", "starlette_receive",
]

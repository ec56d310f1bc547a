"""Test aids for code that embeds lorapub, public and documented (as ``trio.testing`` is).

* :class:`SGLangDouble` — an in-process HTTP server that speaks SGLang 0.5.23's LoRA
  admin contract, running SGLang's own ``LoRARegistry`` (the installed SGLang's, or
  lorapub's verbatim copy of 0.5.23's), with the engine-side staging routes lorapub's
  patch adds (the same code); ``python -m lorapub.testing.serve_double`` runs one in a
  process of its own. :class:`SGLangUnderTest` puts lorapub's SGLang engine adapter on a
  fresh double, over any transport, for the conformance suite.
* fixture builders — :func:`lora_snapshot`, :func:`peft_lora_state_dict`,
  :func:`peft_config`, :func:`fake_manifest`, :func:`fake_plan`.
* :func:`check_engine_admin` — the conformance suite every
  :class:`~lorapub.ports.EngineAdmin` must pass.
* :class:`MemoryEngine` — an in-process engine with injectable faults (lost requests
  and replies, refusals, stalls, restarts) for fast model-based tests, and
  :class:`FaultyRegistry`, a registry wrapper that loses requests and replies.

Neither importing this package nor building a double needs SGLang or a GPU.
"""

from lorapub.testing.conformance import ConformanceFailure, EngineUnderTest, check_engine_admin
from lorapub.testing.fixtures import fake_manifest, fake_plan, lora_snapshot, peft_config, peft_lora_state_dict
from lorapub.testing.faults import FaultyRegistry
from lorapub.testing.memory_engine import MemoryEngine
from lorapub.testing.sglang_double import SGLangDouble, SGLangUnderTest

__all__ = [
    "ConformanceFailure", "EngineUnderTest", "FaultyRegistry", "MemoryEngine", "SGLangDouble", "SGLangUnderTest",
    "check_engine_admin", "fake_manifest", "fake_plan", "lora_snapshot", "peft_config",
    "peft_lora_state_dict",
]

"""Test aids for code that embeds lorapub, public and documented (as ``trio.testing`` is):
:class:`SGLangDouble` and :class:`SGLangUnderTest`, the conformance suite
:func:`check_engine_admin`, :class:`MemoryEngine` and :class:`FaultyRegistry` with their faults,
and fixture builders. Neither importing this package nor building a double needs SGLang or a GPU.
See docs/testing.md.
"""

from lorapub.testing.clock import ManualClock
from lorapub.testing.conformance import ConformanceFailure, EngineUnderTest, check_engine_admin
from lorapub.testing.fixtures import fake_manifest, fake_plan, lora_snapshot, peft_config, peft_lora_state_dict
from lorapub.testing.faults import FaultyRegistry
from lorapub.testing.memory_engine import MemoryEngine
from lorapub.testing.numeric import reference_probe
from lorapub.testing.sglang_double import SGLangDouble, SGLangUnderTest

__all__ = [
    "ConformanceFailure", "EngineUnderTest", "FaultyRegistry", "ManualClock", "MemoryEngine", "SGLangDouble",
    "SGLangUnderTest",
    "check_engine_admin", "fake_manifest", "fake_plan", "lora_snapshot", "peft_config",
    "peft_lora_state_dict", "reference_probe",
]


def __getattr__(name: str) -> object:
    if name == "SGLangWireUnderTest":  # merged into SGLangUnderTest, which runs the one engine adapter
        raise ImportError("SGLangWireUnderTest was merged into lorapub.testing.SGLangUnderTest: "
                          "SGLangUnderTest.start(disk, transport=...) (docs/embedding.md)", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The small public face: what ``from lorapub import *`` gives, and nothing by accident."""

from __future__ import annotations

import lorapub
import lorapub.testing

import lorapub.errors

PUBLIC = {
    "Deadlines", "Deployment", "OverwriteDeployment", "PublicationReport", "Session", "SessionKey", "Snapshot",
    "VersionKey", "WaitReport", "deploy",
} | {
    "AlreadyStarted", "BindingStale", "CapacityError", "EngineCapacityError", "EngineClosed", "EngineError",
    "EngineUnavailable", "EpochMismatch", "GroupClosed", "InvalidInput", "InvalidTransition", "LorapubError",
    "NoPublishedVersion", "NotReady", "NotReclaimable", "OutcomeUnknown", "PublicationBlocked", "PublicationFailed",
    "PublicationSuperseded", "SessionClosed", "SessionExpired", "StaleAttempt", "StoreCorrupted", "StoreError",
    "UnknownEngine", "UnknownVersion", "VersionConflict", "VersionMissing", "VersionReclaiming",
}

TESTING = {
    "ConformanceFailure", "EngineUnderTest", "FaultyRegistry", "MemoryEngine", "SGLangDouble", "SGLangUnderTest",
    "check_engine_admin", "fake_manifest", "fake_plan", "lora_snapshot", "peft_config",
    "peft_lora_state_dict",
}


def test_the_public_face_is_exactly_all():
    assert set(lorapub.__all__) == PUBLIC
    assert len(lorapub.__all__) == len(PUBLIC)
    namespace: dict = {}
    exec("from lorapub import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC


def test_the_readme_imports_work():
    from lorapub import Deployment, PublicationReport, Snapshot  # noqa: F401
    from lorapub.adapters.sglang_http import SGLangOverwriteAdmin  # noqa: F401
    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, SGLangWireEngine, SharedDir, TorchDistributed  # noqa: F401


def _error_classes() -> dict[str, type]:
    return {name: cls for name, cls in vars(lorapub.errors).items()
            if isinstance(cls, type) and issubclass(cls, lorapub.errors.LorapubError)}


def test_every_typed_error_is_importable_from_lorapub():
    errors = _error_classes()
    exported = {name for name in lorapub.__all__ if isinstance(getattr(lorapub, name), type)
                and issubclass(getattr(lorapub, name), lorapub.errors.LorapubError)}
    assert exported == set(errors), (set(errors) ^ exported)
    for name, cls in errors.items():
        assert getattr(lorapub, name) is cls


def test_errors_carry_stable_unique_codes():
    errors = _error_classes()
    codes = {cls.code: name for name, cls in errors.items()}
    assert len(codes) == len(errors), "two error classes share a code"
    for name, cls in errors.items():
        assert cls.code.isupper() and cls.__doc__, f"{name} needs an upper-case code and a docstring"
    # the codes framework adapters switch on never change
    assert {n: errors[n].code for n in ("CapacityError", "PublicationSuperseded", "BindingStale", "VersionMissing",
                                         "EngineCapacityError", "PublicationFailed", "OutcomeUnknown")} == {
        "CapacityError": "CAPACITY_ERROR", "PublicationSuperseded": "SUPERSEDED", "BindingStale": "BINDING_STALE",
        "VersionMissing": "VERSION_MISSING", "EngineCapacityError": "ENGINE_CAPACITY",
        "PublicationFailed": "PUBLICATION_FAILED", "OutcomeUnknown": "OUTCOME_UNKNOWN",
    }


def test_lorapub_testing_is_public_and_explicit():
    assert set(lorapub.testing.__all__) == TESTING
    for name in TESTING:
        assert getattr(lorapub.testing, name).__doc__, f"lorapub.testing.{name} is undocumented"

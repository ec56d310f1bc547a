"""The small public face: what ``from lorapub import *`` gives, and nothing by accident."""

from __future__ import annotations

import lorapub
import lorapub.testing

PUBLIC = {
    "CapacityError", "Deadlines", "Deployment", "EngineError", "LorapubError", "NoPublishedVersion",
    "OutcomeUnknown", "OverwriteDeployment", "PublicationBlocked", "PublicationFailed", "PublicationReport",
    "SessionClosed", "SessionKey", "Snapshot", "VersionConflict", "VersionKey", "VersionMissing",
    "VersionReclaiming", "deploy",
}

TESTING = {
    "ConformanceFailure", "EngineUnderTest", "FaultyRegistry", "MemoryEngine", "SGLangDouble", "SGLangUnderTest",
    "SGLangWireUnderTest", "check_engine_admin", "fake_manifest", "fake_plan", "lora_snapshot", "peft_config",
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
    from lorapub.adapters.sglang_http import SGLangEngine  # noqa: F401
    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, SGLangWireEngine, TorchDistributed  # noqa: F401


def test_errors_carry_stable_codes():
    codes = {name: getattr(lorapub, name).code for name in PUBLIC if name.endswith(("Error", "Conflict", "Missing",
             "Reclaiming", "Blocked", "Closed", "Unknown", "Version", "Failed"))}
    assert codes == {
        "CapacityError": "CAPACITY_ERROR", "EngineError": "ENGINE_ERROR", "LorapubError": "LORAPUB_ERROR",
        "NoPublishedVersion": "NO_PUBLISHED_VERSION", "OutcomeUnknown": "OUTCOME_UNKNOWN",
        "PublicationBlocked": "PUBLICATION_BLOCKED", "PublicationFailed": "PUBLICATION_FAILED",
        "SessionClosed": "SESSION_CLOSED", "VersionConflict": "VERSION_CONFLICT",
        "VersionMissing": "VERSION_MISSING", "VersionReclaiming": "VERSION_RECLAIMING",
    }


def test_lorapub_testing_is_public_and_explicit():
    assert set(lorapub.testing.__all__) == TESTING
    for name in TESTING:
        assert getattr(lorapub.testing, name).__doc__, f"lorapub.testing.{name} is undocumented"

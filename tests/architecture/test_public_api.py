"""The small public face: what ``from lorapub import *`` gives, and nothing by accident."""

from __future__ import annotations

import ast
import importlib
import pathlib

import lorapub
import lorapub.testing

import lorapub.errors

PUBLIC = {
    "AttemptToken", "Deadlines", "Deployment", "DeploymentSettings", "OverwriteDeployment", "PublicationReport", "Session", "SessionKey",
    "Snapshot", "VersionKey", "VersionState", "WaitReport", "deploy",
} | {
    "AlreadyStarted", "BindingStale", "CapacityError", "EngineCapacityError", "EngineClosed", "EngineError",
    "EngineUnavailable", "EpochMismatch", "GroupClosed", "InvalidInput", "InvalidTransition", "LorapubError",
    "NoPublishedVersion", "NotReady", "NotReclaimable", "OutcomeUnknown", "PublicationBlocked", "PublicationFailed",
    "PublicationSuperseded", "SessionClosed", "SessionExpired", "StaleAttempt", "StoreCorrupted", "StoreError",
    "UnknownEngine", "UnknownVersion", "VersionConflict", "VersionMissing", "VersionReclaiming",
    "DrainTimeout", "EngineNotDrained",
    "ProvenanceMismatch",
    "DeploymentClosed",
} | {
    "NumericMismatch", "Probe", "VersionSuspect",  # the numeric READY gate and the canary (docs/provenance.md)
}

TESTING = {
    "ConformanceFailure", "EngineUnderTest", "FaultyRegistry", "ManualClock", "MemoryEngine", "SGLangDouble", "SGLangUnderTest",
    "check_engine_admin", "fake_manifest", "fake_plan", "lora_snapshot", "peft_config",
    "peft_lora_state_dict",
} | {"reference_probe"}


def test_the_public_face_is_exactly_all():
    assert set(lorapub.__all__) == PUBLIC
    assert len(lorapub.__all__) == len(PUBLIC)
    namespace: dict = {}
    exec("from lorapub import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC


def test_the_readme_imports_work():
    from lorapub import Deployment, PublicationReport, Snapshot  # noqa: F401
    from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin  # noqa: F401
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


def test_the_port_and_report_types_are_importable_from_ports_and_lorapub():
    import lorapub.ports
    from lorapub.core.attempt import Phase, ReadyLocal
    from lorapub.core.effects import SendBegin
    from lorapub.core.identity import AttemptToken
    from lorapub.core.version import VersionState

    for cls in (ReadyLocal, SendBegin, AttemptToken, VersionState, Phase):
        assert getattr(lorapub.ports, cls.__name__) is cls and cls.__name__ in lorapub.ports.__all__
    assert lorapub.VersionState is VersionState and lorapub.AttemptToken is AttemptToken


# -- __all__ in every public module -----------------------------------------------------------------
SRC = pathlib.Path(lorapub.__file__).parent
PACKAGES = ("core", "wire", "runtime", "integrations", "adapters", "testing")  # not sglang_patch


def _public_modules() -> list[tuple[str, pathlib.Path]]:
    """errors, ports and every module of PACKAGES whose path has no part with a leading underscore."""
    found = [("lorapub.errors", SRC / "errors.py"), ("lorapub.ports", SRC / "ports.py")]
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            parts = path.relative_to(SRC).with_suffix("").parts
            if any(p.startswith("_") and p != "__init__" for p in parts):
                continue
            found.append((".".join(("lorapub", *(p for p in parts if p != "__init__"))), path))
    return found


def _declares_all(path: pathlib.Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_every_public_module_declares_all():
    modules = _public_modules()
    assert {"lorapub.core", "lorapub.core.registry", "lorapub.wire.codec", "lorapub.runtime.deployment",
            "lorapub.integrations.relax", "lorapub.adapters.sglang_wire", "lorapub.testing"} <= {m for m, _ in modules}
    missing = [name for name, path in modules if not _declares_all(path)]
    assert not missing, f"these public modules define no __all__: {missing}"


def test_every_name_in_all_exists():
    broken, unimportable = [], []
    for name, _ in _public_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # an optional dependency that is not installed here
            if e.name is None or e.name.split(".")[0] == "lorapub":
                raise
            unimportable.append(name)
            continue
        names = list(module.__all__)
        assert len(names) == len(set(names)), f"{name}.__all__ names something twice"
        broken += [f"{name}.{n}" for n in names if not hasattr(module, n)]
    assert not broken, f"__all__ names what the module lacks: {broken}"
    assert set(unimportable) <= {"lorapub.adapters.ray_registry"}, unimportable  # the one that imports ray at once

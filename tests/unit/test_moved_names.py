"""A public name that was removed fails with an error naming its replacement, never a bare
ImportError/TypeError, and an old hook that lorapub no longer reads is refused, not ignored."""

from __future__ import annotations

import importlib

import pytest

from lorapub import Deployment, InvalidInput
from lorapub.testing import MemoryEngine


@pytest.mark.parametrize("name, where", [
    ("SendBegin", "lorapub.ports"), ("ReadyLocal", "lorapub.ports"), ("VersionKey", "lorapub"),
    ("RegistryState", "lorapub.core.registry"), ("BucketPlan", "lorapub.core.manifest"),
    ("handle", "lorapub.core.registry"), ("Binding", "lorapub.core.session"),
])
def test_a_name_lorapub_core_re_exported_names_its_module(name, where):
    with pytest.raises(ImportError, match=f"from {where} import {name}"):
        exec(f"from lorapub.core import {name}", {})
    module = importlib.import_module(where)
    assert getattr(module, name) is not None  # the pointer is right
    from lorapub.core import registry  # a submodule still imports as a submodule
    assert registry.__name__ == "lorapub.core.registry"
    import lorapub.core
    assert not hasattr(lorapub.core, "NoSuchName")  # other names are plain AttributeErrors


def test_the_retired_engine_adapter_names_its_replacement():
    with pytest.raises(ImportError, match="SGLangWireEngine.*transport="):
        exec("from lorapub.adapters.sglang_http import SGLangEngine", {})
    with pytest.raises(ImportError, match="SGLangUnderTest"):
        exec("from lorapub.testing import SGLangWireUnderTest", {})


def test_the_overwrite_adapter_keeps_its_old_import_path():
    from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin

    with pytest.warns(DeprecationWarning, match="lorapub.adapters.sglang_overwrite"):
        from lorapub.adapters.sglang_http import SGLangOverwriteAdmin as old
    assert old is SGLangOverwriteAdmin


def test_the_merged_adapter_base_names_its_replacement():
    with pytest.raises(ImportError, match="sglang_wire.SGLangWireEngine"):
        exec("from lorapub.adapters.sglang_http import SGLangAdminBase", {})


def test_deployment_stash_dir_names_its_replacement():
    with pytest.raises(InvalidInput, match="stash_dir.*transport=") as e:
        Deployment({"e0": MemoryEngine("e0")}, epoch=1, stash_dir="/tmp/x")
    assert e.value.code == "INVALID_INPUT"
    with pytest.raises(TypeError):  # any other unknown keyword is Python's own error, as before
        Deployment({"e0": MemoryEngine("e0")}, epoch=1, no_such_option=1)


async def test_an_engine_with_the_old_bucket_source_hook_is_refused_not_ignored():
    engine = MemoryEngine("e0")
    engine.bucket_source_factory = lambda snapshot, plan: None  # the per-engine hook lorapub read before
    with pytest.raises(InvalidInput, match="bucket_source_factory.*Transport"):
        await Deployment({"e0": engine}, epoch=1).start()


async def test_a_transport_with_the_old_stateless_flag_is_warned_about():
    from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine

    class Mine(HTTPBytes):
        stateless = True  # read before: equality is the transport's own __eq__ now

    engine = SGLangWireEngine("e0", "http://127.0.0.1:9")
    with pytest.warns(DeprecationWarning, match="stateless.*__eq__"):
        with pytest.raises(Exception):
            await Deployment({"e0": engine}, epoch=1, transport=Mine(), deadlines=None).start()
    await engine.close()


def test_the_keyword_check_keeps_deployments_signature():
    """Integrations read Deployment's options from its signature (the Relax one does)."""
    import inspect

    parameters = inspect.signature(Deployment).parameters
    assert {"epoch", "name_prefix", "transport", "capacity"} <= set(parameters) and "stash_dir" not in parameters


def test_the_relax_frozen_copies_wrapper_names_the_deployments_copy_store():
    with pytest.raises(ImportError, match=r"Deployment\(copies=\.\.\.\)"):
        exec("from lorapub.integrations.relax.copies import SharedFrozenCopies", {})


@pytest.mark.parametrize("name", ["STATE_ROUTE", "RECLAIM_HEADER", "MANAGED_PREFIX_ENV"])
def test_the_protocols_names_moved_from_the_core_to_wire(name):
    """The route, header and environment variable names are the staging protocol's (lorapub.wire.routes):
    the old import is an error naming the new one."""
    from lorapub.wire import routes

    with pytest.raises(ImportError, match=f"from lorapub.wire.routes import {name}"):
        exec(f"from lorapub.core.identity import {name}", {})
    assert isinstance(getattr(routes, name), str)
    import lorapub.core.identity as identity
    assert name not in identity.__all__
    with pytest.raises(AttributeError):
        identity.NO_SUCH_NAME  # noqa: B018 - other names are plain AttributeErrors


@pytest.mark.parametrize("old, name, where", [
    ("lorapub.runtime.registry", "LocalRegistry", "lorapub.local_registry"),
    ("lorapub.runtime.registry", "MemoryStore", "lorapub.local_registry"),
    ("lorapub.runtime.clock", "SystemClock", "lorapub.clock"),
    ("lorapub.runtime.clock", "RegistryClock", "lorapub.clock"),
    ("lorapub.runtime.clock", "Elapsed", "lorapub.clock"),
    ("lorapub.runtime.admission", "check_epoch", "lorapub.core.identity"),
])
def test_the_registry_and_its_clock_moved_beneath_the_runtime(old, name, where):
    """The in-process registry and what it needs moved beside the ports (an adapter runs it): the old
    path is no second way, but an error naming the new one."""
    with pytest.raises(ImportError, match=f"{old}.{name} moved: use `from {where} import {name}`"):
        exec(f"from {old} import {name}", {})
    assert getattr(importlib.import_module(where), name) is not None  # the pointer is right
    with pytest.raises(AttributeError):
        importlib.import_module(old).NO_SUCH_NAME  # noqa: B018 - other names are plain AttributeErrors

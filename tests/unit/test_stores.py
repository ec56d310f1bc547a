from lorapub.core.identity import SessionKey, VersionKey
from lorapub.runtime.registry import RegistryService
from lorapub.runtime.stores import FileStore
from tests.unit.test_core_rows import E, EP, publish


def test_file_store_survives_a_registry_restart(tmp_path):
    path = str(tmp_path / "registry.pickle")
    first = RegistryService(EP, E, store=FileStore(path))
    state, token = publish(first.state, "A")
    first._state = state
    first._store.save(state)
    first.bind_first(SessionKey(EP, "s", "n"))
    receipt = state.versions[VersionKey(EP, "A")].commit
    # the process dies; a new one loads what the last transition stored
    again = RegistryService(EP, {"ignored": "x"}, store=FileStore(path))
    assert again.state.engines == state.engines
    assert again.commit(VersionKey(EP, "A"), token, 0).reply == receipt  # replay after restart
    assert again.bind_first(SessionKey(EP, "s", "n")).reply.version == VersionKey(EP, "A")
    assert again.state.versions[VersionKey(EP, "A")].session_refs == 1


def test_file_store_writes_atomically(tmp_path):
    store = FileStore(str(tmp_path / "s.pickle"))
    assert store.load() is None
    store.save({"a": 1})
    store.save({"a": 2})
    assert store.load() == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.pickle"]

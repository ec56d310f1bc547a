from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.registry import BindFirst, Commit
from lorapub.runtime.registry import LocalRegistry
from lorapub.runtime.stores import FileStore
from tests.unit.test_core_rows import E, EP, publish


def test_file_store_survives_a_registry_restart(tmp_path):
    path = str(tmp_path / "registry.pickle")
    first = LocalRegistry(EP, E, store=FileStore(path))
    state, token = publish(first.state, "A")
    first._state = state
    first._store.save(state)
    first.apply(BindFirst(SessionKey(EP, "s", "n")))
    receipt = state.versions[VersionKey(EP, "A")].commit
    # the process dies; a new one loads what the last transition stored
    again = LocalRegistry(EP, {"ignored": "x"}, store=FileStore(path))
    assert again.state.engines == state.engines
    assert again.apply(Commit(VersionKey(EP, "A"), token, 0)).reply == receipt  # replay after restart
    assert again.apply(BindFirst(SessionKey(EP, "s", "n"))).reply.version == VersionKey(EP, "A")
    assert again.state.versions[VersionKey(EP, "A")].session_refs == 1


def test_file_store_writes_atomically(tmp_path):
    store = FileStore(str(tmp_path / "s.pickle"))
    assert store.load() is None
    store.save({"a": 1})
    store.save({"a": 2})
    assert store.load() == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.pickle"]

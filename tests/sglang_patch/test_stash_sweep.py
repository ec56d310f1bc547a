"""Stash folders of ended server lives: a server killed without its shutdown (no ``close()``)
leaves its stash folder behind; the next life on the same host frees it, and never a folder
of a life still running or of another host sharing the root."""

from __future__ import annotations

import os

from lorapub.sglang_patch import staging as es
from lorapub.sglang_patch.staging import claims


def staging(root, life: str) -> es.EngineStaging:
    return es.EngineStaging(hooks=None, incarnation=life, stash_root=str(root))


def leave_data(s: es.EngineStaging) -> str:
    os.makedirs(os.path.join(s.stash_root, "1-v1-a1", "adapter"), exist_ok=True)
    path = os.path.join(s.stash_root, "1-v1-a1", "adapter", "adapter_model.safetensors")
    with open(path, "wb") as f:
        f.write(b"x" * 1024)
    return path


def die(s: es.EngineStaging) -> None:
    """The process is gone: the kernel drops its lock (its descriptor closes); nothing else happens."""
    s._claim()
    s._claim = None
    claims.LIVE_ROOTS.discard(s.stash_root)  # another process's life, as far as the next one can tell


def test_a_closed_life_leaves_nothing(tmp_path):
    s = staging(tmp_path, "life-a")
    leave_data(s)
    s.close()
    assert os.listdir(tmp_path) == []


def test_the_next_life_frees_the_folder_of_a_life_that_died(tmp_path):
    dead = staging(tmp_path, "life-a")
    leave_data(dead)
    die(dead)
    nxt = staging(tmp_path, "life-b")
    assert sorted(os.listdir(tmp_path)) == ["life-b.claim"]
    nxt.close()
    assert os.listdir(tmp_path) == []


def test_a_running_life_another_hosts_life_and_an_unclaimed_folder_are_left_alone(tmp_path):
    running = staging(tmp_path, "life-a")
    kept = leave_data(running)
    elsewhere = tmp_path / "life-x"  # a life of another machine sharing this root, its lock not held here
    elsewhere.mkdir()
    (tmp_path / "life-x.claim").write_text("lorapub-claim v1\nboot 00000000-another-machine\n")
    unclaimed = tmp_path / "life-old"  # made before lives claimed their folders
    unclaimed.mkdir()
    nxt = staging(tmp_path, "life-b")
    assert os.path.exists(kept) and elsewhere.is_dir() and unclaimed.is_dir()
    assert sorted(os.listdir(tmp_path)) == ["life-a", "life-a.claim", "life-b.claim", "life-old", "life-x",
                                            "life-x.claim"]
    running.close()
    nxt.close()
    assert sorted(os.listdir(tmp_path)) == ["life-old", "life-x", "life-x.claim"]


def test_a_claim_still_being_made_is_never_locked_nor_swept(tmp_path):
    """Between creating its claim and locking it, a new life's claim is empty: a sweep meanwhile
    must leave it (and its folder) alone, or the new life would run unclaimed."""
    (tmp_path / "life-new").mkdir()
    (tmp_path / "life-new.claim").write_bytes(b"")
    s = staging(tmp_path, "life-b")
    assert (tmp_path / "life-new").is_dir() and (tmp_path / "life-new.claim").exists()
    s.close()


def test_a_forked_child_that_exits_does_not_free_its_parents_stash(tmp_path):
    s = staging(tmp_path, "life-a")
    kept = leave_data(s)
    pid = os.fork()
    if pid == 0:  # the child: what its atexit would run
        try:
            s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(kept) and os.path.exists(s.stash_root + es.CLAIM_SUFFIX)
    s.close()
    assert os.listdir(tmp_path) == []


def test_a_staging_never_closed_lets_its_claim_go_when_it_is_collected(tmp_path):
    import gc

    s = staging(tmp_path, "life-a")
    leave_data(s)
    claims.LIVE_ROOTS.discard(s.stash_root)  # as if its process had gone: only the lock can tell
    del s
    gc.collect()
    nxt = staging(tmp_path, "life-b")  # the collected life's lock is free: its folder is swept
    assert sorted(os.listdir(tmp_path)) == ["life-b.claim"]
    nxt.close()

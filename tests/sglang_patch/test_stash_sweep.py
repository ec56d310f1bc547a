"""Stash folders of ended server lives: a server killed without its shutdown (no ``close()``)
leaves its stash folder behind; the next life on the same host frees it, and never a folder
of a life still running or of another host sharing the root."""

from __future__ import annotations

import os

from lorapub.sglang_patch import engine_staging as es


def staging(root, life: str) -> es.EngineStaging:
    return es.EngineStaging(hooks=None, incarnation=life, stash_root=str(root))


def leave_data(s: es.EngineStaging) -> str:
    os.makedirs(os.path.join(s.stash_root, "1-v1-a1", "adapter"), exist_ok=True)
    path = os.path.join(s.stash_root, "1-v1-a1", "adapter", "adapter_model.safetensors")
    with open(path, "wb") as f:
        f.write(b"x" * 1024)
    return path


def die(s: es.EngineStaging) -> None:
    """The process is gone: the kernel drops its lock; nothing else happens."""
    os.close(s._claim)
    s._claim = None


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
    elsewhere = tmp_path / "life-x"  # a life of another host sharing this root, its lock not held here
    elsewhere.mkdir()
    (tmp_path / "life-x.claim").write_text("another-host")
    unclaimed = tmp_path / "life-old"  # made before lives claimed their folders
    unclaimed.mkdir()
    nxt = staging(tmp_path, "life-b")
    assert os.path.exists(kept) and elsewhere.is_dir() and unclaimed.is_dir()
    assert sorted(os.listdir(tmp_path)) == ["life-a", "life-a.claim", "life-b.claim", "life-old", "life-x",
                                            "life-x.claim"]
    running.close()
    nxt.close()
    assert sorted(os.listdir(tmp_path)) == ["life-old", "life-x", "life-x.claim"]

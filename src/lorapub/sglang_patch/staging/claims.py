"""Stash folders and their claims: which server life owns a stash folder (a claim file locked with
``flock`` while that life's process runs, naming the running kernel by its boot id), and freeing
those of lives on the same host that ended without their shutdown.
See docs/design.md, "Known limits of this version".
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref
from typing import Any

from lorapub.sglang_patch.staging.buffers import NOFOLLOW
from lorapub.wire.collective import running_kernel

__all__ = ["CLAIM_SUFFIX", "LIVE_ROOTS", "claim_tag", "release_claim", "sweep_ended_lives", "take_claim"]

#: Beside each life's stash folder, its claim: a file locked (flock) while that life's process runs,
#: naming the running kernel (its boot id) whose locks make the claim mean anything.
CLAIM_SUFFIX = ".claim"
#: Stash folders claimed by lives of this process (locks over some network filesystems do not
#: exclude one process from itself).
LIVE_ROOTS: set[str] = set()
logger = logging.getLogger("lorapub.sglang_patch.staging")


def claim_tag() -> str:
    """Which lives' locks this process can read: those of the same running kernel."""
    return f"lorapub-claim v1\n{running_kernel()}\n"


def take_claim(owner: Any, root: str, stash_root: str, tag: str) -> weakref.finalize[[int], None] | None:
    """Claim the stash folder ``stash_root`` (under ``root``) for ``owner``'s life: its claim file,
    locked as long as this process runs and naming the running kernel. Answers what closes the
    claim's descriptor (its lock goes with it; also when ``owner`` is collected unclosed), or None
    where it cannot claim (then nothing is swept either)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no claim, nothing swept
        return None
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(stash_root + CLAIM_SUFFIX, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    except OSError as e:
        logger.warning("lorapub: cannot claim the stash folder %s (%s); earlier lives are not swept", stash_root, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        logger.warning("lorapub: the stash folder %s is claimed by a running process (%s)", stash_root, e)
        return None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, tag.encode())
    except OSError as e:  # claimed, but no sweeper will ever recognise it: freed at close only
        logger.warning("lorapub: cannot write the claim of %s (%s)", stash_root, e)
    LIVE_ROOTS.add(stash_root)
    return weakref.finalize(owner, os.close, fd)


def release_claim(stash_root: str, claim: weakref.finalize[[int], None]) -> None:
    """The life is over: its claim file goes, then its lock (the descriptor closes)."""
    try:
        os.unlink(stash_root + CLAIM_SUFFIX)
    except OSError:
        pass
    claim()
    LIVE_ROOTS.discard(stash_root)


def sweep_ended_lives(root: str, tag: str) -> None:
    """Remove the stash folders of earlier lives under this running kernel whose process is gone
    (their lock is free): a server killed without its shutdown leaves a folder the next life on
    the machine frees. A folder whose claim names another kernel (another machine sharing the
    root, or this one before a reboot), is not complete yet, or has no claim is left alone; so is
    every stash root this process itself holds."""
    import fcntl

    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        claim = os.path.join(root, name)
        folder = claim[: -len(CLAIM_SUFFIX)]
        if not name.endswith(CLAIM_SUFFIX) or folder in LIVE_ROOTS:
            continue
        try:
            other = os.open(claim, os.O_RDWR | NOFOLLOW)
        except OSError:
            continue
        try:
            # Read before locking: a claim still being made (empty) or another machine's is
            # never locked here, so its owner's own lock cannot lose to this sweep.
            if os.pread(other, 4096, 0).decode(errors="replace") != tag:
                continue
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused: that life still runs
            shutil.rmtree(folder, ignore_errors=True)
            os.unlink(claim)
            logger.info("lorapub: freed the stash folder of an ended life: %s", folder)
        except OSError:
            continue
        finally:
            os.close(other)

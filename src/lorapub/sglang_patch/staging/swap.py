"""TEST-ONLY: a staging that serves a new version with the previous version's weights under the new
name (``LORAPUB_TEST_SWAP_WEIGHTS=1``), recording the digest it really loaded. Provenance stamps must
catch it on the first turn. Never set it outside tests. See docs/provenance.md, "Stamp".
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import attrs

__all__ = ["SWAP_ENV", "Kept", "dir_load", "enabled", "tensor_load"]

SWAP_ENV = "LORAPUB_TEST_SWAP_WEIGHTS"


def enabled() -> bool:
    return os.environ.get(SWAP_ENV, "") not in ("", "0")


@attrs.frozen
class Kept:
    """The last version's weights, kept to be served under the next version's name."""

    digest: str
    folder: str | None = None
    tensors: Any = None


def dir_load(kept: Kept | None, path: str, digest: str, stash_root: str) -> tuple[str, str, Kept]:
    """(folder to load, digest it holds, what to keep for the next load)."""
    copy = os.path.join(stash_root, f"swap-{digest[:16]}")
    if not os.path.exists(copy):
        shutil.copytree(path, copy)
    if kept is not None and kept.folder is not None and kept.digest != digest and os.path.isdir(kept.folder):
        return kept.folder, kept.digest, Kept(digest, copy)
    return path, digest, Kept(digest, copy)


def tensor_load(kept: Kept | None, load: tuple[Any, Any, Any], digest: str) -> tuple[tuple[Any, Any, Any], str, Kept]:
    """((tensors, config, checksums) to load, digest they hold, what to keep for the next load)."""
    tensors, config, checksums = load
    mine = Kept(digest, tensors=({k: v.clone() for k, v in tensors.items()}, config, checksums))
    if kept is not None and kept.tensors is not None and kept.digest != digest:
        return kept.tensors, kept.digest, mine
    return load, digest, mine

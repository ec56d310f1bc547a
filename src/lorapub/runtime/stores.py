"""Registry stores: where the single writer keeps its state between calls.

``MemoryStore`` (in registry_service) is the default. ``FileStore`` makes every
transition durable before its reply leaves, so a registry that restarts (a Ray
actor with ``max_restarts``) resumes with the same versions, refs and
tombstones instead of forgetting what engines hold.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any


class FileStore:
    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def load(self) -> Any | None:
        try:
            with open(self.path, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return None

    def save(self, state: Any) -> None:
        # write-then-rename: a crash leaves either the old state or the new one, never half
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".registry-")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

"""Identities of versions, attempts and sessions. Pure values, hashable, ordered.

The protocol's route, header and environment variable names are in :mod:`lorapub.wire.routes`.
"""

from __future__ import annotations

import re
from typing import TypeGuard

import attrs

from lorapub._moved import moved
from lorapub.errors import InvalidInput

__all__ = [
    "LORA_NAME_PREFIX", "MANAGED_PREFIX", "DIGEST_PREFIX_LEN",
    "check_id", "check_epoch", "check_digest", "VersionKey", "check_name_prefix", "lora_name_for", "is_managed_name",
    "epoch_of_name", "AttemptToken", "new_nonce", "born_of", "SessionKey",
]

LORA_NAME_PREFIX = "relax_policy_lora"
#: The default start of every managed adapter name (a deployment may name its own, see
#: :func:`check_name_prefix`); the SGLang patch protects the names that start with the prefix it is
#: launched with (``lorapub.wire.routes.MANAGED_PREFIX_ENV``, this by default).
MANAGED_PREFIX = LORA_NAME_PREFIX + "@"
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}@")
DIGEST_PREFIX_LEN = 12
# Matched with ``fullmatch``: ``$`` would also match before a trailing newline.
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def check_id(kind: str, value: object) -> str:
    """``value`` if it is 1-128 characters of ``[A-Za-z0-9_.:-]`` (no separator, no newline), else
    :class:`InvalidInput`. Ids checked here are safe in engine names and in file names."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise InvalidInput(
            f"{kind} must be 1-128 characters of [A-Za-z0-9_.:-], got {value!r}"
        )
    return value



def _is_epoch(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_epoch(value: object) -> None:
    if not _is_epoch(value):
        raise InvalidInput(f"deployment_epoch must be a non-negative int, got {value!r}")


def check_epoch(epoch: object) -> int:
    """A deployment's ``epoch=`` (its keys' ``deployment_epoch``): an int >= 0, and the message says
    what it is for (a run id string is the usual mistake)."""
    if not _is_epoch(epoch):
        raise InvalidInput(
            f"epoch= must be an int >= 0 that grows with each trainer run, got {epoch!r} ({type(epoch).__name__}): "
            "it numbers this run's versions (e.g. 7-step41) and a newer run's adapters are never touched by an "
            "older one's; pass the run's number, or int(time.time()) taken once at its start"
        )
    return epoch


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidInput(f"digest must be a full lowercase SHA-256 hex string, got {digest!r}")
    return digest


@attrs.frozen(order=True)
class VersionKey:
    """``(deployment_epoch, version_id)``: fixed before the first reserve, never reused."""

    deployment_epoch: int
    version_id: str

    def __attrs_post_init__(self) -> None:
        _check_epoch(self.deployment_epoch)
        check_id("version_id", self.version_id)

    def __str__(self) -> str:
        return f"{self.deployment_epoch}-{self.version_id}"


def check_name_prefix(prefix: object) -> str:
    """``prefix`` if it is 1-64 characters of ``[A-Za-z0-9_.:-]`` then ``@`` (ids hold no ``@``, so
    no version id can make a name that looks like another prefix's), else :class:`InvalidInput`."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise InvalidInput(f"name_prefix must be 1-64 characters of [A-Za-z0-9_.:-] followed by '@', got {prefix!r}")
    return prefix


def lora_name_for(key: VersionKey, digest: str, prefix: str = MANAGED_PREFIX) -> str:
    """The immutable engine-side name; the digest prefix is for humans, the full digest is compared."""
    check_digest(digest)
    return f"{prefix}{key.deployment_epoch}-{key.version_id}-{digest[:DIGEST_PREFIX_LEN]}"


def is_managed_name(name: str, prefix: str = MANAGED_PREFIX) -> bool:
    return name.startswith(prefix)


def epoch_of_name(name: str, prefix: str = MANAGED_PREFIX) -> int | None:
    """The deployment epoch a managed adapter name was made in (None: not a name of ``prefix``)."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


@attrs.frozen(order=True)
class AttemptToken:
    """One publication attempt of one version. ``seq`` comes from the registry's counter."""

    version: VersionKey
    seq: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.version, VersionKey):
            raise InvalidInput(f"an attempt token's version is a VersionKey, got {self.version!r}")
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or self.seq < 0:
            raise InvalidInput(f"an attempt token's seq is a non-negative int, got {self.seq!r}")

    def __str__(self) -> str:
        return f"{self.version}#a{self.seq}"


_BORN_RE = re.compile(r"b([0-9]{1,12})-[0-9a-f]{6,32}")


def new_nonce(now: float, entropy: str) -> str:
    """A session nonce that carries its birth time, so the registry can forget the session's
    tombstone after its window and still refuse late messages for it."""
    return f"b{int(now)}-{entropy}"


def born_of(nonce: str) -> int | None:
    """The birth time a :func:`new_nonce` nonce carries; None for a nonce of the caller's own."""
    m = _BORN_RE.fullmatch(nonce)
    return int(m.group(1)) if m else None


@attrs.frozen(order=True)
class SessionKey:
    """A session lifecycle: the nonce separates two lifecycles that reuse one session id."""

    deployment_epoch: int
    session_id: str
    nonce: str

    def __attrs_post_init__(self) -> None:
        _check_epoch(self.deployment_epoch)
        check_id("session_id", self.session_id)
        check_id("nonce", self.nonce)

    @property
    def born(self) -> int | None:
        """When the lifecycle began (wall-clock seconds), for nonces made by :func:`new_nonce`;
        None for a nonce of the caller's own (its tombstone is then kept for the epoch)."""
        return born_of(self.nonce)

    def __str__(self) -> str:
        return f"{self.deployment_epoch}/{self.session_id}/{self.nonce}"


#: Names that moved to the staging protocol (``lorapub.wire.routes``), where both sides of it read them.
_MOVED = {"MANAGED_PREFIX_ENV": "lorapub.wire.routes", "RECLAIM_HEADER": "lorapub.wire.routes",
          "STATE_ROUTE": "lorapub.wire.routes"}


#: A moved name is an error naming its new module (the core never imports ``lorapub.wire``).
__getattr__ = moved(__name__, _MOVED)

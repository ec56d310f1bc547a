"""The staging machine's messages as values: the commands it takes, the replies it gives and the
effects it asks for (:mod:`lorapub.core.staging.machine` is the machine itself).

A command marked *locked* is sent by the operation holding the attempt's lock; an *admission*
counts the operation as driving the attempt until its ``Leave``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from lorapub.core.identity import AttemptToken

__all__ = [
    "Abandon",
    "Accepted",
    "Aged",
    "Arrive",
    "Begin",
    "Cleaned",
    "Cleanup",
    "Close",
    "CloseBuffer",
    "Collect",
    "CollectFailed",
    "Discard",
    "DropGroup",
    "Effect",
    "End",
    "Finish",
    "Forget",
    "Free",
    "Freed",
    "Join",
    "JoinGroup",
    "Kept",
    "Leave",
    "Load",
    "LoadFailed",
    "Loaded",
    "Lost",
    "PrepareFolder",
    "Proceed",
    "Receipt",
    "Receipted",
    "Receive",
    "ReceiveBytes",
    "Refusal",
    "Release",
    "ReleaseBytes",
    "Releasing",
    "Stored",
    "Sweep",
    "Verify",
    "Wait",
    "invalid",
    "refusal",
]

# -- values -------------------------------------------------------------------------------------------
@attrs.frozen
class Refusal:
    """A definite no: the HTTP status and stable code the caller gets (raised on the wire as
    ``lorapub.wire.refusal.Refused``, whose ``to_json`` is the refusal's body)."""

    status: int
    code: str
    message: str


def refusal(message: str, code: str = "STAGE_REFUSED", status: int = 409) -> Refusal:
    return Refusal(status, code, message)


def invalid(message: str) -> Refusal:
    return Refusal(400, "STAGE_INVALID", message)


@attrs.frozen
class Receipt:
    """What an end loaded: answered by the end, and by a cleanup as what it must unload (its JSON:
    ``lorapub.wire.messages.receipt_to_json``). ``verify_wait``: the seconds the end waited for the last
    SHA-256 checks; ``load_s``: the engine's load."""

    incarnation: str
    lora_name: str
    digest: str
    lora_id: Any
    lora_path: Any
    load: str
    verify_wait: float = 0.0
    load_s: float = 0.0


# -- replies ------------------------------------------------------------------------------------------
@attrs.frozen
class Accepted:
    """Begun, or a bucket stored; ``duplicate``: it was already (nothing was done twice)."""

    duplicate: bool


@attrs.frozen
class Proceed:
    """Admitted: go on (run the effects that came with it)."""


@attrs.frozen
class Join:
    """A collective for this bucket runs: wait for its outcome and answer it as a duplicate."""


@attrs.frozen
class Receipted:
    receipt: Receipt
    duplicate: bool


@attrs.frozen
class Wait:
    """The attempt is staged: wait for its lock (an operation on it may run), then ``Discard``."""


@attrs.frozen
class Cleaned:
    loaded: Receipt | None


@attrs.frozen
class Releasing:
    tokens: tuple[AttemptToken, ...]


@attrs.frozen
class Freed:
    token: AttemptToken


@attrs.frozen
class Kept:
    """The attempt loaded the name again while the release waited: kept (what it loaded was answered,
    or its cleanup will answer it)."""

    token: AttemptToken


@attrs.frozen
class Aged:
    token: AttemptToken
    lora_name: str
    idle: float
    loaded: bool


# -- effects ------------------------------------------------------------------------------------------
@attrs.frozen
class PrepareFolder:
    """A dir load: the adapter's folder and its safetensors file, sized for the plan."""

    token: AttemptToken


@attrs.frozen
class JoinGroup:
    """The torch transport: connect to the attempt's group store in the background."""

    token: AttemptToken


@attrs.frozen
class ReceiveBytes:
    token: AttemptToken
    index: int
    fmt: str


@attrs.frozen
class Collect:
    """Receive the bucket through the attempt's collective (outside its lock)."""

    token: AttemptToken
    index: int


@attrs.frozen
class Verify:
    """Keep the landed bucket and check its SHA-256s beside the next bucket's transfer."""

    token: AttemptToken
    index: int


@attrs.frozen
class CloseBuffer:
    """Bytes that landed for an attempt cleaned up meanwhile: closed, kept nowhere."""

    token: AttemptToken
    index: int


@attrs.frozen
class Load:
    """Wait for every check, then load the adapter pinned through the engine."""

    token: AttemptToken


@attrs.frozen
class ReleaseBytes:
    """The engine holds the adapter now: the staged bytes go (checks cancelled, buffers closed)."""

    token: AttemptToken


@attrs.frozen
class DropGroup:
    """Leave the attempt's group; with ``abort``, tell every party to stop waiting first."""

    token: AttemptToken
    abort: str | None


@attrs.frozen
class Free:
    """The attempt is gone: its bytes, its group (``abort`` as in :class:`DropGroup`) and its folder."""

    token: AttemptToken
    abort: str | None


Effect = (PrepareFolder | JoinGroup | ReceiveBytes | Collect | Verify | CloseBuffer | Load | ReleaseBytes | DropGroup
          | Free)

# -- commands ----------------------------------------------------------------------------------------
@attrs.frozen
class Begin:
    """``problem``: the first thing wrong with the request itself (checked after the tombstone, the
    life and a duplicate); ``late_problem``: what only a new attempt meets (checked after capacity:
    a dtype its folder cannot store, a torch transport's parameters). ``loaded``: the engine's adapter
    names now; ``slot_limit``: its ``max_loaded_loras``."""

    token: AttemptToken
    incarnation: Any
    digest: Any
    lora_name: Any = None
    sizes: tuple[int, ...] = ()
    load: str = "dir"
    transport: str = "http"
    problem: Refusal | None = None
    late_problem: Refusal | None = None
    loaded: frozenset[str] = frozenset()
    slot_limit: Any = None
    now: float = 0.0


@attrs.frozen
class Abandon:
    """A begun attempt's setup failed (its folder could not be written): freed, not tombstoned."""

    token: AttemptToken


@attrs.frozen
class Receive:
    """Admission of a bucket; ``problem``: its index or format is malformed."""

    token: AttemptToken
    incarnation: Any
    problem: Refusal | None = None
    now: float = 0.0


@attrs.frozen
class Arrive:
    """*Locked*: bucket ``index`` in ``fmt``; ``length``: the body's Content-Length (None: unknown)."""

    token: AttemptToken
    index: int
    fmt: str
    length: int | None = None
    now: float = 0.0


@attrs.frozen
class Stored:
    token: AttemptToken
    index: int
    nbytes: int
    now: float = 0.0


@attrs.frozen
class Lost:
    """The bucket's bytes did not arrive (a malformed body, a disk or shared-memory error)."""

    token: AttemptToken
    index: int
    now: float = 0.0


@attrs.frozen
class CollectFailed:
    """The collective failed: the attempt fails here for good."""

    token: AttemptToken
    index: int
    reason: str
    now: float = 0.0


@attrs.frozen
class End:
    token: AttemptToken
    incarnation: Any
    now: float = 0.0


@attrs.frozen
class Finish:
    """*Locked*: the end checks every bucket arrived; then its load runs."""

    token: AttemptToken
    now: float = 0.0


@attrs.frozen
class Loaded:
    token: AttemptToken
    receipt: Receipt


@attrs.frozen
class LoadFailed:
    """The load did not happen: ``fails`` (a bucket did not verify) fails the attempt for good;
    else every bucket stays held and a later end may load again."""

    token: AttemptToken
    refusal: Refusal | None = None
    fails: bool = False


@attrs.frozen
class Cleanup:
    token: AttemptToken
    now: float = 0.0


@attrs.frozen
class Discard:
    """*Locked*: the cleanup frees the attempt and answers what it loaded."""

    token: AttemptToken


@attrs.frozen
class Release:
    """After ``lora_name`` was unloaded (``loaded``: it is registered still)."""

    lora_name: str
    loaded: bool
    now: float = 0.0


@attrs.frozen
class Forget:
    """*Locked*: the release frees and tombstones one attempt of the name, unless its end loaded the
    adapter registered under the name now (``adapters``: registered name -> lora_id, read under the
    lock; None: unknown, so it may have)."""

    token: AttemptToken
    adapters: Mapping[str, Any] | None = None


@attrs.frozen
class Leave:
    """An operation on the attempt ended (its idle time starts again)."""

    token: AttemptToken
    now: float = 0.0


@attrs.frozen
class Sweep:
    """Age out what nobody drove for ``idle_timeout``. ``adapters``: registered name -> lora_id
    (None: unknown, so every loaded attempt is kept)."""

    now: float
    adapters: Mapping[str, Any] | None = None


@attrs.frozen
class Close:
    """The server life ends: every attempt is freed."""

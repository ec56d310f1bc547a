"""A deployment's status, as one plain value: every version with its state, lag, refs and what blocks
its reclaim by name; every engine with what it holds against what it should; attempts in flight;
health. Built from the registry's fleet view and the engines' inventories, or from a store alone.
See docs/operating.md, "Status".
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any, Mapping

import attrs

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.registry import Fleet, SessionsOf
from lorapub.core.version import VersionState
from lorapub.errors import InvalidInput
from lorapub.health import Health
from lorapub.ports import Inventory

__all__ = ["Status", "VersionStatus", "EngineStatus", "AttemptView", "LocalSession", "build_status", "check_bind", "holders"]

SCHEMA = 1  # bumped when a field changes meaning; added fields keep it


@attrs.frozen
class VersionStatus:
    version: str
    state: str
    lag: int | None  # commits behind the default
    session_refs: int
    retiring: bool
    default: bool
    loaded_on: Mapping[str, int]  # engine -> requests running on it there (native refs)
    blocked_by: tuple[str, ...]  # why it is not reclaimed yet, by name (empty: nothing holds it)
    suspect: str | None = None  # the canary saw an engine drift from its probe (why); None: not suspect


@attrs.frozen
class EngineStatus:
    name: str
    incarnation: str | None  # as the registry knows it
    seen: str | None  # as the engine said it (None: not asked, or no answer)
    answered: bool | None  # None: not asked (a status read from a store)
    holds: tuple[str, ...]  # versions of this deployment it holds
    should_hold: tuple[str, ...]
    running_requests: int
    last_error: str | None
    #: False: the engine lists nothing it holds (its adapter has no ``inventory()``): ``holds`` and
    #: ``running_requests`` are unknown, not empty
    reports_holdings: bool = True


@attrs.frozen
class AttemptView:
    token: str
    version: str
    phase: str
    bucket: int  # the bucket being sent (every earlier one is on every target)
    still_s: float | None  # seconds since it last moved, as this process saw it (None: not known)


@attrs.frozen
class LocalSession:
    """A session of this process: what the registry cannot know (its idle time)."""

    session: str
    version: str | None
    state: str
    idle_s: float
    group: str | None


@attrs.frozen
class Status:
    epoch: int
    at: float  # wall-clock time it was taken
    source: str  # "deployment" or "store <path>"
    default: str | None
    default_revision: int
    capacity: int
    slots_used: int
    max_lag: int | None
    healthy: bool | None  # None: no reconciler ran (a status read from a store)
    blockers: tuple[tuple[str, str, str], ...]  # (kind, subject, detail)
    versions: tuple[VersionStatus, ...]
    engines: tuple[EngineStatus, ...]
    attempts: tuple[AttemptView, ...]
    waiting: str | None  # a publication waiting for a slot
    sessions_here: int  # open sessions of this process
    groups_here: int
    notes: tuple[str, ...] = ()  # what health says without it blocking (e.g. engines that do not stamp)
    schema: int = SCHEMA

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True, value_serializer=lambda _i, _a, v: dict(v) if isinstance(v, Mapping) else v)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Status":
        body = dict(data)
        body["blockers"] = tuple(tuple(b) for b in body.get("blockers", ()))
        # fields a newer server adds are left out at every level: an older reader still reads it
        body["versions"] = tuple(_known(VersionStatus, {**v, "blocked_by": tuple(v["blocked_by"])})
                                 for v in body["versions"])
        body["engines"] = tuple(_known(EngineStatus, {**e, "holds": tuple(e["holds"]),
                                                      "should_hold": tuple(e["should_hold"])})
                                for e in body["engines"])
        body["attempts"] = tuple(_known(AttemptView, a) for a in body["attempts"])
        body["notes"] = tuple(body.get("notes", ()))
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})


def _ago(seconds: float | None) -> str:
    return "" if seconds is None else f", idle {seconds:.0f}s"


def holders(sessions: SessionsOf, local: Mapping[str, LocalSession] = {},  # noqa: B006 - read only
            now: float | None = None) -> list[str]:
    """The sessions and groups holding a version, by name, in the one form ``status`` and ``health``
    both show: ``session s1 (active, idle 12s, lease ends in 30s)``, ``group g (2 open member(s))``,
    ``3 more session(s) or group(s)`` (idle: where this process holds the session; the lease: with ``now``)."""
    why = []
    for sid, sstate, lease_until in sessions.session_ids:
        here = local.get(sid)
        lease = f", lease ends in {lease_until - now:.0f}s" if lease_until is not None and now is not None else ""
        why.append(f"session {sid} ({sstate.lower()}{_ago(here.idle_s if here else None)}{lease})")
    why += [f"group {g} ({m} open member(s))" for g, m in sessions.group_ids]
    more = sessions.sessions + sessions.groups - len(sessions.session_ids) - len(sessions.group_ids)
    if more > 0:
        why.append(f"{more} more session(s) or group(s)")
    return why


def _blocked_by(key: VersionKey, state: VersionState, retiring: bool, sessions: SessionsOf | None,
                local: Mapping[str, LocalSession], loaded_on: Mapping[str, int], unloading_on: tuple[str, ...],
                now: float | None) -> tuple[str, ...]:
    """What keeps a version that is not the default from being reclaimed, by name."""
    why: list[str] = []
    if state is VersionState.RETIRED and sessions is not None and not retiring:
        why += holders(sessions, local, now)
    if state is VersionState.RETIRED and not why:
        why.append("reclaim not claimed yet")
    if state is VersionState.RECLAIMING:
        for engine in sorted(set(unloading_on) | {e for e, n in loaded_on.items() if n}):
            n = loaded_on.get(engine, 0)
            why.append(f"engine {engine}: unload not confirmed" + (f", {n} request(s) still running" if n else ""))
    if state is VersionState.ABORTED:
        why.append("cleanup of its failed attempt not confirmed")
    return tuple(why)


def _known(cls: type, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in attrs.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def build_status(
    fleet: Fleet,
    *,
    source: str,
    sessions_of: Mapping[VersionKey, SessionsOf] = {},  # noqa: B006 - read only
    inventories: Mapping[str, Inventory | str | BaseException] | None = None,  # engine -> Inventory, its incarnation (str: it lists nothing), or the error it raised
    health: Health | None = None,
    local: Mapping[str, LocalSession] = {},  # noqa: B006 - read only
    first_seen: Mapping[AttemptToken, float] = {},  # noqa: B006 - read only
    now: float | None = None,
    monotonic: float | None = None,
) -> Status:
    """One :class:`Status` from what was read: the registry's fleet view, who holds refs on each
    version that still holds a slot, what each engine said (None: not asked), the last health."""
    now = time.time() if now is None else now  # the report's wall-clock stamp (``at``), no timer
    monotonic = time.monotonic() if monotonic is None else monotonic  # a caller without a deployment's clock
    held: dict[str, dict[str, int]] = {}  # version name -> engine -> running requests
    answers: dict[str, Inventory | str | BaseException] = dict(inventories or {})
    for engine, answer in answers.items():
        if isinstance(answer, Inventory):
            for name, adapter in answer.adapters.items():
                held.setdefault(name, {})[engine] = adapter.refs
    versions = []
    for slot in fleet.slots:
        name = fleet.lora_names.get(slot.version, "")
        loaded_on = held.get(name, {})
        if inventories is None:  # a store: the registry's view of who holds it
            loaded_on = {e: 0 for e in sorted(fleet.holders.get(slot.version, ()))}
        versions.append(VersionStatus(
            str(slot.version), slot.state.value, slot.lag, slot.session_refs, slot.retiring,
            slot.version == fleet.default, dict(sorted(loaded_on.items())),
            _blocked_by(slot.version, slot.state, slot.retiring, sessions_of.get(slot.version), local, loaded_on,
                        slot.unloading_on, fleet.now),
            fleet.suspect.get(slot.version),
        ))
    should: dict[str, list[str]] = {}
    for key, engines in fleet.holders.items():
        for engine in engines:
            should.setdefault(engine, []).append(str(key))
    for engine, key in fleet.missing:
        should.setdefault(engine, []).append(str(key))
    names = {name: str(key) for key, name in fleet.lora_names.items()}
    blockers = tuple((b.kind, b.subject, b.detail) for b in health.blockers) if health is not None else ()
    engine_rows: list[EngineStatus] = []
    for engine, incarnation in sorted(fleet.engines.items()):
        said = answers.get(engine)
        error = said if isinstance(said, BaseException) else None
        adapters = said.adapters if isinstance(said, Inventory) else {}  # a str: its incarnation alone
        last = next((d for k, s, d in blockers if s == engine or s.startswith(f"{engine}:")), None)
        engine_rows.append(EngineStatus(
            engine, incarnation, said if isinstance(said, str) else said.incarnation if isinstance(said, Inventory) else None,
            None if inventories is None else error is None and said is not None,
            tuple(sorted(names[n] for n in adapters if n in names)),
            tuple(sorted(should.get(engine, ()))),
            sum(a.refs for n, a in adapters.items() if n in names),
            f"{type(error).__name__}: {error}" if error is not None else last,
            not isinstance(said, str),
        ))
    attempts = tuple(
        AttemptView(str(token), str(token.version), progress[0].value, progress[1],
                    monotonic - first_seen[token] if token in first_seen else None)
        for token, progress in sorted(fleet.active.items())
    )
    return Status(
        epoch=fleet.epoch, at=now, source=source, default=str(fleet.default) if fleet.default else None,
        default_revision=fleet.default_revision, capacity=fleet.capacity, slots_used=len(fleet.slots),
        max_lag=fleet.max_lag, healthy=health.healthy if health is not None else None, blockers=blockers,
        versions=tuple(versions), engines=tuple(engine_rows), attempts=attempts,
        waiting=str(fleet.waiting.key) if fleet.waiting is not None else None,
        sessions_here=len(local), groups_here=len({s.group for s in local.values() if s.group is not None}),
        notes=health.notes if health is not None else (),
    )


def check_bind(host: str, token: str | None) -> None:
    """A status endpoint reachable from other hosts must ask for a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise InvalidInput(f"the status endpoint binds {host!r}, beyond localhost: give status_token=… (callers send "
                           "'Authorization: Bearer <token>'), or bind 127.0.0.1")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise InvalidInput("status_token must be a string of at least 16 characters")

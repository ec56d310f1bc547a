"""The registry's state, what its transitions return, and the replies of its queries."""

from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping, TypeVar

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import _fields
from lorapub.core import attempt as att
from lorapub.core.attempt import Attempt, Phase
from lorapub.core.effects import Effect
from lorapub.core.facts import Fact, as_facts
from lorapub.core.identity import MANAGED_PREFIX, AttemptToken, SessionKey, VersionKey, check_name_prefix
from lorapub.core.group import GroupRecord
from lorapub.core.session import SessionRecord
from lorapub.core.session_table import SessionTable
from lorapub.core.version import CommitReceipt, Version, VersionState
from lorapub.errors import EpochMismatch, InvalidInput, StaleAttempt, UnknownVersion

__all__ = ['AttemptStatus', 'DEFAULT_CAPACITY', 'DEFAULT_LEASE_TTL', 'DEFAULT_TOMBSTONE_WINDOW', 'Fleet', 'Membership',
    'ON_STALE', 'Outcome', 'RegistryState', 'ReserveReply', 'SessionsOf', 'SlotHolder', 'Waiter', 'Waiting', 'as_effects',
    'check_capacity', 'check_epoch', 'check_max_lag', 'new_registry']


DEFAULT_CAPACITY = 2
#: Seconds a session's ref outlives the last renewal from its worker (None: no leases).
DEFAULT_LEASE_TTL = 120.0
#: Seconds a closed or expired session's tombstone is kept after the session began (None: for
#: the epoch). Messages for a session born before the window are refused without one.
DEFAULT_TOMBSTONE_WINDOW = 3600.0
#: What a session bound to a version more than ``max_lag`` commits behind the default gets at
#: its next generation: ``"error"`` (BINDING_STALE, the session generates no more) or
#: ``"rebind"`` (it moves to the default at that turn boundary, recorded in its provenance).
ON_STALE = ("error", "rebind")


class Membership(enum.Enum):
    """An engine's place in the fleet (docs/elastic.md). ``JOINING``: added, takes no traffic until it
    holds every version sessions may use; ``SERVING``; ``DRAINING``: takes no new binding and no new
    version, on its way out."""

    JOINING = "JOINING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"


@attrs.frozen
class Waiter:
    """The one publication waiting for a slot (the newest: a newer one supersedes it)."""

    key: VersionKey
    digest: str
    publisher: str
    since: float | None  # registry time it began waiting
    until: float | None  # registry time its caller stops waiting (dropped after that)

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


_K = TypeVar("_K")
_V = TypeVar("_V")


def _frozen_map(value: Mapping[_K, _V]) -> PMap[_K, _V]:
    # attrs.evolve re-runs converters: an existing PMap must pass through, not be copied.
    return value if isinstance(value, PMap) else pmap(value)


# One converter a field (mypy's attrs plugin types the field's argument by its converter's).
def _engines(value: Mapping[str, str]) -> PMap[str, str]:
    return _frozen_map(value)


def _members(value: Mapping[str, Membership]) -> PMap[str, Membership]:
    return _frozen_map(value)


def _versions(value: Mapping[VersionKey, Version]) -> PMap[VersionKey, Version]:
    return _frozen_map(value)


def _attempts(value: Mapping[AttemptToken, Attempt]) -> PMap[AttemptToken, Attempt]:
    return _frozen_map(value)


def _reprovisions(value: Mapping[tuple[str, VersionKey], AttemptToken]) -> PMap[tuple[str, VersionKey], AttemptToken]:
    return _frozen_map(value)


def _groups(value: Mapping[str, GroupRecord]) -> PMap[str, GroupRecord]:
    return _frozen_map(value)


def _superseded(value: Mapping[VersionKey, VersionKey]) -> PMap[VersionKey, VersionKey]:
    return _frozen_map(value)


def _session_table(value: Mapping[SessionKey, SessionRecord]) -> SessionTable:
    # as _frozen_map: an existing table passes through; a mapping of records becomes one
    return value if isinstance(value, SessionTable) else SessionTable(value)


def as_effects(effects: Iterable[Effect]) -> tuple[Effect, ...]:
    return tuple(effects)


@attrs.frozen
class RegistryState:
    epoch: int
    engines: PMap[str, str] = attrs.field(converter=_engines)  # engine -> current incarnation
    capacity: int = DEFAULT_CAPACITY
    versions: PMap[VersionKey, Version] = attrs.field(factory=pmap, converter=_versions)
    attempts: PMap[AttemptToken, Attempt] = attrs.field(factory=pmap, converter=_attempts)
    # SessionKey -> SessionRecord, held as atoms the garbage collector does not track, with
    # the lease and tombstone indexes ExpireLeases reads (see lorapub.core.session_table)
    sessions: SessionTable = attrs.field(factory=SessionTable, converter=_session_table)
    default: VersionKey | None = None
    default_revision: int = 0
    attempt_seq: int = 0
    reclaim_seq: int = 0
    lease_ttl: float | None = DEFAULT_LEASE_TTL
    # (engine, VersionKey) -> the re-provisioning attempt loading it there again
    reprovisions: PMap[tuple[str, VersionKey], AttemptToken] = attrs.field(factory=pmap, converter=_reprovisions)
    expired_sessions: int = 0
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW
    forgotten_sessions: int = 0
    # Bounded staleness: a version more than max_lag commits behind the default is retiring
    # (None: a session keeps its version for life, the RFC's rule).
    max_lag: int | None = None
    on_stale: str = "error"
    groups: PMap[str, GroupRecord] = attrs.field(factory=pmap, converter=_groups)  # group id -> GroupRecord
    waiter: Waiter | None = None
    # a version whose waiting publication a newer one superseded -> that newer version
    superseded: PMap[VersionKey, VersionKey] = attrs.field(factory=pmap, converter=_superseded)
    # how this deployment's versions are named on the engines (each engine protects one prefix)
    name_prefix: str = MANAGED_PREFIX
    # engine -> JOINING or DRAINING; an engine of ``engines`` not named here is SERVING
    members: PMap[str, Membership] = attrs.field(factory=pmap, converter=_members)
    # a new session is kept off a suspect default (VERSION_SUSPECT); bound sessions are never moved
    avoid_suspect: bool = False

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate

    # -- reads ---------------------------------------------------------------
    @property
    def slots_held(self) -> int:
        return sum(1 for v in self.versions.values() if v.holds_slot)

    def slot_holders(self) -> tuple["SlotHolder", ...]:
        return tuple(
            SlotHolder(k, v.state, v.session_refs, v.lag(self.default_revision), v.retiring,
                       tuple(sorted(v.reclaim_pending)),
                       att.cleanup_owed_by(a) if (a := self.attempts.get(v.attempt)) is not None else ())
            for k, v in sorted(self.versions.items()) if v.holds_slot
        )

    def unresolved_attempt(self) -> Attempt | None:
        # Versions hold at most `capacity` live attempts, so this scan is tiny.
        for v in self.versions.values():
            a = self.attempts[v.attempt]
            if not a.resolved:
                return a
        return None

    def version(self, key: VersionKey) -> Version:
        try:
            return self.versions[key]
        except KeyError:
            raise UnknownVersion(f"version {key} was never reserved in epoch {self.epoch}") from None

    def attempt(self, token: AttemptToken) -> Attempt:
        try:
            return self.attempts[token]
        except KeyError:
            raise StaleAttempt(f"attempt {token} was never issued by this registry") from None

    def reclaimable(self) -> list[VersionKey]:
        return sorted(k for k, v in self.versions.items() if v.reclaimable)

    def needed(self) -> list[Version]:
        """Versions sessions can still use: the default and RETIRED versions with refs (not retiring)."""
        return [
            v for k, v in sorted(self.versions.items())
            if v.state is VersionState.PUBLISHED
            or (v.state is VersionState.RETIRED and v.session_refs > 0 and not v.retiring)
        ]

    def missing(self) -> list[tuple[str, VersionKey]]:
        """(engine, version) pairs to load: a needed version an engine lost in a restart, or never
        had (it joined); never on a draining engine."""
        return [
            (engine, v.key) for v in self.needed() for engine in sorted(self.engines)
            if engine not in v.engines and (engine, v.key) not in self.reprovisions
            and self.members.get(engine) is not Membership.DRAINING
        ]

    def membership(self, engine: str) -> Membership:
        """``engine``'s place in the fleet (it must be one of ``engines``)."""
        return self.members.get(engine, Membership.SERVING)

    def in_state(self, membership: Membership) -> frozenset[str]:
        return frozenset(e for e in self.engines if self.membership(e) is membership)

    def publication_targets(self) -> dict[str, str]:
        """The engines a new publication loads on (engine -> incarnation): every member not draining."""
        return {e: inc for e, inc in self.engines.items() if self.members.get(e) is not Membership.DRAINING}


@attrs.frozen
class Outcome:
    """What one command decided: the new state, the reply (its type is the one the command names), the
    effects the I/O layer must run, and the facts the decision established (:mod:`lorapub.core.facts`)."""

    state: RegistryState
    reply: Any = None
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=as_effects)
    facts: tuple[Fact, ...] = attrs.field(default=(), converter=as_facts)


@attrs.frozen
class ReserveReply:
    token: AttemptToken
    lora_name: str
    state: VersionState
    expected_default_revision: int
    created: bool


@attrs.frozen
class SlotHolder:
    """A version that holds one of the managed slots, and what keeps it."""

    version: VersionKey
    state: VersionState
    session_refs: int
    lag: int | None
    retiring: bool
    unloading_on: tuple[str, ...] = ()  # RECLAIMING: engines whose unload is not confirmed
    cleaning_on: tuple[str, ...] = ()  # ABORTED: engines whose cleanup of its attempt is not confirmed

    @property
    def waits_on_engines(self) -> tuple[str, ...]:
        """The engines whose confirmation (unload, cleanup) frees this slot; () when sessions keep it."""
        return self.unloading_on or self.cleaning_on

    @property
    def kept_by_sessions(self) -> bool:
        """Sessions keep this slot: RETIRED with refs and not retiring (a retiring version is reclaimed
        whatever refs it still has: they keep nothing)."""
        return self.state is VersionState.RETIRED and self.session_refs > 0 and not self.retiring

    def describe(self) -> str:
        what = f"{self.version} {self.state.value}"
        if self.lag is not None and self.state is not VersionState.PUBLISHED:
            what += f" (lag {self.lag})"
        if self.kept_by_sessions:
            what += f": kept by {self.session_refs} session ref(s) until they close or expire"
        elif self.state is VersionState.RETIRED:
            what += ": being reclaimed"
        elif self.state is VersionState.RECLAIMING:
            what += f": unload not confirmed yet on {', '.join(self.unloading_on) or 'its engines'}"
        elif self.state is VersionState.ABORTED:
            what += f": cleanup of its failed attempt not confirmed on {', '.join(self.cleaning_on) or 'its engines'}"
        return what


@attrs.frozen
class Waiting:
    """Reserve's reply to a call that waits: no slot yet (``holders`` keep them), or an
    unresolved ``attempt`` runs. Ask again; a newer publication supersedes this one."""

    key: VersionKey
    since: float | None
    holders: tuple[SlotHolder, ...]
    attempt: AttemptToken | None = None
    attempt_phase: str | None = None

    def describe(self) -> str:
        if self.attempt is not None:
            return f"attempt {self.attempt} is {self.attempt_phase}"
        return "every slot is held: " + "; ".join(h.describe() for h in self.holders)


@attrs.frozen
class SessionsOf:
    """What :class:`ReadSessionsOf` answers: who holds refs on a version."""

    version: VersionKey
    sessions: int  # solo sessions holding a ref
    groups: int  # groups holding a ref
    session_ids: tuple[tuple[str, str, float | None], ...]  # (session id, state, lease_until), at most limit
    group_ids: tuple[tuple[str, int], ...]  # (group id, open members), at most limit


@attrs.frozen
class Fleet:
    """What the reconciler and the session router need, without the sessions (cheap to ship).

    ``holders`` maps each version sessions may still use to the engines that hold it now.
    """

    epoch: int
    engines: Mapping[str, str]
    default: VersionKey | None
    holders: Mapping[VersionKey, frozenset[str]]
    missing: tuple[tuple[str, VersionKey], ...]
    reclaimable: tuple[VersionKey, ...]
    reclaiming: tuple[VersionKey, ...]
    cleaning: tuple[AttemptToken, ...]  # aborted attempts whose cleanup is not confirmed
    active: Mapping[AttemptToken, att.Progress]  # live attempts -> their progress value
    expired_sessions: int
    lease_ttl: float | None
    default_revision: int = 0
    retiring: frozenset[VersionKey] = frozenset()
    max_lag: int | None = None
    on_stale: str = "error"
    capacity: int = DEFAULT_CAPACITY
    slots: tuple[SlotHolder, ...] = ()
    waiting: Waiter | None = None
    now: float | None = None  # the registry's clock when it answered
    name_prefix: str = MANAGED_PREFIX
    lora_names: Mapping[VersionKey, str] = attrs.field(factory=dict)  # every version engines may still hold
    joining: frozenset[str] = frozenset()  # members that take no traffic until they hold every needed version
    draining: frozenset[str] = frozenset()  # members that take no new binding (they are on their way out)
    suspect: Mapping[VersionKey, str] = attrs.field(factory=dict)  # resident versions the canary saw drift -> why
    avoid_suspect: bool = False

    @property
    def routable(self) -> frozenset[str]:
        """Engines that take traffic and hold every version sessions may still use."""
        serving = frozenset(self.engines) - self.joining - self.draining
        if not self.holders:
            return serving
        return serving & frozenset.intersection(*self.holders.values())

    def routing(self) -> dict[VersionKey, frozenset[str]]:
        """Where each version's generations may go: its holders, less the joining members, and less
        the draining ones unless no other member holds it (its sessions stay until it is loaded
        elsewhere or they end)."""
        routes = {}
        for key, holders in self.holders.items():
            taking = holders - self.joining
            routes[key] = (taking - self.draining) or taking
        return routes


@attrs.frozen
class AttemptStatus:
    token: AttemptToken
    phase: Phase
    version_state: VersionState
    commit: CommitReceipt | None
    targets: tuple[tuple[str, str], ...]  # (engine, target state)
    publisher: str = ""  # who started it (its own replay may take it over)


def new_registry(
    epoch: int,
    engines: Mapping[str, str],
    capacity: int = DEFAULT_CAPACITY,
    lease_ttl: float | None = DEFAULT_LEASE_TTL,
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW,
    max_lag: int | None = None,
    on_stale: str | None = None,
    name_prefix: str = MANAGED_PREFIX,
    *,
    avoid_suspect: bool = False,
) -> RegistryState:
    if not engines:
        raise InvalidInput("a registry needs at least one target engine")
    check_capacity(capacity)
    if lease_ttl is not None and (not isinstance(lease_ttl, (int, float)) or not lease_ttl > 0):
        raise InvalidInput(f"lease_ttl must be a positive number of seconds or None, got {lease_ttl!r}")
    if tombstone_window is not None and (not isinstance(tombstone_window, (int, float)) or not tombstone_window > 0):
        raise InvalidInput(f"tombstone_window must be a positive number of seconds or None, got {tombstone_window!r}")
    if lease_ttl is not None and tombstone_window is not None and tombstone_window < 2 * lease_ttl:
        raise InvalidInput(f"tombstone_window ({tombstone_window:g}s) must be at least twice lease_ttl ({lease_ttl:g}s)")
    on_stale = check_max_lag(max_lag, on_stale)
    check_room_for_lag(capacity, max_lag)
    check_name_prefix(name_prefix)
    return RegistryState(
        epoch=epoch, engines=dict(engines), capacity=capacity, lease_ttl=lease_ttl, tombstone_window=tombstone_window,
        max_lag=max_lag, on_stale=on_stale, name_prefix=name_prefix, avoid_suspect=avoid_suspect is True,
    )


def check_capacity(capacity: object) -> None:
    what = f"capacity must be an int >= 2 (managed versions held at once; 2 is the RFC's minimum), got {capacity!r}"
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        raise InvalidInput(what, capacity=capacity)
    if capacity < 2:
        # the default holds a slot for as long as it is the default: with one slot, nothing else ever loads
        raise InvalidInput(f"{what}: the default version always holds one slot and a new version needs another "
                           "to load beside it, so it could never publish a second version — use capacity=2 or more",
                           capacity=capacity)


def check_max_lag(max_lag: object, on_stale: object = None) -> str:
    """Check ``max_lag`` and ``on_stale``; returns the ``on_stale`` that applies. The one rule for its
    default (None): with ``max_lag`` set, a stale session moves to the default at its next turn boundary
    (``"rebind"``: no rollout is thrown away); ``"error"`` stays available, for trainers that cannot take
    a trajectory spanning versions. Without ``max_lag`` nothing goes stale, and it stays ``"error"``."""
    if max_lag is not None and (not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0):
        raise InvalidInput(f"max_lag must be an int >= 0 (commits behind the default) or None, got {max_lag!r}")
    if on_stale is None:
        return "rebind" if max_lag is not None else "error"
    if on_stale not in ON_STALE:
        raise InvalidInput(f"on_stale must be one of {', '.join(map(repr, ON_STALE))} (or None: \"rebind\" when "
                           f"max_lag is set), got {on_stale!r}")
    return str(on_stale)


def check_room_for_lag(capacity: int, max_lag: int | None) -> None:
    """``max_lag = k`` frees slots only if ``capacity >= k + 2``: the default and the k versions behind
    it that sessions may still use, plus one for the next version to load. With fewer, a version
    within ``max_lag`` holds the slot the next one needs, and every publication waits for sessions
    to end, which is what ``max_lag`` exists to avoid (docs/freshness.md)."""
    if max_lag is not None and capacity < max_lag + 2:
        raise InvalidInput(f"capacity {capacity} cannot serve max_lag={max_lag}: the default and the {max_lag} "
                           f"version(s) behind it stay usable and the next version needs a slot of its own, so "
                           f"{max_lag + 2} slots are needed — use capacity={max_lag + 2} or more, or "
                           f"max_lag={capacity - 2} or less", capacity=capacity, max_lag=max_lag)


def check_epoch(state: RegistryState, epoch: int, what: object) -> None:
    if epoch != state.epoch:
        raise EpochMismatch(f"{what} belongs to epoch {epoch}; this registry serves epoch {state.epoch}")

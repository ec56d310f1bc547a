"""Sessions and groups: open, bind on the first generation, rebind, close, lease and expire."""

from __future__ import annotations

import math
from typing import Iterable

import attrs

from lorapub.core.commands import (
    AuthorizeDispatch, BeginClose, BindFirst, CloseAndRelease, ExpireLeases, ExpireSessions, ForgetSessions,
    OpenSession, ReadSessionsOf, Rebind, RenewLeases,
)
from lorapub.core import group as grp
from lorapub.core import session as ses
from lorapub.core.identity import SessionKey, VersionKey, check_id
from lorapub.core.group import GroupRecord, GroupState
from lorapub.core.session import Binding, SessionRecord, SessionState
from lorapub.core.version import add_session_ref, drop_session_ref
from lorapub.errors import BindingStale, SessionExpired, InvalidInput, NoPublishedVersion, VersionReclaiming, VersionSuspect

from .publication import reclaim_eligible
from .state import Outcome, RegistryState, SessionsOf, check_epoch

__all__ = ['authorize_dispatch', 'begin_close', 'bind_first', 'close_and_release', 'expire_by_scan', 'expire_leases',
    'expire_sessions', 'forget_sessions', 'open_session', 'read_sessions_of', 'rebind', 'renew_leases']


# -- sessions ------------------------------------------------------------------
def _session(state: RegistryState, key: SessionKey) -> SessionRecord | None:
    check_epoch(state, key.deployment_epoch, f"session {key}")
    return state.sessions.get(key)


def _beyond_window(state: RegistryState, key: SessionKey, now: float | None) -> bool:
    """Born before the tombstone window: a tombstone of it may have been forgotten."""
    born = key.born
    return born is not None and now is not None and state.tombstone_window is not None and (
        born < now - state.tombstone_window
    )


def _refuse_beyond_window(
    state: RegistryState, key: SessionKey, record: SessionRecord | None, now: float | None, what: str
) -> None:
    if record is None and _beyond_window(state, key, now):
        raise SessionExpired(
            f"session {key} began more than {state.tombstone_window:g}s ago and is not live here "
            f"(its tombstone may have been forgotten); {what} refused — start a new session", session=key,
        )


def _version_of(record: SessionRecord | GroupRecord) -> VersionKey:
    """The version a bound session or group is bound to (every bound one has one)."""
    assert record.version is not None
    return record.version


def _binding(state: RegistryState, record: SessionRecord) -> Binding:
    v = state.versions[_version_of(record)]
    revision = v.commit.default_revision if v.commit is not None else 0
    group = state.groups.get(record.group) if record.group is not None else None
    return Binding(record.key, v.key, v.lora_name, v.digest, revision, record.group, record.rebinds,
                   group.rebinds if group is not None else 0)


def _lease_until(state: RegistryState, now: float | None) -> float | None:
    return None if now is None or state.lease_ttl is None else now + state.lease_ttl


def _stale_reason(state: RegistryState, record: SessionRecord) -> str | None:
    """Why a BOUND session may not dispatch on its binding any more (None: it may)."""
    if record.group is not None:
        group = state.groups[record.group]
        if group.version != record.version:
            return f"its group {record.group!r} was rebound to {group.version}"
    version = state.versions[_version_of(record)]
    if version.retiring:
        lag = version.lag(state.default_revision)
        return f"its version {version.key} is {lag} commits behind the default (max_lag {state.max_lag})"
    return None


def _refuse_if_stale(state: RegistryState, record: SessionRecord) -> None:
    why = _stale_reason(state, record)
    if why is not None:
        hint = (" — it rebinds to the default at its next generation" if state.on_stale == "rebind"
                else "; its ref was released and it generates no more — start a new session")
        raise BindingStale(f"session {record.key}: {why}{hint}", session=record.key, version=record.version,
                           **_lag_details(state, _version_of(record)))


def _lag_details(state: RegistryState, version: VersionKey) -> dict[str, object]:
    """What a BindingStale's details carry beside the session: how far behind, against what rule."""
    return {"lag": state.versions[version].lag(state.default_revision), "max_lag": state.max_lag,
            "default": state.default}


def _refuse_if_suspect(state: RegistryState, default: VersionKey, record: SessionRecord | None,
                       group: str | None) -> None:
    """``avoid_suspect``: a new binding never lands on a suspect default; a member of a group already
    bound joins its group's version (a group never spans two versions)."""
    suspect = state.versions[default].suspect
    if not state.avoid_suspect or suspect is None:
        return
    gid = record.group if record is not None else group
    if gid is not None and gid in state.groups and state.groups[gid].state is not GroupState.OPEN:
        return
    raise VersionSuspect(
        f"the default {default} is suspect ({suspect}); avoid_suspect keeps new sessions off it until a newer "
        "version is committed", version=default,
    )


def _join_group(state: RegistryState, found: SessionRecord | None, key: SessionKey, group: str | None) -> tuple[RegistryState, str | None]:
    """A new record joins ``group`` (one more open member); an existing one keeps its own."""
    if found is not None:
        if group is not None and found.group != group:
            raise InvalidInput(f"session {key} is not a member of group {group!r} (it is in {found.group!r})")
        return state, found.group
    if group is None:
        return state, None
    check_id("group", group)
    return attrs.evolve(state, groups=state.groups.set(group, grp.joined(state.groups.get(group), group))), group


def open_session(state: RegistryState, c: OpenSession) -> Outcome:
    key, now, group = c.key, c.now, c.group
    found = _session(state, key)
    _refuse_beyond_window(state, key, found, now, "open")
    record = ses.opened(found, key)
    state, gid = _join_group(state, found, key, group)
    record = ses.leased(attrs.evolve(record, group=gid), _lease_until(state, now))
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def _add_ref(state: RegistryState, key: VersionKey) -> RegistryState:
    return attrs.evolve(state, versions=state.versions.set(key, add_session_ref(state.versions[key])))


def _drop_ref(state: RegistryState, key: VersionKey | None) -> RegistryState:
    if key is None:
        return state
    return attrs.evolve(state, versions=state.versions.set(key, drop_session_ref(state.versions[key])))


def bind_first(state: RegistryState, c: BindFirst) -> Outcome:
    """Bind to the current default on first generation (the lease starts); later calls return
    the same binding and change nothing (leases are renewed in batches, by ``RenewLeases``).

    A group member binds its group's version: the group's first generation binds the group
    (one ref, held by the group), every later member the same version."""
    key, now, group = c.key, c.now, c.group
    record = _session(state, key)
    _refuse_beyond_window(state, key, record, now, "bind")
    if record is not None and record.state is SessionState.BOUND:
        if group is not None and record.group != group:
            raise InvalidInput(f"session {key} is not a member of group {group!r} (it is in {record.group!r})")
        _refuse_if_stale(state, record)
        return Outcome(state, _binding(state, record))  # a replay: same answer, nothing changes
    if record is not None and record.state in ses.ENDING:
        ses.opened(record, key)  # raises the typed refusal (closed or expired)
    default = state.default
    if default is None:
        raise NoPublishedVersion(f"no version is published yet in epoch {state.epoch}")
    _refuse_if_suspect(state, default, record, group)
    state, gid = _join_group(state, record, key, group)
    if gid is None:
        version, holds = default, True
        state = _add_ref(state, version)
    else:
        g = state.groups[gid]
        if g.state is GroupState.OPEN:
            g = grp.bound(g, default)
            state = _add_ref(state, default)
        elif state.versions[_version_of(g)].retiring:
            if state.on_stale != "rebind":
                lag = state.versions[_version_of(g)].lag(state.default_revision)
                raise BindingStale(
                    f"session {key}: its group {gid!r} is bound to {g.version}, {lag} commits behind the default "
                    f"(max_lag {state.max_lag}); a stale group retires together — start a new group",
                    session=key, version=g.version, **_lag_details(state, _version_of(g)),
                )
            g, release = grp.rebound(g, default)
            state = _add_ref(_drop_ref(state, release), default)
        state = attrs.evolve(state, groups=state.groups.set(gid, g))
        version, holds = _version_of(g), False
    record = ses.leased(ses.bound(record, key, version, holds_ref=holds, group=gid), _lease_until(state, now))
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    return Outcome(state, _binding(state, record))


def rebind(state: RegistryState, c: Rebind) -> Outcome:
    """``on_stale="rebind"``: a session (its whole group, for a member) whose version is retiring
    moves to the current default; a member adopts its group's newer version. Anything else
    returns the binding unchanged."""
    key, now = c.key, c.now
    record = ses.require_dispatchable(_session(state, key), key)
    if state.on_stale != "rebind":
        _refuse_if_stale(state, record)
        return Outcome(state, _binding(state, record))
    default = state.default
    assert default is not None  # a bound session's version was the default once, and there is always one since
    if record.group is not None:
        g = state.groups[record.group]
        if state.versions[_version_of(g)].retiring and g.version != default:
            g, release = grp.rebound(g, default)
            state = _add_ref(_drop_ref(state, release), default)
            state = attrs.evolve(state, groups=state.groups.set(record.group, g))
        if record.version != g.version:
            record = attrs.evolve(record, version=g.version, rebinds=record.rebinds + 1)
    elif state.versions[_version_of(record)].retiring and record.version != default:
        state = _add_ref(_drop_ref(state, record.version if record.holds_ref else None), default)
        record = attrs.evolve(record, version=default, holds_ref=True, rebinds=record.rebinds + 1)
    state = attrs.evolve(state, sessions=state.sessions.set(key, ses.leased(record, _lease_until(state, now))))
    return Outcome(state, _binding(state, record))


def begin_close(state: RegistryState, c: BeginClose) -> Outcome:
    key, now = c.key, c.now
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)  # long over: nothing to record
    record = ses.closing(found, key)
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def _ended(
    state: RegistryState, old: SessionRecord | None, release: VersionKey | None, now: float | None
) -> tuple[RegistryState, list[VersionKey]]:
    """A session became a tombstone: drop its own ref (``release``), or leave its group (the last
    member to leave drops the group's). Returns the versions whose ref was dropped."""
    dropped = []
    if release is not None:
        state = _drop_ref(state, release)
        dropped.append(release)
    if old is not None and old.group is not None and old.state not in ses.TOMBSTONES:
        g, group_release = grp.left(state.groups[old.group], now)
        state = attrs.evolve(state, groups=state.groups.set(old.group, g))
        if group_release is not None:
            state = _drop_ref(state, group_release)
            dropped.append(group_release)
    return state, dropped


def close_and_release(state: RegistryState, c: CloseAndRelease) -> Outcome:
    """Release the session ref exactly once and keep a CLOSED tombstone (for the window)."""
    key, now = c.key, c.now
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)
    record, release = ses.closed(found, key)
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    state, dropped = _ended(state, found, release, now)
    return Outcome(state, record.state, [fx for k in dropped for fx in reclaim_eligible(state, k)])


def forget_sessions(state: RegistryState, c: ForgetSessions) -> Outcome:
    """Drop CLOSED tombstones the caller knows can get no late message any more."""
    keys = c.keys
    drop: dict[SessionKey, None] = {}
    for key in keys:
        record = state.sessions.get(key)
        if record is not None and record.state is SessionState.CLOSED:
            drop[key] = None
    return Outcome(attrs.evolve(state, sessions=state.sessions.remove_many(drop)), len(drop))


def renew_leases(state: RegistryState, c: RenewLeases) -> Outcome:
    """Renew the leases of live sessions; the reply names the sessions that are gone
    (expired or unknown here), so their worker refuses them locally too."""
    keys, now = c.keys, c.now
    lease = _lease_until(state, now)
    renewed = []
    gone = []
    for key in keys:
        check_epoch(state, key.deployment_epoch, f"session {key}")
        record = state.sessions.get(key)
        if record is None or record.state is SessionState.EXPIRED:
            gone.append(key)
            continue
        new = ses.leased(record, lease)
        if new is not record:
            renewed.append((key, new))
    return Outcome(attrs.evolve(state, sessions=state.sessions.update(renewed)), tuple(gone))


def expire_sessions(state: RegistryState, c: ExpireSessions) -> Outcome:
    """Expire these sessions now (their worker saw them idle): the live ones become EXPIRED."""
    keys, now = c.keys, c.now
    due = []
    for key in keys:
        record = _session(state, key)
        if record is not None and record.state in ses.LEASED:
            due.append(key)
    return _expire(state, due, [], now)


def expire_leases(state: RegistryState, c: ExpireLeases) -> Outcome:
    """Sessions whose worker stopped renewing: EXPIRED tombstone, ref released once; and the
    tombstones of sessions born before the window are forgotten (closed groups too, a window
    after they closed), and a waiting publication whose caller stopped waiting is dropped.

    The session table indexes leases by deadline and tombstones by birth, so a pass reads
    only the sessions that are due: O(due · log n), not a scan of every session."""
    now = c.now
    if now is None:
        return Outcome(state, ())
    state = _forget_old(state, now)
    if not math.isfinite(now):  # the indexes are ordered by finite times: read every record
        return expire_by_scan(state, now)
    sessions = state.sessions
    forget = [] if state.tombstone_window is None else sessions.tombstones_born_before(now - state.tombstone_window)
    return _expire(state, sessions.leases_due(now), forget, now)


def _forget_old(state: RegistryState, now: float) -> RegistryState:
    waiter = state.waiter
    if waiter is not None and waiter.until is not None and not waiter.until >= now:
        state = attrs.evolve(state, waiter=None)
    if state.tombstone_window is not None and state.groups:
        cutoff = now - state.tombstone_window
        old = [g for g, r in state.groups.items()
               if r.state is GroupState.CLOSED and r.closed_at is not None and r.closed_at < cutoff]
        if old:
            groups = state.groups
            for g in old:
                groups = groups.remove(g)
            state = attrs.evolve(state, groups=groups)
    return state


def expire_by_scan(state: RegistryState, now: float) -> Outcome:
    """``expire_leases`` choosing from every record what the indexes choose (a clock reading that
    is not a finite number)."""
    due, forget = [], []
    for key, record in state.sessions.items():
        if record.state in ses.TOMBSTONES:
            if _beyond_window(state, key, now):
                forget.append(key)
        elif record.lease_until is not None and not record.lease_until >= now and record.state in ses.LEASED:
            due.append(key)  # "not >=": a NaN deadline is due at once
    return _expire(state, due, forget, now)


def _expire(state: RegistryState, due: list[SessionKey], forget: list[SessionKey], now: float | None = None) -> Outcome:
    """Expire the sessions ``due`` (each releases its ref once) and forget the tombstones ``forget``;
    the reply names the sessions expired (sorted), so whoever ran the pass can say whom it expired."""
    if not due and not forget:
        return Outcome(state, ())
    released: set[VersionKey] = set()
    expired = []
    for key in due:
        old = state.sessions[key]
        record, release = ses.expired(old)
        expired.append((key, record))
        state, dropped = _ended(state, old, release, now)
        released.update(dropped)
    # the tombstones first: a session that expires in this pass is not forgotten in it
    state = attrs.evolve(
        state, sessions=state.sessions.remove_many(forget).update(expired),
        expired_sessions=state.expired_sessions + len(expired), forgotten_sessions=state.forgotten_sessions + len(forget),
    )
    return Outcome(state, tuple(sorted(key for key, _ in expired)),
                   [fx for key in sorted(released) for fx in reclaim_eligible(state, key)])


def authorize_dispatch(state: RegistryState, c: AuthorizeDispatch) -> Outcome:
    """The binding a new backend request must carry; refused once closing, stale or reclaiming."""
    key = c.key
    record = ses.require_dispatchable(_session(state, key), key)
    _refuse_if_stale(state, record)
    binding = _binding(state, record)
    version = state.versions[binding.version]
    if not version.dispatchable:
        raise VersionReclaiming(f"version {version.key} is {version.state.value}; dispatch refused")
    return Outcome(state, binding)


def read_sessions_of(state: RegistryState, c: ReadSessionsOf) -> Outcome:
    """Who holds refs on ``key``: a scan of the sessions (for health and error messages only)."""
    key, limit = c.version, c.limit
    state.version(key)
    sessions = 0
    names: list[tuple[str, str, float | None]] = []
    for skey, record in state.sessions.items():
        if record.holds_ref and record.version == key:
            sessions += 1
            if len(names) < limit:
                names.append((skey.session_id, record.state.value, record.lease_until))
    groups = [(g, r.members) for g, r in sorted(state.groups.items()) if r.holds_ref and r.version == key]
    return Outcome(state, SessionsOf(key, sessions, len(groups), tuple(names), tuple(groups[:limit])))

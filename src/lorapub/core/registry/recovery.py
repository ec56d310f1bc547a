"""Recovery: re-provision a version an engine lost, abort an attempt nobody drives, read the fleet."""

from __future__ import annotations


import attrs

from lorapub.core.commands import AbortStale, ReadFleet, RecordLost, StartReprovision
from lorapub.core import attempt as att
from lorapub.core import reclaim as rec
from lorapub.core.attempt import Phase
from lorapub.core.effects import Ignored
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.version import HELD_BY_ENGINES, SERVING, VersionState
from lorapub.errors import UnknownEngine

from .publication import step_attempt
from .state import Fleet, Membership, Outcome, RegistryState

__all__ = ['abort_stale', 'read_fleet', 'record_lost', 'start_reprovision']


# -- recovery --------------------------------------------------------------------
def start_reprovision(state: RegistryState, c: StartReprovision) -> Outcome:
    """Load a needed version again on an engine that lost it; the reply is the attempt token
    (None when nothing is to do: not needed, already held, or already being loaded)."""
    key, engine = c.key, c.engine
    version = state.version(key)
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine} is not registered")
    if (engine, key) not in state.missing():
        running = state.reprovisions.get((engine, key))
        return Outcome(state, running, [Ignored(f"{key} on {engine}: nothing to re-provision")])
    original = state.attempts[version.attempt]
    token = AttemptToken(key, state.attempt_seq + 1)
    attempt, effects = att.start(
        token, version.lora_name, version.digest, original.plan, {engine: state.engines[engine]},
        state.default_revision, reprovision=True,
    )
    state = attrs.evolve(
        state,
        attempt_seq=token.seq,
        attempts=state.attempts.set(token, attempt),
        reprovisions=state.reprovisions.set((engine, key), token),
    )
    return Outcome(state, token, effects)


def record_lost(state: RegistryState, c: RecordLost) -> Outcome:
    """``engine`` no longer holds ``key`` although it did not restart (an operator unloaded it):
    it leaves the version's holders (sessions go to another holder; it is re-provisioned where
    still needed), and a reclaim has nothing left to unload there."""
    engine, key = c.engine, c.key
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine} is not registered")
    version = state.version(key)
    if version.state in SERVING and engine in version.engines:
        version = attrs.evolve(version, engines=tuple(e for e in version.engines if e != engine))
    elif version.state is VersionState.RECLAIMING and engine in version.reclaim_pending:
        version = rec.confirm(version, version.reclaim_id or "", engine)[0]
    else:
        return Outcome(state, False, [Ignored(f"{key} on {engine}: not held there by the registry")])
    return Outcome(attrs.evolve(state, versions=state.versions.set(key, version)), True)


def abort_stale(state: RegistryState, c: AbortStale) -> Outcome:
    """Abort an active attempt whose publisher stopped (cleanup follows on every target)."""
    token, reason = c.token, c.reason
    state.attempt(token)
    return step_attempt(state, token, att.abort, reason)


def read_fleet(state: RegistryState, c: ReadFleet) -> Outcome:
    now = c.now
    needed = state.needed()
    cleaning, active = [], {}
    for token, a in state.attempts.items():
        if a.phase is Phase.ABORTED:
            cleaning.append(token)
        elif a.phase in att.ACTIVE:
            active[token] = att.progress(a)
    return Outcome(state, Fleet(
        epoch=state.epoch,
        engines=dict(state.engines),
        default=state.default,
        holders={v.key: frozenset(v.engines) for v in needed},
        missing=tuple(state.missing()),
        reclaimable=tuple(state.reclaimable()),
        reclaiming=tuple(sorted(k for k, v in state.versions.items() if v.state is VersionState.RECLAIMING)),
        cleaning=tuple(sorted(cleaning)),
        active=active,
        expired_sessions=state.expired_sessions,
        lease_ttl=state.lease_ttl,
        default_revision=state.default_revision,
        retiring=frozenset(k for k, v in state.versions.items() if v.retiring and v.state in SERVING),
        max_lag=state.max_lag,
        on_stale=state.on_stale,
        capacity=state.capacity,
        slots=state.slot_holders(),
        waiting=state.waiter,
        now=now,
        name_prefix=state.name_prefix,
        suspect={k: v.suspect for k, v in state.versions.items() if v.suspect is not None and v.state in SERVING},
        avoid_suspect=state.avoid_suspect,
        # every version whose adapter engines may hold as the registry knows it (loading, serving, being
        # unloaded, or failed and not yet cleaned): anything else managed of this epoch is an orphan
        lora_names={k: v.lora_name for k, v in state.versions.items()
                    if v.state in HELD_BY_ENGINES or v.state in (VersionState.LOADING, VersionState.ABORTED)},
        joining=state.in_state(Membership.JOINING),
        draining=state.in_state(Membership.DRAINING),
    ))

"""Reclaim: claim a retired version no one can use, and count its engines' unloads."""

from __future__ import annotations


import attrs

from lorapub.core.commands import ClaimReclaim, RecordUnloaded, RetryReclaim
from lorapub.core import reclaim as rec
from lorapub.core.effects import Ignored
from lorapub.core.facts import Claimed, Fact, Reclaimed, Unloaded
from lorapub.core.identity import VersionKey
from lorapub.core.version import VersionState, advance

from .state import Outcome, RegistryState

__all__ = ['claim_reclaim', 'record_unloaded', 'retry_reclaim']


# -- reclaim -------------------------------------------------------------------
def claim_reclaim(state: RegistryState, c: ClaimReclaim) -> Outcome:
    key = c.key
    version = state.version(key)
    new, effects = rec.claim(version, rec.reclaim_id_for(version, state.reclaim_seq + 1))
    if new is version:
        return Outcome(state, version.reclaim_id, effects)
    if not new.reclaim_pending:  # every holder restarted: nothing is loaded anywhere
        new = advance(new, VersionState.RECLAIMED)
    state = attrs.evolve(state, versions=state.versions.set(key, new), reclaim_seq=state.reclaim_seq + 1)
    return Outcome(state, new.reclaim_id, effects, [Claimed(key, new.reclaim_id or "")])


def record_unloaded(state: RegistryState, c: RecordUnloaded) -> Outcome:
    """One engine's UNLOADED receipt for ``reclaim_id`` (a late one from a removed engine changes nothing)."""
    key, reclaim_id, engine = c.key, c.reclaim_id, c.engine
    if engine not in state.engines:
        return Outcome(state, state.version(key).state, [Ignored(f"UNLOADED from {engine}, which is not a member")])
    version = state.version(key)
    new, effects = rec.confirm(version, reclaim_id, engine)
    if new is version:  # late, duplicate or foreign: counted nothing
        return Outcome(state, new.state, effects)
    facts: list[Fact] = [Unloaded(key, engine)]
    if new.state is VersionState.RECLAIMED:
        facts.append(Reclaimed(key))
    return Outcome(attrs.evolve(state, versions=state.versions.set(key, new)), new.state, effects, facts)


def retry_reclaim(state: RegistryState, c: RetryReclaim) -> Outcome:
    key = c.key
    version = state.version(key)
    if version.state is not VersionState.RECLAIMING:
        return Outcome(state, version.state, [Ignored(f"{key} is {version.state.value}; nothing to retry")])
    return Outcome(state, version.state, rec.sends(version))

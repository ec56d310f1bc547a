"""Fleet membership: an engine joins (no traffic until it holds every needed version), drains, leaves.

Membership is registry state, so every process of a shared registry and a restarted one see it.
See docs/elastic.md, "Growing and shrinking the fleet".
"""

from __future__ import annotations

import attrs

from lorapub.core.commands import AddEngine, DrainEngine, RegisterEngine, RemoveEngine
from lorapub.core import attempt as att
from lorapub.core.effects import Effect, Ignored
from lorapub.core.identity import check_id
from lorapub.errors import EngineNotDrained, InvalidInput, PublicationBlocked, UnknownEngine

from .publication import _put_attempt, drop_holdings, register_engine
from .state import Membership, Outcome, RegistryState

__all__ = ["add_engine", "admit_joined", "drain_engine", "remove_engine"]


def _member(state: RegistryState, engine: str) -> Membership:
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine!r} is not a member of this fleet (members: {', '.join(sorted(state.engines))})",
                            engine=engine)
    return state.membership(engine)


def add_engine(state: RegistryState, c: AddEngine) -> Outcome:
    """``engine`` joins: JOINING until it holds every needed version (the reconciler loads them there,
    as on an engine that restarted holding nothing), then SERVING. The reply is its membership."""
    engine, incarnation = c.engine, c.incarnation
    check_id("engine name", engine)
    if not isinstance(incarnation, str) or not incarnation:
        raise InvalidInput(f"an engine's incarnation is a non-empty str, got {incarnation!r}")
    effects: list[Effect] = []
    if engine in state.engines:
        out = register_engine(state, RegisterEngine(engine, incarnation))  # a new incarnation: a restart
        state, effects = out.state, list(out.effects)
        if state.membership(engine) is Membership.DRAINING:  # rejoins: loaded again with what it lacks
            state = attrs.evolve(state, members=state.members.set(engine, Membership.JOINING))
    else:
        state = attrs.evolve(
            state, engines=state.engines.set(engine, incarnation), members=state.members.set(engine, Membership.JOINING)
        )
    state = admit_joined(state)
    return Outcome(state, state.membership(engine), effects)


def admit_joined(state: RegistryState) -> RegistryState:
    """Every joining member that now holds every needed version, and that no running publication
    leaves out, becomes SERVING (run after each transition: the one door calls it)."""
    joining = [e for e, m in state.members.items() if m is Membership.JOINING]
    if not joining:
        return state
    needed = state.needed()
    running = state.unresolved_attempt()
    if running is not None and running.phase not in att.ACTIVE:
        running = None
    members = state.members
    for engine in joining:
        # a publication that started before it joined would make a default it lacks
        left_out = running is not None and running.target(engine) is None
        if not left_out and all(engine in v.engines for v in needed):
            members = members.remove(engine)
    return state if members is state.members else attrs.evolve(state, members=members)


def drain_engine(state: RegistryState, c: DrainEngine) -> Outcome:
    """``engine`` takes no new binding and is left out of new publications; the reply is its membership."""
    engine = c.engine
    if _member(state, engine) is Membership.DRAINING:
        return Outcome(state, Membership.DRAINING, [Ignored(f"{engine} is already draining")])
    others = state.in_state(Membership.SERVING) - {engine}
    if not others:
        raise InvalidInput(
            f"engine {engine} is the only member that takes traffic; add another engine (and let it join) "
            "before draining it", engine=engine,
        )
    state = attrs.evolve(state, members=state.members.set(engine, Membership.DRAINING))
    return Outcome(state, Membership.DRAINING)


def remove_engine(state: RegistryState, c: RemoveEngine) -> Outcome:
    """``engine`` leaves: it no longer holds any version as the registry counts them, reclaims stop
    waiting for it, and what attempts asked of it counts as cleaned. Without ``force`` only a draining
    member goes, once no publication still needs it."""
    engine, force = c.engine, c.force
    membership = _member(state, engine)
    if membership is not Membership.DRAINING and not force:
        raise EngineNotDrained(
            f"engine {engine} is {membership.value}: drain it first (`await deployment.drain_engine({engine!r})`), "
            "or remove it once it is unreachable", engine=engine,
        )
    if not state.in_state(Membership.SERVING) - {engine}:
        raise InvalidInput(f"engine {engine} is the only member that takes traffic; add another engine first",
                           engine=engine)
    running = state.unresolved_attempt()
    if (not force and running is not None and (t := running.target(engine)) is not None
            and t.state is not att.TargetState.CLEANED):
        raise PublicationBlocked(
            f"attempt {running.token} ({running.phase.value}) still needs {engine}; remove it once that attempt "
            "ends (or is cleaned)", attempt=running.token, engine=engine, phase=running.phase.value,
        )
    effects: list[Effect] = []
    # versions: no longer held there; a reclaim has nothing left to wait for there
    state = drop_holdings(state, engine)
    # attempts: a publication still loading there aborts (forced); re-provisioning there ends
    reprovisions = state.reprovisions
    for (where, key), token in state.reprovisions.items():
        if where == engine:
            new, _ = att.on_engine_removed(state.attempts[token], engine)
            state = attrs.evolve(state, attempts=state.attempts.set(token, new))
            reprovisions = reprovisions.remove((where, key))
    state = attrs.evolve(state, reprovisions=reprovisions)
    if running is not None:
        new, fx = att.on_engine_removed(running, engine)
        state = _put_attempt(state, new)
        effects += fx
    state = attrs.evolve(state, engines=state.engines.remove(engine), members=state.members.discard(engine))
    return Outcome(admit_joined(state), True, effects)

"""The pure half of the fleet view (lorapub.core.fleet_view.FleetFacts): what a process decides from the
registry's views and its own bindings alone — routes, lag, stale, gone — each fact giving a new value."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, strategies as st

from lorapub.core.fleet_view import FleetFacts
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.registry import Fleet
from lorapub.core.session import Binding

V = [VersionKey(1, f"v{i}") for i in range(4)]


def fleet(revision: int, default: VersionKey | None, holders: dict[VersionKey, frozenset[str]], **kw) -> Fleet:
    return Fleet(1, {"e0": "i0", "e1": "i1"}, default, holders, (), (), (), (), {}, 0, 30.0,
                 default_revision=revision, **kw)


def binding(version: VersionKey, revision: int) -> Binding:
    return Binding(SessionKey(1, "s", "n"), version, "lora", "d" * 8, revision)


def test_before_any_view_every_engine_is_a_candidate_and_nothing_is_gone():
    facts = FleetFacts()
    assert facts.holders(V[0]) is None and not facts.gone(binding(V[0], 0)) and facts.lag(binding(V[0], 0)) == 0


def test_a_view_routes_around_joining_members_and_a_later_view_says_a_version_is_gone():
    facts = FleetFacts().seen(fleet(1, V[0], {V[0]: frozenset({"e0", "e1"})}, joining=frozenset({"e1"})))
    assert facts.holders(V[0]) == {"e0"} and facts.joining == {"e1"}
    b = binding(V[0], 1)
    assert not facts.gone(b)
    later = facts.seen(fleet(3, V[1], {V[1]: frozenset({"e0"})}, retiring=frozenset({V[0]}), max_lag=1))
    assert later.gone(b) and later.is_stale(b) and later.lag(b) == 2
    assert not facts.gone(b)  # the earlier value is unchanged: each fact gives a new one
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        later.default_revision = 0  # type: ignore[misc]


def test_a_binding_newer_than_the_views_is_learned_and_never_undone_by_an_older_view():
    facts = FleetFacts(max_lag=0).bound(binding(V[2], 5))
    assert (facts.default, facts.default_revision) == (V[2], 5)
    assert facts.is_stale(binding(V[1], 4))  # a default past max_lag seen by a bind, before any view says so
    older = facts.seen(fleet(4, V[1], {V[1]: frozenset({"e0"}), V[2]: frozenset({"e0"})}))
    assert (older.default, older.default_revision, older.view_revision) == (V[2], 5, 4)
    assert not older.gone(binding(V[2], 5))  # a view older than the binding says nothing of it


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.sampled_from(V)), max_size=30))
def test_the_default_revision_is_the_newest_seen_and_the_default_is_its_version(steps):
    facts, newest, default = FleetFacts(), 0, None
    for is_view, revision, version in steps:
        facts = facts.seen(fleet(revision, version, {version: frozenset({"e0"})})) if is_view \
            else facts.bound(binding(version, revision))
        if revision > newest or (is_view and revision == newest):
            default = version
        newest = max(newest, revision)
        assert facts.default_revision == newest and facts.default == default
        assert all(facts.lag(binding(v, r)) >= 0 for v in V for r in (0, newest, newest + 1))

"""Deployment's options as one validated value (lorapub.DeploymentSettings): the keywords build it, or it
is passed whole; a bad value is the same typed INVALID_INPUT either way, naming what to pass."""

from __future__ import annotations

import inspect

import attrs
import pytest
from hypothesis import given, strategies as st

from lorapub import Deadlines, Deployment, DeploymentSettings, InvalidInput
from lorapub.testing import MemoryEngine

BAD = [
    ({"epoch": "run-7"}, r"epoch= must be an int >= 0"),
    ({"capacity": 1}, r"capacity must be an int >= 2"),
    ({"max_lag": -1}, r"max_lag must be an int >= 0"),
    ({"on_stale": "skip"}, r"on_stale must be one of"),
    ({"capacity": 2, "max_lag": 1}, r"capacity 2 cannot serve max_lag=1"),
    ({"avoid_suspect": "yes"}, r"avoid_suspect must be True or False"),
    ({"lease_ttl": 0}, r"lease_ttl must be a positive number of seconds or None"),
    ({"idle_ttl": True}, r"idle_ttl must be a positive number of seconds or None"),
    ({"bucket_cap_bytes": 0}, r"bucket_cap_bytes must be a positive int"),
    ({"deadlines": {"begin": 3}}, r"deadlines must be a lorapub.Deadlines"),
    ({"reclaim_retries": -1}, r"reclaim_retries must be an int >= 0"),
    ({"reclaim_backoff": float("inf")}, r"reclaim_backoff must be a finite number"),
    ({"status": ("127.0.0.1", 70000)}, r"status must be \(host, port\)"),
    ({"status": ("0.0.0.0", 0)}, r"give status_token="),
]


def engines() -> dict[str, MemoryEngine]:
    return {"e0": MemoryEngine("e0")}


@pytest.mark.parametrize("options, message", BAD, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD)])
def test_a_bad_setting_is_the_same_typed_refusal_from_the_value_and_from_the_keyword(options, message):
    options = {"epoch": 1, **options}
    with pytest.raises(InvalidInput, match=message) as made:
        DeploymentSettings(**options)
    with pytest.raises(InvalidInput, match=message) as kw:
        Deployment(engines(), **options)
    assert made.value.code == kw.value.code == "INVALID_INPUT"
    assert made.value.message == kw.value.message


def test_settings_passed_whole_are_the_deployments_and_a_keyword_beside_them_is_refused():
    settings = DeploymentSettings(epoch=3, capacity=4, max_lag=2, lease_ttl=60.0)
    dep = Deployment(engines(), settings=settings)
    assert dep.settings is settings
    assert (dep.epoch, dep.capacity, dep.max_lag, dep.on_stale, dep.lease_ttl) == (3, 4, 2, "rebind", 60.0)
    assert isinstance(dep.deadlines, Deadlines)
    with pytest.raises(InvalidInput, match=r"capacity=.*beside it") as e:
        Deployment(engines(), settings=settings, capacity=6)
    assert e.value.code == "INVALID_INPUT"
    assert Deployment(engines(), epoch=3, settings=settings).settings is settings  # deploy() passes epoch= too
    with pytest.raises(InvalidInput, match=r"settings must be a lorapub.DeploymentSettings"):
        Deployment(engines(), settings={"epoch": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"capacity must be an int >= 2"):
        attrs.evolve(settings, capacity=1)  # a changed copy is checked again
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.capacity = 6  # type: ignore[misc]


def test_the_keywords_build_the_same_value_and_share_its_defaults():
    dep = Deployment(engines(), epoch=2, max_lag=0, capacity=3)
    assert dep.settings == DeploymentSettings(epoch=2, max_lag=0, capacity=3)
    keywords = inspect.signature(Deployment.__init__).parameters
    for field in attrs.fields(DeploymentSettings):
        if field.name in ("epoch", "deadlines"):  # required / None for Deadlines()
            assert keywords[field.name].default is None
        else:
            assert keywords[field.name].default == field.default, field.name


def test_without_a_capacity_max_lag_is_checked_against_the_registry_the_deployment_makes():
    DeploymentSettings(epoch=1, max_lag=5)  # may go to a shared registry with room for it
    with pytest.raises(InvalidInput, match=r"capacity 2 cannot serve max_lag=5"):
        Deployment(engines(), epoch=1, max_lag=5)


@given(capacity=st.one_of(st.none(), st.integers(-2, 8)), max_lag=st.one_of(st.none(), st.integers(-1, 8)),
       seconds=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-3, 3), st.booleans()))
def test_a_setting_is_either_accepted_or_refused_as_invalid_input_never_anything_else(capacity, max_lag, seconds):
    try:
        made = DeploymentSettings(epoch=1, capacity=capacity, max_lag=max_lag, reconcile_interval=seconds)
    except InvalidInput as e:
        assert e.code == "INVALID_INPUT" and e.message
    else:
        assert made.capacity is None or made.capacity >= 2
        assert made.reconcile_interval is None or made.reconcile_interval > 0

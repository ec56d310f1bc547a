"""The single-writer registry: applies core transitions, never awaits inside one.

:class:`RegistryService` is synchronous on purpose: each call reads the state,
computes the transition and stores it with no suspension point in between, so
it is a correct single writer under asyncio and inside a Ray actor alike.
:class:`LocalRegistry` is the in-process async face of it (the default);
``lorapub.adapters.ray_registry`` offers the same async face over a Ray actor.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from lorapub.core import registry as R
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import Effect
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey
from lorapub.core.manifest import BucketPlan
from lorapub.core.registry import RegistryState


@attrs.frozen
class Result:
    reply: Any
    effects: tuple[Effect, ...] = ()


class MemoryStore:
    def __init__(self) -> None:
        self._state: RegistryState | None = None

    def load(self) -> RegistryState | None:
        return self._state

    def save(self, state: RegistryState) -> None:
        self._state = state


class RegistryService:
    def __init__(
        self,
        epoch: int,
        engines: Mapping[str, str],
        capacity: int = R.DEFAULT_CAPACITY,
        store: Any | None = None,
    ) -> None:
        self._store = store or MemoryStore()
        self._state = self._store.load() or R.new_registry(epoch, engines, capacity)
        self._store.save(self._state)
        self.transitions = 0

    @property
    def state(self) -> RegistryState:
        return self._state

    def _apply(self, fn: Callable[..., R.Outcome], *args: Any) -> Result:
        outcome = fn(self._state, *args)  # raises typed errors, state untouched
        self._state = outcome.state
        self._store.save(outcome.state)
        self.transitions += 1
        return Result(outcome.reply, tuple(outcome.effects))

    # publication
    def register_engine(self, engine: str, incarnation: str) -> Result:
        return self._apply(R.register_engine, engine, incarnation)

    def reserve(self, key: VersionKey, digest: str, plan: BucketPlan) -> Result:
        return self._apply(R.reserve, key, digest, plan)

    def record_prepared(self, token: AttemptToken, engine: str, incarnation: str) -> Result:
        return self._apply(R.record_prepared, token, engine, incarnation)

    def record_bucket_done(self, token: AttemptToken, party: str, index: int, incarnation: str | None = None) -> Result:
        return self._apply(R.record_bucket_done, token, party, index, incarnation)

    def record_ready(self, receipt: ReadyLocal) -> Result:
        return self._apply(R.record_ready, receipt)

    def record_failure(self, token: AttemptToken, engine: str, reason: str) -> Result:
        return self._apply(R.record_failure, token, engine, reason)

    def record_unknown(self, token: AttemptToken, engine: str, operation: str) -> Result:
        return self._apply(R.record_unknown, token, engine, operation)

    def record_cleaned(self, token: AttemptToken, engine: str, incarnation: str) -> Result:
        return self._apply(R.record_cleaned, token, engine, incarnation)

    def retry_cleanup(self, token: AttemptToken) -> Result:
        return self._apply(R.retry_cleanup, token)

    def commit(self, key: VersionKey, token: AttemptToken, expected_default_revision: int) -> Result:
        return self._apply(R.commit, key, token, expected_default_revision)

    def query_attempt(self, token: AttemptToken) -> R.AttemptStatus:
        return R.query_attempt(self._state, token)

    # sessions
    def open_session(self, key: SessionKey) -> Result:
        return self._apply(R.open_session, key)

    def bind_first(self, key: SessionKey) -> Result:
        return self._apply(R.bind_first, key)

    def begin_close(self, key: SessionKey) -> Result:
        return self._apply(R.begin_close, key)

    def close_and_release(self, key: SessionKey) -> Result:
        return self._apply(R.close_and_release, key)

    def forget_sessions(self, keys: list[SessionKey]) -> Result:
        return self._apply(R.forget_sessions, keys)

    def authorize_dispatch(self, key: SessionKey):
        return R.authorize_dispatch(self._state, key)

    # reclaim
    def claim_reclaim(self, key: VersionKey) -> Result:
        return self._apply(R.claim_reclaim, key)

    def confirm_reclaim(self, key: VersionKey, reclaim_id: str, engine: str) -> Result:
        return self._apply(R.confirm_reclaim, key, reclaim_id, engine)

    def retry_reclaim(self, key: VersionKey) -> Result:
        return self._apply(R.retry_reclaim, key)

    def version(self, key: VersionKey):
        """One version's record (cheap over an actor boundary, unlike snapshot())."""
        return self._state.version(key)

    def reclaimable(self) -> list[VersionKey]:
        return self._state.reclaimable()

    def snapshot(self) -> RegistryState:
        return self._state


_SYNC_METHODS = [
    name for name, value in vars(RegistryService).items() if callable(value) and not name.startswith("_")
]


class LocalRegistry:
    """Async face of an in-process :class:`RegistryService` (the embedded default)."""

    def __init__(self, service: RegistryService) -> None:
        self.service = service

    def __getattr__(self, name: str):
        if name not in _SYNC_METHODS:
            raise AttributeError(name)
        method = getattr(self.service, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        call.__name__ = name
        return call

"""The registry as a named Ray actor, so every rollout process shares one single writer: the actor
runs a :class:`~lorapub.local_registry.LocalRegistry` one call at a time, typed errors come back
as the same lorapub class, and only a lost reply is :class:`~lorapub.errors.OutcomeUnknown`.
See docs/design.md, "Durable store".
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time
import weakref
from typing import Any, Callable, Mapping, TypedDict, TypeVar, cast

import attrs
import ray

from lorapub import errors
from lorapub.core.commands import Command, Returns
from lorapub.core.registry import (
    COMMANDS, DEFAULT_LEASE_TTL, RegistryState, Result, check_capacity, check_max_lag, check_room_for_lag)
from lorapub.ports import RegistryStore
from lorapub.core.identity import MANAGED_PREFIX
from lorapub.local_registry import LocalRegistry
from lorapub.adapters.stores import SQLiteStore

R_ = TypeVar("R_")  # a command's reply type

__all__ = ["RegistryActor", "RayRegistry"]

_ERRORS = {
    cls.code: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.LorapubError)
}


#: A call's answer as it crosses the actor boundary: ("ok", a Result) or ("error", (code, message,
#: details)); an actor of an earlier release answers (code, message). Read only after the tag is checked.
_Reply = tuple[str, Any]


class _Options(TypedDict):
    """The actor's LocalRegistry keyword options (as LocalRegistry names them)."""

    lease_ttl: float | None
    max_lag: int | None
    on_stale: str | None
    name_prefix: str
    avoid_suspect: bool
    clock: Callable[[], float]


class _RunningClock:
    """The registry's time inside the actor: wall time read once (or, for a resumed store, the last
    time a lease was granted: :meth:`go_on_from`), then advanced only while this process runs.

    A stop of the process (SIGSTOP, a debugger, a frozen container) is left out, so lease ages
    never count time in which no worker could have renewed: when the actor resumes, commands
    queued during the stop (an expiry pass before the renewals) find every lease as it was. A
    daemon thread notes the time every ``tick``; a gap longer than ``tick + slack`` between two
    notes (seen by the thread, or by the first reading after the stop) is a stop. A step that
    holds the interpreter that long counts as one too: a lease may outlive its TTL by that much,
    never the other way."""

    # time.monotonic and time.time by default: it runs in the actor's own process, which no deployment's clock
    # reaches (a test passes its own readings)
    def __init__(self, tick: float = 0.25, slack: float = 2.0, *, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, beat: bool = True) -> None:
        self._monotonic, self._wall = monotonic, wall
        self._offset = wall() - monotonic()
        self._tick, self._slack = tick, slack
        self._last = monotonic()
        self.stopped = 0.0  # seconds left out so far
        self._lock = threading.Lock()
        if beat:
            threading.Thread(target=_beat, args=(weakref.ref(self), tick), name="lorapub-registry-clock",
                             daemon=True).start()

    def _note(self) -> float:
        with self._lock:
            now = self._monotonic()
            gap = now - self._last
            if gap > self._tick + self._slack:
                self.stopped += gap - self._tick
            self._last = now
            return now - self.stopped

    def __call__(self) -> float:
        return self._offset + self._note()

    def go_on_from(self, at: float) -> None:
        """Go on from ``at``, a time an earlier life of the registry stamped (never ahead of wall
        time): the time between the two lives is left out as a stop is. Called before the first reading."""
        with self._lock:
            current = self._offset + self._monotonic() - self.stopped
            target = min(at, self._wall())
            if target < current:
                self.stopped += current - target


def _beat(clock: "weakref.ref[_RunningClock]", tick: float) -> None:
    """The clock's thread: notes the time every ``tick`` while the clock is in use (it holds no
    reference to it, so a clock nobody uses ends its thread)."""
    while True:
        time.sleep(tick)
        alive = clock()
        if alive is None:
            return
        alive._note()
        del alive


class _RegistryActor:
    """Opens its registry lazily: a store that cannot be opened answers every call with its
    typed error (and is tried again on the next call) instead of killing the actor, which
    callers would only see as a lost reply."""

    def __init__(
        self, epoch: int, engines: Mapping[str, str], capacity: int, store_path: str | None = None,
        store_factory: Callable[[], RegistryStore] | None = None, lease_ttl: float | None = DEFAULT_LEASE_TTL,
        max_lag: int | None = None, on_stale: str | None = None, name_prefix: str = MANAGED_PREFIX,
        avoid_suspect: bool = False,
    ) -> None:
        self.clock = _RunningClock()
        if store_factory is None and store_path:
            store_factory = functools.partial(SQLiteStore, store_path)  # durable: a restarted actor resumes
        self._open_args = (epoch, dict(engines), capacity)
        self._options = _Options(lease_ttl=lease_ttl, max_lag=max_lag, on_stale=on_stale, name_prefix=name_prefix,
                                 avoid_suspect=avoid_suspect, clock=self.clock)
        self._store_factory = store_factory
        self.registry: LocalRegistry | None = None
        try:
            self._registry()
        except Exception:
            pass  # answered to every caller by handle(), typed, and tried again there
        if _owns_its_process():
            # This process is the registry's alone: take what Ray's worker and the imports made
            # (hundreds of thousands of objects) out of every later collection. A full collection
            # of them took 42-43 ms inside a batch (the p99 of 100 callers); the registry's own
            # state is built to cost the collector almost nothing (docs/benchmarks.md, Part 2).
            gc.collect()
            gc.freeze()

    def _registry(self) -> LocalRegistry:
        if self.registry is None:
            store = self._store_factory() if self._store_factory is not None else None
            try:
                self.registry = LocalRegistry(*self._open_args, store=store, **self._options)
            except BaseException:
                if store is not None and hasattr(store, "close"):
                    store.close()  # release the file so the next try (or an operator) can open it
                raise
            last = _last_lease_granted(self.registry.state)
            if last is not None:  # a resumed store: its leases' ages leave out the time no actor ran
                self.clock.go_on_from(last)
        return self.registry

    def handle_many(self, commands: list[Command]) -> list[_Reply]:
        """A batch from one caller process, applied in order, each answered on its own, made
        durable by one group commit (one actor call and one fsync instead of one per command:
        what lets 100 callers share the actor)."""
        bad = [c for c in commands if not isinstance(c, COMMANDS)]
        if bad:
            return [self.handle(c) for c in commands]  # each answered (and refused) on its own
        try:
            answers = self._registry().apply_many(list(commands))
        except errors.LorapubError as e:
            return [("error", _refusal(e))] * len(commands)
        except Exception:
            # a command the transitions could not read (a malformed field): apply_many changed
            # nothing, so the batch is applied again one command at a time, each answered alone
            return [self.handle(c) for c in commands]
        return [("error", _refusal(a)) if isinstance(a, errors.LorapubError) else ("ok", a) for a in answers]

    def handle(self, command: Command) -> _Reply:
        if not isinstance(command, COMMANDS):
            return ("error", ("INVALID_INPUT", f"{command!r} is not a registry command"))
        try:
            return ("ok", self._registry().apply(command))
        except errors.LorapubError as e:
            return ("error", _refusal(e))
        except Exception as e:  # a definite answer all the same: nothing was applied
            # the store's failures arrive typed (StoreError), so what is left is a transition that
            # could not read the command: a field of the wrong type or form
            return ("error", ("INVALID_INPUT", f"registry refused {_short(command)}: its transition failed on it "
                                               f"({type(e).__name__}: {e}); nothing was applied; build "
                                               f"{type(command).__name__} with fields of the documented types"))

def _last_lease_granted(state: RegistryState) -> float | None:
    """The latest time a stored lease was granted or renewed (a lower bound of the registry's time
    when its last life ended), None without leases."""
    if state.lease_ttl is None:
        return None
    deadlines = [r.lease_until for r in state.sessions.values() if r.lease_until is not None]
    return max(deadlines) - state.lease_ttl if deadlines else None


def _owns_its_process() -> bool:
    """True in a Ray worker process (an actor's own), never in a driver or local mode."""
    try:
        return bool(ray.get_runtime_context().worker.mode == ray.WORKER_MODE)
    except Exception:  # noqa: BLE001 - no Ray context: a plain object in someone's process
        return False


RegistryActor = ray.remote(num_cpus=0)(_RegistryActor)


class RayRegistry:
    """A :class:`~lorapub.ports.Registry` over a named actor (create once, look up from any process).

    The actor runs a :class:`~lorapub.local_registry.LocalRegistry` with Ray's default
    one-call-at-a-time concurrency: each command is applied whole before the next call starts.
    Every typed error raised in the actor (a rejection, and a store that cannot be read, is
    corrupted, belongs to another epoch or cannot save) crosses the process boundary as (code,
    message) and is raised again here as the same lorapub class with the same code. Only a call
    whose reply is lost (actor unreachable or dead, timeout) is
    :class:`~lorapub.errors.OutcomeUnknown`; every registry command is safe to replay. A reply
    lost while Ray restarts a durable actor is asked again here, within ``call_timeout``; an
    actor made again under the handle's name (the old one gone for good) is found at the first
    lost reply, which stays unknown.

    With ``batch=True`` (the default) the commands that callers of one process submit in
    the same event-loop turn travel in **one** actor call and are applied in submission
    order, each answered (or rejected) on its own; a lost batch reply is OutcomeUnknown
    for each of its commands, which are all safe to replay. A command Ray cannot serialize,
    or one the registry cannot read (a field of the wrong type), is
    :class:`~lorapub.errors.InvalidInput` alone; the rest of its batch is applied and answered.
    """

    def __init__(self, handle: Any, call_timeout: float = 30.0, *, batch: bool = True, max_batch: int = 512,
                 name: str | None = None, namespace: str = "lorapub") -> None:
        self.actor = handle
        self.call_timeout = call_timeout
        self.batch = batch
        self.max_batch = max_batch
        # how a restarted or re-created actor is found again (create() and lookup() set it; a handle
        # wrapped without a name never asks a lost reply again: it is OutcomeUnknown at once)
        self.name, self.namespace = name, namespace
        self._pending: list[tuple[Command, asyncio.Future[_Reply]]] = []
        self._flush_scheduled = False
        self.calls = 0  # actor calls made (for benchmarks)

    @classmethod
    def create(
        cls, name: str, epoch: int, engines: Mapping[str, str], capacity: int = 2, namespace: str = "lorapub",
        store_path: str | None = None, store_factory: Callable[[], RegistryStore] | None = None,
        call_timeout: float = 30.0, lease_ttl: float | None = DEFAULT_LEASE_TTL, batch: bool = True,
        max_lag: int | None = None, on_stale: str | None = None, name_prefix: str = MANAGED_PREFIX,
        avoid_suspect: bool = False,
    ) -> "RayRegistry":
        """A durable store lets Ray restart the actor without losing its state.

        ``store_path`` keeps it in a :class:`~lorapub.adapters.stores.SQLiteStore` at that
        path (on the actor's node); ``store_factory`` builds any other store inside the
        actor (it is pickled there), e.g. ``functools.partial(FileStore, path)``.

        An actor that already lives under ``name`` is shared as it is (its settings are its own);
        one made for another epoch is refused (:class:`~lorapub.errors.EpochMismatch`): a new
        epoch needs a new actor.
        """
        # refused here, before a detached actor is made that could only fail its every call
        check_capacity(capacity)
        on_stale = check_max_lag(max_lag, on_stale)
        check_room_for_lag(capacity, max_lag)
        found: Any  # an actor handle: Ray's stubs type an ActorHandle's methods as Never
        try:
            found = ray.get_actor(name, namespace=namespace)
        except ValueError:  # no actor under that name: make it (Ray settles a race between two makers)
            durable = bool(store_path) or store_factory is not None
            found = RegistryActor.options(
                name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                max_restarts=-1 if durable else 0, max_task_retries=0,
            ).remote(epoch, dict(engines), capacity, store_path, store_factory, lease_ttl, max_lag, on_stale,
                     name_prefix, avoid_suspect)
        else:
            _check_epoch_of(found, name, namespace, epoch, call_timeout)
        return cls(found, call_timeout=call_timeout, batch=batch, name=name, namespace=namespace)

    @classmethod
    def lookup(cls, name: str, namespace: str = "lorapub", call_timeout: float = 30.0, batch: bool = True) -> "RayRegistry":
        return cls(ray.get_actor(name, namespace=namespace), call_timeout=call_timeout, batch=batch, name=name,
                   namespace=namespace)

    async def handle(self, command: Returns[R_]) -> Result[R_]:
        if not self.batch:
            try:
                ref = self.actor.handle.remote(command)
            except Exception as e:  # noqa: BLE001 - Ray could not send it: nothing was applied
                raise _not_sendable(command) or _not_sent(type(command).__name__, e) from None
            try:
                return _answer(command, await self._reply(ref, "handle", command, type(command).__name__))
            except _Unread as e:
                raise _unreadable(command, e.cause) from None
        future: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._pending.append((cast(Command, command), future))  # every Returns is a Command
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)
        return _answer(command, await future)

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            asyncio.ensure_future(self._flush(batch))

    async def _flush(self, batch: list[tuple[Command, asyncio.Future[_Reply]]]) -> None:
        try:
            await self._send(batch)
        except BaseException as e:  # every caller is answered, whatever happened to its batch
            # anything but a typed answer may come after the batch left: unknown, never "not applied"
            failure = e if isinstance(e, errors.LorapubError) else errors.OutcomeUnknown(
                f"registry batch of {len(batch)}: no reply ({type(e).__name__}: {e})")
            for _, future in batch:
                if not future.done():
                    future.set_exception(type(failure)(failure.message, **failure.details))
            if not isinstance(e, Exception):
                raise

    async def _send(self, batch: list[tuple[Command, asyncio.Future[_Reply]]]) -> None:
        commands = [c for c, _ in batch]
        try:
            ref = self.actor.handle_many.remote(commands)
        except Exception as e:  # noqa: BLE001 - Ray refused to serialize the batch: nothing was sent
            sendable = []
            for command, future in batch:
                refusal = _not_sendable(command)
                if refusal is None:
                    sendable.append((command, future))
                elif not future.done():
                    future.set_exception(refusal)  # refused alone; the rest of its batch goes on
            if len(sendable) == len(batch):  # no one command is to blame
                raise _not_sent(f"batch of {len(batch)}", e) from None
            if sendable:
                await self._send(sendable)
            return
        try:
            answers = await self._reply(ref, "handle_many", commands, f"batch of {len(batch)}")
        except _Unread as e:  # nothing was applied: each command goes alone, so only the unread one fails
            if len(batch) == 1:
                raise _unreadable(commands[0], e.cause) from None
            await self._send_one_by_one(batch)
            return
        for (_, future), answer in zip(batch, answers):
            if not future.done():
                future.set_result(answer)

    async def _send_one_by_one(self, batch: list[tuple[Command, asyncio.Future[_Reply]]]) -> None:
        sent = [(c, f, self.actor.handle.remote(c)) for c, f in batch]  # one caller's calls run in this order
        for command, future, ref in sent:
            try:
                answer = await self._reply(ref, "handle", command, type(command).__name__)
            except _Unread as e:
                outcome: errors.LorapubError = _unreadable(command, e.cause)
            except errors.LorapubError as e:
                outcome = e
            else:
                if not future.done():
                    future.set_result(answer)
                continue
            if not future.done():
                future.set_exception(outcome)

    async def _reply(self, ref: Any, method: str, argument: Any, what: str) -> Any:
        """The actor's answer to ``ref``. A reply lost because the actor died while Ray restarts it
        (a durable actor) is asked again, within ``call_timeout`` of the first send: every command
        is safe to replay, and a close in flight then lands once the actor is back instead of
        holding its slot until the caller's next lease round."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.call_timeout, 0.05  # bounds a call to the actor (I/O): real time
        while True:
            self.calls += 1
            actor = self.actor
            try:
                return await asyncio.wait_for(ref, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise errors.OutcomeUnknown(
                    f"registry {what}: no reply within call_timeout={self.call_timeout}s (TimeoutError)") from None
            except ray.exceptions.RayActorError as e:  # ActorDiedError, ActorUnavailableError
                if loop.time() + pause >= deadline or not self._restarting(actor):
                    raise errors.OutcomeUnknown(f"registry {what}: no reply ({type(e).__name__})") from None
            except ray.exceptions.RayTaskError as e:
                # definite, not lost: the actor's methods answer every failure of a command, so what
                # raises is Ray reading the argument there, before anything was applied
                raise _Unread(e.cause) from None
            except ray.exceptions.RayError as e:  # the reply's object lost, a system error: it may have run
                raise errors.OutcomeUnknown(f"registry {what}: no reply ({type(e).__name__}: {e})") from None
            await asyncio.sleep(pause)  # waits for the actor to restart (I/O): real time
            pause = min(2 * pause, 1.0)
            ref = getattr(actor, method).remote(argument)

    def _restarting(self, actor: Any) -> bool:
        """Whether ``actor``, which lost a reply, still stands under its name (Ray restarts it). An actor
        gone for good is not: where another was made under the name, this handle turns to it for the next
        call, while the lost reply stays unknown (the new actor never saw the command)."""
        if self.name is None:
            return False
        try:
            found = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:  # gone, and no successor yet
            return False
        if found._actor_id == actor._actor_id:
            return True
        if self.actor is actor:
            self.actor = found
        return False


def _epoch_of(actor: "_RegistryActor") -> int:
    return actor._open_args[0]


def _check_epoch_of(actor: Any, name: str, namespace: str, epoch: int, timeout: float) -> None:
    """Refuse to share an actor made for another epoch (its store and sessions are that epoch's)."""
    try:
        serves = ray.get(actor.__ray_call__.remote(_epoch_of), timeout=timeout)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise errors.OutcomeUnknown(
            f"registry actor {name!r} (namespace {namespace!r}) exists but did not say which epoch it serves "
            f"within {timeout}s ({type(e).__name__}); try again") from None
    if serves != epoch:
        raise errors.EpochMismatch(
            f"registry actor {name!r} (namespace {namespace!r}) serves deployment epoch {serves}, not epoch {epoch}: "
            f"a new epoch needs its own actor: create it under another name (e.g. '{name}-e{epoch}'), or end the "
            f"old one first (ray.kill(ray.get_actor({name!r}, namespace={namespace!r})))")


def _not_sendable(command: object) -> errors.InvalidInput | None:
    """The typed refusal of a command Ray cannot serialize, naming the field that cannot be; None
    when the command serializes."""
    try:
        # Ray's vendored cloudpickle is unannotated
        ray.cloudpickle.dumps(command)  # type: ignore[no-untyped-call]
        return None
    except Exception as e:  # noqa: BLE001 - any pickling failure is the command's
        error = e
    cls = type(command)
    what = cls.__name__
    if attrs.has(cls):
        for field in attrs.fields(cls):
            value = getattr(command, field.name)
            try:
                ray.cloudpickle.dumps(value)  # type: ignore[no-untyped-call]  # as above
            except Exception as e:  # noqa: BLE001
                what, error = f"{what}.{field.name} (a {type(value).__name__})", e
                break
    return errors.InvalidInput(f"{what} cannot be sent to the registry actor ({_first_line(error)}); nothing was "
                               "sent: registry commands hold plain values (str, int, lorapub's keys)")


class _Unread(Exception):
    """The actor's process could not read the call's argument (nothing was applied)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


def _unreadable(command: object, cause: BaseException) -> errors.InvalidInput:
    return errors.InvalidInput(
        f"the registry actor could not read {type(command).__name__} ({type(cause).__name__}: {_first_line(cause)}); "
        "nothing was applied: registry commands hold plain values every process can import")


def _not_sent(what: str, error: Exception) -> errors.LorapubError:
    """Ray refused to send a call whose every command serializes: nothing reached the actor."""
    return errors.LorapubError(f"registry {what}: Ray could not send it ({type(error).__name__}: "
                               f"{_first_line(error)}); nothing was applied, send it again")


def _short(command: object) -> str:
    text = repr(command)
    return text if len(text) <= 300 else text[:300] + "…"


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _refusal(e: errors.LorapubError) -> tuple[str, str, dict[str, Any]]:
    """A typed refusal as it crosses the actor boundary: its code, message and details (the caller
    reads details, e.g. CapacityError's ``held_by_sessions``, as it would in one process)."""
    return e.code, e.message, dict(e.details)


def _answer(command: Returns[R_], answer: _Reply) -> Result[R_]:
    status, value = answer
    if status == "error":
        code, message, details = value if len(value) == 3 else (*value, {})  # an actor of an earlier release: no details
        cls = _ERRORS.get(code)
        if cls is None:
            raise errors.LorapubError(f"{code}: {message}", **details)
        raise cls(message, **details)
    return cast("Result[R_]", value)  # tagged "ok": the actor's LocalRegistry answered this command

"""The pre-lorapub path, kept behaviour-for-behaviour for ``enabled=False``:
pause generation, flush the KV cache, overwrite one fixed adapter name, resume.

Its own type (:class:`OverwriteDeployment`), with its own port (:class:`~lorapub.ports.OverwriteAdmin`);
:func:`lorapub.runtime.deployment.deploy` is the one switch between it and the versioned ``Deployment``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from typing import Any, Awaitable, Callable, Mapping

from lorapub.core.identity import LORA_NAME_PREFIX, check_id
from lorapub.errors import EngineError, InvalidInput, LorapubError, OutcomeUnknown
from lorapub.ports import OverwriteAdmin
from lorapub.snapshot import Snapshot

__all__ = ["FIXED_LORA_NAME", "OverwritePublisher", "OverwriteSession", "OverwriteDeployment"]

FIXED_LORA_NAME = LORA_NAME_PREFIX


def _typed(engine: str, op: str, error: BaseException) -> LorapubError:
    """An engine call's failure as the port allows it: typed errors as they are, anything else unknown."""
    if isinstance(error, LorapubError):
        return error
    return OutcomeUnknown(f"{engine} {op}: {type(error).__name__}: {error}", engine=engine)


class OverwritePublisher:
    def __init__(self, engines: Mapping[str, OverwriteAdmin], stash_dir: str | None,
                 lora_name: str = FIXED_LORA_NAME) -> None:
        self.engines = dict(engines)
        # None: a private directory (0700, unpredictable name) made at the first update and removed
        # by release_private_stash(); a fixed shared path under /tmp could be pre-created by anyone,
        # and one made at construction would outlive an owner never closed.
        self.stash_dir = stash_dir
        self.private_stash: str | None = None
        self.lora_name = lora_name
        self.updates = 0

    def adapter_dir(self, snapshot: Snapshot, version_id: str) -> str:
        """Where this update's adapter is written: under ``<stash>/legacy``, named only from the
        update counter, a checked version id and the content digest (no caller text reaches a path)."""
        check_id("version_id", version_id)
        if self.stash_dir is None:
            self.stash_dir = self.private_stash = tempfile.mkdtemp(prefix="lorapub-legacy-")
        root = os.path.realpath(os.path.join(self.stash_dir, "legacy"))
        path = os.path.realpath(os.path.join(root, f"{self.updates:06d}-{version_id}-{snapshot.digest[:12]}"))
        if os.path.dirname(path) != root:  # a symlinked or otherwise escaping entry is refused, not followed
            raise InvalidInput(f"adapter directory {path} would leave the stash {root}")
        return path

    def release_private_stash(self) -> None:
        """Remove the private directory made at the first update, if any (blocking: run it in a thread)."""
        if self.private_stash is not None:
            shutil.rmtree(self.private_stash, True)
            self.stash_dir = self.private_stash = None

    async def _each(self, op: str, call: Callable[[OverwriteAdmin], Awaitable[Any]]) -> list[LorapubError]:
        """``call`` on every engine at once; the typed failures (every engine is tried)."""
        names = list(self.engines)
        results = await asyncio.gather(*(call(e) for e in self.engines.values()), return_exceptions=True)
        failures = []
        for name, result in zip(names, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                failures.append(_typed(name, op, result))
        return failures

    async def _overwrite(self, engine: OverwriteAdmin, path: str) -> None:
        if self.lora_name in await engine.loaded_adapters():
            await engine.unload_adapter(self.lora_name)
        await engine.load_adapter(self.lora_name, path)

    async def publish(self, snapshot: Snapshot, version_id: str) -> float:
        """Returns the seconds generation stood paused.

        Pause every engine, flush, unload the fixed name where it is loaded and load the new
        adapter under it (every step on all engines at once: the pause lasts one engine's
        load, not their sum), continue. Generation is continued on every engine whatever
        happens in between (a failure, a cancellation); the first failure is raised, typed.
        """
        if not isinstance(snapshot, Snapshot):
            raise InvalidInput(f"publish takes a Snapshot, got {type(snapshot).__name__}")
        path = self.adapter_dir(snapshot, version_id)
        try:
            await asyncio.to_thread(snapshot.save_peft_dir, path)
        except OSError as e:  # before anything is sent: no engine was paused
            raise InvalidInput(f"the adapter cannot be written under stash_dir {self.stash_dir!r}: {e}") from None
        started = time.perf_counter()  # the update's duration, returned to the caller: measured, no timer
        failure: BaseException | None = None
        try:
            failures = await self._each("pause_generation", lambda e: e.pause_generation())
            if failures:
                raise failures[0]
            failures = await self._each("flush_cache", lambda e: e.flush_cache())
            if failures:
                raise failures[0]
            failures = await self._each("overwrite", lambda e: self._overwrite(e, path))
            if failures:
                raise failures[0]
        except BaseException as e:
            failure = e
            raise
        finally:
            # Every engine continues, even one whose pause failed (it may have paused anyway).
            left_paused = await asyncio.shield(self._each("continue_generation", lambda e: e.continue_generation()))
            if left_paused:
                why = "generation may still be paused: " + "; ".join(err.message for err in left_paused)
                if failure is None:
                    raise EngineError(why)
                failure.add_note(why)
        self.updates += 1
        return time.perf_counter() - started


class OverwriteSession:
    """Old behaviour: every request names the one fixed adapter, whatever it holds now."""

    max_resumes = 20

    def __init__(self, engine: OverwriteAdmin, lora_name: str = FIXED_LORA_NAME) -> None:
        self.engine = engine
        self.lora_name = lora_name
        self.resumed = 0

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]:
        if not isinstance(payload, Mapping):
            raise InvalidInput(f"a generation payload is a mapping, got {type(payload).__name__}")
        # The old agentic layer resumes requests that a publication's pause aborted.
        for _ in range(self.max_resumes):
            try:
                out = await self.engine.generate({**payload, "lora_path": self.lora_name})
            except EngineError as e:
                if "aborted" not in e.message:
                    raise
            else:
                # SGLang answers a request that pause_generation(mode="abort") cut short with 200 and
                # finish_reason "abort"; the old agentic layer resumes it.
                if ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type") != "abort":
                    return out
            self.resumed += 1
            await asyncio.sleep(0.005)  # the old path's resume pause (its own, no deployment or clock): real time
        return await self.engine.generate({**payload, "lora_path": self.lora_name})

    async def close(self) -> None:
        return None


class OverwriteDeployment:
    """The switch-off product: ``publish`` returns the seconds paused, ``session`` an :class:`OverwriteSession`."""

    def __init__(self, engines: Mapping[str, OverwriteAdmin], *, stash_dir: str | None = None) -> None:
        if not isinstance(engines, Mapping) or not engines:
            raise InvalidInput("a deployment needs a mapping of at least one engine name to its OverwriteAdmin")
        for name, engine in engines.items():
            check_id("engine name", name)
            if not isinstance(engine, OverwriteAdmin):
                raise InvalidInput(
                    f"engine {name!r} is a {type(engine).__name__}, not an OverwriteAdmin "
                    "(pause_generation, continue_generation, flush_cache, loaded_adapters, load_adapter, "
                    "unload_adapter, generate)"
                )
        if stash_dir is not None:
            stash_dir = os.fspath(stash_dir) if isinstance(stash_dir, os.PathLike) else stash_dir
            if not isinstance(stash_dir, str) or not stash_dir or "\x00" in stash_dir:
                raise InvalidInput(f"stash_dir must be a directory path, got {stash_dir!r}")
        self.engines = dict(engines)
        self.publisher = OverwritePublisher(self.engines, stash_dir)  # None: its private directory
        self._round_robin = itertools.count()

    async def start(self) -> "OverwriteDeployment":
        return self

    async def publish(self, snapshot: Snapshot, version_id: str) -> float:
        return await self.publisher.publish(snapshot, version_id)

    def session(self, session_id: str, nonce: str | None = None, *, group: str | None = None) -> OverwriteSession:
        engines = list(self.engines.values())
        return OverwriteSession(engines[next(self._round_robin) % len(engines)])

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        """Nothing runs in the background; removes the private stash directory if it made one."""
        await asyncio.to_thread(self.publisher.release_private_stash)

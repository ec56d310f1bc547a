"""The trainer side: rank 0's publisher on a loop of its own, and the opt-in
``update_weights_for_rollout`` that publishes each adapter as a version."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
from typing import Any, Callable, Coroutine, TypeVar

from lorapub import (CapacityError, Deployment, DeploymentClosed, PublicationBlocked, PublicationReport,
                     PublicationSuperseded, Snapshot)

from .options import config_from_args, is_enabled, topology_urls, version_id_for
from .shard import RelaxLorapub

__all__ = ['LorapubPublisher', 'LorapubWeightPath', 'PublishOutcome', 'WeightPublicationFailed', 'install_weight_path', 'max_over']

log = logging.getLogger("lorapub.integrations.relax")  # one logger for the whole integration
_STEP_RE = re.compile(r"step(\d+)")  # version_id_for's ids
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------------



async def _cancel_leftover_tasks() -> None:
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


class LorapubPublisher:
    """Rank 0's publication: :class:`RelaxLorapub` (``role="trainer"``) on an event loop of its own, in a
    daemon thread, so the engines' clients and the deployment live across weight updates and a
    publication runs beside training."""

    def __init__(self, args: Any, **options: Any) -> None:
        self.lorapub = RelaxLorapub(args, role="trainer", **options)
        self.enabled = self.lorapub.enabled
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapub-relax-publisher", daemon=True)
        self._thread.start()

    @property
    def deployment(self) -> Deployment | None:
        return self.lorapub.deployment

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop.is_closed():
            coro.close()
            raise DeploymentClosed("this publisher was closed; make a new one to publish again")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _publish(self, snapshot: Snapshot, version_id: str) -> PublicationReport:
        await self.lorapub.start()
        return await self.lorapub._deployed().publish(snapshot, version_id, wait=self.lorapub._config.publish_wait)

    def submit(self, snapshot: Snapshot, version_id: str) -> concurrent.futures.Future[PublicationReport]:
        """Start publishing; the future gives the :class:`lorapub.PublicationReport` or the typed error."""
        return self._submit(self._publish(snapshot, version_id))

    def publish(self, snapshot: Snapshot, version_id: str, timeout: float | None = None) -> PublicationReport:
        return self.submit(snapshot, version_id).result(timeout)

    def follow(self, urls: list[str]) -> concurrent.futures.Future[dict[str, list[str]]]:
        """Bring the engines to ``urls`` in the background (``RelaxLorapub.follow_workers``): this process
        published the versions, so it is the one that loads them on an engine that joins."""
        return self._submit(self.lorapub.follow_workers(urls))

    async def _resume_point(self) -> int | None:
        await self.lorapub.start()
        state = await self.lorapub._deployed().state()
        if state.default is None:
            return None  # nothing published in this epoch: the run starts here
        steps = [int(m.group(1)) for key in state.versions if (m := _STEP_RE.fullmatch(key.version_id))]
        return max(steps, default=0)

    def resume_point(self, timeout: float | None = None) -> int | None:
        """The shared registry's view of a run under way: None when this epoch has no version yet, else the
        highest ``step<N>`` published (0 where no id has that form), which a restarted trainer counts on from."""
        return self._run(self._resume_point(), timeout)

    def settle(self) -> None:
        """Wait for background reclaims."""
        if self.deployment is not None:
            self._run(self.deployment.settle())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.lorapub.aclose())
        finally:
            try:  # nothing may outlive the loop as a destroyed pending task
                self._run(_cancel_leftover_tasks())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()


@dataclasses.dataclass
class PublishOutcome:
    """One weight update's publication, as rank 0 saw it."""

    version_id: str
    digest: str
    status: str = "pending"  # pending, published, superseded, deferred, failed
    report: PublicationReport | None = None
    error: BaseException | None = None


class WeightPublicationFailed(RuntimeError):
    """A publication failed (not superseded, not waiting for a slot): raised on every rank, like
    Relax's own failed adapter push."""


def _default_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def max_over(group: Any = None) -> Callable[[int], int]:
    """``share_verdict`` for a multi-rank trainer: a MAX all-reduce of the failure flag over ``group``
    (Relax's gloo group, ``get_gloo_group()``), as Relax shares its own adapter-push verdict."""

    def share(flag: int) -> int:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return int(tensor.item())

    return share


def _default_params(backend: Any) -> dict[str, Any]:
    # DeviceDirectBackend._push_lora_adapter_distributed reads the parameters this way
    return dict(backend._megatron.named_params_and_buffers(backend.args, backend.model, convert_to_global_name=False))


class LorapubWeightPath:
    """The opt-in ``DeviceDirectBackend.update_weights_for_rollout`` with lorapub on (every rank runs it:
    the adapter export and gather are collective; rank 0 publishes).

    * The first update is Relax's own: it syncs the base under pause (once); then its adapter becomes the
      first version.
    * Every later update publishes the adapter as ``step<rollout_id>`` (``step<weight_version>`` when the
      caller gives no rollout id): the tensors ``export_local_adapter``/``gather_full_adapter`` give and
      ``config_dict()``, frozen in one :class:`lorapub.Snapshot` — the bytes Relax would have pushed —
      sent over lorapub's wire, with no pause and no flush. Relax's actor_fwd/reference sync still runs
      (Relax's own path with ``actor_fwd_only=True``, which pauses nothing).
    * A superseded publication (a newer step took its place while it waited for a slot) is logged; so is
      one still waiting for a slot when the wait ends. Neither fails the step, unless no session keeps
      the slots and only engines that do not answer do, or a failed publication's cleanup waits on
      such an engine: a later step would find the same, so that fails it. That and any other failure raises
      :class:`WeightPublicationFailed` on every rank (``share_verdict``: a MAX over the ranks), at this
      update with ``background_publish`` off, at the next one with it on.
    """

    def __init__(
        self,
        backend: Any,
        publisher: LorapubPublisher | Callable[[], LorapubPublisher] | None,
        *,
        original: Callable[..., None],
        rank: Callable[[], int] | None = None,
        share_verdict: Callable[[int], int] | None = None,
        params: Callable[[Any], dict[str, Any]] | None = None,
        background: bool | None = None,
    ) -> None:
        self.backend = backend
        self._publisher = publisher
        self._original = original
        self._rank = rank or _default_rank
        self._share_verdict = share_verdict
        self._params = params or _default_params
        config = config_from_args(backend.args)
        if background is None:
            assert config is not None, "lorapub is off"  # this path is installed only with it on
            background = config.background_publish
        self.background = background
        self.outcomes: list[PublishOutcome] = []
        self._published_once = False
        self._resume_checked = False
        self._following: concurrent.futures.Future[dict[str, list[str]]] | None = None  # the last look at the rollout engines
        #: True when this trainer found a run under way at its first update (a restart): no base sync then
        self.resumed = False
        self._unreported: list[PublishOutcome] = []
        self._lock = threading.Lock()

    @property
    def publisher(self) -> LorapubPublisher:
        """Rank 0's publisher, made at its first publication (from ``rollout_topology`` by default)."""
        if not isinstance(self._publisher, LorapubPublisher):
            if self._publisher is not None:
                self._publisher = self._publisher()
            else:
                self._publisher = LorapubPublisher(self.backend.args, worker_urls=lambda: topology_urls(self.backend))
        return self._publisher

    def update_weights_for_rollout(self, rollout_only: bool = False, actor_fwd_only: bool = False, *,
                                   rollout_id: int | str | None = None) -> None:
        backend = self.backend
        if not actor_fwd_only and not backend._lora_sync.base_sync_done and not self._resume_checked:
            self._resume()
        if actor_fwd_only or not backend._lora_sync.base_sync_done:
            self._original(rollout_only, actor_fwd_only)  # actor_fwd only, or the first (base) sync: Relax's own
            if actor_fwd_only:
                return
        elif not rollout_only:
            self._original(False, True)  # actor_fwd/reference: Relax's path; actor_fwd_only pauses nothing
        else:
            backend.weight_version += 1  # what Relax's path counts for every update
        self._publish(rollout_id)

    def _resume(self) -> None:
        """A restarted trainer's first update (every rank): when the shared registry already has a version, the
        engines hold the base and serve lorapub's versions, so Relax's first sync (pause, flush, base and
        fixed-adapter push) is skipped and this update publishes through lorapub like any other. The step count
        goes on from the highest ``step<N>`` published, so no version id comes back. Rank 0 decides; the
        decision is shared like a failure verdict (a MAX over the ranks), so every rank takes the same path."""
        self._resume_checked = True
        found = 0
        if self._rank() == 0:
            point = self.publisher.resume_point()
            if point is not None:
                found = 1
                self.backend.weight_version = max(self.backend.weight_version, point)
        if self._share_verdict is not None:
            found = int(self._share_verdict(found))
        if found:
            sync = self.backend._lora_sync
            sync.base_sync_done = sync.adapter_loaded = True
            self.resumed = True
            log.info("lorapub: a run is under way in this epoch (a trainer restart): Relax's first sync is skipped "
                     "(no pause, no flush); this update publishes through lorapub from step %s on",
                     self.backend.weight_version + 1)

    def _publish(self, rollout_id: int | str | None) -> None:
        backend = self.backend
        sync = backend._lora_sync
        all_params = self._params(backend)
        unchanged, new_state = sync.should_skip(all_params)  # collective
        failed = 0
        if unchanged and self._published_once:
            log.debug("lorapub: adapter unchanged on every rank; nothing to publish")
        else:
            local_adapter = sync.export_local_adapter(all_params)  # collective
            merged = sync.gather_full_adapter(local_adapter, all_gather=False)  # collective; None off rank 0
            if self._rank() == 0:
                self._follow_rollout_engines()
                snapshot = Snapshot(merged, sync.config_dict())  # a frozen CPU copy: training may step on
                step = rollout_id if rollout_id is not None else backend.weight_version
                failed = self._submit(snapshot, version_id_for(step))
            self._published_once = True
            sync.adapter_loaded = True
        sync.prev_state = new_state
        if self._rank() == 0:
            failed = max(failed, self._take_background_failures())
        if self._share_verdict is not None:
            failed = int(self._share_verdict(int(failed)))
        if failed:
            errors = [o for o in self.outcomes if o.status == "failed"]
            cause = errors[-1].error if errors else None
            raise WeightPublicationFailed(
                "lorapub: publishing the LoRA adapter failed; the previous version stays the default and sessions "
                f"keep theirs ({cause or 'failed on rank 0'})"
            ) from cause

    def _follow_rollout_engines(self) -> None:
        """Relax refreshes ``rollout_topology`` from its coordinator before every update (and a newer Relax
        names the engines it updated with ``updated_rollout_urls()``): engines that joined or left since the
        last update join or leave lorapub's deployment too (rank 0, in the background)."""
        publisher = self.publisher
        if publisher.deployment is None:
            return  # its first publication starts it from rollout_topology
        updated = getattr(self.backend, "updated_rollout_urls", None)
        urls = list(updated() or ()) if callable(updated) else []
        urls = urls or topology_urls(self.backend)
        if urls:
            self._following = publisher.follow(sorted(urls))

    def _submit(self, snapshot: Snapshot, version_id: str) -> int:
        outcome = PublishOutcome(version_id, snapshot.digest)
        with self._lock:
            self.outcomes.append(outcome)
        future = self.publisher.submit(snapshot, version_id)
        if self.background:
            future.add_done_callback(lambda f: self._settled(outcome, f, background=True))
            return 0
        try:
            future.result()
        except BaseException:  # classified below
            pass
        self._settled(outcome, future, background=False)
        return int(outcome.status == "failed")

    def _settled(self, outcome: PublishOutcome, future: concurrent.futures.Future[PublicationReport], *,
                 background: bool) -> None:
        try:
            outcome.report = report = future.result()
            outcome.status = "published"
            log.info("lorapub: published %s as %s", outcome.version_id, report.lora_name)
            return
        except PublicationSuperseded as e:
            outcome.status, outcome.error = "superseded", e
            log.info("lorapub: %s was superseded by a newer step before it got a slot: %s", outcome.version_id, e)
        except CapacityError as e:
            if e.details.get("unreachable_engines") and not e.details.get("held_by_sessions"):
                # no session keeps a slot, only engines that do not answer: every later step would find
                # the same, and training would go on with a stale policy while nothing is raised
                self._failed(outcome, e, background)
                return
            outcome.status, outcome.error = "deferred", e
            log.warning("lorapub: %s found no slot within the wait (sessions, or requests still running, hold "
                        "the versions); a later step publishes: %s", outcome.version_id, e)
        except PublicationBlocked as e:
            # this step's own publication failed (its cleanup not confirmed yet), or an earlier one's
            # cleanup waits on engines that do not answer: a later step would find the same
            if e.details.get("failed") or e.details.get("unreachable_engines"):
                self._failed(outcome, e, background)
                return
            outcome.status, outcome.error = "deferred", e
            log.warning("lorapub: %s waited for the publication before it, which did not end within the wait; "
                        "a later step publishes: %s", outcome.version_id, e)
        except BaseException as e:  # noqa: BLE001 - reported on every rank by the next update
            self._failed(outcome, e, background)

    def _failed(self, outcome: PublishOutcome, e: BaseException, background: bool) -> None:
        outcome.status, outcome.error = "failed", e
        log.error("lorapub: publishing %s failed: %r", outcome.version_id, e)
        if background:
            with self._lock:
                self._unreported.append(outcome)

    def _take_background_failures(self) -> int:
        with self._lock:
            failed, self._unreported = bool(self._unreported), []
        return int(failed)

    def wait(self, timeout: float | None = None) -> list[PublishOutcome]:
        """Wait until every publication submitted so far has settled (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(o.status == "pending" for o in self.outcomes):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("lorapub publications still pending")
            time.sleep(0.01)
        return list(self.outcomes)

    def close(self) -> None:
        if isinstance(self._publisher, LorapubPublisher):
            self._publisher.close()


def install_weight_path(
    backend: Any,
    publisher: LorapubPublisher | Callable[[], LorapubPublisher] | None = None,
    *,
    rank: Callable[[], int] | None = None,
    share_verdict: Callable[[int], int] | None = None,
    params: Callable[[Any], dict[str, Any]] | None = None,
    background: bool | None = None,
) -> LorapubWeightPath | None:
    """Opt in, on every rank: with lorapub on, ``backend.update_weights_for_rollout`` becomes
    :meth:`LorapubWeightPath.update_weights_for_rollout` (rank 0 builds its publisher lazily, from
    ``backend.rollout_topology`` unless one is given). Off: ``None``, and the backend is untouched."""
    if not is_enabled(backend.args):
        return None
    path = LorapubWeightPath(
        backend, publisher, original=backend.update_weights_for_rollout, rank=rank,
        share_verdict=share_verdict, params=params, background=background,
    )
    backend.update_weights_for_rollout = path.update_weights_for_rollout
    return path

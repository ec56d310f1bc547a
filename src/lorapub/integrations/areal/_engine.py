"""AReaL's remote SGLang engine with lorapub: :class:`LorapubSGLangEngine` (imports AReaL 1.0.4).

Off, it is ``RemoteSGLangEngine`` itself. On, six methods of AReaL's ``RemoteInfEngine`` change
(:class:`LorapubRemoteInfEngine`; ``destroy`` also closes lorapub, ``offload``/``onload`` send the servers'
pause/continue themselves, and ``publish_initial`` is added) and nothing else. See docs/areal.md, "What changes for an AReaL user".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from areal.api import ModelRequest, ModelResponse, RolloutWorkflow, WeightUpdateMeta
from areal.api.cli_args import InferenceEngineConfig
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra import workflow_context
from areal.infra.remote_inf_engine import RemoteInfEngine
from areal.infra.utils.concurrent import get_executor
from areal.utils import name_resolve, names

from lorapub import InvalidInput, PublicationReport

from .config import LorapubAReaLConfig, areal_version, config_of
from .rollout import LorapubRollout, current_episode, read_adapter

__all__ = ["LorapubInferenceEngineConfig", "LorapubSGLangEngine", "LorapubRemoteInfEngine"]

log = logging.getLogger("lorapub.integrations.areal")
_DONE = ("stop", "tool_calls", "length")  # AReaL's agenerate ends a request on these


@dataclasses.dataclass
class LorapubInferenceEngineConfig(InferenceEngineConfig):
    """AReaL's ``InferenceEngineConfig`` with the ``lorapub`` block: type ``rollout`` with it in the
    experiment's config class and ``rollout.lorapub.enabled: true`` in its YAML."""

    lorapub: LorapubAReaLConfig = dataclasses.field(default_factory=LorapubAReaLConfig)


class _BoundEpisode(RolloutWorkflow):
    """The resolved workflow of one ``submit``, run as one lorapub group."""

    def __init__(self, inner: RolloutWorkflow, rollout: LorapubRollout) -> None:
        self.inner = inner
        self.rollout = rollout

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        episode = self.rollout.new_episode(workflow_context.get().task_id)
        token = self.rollout.enter(episode)
        try:
            return await self.inner.arun_episode(engine, data)
        finally:
            self.rollout.leave(token)
            # released even when the episode is cancelled: the close runs on lorapub's loop
            await asyncio.shield(self.rollout.run_async(self.rollout.end_episode(episode)))


class LorapubRemoteInfEngine(RemoteInfEngine):
    """AReaL's ``RemoteInfEngine`` (SGLang backend) with lorapub on:

    * ``initialize`` also starts lorapub's deployment on the servers AReaL found;
    * ``_resolve_workflow`` wraps the episode: one ``submit`` (a prompt and its ``group_size`` samples) is
      one lorapub group, each sample's task one session, released when the episode ends;
    * ``agenerate`` sends each request through the sample's session (its bound version, every turn) and
      answers ``output_versions`` with the version that served it;
    * ``update_weights_from_disk`` publishes the saved adapter as ``v<version>`` (staged on every server,
      committed when all are ready, reclaimed when unused);
    * ``pause_generation``/``continue_generation`` are not sent: the servers keep generating.
    """

    def __init__(self, config: InferenceEngineConfig, backend: SGLangBackend, lorapub: LorapubAReaLConfig,
                 **deployment_options: Any) -> None:
        super().__init__(config, backend)
        self.lorapub = LorapubRollout(lorapub, max_lag=config.max_head_offpolicyness, **deployment_options)
        #: lorapub's answer for recent requests: version_id, lag, rebinds (what the trainer does not read)
        self.served: deque[dict[str, Any]] = deque(maxlen=100_000)

    def initialize(self, engine_id: str | None = None, addr: str | list[str] | None = None,
                   train_data_parallel_size: int | None = None) -> None:
        super().initialize(engine_id, addr, train_data_parallel_size)
        self.lorapub.start(self.addresses)

    def destroy(self) -> None:
        try:
            super().destroy()
        finally:
            self.lorapub.close()

    def _resolve_workflow(self, workflow: Any, workflow_kwargs: Any, group_size: int = 1,
                          proxy_addr: str | None = None) -> RolloutWorkflow:
        resolved = super()._resolve_workflow(workflow, workflow_kwargs, group_size, proxy_addr=proxy_addr)
        return _BoundEpisode(resolved, self.lorapub)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """AReaL's ``agenerate`` (its checks, its resume of an aborted request, its response), each request
        sent once through the sample's lorapub session instead of to a round-robin server."""
        req = req.copy()
        if self.config.return_routed_experts:
            req.metadata["return_routed_experts"] = True
        gconfig = req.gconfig
        if gconfig.n_samples != 1:
            raise ValueError("Inference engines do not support n_samples > 1. "
                             "Please call generate multiple times with n_samples = 1.")
        max_new_tokens = min(gconfig.max_tokens - len(req.input_ids), gconfig.max_new_tokens)
        if max_new_tokens <= 0:
            raise RuntimeError(f"max_new_tokens ({max_new_tokens}) is non-positive! max_tokens={gconfig.max_tokens}, "
                               f"prompt_len={len(req.input_ids)}, max_new_tokens={gconfig.max_new_tokens}.")
        req.gconfig.max_new_tokens = max_new_tokens

        episode = current_episode()
        member = id(asyncio.current_task())  # one session per sample: GroupedRolloutWorkflow gathers them as tasks
        start = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        experts: list[Any] = []
        stop_reason = None
        wanted = gconfig.max_new_tokens
        while stop_reason not in _DONE and len(tokens) < wanted:
            while self.workflow_executor.is_paused():
                await asyncio.sleep(0.5)
            # no lora_path from AReaL: the session names its bound version
            payload = self.backend.build_generation_request(req, with_lora=False, version=self.get_version()).payload
            result = await self.lorapub.run_async(self.lorapub.generate(episode, member, payload))
            if not isinstance(result, dict):
                raise ValueError(f"Expected JSON dict response, got {type(result).__name__}")
            served = dict(result.pop("lorapub"))  # what served it: version_id, lag, rebinds
            self.served.append(served)
            out = self.backend.parse_generation_response(result)
            stop_reason = out.stop_reason
            if req.metadata.get("return_routed_experts", False) and out.routed_experts is None and stop_reason != "abort":
                raise RuntimeError("Requested return_routed_experts=True but received None from SGLang.")
            tokens.extend(out.output_tokens)
            logprobs.extend(out.output_logprobs)
            versions.extend([areal_version(served["version_id"])] * len(out.output_tokens))
            if out.routed_experts is not None:
                experts.append(out.routed_experts)
            req.input_ids += out.output_tokens
            req.gconfig.max_new_tokens -= len(out.output_tokens)
        if stop_reason == "abort":
            stop_reason = "length"
        latency = time.perf_counter() - start
        routed = None
        if experts:
            import numpy as np

            routed = np.concatenate(experts)
        return ModelResponse(
            input_tokens=req.input_ids[: len(req.input_ids) - len(tokens)], input_images=req.image_data,
            output_tokens=tokens, output_logprobs=logprobs, output_versions=versions, stop_reason=stop_reason,
            latency=latency, ttft=latency, tokenizer=req.tokenizer, processor=req.processor, routed_experts=routed,
        )

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[PublicationReport]:
        """Publish the adapter AReaL's trainer saves at ``meta.path`` as ``v<meta.version>``. The future gives
        the :class:`lorapub.PublicationReport`, or raises the typed error (the previous version stays the
        one new trajectories bind)."""
        assert meta.type == "disk"
        if not meta.use_lora:
            raise InvalidInput("lorapub publishes LoRA adapters: a full-model disk update needs rollout.lorapub.enabled: false")
        if meta.version is None:
            raise ValueError("Version is required for LoRA update.")
        if self.config.experiment_name is None or self.config.trial_name is None:
            raise RuntimeError("Experiment and trial names must be set for disk-based weight updates.")
        future: Future[PublicationReport] = get_executor().submit(self._publish_from_disk, meta, self.get_version())
        return future

    def _publish_from_disk(self, meta: WeightUpdateMeta, model_version: int) -> PublicationReport:
        # the trainer announces the saved adapter through name_resolve, as for AReaL's own load
        name_resolve.wait(names.update_weights_from_disk(self.config.experiment_name, self.config.trial_name,
                                                         model_version), timeout=120)
        report = self._publish_folder(str(meta.path), meta.version)
        if meta.clear_checkpoint_after_load:
            shutil.rmtree(str(meta.path), ignore_errors=True)
        return report

    def publish_initial(self, path: str, version: int = 0) -> PublicationReport:
        """Publish the PEFT adapter under ``path`` as ``v<version>``, now: the first version, which AReaL's own
        path loads at server launch (``sglang.lora_paths``: ``<lora_name>-v0``, RLTrainer's ``initial_lora``)
        and never sends as an update. No name_resolve key is waited for (the key of the rollout's version 0
        is the one the trainer's first update writes) and the folder is left in place."""
        return self._publish_folder(path, version)

    def _publish_folder(self, path: str, version: int) -> PublicationReport:
        """The PEFT adapter under ``path``, published as ``v<version>`` (retried as AReaL retries a load)."""
        tik = time.perf_counter()
        snapshot = read_adapter(path)
        read_s = time.perf_counter() - tik
        report = self.lorapub.publish(snapshot, version, attempts=self.config.request_retries)
        # each part named: live, a 264 MB update took 14-25 s here with about 1 s of it on the servers
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in report.phases.items())
        self.logger.info("lorapub: published v%s on every server in %.2fs (read and snapshot %.2fs, the publication "
                         "%.2fs: waited for a slot %.2fs, %s)", version, time.perf_counter() - tik, read_s, report.seconds,
                         report.waited, phases)
        return report

    def pause_generation(self) -> None:
        """Not sent: a publication needs no pause, and the servers' running requests keep their versions."""
        self.lorapub.skipped_pauses += 1

    def continue_generation(self) -> None:
        """Not sent (nothing was paused)."""

    def offload(self) -> None:
        """AReaL's offload, after the servers' pause that :meth:`pause_generation` no longer sends: RLTrainer
        pauses them before it releases their memory, and a request still running there must stop first."""
        RemoteInfEngine.pause_generation(self)
        super().offload()

    def onload(self, tags: list[str] | None = None) -> None:
        """AReaL's onload, then the servers' continue that :meth:`continue_generation` no longer sends."""
        super().onload(tags)
        RemoteInfEngine.continue_generation(self)


class LorapubSGLangEngine(RemoteSGLangEngine):
    """A drop-in for ``areal.engine.sglang_remote.RemoteSGLangEngine``.

    ``rollout.lorapub`` (:class:`LorapubInferenceEngineConfig`), or ``lorapub=`` here, turns lorapub on;
    absent or ``enabled: false``, this is AReaL's own engine, unchanged. ``deployment_options`` go to
    :class:`lorapub.Deployment` (tests hand engines and intervals in)."""

    def __init__(self, config: InferenceEngineConfig, *, lorapub: Any = None, **deployment_options: Any) -> None:
        super().__init__(config)
        block = config_of(lorapub if lorapub is not None else getattr(config, "lorapub", None))
        self.lorapub_config = block if block is not None and block.enabled else None
        if self.lorapub_config is None:
            if deployment_options:
                raise InvalidInput("deployment options were given but rollout.lorapub is off: set rollout.lorapub.enabled: true, or drop them")
            return  # AReaL's own path
        self.lorapub_config.check(lora_name=config.lora_name, use_lora=config.use_lora,
                                  max_head_offpolicyness=config.max_head_offpolicyness)
        self._engine = LorapubRemoteInfEngine(config, SGLangBackend(), self.lorapub_config, **deployment_options)

    def publish_initial(self, path: str, version: int = 0) -> PublicationReport:
        """Publish the initial adapter (a PEFT folder: RLTrainer's ``initial_lora``, or what AReaL's own path
        would list in ``sglang.lora_paths`` as ``<lora_name>-v0``) as ``v0``, after ``initialize`` and before
        the first rollout; see :meth:`LorapubRemoteInfEngine.publish_initial`."""
        if not isinstance(self._engine, LorapubRemoteInfEngine):
            raise InvalidInput("publish_initial needs rollout.lorapub.enabled: true; AReaL's own path loads its "
                               "initial adapter at server launch through sglang.lora_paths (<lora_name>-v0=<path>)")
        return self._engine.publish_initial(path, version)

    @property
    def lorapub(self) -> LorapubRollout | None:
        """The deployment's side (None with lorapub off)."""
        return getattr(self._engine, "lorapub", None)

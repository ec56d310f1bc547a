"""What the AReaL tests and bench/areal_side_by_side.py share: AReaL 1.0.4 on the path, a tokenizer made
here, SGLang doubles that answer logprobs in SGLang's shape, AReaL's config and a trainer's disk update.

AReaL is not installed into the suite's environment: `.ci/install` unpacks it with the packages its
SGLang engine imports into .cache/areal/1.0.4, which :func:`areal_on_path` appends to ``sys.path``
(appended: a package the suite already has wins)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

from aiohttp import web

from lorapub.testing import SGLangDouble, peft_config, peft_lora_state_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
AREAL_DIR = ROOT / ".cache" / "areal" / "1.0.4"
LORA_NAME = "policy"          # AReaL's gconfig.lora_name: its own path serves policy-v<N>
PREFIX = "lorapub@"           # lorapub's names (the doubles protect the same prefix)
VOCAB = 1000                  # the doubles' next_token() is < 1000


def areal_on_path() -> None:
    """Make AReaL 1.0.4 importable, or say how to get it."""
    if not (AREAL_DIR / "areal" / "__init__.py").exists():
        raise RuntimeError(f"AReaL 1.0.4 is not under {AREAL_DIR}: run .ci/install (its areal step)")
    if str(AREAL_DIR) not in sys.path:
        sys.path.append(str(AREAL_DIR))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def kept_from_areal():
    """What AReaL changes for its whole process, put back. ``areal.utils.logging.getLogger`` (called on
    import and at run time) replaces ``logging``'s root logger and manager and re-runs ``dictConfig``: a logger
    made afterwards hangs under AReaL's root, out of pytest's ``caplog``. ``areal.api.cli_args`` runs
    ``uvloop.install()`` on import: every event loop made afterwards in the process would be uvloop's, the rest
    of the suite included (a sender thread's loop closed while another thread wakes it aborts the process)."""
    policy = asyncio.get_event_loop_policy()
    root, manager = logging.Logger.root, logging.Logger.manager
    handlers, level = list(logging.root.handlers), logging.root.level
    disabled = {n: lg.disabled for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)
        logging.Logger.root, logging.Logger.manager = root, manager
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
        for name, was in disabled.items():
            logger = manager.loggerDict.get(name)
            if isinstance(logger, logging.Logger):
                logger.disabled = was


class AReaLDouble(SGLangDouble):
    """An SGLang double whose ``meta_info.output_token_logprobs`` has SGLang's own shape with
    ``return_logprob``: ``[logprob, token_id, text]`` per token (the plain double answers bare floats,
    which AReaL's ``SGLangBackend.parse_generation_response`` cannot read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: every /generate answered: (status, lora_path named, error message or None, whether this incarnation
        #: had loaded that adapter before), in order
        self.answers: list[tuple[int, str | None, str | None, bool]] = []
        #: every adapter name this server loaded at some point (to tell "unloaded" from "never loaded")
        self.ever_loaded: set[str] = set()

    def restart(self) -> None:
        super().restart()
        self.ever_loaded = set()  # what this incarnation loaded

    async def _load(self, lora_name: str, *args: Any, **kwargs: Any) -> Any:
        out = await super()._load(lora_name, *args, **kwargs)
        self.ever_loaded.add(lora_name)
        return out

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            name = (await request.json()).get("lora_path")
        except ValueError:
            name = None
        response = await super().h_generate(request)
        error = None
        if isinstance(response, web.Response) and response.status != 200 and response.body is not None:
            error = str((json.loads(response.body).get("error") or {}).get("message"))
        self.answers.append((response.status, name, error, name in self.ever_loaded))
        if not isinstance(response, web.Response) or response.status != 200 or response.body is None:
            return response
        out = json.loads(response.body)
        meta = out.get("meta_info") or {}
        items = meta.get("output_token_logprobs") or []
        if items and not isinstance(items[0], (list, tuple)):
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(items, out.get("output_ids") or [])]
        return web.json_response(out)


class Fleet:
    """SGLang doubles on an event loop of their own (AReaL's engine is driven from plain threads)."""

    def __init__(self, count: int = 2, **options: Any) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="areal-doubles", daemon=True)
        self._thread.start()
        self.doubles: list[AReaLDouble] = self.call(start_doubles(count, **options))

    def call(self, coro: Any, timeout: float = 30) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Any) -> Any:
        """Run ``fn()`` on the doubles' loop (their state is that loop's)."""
        async def run() -> Any:
            return fn()
        return self.call(run())

    @property
    def addresses(self) -> list[str]:
        return addresses(self.doubles)

    def close(self) -> None:
        import asyncio

        for d in self.doubles:
            self.call(d.stop())

        async def drain() -> None:
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        self.call(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def start_doubles(count: int = 2, *, slots: int = 6, decode_delay: float = 0.002) -> list[AReaLDouble]:
    return [await AReaLDouble(f"e{i}", max_loaded_loras=slots, managed_prefix=PREFIX,
                              decode_delay=decode_delay).start() for i in range(count)]


def addresses(doubles: list[SGLangDouble]) -> list[str]:
    return [d.url.removeprefix("http://") for d in doubles]


def tiny_tokenizer() -> Any:
    """A fast tokenizer made in-process (no hub): tokens ``t0``..``t999``, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    for special in ("<pad>", "<eos>", "<unk>", "<user>", "<assistant>"):
        vocab[special] = len(vocab)
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<user> {% else %}<assistant> {% endif %}"
        "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return tok


def engine_config(*, offpolicyness: int = 2, experiment: str = "areal-test", trial: str = "t0",
                  fileroot: str | None = None, **extra: Any) -> Any:
    """AReaL's own ``InferenceEngineConfig`` for a LoRA run on the doubles."""
    from areal.api.cli_args import InferenceEngineConfig

    return InferenceEngineConfig(
        backend="sglang:d2", experiment_name=experiment, trial_name=trial, fileroot=fileroot,
        max_concurrent_rollouts=64, consumer_batch_size=16, max_head_offpolicyness=offpolicyness,
        use_lora=True, lora_name=LORA_NAME, request_timeout=30, setup_timeout=10,  # retries: AReaL's default (3)
        pause_grace_period=0.0, **extra,
    )


def gconfig(max_new_tokens: int = 4) -> Any:
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, max_tokens=4096, lora_name=LORA_NAME)


def name_resolve_in_memory(root: str) -> None:
    """AReaL's disk update waits on a name_resolve key its trainer writes: a repository under ``root``."""
    from areal.api.cli_args import NameResolveConfig
    from areal.utils import name_resolve

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=root))


def save_adapter(path: str, seed: int) -> None:
    """What AReaL's FSDP trainer writes for a LoRA update: PEFT's two files."""
    import safetensors.numpy

    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file(peft_lora_state_dict(seed), os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(), f)


def save_adapter_bf16(path: str, seed: int) -> None:
    """:func:`save_adapter` in bfloat16, as AReaL's FSDP trainer saves a bf16 model's LoRA (numpy has no
    bfloat16: a reader that loads with numpy fails on it)."""
    import safetensors.torch
    import torch

    os.makedirs(path, exist_ok=True)
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in peft_lora_state_dict(seed).items()}
    safetensors.torch.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(), f)


def train_step_update(engine: Any, meta: Any, version: int, seed: int, save: Any = None) -> Any:
    """One update the way ``FSDPEngine._update_weights_from_disk`` runs it on rank 0: pause, hand the
    rollout engine the update, save the adapter, announce it through name_resolve, wait, continue.
    Returns the future's outcome (or raises its error) and leaves the engine's version at ``version``."""
    from areal.utils import name_resolve, names

    versioned = meta.with_version(version)
    engine.pause_generation()
    try:
        # saved and announced before the engine is handed the update (FSDP hands it first): AReaL's wait
        # polls name_resolve once a second, and the order changes nothing else
        (save or save_adapter)(versioned.path, seed)
        name_resolve.add(names.update_weights_from_disk(engine.config.experiment_name, engine.config.trial_name,
                                                        engine.get_version()), str(time.time()), replace=True)
        result = engine.update_weights_from_disk(versioned).result(timeout=60)
    finally:
        engine.continue_generation()
    engine.set_version(version)
    return result


def fsdp_update(engine: Any, meta: Any, version: int, seed: int) -> Any:
    """One update in ``FSDPEngine._update_weights_from_disk``'s own order on rank 0, as AReaL's ``RLTrainer``
    drives it: pause, hand the rollout engine the update (it waits on name_resolve), save the adapter, add
    the key for the trainer's version (no ``replace``: a key written before is ``NameEntryExistsError``),
    wait for the future, continue (not reached when it raises), then ``set_version``. Slower than
    :func:`train_step_update` by AReaL's name_resolve poll (about 1 s)."""
    from datetime import datetime

    from areal.utils import name_resolve, names

    versioned = meta.with_version(version)
    engine.pause_generation()
    fut = engine.update_weights_from_disk(versioned)
    time.sleep(0.2)  # the trainer's save takes a while: the engine is already waiting on the key
    save_adapter(versioned.path, seed)
    name_resolve.add(names.update_weights_from_disk(engine.config.experiment_name, engine.config.trial_name,
                                                    engine.get_version()),
                     str(datetime.now().timestamp()), keepalive_ttl=120)
    result = fut.result(timeout=60)
    engine.continue_generation()
    engine.set_version(version)
    return result


def no_reward(*args: Any, **kwargs: Any) -> float:
    """A reward of 0: MultiTurnWorkflow then runs every turn it may (module level: AReaL pickles it)."""
    return 0.0

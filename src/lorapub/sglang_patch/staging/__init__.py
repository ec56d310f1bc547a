"""Engine-side staging of adapter versions: begin / bucket / end / cleanup / release, in the engine.

This package runs **inside the SGLang server process** (lorapub's patch adds its routes) and inside
lorapub's contract double, so both use one implementation. It imports only the standard library,
``lorapub.core`` (and its attrs and pyrsistent), ``lorapub.wire`` and, where a transport or load form
needs them, torch (and nothing of lorapub's runtime, adapters or aiohttp).

* :mod:`~lorapub.sglang_patch.staging.machine` (with its values in
  :mod:`~lorapub.sglang_patch.staging.messages`): the staging as a pure state machine, no I/O, no
  clock, no threads: attempts, tombstones, duplicates and late messages, cleanup during ``end``,
  the byte budget, aging;
* :mod:`~lorapub.sglang_patch.staging.engine`: :class:`EngineStaging`, which drives the machine and
  runs its effects;
* :mod:`~lorapub.sglang_patch.staging.receivers` (a message's body, a bucket's bytes off the wire) and
  :mod:`~lorapub.sglang_patch.staging.collective` (a bucket broadcast over torch.distributed): the
  thin receivers; :mod:`~lorapub.sglang_patch.staging.buffers` and
  :mod:`~lorapub.sglang_patch.staging.landing`: where bytes land;
  :mod:`~lorapub.sglang_patch.staging.claims`: which life owns a stash folder;
  :mod:`~lorapub.sglang_patch.staging.server`: the glue to SGLang's server.

One :class:`EngineStaging` per server life (``incarnation``). Every message names its attempt
(``AttemptToken``) and the life it was meant for; a message for another life, for an attempt that
was cleaned up (a **tombstone**), or for one never begun here is refused and recreates nothing.

* ``begin``: checks the name is the version's managed name, that the bucket plan is the one the
  digest describes (the manifest rebuilt from the plan hashes to the digest), that the name is not
  loaded, a LoRA slot is free and the byte budget (``LORAPUB_MAX_STASH_BYTES``) holds what every
  attempt holds and has still to receive; fixes the attempt, its transport and its load form.
* ``receive``: stores bucket ``index`` once into a buffer of exactly the plan's size and verifies the
  SHA-256 of every tensor in it (off the event loop, beside the next bucket's transfer); ``end``
  waits for every check. A duplicate stores nothing and starts no second collective. Where the bytes
  land depends on the load form: a ``dir`` load receives each bucket straight into its place in the
  adapter's safetensors file on the engine's disk (an ``shm`` bucket is mapped, verified, then copied
  there), so the folder is complete when the last bucket is checked; a ``tensors`` load into shared
  memory SGLang's scheduler maps (for ``shm``: the publisher's own pages, no copy). Transports: ``raw``
  (HTTP body: the bucket's tensors back to back in plan order), ``safetensors`` (HTTP body: a
  safetensors blob of the bucket), ``shm`` (same host: a shared-memory file the publisher wrote once
  for every engine), ``torch`` (a torch.distributed broadcast from the publisher, gloo or NCCL, in a
  group begun here).
* ``end``: every bucket present and verified, the manifest digest checked again, then the fresh,
  **pinned** load through the engine (``dir``: the PEFT directory on the engine's own disk, its
  config added now, loaded with ``load_lora_adapter``; ``tensors``: SGLang's own
  ``load_lora_adapter_from_tensors``, which hands the tensors to the scheduler over SGLang's IPC,
  never touching disk). A duplicate ``end`` answers the same receipt.
* ``cleanup``: tombstones the attempt first, waits for its in-flight operation, frees the stash
  (the unload itself is SGLang's ``/unload_lora_adapter`` with the reclaim header). A cleanup that
  comes while ``end`` loads waits for that load: if it registered the adapter, ``end`` is refused
  (``STAGE_TOMBSTONE``) and the cleanup answers the adapter as ``loaded``, so its caller unloads it.
* ``release``: after a reclaim unloaded a name, frees what the attempt that loaded it still keeps.
* **aging**: an attempt nobody has driven (no begin, bucket, end, cleanup or release touching it)
  for ``LORAPUB_STAGE_IDLE_S`` seconds (default 600) is freed and tombstoned exactly as a cleanup
  would, so a publisher that vanished mid-transfer never keeps its stash (nor the byte budget) for
  the server's life. Never while an operation on it runs; an attempt whose ``end`` loaded its adapter
  is left alone while that adapter is loaded (its staged bytes were freed at ``end``; the adapter is
  the registry's to reclaim or clean up), and aged like any other once it is gone. The sweep runs
  before every ``begin``'s capacity check and on a timer of the server's event loop (armed by the
  routes, stopped by ``close``).

Every handler answers ``(status, body)``: 200 with a JSON object, or a definite refusal
(``{"error": {"message", "code"}}``, 400 malformed or not verifying, 409 refused by state).
"""

from __future__ import annotations

from lorapub.sglang_patch.staging.buffers import Buffer, close_all
from lorapub.sglang_patch.staging.claims import CLAIM_SUFFIX
from lorapub.sglang_patch.staging.engine import (
    DEFAULT_IDLE_S,
    IDLE_ENV,
    EngineHooks,
    EngineStaging,
    idle_timeout_setting,
    logger,
    managed_prefix_of,
)
from lorapub.sglang_patch.staging.server import (
    SGLangHooks,
    for_server,
    max_loaded_loras,
    starlette_json,
    starlette_receive,
)

__all__ = [
    "CLAIM_SUFFIX", "DEFAULT_IDLE_S", "IDLE_ENV", "Buffer", "EngineHooks", "EngineStaging", "SGLangHooks",
    "close_all", "for_server", "idle_timeout_setting", "logger", "managed_prefix_of", "max_loaded_loras",
    "starlette_json", "starlette_receive",
]

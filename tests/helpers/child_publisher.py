"""A publisher in a process of its own, killed (SIGKILL) at a chosen step of its second publication.

    python -m tests.helpers.child_publisher EPOCH KILL_AT URL0 URL1

Publishes A with the default in-memory registry (the README's configuration), then B, and kills
itself with SIGKILL right before the registry applies the first command of type ``KILL_AT``
(``RecordPrepared``: every engine began B; ``RecordBucketDone``: B is mid-transfer; ``RecordReady``:
an engine loaded B; ``Commit``: both engines READY, nothing committed). Prints ``READY`` once A
is the default, so the parent knows what was acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from lorapub import Deployment
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.core import commands
from lorapub.local_registry import LocalRegistry
from lorapub.testing import lora_snapshot


async def main(epoch: int, kill_at: str, urls: list[str]) -> None:
    engines = {f"e{i}": SGLangWireEngine(f"e{i}", url) for i, url in enumerate(urls)}
    dep = await Deployment(engines, epoch=epoch, reconcile_interval=None, bucket_cap_bytes=8 << 10).start()
    await dep.publish(lora_snapshot(1), "A")
    print("READY", flush=True)
    kill_type = getattr(commands, kill_at)
    apply = LocalRegistry.apply

    def dying_apply(self, command):
        if isinstance(command, kill_type):
            os.kill(os.getpid(), signal.SIGKILL)
        return apply(self, command)

    LocalRegistry.apply = dying_apply
    await dep.publish(lora_snapshot(2), "B")
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))

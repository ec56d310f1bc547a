"""One rank of a CPU trainer for the multi-rank ``share_verdict`` test: each process joins a gloo
group and runs lorapub's weight path, as every rank of Relax's trainer does (rank 0 publishes)."""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import sys
from types import SimpleNamespace

from lorapub.integrations import relax as relax_lorapub
from lorapub.testing import peft_lora_state_dict
from lorapub.testing.fixtures import peft_config


class _Sync:
    """``LoraAdapterSync`` of one rank (its collectives reduced to what each rank returns)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.base_sync_done = self.adapter_loaded = True  # past Relax's first sync
        self.prev_state = None

    def should_skip(self, all_params):
        return False, {}

    def export_local_adapter(self, all_params):
        return {}

    def gather_full_adapter(self, local_adapter, *, all_gather):
        return peft_lora_state_dict(1) if self.rank == 0 else None  # gathered on rank 0 only

    def config_dict(self):
        return peft_config(8)


class _FailingPublisher(relax_lorapub.LorapubPublisher):
    def __init__(self) -> None:  # no loop and no thread: it refuses every publication at once
        self.submitted: list[str] = []
        self.lorapub = SimpleNamespace(deployment=None)  # never started: no engines to follow

    def submit(self, snapshot, version_id):
        self.submitted.append(version_id)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(RuntimeError("the engines refused the load"))
        return future

    def close(self) -> None:
        pass


def main(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        share = relax_lorapub.max_over(None)
        shared = [share(int(rank == world - 1)), share(0)]  # one rank's failure reaches every rank
        args = SimpleNamespace(enable_lorapub=True, lorapub_resolved={"epoch": 1})
        backend = SimpleNamespace(args=args, _lora_sync=_Sync(rank), weight_version=1)
        publisher = _FailingPublisher() if rank == 0 else None
        path = relax_lorapub.LorapubWeightPath(
            backend, publisher, original=lambda *a: None, rank=dist.get_rank, share_verdict=share,
            params=lambda b: {}, background=False,
        )
        try:
            path.update_weights_for_rollout(True, False, rollout_id=3)
            raised = None
        except relax_lorapub.WeightPublicationFailed as e:
            raised = type(e).__name__
        result = {"rank": rank, "shared": shared, "raised": raised,
                  "published": publisher.submitted if publisher is not None else []}
    finally:
        dist.destroy_process_group()
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

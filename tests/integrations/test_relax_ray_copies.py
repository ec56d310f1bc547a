"""The trainer's frozen copies in a detached Ray actor, for real on the CPU: a trainer started again
(a new handle, found by name) takes back what the one before it kept, and only what is still needed."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from lorapub import VersionKey  # noqa: E402
from lorapub.integrations.relax.copies import RayCopies  # noqa: E402
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402

pytestmark = pytest.mark.ray


def test_copies_outlive_the_handle_that_kept_them_and_keep_only_what_is_retained():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        before = RayCopies("relax-copies-test-1-copies")
        before.keep(VersionKey(1, "step1"), lora_snapshot(1))
        before.keep(VersionKey(1, "step2"), lora_snapshot(2))
        before.retain([VersionKey(1, "step2")])  # the registry no longer needs step1
        before.close()  # the trainer ends: what it sent is in the actor, and its sending thread is gone
        assert before._sender._shutdown and not any(t.is_alive() for t in before._sender._threads)
        after = RayCopies("relax-copies-test-1-copies")  # the restarted trainer's handle
        (key, snapshot), = after.items()
        assert key == VersionKey(1, "step2") and snapshot.digest == lora_snapshot(2).digest
    finally:
        ray.shutdown()

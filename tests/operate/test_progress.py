"""publish(..., progress=callback) reports bytes confirmed per engine and the phase; the progress bar
draws publications over its threshold; a callback that raises never breaks the publication."""

from __future__ import annotations

import io

from lorapub import Deployment
from lorapub.cli import PublishProgressBar
from lorapub.events import PublishProgress
from lorapub.testing import MemoryEngine, lora_snapshot


def _engines():
    return {n: MemoryEngine(n) for n in ("e0", "e1")}


async def test_progress_reports_each_engines_bytes_and_phases_in_order():
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, bucket_cap_bytes=4096).start()
    snapshot = lora_snapshot(1)
    seen: list[PublishProgress] = []
    await dep.publish(snapshot, "A", progress=seen.append)
    total = snapshot.manifest.total_bytes
    assert {e.engine for e in seen} == {"e0", "e1"}
    assert all(e.bytes_total == total and str(e.version) == "1-A" and e.transport == "inline" for e in seen)
    for engine in ("e0", "e1"):
        mine = [e for e in seen if e.engine == engine]
        phases = [e.phase for e in mine]
        assert phases[0] == "begin" and phases[-1] == "end"
        assert phases.index("transfer") < phases.index("end")
        sent = [e.bytes_sent for e in mine]
        assert sent == sorted(sent) and sent[-1] == total
        # one report per bucket confirmed, and several buckets at this cap
        assert len({e.bytes_sent for e in mine if e.phase == "transfer"} - {0}) == len(snapshot.plan(4096))
        assert len(snapshot.plan(4096)) > 1
    await dep.close()


async def test_a_progress_callback_that_raises_is_dropped_and_the_publication_lands():
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError("bar bug")

    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None).start()
    report = await dep.publish(lora_snapshot(1), "A", progress=broken)
    assert report.receipt is not None and len(calls) == 1
    await dep.close()


async def test_the_bar_draws_over_its_threshold_only():
    from rich.console import Console

    out = io.StringIO()
    bar = PublishProgressBar(min_bytes=0, console=Console(file=out, force_terminal=True, width=120))
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A", progress=bar)
    drawn = out.getvalue()
    assert "1-A → e0" in drawn and "1-A → e1" in drawn
    quiet_out = io.StringIO()
    quiet = PublishProgressBar(console=Console(file=quiet_out, force_terminal=True))  # 100 MB threshold
    await dep.publish(lora_snapshot(2), "B", progress=quiet)
    assert quiet_out.getvalue() == "" and quiet.seen  # told, not drawn
    await dep.close()

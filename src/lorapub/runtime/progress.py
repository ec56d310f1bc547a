"""A publication's progress: the run log's phase boundaries and confirmed buckets, told per engine as
:class:`~lorapub.events.PublishProgress` to the caller's callbacks and the deployment's observers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from lorapub.core.identity import VersionKey
from lorapub.core.manifest import BucketPlan
from lorapub.events import Observer, PublishProgress

__all__ = ["progress_listener"]

log = logging.getLogger("lorapub.runtime.publisher")


def progress_listener(key: VersionKey, plan: BucketPlan, engines: Mapping[str, object],
                      progress: list[Callable[[PublishProgress], None]], events: Observer,
                      transport_name: str) -> Callable[[str, str | None, int | None], None]:
    """The run log's listener: each phase boundary and each confirmed bucket, as PublishProgress. A callback
    that raises is logged and dropped: a caller's progress bar never breaks the publication."""
    sent: dict[str, int] = {}
    total = plan.total_bytes

    def listener(phase: str, engine: str | None, index: int | None) -> None:
        if engine is None or engine not in engines:
            return  # the source's half, or the whole phase: told per engine
        if index is not None:
            sent[engine] = sent.get(engine, 0) + plan.buckets[index].nbytes
        event = PublishProgress(key, engine, phase, sent.get(engine, 0), total, transport_name)
        for callback in tuple(progress):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a caller's progress bar never breaks the publication
                log.exception("progress callback %r failed", callback)
                progress.remove(callback)
        events(event)

    return listener

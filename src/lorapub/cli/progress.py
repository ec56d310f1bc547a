"""A progress bar for one publication (bytes confirmed per engine, and the phase), drawn with rich
for publications over ``min_bytes`` (100 MB by default): ``publish(..., progress=PublishProgressBar())``.
See docs/operating.md, "Progress".
"""

from __future__ import annotations

from typing import Any

from lorapub.events import PublishProgress

__all__ = ["PublishProgressBar", "PROGRESS_MIN_BYTES"]

#: Publications smaller than this draw no bar (they take well under a second).
PROGRESS_MIN_BYTES = 100_000_000


class PublishProgressBar:
    """A progress callback: one rich bar per engine, advanced by the bytes it confirmed; closed when
    every engine passed ``end``. Without rich, or under ``min_bytes``, it draws nothing."""

    def __init__(self, min_bytes: int = PROGRESS_MIN_BYTES, console: Any = None) -> None:
        self.min_bytes = min_bytes
        self.console = console
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self.seen: list[PublishProgress] = []
        self._finished: set[str] = set()  # versions whose bar is drawn and closed

    def __call__(self, event: PublishProgress) -> None:
        self.seen.append(event)
        if event.bytes_total < self.min_bytes or str(event.version) in self._finished:
            return
        try:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
        except ImportError:
            return
        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TextColumn("{task.fields[phase]}"),
                                      console=self.console, transient=False)
            self._progress.start()
        task = self._tasks.get(event.engine)
        if task is None:
            task = self._tasks[event.engine] = self._progress.add_task(
                f"{event.version} → {event.engine}", total=event.bytes_total, phase=event.phase)
        self._progress.update(task, completed=event.bytes_sent, phase=event.phase)
        if event.phase == "end" and all(
                t.fields.get("phase") == "end" for t in self._progress.tasks):
            self._finished.add(str(event.version))
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._tasks.clear()

"""Decision logs: every :mod:`lorapub.events` decision is one line on the ``lorapub.decisions``
logger, ``<kind> key=value …`` with stable keys; :class:`JsonFormatter` writes the same as one JSON
object per line. Keys and tokens never appear; per-request events stay at DEBUG.
See docs/operating.md, "Decision logs".
"""

from __future__ import annotations

import datetime
import json
import logging

from lorapub.events import Event

__all__ = ["DecisionLog", "JsonFormatter", "LOGGER", "format_fields"]

#: The logger every decision goes to (``logging.getLogger("lorapub.decisions")``).
LOGGER = "lorapub.decisions"


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    text = str(value)
    # a value with spaces, quotes or '=' is JSON-quoted, so a line splits back into the same keys;
    # text stays as written (JSON escapes only what it must: quotes, backslashes, control characters)
    return json.dumps(text, ensure_ascii=False) if not text or any(c in text for c in ' "=\n\t') else text


def format_fields(fields: dict[str, object]) -> str:
    """``key=value`` pairs in the event's field order."""
    return " ".join(f"{k}={_value(v)}" for k, v in fields.items())


class DecisionLog:
    """The observer that writes each decision as one log line (a :class:`Deployment` has one by
    default; ``decision_log=False`` leaves it out)."""

    def __init__(self, logger: logging.Logger | str = LOGGER) -> None:
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger

    def __call__(self, event: Event) -> None:
        if not self.logger.isEnabledFor(event.LEVEL):
            return
        fields = event.fields()
        self.logger.log(event.LEVEL, "%s %s", event.KIND, format_fields(fields),
                        extra={"lorapub_event": event.KIND, "lorapub_fields": fields})

    def __repr__(self) -> str:
        return f"<DecisionLog {self.logger.name}>"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, and for a decision ``event`` and
    its fields; any other record carries its ``message``.

    ``handler.setFormatter(lorapub.runtime.decision_log.JsonFormatter())``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        kind = getattr(record, "lorapub_event", None)
        if kind is not None:
            out["event"] = kind
            for key, value in getattr(record, "lorapub_fields", {}).items():
                out.setdefault(key, value)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)

"""Logging for lorapub's own commands (``lorapub demo``, ``lorapub status``): the application
configures logging, never the library. Lines carry their time, level and logger; ``--log-json``
writes one JSON object per line (:class:`~lorapub.runtime.decision_log.JsonFormatter`).
See docs/operating.md, "Logs".
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lorapub.runtime.decision_log import JsonFormatter

__all__ = ["LINE_FORMAT", "add_logging_options", "configure_logging"]

#: The line every lorapub command writes: time, level, logger, then the message (a decision's
#: ``<kind> key=value …``).
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_logging_options(parser: Any) -> None:
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="lorapub's log lines on stderr from this level (default WARNING; INFO shows every decision)")
    parser.add_argument("--log-json", action="store_true", help="log lines as one JSON object each")


def configure_logging(level: str | int = "WARNING", *, json_lines: bool = False) -> None:
    """What an application does once at start: a handler on stderr with time and level on the root
    logger (unless the program configured one already), and lorapub's loggers at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(LINE_FORMAT))
    logging.basicConfig(handlers=[handler])  # a no-op where the root logger has handlers already
    logging.getLogger("lorapub").setLevel(level)

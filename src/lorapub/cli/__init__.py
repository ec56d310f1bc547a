"""Operator commands: ``lorapub status`` (a running deployment's status endpoint, or a registry store
read without touching it), the progress bar publications over 100 MB show, and the logging lorapub's
commands configure (a library never does).
See docs/operating.md, "Status".
"""

from lorapub.cli.logs import add_logging_options, configure_logging
from lorapub.cli.progress import PublishProgressBar
from lorapub.cli.status import add_status_parser, read_store, render, run_status

__all__ = ["PublishProgressBar", "add_logging_options", "add_status_parser", "configure_logging", "read_store",
           "render", "run_status"]

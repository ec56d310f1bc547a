"""Operator commands: ``lorapub status`` (a running deployment's status endpoint, or a registry store
read without touching it) and the progress bar publications over 100 MB show.
See docs/operating.md, "Status".
"""

from lorapub.cli.progress import PublishProgressBar
from lorapub.cli.status import add_status_parser, read_store, render, run_status

__all__ = ["PublishProgressBar", "add_status_parser", "read_store", "render", "run_status"]

"""Numbers the patched server reads from its environment: one rule for every setting."""

from __future__ import annotations

import logging
import os
from typing import Callable

__all__ = ["env_number"]


def env_number(env: str, parse: Callable[[str], float], accept: Callable[[float], bool], what: str,
               otherwise: str, logger: logging.Logger) -> float | None:
    """``env`` parsed, or None when unset; a value ``parse`` or ``accept`` refuses is logged on
    ``logger`` (it is not ``what``; ``otherwise`` says what holds instead) and is None too: a bad
    setting never stops a server."""
    raw = os.environ.get(env)
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not accept(value):
        logger.warning("lorapub: %s=%r is not %s; %s", env, raw, what, otherwise)
        return None
    return value

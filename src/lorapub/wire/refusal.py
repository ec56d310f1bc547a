"""A definite refusal from the engine-side staging: an HTTP status and a stable code."""

from __future__ import annotations

__all__ = ["Refused", "refuse", "bad"]


class Refused(Exception):
    """A definite no: ``status`` and a stable ``code`` go back to the caller."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def refuse(message: str, code: str = "STAGE_REFUSED", status: int = 409) -> Refused:
    return Refused(status, code, message)


def bad(message: str) -> Refused:
    return Refused(400, "STAGE_INVALID", message)

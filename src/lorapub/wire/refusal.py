"""A definite refusal from the engine-side staging, raised: the staging machine's ``Refusal`` value
(``lorapub.core.staging.messages``, where its codes are defined) as an exception, and its body."""

from __future__ import annotations

from typing import Any

from lorapub.core.staging.messages import Refusal, invalid, refusal

__all__ = ["Refused", "refuse", "bad"]


class Refused(Exception):
    """A definite no: ``status`` and a stable ``code`` go back to the caller."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    @classmethod
    def of(cls, value: Refusal) -> Refused:
        """The machine's refusal, raised."""
        return cls(value.status, value.code, value.message)

    def value(self) -> Refusal:
        """The refusal as the machine's value (what its commands carry)."""
        return Refusal(self.status, self.code, self.message)

    def to_json(self) -> dict[str, Any]:
        """The refusal's body: ``{"error": {"message": ..., "code": ...}}`` (its status is the HTTP status)."""
        return {"error": {"message": self.message, "code": self.code}}

    @classmethod
    def from_json(cls, status: int, value: object) -> Refused:
        """The refusal a staging route answered with ``status`` (a body of another form: refused as malformed)."""
        error = value.get("error") if isinstance(value, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(
                error.get("code"), str):
            raise bad(f"not a staging refusal: {value!r:.200}")
        return cls(status, error["code"], error["message"])


def refuse(message: str, code: str = "STAGE_REFUSED", status: int = 409) -> Refused:
    return Refused.of(refusal(message, code, status))


def bad(message: str) -> Refused:
    return Refused.of(invalid(message))

"""lorapub's refusals in Relax's shape: chat errors keeping their code, error results, and the
exported sample metadata."""

from __future__ import annotations

from typing import Any, Callable, Mapping, overload

from lorapub import LorapubError

__all__ = ['CONTEXT_MARKERS', 'NOT_RESENDABLE', 'RESENDABLE', 'RelaxChatError', 'chat_error', 'error_result', 'export_metadata']

# ---------------------------------------------------------------------------------------------
# Errors in Relax's shape
# ---------------------------------------------------------------------------------------------

#: Codes an agent's client may send again as they are: nothing ran (no version yet, the bound version is
#: being loaded again, the engine is away) or the engine's failure was definite. They answer 5xx, which
#: OpenAI-style clients resend.
RESENDABLE: dict[str, int] = {
    "NO_PUBLISHED_VERSION": 503, "VERSION_MISSING": 503, "VERSION_RECLAIMING": 503, "VERSION_SUSPECT": 503,
    "ENGINE_UNAVAILABLE": 503, "ENGINE_CLOSED": 503, "ENGINE_ERROR": 502,
}
#: Codes an agent's client must not send again: the request may have run (OUTCOME_UNKNOWN), its answer is not
#: the session's version's (PROVENANCE_MISMATCH, NUMERIC_MISMATCH), or the session or its group can generate
#: no more. They answer 4xx other than 408, 409 and 429, which clients do not resend.
NOT_RESENDABLE: dict[str, int] = {
    "BINDING_STALE": 410, "SESSION_EXPIRED": 410, "GROUP_CLOSED": 410, "DEPLOYMENT_CLOSED": 410,
    "SESSION_CLOSED": 404, "OUTCOME_UNKNOWN": 424, "PROVENANCE_MISMATCH": 421, "NUMERIC_MISMATCH": 421,
    "INVALID_INPUT": 400,
}
_CHAT_STATUS = {**RESENDABLE, **NOT_RESENDABLE}
#: Any other lorapub code (a publication's or an operator's, never a generation's): not resent either.
_OTHER_STATUS = 422
CONTEXT_MARKERS = ("maximum context length", "Requested token count exceeds")


class RelaxChatError(Exception):
    """Shaped like Relax's ``AgenticChatRequestError`` (same constructor and attributes), for where
    that class is not at hand; the shard passes Relax's own to :meth:`RelaxLorapub.wrap_backend`."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_request_error",
        param: str | None = None,
        status_code: int = 400,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = message
        self.code = code
        self.param = param
        self.status_code = status_code
        self.error_type = error_type


@overload
def chat_error(exc: LorapubError, error_type: None = None) -> RelaxChatError: ...
@overload
def chat_error(exc: LorapubError, error_type: Callable[..., Exception] | None) -> Exception: ...


def chat_error(exc: LorapubError, error_type: Callable[..., Exception] | None = None) -> Exception:
    """A lorapub error as Relax's chat error: ``_chat`` answers it with its status and code kept (never
    a 500, never a group drop). The lorapub error is its ``__cause__`` and ``lorapub_error``."""
    cls = error_type or RelaxChatError
    error = cls(
        str(exc), code=exc.code, param=None, status_code=_CHAT_STATUS.get(exc.code, _OTHER_STATUS), error_type="lorapub_error"
    )
    error.__cause__ = exc
    try:
        setattr(error, "lorapub_error", exc)  # an attribute the class need not declare
    except AttributeError:  # a class with __slots__
        pass
    return error


def error_result(exc: LorapubError) -> dict[str, Any]:
    """What Relax's ``_error_from_exception`` makes of :func:`chat_error` (its error-result dict)."""
    error = chat_error(exc)
    return {
        "_http_status": error.status_code,
        "error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code},
    }


def export_metadata(meta_info: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of one generation, for the exported sample's metadata (``{"lorapub": {...}}``:
    version, version_id, lag, lora_name, rebinds, and ``stamp``: what the engine attests served it,
    None where it does not stamp); empty when lorapub did not serve it."""
    provenance = meta_info.get("lorapub") if isinstance(meta_info, Mapping) else None
    return {"lorapub": dict(provenance)} if provenance else {}

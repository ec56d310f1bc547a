"""SGLang contract double: an aiohttp server speaking SGLang 0.5.23's LoRA HTTP contract. A test
double, not an engine: no model runs; what it keeps faithful is the lifecycle lorapub depends on,
running SGLang's own ``LoRARegistry`` (the installed SGLang's, or lorapub's verbatim copy of
0.5.23's), with injectable faults. Outputs are a deterministic function of (adapter content, tokens).
See docs/testing.md, "`SGLangDouble`: the SGLang contract double".
"""

from __future__ import annotations

from lorapub.testing.sglang_double.auth import (
    ADMIN_FORCE,
    ADMIN_OPTIONAL,
    NORMAL,
    ROUTE_AUTH_LEVELS,
    decide_request_auth,
)
from lorapub.testing.sglang_double.engine import Fault, content_signature, next_token, token_logprob
from lorapub.testing.sglang_double.server import SGLangDouble
from lorapub.testing.sglang_double.under_test import SGLangUnderTest

__all__ = [
    "NORMAL", "ADMIN_OPTIONAL", "ADMIN_FORCE", "ROUTE_AUTH_LEVELS", "decide_request_auth", "content_signature",
    "token_logprob", "next_token", "Fault", "SGLangDouble", "SGLangUnderTest",
]

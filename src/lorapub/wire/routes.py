"""The names both sides of the protocol share: the state route and the staging routes, the reclaim
header, the managed-prefix environment variable, the bucket formats and the load forms.
See docs/sglang-patch.md, "Engine-side staging routes (both releases)".
"""

from __future__ import annotations

import re

__all__ = ["STATE_ROUTE", "RECLAIM_HEADER", "MANAGED_PREFIX_ENV", "PREFIX", "BEGIN_ROUTE", "BUCKET_ROUTE",
           "END_ROUTE", "CLEANUP_ROUTE", "RELEASE_ROUTE", "ROUTES", "TRANSPORTS", "FORMATS", "LOAD_FORMS", "SHM_NAME"]

#: The route lorapub's SGLang patch adds: incarnation, adapters, native refs, pending unloads, staging.
STATE_ROUTE = "/lorapub/state"
#: The header that authorises the unload of a managed adapter (reclaim or cleanup).
RECLAIM_HEADER = "X-Lorapub-Reclaim-Id"
#: The SGLang patch protects the adapter names that start with this variable's prefix
#: (``lorapub.core.identity.MANAGED_PREFIX`` when unset); a deployment's ``name_prefix`` must match it.
MANAGED_PREFIX_ENV = "SGLANG_LORAPUB_MANAGED_PREFIX"

PREFIX = "/lorapub/stage"
BEGIN_ROUTE, BUCKET_ROUTE, END_ROUTE = f"{PREFIX}/begin", f"{PREFIX}/bucket", f"{PREFIX}/end"
CLEANUP_ROUTE, RELEASE_ROUTE = f"{PREFIX}/cleanup", f"{PREFIX}/release"
#: (method, path) of every staging route; all are admin-level, like SGLang's LoRA admin routes.
ROUTES = (("POST", BEGIN_ROUTE), ("POST", BUCKET_ROUTE), ("POST", END_ROUTE), ("POST", CLEANUP_ROUTE),
          ("POST", RELEASE_ROUTE))
#: How a transport's buckets reach the engine (a begin's ``transport.kind``).
TRANSPORTS = ("http", "shm", "torch")
#: A bucket body's ``format``.
FORMATS = ("raw", "safetensors", "shm", "torch")
LOAD_FORMS = ("dir", "tensors")
#: A shared-memory bucket file is named like this, inside the engine's allowed shm folder.
SHM_NAME = re.compile(r"lorapub-[0-9a-f]{8,64}-b[0-9]{1,6}\.bucket")

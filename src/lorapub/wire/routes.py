"""The engine-side staging routes, the bucket formats and the load forms (docs/sglang-patch.md)."""

from __future__ import annotations

import re

__all__ = ["PREFIX", "BEGIN_ROUTE", "BUCKET_ROUTE", "END_ROUTE", "CLEANUP_ROUTE", "RELEASE_ROUTE", "ROUTES",
           "FORMATS", "LOAD_FORMS", "SHM_NAME"]

PREFIX = "/lorapub/stage"
BEGIN_ROUTE, BUCKET_ROUTE, END_ROUTE = f"{PREFIX}/begin", f"{PREFIX}/bucket", f"{PREFIX}/end"
CLEANUP_ROUTE, RELEASE_ROUTE = f"{PREFIX}/cleanup", f"{PREFIX}/release"
#: (method, path) of every staging route; all are admin-level, like SGLang's LoRA admin routes.
ROUTES = (("POST", BEGIN_ROUTE), ("POST", BUCKET_ROUTE), ("POST", END_ROUTE), ("POST", CLEANUP_ROUTE),
          ("POST", RELEASE_ROUTE))
FORMATS = ("raw", "safetensors", "shm", "torch")
LOAD_FORMS = ("dir", "tensors")
#: A shared-memory bucket file is named like this, inside the engine's allowed shm folder.
SHM_NAME = re.compile(r"lorapub-[0-9a-f]{8,64}-b[0-9]{1,6}\.bucket")

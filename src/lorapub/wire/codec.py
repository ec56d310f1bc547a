"""The attempt token and the bucket plan as JSON, and the manifest digest a plan describes."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.manifest import Bucket, BucketPlan, Manifest, TensorEntry
from lorapub.wire.refusal import Refused, bad

__all__ = ["token_to_json", "token_from_json", "token_params", "plan_to_json", "plan_from_json", "manifest_digest",
           "json_bytes", "json_or_text"]


def token_to_json(token: AttemptToken) -> dict[str, int | str]:
    return {"epoch": token.version.deployment_epoch, "version_id": token.version.version_id, "seq": token.seq}


def token_from_json(value: Any) -> AttemptToken:
    try:
        return AttemptToken(VersionKey(int(value["epoch"]), str(value["version_id"])), int(value["seq"]))
    except Exception as e:  # noqa: BLE001 - anything malformed is a 400
        raise bad(f"not an attempt token: {value!r:.200} ({e})") from None


def token_params(token: AttemptToken) -> dict[str, str]:
    """The token as URL query parameters (a bucket's body is its bytes)."""
    return {k: str(v) for k, v in token_to_json(token).items()}


def plan_to_json(plan: BucketPlan) -> dict[str, Any]:
    return {
        "digest": plan.digest,
        "serving_config_json": plan.serving_config_json,
        "buckets": [{"index": b.index, "entries": [e.canonical() for e in b.entries]} for b in plan.buckets],
    }


def plan_from_json(value: Any) -> BucketPlan:
    """The plan, with every bucket's size and digest recomputed here (never taken on trust)."""
    try:
        buckets = []
        for i, b in enumerate(value["buckets"]):
            if int(b["index"]) != i:
                raise ValueError(f"bucket {i} says index {b['index']}")
            entries = tuple(
                TensorEntry(str(e["name"]), str(e["dtype"]), tuple(int(x) for x in e["shape"]), int(e["nbytes"]),
                            str(e["sha256"]))
                for e in b["entries"]
            )
            if not entries:
                raise ValueError(f"bucket {i} is empty")
            for e in entries:
                if e.nbytes < 0 or any(x < 0 for x in e.shape) or not re.fullmatch(r"[0-9a-f]{64}", e.sha256):
                    raise ValueError(f"tensor {e.name!r} has a bad size, shape or digest")
            buckets.append(Bucket(i, entries, sum(e.nbytes for e in entries),
                                  hashlib.sha256("".join(e.sha256 for e in entries).encode()).hexdigest()))
        if not buckets:
            raise ValueError("no buckets")
        return BucketPlan(str(value["digest"]), tuple(buckets), str(value["serving_config_json"]))
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001
        raise bad(f"not a bucket plan: {e}") from None


def manifest_digest(plan: BucketPlan) -> str:
    """The digest of the manifest the plan's tensors and serving config describe."""
    entries = [e for b in plan.buckets for e in b.entries]
    try:
        return Manifest.build(entries, json.loads(plan.serving_config_json)).digest
    except Exception as e:  # noqa: BLE001 - unsorted/duplicate names, a config that is not JSON
        raise bad(f"the plan describes no valid manifest: {e}") from None


def json_bytes(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text

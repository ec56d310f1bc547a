"""The protocol's bodies as typed values, each with its one codec: the begin, bucket, end, cleanup and
release requests, their replies and the state route's reply. The publisher's adapter, the engine-side
staging and lorapub's SGLang double all encode and decode them here; anything malformed is refused
(``Refused``, 400).
See docs/sglang-patch.md, "Engine-side staging routes (both releases)".
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from lorapub.core.identity import AttemptToken, check_digest
from lorapub.core.manifest import BucketPlan
from lorapub.core.staging.messages import Receipt
from lorapub.wire.codec import plan_from_json, plan_to_json, token_from_json, token_params, token_to_json
from lorapub.wire.refusal import Refused, bad
from lorapub.wire.routes import FORMATS, LOAD_FORMS, SHM_NAME, TRANSPORTS

__all__ = ["AdapterEntry", "AttemptReport", "BeginBody", "BeginSent", "BucketParams", "BucketSent", "CleanupBody",
           "CleanupReply", "EndBody", "EndReply", "ReleaseBody", "ReleaseReply", "StageReply", "StagingReport",
           "StateReply", "ShmControl", "TorchControl", "TorchOptions", "receipt_from_json", "receipt_to_json"]


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise bad(f"{what} takes a JSON object")
    return value


def _text(value: Mapping[str, Any], key: str, what: str) -> str:
    found = value.get(key)
    if not isinstance(found, str):
        raise bad(f"{what} without its {key} (got {found!r:.80})")
    return found


def _flag(value: Mapping[str, Any], key: str) -> bool:
    found = value.get(key, False)
    if not isinstance(found, bool):
        raise bad(f"{key} is true or false, got {found!r:.80}")
    return found


# -- requests ------------------------------------------------------------------------------------------
def _copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A mapping field's own copy (a body's value never changes under it)."""
    return dict(value)


def _http() -> dict[str, Any]:
    return {"kind": "http"}


@attrs.frozen
class BeginBody:
    """``POST /lorapub/stage/begin``: the attempt, the engine life it is meant for (``incarnation``,
    compared by the engine, never parsed), its managed name and digest, the bucket plan, the transport's
    begin options (``kind``: ``http``, ``shm`` or ``torch``) and the load form."""

    token: AttemptToken
    incarnation: Any
    lora_name: str
    digest: str
    plan: BucketPlan
    transport: Mapping[str, Any] = attrs.field(factory=_http, converter=_copy, hash=False)
    load: str = "dir"

    @property
    def kind(self) -> str:
        return str(self.transport.get("kind", "http"))

    def to_json(self) -> dict[str, Any]:
        return {"token": token_to_json(self.token), "incarnation": self.incarnation, "lora_name": self.lora_name,
                "digest": self.digest, "plan": plan_to_json(self.plan), "transport": dict(self.transport),
                "load": self.load}

    @classmethod
    def from_json(cls, value: object) -> BeginBody:
        return BeginSent.from_json(value).checked()


@attrs.frozen
class BeginSent:
    """A begin's body as it came: its token (a body without one is refused at once), the fields the
    staging compares as they came (the life, the name, the digest: a duplicate begin is answered
    before the rest is looked at), and :meth:`checked`, the body or the first thing wrong with it."""

    token: AttemptToken
    incarnation: Any
    lora_name: Any
    digest: Any
    fields: Mapping[str, Any] = attrs.field(eq=False, repr=False, hash=False)

    @classmethod
    def from_json(cls, value: object) -> BeginSent:
        body = _object(value, "begin")
        return cls(token_from_json(body.get("token")), body.get("incarnation"), body.get("lora_name"),
                   body.get("digest"), body)

    def checked(self) -> BeginBody:
        """The body, or the first thing malformed in it refused: its plan, digest, name, transport, load form."""
        plan = plan_from_json(self.fields.get("plan"))
        try:
            digest = check_digest(self.digest)
        except Exception:  # noqa: BLE001
            raise bad(f"digest {self.digest!r:.80} is not a SHA-256 hex digest") from None
        if not isinstance(self.lora_name, str):
            raise bad(f"lora_name {self.lora_name!r:.80} is not an adapter name")
        transport = self.fields.get("transport") or _http()
        if not isinstance(transport, Mapping):
            raise bad(f"transport {transport!r:.80} is not a JSON object")
        kind = transport.get("kind", "http")
        if kind not in TRANSPORTS:
            raise bad(f"unknown transport {kind!r}")
        load = self.fields.get("load", "dir")
        if load not in LOAD_FORMS:
            raise bad(f"unknown load form {load!r}; one of {LOAD_FORMS}")
        return BeginBody(self.token, self.incarnation, self.lora_name, digest, plan, transport, load)


@attrs.frozen
class TorchOptions:
    """A begin's ``transport`` for the torch transport: the group store the engine joins (``host``,
    ``port``), the collective's ``backend`` (``gloo`` or ``nccl``), the ``device`` it receives on, and the
    seconds it waits for the group (``timeout``)."""

    host: str
    port: int
    backend: str = "gloo"
    device: str = "cpu"
    timeout: float = 60.0

    def to_json(self) -> dict[str, Any]:
        return {"kind": "torch", "host": self.host, "port": self.port, "backend": self.backend,
                "device": self.device, "timeout": self.timeout}

    @classmethod
    def from_json(cls, value: object) -> TorchOptions:
        try:
            body = _object(value, "a torch transport")
            host, port = body["host"], int(body["port"])
            if not isinstance(host, str) or not host:
                raise ValueError(f"host {host!r}")
            timeout, backend = float(body.get("timeout", 60.0)), body.get("backend", "gloo")
            device = body.get("device", "cpu")
            if backend not in ("gloo", "nccl") or not 0 < port < 65536 or not timeout > 0 or not isinstance(device, str):
                raise ValueError(f"backend {backend!r}, port {port}, timeout {timeout}, device {device!r}")
        except Exception as e:  # noqa: BLE001
            raise bad(f"a torch transport needs host, port, backend (gloo|nccl) and timeout: {e}") from None
        return cls(host, port, backend, device, timeout)


@attrs.frozen
class BucketParams:
    """``POST /lorapub/stage/bucket``'s query parameters (its body is the bucket's bytes, or for ``shm``
    and ``torch`` a small JSON object): the token, the bucket's ``index``, the engine life it is meant for
    and the body's ``format``."""

    token: AttemptToken
    index: int
    incarnation: str | None
    format: str = "raw"

    def to_params(self) -> dict[str, str]:
        params = {**token_params(self.token), "index": str(self.index), "format": self.format}
        if self.incarnation is not None:
            params["incarnation"] = self.incarnation
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> BucketParams:
        return BucketSent.from_params(params).checked()


@attrs.frozen
class BucketSent:
    """A bucket's query parameters as they came: its token (refused at once without one), the life it
    names, and :meth:`checked`, the parameters or the first thing wrong with them."""

    token: AttemptToken
    incarnation: str | None
    fields: Mapping[str, str] = attrs.field(eq=False, repr=False, hash=False)

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> BucketSent:
        return cls(token_from_json(params), params.get("incarnation"), params)

    def checked(self) -> BucketParams:
        try:
            index = int(self.fields.get("index", ""))
        except ValueError:
            raise bad(f"bucket index {self.fields.get('index')!r} is not an int") from None
        fmt = self.fields.get("format", "raw")
        if fmt not in FORMATS:
            raise bad(f"unknown bucket format {fmt!r}")
        return BucketParams(self.token, index, self.incarnation, fmt)


@attrs.frozen
class ShmControl:
    """A ``shm`` bucket's body: the name of the shared-memory file the publisher wrote it to (in the
    engine's shm folder)."""

    name: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_json(cls, value: object) -> ShmControl:
        name = _object(value, "a shared-memory bucket").get("name")
        if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
            raise bad(f"shared-memory bucket name {name!r:.80} is not a lorapub bucket file")
        return cls(name)


@attrs.frozen
class TorchControl:
    """A ``torch`` bucket's body: the engine's ``rank`` in the attempt's group of ``world_size``, and the
    rank that broadcasts (``src``, the publisher)."""

    rank: int
    world_size: int
    src: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "src": self.src}

    @classmethod
    def from_json(cls, value: object) -> TorchControl:
        body = _object(value, "a torch bucket")
        try:
            rank, world, src = int(body["rank"]), int(body["world_size"]), int(body.get("src", 0))
            if not (0 < rank < world and 0 <= src < world and src != rank):
                raise ValueError(f"rank {rank}, world {world}, src {src}")
        except Exception as e:  # noqa: BLE001
            raise bad(f"a torch bucket names rank (1..world-1), world_size and src: {e}") from None
        return cls(rank, world, src)


@attrs.frozen
class EndBody:
    """``POST /lorapub/stage/end``: load the attempt's verified buckets in the life it names."""

    token: AttemptToken
    incarnation: Any

    def to_json(self) -> dict[str, Any]:
        return {"token": token_to_json(self.token), "incarnation": self.incarnation}

    @classmethod
    def from_json(cls, value: object) -> EndBody:
        body = _object(value, "end")
        return cls(token_from_json(body.get("token")), body.get("incarnation"))


@attrs.frozen
class CleanupBody:
    """``POST /lorapub/stage/cleanup``: tombstone the attempt and free what it staged (whatever life)."""

    token: AttemptToken

    def to_json(self) -> dict[str, Any]:
        return {"token": token_to_json(self.token)}

    @classmethod
    def from_json(cls, value: object) -> CleanupBody:
        return cls(token_from_json(_object(value, "cleanup").get("token")))


@attrs.frozen
class ReleaseBody:
    """``POST /lorapub/stage/release``: ``lora_name`` was unloaded; free what its attempt still keeps."""

    lora_name: str

    def to_json(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name}

    @classmethod
    def from_json(cls, value: object) -> ReleaseBody:
        name = value.get("lora_name") if isinstance(value, Mapping) else None
        if not isinstance(name, str):
            raise bad("release takes {\"lora_name\": ...}")
        return cls(name)


# -- replies -------------------------------------------------------------------------------------------
@attrs.frozen
class StageReply:
    """A begin's or a bucket's answer: the engine's life, and whether it had it already (``duplicate``:
    nothing was done twice)."""

    incarnation: str
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "duplicate": self.duplicate}

    @classmethod
    def from_json(cls, value: object) -> StageReply:
        body = _object(value, "a staging reply")
        return cls(_text(body, "incarnation", "a staging reply"), _flag(body, "duplicate"))


def receipt_to_json(receipt: Receipt) -> dict[str, Any]:
    """What an end loaded, as its reply and a cleanup's carry it."""
    return {"incarnation": receipt.incarnation, "lora_name": receipt.lora_name, "digest": receipt.digest,
            "lora_id": receipt.lora_id, "lora_path": receipt.lora_path, "load": receipt.load,
            # where end's time went: the last SHA-256 checks, then the engine's load
            "timings": {"verify_wait": receipt.verify_wait, "load": receipt.load_s}}


def _seconds(timings: Mapping[str, Any], key: str) -> float:
    found = timings.get(key, 0.0)
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        raise bad(f"a receipt's {key} time is a number of seconds, got {found!r:.80}")
    return float(found)


def receipt_from_json(value: object) -> Receipt:
    body = _object(value, "a receipt")
    timings = body.get("timings") or {}
    if not isinstance(timings, Mapping):
        raise bad(f"a receipt's timings are a JSON object, got {timings!r:.80}")
    return Receipt(_text(body, "incarnation", "a receipt"), _text(body, "lora_name", "a receipt"),
                   _text(body, "digest", "a receipt"), body.get("lora_id"), body.get("lora_path"),
                   _text(body, "load", "a receipt"), _seconds(timings, "verify_wait"), _seconds(timings, "load"))


@attrs.frozen
class EndReply:
    """An end's answer: what it loaded (a duplicate end answers the same receipt, nothing loaded twice)."""

    receipt: Receipt
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**receipt_to_json(self.receipt), "duplicate": self.duplicate}

    @classmethod
    def from_json(cls, value: object) -> EndReply:
        return cls(receipt_from_json(value), _flag(_object(value, "an end's reply"), "duplicate"))


@attrs.frozen
class CleanupReply:
    """A cleanup's answer: what the attempt loaded (None: nothing; the caller unloads it otherwise).
    ``said`` False: the engine did not say (a staging that predates the field): unload to be safe."""

    incarnation: str
    loaded: Receipt | None
    said: bool = attrs.field(default=True)

    @said.validator
    def _check(self, attribute: object, said: bool) -> None:
        if not said and self.loaded is not None:
            raise ValueError("a cleanup reply that does not say what was loaded names no receipt")

    @property
    def must_unload(self) -> bool:
        return self.loaded is not None or not self.said

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"incarnation": self.incarnation}
        if self.said:
            body["loaded"] = None if self.loaded is None else receipt_to_json(self.loaded)
        return body

    @classmethod
    def from_json(cls, value: object) -> CleanupReply:
        body = _object(value, "a cleanup's reply")
        incarnation = _text(body, "incarnation", "a cleanup's reply")
        if "loaded" not in body:
            return cls(incarnation, None, said=False)
        loaded = body["loaded"]
        return cls(incarnation, None if loaded is None else receipt_from_json(loaded))


@attrs.frozen
class ReleaseReply:
    """A release's answer: the attempts it freed (their tokens' text)."""

    incarnation: str
    freed: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "freed": list(self.freed)}

    @classmethod
    def from_json(cls, value: object) -> ReleaseReply:
        body = _object(value, "a release's reply")
        freed = body.get("freed", [])
        if not isinstance(freed, list) or not all(isinstance(t, str) for t in freed):
            raise bad(f"a release's freed attempts are a list of tokens, got {freed!r:.80}")
        return cls(_text(body, "incarnation", "a release's reply"), tuple(freed))



# -- the state route's reply ---------------------------------------------------------------------------
def _count(value: Mapping[str, Any], key: str, default: int = 0) -> int:
    found = value.get(key, default)
    if isinstance(found, bool) or not isinstance(found, int):
        raise bad(f"{key} is a whole number, got {found!r:.80}")
    return found


def _number(value: Mapping[str, Any], key: str) -> float:
    found = value.get(key, 0.0)
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        raise bad(f"{key} is a number, got {found!r:.80}")
    return float(found)


def _table(value: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    found = value.get(key)
    if found is None:
        return {}
    if not isinstance(found, Mapping):
        raise bad(f"{key} is a JSON object, got {found!r:.80}")
    return found


@attrs.frozen
class AdapterEntry:
    """One adapter registered in the engine: SGLang's ``lora_id`` and ``lora_path``, whether it is
    pinned, and ``refs``, the requests in flight on it (SGLang's own count)."""

    lora_id: Any
    lora_path: Any = None
    pinned: bool = False
    refs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"lora_id": self.lora_id, "lora_path": self.lora_path, "pinned": self.pinned, "refs": self.refs}

    @classmethod
    def from_json(cls, value: object) -> AdapterEntry:
        body = _object(value, "an adapter's entry")
        return cls(body.get("lora_id"), body.get("lora_path"), _flag(body, "pinned"), _count(body, "refs"))


@attrs.frozen
class AttemptReport:
    """One attempt the engine-side staging holds: its ``phase`` (``receiving``, ``failed`` or ``loaded``),
    the ``buckets`` received of ``planned``, the ``bytes`` held, ``idle_s`` since an operation last drove
    it (``driving``: one runs now), whether a ``folder`` holds it, its transport kind and load form."""

    token: AttemptToken
    lora_name: str
    phase: str = "receiving"
    buckets: tuple[int, ...] = ()
    planned: int = 0
    nbytes: int = 0
    loaded: bool = False
    folder: bool = False
    transport: str = "http"
    load: str = "dir"
    idle_s: float = 0.0
    driving: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"token": token_to_json(self.token), "lora_name": self.lora_name, "phase": self.phase,
                "buckets": list(self.buckets), "planned": self.planned, "bytes": self.nbytes, "loaded": self.loaded,
                "folder": self.folder, "transport": self.transport, "load": self.load, "idle_s": self.idle_s,
                "driving": self.driving}

    @classmethod
    def from_json(cls, value: object) -> AttemptReport:
        body = _object(value, "a staged attempt")
        buckets = body.get("buckets", [])
        if not isinstance(buckets, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in buckets):
            raise bad(f"a staged attempt's buckets are a list of indices, got {buckets!r:.80}")
        return cls(token_from_json(body.get("token")), _text(body, "lora_name", "a staged attempt"),
                   str(body.get("phase", "receiving")), tuple(buckets), _count(body, "planned"), _count(body, "bytes"),
                   _flag(body, "loaded"), _flag(body, "folder"), str(body.get("transport", "http")),
                   str(body.get("load", "dir")), _number(body, "idle_s"), _flag(body, "driving"))


@attrs.frozen
class StagingReport:
    """What the engine-side staging holds: every attempt (keyed by its token's text), the bytes held and
    ``reserved`` (by attempts still receiving), tombstones, collectives joined, its idle timeout and the
    attempts aged out."""

    attempts: Mapping[str, AttemptReport] = attrs.field(factory=dict, converter=_copy, hash=False)
    nbytes: int = 0
    reserved: int = 0
    tombstones: int = 0
    collectives: int = 0
    idle_timeout_s: float = float("inf")
    aged_out: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"attempts": {key: a.to_json() for key, a in self.attempts.items()}, "bytes": self.nbytes,
                "reserved": self.reserved, "tombstones": self.tombstones, "collectives": self.collectives,
                "idle_timeout_s": self.idle_timeout_s, "aged_out": self.aged_out}

    @classmethod
    def from_json(cls, value: object) -> StagingReport:
        body = _object(value, "a staging report")
        attempts = {str(key): AttemptReport.from_json(a) for key, a in _table(body, "attempts").items()}
        return cls(attempts, _count(body, "bytes"), _count(body, "reserved"), _count(body, "tombstones"),
                   _count(body, "collectives"), _number(body, "idle_timeout_s") if "idle_timeout_s" in body
                   else float("inf"), _count(body, "aged_out"))


@attrs.frozen
class StateReply:
    """``GET /lorapub/state``: the engine's life (``incarnation``), its registered adapters, the unloads
    it has begun and not finished, ``max_loaded_loras``, whether lorapub's managed-adapter patch runs
    (and the name prefix it protects), whether its answers carry provenance stamps, what its staging
    holds (None: no staging), and, from the patch, the SGLang release and the patch's form."""

    incarnation: str
    adapters: Mapping[str, AdapterEntry] = attrs.field(factory=dict, converter=_copy, hash=False)
    pending_unloads: Mapping[str, Any] = attrs.field(factory=dict, converter=_copy, hash=False)
    max_loaded_loras: int | None = None
    managed_patch: bool = False
    managed_prefix: str | None = None
    stamps: bool = False
    staging: StagingReport | None = None
    sglang: str | None = None
    patch: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "incarnation": self.incarnation, "max_loaded_loras": self.max_loaded_loras,
            "managed_patch": self.managed_patch, "managed_prefix": self.managed_prefix, "stamps": self.stamps,
            "adapters": {name: a.to_json() for name, a in self.adapters.items()},
            "pending_unloads": dict(self.pending_unloads),
            "staging": None if self.staging is None else self.staging.to_json()}
        for key, value in (("sglang", self.sglang), ("patch", self.patch)):
            if value is not None:
                body[key] = value
        return body

    @classmethod
    def from_json(cls, value: object) -> StateReply:
        body = _object(value, "a state")
        limit = body.get("max_loaded_loras")
        if limit is not None and not isinstance(limit, int):
            raise bad(f"max_loaded_loras is a whole number or null, got {limit!r:.80}")
        prefix, release, form = body.get("managed_prefix"), body.get("sglang"), body.get("patch")
        for key, found in (("managed_prefix", prefix), ("sglang", release), ("patch", form)):
            if found is not None and not isinstance(found, str):
                raise bad(f"{key} is text or null, got {found!r:.80}")
        staging = body.get("staging")
        return cls(_text(body, "incarnation", "a state"),
                   {str(name): AdapterEntry.from_json(a) for name, a in _table(body, "adapters").items()},
                   _table(body, "pending_unloads"), limit, _flag(body, "managed_patch"), prefix,
                   _flag(body, "stamps"), None if staging is None else StagingReport.from_json(staging), release, form)

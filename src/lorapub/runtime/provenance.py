"""Checks each turn's engine stamp against the session's binding: the same name and digest, from a
life of an engine it may have run on. A wrong stamp, or none from an engine that declares it stamps,
is :class:`~lorapub.errors.ProvenanceMismatch`; an engine that does not stamp is noted, not failed.
See docs/provenance.md, "Stamp".
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from lorapub.core.session import Binding
from lorapub.errors import LorapubError, ProvenanceMismatch
from lorapub.runtime.fleet import FleetView

__all__ = ["STAMP_KEY", "STAMP_FIELDS", "attest", "stamp_of", "stamp_said", "unstamped"]

#: The key of a response's ``meta_info`` that carries the stamp (lorapub's SGLang patch writes it).
STAMP_KEY = "lorapub"
STAMP_FIELDS = ("lora_name", "digest", "engine", "incarnation", "lora_id")

log = logging.getLogger(__name__)


def stamp_of(out: Any) -> Mapping[str, Any] | None:
    """The stamp of one response (None: none)."""
    meta = out.get("meta_info") if isinstance(out, Mapping) else None
    found = meta.get(STAMP_KEY) if isinstance(meta, Mapping) else None
    return found if isinstance(found, Mapping) else None


def stamp_said(error: ProvenanceMismatch) -> dict[str, object] | None:
    """The stamp a mismatch names: what the engine said (None: no stamp)."""
    stamp = error.details.get("stamp")
    return stamp if isinstance(stamp, dict) else None


def _expected(binding: Binding) -> dict[str, str]:
    return {"version": str(binding.version), "lora_name": binding.lora_name, "digest": binding.digest}


def _candidates(fleet: FleetView, target: str, binding: Binding) -> list[str]:
    """The engines the request may have run on: the target itself (a member, or one removed while the
    request ran: its lives are still known), or behind a router, the holders."""
    if target in fleet.engines or fleet.lives_seen.of([target]):
        return [target]
    holders = fleet.holders(binding.version)
    return sorted(holders) if holders else sorted(fleet.engines)


async def _attests(fleet: FleetView, names: list[str], fresh: bool) -> dict[str, tuple[bool, str] | None]:
    missing = [n for n in names if fresh or n not in fleet.attests]
    if missing:
        await fleet.lives(missing)
    return {n: fleet.attests.get(n) for n in names}


async def attest(fleet: FleetView, target: str, binding: Binding, out: Any) -> dict[str, Any] | None:
    """The turn's stamp if it attests ``binding`` (None: the engine does not stamp); raises
    :class:`ProvenanceMismatch` otherwise. ``target``: the name of where the request was sent."""
    names = _candidates(fleet, target, binding)
    stamp = stamp_of(out)

    def mismatch(reason: str) -> ProvenanceMismatch:
        return ProvenanceMismatch(
            f"{target}: the turn's stamp does not attest {binding.lora_name} (digest {binding.digest[:12]}): {reason}; "
            "the turn is not a success", expected=_expected(binding), stamp=dict(stamp) if stamp else None,
            engine=target, reason=reason,
        )

    if stamp is None:
        said = await _attests(fleet, names, fresh=False)
        if any(a is None for a in said.values()):
            said = await _attests(fleet, names, fresh=True)
        unknown = [n for n, a in said.items() if a is None]
        if unknown:
            raise mismatch(f"no stamp, and {', '.join(unknown)} could not say whether it stamps")
        if all(a is not None and a[0] for a in said.values()):
            raise mismatch("no stamp from an engine that stamps (a silent fallback to the base model?)")
        return None
    if stamp.get("lora_name") != binding.lora_name:
        raise mismatch(f"stamped {stamp.get('lora_name')!r}")
    if stamp.get("digest") != binding.digest:
        raise mismatch(f"stamped digest {str(stamp.get('digest'))[:12]} (other weights under the bound name)")
    for fresh in (False, True):  # a life this process has not seen yet: ask again before judging
        await _attests(fleet, names, fresh)
        if fresh:
            # the registry's record too: a worker holding only the API key cannot ask the engine its
            # life (an admin route), the deployment that publishes records every life it sees there
            try:
                await fleet.refresh()
            except LorapubError as e:  # judged on what is known: a registry that did not answer attests nothing
                log.info("provenance: the registry's record of lives was not read (%s)", e)
        # a past life is a life of the engine: a restart while the answer travelled back is no mismatch
        if stamp.get("incarnation") in fleet.lives_seen.of(names):
            return {k: stamp.get(k) for k in STAMP_FIELDS}
    raise mismatch(f"stamped by life {stamp.get('incarnation')!r}, not a life of {', '.join(names)}")


def unstamped(fleet: FleetView) -> list[str]:
    """Engines that answered and do not stamp (their turns are unattested)."""
    return sorted(n for n, (stamps, _) in fleet.attests.items() if not stamps and n in fleet.engines)

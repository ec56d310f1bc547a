"""What a process knows of the fleet from the registry's views and its own bindings, and what it
decides from that alone: where a version's generations may go, a binding's lag, whether it is stale
or gone. Pure: no I/O, no clock; each fact learned gives a new value (the runtime's FleetView holds it).
See docs/design.md, "Shape".
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from pyrsistent import PMap, pmap

from lorapub.core.identity import VersionKey
from lorapub.core.registry import Fleet
from lorapub.core.session import Binding

__all__ = ["FleetFacts"]


def _routes(value: Mapping[VersionKey, frozenset[str]] | None) -> PMap[VersionKey, frozenset[str]] | None:
    if value is None or isinstance(value, PMap):
        return value
    return pmap({key: frozenset(names) for key, names in value.items()})


@attrs.frozen
class FleetFacts:
    """The registry's latest view as this process holds it, and the defaults its bindings saw since.

    ``routes``: where each version's generations may go (its holders, never a joining member, a
    draining one only for a version no other member holds); None before the first view (every engine
    is a candidate). ``default_revision``/``default``: the newest default seen, by a view or a bind's
    reply (which can outrun the views). ``view_revision``: the default revision of the last view."""

    routes: PMap[VersionKey, frozenset[str]] | None = attrs.field(default=None, converter=_routes)
    default_revision: int = 0
    default: VersionKey | None = None
    view_revision: int = -1
    retiring: frozenset[VersionKey] = frozenset()
    max_lag: int | None = None
    on_stale: str = "error"
    joining: frozenset[str] = frozenset()  # members that take no traffic yet
    draining: frozenset[str] = frozenset()  # members that take no new binding

    def seen(self, fleet: Fleet) -> FleetFacts:
        """These facts once the registry's view ``fleet`` is read (a default never goes back)."""
        newer = fleet.default_revision >= self.default_revision
        return FleetFacts(
            routes=fleet.routing(),
            default_revision=max(self.default_revision, fleet.default_revision),
            default=fleet.default if newer else self.default,
            view_revision=fleet.default_revision,
            retiring=frozenset(fleet.retiring),
            max_lag=fleet.max_lag,
            on_stale=fleet.on_stale,
            joining=frozenset(fleet.joining),
            draining=frozenset(fleet.draining),
        )

    def with_routes(self, routes: Mapping[VersionKey, frozenset[str]]) -> FleetFacts:
        return attrs.evolve(self, routes=routes)

    def bound(self, binding: Binding) -> FleetFacts:
        """These facts once a bind's reply says ``binding`` (it lands on the default of its moment)."""
        if binding.revision <= self.default_revision:
            return self
        return attrs.evolve(self, default=binding.version, default_revision=binding.revision)

    def holders(self, version: VersionKey) -> frozenset[str] | None:
        """Engines ``version``'s generations may go to as last seen; None when not known (every engine)."""
        if self.routes is None:
            return None
        return self.routes.get(version)

    def lag(self, binding: Binding) -> int:
        """Commits behind the default, as this process last saw the default."""
        return max(0, self.default_revision - binding.revision)

    def is_stale(self, binding: Binding) -> bool:
        """Its version is retiring: the last view said so, or a default more than max_lag commits past it
        was seen since (a bind's reply can outrun the view). The registry retires a version exactly then,
        so this only learns it sooner, never wrongly."""
        return binding.version in self.retiring or (self.max_lag is not None and self.lag(binding) > self.max_lag)

    def gone(self, binding: Binding) -> bool:
        """The last view (newer than the binding) no longer serves its version: it is being reclaimed."""
        return (self.routes is not None and binding.revision <= self.view_revision
                and binding.version not in self.routes)

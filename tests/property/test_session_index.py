"""The session table's indexes under the whole core's race machine.

``RegistryMachine`` opens, binds, renews, closes, expires and forgets sessions in any order
while publications race. After every step the lease and tombstone indexes must equal what
a scan of the records gives, and the indexed ``ExpireLeases`` pass must decide exactly what
the scan of every record decides, at the machine's clock and at times around the deadlines.
"""

from __future__ import annotations

from hypothesis.stateful import invariant

from lorapub.core.registry.sessions import expire_by_scan
from lorapub.core import registry as R
from tests.property.test_registry_machine import RegistryMachine
from tests.unit.test_session_table import expected_indexes


class SessionIndexMachine(RegistryMachine):
    @invariant()
    def indexes_match_a_scan_of_the_records(self):
        if not hasattr(self, "state"):
            return
        assert self.state.sessions.index_entries() == expected_indexes(dict(self.state.sessions.items()))

    @invariant()
    def the_indexed_expiry_pass_decides_what_the_scan_decides(self):
        if not hasattr(self, "state"):
            return
        deadlines = {r.lease_until for r in self.state.sessions.values() if r.lease_until is not None}
        for now in {self.now, self.now + 500.0, *deadlines, *(d + 1e-3 for d in deadlines)}:
            by_index, by_scan = R.expire_leases(self.state, R.ExpireLeases(now)), expire_by_scan(self.state, now)
            assert by_index.reply == by_scan.reply and by_index.effects == by_scan.effects
            assert by_index.state == by_scan.state


TestSessionIndexMachine = SessionIndexMachine.TestCase

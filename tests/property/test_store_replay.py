"""Replay equivalence of the durable store, under the whole core's race machine.

Every command of ``RegistryMachine`` (publications with lost, failed, duplicated and
late replies, engine restarts, sessions opening, binding and closing in any order,
reclaims) goes through a ``LocalRegistry`` on a ``SQLiteStore`` as well as through the
pure core. After every step the registry is closed and reopened from its file: the
reopened state must equal the pure core's, and the run continues on the reopened
registry. Snapshots are tiny and frequent, so reopens land before, during and after
snapshots and their collection.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from lorapub.core import registry as R
from lorapub.errors import LorapubError
from lorapub.core.commands import stamped
from lorapub.local_registry import LocalRegistry
from lorapub.adapters.stores import SQLiteStore
from tests.property.test_registry_machine import WINDOW, EPOCH, SESSION_POOL, RegistryMachine


class StoreReplayMachine(RegistryMachine):
    @initialize(snapshot_every=st.integers(1, 6), part_entries=st.integers(1, 3))
    def setup(self, snapshot_every, part_entries):
        super().setup()
        self.dir = tempfile.mkdtemp(prefix="lorapub-store-")
        self.options = dict(snapshot_every=snapshot_every, part_entries=part_entries, gc_batch=2)
        self.registry = LocalRegistry(EPOCH, self.incarnations, store=self._store(), clock=lambda: self.now,
                                      lease_ttl=120.0, tombstone_window=WINDOW)
        assert self.registry.state == self.state

    def _store(self) -> SQLiteStore:
        return SQLiteStore(f"{self.dir}/registry.db", **self.options)

    def try_apply(self, command):
        try:
            expected = R.handle(self.state, stamped(command, self.now))  # as the single writer stamps it
        except LorapubError as e:
            expected = e
        try:
            result = self.registry.apply(command)
        except LorapubError as e:
            assert type(e) is type(expected) and e.message == expected.message
            return e
        assert not isinstance(expected, LorapubError), expected
        assert result.reply == expected.reply and result.effects == expected.effects
        assert self.registry.state == expected.state
        return self.apply(R.Outcome(self.registry.state, result.reply, result.effects))

    @rule(n=st.integers(1, len(SESSION_POOL)))
    def forget_sessions(self, n):
        self.try_apply(R.ForgetSessions(tuple(SESSION_POOL[:n])))
        for key in SESSION_POOL[:n]:
            if key not in self.state.sessions:  # its tombstone is gone: the key is new to the model too
                self.closed.discard(key)
                self.bound.pop(key, None)

    @invariant()
    def reopened_state_is_the_same(self):
        if not hasattr(self, "registry"):
            return
        self.registry.close()
        self.registry = LocalRegistry(EPOCH, {"ignored": "x"}, store=self._store(), clock=lambda: self.now)
        assert self.registry.state == self.state

    def teardown(self):
        if hasattr(self, "registry"):
            self.registry.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestStoreReplay = StoreReplayMachine.TestCase
# every step commits to disk and reopens the file: a quarter of the profile's examples
TestStoreReplay.settings = settings(max_examples=max(10, settings.default.max_examples // 4))

"""The facts the core reports are what the observer used to re-derive.

Before the core's Outcome carried facts, ``ObservedRegistry`` re-derived what the registry decided from
each command and its answer (its reply and effects), remembering claims and retirements to skip replays.
That derivation lives on here only, as the oracle: over the registry and membership machines' random
command sequences (their rules and strategies, unchanged), every command's facts equal what it would have
found, in order.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from lorapub.core import facts as F
from lorapub.core import registry as R
from lorapub.core.commands import ClaimReclaim, Commit, RecordReady, RecordUnloaded, stamped
from lorapub.core.effects import Ignored
from lorapub.core.version import CommitReceipt, VersionState
from lorapub.errors import LorapubError

from .test_membership_machine import MembershipMachine
from .test_registry_machine import RegistryMachine


class OldDerivation:
    """``ObservedRegistry._derive`` as it was, answering the facts instead of emitting events."""

    def __init__(self) -> None:
        self.claims: dict[Any, str] = {}
        self.retired: dict[Any, None] = {}

    def __call__(self, command: object, reply: Any, effects: tuple[Any, ...], before: Any) -> list[F.Fact]:
        found: list[F.Fact] = []
        if isinstance(command, RecordReady):
            # a READY with another digest aborts its attempt: no engine became ready (the old derivation
            # told it as EngineReady; corrected here as in the core)
            attempt = before.attempts.get(command.receipt.token)
            if not any(isinstance(fx, Ignored) for fx in effects) and (
                    attempt is None or attempt.digest == command.receipt.digest):
                found.append(F.Readied(command.receipt.token.version, command.receipt.engine))
        elif isinstance(command, Commit) and isinstance(reply, CommitReceipt) and reply.retired is not None:
            if reply.retired not in self.retired:
                self.retired[reply.retired] = None
                found.append(F.Retired(reply.retired, reply.version))
        elif isinstance(command, ClaimReclaim) and isinstance(reply, str):
            if self.claims.get(command.key) != reply:
                self.claims[command.key] = reply
                found.append(F.Claimed(command.key, reply))
        elif isinstance(command, RecordUnloaded):
            if not any(isinstance(fx, Ignored) for fx in effects):
                found.append(F.Unloaded(command.key, command.engine))
                if reply is VersionState.RECLAIMED:
                    found.append(F.Reclaimed(command.key))
        return found


class ReportsWhatWasDerived:
    """Wraps a machine's one way into the core: each command's facts against the old derivation."""

    def try_apply(self, command):
        if not hasattr(self, "derive"):
            self.derive, self.seen = OldDerivation(), 0
        command = stamped(command, self.now)
        try:
            outcome = R.handle(self.state, command)
        except LorapubError as e:
            return e
        assert list(outcome.facts) == self.derive(command, outcome.reply, outcome.effects, self.state), command
        if type(command) in R.QUERY_HANDLERS:
            assert outcome.facts == () and outcome.state is self.state
        self.seen += len(outcome.facts)
        return self.apply(outcome)


class RegistryFacts(ReportsWhatWasDerived, RegistryMachine):
    pass


class MembershipFacts(ReportsWhatWasDerived, MembershipMachine):
    pass


TestRegistryFacts = RegistryFacts.TestCase
TestRegistryFacts.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestMembershipFacts = MembershipFacts.TestCase
TestMembershipFacts.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)

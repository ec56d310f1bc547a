"""The hand-over between a scheduler's preparer and its preparing helper process, explored by Hypothesis.

The scheduler's side is lorapub's own (``Preparer._prepare`` and ``HelperClient``, over a real pipe); the
helper is a scripted stand-in (:class:`ScriptedHelper`) that speaks the helper's protocol (ready, taken,
shipped, failed, release, plan, stats, stop) from a thread, and per load does what the test draws: ship,
fail, die before or after taking the load, hang, ship an unwanted buffer first, or see its load abandoned
(an unload racing it) before it ships. Helpers are killed, die while idle, and are taught image plans at
any point. ``test_prepare_helper.py`` runs the real helper process; this machine covers the interleavings.

Invariants, after every step:

* every load ended as its script says: its adapter holding the shipped bytes, or the one typed error
  (``HelperFailed``, ``HelperDied``, ``HelperHung``, ``StaleHandle``); a helper that died before it took
  a load had it resent once, to the helper that replaced it;
* nothing is left behind: the live helper holds no shipped buffer (each released exactly once, none
  released that it never shipped), the client wants no token, the preparer tracks no load;
* a handle is opened only for a load that is still wanted (never an abandoned or unwanted one);
* at most one helper is alive, and it is the client's (a killed or dead one is gone: no orphan);
* the live helper knows every image plan the client was taught (a restarted one is taught again).
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import socket
import threading
import types
from multiprocessing.reduction import ForkingPickler

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

torch = pytest.importorskip("torch")

from lorapub.sglang_patch import prepared_load  # noqa: E402
from lorapub.sglang_patch.prepared_load import helper as prepare_helper  # noqa: E402
from lorapub.sglang_patch.prepared_load.image_plan import ImagePlan  # noqa: E402
from tests.sglang_patch.test_prepared_load import Adapter, Config, Manager, Scheduler  # noqa: E402

BEHAVIOURS = ["ok", "fail", "die_before_take", "die_after_take", "hang", "stale_first", "abandon"]
#: a hung helper's deadline: only loads that script a hang get it (every other wait is generous, so a busy
#: machine never turns a slow answer into a hang)
HANG_S = 0.2
PATIENT_S = 120.0
OPENED: list[tuple[int, int]] = []  # (helper, token) of each handle rebuilt in this process


def rebuild_buffer(helper_id: int, token: int, n: int):
    """What a shipped handle rebuilds to here (torch's rebuild, for the real helper): the load's bytes."""
    OPENED.append((helper_id, token))
    return torch.full((n,), token % 251, dtype=torch.uint8)


class ScriptedHelper:
    """A helper process as ``HelperClient`` sees one (``pid``, ``sentinel``, ``is_alive``, ``kill``,
    ``exitcode``), served by a thread that follows the machine's script for each load it is sent."""

    ids = itertools.count(1)

    def __init__(self, world: "World", conn) -> None:
        self.world, self.conn = world, conn
        self.id = next(self.ids)
        self.pid = 100_000 + self.id
        self.exitcode = None
        self.killed = threading.Event()
        self._sentinel_r, self._sentinel_w = os.pipe()
        self.sentinel = self._sentinel_r
        self.live: dict[int, int] = {}  # token -> bytes shipped and not yet released
        self.plans: dict = {}
        self.bad_releases: list[int] = []
        self.thread = threading.Thread(target=self._serve, name=f"scripted-helper-{self.id}", daemon=True)
        self.thread.start()

    # -- what HelperClient calls ---------------------------------------------------------------
    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed.set()
        self.end_from_outside(-9)

    def end_from_outside(self, code: int) -> None:
        """The process ends (killed, or dead while idle): its pipe end shuts, waking its own thread."""
        if self.exitcode is None:
            self.exitcode = code
            try:
                with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # its own thread closed it meanwhile
                pass
            os.close(self._sentinel_w)

    def join(self, timeout=None) -> None:
        self.thread.join(timeout)

    # -- the helper's side -----------------------------------------------------------------------
    def _exit(self, code: int) -> None:
        """Its own thread ends the process (a death the script asked for, or a stop)."""
        if self.exitcode is None:
            self.exitcode = code  # dead from here, as the client will find once its pipe end closes
            os.close(self._sentinel_w)
        self.conn.close()

    def _send(self, *msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            pass

    def _ship(self, token: int) -> None:
        n = 64 + token
        handle = bytes(ForkingPickler.dumps((rebuild_buffer, (self.id, token, n))))
        entries = (prepare_helper.Entry("embedding_layers", "w", "uint8", (n,), 0, n),)
        self.live[token] = n
        self._send("shipped", prepare_helper.Shipped(token, handle, entries, n, {}))

    def _serve(self) -> None:
        try:
            self._loop()
        except (EOFError, OSError):
            pass
        finally:
            self._exit(self.exitcode if self.exitcode is not None else 0)

    def _loop(self) -> None:
        msg = self.conn.recv()
        assert msg[0] == "kit"
        self._send("ready", self.pid)
        while self.exitcode is None:
            msg = self.conn.recv()
            if msg[0] == "prepare":
                self._prepare(msg[1])
            elif msg[0] == "release":
                if self.live.pop(msg[1], None) is None:
                    self.bad_releases.append(msg[1])
            elif msg[0] == "plan":
                self.plans[msg[1].key] = msg[1]
            elif msg[0] == "stats":
                self._send("stats", {"live": len(self.live), "plans": set(self.plans), "pid": self.pid})
            elif msg[0] == "stop":
                return

    def _prepare(self, job) -> None:
        what = self.world.next_behaviour()
        if what == "die_before_take":
            return self._exit(7)
        self._send("taken", job.token)
        if what == "die_after_take":
            return self._exit(7)
        if what == "hang":
            self.killed.wait(PATIENT_S)  # until the client kills it at its deadline
            return self._exit(-9)
        if what == "fail":
            return self._send("failed", job.token, "ValueError: a folder SGLang's processing refuses")
        if what == "stale_first":  # a buffer for a load nobody waits for any more, shipped before this one's
            self._ship(10_000 + job.token)
        if what == "abandon":  # the load's adapter is unloaded while the helper prepares it
            self.world.preparer.abandon(job.lora_id)
        self._ship(job.token)


class World:
    def __init__(self) -> None:
        self.script: collections.deque[str] = collections.deque()
        self.helpers: list[ScriptedHelper] = []
        self.preparer = None

    def next_behaviour(self) -> str:
        return self.script.popleft() if self.script else "ok"

    def spawn(self):
        mine, theirs = multiprocessing.Pipe()
        helper = ScriptedHelper(self, theirs)
        self.helpers.append(helper)
        return helper, mine


def expected(script: list[str]):
    """The error a load with this script ends with (None: it lands)."""
    first = script[0]
    if first == "die_before_take":  # not this load's doing: resent once to the replacement
        first = script[1] if len(script) > 1 else "ok"
        if first == "die_before_take":
            return prepare_helper.HelperDied
    return {"ok": None, "stale_first": None, "fail": prepare_helper.HelperFailed, "die_after_take": prepare_helper.HelperDied,
            "hang": prepare_helper.HelperHung, "abandon": prepare_helper.StaleHandle}[first]


class HandOverMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.saved_spawn = prepare_helper._spawn
        prepare_helper._spawn = self.world.spawn
        manager = Manager()
        scheduler = Scheduler(manager)
        client = prepare_helper.HelperClient(prepare_helper.Kit(device="cpu", dtype=None, threads=None), PATIENT_S, PATIENT_S)
        self.preparer = prepared_load.Preparer(scheduler, manager, helper=client)
        self.preparer.read_config = lambda ref: Config(ref.lora_path)
        self.preparer.new_adapter = lambda ref, config: Adapter(ref.lora_id, config)
        self.world.preparer = self.preparer
        self.client = client
        self.loads = itertools.count(1)
        self.wanted_opens: set[tuple[int, int]] = set()
        self.plan_keys = itertools.count(1)
        OPENED.clear()

    def teardown(self) -> None:
        try:
            self.preparer.close()
            self.preparer.pool.shutdown(wait=False)
        finally:
            prepare_helper._spawn = self.saved_spawn
            for helper in self.world.helpers:
                helper.kill()
                helper.join(PATIENT_S)
                os.close(helper._sentinel_r)

    @rule(script=st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=2))
    def load(self, script):
        n = next(self.loads)
        self.world.script = collections.deque(script)
        self.client.deadline_s = HANG_S if "hang" in script else PATIENT_S
        ref = types.SimpleNamespace(lora_id=f"id{n}", lora_name=f"v{n}", lora_path=f"/p/v{n}")
        before = len(self.world.helpers)
        had_one = self.client.process is not None and self.client.process.is_alive()
        want = expected(script)
        opened = len(OPENED)
        try:
            adapter = self.preparer._prepare(ref)
        except prepare_helper.HelperError as e:
            assert want is not None and type(e) is want, (script, e)
            assert ref.lora_name in str(e) or isinstance(e, prepare_helper.StaleHandle), e  # it names the load
            assert OPENED[opened:] == []  # nothing opened for a load that failed
        else:
            assert want is None, (script, adapter)
            got = adapter.embedding_layers["w"]
            [(helper_id, opened_token)] = OPENED[opened:]  # its own buffer, opened once (no unwanted one)
            assert got.shape == (64 + opened_token,) and bool((got == opened_token % 251).all())
            assert helper_id == self.client.process.id
        # one helper started for a load that found none alive, and one for each that died or hung (at once)
        died = sum(1 for b in script[:2] if b in ("die_before_take", "die_after_take", "hang"))
        assert len(self.world.helpers) - before <= died + (0 if had_one else 1)

    @precondition(lambda self: self.client.process is not None and self.client.process.is_alive())
    @rule()
    def helper_dies_while_idle(self):
        self.client.process.end_from_outside(-9)

    @precondition(lambda self: self.client.process is not None)
    @rule()
    def helper_is_stopped(self):
        self.client.stop("the test stops it")

    @rule()
    def teach_a_plan(self):
        key = ("layout", next(self.plan_keys))
        self.client.teach(ImagePlan(key, (), (), ()))

    @invariant()
    def nothing_is_left_behind(self):
        assert self.client.wanted == set() and self.preparer.tokens == {}
        alive = [h for h in self.world.helpers if h.is_alive()]
        assert len(alive) <= 1
        if alive:
            assert alive[0] is self.client.process
        for h in self.world.helpers:
            assert h.bad_releases == [], "a release for a buffer the helper never shipped"

    @invariant()
    def the_live_helper_holds_nothing_and_knows_every_plan(self):
        process = self.client.process
        if process is None or not process.is_alive():
            return
        stats = self.client.stats(PATIENT_S)
        assert stats["live"] == 0
        assert set(self.client.plans) <= stats["plans"]


_CAP = 20 if HandOverMachine.TestCase.settings.max_examples <= 250 else HandOverMachine.TestCase.settings.max_examples
HandOverMachine.TestCase.settings = settings(HandOverMachine.TestCase.settings, max_examples=_CAP, stateful_step_count=25)
TestHandOverMachine = HandOverMachine.TestCase

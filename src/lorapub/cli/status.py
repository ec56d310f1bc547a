"""``lorapub status``: what a deployment holds and what blocks it, from its status endpoint
(``--url``) or from a registry store file (``--store``, read from a copy: the store is never
written, and a live registry keeps its lock). ``--json`` prints the status as JSON, ``--watch``
redraws it every second. See docs/operating.md, "Status".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from lorapub.core.commands import ReadFleet, ReadSessionsOf
from lorapub.core.registry import RegistryState, SessionsOf, handle
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError, StoreError
from lorapub.runtime.status import Status, build_status
from lorapub.adapters.stores import FileStore, SQLiteStore

__all__ = ["add_status_parser", "run_status", "read_store", "fetch", "render"]

_SQLITE_MAGIC = b"SQLite format 3\x00"


class StatusError(Exception):
    """Why the status cannot be read: exit status 2, one line on stderr."""


def add_status_parser(sub: Any) -> None:
    s = sub.add_parser("status", help="what a running deployment (or a registry store) holds, and what blocks it")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a deployment's status endpoint, e.g. http://127.0.0.1:9464 "
                                     "(Deployment(status=('127.0.0.1', 9464)))")
    where.add_argument("--store", help="a registry store file (SQLiteStore or FileStore), read from a copy")
    s.add_argument("--token", default=os.environ.get("LORAPUB_STATUS_TOKEN"),
                   help="the endpoint's token (default: $LORAPUB_STATUS_TOKEN)")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.add_argument("--watch", action="store_true", help="redraw every --interval seconds until interrupted")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws with --watch (default 1)")
    s.add_argument("--no-probe", action="store_true", help="do not ask the engines (the last reconcile pass's view)")


def read_store(path: str) -> Status:
    """The status a store holds, read from a copy of its files (the original is left as it is)."""
    if not os.path.exists(path):
        raise StatusError(f"no registry store at {path}")
    with open(path, "rb") as f:
        sqlite = f.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    for attempt in range(COPY_ATTEMPTS):
        try:
            state = _load_copy(path, sqlite)
            break
        except LorapubError as e:
            # A live store's files are copied one after the other while it commits: a copy can catch a
            # checkpoint half done. Copied again it is whole; a store damaged for real fails every time.
            if attempt == COPY_ATTEMPTS - 1:
                raise StatusError(f"cannot read the store {path}: {e.message}") from None
            time.sleep(0.05 * (attempt + 1))
    if not isinstance(state, RegistryState):
        raise StatusError(f"{path} holds no registry state (an empty store?)")
    fleet = handle(state, ReadFleet()).reply  # the registry's own queries, through its one door
    sessions_of: dict[Any, SessionsOf] = {h.version: handle(state, ReadSessionsOf(h.version)).reply
                                          for h in fleet.slots if h.state is VersionState.RETIRED and h.session_refs}
    return build_status(fleet, source=f"store {path}", sessions_of=sessions_of)


#: How many copies of a store ``read_store`` reads before it says the store cannot be read.
COPY_ATTEMPTS = 5


def _load_copy(path: str, sqlite: bool) -> Any:
    """The state in a copy of the store's files, its errors naming the store, not the copy."""
    with tempfile.TemporaryDirectory(prefix="lorapub-status-") as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        # The mark first: the store writes it after each commit it acknowledges, so a mark copied
        # before the database can only be behind it (the other order finds a mark ahead: "damaged").
        for suffix in ("-mark", "", "-wal") if sqlite else ("",):
            try:
                shutil.copyfile(path + suffix, copy + suffix)
            except FileNotFoundError:
                if not suffix:
                    raise StatusError(f"no registry store at {path} (it went away while it was read)") from None
                # no -wal after a clean close; no -mark on an older store
        store = SQLiteStore(copy) if sqlite else FileStore(copy)
        try:
            return store.load()
        except LorapubError as e:
            raise type(e)(e.message.replace(copy, path), **e.details) from None
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                close()


async def fetch(url: str, token: str | None, probe: bool = True) -> Status:
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url.rstrip("/") + "/status", params={"probe": "1" if probe else "0"},
                                headers=headers) as r:
                if r.status == 401:
                    raise StatusError(f"{url} refused the token given: check --token or LORAPUB_STATUS_TOKEN" if token
                                      else f"{url} wants a token: give --token or set LORAPUB_STATUS_TOKEN")
                if r.status != 200:
                    text = await r.text()
                    try:
                        said = json.loads(text)
                        text = said["error"] + (f" (health: {said['health']})" if said.get("health") else "")
                    except (ValueError, KeyError, TypeError):
                        text = text[:200]
                    raise StatusError(f"{url}/status answered {r.status}: {text}")
                return Status.from_json(await r.json())
    except (aiohttp.ClientError, TimeoutError) as e:
        raise StatusError(f"cannot reach {url}: {type(e).__name__}: {e}") from None


def render(status: Status) -> Any:
    """The status as rich renderables (a Group): health, versions, engines, attempts."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    def cells(*values: str) -> list[Text]:  # what engines and sessions say is shown as it is, never as markup
        return [Text(v) for v in values]

    health = {True: "[green]healthy[/]", False: "[red]not healthy[/]", None: "[dim]health unknown (no reconciler)[/]"}
    head = Text.from_markup(
        f"[bold]lorapub[/] epoch {status.epoch} · {escape(status.source)} · default [bold]{escape(status.default or '-')}[/] "
        f"(revision {status.default_revision}) · slots {status.slots_used}/{status.capacity} · "
        f"max_lag {status.max_lag if status.max_lag is not None else 'none'} · {health[status.healthy]} · "
        f"{time.strftime('%H:%M:%S', time.localtime(status.at))}")
    parts: list[Any] = [head]
    if status.waiting:
        parts.append(Text(f"publication waiting for a slot: {status.waiting}", style="yellow"))
    versions = Table(title="versions", title_justify="left", expand=True)
    for col in ("version", "state", "lag", "session refs", "running requests", "what blocks its reclaim"):
        versions.add_column(col)
    for v in status.versions:
        running = ", ".join(f"{e}: {n}" for e, n in v.loaded_on.items()) or "-"
        state = v.state + (" (default)" if v.default else "") + (" retiring" if v.retiring else "") \
            + (" SUSPECT" if getattr(v, "suspect", None) else "")
        versions.add_row(*cells(v.version, state, "-" if v.lag is None else str(v.lag), str(v.session_refs), running,
                                "\n".join(v.blocked_by) or "-"))
    parts.append(versions)
    engines = Table(title="engines", title_justify="left", expand=True)
    for col in ("engine", "incarnation", "holds", "should hold", "running", "last error"):
        engines.add_column(col)
    for e in status.engines:
        life = e.incarnation or "-"
        if e.seen is not None and e.seen != e.incarnation:
            life += f" (says {e.seen}: restarted)"
        unknown = e.answered is not True or not e.reports_holdings  # not asked, no answer, or lists nothing
        holds = "not reported" if e.answered and not e.reports_holdings else ", ".join(e.holds) or (
            "?" if unknown else "-")
        row = cells(e.name, life, holds, ", ".join(e.should_hold) or "-",
                    "?" if unknown else str(e.running_requests), e.last_error or "-")
        if e.answered is False:
            row[1].append(" unreachable", style="red")
        engines.add_row(*row)
    parts.append(engines)
    if status.attempts:
        attempts = Table(title="attempts in flight", title_justify="left")
        for col in ("attempt", "phase", "bucket", "still for"):
            attempts.add_column(col)
        for a in status.attempts:
            attempts.add_row(*cells(a.token, a.phase, str(a.bucket), "-" if a.still_s is None else f"{a.still_s:.0f}s"))
        parts.append(attempts)
    if status.notes:
        parts.append(Text("notes:\n" + "\n".join(f"  {n}" for n in status.notes), style="yellow"))
    if status.blockers:
        parts.append(Text("blockers:\n" + "\n".join(f"  {k} {s}: {d}" for k, s, d in status.blockers)))
    parts.append(Text(f"sessions open here: {status.sessions_here} (groups {status.groups_here})", style="dim"))
    return Group(*parts)


def _plain(status: Status) -> str:
    lines = [f"lorapub epoch {status.epoch} ({status.source}): default {status.default or '-'}, slots "
             f"{status.slots_used}/{status.capacity}, healthy {status.healthy}"]
    for v in status.versions:
        lines.append(f"  {v.version} {v.state} lag {v.lag} refs {v.session_refs}"
                     + (": " + "; ".join(v.blocked_by) if v.blocked_by else ""))
    for e in status.engines:
        holds = "not reported" if not e.reports_holdings else ", ".join(e.holds) or "-"
        lines.append(f"  engine {e.name} {e.incarnation}: holds {holds}, should hold "
                     f"{', '.join(e.should_hold) or '-'}" + (f"; {e.last_error}" if e.last_error else ""))
    lines += [f"  blocker {k} {s}: {d}" for k, s, d in status.blockers]
    lines += [f"  note {n}" for n in status.notes]
    return "\n".join(lines)


def _read(args: argparse.Namespace) -> Status:
    if args.store:
        return read_store(args.store)
    return asyncio.run(fetch(args.url, args.token, probe=not args.no_probe))


def run_status(args: argparse.Namespace) -> int:
    try:
        if args.json:
            print(json.dumps(_read(args).to_json(), indent=2, default=str))
            return 0
        try:
            from rich.console import Console
        except ImportError:
            if args.watch:
                raise StatusError("--watch needs rich: pip install 'lorapub[cli]'") from None
            print(_plain(_read(args)))
            return 0
        console = Console()
        if not args.watch:
            console.print(render(_read(args)))
            return 0
        from rich.live import Live

        with Live(render(_read(args)), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(max(0.1, args.interval))
                live.update(render(_read(args)))
    except StatusError as e:
        print(f"lorapub status: error: {e}", file=sys.stderr)
        return 2
    except StoreError as e:
        print(f"lorapub status: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0

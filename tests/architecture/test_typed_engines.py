"""The runtime asks an engine what it is by type, never by probing it: the protocols of
:mod:`lorapub.ports` and ``isinstance`` (a mock answers any ``getattr`` with a member it makes up).

Checked on the source: no ``getattr``/``hasattr`` in the runtime but on the objects listed here,
none of them an engine, each with why (and one delegation of the embedder's own reads).
"""

from __future__ import annotations

import ast
import pathlib

import lorapub

RUNTIME = pathlib.Path(lorapub.__file__).parent / "runtime"

#: (module, the probed object as written) -> why it is no engine.
NOT_ENGINES = {
    ("admission", "transport"): "the deployment's Transport (the `kind` that names it in metrics, where it has one)",
    ("runner", "source"): "the BucketSource a transport made (whether it says it is collective)",
    ("status_server", "site._server"): "aiohttp's TCP site (its listening sockets, for the port the OS chose)",
    ("settings", "copies"): "a CopyStore handed to Deployment(copies=), checked before it is used",
    ("settings", "settings"): "the DeploymentSettings value (its fields, by name)",
    ("retry", "policy"): "the RetryPolicy value (its fields, by name)",
    ("observers", "self.inner"): "the Registry an ObservedRegistry wraps (its own reads, e.g. a store's state)",
    ("decision_log", "record"): "a logging.LogRecord (the event fields a log call put on it)",
}
#: (module, function, object) -> why it reads an engine: the one delegation, never a probe.
DELEGATES = {
    ("admission", "__getattr__", "self.inner"):
        "the wrapper of an adapter without close()/release() passes the embedder's own reads of its adapter "
        "through; the runtime reads nothing through it (tests/unit/test_engine_lifecycle.py shows it)",
}


def _probes(path: pathlib.Path) -> list[tuple[str, str]]:
    """Each ``getattr(...)``/``hasattr(...)`` call in ``path``: the function it is in, the object it reads."""
    found = []
    for scope in ast.walk(ast.parse(path.read_text())):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        name = getattr(scope, "name", "<module>" if isinstance(scope, ast.Module) else "<lambda>")
        nested = [n for n in ast.walk(scope) if n is not scope
                  and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        inner = {id(m) for n in nested for m in ast.walk(n)}
        found += [(name, ast.unparse(node.args[0])) for node in ast.walk(scope)
                  if id(node) not in inner and isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in {"getattr", "hasattr"} and node.args]
    return found


def test_the_runtime_probes_no_engine():
    modules = {p.stem for p in RUNTIME.rglob("*.py")}
    assert {"admission", "runner", "deployment", "reconciler", "publisher", "sessions", "membership"} <= modules
    assert {m for m, _ in NOT_ENGINES} | {m for m, _, _ in DELEGATES} <= modules  # no stale entry
    probed = [f"{path.stem}.{function}: getattr({what}, ...)" for path in sorted(RUNTIME.rglob("*.py"))
              for function, what in _probes(path)
              if (path.stem, what) not in NOT_ENGINES and (path.stem, function, what) not in DELEGATES]
    assert not probed, probed


def test_the_probe_check_sees_a_probe(tmp_path):
    """The check itself can fail: a probe on an engine, plain or behind ``callable``, is seen, in the
    function it is in."""
    path = tmp_path / "m.py"
    path.write_text("def f(engine):\n"
                    "    return callable(getattr(engine, 'close', None)) or (lambda: hasattr(engine.inner, 'x'))\n"
                    "x = getattr(engine, 'name', None)\n")
    assert sorted(_probes(path)) == [("<lambda>", "engine.inner"), ("<module>", "engine"), ("f", "engine")]

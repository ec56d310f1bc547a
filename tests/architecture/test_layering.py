"""The layout is the architecture: who may import whom, and how large a module may grow, checked
on the source.

Levels, each importing only those beneath it (``docs/design.md``, "Shape"):
demo -> integrations, testing -> adapters -> the public face (``lorapub``) -> runtime, sglang_patch
-> snapshot -> probe -> local_registry -> clock, health -> wire, ports -> core -> errors. wire is the staging
protocol both the publisher's adapter and the engine-side staging speak; sglang_patch runs inside the SGLang
server. The adapters import the ports and the values beside them, never the runtime.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import lorapub

SRC = pathlib.Path(lorapub.__file__).parent

def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if node.module == "lorapub"}
    return {m for m in found if m == "lorapub" or m.startswith("lorapub.")}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        yield name, path


#: A package's level: a module imports only its own package and packages of lower levels. "lorapub" is
#: the public face (``from lorapub import Deployment``), above the runtime it re-exports.
LEVELS = {
    "_moved": 0, "errors": 0, "core": 1, "events": 1.5, "wire": 2, "ports": 2, "clock": 2.1, "health": 2.1, "local_registry": 2.2, "probe": 2.4, "snapshot": 2.5, "runtime": 3, "sglang_patch": 3, "lorapub": 4,
    "adapters": 5, "integrations": 6, "testing": 6, "cli": 6.5, "demo": 7, "__main__": 8,
}
#: No module grows past this: one concept per module.
MAX_MODULE_LINES = 600


def _level_of(module: str, names: tuple[str, ...] = ()) -> list[str]:
    """The packages an import statement reaches: ``from lorapub import sglang_patch`` names the
    package, ``from lorapub import Deployment`` the public face."""
    if module == "lorapub":
        subpackages = {p.stem for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
        return [n if n in subpackages else "lorapub" for n in names] or ["lorapub"]
    return [_layer(module)]


def _reached(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {p for a in node.names if a.name.split(".")[0] == "lorapub" for p in _level_of(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "lorapub":
            found |= set(_level_of(node.module, tuple(a.name for a in node.names)))
    return found


def test_every_package_has_a_level():
    packages = {_layer(name) for name, _ in _modules()} - {"__init__"}
    assert packages <= set(LEVELS), sorted(packages - set(LEVELS))


def test_no_module_imports_upward():
    broken = []
    for name, path in _modules():
        mine = "lorapub" if _layer(name) == "__init__" else _layer(name)
        for package in _reached(path):
            if package != mine and LEVELS.get(package, 99) >= LEVELS.get(mine, -1):
                broken.append(f"{name} (level {LEVELS.get(mine)}) imports {package} (level {LEVELS.get(package)})")
    assert not broken, broken


def _runtime_faces() -> frozenset[str]:
    """The public face's names that live in the runtime: ``from lorapub import Deployment`` reaches it."""
    return frozenset(name for name in lorapub.__all__
                     if (getattr(lorapub, name).__module__ or "").startswith("lorapub.runtime"))


def _runtime_reached(module: str, path: pathlib.Path, faces: frozenset[str]) -> list[str]:
    """Each import in ``path`` (module ``module``) that reaches the runtime: ``import``, ``from``,
    relative, under ``TYPE_CHECKING`` or inside a function alike, and the public face's runtime names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    reached = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            if base == "lorapub":
                reached += [f"lorapub.{a.name} (the public face's, from {_runtime_module(a.name)})"
                            for a in node.names if a.name in faces]
        else:
            continue
        reached += [t for t in targets if t == "lorapub.runtime" or t.startswith("lorapub.runtime.")]
    return reached


def _runtime_module(name: str) -> str:
    return str(getattr(lorapub, name).__module__)


def test_the_adapters_never_import_the_runtime():
    """Adapters implement the ports: they import ``lorapub.ports`` and the values beside it, never
    ``lorapub.runtime`` (not for a type either), nor the public face's names that live there."""
    faces = _runtime_faces()
    assert {"Deployment", "Session"} <= faces
    broken = [f"{name} imports {what}" for name, path in _modules() if name.startswith("lorapub.adapters")
              for what in sorted(set(_runtime_reached(name, path, faces)))]
    assert not broken, broken


def test_the_adapter_check_sees_every_form_of_import(tmp_path):
    """The check itself can fail: each way of reaching the runtime is seen."""
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import lorapub.runtime.deployment as d\n"
        "from lorapub import Deployment, errors\n"
        "if TYPE_CHECKING:\n"
        "    from lorapub.runtime.reconciler import Reconciler\n"
        "def f():\n"
        "    from ...runtime import sessions\n"
        "from lorapub.ports import Registry\n"
    )
    assert sorted(_runtime_reached("lorapub.adapters.x.m", path, _runtime_faces())) == [
        "lorapub.Deployment (the public face's, from lorapub.runtime.deployment)",
        "lorapub.runtime", "lorapub.runtime.deployment", "lorapub.runtime.reconciler",
        "lorapub.runtime.reconciler.Reconciler", "lorapub.runtime.sessions",
    ]


def test_no_module_is_over_the_size_limit():
    big = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


#: A module docstring says what the module is in at most this many lines of text (blank lines not
#: counted), plus one line ``See docs/<file>.md, "<section>".`` where the detail lives.
MAX_DOCSTRING_LINES = 5
_DOCS_LINK = re.compile(r'See (``)?docs/(?P<file>[\w.-]+\.md)(``)?(, "(?P<section>.+)")?\.')
#: SGLang's code, verbatim: its docstrings are SGLang's.
_VENDORED = SRC / "testing" / "_sglang_vendor"


def _docstring(path: pathlib.Path) -> tuple[int, list[re.Match[str]]]:
    """A module docstring's lines of text, not counting its first docs link; and its docs links."""
    lines = [line.strip() for line in (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()]
    lines = [line for line in lines if line]
    links = [m for line in lines if (m := _DOCS_LINK.fullmatch(line))]
    return len(lines) - min(len(links), 1), links


def test_module_docstrings_are_short():
    """Module docstrings are at most five lines plus a link to the docs section that holds the
    detail; a link names a docs file and a heading that exist."""
    docs = SRC.parent.parent / "docs"
    long, broken = {}, []
    for name, path in _modules():
        if _VENDORED in path.parents:
            continue
        n, links = _docstring(path)
        if n > MAX_DOCSTRING_LINES:
            long[name] = n
        for link in links if docs.is_dir() else ():
            target = docs / link["file"]
            headings = {h.lstrip("#").strip() for h in target.read_text().splitlines() if h.startswith("#")} \
                if target.is_file() else set()
            if not target.is_file() or (link["section"] and link["section"] not in headings):
                broken.append(f"{name}: {link[0]}")
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (plus a docs link): {long}"
    assert not broken, f"docs links to no such file or heading: {broken}"


def test_the_docstring_check_counts_one_docs_link(tmp_path):
    """The check itself can fail: blank lines and one docs link are free, a second link is not."""
    path = tmp_path / "m.py"
    path.write_text('"""One.\n\nTwo.\nSee docs/design.md, \"Shape\".\nSee ``docs/recovery.md``.\n"""\n')
    n, links = _docstring(path)
    assert (n, [m["file"] for m in links], links[0]["section"]) == (3, ["design.md", "recovery.md"], "Shape")


def test_the_level_check_catches_an_upward_import(tmp_path):
    """The check itself can fail: an import of the runtime from core is upward."""
    path = tmp_path / "m.py"
    path.write_text("from lorapub.runtime.deployment import Deployment\nfrom lorapub import sglang_patch\n")
    assert _reached(path) == {"runtime", "sglang_patch"}
    assert LEVELS["runtime"] > LEVELS["core"]


def test_the_publishers_side_never_imports_the_engines_side():
    """The client speaks the staging protocol (lorapub.wire); it never imports the server that
    answers it (lorapub.sglang_patch, which runs inside SGLang)."""
    broken = [
        f"{name} imports {imported}"
        for name, path in _modules()
        if _layer(name) in {"adapters", "runtime", "integrations", "demo", "ports", "core", "wire"}
        for imported in _imports(path)
        if _layer(imported) == "sglang_patch"
    ]
    assert not broken, broken


def test_the_layering_test_sees_the_layers():
    layers = {_layer(name) for name, _ in _modules()}
    assert {"core", "wire", "runtime", "adapters", "demo", "testing", "ports", "errors"} <= layers


def _blocked(code: str, blocked: set[str]) -> subprocess.CompletedProcess:
    prelude = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(blocked)!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)


def test_public_face_and_runtime_import_without_torch_ray_aiohttp_or_sglang():
    out = _blocked(
        "import lorapub, lorapub.runtime.deployment, lorapub.local_registry\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in {'torch','ray','aiohttp','sglang'}]\n"
        "assert not bad, bad\n"
        "print('ok')\n",
        {"torch", "ray", "aiohttp", "sglang", "safetensors"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_double_runs_sglangs_registry_copy_without_sglang():
    out = _blocked(
        "import lorapub.testing as t\n"
        "from lorapub.testing._sglang_registry import VENDORED_ROOT, registry_root\n"
        "d = t.SGLangDouble('e0')\n"
        "print(registry_root() == VENDORED_ROOT, type(d.lora_registry).__name__)\n",
        {"sglang"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True LoRARegistry"


def test_the_vendored_registry_is_sglang_0523_verbatim():
    import ast
    import os

    from lorapub.testing._sglang_registry import VENDORED_ROOT, sglang_root
    from tests import sglang_real

    root = sglang_real.release_root("0.5.23")
    assert root is not None and root == sglang_root(), ".ci/install installs SGLang 0.5.23"
    for rel in ("srt/lora/lora_registry.py", "srt/utils/aio_rwlock.py"):
        with open(os.path.join(root, rel)) as a, open(os.path.join(VENDORED_ROOT, rel)) as b:
            assert a.read() == b.read(), rel

    def counter(path):
        src = open(path).read()
        node = next(n for n in ast.parse(src).body if getattr(n, "name", "") == "ConcurrentCounter")
        return ast.get_source_segment(src, node)

    common = "srt/utils/common.py"
    assert counter(os.path.join(root, common)) == counter(os.path.join(VENDORED_ROOT, common))


STAGING = SRC / "sglang_patch" / "staging"
#: What the engine-side staging's pure machine may import: values, never I/O, a clock or threads.
PURE = {"__future__", "enum", "typing", "attrs", "pyrsistent"}


def _top_level(path: pathlib.Path, walk: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if walk else tree.body
    top = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            top |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            top.add(n.module.split(".")[0])
    return top


def test_engine_staging_runs_in_the_server_without_lorapubs_runtime():
    """The engine side (what the patched SGLang server imports) needs only the standard library,
    lorapub.core (with attrs and pyrsistent, the core's own dependencies), lorapub.wire and, for its
    torch transport and tensor loads, torch."""
    # sglang_patch.env: the standard library only, the one rule for the server's environment settings
    allowed = {"lorapub.core", "lorapub.errors", "lorapub.wire", "lorapub.sglang_patch.staging", "lorapub.sglang_patch.env"}
    modules = sorted(STAGING.glob("*.py"))
    assert {p.stem for p in modules} >= {"__init__", "engine", "receivers", "collective", "buffers", "landing",
                                          "claims", "server"}
    for path in modules:
        imported = _imports(path)
        assert {m for m in imported if not any(m == a or m.startswith(a + ".") for a in allowed)} == set(), path.name
        top = _top_level(path)
        assert top - {"__future__", "lorapub", "attrs", "pyrsistent"} <= set(sys.stdlib_module_names), (path.name, top)
    out = _blocked(
        "import types\n"
        f"root = {str(SRC)!r}\n"
        "for name, path in (('lorapub', root), ('lorapub.sglang_patch', root + '/sglang_patch')):\n"
        "    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m\n"
        "import lorapub.sglang_patch.staging as es\n"
        "bad = [m for m in sys.modules if m.startswith(('lorapub.runtime', 'lorapub.adapters', 'lorapub.testing'))\n"
        "       or m.split('.')[0] in {'aiohttp', 'torch', 'sglang', 'ray'}]\n"
        "assert not bad, bad\n"
        "print(es.EngineStaging.__name__)\n",
        {"aiohttp", "torch", "sglang", "ray", "safetensors", "fastapi", "starlette"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EngineStaging"


def test_the_staging_machine_is_pure_and_every_staging_module_is_small():
    """The machine and its messages import values only (no I/O, no clock, no threads, nothing of the
    engine's side), and no module of the staging grows past 600 lines."""
    for name in ("machine.py", "messages.py"):
        path = SRC / "core" / "staging" / name  # the machine is pure: it lives in the core
        assert _top_level(path, walk=True) - {"lorapub"} <= PURE, name
        lorapub_imports = _imports(path)
        assert all(m.startswith("lorapub.core.") for m in lorapub_imports), (name, lorapub_imports)
    sizes = {p.name: len(p.read_text().splitlines()) for p in STAGING.glob("*.py")}
    assert max(sizes.values()) <= 600, sizes


def test_the_staging_engine_holds_no_test_switch_of_its_own():
    """A test's behaviour (the numeric gate's scale switch) reaches the engine as an injected hook
    (``EngineStaging(before_dir_load=)``): the engine's module neither reads its variable nor imports it."""
    source = (STAGING / "engine.py").read_text()
    assert "test_switch" not in source and "SCALE_ENV" not in source and "LORAPUB_TEST_SCALE" not in source

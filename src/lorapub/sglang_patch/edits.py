"""Source edits on fingerprinted SGLang functions: one description, two forms.

The runtime form recompiles each edited method from its verbatim source in the
module's own globals; the diff form writes the same edited source into the file.
"""

from __future__ import annotations

import __future__
import os
import textwrap
from typing import TYPE_CHECKING, Any

from lorapub.sglang_patch.targets import PatchMismatch, function_source

if TYPE_CHECKING:
    from lorapub.sglang_patch.release_0517 import FunctionEdit


def edited_source(fe: FunctionEdit, root: str | None = None) -> tuple[str, str]:
    """(verbatim source of the method, the same with every edit applied)."""
    original = function_source(fe.rel, fe.cls, fe.name, root)
    src = original
    for edit in fe.edits:
        found = src.count(edit.old)
        if found != 1:
            raise PatchMismatch(f"{fe.cls}.{fe.name}: an edit anchor occurs {found} times, expected once")
        src = src.replace(edit.old, edit.new)
    return original, src


def _method_text(segment: str) -> str:
    # A method's segment starts at `def` with no indent; its body keeps the class indent.
    lines = segment.splitlines()
    return "\n".join([lines[0]] + [line[4:] if line.startswith("    ") else line for line in lines[1:]]) + "\n"


def _define(text: str, fn_globals: dict[str, Any], where: str) -> dict[str, Any]:
    flags = __future__.annotations.compiler_flag  # SGLang's modules use postponed annotations too
    namespace: dict[str, Any] = {}
    exec(compile(text, f"<lorapub patch: {where}>", "exec", flags=flags, dont_inherit=True), fn_globals, namespace)
    return namespace


def install_method(cls: type, name: str, segment: str, fn_globals: dict[str, Any]) -> None:
    fn = _define(_method_text(segment), fn_globals, f"{cls.__name__}.{name}")[name]
    fn.__qualname__ = f"{cls.__name__}.{name}"
    fn.__lorapub_source__ = segment  # what was compiled, for inspection and tests
    setattr(cls, name, fn)


def install_methods(cls: type, class_body: str, fn_globals: dict[str, Any]) -> list[str]:
    defined = _define(textwrap.dedent(class_body), fn_globals, cls.__name__)
    for name, fn in defined.items():
        fn.__qualname__ = f"{cls.__name__}.{name}"
        setattr(cls, name, fn)
    return sorted(defined)


def read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel)) as f:
        return f.read()


def insert_before(text: str, anchor: str, addition: str, what: str) -> str:
    if text.count(anchor) != 1:
        raise PatchMismatch(f"{what}: anchor {anchor.strip()[:60]!r} occurs {text.count(anchor)} times")
    return text.replace(anchor, addition + anchor)

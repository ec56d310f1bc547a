"""Writes docs/api/reference.md, lorapub's API reference, from the docstrings and signatures of every name the
public modules export (their ``__all__``). Run it after changing a public name or its docstring:

    python3 docs/api/generate.py

tests/architecture/test_api_reference.py fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pathlib
import re
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "api" / "reference.md"

#: The modules an embedder imports, in the order a reader meets them (docs/start-here.md).
MODULES = (
    "lorapub", "lorapub.ports", "lorapub.testing", "lorapub.events", "lorapub.adapters.sglang_wire",
    "lorapub.adapters.sglang_overwrite", "lorapub.integrations.relax", "lorapub.integrations.areal",
)
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _first_paragraph(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return _ADDRESS.sub("", text)


def _own_methods(cls: type) -> list[tuple[str, object]]:
    found = []
    for name, member in vars(cls).items():
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod, property))):
            continue
        found.append((name, member))
    return sorted(found)


def _entry(module: str, name: str, obj: object) -> list[str]:
    lines: list[str] = []
    if typing.get_origin(obj) is not None:  # a type alias (lorapub.events.Observer)
        lines.append(f"### `{name}` (type alias)")
        lines.append(f"`{name} = {_ADDRESS.sub('', repr(obj))}`")
    elif inspect.isclass(obj):
        kind = "enum" if issubclass(obj, enum.Enum) else "exception" if issubclass(obj, BaseException) else "class"
        code = getattr(obj, "code", None) if issubclass(obj, BaseException) else None
        lines.append(f"### `{name}` ({kind})")
        if isinstance(code, str):
            lines.append(f"Code: `{code}`.")
        if kind == "class":
            lines.append(f"`{name}{_signature(obj)}`")
        lines.append(_first_paragraph(obj))
        if kind == "enum":
            lines.append("Members: " + ", ".join(f"`{m.name}`" for m in obj))  # type: ignore[attr-defined]
        elif kind == "class":
            for method, member in _own_methods(obj):
                if isinstance(member, property):
                    lines.append(f"- `{method}` (property): {_first_paragraph(member)}".rstrip(": "))
                else:
                    func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    lines.append(f"- `{method}{_signature(func)}`: {_first_paragraph(func)}".rstrip(": "))
    elif callable(obj):
        lines.append(f"### `{name}{_signature(obj)}`")
        lines.append(_first_paragraph(obj))
    else:
        lines.append(f"### `{name}`")
        lines.append(f"`{_ADDRESS.sub('', repr(obj))[:160]}`")
    return [line for line in lines if line]


def render() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python3 docs/api/generate.py`; do not edit by hand. Every name each",
           "public module exports (its `__all__`), with its signature and the first paragraph of its docstring; the",
           "guides in docs/ say how the pieces fit (docs/start-here.md first).", ""]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        out += [f"## `{module_name}`", "", _first_paragraph(module), ""]
        for name in sorted(getattr(module, "__all__", ())):
            out += _entry(module_name, name, getattr(module, name)) + [""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)} ({len(OUT.read_text().splitlines())} lines)")

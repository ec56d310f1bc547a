"""docs/api/reference.md is what docs/api/generate.py writes from the public modules' docstrings now: a
public name or docstring changed without regenerating the page fails here (run the generator)."""

from __future__ import annotations

import importlib.util
import pathlib
import typing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("api_reference_generator", ROOT / "docs" / "api" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_current():
    generator = _generator()
    assert (ROOT / "docs" / "api" / "reference.md").read_text() == generator.render(), (
        "docs/api/reference.md is out of date: run `python3 docs/api/generate.py`")


def test_every_public_name_in_the_reference_has_a_docstring():
    generator = _generator()
    for module_name in generator.MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if callable(obj) and typing.get_origin(obj) is None:  # a type alias has its comment, not a docstring
                assert generator._first_paragraph(obj), f"{module_name}.{name} has no docstring"

"""docs/start-here.md: linked from the top of the README, a path for each kind of reader, and every
page it names exists (every doc of docs/ is reachable from it)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "start-here.md"


def test_the_readme_points_newcomers_to_it_first():
    head = (ROOT / "README.md").read_text().splitlines()[:4]
    assert any("docs/start-here.md" in line for line in head), head


def test_it_has_a_path_for_each_kind_of_reader_and_every_link_resolves():
    text = PAGE.read_text()
    for reader in ("You embed lorapub", "You operate", "You use Relax", "You write tests"):
        assert f"## {reader}" in text, reader
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((PAGE.parent / link).resolve().exists() for link in links), links
    named = {(PAGE.parent / link).resolve().name for link in links}
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"start-here.md"}
    assert docs <= named, sorted(docs - named)

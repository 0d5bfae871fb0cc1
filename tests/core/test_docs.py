"""The docs that ship with podium: generated tables are current, and links point into the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from podium.cli import options_markdown
from podium.core.backend import backend_class

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["inline", "ray", "torchrun"])
def test_backend_option_tables_match_the_declarations(name: str) -> None:
    text = (ROOT / "docs" / "backends.md").read_text()
    block = re.search(rf"<!-- options:{name} -->\n(.*?)\n<!-- /options:{name} -->", text, re.S)
    assert block is not None, f"docs/backends.md has no options block for {name!r}"
    assert block.group(1) == options_markdown(backend_class(name)), (
        "docs/backends.md is stale: regenerate the table with `podium backends --options-markdown`"
    )


def test_readme_and_docs_link_only_to_files_in_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
    assert "shared folder" not in (ROOT / "README.md").read_text()

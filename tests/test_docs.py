"""The README is a front page: it starts with the two commands, stays short, and every document it (or any other
document of the repository) links is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "jobs" / "README.md", ROOT / "cluster" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_starts_with_the_two_commands_and_is_at_most_1200_words():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[2] == "```bash" and lines[5] == "```", lines[:6]
    assert lines[3].startswith("bash scripts/setup.sh && .venv/bin/treepo-ray train")
    assert lines[4].startswith("bash scripts/test.sh")
    assert len(text.split()) <= 1200, len(text.split())


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_linked_document_is_in_the_repository(doc):
    text = doc.read_text()
    # Markdown links to files ([x](path) or [x](path#anchor)), not to web pages
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]
    missing = [t for t in targets if t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files not in the repository: {missing}"
    assert "DESIGN.md" not in text  # the design notes live outside the project

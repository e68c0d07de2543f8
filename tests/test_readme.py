"""README.md stays a short front page: under 200 lines, its two commands and its "Measured" section intact, the
detail in docs/ (every file it links to exists)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_under_200_lines():
    assert len(README.splitlines()) < 200, len(README.splitlines())


def test_readme_keeps_its_two_commands_and_the_measured_section():
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "./scripts/demo" in first_block and "./scripts/test" in first_block, first_block
    assert "\n## Measured\n" in README


def test_every_file_the_readme_links_to_exists():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert "docs/setup.md" in links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing

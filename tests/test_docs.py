"""The README stays a user's page (short, no long table cells), runs CI's exact test command,
and every relative link in it and in docs/ reaches a file."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_is_short_with_short_table_cells():
    assert len(README.splitlines()) <= 150
    assert len(README) <= 12_000
    cells = [c for line in README.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(map(len, cells)) <= 300


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_relative_links_reach_files():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "gpu" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_config_reference_is_current():
    from rollover.config import markdown_reference

    assert (ROOT / "docs" / "config.md").read_text() == markdown_reference() + "\n", \
        "docs/config.md is stale: python -m rollover.config docs/config.md"

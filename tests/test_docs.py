"""The README stays a user's page (short, no long table cells), runs CI's exact test command,
and every relative link in it and in docs/ reaches a file; docs/features.md keeps short table
cells too, and no page cites a commit (measurements live in docs/benchmarks.md, history in git)."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


MAX_CELL = 300
# A commit named in prose ("commit 54fcd53", "commits 50b0208 and 11be29d") or a bare abbreviated
# hash: 7-40 hex digits with at least one digit and one letter, standing alone (not part of a
# path, a file name, a longer hex string such as a sha256, or a decimal number).
COMMIT_WORD = re.compile(r"\bcommits?\s+(?:of\s+)?`?[0-9a-f]{7,40}\b", re.I)
BARE_HASH = re.compile(r"(?<![\w./#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w./-])")


def table_cells(text):
    """Every cell of every markdown table row in `text` (escaped pipes stay inside a cell)."""
    return [c.strip() for line in text.splitlines() if line.startswith("|")
            for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def test_readme_is_short_with_short_table_cells():
    assert len(README.splitlines()) <= 150
    assert len(README) <= 12_000
    assert max(map(len, table_cells(README))) <= MAX_CELL


def test_feature_and_readme_table_cells_are_short():
    long = [f"{name}: {len(cell)} chars: {cell[:60]}..."
            for name in ("README.md", "docs/features.md")
            for cell in table_cells((ROOT / name).read_text()) if len(cell) > MAX_CELL]
    assert long == []


def test_docs_cite_no_commits():
    """The docs state current facts; git keeps the history, so no page names a commit."""
    cited = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for hit in [*COMMIT_WORD.findall(line), *BARE_HASH.findall(line)]:
                cited.append(f"{page.relative_to(ROOT)}:{n}: {hit}")
    assert cited == []


def test_the_commit_check_tells_commits_from_other_hex():
    for text in ["at commit 54fcd53", "commits 50b0208 and 11be29d", "(commit `495a145`)", "code of commit 1f19f68"]:
        assert COMMIT_WORD.search(text) or BARE_HASH.search(text), text
    for text in ["sha256 " + "3f" * 32, "bench/gpu_h200_1127b_tests.log", "1,024 workers", "12345678 tokens",
                 "decade deadbeef", "docs/bench/sim_fast_2.json", "#decode-on-a-gpu"]:
        assert not (COMMIT_WORD.search(text) or BARE_HASH.search(text)), text


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


def test_the_config_references_are_current():
    from rollover.config import markdown_reference
    from rollover.sim.config import reference

    assert (ROOT / "docs" / "config.md").read_text() == markdown_reference() + "\n", \
        "docs/config.md is stale: python -m rollover.config docs/config.md"
    assert (ROOT / "docs" / "simulator_config.md").read_text() == reference() + "\n", \
        "docs/simulator_config.md is stale: python -m rollover.sim.config docs/simulator_config.md"

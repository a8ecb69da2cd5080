"""The docs' examples work as written. In each page below, every ```python block runs (a page's
blocks in order, in one namespace, from the repository's root, as a reader pasting them into one
script would), every ```yaml block is a config `load_config` accepts, and a block marked
`<!-- file: PATH -->` on the line before it is PATH, verbatim. A fragment that is not meant to
run (a signature listing) is marked `<!-- not run -->` on the line before it.

The examples load SmolLM2-135M-Instruct; here `rollover.models.load_hf_model` and
`load_tokenizer` give a tiny random model and a character tokenizer instead, so the examples
run in seconds and test the code around the model, not what the model writes."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import rollover.models
from rollover.config import load_config
from rollover.testing import char_tokenizer, tiny_model

ROOT = Path(__file__).parent.parent
PAGES = ["README.md", "docs/environments.md"]


def fenced(page: str) -> list[tuple[str, str, str, int]]:
    """The page's fenced blocks as (language, mark, code, line of the opening fence); `mark` is
    the text of an HTML comment on the line just before the fence, or ""."""
    out, lines, i = [], (ROOT / page).read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            prev = lines[i - 1].strip() if i else ""
            mark = prev[4:-3].strip() if prev.startswith("<!--") and prev.endswith("-->") else ""
            end = lines.index("```", i + 1)
            out.append((lang, mark, "".join(line + "\n" for line in lines[i + 1:end]), i + 1))
            i = end
        i += 1
    return out


@pytest.fixture
def tiny_models(monkeypatch):
    monkeypatch.setattr(rollover.models, "load_hf_model", lambda name, dtype=None, device=None: tiny_model(seed=0))
    monkeypatch.setattr(rollover.models, "load_tokenizer", lambda name: char_tokenizer())


def test_blocks_are_found_and_marks_are_known():
    blocks = [b for page in PAGES for b in fenced(page)]
    assert any(lang == "python" for lang, *_ in blocks)
    marks = {mark.split(":")[0] for _, mark, _, _ in blocks if mark}
    assert marks <= {"not run", "file"}, marks


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run_as_written(page, tiny_models, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__main__"}
    ran = 0
    for lang, mark, code, line in fenced(page):
        if lang != "python" or mark == "not run":
            continue
        if mark.startswith("file:"):
            path = mark.split(":", 1)[1].strip()
            assert code == (ROOT / path).read_text(), f"{page}:{line}: the copy of {path} differs from the file"
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
        ran += 1
    if page == "docs/environments.md":  # the environment, then the group of four episodes it printed
        assert ran == 2
        printed = capsys.readouterr().out.splitlines()
        assert len(printed) == 4 and all(p.split()[0] in ("done", "max_turns", "length") for p in printed), printed


@pytest.mark.parametrize("page", PAGES)
def test_yaml_examples_are_valid_configs(page, tmp_path):
    for lang, mark, code, line in fenced(page):
        if lang == "yaml" and mark != "not run":
            path = tmp_path / f"line{line}.yaml"
            path.write_text(code)
            load_config(path)  # raises ConfigError naming the key


def test_the_example_environments_training_command_is_a_valid_config(monkeypatch):
    """examples/envs/spell_backwards.py's docstring command: its config is accepted, and the
    environment it names makes tasks and groups (the training run itself is tests/test_env_*)."""
    from rollover.envs.builders import make_env_builder
    from rollover.types import Prompt

    monkeypatch.chdir(ROOT)
    text = (ROOT / "examples/envs/spell_backwards.py").read_text().replace("\\\n", " ")
    command = shlex.split(next(line for line in text.splitlines() if line.strip().startswith("rollover train")))
    assert command[:2] == ["rollover", "train"]
    cfg = load_config(command[2], command[3:])
    assert cfg.data.train == "env" and cfg.env.options == {}
    builder = make_env_builder(cfg.env.name, cfg.env.options)
    tasks = builder.prompts(3, seed=cfg.seed)
    assert tasks == builder.prompts(3, seed=cfg.seed) and all(isinstance(p, Prompt) for p in tasks)
    assert len(builder.make_group(tasks[0], 2)) == 2

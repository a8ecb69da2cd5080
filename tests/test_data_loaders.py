"""Loading prompts from jsonl, parquet and datasets directories; bad rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollover.data import DataError, load_prompts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trl_style_jsonl_string_prompt(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "What is 3 + 5?", "answer": "8", "level": 1},
            {"prompt": "What is 2 + 2?", "answer": "4", "level": 2},
        ],
    )
    ps = load_prompts(path)
    assert len(ps) == 2 and ps.num_skipped == 0
    first = ps.prompts[0]
    assert first.id == "train:0"
    assert first.text == "What is 3 + 5?" and first.messages is None
    assert first.answer == "8"
    assert first.fields == {"level": 1}


def test_trl_style_conversational_prompt_with_solution_column(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "solution": "2"}])
    (p,) = load_prompts(path).prompts
    assert p.messages == messages and p.text is None
    assert p.answer == "2"
    assert p.fields == {}


def test_verl_style_parquet_with_struct_ground_truth(tmp_path):
    table = pa.table(
        {
            "data_source": ["openai/gsm8k", "openai/gsm8k"],
            "prompt": [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]],
            "ability": ["math", "math"],
            "reward_model": [
                {"style": "rule", "ground_truth": "72"},
                {"style": "rule", "ground_truth": "10"},
            ],
            "extra_info": [{"split": "train", "index": 0}, {"split": "train", "index": 1}],
        }
    )
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(table, path)
    ps = load_prompts(path)
    assert [p.answer for p in ps.prompts] == ["72", "10"]
    assert ps.prompts[1].messages == [{"role": "user", "content": "q1"}]
    # The answer's column is not repeated in fields; the others reach rewards as kwargs.
    assert ps.prompts[1].fields == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "extra_info": {"split": "train", "index": 1},
    }


def test_custom_column_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "label": 3, "answer": "other"}])
    (p,) = load_prompts(path, prompt_key="question", answer_key="label").prompts
    assert p.text == "q" and p.answer == 3
    assert p.fields == {"answer": "other"}


def test_bad_row_raises_naming_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "ok", "answer": "1"}, {"prompt": "no answer here"}],
    )
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: missing answer"):
        load_prompts(path)


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"answer": "1"}, "missing prompt column 'prompt'"),
        ({"prompt": None, "answer": "1"}, "prompt column 'prompt' is null"),
        ({"prompt": 7, "answer": "1"}, "must be a string or a non-empty list"),
        ({"prompt": "", "answer": "1"}, "empty string"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "needs a string 'content'"),
        ({"prompt": ["hi"], "answer": "1"}, "is a str, not a dict"),
        ({"prompt": "q", "answer": ""}, "missing answer"),
        ({"prompt": "q", "answer": float("nan")}, "missing answer"),  # JSON's NaN: a missing value, as pandas writes it
    ],
)
def test_malformed_rows_are_named(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine", "answer": "0"}, row])
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert "d.jsonl line 2" in str(info.value)
    assert reason in str(info.value)


def test_invalid_json_line_is_a_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "a", "answer": "1"}\n{"prompt": \n\n{"prompt": "b", "answer": "2"}\n'
    )
    with pytest.raises(DataError, match=r"d\.jsonl line 2: not valid JSON \(Expecting value at column 12\)"):
        load_prompts(path)  # the column of the row's end, where it was cut short
    ps = load_prompts(path, on_bad_row="skip")
    # The blank line 3 is not a row; line 4 keeps its line-based id.
    assert [p.id for p in ps.prompts] == ["d:0", "d:3"]
    assert ps.num_skipped == 1


def test_a_byte_order_mark_before_the_first_row_is_read_past(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(2)]
    path.write_bytes(("\n".join(rows) + "\n").encode("utf-8-sig"))  # as Windows tools write UTF-8
    assert [p.text for p in load_prompts(path).prompts] == ["q0", "q1"]


def test_line_that_is_not_utf8_is_a_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "answer": str(i)}).encode() for i in range(3)]
    latin1 = '{"prompt": "caf\xe9?", "answer": "1"}'.encode("latin-1")  # 0xe9 then '?'
    path.write_bytes(b"\n".join([good[0], latin1, good[1], b"", good[2]]) + b"\n")
    with pytest.raises(DataError) as info:
        load_prompts(path)
    message = str(info.value)
    assert f"{path} line 2: not valid UTF-8" in message
    assert "0xe9" in message and f"byte column {latin1.index(0xE9) + 1}" in message
    ps = load_prompts(path, on_bad_row="skip")
    assert [p.id for p in ps.prompts] == ["d:0", "d:2", "d:4"]
    assert [b.where for b in ps.skipped] == [f"{path} line 2"]
    assert "not valid UTF-8" in ps.skipped[0].reason


def test_windows_line_endings_and_non_ascii_text(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "¿Cuánto es 3 + 5?", "answer": "8"}, {"prompt": "2 × 2 = ?", "answer": "4"}]
    path.write_bytes(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\r\n" for r in rows))
    ps = load_prompts(path)
    assert [p.text for p in ps.prompts] == [r["prompt"] for r in rows]


@pytest.mark.parametrize("damage", ["not parquet", "truncated", "scrambled footer"])
def test_corrupt_parquet_names_the_file(tmp_path, damage):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["q"] * 50, "answer": ["1"] * 50}), good)
    data = good.read_bytes()
    if damage == "not parquet":
        data = b"prompt,answer\nq,1\n"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:  # keep the magic bytes at both ends, scramble the metadata before the footer
        data = data[:-60] + bytes(b ^ 0x5A for b in data[-60:-8]) + data[-8:]
    path = tmp_path / "d.parquet"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        load_prompts(path, on_bad_row="skip")  # a file that cannot be read is not a bad row
    message = str(info.value)
    assert message.startswith(f"{path}: cannot read as parquet: ")
    assert "\n" not in message and len(message) > len(f"{path}: cannot read as parquet: ") + 10


def test_skip_bad_rows_and_count_them(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "a", "answer": "1"},
            {"prompt": None, "answer": "2"},
            {"prompt": "c"},
            {"prompt": "d", "answer": "4"},
        ],
    )
    ps = load_prompts(path, on_bad_row="skip")
    assert [p.answer for p in ps.prompts] == ["1", "4"]
    assert ps.num_skipped == 2
    assert [b.where for b in ps.skipped] == [f"{path} line 2", f"{path} line 3"]
    assert ps.skipped[0].reason == "prompt column 'prompt' is null"


def test_parquet_bad_row_names_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", "3"]}), path)
    with pytest.raises(DataError, match=r"d\.parquet row 1: prompt column 'prompt' is null"):
        load_prompts(path)


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(DataError, match="no usable rows"):
        load_prompts(path, on_bad_row="skip")


def test_rows_without_answers_when_not_required(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "summarise this"}])
    (p,) = load_prompts(path, require_answer=False).prompts
    assert p.answer is None
    with pytest.raises(DataError, match=r"line 1: missing answer .*require_answer=False"):
        load_prompts(path)


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"unknown dataset extension '\.csv'"):
        load_prompts(csv)
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompts(csv, on_bad_row="ignore")


def test_datasets_save_to_disk_with_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "t", "answer": "1"}]),
            "test": datasets.Dataset.from_list([{"prompt": "e", "answer": "2"}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    assert load_prompts(tmp_path / "ds").prompts[0].text == "t"
    assert load_prompts(tmp_path / "ds", split="test").prompts[0].answer == "2"
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: \['test', 'train'\]; pick one with "):
        load_prompts(tmp_path / "ds", split="validation")
    # the source names its split (a run's data.eval does): its own ids, apart from the train split's
    held = load_prompts(f"{tmp_path / 'ds'}?split=test").prompts
    assert [(p.text, p.answer) for p in held] == [("e", "2")]
    assert held[0].id != load_prompts(tmp_path / "ds").prompts[0].id
    with pytest.raises(DataError, match=r"\?split=validation row|no split 'validation'"):
        load_prompts(f"{tmp_path / 'ds'}?split=validation")
    with pytest.raises(DataError, match=r"takes one option, split \(got \['name'\]\)"):
        load_prompts(f"{tmp_path / 'ds'}?name=x")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_prompts(f"{tmp_path / 'nope'}?split=test")
    with pytest.raises(FileNotFoundError, match=r"dataset not found: .*missing\?\.jsonl"):
        load_prompts(tmp_path / "missing?.jsonl")
    dd.save_to_disk(str(tmp_path / "odd?name"))  # a '?' in the directory's own name
    assert load_prompts(f"{tmp_path / 'odd?name'}?split=test").prompts[0].text == "e"
    assert load_prompts(tmp_path / "odd?name").prompts[0].text == "t"
    rows = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError, match=r"\?split=test picks a split of a directory .* is a file"):
        load_prompts(f"{rows}?split=test")
    with pytest.raises(DataError, match=r"holds the splits \['test', 'train'\]: name one, .*ds\?split=NAME"):
        load_prompts(tmp_path / "ds", split=None)  # as a run's data.eval reads it
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "o", "answer": "3"}])}).save_to_disk(
        str(tmp_path / "single"))
    assert load_prompts(tmp_path / "single", split=None).prompts[0].text == "o"  # one split: nothing to choose
    datasets.Dataset.from_list([{"prompt": "t", "answer": "1"}]).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="holds one Dataset, which has no splits"):
        load_prompts(f"{tmp_path / 'one'}?split=test")


def test_generator_source():
    ps = load_prompts("gen:arithmetic?n=3&seed=1")
    assert len(ps) == 3 and ps.source == "gen:arithmetic?n=3&seed=1"
    assert all(p.text.startswith("What is ") for p in ps.prompts)

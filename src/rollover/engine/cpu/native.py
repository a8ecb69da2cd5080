"""TorchEngine's CPU kernels in C: a decode step's attention, the residual add with RMSNorm,
SwiGLU's SiLU-and-multiply, sampling, and a GEMM for linear layers at decode sizes, fp32.

Why. On a CPU a decode step of SmolLM2-135M at 64 rows spent about 70 ms in its matrix
products and, before these kernels, 40 more in work that reads and writes little memory but
pays for many small calls: MKL's batched GEMMs for each row's [g, head_dim] x [head_dim, Lk]
attention product, a bias pass, scattered cache writes, and torch's CPU RMSNorm, which runs
as five separate element-wise ops. Each kernel here is one pass over its data, parallel with
OpenMP. The GEMM (`pack`, `linear`) multiplies by weights packed once into panels, and
prefetches the next panel while one is used: the weights stream from memory at every decode
step, and MKL's GEMM, at its peak on weights in cache, lost 5-20% on streamed ones
(docs/benchmarks.md, "Native packed GEMM"). The runner uses it where the vectors are 512 bits
wide (`gemm_vector_bits`), where it was measured.

Build. The C source, `kernels.c` beside this module, is compiled at first use with the system's
C compiler (`$CC`, else `cc`; `-O3 -march=native`) into `$ROLLOVER_CACHE/native`, once per
source, flags, torch version and CPU, and loaded with ctypes (which drops the GIL during a
call). It links torch's own libgomp, so its parallel loops share torch's OpenMP worker pool (and
`rollover.engine.cpu.openmp`'s release of it). `-ffast-math` lets the compiler vectorize the
reductions and `expf`; sums then run in another order than torch's, so results agree within
float rounding (about 1e-6 relative), not bit for bit.

Use. `kernels_for(device, dtype, wanted)`: `wanted=None` (TorchEngine's default) uses them on a
CPU in fp32 where they build, and logs once why not where they do not (no compiler, say);
True requires them; False, or `ROLLOVER_NATIVE=0`, keeps to torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = (Path(__file__).parent / "kernels.c").read_text()  # the C, beside this file

_COMPILE = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fPIC", "-fopenmp", "-c"]
# linked without -ffast-math: GCC would add crtfastmath.o, which sets flush-to-zero for the whole
# process (the trainer's denormals included); and against torch's libgomp by name where torch
# bundles one, so the kernels' parallel loops share its worker pool
_LINK = ["-shared"]


def _torch_libgomp() -> Path | None:
    """torch's bundled OpenMP runtime, which the kernels link so both share one worker pool."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_signature() -> str:
    """What `-march=native` compiled for: a library built on one CPU is not loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(cache: Path | None = None) -> Path:
    """Compile the kernels (once per source, flags, compiler, torch and CPU) and return the
    library's path. Raises `RuntimeError` saying why when it cannot."""
    from rollover.models import cache_dir

    if platform.system() != "Linux":
        raise RuntimeError(f"the native kernels are built for Linux only (this is {platform.system()})")
    cc = os.environ.get("CC", "cc")
    gomp = _torch_libgomp()
    link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
    link = [*_LINK, *link, "-lmvec", "-lm"]
    key = hashlib.sha256("\n".join([_SOURCE, cc, *_COMPILE, *link, torch.__version__, _cpu_signature()]).encode()).hexdigest()[:16]
    out_dir = Path(cache or cache_dir() / "native")
    lib = out_dir / f"kernels-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then renamed: concurrent builds are safe
        src, obj, tmp_lib = Path(tmp) / "kernels.c", Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
        src.write_text(_SOURCE)
        for cmd in ([cc, str(src), "-o", str(obj), *_COMPILE], [cc, str(obj), "-o", str(tmp_lib), *link]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RuntimeError(f"the C compiler {cc!r} could not run: {e}") from None
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed to build the native kernels: {done.stderr.strip()[-600:]}")
        os.replace(tmp_lib, lib)
    return lib


def _check(ok: bool, what: str) -> None:
    """The C code trusts its pointers: a layout it does not expect is refused here, loudly."""
    if not ok:
        raise ValueError(f"native kernel: {what}")


def _f32(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu  # (is_cpu: a third of device.type's cost, a check a call)


def fits(group: int, head_dim: int) -> bool:
    """Whether the attention kernel takes a model's heads: at most 16 query heads a kv head, an
    even head size of at most 256 (its per-thread buffers)."""
    return 1 <= group <= 16 and 2 <= head_dim <= 256 and head_dim % 2 == 0


@dataclass(frozen=True)
class PackedWeight:
    """A weight [n, k] in the GEMM's panels (`Kernels.pack`)."""

    data: torch.Tensor
    n: int
    k: int


class Kernels:
    """The loaded library, one method a kernel; each takes fp32 CPU tensors in the layout its C
    comment gives and checks what the C code relies on."""

    def __init__(self, lib: ctypes.CDLL):
        P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._attention = lib.rollover_decode_attention
        self._attention.argtypes = [P, I64, P, I64, P, I64, P, P, P, P, I, P, P, P, I, I, I, I, I, I, F, I]
        self._attention.restype = I
        self._norm = lib.rollover_add_rms_norm
        self._norm.argtypes = [P, I64, P, I64, P, P, I, I, F, I]
        self._norm.restype = None
        self._silu_mul = lib.rollover_silu_mul
        self._silu_mul.argtypes = [P, P, I, I, I]
        self._silu_mul.restype = None
        self._gemm_pack = lib.rollover_gemm_pack
        self._gemm_pack.argtypes = [P, I64, I, I, P, I]
        self._gemm_pack.restype = None
        self._gemm = lib.rollover_gemm
        self._gemm.argtypes = [P, I64, I, I, P, I, P, P, I64, I]
        self._gemm.restype = None
        self.gemm_panel = lib.rollover_gemm_panel()
        self.gemm_vector_bits = lib.rollover_gemm_vector_bits()
        self._sample = lib.rollover_sample
        self._sample.argtypes = [P, I, I, P, P, P, P, P, I]
        self._sample.restype = None

    def attention(self, q, k, v, rope, kc, vc, positions, scratch, span: int, max_len: int, scale: float) -> torch.Tensor:
        """q [B, H, D], k and v [B, KV, D] (heads D apart, last dim contiguous), rope None or the
        (cos, sin_signed) tables; writes k, v at each row's position in kc, vc [rows, KV,
        max_len, D] and returns the attention output [B, H * D]. Raises ValueError where the C
        code refuses its inputs (a position at or past `span`, say)."""
        B, H, D = q.shape
        KV = k.shape[1]
        _check(all(_f32(t) for t in (q, k, v, kc, vc, scratch)), "attention runs fp32 CPU tensors")
        _check(H % KV == 0 and fits(H // KV, D), f"{H} query heads over {KV} kv heads of size {D} are outside the kernel's range")
        _check(kc.shape == vc.shape == (kc.shape[0], KV, max_len, D) and kc.is_contiguous() and vc.is_contiguous(),
               f"the cache must be one layer's contiguous [rows, {KV}, {max_len}, {D}], not {tuple(kc.shape)}")
        _check(k.shape == v.shape == (B, KV, D) and all(t.stride(-1) == 1 and t.stride(-2) == D for t in (q, k, v)),
               f"q, k, v must be [B, heads, {D}] with heads {D} apart")
        _check(positions.shape == (B,) and positions.dtype == torch.long and positions.is_contiguous()
               and scratch.is_contiguous() and scratch.numel() >= B * H * span,
               "positions must be [B] int64 and scratch B * heads * span contiguous floats")
        if rope is not None:
            _check(all(_f32(t) and t.shape == (max_len, D) and t.is_contiguous() for t in rope), f"rope tables must be fp32 [{max_len}, {D}]")
        c, sn = (t.data_ptr() for t in rope) if rope is not None else (None, None)
        out = torch.empty((B, H * D), dtype=torch.float32)
        err = self._attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              c, sn, kc.data_ptr(), vc.data_ptr(), kc.shape[0], positions.data_ptr(), out.data_ptr(),
                              scratch.data_ptr(), span, B, KV, H // KV, D, max_len, scale, torch.get_num_threads())
        if err:
            raise ValueError(f"native decode attention refused its inputs (code {err}): {B} rows, {H // KV} query "
                             f"heads a kv head, head size {D}, positions below {span}")
        return out

    def add_rms_norm(self, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x += r in place (r None: nothing added); returns RMSNorm(x) * w as a new [n, d] tensor.
        x and r are [n, d] with contiguous rows."""
        n, d = x.shape
        _check(_f32(x) and _f32(w) and x.stride(1) == 1 and w.shape == (d,) and w.is_contiguous()
               and (r is None or (_f32(r) and r.shape == (n, d) and r.stride(1) == 1)),
               f"add_rms_norm takes fp32 [n, {d}] rows and a [{d}] weight")
        h = torch.empty((n, d), dtype=torch.float32)
        self._norm(x.data_ptr(), x.stride(0), None if r is None else r.data_ptr(), 0 if r is None else r.stride(0),
                   w.data_ptr(), h.data_ptr(), n, d, eps, torch.get_num_threads())
        return h

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [n, 2m] contiguous (gate, then up) -> silu(gate) * up [n, m]."""
        n, m2 = gu.shape
        _check(_f32(gu) and gu.is_contiguous() and m2 % 2 == 0, "silu_mul takes a contiguous fp32 [n, 2m]")
        out = torch.empty((n, m2 // 2), dtype=torch.float32)
        self._silu_mul(gu.data_ptr(), out.data_ptr(), n, m2 // 2, torch.get_num_threads())
        return out

    def pack(self, w: torch.Tensor) -> "PackedWeight":
        """An [N, K] weight (rows contiguous) in the GEMM's panel layout, for `linear`."""
        _check(_f32(w) and w.dim() == 2 and w.stride(1) == 1 and min(w.shape) > 0, "pack takes an fp32 [N, K] weight with contiguous rows")
        N, K = w.shape
        data = torch.empty(-(-N // self.gemm_panel) * K * self.gemm_panel, dtype=torch.float32)
        self._gemm_pack(w.data_ptr(), w.stride(0), N, K, data.data_ptr(), torch.get_num_threads())
        return PackedWeight(data, N, K)

    def linear(self, x: torch.Tensor, w: "PackedWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (rows contiguous) times the packed weight -> [M, N] (+ bias [N]), as F.linear."""
        _check(x.dim() == 2, f"linear takes a 2-D [M, {w.k}] input, not {x.dim()}-D")
        M, K = x.shape
        _check(_f32(x) and x.stride(1) == 1 and K == w.k, f"linear takes fp32 [M, {w.k}] rows for its weight")
        _check(_f32(w.data) and w.data.is_contiguous() and w.data.numel() == -(-w.n // self.gemm_panel) * self.gemm_panel * w.k,
               "linear takes a weight packed by Kernels.pack")
        _check(bias is None or (_f32(bias) and bias.shape == (w.n,) and bias.is_contiguous()), f"linear takes an fp32 [{w.n}] bias")
        y = torch.empty((M, w.n), dtype=torch.float32)
        if M == 0:
            return y
        self._gemm(x.data_ptr(), x.stride(0), M, K, w.data.data_ptr(), w.n, None if bias is None else bias.data_ptr(),
                   y.data_ptr(), w.n, torch.get_num_threads())
        return y

    def sample(self, logits: torch.Tensor, temps: torch.Tensor | None, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] contiguous fp32, temps [B] fp32 or None (all 1), u [B] float64 uniforms ->
        (tokens [B] int64, logprobs [B] fp32), drawn as `Sampler.sample` draws them."""
        B, V = logits.shape
        _check(_f32(logits) and logits.is_contiguous() and V > 0, "sample takes [B, V > 0] contiguous fp32 logits")
        _check(u.shape == (B,) and u.dtype == torch.float64 and u.is_contiguous() and u.device.type == "cpu",
               "sample takes [B] float64 uniforms")
        _check(temps is None or (temps.shape == (B,) and _f32(temps) and temps.is_contiguous()), "sample takes [B] fp32 temperatures")
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * V, dtype=torch.float32)
        tokens, logprobs = torch.empty(B, dtype=torch.long), torch.empty(B, dtype=torch.float32)
        self._sample(logits.data_ptr(), B, V, None if temps is None else temps.data_ptr(), u.data_ptr(),
                     scratch.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), threads)
        return tokens, logprobs


@functools.lru_cache(maxsize=None)
def load() -> Kernels:
    """The kernels (built at the first call in a process; a cached library that does not load,
    truncated say, is built again once). Raises `RuntimeError` saying why when they cannot be
    built or loaded."""
    lib = build()
    try:
        return Kernels(ctypes.CDLL(str(lib)))
    except (OSError, AttributeError):
        lib.unlink(missing_ok=True)
    try:
        return Kernels(ctypes.CDLL(str(build())))
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"the native kernels did not load: {e}") from None


@functools.lru_cache(maxsize=None)
def _unavailable_said(why: str) -> None:
    log.warning("TorchEngine runs torch's CPU ops instead of its native kernels: %s", why)


def kernels_for(device: torch.device, dtype: torch.dtype, wanted: bool | None, group: int = 1,
                head_dim: int = 64) -> Kernels | None:
    """The native kernels where a runner should use them, else None. `wanted`: None uses them
    where they build (saying once why not); True requires them; False never. `group` (query
    heads a kv head) and `head_dim` are the model's."""
    if wanted is False or (wanted is None and os.environ.get("ROLLOVER_NATIVE", "1") == "0"):
        return None
    if device.type != "cpu" or dtype != torch.float32 or not fits(group, head_dim):
        if wanted:
            raise ValueError(f"the native kernels run fp32 on a CPU with at most 16 query heads a kv head and an even "
                             f"head size up to 256, not {dtype} on {device.type}, {group} heads of {head_dim}")
        if device.type == "cpu" and dtype == torch.float32:
            _unavailable_said(f"{group} query heads a kv head of size {head_dim} are outside the attention kernel's range")
        return None
    try:
        return load()
    except RuntimeError as e:
        if wanted:
            raise
        _unavailable_said(str(e))
        return None

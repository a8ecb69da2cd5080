"""A decode step's attention over the KV cache: write each row's new key and value, then attend
its query heads over the row's cached keys.

Two implementations, with the same inputs and results:

- **torch** (any device and dtype): the new keys and values go in with one `index_copy_` each;
  scores by `baddbmm` over `cache[:B, :, :Lk]` with a bias that masks keys past a row's
  position, softmax, and `bmm` with the values.
- **native** (CPU, fp32; the default there): one C loop over (row, kv head), parallel with
  OpenMP, compiled at first use with the system's C compiler and cached
  (`$ROLLOVER_CACHE/native`). Each row reads its own keys only up to its position, its g query
  heads share one pass over the keys and one over the values, and the new key and value are
  written in the same loop. Why: at decode sizes MKL's batched GEMMs spend more on the call
  for each small [g, head_dim] x [head_dim, Lk] product than on the arithmetic, and the bias
  and the scattered cache writes are separate passes over memory. Measured on the 2-core Intel
  host, SmolLM2-135M's shapes (64 rows, 3 kv heads of 3 query heads, 116 cached tokens, 30
  layers): 15.3 ms a step against 28.8 ms, cache writes included; the K/V it must read take
  11.8 ms at the machine's streaming rate. It runs on torch's own OpenMP runtime (the library
  links torch's libgomp), so it shares torch's worker pool and `rollover.engine.openmp`'s release.

The native kernel sums in another order than MKL, so results agree within float rounding
(about 1e-6 relative), not bit for bit. `native=None` uses it where it builds and says once
why not otherwise (no compiler, say); `True` requires it; `False` (or `ROLLOVER_NATIVE=0`) keeps
to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_ROWS 8  /* rows of keys (values) ahead: 2 KB at head_dim 64, best of 4, 8 and 16 */

static inline __attribute__((always_inline)) void prefetch_row(const float *r, int D) {
    for (int d = 0; d < D; d += 16) __builtin_prefetch(r + d);
}

/* one (row, kv head): write the new key and value at position p, attend G queries over 0..p */
static inline __attribute__((always_inline)) void one_head(
    const float *restrict qb, const float *restrict kn, const float *restrict vn,
    float *restrict kb, float *restrict vb, int64_t p, float *restrict o, float *restrict s,
    int G, const int D, float scale)
{
    int L = (int)p + 1;
    memcpy(kb + p * D, kn, D * sizeof(float));
    memcpy(vb + p * D, vn, D * sizeof(float));
    for (int j = 0; j < L; j++) {  /* scores s[i, j] = q_i . k_j * scale */
        const float *restrict kr = kb + (int64_t)j * D;
        prefetch_row(kr + PREFETCH_ROWS * D, D);
        for (int i = 0; i < G; i++) {
            const float *restrict qi = qb + i * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int d = 0; d < D; d++) acc += qi[d] * kr[d];
            s[i * L + j] = acc * scale;
        }
    }
    float inv[16];
    for (int i = 0; i < G; i++) {  /* softmax numerators in place; 1 / denominator kept */
        float *restrict si = s + i * L, m = si[0], sum = 0.f;
        #pragma omp simd reduction(max:m)
        for (int j = 0; j < L; j++) m = si[j] > m ? si[j] : m;
        #pragma omp simd reduction(+:sum)
        for (int j = 0; j < L; j++) { si[j] = expf(si[j] - m); sum += si[j]; }
        inv[i] = 1.f / sum;
    }
    float acc[16 * 256];
    memset(acc, 0, G * D * sizeof(float));
    for (int j = 0; j < L; j++) {  /* o_i = sum_j p[i, j] v_j */
        const float *restrict vr = vb + (int64_t)j * D;
        prefetch_row(vr + PREFETCH_ROWS * D, D);
        for (int i = 0; i < G; i++) {
            float w = s[i * L + j];
            float *restrict ai = acc + i * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ai[d] += w * vr[d];
        }
    }
    for (int i = 0; i < G; i++) {
        #pragma omp simd
        for (int d = 0; d < D; d++) o[i * D + d] = acc[i * D + d] * inv[i];
    }
}

/* q [B, KV * G, D], k and v [B, KV, D] (row strides given, heads adjacent); kc and vc one layer's
   cache [rows, KV, max_len, D]; out [B, KV * G, D]; scratch B * KV * G * span floats, span >
   every position. Returns nonzero, touching nothing, where the shapes are out of its range. */
int rollover_decode_attention(
    const float *q, int64_t q_row, const float *k, int64_t k_row, const float *v, int64_t v_row,
    float *kc, float *vc, int rows, const int64_t *pos, float *out, float *scratch, int span,
    int B, int KV, int G, int D, int max_len, float scale, int nthreads)
{
    if (G < 1 || G > 16 || D < 1 || D > 256 || B > rows || span > max_len) return 1;
    for (int b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= span) return 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int bh = 0; bh < B * KV; bh++) {
        int b = bh / KV, h = bh % KV;
        const float *qb = q + b * q_row + (int64_t)h * G * D;
        float *kb = kc + (int64_t)bh * max_len * D, *vb = vc + (int64_t)bh * max_len * D;
        float *o = out + (int64_t)b * KV * G * D + (int64_t)h * G * D;
        float *s = scratch + (int64_t)bh * G * span;
        if (D == 64)  /* the common head sizes get loops of a known length */
            one_head(qb, k + b * k_row + h * 64, v + b * v_row + h * 64, kb, vb, pos[b], o, s, G, 64, scale);
        else if (D == 128)
            one_head(qb, k + b * k_row + h * 128, v + b * v_row + h * 128, kb, vb, pos[b], o, s, G, 128, scale);
        else
            one_head(qb, k + b * k_row + h * D, v + b * v_row + h * D, kb, vb, pos[b], o, s, G, D, scale);
    }
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fPIC", "-shared", "-fopenmp"]


def _torch_libgomp() -> Path | None:
    """torch's bundled OpenMP runtime, which the kernel links so both share one worker pool."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_signature() -> str:
    """What `-march=native` compiled for: a library built on one CPU is not loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(cache: Path | None = None) -> Path:
    """Compile the kernel (once per source, flags, compiler, torch and CPU) and return the
    library's path. Raises `RuntimeError` saying why when it cannot."""
    from rollover.models import cache_dir

    if platform.system() != "Linux":
        raise RuntimeError(f"the native decode attention is built for Linux only (this is {platform.system()})")
    cc = os.environ.get("CC", "cc")
    gomp = _torch_libgomp()
    link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else []
    cmd_tail = [*_FLAGS, *link, "-lmvec", "-lm"]
    key = hashlib.sha256("\n".join([_SOURCE, cc, *cmd_tail, torch.__version__, _cpu_signature()]).encode()).hexdigest()[:16]
    out_dir = Path(cache or cache_dir() / "native")
    lib = out_dir / f"decode_attention-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then renamed: concurrent builds are safe
        src, tmp_lib = Path(tmp) / "decode_attention.c", Path(tmp) / "decode_attention.so"
        src.write_text(_SOURCE)
        try:
            done = subprocess.run([cc, str(src), "-o", str(tmp_lib), *cmd_tail], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"the C compiler {cc!r} could not run: {e}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the native decode attention: {done.stderr.strip()[-600:]}")
        os.replace(tmp_lib, lib)
    return lib


@functools.lru_cache(maxsize=None)
def load():
    """The kernel as a ctypes function (built at the first call in a process). Raises
    `RuntimeError` saying why when it cannot be built or loaded."""
    try:
        fn = ctypes.CDLL(str(build())).rollover_decode_attention
    except OSError as e:
        raise RuntimeError(f"the native decode attention did not load: {e}") from None
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [P, I64, P, I64, P, I64, P, P, I, P, P, P, I, I, I, I, I, I, ctypes.c_float, I]
    fn.restype = I
    return fn


@functools.lru_cache(maxsize=None)
def _unavailable_said(why: str) -> None:
    log.warning("TorchEngine decodes with torch's attention: %s", why)


def native_for(device: torch.device, dtype: torch.dtype, wanted: bool | None):
    """The native kernel where this runner should use it, else None. `wanted`: None uses it where
    it builds (saying once why not); True requires it; False never."""
    if wanted is False or (wanted is None and os.environ.get("ROLLOVER_NATIVE", "1") == "0"):
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if wanted:
            raise ValueError(f"the native decode attention runs fp32 on a CPU, not {dtype} on {device.type}")
        return None
    try:
        return load()
    except RuntimeError as e:
        if wanted:
            raise
        _unavailable_said(str(e))
        return None


@dataclass
class Setup:
    """What every layer's attention in one decode step shares."""

    positions: torch.Tensor  # [B] each row's position (where its new key goes)
    Lk: int  # keys 0..Lk-1 are attended (masked per row past its position)
    slot: torch.Tensor | None = None  # torch: flat cache index of each (row, kv head)'s new key
    bias: torch.Tensor | None = None  # torch: [B * KV, 1, Lk], -inf past each row's position
    scratch: torch.Tensor | None = None  # native: room for the scores


class DecodeAttention:
    """One layer's decode attention for a runner's shapes; `native` is the kernel or None."""

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype, native=None):
        self.n_heads, self.n_kv, self.head_dim, self.max_len, self.dtype = n_heads, n_kv, head_dim, max_len, dtype
        self.native = native

    def setup(self, positions: torch.Tensor, Lk: int | None = None) -> Setup:
        B, KV, dev = positions.shape[0], self.n_kv, positions.device
        Lk = Lk or int(positions.max()) + 1
        if self.native is not None:
            if Lk > self.max_len:
                raise ValueError(f"a decode position ({Lk - 1}) is past the cache's {self.max_len} tokens")
            return Setup(positions.contiguous(), Lk, scratch=torch.empty(B * self.n_heads * Lk))
        # flat cache index of (row b, kv head h, position p): (b * KV + h) * max_len + p
        slot = ((torch.arange(B, device=dev)[:, None] * KV + torch.arange(KV, device=dev)[None, :]) * self.max_len
                + positions[:, None]).reshape(-1)
        keymask = torch.arange(Lk, device=dev)[None, :] <= positions[:, None]  # [B, Lk]
        bias = torch.zeros((B, Lk), dtype=self.dtype, device=dev).masked_fill_(~keymask, float("-inf"))
        bias = bias[:, None, None, :].expand(B, KV, 1, Lk).reshape(B * KV, 1, Lk)
        return Setup(positions, Lk, slot=slot, bias=bias)

    def __call__(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 setup: Setup) -> torch.Tensor:
        """Write k, v [B, KV, D] at each row's position in one layer's cache kc, vc [rows, KV,
        max_len, D]; attend q [B, H, D] over the row's keys. Returns [B, H * D]."""
        B, KV, D = q.shape[0], self.n_kv, self.head_dim
        if self.native is not None:
            q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == D else t.contiguous() for t in (q, k, v))
            out = torch.empty((B, self.n_heads * D))
            err = self.native(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              kc.data_ptr(), vc.data_ptr(), kc.shape[0], setup.positions.data_ptr(), out.data_ptr(),
                              setup.scratch.data_ptr(), setup.Lk, B, KV, self.n_heads // KV, D, self.max_len,
                              1.0 / math.sqrt(D), torch.get_num_threads())
            if err:
                raise ValueError(f"native decode attention refused its inputs (code {err}): {B} rows, "
                                 f"{self.n_heads // KV} query heads a kv head, head size {D}, positions below {setup.Lk}")
            return out
        Lk = setup.Lk
        kc.view(-1, D).index_copy_(0, setup.slot, k.reshape(B * KV, D))
        vc.view(-1, D).index_copy_(0, setup.slot, v.reshape(B * KV, D))
        K = kc[:B, :, :Lk].reshape(B * KV, Lk, D)  # views: rows and heads are adjacent in the cache
        V = vc[:B, :, :Lk].reshape(B * KV, Lk, D)
        qg = q.reshape(B * KV, self.n_heads // KV, D)  # the g query heads sharing each kv head
        s = torch.baddbmm(setup.bias, qg, K.transpose(1, 2), alpha=1.0 / math.sqrt(D))  # [B*KV, g, Lk]
        return torch.bmm(torch.softmax(s, dim=-1), V).reshape(B, -1)

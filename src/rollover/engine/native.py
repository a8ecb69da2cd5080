"""TorchEngine's CPU kernels in C: a decode step's attention, the residual add with RMSNorm,
SwiGLU's SiLU-and-multiply, sampling, and a GEMM for linear layers at decode sizes, fp32.

Why. On a CPU a decode step of SmolLM2-135M at 64 rows spent about 70 ms in its matrix
products and, before these kernels, 40 more in work that reads and writes little memory but
pays for many small calls: MKL's batched GEMMs for each row's [g, head_dim] x [head_dim, Lk]
attention product, a bias pass, scattered cache writes, and torch's CPU RMSNorm, which runs
as five separate element-wise ops. Each kernel here is one pass over its data, parallel with
OpenMP. The GEMM (`pack`, `linear`) multiplies by weights packed once into panels, and
prefetches the next panel while one is used: the weights stream from memory at every decode
step, and MKL's GEMM, at its peak on weights in cache, lost 10-25% on streamed ones
(docs/benchmarks.md, "Native packed GEMM"). The runner uses it where the vectors are 512 bits
wide (`gemm_vector_bits`), where it was measured.

Build. The source below is compiled at first use with the system's C compiler (`$CC`, else
`cc`; `-O3 -march=native`) into `$ROLLOVER_CACHE/native`, once per source, flags, torch version
and CPU, and loaded with ctypes (which drops the GIL during a call). It links torch's own
libgomp, so its parallel loops share torch's OpenMP worker pool (and `rollover.engine.openmp`'s
release of it). `-ffast-math` lets the compiler vectorize the reductions and `expf`; sums then
run in another order than torch's, so results agree within float rounding (about 1e-6
relative), not bit for bit.

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

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_ROWS 8  /* cache rows ahead: 2 KB at head_dim 64; the best of 4, 8 and 16 */
#define PARALLEL_FROM 16384  /* elements below which an element-wise kernel runs on one thread */

static inline __attribute__((always_inline)) void prefetch_row(const float *r, int D) {
    for (int d = 0; d < D; d += 16) __builtin_prefetch(r + d);
}

/* x rotated by the rotary table rows c, s (s = sin with its first half negated) */
static inline __attribute__((always_inline)) void rope(
    const float *restrict x, const float *restrict c, const float *restrict s, float *restrict out, const int D)
{
    int half = D / 2;
    #pragma omp simd
    for (int d = 0; d < half; d++) out[d] = x[d] * c[d] + x[d + half] * s[d];
    #pragma omp simd
    for (int d = half; d < D; d++) out[d] = x[d] * c[d] + x[d - half] * s[d];
}

/* one (row, kv head): write the new key (rotated when c is given) and value at position p,
   attend the G queries over keys 0..p */
static inline __attribute__((always_inline)) void one_head(
    const float *restrict qb, const float *restrict kn, const float *restrict vn,
    const float *restrict c, const float *restrict sn,
    float *restrict kb, float *restrict vb, int64_t p, float *restrict o, float *restrict s,
    int G, const int D, float scale)
{
    int L = (int)p + 1;
    float qr[16 * 256];
    if (c) {
        rope(kn, c + p * D, sn + p * D, kb + p * D, D);
        for (int i = 0; i < G; i++) rope(qb + i * D, c + p * D, sn + p * D, qr + i * D, D);
        qb = qr;
    } else {
        memcpy(kb + p * D, kn, D * sizeof(float));
    }
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

/* q [B, KV * G, D], k and v [B, KV, D] (row strides given, heads adjacent); c, sn the rotary
   tables [max_len, D] or NULL (q and k already rotated); kc and vc one layer's cache [rows, KV,
   max_len, D]; out [B, KV * G, D]; scratch B * KV * G * span floats, span > every position.
   Returns nonzero, touching nothing, where the shapes are out of its range. */
int rollover_decode_attention(
    const float *q, int64_t q_row, const float *k, int64_t k_row, const float *v, int64_t v_row,
    const float *c, const float *sn, float *kc, float *vc, int rows, const int64_t *pos, float *out,
    float *scratch, int span, int B, int KV, int G, int D, int max_len, float scale, int nthreads)
{
    if (G < 1 || G > 16 || D < 2 || D > 256 || D % 2 || B > rows || span > max_len) return 1;
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
            one_head(qb, k + b * k_row + h * 64, v + b * v_row + h * 64, c, sn, kb, vb, pos[b], o, s, G, 64, scale);
        else if (D == 128)
            one_head(qb, k + b * k_row + h * 128, v + b * v_row + h * 128, c, sn, kb, vb, pos[b], o, s, G, 128, scale);
        else
            one_head(qb, k + b * k_row + h * D, v + b * v_row + h * D, c, sn, kb, vb, pos[b], o, s, G, D, scale);
    }
    return 0;
}

/* x [n, d] (rows xs apart) += r [n, d] (rows rs apart; NULL: nothing added), in place; then
   h [n, d] = x * rsqrt(mean(x^2) + eps) * w (HF's RMSNorm) */
void rollover_add_rms_norm(float *x, int64_t xs, const float *r, int64_t rs, const float *w, float *h,
                           int n, int d, float eps, int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if((int64_t)n * d >= PARALLEL_FROM)
    for (int i = 0; i < n; i++) {
        float *restrict xi = x + i * xs, *restrict hi = h + (int64_t)i * d;
        float ss = 0.f;
        if (r) {
            const float *restrict ri = r + i * rs;
            #pragma omp simd reduction(+:ss)
            for (int j = 0; j < d; j++) { xi[j] += ri[j]; ss += xi[j] * xi[j]; }
        } else {
            #pragma omp simd reduction(+:ss)
            for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        }
        float inv = 1.f / sqrtf(ss / d + eps);
        #pragma omp simd
        for (int j = 0; j < d; j++) hi[j] = xi[j] * inv * w[j];
    }
}

/* Inverse-CDF sampling, one row per iteration: zt = logits[b] * (1 / temps[b]) (temps NULL: 1),
   e = exp(zt - max zt) kept in the thread's row of `scratch` ([nthreads, V]), so the total and the
   scan add the very same numbers; the first token whose cumulative sum (in double, compared in
   float as torch's cumsum and searchsorted do) exceeds u[b] times the total, the target held
   below the total so that a zero-probability token is never drawn; its logprob zt - max -
   log(total). Products and sums are kept apart (no fused multiply-add can make the max row's
   exponent nonzero). */
void rollover_sample(const float *logits, int B, int V, const float *temps, const double *u,
                     float *scratch, int64_t *tokens, float *logprobs, int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int b = 0; b < B; b++) {
        const float *restrict z = logits + (int64_t)b * V;
        float *restrict e = scratch + (int64_t)omp_get_thread_num() * V;
        float inv_t = temps ? 1.f / temps[b] : 1.f, m;
        #pragma omp simd
        for (int j = 0; j < V; j++) e[j] = z[j] * inv_t;
        m = e[0];
        #pragma omp simd reduction(max:m)
        for (int j = 0; j < V; j++) m = e[j] > m ? e[j] : m;
        double total = 0.0;
        #pragma omp simd reduction(+:total)
        for (int j = 0; j < V; j++) { e[j] = expf(e[j] - m); total += (double)e[j]; }
        float total_f = (float)total, target = (float)(u[b] * (double)total_f);
        if (target >= total_f) target = nextafterf(total_f, 0.f);
        double run = 0.0;
        int tok = -1;
        for (int j0 = 0; j0 < V && tok < 0; j0 += 16) {  /* whole blocks while the sum stays at or below the target */
            int j1 = j0 + 16 < V ? j0 + 16 : V;
            double block = 0.0;
            for (int j = j0; j < j1; j++) block += (double)e[j];
            if ((float)(run + block) <= target) { run += block; continue; }
            for (int j = j0; j < j1; j++) {
                run += (double)e[j];
                if ((float)run > target) { tok = j; break; }
            }
            if (tok < 0) {  /* the block's sum crossed, its running sums did not (rounding): its last token with mass */
                tok = j1 - 1;
                while (e[tok] == 0.f) tok--;
            }
        }
        if (tok < 0) {  /* rounding left the target beyond the whole scan: the last token with mass */
            tok = V - 1;
            while (tok > 0 && e[tok] == 0.f) tok--;
        }
        volatile float zt = z[tok] * inv_t;  /* as rounded in the first pass: no fused multiply-add here */
        tokens[b] = tok;
        logprobs[b] = (zt - m) - logf(total_f);
    }
}

/* gu [n, 2m] (gate, then up): out [n, m] = silu(gate) * up */
void rollover_silu_mul(const float *gu, float *out, int n, int m, int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if((int64_t)n * m >= PARALLEL_FROM)
    for (int i = 0; i < n; i++) {
        const float *restrict g = gu + (int64_t)i * 2 * m, *restrict u = g + m;
        float *restrict o = out + (int64_t)i * m;
        #pragma omp simd
        for (int j = 0; j < m; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

/* A linear layer at decode sizes: y [M, N] = x [M, K] w^T (+ bias), w packed once into panels of
   GEMM_NR output columns, [ceil(N / NR)][K][NR] (columns past N zero). Each thread takes a run of
   panels; a panel is read from memory once and reused, from its core's cache, by every block of
   GEMM_MR rows (the batch fits in cache). The panel after it is prefetched while this one is
   used, its lines spread over the blocks' inner loops, because the weights stream from memory
   at every step and the hardware prefetcher alone leaves the multiplies waiting on them. */
#if defined(__AVX512F__)
#define GEMM_VL 16
#define GEMM_MR 8
#else
#define GEMM_VL 8
#define GEMM_MR 4
#endif
#define GEMM_NR (3 * GEMM_VL)
#define GEMM_KC 256  /* products summed in registers before they are added to the output: the error of a
                        long sum grows with its length (one running sum over K = 18,944 was 9x MKL's) */
typedef float vecf __attribute__((vector_size(GEMM_VL * 4)));
typedef float vecf_u __attribute__((vector_size(GEMM_VL * 4), aligned(4)));  /* any float address */

int rollover_gemm_panel(void) { return GEMM_NR; }
int rollover_gemm_vector_bits(void) { return GEMM_VL * 32; }

/* w [N, K] (rows ws apart, each contiguous) into p, ceil(N / NR) * K * NR floats */
void rollover_gemm_pack(const float *w, int64_t ws, int N, int K, float *p, int nthreads)
{
    int np = (N + GEMM_NR - 1) / GEMM_NR;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int pi = 0; pi < np; pi++) {
        float *restrict dst = p + (int64_t)pi * K * GEMM_NR;
        for (int j = 0; j < GEMM_NR; j++) {
            int n = pi * GEMM_NR + j;
            const float *restrict src = w + (int64_t)n * ws;
            for (int k = 0; k < K; k++) dst[(int64_t)k * GEMM_NR + j] = n < N ? src[k] : 0.f;
        }
    }
}

/* MR rows of x (lda apart) times one panel b: c [MR, ncols] (ldc apart), + bias[0..ncols) when
   given; meanwhile lines first..first+count-1 of the panel at pf are prefetched */
static inline __attribute__((always_inline)) void gemm_block(
    const float *restrict a, int64_t lda, const float *restrict b, int K, float *restrict c, int64_t ldc,
    int ncols, const float *restrict bias, const int MR, const float *pf, int first, int count)
{
    int per = pf ? (count + K - 1) / K : 0;  /* lines to prefetch an iteration */
    for (int k0 = 0; k0 < K; k0 += GEMM_KC) {  /* a run of GEMM_KC products summed in registers, then into c */
        int k1 = k0 + GEMM_KC < K ? k0 + GEMM_KC : K;
        vecf acc[GEMM_MR][3];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = acc[i][2] = (vecf){0};
        for (int k = k0; k < k1; k++) {
            const float *bk = b + (int64_t)k * GEMM_NR;
            vecf b0 = *(const vecf_u *)bk, b1 = *(const vecf_u *)(bk + GEMM_VL), b2 = *(const vecf_u *)(bk + 2 * GEMM_VL);
            for (int l = k * per; l < (k + 1) * per && l < count; l++)
                __builtin_prefetch(pf + (int64_t)(first + l) * 16, 0, 2);
            for (int i = 0; i < MR; i++) {
                vecf av = (vecf){0} + a[i * lda + k];
                acc[i][0] += av * b0;
                acc[i][1] += av * b1;
                acc[i][2] += av * b2;
            }
        }
        if (ncols == GEMM_NR) {
            vecf z = {0}, s0 = z, s1 = z, s2 = z;
            for (int i = 0; i < MR; i++) {
                float *ci = c + i * ldc;
                if (k0) { s0 = *(vecf_u *)ci; s1 = *(vecf_u *)(ci + GEMM_VL); s2 = *(vecf_u *)(ci + 2 * GEMM_VL); }
                else if (bias) { s0 = *(const vecf_u *)bias; s1 = *(const vecf_u *)(bias + GEMM_VL); s2 = *(const vecf_u *)(bias + 2 * GEMM_VL); }
                *(vecf_u *)ci = s0 + acc[i][0];
                *(vecf_u *)(ci + GEMM_VL) = s1 + acc[i][1];
                *(vecf_u *)(ci + 2 * GEMM_VL) = s2 + acc[i][2];
            }
        } else {  /* the last panel's columns past N are not written */
            for (int i = 0; i < MR; i++) {
                float row[GEMM_NR];
                memcpy(row, &acc[i][0], sizeof(vecf));
                memcpy(row + GEMM_VL, &acc[i][1], sizeof(vecf));
                memcpy(row + 2 * GEMM_VL, &acc[i][2], sizeof(vecf));
                for (int j = 0; j < ncols; j++) c[i * ldc + j] = (k0 ? c[i * ldc + j] : bias ? bias[j] : 0.f) + row[j];
            }
        }
    }
}

#define GEMM_CASE(R) case R: gemm_block(a + m0 * lda, lda, b, K, c + (int64_t)m0 * ldc + n0, ldc, ncols, bn, R, next, first, count); break;

/* x [M, K] (rows lda apart) times p (rollover_gemm_pack of an [N, K] w) -> c [M, N] (rows ldc
   apart), + bias [N] when not NULL */
void rollover_gemm(const float *a, int64_t lda, int M, int K, const float *p, int N, const float *bias,
                   float *c, int64_t ldc, int nthreads)
{
    int np = (N + GEMM_NR - 1) / GEMM_NR, nb = (M + GEMM_MR - 1) / GEMM_MR;
    int lines = (int)(((int64_t)K * GEMM_NR * 4 + 63) / 64), per_block = (lines + nb - 1) / nb;
    #pragma omp parallel num_threads(nthreads) if((int64_t)M * N * K >= (1 << 18))
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int p0 = (int)((int64_t)np * t / T), p1 = (int)((int64_t)np * (t + 1) / T);
        for (int pi = p0; pi < p1; pi++) {
            const float *b = p + (int64_t)pi * K * GEMM_NR, *next = pi + 1 < p1 ? b + (int64_t)K * GEMM_NR : 0;
            int n0 = pi * GEMM_NR, ncols = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
            const float *bn = bias ? bias + n0 : 0;
            for (int mb = 0; mb < nb; mb++) {
                int m0 = mb * GEMM_MR, first = mb * per_block, count = lines - first;
                count = count < 0 ? 0 : count > per_block ? per_block : count;
                switch (M - m0 < GEMM_MR ? M - m0 : GEMM_MR) {
#if GEMM_MR == 8
                GEMM_CASE(8) GEMM_CASE(7) GEMM_CASE(6) GEMM_CASE(5)
#endif
                GEMM_CASE(4) GEMM_CASE(3) GEMM_CASE(2) default: gemm_block(a + m0 * lda, lda, b, K, c + (int64_t)m0 * ldc + n0, ldc, ncols, bn, 1, next, first, count);
                }
            }
        }
    }
}
"""

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

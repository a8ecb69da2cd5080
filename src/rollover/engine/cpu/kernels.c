/* rollover's native CPU kernels, fp32: compiled at first use by rollover.engine.native (which
   documents them and checks every argument before a call). */
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

#define GEMM_BLOCK(R) gemm_block(a + m0 * lda, lda, b, K, c + (int64_t)m0 * ldc + n0, ldc, ncols, bn, R, next, first, count)
#define GEMM_CASE(R) case R: GEMM_BLOCK(R); break;

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
                GEMM_CASE(4) GEMM_CASE(3) GEMM_CASE(2) default: GEMM_BLOCK(1);
                }
            }
        }
    }
}

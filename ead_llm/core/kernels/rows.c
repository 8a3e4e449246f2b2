/* ead-llm's own float32 projection for x86-64 CPUs with AVX2 and FMA: out[m][n] = x[m][:] . w[n][:] (+ bias[n]).
 *
 * Every output is one chain of fused multiply-adds over the inputs in order, from zero, then the bias added: the same
 * operations whatever the row count, the row's place in the call or the panel it falls in. So a row gets the same
 * bits in any call (batch invariance by construction, not by probing), and a call of a few rows streams the weight
 * once: each panel of NR outputs is read for up to MR rows at a time while their accumulators stay in registers.
 *
 * The weight is packed once into panels of NR outputs, [panels][k][NR], zero-filled past n. Compiled on first use by
 * ead_llm.core.kernels (cc -O3 -mavx2 -mfma -ffp-contract=off) and called through ctypes, which releases the GIL. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 24        /* outputs per panel: three AVX2 vectors */
#define MR 4         /* rows per micro-kernel call: 12 accumulators, 3 weight vectors and a broadcast fit 16 registers */
#define ROW_BLOCK 64 /* rows kept in the cache while every panel passes over them */
#define AHEAD 1024   /* bytes of the weight stream asked for ahead of the arithmetic (see PREFETCH) */

int64_t ead_rows_panel_width(void) { return NR; }

void ead_rows_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                out[(p * k + i) * NR + j] = col < n ? w[col * k + i] : 0.0f;
            }
}

static inline void store(float *out, __m256 a0, __m256 a1, __m256 a2, int64_t cols, const float *bias) {
    float tmp[NR];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    _mm256_storeu_ps(tmp + 16, a2);
    if (bias)
        for (int64_t j = 0; j < cols; j++) tmp[j] += bias[j];
    memcpy(out, tmp, (size_t)cols * sizeof(float));
}

/* R rows of x (stride ldx) against one panel; the accumulators are named, so they stay in registers. */
#define ACC(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps(), a##r##2 = _mm256_setzero_ps();
#define FMA(r)                                                                                                        \
    {                                                                                                                 \
        const __m256 v = _mm256_broadcast_ss(x + (r) * ldx + i);                                                      \
        a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0);                                                                    \
        a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1);                                                                    \
        a##r##2 = _mm256_fmadd_ps(v, w2, a##r##2);                                                                    \
    }
#define LOAD                                                                                                          \
    const __m256 w0 = _mm256_loadu_ps(w + i * NR), w1 = _mm256_loadu_ps(w + i * NR + 8),                             \
                 w2 = _mm256_loadu_ps(w + i * NR + 16);
#define STORE(r) store(out + (r) * ldo, a##r##0, a##r##1, a##r##2, cols, bias);
#define ARGS                                                                                                          \
    const float *x, int64_t ldx, const float *w, int64_t k, float *out, int64_t ldo, int64_t cols, const float *bias

/* The first group of rows on a panel reads it from memory; with two rows or more the arithmetic per byte is enough
 * to outpace the hardware prefetcher, so the micro-kernel asks for the stream AHEAD bytes on (it runs on into the next
 * panel: panels lie end to end). On an AMD Zen 3 this took SmolLM2's products at 4 rows from 36.8 to 31.1 ms (2 to 6
 * rows gained 7-15%, one row nothing, 64 rows lost 2-4%: hence the first group only). Later groups find the panel in
 * the cache. Prefetching changes no arithmetic. */
#define PREFETCH                                                                                                      \
    _mm_prefetch((const char *)(w + i * NR) + AHEAD, _MM_HINT_T0);                                                    \
    _mm_prefetch((const char *)(w + i * NR) + AHEAD + 64, _MM_HINT_T0);
#define NOTHING

static void micro1(ARGS) {
    ACC(0)
    for (int64_t i = 0; i < k; i++) { LOAD FMA(0) }
    STORE(0)
}
#define MICROS(SUFFIX, AHEAD_OF)                                                                                      \
    static void micro2##SUFFIX(ARGS) {                                                                                \
        ACC(0) ACC(1)                                                                                                 \
        for (int64_t i = 0; i < k; i++) { AHEAD_OF LOAD FMA(0) FMA(1) }                                               \
        STORE(0) STORE(1)                                                                                             \
    }                                                                                                                 \
    static void micro3##SUFFIX(ARGS) {                                                                                \
        ACC(0) ACC(1) ACC(2)                                                                                          \
        for (int64_t i = 0; i < k; i++) { AHEAD_OF LOAD FMA(0) FMA(1) FMA(2) }                                        \
        STORE(0) STORE(1) STORE(2)                                                                                    \
    }                                                                                                                 \
    static void micro4##SUFFIX(ARGS) {                                                                                \
        ACC(0) ACC(1) ACC(2) ACC(3)                                                                                   \
        for (int64_t i = 0; i < k; i++) { AHEAD_OF LOAD FMA(0) FMA(1) FMA(2) FMA(3) }                                 \
        STORE(0) STORE(1) STORE(2) STORE(3)                                                                           \
    }
MICROS(_ahead, PREFETCH)
MICROS(_cached, NOTHING)

/* x: [m][k] contiguous; packed: ead_rows_pack's layout of an [n][k] weight; bias: [n] or NULL; out: [m][n]. */
void ead_rows_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                     float *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
        for (int64_t p = 0; p < panels; p++) {
            const float *w = packed + p * k * NR;
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const float *b = bias ? bias + p * NR : 0;
            for (int64_t r = r0; r < r1; r += MR) {
                const float *xr = x + r * k;
                float *o = out + r * n + p * NR;
                int64_t rows = r1 - r < MR ? r1 - r : MR;
                if (rows == 1)
                    micro1(xr, k, w, k, o, n, cols, b);
                else if (r == r0) /* the panel's first group: it comes from memory */
                    (rows == 2 ? micro2_ahead : rows == 3 ? micro3_ahead : micro4_ahead)(xr, k, w, k, o, n, cols, b);
                else
                    (rows == 2 ? micro2_cached : rows == 3 ? micro3_cached : micro4_cached)(xr, k, w, k, o, n, cols, b);
            }
        }
    }
}

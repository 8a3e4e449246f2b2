/* ead-llm's own float32 projection for x86-64 CPUs with AVX2 and FMA: out[m][n] = x[m][:] . w[n][:] (+ bias[n]).
 *
 * Every output is one chain of fused multiply-adds over the inputs in order, from zero, then the bias added: the same
 * operations whatever the row count, the row's place in the call, the micro-kernel or the panel it falls in. So a row
 * gets the same bits in any call (batch invariance by construction, not by probing), and a call of a few rows streams
 * the weight once: each panel of NR outputs is read for up to MR rows at a time while their accumulators stay in
 * registers (6 rows x 2 vectors = 12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16 registers).
 *
 * The weight is packed once into panels of NR outputs, [panels][k][NR], zero-filled past n: one cache line per input.
 * Compiled on first use by ead_llm.core.kernels (cc -O3 -mavx2 -mfma -ffp-contract=off) and called through ctypes,
 * which releases the GIL. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16        /* outputs per panel: two AVX2 vectors, 64 bytes per input */
#define MR 6         /* rows per micro-kernel call */
#define ROW_BLOCK 64 /* rows kept in the cache while every panel passes over them */
#define AHEAD 1024   /* bytes of the weight stream asked for ahead of the arithmetic (see PREFETCH) */

int64_t ead_rows_panel_width(void) { return NR; }

/* ead_rows_pack (float32) and ead_rows_pack16 (bfloat16 bits): w [n][k] -> [panels][k][NR], zero past n */
#define PACK(NAME, T)                                                                                                 \
    void NAME(const T *w, int64_t n, int64_t k, T *out) {                                                             \
        int64_t panels = (n + NR - 1) / NR;                                                                           \
        for (int64_t p = 0; p < panels; p++)                                                                          \
            for (int64_t i = 0; i < k; i++)                                                                           \
                for (int64_t j = 0; j < NR; j++) {                                                                    \
                    int64_t col = p * NR + j;                                                                         \
                    out[(p * k + i) * NR + j] = col < n ? w[col * k + i] : (T)0;                                      \
                }                                                                                                     \
    }
PACK(ead_rows_pack, float)
PACK(ead_rows_pack16, uint16_t)

static inline void store(float *out, __m256 a0, __m256 a1, int64_t cols, const float *bias) {
    float tmp[NR];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    if (bias)
        for (int64_t j = 0; j < cols; j++) tmp[j] += bias[j];
    memcpy(out, tmp, (size_t)cols * sizeof(float));
}

#define ARGS(W)                                                                                                       \
    const float *x, int64_t ldx, const W *w, int64_t k, float *out, int64_t ldo, int64_t cols, const float *bias
/* the accumulators are named, one pair per row, so they stay in registers */
#define ACC(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define LOAD                                                                                                          \
    const __m256 w0 = _mm256_loadu_ps(w + i * NR);                                                                    \
    const __m256 w1 = _mm256_loadu_ps(w + i * NR + 8);
/* bfloat16 weights (a draft's, whose products may round): widened to float32 exactly (the 16 bits moved up), then
 * the same float32 chain. Half the bytes of a memory-bound product, on any AVX2 CPU. */
#define WIDEN(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_BF16                                                                                                     \
    const __m256 w0 = WIDEN(w + i * NR);                                                                              \
    const __m256 w1 = WIDEN(w + i * NR + 8);
#define FMA(r)                                                                                                        \
    {                                                                                                                 \
        const __m256 v = _mm256_broadcast_ss(x + (r) * ldx + i);                                                      \
        a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0);                                                                    \
        a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1);                                                                    \
    }
#define STORE(r) store(out + (r) * ldo, a##r##0, a##r##1, cols, bias);
#define REP1(M) M(0)
#define REP2(M) REP1(M) M(1)
#define REP3(M) REP2(M) M(2)
#define REP4(M) REP3(M) M(3)
#define REP5(M) REP4(M) M(4)
#define REP6(M) REP5(M) M(5)

/* The first group of rows on a panel reads it from memory; with two rows or more the arithmetic per byte is enough
 * to outpace the hardware prefetcher, so the micro-kernel asks for the stream AHEAD bytes on (it runs on into the next
 * panel: panels lie end to end). On an AMD Zen 3 this took SmolLM2's products at 4 rows from 32-34 to 28.5 ms (one
 * row gained nothing, so it does not ask). Later groups find the panel in the cache. Prefetching changes no
 * arithmetic. */
#define PREFETCH _mm_prefetch((const char *)(w + i * NR) + AHEAD, _MM_HINT_T0);
#define NOTHING

#define MICRO(R, SUFFIX, AHEAD_OF, W, LOADER)                                                                         \
    static void micro##R##SUFFIX(ARGS(W)) {                                                                           \
        REP##R(ACC) for (int64_t i = 0; i < k; i++) {                                                                 \
            AHEAD_OF LOADER REP##R(FMA)                                                                               \
        }                                                                                                             \
        REP##R(STORE)                                                                                                 \
    }
/* the micro-kernels for one weight type, and the linear that runs them */
#define KERNELS(NAME, W, LOADER)                                                                                      \
    MICRO(1, NAME, NOTHING, W, LOADER)                                                                                \
    MICRO(2, NAME##_ahead, PREFETCH, W, LOADER) MICRO(3, NAME##_ahead, PREFETCH, W, LOADER)                           \
    MICRO(4, NAME##_ahead, PREFETCH, W, LOADER) MICRO(5, NAME##_ahead, PREFETCH, W, LOADER)                           \
    MICRO(6, NAME##_ahead, PREFETCH, W, LOADER) MICRO(2, NAME##_cached, NOTHING, W, LOADER)                           \
    MICRO(3, NAME##_cached, NOTHING, W, LOADER) MICRO(4, NAME##_cached, NOTHING, W, LOADER)                           \
    MICRO(5, NAME##_cached, NOTHING, W, LOADER) MICRO(6, NAME##_cached, NOTHING, W, LOADER)                           \
    typedef void (*micro##NAME##_kernel)(ARGS(W));                                                                    \
    static const micro##NAME##_kernel FROM_MEMORY##NAME[MR + 1] = {                                                   \
        0, micro1##NAME, micro2##NAME##_ahead, micro3##NAME##_ahead, micro4##NAME##_ahead, micro5##NAME##_ahead,      \
        micro6##NAME##_ahead};                                                                                        \
    static const micro##NAME##_kernel FROM_CACHE##NAME[MR + 1] = {                                                    \
        0, micro1##NAME, micro2##NAME##_cached, micro3##NAME##_cached, micro4##NAME##_cached, micro5##NAME##_cached,  \
        micro6##NAME##_cached};                                                                                       \
    /* x: [m][k] contiguous; packed: the pack's layout of an [n][k] weight; bias: [n] or NULL; out: [m][n]. */       \
    void ead_rows_linear##NAME(const float *x, int64_t m, int64_t k, const W *packed, int64_t n, const float *bias,  \
                               float *out) {                                                                          \
        int64_t panels = (n + NR - 1) / NR;                                                                           \
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {                                                               \
            int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;                                                     \
            for (int64_t p = 0; p < panels; p++) {                                                                    \
                const W *w = packed + p * k * NR;                                                                     \
                int64_t cols = n - p * NR < NR ? n - p * NR : NR;                                                     \
                const float *b = bias ? bias + p * NR : 0;                                                            \
                for (int64_t r = r0; r < r1; r += MR) {                                                               \
                    int64_t rows = r1 - r < MR ? r1 - r : MR;                                                         \
                    (r == r0 ? FROM_MEMORY##NAME : FROM_CACHE##NAME)[rows](x + r * k, k, w, k, out + r * n + p * NR,  \
                                                                            n, cols, b);                              \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
    }
KERNELS(, float, LOAD)
KERNELS(_bf16, uint16_t, LOAD_BF16)

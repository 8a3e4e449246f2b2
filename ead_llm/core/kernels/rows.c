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
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Threads: a call's panels are shared out among `threads` threads, whole panels each, so each output is still one
 * chain computed by one thread: the same bits with any thread count. The helpers are ead-llm's own (a pool of
 * pthreads, started on first use): one caller at a time uses them (another caller meanwhile, or a child process forked
 * after they started, runs on its own thread), and each spins a while for the next task before it sleeps, since a
 * decode step hands them one projection after another, a fraction of a millisecond each. (GNU OpenMP's pool, tried
 * first, put its threads to sleep after every call once the process had more threads than cores, which costs
 * more than a one-row projection saves.) */
#include <pthread.h>
#define MAX_HELPERS 15
#define SPINS 20000 /* pauses (some tenths of a millisecond) a helper waits for the next task before it sleeps */
typedef void (*panel_work)(const void *args, int64_t first, int64_t last);
static struct {
    pthread_mutex_t use, sleep;
    pthread_cond_t wake;
    int64_t started;
    volatile int64_t generation, done, sleeping, forked;
    panel_work work;
    const void *args;
    int64_t panels, parts;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void in_child(void) { pool.forked = 1; }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(0, 0, in_child); }

static void part_of(int64_t part, int64_t parts, int64_t panels, int64_t *first, int64_t *last) {
    *first = panels * part / parts;
    *last = panels * (part + 1) / parts;
}

static void *helper(void *arg) {
    int64_t part = (int64_t)(intptr_t)arg, seen = 0;
    for (;;) {
        for (int64_t spins = 0; __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen;) {
            if (++spins < SPINS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.sleep);
            pool.sleeping++;
            while (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen)
                pthread_cond_wait(&pool.wake, &pool.sleep);
            pool.sleeping--;
            pthread_mutex_unlock(&pool.sleep);
        }
        seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        if (part < pool.parts) {
            int64_t first, last;
            part_of(part, pool.parts, pool.panels, &first, &last);
            pool.work(pool.args, first, last);
        }
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_ACQ_REL);
    }
    return 0;
}

/* work(args, first, last) over panels [0, panels), on up to `threads` threads (the caller's share is the first) */
static void over_panels(panel_work work, const void *args, int64_t panels, int64_t threads) {
    int64_t parts = threads < panels / 2 ? threads : panels / 2;
    if (parts > MAX_HELPERS + 1) parts = MAX_HELPERS + 1;
    if (parts < 2 || pool.forked || pthread_mutex_trylock(&pool.use)) {
        work(args, 0, panels);
        return;
    }
    while (pool.started < parts - 1) {
        pthread_t thread; /* never joined: a helper lives as long as the process */
        if (pthread_create(&thread, 0, helper, (void *)(intptr_t)(pool.started + 1))) break;
        pthread_detach(thread);
        pool.started++;
    }
    if (pool.started < parts - 1) parts = pool.started + 1;
    pool.work = work;
    pool.args = args;
    pool.panels = panels;
    pool.parts = parts;
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.sleep);
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_ACQ_REL);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    int64_t first, last;
    part_of(0, parts, panels, &first, &last);
    work(args, first, last);
    while (__atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < pool.started) _mm_pause();
    pthread_mutex_unlock(&pool.use);
}


#define NR 16        /* outputs per panel: two AVX2 vectors, 64 bytes per input */
#define MR 6         /* rows per micro-kernel call */
#define ROW_BLOCK 64 /* rows kept in the cache while every panel passes over them */
#define AHEAD 1024   /* bytes of the weight stream asked for ahead of the arithmetic (see PREFETCH) */

int64_t ead_rows_panel_width(void) { return NR; }

/* The most rows one micro-kernel call takes (1 to MR): a call of m rows runs as ceil(m / most) groups of even size.
 * Which is fastest depends on the CPU: on an AMD Zen 4, SmolLM2's products at 5 and 6 rows took 26.5 and 28.0 ms as
 * one group and 24.5 and 24.4 as two (most = 4). Each output is one chain over k in order whatever group its row
 * falls in, so the group size changes time, never bits. Set by the engine from its own timing
 * (ead_llm.core.fused_llama.tune_group). */
static int64_t group_most = MR;
void ead_rows_set_group(int64_t most) {
    __atomic_store_n(&group_most, most < 1 ? 1 : most > MR ? MR : most, __ATOMIC_RELAXED);
}
int64_t ead_rows_group(void) { return __atomic_load_n(&group_most, __ATOMIC_RELAXED); }

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

static inline void store(float *out, __m256 a0, __m256 a1, int64_t cols, const float *bias, const float *residual) {
    float tmp[NR];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    if (bias)
        for (int64_t j = 0; j < cols; j++) tmp[j] += bias[j];
    if (residual) /* a layer's residual stream: residual + (x . w + bias), as torch adds them */
        for (int64_t j = 0; j < cols; j++) tmp[j] = residual[j] + tmp[j];
    memcpy(out, tmp, (size_t)cols * sizeof(float));
}

/* the eight lanes of v added in a fixed tree: a sum whose order depends on nothing but the lanes */
static inline float lanes_sum(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* transformers' LlamaRMSNorm of one row: w * (x * (1 / sqrt(mean(x^2) + eps))). The squares are summed in eight lanes
 * over the row in order, then the lanes in a fixed tree: the same bits for a row in any call. */
static void rms_norm_row(const float *x, int64_t k, const float *w, float eps, float *y) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float sum = lanes_sum(acc);
    for (; i < k; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)k + eps);
    for (int64_t j = 0; j < k; j++) y[j] = w[j] * (x[j] * scale);
}

/* exp(x) for eight floats: Cephes' range reduction and polynomial (about 1 ulp), the same bits on every AVX2 CPU. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

/* silu(gate) * up for one row [gate (k) | up (k)]: gate / (1 + exp(-gate)) * up, eight lanes at a time and the tail
 * through the same lanes (padded), so every element takes the same operations, wherever it falls. */
static void silu_gate_row(const float *x, int64_t k, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) { /* two vectors side by side, no copies */
        const __m256 g0 = _mm256_loadu_ps(x + i), g1 = _mm256_loadu_ps(x + i + 8);
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g0));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g1));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g0, _mm256_add_ps(one, e0)), _mm256_loadu_ps(x + k + i)));
        _mm256_storeu_ps(y + i + 8,
                         _mm256_mul_ps(_mm256_div_ps(g1, _mm256_add_ps(one, e1)), _mm256_loadu_ps(x + k + i + 8)));
    }
    for (; i < k; i += 8) {
        float g[8] = {0}, u[8] = {0}, r[8];
        const int64_t count = k - i < 8 ? k - i : 8;
        memcpy(g, x + i, (size_t)count * sizeof(float));
        memcpy(u, x + k + i, (size_t)count * sizeof(float));
        const __m256 gate = _mm256_loadu_ps(g);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
        _mm256_storeu_ps(r, _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, e)), _mm256_loadu_ps(u)));
        memcpy(y + i, r, (size_t)count * sizeof(float));
    }
}

/* rotary position embedding of a row's first heads, in place: x * cos + roll(x, dim / 2) * sin (sin's first half
 * negated), each product rounded, then the sum: the bits of torch's elementwise form. */
static void rotate_row(float *row, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    float tmp[512];
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * dim;
        memcpy(tmp, x, (size_t)dim * sizeof(float));
        for (int64_t i = 0; i < dim; i++) x[i] = tmp[i] * cos[i] + tmp[i < half ? i + half : i - half] * sin[i];
    }
}

#define ARGS(W)                                                                                                       \
    const float *x, int64_t ldx, const W *w, int64_t k, float *out, int64_t ldo, int64_t cols, const float *bias, \
        const float *residual
/* the accumulators are named, one pair per row, so they stay in registers */
#define ACC(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
/* eight weights as float32: LOAD_AT for float32 weights; WIDEN for bfloat16 ones (a draft's, whose products may
 * round), widened exactly (the 16 bits moved up), then the same float32 chain: half the bytes of a memory-bound
 * product, on any AVX2 CPU */
#define LOAD_AT(p) _mm256_loadu_ps(p)
#define WIDEN(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
/* a panel's 16 weights of input i, loaded by LD */
#define LOAD(LD)                                                                                                      \
    const __m256 w0 = LD(w + i * NR);                                                                                 \
    const __m256 w1 = LD(w + i * NR + 8);
#define FMA(r)                                                                                                        \
    {                                                                                                                 \
        const __m256 v = _mm256_broadcast_ss(x + (r) * ldx + i);                                                      \
        a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0);                                                                    \
        a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1);                                                                    \
    }
#define STORE(r) store(out + (r) * ldo, a##r##0, a##r##1, cols, bias, residual ? residual + (r) * ldo : 0);
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

#define MICRO(R, SUFFIX, AHEAD_OF, W, LD)                                                                             \
    static void micro##R##SUFFIX(ARGS(W)) {                                                                           \
        REP##R(ACC) for (int64_t i = 0; i < k; i++) {                                                                 \
            AHEAD_OF LOAD(LD) REP##R(FMA)                                                                             \
        }                                                                                                             \
        REP##R(STORE)                                                                                                 \
    }
/* A later group of rows (in a call of more than MR rows) finds its panel in the cache, and one of 1 to 4 rows runs at
 * the speed of its chains' latency, not the memory's: so while it runs it asks for its share of the next panel, one
 * line every `every` steps (`every`: the panel's group count, so the groups together ask for the whole panel once,
 * at the pace they consume theirs), and the next panel's first group finds it in the cache too. On an AMD Zen 3 this
 * took SmolLM2's pass of 7 to 16 tokens from 44-72 to 35-59 ms (1 to 6 tokens, one group, unchanged). */
#define SPREAD(R, SUFFIX, W, LD)                                                                                      \
    static void spread##R##SUFFIX(ARGS(W), const W *next, int64_t every) {                                            \
        REP##R(ACC) for (int64_t i = 0, due = 0, line = 0; i < k; i++) {                                              \
            if (i == due) {                                                                                           \
                _mm_prefetch((const char *)(next + line * NR), _MM_HINT_T1);                                          \
                line++;                                                                                               \
                due += every;                                                                                         \
            }                                                                                                         \
            LOAD(LD) REP##R(FMA)                                                                                      \
        }                                                                                                             \
        REP##R(STORE)                                                                                                 \
    }
/* One row over QUAD panels at once: a row alone has one chain per vector of outputs, and a panel's two run at their
 * latency, not the memory's. QUAD panels give 2 * QUAD independent chains: on an AMD Zen 3, SmolLM2's float32
 * products at one row went from 17 to 22 GB/s, a draft's bfloat16 ones from 15 to 21. Each output is still the one
 * chain over k in order, stored as a panel alone stores it: the same bits. */
#define QUAD 4
#define QUAD_ACC(j) __m256 q##j##0 = _mm256_setzero_ps(), q##j##1 = _mm256_setzero_ps();
#define QUAD_FMA(j, LD)                                                                                               \
    q##j##0 = _mm256_fmadd_ps(v, LD(w + (j) * k * NR + i * NR), q##j##0);                                             \
    q##j##1 = _mm256_fmadd_ps(v, LD(w + (j) * k * NR + i * NR + 8), q##j##1);
#define QUAD_STORE(j)                                                                                                 \
    store(out + (j) * NR, q##j##0, q##j##1, NR, bias ? bias + (j) * NR : 0, residual ? residual + (j) * NR : 0);
#define ONE_ROW(SUFFIX, W, LD)                                                                                        \
    static void quad##SUFFIX(const float *x, int64_t ldx, const W *w, int64_t k, float *out, int64_t ldo,             \
                             const float *bias, const float *residual) {                                              \
        (void)ldx, (void)ldo; /* one row: no row strides (the signature is the tiled kernels') */                    \
        QUAD_ACC(0) QUAD_ACC(1) QUAD_ACC(2) QUAD_ACC(3) for (int64_t i = 0; i < k; i++) {                             \
            const __m256 v = _mm256_broadcast_ss(x + i);                                                              \
            QUAD_FMA(0, LD) QUAD_FMA(1, LD) QUAD_FMA(2, LD) QUAD_FMA(3, LD)                                           \
        }                                                                                                             \
        QUAD_STORE(0) QUAD_STORE(1) QUAD_STORE(2) QUAD_STORE(3)                                                       \
    }
/* A few rows (2 to TILE_ROWS) over QUAD whole panels at once, TILE inputs of each in turn. A panel alone is one
 * stream of the weight, and the hardware keeps more of the memory busy for several streams: the one-row path above
 * reads 22 GB/s from four panels, a panel of 2 to 4 rows read 15-19. The accumulators wait in memory between tiles,
 * and each output is still the one chain over k in order, stored as a panel alone stores it: the same bits. On an
 * AMD Zen 3, SmolLM2's float32 products at 2 / 3 / 4 rows went from 31.2 / 29.8 / 29.8 to 27.7 / 24.4 / 25.1 ms
 * (min of 16, both libraries in one process, alternated). Five or six rows, bfloat16 weights, longer tiles, 2, 3,
 * 6 or 8 panels and a prefetch per stream gained nothing or lost, so they are not taken. */
#define TILE 8 /* inputs of a panel per turn: 512 bytes of float32 weights */
#define TILE_LOAD(r) __m256 a##r##0 = acc[g][2 * (r)], a##r##1 = acc[g][2 * (r) + 1];
#define TILE_SAVE(r)                                                                                                  \
    acc[g][2 * (r)] = a##r##0;                                                                                        \
    acc[g][2 * (r) + 1] = a##r##1;
#define TILE_STORE(r)                                                                                                 \
    store(out + (r) * ldo + g * NR, acc[g][2 * (r)], acc[g][2 * (r) + 1], NR, bias ? bias + g * NR : 0,              \
          residual ? residual + (r) * ldo + g * NR : 0);
#define TILED(R, SUFFIX, W, LD)                                                                                       \
    static void tiled##R##SUFFIX(const float *x, int64_t ldx, const W *first, int64_t k, float *out, int64_t ldo,     \
                                 const float *bias, const float *residual) {                                          \
        __m256 acc[QUAD][2 * R];                                                                                      \
        for (int64_t g = 0; g < QUAD; g++)                                                                            \
            for (int64_t j = 0; j < 2 * R; j++) acc[g][j] = _mm256_setzero_ps();                                      \
        for (int64_t t = 0; t < k; t += TILE) {                                                                       \
            const int64_t end = t + TILE < k ? t + TILE : k;                                                          \
            for (int64_t g = 0; g < QUAD; g++) {                                                                      \
                const W *w = first + g * k * NR;                                                                      \
                REP##R(TILE_LOAD) for (int64_t i = t; i < end; i++) {                                                 \
                    LOAD(LD) REP##R(FMA)                                                                              \
                }                                                                                                     \
                REP##R(TILE_SAVE)                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        for (int64_t g = 0; g < QUAD; g++) {                                                                          \
            REP##R(TILE_STORE)                                                                                        \
        }                                                                                                             \
    }
/* one block of rows of a call, as the threads sharing its panels read it */
struct block {
    const float *x;
    int64_t m, k;
    const void *packed;
    int64_t n;
    const float *bias, *residual;
    float *out;
};
/* the micro-kernels for one weight type, and the linear that runs them (calls of 1 to TILE_ROWS rows run QUAD
 * panels at once: one row on ONE_ROW's kernel, more on TILED's; with TILE_ROWS 1 the compiler drops the tiled ones) */
#define KERNELS(NAME, W, LD, TILE_ROWS)                                                                               \
    ONE_ROW(NAME, W, LD)                                                                                              \
    TILED(2, NAME, W, LD) TILED(3, NAME, W, LD) TILED(4, NAME, W, LD)                                                 \
    typedef void (*quad##NAME##_kernel)(const float *, int64_t, const W *, int64_t, float *, int64_t, const float *,   \
                                        const float *);                                                               \
    static const quad##NAME##_kernel QUADS##NAME[5] = {0, quad##NAME, tiled2##NAME, tiled3##NAME, tiled4##NAME};      \
    MICRO(1, NAME, NOTHING, W, LD)                                                                                    \
    MICRO(2, NAME##_ahead, PREFETCH, W, LD) MICRO(3, NAME##_ahead, PREFETCH, W, LD)                                   \
    MICRO(4, NAME##_ahead, PREFETCH, W, LD) MICRO(5, NAME##_ahead, PREFETCH, W, LD)                                   \
    MICRO(6, NAME##_ahead, PREFETCH, W, LD) MICRO(2, NAME##_cached, NOTHING, W, LD)                                   \
    MICRO(3, NAME##_cached, NOTHING, W, LD) MICRO(4, NAME##_cached, NOTHING, W, LD)                                   \
    MICRO(5, NAME##_cached, NOTHING, W, LD) MICRO(6, NAME##_cached, NOTHING, W, LD)                                   \
    SPREAD(1, NAME, W, LD) SPREAD(2, NAME, W, LD) SPREAD(3, NAME, W, LD) SPREAD(4, NAME, W, LD)                       \
    SPREAD(5, NAME, W, LD) SPREAD(6, NAME, W, LD)                                                                     \
    typedef void (*spread##NAME##_kernel)(ARGS(W), const W *, int64_t);                                               \
    static const spread##NAME##_kernel SPREADING##NAME[MR + 1] = {                                                    \
        0, spread1##NAME, spread2##NAME, spread3##NAME, spread4##NAME, spread5##NAME, spread6##NAME};                 \
    typedef void (*micro##NAME##_kernel)(ARGS(W));                                                                    \
    static const micro##NAME##_kernel FROM_MEMORY##NAME[MR + 1] = {                                                   \
        0, micro1##NAME, micro2##NAME##_ahead, micro3##NAME##_ahead, micro4##NAME##_ahead, micro5##NAME##_ahead,      \
        micro6##NAME##_ahead};                                                                                        \
    static const micro##NAME##_kernel FROM_CACHE##NAME[MR + 1] = {                                                    \
        0, micro1##NAME, micro2##NAME##_cached, micro3##NAME##_cached, micro4##NAME##_cached, micro5##NAME##_cached,  \
        micro6##NAME##_cached};                                                                                       \
    /* panels [first, last) of one block of rows (x: [m][k]; residual and out: [m][n]) */                          \
    static void panels##NAME(const void *arguments, int64_t first, int64_t last) {                                    \
        const struct block *a = (const struct block *)arguments;                                                      \
        const float *x = a->x, *bias = a->bias, *residual = a->residual;                                              \
        const W *packed = (const W *)a->packed;                                                                       \
        int64_t m = a->m, k = a->k, n = a->n;                                                                         \
        float *out = a->out;                                                                                          \
        /* groups of even size (7 rows: 4 + 3, not 6 + 1: a group of 1 to 4 rows costs its chains' latency), of at    \
         * most ead_rows_group() rows */                                                                              \
        int64_t most = ead_rows_group(), least = (m + most - 1) / most, step = (m + least - 1) / least;               \
        int64_t groups = (m + step - 1) / step, share = (k + groups - 1) / groups;                                    \
        int64_t p = first;                                                                                            \
        if (m >= 1 && m <= TILE_ROWS) /* whole panels QUAD at a time (the last, maybe partial, ones below) */        \
            for (; p + QUAD <= last && (p + QUAD) * NR <= n; p += QUAD)                                               \
                QUADS##NAME[m](x, k, packed + p * k * NR, k, out + p * NR, n, bias ? bias + p * NR : 0,               \
                               residual ? residual + p * NR : 0);                                                     \
        for (; p < last; p++) {                                                                                       \
            const W *w = packed + p * k * NR;                                                                         \
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;                                                         \
            const float *b = bias ? bias + p * NR : 0;                                                                \
            for (int64_t r = 0, g = 0; r < m; r += step, g++) {                                                       \
                int64_t rows = m - r < step ? m - r : step;                                                           \
                const float *res = residual ? residual + r * n + p * NR : 0;                                          \
                if (groups > 1 && p + 1 < last)                                                                       \
                    SPREADING##NAME[rows](x + r * k, k, w, k, out + r * n + p * NR, n, cols, b, res,                  \
                                          w + k * NR + g * share * NR, groups);                                       \
                else                                                                                                  \
                    (r == 0 && (p == first || groups == 1) ? FROM_MEMORY##NAME : FROM_CACHE##NAME)[rows](             \
                        x + r * k, k, w, k, out + r * n + p * NR, n, cols, b, res);                                   \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    /* one block of rows over every panel, the panels shared among `threads` threads */                             \
    static void block##NAME(const float *x, int64_t m, int64_t k, const W *packed, int64_t n, const float *bias,      \
                            const float *residual, float *out, int64_t threads) {                                     \
        struct block a = {x, m, k, packed, n, bias, residual, out};                                                   \
        over_panels(panels##NAME, &a, (n + NR - 1) / NR, threads);                                                    \
    }                                                                                                                 \
    /* x: [m][k] contiguous; packed: the pack's layout of an [n][k] weight; bias: [n] or NULL; out: [m][n]. */       \
    void ead_rows_linear##NAME(const float *x, int64_t m, int64_t k, const W *packed, int64_t n, const float *bias,  \
                               float *out, int64_t threads) {                                                         \
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK)                                                                 \
            block##NAME(x + r0 * k, m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK, k, packed, n, bias, 0, out + r0 * n,     \
                        threads);                                                                                     \
    }                                                                                                                 \
    /* A projection with the work around it, block by block of rows (one call instead of a dozen small operations): \
     * the input is x's rows RMS-normalised (norm: the norm's weight) or, with gated, x's rows [gate | up] of 2k    \
     * as silu(gate) * up; residual ([m][n] or NULL) is added to the output; rotary (cos, sin: [m][dim], sin with  \
     * its first half negated) turns the first rotary_heads heads of dim outputs of each row. Returns 0, or -1     \
     * when it could not allocate its scratch (nothing written). */                                                  \
    int64_t ead_rows_fused##NAME(const float *x, int64_t m, int64_t k, const float *norm, float eps, int64_t gated,  \
                                 const W *packed, int64_t n, const float *bias, const float *residual, float *out,    \
                                 const float *cos, const float *sin, int64_t rotary_heads, int64_t dim,               \
                                 int64_t threads) {                                                                   \
        float *scratch = 0;                                                                                           \
        if (norm || gated) {                                                                                          \
            scratch = (float *)malloc((size_t)(m < ROW_BLOCK ? m : ROW_BLOCK) * (size_t)k * sizeof(float));           \
            if (!scratch) return -1;                                                                                  \
        }                                                                                                             \
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {                                                               \
            int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;                                                   \
            const float *in = x + r0 * k;                                                                             \
            if (norm) {                                                                                               \
                for (int64_t r = 0; r < rows; r++) rms_norm_row(x + (r0 + r) * k, k, norm, eps, scratch + r * k);     \
                in = scratch;                                                                                         \
            } else if (gated) {                                                                                       \
                for (int64_t r = 0; r < rows; r++) silu_gate_row(x + (r0 + r) * 2 * k, k, scratch + r * k);          \
                in = scratch;                                                                                         \
            }                                                                                                         \
            block##NAME(in, rows, k, packed, n, bias, residual ? residual + r0 * n : 0, out + r0 * n, threads);       \
            if (cos)                                                                                                  \
                for (int64_t r = r0; r < r0 + rows; r++) rotate_row(out + r * n, rotary_heads, dim, cos + r * dim,     \
                                                                    sin + r * dim);                                   \
        }                                                                                                             \
        free(scratch);                                                                                                \
        return 0;                                                                                                     \
    }
KERNELS(, float, LOAD_AT, 4)
KERNELS(_bf16, uint16_t, WIDEN, 1)

/* ---- attention where the paged cache holds the keys ---------------------------------------------------------- */

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = lanes_sum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* lanes_sum of eight vectors at once, as one vector: lane r is lanes_sum(v[r]), the same tree on the same values (the
 * eight vectors transposed, then added as lanes_sum adds its lanes) */
static inline __m256 lanes_sums8(const __m256 v[8]) {
    const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    /* lane i of every vector, for i = 0..7 (t4..t7 from the upper halves) */
    const __m256 t0 = _mm256_permute2f128_ps(b0, b4, 0x20), t4 = _mm256_permute2f128_ps(b0, b4, 0x31);
    const __m256 t1 = _mm256_permute2f128_ps(b1, b5, 0x20), t5 = _mm256_permute2f128_ps(b1, b5, 0x31);
    const __m256 t2 = _mm256_permute2f128_ps(b2, b6, 0x20), t6 = _mm256_permute2f128_ps(b2, b6, 0x31);
    const __m256 t3 = _mm256_permute2f128_ps(b3, b7, 0x20), t7 = _mm256_permute2f128_ps(b3, b7, 0x31);
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t0, t4), _mm256_add_ps(t1, t5)),
                         _mm256_add_ps(_mm256_add_ps(t2, t6), _mm256_add_ps(t3, t7)));
}

/* scores[j] = dot(query, the key at slots[j], dim) * scale for j < count: eight keys at a time, each key's dot the
 * one chain dot() computes (eight lanes over dim in order, the lanes in lanes_sum's tree, the tail after them), so
 * the same bits; the eight chains run side by side instead of one after another. Returns the largest score. */
static float key_scores(const float *query, const float *keys, const int64_t *slots, int64_t count, int64_t dim,
                        float scale, float *scores) {
    float best = -INFINITY;
    const int64_t whole = dim - dim % 8;
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        const float *k[8];
        __m256 acc[8];
        for (int r = 0; r < 8; r++) k[r] = keys + slots[j + r] * dim, acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < whole; i += 8) {
            const __m256 qv = _mm256_loadu_ps(query + i);
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[r] + i), acc[r]);
        }
        float sums[8];
        _mm256_storeu_ps(sums, lanes_sums8(acc));
        for (int r = 0; r < 8; r++) {
            float sum = sums[r];
            for (int64_t i = whole; i < dim; i++) sum += query[i] * k[r][i];
            scores[j + r] = sum * scale;
            best = scores[j + r] > best ? scores[j + r] : best;
        }
    }
    for (; j < count; j++) {
        scores[j] = dot(query, keys + slots[j] * dim, dim) * scale;
        best = scores[j] > best ? scores[j] : best;
    }
    return best;
}

/* o = sum over j < count of scores[j] * (the value at slots[j]), divided by sum: each output one chain over j in
 * order, as before, but C vectors of outputs (8 * C of dim) side by side, so C chains run at once. */
#define VALUE_CHAINS(C)                                                                                               \
    static void value_chains##C(const float *scores, const float *values, const int64_t *slots, int64_t count,       \
                                int64_t dim, float sum, float *o) {                                                   \
        __m256 acc[C];                                                                                                \
        for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();                                                     \
        for (int64_t j = 0; j < count; j++) {                                                                         \
            const __m256 s = _mm256_set1_ps(scores[j]);                                                               \
            const float *v = values + slots[j] * dim;                                                                 \
            for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(s, _mm256_loadu_ps(v + 8 * c), acc[c]);             \
        }                                                                                                             \
        const __m256 by = _mm256_set1_ps(sum);                                                                        \
        for (int c = 0; c < C; c++) _mm256_storeu_ps(o + 8 * c, _mm256_div_ps(acc[c], by));                           \
    }
VALUE_CHAINS(8)
VALUE_CHAINS(4)
VALUE_CHAINS(2)
VALUE_CHAINS(1)

static void weighted_values(const float *scores, const float *values, const int64_t *slots, int64_t count,
                            int64_t dim, float sum, float *o) {
    int64_t i = 0;
    for (; i + 64 <= dim; i += 64) value_chains8(scores, values + i, slots, count, dim, sum, o + i);
    if (i + 32 <= dim) value_chains4(scores, values + i, slots, count, dim, sum, o + i), i += 32;
    if (i + 16 <= dim) value_chains2(scores, values + i, slots, count, dim, sum, o + i), i += 16;
    if (i + 8 <= dim) value_chains1(scores, values + i, slots, count, dim, sum, o + i), i += 8;
    for (; i < dim; i++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < count; j++) acc += scores[j] * values[slots[j] * dim + i];
        o[i] = acc / sum;
    }
}

/* exp(x - shift) of n values in place (eight lanes at a time, the tail padded), and their sum in a fixed order: the
 * vectors added in turn, then their lanes in lanes_sum's tree. Four vectors' exponentials run side by side (exp8's
 * polynomial is a chain of dependent steps); each value takes the same operations either way. */
static float exp_shifted(float *x, int64_t n, float shift) {
    const __m256 by = _mm256_set1_ps(shift);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), by));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), by));
        const __m256 e2 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 16), by));
        const __m256 e3 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 24), by));
        _mm256_storeu_ps(x + i, e0);
        _mm256_storeu_ps(x + i + 8, e1);
        _mm256_storeu_ps(x + i + 16, e2);
        _mm256_storeu_ps(x + i + 24, e3);
        total = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(total, e0), e1), e2), e3);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), by));
        _mm256_storeu_ps(x + i, e);
        total = _mm256_add_ps(total, e);
    }
    if (i < n) {
        float v[8], r[8];
        const int64_t count = n - i;
        for (int64_t j = 0; j < 8; j++) v[j] = j < count ? x[i + j] : -INFINITY;
        _mm256_storeu_ps(r, exp8(_mm256_sub_ps(_mm256_loadu_ps(v), by)));
        for (int64_t j = count; j < 8; j++) r[j] = 0.0f; /* exp8 clamps, so -inf would not give 0 */
        total = _mm256_add_ps(total, _mm256_loadu_ps(r));
        memcpy(x + i, r, (size_t)count * sizeof(float));
    }
    return lanes_sum(total);
}

/* Each query token's attention over its own row's keys, read where the paged cache holds them (no copy).
 * q: token t, head h at q + t * q_token + h * q_head (dim floats); keys, values: one layer's storage [kv_heads]
 * [capacity][dim]; meta [tokens][3]: the offset of the token's row table in tables, the positions it sees (0..n-1,
 * slot table[p / block] * block + p % block), and a slot read after them (a sibling's own keys) or -1. out:
 * [tokens][heads][dim]. Every token's numbers depend on its query and its keys alone, in a fixed order (the scores,
 * their softmax, then the values summed in position order): the same bits in any pass, whatever else it holds, and
 * a verified draft gets the bits its decode step would. Returns 0; -1 when the scratch could not be allocated; -2,
 * reading nothing, when a query's table runs past the tables (table_count entries) or names a slot past the
 * storage (a cache cleared under a pass): a bad table never reads outside the storage. */
int64_t ead_attend(const float *q, int64_t q_token, int64_t q_head, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t dim, const float *keys, const float *values, int64_t capacity, int64_t block,
                   const int64_t *tables, int64_t table_count, const int64_t *meta, float scale, float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t at = meta[3 * t], n = meta[3 * t + 1], own = meta[3 * t + 2];
        if (at < 0 || n < 0 || own >= capacity || (n > 0 && at + (n - 1) / block >= table_count)) return -2;
        for (int64_t b = 0; b * block < n; b++)
            if (tables[at + b] < 0 || (tables[at + b] + 1) * block > capacity) return -2;
    }
    int64_t most = 1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t count = meta[3 * t + 1] + (meta[3 * t + 2] >= 0);
        most = count > most ? count : most;
    }
    float *scores = (float *)malloc((size_t)most * sizeof(float));
    int64_t *slots = (int64_t *)malloc((size_t)most * sizeof(int64_t));
    if (!scores || !slots) {
        free(scores);
        free(slots);
        return -1;
    }
    const int64_t group = heads / kv_heads;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *table = tables + meta[3 * t];
        const int64_t n = meta[3 * t + 1], own = meta[3 * t + 2];
        const int64_t count = n + (own >= 0);
        for (int64_t p = 0, b = 0; p < n; b++) /* slot table[p / block] * block + p % block, without dividing */
            for (int64_t o = 0; o < block && p < n; o++, p++) slots[p] = table[b] * block + o;
        if (own >= 0) slots[n] = own;
        for (int64_t h = 0; h < heads; h++) {
            const float *query = q + t * q_token + h * q_head;
            const float *k = keys + (h / group) * capacity * dim, *v = values + (h / group) * capacity * dim;
            const float best = key_scores(query, k, slots, count, dim, scale, scores);
            const float sum = exp_shifted(scores, count, best);
            weighted_values(scores, v, slots, count, dim, sum, out + (t * heads + h) * dim);
        }
    }
    free(scores);
    free(slots);
    return 0;
}

/* ---- a model's decoder layers in one call ---------------------------------------------------------------------- */

/* One Llama decoder layer as ead_layers reads it: its norms, its four projections packed by ead_rows_pack (qkv: q, k
 * and v side by side; gate_up: gate and up side by side), their biases or NULL, and its MLP's width. */
struct ead_layer {
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t intermediate;
};

/* `count` decoder layers over x [m][hidden] (replaced by the last layer's output) for m tokens that each attend as a
 * decode step at their own position (ead_attend's tables and meta). Each layer is the calls the engine otherwise
 * makes one at a time, in the same order on the same values: q, k and v through ead_rows_fused (the input norm, cos
 * and sin [m][dim], sin's first half negated, turning q's and k's heads), the keys and values copied to `slots` [m] of
 * the layer's cache storage (keys[l], values[l]: [kv_heads][capacity][dim]), ead_attend, then o, gate and up, and down
 * through ead_rows_fused. So every token gets the same bits either way, without a return to Python between them.
 * Returns 0; -1 when a scratch could not be allocated; -2 when a slot lies outside the storage (nothing written) or
 * a query's table is bad (ead_attend's check: that layer's keys and values are written by then, as one call at a
 * time would have written them). */
int64_t ead_layers(const struct ead_layer *layers, int64_t count, float *const *keys, float *const *values, float *x,
                   int64_t m, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                   const float *sin, const int64_t *slots, int64_t capacity, int64_t block, const int64_t *tables,
                   int64_t table_count, const int64_t *meta, float scale, int64_t threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, turned = heads + kv_heads, attended = heads * dim;
    for (int64_t t = 0; t < m; t++)
        if (slots[t] < 0 || slots[t] >= capacity) return -2;
    int64_t widest = 0;
    for (int64_t l = 0; l < count; l++) widest = layers[l].intermediate > widest ? layers[l].intermediate : widest;
    float *qkv = (float *)malloc((size_t)(m * width) * sizeof(float));
    float *heard = (float *)malloc((size_t)(m * attended) * sizeof(float));
    float *mid = (float *)malloc((size_t)(m * hidden) * sizeof(float));
    float *other = (float *)malloc((size_t)(m * hidden) * sizeof(float));
    float *gate_up = (float *)malloc((size_t)(m * 2 * widest) * sizeof(float));
    int64_t status = qkv && heard && mid && other && gate_up ? 0 : -1;
    float *cur = x;
    for (int64_t l = 0; l < count && !status; l++) {
        const struct ead_layer *L = layers + l;
        float *next = cur == x ? other : x;
        status = ead_rows_fused(cur, m, hidden, L->input_norm, L->input_eps, 0, L->qkv, width, L->qkv_bias, 0, qkv,
                                cos, sin, turned, dim, threads);
        if (status) break;
        for (int64_t t = 0; t < m; t++)
            for (int64_t h = 0; h < kv_heads; h++) {
                const float *row = qkv + t * width + (heads + h) * dim;
                memcpy(keys[l] + (h * capacity + slots[t]) * dim, row, (size_t)dim * sizeof(float));
                memcpy(values[l] + (h * capacity + slots[t]) * dim, row + kv_heads * dim,
                       (size_t)dim * sizeof(float));
            }
        status = ead_attend(qkv, width, dim, m, heads, kv_heads, dim, keys[l], values[l], capacity, block, tables,
                            table_count, meta, scale, heard);
        if (status) break;
        status =
            ead_rows_fused(heard, m, attended, 0, 0.0f, 0, L->o, hidden, L->o_bias, cur, mid, 0, 0, 0, 0, threads);
        if (!status)
            status = ead_rows_fused(mid, m, hidden, L->post_norm, L->post_eps, 0, L->gate_up, 2 * L->intermediate,
                                    L->gate_up_bias, 0, gate_up, 0, 0, 0, 0, threads);
        if (!status)
            status = ead_rows_fused(gate_up, m, L->intermediate, 0, 0.0f, 1, L->down, hidden, L->down_bias, mid, next,
                                    0, 0, 0, 0, threads);
        cur = next;
    }
    if (!status && cur != x) memcpy(x, cur, (size_t)(m * hidden) * sizeof(float));
    free(qkv);
    free(heard);
    free(mid);
    free(other);
    free(gate_up);
    return status;
}

/* Per row of x [rows][stride] (vocab values each): the Shannon entropy in bits of softmax(row), and the row's most
 * likely id (the lowest among equal maxima), each output optional (NULL). -inf values count as probability 0. A row
 * that holds a NaN or +inf, or nothing above -inf, gets a NaN entropy and an id of -1: the caller works those out
 * its own way. Every row's numbers depend on that row alone, in a fixed order: the sums of exp(x - max) and of
 * (x - max) * exp(x - max) in eight lanes over blocks of 512 values, each block's lanes added into doubles. */
void ead_row_stats(const float *x, int64_t rows, int64_t vocab, int64_t stride, float *entropy, int64_t *best) {
    const __m256 floor = _mm256_set1_ps(-87.0f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        __m256 top = _mm256_set1_ps(-INFINITY), odd = zero; /* odd: lanes that met a NaN or +inf */
        int64_t i = 0;
        for (; i + 8 <= vocab; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
            top = _mm256_max_ps(top, v);
        }
        float most = -INFINITY;
        int bad = _mm256_movemask_ps(odd) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int j = 0; j < 8; j++) most = lanes[j] > most ? lanes[j] : most;
        for (; i < vocab; i++) {
            bad |= isnan(row[i]) || row[i] == INFINITY;
            most = row[i] > most ? row[i] : most;
        }
        if (bad || most == -INFINITY) {
            if (entropy) entropy[r] = NAN;
            if (best) best[r] = -1;
            continue;
        }
        if (best) {
            const __m256 m = _mm256_set1_ps(most);
            int64_t at = -1;
            for (i = 0; i + 8 <= vocab && at < 0; i += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), m, _CMP_EQ_OQ));
                if (hit) at = i + __builtin_ctz((unsigned)hit);
            }
            for (; i < vocab && at < 0; i++)
                if (row[i] == most) at = i;
            best[r] = at;
        }
        if (!entropy) continue;
        const __m256 shift = _mm256_set1_ps(most);
        double mass = 0.0, weighted = 0.0;
        for (i = 0; i < vocab;) {
            __m256 s = zero, t = zero;
            const int64_t end = vocab - i > 512 ? i + 512 : vocab;
            for (; i < end; i += 8) {
                __m256 d;
                if (end - i >= 8) {
                    d = _mm256_sub_ps(_mm256_loadu_ps(row + i), shift);
                } else { /* the row's last values, padded with -inf */
                    float v[8];
                    for (int64_t j = 0; j < 8; j++) v[j] = j < end - i ? row[i + j] : -INFINITY;
                    d = _mm256_sub_ps(_mm256_loadu_ps(v), shift);
                }
                const __m256 keep = _mm256_cmp_ps(d, floor, _CMP_GE_OQ); /* exp(-87) and below add nothing */
                const __m256 e = _mm256_and_ps(exp8(d), keep);
                s = _mm256_add_ps(s, e);
                t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_and_ps(d, keep), e));
            }
            mass += (double)lanes_sum(s);
            weighted += (double)lanes_sum(t);
        }
        const double nats = log(mass) - weighted / mass;
        entropy[r] = (float)(nats > 0.0 ? nats * 1.4426950408889634 : 0.0);
    }
}

/* One digit of the nucleus search: from a histogram of mass per digit (bins of them, most likely first), the first
 * digit at which the mass counted from *before reaches threshold (the last digit with mass where rounding leaves the
 * row's total short of it); *before gains the mass of the digits ahead of it. */
static int64_t next_digit(const double *hist, int64_t bins, double *before, double threshold) {
    int64_t first = 0, last = 0;
    double cum = 0.0, ahead = 0.0;
    for (int64_t d = 0; d < bins; d++)
        if (hist[d] > 0.0) last = d;
    for (first = 0; first < bins; first++) {
        cum += hist[first];
        if (!(*before + cum < threshold)) break;
        ahead = cum;
    }
    if (first > last) { /* the sums fell short by rounding: the last digit with mass, all ahead of it */
        first = last;
        ahead = 0.0;
        for (int64_t d = 0; d < last; d++) ahead += hist[d];
    }
    *before += ahead;
    return first;
}

/* Per row of scaled [rows][stride] (vocab values at most 0, temperature applied, the maximum at 0): the nucleus
 * floor, as ops.nucleus_by_digits finds it: the value v whose strictly larger values weigh less than
 * top_p * (1 - rtol) of the kept mass while those at or above it reach it, found a digit of its magnitude bits at a
 * time (13, 9, 9 bits) from float64 histograms of exp(value). It
 * writes v to floor_out (-inf where top_p >= 1). With u (a uniform per row), it also draws token_out
 * by inverse CDF over the kept values' weights in token-id order: the first token whose cumulative weight exceeds u
 * times their total (blocks of 512 summed in eight lanes, the blocks and the tokens of the block the draw falls in
 * added in float64; the block's last kept token where rounding runs past its end). The weights are exp8's, zero
 * below -87 (float32's exp there is below 1e-37 of the maximum's). Every row's numbers
 * depend on that row alone. A row holding a NaN or a value above 0, or no weight, gets a NaN floor and token -1
 * (the caller works it out its own way). Returns 0, or -1 when the scratch could not be allocated. */
int64_t ead_nucleus(const float *scaled, int64_t rows, int64_t vocab, int64_t stride, const float *top_p, double rtol,
                    const double *u, float *floor_out, int64_t *token_out) {
    float *weights = (float *)malloc((size_t)vocab * sizeof(float));
    uint32_t *keys = (uint32_t *)malloc((size_t)vocab * sizeof(uint32_t));
    float *mass = (float *)malloc((size_t)vocab * sizeof(float));
    double *hist = (double *)malloc((size_t)8192 * sizeof(double));
    double *block_mass = (double *)malloc((size_t)((vocab + 511) / 512 + 1) * sizeof(double));
    if (!weights || !keys || !mass || !hist || !block_mass) {
        free(weights);
        free(keys);
        free(mass);
        free(hist);
        free(block_mass);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *row = scaled + r * stride;
        double total = 0.0;
        int odd = 0; /* a NaN or a value above 0 */
        const __m256 least = _mm256_set1_ps(-87.0f), zero = _mm256_setzero_ps();
        __m256 bad = zero;
        int64_t i = 0;
        while (i + 8 <= vocab) { /* weights in eight lanes, summed over blocks of 512 into a double */
            __m256 sum = zero;
            const int64_t end = vocab - i >= 512 ? i + 512 : i + (vocab - i) / 8 * 8;
            for (; i < end; i += 8) {
                const __m256 v = _mm256_loadu_ps(row + i);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, zero, _CMP_NLE_UQ));
                const __m256 w = _mm256_and_ps(exp8(v), _mm256_cmp_ps(v, least, _CMP_GE_OQ));
                _mm256_storeu_ps(weights + i, w);
                sum = _mm256_add_ps(sum, w);
            }
            total += (double)lanes_sum(sum);
        }
        odd = _mm256_movemask_ps(bad) != 0;
        for (; i < vocab; i++) {
            odd |= !(row[i] <= 0.0f);
            weights[i] = row[i] >= -87.0f ? expf(row[i]) : 0.0f;
            total += (double)weights[i];
        }
        if (odd || !(total > 0.0)) { /* the caller works such a row out its own way */
            floor_out[r] = NAN;
            if (token_out) token_out[r] = -1;
            continue;
        }
        float floor = -INFINITY;
        if (top_p[r] < 1.0f) {
            const double threshold = (double)top_p[r] * total * (1.0 - rtol);
            double before = 0.0;
            memset(hist, 0, 8192 * sizeof(double));
            for (int64_t i = 0; i < vocab; i++)
                if (weights[i] > 0.0f) {
                    uint32_t bits;
                    memcpy(&bits, row + i, sizeof(bits));
                    hist[(bits & 0x7FFFFFFFu) >> 18] += (double)weights[i];
                }
            uint32_t prefix = (uint32_t)next_digit(hist, 8192, &before, threshold);
            int64_t count = 0; /* the values that share the digits found so far */
            for (int64_t i = 0; i < vocab; i++)
                if (weights[i] > 0.0f) {
                    uint32_t bits;
                    memcpy(&bits, row + i, sizeof(bits));
                    bits &= 0x7FFFFFFFu;
                    if (bits >> 18 == prefix) {
                        keys[count] = bits;
                        mass[count++] = weights[i];
                    }
                }
            for (int shift = 9; shift >= 0; shift -= 9) {
                memset(hist, 0, 512 * sizeof(double));
                for (int64_t j = 0; j < count; j++)
                    if (keys[j] >> (shift + 9) == prefix) hist[(keys[j] >> shift) & 511] += (double)mass[j];
                prefix = (prefix << 9) | (uint32_t)next_digit(hist, 512, &before, threshold);
            }
            float edge;
            memcpy(&edge, &prefix, sizeof(edge));
            floor = -edge;
        }
        floor_out[r] = floor;
        if (!u || !token_out) continue;
        /* the kept weights summed per block of 512 (eight lanes each, into doubles), the block where u times their
         * total falls, then the token inside it (its last kept token where rounding runs past the block's end) */
        const __m256 edge = _mm256_set1_ps(floor);
        const int64_t blocks = (vocab + 511) / 512;
        double kept = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * 512, end = start + 512 < vocab ? start + 512 : vocab;
            __m256 sum = _mm256_setzero_ps();
            int64_t i = start;
            for (; i + 8 <= end; i += 8) {
                const __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(row + i), edge, _CMP_GE_OQ);
                sum = _mm256_add_ps(sum, _mm256_and_ps(_mm256_loadu_ps(weights + i), keep));
            }
            double part = (double)lanes_sum(sum);
            for (; i < end; i++)
                if (row[i] >= floor) part += (double)weights[i];
            block_mass[b] = part;
            kept += part;
        }
        const double target = u[r] * kept;
        double cum = 0.0;
        int64_t block = blocks - 1;
        for (int64_t b = 0; b < blocks; b++) {
            if (block_mass[b] > 0.0) block = b; /* the last block with mass, where the sums run past the end */
            if (cum + block_mass[b] > target && block_mass[b] > 0.0) {
                block = b;
                break;
            }
            cum += block_mass[b];
        }
        if (!(cum + block_mass[block] > target)) cum = target - block_mass[block]; /* rounding: its last token */
        const int64_t start = block * 512, end = start + 512 < vocab ? start + 512 : vocab;
        int64_t token = -1;
        for (int64_t i = start; i < end; i++)
            if (row[i] >= floor && weights[i] > 0.0f) {
                token = i;
                cum += (double)weights[i];
                if (cum > target) break;
            }
        token_out[r] = token;
    }
    free(weights);
    free(keys);
    free(mass);
    free(hist);
    free(block_mass);
    return 0;
}

/* npud host GEMM kernels: batch-invariant by construction (see kernels/host/native.py).
 *
 * Every output element y[m, n] is one chain of operations that depends on row m alone:
 *   float path:   acc = 0; for k = 0..K-1: acc = fma(x[m,k], w[n,k], acc)   (one rounding each)
 *   q8 path:      acc = 0; for block b: acc = fma((float) isum_b, xs[m,b], acc), isum_b an exact
 *                 integer dot product of the row's int8 block with the weights
 *   then y = acc * scale[n] (if any), then y = y + bias[n] (if any), each rounded.
 * Vector lanes run across output columns, never across k. Rows are blocked in registers,
 * columns in tiles of 64, k in chunks, threads take ranges of tiles: none of that changes
 * any element's chain, so every ISA path below gives the same bits as the generic C one.
 * Compile with -ffp-contract=off and without -ffast-math: the only FMAs are explicit.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64
#define QB 32           /* activation quantization block (llama.cpp's q8_0 block) */
#define KC 256          /* k rows per chunk when several row blocks share a weight tile (q8) */
#define MAXR 6          /* rows held in registers at once (AVX-512 float: 6 x 4 accumulators) */
#define MAXR_Q8 3       /* q8: an int32 and a float accumulator per column vector */
#define PF_BYTES 1024   /* software prefetch distance in the weight stream */
#define MAX_THREADS 64
/* pause instructions (tens of microseconds) a worker spins for the next call before it sleeps:
 * enough to bridge the Python between the GEMMs of a layer, short enough not to hold a core
 * that the machine's other processes (or numba's threads) want */
#define SPIN_WAIT 2000

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_I8 = 2, FMT_Q8 = 3 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3 };

typedef struct {
    int fmt;
    long M, K;               /* K: the float path's k; for q8 the padded Kp (multiple of QB) */
    const float *x;          /* [K, M]: the activations transposed, so a row block's values at one k
                                are adjacent (rows of x lie a multiple of 4 KiB apart, which maps
                                them onto the same L1 sets) */
    const void *w;           /* float path [ntiles, K, TILE]; q8 [ntiles, Kp/4, TILE, 4] uint8 (w + 128) */
    long ntiles, N;
    const float *scale;      /* [N] or NULL */
    const float *bias;       /* [N] or NULL */
    float *out;              /* [M, ntiles * TILE] */
    const int8_t *xq;        /* q8: [M, Kp] */
    const float *xs;         /* q8: [M, Kp / QB] */
    const int32_t *xsum;     /* q8: [M, Kp / QB], sum of each block's int8 values */
} job_t;

static int isa_best = -1;
static int isa_used = -1;

/* ------------------------------------------------------------------ row blocks */

/* Row blocks of near-equal size, each at most maxr rows: block i starts at *r0 and has *rn rows. */
static void row_block(long M, int maxr, long i, long nblocks, long *r0, long *rn) {
    long base = M / nblocks, extra = M % nblocks;
    *r0 = i * base + (i < extra ? i : extra);
    *rn = base + (i < extra ? 1 : 0);
}

static inline __attribute__((always_inline)) float store_value(const job_t *j, float v, long n) {
    if (n < j->N) {
        if (j->scale) v = v * j->scale[n];
        if (j->bias) v = v + j->bias[n];
    }
    return v;
}

/* ------------------------------------------------------------------ generic C (and its AVX2 build) */

static inline __attribute__((always_inline)) float widen1(int fmt, const void *w, long i) {
    if (fmt == FMT_F32) return ((const float *)w)[i];
    if (fmt == FMT_BF16) {
        uint32_t b = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    return (float)((const int8_t *)w)[i];
}

static inline __attribute__((always_inline)) size_t elem_size(int fmt) {
    return fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
}

static inline __attribute__((always_inline)) void gen_float_block(int fmt, const job_t *j, long t, long r0, long R,
                                                                  long k0, long k1) {
    const long ldo = j->ntiles * TILE, K = j->K;
    const char *wt = (const char *)j->w + (size_t)t * K * TILE * elem_size(fmt);
    float acc[MAXR][TILE];
    float wv[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = k0 == 0 ? 0.0f : j->out[(r0 + r) * ldo + t * TILE + c];
    for (long k = k0; k < k1; k++) {
        for (int c = 0; c < TILE; c++) wv[c] = widen1(fmt, wt, k * TILE + c);
        for (long r = 0; r < R; r++) {
            const float xv = j->x[k * j->M + r0 + r];
            for (int c = 0; c < TILE; c++) acc[r][c] = fmaf(xv, wv[c], acc[r][c]);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            j->out[(r0 + r) * ldo + t * TILE + c] = k1 == K ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

static inline __attribute__((always_inline)) void gen_q8_block(const job_t *j, long t, long r0, long R, long b0,
                                                               long b1) {
    const long ldo = j->ntiles * TILE, Kp = j->K, nb = Kp / QB;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * Kp * TILE;
    float acc[MAXR_Q8][TILE];
    int32_t isum[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = b0 == 0 ? 0.0f : j->out[(r0 + r) * ldo + t * TILE + c];
    for (long b = b0; b < b1; b++) {
        for (long r = 0; r < R; r++) {
            const int8_t *xq = j->xq + (r0 + r) * Kp + b * QB;
            for (int c = 0; c < TILE; c++) isum[c] = 0;
            for (int k4 = 0; k4 < QB / 4; k4++) {
                const uint8_t *wp = wt + ((size_t)b * (QB / 4) + k4) * TILE * 4;
                for (int c = 0; c < TILE; c++)
                    for (int i = 0; i < 4; i++) isum[c] += (int32_t)xq[k4 * 4 + i] * ((int32_t)wp[c * 4 + i] - 128);
            }
            const float s = j->xs[(r0 + r) * nb + b];
            for (int c = 0; c < TILE; c++) acc[r][c] = fmaf((float)isum[c], s, acc[r][c]);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            j->out[(r0 + r) * ldo + t * TILE + c] = b1 == nb ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

/* One tile of output columns for every row: row blocks of at most maxr rows; when there are
 * several, k goes in chunks so the chunk of the weight tile stays in cache across them. */
#define TILE_DRIVER(NAME, ATTR, BLOCK_FLOAT, BLOCK_Q8, MAXR_F)                                          \
    ATTR static void NAME(const job_t *j, long t) {                                                  \
        const int q8 = j->fmt == FMT_Q8;                                                             \
        const int maxr = q8 ? MAXR_Q8 : (MAXR_F);                                                    \
        const long nblocks = (j->M + maxr - 1) / maxr;                                               \
        const long steps = q8 ? j->K / QB : j->K;                                                    \
        /* float: the chunk of x for all rows (kc * M * 4 bytes) and of the tile stay in L1 */        \
        const long kc = j->M <= 16 ? 256 : j->M <= 32 ? 128 : 64;                                    \
        const long chunk = nblocks == 1 ? steps : (q8 ? KC / QB : kc);                               \
        for (long s0 = 0; s0 < steps; s0 += chunk) {                                                 \
            const long s1 = s0 + chunk < steps ? s0 + chunk : steps;                                 \
            for (long i = 0; i < nblocks; i++) {                                                     \
                long r0, rn;                                                                         \
                row_block(j->M, maxr, i, nblocks, &r0, &rn);                                         \
                switch (j->fmt) {                                                                    \
                case FMT_F32: BLOCK_FLOAT(FMT_F32, j, t, r0, rn, s0, s1); break;                     \
                case FMT_BF16: BLOCK_FLOAT(FMT_BF16, j, t, r0, rn, s0, s1); break;                   \
                case FMT_I8: BLOCK_FLOAT(FMT_I8, j, t, r0, rn, s0, s1); break;                       \
                default: BLOCK_Q8(j, t, r0, rn, s0, s1); break;                                      \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

TILE_DRIVER(tile_generic, __attribute__((noinline)), gen_float_block, gen_q8_block, MAXR)
TILE_DRIVER(tile_avx2, __attribute__((noinline, target("avx2,fma"))), gen_float_block, gen_q8_block, 2)

/* ------------------------------------------------------------------ AVX-512 */

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

static inline __attribute__((always_inline)) T512 __m512 widen16(int fmt, const char *w, long i) {
    if (fmt == FMT_F32) return _mm512_loadu_ps((const float *)w + i);
    if (fmt == FMT_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
}

static inline __attribute__((always_inline)) T512 void store16(const job_t *j, float *o, __m512 v, long n, int last) {
    if (last) {
        const long left = j->N - n;
        const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        if (j->scale) v = _mm512_mask_mul_ps(v, live, v, _mm512_maskz_loadu_ps(live, j->scale + n));
        if (j->bias) v = _mm512_mask_add_ps(v, live, v, _mm512_maskz_loadu_ps(live, j->bias + n));
    }
    _mm512_storeu_ps(o, v);
}

/* R rows x 64 columns in 4R zmm accumulators for k in [k0, k1); each weight vector is loaded
 * and widened once per k and used for all R rows. */
static inline __attribute__((always_inline)) T512 void avx512_rows(int fmt, const int R, const job_t *j, long t,
                                                                   long r0, long k0, long k1) {
    const long ldo = j->ntiles * TILE, K = j->K;
    const size_t es = elem_size(fmt);
    const char *wt = (const char *)j->w + (size_t)t * K * TILE * es;
    const float *x = j->x + r0;
    const long M = j->M;
    float *o = j->out + r0 * ldo + t * TILE;
    __m512 acc[MAXR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * v);
    for (long k = k0; k < k1; k++) {
        const char *row = wt + (size_t)k * TILE * es;
        _mm_prefetch(row + PF_BYTES, _MM_HINT_T0);
        if (es >= 2) _mm_prefetch(row + PF_BYTES + 64, _MM_HINT_T0);
        if (es == 4) {
            _mm_prefetch(row + PF_BYTES + 128, _MM_HINT_T0);
            _mm_prefetch(row + PF_BYTES + 192, _MM_HINT_T0);
        }
        const __m512 w0 = widen16(fmt, wt, k * TILE), w1 = widen16(fmt, wt, k * TILE + 16);
        const __m512 w2 = widen16(fmt, wt, k * TILE + 32), w3 = widen16(fmt, wt, k * TILE + 48);
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[k * M + r]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) store16(j, o + r * ldo + 16 * v, acc[r][v], t * TILE + 16 * v, k1 == K);
}

static inline __attribute__((always_inline)) T512 void avx512_float_block(int fmt, const job_t *j, long t, long r0,
                                                                          long R, long k0, long k1) {
    switch (R) {
    case 1: avx512_rows(fmt, 1, j, t, r0, k0, k1); break;
    case 2: avx512_rows(fmt, 2, j, t, r0, k0, k1); break;
    case 3: avx512_rows(fmt, 3, j, t, r0, k0, k1); break;
    case 4: avx512_rows(fmt, 4, j, t, r0, k0, k1); break;
    case 5: avx512_rows(fmt, 5, j, t, r0, k0, k1); break;
    default: avx512_rows(fmt, 6, j, t, r0, k0, k1); break;
    }
}

/* q8 with VNNI: vpdpbusd multiplies the weights' unsigned bytes (w + 128) by the row's signed
 * bytes in groups of 4 k; starting each block's int32 sum at -128 * sum(x block) makes it the
 * exact sum of x * w. The block sum then enters the float accumulator by one FMA. */
static inline __attribute__((always_inline)) TVNNI void vnni_rows(const int R, const job_t *j, long t, long r0,
                                                                  long b0, long b1) {
    const long ldo = j->ntiles * TILE, Kp = j->K, nb = Kp / QB;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * Kp * TILE;
    float *o = j->out + r0 * ldo + t * TILE;
    __m512 acc[MAXR_Q8][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * v);
    for (long b = b0; b < b1; b++) {
        __m512i isum[MAXR_Q8][4];
        for (int r = 0; r < R; r++) {
            const __m512i init = _mm512_set1_epi32(-128 * j->xsum[(r0 + r) * nb + b]);
            for (int v = 0; v < 4; v++) isum[r][v] = init;
        }
        for (int k4 = 0; k4 < QB / 4; k4++) {
            const uint8_t *wp = wt + ((size_t)b * (QB / 4) + k4) * TILE * 4;
            _mm_prefetch((const char *)wp + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)wp + PF_BYTES + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)wp + PF_BYTES + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)wp + PF_BYTES + 192, _MM_HINT_T0);
            const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
            const __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, j->xq + (r0 + r) * Kp + b * QB + k4 * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xb);
                isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xb);
                isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w2, xb);
                isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w3, xb);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(j->xs[(r0 + r) * nb + b]);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), s, acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) store16(j, o + r * ldo + 16 * v, acc[r][v], t * TILE + 16 * v, b1 == nb);
}

static inline __attribute__((always_inline)) TVNNI void vnni_q8_block(const job_t *j, long t, long r0, long R, long b0,
                                                                      long b1) {
    switch (R) {
    case 1: vnni_rows(1, j, t, r0, b0, b1); break;
    case 2: vnni_rows(2, j, t, r0, b0, b1); break;
    default: vnni_rows(3, j, t, r0, b0, b1); break;
    }
}

TILE_DRIVER(tile_avx512, __attribute__((noinline)) T512, avx512_float_block, gen_q8_block, MAXR)
TILE_DRIVER(tile_avx512_vnni, __attribute__((noinline)) TVNNI, avx512_float_block, vnni_q8_block, MAXR)

/* ------------------------------------------------------------------ thread pool */
/* Persistent workers. A call publishes its job under a new call number, and every thread,
 * the caller included, claims chunks of output tiles from one counter until none is left;
 * the caller then waits for the claimed chunks to finish. A worker that wakes late (the
 * machine is shared) finds nothing left, so the caller never waits for a thread that has
 * not started: it does the work itself. k is never split, so the bits do not depend on
 * who computes a tile. */

typedef void (*tile_fn)(const job_t *, long);

static struct {
    pthread_mutex_t mu, call_mu;
    pthread_cond_t cv;
    _Atomic uint64_t claim; /* call number (16 bits) << 48 | tiles of the call << 24 | next tile */
    atomic_long done;       /* tiles finished in this call */
    int started;            /* workers running */
    int active;             /* workers that take part in calls (threads - 1) */
    const job_t *job;
    long chunk;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, 1};

#define TILE_MASK ((uint64_t)0xffffff)
#define CALL_OF(v) ((uint16_t)((v) >> 48))

static tile_fn tile_for(int isa) {
    switch (isa) {
    case ISA_AVX512_VNNI: return tile_avx512_vnni;
    case ISA_AVX512: return tile_avx512;
    case ISA_AVX2: return tile_avx2;
    default: return tile_generic;
    }
}

/* Claim and run chunks of the current call until none is left. The claim word carries the
 * call's tile count, so nothing of the job is read before a chunk is ours; once it is, the
 * caller waits for it, so the job stays valid while it runs. */
static void run_claims(void) {
    uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        const long next = (long)(v & TILE_MASK), n = (long)((v >> 24) & TILE_MASK);
        if (next >= n) return;
        const long t1 = next + pool.chunk < n ? next + pool.chunk : n;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &v, (v & ~TILE_MASK) | (uint64_t)t1,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue; /* v now holds the current value */
        const job_t *j = pool.job;
        const tile_fn fn = tile_for(isa_used);
        for (long t = next; t < t1; t++) fn(j, t);
        atomic_fetch_add_explicit(&pool.done, t1 - next, memory_order_acq_rel);
        v = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *worker(void *arg) {
    const int index = (int)((uintptr_t)arg >> 16);  /* 0 for the first worker */
    uint16_t seen = (uint16_t)(uintptr_t)arg;       /* the call number at creation */
    for (;;) {
        uint16_t call;
        int spins = 0;
        while ((call = CALL_OF(atomic_load_explicit(&pool.claim, memory_order_acquire))) == seen && spins < SPIN_WAIT) {
            _mm_pause();
            spins++;
        }
        if (call == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((call = CALL_OF(atomic_load(&pool.claim))) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = call;
        if (index < pool.active) run_claims();
    }
    return NULL;
}

static void ensure_workers(int n) {
    while (pool.started < n - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = ((uintptr_t)pool.started << 16) | CALL_OF(atomic_load(&pool.claim));
        const int ok = pthread_create(&th, &attr, worker, (void *)arg) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
}

static void dispatch(const job_t *j, int threads) {
    pthread_mutex_lock(&pool.call_mu);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > j->ntiles) threads = (int)j->ntiles;
    if (threads > 1) ensure_workers(threads);
    if (threads <= 1 || pool.started == 0 || (uint64_t)j->ntiles > TILE_MASK) {
        const tile_fn fn = tile_for(isa_used);
        for (long t = 0; t < j->ntiles; t++) fn(j, t);
        pthread_mutex_unlock(&pool.call_mu);
        return;
    }
    /* chunks: a few per thread, so a late or slow thread leaves work the others pick up */
    const long chunk = j->ntiles / (threads * 8);
    pool.chunk = chunk < 1 ? 1 : chunk;
    pool.active = threads - 1;
    pool.job = j;
    atomic_store(&pool.done, 0);
    const uint64_t call = (uint64_t)(uint16_t)(CALL_OF(atomic_load(&pool.claim)) + 1);
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.claim, call << 48 | (uint64_t)j->ntiles << 24, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_claims();
    int spins = 0;
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < j->ntiles) {
        if (++spins < 20000) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.call_mu);
}

/* ------------------------------------------------------------------ the interface (ctypes) */

int npud_isa_best(void) {
    if (isa_best < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            isa_best = __builtin_cpu_supports("avx512vnni") ? ISA_AVX512_VNNI : ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            isa_best = ISA_AVX2;
        else
            isa_best = ISA_GENERIC;
    }
    return isa_best;
}

/* Use `isa` (clamped to what the CPU has); returns the path in use. */
int npud_set_isa(int isa) {
    const int best = npud_isa_best();
    pthread_mutex_lock(&pool.call_mu);
    isa_used = isa < 0 || isa > best ? best : isa;
    pthread_mutex_unlock(&pool.call_mu);
    return isa_used;
}

/* out[M, ntiles*TILE] = x[M, K] @ W.T, W float/bf16/int8 tiles [ntiles, K, TILE]; scale, bias [N] or NULL.
 * Returns -1 when the transposed copy of x cannot be allocated, else 0. */
int npud_gemm(int fmt, const float *x, long M, long K, const void *w, long ntiles, long N, const float *scale,
              const float *bias, float *out, int threads) {
    if (isa_used < 0) npud_set_isa(-1);
    float *xt = NULL;
    if (M > 1) {
        xt = malloc((size_t)M * K * sizeof(float));
        if (!xt) return -1;
        for (long m = 0; m < M; m++)
            for (long k = 0; k < K; k++) xt[k * M + m] = x[m * K + k];
    }
    job_t j = {fmt, M, K, xt ? xt : x, w, ntiles, N, scale, bias, out, NULL, NULL, NULL};
    dispatch(&j, threads);
    free(xt);
    return 0;
}

/* Quantize rows of x [M, K] in blocks of QB (zero-padded to Kp): xq [M, Kp], xs and xsum [M, Kp/QB].
 * Per block: d = max|x| / 127, q = round(x / d) (away from zero), as llama.cpp's q8_0. */
void npud_quantize_q8(const float *x, long M, long K, long Kp, int8_t *xq, float *xs, int32_t *xsum) {
    const long nb = Kp / QB;
    for (long m = 0; m < M; m++) {
        for (long b = 0; b < nb; b++) {
            float amax = 0.0f;
            for (long k = b * QB; k < b * QB + QB && k < K; k++) {
                const float a = fabsf(x[m * K + k]);
                if (a > amax) amax = a;
            }
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t s = 0;
            for (long k = b * QB; k < b * QB + QB; k++) {
                float q = k < K ? roundf(x[m * K + k] * id) : 0.0f;
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                xq[m * Kp + k] = (int8_t)q;
                s += (int32_t)q;
            }
            xs[m * nb + b] = d;
            xsum[m * nb + b] = s;
        }
    }
}

/* out[M, ntiles*TILE] from int8 weights [ntiles, Kp/4, TILE, 4] (stored w + 128) and the row's
 * q8 blocks; scale (per column), bias [N] or NULL. */
void npud_gemm_q8(const int8_t *xq, const float *xs, const int32_t *xsum, long M, long Kp, const uint8_t *w,
                  long ntiles, long N, const float *scale, const float *bias, float *out, int threads) {
    if (isa_used < 0) npud_set_isa(-1);
    job_t j = {FMT_Q8, M, Kp, NULL, w, ntiles, N, scale, bias, out, xq, xs, xsum};
    dispatch(&j, threads);
}

/* Rows of an embedding table held as tiles (k = 0..K-1 stored, D of them real):
 * out[m, :D] = row tokens[m] widened (times scale[token] when scale is not NULL). */
void npud_embed(int fmt, const void *w, long K, long D, const int64_t *tokens, long M, const float *scale, float *out) {
    for (long m = 0; m < M; m++) {
        const long t = tokens[m] / TILE, c = tokens[m] % TILE;
        for (long d = 0; d < D; d++) {
            float v;
            if (fmt == FMT_Q8)
                v = (float)((int32_t)((const uint8_t *)w)[(((size_t)t * (K / 4) + d / 4) * TILE + c) * 4 + d % 4] - 128);
            else
                v = widen1(fmt, w, ((size_t)t * K + d) * TILE + c);
            out[m * D + d] = scale ? v * scale[tokens[m]] : v;
        }
    }
}

/* npud_quantize_q8 then npud_gemm_q8, with the q8 rows in a scratch buffer of this call. */
int npud_linear_q8(const float *x, long M, long K, long Kp, const uint8_t *w, long ntiles, long N, const float *scale,
                   const float *bias, float *out, int threads) {
    const long nb = Kp / QB;
    int8_t *xq = malloc((size_t)M * Kp);
    float *xs = malloc((size_t)M * nb * sizeof(float));
    int32_t *xsum = malloc((size_t)M * nb * sizeof(int32_t));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    npud_quantize_q8(x, M, K, Kp, xq, xs, xsum);
    npud_gemm_q8(xq, xs, xsum, M, Kp, w, ntiles, N, scale, bias, out, threads);
    free(xq), free(xs), free(xsum);
    return 0;
}

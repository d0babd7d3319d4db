/* What the host GEMM's files share: the job a call becomes, its constants and the inline
 * helpers every kernel path uses. gemm.c: the float and q8 kernels and the ISA choice;
 * bf16dot.c: the bf16-dot format; q8pairs.c: int8-q16's activation rows; blockgemm.c: GGML block weights; blockq8.c: GGML block weights
 * against q8 rows; pool.c: the thread pool that
 * runs a job's tiles. */
#ifndef NPUD_GEMM_H
#define NPUD_GEMM_H

#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <x86intrin.h>

#include "entries.h"

#define TILE 64
#define QB 32           /* activation quantization block (llama.cpp's q8_0 block) */
#define KC 512          /* k rows per chunk when several row blocks share a weight tile (q8) */
#define MAXR 6          /* rows held in registers at once (AVX-512 float: 6 x 4 accumulators) */
#define MAXR_Q8 4       /* q8: 4 x 4 int32 accumulators (the float ones wait in the output) */
#define PF_BYTES 1024   /* software prefetch distance in the weight stream */
#define PREP_PARALLEL_MIN (1L << 15) /* activations (M x K) from which a GEMM's entry quantizes or
                                        transposes them on the pool's threads (pool_for) */

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_I8 = 2, FMT_Q8 = 3, FMT_BD = 4, FMT_QT = 5, FMT_BQ = 6, FMT_Q16 = 7 };
/* ISA_AVX512_BF16: VNNI and AVX512_BF16 (every CPU with the latter has the former) */
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3, ISA_AVX512_BF16 = 4 };

typedef struct job {
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
    const int8_t *xq;        /* q8: [M, Kp]; int8-q16: [M, 2 Kp], each block's hi bytes then its
                                lo bytes (q8pairs.c) */
    const float *xs;         /* q8: [M, Kp / QB] */
    const int32_t *xsum;     /* q8: [M, Kp / QB], sum of each block's integer values */
    const uint32_t *xb;      /* bf16-dot: [Kp / 2, M], each word a row's bf16 pair (x[k], x[k+1]) */
    const float *fac;        /* GGML blocks (blockgemm.c): factor tiles [ntiles, K / group, parts, TILE] */
    long group, parts;       /* GGML blocks: weights a factor group; 1 (S) or 2 (S, D) factors */
    int qbits, qzero;        /* blockgemm.c, blockq8.c: q tiles of bytes (8), or nibbles (4) and fifth bits (5); u = q + qzero */
    int fac16;               /* blockgemm.c, blockq8.c: factor tiles held as float16 (exact: every factor a float16 value) */
    /* the thread pool's part (see the pool below) */
    void (*tile)(const struct job *, long, float *, long);
    long chunk, nchunks;     /* tiles per chunk; chunks */
    atomic_long next;        /* the next chunk to offer */
    _Atomic uint8_t *state;  /* [nchunks]: FREE, OWNED, PUBLISHING, DONE, CALLER */
    struct job *retired;     /* next in the caller's list of jobs a stalled worker still holds */
    int caller_cpu;          /* the CPU the caller ran on when it published the job */
    long published_ns;       /* when the caller published the job (pool.c's trace) */
    atomic_long seen_ns;     /* when a worker first saw it, or 0 */
    long created_ns;         /* when the entry made it (job_new): the GEMM clock's start (pool.c) */
    void (*unit)(void *, long); /* pool_for's job: unit(ctx, i) for each chunk i (no tiles, no scratch) */
    void *ctx;
} job_t;

typedef void (*tile_fn)(const job_t *, long, float *, long);

#define INTERNAL __attribute__((visibility("hidden")))

/* gemm.c: the ISA path calls use now (the best the CPU has unless npud_set_isa said otherwise) */
INTERNAL int isa_in_use(void);

/* pool.c: a job with room for `ntiles` chunk states and `extra` bytes of the call's own buffers;
 * those bytes; and running it (it returns how many finished jobs a worker may still read) */
INTERNAL job_t *job_new(long ntiles, size_t extra);
INTERNAL void *job_extra(job_t *j, long ntiles);
INTERNAL long dispatch(job_t *j, int threads);

/* gemm.c: rows of x [M, K] in q8 blocks of QB (zero-padded to Kp); blockq8.c uses it too */
void npud_quantize_q8(const float *x, long M, long K, long Kp, int8_t *xq, float *xs, int32_t *xsum);
/* q8pairs.c: int8-q16's rows, blocks of 16-bit values as byte pairs (xq [M, 2 Kp]) */
void npud_quantize_q8_pairs(const float *x, long M, long K, long Kp, int8_t *xq, float *xs, int32_t *xsum);

/* ------------------------------------------------------------------ row blocks */

/* Row blocks of near-equal size, each at most maxr rows: block i starts at *r0 and has *rn rows. */
static inline void row_block(long M, int maxr, long i, long nblocks, long *r0, long *rn) {
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

static inline __attribute__((always_inline)) size_t elem_size(int fmt) {
    return fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
}

/* A float16 factor as float32, exactly (normal, subnormal, zero, inf and NaN alike: what
 * vcvtph2ps gives); blockgemm.c and blockq8.c widen float16 factor tiles with it. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
        const float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    bits = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | man << 13;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

static inline __attribute__((always_inline)) T512 void store16(const job_t *j, float *o, __m512 v, long n, int last) {
    if (last) {
        const long left = j->N - n;
        const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        if (j->scale) v = _mm512_mask_mul_ps(v, live, v, _mm512_maskz_loadu_ps(live, j->scale + n));
        if (j->bias) v = _mm512_mask_add_ps(v, live, v, _mm512_maskz_loadu_ps(live, j->bias + n));
    }
    _mm512_storeu_ps(o, v);
}

/* An R-row block's 4R accumulators, 64 columns a row (row r of the block at o + r * ldo): zero
 * where the chain starts, else the partial sums waiting in o (stored and reloaded exactly). */
static inline __attribute__((always_inline)) T512 void acc_load(const int R, __m512 acc[MAXR][4], const float *o,
                                                                long ldo, int start) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = start ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * v);
}

/* ... and back into o: the final values (scale and bias on, store16) when the chain ends. */
static inline __attribute__((always_inline)) T512 void acc_store(const int R, const job_t *j, __m512 acc[MAXR][4],
                                                                 float *o, long ldo, long t, int last) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) store16(j, o + r * ldo + 16 * v, acc[r][v], t * TILE + 16 * v, last);
}

/* One k of the float chain for the block: acc[r][v] = fma(xk[r], w[v], acc[r][v]), xk the
 * block's activations at this k (adjacent in the transposed x). */
static inline __attribute__((always_inline)) T512 void fma_rows(const int R, __m512 acc[MAXR][4], const float *xk,
                                                                const __m512 w[4]) {
    for (int r = 0; r < R; r++) {
        const __m512 xb = _mm512_set1_ps(xk[r]);
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);
    }
}

#endif

/* npud host GEMM kernels: batch-invariant by construction (see kernels/host/native.py).
 *
 * Every output element y[m, n] is one chain of operations that depends on row m alone:
 *   float path:   acc = 0; for k = 0..K-1: acc = fma(x[m,k], w[n,k], acc)   (one rounding each)
 *   q8 path:      acc = 0; for block b: acc = fma((float) isum_b, xs[m,b], acc), isum_b an exact
 *                 integer dot product of the row's int8 block with the weights
 *   bf16-dot path: x rounded to bf16 (npud_round_bf16); acc = 0; for each k-pair (k, k+1):
 *                 acc = ftz(fma(x[m,k+1], w[n,k+1], acc)); acc = ftz(fma(x[m,k], w[n,k], acc)),
 *                 ftz flushing a result below FLT_MIN to zero (what vdpbf16ps computes: bd_step)
 *   then y = acc * scale[n] (if any), then y = y + bias[n] (if any), each rounded.
 * Vector lanes run across output columns, never across k. Rows are blocked in registers (the
 * q8 path's float sums wait in the output between blocks, stored and reloaded exactly),
 * columns in tiles of 64, k in chunks, threads take chunks of whole tiles: none of that changes
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
#include <time.h>
#include <x86intrin.h>

#define TILE 64
#define QB 32           /* activation quantization block (llama.cpp's q8_0 block) */
#define KC 512          /* k rows per chunk when several row blocks share a weight tile (q8) */
#define MAXR 6          /* rows held in registers at once (AVX-512 float: 6 x 4 accumulators) */
#define MAXR_Q8 4       /* q8: 4 x 4 int32 accumulators (the float ones wait in the output) */
#define PF_BYTES 1024   /* software prefetch distance in the weight stream */
#define MAX_THREADS 64
#define CHUNK_BYTES (256 << 10) /* weight bytes a pool chunk reads at most */
/* pause instructions (tens of microseconds) a worker spins for the next call before it sleeps:
 * enough to bridge the Python between the GEMMs of a layer, short enough not to hold a core
 * that the machine's other processes (or numba's threads) want */
#define SPIN_WAIT 2000

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_I8 = 2, FMT_Q8 = 3, FMT_BD = 4 };
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
    const int8_t *xq;        /* q8: [M, Kp] */
    const float *xs;         /* q8: [M, Kp / QB] */
    const int32_t *xsum;     /* q8: [M, Kp / QB], sum of each block's int8 values */
    const uint32_t *xb;      /* bf16-dot: [Kp / 2, M], each word a row's bf16 pair (x[k], x[k+1]) */
    /* the thread pool's part (see the pool below) */
    void (*tile)(const struct job *, long, float *, long);
    long chunk, nchunks;     /* tiles per chunk; chunks */
    atomic_long next;        /* the next chunk to offer */
    _Atomic uint8_t *state;  /* [nchunks]: FREE, OWNED, PUBLISHING, DONE, CALLER */
    struct job *retired;     /* next in the caller's list of jobs a stalled worker still holds */
    int caller_cpu;          /* the CPU the caller ran on when it published the job */
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

/* bf16 tiles hold each group of 32 columns as 16 pairs (c, c + 16), one 32-bit word a pair
 * (formats.py's pair_bf16_columns), so that on AVX-512 a shift and a mask widen 32 columns
 * without a shuffle. Where element i (= row * TILE + column) of a bf16 tile is stored: */
static inline __attribute__((always_inline)) long bf16_pos(long i) {
    return (i & ~31L) + 2 * (i & 15) + ((i >> 4) & 1);
}

static inline __attribute__((always_inline)) float widen1(int fmt, const void *w, long i) {
    if (fmt == FMT_F32) return ((const float *)w)[i];
    if (fmt == FMT_BF16) {
        uint32_t b = (uint32_t)((const uint16_t *)w)[bf16_pos(i)] << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    return (float)((const int8_t *)w)[i];
}

static inline __attribute__((always_inline)) size_t elem_size(int fmt) {
    return fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
}

static inline __attribute__((always_inline)) void gen_float_block(int fmt, const job_t *j, long t, float *o, long ldo,
                                                                  long r0, long R, long k0, long k1) {
    const long K = j->K;
    const char *wt = (const char *)j->w + (size_t)t * K * TILE * elem_size(fmt);
    float acc[MAXR][TILE];
    float wv[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = k0 == 0 ? 0.0f : o[(r0 + r) * ldo + c];
    for (long k = k0; k < k1; k++) {
        for (int c = 0; c < TILE; c++) wv[c] = widen1(fmt, wt, k * TILE + c);
        for (long r = 0; r < R; r++) {
            const float xv = j->x[k * j->M + r0 + r];
            for (int c = 0; c < TILE; c++) acc[r][c] = fmaf(xv, wv[c], acc[r][c]);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            o[(r0 + r) * ldo + c] = k1 == K ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

static inline __attribute__((always_inline)) void gen_q8_block(const job_t *j, long t, float *o, long ldo, long r0,
                                                               long R, long b0, long b1) {
    const long Kp = j->K, nb = Kp / QB;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * Kp * TILE;
    float acc[MAXR_Q8][TILE];
    int32_t isum[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = b0 == 0 ? 0.0f : o[(r0 + r) * ldo + c];
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
            o[(r0 + r) * ldo + c] = b1 == nb ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

/* One tile of output columns for every row, into o (row m at o + m * ldo): row blocks of at
 * most maxr rows; when there are several, k goes in chunks so the chunk of the weight tile
 * stays in cache across them (the partial sums wait in o, stored and reloaded exactly). */
#define TILE_DRIVER(NAME, ATTR, BLOCK_FLOAT, BLOCK_Q8, MAXR_F)                                          \
    ATTR static void NAME(const job_t *j, long t, float *o, long ldo) {                              \
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
                case FMT_F32: BLOCK_FLOAT(FMT_F32, j, t, o, ldo, r0, rn, s0, s1); break;             \
                case FMT_BF16: BLOCK_FLOAT(FMT_BF16, j, t, o, ldo, r0, rn, s0, s1); break;           \
                case FMT_I8: BLOCK_FLOAT(FMT_I8, j, t, o, ldo, r0, rn, s0, s1); break;               \
                default: BLOCK_Q8(j, t, o, ldo, r0, rn, s0, s1); break;                              \
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
    if (fmt == FMT_BF16) { /* i: a multiple of 16; the words of pairs (c, c + 16) of its group of 32 */
        const __m512i pairs = _mm512_loadu_si512((const uint16_t *)w + (i & ~31L));
        return _mm512_castsi512_ps(i & 16 ? _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u))
                                          : _mm512_slli_epi32(pairs, 16));
    }
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
                                                                   float *o, long ldo, long r0, long k0, long k1) {
    const long K = j->K;
    const size_t es = elem_size(fmt);
    const char *wt = (const char *)j->w + (size_t)t * K * TILE * es;
    const float *x = j->x + r0;
    const long M = j->M;
    o += r0 * ldo;
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

static inline __attribute__((always_inline)) T512 void avx512_float_block(int fmt, const job_t *j, long t, float *o,
                                                                          long ldo, long r0, long R, long k0, long k1) {
    switch (R) {
    case 1: avx512_rows(fmt, 1, j, t, o, ldo, r0, k0, k1); break;
    case 2: avx512_rows(fmt, 2, j, t, o, ldo, r0, k0, k1); break;
    case 3: avx512_rows(fmt, 3, j, t, o, ldo, r0, k0, k1); break;
    case 4: avx512_rows(fmt, 4, j, t, o, ldo, r0, k0, k1); break;
    case 5: avx512_rows(fmt, 5, j, t, o, ldo, r0, k0, k1); break;
    default: avx512_rows(fmt, 6, j, t, o, ldo, r0, k0, k1); break;
    }
}

/* q8 with VNNI: vpdpbusd multiplies the weights' unsigned bytes (w + 128) by the row's signed
 * bytes in groups of 4 k; starting each block's int32 sum at -128 * sum(x block) makes it the
 * exact sum of x * w. The block sum then enters the float accumulator by one FMA. The float
 * accumulators live in o (L1; stored and reloaded exactly), so that the registers hold the
 * int32 sums of 4 rows and each weight vector serves 4 rows (rather than 3 with the float
 * accumulators in registers too: 1.1-1.3x at 8 and 64 rows); scale and bias go on last. */
static inline __attribute__((always_inline)) TVNNI void vnni_rows(const int R, const job_t *j, long t, float *o,
                                                                  long ldo, long r0, long b0, long b1) {
    const long Kp = j->K, nb = Kp / QB;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * Kp * TILE;
    const int8_t *xq = j->xq + r0 * Kp;
    const float *xs = j->xs + r0 * nb;
    const int32_t *xsum = j->xsum + r0 * nb;
    o += r0 * ldo;
    for (long b = b0; b < b1; b++) {
        __m512i isum[MAXR_Q8][4];
        for (int r = 0; r < R; r++) {
            const __m512i init = _mm512_set1_epi32(-128 * xsum[r * nb + b]);
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
                memcpy(&four, xq + r * Kp + b * QB + k4 * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xb);
                isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xb);
                isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w2, xb);
                isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w3, xb);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(xs[r * nb + b]);
            for (int v = 0; v < 4; v++) {
                float *p = o + r * ldo + 16 * v;
                const __m512 acc = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(p);
                _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), s, acc));
            }
        }
    }
    if (b1 == nb && (j->scale || j->bias))
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) {
                float *p = o + r * ldo + 16 * v;
                store16(j, p, _mm512_loadu_ps(p), t * TILE + 16 * v, 1);
            }
}

static inline __attribute__((always_inline)) TVNNI void vnni_q8_block(const job_t *j, long t, float *o, long ldo,
                                                                      long r0, long R, long b0, long b1) {
    switch (R) {
    case 1: vnni_rows(1, j, t, o, ldo, r0, b0, b1); break;
    case 2: vnni_rows(2, j, t, o, ldo, r0, b0, b1); break;
    case 3: vnni_rows(3, j, t, o, ldo, r0, b0, b1); break;
    default: vnni_rows(4, j, t, o, ldo, r0, b0, b1); break;
    }
}

TILE_DRIVER(tile_avx512, __attribute__((noinline)) T512, avx512_float_block, gen_q8_block, MAXR)
TILE_DRIVER(tile_avx512_vnni, __attribute__((noinline)) TVNNI, avx512_float_block, vnni_q8_block, MAXR)

/* ------------------------------------------------------------------ bf16-dot (bf16 x bf16 pairs) */
/* Weights [ntiles, Kp/2, TILE] 32-bit words, each (w[k], w[k+1]) of one column (low half k),
 * subnormal bf16 weights stored as zero (formats.py); activations rounded per row by
 * npud_round_bf16, which never yields a subnormal either, so no input of the chain below is
 * subnormal and the hardware's DAZ on its inputs has nothing to do.
 *
 * What vdpbf16ps computes per 32-bit lane, measured on AMD Zen 4 against candidate emulations
 * on 6.4 million adversarial lanes (tools/bf16dot_probe.c: cancellation, subnormal inputs and
 * sums, sums at FLT_MIN, exponents over the whole range, inf and NaN): the high pair's exact
 * product is added to the accumulator with one round-to-nearest-even to 24 significant bits
 * whatever the exponent, and a result below FLT_MIN is then flushed to a zero of its sign;
 * then the same for the low pair. That is an fma and a flush (bd_step), except for a sum just
 * below FLT_MIN, where fma rounds on the subnormal grid (2^-149) and the instruction on the
 * 24-bit one (2^-150): fma's +-FLT_MIN is redone 2^64 times larger (bd_tiny). A NaN result is
 * the first NaN of (x, w, acc), quieted, else the default NaN (inf * 0, inf - inf). Intel's
 * manual describes the same two steps; the start-up self-check (check.py) compares this
 * emulation with the instruction and refuses the instruction where they differ. */

static inline __attribute__((always_inline)) float bd_widen(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static __attribute__((noinline)) float bd_nan(float acc, uint16_t x, uint16_t w) {
    uint32_t u;
    if ((x & 0x7fff) > 0x7f80) return bd_widen(x | 0x40);
    if ((w & 0x7fff) > 0x7f80) return bd_widen(w | 0x40);
    memcpy(&u, &acc, 4);
    u = acc != acc ? u | 0x400000u : 0xffc00000u;
    memcpy(&acc, &u, 4);
    return acc;
}

/* r = fma(x, w, acc) with |r| <= FLT_MIN -> the instruction's result. At +-FLT_MIN the exact sum
 * may lie in [FLT_MIN - 2^-150, FLT_MIN - 2^-151), which rounds to FLT_MIN on the subnormal grid
 * but below it on the 24-bit one. Such a sum has |x w| < 2^-100 (the product cancels against
 * an accumulator of its size, or both are that small), so scaling the smaller factor and the
 * accumulator by 2^64 is exact and overflows nothing. */
static __attribute__((noinline)) float bd_tiny(float acc, float x, float w, float r) {
    if (fabsf(r) < 0x1p-126f) return copysignf(0.0f, r);
    const float s = fabsf(x) < fabsf(w) ? fmaf(x * 0x1p64f, w, acc * 0x1p64f) : fmaf(x, w * 0x1p64f, acc * 0x1p64f);
    return fabsf(s) < 0x1p-62f ? copysignf(0.0f, s) : s * 0x1p-64f;
}

static inline __attribute__((always_inline)) float bd_step(float acc, uint16_t x, uint16_t w) {
    const float xf = bd_widen(x), wf = bd_widen(w), r = fmaf(xf, wf, acc);
    if (r != r) return bd_nan(acc, x, w);
    return fabsf(r) <= 0x1p-126f ? bd_tiny(acc, xf, wf, r) : r;
}

static inline __attribute__((always_inline)) void gen_bd_block(const job_t *j, long t, float *o, long ldo, long r0,
                                                               long R, long s0, long s1) {
    const long np = j->K / 2, M = j->M;
    const uint32_t *wt = (const uint32_t *)j->w + (size_t)t * np * TILE;
    float acc[MAXR][TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = s0 == 0 ? 0.0f : o[(r0 + r) * ldo + c];
    for (long s = s0; s < s1; s++) {
        const uint32_t *wp = wt + s * TILE;
        for (long r = 0; r < R; r++) {
            const uint32_t xp = j->xb[s * M + r0 + r];
            for (int c = 0; c < TILE; c++)
                acc[r][c] = bd_step(bd_step(acc[r][c], xp >> 16, wp[c] >> 16), xp & 0xffff, wp[c] & 0xffff);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            o[(r0 + r) * ldo + c] = s1 == np ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

#define TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma")))

/* R rows x 64 columns in 4R zmm accumulators for k-pairs [s0, s1); each weight vector is loaded
 * once per k-pair for all R rows, the row's pair broadcast as one dword. */
static inline __attribute__((always_inline)) TBF16 void bf16_rows(const int R, const job_t *j, long t, float *o,
                                                                 long ldo, long r0, long s0, long s1) {
    const long np = j->K / 2, M = j->M;
    const uint32_t *wt = (const uint32_t *)j->w + (size_t)t * np * TILE;
    const uint32_t *xb = j->xb + r0;
    o += r0 * ldo;
    __m512 acc[MAXR][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = s0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * v);
    for (long s = s0; s < s1; s++) {
        const uint32_t *wp = wt + s * TILE;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)wp + PF_BYTES + 64 * l, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 16);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 32), w3 = (__m512bh)_mm512_loadu_si512(wp + 48);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[s * M + r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) store16(j, o + r * ldo + 16 * v, acc[r][v], t * TILE + 16 * v, s1 == np);
}

static inline __attribute__((always_inline)) TBF16 void bf16_bd_block(const job_t *j, long t, float *o, long ldo,
                                                                     long r0, long R, long s0, long s1) {
    switch (R) {
    case 1: bf16_rows(1, j, t, o, ldo, r0, s0, s1); break;
    case 2: bf16_rows(2, j, t, o, ldo, r0, s0, s1); break;
    case 3: bf16_rows(3, j, t, o, ldo, r0, s0, s1); break;
    case 4: bf16_rows(4, j, t, o, ldo, r0, s0, s1); break;
    case 5: bf16_rows(5, j, t, o, ldo, r0, s0, s1); break;
    default: bf16_rows(6, j, t, o, ldo, r0, s0, s1); break;
    }
}

/* One tile for every row, as TILE_DRIVER's float path: row blocks of at most MAXR rows, k-pairs
 * in chunks when there are several blocks (partial sums wait in o, stored and reloaded exactly). */
#define BD_DRIVER(NAME, ATTR, BLOCK)                                                                 \
    ATTR static void NAME(const job_t *j, long t, float *o, long ldo) {                              \
        const long nblocks = (j->M + MAXR - 1) / MAXR, steps = j->K / 2;                             \
        /* 256 pairs (64 KiB of the tile): faster here than TILE_DRIVER's smaller chunks at M 8..512 */ \
        const long chunk = nblocks == 1 ? steps : 256;                                               \
        for (long s0 = 0; s0 < steps; s0 += chunk) {                                                 \
            const long s1 = s0 + chunk < steps ? s0 + chunk : steps;                                 \
            for (long i = 0; i < nblocks; i++) {                                                     \
                long r0, rn;                                                                         \
                row_block(j->M, MAXR, i, nblocks, &r0, &rn);                                         \
                BLOCK(j, t, o, ldo, r0, rn, s0, s1);                                                 \
            }                                                                                        \
        }                                                                                            \
    }

BD_DRIVER(tile_bd_generic, __attribute__((noinline)), gen_bd_block)
BD_DRIVER(tile_bd_avx2, __attribute__((noinline, target("avx2,fma"))), gen_bd_block)
BD_DRIVER(tile_bd_avx512, __attribute__((noinline)) T512, gen_bd_block)
BD_DRIVER(tile_bd_bf16, __attribute__((noinline)) TBF16, bf16_bd_block)

/* Whether bf16-dot may use vdpbf16ps (the self-check turns it off where the emulation differs). */
static int bd_hardware = 1;

static void (*tile_bd_for(int isa))(const job_t *, long, float *, long) {
    if (isa >= ISA_AVX512_BF16 && bd_hardware) return tile_bd_bf16;
    if (isa >= ISA_AVX512) return tile_bd_avx512;
    return isa == ISA_AVX2 ? tile_bd_avx2 : tile_bd_generic;
}

/* ------------------------------------------------------------------ thread pool */
/* Persistent workers and work stealing. A call's output tiles go in chunks, and every thread,
 * the caller included, takes chunks from one counter. A worker computes its chunk into its
 * own scratch and copies it out only if the chunk is still its own (OWNED -> PUBLISHING).
 * The caller, once the counter is spent, waits about two of its own chunk times for the
 * chunks workers hold, then takes them back (OWNED -> CALLER) and computes them itself: a
 * worker descheduled in the middle of a chunk (the core is shared) costs the call one chunk,
 * not a scheduler time slice. Every chunk runs the same tile function on the same job, whole
 * (k is never split), so the bits do not depend on which thread computed it.
 *
 * A worker whose chunk was taken back may still read the job after the call has returned.
 * The job (with the call's own copy of the activations) is freed only once no worker's hazard
 * pointer names it; until then it waits in a retired list, and the npud_gemm* functions
 * return how many jobs are retired so that the caller keeps the weights alive too (native.py). */

enum { FREE = 0, OWNED, PUBLISHING, DONE, CALLER };

typedef void (*tile_fn)(const job_t *, long, float *, long);

static struct {
    pthread_mutex_t mu, call_mu;
    pthread_cond_t cv;
    atomic_uint call;                      /* increments with every call the workers take part in */
    _Atomic(job_t *) job;                  /* the current call's job; NULL between calls */
    _Atomic(job_t *) hazard[MAX_THREADS];  /* the job each worker is reading, or NULL */
    atomic_int active;                     /* workers that take part in calls (threads - 1) */
    int started;                           /* workers running */
    job_t *retired;                        /* jobs a worker may still read (caller's side only) */
    atomic_long published, stolen, moved;  /* chunks workers delivered; chunks the caller took back;
                                              workers that moved off the caller's CPU */
    atomic_long offered;                   /* chunks of the calls that went to the pool */
    atomic_long stall_us;                  /* tests: workers sleep this long on each chunk they take
                                              (and the caller lets one take the first) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static tile_fn tile_for(int isa) {
    switch (isa) {
    case ISA_AVX512_BF16:
    case ISA_AVX512_VNNI: return tile_avx512_vnni;
    case ISA_AVX512: return tile_avx512;
    case ISA_AVX2: return tile_avx2;
    default: return tile_generic;
    }
}

/* A job with room for `ntiles` chunk states and `extra` bytes of the call's own buffers. */
static job_t *job_new(long ntiles, size_t extra) {
    const size_t head = (sizeof(job_t) + (size_t)ntiles + 63) / 64 * 64;
    job_t *j = aligned_alloc(64, (head + extra + 63) / 64 * 64);
    if (!j) return NULL;
    memset(j, 0, sizeof(job_t));
    j->state = (_Atomic uint8_t *)((char *)j + sizeof(job_t));
    memset((void *)j->state, FREE, (size_t)ntiles);
    return j;
}

static void *job_extra(job_t *j, long ntiles) {
    return (char *)j + (sizeof(job_t) + (size_t)ntiles + 63) / 64 * 64;
}

/* Tiles [c * chunk, ...) of job j into o (row m of tile t0 at o + m * ldo). */
static void run_chunk(const job_t *j, long c, float *o, long ldo) {
    const long t0 = c * j->chunk, t1 = t0 + j->chunk < j->ntiles ? t0 + j->chunk : j->ntiles;
    for (long t = t0; t < t1; t++) j->tile(j, t, o + (t - t0) * TILE, ldo);
}

/* A loaded machine's scheduler tends to wake a worker on its waker's CPU, where it can only
 * take turns with the caller (and its spin and its stolen chunks cost the caller time): a
 * worker that finds itself there moves to the other CPUs it may use, and stays off that one. */
static void move_off(int cpu, const cpu_set_t *allowed) {
    cpu_set_t set = *allowed;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) > 0 && sched_setaffinity(0, sizeof set, &set) == 0)
        atomic_fetch_add_explicit(&pool.moved, 1, memory_order_relaxed);
}

static void worker_chunks(job_t *j, float **scratch, size_t *cap) {
    const size_t need = (size_t)j->M * j->chunk * TILE * sizeof(float);
    if (need > *cap) {
        free(*scratch);
        *scratch = malloc(need);
        *cap = *scratch ? need : 0;
        if (!*scratch) return; /* the caller does the chunks */
    }
    const long ldo = j->ntiles * TILE, width = j->chunk * TILE;
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= j->nchunks) return;
        uint8_t st = FREE;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, OWNED)) continue;
        const long stall = atomic_load_explicit(&pool.stall_us, memory_order_relaxed);
        if (stall) {
            const struct timespec ts = {stall / 1000000, stall % 1000000 * 1000};
            nanosleep(&ts, NULL);
        }
        run_chunk(j, c, *scratch, width);
        st = OWNED;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, PUBLISHING)) continue; /* taken back */
        const long t0 = c * j->chunk, cols = (t0 + j->chunk < j->ntiles ? j->chunk : j->ntiles - t0) * TILE;
        for (long m = 0; m < j->M; m++) memcpy(j->out + m * ldo + t0 * TILE, *scratch + m * width, cols * sizeof(float));
        atomic_store_explicit(&j->state[c], DONE, memory_order_release);
        atomic_fetch_add_explicit(&pool.published, 1, memory_order_relaxed);
    }
}

/* The caller's part: chunks from the counter, then every chunk not yet done, taking back
 * those a worker has held for longer than about two of the caller's own chunk times. */
static void caller_chunks(job_t *j) {
    const long ldo = j->ntiles * TILE;
    uint64_t spent = 0, ran = 0;
    if (atomic_load_explicit(&pool.stall_us, memory_order_relaxed)) /* tests: a worker takes the first chunk */
        for (int i = 0; i < 100000 && atomic_load(&j->next) == 0; i++) sched_yield();
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= j->nchunks) break;
        uint8_t st = FREE;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) continue;
        const uint64_t t = __rdtsc();
        run_chunk(j, c, j->out + c * j->chunk * TILE, ldo);
        spent += __rdtsc() - t;
        ran++;
    }
    const uint64_t patience = ran ? 2 * spent / ran : 100000, since = __rdtsc();
    for (long c = 0; c < j->nchunks; c++) {
        long spins = 0;
        for (;;) {
            uint8_t st = atomic_load_explicit(&j->state[c], memory_order_acquire);
            if (st == DONE || st == CALLER) break;
            if (st == FREE || (st == OWNED && __rdtsc() - since > patience)) {
                if (!atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) continue;
                run_chunk(j, c, j->out + c * j->chunk * TILE, ldo);
                if (st == OWNED) atomic_fetch_add_explicit(&pool.stolen, 1, memory_order_relaxed);
                break;
            }
            /* OWNED within patience, or PUBLISHING (a copy of a few KiB) */
            if (++spins < 20000) _mm_pause();
            else sched_yield();
        }
    }
}

static void *worker(void *arg) {
    const int index = (int)((uintptr_t)arg >> 32);
    unsigned seen = (unsigned)(uintptr_t)arg; /* the call number at creation */
    float *scratch = NULL;
    size_t cap = 0;
    cpu_set_t allowed; /* the CPUs the process may use (the caller's mask at creation) */
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) CPU_ZERO(&allowed);
    for (;;) {
        unsigned call;
        int spins = 0;
        while ((call = atomic_load_explicit(&pool.call, memory_order_acquire)) == seen && spins < SPIN_WAIT) {
            _mm_pause();
            spins++;
        }
        if (call == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((call = atomic_load(&pool.call)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = call;
        if (index >= atomic_load(&pool.active)) continue;
        job_t *j;
        do { /* name the job, then check it is still the current one: the caller frees only unnamed jobs */
            j = atomic_load(&pool.job);
            atomic_store(&pool.hazard[index], j);
        } while (j && atomic_load(&pool.job) != j);
        if (j && sched_getcpu() == j->caller_cpu) move_off(j->caller_cpu, &allowed);
        if (j) worker_chunks(j, &scratch, &cap);
        atomic_store(&pool.hazard[index], NULL);
    }
    return NULL;
}

static void ensure_workers(int n) {
    while (pool.started < n - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = ((uintptr_t)pool.started << 32) | atomic_load(&pool.call);
        const int ok = pthread_create(&th, &attr, worker, (void *)arg) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
}

static int named_by_worker(const job_t *j) {
    for (int i = 0; i < pool.started; i++)
        if (atomic_load(&pool.hazard[i]) == j) return 1;
    return 0;
}

/* Free the retired jobs no worker names any more; returns how many are still named. Under call_mu. */
static long reclaim(void) {
    long held = 0;
    for (job_t **p = &pool.retired; *p;) {
        job_t *j = *p;
        if (named_by_worker(j)) {
            held++;
            p = &j->retired;
        } else {
            *p = j->retired;
            free(j);
        }
    }
    return held;
}

/* Run job j (from job_new; this call owns it) on `threads` threads; returns the jobs still retired. */
static long dispatch(job_t *j, int threads) {
    pthread_mutex_lock(&pool.call_mu);
    if (!j->tile) j->tile = tile_for(isa_used); /* a format with its own tile functions set it (bf16-dot) */
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > j->ntiles) threads = (int)j->ntiles;
    if (threads > 1) ensure_workers(threads);
    if (threads <= 1 || pool.started == 0) {
        for (long t = 0; t < j->ntiles; t++) j->tile(j, t, j->out + t * TILE, j->ntiles * TILE);
        free(j);
    } else {
        /* chunks: many per thread, and at most CHUNK_BYTES of weights, so that taking one back
         * costs little (a big one-row GEMM streams a chunk in tens of microseconds) */
        /* a tile's weight bytes (FMT_BD: Kp / 2 words of 4 bytes a column) */
        const size_t tile_bytes = (size_t)j->K * TILE * (j->fmt == FMT_BD ? 2 : elem_size(j->fmt));
        const long most = CHUNK_BYTES / tile_bytes > 1 ? (long)(CHUNK_BYTES / tile_bytes) : 1;
        j->chunk = (j->ntiles + threads * 32 - 1) / (threads * 32);
        if (j->chunk > most) j->chunk = most;
        j->nchunks = (j->ntiles + j->chunk - 1) / j->chunk;
        atomic_fetch_add_explicit(&pool.offered, j->nchunks, memory_order_relaxed);
        j->caller_cpu = sched_getcpu();
        atomic_store(&pool.active, threads - 1);
        atomic_store(&pool.job, j);
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.call, 1);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
        caller_chunks(j);
        atomic_store(&pool.job, NULL);
        if (named_by_worker(j)) {
            j->retired = pool.retired;
            pool.retired = j;
        } else {
            free(j);
        }
    }
    const long held = reclaim();
    pthread_mutex_unlock(&pool.call_mu);
    return held;
}

/* ------------------------------------------------------------------ the interface (ctypes) */

int npud_isa_best(void) {
    if (isa_best < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            isa_best = !__builtin_cpu_supports("avx512vnni")  ? ISA_AVX512
                       : __builtin_cpu_supports("avx512bf16") ? ISA_AVX512_BF16
                                                              : ISA_AVX512_VNNI;
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
 * Returns -1 when the call's copy of x cannot be allocated, else how many jobs a worker may
 * still read (then w, scale and bias must stay alive until npud_pool_held() says 0). */
long npud_gemm(int fmt, const float *x, long M, long K, const void *w, long ntiles, long N, const float *scale,
               const float *bias, float *out, int threads) {
    if (isa_used < 0) npud_set_isa(-1);
    job_t *j = job_new(ntiles, (size_t)M * K * sizeof(float));
    if (!j) return -1;
    float *xt = job_extra(j, ntiles); /* x transposed: [K, M] */
    for (long m0 = 0; m0 < M; m0 += 8) { /* 8 rows at a time: 8 read streams, 32-byte writes */
        const long m1 = m0 + 8 < M ? m0 + 8 : M;
        for (long k = 0; k < K; k++)
            for (long m = m0; m < m1; m++) xt[k * M + m] = x[m * K + k];
    }
    j->fmt = fmt, j->M = M, j->K = K, j->x = xt, j->w = w, j->ntiles = ntiles, j->N = N;
    j->scale = scale, j->bias = bias, j->out = out;
    return dispatch(j, threads);
}

/* One row of x [K] in blocks of QB (zero-padded to nb blocks): xq [nb * QB], xs and xsum [nb].
 * Per block: d = max|x| / 127, q = round(x / d) (away from zero), as llama.cpp's q8_0. */
static void quantize_row(const float *x, long K, long nb, int8_t *xq, float *xs, int32_t *xsum) {
    for (long b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (long k = b * QB; k < b * QB + QB && k < K; k++) {
            const float a = fabsf(x[k]);
            if (a > amax) amax = a;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (long k = b * QB; k < b * QB + QB; k++) {
            float q = k < K ? roundf(x[k] * id) : 0.0f;
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            xq[k] = (int8_t)q;
            s += (int32_t)q;
        }
        xs[b] = d;
        xsum[b] = s;
    }
}

/* quantize_row's operations 16 lanes at a time, with its results bit for bit (NaN and
 * infinity included): the max is exact in any order (a NaN lane never wins, as there), x * id
 * is one rounding, roundf is the truncation plus one away from zero when the (exact) fraction
 * is at least a half, the clamp keeps a NaN, and float -> int32 -> int8 truncates as the
 * scalar conversion does. Every ISA path's job calls this one or the other: same bits. */
static T512 void quantize_row_avx512(const float *x, long K, long nb, int8_t *xq, float *xs, int32_t *xsum) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (long b = 0; b < nb; b++) {
        __m512 v[QB / 16];
        __mmask16 live[QB / 16];
        __m512 amax = _mm512_setzero_ps();
        for (int h = 0; h < QB / 16; h++) {
            const long left = K - (b * QB + 16 * h);
            live[h] = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            v[h] = _mm512_maskz_loadu_ps(live[h], x + b * QB + 16 * h);
            amax = _mm512_max_ps(_mm512_abs_ps(v[h]), amax);
        }
        const float d = _mm512_reduce_max_ps(amax) / 127.0f;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m512i s = _mm512_setzero_si512();
        for (int h = 0; h < QB / 16; h++) {
            const __m512 t = _mm512_mul_ps(v[h], id);
            const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, r)), half, _CMP_GE_OQ);
            const __m512 away = _mm512_castsi512_ps(
                _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(t), sign), _mm512_castps_si512(one)));
            __m512 q = _mm512_mask_add_ps(r, up, r, away);
            q = _mm512_max_ps(lo, _mm512_min_ps(hi, q)); /* vmaxps/vminps return the second operand on NaN */
            const __m512i qi = _mm512_maskz_cvttps_epi32(live[h], q);
            _mm_storeu_si128((__m128i *)(xq + b * QB + 16 * h), _mm512_cvtepi32_epi8(qi));
            s = _mm512_add_epi32(s, qi);
        }
        xs[b] = d;
        xsum[b] = _mm512_reduce_add_epi32(s);
    }
}

/* Quantize rows of x [M, K] in blocks of QB (zero-padded to Kp): xq [M, Kp], xs and xsum [M, Kp/QB]. */
void npud_quantize_q8(const float *x, long M, long K, long Kp, int8_t *xq, float *xs, int32_t *xsum) {
    if (isa_used < 0) npud_set_isa(-1);
    const long nb = Kp / QB;
    for (long m = 0; m < M; m++) {
        if (isa_used >= ISA_AVX512)
            quantize_row_avx512(x + m * K, K, nb, xq + m * Kp, xs + m * nb, xsum + m * nb);
        else
            quantize_row(x + m * K, K, nb, xq + m * Kp, xs + m * nb, xsum + m * nb);
    }
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

/* out[M, ntiles*TILE] from int8 weights [ntiles, Kp/4, TILE, 4] (stored w + 128) and x [M, K]
 * quantized per row in q8 blocks (npud_quantize_q8); scale (per column), bias [N] or NULL.
 * Returns as npud_gemm. */
long npud_linear_q8(const float *x, long M, long K, long Kp, const uint8_t *w, long ntiles, long N, const float *scale,
                    const float *bias, float *out, int threads) {
    if (isa_used < 0) npud_set_isa(-1);
    const long nb = Kp / QB;
    const size_t qbytes = ((size_t)M * Kp + 63) / 64 * 64;
    job_t *j = job_new(ntiles, qbytes + (size_t)M * nb * (sizeof(float) + sizeof(int32_t)));
    if (!j) return -1;
    int8_t *xq = job_extra(j, ntiles);
    float *xs = (float *)((char *)xq + qbytes);
    int32_t *xsum = (int32_t *)(xs + M * nb);
    npud_quantize_q8(x, M, K, Kp, xq, xs, xsum);
    j->fmt = FMT_Q8, j->M = M, j->K = Kp, j->w = w, j->ntiles = ntiles, j->N = N;
    j->scale = scale, j->bias = bias, j->out = out, j->xq = xq, j->xs = xs, j->xsum = xsum;
    return dispatch(j, threads);
}

/* x [M, K] -> bf16 bits [M, Kp] (Kp >= K, the rest zero), rounded to nearest even. A NaN stays a
 * NaN (quieted, sign and high payload kept); fp32 zeros and subnormals, and values that would
 * be bf16 subnormals, become zeros of their sign, so the dot products never see a subnormal. */
void npud_round_bf16(const float *x, long M, long K, long Kp, uint16_t *out) {
    for (long m = 0; m < M; m++) {
        for (long k = 0; k < Kp; k++) {
            uint32_t u = 0;
            if (k < K) memcpy(&u, x + m * K + k, 4);
            uint16_t b;
            if ((u & 0x7fffffffu) > 0x7f800000u) b = (uint16_t)((u >> 16) | 0x40);
            else if ((u & 0x7f800000u) == 0) b = (uint16_t)((u >> 16) & 0x8000);
            else b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
            out[m * Kp + k] = b;
        }
    }
}

/* out[M, ntiles*TILE] from bf16 k-pair weights [ntiles, Kp/2, TILE] words and x [M, K] rounded
 * to bf16 per row (npud_round_bf16); scale, bias [N] or NULL. Returns as npud_gemm. */
long npud_linear_bd(const float *x, long M, long K, long Kp, const uint32_t *w, long ntiles, long N,
                    const float *scale, const float *bias, float *out, int threads) {
    if (isa_used < 0) npud_set_isa(-1);
    job_t *j = job_new(ntiles, (size_t)M * Kp * sizeof(uint16_t) * 2);
    if (!j) return -1;
    uint32_t *xt = job_extra(j, ntiles);               /* [Kp/2, M] pairs */
    uint16_t *rows = (uint16_t *)(xt + M * (Kp / 2));   /* [M, Kp] */
    npud_round_bf16(x, M, K, Kp, rows);
    for (long m = 0; m < M; m++)
        for (long s = 0; s < Kp / 2; s++)
            xt[s * M + m] = (uint32_t)rows[m * Kp + 2 * s] | (uint32_t)rows[m * Kp + 2 * s + 1] << 16;
    j->fmt = FMT_BD, j->M = M, j->K = Kp, j->xb = xt, j->w = w, j->ntiles = ntiles, j->N = N;
    j->scale = scale, j->bias = bias, j->out = out;
    pthread_mutex_lock(&pool.call_mu);
    j->tile = tile_bd_for(isa_used);
    pthread_mutex_unlock(&pool.call_mu);
    return dispatch(j, threads);
}

/* bf16-dot's use of vdpbf16ps: 0 off (the emulation), 1 on where the CPU has it, -1 ask.
 * Returns whether the path in use now runs the instruction. */
int npud_bf16dot_hardware(int on) {
    if (isa_used < 0) npud_set_isa(-1);
    pthread_mutex_lock(&pool.call_mu);
    if (on >= 0) bd_hardware = on;
    const int used = isa_used >= ISA_AVX512_BF16 && bd_hardware;
    pthread_mutex_unlock(&pool.call_mu);
    return used;
}

/* How many finished calls a worker may still read (freeing those no worker reads now). */
long npud_pool_held(void) {
    pthread_mutex_lock(&pool.call_mu);
    const long held = reclaim();
    pthread_mutex_unlock(&pool.call_mu);
    return held;
}

/* stats[0]: chunks workers delivered, [1]: chunks the caller took back from a worker,
 * [2]: times a worker moved off the caller's CPU, [3]: chunks of the calls that went to the pool. */
void npud_pool_stats(long *stats) {
    stats[0] = atomic_load(&pool.published);
    stats[1] = atomic_load(&pool.stolen);
    stats[2] = atomic_load(&pool.moved);
    stats[3] = atomic_load(&pool.offered);
}

/* Tests: workers sleep `us` microseconds on every chunk they take (a descheduled worker), and
 * the caller waits for a worker to take the first chunk (0: back to normal). */
void npud_pool_stall(long us) { atomic_store(&pool.stall_us, us); }

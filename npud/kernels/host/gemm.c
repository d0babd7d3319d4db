/* npud host GEMM kernels: batch-invariant by construction (see npud/kernels/host/native.py).
 *
 * Every output element y[m, n] is one chain of operations that depends on row m alone:
 *   float path:   acc = 0; for k = 0..K-1: acc = fma(x[m,k], w[n,k], acc)   (one rounding each)
 *   q8 path:      acc = 0; for block b: acc = fma((float) isum_b, xs[m,b], acc), isum_b an exact
 *                 integer dot product of the row's int8 block with the weights (int8-q16: of its
 *                 16-bit block, each value Q held as two signed bytes Q = 254 hi + lo (q8pairs.c),
 *                 isum = 254 (hi . w) + lo . w, exact in int32)
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
#include "gemm.h"

static atomic_int isa_best = -1;
static atomic_int isa_used = -1; /* chosen at a call's start: a change takes effect from the next call */

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
            for (int c = 0; c < TILE; c++) isum[c] = 0;
            if (j->fmt == FMT_Q16) {
                const int8_t *xq = j->xq + (r0 + r) * 2 * Kp + b * 2 * QB; /* the block's hi bytes, then its lo */
                for (int k4 = 0; k4 < QB / 4; k4++) {
                    const uint8_t *wp = wt + ((size_t)b * (QB / 4) + k4) * TILE * 4;
                    for (int c = 0; c < TILE; c++)
                        for (int i = 0; i < 4; i++)
                            isum[c] += (254 * (int32_t)xq[k4 * 4 + i] + (int32_t)xq[QB + k4 * 4 + i]) *
                                       ((int32_t)wp[c * 4 + i] - 128);
                }
            } else {
                const int8_t *xq = j->xq + (r0 + r) * Kp + b * QB;
                for (int k4 = 0; k4 < QB / 4; k4++) {
                    const uint8_t *wp = wt + ((size_t)b * (QB / 4) + k4) * TILE * 4;
                    for (int c = 0; c < TILE; c++)
                        for (int i = 0; i < 4; i++) isum[c] += (int32_t)xq[k4 * 4 + i] * ((int32_t)wp[c * 4 + i] - 128);
                }
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
        const int q8 = j->fmt == FMT_Q8 || j->fmt == FMT_Q16;                                        \
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

static inline __attribute__((always_inline)) T512 __m512 widen16(int fmt, const char *w, long i) {
    if (fmt == FMT_F32) return _mm512_loadu_ps((const float *)w + i);
    if (fmt == FMT_BF16) { /* i: a multiple of 16; the words of pairs (c, c + 16) of its group of 32 */
        const __m512i pairs = _mm512_loadu_si512((const uint16_t *)w + (i & ~31L));
        return _mm512_castsi512_ps(i & 16 ? _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u))
                                          : _mm512_slli_epi32(pairs, 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
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
    acc_load(R, acc, o, ldo, k0 == 0);
    for (long k = k0; k < k1; k++) {
        const char *row = wt + (size_t)k * TILE * es;
        _mm_prefetch(row + PF_BYTES, _MM_HINT_T0);
        if (es >= 2) _mm_prefetch(row + PF_BYTES + 64, _MM_HINT_T0);
        if (es == 4) {
            _mm_prefetch(row + PF_BYTES + 128, _MM_HINT_T0);
            _mm_prefetch(row + PF_BYTES + 192, _MM_HINT_T0);
        }
        const __m512 w[4] = {widen16(fmt, wt, k * TILE), widen16(fmt, wt, k * TILE + 16),
                             widen16(fmt, wt, k * TILE + 32), widen16(fmt, wt, k * TILE + 48)};
        fma_rows(R, acc, x + k * M, w);
    }
    acc_store(R, j, acc, o, ldo, t, k1 == K);
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
 * exact sum of x * w. int8-q16 makes two passes a block: the row's hi bytes from 0, the sum times
 * 254 plus -128 * sum(Q block), then the lo bytes (the block's weights again, from L1):
 * 254 (hi . w) + lo . w = Q . w, exact in int32 (|Q . w| <= 32 * 32258 * 127 < 2^28).
 * The block sum then enters the float accumulator by one FMA. The float accumulators
 * live in o (L1; stored and reloaded exactly), so that the registers hold the int32 sums of 4
 * rows and each weight vector serves 4 rows (rather than 3 with the float accumulators in
 * registers too: 1.1-1.3x at 8 and 64 rows); scale and bias go on last. */
static inline __attribute__((always_inline)) TVNNI void vnni_pass(const int R, __m512i isum[MAXR_Q8][4],
                                                                  const uint8_t *wb, const int8_t *xq, long stride,
                                                                  int prefetch) {
    for (int k4 = 0; k4 < QB / 4; k4++) {
        const uint8_t *wp = wb + (size_t)k4 * TILE * 4;
        if (prefetch)
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)wp + PF_BYTES + 64 * l, _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
        const __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, xq + r * stride + k4 * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xb);
            isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xb);
            isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w2, xb);
            isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w3, xb);
        }
    }
}

/* int8-q16's block in one pass: the hi and lo bytes' sums in their own registers (8 independent
 * chains a row, for a one-row call's latency), at most 2 rows (16 accumulators and 4 weights). */
static inline __attribute__((always_inline)) TVNNI void vnni_pairs(const int R, __m512i isum[MAXR_Q8][4],
                                                                   const uint8_t *wb, const int8_t *xq, long stride,
                                                                   const int32_t *fix) {
    __m512i lo[2][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) isum[r][v] = lo[r][v] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < QB / 4; k4++) {
        const uint8_t *wp = wb + (size_t)k4 * TILE * 4;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)wp + PF_BYTES + 64 * l, _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
        const __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
        for (int r = 0; r < R; r++) {
            int32_t four_hi, four_lo;
            memcpy(&four_hi, xq + r * stride + k4 * 4, 4);
            memcpy(&four_lo, xq + r * stride + QB + k4 * 4, 4);
            const __m512i xh = _mm512_set1_epi32(four_hi), xl = _mm512_set1_epi32(four_lo);
            isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xh);
            lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], w0, xl);
            isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xh);
            lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], w1, xl);
            isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w2, xh);
            lo[r][2] = _mm512_dpbusd_epi32(lo[r][2], w2, xl);
            isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w3, xh);
            lo[r][3] = _mm512_dpbusd_epi32(lo[r][3], w3, xl);
        }
    }
    for (int r = 0; r < R; r++) { /* 254 hi + lo - 128 sum(Q): exact in int32 */
        const __m512i c = _mm512_set1_epi32(fix[r]);
        for (int v = 0; v < 4; v++) {
            const __m512i h = _mm512_sub_epi32(_mm512_slli_epi32(isum[r][v], 8), _mm512_slli_epi32(isum[r][v], 1));
            isum[r][v] = _mm512_add_epi32(_mm512_add_epi32(h, lo[r][v]), c);
        }
    }
}

static inline __attribute__((always_inline)) TVNNI void vnni_rows(const int R, const job_t *j, long t, float *o,
                                                                  long ldo, long r0, long b0, long b1) {
    const long Kp = j->K, nb = Kp / QB;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * Kp * TILE;
    const int pairs = j->fmt == FMT_Q16;
    const int8_t *xq = j->xq + r0 * (pairs ? 2 : 1) * Kp;
    const float *xs = j->xs + r0 * nb;
    const int32_t *xsum = j->xsum + r0 * nb;
    o += r0 * ldo;
    for (long b = b0; b < b1; b++) {
        const uint8_t *wb = wt + (size_t)b * (QB / 4) * TILE * 4;
        __m512i isum[MAXR_Q8][4];
        if (pairs) {
            int32_t fix[MAXR_Q8];
            for (int r = 0; r < R; r++) fix[r] = -128 * xsum[r * nb + b];
            vnni_pairs(R < 2 ? R : 2, isum, wb, xq + b * 2 * QB, 2 * Kp, fix);
            if (R > 2) vnni_pairs(R - 2, isum + 2, wb, xq + 2 * 2 * Kp + b * 2 * QB, 2 * Kp, fix + 2);
        } else {
            for (int r = 0; r < R; r++) {
                const __m512i init = _mm512_set1_epi32(-128 * xsum[r * nb + b]);
                for (int v = 0; v < 4; v++) isum[r][v] = init;
            }
            vnni_pass(R, isum, wb, xq + b * QB, Kp, 1);
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

static tile_fn tile_for(int isa) {
    switch (isa) {
    case ISA_AVX512_BF16:
    case ISA_AVX512_VNNI: return tile_avx512_vnni;
    case ISA_AVX512: return tile_avx512;
    case ISA_AVX2: return tile_avx2;
    default: return tile_generic;
    }
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
    isa_used = isa < 0 || isa > best ? best : isa;
    return isa_used;
}

int isa_in_use(void) {
    if (isa_used < 0) npud_set_isa(-1);
    return isa_used;
}

/* out[M, ntiles*TILE] = x[M, K] @ W.T, W float/bf16/int8 tiles [ntiles, K, TILE]; scale, bias [N] or NULL.
 * Returns -1 when the call's copy of x cannot be allocated, else how many jobs a worker may
 * still read (then w, scale and bias must stay alive until npud_pool_held() says 0). */
long npud_gemm(int fmt, const float *x, long M, long K, const void *w, long ntiles, long N, const float *scale,
               const float *bias, float *out, int threads) {
    job_t *j = job_new(ntiles, (size_t)M * K * sizeof(float));
    if (!j) return -1;
    float *xt = job_extra(j, ntiles); /* x transposed: [K, M] */
    for (long m0 = 0; m0 < M; m0 += 8) { /* 8 rows at a time: 8 read streams, 32-byte writes */
        const long m1 = m0 + 8 < M ? m0 + 8 : M;
        for (long k = 0; k < K; k++)
            for (long m = m0; m < m1; m++) xt[k * M + m] = x[m * K + k];
    }
    j->fmt = fmt, j->M = M, j->K = K, j->x = xt, j->w = w, j->ntiles = ntiles, j->N = N;
    j->scale = scale, j->bias = bias, j->out = out, j->tile = tile_for(isa_in_use());
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
    const long nb = Kp / QB;
    for (long m = 0; m < M; m++) {
        if (isa_in_use() >= ISA_AVX512)
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
 * quantized per row in q8 blocks (npud_quantize_q8) or, for int8-q16 (fmt FMT_Q16), in blocks of
 * 16-bit values held as byte pairs (q8pairs.c's npud_quantize_q8_pairs); scale (per column), bias
 * [N] or NULL. Returns as npud_gemm. */
long npud_linear_q8(int fmt, const float *x, long M, long K, long Kp, const uint8_t *w, long ntiles, long N,
                    const float *scale, const float *bias, float *out, int threads) {
    const long nb = Kp / QB, bytes = fmt == FMT_Q16 ? 2 : 1;
    const size_t qbytes = ((size_t)M * bytes * Kp + 63) / 64 * 64;
    job_t *j = job_new(ntiles, qbytes + (size_t)M * nb * (sizeof(float) + sizeof(int32_t)));
    if (!j) return -1;
    int8_t *xq = job_extra(j, ntiles);
    float *xs = (float *)((char *)xq + qbytes);
    int32_t *xsum = (int32_t *)(xs + M * nb);
    if (fmt == FMT_Q16)
        npud_quantize_q8_pairs(x, M, K, Kp, xq, xs, xsum);
    else
        npud_quantize_q8(x, M, K, Kp, xq, xs, xsum);
    j->fmt = fmt == FMT_Q16 ? FMT_Q16 : FMT_Q8, j->M = M, j->K = Kp, j->w = w, j->ntiles = ntiles, j->N = N;
    j->scale = scale, j->bias = bias, j->out = out, j->xq = xq, j->xs = xs, j->xsum = xsum;
    j->tile = tile_for(isa_in_use());
    return dispatch(j, threads);
}

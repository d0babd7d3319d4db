#include "gemm.h"

/* ------------------------------------------------------------------ GGML block weights against q8 rows */
/* The "gguf-q8" path: GGUF block weights (npud/kernels/ggml/q8gemm.py lays them out) multiplied by
 * activations quantized per row in blocks of QB = 32 (npud_quantize_q8: llama.cpp's q8_0
 * rounding, d = max|x| / 127, q = round(x / d)), with exact integer sums.
 *
 * Weights: q tiles [ntiles, K / 4, TILE, 4] uint8 holding q + 128 (q the block's small integer,
 * npud/kernels/ggml/blocks.py), factor tiles [ntiles, K / g, P, TILE] float32 (S, then D for P = 2),
 * g = 32 (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K) or 16 (Q6_K). Weight (n, k) is S * q (- D): gguf's own
 * dequantized weight. Two smaller forms of the same numbers (npud/kernels/ggml/gemm.py picks them at
 * packing; the bits do not depend on the form):
 * - factor tiles in float16 where every S is a float16 value (Q8_0, Q4_0, Q5_0: S is the block's
 *   own fp16 d), widened exactly (vcvtph2ps, or half_to_float below);
 * - Q4_0 / Q5_0 / Q4_K / Q5_K q tiles packed (qbits 4 / 5, npud/kernels/ggml/nibbles.py): per tile and group of 32 k,
 *   8 rows of 128 bytes (row k4: byte b of the first 64 holds the byte tiles' vector 0 byte b in
 *   its low nibble and vector 1's in its high one, the next 64 vectors 2 and 3), then for 5 bits
 *   4 x 64 bytes (vector v's byte b: bit k4 the fifth bit of row k4's byte); u = q + Z with Z = 8
 *   / 16 / 0 / 0 (qzero) in place of 128, unpacked in registers, the sum started at -Z * s_G. For row m and column n, over the weight groups G = 0, 1, ... in k order:
 *   i_G = sum over the group's k of q[n,k] * xq[m,k]            (exact, int32: any order)
 *   v   = (float) i_G * S_G                                      (one rounding)
 *   v   = fma(-D_G, (float) s_G, v)   (P = 2; s_G = sum of the group's xq, exact)
 *   acc = fma(v, d[m, b(G)], acc)     (d: the row's scale of the activation block holding G)
 * then y = acc + bias[n] (if any). Every value in the chain is row m's own, so a row's bits do
 * not depend on the other rows; integer sums are exact, so VNNI's vpdpbusd (u8 x s8 in groups
 * of four, with the sum started at -128 * s_G to undo the + 128), the AVX2 build and the generic
 * C give the same bits. Rows go in blocks of MAXR_Q8, groups in chunks when there are several
 * blocks (the partial sums wait in the output, stored and reloaded exactly) or, on the VNNI path for a
 * weight streamed from memory (bq_stream_min), every block over each group in turn (bq_vnni_multi);
 * threads take whole tiles (pool.c). */

/* Factor i (an index into the factor tiles) of job j as float32. */
static inline __attribute__((always_inline)) float fac_at(const job_t *j, size_t i) {
    return j->fac16 ? half_to_float(((const uint16_t *)j->fac)[i]) : j->fac[i];
}

/* u of column c, k = 4 k4 + i of a group's packed q tiles (qbits 4 or 5) at wg. */
static inline __attribute__((always_inline)) int32_t bq_packed_u(const int qbits, const uint8_t *wg, int k4, int c,
                                                                 int i) {
    const int v = c / 16, b = (c % 16) * 4 + i;
    int32_t u = (wg[k4 * 128 + (v / 2) * 64 + b] >> (4 * (v % 2))) & 15;
    if (qbits == 5) u |= ((wg[1024 + v * 64 + b] >> k4) & 1) << 4;
    return u;
}

#define BQ_KC 512 /* k per chunk when several row blocks share a tile's weights (32 KiB of them): the chunked blocks */

static inline __attribute__((always_inline)) void bq_gen_block(const job_t *j, long t, float *o, long ldo, long r0,
                                                               long R, long g0, long g1) {
    const long K = j->K, g = j->group, P = j->parts, ng = K / g, nb = K / QB;
    const int qb = j->qbits;
    const size_t gbytes = (size_t)g * TILE * qb / 8;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * ng * gbytes;
    const size_t ft = (size_t)t * ng * P * TILE; /* the tile's first factor */
    float acc[MAXR_Q8][TILE];
    int32_t isum[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = g0 == 0 ? 0.0f : o[r * ldo + c];
    for (long G = g0; G < g1; G++) {
        const size_t f = ft + G * P * TILE;
        for (long r = 0; r < R; r++) {
            const int8_t *xq = j->xq + (r0 + r) * K + G * g;
            const int32_t s = j->xsum[(r0 + r) * ng + G];
            for (int c = 0; c < TILE; c++) isum[c] = -j->qzero * s;
            const uint8_t *wg = wt + G * gbytes;
            for (int k4 = 0; k4 < g / 4; k4++) {
                const uint8_t *wp = wg + (size_t)k4 * TILE * 4;
                for (int c = 0; c < TILE; c++)
                    for (int i = 0; i < 4; i++)
                        isum[c] += (int32_t)xq[k4 * 4 + i] * (qb == 8 ? (int32_t)wp[c * 4 + i] : bq_packed_u(qb, wg, k4, c, i));
            }
            const float d = j->xs[(r0 + r) * nb + G * g / QB], sf = (float)s;
            for (int c = 0; c < TILE; c++) {
                float v = (float)isum[c] * fac_at(j, f + c);
                if (P == 2) v = fmaf(-fac_at(j, f + TILE + c), sf, v);
                acc[r][c] = fmaf(v, d, acc[r][c]);
            }
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            o[r * ldo + c] = g1 == ng ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

/* 16 factors from i on as float32 (H: the factor tiles are float16). */
static inline __attribute__((always_inline)) TVNNI __m512 bq_fac16(const int H, const float *f32, const uint16_t *f16,
                                                                  size_t i) {
    return H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(f16 + i))) : _mm512_loadu_ps(f32 + i);
}

/* Rows r0 .. r0 + R - 1 (output row r at o + r * ldo) x 64 columns for groups [g0, g1): per group, 4R int32 sums by vpdpbusd (each weight
 * vector loaded, or unpacked, once for the R rows), then the float step into 4R float accumulators: in registers
 * up to 2 rows, past that in o (L1: the driver's row buffer), so that the registers hold the int32
 * sums (measured 1.2-1.5x at 8 and 64 rows on Zen 4). H: float16 factors; Q: qbits (8, 5, 4). */

/* Group wg's four weight vectors of k4 as bytes u (+ 128 for Q = 8, the nibbles for Q = 4, with the
 * fifth bit from hb for Q = 5), the operand vpdpbusd takes: one place for every VNNI path. */
static inline __attribute__((always_inline)) TVNNI void bq_weights(const int Q, const uint8_t *wg, int k4,
                                                                   const __m512i hb[4], __m512i w[4]) {
    if (Q == 8) {
        const uint8_t *wp = wg + (size_t)k4 * TILE * 4;
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_si512(wp + 64 * v);
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const __m512i n0 = _mm512_loadu_si512(wg + 128 * k4), n1 = _mm512_loadu_si512(wg + 128 * k4 + 64);
    w[0] = _mm512_and_si512(n0, low4), w[1] = _mm512_and_si512(_mm512_srli_epi16(n0, 4), low4);
    w[2] = _mm512_and_si512(n1, low4), w[3] = _mm512_and_si512(_mm512_srli_epi16(n1, 4), low4);
    if (Q == 5) { /* + 16 where the plane's bit k4 is set */
        const __m512i bit = _mm512_set1_epi8((char)(1 << k4));
        for (int v = 0; v < 4; v++) w[v] = _mm512_mask_add_epi8(w[v], _mm512_test_epi8_mask(hb[v], bit), w[v], sixteen);
    }
}

static inline __attribute__((always_inline)) TVNNI void bq_vnni_rows(const int R, const int P, const int g, const int H,
                                                                     const int Q, const job_t *j, long t, float *o,
                                                                     long ldo, long r0, long g0, long g1) {
    const long K = j->K, ng = K / g, nb = K / QB;
    const size_t gbytes = (size_t)g * TILE * Q / 8, tbytes = ng * gbytes; /* a group's, a tile's q bytes */
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * tbytes;
    const size_t ft = (size_t)t * ng * P * TILE; /* the tile's first factor */
    const float *f32 = j->fac;
    const uint16_t *f16 = (const uint16_t *)j->fac;
    const size_t fbytes = H ? 2 : 4;
    const int8_t *xq = j->xq + r0 * K;
    const float *xs = j->xs + r0 * nb;
    const int32_t *xsum = j->xsum + r0 * ng;
    /* several rows: the tile's first row block fetches the next tile (the other blocks reread
     * this one from cache, with no stream of their own to overlap) */
    const int ahead = j->M > 1 && r0 == 0;
    __m512 acc[MAXR_Q8][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++)
            acc[r][v] = g0 == 0 || R > 2 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * v);
    for (long G = g0; G < g1; G++) {
        __m512i isum[MAXR_Q8][4];
        for (int r = 0; r < R; r++) {
            const __m512i init = _mm512_set1_epi32(-j->qzero * xsum[r * ng + G]);
            for (int v = 0; v < 4; v++) isum[r][v] = init;
        }
        const uint8_t *wg = wt + G * gbytes;
        __m512i hb[4];
        if (Q == 5)
            for (int v = 0; v < 4; v++) hb[v] = _mm512_loadu_si512(wg + 1024 + 64 * v);
        for (int k4 = 0; k4 < g / 4; k4++) {
            /* prefetch this k4's share of the group's stream (gbytes / 8: 256, 160 or 128 bytes) */
            const char *pf = (const char *)wg + k4 * (gbytes / 8) + PF_BYTES;
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            if (Q != 4) _mm_prefetch(pf + 128, _MM_HINT_T0);
            if (Q == 8) _mm_prefetch(pf + 192, _MM_HINT_T0);
            if (ahead) { /* the next tile's same lines into L2: its stream overlaps this tile's sums */
                _mm_prefetch(pf - PF_BYTES + tbytes, _MM_HINT_T1);
                _mm_prefetch(pf - PF_BYTES + tbytes + 64, _MM_HINT_T1);
                if (Q != 4) _mm_prefetch(pf - PF_BYTES + tbytes + 128, _MM_HINT_T1);
                if (Q == 8) _mm_prefetch(pf - PF_BYTES + tbytes + 192, _MM_HINT_T1);
            }
            __m512i w[4];
            bq_weights(Q, wg, k4, hb, w);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + G * g + k4 * 4, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w[0], xb);
                isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w[1], xb);
                isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w[2], xb);
                isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w[3], xb);
            }
        }
        const size_t f = ft + G * P * TILE;
        const char *fp = (const char *)j->fac + f * fbytes;
        _mm_prefetch(fp + 4 * P * TILE * fbytes, _MM_HINT_T0);
        if (ahead) _mm_prefetch(fp + ng * P * TILE * fbytes, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(xs[r * nb + G * g / QB]);
            const __m512 sf = _mm512_set1_ps((float)xsum[r * ng + G]);
            for (int v = 0; v < 4; v++) {
                __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][v]), bq_fac16(H, f32, f16, f + 16 * v));
                if (P == 2) val = _mm512_fnmadd_ps(_mm512_loadu_ps(f32 + f + TILE + 16 * v), sf, val);
                if (R <= 2) {
                    acc[r][v] = _mm512_fmadd_ps(val, d, acc[r][v]);
                } else { /* more rows: the float sums wait in o (L1), the registers hold the int32 ones */
                    float *p = o + r * ldo + 16 * v;
                    _mm512_storeu_ps(p, _mm512_fmadd_ps(val, d, G == g0 && g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(p)));
                }
            }
        }
    }
    const int last = g1 == ng;
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) {
            if (R > 2) acc[r][v] = _mm512_loadu_ps(o + r * ldo + 16 * v);
            if (last) store16(j, o + r * ldo + 16 * v, acc[r][v], t * TILE + 16 * v, 1);
            else _mm512_storeu_ps(o + r * ldo + 16 * v, acc[r][v]);
        }
}

/* Several row blocks, interleaved per group: group G's weights come in once (its stream, and the
 * next tile's, prefetched ahead of the first block) and every row block of the M rows at o (row r
 * at o + r * ldo, rows r0.. of the job) runs over them while they are in L1, one block of up to
 * MAXR_Q8 rows at a time with its 4R int32 sums in registers; the float sums wait in o. Each row's
 * chain is the one bq_vnni_rows gives it (same int32 sums, same float steps in group order). */
static inline __attribute__((always_inline)) TVNNI void bq_vnni_grp(const int R, const int P, const int g, const int H,
                                                                    const int Q, const int pf, const job_t *j,
                                                                    const uint8_t *wg, size_t tbytes, size_t f, float *o,
                                                                    long ldo, long r0, long G) {
    /* o: the block's first row (job row r0) */
    const long K = j->K, ng = K / g, nb = K / QB;
    const float *f32 = j->fac;
    const uint16_t *f16 = (const uint16_t *)j->fac;
    const int8_t *xq = j->xq + r0 * K + G * g;
    const float *xs = j->xs + r0 * nb;
    const int32_t *xsum = j->xsum + r0 * ng;
    __m512i isum[MAXR_Q8][4];
    for (int r = 0; r < R; r++) {
        const __m512i init = _mm512_set1_epi32(-j->qzero * xsum[r * ng + G]);
        for (int v = 0; v < 4; v++) isum[r][v] = init;
    }
    __m512i hb[4];
    if (Q == 5)
        for (int v = 0; v < 4; v++) hb[v] = _mm512_loadu_si512(wg + 1024 + 64 * v);
    const size_t gbytes = (size_t)g * TILE * Q / 8;
    for (int k4 = 0; k4 < g / 4; k4++) {
        if (pf) { /* the first block: this k4's share of the group PF_BYTES on (L1) and of the next tile's (L2) */
            const char *p = (const char *)wg + k4 * (gbytes / 8);
            for (size_t b = 0; b < gbytes / 8; b += 64) {
                _mm_prefetch(p + PF_BYTES + b, _MM_HINT_T0);
                _mm_prefetch(p + tbytes + b, _MM_HINT_T1);
            }
        }
        __m512i w[4];
        bq_weights(Q, wg, k4, hb, w);
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, xq + r * K + k4 * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w[0], xb);
            isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w[1], xb);
            isum[r][2] = _mm512_dpbusd_epi32(isum[r][2], w[2], xb);
            isum[r][3] = _mm512_dpbusd_epi32(isum[r][3], w[3], xb);
        }
    }
    __m512 fs[4], fd[4];
    for (int v = 0; v < 4; v++) {
        fs[v] = bq_fac16(H, f32, f16, f + 16 * v);
        if (P == 2) fd[v] = _mm512_loadu_ps(f32 + f + TILE + 16 * v);
    }
    for (int r = 0; r < R; r++) {
        const __m512 d = _mm512_set1_ps(xs[r * nb + G * g / QB]);
        const __m512 sf = _mm512_set1_ps((float)xsum[r * ng + G]);
        for (int v = 0; v < 4; v++) {
            __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][v]), fs[v]);
            if (P == 2) val = _mm512_fnmadd_ps(fd[v], sf, val);
            float *p = o + r * ldo + 16 * v;
            _mm512_storeu_ps(p, _mm512_fmadd_ps(val, d, G == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(p)));
        }
    }
}

/* Rows r0 .. r0 + M - 1 of the job (output row r at o + (r - r0) * ldo: the driver's buffer) in
 * nblocks row blocks (row_block), all groups, the blocks interleaved per group. */
static inline __attribute__((always_inline)) TVNNI void bq_vnni_multi(const int P, const int g, const int H,
                                                                      const int Q, const job_t *j, long t, float *o,
                                                                      long ldo, long r0, long M) {
    const long K = j->K, ng = K / g;
    const size_t gbytes = (size_t)g * TILE * Q / 8, tbytes = ng * gbytes;
    const uint8_t *wt = (const uint8_t *)j->w + (size_t)t * tbytes;
    const size_t ft = (size_t)t * ng * P * TILE, fbytes = H ? 2 : 4;
    const long nblocks = (M + MAXR_Q8 - 1) / MAXR_Q8;
    long b0[64 / MAXR_Q8], bn[64 / MAXR_Q8]; /* the driver's BQ_ROWS rows at most */
    for (long i = 0; i < nblocks; i++) row_block(M, MAXR_Q8, i, nblocks, &b0[i], &bn[i]);
    for (long G = 0; G < ng; G++) {
        const uint8_t *wg = wt + G * gbytes;
        const size_t f = ft + G * P * TILE;
        const char *fp = (const char *)j->fac + f * fbytes;
        _mm_prefetch(fp + 4 * P * TILE * fbytes, _MM_HINT_T0);
        _mm_prefetch(fp + ng * P * TILE * fbytes, _MM_HINT_T1);
#define BQ_GRP(R, PF) bq_vnni_grp(R, P, g, H, Q, PF, j, wg, tbytes, f, o + b0[i] * ldo, ldo, r0 + b0[i], G)
        for (long i = 0; i < nblocks; i++) {
            if (i == 0) { /* the stream's prefetches */
                if (bn[i] == 4) BQ_GRP(4, 1);
                else if (bn[i] == 3) BQ_GRP(3, 1);
                else BQ_GRP(2, 1); /* several blocks: 2 rows at least each */
            } else {
                if (bn[i] == 4) BQ_GRP(4, 0);
                else if (bn[i] == 3) BQ_GRP(3, 0);
                else BQ_GRP(2, 0);
            }
        }
#undef BQ_GRP
    }
    for (long r = 0; r < M; r++)
        for (int v = 0; v < 4; v++)
            store16(j, o + r * ldo + 16 * v, _mm512_loadu_ps(o + r * ldo + 16 * v), t * TILE + 16 * v, 1);
}

#define BQ_ROWS(P, g, H, Q)                                                                          \
    switch (R) {                                                                                     \
    case 1: bq_vnni_rows(1, P, g, H, Q, j, t, o, ldo, r0, g0, g1); break;                            \
    case 2: bq_vnni_rows(2, P, g, H, Q, j, t, o, ldo, r0, g0, g1); break;                            \
    case 3: bq_vnni_rows(3, P, g, H, Q, j, t, o, ldo, r0, g0, g1); break;                            \
    default: bq_vnni_rows(4, P, g, H, Q, j, t, o, ldo, r0, g0, g1); break;                           \
    }

static inline __attribute__((always_inline)) TVNNI void bq_vnni_block(const job_t *j, long t, float *o, long ldo,
                                                                      long r0, long R, long g0, long g1) {
    if (j->parts == 2) { /* Q4_K, Q5_K: float32 factors, q tiles of bytes or packed */
        if (j->qbits == 8) {
            BQ_ROWS(2, 32, 0, 8)
        } else if (j->qbits == 5) {
            BQ_ROWS(2, 32, 0, 5)
        } else {
            BQ_ROWS(2, 32, 0, 4)
        }
    } else if (j->group == 16) {
        BQ_ROWS(1, 16, 0, 8)
    } else if (j->qbits != 8) { /* Q4_0, Q5_0: float16 factors (S = d) */
        if (j->qbits == 5) {
            BQ_ROWS(1, 32, 1, 5)
        } else {
            BQ_ROWS(1, 32, 1, 4)
        }
    } else if (j->fac16) {
        BQ_ROWS(1, 32, 1, 8)
    } else {
        BQ_ROWS(1, 32, 0, 8)
    }
}

/* Weights of at least this many q bytes take bq_vnni_multi for several row blocks (the output
 * layer: its 8 rows 1.2-1.3x its 1-row call where the chunked blocks take 1.5x, one thread); smaller
 * ones, which a call finds in cache when it runs over and over, keep the chunked row blocks (measured
 * 10-20% faster at 8 and 16 rows on gemma's layer shapes there). npud_bq8_stream_min changes it (tests). */
static size_t bq_stream_min = (size_t)8 << 20;

/* Sets the threshold above when bytes >= 0; returns the one before. */
long npud_bq8_stream_min(long bytes) {
    const long before = (long)bq_stream_min;
    if (bytes >= 0) bq_stream_min = (size_t)bytes;
    return before;
}

/* bq_vnni_multi for the job's format: 1 (done), or 0 for a weight under bq_stream_min (the driver's
 * chunked row blocks then). */
#define BQ_MULTI(P, g, H, Q) bq_vnni_multi(P, g, H, Q, j, t, o, ldo, r0, M)
static inline __attribute__((always_inline)) TVNNI int bq_vnni_multi_any(const job_t *j, long t, float *o, long ldo,
                                                                        long r0, long M) {
    if ((size_t)j->ntiles * (j->K / j->group) * j->group * TILE * j->qbits / 8 < bq_stream_min) return 0;
    if (j->parts == 2) {
        if (j->qbits == 8) BQ_MULTI(2, 32, 0, 8);
        else if (j->qbits == 5) BQ_MULTI(2, 32, 0, 5);
        else BQ_MULTI(2, 32, 0, 4);
    } else if (j->group == 16) {
        BQ_MULTI(1, 16, 0, 8);
    } else if (j->qbits != 8) {
        if (j->qbits == 5) BQ_MULTI(1, 32, 1, 5);
        else BQ_MULTI(1, 32, 1, 4);
    } else if (j->fac16) {
        BQ_MULTI(1, 32, 1, 8);
    } else {
        BQ_MULTI(1, 32, 0, 8);
    }
    return 1;
}

/* One tile for every row: row blocks of at most MAXR_Q8 rows; with several blocks, groups go in
 * chunks of BQ_KC k so the chunk of the tile stays in cache while every block runs over it. Several
 * rows go through a buffer of BQ_ROWS x 64 (rows 256 bytes apart) and are copied out at the end:
 * the output's rows lie N floats apart, a multiple of 4 KiB for wide layers, so that the rows'
 * partial sums written straight into it share a few cache sets (gemma's head: 3x slower at 8 rows). */
#define BQ_ROWS 64
#define BQ_DRIVER(NAME, ATTR, BLOCK, MULTI)                                                          \
    ATTR static void NAME(const job_t *j, long t, float *o, long ldo) {                              \
        const long ng = j->K / j->group;                                                             \
        if (j->M == 1) {                                                                             \
            BLOCK(j, t, o, ldo, 0, 1, 0, ng);                                                        \
            return;                                                                                  \
        }                                                                                            \
        float buf[BQ_ROWS * TILE] __attribute__((aligned(64)));                                      \
        for (long m0 = 0; m0 < j->M; m0 += BQ_ROWS) {                                                \
            const long mr = j->M - m0 < BQ_ROWS ? j->M - m0 : BQ_ROWS;                               \
            const long nblocks = (mr + MAXR_Q8 - 1) / MAXR_Q8;                                       \
            if (nblocks > 1 && MULTI(j, t, buf, TILE, m0, mr)) {                                     \
                for (long r = 0; r < mr; r++)                                                        \
                    memcpy(o + (m0 + r) * ldo, buf + r * TILE, TILE * sizeof(float));                \
                continue;                                                                            \
            }                                                                                        \
            const long chunk = nblocks == 1 ? ng : BQ_KC / j->group;                                 \
            for (long g0 = 0; g0 < ng; g0 += chunk) {                                                \
                const long g1 = g0 + chunk < ng ? g0 + chunk : ng;                                   \
                for (long i = 0; i < nblocks; i++) {                                                 \
                    long r0, rn;                                                                     \
                    row_block(mr, MAXR_Q8, i, nblocks, &r0, &rn);                                    \
                    BLOCK(j, t, buf + r0 * TILE, TILE, m0 + r0, rn, g0, g1);                         \
                }                                                                                    \
            }                                                                                        \
            for (long r = 0; r < mr; r++) memcpy(o + (m0 + r) * ldo, buf + r * TILE, TILE * sizeof(float)); \
        }                                                                                            \
    }

#define BQ_NO_MULTI(j, t, o, ldo, r0, M) 0 /* the chunked row blocks */
BQ_DRIVER(tile_bq_generic, __attribute__((noinline)), bq_gen_block, BQ_NO_MULTI)
BQ_DRIVER(tile_bq_avx2, __attribute__((noinline, target("avx2,fma"))), bq_gen_block, BQ_NO_MULTI)
BQ_DRIVER(tile_bq_avx512, __attribute__((noinline)) T512, bq_gen_block, BQ_NO_MULTI)
BQ_DRIVER(tile_bq_vnni, __attribute__((noinline)) TVNNI, bq_vnni_block, bq_vnni_multi_any)

/* The q8 rows of x (npud_quantize_q8) and each weight group's sum of a row's int8 activations
 * (exact), rows m0..m1-1: each row's own numbers, so the rows may go in blocks on any thread. */
typedef struct {
    const float *x;
    long K, group;
    int8_t *xq;
    float *xs;
    int32_t *bsum, *gsum;
    long M, blocks;
} bq_prep_t;

static void bq_prep_rows(const bq_prep_t *p, long m0, long m1) {
    const long K = p->K, nb = K / QB, ng = K / p->group;
    npud_quantize_q8(p->x + m0 * K, m1 - m0, K, K, p->xq + m0 * K, p->xs + m0 * nb, p->bsum + m0 * nb);
    for (long m = m0; m < m1; m++)
        for (long G = 0; G < ng; G++) {
            int32_t s = 0;
            for (long k = G * p->group; k < (G + 1) * p->group; k++) s += p->xq[m * K + k];
            p->gsum[m * ng + G] = s;
        }
}

static void bq_prep_unit(void *ctx, long i) {
    const bq_prep_t *p = ctx;
    bq_prep_rows(p, p->M * i / p->blocks, p->M * (i + 1) / p->blocks);
}

/* out[M, ntiles*TILE] = x[M, K] @ W.T (+ bias [N] or NULL) for block weights against q8 rows:
 * q [ntiles, K / 4, TILE, 4] uint8 (q + 128), fac [ntiles, K / group, parts, TILE] float32 (or
 * float16 when fac16, for parts 1 and group 32 only: else -2); qbits 8, or 4 / 5 for packed q tiles
 * [ntiles, K / 32, 1024 or 1280] (group 32: else -2), u = q + qzero; K a multiple of QB and of group.
 * Returns as npud_gemm (gemm.c). */
long npud_linear_bq8(const float *x, long M, long K, const uint8_t *q, const void *fac, long group, long parts,
                     int fac16, int qbits, int qzero, long ntiles, long N, const float *bias, float *out,
                     int threads) {
    if (fac16 && (parts != 1 || group != 32)) return -2; /* float16 factors: the (S, g = 32) formats only */
    /* packed q: Q4_0 / Q5_0's with float16 S, Q4_K / Q5_K's (float32 S, D) */
    if (qbits != 8 && (qbits != 4 && qbits != 5 || group != 32 || (parts == 1) != (fac16 != 0))) return -2;
    const long nb = K / QB, ng = K / group;
    const size_t qbytes = ((size_t)M * K + 63) / 64 * 64;
    job_t *j = job_new(ntiles, qbytes + (size_t)M * nb * (sizeof(float) + sizeof(int32_t)) +
                                   (size_t)M * ng * sizeof(int32_t));
    if (!j) return -1;
    int8_t *xq = job_extra(j, ntiles);
    float *xs = (float *)((char *)xq + qbytes);
    int32_t *bsum = (int32_t *)(xs + M * nb);
    int32_t *gsum = bsum + M * nb;
    bq_prep_t prep = {x, K, group, xq, xs, bsum, gsum, M, 1};
    if (threads > 1 && M > 1 && M * K >= PREP_PARALLEL_MIN) { /* a prefill chunk's rows on the pool's threads */
        prep.blocks = M < 4 * threads ? M : 4 * threads;
        pool_for(threads, prep.blocks, bq_prep_unit, &prep);
    } else {
        bq_prep_rows(&prep, 0, M);
    }
    j->fmt = FMT_BQ, j->M = M, j->K = K, j->w = q, j->fac = fac, j->group = group, j->parts = parts, j->fac16 = fac16, j->qbits = qbits, j->qzero = qzero;
    j->ntiles = ntiles, j->N = N, j->bias = bias, j->out = out, j->xq = xq, j->xs = xs, j->xsum = gsum;
    const int isa = isa_in_use();
    j->tile = isa >= ISA_AVX512_VNNI ? tile_bq_vnni
              : isa == ISA_AVX512    ? tile_bq_avx512
              : isa == ISA_AVX2      ? tile_bq_avx2
                                     : tile_bq_generic;
    return dispatch(j, threads);
}

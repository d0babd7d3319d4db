#include "gemm.h"

/* ------------------------------------------------------------------ GGML block weights ("qtiles") */
/* Weights as npud/kernels/ggml/gemm.py lays them out: q tiles, one row of the tile's 64 columns per k,
 * and factor tiles [ntiles, K / g, P, TILE] float32, or float16 where every factor is a float16
 * value (fac16: Q8_0's, Q4_0's and Q5_0's S is the block's fp16 d), widened exactly (vcvtph2ps,
 * or half_to_float); g = 16 or 32 weights a group; P = 1: S, P = 2: S then D. A k row of q
 * (npud/kernels/ggml/nibbles.py, qt_q below) is
 *   qbits 8: 64 int8 q (column c at byte c)                          [ntiles, K, 64]
 *   qbits 4: 32 bytes, byte b holding u of column b in its low nibble and of column b + 32 in its
 *            high one, q = u - qzero (Q4_0: 8, Q4_K: 0)               [ntiles, K, 32]
 *   qbits 5: those 32 bytes, then 8 bytes whose bit c (byte c / 8, bit c % 8) is the fifth bit of
 *            column c's u (Q5_0: qzero 16, Q5_K: 0)                    [ntiles, K, 40]
 * and unpacked in registers to the same integers. Weight (n, k) is widened with the reference
 * dequantization's own operations, each rounded:
 *   w = S * q            (P = 1: Q8_0, Q4_0, Q5_0, Q6_K)
 *   w = S * q - D        (P = 2: Q4_K, Q5_K)
 * so it is bit for bit gguf's dequantized weight (npud/kernels/ggml/blocks.py), and then the element
 * is gemm.c's float chain over those weights: acc = 0; for k = 0..K-1: acc = fma(x[m,k], w[n,k], acc);
 * then y = acc + bias[n] (if any). Padded columns hold q = 0 and S = D = 0: they widen to 0.
 * Rows are blocked in registers (each weight vector widened once per k for every row of the
 * block; past 24 rows, once per k for all blocks, into an L1 buffer), k goes in chunks when
 * there are several blocks (the partial sums wait in the output, stored and reloaded exactly),
 * threads take whole tiles (pool.c): no element's chain changes, so the AVX-512 path and the
 * generic C one give the same bits for any M, and so do the byte and the packed forms. */

/* Bytes of one k row of a tile's q for qbits Q. */
#define QT_ROW_BYTES(Q) ((Q) == 8 ? 64 : (Q) == 4 ? 32 : 40)

/* q of column c in the k row at `row` (qbits Q, u = q + zero). */
static inline __attribute__((always_inline)) int32_t qt_q(const int Q, const int zero, const uint8_t *row, int c) {
    if (Q == 8) return ((const int8_t *)row)[c];
    int32_t u = c < 32 ? row[c] & 15 : row[c - 32] >> 4;
    if (Q == 5) u |= (row[32 + c / 8] >> (c % 8) & 1) << 4;
    return u - zero;
}

/* Factor i (an index into the factor tiles) of job j as float32. */
static inline __attribute__((always_inline)) float qt_fac(const job_t *j, size_t i) {
    return j->fac16 ? half_to_float(((const uint16_t *)j->fac)[i]) : j->fac[i];
}

static inline __attribute__((always_inline)) float qt_widen1(const job_t *j, long t, long k, long c) {
    const long K = j->K, g = j->group;
    const size_t f = (((size_t)t * (K / g) + k / g) * j->parts) * TILE + c;
    const uint8_t *row = (const uint8_t *)j->w + ((size_t)t * K + k) * QT_ROW_BYTES(j->qbits);
    const int32_t q = j->qbits == 8 ? qt_q(8, 0, row, c) : j->qbits == 4 ? qt_q(4, j->qzero, row, c)
                                                                           : qt_q(5, j->qzero, row, c);
    const float v = qt_fac(j, f) * (float)q;
    return j->parts == 2 ? v - qt_fac(j, f + TILE) : v;
}

/* The generic C block (and, built for AVX2, the AVX2 path's): per group the factors widened once
 * into sf, df; per k the tile's 64 q unpacked and widened into wv, then each row's chain. */
static inline __attribute__((always_inline)) void qt_gen_rows(const int Q, const job_t *j, long t, float *o, long ldo,
                                                              long r0, long R, long k0, long k1) {
    const long K = j->K, g = j->group, P = j->parts;
    const uint8_t *qt = (const uint8_t *)j->w + (size_t)t * K * QT_ROW_BYTES(Q);
    float acc[MAXR][TILE];
    float wv[TILE], sf[TILE], df[TILE];
    int32_t qv[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = k0 == 0 ? 0.0f : o[(r0 + r) * ldo + c];
    for (long k = k0; k < k1; k++) {
        if (k == k0 || k % g == 0) {
            const size_t f = ((size_t)t * (K / g) + k / g) * P * TILE;
            for (int c = 0; c < TILE; c++) {
                sf[c] = qt_fac(j, f + c);
                df[c] = P == 2 ? qt_fac(j, f + TILE + c) : 0.0f;
            }
        }
        const uint8_t *row = qt + k * QT_ROW_BYTES(Q);
        if (Q == 8) {
            for (int c = 0; c < TILE; c++) qv[c] = ((const int8_t *)row)[c];
        } else {
            for (int c = 0; c < 32; c++) {
                qv[c] = (row[c] & 15) - j->qzero;
                qv[c + 32] = (row[c] >> 4) - j->qzero;
            }
            if (Q == 5) {
                uint32_t hi[2];
                memcpy(hi, row + 32, sizeof hi); /* little-endian: bit c of the 64-bit mask */
                for (int c = 0; c < 32; c++) {
                    qv[c] += (int32_t)(hi[0] >> c & 1) << 4;
                    qv[c + 32] += (int32_t)(hi[1] >> c & 1) << 4;
                }
            }
        }
        for (int c = 0; c < TILE; c++) {
            const float v = sf[c] * (float)qv[c];
            wv[c] = P == 2 ? v - df[c] : v;
        }
        for (long r = 0; r < R; r++) {
            const float xv = j->x[k * j->M + r0 + r];
            for (int c = 0; c < TILE; c++) acc[r][c] = fmaf(xv, wv[c], acc[r][c]);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            o[(r0 + r) * ldo + c] = k1 == j->K ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

static inline __attribute__((always_inline)) void qt_gen_block(const job_t *j, long t, float *o, long ldo, long r0,
                                                               long R, long k0, long k1) {
    if (j->qbits == 4) qt_gen_rows(4, j, t, o, ldo, r0, R, k0, k1);
    else if (j->qbits == 5) qt_gen_rows(5, j, t, o, ldo, r0, R, k0, k1);
    else qt_gen_rows(8, j, t, o, ldo, r0, R, k0, k1);
}

/* The 64 q of the k row at `row` (qbits Q) as 4 x 16 floats, columns 16v .. 16v + 15 in q[v]:
 * bytes sign-extended (Q = 8); else u, the low nibbles of bytes 0-31 (columns 0-31) and their
 * high nibbles (columns 32-63), + 16 where the fifth-bit mask's bit is set (Q = 5), as the float
 * 2^23 + u (u in the low mantissa bits), minus 2^23 + zero: u - zero, exactly. */
static inline __attribute__((always_inline)) T512 void qt_unpack(const int Q, const uint8_t *row, __m512 zero,
                                                                 __m512 q[4]) {
    if (Q == 8) {
        for (int v = 0; v < 4; v++)
            q[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * v))));
        return;
    }
    const __m512i e0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row));
    const __m512i e1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16)));
    const __m512i magic = _mm512_set1_epi32(0x4B000000), nib = _mm512_set1_epi32(15);
    __m512i u[4] = {_mm512_ternarylogic_epi32(e0, nib, magic, 0xEA), _mm512_ternarylogic_epi32(e1, nib, magic, 0xEA),
                    _mm512_or_si512(_mm512_srli_epi32(e0, 4), magic), _mm512_or_si512(_mm512_srli_epi32(e1, 4), magic)};
    if (Q == 5) { /* lane i of vector v: bit 16v + i of the mask, rotated to bit 4 */
        const __m512i b4 = _mm512_set1_epi32(16);
        const __m512i rot = _mm512_set_epi32(11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 31, 30, 29, 28);
        const __m512i rot16 = _mm512_add_epi32(rot, b4);
        for (int v = 0; v < 4; v++) {
            const __m512i m = _mm512_set1_epi32(*(const int32_t *)(row + 32 + 4 * (v / 2)));
            const __m512i bit = _mm512_rorv_epi32(m, v % 2 ? rot16 : rot);
            u[v] = _mm512_ternarylogic_epi32(u[v], bit, b4, 0xF8); /* u | (bit & 16) */
        }
    }
    for (int v = 0; v < 4; v++) q[v] = _mm512_sub_ps(_mm512_castsi512_ps(u[v]), zero);
}

/* 16 factors at index i of the factor tiles, float32 or float16 (widened exactly). */
static inline __attribute__((always_inline)) T512 __m512 qt_fac16(const job_t *j, size_t i) {
    return j->fac16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)j->fac + i)))
                    : _mm512_loadu_ps(j->fac + i);
}

/* R rows x 64 columns in 4R zmm accumulators for k in [k0, k1); per group the factors are
 * loaded once, per k the 64 weights are unpacked (qbits Q) and widened once (S * q, then - D)
 * and used by all R rows. */
static inline __attribute__((always_inline)) T512 void qt_rows(const int R, const int P, const int Q, const job_t *j,
                                                               long t, float *o, long ldo, long r0, long k0, long k1) {
    const long K = j->K, g = j->group, M = j->M;
    const uint8_t *qt = (const uint8_t *)j->w + (size_t)t * K * QT_ROW_BYTES(Q);
    const size_t ft = (size_t)t * (K / g) * P * TILE;
    const size_t fbytes = j->fac16 ? 2 : 4;
    const __m512 zero = _mm512_set1_ps(0x1p23f + (float)j->qzero);
    const float *x = j->x + r0;
    o += r0 * ldo;
    __m512 acc[MAXR][4];
    acc_load(R, acc, o, ldo, k0 == 0);
    for (long k = k0; k < k1;) {
        const long grp = k / g, kend = (grp + 1) * g < k1 ? (grp + 1) * g : k1;
        const size_t f = ft + grp * P * TILE;
        _mm_prefetch((const char *)j->fac + (f + P * TILE) * fbytes + PF_BYTES, _MM_HINT_T0);
        __m512 s[4], d[4];
        for (int v = 0; v < 4; v++) {
            s[v] = qt_fac16(j, f + 16 * v);
            d[v] = P == 2 ? qt_fac16(j, f + TILE + 16 * v) : _mm512_setzero_ps();
        }
        for (; k < kend; k++) {
            const uint8_t *row = qt + k * QT_ROW_BYTES(Q);
            _mm_prefetch((const char *)row + PF_BYTES, _MM_HINT_T0);
            __m512 w[4];
            qt_unpack(Q, row, zero, w);
            for (int v = 0; v < 4; v++) {
                w[v] = _mm512_mul_ps(s[v], w[v]);
                if (P == 2) w[v] = _mm512_sub_ps(w[v], d[v]);
            }
            fma_rows(R, acc, x + k * M, w);
        }
    }
    acc_store(R, j, acc, o, ldo, t, k1 == K);
}

#define QT_ROWS_PQ(P, Q)                                                                             \
    switch (R) {                                                                                     \
    case 1: qt_rows(1, P, Q, j, t, o, ldo, r0, k0, k1); break;                                       \
    case 2: qt_rows(2, P, Q, j, t, o, ldo, r0, k0, k1); break;                                       \
    case 3: qt_rows(3, P, Q, j, t, o, ldo, r0, k0, k1); break;                                       \
    case 4: qt_rows(4, P, Q, j, t, o, ldo, r0, k0, k1); break;                                       \
    case 5: qt_rows(5, P, Q, j, t, o, ldo, r0, k0, k1); break;                                       \
    default: qt_rows(6, P, Q, j, t, o, ldo, r0, k0, k1); break;                                      \
    }

#define QT_ROWS_P(P)                                                                                 \
    if (j->qbits == 4) {                                                                             \
        QT_ROWS_PQ(P, 4)                                                                             \
    } else if (j->qbits == 5) {                                                                      \
        QT_ROWS_PQ(P, 5)                                                                             \
    } else {                                                                                         \
        QT_ROWS_PQ(P, 8)                                                                             \
    }

static inline __attribute__((always_inline)) T512 void qt_avx512_block(const job_t *j, long t, float *o, long ldo,
                                                                       long r0, long R, long k0, long k1) {
    if (j->parts == 2) {
        QT_ROWS_P(2)
    } else {
        QT_ROWS_P(1)
    }
}

/* The weights of tile t for k in [k0, k1), widened once into wf [k1 - k0][TILE] (the same
 * operations as qt_rows, so the same floats), for calls with several row blocks to share. */
static inline __attribute__((always_inline)) T512 void qt_widen_chunk(const int P, const int Q, const job_t *j, long t,
                                                                      long k0, long k1, float *wf) {
    const long K = j->K, g = j->group;
    const uint8_t *qt = (const uint8_t *)j->w + (size_t)t * K * QT_ROW_BYTES(Q);
    const size_t ft = (size_t)t * (K / g) * P * TILE;
    const __m512 zero = _mm512_set1_ps(0x1p23f + (float)j->qzero);
    for (long k = k0; k < k1; k++) {
        const size_t f = ft + k / g * P * TILE;
        const uint8_t *row = qt + k * QT_ROW_BYTES(Q);
        _mm_prefetch((const char *)row + PF_BYTES, _MM_HINT_T0);
        __m512 q[4];
        qt_unpack(Q, row, zero, q);
        for (int v = 0; v < 4; v++) {
            __m512 w = _mm512_mul_ps(qt_fac16(j, f + 16 * v), q[v]);
            if (P == 2) w = _mm512_sub_ps(w, qt_fac16(j, f + TILE + 16 * v));
            _mm512_storeu_ps(wf + (k - k0) * TILE + 16 * v, w);
        }
    }
}

static inline __attribute__((always_inline)) T512 void qt_widen_any(const job_t *j, long t, long k0, long k1,
                                                                    float *wf) {
    const int Q = j->qbits;
    if (j->parts == 2) {
        if (Q == 4) qt_widen_chunk(2, 4, j, t, k0, k1, wf);
        else if (Q == 5) qt_widen_chunk(2, 5, j, t, k0, k1, wf);
        else qt_widen_chunk(2, 8, j, t, k0, k1, wf);
    } else {
        if (Q == 4) qt_widen_chunk(1, 4, j, t, k0, k1, wf);
        else if (Q == 5) qt_widen_chunk(1, 5, j, t, k0, k1, wf);
        else qt_widen_chunk(1, 8, j, t, k0, k1, wf);
    }
}

/* R rows x 64 columns from widened weights wf (k0's row first), as gemm.c's avx512_rows. */
static inline __attribute__((always_inline)) T512 void qt_rows_widened(const int R, const job_t *j, const float *wf,
                                                                       long t, float *o, long ldo, long r0, long k0,
                                                                       long k1) {
    const float *x = j->x + r0;
    const long M = j->M;
    o += r0 * ldo;
    __m512 acc[MAXR][4];
    acc_load(R, acc, o, ldo, k0 == 0);
    for (long k = k0; k < k1; k++) {
        const float *w = wf + (k - k0) * TILE;
        const __m512 wv[4] = {_mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), _mm512_loadu_ps(w + 32),
                              _mm512_loadu_ps(w + 48)};
        fma_rows(R, acc, x + k * M, wv);
    }
    acc_store(R, j, acc, o, ldo, t, k1 == j->K);
}

#define QT_KW 64 /* k rows of a tile widened at once when several row blocks share them (16 KiB) */

/* One tile for every row. Up to 24 rows (4 row blocks): each block widens the weights in
 * registers (qt_rows), k in chunks (as the generic driver) so the chunk of the tile stays in L1.
 * More rows: per chunk of QT_KW k, the tile's weights widened once into wf (L1) and every block
 * runs the float chain on them (measured: faster from about 32 rows, slower below). The partial
 * sums wait in o between chunks, stored and reloaded exactly. */
static __attribute__((noinline)) T512 void tile_qt_avx512(const job_t *j, long t, float *o, long ldo) {
    const long nblocks = (j->M + MAXR - 1) / MAXR;
    if (nblocks <= 4) {
        const long chunk = nblocks == 1 ? j->K : j->M <= 16 ? 256 : 128;
        for (long k0 = 0; k0 < j->K; k0 += chunk) {
            const long k1 = k0 + chunk < j->K ? k0 + chunk : j->K;
            for (long i = 0; i < nblocks; i++) {
                long r0, R;
                row_block(j->M, MAXR, i, nblocks, &r0, &R);
                qt_avx512_block(j, t, o, ldo, r0, R, k0, k1);
            }
        }
        return;
    }
    float wf[QT_KW * TILE] __attribute__((aligned(64)));
    for (long k0 = 0; k0 < j->K; k0 += QT_KW) {
        const long k1 = k0 + QT_KW < j->K ? k0 + QT_KW : j->K;
        qt_widen_any(j, t, k0, k1, wf);
        for (long i = 0; i < nblocks; i++) {
            long r0, R;
            row_block(j->M, MAXR, i, nblocks, &r0, &R);
            switch (R) {
            case 1: qt_rows_widened(1, j, wf, t, o, ldo, r0, k0, k1); break;
            case 2: qt_rows_widened(2, j, wf, t, o, ldo, r0, k0, k1); break;
            case 3: qt_rows_widened(3, j, wf, t, o, ldo, r0, k0, k1); break;
            case 4: qt_rows_widened(4, j, wf, t, o, ldo, r0, k0, k1); break;
            case 5: qt_rows_widened(5, j, wf, t, o, ldo, r0, k0, k1); break;
            default: qt_rows_widened(6, j, wf, t, o, ldo, r0, k0, k1); break;
            }
        }
    }
}

/* The generic paths: row blocks of at most MAXR rows, each widening the weights itself (its
 * chain is the same); with several blocks, k in chunks that keep the chunk of x for all rows and
 * of the tile in cache. */
#define QT_DRIVER(NAME, ATTR, BLOCK)                                                                 \
    ATTR static void NAME(const job_t *j, long t, float *o, long ldo) {                              \
        const long nblocks = (j->M + MAXR - 1) / MAXR;                                               \
        const long kc = j->M <= 16 ? 256 : j->M <= 32 ? 128 : 64;                                    \
        const long chunk = nblocks == 1 ? j->K : kc;                                                 \
        for (long k0 = 0; k0 < j->K; k0 += chunk) {                                                  \
            const long k1 = k0 + chunk < j->K ? k0 + chunk : j->K;                                   \
            for (long i = 0; i < nblocks; i++) {                                                     \
                long r0, rn;                                                                         \
                row_block(j->M, MAXR, i, nblocks, &r0, &rn);                                         \
                BLOCK(j, t, o, ldo, r0, rn, k0, k1);                                                 \
            }                                                                                        \
        }                                                                                            \
    }

QT_DRIVER(tile_qt_generic, __attribute__((noinline)), qt_gen_block)
QT_DRIVER(tile_qt_avx2, __attribute__((noinline, target("avx2,fma"))), qt_gen_block)

/* x [M, K] transposed into xt [K, M], its k0..k1-1 (a copy: k ranges may go on any thread) */
typedef struct {
    const float *x;
    float *xt;
    long M, K, blocks;
} qt_transpose_t;

static void qt_transpose(const qt_transpose_t *a, long k0, long k1) {
    const long M = a->M, K = a->K;
    for (long m0 = 0; m0 < M; m0 += 8) {
        const long m1 = m0 + 8 < M ? m0 + 8 : M;
        for (long k = k0; k < k1; k++)
            for (long m = m0; m < m1; m++) a->xt[k * M + m] = a->x[m * K + k];
    }
}

static void qt_transpose_unit(void *ctx, long i) {
    const qt_transpose_t *a = ctx;
    qt_transpose(a, a->K * i / a->blocks, a->K * (i + 1) / a->blocks);
}

/* out[M, ntiles*TILE] = x[M, K] @ W.T (+ bias [N] or NULL) for block weights: q tiles of qbits
 * 8 ([ntiles, K, TILE] int8), 4 or 5 (packed, u = q + qzero), fac [ntiles, K / group, parts, TILE]
 * float32 (float16 when fac16). Returns as npud_gemm (gemm.c), or -2 for a qbits not 8, 4 or 5. */
long npud_linear_qtiles(const float *x, long M, long K, const void *q, const void *fac, long group, long parts,
                        int fac16, int qbits, int qzero, long ntiles, long N, const float *bias, float *out,
                        int threads) {
    if (qbits != 8 && qbits != 4 && qbits != 5) return -2;
    job_t *j = job_new(ntiles, (size_t)M * K * sizeof(float));
    if (!j) return -1;
    float *xt = job_extra(j, ntiles); /* x transposed: [K, M], as npud_gemm's */
    qt_transpose_t tr = {x, xt, M, K, 1};
    if (threads > 1 && M > 1 && M * K >= PREP_PARALLEL_MIN) { /* a prefill chunk's k ranges on the pool's threads */
        tr.blocks = 4 * threads;
        pool_for(threads, tr.blocks, qt_transpose_unit, &tr);
    } else {
        qt_transpose(&tr, 0, K);
    }
    j->fmt = FMT_QT, j->M = M, j->K = K, j->x = xt, j->w = q, j->fac = fac, j->group = group, j->parts = parts;
    j->fac16 = fac16, j->qbits = qbits, j->qzero = qzero;
    j->ntiles = ntiles, j->N = N, j->bias = bias, j->out = out;
    const int isa = isa_in_use();
    j->tile = isa >= ISA_AVX512 ? tile_qt_avx512 : isa == ISA_AVX2 ? tile_qt_avx2 : tile_qt_generic;
    return dispatch(j, threads);
}

/* Rows tokens[m] (in range) of a [V, K] block table in the same tiles, widened: out [M, K]. */
void npud_gather_qtiles(const void *q, const void *fac, long K, long group, long parts, int fac16, int qbits,
                        int qzero, const int64_t *tokens, long M, float *out) {
    job_t j = {.K = K, .w = q, .fac = fac, .group = group, .parts = parts, .fac16 = fac16, .qbits = qbits,
               .qzero = qzero};
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) out[m * K + k] = qt_widen1(&j, tokens[m] / TILE, k, tokens[m] % TILE);
}

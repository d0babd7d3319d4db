#include "gemm.h"

/* ------------------------------------------------------------------ GGML block weights ("qtiles") */
/* Weights as kernels/ggml/gemm.py lays them out: q tiles [ntiles, K, TILE] int8 and factor tiles
 * [ntiles, K / g, P, TILE] float32 (g = 16 or 32 weights a group; P = 1: S, P = 2: S then D).
 * Weight (n, k) is widened with the reference dequantization's own operations, each rounded:
 *   w = S * q            (P = 1: Q8_0, Q4_0, Q5_0, Q6_K)
 *   w = S * q - D        (P = 2: Q4_K, Q5_K)
 * so it is bit for bit gguf's dequantized weight (kernels/ggml/blocks.py), and then the element
 * is gemm.c's float chain over those weights: acc = 0; for k = 0..K-1: acc = fma(x[m,k], w[n,k], acc);
 * then y = acc + bias[n] (if any). Padded columns hold q = 0 and S = D = 0: they widen to 0.
 * Rows are blocked in registers (each weight vector widened once per k for every row of the
 * block; past 24 rows, once per k for all blocks, into an L1 buffer), k goes in chunks when
 * there are several blocks (the partial sums wait in the output, stored and reloaded exactly),
 * threads take whole tiles (pool.c): no element's chain changes, so the AVX-512 path and the
 * generic C one give the same bits for any M. */

static inline __attribute__((always_inline)) float qt_widen1(const job_t *j, long t, long k, long c) {
    const long K = j->K, g = j->group;
    const float *f = j->fac + (((size_t)t * (K / g) + k / g) * j->parts) * TILE + c;
    const float v = f[0] * (float)((const int8_t *)j->w)[((size_t)t * K + k) * TILE + c];
    return j->parts == 2 ? v - f[TILE] : v;
}

static inline __attribute__((always_inline)) void qt_gen_block(const job_t *j, long t, float *o, long ldo, long r0,
                                                               long R, long k0, long k1) {
    float acc[MAXR][TILE];
    float wv[TILE];
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = k0 == 0 ? 0.0f : o[(r0 + r) * ldo + c];
    for (long k = k0; k < k1; k++) {
        for (int c = 0; c < TILE; c++) wv[c] = qt_widen1(j, t, k, c);
        for (long r = 0; r < R; r++) {
            const float xv = j->x[k * j->M + r0 + r];
            for (int c = 0; c < TILE; c++) acc[r][c] = fmaf(xv, wv[c], acc[r][c]);
        }
    }
    for (long r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++)
            o[(r0 + r) * ldo + c] = k1 == j->K ? store_value(j, acc[r][c], t * TILE + c) : acc[r][c];
}

/* R rows x 64 columns in 4R zmm accumulators for k in [k0, k1); per group the factors are
 * loaded once, per k the 64 weights are widened once (S * q, then - D) and used by all R rows. */
static inline __attribute__((always_inline)) T512 void qt_rows(const int R, const int P, const job_t *j, long t,
                                                               float *o, long ldo, long r0, long k0, long k1) {
    const long K = j->K, g = j->group, M = j->M;
    const int8_t *qt = (const int8_t *)j->w + (size_t)t * K * TILE;
    const float *ft = j->fac + (size_t)t * (K / g) * P * TILE;
    const float *x = j->x + r0;
    o += r0 * ldo;
    __m512 acc[MAXR][4];
    acc_load(R, acc, o, ldo, k0 == 0);
    for (long k = k0; k < k1;) {
        const long grp = k / g, kend = (grp + 1) * g < k1 ? (grp + 1) * g : k1;
        const float *f = ft + grp * P * TILE;
        _mm_prefetch((const char *)(f + P * TILE) + PF_BYTES, _MM_HINT_T0);
        __m512 s[4], d[4];
        for (int v = 0; v < 4; v++) {
            s[v] = _mm512_loadu_ps(f + 16 * v);
            d[v] = P == 2 ? _mm512_loadu_ps(f + TILE + 16 * v) : _mm512_setzero_ps();
        }
        for (; k < kend; k++) {
            const int8_t *row = qt + k * TILE;
            _mm_prefetch((const char *)row + PF_BYTES, _MM_HINT_T0);
            __m512 w[4];
            for (int v = 0; v < 4; v++) {
                const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * v))));
                w[v] = _mm512_mul_ps(s[v], q);
                if (P == 2) w[v] = _mm512_sub_ps(w[v], d[v]);
            }
            fma_rows(R, acc, x + k * M, w);
        }
    }
    acc_store(R, j, acc, o, ldo, t, k1 == K);
}

#define QT_ROWS_P(P)                                                                                 \
    switch (R) {                                                                                     \
    case 1: qt_rows(1, P, j, t, o, ldo, r0, k0, k1); break;                                          \
    case 2: qt_rows(2, P, j, t, o, ldo, r0, k0, k1); break;                                          \
    case 3: qt_rows(3, P, j, t, o, ldo, r0, k0, k1); break;                                          \
    case 4: qt_rows(4, P, j, t, o, ldo, r0, k0, k1); break;                                          \
    case 5: qt_rows(5, P, j, t, o, ldo, r0, k0, k1); break;                                          \
    default: qt_rows(6, P, j, t, o, ldo, r0, k0, k1); break;                                         \
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
static inline __attribute__((always_inline)) T512 void qt_widen_chunk(const int P, const job_t *j, long t, long k0,
                                                                      long k1, float *wf) {
    const long K = j->K, g = j->group;
    const int8_t *qt = (const int8_t *)j->w + (size_t)t * K * TILE;
    const float *ft = j->fac + (size_t)t * (K / g) * P * TILE;
    for (long k = k0; k < k1; k++) {
        const float *f = ft + k / g * P * TILE;
        const int8_t *row = qt + k * TILE;
        _mm_prefetch((const char *)row + PF_BYTES, _MM_HINT_T0);
        for (int v = 0; v < 4; v++) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * v))));
            __m512 w = _mm512_mul_ps(_mm512_loadu_ps(f + 16 * v), q);
            if (P == 2) w = _mm512_sub_ps(w, _mm512_loadu_ps(f + TILE + 16 * v));
            _mm512_storeu_ps(wf + (k - k0) * TILE + 16 * v, w);
        }
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
        if (j->parts == 2) qt_widen_chunk(2, j, t, k0, k1, wf);
        else qt_widen_chunk(1, j, t, k0, k1, wf);
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

/* out[M, ntiles*TILE] = x[M, K] @ W.T (+ bias [N] or NULL) for block weights: q [ntiles, K, TILE]
 * int8, fac [ntiles, K / group, parts, TILE] float32. Returns as npud_gemm (gemm.c). */
long npud_linear_qtiles(const float *x, long M, long K, const int8_t *q, const float *fac, long group, long parts,
                        long ntiles, long N, const float *bias, float *out, int threads) {
    job_t *j = job_new(ntiles, (size_t)M * K * sizeof(float));
    if (!j) return -1;
    float *xt = job_extra(j, ntiles); /* x transposed: [K, M], as npud_gemm's */
    for (long m0 = 0; m0 < M; m0 += 8) {
        const long m1 = m0 + 8 < M ? m0 + 8 : M;
        for (long k = 0; k < K; k++)
            for (long m = m0; m < m1; m++) xt[k * M + m] = x[m * K + k];
    }
    j->fmt = FMT_QT, j->M = M, j->K = K, j->x = xt, j->w = q, j->fac = fac, j->group = group, j->parts = parts;
    j->ntiles = ntiles, j->N = N, j->bias = bias, j->out = out;
    const int isa = isa_in_use();
    j->tile = isa >= ISA_AVX512 ? tile_qt_avx512 : isa == ISA_AVX2 ? tile_qt_avx2 : tile_qt_generic;
    return dispatch(j, threads);
}

/* Rows tokens[m] (in range) of a [V, K] block table in the same tiles, widened: out [M, K]. */
void npud_gather_qtiles(const int8_t *q, const float *fac, long K, long group, long parts, const int64_t *tokens,
                        long M, float *out) {
    job_t j = {.K = K, .w = q, .fac = fac, .group = group, .parts = parts};
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) out[m * K + k] = qt_widen1(&j, tokens[m] / TILE, k, tokens[m] % TILE);
}

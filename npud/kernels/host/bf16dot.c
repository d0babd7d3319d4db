#include "gemm.h"

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
    acc_load(R, acc, o, ldo, s0 == 0);
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
    acc_store(R, j, acc, o, ldo, t, s1 == np);
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
static atomic_int bd_hardware = 1;

static void (*tile_bd_for(int isa))(const job_t *, long, float *, long) {
    if (isa >= ISA_AVX512_BF16 && bd_hardware) return tile_bd_bf16;
    if (isa >= ISA_AVX512) return tile_bd_avx512;
    return isa == ISA_AVX2 ? tile_bd_avx2 : tile_bd_generic;
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
    j->tile = tile_bd_for(isa_in_use());
    return dispatch(j, threads);
}

/* bf16-dot's use of vdpbf16ps: 0 off (the emulation), 1 on where the CPU has it, -1 ask.
 * Returns whether the path in use now runs the instruction. */
int npud_bf16dot_hardware(int on) {
    if (on >= 0) bd_hardware = on;
    return isa_in_use() >= ISA_AVX512_BF16 && bd_hardware;
}

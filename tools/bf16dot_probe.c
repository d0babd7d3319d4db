/* What vdpbf16ps computes on this CPU: the instruction against candidate emulations on
 * adversarial lanes (cancellation, subnormal inputs and sums, exponents over the whole range,
 * inf and NaN). gemm.c's bd_step is the candidate that matches (on AMD Zen 4: every lane).
 *
 *   gcc -O2 -ffp-contract=off -o /tmp/bf16dot_probe tools/bf16dot_probe.c -lm && /tmp/bf16dot_probe
 *
 * Candidates, each a variant of "the high pair's exact product added to the accumulator with
 * one round-to-nearest-even to 24 significant bits whatever the exponent, a result below FLT_MIN
 * then flushed to a zero of its sign; then the low pair's" (the one that matches):
 *   even_first    the low pair first
 *   no_flush      subnormal results kept (IEEE gradual underflow)
 *   flush_before  a sum below FLT_MIN before rounding flushed (one that rounds up to it too)
 *   subnormal_grid  a sum just below FLT_MIN rounded on the subnormal grid (2^-149, IEEE's fma),
 *                 not to 24 significant bits (2^-150 there): differs in [FLT_MIN - 2^-150, FLT_MIN - 2^-151)
 *   one_rounding  both products and the accumulator summed exactly, rounded once
 * A mismatch count of 0 for "matches" and > 0 for every other candidate is the finding. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { MATCHES, EVEN_FIRST, NO_FLUSH, FLUSH_BEFORE, SUBNORMAL_GRID, ONE_ROUNDING, NCAND };
static const char *NAMES[NCAND] = {"matches", "even_first", "no_flush", "flush_before", "subnormal_grid",
                                   "one_rounding"};

static float f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bf(uint16_t b) { return f32((uint32_t)(b & 0x7f80 ? b : b & 0x8000) << 16); } /* inputs: DAZ */

__attribute__((target("avx512f,avx512bf16")))
static void hardware(const float *acc, const uint32_t *x, const uint32_t *w, float *out) {
    _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(x),
                                           (__m512bh)_mm512_loadu_si512(w)));
}

/* acc + p (p a bf16 product, exact in double) rounded once to 24 significant bits: the double
 * sum rounded to odd (TwoSum's error decides), then to float, so that no double rounding
 * happens; below FLT_MIN on the subnormal grid (subnormal_grid) or, scaled, on the 24-bit one
 * whatever the exponent */
static int subnormal_grid;
static float add_rounded(float acc, double p, int flush, int flush_before) {
    double s = (double)acc + p;
    if (isfinite(s)) {
        const double bb = s - acc, err = ((double)acc - (s - bb)) + (p - bb);
        uint64_t u;
        memcpy(&u, &s, 8);
        if (err != 0 && !(u & 1)) u += (s > 0) == (err > 0) ? 1 : (uint64_t)-1;
        memcpy(&s, &u, 8);
    }
    if (flush_before && fabs(s) < FLT_MIN) return copysignf(0.0f, (float)s);
    float r = (float)s;
    if (!subnormal_grid && fabs(s) < 0x1p-100) { /* rounded at 2^64 times the size, then compared there */
        const float scaled = (float)(s * 0x1p64);
        r = flush && fabsf(scaled) < 0x1p-62f ? copysignf(0.0f, scaled) : scaled * 0x1p-64f;
    }
    return flush && r != 0 && fabsf(r) < FLT_MIN ? copysignf(0.0f, r) : r;
}

/* one pair: NaN first (the first NaN of x, w, acc, quieted; else the default NaN) */
static float pair(float acc, uint16_t x, uint16_t w, int flush, int flush_before) {
    if ((x & 0x7fff) > 0x7f80) return f32((uint32_t)(x | 0x40) << 16);
    if ((w & 0x7fff) > 0x7f80) return f32((uint32_t)(w | 0x40) << 16);
    if (isnan(acc)) return f32(bits(acc) | 0x400000);
    const float a = bf(x), b = bf(w);
    if ((isinf(a) && b == 0) || (isinf(b) && a == 0)) return f32(0xffc00000u);
    const double p = (double)a * b;
    if (isinf(acc) && isinf(p) && (acc > 0) != (p > 0)) return f32(0xffc00000u);
    return add_rounded(acc, p, flush, flush_before);
}

static float candidate(int c, float acc, uint32_t x, uint32_t w) {
    if (fpclassify(acc) == FP_SUBNORMAL) acc = copysignf(0.0f, acc);
    const uint16_t xh = x >> 16, xl = x & 0xffff, wh = w >> 16, wl = w & 0xffff;
    switch (c) {
    case EVEN_FIRST: return pair(pair(acc, xl, wl, 1, 0), xh, wh, 1, 0);
    case NO_FLUSH: return pair(pair(acc, xh, wh, 0, 0), xl, wl, 0, 0);
    case FLUSH_BEFORE: return pair(pair(acc, xh, wh, 1, 1), xl, wl, 1, 1);
    case SUBNORMAL_GRID: {
        subnormal_grid = 1;
        const float r = pair(pair(acc, xh, wh, 1, 0), xl, wl, 1, 0);
        subnormal_grid = 0;
        return r;
    }
    case ONE_ROUNDING: {
        const long double s = (long double)acc + (long double)bf(xh) * bf(wh) + (long double)bf(xl) * bf(wl);
        const float r = (float)s;
        return isnan(r) || isinf(r) ? pair(pair(acc, xh, wh, 1, 0), xl, wl, 1, 0)
                                    : fabsf(r) < FLT_MIN ? copysignf(0.0f, r) : r;
    }
    default: return pair(pair(acc, xh, wh, 1, 0), xl, wl, 1, 0);
    }
}

static uint64_t state = 88172645463325252ull;
static uint64_t rnd(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }

/* a bf16 value: 0 near 1, 1 anywhere (1 in 16 an inf or NaN), 2 tiny (subnormal products), 3 both ends */
static uint16_t value(int mode) {
    int e;
    switch (mode) {
    case 0: e = 117 + (int)(rnd() % 20); break;
    case 1: e = (int)(rnd() % 255); if (rnd() % 16 == 0) e = 255; break;
    case 2: e = rnd() % 4 == 0 ? 0 : 1 + (int)(rnd() % 40); break;
    default: e = 1 + (int)(rnd() % 12) + (int)(rnd() % 2) * 120; break;
    }
    return (uint16_t)((rnd() & 1) << 15 | e << 7 | (rnd() & 0x7f));
}

int main(void) {
    long mismatches[NCAND] = {0}, lanes = 0;
    for (int it = 0; it < 400000; it++) {
        const int mode = it % 4;
        float acc[16], out[16];
        uint32_t x[16], w[16];
        for (int i = 0; i < 16; i++) {
            x[i] = value(mode) | (uint32_t)value(mode) << 16;
            w[i] = value(mode) | (uint32_t)value(mode) << 16;
            const float ph = bf(x[i] >> 16) * bf(w[i] >> 16), pl = bf(x[i] & 0xffff) * bf(w[i] & 0xffff);
            const float near = 1 + (float)(rnd() % 5 - 2) * 1e-7f;
            switch (rnd() % 5) { /* cancellation against either product or both, or anything */
            case 0: acc[i] = -ph * near; break;
            case 1: acc[i] = -pl * near; break;
            case 2: acc[i] = -(ph + pl) * near; break;
            case 3: acc[i] = f32((uint32_t)(rnd() & 0x807fffff) | (uint32_t)(rnd() % 3) << 23); break;
            default: acc[i] = f32((uint32_t)rnd()); break;
            }
        }
        hardware(acc, x, w, out);
        for (int i = 0; i < 16; i++, lanes++)
            for (int c = 0; c < NCAND; c++)
                mismatches[c] += bits(candidate(c, acc[i], x[i], w[i])) != bits(out[i]);
    }
    /* sums just below FLT_MIN: acc = +-FLT_MIN (1 + j ulp) less products m 2^-k */
    for (int j = 0; j < 4; j++)
        for (int k = 140; k < 176; k++) {
            float acc[16], out[16];
            uint32_t x[16], w[16];
            for (int i = 0; i < 16; i++) {
                const float m = i & 2 ? 1.75f : i & 4 ? 1.5f : 1.0f, sign = i & 1 ? -1.0f : 1.0f;
                acc[i] = sign * FLT_MIN * (1 + j * 0x1p-23f);
                x[i] = bits(-sign * m * ldexpf(1.0f, 60 - k)) & 0xffff0000u; /* high pair; the low one 0 */
                w[i] = bits(0x1p-60f) & 0xffff0000u;
            }
            hardware(acc, x, w, out);
            for (int i = 0; i < 16; i++, lanes++)
                for (int c = 0; c < NCAND; c++)
                    mismatches[c] += bits(candidate(c, acc[i], x[i], w[i])) != bits(out[i]);
        }
    for (int c = 0; c < NCAND; c++) printf("%-13s %ld of %ld lanes differ\n", NAMES[c], mismatches[c], lanes);
    return mismatches[MATCHES] != 0;
}

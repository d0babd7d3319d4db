/* npud host per-row kernels: RMS norm, RoPE, SiLU- and GELU-and-multiply; batch-invariant by construction
 * (see npud/kernels/host/native.py). Each output depends on its own row alone, through one fixed chain:
 *   rms_norm:  sixteen float64 partial sums, lane l = d mod 16 adding fma(x_d, x_d, lane) in d
 *              order (each square is exact in float64), then the halving tree: lane i += lane
 *              i + 8, i += i + 4, i += i + 2, 0 += 1; inv = (float)(1 / sqrt(sum / D + eps)) in
 *              float64; out_d = w_d * (x_d * inv) in float32.
 *   rope:      per (row, i < half): angle = (float)pos * inv_freq_i (a float32 product, as the
 *              reference computes it), c = (float)cos((double)angle), s likewise with sin (libm,
 *              once per row and i: npud_rope_table); for each head, with a = x_i, b = x_(i+half):
 *              out_i = a*c - b*s, out_(i+half) = b*c + a*s (products rounded, no FMA); the
 *              dimensions past 2 * half are copied.
 *   silu_mul:  t = npud_exp(-|g|) (vexp.h); out = ((g < 0 ? g * t : g) / (1 + t)) * up, i.e.
 *              g * sigmoid(g) with the exponential only of non-positive arguments (no overflow).
 *              Within 3 ulp of the float64 value for |g| <= 87 (tests/test_kernels.py); g < -87
 *              gives -0 (the true value is below 1.5e-36 in magnitude).
 *   gelu_tanh_mul: gelu_tanh(g) = g/2 (1 + tanh(y)) = g / (1 + exp(-2y)), y = sqrt(2/pi) (g + 0.044715 g^3):
 *              z = GELU_2C * fma(GELU_K, (g * g) * g, g); t = npud_exp(-|z|);
 *              out = (g * ((z < 0 ? t : 1) / (1 + t))) * up (the exponential only of
 *              non-positive arguments). Within 2e-6 relative of the float64 value, or 1e-37
 *              absolute where it is that small (tests/test_pointwise.py).
 *   add_rms_norm: s_d = x_d + delta_d in float32 (the residual add), stored, then rms_norm of s.
 *   norm_rope: per (row, head) rms_norm over the head's Dh values, stored, then rope of that.
 * The two fused kernels save a call (and a pass over memory) and give the bits of the composed
 * ones (tests/test_pointwise.py). norm_rope and silu_mul read rows lying a given stride apart,
 * so that the column blocks of a fused projection's output need no copy.
 * The AVX-512 path puts lanes across d (or i, or f) and does the same operations as the generic
 * C, which gcc builds a second time for AVX2 + FMA; all paths give the same bits
 * (tests/test_kernels.py). A call computes rows r0..r1-1, so threads split by whole rows.
 * Compile with -ffp-contract=off and without -ffast-math: the only FMAs are explicit.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "entries.h"
#include "vexp.h"

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------ generic C (and its AVX2 build) */

INLINE float inv_rms(double *part, long D, double eps) {
    for (int s = 8; s >= 1; s >>= 1)
        for (int i = 0; i < s; i++) part[i] += part[i + s];
    return (float)(1.0 / sqrt(part[0] / (double)D + eps));
}

/* one row: out = w * (x * inv_rms(x)); out may be x */
INLINE void rms_row_gen(const float *xr, const float *w, long D, double eps, float *o) {
    double part[16] = {0};
    for (long d = 0; d < D; d++) {
        const double v = xr[d];
        part[d & 15] = fma(v, v, part[d & 15]);
    }
    const float inv = inv_rms(part, D, eps);
    for (long d = 0; d < D; d++) o[d] = w[d] * (xr[d] * inv);
}

/* one head: pairs (i, i + half) rotated by the row's cosines c and sines s; o may be xr */
INLINE void rope_row_gen(const float *xr, long Dh, long half, const float *c, const float *s, float *o) {
    for (long i = 0; i < half; i++) {
        const float a = xr[i], b = xr[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i] + a * s[i];
    }
    for (long i = 2 * half; i < Dh; i++) o[i] = xr[i];
}

INLINE void rms_norm_gen(const float *x, const float *w, long D, double eps, float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) rms_row_gen(x + m * D, w, D, eps, out + m * D);
}

INLINE void add_rms_norm_gen(const float *x, const float *delta, const float *w, long D, double eps, float *sum,
                             float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        for (long d = 0; d < D; d++) sum[m * D + d] = x[m * D + d] + delta[m * D + d];
        rms_row_gen(sum + m * D, w, D, eps, out + m * D);
    }
}

INLINE void rope_gen(const float *x, long H, long Dh, long half, const float *cs, float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        const float *c = cs + m * 2 * half, *s = c + half;
        for (long h = 0; h < H; h++) rope_row_gen(x + (m * H + h) * Dh, Dh, half, c, s, out + (m * H + h) * Dh);
    }
}

INLINE void norm_rope_gen(const float *x, long ldx, long H, long Dh, const float *w, double eps, long half,
                          const float *cs, float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        const float *c = cs + m * 2 * half, *s = c + half;
        for (long h = 0; h < H; h++) {
            float *o = out + (m * H + h) * Dh;
            rms_row_gen(x + m * ldx + h * Dh, w, Dh, eps, o);
            rope_row_gen(o, Dh, half, c, s, o);
        }
    }
}

INLINE void silu_mul_gen(const float *gate, long ldg, const float *up, long ldu, long F, float *out, long r0,
                         long r1) {
    for (long m = r0; m < r1; m++) {
        for (long f = 0; f < F; f++) {
            const float g = gate[m * ldg + f];
            const float t = exp_gen(-fabsf(g));
            out[m * F + f] = ((g < 0.0f ? g * t : g) / (1.0f + t)) * up[m * ldu + f];
        }
    }
}

#define GELU_2C 1.59576912160573071f /* 2 sqrt(2 / pi) */
#define GELU_K 0.044715f

INLINE void gelu_tanh_mul_gen(const float *gate, long ldg, const float *up, long ldu, long F, float *out, long r0,
                              long r1) {
    for (long m = r0; m < r1; m++) {
        for (long f = 0; f < F; f++) {
            const float g = gate[m * ldg + f];
            const float z = GELU_2C * fmaf(GELU_K, (g * g) * g, g);
            const float t = exp_gen(-fabsf(z));
            out[m * F + f] = (g * ((z < 0.0f ? t : 1.0f) / (1.0f + t))) * up[m * ldu + f];
        }
    }
}

#define GENERIC(suffix, attr)                                                                                      \
    static __attribute__((noinline)) attr void rms_norm_##suffix(const float *x, const float *w, long D,         \
                                                                 double eps, float *out, long r0, long r1) {     \
        rms_norm_gen(x, w, D, eps, out, r0, r1);                                                                   \
    }                                                                                                              \
    static __attribute__((noinline)) attr void add_rms_norm_##suffix(const float *x, const float *delta,         \
                                                                     const float *w, long D, double eps,         \
                                                                     float *sum, float *out, long r0, long r1) { \
        add_rms_norm_gen(x, delta, w, D, eps, sum, out, r0, r1);                                                   \
    }                                                                                                              \
    static __attribute__((noinline)) attr void rope_##suffix(const float *x, long H, long Dh, long half,         \
                                                             const float *cs, float *out, long r0, long r1) {    \
        rope_gen(x, H, Dh, half, cs, out, r0, r1);                                                                 \
    }                                                                                                              \
    static __attribute__((noinline)) attr void norm_rope_##suffix(const float *x, long ldx, long H, long Dh,     \
                                                                  const float *w, double eps, long half,         \
                                                                  const float *cs, float *out, long r0, long r1) \
    {                                                                                                              \
        norm_rope_gen(x, ldx, H, Dh, w, eps, half, cs, out, r0, r1);                                               \
    }                                                                                                              \
    static __attribute__((noinline)) attr void silu_mul_##suffix(const float *gate, long ldg, const float *up,   \
                                                                 long ldu, long F, float *out, long r0, long r1) \
    {                                                                                                              \
        silu_mul_gen(gate, ldg, up, ldu, F, out, r0, r1);                                                          \
    }                                                                                                              \
    static __attribute__((noinline)) attr void gelu_tanh_mul_##suffix(const float *gate, long ldg,               \
                                                                      const float *up, long ldu, long F,         \
                                                                      float *out, long r0, long r1) {            \
        gelu_tanh_mul_gen(gate, ldg, up, ldu, F, out, r0, r1);                                                     \
    }

GENERIC(generic, )
GENERIC(avx2, __attribute__((target("avx2,fma"))))

/* ------------------------------------------------------------------ AVX-512 */

/* one row: out = w * (x * inv_rms(x)), sixteen float64 lanes as rms_row_gen's; o may be xr */
INLINE T512 void rms_row_avx512(const float *xr, const float *w, long D, double eps, float *o) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd(); /* lanes 0..7 and 8..15 */
    for (long d = 0; d < D; d += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(D - d), xr + d);
        const __m512d vl = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d vh = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
        lo = _mm512_fmadd_pd(vl, vl, lo);
        hi = _mm512_fmadd_pd(vh, vh, hi);
    }
    double part[16];
    _mm512_storeu_pd(part, lo);
    _mm512_storeu_pd(part + 8, hi);
    const __m512 inv = _mm512_set1_ps(inv_rms(part, D, eps));
    for (long d = 0; d < D; d += 16) {
        const __mmask16 k = tail_mask(D - d);
        const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + d), inv);
        _mm512_mask_storeu_ps(o + d, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + d), y));
    }
}

/* one head, as rope_row_gen; o may be xr (each pair is read before it is written) */
INLINE T512 void rope_row_avx512(const float *xr, long Dh, long half, const float *c, const float *s, float *o) {
    for (long i = 0; i < half; i += 16) {
        const __mmask16 k = tail_mask(half - i);
        const __m512 a = _mm512_maskz_loadu_ps(k, xr + i), b = _mm512_maskz_loadu_ps(k, xr + i + half);
        const __m512 vc = _mm512_maskz_loadu_ps(k, c + i), vs = _mm512_maskz_loadu_ps(k, s + i);
        _mm512_mask_storeu_ps(o + i, k, _mm512_sub_ps(_mm512_mul_ps(a, vc), _mm512_mul_ps(b, vs)));
        _mm512_mask_storeu_ps(o + i + half, k, _mm512_add_ps(_mm512_mul_ps(b, vc), _mm512_mul_ps(a, vs)));
    }
    for (long i = 2 * half; i < Dh; i++) o[i] = xr[i];
}

static __attribute__((noinline)) T512 void rms_norm_avx512(const float *x, const float *w, long D, double eps,
                                                           float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) rms_row_avx512(x + m * D, w, D, eps, out + m * D);
}

static __attribute__((noinline)) T512 void add_rms_norm_avx512(const float *x, const float *delta, const float *w,
                                                               long D, double eps, float *sum, float *out, long r0,
                                                               long r1) {
    for (long m = r0; m < r1; m++) {
        const long j = m * D;
        for (long d = 0; d < D; d += 16) {
            const __mmask16 k = tail_mask(D - d);
            const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + j + d), _mm512_maskz_loadu_ps(k, delta + j + d));
            _mm512_mask_storeu_ps(sum + j + d, k, v);
        }
        rms_row_avx512(sum + j, w, D, eps, out + j);
    }
}

static __attribute__((noinline)) T512 void rope_avx512(const float *x, long H, long Dh, long half, const float *cs,
                                                       float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        const float *c = cs + m * 2 * half, *s = c + half;
        for (long h = 0; h < H; h++)
            rope_row_avx512(x + (m * H + h) * Dh, Dh, half, c, s, out + (m * H + h) * Dh);
    }
}

static __attribute__((noinline)) T512 void norm_rope_avx512(const float *x, long ldx, long H, long Dh,
                                                            const float *w, double eps, long half, const float *cs,
                                                            float *out, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        const float *c = cs + m * 2 * half, *s = c + half;
        for (long h = 0; h < H; h++) {
            float *o = out + (m * H + h) * Dh;
            rms_row_avx512(x + m * ldx + h * Dh, w, Dh, eps, o);
            rope_row_avx512(o, Dh, half, c, s, o);
        }
    }
}

static __attribute__((noinline)) T512 void silu_mul_avx512(const float *gate, long ldg, const float *up, long ldu,
                                                           long F, float *out, long r0, long r1) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f), zero = _mm512_setzero_ps();
    for (long m = r0; m < r1; m++) {
        for (long f = 0; f < F; f += 16) {
            const __mmask16 k = tail_mask(F - f);
            const __m512 g = _mm512_maskz_loadu_ps(k, gate + m * ldg + f);
            const __m512 t = exp512(_mm512_or_ps(g, sign)); /* -|g| */
            const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), g, t);
            const __m512 y = _mm512_div_ps(num, _mm512_add_ps(one, t));
            _mm512_mask_storeu_ps(out + m * F + f, k, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, up + m * ldu + f)));
        }
    }
}

static __attribute__((noinline)) T512 void gelu_tanh_mul_avx512(const float *gate, long ldg, const float *up,
                                                                long ldu, long F, float *out, long r0, long r1) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f), zero = _mm512_setzero_ps();
    for (long m = r0; m < r1; m++) {
        for (long f = 0; f < F; f += 16) {
            const __mmask16 k = tail_mask(F - f);
            const __m512 g = _mm512_maskz_loadu_ps(k, gate + m * ldg + f);
            const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            const __m512 z = _mm512_mul_ps(_mm512_set1_ps(GELU_2C), _mm512_fmadd_ps(_mm512_set1_ps(GELU_K), cube, g));
            const __m512 t = exp512(_mm512_or_ps(z, sign)); /* -|z| */
            const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, zero, _CMP_LT_OQ), one, t);
            const __m512 y = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, t)));
            _mm512_mask_storeu_ps(out + m * F + f, k, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, up + m * ldu + f)));
        }
    }
}

/* ------------------------------------------------------------------ entry points (rows r0..r1-1) */

/* x, out: [M, D]; w: [D] */
void npud_rms_norm(int isa, const float *x, long D, const float *w, double eps, float *out, long r0, long r1) {
    if (isa >= ISA_AVX512) rms_norm_avx512(x, w, D, eps, out, r0, r1);
    else if (isa == ISA_AVX2) rms_norm_avx2(x, w, D, eps, out, r0, r1);
    else rms_norm_generic(x, w, D, eps, out, r0, r1);
}

/* cs: [M, 2 * half], the cosines then the sines of row m's angles (see the header) */
void npud_rope_table(const int64_t *pos, const float *inv_freq, long half, float *cs, long r0, long r1) {
    for (long m = r0; m < r1; m++) {
        for (long i = 0; i < half; i++) {
            const double angle = (float)pos[m] * inv_freq[i];
            cs[m * 2 * half + i] = (float)cos(angle);
            cs[m * 2 * half + half + i] = (float)sin(angle);
        }
    }
}

/* x, out: [M, H, Dh] (pairs (i, i + half)); cs from npud_rope_table */
void npud_rope(int isa, const float *x, long H, long Dh, long half, const float *cs, float *out, long r0, long r1) {
    if (isa >= ISA_AVX512) rope_avx512(x, H, Dh, half, cs, out, r0, r1);
    else if (isa == ISA_AVX2) rope_avx2(x, H, Dh, half, cs, out, r0, r1);
    else rope_generic(x, H, Dh, half, cs, out, r0, r1);
}

/* x, delta, sum, out: [M, D]; w: [D]. sum = x + delta, out = rms_norm(sum) */
void npud_add_rms_norm(int isa, const float *x, const float *delta, long D, const float *w, double eps, float *sum,
                       float *out, long r0, long r1) {
    if (isa >= ISA_AVX512) add_rms_norm_avx512(x, delta, w, D, eps, sum, out, r0, r1);
    else if (isa == ISA_AVX2) add_rms_norm_avx2(x, delta, w, D, eps, sum, out, r0, r1);
    else add_rms_norm_generic(x, delta, w, D, eps, sum, out, r0, r1);
}

/* x: M rows ldx floats apart, each H heads of Dh; w: [Dh]; out: [M, H, Dh] = rope(rms_norm(x)) per head */
void npud_norm_rope(int isa, const float *x, long ldx, long H, long Dh, const float *w, double eps, long half,
                    const float *cs, float *out, long r0, long r1) {
    if (isa >= ISA_AVX512) norm_rope_avx512(x, ldx, H, Dh, w, eps, half, cs, out, r0, r1);
    else if (isa == ISA_AVX2) norm_rope_avx2(x, ldx, H, Dh, w, eps, half, cs, out, r0, r1);
    else norm_rope_generic(x, ldx, H, Dh, w, eps, half, cs, out, r0, r1);
}

/* gate, up: M rows of F, ldg and ldu floats apart; out: [M, F] */
void npud_silu_mul(int isa, const float *gate, long ldg, const float *up, long ldu, long F, float *out, long r0,
                   long r1) {
    if (isa >= ISA_AVX512) silu_mul_avx512(gate, ldg, up, ldu, F, out, r0, r1);
    else if (isa == ISA_AVX2) silu_mul_avx2(gate, ldg, up, ldu, F, out, r0, r1);
    else silu_mul_generic(gate, ldg, up, ldu, F, out, r0, r1);
}

/* gate, up: M rows of F, ldg and ldu floats apart; out: [M, F] */
void npud_gelu_tanh_mul(int isa, const float *gate, long ldg, const float *up, long ldu, long F, float *out,
                        long r0, long r1) {
    if (isa >= ISA_AVX512) gelu_tanh_mul_avx512(gate, ldg, up, ldu, F, out, r0, r1);
    else if (isa == ISA_AVX2) gelu_tanh_mul_avx2(gate, ldg, up, ldu, F, out, r0, r1);
    else gelu_tanh_mul_generic(gate, ldg, up, ldu, F, out, r0, r1);
}

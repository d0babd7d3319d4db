/* npud_exp, the float exponential of the host kernels (attention.c's softmax, pointwise.c's
 * activations), in its generic C form (exp_gen) and its AVX-512 form (exp512), which compute the
 * same chain per element and so give the same bits:
 * Cody-Waite range reduction by ln 2 with two FMAs, a degree-7 polynomial (the Taylor
 * coefficients) by Horner with FMAs, times 2^n built from the exponent bits; x < -87 gives 0
 * (a NaN gives exp(-87)). Meant for x <= 0: above ~88.7 the exponent bits overflow. At most
 * 0.93 ulp from the float64 exp over [-87, 0] (measured; tests/test_kernels.py bounds it by 1 ulp).
 * One header included by both sources, so the two kernels share one definition.
 */
#ifndef NPUD_VEXP_H
#define NPUD_VEXP_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* npud_exp's constants: log2(e); ln 2 split so that n * LN2_HI is exact; 1.5 * 2^23, whose
 * addition rounds a float of magnitude < 2^22 to an integer (ties to even) */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define SHIFTER 12582912.0f
#define EXP_MIN -87.0f
#define C7 (1.0f / 5040.0f)
#define C6 (1.0f / 720.0f)
#define C5 (1.0f / 120.0f)
#define C4 (1.0f / 24.0f)
#define C3 (1.0f / 6.0f)
#define C2 0.5f

static inline __attribute__((always_inline)) float exp_gen(float x) {
    const float xc = x > EXP_MIN ? x : EXP_MIN;
    const float n = (xc * LOG2E + SHIFTER) - SHIFTER;
    float r = fmaf(n, -LN2_HI, xc);
    r = fmaf(n, -LN2_LO, r);
    float p = C7;
    p = fmaf(p, r, C6);
    p = fmaf(p, r, C5);
    p = fmaf(p, r, C4);
    p = fmaf(p, r, C3);
    p = fmaf(p, r, C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return x < EXP_MIN ? 0.0f : p * two_n;
}

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

static inline __attribute__((always_inline)) T512 __m512 exp512(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)); /* x > EXP_MIN ? x : EXP_MIN, as exp_gen */
    const __m512 shifter = _mm512_set1_ps(SHIFTER);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), shifter), shifter);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(C7);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ);
    return _mm512_maskz_mul_ps(~under, p, _mm512_castsi512_ps(bits));
}

static inline __attribute__((always_inline)) T512 __mmask16 tail_mask(long left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#endif

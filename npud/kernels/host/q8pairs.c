/* int8-q16's activation rows: blocks of QB values quantized to 16-bit integers, each held as a
 * pair of signed bytes so that the q8 kernels' byte dot products (vpdpbusd) still apply.
 *
 * Per row (nothing else is read), per block of QB values (zero-padded past K):
 *   d = max|x| / QS (QS = 127 * 254), Q = round(x / d) (away from zero) clamped to [-QS, QS],
 *   hi = rint(Q * (1 / 254)) in [-127, 127], lo = Q - 254 hi in [-127, 127] (exact: integers in
 *   float), sum = the block's Q summed in int32.
 * Each value is off by at most d / 2 = max|block| / 64516, where llama.cpp's q8_0 rows (gemm.c's
 * npud_quantize_q8, which int8-q8 and gguf-q8 use) are off by up to max|block| / 254: 254 times
 * finer, for a second pass of byte products over each block (gemm.c's q8 kernels). On random checkpoints with
 * outlier channels that is the difference between logits within 3e-3 x max|logit| and 0.7 x
 * (bench/accuracy.py). hi's product rounds once and never lands on a half (Q / 254 is at least
 * 1/508 away from one), so rint and round agree.
 * Layout: xq [M, 2 Kp], block b's hi bytes at 2 b QB, its lo bytes at 2 b QB + QB; xs, xsum [M, Kp / QB].
 */
#include "gemm.h"

#define QS 32258.0f /* 127 * 254 */

static void quantize_pair_row(const float *x, long K, long nb, int8_t *xq, float *xs, int32_t *xsum) {
    for (long b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (long k = b * QB; k < b * QB + QB && k < K; k++) {
            const float a = fabsf(x[k]);
            if (a > amax) amax = a;
        }
        const float d = amax / QS;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (long i = 0; i < QB; i++) {
            const long k = b * QB + i;
            float q = k < K ? roundf(x[k] * id) : 0.0f;
            q = q > QS ? QS : q < -QS ? -QS : q;
            const float hi = rintf(q * (1.0f / 254.0f));
            xq[2 * b * QB + i] = (int8_t)(int32_t)hi;
            xq[2 * b * QB + QB + i] = (int8_t)(int32_t)(q - 254.0f * hi);
            s += (int32_t)q;
        }
        xs[b] = d;
        xsum[b] = s;
    }
}

/* quantize_pair_row 16 lanes at a time, with its bits (NaN and infinity included: a NaN's q, hi
 * and lo convert to INT32_MIN, whose low byte is 0, as the scalar conversions do on x86), as
 * gemm.c's quantize_row_avx512 does for q8_0. */
static T512 void quantize_pair_row_avx512(const float *x, long K, long nb, int8_t *xq, float *xs, int32_t *xsum) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), inv254 = _mm512_set1_ps(1.0f / 254.0f);
    const __m512 hi_lim = _mm512_set1_ps(QS), lo_lim = _mm512_set1_ps(-QS), f254 = _mm512_set1_ps(254.0f);
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
        const float d = _mm512_reduce_max_ps(amax) / QS;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m512i s = _mm512_setzero_si512();
        for (int h = 0; h < QB / 16; h++) {
            const __m512 t = _mm512_mul_ps(v[h], id);
            const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, r)), half, _CMP_GE_OQ);
            const __m512 away = _mm512_castsi512_ps(
                _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(t), sign), _mm512_castps_si512(one)));
            __m512 q = _mm512_mask_add_ps(r, up, r, away);
            q = _mm512_max_ps(lo_lim, _mm512_min_ps(hi_lim, q)); /* vmaxps/vminps return the second operand on NaN */
            q = _mm512_maskz_mov_ps(live[h], q); /* padding: 0, as the scalar code */
            const __m512 hi =
                _mm512_roundscale_ps(_mm512_mul_ps(q, inv254), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 lo = _mm512_sub_ps(q, _mm512_mul_ps(f254, hi));
            _mm_storeu_si128((__m128i *)(xq + 2 * b * QB + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(hi)));
            _mm_storeu_si128((__m128i *)(xq + 2 * b * QB + QB + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(lo)));
            s = _mm512_add_epi32(s, _mm512_cvttps_epi32(q));
        }
        xs[b] = d;
        xsum[b] = _mm512_reduce_add_epi32(s);
    }
}

/* Rows of x [M, K] in blocks of QB (zero-padded to Kp): xq [M, 2 Kp] (hi, lo bytes a block),
 * xs and xsum [M, Kp / QB]. */
void npud_quantize_q8_pairs(const float *x, long M, long K, long Kp, int8_t *xq, float *xs, int32_t *xsum) {
    const long nb = Kp / QB;
    for (long m = 0; m < M; m++) {
        if (isa_in_use() >= ISA_AVX512)
            quantize_pair_row_avx512(x + m * K, K, nb, xq + m * 2 * Kp, xs + m * nb, xsum + m * nb);
        else
            quantize_pair_row(x + m * K, K, nb, xq + m * 2 * Kp, xs + m * nb, xsum + m * nb);
    }
}

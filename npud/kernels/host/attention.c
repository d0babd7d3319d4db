/* npud host attention: batch-invariant by construction (see npud/kernels/host/native.py).
 *
 * For one row m and one head h (kv head h / (H / KVH)), with the row's visible keys lo..hi
 * (hi = positions[m]; lo = hi - window + 1 when a window is set, else 0), n = hi - lo + 1:
 *   score t:  s = 0; for d = 0..Dh-1: s = fma(q[m,h,d], k[t,d], s);  s = s * scale
 *   softmax:  mx = max over the row's scores (exact, any order); e_t = npud_exp(s_t - mx)
 *   denom:    sixteen partial sums, lane l = (t - lo) mod 16 adding its keys in key order,
 *             then the halving tree: lane i += lane i + 8, i += i + 4, i += i + 2, 0 += 1
 *   values:   acc_d = 0; for t = lo..hi in order: acc_d = fma(e_t, v[t,d], acc_d);
 *             out[m,h,d] = acc_d / denom
 *   npud_exp: vexp.h says how (shared with pointwise.c); at most 0.93 ulp from the float64 exp
 *             over [-87, 0].
 * Each of those chains depends on the row alone: not on how many rows or keys the call has,
 * nor on which thread computed it (a call computes whole rows of whole kv heads). The AVX-512
 * path runs the scores with lanes across keys (a chunk of keys transposed so that the keys'
 * values at one d are adjacent), two rows by two heads per loaded key vector; the
 * exponentials and the denominator's lanes across keys; the values with lanes across d, two
 * heads per loaded value vector. The generic C runs the same operations one lane at a time
 * (fmaf), so both give the same bits, which tests/test_kernels.py checks; gcc builds it a
 * second time for AVX2 + FMA.
 * Compile with -ffp-contract=off and without -ffast-math: the only FMAs are explicit.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entries.h"
#include "vexp.h"

#define KC 256   /* keys per transposed chunk (Dh x KC floats: 128 KiB at Dh 128, in L2) */
#define VB 8     /* value vectors (of 16 d) accumulated per pass over the keys */

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    const float *q;          /* [M, H, Dh] */
    const float *k, *v;      /* [T, KVH, Dh] */
    const int64_t *pos;      /* [M] */
    long M, H, Dh, T, KVH, window;
    float scale;
    float *out;              /* [M, H, Dh] */
} attn_t;

typedef struct {
    float *kt;               /* [Dh, KC]: a chunk of keys transposed */
    float *sc;               /* [rows, G, ntp]: scores from key `base` on, then exponentials */
    float *acc;              /* [Dh] (the generic values' accumulators) */
    long base, ntp;
} scratch_t;

static inline __attribute__((always_inline)) void span(const attn_t *a, long m, long *lo, long *hi) {
    const long h = a->pos[m];
    *hi = h;
    *lo = a->window > 0 && h - a->window + 1 > 0 ? h - a->window + 1 : 0;
}

/* keys c0 .. c0 + cn - 1 of kv head kvh into kt[d * KC + t - c0]; keys past the cache read as 0 */
static inline __attribute__((always_inline)) void transpose(const attn_t *a, long kvh, long c0, long cn, float *kt) {
    for (long t = c0; t < c0 + cn; t++) {
        if (t < a->T) {
            const float *kr = a->k + (t * a->KVH + kvh) * a->Dh;
            for (long d = 0; d < a->Dh; d++) kt[d * KC + t - c0] = kr[d];
        } else {
            for (long d = 0; d < a->Dh; d++) kt[d * KC + t - c0] = 0.0f;
        }
    }
}

/* ------------------------------------------------------------------ generic C (and its AVX2 build) */

/* scores of head row q for the 16 keys at kt (lanes) */
static inline __attribute__((always_inline)) void gen_scores16(const float *q, const float *kt, long Dh, float scale,
                                                               float *s) {
    float acc[16] = {0};
    for (long d = 0; d < Dh; d++)
        for (int l = 0; l < 16; l++) acc[l] = fmaf(q[d], kt[d * KC + l], acc[l]);
    for (int l = 0; l < 16; l++) s[l] = acc[l] * scale;
}

/* softmax and weighted values of one (row, head) whose n scores start at s (overwritten) */
static inline __attribute__((always_inline)) void gen_finish(const attn_t *a, long kvh, long lo, long n, float *s,
                                                             float *acc, float *out) {
    const long Dh = a->Dh;
    float mx = -INFINITY;
    for (long i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    float part[16] = {0};
    for (long i = 0; i < n; i++) {
        s[i] = exp_gen(s[i] - mx);
        part[i % 16] = part[i % 16] + s[i];
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) part[l] = part[l] + part[l + w];
    const float denom = part[0];
    for (long d = 0; d < Dh; d++) acc[d] = 0.0f;
    for (long i = 0; i < n; i++) {
        const float *vr = a->v + ((lo + i) * a->KVH + kvh) * Dh;
        for (long d = 0; d < Dh; d++) acc[d] = fmaf(s[i], vr[d], acc[d]);
    }
    for (long d = 0; d < Dh; d++) out[d] = acc[d] / denom;
}

/* ------------------------------------------------------------------ AVX-512 */

/* transpose()'s work with 16 x 16 blocks transposed in registers */
static inline __attribute__((always_inline)) T512 void transpose512(const attn_t *a, long kvh, long c0, long cn,
                                                                    float *kt) {
    const long Dh = a->Dh, stride = a->KVH * Dh;
    for (long t0 = c0; t0 < c0 + cn; t0 += 16) {
        for (long d0 = 0; d0 < Dh; d0 += 16) {
            const __mmask16 dm = tail_mask(Dh - d0);
            __m512 r[16], u[16];
            for (int i = 0; i < 16; i++)
                r[i] = t0 + i < a->T ? _mm512_maskz_loadu_ps(dm, a->k + (t0 + i) * stride + kvh * Dh + d0)
                                     : _mm512_setzero_ps();
            /* u[i], lane L: r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]; u[i + 1]: the same at 4L+2, 4L+3 */
            for (int i = 0; i < 16; i += 2) {
                u[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                u[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int g = 0; g < 16; g += 4) { /* r[g + j], lane L: column 4L + j of rows g .. g + 3 */
                r[g] = _mm512_shuffle_ps(u[g], u[g + 2], 0x44);
                r[g + 1] = _mm512_shuffle_ps(u[g], u[g + 2], 0xee);
                r[g + 2] = _mm512_shuffle_ps(u[g + 1], u[g + 3], 0x44);
                r[g + 3] = _mm512_shuffle_ps(u[g + 1], u[g + 3], 0xee);
            }
            float *o = kt + d0 * KC + t0 - c0;
            for (int j = 0; j < 4; j++) { /* column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j] */
                const __m512 e0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
                const __m512 e1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
                const __m512 e2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
                const __m512 e3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
                const __m512 col[4] = {_mm512_shuffle_f32x4(e0, e2, 0x88), _mm512_shuffle_f32x4(e1, e3, 0x88),
                                       _mm512_shuffle_f32x4(e0, e2, 0xdd), _mm512_shuffle_f32x4(e1, e3, 0xdd)};
                for (int L = 0; L < 4; L++)
                    if (d0 + 4 * L + j < Dh) _mm512_store_ps(o + (4 * L + j) * KC, col[L]);
            }
        }
    }
}

/* scores of NQ query rows q[i] for NV x 16 keys at kt (lanes across keys, d in order) into s[i] */
static inline __attribute__((always_inline)) T512 void scores512(const int NQ, const int NV, const float *const *q,
                                                                 const float *kt, long Dh, float scale,
                                                                 float *const *s) {
    __m512 acc[4][4];
    for (int i = 0; i < NQ; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
    for (long d = 0; d < Dh; d++) {
        __m512 kv[4];
        for (int j = 0; j < NV; j++) kv[j] = _mm512_load_ps(kt + d * KC + 16 * j);
        for (int i = 0; i < NQ; i++) {
            const __m512 x = _mm512_set1_ps(q[i][d]);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(x, kv[j], acc[i][j]);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int i = 0; i < NQ; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(s[i] + 16 * j, _mm512_mul_ps(acc[i][j], sv));
}

#define SCORES512_NV(NQ)                                                                                           \
    switch (nv) {                                                                                                  \
    case 1: scores512(NQ, 1, q, kt, Dh, scale, s); break;                                                          \
    case 2: scores512(NQ, 2, q, kt, Dh, scale, s); break;                                                          \
    case 3: scores512(NQ, 3, q, kt, Dh, scale, s); break;                                                          \
    default: scores512(NQ, 4, q, kt, Dh, scale, s); break;                                                         \
    }

static inline __attribute__((always_inline)) T512 void avx512_scores(int nq, long nv, const float *const *q,
                                                                     const float *kt, long Dh, float scale,
                                                                     float *const *s) {
    switch (nq) {
    case 1: SCORES512_NV(1) break;
    case 2: SCORES512_NV(2) break;
    case 3: SCORES512_NV(3) break;
    default: SCORES512_NV(4) break;
    }
}

/* exponentials of the n scores at s in place; returns their sum (the denominator) */
static inline __attribute__((always_inline)) T512 float softmax512(long n, float *s) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (long i = 0; i < n; i += 16)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), s + i));
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 part = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), best));
        _mm512_mask_storeu_ps(s + i, k, e);
        part = _mm512_add_ps(part, _mm512_maskz_mov_ps(k, e)); /* + 0 in the lanes past the end: no change */
    }
    /* the halving tree: 16 -> 8 -> 4 -> 2 -> 1 */
    const __m256 p8 = _mm256_add_ps(_mm512_castps512_ps256(part), _mm512_extractf32x8_ps(part, 1));
    const __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
    const __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
    return _mm_cvtss_f32(_mm_add_ss(p2, _mm_movehdup_ps(p2)));
}

/* values of NH heads of one row (exponentials s0, s1; denominators den0, den1) for d0 .. d0 + 16 NV,
 * the last vector masked by `last`: lanes across d, keys in order */
static inline __attribute__((always_inline)) T512 void values512(const int NH, const int NV, const attn_t *a,
                                                                 long kvh, long lo, long n, const float *s0,
                                                                 const float *s1, long d0, __mmask16 last,
                                                                 float den0, float den1, float *o0, float *o1) {
    __m512 acc0[VB], acc1[VB];
    for (int j = 0; j < NV; j++) acc0[j] = acc1[j] = _mm512_setzero_ps();
    const long stride = a->KVH * a->Dh;
    const float *vr = a->v + (lo * a->KVH + kvh) * a->Dh + d0;
    for (long i = 0; i < n; i++, vr += stride) {
        const __m512 e0 = _mm512_set1_ps(s0[i]);
        const __m512 e1 = NH == 2 ? _mm512_set1_ps(s1[i]) : e0;
        for (int j = 0; j < NV; j++) {
            const __m512 vv = _mm512_maskz_loadu_ps(j == NV - 1 ? last : 0xffff, vr + 16 * j);
            acc0[j] = _mm512_fmadd_ps(e0, vv, acc0[j]);
            if (NH == 2) acc1[j] = _mm512_fmadd_ps(e1, vv, acc1[j]);
        }
    }
    for (int j = 0; j < NV; j++) {
        const __mmask16 k = j == NV - 1 ? last : 0xffff;
        _mm512_mask_storeu_ps(o0 + d0 + 16 * j, k, _mm512_div_ps(acc0[j], _mm512_set1_ps(den0)));
        if (NH == 2) _mm512_mask_storeu_ps(o1 + d0 + 16 * j, k, _mm512_div_ps(acc1[j], _mm512_set1_ps(den1)));
    }
}

#define VALUES512_NV(NH)                                                                                           \
    switch (nv) {                                                                                                  \
    case 1: values512(NH, 1, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 2: values512(NH, 2, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 3: values512(NH, 3, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 4: values512(NH, 4, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 5: values512(NH, 5, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 6: values512(NH, 6, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    case 7: values512(NH, 7, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                          \
    default: values512(NH, 8, a, kvh, lo, n, s0, s1, d0, last, den0, den1, o0, o1); break;                         \
    }

/* softmax and values of nh (1 or 2) heads of one row, whose n scores start at s0, s1 (overwritten) */
static __attribute__((noinline)) T512 void finish_avx512(const attn_t *a, long kvh, long lo, long n, int nh,
                                                         float *s0, float *s1, float *acc, float *o0, float *o1) {
    (void)acc;
    const float den0 = softmax512(n, s0), den1 = nh == 2 ? softmax512(n, s1) : den0;
    for (long d0 = 0; d0 < a->Dh; d0 += 16 * VB) {
        const long left = a->Dh - d0, nv = left >= 16 * VB ? VB : (left + 15) / 16;
        const __mmask16 last = tail_mask(left - 16 * (nv - 1));
        if (nh == 2) {
            VALUES512_NV(2)
        } else {
            VALUES512_NV(1)
        }
    }
}

/* ------------------------------------------------------------------ one call: rows m0..m1-1 of kv head kvh */

/* Keys c0 .. c0 + cn transposed, then the scores of every (row, head) of the call against them:
 * two rows and two heads at a time (each transposed key vector used four times), over the keys
 * either row sees; a lane past a row's own keys is a score nobody reads. */
#define CHUNK_SCORES(name, attr, TRANSPOSE, SCORES)                                                                \
    static attr void name(const attn_t *a, long kvh, long m0, long m1, long c0, long cn, scratch_t *w) {           \
        const long G = a->H / a->KVH, Dh = a->Dh;                                                                  \
        TRANSPOSE(a, kvh, c0, cn, w->kt);                                                                          \
        for (long m = m0; m < m1; m += 2) {                                                                        \
            const long mr = m + 1 < m1 ? 2 : 1;                                                                    \
            long lo, hi, lo2, hi2;                                                                                 \
            span(a, m, &lo, &hi);                                                                                  \
            if (mr == 2) {                                                                                         \
                span(a, m + 1, &lo2, &hi2);                                                                        \
                lo = lo2 < lo ? lo2 : lo;                                                                          \
                hi = hi2 > hi ? hi2 : hi;                                                                          \
            }                                                                                                      \
            const long t0 = (lo & ~15L) > c0 ? (lo & ~15L) : c0, t1 = hi + 1 < c0 + cn ? hi + 1 : c0 + cn;       \
            for (long g = 0; g < G; g += 2) {                                                                      \
                const float *q[4] = {0};                                                                           \
                long off[4];                                                                                       \
                int nq = 0;                                                                                        \
                for (long r = 0; r < mr; r++)                                                                      \
                    for (long h = g; h < G && h < g + 2; h++, nq++) {                                              \
                        q[nq] = a->q + ((m + r) * a->H + kvh * G + h) * Dh;                                        \
                        off[nq] = ((m + r - m0) * G + h) * w->ntp - w->base;                                       \
                    }                                                                                              \
                for (long t = t0; t < t1; t += 64) {                                                               \
                    float *s[4];                                                                                   \
                    for (int i = 0; i < nq; i++) s[i] = w->sc + off[i] + t;                                        \
                    SCORES(nq, (t1 - t + 15) / 16, q, w->kt + t - c0, Dh, a->scale, s);                            \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }

static inline __attribute__((always_inline)) void gen_scores(int nq, long nv, const float *const *q,
                                                             const float *kt, long Dh, float scale,
                                                             float *const *s) {
    for (int i = 0; i < nq; i++)
        for (long j = 0; j < nv && j < 4; j++) gen_scores16(q[i], kt + 16 * j, Dh, scale, s[i] + 16 * j);
}

CHUNK_SCORES(chunk_generic, __attribute__((noinline)), transpose, gen_scores)
CHUNK_SCORES(chunk_avx2, __attribute__((noinline, target("avx2,fma"))), transpose, gen_scores)
CHUNK_SCORES(chunk_avx512, __attribute__((noinline)) T512, transpose512, avx512_scores)

#define FINISH_GENERIC(name, attr)                                                                                 \
    static attr void name(const attn_t *a, long kvh, long lo, long n, int nh, float *s0, float *s1, float *acc,   \
                          float *o0, float *o1) {                                                                  \
        gen_finish(a, kvh, lo, n, s0, acc, o0);                                                                    \
        if (nh == 2) gen_finish(a, kvh, lo, n, s1, acc, o1);                                                       \
    }

FINISH_GENERIC(finish_generic, __attribute__((noinline)))
FINISH_GENERIC(finish_avx2, __attribute__((noinline, target("avx2,fma"))))

/* The calling thread's scratch, at least `bytes` long (NULL when it cannot grow). Kept from call
 * to call: a fresh allocation of this size is a fresh mapping, whose page faults cost as much
 * as a decode step's attention. */
static char *scratch(size_t bytes) {
    static __thread char *mem;
    static __thread size_t size;
    if (bytes > size) {
        free(mem);
        size = 0;
        mem = aligned_alloc(64, bytes);
        if (!mem) return NULL;
        size = bytes;
    }
    return mem;
}

/* Rows m0..m1-1 of the heads of kv heads kvh0..kvh1-1; path `isa` (the caller clamps it to what
 * the CPU has). q, k, v, out as attn_t says. Returns 0, or -1 when the scratch memory (the
 * scores of the rows of one kv head and a transposed chunk of keys) could not be allocated. */
long npud_attention(int isa, const float *q, long M, long H, long Dh, const float *k, const float *v, long T,
                    long KVH, const int64_t *pos, long window, float scale, float *out, long kvh0, long kvh1,
                    long m0, long m1) {
    const attn_t a = {q, k, v, pos, M, H, Dh, T, KVH, window, scale, out};
    const long G = H / KVH;
    if (m1 <= m0) return 0;
    long lo_min = T, hi_max = 0;
    for (long m = m0; m < m1; m++) {
        long lo, hi;
        span(&a, m, &lo, &hi);
        lo_min = lo < lo_min ? lo : lo_min;
        hi_max = hi > hi_max ? hi : hi_max;
    }
    scratch_t w;
    w.base = lo_min & ~15L;
    w.ntp = (hi_max + 1 - w.base + 15) / 16 * 16; /* whole vectors of keys */
    const size_t kt_bytes = (size_t)Dh * KC * 4, sc_bytes = (size_t)(m1 - m0) * G * w.ntp * 4;
    const size_t acc_bytes = ((size_t)Dh * 4 + 63) / 64 * 64;
    char *mem = scratch(kt_bytes + sc_bytes + acc_bytes);
    if (!mem) return -1;
    w.kt = (float *)mem;
    w.sc = (float *)(mem + kt_bytes);
    w.acc = (float *)(mem + kt_bytes + sc_bytes);
    for (long kvh = kvh0; kvh < kvh1; kvh++) {
        for (long c0 = w.base; c0 < w.base + w.ntp; c0 += KC) {
            const long cn = w.base + w.ntp - c0 < KC ? w.base + w.ntp - c0 : KC;
            if (isa >= ISA_AVX512) chunk_avx512(&a, kvh, m0, m1, c0, cn, &w);
            else if (isa == ISA_AVX2) chunk_avx2(&a, kvh, m0, m1, c0, cn, &w);
            else chunk_generic(&a, kvh, m0, m1, c0, cn, &w);
        }
        for (long m = m0; m < m1; m++) {
            long lo, hi;
            span(&a, m, &lo, &hi);
            for (long g = 0; g < G; g += 2) { /* two heads at a time share each value load */
                const int nh = G - g >= 2 ? 2 : 1;
                float *s = w.sc + ((m - m0) * G + g) * w.ntp + lo - w.base;
                float *o = out + (m * H + kvh * G + g) * Dh;
                if (isa >= ISA_AVX512) finish_avx512(&a, kvh, lo, hi - lo + 1, nh, s, s + w.ntp, w.acc, o, o + Dh);
                else if (isa == ISA_AVX2) finish_avx2(&a, kvh, lo, hi - lo + 1, nh, s, s + w.ntp, w.acc, o, o + Dh);
                else finish_generic(&a, kvh, lo, hi - lo + 1, nh, s, s + w.ntp, w.acc, o, o + Dh);
            }
        }
    }
    return 0;
}

/* Tests: out[i] = npud_exp(x[i]) on path `isa`, the exponential the softmax uses. */
static __attribute__((noinline)) T512 void exp_avx512(const float *x, long n, float *out) {
    for (long i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, k, exp512(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

void npud_attention_exp(int isa, const float *x, long n, float *out) {
    if (isa >= ISA_AVX512) {
        exp_avx512(x, n, out);
    } else {
        for (long i = 0; i < n; i++) out[i] = exp_gen(x[i]);
    }
}

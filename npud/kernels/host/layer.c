/* npud host decoder layer: one call runs an attention layer over every row of a round
 * (npud/kernels/host/layer.py builds its arguments; npud/kernels/base.py's LayerCall says what it is).
 *
 * Nothing here computes a value of its own: each step is a call of the kernel the per-op path
 * calls for it, with the arguments that path passes (the rows, their strides, the weight's
 * layout, the thread count by the weight's size), so every output has the bits of the per-op
 * path, on every ISA path and for any rows beside it:
 *   input norm        npud_rms_norm, or npud_add_rms_norm with the pending delta
 *   q, k, v           the weight format's GEMM: once for a fused q/k/v weight (the parts are
 *                     columns of its output), else q, k and v apart
 *   head norm + RoPE  npud_norm_rope on the columns where they lie, or npud_rope of a
 *                     contiguous copy where the layer has no head norm
 *   KV rows           copied into each sequence's plane at its rows held..held+n-1 (owning layers)
 *   attention         npud_attention per sequence over its own plane (a large one in units of whole
 *                     rows of whole kv heads on the threads: native.attention's units)
 *   o                 GEMM; the residual: npud_add_rms_norm (sandwich norms: npud_rms_norm of the
 *                     output, then npud_add_rms_norm with the pre-MLP norm)
 *   MLP               GEMM (gate/up fused or apart), npud_silu_mul / npud_gelu_tanh_mul reading the
 *                     halves where they lie, GEMM; sandwich norms: npud_rms_norm of the output
 * A GEMM's output is [M, ntiles * TILE]; where the per-op path takes the first N columns as a
 * contiguous array the rows are copied (a copy changes no bit).
 *
 * Per-row kernels and attention large enough for threads (c->rows_min, c->attn_min) are split over the
 * GEMM pool's threads in whole rows (pool_for), as the per-op path splits them over native.py's pool.
 *
 * npud_decoder_layers runs consecutive layers, each over its own call, in one call (a step's layers).
 *
 * The call returns what the last GEMM's dispatch returned: how many finished GEMM jobs a stalled
 * worker may still read (pool.c; they read the weights, never this call's scratch: a job holds
 * its own copy of the activations, and a worker whose chunk was taken back writes nothing), or
 * < 0: -1 when a GEMM's or attention's scratch could not be allocated, -2 for a bad weight form.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entries.h"

#define TILE 64
enum { LIN_FLOAT = 0, LIN_Q8 = 1, LIN_BD = 2, LIN_QT = 3, LIN_BQ8 = 4 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define ATTENTION_UNIT_WORK (1L << 22) /* native.py's: rows x heads x keys x Dh a threaded unit has at least */

/* One linear layer: which GEMM entry multiplies it, and its arguments (layer.py's _linear). Every
 * field is 8 bytes, so the ctypes mirror has no padding to get wrong. */
typedef struct {
    long kind;      /* LIN_*: npud_gemm, npud_linear_q8, npud_linear_bd, npud_linear_qtiles, npud_linear_bq8 */
    long fmt;       /* LIN_FLOAT: FMT_F32 / FMT_BF16 / FMT_I8 (gemm.h); LIN_Q8: FMT_Q8 / FMT_Q16 */
    long parallel;  /* 1: the call's threads; 0: one thread (a weight below formats.PARALLEL_MIN_BYTES) */
    long K, Kp;     /* the input width; the padded width LIN_Q8 and LIN_BD round rows to */
    long ntiles, N; /* column tiles (the output's width is ntiles * TILE); the true output columns */
    long group, parts, fac16, qbits, zero; /* LIN_QT / LIN_BQ8: the factor tiles' form and the q tiles' */
    const void *w, *fac;                   /* weights (q tiles); GGML blocks: factor tiles */
    const float *scale, *bias;             /* [N] or NULL */
} npud_linear_t;

/* One layer's weights and numbers, built once per model (layer.py's _native_layer). */
typedef struct {
    long D, H, KVH, Dh, half, F; /* hidden, heads, kv heads, head dim, RoPE pairs, MLP width */
    long window;                 /* 0: every position; W: the last W */
    double scale, eps;           /* attention's score scale (taken as a float, as native.attention's), norms' eps */
    long act;                    /* ACT_* */
    long owns_kv, sandwich;      /* writes its KV rows; gemma3's four norms */
    long qkv_fused, q_col, k_col, v_col; /* q, k, v: columns q_col.. of qkv's output, or q, k, v apart */
    long gate_up_fused, up_col;          /* gate, up: columns 0 and up_col of gate_up's output, or apart */
    const float *in_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm; /* [D]; the last two: sandwich */
    const float *q_norm, *k_norm;                                        /* [Dh], or NULL: RoPE alone */
    npud_linear_t qkv, q, k, v, o, gate_up, gate, up, down;
} npud_layer_t;

/* One call: the round's rows and this layer's planes (layer.py's HostLayers.run). */
typedef struct {
    long isa, threads;        /* the per-row kernels' path; the GEMMs' threads (and the pool_for's) */
    long rows_min, attn_min;  /* a per-row kernel's elements, a sequence's attention work (rows x heads
                                 x keys x Dh), from which it is split over the threads (pointwise.py's
                                 POINTWISE_PARALLEL_MIN, native.py's PARALLEL_MIN_WORK) */
    long M, nseq;
    const float *x, *delta;   /* [M, D]; delta NULL: nothing pending */
    const int64_t *pos;       /* [M] */
    const float *cs;          /* [M, 2 half]: npud_rope_table of pos (pointwise._rope_table) */
    const long *seq;          /* [nseq + 1]: sequence s has rows seq[s]..seq[s+1]-1 */
    const long *held;         /* [nseq]: positions each plane held before the pass */
    float *const *keys;       /* [nseq]: each sequence's plane [capacity, KVH, Dh] */
    float *const *values;
    float *x_out, *delta_out; /* [M, D] each: the layer's output is x_out + delta_out */
    float *work;              /* npud_layer_scratch(L, M) floats */
} npud_call_t;

static long linear(const npud_linear_t *l, const float *x, long M, float *out, long threads) {
    const int th = l->parallel ? (int)threads : 1;
    switch (l->kind) {
    case LIN_FLOAT:
        return npud_gemm((int)l->fmt, x, M, l->K, l->w, l->ntiles, l->N, l->scale, l->bias, out, th);
    case LIN_Q8:
        return npud_linear_q8((int)l->fmt, x, M, l->K, l->Kp, l->w, l->ntiles, l->N, l->scale, l->bias, out, th);
    case LIN_BD:
        return npud_linear_bd(x, M, l->K, l->Kp, l->w, l->ntiles, l->N, NULL, l->bias, out, th);
    case LIN_QT:
        return npud_linear_qtiles(x, M, l->K, l->w, l->fac, l->group, l->parts, (int)l->fac16, (int)l->qbits,
                                  (int)l->zero, l->ntiles, l->N, l->bias, out, th);
    case LIN_BQ8:
        return npud_linear_bq8(x, M, l->K, l->w, l->fac, l->group, l->parts, (int)l->fac16, (int)l->qbits,
                               (int)l->zero, l->ntiles, l->N, l->bias, out, th);
    }
    return -2;
}

static inline long width(const npud_linear_t *l) { return l->ntiles * TILE; }
static inline long up16(long n) { return (n + 15) / 16 * 16; } /* whole cache lines between the regions */

/* Where each buffer of a call lies in `work` (floats from its start). */
typedef struct {
    long q, attn, x1, h, qkv, q_own, k_own, v_own, copy, k_roped, o, mixed, n1, h2, gu, g_own, u_own, act, down, dc,
        total;
} layout_t;

static layout_t layout(const npud_layer_t *L, long M) {
    layout_t a;
    long at = 0;
#define TAKE(field, floats) (a.field = at, at += up16((floats)))
    TAKE(q, M * L->H * L->Dh);
    TAKE(attn, M * L->H * L->Dh);
    TAKE(x1, M * L->D);
    TAKE(h, M * L->D);
    TAKE(qkv, L->qkv_fused ? M * width(&L->qkv) : 0);
    TAKE(q_own, L->qkv_fused ? 0 : M * width(&L->q));
    TAKE(k_own, L->qkv_fused || !L->owns_kv ? 0 : M * width(&L->k));
    TAKE(v_own, L->qkv_fused || !L->owns_kv ? 0 : M * width(&L->v));
    TAKE(copy, M * L->H * L->Dh);
    TAKE(k_roped, M * L->KVH * L->Dh);
    TAKE(o, M * width(&L->o));
    TAKE(mixed, M * L->D);
    TAKE(n1, L->sandwich ? M * L->D : 0);
    TAKE(h2, M * L->D);
    TAKE(gu, L->gate_up_fused ? M * width(&L->gate_up) : 0);
    TAKE(g_own, L->gate_up_fused ? 0 : M * width(&L->gate));
    TAKE(u_own, L->gate_up_fused ? 0 : M * width(&L->up));
    TAKE(act, M * L->F);
    TAKE(down, M * width(&L->down));
    TAKE(dc, M * L->D);
#undef TAKE
    a.total = at;
    return a;
}

/* Floats of `work` a call of L over M rows needs. */
long npud_layer_scratch(const npud_layer_t *L, long M) { return layout(L, M).total; }

/* ------------------------------------------------------------------ threads
 * A prefill chunk's per-row kernels and attention go to the GEMM pool's threads (pool_for), the
 * way the per-op path splits them over native.py's pool: a per-row kernel in blocks of whole rows,
 * attention in units of whole rows of whole kv heads (native._attention_units), so no output's
 * bits depend on the split or the thread. */

enum { ROW_RMS, ROW_ADD_RMS, ROW_ROPE, ROW_NORM_ROPE, ROW_SILU, ROW_GELU };

/* One per-row kernel call over rows 0..M-1, its arguments by name (as entries.h's declarations) */
typedef struct {
    int op, isa;
    const float *x, *y;   /* x; add_rms_norm's delta, silu/gelu's up */
    long ldx, ldy, D;     /* strides (norm_rope, silu/gelu); D: the norm's width, silu/gelu's F */
    long H, Dh, half;
    const float *w, *cs;
    double eps;
    float *out, *sum;     /* sum: add_rms_norm's x + delta */
    long M, blocks;
} rows_t;

static void rows_range(const rows_t *r, long r0, long r1) {
    switch (r->op) {
    case ROW_RMS: npud_rms_norm(r->isa, r->x, r->D, r->w, r->eps, r->out, r0, r1); break;
    case ROW_ADD_RMS: npud_add_rms_norm(r->isa, r->x, r->y, r->D, r->w, r->eps, r->sum, r->out, r0, r1); break;
    case ROW_ROPE: npud_rope(r->isa, r->x, r->H, r->Dh, r->half, r->cs, r->out, r0, r1); break;
    case ROW_NORM_ROPE:
        npud_norm_rope(r->isa, r->x, r->ldx, r->H, r->Dh, r->w, r->eps, r->half, r->cs, r->out, r0, r1);
        break;
    case ROW_SILU: npud_silu_mul(r->isa, r->x, r->ldx, r->y, r->ldy, r->D, r->out, r0, r1); break;
    case ROW_GELU: npud_gelu_tanh_mul(r->isa, r->x, r->ldx, r->y, r->ldy, r->D, r->out, r0, r1); break;
    }
}

static void rows_unit(void *ctx, long i) {
    const rows_t *r = ctx;
    rows_range(r, r->M * i / r->blocks, r->M * (i + 1) / r->blocks);
}

/* r over rows 0..M-1 of c: in one call, or with `elements` (out's size, as pointwise._rows counts
 * them) >= c->rows_min in blocks of whole rows on the threads (more blocks than threads, so a
 * thread whose core is busy leaves its share to the others) */
static void rows_run(const npud_call_t *c, rows_t r, long elements) {
    r.isa = (int)c->isa;
    r.M = c->M;
    if (c->threads > 1 && c->M > 1 && elements >= c->rows_min) {
        r.blocks = c->M < 4 * c->threads ? c->M : 4 * c->threads;
        pool_for((int)c->threads, r.blocks, rows_unit, &r);
    } else {
        rows_range(&r, 0, c->M);
    }
}

/* One sequence's attention (npud_attention's arguments) and its units: kvh0, kvh1, m0, m1 each */
typedef struct {
    int isa;
    const float *q, *k, *v;
    long n, H, Dh, T, KVH, window;
    const int64_t *pos;
    float scale;
    float *out;
    const long *units;
    _Atomic long failed;
} attn_units_t;

static void attn_unit(void *ctx, long i) {
    attn_units_t *a = ctx;
    const long *u = a->units + 4 * i;
    if (npud_attention(a->isa, a->q, a->n, a->H, a->Dh, a->k, a->v, a->T, a->KVH, a->pos, a->window, a->scale,
                       a->out, u[0], u[1], u[2], u[3]) < 0)
        atomic_store(&a->failed, 1);
}

/* One sequence's n rows over its plane (T keys): on the calling thread, or, with its work
 * >= c->attn_min, in native._attention_units' units on the threads. 0, or -1 without memory. */
static long attention_run(const npud_layer_t *L, const npud_call_t *c, const float *q, long n, const float *k,
                          const float *v, long T, const int64_t *pos, float *out) {
    const long KVH = L->KVH, threads = c->threads, work = n * L->H * T * L->Dh;
    if (threads <= 1 || work < c->attn_min)
        return npud_attention((int)c->isa, q, n, L->H, L->Dh, k, v, T, KVH, pos, L->window, (float)L->scale, out, 0,
                              KVH, 0, n);
    long want = work / ATTENTION_UNIT_WORK;
    want = want < 8 * threads ? want : 8 * threads;
    want = want > threads ? want : threads;
    long blocks = (want + KVH - 1) / KVH;
    blocks = blocks < n ? blocks : n;
    blocks = blocks > 1 ? blocks : 1;
    const long count = KVH % want == 0 ? want : KVH * blocks;
    long *units = malloc((size_t)count * 4 * sizeof(long));
    if (!units) return -1;
    for (long i = 0; i < count; i++) {
        long *u = units + 4 * i;
        if (KVH % want == 0) {
            u[0] = KVH * i / want, u[1] = KVH * (i + 1) / want, u[2] = 0, u[3] = n;
        } else {
            const long h = i / blocks, b = i % blocks;
            u[0] = h, u[1] = h + 1, u[2] = n * b / blocks, u[3] = n * (b + 1) / blocks;
        }
    }
    attn_units_t a = {(int)c->isa, q, k, v, n, L->H, L->Dh, T, KVH, L->window, pos, (float)L->scale, out, units, 0};
    pool_for((int)threads, count, attn_unit, &a);
    free(units);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* x: M rows ldx floats apart (a GEMM output's columns), `heads` heads of Dh -> out [M, heads, Dh]:
 * rope(rms_norm(x)) per head (npud_norm_rope), or without a norm rope of x copied contiguous
 * (what HostBackend.rope does with a column view) */
static void heads_rope(const npud_layer_t *L, const npud_call_t *c, const float *x, long ldx, long heads,
                       const float *norm, float *copy, float *out) {
    const long M = c->M, Dh = L->Dh;
    if (norm) {
        rows_run(c, (rows_t){.op = ROW_NORM_ROPE, .x = x, .ldx = ldx, .H = heads, .Dh = Dh, .w = norm, .eps = L->eps,
                             .half = L->half, .cs = c->cs, .out = out}, M * heads * Dh);
        return;
    }
    for (long m = 0; m < M; m++) memcpy(copy + m * heads * Dh, x + m * ldx, (size_t)heads * Dh * sizeof(float));
    rows_run(c, (rows_t){.op = ROW_ROPE, .x = copy, .H = heads, .Dh = Dh, .half = L->half, .cs = c->cs, .out = out},
             M * heads * Dh);
}

/* The first D columns of M rows ld floats apart, as a contiguous [M, D] (src itself when ld == D). */
static const float *columns(const float *src, long ld, long M, long D, float *dst) {
    if (ld == D) return src;
    for (long m = 0; m < M; m++) memcpy(dst + m * D, src + m * ld, (size_t)D * sizeof(float));
    return dst;
}

/* The layer over rows 0..M-1 of c. Returns as the header says. */
long npud_decoder_layer(const npud_layer_t *L, const npud_call_t *c) {
    const long M = c->M, D = L->D, H = L->H, KVH = L->KVH, Dh = L->Dh;
    const layout_t a = layout(L, M);
    float *const w = c->work;
    float *q = w + a.q, *attn = w + a.attn;
    /* the residual the layer adds to: x + delta, or x itself when nothing is pending */
    const float *x1 = c->delta ? w + a.x1 : c->x;
    long held = 0;
#define GEMM(l, in, out)                                                                                           \
    do {                                                                                                           \
        const long r_ = linear((l), (in), M, (out), c->threads);                                                   \
        if (r_ < 0) return r_;                                                                                     \
        held = r_;                                                                                                 \
    } while (0)

    {
        float *h = w + a.h;
        if (c->delta)
            rows_run(c, (rows_t){.op = ROW_ADD_RMS, .x = c->x, .y = c->delta, .D = D, .w = L->in_norm, .eps = L->eps,
                                 .sum = w + a.x1, .out = h}, M * D);
        else
            rows_run(c, (rows_t){.op = ROW_RMS, .x = c->x, .D = D, .w = L->in_norm, .eps = L->eps, .out = h}, M * D);
        const float *qs, *ks = NULL, *vs = NULL;
        long ldq, ldk = 0, ldv = 0;
        if (L->qkv_fused) {
            GEMM(&L->qkv, h, w + a.qkv);
            ldq = ldk = ldv = width(&L->qkv);
            qs = w + a.qkv + L->q_col, ks = w + a.qkv + L->k_col, vs = w + a.qkv + L->v_col;
        } else {
            GEMM(&L->q, h, w + a.q_own);
            qs = w + a.q_own, ldq = width(&L->q);
            if (L->owns_kv) {
                GEMM(&L->k, h, w + a.k_own);
                GEMM(&L->v, h, w + a.v_own);
                ks = w + a.k_own, ldk = width(&L->k);
                vs = w + a.v_own, ldv = width(&L->v);
            }
        }
        heads_rope(L, c, qs, ldq, H, L->q_norm, w + a.copy, q);
        if (L->owns_kv) {
            float *kr = w + a.k_roped;
            const long row = KVH * Dh;
            heads_rope(L, c, ks, ldk, KVH, L->k_norm, w + a.copy, kr);
            for (long s = 0; s < c->nseq; s++) /* each sequence's rows into its own plane, in order */
                for (long m = c->seq[s]; m < c->seq[s + 1]; m++) {
                    const long t = c->held[s] + m - c->seq[s];
                    memcpy(c->keys[s] + t * row, kr + m * row, (size_t)row * sizeof(float));
                    memcpy(c->values[s] + t * row, vs + m * ldv, (size_t)row * sizeof(float));
                }
        }
        for (long s = 0; s < c->nseq; s++) { /* each sequence over its own plane: its rows held + n long */
            const long m0 = c->seq[s], n = c->seq[s + 1] - m0;
            if (n > 0 && attention_run(L, c, q + m0 * H * Dh, n, c->keys[s], c->values[s], c->held[s] + n, c->pos + m0,
                                       attn + m0 * H * Dh) < 0)
                return -1;
        }
    }

    GEMM(&L->o, attn, w + a.o);
    const float *mixed = columns(w + a.o, width(&L->o), M, D, w + a.mixed);
    float *h2 = w + a.h2;
    if (L->sandwich) { /* x + rms_norm(o), then the pre-MLP norm of that sum */
        rows_run(c, (rows_t){.op = ROW_RMS, .x = mixed, .D = D, .w = L->post_attn_norm, .eps = L->eps, .out = w + a.n1},
                 M * D);
        rows_run(c, (rows_t){.op = ROW_ADD_RMS, .x = x1, .y = w + a.n1, .D = D, .w = L->pre_ff_norm, .eps = L->eps,
                             .sum = c->x_out, .out = h2}, M * D);
    } else {
        rows_run(c, (rows_t){.op = ROW_ADD_RMS, .x = x1, .y = mixed, .D = D, .w = L->post_attn_norm, .eps = L->eps,
                             .sum = c->x_out, .out = h2}, M * D);
    }
    const float *gate, *up;
    long ldg, ldu;
    if (L->gate_up_fused) {
        GEMM(&L->gate_up, h2, w + a.gu);
        ldg = ldu = width(&L->gate_up);
        gate = w + a.gu, up = w + a.gu + L->up_col;
    } else {
        GEMM(&L->gate, h2, w + a.g_own);
        GEMM(&L->up, h2, w + a.u_own);
        gate = w + a.g_own, ldg = width(&L->gate);
        up = w + a.u_own, ldu = width(&L->up);
    }
    rows_run(c, (rows_t){.op = L->act == ACT_SILU ? ROW_SILU : ROW_GELU, .x = gate, .ldx = ldg, .y = up, .ldy = ldu,
                         .D = L->F, .out = w + a.act}, M * L->F);
    const long ldd = width(&L->down);
    if (L->sandwich) { /* the MLP's output normed is the delta */
        GEMM(&L->down, w + a.act, w + a.down);
        rows_run(c, (rows_t){.op = ROW_RMS, .x = columns(w + a.down, ldd, M, D, w + a.dc), .D = D, .w = L->post_ff_norm,
                             .eps = L->eps, .out = c->delta_out}, M * D);
    } else if (ldd == D) {
        GEMM(&L->down, w + a.act, c->delta_out);
    } else {
        GEMM(&L->down, w + a.act, w + a.down);
        columns(w + a.down, ldd, M, D, c->delta_out);
    }
#undef GEMM
    return held;
}

/* Layers 0..n-1 in order, layer i over calls[i] (whose x and delta are call i - 1's outputs): a
 * step's layers in one call. Returns the last layer's return, or the first error. */
long npud_decoder_layers(const npud_layer_t *const *layers, const npud_call_t *calls, long n) {
    long held = 0;
    /* several rows on threads: the pool's workers stay awake from the first GEMM to the last (a
     * decode step's row keeps pool.c's short spin: its gaps are short, its GEMMs read-bound) */
    const int hold = n > 0 && calls[0].threads > 1 && calls[0].M > 1;
    if (hold) pool_hold(1);
    for (long i = 0; i < n; i++) {
        held = npud_decoder_layer(layers[i], calls + i);
        if (held < 0) break;
    }
    if (hold) pool_hold(0);
    return held;
}

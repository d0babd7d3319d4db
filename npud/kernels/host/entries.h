/* The library's kernel entry points that layer.c calls, declared once. Every source that defines
 * one includes this header (gemm.h for the GEMM sources), so the compiler checks each definition
 * against the declaration layer.c is compiled with. */
#ifndef NPUD_ENTRIES_H
#define NPUD_ENTRIES_H
#include <stdint.h>

/* gemm.c, bf16dot.c, blockgemm.c, blockq8.c: out [M, ntiles * TILE]; each returns how many
 * finished jobs a stalled worker may still read (their weights must stay alive), or < 0 */
long npud_gemm(int fmt, const float *x, long M, long K, const void *w, long ntiles, long N, const float *scale,
               const float *bias, float *out, int threads);
long npud_linear_q8(int fmt, const float *x, long M, long K, long Kp, const uint8_t *w, long ntiles, long N,
                    const float *scale, const float *bias, float *out, int threads);
long npud_linear_bd(const float *x, long M, long K, long Kp, const uint32_t *w, long ntiles, long N,
                    const float *scale, const float *bias, float *out, int threads);
long npud_linear_qtiles(const float *x, long M, long K, const void *q, const void *fac, long group, long parts,
                        int fac16, int qbits, int qzero, long ntiles, long N, const float *bias, float *out,
                        int threads);
long npud_linear_bq8(const float *x, long M, long K, const uint8_t *q, const void *fac, long group, long parts,
                     int fac16, int qbits, int qzero, long ntiles, long N, const float *bias, float *out,
                     int threads);
long npud_bq8_stream_min(long bytes);

/* pointwise.c: rows r0..r1-1 */
void npud_rms_norm(int isa, const float *x, long D, const float *w, double eps, float *out, long r0, long r1);
void npud_add_rms_norm(int isa, const float *x, const float *delta, long D, const float *w, double eps, float *sum,
                       float *out, long r0, long r1);
void npud_rope(int isa, const float *x, long H, long Dh, long half, const float *cs, float *out, long r0, long r1);
void npud_norm_rope(int isa, const float *x, long ldx, long H, long Dh, const float *w, double eps, long half,
                    const float *cs, float *out, long r0, long r1);
void npud_silu_mul(int isa, const float *gate, long ldg, const float *up, long ldu, long F, float *out, long r0,
                   long r1);
void npud_gelu_tanh_mul(int isa, const float *gate, long ldg, const float *up, long ldu, long F, float *out,
                        long r0, long r1);

/* attention.c: rows m0..m1-1 of kv heads kvh0..kvh1-1; 0, or -1 without scratch memory */
long npud_attention(int isa, const float *q, long M, long H, long Dh, const float *k, const float *v, long T,
                    long KVH, const int64_t *pos, long window, float scale, float *out, long kvh0, long kvh1,
                    long m0, long m1);

/* pool.c: unit(ctx, i) for i in 0..n-1 on `threads` threads (the caller's and the GEMM pool's
 * workers), each unit whole on one thread; returns when every unit has run. A unit writes its
 * outputs where it computes them, so the caller waits for the units a worker holds (none is taken
 * back, unlike a GEMM's chunks). layer.c's per-row kernels and attention. */
__attribute__((visibility("hidden"))) void pool_for(int threads, long n, void (*unit)(void *, long), void *ctx);
/* pool.c: while on (1; 0 ends it), the workers spin between calls instead of sleeping */
__attribute__((visibility("hidden"))) void pool_hold(int on);

#endif

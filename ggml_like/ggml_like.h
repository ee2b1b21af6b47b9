/* ggml_like.h -- the tensor kernels cm384 runs on: number types and their
 * conversions, matrix products over stored weights (f32, f16, bf16, fp8 e4m3
 * with block scales, int8 with per-row scales), INT8 activation quantization,
 * and a persistent worker pool with a cheap parallel-for.
 *
 * Layout: a weight matrix W is [rows][cols] row-major, as safetensors stores
 * nn.Linear weights ([out_features][in_features]).  Activations are fp32 rows
 * of `cols` values.  gl_matmul computes y[i][r] = sum_c W[r][c] * x[i][c].
 *
 * Batch invariance (the rule every kernel keeps): the value of y[i][r] depends
 * only on row r of W and row i of x -- never on how many rows of x there are,
 * which range of r a call covers, or how the work is split over threads.  So
 * each dot product runs in one fixed order per (kernel set, cols), whatever
 * the tiling around it.  INT8 products accumulate exactly in int32.
 *
 * Kernel sets are chosen at run time from the CPU's features (gl_kernels_get);
 * every set is tested against the portable scalar one.
 */
#ifndef GGML_LIKE_H
#define GGML_LIKE_H

#include <stddef.h>
#include <stdint.h>

/* Stored number types.  Append-only. */
enum gl_type {
    GL_F32     = 0,
    GL_F16     = 1,
    GL_BF16    = 2,
    GL_F8_E4M3 = 3,   /* with fp32 scales per 128x128 block (DeepSeek-V3's weight_scale_inv) */
    GL_Q8      = 4,   /* symmetric int8, one fp32 scale per row (cm384's W8A8 weights),
                         stored in 16-row panels (gl_q8_at below)                          */
    GL_TYPE_COUNT
};

/* ggml's block-quantized formats, as GGUF stores them (ggml_like/quants.c
 * describes each block).  A row of cols values is cols / gl_type_block()
 * blocks; gl_mat.scale is NULL (the scales live in the blocks).  Append-only. */
enum gl_block_type {
    GL_Q8_0 = 16,     /* 32 values: f16 scale, int8                                        */
    GL_Q4_0,          /* 32 values: f16 scale, 4-bit                                       */
    GL_Q4_K,          /* 256 values: f16 scale and min, 6-bit sub-block scales, 4-bit      */
    GL_Q5_K,          /* as Q4_K with 5-bit values                                         */
    GL_Q6_K,          /* 256 values: f16 scale, int8 sub-block scales, 6-bit               */
    GL_Q4_1,          /* 32 values: f16 scale and min, 4-bit  (llama-quantize's fallbacks  */
    GL_Q5_0,          /* 32 values: f16 scale, 5-bit           for rows that are not whole */
    GL_Q5_1,          /* 32 values: f16 scale and min, 5-bit   k-quant blocks)             */
    GL_BLOCK_TYPE_END
};

#define GL_F8_BLOCK 128

/* A weight matrix as stored. */
typedef struct gl_mat {
    int         type;        /* enum gl_type                                     */
    int         rows, cols;
    const void *data;        /* rows * cols elements, row-major, packed (Q8:
                                16-row panels, gl_q8_at)                         */
    const float *scale;      /* F8: [ceil(rows/128)][ceil(cols/128)] block scales;
                                Q8: [rows] per-row scales; else NULL              */
} gl_mat;

/* GL_Q8's layout.  Rows come in panels of 16 (the last padded with zero
 * rows), columns in groups of 4 (the last padded with zeros); a panel is its
 * groups in column order, 64 bytes each, and lane l (bytes 4l..4l+3) of
 * group g holds row 16p+l's columns 4g..4g+3.  So one 64-byte vector times
 * a token's 4 bytes broadcast gives 16 rows' partial sums in their own
 * lanes (VNNI's vpdpbusd, NEON's sdot): the products need no horizontal
 * sums and no packing at run time, and 256- and 128-bit sets read the same
 * vector as 2 or 4 pieces of 8 or 4 rows.  The values are the int8 weights
 * themselves; only their order differs from row-major. */
#define GL_Q8_PANEL 16
static inline int gl_q8_cols4(int cols) { return (cols + 3) & ~3; }
static inline size_t gl_q8_panel_bytes(int cols) { return (size_t)GL_Q8_PANEL * (size_t)gl_q8_cols4(cols); }
static inline size_t gl_q8_bytes(int rows, int cols) {
    return (size_t)((rows + GL_Q8_PANEL - 1) / GL_Q8_PANEL) * gl_q8_panel_bytes(cols);
}
/* Byte offset of w[r][c]. */
static inline size_t gl_q8_at(int cols, int r, int c) {
    return (size_t)(r / GL_Q8_PANEL) * gl_q8_panel_bytes(cols) + (size_t)(c >> 2) * 64 + (size_t)(r % GL_Q8_PANEL) * 4 + (size_t)(c & 3);
}
/* Row-major int8 rows [r0, r1) of a rows x cols matrix (src holds row r0,
 * then the others at stride ld) into q's layout.
 * Writes those rows' padding columns, and with r1 == rows the padding rows
 * of the last panel, so a matrix packed by panel-aligned pieces is whole. */
void gl_q8_pack_rows(const int8_t *src, int ld, int rows, int cols, int r0, int r1, int8_t *q);

/* Element size in bytes of a stored type. */
static inline size_t gl_type_size(int type) {
    switch (type) {
    case GL_F32: return 4;
    case GL_F16: case GL_BF16: return 2;
    default: return 1;
    }
}

/* Conversions. */
static inline float gl_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t gl_f32_to_bf16(float f) {      /* round to nearest even */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    uint32_t lsb = (v.u >> 16) & 1u;
    return (uint16_t)((v.u + 0x7fffu + lsb) >> 16);
}
float    gl_f16_to_f32(uint16_t h);
uint16_t gl_f32_to_f16(float f);
float    gl_f8e4m3_to_f32(uint8_t b);

int         gl_type_is_block(int type);
int         gl_type_block(int type);                 /* values per block (1: element types) */
size_t      gl_row_bytes(int type, int cols);        /* bytes of one row of cols values     */
const char *gl_type_name(int type);                  /* "BF16", "Q4_K", ...                 */
/* Row r of a block-quantized W to fp32 (what gl_row_to_f32 does for them). */
void        gl_qrow_to_f32(const gl_mat *w, int r, float *out);
void        gl_qrow_range_to_f32(const gl_mat *w, int r, int c0, int n, float *out);   /* columns [c0, c0+n) */
/* One row of cols values (a multiple of 32) to Q8_0 / Q4_0 blocks. */
void        gl_quantize_row_q8_0(const float *x, int cols, uint8_t *out);
void        gl_quantize_row_q4_0(const float *x, int cols, uint8_t *out);

/* Converts row r of W to fp32 (dequantizing blocks/scales). */
void gl_row_to_f32(const gl_mat *w, int r, float *out);
/* Columns [c0, c0 + n) of row r only; c0 a multiple of 256 (every block
 * format's block divides it). */
void gl_row_range_to_f32(const gl_mat *w, int r, int c0, int n, float *out);

/* A set of kernels for one instruction set: "scalar" (portable C), "avx2"
 * (x86-64 with AVX2, FMA, F16C), "avx_vnni" and "avx512_vnni" (AVX2 with
 * VNNI's vpdpbusd for W8A8, VEX- or EVEX-encoded on 256-bit vectors),
 * "avx512" (everything on 512-bit vectors: AVX-512 F/BW/VL/VNNI),
 * "neon" (AArch64) and "neon_dotprod" (AArch64 with SDOT, for W8A8).
 * Sets may differ in the last bits of fp
 * results (each has its own fixed reduction order); W8A8 results are the
 * same bits in every set. */
typedef struct gl_kernels {
    const char *name;        /* "scalar", "avx2", "avx_vnni", "neon", ... */
    /* y[i*ldy + r] = W[r] . x[i*ldx]  for i in [0,n), r in [r0,r1).  W of any
       type except Q8. */
    void (*matmul)(const gl_mat *w, const float *x, int n, int ldx,
                   float *y, int ldy, int r0, int r1);
    /* W8A8: y[i*ldy + r] = (sum_c Wq[r][c]*xq[i][c]) * wscale[r] * xscale[i]. */
    void (*matmul_q8)(const gl_mat *w, const int8_t *xq, const float *xscale, int n, int ldx,
                      float *y, int ldy, int r0, int r1);
    /* Quantize n rows of `cols` floats to int8 with one scale per row
       (max|x|/127).  Returns nothing; scale 0 for an all-zero row. */
    void (*quantize_q8)(const float *x, int n, int cols, int ldx, int8_t *q, int ldq, float *scale);
    float (*dot)(const float *a, const float *b, int n);           /* fixed order */
    void  (*axpy)(float *y, const float *x, float a, int n);       /* y += a*x    */
    /* y[c] += sum_j a[j] * x[j*ldx + c] for j = 0..m-1 in order: m axpys
       in one pass (y stays in registers), bit-identical to calling axpy m
       times.  The attention core's probabilities times values. */
    void  (*axpy_rows)(float *y, const float *x, int ldx, const float *a, int m, int n);
    /* axpy_rows for nh outputs over the same x: output h is y + h*ldy with
       weights a + h*lda; the same bits as nh calls of axpy_rows.  The
       attention core's heads, which share the latent rows (MLA). */
    void  (*axpy_rows_n)(float *y, int ldy, const float *x, int ldx, const float *a, int lda, int nh, int m, int n);
    /* x[i] = e^(scale*(x[i] - shift)) in place; returns their sum, added
       in a fixed order.  The attention core's softmax, a block of keys at a
       time (its 1/sqrt(d) is the scale).  The SIMD sets evaluate e^t by a
       polynomial within a few ulp of expf (t below about -87 gives 0), so
       they match the scalar set to ~1e-6 relative. */
    float (*exp_sum)(float *x, int n, float scale, float shift);
    /* a[i] = silu(a[i]) * b[i] = a[i] / (1 + e^-a[i]) * b[i]: the gated
       feed-forward's activation, with the same exponential. */
    void  (*silu_mul)(float *a, const float *b, int n);
    /* y[l*ldy + j] = sum_c x[j*ldx + c] * qt[c*ldq + l] for rows j < m and
       lanes l < nl: m rows dotted with nl vectors stored transposed (lane l
       of qt row c is element c of vector l).  Each sum is one chain over c
       in increasing order -- by fused multiply-add in the SIMD sets, so
       they give the same bits, whatever m, nl or the lane's place.  The
       attention core's scores: a block of latent rows against every head's
       query, each key element broadcast to 16 heads at once. */
    void  (*dot_rows_t)(float *y, int ldy, const float *qt, int ldq, int nl, const float *x, int ldx, int m, int n);
    /* dot_rows_t and axpy_rows_n over rows of bf16 values (ldx in
       elements), read as they are: the same bits as the fp32 forms on the
       rows widened to fp32, at half the bytes.  A bf16 latent cache. */
    void  (*dot_rows_t_bf16)(float *y, int ldy, const float *qt, int ldq, int nl, const uint16_t *x, int ldx, int m,
                             int n);
    void  (*axpy_rows_n_bf16)(float *y, int ldy, const uint16_t *x, int ldx, const float *a, int lda, int nh, int m,
                              int n);
    /* axpy_rows_n (and its bf16 form) over rows given by pointers: row j
       at xr[j].  The same bits as axpy_rows_n on those rows laid out
       contiguously.  The attention core's chunk of keys, which spans
       several KV blocks (not adjacent in memory): one call for the chunk
       keeps its sums in registers across the blocks. */
    void  (*axpy_rowp_n)(float *y, int ldy, const float *const *xr, const float *a, int lda, int nh, int m, int n);
    void  (*axpy_rowp_n_bf16)(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda, int nh, int m,
                              int n);
    /* dst[c*ldd + r] = src[r*lds + c], r < rows, c < cols (exact: a copy).
       The attention core lays its queries out this way for dot_rows_t. */
    void  (*transpose)(float *dst, int ldd, const float *src, int lds, int rows, int cols);
    /* The attention core in native BF16 over a bf16 latent cache: NULL in
       every set but the opt-in "avx512_bf16", whose vdpbf16ps multiplies
       pairs of bf16 values -- the fp32 operands are rounded to bf16 (nearest
       even), an error of up to 2^-8 relative per product, at twice the FMA
       rate.  round_pairs_bf16 packs rows 2p and 2p + 1 of src ([n][lds], n
       rows of cols values) into dst[p*ldd + l] = bf16(src[2p][l]) | bf16(
       src[2p+1][l]) << 16 (0 past the last row).  dot_rows_tp_bf16 is
       dot_rows_t_bf16 on queries so packed (qp: (n + 1) / 2 rows of ldq
       pairs): each sum one chain over the element pairs in increasing
       order, the same bits whatever m, nl or the lane's place.
       axpy_rowp_n_bf16p is axpy_rowp_n_bf16 with the weights a rounded to
       bf16 and taken two rows at a time (rows 2p and 2p + 1 of each call,
       then 64 rows on, the last one alone when m is odd): the same bits
       whatever nh or the head's place, and for a run of rows split into
       calls at even offsets. */
    void  (*round_pairs_bf16)(uint32_t *dst, int ldd, const float *src, int lds, int n, int cols);
    void  (*dot_rows_tp_bf16)(float *y, int ldy, const uint32_t *qp, int ldq, int nl, const uint16_t *x, int ldx,
                              int m, int n);
    void  (*axpy_rowp_n_bf16p)(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda, int nh, int m,
                               int n);
} gl_kernels;

/* The best kernel set for this CPU (cpuid / hwcap probed once, then cached). */
const gl_kernels *gl_kernels_get(void);
/* The portable reference set, for tests. */
const gl_kernels *gl_kernels_scalar(void);
/* All sets this CPU can run (for tests and benches), scalar first and the
 * one gl_kernels_get picks last; fills at most cap, returns the count. */
int gl_kernels_all(const gl_kernels **out, int cap);
/* The set of that name if this CPU can run it, else NULL (to pin a set).
 * Also finds the opt-in sets gl_kernels_get never picks because they
 * approximate: "avx512_bf16" (bf16 weights times activations rounded to
 * bf16, by AVX512_BF16's vdpbf16ps). */
const gl_kernels *gl_kernels_by_name(const char *name);

/* Quantize a weight matrix to GL_Q8: q gets gl_q8_bytes(rows, cols), scale
 * gets rows floats.  Rows [r0, r1) only (r0 a multiple of GL_Q8_PANEL, so
 * pieces can run in parallel); row is the caller's scratch of
 * GL_Q8_SCRATCH(w->cols) floats. */
#define GL_Q8_SCRATCH(cols) ((size_t)(cols) + (size_t)(cols) / 4 + 1)
void gl_quantize_weight_q8(const gl_mat *w, int8_t *q, float *scale, int r0, int r1, float *row);

/* ---------------------------------------------------------------------- */
/* Worker pool                                                            */
/* ---------------------------------------------------------------------- */
/* n_threads workers (the calling thread counts as one).  gl_pool_run runs
 * fn(ctx, task, worker) for task = 0..n_tasks-1 spread over all workers and
 * returns when every task has finished.  Tasks are handed out one at a time
 * from an atomic counter, so give it more tasks than workers.  Only one
 * thread may call gl_pool_run on a pool at a time.  Cost: a few hundred ns
 * per call while the workers are spinning (they do for ~200 us after a
 * region, then sleep); the caller never waits for a worker that took no
 * task, so a descheduled worker delays nothing it has not started. */
typedef struct gl_pool gl_pool;
typedef void (*gl_task_fn)(void *ctx, int task, int worker);

gl_pool *gl_pool_create(int n_threads);   /* NULL on failure                  */
void     gl_pool_free(gl_pool *p);        /* NULL ok; joins the workers        */
int      gl_pool_size(const gl_pool *p);
void     gl_pool_run(gl_pool *p, int n_tasks, gl_task_fn fn, void *ctx);
/* Runs fn(ctx, w, w) exactly once on every worker w (0 is the caller) and
 * returns when all have finished: work with thread affinity, e.g. one
 * thread per emulated device. */
void     gl_pool_run_pinned(gl_pool *p, gl_task_fn fn, void *ctx);

/* Online CPU count (>= 1). */
int gl_n_cpus(void);
/* A waiting thread's spin: 1 while its budget lasts (from *start, both 0
 * to begin), 0 once it should sleep; with more threads than CPUs it yields
 * instead, for a short count. */
int gl_spin(int *spins, int64_t *start, int oversubscribed);

#endif /* GGML_LIKE_H */

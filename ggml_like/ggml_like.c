/* ggml_like.c -- portable kernels, kernel-set selection and the worker pool.
 * Included by cm384.c (one translation unit); also compiles on its own. */
#ifndef GGML_LIKE_C_INCLUDED
#define GGML_LIKE_C_INCLUDED
#include "ggml_like.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------------- */
/* Conversions                                                            */
/* ---------------------------------------------------------------------- */

float gl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exp == 31) v.u = sign | 0x7f800000u | (man << 13);          /* inf / NaN */
    else v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}

uint16_t gl_f32_to_f16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t sign = (v.u >> 16) & 0x8000u;
    float a = fabsf(f);
    if (a != a) return (uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00u);
    if (a < 6.103515625e-05f) {                     /* subnormal half */
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    uint32_t u = v.u & 0x7fffffffu;
    uint32_t lsb = (u >> 13) & 1u;
    u += 0xfffu + lsb;                              /* round to nearest even */
    return (uint16_t)(sign | (((u >> 23) - 112) << 10) | ((u >> 13) & 0x3ffu));
}

/* fp8 e4m3 ("fn": no infinities; S.1111.111 is NaN), bias 7. */
float gl_f8e4m3_to_f32(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
    float f;
    if (exp == 15 && man == 7) f = NAN;
    else if (exp == 0) f = (float)man * (1.0f / 512.0f);          /* man/8 * 2^-6 */
    else f = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -f : f;
}

/* 256-entry table, built on first use; the table is constant once built and
 * building it twice from two threads writes the same values. */
static float gl_f8_table_values[256];
static atomic_int gl_f8_table_ready;

static const float *gl_f8_table(void) {
    if (!atomic_load_explicit(&gl_f8_table_ready, memory_order_acquire)) {
        static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&mu);
        if (!atomic_load_explicit(&gl_f8_table_ready, memory_order_relaxed)) {
            for (int i = 0; i < 256; i++) gl_f8_table_values[i] = gl_f8e4m3_to_f32((uint8_t)i);
            atomic_store_explicit(&gl_f8_table_ready, 1, memory_order_release);
        }
        pthread_mutex_unlock(&mu);
    }
    return gl_f8_table_values;
}

static void gl_widen16(int type, const uint16_t *p, float *out, int n);

void gl_row_range_to_f32(const gl_mat *w, int r, int c0, int n, float *out) {
    size_t off = (size_t)r * (size_t)w->cols + (size_t)c0;
    switch (w->type) {
    case GL_F32: memcpy(out, (const float *)w->data + off, (size_t)n * 4); break;
    case GL_F16:
    case GL_BF16: gl_widen16(w->type, (const uint16_t *)w->data + off, out, n); break;
    case GL_F8_E4M3: {
        const uint8_t *p = (const uint8_t *)w->data + off;
        const float *t = gl_f8_table();
        int bc = (w->cols + GL_F8_BLOCK - 1) / GL_F8_BLOCK;
        const float *s = w->scale + (size_t)(r / GL_F8_BLOCK) * (size_t)bc;
        for (int c = 0; c < n; c++) out[c] = t[p[c]] * s[(c0 + c) / GL_F8_BLOCK];
        break;
    }
    case GL_Q8: {
        const int8_t *p = (const int8_t *)w->data;
        float s = w->scale[r];
        for (int c = 0; c < n; c++) out[c] = (float)p[gl_q8_at(w->cols, r, c0 + c)] * s;
        break;
    }
    default: gl_qrow_range_to_f32(w, r, c0, n, out); break;   /* GGUF block formats (quants.c) */
    }
}

void gl_row_to_f32(const gl_mat *w, int r, float *out) { gl_row_range_to_f32(w, r, 0, w->cols, out); }

/* ---------------------------------------------------------------------- */
/* Scalar kernels                                                         */
/* ---------------------------------------------------------------------- */
/* Dot products accumulate in 8 independent lanes (c mod 8) that are summed
 * pairwise at the end: the same fixed order for every call, and a shape the
 * compiler vectorizes. */

#define GL_LANES 8

static float gl_lanes_sum(const float *acc) {
    float a = (acc[0] + acc[4]) + (acc[2] + acc[6]);
    float b = (acc[1] + acc[5]) + (acc[3] + acc[7]);
    return a + b;
}

static float scalar_dot(const float *a, const float *b, int n) {
    float acc[GL_LANES] = {0};
    int c = 0;
    for (; c + GL_LANES <= n; c += GL_LANES)
        for (int l = 0; l < GL_LANES; l++) acc[l] += a[c + l] * b[c + l];
    for (int l = 0; c < n; c++, l++) acc[l] += a[c] * b[c];
    return gl_lanes_sum(acc);
}

static void scalar_axpy(float *y, const float *x, float a, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void scalar_axpy_rows(float *y, const float *x, int ldx, const float *a, int m, int n) {
    for (int c = 0; c < n; c++) {
        float acc = y[c];
        for (int j = 0; j < m; j++) acc += a[j] * x[(size_t)j * ldx + c];
        y[c] = acc;
    }
}

static void scalar_axpy_rows_n(float *y, int ldy, const float *x, int ldx, const float *a, int lda, int nh, int m, int n) {
    for (int h = 0; h < nh; h++) scalar_axpy_rows(y + (size_t)h * ldy, x, ldx, a + (size_t)h * lda, m, n);
}

static float scalar_exp_sum(float *x, int n, float scale, float shift) {
    float sum = 0;
    for (int i = 0; i < n; i++) { x[i] = expf(scale * (x[i] - shift)); sum += x[i]; }
    return sum;
}

static void scalar_silu_mul(float *a, const float *b, int n) {
    for (int i = 0; i < n; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

/* Lanes 64 at a time, so the inner loop over lanes vectorizes. */
static void scalar_dot_rows_t(float *y, int ldy, const float *qt, int ldq, int nl, const float *x, int ldx, int m, int n) {
    float acc[64];
    for (int l0 = 0; l0 < nl; l0 += 64) {
        int nw = nl - l0 < 64 ? nl - l0 : 64;
        for (int j = 0; j < m; j++) {
            const float *xr = x + (size_t)j * ldx;
            for (int l = 0; l < nw; l++) acc[l] = 0;
            for (int c = 0; c < n; c++) {
                const float a = xr[c], *q = qt + (size_t)c * ldq + l0;
                for (int l = 0; l < nw; l++) acc[l] += a * q[l];
            }
            for (int l = 0; l < nw; l++) y[(size_t)(l0 + l) * ldy + j] = acc[l];
        }
    }
}

/* The bf16-row forms: the fp32 forms' arithmetic on rows widened one
 * element at a time (exactly), so the same bits as on widened rows. */
static void scalar_dot_rows_t_bf16(float *y, int ldy, const float *qt, int ldq, int nl, const uint16_t *x, int ldx,
                                   int m, int n) {
    float acc[64];
    for (int l0 = 0; l0 < nl; l0 += 64) {
        int nw = nl - l0 < 64 ? nl - l0 : 64;
        for (int j = 0; j < m; j++) {
            const uint16_t *xr = x + (size_t)j * ldx;
            for (int l = 0; l < nw; l++) acc[l] = 0;
            for (int c = 0; c < n; c++) {
                const float a = gl_bf16_to_f32(xr[c]), *q = qt + (size_t)c * ldq + l0;
                for (int l = 0; l < nw; l++) acc[l] += a * q[l];
            }
            for (int l = 0; l < nw; l++) y[(size_t)(l0 + l) * ldy + j] = acc[l];
        }
    }
}

/* Weight rows converted to fp32 a slab of columns at a time and dotted with
 * up to 16 x rows, so a row of any width needs only stack scratch.  The lane
 * of column c is c % GL_LANES, as in scalar_dot, and the accumulators carry
 * across slabs: the result is scalar_dot's, bit for bit. */
#define SCALAR_SLAB 2048
#define SCALAR_XROWS 16
static void scalar_matmul(const gl_mat *w, const float *x, int n, int ldx,
                          float *y, int ldy, int r0, int r1) {
    float slab[SCALAR_SLAB];
    float acc[SCALAR_XROWS][GL_LANES];
    for (int r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < n; i0 += SCALAR_XROWS) {
            int ni = n - i0 < SCALAR_XROWS ? n - i0 : SCALAR_XROWS;
            memset(acc, 0, sizeof acc);
            for (int c0 = 0; c0 < w->cols; c0 += SCALAR_SLAB) {
                int nc = w->cols - c0 < SCALAR_SLAB ? w->cols - c0 : SCALAR_SLAB;
                gl_row_range_to_f32(w, r, c0, nc, slab);
                for (int i = 0; i < ni; i++) {
                    const float *xr = x + (size_t)(i0 + i) * ldx + c0;
                    for (int c = 0; c < nc; c++) acc[i][(c0 + c) % GL_LANES] += slab[c] * xr[c];
                }
            }
            for (int i = 0; i < ni; i++) y[(size_t)(i0 + i) * ldy + r] = gl_lanes_sum(acc[i]);
        }
    }
}

static void scalar_matmul_q8(const gl_mat *w, const int8_t *xq, const float *xscale, int n, int ldx,
                             float *y, int ldy, int r0, int r1) {
    const int8_t *wq = (const int8_t *)w->data;
    for (int r = r0; r < r1; r++) {
        const int8_t *panel = wq + gl_q8_at(w->cols, r, 0);    /* row r's first 4 bytes; then every 64 */
        for (int i = 0; i < n; i++) {
            const int8_t *xr = xq + (size_t)i * ldx;
            int32_t acc = 0;
            for (int c = 0; c < w->cols; c++) acc += (int32_t)panel[(size_t)(c >> 2) * 64 + (c & 3)] * (int32_t)xr[c];
            y[(size_t)i * ldy + r] = (float)acc * w->scale[r] * xscale[i];
        }
    }
}

void gl_q8_pack_rows(const int8_t *src, int ld, int rows, int cols, int r0, int r1, int8_t *q) {
    const int G = gl_q8_cols4(cols) / 4, whole = cols / 4;
    const size_t pb = gl_q8_panel_bytes(cols);
    for (int r = r0; r < (r1 == rows ? (rows + GL_Q8_PANEL - 1) / GL_Q8_PANEL * GL_Q8_PANEL : r1); r++) {
        int8_t *lane = q + (size_t)(r / GL_Q8_PANEL) * pb + (size_t)(r % GL_Q8_PANEL) * 4;   /* group 0 of row r */
        const int8_t *row = r < r1 ? src + (size_t)(r - r0) * ld : NULL;
        int g = 0;
        if (r < r1)                          /* a padding row past r1 == rows is zeros */
            for (; g < whole; g++) memcpy(lane + (size_t)g * 64, row + 4 * g, 4);
        for (; g < G; g++) {                 /* the zero-padded last group (or a padding row) */
            int8_t four[4] = {0, 0, 0, 0};
            if (r < r1) memcpy(four, row + 4 * g, (size_t)(cols - 4 * g));
            memcpy(lane + (size_t)g * 64, four, 4);
        }
    }
}

static void scalar_quantize_q8(const float *x, int n, int cols, int ldx, int8_t *q, int ldq, float *scale) {
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * ldx;
        int8_t *qr = q + (size_t)i * ldq;
        float amax = 0;
        for (int c = 0; c < cols; c++) { float a = fabsf(xr[c]); if (a > amax) amax = a; }
        float s = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0;
        for (int c = 0; c < cols; c++) {
            long v = lrintf(xr[c] * inv);
            qr[c] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        scale[i] = s;
    }
}

/* axpy_rows_n's forms: rows of fp32 or (bf16) of bf16 values, at x + j *
 * ldx or (xr) by pointer. */
static const void *scalar_row_at(const void *x, int ldx, const void *const *xr, int j, int bf16) {
    if (xr) return xr[j];
    return (const char *)x + (size_t)j * ldx * (bf16 ? 2 : 4);
}

static void scalar_axpy_n_of(float *y, int ldy, const void *x, int ldx, const void *const *xr, const float *a, int lda,
                             int nh, int m, int n, int bf16) {
    for (int h = 0; h < nh; h++) {
        float *yh = y + (size_t)h * ldy;
        const float *ah = a + (size_t)h * lda;
        for (int c = 0; c < n; c++) {
            float acc = yh[c];
            for (int j = 0; j < m; j++) {
                const void *row = scalar_row_at(x, ldx, xr, j, bf16);
                acc += ah[j] * (bf16 ? gl_bf16_to_f32(((const uint16_t *)row)[c]) : ((const float *)row)[c]);
            }
            yh[c] = acc;
        }
    }
}

static void scalar_axpy_rows_n_bf16(float *y, int ldy, const uint16_t *x, int ldx, const float *a, int lda, int nh,
                                    int m, int n) {
    scalar_axpy_n_of(y, ldy, x, ldx, NULL, a, lda, nh, m, n, 1);
}

static void scalar_axpy_rowp_n(float *y, int ldy, const float *const *xr, const float *a, int lda, int nh, int m,
                               int n) {
    scalar_axpy_n_of(y, ldy, NULL, 0, (const void *const *)xr, a, lda, nh, m, n, 0);
}

static void scalar_axpy_rowp_n_bf16(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda, int nh,
                                    int m, int n) {
    scalar_axpy_n_of(y, ldy, NULL, 0, (const void *const *)xr, a, lda, nh, m, n, 1);
}

static void scalar_transpose(float *dst, int ldd, const float *src, int lds, int rows, int cols) {
    for (int c = 0; c < cols; c++)          /* writes in order, reads the rows in step */
        for (int r = 0; r < rows; r++) dst[(size_t)c * ldd + r] = src[(size_t)r * lds + c];
}

static const gl_kernels gl_scalar_kernels = {
    "scalar", scalar_matmul, scalar_matmul_q8, scalar_quantize_q8, scalar_dot, scalar_axpy, scalar_axpy_rows,
    scalar_axpy_rows_n, scalar_exp_sum, scalar_silu_mul, scalar_dot_rows_t, scalar_dot_rows_t_bf16,
    scalar_axpy_rows_n_bf16, scalar_axpy_rowp_n, scalar_axpy_rowp_n_bf16, scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};

const gl_kernels *gl_kernels_scalar(void) { return &gl_scalar_kernels; }

/* ---------------------------------------------------------------------- */
/* SIMD kernel sets, chosen at run time                                   */
/* ---------------------------------------------------------------------- */
/* Each file compiles its functions for its instruction set with target
 * attributes, so the library needs no -m flags; define GL_NO_SIMD to build
 * the scalar set only (or for a compiler without target attributes). */

/* e^x in the SIMD sets: x = n*ln2 + r with n = round(x/ln2), so |r| <=
 * ln2/2; e^r by its Taylor series to r^7 (truncation below 1.3e-7 relative:
 * about 2 ulp), then times 2^n placed in the exponent bits.  ln2 comes in two
 * parts so n*ln2 is subtracted almost exactly.  x is clamped to [lo, hi] so
 * 2^n stays a normal float; below lo the result is 0. */
#define GL_EXP_LO     -87.33654475f       /* ln(2^-126)                      */
#define GL_EXP_HI      88.02969193f       /* ln(2^127): n stays <= 127        */
#define GL_EXP_LOG2E   1.44269504089f
#define GL_EXP_LN2_HI  0.693359375f       /* exact in 11 bits                 */
#define GL_EXP_LN2_LO -2.12194440e-4f     /* ln2 - LN2_HI                     */
#define GL_EXP_C7      1.98412698e-4f     /* 1/7!                             */
#define GL_EXP_C6      1.38888889e-3f
#define GL_EXP_C5      8.33333333e-3f
#define GL_EXP_C4      4.16666667e-2f
#define GL_EXP_C3      1.66666667e-1f
#define GL_EXP_C2      0.5f

/* The SIMD sets' contiguous axpy_rows_n forms take rows this many at a time
 * through their row-pointer form (axpy_rowp_n): a piece of rows stays in
 * cache for every head, and a sum is stored and reloaded between pieces
 * (exactly, so the bits are those of one pass). */
#define GL_ROWP_MAX 64
#define GL_ROWP_PAIRS (GL_ROWP_MAX / 2)   /* axpy_rowp_n_bf16p: row pairs a piece */

#if !defined(GL_NO_SIMD) && (defined(__GNUC__) || defined(__clang__))
#if defined(__x86_64__) || defined(__i386__)
#define GL_HAVE_AVX2 1
static void avx2_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1);
static void avx512_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1);
#include "x86_avx2.c"
#include "x86_avx512.c"
#elif defined(__aarch64__)
#define GL_HAVE_NEON 1
static void neon_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1);
#include "arm_neon.c"
#endif
#endif

#include "quants.c"   /* GGUF block formats: portable part and each set's product */

/* The CPU's features, probed once: a benign cache (every thread computes
 * the same value; 0 means not yet probed). */
static atomic_int gl_cpu_features_cache;

static int gl_cpu_features(void) {
    int f = atomic_load_explicit(&gl_cpu_features_cache, memory_order_relaxed);
    if (f) return f;
    f = 0x100;
#if defined(GL_HAVE_AVX2)
    f |= gl_x86_features();
#elif defined(GL_HAVE_NEON)
    f |= gl_arm_features();
#endif
    atomic_store_explicit(&gl_cpu_features_cache, f, memory_order_relaxed);
    return f;
}

/* bf16 or f16 values widened to fp32 (exact either way): the inner loop of
 * making INT8 weights at load, so vectorized where the CPU allows. */
static void gl_widen16(int type, const uint16_t *p, float *out, int n) {
    int c = 0;
#if defined(GL_HAVE_AVX2)
    if (gl_cpu_features() & GL_X86_AVX2) c = avx2_widen16(type, p, out, n);
#endif
    if (type == GL_BF16)
        for (; c < n; c++) out[c] = gl_bf16_to_f32(p[c]);
    else
        for (; c < n; c++) out[c] = gl_f16_to_f32(p[c]);
}

/* Every set this CPU runs, best last. */
static int gl_kernel_sets(const gl_kernels **out) {
    int n = 0, f = gl_cpu_features();
    (void)f;
    out[n++] = &gl_scalar_kernels;
#if defined(GL_HAVE_AVX2)
    if (f & GL_X86_AVX2) out[n++] = &gl_avx2_kernels;
    if (f & GL_X86_AVX_VNNI) out[n++] = &gl_avx_vnni_kernels;
    if (f & GL_X86_AVX512) out[n++] = &gl_avx512_vnni_kernels;
    if (f & GL_X86_AVX512) out[n++] = &gl_avx512_kernels;
#elif defined(GL_HAVE_NEON)
    out[n++] = &gl_neon_kernels;
    if (f & GL_ARM_DOTPROD) out[n++] = &gl_neon_dot_kernels;
#endif
    return n;
}

#define GL_MAX_SETS 8

const gl_kernels *gl_kernels_get(void) {
    const gl_kernels *sets[GL_MAX_SETS];
    int n = gl_kernel_sets(sets);
    return sets[n - 1];
}

int gl_kernels_all(const gl_kernels **out, int cap) {
    const gl_kernels *sets[GL_MAX_SETS];
    int n = gl_kernel_sets(sets);
    for (int i = 0; i < n && i < cap; i++) out[i] = sets[i];
    return n;
}

/* Sets never chosen by gl_kernels_get (approximations an engine asks for
 * by name) that this CPU runs. */
static int gl_kernel_sets_optin(const gl_kernels **out) {
    int n = 0, f = gl_cpu_features();
    (void)f; (void)out;
#if defined(GL_HAVE_AVX2)
    if (f & GL_X86_AVX512_BF16) out[n++] = &gl_avx512_bf16_kernels;
#endif
    return n;
}

const gl_kernels *gl_kernels_by_name(const char *name) {
    const gl_kernels *sets[GL_MAX_SETS];
    int n = gl_kernel_sets(sets);
    n += gl_kernel_sets_optin(sets + n);
    for (int i = 0; i < n; i++)
        if (name && strcmp(sets[i]->name, name) == 0) return sets[i];
    return NULL;
}

void gl_quantize_weight_q8(const gl_mat *w, int8_t *q, float *scale, int r0, int r1, float *row) {
    /* every kernel set quantizes bit-identically, so take the fastest */
    const gl_kernels *k = gl_kernels_get();
    int8_t *rq = (int8_t *)(row + w->cols);      /* the row in int8, then into its panel */
    for (int r = r0; r < r1; r++) {
        gl_row_to_f32(w, r, row);
        k->quantize_q8(row, 1, w->cols, w->cols, rq, w->cols, &scale[r]);
        gl_q8_pack_rows(rq, w->cols, w->rows, w->cols, r, r + 1, q);
    }
}

/* ---------------------------------------------------------------------- */
/* Worker pool                                                            */
/* ---------------------------------------------------------------------- */
/* A decode step opens 10-20 short parallel regions per layer, so opening one
 * must cost far less than a futex wake-up.  The whole region state is one
 * 64-bit word, `work` = generation << 32 | next task index:
 *
 *  - the caller publishes a region by storing (new generation, 0), after
 *    closing the last one with (old generation, all ones);
 *  - anyone claims a task by CAS from (g, t) to (g, t+1) while t < n_tasks,
 *    so a worker that wakes late (the machine is shared, threads get
 *    descheduled) cannot take a task of a later region by mistake;
 *  - finished tasks are counted, and the caller returns when all are done:
 *    it never waits for a worker that took nothing.
 *
 * Idle workers spin on `work` for GL_POOL_SPIN_NS, then sleep on a condition
 * variable; the caller takes the mutex only when `sleepers` says someone
 * sleeps.  Each side writes its flag (sleepers / caller_asleep) before it
 * re-reads the other side's word, both seq_cst, so at least one of the two
 * sees the other: no wake-up is lost.  With more threads than CPUs the
 * spinning yields the CPU instead; otherwise a spin that has found nothing
 * for GL_POOL_YIELD_NS yields at each clock check, so a thread that needs
 * the CPU it holds (a caller between regions, the embedder's thread taking
 * its tokens) gets it in ~20 us, not at the end of the spin.  Fields polled
 * across threads sit on their own cache lines. */

#include <sched.h>
#include <time.h>

#define GL_POOL_SPIN_NS 200000     /* ~ the gap between two regions of a step, and more */
#define GL_POOL_YIELD_NS 20000     /* longer than the gaps inside a step of a big model */

static inline void gl_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

/* Spins a while: returns 0 once the spinning budget (from *start) is spent.
 * The budget is time, as a pause lasts 10 to 200 cycles depending on the
 * CPU; without a POSIX clock in scope it is a count. */
int gl_spin(int *spins, int64_t *start, int oversubscribed) {
    if (oversubscribed) { sched_yield(); return ++*spins < 50; }
    gl_cpu_relax();
    if ((++*spins & 63) != 0) return 1;
#if defined(CLOCK_MONOTONIC)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t t = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (*start == 0) *start = t;
    if (t - *start > GL_POOL_YIELD_NS) sched_yield();
    return t - *start < GL_POOL_SPIN_NS;
#else
    (void)start;
    return *spins < GL_POOL_SPIN_NS / 20;
#endif
}

struct gl_pool {
    int              n;                 /* workers including the caller          */
    int              oversubscribed;    /* more workers than CPUs: do not spin   */
    uint32_t         generation;        /* the caller's copy of the last one     */
    pthread_t       *threads;
    pthread_mutex_t  mu;
    pthread_cond_t   wake, done_cv;
    gl_task_fn       fn;                /* published by the store to `work`      */
    void            *ctx;
    char             pad0[64];
    _Atomic uint64_t work;              /* generation << 32 | next task          */
    atomic_int       n_tasks;
    atomic_int       stop;
    char             pad1[64];
    atomic_int       done;              /* tasks finished in this region         */
    atomic_int       caller_asleep;
    char             pad2[64];
    atomic_int       sleepers;          /* workers asleep (or about to be)       */
    char             pad3[64];
};

typedef struct { gl_pool *p; int id; } gl_worker_arg;

/* The task-index half of `work` for a pinned region (task w on worker w):
 * above any task count, below the "closed" all-ones value, so an unpinned
 * claim never takes it. */
#define GL_PINNED 0x80000000u

/* Runs tasks of generation gen until none is left, then adds how many it
 * ran to `done` (once: fewer cache-line transfers than once per task).
 * Returns 1 if that completed the region.  n_tasks is read after `work` and
 * rechecked on every claim: if it is already the next region's, the caller
 * has closed this generation (see gl_pool_run) before writing it, so the
 * CAS below fails rather than claim a task under a stale count. */
static int gl_pool_work(gl_pool *p, uint32_t gen, int worker) {
    uint64_t w = atomic_load_explicit(&p->work, memory_order_acquire);
    uint32_t n = 0;
    int ran = 0;
    if ((uint32_t)(w >> 32) == gen && (uint32_t)w == GL_PINNED) {
        /* every worker runs its own task once; the region cannot end (nor
           fn change) before this worker's task is done */
        p->fn(p->ctx, worker, worker);
        return atomic_fetch_add_explicit(&p->done, 1, memory_order_seq_cst) + 1 == p->n;
    }
    for (;;) {
        if ((uint32_t)(w >> 32) != gen) break;
        n = (uint32_t)atomic_load_explicit(&p->n_tasks, memory_order_acquire);
        if ((uint32_t)w >= n) break;
        if (!atomic_compare_exchange_weak_explicit(&p->work, &w, w + 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue;                   /* w now holds the current value */
        p->fn(p->ctx, (int)(uint32_t)w, worker);
        ran++;
        w = atomic_load_explicit(&p->work, memory_order_acquire);
    }
    if (!ran) return 0;
    return (uint32_t)(atomic_fetch_add_explicit(&p->done, ran, memory_order_seq_cst) + ran) == n;
}

static void *gl_worker_main(void *arg) {
    gl_worker_arg *wa = arg;
    gl_pool *p = wa->p;
    int id = wa->id;
    free(wa);
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        int64_t start = 0;
        while ((g = (uint32_t)(atomic_load_explicit(&p->work, memory_order_acquire) >> 32)) == seen) {
            if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
            if (gl_spin(&spins, &start, p->oversubscribed)) continue;
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
            while ((uint32_t)(atomic_load_explicit(&p->work, memory_order_seq_cst) >> 32) == seen &&
                   !atomic_load_explicit(&p->stop, memory_order_seq_cst))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_relaxed);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
            start = 0;
        }
        seen = g;
        if (gl_pool_work(p, g, id) && atomic_load_explicit(&p->caller_asleep, memory_order_seq_cst)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int gl_n_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}

gl_pool *gl_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    gl_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = 1;
    p->oversubscribed = n_threads > gl_n_cpus();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!p->threads) { gl_pool_free(p); return NULL; }
        for (int i = 1; i < n_threads; i++) {
            gl_worker_arg *wa = malloc(sizeof *wa);
            if (!wa) { gl_pool_free(p); return NULL; }
            wa->p = p; wa->id = i;
            if (pthread_create(&p->threads[i - 1], NULL, gl_worker_main, wa) != 0) {
                free(wa); gl_pool_free(p); return NULL;
            }
            p->n = i + 1;   /* only started threads are joined */
        }
    }
    return p;
}

void gl_pool_free(gl_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, 1, memory_order_seq_cst);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i - 1], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done_cv);
    free(p);
}

int gl_pool_size(const gl_pool *p) { return p ? p->n : 1; }

static void gl_pool_region(gl_pool *p, int n_tasks, gl_task_fn fn, void *ctx, int pinned);

void gl_pool_run(gl_pool *p, int n_tasks, gl_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    gl_pool_region(p, n_tasks, fn, ctx, 0);
}

void gl_pool_run_pinned(gl_pool *p, gl_task_fn fn, void *ctx) {
    if (!p || p->n == 1) { fn(ctx, 0, 0); return; }
    gl_pool_region(p, p->n, fn, ctx, 1);
}

static void gl_pool_region(gl_pool *p, int n_tasks, gl_task_fn fn, void *ctx, int pinned) {
    /* close the last region for late workers before its count changes */
    atomic_store_explicit(&p->work, (uint64_t)p->generation << 32 | 0xffffffffu, memory_order_relaxed);
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_release);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint32_t gen = ++p->generation;
    if (gen == 0) gen = p->generation = 1;          /* workers start having seen 0 */
    atomic_store_explicit(&p->work, (uint64_t)gen << 32 | (pinned ? GL_PINNED : 0u),
                          memory_order_seq_cst);   /* publishes the above */
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    gl_pool_work(p, gen, 0);
    /* wait for tasks other workers took */
    int spins = 0;
    int64_t start = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks) {
        if (gl_spin(&spins, &start, p->oversubscribed)) continue;
        pthread_mutex_lock(&p->mu);
        atomic_store_explicit(&p->caller_asleep, 1, memory_order_seq_cst);
        while (atomic_load_explicit(&p->done, memory_order_seq_cst) < n_tasks)
            pthread_cond_wait(&p->done_cv, &p->mu);
        atomic_store_explicit(&p->caller_asleep, 0, memory_order_relaxed);
        pthread_mutex_unlock(&p->mu);
    }
}
#endif /* GGML_LIKE_C_INCLUDED */

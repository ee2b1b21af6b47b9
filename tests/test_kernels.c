/* test_kernels.c -- checks every kernel set this CPU runs against the scalar
 * one, the batch-invariance rule, the number conversions and the pool.
 *
 *   cc -O2 -std=c11 -pthread tests/test_kernels.c -lm && ./a.out [seed]
 *
 * (It includes ggml_like.c itself, as cm384.c does.)  Prints one line per
 * failure and ends with "kernels: N passed, N failed"; exits 0 only if all
 * pass.  Each check counts once, however many values it compares.  Also
 * meant to run under -fsanitize=address,undefined and -fsanitize=thread,
 * and under qemu-aarch64 for the NEON sets.  CM384_TEST_POOL_ONLY=1 (the
 * ThreadSanitizer run) keeps what runs on more than one thread -- the pool
 * and every set's products through it -- and leaves the single-threaded
 * checks to the plain and ASan runs, where they cost a tenth of the time. */
#include "../ggml_like/ggml_like.c"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

static int kern_passed, kern_failed;
static int pool_only;   /* CM384_TEST_POOL_ONLY: only what runs on the pool's threads */

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...) {
    if (ok) { kern_passed++; return; }
    kern_failed++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

/* ---- helpers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) {            /* xorshift64* */
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
static int   rng_int(int n) { return (int)(rng_u64() % (uint64_t)n); }
static float rng_unif(void) { return (float)((double)(rng_u64() >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f; }

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Same value, with NaN equal to NaN and +0 equal to -0. */
static int same_value(float a, float b) { return (a != a && b != b) || a == b; }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { printf("out of memory\n"); exit(2); }
    return p;
}

static const char *type_name(int t) {
    static const char *names[] = {"f32", "f16", "bf16", "f8e4m3", "q8"};
    return t >= 0 && t < GL_TYPE_COUNT ? names[t] : "?";
}

/* A random weight matrix of a stored type, owning its buffers. */
typedef struct { gl_mat m; void *data; float *scale; int8_t *q8rows; } test_mat;   /* q8rows: Q8's values row-major */

/* A Q8 matrix's values, row-major, into the panels the kernels read. */
static void *q8_packed(const int8_t *rows_data, int rows, int cols) {
    int8_t *q = xmalloc(gl_q8_bytes(rows, cols));
    gl_q8_pack_rows(rows_data, cols, rows, cols, 0, rows, q);
    return q;
}

static test_mat make_mat(int type, int rows, int cols) {
    test_mat t;
    size_t count = (size_t)rows * cols;
    t.data = xmalloc(count * gl_type_size(type));
    t.scale = NULL;
    for (size_t i = 0; i < count; i++) {
        float v = rng_unif();
        switch (type) {
        case GL_F32:  ((float *)t.data)[i] = v; break;
        case GL_F16:  ((uint16_t *)t.data)[i] = gl_f32_to_f16(v); break;
        case GL_BF16: ((uint16_t *)t.data)[i] = gl_f32_to_bf16(v); break;
        case GL_F8_E4M3: {
            uint8_t b;
            do b = (uint8_t)rng_u64(); while ((b & 0x7f) == 0x7f);   /* no NaN codes */
            ((uint8_t *)t.data)[i] = b;
            break;
        }
        case GL_Q8: ((int8_t *)t.data)[i] = (int8_t)(rng_int(256) - 128); break;   /* -128 too: allowed in weights */
        }
    }
    if (type == GL_F8_E4M3) {
        size_t nb = (size_t)((rows + 127) / 128) * (size_t)((cols + 127) / 128);
        t.scale = xmalloc(nb * sizeof(float));
        for (size_t i = 0; i < nb; i++) t.scale[i] = ldexpf(1.0f + 0.5f * rng_unif(), -8 + rng_int(4));
    } else if (type == GL_Q8) {
        t.scale = xmalloc((size_t)rows * sizeof(float));
        for (int i = 0; i < rows; i++) t.scale[i] = (1.0f + 0.5f * rng_unif()) / 127.0f;
    }
    t.q8rows = NULL;
    if (type == GL_Q8) { t.q8rows = t.data; t.data = q8_packed(t.q8rows, rows, cols); }
    t.m.type = type; t.m.rows = rows; t.m.cols = cols; t.m.data = t.data; t.m.scale = t.scale;
    return t;
}
static void free_mat(test_mat *t) { free(t->data); free(t->scale); free(t->q8rows); }

/* Activations: n rows of cols floats at stride ldx, plus their int8 form. */
typedef struct { float *x; int8_t *xq; float *xs; int n, cols, ldx; } test_act;

static test_act make_act(const gl_kernels *k, int n, int cols, int ldx) {
    test_act a = {xmalloc((size_t)n * ldx * sizeof(float)), xmalloc((size_t)n * ldx), xmalloc((size_t)n * sizeof(float)), n, cols, ldx};
    for (size_t i = 0; i < (size_t)n * ldx; i++) a.x[i] = rng_unif();
    k->quantize_q8(a.x, n, cols, ldx, a.xq, ldx, a.xs);
    return a;
}
static void free_act(test_act *a) { free(a->x); free(a->xq); free(a->xs); }

/* One matrix product through a kernel set, either kind of weight. */
static void run_mm(const gl_kernels *k, const gl_mat *w, const test_act *a, int i0, int n, float *y, int ldy, int r0, int r1) {
    if (w->type == GL_Q8)
        k->matmul_q8(w, a->xq + (size_t)i0 * a->ldx, a->xs + i0, n, a->ldx, y, ldy, r0, r1);
    else
        k->matmul(w, a->x + (size_t)i0 * a->ldx, n, a->ldx, y, ldy, r0, r1);
}

/* ---- conversions ---- */

static double ref_f16(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static double ref_f8(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v = (e == 15 && m == 7) ? NAN : e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return s ? -v : v;
}

/* Nearest f16 to f by exhaustive comparison against the (sorted) finite
 * positive halves, ties to the even code; overflow past 65504 + half an ulp. */
static uint16_t ref_f32_to_f16(float f) {
    uint16_t sign = f2u(f) >> 31 ? 0x8000 : 0;
    double a = fabs((double)f);
    if (f != f) return 0x7e00;
    if (a >= 65520.0) return sign | 0x7c00;
    int lo = 0, hi = 0x7bff;                  /* largest code with value <= a */
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (ref_f16((uint16_t)mid) <= a) lo = mid; else hi = mid - 1; }
    double d0 = a - ref_f16((uint16_t)lo), d1 = lo < 0x7bff ? ref_f16((uint16_t)(lo + 1)) - a : INFINITY;
    int code = d0 < d1 ? lo : d1 < d0 ? lo + 1 : (lo & 1 ? lo + 1 : lo);
    if (lo == 0x7bff && a > 65504.0) code = 0x7bff;
    return (uint16_t)(sign | code);
}

static uint16_t ref_f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    uint32_t lo = u & 0xffff0000u;
    double vl = fabs((double)u2f(lo)), a = fabs((double)f);
    double vh = ((lo >> 16) & 0x7fff) == 0x7f7f ? ldexp(1, 128) : fabs((double)u2f(lo + 0x10000u));
    if ((lo & 0x7f800000u) == 0x7f800000u) return (uint16_t)(lo >> 16);   /* infinity */
    double d0 = a - vl, d1 = vh - a;
    int up = d1 < d0 || (d1 == d0 && ((lo >> 16) & 1));
    return (uint16_t)((up ? lo + 0x10000u : lo) >> 16);
}

static void test_conversions(void) {
    int bad = 0, first = -1;
    for (int h = 0; h < 65536; h++) {
        double r = ref_f16((uint16_t)h);
        float f = gl_f16_to_f32((uint16_t)h);
        if (!(same_value(f, (float)r) && (f2u(f) >> 31) == (uint32_t)(h >> 15))) { bad++; if (first < 0) first = h; }
    }
    check(!bad, "gl_f16_to_f32: %d of 65536 codes wrong (first 0x%04x)", bad, first);

    bad = 0; first = -1;
    for (int b = 0; b < 256; b++) {
        double r = ref_f8((uint8_t)b);
        float f = gl_f8e4m3_to_f32((uint8_t)b);
        if (!same_value(f, (float)r)) { bad++; if (first < 0) first = b; }
    }
    check(!bad, "gl_f8e4m3_to_f32: %d of 256 codes wrong (first 0x%02x)", bad, first);

    /* gl_row_to_f32 over rows holding every 16-bit code (the vector path)
       and an odd tail: each value as the one-code conversion gives it */
    {
        enum { COLS = 65536 + 7 };
        uint16_t *codes = malloc(COLS * sizeof *codes);
        float *row = malloc(COLS * sizeof *row);
        for (int c = 0; c < COLS; c++) codes[c] = (uint16_t)(c * 40503u);   /* odd stride: every code */
        for (int t = 0; t < 2; t++) {
            int type = t ? GL_F16 : GL_BF16;
            gl_mat w = {type, 1, COLS, codes, NULL};
            gl_row_to_f32(&w, 0, row);
            bad = 0; first = -1;
            for (int c = 0; c < COLS; c++) {
                float want = type == GL_BF16 ? gl_bf16_to_f32(codes[c]) : gl_f16_to_f32(codes[c]);
                int ok = want != want ? row[c] != row[c] : f2u(row[c]) == f2u(want);
                if (!ok) { bad++; if (first < 0) first = codes[c]; }
            }
            check(!bad, "gl_row_to_f32 %s: %d of %d wrong (first code 0x%04x)", t ? "f16" : "bf16", bad, COLS, first);
        }
        free(codes);
        free(row);
    }

    /* f32 -> f16: every finite half, the midpoints to its neighbours and one
       float either side of them, both signs; then random floats. */
    bad = 0; uint32_t firstu = 0;
    for (int h = 0; h < 0x7c00; h++) {
        float v = (float)ref_f16((uint16_t)h), nx = (float)ref_f16((uint16_t)(h + 1));
        float mid = h < 0x7bff ? (float)(((double)v + (double)nx) / 2) : 65520.0f;
        float probes[5] = {v, mid, nextafterf(mid, 0), nextafterf(mid, INFINITY), nextafterf(v, INFINITY)};
        for (int j = 0; j < 5; j++)
            for (int s = 0; s < 2; s++) {
                float f = s ? -probes[j] : probes[j];
                if (gl_f32_to_f16(f) != ref_f32_to_f16(f)) { if (!bad++) firstu = f2u(f); }
            }
    }
    for (int i = 0; i < 300000; i++) {
        uint32_t u = (uint32_t)rng_u64();
        if (i & 1) u = (u & 0x8fffffffu) | 0x30000000u;   /* half of them near the f16 range */
        float f = u2f(u);
        if (f != f) continue;
        if (gl_f32_to_f16(f) != ref_f32_to_f16(f)) { if (!bad++) firstu = u; }
    }
    check(!bad, "gl_f32_to_f16: %d wrong (first input bits 0x%08x)", bad, (unsigned)firstu);

    bad = 0; firstu = 0;
    static const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff};
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (int j = 0; j < 7; j++) {
            uint32_t u = (hi << 16) | (j < 6 ? lows[j] : (uint32_t)rng_u64() & 0xffff);
            float f = u2f(u);
            if (f != f) continue;
            if (gl_f32_to_bf16(f) != ref_f32_to_bf16(f)) { if (!bad++) firstu = u; }
        }
    check(!bad, "gl_f32_to_bf16: %d wrong (first input bits 0x%08x)", bad, (unsigned)firstu);
}

static int code_is_finite(int type, int code) {
    if (type == GL_F8_E4M3) return (code & 0x7f) != 0x7f;
    if (type == GL_F16) return (code & 0x7c00) != 0x7c00;
    return (code & 0x7f80) != 0x7f80;
}

/* Each set's own weight conversions, through its matmul: a [rows][9] matrix
 * holding every code, times the unit vectors e_0..e_8 (8 columns through
 * the vector path, 1 through the tail), must give each code's value. */
static void test_set_conversions(const gl_kernels *k) {
    for (int type = GL_F16; type <= GL_F8_E4M3; type++) {
        int ncodes = type == GL_F8_E4M3 ? 256 : 65536, cols = 9;
        int rows = type == GL_F8_E4M3 ? 300 : (ncodes + cols - 1) / cols;   /* f8: 3 row blocks */
        size_t es = gl_type_size(type);
        uint8_t *data = xmalloc((size_t)rows * cols * es);
        int bcols = 1, brows = (rows + 127) / 128;
        float *scale = xmalloc((size_t)brows * bcols * sizeof(float));
        for (int b = 0; b < brows; b++) scale[b] = b == 0 ? 1.0f : ldexpf(1.5f, -b);   /* exact products */
        /* infinities and NaNs times the zeros of x would make NaN for the
           whole row: they are stored as 0 and their rows' checks skip them */
        for (int i = 0; i < rows * cols; i++) {
            int code = i % ncodes;
            if (!code_is_finite(type, code)) code = 0;
            if (es == 2) { uint16_t h = (uint16_t)code; memcpy(data + 2 * (size_t)i, &h, 2); }
            else data[i] = (uint8_t)code;
        }
        gl_mat w = {type, rows, cols, data, type == GL_F8_E4M3 ? scale : NULL};
        float *y = xmalloc((size_t)rows * sizeof(float));
        int bad = 0, first = -1;
        for (int j = 0; j < cols; j++) {
            float x[9] = {0};
            x[j] = 1.0f;
            k->matmul(&w, x, 1, cols, y, rows, 0, rows);
            for (int r = 0; r < rows; r++) {
                int code = (r * cols + j) % ncodes;
                double ref = type == GL_F16 ? ref_f16((uint16_t)code)
                           : type == GL_BF16 ? (double)gl_bf16_to_f32((uint16_t)code)
                           : ref_f8((uint8_t)code) * scale[r / 128];
                if (!code_is_finite(type, code)) continue;
                if (!same_value(y[r], (float)ref)) { bad++; if (first < 0) first = code; }
            }
        }
        check(!bad, "%s: %s weight conversion: %d codes wrong (first 0x%x)", k->name, type_name(type), bad, first);
        free(y); free(data); free(scale);
    }
}

/* ---- quantization, dot, axpy ---- */

static void test_quantize(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int colss[] = {1, 7, 31, 32, 33, 129, 4097};
    for (size_t ci = 0; ci < sizeof colss / sizeof *colss; ci++) {
        int cols = colss[ci], n = 5, ldx = cols + 3;
        float *x = xmalloc((size_t)n * ldx * sizeof(float));
        for (int i = 0; i < n * ldx; i++) x[i] = rng_unif() * ldexpf(1, rng_int(8) - 4);
        for (int c = 0; c < cols; c++) x[c] = 0;                /* row 0: all zero       */
        x[ldx + rng_int(cols)] = 1000.0f;                        /* row 1: one big value  */
        int8_t *q = xmalloc((size_t)n * ldx), *qs = xmalloc((size_t)n * ldx);
        float sc[5], scs[5];
        k->quantize_q8(x, n, cols, ldx, q, ldx, sc);
        s->quantize_q8(x, n, cols, ldx, qs, ldx, scs);
        int same = 1, bound = 1, range = 1;
        for (int i = 0; i < n; i++) {
            if (f2u(sc[i]) != f2u(scs[i])) same = 0;
            int qmax = 0;
            for (int c = 0; c < cols; c++) {
                int v = q[(size_t)i * ldx + c];
                if (v != qs[(size_t)i * ldx + c]) same = 0;
                if (v < -127 || v > 127) range = 0;
                if (abs(v) > qmax) qmax = abs(v);
                /* round to nearest: |x - q*s| <= s/2, plus the rounding of x*inv */
                double err = fabs((double)x[(size_t)i * ldx + c] - (double)v * sc[i]);
                if (err > sc[i] * (0.5 + 1e-5)) bound = 0;
            }
            if (i == 0 ? sc[0] != 0 : qmax != 127) range = 0;
        }
        check(same, "%s: quantize_q8 cols=%d differs from scalar", k->name, cols);
        check(bound, "%s: quantize_q8 cols=%d round trip off by more than half a step", k->name, cols);
        check(range, "%s: quantize_q8 cols=%d values or scales out of range", k->name, cols);
        free(x); free(q); free(qs);
    }
}

/* fp32 sums in another order differ by at most about 2*depth*u*sum|terms|,
 * u = 2^-24, depth = the longest chain of roundings (cols/8 per lane, plus
 * the lane sum and the products). */
static double fp_tol(int cols, double sum_abs) { return 2.0 * (cols / 8 + 8) * ldexp(1, -24) * sum_abs + 1e-37; }

/* axpy_rows is m axpys in one pass: the same bits as calling axpy m times,
 * and close to the scalar set. */
static void test_axpy_rows(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int ns[] = {1, 7, 8, 31, 32, 33, 100, 512, 515}, ms[] = {1, 3, 16};
    float *x = xmalloc(16 * 600 * sizeof(float)), *p = xmalloc(16 * sizeof(float));
    float *y = xmalloc(600 * sizeof(float)), *y1 = xmalloc(600 * sizeof(float)), *ys = xmalloc(600 * sizeof(float));
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++) {
            int n = ns[ni], m = ms[mi], ld = n + 5;
            for (int i = 0; i < m * ld; i++) x[i] = rng_unif();
            for (int j = 0; j < m; j++) p[j] = rng_unif();
            for (int c = 0; c < n; c++) y[c] = y1[c] = ys[c] = rng_unif();
            k->axpy_rows(y, x, ld, p, m, n);
            for (int j = 0; j < m; j++) k->axpy(y1, x + (size_t)j * ld, p[j], n);
            s->axpy_rows(ys, x, ld, p, m, n);
            int same = 1, close = 1;
            for (int c = 0; c < n; c++) {
                same &= f2u(y[c]) == f2u(y1[c]);
                close &= fabs((double)y[c] - ys[c]) <= 1e-5 * (1 + fabs((double)ys[c])) * m;
            }
            check(same, "%s: axpy_rows n=%d m=%d differs from m axpys", k->name, n, m);
            check(close, "%s: axpy_rows n=%d m=%d differs from scalar", k->name, n, m);
        }
    /* axpy_rows_n: nh outputs over one x, the same bits as nh axpy_rows */
    static const int nhs[] = {1, 3, 4, 7, 16};
    float *a = xmalloc(16 * 20 * sizeof(float)), *yn = xmalloc(16 * 520 * sizeof(float)), *yr = xmalloc(16 * 520 * sizeof(float));
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t hi = 0; hi < sizeof nhs / sizeof *nhs; hi++) {
            int n = ns[ni], nh = nhs[hi], m = 13, ld = n + 5, ldy = n + 3, lda = 20;
            for (int i = 0; i < m * ld; i++) x[i] = rng_unif();
            for (int i = 0; i < nh * lda; i++) a[i] = rng_unif();
            for (int i = 0; i < nh * ldy; i++) yn[i] = yr[i] = rng_unif();
            k->axpy_rows_n(yn, ldy, x, ld, a, lda, nh, m, n);
            for (int h = 0; h < nh; h++) k->axpy_rows(yr + (size_t)h * ldy, x, ld, a + (size_t)h * lda, m, n);
            int same = 1;
            for (int i = 0; i < nh * ldy; i++) same &= f2u(yn[i]) == f2u(yr[i]);   /* gaps untouched too */
            check(same, "%s: axpy_rows_n n=%d heads=%d differs from axpy_rows", k->name, n, nh);
        }
    free(a); free(yn); free(yr);
    /* more rows than the SIMD sets take a call (GL_ROWP_MAX = 64): the
       pieces' sums are stored and reloaded, the bits those of one pass */
    {
        enum { MM = 150, NN = 100, LDA = MM + 2 };
        float *xl = xmalloc((size_t)MM * NN * sizeof(float)), *al = xmalloc((size_t)4 * LDA * sizeof(float));
        float *y4 = xmalloc((size_t)4 * NN * sizeof(float)), *y1s = xmalloc((size_t)4 * NN * sizeof(float));
        for (int i = 0; i < MM * NN; i++) xl[i] = rng_unif();
        for (int i = 0; i < 4 * LDA; i++) al[i] = rng_unif();
        static const int mls[] = {63, 64, 65, 128, 150};
        for (size_t mi = 0; mi < sizeof mls / sizeof *mls; mi++) {
            for (int i = 0; i < 4 * NN; i++) y4[i] = y1s[i] = rng_unif();
            k->axpy_rows_n(y4, NN, xl, NN, al, LDA, 4, mls[mi], NN);
            for (int h = 0; h < 4; h++) k->axpy_rows(y1s + (size_t)h * NN, xl, NN, al + (size_t)h * LDA, mls[mi], NN);
            check(!memcmp(y4, y1s, (size_t)4 * NN * sizeof(float)), "%s: axpy_rows_n m=%d differs from axpy_rows",
                  k->name, mls[mi]);
        }
        free(xl); free(al); free(y4); free(y1s);
    }
    free(x); free(p); free(y); free(y1); free(ys);
}

/* dot_rows_t: in the SIMD sets every output is one fmaf chain over c, the
 * same bits as computed here whatever m, nl or the lane's place in its
 * vector; the scalar set (plain multiply-adds) within rounding of it.  The
 * outputs' gaps (ldy > m) are left untouched. */
/* transpose: every element to its place, nothing written outside the
 * rows x cols block of dst (edges of 16 x 16 blocks in both directions). */
static void test_transpose(const gl_kernels *k) {
    static const int shapes[][2] = {{1, 1}, {16, 16}, {3, 40}, {16, 576}, {17, 33}, {64, 576}, {31, 5}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], lds = cols + 3, ldd = rows + 5;
        float *src = xmalloc((size_t)rows * lds * sizeof(float)), *dst = xmalloc((size_t)cols * ldd * sizeof(float));
        for (size_t i = 0; i < (size_t)rows * lds; i++) src[i] = rng_unif();
        for (size_t i = 0; i < (size_t)cols * ldd; i++) dst[i] = -7;
        k->transpose(dst, ldd, src, lds, rows, cols);
        int bad = 0;
        for (int c = 0; c < cols; c++)
            for (int r = 0; r < ldd; r++)
                bad += f2u(dst[(size_t)c * ldd + r]) != f2u(r < rows ? src[(size_t)r * lds + c] : -7.0f);
        check(!bad, "%s: transpose %dx%d: %d values wrong", k->name, rows, cols, bad);
        free(src); free(dst);
    }
}

static void test_dot_rows_t(const gl_kernels *k) {
    static const int ns[] = {1, 19, 576}, ms[] = {1, 4, 5, 16, 19, 33}, nls[] = {1, 5, 16, 17, 40, 64, 80, 130};
    const int simd = strcmp(k->name, "scalar") != 0;
    float *x = xmalloc(33 * 580 * sizeof(float)), *qt = xmalloc(576 * 132 * sizeof(float));
    float *y = xmalloc(130 * 40 * sizeof(float));
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++)
            for (size_t li = 0; li < sizeof nls / sizeof *nls; li++) {
                int n = ns[ni], m = ms[mi], nl = nls[li], ldx = n + 3, ldq = nl + 2, ldy = m + 4;
                for (int i = 0; i < m * ldx; i++) x[i] = rng_unif();
                for (int i = 0; i < n * ldq; i++) qt[i] = rng_unif();
                for (int i = 0; i < nl * ldy; i++) y[i] = -7.0f;
                k->dot_rows_t(y, ldy, qt, ldq, nl, x, ldx, m, n);
                int ok = 1;
                for (int l = 0; l < nl; l++)
                    for (int j = 0; j < ldy; j++) {
                        float got = y[(size_t)l * ldy + j];
                        if (j >= m) { ok &= got == -7.0f; continue; }
                        float ref = 0;
                        double mag = 0;
                        for (int c = 0; c < n; c++) {
                            float a = qt[(size_t)c * ldq + l], b = x[(size_t)j * ldx + c];
                            ref = fmaf(a, b, ref);
                            mag += fabs((double)a * b);
                        }
                        if (simd) ok &= f2u(got) == f2u(ref);
                        else ok &= fabs((double)got - ref) <= 2.0 * (n + 1) * ldexp(1, -24) * mag + 1e-37;
                    }
                check(ok, "%s: dot_rows_t n=%d m=%d lanes=%d %s", k->name, n, m, nl,
                      simd ? "differs from the fmaf chain" : "is not within rounding of it");
            }
    free(x); free(qt); free(y);
}

/* The bf16-row forms of dot_rows_t and axpy_rows_n: the same bits as the
 * set's fp32 forms on the rows widened to fp32, on odd widths (a last
 * element without a pair), every row count and lane count the core uses,
 * head counts with and without a remainder of 4.  The rows are allocated
 * to end exactly where the last one does, so a read past it is caught
 * under ASan; the outputs' gaps are left untouched. */
static void test_bf16_rows(const gl_kernels *k) {
    check(k->dot_rows_t_bf16 && k->axpy_rows_n_bf16, "%s: has no bf16-row kernels", k->name);
    if (!k->dot_rows_t_bf16 || !k->axpy_rows_n_bf16) return;
    static const int ns[] = {1, 2, 19, 33, 512, 576}, ms[] = {1, 3, 5, 16, 17, 23, 33}, nls[] = {1, 5, 16, 17, 40, 64, 80};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++) {
            int n = ns[ni], m = ms[mi], ldx = n + 3;
            size_t nx = (size_t)(m - 1) * ldx + n;
            uint16_t *xh = xmalloc(nx * sizeof(uint16_t));
            float *xf = xmalloc(nx * sizeof(float));
            for (size_t i = 0; i < nx; i++) {
                xh[i] = gl_f32_to_bf16(rng_unif() * (i % 7 == 0 ? 1e-3f : 3.0f));
                if (i % 29 == 5) xh[i] = 0x8000;               /* -0 */
                xf[i] = gl_bf16_to_f32(xh[i]);
            }
            for (size_t li = 0; li < sizeof nls / sizeof *nls; li++) {
                int nl = nls[li], ldq = nl + 2, ldy = m + 4;
                float *qt = xmalloc((size_t)n * ldq * sizeof(float));
                float *y1 = xmalloc((size_t)nl * ldy * sizeof(float)), *y2 = xmalloc((size_t)nl * ldy * sizeof(float));
                for (int i = 0; i < n * ldq; i++) qt[i] = rng_unif();
                for (int i = 0; i < nl * ldy; i++) y1[i] = y2[i] = -7.0f;
                k->dot_rows_t(y1, ldy, qt, ldq, nl, xf, ldx, m, n);
                k->dot_rows_t_bf16(y2, ldy, qt, ldq, nl, xh, ldx, m, n);
                check(!memcmp(y1, y2, (size_t)nl * ldy * sizeof(float)),
                      "%s: dot_rows_t_bf16 n=%d m=%d lanes=%d differs from dot_rows_t on the widened rows", k->name, n, m, nl);
                /* nl heads of weighted sums over the same rows, weights [h][lda] */
                int lda = m + 1, ldh = n + 5;
                float *a = xmalloc((size_t)nl * lda * sizeof(float));
                float *s1 = xmalloc((size_t)nl * ldh * sizeof(float)), *s2 = xmalloc((size_t)nl * ldh * sizeof(float));
                for (int i = 0; i < nl * lda; i++) a[i] = rng_unif();
                for (int i = 0; i < nl * ldh; i++) s1[i] = s2[i] = rng_unif();
                k->axpy_rows_n(s1, ldh, xf, ldx, a, lda, nl, m, n);
                k->axpy_rows_n_bf16(s2, ldh, xh, ldx, a, lda, nl, m, n);
                check(!memcmp(s1, s2, (size_t)nl * ldh * sizeof(float)),
                      "%s: axpy_rows_n_bf16 n=%d m=%d heads=%d differs from axpy_rows_n on the widened rows", k->name, n, m, nl);
                free(a); free(s1); free(s2);
                free(qt); free(y1); free(y2);
            }
            free(xh); free(xf);
        }
}

/* axpy_rowp_n (and its bf16 form), rows by pointer: the same bits as
 * axpy_rows_n on the same rows laid out contiguously, for rows that lie
 * apart (each allocated alone, with its exact size, so a read past one is
 * caught under ASan), in any order in memory, every head count with and
 * without a remainder of 4, widths with vector tails, and more rows than
 * the contiguous form takes in one piece. */
static void test_rowp(const gl_kernels *k) {
    check(k->axpy_rowp_n && k->axpy_rowp_n_bf16, "%s: has no row-pointer kernels", k->name);
    if (!k->axpy_rowp_n || !k->axpy_rowp_n_bf16) return;
    static const int ns[] = {1, 7, 19, 33, 64, 100, 512}, ms[] = {1, 5, 16, 47, 64, 70}, nhs[] = {1, 3, 4, 7, 16, 17};
    enum { MMAX = 70 };
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++) {
            int n = ns[ni], m = ms[mi], ldx = n + 3;
            float *xf = xmalloc((size_t)m * ldx * sizeof(float));
            uint16_t *xh = xmalloc((size_t)m * ldx * sizeof(uint16_t));
            float *rf[MMAX];
            uint16_t *rh[MMAX];
            for (int j = 0; j < m; j++) {   /* allocated in reverse, so the rows run backwards if anything */
                int jj = m - 1 - j;
                rf[jj] = xmalloc((size_t)n * sizeof(float));
                rh[jj] = xmalloc((size_t)n * sizeof(uint16_t));
            }
            for (int j = 0; j < m; j++)
                for (int c = 0; c < n; c++) {
                    uint16_t h = gl_f32_to_bf16(rng_unif() * ((j + c) % 7 == 0 ? 1e-3f : 3.0f));
                    rh[j][c] = xh[(size_t)j * ldx + c] = h;
                    rf[j][c] = xf[(size_t)j * ldx + c] = rng_unif();
                }
            for (size_t hi = 0; hi < sizeof nhs / sizeof *nhs; hi++) {
                int nh = nhs[hi], lda = m + 2, ldy = n + 5;
                float *a = xmalloc((size_t)nh * lda * sizeof(float));
                float *y1 = xmalloc((size_t)nh * ldy * sizeof(float)), *y2 = xmalloc((size_t)nh * ldy * sizeof(float));
                for (int i = 0; i < nh * lda; i++) a[i] = rng_unif();
                for (int bf = 0; bf < 2; bf++) {
                    for (int i = 0; i < nh * ldy; i++) y1[i] = y2[i] = rng_unif();
                    if (bf) {
                        k->axpy_rows_n_bf16(y1, ldy, xh, ldx, a, lda, nh, m, n);
                        k->axpy_rowp_n_bf16(y2, ldy, (const uint16_t *const *)rh, a, lda, nh, m, n);
                    } else {
                        k->axpy_rows_n(y1, ldy, xf, ldx, a, lda, nh, m, n);
                        k->axpy_rowp_n(y2, ldy, (const float *const *)rf, a, lda, nh, m, n);
                    }
                    check(!memcmp(y1, y2, (size_t)nh * ldy * sizeof(float)),
                          "%s: axpy_rowp_n%s n=%d m=%d heads=%d differs from axpy_rows_n", k->name, bf ? "_bf16" : "", n,
                          m, nh);
                }
                free(a); free(y1); free(y2);
            }
            for (int j = 0; j < m; j++) { free(rf[j]); free(rh[j]); }
            free(xf); free(xh);
        }
}

/* exp_sum and silu_mul against the scalar set (expf): within a few ulp per
 * element, on odd lengths (the vector tails), wide ranges, and the inputs
 * at the edges of the exponential: far below its range (0), above it (no
 * inf or NaN), and -inf (a masked key gives 0). */
static void test_exp_silu(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int ns[] = {1, 3, 4, 7, 8, 9, 16, 31, 64, 550, 1001};
    float *x = xmalloc(1001 * sizeof(float)), *xs = xmalloc(1001 * sizeof(float)), *b = xmalloc(1001 * sizeof(float));
    double worst_e = 0, worst_si = 0;
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (int range = 0; range < 3; range++) {
            int n = ns[ni];
            float spread = range == 0 ? 1.0f : range == 1 ? 30.0f : 300.0f, scale = range == 2 ? 0.5f : 0.0883883f;
            float shift = -INFINITY;   /* the max, as the attention core passes it */
            for (int i = 0; i < n; i++) { xs[i] = x[i] = rng_unif() * spread; if (x[i] > shift) shift = x[i]; }
            if (range == 2 && n > 2) xs[n / 2] = x[n / 2] = -INFINITY;
            double sum = k->exp_sum(x, n, scale, shift), sum_s = s->exp_sum(xs, n, scale, shift);
            int ok = fabs(sum - sum_s) <= 4e-6 * sum_s + 1e-30;
            for (int i = 0; i < n; i++) {
                double err = fabs((double)x[i] - xs[i]);
                if (err > 4e-6 * xs[i] + 1e-30 || !(x[i] >= 0)) ok = 0;
                if (xs[i] > 1e-30 && err / xs[i] > worst_e) worst_e = err / xs[i];
            }
            check(ok, "%s: exp_sum n=%d range %g differs from scalar (sum %g, scalar %g)", k->name, n,
                  (double)spread, sum, sum_s);
            for (int i = 0; i < n; i++) { xs[i] = x[i] = rng_unif() * spread * 4; b[i] = rng_unif() * 2; }
            if (n > 3) { xs[0] = x[0] = -1000.0f; xs[1] = x[1] = 1000.0f; xs[2] = x[2] = 0.0f; }
            k->silu_mul(x, b, n);
            s->silu_mul(xs, b, n);
            ok = 1;
            for (int i = 0; i < n; i++) {
                double err = fabs((double)x[i] - xs[i]);
                if (err > 1e-6 * fabs((double)xs[i]) + 1e-30 || x[i] != x[i]) ok = 0;
                if (fabs((double)xs[i]) > 1e-30 && err / fabs((double)xs[i]) > worst_si) worst_si = err / fabs((double)xs[i]);
            }
            check(ok, "%s: silu_mul n=%d range %g differs from scalar", k->name, n, (double)spread);
        }
    printf("  %s: exp_sum and silu_mul against expf: worst relative error %.2e and %.2e\n", k->name, worst_e, worst_si);
    free(x); free(xs); free(b);
}

static void test_dot_axpy(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int ns[] = {0, 1, 7, 8, 31, 33, 64, 129, 512, 4097};
    float *a = xmalloc(4200 * sizeof(float)), *b = xmalloc(4200 * sizeof(float));
    float *y = xmalloc(4200 * sizeof(float)), *ys = xmalloc(4200 * sizeof(float)), *buf = xmalloc(4210 * sizeof(float));
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
        int n = ns[ni];
        for (int i = 0; i < n; i++) a[i] = rng_unif(), b[i] = rng_unif(), y[i] = ys[i] = rng_unif();
        double sum_abs = 0;
        for (int i = 0; i < n; i++) sum_abs += fabs((double)a[i] * b[i]);
        float d = k->dot(a, b, n), ds = s->dot(a, b, n);
        check(fabs((double)d - ds) <= fp_tol(n, sum_abs), "%s: dot n=%d: %.9g vs scalar %.9g", k->name, n, d, ds);
        int aligned = 1;                          /* same bits at any alignment */
        for (int off = 1; off < 8; off++) {
            memcpy(buf + off, a, (size_t)n * sizeof(float));
            if (f2u(k->dot(buf + off, b, n)) != f2u(d)) aligned = 0;
        }
        check(aligned, "%s: dot n=%d depends on the alignment", k->name, n);
        float al = rng_unif();
        k->axpy(y, a, al, n);
        s->axpy(ys, a, al, n);
        int ok = 1;
        for (int i = 0; i < n; i++)
            if (fabs((double)y[i] - ys[i]) > 4 * ldexp(1, -24) * (fabs((double)ys[i]) + fabs((double)al * a[i])) + 1e-37) ok = 0;
        check(ok, "%s: axpy n=%d differs from scalar", k->name, n);
    }
    free(a); free(b); free(y); free(ys); free(buf);
}

/* ---- matmul against scalar ---- */

static void test_matmul_vs_scalar(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int colss[] = {1, 7, 31, 129, 4097}, rowss[] = {1, 5, 7, 17}, ns[] = {1, 3, 4, 5, 9};
    float *wrow = xmalloc(4097 * sizeof(float));
    for (int type = 0; type < GL_TYPE_COUNT; type++)
        for (size_t ci = 0; ci < 6; ci++)          /* ci == 5: a random shape */
            for (size_t ri = 0; ri < 4; ri++) {
                int cols = ci < 5 ? colss[ci] : 1 + rng_int(700);
                int rows = ci < 5 ? rowss[ri] : 1 + rng_int(40);
                if (type == GL_F8_E4M3 && cols > 128) rows += 128;   /* two row blocks of scales */
                int n = ci < 5 ? ns[(ci + ri + (size_t)type) % 5] : 1 + rng_int(12), ldx = cols + 1, ldy = rows + 2;
                test_mat t = make_mat(type, rows, cols);
                test_act a = make_act(s, n, cols, ldx);
                float *y = xmalloc((size_t)n * ldy * sizeof(float)), *ys = xmalloc((size_t)n * ldy * sizeof(float));
                run_mm(k, &t.m, &a, 0, n, y, ldy, 0, rows);
                run_mm(s, &t.m, &a, 0, n, ys, ldy, 0, rows);
                int bad = 0, ref_bad = 0;
                double worst = 0;
                for (int r = 0; r < rows; r++) {
                    gl_row_to_f32(&t.m, r, wrow);
                    for (int i = 0; i < n; i++) {
                        float v = y[(size_t)i * ldy + r], vs = ys[(size_t)i * ldy + r];
                        if (type == GL_Q8) {      /* int32 sums: exact */
                            if (f2u(v) != f2u(vs)) bad++;
                            if (k == s) {         /* the scalar set against the row-major values */
                                int32_t acc = 0;
                                for (int c = 0; c < cols; c++)
                                    acc += (int32_t)t.q8rows[(size_t)r * cols + c] * a.xq[(size_t)i * ldx + c];
                                ref_bad += f2u(vs) != f2u((float)acc * t.scale[r] * a.xs[i]);
                                for (int c = 0; c < cols; c++)
                                    ref_bad += f2u(wrow[c]) != f2u((float)t.q8rows[(size_t)r * cols + c] * t.scale[r]);
                            }
                            continue;
                        }
                        double sum = 0, sum_abs = 0;
                        for (int c = 0; c < cols; c++) {
                            double p = (double)wrow[c] * a.x[(size_t)i * ldx + c];
                            sum += p; sum_abs += fabs(p);
                        }
                        double d = fabs((double)v - vs);
                        if (d > fp_tol(cols, sum_abs)) bad++;
                        if (fabs((double)vs - sum) > fp_tol(cols, sum_abs) / 2) ref_bad++;
                        if (sum_abs > 0 && d / sum_abs > worst) worst = d / sum_abs;
                    }
                }
                check(!bad, "%s: matmul %s rows=%d cols=%d n=%d: %d values off (worst %.3g of sum|terms|)",
                      k->name, type_name(type), rows, cols, n, bad, worst);
                if (k == s)
                    check(!ref_bad, "scalar: matmul %s rows=%d cols=%d n=%d: %d values off the exact sum",
                          type_name(type), rows, cols, n, ref_bad);
                free(y); free(ys); free_act(&a); free_mat(&t);
            }
    free(wrow);
}

/* The scalar matmul converts rows a slab at a time (no heap scratch at any
 * width) and must still give scalar_dot of the whole converted row, bit for
 * bit: widths past a slab (DeepSeek-V3's 7168), and more x rows than it
 * takes at once. */
static void test_scalar_wide(void) {
    const gl_kernels *s = gl_kernels_scalar();
    static const int colss[] = {7168, 5001};
    for (int type = 0; type < GL_TYPE_COUNT; type++) {
        if (type == GL_Q8) continue;                  /* W8A8 has its own integer path */
        for (int ci = 0; ci < 2; ci++) {
            int cols = colss[ci], rows = type == GL_F8_E4M3 ? 130 : 3, n = 21, ldx = cols + 3, ldy = rows + 1;
            test_mat t = make_mat(type, rows, cols);
            test_act a = make_act(s, n, cols, ldx);
            float *y = xmalloc((size_t)n * ldy * sizeof(float)), *wrow = xmalloc((size_t)cols * sizeof(float));
            run_mm(s, &t.m, &a, 0, n, y, ldy, 0, rows);
            int bad = 0;
            for (int r = 0; r < rows; r++) {
                gl_row_to_f32(&t.m, r, wrow);
                for (int i = 0; i < n; i++)
                    bad += f2u(y[(size_t)i * ldy + r]) != f2u(s->dot(wrow, a.x + (size_t)i * ldx, cols));
            }
            check(!bad, "scalar: matmul %s cols=%d n=%d: %d values differ from the whole row's dot", type_name(type), cols, n, bad);
            free(y); free(wrow); free_act(&a); free_mat(&t);
        }
    }
}

/* W8A8 at the edges of int16 pair sums (maddubs saturates, and a slip
 * there would only show with extreme values): every row and token is all
 * -128, -127 or 127 (activations never -128), in long rows. */
static void test_q8_extremes(const gl_kernels *k) {
    const gl_kernels *s = gl_kernels_scalar();
    enum { ROWS = 6, COLS = 4099, N = 5 };
    static const int8_t wv[ROWS] = {-128, -127, 127, -128, 127, 1}, xv[N] = {-127, 127, -127, 127, 0};
    int8_t *w = xmalloc((size_t)ROWS * COLS), *x = xmalloc((size_t)N * COLS);
    float wscale[ROWS], xscale[N], y[N * ROWS], ys[N * ROWS];
    for (int r = 0; r < ROWS; r++) {
        wscale[r] = 1.0f / 127;
        for (int c = 0; c < COLS; c++) w[(size_t)r * COLS + c] = r == 3 && c % 2 ? 127 : wv[r];
    }
    for (int i = 0; i < N; i++) {
        xscale[i] = 1.0f / 127;
        for (int c = 0; c < COLS; c++) x[(size_t)i * COLS + c] = i == 2 && c % 3 ? 127 : xv[i];
    }
    void *wp = q8_packed(w, ROWS, COLS);
    gl_mat m = {GL_Q8, ROWS, COLS, wp, wscale};
    k->matmul_q8(&m, x, xscale, N, COLS, y, ROWS, 0, ROWS);
    s->matmul_q8(&m, x, xscale, N, COLS, ys, ROWS, 0, ROWS);
    int bad = 0;
    for (int j = 0; j < N * ROWS; j++) bad += f2u(y[j]) != f2u(ys[j]);
    check(!bad, "%s: matmul_q8 with extreme values: %d of %d differ from scalar", k->name, bad, N * ROWS);
    free(w); free(x); free(wp);
}

/* The opt-in native-BF16 set: bf16 weights times activations rounded to
 * bf16 (relative error up to 2^-9 each), so against the exact sum it is
 * held to 2^-8 of sum|terms| (plus fp32 rounding); the worst error seen is
 * printed -- that is the mode's measured accuracy.  Other weight types
 * must give the avx512 set's bits. */
static void test_bf16_native(const gl_kernels *k) {
    const gl_kernels *base = gl_kernels_by_name("avx512");
    /* 20000: rows too long for the set's activation buffer (its fallback) */
    static const int colss[] = {1, 7, 31, 32, 33, 129, 2048, 4097, 20000}, ns[] = {1, 3, 4, 5, 9, 7, 13};
    float *wrow = xmalloc(20000 * sizeof(float));
    double worst = 0;
    for (size_t ci = 0; ci < sizeof colss / sizeof *colss; ci++) {
        int cols = colss[ci], rows = 9, n = ns[ci % 7], ldx = cols + 1, ldy = rows + 2;
        test_mat t = make_mat(GL_BF16, rows, cols);
        test_act a = make_act(k, n, cols, ldx);
        float *y = xmalloc((size_t)n * ldy * sizeof(float));
        k->matmul(&t.m, a.x, n, ldx, y, ldy, 0, rows);
        int bad = 0;
        for (int r = 0; r < rows; r++) {
            gl_row_to_f32(&t.m, r, wrow);
            for (int i = 0; i < n; i++) {
                double sum = 0, sum_abs = 0;
                for (int c = 0; c < cols; c++) {
                    double p = (double)wrow[c] * a.x[(size_t)i * ldx + c];
                    sum += p; sum_abs += fabs(p);
                }
                double d = fabs((double)y[(size_t)i * ldy + r] - sum);
                if (d > ldexp(1, -8) * sum_abs + fp_tol(cols, sum_abs)) bad++;
                if (sum_abs > 0 && d / sum_abs > worst) worst = d / sum_abs;
            }
        }
        check(!bad, "%s: bf16 matmul cols=%d n=%d: %d values beyond 2^-8 of sum|terms|", k->name, cols, n, bad);
        free(y); free_act(&a); free_mat(&t);
    }
    printf("  %s: bf16 weights x bf16-rounded activations: worst error %.2e of sum|terms| (fp32 FMA path: ~1e-7)\n",
           k->name, worst);
    if (base)
        for (int type = 0; type < GL_TYPE_COUNT; type++) {
            if (type == GL_BF16) continue;
            int rows = 13, cols = 300, n = 6;
            test_mat t = make_mat(type, rows, cols);
            test_act a = make_act(k, n, cols, cols);
            float *y = xmalloc((size_t)n * rows * sizeof(float)), *yb = xmalloc((size_t)n * rows * sizeof(float));
            run_mm(k, &t.m, &a, 0, n, y, rows, 0, rows);
            run_mm(base, &t.m, &a, 0, n, yb, rows, 0, rows);
            int bad = 0;
            for (int j = 0; j < n * rows; j++) bad += f2u(y[j]) != f2u(yb[j]);
            check(!bad, "%s: %s matmul differs from the avx512 set in %d values", k->name, type_name(type), bad);
            free(y); free(yb); free_act(&a); free_mat(&t);
        }
    free(wrow);
}

/* The opt-in set's native-BF16 attention core: queries and softmax weights
 * rounded to bf16, two elements a product.  round_pairs_bf16 against the
 * scalar rounding; the scores and the weighted sums within fp32 rounding of
 * the sum on the rounded operands, and within 2^-8 of sum|terms| of the
 * exact one (the worst error seen is printed: the mode's accuracy); every
 * value the same bits whatever the lanes, rows or heads of the call, and
 * for rows split into calls at an even offset.  Rows are allocated alone,
 * at their exact size, so a read past one is caught under ASan. */
static void test_bf16_core_native(const gl_kernels *k) {
    check(k->round_pairs_bf16 && k->dot_rows_tp_bf16 && k->axpy_rowp_n_bf16p, "%s: has no native-BF16 core", k->name);
    if (!k->round_pairs_bf16 || !k->dot_rows_tp_bf16 || !k->axpy_rowp_n_bf16p) return;
    enum { MMAX = 130 };
    double worst_s = 0, worst_l = 0;
    static const int ns[] = {1, 2, 19, 33, 64, 100, 576}, ms[] = {1, 3, 5, 16, 17, 23, 64, 70, 130};
    static const int nls[] = {1, 5, 16, 17, 64, 80, 128};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++) {
            int n = ns[ni], m = ms[mi], ldx = n + 3, np = (n + 1) / 2;
            uint16_t *xc = xmalloc((size_t)m * ldx * sizeof(uint16_t)), *xr[MMAX];
            for (int j = 0; j < m; j++) xr[j] = xmalloc((size_t)n * sizeof(uint16_t));
            for (int j = 0; j < m; j++)
                for (int c = 0; c < n; c++)
                    xr[j][c] = xc[(size_t)j * ldx + c] = gl_f32_to_bf16(rng_unif() * ((j + c) % 7 == 0 ? 1e-3f : 3.0f));
            for (size_t li = 0; li < sizeof nls / sizeof *nls; li++) {
                /* scores: nl queries (transposed, [n][ldq]) against the m rows */
                int nl = nls[li], ldq = nl + 3, ldy = m + 2;
                float *qt = xmalloc((size_t)n * ldq * sizeof(float));
                uint32_t *qp = xmalloc((size_t)np * ldq * sizeof(uint32_t));
                float *y = xmalloc((size_t)nl * ldy * sizeof(float)), y1;
                for (int i = 0; i < n * ldq; i++) qt[i] = rng_unif() * (i % 11 == 0 ? 1e-2f : 1.0f);
                k->round_pairs_bf16(qp, ldq, qt, ldq, n, nl);
                int bad_r = 0, bad = 0, bad_inv = 0;
                for (int p = 0; p < np; p++)
                    for (int l = 0; l < nl; l++) {
                        uint32_t want = gl_f32_to_bf16(qt[(size_t)2 * p * ldq + l]) |
                                        (2 * p + 1 < n ? (uint32_t)gl_f32_to_bf16(qt[(size_t)(2 * p + 1) * ldq + l]) << 16 : 0);
                        bad_r += qp[(size_t)p * ldq + l] != want;
                    }
                for (int i = 0; i < nl * ldy; i++) y[i] = -7.0f;
                k->dot_rows_tp_bf16(y, ldy, qp, ldq, nl, xc, ldx, m, n);
                for (int l = 0; l < nl; l++)
                    for (int j = 0; j < m; j++) {
                        double sr = 0, se = 0, sa = 0;
                        for (int c = 0; c < n; c++) {
                            double xv = gl_bf16_to_f32(xr[j][c]), qv = qt[(size_t)c * ldq + l];
                            sr += xv * gl_bf16_to_f32(gl_f32_to_bf16((float)qv));
                            se += xv * qv; sa += fabs(xv * qv);
                        }
                        double v = y[(size_t)l * ldy + j];
                        if (fabs(v - sr) > fp_tol(n, sa) || fabs(v - se) > ldexp(1, -8) * sa + fp_tol(n, sa)) bad++;
                        if (sa > 0 && fabs(v - se) / sa > worst_s) worst_s = fabs(v - se) / sa;
                        k->dot_rows_tp_bf16(&y1, 1, qp + l, ldq, 1, xr[j], n, 1, n);   /* one lane, one row */
                        bad_inv += f2u(y1) != f2u((float)v);
                    }
                for (int l = 0; l < nl; l++) bad += y[(size_t)l * ldy + m] != -7.0f;   /* the gaps untouched */
                check(!bad_r, "%s: round_pairs_bf16 n=%d cols=%d: %d pairs differ from the scalar rounding", k->name, n, nl, bad_r);
                check(!bad, "%s: dot_rows_tp_bf16 n=%d m=%d lanes=%d: %d values off", k->name, n, m, nl, bad);
                check(!bad_inv, "%s: dot_rows_tp_bf16 n=%d m=%d lanes=%d: %d values depend on the call", k->name, n, m, nl, bad_inv);
                free(qt); free(qp); free(y);

                /* weighted sums: nh = nl heads of m weights over the same rows (n columns) */
                int nh = nl, lda = m + 1, ldh = n + 5;
                float *a = xmalloc((size_t)nh * lda * sizeof(float));
                float *y0 = xmalloc((size_t)nh * ldh * sizeof(float)), *s1 = xmalloc((size_t)nh * ldh * sizeof(float));
                float *s2 = xmalloc((size_t)nh * ldh * sizeof(float));
                for (int i = 0; i < nh * lda; i++) a[i] = 0.5f * (rng_unif() + 1.0f);
                for (int i = 0; i < nh * ldh; i++) y0[i] = rng_unif();
                memcpy(s1, y0, (size_t)nh * ldh * sizeof(float));
                k->axpy_rowp_n_bf16p(s1, ldh, (const uint16_t *const *)xr, a, lda, nh, m, n);
                bad = bad_inv = 0;
                for (int h = 0; h < nh; h++)
                    for (int c = 0; c < ldh; c++) {
                        double v = s1[(size_t)h * ldh + c];
                        if (c >= n) { bad += f2u((float)v) != f2u(y0[(size_t)h * ldh + c]); continue; }
                        double sr = y0[(size_t)h * ldh + c], se = sr, sa = fabs(sr);
                        for (int j = 0; j < m; j++) {
                            double xv = gl_bf16_to_f32(xr[j][c]), av = a[(size_t)h * lda + j];
                            sr += xv * gl_bf16_to_f32(gl_f32_to_bf16((float)av));
                            se += xv * av; sa += fabs(xv * av);
                        }
                        if (fabs(v - sr) > fp_tol(m, sa) || fabs(v - se) > ldexp(1, -8) * sa + fp_tol(m, sa)) bad++;
                        if (sa > 0 && fabs(v - se) / sa > worst_l) worst_l = fabs(v - se) / sa;
                    }
                /* a head at a time, and the rows in two calls split at an even offset */
                int split = m / 4 * 2;
                memcpy(s2, y0, (size_t)nh * ldh * sizeof(float));
                for (int h = 0; h < nh; h++) {
                    float *yh = s2 + (size_t)h * ldh;
                    if (split) k->axpy_rowp_n_bf16p(yh, ldh, (const uint16_t *const *)xr, a + (size_t)h * lda, lda, 1, split, n);
                    k->axpy_rowp_n_bf16p(yh, ldh, (const uint16_t *const *)xr + split, a + (size_t)h * lda + split, lda, 1,
                                         m - split, n);
                }
                for (int i = 0; i < nh * ldh; i++) bad_inv += f2u(s1[i]) != f2u(s2[i]);
                check(!bad, "%s: axpy_rowp_n_bf16p n=%d m=%d heads=%d: %d values off", k->name, n, m, nh, bad);
                check(!bad_inv, "%s: axpy_rowp_n_bf16p n=%d m=%d heads=%d: %d values depend on the call", k->name, n, m, nh,
                      bad_inv);
                free(a); free(y0); free(s1); free(s2);
            }
            for (int j = 0; j < m; j++) free(xr[j]);
            free(xc);
        }
    printf("  %s: native-BF16 core (bf16 keys, queries and weights rounded): worst error %.2e (scores), %.2e (latents) "
           "of sum|terms|\n", k->name, worst_s, worst_l);
}

/* W8A8 on shapes the avx512 set packs into panels -- short rows with a few
 * tokens (the attention's per-head absorbed products), and long rows with
 * 12+ tokens (prefill's GEMMs: 512-column slices of 64 rows, int32 sums per
 * block of 96 tokens) -- every value against the scalar set, bit for bit:
 * rows that are no multiple of 64, columns no multiple of 512 (or of 64),
 * token counts across blocks, a row range starting off a panel, and rows of
 * all -128 with activations of +-127 (the extremes of the offset sums). */
static void test_q8_panels_rows(const gl_kernels *k, const char *what, const int colss[4], const int ns[3], const int rowss[3]) {
    const gl_kernels *s = gl_kernels_scalar();
    for (size_t ci = 0; ci < 4; ci++)
        for (size_t ri = 0; ri < 3; ri++) {
            int cols = colss[ci], rows = rowss[ri], n = ns[(ci + ri) % 3], ldx = cols + 8, ldy = rows + 5;
            test_mat t = make_mat(GL_Q8, rows, cols);
            test_act a = make_act(s, n, cols, ldx);
            if (ri == 2) {   /* extremes */
                for (int c = 0; c < cols; c++) t.q8rows[c] = -128;
                gl_q8_pack_rows(t.q8rows, cols, rows, cols, 0, 1, t.data);
                for (int c = 0; c < cols; c++) {
                    a.xq[c] = 127;
                    if (n > 1) a.xq[ldx + c] = -127;
                }
            }
            float *y = xmalloc((size_t)n * ldy * sizeof(float)), *ys = xmalloc((size_t)n * ldy * sizeof(float));
            int r0 = ri == 1 ? 3 : 0;    /* a row range that starts off a panel */
            for (size_t j = 0; j < (size_t)n * ldy; j++) y[j] = ys[j] = -1;
            k->matmul_q8(&t.m, a.xq, a.xs, n, ldx, y, ldy, r0, rows);
            s->matmul_q8(&t.m, a.xq, a.xs, n, ldx, ys, ldy, r0, rows);
            int bad = 0;
            for (size_t j = 0; j < (size_t)n * ldy; j++) bad += f2u(y[j]) != f2u(ys[j]);   /* gaps untouched too */
            check(!bad, "%s: matmul_q8 %s %dx%d n=%d: %d values differ from scalar", k->name, what, rows, cols, n, bad);
            free(y); free(ys); free_act(&a); free_mat(&t);
        }
}

static void test_q8_panels(const gl_kernels *k, const char *what, const int colss[4], const int ns[3]) {
    static const int rowss[] = {16, 61, 130};
    test_q8_panels_rows(k, what, colss, ns, rowss);
}

static void test_q8_short(const gl_kernels *k) {
    static const int colss[] = {4, 128, 132, 512}, ns[] = {5, 23, 60};   /* 60: panels at 512 columns too */
    test_q8_panels(k, "short rows", colss, ns);
}

/* Few tokens: uneven counts and columns, rows of 1 KB+ at n = 2 (avx512:
 * one panel at a time). */
static void test_q8_tiles(const gl_kernels *k) {
    static const int colss[] = {64, 129, 700, 1412}, ns[] = {2, 3, 11};
    test_q8_panels(k, "few tokens", colss, ns);
}

/* 1-16 tokens on matrices over 128 KB, at the edge of avx512's
 * interleaved tokens (32 KB on the stack, padded to 4 tokens): 16 x 2048
 * columns just fit, 16 x 2052 goes to the 4-panel slices instead; and 1-16
 * tokens on 33000 columns. */
static void test_q8_stream(const gl_kernels *k) {
    static const int colss[] = {4, 2047, 2052, 33000}, ns[] = {1, 7, 16}, rowss[] = {77, 130, 257};
    test_q8_panels_rows(k, "up to 16 tokens", colss, ns, rowss);
}

/* More tokens on short rows than one block of the VNNI copies' per-token
 * activation sums holds (X86_Q8_XSUM_MAX, 1024): the sums of the second
 * block must be its own. */
static void test_q8_many(const gl_kernels *k) {
    static const int colss[] = {4, 64, 100, 129}, ns[] = {1100, 1030, 2049};
    test_q8_panels(k, "many tokens", colss, ns);
}

static void test_q8_long(const gl_kernels *k) {
    static const int colss[] = {516, 1024, 1412, 2052}, ns[] = {13, 97, 200};
    test_q8_panels(k, "long rows", colss, ns);
}

/* ---- batch invariance ---- */

typedef struct {
    const gl_kernels *k; const gl_mat *w; const test_act *a;
    float *y; int ldy, n, chunk;
} pool_mm;

static void pool_mm_task(void *ctx, int task, int worker) {
    (void)worker;
    pool_mm *pm = ctx;
    int r0 = task * pm->chunk, r1 = r0 + pm->chunk < pm->w->rows ? r0 + pm->chunk : pm->w->rows;
    run_mm(pm->k, pm->w, pm->a, 0, pm->n, pm->y, pm->ldy, r0, r1);
}

static void test_invariance(const gl_kernels *k, gl_pool *pool2, gl_pool *pool4) {
    /* 2000: a slice past what stays in L2, so the rows go in panels of 6
       and 4 that several token tiles share; 8200: several token blocks */
    static const int colss[] = {7, 129, 300, 2000, 8200};
    for (int type = 0; type < GL_TYPE_COUNT; type++)
        for (size_t ci = 0; ci < sizeof colss / sizeof colss[0]; ci++) {
            int cols = colss[ci], rows = cols > 4000 ? 25 : 131, n = 37, ldx = cols + 5, ldy = rows + 3;
            if (cols > 1000 && k == gl_kernels_scalar()) continue;   /* one code path, no blocks: spare the time */
            test_mat t = make_mat(type, rows, cols);
            test_act a = make_act(k, n, cols, ldx);
            size_t ysz = (size_t)n * ldy;
            float *ref = xmalloc(ysz * sizeof(float)), *y = xmalloc(ysz * sizeof(float));
            run_mm(k, &t.m, &a, 0, n, ref, ldy, 0, rows);

            int bad = 0;
            if (pool_only) goto through_pool;

            /* (1) one token at a time, each from a copy at another alignment */
            test_act one = make_act(k, 1, cols, cols + 8);
            for (int i = 0; i < n; i++) {
                int off = i % 8;
                memcpy(one.x + off, a.x + (size_t)i * ldx, (size_t)cols * sizeof(float));
                memcpy(one.xq + off, a.xq + (size_t)i * ldx, (size_t)cols);
                one.xs[0] = a.xs[i];
                test_act view = one;
                view.x += off; view.xq += off;
                float yrow[131];
                run_mm(k, &t.m, &view, 0, 1, yrow, rows, 0, rows);
                for (int r = 0; r < rows; r++) bad += f2u(yrow[r]) != f2u(ref[(size_t)i * ldy + r]);
            }
            check(!bad, "%s: %s cols=%d: %d values differ between n=1 and n=37", k->name, type_name(type), cols, bad);
            free_act(&one);

            /* (2) random row ranges times random token ranges */
            bad = 0;
            for (int trial = 0; trial < 16; trial++) {
                int r0 = rng_int(rows), r1 = r0 + 1 + rng_int(rows - r0);
                int i0 = rng_int(n), ni = 1 + rng_int(n - i0 < 9 ? n - i0 : 9);
                for (size_t j = 0; j < ysz; j++) y[j] = NAN;
                run_mm(k, &t.m, &a, i0, ni, y + (size_t)i0 * ldy, ldy, r0, r1);
                for (int i = i0; i < i0 + ni; i++)
                    for (int r = r0; r < r1; r++) bad += f2u(y[(size_t)i * ldy + r]) != f2u(ref[(size_t)i * ldy + r]);
                /* nothing outside [r0,r1) x [i0,i0+ni) is written */
                for (int i = 0; i < n; i++)
                    for (int r = 0; r < ldy; r++)
                        if ((i < i0 || i >= i0 + ni || r < r0 || r >= r1) && y[(size_t)i * ldy + r] == y[(size_t)i * ldy + r]) bad++;
            }
            check(!bad, "%s: %s cols=%d: %d values differ (or stray writes) under row/token splits", k->name, type_name(type), cols, bad);

            /* (3) through the pool, 16-row chunks, 2 and 4 threads */
        through_pool:
            for (int pi = 0; pi < 2; pi++) {
                gl_pool *p = pi ? pool4 : pool2;
                pool_mm pm = {k, &t.m, &a, y, ldy, n, 16};
                memset(y, 0, ysz * sizeof(float));
                gl_pool_run(p, (rows + 15) / 16, pool_mm_task, &pm);
                bad = 0;
                for (int i = 0; i < n; i++)
                    for (int r = 0; r < rows; r++) bad += f2u(y[(size_t)i * ldy + r]) != f2u(ref[(size_t)i * ldy + r]);
                check(!bad, "%s: %s cols=%d: %d values differ through a pool of %d", k->name, type_name(type), cols, bad, gl_pool_size(p));
            }
            free(ref); free(y); free_act(&a); free_mat(&t);
        }
}

/* ---- pool ---- */

typedef struct { atomic_int *count; int n_workers; atomic_int bad_worker; int sleep_task; } pool_test;

static void pool_count_task(void *ctx, int task, int worker) {
    pool_test *pt = ctx;
    atomic_fetch_add_explicit(&pt->count[task], 1, memory_order_relaxed);
    if (worker < 0 || worker >= pt->n_workers) atomic_store(&pt->bad_worker, 1);
    if (task == pt->sleep_task) { struct timespec ts = {0, 2000000}; nanosleep(&ts, NULL); }
}

/* gl_pool_run_pinned: every worker runs exactly its own task, every time. */
typedef struct { atomic_int runs[8]; atomic_int wrong; } pinned_test;

static void pinned_task(void *ctx, int task, int worker) {
    pinned_test *pt = ctx;
    if (task != worker || worker < 0 || worker >= 8) atomic_fetch_add(&pt->wrong, 1);
    else atomic_fetch_add(&pt->runs[worker], 1);
}

static void test_pool_pinned(int threads) {
    gl_pool *p = gl_pool_create(threads);
    if (!p) { check(0, "pool: create(%d)", threads); return; }
    pinned_test pt;
    memset(&pt, 0, sizeof pt);
    int rounds = 2000;
    for (int r = 0; r < rounds; r++) gl_pool_run_pinned(p, pinned_task, &pt);
    int ok = atomic_load(&pt.wrong) == 0;
    for (int w = 0; w < threads; w++) ok &= atomic_load(&pt.runs[w]) == rounds;
    check(ok, "pool: pinned runs with %d threads: each worker must run its own task once per region", threads);
    gl_pool_free(p);
}

static void test_pool(int threads) {
    gl_pool *p = gl_pool_create(threads);
    check(p && gl_pool_size(p) == threads, "pool: create(%d) failed", threads);
    if (!p) return;
    enum { MAX_TASKS = 5000 };
    atomic_int *count = xmalloc(MAX_TASKS * sizeof(atomic_int));
    pool_test pt = {count, threads, 0, -1};
    int bad = 0;
    for (int run = 0; run < 600; run++) {
        int n_tasks = run < 20 ? run : 1 + rng_int(run % 7 == 0 ? MAX_TASKS : 64);
        pt.sleep_task = -1;
        if (run % 100 == 50) {           /* let the workers fall asleep first */
            struct timespec ts = {0, 20000000};
            nanosleep(&ts, NULL);
        }
        if (run % 100 == 75) pt.sleep_task = n_tasks - 1;   /* the caller waits long */
        for (int t = 0; t < n_tasks; t++) atomic_init(&count[t], 0);
        gl_pool_run(p, n_tasks, pool_count_task, &pt);
        for (int t = 0; t < n_tasks; t++) bad += atomic_load(&count[t]) != 1;
    }
    /* back to back, few tasks: a worker still finishing one region while
       the next is published must not take or run anything of it */
    for (int run = 0; run < 5000; run++) {
        int n_tasks = 2 + run % 4;
        for (int t = 0; t < n_tasks; t++) atomic_init(&count[t], 0);
        gl_pool_run(p, n_tasks, pool_count_task, &pt);
        for (int t = 0; t < n_tasks; t++) bad += atomic_load(&count[t]) != 1;
    }
    check(!bad, "pool(%d): %d tasks not run exactly once", threads, bad);
    check(!atomic_load(&pt.bad_worker), "pool(%d): worker index out of range", threads);
    gl_pool_free(p);
    free(count);
}

/* ---- GGUF block formats (quants.c) ---- */

/* A random block-quantized matrix: random bytes, with every f16 scale a
 * finite value of moderate size (real files have nothing else). */
static test_mat make_qmat(int type, int rows, int cols) {
    test_mat t;
    size_t rb = gl_row_bytes(type, cols), bb = rb / (size_t)(cols / gl_type_block(type));
    uint8_t *p = xmalloc(rb * rows);
    for (size_t i = 0; i < rb * rows; i++) p[i] = (uint8_t)rng_u64();
    for (size_t b = 0; b < rb * rows / bb; b++) {
        uint8_t *blk = p + b * bb;
        uint16_t d = gl_f32_to_f16(ldexpf(rng_unif(), -6 - rng_int(4))), dm = gl_f32_to_f16(ldexpf(rng_unif(), -7));
        if (type == GL_Q6_K) memcpy(blk + 208, &d, 2);
        else memcpy(blk, &d, 2);
        if (type == GL_Q4_K || type == GL_Q5_K || type == GL_Q4_1 || type == GL_Q5_1) memcpy(blk + 2, &dm, 2);
    }
    t.data = p; t.scale = NULL; t.q8rows = NULL;
    t.m.type = type; t.m.rows = rows; t.m.cols = cols; t.m.data = p; t.m.scale = NULL;
    return t;
}

/* Value i of a block, straight from the layout description (an independent
 * reading of the formats, in double). */
static double ref_block_value(int type, const uint8_t *b, int i) {
    uint16_t h;
    switch (type) {
    case GL_Q8_0: memcpy(&h, b, 2); return ref_f16(h) * (int8_t)b[2 + i];
    case GL_Q4_0: memcpy(&h, b, 2); return ref_f16(h) * (((i < 16 ? b[2 + i] : b[2 + i - 16] >> 4) & 15) - 8);
    case GL_Q4_K: case GL_Q5_K: {
        uint16_t hm;
        memcpy(&h, b, 2); memcpy(&hm, b + 2, 2);
        int sub = i / 32, l = i % 32, g = sub / 2;
        const uint8_t *s = b + 4;
        int sc = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 15) | (s[sub - 4] >> 6) << 4;
        int m = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | (s[sub] >> 6) << 4;
        const uint8_t *qs = b + (type == GL_Q4_K ? 16 : 48);
        int q = sub % 2 ? qs[32 * g + l] >> 4 : qs[32 * g + l] & 15;
        if (type == GL_Q5_K) q += (b[16 + l] >> sub & 1) * 16;
        return ref_f16(h) * sc * q - ref_f16(hm) * m;
    }
    case GL_Q4_1: case GL_Q5_1: {
        uint16_t hm;
        memcpy(&h, b, 2); memcpy(&hm, b + 2, 2);
        const uint8_t *qs = b + (type == GL_Q4_1 ? 4 : 8);
        int q = (i < 16 ? qs[i] : qs[i - 16] >> 4) & 15;
        if (type == GL_Q5_1) q |= (b[4 + i / 8] >> (i % 8) & 1) << 4;
        return ref_f16(h) * q + ref_f16(hm);
    }
    case GL_Q5_0: {
        memcpy(&h, b, 2);
        int q = ((i < 16 ? b[6 + i] : b[6 + i - 16] >> 4) & 15) | (b[2 + i / 8] >> (i % 8) & 1) << 4;
        return ref_f16(h) * (q - 16);
    }
    case GL_Q6_K: {
        memcpy(&h, b + 208, 2);
        int half = i / 128, j = i % 128, quarter = j / 32, l = j % 32;
        const uint8_t *ql = b + 64 * half + (quarter % 2) * 32, *qh = b + 128 + 32 * half;
        int lo = quarter < 2 ? ql[l] & 15 : ql[l] >> 4;
        int q = (lo | ((qh[l] >> (2 * quarter)) & 3) << 4) - 32;
        return ref_f16(h) * (int8_t)b[192 + 8 * half + l / 16 + 2 * quarter] * q;
    }
    }
    return NAN;
}

static const int gguf_block_types[] = {GL_Q8_0, GL_Q4_0, GL_Q4_K, GL_Q5_K, GL_Q6_K, GL_Q4_1, GL_Q5_0, GL_Q5_1};
#define N_GGUF_BLOCK_TYPES (sizeof gguf_block_types / sizeof gguf_block_types[0])

static void test_block_formats(void) {
    const int *types = gguf_block_types;
    float out[512];
    for (size_t ti = 0; ti < N_GGUF_BLOCK_TYPES; ti++) {
        int type = types[ti], bs = gl_type_block(type), bad = 0;
        test_mat t = make_qmat(type, 4, 2 * bs);
        size_t bb = gl_row_bytes(type, 2 * bs) / 2;
        for (int r = 0; r < 4; r++) {
            gl_row_to_f32(&t.m, r, out);
            for (int i = 0; i < 2 * bs; i++) {
                const uint8_t *blk = (const uint8_t *)t.data + (size_t)r * 2 * bb + (size_t)(i / bs) * bb;
                double ref = ref_block_value(type, blk, i % bs);
                if (fabs(ref - out[i]) > 1e-7 * fabs(ref) + 1e-30) bad++;   /* one rounding at most */
            }
        }
        check(!bad, "%s: %d dequantized values differ from the layout", gl_type_name(type), bad);
        free_mat(&t);
    }
    /* the quantizers: each value within half a step of the original (Q4_0:
       a step; its codes run -8..7, so the side opposite the largest
       magnitude clips) */
    float x[64], back[64];
    for (int i = 0; i < 64; i++) x[i] = rng_unif() * (i == 5 ? 4 : 1);
    uint8_t q[68];
    for (int pass = 0; pass < 2; pass++) {
        int type = pass ? GL_Q4_0 : GL_Q8_0;
        (pass ? gl_quantize_row_q4_0 : gl_quantize_row_q8_0)(x, 64, q);
        gl_mat m = {type, 1, 64, q, NULL};
        gl_row_to_f32(&m, 0, back);
        int bad = 0;
        for (int b = 0; b < 2; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
            float tol = pass ? amax / 8.0f : 0.5f * amax / 127.0f;
            for (int i = 0; i < 32; i++) bad += fabsf(back[32 * b + i] - x[32 * b + i]) > tol * 1.002f;
        }
        check(!bad, "%s: quantize then dequantize: %d values off by more than the step allows", gl_type_name(type), bad);
    }
}

/* Block-format products of a set: equal to the scalar set within rounding;
 * where the set keeps the 8-lane order of its fp32 product, the same bits as
 * that product over the dequantized matrix; batch invariant. */
static void test_qmatmul(const gl_kernels *k) {
    const int *types = gguf_block_types;
    const gl_kernels *s = gl_kernels_scalar();
    /* the 8-lane sets: the block product and the fp32 product share their
       order; the AVX-512 sets' block product runs 16 lanes (quants.c) */
    const int same_order = strncmp(k->name, "avx512", 6) != 0;
    for (size_t ti = 0; ti < N_GGUF_BLOCK_TYPES; ti++)
        for (int shape = 0; shape < 4; shape++) {
            int type = types[ti], bs = gl_type_block(type);
            int cols = bs * (shape == 0 ? 1 : shape == 1 ? 5 : shape == 2 ? 9 : 1 + rng_int(bs == 32 ? 80 : 10));
            int rows = 1 + rng_int(8), n = shape == 3 ? 33 + rng_int(8) : 1 + rng_int(6), ldx = cols + 3, ldy = rows + 1;
            test_mat t = make_qmat(type, rows, cols);
            test_mat f = {{GL_F32, rows, cols, NULL, NULL}, xmalloc((size_t)rows * cols * 4), NULL, NULL};
            for (int r = 0; r < rows; r++) gl_row_to_f32(&t.m, r, (float *)f.data + (size_t)r * cols);
            f.m.data = f.data;
            test_act a = make_act(s, n, cols, ldx);
            size_t ysz = (size_t)n * ldy;
            float *y = xmalloc(ysz * 4), *ys = xmalloc(ysz * 4), *yf = xmalloc(ysz * 4), *y1 = xmalloc(ysz * 4);
            run_mm(k, &t.m, &a, 0, n, y, ldy, 0, rows);
            run_mm(s, &t.m, &a, 0, n, ys, ldy, 0, rows);
            run_mm(k, &f.m, &a, 0, n, yf, ldy, 0, rows);
            for (int i = 0; i < n; i++) run_mm(k, &t.m, &a, i, 1, y1 + (size_t)i * ldy, ldy, rows / 2, rows);
            for (int i = 0; i < n; i++) run_mm(k, &t.m, &a, i, 1, y1 + (size_t)i * ldy, ldy, 0, rows / 2);
            int bad = 0, bits = 0, inv = 0;
            for (int i = 0; i < n; i++)
                for (int r = 0; r < rows; r++) {
                    size_t j = (size_t)i * ldy + r;
                    double sum_abs = 0;
                    for (int c = 0; c < cols; c++) sum_abs += fabs((double)((float *)f.data)[(size_t)r * cols + c] * a.x[(size_t)i * ldx + c]);
                    bad += fabs((double)y[j] - ys[j]) > fp_tol(cols, sum_abs);
                    bits += same_order && f2u(y[j]) != f2u(yf[j]);
                    inv += f2u(y[j]) != f2u(y1[j]);
                }
            check(!bad, "%s: matmul %s rows=%d cols=%d n=%d: %d values off the scalar set", k->name, gl_type_name(type), rows, cols, n, bad);
            check(!bits, "%s: matmul %s cols=%d: %d values differ from the fp32 product of the dequantized rows", k->name, gl_type_name(type), cols, bits);
            check(!inv, "%s: matmul %s cols=%d n=%d: %d values change with the batch or row range", k->name, gl_type_name(type), cols, n, inv);
            free(y); free(ys); free(yf); free(y1); free_act(&a); free_mat(&t); free_mat(&f);
        }
}

#ifdef CM384_TEST_ALL
int test_main_kernels(int argc, char **argv) {
#else
int main(int argc, char **argv) {
#endif
    if (argc > 1) rng_state = strtoull(argv[1], NULL, 0) | 1;   /* another seed: other random shapes and data */
    pool_only = getenv("CM384_TEST_POOL_ONLY") != NULL;
    const gl_kernels *sets[8];
    int n_sets = gl_kernels_all(sets, 8);
    if (n_sets > 8) n_sets = 8;
    printf("kernel sets:");
    for (int i = 0; i < n_sets; i++) printf(" %s", sets[i]->name);
    printf(" (gl_kernels_get: %s)\n", gl_kernels_get()->name);
#if defined(GL_HAVE_AVX2)
    {   /* built in, but only a CPU that has them can check them */
        int f = gl_cpu_features();
        if (!(f & GL_X86_AVX_VNNI)) printf("  avx_vnni: this CPU has no AVX-VNNI, not checked here\n");
        if (!(f & GL_X86_AVX512)) printf("  avx512_vnni, avx512: this CPU has no AVX-512 (F/BW/VL/VNNI), not checked here\n");
    }
#endif
    check(gl_kernels_get() == sets[n_sets - 1], "gl_kernels_get is not the last of gl_kernels_all");
    check(gl_kernels_by_name("scalar") == gl_kernels_scalar() && !gl_kernels_by_name("nope"), "gl_kernels_by_name");

    test_pool(2);
    test_pool_pinned(2);
    test_pool_pinned(4);
    test_pool(4);
    if (!pool_only) {
        test_conversions();
        test_scalar_wide();
        test_block_formats();
    }
    gl_pool *pool2 = gl_pool_create(2), *pool4 = gl_pool_create(4);
    for (int s = 0; s < n_sets && pool_only; s++) test_invariance(sets[s], pool2, pool4);
    for (int s = 0; s < n_sets && !pool_only; s++) {
        test_set_conversions(sets[s]);
        test_quantize(sets[s]);
        test_dot_axpy(sets[s]);
        test_axpy_rows(sets[s]);
        test_dot_rows_t(sets[s]);
        test_transpose(sets[s]);
        test_bf16_rows(sets[s]);
        test_rowp(sets[s]);
        test_exp_silu(sets[s]);
        test_matmul_vs_scalar(sets[s]);
        test_q8_extremes(sets[s]);
        test_q8_short(sets[s]);
        test_q8_tiles(sets[s]);
        test_q8_stream(sets[s]);
        test_q8_long(sets[s]);
        test_q8_many(sets[s]);
        test_invariance(sets[s], pool2, pool4);
        test_qmatmul(sets[s]);
    }
    {   /* opt-in sets: never chosen by default; checked wherever the CPU has them */
        const gl_kernels *bf = gl_kernels_by_name("avx512_bf16");
        if (bf && pool_only) test_invariance(bf, pool2, pool4);
        else if (bf) {
            test_bf16_native(bf);
            test_q8_extremes(bf);
            test_dot_rows_t(bf);
            test_bf16_rows(bf);
            test_rowp(bf);
            test_bf16_core_native(bf);
            test_invariance(bf, pool2, pool4);
        }
#if defined(GL_HAVE_AVX2)
        else printf("  avx512_bf16 (opt-in): this CPU has no AVX512_BF16, not checked here\n");
#endif
    }
    gl_pool_free(pool2);
    gl_pool_free(pool4);
    printf("kernels: %d passed, %d failed\n", kern_passed, kern_failed);
    return kern_failed ? 1 : 0;
}

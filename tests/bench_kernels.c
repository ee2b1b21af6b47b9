/* bench_kernels.c -- this machine's limits, and the kernels measured
 * against them in the same run.
 *
 *   cc -O2 -std=c11 -pthread tests/bench_kernels.c -lm && ./a.out [--json] [--quick]
 *
 * Limits: read bandwidth (a sum over a buffer far larger than the caches,
 * 1 thread and all, each reading one sequential run at a time or two side
 * by side, whichever is faster), fp32 FMA peak and the int8 peak of the instructions the
 * chosen kernel set uses (register-only loops: AVX2 sign/maddubs/madd/add,
 * NEON smull/smlal/sadalp, SDOT, or VNNI's vpdpbusd).  Kernels: matrix-vector (n=1, decode) in GB/s of weights read, as
 * a share of the measured bandwidth, over enough matrices (> 64 MB) that
 * none stays in cache; n=16 in time per weight byte against n=1; GEMM
 * (n=512, prefill) in GOP/s as a share of the measured peak; and the cost of
 * one empty gl_pool_run.  Every figure is the median of several runs: the
 * machine may be shared.  --now prints the limits alone (read bandwidth,
 * FP32 and INT8 peaks, all threads), for make bench to measure just
 * before each model run. */
#include "../ggml_like/ggml_like.c"

#include <stdio.h>
#include <time.h>

static int json, quick, sweep, now_only;
static const char *set_name;   /* --set NAME: measure that kernel set instead of the default */
static FILE *json_out;   /* --json-out FILE: the JSON lines also go there */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double best(const double *v, int n) {
    double b = v[0];
    for (int i = 1; i < n; i++) if (v[i] > b) b = v[i];
    return b;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) { fprintf(stderr, "out of memory (%zu bytes)\n", n); exit(2); }
    return p;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t rng_u64(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static void report_json(FILE *f, const char *what, double value, const char *unit, const char *vs, double ratio) {
    fprintf(f, "{\"bench\":\"%s\",\"value\":%.4g,\"unit\":\"%s\"", what, value, unit);
    if (vs) fprintf(f, ",\"vs\":\"%s\",\"ratio\":%.4f", vs, ratio);
    fprintf(f, "}\n");
    fflush(f);
}

/* One row of the result table (or a JSON line with --json). */
static void report(const char *what, double value, const char *unit, const char *vs, double ratio) {
    if (json_out) report_json(json_out, what, value, unit, vs, ratio);
    if (json) {
        report_json(stdout, what, value, unit, vs, ratio);
    } else if (vs) {
        printf("%-40s %10.2f %-8s %6.1f%% of %s\n", what, value, unit, 100 * ratio, vs);
    } else {
        printf("%-40s %10.2f %-8s\n", what, value, unit);
    }
    fflush(stdout);
}

/* The 1-minute load average: a bench on a shared machine says how shared. */
static double load_average(void) {
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) { if (fscanf(f, "%lf", &l) != 1) l = -1; fclose(f); }
    return l;
}

/* ---- limits: register-only and streaming loops ---- */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BENCH_AVX2 __attribute__((target("avx2,fma")))

static BENCH_AVX2 float sum_avx2(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/* The same over the two halves of [p, p + n) side by side: two sequential
 * runs, which one thread may stream faster than one (Zen 5, 2 threads,
 * 256 MB: 61-64 GB/s as one run a thread, 72-76 as two; the avx512 set's
 * bf16 decode product reads two: a512_rows2). */
static BENCH_AVX2 float sum2_avx2(const float *p, size_t n) {
    const float *q = p + n / 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 16 <= n / 2; i += 16) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(q + i));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(q + i + 8));
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/* 12 independent FMA chains: enough to cover latency x throughput. */
static BENCH_AVX2 float fma_avx2(long iters) {
    __m256 a[12], m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
#pragma GCC unroll 16
    for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps((float)j);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], m, c);
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]), "+x"(a[4]), "+x"(a[5]));
    }
    __m256 s = a[0];
#pragma GCC unroll 16
    for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, a[j]);
    return _mm256_cvtss_f32(s);
}

/* The int8 multiply-add the kernels use: sign, maddubs, madd, add; 6
 * chains, each on its own activation vector so none can be shared. */
static BENCH_AVX2 int int8_avx2(long iters) {
    __m256i acc[6], x[6], w = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i wa = _mm256_abs_epi8(w);
#pragma GCC unroll 16
    for (int j = 0; j < 6; j++) acc[j] = _mm256_set1_epi32(j), x[j] = _mm256_set1_epi8((char)(j - 3));
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 6; j++) {
            __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x[j], w));
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, ones));
        }
        /* the products must be recomputed every time */
        __asm__ volatile("" : "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]), "+x"(x[4]), "+x"(x[5]), "+x"(w), "+x"(wa));
    }
    __m256i s = acc[0];
#pragma GCC unroll 16
    for (int j = 1; j < 6; j++) s = _mm256_add_epi32(s, acc[j]);
    return _mm256_extract_epi32(s, 0);
}

/* The same with VNNI's vpdpbusd (the avx_vnni / avx512_vnni sets): one
 * instruction for 32 products and their sums, as the kernels use it (the
 * weights offset to unsigned once per vector, x86_q8.h), 12 chains, each
 * on its own activation vector reloaded from L1 every time as the kernels'
 * are.  The sums must stay in registers, tied in place: VEX code has 16 ymm
 * registers, and 12 chains each holding its activations in one spilled
 * them (so did gcc 12's intrinsic, which copies every accumulator each
 * iteration, and a loop over them left rolled); the EVEX form under "v"
 * went through a register copy per instruction.  Each measured under the
 * W8A8 GEMM's own rate (303-463 GOP/s on Zen 5 against 500-800). */
static inline __attribute__((always_inline, target(GL_VNNI_TARGET))) __m256i bench_dp_vex(__m256i acc, __m256i u, __m256i x) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
    return acc;
}
static inline __attribute__((always_inline, target(GL_EVEX_TARGET))) __m256i bench_dp_evex(__m256i acc, __m256i u, __m256i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
    return acc;
}
#define BENCH_VNNI_CHAINS 12
#define BENCH_VNNI_LOOP(name, tgt, dp)                                                          \
    static __attribute__((target(tgt))) int name(long iters) {                                 \
        __m256i acc[BENCH_VNNI_CHAINS], w = _mm256_set1_epi8(3);                                \
        _Alignas(32) int8_t xs[BENCH_VNNI_CHAINS][32];                                          \
        for (int j = 0; j < BENCH_VNNI_CHAINS; j++) memset(xs[j], j - 5, 32);                   \
        /* every loop over the sums unrolled, or they live on the stack */                     \
        _Pragma("GCC unroll 16")                                                                \
        for (int j = 0; j < BENCH_VNNI_CHAINS; j++) acc[j] = _mm256_set1_epi32(j);              \
        for (long i = 0; i < iters; i++) {                                                      \
            _Pragma("GCC unroll 16")                                                            \
            for (int j = 0; j < BENCH_VNNI_CHAINS; j++)                                         \
                acc[j] = dp(acc[j], w, _mm256_load_si256((const __m256i *)xs[j]));               \
            /* the activations may have changed: reload them */                                 \
            __asm__ volatile("" : "+x"(w) : "r"(xs) : "memory");                                \
        }                                                                                       \
        __m256i s = acc[0];                                                                     \
        _Pragma("GCC unroll 16")                                                                \
        for (int j = 1; j < BENCH_VNNI_CHAINS; j++) s = _mm256_add_epi32(s, acc[j]);           \
        return _mm256_extract_epi32(s, 0);                                                      \
    }
BENCH_VNNI_LOOP(int8_avx_vnni, GL_VNNI_TARGET, bench_dp_vex)
BENCH_VNNI_LOOP(int8_avx512_vnni, GL_EVEX_TARGET, bench_dp_evex)
/* 512-bit (the avx512 set): FMA and vpdpbusd on zmm, 12 chains each
   (latency 4-5 cycles at 2 per cycle needs about 10 in flight) */
static __attribute__((target(GL_A512_TARGET))) float fma_avx512(long iters) {
    __m512 a[12], m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
#pragma GCC unroll 16
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], m, c);
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]));
    }
    __m512 s = a[0];
#pragma GCC unroll 16
    for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, a[j]);
    return _mm512_reduce_add_ps(s);
}
/* The avx512 set's W8A8 step: one vpdpbusd per 64 products (the weights'
   offset is a xor, amortized over the tile's tokens) */
static __attribute__((target(GL_A512_TARGET))) int int8_avx512(long iters) {
    __m512i acc[12], x[12], w = _mm512_set1_epi8(3);
#pragma GCC unroll 16
    for (int j = 0; j < 12; j++) acc[j] = _mm512_set1_epi32(j), x[j] = _mm512_set1_epi8((char)(j - 6));
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], w, x[j]);
        __asm__ volatile("" : "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]), "+v"(x[4]), "+v"(x[5]), "+v"(w));
    }
    __m512i s = acc[0];
#pragma GCC unroll 16
    for (int j = 1; j < 12; j++) s = _mm512_add_epi32(s, acc[j]);
    return _mm512_reduce_add_epi32(s);
}
/* The BF16 dot-product peak (AVX512_BF16): one vdpbf16ps is 32 products
   and 32 adds; the opt-in avx512_bf16 set's native core runs on it */
static __attribute__((target(GL_A512_TARGET ",avx512bf16"))) float bf16dp_avx512(long iters) {
    __m512 a[12];
    const __m512bh m = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f), c = (__m512bh)_mm512_set1_epi32(0x33d633d6);
#pragma GCC unroll 16
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbf16_ps(a[j], m, c);
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]));
    }
    __m512 s = a[0];
#pragma GCC unroll 16
    for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, a[j]);
    return _mm512_reduce_add_ps(s);
}
#define BF16DP512_FLOPS_PER_ITER (12 * 32 * 2)
#define FMA512_FLOPS_PER_ITER (12 * 16 * 2)
#define VNNI512_OPS_PER_ITER  (12 * 64 * 2)
#define FMA_FLOPS_PER_ITER (12 * 8 * 2)
#define INT8_OPS_PER_ITER  (6 * 32 * 2)
#define VNNI_OPS_PER_ITER  (BENCH_VNNI_CHAINS * 32 * 2)
#endif

#if defined(__aarch64__)
#include <arm_neon.h>
static float sum_neon(const float *p, size_t n) {
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 16 <= n; i += 16) {
        a0 = vaddq_f32(a0, vld1q_f32(p + i));
        a1 = vaddq_f32(a1, vld1q_f32(p + i + 4));
        a2 = vaddq_f32(a2, vld1q_f32(p + i + 8));
        a3 = vaddq_f32(a3, vld1q_f32(p + i + 12));
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
}
static float sum2_neon(const float *p, size_t n) {
    const float *q = p + n / 2;
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 8 <= n / 2; i += 8) {
        a0 = vaddq_f32(a0, vld1q_f32(p + i));
        a1 = vaddq_f32(a1, vld1q_f32(p + i + 4));
        a2 = vaddq_f32(a2, vld1q_f32(q + i));
        a3 = vaddq_f32(a3, vld1q_f32(q + i + 4));
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
}
static float fma_neon(long iters) {
    float32x4_t a[16], m = vdupq_n_f32(0.999999f), c = vdupq_n_f32(1e-7f);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) a[j] = vdupq_n_f32((float)j);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) a[j] = vfmaq_f32(c, a[j], m);
        __asm__ volatile("" : "+w"(a[0]), "+w"(a[1]), "+w"(a[2]), "+w"(a[3]));
    }
    float32x4_t s = a[0];
#pragma GCC unroll 16
    for (int j = 1; j < 16; j++) s = vaddq_f32(s, a[j]);
    return vgetq_lane_f32(s, 0);
}
/* Without the dot-product extension: widening multiply, then pairwise add;
 * 8 chains on 8 activation vectors. */
static int int8_neon(long iters) {
    int32x4_t acc[8];
    int8x16_t x[8], w = vdupq_n_s8(3);
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++) acc[j] = vdupq_n_s32(j), x[j] = vdupq_n_s8((int8_t)(j - 4));
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 8; j++) {
            int16x8_t p = vmull_s8(vget_low_s8(w), vget_low_s8(x[j]));
            p = vmlal_high_s8(p, w, x[j]);
            acc[j] = vpadalq_s16(acc[j], p);
        }
        __asm__ volatile("" : "+w"(x[0]), "+w"(x[1]), "+w"(x[2]), "+w"(x[3]), "+w"(x[4]), "+w"(x[5]), "+w"(x[6]), "+w"(x[7]), "+w"(w));
    }
    int32x4_t s = acc[0];
#pragma GCC unroll 16
    for (int j = 1; j < 8; j++) s = vaddq_s32(s, acc[j]);
    return vgetq_lane_s32(s, 0);
}
/* With the dot-product extension (the neon_dotprod set's W8A8): SDOT. */
#if defined(__clang__)
#define BENCH_DOTPROD __attribute__((target("dotprod")))
#else
#define BENCH_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
static BENCH_DOTPROD int sdot_neon(long iters) {
    int32x4_t acc[8];
    int8x16_t x[8], w = vdupq_n_s8(3);
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++) acc[j] = vdupq_n_s32(j), x[j] = vdupq_n_s8((int8_t)(j - 4));
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int j = 0; j < 8; j++) acc[j] = neon_sdot(acc[j], w, x[j]);
        __asm__ volatile("" : "+w"(x[0]), "+w"(x[1]), "+w"(x[2]), "+w"(x[3]), "+w"(x[4]), "+w"(x[5]), "+w"(x[6]), "+w"(x[7]), "+w"(w));
    }
    int32x4_t s = acc[0];
#pragma GCC unroll 16
    for (int j = 1; j < 8; j++) s = vaddq_s32(s, acc[j]);
    return vgetq_lane_s32(s, 0);
}
#define FMA_FLOPS_PER_ITER (16 * 4 * 2)
#define INT8_OPS_PER_ITER  (8 * 16 * 2)
#define SDOT_OPS_PER_ITER  (8 * 16 * 2)
#endif

static float sum_floats(const float *p, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_supports("avx2")) return sum_avx2(p, n);
#elif defined(__aarch64__)
    return sum_neon(p, n);
#endif
    float a[8] = {0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) a[l] += p[i + l];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

static float sum2_floats(const float *p, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_supports("avx2")) return sum2_avx2(p, n);
#elif defined(__aarch64__)
    return sum2_neon(p, n);
#endif
    return sum_floats(p, n / 2) + sum_floats(p + n / 2, n / 2);
}

/* Peak loops, one call per task (kind 0 and 9: a read of the buffer, as one
 * run a task or two side by side). */
typedef struct { int kind; long iters; const float *buf; size_t per_task; volatile float sink; } limit_job;

static void limit_task(void *ctx, int task, int worker) {
    (void)worker;
    limit_job *j = ctx;
    float s = 0;
    if (j->kind == 0) s = sum_floats(j->buf + (size_t)task * j->per_task, j->per_task);
    else if (j->kind == 9) s = sum2_floats(j->buf + (size_t)task * j->per_task, j->per_task);
#if defined(FMA_FLOPS_PER_ITER)
#if defined(__x86_64__) || defined(__i386__)
    else if (j->kind == 1) s = fma_avx2(j->iters);
    else if (j->kind == 4) s = (float)int8_avx_vnni(j->iters);
    else if (j->kind == 5) s = (float)int8_avx512_vnni(j->iters);
    else if (j->kind == 6) s = (float)int8_avx512(j->iters);
    else if (j->kind == 7) s = fma_avx512(j->iters);
    else if (j->kind == 8) s = bf16dp_avx512(j->iters);
    else s = (float)int8_avx2(j->iters);
#else
    else if (j->kind == 1) s = fma_neon(j->iters);
    else if (j->kind == 2) s = (float)int8_neon(j->iters);
    else s = (float)sdot_neon(j->iters);
#endif
#endif
    if (s == 12345.678f) j->sink = s;   /* keeps the result alive */
}

/* Seconds for one run of n_tasks tasks on pool p. */
static double time_tasks(gl_pool *p, int n_tasks, gl_task_fn fn, void *ctx) {
    double t0 = now();
    gl_pool_run(p, n_tasks, fn, ctx);
    return now() - t0;
}

/* ---- matrix products as cm384 runs them: chunks of >= 16 output rows ---- */

typedef struct {
    const gl_kernels *k;
    const gl_mat *w;          /* n_mats matrices, run one after another */
    int n_mats, n, chunk, chunks_per_mat;
    const float *x; const int8_t *xq; const float *xs; int ldx;
    float *y;
    int many_products;        /* one region for all n_mats (a MoE layer's experts) */
    int per_region;           /* ... or for this many at a time (0: all) */
} mm_bench;

static void mm_bench_task(void *ctx, int task, int worker) {
    (void)worker;
    mm_bench *b = ctx;
    const gl_mat *w = &b->w[task / b->chunks_per_mat];
    int r0 = (task % b->chunks_per_mat) * b->chunk, r1 = r0 + b->chunk < w->rows ? r0 + b->chunk : w->rows;
    if (w->type == GL_Q8) b->k->matmul_q8(w, b->xq, b->xs, b->n, b->ldx, b->y, w->rows, r0, r1);
    else b->k->matmul(w, b->x, b->n, b->ldx, b->y, w->rows, r0, r1);
}

/* The rows of a task as cm384's region_add_mm cuts a product: ~256 KB of
 * weights a task and at least two tasks a worker, but up to 16 tokens
 * (decode) stream 1 MB a task, one task a worker at least, as many tasks
 * each -- and in a region of many products (a MoE layer's experts) the
 * products balance the workers, so each is cut by its bytes alone.
 * Multiples of 16 rows. */
static int chunk_rows(const gl_mat *w, int n, int workers, int many_products) {
    size_t bytes = (size_t)w->rows * gl_row_bytes(w->type, w->cols);
    int streams = n <= 16;
    size_t per_task = streams ? 1024u << 10 : 256u << 10;
    int nc = (int)((bytes + per_task - 1) / per_task);
    int spread = workers > 1 ? (streams ? 1 : 2) * workers : 1;
    if (many_products && streams) spread = 1;
    if (nc < spread) nc = spread;
    if (spread > 1 && nc % workers) nc += workers - nc % workers;   /* as many tasks each */
    if (nc > (w->rows + 15) / 16) nc = (w->rows + 15) / 16;
    int chunk = (w->rows + nc - 1) / nc;
    return (chunk + 15) & ~15;
}

/* Seconds for one pass over all matrices: one parallel region per matrix
 * (as the engine issues a dense layer's products), or with many_products
 * one region for them all (as it issues a MoE layer's experts). */
static double time_matmul(gl_pool *p, mm_bench *b) {
    b->chunk = chunk_rows(&b->w[0], b->n, gl_pool_size(p), b->many_products);
    b->chunks_per_mat = (b->w[0].rows + b->chunk - 1) / b->chunk;
    const gl_mat *all = b->w;
    double t0 = now();
    if (b->many_products && b->per_region > 0)
        for (int m = 0; m < b->n_mats; m += b->per_region) {
            b->w = all + m;
            int k = b->n_mats - m < b->per_region ? b->n_mats - m : b->per_region;
            gl_pool_run(p, b->chunks_per_mat * k, mm_bench_task, b);
        }
    else if (b->many_products) gl_pool_run(p, b->chunks_per_mat * b->n_mats, mm_bench_task, b);
    else
        for (int m = 0; m < b->n_mats; m++) {
            b->w = all + m;
            gl_pool_run(p, b->chunks_per_mat, mm_bench_task, b);
        }
    b->w = all;
    return now() - t0;
}

/* The limits, one measurement each; kept so each kernel run is paired with
 * a limit measured just before it (the load on a shared machine drifts). */
typedef struct {
    gl_pool *p1, *pn;
    float *buf; size_t buf_floats;
    long iters;
} limits;

/* The better of one sequential run a thread and two: the kernels read
 * either way, and the limit is the faster. */
static double bandwidth_once(limits *L, gl_pool *p) {
    enum { TASKS = 64 };
    limit_job one = {0, 0, L->buf, L->buf_floats / TASKS, 0}, two = {9, 0, L->buf, L->buf_floats / TASKS, 0};
    double t1 = time_tasks(p, TASKS, limit_task, &one), t2 = time_tasks(p, TASKS, limit_task, &two);
    return (double)L->buf_floats * 4 / (t1 < t2 ? t1 : t2) / 1e9;
}

/* kind 1: fp32 FMA, 2: int8, 3: int8 SDOT, 4: AVX-VNNI, 5: AVX512-VNNI
   (256-bit), 6: AVX512-VNNI on zmm, 7: fp32 FMA on zmm */
static double peak_once(limits *L, int kind) {
#if defined(FMA_FLOPS_PER_ITER)
    int tasks = gl_pool_size(L->pn) * 2;
    limit_job j = {kind, L->iters, NULL, 0, 0};
#if defined(SDOT_OPS_PER_ITER)
    double per = kind == 1 ? FMA_FLOPS_PER_ITER : kind == 2 ? INT8_OPS_PER_ITER : SDOT_OPS_PER_ITER;
#else
    double per = kind == 1 ? FMA_FLOPS_PER_ITER : kind == 6 ? VNNI512_OPS_PER_ITER : kind == 7 ? FMA512_FLOPS_PER_ITER
               : kind == 8 ? BF16DP512_FLOPS_PER_ITER : kind == 4 || kind == 5 ? VNNI_OPS_PER_ITER : INT8_OPS_PER_ITER;
#endif
    return per * (double)L->iters * tasks / time_tasks(L->pn, tasks, limit_task, &j) / 1e9;
#else
    (void)L; (void)kind;
    return 0;
#endif
}

/* Runs `reps` pairs (limit, kernel); reports the kernel's median value and
 * the median of the per-pair ratios kernel/limit (or limit/kernel time for
 * vs_is_time).  Returns the median kernel value. */
typedef double (*measure_fn)(void *ctx);
static double paired(const char *what, const char *unit, const char *vs, int reps,
                     measure_fn kernel, void *kctx, measure_fn limit, void *lctx) {
    double v[16], r[16];
    if (reps > 16) reps = 16;
    for (int i = 0; i < reps; i++) {
        double l = limit ? limit(lctx) : 0;
        v[i] = kernel(kctx);
        r[i] = l > 0 ? v[i] / l : 0;
    }
    double mv = median(v, reps), mr = median(r, reps);
    report(what, mv, unit, limit ? vs : NULL, mr);
    return mv;
}

/* n_mats matrices of one type sharing nothing, filled with random values. */
static gl_mat *make_mats(int type, int rows, int cols, int n_mats) {
    gl_mat *w = xmalloc((size_t)n_mats * sizeof *w);
    size_t bytes = (size_t)rows * cols * gl_type_size(type);
    for (int m = 0; m < n_mats; m++) {
        uint8_t *d = xmalloc(bytes);
        for (size_t i = 0; i + 8 <= bytes; i += 8) {
            uint64_t v = rng_u64();
            if (type == GL_BF16) v = (v & 0x807f807f807f807full) | 0x3f003f003f003f00ull;   /* +-[0.5, 1) */
            if (type == GL_Q8)
                for (int j = 0; j < 8; j++) d[i + j] = (uint8_t)(int8_t)((int)((v >> (8 * j)) & 0xff) % 255 - 127);
            else memcpy(d + i, &v, 8);
        }
        float *scale = NULL;
        if (type == GL_Q8) {
            scale = xmalloc((size_t)rows * sizeof(float));
            for (int r = 0; r < rows; r++) scale[r] = 1.0f / 127;
        }
        if (type == GL_Q8) {          /* the same values in the kernels' panels */
            uint8_t *q = xmalloc(gl_q8_bytes(rows, cols));
            gl_q8_pack_rows((const int8_t *)d, cols, rows, cols, 0, rows, (int8_t *)q);
            free(d);
            d = q;
        }
        w[m] = (gl_mat){type, rows, cols, d, scale};
    }
    return w;
}
static void free_mats(gl_mat *w, int n_mats) {
    for (int m = 0; m < n_mats; m++) { free((void *)w[m].data); free((void *)w[m].scale); }
    free(w);
}

/* measure_fn adapters for paired() */
typedef struct { mm_bench b; gl_pool *p; double bytes; } mm_run_ctx;
typedef struct { limits *L; gl_pool *p; } bw_ctx;
typedef struct { limits *L; int kind; } peak_ctx;

static double mm_gbps(void *ctx) { mm_run_ctx *c = ctx; return c->bytes / time_matmul(c->p, &c->b) / 1e9; }
static double mm_gops(void *ctx) {
    mm_run_ctx *c = ctx;
    const gl_mat *w = c->b.w;
    return 2.0 * w->rows * w->cols * c->b.n * c->b.n_mats / time_matmul(c->p, &c->b) / 1e9;
}
static double bw_measure(void *ctx) { bw_ctx *c = ctx; return bandwidth_once(c->L, c->p); }
static double peak_measure(void *ctx) { peak_ctx *c = ctx; return peak_once(c->L, c->kind); }

/* ---- the attention core as prefill runs it ----
 * A tile of 4 queries x 16 heads (64 lanes) against a 512-key latent cache
 * of 576-wide rows (MLA: kv_lora 512 + rope 64), a KV block of 16 rows per
 * call: the scores (dot_rows_t), then the weighted latents over the first
 * 512 columns (axpy_rowp_n, 16 heads and a chunk of 64 keys per call, the
 * rows by pointer as the core passes them across KV blocks).  A task per
 * tile, every worker on its own tiles over one shared cache, as t_core runs
 * them. */
enum { CORE_L = 64, CORE_KEYS_B = 512, CORE_W = 576, CORE_R = 512, CORE_BLK = 16, CORE_CHUNK = 64, CORE_TILES = 64 };
typedef struct {
    const gl_kernels *k;
    const float *qt, *kv;
    float *sc, *lat;
    int which;                 /* 0 scores, 1 latents; 2, 3: the same in native BF16 */
    const uint32_t *qp;        /* which 2: the queries as bf16 pairs */
    const uint16_t *kvh;       /* which 2, 3: the cache in bf16 */
} core_bench;
static void core_task(void *ctx, int task, int worker) {
    core_bench *c = ctx;
    (void)task;
    float *sc = c->sc + (size_t)worker * CORE_L * CORE_KEYS_B, *lat = c->lat + (size_t)worker * CORE_L * CORE_R;
    if (c->which == 0)
        for (int j = 0; j < CORE_KEYS_B; j += CORE_BLK)
            c->k->dot_rows_t(sc + j, CORE_KEYS_B, c->qt, CORE_L, CORE_L, c->kv + (size_t)j * CORE_W, CORE_W, CORE_BLK, CORE_W);
    else if (c->which == 2)
        for (int j = 0; j < CORE_KEYS_B; j += CORE_BLK)
            c->k->dot_rows_tp_bf16(sc + j, CORE_KEYS_B, c->qp, CORE_L, CORE_L, c->kvh + (size_t)j * CORE_W, CORE_W,
                                   CORE_BLK, CORE_W);
    else if (c->which == 3)
        for (int q = 0; q < CORE_L / 16; q++)
            for (int j = 0; j < CORE_KEYS_B; j += CORE_CHUNK) {
                const uint16_t *rp[CORE_CHUNK];
                for (int i = 0; i < CORE_CHUNK; i++) rp[i] = c->kvh + (size_t)(j + i) * CORE_W;
                c->k->axpy_rowp_n_bf16p(lat + (size_t)q * 16 * CORE_R, CORE_R, rp, sc + (size_t)q * 16 * CORE_KEYS_B + j,
                                        CORE_KEYS_B, 16, CORE_CHUNK, CORE_R);
            }
    else
        for (int q = 0; q < CORE_L / 16; q++)
            for (int j = 0; j < CORE_KEYS_B; j += CORE_CHUNK) {
                const float *rp[CORE_CHUNK];
                for (int i = 0; i < CORE_CHUNK; i++) rp[i] = c->kv + (size_t)(j + i) * CORE_W;
                c->k->axpy_rowp_n(lat + (size_t)q * 16 * CORE_R, CORE_R, rp, sc + (size_t)q * 16 * CORE_KEYS_B + j,
                                  CORE_KEYS_B, 16, CORE_CHUNK, CORE_R);
            }
}
typedef struct { core_bench c; gl_pool *p; } core_run_ctx;
static double core_gflops(void *ctx) {
    core_run_ctx *r = ctx;
    double t = time_tasks(r->p, CORE_TILES, core_task, &r->c);
    return 2.0 * CORE_L * CORE_KEYS_B * (r->c.which % 2 == 0 ? CORE_W : CORE_R) * CORE_TILES / t / 1e9;
}

/* ---- pool overhead ---- */

static void empty_task(void *ctx, int task, int worker) { (void)ctx; (void)task; (void)worker; }

/* A task that busy-waits `ns`: with as many tasks as threads, a run takes
 * that long plus the pool's own cost of starting and joining. */
static void busy_task(void *ctx, int task, int worker) {
    (void)task; (void)worker;
    double until = now() + *(const double *)ctx * 1e-9;
    while (now() < until) {}
}

/* ns per gl_pool_run of n_tasks tasks of busy_ns each (0: empty), minus
 * the busy time itself: the median and the 10th percentile of single runs
 * (on a shared machine the median includes runs where a worker was
 * descheduled and the caller did its share; the 10th percentile is the
 * pool's own cost when it has the cores). */
static void pool_overhead_ns(gl_pool *p, int n_tasks, double busy_ns, double *p50, double *p10) {
    enum { RUNS = 20001 };
    static double t[RUNS];
    for (int i = 0; i < RUNS; i++) {
        double t0 = now();
        gl_pool_run(p, n_tasks, busy_ns > 0 ? busy_task : empty_task, &busy_ns);
        t[i] = (now() - t0) * 1e9 - busy_ns;
    }
    qsort(t, RUNS, sizeof *t, cmp_double);
    *p50 = t[RUNS / 2];
    *p10 = t[RUNS / 10];
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--sweep")) sweep = 1;
        else if (!strcmp(argv[i], "--now")) now_only = 1;
        else if (!strcmp(argv[i], "--set") && i + 1 < argc) set_name = argv[++i];
        else if (!strcmp(argv[i], "--json-out") && i + 1 < argc) {
            if (!(json_out = fopen(argv[++i], "w"))) { perror(argv[i]); return 2; }
        } else {
            fprintf(stderr, "usage: %s [--json] [--json-out FILE] [--quick] [--sweep] [--set NAME] [--now]\n", argv[0]);
            return 2;
        }
    }
    const gl_kernels *k = set_name ? gl_kernels_by_name(set_name) : gl_kernels_get();
    if (!k) { fprintf(stderr, "kernel set %s: unknown or not runnable on this CPU\n", set_name); return 2; }
    int threads = gl_n_cpus();
    gl_pool *p1 = gl_pool_create(1), *pn = gl_pool_create(threads);
    if (!p1 || !pn) { fprintf(stderr, "cannot create the worker pool\n"); return 1; }
    if (!json && !now_only) printf("kernel set %s, %d threads%s\n\n", k->name, threads, quick ? " (quick)" : "");
    double load0 = load_average();
    char what[96], vs[64];

    /* limits */
    limits L = {p1, pn, NULL, (size_t)(quick ? 64 : 256) << 18, quick ? 2000000 : 10000000};
    L.buf = xmalloc(L.buf_floats * sizeof(float));                 /* 64 or 256 MB */
    for (size_t i = 0; i < L.buf_floats; i++) L.buf[i] = (float)(i & 255);
    /* the int8 peak of the instructions the chosen set uses */
    int int8_kind = 2, fma_kind = 1;   /* the peaks of the vector width the chosen set uses */
#if defined(SDOT_OPS_PER_ITER)
    if (gl_cpu_features() & GL_ARM_DOTPROD) int8_kind = 3;
#endif
#if defined(GL_HAVE_AVX2)
    if (!strcmp(k->name, "avx_vnni")) int8_kind = 4;
    if (!strcmp(k->name, "avx512_vnni")) int8_kind = 5;
    if (!strcmp(k->name, "avx512")) int8_kind = 6, fma_kind = 7;
#endif
    if (now_only) {   /* --now: the limits alone, all threads (make bench measures them before each run) */
        double bws[5], fs[3], is[3];
        for (int i = 0; i < 5; i++) bws[i] = bandwidth_once(&L, pn);
        for (int i = 0; i < 3; i++) { fs[i] = peak_once(&L, fma_kind); is[i] = peak_once(&L, int8_kind); }
        printf("%.2f %.1f %.1f\n", best(bws, 5), best(fs, 3), best(is, 3));
        free(L.buf);
        gl_pool_free(p1);
        gl_pool_free(pn);
        return 0;
    }
    double bw1s[7], bwns[7], fmas[5], int8s[5];
    for (int i = 0; i < 7; i++) { bw1s[i] = bandwidth_once(&L, p1); bwns[i] = bandwidth_once(&L, pn); }
    for (int i = 0; i < 5; i++) { fmas[i] = peak_once(&L, fma_kind); int8s[i] = peak_once(&L, int8_kind); }
    /* a limit is the best the machine showed: on a shared host another
       process only ever lowers a run, and a low limit would flatter every
       ratio measured against it */
    double bw1 = best(bw1s, 7), bwn = best(bwns, 7), fma_peak = best(fmas, 5), int8_peak = best(int8s, 5);
    report("read bandwidth, 1 thread", bw1, "GB/s", NULL, 0);
    snprintf(what, sizeof what, "read bandwidth, %d threads", threads);
    report(what, bwn, "GB/s", NULL, 0);
    if (fma_peak > 0) {
        snprintf(what, sizeof what, "fp32 FMA peak%s, %d threads", fma_kind == 7 ? " zmm" : "", threads);
        report(what, fma_peak, "GFLOP/s", NULL, 0);
        snprintf(what, sizeof what, "int8 %s peak, %d threads",
                 int8_kind == 3 ? "sdot" : int8_kind == 6 ? "vpdpbusd-zmm" : int8_kind >= 4 ? "vpdpbusd" : "multiply-add", threads);
        report(what, int8_peak, "GOP/s", NULL, 0);
        const gl_kernels *bf = gl_kernels_by_name("avx512_bf16");
        if (bf && bf->dot_rows_tp_bf16) {   /* the opt-in set's native BF16 (section "attention core ... native") */
            double bfs[5];
            for (int i = 0; i < 5; i++) bfs[i] = peak_once(&L, 8);
            snprintf(what, sizeof what, "bf16 vdpbf16ps peak (opt-in avx512_bf16), %d threads", threads);
            report(what, best(bfs, 5), "GFLOP/s", NULL, 0);
        }
    }
    if (!json) printf("(each ratio below: median over runs, each run against a limit measured just before it)\n");

    /* matrix-vector (decode) and n=16, over > 64 MB of weights */
    static const int shapes[][2] = {{2048, 2048}, {1408, 2048}};
    static const int types[] = {GL_BF16, GL_Q8};
    int cols_max = 2048, n_max = 512;
    float *x = xmalloc((size_t)n_max * cols_max * sizeof(float));
    int8_t *xq = xmalloc((size_t)n_max * cols_max);
    float *xs = xmalloc((size_t)n_max * sizeof(float));
    float *y = xmalloc((size_t)n_max * 2048 * sizeof(float));
    for (size_t i = 0; i < (size_t)n_max * cols_max; i++) x[i] = (float)((int)(rng_u64() % 2001) - 1000) / 1000.0f;
    k->quantize_q8(x, n_max, cols_max, cols_max, xq, cols_max, xs);
    double total_mb = quick ? 96 : 160;
    for (int ti = 0; ti < 2; ti++)
        for (int si = 0; si < 2; si++) {
            int type = types[ti], rows = shapes[si][0], cols = shapes[si][1];
            double mat_bytes = (double)rows * cols * gl_type_size(type);
            int n_mats = (int)(total_mb * 1048576 / mat_bytes) + 1;
            gl_mat *w = make_mats(type, rows, cols, n_mats);
            mm_run_ctx mc = {{k, w, n_mats, 1, 0, 0, x, xq, xs, cols_max, y, 0, 0}, pn, mat_bytes * n_mats};
            const char *tn = type == GL_Q8 ? "q8" : "bf16";
            bw_ctx bc = {&L, pn};
            snprintf(what, sizeof what, "matmul n=1 %s %dx%d (%d mats)", tn, rows, cols, n_mats);
            snprintf(vs, sizeof vs, "read bw %dT", threads);
            double gb1 = paired(what, "GB/s", vs, 7, mm_gbps, &mc, bw_measure, &bc);
            if (si == 0) {
                mm_run_ctx mc1 = mc;
                mc1.p = p1;
                bw_ctx bc1 = {&L, p1};
                snprintf(what, sizeof what, "matmul n=1 %s %dx%d, 1 thread", tn, rows, cols);
                paired(what, "GB/s", "read bw 1T", 5, mm_gbps, &mc1, bw_measure, &bc1);
            }
            mc.b.n = 16;
            snprintf(what, sizeof what, "matmul n=16 %s %dx%d", tn, rows, cols);
            double gb16 = paired(what, "GB/s", NULL, 7, mm_gbps, &mc, NULL, NULL);
            snprintf(what, sizeof what, "  n=16 / n=1 time per weight byte");
            report(what, gb1 / gb16, "x", NULL, 0);
            free_mats(w, n_mats);
        }

    /* a MoE layer's experts at decode: many 1 MB products (an expert's
       gate and up, 1024x1024 INT8 or 512x1024 bf16) in one region, each
       one task */
    for (int ti = 0; ti < 2; ti++) {
        int type = types[ti], cols = 1024, rows = type == GL_Q8 ? 1024 : 512;
        double mat_bytes = (double)rows * cols * gl_type_size(type);
        int n_mats = (int)(total_mb * 1048576 / mat_bytes) + 1;
        gl_mat *w = make_mats(type, rows, cols, n_mats);
        mm_run_ctx mc = {{k, w, n_mats, 1, 0, 0, x, xq, xs, cols_max, y, 1, 0}, pn, mat_bytes * n_mats};
        bw_ctx bc = {&L, pn};
        snprintf(what, sizeof what, "experts n=1 %s %dx%d, one task each (%d)", type == GL_Q8 ? "q8" : "bf16", rows, cols, n_mats);
        snprintf(vs, sizeof vs, "read bw %dT", threads);
        paired(what, "GB/s", vs, 7, mm_gbps, &mc, bw_measure, &bc);
        /* as a decode step meets them: a layer's 6 experts a region, and
           a 1 MB projection a region (each region's start and end are the
           step's, and its streams start cold) */
        mc.b.per_region = 6;
        snprintf(what, sizeof what, "experts n=1 %s %dx%d, 6 a region", type == GL_Q8 ? "q8" : "bf16", rows, cols);
        paired(what, "GB/s", vs, 7, mm_gbps, &mc, bw_measure, &bc);
        mc.b.many_products = 0;
        snprintf(what, sizeof what, "matmul n=1 %s %dx%d, one a region", type == GL_Q8 ? "q8" : "bf16", rows, cols);
        paired(what, "GB/s", vs, 7, mm_gbps, &mc, bw_measure, &bc);
        free_mats(w, n_mats);
    }

    /* GEMM (prefill): n=512, one matrix (2048x2048) */
    for (int ti = 0; ti < 2; ti++) {
        int type = types[ti], rows = 2048, cols = 2048, n = quick ? 128 : n_max;
        gl_mat *w = make_mats(type, rows, cols, 1);
        mm_run_ctx mc = {{k, w, 1, n, 0, 0, x, xq, xs, cols_max, y, 0, 0}, pn, 0};
        peak_ctx pc = {&L, type == GL_Q8 ? int8_kind : fma_kind};
        mm_gops(&mc);   /* warm up */
        snprintf(what, sizeof what, "gemm n=%d %s %dx%d", n, type == GL_Q8 ? "q8" : "bf16", rows, cols);
        paired(what, "GOP/s", type == GL_Q8 ? "int8 peak" : "fp32 FMA peak", 5, mm_gops, &mc,
               fma_peak > 0 ? peak_measure : NULL, &pc);
        free_mats(w, 1);
        /* the same product over > 64 MB of weights, as a model's prefill
           streams them from DRAM (packing and prefetching show here) */
        int n_mats = (int)(total_mb * 1048576 / ((double)rows * cols * gl_type_size(type))) + 1;
        w = make_mats(type, rows, cols, n_mats);
        mm_run_ctx mcd = {{k, w, n_mats, n, 0, 0, x, xq, xs, cols_max, y, 0, 0}, pn, 0};
        snprintf(what, sizeof what, "gemm n=%d %s %dx%d (%d mats)", n, type == GL_Q8 ? "q8" : "bf16", rows, cols, n_mats);
        paired(what, "GOP/s", type == GL_Q8 ? "int8 peak" : "fp32 FMA peak", 5, mm_gops, &mcd,
               fma_peak > 0 ? peak_measure : NULL, &pc);
        free_mats(w, n_mats);
    }
    /* --sweep: GOP/s against the number of tokens, 2048x2048 as in the
       engine (chunks of rows over the pool), where decode turns into prefill */
    if (sweep) {
        static const int ns[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512};
        for (int ti = 0; ti < 2; ti++) {
            int type = types[ti];
            gl_mat *w = make_mats(type, 2048, 2048, 8);
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                mm_run_ctx mc = {{k, w, 8, ns[ni], 0, 0, x, xq, xs, cols_max, y, 0, 0}, pn, 0};
                snprintf(what, sizeof what, "sweep %s 2048x2048 n=%d", type == GL_Q8 ? "q8" : "bf16", ns[ni]);
                double v[5];
                for (int r = 0; r < 5; r++) v[r] = mm_gops(&mc);
                report(what, median(v, 5), "GOP/s", NULL, 0);
            }
            free_mats(w, 8);
        }
    }
    /* the attention core (prefill, absorbed MLA): fp32 at the FMA peak */
    if (fma_peak > 0) {
        float *qt = xmalloc((size_t)CORE_W * CORE_L * sizeof(float)), *kv = xmalloc((size_t)CORE_KEYS_B * CORE_W * sizeof(float));
        float *sc = xmalloc((size_t)threads * CORE_L * CORE_KEYS_B * sizeof(float));
        float *lat = xmalloc((size_t)threads * CORE_L * CORE_R * sizeof(float));
        for (int i = 0; i < CORE_W * CORE_L; i++) qt[i] = (float)((int)(rng_u64() % 2001) - 1000) / 1000.0f;
        for (int i = 0; i < CORE_KEYS_B * CORE_W; i++) kv[i] = (float)((int)(rng_u64() % 2001) - 1000) / 1000.0f;
        for (size_t i = 0; i < (size_t)threads * CORE_L * CORE_KEYS_B; i++) sc[i] = (float)(rng_u64() % 1000) / 1e6f;
        memset(lat, 0, (size_t)threads * CORE_L * CORE_R * sizeof(float));
        peak_ctx pc = {&L, fma_kind};
        for (int which = 0; which < 2; which++) {
            core_run_ctx cr = {{k, qt, kv, sc, lat, which, NULL, NULL}, pn};
            core_gflops(&cr);   /* warm up */
            snprintf(what, sizeof what, "attention core %s, 64 lanes x 512 keys",
                     which == 0 ? "scores (dot_rows_t)" : "latents (axpy_rowp_n)");
            paired(what, "GFLOP/s", "fp32 FMA peak", 5, core_gflops, &cr, peak_measure, &pc);
        }
        /* the opt-in set's native-BF16 core (bf16 cache, queries and weights
           rounded), against the BF16 dot-product peak */
        const gl_kernels *bf = gl_kernels_by_name("avx512_bf16");
        if (bf && bf->dot_rows_tp_bf16) {
            uint16_t *kvh = xmalloc((size_t)CORE_KEYS_B * CORE_W * sizeof(uint16_t));
            uint32_t *qp = xmalloc((size_t)(CORE_W / 2) * CORE_L * sizeof(uint32_t));
            for (int i = 0; i < CORE_KEYS_B * CORE_W; i++) kvh[i] = gl_f32_to_bf16(kv[i]);
            bf->round_pairs_bf16(qp, CORE_L, qt, CORE_L, CORE_W, CORE_L);
            peak_ctx pb = {&L, 8};
            for (int which = 2; which < 4; which++) {
                core_run_ctx cr = {{bf, qt, kv, sc, lat, which, qp, kvh}, pn};
                core_gflops(&cr);
                snprintf(what, sizeof what, "attention core %s, native BF16",
                         which == 2 ? "scores (dot_rows_tp_bf16)" : "latents (axpy_rowp_n_bf16p)");
                paired(what, "GFLOP/s", "BF16 dot peak", 5, core_gflops, &cr, peak_measure, &pb);
            }
            free(kvh); free(qp);
        }
        free(qt); free(kv); free(sc); free(lat);
    }
    free(x); free(xq); free(xs); free(y); free(L.buf);

    /* pool: empty regions (the caller may finish them alone), and regions
       of one 5 us task per thread, which every worker should join */
    double p50, p10;
    pool_overhead_ns(pn, 16, 0, &p50, &p10);
    snprintf(what, sizeof what, "empty gl_pool_run, %d threads, 16 tasks", threads);
    report(what, p50, "ns", NULL, 0);
    pool_overhead_ns(pn, threads, 5000, &p50, &p10);
    snprintf(what, sizeof what, "gl_pool_run overhead, %d x 5us tasks", threads);
    report(what, p50, "ns", NULL, 0);
    snprintf(what, sizeof what, "  same, 10th percentile");
    report(what, p10, "ns", NULL, 0);

    double load1 = load_average();
    if (load0 >= 0) {
        snprintf(what, sizeof what, "load average before / after (%d CPUs)", threads);
        if (json_out) fprintf(json_out, "{\"bench\":\"load average\",\"before\":%.2f,\"after\":%.2f,\"cpus\":%d}\n", load0, load1, threads);
        if (json) printf("{\"bench\":\"load average\",\"before\":%.2f,\"after\":%.2f,\"cpus\":%d}\n", load0, load1, threads);
        else printf("%-40s %5.2f / %.2f\n", what, load0, load1);
    }
    if (json_out) fclose(json_out);
    gl_pool_free(p1);
    gl_pool_free(pn);
    return 0;
}

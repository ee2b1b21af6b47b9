/* x86_avx2.c -- AVX2 + FMA + F16C kernels (Haswell, Zen and later).
 *
 * Included from ggml_like.c.  Every function carries a target attribute, so
 * the library builds without -mavx2; gl_kernels_get offers this set only when
 * cpuid says the CPU and the OS have those features.
 *
 * Reduction order of one fp dot product W[r] . x[i] -- the same in every path
 * below, whatever the tile shape, so results are batch invariant: lane l of
 * one 8-wide accumulator takes w[c]*x[c] for c = l (mod 8) by FMA in
 * increasing c; the last cols%8 columns form one zero-padded block; the lanes
 * are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the scalar set's order.
 * Weights are widened to fp32 exactly (fp8 times its block scale, rounded
 * once), the values gl_row_to_f32 gives.
 *
 * Loop structure (matmul): tokens in blocks whose activations fit in L2; in a
 * block, weight rows in panels of 3 that stay in L1 while every token tile
 * of 4 passes over them; one tile keeps 3x4 accumulators in registers, so
 * each weight vector loaded serves 4 tokens and each activation vector 3
 * rows.  With n = 1 or 2 (the matrix-vector path, bound by memory
 * bandwidth) rows of 1 KB or more go four at once, one from each quarter
 * of the range (avx2_row_runs): four sequential runs in flight (Zen 3, 2
 * threads, bf16 2048x2048 from DRAM: 73-76% of the read limit with 3-row
 * panels, 88-94% with four runs; bench_kernels, alternating runs).  W8A8
 * (x86_q8.h) reads GL_Q8's 16-row panels, one panel times 4 tokens a tile
 * (8 in the EVEX copy, which has 32 registers).
 * A column-blocked GEMM (weights in L2, activations in L1, accumulators
 * saved between blocks) was measured slower than this on Zen 3 at every n
 * from 4 to 512, so there is one path. */
#include <immintrin.h>

#define GL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define GL_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

#define AVX2_NR 3      /* weight rows per fp tile          */
#define AVX2_NT 4      /* tokens per tile                  */
/* 1-2 tokens (decode) on rows of 1 KB or more: four rows at once, one from
 * each quarter of the range (avx2_row_runs), so that a thread reads four
 * sequential runs of bytes side by side instead of one panel's rows a row
 * apart. */
#define AVX2_ROW_RUNS 4
#define AVX2_ROWWISE_MAX_N 2
#define AVX2_ROWWISE_MIN_BYTES 1024
#define AVX2_TILE_ROWS 4   /* the most rows a tile holds: max(AVX2_NR, AVX2_ROW_RUNS) */
#ifndef GL_TOKEN_BLOCK_BYTES
#define GL_TOKEN_BLOCK_BYTES 262144 /* activations per token block */
#endif
#ifndef GL_PF_PANELS
#define GL_PF_PANELS 2 /* prefetch distance, in panels     */
#endif

GL_AVX2_INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l0+l4 .. l3+l7 */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                 /* s0+s2, s1+s3  */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

GL_AVX2_INLINE int32_t avx2_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Mask of the first `rem` (0..8) lanes, for maskload/maskstore. */
GL_AVX2_INLINE __m256i avx2_tail_mask(int rem) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 weights of a stored type as fp32.  fp8 e4m3 goes through fp16: the
 * bits s.eeee.mmm placed as s.0eeee.mmm0000000 are an fp16 of value v/256
 * (subnormals included), so `scale` holds the block scale times 256: the
 * product is v * scale rounded once.  (The e4m3 NaN code reads as 480.) */
GL_AVX2_INLINE __m256 avx2_load_w(int type, const uint8_t *p, __m256 scale) {
    switch (type) {
    case GL_F32: return _mm256_loadu_ps((const float *)p);
    case GL_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case GL_BF16: {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    default: {   /* GL_F8_E4M3 */
        __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
        __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xbf80));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), scale);
    }
    }
}

/* One register tile: y[t*ldy + r+k*rs] = W[r+k*rs] . x[t*ldx] for k < nr,
 * t < nt (constants after inlining, so acc[][] lives in registers; rs, the
 * rows between the tile's rows, is 1 but in avx2_row_runs).  pf: an address
 * to prefetch from, at the pace this tile reads its rows (rs > 1: row k's
 * at pf + k*rs rows). */
GL_AVX2_INLINE void avx2_tile_rs(int type, const gl_mat *w, int r, int nr, int rs, const float *x, int ldx, int nt,
                                 float *y, int ldy, const uint8_t *pf) {
    const int cols = w->cols, full = cols & ~7;
    const size_t es = gl_type_size(type);
    const int bcols = (cols + GL_F8_BLOCK - 1) / GL_F8_BLOCK;
    const uint8_t *wr[AVX2_TILE_ROWS];
    const float *wsc[AVX2_TILE_ROWS];
    __m256 acc[AVX2_TILE_ROWS][AVX2_NT], s[AVX2_TILE_ROWS], wv[AVX2_TILE_ROWS];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        wr[k] = (const uint8_t *)w->data + (size_t)(r + k * rs) * (size_t)cols * es;
        wsc[k] = type == GL_F8_E4M3 ? w->scale + (size_t)((r + k * rs) / GL_F8_BLOCK) * (size_t)bcols : NULL;
        s[k] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[k][t] = _mm256_setzero_ps();
    }
    for (int cb = 0; cb < cols; cb += GL_F8_BLOCK) {
        if (type == GL_F8_E4M3) {
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) s[k] = _mm256_set1_ps(wsc[k][cb / GL_F8_BLOCK] * 256.0f);
        }
        int ce = cb + GL_F8_BLOCK < full ? cb + GL_F8_BLOCK : full;
        for (int c = cb; c < ce; c += 8) {
            if (rs > 1) {
#pragma GCC unroll 4
                for (int k = 0; k < nr; k++) _mm_prefetch((const char *)pf + ((size_t)k * rs * cols + c) * es, _MM_HINT_NTA);
            } else {
                const uint8_t *pc = pf + (size_t)c * (size_t)nr * es;
                _mm_prefetch((const char *)pc, _MM_HINT_NTA);
                if (nr * es * 8 > 64) _mm_prefetch((const char *)pc + 64, _MM_HINT_NTA);
            }
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) wv[k] = avx2_load_w(type, wr[k] + (size_t)c * es, s[k]);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                __m256 xv = _mm256_loadu_ps(x + (size_t)t * ldx + c);
#pragma GCC unroll 4
                for (int k = 0; k < nr; k++) acc[k][t] = _mm256_fmadd_ps(wv[k], xv, acc[k][t]);
            }
        }
    }
    if (full < cols) {   /* the zero-padded last block; s[] holds its scale */
        const int rem = cols - full;
        const __m256i mask = avx2_tail_mask(rem);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            uint8_t buf[32] = {0};
            memcpy(buf, wr[k] + (size_t)full * es, (size_t)rem * es);
            wv[k] = avx2_load_w(type, buf, s[k]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256 xv = _mm256_maskload_ps(x + (size_t)t * ldx + full, mask);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = _mm256_fmadd_ps(wv[k], xv, acc[k][t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) y[(size_t)t * ldy + r + k * rs] = avx2_hsum(acc[k][t]);
}

GL_AVX2_INLINE void avx2_tile(int type, const gl_mat *w, int r, int nr, const float *x, int ldx, int nt,
                              float *y, int ldy, const uint8_t *pf) {
    avx2_tile_rs(type, w, r, nr, 1, x, ldx, nt, y, ldy, pf);
}

/* The tile for nt = 1..4 tokens (nr stays a constant). */
GL_AVX2_INLINE void avx2_tile_nt(int type, const gl_mat *w, int r, int nr, const float *x, int ldx, int nt,
                                 float *y, int ldy, const uint8_t *pf) {
    switch (nt) {
    case 4: avx2_tile(type, w, r, nr, x, ldx, 4, y, ldy, pf); break;
    case 3: avx2_tile(type, w, r, nr, x, ldx, 3, y, ldy, pf); break;
    case 2: avx2_tile(type, w, r, nr, x, ldx, 2, y, ldy, pf); break;
    case 1: avx2_tile(type, w, r, nr, x, ldx, 1, y, ldy, pf); break;
    }
}

/* Rows [r, r1) in panels of nr, times n tokens.  Each panel is read whole
 * by every token tile in turn: the first tile pulls it from memory, the
 * others find it in L1.  Rows are contiguous, so the first tile also
 * prefetches the panel GL_PF_PANELS on (if still below r1) while it reads
 * this one: the hardware prefetcher restarts at every page, and a panel is
 * only a few pages.  (Non-temporal: weights read once should not push the
 * activations out of L2; measured a little faster than T0 on Zen 3.) */
GL_AVX2_INLINE void avx2_panels(int type, const gl_mat *w, int nr, const float *x, int n, int ldx,
                                float *y, int ldy, int r, int r1) {
    const size_t row_bytes = (size_t)w->cols * gl_type_size(type);
    for (; r + nr <= r1; r += nr) {
        const uint8_t *panel = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint8_t *pf = r + (GL_PF_PANELS + 1) * nr <= r1 ? panel + GL_PF_PANELS * (size_t)nr * row_bytes : panel;
        for (int i = 0; i < n; i += AVX2_NT, pf = panel) {
            int nt = n - i < AVX2_NT ? n - i : AVX2_NT;
            avx2_tile_nt(type, w, r, nr, x + (size_t)i * ldx, ldx, nt, y + (size_t)i * ldy, ldy, pf);
        }
    }
}

/* Rows [r, r1) for 1-2 tokens, AVX2_ROW_RUNS rows at once: row i of each
 * quarter of the range side by side, so four sequential runs are in flight
 * where a panel's rows are streams a row apart.  Each row's sum is the one
 * a row alone gets. */
GL_AVX2_INLINE void avx2_row_runs(int type, const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r,
                                  int r1) {
    const size_t row_bytes = (size_t)w->cols * gl_type_size(type);
    const int part = (r1 - r) / AVX2_ROW_RUNS;
    const uint8_t *base = (const uint8_t *)w->data;
    for (int i = 0; i < part; i++) {
        const int ra = r + i, ahead = i + GL_PF_PANELS < part ? GL_PF_PANELS : 0;
        const uint8_t *pf = base + (size_t)(ra + ahead) * row_bytes;
        if (n == 1) avx2_tile_rs(type, w, ra, AVX2_ROW_RUNS, part, x, ldx, 1, y, ldy, pf);
        else avx2_tile_rs(type, w, ra, AVX2_ROW_RUNS, part, x, ldx, 2, y, ldy, pf);
    }
    avx2_panels(type, w, 1, x, n, ldx, y, ldy, r + AVX2_ROW_RUNS * part, r1);
}

/* Tokens per block: the activations of a block (fp32 or int8) stay in L2
 * (~256 KB) while all the row panels pass over them. */
static int gl_token_block(int cols, int elem_size) {
    int nb = (int)(GL_TOKEN_BLOCK_BYTES / ((size_t)(cols > 0 ? cols : 1) * (size_t)elem_size));
    nb &= ~(AVX2_NT - 1);
    return nb < AVX2_NT ? AVX2_NT : nb;
}

GL_AVX2_INLINE void avx2_matmul_typed(int type, const gl_mat *w, const float *x, int n, int ldx,
                                      float *y, int ldy, int r0, int r1) {
    if (n <= AVX2_ROWWISE_MAX_N && (size_t)w->cols * gl_type_size(type) >= AVX2_ROWWISE_MIN_BYTES) {
        avx2_row_runs(type, w, x, n, ldx, y, ldy, r0, r1);
        return;
    }
    const int nb = gl_token_block(w->cols, 4), r = r0 + (r1 - r0) / AVX2_NR * AVX2_NR;
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        avx2_panels(type, w, AVX2_NR, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r0, r);
        avx2_panels(type, w, 1, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r, r1);
    }
}

static GL_AVX2 void avx2_matmul_f32(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    avx2_matmul_typed(GL_F32, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_AVX2 void avx2_matmul_f16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    avx2_matmul_typed(GL_F16, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_AVX2 void avx2_matmul_bf16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    avx2_matmul_typed(GL_BF16, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_AVX2 void avx2_matmul_f8(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    avx2_matmul_typed(GL_F8_E4M3, w, x, n, ldx, y, ldy, r0, r1);
}

static void avx2_matmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    switch (w->type) {
    case GL_F32:     avx2_matmul_f32(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F16:     avx2_matmul_f16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_BF16:    avx2_matmul_bf16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F8_E4M3: avx2_matmul_f8(w, x, n, ldx, y, ldy, r0, r1); break;
    default:
        if (gl_type_is_block(w->type)) avx2_qmatmul(w, x, n, ldx, y, ldy, r0, r1);   /* quants.c */
        else scalar_matmul(w, x, n, ldx, y, ldy, r0, r1);
        break;
    }
}

/* The AVX-512 set: the block formats with 512-bit FMA (quants.c), the rest as AVX2. */
static void avx512_matmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    if (gl_type_is_block(w->type)) avx512_qmatmul(w, x, n, ldx, y, ldy, r0, r1);
    else avx2_matmul(w, x, n, ldx, y, ldy, r0, r1);
}

/* ---- W8A8 ----
 * maddubs multiplies unsigned by signed bytes and adds pairs into int16
 * (saturating), so: |w| (unsigned) times x*sign(w) (signed) = w*x, and a pair
 * is at most 2*128*127 = 32512 < 32767 as long as the activations are never
 * -128 (quantize_q8 keeps them in [-127, 127]; a weight of -128 would even
 * be fine: its |w| is 128 as an unsigned byte).
 * madd by ones widens the pairs to int32; int32 sums are exact, so any order
 * and tiling gives the same bits.  y = (float)acc * wscale * xscale, in that
 * order, as the scalar set. */

GL_AVX2_INLINE __m256i avx2_mac_i8(__m256i acc, __m256i wabs, __m256i w, __m256i x, __m256i ones) {
    __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
}

/* The W8A8 tiles and matmul are written once in x86_q8.h and compiled once
 * per multiply-add: AVX2's maddubs + madd pair, and VNNI's one-instruction
 * vpdpbusd (u8 x s8, four products into each int32 lane), either as AVX-VNNI
 * (VEX: Alder Lake and later, Zen 5) or as AVX512-VNNI on 256-bit vectors
 * (EVEX: Ice Lake, Zen 4 and later).  vpdpbusd takes the weights offset
 * to unsigned (w + 128) and the activations as they are, and the tile
 * subtracts 128 times each token's sum (X86_Q8_OFFSET; see x86_q8.h).
 * vpdpbusd is written as asm: with the
 * intrinsics gcc 12 copies every accumulator to another register and back
 * each iteration (~20% slower prefill); {vex} asks for the AVX-VNNI encoding. */
#define X86_Q8(name) avx2_##name
#define X86_Q8_INLINE GL_AVX2_INLINE
#define X86_Q8_FN GL_AVX2
#define X86_Q8_MAC avx2_mac_i8
#define X86_Q8_NT 4
#define X86_Q8_OFFSET 0
#include "x86_q8.h"
#undef X86_Q8
#undef X86_Q8_INLINE
#undef X86_Q8_FN
#undef X86_Q8_MAC
#undef X86_Q8_NT
#undef X86_Q8_OFFSET

#define GL_VNNI_TARGET "avx2,fma,f16c,avxvnni"
#define GL_EVEX_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"

static inline __attribute__((always_inline, target(GL_VNNI_TARGET))) __m256i
vnni_mac_i8(__m256i acc, __m256i wu, __m256i w, __m256i x, __m256i ones) {
    (void)w; (void)ones;
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(wu), "x"(x));
    return acc;
}
#define X86_Q8(name) vnni_##name
#define X86_Q8_INLINE static inline __attribute__((always_inline, target(GL_VNNI_TARGET)))
#define X86_Q8_FN __attribute__((target(GL_VNNI_TARGET)))
#define X86_Q8_MAC vnni_mac_i8
#define X86_Q8_NT 4
#define X86_Q8_OFFSET 1
#include "x86_q8.h"
#undef X86_Q8
#undef X86_Q8_INLINE
#undef X86_Q8_FN
#undef X86_Q8_MAC
#undef X86_Q8_NT
#undef X86_Q8_OFFSET

static inline __attribute__((always_inline, target(GL_EVEX_TARGET))) __m256i
evex_mac_i8(__m256i acc, __m256i wu, __m256i w, __m256i x, __m256i ones) {
    (void)w; (void)ones;
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(wu), "v"(x));
    return acc;
}
#define X86_Q8(name) evex_##name
#define X86_Q8_INLINE static inline __attribute__((always_inline, target(GL_EVEX_TARGET)))
#define X86_Q8_FN __attribute__((target(GL_EVEX_TARGET)))
#define X86_Q8_MAC evex_mac_i8
#define X86_Q8_NT 8
#define X86_Q8_OFFSET 1
#include "x86_q8.h"
#undef X86_Q8
#undef X86_Q8_INLINE
#undef X86_Q8_FN
#undef X86_Q8_MAC
#undef X86_Q8_NT
#undef X86_Q8_OFFSET


/* Same values as scalar_quantize_q8: max|x| is exact in any order, x*inv is
 * one rounding, and cvtps rounds to nearest even like lrintf. */
static GL_AVX2 void avx2_quantize_q8(const float *x, int n, int cols, int ldx, int8_t *q, int ldq, float *scale) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo = _mm256_set1_epi8(-127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * ldx;
        int8_t *qr = q + (size_t)i * ldq;
        __m256 m = _mm256_setzero_ps();
        int c = 0;
        for (; c + 8 <= cols; c += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xr + c), absmask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float amax = _mm_cvtss_f32(m4);
        for (; c < cols; c++) { float a = fabsf(xr[c]); if (a > amax) amax = a; }
        float inv = amax > 0 ? 127.0f / amax : 0;
        const __m256 vinv = _mm256_set1_ps(inv);
        c = 0;
        for (; c + 32 <= cols; c += 32) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + c + 8), vinv));
            __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + c + 16), vinv));
            __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + c + 24), vinv));
            __m256i v = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(d, e));
            v = _mm256_permutevar8x32_epi32(v, order);   /* undo the per-lane interleave of packs */
            _mm256_storeu_si256((__m256i *)(qr + c), _mm256_max_epi8(v, lo));
        }
        for (; c < cols; c++) {
            long v = lrintf(xr[c] * inv);
            qr[c] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        scale[i] = amax / 127.0f;
    }
}

/* Four accumulators (c/8 mod 4), summed (a0+a1)+(a2+a3) then as above. */
static GL_AVX2 float avx2_dot(const float *a, const float *b, int n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int c = 0, k = 0;
    for (; c + 32 <= n; c += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8 * j), _mm256_loadu_ps(b + c + 8 * j), acc[j]);
    for (; c + 8 <= n; c += 8, k++) acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc[k]);
    if (c < n) {
        __m256i mask = avx2_tail_mask(n - c);
        acc[k] = _mm256_fmadd_ps(_mm256_maskload_ps(a + c, mask), _mm256_maskload_ps(b + c, mask), acc[k]);
    }
    return avx2_hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

static GL_AVX2 void avx2_axpy(float *y, const float *x, float a, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int c = 0;
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(y + c, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
    if (c < n) {
        __m256i mask = avx2_tail_mask(n - c);
        __m256 v = _mm256_fmadd_ps(va, _mm256_maskload_ps(x + c, mask), _mm256_maskload_ps(y + c, mask));
        _mm256_maskstore_ps(y + c, mask, v);
    }
}

/* m fused axpys over 32 columns at a time, y held in 4 registers */
static GL_AVX2 void avx2_axpy_rows(float *y, const float *x, int ldx, const float *a, int m, int n) {
    int c = 0;
    for (; c + 32 <= n; c += 32) {
        __m256 y0 = _mm256_loadu_ps(y + c), y1 = _mm256_loadu_ps(y + c + 8);
        __m256 y2 = _mm256_loadu_ps(y + c + 16), y3 = _mm256_loadu_ps(y + c + 24);
        for (int j = 0; j < m; j++) {
            const float *xr = x + (size_t)j * ldx + c;
            const __m256 va = _mm256_set1_ps(a[j]);
            y0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(xr), y0);
            y1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(xr + 8), y1);
            y2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(xr + 16), y2);
            y3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(xr + 24), y3);
        }
        _mm256_storeu_ps(y + c, y0); _mm256_storeu_ps(y + c + 8, y1);
        _mm256_storeu_ps(y + c + 16, y2); _mm256_storeu_ps(y + c + 24, y3);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 y0 = _mm256_loadu_ps(y + c);
        for (int j = 0; j < m; j++) y0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), _mm256_loadu_ps(x + (size_t)j * ldx + c), y0);
        _mm256_storeu_ps(y + c, y0);
    }
    if (c < n) {
        __m256i mask = avx2_tail_mask(n - c);
        __m256 y0 = _mm256_maskload_ps(y + c, mask);
        for (int j = 0; j < m; j++)
            y0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), _mm256_maskload_ps(x + (size_t)j * ldx + c, mask), y0);
        _mm256_maskstore_ps(y + c, mask, y0);
    }
}

/* Rows of fp32 or (bf16 = 1) of bf16 values, 8 elements from element i
 * (a bf16 value widens exactly: it is the top half of its fp32). */
GL_AVX2_INLINE __m256 avx2_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

GL_AVX2_INLINE __m256 avx2_row8(const void *x, size_t i, int bf16) {
    return bf16 ? avx2_bf16x8((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* One head's m fused axpys over rows given by pointers (row j at xr[j]),
 * columns [c0, n): 8 at a time, the tail as avx2_axpy_rows and
 * avx2_axpy_rows_bf16 take theirs (the same bits). */
GL_AVX2_INLINE void avx2_axpy_rowp(float *y, const void *const *xr, int c0, const float *a, int m, int n, int bf16) {
    int c = c0;
    for (; c + 8 <= n; c += 8) {
        __m256 y0 = _mm256_loadu_ps(y + c);
        for (int j = 0; j < m; j++) y0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), avx2_row8(xr[j], c, bf16), y0);
        _mm256_storeu_ps(y + c, y0);
    }
    if (c < n) {
        __m256i mask = avx2_tail_mask(n - c);
        __m256 y0 = _mm256_maskload_ps(y + c, mask);
        for (int j = 0; j < m; j++) {
            __m256 xv;
            if (bf16) {   /* widened through the stack (no 16-bit masked loads) */
                float t[8] = {0};
                for (int i = 0; i < n - c; i++) t[i] = gl_bf16_to_f32(((const uint16_t *)xr[j])[c + i]);
                xv = _mm256_loadu_ps(t);
            } else {
                xv = _mm256_maskload_ps((const float *)xr[j] + c, mask);
            }
            y0 = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), xv, y0);
        }
        _mm256_maskstore_ps(y + c, mask, y0);
    }
}

/* Four outputs at a time over 16 columns: each x vector loaded serves four
 * heads (the rows of a KV block stay in L1 once, not once per head).  Every
 * element is still y = fma(a_j, x_j, y) for j in order, as avx2_axpy_rows --
 * on fp32 rows, or on bf16 rows widened in registers (the same bits).  Rows
 * by pointer, so a chunk of keys spread over KV blocks is one call. */
GL_AVX2_INLINE void avx2_axpy_rowp_n_of(float *y, int ldy, const void *const *xr, const float *a, int lda, int nh,
                                        int m, int n, int bf16) {
    int h = 0;
    for (; h + 4 <= nh; h += 4) {
        float *y0 = y + (size_t)h * ldy, *y1 = y0 + ldy, *y2 = y1 + ldy, *y3 = y2 + ldy;
        const float *a0 = a + (size_t)h * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
        int c = 0;
        for (; c + 16 <= n; c += 16) {
            __m256 s00 = _mm256_loadu_ps(y0 + c), s01 = _mm256_loadu_ps(y0 + c + 8);
            __m256 s10 = _mm256_loadu_ps(y1 + c), s11 = _mm256_loadu_ps(y1 + c + 8);
            __m256 s20 = _mm256_loadu_ps(y2 + c), s21 = _mm256_loadu_ps(y2 + c + 8);
            __m256 s30 = _mm256_loadu_ps(y3 + c), s31 = _mm256_loadu_ps(y3 + c + 8);
            for (int j = 0; j < m; j++) {
                const __m256 x0 = avx2_row8(xr[j], c, bf16), x1 = avx2_row8(xr[j], c + 8, bf16);
                __m256 v = _mm256_set1_ps(a0[j]);
                s00 = _mm256_fmadd_ps(v, x0, s00); s01 = _mm256_fmadd_ps(v, x1, s01);
                v = _mm256_set1_ps(a1[j]);
                s10 = _mm256_fmadd_ps(v, x0, s10); s11 = _mm256_fmadd_ps(v, x1, s11);
                v = _mm256_set1_ps(a2[j]);
                s20 = _mm256_fmadd_ps(v, x0, s20); s21 = _mm256_fmadd_ps(v, x1, s21);
                v = _mm256_set1_ps(a3[j]);
                s30 = _mm256_fmadd_ps(v, x0, s30); s31 = _mm256_fmadd_ps(v, x1, s31);
            }
            _mm256_storeu_ps(y0 + c, s00); _mm256_storeu_ps(y0 + c + 8, s01);
            _mm256_storeu_ps(y1 + c, s10); _mm256_storeu_ps(y1 + c + 8, s11);
            _mm256_storeu_ps(y2 + c, s20); _mm256_storeu_ps(y2 + c + 8, s21);
            _mm256_storeu_ps(y3 + c, s30); _mm256_storeu_ps(y3 + c + 8, s31);
        }
        if (c < n)   /* the last columns, a head at a time */
            for (int k = 0; k < 4; k++) avx2_axpy_rowp(y + (size_t)(h + k) * ldy, xr, c, a + (size_t)(h + k) * lda, m, n, bf16);
    }
    for (; h < nh; h++) avx2_axpy_rowp(y + (size_t)h * ldy, xr, 0, a + (size_t)h * lda, m, n, bf16);
}

/* The same over rows at x + j * ldx, GL_ROWP_MAX rows a call (a sum is
 * stored and reloaded between them, exactly). */
GL_AVX2_INLINE void avx2_axpy_rows_n_of(float *y, int ldy, const void *x, int ldx, const float *a, int lda, int nh,
                                        int m, int n, int bf16) {
    const void *xr[GL_ROWP_MAX];
    const size_t es = bf16 ? 2 : 4;
    for (int j0 = 0; j0 < m; j0 += GL_ROWP_MAX) {
        const int mm = m - j0 < GL_ROWP_MAX ? m - j0 : GL_ROWP_MAX;
        for (int j = 0; j < mm; j++) xr[j] = (const char *)x + (size_t)(j0 + j) * ldx * es;
        avx2_axpy_rowp_n_of(y, ldy, xr, a + j0, lda, nh, mm, n, bf16);
    }
}

static GL_AVX2 void avx2_axpy_rows_n(float *y, int ldy, const float *x, int ldx, const float *a, int lda, int nh, int m,
                                     int n) {
    avx2_axpy_rows_n_of(y, ldy, x, ldx, a, lda, nh, m, n, 0);
}

static GL_AVX2 void avx2_axpy_rows_n_bf16(float *y, int ldy, const uint16_t *x, int ldx, const float *a, int lda,
                                          int nh, int m, int n) {
    avx2_axpy_rows_n_of(y, ldy, x, ldx, a, lda, nh, m, n, 1);
}

static GL_AVX2 void avx2_axpy_rowp_n(float *y, int ldy, const float *const *xr, const float *a, int lda, int nh, int m,
                                     int n) {
    avx2_axpy_rowp_n_of(y, ldy, (const void *const *)xr, a, lda, nh, m, n, 0);
}

static GL_AVX2 void avx2_axpy_rowp_n_bf16(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda,
                                          int nh, int m, int n) {
    avx2_axpy_rowp_n_of(y, ldy, (const void *const *)xr, a, lda, nh, m, n, 1);
}

/* e^x on 8 lanes (GL_EXP_* in ggml_like.c says how). */
GL_AVX2_INLINE __m256 avx2_exp(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(GL_EXP_LO), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(GL_EXP_HI)), _mm256_set1_ps(GL_EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(GL_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GL_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GL_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(GL_EXP_C7);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GL_EXP_C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GL_EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GL_EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GL_EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(GL_EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The exponentials summed in 8 lanes (added as avx2_hsum); the tail goes
 * through the same vector code padded with -inf, which gives 0. */
static GL_AVX2 float avx2_exp_sum(float *x, int n, float scale, float shift) {
    float buf[8];
    const __m256 vm = _mm256_set1_ps(shift), vs = _mm256_set1_ps(scale);
    __m256 sum = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 v = avx2_exp(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + c), vm)));
        _mm256_storeu_ps(x + c, v);
        sum = _mm256_add_ps(sum, v);
    }
    if (c < n) {
        for (int l = 0; l < 8; l++) buf[l] = c + l < n ? x[c + l] : -INFINITY;
        __m256 v = avx2_exp(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(buf), vm)));
        _mm256_storeu_ps(buf, v);
        sum = _mm256_add_ps(sum, v);
        for (int l = 0; c + l < n; l++) x[c + l] = buf[l];
    }
    return avx2_hsum(sum);
}

GL_AVX2_INLINE __m256 avx2_silu_mul8(__m256 a, __m256 b) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 d = _mm256_add_ps(one, avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), a)));
    return _mm256_mul_ps(_mm256_div_ps(a, d), b);
}

static GL_AVX2 void avx2_silu_mul(float *a, const float *b, int n) {
    int c = 0;
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(a + c, avx2_silu_mul8(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c)));
    if (c < n) {
        const __m256i mask = avx2_tail_mask(n - c);
        _mm256_maskstore_ps(a + c, mask, avx2_silu_mul8(_mm256_maskload_ps(a + c, mask), _mm256_maskload_ps(b + c, mask)));
    }
}

/* dot_rows_t (as a512_dot_rows_t): 8 lanes against 8 rows at a time,
 * each row element broadcast into its own accumulator, FMAs in c order. */
/* Accumulators [row][lane] stored to y transposed: lane l of row j to
 * y[l * ldy + j], for the first nl lanes.  They come by value: given an
 * array of them, gcc 12 kept all eight in memory for the whole loop (a
 * store and a reload around every FMA: a third of the speed). */
GL_AVX2_INLINE void avx2_store8_rows_t(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                       __m256 a7, float *y, int ldy, int nl) {
    float t[8][8];
    _mm256_storeu_ps(t[0], a0); _mm256_storeu_ps(t[1], a1); _mm256_storeu_ps(t[2], a2); _mm256_storeu_ps(t[3], a3);
    _mm256_storeu_ps(t[4], a4); _mm256_storeu_ps(t[5], a5); _mm256_storeu_ps(t[6], a6); _mm256_storeu_ps(t[7], a7);
    for (int l = 0; l < nl; l++)
        for (int j = 0; j < 8; j++) y[(size_t)l * ldy + j] = t[j][l];
}

#define AVX2_BC(p, o) _mm256_broadcast_ss((const float *)((const char *)(p) + (o)))
GL_AVX2_INLINE void avx2_dot8_rows(const float *qt, size_t ldq, __m256i mk, const float *x, size_t ldx, int n,
                                   float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(float), L3 = 3 * L;
    const char *p0 = (const char *)x, *p1 = p0 + 4 * L;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p0 += 4, p1 += 4) {
        const __m256 v = _mm256_maskload_ps(q, mk);
        a0 = _mm256_fmadd_ps(v, AVX2_BC(p0, 0), a0);     a1 = _mm256_fmadd_ps(v, AVX2_BC(p0, L), a1);
        a2 = _mm256_fmadd_ps(v, AVX2_BC(p0, 2 * L), a2); a3 = _mm256_fmadd_ps(v, AVX2_BC(p0, L3), a3);
        a4 = _mm256_fmadd_ps(v, AVX2_BC(p1, 0), a4);     a5 = _mm256_fmadd_ps(v, AVX2_BC(p1, L), a5);
        a6 = _mm256_fmadd_ps(v, AVX2_BC(p1, 2 * L), a6); a7 = _mm256_fmadd_ps(v, AVX2_BC(p1, L3), a7);
    }
    avx2_store8_rows_t(a0, a1, a2, a3, a4, a5, a6, a7, y, ldy, nl);
}
/* Rows' 16-lane accumulators (two vectors each, built after the loop)
 * stored transposed: lane l of row j to y[l * ldy + j]. */
GL_AVX2_INLINE void avx2_store16_rows_t(const __m256 acc[][2], int rows, float *y, int ldy) {
    float t[6][16];
    for (int j = 0; j < rows; j++) _mm256_storeu_ps(t[j], acc[j][0]), _mm256_storeu_ps(t[j] + 8, acc[j][1]);
    for (int l = 0; l < 16; l++)
        for (int j = 0; j < rows; j++) y[(size_t)l * ldy + j] = t[j][l];
}

/* Row element (p + o bytes) broadcast into the row's two 8-lane sums. */
#define AVX2_FMA2(s0, s1, p, o) do { const __m256 b_ = AVX2_BC(p, o); \
        s0 = _mm256_fmadd_ps(q0, b_, s0); s1 = _mm256_fmadd_ps(q1, b_, s1); } while (0)
/* 16 lanes (two vectors of qt) against 6 rows: each qt vector loaded
 * serves six rows and each broadcast two vectors -- 8 loads per 12 FMAs,
 * where 8 rows x one vector took 9 per 8 (load-bound: 72% of the FMA
 * peak). */
GL_AVX2_INLINE void avx2_dot16x6_rows(const float *qt, size_t ldq, const float *x, size_t ldx, int n, float *y,
                                      int ldy) {
    const size_t L = ldx * sizeof(float);
    const char *p0 = (const char *)x, *p1 = p0 + 3 * L;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p0 += 4, p1 += 4) {
        const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
        AVX2_FMA2(a00, a01, p0, 0); AVX2_FMA2(a10, a11, p0, L); AVX2_FMA2(a20, a21, p0, 2 * L);
        AVX2_FMA2(a30, a31, p1, 0); AVX2_FMA2(a40, a41, p1, L); AVX2_FMA2(a50, a51, p1, 2 * L);
    }
    const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    avx2_store16_rows_t(acc, 6, y, ldy);
}
/* The same for 4 rows (a block of 16 keys: 6 + 6 + 4). */
GL_AVX2_INLINE void avx2_dot16x4_rows(const float *qt, size_t ldq, const float *x, size_t ldx, int n, float *y,
                                      int ldy) {
    const size_t L = ldx * sizeof(float);
    const char *p = (const char *)x;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p += 4) {
        const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
        AVX2_FMA2(a00, a01, p, 0); AVX2_FMA2(a10, a11, p, L); AVX2_FMA2(a20, a21, p, 2 * L); AVX2_FMA2(a30, a31, p, 3 * L);
    }
    const __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    avx2_store16_rows_t(acc, 4, y, ldy);
}
#undef AVX2_FMA2
#undef AVX2_BC

GL_AVX2_INLINE void avx2_dot1_row(const float *qt, size_t ldq, __m256i mk, const float *x, int n, float *y, int ldy,
                                  int nl) {
    __m256 a0 = _mm256_setzero_ps();
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq) a0 = _mm256_fmadd_ps(_mm256_maskload_ps(q, mk), _mm256_set1_ps(x[c]), a0);
    float t[8];
    _mm256_storeu_ps(t, a0);
    for (int l = 0; l < nl; l++) y[(size_t)l * ldy] = t[l];
}

/* dot_rows_t over bf16 rows (as a512_dot_rows_t_bf16): a pair of elements
 * broadcast as one 32-bit value, element c by a shift and c + 1 by a mask. */
GL_AVX2_INLINE __m256i avx2_pair(const char *p) {
    int32_t d;
    memcpy(&d, p, 4);
    return _mm256_set1_epi32(d);
}
#define AVX2_LO(d) _mm256_castsi256_ps(_mm256_slli_epi32((d), 16))
#define AVX2_HI(d) _mm256_castsi256_ps(_mm256_and_si256((d), _mm256_set1_epi32((int32_t)0xffff0000u)))
#define AVX2_ONE(p, o) _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)((uint32_t)*(const uint16_t *)((const char *)(p) + (o)) << 16)))
#define AVX2_STEP2(a, p, o) do { const __m256i d_ = avx2_pair((const char *)(p) + (o)); \
        a = _mm256_fmadd_ps(v0, AVX2_LO(d_), a); a = _mm256_fmadd_ps(v1, AVX2_HI(d_), a); } while (0)
GL_AVX2_INLINE void avx2_dot8_rows_bf16(const float *qt, size_t ldq, __m256i mk, const uint16_t *x, size_t ldx, int n,
                                        float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(uint16_t), L3 = 3 * L;
    const char *p0 = (const char *)x, *p1 = p0 + 4 * L;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *q = qt;
    int c = 0;
    for (; c + 2 <= n; c += 2, q += 2 * ldq, p0 += 4, p1 += 4) {
        const __m256 v0 = _mm256_maskload_ps(q, mk), v1 = _mm256_maskload_ps(q + ldq, mk);
        AVX2_STEP2(a0, p0, 0); AVX2_STEP2(a1, p0, L); AVX2_STEP2(a2, p0, 2 * L); AVX2_STEP2(a3, p0, L3);
        AVX2_STEP2(a4, p1, 0); AVX2_STEP2(a5, p1, L); AVX2_STEP2(a6, p1, 2 * L); AVX2_STEP2(a7, p1, L3);
    }
    if (c < n) {
        const __m256 v = _mm256_maskload_ps(q, mk);
        a0 = _mm256_fmadd_ps(v, AVX2_ONE(p0, 0), a0);     a1 = _mm256_fmadd_ps(v, AVX2_ONE(p0, L), a1);
        a2 = _mm256_fmadd_ps(v, AVX2_ONE(p0, 2 * L), a2); a3 = _mm256_fmadd_ps(v, AVX2_ONE(p0, L3), a3);
        a4 = _mm256_fmadd_ps(v, AVX2_ONE(p1, 0), a4);     a5 = _mm256_fmadd_ps(v, AVX2_ONE(p1, L), a5);
        a6 = _mm256_fmadd_ps(v, AVX2_ONE(p1, 2 * L), a6); a7 = _mm256_fmadd_ps(v, AVX2_ONE(p1, L3), a7);
    }
    avx2_store8_rows_t(a0, a1, a2, a3, a4, a5, a6, a7, y, ldy, nl);
}

GL_AVX2_INLINE void avx2_dot1_row_bf16(const float *qt, size_t ldq, __m256i mk, const uint16_t *x, int n, float *y,
                                       int ldy, int nl) {
    __m256 a0 = _mm256_setzero_ps();
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq) a0 = _mm256_fmadd_ps(_mm256_maskload_ps(q, mk), AVX2_ONE(x + c, 0), a0);
    float t[8];
    _mm256_storeu_ps(t, a0);
    for (int l = 0; l < nl; l++) y[(size_t)l * ldy] = t[l];
}
#undef AVX2_STEP2
#undef AVX2_ONE
#undef AVX2_HI
#undef AVX2_LO

static GL_AVX2 void avx2_dot_rows_t_bf16(float *y, int ldy, const float *qt, int ldq, int nl, const uint16_t *x,
                                         int ldx, int m, int n) {
    for (int l0 = 0; l0 < nl; l0 += 8) {
        const int nw = nl - l0 < 8 ? nl - l0 : 8;
        const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(nw), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const float *q = qt + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 8 <= m; j += 8)
            avx2_dot8_rows_bf16(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j < m; j++) avx2_dot1_row_bf16(q, (size_t)ldq, mk, x + (size_t)j * ldx, n, yl + j, ldy, nw);
    }
}

static GL_AVX2 void avx2_dot_rows_t(float *y, int ldy, const float *qt, int ldq, int nl, const float *x, int ldx, int m,
                                    int n) {
    int l0 = 0;
    for (; l0 + 16 <= nl && m >= 4; l0 += 16) {   /* 16 lanes at a time, 6 or 4 rows at a time */
        const __m256i all = _mm256_set1_epi32(-1);
        int j = 0;
        for (; j + 6 <= m; j += 6)
            avx2_dot16x6_rows(qt + l0, (size_t)ldq, x + (size_t)j * ldx, (size_t)ldx, n, y + (size_t)l0 * ldy + j, ldy);
        for (; j + 4 <= m; j += 4)
            avx2_dot16x4_rows(qt + l0, (size_t)ldq, x + (size_t)j * ldx, (size_t)ldx, n, y + (size_t)l0 * ldy + j, ldy);
        for (; j < m; j++)
            for (int h = 0; h < 16; h += 8)
                avx2_dot1_row(qt + l0 + h, (size_t)ldq, all, x + (size_t)j * ldx, n, y + (size_t)(l0 + h) * ldy + j, ldy, 8);
    }
    for (; l0 < nl; l0 += 8) {
        const int nw = nl - l0 < 8 ? nl - l0 : 8;
        const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(nw), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const float *q = qt + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 8 <= m; j += 8) avx2_dot8_rows(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j < m; j++) avx2_dot1_row(q, (size_t)ldq, mk, x + (size_t)j * ldx, n, yl + j, ldy, nw);
    }
}

static const gl_kernels gl_avx2_kernels = {
    "avx2", avx2_matmul, avx2_matmul_q8, avx2_quantize_q8, avx2_dot, avx2_axpy, avx2_axpy_rows, avx2_axpy_rows_n,
    avx2_exp_sum, avx2_silu_mul, avx2_dot_rows_t, avx2_dot_rows_t_bf16, avx2_axpy_rows_n_bf16,
    avx2_axpy_rowp_n, avx2_axpy_rowp_n_bf16, scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};

/* The VNNI sets differ from AVX2 only in the W8A8 matmul. */
static const gl_kernels gl_avx_vnni_kernels = {
    "avx_vnni", avx2_matmul, vnni_matmul_q8, avx2_quantize_q8, avx2_dot, avx2_axpy, avx2_axpy_rows, avx2_axpy_rows_n,
    avx2_exp_sum, avx2_silu_mul, avx2_dot_rows_t, avx2_dot_rows_t_bf16, avx2_axpy_rows_n_bf16,
    avx2_axpy_rowp_n, avx2_axpy_rowp_n_bf16, scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};
static const gl_kernels gl_avx512_vnni_kernels = {
    "avx512_vnni", avx512_matmul, evex_matmul_q8, avx2_quantize_q8, avx2_dot, avx2_axpy, avx2_axpy_rows, avx2_axpy_rows_n,
    avx2_exp_sum, avx2_silu_mul, avx2_dot_rows_t, avx2_dot_rows_t_bf16, avx2_axpy_rows_n_bf16,
    avx2_axpy_rowp_n, avx2_axpy_rowp_n_bf16, scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};

/* bf16 (shifted into the top half) or f16 (F16C) to fp32, 8 at a time;
 * returns how many it did -- the caller widens the rest. */
static GL_AVX2 int avx2_widen16(int type, const uint16_t *p, float *out, int n) {
    int c = 0;
    if (type == GL_BF16)
        for (; c + 8 <= n; c += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + c)));
            _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
    else
        for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + c))));
    return c;
}

/* ---- CPU features ---- */
#include <cpuid.h>

enum { GL_X86_AVX2 = 1, GL_X86_AVX512 = 2, GL_X86_AVX_VNNI = 4, GL_X86_AVX512_BF16 = 8 };

static uint64_t gl_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* Bits of GL_X86_*: instruction sets both the CPU and the OS (saved
 * register state, XCR0) support. */
static int gl_x86_features(void) {
    unsigned a, b, c, d;
    int f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return 0;
    uint64_t xcr0 = gl_xgetbv0();
    if ((xcr0 & 6) != 6) return 0;                       /* XMM and YMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (((b >> 5) & 1) && fma && f16c) f |= GL_X86_AVX2;
    int avx512 = ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1); /* F BW VL VNNI */
    if ((f & GL_X86_AVX2) && avx512 && (xcr0 & 0xe6) == 0xe6) f |= GL_X86_AVX512;   /* + opmask, ZMM state */
    if ((f & GL_X86_AVX2) && a >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) {
        if ((a >> 4) & 1) f |= GL_X86_AVX_VNNI;
        if ((f & GL_X86_AVX512) && ((a >> 5) & 1)) f |= GL_X86_AVX512_BF16;
    }
    return f;
}

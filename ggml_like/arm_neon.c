/* arm_neon.c -- AArch64 NEON kernels, and W8A8 with the dot-product
 * extension (SDOT, Armv8.2 "dotprod") where the CPU has it.
 *
 * Included from ggml_like.c.  NEON is part of every AArch64 CPU; SDOT is
 * emitted only in neon_matmul_q8_dot, which gl_kernels_get offers only when
 * the kernel reports HWCAP_ASIMDDP.
 *
 * Reduction order of one fp dot product, the same in every path whatever
 * the tile (batch invariance): 8 lanes held in two float32x4 (lanes 0-3 and
 * 4-7), lane l takes w[c]*x[c] for c = l (mod 8) by fused multiply-add in
 * increasing c; the last cols%8 columns form one zero-padded block; the lanes
 * are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the scalar set's
 * order.  Weights are widened to fp32 exactly (fp8 times its block scale,
 * rounded once), the values gl_row_to_f32 gives.
 *
 * Tiles: 2 weight rows x 4 tokens (16 of the 32 vector registers hold
 * accumulators); tokens in blocks whose activations stay in L2, as on x86. */
#include <arm_neon.h>

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#define NEON_NR 2
#define NEON_NT 4
#define GL_NEON_INLINE static inline __attribute__((always_inline))

typedef struct { float32x4_t lo, hi; } neon_f8x;   /* 8 fp32 lanes */

GL_NEON_INLINE float neon_hsum(neon_f8x v) {
    float32x4_t s = vaddq_f32(v.lo, v.hi);                          /* l0+l4 .. l3+l7 */
    float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));    /* s0+s2, s1+s3   */
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

GL_NEON_INLINE neon_f8x neon_fma(neon_f8x acc, neon_f8x w, neon_f8x x) {
    acc.lo = vfmaq_f32(acc.lo, w.lo, x.lo);
    acc.hi = vfmaq_f32(acc.hi, w.hi, x.hi);
    return acc;
}

GL_NEON_INLINE neon_f8x neon_zero(void) {
    neon_f8x z = {vdupq_n_f32(0), vdupq_n_f32(0)};
    return z;
}

GL_NEON_INLINE neon_f8x neon_load_x(const float *p) {
    neon_f8x v = {vld1q_f32(p), vld1q_f32(p + 4)};
    return v;
}

/* 8 weights of a stored type as fp32.  fp8 e4m3 goes through fp16: the bits
 * s.eeee.mmm placed as s.0eeee.mmm0000000 are an fp16 of value v/256
 * (subnormals included), so `scale` holds the block scale times 256.  (The
 * e4m3 NaN code reads as 480, as in the x86 sets.) */
GL_NEON_INLINE neon_f8x neon_load_w(int type, const uint8_t *p, float32x4_t scale) {
    neon_f8x v;
    switch (type) {
    case GL_F32:
        v.lo = vld1q_f32((const float *)p);
        v.hi = vld1q_f32((const float *)p + 4);
        break;
    case GL_F16: {
        uint16x8_t h = vld1q_u16((const uint16_t *)p);
        v.lo = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
        v.hi = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
        break;
    }
    case GL_BF16: {
        uint16x8_t h = vld1q_u16((const uint16_t *)p);
        v.lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        v.hi = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16));
        break;
    }
    default: {   /* GL_F8_E4M3 */
        int16x8_t b = vmovl_s8(vld1_s8((const int8_t *)p));
        uint16x8_t h = vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(b, 7)), vdupq_n_u16(0xbf80));
        v.lo = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))), scale);
        v.hi = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))), scale);
        break;
    }
    }
    return v;
}

/* y[t*ldy + r+k] = W[r+k] . x[t*ldx] for k < nr, t < nt (constants after
 * inlining).  pf: where to prefetch, at the pace this panel is read. */
GL_NEON_INLINE void neon_tile(int type, const gl_mat *w, int r, int nr,
                              const float *x, int ldx, int nt, float *y, int ldy, const uint8_t *pf) {
    const int cols = w->cols, full = cols & ~7;
    const size_t es = gl_type_size(type);
    const int bcols = (cols + GL_F8_BLOCK - 1) / GL_F8_BLOCK;
    const uint8_t *wr[NEON_NR];
    const float *wsc[NEON_NR];
    neon_f8x acc[NEON_NR][NEON_NT], wv[NEON_NR];
    float32x4_t s[NEON_NR];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        wr[k] = (const uint8_t *)w->data + (size_t)(r + k) * (size_t)cols * es;
        wsc[k] = type == GL_F8_E4M3 ? w->scale + (size_t)((r + k) / GL_F8_BLOCK) * (size_t)bcols : NULL;
        s[k] = vdupq_n_f32(0);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[k][t] = neon_zero();
    }
    for (int cb = 0; cb < cols; cb += GL_F8_BLOCK) {
        if (type == GL_F8_E4M3) {
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) s[k] = vdupq_n_f32(wsc[k][cb / GL_F8_BLOCK] * 256.0f);
        }
        int ce = cb + GL_F8_BLOCK < full ? cb + GL_F8_BLOCK : full;
        for (int c = cb; c < ce; c += 8) {
            __builtin_prefetch(pf + (size_t)c * (size_t)nr * es, 0, 0);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) wv[k] = neon_load_w(type, wr[k] + (size_t)c * es, s[k]);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                neon_f8x xv = neon_load_x(x + (size_t)t * ldx + c);
#pragma GCC unroll 4
                for (int k = 0; k < nr; k++) acc[k][t] = neon_fma(acc[k][t], wv[k], xv);
            }
        }
    }
    if (full < cols) {   /* the zero-padded last block; s[] holds its scale */
        const int rem = cols - full;
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            uint8_t buf[32] = {0};
            memcpy(buf, wr[k] + (size_t)full * es, (size_t)rem * es);
            wv[k] = neon_load_w(type, buf, s[k]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            float buf[8] = {0};
            memcpy(buf, x + (size_t)t * ldx + full, (size_t)rem * sizeof(float));
            neon_f8x xv = neon_load_x(buf);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = neon_fma(acc[k][t], wv[k], xv);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) y[(size_t)t * ldy + r + k] = neon_hsum(acc[k][t]);
}

/* Prefetch distance, in panels (see x86_avx2.c). */
#define NEON_PF_PANELS 2

GL_NEON_INLINE void neon_tiles(int type, const gl_mat *w, int r, int nr, int r1,
                               const float *x, int n, int ldx, float *y, int ldy) {
    const size_t row_bytes = (size_t)w->cols * gl_type_size(type);
    const uint8_t *panel = (const uint8_t *)w->data + (size_t)r * row_bytes;
    const uint8_t *pf = r + (NEON_PF_PANELS + 1) * nr <= r1 ? panel + NEON_PF_PANELS * (size_t)nr * row_bytes : panel;
    int i = 0;
    for (; i + NEON_NT <= n; i += NEON_NT, pf = panel)
        neon_tile(type, w, r, nr, x + (size_t)i * ldx, ldx, NEON_NT, y + (size_t)i * ldy, ldy, pf);
    const float *xi = x + (size_t)i * ldx;
    float *yi = y + (size_t)i * ldy;
    switch (n - i) {
    case 1: neon_tile(type, w, r, nr, xi, ldx, 1, yi, ldy, pf); break;
    case 2: neon_tile(type, w, r, nr, xi, ldx, 2, yi, ldy, pf); break;
    case 3: neon_tile(type, w, r, nr, xi, ldx, 3, yi, ldy, pf); break;
    }
}

/* Tokens per block: their activations (fp32 or int8) stay within ~256 KB. */
static int neon_token_block(int cols, int elem_size) {
    int nb = (int)(262144 / ((size_t)(cols > 0 ? cols : 1) * (size_t)elem_size));
    nb &= ~(NEON_NT - 1);
    return nb < NEON_NT ? NEON_NT : nb;
}

GL_NEON_INLINE void neon_matmul_typed(int type, const gl_mat *w, const float *x, int n, int ldx,
                                      float *y, int ldy, int r0, int r1) {
    const int nb = neon_token_block(w->cols, 4);
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        const float *xb = x + (size_t)i0 * ldx;
        float *yb = y + (size_t)i0 * ldy;
        int r = r0;
        for (; r + NEON_NR <= r1; r += NEON_NR) neon_tiles(type, w, r, NEON_NR, r1, xb, ni, ldx, yb, ldy);
        for (; r < r1; r++) neon_tiles(type, w, r, 1, r1, xb, ni, ldx, yb, ldy);
    }
}

static void neon_matmul_f32(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    neon_matmul_typed(GL_F32, w, x, n, ldx, y, ldy, r0, r1);
}
static void neon_matmul_f16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    neon_matmul_typed(GL_F16, w, x, n, ldx, y, ldy, r0, r1);
}
static void neon_matmul_bf16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    neon_matmul_typed(GL_BF16, w, x, n, ldx, y, ldy, r0, r1);
}
static void neon_matmul_f8(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    neon_matmul_typed(GL_F8_E4M3, w, x, n, ldx, y, ldy, r0, r1);
}

static void neon_matmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    switch (w->type) {
    case GL_F32:     neon_matmul_f32(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F16:     neon_matmul_f16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_BF16:    neon_matmul_bf16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F8_E4M3: neon_matmul_f8(w, x, n, ldx, y, ldy, r0, r1); break;
    default:
        if (gl_type_is_block(w->type)) neon_qmatmul(w, x, n, ldx, y, ldy, r0, r1);   /* quants.c */
        else scalar_matmul(w, x, n, ldx, y, ldy, r0, r1);
        break;
    }
}

/* ---- W8A8 ----
 * int32 sums are exact, so tiling and order do not matter; arm_neon_q8.h
 * describes the tiles over GL_Q8's panels, written once and compiled twice.
 * y = (float)acc * wscale * xscale, in that order, as the scalar set. */

/* A token's group j (its 4 bytes) in every lane. */
#define NEON_LANE4(x, j) vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), j))

/* Plain NEON: a weight vector holds rows 0-1 of its 4 in the low 8 bytes,
 * rows 2-3 in the high.  Two groups' products add in int16 (a pair is at most
 * 2*128*127 = 32512: no overflow, as the activations are never -128), then
 * pairwise into int32, so lo's lanes are row 0's two halves and row 1's, hi's
 * the same for rows 2-3; one vpaddq_s32 at the end gives the 4 rows' sums. */
typedef struct { int32x4_t lo, hi; } neon_acc_q8;

GL_NEON_INLINE neon_acc_q8 neon_mac_q8(neon_acc_q8 a, int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
    int16x8_t lo = vmlal_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), vget_low_s8(w1), vget_low_s8(x1));
    int16x8_t hi = vmlal_high_s8(vmull_high_s8(w0, x0), w1, x1);
    a.lo = vpadalq_s16(a.lo, lo);
    a.hi = vpadalq_s16(a.hi, hi);
    return a;
}

#define NEON_Q8(name) name##_plain
#define NEON_Q8_TARGET
#define NEON_Q8_ACC neon_acc_q8
#define NEON_Q8_ZERO ((neon_acc_q8){vdupq_n_s32(0), vdupq_n_s32(0)})
#define NEON_Q8_SUM(a) vpaddq_s32((a).lo, (a).hi)
#define NEON_Q8_MAC(a, w0, w1, x, j, k) neon_mac_q8(a, w0, w1, NEON_LANE4(x, j), NEON_LANE4(x, k))
#define NEON_Q8_NQ 2   /* half a panel x 2 tokens, 2 registers each (a whole panel spilled) */
#define NEON_Q8_NT 2
#include "arm_neon_q8.h"

/* SDOT: 4 products into each int32 lane, by element (lane j of x), so the
 * accumulator is the 4 rows' sums.  The intrinsic may only be inlined into
 * functions compiled for dotprod, so the whole chain carries the attribute. */
#if defined(__clang__)
#define NEON_Q8_TARGET __attribute__((target("dotprod")))
#else
#define NEON_Q8_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#if defined(__clang__) && !defined(__ARM_FEATURE_DOTPROD)
/* older clang declares vdotq_laneq_s32 only when the whole file targets dotprod */
#define NEON_SDOT_LANE(j)                                                                             \
    GL_NEON_INLINE NEON_Q8_TARGET int32x4_t neon_sdot_##j(int32x4_t acc, int8x16_t w, int8x16_t x) { \
        __asm__("sdot %0.4s, %1.16b, %2.4b[" #j "]" : "+w"(acc) : "w"(w), "w"(x));                 \
        return acc;                                                                                  \
    }
NEON_SDOT_LANE(0) NEON_SDOT_LANE(1) NEON_SDOT_LANE(2) NEON_SDOT_LANE(3)
#undef NEON_SDOT_LANE
#define NEON_Q8_MAC(a, w0, w1, x, j, k) neon_sdot_##k(neon_sdot_##j(a, w0, x), w1, x)
#else
#define NEON_Q8_MAC(a, w0, w1, x, j, k) vdotq_laneq_s32(vdotq_laneq_s32(a, w0, x, j), w1, x, k)
#endif
#define NEON_Q8(name) name##_dot
#define NEON_Q8_ACC int32x4_t
#define NEON_Q8_ZERO vdupq_n_s32(0)
#define NEON_Q8_SUM(a) (a)
#define NEON_Q8_NQ 4   /* a whole panel x 4 tokens */
#define NEON_Q8_NT 4
#include "arm_neon_q8.h"

/* Same values as scalar_quantize_q8: max|x| is exact in any order, x*inv is
 * one rounding, and vcvtn rounds to nearest even like lrintf (default mode). */
static void neon_quantize_q8(const float *x, int n, int cols, int ldx, int8_t *q, int ldq, float *scale) {
    const int8x8_t lo = vdup_n_s8(-127);
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * ldx;
        int8_t *qr = q + (size_t)i * ldq;
        float32x4_t m = vdupq_n_f32(0);
        int c = 0;
        for (; c + 4 <= cols; c += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(xr + c)));
        float amax = vmaxvq_f32(m);
        for (; c < cols; c++) { float a = fabsf(xr[c]); if (a > amax) amax = a; }
        float inv = amax > 0 ? 127.0f / amax : 0;
        const float32x4_t vinv = vdupq_n_f32(inv);
        c = 0;
        for (; c + 8 <= cols; c += 8) {
            int32x4_t a = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xr + c), vinv));
            int32x4_t b = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xr + c + 4), vinv));
            int8x8_t v = vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b)));
            vst1_s8(qr + c, vmax_s8(v, lo));
        }
        for (; c < cols; c++) {
            long v = lrintf(xr[c] * inv);
            qr[c] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        scale[i] = amax / 127.0f;
    }
}

/* Four 8-lane accumulators (c/8 mod 4), summed (a0+a1)+(a2+a3), then as above. */
static float neon_dot(const float *a, const float *b, int n) {
    neon_f8x acc[4] = {neon_zero(), neon_zero(), neon_zero(), neon_zero()};
    int c = 0, k = 0;
    for (; c + 32 <= n; c += 32)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[j] = neon_fma(acc[j], neon_load_x(a + c + 8 * j), neon_load_x(b + c + 8 * j));
    for (; c + 8 <= n; c += 8, k++) acc[k] = neon_fma(acc[k], neon_load_x(a + c), neon_load_x(b + c));
    if (c < n) {
        float ba[8] = {0}, bb[8] = {0};
        memcpy(ba, a + c, (size_t)(n - c) * sizeof(float));
        memcpy(bb, b + c, (size_t)(n - c) * sizeof(float));
        acc[k] = neon_fma(acc[k], neon_load_x(ba), neon_load_x(bb));
    }
    neon_f8x s;
    s.lo = vaddq_f32(vaddq_f32(acc[0].lo, acc[1].lo), vaddq_f32(acc[2].lo, acc[3].lo));
    s.hi = vaddq_f32(vaddq_f32(acc[0].hi, acc[1].hi), vaddq_f32(acc[2].hi, acc[3].hi));
    return neon_hsum(s);
}

static void neon_axpy(float *y, const float *x, float a, int n) {
    int c = 0;
    for (; c + 4 <= n; c += 4) vst1q_f32(y + c, vfmaq_n_f32(vld1q_f32(y + c), vld1q_f32(x + c), a));
    for (; c < n; c++) y[c] = fmaf(a, x[c], y[c]);   /* fused, as the vector lanes */
}

/* m fused axpys over 16 columns at a time, y held in 4 registers */
/* Rows of fp32 or (bf16 = 1) of bf16 values: 4 elements, or one, from
 * element i (a bf16 value widens exactly, by vshll: the top half of its
 * fp32).  The axpys read either, with the same FMAs, so the bf16 form gives
 * the bits of the fp32 one on the widened rows, at half the bytes. */
GL_NEON_INLINE float32x4_t neon_row4(const void *x, size_t i, int bf16) {
    return bf16 ? vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)x + i), 16)) : vld1q_f32((const float *)x + i);
}

GL_NEON_INLINE float neon_row1(const void *x, size_t i, int bf16) {
    return bf16 ? gl_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* One head's m fused axpys over rows given by pointers (row j at xr[j]),
 * 16 columns at a time, then 4, then one. */
GL_NEON_INLINE void neon_axpy_rowp_of(float *y, const void *const *xr, const float *a, int m, int n, int bf16) {
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        float32x4_t y0 = vld1q_f32(y + c), y1 = vld1q_f32(y + c + 4), y2 = vld1q_f32(y + c + 8), y3 = vld1q_f32(y + c + 12);
        for (int j = 0; j < m; j++) {
            const void *row = xr[j];
            y0 = vfmaq_n_f32(y0, neon_row4(row, c, bf16), a[j]);
            y1 = vfmaq_n_f32(y1, neon_row4(row, c + 4, bf16), a[j]);
            y2 = vfmaq_n_f32(y2, neon_row4(row, c + 8, bf16), a[j]);
            y3 = vfmaq_n_f32(y3, neon_row4(row, c + 12, bf16), a[j]);
        }
        vst1q_f32(y + c, y0); vst1q_f32(y + c + 4, y1); vst1q_f32(y + c + 8, y2); vst1q_f32(y + c + 12, y3);
    }
    for (; c + 4 <= n; c += 4) {
        float32x4_t y0 = vld1q_f32(y + c);
        for (int j = 0; j < m; j++) y0 = vfmaq_n_f32(y0, neon_row4(xr[j], c, bf16), a[j]);
        vst1q_f32(y + c, y0);
    }
    for (; c < n; c++) {
        float acc = y[c];
        for (int j = 0; j < m; j++) acc = fmaf(a[j], neon_row1(xr[j], c, bf16), acc);
        y[c] = acc;
    }
}

/* The same over rows at x + j * ldx, GL_ROWP_MAX rows a call (a sum is
 * stored and reloaded between them, exactly). */
GL_NEON_INLINE void neon_axpy_rows_of(float *y, const void *x, int ldx, const float *a, int m, int n, int bf16) {
    const void *xr[GL_ROWP_MAX];
    const size_t es = bf16 ? 2 : 4;
    for (int j0 = 0; j0 < m; j0 += GL_ROWP_MAX) {
        const int mm = m - j0 < GL_ROWP_MAX ? m - j0 : GL_ROWP_MAX;
        for (int j = 0; j < mm; j++) xr[j] = (const char *)x + (size_t)(j0 + j) * ldx * es;
        neon_axpy_rowp_of(y, xr, a + j0, mm, n, bf16);
    }
}

static void neon_axpy_rows(float *y, const float *x, int ldx, const float *a, int m, int n) {
    neon_axpy_rows_of(y, x, ldx, a, m, n, 0);
}

static void neon_axpy_rows_n(float *y, int ldy, const float *x, int ldx, const float *a, int lda, int nh, int m, int n) {
    for (int h = 0; h < nh; h++) neon_axpy_rows_of(y + (size_t)h * ldy, x, ldx, a + (size_t)h * lda, m, n, 0);
}

static void neon_axpy_rows_n_bf16(float *y, int ldy, const uint16_t *x, int ldx, const float *a, int lda, int nh, int m,
                                  int n) {
    for (int h = 0; h < nh; h++) neon_axpy_rows_of(y + (size_t)h * ldy, x, ldx, a + (size_t)h * lda, m, n, 1);
}

static void neon_axpy_rowp_n(float *y, int ldy, const float *const *xr, const float *a, int lda, int nh, int m, int n) {
    for (int h = 0; h < nh; h++) neon_axpy_rowp_of(y + (size_t)h * ldy, (const void *const *)xr, a + (size_t)h * lda, m, n, 0);
}

static void neon_axpy_rowp_n_bf16(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda, int nh, int m,
                                  int n) {
    for (int h = 0; h < nh; h++) neon_axpy_rowp_of(y + (size_t)h * ldy, (const void *const *)xr, a + (size_t)h * lda, m, n, 1);
}

/* e^x on 4 lanes (GL_EXP_* in ggml_like.c says how). */
GL_NEON_INLINE float32x4_t neon_exp(float32x4_t x) {
    const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(GL_EXP_LO));
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(GL_EXP_HI)), vdupq_n_f32(GL_EXP_LO));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(GL_EXP_LOG2E)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(GL_EXP_LN2_HI));
    r = vfmsq_f32(r, n, vdupq_n_f32(GL_EXP_LN2_LO));
    float32x4_t p = vdupq_n_f32(GL_EXP_C7);
    p = vfmaq_f32(vdupq_n_f32(GL_EXP_C6), p, r);
    p = vfmaq_f32(vdupq_n_f32(GL_EXP_C5), p, r);
    p = vfmaq_f32(vdupq_n_f32(GL_EXP_C4), p, r);
    p = vfmaq_f32(vdupq_n_f32(GL_EXP_C3), p, r);
    p = vfmaq_f32(vdupq_n_f32(GL_EXP_C2), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    p = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(p), under));
}

/* As the AVX2 exp_sum, in 4 lanes; the tail padded with -inf. */
static float neon_exp_sum(float *x, int n, float scale, float shift) {
    float buf[4];
    const float32x4_t vm = vdupq_n_f32(shift), vs = vdupq_n_f32(scale);
    float32x4_t sum = vdupq_n_f32(0);
    int c = 0;
    for (; c + 4 <= n; c += 4) {
        float32x4_t v = neon_exp(vmulq_f32(vs, vsubq_f32(vld1q_f32(x + c), vm)));
        vst1q_f32(x + c, v);
        sum = vaddq_f32(sum, v);
    }
    if (c < n) {
        for (int l = 0; l < 4; l++) buf[l] = c + l < n ? x[c + l] : -INFINITY;
        float32x4_t v = neon_exp(vmulq_f32(vs, vsubq_f32(vld1q_f32(buf), vm)));
        vst1q_f32(buf, v);
        sum = vaddq_f32(sum, v);
        for (int l = 0; c + l < n; l++) x[c + l] = buf[l];
    }
    float32x2_t t = vadd_f32(vget_low_f32(sum), vget_high_f32(sum));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

static void neon_silu_mul(float *a, const float *b, int n) {
    int c = 0;
    for (; c + 4 <= n; c += 4) {
        float32x4_t v = vld1q_f32(a + c);
        float32x4_t d = vaddq_f32(vdupq_n_f32(1.0f), neon_exp(vnegq_f32(v)));
        vst1q_f32(a + c, vmulq_f32(vdivq_f32(v, d), vld1q_f32(b + c)));
    }
    if (c < n) {
        float ba[4] = {0}, bb[4] = {0};
        memcpy(ba, a + c, (size_t)(n - c) * sizeof(float));
        memcpy(bb, b + c, (size_t)(n - c) * sizeof(float));
        neon_silu_mul(ba, bb, 4);
        memcpy(a + c, ba, (size_t)(n - c) * sizeof(float));
    }
}

/* dot_rows_t (as a512_dot_rows_t): 4 lanes against 8 rows at a time, each
 * row element multiplied into its own accumulator, FMAs in c order; the
 * last nl % 4 lanes by fmaf, the same chain.  Rows of fp32, or (bf16 = 1,
 * dot_rows_t_bf16) of bf16 widened as they are read: the same bits. */
GL_NEON_INLINE void neon_dot8_rows_of(const float *qt, size_t ldq, const void *x, size_t ldx, int n, float *y, int ldy,
                                      int bf16) {
    const size_t L = ldx;
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *q = qt;
    for (size_t c = 0; c < (size_t)n; c++, q += ldq) {
        const float32x4_t v = vld1q_f32(q);
        const size_t i0 = c, i1 = c + 4 * L;
        a0 = vfmaq_n_f32(a0, v, neon_row1(x, i0, bf16));         a1 = vfmaq_n_f32(a1, v, neon_row1(x, i0 + L, bf16));
        a2 = vfmaq_n_f32(a2, v, neon_row1(x, i0 + 2 * L, bf16)); a3 = vfmaq_n_f32(a3, v, neon_row1(x, i0 + 3 * L, bf16));
        a4 = vfmaq_n_f32(a4, v, neon_row1(x, i1, bf16));         a5 = vfmaq_n_f32(a5, v, neon_row1(x, i1 + L, bf16));
        a6 = vfmaq_n_f32(a6, v, neon_row1(x, i1 + 2 * L, bf16)); a7 = vfmaq_n_f32(a7, v, neon_row1(x, i1 + 3 * L, bf16));
    }
    float t[8][4];   /* [row][lane] */
    vst1q_f32(t[0], a0); vst1q_f32(t[1], a1); vst1q_f32(t[2], a2); vst1q_f32(t[3], a3);
    vst1q_f32(t[4], a4); vst1q_f32(t[5], a5); vst1q_f32(t[6], a6); vst1q_f32(t[7], a7);
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < 8; j++) y[(size_t)l * ldy + j] = t[j][l];
}

GL_NEON_INLINE void neon_dot_rows_t_of(float *y, int ldy, const float *qt, int ldq, int nl, const void *x, int ldx, int m,
                                       int n, int bf16) {
    int l0 = 0;
    for (; l0 + 4 <= nl; l0 += 4) {
        const float *q = qt + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 8 <= m; j += 8) neon_dot8_rows_of(q, (size_t)ldq, (const char *)x + (size_t)j * ldx * (bf16 ? 2 : 4),
                                                     (size_t)ldx, n, yl + j, ldy, bf16);
        for (; j < m; j++) {
            float32x4_t a0 = vdupq_n_f32(0);
            for (int c = 0; c < n; c++)
                a0 = vfmaq_n_f32(a0, vld1q_f32(q + (size_t)c * ldq), neon_row1(x, (size_t)j * ldx + c, bf16));
            float t[4];
            vst1q_f32(t, a0);
            for (int l = 0; l < 4; l++) yl[(size_t)l * ldy + j] = t[l];
        }
    }
    for (; l0 < nl; l0++)
        for (int j = 0; j < m; j++) {
            float acc = 0;
            for (int c = 0; c < n; c++) acc = fmaf(qt[(size_t)c * ldq + l0], neon_row1(x, (size_t)j * ldx + c, bf16), acc);
            y[(size_t)l0 * ldy + j] = acc;
        }
}

static void neon_dot_rows_t(float *y, int ldy, const float *qt, int ldq, int nl, const float *x, int ldx, int m, int n) {
    neon_dot_rows_t_of(y, ldy, qt, ldq, nl, x, ldx, m, n, 0);
}

static void neon_dot_rows_t_bf16(float *y, int ldy, const float *qt, int ldq, int nl, const uint16_t *x, int ldx, int m,
                                 int n) {
    neon_dot_rows_t_of(y, ldy, qt, ldq, nl, x, ldx, m, n, 1);
}

static const gl_kernels gl_neon_kernels = {
    "neon", neon_matmul, neon_matmul_q8_plain, neon_quantize_q8, neon_dot, neon_axpy, neon_axpy_rows,
    neon_axpy_rows_n, neon_exp_sum, neon_silu_mul, neon_dot_rows_t, neon_dot_rows_t_bf16, neon_axpy_rows_n_bf16,
    neon_axpy_rowp_n, neon_axpy_rowp_n_bf16,
    scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};
static const gl_kernels gl_neon_dot_kernels = {
    "neon_dotprod", neon_matmul, neon_matmul_q8_dot, neon_quantize_q8, neon_dot, neon_axpy, neon_axpy_rows,
    neon_axpy_rows_n, neon_exp_sum, neon_silu_mul, neon_dot_rows_t, neon_dot_rows_t_bf16, neon_axpy_rows_n_bf16,
    neon_axpy_rowp_n, neon_axpy_rowp_n_bf16,
    scalar_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};

/* ---- CPU features ---- */

enum { GL_ARM_DOTPROD = 1 };

static int gl_arm_features(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) ? GL_ARM_DOTPROD : 0;
#elif defined(__APPLE__)
    int v = 0;
    size_t len = sizeof v;
    if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &len, NULL, 0) == 0 && v) return GL_ARM_DOTPROD;
    return 0;
#else
    return 0;
#endif
}

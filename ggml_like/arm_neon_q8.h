/* arm_neon_q8.h -- the NEON W8A8 matmul, included twice by arm_neon.c:
 * NEON_Q8(name) names this copy's functions, NEON_Q8_TARGET is its target
 * attribute (empty, or dotprod) and NEON_Q8_MAC(acc, w, x) adds the 16
 * products w*x into the 4 int32 lanes of acc. */

NEON_Q8_TARGET GL_NEON_INLINE void NEON_Q8(neon_tile_q8)(const gl_mat *w, int r, int nr, const int8_t *xq,
                                                         const float *xs, int ldx, int nt, float *y, int ldy,
                                                         const int8_t *pf) {
    const int cols = w->cols, full = cols & ~15;
    const int8_t *wr[NEON_NR];
    int32x4_t acc[NEON_NR][NEON_NT];
    int8x16_t wv[NEON_NR];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        wr[k] = (const int8_t *)w->data + (size_t)(r + k) * (size_t)cols;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[k][t] = vdupq_n_s32(0);
    }
    for (int c = 0; c < full; c += 16) {
        __builtin_prefetch(pf + (size_t)c * nr, 0, 0);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = vld1q_s8(wr[k] + c);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            int8x16_t xv = vld1q_s8(xq + (size_t)t * ldx + c);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = NEON_Q8_MAC(acc[k][t], wv[k], xv);
        }
    }
    if (full < cols) {   /* zero padding adds nothing to an exact sum */
        const size_t rem = (size_t)(cols - full);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            int8_t buf[16] = {0};
            memcpy(buf, wr[k] + full, rem);
            wv[k] = vld1q_s8(buf);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            int8_t buf[16] = {0};
            memcpy(buf, xq + (size_t)t * ldx + full, rem);
            int8x16_t xv = vld1q_s8(buf);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = NEON_Q8_MAC(acc[k][t], wv[k], xv);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++)
            y[(size_t)t * ldy + r + k] = (float)vaddvq_s32(acc[k][t]) * w->scale[r + k] * xs[t];
}

NEON_Q8_TARGET GL_NEON_INLINE void NEON_Q8(neon_tiles_q8)(const gl_mat *w, int r, int nr, int r1, const int8_t *xq,
                                                          const float *xs, int n, int ldx, float *y, int ldy) {
    const int8_t *panel = (const int8_t *)w->data + (size_t)r * (size_t)w->cols;
    const int8_t *pf = r + (NEON_PF_PANELS + 1) * nr <= r1 ? panel + NEON_PF_PANELS * (size_t)nr * (size_t)w->cols : panel;
    int i = 0;
    for (; i + NEON_NT <= n; i += NEON_NT, pf = panel)
        NEON_Q8(neon_tile_q8)(w, r, nr, xq + (size_t)i * ldx, xs + i, ldx, NEON_NT, y + (size_t)i * ldy, ldy, pf);
    const int8_t *xi = xq + (size_t)i * ldx;
    float *yi = y + (size_t)i * ldy;
    switch (n - i) {
    case 1: NEON_Q8(neon_tile_q8)(w, r, nr, xi, xs + i, ldx, 1, yi, ldy, pf); break;
    case 2: NEON_Q8(neon_tile_q8)(w, r, nr, xi, xs + i, ldx, 2, yi, ldy, pf); break;
    case 3: NEON_Q8(neon_tile_q8)(w, r, nr, xi, xs + i, ldx, 3, yi, ldy, pf); break;
    }
}

NEON_Q8_TARGET static void NEON_Q8(neon_matmul_q8)(const gl_mat *w, const int8_t *xq, const float *xscale, int n,
                                                   int ldx, float *y, int ldy, int r0, int r1) {
    const int nb = neon_token_block(w->cols, 1);
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        const int8_t *xb = xq + (size_t)i0 * ldx;
        float *yb = y + (size_t)i0 * ldy;
        int r = r0;
        for (; r + NEON_NR <= r1; r += NEON_NR)
            NEON_Q8(neon_tiles_q8)(w, r, NEON_NR, r1, xb, xscale + i0, ni, ldx, yb, ldy);
        for (; r < r1; r++) NEON_Q8(neon_tiles_q8)(w, r, 1, r1, xb, xscale + i0, ni, ldx, yb, ldy);
    }
}

/* arm_neon_q8.h -- the NEON W8A8 matmul over GL_Q8's 16-row panels, included
 * twice by arm_neon.c (plain NEON, and SDOT under the dotprod target).
 *
 * A panel's group of 4 columns is 64 bytes = 4 vectors ("quads") of 4 rows,
 * lane l of a quad holding one row's 4 weights.  A token's 4 bytes of that
 * group broadcast to every lane give the quad's 4 rows their products in
 * their own lanes: no horizontal sums, and no repacking at run time.  A tile
 * is NEON_Q8_NQ quads of a panel times NEON_Q8_NT tokens, one accumulator
 * each; it loads 16 bytes of each token (4 groups) at a time and multiplies
 * every weight vector into all its tokens.  The panel's first tile reads it
 * from memory, the others find it in cache.
 *
 * Parameters, set by arm_neon.c and undefined at the end:
 *   NEON_Q8(name)   this copy's function names
 *   NEON_Q8_TARGET  its target attribute (empty, or dotprod)
 *   NEON_Q8_ACC     the accumulator of a quad x 1 token, NEON_Q8_ZERO its 0,
 *                   NEON_Q8_SUM(a) the quad's 4 int32 sums (an int32x4_t)
 *   NEON_Q8_MAC(a, w0, w1, x, j, k)  adds a quad's products with groups j and
 *                   k (constants 0-3) of a token's 16 bytes x; w0, w1 are the
 *                   quad's weights in those groups
 *   NEON_Q8_NQ, NEON_Q8_NT  the tile (its accumulators fill about half of the
 *                   32 vector registers) */

/* y[t*ldy + r], t < nt, for the tile's rows r in [lo, hi): quads q0.. of the
 * panel at `panel`, whose first row is r16.  nt is a constant after inlining.
 * Prefetches pf bytes ahead of what it reads (0: no look-ahead). */
NEON_Q8_TARGET GL_NEON_INLINE void NEON_Q8(neon_tile_q8)(const gl_mat *w, const int8_t *panel, int r16, int q0,
                                                         int lo, int hi, const int8_t *xq, const float *xs, int ldx,
                                                         int nt, float *y, int ldy, size_t pf) {
    const int cols = w->cols, cols4 = gl_q8_cols4(cols);
    NEON_Q8_ACC acc[NEON_Q8_NQ][NEON_Q8_NT];
    int8x16_t xv[NEON_Q8_NT];
    int8_t wtail[256], xtail[NEON_Q8_NT][16];
#pragma GCC unroll 4
    for (int q = 0; q < NEON_Q8_NQ; q++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[q][t] = NEON_Q8_ZERO;
    for (int c = 0; c < cols; c += 16) {
        const int8_t *wp = panel + (size_t)c * GL_Q8_PANEL, *xp = xq + c;
        int ldxp = ldx;
#pragma GCC unroll 4
        for (int l = 0; l < 256; l += 64) __builtin_prefetch(wp + pf + l, 0, 0);
        if (c + 16 > cols) {   /* a token row ends at cols, the panel at cols4: zero-padded copies */
            memset(wtail, 0, sizeof wtail);
            memcpy(wtail, wp, (size_t)(cols4 - c) * GL_Q8_PANEL);
            memset(xtail, 0, sizeof xtail);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) memcpy(xtail[t], xq + (size_t)t * ldx + c, (size_t)(cols - c));
            wp = wtail, xp = xtail[0], ldxp = 16;
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) xv[t] = vld1q_s8(xp + (size_t)t * ldxp);
/* groups j and k of the 4: each quad's 2 weight vectors into every token */
#define NEON_Q8_PAIR(j, k)                                                                  \
        _Pragma("GCC unroll 4") for (int q = 0; q < NEON_Q8_NQ; q++) {                      \
            const int8_t *wq = wp + 16 * (q0 + q);                                          \
            const int8x16_t w0 = vld1q_s8(wq + 64 * (j)), w1 = vld1q_s8(wq + 64 * (k));     \
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)                            \
                acc[q][t] = NEON_Q8_MAC(acc[q][t], w0, w1, xv[t], j, k);                    \
        }
        NEON_Q8_PAIR(0, 1)
        NEON_Q8_PAIR(2, 3)
#undef NEON_Q8_PAIR
    }
    /* (float)sum * wscale * xscale in that order, as the scalar set; a quad
     * partly outside [lo, hi) (the range's ends) is stored lane by lane */
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        float *yt = y + (size_t)t * ldy;
#pragma GCC unroll 4
        for (int q = 0; q < NEON_Q8_NQ; q++) {
            const int r = r16 + 4 * (q0 + q);
            const int32x4_t s = NEON_Q8_SUM(acc[q][t]);
            if (r >= lo && r + 4 <= hi) {
                vst1q_f32(yt + r, vmulq_n_f32(vmulq_f32(vcvtq_f32_s32(s), vld1q_f32(w->scale + r)), xs[t]));
            } else {
                int32_t si[4];
                vst1q_s32(si, s);
                for (int l = 0; l < 4; l++)
                    if (r + l >= lo && r + l < hi) yt[r + l] = (float)si[l] * w->scale[r + l] * xs[t];
            }
        }
    }
}

/* Rows [r0, r1) panel by panel (skipping quads wholly outside), each panel
 * times all tokens of a block (whose activations stay in L2).  Its first tile
 * prefetches a quarter panel ahead, into the next panel (the hardware
 * prefetcher restarts at every page), unless that is past the range. */
NEON_Q8_TARGET static void NEON_Q8(neon_matmul_q8)(const gl_mat *w, const int8_t *xq, const float *xscale, int n,
                                                   int ldx, float *y, int ldy, int r0, int r1) {
    const size_t pb = gl_q8_panel_bytes(w->cols), ahead = pb / 4;
    const int p0 = r0 / GL_Q8_PANEL, p1 = (r1 + GL_Q8_PANEL - 1) / GL_Q8_PANEL;
    const int nb = neon_token_block(w->cols, 1);
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        for (int p = p0; p < p1; p++) {
            const int8_t *panel = (const int8_t *)w->data + (size_t)p * pb, *x = xq + (size_t)i0 * ldx;
            const float *xs = xscale + i0;
            float *yb = y + (size_t)i0 * ldy;
            const int r16 = p * GL_Q8_PANEL, lo = r16 > r0 ? r16 : r0, hi = r16 + GL_Q8_PANEL < r1 ? r16 + GL_Q8_PANEL : r1;
            size_t pf = p + 2 <= p1 ? ahead : 0;
            for (int q0 = 0; q0 < 4; q0 += NEON_Q8_NQ) {
                if (r16 + 4 * (q0 + NEON_Q8_NQ) <= lo || r16 + 4 * q0 >= hi) continue;
                int i = 0;
                for (; i + NEON_Q8_NT <= ni; i += NEON_Q8_NT, pf = 0)
                    NEON_Q8(neon_tile_q8)(w, panel, r16, q0, lo, hi, x + (size_t)i * ldx, xs + i, ldx, NEON_Q8_NT,
                                          yb + (size_t)i * ldy, ldy, pf);
                const int8_t *xi = x + (size_t)i * ldx;
                float *yi = yb + (size_t)i * ldy;
                switch (ni - i) {   /* the last tokens, counts the compiler sees */
#if NEON_Q8_NT > 3
                case 3: NEON_Q8(neon_tile_q8)(w, panel, r16, q0, lo, hi, xi, xs + i, ldx, 3, yi, ldy, pf); break;
#endif
#if NEON_Q8_NT > 2
                case 2: NEON_Q8(neon_tile_q8)(w, panel, r16, q0, lo, hi, xi, xs + i, ldx, 2, yi, ldy, pf); break;
#endif
                case 1: NEON_Q8(neon_tile_q8)(w, panel, r16, q0, lo, hi, xi, xs + i, ldx, 1, yi, ldy, pf); break;
                }
                pf = 0;
            }
        }
    }
}

#undef NEON_Q8
#undef NEON_Q8_TARGET
#undef NEON_Q8_ACC
#undef NEON_Q8_ZERO
#undef NEON_Q8_SUM
#undef NEON_Q8_MAC
#undef NEON_Q8_NT
#undef NEON_Q8_NQ

/* x86_q8.h -- the x86 W8A8 matmul, included once per instruction set by
 * x86_avx2.c: X86_Q8(name) names this copy's functions, X86_Q8_INLINE and
 * X86_Q8_FN carry its target attribute, and X86_Q8_MAC(acc, |w|, w, x, ones)
 * adds the 32 products w*x into the 8 int32 lanes of acc.  Every MAC sums
 * exactly (int32, no saturation for activations in [-127, 127]), so every
 * copy gives the scalar set's bits. */

/* As avx2_tile, for int8 rows and tokens (32 columns a step). */
X86_Q8_INLINE void X86_Q8(tile_q8)(const gl_mat *w, int r, int nr, const int8_t *xq, const float *xs, int ldx, int nt,
                                 float *y, int ldy, const int8_t *pf) {
    const int cols = w->cols, full = cols & ~31;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *wr[AVX2_Q8_NR];
    __m256i acc[AVX2_Q8_NR][AVX2_NT], wv[AVX2_Q8_NR], wa[AVX2_Q8_NR];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        wr[k] = (const int8_t *)w->data + (size_t)(r + k) * (size_t)cols;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[k][t] = _mm256_setzero_si256();
    }
    for (int c = 0; c < full; c += 32) {
        _mm_prefetch((const char *)(pf + (size_t)c * nr), _MM_HINT_NTA);
        if (nr > 2) _mm_prefetch((const char *)(pf + (size_t)c * nr + 64), _MM_HINT_NTA);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            wv[k] = _mm256_loadu_si256((const __m256i *)(wr[k] + c));
            wa[k] = _mm256_abs_epi8(wv[k]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)t * ldx + c));
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = X86_Q8_MAC(acc[k][t], wa[k], wv[k], xv, ones);
        }
    }
    if (full < cols) {   /* zero padding adds nothing to an exact sum */
        const size_t rem = (size_t)(cols - full);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            int8_t buf[32] = {0};
            memcpy(buf, wr[k] + full, rem);
            wv[k] = _mm256_loadu_si256((const __m256i *)buf);
            wa[k] = _mm256_abs_epi8(wv[k]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            int8_t buf[32] = {0};
            memcpy(buf, xq + (size_t)t * ldx + full, rem);
            __m256i xv = _mm256_loadu_si256((const __m256i *)buf);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = X86_Q8_MAC(acc[k][t], wa[k], wv[k], xv, ones);
        }
    }
    if (nr == 2 && nt == 4) {
        /* the 8 sums at once (exact in int32, so any order gives the same
           bits): hadd pairs the tokens' lanes, then the two 128-bit halves
           are added; then (float)sum * wscale * xscale, four tokens a row */
        const __m256i h0 = _mm256_hadd_epi32(acc[0][0], acc[0][1]), h1 = _mm256_hadd_epi32(acc[0][2], acc[0][3]);
        const __m256i h2 = _mm256_hadd_epi32(acc[1][0], acc[1][1]), h3 = _mm256_hadd_epi32(acc[1][2], acc[1][3]);
        const __m256i g0 = _mm256_hadd_epi32(h0, h1), g1 = _mm256_hadd_epi32(h2, h3);
        const __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(g0), _mm256_extracti128_si256(g0, 1));
        const __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(g1), _mm256_extracti128_si256(g1, 1));
        const __m128 vx = _mm_loadu_ps(xs);
        float o[2][4];
        _mm_storeu_ps(o[0], _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(s0), _mm_set1_ps(w->scale[r])), vx));
        _mm_storeu_ps(o[1], _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(s1), _mm_set1_ps(w->scale[r + 1])), vx));
        for (int t = 0; t < 4; t++) {
            y[(size_t)t * ldy + r] = o[0][t];
            y[(size_t)t * ldy + r + 1] = o[1][t];
        }
        return;
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++)
            y[(size_t)t * ldy + r + k] = (float)avx2_hsum_i32(acc[k][t]) * w->scale[r + k] * xs[t];
}

X86_Q8_INLINE void X86_Q8(tile_q8_nt)(const gl_mat *w, int r, int nr, const int8_t *xq, const float *xs, int ldx, int nt,
                                    float *y, int ldy, const int8_t *pf) {
    switch (nt) {
    case 4: X86_Q8(tile_q8)(w, r, nr, xq, xs, ldx, 4, y, ldy, pf); break;
    case 3: X86_Q8(tile_q8)(w, r, nr, xq, xs, ldx, 3, y, ldy, pf); break;
    case 2: X86_Q8(tile_q8)(w, r, nr, xq, xs, ldx, 2, y, ldy, pf); break;
    case 1: X86_Q8(tile_q8)(w, r, nr, xq, xs, ldx, 1, y, ldy, pf); break;
    }
}

/* As avx2_panels. */
X86_Q8_INLINE void X86_Q8(panels_q8)(const gl_mat *w, int nr, const int8_t *xq, const float *xs, int n, int ldx,
                                   float *y, int ldy, int r, int r1) {
    const size_t row_bytes = (size_t)w->cols;
    for (; r + nr <= r1; r += nr) {
        const int8_t *panel = (const int8_t *)w->data + (size_t)r * row_bytes;
        const int8_t *pf = r + (GL_PF_PANELS + 1) * nr <= r1 ? panel + GL_PF_PANELS * (size_t)nr * row_bytes : panel;
        for (int i = 0; i < n; i += AVX2_NT, pf = panel) {
            int nt = n - i < AVX2_NT ? n - i : AVX2_NT;
            X86_Q8(tile_q8_nt)(w, r, nr, xq + (size_t)i * ldx, xs + i, ldx, nt, y + (size_t)i * ldy, ldy, pf);
        }
    }
}

static X86_Q8_FN void X86_Q8(matmul_q8)(const gl_mat *w, const int8_t *xq, const float *xscale, int n, int ldx,
                                   float *y, int ldy, int r0, int r1) {
    const int nb = gl_token_block(w->cols, 1), r = r0 + (r1 - r0) / AVX2_Q8_NR * AVX2_Q8_NR;
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        const int8_t *xb = xq + (size_t)i0 * ldx;
        X86_Q8(panels_q8)(w, AVX2_Q8_NR, xb, xscale + i0, ni, ldx, y + (size_t)i0 * ldy, ldy, r0, r);
        X86_Q8(panels_q8)(w, 1, xb, xscale + i0, ni, ldx, y + (size_t)i0 * ldy, ldy, r, r1);
    }
}
/* x86_q8.h -- the x86 W8A8 matmul, included once per instruction set by
 * x86_avx2.c: X86_Q8(name) names this copy's functions, X86_Q8_INLINE and
 * X86_Q8_FN carry its target attribute, X86_Q8_NT is its tokens per tile,
 * and X86_Q8_MAC(acc, a, w, x, ones) adds the 32 products w*x into the 8
 * int32 lanes of acc, given a = |w| -- or, where X86_Q8_OFFSET is 1, adds
 * the products (w + 128)*x given a = w + 128 (as unsigned bytes).
 *
 * The weights are GL_Q8's 16-row panels (ggml_like.h): a panel's 64-byte
 * group g is two vectors, rows 0-7 and rows 8-15, each int32 lane one row's
 * columns 4g..4g+3.  A token's 4 bytes at 4g, broadcast to every lane, times
 * one vector gives 8 rows' partial sums in their own lanes, so a tile (one
 * panel times X86_Q8_NT tokens) keeps 2*NT accumulators that end as 8
 * consecutive y values each: convert, scale, one store; no horizontal sums.
 * AVX2's maddubs multiplies unsigned by signed bytes into saturating int16
 * pairs, so it takes |w| once per weight vector and sign(x, w) once per
 * vector and token (|w| x |x| <= 127 x 127, two of them fit).  VNNI's
 * vpdpbusd sums four products straight into int32, so the VNNI copies
 * (X86_Q8_OFFSET) offset the weights instead, as the avx512 set does:
 * w + 128 (a xor of the sign bit, once per weight vector, shared by the
 * tile's tokens) times the signed activations, then 128 times the token's
 * sum of activations subtracted -- no instruction per product besides
 * vpdpbusd, where the sign had cost one per vpdpbusd (Zen 5, avx_vnni, one
 * thread: 303 GOP/s with the sign, 407 without).  Every MAC sums exactly
 * (int32, no saturation for activations in [-127, 127]; the offset sum is
 * exact modulo 2^32 and the true sum fits), so every copy gives the scalar
 * set's bits.
 *
 * Loop structure: tokens in blocks whose activations stay in L2; in a
 * block, every panel overlapping [r0, r1) is read by each token tile in
 * turn (the first tile pulls it from memory and prefetches ahead, the
 * others find it in cache).  Padding rows are computed, never stored. */

#ifndef X86_Q8_XSUM_MAX
#define X86_Q8_XSUM_MAX 1024   /* tokens per block in the offset copies (their sums live on the stack) */
#endif

/* One token reads the panels in X86_Q8_RUNS runs side by side, two tokens
 * in half as many (their sums fill the 16 ymm registers): Zen 5, 2
 * threads, INT8 2048x2048 from DRAM, avx2 set: 62-72% of the read limit
 * with one run, 78-83% with two, 88-95% with four (bench_kernels). */
#ifndef X86_Q8_RUNS
#define X86_Q8_RUNS 4
#endif
#define X86_Q8_RUNS2 (X86_Q8_RUNS > 1 ? X86_Q8_RUNS / 2 : 1)   /* two tokens' runs */

#ifndef GL_Q8_PF_ROWS
#define GL_Q8_PF_ROWS 4   /* prefetch distance: this many rows' bytes */
#endif

/* A token's 4 bytes from p (nb of them, the rest zero: never past the
 * token's cols) in every lane. */
X86_Q8_INLINE __m256i X86_Q8(x4)(const int8_t *p, int nb) {
    int32_t v = 0;
    memcpy(&v, p, (size_t)nb);
    return _mm256_set1_epi32(v);
}

/* The offset copies' per-token sums of activations: xsum[i] = sum of token
 * i's cols bytes (exact in any order). */
X86_Q8_INLINE void X86_Q8(xsums)(const int8_t *xq, int n, int ldx, int cols, int32_t *xsum) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int i = 0; i < n; i++) {
        const int8_t *xr = xq + (size_t)i * ldx;
        __m256i acc = _mm256_setzero_si256();
        int c = 0;
        for (; c + 32 <= cols; c += 32)   /* 1*x + 1*x in int16 cannot saturate */
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)(xr + c))), ones16));
        int32_t s = avx2_hsum_i32(acc);
        for (; c < cols; c++) s += xr[c];
        xsum[i] = s;
    }
}

/* y[r] for r in [lo, hi) from a cut panel's eight sums s (rows rb..rb+7):
 * out of line, since the tiles' every (half, token) would otherwise carry
 * its own vectorized copy of this rare loop (the avx512_vnni copy's tiles
 * were 96 KB, half of ggml_like.c's build time). */
#ifndef X86_Q8_STORE_ROWS
#define X86_Q8_STORE_ROWS
static __attribute__((noinline)) void x86_q8_store_rows(const int32_t *s, int rb, int lo, int hi, const float *scale,
                                                        float xs, float *y) {
    for (int r = lo; r < hi; r++) y[r] = (float)s[r - rb] * scale[r] * xs;
}
#endif

/* Panel p (rows 16p..16p+15) times nt tokens; y rows in [r0, r1) only
 * (xsum: the tokens' sums, read by the offset copies alone).  With R > 1
 * (one or two tokens: decode), R panels at once, p + s*part for s < R: R
 * sequential runs of bytes side by side, which keep more misses in flight
 * than one (see X86_Q8_RUNS), each prefetching its own run X86_Q8_RUN_PF
 * bytes ahead instead of pf.  R is a constant where it is called. */
#ifndef X86_Q8_RUN_PF
#define X86_Q8_RUN_PF 2048
#endif
X86_Q8_INLINE void X86_Q8(tile_q8)(const gl_mat *w, const int R, int part, int p, const int8_t *xq, const float *xs,
                                 const int32_t *xsum, int ldx, int nt, float *y, int ldy, int r0, int r1,
                                 const int8_t *pf) {
    const int8_t *panel[4];
#pragma GCC unroll 4
    for (int s = 0; s < R; s++) panel[s] = (const int8_t *)w->data + (size_t)(p + s * part) * gl_q8_panel_bytes(w->cols);
    const int full = w->cols >> 2, rem = w->cols & 3;
    __m256i acc[4][X86_Q8_NT][2];
#pragma GCC unroll 4
    for (int s = 0; s < R; s++)
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[s][t][0] = acc[s][t][1] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    (void)flip; (void)xsum;
    for (int g = 0; g < full; g++) {
#pragma GCC unroll 4
        for (int s = 0; s < R; s++) {
            const int8_t *wg = panel[s] + (size_t)g * 64;
            _mm_prefetch(R > 1 ? (const char *)((uintptr_t)wg + X86_Q8_RUN_PF) : (const char *)(pf + (size_t)g * 64), _MM_HINT_NTA);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg), w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));
            const __m256i a0 = X86_Q8_OFFSET ? _mm256_xor_si256(w0, flip) : _mm256_abs_epi8(w0);
            const __m256i a1 = X86_Q8_OFFSET ? _mm256_xor_si256(w1, flip) : _mm256_abs_epi8(w1);
#pragma GCC unroll 8
            for (int t = 0; t < nt; t++) {
                const __m256i xv = X86_Q8(x4)(xq + (size_t)t * ldx + 4 * g, 4);
                acc[s][t][0] = X86_Q8_MAC(acc[s][t][0], a0, w0, xv, ones);
                acc[s][t][1] = X86_Q8_MAC(acc[s][t][1], a1, w1, xv, ones);
            }
        }
    }
    /* y = (float)sum * wscale * xscale, in the scalar set's order.  The
       zero-padded last group (cols % 4 != 0) joins here, from the tokens'
       remaining bytes only: after the loop, or before it, it made gcc copy
       and spill the accumulators inside the loop. */
#pragma GCC unroll 8
    for (int sh = 0; sh < 2 * R; sh++) {
        const int s = sh / 2, h = sh % 2;
        const int rb = 16 * (p + s * part) + 8 * h;
        const __m256i wl = rem ? _mm256_loadu_si256((const __m256i *)(panel[s] + (size_t)full * 64 + 32 * h))
                               : _mm256_setzero_si256();
        const __m256i al = X86_Q8_OFFSET ? _mm256_xor_si256(wl, flip) : _mm256_abs_epi8(wl);
        const int whole = rb >= r0 && rb + 8 <= r1, lo = r0 > rb ? r0 : rb, hi = r1 < rb + 8 ? r1 : rb + 8;
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            __m256i sum = acc[s][t][h];
            if (rem) sum = X86_Q8_MAC(sum, al, wl, X86_Q8(x4)(xq + (size_t)t * ldx + 4 * full, rem), ones);
            if (X86_Q8_OFFSET) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32((int32_t)((uint32_t)xsum[t] << 7)));
            if (whole) {
                const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(w->scale + rb));
                _mm256_storeu_ps(y + (size_t)t * ldy + rb, _mm256_mul_ps(v, _mm256_set1_ps(xs[t])));
            } else {   /* a panel cut by r0 or r1, or the padding rows */
                int32_t s[8];
                _mm256_storeu_si256((__m256i *)s, sum);
                x86_q8_store_rows(s, rb, lo, hi, w->scale, xs[t], y + (size_t)t * ldy);
            }
        }
    }
}

/* One tile of nt = 1..X86_Q8_NT tokens: a function of its own, called once
 * a (panel, token tile), so its X86_Q8_NT copies of the tile are compiled
 * once rather than at each call site. */
static X86_Q8_FN __attribute__((noinline)) void X86_Q8(tile_q8_nt)(const gl_mat *w, int p, const int8_t *xq,
                                                                  const float *xs, const int32_t *xsum, int ldx,
                                                                  int nt, float *y, int ldy, int r0, int r1,
                                                                  const int8_t *pf) {
    switch (nt) {
#if X86_Q8_NT > 4
    case 8: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 8, y, ldy, r0, r1, pf); break;
    case 7: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 7, y, ldy, r0, r1, pf); break;
    case 6: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 6, y, ldy, r0, r1, pf); break;
    case 5: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 5, y, ldy, r0, r1, pf); break;
#endif
    case 4: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 4, y, ldy, r0, r1, pf); break;
    case 3: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 3, y, ldy, r0, r1, pf); break;
    case 2: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 2, y, ldy, r0, r1, pf); break;
    case 1: X86_Q8(tile_q8)(w, 1, 1, p, xq, xs, xsum, ldx, 1, y, ldy, r0, r1, pf); break;
    }
}

static X86_Q8_FN void X86_Q8(matmul_q8)(const gl_mat *w, const int8_t *xq, const float *xscale, int n, int ldx,
                                   float *y, int ldy, int r0, int r1) {
    if (r0 >= r1) return;
    const size_t pb = gl_q8_panel_bytes(w->cols), dist = (size_t)GL_Q8_PF_ROWS * (size_t)gl_q8_cols4(w->cols);
    const int p0 = r0 / GL_Q8_PANEL, p1 = (r1 + GL_Q8_PANEL - 1) / GL_Q8_PANEL;
    int nb = gl_token_block(w->cols, 1);
    int32_t xsum[X86_Q8_OFFSET ? X86_Q8_XSUM_MAX : 1];
    if (X86_Q8_OFFSET && nb > X86_Q8_XSUM_MAX) nb = X86_Q8_XSUM_MAX;
    if (n <= 2) {           /* decode: the panels in runs, the last few one at a time */
        if (X86_Q8_OFFSET) X86_Q8(xsums)(xq, n, ldx, w->cols, xsum);
        const int runs = n == 1 ? X86_Q8_RUNS : X86_Q8_RUNS2, part = (p1 - p0) / runs;
        for (int i = 0; i < part; i++) {
            const int8_t *self = (const int8_t *)w->data + (size_t)(p0 + i) * pb;   /* pf, were the runs one */
            if (n == 1) X86_Q8(tile_q8)(w, X86_Q8_RUNS, part, p0 + i, xq, xscale, xsum, ldx, 1, y, ldy, r0, r1, self);
            else X86_Q8(tile_q8)(w, X86_Q8_RUNS2, part, p0 + i, xq, xscale, xsum, ldx, 2, y, ldy, r0, r1, self);
        }
        for (int p = p0 + runs * part; p < p1; p++) {
            const int8_t *panel = (const int8_t *)w->data + (size_t)p * pb;
            const int8_t *pf = (size_t)(p1 - p) * pb >= dist + pb ? panel + dist : panel;
            X86_Q8(tile_q8_nt)(w, p, xq, xscale, xsum, ldx, n, y, ldy, r0, r1, pf);
        }
        return;
    }
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        if (X86_Q8_OFFSET) X86_Q8(xsums)(xq + (size_t)i0 * ldx, ni, ldx, w->cols, xsum);
        for (int p = p0; p < p1; p++) {
            /* the panels are one contiguous stream: the first tile reads
               dist bytes ahead, as long as that stays in [r0, r1)'s panels */
            const int8_t *panel = (const int8_t *)w->data + (size_t)p * pb;
            const int8_t *pf = (size_t)(p1 - p) * pb >= dist + pb ? panel + dist : panel;
            for (int i = i0; i < i0 + ni; i += X86_Q8_NT, pf = panel) {
                const int nt = i0 + ni - i < X86_Q8_NT ? i0 + ni - i : X86_Q8_NT;
                X86_Q8(tile_q8_nt)(w, p, xq + (size_t)i * ldx, xscale + i, xsum + (X86_Q8_OFFSET ? i - i0 : 0), ldx, nt, y + (size_t)i * ldy, ldy, r0, r1, pf);
            }
        }
    }
}

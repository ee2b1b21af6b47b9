/* x86_avx512.c -- the "avx512" kernel set: 512-bit vectors (AVX-512 F, BW,
 * VL and VNNI: Ice Lake, Sapphire Rapids, Zen 4, Zen 5 and later).
 *
 * Included from ggml_like.c after x86_avx2.c (whose helpers, exp constants
 * and feature bits it uses).  Every function carries a target attribute, so
 * the library builds without -mavx512f; gl_kernels_get offers this set only
 * when cpuid and XCR0 say the CPU and the OS run 512-bit code.
 *
 * fp products (f32, f16, bf16, fp8 weights; fp32 activations): the weights
 * are widened to fp32 exactly (the values gl_row_to_f32 gives) and
 * multiplied by FMA.  Reduction order of one dot product W[r] . x[i], the
 * same in every path (tile shape, n, row range), so results are batch
 * invariant: lane l of one 16-wide accumulator takes w[c]*x[c] for c = l
 * (mod 16) in increasing c; the last cols%16 columns are one zero-padded
 * block (masked loads); the 16 lanes are summed as lo256 + hi256 and then in
 * avx2_hsum's order -- the transposed reduction of a full tile (a512_reduce16)
 * adds exactly the same pairs.
 *
 * W8A8 products: vpdpbusd multiplies unsigned by signed bytes.  The weights
 * are made unsigned by an offset, w + 128 (a xor of the sign bit), and the
 * activations stay signed: sum (w+128)*x = sum w*x + 128 * sum x, so the
 * token's sum of activations (computed once per call and token) times 128
 * is subtracted.  Every step is exact in int32 (the offset sum is exact
 * modulo 2^32 and the true sum fits), so every tile shape gives the scalar
 * set's bits.  The weights are in GL_Q8's 16-row panels, one row a lane
 * (a512_q8_dot): no horizontal sums and no per-(row, token) sign fix-up,
 * one vpdpbusd per 64 products.
 *
 * Loop structure of the fp products: as the AVX2 set (tokens in L2-sized
 * blocks, weight rows in panels that stay in L1 while every token tile
 * passes over them), with 4-row x 4-token register tiles of 512-bit
 * accumulators reduced together (bf16 prefill: 6 x 4 in row panels, 4 x 6
 * in slices that stay in L2; see A512_NR_WIDE).  With n = 1 or 2 (decode,
 * bound by memory bandwidth) rows of 1 KB or more go one at a time, so that
 * the matrix streams in as one sequential run (A512_ROWWISE_MAX_N); shorter
 * rows stream 4 at a time, prefetching ahead.  The W8A8 loops are described
 * above a512_q8_dot. */

#define GL_A512_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define GL_A512 __attribute__((target(GL_A512_TARGET)))
#define GL_A512_INLINE static inline __attribute__((always_inline, target(GL_A512_TARGET)))

#define A512_NR 4      /* weight rows per tile   */
#define A512_NT 4      /* tokens per tile        */
/* Wide tiles for prefill's bf16 products, 24 sums of the 32
 * registers: whichever operand streams in from L2 should serve as many
 * vectors of the other as the registers allow.  Row panels (the panel in
 * L1, tokens from L2) take 6 rows x 4 tokens: 2048x2048 bf16 x 128 tokens
 * went from 58-63% to 70-77% of the FMA peak in one set of alternating
 * runs, 54-59% to 61-68% in another.  A slice that stays in L2
 * (tokens_outer: the tokens in L1, the rows from L2) takes 4 rows x 6
 * tokens: bf16 prefill of 512 tokens, bench-M 707 -> 821 tok/s, V2-Lite-4
 * 346 -> 385 (medians of 8 and 6 alternating runs).  bf16 only: see
 * a512_tokens_outer. */
#define A512_NR_WIDE 6
#define A512_NT_WIDE 6
/* 1-2 tokens (decode) on rows of 1 KB or more go one row at a time (four
 * at once, one from each quarter of the rows: a512_row_runs): the rows then
 * stream from DRAM as sequential runs, while a panel's four rows read side
 * by side are four streams a row apart, which Zen 5's prefetchers fetch
 * about a quarter slower (one thread, weights from DRAM: 2048x2048 int8
 * 18.9 -> 24.9 GB/s).  Shorter rows: a panel is one run. */
#define A512_ROWWISE_MAX_N 2
#define A512_ROWWISE_MIN_BYTES 1024

/* Where the 4-row panels of rows [r0, r1) end (the rest go one row at a
 * time): at r0 when the rows go one at a time, as above. */
static inline int a512_panels_end(int n, size_t row_bytes, int r0, int r1) {
    if (n <= A512_ROWWISE_MAX_N && row_bytes >= A512_ROWWISE_MIN_BYTES) return r0;
    return r0 + (r1 - r0) / A512_NR * A512_NR;
}
#define A512_XSUM_MAX 1024   /* tokens per block in the W8A8 path (their sums live on the stack) */

/* Mask of the first rem (0..16) lanes / (0..64) bytes. */
GL_A512_INLINE __mmask16 a512_mask16(int rem) { return (__mmask16)((1u << rem) - 1u); }
GL_A512_INLINE __mmask64 a512_mask64(int rem) { return rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1); }

/* Stores of 16 lanes under a mask that is usually full: a plain store when
 * it is.  On Zen 5 a masked store costs far more than a plain one when its
 * line is not in cache (W_uk^T's products, 512 x 128 over 512 tokens, whose
 * outputs stream to memory: 330 -> 570 GOP/s on one thread). */
GL_A512_INLINE void a512_store16(float *p, __mmask16 k, __m512 v) {
    if (k == (__mmask16)0xffff) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, k, v);
}
GL_A512_INLINE void a512_store16_epi32(void *p, __mmask16 k, __m512i v) {
    if (k == (__mmask16)0xffff) _mm512_storeu_si512(p, v);
    else _mm512_mask_storeu_epi32(p, k, v);
}
GL_A512_INLINE void a512_store16_epi8(void *p, __mmask16 k, __m128i v) {
    if (k == (__mmask16)0xffff) _mm_storeu_si128((__m128i *)p, v);
    else _mm_mask_storeu_epi8(p, k, v);
}

/* One accumulator's 16 lanes: lo256 + hi256, then avx2_hsum's order. */
GL_A512_INLINE float a512_hsum(__m512 v) {
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return avx2_hsum(s);
}
GL_A512_INLINE int32_t a512_hsum_i32(__m512i v) {
    return avx2_hsum_i32(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}

/* 16 accumulators reduced at once: lane 4k+m of the result is the sum of
 * a[4m+k], each added in a512_hsum's order (the same pairs, so the same
 * bits).  Four levels: 128-bit quarters (0+2, 1+3), then the two halves,
 * then lanes (0+2, 1+3) within a quarter, then (0+1). */
GL_A512_INLINE __m512 a512_reduce16(const __m512 *a) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88), _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))));
}

/* Lane quarter t of v to y[t*ldy + r .. r+3]. */
GL_A512_INLINE void a512_store4x4(__m512 v, float *y, int ldy, int r) {
    _mm_storeu_ps(y + r, _mm512_extractf32x4_ps(v, 0));
    _mm_storeu_ps(y + (size_t)ldy + r, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(y + 2 * (size_t)ldy + r, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(y + 3 * (size_t)ldy + r, _mm512_extractf32x4_ps(v, 3));
}

/* 16 weights of a stored type as fp32, the first `m` lanes loaded (the rest
 * 0).  fp8 e4m3 goes through fp16 as in avx2_load_w: `scale` holds the
 * block scale times 256. */
GL_A512_INLINE __m512 a512_load_w(int type, const uint8_t *p, __m512 scale, __mmask16 m, int full) {
    switch (type) {
    case GL_F32: return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
    case GL_F16: return _mm512_cvtph_ps(full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p));
    case GL_BF16: {
        __m256i h = full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    default: {   /* GL_F8_E4M3 */
        __m128i b = full ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(m, p);
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbf80));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), scale);
    }
    }
}

/* One register tile: y[t*ldy + r+k*rs] = W[r+k*rs] . x[t*ldx] for k < nr,
 * t < nt (constants after inlining; rs, the rows between the tile's rows,
 * is 1 but in a512_row_runs).  pf: an address to prefetch from, at the pace
 * this tile reads its rows (rs > 1: row k's at pf + k*rs rows). */
GL_A512_INLINE void a512_tile_rs(int type, const gl_mat *w, int r, int nr, int rs, const float *x, int ldx, int nt,
                                 float *y, int ldy, const uint8_t *pf) {
    const int cols = w->cols, full = cols & ~15;
    const size_t es = gl_type_size(type);
    const int bcols = (cols + GL_F8_BLOCK - 1) / GL_F8_BLOCK;
    const uint8_t *wr[A512_NR_WIDE];
    const float *wsc[A512_NR_WIDE];
    __m512 acc[A512_NR_WIDE][A512_NT_WIDE], s[A512_NR_WIDE], wv[A512_NR_WIDE];
#pragma GCC unroll 6
    for (int k = 0; k < nr; k++) {
        wr[k] = (const uint8_t *)w->data + (size_t)(r + k * rs) * (size_t)cols * es;
        wsc[k] = type == GL_F8_E4M3 ? w->scale + (size_t)((r + k * rs) / GL_F8_BLOCK) * (size_t)bcols : NULL;
        s[k] = _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) acc[k][t] = _mm512_setzero_ps();
    }
    for (int cb = 0; cb < cols; cb += GL_F8_BLOCK) {
        if (type == GL_F8_E4M3) {
#pragma GCC unroll 6
            for (int k = 0; k < nr; k++) s[k] = _mm512_set1_ps(wsc[k][cb / GL_F8_BLOCK] * 256.0f);
        }
        int ce = cb + GL_F8_BLOCK < full ? cb + GL_F8_BLOCK : full;
        for (int c = cb; c < ce; c += 16) {
            if (rs > 1) {
#pragma GCC unroll 6
                for (int k = 0; k < nr; k++) _mm_prefetch((const char *)pf + ((size_t)k * rs * cols + c) * es, _MM_HINT_NTA);
            } else {
                const uint8_t *pc = pf + (size_t)c * (size_t)nr * es;
                _mm_prefetch((const char *)pc, _MM_HINT_NTA);
                if (nr * es * 16 > 64) _mm_prefetch((const char *)pc + 64, _MM_HINT_NTA);
                if (nr * es * 16 > 128) { _mm_prefetch((const char *)pc + 128, _MM_HINT_NTA); _mm_prefetch((const char *)pc + 192, _MM_HINT_NTA); }
            }
#pragma GCC unroll 6
            for (int k = 0; k < nr; k++) wv[k] = a512_load_w(type, wr[k] + (size_t)c * es, s[k], 0, 1);
#pragma GCC unroll 6
            for (int t = 0; t < nt; t++) {
                __m512 xv = _mm512_loadu_ps(x + (size_t)t * ldx + c);
#pragma GCC unroll 6
                for (int k = 0; k < nr; k++) acc[k][t] = _mm512_fmadd_ps(wv[k], xv, acc[k][t]);
            }
        }
    }
    if (full < cols) {   /* the zero-padded last block; s[] holds its scale */
        const __mmask16 m = a512_mask16(cols - full);
#pragma GCC unroll 6
        for (int k = 0; k < nr; k++) wv[k] = a512_load_w(type, wr[k] + (size_t)full * es, s[k], m, 0);
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)t * ldx + full);
#pragma GCC unroll 6
            for (int k = 0; k < nr; k++) acc[k][t] = _mm512_fmadd_ps(wv[k], xv, acc[k][t]);
        }
    }
    /* 4 rows x 4 tokens reduced together, the rest of a wide tile one sum
       at a time: the same pairs in the same order, so the same bits */
    const int quad = nr >= 4 && nt >= 4 && rs == 1;
    if (quad) {
        __m512 a[16];
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++) a[4 * k + t] = acc[k][t];   /* lane 4t+k <- a[4k+t] */
        a512_store4x4(a512_reduce16(a), y, ldy, r);
    }
#pragma GCC unroll 6
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 6
        for (int k = 0; k < nr; k++)
            if (!quad || k >= 4 || t >= 4) y[(size_t)t * ldy + r + k * rs] = a512_hsum(acc[k][t]);
}

GL_A512_INLINE void a512_tile(int type, const gl_mat *w, int r, int nr, const float *x, int ldx, int nt,
                              float *y, int ldy, const uint8_t *pf) {
    a512_tile_rs(type, w, r, nr, 1, x, ldx, nt, y, ldy, pf);
}

/* The tile for nt = 1..4 tokens (nr stays a constant); _of with wide: 1..6. */
GL_A512_INLINE void a512_tile_nt(int type, const gl_mat *w, int r, int nr, const float *x, int ldx, int nt,
                                 float *y, int ldy, const uint8_t *pf) {
    switch (nt) {
    case 4: a512_tile(type, w, r, nr, x, ldx, 4, y, ldy, pf); break;
    case 3: a512_tile(type, w, r, nr, x, ldx, 3, y, ldy, pf); break;
    case 2: a512_tile(type, w, r, nr, x, ldx, 2, y, ldy, pf); break;
    case 1: a512_tile(type, w, r, nr, x, ldx, 1, y, ldy, pf); break;
    }
}
GL_A512_INLINE void a512_tile_nt_of(int type, int wide, const gl_mat *w, int r, int nr, const float *x, int ldx,
                                    int nt, float *y, int ldy, const uint8_t *pf) {
    if (wide && nt == 6) a512_tile(type, w, r, nr, x, ldx, 6, y, ldy, pf);
    else if (wide && nt == 5) a512_tile(type, w, r, nr, x, ldx, 5, y, ldy, pf);
    else a512_tile_nt(type, w, r, nr, x, ldx, nt, y, ldy, pf);
}

/* Rows [r, r1) in panels of nr, times n tokens (as avx2_panels). */
GL_A512_INLINE void a512_panels(int type, const gl_mat *w, int nr, const float *x, int n, int ldx,
                                float *y, int ldy, int r, int r1) {
    const size_t row_bytes = (size_t)w->cols * gl_type_size(type);
    for (; r + nr <= r1; r += nr) {
        const uint8_t *panel = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint8_t *pf = r + (GL_PF_PANELS + 1) * nr <= r1 ? panel + GL_PF_PANELS * (size_t)nr * row_bytes : panel;
        for (int i = 0; i < n; i += A512_NT, pf = panel) {
            int nt = n - i < A512_NT ? n - i : A512_NT;
            a512_tile_nt(type, w, r, nr, x + (size_t)i * ldx, ldx, nt, y + (size_t)i * ldy, ldy, pf);
        }
    }
}

/* Rows [r, r1) one at a time for 1-2 tokens, as A512_ROW_RUNS sequential
 * runs: row i of each quarter of the range side by side.  One row is one
 * FMA chain (the lanes fix the order), 16 values every FMA latency, which
 * from DRAM holds a thread under its share of the bandwidth; rows a row
 * apart are streams that jump, which the prefetchers follow worse (see
 * A512_ROWWISE_MIN_BYTES).  Four quarters are four chains on four runs the
 * prefetchers follow, and enough misses in flight for a Zen 5 core (bf16
 * 2048x2048 on 2 threads: 76-79% of the read limit with two runs, 88-89%
 * with four).  Each row's sum is the one a row alone gets. */
#define A512_ROW_RUNS 4
GL_A512_INLINE void a512_row_runs(int type, const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r,
                                  int r1) {
    const size_t row_bytes = (size_t)w->cols * gl_type_size(type);
    const int part = (r1 - r) / A512_ROW_RUNS;
    const uint8_t *base = (const uint8_t *)w->data;
    for (int i = 0; i < part; i++) {
        const int ra = r + i, ahead = i + GL_PF_PANELS < part ? GL_PF_PANELS : 0;
        const uint8_t *pf = base + (size_t)(ra + ahead) * row_bytes;
        if (n == 1) a512_tile_rs(type, w, ra, A512_ROW_RUNS, part, x, ldx, 1, y, ldy, pf);
        else a512_tile_rs(type, w, ra, A512_ROW_RUNS, part, x, ldx, 2, y, ldy, pf);
    }
    a512_panels(type, w, 1, x, n, ldx, y, ldy, r + A512_ROW_RUNS * part, r1);
}

/* A matrix small enough to stay in L1 (16 rows x 576 floats, say) goes the
 * other way round: each token tile is read once and passes over all the
 * rows while they sit in L1, instead of every row panel re-reading all the
 * tokens from L2.  Same tiles, same bits.  So does a slice of 16-bit or
 * 8-bit weights that stays in L2 (a task's 256 KB): the tile then reads
 * its weights from L2 at 2 bytes a value or less instead of its tokens at
 * 4 (one thread, bf16 x 96 tokens: 128x1024 166 -> 178 GFLOP/s, 256x512
 * 153 -> 169, 48x2816 147 -> 155; 64x2048 168 -> 164). */
#define A512_L1_BYTES (40 << 10)
#define A512_L2_SLICE_BYTES (384 << 10)

/* wide (a constant): the wide tiles, for bf16 only -- each tile shape is
 * another copy of the tile's code, and the other types are rare in
 * prefill's products. */
GL_A512_INLINE void a512_tokens_outer(int type, int wide, const gl_mat *w, const float *x, int n, int ldx,
                                      float *y, int ldy, int r0, int r1) {
    const int r = r0 + (r1 - r0) / A512_NR * A512_NR, step = wide ? A512_NT_WIDE : A512_NT;
    const uint8_t *base = (const uint8_t *)w->data;
    for (int i = 0; i < n; i += step) {
        const int nt = n - i < step ? n - i : step;
        const float *xi = x + (size_t)i * ldx;
        float *yi = y + (size_t)i * ldy;
        for (int rr = r0; rr < r; rr += A512_NR) a512_tile_nt_of(type, wide, w, rr, A512_NR, xi, ldx, nt, yi, ldy, base);
        for (int rr = r; rr < r1; rr++) a512_tile_nt_of(type, wide, w, rr, 1, xi, ldx, nt, yi, ldy, base);
    }
}

GL_A512_INLINE void a512_matmul_typed(int type, int wide, const gl_mat *w, const float *x, int n, int ldx,
                                      float *y, int ldy, int r0, int r1) {
    const size_t slice = (size_t)(r1 - r0) * (size_t)w->cols * gl_type_size(type);
    if (n > A512_NT && (slice <= A512_L1_BYTES || (gl_type_size(type) <= 2 && slice <= A512_L2_SLICE_BYTES))) {
        a512_tokens_outer(type, wide, w, x, n, ldx, y, ldy, r0, r1);
        return;
    }
    const int nb = gl_token_block(w->cols, 4), r = a512_panels_end(n, (size_t)w->cols * gl_type_size(type), r0, r1);
    /* rows [r0, r6) in panels of 6, [r6, r4) of 4, the rest one at a time */
    const int r6 = wide && n > A512_NT ? r0 + (r1 - r0) / A512_NR_WIDE * A512_NR_WIDE : r0;
    const int r4 = r6 + (r - r6) / A512_NR * A512_NR;
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        if (wide) a512_panels(type, w, A512_NR_WIDE, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r0, r6);
        a512_panels(type, w, A512_NR, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r6, r4);
        if (r == r0 && ni <= A512_ROWWISE_MAX_N) a512_row_runs(type, w, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r4, r1);
        else a512_panels(type, w, 1, x + (size_t)i0 * ldx, ni, ldx, y + (size_t)i0 * ldy, ldy, r4, r1);
    }
}

static GL_A512 void a512_matmul_f32(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    a512_matmul_typed(GL_F32, 0, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_A512 void a512_matmul_f16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    a512_matmul_typed(GL_F16, 0, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_A512 void a512_matmul_bf16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    a512_matmul_typed(GL_BF16, 1, w, x, n, ldx, y, ldy, r0, r1);
}
static GL_A512 void a512_matmul_f8(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    a512_matmul_typed(GL_F8_E4M3, 0, w, x, n, ldx, y, ldy, r0, r1);
}

static void a512_matmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    switch (w->type) {
    case GL_F32:     a512_matmul_f32(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F16:     a512_matmul_f16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_BF16:    a512_matmul_bf16(w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_F8_E4M3: a512_matmul_f8(w, x, n, ldx, y, ldy, r0, r1); break;
    default:
        if (gl_type_is_block(w->type)) avx512_qmatmul(w, x, n, ldx, y, ldy, r0, r1);   /* quants.c, 16 lanes */
        else scalar_matmul(w, x, n, ldx, y, ldy, r0, r1);
        break;
    }
}

/* ---- W8A8 ---- */

/* sum_c x[c] of each of n int8 rows (exact). */
GL_A512_INLINE void a512_xsums(const int8_t *xq, int n, int ldx, int cols, int32_t *xsum) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int i = 0; i < n; i++) {
        const int8_t *xr = xq + (size_t)i * ldx;
        __m512i acc = _mm512_setzero_si512();
        for (int c = 0; c < cols; c += 64)
            acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(a512_mask64(cols - c), xr + c));
        xsum[i] = _mm512_reduce_add_epi32(acc);
    }
}

/* acc += w . x (u8 x s8, four bytes a lane).  gcc 12 rotates a tile's
 * accumulators through register copies and stack spills around the
 * intrinsic (a 4x4 tile ran at half speed from L2); tied in place by the
 * asm they stay put.  clang keeps the intrinsic. */
GL_A512_INLINE void a512_dpbusd(__m512i *acc, __m512i w, __m512i x) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(x));
#else
    *acc = _mm512_dpbusd_epi32(*acc, w, x);
#endif
}

/* The weights come in GL_Q8's 16-row panels (ggml_like.h): a panel's
 * 64-byte group g holds its 16 rows' columns 4g..4g+3, one row a lane, so a
 * vpdpbusd of the group (+128) with a token's 4 bytes broadcast adds four
 * products to each of the 16 rows' sums, which stay in their lanes: no
 * horizontal sums, each result vector is 16 consecutive rows, and the
 * layout was made at load, so nothing is packed here.
 *
 * A tile is 4 panels (64 rows) x up to 6 tokens: each group's four weight
 * vectors feed 24 vpdpbusd.  Rows of up to A512_Q8_KC columns (the per-head
 * absorbed products, short FFN rows), or up to A512_Q8_NT tokens, go whole,
 * every 6 tokens over the 4 panels while they sit in L1; longer rows with
 * more tokens take the columns a slice of A512_Q8_KC at a time (the 4
 * panels' slice, 32 KB, stays in L1 while every 6 tokens of a block pass
 * over it) and keep the block's sums on the stack between slices.  One or
 * two tokens (decode) go panel by panel, and so do 3-16 on a matrix that
 * comes from memory (a512_q8_runs, a512_q8_stream): a panel is one
 * sequential run of bytes, and a thread reads a few runs side by side,
 * one panel from each, where a tile's four panels interleave line by line. */
#define A512_Q8_NT 6       /* tokens per tile                        */
#define A512_Q8_KC 512     /* columns per slice, many tokens         */
#define A512_Q8_KNT 96     /* tokens whose sums wait on the stack    */
#define A512_Q8_PF 4096    /* prefetch distance streaming from DRAM, bytes */
#define A512_Q8_RUN_PF 2048 /* ... for each of several runs side by side (one run: A512_Q8_PF) */

static inline int32_t a512_load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
/* The first nb (< 4) bytes at p, zero-padded: a token's last, partial group
 * (never read past its cols). */
static inline int32_t a512_load_i32_part(const int8_t *p, int nb) { int32_t v = 0; memcpy(&v, p, (size_t)nb); return v; }

/* Rows [16P, 16P+16) clipped to [r0, r1): the lanes a panel stores. */
GL_A512_INLINE __mmask16 a512_rows_mask(int P, int r0, int r1) {
    int lo = r0 - 16 * P, hi = r1 - 16 * P;
    if (lo < 0) lo = 0;
    if (hi > 16) hi = 16;
    return hi <= lo ? 0 : (__mmask16)(a512_mask16(hi) & ~a512_mask16(lo));
}

/* y[t][16P + l] = (sum[l] - 128 xsum[t]) * wscale * xscale[t] on the lanes of m. */
GL_A512_INLINE void a512_q8_store(__m512i sum, int32_t xsum, float xs, const float *wscale, __mmask16 m, float *y) {
    const __m512 ws = _mm512_maskz_loadu_ps(m, wscale);
    __m512i s = _mm512_sub_epi32(sum, _mm512_set1_epi32((int32_t)((uint32_t)xsum << 7)));
    a512_store16(y, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), ws), _mm512_set1_ps(xs)));
}

/* acc[p][t] += panel p's groups [0, G) . token t's bytes: the panels start
 * at wp[p], token t's 4-byte groups at xq + t*ldx.  pf (if not 0): each
 * line read prefetches the one pf bytes on -- weights come from DRAM, and a
 * burst of loads would otherwise wait on its latency (prefetches never
 * fault, so pf may point past the matrix). */
GL_A512_INLINE void a512_q8_dot(const int8_t *const wp[4], int G, const int8_t *xq, int ldx, int nt,
                                __m512i acc[4][A512_Q8_NT], ptrdiff_t pf) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int g = 0; g < G; g++) {
        if (pf)
            for (int p = 0; p < 4; p++) _mm_prefetch((const char *)((uintptr_t)(wp[p] + 64 * (size_t)g) + (uintptr_t)pf), _MM_HINT_NTA);
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(wp[0] + 64 * (size_t)g), flip);
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(wp[1] + 64 * (size_t)g), flip);
        const __m512i w2 = _mm512_xor_si512(_mm512_loadu_si512(wp[2] + 64 * (size_t)g), flip);
        const __m512i w3 = _mm512_xor_si512(_mm512_loadu_si512(wp[3] + 64 * (size_t)g), flip);
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            const __m512i xb = _mm512_set1_epi32(a512_load_i32(xq + (size_t)t * ldx + 4 * (size_t)g));
            a512_dpbusd(&acc[0][t], w0, xb);
            a512_dpbusd(&acc[1][t], w1, xb);
            a512_dpbusd(&acc[2][t], w2, xb);
            a512_dpbusd(&acc[3][t], w3, xb);
        }
    }
}

/* The columns past the last whole group of 4 (cols % 4 of them): the
 * tokens' bytes there, zero-padded, as one group (never reading past cols). */
GL_A512_INLINE void a512_q8_dot_tail(const int8_t *const wp[4], int cols, const int8_t *xq, int ldx, int nt,
                                     __m512i acc[4][A512_Q8_NT]) {
    const int G = cols / 4, rem = cols - 4 * G;
    if (!rem) return;
    int32_t tail[A512_Q8_NT];
    for (int t = 0; t < nt; t++) tail[t] = a512_load_i32_part(xq + (size_t)t * ldx + 4 * (size_t)G, rem);
    const int8_t *wt[4] = {wp[0] + 64 * (size_t)G, wp[1] + 64 * (size_t)G, wp[2] + 64 * (size_t)G, wp[3] + 64 * (size_t)G};
    a512_q8_dot(wt, 1, (const int8_t *)tail, 4, nt, acc, 0);
}

/* Tokens [0, nt) x the 4 panels from P (those past the last one P1 repeat
 * P, and store nothing), the whole row. */
GL_A512_INLINE void a512_q8_tile(const gl_mat *w, int P, int P1, const int8_t *xq, int ldx, int nt, const int32_t *xsum,
                                 const float *xs, int r0, int r1, float *y, int ldy, ptrdiff_t pf) {
    const size_t ps = gl_q8_panel_bytes(w->cols);
    const int8_t *base = (const int8_t *)w->data;
    const int8_t *wp[4];
    __m512i acc[4][A512_Q8_NT];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        wp[p] = base + (size_t)(P + p < P1 ? P + p : P) * ps;
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) acc[p][t] = _mm512_setzero_si512();
    }
    a512_q8_dot(wp, w->cols / 4, xq, ldx, nt, acc, pf);
    a512_q8_dot_tail(wp, w->cols, xq, ldx, nt, acc);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const __mmask16 m = P + p < P1 ? a512_rows_mask(P + p, r0, r1) : 0;
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++)
            a512_q8_store(acc[p][t], xsum[t], xs[t], w->scale + 16 * (P + p), m, y + (size_t)t * ldy + 16 * (P + p));
    }
}

/* As a512_q8_tile over one slice of columns, the sums kept in acc[t][64]. */
GL_A512_INLINE void a512_q8_slice(const int8_t *const wp[4], int G, int cols_left, const int8_t *xq, int ldx, int nt,
                                  int32_t *acc, ptrdiff_t pf) {
    __m512i a[4][A512_Q8_NT];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) a[p][t] = _mm512_loadu_si512(acc + (size_t)t * 64 + 16 * p);
    a512_q8_dot(wp, G, xq, ldx, nt, a, pf);
    if (cols_left <= A512_Q8_KC) a512_q8_dot_tail(wp, cols_left, xq, ldx, nt, a);   /* the last slice */
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) _mm512_storeu_si512(acc + (size_t)t * 64 + 16 * p, a[p][t]);
}

#define A512_Q8_BY_NT(call_nt, nt) do { switch (nt) { \
    case 6: call_nt(6); break; case 5: call_nt(5); break; case 4: call_nt(4); break; \
    case 3: call_nt(3); break; case 2: call_nt(2); break; case 1: call_nt(1); break; } } while (0)

/* Many tokens: blocks of A512_Q8_KNT, each over 64 rows a slice of columns at a time. */
GL_A512_INLINE void a512_q8_sliced(const gl_mat *w, int n, const int8_t *xq, int ldx, const int32_t *xsum,
                                   const float *xs, int r0, int r1, float *y, int ldy) {
    int32_t acc[A512_Q8_KNT * 64];
    const size_t ps = gl_q8_panel_bytes(w->cols);
    const int cols = w->cols, P1 = (r1 + 15) / 16;
    for (int i0 = 0; i0 < n; i0 += A512_Q8_KNT) {
        const int ni = n - i0 < A512_Q8_KNT ? n - i0 : A512_Q8_KNT;
        for (int P = r0 / 16; P < P1; P += 4) {
            memset(acc, 0, sizeof(int32_t) * 64 * (size_t)ni);
            for (int c0 = 0; c0 < cols; c0 += A512_Q8_KC) {
                const int left = cols - c0, G = (left < A512_Q8_KC ? left : A512_Q8_KC) / 4;
                const int8_t *wp[4];
                for (int p = 0; p < 4; p++)
                    wp[p] = (const int8_t *)w->data + (size_t)(P + p < P1 ? P + p : P) * ps + (size_t)c0 * 16;
                for (int i = 0; i < ni; i += A512_Q8_NT) {
                    const int nt = ni - i < A512_Q8_NT ? ni - i : A512_Q8_NT;
                    const int8_t *xi = xq + (size_t)(i0 + i) * ldx + c0;
                    int32_t *ai = acc + (size_t)i * 64;
                    /* the block's first tile brings in the next slice (or the next panels') */
                    const ptrdiff_t pf = i ? 0 : left > A512_Q8_KC ? 16 * A512_Q8_KC : (ptrdiff_t)(4 * ps) - 16 * c0;
#define A512_Q8_SLICE(k) a512_q8_slice(wp, G, left, xi, ldx, k, ai, pf)
                    A512_Q8_BY_NT(A512_Q8_SLICE, nt);
#undef A512_Q8_SLICE
                }
            }
            for (int p = 0; p < 4 && P + p < P1; p++) {
                const __mmask16 m = a512_rows_mask(P + p, r0, r1);
                for (int t = 0; t < ni; t++)
                    a512_q8_store(_mm512_loadu_si512(acc + (size_t)t * 64 + 16 * p), xsum[i0 + t], xs[i0 + t],
                                  w->scale + 16 * (P + p), m, y + (size_t)(i0 + t) * ldy + 16 * (P + p));
            }
        }
    }
}

/* One or two tokens over the panels [P, P + ns*part): ns panels at once,
 * the i-th of each of ns equal runs, so that a thread reads ns sequential
 * runs of bytes side by side -- one run at a time leaves the core short of
 * misses in flight (a Zen 5 core: 58-65 GB/s on 2 threads one run each,
 * 79-81 with four and the prefetch 2 KB ahead, against a read limit of
 * 78-80).  Two sums a (panel, token), over alternate groups: DRAM, not the
 * vpdpbusd latency, bounds a few tokens.  Integer sums, so the order of
 * the groups changes no bit.  ns is a constant where it is called. */
GL_A512_INLINE void a512_q8_runs(const gl_mat *w, const int ns, int nt, int P, int part, const int8_t *xq, int ldx,
                                 const int32_t *xsum, const float *xs, int r0, int r1, float *y, int ldy) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const size_t ps = gl_q8_panel_bytes(w->cols);
    const int G = w->cols / 4, G2 = G & ~1, rem = w->cols - 4 * G;
    for (int i = 0; i < part; i++) {
        const int8_t *wp[4];
        __m512i a[4][2][2];                    /* [run][token][alternate groups] */
#pragma GCC unroll 4
        for (int s = 0; s < ns; s++) {
            wp[s] = (const int8_t *)w->data + (size_t)(P + s * part + i) * ps;
            a[s][0][0] = a[s][0][1] = a[s][1][0] = a[s][1][1] = _mm512_setzero_si512();
        }
        for (int g = 0; g < G2; g += 2) {
#pragma GCC unroll 2
            for (int j = 0; j < 2; j++) {
                const __m512i x0 = _mm512_set1_epi32(a512_load_i32(xq + 4 * (size_t)(g + j)));
                const __m512i x1 = nt > 1 ? _mm512_set1_epi32(a512_load_i32(xq + ldx + 4 * (size_t)(g + j))) : x0;
#pragma GCC unroll 4
                for (int s = 0; s < ns; s++) {
                    const int8_t *line = wp[s] + 64 * (size_t)(g + j);
                    _mm_prefetch((const char *)((uintptr_t)line + A512_Q8_RUN_PF), _MM_HINT_NTA);
                    const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(line), flip);
                    a512_dpbusd(&a[s][0][j], wv, x0);
                    if (nt > 1) a512_dpbusd(&a[s][1][j], wv, x1);
                }
            }
        }
        for (int g = G2; g < G + (rem > 0); g++) {     /* an odd last group, and the partial one */
            const int nb = g < G ? 4 : rem;
            const __m512i x0 = _mm512_set1_epi32(a512_load_i32_part(xq + 4 * (size_t)g, nb));
            const __m512i x1 = nt > 1 ? _mm512_set1_epi32(a512_load_i32_part(xq + ldx + 4 * (size_t)g, nb)) : x0;
#pragma GCC unroll 4
            for (int s = 0; s < ns; s++) {
                const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(wp[s] + 64 * (size_t)g), flip);
                a512_dpbusd(&a[s][0][0], wv, x0);
                if (nt > 1) a512_dpbusd(&a[s][1][0], wv, x1);
            }
        }
#pragma GCC unroll 4
        for (int s = 0; s < ns; s++) {
            const int Ps = P + s * part + i;
            const __mmask16 m = a512_rows_mask(Ps, r0, r1);
            for (int t = 0; t < nt; t++)
                a512_q8_store(_mm512_add_epi32(a[s][t][0], a[s][t][1]), xsum[t], xs[t], w->scale + 16 * Ps, m,
                              y + (size_t)t * ldy + 16 * Ps);
        }
    }
}

/* One or two tokens (decode) over rows [r0, r1): the panels four runs at a
 * time, the last few one at a time. */
GL_A512_INLINE void a512_q8_decode(const gl_mat *w, int nt, const int8_t *xq, int ldx, const int32_t *xsum,
                                   const float *xs, int r0, int r1, float *y, int ldy) {
    const int P0 = r0 / 16, np = (r1 + 15) / 16 - P0, part = np / 4;
    if (nt == 1) a512_q8_runs(w, 4, 1, P0, part, xq, ldx, xsum, xs, r0, r1, y, ldy);   /* nt a constant */
    else a512_q8_runs(w, 4, 2, P0, part, xq, ldx, xsum, xs, r0, r1, y, ldy);
    for (int P = P0 + 4 * part; P < P0 + np; P++) a512_q8_runs(w, 1, nt, P, 1, xq, ldx, xsum, xs, r0, r1, y, ldy);
}

/* acc += w . (token's 4 bytes at p, broadcast): the broadcast folded into
 * the vpdpbusd as its memory operand, so streaming one panel past many
 * tokens costs no shuffle per product. */
GL_A512_INLINE void a512_dpbusd_b4(__m512i *acc, __m512i w, const int8_t *p) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(w), "m"(*(const int8_t (*)[4])p));
#else
    *acc = _mm512_dpbusd_epi32(*acc, w, _mm512_set1_epi32(a512_load_i32(p)));
#endif
}

/* 3 to A512_Q8_STREAM_NT tokens (a decode batch's few per expert), R
 * panels at a time as a512_q8_runs: R sequential runs of bytes side by
 * side, and each 64-byte group feeds every token.  The tokens come
 * interleaved, xt[g * ntp + t] = token t's group g (zero-padded like the
 * weights; tokens nt .. ntp-1 are zeros), so one pointer reaches them all.
 * R x TMAX sums: about ten vpdpbusd in flight whatever nt is (their latency
 * would otherwise bound a few tokens).  TMAX and R are constants where it
 * is called: the sums stay in registers, and 3-16 tokens share three copies
 * of the loop (ntp a multiple of 4 up to TMAX: the padding's products are
 * free while the weights stream in). */
#define A512_Q8_STREAM_NT 16
#define A512_Q8_STREAM_BYTES 32768   /* the interleaved tokens, on the stack */
/* Small matrices stream too.  A head's absorbed product (64 KB) had gone
 * to the tiles, which share each broadcast token among 4 panels and were
 * 10-35% faster from L1/L2, while each device group re-read it; once the
 * groups share one pass it comes from DRAM, where the tiles reached 4-7
 * GB/s against 24-27 streaming (512x128, 16 tokens, 2 threads).  bench-M
 * INT8 16 streams, TPOT medians of 6 alternating runs: 12.23 -> 11.78 ms;
 * the paper preset and the trained model's 16 streams no slower. */
GL_A512_INLINE void a512_q8_stream_runs(const gl_mat *w, const int R, const int TMAX, int ntp, int nt, int P,
                                        int part, const int8_t *xt, const int32_t *xsum, const float *xs, int r0,
                                        int r1, float *y, int ldy) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const size_t ps = gl_q8_panel_bytes(w->cols);
    const int G = gl_q8_cols4(w->cols) / 4;
    for (int i = 0; i < part; i++) {
        const int8_t *wp[4];
        __m512i a[A512_Q8_STREAM_NT];          /* run s's sum for token t: a[s * TMAX + t] */
#pragma GCC unroll 4
        for (int s = 0; s < R; s++) wp[s] = (const int8_t *)w->data + (size_t)(P + s * part + i) * ps;
#pragma GCC unroll 16
        for (int k = 0; k < R * TMAX; k++) a[k] = _mm512_setzero_si512();
        for (int g = 0; g < G; g++) {
            const int8_t *xg = xt + 4 * (size_t)g * ntp;
#pragma GCC unroll 4
            for (int s = 0; s < R; s++) {
                const int8_t *line = wp[s] + 64 * (size_t)g;
                _mm_prefetch((const char *)((uintptr_t)line + (R > 1 ? A512_Q8_RUN_PF : A512_Q8_PF)), _MM_HINT_NTA);
                const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(line), flip);
#pragma GCC unroll 16
                for (int t = 0; t < TMAX; t++) {
                    if (TMAX > 4 && t % 4 == 0 && t >= ntp) break;   /* one test a chunk of 4 */
                    a512_dpbusd_b4(&a[s * TMAX + t], wv, xg + 4 * t);
                }
            }
        }
#pragma GCC unroll 4
        for (int s = 0; s < R; s++) {
            const int Ps = P + s * part + i;
            const __mmask16 m = a512_rows_mask(Ps, r0, r1);
#pragma GCC unroll 16
            for (int t = 0; t < TMAX && t < nt; t++)
                a512_q8_store(a[s * TMAX + t], xsum[t], xs[t], w->scale + 16 * Ps, m, y + (size_t)t * ldy + 16 * Ps);
        }
    }
}

/* Rows [r0, r1): the panels R runs at a time, the last few one at a time. */
GL_A512_INLINE void a512_q8_stream(const gl_mat *w, const int R, const int TMAX, int ntp, int nt, const int8_t *xt,
                                   const int32_t *xsum, const float *xs, int r0, int r1, float *y, int ldy) {
    const int P0 = r0 / 16, np = (r1 + 15) / 16 - P0, part = np / R;
    a512_q8_stream_runs(w, R, TMAX, ntp, nt, P0, part, xt, xsum, xs, r0, r1, y, ldy);
    for (int P = P0 + R * part; P < P0 + np; P++)
        a512_q8_stream_runs(w, 1, TMAX, ntp, nt, P, 1, xt, xsum, xs, r0, r1, y, ldy);
}

/* xt[g * ntp + t] = token t's bytes 4g..4g+3 (zero past cols, and for the
 * padding tokens nt .. ntp-1). */
GL_A512_INLINE void a512_q8_interleave(const int8_t *xq, int nt, int ntp, int ldx, int cols, int32_t *xt) {
    const int G = gl_q8_cols4(cols) / 4, whole = cols / 4;
    for (int t = 0; t < nt; t++) {
        const int8_t *xr = xq + (size_t)t * ldx;
        for (int g = 0; g < whole; g++) xt[(size_t)g * ntp + t] = a512_load_i32(xr + 4 * g);
        if (whole < G) xt[(size_t)whole * ntp + t] = a512_load_i32_part(xr + 4 * whole, cols - 4 * whole);
    }
    for (int t = nt; t < ntp; t++)
        for (int g = 0; g < G; g++) xt[(size_t)g * ntp + t] = 0;
}

static GL_A512 void a512_matmul_q8(const gl_mat *w, const int8_t *xq, const float *xscale, int n, int ldx,
                                   float *y, int ldy, int r0, int r1) {
    int32_t xsum[A512_XSUM_MAX];
    if (r1 <= r0) return;
    for (int i0 = 0; i0 < n; i0 += A512_XSUM_MAX) {
        const int ni = n - i0 < A512_XSUM_MAX ? n - i0 : A512_XSUM_MAX;
        const int8_t *xb = xq + (size_t)i0 * ldx;
        const float *xs = xscale + i0;
        float *yb = y + (size_t)i0 * ldy;
        a512_xsums(xb, ni, ldx, w->cols, xsum);
        const int ntp = (ni + 3) & ~3;                  /* tokens interleaved, with the padding */
        if (ni <= 2) a512_q8_decode(w, ni, xb, ldx, xsum, xs, r0, r1, yb, ldy);
        else if (ni <= A512_Q8_STREAM_NT &&
                 (size_t)ntp * gl_q8_cols4(w->cols) <= A512_Q8_STREAM_BYTES) {
            _Alignas(64) int32_t xt[A512_Q8_STREAM_BYTES / 4];
            a512_q8_interleave(xb, ni, ntp, ldx, w->cols, xt);
            const int8_t *x8 = (const int8_t *)xt;
            if (ni <= 4) a512_q8_stream(w, 4, 4, 4, ni, x8, xsum, xs, r0, r1, yb, ldy);
            else if (ni <= 8) a512_q8_stream(w, 2, 8, ntp, ni, x8, xsum, xs, r0, r1, yb, ldy);
            else a512_q8_stream(w, 1, 16, ntp, ni, x8, xsum, xs, r0, r1, yb, ldy);
        } else if (ni <= A512_Q8_NT || w->cols <= A512_Q8_KC) {   /* whole rows, the sums in registers */
            const int P1 = (r1 + 15) / 16;
            for (int P = r0 / 16; P < P1; P += 4)
                for (int i = 0; i < ni; i += A512_Q8_NT) {   /* the 4 panels (<= 32 KB) stay in L1 */
                    const int nt = ni - i < A512_Q8_NT ? ni - i : A512_Q8_NT;
                    /* the first tile streams them in and prefetches the next 4 */
                    const ptrdiff_t pf = i ? 0 : ni <= A512_Q8_NT ? A512_Q8_PF : (ptrdiff_t)(4 * gl_q8_panel_bytes(w->cols));
#define A512_Q8_TILE(k) a512_q8_tile(w, P, P1, xb + (size_t)i * ldx, ldx, k, xsum + i, xs + i, r0, r1, yb + (size_t)i * ldy, ldy, pf)
                    A512_Q8_BY_NT(A512_Q8_TILE, nt);
#undef A512_Q8_TILE
                }
        } else a512_q8_sliced(w, ni, xb, ldx, xsum, xs, r0, r1, yb, ldy);
    }
}

/* Same values as scalar_quantize_q8: max|x| is exact in any order, x*inv is
 * one rounding, cvtps rounds to nearest even like lrintf, and the
 * saturating narrowing then the max with -127 clamp as the scalar set. */
static GL_A512 void a512_quantize_q8(const float *x, int n, int cols, int ldx, int8_t *q, int ldq, float *scale) {
    const __m128i lo = _mm_set1_epi8(-127);
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * ldx;
        int8_t *qr = q + (size_t)i * ldq;
        __m512 m = _mm512_setzero_ps();
        int c = 0;
        for (; c + 16 <= cols; c += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xr + c)));
        if (c < cols) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(a512_mask16(cols - c), xr + c)));
        float amax = _mm512_reduce_max_ps(m);
        float inv = amax > 0 ? 127.0f / amax : 0;
        const __m512 vinv = _mm512_set1_ps(inv);
        for (c = 0; c < cols; c += 16) {
            __mmask16 k = cols - c >= 16 ? (__mmask16)0xffff : a512_mask16(cols - c);
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + c), vinv));
            a512_store16_epi8(qr + c, k, _mm_max_epi8(_mm512_cvtsepi32_epi8(v), lo));
        }
        scale[i] = amax / 127.0f;
    }
}

/* Four 16-lane accumulators (c/16 mod 4), summed (a0+a1)+(a2+a3), then as
 * a512_hsum; the tail is one zero-padded block. */
static GL_A512 float a512_dot(const float *a, const float *b, int n) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int c = 0, k = 0;
    for (; c + 64 <= n; c += 64)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 16 * j), _mm512_loadu_ps(b + c + 16 * j), acc[j]);
    for (; c + 16 <= n; c += 16, k++) acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc[k]);
    if (c < n) {
        __mmask16 m = a512_mask16(n - c);
        acc[k] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, b + c), acc[k]);
    }
    return a512_hsum(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

/* Elementwise y = fma(a, x, y): the same bits at any vector width. */
static GL_A512 void a512_axpy(float *y, const float *x, float a, int n) {
    const __m512 va = _mm512_set1_ps(a);
    int c = 0;
    for (; c + 16 <= n; c += 16) _mm512_storeu_ps(y + c, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c)));
    if (c < n) {
        __mmask16 m = a512_mask16(n - c);
        _mm512_mask_storeu_ps(y + c, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + c), _mm512_maskz_loadu_ps(m, y + c)));
    }
}

/* m fused axpys over 64 columns at a time, y held in 4 registers */
static GL_A512 void a512_axpy_rows(float *y, const float *x, int ldx, const float *a, int m, int n) {
    int c = 0;
    for (; c + 64 <= n; c += 64) {
        __m512 y0 = _mm512_loadu_ps(y + c), y1 = _mm512_loadu_ps(y + c + 16);
        __m512 y2 = _mm512_loadu_ps(y + c + 32), y3 = _mm512_loadu_ps(y + c + 48);
        for (int j = 0; j < m; j++) {
            const float *xr = x + (size_t)j * ldx + c;
            const __m512 va = _mm512_set1_ps(a[j]);
            y0 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xr), y0);
            y1 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xr + 16), y1);
            y2 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xr + 32), y2);
            y3 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xr + 48), y3);
        }
        _mm512_storeu_ps(y + c, y0); _mm512_storeu_ps(y + c + 16, y1);
        _mm512_storeu_ps(y + c + 32, y2); _mm512_storeu_ps(y + c + 48, y3);
    }
    for (; c < n; c += 16) {
        __mmask16 k = n - c >= 16 ? (__mmask16)0xffff : a512_mask16(n - c);
        __m512 y0 = _mm512_maskz_loadu_ps(k, y + c);
        for (int j = 0; j < m; j++) y0 = _mm512_fmadd_ps(_mm512_set1_ps(a[j]), _mm512_maskz_loadu_ps(k, x + (size_t)j * ldx + c), y0);
        a512_store16(y + c, k, y0);
    }
}

/* Rows of fp32 or (bf16 = 1) of bf16 values, 16 elements from element i:
 * a bf16 value is the top half of its fp32, so it widens exactly. */
GL_A512_INLINE __m512 a512_bf16x16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

GL_A512_INLINE __m512 a512_row16(const void *x, size_t i, __mmask16 k, int bf16) {
    return bf16 ? a512_bf16x16((const uint16_t *)x + i, k) : _mm512_maskz_loadu_ps(k, (const float *)x + i);
}

/* One head's m fused axpys over rows given by pointers (row j at xr[j]),
 * columns [c0, n) 16 at a time, the last ones masked. */
GL_A512_INLINE void a512_axpy_rowp(float *y, const void *const *xr, int c0, const float *a, int m, int n, int bf16) {
    for (int c = c0; c < n; c += 16) {
        __mmask16 k = n - c >= 16 ? (__mmask16)0xffff : a512_mask16(n - c);
        __m512 y0 = _mm512_maskz_loadu_ps(k, y + c);
        for (int j = 0; j < m; j++) y0 = _mm512_fmadd_ps(_mm512_set1_ps(a[j]), a512_row16(xr[j], c, k, bf16), y0);
        a512_store16(y + c, k, y0);
    }
}

/* Four heads' sums over columns [c, c + 64): 16 accumulators, so each x
 * vector loaded serves four heads and each weight broadcast four vectors --
 * half a load per FMA. */
GL_A512_INLINE void a512_axpy4x64(float *y, int ldy, const void *const *xr, const float *a, int lda, int m, int c,
                                  int bf16) {
    const __mmask16 all = 0xffff;
    const float *a0 = a, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    float *y0 = y + c, *y1 = y0 + ldy, *y2 = y1 + ldy, *y3 = y2 + ldy;
#define A512_LD4(s, yk) __m512 s##0 = _mm512_loadu_ps(yk), s##1 = _mm512_loadu_ps(yk + 16), \
                               s##2 = _mm512_loadu_ps(yk + 32), s##3 = _mm512_loadu_ps(yk + 48)
#define A512_FMA4(s, ak) do { const __m512 v_ = _mm512_set1_ps(ak[j]); \
        s##0 = _mm512_fmadd_ps(v_, x0, s##0); s##1 = _mm512_fmadd_ps(v_, x1, s##1); \
        s##2 = _mm512_fmadd_ps(v_, x2, s##2); s##3 = _mm512_fmadd_ps(v_, x3, s##3); } while (0)
#define A512_ST4(s, yk) do { _mm512_storeu_ps(yk, s##0); _mm512_storeu_ps(yk + 16, s##1); \
        _mm512_storeu_ps(yk + 32, s##2); _mm512_storeu_ps(yk + 48, s##3); } while (0)
    A512_LD4(s0, y0); A512_LD4(s1, y1); A512_LD4(s2, y2); A512_LD4(s3, y3);
    for (int j = 0; j < m; j++) {    /* named sums: an array of them made gcc store each step */
        const void *row = xr[j];
        const __m512 x0 = a512_row16(row, c, all, bf16), x1 = a512_row16(row, c + 16, all, bf16);
        const __m512 x2 = a512_row16(row, c + 32, all, bf16), x3 = a512_row16(row, c + 48, all, bf16);
        A512_FMA4(s0, a0); A512_FMA4(s1, a1); A512_FMA4(s2, a2); A512_FMA4(s3, a3);
    }
    A512_ST4(s0, y0); A512_ST4(s1, y1); A512_ST4(s2, y2); A512_ST4(s3, y3);
#undef A512_LD4
#undef A512_FMA4
#undef A512_ST4
}

/* Four outputs (heads) at a time over 64 columns, then 32, then a head at a
 * time: each x vector loaded serves four heads.  Every element is y =
 * fma(a_j, x_j, y) for j in order, as a512_axpy_rows -- on fp32 rows, or on
 * bf16 rows widened in registers (the same bits as on the widened rows,
 * half the bytes).  Rows by pointer, so a chunk of keys spread over KV
 * blocks is one call: its sums stay in registers across the blocks. */
GL_A512_INLINE void a512_axpy_rowp_n_of(float *y, int ldy, const void *const *xr, const float *a, int lda, int nh,
                                        int m, int n, int bf16) {
    const __mmask16 all = 0xffff;
    /* 64 columns at a time, every group of four heads in turn: the rows'
     * 64 columns stay in L1 for all of them */
    const int c64 = nh >= 4 ? n / 64 * 64 : 0;
    for (int c = 0; c < c64; c += 64)
        for (int h = 0; h + 4 <= nh; h += 4)
            a512_axpy4x64(y + (size_t)h * ldy, ldy, xr, a + (size_t)h * lda, lda, m, c, bf16);
    int h = 0;
    for (; h + 4 <= nh; h += 4) {
        float *y0 = y + (size_t)h * ldy, *y1 = y0 + ldy, *y2 = y1 + ldy, *y3 = y2 + ldy;
        const float *a0 = a + (size_t)h * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
        int c = c64;
        for (; c + 32 <= n; c += 32) {
            __m512 s00 = _mm512_loadu_ps(y0 + c), s01 = _mm512_loadu_ps(y0 + c + 16);
            __m512 s10 = _mm512_loadu_ps(y1 + c), s11 = _mm512_loadu_ps(y1 + c + 16);
            __m512 s20 = _mm512_loadu_ps(y2 + c), s21 = _mm512_loadu_ps(y2 + c + 16);
            __m512 s30 = _mm512_loadu_ps(y3 + c), s31 = _mm512_loadu_ps(y3 + c + 16);
            for (int j = 0; j < m; j++) {
                const __m512 x0 = a512_row16(xr[j], c, all, bf16), x1 = a512_row16(xr[j], c + 16, all, bf16);
                __m512 v = _mm512_set1_ps(a0[j]);
                s00 = _mm512_fmadd_ps(v, x0, s00); s01 = _mm512_fmadd_ps(v, x1, s01);
                v = _mm512_set1_ps(a1[j]);
                s10 = _mm512_fmadd_ps(v, x0, s10); s11 = _mm512_fmadd_ps(v, x1, s11);
                v = _mm512_set1_ps(a2[j]);
                s20 = _mm512_fmadd_ps(v, x0, s20); s21 = _mm512_fmadd_ps(v, x1, s21);
                v = _mm512_set1_ps(a3[j]);
                s30 = _mm512_fmadd_ps(v, x0, s30); s31 = _mm512_fmadd_ps(v, x1, s31);
            }
            _mm512_storeu_ps(y0 + c, s00); _mm512_storeu_ps(y0 + c + 16, s01);
            _mm512_storeu_ps(y1 + c, s10); _mm512_storeu_ps(y1 + c + 16, s11);
            _mm512_storeu_ps(y2 + c, s20); _mm512_storeu_ps(y2 + c + 16, s21);
            _mm512_storeu_ps(y3 + c, s30); _mm512_storeu_ps(y3 + c + 16, s31);
        }
        if (c < n)   /* the last columns, a head at a time */
            for (int k = 0; k < 4; k++) a512_axpy_rowp(y + (size_t)(h + k) * ldy, xr, c, a + (size_t)(h + k) * lda, m, n, bf16);
    }
    for (; h < nh; h++) a512_axpy_rowp(y + (size_t)h * ldy, xr, 0, a + (size_t)h * lda, m, n, bf16);
}

/* The same over rows at x + j * ldx: GL_ROWP_MAX rows a call (a sum is
 * stored and reloaded between them, exactly), so each piece of rows stays
 * in cache for every head. */
GL_A512_INLINE void a512_axpy_rows_n_of(float *y, int ldy, const void *x, int ldx, const float *a, int lda, int nh,
                                        int m, int n, int bf16) {
    const void *xr[GL_ROWP_MAX];
    const size_t es = bf16 ? 2 : 4;
    for (int j0 = 0; j0 < m; j0 += GL_ROWP_MAX) {
        const int mm = m - j0 < GL_ROWP_MAX ? m - j0 : GL_ROWP_MAX;
        for (int j = 0; j < mm; j++) xr[j] = (const char *)x + (size_t)(j0 + j) * ldx * es;
        a512_axpy_rowp_n_of(y, ldy, xr, a + j0, lda, nh, mm, n, bf16);
    }
}

static GL_A512 void a512_axpy_rows_n(float *y, int ldy, const float *x, int ldx, const float *a, int lda, int nh, int m,
                                     int n) {
    a512_axpy_rows_n_of(y, ldy, x, ldx, a, lda, nh, m, n, 0);
}

static GL_A512 void a512_axpy_rows_n_bf16(float *y, int ldy, const uint16_t *x, int ldx, const float *a, int lda,
                                          int nh, int m, int n) {
    a512_axpy_rows_n_of(y, ldy, x, ldx, a, lda, nh, m, n, 1);
}

static GL_A512 void a512_axpy_rowp_n(float *y, int ldy, const float *const *xr, const float *a, int lda, int nh, int m,
                                     int n) {
    a512_axpy_rowp_n_of(y, ldy, (const void *const *)xr, a, lda, nh, m, n, 0);
}

static GL_A512 void a512_axpy_rowp_n_bf16(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda,
                                          int nh, int m, int n) {
    a512_axpy_rowp_n_of(y, ldy, (const void *const *)xr, a, lda, nh, m, n, 1);
}

/* e^x on 16 lanes: avx2_exp's steps, op for op (so each value has the same
 * bits as in the AVX2 set). */
GL_A512_INLINE __m512 a512_exp(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(GL_EXP_LO), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(GL_EXP_HI)), _mm512_set1_ps(GL_EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(GL_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GL_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GL_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(GL_EXP_C7);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GL_EXP_C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GL_EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GL_EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GL_EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GL_EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

/* The exponentials summed in 16 lanes (added as a512_hsum); the tail is
 * masked (its lanes add 0). */
static GL_A512 float a512_exp_sum(float *x, int n, float scale, float shift) {
    const __m512 vm = _mm512_set1_ps(shift), vs = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        __mmask16 k = n - c >= 16 ? (__mmask16)0xffff : a512_mask16(n - c);
        __m512 v = a512_exp(_mm512_mul_ps(vs, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm)));
        v = _mm512_maskz_mov_ps(k, v);
        a512_store16(x + c, k, v);
        sum = _mm512_add_ps(sum, v);
    }
    return a512_hsum(sum);
}

GL_A512_INLINE __m512 a512_silu_mul16(__m512 a, __m512 b) {
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), a512_exp(_mm512_sub_ps(_mm512_setzero_ps(), a)));
    return _mm512_mul_ps(_mm512_div_ps(a, d), b);
}

static GL_A512 void a512_silu_mul(float *a, const float *b, int n) {
    for (int c = 0; c < n; c += 16) {
        __mmask16 k = n - c >= 16 ? (__mmask16)0xffff : a512_mask16(n - c);
        a512_store16(a + c, k, a512_silu_mul16(_mm512_maskz_loadu_ps(k, a + c), _mm512_maskz_loadu_ps(k, b + c)));
    }
}

/* dot_rows_t: 16 lanes (one vector of qt) against 16 rows at a time, each
 * row element broadcast from memory into its own accumulator -- no
 * horizontal sums, and every lane a chain of FMAs in c order.  The rows are
 * reached from four moving pointers at 0, L, 2L and 3L bytes (a row array
 * or 16 pointers made gcc spill the accumulators every step). */
/* Accumulators [row][lane] stored to y transposed: lane l of row j to
 * y[l * ldy + j], for the first nl lanes. */
GL_A512_INLINE void a512_store_rows_t(const __m512 *acc, int rows, float *y, int ldy, int nl) {
    float t[16][16];
    for (int j = 0; j < rows; j++) _mm512_storeu_ps(t[j], acc[j]);
    for (int l = 0; l < nl; l++)
        for (int j = 0; j < rows; j++) y[(size_t)l * ldy + j] = t[j][l];
}

#define A512_BC(p, o) _mm512_set1_ps(*(const float *)((const char *)(p) + (o)))
GL_A512_INLINE void a512_dot16_rows(const float *qt, size_t ldq, __mmask16 mk, const float *x, size_t ldx, int n,
                                    float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(float), L3 = 3 * L;
    const char *p0 = (const char *)x, *p1 = p0 + 4 * L, *p2 = p1 + 4 * L, *p3 = p2 + 4 * L;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p0 += 4, p1 += 4, p2 += 4, p3 += 4) {
        const __m512 v = _mm512_maskz_loadu_ps(mk, q);
        a0 = _mm512_fmadd_ps(v, A512_BC(p0, 0), a0);      a1 = _mm512_fmadd_ps(v, A512_BC(p0, L), a1);
        a2 = _mm512_fmadd_ps(v, A512_BC(p0, 2 * L), a2);  a3 = _mm512_fmadd_ps(v, A512_BC(p0, L3), a3);
        a4 = _mm512_fmadd_ps(v, A512_BC(p1, 0), a4);      a5 = _mm512_fmadd_ps(v, A512_BC(p1, L), a5);
        a6 = _mm512_fmadd_ps(v, A512_BC(p1, 2 * L), a6);  a7 = _mm512_fmadd_ps(v, A512_BC(p1, L3), a7);
        a8 = _mm512_fmadd_ps(v, A512_BC(p2, 0), a8);      a9 = _mm512_fmadd_ps(v, A512_BC(p2, L), a9);
        a10 = _mm512_fmadd_ps(v, A512_BC(p2, 2 * L), a10); a11 = _mm512_fmadd_ps(v, A512_BC(p2, L3), a11);
        a12 = _mm512_fmadd_ps(v, A512_BC(p3, 0), a12);    a13 = _mm512_fmadd_ps(v, A512_BC(p3, L), a13);
        a14 = _mm512_fmadd_ps(v, A512_BC(p3, 2 * L), a14); a15 = _mm512_fmadd_ps(v, A512_BC(p3, L3), a15);
    }
    const __m512 acc[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
    a512_store_rows_t(acc, 16, y, ldy, nl);
}

/* The last m % 16 rows: four, then one at a time. */
GL_A512_INLINE void a512_dot4_rows(const float *qt, size_t ldq, __mmask16 mk, const float *x, size_t ldx, int n,
                                   float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(float);
    const char *p = (const char *)x;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p += 4) {
        const __m512 v = _mm512_maskz_loadu_ps(mk, q);
        a0 = _mm512_fmadd_ps(v, A512_BC(p, 0), a0);     a1 = _mm512_fmadd_ps(v, A512_BC(p, L), a1);
        a2 = _mm512_fmadd_ps(v, A512_BC(p, 2 * L), a2); a3 = _mm512_fmadd_ps(v, A512_BC(p, 3 * L), a3);
    }
    const __m512 acc[4] = {a0, a1, a2, a3};
    a512_store_rows_t(acc, 4, y, ldy, nl);
}

GL_A512_INLINE void a512_dot1_row(const float *qt, size_t ldq, __mmask16 mk, const float *x, int n, float *y, int ldy,
                                  int nl) {
    __m512 a0 = _mm512_setzero_ps();
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq) a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q), _mm512_set1_ps(x[c]), a0);
    float t[16];
    _mm512_storeu_ps(t, a0);
    for (int l = 0; l < nl; l++) y[(size_t)l * ldy] = t[l];
}
/* 64 lanes (four vectors of qt) against 4 rows: each qt vector loaded
 * serves four rows and each row element broadcast serves 64 lanes -- half a
 * load per FMA, where one vector against 16 rows took one (and the core
 * ran at 70% of the FMA peak, bound by loads). */
GL_A512_INLINE void a512_dot4x4_rows(const float *qt, size_t ldq, const float *x, size_t ldx, int n, float *y,
                                     int ldy) {
    const size_t L = ldx * sizeof(float);
    const char *p = (const char *)x;
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq, p += 4) {
        const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
        const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
        __m512 b = A512_BC(p, 0);
        a00 = _mm512_fmadd_ps(q0, b, a00); a01 = _mm512_fmadd_ps(q1, b, a01);
        a02 = _mm512_fmadd_ps(q2, b, a02); a03 = _mm512_fmadd_ps(q3, b, a03);
        b = A512_BC(p, L);
        a10 = _mm512_fmadd_ps(q0, b, a10); a11 = _mm512_fmadd_ps(q1, b, a11);
        a12 = _mm512_fmadd_ps(q2, b, a12); a13 = _mm512_fmadd_ps(q3, b, a13);
        b = A512_BC(p, 2 * L);
        a20 = _mm512_fmadd_ps(q0, b, a20); a21 = _mm512_fmadd_ps(q1, b, a21);
        a22 = _mm512_fmadd_ps(q2, b, a22); a23 = _mm512_fmadd_ps(q3, b, a23);
        b = A512_BC(p, 3 * L);
        a30 = _mm512_fmadd_ps(q0, b, a30); a31 = _mm512_fmadd_ps(q1, b, a31);
        a32 = _mm512_fmadd_ps(q2, b, a32); a33 = _mm512_fmadd_ps(q3, b, a33);
    }
    const __m512 v0[4] = {a00, a10, a20, a30}, v1[4] = {a01, a11, a21, a31};
    const __m512 v2[4] = {a02, a12, a22, a32}, v3[4] = {a03, a13, a23, a33};
    a512_store_rows_t(v0, 4, y, ldy, 16);
    a512_store_rows_t(v1, 4, y + (size_t)16 * ldy, ldy, 16);
    a512_store_rows_t(v2, 4, y + (size_t)32 * ldy, ldy, 16);
    a512_store_rows_t(v3, 4, y + (size_t)48 * ldy, ldy, 16);
}
#undef A512_BC

/* dot_rows_t over bf16 rows, with the same FMAs in the same order as on
 * the widened rows (so the same bits), reading half the bytes.  Two
 * elements at a time: one 32-bit broadcast of the pair gives element c by
 * a shift and element c + 1 by a mask (a bf16 value is the top half of its
 * fp32), each an instruction with the broadcast folded in. */
GL_A512_INLINE __m512i a512_pair(const char *p) {
    int32_t d;
    memcpy(&d, p, 4);                   /* rows are 2-byte aligned */
    return _mm512_set1_epi32(d);
}
#define A512_PAIR(p, o) a512_pair((const char *)(p) + (o))
#define A512_LO(d) _mm512_castsi512_ps(_mm512_slli_epi32((d), 16))
#define A512_HI(d) _mm512_castsi512_ps(_mm512_and_si512((d), _mm512_set1_epi32((int32_t)0xffff0000u)))
#define A512_ONE(p, o) _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)((uint32_t)*(const uint16_t *)((const char *)(p) + (o)) << 16)))
#define A512_STEP2(a, p, o) do { const __m512i d_ = A512_PAIR(p, o); \
        a = _mm512_fmadd_ps(v0, A512_LO(d_), a); a = _mm512_fmadd_ps(v1, A512_HI(d_), a); } while (0)
GL_A512_INLINE void a512_dot16_rows_bf16(const float *qt, size_t ldq, __mmask16 mk, const uint16_t *x, size_t ldx,
                                         int n, float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(uint16_t), L3 = 3 * L;
    const char *p0 = (const char *)x, *p1 = p0 + 4 * L, *p2 = p1 + 4 * L, *p3 = p2 + 4 * L;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    const float *q = qt;
    int c = 0;
    for (; c + 2 <= n; c += 2, q += 2 * ldq, p0 += 4, p1 += 4, p2 += 4, p3 += 4) {
        const __m512 v0 = _mm512_maskz_loadu_ps(mk, q), v1 = _mm512_maskz_loadu_ps(mk, q + ldq);
        A512_STEP2(a0, p0, 0);  A512_STEP2(a1, p0, L);  A512_STEP2(a2, p0, 2 * L);  A512_STEP2(a3, p0, L3);
        A512_STEP2(a4, p1, 0);  A512_STEP2(a5, p1, L);  A512_STEP2(a6, p1, 2 * L);  A512_STEP2(a7, p1, L3);
        A512_STEP2(a8, p2, 0);  A512_STEP2(a9, p2, L);  A512_STEP2(a10, p2, 2 * L); A512_STEP2(a11, p2, L3);
        A512_STEP2(a12, p3, 0); A512_STEP2(a13, p3, L); A512_STEP2(a14, p3, 2 * L); A512_STEP2(a15, p3, L3);
    }
    if (c < n) {   /* an odd last element, alone (the pair would read past the row) */
        const __m512 v = _mm512_maskz_loadu_ps(mk, q);
        a0 = _mm512_fmadd_ps(v, A512_ONE(p0, 0), a0);      a1 = _mm512_fmadd_ps(v, A512_ONE(p0, L), a1);
        a2 = _mm512_fmadd_ps(v, A512_ONE(p0, 2 * L), a2);  a3 = _mm512_fmadd_ps(v, A512_ONE(p0, L3), a3);
        a4 = _mm512_fmadd_ps(v, A512_ONE(p1, 0), a4);      a5 = _mm512_fmadd_ps(v, A512_ONE(p1, L), a5);
        a6 = _mm512_fmadd_ps(v, A512_ONE(p1, 2 * L), a6);  a7 = _mm512_fmadd_ps(v, A512_ONE(p1, L3), a7);
        a8 = _mm512_fmadd_ps(v, A512_ONE(p2, 0), a8);      a9 = _mm512_fmadd_ps(v, A512_ONE(p2, L), a9);
        a10 = _mm512_fmadd_ps(v, A512_ONE(p2, 2 * L), a10); a11 = _mm512_fmadd_ps(v, A512_ONE(p2, L3), a11);
        a12 = _mm512_fmadd_ps(v, A512_ONE(p3, 0), a12);    a13 = _mm512_fmadd_ps(v, A512_ONE(p3, L), a13);
        a14 = _mm512_fmadd_ps(v, A512_ONE(p3, 2 * L), a14); a15 = _mm512_fmadd_ps(v, A512_ONE(p3, L3), a15);
    }
    const __m512 acc[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
    a512_store_rows_t(acc, 16, y, ldy, nl);
}

/* The last m % 16 rows: four, then one at a time. */
GL_A512_INLINE void a512_dot4_rows_bf16(const float *qt, size_t ldq, __mmask16 mk, const uint16_t *x, size_t ldx,
                                        int n, float *y, int ldy, int nl) {
    const size_t L = ldx * sizeof(uint16_t);
    const char *p = (const char *)x;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *q = qt;
    int c = 0;
    for (; c + 2 <= n; c += 2, q += 2 * ldq, p += 4) {
        const __m512 v0 = _mm512_maskz_loadu_ps(mk, q), v1 = _mm512_maskz_loadu_ps(mk, q + ldq);
        A512_STEP2(a0, p, 0); A512_STEP2(a1, p, L); A512_STEP2(a2, p, 2 * L); A512_STEP2(a3, p, 3 * L);
    }
    if (c < n) {
        const __m512 v = _mm512_maskz_loadu_ps(mk, q);
        a0 = _mm512_fmadd_ps(v, A512_ONE(p, 0), a0);     a1 = _mm512_fmadd_ps(v, A512_ONE(p, L), a1);
        a2 = _mm512_fmadd_ps(v, A512_ONE(p, 2 * L), a2); a3 = _mm512_fmadd_ps(v, A512_ONE(p, 3 * L), a3);
    }
    const __m512 acc[4] = {a0, a1, a2, a3};
    a512_store_rows_t(acc, 4, y, ldy, nl);
}

GL_A512_INLINE void a512_dot1_row_bf16(const float *qt, size_t ldq, __mmask16 mk, const uint16_t *x, int n, float *y,
                                       int ldy, int nl) {
    __m512 a0 = _mm512_setzero_ps();
    const float *q = qt;
    for (int c = 0; c < n; c++, q += ldq)
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q), A512_ONE(x + c, 0), a0);
    float t[16];
    _mm512_storeu_ps(t, a0);
    for (int l = 0; l < nl; l++) y[(size_t)l * ldy] = t[l];
}
#undef A512_STEP2
#undef A512_ONE
#undef A512_HI
#undef A512_LO
#undef A512_PAIR

static GL_A512 void a512_dot_rows_t_bf16(float *y, int ldy, const float *qt, int ldq, int nl, const uint16_t *x,
                                         int ldx, int m, int n) {
    for (int l0 = 0; l0 < nl; l0 += 16) {
        const int nw = nl - l0 < 16 ? nl - l0 : 16;
        const __mmask16 mk = nw == 16 ? (__mmask16)0xffff : a512_mask16(nw);
        const float *q = qt + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 16 <= m; j += 16)
            a512_dot16_rows_bf16(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j + 4 <= m; j += 4)
            a512_dot4_rows_bf16(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j < m; j++) a512_dot1_row_bf16(q, (size_t)ldq, mk, x + (size_t)j * ldx, n, yl + j, ldy, nw);
    }
}

static GL_A512 void a512_dot_rows_t(float *y, int ldy, const float *qt, int ldq, int nl, const float *x, int ldx, int m,
                                    int n) {
    int l0 = 0;
    for (; l0 + 64 <= nl && m >= 4; l0 += 64) {   /* 64 lanes at a time, 4 rows at a time */
        int j = 0;
        for (; j + 4 <= m; j += 4)
            a512_dot4x4_rows(qt + l0, (size_t)ldq, x + (size_t)j * ldx, (size_t)ldx, n, y + (size_t)l0 * ldy + j, ldy);
        for (; j < m; j++)
            for (int v = 0; v < 4; v++)
                a512_dot1_row(qt + l0 + 16 * v, (size_t)ldq, (__mmask16)0xffff, x + (size_t)j * ldx, n,
                              y + (size_t)(l0 + 16 * v) * ldy + j, ldy, 16);
    }
    for (; l0 < nl; l0 += 16) {
        const int nw = nl - l0 < 16 ? nl - l0 : 16;
        const __mmask16 mk = nw == 16 ? (__mmask16)0xffff : a512_mask16(nw);
        const float *q = qt + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 16 <= m; j += 16) a512_dot16_rows(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j + 4 <= m; j += 4) a512_dot4_rows(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw);
        for (; j < m; j++) a512_dot1_row(q, (size_t)ldq, mk, x + (size_t)j * ldx, n, yl + j, ldy, nw);
    }
}

/* ---- transpose ----
 * 16 x 16 blocks in registers: two rounds of unpacks transpose the 4 x 4
 * blocks inside each 128-bit lane, two rounds of 128-bit shuffles the 4 x 4
 * grid of those blocks (64 shuffles per 256 values, against 256 scalar
 * loads and stores).  Edge blocks load and store masked. */
GL_A512_INLINE void a512_transpose16(__m512 r[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int j = 0; j < 16; j += 4) {            /* b[j+m] lane k: element 4k+m of rows j..j+3 */
        b[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[j]), _mm512_castps_pd(a[j + 2])));
        b[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[j]), _mm512_castps_pd(a[j + 2])));
        b[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[j + 1]), _mm512_castps_pd(a[j + 3])));
        b[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[j + 1]), _mm512_castps_pd(a[j + 3])));
    }
    for (int m = 0; m < 4; m++) {                /* lane k of b[4j+m] goes to lane j of r[4k+m] */
        const __m512 c0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44), c1 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xee);
        const __m512 c2 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44), c3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xee);
        r[m] = _mm512_shuffle_f32x4(c0, c2, 0x88);
        r[4 + m] = _mm512_shuffle_f32x4(c0, c2, 0xdd);
        r[8 + m] = _mm512_shuffle_f32x4(c1, c3, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(c1, c3, 0xdd);
    }
}

static GL_A512 void a512_transpose(float *dst, int ldd, const float *src, int lds, int rows, int cols) {
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? rows - r0 : 16;
        const __mmask16 rm = a512_mask16(nr);
        for (int c0 = 0; c0 < cols; c0 += 16) {
            const int nc = cols - c0 < 16 ? cols - c0 : 16;
            const __mmask16 cm = a512_mask16(nc);
            __m512 v[16];
            for (int i = 0; i < 16; i++)
                v[i] = i < nr ? _mm512_maskz_loadu_ps(cm, src + (size_t)(r0 + i) * lds + c0) : _mm512_setzero_ps();
            a512_transpose16(v);
            for (int j = 0; j < nc; j++) a512_store16(dst + (size_t)(c0 + j) * ldd + r0, rm, v[j]);
        }
    }
}

static const gl_kernels gl_avx512_kernels = {
    "avx512", a512_matmul, a512_matmul_q8, a512_quantize_q8, a512_dot, a512_axpy, a512_axpy_rows, a512_axpy_rows_n,
    a512_exp_sum, a512_silu_mul, a512_dot_rows_t, a512_dot_rows_t_bf16, a512_axpy_rows_n_bf16,
    a512_axpy_rowp_n, a512_axpy_rowp_n_bf16, a512_transpose,
    NULL, NULL, NULL,   /* no native-BF16 core */
};

/* ---- opt-in: native BF16 dot products (AVX512_BF16) ----
 * "avx512_bf16": the avx512 set, except that bf16 weights are multiplied by
 * vdpbf16ps with the activations rounded to bf16 (nearest even) -- twice
 * the fp32 FMA rate, but each activation loses its low 16 bits, an error
 * of up to 2^-8 relative per product (test_kernels measures it against
 * the exact sum).  Never chosen by gl_kernels_get: an engine asks for it
 * by name.  Order: lane l of a 16-wide accumulator takes the column pairs
 * (32s + 2l, 32s + 2l + 1) in increasing s; the tail is zero-padded; the
 * lanes are summed as a512_hsum. */
#define GL_A512BF_TARGET GL_A512_TARGET ",avx512bf16"
#define GL_A512BF __attribute__((target(GL_A512BF_TARGET)))
#define GL_A512BF_INLINE static inline __attribute__((always_inline, target(GL_A512BF_TARGET)))

/* The activations are rounded to bf16 once per call, a block of tokens at
 * a time, into 32 KB on the stack (each row zero-padded to whole 32s), so
 * that a tile loads them as it loads the weights.  Converting them in the
 * tile, for every row panel, had cost as much as the products: prefill
 * was within 5% of the exact FMA path.  With the buffer and 4 x 6 tiles,
 * one thread, bf16 weights from DRAM: 1408x2048 x 48 tokens 151 -> 240
 * GFLOP/s against the exact path, 512x1024 x 96 196 -> 279; the same
 * bits as before.  (64 and 128 KB buffers measured the same.) */
#define A512BF_X_BYTES (32 << 10)
#define A512BF_NT 6       /* tokens per tile: 4 rows x 6 tokens, 24 sums of the 32 registers */

GL_A512BF_INLINE void a512bf_round_rows(const float *x, int n, int ldx, int cols, uint16_t *xb, int ldb) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * ldx;
        uint16_t *bi = xb + (size_t)i * ldb;
        for (int c = 0; c < ldb; c += 32) {
            const int m = cols - c;
            __m512 lo, hi;
            if (m >= 32) { lo = _mm512_loadu_ps(xi + c); hi = _mm512_loadu_ps(xi + c + 16); }
            else {
                lo = _mm512_maskz_loadu_ps(a512_mask16(m < 16 ? m : 16), xi + c);
                hi = _mm512_maskz_loadu_ps(a512_mask16(m > 16 ? m - 16 : 0), xi + c + 16);
            }
            _mm512_storeu_si512(bi + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Rows r + k*rs, k < nr (rs: 1, but in a512bf_row_runs), times nt tokens;
 * pf: where to prefetch from, at the pace the tile reads (rs > 1: row k's
 * at pf + k*rs rows). */
GL_A512BF_INLINE void a512bf_tile_rs(const gl_mat *w, int r, int nr, int rs, const uint16_t *xb, int ldb, int nt,
                                     float *y, int ldy, const uint8_t *pf) {
    const int cols = w->cols, full = cols & ~31;
    const uint16_t *wr[A512_NR];
    __m512 acc[A512_NR][A512BF_NT];
    __m512bh wv[A512_NR];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        wr[k] = (const uint16_t *)w->data + (size_t)(r + k * rs) * (size_t)cols;
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) acc[k][t] = _mm512_setzero_ps();
    }
    for (int c = 0; c < full; c += 32) {
        if (rs > 1) {
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) _mm_prefetch((const char *)pf + ((size_t)k * rs * cols + c) * 2, _MM_HINT_NTA);
        } else {
            const uint8_t *pc = pf + (size_t)c * (size_t)nr * 2;
            _mm_prefetch((const char *)pc, _MM_HINT_NTA);
            if (nr > 1) _mm_prefetch((const char *)pc + 64, _MM_HINT_NTA);
            if (nr > 2) { _mm_prefetch((const char *)pc + 128, _MM_HINT_NTA); _mm_prefetch((const char *)pc + 192, _MM_HINT_NTA); }
        }
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = (__m512bh)_mm512_loadu_si512(wr[k] + c);
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (size_t)t * ldb + c);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = _mm512_dpbf16_ps(acc[k][t], wv[k], xv);
        }
    }
    if (full < cols) {   /* the weights' tail masked (past it lies the next row), the tokens' zero-padded */
        const __mmask32 m = (__mmask32)((1ull << (cols - full)) - 1);
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = (__m512bh)_mm512_maskz_loadu_epi16(m, wr[k] + full);
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (size_t)t * ldb + full);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = _mm512_dpbf16_ps(acc[k][t], wv[k], xv);
        }
    }
    if (nr == 4 && nt == 4 && rs == 1) {
        __m512 a[16];
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++) a[4 * k + t] = acc[k][t];
        a512_store4x4(a512_reduce16(a), y, ldy, r);
        return;
    }
#pragma GCC unroll 6
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) y[(size_t)t * ldy + r + k * rs] = a512_hsum(acc[k][t]);
}

GL_A512BF_INLINE void a512bf_panels(const gl_mat *w, int nr, const uint16_t *xb, int n, int ldb, float *y, int ldy,
                                    int r, int r1) {
    const size_t row_bytes = (size_t)w->cols * 2;
    for (; r + nr <= r1; r += nr) {
        const uint8_t *panel = (const uint8_t *)w->data + (size_t)r * row_bytes;
        const uint8_t *pf = r + (GL_PF_PANELS + 1) * nr <= r1 ? panel + GL_PF_PANELS * (size_t)nr * row_bytes : panel;
        for (int i = 0; i < n; i += A512BF_NT, pf = panel) {
            int nt = n - i < A512BF_NT ? n - i : A512BF_NT;
            const uint16_t *xi = xb + (size_t)i * ldb;
            float *yi = y + (size_t)i * ldy;
            switch (nt) {
            case 6: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 6, yi, ldy, pf); break;
            case 5: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 5, yi, ldy, pf); break;
            case 4: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 4, yi, ldy, pf); break;
            case 3: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 3, yi, ldy, pf); break;
            case 2: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 2, yi, ldy, pf); break;
            case 1: a512bf_tile_rs(w, r, nr, 1, xi, ldb, 1, yi, ldy, pf); break;
            }
        }
    }
}

/* Rows [r, r1) one at a time for 1-2 tokens, four at once from the
 * quarters of the range, as a512_row_runs: four sequential runs. */
GL_A512BF_INLINE void a512bf_row_runs(const gl_mat *w, const uint16_t *xb, int n, int ldb, float *y, int ldy, int r,
                                      int r1) {
    const size_t row_bytes = (size_t)w->cols * 2;
    const int part = (r1 - r) / A512_ROW_RUNS;
    for (int i = 0; i < part; i++) {
        const int ra = r + i, ahead = i + GL_PF_PANELS < part ? GL_PF_PANELS : 0;
        const uint8_t *pf = (const uint8_t *)w->data + (size_t)(ra + ahead) * row_bytes;
        if (n == 1) a512bf_tile_rs(w, ra, A512_ROW_RUNS, part, xb, ldb, 1, y, ldy, pf);
        else a512bf_tile_rs(w, ra, A512_ROW_RUNS, part, xb, ldb, 2, y, ldy, pf);
    }
    a512bf_panels(w, 1, xb, n, ldb, y, ldy, r + A512_ROW_RUNS * part, r1);
}

static GL_A512BF void a512bf_matmul_bf16(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    _Alignas(64) uint16_t xb[A512BF_X_BYTES / 2];
    const int ldb = (w->cols + 31) & ~31;
    int nb = (int)(sizeof xb / ((size_t)ldb * 2));
    if (nb > A512BF_NT) nb -= nb % A512BF_NT;
    if (nb < 1) {   /* rows longer than the buffer (over 16K columns): a token at a time, unbuffered */
        for (int i = 0; i < n; i++) {
            uint16_t one[32];
            for (int r = r0; r < r1; r++) {
                __m512 acc = _mm512_setzero_ps();
                const uint16_t *wr = (const uint16_t *)w->data + (size_t)r * (size_t)w->cols;
                for (int c = 0; c < w->cols; c += 32) {
                    const int m = w->cols - c < 32 ? w->cols - c : 32;
                    a512bf_round_rows(x + (size_t)i * ldx + c, 1, ldx, m, one, 32);
                    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)(m == 32 ? ~0u : (1u << m) - 1u), wr + c);
                    acc = _mm512_dpbf16_ps(acc, wv, (__m512bh)_mm512_loadu_si512(one));
                }
                y[(size_t)i * ldy + r] = a512_hsum(acc);
            }
        }
        return;
    }
    const int r = a512_panels_end(n, (size_t)w->cols * 2, r0, r1);
    for (int i0 = 0; i0 < n; i0 += nb) {
        const int ni = n - i0 < nb ? n - i0 : nb;
        a512bf_round_rows(x + (size_t)i0 * ldx, ni, ldx, w->cols, xb, ldb);
        a512bf_panels(w, A512_NR, xb, ni, ldb, y + (size_t)i0 * ldy, ldy, r0, r);
        if (r == r0 && ni <= A512_ROWWISE_MAX_N) a512bf_row_runs(w, xb, ni, ldb, y + (size_t)i0 * ldy, ldy, r, r1);
        else a512bf_panels(w, 1, xb, ni, ldb, y + (size_t)i0 * ldy, ldy, r, r1);
    }
}

static void a512bf_matmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    if (w->type == GL_BF16) a512bf_matmul_bf16(w, x, n, ldx, y, ldy, r0, r1);
    else a512_matmul(w, x, n, ldx, y, ldy, r0, r1);
}

/* The attention core in native BF16 (the round_pairs_bf16, dot_rows_tp_bf16
 * and axpy_rowp_n_bf16p entries): over a bf16 latent cache, the queries
 * and the softmax weights are rounded to bf16 and multiplied a pair of
 * elements at a time by vdpbf16ps.  The scores pair the latent's elements
 * (a key's pair is one 32-bit broadcast from the cache row); the weighted
 * sums pair the keys, so two rows are interleaved in registers
 * (vpunpcklwd/hwd, within 128-bit lanes), and the sums live in that
 * permuted column order, put back when stored. */
static GL_A512BF void a512bf_round_pairs(uint32_t *dst, int ldd, const float *src, int lds, int n, int cols) {
    /* element 2i of the result from a (low half of cvtne2ps), 2i + 1 from b */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; 2 * p < n; p++) {
        const float *r0 = src + (size_t)2 * p * lds, *r1 = 2 * p + 1 < n ? r0 + lds : NULL;
        uint32_t *d = dst + (size_t)p * ldd;
        for (int l = 0; l < cols; l += 16) {
            const __mmask16 k = cols - l >= 16 ? (__mmask16)0xffff : a512_mask16(cols - l);
            const __m512 a = _mm512_maskz_loadu_ps(k, r0 + l), b = r1 ? _mm512_maskz_loadu_ps(k, r1 + l) : _mm512_setzero_ps();
            const __m512i v = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            a512_store16_epi32(d + l, k, v);
        }
    }
}

/* Pair p of a bf16 row of n elements, broadcast: the last one alone
 * (paired with 0) when n is odd, so nothing past the row is read. */
GL_A512BF_INLINE __m512bh a512bf_xpair(const uint16_t *x, int p, int n) {
    uint32_t d;
    if (2 * p + 1 < n) memcpy(&d, x + 2 * p, 4);
    else d = x[2 * p];
    return (__m512bh)_mm512_set1_epi32((int32_t)d);
}

/* Scores: NR rows against NG vectors of 16 lanes (NR x NG sums). */
GL_A512BF_INLINE void a512bf_dot_tile(const uint32_t *qp, size_t ldq, __mmask16 mk, const uint16_t *x, size_t ldx,
                                      int n, float *y, int ldy, int nl, const int NR, const int NG) {
    __m512 acc[16][4];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    const int np = (n + 1) / 2;
    for (int p = 0; p < np; p++) {
        __m512bh q[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++)
            q[g] = (__m512bh)(NG == 1 ? _mm512_maskz_loadu_epi32(mk, qp + (size_t)p * ldq)
                                      : _mm512_loadu_si512(qp + (size_t)p * ldq + 16 * g));
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            const __m512bh b = a512bf_xpair(x + (size_t)r * ldx, p, n);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], q[g], b);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        __m512 v[16];
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) v[r] = acc[r][g];
        a512_store_rows_t(v, NR, y + (size_t)16 * g * ldy, ldy, NG == 1 ? nl : 16);
    }
}

static GL_A512BF void a512bf_dot_rows_tp(float *y, int ldy, const uint32_t *qp, int ldq, int nl, const uint16_t *x,
                                         int ldx, int m, int n) {
    int l0 = 0;
    for (; l0 + 64 <= nl && m >= 4; l0 += 64) {   /* 64 lanes x 4 rows: half a load per product */
        int j = 0;
        for (; j + 4 <= m; j += 4)
            a512bf_dot_tile(qp + l0, (size_t)ldq, 0xffff, x + (size_t)j * ldx, (size_t)ldx, n,
                            y + (size_t)l0 * ldy + j, ldy, 64, 4, 4);
        for (; j < m; j++)
            a512bf_dot_tile(qp + l0, (size_t)ldq, 0xffff, x + (size_t)j * ldx, (size_t)ldx, n,
                            y + (size_t)l0 * ldy + j, ldy, 64, 1, 4);
    }
    for (; l0 < nl; l0 += 16) {                    /* 16 lanes x 16, 4, 1 rows */
        const int nw = nl - l0 < 16 ? nl - l0 : 16;
        const __mmask16 mk = nw == 16 ? (__mmask16)0xffff : a512_mask16(nw);
        const uint32_t *q = qp + l0;
        float *yl = y + (size_t)l0 * ldy;
        int j = 0;
        for (; j + 16 <= m; j += 16) a512bf_dot_tile(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw, 16, 1);
        for (; j + 4 <= m; j += 4) a512bf_dot_tile(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw, 4, 1);
        for (; j < m; j++) a512bf_dot_tile(q, (size_t)ldq, mk, x + (size_t)j * ldx, (size_t)ldx, n, yl + j, ldy, nw, 1, 1);
    }
}

/* Weighted sums: NH heads (ap: their weight pairs, ldap apart) over NW
 * units of 32 columns from c (nc of them in all, the last unit masked),
 * the m rows xr[] two at a time.  A unit's sums are two vectors: columns
 * 0-3, 8-11, 16-19, 24-27 of it (lo) and 4-7, ... , 28-31 (hi), the order
 * vpunpck*wd leaves the interleaved rows in. */
GL_A512BF_INLINE void a512bf_axpy_tile(float *y, int ldy, const uint16_t *const *xr, const uint32_t *ap, int ldap,
                                       int m, int c, int nc, const int NH, const int NW) {
    const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i back0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i back1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    __mmask32 kx[2];
    __mmask16 ky[2][2];
#pragma GCC unroll 2
    for (int u = 0; u < NW; u++) {
        const int left = nc - 32 * u;
        kx[u] = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
        ky[u][0] = left >= 16 ? (__mmask16)0xffff : a512_mask16(left);
        ky[u][1] = left >= 32 ? (__mmask16)0xffff : left > 16 ? a512_mask16(left - 16) : 0;
    }
    __m512 acc[4][2][2];
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 2
        for (int u = 0; u < NW; u++) {
            const float *yh = y + (size_t)h * ldy + c + 32 * u;
            const __m512 y0 = _mm512_maskz_loadu_ps(ky[u][0], yh), y1 = _mm512_maskz_loadu_ps(ky[u][1], yh + 16);
            acc[h][u][0] = _mm512_permutex2var_ps(y0, to_lo, y1);
            acc[h][u][1] = _mm512_permutex2var_ps(y0, to_hi, y1);
        }
    for (int p = 0; 2 * p < m; p++) {
        const uint16_t *r0 = xr[2 * p] + c, *r1 = 2 * p + 1 < m ? xr[2 * p + 1] + c : NULL;
        __m512bh x[2][2];
#pragma GCC unroll 2
        for (int u = 0; u < NW; u++) {
            const __m512i a = _mm512_maskz_loadu_epi16(kx[u], r0 + 32 * u);
            const __m512i b = r1 ? _mm512_maskz_loadu_epi16(kx[u], r1 + 32 * u) : _mm512_setzero_si512();
            x[u][0] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            x[u][1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)ap[(size_t)h * ldap + p]);
#pragma GCC unroll 2
            for (int u = 0; u < NW; u++) {
                acc[h][u][0] = _mm512_dpbf16_ps(acc[h][u][0], x[u][0], w);
                acc[h][u][1] = _mm512_dpbf16_ps(acc[h][u][1], x[u][1], w);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 2
        for (int u = 0; u < NW; u++) {
            float *yh = y + (size_t)h * ldy + c + 32 * u;
            a512_store16(yh, ky[u][0], _mm512_permutex2var_ps(acc[h][u][0], back0, acc[h][u][1]));
            a512_store16(yh + 16, ky[u][1], _mm512_permutex2var_ps(acc[h][u][0], back1, acc[h][u][1]));
        }
}

#define A512BF_AP_HEADS 32
static GL_A512BF void a512bf_axpy_rowp_n_bf16p(float *y, int ldy, const uint16_t *const *xr, const float *a, int lda,
                                               int nh, int m, int n) {
    uint32_t ap[A512BF_AP_HEADS][GL_ROWP_PAIRS];
    for (int j0 = 0; j0 < m; j0 += 2 * GL_ROWP_PAIRS) {
        const int mm = m - j0 < 2 * GL_ROWP_PAIRS ? m - j0 : 2 * GL_ROWP_PAIRS;
        for (int h0 = 0; h0 < nh; h0 += A512BF_AP_HEADS) {
            const int hn = nh - h0 < A512BF_AP_HEADS ? nh - h0 : A512BF_AP_HEADS;
            for (int h = 0; h < hn; h++) {   /* 32 weights rounded in order are 16 pairs (0 past the last) */
                const float *ah = a + (size_t)(h0 + h) * lda + j0;
                for (int i = 0; i < mm; i += 32) {
                    const int left = mm - i;
                    const __m512 lo = _mm512_maskz_loadu_ps(left >= 16 ? (__mmask16)0xffff : a512_mask16(left), ah + i);
                    const __m512 hi = _mm512_maskz_loadu_ps(left >= 32 ? (__mmask16)0xffff : left > 16 ? a512_mask16(left - 16) : 0,
                                                            ah + i + 16);
                    _mm512_storeu_si512(&ap[h][i / 2], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
            float *yh0 = y + (size_t)h0 * ldy;
            for (int c = 0; c < n; c += 64) {   /* 64 columns of the rows stay in L1 for every head */
                const int nc = n - c < 64 ? n - c : 64;
                int h = 0;
                if (nc > 32) {
                    for (; h + 4 <= hn; h += 4) a512bf_axpy_tile(yh0 + (size_t)h * ldy, ldy, xr + j0, ap[h], GL_ROWP_PAIRS, mm, c, nc, 4, 2);
                    for (; h < hn; h++) a512bf_axpy_tile(yh0 + (size_t)h * ldy, ldy, xr + j0, ap[h], GL_ROWP_PAIRS, mm, c, nc, 1, 2);
                } else {
                    for (; h + 4 <= hn; h += 4) a512bf_axpy_tile(yh0 + (size_t)h * ldy, ldy, xr + j0, ap[h], GL_ROWP_PAIRS, mm, c, nc, 4, 1);
                    for (; h < hn; h++) a512bf_axpy_tile(yh0 + (size_t)h * ldy, ldy, xr + j0, ap[h], GL_ROWP_PAIRS, mm, c, nc, 1, 1);
                }
            }
        }
    }
}

static const gl_kernels gl_avx512_bf16_kernels = {
    "avx512_bf16", a512bf_matmul, a512_matmul_q8, a512_quantize_q8, a512_dot, a512_axpy, a512_axpy_rows,
    a512_axpy_rows_n, a512_exp_sum, a512_silu_mul, a512_dot_rows_t, a512_dot_rows_t_bf16, a512_axpy_rows_n_bf16,
    a512_axpy_rowp_n, a512_axpy_rowp_n_bf16, a512_transpose, a512bf_round_pairs, a512bf_dot_rows_tp,
    a512bf_axpy_rowp_n_bf16p,
};

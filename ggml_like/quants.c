/* quants.c -- ggml's block-quantized weight formats, as GGUF files store
 * them: Q8_0, Q4_0 (32 values a block) and the k-quants Q4_K, Q5_K, Q6_K
 * (256 values a block, with 6- or 8-bit sub-block scales).
 *
 * Included by ggml_like.c after the SIMD sets (it uses their helpers).
 *
 * A row of `cols` values is cols / block_size blocks, back to back; row r of
 * a matrix starts at r * gl_row_bytes(type, cols).  The blocks' fields:
 *
 *   Q8_0  34 B: f16 d, int8 q[32]                  x = d * q
 *   Q4_0  18 B: f16 d, u8 qs[16]                   x = d * (nibble - 8); value j
 *               is the low nibble of qs[j] (j < 16) or the high nibble of qs[j-16]
 *   Q4_K 144 B: f16 d, f16 dmin, u8 scales[12], u8 qs[128]
 *               8 sub-blocks of 32, each a 6-bit scale sc and min m packed in
 *               scales[]; x = (d*sc) * nibble - (dmin*m); qs[32g..32g+31] hold
 *               sub-block 2g in low nibbles, 2g+1 in high nibbles
 *   Q5_K 176 B: f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
 *               as Q4_K with a fifth bit: bit 2g (2g+1) of qh[l] adds 16 to
 *               value l of sub-block 2g (2g+1)
 *   Q6_K 210 B: u8 ql[128], u8 qh[64], int8 scales[16], f16 d
 *               16 sub-blocks of 16; x = (d*sc) * (q - 32), q 6 bits (low 4
 *               from ql, high 2 from qh)
 *   Q4_1  20 B: f16 d, f16 m, u8 qs[16]             x = d * nibble + m
 *   Q5_0  22 B: f16 d, u8 qh[4], u8 qs[16]          x = d * (q - 16), bit j of the
 *               little-endian u32 qh is the fifth bit of value j
 *   Q5_1  24 B: f16 d, f16 m, u8 qh[4], u8 qs[16]   x = d * q + m
 * (Q4_1, Q5_0 and Q5_1 are what llama-quantize writes for rows that are not
 * whole 256-value blocks in k-quant files; their SIMD sets dequantize through
 * the portable code and multiply with the set's FMA.)
 *
 * Exactness: every value a block stands for is one fp32 number, whichever
 * way it is computed: d*sc is exact (11 + 8 significant bits), times q is
 * exact (at most 23 bits), and the k-quants' "- dmin*m" is the one rounding,
 * of an exact difference.  So dequantizing in any kernel set gives the same
 * bits, and a product over a quantized row is the product over its exact
 * values in the set's fixed order: the stored format, computed as stored.
 *
 * The matrix product (every SIMD set): a panel of up to 3 weight rows is
 * dequantized a chunk of columns at a time into a small fp32 buffer (in L1),
 * and every token of a block of up to 32 passes over it; partial sums are
 * kept per (token, row) between chunks, lane l taking the columns c = l (mod
 * the set's width) in increasing c, and reduced at the end in a fixed order.
 * The weights are never expanded in memory beyond that buffer. */

#define GL_QK 32           /* values per Q8_0 / Q4_0 block   */
#define GL_QK_K 256        /* values per k-quant block       */

int gl_type_is_block(int type) { return type >= GL_Q8_0 && type < GL_BLOCK_TYPE_END; }

int gl_type_block(int type) {
    switch (type) {
    case GL_Q8_0: case GL_Q4_0: case GL_Q4_1: case GL_Q5_0: case GL_Q5_1: return GL_QK;
    case GL_Q4_K: case GL_Q5_K: case GL_Q6_K: return GL_QK_K;
    default: return 1;
    }
}

static size_t gl_block_bytes(int type) {
    switch (type) {
    case GL_Q8_0: return 34;
    case GL_Q4_0: return 18;
    case GL_Q4_K: return 144;
    case GL_Q5_K: return 176;
    case GL_Q6_K: return 210;
    case GL_Q4_1: return 20;
    case GL_Q5_0: return 22;
    case GL_Q5_1: return 24;
    default: return gl_type_size(type);
    }
}

size_t gl_row_bytes(int type, int cols) {
    return (size_t)(cols / gl_type_block(type)) * gl_block_bytes(type);
}

const char *gl_type_name(int type) {
    static const char *names[] = {"F32", "F16", "BF16", "F8_E4M3", "INT8"};
    static const char *blocks[] = {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1"};
    if (type >= 0 && type < GL_TYPE_COUNT) return names[type];
    if (gl_type_is_block(type)) return blocks[type - GL_Q8_0];
    return "?";
}

static inline float gl_load_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return gl_f16_to_f32(h);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block. */
static void gl_kq_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One block to fp32 (the reference every SIMD set must equal bit for bit). */
static void gl_block_to_f32(int type, const uint8_t *b, float *out) {
    switch (type) {
    case GL_Q8_0: {
        float d = gl_load_f16(b);
        for (int j = 0; j < 32; j++) out[j] = d * (float)(int8_t)b[2 + j];
        break;
    }
    case GL_Q4_0: {
        float d = gl_load_f16(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((b[2 + j] & 0xF) - 8);
            out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case GL_Q4_1: {
        float d = gl_load_f16(b), m = gl_load_f16(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(b[4 + j] & 0xF) + m;
            out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case GL_Q5_0:
    case GL_Q5_1: {
        int one = type == GL_Q5_1;
        float d = gl_load_f16(b), m = one ? gl_load_f16(b + 2) : 0.0f;
        const uint8_t *qh = b + 2 + 2 * one, *qs = qh + 4;
        uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0xF) | (int)((h >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
            if (one) { out[j] = d * (float)lo + m; out[j + 16] = d * (float)hi + m; }
            else { out[j] = d * (float)(lo - 16); out[j + 16] = d * (float)(hi - 16); }
        }
        break;
    }
    case GL_Q4_K:
    case GL_Q5_K: {
        float d = gl_load_f16(b), dmin = gl_load_f16(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16;
        const uint8_t *q = type == GL_Q4_K ? b + 16 : b + 48;
        for (int g = 0; g < 4; g++, q += 32, out += 64) {
            int s0, m0, s1, m1;
            gl_kq_scale_min(sc, 2 * g, &s0, &m0);
            gl_kq_scale_min(sc, 2 * g + 1, &s1, &m1);
            float d0 = d * (float)s0, o0 = dmin * (float)m0, d1 = d * (float)s1, o1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                int lo = q[l] & 0xF, hi = q[l] >> 4;
                if (type == GL_Q5_K) {
                    lo += (qh[l] >> (2 * g) & 1) << 4;
                    hi += (qh[l] >> (2 * g + 1) & 1) << 4;
                }
                out[l] = d0 * (float)lo - o0;
                out[l + 32] = d1 * (float)hi - o1;
            }
        }
        break;
    }
    case GL_Q6_K: {
        float d = gl_load_f16(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, out += 128)
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2 & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
                out[l] = d * (float)sc[is] * (float)q1;
                out[l + 32] = d * (float)sc[is + 2] * (float)q2;
                out[l + 64] = d * (float)sc[is + 4] * (float)q3;
                out[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        break;
    }
    }
}

#if defined(GL_HAVE_AVX2) || defined(GL_HAVE_NEON)
/* Columns [c0, c0+nc) of a row, block-aligned (the SIMD sets' way for the
 * types they have no kernel of their own for). */
static void gl_qrow_span_scalar(int type, const uint8_t *row, int c0, int nc, float *out) {
    int bs = gl_type_block(type);
    size_t bb = gl_block_bytes(type);
    for (int c = 0; c < nc; c += bs) gl_block_to_f32(type, row + (size_t)((c0 + c) / bs) * bb, out + c);
}
#endif

void gl_qrow_to_f32(const gl_mat *w, int r, float *out) { gl_qrow_range_to_f32(w, r, 0, w->cols, out); }

/* Columns [c0, c0+n) of row r: whole blocks straight to out, a block cut by
 * either end through a scratch block. */
void gl_qrow_range_to_f32(const gl_mat *w, int r, int c0, int n, float *out) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * gl_row_bytes(w->type, w->cols);
    int bs = gl_type_block(w->type);
    size_t bb = gl_block_bytes(w->type);
    float tmp[GL_QK_K];
    for (int c = c0; c < c0 + n;) {
        int b = c / bs, start = b * bs, end = start + bs < c0 + n ? start + bs : c0 + n;
        if (start == c && end == start + bs) gl_block_to_f32(w->type, row + (size_t)b * bb, out + (c - c0));
        else {
            gl_block_to_f32(w->type, row + (size_t)b * bb, tmp);
            memcpy(out + (c - c0), tmp + (c - start), (size_t)(end - c) * sizeof(float));
        }
        c = end;
    }
}

/* Q8_0 as llama.cpp's converter and quantizer write it: d = max|x| / 127
 * (stored as f16), q = round(x / d) half away from zero. */
void gl_quantize_row_q8_0(const float *x, int cols, uint8_t *out) {
    for (int c0 = 0; c0 + GL_QK <= cols; c0 += GL_QK, out += 34) {
        float amax = 0;
        for (int j = 0; j < GL_QK; j++) amax = fabsf(x[c0 + j]) > amax ? fabsf(x[c0 + j]) : amax;
        float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t h = gl_f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < GL_QK; j++) {
            float v = roundf(x[c0 + j] * id);
            out[2 + j] = (uint8_t)(int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
    }
}

/* Q4_0 as ggml's reference quantizer: the value of largest magnitude maps
 * to -8, d = max / -8. */
void gl_quantize_row_q4_0(const float *x, int cols, uint8_t *out) {
    for (int c0 = 0; c0 + GL_QK <= cols; c0 += GL_QK, out += 18) {
        float amax = 0, max = 0;
        for (int j = 0; j < GL_QK; j++)
            if (fabsf(x[c0 + j]) > amax) { amax = fabsf(x[c0 + j]); max = x[c0 + j]; }
        float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t h = gl_f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < 16; j++) {
            int a = (int)(x[c0 + j] * id + 8.5f), b = (int)(x[c0 + j + 16] * id + 8.5f);
            a = a > 15 ? 15 : a < 0 ? 0 : a;
            b = b > 15 ? 15 : b < 0 ? 0 : b;
            out[2 + j] = (uint8_t)(a | b << 4);
        }
    }
}

/* ---- the matrix product, shared by the SIMD sets ---- */
#if defined(GL_HAVE_AVX2) || defined(GL_HAVE_NEON)

#define GL_QMM_NR 3        /* weight rows per panel                     */
#define GL_QMM_TB 32       /* tokens whose partial sums are kept        */
#define GL_QMM_CHUNK 1024  /* columns dequantized at a time (k*256)     */

/* A SIMD set's two parts: dequantize columns [c0, c0+nc) of a row, and
 * add the products of nr buffered weight rows and nt tokens over nc
 * columns into partial sums part[t][k][0..lanes). */
typedef void (*gl_qdeq_fn)(int type, const uint8_t *row, int c0, int nc, float *out);
typedef void (*gl_qfma_fn)(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part);

/* The lanes' fixed reduction: 16 lanes fold to 8 (l + l+8), then
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the order of the fp sets' sums. */
static float gl_qmm_reduce(const float *p, int lanes) {
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = lanes == 16 ? p[i] + p[i + 8] : p[i];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static void gl_qmatmul_with(gl_qdeq_fn deq, gl_qfma_fn fma, int lanes, const gl_mat *w, const float *x, int n,
                            int ldx, float *y, int ldy, int r0, int r1) {
    float wbuf[GL_QMM_NR * GL_QMM_CHUNK] __attribute__((aligned(64)));
    float part[GL_QMM_TB * GL_QMM_NR * 16] __attribute__((aligned(64)));
    const int cols = w->cols;
    const size_t rb = gl_row_bytes(w->type, cols);
    for (int i0 = 0; i0 < n; i0 += GL_QMM_TB) {
        int ni = n - i0 < GL_QMM_TB ? n - i0 : GL_QMM_TB;
        for (int r = r0; r < r1; r += GL_QMM_NR) {
            int nr = r1 - r < GL_QMM_NR ? r1 - r : GL_QMM_NR;
            memset(part, 0, (size_t)ni * GL_QMM_NR * (size_t)lanes * sizeof(float));
            for (int c0 = 0; c0 < cols; c0 += GL_QMM_CHUNK) {
                int nc = cols - c0 < GL_QMM_CHUNK ? cols - c0 : GL_QMM_CHUNK;
                for (int k = 0; k < nr; k++)
                    deq(w->type, (const uint8_t *)w->data + (size_t)(r + k) * rb, c0, nc, wbuf + k * GL_QMM_CHUNK);
                for (int t = 0; t < ni; t += 4)
                    fma(wbuf, nr, x + (size_t)(i0 + t) * ldx + c0, ldx, ni - t < 4 ? ni - t : 4, nc,
                        part + (size_t)t * GL_QMM_NR * lanes);
            }
            for (int t = 0; t < ni; t++)
                for (int k = 0; k < nr; k++)
                    y[(size_t)(i0 + t) * ldy + r + k] = gl_qmm_reduce(part + ((size_t)t * GL_QMM_NR + k) * lanes, lanes);
        }
    }
}

#define GL_QTILE_CASES(tile)                                                     \
    switch (nr * 4 + nt) {                                                       \
    case 3 * 4 + 4: tile(wbuf, 3, x, ldx, 4, nc, part); break;                   \
    case 3 * 4 + 3: tile(wbuf, 3, x, ldx, 3, nc, part); break;                   \
    case 3 * 4 + 2: tile(wbuf, 3, x, ldx, 2, nc, part); break;                   \
    case 3 * 4 + 1: tile(wbuf, 3, x, ldx, 1, nc, part); break;                   \
    case 2 * 4 + 4: tile(wbuf, 2, x, ldx, 4, nc, part); break;                   \
    case 2 * 4 + 3: tile(wbuf, 2, x, ldx, 3, nc, part); break;                   \
    case 2 * 4 + 2: tile(wbuf, 2, x, ldx, 2, nc, part); break;                   \
    case 2 * 4 + 1: tile(wbuf, 2, x, ldx, 1, nc, part); break;                   \
    case 1 * 4 + 4: tile(wbuf, 1, x, ldx, 4, nc, part); break;                   \
    case 1 * 4 + 3: tile(wbuf, 1, x, ldx, 3, nc, part); break;                   \
    case 1 * 4 + 2: tile(wbuf, 1, x, ldx, 2, nc, part); break;                   \
    default:        tile(wbuf, 1, x, ldx, 1, nc, part); break;                   \
    }

#endif

#if defined(GL_HAVE_AVX2)
/* ---- AVX2 (and AVX-512) ---- */

/* an f16 scale by F16C: the same value as gl_f16_to_f32, subnormals included */
GL_AVX2_INLINE float qavx2_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

GL_AVX2_INLINE __m256 qavx2_u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
GL_AVX2_INLINE __m256 qavx2_i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* 16 bytes of small unsigned ints: 16 values d*q - o to out (o may be 0). */
GL_AVX2_INLINE void qavx2_put16(__m128i q, __m256 d, __m256 o, float *out) {
    _mm256_storeu_ps(out, _mm256_fmsub_ps(d, qavx2_u8x8(q), o));
    _mm256_storeu_ps(out + 8, _mm256_fmsub_ps(d, qavx2_u8x8(_mm_srli_si128(q, 8)), o));
}

static GL_AVX2 void avx2_qdeq(int type, const uint8_t *row, int c0, int nc, float *out) {
    const __m128i m4 = _mm_set1_epi8(0x0F), m1 = _mm_set1_epi8(1), m3 = _mm_set1_epi8(3);
    switch (type) {
    case GL_Q8_0:
        for (int c = 0; c < nc; c += 32) {
            const uint8_t *b = row + (size_t)((c0 + c) / 32) * 34;
            __m256 d = _mm256_set1_ps(gl_load_f16(b));
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(out + c + j, _mm256_mul_ps(d, qavx2_i8x8(_mm_loadl_epi64((const __m128i *)(b + 2 + j)))));
        }
        break;
    case GL_Q4_0:
        for (int c = 0; c < nc; c += 32) {
            const uint8_t *b = row + (size_t)((c0 + c) / 32) * 18;
            __m256 d = _mm256_set1_ps(gl_load_f16(b)), o = _mm256_set1_ps(8.0f * gl_load_f16(b));
            __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
            /* d*(q-8) = d*q - 8d: d*q and 8d are exact, so one rounding, the same value */
            qavx2_put16(_mm_and_si128(q, m4), d, o, out + c);
            qavx2_put16(_mm_and_si128(_mm_srli_epi16(q, 4), m4), d, o, out + c + 16);
        }
        break;
    case GL_Q4_K:
    case GL_Q5_K:
        for (int c = 0; c < nc; c += 256) {
            const uint8_t *b = row + (size_t)((c0 + c) / 256) * gl_block_bytes(type);
            float d = gl_load_f16(b), dmin = gl_load_f16(b + 2);
            const uint8_t *q = type == GL_Q4_K ? b + 16 : b + 48;
            __m128i h0 = _mm_loadu_si128((const __m128i *)(b + 16)), h1 = _mm_loadu_si128((const __m128i *)(b + 32));
            for (int g = 0; g < 4; g++, q += 32) {
                int s0, o0, s1, o1;
                gl_kq_scale_min(b + 4, 2 * g, &s0, &o0);
                gl_kq_scale_min(b + 4, 2 * g + 1, &s1, &o1);
                __m256 d0 = _mm256_set1_ps(d * (float)s0), n0 = _mm256_set1_ps(dmin * (float)o0);
                __m256 d1 = _mm256_set1_ps(d * (float)s1), n1 = _mm256_set1_ps(dmin * (float)o1);
                __m128i a = _mm_loadu_si128((const __m128i *)q), bq = _mm_loadu_si128((const __m128i *)(q + 16));
                __m128i alo = _mm_and_si128(a, m4), blo = _mm_and_si128(bq, m4);
                __m128i ahi = _mm_and_si128(_mm_srli_epi16(a, 4), m4), bhi = _mm_and_si128(_mm_srli_epi16(bq, 4), m4);
                if (type == GL_Q5_K) {
                    __m128i s = _mm_cvtsi32_si128(2 * g), s1v = _mm_cvtsi32_si128(2 * g + 1);
                    alo = _mm_or_si128(alo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h0, s), m1), 4));
                    blo = _mm_or_si128(blo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h1, s), m1), 4));
                    ahi = _mm_or_si128(ahi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h0, s1v), m1), 4));
                    bhi = _mm_or_si128(bhi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h1, s1v), m1), 4));
                }
                float *o = out + c + 64 * g;
                qavx2_put16(alo, d0, n0, o);
                qavx2_put16(blo, d0, n0, o + 16);
                qavx2_put16(ahi, d1, n1, o + 32);
                qavx2_put16(bhi, d1, n1, o + 48);
            }
        }
        break;
    case GL_Q6_K:
        for (int c = 0; c < nc; c += 256) {
            const uint8_t *b = row + (size_t)((c0 + c) / 256) * 210;
            float d = gl_load_f16(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            const __m128i k32 = _mm_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                float *o = out + c + 128 * h;
                for (int half = 0; half < 2; half++) {   /* l in [16*half, 16*half+16): one scale each */
                    __m128i A = _mm_loadu_si128((const __m128i *)(ql + 16 * half));
                    __m128i C = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * half));
                    __m128i H = _mm_loadu_si128((const __m128i *)(qh + 16 * half));
                    __m128i q[4];
                    q[0] = _mm_or_si128(_mm_and_si128(A, m4), _mm_slli_epi16(_mm_and_si128(H, m3), 4));
                    q[1] = _mm_or_si128(_mm_and_si128(C, m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 2), m3), 4));
                    q[2] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(A, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 4), m3), 4));
                    q[3] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(C, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 6), m3), 4));
                    for (int k = 0; k < 4; k++) {
                        __m128i v = _mm_sub_epi8(q[k], k32);
                        __m256 ds = _mm256_set1_ps(d * (float)sc[8 * h + half + 2 * k]);
                        float *p = o + 32 * k + 16 * half;
                        _mm256_storeu_ps(p, _mm256_mul_ps(ds, qavx2_i8x8(v)));
                        _mm256_storeu_ps(p + 8, _mm256_mul_ps(ds, qavx2_i8x8(_mm_srli_si128(v, 8))));
                    }
                }
            }
        }
        break;
    default:
        gl_qrow_span_scalar(type, row, c0, nc, out);
    }
}

/* nr x nt register tile over nc columns, partial sums in and out. */
GL_AVX2_INLINE void qavx2_tile(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part) {
    __m256 acc[GL_QMM_NR][4];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) acc[k][t] = _mm256_loadu_ps(part + ((size_t)t * GL_QMM_NR + k) * 8);
    for (int c = 0; c < nc; c += 8) {
        __m256 wv[GL_QMM_NR];
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = _mm256_load_ps(wbuf + k * GL_QMM_CHUNK + c);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * ldx + c);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = _mm256_fmadd_ps(wv[k], xv, acc[k][t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) _mm256_storeu_ps(part + ((size_t)t * GL_QMM_NR + k) * 8, acc[k][t]);
}


static GL_AVX2 void avx2_qfma(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part) {
    GL_QTILE_CASES(qavx2_tile)
}

/* Columns [c, c+32) of a row as 4 x 8 fp32 in registers: the values
 * gl_block_to_f32 gives, for the decode path below. */
GL_AVX2_INLINE void qavx2_get32(int type, const uint8_t *row, int c, __m256 v[4]) {
    const __m128i m4 = _mm_set1_epi8(0x0F), m3 = _mm_set1_epi8(3);
    switch (type) {
    case GL_Q8_0: {
        const uint8_t *b = row + (size_t)(c / 32) * 34;
        __m256 d = _mm256_set1_ps(qavx2_f16(b));
        for (int j = 0; j < 4; j++) v[j] = _mm256_mul_ps(d, qavx2_i8x8(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
        break;
    }
    case GL_Q4_0: {
        const uint8_t *b = row + (size_t)(c / 32) * 18;
        __m256 d = _mm256_set1_ps(qavx2_f16(b)), o = _mm256_set1_ps(8.0f * qavx2_f16(b));
        __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), lo = _mm_and_si128(q, m4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        v[0] = _mm256_fmsub_ps(d, qavx2_u8x8(lo), o);
        v[1] = _mm256_fmsub_ps(d, qavx2_u8x8(_mm_srli_si128(lo, 8)), o);
        v[2] = _mm256_fmsub_ps(d, qavx2_u8x8(hi), o);
        v[3] = _mm256_fmsub_ps(d, qavx2_u8x8(_mm_srli_si128(hi, 8)), o);
        break;
    }
    case GL_Q4_K:
    case GL_Q5_K: {
        const uint8_t *b = row + (size_t)(c / 256) * gl_block_bytes(type);
        int sub = (c % 256) / 32, sc, mn;
        gl_kq_scale_min(b + 4, sub, &sc, &mn);
        __m256 d = _mm256_set1_ps(qavx2_f16(b) * (float)sc), o = _mm256_set1_ps(qavx2_f16(b + 2) * (float)mn);
        const uint8_t *q = (type == GL_Q4_K ? b + 16 : b + 48) + 32 * (sub / 2);
        __m128i a = _mm_loadu_si128((const __m128i *)q), e = _mm_loadu_si128((const __m128i *)(q + 16));
        if (sub & 1) { a = _mm_srli_epi16(a, 4); e = _mm_srli_epi16(e, 4); }
        a = _mm_and_si128(a, m4);
        e = _mm_and_si128(e, m4);
        if (type == GL_Q5_K) {
            const __m128i m1 = _mm_set1_epi8(1), sh = _mm_cvtsi32_si128(sub);
            a = _mm_or_si128(a, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 16)), sh), m1), 4));
            e = _mm_or_si128(e, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 32)), sh), m1), 4));
        }
        v[0] = _mm256_fmsub_ps(d, qavx2_u8x8(a), o);
        v[1] = _mm256_fmsub_ps(d, qavx2_u8x8(_mm_srli_si128(a, 8)), o);
        v[2] = _mm256_fmsub_ps(d, qavx2_u8x8(e), o);
        v[3] = _mm256_fmsub_ps(d, qavx2_u8x8(_mm_srli_si128(e, 8)), o);
        break;
    }
    case GL_Q6_K: {
        const uint8_t *b = row + (size_t)(c / 256) * 210;
        int j = c % 256, h = j / 128, quarter = (j % 128) / 32;
        const uint8_t *ql = b + 64 * h + (quarter & 1) * 32, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * quarter;
        float d = qavx2_f16(b + 208);
        __m128i sh = _mm_cvtsi32_si128(2 * quarter);
        for (int half = 0; half < 2; half++) {
            __m128i A = _mm_loadu_si128((const __m128i *)(ql + 16 * half)), H = _mm_loadu_si128((const __m128i *)(qh + 16 * half));
            if (quarter >= 2) A = _mm_srli_epi16(A, 4);
            __m128i q = _mm_or_si128(_mm_and_si128(A, m4), _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(H, sh), m3), 4));
            q = _mm_sub_epi8(q, _mm_set1_epi8(32));
            __m256 ds = _mm256_set1_ps(d * (float)sc[half]);
            v[2 * half] = _mm256_mul_ps(ds, qavx2_i8x8(q));
            v[2 * half + 1] = _mm256_mul_ps(ds, qavx2_i8x8(_mm_srli_si128(q, 8)));
        }
        break;
    }
    default: {
        float buf[32];
        gl_qrow_span_scalar(type, row, c, 32, buf);
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(buf + 8 * k);
    }
    }
}

/* Decode (one or two tokens): rows streamed once, four at a time (four
 * independent FMA chains), their values made in registers 32 at a time --
 * the same values and lane order as the buffered path, so the same bits. */
#define GL_QMV_ROWS 4
GL_AVX2_INLINE void qavx2_matvec_rows(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r, int nr) {
    const size_t rb = gl_row_bytes(w->type, w->cols);
    const uint8_t *row[GL_QMV_ROWS];
    __m256 acc0[GL_QMV_ROWS], acc1[GL_QMV_ROWS], v[4];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        row[k] = (const uint8_t *)w->data + (size_t)(r + k) * rb;
        acc0[k] = acc1[k] = _mm256_setzero_ps();
    }
    for (int c = 0; c < w->cols; c += 32) {
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            qavx2_get32(w->type, row[k], c, v);
            for (int j = 0; j < 4; j++) acc0[k] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + c + 8 * j), acc0[k]);
            if (n > 1)
                for (int j = 0; j < 4; j++) acc1[k] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + ldx + c + 8 * j), acc1[k]);
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        y[r + k] = avx2_hsum(acc0[k]);
        if (n > 1) y[ldy + r + k] = avx2_hsum(acc1[k]);
    }
}

GL_AVX2_INLINE void qavx2_matvec_typed(int type, const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    gl_mat t = *w;
    t.type = type;   /* a constant after inlining: the per-block switch folds away */
    int r = r0;
    for (; r + GL_QMV_ROWS <= r1; r += GL_QMV_ROWS) qavx2_matvec_rows(&t, x, n, ldx, y, ldy, r, GL_QMV_ROWS);
    for (; r < r1; r++) qavx2_matvec_rows(&t, x, n, ldx, y, ldy, r, 1);
}

static GL_AVX2 void avx2_qmatvec(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    switch (w->type) {
    case GL_Q8_0: qavx2_matvec_typed(GL_Q8_0, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q4_0: qavx2_matvec_typed(GL_Q4_0, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q4_K: qavx2_matvec_typed(GL_Q4_K, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q5_K: qavx2_matvec_typed(GL_Q5_K, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q6_K: qavx2_matvec_typed(GL_Q6_K, w, x, n, ldx, y, ldy, r0, r1); break;
    default:      qavx2_matvec_typed(w->type, w, x, n, ldx, y, ldy, r0, r1); break;
    }
}

static void avx2_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    if (n <= 2) avx2_qmatvec(w, x, n, ldx, y, ldy, r0, r1);
    else gl_qmatmul_with(avx2_qdeq, avx2_qfma, 8, w, x, n, ldx, y, ldy, r0, r1);
}

/* AVX-512: the same dequantized values, 16 lanes (c mod 16) by 512-bit FMA. */
#define GL_AVX512_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"
#define GL_AVX512_INLINE static inline __attribute__((always_inline, target(GL_AVX512_TARGET)))

GL_AVX512_INLINE void qavx512_tile(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part) {
    __m512 acc[GL_QMM_NR][4];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) acc[k][t] = _mm512_loadu_ps(part + ((size_t)t * GL_QMM_NR + k) * 16);
    for (int c = 0; c < nc; c += 16) {   /* nc is a multiple of 32 */
        __m512 wv[GL_QMM_NR];
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = _mm512_load_ps(wbuf + k * GL_QMM_CHUNK + c);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)t * ldx + c);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = _mm512_fmadd_ps(wv[k], xv, acc[k][t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) _mm512_storeu_ps(part + ((size_t)t * GL_QMM_NR + k) * 16, acc[k][t]);
}

static __attribute__((target(GL_AVX512_TARGET))) void avx512_qfma(const float *wbuf, int nr, const float *x, int ldx,
                                                                 int nt, int nc, float *part) {
    GL_QTILE_CASES(qavx512_tile)
}

/* Decode as in AVX2, 16 lanes: columns c..c+15 are one 512-bit vector. */
GL_AVX512_INLINE void qavx512_matvec_rows(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r, int nr) {
    const size_t rb = gl_row_bytes(w->type, w->cols);
    const uint8_t *row[GL_QMV_ROWS];
    __m512 acc0[GL_QMV_ROWS], acc1[GL_QMV_ROWS];
    __m256 v[4];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        row[k] = (const uint8_t *)w->data + (size_t)(r + k) * rb;
        acc0[k] = acc1[k] = _mm512_setzero_ps();
    }
    for (int c = 0; c < w->cols; c += 32) {
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            qavx2_get32(w->type, row[k], c, v);
            __m512 a = _mm512_insertf32x8(_mm512_castps256_ps512(v[0]), v[1], 1);
            __m512 b = _mm512_insertf32x8(_mm512_castps256_ps512(v[2]), v[3], 1);
            acc0[k] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + c + 16), _mm512_fmadd_ps(a, _mm512_loadu_ps(x + c), acc0[k]));
            if (n > 1)
                acc1[k] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + ldx + c + 16), _mm512_fmadd_ps(a, _mm512_loadu_ps(x + ldx + c), acc1[k]));
        }
    }
    float p[16];
#pragma GCC unroll 4
    for (int k = 0; k < nr; k++) {
        _mm512_storeu_ps(p, acc0[k]);
        y[r + k] = gl_qmm_reduce(p, 16);
        if (n > 1) { _mm512_storeu_ps(p, acc1[k]); y[ldy + r + k] = gl_qmm_reduce(p, 16); }
    }
}

GL_AVX512_INLINE void qavx512_matvec_typed(int type, const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    gl_mat t = *w;
    t.type = type;
    int r = r0;
    for (; r + GL_QMV_ROWS <= r1; r += GL_QMV_ROWS) qavx512_matvec_rows(&t, x, n, ldx, y, ldy, r, GL_QMV_ROWS);
    for (; r < r1; r++) qavx512_matvec_rows(&t, x, n, ldx, y, ldy, r, 1);
}

static __attribute__((target(GL_AVX512_TARGET))) void avx512_qmatvec(const gl_mat *w, const float *x, int n, int ldx,
                                                                    float *y, int ldy, int r0, int r1) {
    switch (w->type) {
    case GL_Q8_0: qavx512_matvec_typed(GL_Q8_0, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q4_0: qavx512_matvec_typed(GL_Q4_0, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q4_K: qavx512_matvec_typed(GL_Q4_K, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q5_K: qavx512_matvec_typed(GL_Q5_K, w, x, n, ldx, y, ldy, r0, r1); break;
    case GL_Q6_K: qavx512_matvec_typed(GL_Q6_K, w, x, n, ldx, y, ldy, r0, r1); break;
    default:      qavx512_matvec_typed(w->type, w, x, n, ldx, y, ldy, r0, r1); break;
    }
}

static void avx512_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    if (n <= 2) avx512_qmatvec(w, x, n, ldx, y, ldy, r0, r1);
    else gl_qmatmul_with(avx2_qdeq, avx512_qfma, 16, w, x, n, ldx, y, ldy, r0, r1);
}

#elif defined(GL_HAVE_NEON)
/* ---- NEON ---- */

GL_NEON_INLINE void qneon_put8(uint8x8_t q, float32x4_t d, float32x4_t o, float *out) {
    uint16x8_t h = vmovl_u8(q);
    /* d*q - o: the product is exact, so the fused form rounds once, as the scalar */
    vst1q_f32(out, vsubq_f32(vmulq_f32(d, vcvtq_f32_u32(vmovl_u16(vget_low_u16(h)))), o));
    vst1q_f32(out + 4, vsubq_f32(vmulq_f32(d, vcvtq_f32_u32(vmovl_u16(vget_high_u16(h)))), o));
}

GL_NEON_INLINE void qneon_put16(uint8x16_t q, float32x4_t d, float32x4_t o, float *out) {
    qneon_put8(vget_low_u8(q), d, o, out);
    qneon_put8(vget_high_u8(q), d, o, out + 8);
}

GL_NEON_INLINE void qneon_put8s(int8x8_t q, float32x4_t d, float *out) {
    int16x8_t h = vmovl_s8(q);
    vst1q_f32(out, vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)))));
    vst1q_f32(out + 4, vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)))));
}

static void neon_qdeq(int type, const uint8_t *row, int c0, int nc, float *out) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m1 = vdupq_n_u8(1), m3 = vdupq_n_u8(3);
    switch (type) {
    case GL_Q8_0:
        for (int c = 0; c < nc; c += 32) {
            const uint8_t *b = row + (size_t)((c0 + c) / 32) * 34;
            float32x4_t d = vdupq_n_f32(gl_load_f16(b));
            for (int j = 0; j < 32; j += 8) qneon_put8s(vld1_s8((const int8_t *)(b + 2 + j)), d, out + c + j);
        }
        break;
    case GL_Q4_0:
        for (int c = 0; c < nc; c += 32) {
            const uint8_t *b = row + (size_t)((c0 + c) / 32) * 18;
            float32x4_t d = vdupq_n_f32(gl_load_f16(b)), o = vdupq_n_f32(8.0f * gl_load_f16(b));
            uint8x16_t q = vld1q_u8(b + 2);
            qneon_put16(vandq_u8(q, m4), d, o, out + c);
            qneon_put16(vshrq_n_u8(q, 4), d, o, out + c + 16);
        }
        break;
    case GL_Q4_K:
    case GL_Q5_K:
        for (int c = 0; c < nc; c += 256) {
            const uint8_t *b = row + (size_t)((c0 + c) / 256) * gl_block_bytes(type);
            float d = gl_load_f16(b), dmin = gl_load_f16(b + 2);
            const uint8_t *q = type == GL_Q4_K ? b + 16 : b + 48;
            uint8x16_t h0 = vld1q_u8(b + 16), h1 = vld1q_u8(b + 32);
            for (int g = 0; g < 4; g++, q += 32) {
                int s0, o0, s1, o1;
                gl_kq_scale_min(b + 4, 2 * g, &s0, &o0);
                gl_kq_scale_min(b + 4, 2 * g + 1, &s1, &o1);
                float32x4_t d0 = vdupq_n_f32(d * (float)s0), n0 = vdupq_n_f32(dmin * (float)o0);
                float32x4_t d1 = vdupq_n_f32(d * (float)s1), n1 = vdupq_n_f32(dmin * (float)o1);
                uint8x16_t a = vld1q_u8(q), bq = vld1q_u8(q + 16);
                uint8x16_t alo = vandq_u8(a, m4), blo = vandq_u8(bq, m4), ahi = vshrq_n_u8(a, 4), bhi = vshrq_n_u8(bq, 4);
                if (type == GL_Q5_K) {
                    int8x16_t s = vdupq_n_s8((int8_t)-(2 * g)), s1v = vdupq_n_s8((int8_t)-(2 * g + 1));
                    alo = vorrq_u8(alo, vshlq_n_u8(vandq_u8(vshlq_u8(h0, s), m1), 4));
                    blo = vorrq_u8(blo, vshlq_n_u8(vandq_u8(vshlq_u8(h1, s), m1), 4));
                    ahi = vorrq_u8(ahi, vshlq_n_u8(vandq_u8(vshlq_u8(h0, s1v), m1), 4));
                    bhi = vorrq_u8(bhi, vshlq_n_u8(vandq_u8(vshlq_u8(h1, s1v), m1), 4));
                }
                float *o = out + c + 64 * g;
                qneon_put16(alo, d0, n0, o);
                qneon_put16(blo, d0, n0, o + 16);
                qneon_put16(ahi, d1, n1, o + 32);
                qneon_put16(bhi, d1, n1, o + 48);
            }
        }
        break;
    case GL_Q6_K:
        for (int c = 0; c < nc; c += 256) {
            const uint8_t *b = row + (size_t)((c0 + c) / 256) * 210;
            float d = gl_load_f16(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            const uint8x16_t k32 = vdupq_n_u8(32);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                float *o = out + c + 128 * h;
                for (int half = 0; half < 2; half++) {
                    uint8x16_t A = vld1q_u8(ql + 16 * half), C = vld1q_u8(ql + 32 + 16 * half), H = vld1q_u8(qh + 16 * half);
                    uint8x16_t q[4];
                    q[0] = vorrq_u8(vandq_u8(A, m4), vshlq_n_u8(vandq_u8(H, m3), 4));
                    q[1] = vorrq_u8(vandq_u8(C, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(H, 2), m3), 4));
                    q[2] = vorrq_u8(vshrq_n_u8(A, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(H, 4), m3), 4));
                    q[3] = vorrq_u8(vshrq_n_u8(C, 4), vshlq_n_u8(vshrq_n_u8(H, 6), 4));
                    for (int k = 0; k < 4; k++) {
                        int8x16_t v = vreinterpretq_s8_u8(vsubq_u8(q[k], k32));
                        float32x4_t ds = vdupq_n_f32(d * (float)sc[8 * h + half + 2 * k]);
                        float *p = o + 32 * k + 16 * half;
                        qneon_put8s(vget_low_s8(v), ds, p);
                        qneon_put8s(vget_high_s8(v), ds, p + 8);
                    }
                }
            }
        }
        break;
    default:
        gl_qrow_span_scalar(type, row, c0, nc, out);
    }
}

GL_NEON_INLINE void qneon_tile(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part) {
    neon_f8x acc[GL_QMM_NR][4];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) acc[k][t] = neon_load_x(part + ((size_t)t * GL_QMM_NR + k) * 8);
    for (int c = 0; c < nc; c += 8) {
        neon_f8x wv[GL_QMM_NR];
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) wv[k] = neon_load_x(wbuf + k * GL_QMM_CHUNK + c);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            neon_f8x xv = neon_load_x(x + (size_t)t * ldx + c);
#pragma GCC unroll 4
            for (int k = 0; k < nr; k++) acc[k][t] = neon_fma(acc[k][t], wv[k], xv);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int k = 0; k < nr; k++) {
            float *p = part + ((size_t)t * GL_QMM_NR + k) * 8;
            vst1q_f32(p, acc[k][t].lo);
            vst1q_f32(p + 4, acc[k][t].hi);
        }
}

static void neon_qfma(const float *wbuf, int nr, const float *x, int ldx, int nt, int nc, float *part) {
    GL_QTILE_CASES(qneon_tile)
}

static void neon_qmatmul(const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy, int r0, int r1) {
    gl_qmatmul_with(neon_qdeq, neon_qfma, 8, w, x, n, ldx, y, ldy, r0, r1);
}
#endif

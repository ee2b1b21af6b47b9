/* test_loader.c -- loading checkpoints: every damaged or unsupported input
 * returns its documented status with a message naming the file, never a
 * crash; FP8 block-scaled checkpoints compute exactly what their
 * dequantized weights compute; tokenizer-only models; progress reports. */
#include "../cm384.c"
#include "test.h"

#include <dirent.h>

#define FIX "tests/fixtures/tiny-dsv3"

static char tmp_root[256];

static int ld_read_all(const char *path, uint8_t **data, size_t *size) {
    *data = NULL;
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *data = malloc((size_t)n + 1);
    *size = fread(*data, 1, (size_t)n, f);
    fclose(f);
    return 0;
}

static void ld_write_all(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    fwrite(data, 1, size, f);
    fclose(f);
}

/* A fresh copy of the fixture directory. */
static const char *fresh_copy(const char *name) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", tmp_root, name);
    mkdir(dir, 0755);
    DIR *d = opendir(FIX);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char src[512], dst[768];
        snprintf(src, sizeof src, "%s/%s", FIX, de->d_name);
        snprintf(dst, sizeof dst, "%s/%s", dir, de->d_name);
        uint8_t *data; size_t n;
        if (ld_read_all(src, &data, &n) == 0) { ld_write_all(dst, data, n); free(data); }
    }
    closedir(d);
    return dir;
}

static void file_in(char *out, size_t cap, const char *dir, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

/* Replaces the first `from` in a safetensors header with `to`, keeping the
 * data bytes: the header length field is rewritten. */
static void edit_header(const char *path, const char *from, const char *to) {
    uint8_t *d; size_t n;
    ld_read_all(path, &d, &n);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | d[i];
    char *h = malloc(hl + 1);
    memcpy(h, d + 8, hl);
    h[hl] = 0;
    char *at = strstr(h, from);
    if (!at) { printf("edit_header: %s not found\n", from); exit(1); }
    size_t nh = hl - strlen(from) + strlen(to);
    char *h2 = malloc(nh + 8);
    size_t pre = (size_t)(at - h);
    memcpy(h2, h, pre);
    memcpy(h2 + pre, to, strlen(to));
    memcpy(h2 + pre + strlen(to), at + strlen(from), hl - pre - strlen(from));
    while (nh % 8) h2[nh++] = ' ';
    FILE *f = fopen(path, "wb");
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(nh >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(h2, 1, nh, f);
    fwrite(d + 8 + hl, 1, n - 8 - hl, f);
    fclose(f);
    free(d); free(h); free(h2);
}

static void replace_in_file(const char *path, const char *from, const char *to) {
    uint8_t *d; size_t n;
    ld_read_all(path, &d, &n);
    d[n] = 0;
    char *at = strstr((char *)d, from);
    if (!at) { printf("replace_in_file: %s not found in %s\n", from, path); exit(1); }
    FILE *f = fopen(path, "wb");
    fwrite(d, 1, (size_t)(at - (char *)d), f);
    fwrite(to, 1, strlen(to), f);
    fwrite(at + strlen(from), 1, n - (size_t)(at - (char *)d) - strlen(from), f);
    fclose(f);
    free(d);
}

/* Loads and expects a status whose message mentions `needle`. */
static void expect(const char *what, const char *path, int status, const char *needle) {
    cm384_model *m = (cm384_model *)1;
    int r = cm384_model_load(path, NULL, &m);
    const char *msg = cm384_last_error();
    int ok = r == status && m == NULL && (!needle || strstr(msg, needle));
    printf("  %-34s -> %-22s %s\n", what, cm384_strerror(r), msg);
    CHECK(ok, "%s: got status %d (%s), want %d mentioning \"%s\"", what, r, msg, status, needle ? needle : "");
    if (r == CM384_OK) cm384_model_free(m);
}

/* ---- FP8: write the fixture as F8_E4M3 with 128x128 block scales, and as
   F32 holding exactly the dequantized values ---- */

static uint8_t f32_to_e4m3(float x) {
    /* nearest representable e4m3fn value by search: 256 candidates */
    int best = 0;
    float bd = INFINITY;
    for (int i = 0; i < 256; i++) {
        float v = gl_f8e4m3_to_f32((uint8_t)i);
        if (v != v) continue;
        float dd = fabsf(v - x);
        if (dd < bd) { bd = dd; best = i; }
    }
    return (uint8_t)best;
}

typedef struct { char name[160]; char dtype[8]; int ndim; int64_t shape[2]; uint8_t *data; size_t n; } out_tensor;

static void write_safetensors(const char *path, out_tensor *t, int nt) {
    strbuf h = {0};
    sb_puts(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (int i = 0; i < nt; i++) {
        char buf[512];
        if (t[i].ndim == 1)
            snprintf(buf, sizeof buf, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%zu,%zu]}",
                     t[i].name, t[i].dtype, (long long)t[i].shape[0], off, off + t[i].n);
        else
            snprintf(buf, sizeof buf, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}",
                     t[i].name, t[i].dtype, (long long)t[i].shape[0], (long long)t[i].shape[1], off, off + t[i].n);
        sb_puts(&h, buf);
        off += t[i].n;
    }
    sb_puts(&h, "}");
    while (h.n % 8) sb_puts(&h, " ");
    FILE *f = fopen(path, "wb");
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)h.n >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(h.p, 1, h.n, f);
    for (int i = 0; i < nt; i++) fwrite(t[i].data, 1, t[i].n, f);
    fclose(f);
    free(h.p);
}

static int is_fp8_candidate(const char *name, int ndim) {
    if (ndim != 2) return 0;
    if (strstr(name, "embed_tokens") || strstr(name, "lm_head") || strstr(name, "shared_head.head") ||
        strstr(name, "mlp.gate.weight") || strstr(name, "eh_proj")) return 0;
    return 1;
}

static void make_fp8_pair(const char *dir8, const char *dir32) {
    mkdir(dir8, 0755);
    mkdir(dir32, 0755);
    arena a = {0};
    tensor_table tt = {0};
    file_map fm[2];
    const char *shards[2] = {FIX "/model-00001-of-00002.safetensors", FIX "/model-00002-of-00002.safetensors"};
    for (int i = 0; i < 2; i++) { file_map_open(&fm[i], shards[i], 1); st_read_header(&fm[i], shards[i], i, &a, &tt); }
    out_tensor *o8 = calloc((size_t)tt.n * 2, sizeof *o8), *o32 = calloc((size_t)tt.n, sizeof *o32);
    int n8 = 0, n32 = 0;
    for (int i = 0; i < tt.cap; i++) {
        tensor_info *t = &tt.items[i];
        if (!t->name) continue;
        out_tensor *a8 = &o8[n8++], *a32 = &o32[n32++];
        snprintf(a8->name, sizeof a8->name, "%s", t->name);
        snprintf(a32->name, sizeof a32->name, "%s", t->name);
        a8->ndim = a32->ndim = t->ndim;
        a8->shape[0] = a32->shape[0] = t->shape[0];
        a8->shape[1] = a32->shape[1] = t->ndim > 1 ? t->shape[1] : 1;
        int rows = (int)t->shape[0], cols = t->ndim > 1 ? (int)t->shape[1] : 1;
        gl_mat g = {t->dtype, t->ndim > 1 ? rows : 1, t->ndim > 1 ? cols : rows, t->data, NULL};
        float *f = malloc(sizeof(float) * rows * cols);
        for (int r = 0; r < g.rows; r++) gl_row_to_f32(&g, r, f + (size_t)r * g.cols);
        if (!is_fp8_candidate(t->name, t->ndim)) {
            /* unchanged in the fp8 file; F32 in the reference file */
            snprintf(a8->dtype, sizeof a8->dtype, "%s", t->dtype_name);
            a8->data = malloc(t->nbytes); memcpy(a8->data, t->data, t->nbytes); a8->n = t->nbytes;
            snprintf(a32->dtype, sizeof a32->dtype, "F32");
            a32->data = (uint8_t *)f; a32->n = sizeof(float) * rows * cols;
            continue;
        }
        int br = (rows + 127) / 128, bc = (cols + 127) / 128;
        float *sc = calloc((size_t)br * bc, sizeof(float));
        uint8_t *q = malloc((size_t)rows * cols);
        float *deq = malloc(sizeof(float) * rows * cols);
        for (int bi = 0; bi < br; bi++)
            for (int bj = 0; bj < bc; bj++) {
                float amax = 0;
                for (int r = bi * 128; r < rows && r < bi * 128 + 128; r++)
                    for (int c = bj * 128; c < cols && c < bj * 128 + 128; c++) amax = fmaxf(amax, fabsf(f[(size_t)r * cols + c]));
                float s = amax > 0 ? amax / 448.0f : 1.0f;
                sc[bi * bc + bj] = s;
                for (int r = bi * 128; r < rows && r < bi * 128 + 128; r++)
                    for (int c = bj * 128; c < cols && c < bj * 128 + 128; c++) {
                        uint8_t b = f32_to_e4m3(f[(size_t)r * cols + c] / s);
                        q[(size_t)r * cols + c] = b;
                        deq[(size_t)r * cols + c] = gl_f8e4m3_to_f32(b) * s;
                    }
            }
        snprintf(a8->dtype, sizeof a8->dtype, "F8_E4M3");
        a8->data = q; a8->n = (size_t)rows * cols;
        out_tensor *s8 = &o8[n8++];
        snprintf(s8->name, sizeof s8->name, "%s_scale_inv", t->name);
        snprintf(s8->dtype, sizeof s8->dtype, "F32");
        s8->ndim = 2; s8->shape[0] = br; s8->shape[1] = bc;
        s8->data = (uint8_t *)sc; s8->n = sizeof(float) * br * bc;
        snprintf(a32->dtype, sizeof a32->dtype, "F32");
        a32->data = (uint8_t *)deq; a32->n = sizeof(float) * rows * cols;
        free(f);
    }
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dir8); write_safetensors(p, o8, n8);
    snprintf(p, sizeof p, "%s/model.safetensors", dir32); write_safetensors(p, o32, n32);
    uint8_t *cfg; size_t cn;
    ld_read_all(FIX "/config.json", &cfg, &cn);
    snprintf(p, sizeof p, "%s/config.json", dir32); ld_write_all(p, cfg, cn);
    cfg[cn] = 0;
    /* the fp8 config carries quantization_config as DeepSeek-V3 ships it */
    char *brace = strrchr((char *)cfg, '}');
    *brace = 0;
    char *c8 = malloc(cn + 256);
    snprintf(c8, cn + 256, "%s,\n  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", "
             "\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}\n}\n", (char *)cfg);
    snprintf(p, sizeof p, "%s/config.json", dir8); ld_write_all(p, c8, strlen(c8));
    free(c8); free(cfg);
    for (int i = 0; i < n8; i++) free(o8[i].data);
    for (int i = 0; i < n32; i++) free(o32[i].data);
    free(o8); free(o32);
    free(tt.items);
    for (int i = 0; i < 2; i++) file_map_close(&fm[i]);
    arena_free(&a);
}

static int progress_calls;
static int on_progress(void *user, const char *stage, uint64_t done, uint64_t total) {
    (void)stage;
    progress_calls++;
    return user && done * 2 > total;          /* cancel half-way when asked */
}

/* ---- damaged GGUF files: a good file written by cm384_model_save_gguf,
   then one field broken at a time ---- */

static uint8_t *gguf_good;
static size_t gguf_good_n;

/* Offset of the first occurrence of a byte string in the good file. */
static size_t gguf_find_bytes(const char *s, size_t from) {
    size_t n = strlen(s);
    for (size_t i = from; i + n <= gguf_good_n; i++)
        if (!memcmp(gguf_good + i, s, n)) return i;
    printf("gguf_find_bytes: \"%s\" not in the file\n", s);
    exit(1);
}

/* Writes the good file with n bytes at `at` replaced (or cut to `cut` bytes). */
static const char *gguf_variant(const char *name, size_t at, const void *bytes, size_t n, size_t cut) {
    static char path[600];
    snprintf(path, sizeof path, "%s/%s.gguf", tmp_root, name);
    uint8_t *d = malloc(gguf_good_n);
    memcpy(d, gguf_good, gguf_good_n);
    if (bytes) memcpy(d + at, bytes, n);
    ld_write_all(path, d, cut ? cut : gguf_good_n);
    free(d);
    return path;
}

static void gguf_put_u64(uint8_t *b, uint64_t v) { for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i)); }

static void gguf_damaged_cases(void) {
    char good[600];
    snprintf(good, sizeof good, "%s/good.gguf", tmp_root);
    cm384_model *m;
    int r = cm384_model_load(FIX, NULL, &m);
    if (!r) r = cm384_model_save_gguf(m, good, "q8_0");
    cm384_model_free(m);
    CHECK(r == CM384_OK, "writing the GGUF to damage: %s", cm384_last_error());
    if (r || ld_read_all(good, &gguf_good, &gguf_good_n)) return;
    r = cm384_model_load(good, NULL, &m);
    CHECK(r == CM384_OK, "the undamaged GGUF loads: %s", cm384_last_error());
    cm384_model_free(m);

    uint8_t b8[8];
    size_t at;
    expect("GGUF cut in the header", gguf_variant("cut-header", 0, NULL, 0, 100), CM384_E_FORMAT, "cannot fit");
    expect("GGUF cut in the metadata", gguf_variant("cut-meta", 0, NULL, 0, gguf_find_bytes("tokenizer.ggml.merges", 0) + 10),
           CM384_E_FORMAT, "cut-meta.gguf");
    expect("GGUF cut in the tensor data", gguf_variant("cut-data", 0, NULL, 0, gguf_good_n - 1000), CM384_E_FORMAT, "truncated");
    expect("GGUF bad magic", gguf_variant("magic", 0, "GGUX", 4, 0), CM384_E_FORMAT, "magic");
    expect("GGUF version 9", gguf_variant("version", 4, "\x09\0\0\0", 4, 0), CM384_E_UNSUPPORTED, "version 9");
    gguf_put_u64(b8, 1ull << 60);
    expect("GGUF absurd metadata count", gguf_variant("nkv", 16, b8, 8, 0), CM384_E_FORMAT, "cannot fit");
    at = gguf_find_bytes("general.architecture", 0);
    expect("GGUF key length past the end", gguf_variant("keylen", at - 8, b8, 8, 0), CM384_E_FORMAT, "past the end");
    at = gguf_find_bytes("general.type", 0) + strlen("general.type");
    expect("GGUF unknown value type", gguf_variant("vtype", at, "\x4d\0\0\0", 4, 0), CM384_E_FORMAT, "value type 77");
    at = gguf_find_bytes("deepseek2", gguf_find_bytes("general.architecture", 0) + 20);
    expect("GGUF another architecture", gguf_variant("arch", at, "qwen2moe_", 9, 0), CM384_E_UNSUPPORTED, "qwen2moe_");
    at = gguf_find_bytes("deepseek2.attention.kv_lora_rank", 0);
    expect("GGUF missing hyper-parameter", gguf_variant("nokey", at, "deepseek2.attention.kv_lora_ranq", 32, 0),
           CM384_E_FORMAT, "kv_lora_rank");
    at = gguf_find_bytes("deepseek-v3", 0);
    expect("GGUF unknown pre-tokenizer", gguf_variant("pre", at, "deepseek-v9", 11, 0), CM384_E_UNSUPPORTED, "deepseek-v9");
    /* tensor infos: name, n_dims (u32), ne (u64 each), type (u32), offset (u64) */
    at = gguf_find_bytes("blk.0.attn_q_a.weight", gguf_find_bytes("tokenizer.ggml.merges", 0));
    size_t info = at + strlen("blk.0.attn_q_a.weight");
    expect("GGUF missing tensor", gguf_variant("notensor", at, "blk.0.attn_q_x", 14, 0), CM384_E_FORMAT, "attn_q_a");
    expect("GGUF duplicate tensor", gguf_variant("dup", gguf_find_bytes("blk.0.attn_q_b.weight", info), "blk.0.attn_q_a", 14, 0),
           CM384_E_FORMAT, "appears twice");
    expect("GGUF 7 dimensions", gguf_variant("ndims", info, "\x07\0\0\0", 4, 0), CM384_E_FORMAT, "dimensions");
    gguf_put_u64(b8, 48);   /* rows of 48 values: not whole Q8_0 blocks */
    expect("GGUF rows not whole blocks", gguf_variant("blocks", info + 4, b8, 8, 0), CM384_E_FORMAT, "blocks");
    gguf_put_u64(b8, 33);
    expect("GGUF wrong shape", gguf_variant("shape", info + 12, b8, 8, 0), CM384_E_FORMAT, "shape");
    expect("GGUF unknown tensor type", gguf_variant("ttype", info + 20, "\x63\0\0\0", 4, 0), CM384_E_UNSUPPORTED, "type 99");
    expect("GGUF unsupported tensor type", gguf_variant("q2k", info + 20, "\x0a\0\0\0", 4, 0), CM384_E_UNSUPPORTED, "Q2_K");
    uint64_t off = 0;
    for (int i = 7; i >= 0; i--) off = off << 8 | gguf_good[info + 24 + i];
    gguf_put_u64(b8, off + 1);
    expect("GGUF misaligned tensor", gguf_variant("align", info + 24, b8, 8, 0), CM384_E_FORMAT, "alignment");
    gguf_put_u64(b8, 1ull << 40);
    expect("GGUF tensor past the end", gguf_variant("offset", info + 24, b8, 8, 0), CM384_E_FORMAT, "past the end");
    free(gguf_good);
}

TEST_MAIN(loader) {
    snprintf(tmp_root, sizeof tmp_root, "/tmp/cm384-test-loader-XXXXXX");
    if (!mkdtemp(tmp_root)) { perror("mkdtemp"); return 1; }
    char p[768];
    const char *d;

    printf("loader errors:\n");
    expect("path does not exist", "/nonexistent/model", CM384_E_IO, "/nonexistent/model");

    d = fresh_copy("badjson");
    file_in(p, sizeof p, d, "config.json");
    replace_in_file(p, "\"hidden_size\": 64,", "\"hidden_size\": 64,,");
    expect("bad JSON in config.json", d, CM384_E_FORMAT, "config.json");

    d = fresh_copy("modeltype");
    file_in(p, sizeof p, d, "config.json");
    replace_in_file(p, "\"deepseek_v3\"", "\"llama\"");
    expect("unsupported model_type", d, CM384_E_UNSUPPORTED, "llama");

    d = fresh_copy("blocksize");
    file_in(p, sizeof p, d, "config.json");
    replace_in_file(p, "\"model_type\": \"deepseek_v3\",", "\"model_type\": \"deepseek_v3\", \"quantization_config\": "
                    "{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]},");
    expect("FP8 block size other than 128x128", d, CM384_E_UNSUPPORTED, "weight_block_size");

    d = fresh_copy("noconfig");
    file_in(p, sizeof p, d, "config.json");
    unlink(p);
    expect("no config.json", d, CM384_E_IO, "config.json");

    d = fresh_copy("missing");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    edit_header(p, "\"model.norm.weight\"", "\"model.norm.weighX\"");
    file_in(p, sizeof p, d, "model.safetensors.index.json");
    replace_in_file(p, "\"model.norm.weight\"", "\"model.norm.weighX\"");
    expect("missing tensor", d, CM384_E_FORMAT, "model.norm.weight");

    d = fresh_copy("notinshard");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    edit_header(p, "\"model.norm.weight\"", "\"model.norm.weighX\"");
    expect("index names a tensor a shard lacks", d, CM384_E_FORMAT, "model.norm.weight");

    d = fresh_copy("shape");
    file_in(p, sizeof p, d, "model-00001-of-00002.safetensors");
    edit_header(p, "\"model.layers.0.self_attn.q_a_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[32,64]",
                   "\"model.layers.0.self_attn.q_a_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[64,32]");
    expect("wrong shape", d, CM384_E_FORMAT, "q_a_proj");

    d = fresh_copy("dtype");
    file_in(p, sizeof p, d, "model-00001-of-00002.safetensors");
    edit_header(p, "\"model.embed_tokens.weight\":{\"dtype\":\"BF16\"", "\"model.embed_tokens.weight\":{\"dtype\":\"Q4\"");
    expect("unknown dtype", d, CM384_E_UNSUPPORTED, "Q4");

    d = fresh_copy("dtype2");
    file_in(p, sizeof p, d, "model-00001-of-00002.safetensors");
    edit_header(p, "\"model.embed_tokens.weight\":{\"dtype\":\"BF16\"", "\"model.embed_tokens.weight\":{\"dtype\":\"I16\"");
    expect("a dtype that is not a weight type", d, CM384_E_UNSUPPORTED, "I16");

    d = fresh_copy("truncated");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    if (truncate(p, 300000) != 0) perror("truncate");
    expect("truncated shard", d, CM384_E_FORMAT, "truncated");

    d = fresh_copy("hdrlen");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    {
        uint8_t *data; size_t n;
        ld_read_all(p, &data, &n);
        uint64_t big = (uint64_t)n * 4;
        for (int i = 0; i < 8; i++) data[i] = (uint8_t)(big >> (8 * i));
        ld_write_all(p, data, n);
        free(data);
    }
    expect("header length past end of file", d, CM384_E_FORMAT, "past the end");

    d = fresh_copy("badhdr");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    edit_header(p, "{\"__metadata__\"", "[\"__metadata__\"");
    expect("safetensors header is not JSON", d, CM384_E_FORMAT, "model-00002-of-00002.safetensors");

    d = fresh_copy("offsets");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors");
    edit_header(p, "\"data_offsets\":[0,4096]", "\"data_offsets\":[0,4095]");
    expect("byte count does not match shape", d, CM384_E_FORMAT, "bytes for");

    d = fresh_copy("badvalue");
    file_in(p, sizeof p, d, "config.json");
    replace_in_file(p, "\"hidden_size\": 64,", "\"hidden_size\": \"sixty-four\",");
    expect("config value of the wrong type", d, CM384_E_FORMAT, "hidden_size");

    d = fresh_copy("noshards");
    file_in(p, sizeof p, d, "model.safetensors.index.json"); unlink(p);
    expect("no safetensors at all", d, CM384_E_IO, "model.safetensors");

    d = fresh_copy("shardgone");
    file_in(p, sizeof p, d, "model-00002-of-00002.safetensors"); unlink(p);
    expect("a shard the index names is missing", d, CM384_E_IO, "model-00002-of-00002.safetensors");

    d = fresh_copy("badtok");
    file_in(p, sizeof p, d, "tokenizer.json");
    truncate(p, 1000);
    expect("truncated tokenizer.json", d, CM384_E_FORMAT, "tokenizer.json");

    snprintf(p, sizeof p, "%s/model.gguf", tmp_root);
    ld_write_all(p, "GGUF", 4);
    expect("a 4-byte GGUF file", p, CM384_E_FORMAT, "model.gguf");
    gguf_damaged_cases();

    /* NULL and bad arguments */
    {
        cm384_model *m;
        CHECK(cm384_model_load(NULL, NULL, &m) == CM384_E_INVALID, "NULL path");
        cm384_load_opts o;
        cm384_load_opts_init(&o);
        o.struct_size = 3;
        CHECK(cm384_model_load(FIX, &o, &m) == CM384_E_INVALID, "struct_size too small");
        cm384_model_free(NULL);
    }

    printf("progress and cancellation:\n");
    {
        cm384_load_opts o;
        cm384_load_opts_init(&o);
        o.progress = on_progress;
        cm384_model *m;
        progress_calls = 0;
        int r = cm384_model_load(FIX, &o, &m);
        printf("  progress callback called %d times\n", progress_calls);
        CHECK(r == CM384_OK && progress_calls > 10, "progress: %d calls, status %d", progress_calls, r);
        cm384_model_free(m);
        o.progress_user = (void *)1;
        r = cm384_model_load(FIX, &o, &m);
        CHECK(r == CM384_E_CANCELLED && m == NULL, "cancel from the progress callback: %d", r);
        o.progress_user = NULL;
        o.use_mmap = 0;
        r = cm384_model_load(FIX, &o, &m);
        CHECK(r == CM384_OK, "load without mmap: %s", cm384_last_error());
        cm384_model_free(m);
    }

    printf("tokenizer-only model:\n");
    {
        cm384_model *m;
        int r = cm384_model_load(FIX "/tokenizer.json", NULL, &m);
        CHECK(r == CM384_OK, "tokenizer-only load: %s", cm384_last_error());
        if (r == CM384_OK) {
            CHECK(cm384_vocab_size(m) == 1024, "vocab %d", cm384_vocab_size(m));
            cm384_engine *e = (cm384_engine *)1;
            r = cm384_engine_create(m, NULL, &e);
            printf("  engine on a tokenizer-only model -> %s: %s\n", cm384_strerror(r), cm384_last_error());
            CHECK(r == CM384_E_MISUSE && e == NULL, "engine on tokenizer-only model: %d", r);
            cm384_model_info info;
            memset(&info, 0, sizeof info);
            info.struct_size = sizeof info;
            cm384_model_get_info(m, &info);
            CHECK(!strcmp(info.model_type, "tokenizer"), "model_type %s", info.model_type);
            cm384_model_free(m);
        }
    }

    printf("FP8 (F8_E4M3 with 128x128 block scales):\n");
    {
        char d8[512], d32[512];
        snprintf(d8, sizeof d8, "%s/fp8", tmp_root);
        snprintf(d32, sizeof d32, "%s/f32", tmp_root);
        make_fp8_pair(d8, d32);
        cm384_model *m8, *m32;
        int r8 = cm384_model_load(d8, NULL, &m8), r32 = cm384_model_load(d32, NULL, &m32);
        CHECK(r8 == CM384_OK && r32 == CM384_OK, "fp8 load: %s", cm384_last_error());
        if (r8 == CM384_OK && r32 == CM384_OK) {
            cm384_model_info i8;
            memset(&i8, 0, sizeof i8);
            i8.struct_size = sizeof i8;
            cm384_model_get_info(m8, &i8);
            CHECK(!strcmp(i8.weight_dtype, "F8_E4M3"), "dominant dtype %s", i8.weight_dtype);
            cm384_config c;
            cm384_config_init(&c);
            c.n_workers = 2; c.int8_dispatch = 0; c.preset = "single";
            cm384_engine *e8, *e32;
            cm384_engine_create(m8, &c, &e8);
            cm384_engine_create(m32, &c, &e32);
            int32_t ids[40];
            for (int i = 0; i < 40; i++) ids[i] = (i * 97 + 5) % 1024;
            float *l8 = malloc(sizeof(float) * 40 * 1024), *l32 = malloc(sizeof(float) * 40 * 1024);
            cm384_eval(e8, ids, 40, l8, NULL);
            cm384_eval(e32, ids, 40, l32, NULL);
            double mx = 0;
            for (int i = 0; i < 40 * 1024; i++) mx = fmax(mx, fabs(l8[i] - l32[i]));
            printf("  fp8 checkpoint vs its dequantized F32 copy: max |diff| %.2e over 40 positions\n", mx);
            CHECK(mx < 1e-5, "fp8 differs from dequantized f32 by %g", mx);
            free(l8); free(l32);
            cm384_engine_free(e8);
            cm384_engine_free(e32);
        }
        cm384_model_free(m8);
        cm384_model_free(m32);
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp_root);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", tmp_root);
    return test_summary("loader");
}

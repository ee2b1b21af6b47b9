/* test_fuzzfix.c -- one regression test per defect the fuzz harnesses found
 * (tests/fuzz/README.md lists them; each reproducer is also kept in the
 * harness's corpus, so `make test` replays it through the harness too). */
#ifndef CM384_TEST_ALL
#include "../cm384.c"
#endif
#include "test.h"

/* A safetensors file whose header length is odd puts 16-bit data at odd
 * addresses; reading it through a uint16_t pointer is undefined (UBSan:
 * misaligned load in gl_row_to_f32).  Found by the safetensors harness.
 * Matrices and vectors must read the right values from any alignment. */
static void ff_misaligned_16bit(void) {
    printf("16-bit tensors at odd offsets:\n");
    static const float want[6] = {1, -2, 3.5f, 0, 0.25f, -7};
    for (int type = GL_F16; type <= GL_BF16; type++) {
        const char *dt = type == GL_F16 ? "F16" : "BF16";
        char hdr[256];
        int hl = snprintf(hdr, sizeof hdr,
                          "{\"w.weight\":{\"dtype\":\"%s\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
                          "\"v.weight\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[12,18]}}", dt, dt);
        if (hl % 2 == 0) hdr[hl++] = ' ';                  /* an odd header length */
        size_t size = 8 + (size_t)hl + 18;
        uint8_t *buf = malloc(size), *file = buf;           /* aligned, so the data starts at an odd address */
        if (!buf) { CHECK(0, "malloc"); return; }
        for (int i = 0; i < 8; i++) file[i] = (uint8_t)((uint64_t)hl >> (8 * i));
        memcpy(file + 8, hdr, (size_t)hl);
        for (int i = 0; i < 9; i++) {
            uint16_t h = type == GL_F16 ? gl_f32_to_f16(want[i % 6]) : gl_f32_to_bf16(want[i % 6]);
            memcpy(file + 8 + hl + 2 * i, &h, 2);
        }
        file_map f = {file, size, 0, NULL};
        cm384_model m;
        memset(&m, 0, sizeof m);
        char *names[1] = {"odd.safetensors"};
        m.path = "odd";
        m.file_names = names;
        int r = st_read_header(&f, "odd.safetensors", 0, &m.a, &m.tensors);
        CHECK(r == CM384_OK, "%s header: %s", dt, cm384_last_error());
        CHECK((uintptr_t)(file + 8 + hl) % 2 == 1, "the data is not misaligned: the test tests nothing");
        gl_mat g;
        float row[3], *vec = NULL;
        r = bind_mat(&m, "w.weight", 2, 3, &g, 1);
        CHECK(r == CM384_OK && (uintptr_t)g.data % 2 == 0, "%s matrix bound at %p", dt, g.data);
        if (!r) {
            gl_row_to_f32(&g, 1, row);
            CHECK(row[0] == want[3] && row[1] == want[4] && row[2] == want[5], "%s row 1: %g %g %g", dt, row[0], row[1], row[2]);
        }
        r = bind_vec(&m, "v.weight", 3, &vec, 1);
        CHECK(r == CM384_OK && vec && vec[0] == want[0] && vec[1] == want[1] && vec[2] == want[2], "%s vector", dt);
        free(m.tensors.items);
        arena_free(&m.a);
        free(buf);
    }
}

/* Config numbers the math turns into floats or logarithms: rms_norm_eps
 * 1e106 became +inf when cast to float (the config harness, 252 K runs: its
 * invariant "eps is a positive number" failed), and rope_theta <= 1, a
 * beta of 0 or a huge mscale gave NaN or infinite RoPE frequencies.  Each is
 * refused with CM384_E_FORMAT naming the field; the fixture still loads. */
static char ff_dir[256];

static int ff_load_with(const char *key, const char *value, cm384_model **m) {
    char src[512], *text = NULL;
    FILE *f = fopen("tests/fixtures/tiny-dsv3/config.json", "rb");
    long n = 0;
    if (f) { fseek(f, 0, SEEK_END); n = ftell(f); fseek(f, 0, SEEK_SET); }
    if (!f || n <= 0 || !(text = malloc((size_t)n + 1)) || fread(text, 1, (size_t)n, f) != (size_t)n) {
        if (f) fclose(f);
        free(text);
        return -100;
    }
    fclose(f);
    text[n] = 0;
    snprintf(src, sizeof src, "%s/config.json", ff_dir);
    FILE *o = fopen(src, "wb");
    char *at = key ? strstr(text, key) : NULL;
    if (!o) { free(text); return -100; }
    if (at) {                                   /* "key": value, -> "key": new, */
        char *colon = strchr(at, ':'), *end = colon ? strpbrk(colon, ",\n}") : NULL;
        fwrite(text, 1, (size_t)(colon + 1 - text), o);
        fprintf(o, " %s", value);
        fputs(end, o);
    } else fputs(text, o);
    fclose(o);
    free(text);
    return cm384_model_load(ff_dir, NULL, m);
}

static void ff_config_numbers(void) {
    printf("config numbers that do not make numbers:\n");
    snprintf(ff_dir, sizeof ff_dir, "/tmp/cm384-test-fuzzfix-XXXXXX");
    if (!mkdtemp(ff_dir)) { CHECK(0, "mkdtemp"); return; }
    const char *links[] = {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors"};
    char cwd[512], from[1024], to[512];
    if (!getcwd(cwd, sizeof cwd)) cwd[0] = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(from, sizeof from, "%s/tests/fixtures/tiny-dsv3/%s", cwd, links[i]);
        snprintf(to, sizeof to, "%s/%s", ff_dir, links[i]);
        if (symlink(from, to)) CHECK(0, "symlink %s", to);
    }
    cm384_model *m = NULL;
    int r = ff_load_with(NULL, NULL, &m);
    CHECK(r == CM384_OK, "the fixture's own config: %s", cm384_last_error());
    cm384_model_free(m);
    static const struct { const char *key, *value, *named; } bad[] = {
        {"\"rms_norm_eps\"", "1e106", "rms_norm_eps"}, {"\"rms_norm_eps\"", "0", "rms_norm_eps"},
        {"\"rms_norm_eps\"", "1e-50", "rms_norm_eps"}, {"\"rms_norm_eps\"", "-1e-6", "rms_norm_eps"},
        {"\"routed_scaling_factor\"", "1e300", "routed_scaling_factor"},
        {"\"routed_scaling_factor\"", "-2.5", "routed_scaling_factor"},
        {"\"rope_theta\"", "1", "rope_theta"}, {"\"rope_theta\"", "0.5", "rope_theta"},
        {"\"beta_fast\"", "0", "RoPE frequencies"}, {"\"beta_slow\"", "-1", "RoPE frequencies"},
        {"\"mscale\"", "1e20", "mscale"}, {"\"factor\"", "1e300", "RoPE frequencies"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        m = NULL;
        r = ff_load_with(bad[i].key, bad[i].value, &m);
        CHECK(r == CM384_E_FORMAT && m == NULL && strstr(cm384_last_error(), bad[i].named),
              "%s %s: status %d, \"%s\"", bad[i].key, bad[i].value, r, cm384_last_error());
        if (r == CM384_E_FORMAT) printf("  %s %s: %s\n", bad[i].key, bad[i].value, cm384_last_error());
        cm384_model_free(m);
    }
    for (int i = 0; i < 3; i++) { snprintf(to, sizeof to, "%s/%s", ff_dir, links[i]); unlink(to); }
    snprintf(to, sizeof to, "%s/config.json", ff_dir);
    unlink(to);
    rmdir(ff_dir);
}

/* A tokenizer.json whose Split regex repeats a repeat (\s**, which Oniguruma
 * accepts) before text that never follows: in a run of spaces every start
 * position spent the 10M backtracks a match attempt may take -- 4 s for the
 * 256 bytes the tokenizer harness fed it (a slow unit it reported), hours
 * for a long prompt.  Two fixes, each checked here:
 *   - a tokenize call has a total (RX_BACKTRACK_LIMIT + RX_BACKTRACKS_PER_BYTE
 *     a byte): with a nested repeat no rule can reduce ((\s*)*, a captured
 *     group) the searches stay inside it and still cover the text, and
 *     DeepSeek-V3's tokenizer with that regex gives a long run of spaces back;
 *   - a repeat stacked on a repeat of one character is reduced to one
 *     repeat, as Oniguruma does (rx_reduce_stacked): \s** then backtracks a
 *     few times a character and splits the text as \s* does. */
static void ff_nested_repeat(void) {
    printf("a pre-tokenizer regex with a nested repeat:\n");
    static const char pat[] = "(\\s*)*\r\n]+|\\s+(?!\\S)|\\s+";
    arena a;
    memset(&a, 0, sizeof a);
    rx_prog prog;
    const char *err = NULL;
    int r = rx_compile(pat, sizeof pat - 1, &a, &prog, &err);
    CHECK(r == CM384_OK, "compile: %s", err ? err : "?");
    enum { N = 2000 };
    uint32_t *cp = malloc(N * sizeof *cp);
    uint8_t *props = malloc(N);
    if (r || !cp || !props) { free(cp); free(props); arena_free(&a); return; }
    for (int i = 0; i < N; i++) { cp[i] = i == N - 1 ? 'x' : ' '; props[i] = unicode_props(cp[i]); }
    tok_enc e;
    memset(&e, 0, sizeof e);
    long long total = RX_BACKTRACK_LIMIT + (long long)RX_BACKTRACKS_PER_BYTE * N;   /* as tokenizer_encode */
    e.vm.total = total;
    segs_regex(&e, &prog, cp, props, N);
    CHECK(e.vm.steps > RX_BACKTRACK_LIMIT, "only %lld backtracks: the pattern is not the hostile one", e.vm.steps);
    CHECK(e.vm.steps <= total, "%lld backtracks, beyond the call's total %lld", e.vm.steps, total);
    int covered = 0, contiguous = 1;
    for (size_t i = 0; i < e.seg_n; i++) {
        contiguous &= e.seg[i].s == covered;
        covered = e.seg[i].e;
    }
    CHECK(e.status == 0 && contiguous && covered == N, "segments cover [0, %d) of %d (status %d)", covered, N, e.status);
    printf("  (\\s*)*: %d spaces and an x: %lld backtracks (total allowed %lld), %zu segments\n", N - 1, e.vm.steps, total,
           e.seg_n);
    free(e.seg); free(e.vm.stack); free(e.vm.slots);

    /* stacked on one character: reduced, and the same segments as \s* */
    static const char *const stacked[] = {"\\s**\r\n]+|\\s+(?!\\S)|\\s+", "(?:\\s+)*\r\n]+|\\s+(?!\\S)|\\s+",
                                          "\\s?*\r\n]+|\\s+(?!\\S)|\\s+"};
    static const char *const stacked_name[] = {"\\s**", "(?:\\s+)*", "\\s?*"};
    static const char plain[] = "\\s*\r\n]+|\\s+(?!\\S)|\\s+";
    tok_enc want;
    memset(&want, 0, sizeof want);
    rx_prog pp;
    r = rx_compile(plain, sizeof plain - 1, &a, &pp, &err);
    want.vm.total = total;
    if (r == CM384_OK) segs_regex(&want, &pp, cp, props, N);
    for (int k = 0; k < 3 && r == CM384_OK; k++) {
        rx_prog sp;
        int rk = rx_compile(stacked[k], strlen(stacked[k]), &a, &sp, &err);
        CHECK(rk == CM384_OK, "compile %s: %s", stacked_name[k], err ? err : "?");
        if (rk) continue;
        tok_enc got;
        memset(&got, 0, sizeof got);
        got.vm.total = total;
        segs_regex(&got, &sp, cp, props, N);
        int same = got.status == 0 && got.seg_n == want.seg_n;
        for (size_t i = 0; same && i < got.seg_n; i++) same = got.seg[i].s == want.seg[i].s && got.seg[i].e == want.seg[i].e;
        CHECK(got.vm.steps <= 4 * want.vm.steps + 16, "%s: %lld backtracks, \\s* takes %lld", stacked_name[k], got.vm.steps,
              want.vm.steps);
        CHECK(same, "%s splits %d spaces and an x other than \\s* does (%zu and %zu segments)", stacked_name[k], N - 1,
              got.seg_n, want.seg_n);
        printf("  %s: %lld backtracks (\\s*: %lld), the same %zu segments\n", stacked_name[k], got.vm.steps, want.vm.steps,
               got.seg_n);
        free(got.seg); free(got.vm.stack); free(got.vm.slots);
    }
    free(want.seg); free(want.vm.stack); free(want.vm.slots);
    free(cp); free(props);
    arena_free(&a);

    /* DeepSeek-V3's tokenizer with its first Split regex made hostile: a
       long run of spaces must come back intact */
    FILE *f = fopen("tests/fixtures/tokenizer/tokenizer.json", "rb");
    CHECK(f != NULL, "tests/fixtures/tokenizer/tokenizer.json");
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    static const char from[] = "\"\\\\p{N}{1,3}\"", to[] = "\"(\\\\s*)*[\\r\\n]+\"";
    char *json = malloc((size_t)size + sizeof to), *text = malloc(N + 1), *back = malloc(N + 1);
    size_t got = json ? fread(json, 1, (size_t)size, f) : 0;
    fclose(f);
    char *at = NULL;
    if (json && got == (size_t)size) { json[size] = 0; at = strstr(json, from); }
    CHECK(at != NULL, "the fixture's first Split regex \\p{N}{1,3} is not where the test expects it");
    char path[64] = "";
    if (at && text && back) {
        memmove(at + sizeof to - 1, at + sizeof from - 1, strlen(at + sizeof from - 1) + 1);
        memcpy(at, to, sizeof to - 1);
        snprintf(path, sizeof path, "/tmp/cm384-test-nested-XXXXXX");
        int fd = mkstemp(path);
        FILE *o = fd >= 0 ? fdopen(fd, "wb") : NULL;
        if (o) { fputs(json, o); fclose(o); }
        char named[sizeof path + 8];
        snprintf(named, sizeof named, "%s.json", path);
        const char *file = rename(path, named) == 0 ? named : path;
        cm384_model *m = NULL;
        r = cm384_model_load(file, NULL, &m);
        CHECK(r == CM384_OK, "the hostile tokenizer: %s", cm384_last_error());
        if (r == CM384_OK) {
            memset(text, ' ', N);
            text[N - 1] = 'x';
            int32_t *ids = malloc(sizeof(int32_t) * N);
            int n = ids ? cm384_tokenize(m, text, N, ids, N, 0) : -1;
            int d = n > 0 ? cm384_detokenize(m, ids, n, back, N + 1) : -1;
            CHECK(n > 0 && d == N && !memcmp(back, text, N), "%d spaces and an x: %d ids, %d bytes back (%s)",
                  N - 1, n, d, cm384_last_error());
            printf("  DeepSeek-V3's tokenizer with (\\s*)*[\\r\\n]+ first: %d spaces and an x -> %d ids -> the text\n", N - 1, n);
            free(ids);
        }
        cm384_model_free(m);
        unlink(file);
    }
    free(json); free(text); free(back);
}

/* A GGUF model with no routed experts whose expert_used_count said 2^26:
 * the loader checked the MoE numbers only when there were routed experts,
 * and engine creation sized scratch by them -- a 1 TB pool for a 79 KB
 * file (the gguf harness, 8.1 M runs: ASan's allocator gave up; a plain
 * build failed with CM384_E_NOMEM).  With no routed experts the loader now
 * zeroes the experts per token, their width and the shared experts. */
static void ff_dense_moe_numbers(void) {
    printf("a dense model's MoE numbers:\n");
    const char *path = "tests/fuzz/corpus/gguf/crash-dense-topk.gguf";
    cm384_model *m = NULL;
    int r = cm384_model_load(path, NULL, &m);
    CHECK(r == CM384_OK, "%s: %s", path, cm384_last_error());
    if (r) return;
    CHECK(m->hp.n_routed == 0 && m->hp.top_k == 0 && m->hp.moe_inter == 0 && m->hp.n_shared == 0,
          "routed %d, per token %d, width %d, shared %d", m->hp.n_routed, m->hp.top_k, m->hp.moe_inter, m->hp.n_shared);
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "single"; c.n_devices = 1; c.n_workers = 1; c.max_ctx = 8; c.max_batch = 1;
    c.kv_pool_bytes = 1 << 20;
    cm384_engine *e = NULL;
    r = cm384_engine_create(m, &c, &e);
    CHECK(r == CM384_OK, "engine: %s", cm384_last_error());
    if (r == CM384_OK) {
        cm384_stats st;
        memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        CHECK(st.pool_bytes < (16u << 20), "pool %llu bytes", (unsigned long long)st.pool_bytes);
        int V = cm384_vocab_size(m);
        int32_t in[3] = {0, V > 1 ? 1 : 0, V - 1};
        float *lg = malloc(sizeof(float) * 3 * (size_t)V);
        r = lg ? cm384_eval(e, in, 3, lg, NULL) : CM384_E_NOMEM;
        CHECK(r == CM384_OK, "a forward pass: %s", cm384_last_error());
        printf("  %s: pool %.1f MB, a 3-token forward pass %s\n", path, st.pool_bytes / 1e6, r ? "failed" : "ran");
        free(lg);
        cm384_engine_free(e);
    }
    cm384_model_free(m);
}

TEST_MAIN(fuzzfix) {
    ff_misaligned_16bit();
    ff_config_numbers();
    ff_nested_repeat();
    ff_dense_moe_numbers();
    return test_summary("fuzzfix");
}

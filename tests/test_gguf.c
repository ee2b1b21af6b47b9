/* test_gguf.c -- GGUF files in and out.
 *
 *   - Files written by llama.cpp's own converter (convert_hf_to_gguf.py) and
 *     quantizer (llama-quantize) from tests/fixtures/tiny-dsv3 and a
 *     k-quant-sized sibling (tests/fixtures/gguf, see its README): BF16
 *     gives the logits of DeepSeek's official code on the safetensors
 *     (reference.json) within 1e-3; the quantized files agree with the
 *     logits llama.cpp computed on the same files (golden.json) within the
 *     quantization's own noise -- the largest difference between the
 *     quantized and the unquantized model's logits (llama.cpp multiplies
 *     k-quant and Q8_0 weights with 8-bit activations, which adds an error of
 *     that order; cm384 computes the stored values exactly) -- and pick the
 *     same top-1 wherever llama.cpp's own top-1 margin exceeds the noise at
 *     that position.
 *   - cm384_model_save_gguf round trips: F32, F16 and BF16 give the
 *     safetensors' logits (and MTP logits) within 1e-3; Q8_0 computes
 *     exactly what its dequantized values do (an F32 file of them).
 *   - The tokenizer in a GGUF: DeepSeek-V3's real tokenizer written as a
 *     vocab-only GGUF tokenizes all of tests/fixtures/tokenizer/cases.jsonl
 *     as Hugging Face does, and keeps the chat template.
 * The peer itself (llama.cpp built from node-llama-cpp) is needed only to
 * regenerate the fixtures: `make check-peer` (tests/peer/check-peer.sh). */
#include "../cm384.c"
#include "test.h"

#define GG_FIX "tests/fixtures/gguf"
#define GG_TINY "tests/fixtures/tiny-dsv3"

static char gg_tmp[256];

static cm384_engine *gg_engine(cm384_model *m) {
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "single"; c.n_workers = 2; c.int8_dispatch = 0;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) CHECK(0, "engine: %s", cm384_last_error());
    return e;
}

/* Logits (and MTP logits when mtp is not NULL) of ids on a model path. */
static float *gg_logits(const char *path, const int32_t *ids, int n, float **mtp) {
    cm384_model *m;
    if (cm384_model_load(path, NULL, &m)) { CHECK(0, "%s: %s", path, cm384_last_error()); return NULL; }
    cm384_engine *e = gg_engine(m);
    int V = m->hp.vocab;
    float *l = malloc(sizeof(float) * (size_t)n * V);
    if (mtp) *mtp = m->hp.n_mtp ? malloc(sizeof(float) * (size_t)(n - 1) * V) : NULL;
    if (!e || cm384_eval(e, ids, n, l, mtp ? *mtp : NULL)) { CHECK(0, "%s: eval: %s", path, cm384_last_error()); free(l); l = NULL; }
    cm384_engine_free(e);
    cm384_model_free(m);
    return l;
}

static double gg_max_diff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

static int gg_argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

/* ---- llama.cpp's files against DeepSeek's official logits ---- */

static void gg_check_official(const char *file) {
    arena a = {0};
    json ref;
    file_map bin;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", GG_FIX, file);
    if (json_load_file(GG_TINY "/reference.json", &a, &ref) || file_map_open(&bin, GG_TINY "/reference.bin", 1)) {
        CHECK(0, "cannot read the tiny-dsv3 reference");
        arena_free(&a);
        return;
    }
    cm384_model *m;
    if (cm384_model_load(path, NULL, &m)) { CHECK(0, "%s: %s", path, cm384_last_error()); arena_free(&a); return; }
    cm384_engine *e = gg_engine(m);
    const json *seqs = json_get(&ref, "sequences");
    int V = m->hp.vocab, top_bad = 0, n_pos = 0;
    double worst = 0;
    for (int i = 0; e && i < seqs->len; i++) {
        const json *sq = &seqs->kids[i], *tk = json_get(sq, "tokens");
        int n = tk->len;
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
        for (int t = 0; t < n; t++) ids[t] = (int32_t)tk->kids[t].num;
        float *lg = malloc(sizeof(float) * (size_t)n * V);
        cm384_eval(e, ids, n, lg, NULL);
        const float *want = (const float *)(bin.data + (size_t)json_num(json_get(sq, "logits"), "offset", 0));
        const json *margin = json_get(sq, "top1_margin"), *top1 = json_get(sq, "top1");
        worst = fmax(worst, gg_max_diff(lg, want, (size_t)n * V));
        for (int t = 0; t < n; t++, n_pos++)
            if (margin->kids[t].num > 1e-3 && gg_argmax(lg + (size_t)t * V, V) != (int)top1->kids[t].num) top_bad++;
        free(ids); free(lg);
    }
    printf("  %-28s vs DeepSeek's official code: max |diff| %.2e over %d positions, top-1 differs at %d\n",
           file, worst, n_pos, top_bad);
    CHECK(worst < 1e-3 && top_bad == 0, "%s: max diff %g, %d top-1 differ", file, worst, top_bad);
    cm384_engine_free(e);
    cm384_model_free(m);
    file_map_close(&bin);
    arena_free(&a);
}

/* ---- quantized files against llama.cpp's logits on the same file ---- */

static void gg_check_golden(void) {
    arena a = {0};
    json g;
    file_map bin;
    if (json_load_file(GG_FIX "/golden.json", &a, &g) || file_map_open(&bin, GG_FIX "/golden.bin", 1)) {
        CHECK(0, "cannot read " GG_FIX "/golden.json / golden.bin");
        arena_free(&a);
        return;
    }
    const json *files = json_get(&g, "files");
    for (int fi = 0; files && fi < files->len; fi++) {
        const json *f = &files->kids[fi];
        const char *file = json_str(f, "file", ""), *base = json_str(f, "unquantized", NULL);
        const json *tk = json_get(f, "ids");
        int n = tk->len, V = (int)json_num(f, "vocab", 0);
        int32_t ids[256];
        for (int t = 0; t < n && t < 256; t++) ids[t] = (int32_t)tk->kids[t].num;
        char path[512], bpath[512];
        snprintf(path, sizeof path, "%s/%s", GG_FIX, file);
        const float *llama = (const float *)(bin.data + (size_t)json_num(f, "offset", 0));
        float *lg = gg_logits(path, ids, n, NULL);
        if (!lg) continue;
        if (!base) {   /* an unquantized file: the same numbers as llama.cpp, up to fp32 order */
            double d = gg_max_diff(lg, llama, (size_t)n * V);
            printf("  %-28s vs llama.cpp: max |diff| %.2e\n", file, d);
            CHECK(d < 1e-3, "%s: %g from llama.cpp's logits", file, d);
            free(lg);
            continue;
        }
        snprintf(bpath, sizeof bpath, "%s", base);   /* a model directory, from the repository root */
        float *ref = gg_logits(bpath, ids, n, NULL);
        if (!ref) { free(lg); continue; }
        /* per position: cm384 vs llama.cpp on this file, against the noise
           this quantization adds (cm384 on the file vs the unquantized one) */
        double worst = 0, worst_noise = 0, worst_ratio = 0;
        int agree = 0, decided = 0, decided_agree = 0;
        for (int t = 0; t < n; t++) {
            const float *x = lg + (size_t)t * V, *y = llama + (size_t)t * V, *u = ref + (size_t)t * V;
            double d = gg_max_diff(x, y, (size_t)V), noise = gg_max_diff(x, u, (size_t)V);
            worst = fmax(worst, d);
            worst_noise = fmax(worst_noise, noise);
            worst_ratio = fmax(worst_ratio, d / (noise + 1e-6));
            int tx = gg_argmax(x, V), ty = gg_argmax(y, V);
            agree += tx == ty;
            /* llama.cpp's margin between its top two */
            float m1 = y[ty], m2 = -INFINITY;
            for (int v = 0; v < V; v++) if (v != ty && y[v] > m2) m2 = y[v];
            if (m1 - m2 > noise) { decided++; decided_agree += tx == ty; }
        }
        printf("  %-28s vs llama.cpp: max |diff| %.3g, the quantization's own %.3g (worst position ratio %.2f); "
               "top-1 %d/%d, %d/%d where llama.cpp's margin exceeds the noise\n",
               file, worst, worst_noise, worst_ratio, agree, n, decided_agree, decided);
        CHECK(worst <= worst_noise, "%s: differs from llama.cpp by %g, more than the quantization's own noise %g",
              file, worst, worst_noise);
        CHECK(decided_agree == decided, "%s: top-1 differs from llama.cpp at %d of %d decided positions", file,
              decided - decided_agree, decided);
        free(lg); free(ref);
    }
    file_map_close(&bin);
    arena_free(&a);
}

/* ---- cm384's own export, read back ---- */

static void gg_round_trips(const char *dir) {
    int32_t ids[48];
    for (int i = 0; i < 48; i++) ids[i] = (int32_t)((i * 97 + 5) % 1000);
    float *mtp_ref = NULL, *ref = gg_logits(dir, ids, 48, &mtp_ref);
    if (!ref) return;
    cm384_model *m;
    if (cm384_model_load(dir, NULL, &m)) { CHECK(0, "%s", cm384_last_error()); free(ref); free(mtp_ref); return; }
    int V = m->hp.vocab;
    static const char *types[] = {"f32", "bf16", "f16", "q8_0"};
    char path[4][400];
    for (int ti = 0; ti < 4; ti++) {
        snprintf(path[ti], sizeof path[ti], "%s/rt-%s.gguf", gg_tmp, types[ti]);
        int r = cm384_model_save_gguf(m, path[ti], types[ti]);
        CHECK(r == CM384_OK, "save %s: %s", types[ti], cm384_last_error());
    }
    cm384_model_free(m);
    for (int ti = 0; ti < 3; ti++) {
        float *mtp = NULL, *l = gg_logits(path[ti], ids, 48, &mtp);
        if (!l) continue;
        double d = gg_max_diff(l, ref, (size_t)48 * V), dm = mtp && mtp_ref ? gg_max_diff(mtp, mtp_ref, (size_t)47 * V) : -1;
        printf("  %s -> %-5s GGUF: logits max |diff| %.2e, MTP logits %.2e\n", dir, types[ti], d, dm);
        CHECK(d < 1e-3, "%s %s round trip: %g", dir, types[ti], d);
        CHECK(mtp_ref && mtp && dm < 1e-3, "%s %s round trip: MTP logits %g", dir, types[ti], dm);
        free(l); free(mtp);
    }
    /* Q8_0: its dequantized values written as F32 must compute the same */
    char deq[420];
    snprintf(deq, sizeof deq, "%s/rt-q8_0-dequantized.gguf", gg_tmp);
    if (!cm384_model_load(path[3], NULL, &m)) {
        CHECK(cm384_model_save_gguf(m, deq, "f32") == CM384_OK, "save dequantized: %s", cm384_last_error());
        cm384_model_free(m);
        float *lq = gg_logits(path[3], ids, 48, NULL), *lf = gg_logits(deq, ids, 48, NULL);
        if (lq && lf) {
            double d = gg_max_diff(lq, lf, (size_t)48 * V), noise = gg_max_diff(lq, ref, (size_t)48 * V);
            printf("  %s -> q8_0 GGUF: %.2e from its dequantized F32 copy (the rounding of fp32 sums); "
                   "%.3g from the original weights\n", dir, d, noise);
            CHECK(d < 1e-4, "q8_0 vs its dequantized values: %g", d);
        }
        free(lq); free(lf);
    }
    free(ref); free(mtp_ref);
}

/* A model without q_lora (V2-Lite's attention) says so in the file:
 * q_lora_rank 0, which llama.cpp needs to take such a model at any depth
 * other than V2-Lite's own 26 or 27 layers. */
static void gg_lite_export(const char *dir) {
    int32_t ids[24];
    for (int i = 0; i < 24; i++) ids[i] = (int32_t)((i * 131 + 7) % 1000);
    cm384_model *m;
    if (cm384_model_load(dir, NULL, &m)) { CHECK(0, "%s", cm384_last_error()); return; }
    CHECK(m->hp.q_lora == 0, "%s has q_lora %d", dir, m->hp.q_lora);
    int V = m->hp.vocab;
    char path[400];
    snprintf(path, sizeof path, "%s/lite-bf16.gguf", gg_tmp);
    CHECK(cm384_model_save_gguf(m, path, "bf16") == CM384_OK, "save: %s", cm384_last_error());
    cm384_model_free(m);
    file_map f;
    arena a = {0};
    gguf_meta g;
    tensor_table tt = {0};
    if (file_map_open(&f, path, 0)) { CHECK(0, "open %s", path); return; }
    if (gguf_read(&f, path, 0, &a, &g, &tt) == CM384_OK) {
        const gguf_kv *kv = gguf_find(&g, "deepseek2.attention.q_lora_rank");
        CHECK(kv && kv->num == 0, "q_lora_rank %s", kv ? "is not 0" : "is missing");
        printf("  %s -> bf16 GGUF: attention.q_lora_rank %s\n", dir, kv ? "0, written" : "missing");
    } else CHECK(0, "read back: %s", cm384_last_error());
    free(tt.items);
    arena_free(&a);
    file_map_close(&f);
    float *ref = gg_logits(dir, ids, 24, NULL), *l = gg_logits(path, ids, 24, NULL);
    if (ref && l) {
        double d = gg_max_diff(l, ref, (size_t)24 * V);
        CHECK(d < 1e-3, "%s bf16 round trip: %g", dir, d);
    }
    free(ref); free(l);
}

/* ---- the tokenizer in a GGUF ---- */

static void gg_tokenizer(void) {
    cm384_model *tj, *tg;
    char path[400];
    /* CM384_GGUF_VOCAB: a vocab-only GGUF of the same tokenizer written by
       another tool (check-peer: llama.cpp's converter) instead of ours */
    const char *other = getenv("CM384_GGUF_VOCAB");
    if (other) snprintf(path, sizeof path, "%s", other);
    else snprintf(path, sizeof path, "%s/deepseek-v3-vocab.gguf", gg_tmp);
    if (cm384_model_load("tests/fixtures/tokenizer/tokenizer.json", NULL, &tj)) { CHECK(0, "%s", cm384_last_error()); return; }
    CHECK(tj->tok->pre_name && !strcmp(tj->tok->pre_name, "deepseek-v3"), "DeepSeek-V3's pre-tokenizer not recognised");
    int r = other ? CM384_OK : cm384_model_save_gguf(tj, path, NULL);
    CHECK(r == CM384_OK, "vocab-only save: %s", cm384_last_error());
    r = cm384_model_load(path, NULL, &tg);
    CHECK(r == CM384_OK, "vocab-only load: %s", cm384_last_error());
    if (r) { cm384_model_free(tj); return; }
    CHECK(tg->tokenizer_only && cm384_vocab_size(tg) == cm384_vocab_size(tj), "vocab %d vs %d",
          cm384_vocab_size(tg), cm384_vocab_size(tj));
    CHECK(cm384_token_bos(tg) == cm384_token_bos(tj) && cm384_token_eos(tg) == cm384_token_eos(tj), "BOS/EOS");
    CHECK(tg->tok->chat_template && tj->tok->chat_template && !strcmp(tg->tok->chat_template, tj->tok->chat_template),
          "the chat template did not survive");
    /* every case of the real tokenizer: ids as HF gives them, and back */
    file_map f;
    int bad = 0, cases = 0;
    if (file_map_open(&f, "tests/fixtures/tokenizer/cases.jsonl", 0)) { CHECK(0, "cases.jsonl"); f.size = 0; }
    int32_t *ids = malloc(sizeof(int32_t) * 65536);
    char *text = malloc(1 << 20);
    for (size_t pos = 0; pos < f.size;) {
        const char *line = (const char *)f.data + pos;
        const char *nl = memchr(line, '\n', f.size - pos);
        size_t len = nl ? (size_t)(nl - line) : f.size - pos;
        pos += len + 1;
        arena a = {0};
        json c;
        if (json_parse(line, len, &a, &c, "cases.jsonl")) { bad++; arena_free(&a); continue; }
        const json *t = json_get(&c, "text"), *want = json_get(&c, "ids");
        const json *add = json_get(&c, "add_special_tokens");
        int n = cm384_tokenize(tg, t->str, (size_t)t->len, ids, 65536, add && add->type == JSON_TRUE ? CM384_TOK_ADD_BOS : 0);
        int ok = n == want->len;
        for (int i = 0; ok && i < n; i++) ok = ids[i] == (int32_t)want->kids[i].num;
        if (ok) {
            int k = cm384_detokenize(tg, ids, n, text, 1 << 20);
            const json *dec = json_get(&c, "decoded");
            ok = dec && k == dec->len && !memcmp(text, dec->str, (size_t)k);
        }
        if (!ok && bad < 3) printf("  GGUF tokenizer differs on \"%.60s\"\n", t->str);
        bad += !ok;
        cases++;
        arena_free(&a);
    }
    printf("  DeepSeek-V3's tokenizer as a vocab-only GGUF (%s): %d of %d cases as Hugging Face\n",
           other ? other : "cm384's export", cases - bad, cases);
    CHECK(cases > 1000 && bad == 0, "%d of %d tokenizer cases differ through GGUF", bad, cases);
    free(ids); free(text);
    file_map_close(&f);
    cm384_model_free(tj);
    cm384_model_free(tg);
}

TEST_MAIN(gguf) {
    snprintf(gg_tmp, sizeof gg_tmp, "/tmp/cm384-test-gguf-XXXXXX");
    if (!mkdtemp(gg_tmp)) { perror("mkdtemp"); return 1; }
    printf("llama.cpp's converter output (%s):\n", GG_FIX);
    gg_check_official("tiny-dsv3-bf16.gguf");
    printf("quantized files against llama.cpp on the same file:\n");
    gg_check_golden();
    printf("export round trips:\n");
    gg_round_trips(GG_TINY);
    if (!getenv("CM384_QUICK")) gg_round_trips("models/shakespeare");
    gg_lite_export("tests/fixtures/tiny-dsv2-lite");
    printf("tokenizer:\n");
    gg_tokenizer();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", gg_tmp);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", gg_tmp);
    return test_summary("gguf");
}

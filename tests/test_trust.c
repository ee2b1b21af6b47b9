/* test_trust.c -- no hole a careless caller can fall into, and nothing lost
 * without a word:
 *   - the defaults are exact (no approximation unless asked; the paper preset
 *     turns its approximations on, and the report says which are on);
 *   - every config and sampling field is checked against its documented
 *     range, and the message names the field;
 *   - token ids outside the embedding are refused on every path, also ids a
 *     tokenizer produces from text;
 *   - events carry all their text (cm384_generate too), report lines are
 *     never cut, the trace keeps every event past its buffer, reset_stats
 *     resets everything it reports, a wait that times out says so, a
 *     successful cancel leaves no error behind;
 *   - a broken engine invariant fails the step's requests with
 *     CM384_EV_ERROR / CM384_E_INTERNAL instead of aborting, and the engine
 *     goes on serving. */
#include "../cm384.c"
#include "test.h"

#define TR_FIX "tests/fixtures/tiny-dsv3"

static int tr_contains(const char *s, const char *what) { return s && strstr(s, what) != NULL; }

/* ---- defaults ---- */
static void tr_defaults(cm384_model *m) {
    printf("exact defaults:\n");
    cm384_config c;
    cm384_config_init(&c);
    CHECK(c.int8 == 0 && c.int8_dispatch == -1 && c.mtp == 0, "config_init turns an approximation on");
    cm384_engine *e;
    int r = cm384_engine_create(m, NULL, &e);
    CHECK(r == CM384_OK, "NULL config: %s", cm384_last_error());
    if (r) return;
    CHECK(!e->cfg.int8 && !e->cfg.int8_dispatch, "a NULL config resolves to an approximation (int8 %d, dispatch %d)",
          e->cfg.int8, e->cfg.int8_dispatch);
    char rep[8192];
    cm384_report(e, rep, sizeof rep);
    CHECK(tr_contains(rep, "numerics: exact"), "the report does not say the numerics are exact");
    cm384_engine_free(e);

    c.preset = "paper";
    c.n_workers = 2;
    r = cm384_engine_create(m, &c, &e);
    CHECK(r == CM384_OK, "paper preset: %s", cm384_last_error());
    if (r) return;
    CHECK(e->cfg.int8_dispatch == 1, "the paper preset does not dispatch in INT8");
    cm384_report(e, rep, sizeof rep);
    CHECK(tr_contains(rep, "approximations on: INT8 dispatch"), "the report does not name INT8 dispatch");
    cm384_engine_free(e);
    c.int8_dispatch = 0;                       /* the switch wins over the preset */
    r = cm384_engine_create(m, &c, &e);
    CHECK(r == CM384_OK && !e->cfg.int8_dispatch, "int8_dispatch = 0 is not honoured by the paper preset");
    if (!r) cm384_engine_free(e);
}

/* ---- config fields ---- */
static void tr_config(cm384_model *m) {
    printf("config fields:\n");
    /* each case: a field set out of range, and the name the message must carry */
    cm384_config c;
    int n_cases = 0, n_ok = 0;
#define TRY(field, value)                                                                         \
    do {                                                                                          \
        cm384_config_init(&c);                                                                    \
        c.n_workers = 2;                                                                          \
        c.field = value;                                                                          \
        cm384_engine *e_ = NULL;                                                                  \
        int r_ = cm384_engine_create(m, &c, &e_);                                                 \
        int ok_ = r_ == CM384_E_INVALID && !e_ && tr_contains(cm384_last_error(), #field);        \
        CHECK(ok_, "config." #field " = " #value ": status %d, message \"%s\"", r_, cm384_last_error()); \
        if (e_) cm384_engine_free(e_);                                                            \
        n_cases++; n_ok += ok_;                                                                   \
    } while (0)
    TRY(n_devices, -1);
    TRY(n_devices, 5000);
    TRY(n_workers, -2);
    TRY(n_workers, 2000);
    TRY(max_ctx, -1);
    TRY(max_ctx, 1);
    TRY(max_ctx, 1 << 20);                     /* beyond the model's positions */
    TRY(max_batch, -1);
    TRY(max_batch, 100000);
    TRY(kv_block_tokens, -16);
    TRY(prefill_chunk, -1);
    TRY(int8, 2);
    TRY(int8, -1);
    TRY(int8_dispatch, 2);
    TRY(int8_dispatch, -2);
    TRY(microbatches, 3);
    TRY(microbatches, -1);
    TRY(mtp, 7);
    TRY(tpot_target_ms, -1.0);
    TRY(tpot_target_ms, NAN);
    TRY(tpot_target_ms, INFINITY);
    TRY(prefill_share, -0.5);
    TRY(prefill_share, 0.95);
    TRY(prefill_share, NAN);
    TRY(preset, "fastest");
#undef TRY
    printf("  %d of %d out-of-range fields refused, each named in the message\n", n_ok, n_cases);
    /* and the zeros are defaults, not errors */
    cm384_config_init(&c);
    c.n_devices = 0; c.n_workers = 0; c.max_ctx = 0; c.max_batch = 0; c.kv_block_tokens = 0;
    c.prefill_chunk = 0; c.microbatches = 0; c.int8_dispatch = 0; c.tpot_target_ms = 0; c.prefill_share = 0; c.preset = NULL;
    cm384_engine *e;
    int r = cm384_engine_create(m, &c, &e);
    CHECK(r == CM384_OK, "every field 0: %s", cm384_last_error());
    if (!r) {
        CHECK(e->n_dev == 384 && e->max_ctx == 256 && e->cfg.max_batch == 64 && e->kv.block_tokens == 16 &&
              e->cfg.prefill_chunk == 512 && e->cfg.microbatches == 1 && e->prefill_lend == 0,
              "zeros did not become the documented defaults");
        cm384_engine_free(e);
    }
}

typedef struct tr_text { char *buf; size_t n, cap; int32_t ids[64]; int n_ids, finals, final_kind; } tr_text;

static int tr_collect(void *user, const cm384_event *ev) {
    tr_text *t = user;
    if (t->n + ev->text_len + 1 > t->cap) {
        t->cap = 2 * (t->n + ev->text_len + 1);
        t->buf = realloc(t->buf, t->cap);
    }
    memcpy(t->buf + t->n, ev->text, ev->text_len);
    t->n += ev->text_len;
    t->buf[t->n] = 0;
    if (ev->kind == CM384_EV_TOKEN && t->n_ids < 64) t->ids[t->n_ids++] = ev->token;
    if (ev->kind != CM384_EV_TOKEN) { t->finals++; t->final_kind = ev->kind; }
    return 0;
}

/* ---- sampling fields ---- */
static void tr_sampling(cm384_engine *e) {
    printf("sampling fields:\n");
    int32_t ids[4] = {0, 5, 9, 13};
    cm384_request rq;
    cm384_sampling s;
    int n_cases = 0, n_ok = 0;
#define TRY(field, value)                                                                         \
    do {                                                                                          \
        cm384_sampling_init(&s);                                                                  \
        s.field = value;                                                                          \
        cm384_request_init(&rq);                                                                  \
        rq.ids = ids; rq.n_ids = 4; rq.sampling = &s;                                             \
        uint64_t id_ = 99;                                                                        \
        int r_ = cm384_submit(e, &rq, &id_);                                                      \
        int ok_ = r_ == CM384_E_INVALID && id_ == 0 && tr_contains(cm384_last_error(), "sampling." #field); \
        CHECK(ok_, "sampling." #field " = " #value ": status %d, message \"%s\"", r_, cm384_last_error()); \
        n_cases++; n_ok += ok_;                                                                   \
    } while (0)
    TRY(min_p, 1.5f);
    TRY(min_p, -0.1f);
    TRY(min_p, NAN);
    TRY(top_p, 1.01f);
    TRY(top_p, -1.0f);
    TRY(temperature, -0.5f);
    TRY(temperature, INFINITY);
    TRY(temperature, NAN);
    TRY(top_k, -3);
    TRY(max_tokens, 0);
    TRY(max_tokens, -5);
#undef TRY
    printf("  %d of %d out-of-range sampling fields refused, each named in the message\n", n_ok, n_cases);

    /* the edges of the ranges run and stay well defined: min_p = 1 keeps
       only the best token, and a temperature whose inverse overflows is
       greedy -- both give the greedy tokens */
    float temps[3] = {0.0f, 1e-45f, 0.9f}, min_ps[3] = {0.0f, 0.0f, 1.0f};
    tr_text got[3];
    memset(got, 0, sizeof got);
    for (int k = 0; k < 3; k++) {
        cm384_sampling_init(&s);
        s.temperature = temps[k]; s.min_p = min_ps[k]; s.max_tokens = 8; s.ignore_eos = 1; s.seed = 7;
        int r = cm384_generate(e, NULL, ids, 4, &s, tr_collect, &got[k]);
        CHECK(r == CM384_OK && got[k].n_ids == 8, "temperature %g, min_p %g: status %d, %d tokens", temps[k], min_ps[k],
              r, got[k].n_ids);
    }
    for (int k = 1; k < 3; k++)
        CHECK(got[k].n_ids == got[0].n_ids && !memcmp(got[k].ids, got[0].ids, sizeof(int32_t) * (size_t)got[0].n_ids),
              "temperature %g, min_p %g is not greedy", temps[k], min_ps[k]);
    printf("  min_p = 1 and temperature 1e-45 give the greedy tokens: %s\n",
           !memcmp(got[1].ids, got[0].ids, sizeof got[0].ids) && !memcmp(got[2].ids, got[0].ids, sizeof got[0].ids) ? "yes" : "no");
    for (int k = 0; k < 3; k++) free(got[k].buf);
}

/* ---- token ids past the embedding ---- */
static int tr_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    return fclose(f) == 0 && w == n ? 0 : -1;
}

static char *tr_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)sz + 1);
    if (p && fread(p, 1, (size_t)sz, f) != (size_t)sz) { free(p); p = NULL; }
    fclose(f);
    if (p) { p[sz] = 0; *n = (size_t)sz; }
    return p;
}

/* A copy of the fixture in dir whose tokenizer.json has more added tokens
 * (appended to "added_tokens", so each gets the next id: HF numbers added
 * tokens itself, after the vocab and the added tokens before them). */
static int tr_model_with_added_tokens(const char *dir, const char *tokens_json) {
    char p[1024], q[1024], cwd[512];
    mkdir(dir, 0755);
    if (!getcwd(cwd, sizeof cwd)) return -1;
    const char *same[] = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                          "model.safetensors.index.json", "tokenizer_config.json"};
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, same[i]);
        snprintf(q, sizeof q, "%s/" TR_FIX "/%s", cwd, same[i]);
        unlink(p);
        if (symlink(q, p)) return -1;
    }
    size_t n;
    char *t = tr_read_file(TR_FIX "/tokenizer.json", &n);
    if (!t) return -1;
    char *at = strstr(t, "\"added_tokens\"");
    char *br = at ? strchr(at, ']') : NULL;          /* the end of the array */
    if (!br) { free(t); return -1; }
    size_t head = (size_t)(br - t), add = strlen(tokens_json);
    char *out = malloc(n + add + 2);
    memcpy(out, t, head);
    out[head] = ',';
    memcpy(out + head + 1, tokens_json, add);
    memcpy(out + head + 1 + add, t + head, n - head);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    int r = tr_write_file(p, out, n + add + 1);
    free(out);
    free(t);
    return r;
}

#define TR_ADDED(content) "{\"id\":0,\"content\":\"" content "\",\"single_word\":false,\"lstrip\":false," \
                          "\"rstrip\":false,\"normalized\":false,\"special\":false}"

static void tr_ids(cm384_model *m) {
    printf("token ids outside the embedding:\n");
    const char *dir = "build/trust-beyond-vocab";
    /* enough added tokens that the last ones get ids past the 1024 embedding rows */
    int r = tr_model_with_added_tokens(dir, TR_ADDED("<|b0|>") "," TR_ADDED("<|b1|>") "," TR_ADDED("<|b2|>") ","
                                            TR_ADDED("<|b3|>") "," TR_ADDED("<|b4|>") "," TR_ADDED("<|beyond|>"));
    CHECK(r == 0, "cannot write the test model in %s", dir);
    cm384_model *mb;
    r = cm384_model_load(dir, NULL, &mb);
    CHECK(r == CM384_OK, "load %s: %s", dir, cm384_last_error());
    if (r) return;
    int32_t toks[16];
    int n = cm384_tokenize(mb, "hi <|beyond|>", 13, toks, 16, 0);
    int beyond = n > 0 ? toks[n - 1] : -1;
    char beyond_s[16];
    snprintf(beyond_s, sizeof beyond_s, "%d", beyond);
    CHECK(beyond >= 1024 && cm384_vocab_size(mb) == 1024, "the added token's id %d is not past the 1024 rows", beyond);
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2;
    cm384_engine *e;
    if (cm384_engine_create(mb, &c, &e) == CM384_OK) {
        cm384_request rq;
        cm384_request_init(&rq);
        rq.text = "hi <|beyond|>";
        uint64_t id = 5;
        r = cm384_submit(e, &rq, &id);
        printf("  text prompt with id %d (embedding has 1024 rows): %s\n", beyond, cm384_last_error());
        CHECK(r == CM384_E_INVALID && id == 0 && tr_contains(cm384_last_error(), beyond_s),
              "a text prompt producing id %d was not refused: status %d (%s)", beyond, r, cm384_last_error());
        rq.text = "hi there";
        r = cm384_submit(e, &rq, &id);
        CHECK(r == CM384_OK && cm384_wait(e, id, -1) == CM384_OK, "an ordinary prompt failed on the same engine");
        int32_t bad[3] = {0, beyond, 5};
        float *lg = malloc(sizeof(float) * 3 * 1024);
        r = cm384_eval(e, bad, 3, lg, NULL);
        CHECK(r == CM384_E_INVALID && tr_contains(cm384_last_error(), beyond_s), "cm384_eval took id %d: %d", beyond, r);
        bad[1] = -4;
        r = cm384_eval(e, bad, 3, lg, NULL);
        CHECK(r == CM384_E_INVALID, "cm384_eval took id -4: %d", r);
        free(lg);
        rq.text = NULL; rq.ids = bad; rq.n_ids = 3;
        bad[1] = 1024;
        r = cm384_submit(e, &rq, &id);
        CHECK(r == CM384_E_INVALID && tr_contains(cm384_last_error(), "1024"), "submitted ids took 1024: %d", r);
        cm384_engine_free(e);
    }
    cm384_model_free(mb);
    (void)m;
}

/* ---- nothing lost ---- */
/* Events carry all their text: through cm384_generate a run delivers exactly
 * the detokenized text of its tokens; and cm384_generate's queue holds the
 * longest text an event of the model can carry (a tokenizer with a 1500-byte
 * token: one event of 1500 bytes goes through whole). */
static void tr_long_text(cm384_model *m) {
    printf("events keep all their text:\n");
    int32_t ids[6] = {0, 17, 300, 41, 250, 9};
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 40; s.ignore_eos = 1; s.temperature = 1.0f; s.seed = 3;
    tr_text t = {0};
    int r = cm384_generate(e, NULL, ids, 6, &s, tr_collect, &t);
    char want[4096];
    int wn = cm384_detokenize(m, t.ids, t.n_ids, want, sizeof want);
    printf("  40 sampled tokens: events carried %zu bytes, their ids detokenize to %d\n", t.n, wn);
    CHECK(r == CM384_OK && t.n_ids == 40 && t.finals == 1 && wn >= 0 && (size_t)wn == t.n && !memcmp(want, t.buf, t.n),
          "the events' text is not the tokens' text (status %d)", r);
    free(t.buf);
    cm384_engine_free(e);

    char tok[2200], longtext[1501];
    memset(longtext, 'Z', 1500);
    longtext[1500] = 0;
    snprintf(tok, sizeof tok, TR_ADDED("%s"), longtext);
    const char *dir = "build/trust-long-token";
    CHECK(tr_model_with_added_tokens(dir, tok) == 0, "cannot write %s", dir);
    cm384_model *ml;
    r = cm384_model_load(dir, NULL, &ml);
    CHECK(r == CM384_OK, "load %s: %s", dir, cm384_last_error());
    if (r) return;
    gen_queue q;
    memset(&q, 0, sizeof q);
    q.text_cap = request_text_cap(ml) + 1;
    char *texts = malloc(GEN_RING * q.text_cap);
    for (int i = 0; i < GEN_RING; i++) q.ring[i].text = texts + (size_t)i * q.text_cap;
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    cm384_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = CM384_EV_TOKEN;
    ev.text = longtext;
    ev.text_len = 1500;
    gen_push(&q, &ev);
    printf("  a 1500-byte event through cm384_generate's queue: %zu bytes out\n", q.ring[0].ev.text_len);
    CHECK(q.count == 1 && q.ring[0].ev.text_len == 1500 && !memcmp(q.ring[0].text, longtext, 1500),
          "the queue cut a 1500-byte event to %zu bytes", q.ring[0].ev.text_len);
    pthread_mutex_destroy(&q.mu);
    pthread_cond_destroy(&q.cv);
    free(texts);
    cm384_model_free(ml);
}

static void tr_report_line(void) {
    printf("report lines:\n");
    strbuf b = {0};
    char big[3000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    sb_printf(&b, "[%s]", big);
    CHECK(b.n == sizeof big + 1 && b.p[b.n - 1] == ']', "sb_printf cut a %zu-byte line to %zu", sizeof big + 1, b.n);
    free(b.p);
}

static int tr_count(const char *s, const char *what) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)); p++) n++;
    return n;
}

static void tr_trace_and_stats(cm384_model *m) {
    printf("trace, stats, wait, cancel:\n");
    const char *path = "build/trust-trace.json";
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2;
    c.trace_path = path;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    e->cap_tev = 8;                          /* a tiny buffer: the trace must stream, not drop */
    int32_t ids[5] = {0, 3, 5, 7, 11};
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 12; s.ignore_eos = 1;
    int r = cm384_generate(e, NULL, ids, 5, &s, NULL, NULL);
    CHECK(r == CM384_OK, "traced run: %s", cm384_last_error());

    /* reset_stats resets expert load too */
    uint64_t load[16];
    int ne = cm384_get_expert_load(e, -1, load, 16);
    uint64_t before = 0, after = 0;
    for (int i = 0; i < ne; i++) before += load[i];
    cm384_reset_stats(e);
    cm384_get_expert_load(e, -1, load, 16);
    for (int i = 0; i < ne; i++) after += load[i];
    CHECK(before > 0 && after == 0, "reset_stats left expert load: %llu tokens before, %llu after",
          (unsigned long long)before, (unsigned long long)after);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    CHECK(st.expert_load_max_over_mean == 0 && st.tokens_decoded == 0, "reset_stats left counters");

    /* a wait that times out says so; a successful cancel leaves the last error alone */
    cm384_request rq;
    cm384_request_init(&rq);
    rq.ids = ids; rq.n_ids = 5;
    cm384_sampling_init(&s);
    s.max_tokens = 200; s.ignore_eos = 1;
    rq.sampling = &s;
    uint64_t id;
    r = cm384_submit(e, &rq, &id);
    CHECK(r == CM384_OK, "submit: %s", cm384_last_error());
    int w = cm384_wait(e, id, 0);
    CHECK(w == CM384_E_TIMEOUT && tr_contains(cm384_last_error(), "still running"),
          "a timed-out wait returned %d (%s)", w, cm384_last_error());
    CHECK(!strcmp(cm384_strerror(CM384_E_TIMEOUT), "CM384_E_TIMEOUT: timed out"), "strerror(CM384_E_TIMEOUT)");
    cm384_wait(e, 987654, 0);                 /* leaves "no request 987654" */
    char before_msg[1100];
    snprintf(before_msg, sizeof before_msg, "%s", cm384_last_error());
    CHECK(cm384_cancel(e, id) == CM384_OK, "cancel a running request");
    CHECK(!strcmp(cm384_last_error(), before_msg), "a successful cancel changed the last error to \"%s\"",
          cm384_last_error());
    CHECK(cm384_wait(e, id, -1) == CM384_E_CANCELLED, "the cancelled request did not end cancelled");
    char rep[8192];
    cm384_report(e, rep, sizeof rep);
    CHECK(tr_contains(rep, "trace: ") && tr_contains(rep, " 0 lost"), "the report does not account for the trace");
    uint64_t written = e->trace_written + (uint64_t)e->n_tev;
    cm384_engine_free(e);

    size_t n;
    char *t = tr_read_file(path, &n);
    CHECK(t != NULL, "no trace file");
    if (!t) return;
    arena a = {0};
    json root;
    int pr = json_parse(t, n, &a, &root, path);
    int events = tr_count(t, "\"ph\":\"X\"");
    printf("  trace with an 8-event buffer: %d events in the file, %llu counted, parses: %s\n", events,
           (unsigned long long)written, pr == CM384_OK ? "yes" : "no");
    CHECK(pr == CM384_OK, "the streamed trace is not JSON: %s", cm384_last_error());
    CHECK(events > 100 && (uint64_t)events == written, "the trace kept %d of %llu events", events, (unsigned long long)written);
    arena_free(&a);
    free(t);
}

/* ---- a broken invariant: CM384_EV_ERROR, and the engine goes on ---- */
static void tr_internal(cm384_model *m) {
    printf("internal errors:\n");
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    int32_t ids[6] = {0, 17, 300, 41, 250, 9};
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 6; s.ignore_eos = 1;
    tr_text good = {0};
    int r = cm384_generate(e, NULL, ids, 6, &s, tr_collect, &good);
    CHECK(r == CM384_OK, "reference run: %d", r);

    peers_pause(e);
    int cap[N_LANES];
    for (int L = 0; L < N_LANES; L++) {
        cap[L] = e->peers[L].rg.cap;
        e->peers[L].rg.cap = 1;              /* as if the regions had been sized too small */
    }
    peers_resume(e);
    tr_text bad = {0};
    r = cm384_generate(e, NULL, ids, 6, &s, tr_collect, &bad);
    printf("  regions sized too small: status %d, final event %d, %d tokens delivered\n", r, bad.final_kind, bad.n_ids);
    CHECK(r == CM384_E_INTERNAL && bad.final_kind == CM384_EV_ERROR && bad.finals == 1 && bad.n_ids == 0,
          "a broken step gave status %d, final kind %d, %d tokens", r, bad.final_kind, bad.n_ids);
    float *lg = malloc(sizeof(float) * 6 * 1024);
    r = cm384_eval(e, ids, 6, lg, NULL);
    CHECK(r == CM384_E_INTERNAL && tr_contains(cm384_last_error(), "internal error"), "eval on a broken region: %d", r);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    CHECK(st.requests_failed == 1, "requests_failed = %llu", (unsigned long long)st.requests_failed);

    peers_pause(e);
    for (int L = 0; L < N_LANES; L++) e->peers[L].rg.cap = cap[L];
    peers_resume(e);
    tr_text again = {0};
    r = cm384_generate(e, NULL, ids, 6, &s, tr_collect, &again);
    CHECK(r == CM384_OK && again.n_ids == good.n_ids && !memcmp(again.ids, good.ids, sizeof(int32_t) * good.n_ids),
          "after the failed step the engine gives other tokens (status %d)", r);
    r = cm384_eval(e, ids, 6, lg, NULL);
    CHECK(r == CM384_OK, "eval after the failed step: %s", cm384_last_error());
    free(lg);
    free(good.buf); free(bad.buf); free(again.buf);
    cm384_engine_free(e);
}

TEST_MAIN(trust) {
    cm384_model *m;
    if (cm384_model_load(TR_FIX, NULL, &m)) { printf("%s\n", cm384_last_error()); return 1; }
    tr_defaults(m);
    tr_config(m);
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e) == CM384_OK) {
        tr_sampling(e);
        cm384_engine_free(e);
    }
    tr_ids(m);
    tr_long_text(m);
    tr_report_line();
    tr_trace_and_stats(m);
    tr_internal(m);
    cm384_model_free(m);
    return test_summary("trust");
}

/* request: cm384_submit with hostile cm384_request and cm384_sampling values
 * -- struct sizes, prompts as text and as ids (out of range, negative
 * counts), temperatures, top-k, top-p and min-p from raw float bits (NaN,
 * infinities, negatives, > 1), seeds, max_tokens, tenants -- on a running
 * engine (tiny-dsv3, a short context so a request costs little).
 * Must hold: submit either queues the request or fails with INVALID or
 * CAPACITY, a message, no id and no event; a queued request sends token
 * events with ids in [0, vocab), then exactly one final event whose status is
 * what cm384_wait returns, n_generated counts the tokens and stays within
 * max_tokens; and the same request submitted again gives the same tokens
 * (same seed, same tokens). */

static cm384_engine *fuzz_req_engine;
static cm384_model *fuzz_req_model;

static void fuzz_request_init(void) {
    if (cm384_model_load(fuzz_fixture("tiny-dsv3"), NULL, &fuzz_req_model)) {
        fprintf(stderr, "%s\n", cm384_last_error());
        exit(2);
    }
    cm384_config c;
    cm384_config_init(&c);
    c.n_devices = 4;
    c.n_workers = 1;
    c.max_ctx = 8;
    c.max_batch = 4;
    if (cm384_engine_create(fuzz_req_model, &c, &fuzz_req_engine)) {
        fprintf(stderr, "%s\n", cm384_last_error());
        exit(2);
    }
}

typedef struct fuzz_req_log {
    int32_t tokens[64];
    int     n_tokens, n_final, final_status, final_generated, after_final;
    uint64_t id;
} fuzz_req_log;

static int fuzz_req_event(void *user, const cm384_event *ev) {
    fuzz_req_log *l = user;
    if (l->n_final) l->after_final++;
    if (ev->kind == CM384_EV_TOKEN) {
        if (l->n_tokens < 64) l->tokens[l->n_tokens] = ev->token;
        l->n_tokens++;
    } else {
        l->n_final++;
        l->final_status = ev->status;
        l->final_generated = ev->n_generated;
    }
    l->id = ev->id;
    return 0;
}

static float fuzz_req_float(fz *f) {
    static const float picks[] = {0.0f, 0.5f, 1.0f, 2.0f, 1e-30f, 1e30f, -1.0f, 0.999f, 1.001f, 0.05f};
    uint8_t b = fz_u8(f);
    if (b < 0x40) return picks[b % 10];
    if (b < 0x48) return b & 1 ? INFINITY : -INFINITY;
    if (b < 0x50) return NAN;
    return fz_f32(f);
}

/* Submits, waits, checks the events; returns the status (events in *l). */
static int fuzz_req_run(const cm384_request *q, fuzz_req_log *l, int max_tokens_seen, int events) {
    cm384_engine *e = fuzz_req_engine;
    memset(l, 0, sizeof *l);
    uint64_t id = 12345;
    int r = cm384_submit(e, q, &id);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_INVALID, CM384_E_CAPACITY, CM384_E_NOMEM);
        FUZZ_CHECK(id == 0, "a failed submit gave id %llu", (unsigned long long)id);
        cm384_wait_all(e);
        FUZZ_CHECK(l->n_tokens == 0 && l->n_final == 0, "a request that was not queued sent events");
        return r;
    }
    int st = cm384_wait(e, id, -1);
    FUZZ_CHECK(st == CM384_OK, "a queued request ended with %s", cm384_strerror(st));
    if (!events) {                        /* struct_size stops before on_event */
        FUZZ_CHECK(l->n_tokens == 0 && l->n_final == 0, "events went to a callback the request did not give");
        return st;
    }
    FUZZ_CHECK(l->n_final == 1 && l->after_final == 0, "%d final events, %d events after one", l->n_final, l->after_final);
    FUZZ_CHECK(l->id == id, "events carry id %llu, not %llu", (unsigned long long)l->id, (unsigned long long)id);
    FUZZ_CHECK(l->final_status == st, "final event status %d, cm384_wait %d", l->final_status, st);
    FUZZ_CHECK(l->final_generated == l->n_tokens, "n_generated %d, %d token events", l->final_generated, l->n_tokens);
    FUZZ_CHECK(l->n_tokens <= max_tokens_seen, "%d tokens for max_tokens %d", l->n_tokens, max_tokens_seen);
    int V = cm384_vocab_size(fuzz_req_model);
    for (int i = 0; i < l->n_tokens && i < 64; i++)
        FUZZ_CHECK(l->tokens[i] >= 0 && l->tokens[i] < V, "token %d out of [0, %d)", l->tokens[i], V);
    return st;
}

static int fuzz_request(const uint8_t *data, size_t size) {
    fz f = {data, size};
    int V = cm384_vocab_size(fuzz_req_model);
    fuzz_req_log log1, log2;
    cm384_request q;
    cm384_request_init(&q);
    cm384_sampling s;
    cm384_sampling_init(&s);
    uint8_t mode = fz_u8(&f);
    static const size_t rq_sizes[] = {sizeof(cm384_request), offsetof(cm384_request, sampling), 0, 65537,
                                      sizeof(cm384_request) + 64, offsetof(cm384_request, sampling) - 1};
    static const size_t sp_sizes[] = {sizeof(cm384_sampling), offsetof(cm384_sampling, top_k), 0, 1u << 20,
                                      sizeof(cm384_sampling) + 8, offsetof(cm384_sampling, seed)};
    /* the request struct may claim to be bigger than ours: give it room */
    struct { cm384_request q; uint8_t pad[128]; } big;
    memset(&big, 0, sizeof big);
    char *text = NULL;
    int32_t ids[16];
    int n_have = 0;
    if (mode & 1) {
        size_t len;
        text = fz_str(&f, 48, &len);
        q.text = text;
        q.text_len = (mode & 2) && len ? fz_u8(&f) % len : 0;
    }
    if (mode & 4) {
        n_have = fz_u8(&f) % 17;
        for (int i = 0; i < n_have; i++) {
            uint32_t v = fz_u32(&f);
            ids[i] = (mode & 8) ? (int32_t)v : (int32_t)(v % (uint32_t)(V + 1));
        }
        q.ids = n_have ? ids : NULL;
        int8_t k = (int8_t)fz_u8(&f);
        q.n_ids = k < 0 ? k : k % (n_have + 1);
    }
    int max_tokens = 128;
    if (mode & 16) {
        s.temperature = fuzz_req_float(&f);
        s.top_p = fuzz_req_float(&f);
        s.min_p = fuzz_req_float(&f);
        uint8_t kb = fz_u8(&f);
        s.top_k = kb < 0x80 ? kb % 8 : (int)fz_u32(&f);
        s.seed = fz_u64(&f);
        uint8_t mb = fz_u8(&f);
        s.max_tokens = mb < 0xc0 ? mb % 8 : (int)fz_u32(&f);
        s.ignore_eos = mb & 1;
        s.struct_size = sp_sizes[fz_u8(&f) % 6];
        if (s.struct_size >= offsetof(cm384_sampling, max_tokens) + sizeof(int)) max_tokens = s.max_tokens;
        q.sampling = &s;
    }
    q.tenant = fz_u32(&f);
    q.on_event = fuzz_req_event;
    q.user = &log1;
    q.struct_size = rq_sizes[(mode >> 5) % 6];
    big.q = q;
    int events = q.struct_size >= sizeof(cm384_request);
    if (q.struct_size < offsetof(cm384_request, sampling) + sizeof(void *)) max_tokens = 128;   /* default sampling */
    int r = fuzz_req_run(&big.q, &log1, max_tokens, events);
    if (r == CM384_OK && events) {
        big.q.user = &log2;
        int r2 = fuzz_req_run(&big.q, &log2, max_tokens, events);
        FUZZ_CHECK(r2 == CM384_OK && log2.n_tokens == log1.n_tokens &&
                   !memcmp(log1.tokens, log2.tokens, sizeof(int32_t) * (size_t)(log1.n_tokens < 64 ? log1.n_tokens : 64)),
                   "the same request gave other tokens the second time (%d and %d tokens)", log1.n_tokens, log2.n_tokens);
    }
    free(text);
    return 0;
}

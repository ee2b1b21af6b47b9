/* test_api.c -- the public API's contract: bad arguments fail with their
 * documented status and never crash, option structs are versioned by
 * struct_size, errors are per thread, sampling does what each knob says,
 * streaming decode never splits a character. */
#include "../cm384.c"
#include "test.h"

#define FIX "tests/fixtures/tiny-dsv3"

/* ---- sampling: each knob, measured ---- */
static void sampling(void) {
    printf("sampling:\n");
    enum { V = 8 };
    float logits[V] = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f};
    cand c[V];
    cm384_sampling s;
    uint64_t rng = 1;
    int ok;

    cm384_sampling_init(&s);
    CHECK(sample_token(logits, V, &s, &rng, c) == 0, "greedy is not the argmax");
    float tie[4] = {1, 3, 3, 0};
    CHECK(sample_token(tie, 4, &s, &rng, c) == 1, "greedy ties go to the lowest id");

    /* temperature 1: frequencies follow softmax(logits) */
    s.temperature = 1.0f;
    int count[V] = {0}, N = 40000;
    for (int i = 0; i < N; i++) count[sample_token(logits, V, &s, &rng, c)]++;
    double z = 0, worst = 0;
    for (int v = 0; v < V; v++) z += exp(logits[v]);
    for (int v = 0; v < V; v++) {
        double p = exp(logits[v]) / z, sd = sqrt(N * p * (1 - p)) + 1;
        worst = fmax(worst, fabs(count[v] - N * p) / sd);
    }
    printf("  temperature 1: %d draws, largest deviation from softmax %.2f sigma\n", N, worst);
    CHECK(worst < 5, "temperature sampling deviates from softmax by %.1f sigma", worst);

    /* top-k 3: only the three best */
    memset(count, 0, sizeof count);
    s.top_k = 3;
    for (int i = 0; i < 5000; i++) count[sample_token(logits, V, &s, &rng, c)]++;
    ok = count[0] && count[1] && count[2];
    for (int v = 3; v < V; v++) ok &= count[v] == 0;
    CHECK(ok, "top-k 3 sampled outside the top 3");
    s.top_k = 1;
    ok = 1;
    for (int i = 0; i < 200; i++) ok &= sample_token(logits, V, &s, &rng, c) == 0;
    CHECK(ok, "top-k 1 is not greedy");

    /* top-p: the nucleus only.  p(0)=0.43, p(0)+p(1)=0.70, +p(2)=0.86 */
    s.top_k = 0;
    s.top_p = 0.75f;
    memset(count, 0, sizeof count);
    for (int i = 0; i < 5000; i++) count[sample_token(logits, V, &s, &rng, c)]++;
    ok = count[0] && count[1] && count[2];
    for (int v = 3; v < V; v++) ok &= count[v] == 0;
    CHECK(ok, "top-p 0.75 sampled outside its nucleus {0,1,2}");

    /* min-p 0.5: tokens at least half as likely as the best: {0 (1.0), 1 (0.61)} */
    s.top_p = 1.0f;
    s.min_p = 0.5f;
    memset(count, 0, sizeof count);
    for (int i = 0; i < 5000; i++) count[sample_token(logits, V, &s, &rng, c)]++;
    ok = count[0] && count[1];
    for (int v = 2; v < V; v++) ok &= count[v] == 0;
    CHECK(ok, "min-p 0.5 sampled a token less than half as likely as the best");

    /* the same seed, the same tokens; another seed, others */
    s.min_p = 0;
    int a[64], b[64], d[64], same = 1, diff = 0;
    uint64_t r1 = 42, r2 = 42, r3 = 43;
    for (int i = 0; i < 64; i++) {
        a[i] = sample_token(logits, V, &s, &r1, c);
        b[i] = sample_token(logits, V, &s, &r2, c);
        d[i] = sample_token(logits, V, &s, &r3, c);
        same &= a[i] == b[i];
        diff += a[i] != d[i];
    }
    CHECK(same && diff > 0, "seeds: same %d, %d differences with another seed", same, diff);
}

/* ---- arguments, versions, errors ---- */
static int err_thread_ok;
static void *other_thread(void *arg) {
    (void)arg;
    err_thread_ok = cm384_last_error()[0] == 0;         /* another thread's error is not ours */
    return NULL;
}

static void arguments(cm384_model *m) {
    printf("arguments and versions:\n");
    for (int s = 0; s >= -10; s--) CHECK(cm384_strerror(s) && cm384_strerror(s)[0], "strerror(%d)", s);
    CHECK(strstr(cm384_strerror(-1000), "unknown") != NULL, "strerror of an unknown code");
    cm384_model_free(NULL);
    cm384_engine_free(NULL);
    CHECK(cm384_vocab_size(NULL) == CM384_E_INVALID, "vocab_size(NULL)");
    CHECK(cm384_tokenize(NULL, "x", 1, NULL, 0, 0) == CM384_E_INVALID, "tokenize(NULL model)");
    CHECK(cm384_tokenize(m, NULL, 3, NULL, 0, 0) == CM384_E_INVALID, "tokenize(NULL text)");
    CHECK(cm384_tokenize(m, "", 0, NULL, 0, 0) == 0, "tokenize of empty text");
    int32_t bad = 99999;
    CHECK(cm384_detokenize(m, &bad, 1, NULL, 0) == CM384_E_INVALID, "detokenize of a bad id");
    CHECK(cm384_eval(NULL, &bad, 1, NULL, NULL) == CM384_E_INVALID, "eval(NULL)");

    /* a failed call leaves its message on this thread only */
    cm384_engine *e;
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "mesh";
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID && strstr(cm384_last_error(), "mesh"), "unknown preset");
    pthread_t th;
    pthread_create(&th, NULL, other_thread, NULL);
    pthread_join(th, NULL);
    CHECK(err_thread_ok, "the error message leaked to another thread");
    cm384_config_init(&c);
    c.max_ctx = 100000;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID, "max_ctx beyond the model");
    cm384_config_init(&c);
    c.kv_pool_bytes = 1000;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID, "a pool too small for one request");
    cm384_config_init(&c);
    c.preset = "paper";
    c.n_devices = 8;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID && strstr(cm384_last_error(), "paper"),
          "paper preset on too few devices: %s", cm384_last_error());
    cm384_config_init(&c);
    c.struct_size = 2;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID, "struct_size too small");

    /* an older, smaller struct: only its fields are read or written */
    cm384_config_init(&c);
    c.struct_size = offsetof(cm384_config, max_ctx);    /* knows topology only */
    c.n_workers = 2;
    c.max_ctx = 12345;                                    /* beyond its size: ignored */
    CHECK(cm384_engine_create(m, &c, &e) == CM384_OK, "an older config struct: %s", cm384_last_error());
    if (e) {
        CHECK(e->max_ctx != 12345, "a field beyond struct_size was read");
        cm384_stats st;
        memset(&st, 0xAB, sizeof st);
        st.struct_size = offsetof(cm384_stats, tokens_prefilled);
        cm384_get_stats(e, &st);
        CHECK(st.tokens_prefilled == 0xABABABABABABABABull, "get_stats wrote beyond struct_size");
        char small[16];
        int n = cm384_report(e, small, sizeof small);
        CHECK(n > 100 && strlen(small) == 15, "report: snprintf convention (%d)", n);
        /* requests: bad ones fail alone */
        cm384_request rq;
        cm384_request_init(&rq);
        CHECK(cm384_submit(e, &rq, NULL) == CM384_E_INVALID, "a request without a prompt");
        rq.text = "Hello";
        cm384_sampling sp;
        cm384_sampling_init(&sp);
        sp.max_tokens = 0;
        rq.sampling = &sp;
        CHECK(cm384_submit(e, &rq, NULL) == CM384_E_INVALID, "max_tokens 0");
        sp.max_tokens = 4;
        sp.temperature = -1;
        CHECK(cm384_submit(e, &rq, NULL) == CM384_E_INVALID, "negative temperature");
        sp.temperature = 0;
        uint64_t id;
        CHECK(cm384_submit(e, &rq, &id) == CM384_OK, "a text prompt: %s", cm384_last_error());
        CHECK(cm384_wait(e, id, 10000) == CM384_OK, "wait");
        CHECK(cm384_wait(e, 987654, 0) == CM384_E_NOT_FOUND, "wait for an unknown id");
        CHECK(cm384_cancel(e, 987654) == CM384_E_NOT_FOUND, "cancel an unknown id");
        cm384_engine_free(e);
    }
    cm384_model_info info;
    memset(&info, 0x55, sizeof info);
    info.struct_size = offsetof(cm384_model_info, n_layers);
    cm384_model_get_info(m, &info);
    CHECK(info.vocab_size == 1024 && info.n_layers == 0x55555555, "model_get_info and struct_size");
}

/* ---- tokens and text ---- */
static void text(cm384_model *m) {
    printf("tokens and text:\n");
    /* "🦀" is four bytes; the tiny tokenizer has no token for it, so it comes
       out as several byte tokens: nothing is printed until the last */
    const char *crab = "\xf0\x9f\xa6\x80";
    int32_t ids[8];
    int n = cm384_tokenize(m, crab, 4, ids, 8, 0);
    CHECK(n >= 2, "the crab is %d tokens", n);
    cm384_detok_stream ds;
    cm384_detok_stream_init(&ds);
    char out[64];
    int early = 0, last = 0;
    for (int i = 0; i < n && i < 8; i++) {
        int k = cm384_detok_stream_push(m, &ds, ids[i], out, sizeof out);
        if (i < n - 1) early += k; else last = k;
    }
    CHECK(early == 0 && last == 4 && !memcmp(out, crab, 4), "streaming decode split a character (%d early, %d last)", early, last);
    cm384_detok_stream_init(&ds);
    cm384_detok_stream_push(m, &ds, ids[0], out, sizeof out);
    int f = cm384_detok_stream_flush(&ds, out, sizeof out);
    CHECK(f >= 3 && !memcmp(out, "\xef\xbf\xbd", 3), "an incomplete tail flushes as U+FFFD (%d)", f);
    CHECK(cm384_token_is_special(m, 0) == 1 && cm384_token_is_special(m, 300) == 0, "is_special");
    char t[16];
    CHECK(cm384_token_text(m, 3, t, sizeof t) == 1 && t[0] == '!', "token_text of id 3");
    CHECK(cm384_token_bos(m) == 0 && cm384_token_eos(m) == 1, "bos/eos");
    cm384_chat_msg msgs[2] = {{"system", "Be brief.", NULL, 0}, {"user", "Hi", NULL, 0}};
    char buf[256];
    int len = cm384_chat_render(m, msgs, 2, CM384_CHAT_ADD_GENERATION_PROMPT, buf, sizeof buf);
    const char *want = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>Be brief.<\xef\xbd\x9cUser\xef\xbd\x9c>Hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";
    CHECK(len == (int)strlen(want) && !strcmp(buf, want), "chat render: %s", buf);
    cm384_chat_msg nor = {NULL, "x", NULL, 0};
    CHECK(cm384_chat_render(m, &nor, 1, 0, buf, sizeof buf) == CM384_E_INVALID, "a message without a role");
}

/* ---- the paper preset at DeepSeek-V3's scale (topology only, no weights) ---- */
static void paper_v3(void) {
    printf("paper preset for DeepSeek-V3's shapes (256 experts, top-8, 61 layers):\n");
    cm384_model fake;
    memset(&fake, 0, sizeof fake);
    fake.hp.n_routed = 256; fake.hp.top_k = 8; fake.hp.n_shared = 1; fake.hp.n_layers = 61; fake.hp.n_mtp = 1;
    fake.hp.n_dense = 3;
    layer_w layers[62];
    memset(layers, 0, sizeof layers);
    for (int l = 0; l < 62; l++) layers[l].is_moe = l >= 3;
    fake.layers = layers;
    struct cm384_engine e;
    memset(&e, 0, sizeof e);
    e.m = &fake;
    cm384_config_init(&e.cfg);
    snprintf(e.preset, sizeof e.preset, "paper");
    e.n_workers = 2;
    int r = build_topology(&e);
    CHECK(r == CM384_OK, "paper topology: %s", cm384_last_error());
    int attn = 0, expert = 0, shared = 0, prefill = 0, alone = 1;
    for (int d = 0; d < e.n_dev; d++) {
        attn += !!(e.dev[d].roles & ROLE_ATTN);
        expert += !!(e.dev[d].roles & ROLE_EXPERT);
        shared += !!(e.dev[d].roles & ROLE_SHARED);
        prefill += !!(e.dev[d].roles & ROLE_PREFILL);
        if (e.dev[d].n_hosted > 1) alone = 0;
    }
    const placement *p = &e.place[PHASE_DECODE];
    int replicas = 0;
    for (int x = 0; x < 256; x++) replicas += pl_nrep(p, 10, 256)[x] - 1;
    printf("  %d decode devices (DP attention on all), %d expert devices (256 + %d redundant), %d shared-expert "
           "replicas, %d prefill devices, one expert per device: %s, %d experts replicated in layer 10\n",
           attn, expert, e.n_red, shared, prefill, alone ? "yes" : "no", replicas);
    CHECK(attn == 320 && expert == 288 && e.n_red == 32 && shared == 32 && prefill == 32 && alone && replicas == 32,
          "EP320 layout");
    pl_free(&e.place[0]);
    pl_free(&e.place[1]);
    free(e.dev); free(e.pre_devs); free(e.attn_devs); free(e.red_devs); free(e.exp_devs);
    free(e.eplb_ld); free(e.eplb_items); free(e.eplb_used); free(e.eplb_old);
}

/* ---- what the observability calls report adds up ---- */
static void observability(cm384_model *m) {
    printf("observability:\n");
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.n_devices = 24; c.int8_dispatch = 1;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 3 + (i * 37) % 1000;
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 12; s.ignore_eos = 1;
    for (int r = 0; r < 3; r++) cm384_generate(e, NULL, ids, 20 + 10 * r, &s, NULL, NULL);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    int n = cm384_get_traffic(e, NULL, 0);
    uint64_t *tr = calloc((size_t)n * n, sizeof *tr), sum = 0;
    CHECK(cm384_get_traffic(e, tr, n * n) == 24, "traffic matrix size %d", n);
    for (int i = 0; i < n * n; i++) sum += tr[i];
    CHECK(sum == st.dispatch_bytes + st.combine_bytes,
          "UB traffic matrix sums to %llu, stats say %llu", (unsigned long long)sum,
          (unsigned long long)(st.dispatch_bytes + st.combine_bytes));
    uint64_t rdma = 0;
    CHECK(cm384_get_plane_traffic(e, CM384_PLANE_RDMA, tr, n * n) == 24, "RDMA plane size");
    for (int i = 0; i < n * n; i++) rdma += tr[i];
    CHECK(rdma == st.kv_handoff_bytes && rdma > 0, "RDMA plane sums to %llu, KV hand-off %llu", (unsigned long long)rdma,
          (unsigned long long)st.kv_handoff_bytes);
    CHECK(cm384_get_plane_traffic(e, 3, tr, n * n) == CM384_E_INVALID, "a bad plane");
    uint64_t load[16], total = 0;
    int E = cm384_get_expert_load(e, -1, load, 16);
    for (int x = 0; x < E; x++) total += load[x];
    /* every token of every step goes to top_k experts in each of 3 MoE layers (2 main + MTP not run here: 2) */
    uint64_t tokens = st.tokens_prefilled + st.tokens_decoded - 3;   /* the last token of each request is not fed back */
    CHECK(E == 16 && total == tokens * 4 * 2, "expert loads sum to %llu, want %llu", (unsigned long long)total,
          (unsigned long long)(tokens * 4 * 2));
    CHECK(cm384_get_expert_load(e, 7, load, 16) == CM384_E_INVALID, "a bad layer");
    double busy[24];
    CHECK(cm384_get_device_busy(e, busy, 24) == 24, "device busy size");
    int busy_dev = 0;
    for (int d = 0; d < 24; d++) busy_dev += busy[d] > 0;
    printf("  %d devices, traffic %.2f MB, %llu expert rows, %d devices busy; device 0 is %s, device 4 is %s\n", n,
           sum / 1e6, (unsigned long long)total, busy_dev, cm384_device_roles(e, 0), cm384_device_roles(e, 4));
    CHECK(busy_dev >= 6 && !strcmp(cm384_device_roles(e, 0), "prefill") && !strcmp(cm384_device_roles(e, 4), "expert"),
          "device roles and busy times");
    free(tr);
    cm384_engine_free(e);
}

TEST_MAIN(api) {
    paper_v3();
    sampling();
    cm384_model *m;
    if (cm384_model_load(FIX, NULL, &m)) { printf("%s\n", cm384_last_error()); return 1; }
    arguments(m);
    text(m);
    observability(m);
    cm384_model_free(m);
    return test_summary("api");
}

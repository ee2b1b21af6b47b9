/* test_engine.c -- the supernode keeps the model's answer.
 *
 *   exactness    64 concurrent requests (prompts of 1-300 tokens, outputs
 *                of 1-32) give exactly the greedy tokens each gives run
 *                alone on one device, on every topology;
 *   caching      a shared prefix is served from the context cache with the
 *                same tokens; another tenant gets no hit;
 *   INT8         dispatch quantized to INT8 keeps top-1 on the fixture
 *                sequences (threshold set from measurement);
 *   exhaustion   200 requests through a pool that fits 10 at a time all
 *                finish with the unconstrained tokens;
 *   cancel, concurrent submit, bad requests.
 *
 * The model is the tiny-dsv3 fixture with max_position_embeddings raised to
 * 1024 (the weights do not depend on it), so prompts up to 300 fit.
 * Set CM384_QUICK=1 for a smaller workload (used under ThreadSanitizer). */
#include "../cm384.c"
#include "test.h"

#define FIX "tests/fixtures/tiny-dsv3"

typedef struct job {
    int32_t prompt[320];
    int     n_prompt, max_tokens;
    uint32_t tenant;
    int     out[64], n_out;
    int     status, n_cached, finals;
    int     cancel_after;          /* callback cancels after this many tokens (0 = never) */
} job;

static int on_event(void *user, const cm384_event *ev) {
    job *j = user;
    if (ev->kind == CM384_EV_TOKEN) {
        if (j->n_out < 64) j->out[j->n_out] = ev->token;
        j->n_out++;
        return j->cancel_after && j->n_out >= j->cancel_after;
    }
    j->status = ev->status;
    j->n_cached = ev->n_cached;
    j->finals++;
    return 0;
}

static int with_mtp;        /* engines made next use MTP speculative decoding */
static float temperature;   /* requests submitted next sample at this temperature */
static uint64_t rng = 12345;
static int rnd(int n) { rng = rng * 6364136223846793005ull + 1442695040888963407ull; return (int)((rng >> 33) % (uint64_t)n); }

static void make_jobs(job *jobs, int n, int max_prompt, int max_out) {
    for (int i = 0; i < n; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].n_prompt = 1 + rnd(max_prompt);
        jobs[i].prompt[0] = 0;
        for (int t = 1; t < jobs[i].n_prompt; t++) jobs[i].prompt[t] = 3 + rnd(1000);
        jobs[i].max_tokens = 1 + rnd(max_out);
    }
}

static void reset_outputs(job *jobs, int n) {
    for (int i = 0; i < n; i++) { jobs[i].n_out = 0; jobs[i].status = -99; jobs[i].finals = 0; jobs[i].n_cached = 0; }
}

static void submit_job(cm384_engine *e, job *j) {
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = j->max_tokens;
    s.temperature = temperature;
    s.top_p = temperature > 0 ? 0.9f : 1.0f;
    s.seed = (uint64_t)j->n_prompt * 7919u;
    cm384_request rq;
    cm384_request_init(&rq);
    rq.ids = j->prompt; rq.n_ids = j->n_prompt; rq.sampling = &s; rq.tenant = j->tenant;
    rq.on_event = on_event; rq.user = j;
    int r = cm384_submit(e, &rq, NULL);
    if (r) printf("  submit failed: %s\n", cm384_last_error());
}


static cm384_engine *engine(cm384_model *m, const char *preset, int workers, int devices, int mbs, int int8) {
    cm384_config c;
    cm384_config_init(&c);
    c.preset = preset; c.n_workers = workers; c.microbatches = mbs; c.int8_dispatch = int8; c.mtp = with_mtp;
    c.bf16_combine = -1;            /* exact numerics on every topology, the paper preset too */
    if (devices) c.n_devices = devices;
    c.max_ctx = m->hp.max_pos < 512 ? m->hp.max_pos : 512;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

static int same_tokens(const job *a, const job *b) {
    if (a->n_out != b->n_out || a->status != b->status) return 0;
    for (int t = 0; t < a->n_out && t < 64; t++) if (a->out[t] != b->out[t]) return 0;
    return 1;
}

static int quick;

/* The config engine() makes with two workers, exact numerics and a short
 * context, for a test to add its own switch to. */
static cm384_config small_config(const cm384_model *m) {
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.bf16_combine = -1; c.mtp = with_mtp;
    c.max_ctx = m->hp.max_pos < 512 ? m->hp.max_pos : 512;
    return c;
}

/* Submits n jobs (outputs cleared) and waits for them all. */
static void run_jobs(cm384_engine *e, job *jobs, int n) {
    for (int i = 0; i < n; i++) { reset_outputs(&jobs[i], 1); submit_job(e, &jobs[i]); }
    cm384_wait_all(e);
}

/* ---- a prefaulted pool ---- */
/* config.prefault: every page of the pool is resident once the engine
 * exists (mincore, where the OS has it), and requests give the tokens a
 * lazily touched pool gives. */
static void prefaulted(cm384_model *m) {
    printf("prefaulted pool:\n");
    enum { N = 8 };
    job ref[N], got[N];
    make_jobs(ref, N, 100, 16);
    memcpy(got, ref, sizeof ref);
    cm384_engine *e = engine(m, "default", 2, 0, 2, 0);
    run_jobs(e, ref, N);
    cm384_engine_free(e);
    cm384_config c = small_config(m);
    c.prefault = 1;
    e = NULL;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_OK, "engine with prefault: %s", cm384_last_error());
    if (!e) return;
#if defined(__linux__)
    {
        const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t a = (uintptr_t)e->pool & ~(pg - 1), b = ((uintptr_t)e->pool + e->pool_bytes + pg - 1) & ~(pg - 1);
        size_t np = (size_t)((b - a) / pg), resident = 0;
        unsigned char *vec = malloc(np);
        if (vec && mincore((void *)a, b - a, vec) == 0)
            for (size_t i = 0; i < np; i++) resident += vec[i] & 1;
        printf("  %.1f MB pool: %zu of %zu pages resident after creation\n", e->pool_bytes / 1e6, resident, np);
        CHECK(vec && resident == np, "prefault: %zu of %zu pool pages resident", resident, np);
        free(vec);
    }
#endif
    run_jobs(e, got, N);
    int same = 0;
    for (int i = 0; i < N; i++) same += same_tokens(&ref[i], &got[i]) && got[i].status == CM384_OK;
    printf("  %d/%d requests give the tokens of a lazily touched pool\n", same, N);
    CHECK(same == N, "prefault: %d/%d requests as without it", same, N);
    cm384_engine_free(e);
    c.prefault = 2;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID && e == NULL, "config.prefault = 2 is refused");
}

/* ---- the stage profile ---- */
/* config.profile: every stage of both phases is in it, each counted once a
 * region -- an attention core per layer and step, the head's logits once a
 * step -- its times within the phase's busy time, the tokens unchanged,
 * and it is refused where it was not asked for. */
static void profiled(cm384_model *m) {
    printf("stage profile:\n");
    enum { N = 6 };
    job ref[N], got[N];
    make_jobs(ref, N, 60, 12);
    memcpy(got, ref, sizeof ref);
    cm384_engine *e = engine(m, "default", 2, 0, 1, 0);
    run_jobs(e, ref, N);
    cm384_stage_time none[1];
    CHECK(cm384_get_profile(e, none, 1) == CM384_E_MISUSE, "cm384_get_profile without config.profile is refused");
    cm384_engine_free(e);
    cm384_config c = small_config(m);
    c.profile = 1;
    e = NULL;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_OK, "engine with profile: %s", cm384_last_error());
    if (!e) return;
    CHECK(cm384_get_profile(e, NULL, 0) == 0, "a new engine's profile is empty");
    run_jobs(e, got, N);
    int same = 0;
    for (int i = 0; i < N; i++) same += same_tokens(&ref[i], &got[i]) && got[i].status == CM384_OK;
    CHECK(same == N, "profile: %d/%d requests give the tokens of an engine without it", same, N);
    cm384_stats st = {.struct_size = sizeof st};
    cm384_get_stats(e, &st);
    int n = cm384_get_profile(e, NULL, 0);
    cm384_stage_time t[256];
    CHECK(n > 0 && n <= 256, "profile: %d stages", n);
    if (n <= 0 || n > 256) { cm384_engine_free(e); return; }
    CHECK(cm384_get_profile(e, t, 3) == n, "a short buffer still gets the count");
    CHECK(cm384_get_profile(e, t, n) == n, "profile read back");
    double sum[2] = {0, 0};
    uint64_t core[2] = {0, 0}, logits[2] = {0, 0};
    int dup = 0, bad = 0;
    for (int i = 0; i < n; i++) {
        bad += t[i].phase != CM384_PHASE_PREFILL && t[i].phase != CM384_PHASE_DECODE;
        bad += !t[i].name || !t[i].op || !(t[i].seconds >= 0) || t[i].regions == 0;
        if (bad) continue;
        sum[t[i].phase] += t[i].seconds;
        if (!strcmp(t[i].name, "attention") && !strcmp(t[i].op, "core")) core[t[i].phase] += t[i].regions;
        if (!strcmp(t[i].name, "head") && !strcmp(t[i].op, "logits")) logits[t[i].phase] += t[i].regions;
        for (int j = 0; j < i; j++)
            dup += t[j].phase == t[i].phase && !strcmp(t[j].name, t[i].name) && !strcmp(t[j].op, t[i].op);
    }
    CHECK(!bad && !dup, "profile rows: %d malformed, %d repeated", bad, dup);
    int layers = m->hp.n_layers + (with_mtp ? m->hp.n_mtp : 0);
    printf("  %d stages; decode: %llu steps, %llu core regions, %llu head regions, %.1f of %.1f ms in stages\n", n,
           (unsigned long long)st.decode_steps, (unsigned long long)core[1], (unsigned long long)logits[1],
           1e3 * sum[1], 1e3 * st.decode_seconds);
    if (!with_mtp) {   /* MTP layers attend in batches of their own (mtp_flush) */
        CHECK(core[1] == (uint64_t)m->hp.n_layers * st.decode_steps, "decode: %llu core regions, %d layers x %llu steps",
              (unsigned long long)core[1], layers, (unsigned long long)st.decode_steps);
        CHECK(logits[1] == st.decode_steps, "decode: %llu head regions in %llu steps", (unsigned long long)logits[1],
              (unsigned long long)st.decode_steps);
    }
    CHECK(core[0] >= (uint64_t)m->hp.n_layers * st.prefill_steps, "prefill: %llu core regions in %llu steps",
          (unsigned long long)core[0], (unsigned long long)st.prefill_steps);
    CHECK(sum[1] > 0 && sum[1] <= st.decode_seconds, "decode stages %.3f ms within its busy %.3f ms", 1e3 * sum[1],
          1e3 * st.decode_seconds);
    CHECK(sum[0] > 0 && sum[0] <= st.prefill_seconds, "prefill stages %.3f ms within its busy %.3f ms", 1e3 * sum[0],
          1e3 * st.prefill_seconds);
    cm384_reset_stats(e);
    CHECK(cm384_get_profile(e, t, n) == 0, "cm384_reset_stats clears the profile");
    CHECK(cm384_get_profile(e, NULL, -1) == CM384_E_INVALID && cm384_get_profile(NULL, t, 1) == CM384_E_INVALID &&
          cm384_get_profile(e, NULL, 1) == CM384_E_INVALID, "cm384_get_profile refuses a NULL engine, cap < 0, NULL out");
    cm384_engine_free(e);
    c.profile = 2;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_E_INVALID && e == NULL, "config.profile = 2 is refused");
}

/* Decode's roofline counters (cm384_stats.decode_roof_*): one stream
 * without MTP multiplies one row a product, so every byte sits in the first
 * bucket with as many multiply-adds as weight values; the core's flops are
 * per layer and key a score and a weighted latent of every head, over the
 * keys each decode step's query sees. */
static void roofline(cm384_model *m) {
    printf("decode roofline counters:\n");
    uint64_t fp_macs = 0, fp_bytes = 0;
    for (int int8 = 0; int8 < 2; int8++) {
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.max_ctx = 256; c.mtp = 0; c.int8 = int8;
        cm384_engine *e = NULL;
        if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
        enum { P = 20, N = 12 };
        int32_t prompt[P];
        for (int i = 0; i < P; i++) prompt[i] = 2 + (i * 37) % 1000;
        cm384_sampling sp;
        cm384_sampling_init(&sp);
        sp.max_tokens = N; sp.ignore_eos = 1;
        int r = cm384_generate(e, NULL, prompt, P, &sp, NULL, NULL);
        CHECK(r == CM384_OK, "generate: %s", cm384_strerror(r));
        cm384_stats st = {.struct_size = sizeof st};
        cm384_get_stats(e, &st);
        const hparams *hp = &m->hp;
        uint64_t others = 0, keys = 0;
        for (int i = 1; i < CM384_ROOF_ROWS; i++) others += st.decode_roof_bytes[i] + st.decode_roof_macs[i];
        /* steps at positions P .. P + steps - 1 (the first token came from prefill) */
        for (uint64_t t = 0; t < st.decode_steps; t++) keys += (uint64_t)P + t + 1;
        uint64_t flops = keys * (uint64_t)hp->n_layers * 2u * (uint64_t)hp->n_heads * (2u * (uint64_t)hp->kv_lora + (uint64_t)hp->qk_rope);
        printf("  %s: %llu decode steps, %llu bytes over %llu multiply-adds at 1 row, core %llu flops\n", int8 ? "int8" : "fp",
               (unsigned long long)st.decode_steps, (unsigned long long)st.decode_roof_bytes[0],
               (unsigned long long)st.decode_roof_macs[0], (unsigned long long)st.decode_roof_core_flops);
        CHECK(st.decode_steps == N - 1, "%llu decode steps for %d tokens", (unsigned long long)st.decode_steps, N);
        CHECK(others == 0, "one stream: products over more than one row counted");
        CHECK(st.decode_roof_bytes[0] >= st.decode_weight_bytes && st.decode_weight_bytes > 0,
              "roofline bytes %llu below the weight bytes streamed %llu (it also counts the per-head products)",
              (unsigned long long)st.decode_roof_bytes[0], (unsigned long long)st.decode_weight_bytes);
        /* one row: a multiply-add per weight value -- the same products in
           INT8 (1 byte a value, the router's few kept as they were) as in
           the file's type (2-4 bytes) */
        if (!int8) {
            fp_macs = st.decode_roof_macs[0]; fp_bytes = st.decode_roof_bytes[0];
            CHECK(fp_macs * 2 <= fp_bytes && fp_bytes <= fp_macs * 4, "fp: %llu multiply-adds for %llu bytes",
                  (unsigned long long)fp_macs, (unsigned long long)fp_bytes);
        } else {
            CHECK(st.decode_roof_macs[0] == fp_macs, "int8: %llu multiply-adds, %llu in the file's type",
                  (unsigned long long)st.decode_roof_macs[0], (unsigned long long)fp_macs);
            CHECK(st.decode_roof_macs[0] <= st.decode_roof_bytes[0] && st.decode_roof_bytes[0] < fp_bytes,
                  "int8: %llu bytes for %llu multiply-adds (%llu in the file's type)", (unsigned long long)st.decode_roof_bytes[0],
                  (unsigned long long)st.decode_roof_macs[0], (unsigned long long)fp_bytes);
        }
        CHECK(st.decode_roof_core_flops == flops, "core flops %llu, want %llu", (unsigned long long)st.decode_roof_core_flops,
              (unsigned long long)flops);
        cm384_reset_stats(e);
        cm384_get_stats(e, &st);
        CHECK(st.decode_roof_bytes[0] == 0 && st.decode_roof_macs[0] == 0 && st.decode_roof_core_flops == 0,
              "cm384_reset_stats clears the roofline counters");
        cm384_engine_free(e);
    }
}

/* ---- exactness matrix ---- */
static void exactness(cm384_model *m) {
    int N = quick ? 12 : 64;
    job *ref = calloc((size_t)N, sizeof *ref), *got = calloc((size_t)N, sizeof *got);
    make_jobs(ref, N, quick ? 120 : 300, 32);
    /* reference: each request alone on one device */
    cm384_engine *e = engine(m, "single", 1, 0, 1, 0);
    for (int i = 0; i < N; i++) { reset_outputs(&ref[i], 1); submit_job(e, &ref[i]); cm384_wait_all(e); }
    cm384_engine_free(e);
    struct { const char *name, *preset; int workers, devices, mbs, mtp; } topo[] = {
        {"1 device, 1 worker", "single", 1, 0, 1, 0},
        {"1 device, 2 workers", "single", 2, 0, 2, 0},
        {"default, 2 workers", "default", 2, 0, 2, 0},
        {"default, 1 worker", "default", 1, 0, 2, 0},
        {"one expert per device (20 devices)", "default", 2, 20, 1, 0},
        {"4 devices (4 experts each)", "default", 2, 4, 2, 0},
        {"paper preset, 384 devices", "paper", 2, 384, 2, 0},
        {"one thread per device (8 devices, 8 workers)", "default", 8, 8, 2, 0},
        {"default + MTP speculative decoding (every step drafts)", "default", 2, 0, 2, 2},
        {"paper + MTP speculative decoding (every step drafts)", "paper", 2, 384, 2, 2},
        {"default + MTP, drafting while it pays (the gate)", "default", 2, 0, 2, 1},
    };
    printf("exactness: %d concurrent requests vs each alone on one device\n", N);
    for (size_t k = 0; k < sizeof topo / sizeof topo[0]; k++) {
        if (quick && k > 2 && k < 6) continue;
        memcpy(got, ref, (size_t)N * sizeof *got);
        reset_outputs(got, N);
        with_mtp = topo[k].mtp;
        e = engine(m, topo[k].preset, topo[k].workers, topo[k].devices, topo[k].mbs, 0);
        with_mtp = 0;
        if (!e) { CHECK(0, "engine for %s", topo[k].name); continue; }
        double t0 = now_ms();
        for (int i = 0; i < N; i++) submit_job(e, &got[i]);
        cm384_wait_all(e);
        double dt = now_ms() - t0;
        int same = 0, one_final = 0;
        for (int i = 0; i < N; i++) { same += same_tokens(&got[i], &ref[i]); one_final += got[i].finals == 1; }
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        printf("  %-36s %2d/%d identical, %d/%d single final event, %6.0f ms, %3d devices used for experts",
               topo[k].name, same, N, one_final, N, dt, st.n_expert_devices);
        if (topo[k].mtp) printf(", MTP %llu/%llu drafts accepted", (unsigned long long)st.mtp_accepted, (unsigned long long)st.mtp_drafted);
        printf("\n");
        if (topo[k].mtp) CHECK(st.mtp_drafted > 0, "%s: no MTP drafts", topo[k].name);
        CHECK(same == N && one_final == N, "%s: %d/%d requests identical", topo[k].name, same, N);
        cm384_engine_free(e);
    }
    free(ref);
    free(got);
}

/* ---- sampling is reproducible: same seed, same tokens, with or without MTP
   and whatever else runs ---- */
static void sampled(cm384_model *m) {
    int N = quick ? 6 : 16;
    printf("temperature 0.8, top-p 0.9, per-request seeds:\n");
    job *ref = calloc((size_t)N, sizeof *ref), *got = calloc((size_t)N, sizeof *got);
    make_jobs(ref, N, 60, 32);
    temperature = 0.8f;
    cm384_engine *e = engine(m, "single", 1, 0, 1, 0);
    for (int i = 0; i < N; i++) { reset_outputs(&ref[i], 1); submit_job(e, &ref[i]); cm384_wait_all(e); }
    cm384_engine_free(e);
    for (int pass = 0; pass < 3; pass++) {          /* MTP off, every step drafting, gated */
        memcpy(got, ref, (size_t)N * sizeof *got);
        reset_outputs(got, N);
        with_mtp = pass == 0 ? 0 : pass == 1 ? 2 : 1;
        e = engine(m, "default", 2, 0, 2, 0);
        with_mtp = 0;
        for (int i = 0; i < N; i++) submit_job(e, &got[i]);
        cm384_wait_all(e);
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        cm384_engine_free(e);
        int same = 0;
        for (int i = 0; i < N; i++) same += same_tokens(&got[i], &ref[i]);
        printf("  %d concurrent, %s: %d/%d identical to one-at-a-time runs", N,
               pass == 0 ? "MTP off" : pass == 1 ? "MTP every step" : "MTP gated", same, N);
        if (pass) printf(" (%llu/%llu drafts accepted)", (unsigned long long)st.mtp_accepted, (unsigned long long)st.mtp_drafted);
        printf("\n");
        CHECK(same == N, "sampled requests differ (%s)", pass ? "MTP" : "no MTP");
    }
    temperature = 0;
    free(ref);
    free(got);
}

/* ---- context caching ---- */
static void caching(cm384_model *m) {
    printf("context cache:\n");
    job a = {0}, b = {0}, c = {0}, fresh = {0};
    int n_prefix = 100;
    for (int t = 0; t < n_prefix; t++) a.prompt[t] = 3 + (t * 37) % 1000;
    memcpy(b.prompt, a.prompt, sizeof a.prompt);
    for (int t = n_prefix; t < n_prefix + 20; t++) { a.prompt[t] = 3 + (t * 11) % 1000; b.prompt[t] = 3 + (t * 13) % 1000; }
    a.n_prompt = b.n_prompt = n_prefix + 20;
    a.max_tokens = b.max_tokens = 12;
    c = b; c.tenant = 7;
    fresh = b;
    cm384_engine *e = engine(m, "default", 2, 0, 2, 0);
    double t0 = now_ms();
    submit_job(e, &a); cm384_wait_all(e);
    double t_a = now_ms() - t0;
    t0 = now_ms();
    submit_job(e, &b); cm384_wait_all(e);
    double t_b = now_ms() - t0;
    submit_job(e, &c); cm384_wait_all(e);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    cm384_engine_free(e);
    e = engine(m, "default", 2, 0, 2, 0);
    submit_job(e, &fresh); cm384_wait_all(e);
    cm384_engine_free(e);
    printf("  first request: %d cached; same prefix: %d of %d prompt tokens cached (%.1f ms vs %.1f ms); "
           "other tenant: %d cached; hit ratio %.2f\n", a.n_cached, b.n_cached, b.n_prompt, t_b, t_a, c.n_cached,
           st.cache_hit_ratio);
    CHECK(a.n_cached == 0, "first request reports %d cached tokens", a.n_cached);
    CHECK(b.n_cached >= 96, "shared prefix: only %d cached tokens", b.n_cached);
    CHECK(same_tokens(&b, &fresh), "cached run differs from an uncached run");
    CHECK(c.n_cached == 0, "another tenant got %d cached tokens", c.n_cached);
    CHECK(same_tokens(&c, &fresh), "other tenant's tokens differ");
    CHECK(st.tokens_cached >= 96 && st.cache_hit_ratio > 0, "stats: %llu cached", (unsigned long long)st.tokens_cached);
}

/* ---- INT8 dispatch ---- */
static void int8_dispatch(cm384_model *m) {
    printf("INT8 dispatch vs fp32 dispatch on the fixture sequences:\n");
    arena a = {0};
    json ref;
    json_load_file(FIX "/reference.json", &a, &ref);
    cm384_engine *e0 = engine(m, "default", 2, 0, 1, 0), *e1 = engine(m, "default", 2, 0, 1, 1);
    cm384_config c8;
    cm384_config_init(&c8);
    c8.n_workers = 2; c8.int8 = 1; c8.max_ctx = 256;
    cm384_engine *e8 = NULL;
    cm384_engine_create(m, &c8, &e8);
    const json *seqs = json_get(&ref, "sequences");
    int agree = 0, total = 0, agree8 = 0;
    double max_diff = 0, kl8 = 0;
    for (int i = 0; i < seqs->len; i++) {
        const json *tk = json_get(&seqs->kids[i], "tokens");
        int n = tk->len;
        int32_t ids[256];
        for (int t = 0; t < n; t++) ids[t] = (int32_t)tk->kids[t].num;
        float *l0 = malloc(sizeof(float) * n * 1024), *l1 = malloc(sizeof(float) * n * 1024);
        float *l8 = malloc(sizeof(float) * n * 1024);
        cm384_eval(e0, ids, n, l0, NULL);
        cm384_eval(e1, ids, n, l1, NULL);
        cm384_eval(e8, ids, n, l8, NULL);
        int ag = 0;
        for (int t = 0; t < n; t++) {
            int b0 = 0, b1 = 0, b8 = 0;
            for (int v = 1; v < 1024; v++) {
                if (l0[t * 1024 + v] > l0[t * 1024 + b0]) b0 = v;
                if (l1[t * 1024 + v] > l1[t * 1024 + b1]) b1 = v;
                if (l8[t * 1024 + v] > l8[t * 1024 + b8]) b8 = v;
            }
            ag += b0 == b1;
            agree8 += b0 == b8;
            for (int v = 0; v < 1024; v++) max_diff = fmax(max_diff, fabs(l0[t * 1024 + v] - l1[t * 1024 + v]));
            /* KL(fp32 || W8A8) at this position */
            double m0 = -1e30, m8 = -1e30, z0 = 0, z8 = 0, kl = 0;
            for (int v = 0; v < 1024; v++) { m0 = fmax(m0, l0[t * 1024 + v]); m8 = fmax(m8, l8[t * 1024 + v]); }
            for (int v = 0; v < 1024; v++) { z0 += exp(l0[t * 1024 + v] - m0); z8 += exp(l8[t * 1024 + v] - m8); }
            for (int v = 0; v < 1024; v++) {
                double a = l0[t * 1024 + v] - m0 - log(z0), b = l8[t * 1024 + v] - m8 - log(z8);
                kl += exp(a) * (a - b);
            }
            kl8 += kl;
        }
        free(l8);
        printf("  %-12s top-1 agreement %3d/%3d\n", json_str(&seqs->kids[i], "name", ""), ag, n);
        agree += ag; total += n;
        free(l0); free(l1);
    }
    cm384_stats s0, s1;
    s0.struct_size = s1.struct_size = sizeof s0;
    cm384_get_stats(e0, &s0);
    cm384_get_stats(e1, &s1);
    printf("  total %d/%d (%.1f%%), max |logit diff| %.3f; dispatch bytes %.2f MB INT8 vs %.2f MB fp32 (bf16 would be %.2f MB)\n",
           agree, total, 100.0 * agree / total, max_diff, s1.dispatch_bytes / 1e6, s0.dispatch_bytes / 1e6,
           s1.dispatch_bytes_bf16 / 1e6);
    /* measured here: 277/284 (97.5%) -- the fixture's random weights leave
       top-1 margins as small as 1.5e-3, so a few positions flip; the
       threshold leaves room for a few more flips with other kernels */
    CHECK(agree * 100 >= 95 * total, "INT8 dispatch top-1 agreement %d/%d below 95%%", agree, total);
    CHECK(s1.dispatch_bytes * 3 < s0.dispatch_bytes, "INT8 dispatch should send under a third of fp32's bytes");
    printf("  INT8 W8A8 weights vs fp32: top-1 agreement %d/%d (%.1f%%), mean KL %.4f nats per position\n",
           agree8, total, 100.0 * agree8 / total, kl8 / total);
    /* measured here: 265/284 (93.3%), KL 0.017 -- the fixture's random
       64-wide weights are hard on 8 bits (the trained model: 97%, KL 0.006,
       tests/test_model.c); thresholds leave room for other kernels */
    CHECK(agree8 * 100 >= 88 * total && kl8 / total < 0.04, "W8A8: %d/%d, KL %.4f", agree8, total, kl8 / total);
    cm384_engine_free(e0);
    cm384_engine_free(e1);
    cm384_engine_free(e8);
    arena_free(&a);
}

/* ---- pool exhaustion ---- */
static int n_log[3];
static void count_log(void *user, int level, const char *msg) {
    (void)user; (void)msg;
    if (level >= 0 && level < 3) n_log[level]++;
}

static void exhaustion(cm384_model *m) {
    int N = quick ? 40 : 200;
    printf("pool exhaustion: %d requests, pool for about 10 at a time\n", N);
    job *ref = calloc((size_t)N, sizeof *ref), *got = calloc((size_t)N, sizeof *got);
    make_jobs(ref, N, 60, 24);
    for (int i = 0; i < N; i++) { ref[i].n_prompt = 20 + ref[i].n_prompt; for (int t = 1; t < ref[i].n_prompt; t++) ref[i].prompt[t] = 3 + rnd(1000); }
    cm384_engine *e = engine(m, "default", 2, 0, 2, 0);
    reset_outputs(ref, N);
    for (int i = 0; i < N; i++) submit_job(e, &ref[i]);
    cm384_wait_all(e);
    cm384_engine_free(e);
    for (int mtp = 0; mtp < 3; mtp++) {          /* off, gated, every step drafting */
        memcpy(got, ref, (size_t)N * sizeof *got);
        reset_outputs(got, N);
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.int8_dispatch = 0; c.max_ctx = 128; c.kv_block_tokens = 16; c.mtp = mtp;
        c.log = count_log;
        memset(n_log, 0, sizeof n_log);
        size_t block = (size_t)(m->hp.n_layers + m->hp.n_mtp) * 16 * (m->hp.kv_lora + m->hp.qk_rope) * sizeof(float);
        c.kv_pool_bytes = 10 * 6 * block;              /* a request needs up to 6 blocks */
        cm384_engine_create(m, &c, &e);
        for (int i = 0; i < N; i++) submit_job(e, &got[i]);
        cm384_wait_all(e);
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        cm384_engine_free(e);
        int same = 0, finals = 0;
        for (int i = 0; i < N; i++) { same += same_tokens(&got[i], &ref[i]); finals += got[i].finals == 1; }
        printf("  %s%d/%d finished with one final event, %d/%d identical to the unconstrained run; %llu preemptions, "
               "%llu blocks in the pool\n", mtp == 1 ? "with MTP gated: " : mtp == 2 ? "with MTP every step: " : "", finals, N, same, N,
               (unsigned long long)st.requests_preempted, (unsigned long long)st.kv_blocks_total);
        CHECK(finals == N && same == N, "exhaustion: %d finals, %d identical of %d", finals, same, N);
        CHECK(st.requests_done == (uint64_t)N, "stats say %llu done", (unsigned long long)st.requests_done);
        CHECK(n_log[1] == 1 + (int)st.eplb_runs && (uint64_t)n_log[2] == st.requests_preempted,
              "log: %d info, %d warnings for %llu preemptions", n_log[1], n_log[2], (unsigned long long)st.requests_preempted);
    }
    free(ref);
    free(got);
}

/* ---- cancel, concurrent submit, bad requests ---- */
typedef struct { cm384_engine *e; job *jobs; int n; } submitter;

static void *submit_thread(void *arg) {
    submitter *s = arg;
    uint64_t ids[64];
    for (int i = 0; i < s->n; i++) {
        cm384_sampling sp;
        cm384_sampling_init(&sp);
        sp.max_tokens = s->jobs[i].max_tokens;
        cm384_request rq;
        cm384_request_init(&rq);
        rq.ids = s->jobs[i].prompt; rq.n_ids = s->jobs[i].n_prompt; rq.sampling = &sp;
        rq.on_event = on_event; rq.user = &s->jobs[i];
        cm384_submit(s->e, &rq, &ids[i]);
    }
    for (int i = 0; i < s->n; i++) s->jobs[i].status = cm384_wait(s->e, ids[i], -1) == CM384_OK ? CM384_OK : -1;
    return NULL;
}

static void control(cm384_model *m) {
    printf("cancel, concurrent submit, bad requests:\n");
    cm384_engine *e = engine(m, "default", 2, 0, 2, 0);
    /* cancel from the callback */
    job j = {0};
    j.n_prompt = 10; for (int t = 0; t < 10; t++) j.prompt[t] = 5 + t;
    j.max_tokens = 200; j.cancel_after = 5;
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 200; s.ignore_eos = 1;
    cm384_request rq;
    cm384_request_init(&rq);
    rq.ids = j.prompt; rq.n_ids = j.n_prompt; rq.sampling = &s; rq.on_event = on_event; rq.user = &j;
    uint64_t id;
    cm384_submit(e, &rq, &id);
    int st = cm384_wait(e, id, -1);
    printf("  cancelled from its callback after %d tokens: status %s, %d final event\n", j.n_out, cm384_strerror(st), j.finals);
    CHECK(st == CM384_E_CANCELLED && j.finals == 1 && j.status == CM384_E_CANCELLED && j.n_out >= 5 && j.n_out < 200,
          "callback cancel: status %d, %d tokens", st, j.n_out);
    CHECK(cm384_wait(e, id, 0) == CM384_E_NOT_FOUND, "a finished request's result is taken once");
    CHECK(cm384_cancel(e, id) == CM384_E_NOT_FOUND, "cancel of a finished request");
    /* cancel from another thread while it streams */
    job k = j;
    k.cancel_after = 0; k.n_out = 0; k.finals = 0;
    rq.user = &k;
    cm384_submit(e, &rq, &id);
    while (1) {
        pthread_mutex_lock(&e->mu);
        int live = 0;
        for (int i = 0; i < e->sched->n_live; i++) if (e->sched->live[i]->id == id) live = 1;
        pthread_mutex_unlock(&e->mu);
        if (!live) break;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        if (cm384_cancel(e, id) == CM384_OK) break;
    }
    st = cm384_wait(e, id, -1);
    printf("  cancelled by cm384_cancel: status %s after %d tokens\n", cm384_strerror(st), k.n_out);
    CHECK(st == CM384_E_CANCELLED && k.finals == 1, "cm384_cancel: status %d, %d finals", st, k.finals);
    /* bad requests fail alone */
    int32_t bad[3] = {0, 5000, 7};
    rq.ids = bad; rq.n_ids = 3; rq.user = &j;
    CHECK(cm384_submit(e, &rq, NULL) == CM384_E_INVALID, "unknown token id accepted");
    static int32_t longp[600];
    rq.ids = longp; rq.n_ids = 600;
    CHECK(cm384_submit(e, &rq, NULL) == CM384_E_CAPACITY, "a prompt longer than the context accepted");
    rq.ids = NULL; rq.n_ids = 0;
    CHECK(cm384_submit(e, &rq, NULL) == CM384_E_INVALID, "an empty request accepted");
    /* submit from four threads at once */
    int T = 4, per = quick ? 4 : 12;
    job *jobs = calloc((size_t)(T * per), sizeof *jobs), *ref = calloc((size_t)(T * per), sizeof *ref);
    make_jobs(ref, T * per, 80, 16);
    reset_outputs(ref, T * per);
    cm384_engine *e1 = engine(m, "single", 1, 0, 1, 0);
    for (int i = 0; i < T * per; i++) { submit_job(e1, &ref[i]); cm384_wait_all(e1); }
    cm384_engine_free(e1);
    memcpy(jobs, ref, (size_t)(T * per) * sizeof *jobs);
    reset_outputs(jobs, T * per);
    pthread_t th[4];
    submitter sub[4];
    for (int t = 0; t < T; t++) { sub[t] = (submitter){e, jobs + t * per, per}; pthread_create(&th[t], NULL, submit_thread, &sub[t]); }
    for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
    int same = 0;
    for (int i = 0; i < T * per; i++) { jobs[i].status = jobs[i].status; same += jobs[i].n_out == ref[i].n_out && !memcmp(jobs[i].out, ref[i].out, sizeof ref[i].out); }
    printf("  %d threads x %d requests: %d/%d identical to one-at-a-time runs\n", T, per, same, T * per);
    CHECK(same == T * per, "concurrent submit: %d/%d identical", same, T * per);
    /* the engine still works, and frees cleanly with requests in flight */
    job last = ref[0];
    reset_outputs(&last, 1);
    submit_job(e, &last);
    job *inflight = calloc(8, sizeof *inflight);
    for (int i = 0; i < 8; i++) { inflight[i] = ref[i]; inflight[i].max_tokens = 30; reset_outputs(&inflight[i], 1); submit_job(e, &inflight[i]); }
    cm384_engine_free(e);            /* cancels what is running; each gets its final event */
    int finals = 0;
    for (int i = 0; i < 8; i++) finals += inflight[i].finals == 1;
    printf("  engine freed with requests in flight: %d/8 got exactly one final event\n", finals);
    CHECK(finals == 8, "requests in flight at engine_free: %d/8 final events", finals);
    free(inflight);
    free(jobs);
    free(ref);
}

/* ---- the Chrome trace parses back, one track per device ---- */
static void trace(cm384_model *m) {
    printf("trace:\n");
    char path[] = "/tmp/cm384-trace-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) { CHECK(0, "mkstemp"); return; }
    close(fd);
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.max_ctx = 256; c.trace_path = path;
    cm384_engine *e;
    CHECK(cm384_engine_create(m, &c, &e) == CM384_OK, "engine with trace: %s", cm384_last_error());
    job jobs[4];
    make_jobs(jobs, 4, 40, 8);
    reset_outputs(jobs, 4);
    for (int i = 0; i < 4; i++) submit_job(e, &jobs[i]);
    cm384_wait_all(e);
    cm384_engine_free(e);
    arena a = {0};
    json t;
    int r = json_load_file(path, &a, &t);
    CHECK(r == CM384_OK, "trace is not valid JSON: %s", cm384_last_error());
    const json *ev = json_get(&t, "traceEvents");
    int n_x = 0, bad = 0, tids[400] = {0}, n_tids = 0, names = 0;
    const char *want[] = {"attention", "moe", "dispatch", "experts", "combine", "head"};
    int seen[6] = {0};
    for (int i = 0; ev && i < ev->len; i++) {
        const json *x = &ev->kids[i];
        if (strcmp(json_str(x, "ph", ""), "X")) continue;
        n_x++;
        if (!json_is_num(json_get(x, "ts")) || !json_is_num(json_get(x, "dur")) || json_num(x, "dur", -1) < 0) bad++;
        int tid = (int)json_num(x, "tid", -1);
        if (tid >= 0 && tid < 400 && !tids[tid]) { tids[tid] = 1; n_tids++; }
        for (int k = 0; k < 6; k++) if (!strcmp(json_str(x, "name", ""), want[k])) seen[k] = 1;
    }
    for (int k = 0; k < 6; k++) names += seen[k];
    printf("  %d complete events on %d device tracks, %d/6 phase names, %d malformed\n", n_x, n_tids, names, bad);
    CHECK(n_x > 100 && bad == 0 && n_tids >= 4 && names == 6, "trace content");
    /* every step span is numbered, each peer's 0, 1, 2, ...; every device
       event names its peer's step and lies inside that step's span */
    enum { MAX_STEPS = 4096 };
    static double span_t0[2][MAX_STEPS], span_t1[2][MAX_STEPS];
    int n_spans[2] = {0, 0}, unnumbered = 0, out_of_order = 0, outside = 0, dev_events = 0, no_op = 0;
    int core_ops = 0, down_ops = 0;   /* "attention"/"core" and "experts"/"down" events */
    for (int i = 0; ev && i < ev->len; i++) {
        const json *x = &ev->kids[i];
        const char *nm = json_str(x, "name", "");
        int p = !strcmp(nm, "decode step") ? 0 : !strcmp(nm, "prefill step") ? 1 : -1;
        if (p < 0) continue;
        double st = json_num(json_get(x, "args"), "step", -1);
        if (st < 0) { unnumbered++; continue; }
        if ((int)st != n_spans[p] || n_spans[p] == MAX_STEPS) { out_of_order++; continue; }
        span_t0[p][n_spans[p]] = json_num(x, "ts", 0);
        span_t1[p][n_spans[p]++] = json_num(x, "ts", 0) + json_num(x, "dur", 0);
    }
    for (int i = 0; ev && i < ev->len; i++) {
        const json *x = &ev->kids[i], *args = json_get(x, "args");
        if (strcmp(json_str(x, "ph", ""), "X") || !json_get(args, "layer")) continue;
        dev_events++;
        /* each names its stage: the trace tells the core from the products */
        const char *op = json_str(args, "op", ""), *nm = json_str(x, "name", "");
        if (!*op) no_op++;
        core_ops += !strcmp(nm, "attention") && !strcmp(op, "core");
        down_ops += !strcmp(nm, "experts") && !strcmp(op, "down");
        const char *peer = json_str(args, "peer", "");
        int p = !strcmp(peer, "decode") ? 0 : !strcmp(peer, "prefill") ? 1 : -1, st = (int)json_num(args, "step", -1);
        if (p < 0 || st < 0 || st >= n_spans[p]) { unnumbered++; continue; }
        double t0 = json_num(x, "ts", 0), t1 = t0 + json_num(x, "dur", 0);
        if (t0 < span_t0[p][st] - 0.01 || t1 > span_t1[p][st] + 0.01) outside++;
    }
    printf("  %d decode and %d prefill step spans; of %d device events %d unnumbered, %d outside their step; %d spans out of order\n",
           n_spans[0], n_spans[1], dev_events, unnumbered, outside, out_of_order);
    CHECK(n_spans[0] >= 4 && n_spans[1] >= 1 && dev_events > 100 && unnumbered == 0 && outside == 0 && out_of_order == 0,
          "trace steps");
    printf("  stages: %d device events without one, %d attention core and %d expert down-projection events\n", no_op,
           core_ops, down_ops);
    CHECK(no_op == 0 && core_ops > 0 && down_ops > 0, "every device event names its stage");
    arena_free(&a);
    unlink(path);
}

/* The MTP gate defers the MTP layer's rows while it is not drafting; a block
 * must still reach the context cache whole.  Two engines run the same
 * request, one drafting every step, one gated on a clock where drafting
 * never pays: every block the gated engine cached holds the same MTP rows. */
static double never_pays(void *user, int rows, int requests, int mtp) { (void)user; return mtp ? requests : rows; }

static void mtp_gate_cache(cm384_model *m) {
    float *rows[2] = {NULL, NULL};
    int *cached = NULL, n_cached = 0, first_block = -1;
    uint64_t drafted[2] = {0, 0};
    for (int k = 0; k < 2; k++) {                 /* 0: every step drafts, 1: gated */
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.max_ctx = 256; c.mtp = k ? 1 : 2;
        cm384_engine *e;
        if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); break; }
        e->dbg_step_ms = never_pays;
        int32_t prompt[20];
        for (int i = 0; i < 20; i++) prompt[i] = 2 + (i * 37) % 1000;
        cm384_sampling s;
        cm384_sampling_init(&s);
        s.max_tokens = 100; s.ignore_eos = 1;
        int r = cm384_generate(e, NULL, prompt, 20, &s, NULL, NULL);
        CHECK(r == CM384_OK, "generate: %s", cm384_strerror(r));
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        drafted[k] = st.mtp_drafted;
        const kv_pool *kv = &e->kv;
        size_t bf = kv->block_bytes / sizeof(float);          /* an fp32 cache */
        int l = m->hp.n_layers, B = kv->block_tokens, row = kv->row;
        rows[k] = malloc(sizeof(float) * bf * (size_t)kv->n_blocks);
        memcpy(rows[k], kv->data, sizeof(float) * bf * (size_t)kv->n_blocks);
        if (k) {
            cached = malloc(sizeof(int) * (size_t)e->index_cap);
            for (int i = 0; i < e->index_cap; i++) if (e->index[i] >= 0) cached[n_cached++] = e->index[i];
            /* the block holding the prompt's first tokens: its slot 0 is no
               MTP row (an MTP layer's position p sits in slot p + 1), never
               written by either engine, so it is not compared */
            for (int i = 0; i < n_cached; i++)
                if (B <= 20 && !memcmp(e->bm[cached[i]].tokens, prompt, sizeof(int32_t) * (size_t)B)) first_block = cached[i];
        }
        cm384_engine_free(e);
        if (!k) continue;
        int same = 0;
        for (int i = 0; i < n_cached; i++) {
            int skip = cached[i] == first_block;
            size_t at = (size_t)cached[i] * bf + ((size_t)l * B + (size_t)skip) * row;
            same += !memcmp(rows[0] + at, rows[1] + at, sizeof(float) * (size_t)(B - skip) * row);
        }
        printf("MTP gate and the context cache: %d of %d cached blocks hold the MTP rows of an engine drafting every "
               "step (drafted steps: gated %llu, every step %llu)\n", same, n_cached, (unsigned long long)drafted[1],
               (unsigned long long)drafted[0]);
        CHECK(n_cached >= 6 && same == n_cached && first_block >= 0, "%d of %d cached blocks have their MTP rows", same,
              n_cached);
        CHECK(drafted[1] * 4 < drafted[0], "the gate drafted %llu steps of %llu", (unsigned long long)drafted[1],
              (unsigned long long)drafted[0]);
    }
    free(rows[0]); free(rows[1]); free(cached);
}

TEST_MAIN(engine) {
    quick = getenv("CM384_QUICK") != NULL;
    /* the fixture with a longer context */
    char dir[] = "/tmp/cm384-test-engine-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    const char *files[] = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char src[256], dst[256];
        snprintf(src, sizeof src, FIX "/%s", files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        file_map f;
        if (file_map_open(&f, src, 0)) { printf("%s\n", cm384_last_error()); return 1; }
        FILE *o = fopen(dst, "wb");
        const char *from = "\"max_position_embeddings\": 256";
        char *at = i == 0 ? strstr((char *)f.data, from) : NULL;
        if (at) {
            fwrite(f.data, 1, (size_t)(at - (char *)f.data), o);
            fputs("\"max_position_embeddings\": 1024", o);
            fwrite(at + strlen(from), 1, f.size - (size_t)(at - (char *)f.data) - strlen(from), o);
        } else {
            fwrite(f.data, 1, f.size, o);
        }
        fclose(o);
        file_map_close(&f);
    }
    cm384_model *m;
    if (cm384_model_load(dir, NULL, &m)) { printf("load: %s\n", cm384_last_error()); return 1; }
    mtp_gate_cache(m);
    exactness(m);
    sampled(m);
    caching(m);
    if (!quick) int8_dispatch(m);
    exhaustion(m);
    prefaulted(m);
    profiled(m);
    roofline(m);
    control(m);
    trace(m);
    cm384_model_free(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {}
    return test_summary("engine");
}

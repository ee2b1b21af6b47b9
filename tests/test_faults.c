/* test_faults.c -- a device dies, the supernode recovers, and no request
 * notices: its tokens are those of a run without faults.
 *
 *   roles     64 concurrent requests (greedy and seeded sampling, shared
 *             prefixes) with an expert, an attention, a prefill and the
 *             caching device failed, and a link fault, at fixed step counts:
 *             tokens identical to the fault-free run, one final event each,
 *             and the stats and fault records say what was recomputed;
 *   random    the paper preset (with MTP) under faults on random devices at
 *             random steps, several seeds;
 *   fatal     every attention device dead: the pending requests end with
 *             CM384_EV_ERROR / CM384_E_DEVICE, the finished ones stay done,
 *             submissions and eval are refused;
 *   api       bad devices and kinds, a device failed twice, a fault whose
 *             step never comes; cm384_fail_device while requests run.
 *
 * Faults are placed by step count (cm384_fail_device_at), never by time.
 * CM384_QUICK=1 runs fewer seeds. */
#include "../cm384.c"
#include "test.h"

#define FT_FIX "tests/fixtures/tiny-dsv3"
#define FT_REQ 64
#define FT_OUT 20

typedef struct ft_req {
    int32_t toks[FT_OUT + 8];
    int     n, finals, last_kind, last_status;
} ft_req;

static int ft_event(void *user, const cm384_event *ev) {
    ft_req *q = user;
    if (ev->kind == CM384_EV_TOKEN) { if (q->n < FT_OUT + 8) q->toks[q->n++] = ev->token; }
    else { q->finals++; q->last_kind = ev->kind; q->last_status = ev->status; }
    return 0;
}

static int ft_log_faults;
static void ft_log(void *user, int level, const char *msg) {
    (void)user; (void)level;
    if (!strncmp(msg, "fault", 5)) ft_log_faults++;
}

static cm384_engine *ft_engine(cm384_model *m, const char *preset, int mtp, const char *trace) {
    cm384_config c;
    cm384_config_init(&c);
    c.preset = preset; c.n_workers = 2; c.max_ctx = 160; c.mtp = mtp; c.max_batch = 24;
    c.trace_path = trace; c.log = ft_log;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

/* 64 requests: four tenants' shared prefixes, then their own tokens; even
 * ones greedy, odd ones sampled with their own seed. */
static void ft_submit_all(cm384_engine *e, ft_req *q, uint64_t *ids) {
    for (int i = 0; i < FT_REQ; i++) {
        int32_t p[80];
        int n = 24 + (i * 7) % 40;
        for (int k = 0; k < n; k++) p[k] = k < 16 ? 3 + ((i % 4) * 131 + k * 17) % 1000 : 3 + (i * 53 + k * 29) % 1000;
        static cm384_sampling s[2];
        cm384_sampling_init(&s[0]);
        s[0].max_tokens = FT_OUT; s[0].ignore_eos = 1;
        s[1] = s[0];
        s[1].temperature = 0.9f; s[1].top_p = 0.95f;
        cm384_sampling si = s[i & 1];
        if (i & 1) si.seed = 1000 + (uint64_t)i;
        memset(&q[i], 0, sizeof q[i]);
        cm384_request r;
        cm384_request_init(&r);
        r.ids = p; r.n_ids = n; r.sampling = &si; r.on_event = ft_event; r.user = &q[i];
        if (cm384_submit(e, &r, &ids[i])) printf("  submit: %s\n", cm384_last_error());
    }
}

static void ft_run(cm384_engine *e, ft_req *q) {
    uint64_t ids[FT_REQ];
    ft_submit_all(e, q, ids);
    cm384_wait_all(e);
}

/* Every request: one final event, DONE, and the reference's tokens. */
static int ft_same(const ft_req *ref, const ft_req *q, const char *what) {
    int bad = 0, first = -1;
    for (int i = 0; i < FT_REQ; i++) {
        int ok = q[i].finals == 1 && q[i].last_kind == CM384_EV_DONE && q[i].n == ref[i].n &&
                 !memcmp(q[i].toks, ref[i].toks, (size_t)ref[i].n * sizeof(int32_t));
        if (!ok) { bad++; if (first < 0) first = i; }
    }
    CHECK(bad == 0, "%s: %d of %d requests differ from the fault-free run (first: %d, %d tokens, %d final events)", what,
          bad, FT_REQ, first, first >= 0 ? q[first].n : 0, first >= 0 ? q[first].finals : 0);
    return bad == 0;
}

/* An attention device that holds no routed expert (the paper preset's
 * attention devices are its expert devices too, but for the shared ones). */
static int ft_attention_only(cm384_engine *e) {
    for (int i = 0; i < e->n_attn; i++) {
        int d = e->attn_devs[i], is_exp = 0;
        for (int k = 0; k < e->n_exp_devs; k++) is_exp |= e->exp_devs[k] == d;
        if (!is_exp) return d;
    }
    return e->attn_devs[0];
}

static void ft_roles(cm384_model *m, const char *preset, const ft_req *ref) {
    cm384_engine *e = ft_engine(m, preset, 0, "build/faults_trace.json");
    if (!e) { CHECK(0, "engine"); return; }
    int exp = e->exp_devs[0], attn = ft_attention_only(e), pre = e->pre_devs[0], cache = e->cache_dev, link = e->exp_devs[1];
    CHECK(exp != attn && exp != pre && attn != pre && cache != exp, "%s: distinct devices for the roles", preset);
    ft_log_faults = 0;
    CHECK(!cm384_fail_device_at(e, exp, CM384_FAULT_DEVICE, 6), "schedule expert");
    CHECK(!cm384_fail_device_at(e, link, CM384_FAULT_LINK, 9), "schedule link");
    CHECK(!cm384_fail_device_at(e, attn, CM384_FAULT_DEVICE, 14), "schedule attention");
    CHECK(!cm384_fail_device_at(e, pre, CM384_FAULT_DEVICE, 3), "schedule prefill");
    CHECK(!cm384_fail_device_at(e, cache, CM384_FAULT_DEVICE, 20), "schedule caching");
    ft_req q[FT_REQ];
    ft_run(e, q);
    ft_same(ref, q, preset);
    cm384_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    cm384_fault_info fi[8];
    for (int i = 0; i < 8; i++) fi[i].struct_size = sizeof fi[i];
    int nf = cm384_get_faults(e, fi, 8);
    CHECK(nf == 5 && st.n_faults == 5 && st.n_failed_devices == 4, "%s: 5 faults, 4 dead devices (got %d, %llu, %d)",
          preset, nf, (unsigned long long)st.n_faults, st.n_failed_devices);
    int seen_attn = 0, seen_pre = 0, seen_exp = 0, seen_link = 0, seen_cache = 0, open = 0;
    for (int i = 0; i < nf && i < 8; i++) {
        printf("  %s: fault %d: %s %d (%s) at step %llu: %d re-admitted, %llu recomputed, %d experts re-placed, "
               "%d failed over, %llu messages retried, recovered in %.2f ms\n", preset, i,
               fi[i].kind == CM384_FAULT_LINK ? "link" : "device", fi[i].device, fi[i].roles,
               (unsigned long long)fi[i].step, fi[i].requests_readmitted, (unsigned long long)fi[i].tokens_recomputed,
               fi[i].experts_replaced, fi[i].experts_failed_over, (unsigned long long)fi[i].messages_retried,
               fi[i].recovery_ms);
        open += fi[i].recovery_ms < 0 || fi[i].fatal;
        if (fi[i].device == attn && fi[i].kind == CM384_FAULT_DEVICE)
            seen_attn = fi[i].requests_readmitted > 0 && fi[i].tokens_recomputed > 0;
        if (fi[i].device == pre) seen_pre = 1;
        if (fi[i].device == exp) seen_exp = fi[i].experts_replaced + fi[i].experts_failed_over > 0;
        if (fi[i].device == link && fi[i].kind == CM384_FAULT_LINK) seen_link = fi[i].messages_retried > 0;
        if (fi[i].device == cache) seen_cache = strstr(fi[i].roles, "caching") != NULL;
    }
    CHECK(open == 0, "%s: every fault recovered, none fatal", preset);
    CHECK(seen_attn, "%s: the attention device's requests were re-admitted and recomputed", preset);
    CHECK(seen_pre && seen_cache, "%s: the prefill and caching faults are recorded with their roles", preset);
    CHECK(seen_exp, "%s: the expert device's experts moved", preset);
    CHECK(seen_link, "%s: the link fault's dropped messages were found and sent again", preset);
    CHECK(st.requests_readmitted > 0 && st.tokens_recomputed > 0 && st.messages_retried > 0,
          "%s: stats count re-admissions (%llu), recomputed tokens (%llu), retried messages (%llu)", preset,
          (unsigned long long)st.requests_readmitted, (unsigned long long)st.tokens_recomputed,
          (unsigned long long)st.messages_retried);
    CHECK(st.requests_done == FT_REQ && st.requests_failed == 0, "%s: %llu done, %llu failed", preset,
          (unsigned long long)st.requests_done, (unsigned long long)st.requests_failed);
    CHECK(ft_log_faults >= 10, "%s: each fault and its recovery logged (%d lines)", preset, ft_log_faults);
    /* the dead devices hold nothing now */
    int holds = 0;
    for (int l = 0; l < e->m->hp.n_layers; l++) {
        const placement *p = &e->place[PHASE_DECODE];
        for (int i = 0; i < p->n_entries; i++) {
            int d = pl_dev(p, l)[i];
            holds += d >= 0 && e->dev[d].failed && e->m->layers[l].is_moe;
        }
        const placement *pp = &e->place[PHASE_PREFILL];
        for (int i = 0; i < pp->n_entries; i++) { int d = pl_dev(pp, l)[i]; holds += d >= 0 && e->dev[d].failed; }
    }
    CHECK(holds == 0, "%s: no expert placement points at a dead device (%d entries do)", preset, holds);
    CHECK(!strcmp(cm384_device_roles(e, exp), "failed") && e->cache_dev != cache && (e->dev[e->cache_dev].roles & ROLE_CACHE),
          "%s: dead devices say so; another device holds the cache", preset);
    char rep[8192];
    cm384_report(e, rep, sizeof rep);
    CHECK(strstr(rep, "faults: 5") != NULL, "%s: the report has a faults line", preset);
    cm384_engine_free(e);
    FILE *f = fopen("build/faults_trace.json", "rb");
    int traced = 0;
    if (f) {
        char *buf = malloc(1 << 24);
        size_t n = buf ? fread(buf, 1, (1 << 24) - 1, f) : 0;
        if (buf) { buf[n] = 0; traced = strstr(buf, "fault: recovery") != NULL && strstr(buf, "link fault: retried") != NULL; }
        free(buf);
        fclose(f);
    }
    CHECK(traced, "%s: the trace shows the faults' recoveries on their devices", preset);
}

/* Random devices with a role, at random steps. */
static void ft_random(cm384_model *m, const ft_req *ref_mtp, int seeds) {
    for (int seed = 1; seed <= seeds; seed++) {
        cm384_engine *e = ft_engine(m, "paper", seed % 2 ? 1 : 2, NULL);   /* MTP gated, or every step drafting */
        if (!e) { CHECK(0, "engine"); return; }
        uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)seed;
        int n_faults = 3 + seed % 3, scheduled = 0;
        for (int k = 0; k < n_faults; k++) {
            int d, tries = 0;
            do {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                d = (int)((rng >> 33) % (uint64_t)e->n_dev);
            } while ((!e->dev[d].roles || (e->dev[d].roles & (ROLE_PREFILL | ROLE_ATTN))) && ++tries < 10000);
            /* a prefill or attention device at most once each: two remain */
            if (k == 0) d = e->pre_devs[seed % e->n_pre];
            if (k == 1) d = e->attn_devs[(seed * 5) % e->n_attn];
            int kind = k == 2 && seed % 2 ? CM384_FAULT_LINK : CM384_FAULT_DEVICE;
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            uint64_t step = 1 + (rng >> 33) % 30;
            if (!cm384_fail_device_at(e, d, kind, step)) scheduled++;
        }
        ft_req q[FT_REQ];
        ft_run(e, q);
        char what[64];
        snprintf(what, sizeof what, "paper + MTP, seed %d", seed);
        int same = ft_same(ref_mtp, q, what);
        cm384_fault_info fi[8];
        for (int i = 0; i < 8; i++) fi[i].struct_size = sizeof fi[i];
        int nf = cm384_get_faults(e, fi, 8), open = 0;
        for (int i = 0; i < nf && i < 8; i++) {
            open += fi[i].recovery_ms < 0;
            if (!same || getenv("CM384_FAULTS_VERBOSE"))
                printf("    %s: %s %d (%s) at step %llu: %d re-admitted, %llu recomputed, %d re-placed, %d failed over, "
                       "%llu retried\n", what, fi[i].kind == CM384_FAULT_LINK ? "link" : "device", fi[i].device,
                       fi[i].roles, (unsigned long long)fi[i].step, fi[i].requests_readmitted,
                       (unsigned long long)fi[i].tokens_recomputed, fi[i].experts_replaced, fi[i].experts_failed_over,
                       (unsigned long long)fi[i].messages_retried);
        }
        CHECK(nf >= 1 && open == 0, "%s: %d faults hit (%d scheduled), %d not recovered", what, nf, scheduled, open);
        cm384_engine_free(e);
    }
}

static void ft_fatal(cm384_model *m, const ft_req *ref) {
    cm384_engine *e = ft_engine(m, "default", 0, NULL);
    if (!e) { CHECK(0, "engine"); return; }
    for (int i = 0; i < e->n_attn; i++) cm384_fail_device_at(e, e->attn_devs[i], CM384_FAULT_DEVICE, 12 + (uint64_t)i);
    ft_req q[FT_REQ];
    ft_run(e, q);
    int one = 1, errors = 0, done_same = 0, other = 0;
    for (int i = 0; i < FT_REQ; i++) {
        one &= q[i].finals == 1;
        if (q[i].last_kind == CM384_EV_ERROR && q[i].last_status == CM384_E_DEVICE) errors++;
        else if (q[i].last_kind == CM384_EV_DONE)
            done_same += q[i].n == ref[i].n && !memcmp(q[i].toks, ref[i].toks, (size_t)ref[i].n * sizeof(int32_t));
        else other++;
    }
    CHECK(one, "fatal: every request has exactly one final event");
    CHECK(errors > 0 && other == 0 && errors + done_same == FT_REQ,
          "fatal: %d end with CM384_E_DEVICE, %d done (with the reference's tokens), %d otherwise", errors, done_same, other);
    int32_t ids[4] = {0, 5, 6, 7};
    uint64_t id;
    cm384_request r;
    cm384_request_init(&r);
    r.ids = ids; r.n_ids = 4;
    CHECK(cm384_submit(e, &r, &id) == CM384_E_DEVICE && strstr(cm384_last_error(), "attention"),
          "fatal: a later submission is refused, naming the role (%s)", cm384_last_error());
    float *lg = malloc(sizeof(float) * 4 * (size_t)cm384_vocab_size(m));
    CHECK(cm384_eval(e, ids, 4, lg, NULL) == CM384_E_DEVICE, "fatal: eval is refused too");
    free(lg);
    cm384_fault_info fi[4];
    for (int i = 0; i < 4; i++) fi[i].struct_size = sizeof fi[i];
    int nf = cm384_get_faults(e, fi, 4);
    CHECK(nf == 2 && fi[1].fatal && !fi[0].fatal, "fatal: the second fault is the fatal one (%d faults)", nf);
    cm384_engine_free(e);
}

static void ft_api(cm384_model *m, const ft_req *ref) {
    cm384_engine *e = ft_engine(m, "default", 0, NULL);
    if (!e) { CHECK(0, "engine"); return; }
    CHECK(cm384_fail_device(NULL, 0, 0) == CM384_E_INVALID, "NULL engine");
    CHECK(cm384_fail_device(e, -1, 0) == CM384_E_INVALID && cm384_fail_device(e, e->n_dev, 0) == CM384_E_INVALID,
          "devices out of range");
    CHECK(cm384_fail_device(e, 0, 7) == CM384_E_INVALID && strstr(cm384_last_error(), "kind"), "unknown kind");
    CHECK(cm384_get_faults(e, NULL, 3) == CM384_E_INVALID && cm384_get_faults(e, NULL, 0) == 0, "get_faults arguments");
    CHECK(!cm384_fail_device_at(e, e->exp_devs[3], CM384_FAULT_DEVICE, 1000000), "a fault far in the future");
    /* a fault now, while requests run: applied at the next step boundary,
       wherever that falls, and the tokens do not change */
    ft_req q[FT_REQ];
    uint64_t ids[FT_REQ];
    ft_submit_all(e, q, ids);
    cm384_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    for (int k = 0; k < 2000 && !st.tokens_decoded; k++) {    /* some decoding has happened (or it is over) */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        cm384_get_stats(e, &st);
    }
    CHECK(!cm384_fail_device(e, e->attn_devs[1], CM384_FAULT_DEVICE), "fail an attention device now");
    cm384_wait_all(e);
    ft_same(ref, q, "a fault mid-run");
    cm384_fault_info fi[4];
    for (int i = 0; i < 4; i++) fi[i].struct_size = sizeof fi[i];
    /* every request may have ended before the fault was asked for (a loaded
       machine, a fast decode): then an idle peer loop applies it, on its own
       thread, after cm384_wait_all has returned -- wait for that */
    int nf = cm384_get_faults(e, fi, 4);
    for (int k = 0; k < 20000 && nf == 0; k++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        nf = cm384_get_faults(e, fi, 4);
    }
    CHECK(nf == 1, "the fault asked for now was not applied (%d faults)", nf);
    CHECK(cm384_fail_device(e, fi[0].device, CM384_FAULT_DEVICE) == CM384_E_MISUSE, "a dead device cannot fail again");
    /* an old caller's smaller record */
    cm384_fault_info small;
    memset(&small, 0xab, sizeof small);
    small.struct_size = offsetof(cm384_fault_info, roles);
    CHECK(cm384_get_faults(e, &small, 1) == 1 && small.device == fi[0].device && (unsigned char)small.roles[0] == 0xab,
          "struct_size is honoured");
    cm384_engine_free(e);
}

TEST_MAIN(faults) {
    int quick = getenv("CM384_QUICK") != NULL;
    cm384_model *m;
    if (cm384_model_load(FT_FIX, NULL, &m)) { printf("%s\n", cm384_last_error()); return 1; }
    /* the fault-free references: the default preset (exact), and the paper
       preset (INT8 dispatch, BF16 combine: its own numbers), which MTP
       must not change */
    ft_req *ref = calloc(FT_REQ, sizeof *ref), *ref_paper = calloc(FT_REQ, sizeof *ref), *ref_mtp = calloc(FT_REQ, sizeof *ref);
    cm384_engine *e = ft_engine(m, "default", 0, NULL);
    ft_run(e, ref);
    cm384_engine_free(e);
    e = ft_engine(m, "paper", 0, NULL);
    ft_run(e, ref_paper);
    cm384_engine_free(e);
    e = ft_engine(m, "paper", 2, NULL);
    ft_run(e, ref_mtp);
    cm384_engine_free(e);
    int ok = 1;
    for (int i = 0; i < FT_REQ; i++) ok &= ref[i].finals == 1 && ref[i].n == FT_OUT && ref_paper[i].n == FT_OUT;
    CHECK(ok, "the fault-free runs finish every request");
    ft_same(ref_paper, ref_mtp, "paper + MTP against paper");
    ft_roles(m, "default", ref);
    if (!quick) ft_roles(m, "paper", ref_paper);
    ft_random(m, ref_mtp, quick ? 2 : 6);
    ft_fatal(m, ref);
    ft_api(m, ref);
    free(ref); free(ref_paper); free(ref_mtp);
    cm384_model_free(m);
    return test_summary("faults");
}

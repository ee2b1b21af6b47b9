/* test_slo.c -- the SLO controller picks the largest decode batch whose p99
 * time per output token stays under the target.  A request's TPOT is the
 * mean over its tokens (as the paper's), so the p99 checked is over windows
 * of consecutive cycles as long as a request runs.
 *
 * The controller is fed step times from a synthetic machine (a known cost
 * per step plus deterministic noise), never the wall clock, so the test is
 * the same on a loaded CI machine.  For each case: after a warm-up, the
 * measured p99 TPOT stays under the target, and the batch it settled on is
 * the largest the machine allows (or one less: the p99 factor is an
 * estimate). */
#include "../cm384.c"
#include "test.h"

typedef struct slo_machine {
    double a, b, c, d;          /* t = a + b*batch + c*batch*ctx/1000 + d*prefill/1000 (ms) */
    double noise;               /* relative, uniform in [-noise, +noise]                    */
    uint64_t rng;
} slo_machine;

static double slo_noise(slo_machine *m) {
    m->rng = m->rng * 6364136223846793005ull + 1442695040888963407ull;
    double u = (double)(m->rng >> 11) / 9007199254740992.0;
    return 1 + m->noise * (2 * u - 1);
}

static double slo_true_time(const slo_machine *m, int batch, double ctx, double prefill) {
    return m->a + m->b * batch + m->c * batch * ctx / 1000 + m->d * prefill / 1000;
}

/* The largest batch whose TPOT, with the machine's noise scaled by
 * `margin`, holds the target. */
static int slo_best(const slo_machine *m, double target, double ctx, double prefill, double tpr, int max_batch,
                    double margin) {
    int best = 0;
    for (int b = 1; b <= max_batch; b++)
        if (slo_true_time(m, b, ctx, prefill) * (1 + margin * m->noise) / tpr <= target) best = b;
    return best;
}

#define SLO_REQ_STEPS 32          /* a request's run in the synthetic cases */

/* p99 over the means of every window of w consecutive values (each window
 * one request's run). */
static double slo_p99_windows(const double *v, int n, int w) {
    if (n < w) w = n;
    double *m = malloc(sizeof(double) * (size_t)(n - w + 1)), sum = 0;
    for (int i = 0; i < n; i++) {
        sum += v[i];
        if (i >= w) sum -= v[i - w];
        if (i >= w - 1) m[i - w + 1] = sum / w;
    }
    double p = 0;
    int nw = n - w + 1;
    for (int i = 1; i < nw; i++) { double x = m[i]; int j = i; while (j > 0 && m[j - 1] > x) { m[j] = m[j - 1]; j--; } m[j] = x; }
    int k = (int)ceil(0.99 * nw) - 1;
    p = m[k < 0 ? 0 : k];
    free(m);
    return p;
}

/* Runs `steps` decode cycles with `avail` requests waiting; ctx(step) and
 * prefill(step) give the mean context and the prefill tokens of each step.
 * Returns the p99 TPOT over the steps after `warm` and the final cap. */
static double slo_run(slo_ctl *c, slo_machine *m, int steps, int warm, int avail, int max_batch, double tpr,
                      double ctx0, double ctx1, double prefill, int *final_cap, int *violations) {
    double *tp = malloc(sizeof(double) * (size_t)steps);
    int n = 0;
    *violations = 0;
    for (int s = 0; s < steps; s++) {
        double ctx = ctx0 + (ctx1 - ctx0) * s / (steps > 1 ? steps - 1 : 1);
        int cap = slo_choose(c, ctx, prefill, 0, 0, max_batch);   /* this step's context is known */
        int batch = cap < avail ? cap : avail;
        double t = slo_true_time(m, batch, ctx, prefill) * slo_noise(m);
        slo_observe(c, batch, ctx, prefill, t, tpr);
        if (s >= warm) {
            tp[n++] = t / tpr;
            *violations += t / tpr > c->target_ms;
        }
    }
    double p = slo_p99_windows(tp, n, SLO_REQ_STEPS);
    free(tp);
    *final_cap = c->cap;
    return p;
}

static void slo_case(const char *name, slo_machine m, double target, int max_batch, double tpr, double ctx0, double ctx1,
                     double prefill) {
    slo_ctl c;
    slo_init(&c, target, max_batch);
    int cap, viol;
    double p99 = slo_run(&c, &m, 600, 100, 1000, max_batch, tpr, ctx0, ctx1, prefill, &cap, &viol);
    int best = slo_best(&m, target, ctx1, prefill, tpr, max_batch, 0.5), mean_ok = slo_best(&m, target, ctx1, prefill, tpr, max_batch, 0);
    printf("  %-34s target %5.1f ms: p99 TPOT %6.2f ms (%3d of 500 cycles over), batch %3d (the machine allows %3d to %3d)%s\n",
           name, target, p99, viol, cap, best, mean_ok, c.infeasible ? ", infeasible" : "");
    if (mean_ok == 0) {
        CHECK(c.infeasible && cap == 1, "%s: an infeasible target was not reported (cap %d)", name, cap);
        return;
    }
    CHECK(!c.infeasible, "%s: a feasible target reported infeasible", name);
    CHECK(p99 <= target, "%s: p99 TPOT %.2f ms over the %.1f ms target", name, p99, target);
    CHECK(cap >= best - 1 && cap <= mean_ok, "%s: settled on batch %d, the machine allows %d to %d", name, cap, best, mean_ok);
}

/* ---- in the engine: the scheduler follows the controller ---- */
typedef struct slo_clock {
    slo_machine m;
    int steps, max_batch_run, n_tp;
    double tp[4096];
} slo_clock;

static double slo_virtual_cycle(void *user, int batch, double ctx, double prefill) {
    slo_clock *k = user;
    double t = slo_true_time(&k->m, batch, ctx, prefill) * slo_noise(&k->m);
    if (batch > k->max_batch_run) k->max_batch_run = batch;
    if (k->n_tp < 4096) k->tp[k->n_tp++] = t;
    if (getenv("SLO_TRACE")) printf("    step %3d batch %2d ctx %6.1f t %6.2f\n", k->steps, batch, ctx, t);
    k->steps++;
    return t;
}

typedef struct slo_req { int n; int32_t tok[160]; } slo_req;
static int slo_on_event(void *user, const cm384_event *ev) {
    slo_req *q = user;
    if (ev->kind == CM384_EV_TOKEN && q->n < 160) q->tok[q->n++] = ev->token;
    return 0;
}

static void slo_engine(void) {
    printf("SLO controller in the engine (a virtual clock):\n");
    cm384_model *m;
    if (cm384_model_load("tests/fixtures/tiny-dsv3", NULL, &m)) { CHECK(0, "%s", cm384_last_error()); return; }
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.max_batch = 48; c.max_ctx = 256; c.tpot_target_ms = 10.0;
    c.time_shared = 1;     /* the virtual clock charges prefill inside the decode cycle, as one loop does */
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "%s", cm384_last_error()); cm384_model_free(m); return; }
    slo_clock k = {{1.5, 0.40, 1.0, 0.0, 0.05, 4242}, 0, 0, 0, {0}};
    peers_pause(e);            /* set before the scheduler runs a step */
    e->dbg_cycle_ms = slo_virtual_cycle;
    e->dbg_cycle_user = &k;
    peers_resume(e);
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 150; s.ignore_eos = 1;
    int32_t prompt[8] = {0, 5, 9, 13, 17, 21, 25, 29};
    static slo_req got[40];
    memset(got, 0, sizeof got);
    for (int i = 0; i < 40; i++) {
        cm384_request rq;
        cm384_request_init(&rq);
        rq.ids = prompt; rq.n_ids = 8 - i % 3; rq.sampling = &s; rq.on_event = slo_on_event; rq.user = &got[i];
        cm384_submit(e, &rq, NULL);
    }
    cm384_wait_all(e);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    /* every request ran, and while all 40 were waiting the batch was the controller's */
    int warm = 60, n = k.n_tp - warm;
    double p99 = n > 0 ? slo_p99_windows(k.tp + warm, n, 150) : 0;    /* a request decodes 150 tokens */
    int best = slo_best(&k.m, 10.0, 80, 0, 1.0, 48, 1.0);
    printf("  %d decode steps, largest batch run %d (the machine allows %d at context 80), virtual p99 TPOT %.2f ms, "
           "%llu requests done\n", k.steps, k.max_batch_run, best, p99, (unsigned long long)st.requests_done);
    CHECK(st.requests_done == 40, "%llu of 40 requests done", (unsigned long long)st.requests_done);
    CHECK(n > 100 && p99 <= 10.0, "virtual p99 %.2f ms over the 10 ms target", p99);
    CHECK(k.max_batch_run < 40 && k.max_batch_run >= best - 2, "batches up to %d, the machine allows about %d",
          k.max_batch_run, best);
    CHECK(!st.slo_infeasible && st.decode_batch_cap >= 1, "stats: cap %d, infeasible %d", st.decode_batch_cap, st.slo_infeasible);
    char rep[8192];
    cm384_report(e, rep, sizeof rep);
    CHECK(strstr(rep, "SLO: TPOT target 10.00 ms") != NULL, "the report does not show the SLO");
    cm384_engine_free(e);
    /* the controller only decides when requests run, never what they compute:
       each request's tokens equal the same request alone */
    int same = 0;
    for (int v = 0; v < 3; v++) {
        cm384_config_init(&c);
        c.n_workers = 2; c.preset = "single";
        cm384_engine *e1;
        if (cm384_engine_create(m, &c, &e1)) break;
        slo_req alone = {0, {0}};
        cm384_generate(e1, NULL, prompt, 8 - v, &s, slo_on_event, &alone);
        cm384_engine_free(e1);
        for (int i = v; i < 40; i += 3)
            same += got[i].n == alone.n && alone.n == 150 && !memcmp(got[i].tok, alone.tok, sizeof(int32_t) * 150);
    }
    printf("  %llu preemptions; %d of 40 requests' tokens equal the request alone\n",
           (unsigned long long)st.requests_preempted, same);
    CHECK(st.requests_preempted == 0, "the SLO controller preempted %llu requests (it only holds admission)",
          (unsigned long long)st.requests_preempted);
    CHECK(same == 40, "%d of 40 requests give their lone tokens under the SLO controller", same);
    cm384_model_free(m);
}

TEST_MAIN(slo) {
    printf("SLO controller on synthetic machines (no wall clock):\n");
    /* decode-like: a fixed cost per step (weights), a cost per request and per context token */
    slo_machine m = {2.0, 0.30, 0.60, 0.0, 0.05, 12345};
    slo_case("steady context 500", m, 10.0, 64, 1.0, 500, 500, 0);
    slo_case("steady context 500, tight", m, 4.0, 64, 1.0, 500, 500, 0);
    slo_case("steady, batch capped by config", m, 50.0, 16, 1.0, 500, 500, 0);
    slo_case("context grows 200 -> 2000", m, 12.0, 64, 1.0, 200, 2000, 0);
    slo_case("MTP: 1.7 tokens per step", m, 10.0, 64, 1.7, 500, 500, 0);
    slo_machine mp = {2.0, 0.30, 0.60, 4.0, 0.05, 777};
    slo_case("prefill 1000 tokens per cycle", mp, 15.0, 64, 1.0, 500, 500, 1000);
    slo_case("infeasible: below one request", m, 1.5, 64, 1.0, 500, 500, 0);
    /* noisier machine */
    slo_machine mn = {3.0, 0.50, 0.40, 0.0, 0.20, 99};
    slo_case("20% noise", mn, 20.0, 128, 1.0, 800, 800, 0);
    slo_engine();
    return test_summary("slo");
}

/* test_peers.c -- the supernode as a machine, not a ledger.
 *
 *   fabric      the UB counters equal the bytes the dispatch and combine
 *               copies wrote, computed here from the routing counts and the
 *               placement; a device writing to itself is local, never
 *               fabric; the KV hand-off is on the RDMA plane;
 *   bf16        BF16 combine halves the combine bytes and stays close to
 *               the exact answer (measured on the fixture sequences).
 *
 * The model is the tiny-dsv3 fixture.  CM384_QUICK=1 runs less. */
#include "../cm384.c"
#include "test.h"
#include <sys/wait.h>
#undef DIR                 /* test_model.c names its folder so; here it is dirent's */

#define PE_FIX "tests/fixtures/tiny-dsv3"

static int pe_quick;

static cm384_engine *pe_make(cm384_model *m, const char *preset, int workers, int int8_dispatch, int bf16_combine) {
    cm384_config c;
    cm384_config_init(&c);
    c.preset = preset; c.n_workers = workers; c.int8_dispatch = int8_dispatch; c.bf16_combine = bf16_combine;
    c.max_ctx = 256;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

static void pe_one_request(cm384_engine *e, int n_prompt, int n_out) {
    int32_t ids[200];
    for (int i = 0; i < n_prompt; i++) ids[i] = i ? 3 + (i * 37) % 1000 : 0;
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = n_out; s.ignore_eos = 1;
    cm384_generate(e, NULL, ids, n_prompt, &s, NULL, NULL);
}

/* What the copies must have written, from the routing counts: a request
 * alone is prefilled on the first prefill device and decoded on the first
 * attention device; every (token, expert) pair is one message there and one
 * back. */
static void pe_fabric_expect(cm384_engine *e, uint64_t msg, uint64_t back, uint64_t *want, uint64_t *local) {
    const hparams *hp = &e->m->hp;
    int E = hp->n_routed, NL = hp->n_layers + hp->n_mtp, n = e->n_dev;
    int src_of[2] = {e->pre_devs[0], e->attn_devs[0]};
    memset(want, 0, (size_t)n * n * sizeof *want);
    *local = 0;
    for (int ph = 0; ph < 2; ph++) {
        const placement *p = &e->place[ph];
        for (int l = 0; l < NL; l++)
            for (int x = 0; x < E; x++) {
                uint64_t cnt = e->expert_load[((size_t)ph * NL + l) * E + x];
                int src = src_of[ph], dst = pl_dev(p, l)[x * p->max_rep];
                if (!cnt) continue;
                if (dst == src) { *local += cnt * (msg + back); continue; }
                want[(size_t)src * n + dst] += cnt * msg;
                want[(size_t)dst * n + src] += cnt * back;
            }
    }
}

static void pe_fabric(cm384_model *m) {
    printf("fabric: counters against the bytes the copies wrote\n");
    const hparams *hp = &m->hp;
    uint64_t D = (uint64_t)hp->dim;
    struct { const char *preset; int int8, bf16; } cs[] = {
        {"default", 0, -1}, {"default", 1, -1}, {"default", 1, 1}, {"single", 1, -1}, {"single", 0, 1},
    };
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
        cm384_engine *e = pe_make(m, cs[k].preset, 2, cs[k].int8, cs[k].bf16);
        if (!e) { CHECK(0, "engine"); continue; }
        pe_one_request(e, 40, 12);
        uint64_t msg = (cs[k].int8 ? D + sizeof(float) : 4 * D) + sizeof(msg_meta);
        uint64_t back = cs[k].bf16 > 0 ? 2 * D : 4 * D;
        int n = e->n_dev;
        uint64_t *want = calloc((size_t)n * n, sizeof *want), *got = calloc((size_t)n * n, sizeof *got), local;
        pe_fabric_expect(e, msg, back, want, &local);
        cm384_get_traffic(e, got, n * n);
        int diff = 0, diag = 0;
        uint64_t sum = 0, wsum = 0;
        for (int i = 0; i < n * n; i++) { diff += got[i] != want[i]; sum += got[i]; wsum += want[i]; }
        for (int d = 0; d < n; d++) diag += got[(size_t)d * n + d] != 0;
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        printf("  %-7s int8 dispatch %d, bf16 combine %2d: UB %8llu bytes (expected %8llu), local %8llu (expected %8llu), "
               "RDMA %llu\n", cs[k].preset, cs[k].int8, cs[k].bf16, (unsigned long long)sum, (unsigned long long)wsum,
               (unsigned long long)st.local_bytes, (unsigned long long)local, (unsigned long long)st.kv_handoff_bytes);
        CHECK(diff == 0, "%s: %d (src, dst) entries differ from the bytes the copies wrote", cs[k].preset, diff);
        CHECK(diag == 0, "%s: a device sent itself fabric traffic", cs[k].preset);
        CHECK(sum == st.dispatch_bytes + st.combine_bytes, "%s: matrix %llu, stats %llu", cs[k].preset,
              (unsigned long long)sum, (unsigned long long)(st.dispatch_bytes + st.combine_bytes));
        CHECK(st.local_bytes == local, "%s: local bytes %llu, expected %llu", cs[k].preset,
              (unsigned long long)st.local_bytes, (unsigned long long)local);
        if (!strcmp(cs[k].preset, "single")) {
            CHECK(sum == 0 && st.kv_handoff_bytes == 0 && st.messages == 0, "single: %llu fabric bytes, %llu RDMA",
                  (unsigned long long)sum, (unsigned long long)st.kv_handoff_bytes);
        } else {
            CHECK(sum > 0 && st.kv_handoff_bytes > 0, "default: fabric traffic and a KV hand-off expected");
            uint64_t n_disp = st.dispatch_bytes / msg, n_comb = st.combine_bytes / back;
            CHECK(st.dispatch_bytes % msg == 0 && st.combine_bytes % back == 0 && n_disp == n_comb &&
                  st.messages == n_disp + n_comb, "default: %llu dispatch and %llu combine messages, %llu counted",
                  (unsigned long long)n_disp, (unsigned long long)n_comb, (unsigned long long)st.messages);
        }
        free(want);
        free(got);
        cm384_engine_free(e);
    }
    /* the paper preset: attention and one routed expert share each decode
       device, shared-expert replicas have their own -- diagonal still zero */
    cm384_engine *e = pe_make(m, "paper", 2, 1, 0);
    if (e) {
        pe_one_request(e, 40, 12);
        int n = e->n_dev, diag = 0;
        uint64_t *got = calloc((size_t)n * n, sizeof *got), sum = 0;
        cm384_get_traffic(e, got, n * n);
        for (int i = 0; i < n * n; i++) sum += got[i];
        for (int d = 0; d < n; d++) diag += got[(size_t)d * n + d] != 0;
        cm384_stats st;
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        uint64_t n_disp = st.dispatch_bytes / (D + 12), n_comb = st.combine_bytes / (2 * D);
        printf("  paper: UB %llu bytes, %llu dispatch and %llu BF16 combine messages, local %llu bytes\n",
               (unsigned long long)sum, (unsigned long long)n_disp, (unsigned long long)n_comb,
               (unsigned long long)st.local_bytes);
        CHECK(diag == 0 && sum == st.dispatch_bytes + st.combine_bytes, "paper: diagonal or sum wrong");
        CHECK(n_disp == n_comb && st.combine_bytes % (2 * D) == 0 && st.local_bytes > 0,
              "paper: BF16 combine must mirror INT8 dispatch message for message");
        free(got);
        cm384_engine_free(e);
    }
}

/* BF16 combine against the exact answer, on the fixture's sequences. */
static void pe_bf16_accuracy(cm384_model *m) {
    arena a = {0};
    json ref;
    if (json_load_file(PE_FIX "/reference.json", &a, &ref)) { CHECK(0, "reference.json"); return; }
    cm384_engine *e0 = pe_make(m, "default", 2, 0, -1), *e1 = pe_make(m, "default", 2, 0, 1);
    const json *seqs = json_get(&ref, "sequences");
    int agree = 0, total = 0, V = m->hp.vocab;
    double max_diff = 0;
    for (int i = 0; e0 && e1 && i < seqs->len; i++) {
        const json *tk = json_get(&seqs->kids[i], "tokens");
        int n = tk->len;
        int32_t ids[256];
        for (int t = 0; t < n && t < 256; t++) ids[t] = (int32_t)tk->kids[t].num;
        float *l0 = malloc(sizeof(float) * n * V), *l1 = malloc(sizeof(float) * n * V);
        cm384_eval(e0, ids, n, l0, NULL);
        cm384_eval(e1, ids, n, l1, NULL);
        for (int t = 0; t < n; t++) {
            int b0 = 0, b1 = 0;
            for (int v = 1; v < V; v++) {
                if (l0[t * V + v] > l0[t * V + b0]) b0 = v;
                if (l1[t * V + v] > l1[t * V + b1]) b1 = v;
            }
            agree += b0 == b1;
            for (int v = 0; v < V; v++) max_diff = fmax(max_diff, fabs(l0[t * V + v] - l1[t * V + v]));
        }
        total += n;
        free(l0); free(l1);
    }
    printf("bf16 combine vs exact: top-1 agreement %d/%d (%.1f%%), max |logit diff| %.4f\n", agree, total,
           total ? 100.0 * agree / total : 0, max_diff);
    /* a measurement, with room: BF16 keeps 8 bits of mantissa of each
       expert output; the fixture's random weights leave top-1 margins of
       ~1e-3, so a few positions may flip */
    CHECK(total > 0 && agree * 100 >= 95 * total && max_diff > 0, "BF16 combine: %d/%d, max diff %.4f", agree, total, max_diff);
    cm384_engine_free(e0);
    cm384_engine_free(e1);
    arena_free(&a);
}

/* ---- peers at the same time ---- */

typedef struct pe_job {
    int32_t     prompt[256];
    int         n_prompt, max_tokens;
    int         out[64], n_out, finals, status, n_cached;
    uint64_t    id;
} pe_job;

static int pe_on_event(void *user, const cm384_event *ev) {
    pe_job *j = user;
    if (ev->kind == CM384_EV_TOKEN) {
        if (j->n_out < 64) j->out[j->n_out] = ev->token;
        __atomic_add_fetch(&j->n_out, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    j->status = ev->status;
    j->n_cached = ev->n_cached;
    __atomic_add_fetch(&j->finals, 1, __ATOMIC_SEQ_CST);
    return 0;
}

static void pe_submit_fn(cm384_engine *e, pe_job *j, cm384_event_fn fn) {
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = j->max_tokens;
    s.ignore_eos = 1;
    cm384_request rq;
    cm384_request_init(&rq);
    rq.ids = j->prompt; rq.n_ids = j->n_prompt; rq.sampling = &s;
    rq.on_event = fn; rq.user = j;
    if (cm384_submit(e, &rq, &j->id)) printf("  submit: %s\n", cm384_last_error());
}

static void pe_submit(cm384_engine *e, pe_job *j) { pe_submit_fn(e, j, pe_on_event); }

static cm384_engine *pe_engine_share(cm384_model *m, const char *preset, int time_shared, int chunk, double share) {
    cm384_config c;
    cm384_config_init(&c);
    c.preset = preset; c.n_workers = 2; c.int8_dispatch = 0; c.bf16_combine = -1;
    c.time_shared = time_shared; c.prefill_chunk = chunk; c.max_ctx = 256; c.prefill_share = share;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

static cm384_engine *pe_engine(cm384_model *m, const char *preset, int time_shared, int chunk) {
    return pe_engine_share(m, preset, time_shared, chunk, 0);
}

/* Decoding requests run while long prompts arrive: decode steps complete
 * while a prefill step computes (the step counters, not the clock, say so),
 * and every request's tokens are the ones it gets alone on one device.  The
 * time-shared loop is the control: there no decode step can run inside a
 * prefill step.  With prefill_share 0.5 decode lends its thread to the long
 * prompts' tasks between its steps; by default it never does, and the
 * tokens are the same. */
static void pe_arrivals(cm384_model *m) {
    enum { ND = 8, NL = 3 };
    static pe_job ref[ND + NL], got[ND + NL];
    uint64_t r = 777;
    for (int i = 0; i < ND + NL; i++) {
        pe_job *j = &ref[i];
        memset(j, 0, sizeof *j);
        j->n_prompt = i < ND ? 4 + i : 200 + 10 * (i - ND);          /* the long ones: one chunk each */
        j->max_tokens = i < ND ? 160 : 3;               /* decoders outlast the long prompts by a wide margin */
        for (int t = 0; t < j->n_prompt; t++) { r = r * 6364136223846793005ull + 1; j->prompt[t] = t ? 3 + (int)((r >> 33) % 1000) : 0; }
    }
    cm384_engine *e = pe_engine(m, "single", 1, 256);
    for (int i = 0; e && i < ND + NL; i++) { pe_submit(e, &ref[i]); cm384_wait_all(e); }
    cm384_engine_free(e);
    printf("peers at the same time: %d requests decoding while %d prompts of 200-220 tokens arrive\n", ND, NL);
    for (int ts = 0; ts < 2; ts++) {
        for (int pass = 0; pass < (ts ? 1 : 3); pass++) {
            const char *preset = pass == 1 ? "paper" : "default";
            double share = pass == 2 ? 0 : 0.5;
            memcpy(got, ref, sizeof got);
            for (int i = 0; i < ND + NL; i++) { got[i].n_out = 0; got[i].finals = 0; got[i].status = -99; }
            e = pe_engine_share(m, preset, ts, 256, share);
            if (!e) { CHECK(0, "engine"); continue; }
            for (int i = 0; i < ND; i++) pe_submit(e, &got[i]);
            /* the long prompts arrive once every decoder has its first tokens */
            for (int spins = 0; spins < 100000; spins++) {
                int ready = 0;
                for (int i = 0; i < ND; i++) ready += __atomic_load_n(&got[i].n_out, __ATOMIC_SEQ_CST) >= 2;
                if (ready == ND) break;
                usleep(200);
            }
            for (int i = ND; i < ND + NL; i++) pe_submit(e, &got[i]);
            cm384_wait_all(e);
            cm384_stats st;
            st.struct_size = sizeof st;
            cm384_get_stats(e, &st);
            int same = 0, finals = 0;
            for (int i = 0; i < ND + NL; i++) {
                finals += got[i].finals == 1;
                int ok = got[i].n_out == ref[i].n_out && got[i].status == CM384_OK;
                for (int t = 0; ok && t < got[i].n_out && t < 64; t++) ok = got[i].out[t] == ref[i].out[t];
                same += ok;
            }
            int64_t short_steps = e->peers ? e->peers[LANE_PREFILL].short_steps : 0;
            printf("  %-16s %-7s: %2d/%d identical to alone on one device, %llu prefill and %llu decode steps, "
                   "%llu decode steps inside prefill steps, %lld prefill steps as short tasks, "
                   "%llu prefill tasks run by decode's thread\n",
                   ts ? "time-shared loop" : share > 0 ? "peers, lending" : "peers", preset, same, ND + NL,
                   (unsigned long long)st.prefill_steps, (unsigned long long)st.decode_steps,
                   (unsigned long long)st.decode_steps_in_prefill, (long long)short_steps,
                   (unsigned long long)st.prefill_lent_tasks);
            /* short tasks exactly while a request decodes: a long prompt's
               step beside the decoders (the first arrives while they all
               decode; the last may find them finished, so not all NL), never
               the first step (nothing decoding yet) nor in the time-shared
               loop, where no decode step can wait on them */
            if (ts) CHECK(short_steps == 0, "time-shared: %lld prefill steps cut into short tasks", (long long)short_steps);
            else CHECK(short_steps >= 1 && short_steps < (int64_t)st.prefill_steps,
                       "peers (%s): %lld of %llu prefill steps as short tasks (want some of the %d long prompts', not the first)",
                       preset, (long long)short_steps, (unsigned long long)st.prefill_steps, NL);
            CHECK(same == ND + NL && finals == ND + NL, "%s: %d/%d identical, %d single finals", preset, same, ND + NL, finals);
            if (ts) CHECK(st.decode_steps_in_prefill == 0, "time-shared: a decode step ran inside a prefill step");
            else CHECK(st.decode_steps_in_prefill > 0, "peers (%s): no decode step ran while a long prompt was prefilled", preset);
            /* decode alone: every step in the time-shared loop; beside the
               peers, the steps after the long prompts (the decoders outlast
               them) but not those inside their prefill steps -- and never
               more bytes, time or tokens than decode's in all */
            printf("  %-16s %-7s: %llu of %llu decode steps alone, %llu tokens, %.3f of %.3f s\n",
                   ts ? "time-shared loop" : share > 0 ? "peers, lending" : "peers", preset, (unsigned long long)st.decode_alone_steps, (unsigned long long)st.decode_steps,
                   (unsigned long long)st.decode_alone_tokens, st.decode_alone_seconds, st.decode_seconds);
            if (ts) CHECK(st.decode_alone_steps == st.decode_steps, "time-shared: %llu of %llu decode steps alone",
                          (unsigned long long)st.decode_alone_steps, (unsigned long long)st.decode_steps);
            else CHECK(st.decode_alone_steps > 0 && st.decode_alone_steps + st.decode_steps_in_prefill <= st.decode_steps,
                       "peers (%s): %llu decode steps alone, %llu inside prefill steps, of %llu", preset,
                       (unsigned long long)st.decode_alone_steps, (unsigned long long)st.decode_steps_in_prefill,
                       (unsigned long long)st.decode_steps);
            CHECK(st.decode_alone_tokens >= st.decode_alone_steps && st.decode_alone_tokens <= st.tokens_decoded &&
                  st.decode_alone_weight_bytes > 0 && st.decode_alone_weight_bytes <= st.decode_weight_bytes &&
                  st.decode_alone_seconds > 0 && st.decode_alone_seconds <= st.decode_seconds,
                  "%s: decode alone %llu tokens of %llu, %llu weight bytes of %llu, %.3f s of %.3f",
                  preset, (unsigned long long)st.decode_alone_tokens, (unsigned long long)st.tokens_decoded,
                  (unsigned long long)st.decode_alone_weight_bytes, (unsigned long long)st.decode_weight_bytes,
                  st.decode_alone_seconds, st.decode_seconds);
            /* lending: decode steps ran inside prefill steps, and between them
               decode's thread took prefill's tasks -- unless told not to */
            if (ts || share == 0) CHECK(st.prefill_lent_tasks == 0 && st.prefill_lent_seconds == 0,
                                      "%s: decode lent prefill %llu tasks", ts ? "time-shared" : "prefill_share 0",
                                      (unsigned long long)st.prefill_lent_tasks);
            else CHECK(st.prefill_lent_tasks > 0 && st.prefill_lent_seconds > 0,
                       "peers (%s): decode never lent prefill its thread", preset);
            cm384_engine_free(e);
        }
    }
}

/* How long decode lends after a step (prefill_share): share / (1 - share)
 * times the step, never beyond a TPOT target's slack, nothing under 1 us. */
static void pe_lend_budget(void) {
    const uint64_t ms = 1000000;
    struct { uint64_t step; double lend, target; uint64_t want; } c[] = {
        {10 * ms, 1.0, 0, 10 * ms},         /* share 0.5, no target: as long again */
        {10 * ms, 3.0, 0, 30 * ms},         /* share 0.75 */
        {10 * ms, 1.0, 50, 10 * ms},        /* a target with room to spare */
        {10 * ms, 1.0, 15, 5 * ms},         /* ... with 5 ms of slack */
        {10 * ms, 1.0, 10, 0},              /* the step alone meets it: nothing */
        {10 * ms, 1.0, 8, 0},               /* the step misses it: nothing */
        {500, 1.0, 0, 0},                   /* under a microsecond: nothing */
    };
    int ok = 0, n = (int)(sizeof c / sizeof c[0]);
    for (int i = 0; i < n; i++) {
        uint64_t got = lend_budget_ns(c[i].step, c[i].lend, c[i].target);
        int good = got == c[i].want;
        ok += good;
        CHECK(good, "lend budget: step %llu ns, lend %.2f, target %.1f ms: %llu ns, want %llu", (unsigned long long)c[i].step,
              c[i].lend, c[i].target, (unsigned long long)got, (unsigned long long)c[i].want);
    }
    printf("lending budget (prefill_share, TPOT slack): %d of %d cases\n", ok, n);
}

/* The trace: prefill devices and decode devices busy at the same time.
 * The decoders' second token (on decode's thread, inside a decode step)
 * waits until the prefill lane is computing the long prompts, so that they
 * have most of their tokens left when that step begins: without the hold a
 * slow start of the prefill step let them run out first (seen in CI). */
static cm384_engine *pe_hold_engine;
static int pe_hold_waits;
static int pe_hold_on_event(void *user, const cm384_event *ev) {
    pe_job *j = user;
    if (ev->kind == CM384_EV_TOKEN && j->n_out == 1 && pe_hold_engine) {
        peer *P = &pe_hold_engine->peers[LANE_PREFILL];
        for (int spins = 0; spins < 50000 && !atomic_load(&P->computing); spins++) usleep(200);   /* 10 s at most */
        __atomic_add_fetch(&pe_hold_waits, !atomic_load(&P->computing), __ATOMIC_SEQ_CST);
    }
    return pe_on_event(user, ev);
}

static void pe_trace_overlap(cm384_model *m) {
    char path[] = "/tmp/cm384-peers-trace-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) { CHECK(0, "mkstemp"); return; }
    close(fd);
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.max_ctx = 256; c.trace_path = path; c.int8_dispatch = 0;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); unlink(path); return; }
    static pe_job jobs[6];
    for (int i = 0; i < 6; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].n_prompt = i < 4 ? 6 : 220;
        jobs[i].max_tokens = i < 4 ? 240 : 2;      /* the short ones decode until they are cancelled */
        for (int t = 0; t < jobs[i].n_prompt; t++) jobs[i].prompt[t] = t ? 3 + (t * 31 + i) % 1000 : 0;
    }
    pe_hold_engine = e;
    pe_hold_waits = 0;
    for (int i = 0; i < 4; i++) pe_submit_fn(e, &jobs[i], pe_hold_on_event);
    /* the first tokens come from prefill's step, so the long prompts join
       none of the decoders' prefill */
    for (int spins = 0; spins < 100000 && __atomic_load_n(&jobs[3].n_out, __ATOMIC_SEQ_CST) < 1; spins++) usleep(200);
    pe_submit(e, &jobs[4]);
    pe_submit(e, &jobs[5]);
    /* the decoding requests are cancelled only once the long prompts are done */
    cm384_wait(e, jobs[4].id, -1);
    cm384_wait(e, jobs[5].id, -1);
    for (int i = 0; i < 4; i++) cm384_cancel(e, jobs[i].id);
    cm384_wait_all(e);
    pe_hold_engine = NULL;
    CHECK(pe_hold_waits == 0, "%d decoders stopped waiting for the prefill step", pe_hold_waits);
    /* the events, before the engine writes them out */
    /* steps on the peers' tracks: a decode step the counters saw inside a
       prefill step overlaps it in the trace; devices: the same, per event */
    pthread_mutex_lock(&e->trace_mu);
    int n = e->n_tev, steps = 0, dev_overlaps = 0, n_pre = 0;
    pthread_mutex_unlock(&e->trace_mu);
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            const trace_event *a = &e->tev[i];
            int a_pre = pass ? a->device == e->n_dev + LANE_PREFILL
                             : a->device < e->n_dev && (e->dev[a->device].roles & ROLE_PREFILL);
            if (a->t0 == UINT64_MAX || !a_pre) continue;
            n_pre += !pass;
            for (int k = 0; k < n; k++) {
                const trace_event *b = &e->tev[k];
                int b_dec = pass ? b->device == e->n_dev + LANE_DECODE
                                 : b->device < e->n_dev && (e->dev[b->device].roles & ROLE_ATTN);
                if (b->t0 == UINT64_MAX || !b_dec) continue;
                if (b->t0 < a->t1 && b->t1 > a->t0) { if (pass) steps++; else dev_overlaps++; break; }
            }
        }
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    cm384_engine_free(e);
    arena ar = {0};
    json doc;
    int r = json_load_file(path, &ar, &doc);
    printf("trace: %d prefill steps overlap a decode step (%llu decode steps counted inside prefill steps); "
           "%d of %d prefill-device events overlap a decode-device event\n", steps,
           (unsigned long long)st.decode_steps_in_prefill, dev_overlaps, n_pre);
    CHECK(r == CM384_OK, "trace is not valid JSON");
    CHECK(steps > 0 && st.decode_steps_in_prefill > 0, "the trace shows no decode step while prefill worked");
    arena_free(&ar);
    unlink(path);
}

/* ---- the caching subsystem's disk tier ---- */

static int pe_n_ignored_logs;
static void pe_log(void *user, int level, const char *msg) {
    (void)user;
    if (level == 2 && strstr(msg, "ignored:")) __atomic_add_fetch(&pe_n_ignored_logs, 1, __ATOMIC_SEQ_CST);
}

static cm384_engine *pe_cache_engine(cm384_model *m, const char *dir, int int8_dispatch) {
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.max_ctx = 256; c.cache_dir = dir; c.int8_dispatch = int8_dispatch; c.log = pe_log;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

/* Runs job j alone on e; returns its stats afterwards. */
static cm384_stats pe_run_one(cm384_engine *e, pe_job *j) {
    j->n_out = 0; j->finals = 0; j->status = -99;
    pe_submit(e, j);
    cm384_wait_all(e);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    return st;
}

static int pe_same(const pe_job *a, const pe_job *b) {
    if (a->n_out != b->n_out || a->status != b->status) return 0;
    for (int t = 0; t < a->n_out && t < 64; t++) if (a->out[t] != b->out[t]) return 0;
    return 1;
}

/* A fresh engine and a restarted process find the prefix in cache_dir and
 * give the same tokens; damaged, truncated and foreign files are ignored
 * with a log line and the request is still right; other numerics never
 * match. */
static void pe_disk_tier(cm384_model *m) {
    char dir[] = "/tmp/cm384-peers-cache-XXXXXX";
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp"); return; }
    static pe_job j, ref;
    memset(&j, 0, sizeof j);
    j.n_prompt = 150; j.max_tokens = 12;               /* 9 full blocks of 16 before the last token */
    for (int t = 0; t < j.n_prompt; t++) j.prompt[t] = t ? 3 + (t * 53) % 1000 : 0;
    ref = j;
    cm384_engine *e = pe_engine(m, "default", 0, 0);
    if (e) { pe_run_one(e, &ref); cm384_engine_free(e); }
    printf("context cache on disk (%s):\n", dir);
    /* 1. a first engine writes the blocks */
    e = pe_cache_engine(m, dir, 0);
    if (!e) { CHECK(0, "engine"); return; }
    cm384_stats st = pe_run_one(e, &j);
    char folder[600];
    snprintf(folder, sizeof folder, "%s", e->cache_dir);
    cm384_engine_free(e);                              /* the caching loop has written everything */
    int files = 0;
    DIR *d = opendir(folder);
    for (struct dirent *de; d && (de = readdir(d));) files += strstr(de->d_name, ".kv") != NULL;
    if (d) closedir(d);
    printf("  first engine: %d block files written, %d tokens cached\n", files, j.n_cached);
    CHECK(files >= 9 && j.n_cached == 0 && pe_same(&j, &ref), "first engine: %d files, same %d", files, pe_same(&j, &ref));
    /* 2. a second engine in this process: the pool is empty, the disk is not */
    e = pe_cache_engine(m, dir, 0);
    st = pe_run_one(e, &j);
    cm384_engine_free(e);
    printf("  second engine: %d prompt tokens from disk (%llu blocks loaded), tokens %s\n", j.n_cached,
           (unsigned long long)st.cache_hits_disk, pe_same(&j, &ref) ? "identical" : "DIFFERENT");
    CHECK(j.n_cached == 144 && st.cache_hits_disk == 9 && pe_same(&j, &ref), "second engine: %d cached, %llu from disk",
          j.n_cached, (unsigned long long)st.cache_hits_disk);
    /* 3. a restarted process: a child loads the model anew and reports what it got */
    int fds[2];
    if (pipe(fds) == 0) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            cm384_model *m2;
            pe_job k = j;
            int got[3] = {-1, -1, 0};
            if (!cm384_model_load(PE_FIX, NULL, &m2)) {
                cm384_engine *e2 = pe_cache_engine(m2, dir, 0);
                if (e2) {
                    pe_run_one(e2, &k);
                    got[0] = k.n_cached;
                    got[1] = (int)pe_same(&k, &ref);
                    cm384_engine_free(e2);
                }
                cm384_model_free(m2);
            }
            if (write(fds[1], got, sizeof got) != (ssize_t)sizeof got) _exit(1);
            _exit(0);
        }
        close(fds[1]);
        int got[3] = {-2, -2, 0};
        ssize_t n = read(fds[0], got, sizeof got);
        close(fds[0]);
        int status = 0;
        if (pid > 0) waitpid(pid, &status, 0);
        printf("  restarted process: %d prompt tokens from disk, tokens %s\n", got[0], got[1] == 1 ? "identical" : "DIFFERENT");
        CHECK(n == (ssize_t)sizeof got && got[0] == 144 && got[1] == 1, "restarted process: %d cached, same %d", got[0], got[1]);
    }
    /* 4. other numerics (INT8 dispatch): another folder, never a match */
    e = pe_cache_engine(m, dir, 1);
    pe_job k = j;
    st = pe_run_one(e, &k);
    cm384_engine_free(e);
    CHECK(k.n_cached == 0 && st.cache_hits_disk == 0, "INT8-dispatch engine used exact blocks: %d cached", k.n_cached);
    /* 5. damage: block 3's file flipped, block 6's cut short, and a foreign
       file under block 1's name */
    char sub[600], cmd[1600];
    e = pe_cache_engine(m, dir, 0);                    /* its folder is the exact engine's */
    snprintf(sub, sizeof sub, "%s", e->cache_dir);
    uint64_t key = 0, keys[9];
    int B = e->kv.block_tokens;
    for (int b = 0; b < 9; b++) { key = block_key(key, 0, j.prompt + b * B, B); keys[b] = key; }
    char path[700];
    snprintf(path, sizeof path, "%s/%016llx.kv", sub, (unsigned long long)keys[3]);
    FILE *f = fopen(path, "r+b");
    if (f) { fseek(f, 200, SEEK_SET); int c = fgetc(f); fseek(f, 200, SEEK_SET); fputc(c ^ 0x40, f); fclose(f); }
    snprintf(path, sizeof path, "%s/%016llx.kv", sub, (unsigned long long)keys[6]);
    CHECK(truncate(path, 100) == 0, "truncate");
    snprintf(path, sizeof path, "%s/%016llx.kv", sub, (unsigned long long)keys[1]);
    cm384_engine_free(e);
    /* the foreign file: a valid file from another fingerprint, renamed */
    e = pe_cache_engine(m, dir, 1);
    char other[700];
    snprintf(other, sizeof other, "%s/%016llx.kv", e->cache_dir, (unsigned long long)keys[1]);
    cm384_engine_free(e);
    snprintf(cmd, sizeof cmd, "cp %s %s", other, path);
    CHECK(system(cmd) == 0, "copy a foreign file");
    pe_n_ignored_logs = 0;
    e = pe_cache_engine(m, dir, 0);
    k = j;
    st = pe_run_one(e, &k);
    cm384_engine_free(e);
    printf("  foreign block 1: %d prompt tokens from disk, %llu files not trusted, %d log lines, tokens %s\n", k.n_cached,
           (unsigned long long)st.cache_files_ignored, pe_n_ignored_logs, pe_same(&k, &ref) ? "identical" : "DIFFERENT");
    CHECK(k.n_cached == 16 && st.cache_files_ignored == 1 && pe_n_ignored_logs == 1 && pe_same(&k, &ref),
          "foreign file: %d cached, %llu ignored", k.n_cached, (unsigned long long)st.cache_files_ignored);
    /* block 1 is good again (re-saved by the last run); now block 3's flip and block 6's cut */
    pe_n_ignored_logs = 0;
    e = pe_cache_engine(m, dir, 0);
    k = j;
    st = pe_run_one(e, &k);
    cm384_engine_free(e);
    printf("  damaged block 3: %d prompt tokens from disk, %llu not trusted, tokens %s\n", k.n_cached,
           (unsigned long long)st.cache_files_ignored, pe_same(&k, &ref) ? "identical" : "DIFFERENT");
    CHECK(k.n_cached == 48 && st.cache_files_ignored == 1 && pe_n_ignored_logs == 1 && pe_same(&k, &ref),
          "damaged file: %d cached", k.n_cached);
    pe_n_ignored_logs = 0;
    e = pe_cache_engine(m, dir, 0);
    k = j;
    st = pe_run_one(e, &k);
    cm384_engine_free(e);
    printf("  truncated block 6: %d prompt tokens from disk, %llu not trusted, tokens %s\n", k.n_cached,
           (unsigned long long)st.cache_files_ignored, pe_same(&k, &ref) ? "identical" : "DIFFERENT");
    CHECK(k.n_cached == 96 && st.cache_files_ignored == 1 && pe_same(&k, &ref), "truncated file: %d cached", k.n_cached);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {}
}

/* A bf16 KV cache (config.kv_bf16) on disk: its blocks take half the bytes
 * of fp32 ones, a second engine finds them and gives the first's tokens,
 * and an fp32 engine on the same folder never takes them (other numerics). */
static cm384_engine *pe_kv_engine(cm384_model *m, const char *dir, int kv_bf16) {
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.max_ctx = 256; c.cache_dir = dir; c.int8_dispatch = 0; c.kv_bf16 = kv_bf16;
    cm384_engine *e = NULL;
    if (cm384_engine_create(m, &c, &e)) printf("  engine_create: %s\n", cm384_last_error());
    return e;
}

static long pe_folder_kv_bytes(const char *folder, int *files) {
    long bytes = 0;
    *files = 0;
    DIR *d = opendir(folder);
    for (struct dirent *de; d && (de = readdir(d));) {
        if (!strstr(de->d_name, ".kv")) continue;
        char p[900];
        snprintf(p, sizeof p, "%s/%s", folder, de->d_name);
        struct stat sb;
        if (!stat(p, &sb)) { bytes += (long)sb.st_size; (*files)++; }
    }
    if (d) closedir(d);
    return bytes;
}

static void pe_disk_tier_bf16(cm384_model *m) {
    char dir[] = "/tmp/cm384-peers-kvbf16-XXXXXX";
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp"); return; }
    static pe_job a, b, f32;
    memset(&a, 0, sizeof a);
    a.n_prompt = 150; a.max_tokens = 12;
    for (int t = 0; t < a.n_prompt; t++) a.prompt[t] = t ? 3 + (t * 29) % 1000 : 0;
    b = f32 = a;
    char fold16[600], fold32[600];
    int files16 = 0, files32 = 0;
    cm384_engine *e = pe_kv_engine(m, dir, 0);                 /* fp32 first: its files to compare */
    if (!e) { CHECK(0, "engine"); return; }
    pe_run_one(e, &f32);
    snprintf(fold32, sizeof fold32, "%s", e->cache_dir);
    cm384_engine_free(e);
    e = pe_kv_engine(m, dir, 1);
    if (!e) { CHECK(0, "engine"); return; }
    cm384_stats st = pe_run_one(e, &a);
    snprintf(fold16, sizeof fold16, "%s", e->cache_dir);
    cm384_engine_free(e);
    long bytes16 = pe_folder_kv_bytes(fold16, &files16), bytes32 = pe_folder_kv_bytes(fold32, &files32);
    e = pe_kv_engine(m, dir, 1);
    st = pe_run_one(e, &b);
    cm384_engine_free(e);
    printf("bf16 KV cache on disk: %d files of %ld bytes (fp32: %d of %ld); a second engine took %d prompt tokens "
           "from disk (%llu blocks), tokens %s; the first run's cached %d\n", files16, files16 ? bytes16 / files16 : 0,
           files32, files32 ? bytes32 / files32 : 0, b.n_cached, (unsigned long long)st.cache_hits_disk,
           pe_same(&a, &b) ? "identical" : "DIFFERENT", a.n_cached);
    CHECK(strcmp(fold16, fold32) != 0, "bf16 and fp32 KV blocks share a folder");
    CHECK(files16 >= 9 && files16 == files32 && bytes16 < 0.55 * bytes32 && bytes16 > 0.45 * bytes32,
          "bf16 block files: %d of %ld bytes against %d fp32 of %ld", files16, bytes16, files32, bytes32);
    CHECK(a.n_cached == 0 && b.n_cached == 144 && st.cache_hits_disk == 9 && pe_same(&a, &b),
          "bf16 KV from disk: %d cached, same %d", b.n_cached, pe_same(&a, &b));
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {}
}

/* The file parser on its own: every truncation of a good file and every
 * single-byte change of its header is refused. */
static void pe_kvf_parser(void) {
    kvf_expect x = {0x1234, 0x55, 0x66, 7, 4, 2, 3, 0, 4};
    size_t pay = kvf_payload_bytes(&x), n = sizeof(kvf_header) + pay, at;
    uint8_t *buf = calloc(1, n), *cp = malloc(n);
    kvf_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, KVF_MAGIC, 8);
    h.version = KVF_VERSION; h.block_tokens = 4; h.n_layers = 2; h.row = 3; h.tenant = 7;
    h.fingerprint = 0x1234; h.key = 0x55; h.parent = 0x66; h.payload_bytes = pay;
    for (size_t i = 0; i < pay; i++) buf[sizeof h + i] = (uint8_t)(i * 7);
    h.checksum = kvf_checksum(buf + sizeof h, pay);
    memcpy(buf, &h, sizeof h);
    CHECK(kvf_parse(buf, n, &x, &at) == NULL && at == sizeof h, "a good file refused");
    int bad_trunc = 0, bad_flip = 0;
    for (size_t k = 0; k < n; k++) bad_trunc += kvf_parse(buf, k, &x, &at) == NULL;
    for (size_t k = 0; k < n; k++) {
        memcpy(cp, buf, n);
        cp[k] ^= 1;
        bad_flip += kvf_parse(cp, n, &x, &at) == NULL;
    }
    printf("kvf parser: %zu truncations and %zu one-bit flips of a %zu-byte file: %d and %d accepted\n", n, n, n,
           bad_trunc, bad_flip);
    CHECK(bad_trunc == 0 && bad_flip == 0, "the parser accepted a damaged file");
    free(buf);
    free(cp);
}

/* The model cache: INT8 weights made once, then mapped by a later load of
 * the same model with the same tokens; a damaged file, or one an older
 * version made (row-major INT8 weights), is remade. */
static int pe_n_mapped, pe_n_remade, pe_n_version;
static void pe_q8_log(void *user, int level, const char *msg) {
    (void)user; (void)level;
    if (strstr(msg, "INT8 weights mapped")) pe_n_mapped++;
    if (strstr(msg, "model cache:") && strstr(msg, "ignored")) pe_n_remade++;
    if (strstr(msg, "model cache:") && strstr(msg, "another version")) pe_n_version++;
}

static void pe_model_cache(void) {
    char dir[] = "/tmp/cm384-peers-q8-XXXXXX";
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp"); return; }
    static pe_job runs[4];
    for (int pass = 0; pass < 4; pass++) {
        if (pass == 2) {                                   /* damage the file: one byte of its data */
            char cmd[600];
            snprintf(cmd, sizeof cmd, "f=$(ls %s/*.q8) && printf 'Z' | dd of=$f bs=1 seek=5000 conv=notrunc 2>/dev/null", dir);
            CHECK(system(cmd) == 0, "damage the INT8 file");
        }
        if (pass == 3) {                                   /* format version 1 in the header */
            char cmd[600];
            snprintf(cmd, sizeof cmd, "f=$(ls %s/*.q8) && printf '\\001\\000\\000\\000' | dd of=$f bs=1 seek=8 conv=notrunc 2>/dev/null", dir);
            CHECK(system(cmd) == 0, "age the INT8 file");
        }
        cm384_model *m;
        if (cm384_model_load(PE_FIX, NULL, &m)) { CHECK(0, "load"); break; }
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.max_ctx = 256; c.int8 = 1; c.cache_dir = dir; c.log = pe_q8_log;
        pe_n_mapped = pe_n_remade = pe_n_version = 0;
        cm384_engine *e = NULL;
        if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); cm384_model_free(m); break; }
        pe_job *j = &runs[pass];
        memset(j, 0, sizeof *j);
        j->n_prompt = 20; j->max_tokens = 10;
        for (int t = 0; t < j->n_prompt; t++) j->prompt[t] = t ? 3 + (t * 29) % 1000 : 0;
        pe_run_one(e, j);
        cm384_engine_free(e);
        cm384_model_free(m);
        int same = pass == 0 || pe_same(j, &runs[0]);
        printf("model cache, %s: INT8 weights %s, tokens %s\n", pass == 0 ? "first load" : pass == 1 ? "second load" : pass == 2 ? "damaged file" : "older version's file",
               pe_n_mapped ? "from cache_dir" : "made", same ? "identical" : "DIFFERENT");
        CHECK(same && j->status == CM384_OK, "model cache pass %d: tokens differ", pass);
        CHECK(pe_n_mapped == (pass == 1), "pass %d: mapped %d times", pass, pe_n_mapped);
        CHECK(pe_n_remade == (pass >= 2), "pass %d: %d damaged-file log lines", pass, pe_n_remade);
        CHECK(pe_n_version == (pass == 3), "pass %d: %d older-version log lines", pass, pe_n_version);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {}
}

TEST_MAIN(peers) {
    pe_quick = getenv("CM384_QUICK") != NULL;
    cm384_model *m;
    if (cm384_model_load(PE_FIX, NULL, &m)) { printf("load: %s\n", cm384_last_error()); return 1; }
    pe_fabric(m);
    pe_lend_budget();
    pe_arrivals(m);
    pe_trace_overlap(m);
    pe_kvf_parser();
    pe_disk_tier(m);
    pe_disk_tier_bf16(m);
    pe_model_cache();
    if (!pe_quick) pe_bf16_accuracy(m);
    cm384_model_free(m);
    return test_summary("peers");
}

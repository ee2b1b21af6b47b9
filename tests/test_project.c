/* test_project.c -- the projection onto CloudMatrix384 (section 15): its
 * parameters all have sources, it is built from the engine's own placement
 * and messages, and it is checked -- never fitted -- against the paper's
 * end-to-end tables: Table 4's decode rows and Table 2's prefill rows, each
 * reported with its error.  Rows the model does not reach within 15% are
 * known gaps (docs/how-it-works.md says why); for them the test pins the
 * error near the value the docs quote, so a change to the model that moves
 * them is seen and the docs updated. */
#include "../cm384.c"
#include "test.h"

#define PJ_R1 "tests/fixtures/deepseek-r1"
#define PJ_SMALL "models/shakespeare"

/* ---- parameters and profiles ---- */
static void pj_params(void) {
    printf("parameters:\n");
    int n = cm384_hw_param(0, NULL, NULL, NULL, NULL, NULL), bad = 0;
    for (int i = 0; i < n; i++) {
        const char *pr, *k, *u, *s;
        double v;
        cm384_hw_param(i, &pr, &k, &v, &u, &s);
        if (!pr || !k || !s || strlen(s) < 8 || !isfinite(v)) { bad++; printf("  row %d (%s) has no source\n", i, k ? k : "?"); }
    }
    printf("  %d rows, each with a source\n", n);
    CHECK(n > 40 && !bad, "%d parameter rows without a source", bad);
    CHECK(cm384_hw_param(n, NULL, NULL, NULL, NULL, NULL) == CM384_E_INVALID, "row past the end");
    cm384_hw hw;
    hw.struct_size = sizeof hw;
    CHECK(cm384_hw_get("cloudmatrix384", &hw) == CM384_OK && hw.int8_tops == 752 && hw.bf16_tflops == 376 &&
          hw.attn_cube_cores == 16 && hw.cube_cores == 24 && hw.dispatch_us_hi == 152 && hw.mla_flop_eff == 0.654,
          "cloudmatrix384 profile does not match the table");
    cm384_hw small;
    small.struct_size = offsetof(cm384_hw, bf16_tflops);
    CHECK(cm384_hw_get("h800", &small) == CM384_OK && small.struct_size == offsetof(cm384_hw, bf16_tflops) &&
          small.dies_per_npu == 1, "an older, shorter cm384_hw gets the fields it knows");
    CHECK(cm384_hw_get("h800", &hw) == CM384_OK && hw.int8_tops == 1979 && hw.combine_us_hi == 360, "h800 profile");
    CHECK(cm384_hw_get("tpu", &hw) == CM384_E_INVALID && strstr(cm384_last_error(), "tpu"), "unknown profile accepted");
}

/* ---- a model from config.json alone ---- */
static cm384_model *pj_r1(void) {
    printf("config-only DeepSeek-R1:\n");
    cm384_model *m = NULL;
    int r = cm384_model_load_config(PJ_R1, &m);
    CHECK(r == CM384_OK, "load %s: %s", PJ_R1, cm384_last_error());
    if (r) return NULL;
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    double main_b = (double)(m->n_params - m->n_mtp_params) / 1e9, act_b = in.n_active_params / 1e9;
    printf("  %d layers (%d dense), %d experts top-%d: %.1fB parameters in the main model, %.1fB active per token, "
           "%.1fB in the MTP module\n", in.n_layers, in.n_dense_layers, in.n_routed_experts, in.n_experts_per_tok, main_b,
           act_b, m->n_mtp_params / 1e9);
    CHECK(fabs(main_b - 671) < 671 * 0.01, "DeepSeek-V3/R1 has 671B parameters, counted %.1fB", main_b);
    CHECK(fabs(act_b - 37) < 37 * 0.03, "DeepSeek-V3/R1 has 37B active parameters, counted %.1fB", act_b);
    CHECK(in.n_dense_layers == 3 && in.n_mtp_layers == 1, "dense / MTP layers");
    cm384_engine *e = NULL;
    CHECK(cm384_engine_create(m, NULL, &e) == CM384_E_MISUSE && !e, "an engine on a config-only model");
    cm384_model *bad = NULL;
    CHECK(cm384_model_load_config("tests/fixtures/nope/config.json", &bad) == CM384_E_IO && !bad, "missing config");
    CHECK(cm384_model_load_config(PJ_SMALL "/val.txt", &bad) == CM384_E_FORMAT && !bad, "a text file as config");
    return m;
}

/* ---- grounded in the engine: placement and messages ---- */
static void pj_grounding(const cm384_model *m) {
    printf("grounding:\n");
    cm384_projection *p = calloc(1, sizeof *p);
    if (!p) return;
    int r = cm384_project(m, NULL, p);
    CHECK(r == CM384_OK, "project: %s", cm384_last_error());
    printf("  the paper preset at R1's scale: %d decode devices, EP%d (%d shared replicas, %d redundant), prefill %d\n",
           p->decode_devices, p->expert_devices, p->shared_replicas, p->redundant_experts, p->prefill_devices);
    CHECK(p->decode_devices == 320 && p->expert_devices == 320 && p->shared_replicas == 32 && p->redundant_experts == 32 &&
          p->prefill_devices == 32, "the deployment is not the paper's (s2.3: DP320/EP320, 32 + 32, prefill EP32)");
    free(p);

    /* the projection prices moe_layout's messages: check them against what a
       run of the engine counts (INT8 dispatch, the engine's fp32 combine) */
    cm384_model *sm;
    if (cm384_model_load("tests/fixtures/tiny-dsv3", NULL, &sm)) { CHECK(0, "tiny model: %s", cm384_last_error()); return; }
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.n_devices = 24; c.int8_dispatch = 1;
    cm384_engine *e;
    if (cm384_engine_create(sm, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); cm384_model_free(sm); return; }
    int32_t ids[24];
    for (int i = 0; i < 24; i++) ids[i] = 3 + (i * 53) % 1000;
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 6; s.ignore_eos = 1;
    cm384_generate(e, NULL, ids, 24, &s, NULL, NULL);
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    double md, mc;
    proj_msg_bytes(sm->hp.dim, 1, 0, &md, &mc);
    uint64_t msgs = st.messages / 2;            /* one dispatch and one combine per (token, expert) */
    printf("  engine: %llu token messages, %llu dispatch bytes, %llu combine bytes; projection: %.0f + %.0f bytes each\n",
           (unsigned long long)msgs, (unsigned long long)st.dispatch_bytes, (unsigned long long)st.combine_bytes, md, mc);
    CHECK(msgs > 0 && st.dispatch_bytes == (uint64_t)(msgs * md) && st.combine_bytes == (uint64_t)(msgs * mc),
          "the projection's message sizes are not the engine's");
    cm384_engine_free(e);
    cm384_model_free(sm);

    /* Table 6 at its own point: 128 tokens x top-8 x 7.5 KB at EP256 */
    cm384_hw hw;
    hw.struct_size = sizeof hw;
    cm384_hw_get("cloudmatrix384", &hw);
    double b = 128.0 * 8 * 7680;
    CHECK(fabs(proj_a2a_us(&hw, 0, 256, b, 0) - 152) < 1e-9 && fabs(proj_a2a_us(&hw, 1, 8, 128.0 * 8 * 14336, 0) - 118) < 1e-9 &&
          fabs(proj_a2a_us(&hw, 0, 256, b, 1) - 152) < 1e-9, "dispatch/combine do not reproduce Table 6 at its points");
}

/* ---- the expert load of a real run of the small trained model ---- */
static uint64_t *pj_measured_load(int *layers, int *experts) {
    *layers = *experts = 0;
    cm384_model *m;
    if (cm384_model_load(PJ_SMALL, NULL, &m)) { printf("  (no %s: %s)\n", PJ_SMALL, cm384_last_error()); return NULL; }
    FILE *f = fopen(PJ_SMALL "/val.txt", "rb");
    char text[8192];
    size_t got = f ? fread(text, 1, sizeof text, f) : 0;
    if (f) fclose(f);
    int n = cm384_tokenize(m, text, got, NULL, 0, 0);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    uint64_t *load = NULL;
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.int8_dispatch = 0;
    cm384_engine *e = NULL;
    if (ids && cm384_tokenize(m, text, got, ids, n, 0) == n && n > 16 * 64 && !cm384_engine_create(m, &c, &e)) {
        uint64_t id[16];
        cm384_sampling s;
        cm384_sampling_init(&s);
        s.max_tokens = 16; s.ignore_eos = 1;
        for (int i = 0; i < 16; i++) {
            cm384_request q;
            cm384_request_init(&q);
            q.ids = ids + i * 64; q.n_ids = 64; q.sampling = &s;
            cm384_submit(e, &q, &id[i]);
        }
        for (int i = 0; i < 16; i++) cm384_wait(e, id[i], -1);
        int E = m->hp.n_routed, NL = m->hp.n_layers + m->hp.n_mtp;
        load = calloc((size_t)NL * E, sizeof(uint64_t));
        for (int l = 0; load && l < NL; l++) {
            uint64_t *row = load + (size_t)*layers * E, sum = 0;
            cm384_get_expert_load(e, l, row, E);
            for (int x = 0; x < E; x++) sum += row[x];
            if (sum) (*layers)++;
        }
        *experts = E;
    }
    cm384_engine_free(e);
    free(ids);
    cm384_model_free(m);
    return load;
}

/* ---- the paper's tables ---- */
typedef struct pj_row {
    int    prompt, output;
    double slo;
    int    batch;          /* the paper's */
    double tpot, tok;      /* the paper's */
    double gap;            /* 0: must be within 15%; else the known error (%) the docs quote */
} pj_row;

static void pj_tables(const cm384_model *m) {
    printf("Table 4 (decode under TPOT targets), perfect balance; error = projected / paper - 1:\n");
    static const pj_row t4[] = {
        {1024, 1024, 50, 128, 46.8, 2733, 31.8}, {2048, 256, 50, 112, 47.4, 2360, 52.0},
        {4096, 256, 50, 96, 49.4, 1943, 46.4},   {4096, 256, 30, 24, 24.6, 974, 129.7},
        {4096, 256, 15, 8, 14.9, 538, 0},
    };
    cm384_projection *p = calloc(1, sizeof *p), *q = calloc(1, sizeof *q);
    if (!p || !q) { free(p); free(q); return; }
    for (size_t i = 0; i < sizeof t4 / sizeof t4[0]; i++) {
        const pj_row *t = &t4[i];
        cm384_proj_opts o;
        cm384_proj_opts_init(&o);
        o.prompt = t->prompt; o.output = t->output; o.tpot_slo_ms = t->slo;
        int r = cm384_project(m, &o, p);
        CHECK(r == CM384_OK, "project: %s", cm384_last_error());
        o.batch = t->batch;
        cm384_project(m, &o, q);
        double err = 100 * (p->decode_tok_s / t->tok - 1), err_b = 100 * (q->decode_tok_s / t->tok - 1);
        printf("  %2.0f ms %4d/%-4d paper: batch %3d TPOT %4.1f ms %5.0f tok/s | projected: batch %3d%s TPOT %4.1f ms "
               "%5.0f tok/s, error %+6.1f%%  %s | at batch %3d: %5.0f tok/s %+6.1f%%\n",
               t->slo, t->prompt, t->output, t->batch, t->tpot, t->tok, p->batch, p->feasible ? " " : "*", p->tpot_ms,
               p->decode_tok_s, err, t->gap ? "KNOWN GAP" : "within 15%", t->batch, q->decode_tok_s, err_b);
        if (t->gap) CHECK(fabs(err - t->gap) < 10, "row %zu moved: error %+.1f%%, the docs quote %+.1f%%", i, err, t->gap);
        else CHECK(fabs(err) <= 15, "row %zu: error %+.1f%% exceeds 15%%", i, err);
        /* what must hold whatever the hardware numbers */
        CHECK(fabs(p->decode_tok_s - p->batch * p->tokens_per_step / (p->step_ms / 1e3)) < 1e-6 * p->decode_tok_s &&
              fabs(p->tpot_ms - p->step_ms / p->tokens_per_step) < 1e-9, "tok/s = batch x tokens per step / step");
        CHECK(!p->feasible || p->tpot_ms <= t->slo, "the chosen batch misses its target");
        if (p->feasible && p->batch < o.max_batch) {
            o.batch = p->batch + 8;
            cm384_project(m, &o, q);
            CHECK(q->tpot_ms > t->slo || q->hbm_used_gb > 64, "batch %d + 8 also meets %.0f ms", p->batch, t->slo);
        }
    }
    printf("  (* no batch meets the target: batch 8 shown)\n");

    printf("Table 2 (prefill, 4K prompts, 16,384 tokens per NPU):\n");
    cm384_proj_opts o;
    cm384_proj_opts_init(&o);
    o.batch = 96;
    cm384_project(m, &o, p);
    double perfect = p->prefill_tok_s, err = 100 * (perfect / 6688 - 1);
    printf("  perfect EPLB: paper 6,688, projected %.0f tok/s/NPU, error %+.1f%%  within 15%%\n", perfect, err);
    CHECK(fabs(err) <= 15, "prefill (perfect EPLB) error %+.1f%%", err);
    o.prefill_expanded = 1;
    cm384_project(m, &o, q);
    printf("  (the same with the expanded MLA form in prefill, which the engine does not compute: %.0f, %+.1f%%)\n",
           q->prefill_tok_s, 100 * (q->prefill_tok_s / 6688 - 1));
    CHECK(q->prefill_tok_s > perfect, "the expanded form has less arithmetic");
    o.prefill_expanded = 0;

    int layers, experts;
    uint64_t *load = pj_measured_load(&layers, &experts);
    if (load && layers) {
        o.expert_load = load; o.load_layers = layers; o.load_experts = experts;
        cm384_project(m, &o, q);
        double e2 = 100 * (q->prefill_tok_s / 5655 - 1);
        printf("  default: paper 5,655; projected with the load measured on %s (%d MoE layers of %d experts, busiest "
               "prefill device %.2fx the mean): %.0f tok/s/NPU, error %+.1f%%  KNOWN GAP\n", PJ_SMALL, layers, experts,
               q->prefill_load_max_over_mean, q->prefill_tok_s, e2);
        printf("  measured imbalance vs perfect balance: prefill %+.1f%%, decode (batch 96) %+.1f%% (paper: -15%% prefill)\n",
               100 * (q->prefill_tok_s / perfect - 1), 100 * (q->decode_tok_s / p->decode_tok_s - 1));
        CHECK(q->prefill_load_max_over_mean > 1.0 && q->prefill_tok_s < perfect && q->decode_tok_s <= p->decode_tok_s,
              "measured imbalance must cost throughput");
        CHECK(fabs(e2 - 33.0) < 10, "prefill (default) moved: %+.1f%%, the docs quote +33%%", e2);
        /* EPLB's replicas on the hottest experts lower the busiest decode device */
        o.eplb = 0;
        cm384_project(m, &o, p);
        printf("  decode expert-device load max/mean: %.2f without EPLB re-placement, %.2f with\n",
               p->decode_load_max_over_mean, q->decode_load_max_over_mean);
        CHECK(q->decode_load_max_over_mean < p->decode_load_max_over_mean, "EPLB does not lower the busiest device");
        o.eplb = 1;
    } else {
        CHECK(0, "no measured load from %s", PJ_SMALL);
    }
    free(load);
    free(p);
    free(q);
}

/* ---- each mechanism's effect, projected (the paper's ablations) ---- */
static void pj_mechanisms(const cm384_model *m) {
    printf("mechanisms at 4096/256, batch 96 (projected; the paper's gain in brackets):\n");
    cm384_projection *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    if (!a || !b) { free(a); free(b); return; }
    cm384_proj_opts o;
    cm384_proj_opts_init(&o);
    o.batch = 96;
    cm384_project(m, &o, a);
    o.microbatches = 1;
    cm384_project(m, &o, b);
    printf("  microbatching: decode %+.1f%% [+9.4%% at batch 96], prefill %+.1f%% [+23-31%%]\n",
           100 * (a->decode_tok_s / b->decode_tok_s - 1), 100 * (a->prefill_tok_s / b->prefill_tok_s - 1));
    CHECK(a->prefill_tok_s > b->prefill_tok_s, "prefill microbatching must overlap the fabric");
    o.microbatches = 2; o.mtp = 0;
    cm384_project(m, &o, b);
    printf("  MTP: decode %+.1f%% [+6-49%%]\n", 100 * (a->decode_tok_s / b->decode_tok_s - 1));
    CHECK(a->decode_tok_s > b->decode_tok_s && b->tokens_per_step == 1, "MTP must pay at batch 96");
    o.mtp = 1; o.cache_reuse = 0.5;
    cm384_project(m, &o, b);
    double x50 = b->prefill_tok_s / a->prefill_tok_s;
    o.cache_reuse = 0.9;
    cm384_project(m, &o, b);
    printf("  context cache: prefill x%.2f at 50%% reuse [x1.42], x%.2f at 90%% [x2.28]\n", x50, b->prefill_tok_s / a->prefill_tok_s);
    CHECK(x50 > 1 && b->prefill_tok_s / a->prefill_tok_s > x50, "reuse must raise prefill throughput");
    o.cache_reuse = 0; o.int8_dispatch = 0;
    cm384_project(m, &o, b);
    printf("  INT8 dispatch: %.1f vs %.1f MB dispatched per device per step, decode %+.1f%%\n", a->dispatch_mb,
           b->dispatch_mb, 100 * (a->decode_tok_s / b->decode_tok_s - 1));
    CHECK(b->dispatch_mb > 3.9 * a->dispatch_mb, "fp32 messages are ~4x INT8's");
    o.int8_dispatch = 1; o.int8 = 0;
    cm384_project(m, &o, b);
    printf("  INT8 W8A8: decode %+.1f%%, prefill %+.1f%%; HBM per decode device %.1f vs %.1f GB\n",
           100 * (a->decode_tok_s / b->decode_tok_s - 1), 100 * (a->prefill_tok_s / b->prefill_tok_s - 1), a->hbm_used_gb,
           b->hbm_used_gb);
    CHECK(a->prefill_tok_s > b->prefill_tok_s && a->hbm_used_gb < b->hbm_used_gb, "W8A8 must pay");
    o.int8 = 1; o.graph_bundling = 0;
    cm384_project(m, &o, b);
    printf("  graph bundling: step %.1f vs %.1f ms (two 0.7 ms host gaps)\n", a->step_ms, b->step_ms);
    CHECK(fabs(b->step_ms - a->step_ms - 1.4) < 1e-6, "two graph launches of 0.7 ms");
    /* the engine's config fields map onto the projection's switches */
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "paper"; c.int8 = 1; c.mtp = 0; c.int8_dispatch = 0; c.cache_bytes = (size_t)-1;
    cm384_proj_opts_init(&o);
    o.cache_reuse = 0.5;
    cm384_proj_opts_from_config(&o, &c);
    CHECK(o.int8 == 1 && o.mtp == 0 && o.int8_dispatch == 0 && o.microbatches == 2 && o.cache_reuse == 0 && o.eplb == 1,
          "cm384_proj_opts_from_config");
    /* H800, for comparison only */
    cm384_proj_opts_init(&o);
    o.batch = 96; o.hw = "h800";
    CHECK(cm384_project(m, &o, b) == CM384_OK, "h800: %s", cm384_last_error());
    printf("  the same deployment on H800s: decode %.0f tok/s/GPU at batch 96 (TPOT %.1f ms), prefill %.0f\n",
           b->decode_tok_s, b->tpot_ms, b->prefill_tok_s);
    int n = cm384_projection_report(a, NULL, 0);
    char *txt = malloc((size_t)n + 1);
    CHECK(txt && cm384_projection_report(a, txt, (size_t)n + 1) == n && strstr(txt, "TPOT") && strstr(txt, "dispatch"),
          "projection report");
    free(txt);
    free(a);
    free(b);
}

static void pj_bad_input(const cm384_model *m) {
    printf("bad input:\n");
    cm384_projection *p = calloc(1, sizeof *p);
    cm384_proj_opts o;
    cm384_proj_opts_init(&o);
    o.prompt = 0;
    CHECK(cm384_project(m, &o, p) == CM384_E_INVALID, "prompt 0");
    cm384_proj_opts_init(&o);
    o.mtp_accept = 1.5;
    CHECK(cm384_project(m, &o, p) == CM384_E_INVALID, "acceptance 1.5");
    cm384_proj_opts_init(&o);
    o.tpot_slo_ms = 0;
    CHECK(cm384_project(m, &o, p) == CM384_E_INVALID, "neither a batch nor a target");
    cm384_proj_opts_init(&o);
    o.hw = "abacus";
    CHECK(cm384_project(m, &o, p) == CM384_E_INVALID, "unknown hardware");
    cm384_proj_opts_init(&o);
    o.struct_size = 3;
    CHECK(cm384_project(m, &o, p) == CM384_E_INVALID, "struct_size");
    CHECK(cm384_project(NULL, NULL, p) == CM384_E_INVALID && cm384_project(m, NULL, NULL) == CM384_E_INVALID, "NULL");
    cm384_projection *old = calloc(1, sizeof *old);
    if (old) {
        old->struct_size = offsetof(cm384_projection, prefill_tok_s);
        memset((char *)old + old->struct_size, 0x5a, sizeof *old - old->struct_size);
        CHECK(cm384_project(m, NULL, old) == CM384_OK && old->struct_size == offsetof(cm384_projection, prefill_tok_s) &&
              old->decode_tok_s > 0 && ((unsigned char *)old)[sizeof *old - 1] == 0x5a,
              "an older, shorter cm384_projection gets only the fields it knows");
        CHECK(cm384_projection_report(old, NULL, 0) == CM384_E_INVALID, "a report from a shorter struct");
        free(old);
    }
    cm384_proj_opts_init(&o);
    o.tpot_slo_ms = 1;
    CHECK(cm384_project(m, &o, p) == CM384_OK && !p->feasible && p->batch == 8, "an unreachable target is reported");
    free(p);
}

TEST_MAIN(project) {
    pj_params();
    cm384_model *m = pj_r1();
    if (m) {
        pj_grounding(m);
        pj_tables(m);
        pj_mechanisms(m);
        pj_bad_input(m);
    }
    cm384_model_free(m);
    return test_summary("project");
}

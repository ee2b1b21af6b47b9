/* test_golden.c -- cm384 against DeepSeek's official inference code.
 *
 * The tiny-dsv3 fixture holds logits, greedy runs, MTP logits and routing
 * computed by deepseek-ai/DeepSeek-V3's inference/model.py in fp32 (see
 * tests/fixtures/tiny-dsv3/README.md).  This test checks, on one device and
 * on the default and paper topologies:
 *   - logits at every position of every reference sequence within 1e-3, and
 *     the same top-1 wherever the reference margin exceeds 1e-3;
 *   - both greedy continuations, token for token, through the scheduler;
 *   - MTP logits within 1e-3;
 *   - the routed experts of every token in every MoE layer (as sets);
 *   - incremental decoding through the KV cache against the full forward
 *     (within 1e-4).
 * Dispatch is fp32 here: the INT8 dispatch's effect is measured in
 * test_engine. */
#include "../cm384.c"
#include "test.h"

#define FIX "tests/fixtures/tiny-dsv3"

static arena A;
static json ref;
static file_map bin;

static const float *ref_array(const json *rec) {
    return (const float *)(bin.data + (size_t)json_num(rec, "offset", 0));
}

static int load_ids(const json *arr, int32_t *ids, int cap) {
    int n = arr->len < cap ? arr->len : cap;
    for (int i = 0; i < n; i++) ids[i] = (int32_t)arr->kids[i].num;
    return n;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

static int collect(void *user, const cm384_event *ev) {
    int *out = user;
    if (ev->kind == CM384_EV_TOKEN && out[0] < 63) out[1 + out[0]++] = ev->token;
    return 0;
}

/* kv_block: tokens per KV block (0: the default 16); odd sizes and blocks
 * longer than an attention-core chunk move the core's chunk edges.
 * rescale_always: the core rescales its running softmax at every new max
 * (core_slack 0), which real scores rarely ask for. */
/* preset NULL: the engine made with a NULL config (every default), which
 * must compute the reference exactly. */
/* Logits of ids[0..n) from a p0-token prefill and then one token at a time
 * on a decode device (the KV cache between), against cm384_eval's one
 * prefill: the largest difference (batch invariance: it must be 0). */
static double incremental_vs_full(cm384_engine *e, const int32_t *ids, int n, int p0, int V) {
    float *full = malloc(sizeof(float) * n * V), *inc = malloc(sizeof(float) * n * V);
    if (!full || !inc) { free(full); free(inc); return INFINITY; }
    cm384_eval(e, ids, n, full, NULL);
    peer *S = &e->peers[LANE_PREFILL];             /* its working memory, with both peers paused */
    peers_pause(e);
    int B = e->kv.block_tokens, nb = (n + B) / B, blocks[64];
    if (nb > 64) { peers_resume(e); free(full); free(inc); return INFINITY; }
    pthread_mutex_lock(&e->pool_mu);
    for (int b = 0; b < nb; b++) blocks[b] = block_get(e);
    pthread_mutex_unlock(&e->pool_mu);
    for (int p = 0; p < n;) {
        int cnt = p == 0 ? p0 : 1;
        microbatch mb = {0};
        mb_arrays *a = &S->mba[0];
        for (int t = 0; t < cnt; t++) { a->pos[t] = p + t; a->tables[t] = blocks; S->dev_of[t] = p ? e->attn_devs[0] : e->pre_devs[0]; }
        mb.n = cnt; mb.tok = ids + p; mb.pos = a->pos; mb.tables = a->tables;
        mb.phase = p ? PHASE_DECODE : PHASE_PREFILL; mb.s = &S->s[0]; mb.logits = inc + (size_t)p * V;
        mb_make_groups(&mb, a->groups, S->dev_of);
        forward_main(e, &S->rg, &mb, 1);
        p += cnt;
    }
    pthread_mutex_lock(&e->pool_mu);
    for (int b = 0; b < nb; b++) block_unref(e, blocks[b]);
    pthread_mutex_unlock(&e->pool_mu);
    peers_resume(e);
    double mx = 0;
    for (size_t k = 0; k < (size_t)n * V; k++) { double d = fabs(full[k] - inc[k]); if (d > mx) mx = d; }
    free(full);
    free(inc);
    return mx;
}

/* The reference's greedy continuations, token for token, through the
 * scheduler (prefill, then decode); label prefixes each line. */
/* Generates the reference's greedy entry g from its prompt (ids, *n) into
 * out (count, then tokens); 1 if the tokens are the reference's.  *status:
 * cm384_generate's. */
static int greedy_matches(cm384_engine *e, const json *g, int32_t ids[256], int *n, int out[64], int *status) {
    *n = load_ids(json_get(g, "prompt"), ids, 256);
    const json *gen = json_get(g, "generated");
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = gen->len;
    s.ignore_eos = 1;
    memset(out, 0, 64 * sizeof(int));
    *status = cm384_generate(e, NULL, ids, *n, &s, collect, out);
    int same = *status == CM384_OK && out[0] == gen->len;
    for (int t = 0; same && t < gen->len; t++) same = out[1 + t] == (int)gen->kids[t].num;
    return same;
}

static void check_greedy(cm384_engine *e, const char *label, const char *same_text) {
    const json *gr = json_get(&ref, "greedy");
    for (int i = 0; i < gr->len; i++) {
        int32_t ids[256];
        int n, r, out[64];
        int same = greedy_matches(e, &gr->kids[i], ids, &n, out, &r);
        printf("  %sgreedy %d (prompt %d): %s\n", label, i, n, same ? same_text : "DIFFERENT");
        CHECK(same, "%sgreedy run %d differs (status %d)", label, i, r);
    }
}

static void check_topology(cm384_model *m, const char *preset, int microbatches, int kv_block, int rescale_always) {
    if (!preset) printf("[NULL config: every default");
    else printf("[%s, %d microbatch%s", preset, microbatches, microbatches > 1 ? "es" : "");
    if (kv_block) printf(", KV blocks of %d", kv_block);
    printf("%s]\n", rescale_always ? ", softmax rescaled at every new max" : "");
    cm384_config c;
    cm384_config_init(&c);
    c.preset = preset;
    c.n_workers = 2;
    c.int8_dispatch = 0;
    c.bf16_combine = -1;        /* the paper preset combines in BF16 unless told not to */
    c.microbatches = microbatches;
    c.kv_block_tokens = kv_block;
    cm384_engine *e;
    int r = cm384_engine_create(m, preset ? &c : NULL, &e);
    if (!preset) preset = "NULL config";
    CHECK(r == CM384_OK, "engine_create(%s): %s", preset, cm384_last_error());
    if (r) return;
    if (rescale_always) e->core_slack = 0;
    const int V = 1024, K = 4, NL = 4;
    e->dbg_route = calloc((size_t)NL * e->max_ctx * K, sizeof(int));

    /* logits and MTP logits of every sequence */
    const json *seqs = json_get(&ref, "sequences"), *mtp = json_get(json_get(&ref, "mtp"), "entries");
    for (int i = 0; i < seqs->len; i++) {
        const json *sq = &seqs->kids[i];
        int32_t ids[256];
        int n = load_ids(json_get(sq, "tokens"), ids, 256);
        float *lg = malloc(sizeof(float) * n * V), *ml = malloc(sizeof(float) * n * V);
        r = cm384_eval(e, ids, n, lg, n > 1 ? ml : NULL);
        CHECK(r == CM384_OK, "eval %s: %s", json_str(sq, "name", ""), cm384_last_error());
        const float *want = ref_array(json_get(sq, "logits"));
        const json *margin = json_get(sq, "top1_margin"), *top1 = json_get(sq, "top1");
        double mx = 0;
        int top_ok = 1, compared = 0;
        for (int t = 0; t < n; t++) {
            for (int v = 0; v < V; v++) {
                double d = fabs(lg[(size_t)t * V + v] - want[(size_t)t * V + v]);
                if (d > mx) mx = d;
            }
            if (margin->kids[t].num > 1e-3) {
                compared++;
                if (argmax(lg + (size_t)t * V, V) != (int)top1->kids[t].num) top_ok = 0;
            }
        }
        printf("  %-12s logits max |diff| %.2e, top-1 same at %d/%d positions", json_str(sq, "name", ""), mx,
               top_ok ? compared : -1, compared);
        CHECK(mx < 1e-3, "%s: max logit diff %g", json_str(sq, "name", ""), mx);
        CHECK(top_ok, "%s: top-1 differs", json_str(sq, "name", ""));
        for (int j = 0; j < mtp->len; j++) {
            if (strcmp(json_str(&mtp->kids[j], "sequence", ""), json_str(sq, "name", ""))) continue;
            const float *wm = ref_array(json_get(&mtp->kids[j], "logits"));
            double mm = 0;
            for (size_t k = 0; k < (size_t)(n - 1) * V; k++) { double d = fabs(ml[k] - wm[k]); if (d > mm) mm = d; }
            printf(", MTP max |diff| %.2e", mm);
            CHECK(mm < 1e-3, "%s: MTP logit diff %g", json_str(sq, "name", ""), mm);
            /* routing: main layers and the MTP layer of seq3 */
            const json *rt = json_get(&ref, "routing");
            if (!strcmp(json_str(rt, "sequence", ""), json_str(sq, "name", ""))) {
                const json *layers = json_get(rt, "layers");
                int bad = 0, total = 0;
                for (int li = 0; li < layers->len; li++) {
                    int l = (int)json_num(&layers->kids[li], "layer", -1);
                    const json *ex = json_get(&layers->kids[li], "expert_ids");
                    for (int t = 0; t < ex->len; t++, total++) {
                        unsigned want_set = 0, got_set = 0;
                        for (int k = 0; k < K; k++) {
                            want_set |= 1u << (int)ex->kids[t].kids[k].num;
                            got_set |= 1u << e->dbg_route[((size_t)l * e->max_ctx + t) * K + k];
                        }
                        bad += want_set != got_set;
                    }
                }
                const json *mr = json_get(&mtp->kids[j], "routing");
                if (mr) {
                    const json *ex = json_get(mr, "expert_ids");
                    for (int t = 0; ex && t < ex->len; t++, total++) {
                        unsigned want_set = 0, got_set = 0;
                        for (int k = 0; k < K; k++) {
                            want_set |= 1u << (int)ex->kids[t].kids[k].num;
                            got_set |= 1u << e->dbg_route[((size_t)3 * e->max_ctx + t) * K + k];
                        }
                        bad += want_set != got_set;
                    }
                }
                printf(", routing %d/%d token-layers identical", total - bad, total);
                CHECK(bad == 0 && total >= 3 * 69, "routing differs for %d of %d token-layers", bad, total);
            }
        }
        printf("\n");
        free(lg);
        free(ml);
    }

    /* greedy continuations through the scheduler (prefill, then decode) */
    check_greedy(e, "", "16/16 tokens identical");

    /* incremental decoding through the KV cache == full forward */
    {
        const json *sq = &seqs->kids[seqs->len - 1];
        int32_t ids[256];
        int n = load_ids(json_get(sq, "tokens"), ids, 256);
        double mx = incremental_vs_full(e, ids, n, 100, V);
        printf("  incremental decode vs full forward (%d tokens): max |diff| %.2e\n", n, mx);
        CHECK(mx == 0, "incremental decoding differs from the full forward by %g (batch invariance: it must be 0)", mx);
    }
    free(e->dbg_route);
    e->dbg_route = NULL;
    cm384_engine_free(e);
}

/* The attention core's lanes (t_core): with 16-key chunks a 250-token
 * sequence has 16 chunks, so each of the 4 lanes takes several and folds
 * run at every step.  Decoded one token at a time (a lone query: its lanes
 * are tasks of their own) it must give the bits of one prefill (lanes in
 * turn), and the logits must stay within float noise of the default
 * 64-key chunks'. */
static void check_lanes(cm384_model *m) {
    printf("[attention core lanes: 16-key chunks, 250 tokens]\n");
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.int8_dispatch = 0; c.max_ctx = 256;
    cm384_engine *e;
    int r = cm384_engine_create(m, &c, &e);
    CHECK(r == CM384_OK, "engine_create: %s", cm384_last_error());
    if (r) return;
    enum { V = 1024, N = 250 };
    int32_t ids[N];
    uint32_t x = 12345;
    for (int i = 0; i < N; i++) { x = x * 1664525u + 1013904223u; ids[i] = (int32_t)((x >> 8) % V); }
    float *ref = malloc(sizeof(float) * N * V), *got = malloc(sizeof(float) * N * V);
    if (ref && got) {
        cm384_eval(e, ids, N, ref, NULL);                /* the default chunks */
        for (int l = 0; l < N_LANES; l++)
            for (int k = 0; k < 2; k++) e->peers[l].s[k].core_chunk = 16;
        double mx = incremental_vs_full(e, ids, N, 37, V);
        printf("  incremental decode vs full forward: max |diff| %.2e\n", mx);
        CHECK(mx == 0, "with 16-key chunks, incremental decoding differs from the full forward by %g", mx);
        cm384_eval(e, ids, N, got, NULL);
        double d = 0;
        for (size_t k = 0; k < (size_t)N * V; k++) if (fabs(got[k] - ref[k]) > d) d = fabs(got[k] - ref[k]);
        printf("  16-key chunks vs 64-key chunks: logits max |diff| %.2e\n", d);
        CHECK(d > 0 && d < 1e-4, "16-key and 64-key chunks give logits %g apart", d);
    }
    free(ref);
    free(got);
    cm384_engine_free(e);
}

/* The largest |got - want| over n logits; *spread = max - min of want. */
static double diff_and_spread(const float *got, const float *want, int n, double *spread) {
    double lo = 1e30, hi = -1e30, mx = 0;
    for (int v = 0; v < n; v++) {
        double w = want[v], d = fabs(got[v] - w);
        if (d > mx) mx = d;
        if (w < lo) lo = w;
        if (w > hi) hi = w;
    }
    *spread = hi - lo;
    return mx;
}

/* Expanded prefill (config.prefill_expanded): DeepSeek's naive MLA, the
 * same model with other rounding.  Its logits must match the reference as
 * the absorbed path's do, with KV blocks of 5 and 16-key chunks (the
 * running softmax over many chunks, rescaled at every new max), and a
 * prompt prefilled 7 tokens a step must give the bits of one prefill (keys
 * chunked by slot, queries by tile: no dependence on the batch); the paper
 * preset (two microbatches a step) must give the reference's greedy
 * continuations.  With INT8 weights the expansion is W8A8 too: measured
 * against the absorbed INT8 path. */
static void check_expanded(cm384_model *m) {
    printf("[expanded prefill]\n");
    enum { V = 1024, N = 250 };
    cm384_engine *e[5] = {0};
    for (int i = 0; i < 5; i++) {
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.int8_dispatch = 0; c.max_ctx = 256;
        c.prefill_expanded = i != 0;
        if (i == 2) c.prefill_chunk = 7, c.max_batch = 2, c.kv_block_tokens = 5;   /* steps of 7 */
        if (i == 3) c.int8 = 1;
        if (i == 4) c.preset = "paper", c.microbatches = 2, c.bf16_combine = -1;    /* two microbatches */
        int r = cm384_engine_create(m, &c, &e[i]);
        CHECK(r == CM384_OK, "engine_create: %s", cm384_last_error());
        if (r) goto done;
    }
    e[2]->x_chunk = 16;
    e[2]->core_slack = 0;
    const json *seqs = json_get(&ref, "sequences"), *mtp = json_get(json_get(&ref, "mtp"), "entries");
    for (int v = 1; v <= 2; v++) {
        double worst = 0, worst_mtp = 0;
        int top_ok = 1, compared = 0, differ = 0;
        for (int i = 0; i < seqs->len; i++) {
            const json *sq = &seqs->kids[i];
            int32_t ids[256];
            int n = load_ids(json_get(sq, "tokens"), ids, 256);
            float *lg = malloc(sizeof(float) * n * V), *ml = malloc(sizeof(float) * n * V), *ab = malloc(sizeof(float) * n * V);
            int r = cm384_eval(e[v], ids, n, lg, n > 1 ? ml : NULL);
            CHECK(r == CM384_OK, "eval %s: %s", json_str(sq, "name", ""), cm384_last_error());
            cm384_eval(e[0], ids, n, ab, NULL);
            const float *want = ref_array(json_get(sq, "logits"));
            const json *margin = json_get(sq, "top1_margin"), *top1 = json_get(sq, "top1");
            for (int t = 0; t < n; t++) {
                for (int k = 0; k < V; k++) {
                    double d = fabs(lg[(size_t)t * V + k] - want[(size_t)t * V + k]);
                    if (d > worst) worst = d;
                    differ += lg[(size_t)t * V + k] != ab[(size_t)t * V + k];
                }
                if (margin->kids[t].num > 1e-3) {
                    compared++;
                    if (argmax(lg + (size_t)t * V, V) != (int)top1->kids[t].num) top_ok = 0;
                }
            }
            for (int j = 0; j < mtp->len; j++) {
                if (strcmp(json_str(&mtp->kids[j], "sequence", ""), json_str(sq, "name", ""))) continue;
                const float *wm = ref_array(json_get(&mtp->kids[j], "logits"));
                for (size_t k = 0; k < (size_t)(n - 1) * V; k++) if (fabs(ml[k] - wm[k]) > worst_mtp) worst_mtp = fabs(ml[k] - wm[k]);
            }
            free(lg); free(ml); free(ab);
        }
        printf("  %s: logits max |diff| %.2e, MTP %.2e, top-1 same at %d/%d positions; %d logits not the absorbed path's bits\n",
               v == 1 ? "one prefill, 256-key chunks" : "7 tokens a step, KV blocks of 5, 16-key chunks, rescaled at every max",
               worst, worst_mtp, top_ok ? compared : -1, compared, differ);
        CHECK(worst < 1e-3 && worst_mtp < 1e-3 && top_ok, "expanded prefill: logits %g (MTP %g) from the reference", worst, worst_mtp);
        CHECK(differ > 0, "expanded prefill gave the absorbed path's bits everywhere: did it run?");
    }
    /* the paper preset (two microbatches a step) through the scheduler:
       the reference's greedy continuations */
    check_greedy(e[4], "paper preset, ", "tokens identical");
    int32_t ids[N];
    uint32_t x = 777;
    for (int i = 0; i < N; i++) { x = x * 1664525u + 1013904223u; ids[i] = (int32_t)((x >> 8) % V); }
    float *a = malloc(sizeof(float) * N * V), *b = malloc(sizeof(float) * N * V);
    if (a && b) {
        /* one prefill against 7 tokens a step, the same chunks */
        cm384_engine_free(e[2]);
        cm384_config c;
        cm384_config_init(&c);
        c.n_workers = 2; c.int8_dispatch = 0; c.max_ctx = 256; c.prefill_expanded = 1; c.prefill_chunk = 7; c.max_batch = 2;
        int r = cm384_engine_create(m, &c, &e[2]);
        CHECK(r == CM384_OK, "engine_create: %s", cm384_last_error());
        if (!r) {
            cm384_eval(e[1], ids, N, a, NULL);
            cm384_eval(e[2], ids, N, b, NULL);
            double d = 0;
            for (size_t k = 0; k < (size_t)N * V; k++) if (fabs(a[k] - b[k]) > d) d = fabs(a[k] - b[k]);
            printf("  %d tokens, one prefill vs 7 tokens a step: max |diff| %.2e\n", N, d);
            CHECK(d == 0, "expanded prefill depends on the prefill chunk: %g", d);
        }
        /* INT8: absorbed against expanded (W8A8 expansion) */
        cm384_config_init(&c);
        c.n_workers = 2; c.int8_dispatch = 0; c.max_ctx = 256; c.int8 = 1;
        cm384_engine *q;
        r = cm384_engine_create(m, &c, &q);
        CHECK(r == CM384_OK, "engine_create: %s", cm384_last_error());
        if (!r) {
            cm384_eval(q, ids, N, a, NULL);
            cm384_eval(e[3], ids, N, b, NULL);
            int close = 0;
            double worst = 0;
            for (int t = 0; t < N; t++) {
                double spread, mx = diff_and_spread(b + (size_t)t * V, a + (size_t)t * V, V, &spread);
                close += mx < 0.02 * spread;
                if (mx / spread > worst) worst = mx / spread;
            }
            printf("  INT8, %d tokens: expanded within 2%% of the logits' spread of absorbed at %d positions (worst %.1f%%)\n",
                   N, close, 100 * worst);
            CHECK(close >= 0.9 * N, "INT8 expanded prefill: only %d of %d positions close to the absorbed path", close, N);
            cm384_engine_free(q);
        }
    }
    free(a);
    free(b);
done:
    for (int i = 0; i < 5; i++) cm384_engine_free(e[i]);
}

/* The bf16 latent cache (config.kv_bf16) is an approximation, so its logits
 * are measured against the reference rather than held to float noise.
 * Rounding each latent value to 8 bits of mantissa moves a logit by a small
 * fraction of its spread -- except where it tips a near-tie in the router
 * and the token goes to another expert, which moves that position's logits
 * a lot (as INT8 dispatch does).  So: at 95% of positions the logits stay
 * within 1% of their spread and top-1 is kept where the reference's margin
 * is wide (> 0.05); the rest of the engine is unchanged, so decoding
 * through the cache still gives the full forward's bits. */
/* With kernels = "avx512_bf16" the attention core over that cache also
 * rounds its queries and softmax weights to bf16 (vdpbf16ps): the same
 * bounds, and the same bits decoded as prefilled. */
static void check_kv_bf16(cm384_model *m, const char *kernels) {
    printf("[bf16 KV cache%s%s]\n", kernels ? ", kernels " : "", kernels ? kernels : "");
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.int8_dispatch = 0; c.kv_bf16 = 1; c.kernels = kernels;
    cm384_engine *e;
    int r = cm384_engine_create(m, &c, &e);
    if (kernels && r == CM384_E_INVALID) {
        printf("  this CPU cannot run %s: not checked here\n", kernels);
        return;
    }
    CHECK(r == CM384_OK, "engine_create: %s", cm384_last_error());
    if (r) return;
    const int V = 1024;
    const json *seqs = json_get(&ref, "sequences");
    int positions = 0, close = 0, wide = 0, wide_same = 0;
    double worst = 0, worst_rel = 0;
    for (int i = 0; i < seqs->len; i++) {
        const json *sq = &seqs->kids[i];
        int32_t ids[256];
        int n = load_ids(json_get(sq, "tokens"), ids, 256);
        float *lg = malloc(sizeof(float) * n * V);
        r = cm384_eval(e, ids, n, lg, NULL);
        CHECK(r == CM384_OK, "eval %s: %s", json_str(sq, "name", ""), cm384_last_error());
        const float *want = ref_array(json_get(sq, "logits"));
        const json *margin = json_get(sq, "top1_margin"), *top1 = json_get(sq, "top1");
        for (int t = 0; t < n; t++, positions++) {
            double spread, mx = diff_and_spread(lg + (size_t)t * V, want + (size_t)t * V, V, &spread);
            close += mx < 0.01 * spread;
            if (mx > worst) worst = mx, worst_rel = mx / spread;
            if (margin->kids[t].num > 0.05) {
                wide++;
                wide_same += argmax(lg + (size_t)t * V, V) == (int)top1->kids[t].num;
            }
        }
        free(lg);
    }
    printf("  %d positions: logits within 1%% of their spread at %d, worst |diff| %.2e (%.0f%% of its spread); "
           "top-1 kept at %d of %d with margin > 0.05\n", positions, close, worst, 100 * worst_rel, wide_same, wide);
    CHECK(close >= 0.95 * positions, "bf16 KV: logits within 1%% of their spread at only %d of %d positions", close,
          positions);
    CHECK(wide_same >= 0.95 * wide, "bf16 KV: top-1 kept at only %d of %d wide-margin positions", wide_same, wide);
    const json *sq = &seqs->kids[seqs->len - 1];
    int32_t ids[256];
    int n = load_ids(json_get(sq, "tokens"), ids, 256);
    double mx = incremental_vs_full(e, ids, n, 100, V);
    printf("  incremental decode vs full forward (%d tokens): max |diff| %.2e\n", n, mx);
    CHECK(mx == 0, "with a bf16 KV cache, incremental decoding differs from the full forward by %g", mx);
    cm384_engine_free(e);
}

/* MTP speculative decoding: every draft made while generating equals the
 * argmax of the MTP logits cm384_eval gives for that position (which match
 * the reference above), and the generated tokens equal the reference's. */
static void check_mtp_drafts(cm384_model *m) {
    printf("[MTP speculative decoding]\n");
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.int8_dispatch = 0; c.mtp = 2;          /* a draft at every position */
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    e->dbg_draft = malloc(sizeof(int) * (size_t)e->max_ctx);
    for (int i = 0; i < e->max_ctx; i++) e->dbg_draft[i] = -1;
    int32_t ids[256];
    int n, r, out[64];
    int same = greedy_matches(e, &json_get(&ref, "greedy")->kids[1], ids, &n, out, &r);
    CHECK(same, "greedy run with MTP differs from the reference (status %d)", r);
    int total = n + out[0];
    for (int t = 0; t < out[0]; t++) ids[n + t] = out[1 + t];
    float *lg = malloc(sizeof(float) * total * 1024), *ml = malloc(sizeof(float) * total * 1024);
    cm384_eval(e, ids, total, lg, ml);
    int checked = 0, agree = 0;
    for (int p = 0; p < total - 1; p++) {
        if (e->dbg_draft[p] < 0) continue;
        checked++;
        agree += e->dbg_draft[p] == argmax(ml + (size_t)p * 1024, 1024);
    }
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    printf("  greedy with MTP: %s; %d/%d drafts equal the MTP head's argmax at their position; %llu/%llu accepted\n",
           same ? "16/16 tokens identical" : "DIFFERENT", agree, checked,
           (unsigned long long)st.mtp_accepted, (unsigned long long)st.mtp_drafted);
    CHECK(checked >= 10 && agree == checked, "drafts: %d of %d agree", agree, checked);
    free(lg); free(ml);
    free(e->dbg_draft);
    e->dbg_draft = NULL;
    cm384_engine_free(e);
}

/* DeepSeek-V2 semantics (plain q_proj or q low-rank, softmax routing,
 * greedy / group-limited top-k, norm_topk_prob, routed scaling, YaRN's
 * cos/sin multiplier) against models/train/dsv2_ref.py, a float32 reference
 * of Hugging Face's DeepSeek-V2 modeling code that is itself tied to the
 * official V3 golden data on every shared part (see each fixture's README). */
static void check_v2(const char *dir) {
    char p[256];
    arena a = {0};
    json rj;
    file_map fb;
    snprintf(p, sizeof p, "%s/reference.json", dir);
    int r = json_load_file(p, &a, &rj);
    snprintf(p, sizeof p, "%s/reference.bin", dir);
    if (r || file_map_open(&fb, p, 1)) { CHECK(0, "%s: cannot read the reference", dir); arena_free(&a); return; }
    cm384_model *m;
    if (cm384_model_load(dir, NULL, &m)) { CHECK(0, "%s: %s", dir, cm384_last_error()); arena_free(&a); return; }
    const int V = m->hp.vocab, K = m->hp.top_k;
    printf("[%s]\n", dir);
    const char *presets[2] = {"single", "default"};
    for (int pi = 0; pi < 2; pi++) {
        cm384_config c;
        cm384_config_init(&c);
        c.preset = presets[pi]; c.n_workers = 2;
        cm384_engine *e;      /* the default topology from a NULL config: every default is exact */
        if (cm384_engine_create(m, pi ? NULL : &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); continue; }
        e->dbg_route = calloc((size_t)(m->hp.n_layers + 1) * e->max_ctx * K, sizeof(int));
        const json *seqs = json_get(&rj, "sequences"), *rt = json_get(&rj, "routing");
        double worst = 0;
        int top_ok = 1, routed_bad = 0, routed_total = 0;
        for (int i = 0; i < seqs->len; i++) {
            const json *sq = &seqs->kids[i];
            int32_t ids[256];
            int n = load_ids(json_get(sq, "tokens"), ids, 256);
            float *lg = malloc(sizeof(float) * n * V);
            cm384_eval(e, ids, n, lg, NULL);
            const float *want = (const float *)(fb.data + (size_t)json_num(json_get(sq, "logits"), "offset", 0));
            const json *margin = json_get(sq, "top1_margin"), *top1 = json_get(sq, "top1");
            for (int t = 0; t < n; t++) {
                for (int v = 0; v < V; v++) worst = fmax(worst, fabs(lg[(size_t)t * V + v] - want[(size_t)t * V + v]));
                if (margin->kids[t].num > 1e-3 && argmax(lg + (size_t)t * V, V) != (int)top1->kids[t].num) top_ok = 0;
            }
            if (!strcmp(json_str(rt, "sequence", ""), json_str(sq, "name", ""))) {
                const json *layers = json_get(rt, "layers");
                for (int li = 0; li < layers->len; li++) {
                    int l = (int)json_num(&layers->kids[li], "layer", -1);
                    const json *ex = json_get(&layers->kids[li], "expert_ids");
                    for (int t = 0; t < ex->len; t++, routed_total++) {
                        unsigned w = 0, g = 0;
                        for (int k = 0; k < K; k++) {
                            w |= 1u << (int)ex->kids[t].kids[k].num;
                            g |= 1u << e->dbg_route[((size_t)l * e->max_ctx + t) * K + k];
                        }
                        routed_bad += w != g;
                    }
                }
            }
            free(lg);
        }
        printf("  %-8s logits max |diff| %.2e, top-1 %s, routing %d/%d token-layers identical\n", presets[pi], worst,
               top_ok ? "identical" : "DIFFERENT", routed_total - routed_bad, routed_total);
        CHECK(worst < 1e-3 && top_ok, "%s (%s): logits differ by %g", dir, presets[pi], worst);
        CHECK(routed_bad == 0 && routed_total > 0, "%s (%s): routing differs for %d", dir, presets[pi], routed_bad);
        free(e->dbg_route);
        e->dbg_route = NULL;
        cm384_engine_free(e);
    }
    cm384_model_free(m);
    file_map_close(&fb);
    arena_free(&a);
}

TEST_MAIN(golden) {
    int r = json_load_file(FIX "/reference.json", &A, &ref);
    if (r || file_map_open(&bin, FIX "/reference.bin", 1)) {
        printf("cannot read the fixture: %s\n", cm384_last_error());
        return 1;
    }
    cm384_model *m;
    r = cm384_model_load(FIX, NULL, &m);
    CHECK(r == CM384_OK, "load: %s", cm384_last_error());
    if (r) return test_summary("golden");
    check_topology(m, NULL, 0, 0, 0);
    check_topology(m, "single", 1, 0, 0);
    check_topology(m, "default", 2, 0, 0);
    check_topology(m, "paper", 2, 0, 0);
    check_topology(m, "default", 1, 5, 1);
    check_topology(m, "single", 1, 100, 0);
    check_mtp_drafts(m);
    check_lanes(m);
    check_kv_bf16(m, NULL);
    check_kv_bf16(m, "avx512_bf16");
    check_expanded(m);
    cm384_model_free(m);
    check_v2("tests/fixtures/tiny-dsv2-lite");
    check_v2("tests/fixtures/tiny-dsv2-group");
    check_v2("tests/fixtures/tiny-dsv2-norm");
    file_map_close(&bin);
    arena_free(&A);
    return test_summary("golden");
}

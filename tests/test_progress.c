/* test_progress.c -- long work shows its progress and its cost: the load
 * callback's sequence of stages (tensors, check, quantize), INT8 weights
 * made during the load and cancellable there, and the memory estimate an
 * engine makes (its arithmetic recomputed here from the tensors, and its
 * warning when physical memory is exceeded).
 *
 *   build/cm384_tests progress [GENERATED_MODEL]
 *
 * GENERATED_MODEL (default build/models/fp8-q-plain, made by tests/run.sh):
 *   gen_synth --preset tiny --dtype fp8 --set q_lora_rank=null \
 *             --set num_hidden_layers=2 --set n_shared_experts=2 DIR */
#ifndef CM384_TEST_ALL
#include "../cm384.c"
#endif
#include "test.h"

#define PR_FIX "tests/fixtures/tiny-dsv3"

/* ---- the callback's sequence ---- */

typedef struct pr_call { char stage[16]; uint64_t done, total; } pr_call;
typedef struct pr_log { pr_call calls[4096]; int n; const char *cancel_stage; } pr_log;

static int pr_record(void *user, const char *stage, uint64_t done, uint64_t total) {
    pr_log *l = user;
    if (l->n < 4096) {
        snprintf(l->calls[l->n].stage, sizeof l->calls[l->n].stage, "%s", stage);
        l->calls[l->n].done = done;
        l->calls[l->n].total = total;
        l->n++;
    }
    return l->cancel_stage && !strcmp(stage, l->cancel_stage) && done * 2 > total;
}

/* Every stage is one run of calls, in the order given; within it the total
 * holds, done never goes back nor past the total, and the last call has
 * done == total. */
static void pr_check_sequence(const pr_log *l, const char *const *stages, int n_stages, const char *what) {
    int i = 0;
    for (int s = 0; s < n_stages; s++) {
        int first = i;
        while (i < l->n && !strcmp(l->calls[i].stage, stages[s])) i++;
        CHECK(i > first, "%s: stage \"%s\" missing (call %d is \"%s\")", what, stages[s], i, i < l->n ? l->calls[i].stage : "-");
        if (i == first) return;
        int ok = 1;
        for (int k = first; k < i; k++) {
            ok &= l->calls[k].total == l->calls[first].total && l->calls[k].done <= l->calls[k].total;
            if (k > first) ok &= l->calls[k].done >= l->calls[k - 1].done;
        }
        CHECK(ok, "%s: stage \"%s\": total changes, done goes back or past the total", what, stages[s]);
        CHECK(l->calls[i - 1].done == l->calls[i - 1].total, "%s: stage \"%s\" ends at %llu of %llu", what, stages[s],
              (unsigned long long)l->calls[i - 1].done, (unsigned long long)l->calls[i - 1].total);
        printf("  %s: \"%s\" %d calls, %llu bytes\n", what, stages[s], i - first, (unsigned long long)l->calls[first].total);
    }
    CHECK(i == l->n, "%s: %d calls after the last stage (\"%s\")", what, l->n - i, i < l->n ? l->calls[i].stage : "");
}

static int pr_count(const pr_log *l, const char *stage) {
    int n = 0;
    for (int i = 0; i < l->n; i++) n += !strcmp(l->calls[i].stage, stage);
    return n;
}

static void pr_sequences(void) {
    printf("load progress:\n");
    static pr_log log;
    cm384_load_opts o;
    cm384_model *m, *plain;

    cm384_load_opts_init(&o);
    o.progress = pr_record;
    o.progress_user = &log;
    memset(&log, 0, sizeof log);
    CHECK(cm384_model_load(PR_FIX, &o, &plain) == CM384_OK, "plain load: %s", cm384_last_error());
    const char *only_tensors[] = {"tensors"};
    pr_check_sequence(&log, only_tensors, 1, "default load");
    CHECK(plain->q8 == NULL, "a load without int8 made INT8 weights");

    memset(&log, 0, sizeof log);
    o.check_values = 1;
    o.int8 = 1;
    CHECK(cm384_model_load(PR_FIX, &o, &m) == CM384_OK, "int8 load: %s", cm384_last_error());
    const char *all[] = {"tensors", "check", "quantize"};
    pr_check_sequence(&log, all, 3, "check_values + int8");
    CHECK(pr_count(&log, "quantize") >= 10, "quantize reported %d times (in steps, not once)", pr_count(&log, "quantize"));
    CHECK(log.n && log.calls[log.n - 1].total == m->q8_bytes, "quantize total %llu, INT8 bytes %llu",
          (unsigned long long)(log.n ? log.calls[log.n - 1].total : 0), (unsigned long long)m->q8_bytes);
    CHECK(m->q8 != NULL, "the INT8 weights were not made during the load");

    /* an engine with int8 uses the copies the load made, and they are the
       ones an engine would have made itself: the same logits, bit for bit */
    struct layer_q8 *made = m->q8;
    cm384_config c;
    cm384_config_init(&c);
    c.int8 = 1;
    c.n_workers = 2;
    cm384_engine *e1 = NULL, *e2 = NULL;
    CHECK(cm384_engine_create(m, &c, &e1) == CM384_OK, "engine on the int8 load: %s", cm384_last_error());
    CHECK(m->q8 == made, "the engine made the INT8 weights again");
    CHECK(cm384_engine_create(plain, &c, &e2) == CM384_OK, "engine making INT8 itself: %s", cm384_last_error());
    int32_t ids[6] = {0, 17, 42, 99, 5, 300};
    int V = cm384_vocab_size(m);
    float *a = malloc(sizeof(float) * 6 * V), *b = malloc(sizeof(float) * 6 * V);
    if (e1 && e2 && a && b) {
        CHECK(cm384_eval(e1, ids, 6, a, NULL) == CM384_OK && cm384_eval(e2, ids, 6, b, NULL) == CM384_OK, "eval");
        CHECK(!memcmp(a, b, sizeof(float) * 6 * V), "INT8 weights made at load give other logits than an engine's");
    }
    free(a);
    free(b);
    cm384_engine_free(e1);
    cm384_engine_free(e2);
    cm384_model_free(m);
    cm384_model_free(plain);

    /* a GGUF file goes through the same stages */
    memset(&log, 0, sizeof log);
    o.check_values = 0;
    CHECK(cm384_model_load("tests/fixtures/gguf/tiny-dsv3-bf16.gguf", &o, &m) == CM384_OK, "GGUF int8 load: %s",
          cm384_last_error());
    const char *gguf_stages[] = {"tensors", "quantize"};
    pr_check_sequence(&log, gguf_stages, 2, "GGUF + int8");
    CHECK(m && m->q8 != NULL, "the GGUF load did not make the INT8 weights");
    cm384_model_free(m);

    /* cancelled half-way through quantizing: the load fails cleanly */
    memset(&log, 0, sizeof log);
    log.cancel_stage = "quantize";
    o.check_values = 0;
    m = (cm384_model *)1;
    int r = cm384_model_load(PR_FIX, &o, &m);
    CHECK(r == CM384_E_CANCELLED && m == NULL, "cancel while quantizing: %d", r);
    CHECK(strstr(cm384_last_error(), "cancelled") != NULL, "message: %s", cm384_last_error());
    const pr_call *last = log.n ? &log.calls[log.n - 1] : NULL;
    CHECK(last && !strcmp(last->stage, "quantize") && last->done < last->total, "the cancelling call was not the last");
}

/* ---- the memory estimate ---- */

static int pr_warnings;
static char pr_warning[1024];
static void pr_on_log(void *user, int level, const char *msg) {
    (void)user;
    if (level >= 2 && strstr(msg, "memory")) { pr_warnings++; snprintf(pr_warning, sizeof pr_warning, "%s", msg); }
}

static int pr_ends(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* The estimate's parts recomputed from the checkpoint's tensors: an INT8
 * engine reads the embeddings, the routers (and the vectors, as fp32
 * copies) in their stored type; every other 2-D weight is replaced by a copy of a byte per weight (in
 * 16-row panels: rows padded to a multiple of 16, columns to 4) and a float per
 * row, kv_b_proj by its per-head W_uk^T [kv_lora x nope] and W_uv
 * [v x kv_lora] copies (and W_uk [nope x kv_lora], for the expanded
 * prefill, unless kv_b_proj is fp8). */
static void pr_estimate(const char *dir) {
    printf("memory estimate (%s):\n", dir);
    cm384_model *m;
    if (cm384_model_load(dir, NULL, &m)) {
        CHECK(0, "%s: %s (tests/run.sh makes it with build/gen_synth)", dir, cm384_last_error());
        return;
    }
    const hparams *hp = &m->hp;
    uint64_t weights = 0, replaced = 0, copies = 0;
    int kv_b_rows = 0;              /* kv_b_proj sliceable by rows: W_uk copies too (expanded prefill) */
    for (int i = 0; i < m->tensors.cap; i++) {
        const tensor_info *t = &m->tensors.items[i];
        if (!t->name || pr_ends(t->name, "_scale_inv")) continue;
        weights += t->nbytes;                              /* weight_bytes counts vectors too */
        if (t->ndim != 2 || pr_ends(t->name, "embed_tokens.weight") || pr_ends(t->name, "mlp.gate.weight")) continue;
        replaced += t->nbytes;
        if (pr_ends(t->name, "kv_b_proj.weight")) {
            kv_b_rows = t->dtype != GL_F8_E4M3;
            continue;
        }
        copies += gl_q8_bytes((int)t->shape[0], (int)t->shape[1]) + 4 * (uint64_t)t->shape[0];
    }
    uint64_t per_head = gl_q8_bytes(hp->kv_lora, hp->qk_nope) + 4 * (uint64_t)hp->kv_lora +
                        gl_q8_bytes(hp->v_head, hp->kv_lora) + 4 * (uint64_t)hp->v_head +
                        (kv_b_rows ? gl_q8_bytes(hp->qk_nope, hp->kv_lora) + 4 * (uint64_t)hp->qk_nope : 0);
    copies += (uint64_t)(hp->n_layers + hp->n_mtp) * hp->n_heads * per_head;
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    CHECK(in.weight_bytes == weights, "weight_bytes %llu, the tensors hold %llu", (unsigned long long)in.weight_bytes,
          (unsigned long long)weights);
    CHECK(m->q8_bytes == copies, "INT8 copies %llu bytes, recomputed %llu", (unsigned long long)m->q8_bytes,
          (unsigned long long)copies);
    CHECK(m->q8_replaced == replaced, "replaced %llu bytes, recomputed %llu", (unsigned long long)m->q8_replaced,
          (unsigned long long)replaced);

    for (int int8 = 0; int8 < 2; int8++) {
        cm384_config c;
        cm384_config_init(&c);
        c.int8 = int8;
        c.n_workers = 2;
        c.max_ctx = 128;
        c.max_batch = 4;
        c.log = pr_on_log;
        cm384_engine *e;
        pr_warnings = 0;
        if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); continue; }
        cm384_stats st;
        memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        cm384_get_stats(e, &st);
        uint64_t own = m->a.total;
        uint64_t w_stored = weights + own, w_int8 = weights - replaced + copies + own;
        uint64_t kv = st.kv_blocks_total * (uint64_t)(hp->n_layers + hp->n_mtp) * 16 * (hp->kv_lora + hp->qk_rope) * 4;
        printf("  int8 %d: weights %llu (int8 %llu), KV %llu, scratch %llu, total %llu of %llu physical\n", int8,
               (unsigned long long)st.mem_weight_bytes, (unsigned long long)st.mem_int8_weight_bytes,
               (unsigned long long)st.mem_kv_bytes, (unsigned long long)st.mem_scratch_bytes,
               (unsigned long long)st.mem_total_bytes, (unsigned long long)st.mem_physical_bytes);
        CHECK(st.mem_weight_bytes == (int8 ? w_int8 : w_stored), "weights %llu, expected %llu",
              (unsigned long long)st.mem_weight_bytes, (unsigned long long)(int8 ? w_int8 : w_stored));
        CHECK(st.mem_int8_weight_bytes == w_int8, "int8 weights %llu, expected %llu",
              (unsigned long long)st.mem_int8_weight_bytes, (unsigned long long)w_int8);
        CHECK(st.mem_kv_bytes == kv, "KV %llu, expected %llu", (unsigned long long)st.mem_kv_bytes, (unsigned long long)kv);
        CHECK(st.mem_scratch_bytes >= st.pool_bytes - kv && st.mem_scratch_bytes < st.pool_bytes - kv + (64u << 20),
              "scratch %llu for a pool of %llu", (unsigned long long)st.mem_scratch_bytes, (unsigned long long)st.pool_bytes);
        CHECK(st.mem_total_bytes == st.mem_weight_bytes + st.mem_kv_bytes + st.mem_scratch_bytes, "total is not the sum");
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        CHECK(st.mem_physical_bytes == (uint64_t)pages * (uint64_t)page, "physical memory %llu",
              (unsigned long long)st.mem_physical_bytes);
        CHECK(pr_warnings == 0, "a warning with memory to spare: %s", pr_warning);
        if (int8) {
            /* the estimate against what the copies really took (the arena
               rounds each allocation up to 16 bytes) */
            CHECK(m->q8_arena.total >= copies && m->q8_arena.total < copies + copies / 20 + 4096,
                  "INT8 copies took %zu bytes, estimated %llu", m->q8_arena.total, (unsigned long long)copies);
        }
        uint64_t total = st.mem_total_bytes;
        cm384_engine_free(e);

        /* on a machine with less memory than that: one warning, naming the
           parts and, when INT8 is off, what INT8 would need */
        uint64_t phys = m->phys_mem;
        m->phys_mem = total - 1;
        pr_warnings = 0;
        pr_warning[0] = 0;
        if (cm384_engine_create(m, &c, &e) == CM384_OK) cm384_engine_free(e);
        m->phys_mem = phys;
        printf("  warning: %s\n", pr_warning);
        CHECK(pr_warnings == 1 && strstr(pr_warning, "exceeds physical memory"), "%d warnings: %s", pr_warnings, pr_warning);
        CHECK(strstr(pr_warning, "KV pool") && strstr(pr_warning, "scratch"), "the warning does not name the parts");
        CHECK((strstr(pr_warning, "with INT8 weights") != NULL) == !int8, "the INT8 hint %s", int8 ? "with INT8 on" : "is missing");
    }
    cm384_model_free(m);
}

TEST_MAIN(progress) {
    pr_sequences();
    pr_estimate(PR_FIX);
    pr_estimate(argc > 1 ? argv[1] : "build/models/fp8-q-plain");
    return test_summary("progress");
}

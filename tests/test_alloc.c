/* test_alloc.c -- nothing is allocated on the per-token path.
 *
 * Linked with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc so every
 * allocation anywhere in the library (engine, kernels, tokenizer) is counted.
 * Eight requests decode side by side; once all of them are past their
 * prompts, the count must not move while they generate the next tokens. */
#include "../cm384.c"
#include "test.h"

#ifndef CM384_TEST_NO_WRAP
void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t s);
void *__real_realloc(void *p, size_t n);

static atomic_int counting;
static atomic_long n_alloc;

void *__wrap_malloc(size_t n) {
    if (atomic_load(&counting)) atomic_fetch_add(&n_alloc, 1);
    return __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t s) {
    if (atomic_load(&counting)) atomic_fetch_add(&n_alloc, 1);
    return __real_calloc(n, s);
}
void *__wrap_realloc(void *p, size_t n) {
    if (atomic_load(&counting)) atomic_fetch_add(&n_alloc, 1);
    return __real_realloc(p, n);
}
#endif

#define NREQ 8
static atomic_int produced[NREQ];

static int alloc_on_event(void *user, const cm384_event *ev) {
    if (ev->kind == CM384_EV_TOKEN) atomic_fetch_add(&produced[(intptr_t)user], 1);
    return 0;
}

static int min_produced(void) {
    int mn = INT_MAX;
    for (int i = 0; i < NREQ; i++) { int v = atomic_load(&produced[i]); if (v < mn) mn = v; }
    return mn;
}

static void wait_for(int n) {
    while (min_produced() < n) { struct timespec ts = {0, 1000000}; nanosleep(&ts, NULL); }
}

/* Runs NREQ requests and counts allocations over `steps` decode steps once
 * every request is past its prompt.  kset: a kernel set to pin (NULL: the
 * fastest this CPU has); int8: W8A8 weights. */
static void run(cm384_model *m, const char *preset, int int8_dispatch, int microbatches, int mtp, int int8,
                const char *kset, int steps_wanted) {
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.preset = preset; c.int8_dispatch = int8_dispatch; c.microbatches = microbatches; c.mtp = mtp;
    c.int8 = int8; c.max_ctx = 256;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    if (kset) e->k = gl_kernels_by_name(kset);
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 10 + steps_wanted + 20; s.ignore_eos = 1; s.temperature = 0.8f; s.top_p = 0.9f; s.seed = 7;
    int32_t prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = 3 + i * 17 % 1000;
    for (int i = 0; i < NREQ; i++) {
        atomic_store(&produced[i], 0);
        cm384_request rq;
        cm384_request_init(&rq);
        rq.ids = prompt; rq.n_ids = 10 + 3 * i; rq.sampling = &s; rq.on_event = alloc_on_event; rq.user = (void *)(intptr_t)i;
        cm384_submit(e, &rq, NULL);
    }
    wait_for(5);
    atomic_store(&n_alloc, 0);
    atomic_store(&counting, 1);
    int before = min_produced();
    wait_for(before + steps_wanted);
    atomic_store(&counting, 0);
    int steps = min_produced() - before;
    long n = atomic_load(&n_alloc);
    printf("  %-7s %-11s int8 dispatch %d, %d microbatch%s%s%s: %ld allocations during %d+ decode steps of %d requests\n",
           preset, e->k->name, int8_dispatch, microbatches, microbatches > 1 ? "es" : "", mtp ? ", MTP" : "",
           int8 ? ", W8A8" : "", n, steps, NREQ);
    CHECK(n == 0 && steps >= steps_wanted, "%ld allocations on the token path", n);
    cm384_wait_all(e);
    cm384_engine_free(e);
}

TEST_MAIN(alloc) {
#ifdef CM384_TEST_NO_WRAP
    printf("alloc: this linker has no --wrap, allocations cannot be counted here\n");
    return 0;
#endif
    cm384_model *m;
    if (cm384_model_load("tests/fixtures/tiny-dsv3", NULL, &m)) { printf("%s\n", cm384_last_error()); return 1; }
    printf("allocations on the per-token path:\n");
    run(m, "default", 1, 2, 0, 0, NULL, 40);
    run(m, "paper", 0, 2, 0, 0, NULL, 40);
    run(m, "single", 1, 1, 0, 0, NULL, 40);
    run(m, "default", 1, 2, 2, 0, NULL, 40);
    run(m, "default", 1, 2, 1, 0, NULL, 40);
    cm384_model_free(m);
    /* DeepSeek-V3's hidden width (7168, wider than any stack scratch of the
       kernels), from models/gen: gen_synth --preset tiny --set hidden_size=7168 */
    const char *wide = argc > 1 ? argv[1] : "build/models/v3-width";
    if (cm384_model_load(wide, NULL, &m)) {
        CHECK(0, "%s (make it with build/gen_synth --preset tiny --set hidden_size=7168 --no-index %s): %s", wide, wide,
              cm384_last_error());
        return test_summary("alloc");
    }
    printf("at hidden size %d:\n", m->hp.dim);
    run(m, "default", 1, 1, 1, 0, NULL, 6);
    run(m, "default", 0, 1, 0, 1, NULL, 6);
    run(m, "single", 0, 1, 0, 0, "scalar", 2);
    cm384_model_free(m);
    return test_summary("alloc");
}

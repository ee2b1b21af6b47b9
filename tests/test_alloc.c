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

static void run(cm384_model *m, const char *preset, int int8_dispatch, int microbatches, int mtp) {
    cm384_config c;
    cm384_config_init(&c);
    c.n_workers = 2; c.preset = preset; c.int8_dispatch = int8_dispatch; c.microbatches = microbatches; c.mtp = mtp;
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) { CHECK(0, "engine: %s", cm384_last_error()); return; }
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = 200; s.ignore_eos = 1; s.temperature = 0.8f; s.top_p = 0.9f; s.seed = 7;
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
    wait_for(45);
    atomic_store(&counting, 0);
    int steps = min_produced() - before;
    long n = atomic_load(&n_alloc);
    printf("  %-8s int8 dispatch %d, %d microbatch%s%s: %ld allocations during %d+ decode steps of %d requests\n",
           preset, int8_dispatch, microbatches, microbatches > 1 ? "es" : "", mtp ? ", MTP" : "", n, steps, NREQ);
    CHECK(n == 0 && steps >= 30, "%ld allocations on the token path", n);
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
    run(m, "default", 1, 2, 0);
    run(m, "paper", 0, 2, 0);
    run(m, "single", 1, 1, 0);
    run(m, "default", 1, 2, 1);
    cm384_model_free(m);
    return test_summary("alloc");
}

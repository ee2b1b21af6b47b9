/* cm384_logits.c -- cm384's side of the GGUF comparison, the same interface
 * as llama_logits.c (a client of cm384.h only):
 *
 *   cm384_logits MODEL OUT.bin ID ID ...        logits: n x vocab floats
 *   cm384_logits MODEL --bench P N [THREADS]    load, prefill P, decode N
 *
 * MODEL is a .gguf file or a Hugging Face directory.  The engine runs on one
 * device with fp32 dispatch (the exact default numerics; INT8 dispatch is an
 * approximation this comparison leaves out).  Prints one JSON line. */
#define _POSIX_C_SOURCE 200809L
#include "../../cm384.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static double peak_rss_mb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    if (f) fclose(f);
    return kb / 1024.0;
}

typedef struct { double t_first; int n; } timing;

static int on_event(void *user, const cm384_event *ev) {
    timing *t = user;
    if (ev->kind == CM384_EV_TOKEN && t->n++ == 0) t->t_first = now_ms();
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODEL OUT.bin ID... | MODEL --bench P N [THREADS]\n", argv[0]); return 2; }
    int bench = !strcmp(argv[2], "--bench");
    double t0 = now_ms();
    cm384_model *m;
    cm384_engine *e;
    if (cm384_model_load(argv[1], NULL, &m)) { fprintf(stderr, "cm384_logits: %s\n", cm384_last_error()); return 1; }
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "single";
    c.int8_dispatch = 0;
    c.n_workers = bench && argc > 5 ? atoi(argv[5]) : 2;
    int n = bench ? atoi(argv[3]) + atoi(argv[4]) : argc - 3;
    c.max_ctx = (n + 16 + 15) / 16 * 16;   /* whole KV blocks */
    c.max_batch = 1;
    if (cm384_engine_create(m, &c, &e)) { fprintf(stderr, "cm384_logits: %s\n", cm384_last_error()); return 1; }
    double load_ms = now_ms() - t0, rss = peak_rss_mb();
    int V = cm384_vocab_size(m);
    if (!bench) {
        int32_t *ids = malloc(sizeof *ids * (size_t)n);
        float *l = malloc(sizeof *l * (size_t)n * (size_t)V);
        for (int i = 0; i < n; i++) ids[i] = atoi(argv[3 + i]);
        if (cm384_eval(e, ids, n, l, NULL)) { fprintf(stderr, "cm384_logits: %s\n", cm384_last_error()); return 1; }
        FILE *f = fopen(argv[2], "wb");
        fwrite(l, sizeof(float), (size_t)n * (size_t)V, f);
        fclose(f);
        printf("{\"vocab\": %d, \"n\": %d, \"load_ms\": %.1f, \"rss_mb\": %.1f}\n", V, n, load_ms, rss);
        free(ids); free(l);
    } else {
        int P = atoi(argv[3]), N = atoi(argv[4]);
        int32_t *ids = malloc(sizeof *ids * (size_t)P);
        for (int i = 0; i < P; i++) ids[i] = 3 + (i * 131) % (V - 3);
        cm384_sampling s;
        cm384_sampling_init(&s);
        s.max_tokens = N;
        s.ignore_eos = 1;
        timing t = {0, 0};
        double t1 = now_ms();
        if (cm384_generate(e, NULL, ids, P, &s, on_event, &t)) { fprintf(stderr, "cm384_logits: %s\n", cm384_last_error()); return 1; }
        double t3 = now_ms();
        /* prefill ends with the first token; decode is the N-1 after it */
        printf("{\"vocab\": %d, \"load_ms\": %.1f, \"rss_mb\": %.1f, \"prefill_tok_s\": %.1f, \"decode_tok_s\": %.1f, "
               "\"rss_end_mb\": %.1f}\n", V, load_ms, rss, P / ((t.t_first - t1) / 1e3),
               (t.n - 1) / ((t3 - t.t_first) / 1e3), peak_rss_mb());
        free(ids);
    }
    cm384_engine_free(e);
    cm384_model_free(m);
    return 0;
}

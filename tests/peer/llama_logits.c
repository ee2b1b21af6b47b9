/* llama_logits.c -- llama.cpp's side of the GGUF comparison: loads a GGUF
 * file with libllama (the peer build, CPU only, flash attention off), runs
 * one sequence, and writes every position's logits; optionally times a
 * prefill and a greedy decode on the same file.
 *
 *   llama_logits FILE.gguf OUT.bin ID ID ...        logits: n x vocab floats
 *   llama_logits FILE.gguf --bench P N [THREADS]    load, prefill P, decode N
 *
 * Prints one JSON line: vocab, n, load_ms, rss_mb (peak after loading),
 * and with --bench prefill_tok_s and decode_tok_s.  cm384_logits.c is the
 * same tool on cm384, so tests/peer/check-peer.sh compares like with like.
 * Built by check-peer.sh against the peer's static libraries. */
#include "llama.h"

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

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int decode(struct llama_context *ctx, const llama_token *ids, int n, int pos0, int all_logits) {
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = ids[i];
        b.pos[i] = pos0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = all_logits || i == n - 1;
    }
    b.n_tokens = n;
    int r = llama_decode(ctx, b);
    llama_batch_free(b);
    return r;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s FILE.gguf OUT.bin ID... | FILE.gguf --bench P N [THREADS]\n", argv[0]); return 2; }
    int bench = !strcmp(argv[2], "--bench");
    int threads = bench && argc > 5 ? atoi(argv[5]) : 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    double t0 = now_ms();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "llama_logits: cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    int n = bench ? atoi(argv[3]) + atoi(argv[4]) : argc - 3;
    cp.n_ctx = (uint32_t)(n + 16);
    cp.n_batch = cp.n_ubatch = (uint32_t)(n + 16);
    cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama_logits: cannot create a context\n"); return 1; }
    double load_ms = now_ms() - t0, rss = peak_rss_mb();
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int V = llama_vocab_n_tokens(vocab);
    if (!bench) {
        llama_token *ids = malloc(sizeof *ids * (size_t)n);
        for (int i = 0; i < n; i++) ids[i] = atoi(argv[3 + i]);
        if (decode(ctx, ids, n, 0, 1)) { fprintf(stderr, "llama_logits: decode failed\n"); return 1; }
        FILE *f = fopen(argv[2], "wb");
        for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t)V, f);
        fclose(f);
        printf("{\"vocab\": %d, \"n\": %d, \"load_ms\": %.1f, \"rss_mb\": %.1f}\n", V, n, load_ms, rss);
        free(ids);
    } else {
        int P = atoi(argv[3]), N = atoi(argv[4]);
        llama_token *ids = malloc(sizeof *ids * (size_t)(P + N));
        for (int i = 0; i < P; i++) ids[i] = 3 + (i * 131) % (V - 3);
        double t1 = now_ms();
        if (decode(ctx, ids, P, 0, 0)) { fprintf(stderr, "llama_logits: prefill failed\n"); return 1; }
        double t2 = now_ms();
        for (int k = 0; k < N; k++) {
            const float *l = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int v = 1; v < V; v++) if (l[v] > l[best]) best = v;
            ids[P + k] = best;
            if (decode(ctx, &ids[P + k], 1, P + k, 0)) { fprintf(stderr, "llama_logits: decode failed\n"); return 1; }
        }
        double t3 = now_ms();
        printf("{\"vocab\": %d, \"load_ms\": %.1f, \"rss_mb\": %.1f, \"prefill_tok_s\": %.1f, \"decode_tok_s\": %.1f, "
               "\"rss_end_mb\": %.1f}\n", V, load_ms, rss, P / ((t2 - t1) / 1e3), N / ((t3 - t2) / 1e3), peak_rss_mb());
        free(ids);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

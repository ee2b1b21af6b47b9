/* cm384 -- the command-line tool, a client of cm384.h like any embedder.
 *
 *   cm384 run        -m DIR -p "prompt"     generate, streaming the text
 *   cm384 chat       -m DIR                 chat in DeepSeek's format
 *   cm384 tokenize   -m DIR|tokenizer.json "text"
 *   cm384 eval       -m DIR "text"          top next tokens at every position
 *   cm384 perplexity -m DIR FILE            mean loss over a text file
 *   cm384 bench      -m DIR                 drive a workload, print the report
 *   cm384 info       -m DIR                 what the model is
 *
 * `cm384 help` lists every option. */
#define _POSIX_C_SOURCE 200809L
#include "../cm384.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- options ---- */

typedef struct opts {
    const char *model, *prompt, *system, *trace, *preset, *file;
    int         n_tokens, n_prompt, threads, devices, max_ctx, top, report, json, int8, int8_dispatch, mtp;
    int         microbatches, requests, concurrency, tenants, bos, window, quiet;
    float       temperature, top_p, min_p, shared_prefix;
    int         top_k;
    long long   seed;
    const char *args[8];
    int         n_args;
} opts;

static void usage(void) {
    printf(
        "usage: cm384 COMMAND [options]\n"
        "commands:\n"
        "  run         generate from a prompt (-p) and stream the text\n"
        "  chat        interactive chat (DeepSeek chat format); one line per user turn\n"
        "  tokenize    print the ids of TEXT (model dir or a tokenizer.json)\n"
        "  eval        print the top next tokens at every position of TEXT\n"
        "  perplexity  mean next-token loss over FILE in windows of --ctx tokens\n"
        "  bench       run a workload and print throughput, latency and the supernode report\n"
        "  info        print the model's shapes and sizes\n"
        "options:\n"
        "  -m DIR            model directory (default models/shakespeare)\n"
        "  -p TEXT           prompt (run); prompt tokens (bench, default 128)\n"
        "  -n N              tokens to generate (default 128; bench 64)\n"
        "  -t N              worker threads (default: online cores)\n"
        "  --temp T --top-k K --top-p P --min-p P --seed S   sampling (default greedy)\n"
        "  --system TEXT     system prompt (chat)\n"
        "  --preset NAME     default | paper | single\n"
        "  --devices N       emulated devices (default 384)\n"
        "  --microbatches N  1 or 2 (default: 2 with --preset paper, else 1)\n"
        "  --ctx N           max context (run/bench) or window (perplexity)\n"
        "  --int8            INT8 W8A8 weights\n"
        "  --int8-dispatch     dispatch tokens to experts in INT8 (an approximation;\n"
        "                      the paper preset's default)\n"
        "  --no-int8-dispatch  dispatch tokens to experts in fp32 (exact; the default)\n"
        "  --mtp             speculative decoding with the MTP layer\n"
        "  --trace FILE      write a Chrome trace (open in Perfetto)\n"
        "  --report          print the supernode report after generating\n"
        "  --top N           tokens shown per position (eval, default 5)\n"
        "  --bos             prepend BOS (tokenize)\n"
        "  bench: --requests N --concurrency C --shared-prefix F --tenants T --json\n");
}

static int parse(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->model = "models/shakespeare";
    o->n_tokens = -1; o->n_prompt = -1; o->top = 5; o->int8_dispatch = -1; o->microbatches = 0;
    o->requests = 16; o->concurrency = 16; o->tenants = 1; o->top_p = 1.0f; o->seed = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define VAL (v ? (i++, v) : (fprintf(stderr, "cm384: %s needs a value\n", a), exit(2), ""))
        if (!strcmp(a, "-m")) o->model = VAL;
        else if (!strcmp(a, "-p")) { o->prompt = VAL; o->n_prompt = atoi(o->prompt); }
        else if (!strcmp(a, "-n")) o->n_tokens = atoi(VAL);
        else if (!strcmp(a, "-t")) o->threads = atoi(VAL);
        else if (!strcmp(a, "--temp")) o->temperature = (float)atof(VAL);
        else if (!strcmp(a, "--top-k")) o->top_k = atoi(VAL);
        else if (!strcmp(a, "--top-p")) o->top_p = (float)atof(VAL);
        else if (!strcmp(a, "--min-p")) o->min_p = (float)atof(VAL);
        else if (!strcmp(a, "--seed")) o->seed = atoll(VAL);
        else if (!strcmp(a, "--system")) o->system = VAL;
        else if (!strcmp(a, "--preset")) o->preset = VAL;
        else if (!strcmp(a, "--devices")) o->devices = atoi(VAL);
        else if (!strcmp(a, "--microbatches")) o->microbatches = atoi(VAL);
        else if (!strcmp(a, "--ctx")) { o->max_ctx = atoi(VAL); o->window = o->max_ctx; }
        else if (!strcmp(a, "--int8")) o->int8 = 1;
        else if (!strcmp(a, "--no-int8-dispatch")) o->int8_dispatch = 0;
        else if (!strcmp(a, "--int8-dispatch")) o->int8_dispatch = 1;
        else if (!strcmp(a, "--mtp")) o->mtp = 1;
        else if (!strcmp(a, "--trace")) o->trace = VAL;
        else if (!strcmp(a, "--report")) o->report = 1;
        else if (!strcmp(a, "--top")) o->top = atoi(VAL);
        else if (!strcmp(a, "--bos")) o->bos = 1;
        else if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--quiet")) o->quiet = 1;
        else if (!strcmp(a, "--requests")) o->requests = atoi(VAL);
        else if (!strcmp(a, "--concurrency")) o->concurrency = atoi(VAL);
        else if (!strcmp(a, "--shared-prefix")) o->shared_prefix = (float)atof(VAL);
        else if (!strcmp(a, "--tenants")) o->tenants = atoi(VAL);
        else if (a[0] == '-' && a[1]) { fprintf(stderr, "cm384: unknown option %s (cm384 help)\n", a); return 2; }
        else if (o->n_args < 8) o->args[o->n_args++] = a;
#undef VAL
    }
    return 0;
}

static int die(const char *what, int status) {
    fprintf(stderr, "cm384: %s: %s\n", what, cm384_last_error()[0] ? cm384_last_error() : cm384_strerror(status));
    return 1;
}

static int on_progress(void *user, const char *stage, uint64_t done, uint64_t total) {
    int *last = user, pct = total ? (int)(100.0 * (double)done / (double)total) : 100;
    if (total > (64u << 20) && pct / 10 != *last / 10) {          /* big models: every 10% */
        fprintf(stderr, "\rloading %s: %3d%%%s", stage, pct, pct >= 100 ? "\n" : "");
        *last = pct;
    }
    return 0;
}

static int load(const opts *o, cm384_model **m) {
    cm384_load_opts lo;
    cm384_load_opts_init(&lo);
    int last = -10;
    lo.progress = on_progress;
    lo.progress_user = &last;
    int r = cm384_model_load(o->model, &lo, m);
    if (r) return die("loading the model", r);
    return 0;
}

static int make_engine(const opts *o, cm384_model *m, cm384_engine **e) {
    cm384_config c;
    cm384_config_init(&c);
    if (o->threads) c.n_workers = o->threads;
    if (o->devices) c.n_devices = o->devices;
    if (o->preset) c.preset = o->preset;
    if (o->max_ctx) c.max_ctx = o->max_ctx;
    c.int8 = o->int8;
    c.int8_dispatch = o->int8_dispatch;
    c.microbatches = o->microbatches;
    c.mtp = o->mtp;
    c.trace_path = o->trace;
    int r = cm384_engine_create(m, &c, e);
    if (r) return die("creating the engine", r);
    return 0;
}

static void sampling_from(const opts *o, cm384_sampling *s, int dflt_tokens) {
    cm384_sampling_init(s);
    s->temperature = o->temperature;
    s->top_k = o->top_k;
    s->top_p = o->top_p;
    s->min_p = o->min_p;
    s->seed = (uint64_t)o->seed;
    s->max_tokens = o->n_tokens > 0 ? o->n_tokens : dflt_tokens;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- run / chat ---- */

typedef struct stream { FILE *out; int n; char *capture; size_t cap_len, cap_cap; } stream;

static int print_event(void *user, const cm384_event *ev) {
    stream *s = user;
    if (ev->text_len) {
        fwrite(ev->text, 1, ev->text_len, s->out);
        fflush(s->out);
        if (s->capture && s->cap_len + ev->text_len < s->cap_cap) {
            memcpy(s->capture + s->cap_len, ev->text, ev->text_len);
            s->cap_len += ev->text_len;
            s->capture[s->cap_len] = 0;
        }
    }
    if (ev->kind == CM384_EV_TOKEN) s->n++;
    if (ev->kind != CM384_EV_TOKEN) {
        fprintf(stderr, "\n[%d prompt tokens (%d cached), %d generated, TTFT %.1f ms, %.1f ms/token]\n",
                ev->n_prompt, ev->n_cached, ev->n_generated, ev->ttft_ms, ev->tpot_ms);
    }
    return 0;
}

static void print_report(cm384_engine *e) {
    int n = cm384_report(e, NULL, 0);
    char *buf = malloc((size_t)n + 1);
    cm384_report(e, buf, (size_t)n + 1);
    fputs(buf, stdout);
    free(buf);
}

static int cmd_run(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return 1;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return 1; }
    const char *prompt = o->prompt ? o->prompt : o->n_args ? o->args[0] : "";
    cm384_sampling s;
    sampling_from(o, &s, 128);
    stream st = {stdout, 0, NULL, 0, 0};
    fputs(prompt, stdout);
    int r = cm384_generate(e, prompt, NULL, 0, &s, print_event, &st);
    if (r && r != CM384_E_CANCELLED) { die("generating", r); }
    if (o->report) { printf("\n"); print_report(e); }
    cm384_engine_free(e);
    cm384_model_free(m);
    return r ? 1 : 0;
}

static int cmd_chat(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return 1;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return 1; }
    cm384_chat_msg msgs[256];
    char *owned[256];
    int n = 0;
    if (o->system) msgs[n++] = (cm384_chat_msg){"system", o->system, NULL, 0};
    char line[4096];
    fprintf(stderr, "chat with %s (empty line or EOF ends)\n", o->model);
    while (n < 250) {
        fprintf(stderr, "> ");
        if (!fgets(line, sizeof line, stdin) || line[0] == '\n') break;
        line[strcspn(line, "\n")] = 0;
        owned[n] = strdup(line);
        msgs[n] = (cm384_chat_msg){"user", owned[n], NULL, 0};
        n++;
        int len = cm384_chat_render(m, msgs, n, CM384_CHAT_ADD_GENERATION_PROMPT, NULL, 0);
        if (len < 0) { die("chat_render", len); break; }
        char *text = malloc((size_t)len + 1);
        cm384_chat_render(m, msgs, n, CM384_CHAT_ADD_GENERATION_PROMPT, text, (size_t)len + 1);
        int n_ids = cm384_tokenize(m, text, (size_t)len, NULL, 0, 0);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n_ids > 0 ? n_ids : 1));
        cm384_tokenize(m, text, (size_t)len, ids, n_ids, 0);
        cm384_sampling s;
        sampling_from(o, &s, 256);
        char *reply = calloc(1, 1 << 16);
        stream st = {stdout, 0, reply, 0, 1 << 16};
        int r = cm384_generate(e, NULL, ids, n_ids, &s, print_event, &st);
        printf("\n");
        free(text);
        free(ids);
        if (r) { die("generating", r); free(reply); break; }
        owned[n] = reply;
        msgs[n++] = (cm384_chat_msg){"assistant", reply, NULL, 0};
    }
    for (int i = o->system ? 1 : 0; i < n; i++) free(owned[i]);
    cm384_engine_free(e);
    cm384_model_free(m);
    return 0;
}

/* ---- tokenize / eval ---- */

static int cmd_tokenize(const opts *o) {
    cm384_model *m;
    if (load(o, &m)) return 1;
    const char *text = o->n_args ? o->args[0] : o->prompt ? o->prompt : "";
    int n = cm384_tokenize(m, text, strlen(text), NULL, 0, o->bos ? CM384_TOK_ADD_BOS : 0);
    if (n < 0) { cm384_model_free(m); return die("tokenize", n); }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    cm384_tokenize(m, text, strlen(text), ids, n, o->bos ? CM384_TOK_ADD_BOS : 0);
    printf("[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
    printf("]\n");
    if (!o->quiet)
        for (int i = 0; i < n; i++) {
            char piece[256];
            cm384_detokenize(m, &ids[i], 1, piece, sizeof piece);
            printf("%6d  %s\n", ids[i], piece);
        }
    free(ids);
    cm384_model_free(m);
    return 0;
}

static int cmd_eval(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return 1;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return 1; }
    const char *text = o->n_args ? o->args[0] : o->prompt ? o->prompt : "";
    int n = cm384_tokenize(m, text, strlen(text), NULL, 0, CM384_TOK_ADD_BOS);
    if (n <= 0) { cm384_engine_free(e); cm384_model_free(m); return die("tokenize", n); }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    cm384_tokenize(m, text, strlen(text), ids, n, CM384_TOK_ADD_BOS);
    int V = cm384_vocab_size(m);
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    int r = cm384_eval(e, ids, n, lg, NULL);
    if (r) { free(ids); free(lg); cm384_engine_free(e); cm384_model_free(m); return die("eval", r); }
    for (int t = 0; t < n; t++) {
        char piece[256];
        cm384_detokenize(m, &ids[t], 1, piece, sizeof piece);
        float *row = lg + (size_t)t * V, mx = row[0];
        for (int v = 1; v < V; v++) if (row[v] > mx) mx = row[v];
        double z = 0;
        for (int v = 0; v < V; v++) z += exp(row[v] - mx);
        printf("%4d %6d %-16.16s ->", t, ids[t], piece);
        for (int k = 0; k < o->top && k < V; k++) {
            int best = -1;
            for (int v = 0; v < V; v++)
                if ((best < 0 || row[v] > row[best]) && row[v] > -INFINITY) best = v;
            char p2[256];
            if (cm384_detokenize(m, &best, 1, p2, sizeof p2) < 0) snprintf(p2, sizeof p2, "<%d>", best);
            for (char *c = p2; *c; c++) if (*c == '\n') *c = ' ';
            printf("  %s (%.3f)", p2, exp(row[best] - mx) / z);
            row[best] = -INFINITY;
        }
        printf("\n");
    }
    free(ids);
    free(lg);
    cm384_engine_free(e);
    cm384_model_free(m);
    return 0;
}

/* ---- perplexity ---- */

static int cmd_perplexity(const opts *o) {
    const char *path = o->n_args ? o->args[0] : NULL;
    if (!path) { fprintf(stderr, "cm384 perplexity: give a text file\n"); return 2; }
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 1; }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    size_t got = fread(text, 1, (size_t)len, f);
    fclose(f);
    text[got] = 0;
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return 1;
    int W = o->window > 1 ? o->window : 256;
    opts oo = *o;
    oo.max_ctx = W;
    oo.int8_dispatch = o->int8_dispatch;
    if (make_engine(&oo, m, &e)) { cm384_model_free(m); return 1; }
    int n = cm384_tokenize(m, text, got, NULL, 0, 0);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    cm384_tokenize(m, text, got, ids, n, 0);
    int V = cm384_vocab_size(m);
    float *lg = malloc(sizeof(float) * (size_t)W * V);
    /* non-overlapping windows of W tokens; each scored on all its positions
       (W-1 predictions) */
    double nll = 0;
    long count = 0;
    double t0 = now_s();
    for (int w0 = 0; w0 + 1 < n; w0 += W) {
        int wn = n - w0 < W ? n - w0 : W;
        int r = cm384_eval(e, ids + w0, wn, lg, NULL);
        if (r) { die("eval", r); break; }
        for (int t = 0; t + 1 < wn; t++) {
            float *row = lg + (size_t)t * V, mx = row[0];
            for (int v = 1; v < V; v++) if (row[v] > mx) mx = row[v];
            double z = 0;
            for (int v = 0; v < V; v++) z += exp((double)row[v] - mx);
            nll += log(z) + mx - row[ids[w0 + t + 1]];
            count++;
        }
    }
    double dt = now_s() - t0;
    printf("%s: %d tokens, windows of %d, %ld predictions: mean loss %.6f nats/token, perplexity %.4f (%.1f tok/s)\n",
           path, n, W, count, nll / (count ? count : 1), exp(nll / (count ? count : 1)), count / dt);
    free(ids); free(lg); free(text);
    cm384_engine_free(e);
    cm384_model_free(m);
    return 0;
}

/* ---- bench ---- */

typedef struct bench_req { int32_t *ids; int n; uint64_t id; int done; } bench_req;

static int bench_event(void *user, const cm384_event *ev) {
    bench_req *b = user;
    if (ev->kind != CM384_EV_TOKEN) b->done = 1;
    return 0;
}

static int cmd_bench(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    double t_load = now_s();
    if (load(o, &m)) return 1;
    t_load = now_s() - t_load;
    int P = o->n_prompt > 0 ? o->n_prompt : 128, N = o->n_tokens > 0 ? o->n_tokens : 64;
    int R = o->requests > 0 ? o->requests : 1, C = o->concurrency > 0 ? o->concurrency : 1;
    if (C > R) C = R;
    opts oo = *o;
    if (!oo.max_ctx) oo.max_ctx = P + N + 16;
    if (make_engine(&oo, m, &e)) { cm384_model_free(m); return 1; }
    int V = cm384_vocab_size(m), bos = cm384_token_bos(m);
    /* prompts: a shared prefix per tenant, then random tokens */
    int shared = (int)(o->shared_prefix * P);
    uint64_t rng = 0x1234567;
    bench_req *rq = calloc((size_t)R, sizeof *rq);
    int32_t **prefix = calloc((size_t)(o->tenants > 0 ? o->tenants : 1), sizeof *prefix);
    int T = o->tenants > 0 ? o->tenants : 1;
    for (int t = 0; t < T; t++) {
        prefix[t] = malloc(sizeof(int32_t) * (size_t)(shared + 1));
        for (int i = 0; i < shared; i++) { rng = rng * 6364136223846793005ull + 1; prefix[t][i] = 3 + (int)((rng >> 33) % (uint64_t)(V - 3)); }
    }
    for (int i = 0; i < R; i++) {
        rq[i].n = P;
        rq[i].ids = malloc(sizeof(int32_t) * (size_t)P);
        for (int k = 0; k < P; k++) {
            rng = rng * 6364136223846793005ull + 1;
            rq[i].ids[k] = k < shared ? prefix[i % T][k] : 3 + (int)((rng >> 33) % (uint64_t)(V - 3));
        }
        if (bos >= 0) rq[i].ids[0] = bos;
    }
    cm384_sampling s;
    sampling_from(o, &s, N);
    s.max_tokens = N;
    s.ignore_eos = 1;
    double t0 = now_s();
    int next = 0, finished = 0;
    while (finished < R) {
        while (next < R && next - finished < C) {
            cm384_request q;
            cm384_request_init(&q);
            q.ids = rq[next].ids; q.n_ids = rq[next].n; q.sampling = &s;
            q.tenant = (uint32_t)(next % T);
            q.on_event = bench_event; q.user = &rq[next];
            if (cm384_submit(e, &q, &rq[next].id)) { die("submit", -1); break; }
            next++;
        }
        cm384_wait(e, rq[finished].id, -1);
        finished++;
    }
    double wall = now_s() - t0;
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    double out_tok_s = (double)R * N / wall;
    /* what one token costs: active weights read once per decode step (bytes)
       and 2 flops per active parameter */
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    double bpp = o->int8 ? 1.0 : !strcmp(in.weight_dtype, "F32") ? 4.0 : !strcmp(in.weight_dtype, "F8_E4M3") ? 1.0 : 2.0;
    double act_bytes = (double)in.n_active_params * bpp;
    double decode_gbs = C == 1 ? act_bytes * st.decode_tok_per_s / 1e9 : 0;   /* one stream reads them all per token */
    /* a prompt token skips the head (only the last one needs logits) */
    double prefill_params = (double)in.n_active_params - (double)in.vocab_size * in.hidden_size;
    double prefill_gops = 2.0 * prefill_params * st.prefill_tok_per_s / 1e9;
    if (o->json) {
        printf("{\"active_params\":%llu,\"bytes_per_param\":%.1f,\"decode_weight_gbs\":%.2f,\"prefill_gops\":%.2f,",
               (unsigned long long)in.n_active_params, bpp, decode_gbs, prefill_gops);
        printf("\"model\":\"%s\",\"prompt\":%d,\"gen\":%d,\"requests\":%d,\"concurrency\":%d,\"threads\":%d,"
               "\"preset\":\"%s\",\"int8\":%d,\"int8_dispatch\":%d,\"shared_prefix\":%.2f,\"load_s\":%.3f,"
               "\"wall_s\":%.3f,\"output_tok_s\":%.2f,\"prefill_tok_s\":%.2f,\"decode_tok_s\":%.2f,"
               "\"ttft_p50_ms\":%.2f,\"ttft_p99_ms\":%.2f,\"tpot_p50_ms\":%.3f,\"tpot_p99_ms\":%.3f,"
               "\"cache_hit_ratio\":%.4f,\"dispatch_bytes\":%llu,\"dispatch_bytes_bf16\":%llu,"
               "\"combine_bytes\":%llu,\"preempted\":%llu,\"mtp_drafted\":%llu,\"mtp_accepted\":%llu}\n",
               o->model, P, N, R, C, st.n_workers, o->preset ? o->preset : "default", o->int8, o->int8_dispatch,
               o->shared_prefix, t_load, wall, out_tok_s, st.prefill_tok_per_s, st.decode_tok_per_s,
               st.ttft_p50_ms, st.ttft_p99_ms, st.tpot_p50_ms, st.tpot_p99_ms, st.cache_hit_ratio,
               (unsigned long long)st.dispatch_bytes, (unsigned long long)st.dispatch_bytes_bf16,
               (unsigned long long)st.combine_bytes, (unsigned long long)st.requests_preempted,
               (unsigned long long)st.mtp_drafted, (unsigned long long)st.mtp_accepted);
    } else {
        printf("workload: %d requests x (%d prompt + %d generated) tokens, %d in flight, shared prefix %.0f%%, %d tenant%s\n",
               R, P, N, C, 100 * o->shared_prefix, T, T > 1 ? "s" : "");
        printf("wall %.2f s: %.1f generated tok/s overall; load %.2f s\n", wall, out_tok_s, t_load);
        print_report(e);
    }
    for (int i = 0; i < R; i++) free(rq[i].ids);
    for (int t = 0; t < T; t++) free(prefix[t]);
    free(prefix);
    free(rq);
    cm384_engine_free(e);
    cm384_model_free(m);
    return 0;
}

static int cmd_info(const opts *o) {
    cm384_model *m;
    if (load(o, &m)) return 1;
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    printf("%s: %s, %s weights\n", o->model, in.model_type, in.weight_dtype);
    printf("  vocab %d, hidden %d, %d layers (%d dense), %d MTP\n", in.vocab_size, in.hidden_size, in.n_layers,
           in.n_dense_layers, in.n_mtp_layers);
    printf("  MLA: %d heads, q_lora %d, kv_lora %d, qk_nope %d, qk_rope %d, v %d\n", in.n_heads, in.q_lora_rank,
           in.kv_lora_rank, in.qk_nope_head_dim, in.qk_rope_head_dim, in.v_head_dim);
    printf("  MoE: %d routed + %d shared experts, top-%d\n", in.n_routed_experts, in.n_shared_experts, in.n_experts_per_tok);
    printf("  %.1fM parameters, %.1fM active per token, %.1f MB of weights; context %d; bos %d eos %d\n",
           in.n_params / 1e6, in.n_active_params / 1e6, in.weight_bytes / 1e6, in.max_position_embeddings, in.bos_id, in.eos_id);
    cm384_model_free(m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    opts o;
    if (parse(argc, argv, &o)) return 2;
    const char *c = argv[1];
    if (!strcmp(c, "run")) return cmd_run(&o);
    if (!strcmp(c, "chat")) return cmd_chat(&o);
    if (!strcmp(c, "tokenize")) return cmd_tokenize(&o);
    if (!strcmp(c, "eval")) return cmd_eval(&o);
    if (!strcmp(c, "perplexity")) return cmd_perplexity(&o);
    if (!strcmp(c, "bench")) return cmd_bench(&o);
    if (!strcmp(c, "info")) return cmd_info(&o);
    fprintf(stderr, "cm384: unknown command \"%s\" (cm384 help)\n", c);
    return 2;
}

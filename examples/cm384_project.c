/* cm384_project.c -- `cm384 project` and `cm384 bench --ablate`, part of the
 * cm384 tool (examples/cm384.c hands these commands here).  A client of
 * cm384.h like any embedder.
 *
 *   cm384 project                     DeepSeek-R1 on CloudMatrix384, the paper's set-up
 *   cm384 project --table4            the paper's Tables 2 and 4 beside the projection
 *   cm384 project --params            every parameter of the model with its source
 *   cm384 project --from-run DIR      run a workload on the small model DIR and carry
 *                                     its measured expert load to full scale
 *   cm384 project --svg FILE          the picture (with --from-run: the run too)
 *   cm384 bench --ablate [-m DIR]     each mechanism off in turn: measured here and
 *                                     projected on CloudMatrix384
 *
 * docs/how-it-works.md explains how to read every table and the picture. */
#define _POSIX_C_SOURCE 200809L
#include "../cm384.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int cm384_cli_project(int argc, char **argv);
int cm384_cli_ablate(int argc, char **argv);
int cm384_cli_has(int argc, char **argv, const char *flag);
void cm384_cli_project_usage(FILE *f);

int cm384_cli_has(int argc, char **argv, const char *flag) {
    for (int i = 2; i < argc; i++) if (!strcmp(argv[i], flag)) return 1;
    return 0;
}

void cm384_cli_project_usage(FILE *f) {
    fprintf(f, "  %-11s %s\n", "project", "DeepSeek-R1 (or a run) projected on CloudMatrix384: TPOT, TTFT, tokens/s per NPU");
    fprintf(f, "  %-11s %s\n", "bench --ablate", "each mechanism off in turn: measured here, projected on CloudMatrix384");
}

#define PJ_USAGE 2      /* exit status for a wrong command line, as the rest of the tool */

/* Strict numbers: the whole text, in range, or a message and PJ_USAGE. */
static int pj_int(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out) {
    char *end;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < lo || x > hi) {
        fprintf(stderr, "cm384 %s: %s needs an integer in %ld..%ld, got \"%s\"\n", cmd, opt, lo, hi, v ? v : "");
        return PJ_USAGE;
    }
    *out = (int)x;
    return 0;
}

static int pj_num(const char *cmd, const char *opt, const char *v, double lo, double hi, double *out) {
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "cm384 %s: %s needs a number in %g..%g, got \"%s\"\n", cmd, opt, lo, hi, v ? v : "");
        return PJ_USAGE;
    }
    *out = x;
    return 0;
}

static double pj_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ======================================================================== */
/* A workload on a small model, measured                                    */
/* ======================================================================== */

typedef struct pj_workload {
    const char *model;          /* model directory                               */
    int         requests, concurrency, prompt, gen, tenants, threads;
    double      shared_prefix;  /* fraction of each prompt shared per tenant     */
    const char *trace;          /* Chrome trace path, or NULL                    */
    int         ppl_tokens;     /* > 0: also measure perplexity on that many
                                   tokens of DIR/val.txt (windows of 128)        */
} pj_workload;

typedef struct pj_result {
    cm384_stats st;
    double      wall_s, ppl;
    int32_t    *tokens;         /* [requests][gen] generated tokens              */
    int         n_dev;
    uint64_t   *traffic;        /* [n_dev][n_dev]                                */
    char      (*roles)[32];     /* [n_dev]                                       */
    double     *busy_ms;        /* [n_dev]                                       */
    int         n_experts, n_load_layers;
    uint64_t   *load;           /* [n_load_layers][n_experts], MoE layers only   */
} pj_result;

static void pj_result_free(pj_result *r) {
    free(r->tokens); free(r->traffic); free(r->roles); free(r->busy_ms); free(r->load);
    memset(r, 0, sizeof *r);
}

/* Prompts: windows of the model's val.txt when it has one (routing on real
 * text), else pseudo-random ids; the first shared_prefix of each prompt is
 * its tenant's. */
static int32_t *pj_text_ids(const cm384_model *m, const char *dir, int *n_out) {
    char path[1024];
    snprintf(path, sizeof path, "%s/val.txt", dir);
    FILE *f = fopen(path, "rb");
    *n_out = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    size_t got = text ? fread(text, 1, (size_t)len, f) : 0;
    fclose(f);
    if (!text) return NULL;
    int n = cm384_tokenize(m, text, got, NULL, 0, 0);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (ids) cm384_tokenize(m, text, got, ids, n, 0);
    free(text);
    *n_out = ids ? n : 0;
    return ids;
}

typedef struct pj_req { int32_t *out; int n, cap; uint64_t id; } pj_req;

static int pj_on_event(void *user, const cm384_event *ev) {
    pj_req *q = user;
    if (ev->kind == CM384_EV_TOKEN && q->n < q->cap) q->out[q->n++] = ev->token;
    return 0;
}

static int pj_fail(const char *what) {
    fprintf(stderr, "cm384: %s: %s\n", what, cm384_last_error());
    return 1;
}

/* Runs workload w on model m with engine config c; fills res. */
static int pj_run(const cm384_model *m, const cm384_config *cfg, const pj_workload *w, pj_result *res) {
    memset(res, 0, sizeof *res);
    cm384_config c = *cfg;
    c.trace_path = w->trace;
    if (!c.max_ctx) c.max_ctx = w->prompt + w->gen + 16;
    if (w->ppl_tokens > 0 && c.max_ctx < 128) c.max_ctx = 128;          /* the perplexity windows */
    cm384_engine *e;
    if (cm384_engine_create(m, &c, &e)) return pj_fail("creating the engine");
    int V = cm384_vocab_size(m), bos = cm384_token_bos(m), n_text = 0;
    int32_t *text = pj_text_ids(m, w->model, &n_text);
    int R = w->requests, P = w->prompt, T = w->tenants > 0 ? w->tenants : 1;
    int shared = (int)(w->shared_prefix * P);
    int32_t *prompts = malloc(sizeof(int32_t) * (size_t)R * P);
    pj_req *rq = calloc((size_t)R, sizeof *rq);
    res->tokens = calloc((size_t)R * (w->gen > 0 ? w->gen : 1), sizeof(int32_t));
    if (!prompts || !rq || !res->tokens) { free(prompts); free(rq); free(text); cm384_engine_free(e); return pj_fail("out of memory"); }
    uint64_t rng = 0x1234567;
    for (int i = 0; i < R; i++) {
        int32_t *p = prompts + (size_t)i * P;
        for (int k = 0; k < P; k++) {
            int src = k < shared ? i % T : T + i;              /* tenant's window, then the request's own */
            if (n_text > P) {
                long off = ((long)src * 977 * P / 7) % (n_text - P);
                p[k] = text[off + k];
            } else {
                rng = rng * 6364136223846793005ull + 1;
                p[k] = 3 + (int)((rng >> 33) % (uint64_t)(V > 4 ? V - 3 : 1));
            }
        }
        if (bos >= 0) p[0] = bos;
        rq[i].out = res->tokens + (size_t)i * w->gen;
        rq[i].cap = w->gen;
    }
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.max_tokens = w->gen;
    s.ignore_eos = 1;
    int C = w->concurrency > 0 ? w->concurrency : 1, next = 0, finished = 0, rc = 0;
    double t0 = pj_now();
    while (finished < R && !rc) {
        while (next < R && next - finished < C) {
            cm384_request q;
            cm384_request_init(&q);
            q.ids = prompts + (size_t)next * P; q.n_ids = P; q.sampling = &s;
            q.tenant = (uint32_t)(next % T); q.on_event = pj_on_event; q.user = &rq[next];
            if (cm384_submit(e, &q, &rq[next].id)) { rc = pj_fail("submit"); break; }
            next++;
        }
        if (!rc) cm384_wait(e, rq[finished++].id, -1);
    }
    res->wall_s = pj_now() - t0;
    res->st.struct_size = sizeof res->st;
    cm384_get_stats(e, &res->st);
    /* what the run leaves to look at: traffic, roles, busy time, expert load */
    int nd = cm384_get_traffic(e, NULL, 0);
    res->n_dev = nd;
    res->traffic = malloc(sizeof(uint64_t) * (size_t)nd * nd);
    res->roles = calloc((size_t)nd, sizeof *res->roles);
    res->busy_ms = calloc((size_t)nd, sizeof(double));
    if (res->traffic && res->roles && res->busy_ms) {
        cm384_get_traffic(e, res->traffic, nd * nd);
        cm384_get_device_busy(e, res->busy_ms, nd);
        for (int d = 0; d < nd; d++) snprintf(res->roles[d], sizeof res->roles[d], "%s", cm384_device_roles(e, d));
    }
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    int E = in.n_routed_experts, NL = in.n_layers + in.n_mtp_layers;
    res->n_experts = E;
    res->load = E > 0 ? calloc((size_t)NL * E, sizeof(uint64_t)) : NULL;
    for (int l = 0; res->load && l < NL; l++) {
        uint64_t *row = res->load + (size_t)res->n_load_layers * E, sum = 0;
        cm384_get_expert_load(e, l, row, E);
        for (int x = 0; x < E; x++) sum += row[x];
        if (sum) res->n_load_layers++;                       /* dense layers route nothing */
    }
    /* perplexity on the first ppl_tokens of val.txt, windows of 128 */
    if (w->ppl_tokens > 0 && n_text > 1) {
        int W = 128, n = n_text < w->ppl_tokens ? n_text : w->ppl_tokens;
        float *lg = malloc(sizeof(float) * (size_t)W * V);
        double nll = 0;
        long cnt = 0;
        for (int w0 = 0; lg && w0 + 1 < n; w0 += W) {
            int wn = n - w0 < W ? n - w0 : W;
            if (cm384_eval(e, text + w0, wn, lg, NULL)) break;
            for (int t = 0; t + 1 < wn; t++) {
                const float *row = lg + (size_t)t * V;
                float mx = row[0];
                for (int v = 1; v < V; v++) if (row[v] > mx) mx = row[v];
                double z = 0;
                for (int v = 0; v < V; v++) z += exp((double)row[v] - mx);
                nll += log(z) + mx - row[text[w0 + t + 1]];
                cnt++;
            }
        }
        free(lg);
        res->ppl = cnt ? exp(nll / cnt) : 0;
    }
    free(prompts); free(rq); free(text);
    cm384_engine_free(e);                         /* writes the trace */
    return rc;
}

/* The engine config the paper preset implies on a small model: every
 * mechanism on. */
static void pj_paper_config(cm384_config *c, int threads) {
    cm384_config_init(c);
    c->preset = "paper";
    c->n_workers = threads > 0 ? threads : 2;
    c->int8 = 1;
    c->int8_dispatch = 1;
    c->microbatches = 2;
    c->mtp = 1;
}

/* ======================================================================== */
/* The picture: one self-contained SVG                                      */
/* ======================================================================== */

typedef struct pj_svg { FILE *f; } pj_svg;

static const char *pj_color(const char *name) {
    static const struct { const char *n, *c; } k[] = {
        {"attention", "#4e79a7"}, {"MLAProlog", "#76b7b2"}, {"o_proj", "#59a14f"}, {"kv_b", "#8cd17d"},
        {"ffn", "#b07aa1"}, {"moe", "#b07aa1"}, {"router", "#9c755f"}, {"gate", "#9c755f"},
        {"dispatch", "#f28e2b"}, {"experts", "#e15759"}, {"shared expert", "#ff9d9a"}, {"combine", "#edc948"},
        {"head", "#bab0ac"}, {"mtp", "#d37295"}, {"eh_proj", "#d37295"}, {"sample", "#79706e"},
        {"dense FFN", "#b07aa1"}, {"all-gather", "#a0cbe8"}, {"all-to-all", "#86bcb6"},
        {"dense layers", "#b07aa1"}, {"MoE layers", "#e15759"}, {"MTP draft", "#d37295"}, {"host gaps", "#79706e"},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) if (!strcmp(k[i].n, name)) return k[i].c;
    return "#cccccc";
}

static void pj_text(FILE *f, double x, double y, int size, const char *anchor, const char *weight, const char *s) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"%d\" text-anchor=\"%s\" font-weight=\"%s\">", x, y, size, anchor, weight);
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else fputc(*s, f);
    }
    fputs("</text>\n", f);
}

/* A trace event read back from the engine's Chrome trace: a device's work
 * (its layer and microbatch), or a peer's step span ("prefill step",
 * "decode step" on the peer's own track); step is the peer step's number. */
typedef struct pj_tev { char name[24]; int dev, mb, layer; long step; double ts, dur; } pj_tev;

static pj_tev *pj_read_trace(const char *path, int *n_out) {
    FILE *f = fopen(path, "r");
    *n_out = 0;
    if (!f) return NULL;
    int n = 0, cap = 0;
    pj_tev *ev = NULL;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        if (!strstr(line, "\"ph\":\"X\"")) continue;
        pj_tev t;
        memset(&t, 0, sizeof t);
        const char *p = strstr(line, "\"name\":\""), *q = strstr(line, "\"tid\":"), *r = strstr(line, "\"ts\":"),
                   *s = strstr(line, "\"dur\":"), *u = strstr(line, "\"microbatch\":"), *l = strstr(line, "\"layer\":");
        if (!p || !q || !r || !s) continue;
        p += 8;
        size_t k = 0;
        while (p[k] && p[k] != '"' && k + 1 < sizeof t.name) { t.name[k] = p[k]; k++; }
        t.dev = atoi(q + 6); t.ts = atof(r + 5); t.dur = atof(s + 6);
        t.mb = u ? atoi(u + 13) : 0;
        t.layer = l ? atoi(l + 8) : -1;
        const char *st = strstr(line, "\"step\":");
        t.step = st ? atol(st + 7) : -1;
        if (t.dev < 0 || t.dev > 65535) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            pj_tev *nv = realloc(ev, (size_t)cap * sizeof *ev);
            if (!nv) break;
            ev = nv;
        }
        ev[n++] = t;
    }
    fclose(f);
    *n_out = n;
    return ev;
}

/* Draws the events of [t0, t1) one row per device that worked in it. */
static double pj_svg_window(FILE *f, double y0, const pj_tev *ev, int n, const pj_result *res, double t0, double t1,
                            const char *what) {
    double W = 1100, x0 = 190, rh = 14;
    int max_dev = 0;
    for (int i = 0; i < n; i++) if (ev[i].dev > max_dev) max_dev = ev[i].dev;
    int *row = malloc(sizeof(int) * (size_t)(max_dev + 1)), rows = 0;
    if (!row) return y0;
    for (int d = 0; d <= max_dev; d++) row[d] = -1;
    for (int i = 0; i < n; i++) if (ev[i].ts < t1 && ev[i].ts + ev[i].dur > t0) row[ev[i].dev] = 0;
    for (int d = 0; d <= max_dev; d++) row[d] = row[d] == 0 && rows < 32 ? rows++ : -1;
    double scale = (W - x0) / (t1 - t0);
    char lab[160];
    snprintf(lab, sizeof lab, "%s: %.2f ms", what, (t1 - t0) / 1e3);
    pj_text(f, x0, y0 + 12, 12, "start", "bold", lab);
    y0 += 16;
    for (int d = 0; d <= max_dev; d++) {
        if (row[d] < 0) continue;
        snprintf(lab, sizeof lab, "dev %d %s", d, res && d < res->n_dev ? res->roles[d] : "");
        pj_text(f, x0 - 6, y0 + row[d] * rh + 10, 10, "end", "normal", lab);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#f4f4f4\"/>\n", x0,
                y0 + row[d] * rh + 1, W - x0, rh - 2);
    }
    for (int i = 0; i < n; i++) {
        const pj_tev *t = &ev[i];
        if (row[t->dev] < 0 || t->ts >= t1 || t->ts + t->dur <= t0) continue;
        double a = t->ts < t0 ? t0 : t->ts, b = t->ts + t->dur > t1 ? t1 : t->ts + t->dur, wdt = (b - a) * scale;
        fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" fill-opacity=\"%s\"><title>%s "
                   "layer %d mb%d %.0f us</title></rect>\n",
                x0 + (a - t0) * scale, y0 + row[t->dev] * rh + 1 + (t->mb ? (rh - 2) / 2 : 0), wdt < 0.4 ? 0.4 : wdt,
                (rh - 2) / 2, pj_color(t->name), t->mb ? "0.55" : "1.0", t->name, t->layer, t->mb, t->dur);
    }
    free(row);
    return y0 + rows * rh + 6;
}

/* Panel: per-device timelines of the run -- the first prefill step and
 * three decode steps in a row that no prefill step overlaps, each window
 * the peers' own step spans (numbered by the engine, so no guessing from
 * gaps in time). */
static int pj_span_cmp(const void *a, const void *b) {
    const pj_tev *x = a, *y = b;
    return (x->step > y->step) - (x->step < y->step);
}

static double pj_svg_timeline(FILE *f, double y0, const pj_tev *ev, int n, const pj_result *res) {
    pj_text(f, 20, y0, 15, "start", "bold", "1. The emulator, device by device (from the run's Chrome trace)");
    y0 += 6;
    if (!ev || !n) { pj_text(f, 30, y0 + 20, 12, "start", "normal", "(no trace)"); return y0 + 40; }
    pj_tev *dec = malloc(sizeof(pj_tev) * (size_t)n);
    if (!dec) return y0;
    const pj_tev *pre = NULL;
    int nd = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(ev[i].name, "decode step")) dec[nd++] = ev[i];
        else if (!strcmp(ev[i].name, "prefill step") && (!pre || ev[i].step < pre->step)) pre = &ev[i];
    }
    qsort(dec, (size_t)nd, sizeof *dec, pj_span_cmp);
    if (pre) y0 = pj_svg_window(f, y0, ev, n, res, pre->ts, pre->ts + pre->dur, "a step with prefill work") + 6;
    int shown = 0;
    for (int k = 2; k + 2 < nd && !shown; k++) {     /* past the first two: warm caches */
        if (dec[k + 2].step != dec[k].step + 2) continue;
        double t0 = dec[k].ts, t1 = dec[k + 2].ts + dec[k + 2].dur;
        int overlapped = 0;
        for (int i = 0; i < n && !overlapped; i++)
            overlapped = !strcmp(ev[i].name, "prefill step") && ev[i].ts < t1 && ev[i].ts + ev[i].dur > t0;
        if (overlapped) continue;
        y0 = pj_svg_window(f, y0, ev, n, res, t0, t1, "three decode steps") + 6;
        shown = 1;
    }
    if (!pre && !shown) { pj_text(f, 30, y0 + 20, 12, "start", "normal", "(no serving steps in the trace)"); y0 += 30; }
    free(dec);
    const char *legend[] = {"attention", "router", "dispatch", "experts", "combine", "head", "mtp", "sample"};
    for (int i = 0; i < 8; i++) {
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>\n", 190 + i * 95.0, y0, pj_color(legend[i]));
        pj_text(f, 204 + i * 95.0, y0 + 9, 11, "start", "normal", legend[i]);
    }
    pj_text(f, 190, y0 + 26, 11, "start", "normal",
            "upper half of a row: microbatch 0, lower (paler) half: microbatch 1; hover a bar for its layer and duration");
    return y0 + 34;
}

/* Panel: the traffic matrix, device by device (devices that sent or
 * received anything), log colour scale, with role bands. */
static double pj_svg_traffic(FILE *f, double y0, const pj_result *res) {
    pj_text(f, 20, y0, 15, "start", "bold", "2. The fabric: bytes each device sent each device (rows send, columns receive; log scale)");
    y0 += 10;
    if (!res || !res->traffic) return y0 + 20;
    int nd = res->n_dev, *use = malloc(sizeof(int) * (size_t)nd), n = 0;
    if (!use) return y0;
    for (int d = 0; d < nd; d++) {
        uint64_t s = 0;
        for (int k = 0; k < nd; k++) s += res->traffic[(size_t)d * nd + k] + res->traffic[(size_t)k * nd + d];
        if (s && n < 96) use[n++] = d;
    }
    double cell = n ? 420.0 / n : 10, x0 = 190;
    uint64_t mx = 1;
    for (int i = 0; i < n; i++) for (int j = 0; j < n; j++) {
        uint64_t v = res->traffic[(size_t)use[i] * nd + use[j]];
        if (v > mx) mx = v;
    }
    for (int i = 0; i < n; i++) {
        char lab[64];
        snprintf(lab, sizeof lab, "%d %s", use[i], res->roles[use[i]]);
        if (cell >= 8) pj_text(f, x0 - 4, y0 + i * cell + cell * 0.8, cell > 11 ? 9 : 7, "end", "normal", lab);
        for (int j = 0; j < n; j++) {
            uint64_t v = res->traffic[(size_t)use[i] * nd + use[j]];
            double t = v ? log((double)v) / log((double)mx) : 0;
            if (t < 0) t = 0;
            int g = v ? (int)(235 - 200 * t) : 250;
            fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"%.2f\" fill=\"rgb(%d,%d,%d)\"><title>%d -&gt; %d: %.3f MB</title></rect>\n",
                    x0 + j * cell, y0 + i * cell, cell, cell, v ? 255 : 250, g, v ? g / 2 : 250, use[i], use[j], v / 1e6);
        }
    }
    /* by role */
    double xr = x0 + 460, yr = y0 + 10;
    pj_text(f, xr, yr, 12, "start", "bold", "by role (MB)");
    char roles[16][32];
    int nr = 0;
    for (int i = 0; i < n; i++) {
        int k = 0;
        while (k < nr && strcmp(roles[k], res->roles[use[i]])) k++;
        if (k == nr && nr < 16) snprintf(roles[nr++], 32, "%s", res->roles[use[i]]);
    }
    for (int a = 0; a < nr; a++)
        for (int b = 0; b < nr; b++) {
            uint64_t s = 0;
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++)
                    if (!strcmp(res->roles[use[i]], roles[a]) && !strcmp(res->roles[use[j]], roles[b]))
                        s += res->traffic[(size_t)use[i] * nd + use[j]];
            if (!s) continue;
            char lab[200];
            snprintf(lab, sizeof lab, "%-18.31s -> %-18.31s %9.2f", roles[a], roles[b], s / 1e6);
            yr += 15;
            pj_text(f, xr, yr, 11, "start", "normal", lab);
        }
    yr += 22;
    char lab[200];
    snprintf(lab, sizeof lab, "dispatch %.2f MB, combine %.2f MB,", res->st.dispatch_bytes / 1e6, res->st.combine_bytes / 1e6);
    pj_text(f, xr, yr, 11, "start", "normal", lab);
    yr += 15;
    snprintf(lab, sizeof lab, "KV hand-off %.2f MB, %llu messages", res->st.kv_handoff_bytes / 1e6,
             (unsigned long long)res->st.messages);
    pj_text(f, xr, yr, 11, "start", "normal", lab);
    free(use);
    double yend = y0 + n * cell + 20;
    return yend > yr + 20 ? yend : yr + 20;
}

/* Panel: expert load -- measured per expert on the small model, and the
 * projected per-device load at full scale without and with EPLB. */
static double pj_svg_load(FILE *f, double y0, const pj_result *res, const cm384_projection *p) {
    pj_text(f, 20, y0, 15, "start", "bold", "3. Expert load: measured on the run; carried to full scale, rows per expert device of one layer, before / after EPLB");
    y0 += 14;
    double x0 = 60, h = 90;
    if (res && res->load && res->n_load_layers) {
        int E = res->n_experts;
        double *tot = calloc((size_t)E, sizeof(double)), mx = 0, mean = 0;
        if (tot) {
            for (int l = 0; l < res->n_load_layers; l++) for (int x = 0; x < E; x++) tot[x] += (double)res->load[(size_t)l * E + x];
            for (int x = 0; x < E; x++) { mean += tot[x] / E; if (tot[x] > mx) mx = tot[x]; }
            double bw = 280.0 / E;
            for (int x = 0; x < E; x++) {
                double hh = mx > 0 ? tot[x] / mx * h : 0;
                fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#e15759\"/>\n", x0 + x * bw,
                        y0 + 10 + h - hh, bw * 0.85, hh);
            }
            fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#333\" stroke-dasharray=\"3,2\"/>\n", x0,
                    x0 + 280, y0 + 10 + h - mean / mx * h, y0 + 10 + h - mean / mx * h);
            char lab[128];
            snprintf(lab, sizeof lab, "the run: tokens per expert (%d experts), max/mean %.2f", E, mean > 0 ? mx / mean : 0);
            pj_text(f, x0, y0 + h + 26, 11, "start", "normal", lab);
            free(tot);
        }
    }
    if (p && p->n_load_devices) {
        for (int pass = 0; pass < 2; pass++) {
            double xx = 380 + pass * 370, mx = 0;
            const float *v = pass ? p->load_eplb : p->load_no_eplb;
            for (int d = 0; d < p->n_load_devices; d++) if (v[d] > mx) mx = v[d];
            double bw = 340.0 / p->n_load_devices, top = mx > 1.5 ? mx : 1.5;
            for (int d = 0; d < p->n_load_devices; d++) {
                double hh = v[d] / top * h;
                fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"/>\n", xx + d * bw,
                        y0 + 10 + h - hh, bw * 0.9 < 0.5 ? 0.5 : bw * 0.9, hh, pass ? "#59a14f" : "#f28e2b");
            }
            fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#333\" stroke-dasharray=\"3,2\"/>\n", xx,
                    xx + 340, y0 + 10 + h - h / top, y0 + 10 + h - h / top);
            char lab[160];
            snprintf(lab, sizeof lab, "EP%d, %s: max %.2f x mean", p->n_load_devices,
                     pass ? "EPLB re-placed the replicas" : "replicas not re-placed", mx);
            pj_text(f, xx, y0 + h + 26, 11, "start", "normal", lab);
        }
    }
    return y0 + h + 46;
}

/* Panel: the projected CloudMatrix384 step. */
static double pj_svg_projection(FILE *f, double y0, const cm384_projection *p) {
    char lab[256];
    snprintf(lab, sizeof lab, "4. Projected on %s: one MoE layer of decode per device (batch %d per NPU: %.0f us), and the step",
             !strcmp(p->hw, "h800") ? "H800s" : "CloudMatrix384", p->batch, p->layer_us);
    pj_text(f, 20, y0, 15, "start", "bold", lab);
    y0 += 12;
    double x0 = 190, W = 1100, end = 0;
    for (int i = 0; i < p->n_decode_ops; i++)
        if (p->decode_ops[i].start_us + p->decode_ops[i].dur_us > end) end = p->decode_ops[i].start_us + p->decode_ops[i].dur_us;
    double sc = end > 0 ? (W - x0) / end : 1;
    const char *lanes[2] = {"attention stream (16 AIC)", "MoE stream (8 AIC)"};
    for (int l = 0; l < 2; l++) pj_text(f, x0 - 6, y0 + 8 + l * 26 + 16, 11, "end", "normal", lanes[l]);
    for (int i = 0; i < p->n_decode_ops; i++) {
        const cm384_proj_op *q = &p->decode_ops[i];
        double x = x0 + q->start_us * sc, w = q->dur_us * sc, y = y0 + 8 + (q->lane ? 26 : 0);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"22\" fill=\"%s\" fill-opacity=\"%s\" stroke=\"#fff\"><title>%s mb%d %.1f us</title></rect>\n",
                x, y, w < 0.5 ? 0.5 : w, pj_color(q->name), q->microbatch ? "0.6" : "1.0", q->name, q->microbatch, q->dur_us);
        if (w > 48) {
            snprintf(lab, sizeof lab, "%s mb%d", q->name, q->microbatch);
            pj_text(f, x + w / 2, y + 15, 10, "middle", "normal", lab);
        }
    }
    double y1 = y0 + 66;
    snprintf(lab, sizeof lab, "0 .. %.0f us; TPOT %.1f ms, %.0f tokens/s per NPU, %.2f tokens per request per step", end,
             p->tpot_ms, p->decode_tok_s, p->tokens_per_step);
    pj_text(f, x0, y1, 11, "start", "normal", lab);
    /* the step by part */
    y1 += 14;
    double tot = 0;
    for (int i = 0; i < p->n_step_ops; i++) tot += p->step_ops[i].dur_us;
    pj_text(f, x0 - 6, y1 + 15, 11, "end", "normal", "decode step");
    double x = x0;
    for (int i = 0; i < p->n_step_ops; i++) {
        double w = tot > 0 ? p->step_ops[i].dur_us / tot * (W - x0) : 0;
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"20\" fill=\"%s\" stroke=\"#fff\"/>\n", x, y1,
                w, pj_color(p->step_ops[i].name));
        if (w > 70) {
            snprintf(lab, sizeof lab, "%s %.1f ms", p->step_ops[i].name, p->step_ops[i].dur_us / 1e3);
            pj_text(f, x + w / 2, y1 + 14, 10, "middle", "normal", lab);
        }
        x += w;
    }
    /* prefill layer */
    y1 += 34;
    end = 0;
    for (int i = 0; i < p->n_prefill_ops; i++)
        if (p->prefill_ops[i].start_us + p->prefill_ops[i].dur_us > end) end = p->prefill_ops[i].start_us + p->prefill_ops[i].dur_us;
    sc = end > 0 ? (W - x0) / end : 1;
    pj_text(f, x0 - 6, y1 + 15, 11, "end", "normal", "prefill: cube cores");
    pj_text(f, x0 - 6, y1 + 41, 11, "end", "normal", "prefill: fabric DMA");
    for (int i = 0; i < p->n_prefill_ops; i++) {
        const cm384_proj_op *q = &p->prefill_ops[i];
        double xx = x0 + q->start_us * sc, w = q->dur_us * sc, y = y1 + (q->lane == 2 ? 26 : 0);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"22\" fill=\"%s\" fill-opacity=\"%s\" stroke=\"#fff\"><title>%s mb%d %.0f us</title></rect>\n",
                xx, y, w < 0.5 ? 0.5 : w, pj_color(q->name), q->microbatch ? "0.6" : "1.0", q->name, q->microbatch, q->dur_us);
        if (w > 60) {
            snprintf(lab, sizeof lab, "%s mb%d", q->name, q->microbatch);
            pj_text(f, xx + w / 2, y + 15, 10, "middle", "normal", lab);
        }
    }
    snprintf(lab, sizeof lab, "one prefill MoE layer: %.1f ms; %.0f prompt tokens/s per NPU, TTFT %.0f ms for a batch of %s",
             end / 1e3, p->prefill_tok_s, p->ttft_ms, "16,384 tokens per NPU");
    pj_text(f, x0, y1 + 66, 11, "start", "normal", lab);
    return y1 + 84;
}

static int pj_write_svg(const char *path, const char *trace, const pj_result *res, const cm384_projection *p,
                        const char *title) {
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); return 1; }
    int n_ev = 0;
    pj_tev *ev = trace ? pj_read_trace(trace, &n_ev) : NULL;
    /* draw into a temporary body first to know the height */
    char *body = NULL;
    size_t body_len = 0;
    FILE *b = open_memstream(&body, &body_len);
    if (!b) { fclose(f); free(ev); return 1; }
    double y = 56;
    if (res) {
        y = pj_svg_timeline(b, y, ev, n_ev, res) + 16;
        y = pj_svg_traffic(b, y, res) + 16;
    }
    y = pj_svg_load(b, y, res, p) + 10;
    y = pj_svg_projection(b, y, p) + 10;
    fclose(b);
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1120\" height=\"%.0f\" viewBox=\"0 0 1120 %.0f\" "
               "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n", y, y);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    pj_text(f, 20, 28, 18, "start", "bold", title);
    fwrite(body, 1, body_len, f);
    fprintf(f, "</svg>\n");
    free(body);
    free(ev);
    return fclose(f) ? 1 : 0;
}

/* ======================================================================== */
/* cm384 project                                                            */
/* ======================================================================== */

typedef struct pj_opts {
    const char *model, *from_run, *svg, *hw, *trace_keep;
    int         table4, params, threads, run_requests, run_prompt, run_gen;
    cm384_proj_opts po;
} pj_opts;

static void pj_help(void) {
    printf("usage: cm384 project [options]\n\n"
           "Projects a model on CloudMatrix384 (or H800s): the engine's own schedule, placement\n"
           "(the paper preset at the model's scale) and messages, priced per operator from hardware\n"
           "specifications and the paper's operator-level measurements.  Prints TPOT, TTFT, tokens/s\n"
           "per NPU and one layer operator by operator.  docs/how-it-works.md explains the output.\n"
           "examples:\n"
           "  cm384 project --batch 96                      DeepSeek-R1, 4K/256, batch 96 per NPU\n"
           "  cm384 project --table4                        the paper's Tables 2 and 4 beside the projection\n"
           "  cm384 project --from-run models/shakespeare --svg build/report.svg\n"
           "options:\n"
           "  -m, --model DIR|FILE   config.json (or its directory) to project (tests/fixtures/deepseek-r1)\n"
           "  --hw NAME              cloudmatrix384 (default) or h800\n"
           "  --prompt N --output N  tokens per request (4096, 256)\n"
           "  --batch N              decode requests per NPU (default: the largest meeting --slo)\n"
           "  --max-batch N --slo MS search bound (128) and TPOT target (50 ms)\n"
           "  --mtp-accept F         MTP draft acceptance (0.7)\n"
           "  --cache-reuse F        prompt fraction served by the context cache (0)\n"
           "  --prefill-tokens N     prompt tokens per NPU per prefill batch (16384)\n"
           "  --microbatches 1|2 --no-int8 --no-int8-dispatch --no-bf16-combine --no-mtp --no-eplb\n"
           "  --no-graph-bundling    switch a mechanism off\n"
           "  --prefill-expanded     price prefill attention in the expanded MLA form\n"
           "  --a2a-affine           dispatch/combine as a fixed part plus bytes at the link's rate\n"
           "  --from-run DIR         run a workload on the small model DIR (paper preset, every mechanism\n"
           "                         on) and carry its measured expert load and switches to full scale\n"
           "  --run-requests N --run-prompt N --run-tokens N   that workload (16, 96, 32)\n"
           "  -t N                   worker threads for the run (2)\n"
           "  --svg FILE             the picture (with --from-run: the run's timeline, traffic and load too)\n"
           "  --trace FILE           keep the run's Chrome trace\n"
           "  --table4               the paper's Table 4 and Table 2 beside the projection, error per row\n"
           "  --params               every parameter with its source\n");
}

static int pj_parse(int argc, char **argv, pj_opts *o) {
    memset(o, 0, sizeof *o);
    o->model = "tests/fixtures/deepseek-r1";
    o->threads = 2;
    o->run_requests = 16; o->run_prompt = 96; o->run_gen = 32;
    cm384_proj_opts_init(&o->po);
    const char *C = "project";
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r = 0;
#define NEED() do { if (!v) { fprintf(stderr, "cm384 project: %s needs a value\n", a); return PJ_USAGE; } i++; } while (0)
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { pj_help(); return -1; }
        else if (!strcmp(a, "-m") || !strcmp(a, "--model")) { NEED(); o->model = v; }
        else if (!strcmp(a, "--hw")) { NEED(); o->po.hw = v; }
        else if (!strcmp(a, "--prompt")) { NEED(); r = pj_int(C, a, v, 1, 1 << 24, &o->po.prompt); }
        else if (!strcmp(a, "--output")) { NEED(); r = pj_int(C, a, v, 1, 1 << 24, &o->po.output); }
        else if (!strcmp(a, "--batch")) { NEED(); r = pj_int(C, a, v, 1, 1 << 16, &o->po.batch); }
        else if (!strcmp(a, "--max-batch")) { NEED(); r = pj_int(C, a, v, 1, 1 << 16, &o->po.max_batch); }
        else if (!strcmp(a, "--slo")) { NEED(); r = pj_num(C, a, v, 0.001, 1e6, &o->po.tpot_slo_ms); }
        else if (!strcmp(a, "--mtp-accept")) { NEED(); r = pj_num(C, a, v, 0, 1, &o->po.mtp_accept); }
        else if (!strcmp(a, "--cache-reuse")) { NEED(); r = pj_num(C, a, v, 0, 0.999, &o->po.cache_reuse); }
        else if (!strcmp(a, "--prefill-tokens")) { NEED(); r = pj_int(C, a, v, 1, 1 << 26, &o->po.prefill_tokens); }
        else if (!strcmp(a, "--microbatches")) { NEED(); r = pj_int(C, a, v, 1, 2, &o->po.microbatches); }
        else if (!strcmp(a, "--no-int8")) o->po.int8 = 0;
        else if (!strcmp(a, "--no-int8-dispatch")) o->po.int8_dispatch = 0;
        else if (!strcmp(a, "--no-bf16-combine")) o->po.bf16_combine = 0;
        else if (!strcmp(a, "--no-mtp")) o->po.mtp = 0;
        else if (!strcmp(a, "--no-eplb")) o->po.eplb = 0;
        else if (!strcmp(a, "--no-graph-bundling")) o->po.graph_bundling = 0;
        else if (!strcmp(a, "--prefill-expanded")) o->po.prefill_expanded = 1;
        else if (!strcmp(a, "--a2a-affine")) o->po.a2a_affine = 1;
        else if (!strcmp(a, "--from-run")) { NEED(); o->from_run = v; }
        else if (!strcmp(a, "--run-requests")) { NEED(); r = pj_int(C, a, v, 1, 4096, &o->run_requests); }
        else if (!strcmp(a, "--run-prompt")) { NEED(); r = pj_int(C, a, v, 2, 65536, &o->run_prompt); }
        else if (!strcmp(a, "--run-tokens")) { NEED(); r = pj_int(C, a, v, 1, 65536, &o->run_gen); }
        else if (!strcmp(a, "-t")) { NEED(); r = pj_int(C, a, v, 1, 1024, &o->threads); }
        else if (!strcmp(a, "--svg")) { NEED(); o->svg = v; }
        else if (!strcmp(a, "--trace")) { NEED(); o->trace_keep = v; }
        else if (!strcmp(a, "--table4")) o->table4 = 1;
        else if (!strcmp(a, "--params")) o->params = 1;
        else { fprintf(stderr, "cm384 project: unknown option or argument \"%s\" (cm384 project --help)\n", a); return PJ_USAGE; }
        if (r) return r;
#undef NEED
    }
    return 0;
}

static void pj_print_params(void) {
    int n = cm384_hw_param(0, NULL, NULL, NULL, NULL, NULL);
    printf("%-15s %-20s %10s %-12s %s\n", "profile", "parameter", "value", "unit", "source");
    for (int i = 0; i < n; i++) {
        const char *pr, *k, *u, *s;
        double v;
        cm384_hw_param(i, &pr, &k, &v, &u, &s);
        printf("%-15s %-20s %10g %-12s %s\n", pr, k, v, u, s);
    }
}

static void pj_print_report(const cm384_projection *p) {
    int n = cm384_projection_report(p, NULL, 0);
    char *b = malloc((size_t)n + 1);
    if (!b) return;
    cm384_projection_report(p, b, (size_t)n + 1);
    fputs(b, stdout);
    free(b);
}

/* The paper's Table 4 (decode under TPOT targets) and Table 2's
 * CloudMatrix-Infer rows (prefill), beside the projection.  Errors are
 * (projected - paper) / paper. */
static void pj_table4(const cm384_model *m, const cm384_proj_opts *base, const pj_result *run) {
    static const struct { int prompt, output; double slo; int batch; double tpot, tok; } t4[] = {
        {1024, 1024, 50, 128, 46.8, 2733}, {2048, 256, 50, 112, 47.4, 2360}, {4096, 256, 50, 96, 49.4, 1943},
        {4096, 256, 30, 24, 24.6, 974},    {4096, 256, 15, 8, 14.9, 538},
    };
    cm384_projection *p = calloc(1, sizeof *p);
    if (!p) return;
    printf("Table 4 (decode, DeepSeek-R1, CloudMatrix384): the paper beside the projection\n");
    printf("%-9s %-9s | %-23s | %-33s | %-24s\n", "SLO", "prompt/out", "paper: batch TPOT tok/s",
           "projected, batch it picks: b TPOT tok/s err", "at the paper's batch: TPOT tok/s err");
    for (size_t i = 0; i < sizeof t4 / sizeof t4[0]; i++) {
        cm384_proj_opts o = *base;
        o.prompt = t4[i].prompt; o.output = t4[i].output; o.tpot_slo_ms = t4[i].slo; o.batch = 0;
        if (cm384_project(m, &o, p)) { printf("projection failed: %s\n", cm384_last_error()); break; }
        int b = p->batch, feas = p->feasible;
        double tp = p->tpot_ms, tk = p->decode_tok_s;
        o.batch = t4[i].batch;
        cm384_project(m, &o, p);
        printf("%3.0f ms    %4d/%-4d | %4d %5.1f ms %6.0f     | %4d%s %5.1f ms %6.0f %+6.1f%%        | %5.1f ms %6.0f %+6.1f%%\n",
               t4[i].slo, t4[i].prompt, t4[i].output, t4[i].batch, t4[i].tpot, t4[i].tok, b, feas ? " " : "*", tp, tk,
               100 * (tk - t4[i].tok) / t4[i].tok, p->tpot_ms, p->decode_tok_s, 100 * (p->decode_tok_s - t4[i].tok) / t4[i].tok);
    }
    printf("  * no batch meets the target; the smallest (8) is shown\n");
    cm384_proj_opts o = *base;
    o.prompt = 4096; o.batch = 96; o.expert_load = NULL;
    cm384_project(m, &o, p);
    printf("Table 2 (prefill, 4K prompts, 16,384 tokens per NPU):\n");
    printf("  perfect EPLB  paper 6,688 tok/s/NPU, projected %6.0f (%+.1f%%)\n", p->prefill_tok_s,
           100 * (p->prefill_tok_s - 6688) / 6688);
    if (run && run->load && run->n_load_layers) {
        o.expert_load = run->load; o.load_layers = run->n_load_layers; o.load_experts = run->n_experts;
        cm384_project(m, &o, p);
        printf("  default       paper 5,655 tok/s/NPU, projected %6.0f (%+.1f%%) with the expert load measured on the run "
               "(busiest prefill device %.2f x mean)\n", p->prefill_tok_s, 100 * (p->prefill_tok_s - 5655) / 5655,
               p->prefill_load_max_over_mean);
    } else {
        printf("  default       paper 5,655 tok/s/NPU: needs a measured load (--from-run DIR)\n");
    }
    free(p);
}

int cm384_cli_project(int argc, char **argv) {
    pj_opts o;
    int rc = pj_parse(argc, argv, &o);
    if (rc < 0) return 0;                  /* --help */
    if (rc) return rc;
    if (o.params) { pj_print_params(); return 0; }
    cm384_model *m;
    if (cm384_model_load_config(o.model, &m)) return pj_fail("loading the config");
    pj_result run;
    memset(&run, 0, sizeof run);
    int have_run = 0;
    char trace[256] = "";
    if (o.from_run) {
        cm384_model *sm;
        cm384_load_opts lo;
        cm384_load_opts_init(&lo);
        if (cm384_model_load(o.from_run, &lo, &sm)) { cm384_model_free(m); return pj_fail("loading the run's model"); }
        cm384_config c;
        pj_paper_config(&c, o.threads);
        if (o.svg || o.trace_keep)      /* the picture reads the run's trace: keep it next to the picture */
            snprintf(trace, sizeof trace, o.trace_keep ? "%s" : "%s.trace.json", o.trace_keep ? o.trace_keep : o.svg);
        pj_workload w = {o.from_run, o.run_requests, o.run_requests, o.run_prompt, o.run_gen, 1, o.threads, 0.0,
                         trace[0] ? trace : NULL, 0};
        printf("run: %s, %d requests of %d + %d tokens, paper preset with every mechanism on\n", o.from_run,
               w.requests, w.prompt, w.gen);
        if (pj_run(sm, &c, &w, &run)) { cm384_model_free(sm); cm384_model_free(m); return 1; }
        have_run = 1;
        printf("  measured: decode %.1f tok/s, TPOT p50 %.2f ms, dispatch %.2f MB, combine %.2f MB, expert-device load "
               "max/mean %.2f over %d MoE layers\n", run.st.decode_tok_per_s, run.st.tpot_p50_ms, run.st.dispatch_bytes / 1e6,
               run.st.combine_bytes / 1e6, run.st.expert_load_max_over_mean, run.n_load_layers);
        cm384_proj_opts_from_config(&o.po, &c);
        o.po.expert_load = run.load;
        o.po.load_layers = run.n_load_layers;
        o.po.load_experts = run.n_experts;
        cm384_model_free(sm);
    }
    cm384_projection *p = calloc(1, sizeof *p);
    if (!p) { cm384_model_free(m); pj_result_free(&run); return pj_fail("out of memory"); }
    if (o.table4) {
        cm384_proj_opts base = o.po;
        pj_table4(m, &base, have_run ? &run : NULL);
    } else {
        if (cm384_project(m, &o.po, p)) { free(p); cm384_model_free(m); pj_result_free(&run); return pj_fail("projecting"); }
        pj_print_report(p);
        if (have_run) {
            cm384_proj_opts perfect = o.po;
            perfect.expert_load = NULL;
            cm384_projection *q = calloc(1, sizeof *q);
            if (q && !cm384_project(m, &perfect, q))
                printf("measured imbalance vs perfect balance: decode %.0f vs %.0f tok/s/NPU (%+.1f%%), prefill %.0f vs %.0f "
                       "tok/s/NPU (%+.1f%%)\n", p->decode_tok_s, q->decode_tok_s, 100 * (p->decode_tok_s / q->decode_tok_s - 1),
                       p->prefill_tok_s, q->prefill_tok_s, 100 * (p->prefill_tok_s / q->prefill_tok_s - 1));
            free(q);
        }
    }
    if (o.svg) {
        if (o.table4 && cm384_project(m, &o.po, p)) { free(p); cm384_model_free(m); pj_result_free(&run); return pj_fail("projecting"); }
        char title[256];
        snprintf(title, sizeof title, "cm384: %s%s, projected on %s", have_run ? "a run of " : "DeepSeek-R1",
                 have_run ? o.from_run : "", !strcmp(p->hw, "h800") ? "H800s" : "CloudMatrix384");
        if (pj_write_svg(o.svg, trace[0] ? trace : NULL, have_run ? &run : NULL, p, title) == 0)
            printf("picture: %s\n", o.svg);
        else rc = 1;
    }
    free(p);
    pj_result_free(&run);
    cm384_model_free(m);
    return rc;
}

/* ======================================================================== */
/* cm384 bench --ablate                                                     */
/* ======================================================================== */

/* Median of n values (sorts them). */
static double pj_median(double *v, int n) {
    for (int i = 1; i < n; i++) for (int j = i; j > 0 && v[j - 1] > v[j]; j--) { double t = v[j]; v[j] = v[j - 1]; v[j - 1] = t; }
    return n ? v[n / 2] : 0;
}

int cm384_cli_ablate(int argc, char **argv) {
    const char *model = "models/shakespeare", *target = "tests/fixtures/deepseek-r1";
    int threads = 2, R = 16, P = 128, N = 32, reps = 1, C = 4;
    double shared = 0.5;
    const char *cmd = "bench --ablate";
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r = 0;
        if (!strcmp(a, "--ablate")) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: cm384 bench --ablate [-m DIR] [--project CONFIG] [--requests N] [-p N] [-n N]\n"
                   "                            [--concurrency N] [--shared-prefix F] [--reps N] [-t N]\n\n"
                   "Runs one workload on the small model DIR (models/shakespeare) with every mechanism on (the\n"
                   "paper preset), then with each switched off in turn, and prints one table: measured here\n"
                   "(decode tokens/s, TTFT, TPOT, fabric bytes, tokens equal to the exact run, perplexity\n"
                   "change) beside the same switches projected on CloudMatrix384 for CONFIG (DeepSeek-R1)\n"
                   "and the gain the paper reports.  Defaults: 16 requests of 128 + 32 tokens, 4 in flight,\n"
                   "2 tenants sharing half of each prompt, 1 run each.\n");
            return 0;
        }
        if (!v) { fprintf(stderr, "cm384 %s: %s needs a value\n", cmd, a); return PJ_USAGE; }
        if (!strcmp(a, "-m")) model = v;
        else if (!strcmp(a, "--project")) target = v;
        else if (!strcmp(a, "-t")) r = pj_int(cmd, a, v, 1, 1024, &threads);
        else if (!strcmp(a, "--requests")) r = pj_int(cmd, a, v, 1, 4096, &R);
        else if (!strcmp(a, "-p")) r = pj_int(cmd, a, v, 2, 65536, &P);
        else if (!strcmp(a, "-n")) r = pj_int(cmd, a, v, 1, 65536, &N);
        else if (!strcmp(a, "--shared-prefix")) r = pj_num(cmd, a, v, 0, 1, &shared);
        else if (!strcmp(a, "--reps")) r = pj_int(cmd, a, v, 1, 16, &reps);
        else if (!strcmp(a, "--concurrency")) r = pj_int(cmd, a, v, 1, 4096, &C);
        else { fprintf(stderr, "cm384 %s: unknown option \"%s\" (cm384 bench --ablate --help)\n", cmd, a); return PJ_USAGE; }
        if (r) return r;
        i++;
    }
    cm384_model *m, *big;
    cm384_load_opts lo;
    cm384_load_opts_init(&lo);
    if (cm384_model_load(model, &lo, &m)) return pj_fail("loading the model");
    if (cm384_model_load_config(target, &big)) { cm384_model_free(m); return pj_fail("loading the projected config"); }
    /* the mechanisms, each switched off in turn through its config field */
    enum { A_ALL, A_INT8_DISPATCH, A_BF16_COMBINE, A_MICRO, A_MTP, A_CACHE, A_EPLB, A_W8A8, A_N };
    static const char *names[A_N] = {"all on (paper preset)", "- INT8 dispatch", "- BF16 combine", "- microbatching",
                                     "- MTP", "- context cache", "- EPLB", "- INT8 W8A8"};
    static const char *paper[A_N] = {"", "7.5 KB vs ~14 KB messages", "(none reported)", "decode +5.8-9.4%, prefill +23-31%",
                                     "decode +6-49%", "prefill x1.42 (50% reuse)", "prefill +18%", "accuracy parity"};
    int switchable[A_N] = {1, 1, 1, 1, 1, 1, 1, 1};
    /* a few requests in flight at a time, so later ones find their tenant's prefix cached */
    pj_workload w = {model, R, C < R ? C : R, P, N, 2, threads, shared, NULL, 1024};
    /* the exact reference: every approximation off, every schedule mechanism on */
    cm384_config ref;
    pj_paper_config(&ref, threads);
    ref.int8 = 0; ref.int8_dispatch = 0; ref.bf16_combine = -1;
    pj_result exact;
    printf("ablation: %s, %d requests x (%d prompt + %d generated) tokens, %d in flight, %d tenants sharing %.0f%% "
           "prefixes; projected: %s on CloudMatrix384, 4096/256, batch 96 per NPU\n", model, R, P, N, w.concurrency,
           w.tenants, 100 * shared, target);
    if (pj_run(m, &ref, &w, &exact)) { cm384_model_free(m); cm384_model_free(big); return 1; }
    printf("exact reference (no INT8 anywhere, fp32 combine): perplexity %.4f on the first 1024 tokens of val.txt, context-cache hit "
           "ratio %.2f (the projection's reuse)\n\n", exact.ppl, exact.st.cache_hit_ratio);
    printf("%-22s | %-68s | %-44s | %s\n", "mechanism", "measured here: decode tok/s  TTFT p50  TPOT p50  fabric MB  tokens=exact  dPPL",
           "projected CM384: decode tok/s/NPU  TPOT  prefill", "paper");
    double base_dec = 0, base_proj = 0, base_pre = 0;
    cm384_projection *pr = calloc(1, sizeof *pr);
    for (int a = 0; a < A_N && pr; a++) {
        cm384_config c;
        pj_paper_config(&c, threads);
        if (a == A_INT8_DISPATCH) c.int8_dispatch = 0;
        if (a == A_BF16_COMBINE) c.bf16_combine = -1;
        if (a == A_MICRO) c.microbatches = 1;
        if (a == A_MTP) c.mtp = 0;
        if (a == A_CACHE) c.cache_bytes = (size_t)-1;
        if (a == A_EPLB) c.eplb_period = -1;
        if (a == A_W8A8) c.int8 = 0;
        /* measured: median decode tok/s of reps runs */
        pj_result r;
        double dec[16], ttft[16], tpot[16];
        int nrep = switchable[a] ? (reps < 16 ? reps : 16) : 0;
        memset(&r, 0, sizeof r);
        double ppl = 0;
        for (int k = 0; k < nrep; k++) {
            if (k) pj_result_free(&r);
            pj_workload wk = w;
            wk.ppl_tokens = k == 0 ? w.ppl_tokens : 0;        /* numerics do not change between repeats */
            if (pj_run(m, &c, &wk, &r)) { free(pr); cm384_model_free(m); cm384_model_free(big); return 1; }
            if (k == 0) ppl = r.ppl;
            dec[k] = r.st.decode_tok_per_s; ttft[k] = r.st.ttft_p50_ms; tpot[k] = r.st.tpot_p50_ms;
        }
        r.ppl = ppl;
        double med = pj_median(dec, nrep), med_ttft = pj_median(ttft, nrep), med_tpot = pj_median(tpot, nrep);
        /* projected: the same switches at full scale, with this run's measured load and cache hits */
        cm384_proj_opts po;
        cm384_proj_opts_init(&po);
        cm384_proj_opts_from_config(&po, &c);
        po.prompt = 4096; po.output = 256; po.batch = 96;
        const pj_result *src = nrep ? &r : &exact;
        po.cache_reuse = a == A_CACHE ? 0 : exact.st.cache_hit_ratio;
        po.expert_load = src->load; po.load_layers = src->n_load_layers; po.load_experts = src->n_experts;
        if (cm384_project(big, &po, pr)) { pj_fail("projecting"); break; }
        if (a == A_ALL) { base_dec = med; base_proj = pr->decode_tok_s; base_pre = pr->prefill_tok_s; }
        int same = 0;
        if (nrep) for (int i = 0; i < R; i++) same += !memcmp(r.tokens + (size_t)i * N, exact.tokens + (size_t)i * N, sizeof(int32_t) * N);
        char meas[160];
        if (nrep)
            snprintf(meas, sizeof meas, "%7.1f (%+5.1f%%) %7.1f ms %6.2f ms %9.2f %6d/%-3d %+7.4f", med,
                     a && base_dec > 0 ? 100 * (base_dec / med - 1) : 0.0, med_ttft, med_tpot,
                     (r.st.dispatch_bytes + r.st.combine_bytes) / 1e6, same, R, r.ppl - exact.ppl);
        else
            snprintf(meas, sizeof meas, "%-68s", "  (no switch in the engine yet: projected only)");
        printf("%-22s | %-68s | %6.0f (%+5.1f%%) %5.1f ms %6.0f (%+5.1f%%) | %s\n", names[a], meas, pr->decode_tok_s,
               a ? 100 * (base_proj / pr->decode_tok_s - 1) : 0.0, pr->tpot_ms, pr->prefill_tok_s,
               a ? 100 * (base_pre / pr->prefill_tok_s - 1) : 0.0, paper[a]);
        pj_result_free(&r);
    }
    printf("\nMeasured: medians of %d runs (load average matters: note it).  Percentages on the mechanism rows are what\n"
           "the mechanism buys: (all on) / (this one off) - 1.\n", reps);
    printf("tokens=exact counts requests whose greedy tokens equal the exact reference's; dPPL is the perplexity change.\n");
    free(pr);
    pj_result_free(&exact);
    cm384_model_free(big);
    cm384_model_free(m);
    return 0;
}

/* cm384 -- the command-line tool, a client of cm384.h like any embedder.
 *
 *   cm384 COMMAND [options] [--] [arguments]
 *   cm384 help [COMMAND]          cm384 COMMAND --help          cm384 --version
 *
 * Exit status: 0 done, 1 the work failed (a load, a file, a request), 2 the
 * command line is wrong (unknown command or option, a bad number, a missing
 * or extra argument).  Numbers are read strictly and checked against their
 * ranges; nothing falls back to a default silently.
 *
 * Commands and options are two tables.  To add a command: write
 * cmd_NAME(const opts *), add a row to `commands` (usage, summary, help with
 * examples, how many arguments it takes) and give it a bit in `enum cmd`;
 * an option is a row of `options` that lists the commands taking it. */
#define _POSIX_C_SOURCE 200809L
#include "../cm384.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

int cm384_cli_project(int argc, char **argv);          /* examples/cm384_project.c */
int cm384_cli_ablate(int argc, char **argv);
int cm384_cli_has(int argc, char **argv, const char *flag);
void cm384_cli_project_usage(FILE *f);

/* ---- options ---- */

typedef struct opts {
    const char *cmd;                          /* the command's name           */
    const char *model, *prompt, *system, *trace, *preset, *kernels, *slo, *cache_dir;
    const char *args[4];                      /* positional arguments         */
    int         n_args;
    int         n_tokens, n_prompt, threads, devices, max_ctx, top, microbatches;
    int         requests, concurrency, tenants, top_k, eplb_period, arrivals, arrival_count;
    int         bf16_combine, time_shared, skewed, kv_bf16, prefill_expanded, prefault, profile;
    struct { int device, kind; unsigned long long step; } fails[16];   /* --fail, in order */
    int         n_fails;
    int         report, json, int8, int8_dispatch, mtp, bos, quiet, verbose, check_values, progress, no_warmup, no_mmap;
    double      temperature, top_p, min_p, shared_prefix, tpot_target, prefill_share;
    unsigned long long seed;
    const char *out, *type;                   /* convert                      */
} opts;

enum cmd {                                    /* one bit per command          */
    C_RUN = 1, C_CHAT = 2, C_TOKENIZE = 4, C_EVAL = 8, C_PERPLEXITY = 16, C_BENCH = 32, C_INFO = 64,
    C_CONVERT = 128,
};
#define C_ENGINE (C_RUN | C_CHAT | C_EVAL | C_PERPLEXITY | C_BENCH)   /* build an engine */
#define C_SAMPLE (C_RUN | C_CHAT | C_BENCH)                           /* generate        */
#define C_ALL    (C_ENGINE | C_TOKENIZE | C_INFO | C_CONVERT)

enum { O_FLAG, O_INT, O_U64, O_FLOAT, O_STR, O_FAIL };

typedef struct option {
    const char *name;
    unsigned    cmds;       /* the commands that take it                      */
    int         kind;
    size_t      off;        /* the field of opts it sets                      */
    double      lo, hi;     /* O_INT, O_FLOAT: the accepted range             */
    int         flag_value; /* O_FLAG: what it stores                         */
    const char *arg, *help;
} option;

#define F(field) offsetof(opts, field)
static const option options[] = {
    {"-m", C_ALL, O_STR, F(model), 0, 0, 0, "DIR", "model directory or .gguf file, or a tokenizer.json (tokenize) (default models/shakespeare)"},
    {"-o", C_CONVERT, O_STR, F(out), 0, 0, 0, "FILE", "the GGUF file to write"},
    {"--type", C_CONVERT, O_STR, F(type), 0, 0, 0, "T", "bf16 (default), f16, f32 or q8_0"},
    {"--check-values", C_ALL, O_FLAG, F(check_values), 0, 0, 1, NULL, "scan every weight for NaN/Inf while loading (slow)"},
    {"--no-mmap", C_ALL, O_FLAG, F(no_mmap), 0, 0, 1, NULL, "read the weight files into memory (huge pages) instead of mapping them"},
    {"--progress", C_ALL, O_FLAG, F(progress), 0, 0, 1, NULL, "show the load's progress whatever the model's size (default: over 64 MB)"},
    {"-p", C_RUN, O_STR, F(prompt), 0, 0, 0, "TEXT", "the prompt (or give it as the argument)"},
    {"-p", C_BENCH, O_INT, F(n_prompt), 1, 1 << 20, 0, "N", "prompt tokens per request (default 128)"},
    {"-n", C_SAMPLE, O_INT, F(n_tokens), 1, 1 << 24, 0, "N", "tokens to generate (default 128; chat 256; bench 64)"},
    {"--temp", C_SAMPLE, O_FLOAT, F(temperature), 0, 1000, 0, "T", "sampling temperature (default 0: greedy)"},
    {"--top-k", C_SAMPLE, O_INT, F(top_k), 0, 1 << 24, 0, "K", "keep the K most likely tokens (0: off)"},
    {"--top-p", C_SAMPLE, O_FLOAT, F(top_p), 0, 1, 0, "P", "nucleus sampling (1: off)"},
    {"--min-p", C_SAMPLE, O_FLOAT, F(min_p), 0, 1, 0, "P", "drop tokens below P x the best one's probability (0: off)"},
    {"--seed", C_SAMPLE, O_U64, F(seed), 0, 0, 0, "S", "sampling seed (default 0): the same seed gives the same tokens"},
    {"--system", C_CHAT, O_STR, F(system), 0, 0, 0, "TEXT", "system prompt"},
    {"-t", C_ENGINE, O_INT, F(threads), 1, 1024, 0, "N", "worker threads (default: online cores)"},
    {"--preset", C_ENGINE, O_STR, F(preset), 0, 0, 0, "NAME", "default | paper | single"},
    {"--devices", C_ENGINE, O_INT, F(devices), 1, 4096, 0, "N", "emulated devices (default 384)"},
    {"--microbatches", C_ENGINE, O_INT, F(microbatches), 1, 2, 0, "N", "1 or 2 (default: 2 with --preset paper, else 1)"},
    {"--ctx", C_ENGINE, O_INT, F(max_ctx), 2, 1 << 24, 0, "N", "max context (perplexity: the window, default 256)"},
    {"--int8", C_ENGINE, O_FLAG, F(int8), 0, 0, 1, NULL, "INT8 W8A8 weights, made while loading"},
    {"--int8-dispatch", C_ENGINE, O_FLAG, F(int8_dispatch), 0, 0, 1, NULL, "dispatch tokens to experts in INT8 (an approximation; the paper preset's default)"},
    {"--no-int8-dispatch", C_ENGINE, O_FLAG, F(int8_dispatch), 0, 0, 0, NULL, "dispatch tokens to experts in fp32 (exact; the default)"},
    {"--bf16-combine", C_ENGINE, O_FLAG, F(bf16_combine), 0, 0, 1, NULL, "expert outputs return in BF16 (an approximation; the paper preset's default)"},
    {"--no-bf16-combine", C_ENGINE, O_FLAG, F(bf16_combine), 0, 0, -1, NULL, "expert outputs return in fp32 (exact; the default)"},
    {"--kv-bf16", C_ENGINE, O_FLAG, F(kv_bf16), 0, 0, 1, NULL, "keep the KV cache in BF16: half its memory (an approximation; default fp32, exact)"},
    {"--prefill-expanded", C_ENGINE, O_FLAG, F(prefill_expanded), 0, 0, 1, NULL, "prefill attends with K and V expanded per head (DeepSeek's naive MLA): faster long prompts, other rounding than decode (default: absorbed, the same bits everywhere)"},
    {"--prefault", C_ENGINE, O_FLAG, F(prefault), 0, 0, 1, NULL, "touch the engine's whole pool at creation, so no prompt pays for first touches of memory (default: pages touched when first used)"},
    {"--time-shared", C_ENGINE, O_FLAG, F(time_shared), 0, 0, 1, NULL, "one loop runs a prefill step then a decode step, in turn (default: prefill and decode run as peers)"},
    {"--prefill-share", C_ENGINE, O_FLOAT, F(prefill_share), 0, 0.9, 0, "S", "peers: the share of the cores prefill gets while both have work (default 0: decode first)"},
    {"--cache-dir", C_ENGINE, O_STR, F(cache_dir), 0, 0, 0, "DIR", "the context cache's disk tier (KV blocks kept across runs) and, with --int8, the model cache (INT8 weights saved once, then mapped)"},
    {"--fail", C_SAMPLE, O_FAIL, F(n_fails), 0, 0, 0, "DEV@STEP[:KIND]", "device DEV fails once the engine has run STEP steps (KIND: device, the default, or link: one step's messages lost); repeatable"},
    {"--mtp", C_ENGINE, O_FLAG, F(mtp), 0, 0, 1, NULL, "speculative decoding with the MTP layer, drafting while it pays"},
    {"--mtp-always", C_ENGINE, O_FLAG, F(mtp), 0, 0, 2, NULL, "MTP drafting on every decode step"},
    {"--kernels", C_ENGINE, O_STR, F(kernels), 0, 0, 0, "NAME", "kernel set (default: the best exact one for this CPU; avx512_bf16: native BF16 dot products, approximate)"},
    {"--no-warmup", C_BENCH, O_FLAG, F(no_warmup), 0, 0, 1, NULL, "time from a cold start (default: one untimed request of the same length first, as llama-bench warms up)"},
    {"--trace", C_ENGINE, O_STR, F(trace), 0, 0, 0, "FILE", "write a Chrome trace (open in Perfetto)"},
    {"--profile", C_BENCH, O_FLAG, F(profile), 0, 0, 1, NULL, "after the report, where each phase's steps spent their time, stage by stage"},
    {"--tpot-target", C_ENGINE, O_FLOAT, F(tpot_target), 0, 1e6, 0, "MS", "SLO: the largest decode batch whose p99 time per output token stays under MS (0: none)"},
    {"--eplb-period", C_ENGINE, O_INT, F(eplb_period), -1, 1000000, 0, "N", "decode steps between EPLB re-placements (default 32; -1: never)"},
    {"-v", C_ENGINE, O_FLAG, F(verbose), 0, 0, 1, NULL, "print the engine's log (topology, memory, preemptions)"},
    {"--report", C_RUN | C_BENCH, O_FLAG, F(report), 0, 0, 1, NULL, "print the supernode report"},
    {"--top", C_EVAL, O_INT, F(top), 1, 1000, 0, "N", "tokens shown per position (default 5)"},
    {"--bos", C_TOKENIZE, O_FLAG, F(bos), 0, 0, 1, NULL, "prepend BOS"},
    {"--quiet", C_TOKENIZE, O_FLAG, F(quiet), 0, 0, 1, NULL, "print only the ids"},
    {"--requests", C_BENCH, O_INT, F(requests), 0, 1000000, 0, "N", "requests (default 16; 0 with --arrivals: prefill alone)"},
    {"--concurrency", C_BENCH, O_INT, F(concurrency), 1, 100000, 0, "C", "requests in flight (default 16)"},
    {"--shared-prefix", C_BENCH, O_FLOAT, F(shared_prefix), 0, 1, 0, "F", "fraction of each prompt shared per tenant (default 0)"},
    {"--tenants", C_BENCH, O_INT, F(tenants), 1, 100000, 0, "T", "context-cache tenants (default 1)"},
    {"--arrivals", C_BENCH, O_INT, F(arrivals), 0, 1 << 20, 0, "P", "prompts of P tokens keep arriving (one in flight, 1 token out each) while the requests decode"},
    {"--arrival-count", C_BENCH, O_INT, F(arrival_count), 1, 1000000, 0, "N", "stop the arrivals after N (default: when the requests end; 4 with --requests 0)"},
    {"--skewed", C_BENCH, O_FLAG, F(skewed), 0, 0, 1, NULL, "every prompt repeats one 8-token phrase (routing concentrates on few experts: EPLB's case)"},
    {"--json", C_BENCH, O_FLAG, F(json), 0, 0, 1, NULL, "one JSON line instead of the report"},
    {"--slo", C_BENCH, O_STR, F(slo), 0, 0, 0, "MS,MS,...", "run the workload under each TPOT target (and with MTP when the model has it): the batch chosen, TPOT, tok/s"},
};
#undef F
#define N_OPTIONS (int)(sizeof options / sizeof options[0])

/* ---- commands ---- */

static int cmd_run(const opts *o), cmd_chat(const opts *o), cmd_tokenize(const opts *o), cmd_eval(const opts *o),
           cmd_perplexity(const opts *o), cmd_bench(const opts *o), cmd_info(const opts *o), cmd_convert(const opts *o);

typedef struct command {
    const char *name;
    unsigned    bit;
    int       (*run)(const opts *o);
    int         min_args, max_args;
    const char *args;       /* the arguments, for usage lines               */
    const char *summary;
    const char *help;       /* what it does, then examples                  */
} command;

static const command commands[] = {
    {"run", C_RUN, cmd_run, 0, 1, "[PROMPT]", "generate from a prompt and stream the text",
     "Generates from PROMPT (or -p TEXT), streaming the text as it comes, then\n"
     "a line with the prompt and generated token counts and the latencies.\n"
     "examples:\n"
     "  cm384 run -m models/shakespeare -p \"ROMEO:\" -n 100\n"
     "  cm384 run -m DIR \"Once upon a time\" --temp 0.8 --top-p 0.95 --seed 1 --report\n"},
    {"chat", C_CHAT, cmd_chat, 0, 0, "", "chat in the model's chat format, one line per user turn",
     "Reads one user turn per line from standard input and answers it in the\n"
     "model's chat format (DeepSeek-V3's template); an empty line or EOF ends.\n"
     "examples:\n"
     "  cm384 chat -m DIR --system \"You are a helpful assistant.\"\n"
     "  echo \"Hello!\" | cm384 chat -m DIR -n 64\n"},
    {"tokenize", C_TOKENIZE, cmd_tokenize, 1, 1, "TEXT", "print the token ids of TEXT",
     "Prints the ids of TEXT as a list, then one line per token with its text.\n"
     "-m takes a model directory or a tokenizer.json on its own.\n"
     "examples:\n"
     "  cm384 tokenize -m tests/fixtures/tokenizer/tokenizer.json \"Hello world\"\n"
     "  cm384 tokenize -m DIR --bos --quiet -- \"--not an option\"\n"},
    {"eval", C_EVAL, cmd_eval, 1, 1, "TEXT", "show the most likely next tokens at every position of TEXT",
     "Evaluates BOS + TEXT in one pass and prints, at every position, the token\n"
     "and the --top most likely next tokens with their probabilities.\n"
     "examples:\n"
     "  cm384 eval -m tests/fixtures/tiny-dsv3 \"Hello\" --top 3\n"},
    {"perplexity", C_PERPLEXITY, cmd_perplexity, 1, 1, "FILE", "mean next-token loss over a text file",
     "Tokenizes FILE (- for standard input), scores it in windows of --ctx\n"
     "tokens (each token predicted from the ones before it in its window) and\n"
     "prints the mean loss in nats per token and its perplexity.  The file must\n"
     "give at least two tokens.\n"
     "examples:\n"
     "  cm384 perplexity -m models/shakespeare models/shakespeare/val.txt --ctx 256\n"
     "  cat notes.txt | cm384 perplexity -m DIR -\n"},
    {"bench", C_BENCH, cmd_bench, 0, 0, "", "drive a workload and print throughput, latency and the report",
     "Submits --requests requests of -p random prompt tokens (a --shared-prefix\n"
     "fraction shared per tenant) and -n generated tokens each, --concurrency at\n"
     "a time, and prints throughput, latency and the supernode report (or one\n"
     "JSON line).  load_s includes making INT8 weights with --int8.\n"
     "examples:\n"
     "  cm384 bench -m DIR -p 512 -n 128 -t 2 --int8 --json\n"
     "  cm384 bench -m DIR --requests 64 --concurrency 16 --shared-prefix 0.5 --tenants 2 --preset paper\n"
     "  cm384 bench -m DIR --requests 96 --concurrency 64 -p 256 -n 64 --slo 5,10,20   (Table 4's shape)\n"
     "`cm384 bench --ablate` switches each mechanism off in turn (cm384 bench --ablate --help).\n"},
    {"info", C_INFO, cmd_info, 0, 0, "", "print the model's shapes and sizes",
     "Loads the model and prints its type, shapes, parameter counts and sizes.\n"
     "examples:\n"
     "  cm384 info -m tests/fixtures/tiny-dsv3\n"
     "  cm384 info -m DIR --check-values\n"},
    {"convert", C_CONVERT, cmd_convert, 0, 0, "", "write the model as a GGUF file llama.cpp loads",
     "Writes the model (-m: a Hugging Face directory or a GGUF file) to -o FILE in\n"
     "llama.cpp's deepseek2 layout, tokenizer and chat template included, with\n"
     "the matrices in --type (norms, biases and the router stay F32).\n"
     "examples:\n"
     "  cm384 convert -m models/shakespeare -o shakespeare-q8_0.gguf --type q8_0\n"},
};
#define N_COMMANDS (int)(sizeof commands / sizeof commands[0])

#define EXIT_RUNTIME 1
#define EXIT_USAGE   2

static const command *find_command(const char *name) {
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

static void usage(FILE *f) {
    fprintf(f, "usage: cm384 COMMAND [options] [--] [arguments]\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-11s %s\n", commands[i].name, commands[i].summary);
    cm384_cli_project_usage(f);
    fprintf(f, "`cm384 help COMMAND` (or `cm384 COMMAND --help`) shows a command's options and examples;\n"
               "`cm384 --version` the version.  Exit status: 0 done, 1 failed, 2 bad command line.\n");
}

static void command_help(const command *c) {
    printf("usage: cm384 %s [options]%s%s\n\n%s\noptions:\n", c->name, c->args[0] ? " " : "", c->args, c->help);
    for (int i = 0; i < N_OPTIONS; i++) {
        const option *p = &options[i];
        if (!(p->cmds & c->bit)) continue;
        char left[40];
        snprintf(left, sizeof left, "%s%s%s", p->name, p->arg ? " " : "", p->arg ? p->arg : "");
        printf("  %-20s %s\n", left, p->help);
    }
    printf("  %-20s %s\n  %-20s %s\n", "-h, --help", "this help", "--", "ends the options: what follows is an argument");
}

/* Prints "cm384 CMD: message" and where to look; returns EXIT_USAGE. */
static int bad_usage(const command *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static int bad_usage(const command *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cm384 %s: ", c->name);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (cm384 help %s)\n", c->name);
    return EXIT_USAGE;
}

/* Strict numbers: the whole text, in range; no spaces, no hex, no NaN. */
/* --fail DEV@STEP[:KIND] */
static int read_fail(const command *c, const char *s, opts *o) {
    if (o->n_fails == (int)(sizeof o->fails / sizeof o->fails[0]))
        return bad_usage(c, "--fail: at most %d faults", (int)(sizeof o->fails / sizeof o->fails[0]));
    char *end;
    errno = 0;
    long dev = strtol(s, &end, 10);
    if (end == s || *end != '@' || errno || dev < 0 || dev > 1000000)
        return bad_usage(c, "--fail \"%s\": DEVICE@STEP[:device|link], e.g. 4@10 or 7@3:link", s);
    const char *st = end + 1;
    errno = 0;
    unsigned long long step = strtoull(st, &end, 10);
    if (end == st || *st == '-' || errno || (*end && *end != ':'))
        return bad_usage(c, "--fail \"%s\": the step is a number of engine steps (DEVICE@STEP[:device|link])", s);
    int kind = 0;
    if (*end == ':') {
        if (!strcmp(end + 1, "device")) kind = CM384_FAULT_DEVICE;
        else if (!strcmp(end + 1, "link")) kind = CM384_FAULT_LINK;
        else return bad_usage(c, "--fail \"%s\": the kind is device or link", s);
    }
    o->fails[o->n_fails].device = (int)dev;
    o->fails[o->n_fails].kind = kind;
    o->fails[o->n_fails].step = step;
    o->n_fails++;
    return 0;
}

static int read_number(const command *c, const option *p, const char *s, void *field) {
    char *end;
    errno = 0;
    if (!*s || *s == ' ' || *s == '\t' || *s == '\n' || *s == '+')
        return bad_usage(c, "%s \"%s\": not a number", p->name, s);
    if (p->kind == O_INT) {
        long v = strtol(s, &end, 10);
        if (*end || errno) return bad_usage(c, "%s \"%s\": not an integer", p->name, s);
        if (v < p->lo || v > p->hi)
            return bad_usage(c, "%s %ld: must be from %.0f to %.0f", p->name, v, p->lo, p->hi);
        *(int *)field = (int)v;
    } else if (p->kind == O_U64) {
        if (*s == '-') return bad_usage(c, "%s \"%s\": must be a non-negative integer", p->name, s);
        unsigned long long v = strtoull(s, &end, 10);
        if (*end || errno) return bad_usage(c, "%s \"%s\": not an integer from 0 to %llu", p->name, s, ~0ull);
        *(unsigned long long *)field = v;
    } else {
        double v = strtod(s, &end);
        if (*end || errno || !isfinite(v) || (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')))
            return bad_usage(c, "%s \"%s\": not a number", p->name, s);
        if (v < p->lo || v > p->hi) return bad_usage(c, "%s %s: must be from %g to %g", p->name, s, p->lo, p->hi);
        *(double *)field = v;
    }
    return 0;
}

/* Reads argv[2..] for command c.  Returns 0, EXIT_USAGE, or -1 for --help. */
static int parse_args(const command *c, int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->cmd = c->name;
    o->model = "models/shakespeare";
    o->top = 5;
    o->int8_dispatch = -1;                                 /* the library's default */
    o->top_p = 1.0;
    o->requests = 16;
    o->concurrency = 16;
    o->tenants = 1;
    int only_args = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (only_args || a[0] != '-' || !a[1]) {              /* "-" alone is an argument (stdin) */
            if (o->n_args >= c->max_args) {
                if (c->max_args == 0) return bad_usage(c, "takes no arguments, got \"%s\"", a);
                return bad_usage(c, "takes %d argument%s (%s), got another: \"%s\"", c->max_args,
                                 c->max_args > 1 ? "s" : "", c->args, a);
            }
            o->args[o->n_args++] = a;
            continue;
        }
        if (!strcmp(a, "--")) { only_args = 1; continue; }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return -1;
        /* --name=value */
        char name[64];
        const char *eq = !strncmp(a, "--", 2) ? strchr(a, '=') : NULL, *val = NULL;
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        if (nl >= sizeof name) return bad_usage(c, "unknown option %.40s...", a);
        memcpy(name, a, nl);
        name[nl] = 0;
        if (eq) val = eq + 1;
        const option *p = NULL;
        int elsewhere = 0;
        for (int k = 0; k < N_OPTIONS && !p; k++)
            if (!strcmp(options[k].name, name)) {
                if (options[k].cmds & c->bit) p = &options[k];
                else elsewhere = 1;
            }
        if (!p) {
            if (elsewhere) return bad_usage(c, "%s is not an option of %s", name, c->name);
            return bad_usage(c, "unknown option %s", name);
        }
        void *field = (char *)o + p->off;
        if (p->kind == O_FLAG) {
            if (val) return bad_usage(c, "%s takes no value", name);
            *(int *)field = p->flag_value;
            continue;
        }
        if (!val) {
            if (i + 1 >= argc) return bad_usage(c, "%s needs a value (%s)", name, p->arg);
            val = argv[++i];
        }
        if (p->kind == O_STR) *(const char **)field = val;
        else if (p->kind == O_FAIL) { if (read_fail(c, val, o)) return EXIT_USAGE; }
        else if (read_number(c, p, val, field)) return EXIT_USAGE;
    }
    if (o->n_args < c->min_args) return bad_usage(c, "missing %s", c->args);
    if (o->preset && strcmp(o->preset, "default") && strcmp(o->preset, "paper") && strcmp(o->preset, "single"))
        return bad_usage(c, "--preset \"%s\": one of default, paper, single", o->preset);
    if (c->bit == C_RUN && o->prompt && o->n_args) return bad_usage(c, "give the prompt as -p TEXT or as the argument, not both");
    return 0;
}

/* ---- loading, with progress on one line ---- */

static struct { const char *stage; int pct, open, show, force; } progress;

static void progress_end(void) {
    if (progress.open) fputc('\n', stderr);
    progress.open = 0;
}

static int die(const char *what, int status) {
    progress_end();
    fprintf(stderr, "cm384: %s: %s\n", what, cm384_last_error()[0] ? cm384_last_error() : cm384_strerror(status));
    return EXIT_RUNTIME;
}

static int on_progress(void *user, const char *stage, uint64_t done, uint64_t total) {
    (void)user;
    int pct = total ? (int)(100.0 * (double)done / (double)total) : 100;
    if (pct > 100) pct = 100;
    if (!progress.stage || strcmp(progress.stage, stage)) {   /* a new stage: a new line */
        progress_end();
        progress.stage = stage;
        progress.pct = -1;
        progress.show = progress.force || total > (64u << 20);   /* big models only: every 10% */
    }
    if (progress.show && (pct / 10 != progress.pct / 10 || (pct == 100 && progress.pct != 100))) {
        const char *what = !strcmp(stage, "tensors") ? "loading tensors"
                         : !strcmp(stage, "check") ? "checking values"
                         : !strcmp(stage, "quantize") ? "making INT8 weights" : stage;
        fprintf(stderr, "\r%s: %3d%%", what, pct);
        progress.open = 1;
        progress.pct = pct;
        if (pct == 100) progress_end();
    }
    return 0;
}

static int load(const opts *o, cm384_model **m) {
    cm384_load_opts lo;
    cm384_load_opts_init(&lo);
    lo.progress = on_progress;
    progress.force = o->progress;
    lo.check_values = o->check_values;
    lo.use_mmap = !o->no_mmap;
    lo.int8 = o->int8;
    lo.cache_dir = o->int8 ? o->cache_dir : NULL;     /* the model cache: INT8 weights mapped or read from it, or saved there */
    int r = cm384_model_load(o->model, &lo, m);
    progress_end();
    if (r) return die("loading the model", r);
    return 0;
}

static void on_log(void *user, int level, const char *msg) {
    const opts *o = user;
    if (level >= 2) fprintf(stderr, "cm384: warning: %s\n", msg);
    else if (o->verbose) fprintf(stderr, "cm384: %s\n", msg);
}

static int make_engine(const opts *o, cm384_model *m, cm384_engine **e) {
    cm384_config c;
    cm384_config_init(&c);
    if (o->threads) c.n_workers = o->threads;
    if (o->devices) c.n_devices = o->devices;
    if (o->preset) c.preset = o->preset;
    if (o->max_ctx) c.max_ctx = o->max_ctx;
    c.int8 = o->int8;
    if (o->int8_dispatch >= 0) c.int8_dispatch = o->int8_dispatch;
    c.microbatches = o->microbatches;
    c.mtp = o->mtp;
    c.trace_path = o->trace;
    c.kernels = o->kernels;
    c.tpot_target_ms = o->tpot_target;
    c.eplb_period = o->eplb_period;
    c.bf16_combine = o->bf16_combine;
    c.time_shared = o->time_shared;
    c.prefill_share = o->prefill_share;
    c.kv_bf16 = o->kv_bf16;
    c.prefill_expanded = o->prefill_expanded;
    c.prefault = o->prefault;
    c.profile = o->profile;
    c.cache_dir = o->cache_dir;
    c.log = on_log;
    c.log_user = (void *)o;
    int r = cm384_engine_create(m, &c, e);
    if (r) return die("creating the engine", r);
    for (int i = 0; i < o->n_fails; i++)
        if ((r = cm384_fail_device_at(*e, o->fails[i].device, o->fails[i].kind, o->fails[i].step))) {
            cm384_engine_free(*e);
            *e = NULL;
            return die("--fail", r);
        }
    return 0;
}

/* After a run with --fail: what each fault took, and the ones whose step
 * never came. */
static void print_faults(const opts *o, cm384_engine *e) {
    if (!o->n_fails) return;
    cm384_fault_info fi[16];
    for (int i = 0; i < 16; i++) fi[i].struct_size = sizeof fi[i];
    int n = cm384_get_faults(e, fi, 16);
    for (int i = 0; i < n && i < 16; i++)
        fprintf(stderr, "fault: %s %d (%s) at step %llu: %d request%s re-admitted, %llu tokens recomputed, %d experts "
                "re-placed, %d left to a replica, %llu messages retried; %s %.2f ms%s\n",
                fi[i].kind == CM384_FAULT_LINK ? "link of device" : "device", fi[i].device, fi[i].roles,
                (unsigned long long)fi[i].step, fi[i].requests_readmitted, fi[i].requests_readmitted == 1 ? "" : "s",
                (unsigned long long)fi[i].tokens_recomputed, fi[i].experts_replaced, fi[i].experts_failed_over,
                (unsigned long long)fi[i].messages_retried, fi[i].recovery_ms >= 0 ? "recovered in" : "still recovering after",
                fi[i].recovery_ms >= 0 ? fi[i].recovery_ms : 0.0, fi[i].fatal ? "; FATAL: no device of a needed role is left" : "");
    if (n < o->n_fails)
        fprintf(stderr, "fault: %d of the %d faults asked for never happened (the run ended before their step)\n",
                o->n_fails - n, o->n_fails);
}

static void sampling_from(const opts *o, cm384_sampling *s, int dflt_tokens) {
    cm384_sampling_init(s);
    s->temperature = (float)o->temperature;
    s->top_k = o->top_k;
    s->top_p = (float)o->top_p;
    s->min_p = (float)o->min_p;
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
    else
        fprintf(stderr, "\n[%d prompt tokens (%d cached), %d generated, TTFT %.1f ms, %.1f ms/token]\n",
                ev->n_prompt, ev->n_cached, ev->n_generated, ev->ttft_ms, ev->tpot_ms);
    return 0;
}

static int print_report(cm384_engine *e) {
    int n = cm384_report(e, NULL, 0);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (!buf) return die("report", n < 0 ? n : CM384_E_NOMEM);
    cm384_report(e, buf, (size_t)n + 1);
    fputs(buf, stdout);
    free(buf);
    return 0;
}

/* --profile: each phase's stages by time, against its busy time (the
 * steps' span; what the stages leave is bookkeeping and hand-overs). */
static int stage_time_desc(const void *a, const void *b) {
    double x = ((const cm384_stage_time *)a)->seconds, y = ((const cm384_stage_time *)b)->seconds;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int print_profile(cm384_engine *e) {
    int n = cm384_get_profile(e, NULL, 0);
    if (n < 0) return die("profile", n);
    cm384_stage_time *t = malloc(sizeof *t * (size_t)(n + 1));
    if (!t) return die("profile", CM384_E_NOMEM);
    n = cm384_get_profile(e, t, n);
    qsort(t, (size_t)n, sizeof *t, stage_time_desc);
    cm384_stats st = {.struct_size = sizeof st};
    cm384_get_stats(e, &st);
    for (int ph = 0; ph < 2; ph++) {
        double busy = ph == CM384_PHASE_DECODE ? st.decode_seconds : st.prefill_seconds;
        unsigned long long steps = ph == CM384_PHASE_DECODE ? st.decode_steps : st.prefill_steps;
        if (busy <= 0 || !steps) continue;
        printf("\nwhere %s's time went: %llu steps, %.3f ms a step (stages by their time, first task's start to last task's end)\n",
               ph == CM384_PHASE_DECODE ? "decode" : "prefill", steps, 1e3 * busy / (double)steps);
        printf("  %-10s %-28s %10s %8s %7s\n", "operation", "stage", "ms/step", "share", "regions");
        double sum = 0;
        for (int i = 0; i < n; i++) {
            if (t[i].phase != ph) continue;
            sum += t[i].seconds;
            printf("  %-10s %-28s %10.3f %7.1f%% %7llu\n", t[i].name, t[i].op, 1e3 * t[i].seconds / (double)steps,
                   100 * t[i].seconds / busy, (unsigned long long)t[i].regions);
        }
        printf("  %-39s %10.3f %7.1f%%\n", "(between stages: bookkeeping, hand-overs)",
               1e3 * (busy - sum) / (double)steps, 100 * (busy - sum) / busy);
    }
    free(t);
    return 0;
}

static int cmd_run(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return EXIT_RUNTIME;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return EXIT_RUNTIME; }
    const char *prompt = o->prompt ? o->prompt : o->n_args ? o->args[0] : "";
    cm384_sampling s;
    sampling_from(o, &s, 128);
    stream st = {stdout, 0, NULL, 0, 0};
    fputs(prompt, stdout);
    int r = cm384_generate(e, prompt, NULL, 0, &s, print_event, &st);
    if (r) die("generating", r);
    if (o->report) { printf("\n"); if (print_report(e)) r = 1; }
    print_faults(o, e);
    cm384_engine_free(e);
    cm384_model_free(m);
    return r ? EXIT_RUNTIME : 0;
}

static int cmd_chat(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return EXIT_RUNTIME;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return EXIT_RUNTIME; }
    enum { MAX_MSGS = 256 };
    cm384_chat_msg msgs[MAX_MSGS];
    char *owned[MAX_MSGS] = {0};
    int n = 0, status = 0;
    if (o->system) msgs[n++] = (cm384_chat_msg){"system", o->system, NULL, 0};
    char *line = NULL;
    size_t line_cap = 0;
    fprintf(stderr, "chat with %s (empty line or EOF ends)\n", o->model);
    while (n + 2 <= MAX_MSGS) {
        fprintf(stderr, "> ");
        ssize_t got = getline(&line, &line_cap, stdin);
        if (got <= 0 || line[0] == '\n') break;
        line[strcspn(line, "\n")] = 0;
        if (!(owned[n] = strdup(line))) { status = die("chat", CM384_E_NOMEM); break; }
        msgs[n] = (cm384_chat_msg){"user", owned[n], NULL, 0};
        n++;
        int len = cm384_chat_render(m, msgs, n, CM384_CHAT_ADD_GENERATION_PROMPT, NULL, 0);
        if (len < 0) { status = die("rendering the chat", len); break; }
        char *text = malloc((size_t)len + 1);
        if (text) cm384_chat_render(m, msgs, n, CM384_CHAT_ADD_GENERATION_PROMPT, text, (size_t)len + 1);
        int n_ids = text ? cm384_tokenize(m, text, (size_t)len, NULL, 0, 0) : CM384_E_NOMEM;
        int32_t *ids = n_ids > 0 ? malloc(sizeof(int32_t) * (size_t)n_ids) : NULL;
        char *reply = calloc(1, 1 << 16);
        if (!text || n_ids <= 0 || !ids || !reply) {
            free(text); free(ids); free(reply);
            status = die("tokenizing the chat", n_ids < 0 ? n_ids : CM384_E_NOMEM);
            break;
        }
        cm384_tokenize(m, text, (size_t)len, ids, n_ids, 0);
        cm384_sampling s;
        sampling_from(o, &s, 256);
        stream st = {stdout, 0, reply, 0, 1 << 16};
        int r = cm384_generate(e, NULL, ids, n_ids, &s, print_event, &st);
        printf("\n");
        free(text);
        free(ids);
        if (r) { free(reply); status = die("generating", r); break; }
        owned[n] = reply;
        msgs[n++] = (cm384_chat_msg){"assistant", reply, NULL, 0};
    }
    free(line);
    for (int i = 0; i < n; i++) free(owned[i]);
    cm384_engine_free(e);
    cm384_model_free(m);
    return status;
}

/* ---- tokenize / eval ---- */

static int cmd_tokenize(const opts *o) {
    cm384_model *m;
    if (load(o, &m)) return EXIT_RUNTIME;
    const char *text = o->args[0];
    unsigned flags = o->bos ? CM384_TOK_ADD_BOS : 0;
    int n = cm384_tokenize(m, text, strlen(text), NULL, 0, flags);
    int32_t *ids = n >= 0 ? malloc(sizeof(int32_t) * (size_t)(n + 1)) : NULL;
    if (!ids) { cm384_model_free(m); return die("tokenize", n < 0 ? n : CM384_E_NOMEM); }
    cm384_tokenize(m, text, strlen(text), ids, n, flags);
    printf("[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
    printf("]\n");
    if (!o->quiet)
        for (int i = 0; i < n; i++) {
            char piece[256];
            cm384_token_text(m, ids[i], piece, sizeof piece);
            printf("%6d  %s\n", ids[i], piece);
        }
    free(ids);
    cm384_model_free(m);
    return 0;
}

static int cmd_eval(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) return EXIT_RUNTIME;
    if (make_engine(o, m, &e)) { cm384_model_free(m); return EXIT_RUNTIME; }
    const char *text = o->args[0];
    int n = cm384_tokenize(m, text, strlen(text), NULL, 0, CM384_TOK_ADD_BOS);
    int V = cm384_vocab_size(m);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    float *lg = n > 0 ? malloc(sizeof(float) * (size_t)n * (size_t)V) : NULL;
    int r = n <= 0 ? (n < 0 ? n : CM384_E_INVALID) : !ids || !lg ? CM384_E_NOMEM : CM384_OK;
    if (r) {
        free(ids); free(lg); cm384_engine_free(e); cm384_model_free(m);
        return die(n == 0 ? "eval: the text gives no tokens and the model has no BOS" : "tokenize", r);
    }
    cm384_tokenize(m, text, strlen(text), ids, n, CM384_TOK_ADD_BOS);
    if ((r = cm384_eval(e, ids, n, lg, NULL))) {
        free(ids); free(lg); cm384_engine_free(e); cm384_model_free(m);
        return die("eval", r);
    }
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
            if (best < 0) break;
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

/* The whole of a file (or of standard input for "-"), or NULL with a message. */
static char *read_text(const char *path, size_t *len) {
    FILE *f = stdin;
    if (strcmp(path, "-")) {
        struct stat st;
        if (stat(path, &st) != 0) { fprintf(stderr, "cm384 perplexity: %s: %s\n", path, strerror(errno)); return NULL; }
        if (S_ISDIR(st.st_mode)) { fprintf(stderr, "cm384 perplexity: %s is a directory, not a text file\n", path); return NULL; }
        if (!(f = fopen(path, "rb"))) { fprintf(stderr, "cm384 perplexity: %s: %s\n", path, strerror(errno)); return NULL; }
    }
    size_t n = 0, cap = 1 << 16;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (ferror(f)) { fprintf(stderr, "cm384 perplexity: %s: read error\n", path); free(buf); buf = NULL; break; }
        if (feof(f)) break;
        if (n + 1 >= cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) { free(buf); buf = NULL; }
            buf = b;
        }
    }
    if (f != stdin) fclose(f);
    if (!buf) { fprintf(stderr, "cm384 perplexity: %s: out of memory\n", path); return NULL; }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int cmd_perplexity(const opts *o) {
    const char *path = o->args[0];
    size_t got;
    char *text = read_text(path, &got);
    if (!text) return EXIT_RUNTIME;
    cm384_model *m;
    cm384_engine *e;
    if (load(o, &m)) { free(text); return EXIT_RUNTIME; }
    int W = o->max_ctx ? o->max_ctx : 256;
    int n = cm384_tokenize(m, text, got, NULL, 0, 0);
    if (n < 2) {
        if (n < 0) die("tokenize", n);
        else fprintf(stderr, "cm384 perplexity: %s gives %d token%s; perplexity needs at least 2 "
                             "(one to predict from, one to predict)\n", path, n, n == 1 ? "" : "s");
        free(text);
        cm384_model_free(m);
        return EXIT_RUNTIME;
    }
    opts oo = *o;
    oo.max_ctx = W;
    if (make_engine(&oo, m, &e)) { free(text); cm384_model_free(m); return EXIT_RUNTIME; }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    int V = cm384_vocab_size(m);
    float *lg = malloc(sizeof(float) * (size_t)W * (size_t)V);
    int status = 0;
    if (!ids || !lg) status = die("perplexity", CM384_E_NOMEM);
    else cm384_tokenize(m, text, got, ids, n, 0);
    /* non-overlapping windows of W tokens; each scored on all its positions
       (W-1 predictions); a last window of one token predicts nothing */
    double nll = 0, t0 = now_s();
    long count = 0;
    for (int w0 = 0; !status && w0 + 1 < n; w0 += W) {
        int wn = n - w0 < W ? n - w0 : W;
        int r = cm384_eval(e, ids + w0, wn, lg, NULL);
        if (r) { status = die("eval", r); break; }
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
    if (!status)
        printf("%s: %d tokens, windows of %d, %ld predictions: mean loss %.6f nats/token, perplexity %.4f (%.1f tok/s)\n",
               path, n, W, count, nll / count, exp(nll / count), count / (dt > 0 ? dt : 1e-9));
    free(ids); free(lg); free(text);
    cm384_engine_free(e);
    cm384_model_free(m);
    return status;
}

/* ---- bench ---- */

typedef struct bench_req {
    int32_t *ids;
    int      n;
    uint64_t id;
    int      done;           /* its final event came                           */
    double   t_last;         /* its last token, for the gaps between tokens    */
    double  *gaps;           /* ms between consecutive tokens (NULL: not kept) */
    int      n_gaps, cap_gaps;
    double   ttft_sum, ttft_max;  /* over its finished runs (the arrivals reuse one) */
    int      n_ttft;
} bench_req;

/* The workload: R requests (C in flight, T tenants), and optionally prompts
 * of AP tokens arriving one at a time while they run (AN of them at most). */
typedef struct bench_work {
    bench_req *rq;
    int        R, C, T;
    int32_t   *arr;
    int        AP, AN;
} bench_work;

typedef struct bench_out {
    cm384_stats st;
    double      wall;
    int         n_arrived;
    double      arr_ttft_mean, arr_ttft_max;   /* the arrivals' time to first token */
    double      itl50, itl99;        /* gaps between tokens, over every request  */
    double      tp50, tp99;          /* each request's mean gap, over requests   */
} bench_out;

static int bench_event(void *user, const cm384_event *ev) {
    bench_req *b = user;
    if (ev->kind != CM384_EV_TOKEN) {
        if (ev->kind == CM384_EV_DONE) {
            b->ttft_sum += ev->ttft_ms;
            if (ev->ttft_ms > b->ttft_max) b->ttft_max = ev->ttft_ms;
            b->n_ttft++;
        }
        b->done = 1;
        return 0;
    }
    double t = now_s();
    if (b->t_last > 0 && b->n_gaps < b->cap_gaps) b->gaps[b->n_gaps++] = (t - b->t_last) * 1e3;
    b->t_last = t;
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double quantile(double *v, int n, double q) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int k = (int)ceil(q * n) - 1;
    return v[k < 0 ? 0 : k >= n ? n - 1 : k];
}

/* Runs the workload on a fresh engine.  Fills out; returns 0 or an exit
 * status. */
static int bench_run(const opts *o, cm384_model *m, const bench_work *w, const cm384_sampling *s, bench_out *out,
                     cm384_engine **keep) {
    cm384_engine *e;
    bench_req *rq = w->rq;
    int R = w->R, C = w->C, T = w->T;
    memset(out, 0, sizeof *out);
    if (make_engine(o, m, &e)) return EXIT_RUNTIME;
    int status = 0, next = 0, finished = 0;
    if (!o->no_warmup && (R > 0 || w->AP > 0)) {   /* untimed: a prompt of the same length (other tokens: no cache hit), 2 tokens out */
        int P = R > 0 ? rq[0].n : w->AP, V = cm384_vocab_size(m);
        uint64_t rng = 0x9e3779b97f4a7c15ull;
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)P);
        uint64_t id = 0;
        cm384_sampling ws = *s;
        ws.max_tokens = 2;
        if (!ids) status = die("bench", CM384_E_NOMEM);
        for (int k = 0; !status && k < P; k++) { rng = rng * 6364136223846793005ull + 1; ids[k] = 3 + (int)((rng >> 33) % (uint64_t)(V - 3)); }
        cm384_request q;
        cm384_request_init(&q);
        q.ids = ids; q.n_ids = P; q.sampling = &ws; q.tenant = (uint32_t)T;
        if (!status && !cm384_submit(e, &q, &id)) cm384_wait(e, id, -1);
        free(ids);
        cm384_reset_stats(e);
    }
    for (int i = 0; i < R; i++) { rq[i].done = 0; rq[i].t_last = 0; rq[i].n_gaps = 0; rq[i].id = 0; }
    cm384_sampling as = *s;                           /* the arriving prompts: one token out each */
    as.max_tokens = 1;
    bench_req arq;
    memset(&arq, 0, sizeof arq);
    arq.done = 1;
    double t0 = now_s();
    while (!status && (finished < R || (w->AP > 0 && R == 0 && out->n_arrived < w->AN) || !arq.done)) {
        /* an arriving prompt: one in flight while the requests run */
        if (w->AP > 0 && arq.done && out->n_arrived < w->AN && (finished < R || R == 0)) {
            if (arq.id) cm384_wait(e, arq.id, -1);
            cm384_request q;
            cm384_request_init(&q);
            q.ids = w->arr; q.n_ids = w->AP; q.sampling = &as;
            q.tenant = (uint32_t)(T + 1 + out->n_arrived);     /* never served from the cache */
            q.on_event = bench_event; q.user = &arq;
            arq.done = 0;
            int r = cm384_submit(e, &q, &arq.id);
            if (r) { status = die("submit", r); break; }
            out->n_arrived++;
        }
        if (finished == R) {                                /* only the arrival left: let it finish */
            int r = cm384_wait(e, arq.id, -1);
            if (r) { status = die("request", r); break; }
            arq.done = 1; arq.id = 0;
            continue;
        }
        while (next < R && next - finished < C) {
            cm384_request q;
            cm384_request_init(&q);
            q.ids = rq[next].ids; q.n_ids = rq[next].n; q.sampling = s;
            q.tenant = (uint32_t)(next % T);
            q.on_event = bench_event; q.user = &rq[next];
            int r = cm384_submit(e, &q, &rq[next].id);
            if (r) { status = die("submit", r); break; }
            next++;
        }
        if (status) break;
        int r = cm384_wait(e, rq[finished].id, w->AP > 0 && !arq.done ? 2 : -1);   /* poll: the arrival may need replacing */
        if (r == CM384_E_TIMEOUT) continue;
        if (r) { status = die("request", r); break; }
        finished++;
    }
    if (status) {                                     /* stop what is still running */
        for (int i = finished; i < next; i++) cm384_cancel(e, rq[i].id);
        if (arq.id) cm384_cancel(e, arq.id);
        cm384_wait_all(e);
    } else if (arq.id && !arq.done) cm384_wait(e, arq.id, -1);
    out->arr_ttft_mean = arq.n_ttft ? arq.ttft_sum / arq.n_ttft : 0;
    out->arr_ttft_max = arq.ttft_max;
    out->wall = now_s() - t0;
    /* gaps between consecutive tokens of the requests, and each one's TPOT */
    int n_gaps = 0;
    for (int i = 0; i < R; i++) n_gaps += rq[i].n_gaps;
    double *gaps = malloc(sizeof(double) * (size_t)(n_gaps + 1)), *tpots = malloc(sizeof(double) * (size_t)(R + 1));
    if (gaps && tpots) {
        n_gaps = 0;
        for (int i = 0; i < R; i++) {
            double sum = 0;
            for (int k = 0; k < rq[i].n_gaps; k++) { gaps[n_gaps++] = rq[i].gaps[k]; sum += rq[i].gaps[k]; }
            tpots[i] = rq[i].n_gaps ? sum / rq[i].n_gaps : 0;
        }
        out->itl50 = quantile(gaps, n_gaps, 0.5); out->itl99 = quantile(gaps, n_gaps, 0.99);
        out->tp50 = quantile(tpots, R, 0.5); out->tp99 = quantile(tpots, R, 0.99);
    }
    free(gaps);
    free(tpots);
    out->st.struct_size = sizeof out->st;
    cm384_get_stats(e, &out->st);
    if (!o->json) print_faults(o, e);
    if (keep && !status) *keep = e;
    else cm384_engine_free(e);
    return status;
}

/* --slo 15,30,50: the workload under each target, as the paper's Table 4
 * (batch chosen, TPOT, tokens/s), and again with MTP when the model has it. */
static int bench_slo(const opts *o, cm384_model *m, const bench_work *w, const cm384_sampling *s) {
    double targets[32];
    int n = 0;
    const char *p = o->slo;
    while (*p && n < 32) {
        char *end;
        double v = strtod(p, &end);
        if (end == p || !isfinite(v) || v <= 0 || (*end && *end != ',')) {
            fprintf(stderr, "cm384 bench: --slo \"%s\": a comma-separated list of targets in ms, each > 0 (cm384 help bench)\n", o->slo);
            return EXIT_USAGE;
        }
        targets[n++] = v;
        p = *end ? end + 1 : end;
    }
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    printf("SLO table: %d requests x (%d prompt + %d generated) tokens, %d in flight\n", w->R, w->rq[0].n, s->max_tokens, w->C);
    printf("  %-9s %-4s %8s %11s %11s %12s  %s\n", "target", "MTP", "batch", "TPOT p50", "TPOT p99", "tok/s", "");
    for (int mtp = 0; mtp <= (in.n_mtp_layers > 0); mtp++)
        for (int i = 0; i < n; i++) {
            opts oo = *o;
            oo.tpot_target = targets[i];
            oo.mtp = mtp;
            bench_out out;
            int r = bench_run(&oo, m, w, s, &out, NULL);
            if (r) return r;
            const cm384_stats st = out.st;
            int met = st.tpot_p99_ms <= targets[i];
            printf("  %6.2f ms %-4s %8d %8.2f ms %8.2f ms %12.1f  %s\n", targets[i], mtp ? "on" : "off", st.decode_batch_cap,
                   st.tpot_p50_ms, st.tpot_p99_ms, (double)w->R * s->max_tokens / out.wall,
                   st.slo_infeasible ? "infeasible: one request alone misses it" : met ? "met" : "MISSED");
        }
    printf("batch: the number of requests the controller let run at once at the end; TPOT per request (MTP's\n"
           "extra tokens count); tok/s generated over the whole run.\n");
    return 0;
}

static int cmd_bench(const opts *o) {
    cm384_model *m;
    cm384_engine *e;
    double t_load = now_s();
    if (load(o, &m)) return EXIT_RUNTIME;
    t_load = now_s() - t_load;
    int P = o->n_prompt > 0 ? o->n_prompt : 128, N = o->n_tokens > 0 ? o->n_tokens : 64;
    int R = o->requests, C = o->concurrency < R ? o->concurrency : R, T = o->tenants;
    int AP = o->arrivals, AN = o->arrival_count > 0 ? o->arrival_count : R ? 1 << 30 : 4;
    int V = cm384_vocab_size(m), bos = cm384_token_bos(m);
    if (V < 4) { cm384_model_free(m); fprintf(stderr, "cm384 bench: the vocabulary is too small (%d)\n", V); return EXIT_RUNTIME; }
    if (R == 0 && AP == 0) {
        cm384_model_free(m);
        fprintf(stderr, "cm384 bench: --requests 0 needs --arrivals P (prefill alone) (cm384 help bench)\n");
        return EXIT_USAGE;
    }
    if (o->slo && R == 0) {
        cm384_model_free(m);
        fprintf(stderr, "cm384 bench: --slo needs requests to decode (cm384 help bench)\n");
        return EXIT_USAGE;
    }
    opts oo = *o;
    if (!oo.max_ctx) oo.max_ctx = (AP > P ? AP : P) + N + 16;
    /* prompts: a shared prefix per tenant, then random tokens */
    int shared = (int)(o->shared_prefix * P), status = 0;
    uint64_t rng = 0x1234567;
    bench_req *rq = calloc((size_t)R + 1, sizeof *rq);
    int32_t *prefix = malloc(sizeof(int32_t) * (size_t)T * (size_t)(shared + 1));
    int32_t *arr = malloc(sizeof(int32_t) * (size_t)(AP + 1));
    if (!rq || !prefix || !arr) status = die("bench", CM384_E_NOMEM);
    for (int i = 0; !status && i < T * shared; i++) {
        rng = rng * 6364136223846793005ull + 1;
        prefix[i] = 3 + (int)((rng >> 33) % (uint64_t)(V - 3));
    }
    rng ^= (uint64_t)o->seed * 0x9e3779b97f4a7c15ull;      /* --seed: other suffixes after the same prefixes */
    for (int i = 0; !status && i < R; i++) {
        rq[i].n = P;
        if (!(rq[i].ids = malloc(sizeof(int32_t) * (size_t)P))) { status = die("bench", CM384_E_NOMEM); break; }
        for (int k = 0; k < P; k++) {
            rng = rng * 6364136223846793005ull + 1;
            rq[i].ids[k] = k < shared ? prefix[(size_t)(i % T) * shared + k] : 3 + (int)((rng >> 33) % (uint64_t)(V - 3));
            if (o->skewed) rq[i].ids[k] = 3 + (int)((0x9e3779b9u * (unsigned)(k % 8 + 1)) % (unsigned)(V - 3));
        }
        if (bos >= 0) rq[i].ids[0] = bos;
        rq[i].cap_gaps = N;
        if (!(rq[i].gaps = calloc((size_t)N, sizeof(double)))) { status = die("bench", CM384_E_NOMEM); break; }
    }
    for (int k = 0; !status && k < AP; k++) {           /* the arriving prompt: random tokens */
        rng = rng * 6364136223846793005ull + 1;
        arr[k] = 3 + (int)((rng >> 33) % (uint64_t)(V - 3));
    }
    if (!status && AP > 0 && bos >= 0) arr[0] = bos;
    bench_work w = {rq, R, C, T, arr, AP, AN};
    cm384_sampling s;
    sampling_from(o, &s, N);
    s.max_tokens = N;
    s.ignore_eos = 1;
    bench_out out;
    memset(&out, 0, sizeof out);
    e = NULL;
    if (!status && o->slo) status = bench_slo(&oo, m, &w, &s);
    else if (!status) status = bench_run(&oo, m, &w, &s, &out, &e);
    const cm384_stats st = out.st;
    double wall = out.wall > 0 ? out.wall : 1e-9;
    double out_tok_s = (double)R * N / wall;
    double arrival_tok_s = (double)out.n_arrived * AP / wall;
    double total_tok_s = ((double)R * N + (double)st.tokens_prefilled) / wall;
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
    /* and the attention core's fp32 flops beside them (absorbed MLA: per
       head and key a score over kv_lora + rope and a weighted latent over
       kv_lora), a prompt's token seeing (P + 1) / 2 keys on average when
       it is prefilled from position 0: at 512 tokens on bench-M's shapes
       nearly a quarter of the products' ops (71 MFLOP a token against 304
       MOP), but at the FP32 peak, not the INT8 one */
    double core_flop = 2.0 * in.n_heads * (2.0 * in.kv_lora_rank + in.qk_rope_head_dim) * (P + 1) / 2.0 * in.n_layers;
    double prefill_core_gflops = core_flop * st.prefill_tok_per_s / 1e9;
    if (!status && !o->slo && o->json) {
        printf("{\"active_params\":%llu,\"bytes_per_param\":%.1f,\"decode_weight_gbs\":%.2f,\"prefill_gops\":%.2f,"
               "\"prefill_core_gflops\":%.3f,",
               (unsigned long long)in.n_active_params, bpp, decode_gbs, prefill_gops, prefill_core_gflops);
        printf("\"model\":\"%s\",\"prompt\":%d,\"gen\":%d,\"requests\":%d,\"concurrency\":%d,\"threads\":%d,"
               "\"preset\":\"%s\",\"int8\":%d,\"int8_dispatch\":%d,\"shared_prefix\":%.2f,\"load_s\":%.3f,"
               "\"wall_s\":%.3f,\"output_tok_s\":%.2f,\"prefill_tok_s\":%.2f,\"decode_tok_s\":%.2f,"
               "\"ttft_p50_ms\":%.2f,\"ttft_p99_ms\":%.2f,\"tpot_p50_ms\":%.3f,\"tpot_p99_ms\":%.3f,"
               "\"cache_hit_ratio\":%.4f,\"dispatch_bytes\":%llu,\"dispatch_bytes_bf16\":%llu,"
               "\"combine_bytes\":%llu,\"preempted\":%llu,\"mtp_drafted\":%llu,\"mtp_accepted\":%llu,"
               "\"mem_weight_bytes\":%llu,\"mem_kv_bytes\":%llu,\"mem_scratch_bytes\":%llu,\"mem_total_bytes\":%llu,"
               "\"tokens_decoded\":%llu,\"decode_seconds\":%.4f,\"decode_weight_bytes\":%llu,\"decode_steps_weight_gbs\":%.2f,"
               "\"eplb_runs\":%llu,\"expert_load_max_over_mean\":%.3f,\"eplb_load_before\":%.3f,\"eplb_load_after\":%.3f,",
               o->model, P, N, R, C, st.n_workers, o->preset ? o->preset : "default", o->int8,
               st.dispatch_bytes < st.dispatch_bytes_bf16,   /* INT8 dispatch was in effect: fewer bytes than bf16 */ o->shared_prefix, t_load, wall, out_tok_s,
               st.prefill_tok_per_s, st.decode_tok_per_s, st.ttft_p50_ms, st.ttft_p99_ms, st.tpot_p50_ms,
               st.tpot_p99_ms, st.cache_hit_ratio, (unsigned long long)st.dispatch_bytes,
               (unsigned long long)st.dispatch_bytes_bf16, (unsigned long long)st.combine_bytes,
               (unsigned long long)st.requests_preempted, (unsigned long long)st.mtp_drafted,
               (unsigned long long)st.mtp_accepted, (unsigned long long)st.mem_weight_bytes,
               (unsigned long long)st.mem_kv_bytes, (unsigned long long)st.mem_scratch_bytes,
               (unsigned long long)st.mem_total_bytes, (unsigned long long)st.tokens_decoded, st.decode_seconds,
               (unsigned long long)st.decode_weight_bytes,
               st.decode_seconds > 0 ? (double)st.decode_weight_bytes / st.decode_seconds / 1e9 : 0.0,
               (unsigned long long)st.eplb_runs, st.expert_load_max_over_mean, st.eplb_load_before, st.eplb_load_after);
        printf("\"time_shared\":%d,\"arrival_prompt\":%d,\"arrivals\":%d,\"arrival_tok_s\":%.2f,\"total_tok_s\":%.2f,"
               "\"itl_p50_ms\":%.3f,\"itl_p99_ms\":%.3f,\"req_tpot_p50_ms\":%.3f,\"req_tpot_p99_ms\":%.3f,"
               "\"decode_steps\":%llu,\"decode_steps_in_prefill\":%llu,\"cache_hits_pool\":%llu,\"cache_hits_disk\":%llu,"
               "\"cache_misses\":%llu,\"tokens_cached\":%llu,\"tokens_prefilled\":%llu,\"prefill_s\":%.4f,"
               "\"prefill_lent_s\":%.4f,\"prefill_lent_tasks\":%llu,\"arrival_ttft_mean_ms\":%.2f,\"arrival_ttft_max_ms\":%.2f,"
               "\"decode_alone_steps\":%llu,\"decode_alone_tok_s\":%.2f,\"decode_alone_weight_gbs\":%.2f,",
               o->time_shared, AP, out.n_arrived, arrival_tok_s, total_tok_s, out.itl50, out.itl99, out.tp50, out.tp99,
               (unsigned long long)st.decode_steps, (unsigned long long)st.decode_steps_in_prefill,
               (unsigned long long)st.cache_hits_pool, (unsigned long long)st.cache_hits_disk,
               (unsigned long long)st.cache_misses, (unsigned long long)st.tokens_cached,
               (unsigned long long)st.tokens_prefilled, st.prefill_seconds, st.prefill_lent_seconds,
               (unsigned long long)st.prefill_lent_tasks, out.arr_ttft_mean, out.arr_ttft_max,
               (unsigned long long)st.decode_alone_steps,
               st.decode_alone_seconds > 0 ? st.decode_alone_tokens / st.decode_alone_seconds : 0.0,
               st.decode_alone_seconds > 0 ? st.decode_alone_weight_bytes / st.decode_alone_seconds / 1e9 : 0.0);
        /* decode's roofline (cm384.h, cm384_stats): make bench puts the
           machine's limits to it */
        for (int a = 0; a < 2; a++) {
            printf("\"decode_roof_%s\":[", a ? "macs" : "bytes");
            for (int i = 0; i < CM384_ROOF_ROWS; i++)
                printf("%s%llu", i ? "," : "", (unsigned long long)(a ? st.decode_roof_macs[i] : st.decode_roof_bytes[i]));
            printf("],");
        }
        printf("\"decode_roof_core_flops\":%llu}\n", (unsigned long long)st.decode_roof_core_flops);
    } else if (!status && !o->slo) {
        printf("workload: %d requests x (%d prompt + %d generated) tokens, %d in flight, shared prefix %.0f%%, %d tenant%s\n",
               R, P, N, C, 100 * o->shared_prefix, T, T > 1 ? "s" : "");
        printf("wall %.2f s: %.1f generated tok/s overall; load %.2f s\n", wall, out_tok_s, t_load);
        if (AP > 0)
            printf("arrivals: %d prompts of %d tokens (%.1f prompt tok/s, TTFT mean %.1f ms, max %.1f ms) while decoding; "
                   "gaps between tokens p50 %.2f ms p99 %.2f ms; per-request TPOT p50 %.2f ms p99 %.2f ms; %.1f tok/s in all "
                   "(%s)\n", out.n_arrived, AP, arrival_tok_s, out.arr_ttft_mean, out.arr_ttft_max, out.itl50, out.itl99,
                   out.tp50, out.tp99, total_tok_s,
                   o->time_shared ? "time-shared loop" : "peers");
        if (print_report(e)) status = EXIT_RUNTIME;
        if (o->profile && print_profile(e)) status = EXIT_RUNTIME;
    }
    for (int i = 0; rq && i < R; i++) { free(rq[i].ids); free(rq[i].gaps); }
    free(prefix);
    free(arr);
    free(rq);
    if (e) cm384_engine_free(e);
    cm384_model_free(m);
    return status;
}

static int cmd_convert(const opts *o) {
    if (!o->out) { fprintf(stderr, "cm384 convert: -o FILE.gguf is required (cm384 help convert)\n"); return EXIT_USAGE; }
    cm384_model *m;
    if (load(o, &m)) return EXIT_RUNTIME;
    const char *type = o->type ? o->type : "bf16";
    int r = cm384_model_save_gguf(m, o->out, type);
    cm384_model_free(m);
    if (r) { fprintf(stderr, "cm384 convert: %s\n", cm384_last_error()); return r == CM384_E_INVALID ? EXIT_USAGE : EXIT_RUNTIME; }
    fprintf(stderr, "wrote %s (%s)\n", o->out, type);
    return 0;
}

static int cmd_info(const opts *o) {
    cm384_model *m;
    if (load(o, &m)) return EXIT_RUNTIME;
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
    if (argc < 2) { usage(stderr); return EXIT_USAGE; }
    const char *c = argv[1];
    if (!strcmp(c, "--version") || !strcmp(c, "version")) {
        if (argc > 2) { fprintf(stderr, "cm384: %s takes no arguments\n", c); return EXIT_USAGE; }
        printf("cm384 %s\n", cm384_version());
        return 0;
    }
    if (!strcmp(c, "help") || !strcmp(c, "-h") || !strcmp(c, "--help")) {
        if (argc == 2) { usage(stdout); return 0; }
        if (argc == 3 && !strcmp(argv[2], "project")) { char *hv[] = {argv[0], argv[2], "--help", NULL}; return cm384_cli_project(3, hv); }
        const command *h = find_command(argv[2]);
        if (!h || argc > 3) {
            fprintf(stderr, "cm384 help: %s \"%s\" (cm384 help lists them)\n", h ? "one command, got also" : "no command",
                    h ? argv[3] : argv[2]);
            return EXIT_USAGE;
        }
        command_help(h);
        return 0;
    }
    /* the projection and the ablation parse their own options (examples/cm384_project.c) */
    if (!strcmp(c, "project")) return cm384_cli_project(argc, argv);
    if (!strcmp(c, "bench") && cm384_cli_has(argc, argv, "--ablate")) return cm384_cli_ablate(argc, argv);
    const command *cmd = find_command(c);
    if (!cmd) {
        fprintf(stderr, "cm384: unknown command \"%s\"\n", c);
        usage(stderr);
        return EXIT_USAGE;
    }
    opts o;
    int r = parse_args(cmd, argc, argv, &o);
    if (r < 0) { command_help(cmd); return 0; }
    if (r) return r;
    return cmd->run(&o);
}

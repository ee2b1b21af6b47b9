/* fuzz_main.c -- every cm384 fuzz harness in one program, compiled once with
 * the library (the harnesses reach internals, as the tests do).
 *
 *   build/fuzz/fuzz_NAME [libFuzzer flags] [CORPUS_DIR|FILE ...]
 *   build/fuzz/cm384_fuzz -target=NAME ...     the same
 *   build/fuzz/cm384_fuzz -list                 the harnesses and their
 *                                              `make test` run counts
 *
 * Built with clang's libFuzzer (-fsanitize=fuzzer) when it is available;
 * otherwise CM384_FUZZ_STANDALONE gives a main() that replays the corpus and
 * then mutates it deterministically for -runs=N runs (-seed=S), so the same
 * harnesses still run in `make test`.  tests/fuzz/README.md explains how to
 * add a harness. */
#include "../../cm384.c"
#include "fuzz.h"

#include "fuzz_json.c"
#include "fuzz_config.c"
#include "fuzz_safetensors.c"
#include "fuzz_shard_index.c"
#include "fuzz_tokenizer.c"
#include "fuzz_tokenizer_config.c"
#include "fuzz_tokenize.c"
#include "fuzz_chat.c"
#include "fuzz_request.c"
#include "fuzz_kv_block.c"
#include "fuzz_gguf.c"

/* name, the harness, its one-time set-up (may be NULL), runs in `make test` */
static const struct fuzz_target {
    const char *name;
    int (*run)(const uint8_t *data, size_t size);
    void (*init)(void);
    long test_runs;
} fuzz_targets[] = {
    {"json", fuzz_json, NULL, 20000},
    {"config", fuzz_config, fuzz_config_init, 3000},
    {"safetensors", fuzz_safetensors, NULL, 20000},
    {"shard_index", fuzz_shard_index, fuzz_shard_index_init, 1000},
    {"tokenizer", fuzz_tokenizer, NULL, 1000},
    {"tokenizer_config", fuzz_tokenizer_config, fuzz_tokenizer_config_init, 1000},
    {"tokenize", fuzz_tokenize, fuzz_tokenize_init, 5000},
    {"chat", fuzz_chat, fuzz_chat_init, 5000},
    {"request", fuzz_request, fuzz_request_init, 1000},
    {"kv_block", fuzz_kv_block, NULL, 20000},
    {"gguf", fuzz_gguf, NULL, 1000},
};
#define N_FUZZ_TARGETS (int)(sizeof fuzz_targets / sizeof fuzz_targets[0])

static const struct fuzz_target *fuzz_current;

static const struct fuzz_target *fuzz_find(const char *name) {
    for (int i = 0; i < N_FUZZ_TARGETS; i++)
        if (!strcmp(fuzz_targets[i].name, name)) return &fuzz_targets[i];
    return NULL;
}

static void fuzz_usage(void) {
    fprintf(stderr, "cm384_fuzz: name a harness: run it as fuzz_NAME (a link to cm384_fuzz) or pass -target=NAME\n"
                    "harnesses:");
    for (int i = 0; i < N_FUZZ_TARGETS; i++) fprintf(stderr, " %s", fuzz_targets[i].name);
    fprintf(stderr, "\n");
}

/* Picks the harness from the program's name (fuzz_NAME) or -target=NAME
 * (removed from argv before libFuzzer reads its flags), then sets it up. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *prog = strrchr((*argv)[0], '/');
    prog = prog ? prog + 1 : (*argv)[0];
    if (!strncmp(prog, "fuzz_", 5)) fuzz_current = fuzz_find(prog + 5);
    for (int i = 1; i < *argc; i++) {
        const char *a = (*argv)[i];
        if (!strcmp(a, "-list")) {
            for (int k = 0; k < N_FUZZ_TARGETS; k++) printf("%s %ld\n", fuzz_targets[k].name, fuzz_targets[k].test_runs);
            exit(0);
        }
        if (!strncmp(a, "-target=", 8)) {
            if (!(fuzz_current = fuzz_find(a + 8))) { fuzz_usage(); exit(2); }
            for (int k = i; k < *argc - 1; k++) (*argv)[k] = (*argv)[k + 1];
            (*argc)--;
            i--;
        }
    }
    if (!fuzz_current) { fuzz_usage(); exit(2); }
    fuzz_target_name = fuzz_current->name;
    if (fuzz_current->init) fuzz_current->init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    return fuzz_current->run(data, size);
}

#ifdef CM384_FUZZ_STANDALONE
/* ---- without libFuzzer: replay, then deterministic mutation ---- */

typedef struct { uint8_t *data; size_t size; } fuzz_unit;

static fuzz_unit *units;
static int n_units, cap_units;

static void add_unit(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = malloc((size_t)(n > 0 ? n : 1));
    if (!d || (n > 0 && fread(d, 1, (size_t)n, f) != (size_t)n)) { perror(path); exit(2); }
    fclose(f);
    if (n_units == cap_units) {
        cap_units = cap_units ? 2 * cap_units : 64;
        units = realloc(units, (size_t)cap_units * sizeof *units);
        if (!units) abort();
    }
    units[n_units++] = (fuzz_unit){d, (size_t)n};
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void add_path(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) { perror(path); exit(2); }
    if (!S_ISDIR(st.st_mode)) { add_unit(path); return; }
    DIR *d = opendir(path);
    if (!d) { perror(path); exit(2); }
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        if (n == cap) { cap = cap ? 2 * cap : 64; names = realloc(names, (size_t)cap * sizeof *names); if (!names) abort(); }
        names[n] = malloc(strlen(path) + strlen(de->d_name) + 2);
        sprintf(names[n++], "%s/%s", path, de->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_names);     /* the same order on every machine */
    for (int i = 0; i < n; i++) { add_unit(names[i]); free(names[i]); }
    free(names);
}

static uint64_t mut_state;
static uint64_t mut_next(void) {
    mut_state += 0x9e3779b97f4a7c15ull;
    uint64_t z = mut_state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static size_t mut_below(size_t n) { return n ? (size_t)(mut_next() % n) : 0; }

/* A few random edits of a corpus unit: the kinds of change that break
 * parsers (bytes flipped, structure characters, numbers, cut and repeated
 * spans, a splice from another unit). */
static size_t mutate(uint8_t *buf, size_t n, size_t cap) {
    static const char *tokens[] = {"\"", "{", "}", "[", "]", ",", ":", "\\", "\\u", "0", "-1", "1e309", "NaN",
                                   "4294967296", "-2147483649", "null", "true", "\xff", "\xc3", "\xe2\x82", "\0"};
    int edits = 1 + (int)mut_below(4);
    for (int e = 0; e < edits; e++) {
        switch (mut_below(7)) {
        case 0: if (n) buf[mut_below(n)] ^= (uint8_t)(1u << mut_below(8)); break;
        case 1: if (n) buf[mut_below(n)] = (uint8_t)mut_next(); break;
        case 2: {                                                    /* insert a token */
            const char *t = tokens[mut_below(sizeof tokens / sizeof tokens[0])];
            size_t tl = t[0] ? strlen(t) : 1, at = mut_below(n + 1);
            if (n + tl > cap) break;
            memmove(buf + at + tl, buf + at, n - at);
            memcpy(buf + at, t, tl);
            n += tl;
            break;
        }
        case 3: {                                                    /* delete a span */
            if (!n) break;
            size_t at = mut_below(n), len = 1 + mut_below(n - at < 64 ? n - at : 64);
            memmove(buf + at, buf + at + len, n - at - len);
            n -= len;
            break;
        }
        case 4: {                                                    /* repeat a span */
            if (!n) break;
            size_t at = mut_below(n), len = 1 + mut_below(n - at < 64 ? n - at : 64);
            if (n + len > cap) break;
            memmove(buf + at + len, buf + at, n - at);
            n += len;
            break;
        }
        case 5: {                                                    /* splice another unit */
            const fuzz_unit *o = &units[mut_below((size_t)n_units)];
            if (!o->size) break;
            size_t from = mut_below(o->size), len = 1 + mut_below(o->size - from < 256 ? o->size - from : 256);
            size_t at = mut_below(n + 1);
            if (at + len > cap) break;
            memcpy(buf + at, o->data + from, len);
            if (at + len > n) n = at + len;
            break;
        }
        default: n = mut_below(n + 1); break;                         /* truncate */
        }
    }
    return n;
}

int main(int argc, char **argv) {
    LLVMFuzzerInitialize(&argc, &argv);
    long runs = -1;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "-runs=", 6)) runs = atol(argv[i] + 6);
        else if (!strncmp(argv[i], "-seed=", 6)) seed = strtoull(argv[i] + 6, NULL, 10);
        else if (argv[i][0] == '-') continue;                        /* other libFuzzer flags */
        else add_path(argv[i]);
    }
    mut_state = seed;
    size_t max = 64;
    for (int i = 0; i < n_units; i++) {
        fuzz_current->run(units[i].data, units[i].size);
        if (units[i].size > max) max = units[i].size;
    }
    long done = n_units;
    if (n_units && runs > done) {
        size_t cap = 2 * max;
        uint8_t *buf = malloc(cap);
        if (!buf) abort();
        for (; done < runs; done++) {
            const fuzz_unit *u = &units[mut_below((size_t)n_units)];
            memcpy(buf, u->data, u->size);
            size_t n = mutate(buf, u->size, cap);
            /* an exact-size copy, so that reading past the end is caught */
            uint8_t *in = malloc(n ? n : 1);
            if (!in) abort();
            memcpy(in, buf, n);
            fuzz_current->run(in, n);
            free(in);
        }
        free(buf);
    }
    printf("fuzz %s: %ld runs (%d corpus units replayed, then mutated; standalone build, no coverage feedback)\n",
           fuzz_current->name, done, n_units);
    return 0;
}
#endif

/* fuzz_gguf.c -- libFuzzer harness for the GGUF loader: any bytes as one
 * .gguf file, loaded as a model (header, metadata, tensor infos, deepseek2
 * hyper-parameters, tensor binding, the tokenizer from tokenizer.ggml.*).
 * When it loads, it is used: a tokenizer-only file tokenizes and decodes a
 * text; a model also runs a 3-token forward pass on one device, which reads
 * every bound weight.
 * Must hold: a bad file fails with FORMAT, UNSUPPORTED or NOMEM, leaves no
 * model, and the message names the file; an accepted file's tensors lie
 * inside it (and ASan sees any read outside the mapping: the forward pass
 * touches every row); tokenizing gives ids below the vocab size.
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -pthread tests/fuzz/fuzz_gguf.c -lm
 *   ./a.out -max_total_time=600 tests/fuzz/corpus/gguf
 *
 * With -DFUZZ_REPLAY it is a plain program: it runs the files named on its
 * command line, then (-runs=N) N deterministic mutations of them -- byte
 * overwrites, cuts -- so `make test` exercises it under ASan+UBSan without
 * libFuzzer.  Seeds: tests/fuzz/make_gguf_seeds.py. */
#include "../../cm384.c"

#include <stdio.h>

#define FUZZ_CHECK(cond, ...)                                                         \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "fuzz gguf: invariant failed at %s:%d: %s\n  ", __FILE__, \
                    __LINE__, #cond);                                                 \
            fprintf(stderr, __VA_ARGS__);                                             \
            fprintf(stderr, "\n  last error: %s\n", cm384_last_error());             \
            abort();                                                                  \
        }                                                                             \
    } while (0)

static int fuzz_gguf_status_in(int st, const int *ok, int n) {
    for (int i = 0; i < n; i++) if (st == ok[i]) return 1;
    return 0;
}
#define FUZZ_CHECK_FAILED(st, ...)                                                      \
    do {                                                                                \
        static const int ok_[] = {__VA_ARGS__};                                          \
        FUZZ_CHECK((st) < 0 && fuzz_gguf_status_in((st), ok_, (int)(sizeof ok_ / sizeof ok_[0])), \
                   "unexpected status %s", cm384_strerror(st));                          \
        FUZZ_CHECK(cm384_last_error()[0] != 0, "failed with %s but no message", cm384_strerror(st)); \
    } while (0)

/* A scratch file for the input (in /dev/shm when there is one). */
static const char *fuzz_gguf_path(void) {
    static char path[256];
    if (!path[0]) {
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(path, sizeof path, "%s/cm384-fuzz-%d.gguf", base, (int)getpid());
    }
    return path;
}

static void fuzz_gguf_use(cm384_model *m) {
    int V = cm384_vocab_size(m);
    int32_t ids[64];
    int n = cm384_tokenize(m, "ab c\n", 5, ids, 64, CM384_TOK_ADD_BOS);
    if (n >= 0)
        for (int i = 0; i < n && i < 64; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < V, "id %d of %d", ids[i], V);
    char text[256];
    if (n > 0) FUZZ_CHECK(cm384_detokenize(m, ids, n < 64 ? n : 64, text, sizeof text) >= 0, "detokenize of its ids");
    if (m->tokenizer_only) return;
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "single"; c.n_devices = 1; c.n_workers = 1; c.max_ctx = 8; c.max_batch = 1;
    c.kv_pool_bytes = 1 << 20; c.int8_dispatch = 0;
    cm384_engine *e;
    int r = cm384_engine_create(m, &c, &e);
    if (r) { FUZZ_CHECK_FAILED(r, CM384_E_NOMEM, CM384_E_INVALID, CM384_E_CAPACITY); return; }
    int32_t in[3] = {0, V > 1 ? 1 : 0, V - 1};
    float *lg = malloc(sizeof(float) * 3 * (size_t)V);
    if (!lg) abort();
    r = cm384_eval(e, in, 3, lg, NULL);
    if (r) FUZZ_CHECK_FAILED(r, CM384_E_NOMEM, CM384_E_CAPACITY, CM384_E_INVALID);
    free(lg);
    cm384_engine_free(e);
}

static int fuzz_gguf(const uint8_t *data, size_t size) {
    const char *path = fuzz_gguf_path();
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f)) { perror(path); abort(); }
    cm384_model *m = (cm384_model *)1;
    int r = cm384_model_load(path, NULL, &m);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(m == NULL, "a failed load left a model");
        FUZZ_CHECK(strstr(cm384_last_error(), path) != NULL, "the message does not name the file");
        return 0;
    }
    /* every tensor of an accepted file lies inside it */
    const uint8_t *base = m->files[0].data, *end = base + m->files[0].size;
    for (int i = 0; i < m->tensors.cap; i++) {
        const tensor_info *t = &m->tensors.items[i];
        if (!t->name || t->dtype < 0) continue;
        FUZZ_CHECK(t->data >= base && t->data <= end && t->nbytes <= (size_t)(end - t->data),
                   "tensor \"%s\" lies outside the file", t->name);
    }
    fuzz_gguf_use(m);
    cm384_model_free(m);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_gguf(data, size); }

#ifdef FUZZ_REPLAY
int main(int argc, char **argv) {
    long runs = 0;
    uint64_t st = 0x9e3779b97f4a7c15ull;
    int files = 0;
    for (int a = 1; a < argc; a++) {
        if (!strncmp(argv[a], "-runs=", 6)) { runs = atol(argv[a] + 6); continue; }
        FILE *f = fopen(argv[a], "rb");
        if (!f) { perror(argv[a]); return 1; }
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *d = malloc((size_t)n + 1), *m = malloc((size_t)n + 1);
        if (!d || !m || fread(d, 1, (size_t)n, f) != (size_t)n) { perror(argv[a]); return 1; }
        fclose(f);
        fuzz_gguf(d, (size_t)n);
        files++;
        for (long run = 0; run < runs; run++) {
            memcpy(m, d, (size_t)n);
            size_t len = (size_t)n;
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            int k = 1 + (int)(st % 8);
            for (int j = 0; j < k; j++) {   /* mostly the header and metadata: where the parser is */
                st ^= st << 13; st ^= st >> 7; st ^= st << 17;
                size_t span = (st >> 40) % 4 && n > 4096 ? 4096 : (size_t)n;
                size_t at = (size_t)(st % span);
                uint8_t v = (st >> 20) % 4 == 0 ? 0xff : (st >> 20) % 4 == 1 ? 0 : (uint8_t)(st >> 32);
                m[at] = v;
            }
            if ((st >> 50) % 6 == 0) len = (size_t)((st >> 8) % (uint64_t)n);
            fuzz_gguf(m, len);
        }
        free(d);
        free(m);
    }
    unlink(fuzz_gguf_path());
    printf("fuzz_gguf: %d files, %ld mutations each: 1 passed, 0 failed\n", files, runs);
    return 0;
}
#endif

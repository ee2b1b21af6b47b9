/* fuzz_server.c -- libFuzzer harness for the server's request parsing
 * (examples/server.c): the HTTP head, chunked bodies, the JSON parser and the
 * completion fields read from it.  The first byte picks the parser; the rest
 * is its input.  Every input must be answered (accepted or refused) without a
 * crash, and every byte the parsers allocate must be freed again.
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_server.c build/libcm384.a -lm -lpthread
 *   ./a.out -max_total_time=60 tests/fuzz/server_corpus
 *
 * Built with -DFUZZ_REPLAY it is a plain program that runs the files named on
 * its command line (no libFuzzer needed). */
#define SERVER_NO_MAIN
#include "../../examples/server.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int mode = data[0] % 4;
    const char *in = (const char *)data + 1;
    size_t n = size - 1;
    if (mode == 0 || mode == 1) {
        /* HTTP: a head, then (mode 1) a chunked body after it */
        http_head h;
        const char *why = "";
        int r = http_parse_head(in, n, 4096, &h, &why);
        if (r < 0 && (r != -400 && r != -431 && r != -501 && r != -505)) __builtin_trap();
        if (r == 1 && (h.head_len > n || h.head_len > 4096)) __builtin_trap();
        if (mode == 1) {
            size_t off = r == 1 ? h.head_len : 0;
            char *copy = malloc(n - off + 1);
            if (!copy) return 0;
            memcpy(copy, in + off, n - off);
            size_t consumed = 0;
            long d = http_dechunk(copy, n - off, 1 << 16, &consumed);
            if (d >= 0 && ((size_t)d > n - off || consumed > n - off || (size_t)d > (1 << 16))) __builtin_trap();
            free(copy);
        }
    } else {
        /* JSON, then the fields of a chat (mode 2) or completion (mode 3) */
        jval doc;
        char err[256];
        if (json_parse_doc(in, n, &doc, err, sizeof err) == 0) {
            gen_params g;
            const char *param = NULL;
            if (gen_params_parse(&doc, mode == 2, &g, err, sizeof err, &param) == 0) {
                for (int i = 0; i < g.n_msgs; i++)
                    if (!g.msgs[i].role || (!g.msgs[i].content && g.msgs[i].n_tool_calls == 0)) __builtin_trap();
                if (mode == 3 && (!g.prompt || g.prompt_len == 0)) __builtin_trap();
            }
            gen_params_free(&g);
            jfree(&doc);
        }
    }
    if (atomic_load(&live_bytes) != 0) __builtin_trap();   /* everything allocated was freed */
    return 0;
}

#ifdef FUZZ_REPLAY
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) { perror(argv[i]); return 1; }
        static uint8_t buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        LLVMFuzzerTestOneInput(buf, n);
    }
    printf("fuzz_server: replayed %d inputs\n", argc - 1);
    return 0;
}
#endif

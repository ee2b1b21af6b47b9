/* main.c -- the cm384 test program: every test area in one translation
 * unit with the library, so `make test` compiles the library once per
 * configuration (plain, ASan+UBSan, TSan) instead of once per area.
 *
 *   build/cm384_tests AREA [args]      run one area (its own arguments follow)
 *   build/cm384_tests                  list the areas
 *
 * Each area prints "AREA: N passed, N failed" and exits non-zero on failure. */
#define CM384_TEST_ALL 1
#include "test_tokenizer.c"
#include "test_kernels.c"
#include "test_golden.c"
#include "test_loader.c"
#include "test_engine.c"
#include "test_alloc.c"
#include "test_model.c"
#include "test_api.c"
#include "test_trust.c"
#include "test_slo.c"
#include "test_eplb.c"
#include "test_progress.c"
#include "test_fuzzfix.c"
#include "test_gguf.c"
#include "test_project.c"
#include "test_peers.c"
#include "test_faults.c"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
} areas[] = {
    {"tokenizer", test_main_tokenizer},
    {"kernels", test_main_kernels},
    {"golden", test_main_golden},
    {"loader", test_main_loader},
    {"engine", test_main_engine},
    {"alloc", test_main_alloc},
    {"model", test_main_model},
    {"api", test_main_api},
    {"trust", test_main_trust},
    {"slo", test_main_slo},
    {"eplb", test_main_eplb},
    {"progress", test_main_progress},
    {"fuzzfix", test_main_fuzzfix},
    {"gguf", test_main_gguf},
    {"project", test_main_project},
    {"peers", test_main_peers},
    {"faults", test_main_faults},
};

int main(int argc, char **argv) {
    int n = (int)(sizeof areas / sizeof areas[0]);
    if (argc >= 2)
        for (int i = 0; i < n; i++)
            if (!strcmp(argv[1], areas[i].name)) {
                test_passed = test_failed = 0;
                return areas[i].run(argc - 1, argv + 1);
            }
    fprintf(stderr, "usage: %s AREA [args]\nareas:", argv[0]);
    for (int i = 0; i < n; i++) fprintf(stderr, " %s", areas[i].name);
    fprintf(stderr, "\n");
    return 2;
}

/* test.h -- the few helpers every cm384 test area shares.  Each area counts
 * checks and ends with "<name>: N passed, N failed".
 *
 * The areas (tests/test_*.c) are compiled together into one program per
 * configuration (tests/main.c: plain, ASan+UBSan, TSan), so the library is
 * compiled once per configuration; `build/cm384_tests AREA [args]` runs one.
 * A test file still compiles on its own (its TEST_MAIN is then main()).
 * To add an area: write tests/test_NAME.c with TEST_MAIN(NAME) { ... return
 * test_summary("NAME"); }, list it in tests/main.c, and run it from
 * tests/run.sh.  Keep file-scope names unique across areas (prefix them). */
#ifndef CM384_TEST_H
#define CM384_TEST_H
#include <stdio.h>

#if defined(__GNUC__)
#define TEST_UNUSED __attribute__((unused))
#else
#define TEST_UNUSED
#endif
#ifdef CM384_TEST_ALL
#define TEST_MAIN(name) int test_main_##name(int argc TEST_UNUSED, char **argv TEST_UNUSED)
#else
#define TEST_MAIN(name) int main(int argc TEST_UNUSED, char **argv TEST_UNUSED)
#endif

static int test_passed, test_failed;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) test_passed++;                                          \
        else {                                                            \
            test_failed++;                                                \
            printf("  FAIL %s:%d: ", __FILE__, __LINE__);                 \
            printf(__VA_ARGS__);                                          \
            printf("\n");                                                 \
        }                                                                 \
    } while (0)

static int test_summary(const char *name) {
    printf("%s: %d passed, %d failed\n", name, test_passed, test_failed);
    return test_failed ? 1 : 0;
}
#endif

/* test.h -- the few helpers every cm384 test program shares.  Each program
 * counts checks and ends with "<name>: N passed, N failed". */
#ifndef CM384_TEST_H
#define CM384_TEST_H
#include <stdio.h>

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

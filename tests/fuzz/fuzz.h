/* fuzz.h -- what every cm384 fuzz harness shares: invariant checks, a reader
 * that turns fuzz bytes into typed values, scratch files, fixture paths and
 * an independent UTF-8 validator.  See tests/fuzz/README.md. */
#ifndef CM384_FUZZ_H
#define CM384_FUZZ_H
#include <dirent.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A harness states what must hold; a violation is a finding, reported the
 * way a crash is (abort: libFuzzer saves the input). */
static const char *fuzz_target_name = "?";
#define FUZZ_CHECK(cond, ...)                                                         \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "fuzz %s: invariant failed at %s:%d: %s\n  ",             \
                    fuzz_target_name, __FILE__, __LINE__, #cond);                     \
            fprintf(stderr, __VA_ARGS__);                                             \
            fprintf(stderr, "\n  last error: %s\n", cm384_last_error());             \
            abort();                                                                  \
        }                                                                             \
    } while (0)

/* A status a failing call may return, and its message must say something. */
#define FUZZ_CHECK_FAILED(st, ...)                                                   \
    do {                                                                              \
        int st_ = (st);                                                               \
        FUZZ_CHECK(st_ < 0, "expected a failure status, got %d", st_);                \
        FUZZ_CHECK(fuzz_status_in(st_, __VA_ARGS__, 1), "unexpected status %s",       \
                   cm384_strerror(st_));                                              \
        FUZZ_CHECK(cm384_last_error()[0] != 0, "failed with %s but no message",       \
                   cm384_strerror(st_));                                              \
    } while (0)

/* fuzz_status_in(st, a, b, ..., 1): st is one of a, b, ... (list ends at 1) */
static int fuzz_status_in(int st, ...) {
    va_list ap;
    va_start(ap, st);
    int found = 0;
    for (int v = va_arg(ap, int); v != 1; v = va_arg(ap, int)) found |= v == st;
    va_end(ap);
    return found;
}

/* ---- fuzz bytes as typed values (reading past the end gives zeros) ---- */

typedef struct fz { const uint8_t *p; size_t n; } fz;

static uint8_t fz_u8(fz *f) {
    if (!f->n) return 0;
    f->n--;
    return *f->p++;
}
static uint32_t fz_u32(fz *f) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)fz_u8(f) << (8 * i);
    return v;
}
static uint64_t fz_u64(fz *f) { uint64_t lo = fz_u32(f); return lo | (uint64_t)fz_u32(f) << 32; }
static float fz_f32(fz *f) { uint32_t u = fz_u32(f); float x; memcpy(&x, &u, 4); return x; }
/* up to max bytes, as a malloc'd NUL-terminated string (stops at the end) */
static char *fz_str(fz *f, size_t max, size_t *len) {
    size_t n = fz_u8(f);
    if (n > max) n = max;
    if (n > f->n) n = f->n;
    char *s = malloc(n + 1);
    if (!s) abort();
    memcpy(s, f->p, n);
    s[n] = 0;
    f->p += n; f->n -= n;
    if (len) *len = n;
    return s;
}

/* ---- files ---- */

static char fuzz_dir[256];          /* this process's scratch directory */

static void fuzz_rm_dir(void) {
    if (!fuzz_dir[0]) return;
    DIR *d = opendir(fuzz_dir);
    if (d) {
        struct dirent *de;
        char p[512];
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
                snprintf(p, sizeof p, "%s/%s", fuzz_dir, de->d_name);
                unlink(p);
            }
        closedir(d);
    }
    rmdir(fuzz_dir);
}

/* A fresh directory for this process (in /dev/shm when there is one: the
 * loaders read files, and the harnesses write one per run). */
static const char *fuzz_scratch(void) {
    if (fuzz_dir[0]) return fuzz_dir;
    struct stat st;
    const char *base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm"
                     : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s/cm384-fuzz-XXXXXX", base);
    if (!mkdtemp(fuzz_dir)) { perror(fuzz_dir); abort(); }
    atexit(fuzz_rm_dir);
    return fuzz_dir;
}

/* The path of name inside the scratch directory (a static buffer per slot). */
static const char *fuzz_path(const char *name) {
    static char buf[4][512];
    static int slot;
    char *p = buf[slot++ & 3];
    snprintf(p, 512, "%s/%s", fuzz_scratch(), name);
    return p;
}

static void fuzz_write(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f)) { perror(path); abort(); }
}

/* A fixture file's absolute path: $CM384_FIXTURES or tests/fixtures. */
static const char *fuzz_fixture(const char *rel) {
    static char buf[4][1024];
    static int slot;
    char *p = buf[slot++ & 3];
    const char *root = getenv("CM384_FIXTURES");
    char cwd[512];
    if (!root) root = "tests/fixtures";
    if (root[0] == '/') snprintf(p, 1024, "%s/%s", root, rel);
    else snprintf(p, 1024, "%s/%s/%s", getcwd(cwd, sizeof cwd) ? cwd : ".", root, rel);
    struct stat st;
    if (stat(p, &st) != 0) {
        fprintf(stderr, "fuzz %s: fixture %s not found (run from the repository root or set CM384_FIXTURES)\n",
                fuzz_target_name, p);
        exit(2);
    }
    return p;
}

static void fuzz_link(const char *fixture_rel, const char *name) {
    const char *to = fuzz_path(name);
    unlink(to);
    if (symlink(fuzz_fixture(fixture_rel), to) != 0) { perror(to); abort(); }
}

/* ---- UTF-8, checked independently of the library's decoder ---- */

static int fuzz_utf8_valid(const char *s, size_t n) {
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint8_t c = p[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { k = 2; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { k = 3; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { k = 4; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (i + k > n) return 0;
        for (size_t j = 1; j < k; j++) {
            if ((p[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (p[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
        i += k;
    }
    return 1;
}

#endif

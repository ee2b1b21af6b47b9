/* cm384.c -- the engine, one translation unit.  See cm384.h for the API.
 *
 * Read it top to bottom: the sections come in the order a request meets them.
 *
 *    1. Errors and small utilities
 *    2. JSON
 *    3. Tokenizer and chat format
 *    4. Checkpoint loading (config.json, safetensors)
 *    5. Model math: norms, RoPE, MLA, router, experts, MTP
 *    6. ...
 *
 * The tensor kernels live in ggml_like/ and are included here, so that
 * `cc -c cm384.c` builds the whole library.
 */
#ifndef CM384_C_INCLUDED      /* the test program includes it from several test files */
#define CM384_C_INCLUDED
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "cm384.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

/* The kernels (ggml_like/) are part of this translation unit, so that
 * `cc -c cm384.c` builds the whole library; the Makefile compiles them as
 * a second object beside this one instead (CM384_KERNELS_APART), so that
 * the two halves build on two cores at once. */
#ifndef CM384_KERNELS_APART
#include "ggml_like/ggml_like.c"
#else
#include <stdatomic.h>
#include "ggml_like/ggml_like.h"
#endif

/* ======================================================================== */
/* 1. Errors and small utilities                                            */
/* ======================================================================== */
/* Every failing internal function records a message with fail() and returns
 * the status; the public entry point passes the status up unchanged.  The
 * message lives in a thread-local buffer, like dlerror(): the only state the
 * library keeps outside its objects. */

static _Thread_local char last_error_msg[1024];

static int fail(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static int fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error_msg, sizeof last_error_msg, fmt, ap);
    va_end(ap);
    return status;
}

const char *cm384_last_error(void) { return last_error_msg; }

const char *cm384_version(void) { return "0.1.0"; }

const char *cm384_strerror(int status) {
    switch (status) {
    case CM384_OK:            return "CM384_OK: success";
    case CM384_E_INVALID:     return "CM384_E_INVALID: invalid argument";
    case CM384_E_NOMEM:       return "CM384_E_NOMEM: out of memory";
    case CM384_E_IO:          return "CM384_E_IO: cannot open or read a file";
    case CM384_E_FORMAT:      return "CM384_E_FORMAT: malformed file";
    case CM384_E_UNSUPPORTED: return "CM384_E_UNSUPPORTED: not supported";
    case CM384_E_CAPACITY:    return "CM384_E_CAPACITY: does not fit";
    case CM384_E_CANCELLED:   return "CM384_E_CANCELLED: cancelled";
    case CM384_E_MISUSE:      return "CM384_E_MISUSE: call not allowed in this state";
    case CM384_E_INTERNAL:    return "CM384_E_INTERNAL: internal error";
    case CM384_E_NOT_FOUND:   return "CM384_E_NOT_FOUND: no such request";
    case CM384_E_TIMEOUT:     return "CM384_E_TIMEOUT: timed out";
    case CM384_E_DEVICE:      return "CM384_E_DEVICE: no device of a needed role survives";
    default:                  return "unknown status";
    }
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Arena: many small allocations freed together (JSON trees, tokenizer
 * strings, tensor tables).  Chunks are chained; nothing is ever moved. */
typedef struct arena_chunk { struct arena_chunk *next; size_t used, cap; } arena_chunk;
typedef struct { arena_chunk *head; size_t total; } arena;

/* Bytes per chunk.  The fuzz build sets 0: every allocation is then a chunk
 * of its own, exactly its size, so AddressSanitizer sees an overrun of any
 * one JSON node or string (and no megabyte is mapped per small parse). */
#ifndef CM384_ARENA_CHUNK
#define CM384_ARENA_CHUNK (1u << 20)
#endif

static void *arena_alloc(arena *a, size_t n) {
#if CM384_ARENA_CHUNK
    n = (n + 15) & ~(size_t)15;
#endif
    arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > CM384_ARENA_CHUNK ? n : CM384_ARENA_CHUNK;
        c = malloc(((sizeof(arena_chunk) + 15) & ~(size_t)15) + cap);
        if (!c) return NULL;
        c->next = a->head; c->used = 0; c->cap = cap;
        a->head = c;
    }
    /* chunk payload starts 16-byte aligned after the header */
    char *base = (char *)c + ((sizeof(arena_chunk) + 15) & ~(size_t)15);
    void *p = base + c->used;
    c->used += n;
    a->total += n;
    return p;
}

static char *arena_strndup(arena *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    if (p) { memcpy(p, s, n); p[n] = 0; }
    return p;
}

static void arena_free(arena *a) {
    arena_chunk *c = a->head;
    while (c) { arena_chunk *n = c->next; free(c); c = n; }
    a->head = NULL; a->total = 0;
}

/* AddressSanitizer builds keep big buffers apart, so overreads show. */
#if defined(__SANITIZE_ADDRESS__)
#define CM384_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CM384_ASAN 1
#endif
#endif
#ifndef CM384_ASAN
#define CM384_ASAN 0
#endif

/* Asks the OS for transparent huge pages on a big, long-lived buffer (Linux
 * with THP in "madvise" mode, the common default): one first-touch fault
 * and one TLB entry per 2 MB instead of per 4 KB, which the token path pays
 * when it first sweeps the pool's scratch and KV blocks.  Advice only. */
static void advise_huge(void *p, size_t n) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t H = (uintptr_t)2 << 20;
    uintptr_t a = ((uintptr_t)p + H - 1) & ~(H - 1), b = ((uintptr_t)p + n) & ~(H - 1);
    if (b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
#else
    (void)p; (void)n;
#endif
}

/* Faults in every page of [p, p + n) now, writable (config.prefault):
 * Linux's MADV_POPULATE_WRITE where the kernel has it (5.14+), else a
 * write to each page, which the engine may make because nothing in the
 * pool is read before it is written. */
static void prefault_pages(void *p, size_t n) {
    if (!n) return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
#if defined(MADV_POPULATE_WRITE)
    uintptr_t a = (uintptr_t)p & ~(pg - 1), b = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    if (madvise((void *)a, b - a, MADV_POPULATE_WRITE) == 0) return;
#endif
    volatile uint8_t *v = p;
    for (size_t i = 0; i < n; i += pg) v[i] = 0;
    v[n - 1] = 0;
}

/* Maps every page of [p, p + n) now, for reading (config.prefault on the
 * token embedding): Linux's MADV_POPULATE_READ where the kernel has it,
 * else a read of each page.  A row looked up for the first time otherwise
 * faults in its page from the file's mapping (V2-Lite-4 INT8, 4 KB rows:
 * 55 us a new token against 1.9 us a repeated one; the stage that looks it
 * up, 0.082 -> 0.043 ms a decode step). */
static void prefault_read(const void *p, size_t n) {
    if (!p || !n) return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
#if defined(MADV_POPULATE_READ)
    uintptr_t a = (uintptr_t)p & ~(pg - 1), b = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    if (madvise((void *)a, b - a, MADV_POPULATE_READ) == 0) return;
#endif
    const volatile uint8_t *v = p;
    uint8_t sink = 0;
    for (size_t i = 0; i < n; i += pg) sink ^= v[i];
    (void)sink;
}

/* n bytes starting on a 2 MB boundary, advised for huge pages, for weights
 * that decode streams every token (one TLB entry per 2 MB instead of per
 * 4 KB).  Under 2 MB, or in an AddressSanitizer build, a plain malloc.
 * *raw gets what to free; NULL when out of memory. */
static void *huge_alloc(size_t n, void **raw) {
    const size_t huge = (size_t)2 << 20, pad = n >= huge && !CM384_ASAN ? huge : 0;
    uint8_t *p = malloc(n + pad);
    *raw = p;
    if (!p || !pad) return p;
    p = (uint8_t *)(((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1));
    advise_huge(p, n);
    return p;
}

/* Growable byte buffer (strings built at load time, never on the token path). */
typedef struct { char *p; size_t n, cap; int oom; } strbuf;

static void sb_putn(strbuf *b, const char *s, size_t n);
static void sb_puts(strbuf *b, const char *s);

static void sb_putn(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(strbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

/* snprintf-convention copy of n bytes: returns n, writes at most cap-1 + NUL. */
static int copy_out(const char *src, size_t n, char *out, size_t cap) {
    if (out && cap > 0) {
        size_t k = n < cap - 1 ? n : cap - 1;
        memcpy(out, src, k);
        out[k] = 0;
    }
    return n > INT_MAX ? INT_MAX : (int)n;
}

/* A file mapped read-only at a 2 MB boundary (file offset 0 there, so the
 * page cache's 2 MB folios line up with whole page-table entries) and
 * advised for huge pages: pages the mapping faults in from disk then come
 * as 2 MB folios mapped whole, one TLB entry per 2 MB of the weights that
 * decode streams.  Left to itself the kernel reads them as smaller folios
 * mapped by 4 KB entries.  (V2-Lite-4 bf16, 1 stream, 200 tokens, from a
 * cold page cache: 20.6-30.1 -> 32.7-39.1 tok/s over 4-5 runs each; warm
 * runs after it 41-46 against 30-32 after a plain mapping's read: make
 * bench section 3d.)  Elsewhere, or if the reservation fails, a plain
 * mapping.  MAP_FAILED on failure. */
static void *map_file_huge(int fd, size_t n) {
#if defined(MADV_HUGEPAGE) && defined(MAP_ANONYMOUS) && defined(MAP_FIXED)
    const size_t H = (size_t)2 << 20;
    if (n >= H && n <= SIZE_MAX - H) {
        uint8_t *r = mmap(NULL, n + H, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r != MAP_FAILED) {
            uint8_t *a = (uint8_t *)(((uintptr_t)r + H - 1) & ~(uintptr_t)(H - 1));
            void *p = mmap(a, n, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);   /* replaces that part of the reservation */
            if (p == MAP_FAILED) {
                munmap(r, n + H);
                return mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
            }
            if (a > r) munmap(r, (size_t)(a - r));                 /* the reservation's slack, both sides */
            size_t tail = (size_t)(r + n + H - (a + n));
            if (tail) munmap(a + n, tail);
            (void)madvise(p, n, MADV_HUGEPAGE);
            return p;
        }
    }
#endif
    return mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
}

/* A whole file, memory-mapped read-only (or read into memory). */
typedef struct { const uint8_t *data; size_t size; int mapped; void *raw; } file_map;   /* raw: what to free */

static int file_map_open(file_map *f, const char *path, int use_mmap) {
    memset(f, 0, sizeof *f);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return fail(CM384_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return fail(CM384_E_IO, "%s: cannot stat: %s", path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return fail(CM384_E_IO, "%s: not a regular file", path);
    }
    f->size = (size_t)st.st_size;
    if (f->size == 0) { close(fd); f->data = (const uint8_t *)""; return CM384_OK; }
    if (use_mmap) {
        void *p = map_file_huge(fd, f->size);
        close(fd);
        if (p == MAP_FAILED) return fail(CM384_E_NOMEM, "%s: mmap of %zu bytes failed: %s",
                                         path, f->size, strerror(errno));
        f->data = p; f->mapped = 1;
        return CM384_OK;
    }
    uint8_t *buf = huge_alloc(f->size, &f->raw);   /* streamed as the INT8 copies are */
    if (!buf) { close(fd); return fail(CM384_E_NOMEM, "%s: cannot allocate %zu bytes", path, f->size); }
    size_t got = 0;
    while (got < f->size) {
        ssize_t r = read(fd, buf + got, f->size - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            free(f->raw); f->raw = NULL; close(fd);
            return fail(CM384_E_IO, "%s: read failed at byte %zu", path, got);
        }
        got += (size_t)r;
    }
    close(fd);
    f->data = buf;
    return CM384_OK;
}

static void file_map_close(file_map *f) {
    if (f->size == 0) { memset(f, 0, sizeof *f); return; }
    if (f->mapped) munmap((void *)f->data, f->size);
    else free(f->raw);
    memset(f, 0, sizeof *f);
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (k > 0 && p[k - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* ======================================================================== */
/* 2. JSON                                                                  */
/* ======================================================================== */
/* A small, strict, bounds-checked JSON reader: the whole text is parsed into
 * a tree in an arena.  Children of an array or object are stored contiguously
 * (obj members carry their key).  Strings are unescaped to UTF-8 and
 * NUL-terminated (they may also contain NUL: use len). */

enum { JSON_NULL, JSON_FALSE, JSON_TRUE, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT };

typedef struct json {
    int          type;
    int          len;      /* string: bytes; array/object: children        */
    const char  *key;      /* member name inside an object, else NULL      */
    int          key_len;
    double       num;
    const char  *str;
    struct json *kids;
} json;

typedef struct {
    const char *p, *end, *start;
    arena      *a;
    json       *stack;      /* children being collected, all levels        */
    size_t      sp, cap;
    char        err[160];
    int         depth;
} json_parser;

static int json_err(json_parser *ps, const char *what) {
    if (!ps->err[0]) {
        /* line/column make messages about hand-edited configs useful */
        int line = 1, col = 1;
        for (const char *q = ps->start; q < ps->p && q < ps->end; q++) {
            if (*q == '\n') { line++; col = 1; } else col++;
        }
        snprintf(ps->err, sizeof ps->err, "%s at line %d column %d (byte %ld)",
                 what, line, col, (long)(ps->p - ps->start));
    }
    return -1;
}

static void json_ws(json_parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int utf8_put(char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 63));
        o[2] = (char)(0x80 | (cp & 63)); return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 63));
    o[2] = (char)(0x80 | ((cp >> 6) & 63)); o[3] = (char)(0x80 | (cp & 63)); return 4;
}

/* Parses a string at ps->p (which points at the opening quote). */
static int json_string(json_parser *ps, const char **out, int *out_len) {
    ps->p++; /* opening quote */
    const char *s = ps->p;
    size_t plain = 0;
    int has_escape = 0;
    while (s < ps->end && *s != '"') {
        if ((unsigned char)*s < 0x20) { ps->p = s; return json_err(ps, "control character in string"); }
        if (*s == '\\') { has_escape = 1; s++; if (s >= ps->end) break; }
        s++; plain++;
    }
    if (s >= ps->end) { ps->p = s; return json_err(ps, "unterminated string"); }
    size_t raw_len = (size_t)(s - ps->p);
    if (raw_len > INT_MAX / 2) return json_err(ps, "string too long");
    if (!has_escape) {
        char *o = arena_strndup(ps->a, ps->p, raw_len);
        if (!o) return json_err(ps, "out of memory");
        *out = o; *out_len = (int)raw_len;
        ps->p = s + 1;
        return 0;
    }
    char *o = arena_alloc(ps->a, raw_len + 1);   /* unescaped never longer */
    if (!o) return json_err(ps, "out of memory");
    size_t k = 0;
    const char *q = ps->p;
    while (q < s) {
        if (*q != '\\') { o[k++] = *q++; continue; }
        q++;
        char c = *q++;
        switch (c) {
        case '"': o[k++] = '"'; break;
        case '\\': o[k++] = '\\'; break;
        case '/': o[k++] = '/'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'n': o[k++] = '\n'; break;
        case 'r': o[k++] = '\r'; break;
        case 't': o[k++] = '\t'; break;
        case 'u': {
            uint32_t cp = 0;
            if (s - q < 4) { ps->p = q; return json_err(ps, "short \\u escape"); }
            for (int i = 0; i < 4; i++) {
                int h = hexval(q[i]);
                if (h < 0) { ps->p = q; return json_err(ps, "bad \\u escape"); }
                cp = cp * 16 + (uint32_t)h;
            }
            q += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && s - q >= 6 && q[0] == '\\' && q[1] == 'u') {
                uint32_t lo = 0; int ok = 1;
                for (int i = 0; i < 4; i++) {
                    int h = hexval(q[2 + i]);
                    if (h < 0) { ok = 0; break; }
                    lo = lo * 16 + (uint32_t)h;
                }
                if (ok && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    q += 6;
                }
            }
            if (cp >= 0xD800 && cp < 0xE000) cp = 0xFFFD; /* lone surrogate */
            k += (size_t)utf8_put(o + k, cp);
            break;
        }
        default: ps->p = q - 1; return json_err(ps, "bad escape");
        }
    }
    o[k] = 0;
    *out = o; *out_len = (int)k;
    ps->p = s + 1;
    (void)plain;
    return 0;
}

static int json_push(json_parser *ps, const json *v) {
    if (ps->sp == ps->cap) {
        size_t cap = ps->cap ? ps->cap * 2 : 1024;
        json *n = realloc(ps->stack, cap * sizeof(json));
        if (!n) return json_err(ps, "out of memory");
        ps->stack = n; ps->cap = cap;
    }
    ps->stack[ps->sp++] = *v;
    return 0;
}

static int json_value(json_parser *ps, json *v);

/* Collects the children pushed since `base` into one arena block. */
static int json_close(json_parser *ps, json *v, size_t base) {
    size_t n = ps->sp - base;
    if (n > INT_MAX) return json_err(ps, "too many elements");
    v->len = (int)n;
    v->kids = NULL;
    if (n) {
        v->kids = arena_alloc(ps->a, n * sizeof(json));
        if (!v->kids) return json_err(ps, "out of memory");
        memcpy(v->kids, ps->stack + base, n * sizeof(json));
    }
    ps->sp = base;
    return 0;
}

static int json_value(json_parser *ps, json *v) {
    memset(v, 0, sizeof *v);
    json_ws(ps);
    if (ps->p >= ps->end) return json_err(ps, "unexpected end of input");
    char c = *ps->p;
    if (c == '{' || c == '[') {
        if (++ps->depth > 200) return json_err(ps, "nesting too deep");
        int is_obj = c == '{';
        char close = is_obj ? '}' : ']';
        v->type = is_obj ? JSON_OBJECT : JSON_ARRAY;
        size_t base = ps->sp;
        ps->p++;
        json_ws(ps);
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            ps->depth--;
            return json_close(ps, v, base);
        }
        for (;;) {
            json kid;
            const char *key = NULL;
            int key_len = 0;
            json_ws(ps);
            if (is_obj) {
                if (ps->p >= ps->end || *ps->p != '"') return json_err(ps, "expected a member name");
                if (json_string(ps, &key, &key_len)) return -1;
                json_ws(ps);
                if (ps->p >= ps->end || *ps->p != ':') return json_err(ps, "expected ':'");
                ps->p++;
            }
            if (json_value(ps, &kid)) return -1;
            kid.key = key;
            kid.key_len = key_len;
            if (json_push(ps, &kid)) return -1;
            json_ws(ps);
            if (ps->p >= ps->end) return json_err(ps, "unexpected end of input");
            if (*ps->p == ',') { ps->p++; continue; }
            if (*ps->p == close) { ps->p++; break; }
            return json_err(ps, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
        ps->depth--;
        return json_close(ps, v, base);
    }
    if (c == '"') {
        v->type = JSON_STRING;
        return json_string(ps, &v->str, &v->len);
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        const char *q = ps->p;
        if (*q == '-') q++;
        if (q >= ps->end || *q < '0' || *q > '9') return json_err(ps, "bad number");
        while (q < ps->end && ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' ||
                               *q == '+' || *q == '-'))
            q++;
        char tmp[64];
        size_t n = (size_t)(q - ps->p);
        if (n >= sizeof tmp) return json_err(ps, "number too long");
        memcpy(tmp, ps->p, n);
        tmp[n] = 0;
        char *endp;
        v->num = strtod(tmp, &endp);
        if (endp != tmp + n) return json_err(ps, "bad number");
        v->type = JSON_NUMBER;
        ps->p = q;
        return 0;
    }
    struct { const char *word; int type; } lits[] = {
        {"true", JSON_TRUE}, {"false", JSON_FALSE}, {"null", JSON_NULL},
        {"NaN", JSON_NUMBER}, {"Infinity", JSON_NUMBER}};
    for (size_t i = 0; i < sizeof lits / sizeof lits[0]; i++) {
        size_t n = strlen(lits[i].word);
        if ((size_t)(ps->end - ps->p) >= n && memcmp(ps->p, lits[i].word, n) == 0) {
            v->type = lits[i].type;
            if (lits[i].type == JSON_NUMBER) v->num = lits[i].word[0] == 'N' ? NAN : INFINITY;
            ps->p += n;
            return 0;
        }
    }
    return json_err(ps, "unexpected character");
}

/* Parses text[0..n) into *out (allocated in a).  On error returns
 * CM384_E_FORMAT with a message naming `what` (usually the file name). */
static int json_parse(const char *text, size_t n, arena *a, json *out, const char *what) {
    json_parser ps = {0};
    ps.p = ps.start = text;
    ps.end = text + n;
    ps.a = a;
    /* skip a UTF-8 byte-order mark */
    if (n >= 3 && (uint8_t)text[0] == 0xEF && (uint8_t)text[1] == 0xBB && (uint8_t)text[2] == 0xBF) ps.p += 3;
    int r = json_value(&ps, out);
    if (r == 0) {
        json_ws(&ps);
        if (ps.p != ps.end) r = json_err(&ps, "trailing characters after the JSON value");
    }
    free(ps.stack);
    if (r) return fail(CM384_E_FORMAT, "%s: bad JSON: %s", what, ps.err);
    return CM384_OK;
}

static const json *json_get(const json *obj, const char *key) {
    if (!obj || obj->type != JSON_OBJECT) return NULL;
    size_t kl = strlen(key);
    for (int i = 0; i < obj->len; i++)
        if ((size_t)obj->kids[i].key_len == kl && memcmp(obj->kids[i].key, key, kl) == 0)
            return &obj->kids[i];
    return NULL;
}

static int json_is_num(const json *v) { return v && v->type == JSON_NUMBER; }

static double json_num(const json *obj, const char *key, double dflt) {
    const json *v = json_get(obj, key);
    if (json_is_num(v)) return v->num;
    if (v && v->type == JSON_TRUE) return 1;
    if (v && v->type == JSON_FALSE) return 0;
    return dflt;
}

static const char *json_str(const json *obj, const char *key, const char *dflt) {
    const json *v = json_get(obj, key);
    return v && v->type == JSON_STRING ? v->str : dflt;
}

/* Reads and parses a whole JSON file. */
static int json_load_file(const char *path, arena *a, json *out) {
    file_map f;
    int r = file_map_open(&f, path, 0);
    if (r) return r;
    r = json_parse((const char *)f.data, f.size, a, out, path);
    file_map_close(&f);
    return r;
}

/* ======================================================================== */
/* 3. Tokenizer and chat format                                             */
/* ======================================================================== */
/* DeepSeek's tokenizers are Hugging Face byte-level BPE tokenizers described
 * by tokenizer.json.  Encoding reproduces what HF tokenizers (Rust) does, so
 * the ids match it exactly:
 *
 *   1. added tokens ("<｜User｜>", BOS, ...) are cut out of the raw text,
 *      leftmost-longest, before anything else looks at it;
 *   2. the pre-tokenizer splits each remaining stretch into pieces with the
 *      regexes of tokenizer.json, run by a small backtracking engine with
 *      Oniguruma's semantics over Unicode 16 categories (unicode_data.h);
 *   3. each piece's bytes become byte-level symbols (GPT-2's byte map);
 *   4. BPE merges adjacent symbols, lowest merge rank first.
 *
 * Decoding maps every token back to its bytes and reads them as UTF-8,
 * replacing invalid sequences as Rust's String::from_utf8_lossy does.
 * A tokenizer is immutable after tokenizer_load(): an encode call keeps its
 * scratch memory to itself, so any number of threads may share a tokenizer.
 *
 * Chat rendering reproduces DeepSeek-V3's Jinja chat template in C (no Jinja
 * engine); see chat_render() near the end of this section. */

#include "ggml_like/unicode_data.h"

/* ---- 3a. UTF-8 and Unicode properties ----------------------------------- */

#define UCAT_WS      0x20u        /* flag next to a category: White_Space        */
#define TOK_BAD_BYTE 0x110000u    /* an invalid UTF-8 byte b is read as this + b */

static int unicode_category(uint32_t cp) {
    if (cp < 256) return unicode_latin1[cp] & 31;
    if (cp > 0x10FFFF) return UCAT_Cn;
    /* the last run starting at or before cp */
    size_t lo = 0, hi = sizeof unicode_cat_runs / sizeof unicode_cat_runs[0];
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if ((unicode_cat_runs[mid] >> 5) <= cp) lo = mid; else hi = mid;
    }
    return (int)(unicode_cat_runs[lo] & 31);
}

static int unicode_is_space(uint32_t cp) {
    if (cp < 256) return (unicode_latin1[cp] & UCAT_WS) != 0;
    for (size_t i = 0; i < sizeof unicode_white_space / sizeof unicode_white_space[0]; i++)
        if (cp >= unicode_white_space[i][0] && cp <= unicode_white_space[i][1]) return 1;
    return 0;
}

/* Category and White_Space bit of a code point, as the regex engine sees it. */
static uint8_t unicode_props(uint32_t cp) {
    if (cp < 256) return unicode_latin1[cp];
    return (uint8_t)((unsigned)unicode_category(cp) | (unicode_is_space(cp) ? UCAT_WS : 0u));
}

#define UMASK(c) (1u << (c))
#define UMASK_L  (UMASK(UCAT_Lu) | UMASK(UCAT_Ll) | UMASK(UCAT_Lt) | UMASK(UCAT_Lm) | UMASK(UCAT_Lo))
#define UMASK_M  (UMASK(UCAT_Mn) | UMASK(UCAT_Mc) | UMASK(UCAT_Me))
#define UMASK_N  (UMASK(UCAT_Nd) | UMASK(UCAT_Nl) | UMASK(UCAT_No))
#define UMASK_P  (UMASK(UCAT_Pc) | UMASK(UCAT_Pd) | UMASK(UCAT_Ps) | UMASK(UCAT_Pe) | \
                  UMASK(UCAT_Pi) | UMASK(UCAT_Pf) | UMASK(UCAT_Po))
#define UMASK_S  (UMASK(UCAT_Sm) | UMASK(UCAT_Sc) | UMASK(UCAT_Sk) | UMASK(UCAT_So))
#define UMASK_Z  (UMASK(UCAT_Zs) | UMASK(UCAT_Zl) | UMASK(UCAT_Zp))
#define UMASK_C  (UMASK(UCAT_Cc) | UMASK(UCAT_Cf) | UMASK(UCAT_Cs) | UMASK(UCAT_Co) | UMASK(UCAT_Cn))
#define UMASK_ALL ((1u << UCAT_COUNT) - 1)
/* Oniguruma's word characters.  Its Unicode Word property is Alphabetic,
 * Mark, Decimal_Number and Connector_Punctuation (Alphabetic here: L, Nl and
 * the circled / squared Latin letters, the only Other_Alphabetic outside M).
 * That is what \w means inside [...].  A bare \w, \W, \b or \B reads a
 * ctype table instead, whose ISO-8859-1 part also counts the superscripts
 * and fractions ² ³ ¹ ¼ ½ ¾ as word characters (both measured against
 * tokenizers 0.23). */
#define UMASK_WORD (UMASK_L | UMASK_M | UMASK(UCAT_Nd) | UMASK(UCAT_Nl) | UMASK(UCAT_Pc))
static const uint32_t onig_latin1_word[8] = {
    0, 0x03FF0000, 0x87FFFFFE, 0x07FFFFFE,    /* 0-9 A-Z _ a-z                 */
    0, 0x762C0400, 0xFF7FFFFF, 0xFF7FFFFF,    /* ª ² ³ µ ¹ º ¼ ½ ¾ À-ÿ but × ÷ */
};

static int onig_is_word(uint32_t cp, uint8_t props, int ctype) {
    if (ctype && cp < 256) return (onig_latin1_word[cp >> 5] >> (cp & 31)) & 1;
    if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return 1;
    return (UMASK_WORD >> (props & 31)) & 1;
}

/* How many bytes a UTF-8 sequence starting with b needs (0: b starts none). */
static int utf8_need(uint8_t b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* May byte c follow the valid prefix s[0..np) (np >= 1)?  The second byte's
 * range excludes overlong forms, surrogates and code points past U+10FFFF. */
static int utf8_continues(const uint8_t *s, int np, uint8_t c) {
    uint8_t lo = 0x80, hi = 0xBF;
    if (np == 1) {
        if (s[0] == 0xE0) lo = 0xA0;
        if (s[0] == 0xED) hi = 0x9F;
        if (s[0] == 0xF0) lo = 0x90;
        if (s[0] == 0xF4) hi = 0x8F;
    }
    return c >= lo && c <= hi;
}

/* Decodes the UTF-8 sequence at s (n > 0 bytes left) into *cp and returns its
 * length.  A byte that does not start a complete, valid sequence is returned
 * alone as TOK_BAD_BYTE + byte, so that every input byte still reaches BPE. */
static int utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    int need = utf8_need(s[0]), k = 1;
    if (need == 1) { *cp = s[0]; return 1; }
    while (k < need && (size_t)k < n && utf8_continues(s, k, s[k])) k++;
    if (need == 0 || k < need) { *cp = TOK_BAD_BYTE + s[0]; return 1; }
    uint32_t v = s[0] & (0x7Fu >> need);
    for (int i = 1; i < need; i++) v = (v << 6) | (s[i] & 0x3Fu);
    *cp = v;
    return need;
}

/* Lossy UTF-8 output, byte by byte, with Rust's from_utf8_lossy rule: each
 * maximal prefix of a valid sequence that cannot be completed becomes one
 * U+FFFD, and the byte that broke it is read again as a new start.  Used by
 * whole-text decoding and by the streaming decoder (which keeps `pend`). */
typedef struct {
    char   *out;
    size_t  cap, n;        /* n counts every byte produced, written or not */
} tok_sink;

static void sink_put(tok_sink *k, const char *s, size_t len) {
    for (size_t i = 0; i < len; i++, k->n++)
        if (k->n < k->cap) k->out[k->n] = s[i];
}

static const char utf8_fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Feeds one byte; pend/np hold an incomplete sequence (at most 3 bytes). */
static void utf8_lossy_byte(tok_sink *k, uint8_t *pend, int *np, uint8_t c) {
    if (*np > 0) {
        if (utf8_continues(pend, *np, c)) {
            pend[(*np)++] = c;
            if (*np == utf8_need(pend[0])) { sink_put(k, (const char *)pend, (size_t)*np); *np = 0; }
            return;
        }
        sink_put(k, utf8_fffd, 3);   /* the prefix can never complete */
        *np = 0;
    }
    int need = utf8_need(c);
    if (need == 1) sink_put(k, (const char *)&c, 1);
    else if (need == 0) sink_put(k, utf8_fffd, 3);
    else { pend[0] = c; *np = 1; }
}

/* ---- 3b. Regular expressions -------------------------------------------- */
/* tokenizer.json's pre-tokenizers are regexes that HF runs with Oniguruma.
 * This is a backtracking engine over code points with Oniguruma's (Ruby
 * syntax) semantics for what tokenizer regexes use: literals and escapes,
 * [...] classes with ranges, negation and \p{..} categories, \s \S \d \D \w
 * \W \h \H, ., alternation (leftmost alternative first), groups, greedy, lazy
 * and possessive ? * + {m,n}, (?=..) (?!..) (?>..), ^ $ \A \z \Z \b \B and
 * the flags (?i) (ASCII case folding only) and (?m) (dot matches newline).
 * Not supported (load fails with CM384_E_UNSUPPORTED): backreferences,
 * lookbehind, script properties such as \p{Han}, nested classes, (?x).
 *
 * A pattern is parsed into a tree, then compiled into a small program for a
 * backtracking VM; the VM's stack of choice points lives in the encode call's
 * scratch memory. */

enum { RX_CHAR, RX_CHARI, RX_CLASS, RX_ANY, RX_SPLIT, RX_JMP, RX_ASSERT, RX_LOOK, RX_NLOOK,
       RX_ATOMIC, RX_SUBEND, RX_MARK, RX_EMPTYCHK, RX_MATCH };
enum { RXA_BOL, RXA_EOL, RXA_BOS, RXA_EOS, RXA_EOS_NL, RXA_WORDB, RXA_NWORDB };

typedef struct { int32_t op, x, y; } rx_inst;

typedef struct {
    uint32_t        ascii[4];   /* membership of U+0000..U+007F, negation applied */
    uint32_t        cats;       /* categories included (UMASK bits)               */
    uint8_t         ws, not_ws; /* \s or \S was among the items                   */
    uint8_t         word, not_word;   /* \w or \W                                */
    uint8_t         ctype;      /* a bare \w or \W: Oniguruma's ctype table      */
    uint8_t         neg;        /* [^...]                                         */
    int             n_ranges;
    const uint32_t *ranges;     /* sorted, disjoint [lo, hi] pairs                */
} rx_class;

typedef struct {
    rx_inst  *code;  int n_code;
    rx_class *cls;   int n_cls;
    int       n_slots;          /* loop-progress registers (see RX_MARK)           */
} rx_prog;

/* Is cp among the class's items (negation not applied)? */
static int rx_class_items(const rx_class *c, uint32_t cp, uint8_t props) {
    int in = (c->cats >> (props & 31)) & 1;
    if (!in) in = (props & UCAT_WS) ? c->ws : c->not_ws;
    if (!in && (c->word | c->not_word)) in = onig_is_word(cp, props, c->ctype) ? c->word : c->not_word;
    if (!in && c->n_ranges) {
        int lo = 0, hi = c->n_ranges - 1;
        while (lo <= hi) {
            int mid = (lo + hi) / 2;
            if (cp < c->ranges[2 * mid]) hi = mid - 1;
            else if (cp > c->ranges[2 * mid + 1]) lo = mid + 1;
            else { in = 1; break; }
        }
    }
    return in;
}

static int rx_class_has(const rx_class *c, uint32_t cp, uint8_t props) {
    if (cp < 128) return (c->ascii[cp >> 5] >> (cp & 31)) & 1;
    return rx_class_items(c, cp, props) ^ c->neg;
}

/* Parse tree. CAT and ALT chain their children through `next`. */
enum { RN_EMPTY, RN_CHAR, RN_CLASS, RN_ANY, RN_CAT, RN_ALT, RN_REPEAT, RN_LOOK, RN_ATOMIC, RN_ASSERT };
typedef struct {
    int kind;
    int a;            /* CHAR: code point; CLASS: index; ANY: dotall; LOOK: negated; ASSERT: RXA_ */
    int fold;         /* CHAR: ASCII case-insensitive                                        */
    int min, max;     /* REPEAT: max -1 = unbounded                                          */
    int greedy, possessive;
    int captured;     /* a capturing group's body (matters for what may repeat) */
    int kid, next;
} rx_node;

/* A class being built. */
typedef struct {
    uint32_t *r; int n, cap;      /* [lo, hi] pairs, unsorted */
    uint32_t  cats;
    uint8_t   ws, not_ws, word, not_word, ctype, neg;
} rx_cbuild;

typedef struct {
    const uint32_t *p; int n, i;          /* the pattern as code points  */
    rx_node   *nodes; int n_nodes, cap_nodes;
    rx_cbuild *cls;   int n_cls, cap_cls;
    int        fold, dotall, depth;
    const char *err;  int err_status;
} rx_parser;

#define RX_MAX_NODES  (1 << 18)
#define RX_MAX_CODE   (1 << 20)
#define RX_MAX_REPEAT 1000

static int rx_fail(rx_parser *ps, int status, const char *what) {
    if (!ps->err) { ps->err = what; ps->err_status = status; }
    return -1;
}

static int rx_new(rx_parser *ps, int kind) {
    if (ps->n_nodes == ps->cap_nodes) {
        if (ps->cap_nodes >= RX_MAX_NODES) return rx_fail(ps, CM384_E_UNSUPPORTED, "pattern too large");
        int cap = ps->cap_nodes ? ps->cap_nodes * 2 : 64;
        rx_node *nn = realloc(ps->nodes, (size_t)cap * sizeof *nn);
        if (!nn) return rx_fail(ps, CM384_E_NOMEM, "out of memory");
        ps->nodes = nn; ps->cap_nodes = cap;
    }
    rx_node *nd = &ps->nodes[ps->n_nodes];
    memset(nd, 0, sizeof *nd);
    nd->kind = kind; nd->kid = nd->next = -1;
    return ps->n_nodes++;
}

static int rx_new_class(rx_parser *ps) {
    if (ps->n_cls == ps->cap_cls) {
        int cap = ps->cap_cls ? ps->cap_cls * 2 : 16;
        rx_cbuild *nc = realloc(ps->cls, (size_t)cap * sizeof *nc);
        if (!nc) return rx_fail(ps, CM384_E_NOMEM, "out of memory");
        ps->cls = nc; ps->cap_cls = cap;
    }
    memset(&ps->cls[ps->n_cls], 0, sizeof ps->cls[0]);
    return ps->n_cls++;
}

static int cb_range(rx_parser *ps, rx_cbuild *c, uint32_t lo, uint32_t hi) {
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 8;
        uint32_t *nr = realloc(c->r, (size_t)cap * 2 * sizeof *nr);
        if (!nr) return rx_fail(ps, CM384_E_NOMEM, "out of memory");
        c->r = nr; c->cap = cap;
    }
    c->r[2 * c->n] = lo; c->r[2 * c->n + 1] = hi; c->n++;
    return 0;
}

static uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* Property names: general categories (one or two letters, or the long
 * names), Any, and Space / White_Space.  Case, '_', ' ' and '-' are ignored,
 * as Oniguruma does.  Returns 0 and fills *mask (or *ws) or -1 if unknown. */
static int rx_property(const uint32_t *name, int n, uint32_t *mask, int *ws) {
    static const struct { const char *name; uint32_t mask; } props[] = {
        {"l", UMASK_L}, {"letter", UMASK_L}, {"lc", UMASK(UCAT_Lu) | UMASK(UCAT_Ll) | UMASK(UCAT_Lt)},
        {"l&", UMASK(UCAT_Lu) | UMASK(UCAT_Ll) | UMASK(UCAT_Lt)},
        {"casedletter", UMASK(UCAT_Lu) | UMASK(UCAT_Ll) | UMASK(UCAT_Lt)},
        {"lu", UMASK(UCAT_Lu)}, {"uppercaseletter", UMASK(UCAT_Lu)},
        {"ll", UMASK(UCAT_Ll)}, {"lowercaseletter", UMASK(UCAT_Ll)},
        {"lt", UMASK(UCAT_Lt)}, {"titlecaseletter", UMASK(UCAT_Lt)},
        {"lm", UMASK(UCAT_Lm)}, {"modifierletter", UMASK(UCAT_Lm)},
        {"lo", UMASK(UCAT_Lo)}, {"otherletter", UMASK(UCAT_Lo)},
        {"m", UMASK_M}, {"mark", UMASK_M}, {"combiningmark", UMASK_M},
        {"mn", UMASK(UCAT_Mn)}, {"nonspacingmark", UMASK(UCAT_Mn)},
        {"mc", UMASK(UCAT_Mc)}, {"spacingmark", UMASK(UCAT_Mc)},
        {"me", UMASK(UCAT_Me)}, {"enclosingmark", UMASK(UCAT_Me)},
        {"n", UMASK_N}, {"number", UMASK_N},
        {"nd", UMASK(UCAT_Nd)}, {"decimalnumber", UMASK(UCAT_Nd)},
        {"nl", UMASK(UCAT_Nl)}, {"letternumber", UMASK(UCAT_Nl)},
        {"no", UMASK(UCAT_No)}, {"othernumber", UMASK(UCAT_No)},
        {"p", UMASK_P}, {"punctuation", UMASK_P},
        {"pc", UMASK(UCAT_Pc)}, {"connectorpunctuation", UMASK(UCAT_Pc)},
        {"pd", UMASK(UCAT_Pd)}, {"dashpunctuation", UMASK(UCAT_Pd)},
        {"ps", UMASK(UCAT_Ps)}, {"openpunctuation", UMASK(UCAT_Ps)},
        {"pe", UMASK(UCAT_Pe)}, {"closepunctuation", UMASK(UCAT_Pe)},
        {"pi", UMASK(UCAT_Pi)}, {"initialpunctuation", UMASK(UCAT_Pi)},
        {"pf", UMASK(UCAT_Pf)}, {"finalpunctuation", UMASK(UCAT_Pf)},
        {"po", UMASK(UCAT_Po)}, {"otherpunctuation", UMASK(UCAT_Po)},
        {"s", UMASK_S}, {"symbol", UMASK_S},
        {"sm", UMASK(UCAT_Sm)}, {"mathsymbol", UMASK(UCAT_Sm)},
        {"sc", UMASK(UCAT_Sc)}, {"currencysymbol", UMASK(UCAT_Sc)},
        {"sk", UMASK(UCAT_Sk)}, {"modifiersymbol", UMASK(UCAT_Sk)},
        {"so", UMASK(UCAT_So)}, {"othersymbol", UMASK(UCAT_So)},
        {"z", UMASK_Z}, {"separator", UMASK_Z},
        {"zs", UMASK(UCAT_Zs)}, {"spaceseparator", UMASK(UCAT_Zs)},
        {"zl", UMASK(UCAT_Zl)}, {"lineseparator", UMASK(UCAT_Zl)},
        {"zp", UMASK(UCAT_Zp)}, {"paragraphseparator", UMASK(UCAT_Zp)},
        {"c", UMASK_C}, {"other", UMASK_C},
        {"cc", UMASK(UCAT_Cc)}, {"control", UMASK(UCAT_Cc)},
        {"cf", UMASK(UCAT_Cf)}, {"format", UMASK(UCAT_Cf)},
        {"cs", UMASK(UCAT_Cs)}, {"surrogate", UMASK(UCAT_Cs)},
        {"co", UMASK(UCAT_Co)}, {"privateuse", UMASK(UCAT_Co)},
        {"cn", UMASK(UCAT_Cn)}, {"unassigned", UMASK(UCAT_Cn)},
        {"any", UMASK_ALL},
    };
    char key[40];
    int k = 0;
    for (int i = 0; i < n; i++) {
        uint32_t c = name[i];
        if (c == '_' || c == ' ' || c == '-') continue;
        if (c > 127 || k + 1 >= (int)sizeof key) return -1;
        key[k++] = (char)ascii_lower(c);
    }
    key[k] = 0;
    *ws = 0; *mask = 0;
    if (!strcmp(key, "space") || !strcmp(key, "whitespace")) { *ws = 1; return 0; }
    for (size_t i = 0; i < sizeof props / sizeof props[0]; i++)
        if (!strcmp(key, props[i].name)) { *mask = props[i].mask; return 0; }
    return -1;
}

/* Adds a class escape (\d \s \w \h and negations, \p{..} \P{..}) to c.
 * ps->i is just past the escape letter. */
static int rx_class_escape(rx_parser *ps, uint32_t letter, rx_cbuild *c) {
    switch (letter) {
    case 'd': c->cats |= UMASK(UCAT_Nd); return 0;
    case 'D': c->cats |= UMASK_ALL & ~UMASK(UCAT_Nd); return 0;
    case 'w': c->word = 1; return 0;
    case 'W': c->not_word = 1; return 0;
    case 's': c->ws = 1; return 0;
    case 'S': c->not_ws = 1; return 0;
    case 'h':
        if (cb_range(ps, c, '0', '9') || cb_range(ps, c, 'a', 'f') || cb_range(ps, c, 'A', 'F')) return -1;
        return 0;
    case 'H':   /* everything but [0-9a-fA-F] */
        if (cb_range(ps, c, 0, '0' - 1) || cb_range(ps, c, '9' + 1, 'A' - 1) ||
            cb_range(ps, c, 'F' + 1, 'a' - 1) || cb_range(ps, c, 'f' + 1, 0x10FFFF)) return -1;
        return 0;
    }
    /* \p{Name}, \p{^Name}, \P{Name} */
    if (ps->i >= ps->n || ps->p[ps->i] != '{') return rx_fail(ps, CM384_E_FORMAT, "\\p needs {name}");
    int start = ++ps->i, negate = letter == 'P';
    while (ps->i < ps->n && ps->p[ps->i] != '}') ps->i++;
    if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "unterminated \\p{");
    int end = ps->i++;
    if (start < end && ps->p[start] == '^') { negate = !negate; start++; }
    uint32_t mask; int ws;
    if (rx_property(ps->p + start, end - start, &mask, &ws))
        return rx_fail(ps, CM384_E_UNSUPPORTED, "unsupported \\p{} property (only general categories)");
    if (ws) { if (negate) c->not_ws = 1; else c->ws = 1; }
    else c->cats |= negate ? (UMASK_ALL & ~mask) : mask;
    return 0;
}

static int rx_hex(rx_parser *ps, int min_digits, int max_digits, uint32_t *out) {
    uint32_t v = 0; int k = 0;
    while (k < max_digits && ps->i < ps->n && ps->p[ps->i] < 128 && hexval((int)ps->p[ps->i]) >= 0) {
        v = v * 16 + (uint32_t)hexval((int)ps->p[ps->i]);
        ps->i++; k++;
    }
    if (k < min_digits || v > 0x10FFFF) return rx_fail(ps, CM384_E_FORMAT, "bad hex escape");
    *out = v;
    return 0;
}

/* Parses the escape after a backslash (ps->i at the letter).  Returns 1 with
 * a literal in *cp, 2 when a class escape was added to *c, 3 with an
 * assertion kind in *cp (outside classes), or -1. */
static int rx_escape(rx_parser *ps, int in_class, uint32_t *cp, rx_cbuild *c) {
    if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "pattern ends with a backslash");
    uint32_t e = ps->p[ps->i++];
    switch (e) {
    case 't': *cp = '\t'; return 1;
    case 'n': *cp = '\n'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case 'a': *cp = 7; return 1;
    case 'e': *cp = 27; return 1;
    case '0': {   /* \0, \0o, \0oo: octal */
        uint32_t v = 0;
        for (int k = 0; k < 2 && ps->i < ps->n && ps->p[ps->i] >= '0' && ps->p[ps->i] <= '7'; k++)
            v = v * 8 + (ps->p[ps->i++] - '0');
        *cp = v; return 1;
    }
    case 'x':
        if (ps->i < ps->n && ps->p[ps->i] == '{') {
            ps->i++;
            if (rx_hex(ps, 1, 8, cp)) return -1;
            if (ps->i >= ps->n || ps->p[ps->i] != '}') return rx_fail(ps, CM384_E_FORMAT, "bad \\x{} escape");
            ps->i++;
            return 1;
        }
        return rx_hex(ps, 1, 2, cp) ? -1 : 1;
    case 'u': return rx_hex(ps, 4, 4, cp) ? -1 : 1;
    case 'd': case 'D': case 'w': case 'W': case 's': case 'S': case 'h': case 'H': case 'p': case 'P':
        return rx_class_escape(ps, e, c) ? -1 : 2;
    case 'b':
        if (in_class) { *cp = 8; return 1; }
        *cp = RXA_WORDB; return 3;
    }
    if (!in_class) {
        switch (e) {
        case 'B': *cp = RXA_NWORDB; return 3;
        case 'A': *cp = RXA_BOS; return 3;
        case 'z': *cp = RXA_EOS; return 3;
        case 'Z': *cp = RXA_EOS_NL; return 3;
        }
    }
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '1' && e <= '9'))
        return rx_fail(ps, CM384_E_UNSUPPORTED, "unsupported escape (backreference, \\R, \\X, \\K, \\G...)");
    *cp = e;   /* an escaped punctuation character or any other: itself */
    return 1;
}

/* [...] after the '['. */
static int rx_parse_class(rx_parser *ps) {
    int ci = rx_new_class(ps);
    if (ci < 0) return -1;
    rx_cbuild *c = &ps->cls[ci];
    if (ps->i < ps->n && ps->p[ps->i] == '^') { c->neg = 1; ps->i++; }
    int first = 1;
    for (;;) {
        if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "unterminated [ class");
        uint32_t ch = ps->p[ps->i];
        if (ch == ']' && !first) { ps->i++; break; }
        first = 0;
        if (ch == '[') return rx_fail(ps, CM384_E_UNSUPPORTED, "nested [ ] sets and [: :] are not supported");
        if (ch == '&' && ps->i + 1 < ps->n && ps->p[ps->i + 1] == '&')
            return rx_fail(ps, CM384_E_UNSUPPORTED, "class intersection && is not supported");
        uint32_t lo;
        ps->i++;
        if (ch == '\\') {
            int r = rx_escape(ps, 1, &lo, &ps->cls[ci]);
            c = &ps->cls[ci];
            if (r < 0) return -1;
            if (r == 2) continue;
        } else lo = ch;
        /* a range lo-hi, unless '-' is last */
        if (ps->i + 1 < ps->n && ps->p[ps->i] == '-' && ps->p[ps->i + 1] != ']') {
            ps->i++;
            uint32_t hi = ps->p[ps->i++];
            if (hi == '\\') {
                int r = rx_escape(ps, 1, &hi, &ps->cls[ci]);
                c = &ps->cls[ci];
                if (r < 0) return -1;
                if (r != 1) return rx_fail(ps, CM384_E_FORMAT, "bad range in class");
            }
            if (hi < lo) return rx_fail(ps, CM384_E_FORMAT, "empty range in class");
            if (cb_range(ps, c, lo, hi)) return -1;
        } else if (cb_range(ps, c, lo, lo)) return -1;
    }
    /* (?i): add the other case of ASCII letters */
    if (ps->fold) {
        int n = c->n;
        for (int k = 0; k < n; k++) {
            uint32_t lo = c->r[2 * k], hi = c->r[2 * k + 1];
            uint32_t a = lo > 'A' ? lo : 'A', b = hi < 'Z' ? hi : 'Z';
            if (a <= b && cb_range(ps, &ps->cls[ci], a + 32, b + 32)) return -1;
            a = lo > 'a' ? lo : 'a'; b = hi < 'z' ? hi : 'z';
            if (a <= b && cb_range(ps, &ps->cls[ci], a - 32, b - 32)) return -1;
            c = &ps->cls[ci];
        }
    }
    int nd = rx_new(ps, RN_CLASS);
    if (nd < 0) return -1;
    ps->nodes[nd].a = ci;
    return nd;
}

static int rx_parse_alt(rx_parser *ps);

/* A class node holding one escape such as \s or \p{L}. */
static int rx_escape_node(rx_parser *ps) {
    int ci = rx_new_class(ps);
    if (ci < 0) return -1;
    uint32_t cp;
    ps->cls[ci].ctype = 1;   /* a bare \w reads Oniguruma's ctype table */
    int r = rx_escape(ps, 0, &cp, &ps->cls[ci]);
    if (r < 0) return -1;
    if (r == 2) {
        int nd = rx_new(ps, RN_CLASS);
        if (nd < 0) return -1;
        ps->nodes[nd].a = ci;
        return nd;
    }
    ps->n_cls--;   /* not a class after all */
    int nd = rx_new(ps, r == 3 ? RN_ASSERT : RN_CHAR);
    if (nd < 0) return -1;
    ps->nodes[nd].a = (int)cp;
    ps->nodes[nd].fold = ps->fold;
    return nd;
}

/* Reads "(?flags" up to ':' or ')' and applies them to ps; *colon tells which. */
static int rx_flags(rx_parser *ps, int *colon) {
    int on = 1;
    for (;;) {
        if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "unterminated (? group");
        uint32_t c = ps->p[ps->i++];
        if (c == ':') { *colon = 1; return 0; }
        if (c == ')') { *colon = 0; return 0; }
        if (c == '-') on = 0;
        else if (c == 'i') ps->fold = on;
        else if (c == 'm') ps->dotall = on;
        else return rx_fail(ps, CM384_E_UNSUPPORTED, "unsupported (?flag) (only i and m)");
    }
}

static int rx_parse_group(rx_parser *ps) {   /* after '(' */
    int kind = -1, neg = 0, captured = 1;
    int save_fold = ps->fold, save_dotall = ps->dotall;
    if (ps->i < ps->n && ps->p[ps->i] == '?') {
        ps->i++;
        uint32_t c = ps->i < ps->n ? ps->p[ps->i] : 0;
        captured = 0;
        if (c == ':') ps->i++;
        else if (c == '=' || c == '!') { ps->i++; kind = RN_LOOK; neg = c == '!'; }
        else if (c == '>') { ps->i++; kind = RN_ATOMIC; }
        else if (c == '#') {  /* comment */
            while (ps->i < ps->n && ps->p[ps->i] != ')') ps->i++;
            if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "unterminated comment");
            ps->i++;
            return rx_new(ps, RN_EMPTY);
        } else if (c == '<' || c == '\'' || c == 'P') {
            if (c == 'P') ps->i++;
            uint32_t open = ps->i < ps->n ? ps->p[ps->i] : 0;
            if (open == '<' && ps->i + 1 < ps->n && (ps->p[ps->i + 1] == '=' || ps->p[ps->i + 1] == '!'))
                return rx_fail(ps, CM384_E_UNSUPPORTED, "lookbehind is not supported");
            uint32_t close = open == '<' ? '>' : '\'';
            if (open != '<' && open != '\'') return rx_fail(ps, CM384_E_FORMAT, "bad group name");
            while (ps->i < ps->n && ps->p[ps->i] != close) ps->i++;   /* a named group groups */
            if (ps->i >= ps->n) return rx_fail(ps, CM384_E_FORMAT, "unterminated group name");
            ps->i++;
            captured = 1;
        } else {
            int colon;
            if (rx_flags(ps, &colon)) return -1;
            if (!colon) {
                /* (?i) alone: Oniguruma applies it to the rest of the enclosing
                 * group, alternatives included: a(?i)b|c is a(?i:b|c). */
                if (++ps->depth > 200) return rx_fail(ps, CM384_E_UNSUPPORTED, "pattern nested too deep");
                int sub = rx_parse_alt(ps);
                ps->depth--;
                ps->fold = save_fold; ps->dotall = save_dotall;
                return sub;
            }
        }
    }
    if (++ps->depth > 200) return rx_fail(ps, CM384_E_UNSUPPORTED, "pattern nested too deep");
    int sub = rx_parse_alt(ps);
    ps->depth--;
    ps->fold = save_fold; ps->dotall = save_dotall;
    if (sub < 0) return -1;
    if (ps->i >= ps->n || ps->p[ps->i] != ')') return rx_fail(ps, CM384_E_FORMAT, "missing )");
    ps->i++;
    if (kind < 0) {
        if (captured) ps->nodes[sub].captured = 1;
        return sub;
    }
    int nd = rx_new(ps, kind);
    if (nd < 0) return -1;
    ps->nodes[nd].kid = sub;
    ps->nodes[nd].a = neg;
    return nd;
}

/* {m}, {m,}, {m,n}, {,n} at ps->i (on the '{'); 0 if it is not one (then '{'
 * is a literal, as in Oniguruma). */
static int rx_interval(rx_parser *ps, int *min, int *max) {
    int i = ps->i + 1, lo = -1, hi = -1;
    long v = 0; int digits = 0;
    while (i < ps->n && ps->p[i] >= '0' && ps->p[i] <= '9') { v = v * 10 + (ps->p[i++] - '0'); digits++; if (v > 100000) v = 100000; }
    if (digits) lo = (int)v;
    if (i < ps->n && ps->p[i] == '}') {
        if (!digits) return 0;
        hi = lo;
    } else if (i < ps->n && ps->p[i] == ',') {
        i++; v = 0; digits = 0;
        while (i < ps->n && ps->p[i] >= '0' && ps->p[i] <= '9') { v = v * 10 + (ps->p[i++] - '0'); digits++; if (v > 100000) v = 100000; }
        if (i >= ps->n || ps->p[i] != '}') return 0;
        if (lo < 0 && !digits) return 0;
        if (lo < 0) lo = 0;
        hi = digits ? (int)v : -1;
    } else return 0;
    ps->i = i + 1;
    *min = lo; *max = hi;
    return 1;
}

/* Oniguruma refuses to repeat an anchor or lookaround, or an alternation
 * with such a branch, seen through (?:...) but not through (...) or (?>...);
 * a sequence of several items is always accepted. */
static int rx_bad_target(const rx_node *nodes, int i) {
    const rx_node *nd = &nodes[i];
    if (nd->captured) return 0;
    switch (nd->kind) {
    case RN_ASSERT: case RN_LOOK: return 1;
    case RN_CAT: return nd->kid >= 0 && nodes[nd->kid].next < 0 && rx_bad_target(nodes, nd->kid);
    case RN_ALT:
        for (int k = nd->kid; k >= 0; k = nodes[k].next) if (rx_bad_target(nodes, k)) return 1;
        return 0;
    default: return 0;
    }
}

/* A greedy repeat stacked on a greedy ?, * or + of one character, with
 * counts that say the same thing is the one repeat it reduces to, as
 * Oniguruma reduces it: \s**, [a-z]+*, x?* and (?:x?)+ are a * of their
 * character, (?:x+)+ a +, (?:x?)? a ?.  Each turn takes one character, so
 * the matches and the order they are tried in stay the same; left stacked,
 * the outer loop would try every way of cutting a run into turns --
 * exponential in the run when what follows fails.  Changes the inner repeat
 * in place and returns 1, or returns 0 (a captured group stays as written). */
static int rx_reduce_stacked(rx_node *nodes, int atom, int min, int max, int greedy, int possessive) {
    while (nodes[atom].kind == RN_CAT && !nodes[atom].captured && nodes[atom].kid >= 0 && nodes[nodes[atom].kid].next < 0)
        atom = nodes[atom].kid;                      /* (?:X) is X */
    rx_node *in = &nodes[atom];
    if (in->kind != RN_REPEAT || in->captured || !in->greedy || in->possessive || !greedy || possessive) return 0;
    int one = nodes[in->kid].kind == RN_CHAR || nodes[in->kid].kind == RN_CLASS || nodes[in->kid].kind == RN_ANY;
    if (!one || in->min > 1 || min > 1 || (in->max != 1 && in->max != -1) || (max != 1 && max != -1)) return 0;
    in->min *= min;
    in->max = in->max == -1 || max == -1 ? -1 : 1;
    return 1;
}

static int rx_parse_repeat(rx_parser *ps) {
    int atom;
    uint32_t c = ps->p[ps->i];
    if (c == '(') { ps->i++; atom = rx_parse_group(ps); }
    else if (c == '[') { ps->i++; atom = rx_parse_class(ps); }
    else if (c == '\\') { ps->i++; atom = rx_escape_node(ps); }
    else if (c == '.') {
        ps->i++;
        atom = rx_new(ps, RN_ANY);
        if (atom >= 0) ps->nodes[atom].a = ps->dotall;
    } else if (c == '^' || c == '$') {
        ps->i++;
        atom = rx_new(ps, RN_ASSERT);
        if (atom >= 0) ps->nodes[atom].a = c == '^' ? RXA_BOL : RXA_EOL;
    } else if (c == '*' || c == '+' || c == '?') {
        return rx_fail(ps, CM384_E_FORMAT, "target of repeat operator is not specified");
    } else {
        ps->i++;
        atom = rx_new(ps, RN_CHAR);
        if (atom >= 0) { ps->nodes[atom].a = (int)c; ps->nodes[atom].fold = ps->fold; }
    }
    if (atom < 0) return -1;
    for (int stacked = 0;; stacked++) {
        if (ps->i >= ps->n) break;
        if (stacked == 4) return rx_fail(ps, CM384_E_UNSUPPORTED, "too many stacked quantifiers");
        c = ps->p[ps->i];
        int min, max, interval = 0;
        if (c == '*') { min = 0; max = -1; ps->i++; }
        else if (c == '+') { min = 1; max = -1; ps->i++; }
        else if (c == '?') { min = 0; max = 1; ps->i++; }
        else if (c == '{' && rx_interval(ps, &min, &max)) interval = 1;
        else break;
        if (rx_bad_target(ps->nodes, atom)) return rx_fail(ps, CM384_E_FORMAT, "target of repeat operator is invalid");
        if (min > RX_MAX_REPEAT || max > RX_MAX_REPEAT)
            return rx_fail(ps, CM384_E_UNSUPPORTED, "repeat count too large");
        if (max >= 0 && max < min) return rx_fail(ps, CM384_E_FORMAT, "bad repeat range");
        int greedy = 1, possessive = 0;
        if (ps->i < ps->n && ps->p[ps->i] == '?') { greedy = 0; ps->i++; }
        else if (!interval && ps->i < ps->n && ps->p[ps->i] == '+') { possessive = 1; ps->i++; }
        if (rx_reduce_stacked(ps->nodes, atom, min, max, greedy, possessive)) continue;
        int nd = rx_new(ps, RN_REPEAT);
        if (nd < 0) return -1;
        rx_node *r = &ps->nodes[nd];
        r->kid = atom; r->min = min; r->max = max; r->greedy = greedy; r->possessive = possessive;
        atom = nd;
    }
    return atom;
}

static int rx_parse_cat(rx_parser *ps) {
    int cat = rx_new(ps, RN_CAT), last = -1;
    if (cat < 0) return -1;
    while (ps->i < ps->n && ps->p[ps->i] != '|' && ps->p[ps->i] != ')') {
        int kid = rx_parse_repeat(ps);
        if (kid < 0) return -1;
        if (last < 0) ps->nodes[cat].kid = kid; else ps->nodes[last].next = kid;
        last = kid;
    }
    return cat;
}

static int rx_parse_alt(rx_parser *ps) {
    int first = rx_parse_cat(ps);
    if (first < 0 || ps->i >= ps->n || ps->p[ps->i] != '|') return first;
    int alt = rx_new(ps, RN_ALT), last = first;
    if (alt < 0) return -1;
    ps->nodes[alt].kid = first;
    while (ps->i < ps->n && ps->p[ps->i] == '|') {
        ps->i++;
        int kid = rx_parse_cat(ps);
        if (kid < 0) return -1;
        ps->nodes[last].next = kid;
        last = kid;
    }
    return alt;
}

/* Compiler: tree -> program. */
typedef struct {
    rx_parser *ps;
    rx_inst   *code; int n, cap;
    int        n_slots;
} rx_compiler;

static int rx_emit(rx_compiler *c, int op, int x, int y) {
    if (c->n == c->cap) {
        if (c->cap >= RX_MAX_CODE) return rx_fail(c->ps, CM384_E_UNSUPPORTED, "pattern too large");
        int cap = c->cap ? c->cap * 2 : 64;
        rx_inst *nc = realloc(c->code, (size_t)cap * sizeof *nc);
        if (!nc) return rx_fail(c->ps, CM384_E_NOMEM, "out of memory");
        c->code = nc; c->cap = cap;
    }
    c->code[c->n].op = op; c->code[c->n].x = x; c->code[c->n].y = y;
    return c->n++;
}

/* Can the node match the empty string?  (Loops over such nodes need a
 * progress check, or `(a*)*` would spin forever.) */
static int rx_nullable(const rx_node *nodes, int i) {
    const rx_node *nd = &nodes[i];
    switch (nd->kind) {
    case RN_CHAR: case RN_CLASS: case RN_ANY: return 0;
    case RN_CAT:
        for (int k = nd->kid; k >= 0; k = nodes[k].next) if (!rx_nullable(nodes, k)) return 0;
        return 1;
    case RN_ALT:
        for (int k = nd->kid; k >= 0; k = nodes[k].next) if (rx_nullable(nodes, k)) return 1;
        return 0;
    case RN_REPEAT: return nd->min == 0 || rx_nullable(nodes, nd->kid);
    case RN_ATOMIC: return rx_nullable(nodes, nd->kid);
    default: return 1;   /* empty, assertions, lookahead */
    }
}

static int rx_gen(rx_compiler *c, int i);

static int rx_gen_repeat(rx_compiler *c, const rx_node *nd) {
    for (int k = 0; k < nd->min; k++) if (rx_gen(c, nd->kid)) return -1;
    if (nd->max < 0) {
        int nullable = rx_nullable(c->ps->nodes, nd->kid);
        int slot = nullable ? c->n_slots++ : -1, chk = -1;
        int loop = rx_emit(c, RX_SPLIT, 0, 0);
        if (loop < 0) return -1;
        int body = c->n;
        if (nullable && rx_emit(c, RX_MARK, slot, 0) < 0) return -1;
        if (rx_gen(c, nd->kid)) return -1;
        if (nullable && (chk = rx_emit(c, RX_EMPTYCHK, slot, 0)) < 0) return -1;
        if (rx_emit(c, RX_JMP, loop, 0) < 0) return -1;
        int exit = c->n;
        c->code[loop].x = nd->greedy ? body : exit;
        c->code[loop].y = nd->greedy ? exit : body;
        if (chk >= 0) c->code[chk].y = exit;
        return 0;
    }
    /* optional copies e(e(e)?)?: every "skip" goes to the end */
    int k = nd->max - nd->min;
    int *splits = k ? malloc((size_t)k * sizeof *splits) : NULL;
    if (k && !splits) return rx_fail(c->ps, CM384_E_NOMEM, "out of memory");
    for (int j = 0; j < k; j++) {
        if ((splits[j] = rx_emit(c, RX_SPLIT, 0, 0)) < 0 || rx_gen(c, nd->kid)) { free(splits); return -1; }
    }
    int end = c->n;
    for (int j = 0; j < k; j++) {
        c->code[splits[j]].x = nd->greedy ? splits[j] + 1 : end;
        c->code[splits[j]].y = nd->greedy ? end : splits[j] + 1;
    }
    free(splits);
    return 0;
}

static int rx_gen(rx_compiler *c, int i) {
    const rx_node nd = c->ps->nodes[i];   /* a copy: nodes do not move, but stay safe */
    switch (nd.kind) {
    case RN_EMPTY: return 0;
    case RN_CHAR: {
        uint32_t lc = ascii_lower((uint32_t)nd.a);
        int folds = nd.fold && lc >= 'a' && lc <= 'z';
        return rx_emit(c, folds ? RX_CHARI : RX_CHAR, folds ? (int)lc : nd.a, 0) < 0 ? -1 : 0;
    }
    case RN_CLASS: return rx_emit(c, RX_CLASS, nd.a, 0) < 0 ? -1 : 0;
    case RN_ANY: return rx_emit(c, RX_ANY, nd.a, 0) < 0 ? -1 : 0;
    case RN_ASSERT: return rx_emit(c, RX_ASSERT, nd.a, 0) < 0 ? -1 : 0;
    case RN_CAT:
        for (int k = nd.kid; k >= 0; k = c->ps->nodes[k].next) if (rx_gen(c, k)) return -1;
        return 0;
    case RN_ALT: {
        /* SPLIT a1, next; a1; JMP end; next: SPLIT a2, next2; ... ak; end: */
        int jumps = -1;   /* chain of JMPs to patch, linked through .x */
        for (int k = nd.kid; k >= 0; k = c->ps->nodes[k].next) {
            int last = c->ps->nodes[k].next < 0;
            int split = -1;
            if (!last && (split = rx_emit(c, RX_SPLIT, 0, 0)) < 0) return -1;
            if (split >= 0) c->code[split].x = c->n;
            if (rx_gen(c, k)) return -1;
            if (!last) {
                int j = rx_emit(c, RX_JMP, jumps, 0);
                if (j < 0) return -1;
                jumps = j;
                c->code[split].y = c->n;
            }
        }
        while (jumps >= 0) { int nx = c->code[jumps].x; c->code[jumps].x = c->n; jumps = nx; }
        return 0;
    }
    case RN_REPEAT:
        if (nd.possessive) {   /* a*+ is (?>a*) */
            int at = rx_emit(c, RX_ATOMIC, 0, 0);
            rx_node plain = nd;
            plain.possessive = 0;
            if (at < 0 || rx_gen_repeat(c, &plain) || rx_emit(c, RX_SUBEND, 0, 0) < 0) return -1;
            c->code[at].x = c->n;
            return 0;
        }
        return rx_gen_repeat(c, &nd);
    case RN_LOOK: case RN_ATOMIC: {
        int op = nd.kind == RN_ATOMIC ? RX_ATOMIC : nd.a ? RX_NLOOK : RX_LOOK;
        int at = rx_emit(c, op, 0, 0);
        if (at < 0 || rx_gen(c, nd.kid) || rx_emit(c, RX_SUBEND, 0, 0) < 0) return -1;
        c->code[at].x = c->n;
        return 0;
    }
    }
    return rx_fail(c->ps, CM384_E_INTERNAL, "bad regex node");
}

static int range_cmp(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Compiles pattern[0..len) (UTF-8) into *out, allocated in a.  On failure
 * returns a status and sets *err to a static description. */
static int rx_compile(const char *pattern, size_t len, arena *a, rx_prog *out, const char **err) {
    rx_parser ps = {0};
    rx_compiler cc = {0};
    int status = CM384_OK;
    memset(out, 0, sizeof *out);
    uint32_t *cps = malloc((len + 1) * sizeof *cps);
    if (!cps) { *err = "out of memory"; return CM384_E_NOMEM; }
    int n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        i += (size_t)utf8_decode((const uint8_t *)pattern + i, len - i, &cp);
        if (cp >= TOK_BAD_BYTE) { free(cps); *err = "pattern is not valid UTF-8"; return CM384_E_FORMAT; }
        cps[n++] = cp;
    }
    ps.p = cps; ps.n = n;
    int root = rx_parse_alt(&ps);
    if (root >= 0 && ps.i < ps.n) root = rx_fail(&ps, CM384_E_FORMAT, "unmatched )");
    cc.ps = &ps;
    if (root < 0 || rx_gen(&cc, root) || rx_emit(&cc, RX_MATCH, 0, 0) < 0) {
        status = ps.err_status ? ps.err_status : CM384_E_FORMAT;
        *err = ps.err ? ps.err : "bad pattern";
        goto done;
    }
    /* freeze the program and its classes into the arena */
    out->code = arena_alloc(a, (size_t)cc.n * sizeof *out->code);
    out->cls = arena_alloc(a, (size_t)(ps.n_cls ? ps.n_cls : 1) * sizeof *out->cls);
    if (!out->code || !out->cls) { status = CM384_E_NOMEM; *err = "out of memory"; goto done; }
    memcpy(out->code, cc.code, (size_t)cc.n * sizeof *out->code);
    out->n_code = cc.n;
    out->n_slots = cc.n_slots;
    for (int k = 0; k < ps.n_cls; k++) {
        rx_cbuild *b = &ps.cls[k];
        rx_class *c = &out->cls[k];
        memset(c, 0, sizeof *c);
        /* sort ranges and merge overlaps, for the binary search */
        if (b->n > 1) qsort(b->r, (size_t)b->n, 2 * sizeof *b->r, range_cmp);
        int m = 0;
        for (int i = 0; i < b->n; i++) {
            if (m > 0 && b->r[2 * i] <= b->r[2 * (m - 1) + 1] + 1) {
                if (b->r[2 * i + 1] > b->r[2 * (m - 1) + 1]) b->r[2 * (m - 1) + 1] = b->r[2 * i + 1];
            } else { b->r[2 * m] = b->r[2 * i]; b->r[2 * m + 1] = b->r[2 * i + 1]; m++; }
        }
        uint32_t *r = NULL;
        if (m) {
            r = arena_alloc(a, (size_t)m * 2 * sizeof *r);
            if (!r) { status = CM384_E_NOMEM; *err = "out of memory"; goto done; }
            memcpy(r, b->r, (size_t)m * 2 * sizeof *r);
        }
        c->cats = b->cats; c->ws = b->ws; c->not_ws = b->not_ws; c->neg = b->neg;
        c->word = b->word; c->not_word = b->not_word; c->ctype = b->ctype;
        c->ranges = r; c->n_ranges = m;
        for (uint32_t ch = 0; ch < 128; ch++)   /* ASCII membership, negation included */
            if (rx_class_items(c, ch, unicode_latin1[ch]) ^ c->neg) c->ascii[ch >> 5] |= 1u << (ch & 31);
    }
    out->n_cls = ps.n_cls;
done:
    for (int k = 0; k < ps.n_cls; k++) free(ps.cls[k].r);
    free(ps.cls);
    free(ps.nodes);
    free(cc.code);
    free(cps);
    return status;
}

/* The VM.  A choice point is (pc, pos); pc < 0 marks "restore slot -pc-1 to
 * pos" so that loop-progress registers are undone on backtracking. */
typedef struct { int32_t pc, pos; } rx_frame;

typedef struct {
    const uint32_t *cp;       /* the text being matched, [0, n)          */
    const uint8_t  *props;    /* unicode_props() of each code point      */
    int             n;
    rx_frame       *stack;  size_t sp, cap;
    int            *slots;  int n_slots;
    long            budget;   /* backtracks left in this match attempt   */
    long long       total;    /* ... and in the whole tokenize call      */
    long long       steps;    /* backtracks taken (tests read it)        */
    int             oom;
} rx_vm;

/* Oniguruma gives up a match attempt after this many backtracks; so do we
 * (the attempt then fails).  That alone still lets a hostile pattern (a
 * nested repeat such as \s** before text that never follows) spend the
 * limit at every position: seconds for 256 bytes, hours for a long prompt.
 * So a tokenize call also has a total, RX_BACKTRACK_LIMIT plus
 * RX_BACKTRACKS_PER_BYTE for each byte of its text; once it is spent, the
 * searches of that call find nothing more and the rest of the text stays
 * one piece.  Real pre-tokenizer patterns backtrack a few times per
 * character, far inside it; Oniguruma has no such total (HF would take the
 * hours). */
#define RX_BACKTRACK_LIMIT 10000000L
#define RX_BACKTRACKS_PER_BYTE 1000

static int rx_push(rx_vm *vm, int pc, int pos) {
    if (vm->sp == vm->cap) {
        size_t cap = vm->cap ? vm->cap * 2 : 256;
        rx_frame *ns = realloc(vm->stack, cap * sizeof *ns);
        if (!ns) { vm->oom = 1; return -1; }
        vm->stack = ns; vm->cap = cap;
    }
    vm->stack[vm->sp].pc = pc; vm->stack[vm->sp].pos = pos;
    vm->sp++;
    return 0;
}

static int rx_is_word(const rx_vm *vm, int pos) {
    return pos >= 0 && pos < vm->n && onig_is_word(vm->cp[pos], vm->props[pos], 1);
}

/* Runs the program from pc at pos; returns the end of the first match in
 * priority order, or -1.  Sub-matches (lookahead, atomic groups) recurse and
 * end at their RX_SUBEND; their choice points are dropped when they return,
 * which makes them atomic as in Oniguruma. */
static int rx_run(const rx_prog *p, rx_vm *vm, int pc, int pos, int depth) {
    size_t base = vm->sp;
    if (depth > 64) return -1;
    for (;;) {
        const rx_inst *in = &p->code[pc];
        switch (in->op) {
        case RX_CHAR:
            if (pos < vm->n && vm->cp[pos] == (uint32_t)in->x) { pos++; pc++; continue; }
            goto fail;
        case RX_CHARI:
            if (pos < vm->n && ascii_lower(vm->cp[pos]) == (uint32_t)in->x) { pos++; pc++; continue; }
            goto fail;
        case RX_CLASS:
            if (pos < vm->n && rx_class_has(&p->cls[in->x], vm->cp[pos], vm->props[pos])) { pos++; pc++; continue; }
            goto fail;
        case RX_ANY:
            if (pos < vm->n && (in->x || vm->cp[pos] != '\n')) { pos++; pc++; continue; }
            goto fail;
        case RX_SPLIT:
            if (rx_push(vm, in->y, pos)) goto fail;
            pc = in->x;
            continue;
        case RX_JMP:
            pc = in->x;
            continue;
        case RX_ASSERT: {
            int ok = 0;
            switch (in->x) {
            /* Oniguruma's ^ never matches at the very end, even after a newline */
            case RXA_BOL: ok = pos == 0 || (vm->cp[pos - 1] == '\n' && pos < vm->n); break;
            case RXA_EOL: ok = pos == vm->n || vm->cp[pos] == '\n'; break;
            case RXA_BOS: ok = pos == 0; break;
            case RXA_EOS: ok = pos == vm->n; break;
            case RXA_EOS_NL: ok = pos == vm->n || (pos == vm->n - 1 && vm->cp[pos] == '\n'); break;
            case RXA_WORDB: ok = rx_is_word(vm, pos - 1) != rx_is_word(vm, pos); break;
            case RXA_NWORDB: ok = rx_is_word(vm, pos - 1) == rx_is_word(vm, pos); break;
            }
            if (!ok) goto fail;
            pc++;
            continue;
        }
        case RX_LOOK: case RX_NLOOK: {
            int r = rx_run(p, vm, pc + 1, pos, depth + 1);
            if (vm->oom || vm->budget < 0) goto fail;
            if ((r >= 0) != (in->op == RX_LOOK)) goto fail;
            pc = in->x;
            continue;
        }
        case RX_ATOMIC: {
            int r = rx_run(p, vm, pc + 1, pos, depth + 1);
            if (r < 0) goto fail;
            pos = r;
            pc = in->x;
            continue;
        }
        case RX_MARK:
            if (rx_push(vm, -in->x - 1, vm->slots[in->x])) goto fail;
            vm->slots[in->x] = pos;
            pc++;
            continue;
        case RX_EMPTYCHK:
            pc = vm->slots[in->x] == pos ? in->y : pc + 1;   /* no progress: leave the loop */
            continue;
        case RX_SUBEND: case RX_MATCH:
            /* restore registers saved above base, then drop the choice points */
            while (vm->sp > base) {
                rx_frame f = vm->stack[--vm->sp];
                if (f.pc < 0) vm->slots[-f.pc - 1] = f.pos;
            }
            return pos;
        }
    fail:
        for (;;) {
            /* out of choices, out of memory, or out of budget: the attempt fails */
            if (vm->sp == base || vm->oom || vm->budget < 0) {
                while (vm->sp > base) {
                    rx_frame f = vm->stack[--vm->sp];
                    if (f.pc < 0) vm->slots[-f.pc - 1] = f.pos;
                }
                return -1;
            }
            rx_frame f = vm->stack[--vm->sp];
            if (f.pc < 0) { vm->slots[-f.pc - 1] = f.pos; continue; }
            vm->budget--;
            vm->steps++;
            pc = f.pc; pos = f.pos;
            break;
        }
    }
}

/* Leftmost match at or after `from`: returns 1 and [*ms, *me), or 0. */
static int rx_search(const rx_prog *p, rx_vm *vm, int from, int *ms, int *me) {
    if (vm->n_slots < p->n_slots) {
        int *ns = realloc(vm->slots, (size_t)p->n_slots * sizeof *ns);
        if (!ns) { vm->oom = 1; return 0; }
        for (int i = vm->n_slots; i < p->n_slots; i++) ns[i] = -1;
        vm->slots = ns; vm->n_slots = p->n_slots;
    }
    for (int s = from; s <= vm->n; s++) {
        /* cheap reject: a program that starts by consuming one class or char */
        const rx_inst *in0 = &p->code[0];
        if (s < vm->n) {
            if (in0->op == RX_CLASS && !rx_class_has(&p->cls[in0->x], vm->cp[s], vm->props[s])) continue;
            if (in0->op == RX_CHAR && vm->cp[s] != (uint32_t)in0->x) continue;
        } else if (in0->op == RX_CLASS || in0->op == RX_CHAR) break;
        if (vm->total <= 0) return 0;                /* the call's total is spent */
        /* an attempt fails on the backtrack after its budget: budget + 1 steps */
        vm->budget = vm->total <= RX_BACKTRACK_LIMIT ? (long)vm->total - 1 : RX_BACKTRACK_LIMIT;
        long long before = vm->steps;
        int e = rx_run(p, vm, 0, s, 0);
        vm->total -= vm->steps - before;
        if (vm->oom) return 0;
        if (e >= 0) { *ms = s; *me = e; return 1; }
    }
    return 0;
}

/* ---- 3c. The tokenizer -------------------------------------------------- */

typedef struct tokenizer tokenizer;

/* One pre-tokenizer step of tokenizer.json ("Sequence"s are flattened). */
enum { PT_SPLIT, PT_DIGITS, PT_BYTELEVEL };
enum { SPLIT_ISOLATED, SPLIT_REMOVED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };

typedef struct {
    int       kind;
    int       behavior, invert;      /* PT_SPLIT, PT_DIGITS                    */
    int       is_regex;              /* PT_SPLIT: regex (rx) or string (lit)   */
    rx_prog   rx;                    /* also ByteLevel's GPT-2 regex           */
    uint32_t *lit; int n_lit;
    int       individual_digits;     /* PT_DIGITS                              */
    int       add_prefix_space, use_regex;   /* PT_BYTELEVEL                   */
} pretok_step;

/* A merge rule: the pair (a, b) of ids becomes id, with priority rank. */
typedef struct { uint32_t a, b; int32_t rank, id; } bpe_merge;

/* Byte trie of added-token contents; token = the id a content stands for. */
typedef struct { int32_t child, sibling, token; uint8_t byte; } trie_node;

/* Per-id flags.  An added token's lstrip / rstrip / single_word are those of
 * the last added_tokens entry that got its id, as HF looks them up by id. */
/* TOKF_BYTELEVEL: a model-vocab entry made only of byte-map characters (what
 * ignore_merges may look a whole word up in). */
enum { TOKF_EXISTS = 1, TOKF_SPECIAL = 2, TOKF_ADDED = 4, TOKF_BYTELEVEL = 8,
       TOKF_LSTRIP = 16, TOKF_RSTRIP = 32, TOKF_SINGLE_WORD = 64 };

#define TOK_MAX_STEPS 16
#define TOK_MAX_ID    (1 << 24)

struct tokenizer {
    arena       mem;                 /* everything below lives here            */
    int         n_ids;               /* max id + 1                             */
    int         max_piece;           /* bytes of the longest token             */
    uint32_t   *piece_off;           /* id -> bytes [off[id], off[id+1])       */
    char       *piece_bytes;
    uint8_t    *piece_flags;         /* TOKF_*                                 */
    int32_t     byte_id[256];        /* id of each byte's byte-level symbol    */
    bpe_merge  *merges;              /* open-addressing table by (a, b)        */
    uint32_t    merge_mask;
    int         ignore_merges, unk_id, fuse_unk;
    int32_t    *words;               /* ignore_merges: raw bytes -> id table   */
    uint32_t    word_mask;
    trie_node  *trie[2]; int n_trie[2];   /* [0] normalized=false, matched first */
    pretok_step steps[TOK_MAX_STEPS]; int n_steps;
    int         bos_id, eos_id;
    const char *bos_text;            /* what the chat template writes as BOS   */
    const char *eos_text;            /* ... and as EOS (DeepSeek-V2's formats) */
    int         chat_format;         /* CM384_CHAT_*, or CM384_E_NOT_FOUND (no
                                        template), CM384_E_UNSUPPORTED (unknown) */
    uint64_t    chat_template_hash;  /* of the canonical text, for messages    */
    const char *pre_name;            /* llama.cpp's name for the pre-tokenizer
                                        ("deepseek-v3", "deepseek-llm") or NULL */
    const char *chat_template;       /* the template text as the model ships it
                                        (tokenizer_config.json or the GGUF's
                                        tokenizer.chat_template), or NULL     */
};

/* GPT-2's byte map: printable Latin-1 bytes stand for themselves; the other
 * 68 (controls, space, DEL, NBSP, soft hyphen...) move to U+0100.. in byte
 * order, so that every byte is a visible character in vocab strings. */
static uint32_t bytelevel_cp(int b) {
    if (b <= 32) return 256u + (uint32_t)b;
    if (b >= 127 && b <= 160) return (uint32_t)b + 162u;
    if (b == 173) return 323u;
    return (uint32_t)b;
}

static int bytelevel_byte(uint32_t cp) {   /* inverse of bytelevel_cp, -1 if none */
    if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255)) return (int)cp;
    if (cp >= 256 && cp <= 288) return (int)cp - 256;
    if (cp >= 289 && cp <= 322) return (int)cp - 162;
    if (cp == 323) return 173;
    return -1;
}

/* The ByteLevel decoder's rule for one token string: if every character is
 * in the byte map, the bytes it stands for; otherwise the string's own UTF-8
 * (added tokens such as "<｜User｜>").  Writes to out (may be NULL) and
 * returns the length; *mapped tells which rule applied. */
static size_t bytelevel_decode(const char *s, size_t n, char *out, int *mapped) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)utf8_decode((const uint8_t *)s + i, n - i, &cp);
        int b = cp < TOK_BAD_BYTE ? bytelevel_byte(cp) : -1;
        if (b < 0) {
            if (out) memcpy(out, s, n);
            *mapped = 0;
            return n;
        }
        if (out) out[k] = (char)b;
        k++;
    }
    *mapped = 1;
    return k;
}

static uint64_t tok_hash(const void *p, size_t n) {   /* FNV-1a */
    const uint8_t *s = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint32_t pair_slot(uint32_t a, uint32_t b, uint32_t mask) {
    uint64_t key = ((uint64_t)a << 32) | b;
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

static const bpe_merge *bpe_find(const tokenizer *t, int32_t a, int32_t b) {
    if (!t->merges) return NULL;
    uint32_t h = pair_slot((uint32_t)a, (uint32_t)b, t->merge_mask);
    for (;;) {
        const bpe_merge *m = &t->merges[h];
        if (m->a == UINT32_MAX) return NULL;
        if (m->a == (uint32_t)a && m->b == (uint32_t)b) return m;
        h = (h + 1) & t->merge_mask;
    }
}

/* ignore_merges: the id of a byte-level token whose bytes are exactly s[0..n). */
static int32_t word_find(const tokenizer *t, const uint8_t *s, size_t n) {
    if (!t->words) return -1;
    uint32_t h = (uint32_t)tok_hash(s, n) & t->word_mask;
    for (;;) {
        int32_t id = t->words[h];
        if (id < 0) return -1;
        uint32_t len = t->piece_off[id + 1] - t->piece_off[id];
        if (len == n && memcmp(t->piece_bytes + t->piece_off[id], s, n) == 0) return id;
        h = (h + 1) & t->word_mask;
    }
}

/* ---- loading ---- */

/* Load-time state: the parsed JSON and a table from vocab strings (as they
 * appear in tokenizer.json) to ids, freed when loading ends. */
typedef struct {
    tokenizer  *t;
    const char *path;
    arena       tmp;
    const char **str; int *len;      /* vocab id -> its string, NULL if none */
    int32_t    *vtab; uint32_t vmask;   /* vocab string -> id                */
    const char **text; int *text_len;   /* any id -> its text (added wins)   */
    const json *added;                  /* the added_tokens array            */
    int32_t    *aid, *afirst;           /* added token i: its id; the first
                                           entry with the same content       */
} tok_loader;

static int vocab_find(const tok_loader *L, const char *s, size_t n) {
    uint32_t h = (uint32_t)tok_hash(s, n) & L->vmask;
    for (;;) {
        int32_t id = L->vtab[h];
        if (id < 0) return -1;
        if ((size_t)L->len[id] == n && memcmp(L->str[id], s, n) == 0) return id;
        h = (h + 1) & L->vmask;
    }
}

static uint32_t pow2_at_least(size_t n) {
    uint32_t p = 16;
    while (p < n && p < (1u << 30)) p <<= 1;
    return p;
}

static int json_int_id(const json *v, int *id) {
    if (!v || v->type != JSON_NUMBER || !(v->num >= 0) || v->num >= TOK_MAX_ID || v->num != (double)(int)v->num)
        return -1;
    *id = (int)v->num;
    return 0;
}

static int json_flag(const json *obj, const char *key, int dflt) {
    const json *v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return dflt;
    if (v->type == JSON_TRUE) return 1;
    if (v->type == JSON_FALSE) return 0;
    return -1;
}

/* HF ignores the ids written in added_tokens and numbers them itself, as
 * AddedVocabulary::add_tokens does: a content already in the vocab (or added
 * before) keeps that id; a new one gets the next id after the vocab and after
 * the added tokens so far.  Real files agree with this; odd ones are read the
 * way HF reads them. */
static int added_id(tok_loader *L, const json *added, int i, int vocab_size, int *max_added,
                    int32_t *atab, uint32_t amask) {
    const json *c = json_get(&added->kids[i], "content");
    uint32_t h = (uint32_t)tok_hash(c->str, (size_t)c->len) & amask;
    for (; atab[h] >= 0; h = (h + 1) & amask) {
        const json *o = json_get(&added->kids[atab[h]], "content");
        if (o->len == c->len && memcmp(o->str, c->str, (size_t)c->len) == 0) {
            L->afirst[i] = atab[h];
            return L->aid[atab[h]];
        }
    }
    atab[h] = i;
    L->afirst[i] = i;
    int id = vocab_find(L, c->str, (size_t)c->len);
    if (id < 0) id = *max_added < 0 ? vocab_size : *max_added >= vocab_size ? *max_added + 1 : vocab_size;
    if (id > *max_added) *max_added = id;
    return id;
}

static int load_vocab(tok_loader *L, const json *model, const json *added) {
    tokenizer *t = L->t;
    const json *vocab = json_get(model, "vocab");
    if (!vocab || vocab->type != JSON_OBJECT)
        return fail(CM384_E_FORMAT, "%s: model.vocab is missing or not an object", L->path);
    int max_id = -1;
    for (int i = 0; i < vocab->len; i++) {
        int id;
        if (json_int_id(&vocab->kids[i], &id))
            return fail(CM384_E_FORMAT, "%s: model.vocab entry %d (\"%.40s\") has no valid id",
                        L->path, i, vocab->kids[i].key);
        if (id > max_id) max_id = id;
    }
    if (added && added->type != JSON_ARRAY && added->type != JSON_NULL)
        return fail(CM384_E_FORMAT, "%s: added_tokens is not an array", L->path);
    int n_added = added && added->type == JSON_ARRAY ? added->len : 0;
    for (int i = 0; i < n_added; i++) {
        const json *a = &added->kids[i];
        const json *content = json_get(a, "content");
        int id;
        if (a->type != JSON_OBJECT || json_int_id(json_get(a, "id"), &id) ||
            !content || content->type != JSON_STRING || content->len == 0)
            return fail(CM384_E_FORMAT, "%s: added_tokens[%d] needs an id and a non-empty content", L->path, i);
    }
    if (max_id < 0 && n_added == 0) return fail(CM384_E_FORMAT, "%s: the vocab is empty", L->path);

    /* ids can reach max(max_id + 1, vocab size) + n_added */
    size_t bound = (size_t)(max_id + 1 > vocab->len ? max_id + 1 : vocab->len) + (size_t)n_added;
    L->str = calloc(bound, sizeof *L->str);
    L->len = calloc(bound, sizeof *L->len);
    L->text = calloc(bound, sizeof *L->text);
    L->text_len = calloc(bound, sizeof *L->text_len);
    L->vmask = pow2_at_least((size_t)vocab->len * 2) - 1;
    L->vtab = malloc(((size_t)L->vmask + 1) * sizeof *L->vtab);
    uint32_t amask = pow2_at_least((size_t)n_added * 2) - 1;
    int32_t *atab = malloc(((size_t)amask + 1) * sizeof *atab);
    L->added = added;
    L->aid = malloc(((size_t)n_added + 1) * sizeof *L->aid);
    L->afirst = malloc(((size_t)n_added + 1) * sizeof *L->afirst);
    if (!L->str || !L->len || !L->text || !L->text_len || !L->vtab || !atab || !L->aid || !L->afirst) {
        free(atab);
        return fail(CM384_E_NOMEM, "%s: out of memory for the vocab", L->path);
    }
    memset(L->vtab, 0xff, ((size_t)L->vmask + 1) * sizeof *L->vtab);
    memset(atab, 0xff, ((size_t)amask + 1) * sizeof *atab);

    for (int i = 0; i < vocab->len; i++) {
        const json *v = &vocab->kids[i];
        int id = (int)v->num;
        if (L->str[id]) {
            free(atab);
            return fail(CM384_E_FORMAT, "%s: model.vocab gives id %d to \"%.40s\" and \"%.40s\"",
                        L->path, id, L->str[id], v->key);
        }
        L->str[id] = L->text[id] = v->key;
        L->len[id] = L->text_len[id] = v->key_len;
        uint32_t h = (uint32_t)tok_hash(v->key, (size_t)v->key_len) & L->vmask;
        while (L->vtab[h] >= 0) {
            int o = L->vtab[h];
            if (L->len[o] == v->key_len && memcmp(L->str[o], v->key, (size_t)v->key_len) == 0) {
                free(atab);
                return fail(CM384_E_FORMAT, "%s: model.vocab has \"%.40s\" twice", L->path, v->key);
            }
            h = (h + 1) & L->vmask;
        }
        L->vtab[h] = id;
    }
    int max_added = -1;
    for (int i = 0; i < n_added; i++) L->aid[i] = added_id(L, added, i, vocab->len, &max_added, atab, amask);
    free(atab);
    t->n_ids = (max_id > max_added ? max_id : max_added) + 1;

    size_t n = (size_t)t->n_ids;
    t->piece_flags = arena_alloc(&t->mem, n);
    t->piece_off = arena_alloc(&t->mem, (n + 1) * sizeof *t->piece_off);
    if (!t->piece_flags || !t->piece_off) return fail(CM384_E_NOMEM, "%s: out of memory", L->path);
    memset(t->piece_flags, 0, n);
    for (int i = 0; i < vocab->len; i++) t->piece_flags[(int)vocab->kids[i].num] = TOKF_EXISTS;

    /* added tokens: their content is their text; they win over the vocab */
    for (int i = 0; i < n_added; i++) {
        const json *a = &added->kids[i];
        const json *content = json_get(a, "content");
        int id = L->aid[i];
        int special = json_flag(a, "special", 0);
        int lstrip = json_flag(a, "lstrip", 0), rstrip = json_flag(a, "rstrip", 0);
        int single = json_flag(a, "single_word", 0);
        int normalized = json_flag(a, "normalized", !special);
        if (special < 0 || lstrip < 0 || rstrip < 0 || single < 0 || normalized < 0)
            return fail(CM384_E_FORMAT, "%s: added_tokens[%d] has a flag that is not true/false", L->path, i);
        L->text[id] = content->str; L->text_len[id] = content->len;
        t->piece_flags[id] = (uint8_t)(TOKF_EXISTS | TOKF_ADDED | (special ? TOKF_SPECIAL : 0) |
                                       (lstrip ? TOKF_LSTRIP : 0) | (rstrip ? TOKF_RSTRIP : 0) |
                                       (single ? TOKF_SINGLE_WORD : 0));
    }

    /* pieces: the bytes each id decodes to */
    size_t total = 0;
    for (size_t id = 0; id < n; id++) {
        int mapped;
        if (L->text[id]) total += bytelevel_decode(L->text[id], (size_t)L->text_len[id], NULL, &mapped);
    }
    if (total > UINT32_MAX - 1) return fail(CM384_E_FORMAT, "%s: vocab too large", L->path);
    t->piece_bytes = arena_alloc(&t->mem, total + 1);
    if (!t->piece_bytes) return fail(CM384_E_NOMEM, "%s: out of memory", L->path);
    uint32_t off = 0;
    for (size_t id = 0; id < n; id++) {
        t->piece_off[id] = off;
        if (!L->text[id]) continue;
        int mapped;
        size_t k = bytelevel_decode(L->text[id], (size_t)L->text_len[id], t->piece_bytes + off, &mapped);
        if (k > (size_t)t->max_piece) t->max_piece = k > INT_MAX / 4 ? INT_MAX / 4 : (int)k;
        off += (uint32_t)k;
        if (mapped && L->str[id]) t->piece_flags[id] |= TOKF_BYTELEVEL;   /* a model-vocab string */
    }
    t->piece_off[n] = off;
    return CM384_OK;
}

/* Splits a merges entry, "a b" or ["a", "b"], into its two strings. */
static int merge_parts(const json *m, const char **a, size_t *na, const char **b, size_t *nb) {
    if (m->type == JSON_ARRAY) {
        if (m->len != 2 || m->kids[0].type != JSON_STRING || m->kids[1].type != JSON_STRING) return -1;
        *a = m->kids[0].str; *na = (size_t)m->kids[0].len;
        *b = m->kids[1].str; *nb = (size_t)m->kids[1].len;
        return 0;
    }
    if (m->type != JSON_STRING) return -1;
    const char *sp = memchr(m->str, ' ', (size_t)m->len);
    if (!sp || memchr(sp + 1, ' ', (size_t)(m->str + m->len - sp - 1))) return -1;   /* exactly one space */
    *a = m->str; *na = (size_t)(sp - m->str);
    *b = sp + 1; *nb = (size_t)(m->str + m->len - sp - 1);
    return 0;
}

static int load_merges(tok_loader *L, const json *model) {
    tokenizer *t = L->t;
    const json *merges = json_get(model, "merges");
    if (merges && merges->type == JSON_NULL) merges = NULL;
    if (merges && merges->type != JSON_ARRAY)
        return fail(CM384_E_FORMAT, "%s: model.merges is not an array", L->path);
    int nm = merges ? merges->len : 0;
    t->merge_mask = pow2_at_least((size_t)nm * 2) - 1;
    t->merges = arena_alloc(&t->mem, ((size_t)t->merge_mask + 1) * sizeof *t->merges);
    if (!t->merges) return fail(CM384_E_NOMEM, "%s: out of memory for merges", L->path);
    memset(t->merges, 0xff, ((size_t)t->merge_mask + 1) * sizeof *t->merges);
    char *cat = NULL;
    size_t cat_cap = 0;
    for (int k = 0; k < nm; k++) {
        const char *a, *b;
        size_t na, nb;
        if (merge_parts(&merges->kids[k], &a, &na, &b, &nb)) {
            free(cat);
            return fail(CM384_E_FORMAT, "%s: model.merges[%d] is not \"a b\" or [\"a\", \"b\"]", L->path, k);
        }
        int ia = vocab_find(L, a, na), ib = vocab_find(L, b, nb);
        if (na + nb > cat_cap) {
            cat_cap = (na + nb) * 2 + 64;
            char *nc = realloc(cat, cat_cap);
            if (!nc) { free(cat); return fail(CM384_E_NOMEM, "%s: out of memory", L->path); }
            cat = nc;
        }
        memcpy(cat, a, na);
        memcpy(cat + na, b, nb);
        int ic = vocab_find(L, cat, na + nb);
        if (ia < 0 || ib < 0 || ic < 0) {
            const char *which = ia < 0 ? a : ib < 0 ? b : cat;
            int wl = (int)(ia < 0 ? na : ib < 0 ? nb : na + nb);
            int r = fail(CM384_E_FORMAT, "%s: model.merges[%d]: token \"%.*s\" is not in the vocab",
                         L->path, k, wl > 60 ? 60 : wl, which);
            free(cat);
            return r;
        }
        /* a repeated pair keeps the later rank, as HF's HashMap does */
        uint32_t h = pair_slot((uint32_t)ia, (uint32_t)ib, t->merge_mask);
        while (t->merges[h].a != UINT32_MAX && !(t->merges[h].a == (uint32_t)ia && t->merges[h].b == (uint32_t)ib))
            h = (h + 1) & t->merge_mask;
        t->merges[h].a = (uint32_t)ia; t->merges[h].b = (uint32_t)ib;
        t->merges[h].rank = k; t->merges[h].id = ic;
    }
    free(cat);
    return CM384_OK;
}

static int load_model(tok_loader *L, const json *root) {
    tokenizer *t = L->t;
    const json *model = json_get(root, "model");
    if (!model || model->type != JSON_OBJECT)
        return fail(CM384_E_FORMAT, "%s: no \"model\" object", L->path);
    const char *type = json_str(model, "type", NULL);
    if (type && strcmp(type, "BPE"))
        return fail(CM384_E_UNSUPPORTED, "%s: model type \"%s\" is not supported (only BPE)", L->path, type);
    const char *cont = json_str(model, "continuing_subword_prefix", NULL);
    const char *suffix = json_str(model, "end_of_word_suffix", NULL);
    if ((cont && cont[0]) || (suffix && suffix[0]))
        return fail(CM384_E_UNSUPPORTED, "%s: BPE with a subword prefix or suffix is not supported", L->path);
    int r = load_vocab(L, model, json_get(root, "added_tokens"));
    if (r) return r;
    if ((r = load_merges(L, model))) return r;
    for (int b = 0; b < 256; b++) {
        char u[4];
        int k = utf8_put(u, bytelevel_cp(b));
        t->byte_id[b] = vocab_find(L, u, (size_t)k);
    }
    t->ignore_merges = json_flag(model, "ignore_merges", 0) == 1;
    t->fuse_unk = json_flag(model, "fuse_unk", 0) == 1;
    const char *unk = json_str(model, "unk_token", NULL);
    t->unk_id = unk ? vocab_find(L, unk, strlen(unk)) : -1;
    if (t->ignore_merges) {
        t->word_mask = pow2_at_least((size_t)t->n_ids * 2) - 1;
        t->words = arena_alloc(&t->mem, ((size_t)t->word_mask + 1) * sizeof *t->words);
        if (!t->words) return fail(CM384_E_NOMEM, "%s: out of memory", L->path);
        memset(t->words, 0xff, ((size_t)t->word_mask + 1) * sizeof *t->words);
        for (int id = 0; id < t->n_ids; id++) {
            if (!(t->piece_flags[id] & TOKF_BYTELEVEL)) continue;
            const uint8_t *s = (const uint8_t *)t->piece_bytes + t->piece_off[id];
            size_t n = t->piece_off[id + 1] - t->piece_off[id];
            if (word_find(t, s, n) >= 0) continue;
            uint32_t h = (uint32_t)tok_hash(s, n) & t->word_mask;
            while (t->words[h] >= 0) h = (h + 1) & t->word_mask;
            t->words[h] = id;
        }
    }
    return CM384_OK;
}

static int trie_add(tokenizer *t, int which, const char *s, size_t n, int token, int cap) {
    trie_node *nodes = t->trie[which];
    int cur = 0;
    for (size_t i = 0; i < n; i++) {
        int c = nodes[cur].child;
        while (c >= 0 && nodes[c].byte != (uint8_t)s[i]) c = nodes[c].sibling;
        if (c < 0) {
            if (t->n_trie[which] >= cap) return -1;
            c = t->n_trie[which]++;
            nodes[c].byte = (uint8_t)s[i]; nodes[c].child = -1; nodes[c].token = -1;
            nodes[c].sibling = nodes[cur].child;
            nodes[cur].child = c;
        }
        cur = c;
    }
    nodes[cur].token = token;   /* a repeated content: the later entry wins */
    return 0;
}

/* Which contents go into which trie follows HF's AddedVocabulary: the first
 * special entry of each content, then every entry whose content has no
 * special entry at all; each into the trie of its own normalized flag. */
static int load_added_tries(tok_loader *L) {
    tokenizer *t = L->t;
    const json *added = L->added;
    int n = added && added->type == JSON_ARRAY ? added->len : 0;
    size_t cap = 1;
    for (int i = 0; i < n; i++) cap += (size_t)json_get(&added->kids[i], "content")->len;
    if (cap > INT_MAX) return fail(CM384_E_FORMAT, "%s: added tokens too long", L->path);
    for (int w = 0; w < 2; w++) {
        t->trie[w] = arena_alloc(&t->mem, cap * sizeof(trie_node));
        if (!t->trie[w]) return fail(CM384_E_NOMEM, "%s: out of memory", L->path);
        t->trie[w][0].child = -1; t->trie[w][0].sibling = -1; t->trie[w][0].token = -1;
        t->n_trie[w] = 1;
    }
    uint8_t *has_special = calloc((size_t)n + 1, 1), *placed = calloc((size_t)n + 1, 1);
    if (!has_special || !placed) { free(has_special); free(placed); return fail(CM384_E_NOMEM, "%s: out of memory", L->path); }
    for (int i = 0; i < n; i++)
        if (json_flag(&added->kids[i], "special", 0) == 1) has_special[L->afirst[i]] = 1;
    int r = CM384_OK;
    for (int pass = 0; pass < 2 && !r; pass++)
        for (int i = 0; i < n && !r; i++) {
            const json *a = &added->kids[i];
            int special = json_flag(a, "special", 0) == 1;
            int normalized = json_flag(a, "normalized", !special) == 1;
            if (pass == 0 ? !special || placed[L->afirst[i]] : has_special[L->afirst[i]]) continue;
            placed[L->afirst[i]] = 1;
            const json *content = json_get(a, "content");
            if (trie_add(t, normalized, content->str, (size_t)content->len, L->aid[i], (int)cap))
                r = fail(CM384_E_INTERNAL, "%s: added-token trie overflow", L->path);
        }
    free(has_special);
    free(placed);
    return r;
}

static int check_normalizer(tok_loader *L, const json *nz) {
    if (!nz || nz->type == JSON_NULL) return CM384_OK;
    const char *type = json_str(nz, "type", NULL);
    const json *list = json_get(nz, "normalizers");
    if (type && !strcmp(type, "Sequence") && list && list->type == JSON_ARRAY) {
        for (int i = 0; i < list->len; i++) {
            int r = check_normalizer(L, &list->kids[i]);
            if (r) return r;
        }
        return CM384_OK;
    }
    /* DeepSeek's tokenizers have none; a real one would change the ids */
    return fail(CM384_E_UNSUPPORTED, "%s: normalizer \"%s\" is not supported", L->path, type ? type : "?");
}

static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int add_pretok(tok_loader *L, const json *pt, int depth) {
    tokenizer *t = L->t;
    if (!pt || pt->type == JSON_NULL) return CM384_OK;
    const char *type = json_str(pt, "type", NULL);
    if (!type) return fail(CM384_E_FORMAT, "%s: pre_tokenizer without a type", L->path);
    if (!strcmp(type, "Sequence")) {
        const json *list = json_get(pt, "pretokenizers");
        if (!list || list->type != JSON_ARRAY || depth > 8)
            return fail(CM384_E_FORMAT, "%s: pre_tokenizer Sequence without a pretokenizers list", L->path);
        for (int i = 0; i < list->len; i++) {
            int r = add_pretok(L, &list->kids[i], depth + 1);
            if (r) return r;
        }
        return CM384_OK;
    }
    if (t->n_steps == TOK_MAX_STEPS) return fail(CM384_E_UNSUPPORTED, "%s: too many pre-tokenizers", L->path);
    if (t->n_steps > 0 && t->steps[t->n_steps - 1].kind == PT_BYTELEVEL)
        return fail(CM384_E_UNSUPPORTED, "%s: pre-tokenizers after ByteLevel are not supported", L->path);
    pretok_step *st = &t->steps[t->n_steps];
    memset(st, 0, sizeof *st);
    const char *err = NULL;
    if (!strcmp(type, "Split")) {
        static const char *behaviors[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        const char *beh = json_str(pt, "behavior", NULL);
        st->kind = PT_SPLIT;
        st->behavior = -1;
        for (int i = 0; beh && i < 5; i++) if (!strcmp(beh, behaviors[i])) st->behavior = i;
        st->invert = json_flag(pt, "invert", 0);
        const json *pat = json_get(pt, "pattern");
        const json *rx = json_get(pat, "Regex"), *lit = json_get(pat, "String");
        if (st->behavior < 0 || st->invert < 0 || !((rx && rx->type == JSON_STRING) || (lit && lit->type == JSON_STRING)))
            return fail(CM384_E_FORMAT, "%s: Split pre-tokenizer needs a pattern {Regex|String}, a behavior and invert", L->path);
        if (rx && rx->type == JSON_STRING) {
            st->is_regex = 1;
            int r = rx_compile(rx->str, (size_t)rx->len, &t->mem, &st->rx, &err);
            if (r) return fail(r, "%s: Split regex \"%.60s\": %s", L->path, rx->str, err);
        } else {
            st->lit = arena_alloc(&t->mem, ((size_t)lit->len + 1) * sizeof *st->lit);
            if (!st->lit) return fail(CM384_E_NOMEM, "%s: out of memory", L->path);
            for (int i = 0; i < lit->len;) {
                uint32_t cp;
                i += utf8_decode((const uint8_t *)lit->str + i, (size_t)(lit->len - i), &cp);
                st->lit[st->n_lit++] = cp;
            }
        }
    } else if (!strcmp(type, "ByteLevel")) {
        st->kind = PT_BYTELEVEL;
        st->add_prefix_space = json_flag(pt, "add_prefix_space", 1);
        st->use_regex = json_flag(pt, "use_regex", 1);
        if (st->add_prefix_space < 0 || st->use_regex < 0)
            return fail(CM384_E_FORMAT, "%s: ByteLevel flags must be true/false", L->path);
        if (st->use_regex) {
            int r = rx_compile(gpt2_pattern, sizeof gpt2_pattern - 1, &t->mem, &st->rx, &err);
            if (r) return fail(r, "%s: GPT-2 regex: %s", L->path, err);
        }
    } else if (!strcmp(type, "Digits")) {
        st->kind = PT_DIGITS;
        st->individual_digits = json_flag(pt, "individual_digits", 0) == 1;
        st->behavior = st->individual_digits ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS;
    } else {
        return fail(CM384_E_UNSUPPORTED, "%s: pre-tokenizer \"%s\" is not supported", L->path, type);
    }
    t->n_steps++;
    return CM384_OK;
}

static int check_decoder(tok_loader *L, const json *d) {
    if (!d || d->type == JSON_NULL) return CM384_OK;   /* treated as ByteLevel */
    const char *type = json_str(d, "type", NULL);
    if (type && !strcmp(type, "ByteLevel")) return CM384_OK;
    const json *list = json_get(d, "decoders");
    if (type && !strcmp(type, "Sequence") && list && list->type == JSON_ARRAY) {
        for (int i = 0; i < list->len; i++) {
            int r = check_decoder(L, &list->kids[i]);
            if (r) return r;
        }
        return CM384_OK;
    }
    return fail(CM384_E_UNSUPPORTED, "%s: decoder \"%s\" is not supported (only ByteLevel)", L->path, type ? type : "?");
}

/* bos_token / eos_token of tokenizer_config.json: "text" or {"content": "text"}. */
static const char *config_token_text(const json *cfg, const char *key, int *len) {
    const json *v = json_get(cfg, key);
    if (v && v->type == JSON_OBJECT) v = json_get(v, "content");
    if (!v || v->type != JSON_STRING) return NULL;
    *len = v->len;
    return v->str;
}

static int token_id_of_text(const tok_loader *L, const char *s, int n) {
    int n_added = L->added && L->added->type == JSON_ARRAY ? L->added->len : 0;
    for (int i = 0; i < n_added; i++) {
        const json *c = json_get(&L->added->kids[i], "content");
        if (c->len == n && memcmp(c->str, s, (size_t)n) == 0) return L->aid[i];
    }
    return vocab_find(L, s, (size_t)n);
}

static void tokenizer_set_chat_template(tokenizer *t, const char *tpl, size_t len);

/* The chat template text, wherever it came from (tokenizer_config.json's
 * chat_template, a GGUF's tokenizer.chat_template): kept with the tokenizer
 * (a GGUF export writes it back), and the chat format recognised from it. */
static int tokenizer_keep_template(tokenizer *t, const char *tpl, size_t len, const char *path) {
    char *copy = arena_strndup(&t->mem, tpl, len);
    if (!copy) return fail(CM384_E_NOMEM, "%s: out of memory", path);
    t->chat_template = copy;
    tokenizer_set_chat_template(t, copy, len);
    return CM384_OK;
}

static int load_config(tok_loader *L, const char *config_path) {
    tokenizer *t = L->t;
    t->bos_id = t->eos_id = -1;
    t->bos_text = t->eos_text = "";
    t->chat_format = CM384_E_NOT_FOUND;
    if (!config_path || !file_exists(config_path)) return CM384_OK;
    json cfg;
    int r = json_load_file(config_path, &L->tmp, &cfg);
    if (r) return r;
    if (cfg.type != JSON_OBJECT) return fail(CM384_E_FORMAT, "%s: not a JSON object", config_path);
    int n;
    const char *s = config_token_text(&cfg, "bos_token", &n);
    if (s) {
        t->bos_id = token_id_of_text(L, s, n);
        char *copy = arena_strndup(&t->mem, s, (size_t)n);
        if (!copy) return fail(CM384_E_NOMEM, "%s: out of memory", config_path);
        t->bos_text = copy;
    }
    if ((s = config_token_text(&cfg, "eos_token", &n))) {
        t->eos_id = token_id_of_text(L, s, n);
        char *copy = arena_strndup(&t->mem, s, (size_t)n);
        if (!copy) return fail(CM384_E_NOMEM, "%s: out of memory", config_path);
        t->eos_text = copy;
    }
    /* chat_template: a string, or a list of {name, template} */
    const json *ct = json_get(&cfg, "chat_template");
    const json *tpl = NULL;
    if (ct && ct->type == JSON_STRING) tpl = ct;
    else if (ct && ct->type == JSON_ARRAY) {
        for (int i = 0; i < ct->len; i++) {
            const char *name = json_str(&ct->kids[i], "name", NULL);
            const json *text = json_get(&ct->kids[i], "template");
            if (text && text->type == JSON_STRING && (!tpl || (name && !strcmp(name, "default")))) tpl = text;
        }
    }
    return tpl ? tokenizer_keep_template(t, tpl->str, (size_t)tpl->len, config_path) : CM384_OK;
}

static void tokenizer_free(tokenizer *t) {
    if (!t) return;
    arena_free(&t->mem);
    free(t);
}

/* The two pre-tokenizers DeepSeek's GGUF files name, as their tokenizer.json
 * files spell them ("deepseek-v3": V3, R1 and their family; "deepseek-llm":
 * DeepSeek-LLM, V2, V2-Lite). */
static const char gguf_pre_deepseek_v3[] =
    "{\"type\":\"Sequence\",\"pretokenizers\":["
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}{1,3}\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[一-龥぀-ゟ゠-ヿ]+\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[!\\\"#$%&'()*+,\\\\-./:;<=>?@\\\\[\\\\\\\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\\r\\n\\\\p{L}\\\\p{P}\\\\p{S}]?[\\\\p{L}\\\\p{M}]+| ?[\\\\p{P}\\\\p{S}]+[\\r\\n]*|\\\\s*[\\r\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
    "\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}";
static const char gguf_pre_deepseek_llm[] =
    "{\"type\":\"Sequence\",\"pretokenizers\":["
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[\\r\\n]\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s?[!-/:-~！-／：-～‘-‟　-。]+\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+$\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[一-龥ࠀ-一가-퟿]+\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}+\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}";

/* Two JSON values equal as data (object members in any order). */
static int json_equal(const json *a, const json *b) {
    if (!a || !b || a->type != b->type || a->len != b->len) return 0;
    switch (a->type) {
    case JSON_NUMBER: return a->num == b->num;
    case JSON_STRING: return !memcmp(a->str, b->str, (size_t)a->len);
    case JSON_ARRAY:
        for (int i = 0; i < a->len; i++) if (!json_equal(&a->kids[i], &b->kids[i])) return 0;
        return 1;
    case JSON_OBJECT:
        for (int i = 0; i < a->len; i++) {
            const json *o = NULL;
            for (int j = 0; j < b->len && !o; j++)
                if (b->kids[j].key_len == a->kids[i].key_len && !memcmp(b->kids[j].key, a->kids[i].key, (size_t)a->kids[i].key_len))
                    o = &b->kids[j];
            if (!json_equal(&a->kids[i], o)) return 0;
        }
        return 1;
    default: return 1;
    }
}


/* llama.cpp's name for this pre-tokenizer, if it is one of DeepSeek's (what
 * a GGUF export writes as tokenizer.ggml.pre). */
static int tokenizer_pre_name(tok_loader *L, const json *pt) {
    static const struct { const char *name, *text; } known[] = {
        {"deepseek-v3", gguf_pre_deepseek_v3}, {"deepseek-llm", gguf_pre_deepseek_llm}};
    for (size_t i = 0; pt && i < sizeof known / sizeof known[0]; i++) {
        json k;
        if (json_parse(known[i].text, strlen(known[i].text), &L->tmp, &k, "built-in pre-tokenizer"))
            return fail(CM384_E_INTERNAL, "built-in pre-tokenizer %s does not parse", known[i].name);
        if (json_equal(pt, &k)) { L->t->pre_name = known[i].name; break; }
    }
    return CM384_OK;
}

/* Builds L->t from a parsed tokenizer.json tree. */
static int tokenizer_build(tok_loader *L, const json *root) {
    int r = CM384_OK;
    if (root->type != JSON_OBJECT) r = fail(CM384_E_FORMAT, "%s: not a JSON object", L->path);
    if (!r) r = load_model(L, root);
    if (!r) r = load_added_tries(L);
    if (!r) r = check_normalizer(L, json_get(root, "normalizer"));
    if (!r) r = add_pretok(L, json_get(root, "pre_tokenizer"), 0);
    if (!r && (L->t->n_steps == 0 || L->t->steps[L->t->n_steps - 1].kind != PT_BYTELEVEL))
        r = fail(CM384_E_UNSUPPORTED, "%s: the pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)", L->path);
    if (!r) r = check_decoder(L, json_get(root, "decoder"));
    if (!r) r = tokenizer_pre_name(L, json_get(root, "pre_tokenizer"));
    return r;
}

static void tok_loader_free(tok_loader *L) {
    free(L->str); free(L->len); free(L->text); free(L->text_len); free(L->vtab); free(L->aid); free(L->afirst);
    arena_free(&L->tmp);
}

static int tokenizer_load(tokenizer **out, const char *tokenizer_json_path, const char *tokenizer_config_path) {
    if (!out || !tokenizer_json_path) return fail(CM384_E_INVALID, "tokenizer_load: NULL argument");
    *out = NULL;
    tok_loader L;
    memset(&L, 0, sizeof L);
    L.path = tokenizer_json_path;
    L.t = calloc(1, sizeof *L.t);
    if (!L.t) return fail(CM384_E_NOMEM, "%s: out of memory", L.path);
    json root;
    int r = json_load_file(L.path, &L.tmp, &root);
    if (!r) r = tokenizer_build(&L, &root);
    if (!r) r = load_config(&L, tokenizer_config_path);
    tok_loader_free(&L);
    if (r) { tokenizer_free(L.t); return r; }
    *out = L.t;
    return CM384_OK;
}

static int tokenizer_n_ids(const tokenizer *t) { return t ? t->n_ids : 0; }
static int tokenizer_bos(const tokenizer *t) { return t ? t->bos_id : -1; }
static int tokenizer_eos(const tokenizer *t) { return t ? t->eos_id : -1; }

/* Room that always suffices for one detok_stream_push(): a cut code point
 * (3 bytes of U+FFFD) plus the longest token, every byte of it possibly an
 * invalid byte (3 bytes each).  DeepSeek-V3's longest token is 128 spaces,
 * so 64 bytes are not always enough there. */
static int tokenizer_max_piece(const tokenizer *t) { return t ? t->max_piece : 0; }
static size_t tokenizer_stream_cap(const tokenizer *t) { return 3 + 3 * (size_t)tokenizer_max_piece(t); }

static int tokenizer_is_special(const tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_ids && (t->piece_flags[id] & TOKF_SPECIAL);
}

static int tokenizer_piece(const tokenizer *t, int32_t id, const char **bytes, int *len) {
    if (!t || !bytes || !len) return fail(CM384_E_INVALID, "tokenizer_piece: NULL argument");
    if (id < 0 || id >= t->n_ids) return fail(CM384_E_INVALID, "token id %d out of range [0, %d)", (int)id, t->n_ids);
    *bytes = t->piece_bytes + t->piece_off[id];   /* an id with no token: empty, as HF skips it */
    *len = (int)(t->piece_off[id + 1] - t->piece_off[id]);
    return CM384_OK;
}

/* ---- 3d. Encoding ------------------------------------------------------- */

typedef struct { int s, e, prefix; } tok_span;  /* code points [s, e); prefix: ByteLevel put a space before */
typedef struct { int s, e, match; } tok_seg;    /* one piece of a split, matched by the pattern or not     */
typedef struct { int32_t rank, pos; } bpe_cand; /* a pair that could merge: rank, left symbol              */

typedef struct { uint64_t hash; uint32_t key_off, key_len, ids_off, ids_len; } bpe_cache_ent;
#define BPE_CACHE_SLOTS 4096   /* power of two                    */
#define BPE_CACHE_WORD  48     /* longer pieces are not cached    */

/* Everything one encode call needs; freed when it returns. */
typedef struct {
    const tokenizer *t;
    int32_t  *out;  int cap;  size_t count;
    int       no_special;
    uint32_t *cp;   uint8_t *props;  uint32_t *off;   /* decoded stretch; off: byte offsets */
    size_t    cp_cap, props_cap, off_cap;
    uint32_t *tcp;  uint8_t *tprops;  size_t tcp_cap, tprops_cap;   /* ByteLevel's prefixed copy */
    tok_span *sp[2]; size_t sp_n[2], sp_cap[2];
    tok_seg  *seg;  size_t seg_n, seg_cap;
    rx_vm     vm;
    int32_t  *sym, *prev, *next; size_t sym_cap, prev_cap, next_cap;
    bpe_cand *heap; size_t heap_cap;
    uint8_t  *word; size_t word_cap;
    /* Words repeat, so each call keeps a small direct-mapped cache of BPE
     * results (HF keeps one in the tokenizer; ours stays per call so the
     * tokenizer is never written to). */
    bpe_cache_ent *cache;       /* made after the first 32 words of a call */
    int       n_words;
    uint8_t  *ckeys; size_t ckeys_n, ckeys_cap;
    int32_t  *cids;  size_t cids_n, cids_cap;
    int       status;
} tok_enc;

/* Grows a scratch array to hold `need` elements.  On failure the old block
 * is kept (and freed later) and e->status says why. */
static void *enc_grow(tok_enc *e, void *p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap || e->status) return p;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *np = nc <= SIZE_MAX / elem ? realloc(p, nc * elem) : NULL;
    if (!np) { e->status = CM384_E_NOMEM; return p; }
    *cap = nc;
    return np;
}
#define ENC_GROW(e, arr, cap, need) ((arr) = enc_grow((e), (arr), &(cap), (need), sizeof *(arr)), (e)->status == 0)

static void enc_emit(tok_enc *e, int32_t id) {
    if (e->count < (size_t)e->cap) e->out[e->count] = id;
    e->count++;
}

static int cand_less(bpe_cand a, bpe_cand b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void heap_push(bpe_cand *h, int *n, bpe_cand c) {
    int i = (*n)++;
    while (i > 0 && cand_less(c, h[(i - 1) / 2])) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = c;
}

static bpe_cand heap_pop(bpe_cand *h, int *n) {
    bpe_cand top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c])) c++;
        if (!cand_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

/* BPE on one word: w[0..n) become byte-level symbols; the pair with the
 * lowest merge rank (leftmost on ties) merges until none can, exactly the
 * order of HF's priority queue.  The result is left in e->sym[0..count). */
static int bpe_merge_word(tok_enc *e, const uint8_t *w, size_t n) {
    const tokenizer *t = e->t;
    if (!ENC_GROW(e, e->sym, e->sym_cap, n) || !ENC_GROW(e, e->prev, e->prev_cap, n) ||
        !ENC_GROW(e, e->next, e->next_cap, n) || !ENC_GROW(e, e->heap, e->heap_cap, 3 * n))
        return 0;
    int32_t *sym = e->sym, *prv = e->prev, *nxt = e->next;
    int m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) {   /* no symbol for this byte: unk, or dropped as HF does */
            if (t->unk_id < 0 || (t->fuse_unk && m > 0 && sym[m - 1] == t->unk_id)) continue;
            id = t->unk_id;
        }
        sym[m++] = id;
    }
    if (m <= 1) return m;
    int nh = 0;
    for (int i = 0; i < m; i++) {
        prv[i] = i - 1;
        nxt[i] = i + 1 < m ? i + 1 : -1;
        if (i + 1 < m) {
            const bpe_merge *mg = bpe_find(t, sym[i], sym[i + 1]);
            if (mg) heap_push(e->heap, &nh, (bpe_cand){mg->rank, i});
        }
    }
    while (nh > 0) {
        bpe_cand c = heap_pop(e->heap, &nh);
        int i = c.pos, j;
        if (sym[i] < 0 || (j = nxt[i]) < 0) continue;          /* merged away */
        const bpe_merge *mg = bpe_find(t, sym[i], sym[j]);
        if (!mg || mg->rank != c.rank) continue;                 /* stale       */
        sym[i] = mg->id;
        sym[j] = -1;
        nxt[i] = nxt[j];
        if (nxt[j] >= 0) prv[nxt[j]] = i;
        if (prv[i] >= 0 && (mg = bpe_find(t, sym[prv[i]], sym[i])))
            heap_push(e->heap, &nh, (bpe_cand){mg->rank, prv[i]});
        if (nxt[i] >= 0 && (mg = bpe_find(t, sym[i], sym[nxt[i]])))
            heap_push(e->heap, &nh, (bpe_cand){mg->rank, i});
    }
    int k = 0;   /* the survivors, in order (the first symbol always survives) */
    for (int i = 0; i >= 0; i = nxt[i]) sym[k++] = sym[i];
    return k;
}

/* Encodes one piece: its bytes, after a space when ByteLevel's
 * add_prefix_space put one there. */
static void enc_bpe(tok_enc *e, const uint8_t *s, size_t n, int prefix) {
    const tokenizer *t = e->t;
    size_t total = n + (prefix ? 1 : 0);
    if (total == 0) return;
    if (total > INT_MAX / 4) { e->status = CM384_E_CAPACITY; return; }
    const uint8_t *w = s;
    if (prefix) {
        if (!ENC_GROW(e, e->word, e->word_cap, total)) return;
        e->word[0] = ' ';
        memcpy(e->word + 1, s, n);
        w = e->word;
    }
    if (t->ignore_merges) {   /* a piece that is a whole token skips the merges */
        int32_t id = word_find(t, w, total);
        if (id >= 0) { enc_emit(e, id); return; }
    }
    bpe_cache_ent *ce = NULL;
    uint64_t h = 0;
    if (total <= BPE_CACHE_WORD && ++e->n_words > 32) {
        if (!e->cache && !(e->cache = calloc(BPE_CACHE_SLOTS, sizeof *e->cache))) { e->status = CM384_E_NOMEM; return; }
        h = tok_hash(w, total) | 1;   /* never 0: 0 marks an empty slot */
        ce = &e->cache[h & (BPE_CACHE_SLOTS - 1)];
        if (ce->hash == h && ce->key_len == total && memcmp(e->ckeys + ce->key_off, w, total) == 0) {
            for (uint32_t i = 0; i < ce->ids_len; i++) enc_emit(e, e->cids[ce->ids_off + i]);
            return;
        }
    }
    int k = bpe_merge_word(e, w, total);
    for (int i = 0; i < k; i++) enc_emit(e, e->sym[i]);
    if (ce && k > 0 && ENC_GROW(e, e->ckeys, e->ckeys_cap, e->ckeys_n + total) &&
        ENC_GROW(e, e->cids, e->cids_cap, e->cids_n + (size_t)k)) {
        memcpy(e->ckeys + e->ckeys_n, w, total);
        memcpy(e->cids + e->cids_n, e->sym, (size_t)k * sizeof *e->cids);
        ce->hash = h;
        ce->key_off = (uint32_t)e->ckeys_n; ce->key_len = (uint32_t)total;
        ce->ids_off = (uint32_t)e->cids_n; ce->ids_len = (uint32_t)k;
        e->ckeys_n += total;
        e->cids_n += (size_t)k;
    }
}

static void seg_push(tok_enc *e, int s, int en, int match) {
    if (!ENC_GROW(e, e->seg, e->seg_cap, e->seg_n + 1)) return;
    e->seg[e->seg_n].s = s; e->seg[e->seg_n].e = en; e->seg[e->seg_n].match = match;
    e->seg_n++;
}

/* Regex matches over cp[0..n) as segments, the way HF iterates Oniguruma's
 * matches (an empty match right after the previous match is skipped). */
static void segs_regex(tok_enc *e, const rx_prog *rx, const uint32_t *cp, const uint8_t *props, int n) {
    e->vm.cp = cp; e->vm.props = props; e->vm.n = n;
    int pos = 0, prev = 0, last_end = -1, ms, me;
    while (pos <= n && rx_search(rx, &e->vm, pos, &ms, &me)) {
        if (ms == me && me == last_end) { pos = me + 1; continue; }
        if (prev < ms) seg_push(e, prev, ms, 0);
        seg_push(e, ms, me, 1);
        prev = last_end = pos = me;
    }
    if (e->vm.oom) e->status = CM384_E_NOMEM;
    if (prev < n) seg_push(e, prev, n, 0);
}

static void segs_literal(tok_enc *e, const pretok_step *st, const uint32_t *cp, int n) {
    int prev = 0;
    if (st->n_lit > 0)
        for (int i = 0; i + st->n_lit <= n;) {
            if (memcmp(cp + i, st->lit, (size_t)st->n_lit * sizeof *cp) == 0) {
                if (prev < i) seg_push(e, prev, i, 0);
                seg_push(e, i, i + st->n_lit, 1);
                i = prev = i + st->n_lit;
            } else i++;
        }
    if (prev < n) seg_push(e, prev, n, 0);
}

/* Digits: every numeric character (Rust's char::is_numeric) is a match. */
static void segs_digits(tok_enc *e, const uint8_t *props, int n) {
    int prev = 0;
    for (int i = 0; i < n; i++)
        if ((UMASK_N >> (props[i] & 31)) & 1) {
            if (prev < i) seg_push(e, prev, i, 0);
            seg_push(e, i, i + 1, 1);
            prev = i + 1;
        }
    if (prev < n) seg_push(e, prev, n, 0);
}

static void span_push(tok_enc *e, int dst, int s, int en, int prefix) {
    if (!ENC_GROW(e, e->sp[dst], e->sp_cap[dst], e->sp_n[dst] + 1)) return;
    tok_span *p = &e->sp[dst][e->sp_n[dst]++];
    p->s = s; p->e = en; p->prefix = prefix;
}

/* Turns the segments of one span into pieces per the Split behavior (HF's
 * SplitDelimiterBehavior), shifted by base, empty pieces dropped. */
static void segs_to_spans(tok_enc *e, int dst, int behavior, int invert, int base) {
    size_t first = e->sp_n[dst];
    int prev_match = 0;
    tok_span *sp;
    if (behavior == SPLIT_MERGED_NEXT) {   /* HF folds from the right, then reverses */
        for (size_t k = e->seg_n; k-- > 0;) {
            tok_seg g = e->seg[k];
            int m = g.match ^ invert;
            if (m && !prev_match && e->sp_n[dst] > first) e->sp[dst][e->sp_n[dst] - 1].s = base + g.s;
            else span_push(e, dst, base + g.s, base + g.e, 0);
            prev_match = m;
        }
        if (e->status) return;
        sp = e->sp[dst];
        for (size_t a = first, b = e->sp_n[dst]; a + 1 < b; a++, b--) {
            tok_span tmp = sp[a]; sp[a] = sp[b - 1]; sp[b - 1] = tmp;
        }
    } else {
        for (size_t k = 0; k < e->seg_n; k++) {
            tok_seg g = e->seg[k];
            int m = g.match ^ invert;
            int has_last = e->sp_n[dst] > first;
            switch (behavior) {
            case SPLIT_ISOLATED: span_push(e, dst, base + g.s, base + g.e, 0); break;
            case SPLIT_REMOVED: if (!m) span_push(e, dst, base + g.s, base + g.e, 0); break;
            case SPLIT_MERGED_PREV:
                if (m && !prev_match && has_last) e->sp[dst][e->sp_n[dst] - 1].e = base + g.e;
                else span_push(e, dst, base + g.s, base + g.e, 0);
                break;
            case SPLIT_CONTIGUOUS:
                if (m == prev_match && has_last) e->sp[dst][e->sp_n[dst] - 1].e = base + g.e;
                else span_push(e, dst, base + g.s, base + g.e, 0);
                break;
            }
            prev_match = m;
        }
        if (e->status) return;
    }
    /* drop empty pieces */
    sp = e->sp[dst];
    size_t w = first;
    for (size_t k = first; k < e->sp_n[dst]; k++) if (sp[k].e > sp[k].s) sp[w++] = sp[k];
    e->sp_n[dst] = w;
}

/* ByteLevel: the optional prefix space, then (use_regex) GPT-2's split. */
static void bytelevel_span(tok_enc *e, const pretok_step *st, int dst, tok_span in) {
    int n = in.e - in.s;
    int prefix = st->add_prefix_space && !(n > 0 && e->cp[in.s] == ' ');
    if (!st->use_regex) { span_push(e, dst, in.s, in.e, prefix); return; }
    e->seg_n = 0;
    if (!prefix) {
        segs_regex(e, &st->rx, e->cp + in.s, e->props + in.s, n);
        if (!e->status) segs_to_spans(e, dst, SPLIT_ISOLATED, 0, in.s);
        return;
    }
    /* the regex must see the space: match on a copy with it prepended */
    if (!ENC_GROW(e, e->tcp, e->tcp_cap, (size_t)n + 1) || !ENC_GROW(e, e->tprops, e->tprops_cap, (size_t)n + 1))
        return;
    e->tcp[0] = ' ';
    e->tprops[0] = unicode_latin1[' '];
    memcpy(e->tcp + 1, e->cp + in.s, (size_t)n * sizeof *e->tcp);
    memcpy(e->tprops + 1, e->props + in.s, (size_t)n);
    segs_regex(e, &st->rx, e->tcp, e->tprops, n + 1);
    for (size_t k = 0; k < e->seg_n && !e->status; k++) {
        tok_seg g = e->seg[k];
        if (g.e == g.s) continue;
        if (g.s == 0) span_push(e, dst, in.s, in.s + g.e - 1, 1);
        else span_push(e, dst, in.s + g.s - 1, in.s + g.e - 1, 0);
    }
}

/* Pre-tokenizes and BPE-encodes a stretch of text that holds no added token. */
static void enc_stretch(tok_enc *e, const uint8_t *text, size_t len) {
    const tokenizer *t = e->t;
    if (len > INT_MAX / 2) { e->status = CM384_E_CAPACITY; return; }
    if (!ENC_GROW(e, e->cp, e->cp_cap, len + 1) || !ENC_GROW(e, e->props, e->props_cap, len + 1) ||
        !ENC_GROW(e, e->off, e->off_cap, len + 1))
        return;
    int n = 0;
    for (size_t i = 0; i < len; n++) {
        uint32_t c;
        int k = utf8_decode(text + i, len - i, &c);
        e->cp[n] = c;
        e->props[n] = c >= TOK_BAD_BYTE ? (uint8_t)UCAT_Cn : unicode_props(c);
        e->off[n] = (uint32_t)i;
        i += (size_t)k;
    }
    e->off[n] = (uint32_t)len;
    int cur = 0;
    e->sp_n[0] = 0;
    span_push(e, 0, 0, n, 0);
    for (int k = 0; k < t->n_steps && !e->status; k++) {
        const pretok_step *st = &t->steps[k];
        int dst = cur ^ 1;
        e->sp_n[dst] = 0;
        for (size_t i = 0; i < e->sp_n[cur] && !e->status; i++) {
            tok_span in = e->sp[cur][i];
            if (st->kind == PT_BYTELEVEL) { bytelevel_span(e, st, dst, in); continue; }
            e->seg_n = 0;
            if (st->kind == PT_DIGITS) segs_digits(e, e->props + in.s, in.e - in.s);
            else if (st->is_regex) segs_regex(e, &st->rx, e->cp + in.s, e->props + in.s, in.e - in.s);
            else segs_literal(e, st, e->cp + in.s, in.e - in.s);
            if (!e->status) segs_to_spans(e, dst, st->behavior, st->invert, in.s);
        }
        cur = dst;
    }
    for (size_t i = 0; i < e->sp_n[cur] && !e->status; i++) {
        tok_span p = e->sp[cur][i];
        enc_bpe(e, text + e->off[p.s], e->off[p.e] - e->off[p.s], p.prefix);
    }
}

/* Longest added token of trie w at text[i..len): its id, end in *end. */
static int trie_longest(const tokenizer *t, int w, const uint8_t *text, size_t i, size_t len, size_t *end) {
    const trie_node *nodes = t->trie[w];
    int cur = 0, best = -1;
    for (size_t k = i; k < len; k++) {
        int c = nodes[cur].child;
        while (c >= 0 && nodes[c].byte != text[k]) c = nodes[c].sibling;
        if (c < 0) break;
        cur = c;
        if (nodes[cur].token >= 0) { best = nodes[cur].token; *end = k + 1; }
    }
    return best;
}

/* The code point that ends at text[pos] (pos > 0); its start in *start. */
static uint32_t utf8_before(const uint8_t *text, size_t pos, size_t *start) {
    size_t s = pos - 1;
    while (s > 0 && pos - s < 4 && (text[s] & 0xC0) == 0x80) s--;
    uint32_t cp;
    if ((size_t)utf8_decode(text + s, pos - s, &cp) != pos - s) { s = pos - 1; cp = TOK_BAD_BYTE + text[s]; }
    *start = s;
    return cp;
}

/* single_word's idea of a word character is Rust regex's \w: Alphabetic,
 * Mark, Decimal_Number, Connector_Punctuation, Join_Control.  Alphabetic is
 * approximated by L, Nl and the circled / squared Latin letters. */
static int is_word_char(uint32_t cp) {
    if (cp >= TOK_BAD_BYTE) return 0;
    if (cp == 0x200C || cp == 0x200D || (cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return 1;
    return ((UMASK_L | UMASK_M | UMASK(UCAT_Nd) | UMASK(UCAT_Nl) | UMASK(UCAT_Pc)) >> unicode_category(cp)) & 1;
}

/* Cuts the added tokens of trie w (0: not normalized, 1: normalized) out of
 * text, leftmost-longest as HF's Aho-Corasick does; the stretches between go
 * to the next trie, then to the pre-tokenizer. */
static void enc_added(tok_enc *e, const uint8_t *text, size_t len, int w) {
    const tokenizer *t = e->t;
    if (w >= 2 || e->no_special) { enc_stretch(e, text, len); return; }
    if (t->n_trie[w] <= 1) { enc_added(e, text, len, w + 1); return; }
    size_t done = 0, i = 0;   /* done: end of the last match */
    while (i < len && !e->status) {
        size_t me = 0, ms = i;
        int id = trie_longest(t, w, text, i, len, &me);
        if (id < 0) { i++; continue; }
        uint8_t fl = t->piece_flags[id];
        i = me;
        if (fl & TOKF_SINGLE_WORD) {
            size_t st;
            uint32_t c;
            if (ms > 0 && is_word_char(utf8_before(text, ms, &st))) continue;
            if (me < len && (utf8_decode(text + me, len - me, &c), is_word_char(c))) continue;
        }
        if (fl & TOKF_LSTRIP) {   /* swallow the white space before, back to the last match */
            size_t st;
            while (ms > done && unicode_is_space(utf8_before(text, ms, &st))) ms = st;
        }
        if (fl & TOKF_RSTRIP) {
            uint32_t c;
            while (me < len) {
                int n = utf8_decode(text + me, len - me, &c);
                if (!unicode_is_space(c)) break;
                me += (size_t)n;
            }
            i = me;
        }
        if (done < ms) enc_added(e, text + done, ms - done, w + 1);
        enc_emit(e, id);
        done = me;
    }
    if (done < len && !e->status) enc_added(e, text + done, len - done, w + 1);
}

static int tokenizer_encode(const tokenizer *t, const char *text, size_t len, int32_t *out, int cap, unsigned flags) {
    if (!t || (!text && len) || cap < 0 || (!out && cap > 0))
        return fail(CM384_E_INVALID, "tokenize: bad argument");
    tok_enc e;
    memset(&e, 0, sizeof e);
    e.t = t; e.out = out; e.cap = cap;
    e.no_special = (flags & CM384_TOK_NO_SPECIAL) != 0;
    e.vm.total = RX_BACKTRACK_LIMIT + (long long)RX_BACKTRACKS_PER_BYTE * (long long)len;
    if ((flags & CM384_TOK_ADD_BOS) && t->bos_id >= 0) enc_emit(&e, t->bos_id);
    if (len) enc_added(&e, (const uint8_t *)text, len, 0);
    free(e.cp); free(e.props); free(e.off); free(e.tcp); free(e.tprops);
    free(e.sp[0]); free(e.sp[1]); free(e.seg);
    free(e.vm.stack); free(e.vm.slots);
    free(e.sym); free(e.prev); free(e.next); free(e.heap); free(e.word);
    free(e.cache); free(e.ckeys); free(e.cids);
    if (e.status == CM384_E_NOMEM) return fail(CM384_E_NOMEM, "tokenize: out of memory (%zu bytes of text)", len);
    if (e.status) return fail(e.status, "tokenize: text too long (%zu bytes)", len);
    if (e.count > INT_MAX) return fail(CM384_E_CAPACITY, "tokenize: more than INT_MAX tokens");
    return (int)e.count;
}

/* ---- 3e. Decoding ------------------------------------------------------- */

static int tokenizer_decode(const tokenizer *t, const int32_t *ids, int n, char *out, size_t cap) {
    if (!t || n < 0 || (n > 0 && !ids) || (!out && cap > 0)) return fail(CM384_E_INVALID, "detokenize: bad argument");
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_ids)
            return fail(CM384_E_INVALID, "detokenize: token id %d at position %d out of range [0, %d)",
                        (int)ids[i], i, t->n_ids);
    tok_sink k = {out, cap ? cap - 1 : 0, 0};
    uint8_t pend[4];
    int np = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *p = (const uint8_t *)t->piece_bytes + t->piece_off[ids[i]];
        const uint8_t *end = (const uint8_t *)t->piece_bytes + t->piece_off[ids[i] + 1];
        for (; p < end; p++) utf8_lossy_byte(&k, pend, &np, *p);
    }
    if (np) sink_put(&k, utf8_fffd, 3);
    if (cap) out[k.n < cap - 1 ? k.n : cap - 1] = 0;
    if (k.n > INT_MAX) return fail(CM384_E_CAPACITY, "detokenize: text longer than INT_MAX");
    return (int)k.n;
}

/* Streaming: the struct keeps the incomplete tail of a code point (at most
 * 3 bytes).  Working on a copy of it lets a call that runs out of room
 * return CM384_E_CAPACITY with the stream unchanged. */
static int detok_stream_push(const tokenizer *t, cm384_detok_stream *s, int32_t id, char *out, size_t cap) {
    if (!t || !s || (!out && cap > 0)) return fail(CM384_E_INVALID, "detok_stream_push: bad argument");
    if (id < 0 || id >= t->n_ids) return fail(CM384_E_INVALID, "token id %d out of range [0, %d)", (int)id, t->n_ids);
    if (s->n_pending < 0 || s->n_pending > 3) return fail(CM384_E_INVALID, "detok stream not initialized");
    uint8_t pend[4];
    int np = s->n_pending;
    memcpy(pend, s->pending, (size_t)np);
    tok_sink k = {out, cap, 0};
    const uint8_t *p = (const uint8_t *)t->piece_bytes + t->piece_off[id];
    const uint8_t *end = (const uint8_t *)t->piece_bytes + t->piece_off[id + 1];
    for (; p < end; p++) utf8_lossy_byte(&k, pend, &np, *p);
    if (k.n > cap)
        return fail(CM384_E_CAPACITY, "detok_stream_push: token %d needs %zu bytes, have %zu (%zu always suffice)",
                    (int)id, k.n, cap, tokenizer_stream_cap(t));
    memcpy(s->pending, pend, (size_t)np);
    s->n_pending = np;
    return (int)k.n;
}

static int detok_stream_flush(cm384_detok_stream *s, char *out, size_t cap) {
    if (!s || (!out && cap > 0)) return fail(CM384_E_INVALID, "detok_stream_flush: bad argument");
    if (s->n_pending <= 0) { s->n_pending = 0; return 0; }
    if (cap < 3) return fail(CM384_E_CAPACITY, "detok_stream_flush: needs 3 bytes");
    memcpy(out, utf8_fffd, 3);
    s->n_pending = 0;
    return 3;
}

/* ---- 3f. Chat format ---------------------------------------------------- */
/* DeepSeek's chat templates (the Jinja text in tokenizer_config.json, or a
 * GGUF's tokenizer.chat_template), reproduced in C -- no Jinja engine.  The
 * model's template is recognised by its text, never guessed: it is brought to
 * a canonical form (what a Jinja parser would see -- whitespace inside tags,
 * the spelling of string escapes, "-" trims and layout-only blank runs
 * between tags do not matter, everything else does), hashed, and looked up
 * among the templates DeepSeek shipped.  An unknown template makes
 * cm384_chat_render() fail and name the hash; the caller may then choose a
 * format explicitly with cm384_chat_render_format().
 *
 * The formats, in the templates' own terms (BOS and EOS are the
 * tokenizer_config's bos_token and eos_token text):
 *   deepseek-v2      (V2-Chat, V2-Lite-Chat, deepseek-llm-chat): BOS, then per
 *                    message, in order: system content + "\n\n"; "User: " +
 *                    content + "\n\n"; "Assistant: " + content + EOS; other
 *                    roles skipped.  Generation prompt "Assistant:".
 *   deepseek-v2-0628 (V2-Chat-0628): the same with "<｜User｜>" + content and
 *                    "<｜Assistant｜>" + content + EOS.
 *   deepseek-v2.5    (V2.5, Coder-V2): BOS + the LAST system message's
 *                    content, then the turns as in V3 below.
 *   deepseek-v3      BOS + every system content joined by "\n\n", then:
 *                    user "<｜User｜>" + content; assistant with content
 *                    "<｜Assistant｜>" + content + "<｜end▁of▁sentence｜>", or
 *                    right after tool outputs "<｜tool▁outputs▁end｜>" +
 *                    content + EOS; assistant without content (tool calls):
 *                    the first call of the whole conversation opens
 *                    "<｜Assistant｜><｜tool▁calls▁begin｜>", later calls
 *                    start with "\n" and are each followed by
 *                    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>" (ns.is_first
 *                    is never reset, so a lone call never closes); tool: the
 *                    first output opens "<｜tool▁outputs▁begin｜>", later ones
 *                    start with "\n"; after the loop "<｜tool▁outputs▁end｜>"
 *                    if the last turn was a tool output, else "<｜Assistant｜>"
 *                    for a generation prompt.  An assistant message with
 *                    content takes the content branch: its tool calls are not
 *                    written.
 *   deepseek-r1      V2.5's turns, but an assistant's content in history
 *                    keeps only what follows its last "</think>", and the
 *                    generation prompt is "<｜Assistant｜><think>\n".
 * Content NULL is allowed only for an assistant in the tool-call formats (the
 * templates fail on "a" + none).  Goldens: tests/fixtures/chat. */

static void sink_str(tok_sink *k, const char *s) { sink_put(k, s, strlen(s)); }

typedef struct { char *p; size_t n, cap; int oom; } chat_buf;

static void cbuf_put(chat_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int is_word(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* The canonical form of a Jinja template: text outside tags as is (minus
 * what "-" trims remove, and dropping runs made only of blanks); inside
 * {{ }} and {% %} no whitespace (one space between two words), string
 * literals decoded and written back single-quoted; comments dropped.
 * Returns a malloc'd string (NULL when out of memory). */
static char *chat_template_canonical(const char *t, size_t n) {
    chat_buf b = {0};
    cbuf_put(&b, "", 0);
    size_t i = 0, text_start = 0;   /* start of the pending text run in b */
    int trim_next = 0;
    while (i < n && !b.oom) {
        if (i + 1 < n && t[i] == '{' && (t[i + 1] == '{' || t[i + 1] == '%' || t[i + 1] == '#')) {
            char open = t[i + 1], close = open == '{' ? '}' : open;
            size_t j = i + 2;
            int lstrip = j < n && t[j] == '-';
            if (lstrip) j++;
            /* the pending text: left-trimmed by "-", dropped when blank */
            size_t e = b.n;
            if (lstrip) while (e > text_start && is_blank(b.p[e - 1])) e--;
            int blank = 1;
            for (size_t q = text_start; q < e; q++) if (!is_blank(b.p[q])) blank = 0;
            b.n = blank ? text_start : e;
            b.p[b.n] = 0;
            if (open != '#') { char o[3] = {'{', open, 0}; cbuf_put(&b, o, 2); }
            int rtrim = 0;
            char prev = 0;
            while (j < n) {
                if (t[j] == '-' && j + 2 < n && t[j + 1] == close && t[j + 2] == '}') { rtrim = 1; j++; continue; }
                if (j + 1 < n && t[j] == close && t[j + 1] == '}') break;
                if (open == '#') { j++; continue; }
                if (is_blank(t[j])) {
                    while (j < n && is_blank(t[j])) j++;
                    if (j < n && is_word(prev) && is_word(t[j])) { cbuf_put(&b, " ", 1); prev = ' '; }
                    continue;
                }
                if (t[j] == '\'' || t[j] == '"') {
                    char q = t[j++];
                    cbuf_put(&b, "'", 1);
                    while (j < n && t[j] != q) {
                        char c = t[j++];
                        if (c == '\\' && j < n) {
                            c = t[j++];
                            c = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
                        }
                        if (c == '\'' || c == '\\') cbuf_put(&b, "\\", 1);
                        cbuf_put(&b, &c, 1);
                    }
                    j++;
                    cbuf_put(&b, "'", 1);
                    prev = '\'';
                    continue;
                }
                cbuf_put(&b, &t[j], 1);
                prev = t[j++];
            }
            if (open != '#') { char c2[3] = {close, '}', 0}; cbuf_put(&b, c2, 2); }
            i = j + 2;
            trim_next = rtrim;
            text_start = b.n;
            continue;
        }
        if (trim_next && is_blank(t[i])) { i++; continue; }
        trim_next = 0;
        cbuf_put(&b, &t[i], 1);
        i++;
    }
    /* trailing text */
    int blank = 1;
    for (size_t q = text_start; q < b.n; q++) if (!is_blank(b.p[q])) blank = 0;
    if (blank && b.p) { b.n = text_start; b.p[b.n] = 0; }
    if (b.oom) { free(b.p); return NULL; }
    return b.p;
}

static uint64_t fnv1a64(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) { h ^= (uint8_t)s[i]; h *= 0x100000001b3ull; }
    return h;
}

/* The templates DeepSeek shipped, by the hash of their canonical form (the
 * texts are in tests/fixtures/chat, with where each came from). */
static const struct { uint64_t hash; int format; const char *what; } chat_known[] = {
    {0x5b1c0db29d067ebcull, CM384_CHAT_DEEPSEEK_V2, "DeepSeek-V2-Chat / V2-Lite-Chat"},
    {0x674501398298734full, CM384_CHAT_DEEPSEEK_V2_0628, "DeepSeek-V2-Chat-0628"},
    {0xb044f4b4a7efcb93ull, CM384_CHAT_DEEPSEEK_V25, "DeepSeek-V2.5"},
    {0xa14973c6592b3d06ull, CM384_CHAT_DEEPSEEK_V3, "DeepSeek-V3"},
    {0x3d7301c202fd853bull, CM384_CHAT_DEEPSEEK_R1, "DeepSeek-R1"},
};

static const char *chat_format_name(int format) {
    switch (format) {
    case CM384_CHAT_DEEPSEEK_V2:      return "deepseek-v2";
    case CM384_CHAT_DEEPSEEK_V2_0628: return "deepseek-v2-0628";
    case CM384_CHAT_DEEPSEEK_V25:     return "deepseek-v2.5";
    case CM384_CHAT_DEEPSEEK_V3:      return "deepseek-v3";
    case CM384_CHAT_DEEPSEEK_R1:      return "deepseek-r1";
    default:                          return NULL;
    }
}

/* The format a template's text is, CM384_E_UNSUPPORTED if none (*hash gets
 * the canonical hash), CM384_E_NOMEM. */
static int chat_template_format(const char *tpl, size_t len, uint64_t *hash) {
    char *c = chat_template_canonical(tpl, len);
    if (!c) return CM384_E_NOMEM;
    uint64_t h = fnv1a64(c, strlen(c));
    free(c);
    if (hash) *hash = h;
    for (size_t i = 0; i < sizeof chat_known / sizeof chat_known[0]; i++)
        if (chat_known[i].hash == h) return chat_known[i].format;
    return CM384_E_UNSUPPORTED;
}

/* The template that came with the tokenizer (tokenizer_config.json or a
 * GGUF's tokenizer.chat_template). */
static void tokenizer_set_chat_template(tokenizer *t, const char *tpl, size_t len) {
    t->chat_format = chat_template_format(tpl, len, &t->chat_template_hash);
}

static void chat_tool_call(tok_sink *k, const cm384_tool_call *tc) {
    sink_str(k, tc->type ? tc->type : "function");
    sink_str(k, "<｜tool▁sep｜>");
    sink_str(k, tc->name);
    sink_str(k, "\n```json\n");
    sink_str(k, tc->arguments);
    sink_str(k, "\n```<｜tool▁call▁end｜>");
}

/* deepseek-v2 and -0628: one pass, each message in place. */
static void chat_render_v2(const tokenizer *t, int format, const cm384_chat_msg *msgs, int n, unsigned flags, tok_sink *k) {
    int v0628 = format == CM384_CHAT_DEEPSEEK_V2_0628;
    sink_str(k, t->bos_text);
    for (int i = 0; i < n; i++) {
        const cm384_chat_msg *m = &msgs[i];
        if (!strcmp(m->role, "user")) {
            sink_str(k, v0628 ? "<｜User｜>" : "User: ");
            sink_str(k, m->content);
            if (!v0628) sink_str(k, "\n\n");
        } else if (!strcmp(m->role, "assistant")) {
            sink_str(k, v0628 ? "<｜Assistant｜>" : "Assistant: ");
            sink_str(k, m->content);
            sink_str(k, t->eos_text);
        } else if (!strcmp(m->role, "system")) {
            sink_str(k, m->content);
            sink_str(k, "\n\n");
        }
    }
    if (flags & CM384_CHAT_ADD_GENERATION_PROMPT) sink_str(k, v0628 ? "<｜Assistant｜>" : "Assistant:");
}

/* deepseek-v2.5, -v3 and -r1. */
static void chat_render_tools(const tokenizer *t, int format, const cm384_chat_msg *msgs, int n, unsigned flags, tok_sink *k) {
    sink_str(k, t->bos_text);
    if (format == CM384_CHAT_DEEPSEEK_V3) {
        int first_sp = 1;
        for (int i = 0; i < n; i++) {
            if (strcmp(msgs[i].role, "system")) continue;
            if (!first_sp) sink_str(k, "\n\n");
            sink_str(k, msgs[i].content);
            first_sp = 0;
        }
    } else {
        const char *sp = "";
        for (int i = 0; i < n; i++)
            if (!strcmp(msgs[i].role, "system")) sp = msgs[i].content;
        sink_str(k, sp);
    }
    int is_first = 0, is_tool = 0, is_output_first = 1;
    for (int i = 0; i < n; i++) {
        const cm384_chat_msg *m = &msgs[i];
        if (!strcmp(m->role, "user")) {
            is_tool = 0;
            sink_str(k, "<｜User｜>");
            sink_str(k, m->content);
        } else if (!strcmp(m->role, "assistant") && !m->content) {
            is_tool = 0;
            for (int j = 0; j < m->n_tool_calls; j++) {
                if (!is_first) {
                    sink_str(k, "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>");
                    chat_tool_call(k, &m->tool_calls[j]);
                    is_first = 1;
                } else {
                    sink_str(k, "\n<｜tool▁call▁begin｜>");
                    chat_tool_call(k, &m->tool_calls[j]);
                    sink_str(k, "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>");
                }
            }
        } else if (!strcmp(m->role, "assistant")) {
            if (is_tool) {
                sink_str(k, "<｜tool▁outputs▁end｜>");
                sink_str(k, m->content);
                sink_str(k, "<｜end▁of▁sentence｜>");
                is_tool = 0;
            } else {
                const char *c = m->content, *th;
                if (format == CM384_CHAT_DEEPSEEK_R1)
                    while ((th = strstr(c, "</think>"))) c = th + 8;
                sink_str(k, "<｜Assistant｜>");
                sink_str(k, c);
                sink_str(k, "<｜end▁of▁sentence｜>");
            }
        } else if (!strcmp(m->role, "tool")) {
            is_tool = 1;
            sink_str(k, is_output_first ? "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" : "\n<｜tool▁output▁begin｜>");
            sink_str(k, m->content);
            sink_str(k, "<｜tool▁output▁end｜>");
            is_output_first = 0;
        }
    }
    if (is_tool) sink_str(k, "<｜tool▁outputs▁end｜>");
    if ((flags & CM384_CHAT_ADD_GENERATION_PROMPT) && !is_tool)
        sink_str(k, format == CM384_CHAT_DEEPSEEK_R1 ? "<｜Assistant｜><think>\n" : "<｜Assistant｜>");
}

/* format CM384_CHAT_MODEL: the one recognised from the tokenizer's template. */
static int chat_render(const tokenizer *t, int format, const cm384_chat_msg *msgs, int n, unsigned flags, char *out, size_t cap) {
    if (!t || n < 0 || (n > 0 && !msgs) || (!out && cap > 0)) return fail(CM384_E_INVALID, "chat_render: bad argument");
    if (format == CM384_CHAT_MODEL) {
        format = t->chat_format;
        if (format == CM384_E_NOT_FOUND)
            return fail(CM384_E_UNSUPPORTED, "chat_render: the model has no chat template (tokenizer_config.json's chat_template); "
                        "choose a format with cm384_chat_render_format()");
        if (format < 0)
            return fail(CM384_E_UNSUPPORTED, "chat_render: the model's chat template is not one cm384 knows (canonical hash "
                        "%016llx; known: DeepSeek-V2, V2-0628, V2.5, V3, R1); choose a format with cm384_chat_render_format()",
                        (unsigned long long)t->chat_template_hash);
    }
    if (!chat_format_name(format)) return fail(CM384_E_INVALID, "chat_render: unknown chat format %d", format);
    int tools = format == CM384_CHAT_DEEPSEEK_V25 || format == CM384_CHAT_DEEPSEEK_V3 || format == CM384_CHAT_DEEPSEEK_R1;
    for (int i = 0; i < n; i++) {
        const cm384_chat_msg *m = &msgs[i];
        if (!m->role) return fail(CM384_E_INVALID, "chat_render: message %d has no role", i);
        if (!m->content && (!tools || !strcmp(m->role, "user") || !strcmp(m->role, "system") || !strcmp(m->role, "tool")))
            return fail(CM384_E_INVALID, "chat_render: message %d (%s) has no content%s", i, m->role,
                        tools ? "" : " (this chat format has no tool calls)");
        if (m->n_tool_calls < 0 || (m->n_tool_calls > 0 && !m->tool_calls))
            return fail(CM384_E_INVALID, "chat_render: message %d has bad tool calls", i);
        for (int j = 0; j < m->n_tool_calls; j++)
            if (!m->tool_calls[j].name || !m->tool_calls[j].arguments)
                return fail(CM384_E_INVALID, "chat_render: message %d tool call %d needs a name and arguments", i, j);
    }
    tok_sink k = {out, cap ? cap - 1 : 0, 0};
    if (tools) chat_render_tools(t, format, msgs, n, flags, &k);
    else chat_render_v2(t, format, msgs, n, flags, &k);
    if (cap) out[k.n < cap - 1 ? k.n : cap - 1] = 0;
    if (k.n > INT_MAX) return fail(CM384_E_CAPACITY, "chat_render: text longer than INT_MAX");
    return (int)k.n;
}

/* ======================================================================== */
/* 4. Checkpoint loading                                                    */
/* ======================================================================== */
/* A model directory is config.json + safetensors shards (+ index) +
 * tokenizer files.  Shards are memory-mapped; every tensor's header entry is
 * checked against the file size and against the shape the config implies
 * before anything is used.  Weights stay in their stored type: a gl_mat points
 * straight into the mapping.  Only small vectors (norm weights, router bias)
 * are converted to fp32, and the absorbed-attention matrix W_uk^T is derived
 * once (see 5.3). */

enum { ARCH_V2 = 2, ARCH_V3 = 3 };
enum { TOPK_GREEDY, TOPK_GROUP_LIMITED, TOPK_NOAUX_TC };
enum { SCORE_SOFTMAX, SCORE_SIGMOID };

/* Hyper-parameters, named as in config.json where a name exists. */
typedef struct hparams {
    int    arch;                 /* ARCH_V2 or ARCH_V3 (reference semantics)       */
    int    vocab, dim;           /* vocab_size, hidden_size                        */
    int    n_layers, n_mtp;      /* num_hidden_layers, num_nextn_predict_layers    */
    int    n_dense;              /* first_k_dense_replace                          */
    int    moe_freq;             /* moe_layer_freq                                 */
    int    inter, moe_inter;     /* intermediate_size, moe_intermediate_size       */
    int    n_heads;
    int    q_lora;               /* q_lora_rank, 0 = plain q_proj                  */
    int    kv_lora, qk_nope, qk_rope, v_head;
    int    n_routed, n_shared, top_k, n_group, topk_group;
    int    topk_method, score_func, norm_topk;
    float  route_scale;          /* routed_scaling_factor                          */
    double rope_theta;
    int    yarn;                 /* rope_scaling type yarn                         */
    double yarn_factor, beta_fast, beta_slow, mscale, mscale_all_dim;
    int    yarn_orig_max;        /* original_max_position_embeddings               */
    int    max_pos;              /* max_position_embeddings                        */
    float  eps;                  /* rms_norm_eps                                   */
    int    tie_emb;
    int    bos, eos;
} hparams;

static int layer_is_moe(const hparams *hp, int l) {
    if (l >= hp->n_layers) return hp->n_routed > 0;       /* MTP layers are MoE in V3 */
    return hp->n_routed > 0 && l >= hp->n_dense && l % hp->moe_freq == 0;
}

/* Reads an integer config field; missing -> dflt; present but not a
 * non-negative integer -> error. */
static int cfg_int(const json *cfg, const char *key, int dflt, int *out, const char *path) {
    const json *v = json_get(cfg, key);
    if (!v || v->type == JSON_NULL) { *out = dflt; return CM384_OK; }
    if (v->type == JSON_ARRAY && v->len > 0) v = &v->kids[0];    /* eos_token_id: [1, ...] */
    if (v->type != JSON_NUMBER || v->num < 0 || v->num > 1e9 || v->num != floor(v->num))
        return fail(CM384_E_FORMAT, "%s: \"%s\" must be a non-negative integer", path, key);
    *out = (int)v->num;
    return CM384_OK;
}

static int cfg_num(const json *cfg, const char *key, double dflt, double *out, const char *path) {
    const json *v = json_get(cfg, key);
    if (!v || v->type == JSON_NULL) { *out = dflt; return CM384_OK; }
    if (v->type != JSON_NUMBER || !isfinite(v->num))
        return fail(CM384_E_FORMAT, "%s: \"%s\" must be a number", path, key);
    *out = v->num;
    return CM384_OK;
}

static int parse_config(const json *cfg, const char *path, hparams *hp) {
    memset(hp, 0, sizeof *hp);
    if (!cfg || cfg->type != JSON_OBJECT) return fail(CM384_E_FORMAT, "%s: not a JSON object", path);
    const char *mt = json_str(cfg, "model_type", NULL);
    if (!mt) return fail(CM384_E_FORMAT, "%s: no \"model_type\"", path);
    if (!strcmp(mt, "deepseek_v3") || !strcmp(mt, "kimi_k2")) hp->arch = ARCH_V3;
    else if (!strcmp(mt, "deepseek_v2")) hp->arch = ARCH_V2;
    else return fail(CM384_E_UNSUPPORTED, "%s: model_type \"%s\" is not supported "
                     "(supported: deepseek_v2, deepseek_v3, kimi_k2)", path, mt);
    const char *act = json_str(cfg, "hidden_act", "silu");
    if (strcmp(act, "silu")) return fail(CM384_E_UNSUPPORTED, "%s: hidden_act \"%s\" (only silu)", path, act);

    int r = 0;
    double d;
    r |= cfg_int(cfg, "vocab_size", 0, &hp->vocab, path);
    r |= cfg_int(cfg, "hidden_size", 0, &hp->dim, path);
    r |= cfg_int(cfg, "num_hidden_layers", 0, &hp->n_layers, path);
    r |= cfg_int(cfg, "num_nextn_predict_layers", 0, &hp->n_mtp, path);
    r |= cfg_int(cfg, "first_k_dense_replace", 0, &hp->n_dense, path);
    r |= cfg_int(cfg, "moe_layer_freq", 1, &hp->moe_freq, path);
    r |= cfg_int(cfg, "intermediate_size", 0, &hp->inter, path);
    r |= cfg_int(cfg, "moe_intermediate_size", 0, &hp->moe_inter, path);
    r |= cfg_int(cfg, "num_attention_heads", 0, &hp->n_heads, path);
    r |= cfg_int(cfg, "q_lora_rank", 0, &hp->q_lora, path);
    r |= cfg_int(cfg, "kv_lora_rank", 0, &hp->kv_lora, path);
    r |= cfg_int(cfg, "qk_nope_head_dim", 0, &hp->qk_nope, path);
    r |= cfg_int(cfg, "qk_rope_head_dim", 0, &hp->qk_rope, path);
    r |= cfg_int(cfg, "v_head_dim", 0, &hp->v_head, path);
    r |= cfg_int(cfg, "n_routed_experts", 0, &hp->n_routed, path);
    r |= cfg_int(cfg, "n_shared_experts", 0, &hp->n_shared, path);
    r |= cfg_int(cfg, "num_experts_per_tok", 0, &hp->top_k, path);
    r |= cfg_int(cfg, "n_group", 1, &hp->n_group, path);
    r |= cfg_int(cfg, "topk_group", 1, &hp->topk_group, path);
    r |= cfg_int(cfg, "max_position_embeddings", 4096, &hp->max_pos, path);
    r |= cfg_int(cfg, "bos_token_id", 0, &hp->bos, path);
    r |= cfg_int(cfg, "eos_token_id", 1, &hp->eos, path);
    /* numbers the math uses as floats: in range before the conversion (a
       double past FLT_MAX does not convert) */
    if (cfg_num(cfg, "routed_scaling_factor", 1.0, &d, path)) return CM384_E_FORMAT;
    if (!(d > 0 && d <= 1e6))
        return fail(CM384_E_FORMAT, "%s: \"routed_scaling_factor\" %g must be in (0, 1e6]", path, d);
    hp->route_scale = (float)d;
    if (cfg_num(cfg, "rms_norm_eps", 1e-6, &d, path)) return CM384_E_FORMAT;
    if (!(d > 0 && d <= 1) || (float)d == 0)
        return fail(CM384_E_FORMAT, "%s: \"rms_norm_eps\" %g must be in (0, 1] (and not 0 as a float)", path, d);
    hp->eps = (float)d;
    r |= cfg_num(cfg, "rope_theta", 10000.0, &hp->rope_theta, path);
    if (r) return CM384_E_FORMAT;
    if (!(hp->rope_theta > 1))
        return fail(CM384_E_FORMAT, "%s: \"rope_theta\" %g must be greater than 1", path, hp->rope_theta);
    hp->tie_emb = json_num(cfg, "tie_word_embeddings", 0) != 0;
    hp->norm_topk = json_num(cfg, "norm_topk_prob", 0) != 0;
    if (hp->moe_freq < 1) hp->moe_freq = 1;

    const char *tm = json_str(cfg, "topk_method", hp->arch == ARCH_V3 ? "noaux_tc" : "greedy");
    if (!strcmp(tm, "greedy") || !strcmp(tm, "gready")) hp->topk_method = TOPK_GREEDY;
    else if (!strcmp(tm, "group_limited_greedy")) hp->topk_method = TOPK_GROUP_LIMITED;
    else if (!strcmp(tm, "noaux_tc")) hp->topk_method = TOPK_NOAUX_TC;
    else return fail(CM384_E_UNSUPPORTED, "%s: topk_method \"%s\" is not supported", path, tm);
    const char *sf = json_str(cfg, "scoring_func", hp->arch == ARCH_V3 ? "sigmoid" : "softmax");
    if (!strcmp(sf, "softmax")) hp->score_func = SCORE_SOFTMAX;
    else if (!strcmp(sf, "sigmoid")) hp->score_func = SCORE_SIGMOID;
    else return fail(CM384_E_UNSUPPORTED, "%s: scoring_func \"%s\" is not supported", path, sf);

    /* FP8 checkpoints: only DeepSeek's 128x128 block scales are understood */
    const json *qc = json_get(cfg, "quantization_config");
    if (qc && qc->type == JSON_OBJECT) {
        const char *qm = json_str(qc, "quant_method", "fp8");
        const json *bs = json_get(qc, "weight_block_size");
        if (strcmp(qm, "fp8"))
            return fail(CM384_E_UNSUPPORTED, "%s: quantization_config quant_method \"%s\" (only fp8)", path, qm);
        if (bs && (bs->type != JSON_ARRAY || bs->len != 2 || bs->kids[0].num != GL_F8_BLOCK || bs->kids[1].num != GL_F8_BLOCK))
            return fail(CM384_E_UNSUPPORTED, "%s: quantization_config weight_block_size must be [128, 128]", path);
    }
    const json *rs = json_get(cfg, "rope_scaling");
    if (rs && rs->type == JSON_OBJECT) {
        const char *type = json_str(rs, "type", json_str(rs, "rope_type", ""));
        if (strcmp(type, "yarn"))
            return fail(CM384_E_UNSUPPORTED, "%s: rope_scaling type \"%s\" (only yarn)", path, type);
        hp->yarn = 1;
        r |= cfg_num(rs, "factor", 1.0, &hp->yarn_factor, path);
        r |= cfg_int(rs, "original_max_position_embeddings", 4096, &hp->yarn_orig_max, path);
        r |= cfg_num(rs, "beta_fast", 32, &hp->beta_fast, path);
        r |= cfg_num(rs, "beta_slow", 1, &hp->beta_slow, path);
        r |= cfg_num(rs, "mscale", 1, &hp->mscale, path);
        r |= cfg_num(rs, "mscale_all_dim", 0, &hp->mscale_all_dim, path);
        if (r) return CM384_E_FORMAT;
        if (hp->mscale > 1000 || hp->mscale_all_dim > 1000)    /* the attention scale must stay a float */
            return fail(CM384_E_FORMAT, "%s: rope_scaling mscale %g / mscale_all_dim %g above 1000", path,
                        hp->mscale, hp->mscale_all_dim);
        if (hp->yarn_factor <= 1.0) hp->yarn = 0;
    } else if (rs && rs->type != JSON_NULL) {
        return fail(CM384_E_FORMAT, "%s: \"rope_scaling\" must be an object or null", path);
    }

    /* shape sanity: everything the math divides by or allocates from */
    struct { const char *name; int v; } need[] = {
        {"vocab_size", hp->vocab}, {"hidden_size", hp->dim}, {"num_hidden_layers", hp->n_layers},
        {"num_attention_heads", hp->n_heads}, {"kv_lora_rank", hp->kv_lora},
        {"qk_rope_head_dim", hp->qk_rope}, {"v_head_dim", hp->v_head}};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (need[i].v <= 0) return fail(CM384_E_FORMAT, "%s: \"%s\" missing or zero", path, need[i].name);
    if (hp->qk_rope % 2) return fail(CM384_E_FORMAT, "%s: qk_rope_head_dim must be even", path);
    if (hp->n_routed > 0) {
        if (hp->top_k <= 0 || hp->top_k > hp->n_routed || hp->moe_inter <= 0)
            return fail(CM384_E_FORMAT, "%s: bad MoE sizes (num_experts_per_tok %d, n_routed_experts %d, "
                        "moe_intermediate_size %d)", path, hp->top_k, hp->n_routed, hp->moe_inter);
        if (hp->n_group < 1 || hp->n_routed % hp->n_group || hp->topk_group < 1 || hp->topk_group > hp->n_group)
            return fail(CM384_E_FORMAT, "%s: n_group %d / topk_group %d do not divide %d experts",
                        path, hp->n_group, hp->topk_group, hp->n_routed);
        if (hp->top_k > 64 || hp->n_routed > 1024 || hp->n_group > 256)
            return fail(CM384_E_UNSUPPORTED, "%s: more than 64 experts per token, 1024 experts or 256 groups", path);
    } else hp->top_k = hp->moe_inter = hp->n_shared = 0;   /* no routed experts: the MoE numbers mean
                                                               nothing, and would size scratch */
    if (hp->n_dense > 0 || hp->n_routed == 0)
        if (hp->inter <= 0) return fail(CM384_E_FORMAT, "%s: intermediate_size missing", path);
    if (hp->n_mtp > 1) hp->n_mtp = 1;   /* only the first MTP module is used */
    if (hp->bos >= hp->vocab) hp->bos = -1;
    if (hp->eos >= hp->vocab) hp->eos = -1;
    return CM384_OK;
}

/* ---- safetensors ---- */

typedef struct tensor_info {
    const char    *name;
    int            dtype;         /* enum gl_type, or -1 for other stored types   */
    const char    *dtype_name;
    int            ndim;
    int64_t        shape[4];
    const uint8_t *data;
    size_t         nbytes;
    int            file;          /* index into model->files                       */
} tensor_info;

/* Open-addressing table name -> tensor_info. */
typedef struct {
    tensor_info *items;
    int          n, cap;          /* cap is a power of two                          */
} tensor_table;

static uint64_t hash_str(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;                    /* FNV-1a */
    for (size_t i = 0; i < n; i++) { h ^= (uint8_t)s[i]; h *= 1099511628211ull; }
    return h;
}

static tensor_info *tensor_find(const tensor_table *t, const char *name) {
    if (!t->cap) return NULL;
    uint64_t h = hash_str(name, strlen(name));
    for (int i = (int)(h & (uint64_t)(t->cap - 1));; i = (i + 1) & (t->cap - 1)) {
        if (!t->items[i].name) return NULL;
        if (!strcmp(t->items[i].name, name)) return &t->items[i];
    }
}

static int tensor_insert(tensor_table *t, const tensor_info *ti) {
    if ((t->n + 1) * 2 > t->cap) {
        int cap = t->cap ? t->cap * 2 : 1024;
        tensor_info *items = calloc((size_t)cap, sizeof *items);
        if (!items) return fail(CM384_E_NOMEM, "out of memory for the tensor table");
        for (int i = 0; i < t->cap; i++) {
            if (!t->items[i].name) continue;
            uint64_t h = hash_str(t->items[i].name, strlen(t->items[i].name));
            int j = (int)(h & (uint64_t)(cap - 1));
            while (items[j].name) j = (j + 1) & (cap - 1);
            items[j] = t->items[i];
        }
        free(t->items);
        t->items = items;
        t->cap = cap;
    }
    uint64_t h = hash_str(ti->name, strlen(ti->name));
    int j = (int)(h & (uint64_t)(t->cap - 1));
    while (t->items[j].name) {
        if (!strcmp(t->items[j].name, ti->name)) return 1;   /* duplicate */
        j = (j + 1) & (t->cap - 1);
    }
    t->items[j] = *ti;
    t->n++;
    return 0;
}

static int st_dtype(const char *s, int *bytes) {
    static const struct { const char *name; int type, bytes; } dt[] = {
        {"F32", GL_F32, 4}, {"F16", GL_F16, 2}, {"BF16", GL_BF16, 2}, {"F8_E4M3", GL_F8_E4M3, 1},
        /* known to safetensors, not usable as weights here */
        {"F64", -1, 8}, {"I64", -1, 8}, {"I32", -1, 4}, {"I16", -1, 2}, {"I8", -1, 1}, {"U8", -1, 1},
        {"BOOL", -1, 1}, {"F8_E5M2", -1, 1}, {"U16", -1, 2}, {"U32", -1, 4}, {"U64", -1, 8}};
    for (size_t i = 0; i < sizeof dt / sizeof dt[0]; i++)
        if (!strcmp(s, dt[i].name)) { *bytes = dt[i].bytes; return dt[i].type; }
    *bytes = 0;
    return -2;
}

/* Parses one shard's header and adds its tensors to the table. */
static int st_read_header(const file_map *f, const char *path, int file_index, arena *a,
                          tensor_table *tt) {
    if (f->size < 8) return fail(CM384_E_FORMAT, "%s: %zu bytes: too short for a safetensors file", path, f->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->data[i];
    if (hlen > f->size - 8)
        return fail(CM384_E_FORMAT, "%s: header length %llu is past the end of the file (%zu bytes)",
                    path, (unsigned long long)hlen, f->size);
    if (hlen > 100u << 20) return fail(CM384_E_FORMAT, "%s: header length %llu is implausibly large",
                                       path, (unsigned long long)hlen);
    json hdr;
    int r = json_parse((const char *)f->data + 8, (size_t)hlen, a, &hdr, path);
    if (r) return r;
    if (hdr.type != JSON_OBJECT) return fail(CM384_E_FORMAT, "%s: header is not a JSON object", path);
    const uint8_t *base = f->data + 8 + hlen;
    size_t data_size = f->size - 8 - (size_t)hlen;
    for (int i = 0; i < hdr.len; i++) {
        const json *e = &hdr.kids[i];
        if (!strcmp(e->key, "__metadata__")) continue;
        const char *dts = json_str(e, "dtype", NULL);
        const json *shape = json_get(e, "shape"), *offs = json_get(e, "data_offsets");
        if (!dts || !shape || shape->type != JSON_ARRAY || !offs || offs->type != JSON_ARRAY || offs->len != 2)
            return fail(CM384_E_FORMAT, "%s: tensor \"%s\": header entry needs dtype, shape and data_offsets",
                        path, e->key);
        tensor_info ti = {0};
        ti.name = e->key;
        ti.dtype_name = dts;
        ti.file = file_index;
        int esize;
        ti.dtype = st_dtype(dts, &esize);
        if (ti.dtype == -2)
            return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has unknown dtype \"%s\"", path, e->key, dts);
        if (shape->len > 4)
            return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has %d dimensions", path, e->key, shape->len);
        ti.ndim = shape->len;
        uint64_t numel = 1;
        for (int k = 0; k < shape->len; k++) {
            const json *s = &shape->kids[k];
            if (s->type != JSON_NUMBER || s->num < 0 || s->num > 1e12 || s->num != floor(s->num))
                return fail(CM384_E_FORMAT, "%s: tensor \"%s\": bad shape", path, e->key);
            ti.shape[k] = (int64_t)s->num;
            numel *= (uint64_t)ti.shape[k];
        }
        double b = offs->kids[0].num, en = offs->kids[1].num;
        if (offs->kids[0].type != JSON_NUMBER || offs->kids[1].type != JSON_NUMBER || b < 0 || en < b ||
            b != floor(b) || en != floor(en))
            return fail(CM384_E_FORMAT, "%s: tensor \"%s\": bad data_offsets", path, e->key);
        if (en > (double)data_size)
            return fail(CM384_E_FORMAT, "%s: tensor \"%s\" ends at byte %.0f of the data, but the file holds "
                        "only %zu data bytes (truncated shard?)", path, e->key, en, data_size);
        if ((uint64_t)(en - b) != numel * (uint64_t)esize)
            return fail(CM384_E_FORMAT, "%s: tensor \"%s\": %.0f bytes for %llu elements of %s",
                        path, e->key, en - b, (unsigned long long)numel, dts);
        ti.data = base + (size_t)b;
        ti.nbytes = (size_t)(en - b);
        int ins = tensor_insert(tt, &ti);
        if (ins < 0) return ins;
        if (ins == 1) return fail(CM384_E_FORMAT, "%s: tensor \"%s\" appears twice", path, e->key);
    }
    return CM384_OK;
}

/* ---- GGUF ----
 * llama.cpp's single-file format: "GGUF", version (2 or 3), tensor count,
 * metadata count, then metadata (key string, value type, value), tensor
 * infos (name, dims, ggml type, offset), and the tensor data from the next
 * multiple of general.alignment (default 32).  Little-endian throughout;
 * strings are a u64 length and bytes.  ggml lists dimensions fastest first,
 * so ne = {cols, rows, n} is the row-major [n][rows][cols] of safetensors.
 * Every read is bounds-checked against the file size; a bad file fails with
 * a message naming it and the offending key, tensor or byte offset. */

enum { GGUF_U8, GGUF_I8, GGUF_U16, GGUF_I16, GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STR,
       GGUF_ARR, GGUF_U64, GGUF_I64, GGUF_F64, GGUF_NTYPES };

typedef struct gguf_kv {
    const char    *key;          /* NUL-terminated copy                          */
    int            type;         /* GGUF_*                                       */
    int            arr_type;     /* GGUF_ARR: element type                       */
    uint64_t       n;            /* GGUF_ARR: elements; GGUF_STR: bytes          */
    const uint8_t *p;            /* the value's bytes in the file (array: first
                                    element; string: its bytes)                  */
    double         num;          /* numbers and bools                            */
} gguf_kv;

typedef struct gguf_meta {
    gguf_kv *kv;
    int      n_kv;
    uint32_t version, alignment;
} gguf_meta;

typedef struct {
    const uint8_t *p;
    size_t         pos, size;
    const char    *path;
} gguf_reader;

static int gguf_need(gguf_reader *rd, uint64_t n, const char *what) {
    if (n > rd->size - rd->pos)
        return fail(CM384_E_FORMAT, "%s: %s at byte %zu runs past the end of the file (%zu bytes; truncated?)",
                    rd->path, what, rd->pos, rd->size);
    return CM384_OK;
}

static uint64_t gguf_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static int gguf_u32(gguf_reader *rd, uint32_t *v, const char *what) {
    int r = gguf_need(rd, 4, what);
    if (!r) { *v = (uint32_t)gguf_le(rd->p + rd->pos, 4); rd->pos += 4; }
    return r;
}

static int gguf_u64(gguf_reader *rd, uint64_t *v, const char *what) {
    int r = gguf_need(rd, 8, what);
    if (!r) { *v = gguf_le(rd->p + rd->pos, 8); rd->pos += 8; }
    return r;
}

static int gguf_str(gguf_reader *rd, const uint8_t **s, uint64_t *len, const char *what) {
    int r = gguf_u64(rd, len, what);
    if (!r) r = gguf_need(rd, *len, what);
    if (!r) { *s = rd->p + rd->pos; rd->pos += (size_t)*len; }
    return r;
}

static int gguf_scalar_size(int type) {
    static const int sz[GGUF_NTYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type >= 0 && type < GGUF_NTYPES ? sz[type] : 0;
}

static double gguf_scalar(const uint8_t *p, int type) {
    uint64_t u = gguf_le(p, gguf_scalar_size(type));
    switch (type) {
    case GGUF_I8: return (int8_t)u;
    case GGUF_I16: return (int16_t)u;
    case GGUF_I32: return (int32_t)u;
    case GGUF_I64: return (double)(int64_t)u;
    case GGUF_F32: { uint32_t b = (uint32_t)u; float f; memcpy(&f, &b, 4); return f; }
    case GGUF_F64: { double f; memcpy(&f, &u, 8); return f; }
    default: return (double)u;
    }
}

/* ggml tensor types: the ones cm384 computes, and names for the rest. */
static int gguf_ggml_type(uint32_t t, const char **name) {
    static const struct { uint32_t id; int type; const char *name; } tt[] = {
        {0, GL_F32, "F32"}, {1, GL_F16, "F16"}, {30, GL_BF16, "BF16"}, {8, GL_Q8_0, "Q8_0"},
        {2, GL_Q4_0, "Q4_0"}, {12, GL_Q4_K, "Q4_K"}, {13, GL_Q5_K, "Q5_K"}, {14, GL_Q6_K, "Q6_K"},
        {3, GL_Q4_1, "Q4_1"}, {6, GL_Q5_0, "Q5_0"}, {7, GL_Q5_1, "Q5_1"}, {9, -1, "Q8_1"}, {10, -1, "Q2_K"},
        {11, -1, "Q3_K"}, {15, -1, "Q8_K"}, {16, -1, "IQ2_XXS"}, {17, -1, "IQ2_XS"}, {18, -1, "IQ3_XXS"},
        {19, -1, "IQ1_S"}, {20, -1, "IQ4_NL"}, {21, -1, "IQ3_S"}, {22, -1, "IQ2_S"}, {23, -1, "IQ4_XS"},
        {24, -1, "I8"}, {25, -1, "I16"}, {26, -1, "I32"}, {27, -1, "I64"}, {28, -1, "F64"},
        {29, -1, "IQ1_M"}, {34, -1, "TQ1_0"}, {35, -1, "TQ2_0"}, {39, -1, "MXFP4"}};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++)
        if (tt[i].id == t) { *name = tt[i].name; return tt[i].type; }
    *name = NULL;
    return -2;
}

/* Parses the header and the tensor infos of a GGUF file; adds the tensors
 * to tt (names as in the file, shapes row-major) and the metadata to g. */
static int gguf_read(const file_map *f, const char *path, int file_index, arena *a, gguf_meta *g, tensor_table *tt) {
    gguf_reader rd = {f->data, 0, f->size, path};
    memset(g, 0, sizeof *g);
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    int r = gguf_u32(&rd, &magic, "the magic");
    if (r) return r;
    if (magic != 0x46554747u) return fail(CM384_E_FORMAT, "%s: not a GGUF file (no \"GGUF\" magic)", path);
    if ((r = gguf_u32(&rd, &g->version, "the version"))) return r;
    if (g->version < 2 || g->version > 3)
        return fail(CM384_E_UNSUPPORTED, "%s: GGUF version %u (only 2 and 3)", path, g->version);
    if ((r = gguf_u64(&rd, &n_tensors, "the tensor count")) || (r = gguf_u64(&rd, &n_kv, "the metadata count")))
        return r;
    /* every entry takes at least 12 bytes (kv) or 24 (tensor): bounds the counts */
    if (n_kv > f->size / 12 || n_tensors > f->size / 24)
        return fail(CM384_E_FORMAT, "%s: %llu metadata entries and %llu tensors cannot fit in %zu bytes",
                    path, (unsigned long long)n_kv, (unsigned long long)n_tensors, f->size);
    g->kv = arena_alloc(a, (size_t)(n_kv ? n_kv : 1) * sizeof *g->kv);
    if (!g->kv) return fail(CM384_E_NOMEM, "out of memory");
    g->alignment = 32;
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        const uint8_t *ks;
        uint64_t kl;
        uint32_t type;
        memset(kv, 0, sizeof *kv);
        if ((r = gguf_str(&rd, &ks, &kl, "a metadata key"))) return r;
        if (!(kv->key = arena_strndup(a, (const char *)ks, (size_t)kl))) return fail(CM384_E_NOMEM, "out of memory");
        if ((r = gguf_u32(&rd, &type, kv->key))) return r;
        kv->type = (int)type;
        if (type == GGUF_STR) {
            if ((r = gguf_str(&rd, &kv->p, &kv->n, kv->key))) return r;
        } else if (type == GGUF_ARR) {
            uint32_t et;
            if ((r = gguf_u32(&rd, &et, kv->key)) || (r = gguf_u64(&rd, &kv->n, kv->key))) return r;
            kv->arr_type = (int)et;
            kv->p = rd.p + rd.pos;
            if (et == GGUF_STR) {
                for (uint64_t j = 0; j < kv->n; j++) {
                    const uint8_t *s;
                    uint64_t sl;
                    if ((r = gguf_str(&rd, &s, &sl, kv->key))) return r;
                }
            } else {
                int es = gguf_scalar_size((int)et);
                if (!es) return fail(CM384_E_FORMAT, "%s: metadata \"%s\": array of element type %u is not supported",
                                     path, kv->key, et);
                if (kv->n > (rd.size - rd.pos) / (uint64_t)es)
                    return fail(CM384_E_FORMAT, "%s: metadata \"%s\": %llu elements run past the end of the file",
                                path, kv->key, (unsigned long long)kv->n);
                rd.pos += (size_t)kv->n * (size_t)es;
            }
        } else {
            int es = gguf_scalar_size((int)type);
            if (!es) return fail(CM384_E_FORMAT, "%s: metadata \"%s\" has unknown value type %u", path, kv->key, type);
            if ((r = gguf_need(&rd, (uint64_t)es, kv->key))) return r;
            kv->p = rd.p + rd.pos;
            kv->num = gguf_scalar(kv->p, (int)type);
            rd.pos += (size_t)es;
        }
        g->n_kv++;
        if (!strcmp(kv->key, "general.alignment")) {
            if (type != GGUF_U32 || kv->num < 1 || kv->num > 65536 || ((uint32_t)kv->num & ((uint32_t)kv->num - 1)))
                return fail(CM384_E_FORMAT, "%s: general.alignment must be a u32 power of two", path);
            g->alignment = (uint32_t)kv->num;
        }
    }
    /* tensor infos; offsets are checked once the data section is known */
    tensor_info *infos = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *infos);
    uint64_t *offs = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *offs);
    if (!infos || !offs) { free(infos); free(offs); return fail(CM384_E_NOMEM, "out of memory"); }
    for (uint64_t i = 0; i < n_tensors && !r; i++) {
        tensor_info *ti = &infos[i];
        const uint8_t *ns;
        uint64_t nl, ne[4] = {1, 1, 1, 1};
        uint32_t nd, type;
        if ((r = gguf_str(&rd, &ns, &nl, "a tensor name"))) break;
        if (nl == 0 || nl > 1024) { r = fail(CM384_E_FORMAT, "%s: tensor %llu has a name of %llu bytes", path,
                                            (unsigned long long)i, (unsigned long long)nl); break; }
        if (!(ti->name = arena_strndup(a, (const char *)ns, (size_t)nl))) { r = fail(CM384_E_NOMEM, "out of memory"); break; }
        if ((r = gguf_u32(&rd, &nd, ti->name))) break;
        if (nd < 1 || nd > 4) { r = fail(CM384_E_FORMAT, "%s: tensor \"%s\" has %u dimensions (1 to 4)", path, ti->name, nd); break; }
        uint64_t numel = 1;
        for (uint32_t d = 0; d < nd && !r; d++) {
            if ((r = gguf_u64(&rd, &ne[d], ti->name))) break;
            if (ne[d] < 1 || ne[d] > ((uint64_t)1 << 40) || numel > ((uint64_t)1 << 48) / ne[d])
                r = fail(CM384_E_FORMAT, "%s: tensor \"%s\": dimension %u is %llu", path, ti->name, d, (unsigned long long)ne[d]);
            else numel *= ne[d];
        }
        if (r || (r = gguf_u32(&rd, &type, ti->name)) || (r = gguf_u64(&rd, &offs[i], ti->name))) break;
        ti->dtype = gguf_ggml_type(type, &ti->dtype_name);
        if (ti->dtype == -2) { r = fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has unknown ggml type %u", path, ti->name, type); break; }
        ti->ndim = (int)nd;
        for (uint32_t d = 0; d < nd; d++) ti->shape[d] = (int64_t)ne[nd - 1 - d];
        ti->file = file_index;
        if (ti->dtype >= 0) {
            int bs = gl_type_block(ti->dtype);
            if (ne[0] % (uint64_t)bs) {
                r = fail(CM384_E_FORMAT, "%s: tensor \"%s\": rows of %llu values are not whole %s blocks of %d",
                         path, ti->name, (unsigned long long)ne[0], ti->dtype_name, bs);
                break;
            }
            ti->nbytes = gl_row_bytes(ti->dtype, (int)ne[0]) * (size_t)(numel / ne[0]);
        }
    }
    if (!r) {
        size_t data = (rd.pos + g->alignment - 1) / g->alignment * g->alignment;
        if (n_tensors && data > f->size) r = fail(CM384_E_FORMAT, "%s: the tensor data would start past the end of the file", path);
        for (uint64_t i = 0; i < n_tensors && !r; i++) {
            tensor_info *ti = &infos[i];
            if (offs[i] % g->alignment)
                r = fail(CM384_E_FORMAT, "%s: tensor \"%s\": offset %llu is not a multiple of the alignment %u",
                         path, ti->name, (unsigned long long)offs[i], g->alignment);
            else if (ti->dtype >= 0 && (offs[i] > f->size - data || ti->nbytes > f->size - data - offs[i]))
                r = fail(CM384_E_FORMAT, "%s: tensor \"%s\" (%zu bytes at offset %llu) runs past the end of the "
                         "file (truncated?)", path, ti->name, ti->nbytes, (unsigned long long)offs[i]);
            if (r) break;
            ti->data = f->data + data + (size_t)offs[i];
            int ins = tensor_insert(tt, ti);
            if (ins < 0) r = ins;
            else if (ins == 1) r = fail(CM384_E_FORMAT, "%s: tensor \"%s\" appears twice", path, ti->name);
        }
    }
    free(infos);
    free(offs);
    return r;
}

static const gguf_kv *gguf_find(const gguf_meta *g, const char *key) {
    for (int i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

/* ---- the model: weights bound to names and shapes ---- */

typedef struct ffn_w { gl_mat gate, up, down; } ffn_w;   /* down(silu(gate x) * up x) */

typedef struct layer_w {
    float  *attn_norm, *ffn_norm;   /* input_layernorm, post_attention_layernorm  [dim]      */
    gl_mat  wq_a, wq_b, wq;         /* q_a_proj [q_lora][dim], q_b_proj [H*(nope+rope)][q_lora]
                                       or q_proj [H*(nope+rope)][dim]                        */
    float  *q_norm;                 /* q_a_layernorm [q_lora]                                 */
    gl_mat  wkv_a;                  /* kv_a_proj_with_mqa [kv_lora+rope][dim]                 */
    float  *kv_norm;                /* kv_a_layernorm [kv_lora]                               */
    gl_mat  wkv_b;                  /* kv_b_proj [H*(nope+v)][kv_lora]                        */
    gl_mat *w_uk_t;                 /* derived, per head: W_uk^T [kv_lora][nope]              */
    gl_mat *w_uv;                   /* per head: rows of wkv_b giving V, [v][kv_lora]         */
    gl_mat *w_uk;                   /* per head: rows of wkv_b giving K_nope, [nope][kv_lora]
                                       (expanded prefill; NULL when wkv_b is not whole rows) */
    gl_mat  wo;                     /* o_proj [dim][H*v]                                      */
    int     is_moe;
    ffn_w   dense;                  /* mlp.{gate,up,down}_proj (dense layers)                 */
    gl_mat  router;                 /* mlp.gate.weight [n_routed][dim]                        */
    float  *router_bias;            /* mlp.gate.e_score_correction_bias [n_routed] or NULL    */
    ffn_w  *experts;                /* mlp.experts.E [n_routed]                               */
    ffn_w   shared;                 /* mlp.shared_experts (n_shared fused), gate.rows==0: none*/
    /* MTP module only (layer index n_layers) */
    float  *enorm, *hnorm, *head_norm;
    gl_mat  eh_proj;                /* [dim][2*dim]                                           */
    gl_mat  embed, head;            /* its own copies of the embedding and the head          */
} layer_w;

/* INT8 copies (GL_Q8: int8 values, one scale per output row) of the
 * projections that carry the compute: attention projections (with the
 * absorbed W_uk^T and W_uv of each head), dense FFN, shared and routed
 * experts, the heads.  The router, norms, embedding and the attention core
 * (scores, softmax, weighted latents) stay in their stored type and fp32. */
typedef struct layer_q8 {
    gl_mat  wq_a, wq_b, wq, wkv_a, wo;
    ffn_w   dense, shared;
    ffn_w  *experts;
    gl_mat  eh_proj, head;          /* MTP layers                                 */
    gl_mat *w_uk_t, *w_uv;          /* per head: the absorbed MLA products        */
    gl_mat *w_uk;                   /* per head: W_uk as rows (expanded prefill), or NULL */
} layer_q8;

struct cm384_model {
    char         *path;
    hparams       hp;
    int           tokenizer_only;
    int           config_only;    /* shapes from config.json, no weights (section 15) */
    tokenizer    *tok;
    int           n_files;
    file_map     *files;
    char        **file_names;
    tensor_table  tensors;
    arena         a;              /* names, JSON, fp32 vectors, derived matrices             */
    gl_mat        embed, head;    /* model.embed_tokens [vocab][dim], lm_head [vocab][dim]    */
    float        *final_norm;     /* model.norm [dim]                                         */
    layer_w      *layers;         /* n_layers main layers, then n_mtp MTP modules             */
    float        *rope_freq;      /* [qk_rope/2] angular frequencies, YaRN applied            */
    float         rope_mscale;    /* cos/sin multiplier (1 unless mscale != mscale_all_dim)   */
    float         attn_scale;     /* softmax scale, YaRN mscale included                      */
    uint64_t      n_params, n_active_params, weight_bytes;
    uint64_t      n_mtp_params;   /* of n_params, in the MTP module                        */
    int           binding_mtp;    /* bind_* are binding an MTP layer                       */
    int           main_dtype;
    /* INT8 W8A8 copies of the big projections, made on first use and shared
       by every engine on this model (section 6) */
    pthread_mutex_t q8_mu;
    struct layer_q8 *q8;
    gl_mat        q8_head;        /* lm_head in INT8                                       */
    arena         q8_arena;
    void         *q8_block;       /* the INT8 copies' bytes, in one huge-page block        */
    file_map      q8_file;        /* the model cache's INT8 weights, if used               */
    char         *cache_dir;      /* load opts: where the model cache is kept (or NULL)     */
    int           use_mmap;       /* load opts: map files (the model cache's too), or read  */
    /* load-time progress */
    cm384_progress_fn progress;
    void         *progress_user;
    uint64_t      progress_done, progress_total;
    /* memory: what INT8 copies would take and the stored bytes they replace
       (section 9), and the machine's physical memory, for the estimate an
       engine makes (section 14) */
    uint64_t      q8_bytes, q8_replaced;
    uint64_t      phys_mem;
};

typedef struct { cm384_model *m; int status; } binder;

static int report_progress(cm384_model *m, const char *stage, uint64_t add) {
    m->progress_done += add;
    if (m->progress && m->progress(m->progress_user, stage, m->progress_done, m->progress_total))
        return fail(CM384_E_CANCELLED, "%s: loading cancelled by the progress callback", m->path);
    return CM384_OK;
}

static const char *shard_name(const cm384_model *m, const tensor_info *t) {
    return m->file_names[t->file];
}

/* Binds a 2-D weight [rows][cols]; required=0 lets a missing tensor leave
 * out->data NULL. */
static int bind_mat(cm384_model *m, const char *name, int rows, int cols, gl_mat *out, int required) {
    memset(out, 0, sizeof *out);
    tensor_info *t = tensor_find(&m->tensors, name);
    if (!t) {
        if (!required) return CM384_OK;
        return fail(CM384_E_FORMAT, "%s: missing tensor \"%s\" (expected shape [%d, %d])", m->path, name, rows, cols);
    }
    if (t->dtype < 0)
        return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has dtype %s; weights must be F32, F16, BF16, F8_E4M3 "
                    "or (GGUF) Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K",
                    shard_name(m, t), name, t->dtype_name);
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        char got[96] = "[";
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        strncat(got, "]", sizeof got - strlen(got) - 1);
        return fail(CM384_E_FORMAT, "%s: tensor \"%s\" has shape %s, expected [%d, %d]",
                    shard_name(m, t), name, got, rows, cols);
    }
    out->type = t->dtype;
    out->rows = rows;
    out->cols = cols;
    out->data = t->data;
    if ((uintptr_t)t->data % gl_type_size(t->dtype)) {
        /* misaligned fp32 / 16-bit data cannot be read through its pointer
           type (a header whose length is not a multiple of 8 puts it there) */
        void *p = arena_alloc(&m->a, t->nbytes);
        if (!p) return fail(CM384_E_NOMEM, "out of memory copying %s", name);
        memcpy(p, t->data, t->nbytes);
        out->data = p;
    }
    if (t->dtype == GL_F8_E4M3) {
        char sname[512];
        size_t nl = strlen(name);
        if (nl < 7 || strcmp(name + nl - 7, ".weight") || nl + 16 > sizeof sname)
            return fail(CM384_E_FORMAT, "%s: F8 tensor \"%s\" has no matching scale name", m->path, name);
        snprintf(sname, sizeof sname, "%s_scale_inv", name);
        tensor_info *s = tensor_find(&m->tensors, sname);
        int br = (rows + GL_F8_BLOCK - 1) / GL_F8_BLOCK, bc = (cols + GL_F8_BLOCK - 1) / GL_F8_BLOCK;
        if (!s) return fail(CM384_E_FORMAT, "%s: F8_E4M3 tensor \"%s\" needs \"%s\" (shape [%d, %d])",
                            m->path, name, sname, br, bc);
        if (s->dtype != GL_F32 && s->dtype != GL_BF16)
            return fail(CM384_E_UNSUPPORTED, "%s: scale \"%s\" has dtype %s (F32 expected)", shard_name(m, s), sname, s->dtype_name);
        if (s->ndim != 2 || s->shape[0] != br || s->shape[1] != bc)
            return fail(CM384_E_FORMAT, "%s: scale \"%s\" has the wrong shape (expected [%d, %d])",
                        shard_name(m, s), sname, br, bc);
        float *sc = arena_alloc(&m->a, (size_t)br * bc * sizeof(float));
        if (!sc) return fail(CM384_E_NOMEM, "out of memory");
        for (int i = 0; i < br * bc; i++) {
            if (s->dtype == GL_F32) memcpy(&sc[i], s->data + 4 * (size_t)i, 4);
            else { uint16_t h; memcpy(&h, s->data + 2 * (size_t)i, 2); sc[i] = gl_bf16_to_f32(h); }
        }
        out->scale = sc;
    }
    m->n_params += (uint64_t)rows * (uint64_t)cols;
    if (m->binding_mtp) m->n_mtp_params += (uint64_t)rows * (uint64_t)cols;
    m->weight_bytes += t->nbytes;
    return report_progress(m, "tensors", t->nbytes);
}

/* Binds a 1-D vector, converted to fp32 (norm weights, router bias). */
static int bind_vec(cm384_model *m, const char *name, int n, float **out, int required) {
    *out = NULL;
    tensor_info *t = tensor_find(&m->tensors, name);
    if (!t) {
        if (!required) return CM384_OK;
        return fail(CM384_E_FORMAT, "%s: missing tensor \"%s\" (expected shape [%d])", m->path, name, n);
    }
    if (t->dtype < 0 || t->dtype == GL_F8_E4M3)
        return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has dtype %s (F32, F16 or BF16 expected)",
                    shard_name(m, t), name, t->dtype_name);
    if (t->ndim != 1 || t->shape[0] != n)
        return fail(CM384_E_FORMAT, "%s: tensor \"%s\" has the wrong shape (expected [%d])", shard_name(m, t), name, n);
    float *v = arena_alloc(&m->a, (size_t)n * sizeof(float));
    if (!v) return fail(CM384_E_NOMEM, "out of memory");
    gl_mat g = {t->dtype, 1, n, t->data, NULL};
    if (t->dtype == GL_F32) memcpy(v, t->data, (size_t)n * 4);
    else if ((uintptr_t)t->data % 2) {                 /* misaligned 16-bit values */
        for (int i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, t->data + 2 * (size_t)i, 2);
            v[i] = t->dtype == GL_BF16 ? gl_bf16_to_f32(h) : gl_f16_to_f32(h);
        }
    } else gl_row_to_f32(&g, 0, v);
    *out = v;
    m->n_params += (uint64_t)n;
    if (m->binding_mtp) m->n_mtp_params += (uint64_t)n;
    m->weight_bytes += t->nbytes;
    return CM384_OK;
}

static int bind_ffn(cm384_model *m, const char *prefix, int inter, ffn_w *f, int required) {
    char n1[256], n2[256], n3[256];
    snprintf(n1, sizeof n1, "%s.gate_proj.weight", prefix);
    snprintf(n2, sizeof n2, "%s.up_proj.weight", prefix);
    snprintf(n3, sizeof n3, "%s.down_proj.weight", prefix);
    int d = m->hp.dim, r;
    if ((r = bind_mat(m, n1, inter, d, &f->gate, required))) return r;
    if (!f->gate.data) return CM384_OK;
    if ((r = bind_mat(m, n2, inter, d, &f->up, 1))) return r;
    return bind_mat(m, n3, d, inter, &f->down, 1);
}

/* A matrix made from rows of another, in a type that holds its values
 * exactly: used for the absorbed-attention matrices.  fp8 with block scales
 * becomes fp32 (fp8 x scale needs more bits than bf16 has). */
static int derive_mat(cm384_model *m, const gl_mat *src, int row0, int rows, int transpose, gl_mat *out) {
    int type = src->type == GL_F16 ? GL_F16 : src->type == GL_BF16 ? GL_BF16 : GL_F32;
    int cols = src->cols;
    size_t es = gl_type_size(type);
    void *dst = arena_alloc(&m->a, (size_t)rows * cols * es);
    float *row = malloc((size_t)cols * sizeof(float));
    if (!dst || !row) { free(row); return fail(CM384_E_NOMEM, "out of memory deriving attention matrices"); }
    for (int r = 0; r < rows; r++) {
        gl_row_to_f32(src, row0 + r, row);
        for (int c = 0; c < cols; c++) {
            /* transposed: element (r, c) goes to (c, r) of a [cols][rows] matrix */
            size_t at = transpose ? (size_t)c * rows + r : (size_t)r * cols + c;
            if (type == GL_F32) ((float *)dst)[at] = row[c];
            else if (type == GL_F16) ((uint16_t *)dst)[at] = gl_f32_to_f16(row[c]);
            else ((uint16_t *)dst)[at] = gl_f32_to_bf16(row[c]);
        }
    }
    free(row);
    out->type = type;
    out->rows = transpose ? cols : rows;
    out->cols = transpose ? rows : cols;
    out->data = dst;
    out->scale = NULL;
    return CM384_OK;
}

/* W_uk of each head as the rows of wkv_b it is ([nope][kv_lora], no copy),
 * for the expanded prefill (section 7).  fp8 block scales do not slice
 * by rows, so an fp8 wkv_b (and a GGUF file that stores k_b apart) leaves
 * w_uk NULL: those models attend absorbed in prefill too. */
static int kv_b_views(cm384_model *m, layer_w *L) {
    const hparams *hp = &m->hp;
    L->w_uk = NULL;
    if (!L->wkv_b.data || L->wkv_b.type == GL_F8_E4M3 || L->wkv_b.type == GL_Q8) return CM384_OK;
    L->w_uk = arena_alloc(&m->a, (size_t)hp->n_heads * sizeof(gl_mat));
    if (!L->w_uk) return fail(CM384_E_NOMEM, "out of memory");
    for (int h = 0; h < hp->n_heads; h++) {
        gl_mat k = L->wkv_b;
        k.rows = hp->qk_nope;
        k.data = (const uint8_t *)L->wkv_b.data + (size_t)h * (hp->qk_nope + hp->v_head) * gl_row_bytes(k.type, hp->kv_lora);
        L->w_uk[h] = k;
    }
    return CM384_OK;
}

/* The layer table and the RoPE frequencies, from the hyper-parameters
 * (both loaders, before they bind the layers). */
static int model_alloc_layers(cm384_model *m) {
    const hparams *hp = &m->hp;
    int nl = hp->n_layers + hp->n_mtp;
    m->layers = arena_alloc(&m->a, (size_t)nl * sizeof(layer_w));
    m->rope_freq = arena_alloc(&m->a, (size_t)(hp->qk_rope / 2) * sizeof(float));
    if (!m->layers || !m->rope_freq) return fail(CM384_E_NOMEM, "out of memory");
    memset(m->layers, 0, (size_t)nl * sizeof(layer_w));
    return CM384_OK;
}

static int bind_layer(cm384_model *m, int l) {
    const hparams *hp = &m->hp;
    layer_w *L = &m->layers[l];
    char p[128], n[256];
    int r, H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope;
    snprintf(p, sizeof p, "model.layers.%d", l);
#define NAME(fmt) (snprintf(n, sizeof n, "%s." fmt, p), n)
    if ((r = bind_vec(m, NAME("input_layernorm.weight"), hp->dim, &L->attn_norm, 1))) return r;
    if ((r = bind_vec(m, NAME("post_attention_layernorm.weight"), hp->dim, &L->ffn_norm, 1))) return r;
    if (hp->q_lora) {
        if ((r = bind_mat(m, NAME("self_attn.q_a_proj.weight"), hp->q_lora, hp->dim, &L->wq_a, 1))) return r;
        if ((r = bind_vec(m, NAME("self_attn.q_a_layernorm.weight"), hp->q_lora, &L->q_norm, 1))) return r;
        if ((r = bind_mat(m, NAME("self_attn.q_b_proj.weight"), H * qk, hp->q_lora, &L->wq_b, 1))) return r;
    } else {
        if ((r = bind_mat(m, NAME("self_attn.q_proj.weight"), H * qk, hp->dim, &L->wq, 1))) return r;
    }
    if ((r = bind_mat(m, NAME("self_attn.kv_a_proj_with_mqa.weight"), hp->kv_lora + hp->qk_rope, hp->dim, &L->wkv_a, 1))) return r;
    if ((r = bind_vec(m, NAME("self_attn.kv_a_layernorm.weight"), hp->kv_lora, &L->kv_norm, 1))) return r;
    if ((r = bind_mat(m, NAME("self_attn.kv_b_proj.weight"), H * (hp->qk_nope + hp->v_head), hp->kv_lora, &L->wkv_b, 1))) return r;
    if ((r = bind_mat(m, NAME("self_attn.o_proj.weight"), hp->dim, H * hp->v_head, &L->wo, 1))) return r;

    /* absorbed attention: per head, W_uk^T (to map q_nope into the latent) and
       W_uv (to map the attended latent to values) */
    L->w_uk_t = arena_alloc(&m->a, (size_t)H * sizeof(gl_mat));
    L->w_uv = arena_alloc(&m->a, (size_t)H * sizeof(gl_mat));
    if (!L->w_uk_t || !L->w_uv) return fail(CM384_E_NOMEM, "out of memory");
    for (int h = 0; h < H; h++) {
        int base = h * (hp->qk_nope + hp->v_head);
        if ((r = derive_mat(m, &L->wkv_b, base, hp->qk_nope, 1, &L->w_uk_t[h]))) return r;
        if (L->wkv_b.type == GL_F8_E4M3) {
            if ((r = derive_mat(m, &L->wkv_b, base + hp->qk_nope, hp->v_head, 0, &L->w_uv[h]))) return r;
        } else {
            gl_mat v = L->wkv_b;
            v.rows = hp->v_head;
            v.data = (const uint8_t *)L->wkv_b.data + (size_t)(base + hp->qk_nope) * gl_row_bytes(v.type, hp->kv_lora);
            L->w_uv[h] = v;
        }
    }
    if ((r = kv_b_views(m, L))) return r;

    L->is_moe = layer_is_moe(hp, l);
    if (!L->is_moe) {
        if ((r = bind_ffn(m, NAME("mlp"), hp->inter, &L->dense, 1))) return r;
    } else {
        if ((r = bind_mat(m, NAME("mlp.gate.weight"), hp->n_routed, hp->dim, &L->router, 1))) return r;
        if ((r = bind_vec(m, NAME("mlp.gate.e_score_correction_bias"), hp->n_routed, &L->router_bias,
                          hp->topk_method == TOPK_NOAUX_TC))) return r;
        L->experts = arena_alloc(&m->a, (size_t)hp->n_routed * sizeof(ffn_w));
        if (!L->experts) return fail(CM384_E_NOMEM, "out of memory");
        for (int e = 0; e < hp->n_routed; e++) {
            char ep[160];
            snprintf(ep, sizeof ep, "%s.mlp.experts.%d", p, e);
            if ((r = bind_ffn(m, ep, hp->moe_inter, &L->experts[e], 1))) return r;
        }
        if (hp->n_shared > 0)
            if ((r = bind_ffn(m, NAME("mlp.shared_experts"), hp->moe_inter * hp->n_shared, &L->shared, 1))) return r;
    }
    if (l >= hp->n_layers) {
        if ((r = bind_vec(m, NAME("enorm.weight"), hp->dim, &L->enorm, 1))) return r;
        if ((r = bind_vec(m, NAME("hnorm.weight"), hp->dim, &L->hnorm, 1))) return r;
        if ((r = bind_mat(m, NAME("eh_proj.weight"), hp->dim, 2 * hp->dim, &L->eh_proj, 1))) return r;
        if ((r = bind_vec(m, NAME("shared_head.norm.weight"), hp->dim, &L->head_norm, 1))) return r;
        if ((r = bind_mat(m, NAME("embed_tokens.weight"), hp->vocab, hp->dim, &L->embed, 0))) return r;
        if ((r = bind_mat(m, NAME("shared_head.head.weight"), hp->vocab, hp->dim, &L->head, 0))) return r;
        if (!L->embed.data) L->embed = m->embed;     /* some exports drop the copies */
        if (!L->head.data) L->head = m->head;
    }
#undef NAME
    return CM384_OK;
}

/* YaRN as DeepSeek's code computes it: frequencies blended between
 * interpolation (/factor) and extrapolation over a ramp of pair indices. */
static void rope_setup(cm384_model *m) {
    const hparams *hp = &m->hp;
    int half = hp->qk_rope / 2, dim = hp->qk_rope;
    for (int k = 0; k < half; k++)
        m->rope_freq[k] = (float)(1.0 / pow(hp->rope_theta, (double)(2 * k) / dim));
    m->rope_mscale = 1.0f;
    m->attn_scale = (float)(1.0 / sqrt((double)(hp->qk_nope + hp->qk_rope)));
    if (!hp->yarn) return;
    double base = hp->rope_theta, orig = hp->yarn_orig_max;
#define CORR_DIM(rot) (dim * log(orig / ((rot) * 2 * M_PI)) / (2 * log(base)))
    double lo = floor(CORR_DIM(hp->beta_fast)), hi = ceil(CORR_DIM(hp->beta_slow));
#undef CORR_DIM
    if (lo < 0) lo = 0;
    if (hi > dim - 1) hi = dim - 1;
    if (lo == hi) hi += 0.001;
    for (int k = 0; k < half; k++) {
        double ramp = ((double)k - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double smooth = 1.0 - ramp;
        float f = m->rope_freq[k];
        m->rope_freq[k] = (float)(f / hp->yarn_factor * (1.0 - smooth) + f * smooth);
    }
#define GET_MSCALE(s) ((s) <= 0 ? 1.0 : 0.1 * (s) * log(hp->yarn_factor) + 1.0)
    double ms_all = GET_MSCALE(hp->mscale_all_dim), ms = GET_MSCALE(hp->mscale);
#undef GET_MSCALE
    m->attn_scale = (float)(m->attn_scale * ms_all * ms_all);
    m->rope_mscale = (float)(ms / ms_all);
}

void cm384_load_opts_init(cm384_load_opts *o) {
    memset(o, 0, sizeof *o);
    o->struct_size = sizeof *o;
    o->use_mmap = 1;
}

void cm384_model_free(cm384_model *m) {
    if (!m) return;
    tokenizer_free(m->tok);
    for (int i = 0; i < m->n_files; i++) {
        file_map_close(&m->files[i]);
        free(m->file_names[i]);
    }
    free(m->files);
    free(m->file_names);
    free(m->tensors.items);
    arena_free(&m->a);
    arena_free(&m->q8_arena);
    free(m->q8_block);
    if (m->q8_file.data) file_map_close(&m->q8_file);
    free(m->cache_dir);
    pthread_mutex_destroy(&m->q8_mu);
    free(m->path);
    free(m);
}

/* Finds the shards: the index's weight_map, or model.safetensors, or every
 * *.safetensors file in the directory. */
static int list_shards(cm384_model *m, const char *dir, json *index, int *has_index) {
    char *ip = path_join(dir, "model.safetensors.index.json");
    if (!ip) return fail(CM384_E_NOMEM, "out of memory");
    *has_index = file_exists(ip);
    int r = CM384_OK;
    char **names = NULL;
    int n = 0, cap = 0;
    if (*has_index) {
        r = json_load_file(ip, &m->a, index);
        const json *wm = r ? NULL : json_get(index, "weight_map");
        if (!r && (!wm || wm->type != JSON_OBJECT))
            r = fail(CM384_E_FORMAT, "%s: no \"weight_map\" object", ip);
        for (int i = 0; !r && i < wm->len; i++) {
            if (wm->kids[i].type != JSON_STRING || strchr(wm->kids[i].str, '/')) {
                r = fail(CM384_E_FORMAT, "%s: weight_map entry \"%s\" is not a shard file name", ip, wm->kids[i].key);
                break;
            }
            int seen = 0;
            for (int j = 0; j < n && !seen; j++) seen = !strcmp(names[j], wm->kids[i].str);
            if (seen) continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 16;
                char **nn = realloc(names, (size_t)cap * sizeof *names);
                if (!nn) { r = fail(CM384_E_NOMEM, "out of memory"); break; }
                names = nn;
            }
            names[n++] = (char *)wm->kids[i].str;
        }
    } else {
        static char single[] = "model.safetensors";
        char *sp = path_join(dir, single);
        if (sp && file_exists(sp)) {
            names = malloc(sizeof *names);
            if (names) names[n++] = single;
        }
        free(sp);
        if (!n) r = fail(CM384_E_IO, "%s: no model.safetensors and no model.safetensors.index.json", dir);
    }
    if (!r) {
        m->files = calloc((size_t)n, sizeof *m->files);
        m->file_names = calloc((size_t)n, sizeof *m->file_names);
        if (!m->files || !m->file_names) r = fail(CM384_E_NOMEM, "out of memory");
        for (int i = 0; !r && i < n; i++) {
            m->file_names[i] = path_join(dir, names[i]);
            if (!m->file_names[i]) r = fail(CM384_E_NOMEM, "out of memory");
            m->n_files = i + 1;
        }
    }
    free(names);
    free(ip);
    return r;
}

static int load_tokenizer_files(cm384_model *m, const char *dir, int required) {
    char *tj = path_join(dir, "tokenizer.json"), *tc = path_join(dir, "tokenizer_config.json");
    int r = CM384_OK;
    if (!tj || !tc) r = fail(CM384_E_NOMEM, "out of memory");
    else if (file_exists(tj)) r = tokenizer_load(&m->tok, tj, file_exists(tc) ? tc : NULL);
    else if (required) r = fail(CM384_E_IO, "%s: cannot open", tj);
    free(tj);
    free(tc);
    return r;
}

static int model_q8_at_load(cm384_model *m, int make);      /* section 9 */
static int model_finish(cm384_model *m) {
    const hparams *hp = &m->hp;
    rope_setup(m);
    /* whatever rope_scaling says, the frequencies and scales must be numbers */
    int rope_ok = isfinite(m->attn_scale) && m->attn_scale > 0 && isfinite(m->rope_mscale) && m->rope_mscale > 0;
    for (int k = 0; k < hp->qk_rope / 2; k++) rope_ok &= isfinite(m->rope_freq[k]) && m->rope_freq[k] > 0;
    if (!rope_ok)
        return fail(CM384_E_FORMAT, "%s: rope_theta %g and rope_scaling (factor %g, beta_fast %g, beta_slow %g, "
                    "mscale %g, mscale_all_dim %g, original_max_position_embeddings %d) give RoPE frequencies or an "
                    "attention scale that are not positive numbers", m->path, hp->rope_theta, hp->yarn_factor,
                    hp->beta_fast, hp->beta_slow, hp->mscale, hp->mscale_all_dim, hp->yarn_orig_max);
    /* active parameters per token, as DeepSeek counts them: the main model
       without the embedding table and without the routed experts a token
       does not visit */
    uint64_t expert = 3ull * hp->dim * hp->moe_inter, n_moe = 0;
    for (int l = 0; l < hp->n_layers; l++) n_moe += m->layers[l].is_moe;
    m->n_active_params = m->n_params - m->n_mtp_params - (uint64_t)hp->vocab * hp->dim -
                         n_moe * expert * (uint64_t)(hp->n_routed - hp->top_k);
    return CM384_OK;
}

static int model_load_dir(cm384_model *m, const char *dir, const cm384_load_opts *o) {
    int r;
    char *cp = path_join(dir, "config.json");
    if (!cp) return fail(CM384_E_NOMEM, "out of memory");
    json cfg;
    r = json_load_file(cp, &m->a, &cfg);
    if (!r) r = parse_config(&cfg, cp, &m->hp);
    free(cp);
    if (r) return r;
    hparams *hp = &m->hp;

    json index;
    int has_index = 0;
    if ((r = list_shards(m, dir, &index, &has_index))) return r;
    for (int i = 0; i < m->n_files; i++) {
        if ((r = file_map_open(&m->files[i], m->file_names[i], o->use_mmap))) return r;
        if ((r = st_read_header(&m->files[i], m->file_names[i], i, &m->a, &m->tensors))) return r;
        m->progress_total += m->files[i].size;
    }
    if (has_index) {
        /* every tensor the index promises must be in the shard it names */
        const json *wm = json_get(&index, "weight_map");
        for (int i = 0; i < wm->len; i++) {
            tensor_info *t = tensor_find(&m->tensors, wm->kids[i].key);
            const char *want = wm->kids[i].str;
            const char *have = t ? strrchr(m->file_names[t->file], '/') : NULL;
            have = have ? have + 1 : t ? m->file_names[t->file] : NULL;
            if (!t || strcmp(have, want))
                return fail(CM384_E_FORMAT, "%s/%s: tensor \"%s\" is listed in model.safetensors.index.json "
                            "but not found in that shard", dir, want, wm->kids[i].key);
        }
    }

    /* the MTP module is optional: used when its tensors are present */
    if (hp->n_mtp) {
        char n[128];
        snprintf(n, sizeof n, "model.layers.%d.eh_proj.weight", hp->n_layers);
        if (!tensor_find(&m->tensors, n)) hp->n_mtp = 0;
    }
    if ((r = bind_mat(m, "model.embed_tokens.weight", hp->vocab, hp->dim, &m->embed, 1))) return r;
    if ((r = bind_vec(m, "model.norm.weight", hp->dim, &m->final_norm, 1))) return r;
    if ((r = bind_mat(m, "lm_head.weight", hp->vocab, hp->dim, &m->head, !hp->tie_emb))) return r;
    if (!m->head.data) m->head = m->embed;
    m->main_dtype = m->embed.type;
    int nl = hp->n_layers + hp->n_mtp;
    if ((r = model_alloc_layers(m))) return r;
    for (int l = 0; l < nl; l++) {
        m->binding_mtp = l >= hp->n_layers;
        if ((r = bind_layer(m, l))) return r;
        if (m->layers[l].wkv_a.type != GL_BF16 || l == 0) m->main_dtype = m->layers[l].wkv_a.type;
    }
    if ((r = model_finish(m))) return r;
    m->progress_done = m->progress_total;          /* the stage ends at 100% */
    if ((r = report_progress(m, "tensors", 0))) return r;

    if (o->check_values) {
        /* scan every bound weight for NaN/Inf (slow; off by default) */
        m->progress_done = m->progress_total = 0;
        for (int i = 0; i < m->tensors.cap; i++) {
            tensor_info *t = &m->tensors.items[i];
            if (t->name && t->dtype >= 0 && t->dtype != GL_F8_E4M3) m->progress_total += t->nbytes;
        }
        for (int i = 0; i < m->tensors.cap; i++) {
            tensor_info *t = &m->tensors.items[i];
            if (!t->name || t->dtype < 0 || t->dtype == GL_F8_E4M3) continue;
            size_t es = gl_type_size(t->dtype), cnt = t->nbytes / es;
            for (size_t k = 0; k < cnt; k++) {
                float v;
                if (t->dtype == GL_F32) memcpy(&v, t->data + k * 4, 4);
                else { uint16_t h; memcpy(&h, t->data + k * 2, 2);
                       v = t->dtype == GL_BF16 ? gl_bf16_to_f32(h) : gl_f16_to_f32(h); }
                if (!isfinite(v))
                    return fail(CM384_E_FORMAT, "%s: tensor \"%s\" element %zu is not finite",
                                shard_name(m, t), t->name, k);
            }
            if ((r = report_progress(m, "check", t->nbytes))) return r;
        }
        if (m->progress_total == 0 && (r = report_progress(m, "check", 0))) return r;
    }
    if ((r = load_tokenizer_files(m, dir, 0))) return r;

    return model_q8_at_load(m, o->int8);
}

/* ---- GGUF models: llama.cpp's deepseek2 architecture ----
 * llama.cpp converts DeepSeek-V2/V2-Lite/V3/R1 (and V3-layout models such as
 * Moonlight and Kimi-K2) to architecture "deepseek2": hyper-parameters under
 * "deepseek2.*", tensors "blk.N.*" with the routed experts stacked into one
 * [n_expert][rows][cols] tensor per projection, and kv_b_proj either whole
 * (attn_kv_b, older files) or split per head into attn_k_b = W_uk^T
 * [H][kv_lora][nope] and attn_v_b = W_uv [H][v][kv_lora] -- exactly the
 * absorbed matrices cm384 computes with, so they are bound in place.  The
 * routing method is not stored: sigmoid gating means DeepSeek-V3's noaux_tc
 * (with the expert bias), softmax means V2's greedy top-k, group-limited
 * (each group's best score) when there are expert groups, as DeepSeek's
 * reference code does. */

typedef struct { const gguf_meta *g; const char *path; char arch[32]; } gguf_cfg;

static const gguf_kv *gcfg_find(const gguf_cfg *c, const char *name) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", c->arch, name);
    return gguf_find(c->g, key);
}

/* An integer of the architecture; missing -> dflt (required: an error). */
static int gcfg_int(const gguf_cfg *c, const char *name, int dflt, int required, int *out) {
    const gguf_kv *kv = gcfg_find(c, name);
    if (!kv) {
        if (required) return fail(CM384_E_FORMAT, "%s: no metadata \"%s.%s\"", c->path, c->arch, name);
        *out = dflt;
        return CM384_OK;
    }
    if (kv->type == GGUF_STR || kv->type == GGUF_ARR || kv->type == GGUF_F32 || kv->type == GGUF_F64 ||
        kv->num < 0 || kv->num > 1e9)
        return fail(CM384_E_FORMAT, "%s: metadata \"%s\" must be a non-negative integer", c->path, kv->key);
    *out = (int)kv->num;
    return CM384_OK;
}

static int gcfg_num(const gguf_cfg *c, const char *name, double dflt, double *out) {
    const gguf_kv *kv = gcfg_find(c, name);
    if (!kv) { *out = dflt; return CM384_OK; }
    if (kv->type == GGUF_STR || kv->type == GGUF_ARR || !isfinite(kv->num))
        return fail(CM384_E_FORMAT, "%s: metadata \"%s\" must be a number", c->path, kv->key);
    *out = kv->num;
    return CM384_OK;
}

/* A string value as (pointer, length) into the file; NULL if absent or not a string. */
static const char *gguf_strval(const gguf_meta *g, const char *key, size_t *len) {
    const gguf_kv *kv = gguf_find(g, key);
    if (!kv || kv->type != GGUF_STR) return NULL;
    *len = (size_t)kv->n;
    return (const char *)kv->p;
}

static int gguf_hparams(const gguf_cfg *c, const tensor_table *tt, hparams *hp) {
    memset(hp, 0, sizeof *hp);
    int r = 0, block_count = 0, kl_mla = 0, vl_mla = 0, kl = 0, vl = 0, gating = 0, norm = 0;
    double d;
    r |= gcfg_int(c, "block_count", 0, 1, &block_count);
    r |= gcfg_int(c, "nextn_predict_layers", 0, 0, &hp->n_mtp);
    r |= gcfg_int(c, "embedding_length", 0, 1, &hp->dim);
    r |= gcfg_int(c, "feed_forward_length", 0, 0, &hp->inter);
    r |= gcfg_int(c, "expert_feed_forward_length", 0, 0, &hp->moe_inter);
    r |= gcfg_int(c, "attention.head_count", 0, 1, &hp->n_heads);
    r |= gcfg_int(c, "attention.q_lora_rank", 0, 0, &hp->q_lora);
    r |= gcfg_int(c, "attention.kv_lora_rank", 0, 1, &hp->kv_lora);
    r |= gcfg_int(c, "rope.dimension_count", 0, 1, &hp->qk_rope);
    r |= gcfg_int(c, "attention.key_length_mla", 0, 0, &kl_mla);
    r |= gcfg_int(c, "attention.value_length_mla", 0, 0, &vl_mla);
    r |= gcfg_int(c, "attention.key_length", 0, 0, &kl);
    r |= gcfg_int(c, "attention.value_length", 0, 0, &vl);
    r |= gcfg_int(c, "leading_dense_block_count", 0, 0, &hp->n_dense);
    r |= gcfg_int(c, "expert_count", 0, 0, &hp->n_routed);
    r |= gcfg_int(c, "expert_shared_count", 0, 0, &hp->n_shared);
    r |= gcfg_int(c, "expert_used_count", 0, 0, &hp->top_k);
    r |= gcfg_int(c, "expert_group_count", 1, 0, &hp->n_group);
    r |= gcfg_int(c, "expert_group_used_count", 1, 0, &hp->topk_group);
    r |= gcfg_int(c, "expert_gating_func", 1, 0, &gating);
    r |= gcfg_int(c, "context_length", 4096, 0, &hp->max_pos);
    r |= gcfg_num(c, "expert_weights_norm", 0, &d); norm = d != 0;
    r |= gcfg_num(c, "expert_weights_scale", 1.0, &d); hp->route_scale = (float)d;
    r |= gcfg_num(c, "rope.freq_base", 10000.0, &hp->rope_theta);
    r |= gcfg_num(c, "attention.layer_norm_rms_epsilon", 1e-6, &d); hp->eps = (float)d;
    if (r) return CM384_E_FORMAT;
    if (hp->n_group < 1) hp->n_group = 1;
    if (hp->topk_group < 1) hp->topk_group = 1;
    /* MLA head sizes: the "_mla" keys in files with split k_b / v_b, else
       key_length = nope + rope and value_length = v per head */
    hp->qk_nope = (kl_mla ? kl_mla : kl) - hp->qk_rope;
    hp->v_head = vl_mla ? vl_mla : vl;
    if (hp->qk_nope <= 0 || hp->v_head <= 0)
        return fail(CM384_E_FORMAT, "%s: attention key/value lengths (%d, %d) do not leave MLA head sizes "
                    "(rope dimension %d)", c->path, kl_mla ? kl_mla : kl, hp->v_head, hp->qk_rope);
    if (gating != 1 && gating != 2)
        return fail(CM384_E_UNSUPPORTED, "%s: expert_gating_func %d (1 softmax, 2 sigmoid)", c->path, gating);
    hp->score_func = gating == 2 ? SCORE_SIGMOID : SCORE_SOFTMAX;
    hp->arch = gating == 2 ? ARCH_V3 : ARCH_V2;
    hp->topk_method = gating == 2 ? TOPK_NOAUX_TC : hp->n_group > 1 ? TOPK_GROUP_LIMITED : TOPK_GREEDY;
    hp->norm_topk = norm;
    hp->moe_freq = 1;
    /* nextn layers are counted in block_count; used when their tensors are there */
    if (hp->n_mtp < 0 || hp->n_mtp > block_count)
        return fail(CM384_E_FORMAT, "%s: nextn_predict_layers %d of %d blocks", c->path, hp->n_mtp, block_count);
    hp->n_layers = block_count - hp->n_mtp;
    char probe[64];
    snprintf(probe, sizeof probe, "blk.%d.nextn.eh_proj.weight", hp->n_layers);
    if (!tensor_find(tt, probe)) hp->n_mtp = 0;
    if (hp->n_mtp > 1) hp->n_mtp = 1;
    /* vocab: the key, else the embedding's rows */
    const tensor_info *emb = tensor_find(tt, "token_embd.weight");
    r = gcfg_int(c, "vocab_size", emb && emb->ndim == 2 ? (int)emb->shape[0] : 0, 0, &hp->vocab);
    if (r) return r;
    hp->tie_emb = !tensor_find(tt, "output.weight");
    size_t sl;
    const char *st = gguf_strval(c->g, "deepseek2.rope.scaling.type", &sl);
    if (!st) {
        char key[96];
        snprintf(key, sizeof key, "%s.rope.scaling.type", c->arch);
        st = gguf_strval(c->g, key, &sl);
    }
    if (st && !(sl == 4 && !memcmp(st, "none", 4))) {
        if (!(sl == 4 && !memcmp(st, "yarn", 4)))
            return fail(CM384_E_UNSUPPORTED, "%s: rope.scaling.type \"%.*s\" (only yarn)", c->path, (int)sl, st);
        double log_mul = 0;
        hp->yarn = 1;
        r |= gcfg_num(c, "rope.scaling.factor", 1.0, &hp->yarn_factor);
        r |= gcfg_int(c, "rope.scaling.original_context_length", 4096, 0, &hp->yarn_orig_max);
        r |= gcfg_num(c, "rope.scaling.yarn_beta_fast", 32, &hp->beta_fast);
        r |= gcfg_num(c, "rope.scaling.yarn_beta_slow", 1, &hp->beta_slow);
        r |= gcfg_num(c, "rope.scaling.yarn_log_multiplier", 0, &log_mul);
        if (r) return CM384_E_FORMAT;
        /* the converter writes 0.1 * mscale_all_dim; mscale itself is not kept
           (llama.cpp assumes mscale == mscale_all_dim, as V3's configs have it) */
        hp->mscale_all_dim = hp->mscale = log_mul / 0.1;
        if (hp->yarn_factor <= 1.0) hp->yarn = 0;
    }
    /* the same sanity checks as config.json */
    struct { const char *name; int v; } need[] = {
        {"vocab_size", hp->vocab}, {"embedding_length", hp->dim}, {"block_count", hp->n_layers},
        {"attention.head_count", hp->n_heads}, {"attention.kv_lora_rank", hp->kv_lora},
        {"rope.dimension_count", hp->qk_rope}};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (need[i].v <= 0) return fail(CM384_E_FORMAT, "%s: \"%s.%s\" missing or zero", c->path, c->arch, need[i].name);
    if (hp->qk_rope % 2) return fail(CM384_E_FORMAT, "%s: rope.dimension_count must be even", c->path);
    /* bounds that keep every size the binding multiplies within int (real
       models are far inside them; the tensors' own shapes are checked next) */
    struct { const char *name; int v, max; } lim[] = {
        {"embedding_length", hp->dim, 1 << 20}, {"feed_forward_length", hp->inter, 1 << 20},
        {"expert_feed_forward_length", hp->moe_inter, 1 << 20}, {"attention.head_count", hp->n_heads, 1024},
        {"attention.q_lora_rank", hp->q_lora, 1 << 16}, {"attention.kv_lora_rank", hp->kv_lora, 1 << 16},
        {"rope.dimension_count", hp->qk_rope, 1 << 14}, {"qk_nope", hp->qk_nope, 1 << 16},
        {"v_head", hp->v_head, 1 << 16}, {"expert_shared_count", hp->n_shared, 64}, {"block_count", hp->n_layers, 4096},
        {"vocab_size", hp->vocab, 1 << 24}};
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
        if (lim[i].v > lim[i].max)
            return fail(CM384_E_UNSUPPORTED, "%s: %s %d is beyond %d", c->path, lim[i].name, lim[i].v, lim[i].max);
    if (hp->n_routed > 0) {
        if (hp->top_k <= 0 || hp->top_k > hp->n_routed || hp->moe_inter <= 0)
            return fail(CM384_E_FORMAT, "%s: bad MoE sizes (expert_used_count %d, expert_count %d, "
                        "expert_feed_forward_length %d)", c->path, hp->top_k, hp->n_routed, hp->moe_inter);
        if (hp->n_routed % hp->n_group || hp->topk_group > hp->n_group)
            return fail(CM384_E_FORMAT, "%s: expert groups %d / %d do not divide %d experts",
                        c->path, hp->n_group, hp->topk_group, hp->n_routed);
        if (hp->top_k > 64 || hp->n_routed > 1024 || hp->n_group > 256)
            return fail(CM384_E_UNSUPPORTED, "%s: more than 64 experts per token, 1024 experts or 256 groups", c->path);
    } else hp->top_k = hp->moe_inter = hp->n_shared = 0;   /* no routed experts: the MoE numbers mean
                                                               nothing, and would size scratch */
    if ((hp->n_dense > 0 || hp->n_routed == 0) && hp->inter <= 0)
        return fail(CM384_E_FORMAT, "%s: feed_forward_length missing", c->path);
    const gguf_kv *b = gguf_find(c->g, "tokenizer.ggml.bos_token_id"), *e = gguf_find(c->g, "tokenizer.ggml.eos_token_id");
    hp->bos = b && b->type != GGUF_STR && b->type != GGUF_ARR && b->num >= 0 && b->num < hp->vocab ? (int)b->num : -1;
    hp->eos = e && e->type != GGUF_STR && e->type != GGUF_ARR && e->num >= 0 && e->num < hp->vocab ? (int)e->num : -1;
    return CM384_OK;
}

/* Binds item idx of a stacked 3-D tensor [n][R][cols], rows [row0, row0+rows). */
static int bind_slice(cm384_model *m, const char *name, int idx, int n, int row0, int rows, int R, int cols, gl_mat *out) {
    memset(out, 0, sizeof *out);
    tensor_info *t = tensor_find(&m->tensors, name);
    if (!t) return fail(CM384_E_FORMAT, "%s: missing tensor \"%s\" (expected shape [%d, %d, %d])", m->path, name, n, R, cols);
    if (t->dtype < 0 || t->dtype == GL_F8_E4M3)
        return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has type %s; GGUF weights must be F32, F16, BF16, "
                    "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K", shard_name(m, t), name, t->dtype_name);
    if (t->ndim != 3 || t->shape[0] != n || t->shape[1] != R || t->shape[2] != cols)
        return fail(CM384_E_FORMAT, "%s: tensor \"%s\" has the wrong shape (expected [%d, %d, %d])",
                    shard_name(m, t), name, n, R, cols);
    size_t rb = gl_row_bytes(t->dtype, cols);
    out->type = t->dtype;
    out->rows = rows;
    out->cols = cols;
    out->data = t->data + ((size_t)idx * (size_t)R + (size_t)row0) * rb;
    m->n_params += (uint64_t)rows * (uint64_t)cols;
    if (m->binding_mtp) m->n_mtp_params += (uint64_t)rows * (uint64_t)cols;
    m->weight_bytes += (uint64_t)rows * rb;
    return CM384_OK;
}

static int bind_layer_gguf(cm384_model *m, int l) {
    const hparams *hp = &m->hp;
    layer_w *L = &m->layers[l];
    char n[160], n2[160];
    int r, H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope, D = hp->dim;
#define GN(fmt) (snprintf(n, sizeof n, "blk.%d." fmt, l), n)
    if ((r = bind_vec(m, GN("attn_norm.weight"), D, &L->attn_norm, 1))) return r;
    if ((r = bind_vec(m, GN("ffn_norm.weight"), D, &L->ffn_norm, 1))) return r;
    if (hp->q_lora) {
        if ((r = bind_mat(m, GN("attn_q_a.weight"), hp->q_lora, D, &L->wq_a, 1))) return r;
        if ((r = bind_vec(m, GN("attn_q_a_norm.weight"), hp->q_lora, &L->q_norm, 1))) return r;
        if ((r = bind_mat(m, GN("attn_q_b.weight"), H * qk, hp->q_lora, &L->wq_b, 1))) return r;
    } else {
        if ((r = bind_mat(m, GN("attn_q.weight"), H * qk, D, &L->wq, 1))) return r;
    }
    if ((r = bind_mat(m, GN("attn_kv_a_mqa.weight"), hp->kv_lora + hp->qk_rope, D, &L->wkv_a, 1))) return r;
    if ((r = bind_vec(m, GN("attn_kv_a_norm.weight"), hp->kv_lora, &L->kv_norm, 1))) return r;
    if ((r = bind_mat(m, GN("attn_output.weight"), D, H * hp->v_head, &L->wo, 1))) return r;
    L->w_uk_t = arena_alloc(&m->a, (size_t)H * sizeof(gl_mat));
    L->w_uv = arena_alloc(&m->a, (size_t)H * sizeof(gl_mat));
    if (!L->w_uk_t || !L->w_uv) return fail(CM384_E_NOMEM, "out of memory");
    if (tensor_find(&m->tensors, GN("attn_k_b.weight"))) {
        snprintf(n2, sizeof n2, "blk.%d.attn_v_b.weight", l);
        for (int h = 0; h < H; h++) {
            if ((r = bind_slice(m, n, h, H, 0, hp->kv_lora, hp->kv_lora, hp->qk_nope, &L->w_uk_t[h]))) return r;
            if ((r = bind_slice(m, n2, h, H, 0, hp->v_head, hp->v_head, hp->kv_lora, &L->w_uv[h]))) return r;
        }
    } else {
        /* older files: kv_b whole; W_uk^T derived as for safetensors (in fp32
           for block formats: their values times a transpose need no rounding) */
        if ((r = bind_mat(m, GN("attn_kv_b.weight"), H * (hp->qk_nope + hp->v_head), hp->kv_lora, &L->wkv_b, 1)))
            return r;
        for (int h = 0; h < H; h++) {
            int base = h * (hp->qk_nope + hp->v_head);
            if ((r = derive_mat(m, &L->wkv_b, base, hp->qk_nope, 1, &L->w_uk_t[h]))) return r;
            gl_mat v = L->wkv_b;
            v.rows = hp->v_head;
            v.data = (const uint8_t *)L->wkv_b.data + (size_t)(base + hp->qk_nope) * gl_row_bytes(v.type, hp->kv_lora);
            L->w_uv[h] = v;
        }
        if ((r = kv_b_views(m, L))) return r;
    }
    L->is_moe = layer_is_moe(hp, l);
    if (!L->is_moe) {
        if ((r = bind_mat(m, GN("ffn_gate.weight"), hp->inter, D, &L->dense.gate, 1))) return r;
        if ((r = bind_mat(m, GN("ffn_up.weight"), hp->inter, D, &L->dense.up, 1))) return r;
        if ((r = bind_mat(m, GN("ffn_down.weight"), D, hp->inter, &L->dense.down, 1))) return r;
    } else {
        int E = hp->n_routed, F = hp->moe_inter;
        if ((r = bind_mat(m, GN("ffn_gate_inp.weight"), E, D, &L->router, 1))) return r;
        if ((r = bind_vec(m, GN("exp_probs_b.bias"), E, &L->router_bias, hp->topk_method == TOPK_NOAUX_TC))) return r;
        L->experts = arena_alloc(&m->a, (size_t)E * sizeof(ffn_w));
        if (!L->experts) return fail(CM384_E_NOMEM, "out of memory");
        int fused = tensor_find(&m->tensors, GN("ffn_gate_up_exps.weight")) != NULL;
        char ng[160], nu[160], nd[160];
        snprintf(ng, sizeof ng, "blk.%d.%s.weight", l, fused ? "ffn_gate_up_exps" : "ffn_gate_exps");
        snprintf(nu, sizeof nu, "blk.%d.%s.weight", l, fused ? "ffn_gate_up_exps" : "ffn_up_exps");
        snprintf(nd, sizeof nd, "blk.%d.ffn_down_exps.weight", l);
        for (int e = 0; e < E; e++) {
            ffn_w *f = &L->experts[e];
            if ((r = bind_slice(m, ng, e, E, 0, F, fused ? 2 * F : F, D, &f->gate))) return r;
            if ((r = bind_slice(m, nu, e, E, fused ? F : 0, F, fused ? 2 * F : F, D, &f->up))) return r;
            if ((r = bind_slice(m, nd, e, E, 0, D, D, F, &f->down))) return r;
        }
        if (hp->n_shared > 0) {
            int S = F * hp->n_shared;
            if ((r = bind_mat(m, GN("ffn_gate_shexp.weight"), S, D, &L->shared.gate, 1))) return r;
            if ((r = bind_mat(m, GN("ffn_up_shexp.weight"), S, D, &L->shared.up, 1))) return r;
            if ((r = bind_mat(m, GN("ffn_down_shexp.weight"), D, S, &L->shared.down, 1))) return r;
        }
    }
    if (l >= hp->n_layers) {
        if ((r = bind_vec(m, GN("nextn.enorm.weight"), D, &L->enorm, 1))) return r;
        if ((r = bind_vec(m, GN("nextn.hnorm.weight"), D, &L->hnorm, 1))) return r;
        if ((r = bind_mat(m, GN("nextn.eh_proj.weight"), D, 2 * D, &L->eh_proj, 1))) return r;
        if ((r = bind_vec(m, GN("nextn.shared_head_norm.weight"), D, &L->head_norm, 1))) return r;
        if ((r = bind_mat(m, GN("nextn.embed_tokens.weight"), hp->vocab, D, &L->embed, 0))) return r;
        if ((r = bind_mat(m, GN("nextn.shared_head_head.weight"), hp->vocab, D, &L->head, 0))) return r;
        if (!L->embed.data) L->embed = m->embed;
        if (!L->head.data) L->head = m->head;
    }
#undef GN
    return CM384_OK;
}

static void sb_json_str(strbuf *b, const char *s, size_t n) {
    sb_putn(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char esc[8];
        if (ch == '"' || ch == '\\') { esc[0] = '\\'; esc[1] = (char)ch; sb_putn(b, esc, 2); }
        else if (ch < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", ch); sb_putn(b, esc, 6); }
        else sb_putn(b, (const char *)&ch, 1);
    }
    sb_putn(b, "\"", 1);
}

/* GGUF token types (llama.cpp's llama_token_type). */
enum { GGUF_TOK_NORMAL = 1, GGUF_TOK_UNKNOWN = 2, GGUF_TOK_CONTROL = 3, GGUF_TOK_USER_DEFINED = 4,
       GGUF_TOK_UNUSED = 5, GGUF_TOK_BYTE = 6 };

/* The tokenizer a GGUF file carries (tokenizer.ggml.*), read through the
 * same code as tokenizer.json: the arrays are written out as the
 * tokenizer.json they came from -- every token in the vocab at its id,
 * control and user-defined tokens also as added tokens (special / not), the
 * merges, and the pre-tokenizer the file names. */
static int gguf_tokenizer(tokenizer **out, const char *path, const gguf_meta *g) {
    *out = NULL;
    size_t ml = 0, pl = 0;   /* set by gguf_strval when the key is there (gcc -O3 cannot see it) */
    const char *model = gguf_strval(g, "tokenizer.ggml.model", &ml), *pre = gguf_strval(g, "tokenizer.ggml.pre", &pl);
    const gguf_kv *toks = gguf_find(g, "tokenizer.ggml.tokens"), *types = gguf_find(g, "tokenizer.ggml.token_type");
    const gguf_kv *merges = gguf_find(g, "tokenizer.ggml.merges");
    if (!model) return fail(CM384_E_FORMAT, "%s: no tokenizer (tokenizer.ggml.model)", path);
    if (!(ml == 4 && !memcmp(model, "gpt2", 4)))
        return fail(CM384_E_UNSUPPORTED, "%s: tokenizer.ggml.model \"%.*s\" (only gpt2: byte-level BPE)", path, (int)ml, model);
    if (!toks || toks->type != GGUF_ARR || toks->arr_type != GGUF_STR || toks->n == 0 || toks->n > TOK_MAX_ID)
        return fail(CM384_E_FORMAT, "%s: tokenizer.ggml.tokens must be a non-empty array of strings", path);
    if (types && (types->type != GGUF_ARR || types->arr_type != GGUF_I32 || types->n != toks->n))
        return fail(CM384_E_FORMAT, "%s: tokenizer.ggml.token_type must be an i32 array as long as the tokens", path);
    if (merges && (merges->type != GGUF_ARR || merges->arr_type != GGUF_STR))
        return fail(CM384_E_FORMAT, "%s: tokenizer.ggml.merges must be an array of strings", path);
    const char *pre_json;
    if (!pre || (pl == 7 && !memcmp(pre, "default", 7))) pre_json = "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}";
    else if (pl == 11 && !memcmp(pre, "deepseek-v3", 11)) pre_json = gguf_pre_deepseek_v3;
    else if (pl == 12 && !memcmp(pre, "deepseek-llm", 12)) pre_json = gguf_pre_deepseek_llm;
    else return fail(CM384_E_UNSUPPORTED, "%s: pre-tokenizer \"%.*s\" (supported: deepseek-v3, deepseek-llm, default)",
                     path, (int)pl, pre);
    strbuf b = {0};
    sb_puts(&b, "{\"model\":{\"type\":\"BPE\",\"vocab\":{");
    const uint8_t *p = toks->p;
    int first = 1;
    /* added tokens as a second list, written after the vocab */
    strbuf added = {0};
    sb_puts(&added, "\"added_tokens\":[");
    int first_added = 1;
    for (uint64_t i = 0; i < toks->n; i++) {
        uint64_t len = gguf_le(p, 8);
        const char *s = (const char *)p + 8;
        p += 8 + len;
        int type = types ? (int)(int32_t)gguf_le(types->p + 4 * i, 4) : GGUF_TOK_NORMAL;
        if (type == GGUF_TOK_UNUSED) continue;
        if (!first) sb_puts(&b, ",");
        first = 0;
        sb_json_str(&b, s, (size_t)len);
        char num[48];
        snprintf(num, sizeof num, ":%llu", (unsigned long long)i);
        sb_puts(&b, num);
        if (type == GGUF_TOK_CONTROL || type == GGUF_TOK_USER_DEFINED) {
            if (!first_added) sb_puts(&added, ",");
            first_added = 0;
            snprintf(num, sizeof num, "{\"id\":%llu,\"content\":", (unsigned long long)i);
            sb_puts(&added, num);
            sb_json_str(&added, s, (size_t)len);
            sb_puts(&added, type == GGUF_TOK_CONTROL ? ",\"special\":true,\"normalized\":false}"
                                                     : ",\"special\":false,\"normalized\":true}");
        }
    }
    sb_puts(&b, "},\"merges\":[");
    p = merges ? merges->p : NULL;
    for (uint64_t i = 0; merges && i < merges->n; i++) {
        uint64_t len = gguf_le(p, 8);
        if (i) sb_puts(&b, ",");
        sb_json_str(&b, (const char *)p + 8, (size_t)len);
        p += 8 + len;
    }
    sb_puts(&b, "]},");
    sb_puts(&added, "],");
    if (added.p) sb_putn(&b, added.p, added.n);
    free(added.p);
    sb_puts(&b, "\"pre_tokenizer\":");
    sb_puts(&b, pre_json);
    sb_puts(&b, ",\"decoder\":{\"type\":\"ByteLevel\"}}");
    if (b.oom || added.oom) { free(b.p); return fail(CM384_E_NOMEM, "%s: out of memory for the tokenizer", path); }

    tok_loader L;
    memset(&L, 0, sizeof L);
    L.path = path;
    L.t = calloc(1, sizeof *L.t);
    json root;
    int r = L.t ? json_parse(b.p, b.n, &L.tmp, &root, path) : fail(CM384_E_NOMEM, "%s: out of memory", path);
    if (!r) r = tokenizer_build(&L, &root);
    if (!r) {
        tokenizer *t = L.t;
        /* the name the file gives, as written (tokenizer_build matched it too) */
        const gguf_kv *bk = gguf_find(g, "tokenizer.ggml.bos_token_id"), *ek = gguf_find(g, "tokenizer.ggml.eos_token_id");
        t->bos_id = bk && bk->type != GGUF_STR && bk->type != GGUF_ARR && bk->num >= 0 && bk->num < t->n_ids ? (int)bk->num : -1;
        t->eos_id = ek && ek->type != GGUF_STR && ek->type != GGUF_ARR && ek->num >= 0 && ek->num < t->n_ids ? (int)ek->num : -1;
        t->bos_text = "";
        if (t->bos_id >= 0) {
            const char *bt = L.text[t->bos_id];
            char *copy = bt ? arena_strndup(&t->mem, bt, (size_t)L.text_len[t->bos_id]) : NULL;
            if (bt && !copy) r = fail(CM384_E_NOMEM, "%s: out of memory", path);
            if (copy) t->bos_text = copy;
        }
        t->eos_text = "";
        if (!r && t->eos_id >= 0 && L.text[t->eos_id]) {
            char *copy = arena_strndup(&t->mem, L.text[t->eos_id], (size_t)L.text_len[t->eos_id]);
            if (!copy) r = fail(CM384_E_NOMEM, "%s: out of memory", path);
            else t->eos_text = copy;
        }
        t->chat_format = CM384_E_NOT_FOUND;
        size_t tl;
        const char *tpl = gguf_strval(g, "tokenizer.chat_template", &tl);
        if (!r && tpl) r = tokenizer_keep_template(t, tpl, tl, path);
    }
    tok_loader_free(&L);
    free(b.p);
    if (r) { tokenizer_free(L.t); return r; }
    *out = L.t;
    return CM384_OK;
}

/* What both loaders finish with: RoPE tables and the active-parameter count. */
static int model_finish(cm384_model *m);

static int model_load_gguf(cm384_model *m, const char *path, const cm384_load_opts *o) {
    int r;
    m->files = calloc(1, sizeof *m->files);
    m->file_names = calloc(1, sizeof *m->file_names);
    if (!m->files || !m->file_names || !(m->file_names[0] = strdup(path))) return fail(CM384_E_NOMEM, "out of memory");
    m->n_files = 1;
    if ((r = file_map_open(&m->files[0], path, o->use_mmap))) return r;
    gguf_meta g;
    if ((r = gguf_read(&m->files[0], path, 0, &m->a, &g, &m->tensors))) return r;
    m->progress_total = m->files[0].size;
    size_t al;
    const char *arch = gguf_strval(&g, "general.architecture", &al);
    if (!arch) return fail(CM384_E_FORMAT, "%s: no general.architecture", path);
    if (!(al == 9 && !memcmp(arch, "deepseek2", 9)))
        return fail(CM384_E_UNSUPPORTED, "%s: architecture \"%.*s\" is not supported (only deepseek2: "
                    "DeepSeek-V2, V2-Lite, V3, R1 and V3-layout models)", path, (int)(al < 64 ? al : 64), arch);
    if (m->tensors.n == 0) {
        /* a vocab-only file: a tokenizer-only model */
        m->tokenizer_only = 1;
        return gguf_tokenizer(&m->tok, path, &g);
    }
    gguf_cfg c = {&g, path, "deepseek2"};
    if ((r = gguf_hparams(&c, &m->tensors, &m->hp))) return r;
    hparams *hp = &m->hp;
    if ((r = bind_mat(m, "token_embd.weight", hp->vocab, hp->dim, &m->embed, 1))) return r;
    if ((r = bind_vec(m, "output_norm.weight", hp->dim, &m->final_norm, 1))) return r;
    if ((r = bind_mat(m, "output.weight", hp->vocab, hp->dim, &m->head, !hp->tie_emb))) return r;
    if (!m->head.data) m->head = m->embed;
    m->main_dtype = m->embed.type;
    int nl = hp->n_layers + hp->n_mtp;
    if ((r = model_alloc_layers(m))) return r;
    for (int l = 0; l < nl; l++) {
        m->binding_mtp = l >= hp->n_layers;
        if ((r = bind_layer_gguf(m, l))) return r;
        if (l == 0 || (hp->n_routed > 0 && m->layers[l].is_moe && l < hp->n_layers))
            m->main_dtype = m->layers[l].is_moe ? m->layers[l].experts[0].gate.type : m->layers[l].dense.gate.type;
    }
    if ((r = model_finish(m))) return r;
    m->progress_done = m->progress_total;          /* the stage ends at 100% */
    if ((r = report_progress(m, "tensors", 0))) return r;
    if ((r = gguf_tokenizer(&m->tok, path, &g))) return r;
    return model_q8_at_load(m, o->int8);
}

int cm384_model_load(const char *path, const cm384_load_opts *opts, cm384_model **out) {
    if (out) *out = NULL;
    if (!path || !out) return fail(CM384_E_INVALID, "cm384_model_load: path and out must not be NULL");
    cm384_load_opts o;
    cm384_load_opts_init(&o);
    if (opts) {
        if (opts->struct_size < offsetof(cm384_load_opts, use_mmap))
            return fail(CM384_E_INVALID, "cm384_model_load: opts->struct_size %zu is too small", opts->struct_size);
        memcpy(&o, opts, opts->struct_size < sizeof o ? opts->struct_size : sizeof o);
    }
    struct stat st;
    if (stat(path, &st) != 0) return fail(CM384_E_IO, "%s: cannot open: %s", path, strerror(errno));
    cm384_model *m = calloc(1, sizeof *m);
    if (!m) return fail(CM384_E_NOMEM, "out of memory");
    m->path = strdup(path);
    pthread_mutex_init(&m->q8_mu, NULL);
    m->progress = o.progress;
    m->progress_user = o.progress_user;
    m->use_mmap = o.use_mmap;
    if (opts && opts->struct_size > offsetof(cm384_load_opts, cache_dir) && o.cache_dir && o.cache_dir[0]) {
        m->cache_dir = strdup(o.cache_dir);
        if (!m->cache_dir) { free(m->path); pthread_mutex_destroy(&m->q8_mu); free(m); return fail(CM384_E_NOMEM, "out of memory"); }
    }
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    m->phys_mem = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    int r;
    if (!m->path) r = fail(CM384_E_NOMEM, "out of memory");
    else if (S_ISDIR(st.st_mode)) {
        r = model_load_dir(m, path, &o);
    } else {
        size_t n = strlen(path);
        if (n >= 5 && !strcmp(path + n - 5, ".gguf")) {
            r = model_load_gguf(m, path, &o);
        } else if (n >= 5 && !strcmp(path + n - 5, ".json")) {
            /* a tokenizer.json on its own: a tokenizer-only model */
            char *dir = strdup(path), *slash = dir ? strrchr(dir, '/') : NULL;
            char *tc = NULL;
            if (dir) {
                if (slash) slash[1] = 0; else strcpy(dir, ".");
                tc = path_join(dir, "tokenizer_config.json");
            }
            m->tokenizer_only = 1;
            r = !dir || !tc ? fail(CM384_E_NOMEM, "out of memory")
                            : tokenizer_load(&m->tok, path, file_exists(tc) ? tc : NULL);
            free(dir);
            free(tc);
        } else {
            r = fail(CM384_E_UNSUPPORTED, "%s: not a model directory, tokenizer.json or .gguf file", path);
        }
    }
    if (r) { cm384_model_free(m); return r; }
    *out = m;
    return CM384_OK;
}

/* ---- GGUF export ----
 * Writes a loaded model as llama.cpp's converter would: architecture
 * deepseek2, the hyper-parameters under deepseek2.*, the experts stacked,
 * kv_b_proj split per head into attn_k_b (W_uk^T) and attn_v_b, norms,
 * biases and the router in F32, the other matrices in the chosen type
 * (Q8_0 falls back to F16 for rows that are not whole blocks, as the
 * converter does), the tokenizer and chat template, and the MTP layer as
 * blk.N.nextn.* when the model has one.  Rows are converted one at a time
 * while writing: nothing is expanded in memory. */

/* One tensor to write: `n_src` matrices of rows x cols stacked (or a vector). */
typedef struct {
    char          name[96];
    int           type;          /* gl type written                            */
    int           ndim;
    int64_t       ne[3];         /* ggml order: cols first                      */
    const gl_mat *src;           /* n_src matrices of rows x cols, or NULL      */
    int           n_src, rows, cols;
    const float  *vec;           /* or one fp32 vector of cols values           */
    size_t        nbytes;
    uint64_t      offset;
} gw_tensor;

typedef struct {
    FILE       *f;
    const char *path;
    int         err;
    uint64_t    n_kv;
} gguf_writer;

static void gw_bytes(gguf_writer *w, const void *p, size_t n) {
    if (!w->err && n && fwrite(p, 1, n, w->f) != n) w->err = 1;
}
static void gw_u32(gguf_writer *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    gw_bytes(w, b, 4);
}
static void gw_u64(gguf_writer *w, uint64_t v) { gw_u32(w, (uint32_t)v); gw_u32(w, (uint32_t)(v >> 32)); }
static void gw_str(gguf_writer *w, const char *s, size_t n) { gw_u64(w, n); gw_bytes(w, s, n); }
static void gw_key(gguf_writer *w, const char *key, int type) { gw_str(w, key, strlen(key)); gw_u32(w, (uint32_t)type); w->n_kv++; }
static void gw_kv_u32(gguf_writer *w, const char *key, uint32_t v) { gw_key(w, key, GGUF_U32); gw_u32(w, v); }
static void gw_kv_f32(gguf_writer *w, const char *key, float v) {
    uint32_t u; memcpy(&u, &v, 4);
    gw_key(w, key, GGUF_F32); gw_u32(w, u);
}
static void gw_kv_bool(gguf_writer *w, const char *key, int v) { gw_key(w, key, GGUF_BOOL); uint8_t b = (uint8_t)!!v; gw_bytes(w, &b, 1); }
static void gw_kv_str(gguf_writer *w, const char *key, const char *s) { gw_key(w, key, GGUF_STR); gw_str(w, s, strlen(s)); }

static uint32_t gw_ggml_type(int type) {
    switch (type) {
    case GL_F32: return 0;
    case GL_F16: return 1;
    case GL_BF16: return 30;
    case GL_Q8_0: return 8;
    default: return 0;
    }
}

/* The token string llama.cpp's converter writes: a vocab token in GPT-2's
 * byte-map characters, an added token as its text. */
static void gw_token_text(const tokenizer *t, int id, strbuf *b) {
    const char *p = NULL;
    int n = 0;
    b->n = 0;
    if (b->p) b->p[0] = 0;
    if (tokenizer_piece(t, id, &p, &n) != 0) return;
    if (!(t->piece_flags[id] & TOKF_BYTELEVEL)) { sb_putn(b, p, (size_t)n); return; }
    for (int i = 0; i < n; i++) {
        char u[4];
        int k = utf8_put(u, bytelevel_cp((uint8_t)p[i]));
        sb_putn(b, u, (size_t)k);
    }
}

static int gw_looks_special(const char *s, size_t n) {
    return (n >= 4 && !memcmp(s, "<|", 2) && !memcmp(s + n - 2, "|>", 2)) ||
           (n >= 8 && !memcmp(s, "<｜", 4) && !memcmp(s + n - 4, "｜>", 4));
}

static int bpe_merge_rank_cmp(const void *a, const void *b) {
    const bpe_merge *x = a, *y = b;
    return x->rank < y->rank ? -1 : x->rank > y->rank;
}

static void gw_tokenizer(gguf_writer *w, const cm384_model *m, int n) {
    const tokenizer *t = m->tok;
    strbuf s = {0};
    gw_kv_str(w, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(w, "tokenizer.ggml.pre", t->pre_name ? t->pre_name : "default");
    gw_key(w, "tokenizer.ggml.tokens", GGUF_ARR);
    gw_u32(w, GGUF_STR);
    gw_u64(w, (uint64_t)n);
    for (int id = 0; id < n; id++) {
        if (id < t->n_ids && (t->piece_flags[id] & TOKF_EXISTS)) gw_token_text(t, id, &s);
        else { char pad[32]; int k = snprintf(pad, sizeof pad, "[PAD%d]", id); s.n = 0; sb_putn(&s, pad, (size_t)k); }
        gw_str(w, s.p ? s.p : "", s.n);
    }
    gw_key(w, "tokenizer.ggml.token_type", GGUF_ARR);
    gw_u32(w, GGUF_I32);
    gw_u64(w, (uint64_t)n);
    for (int id = 0; id < n; id++) {
        int type = GGUF_TOK_UNUSED;
        if (id < t->n_ids && (t->piece_flags[id] & TOKF_EXISTS)) {
            type = GGUF_TOK_NORMAL;
            if (t->piece_flags[id] & TOKF_ADDED) {
                const char *p; int k;
                tokenizer_piece(t, id, &p, &k);
                type = (t->piece_flags[id] & TOKF_SPECIAL) || gw_looks_special(p, (size_t)k) ? GGUF_TOK_CONTROL
                                                                                             : GGUF_TOK_USER_DEFINED;
            }
        }
        gw_u32(w, (uint32_t)type);
    }
    /* merges in rank order */
    size_t nm = 0, cap = (size_t)t->merge_mask + 1;
    bpe_merge *ms = malloc(cap * sizeof *ms);
    if (!ms) { w->err = 2; free(s.p); return; }
    for (size_t i = 0; i < cap; i++) if (t->merges[i].a != UINT32_MAX) ms[nm++] = t->merges[i];
    qsort(ms, nm, sizeof *ms, bpe_merge_rank_cmp);
    gw_key(w, "tokenizer.ggml.merges", GGUF_ARR);
    gw_u32(w, GGUF_STR);
    gw_u64(w, nm);
    strbuf a = {0};
    for (size_t i = 0; i < nm; i++) {
        gw_token_text(t, (int)ms[i].a, &s);
        gw_token_text(t, (int)ms[i].b, &a);
        gw_u64(w, s.n + 1 + a.n);
        gw_bytes(w, s.p, s.n);
        gw_bytes(w, " ", 1);
        gw_bytes(w, a.p, a.n);
    }
    free(ms);
    free(a.p);
    free(s.p);
    if (t->bos_id >= 0) gw_kv_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)t->bos_id);
    if (t->eos_id >= 0) gw_kv_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)t->eos_id);
    if (t->chat_template) gw_kv_str(w, "tokenizer.chat_template", t->chat_template);
}

/* Adds a tensor of n_src stacked matrices (n_src 0: one matrix, 2-D). */
static void gw_add(gw_tensor *ts, int *nt, int out_type, const char *name, const gl_mat *src, int n_src) {
    gw_tensor *x = &ts[(*nt)++];
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->src = src;
    x->n_src = n_src ? n_src : 1;
    x->rows = src[0].rows;
    x->cols = src[0].cols;
    x->type = out_type;
    if (x->type == GL_Q8_0 && x->cols % 32) x->type = GL_F16;   /* as the converter falls back */
    x->ndim = n_src ? 3 : 2;
    x->ne[0] = x->cols; x->ne[1] = x->rows; x->ne[2] = x->n_src;
    x->nbytes = gl_row_bytes(x->type, x->cols) * (size_t)x->rows * (size_t)x->n_src;
}

static void gw_add_vec(gw_tensor *ts, int *nt, const char *name, const float *v, int n) {
    gw_tensor *x = &ts[(*nt)++];
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->vec = v;
    x->type = GL_F32;
    x->ndim = 1;
    x->ne[0] = n; x->rows = 1; x->cols = n; x->n_src = 1;
    x->nbytes = (size_t)n * 4;
}

/* Converts and writes one tensor, a row at a time. */
static void gw_data(gguf_writer *w, const gw_tensor *x, float *row, uint8_t *buf) {
    if (x->vec) { gw_bytes(w, x->vec, (size_t)x->cols * 4); return; }
    size_t rb = gl_row_bytes(x->type, x->cols);
    for (int s = 0; s < x->n_src && !w->err; s++)
        for (int r = 0; r < x->rows && !w->err; r++) {
            gl_row_to_f32(&x->src[s], r, row);
            switch (x->type) {
            case GL_F32: memcpy(buf, row, rb); break;
            case GL_F16: for (int c = 0; c < x->cols; c++) { uint16_t h = gl_f32_to_f16(row[c]); memcpy(buf + 2 * c, &h, 2); } break;
            case GL_BF16: for (int c = 0; c < x->cols; c++) { uint16_t h = gl_f32_to_bf16(row[c]); memcpy(buf + 2 * c, &h, 2); } break;
            case GL_Q8_0: gl_quantize_row_q8_0(row, x->cols, buf); break;
            }
            gw_bytes(w, buf, rb);
        }
}

/* A tokenizer-only model: a vocab-only file (no tensors), as the converter's
 * --vocab-only writes. */
static int gguf_save_vocab_only(const cm384_model *m, const char *path) {
    gguf_writer w = {fopen(path, "wb"), path, 0, 0};
    if (!w.f) return fail(CM384_E_IO, "%s: cannot create: %s", path, strerror(errno));
    gw_u32(&w, 0x46554747u);
    gw_u32(&w, 3);
    gw_u64(&w, 0);
    long kv_count_at = ftell(w.f);
    gw_u64(&w, 0);
    gw_kv_str(&w, "general.architecture", "deepseek2");
    gw_kv_str(&w, "general.type", "vocab");
    gw_kv_u32(&w, "deepseek2.vocab_size", (uint32_t)tokenizer_n_ids(m->tok));
    gw_tokenizer(&w, m, tokenizer_n_ids(m->tok));
    if (!w.err && fseek(w.f, kv_count_at, SEEK_SET) != 0) w.err = 1;
    gw_u64(&w, w.n_kv);
    if (fclose(w.f) != 0 && !w.err) w.err = 1;
    if (w.err) { remove(path); return fail(w.err == 2 ? CM384_E_NOMEM : CM384_E_IO, "%s: write failed", path); }
    return CM384_OK;
}

int cm384_model_save_gguf(const cm384_model *m, const char *path, const char *type) {
    if (!m || !path) return fail(CM384_E_INVALID, "cm384_model_save_gguf: model and path must not be NULL");
    if (!m->tok) return fail(CM384_E_MISUSE, "cm384_model_save_gguf: %s has no tokenizer", m->path);
    int wt, ftype;
    if (!type || !strcmp(type, "bf16")) { wt = GL_BF16; ftype = 32; }
    else if (!strcmp(type, "f16")) { wt = GL_F16; ftype = 1; }
    else if (!strcmp(type, "f32")) { wt = GL_F32; ftype = 0; }
    else if (!strcmp(type, "q8_0")) { wt = GL_Q8_0; ftype = 7; }
    else return fail(CM384_E_INVALID, "cm384_model_save_gguf: type \"%s\" (bf16, f16, f32 or q8_0)", type);
    if (m->tokenizer_only) return gguf_save_vocab_only(m, path);
    const hparams *hp = &m->hp;
    if (hp->moe_freq != 1 && hp->n_routed > 0)
        return fail(CM384_E_UNSUPPORTED, "%s: moe_layer_freq %d cannot be written to GGUF (every layer after the "
                    "dense ones is MoE there)", m->path, hp->moe_freq);
    if (hp->yarn && hp->mscale != hp->mscale_all_dim)
        return fail(CM384_E_UNSUPPORTED, "%s: YaRN mscale %g != mscale_all_dim %g cannot be written to GGUF",
                    m->path, hp->mscale, hp->mscale_all_dim);

    /* the tensors, in llama.cpp's order within each block */
    int nl = hp->n_layers + hp->n_mtp, H = hp->n_heads, E = hp->n_routed;
    size_t max_t = 3 + (size_t)nl * 32;
    gw_tensor *ts = calloc(max_t, sizeof *ts);
    gl_mat *stacks = calloc((size_t)nl * (3 * (size_t)(E > H ? E : H) + 2 * (size_t)H) + 1, sizeof *stacks);
    if (!ts || !stacks) { free(ts); free(stacks); return fail(CM384_E_NOMEM, "out of memory"); }
    int nt = 0;
    size_t sp = 0;
    char nm[96];
    gw_add(ts, &nt, wt, "token_embd.weight", &m->embed, 0);
    gw_add_vec(ts, &nt, "output_norm.weight", m->final_norm, hp->dim);
    if (m->head.data != m->embed.data) gw_add(ts, &nt, wt, "output.weight", &m->head, 0);
#define WN(fmt) (snprintf(nm, sizeof nm, "blk.%d." fmt, l), nm)
    for (int l = 0; l < nl; l++) {
        const layer_w *L = &m->layers[l];
        gw_add_vec(ts, &nt, WN("attn_norm.weight"), L->attn_norm, hp->dim);
        if (hp->q_lora) {
            gw_add(ts, &nt, wt, WN("attn_q_a.weight"), &L->wq_a, 0);
            gw_add_vec(ts, &nt, WN("attn_q_a_norm.weight"), L->q_norm, hp->q_lora);
            gw_add(ts, &nt, wt, WN("attn_q_b.weight"), &L->wq_b, 0);
        } else {
            gw_add(ts, &nt, wt, WN("attn_q.weight"), &L->wq, 0);
        }
        gw_add(ts, &nt, wt, WN("attn_kv_a_mqa.weight"), &L->wkv_a, 0);
        gw_add_vec(ts, &nt, WN("attn_kv_a_norm.weight"), L->kv_norm, hp->kv_lora);
        for (int h = 0; h < H; h++) { stacks[sp + h] = L->w_uk_t[h]; stacks[sp + H + h] = L->w_uv[h]; }
        gw_add(ts, &nt, wt, WN("attn_k_b.weight"), &stacks[sp], H);
        gw_add(ts, &nt, wt, WN("attn_v_b.weight"), &stacks[sp + H], H);
        sp += 2 * (size_t)H;
        gw_add(ts, &nt, wt, WN("attn_output.weight"), &L->wo, 0);
        gw_add_vec(ts, &nt, WN("ffn_norm.weight"), L->ffn_norm, hp->dim);
        if (!L->is_moe) {
            gw_add(ts, &nt, wt, WN("ffn_gate.weight"), &L->dense.gate, 0);
            gw_add(ts, &nt, wt, WN("ffn_up.weight"), &L->dense.up, 0);
            gw_add(ts, &nt, wt, WN("ffn_down.weight"), &L->dense.down, 0);
        } else {
            gw_add(ts, &nt, GL_F32, WN("ffn_gate_inp.weight"), &L->router, 0);
            if (L->router_bias) gw_add_vec(ts, &nt, WN("exp_probs_b.bias"), L->router_bias, E);
            for (int e = 0; e < E; e++) {
                stacks[sp + e] = L->experts[e].gate;
                stacks[sp + E + e] = L->experts[e].up;
                stacks[sp + 2 * E + e] = L->experts[e].down;
            }
            gw_add(ts, &nt, wt, WN("ffn_gate_exps.weight"), &stacks[sp], E);
            gw_add(ts, &nt, wt, WN("ffn_up_exps.weight"), &stacks[sp + E], E);
            gw_add(ts, &nt, wt, WN("ffn_down_exps.weight"), &stacks[sp + 2 * E], E);
            sp += 3 * (size_t)E;
            if (L->shared.gate.data) {
                gw_add(ts, &nt, wt, WN("ffn_gate_shexp.weight"), &L->shared.gate, 0);
                gw_add(ts, &nt, wt, WN("ffn_up_shexp.weight"), &L->shared.up, 0);
                gw_add(ts, &nt, wt, WN("ffn_down_shexp.weight"), &L->shared.down, 0);
            }
        }
        if (l >= hp->n_layers) {
            gw_add(ts, &nt, wt, WN("nextn.eh_proj.weight"), &L->eh_proj, 0);
            gw_add_vec(ts, &nt, WN("nextn.enorm.weight"), L->enorm, hp->dim);
            gw_add_vec(ts, &nt, WN("nextn.hnorm.weight"), L->hnorm, hp->dim);
            gw_add_vec(ts, &nt, WN("nextn.shared_head_norm.weight"), L->head_norm, hp->dim);
            if (L->embed.data != m->embed.data) gw_add(ts, &nt, wt, WN("nextn.embed_tokens.weight"), &L->embed, 0);
            if (L->head.data != m->head.data) gw_add(ts, &nt, wt, WN("nextn.shared_head_head.weight"), &L->head, 0);
        }
    }
#undef WN
    uint64_t off = 0;
    int max_cols = 1;
    for (int i = 0; i < nt; i++) {
        ts[i].offset = off;
        off += (ts[i].nbytes + 31) / 32 * 32;
        if (ts[i].cols > max_cols) max_cols = ts[i].cols;
    }

    gguf_writer w = {fopen(path, "wb"), path, 0, 0};
    if (!w.f) { free(ts); free(stacks); return fail(CM384_E_IO, "%s: cannot create: %s", path, strerror(errno)); }
    /* the header's metadata count is patched once the metadata is written */
    gw_u32(&w, 0x46554747u);
    gw_u32(&w, 3);
    gw_u64(&w, (uint64_t)nt);
    long kv_count_at = ftell(w.f);
    gw_u64(&w, 0);
    gw_kv_str(&w, "general.architecture", "deepseek2");
    gw_kv_str(&w, "general.type", "model");
    const char *base = strrchr(m->path, '/');
    gw_kv_str(&w, "general.name", base && base[1] ? base + 1 : m->path);
    gw_kv_u32(&w, "general.file_type", (uint32_t)ftype);
    gw_kv_u32(&w, "general.quantization_version", 2);
    gw_kv_u32(&w, "deepseek2.block_count", (uint32_t)nl);
    if (hp->n_mtp) gw_kv_u32(&w, "deepseek2.nextn_predict_layers", (uint32_t)hp->n_mtp);
    gw_kv_u32(&w, "deepseek2.context_length", (uint32_t)hp->max_pos);
    gw_kv_u32(&w, "deepseek2.embedding_length", (uint32_t)hp->dim);
    gw_kv_u32(&w, "deepseek2.feed_forward_length", (uint32_t)hp->inter);
    gw_kv_u32(&w, "deepseek2.attention.head_count", (uint32_t)H);
    gw_kv_u32(&w, "deepseek2.attention.head_count_kv", 1);
    gw_kv_f32(&w, "deepseek2.rope.freq_base", (float)hp->rope_theta);
    gw_kv_f32(&w, "deepseek2.attention.layer_norm_rms_epsilon", hp->eps);
    if (E > 0) {
        gw_kv_u32(&w, "deepseek2.expert_count", (uint32_t)E);
        gw_kv_u32(&w, "deepseek2.expert_used_count", (uint32_t)hp->top_k);
        gw_kv_u32(&w, "deepseek2.expert_group_count", (uint32_t)hp->n_group);
        gw_kv_u32(&w, "deepseek2.expert_group_used_count", (uint32_t)hp->topk_group);
        gw_kv_u32(&w, "deepseek2.expert_gating_func", hp->score_func == SCORE_SIGMOID ? 2 : 1);
    }
    gw_kv_u32(&w, "deepseek2.leading_dense_block_count", (uint32_t)(E > 0 ? hp->n_dense : hp->n_layers));
    gw_kv_u32(&w, "deepseek2.vocab_size", (uint32_t)hp->vocab);
    /* 0 too: llama.cpp takes a file without it for a q_lora-less model only
       at V2-Lite's 26 or 27 layers, with it at 0 at any depth */
    gw_kv_u32(&w, "deepseek2.attention.q_lora_rank", (uint32_t)hp->q_lora);
    gw_kv_u32(&w, "deepseek2.attention.kv_lora_rank", (uint32_t)hp->kv_lora);
    gw_kv_u32(&w, "deepseek2.attention.key_length", (uint32_t)(hp->kv_lora + hp->qk_rope));
    gw_kv_u32(&w, "deepseek2.attention.value_length", (uint32_t)hp->kv_lora);
    gw_kv_u32(&w, "deepseek2.attention.key_length_mla", (uint32_t)(hp->qk_nope + hp->qk_rope));
    gw_kv_u32(&w, "deepseek2.attention.value_length_mla", (uint32_t)hp->v_head);
    gw_kv_u32(&w, "deepseek2.expert_feed_forward_length", (uint32_t)(hp->moe_inter ? hp->moe_inter : hp->inter));
    gw_kv_u32(&w, "deepseek2.expert_shared_count", (uint32_t)hp->n_shared);
    gw_kv_f32(&w, "deepseek2.expert_weights_scale", hp->route_scale);
    if (hp->arch == ARCH_V3 ? hp->score_func == SCORE_SIGMOID : hp->norm_topk)
        gw_kv_bool(&w, "deepseek2.expert_weights_norm", 1);
    gw_kv_u32(&w, "deepseek2.rope.dimension_count", (uint32_t)hp->qk_rope);
    if (hp->yarn) {
        gw_kv_str(&w, "deepseek2.rope.scaling.type", "yarn");
        gw_kv_f32(&w, "deepseek2.rope.scaling.factor", (float)hp->yarn_factor);
        gw_kv_u32(&w, "deepseek2.rope.scaling.original_context_length", (uint32_t)hp->yarn_orig_max);
        gw_kv_f32(&w, "deepseek2.rope.scaling.yarn_beta_fast", (float)hp->beta_fast);
        gw_kv_f32(&w, "deepseek2.rope.scaling.yarn_beta_slow", (float)hp->beta_slow);
        gw_kv_f32(&w, "deepseek2.rope.scaling.yarn_log_multiplier", (float)(0.1 * hp->mscale_all_dim));
    }
    gw_tokenizer(&w, m, hp->vocab);
    for (int i = 0; i < nt; i++) {
        const gw_tensor *x = &ts[i];
        gw_str(&w, x->name, strlen(x->name));
        gw_u32(&w, (uint32_t)x->ndim);
        for (int d = 0; d < x->ndim; d++) gw_u64(&w, (uint64_t)x->ne[d]);
        gw_u32(&w, gw_ggml_type(x->type));
        gw_u64(&w, x->offset);
    }
    static const uint8_t zeros[32];
    long pos = ftell(w.f);
    if (pos < 0) w.err = 1;
    else gw_bytes(&w, zeros, (size_t)((32 - pos % 32) % 32));
    float *row = malloc((size_t)max_cols * sizeof(float));
    uint8_t *buf = malloc((size_t)max_cols * 4);
    if (!row || !buf) w.err = 2;
    for (int i = 0; i < nt && !w.err; i++) {
        gw_data(&w, &ts[i], row, buf);
        gw_bytes(&w, zeros, (size_t)((32 - ts[i].nbytes % 32) % 32));
    }
    free(row);
    free(buf);
    free(ts);
    free(stacks);
    if (!w.err && (fseek(w.f, kv_count_at, SEEK_SET) != 0)) w.err = 1;
    gw_u64(&w, w.n_kv);
    if (fclose(w.f) != 0 && !w.err) w.err = 1;
    if (w.err == 2) { remove(path); return fail(CM384_E_NOMEM, "out of memory writing %s", path); }
    if (w.err) { remove(path); return fail(CM384_E_IO, "%s: write failed: %s", path, strerror(errno)); }
    return CM384_OK;
}

int cm384_model_get_info(const cm384_model *m, cm384_model_info *out) {
    if (!m || !out) return fail(CM384_E_INVALID, "cm384_model_get_info: NULL argument");
    size_t sz = out->struct_size && out->struct_size < sizeof *out ? out->struct_size : sizeof *out;
    cm384_model_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    const hparams *hp = &m->hp;
    snprintf(info.model_type, sizeof info.model_type, "%s",
             m->tokenizer_only ? "tokenizer" : hp->arch == ARCH_V3 ? "deepseek_v3" : "deepseek_v2");
    info.vocab_size = cm384_vocab_size(m);
    info.n_layers = hp->n_layers;
    info.n_dense_layers = 0;
    for (int l = 0; l < hp->n_layers && m->layers; l++) info.n_dense_layers += !m->layers[l].is_moe;
    info.n_mtp_layers = hp->n_mtp;
    info.hidden_size = hp->dim;
    info.n_heads = hp->n_heads;
    info.q_lora_rank = hp->q_lora;
    info.kv_lora_rank = hp->kv_lora;
    info.qk_nope_head_dim = hp->qk_nope;
    info.qk_rope_head_dim = hp->qk_rope;
    info.v_head_dim = hp->v_head;
    info.n_routed_experts = hp->n_routed;
    info.n_shared_experts = hp->n_shared;
    info.n_experts_per_tok = hp->top_k;
    info.max_position_embeddings = hp->max_pos;
    info.bos_id = cm384_token_bos(m);
    info.eos_id = cm384_token_eos(m);
    info.n_params = m->n_params;
    info.n_active_params = m->n_active_params;
    info.weight_bytes = m->weight_bytes;
    snprintf(info.weight_dtype, sizeof info.weight_dtype, "%s",
             m->tokenizer_only ? "" : gl_type_name(m->main_dtype));
    info.struct_size = sz;              /* what the caller's struct holds of it */
    memcpy(out, &info, sz);
    out->struct_size = sz;
    return CM384_OK;
}

int cm384_vocab_size(const cm384_model *m) {
    if (!m) return fail(CM384_E_INVALID, "cm384_vocab_size: NULL model");
    if (m->tokenizer_only) return m->tok ? tokenizer_n_ids(m->tok) : 0;
    return m->hp.vocab;
}

int cm384_token_bos(const cm384_model *m) {
    if (!m) return -1;
    if (m->tok && tokenizer_bos(m->tok) >= 0) return tokenizer_bos(m->tok);
    return m->tokenizer_only ? -1 : m->hp.bos;
}

int cm384_token_eos(const cm384_model *m) {
    if (!m) return -1;
    if (!m->tokenizer_only) return m->hp.eos;
    return m->tok ? tokenizer_eos(m->tok) : -1;
}

/* ======================================================================== */
/* 5. Model math                                                            */
/* ======================================================================== */
/* The pieces of DeepSeek's transformer that work on one token at a time.
 * The batched layer operations built from them, which run on the emulated
 * devices, are in section 7. */

/* ---- 5.1 small pieces ---- */

/* x * rsqrt(mean(x^2) + eps) * w, in fp32 (DeepSeek's RMSNorm).  The sum of
 * squares is the kernel set's dot product -- its fixed order, vectorized --
 * not one chain of n dependent adds (a microsecond a 1024-wide row). */
static void rmsnorm(const gl_kernels *k, float *out, const float *x, const float *w, int n, float eps) {
    float ss = k->dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* RoPE on interleaved pairs (2k, 2k+1), as DeepSeek's view_as_complex.
 * rope_angles fills cs[2k], cs[2k+1] with the (mscale-scaled) cos and sin of
 * pair k at pos -- once per token per forward, since every layer and head
 * rotates by the same angles; rope rotates v by them. */
static void rope_angles(const cm384_model *m, int pos, float *cs) {
    for (int k = 0; k < m->hp.qk_rope / 2; k++) {
        float ang = (float)pos * m->rope_freq[k];
        cs[2 * k] = (float)cos((double)ang) * m->rope_mscale;
        cs[2 * k + 1] = (float)sin((double)ang) * m->rope_mscale;
    }
}

static void rope(float *v, const float *cs, int dim) {
    for (int k = 0; k < dim; k += 2) {
        float a = v[k], b = v[k + 1], c = cs[k], s = cs[k + 1];
        v[k] = a * c - b * s;
        v[k + 1] = a * s + b * c;
    }
}

static void softmax_inplace(float *x, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) if (x[i] > mx) mx = x[i];
    float sum = 0;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* ---- 5.2 the KV cache: paged blocks of MLA latents ---- */
/* Per token and layer MLA needs only the compressed latent c (kv_lora_rank
 * values, after kv_a_layernorm) and the shared rotated key k_pe (qk_rope
 * values): one row of kv_lora + qk_rope floats.  Rows live in blocks of B
 * tokens; a block holds its tokens' rows for every layer, so a whole block
 * can be handed from prefill to decode or shared through the context cache.
 * A sequence is a block table: position p is in block p / B, slot p % B.
 * MTP layers store their rows in the same block: slot s of an MTP layer
 * holds the MTP entry for position s - 1 (its inputs are h_{s-1} and token
 * s), so a block's MTP rows depend only on tokens up to that block's end. */

typedef struct kv_pool {
    int      block_tokens;    /* B                                          */
    int      n_layers;        /* main + MTP layers                           */
    int      row;             /* values per token per layer                  */
    int      bf16;            /* values stored as bf16 (cm384_config.kv_bf16),
                                 else fp32                                   */
    size_t   row_bytes;       /* row * (2 or 4)                              */
    size_t   block_bytes;     /* n_layers * B * row_bytes                    */
    int      n_blocks;
    uint8_t *data;            /* n_blocks * block_bytes                      */
} kv_pool;

/* The row of (layer, pos): fp32, or bf16 with kv->bf16. */
static void *kv_row(const kv_pool *kv, const int *blocks, int layer, int pos) {
    int b = blocks[pos / kv->block_tokens], s = pos % kv->block_tokens;
    return kv->data + (size_t)b * kv->block_bytes + ((size_t)layer * kv->block_tokens + s) * kv->row_bytes;
}

/* ---- 5.3 the router ---- */

/* The router for one token: picks top_k experts and their weights from
 * logits[n_routed], following the reference for each topk_method and
 * scoring_func (DeepSeek-V3's official Gate for V3, the V2 modeling code for
 * V2): the correction bias only selects; group-limited top-k keeps the best
 * topk_group groups; weights are the unbiased scores, normalized and scaled. */
static void route_token(const hparams *hp, const float *logits, const float *bias, int *ids, float *w) {
    int E = hp->n_routed, K = hp->top_k, G = hp->n_group, per = E / G;
    float score[1024], sel[1024];                 /* E <= 1024 checked at load */
    for (int e = 0; e < E; e++) score[e] = logits[e];
    if (hp->score_func == SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-score[e]));
    } else {
        softmax_inplace(score, E);
    }
    for (int e = 0; e < E; e++) sel[e] = bias ? score[e] + bias[e] : score[e];
    if (hp->topk_method != TOPK_GREEDY && G > 1) {
        float gscore[256];
        for (int g = 0; g < G; g++) {
            const float *s = sel + g * per;
            if (bias) {       /* sum of the two best (biased) scores of the group */
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int i = 0; i < per; i++) {
                    if (s[i] > b1) { b2 = b1; b1 = s[i]; } else if (s[i] > b2) b2 = s[i];
                }
                gscore[g] = per > 1 ? b1 + b2 : b1;
            } else {          /* the group's best score */
                float b1 = -INFINITY;
                for (int i = 0; i < per; i++) if (s[i] > b1) b1 = s[i];
                gscore[g] = b1;
            }
        }
        unsigned char keep[256] = {0};
        for (int r = 0; r < hp->topk_group; r++) {
            int best = -1;
            for (int g = 0; g < G; g++) if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = 1;
        }
        for (int g = 0; g < G; g++) if (!keep[g]) for (int i = 0; i < per; i++) sel[g * per + i] = -INFINITY;
    }
    /* top-k by selection score, highest first; ties go to the lower id */
    unsigned char taken[1024] = {0};
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) if (!taken[e] && (best < 0 || sel[e] > sel[best])) best = e;
        taken[best] = 1;
        ids[k] = best;
        w[k] = score[best];
    }
    int normalize = hp->arch == ARCH_V3 ? hp->score_func == SCORE_SIGMOID : (hp->norm_topk && K > 1);
    if (normalize) {
        float sum = 0;
        for (int k = 0; k < K; k++) sum += w[k];
        if (hp->arch == ARCH_V2) sum += 1e-20f;
        for (int k = 0; k < K; k++) w[k] /= sum;
    }
    if (hp->arch == ARCH_V3 || !normalize)
        for (int k = 0; k < K; k++) w[k] *= hp->route_scale;
}


/* ======================================================================== */
/* 6. The supernode: devices, placement, the pool and the fabric            */
/* ======================================================================== */
/* A device is logical: an id, its roles, what it holds and its counters.
 * Work is expressed as tasks that belong to a device; a pool of worker
 * threads runs them.  Devices exchange activations only through the fabric:
 * a send writes straight into a buffer the receiver owns (pre-allocated in
 * the pool: the AIV-Direct idea) and is counted per (source, destination).
 *
 * Roles:
 *   prefill       computes prompts (attention data-parallel by request,
 *                 routed experts spread over the prefill group);
 *   attention     owns decoding requests and their KV blocks (DP attention);
 *   expert        holds routed experts (and replicas of hot ones) for decode;
 *   shared        holds a replica of the shared expert (paper preset).
 * Presets:
 *   single   one device does everything;
 *   default  fastest on this host: as many prefill and attention devices as
 *            workers, one device per routed expert, shared experts computed
 *            where the token is;
 *   paper    CloudMatrix-Infer's deployment scaled to the model: decode
 *            attention DP over every decode device, one routed expert per
 *            device, R/top_k shared-expert replicas and R/8 redundant experts
 *            (EP320 for a 256-expert model), prefill EP over R/8 devices. */

#ifndef CM384_MALLOC
#define CM384_MALLOC(n)     malloc(n)
#define CM384_CALLOC(n, s)  calloc(n, s)
#define CM384_FREE(p)       free(p)
#endif

enum { ROLE_PREFILL = 1, ROLE_ATTN = 2, ROLE_EXPERT = 4, ROLE_SHARED = 8, ROLE_CACHE = 16 };
enum { PHASE_PREFILL = 0, PHASE_DECODE = 1 };

typedef struct device {
    unsigned roles;
    int      n_owned;        /* decode requests it owns (attention)           */
    int      n_hosted;       /* routed expert replicas it hosts (decode)       */
    int      failed;         /* dead (section 12b): no role, no work           */
    unsigned had_roles;      /* ... and what it was (its traffic's role)       */
} device;

/* Where each routed expert of each layer lives in one phase.  An entry is a
 * (device, expert) pair: entry e*max_rep + r is replica r of expert e;
 * entries E*max_rep + j are shared-expert replicas. */
typedef struct placement {
    int  max_rep;
    int  n_entries;          /* E*max_rep + n_shared                          */
    int *dev;                /* [layers][n_entries] device, -1 = unused       */
    int *n_rep;              /* [layers][E] replicas of each expert            */
    int *order;              /* [layers][n_entries] entries by (device, expert)*/
    int  n_shared;           /* shared-expert replicas; 0 = at the source      */
} placement;

static int *pl_dev(const placement *p, int l) { return p->dev + (size_t)l * p->n_entries; }
static int *pl_nrep(const placement *p, int l, int E) { return p->n_rep + (size_t)l * E; }
static int *pl_order(const placement *p, int l) { return p->order + (size_t)l * p->n_entries; }

/* Sorts a layer's entries by (device, expert) so that each device's
 * received rows are contiguous and in a fixed order. */
static void pl_sort(placement *p, int l) {
    int *dev = pl_dev(p, l), *ord = pl_order(p, l), n = 0;
    for (int i = 0; i < p->n_entries; i++) if (dev[i] >= 0) ord[n++] = i;
    for (int i = 1; i < n; i++) {               /* insertion sort: small, stable */
        int v = ord[i], j = i;
        while (j > 0 && (dev[ord[j - 1]] > dev[v] || (dev[ord[j - 1]] == dev[v] && ord[j - 1] > v))) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = v;
    }
    for (int i = n; i < p->n_entries; i++) ord[i] = -1;
}

/* ---- the worker pool, shared by the peers ---- */
/* Prefill and decode each run their own loop (section 12) and give their
 * parallel regions to one pool of worker threads through a lane each.  A
 * free worker takes the next task of the decode lane first, and of the
 * prefill lane only when decode has none left unclaimed: a decode region
 * waits at most for tasks already running, never behind a whole prefill
 * chunk.  The loop that published a region helps run it -- except the
 * prefill loop while decode has work, which sleeps instead, so the cores
 * never have more busy threads than workers: alone, either loop gets every
 * core; together, decode takes what it needs and prefill the rest (with
 * prefill_share, plus the time decode lends it between steps: section 12).
 * A lane holds one region at a time; tasks are claimed from an atomic word
 * (generation << 32 | next task), as in gl_pool. */

enum { LANE_DECODE = 0, LANE_PREFILL = 1, N_LANES = 2 };

typedef struct lane {
    _Alignas(64) _Atomic uint64_t work;     /* generation << 32 | next task        */
    atomic_int      n_tasks;
    gl_task_fn      fn;
    void           *ctx;
    uint32_t        gen;                    /* the publishing loop's copy           */
    _Alignas(64) atomic_int done;           /* tasks finished in this region        */
    atomic_int      waiting;                /* its loop sleeps on done_cv           */
    pthread_cond_t  done_cv;
} lane;

typedef struct lane_pool {
    int             n_threads;              /* pool threads; the loops' own are extra */
    int             oversubscribed;         /* more threads than CPUs: do not spin   */
    pthread_t      *threads;
    lane            lanes[N_LANES];
    pthread_mutex_t mu;
    pthread_cond_t  wake;
    _Alignas(64) atomic_int sleepers;
    atomic_int      stop;
    atomic_int      decode_busy;            /* the decode loop has work             */
    atomic_int      prefill_busy;           /* the prefill loop has work            */
} lane_pool;

typedef struct lane_worker_arg { lane_pool *lp; int id; } lane_worker_arg;

/* Claims and runs one task of lane L: 1; 2 if another worker claimed it
 * first (try again); 0 if it has none unclaimed. */
static int lane_try(lane_pool *lp, int L, int worker) {
    lane *ln = &lp->lanes[L];
    uint64_t w = atomic_load_explicit(&ln->work, memory_order_acquire);
    uint32_t n = (uint32_t)atomic_load_explicit(&ln->n_tasks, memory_order_acquire);
    if ((uint32_t)w >= n) return 0;
    /* a count from a newer region means this one was closed: the CAS fails */
    if (!atomic_compare_exchange_strong_explicit(&ln->work, &w, w + 1, memory_order_acquire, memory_order_acquire))
        return 2;
    ln->fn(ln->ctx, (int)(uint32_t)w, worker);
    if ((uint32_t)atomic_fetch_add_explicit(&ln->done, 1, memory_order_seq_cst) + 1 == n &&
        atomic_load_explicit(&ln->waiting, memory_order_seq_cst)) {
        pthread_mutex_lock(&lp->mu);
        pthread_cond_broadcast(&ln->done_cv);
        pthread_mutex_unlock(&lp->mu);
    }
    return 1;
}

static int lanes_have_work(lane_pool *lp) {
    for (int L = 0; L < N_LANES; L++) {
        lane *ln = &lp->lanes[L];
        uint64_t w = atomic_load_explicit(&ln->work, memory_order_seq_cst);
        if ((uint32_t)w < (uint32_t)atomic_load_explicit(&ln->n_tasks, memory_order_seq_cst)) return 1;
    }
    return 0;
}

static void *lane_worker_main(void *arg) {
    lane_worker_arg *wa = arg;
    lane_pool *lp = wa->lp;
    int id = wa->id;
    CM384_FREE(wa);
    int spins = 0;
    int64_t start = 0;
    for (;;) {
        if (lane_try(lp, LANE_DECODE, id) || lane_try(lp, LANE_PREFILL, id)) { spins = 0; start = 0; continue; }
        if (atomic_load_explicit(&lp->stop, memory_order_acquire)) return NULL;
        if (gl_spin(&spins, &start, lp->oversubscribed)) continue;
        pthread_mutex_lock(&lp->mu);
        atomic_fetch_add_explicit(&lp->sleepers, 1, memory_order_seq_cst);
        while (!lanes_have_work(lp) && !atomic_load_explicit(&lp->stop, memory_order_seq_cst))
            pthread_cond_wait(&lp->wake, &lp->mu);
        atomic_fetch_sub_explicit(&lp->sleepers, 1, memory_order_relaxed);
        pthread_mutex_unlock(&lp->mu);
        spins = 0;
        start = 0;
    }
}

static void lane_pool_free(lane_pool *lp) {
    if (!lp) return;
    pthread_mutex_lock(&lp->mu);
    atomic_store_explicit(&lp->stop, 1, memory_order_seq_cst);
    pthread_cond_broadcast(&lp->wake);
    pthread_mutex_unlock(&lp->mu);
    for (int i = 0; i < lp->n_threads; i++) pthread_join(lp->threads[i], NULL);
    for (int L = 0; L < N_LANES; L++) pthread_cond_destroy(&lp->lanes[L].done_cv);
    pthread_mutex_destroy(&lp->mu);
    pthread_cond_destroy(&lp->wake);
    CM384_FREE(lp->threads);
    CM384_FREE(lp);
}

/* n_workers - 1 pool threads: worker ids 1 .. n_workers-1; the decode loop
 * is worker 0 and the prefill loop worker n_workers. */
static lane_pool *lane_pool_create(int n_workers) {
    lane_pool *lp = CM384_CALLOC(1, sizeof *lp);
    if (!lp) return NULL;
    pthread_mutex_init(&lp->mu, NULL);
    pthread_cond_init(&lp->wake, NULL);
    for (int L = 0; L < N_LANES; L++) pthread_cond_init(&lp->lanes[L].done_cv, NULL);
    lp->oversubscribed = n_workers > gl_n_cpus();
    int n = n_workers - 1;
    lp->threads = CM384_CALLOC((size_t)(n > 0 ? n : 1), sizeof(pthread_t));
    if (!lp->threads) { lane_pool_free(lp); return NULL; }
    for (int i = 0; i < n; i++) {
        lane_worker_arg *wa = CM384_MALLOC(sizeof *wa);
        if (!wa) { lane_pool_free(lp); return NULL; }
        wa->lp = lp; wa->id = i + 1;
        if (pthread_create(&lp->threads[i], NULL, lane_worker_main, wa) != 0) { CM384_FREE(wa); lane_pool_free(lp); return NULL; }
        lp->n_threads = i + 1;          /* only started threads are joined */
    }
    return lp;
}

/* Runs fn(ctx, task, worker) for every task on lane L and returns when all
 * have finished.  The caller (worker id `worker`) helps when `helps`. */
static void lane_run(lane_pool *lp, int L, int n_tasks, gl_task_fn fn, void *ctx, int worker, int helps) {
    if (n_tasks <= 0) return;
    if (lp->n_threads == 0 || (helps && n_tasks == 1)) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, worker);
        return;
    }
    lane *ln = &lp->lanes[L];
    /* close the last region for late workers before its count changes */
    atomic_store_explicit(&ln->work, (uint64_t)ln->gen << 32 | 0xffffffffu, memory_order_relaxed);
    atomic_store_explicit(&ln->n_tasks, n_tasks, memory_order_release);
    ln->fn = fn;
    ln->ctx = ctx;
    atomic_store_explicit(&ln->done, 0, memory_order_relaxed);
    ln->gen++;
    atomic_store_explicit(&ln->work, (uint64_t)ln->gen << 32, memory_order_seq_cst);   /* publishes the above */
    if (atomic_load_explicit(&lp->sleepers, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&lp->mu);
        pthread_cond_broadcast(&lp->wake);
        pthread_mutex_unlock(&lp->mu);
    }
    int spins = 0;
    int64_t start = 0;
    if (helps) {
        while (lane_try(lp, L, worker)) {}
        while (atomic_load_explicit(&ln->done, memory_order_acquire) < n_tasks && gl_spin(&spins, &start, lp->oversubscribed)) {}
    }
    if (atomic_load_explicit(&ln->done, memory_order_acquire) < n_tasks) {
        pthread_mutex_lock(&lp->mu);
        atomic_store_explicit(&ln->waiting, 1, memory_order_seq_cst);
        while (atomic_load_explicit(&ln->done, memory_order_seq_cst) < n_tasks) pthread_cond_wait(&ln->done_cv, &lp->mu);
        atomic_store_explicit(&ln->waiting, 0, memory_order_relaxed);
        pthread_mutex_unlock(&lp->mu);
    }
}

/* ---- parallel regions ---- */
/* A region is one gl_pool_run: a set of task groups, each belonging to one
 * device.  Every task is timed into its device's busy time; with a trace
 * open, each group becomes a trace event on its device's track. */

typedef void (*task_fn)(void *ctx, int arg, int task, int worker);

typedef struct rg_group {
    task_fn     fn;
    void       *ctx;
    int         arg, n, device, first;
    const struct dev_group *split;   /* work fused for several devices: charged by rows */
    int         n_split;
    const char *name;           /* trace label                                */
    const char *op;             /* ... and the stage within it (trace args)   */
    int         layer, mb;
    _Atomic uint64_t t0, t1;    /* first task start, last task end (ns)       */
} rg_group;

/* step: the number of the peer step (lane) the event belongs to, -1 when
 * none (cm384_eval); a peer's own step spans carry theirs. */
typedef struct trace_event { int device, layer, mb, lane; int64_t step; const char *name, *op; uint64_t t0, t1; } trace_event;
#define TRACE_BUF_EVENTS (1 << 16)        /* events held before they go to the file */

typedef struct region {
    rg_group  *g;
    int        n_groups, cap, n_tasks;
    int        lane, caller;               /* the peer whose loop runs it: its lane, its worker id */
    int64_t    step;                       /* that peer's step now running, -1 outside steps (trace) */
    int        small_tasks;                /* cut products into short tasks: prefill beside decode
                                              (set per prefill step: some request is decoding) */
    int        many_products;              /* its products are many (a MoE layer's experts): they
                                              balance the workers, none needs cutting for that */
    size_t     work;                       /* bytes its tasks read, where sized (see region_run) */
    int        unsized;                    /* it holds tasks of no size                          */
    struct cm384_engine *e;
    const char *name; int layer, mb;     /* label for groups added next     */
    const char *op;                      /* ... their stage (NULL: none)    */
    const char *broken;        /* an invariant broke: why (see region_break)     */
} region;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int region_groups(const region *rg) { return rg->n_groups; }

/* An invariant of the engine broke (a bug: buffers sized at creation proved
 * too small).  Nothing is aborted: the region stops taking work, and whoever
 * ran the step fails its requests with CM384_E_INTERNAL (step_failed,
 * cm384_eval), then clears it. */
static void region_break(region *rg, const char *why) {
    if (!rg->broken) rg->broken = why;
}

/* Adds a group of n tasks that read about `bytes` in all (weights and
 * rows); a region of only such groups, and little of it, runs on its caller
 * (region_run). */
static void region_add_sized(region *rg, task_fn fn, void *ctx, int arg, int n, int device, size_t bytes) {
    if (n <= 0 || rg->broken) return;
    if (rg->n_groups == rg->cap) {       /* sized at engine creation for the worst case */
        region_break(rg, "a parallel region has more task groups than it was sized for");
        return;
    }
    rg_group *g = &rg->g[rg->n_groups++];
    g->fn = fn; g->ctx = ctx; g->arg = arg; g->n = n; g->device = device; g->first = rg->n_tasks;
    g->name = rg->name; g->op = rg->op; g->layer = rg->layer; g->mb = rg->mb;
    g->split = NULL; g->n_split = 0;
    atomic_store_explicit(&g->t0, UINT64_MAX, memory_order_relaxed);
    atomic_store_explicit(&g->t1, 0, memory_order_relaxed);
    rg->n_tasks += n;
    rg->work += bytes;
}

/* A group of tasks of no stated size: its region goes to the workers. */
static void region_add(region *rg, task_fn fn, void *ctx, int arg, int n, int device) {
    int before = rg->n_groups;
    region_add_sized(rg, fn, ctx, arg, n, device, 0);
    if (rg->n_groups > before) rg->unsized = 1;
}

/* ---- matrix products as region tasks ---- */
/* A product y = W x over n rows is split into chunks of output rows: big
 * enough to stream a useful slab of weights, small enough to balance the
 * workers.  The kernels' per-row results do not depend on the split. */

typedef struct mm_job {
    const gl_mat *w;
    const float  *x;   int ldx;          /* n rows of w->cols floats           */
    const int8_t *xq;  const float *xs;  /* or int8 rows + scales (Q8 weights) */
    float        *y;   int ldy;
    int           n;
    int           chunk;
    int           n_row_chunks, tok_chunk;   /* tasks: row chunks x token chunks */
    const gl_kernels *k;
} mm_job;

/* A matrix's bytes as stored (block formats by their blocks). */
static size_t mat_bytes(const gl_mat *w) { return (size_t)w->rows * gl_row_bytes(w->type, w->cols); }

static void mm_chunk_task(void *ctx, int arg, int c, int worker) {
    (void)arg; (void)worker;
    mm_job *jb = ctx;
    int rc = c % jb->n_row_chunks, t0 = c / jb->n_row_chunks * jb->tok_chunk, nt = jb->n - t0;
    if (nt > jb->tok_chunk) nt = jb->tok_chunk;
    int r0 = rc * jb->chunk, r1 = r0 + jb->chunk;
    if (r1 > jb->w->rows) r1 = jb->w->rows;
    size_t xo = (size_t)t0 * jb->ldx, yo = (size_t)t0 * jb->ldy;
    if (jb->w->type == GL_Q8) jb->k->matmul_q8(jb->w, jb->xq + xo, jb->xs + t0, nt, jb->ldx, jb->y + yo, jb->ldy, r0, r1);
    else jb->k->matmul(jb->w, jb->x + xo, nt, jb->ldx, jb->y + yo, jb->ldy, r0, r1);
}

#define MM_TASK_BYTES (256u << 10)         /* weights a product's task reads          */
#define MM_STREAM_TASK_BYTES (1024u << 10) /* ... when it has at most MM_STREAM_MAX_N tokens */
#define MM_STREAM_MAX_N 16                 /* the kernels' streaming forms take up to 16 tokens */
/* Work that reads fewer bytes than this (weights x tokens, or rows) takes a
 * few microseconds at cache speed: less than handing it to another worker
 * costs.  A product this small is one task, and a region of only such work
 * runs on its caller (on the trained model, every region of a decode step). */
#define SMALL_WORK_BYTES (256u << 10)
#define SMALL_TASK_MACS (4u << 20)    /* a prefill task beside decode: ~0.2-0.5 ms on a core */
#define SMALL_TASK_TOKENS 64        /* ... and its tokens, when the products allow it */
#define SMALL_TASK_PACKED 32        /* ... and at least these: a W8A8 task's weights serve 32+ tokens */

/* Adds job jb (which must stay alive until the region has run). */
static void region_add_mm(region *rg, int n_workers, mm_job *jb, int device) {
    if (jb->n <= 0) return;
    size_t bytes = mat_bytes(jb->w);
    /* ~256 KB of weights a task, at least two tasks a worker -- but a
       product of up to 16 tokens (decode) streams its weights, and each task
       is a stream that starts cold, paying again for its tokens' set-up
       (a512_q8_interleave): up to 1 MB a task and one task a worker -- and
       in a region of many such products (a MoE layer's experts) the
       products themselves balance the workers, so each is cut only by
       those bytes.  (bench-M INT8, medians of 5 alternating runs, 16
       streams: TPOT 15.7 -> 14.7 ms with 1 MB tasks up to 16 tokens rather
       than 2, 14.2 with experts uncut; one stream 257 -> 264 tok/s;
       bf16 16 streams 41.1 -> 38.9 ms) */
    int streams = jb->n <= MM_STREAM_MAX_N;
    size_t per_task = streams ? MM_STREAM_TASK_BYTES : MM_TASK_BYTES;
    int nc = (int)((bytes + per_task - 1) / per_task);
    int by_rows = (jb->w->rows + 15) / 16;
    int spread = n_workers > 1 ? (streams ? 1 : 2) * n_workers : 1;
    if (rg->many_products && streams) spread = 1;
    if (bytes * (size_t)jb->n < SMALL_WORK_BYTES) spread = 1;   /* less work than handing it over */
    if (nc < spread) nc = spread;
    /* a product its region's workers share: as many tasks each (2.8 MB in
       three 1 MB tasks kept one worker of two idle a third of the time) */
    if (spread > 1 && nc % n_workers) nc += n_workers - nc % n_workers;
    if (nc > by_rows) nc = by_rows;
    if (nc < 1) nc = 1;
    int chunk = (jb->w->rows + nc - 1) / nc;
    chunk = (chunk + 15) & ~15;
    jb->chunk = chunk;
    jb->n_row_chunks = (jb->w->rows + chunk - 1) / chunk;
    jb->tok_chunk = jb->n;
    /* beside decode, a long task would hold a worker decode wants: cut the
       tokens too (each row's result is the same whatever batch it is in) */
    size_t macs = (size_t)chunk * jb->w->cols * (size_t)jb->n;
    if (rg->small_tasks && macs > SMALL_TASK_MACS) {
        /* fewer rows before fewer tokens: the rows go down to 64 (4 of
           GL_Q8's panels, one avx512 tile) before the tokens go under all
           of them, or SMALL_TASK_TOKENS, so that each weight read serves
           many tokens.  (Measured when fewer than 32 tokens fell to slower
           row-major tiles: an expert's 48 tokens had been cut to 12-16; the
           weights are now always in panels, and the rule keeps an expert's
           tokens together.) */
        int want = jb->n < SMALL_TASK_TOKENS ? jb->n : SMALL_TASK_TOKENS;
        size_t budget = jb->n >= SMALL_TASK_TOKENS ? 2 * (size_t)SMALL_TASK_MACS : SMALL_TASK_MACS;
        if (chunk > 64 && (size_t)chunk * jb->w->cols * want > budget) {
            size_t rows = budget / ((size_t)jb->w->cols * want);
            int c = rows < 64 ? 64 : (int)(rows & ~(size_t)63);
            if (c < chunk) {
                chunk = c;
                jb->chunk = chunk;
                jb->n_row_chunks = (jb->w->rows + chunk - 1) / chunk;
            }
        }
        size_t per = (size_t)chunk * jb->w->cols;
        int t = (int)(budget / (per ? per : 1));
        /* up to twice the budget to reach SMALL_TASK_PACKED tokens */
        if (t < SMALL_TASK_PACKED && jb->n >= SMALL_TASK_PACKED && per * SMALL_TASK_PACKED <= 2 * budget) t = SMALL_TASK_PACKED;
        t = t < 4 ? 4 : t & ~3;
        if (t < jb->n) jb->tok_chunk = t;
    }
    region_add_sized(rg, mm_chunk_task, jb, 0, jb->n_row_chunks * ((jb->n + jb->tok_chunk - 1) / jb->tok_chunk), device,
                     bytes * (size_t)jb->n);
}

/* ---- per-microbatch working memory (carved from the pool) ---- */

#define CORE_TILE 4       /* queries of one sequence the attention core takes together */
#define CORE_KEYS 64      /* keys per attention-core chunk (rounded up to whole KV blocks) */
#define CORE_SLACK 8.0f   /* the core's softmax terms stay below e^8 (see t_core)         */
#define CORE_LANES 4      /* a query's key chunks go round-robin to this many partial softmaxes */
#define CORE_ROWP 64      /* latent rows the weighted sum takes a call (by pointer, across KV blocks) */
#define CORE_SPLIT_TILES 4 /* at most this many tiles have their lanes run as separate tasks */
#define XKEYS 256         /* expanded prefill: keys expanded at a time (rounded up to whole blocks) */
#define XTILE 16          /* expanded prefill: queries of one sequence a task takes together */

/* What travels with each dispatched row besides its payload (and, with INT8
 * dispatch, its per-token scale): where the expert's output must go back. */
typedef struct msg_meta {
    int32_t slot;              /* source row * (K+1) + k: its combine slot          */
    int16_t expert;            /* routed expert (E: the shared expert)              */
    int16_t src_dev;           /* the sending device                                */
} msg_meta;

typedef struct fwd_scratch {
    int     cap;               /* tokens                                          */
    float  *x, *xn;            /* [cap][dim] residual stream, normed input         */
    float  *qa;                /* [cap][q_lora]                                    */
    float  *q;                 /* [cap][H][nope+rope]                              */
    float  *kva;               /* [cap][kv_lora+rope]                              */
    float  *qlat;              /* [cap][H][kv_lora+rope] absorbed query + q_pe     */
    float  *rope_cs;           /* [cap][rope] each row's RoPE cos/sin (rope_angles) */
    float  *ctx;               /* [H][cap][kv_lora] attended latents, head-major:
                                  W_uv reads a head's rows contiguously           */
    float  *att;               /* [cap][H][v]                                      */
    float  *tmp;               /* [cap][dim] block output before the residual add  */
    float  *ffa, *ffb;         /* [cap][max(inter, shared inter, 2*dim)]           */
    int     core_chunk;        /* keys per attention-core chunk                    */
    float  *scores;            /* [workers][CORE_TILE][H][core_chunk]             */
    float  *qt;                /* [workers][kv_lora+rope][CORE_TILE*H] a tile's
                                  absorbed queries transposed (core_queries)      */
    uint32_t *qtp;             /* [workers][(kv_lora+rope+1)/2][CORE_TILE*H] the
                                  same rounded to bf16 pairs (native-BF16 core)   */
    float  *run_ml;            /* [workers][2][CORE_TILE][H][2] running max and sum:
                                  the lane being run, and the lanes folded so far */
    float  *lane_lat;          /* [workers][CORE_TILE][H][kv_lora] a lane's latents */
    float  *split_ml;          /* [CORE_SPLIT_TILES][CORE_TILE][H][CORE_LANES][2]   */
    float  *split_lat;         /* [CORE_SPLIT_TILES][CORE_TILE][CORE_LANES-1][H][kv_lora] */
    int    *tile_row, *tile_n; /* [cap] attention-core tiles: first row, rows      */
    int    *tile_first;        /* [cap+1] per device group: its first tile         */
    float  *router;            /* [cap][E] router logits                           */
    int    *top_id;            /* [cap][K] chosen experts                          */
    float  *top_w;             /* [cap][K] their weights                           */
    int    *row_of;            /* [cap][K+1] received row of (token, k); k=K:
                                  the shared-expert replica's row                  */
    /* expert side: rows received by the expert devices, grouped by entry */
    int     rows;              /* cap*(K+1)                                        */
    int8_t *recv_q;            /* [rows][dim] INT8 dispatch                        */
    float  *recv_s;            /* [rows] their per-token scales                    */
    float  *recv_f;            /* [rows][dim] fp32 dispatch / dequantized          */
    msg_meta *recv_meta;       /* [rows] routing metadata written with each row    */
    float  *ex_a, *ex_b;       /* [rows][max(moe_inter, shared inter)]             */
    float  *ex_out;            /* [rows][dim]                                      */
    float  *comb;              /* [cap][K+1][dim] the source's combine buffer      */
    uint16_t *comb16;          /* [cap][K+1][dim] the same in BF16 (bf16_combine)  */
    int    *dst_dev;           /* [cap][K+1] device of each (token, k) row         */
    int    *entry_count, *entry_first;   /* [n_entries + 1]                        */
    int     n_jobs_cap;
    mm_job *jobs;
    float  *hsel;              /* [cap][dim] normed rows that need logits          */
    int    *sel;               /* [cap] row of hsel (or -1)                         */
    /* INT8 W8A8: activations quantized per token before each INT8 product */
    int8_t *xnq, *qaq, *attq, *ffq, *exq, *hselq;   /* like xn, qa, att, ffa, ex_a, hsel */
    float  *xns, *qas, *atts, *ffs, *exs, *hsels;   /* their per-row scales              */
    int8_t *qnq, *ctxq;        /* [H][cap][nope], [H][cap][kv_lora]: per (token, head),
                                  a head's rows contiguous (a strided copy made the
                                  per-head products ~2.5x slower per MAC)         */
    float  *qns, *ctxs;        /* [H][cap] their scales (a head's rows consecutive)     */
    int    *sel_first, *sel_n; /* [cap] per device group: its rows of hsel         */
    /* expanded prefill (cm384_config.prefill_expanded; NULL otherwise) */
    int     x_keys;            /* keys per chunk: whole KV blocks                  */
    float  *xlat;              /* [x_keys][kv_lora+rope] the chunk's latent rows   */
    int8_t *xlatq;             /* [x_keys][kv_lora] the same in INT8 (W8A8)        */
    float  *xlats;             /* [x_keys] their scales                            */
    float  *xk;                /* [H][x_keys][nope+rope] keys per head             */
    float  *xv;                /* [H][x_keys][v] values per head                   */
    float  *xsc;               /* [workers][XTILE][x_keys] a tile's scores          */
    float  *xml;               /* [cap][H][2] running max and sum per (row, head)   */
} fwd_scratch;

/* A bump allocator over the pool: everything the engine needs per token is
 * carved once at creation, so the token path never allocates. */
typedef struct carver { uint8_t *base; size_t off; } carver;

static void *carve(carver *c, size_t bytes) {
    size_t at = (c->off + 63) & ~(size_t)63;
    c->off = at + bytes;
    return c->base ? c->base + at : NULL;
}

static void scratch_carve(carver *c, fwd_scratch *s, const hparams *hp, int cap, int block, int workers,
                          int n_entries, int n_jobs, int expanded) {
    size_t C = (size_t)cap, H = (size_t)hp->n_heads, K = (size_t)(hp->top_k > 0 ? hp->top_k : 1);
    size_t D = (size_t)hp->dim, lat = (size_t)hp->kv_lora + hp->qk_rope;
    size_t inter = (size_t)hp->inter, sh = (size_t)hp->moe_inter * hp->n_shared;
    if (inter < 2 * D) inter = 2 * D;
    if (inter < sh) inter = sh;
    size_t mi = (size_t)hp->moe_inter > sh ? (size_t)hp->moe_inter : sh;
    if (mi < 1) mi = 1;
    size_t E = (size_t)(hp->n_routed > 0 ? hp->n_routed : 1);
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->rows = (int)(C * (K + 1));
    size_t R = (size_t)s->rows;
#define F(n) carve(c, (n) * sizeof(float))
    s->x = F(C * D); s->xn = F(C * D); s->qa = F(C * (size_t)(hp->q_lora + 1));
    s->q = F(C * H * (hp->qk_nope + hp->qk_rope)); s->kva = F(C * lat); s->qlat = F(C * H * lat);
    s->rope_cs = F(C * (size_t)hp->qk_rope);
    s->ctx = F(C * H * hp->kv_lora); s->att = F(C * H * hp->v_head); s->tmp = F(C * D);
    s->ffa = F(C * inter); s->ffb = F(C * inter);
    s->core_chunk = (CORE_KEYS + block - 1) / block * block;
    s->scores = F((size_t)workers * H * CORE_TILE * (size_t)s->core_chunk);
    s->qt = F((size_t)workers * CORE_TILE * H * lat);
    s->qtp = carve(c, (size_t)workers * CORE_TILE * H * ((lat + 1) / 2) * sizeof(uint32_t));
    s->run_ml = F((size_t)workers * 2 * H * CORE_TILE * 2);
    s->lane_lat = F((size_t)workers * CORE_TILE * H * hp->kv_lora);
    s->split_ml = F((size_t)CORE_SPLIT_TILES * CORE_TILE * H * CORE_LANES * 2);
    s->split_lat = F((size_t)CORE_SPLIT_TILES * CORE_TILE * (CORE_LANES - 1) * H * hp->kv_lora);
    s->tile_row = carve(c, C * sizeof(int));
    s->tile_n = carve(c, C * sizeof(int));
    s->tile_first = carve(c, (C + 1) * sizeof(int));
    s->router = F(C * E); s->top_w = F(C * K);
    s->top_id = carve(c, C * K * sizeof(int));
    s->row_of = carve(c, C * (K + 1) * sizeof(int));
    s->recv_q = carve(c, R * D);
    s->recv_s = F(R); s->recv_f = F(R * D);
    s->recv_meta = carve(c, R * sizeof(struct msg_meta));
    s->ex_a = F(R * mi); s->ex_b = F(R * mi); s->ex_out = F(R * D);
    s->comb = F(C * (K + 1) * D);
    s->comb16 = carve(c, C * (K + 1) * D * sizeof(uint16_t));
    s->dst_dev = carve(c, C * (K + 1) * sizeof(int));
    s->entry_count = carve(c, ((size_t)n_entries + 1) * sizeof(int));
    s->entry_first = carve(c, ((size_t)n_entries + 2) * sizeof(int));
    s->n_jobs_cap = n_jobs;
    s->jobs = carve(c, ((size_t)n_jobs + 1) * sizeof(mm_job));      /* + op_job's spare */
    s->hsel = F(C * D);
    s->sel = carve(c, C * sizeof(int));
    s->xnq = carve(c, C * D); s->xns = F(C);
    s->qaq = carve(c, C * (size_t)(hp->q_lora + 1)); s->qas = F(C);
    s->attq = carve(c, C * H * hp->v_head); s->atts = F(C);
    s->ffq = carve(c, C * inter); s->ffs = F(C);
    s->exq = carve(c, R * mi); s->exs = F(R);
    s->hselq = carve(c, C * D); s->hsels = F(C);
    s->qnq = carve(c, C * H * hp->qk_nope); s->qns = F(H * C);
    s->ctxq = carve(c, C * H * hp->kv_lora); s->ctxs = F(H * C);
    s->sel_first = carve(c, C * sizeof(int));
    s->sel_n = carve(c, C * sizeof(int));
    if (expanded) {
        size_t X = (size_t)((XKEYS + block - 1) / block * block);
        s->x_keys = (int)X;
        s->xlat = F(X * lat);
        s->xlatq = carve(c, X * hp->kv_lora);
        s->xlats = F(X);
        s->xk = F(H * X * (hp->qk_nope + hp->qk_rope));
        s->xv = F(H * X * hp->v_head);
        s->xsc = F((size_t)workers * XTILE * X);
        s->xml = F(C * H * 2);
    }
#undef F
}

typedef struct request request;   /* section 11 */

/* Per block of the KV pool: who uses it and, when it is in the context
 * cache, what it holds (section 8). */
typedef struct block_meta {
    int      ref;            /* users: requests holding it + 1 if cached        */
    int      cached;         /* in the context-cache index                       */
    uint64_t hash;           /* chain hash of the prefix ending with this block  */
    uint64_t parent;         /* chain hash of the prefix before it               */
    uint32_t tenant;
    int      lru_prev, lru_next;   /* evictable list (cached, ref == 1)         */
    int      owner;          /* device whose memory region it is in (traffic)    */
    int32_t *tokens;         /* [B] the tokens it holds (to verify a hit)        */
} block_meta;

/* A set of block keys found on disk (open addressing; 0 = empty; section 8). */
typedef struct key_set { uint64_t *k; int n, cap; } key_set;

struct cm384_engine {
    const cm384_model *m;
    cm384_config      cfg;
    char              preset[16];
    const gl_kernels *k;
    gl_pool          *pool_threads;          /* pinned: one thread per device      */
    lane_pool        *lanes;                 /* otherwise: the peers' shared workers */
    int               time_shared;           /* one loop runs prefill, then decode  */
    double            prefill_lend;          /* peers: decode lends prefill this many
                                                times each step's time (prefill_share) */
    int               n_workers;
    /* topology */
    int               n_dev;
    device           *dev;
    int              *pre_devs, n_pre;       /* prefill devices                 */
    int              *attn_devs, n_attn;     /* decode attention devices        */
    placement         place[2];              /* PHASE_PREFILL, PHASE_DECODE     */
    int              *red_devs, n_red;       /* devices for redundant experts   */
    int              *exp_devs, n_exp_devs;  /* decode's routed-expert devices, the
                                                redundant ones included         */
    int               exp_cap;               /* expert slots per such device    */
    int               shared_at_source;
    int               fuse_groups;           /* stream a shared weight once for all
                                                devices' rows (not in the paper preset) */
    int               pinned;                /* one thread per device: device d's tasks
                                                run on worker d                     */
    /* the pool: KV blocks, cache index, microbatch buffers */
    uint8_t          *pool;
    size_t            pool_bytes;
    uint64_t          mem[5];     /* the estimate: weights, int8 weights, KV, scratch, total */
    char              mem_line[192];   /* ... as the creation log line says it            */
    kv_pool           kv;
    block_meta       *bm;
    int              *free_blocks, n_free;
    int              *index;                 /* cache hash table: block ids, -1  */
    int               index_cap;
    int               lru_head, lru_tail;    /* evictable cached blocks          */
    int               n_cached, cache_blocks_max;
    struct peer      *peers;                 /* [N_LANES]: decode, prefill (section 12) */
    struct cacher    *cacher;                /* the caching loop (section 12), with cache_dir */
    char             *cache_dir;             /* cache_dir/<fingerprint>, or NULL  */
    uint64_t          kv_fingerprint;        /* model and numerics: what KV values depend on */
    key_set           disk_keys;             /* blocks on disk (under pool_mu)    */
    uint64_t          n_evictions;           /* under pool_mu                      */
    int               cache_dev;             /* the caching device                 */
    pthread_mutex_t   pool_mu;               /* KV blocks, the cache index, owners */
    int               max_ctx;
    double          (*dbg_cycle_ms)(void *user, int batch, double ctx_mean, double prefill_tokens);
    void             *dbg_cycle_user;        /* tests: a virtual clock for the SLO controller */
    double          (*dbg_step_ms)(void *user, int rows, int requests, int mtp);   /* tests: the MTP
                                                gate's clock (mtp 0: a step's main model, 1: its MTP layer) */
    /* fabric and counters */
    _Atomic uint64_t *traffic[3];            /* per plane (PLANE_*): [n_dev][n_dev] bytes */
    uint64_t         *busy;                  /* [workers][n_dev] ns             */
    uint64_t         *expert_load;           /* [layers][E] tokens routed       */
    uint64_t         *dev_rows;              /* [2][n_dev] rows computed as expert,
                                                per phase                       */
    uint64_t         *dev_rows_layer;        /* [layers][n_dev] decode's, per layer */
    uint64_t          eplb_runs;             /* re-placements made              */
    double            eplb_before, eplb_after;   /* last one: max/mean device load of
                                                its window, old and new placement */
    uint64_t          eplb_moved_bytes;      /* expert weights that changed device */
    double           *eplb_ld;               /* EPLB scratch, made with the topology */
    struct eplb_item *eplb_items;
    int              *eplb_used, *eplb_old;
    _Atomic uint64_t  weight_bytes[2];       /* weight bytes streamed per phase (stats; get_stats reads them mid-step) */
    _Atomic uint64_t  roof_bytes[CM384_ROOF_ROWS], roof_macs[CM384_ROOF_ROWS];   /* decode's products by rows */
    _Atomic uint64_t  roof_core_flops;       /* decode's attention core (cm384_stats.decode_roof_*) */
    _Atomic uint64_t  dispatch_bytes, dispatch_bytes_bf16, combine_bytes, combine_bytes_bf16, n_messages;
    _Atomic uint64_t  local_bytes;           /* rows a device wrote to itself: not fabric */
    _Atomic uint64_t  kv_handoff_bytes;      /* the RDMA plane                   */
    int               bf16_combine;          /* expert outputs return in BF16    */
    int              *dbg_route;             /* tests: [layers][max_ctx][K] experts */
    int              *dbg_draft;             /* tests: [max_ctx] draft made at each MTP position */
    float            *dbg_amax;              /* tests, 1 worker: [layer][attn, ffn][dim] max |normed input| */
    float             core_slack;            /* CORE_SLACK; tests set 0: t_core rescales at every new max */
    int               expanded;              /* prefill attends expanded (cm384_config.prefill_expanded) */
    int               x_chunk;               /* tests: its keys per chunk, below the scratch's XKEYS (0: XKEYS) */
    int               mtp;                   /* speculative decoding with MTP on  */
    float            *blk_h;                 /* [blocks][dim] h at each block's end (MTP) */
    /* trace */
    FILE             *trace;
    trace_event      *tev;                   /* buffered, streamed to the file when full */
    int               n_tev, cap_tev;        /* under trace_mu: both peers add events */
    uint64_t          t_origin;
    unsigned char    *trace_named;           /* [n_dev + N_LANES] track already named */
    uint64_t          trace_written, trace_lost;   /* events; lost = the file refused them */
    pthread_mutex_t   trace_mu;
    /* the stage profile (config.profile): a row per (phase, name, op) */
    int               timed;                 /* tasks record their group's first start and last end */
    struct stage_row { int phase; const char *name, *op; uint64_t ns, regions; } *prof;
    int               n_prof;                /* under prof_mu */
    pthread_mutex_t   prof_mu;
    /* requests (section 12) */
    pthread_mutex_t   mu;                    /* the queues, the live and done lists, stats */
    pthread_cond_t    cv_done;
    int               stopping;
    struct sched     *sched;
    /* faults (section 12b) */
    struct fault_rec *faults;                /* under e->mu: every fault so far  */
    int               n_faults, cap_faults;
    struct fault_due *due;                   /* under e->mu: scheduled, by step  */
    int               n_due, cap_due;
    _Atomic int       n_due_atomic;          /* n_due, read by the loops unlocked */
    _Atomic int       link_arm;              /* device whose link drops the next step's messages (-1) */
    int               link_arm_fault;        /* its fault record                  */
    _Atomic int       link_drop[2];          /* per phase: the device whose link drops this step's (-1) */
    int               link_fault[2];         /* ... its fault record               */
    _Atomic uint64_t  link_retried[2];       /* ... messages found missing and sent again */
    int               fatal;                 /* CM384_E_DEVICE once a needed role has no device */
    char              fatal_why[96];
};

/* Work fused for several devices (a weight streamed once for all their
 * rows) is charged to each device by its share of the rows. */
typedef struct dev_group { int device, first, n; } dev_group;

static int dev_group_device(const dev_group *g, int k) { return g[k].device; }

static void charge_split(struct cm384_engine *e, int worker, const rg_group *g, uint64_t dt) {
    int total = 0;
    for (int k = 0; k < g->n_split; k++) total += g->split[k].n;
    for (int k = 0; k < g->n_split; k++)
        e->busy[(size_t)worker * e->n_dev + g->split[k].device] += total ? dt * (uint64_t)g->split[k].n / (uint64_t)total : 0;
}

static void region_task(void *ctx, int t, int worker) {
    region *rg = ctx;
    int lo = 0, hi = rg->n_groups - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (rg->g[mid].first <= t) lo = mid; else hi = mid - 1;
    }
    rg_group *g = &rg->g[lo];
    uint64_t t0 = now_ns();
    g->fn(g->ctx, g->arg, t - g->first, worker);
    uint64_t t1 = now_ns();
    struct cm384_engine *e = rg->e;
    if (g->split) charge_split(e, worker, g, t1 - t0);
    else e->busy[(size_t)worker * e->n_dev + g->device] += t1 - t0;
    if (e->timed) {
        uint64_t v = atomic_load_explicit(&g->t0, memory_order_relaxed);
        while (t0 < v && !atomic_compare_exchange_weak_explicit(&g->t0, &v, t0, memory_order_relaxed, memory_order_relaxed)) {}
        v = atomic_load_explicit(&g->t1, memory_order_relaxed);
        while (t1 > v && !atomic_compare_exchange_weak_explicit(&g->t1, &v, t1, memory_order_relaxed, memory_order_relaxed)) {}
    }
}

/* One thread per device: worker w runs every task of device w. */
static void region_task_device(void *ctx, int w, int worker) {
    region *rg = ctx;
    for (int i = 0; i < rg->n_groups; i++)
        if (rg->g[i].device == w)
            for (int t = 0; t < rg->g[i].n; t++) region_task(rg, rg->g[i].first + t, worker);
}

static void trace_flush(struct cm384_engine *e);

/* The profile's row for (phase, name, op), added in the order stages first
 * run; NULL when the table is full (it holds every stage there is). */
#define PROFILE_ROWS 128
static struct stage_row *profile_row(struct cm384_engine *e, int phase, const char *name, const char *op) {
    for (int i = 0; i < e->n_prof; i++) {
        struct stage_row *p = &e->prof[i];
        if (p->phase == phase && p->name == name && p->op == op) return p;
    }
    if (e->n_prof == PROFILE_ROWS) return NULL;
    struct stage_row *p = &e->prof[e->n_prof++];
    *p = (struct stage_row){phase, name, op, 0, 0};
    return p;
}

/* A region's groups into the profile: each (name, op) of each microbatch
 * counts once, from its first task's start to its last task's end (a
 * region holds a few of them; groups past PROFILE_KEYS distinct ones count
 * on their own). */
#define PROFILE_KEYS 16
static void profile_add(struct cm384_engine *e, const region *rg) {
    int phase = rg->lane == LANE_DECODE ? PHASE_DECODE : PHASE_PREFILL, nk = 0;
    struct { const char *name, *op; int mb; uint64_t t0, t1; } key[PROFILE_KEYS];
    pthread_mutex_lock(&e->prof_mu);
    for (int i = 0; i < rg->n_groups; i++) {
        const rg_group *g = &rg->g[i];
        uint64_t t0 = atomic_load_explicit(&g->t0, memory_order_relaxed), t1 = atomic_load_explicit(&g->t1, memory_order_relaxed);
        if (t0 == UINT64_MAX || t1 < t0) continue;          /* it ran no task */
        int k = 0;
        while (k < nk && !(key[k].name == g->name && key[k].op == g->op && key[k].mb == g->mb)) k++;
        if (k < nk) {
            if (t0 < key[k].t0) key[k].t0 = t0;
            if (t1 > key[k].t1) key[k].t1 = t1;
        } else if (nk < PROFILE_KEYS) {
            key[nk].name = g->name; key[nk].op = g->op; key[nk].mb = g->mb; key[nk].t0 = t0; key[nk].t1 = t1;
            nk++;
        } else {
            struct stage_row *p = profile_row(e, phase, g->name, g->op);
            if (p) { p->ns += t1 - t0; p->regions++; }
        }
    }
    for (int k = 0; k < nk; k++) {
        struct stage_row *p = profile_row(e, phase, key[k].name, key[k].op);
        if (p) { p->ns += key[k].t1 - key[k].t0; p->regions++; }
    }
    pthread_mutex_unlock(&e->prof_mu);
}

static void region_run(region *rg) {
    struct cm384_engine *e = rg->e;
    /* prefill helps its own region only while decode is idle */
    int helps = rg->lane == LANE_DECODE || e->time_shared || !atomic_load_explicit(&e->lanes->decode_busy, memory_order_relaxed);
    if (rg->n_tasks > 0 && e->pinned) gl_pool_run_pinned(e->pool_threads, region_task_device, rg);
    else if (rg->n_tasks > 0 && helps && !rg->unsized && rg->work < SMALL_WORK_BYTES)
        for (int t = 0; t < rg->n_tasks; t++) region_task(rg, t, rg->caller);   /* less work than a handover */
    else if (rg->n_tasks > 0) lane_run(e->lanes, rg->lane, rg->n_tasks, region_task, rg, rg->caller, helps);
    if (e->prof) profile_add(e, rg);
    if (e->trace) {
        pthread_mutex_lock(&e->trace_mu);           /* both peers add events */
        for (int i = 0; i < rg->n_groups; i++) {
            rg_group *g = &rg->g[i];
            for (int k = 0; k < (g->split ? g->n_split : 1); k++) {
                if (e->n_tev == e->cap_tev) trace_flush(e);
                trace_event *ev = &e->tev[e->n_tev++];
                ev->device = g->split ? dev_group_device(g->split, k) : g->device;
                ev->layer = g->layer; ev->mb = g->mb; ev->name = g->name; ev->op = g->op;
                ev->lane = rg->lane; ev->step = rg->step;
                ev->t0 = atomic_load_explicit(&g->t0, memory_order_relaxed);
                ev->t1 = atomic_load_explicit(&g->t1, memory_order_relaxed);
            }
        }
        pthread_mutex_unlock(&e->trace_mu);
    }
    rg->n_groups = rg->n_tasks = 0;
    rg->work = 0;
    rg->unsized = 0;
    rg->op = NULL;
}

/* A span on a peer's own track (after the devices'): its steps. */

static void trace_span(struct cm384_engine *e, int lane, const char *name, int64_t step, uint64_t t0, uint64_t t1) {
    if (!e->trace) return;
    pthread_mutex_lock(&e->trace_mu);
    if (e->n_tev == e->cap_tev) trace_flush(e);
    e->tev[e->n_tev++] = (trace_event){.device = e->n_dev + lane, .layer = -1, .lane = lane, .step = step, .name = name,
                                       .t0 = t0, .t1 = t1};
    pthread_mutex_unlock(&e->trace_mu);
}

/* The embedder's log callback, if any (never on the token path's hot loop). */
static void engine_log(const struct cm384_engine *e, int level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void engine_log(const struct cm384_engine *e, int level, const char *fmt, ...) {
    if (!e->cfg.log) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    e->cfg.log(e->cfg.log_user, level, msg);
}

static void quantize_row(const struct cm384_engine *e, const float *x, int n, int8_t *q, float *scale) {
    e->k->quantize_q8(x, 1, n, n, q, n, scale);
}

/* The fabric's three planes, as in CloudMatrix384: UB carries dispatch and
 * combine between devices, RDMA the prefill -> decode KV hand-off, and the
 * memory pool plane the caching devices' loads and saves.  Every byte one
 * device writes to another is counted on its plane, per (source,
 * destination); a device writing to itself is local, never counted here. */
enum { PLANE_UB = 0, PLANE_RDMA = 1, PLANE_POOL = 2 };

static void fabric_count(struct cm384_engine *e, int plane, int src, int dst, uint64_t bytes) {
    size_t i = (size_t)src * e->n_dev + dst;
    atomic_fetch_add_explicit(&e->traffic[plane][i], bytes, memory_order_relaxed);
}

/* ======================================================================== */
/* 7. Layers on devices                                                     */
/* ======================================================================== */
/* A microbatch is the set of tokens that go through the layers together,
 * sorted by the device that owns them.  Each layer operation (attention,
 * feed-forward, head) is a short list of stages; a stage does a little
 * serial bookkeeping and adds tasks, per device, to a parallel region.
 * Splitting the work this way lets two microbatches share regions (one's
 * attention beside the other's MoE, section 9) and lets every task be
 * charged to its device.
 *
 * The MoE layer follows the CloudMatrix/DeepEP protocol: the router runs
 * where the token is; a layout pass counts rows per (device, expert); the
 * source device writes each token (INT8-quantized with a per-token scale, or
 * fp32) straight into the rows the expert device reserved for it; each
 * expert device runs its experts over all rows it received (one GEMM per
 * expert); the outputs are written back into the source's combine buffer,
 * and the source sums them in top-k order -- a fixed order, whatever the
 * arrival order, so results do not depend on placement. */

#define FOR_GROUPS(mb, g) for (int g = 0; g < (mb)->n_groups; g++)

enum { PEND_NONE, PEND_EMBED, PEND_ADD_TMP, PEND_COMBINE };
enum { OP_ATTN, OP_FFN, OP_HEAD, OP_MTP_IN };

typedef struct microbatch {
    int                  n;
    const int32_t       *tok;       /* [n] tokens (MTP: the next tokens)               */
    const int           *pos;       /* [n] positions                                   */
    const int          **tables;    /* [n] KV block tables                             */
    int                  kv_shift;  /* KV slot = pos + kv_shift (1 in MTP layers)      */
    int                  n_groups;
    dev_group           *groups;    /* device groups, contiguous rows                  */
    int                  phase;     /* PHASE_PREFILL / PHASE_DECODE: which placement   */
    int                  index;     /* microbatch number (trace)                       */
    fwd_scratch         *s;
    int                  pending;   /* residual add the previous op left in tmp/comb   */
    int                  pending_layer;
    const unsigned char *want;      /* [n] rows that need logits; NULL = all            */
    float               *logits;    /* [wanted rows][vocab]                            */
    float               *h_out;     /* [n][dim] final-normed hidden (for MTP) or NULL  */
} microbatch;

typedef struct op {
    struct cm384_engine *e;
    microbatch          *mb;
    int                  kind, layer, stage;
    int                  n_jobs;
    const gl_mat        *head;      /* OP_HEAD                                          */
    const float         *head_norm;
    const float         *h_in;      /* OP_MTP_IN: [n][dim] main model's final hidden    */
    int                  core_split;/* OP_ATTN: head groups per tile in the attention core */
    int                  core_lanes;/* OP_ATTN: CORE_LANES when a tile's lanes are tasks of
                                       their own (few tiles), else 1                   */
    region              *rg;        /* the peer's region its stages add to              */
    task_fn              head_fn;   /* OP_ATTN: the per-head product op_heads added...  */
    int                  heads_per_task; /* ... and the heads each of its tasks runs    */
    /* OP_ATTN, expanded prefill: the run of rows (one sequence) and the
       chunk of its keys being attended, and the run's tiles */
    int                  x_r0, x_r1, x_keys, x_c0, x_c1, x_t0, x_t1, x_dev;
} op;

static mm_job *op_job(op *o) {
    fwd_scratch *s = o->mb->s;
    if (o->n_jobs >= s->n_jobs_cap) {
        /* a bug (the jobs are sized at engine creation): hand back a spare job
           that region_add will refuse, and fail the step */
        region_break(o->rg, "a layer needs more matrix jobs than its scratch was sized for");
        o->n_jobs = s->n_jobs_cap;
        return &s->jobs[s->n_jobs_cap];
    }
    mm_job *jb = &s->jobs[o->n_jobs++];
    memset(jb, 0, sizeof *jb);
    jb->k = o->e->k;
    return jb;
}

/* `times` decode products of w over n rows, for the roofline (cm384_stats):
 * their bytes as stored (block formats by their blocks) and multiply-adds. */
static void roof_count(struct cm384_engine *e, const gl_mat *w, int n, int times) {
    uint64_t bytes = (uint64_t)mat_bytes(w) * (uint64_t)times;
    uint64_t values = (uint64_t)w->rows * (uint64_t)w->cols * (uint64_t)times;
    int i = n < CM384_ROOF_ROWS ? n - 1 : CM384_ROOF_ROWS - 1;
    atomic_fetch_add_explicit(&e->roof_bytes[i], bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->roof_macs[i], values * (uint64_t)n, memory_order_relaxed);
}

/* y = W x over a device's rows.  INT8 weights (GL_Q8) read the rows'
 * quantized copy xq (same row stride) and scales xs instead of x. */
static void op_mmq(op *o, region *rg, const gl_mat *w, const float *x, const int8_t *xq, const float *xs, int ldx,
                   float *y, int ldy, int n, int device) {
    if (n <= 0) return;
    mm_job *jb = op_job(o);
    jb->w = w; jb->x = x; jb->xq = xq; jb->xs = xs; jb->ldx = ldx; jb->y = y; jb->ldy = ldy; jb->n = n;
    region_add_mm(rg, o->e->n_workers, jb, device);
    atomic_fetch_add_explicit(&o->e->weight_bytes[o->mb->phase == PHASE_DECODE],
                              (uint64_t)w->rows * (uint64_t)w->cols * gl_type_size(w->type), memory_order_relaxed);
    if (o->mb->phase == PHASE_DECODE) roof_count(o->e, w, n, 1);
}

/* The group added at index `first` (if any) did every device group's work
 * of mb at once: its time is charged to each device by rows. */
static void fused_charge(region *rg, int first, const microbatch *mb) {
    if (region_groups(rg) > first) { rg->g[first].split = mb->groups; rg->g[first].n_split = mb->n_groups; }
}

/* y = W x over every device group's rows (x, xq, xs, y point at row 0).
 * Each device computes its own rows; in the default topology the devices
 * share one copy of W in this process, so the product streams W once for
 * all of them and charges each by its rows -- the paper preset keeps one
 * pass per device, the cost DP attention has when every device reads its
 * own copy.  Rows, not groups, decide every result either way. */
static void op_mm_rows(op *o, region *rg, const gl_mat *w, const float *x, const int8_t *xq, const float *xs,
                       int ldx, float *y, int ldy) {
    microbatch *mb = o->mb;
    if (o->e->fuse_groups && mb->n_groups > 1) {
        int first = region_groups(rg);
        op_mmq(o, rg, w, x, xq, xs, ldx, y, ldy, mb->n, mb->groups[0].device);
        fused_charge(rg, first, mb);
        return;
    }
    FOR_GROUPS(mb, g) {
        size_t f = (size_t)mb->groups[g].first;
        op_mmq(o, rg, w, x + f * ldx, xq ? xq + f * ldx : NULL, xs ? xs + f : NULL, ldx, y + f * ldy, ldy,
               mb->groups[g].n, mb->groups[g].device);
    }
}

/* The INT8 copy of layer l when the engine runs W8A8, else NULL. */
static const layer_q8 *op_q8(const op *o) {
    return o->e->cfg.int8 && o->layer >= 0 ? &o->e->m->q8[o->layer] : NULL;
}

static void quantize_row(const struct cm384_engine *e, const float *x, int n, int8_t *q, float *scale);

/* ---- per-token tasks ---- */

/* The residual add the previous op owes x, then the norm of this op. */
static void t_norm(void *ctx, int g, int t, int worker);
#define COMBINE_SLAB 256   /* columns of the combine summed in registers and on the stack */

/* The norm, then the row as an INT8 message would bring it to a receiver
 * (quantized per token, dequantized), into recv_f: the input of a shared
 * expert computed at the source in place of one the paper preset's decode
 * sends tokens to. */
static void t_norm_dq(void *ctx, int g, int t, int worker) {
    t_norm(ctx, g, t, worker);
    op *o = ctx;
    fwd_scratch *s = o->mb->s;
    int D = o->e->m->hp.dim, r = o->mb->groups[g].first + t;
    int8_t *q = s->xnq + (size_t)r * D;
    quantize_row(o->e, s->xn + (size_t)r * D, D, q, &s->xns[r]);
    float *f = s->recv_f + (size_t)r * D, sc = s->xns[r];
    for (int d = 0; d < D; d++) f[d] = (float)q[d] * sc;
}

static void t_norm(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const cm384_model *m = o->e->m;
    const hparams *hp = &m->hp;
    fwd_scratch *s = mb->s;
    int D = hp->dim, r = mb->groups[g].first + t;
    float *x = s->x + (size_t)r * D;
    if (mb->pending == PEND_EMBED) {
        gl_row_to_f32(&m->embed, mb->tok[r], x);
        rope_angles(m, mb->pos[r], s->rope_cs + (size_t)r * hp->qk_rope);
    } else if (mb->pending == PEND_ADD_TMP) {
        o->e->k->axpy(x, s->tmp + (size_t)r * D, 1.0f, D);       /* x + a, exactly rounded */
    } else if (mb->pending == PEND_COMBINE) {
        int K = hp->top_k, has_shared = m->layers[mb->pending_layer].shared.gate.data != NULL;
        const float *w = s->top_w + (size_t)r * K, *cb = s->comb + (size_t)r * (K + 1) * D;
        if (o->e->bf16_combine) {            /* expert outputs came back in BF16 */
            const uint16_t *c16 = s->comb16 + (size_t)r * (K + 1) * D;
            int shared16 = o->e->place[mb->phase].n_shared > 0;   /* else computed here, fp32 */
            int as_sent = !shared16 && o->e->place[PHASE_DECODE].n_shared > 0;   /* rounded as decode's comes back */
            for (int d = 0; d < D; d++) {
                float acc = 0;
                for (int k = 0; k < K; k++) acc += w[k] * gl_bf16_to_f32(c16[(size_t)k * D + d]);
                if (has_shared)
                    acc += shared16 ? gl_bf16_to_f32(c16[(size_t)K * D + d])
                         : as_sent ? gl_bf16_to_f32(gl_f32_to_bf16(cb[(size_t)K * D + d])) : cb[(size_t)K * D + d];
                x[d] += acc;
            }
        } else {             /* the same sums, a slab of columns at a time by the kernels' axpy */
            const gl_kernels *kn = o->e->k;
            float acc[COMBINE_SLAB];
            for (int d0 = 0; d0 < D; d0 += COMBINE_SLAB) {
                int nd = D - d0 < COMBINE_SLAB ? D - d0 : COMBINE_SLAB;
                memset(acc, 0, (size_t)nd * sizeof(float));
                for (int k = 0; k < K; k++) kn->axpy(acc, cb + (size_t)k * D + d0, w[k], nd);
                if (has_shared) kn->axpy(acc, cb + (size_t)K * D + d0, 1.0f, nd);
                kn->axpy(x + d0, acc, 1.0f, nd);
            }
        }
    }
    const float *nw = o->kind == OP_ATTN ? m->layers[o->layer].attn_norm
                    : o->kind == OP_FFN  ? m->layers[o->layer].ffn_norm : o->head_norm;
    float *xn = s->xn + (size_t)r * D;
    rmsnorm(o->e->k, xn, x, nw, D, hp->eps);
    if (o->e->dbg_amax && o->kind != OP_HEAD) {
        float *am = o->e->dbg_amax + ((size_t)o->layer * 2 + (o->kind == OP_ATTN ? 0 : 1)) * D;
        for (int d = 0; d < D; d++) if (fabsf(xn[d]) > am[d]) am[d] = fabsf(xn[d]);
    }
    if (op_q8(o) && o->kind != OP_HEAD) quantize_row(o->e, xn, D, s->xnq + (size_t)r * D, &s->xns[r]);
    if (o->kind == OP_HEAD) {
        if (s->sel[r] >= 0) memcpy(s->hsel + (size_t)s->sel[r] * D, xn, (size_t)D * sizeof(float));
        if (s->sel[r] >= 0 && o->head->type == GL_Q8)
            quantize_row(o->e, xn, D, s->hselq + (size_t)s->sel[r] * D, &s->hsels[s->sel[r]]);
        if (mb->h_out) memcpy(mb->h_out + (size_t)r * D, xn, (size_t)D * sizeof(float));
    }
}

/* q_a_layernorm, and the token's KV row: normed latent + rotated k_pe. */
static void t_kv_write(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const cm384_model *m = o->e->m;
    const hparams *hp = &m->hp;
    const layer_w *L = &m->layers[o->layer];
    int r = mb->groups[g].first + t, lat = hp->kv_lora + hp->qk_rope;
    if (hp->q_lora) {
        float *qa = mb->s->qa + (size_t)r * hp->q_lora;
        rmsnorm(o->e->k, qa, qa, L->q_norm, hp->q_lora, hp->eps);
        if (op_q8(o)) quantize_row(o->e, qa, hp->q_lora, mb->s->qaq + (size_t)r * hp->q_lora, &mb->s->qas[r]);
    }
    float *kva = mb->s->kva + (size_t)r * lat;
    void *slot = kv_row(&o->e->kv, mb->tables[r], o->layer, mb->pos[r] + mb->kv_shift);
    int bf16 = o->e->kv.bf16;
    float *row = bf16 ? kva : slot;                /* bf16: made in place, then rounded */
    rmsnorm(o->e->k, row, kva, L->kv_norm, hp->kv_lora, hp->eps);
    if (!bf16) memcpy(row + hp->kv_lora, kva + hp->kv_lora, (size_t)hp->qk_rope * sizeof(float));
    rope(row + hp->kv_lora, mb->s->rope_cs + (size_t)r * hp->qk_rope, hp->qk_rope);
    if (bf16)
        for (int i = 0; i < lat; i++) ((uint16_t *)slot)[i] = gl_f32_to_bf16(row[i]);
}

/* The per-head products (t_absorb, t_uv) take a device group's rows, or
 * with ALL_GROUPS every group's at once: the groups lie side by side from
 * row 0, and in the default topology the devices share one copy of each
 * head's matrix, so it is read once for all of them (as op_mm_rows does). */
#define ALL_GROUPS -1
static dev_group head_rows(const microbatch *mb, int g) {
    if (g != ALL_GROUPS) return mb->groups[g];
    dev_group all = mb->groups[0];
    all.first = 0;
    all.n = mb->n;
    return all;
}

/* Head 0's absorbed product (uv: W_uv, else W_uk^T) in the type it is used
 * in; every head's has its shape and type. */
static const gl_mat *head_mat(const op *o, int uv) {
    const layer_w *L = &o->e->m->layers[o->layer];
    const layer_q8 *Q = op_q8(o);
    return uv ? (Q ? &Q->w_uv[0] : &L->w_uv[0]) : (Q ? &Q->w_uk_t[0] : &L->w_uk_t[0]);
}

/* Bytes of one token's absorbed products over every head: t_absorb's and
 * t_uv's size. */
static size_t head_bytes(const op *o, int uv) {
    const gl_mat *w = head_mat(o, uv);
    return (size_t)o->e->m->hp.n_heads * mat_bytes(w);
}

/* A run of o->heads_per_task heads of a per-head product, in order. */
static void t_heads(void *ctx, int g, int task, int worker) {
    op *o = ctx;
    int H = o->e->m->hp.n_heads, h1 = (task + 1) * o->heads_per_task;
    for (int h = task * o->heads_per_task; h < h1 && h < H; h++) o->head_fn(ctx, g, h, worker);
}

/* Adds a per-head product's tasks, for each device group or, when the
 * groups are fused, for all of them (charged to each by rows).  Prefill
 * takes a head a task; a few rows (decode) take a run of heads a task, one
 * run a worker: a head's matrix is only 64 KB at DeepSeek's shapes, and
 * as a task of its own each began a cold stream of weights (bench-M INT8,
 * one stream: W_uk^T of 16 heads, 1 MB, read at 33 GB/s a step against
 * 60-70 for the projections beside it).  The heads' results are the same
 * whatever the runs. */
static void op_heads(op *o, region *rg, task_fn fn, int uv) {
    microbatch *mb = o->mb;
    int H = o->e->m->hp.n_heads, W = o->e->n_workers;
    o->head_fn = fn;
    o->heads_per_task = mb->n <= MM_STREAM_MAX_N && W > 1 ? (H + W - 1) / W : 1;
    if (mb->phase == PHASE_DECODE) {   /* every head's product over each group's rows */
        if (o->e->fuse_groups && mb->n_groups > 1) roof_count(o->e, head_mat(o, uv), mb->n, H);
        else FOR_GROUPS(mb, g) roof_count(o->e, head_mat(o, uv), mb->groups[g].n, H);
    }
    int tasks = (H + o->heads_per_task - 1) / o->heads_per_task;
    if (o->e->fuse_groups && mb->n_groups > 1) {
        int first = region_groups(rg);
        region_add_sized(rg, t_heads, o, ALL_GROUPS, tasks, mb->groups[0].device, head_bytes(o, uv) * (size_t)mb->n);
        fused_charge(rg, first, mb);
        return;
    }
    FOR_GROUPS(mb, g)
        region_add_sized(rg, t_heads, o, g, tasks, mb->groups[g].device, head_bytes(o, uv) * (size_t)mb->groups[g].n);
}

/* Absorb W_uk into the query for one head over a device's rows, then place
 * the rotated q_pe after it: one dot with a KV row scores both parts. */
static void t_absorb(void *ctx, int g, int h, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const cm384_model *m = o->e->m;
    const hparams *hp = &m->hp;
    const layer_w *L = &m->layers[o->layer];
    int H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope, lat = hp->kv_lora + hp->qk_rope;
    const dev_group rows = head_rows(mb, g), *gr = &rows;
    const float *q = mb->s->q + ((size_t)gr->first * H + h) * qk;
    float *ql = mb->s->qlat + ((size_t)gr->first * H + h) * lat;
    const layer_q8 *Q = op_q8(o);
    if (Q) {   /* W8A8: this head's q_nope quantized per token */
        int nope = hp->qk_nope;
        int8_t *xq = mb->s->qnq + ((size_t)h * mb->s->cap + gr->first) * nope;
        float *xs = mb->s->qns + (size_t)h * mb->s->cap + gr->first;
        o->e->k->quantize_q8(q, gr->n, nope, H * qk, xq, nope, xs);
        o->e->k->matmul_q8(&Q->w_uk_t[h], xq, xs, gr->n, nope, ql, H * lat, 0, hp->kv_lora);
    } else {
        o->e->k->matmul(&L->w_uk_t[h], q, gr->n, H * qk, ql, H * lat, 0, hp->kv_lora);
    }
    for (int t = 0; t < gr->n; t++) {
        float *dst = ql + (size_t)t * H * lat + hp->kv_lora;
        memcpy(dst, q + (size_t)t * H * qk + hp->qk_nope, (size_t)hp->qk_rope * sizeof(float));
        rope(dst, mb->s->rope_cs + (size_t)(gr->first + t) * hp->qk_rope, hp->qk_rope);
    }
}

/* Attention core for a tile of up to CORE_TILE consecutive queries of one
 * sequence and a range of heads, a chunk of keys (a few KV blocks) at a time
 * as flash attention goes.  The chunk's scores come from the dot_rows_t
 * kernel, a block at a time: the tile's queries and heads are laid out
 * transposed (core_queries), so each element of a key's row is multiplied
 * into 16 heads' sums at once and the row is read once for all of them
 * (twice the speed of the row-by-query dot products, which spent their time
 * in horizontal sums).  Each
 * (query, head) keeps a running shift M and sum L of e^(scale*(score - M));
 * then the chunk's rows, still in cache, are added with their weights to the
 * attended latent.  M is raised (and the latent and L scaled down to match)
 * only when a score exceeds it by enough that e^(scale*(score - M)) could
 * pass e^CORE_SLACK, so that is rare.  Each latent row comes from memory
 * once per task, not once for the scores and again for the sum, and no
 * buffer grows with the context.
 *
 * The chunks (fixed by KV slot) go round-robin to CORE_LANES lanes, each a
 * partial softmax of its own (M, L and an unnormalized latent); the lanes are
 * folded in lane order and the latent divided by L at the end.  One query
 * decoding over a long context is then CORE_LANES tasks that read a quarter
 * of its latent cache each, instead of tasks that split the heads and read
 * all of it again (at 4,000 tokens the reading again was a fifth of a
 * decode step).
 * Every (query, head) result is the same whatever tile, split or task it
 * falls in: the kernels' per-row results do not depend on the batch, each
 * lane visits the same chunks in the same order, and the fold is the same
 * function in the same order wherever it runs.  A context of one chunk has
 * one lane and no fold. */

/* The core in native BF16: the opt-in kernel set that has it ("avx512_bf16")
 * over a bf16 latent cache.  Queries and softmax weights are rounded to
 * bf16 and multiplied by vdpbf16ps (twice the FMA rate); the invariances
 * above hold as they do in fp32, since each (query, head) result is still
 * one chain per kernel call, and the calls are the same wherever it falls. */
static int core_native(const struct cm384_engine *e) { return e->kv.bf16 && e->k->dot_rows_tp_bf16; }

/* The tile's absorbed queries for heads [h0, h1), transposed into the
 * worker's qt: element c of (query q, head h) at qt[c * nl + q * (h1 - h0) +
 * h - h0], nl = the tile's queries times h1 - h0. */
static void core_queries(op *o, int tile, int h0, int h1, int worker) {
    fwd_scratch *s = o->mb->s;
    const hparams *hp = &o->e->m->hp;
    int H = hp->n_heads, lat_w = hp->kv_lora + hp->qk_rope, nq = s->tile_n[tile];
    float *dst = s->qt + (size_t)worker * CORE_TILE * H * lat_w;
    const float *src = s->qlat + (size_t)s->tile_row[tile] * H * lat_w;
    int nh = h1 - h0;
    for (int q = 0; q < nq; q++)             /* dst[c][q][h - h0] = src[q][h][c] */
        o->e->k->transpose(dst + (size_t)q * nh, nq * nh, src + ((size_t)q * H + h0) * lat_w, lat_w, nh, lat_w);
    if (core_native(o->e))                   /* and as bf16 pairs of c, for vdpbf16ps */
        o->e->k->round_pairs_bf16(s->qtp + (size_t)worker * CORE_TILE * H * ((lat_w + 1) / 2), nq * nh, dst, nq * nh,
                                  lat_w, nq * nh);
}

/* One lane of a tile over heads [h0, h1) (core_queries has laid them out):
 * its unnormalized latents at
 * lat + h * ldh + q * ldq, its M and L at ml + (q * H + h) * 2 (L = 0: the
 * lane saw no key of that query, and its latent is left unwritten). */
static void core_lane(op *o, int tile, int h0, int h1, int lane, float *lat, size_t ldh, size_t ldq, float *ml_out,
                      int worker) {
    microbatch *mb = o->mb;
    struct cm384_engine *e = o->e;
    const hparams *hp = &e->m->hp;
    const gl_kernels *k = e->k;
    fwd_scratch *s = mb->s;
    int H = hp->n_heads, lat_w = hp->kv_lora + hp->qk_rope, R = hp->kv_lora, B = e->kv.block_tokens;
    int CH = s->core_chunk;                                          /* keys per chunk: whole blocks */
    int r0 = s->tile_row[tile], nq = s->tile_n[tile], sh = mb->kv_shift;
    int p0 = mb->pos[r0], n_keys = mb->pos[r0 + nq - 1] + 1;       /* keys of the last query */
    const int *tab = mb->tables[r0];
    float *sc = s->scores + (size_t)worker * CORE_TILE * H * CH;     /* [q][h][key in chunk] */
    const float *qt = s->qt + (size_t)worker * CORE_TILE * H * lat_w;
    int nh = h1 - h0, nl = nq * nh;
    float scale = e->m->attn_scale, slack = e->core_slack / scale;
    int bf16 = e->kv.bf16;       /* a bf16 cache is read as it is, by the kernels' bf16 forms */
    int native = core_native(e);
    const uint32_t *qtp = s->qtp + (size_t)worker * CORE_TILE * H * ((lat_w + 1) / 2);
#define SC(h, q) (sc + ((size_t)(q) * H + (h)) * CH)
#define ML(h, q) (ml_out + ((size_t)(q) * H + (h)) * 2)
#define LATENT(h, q) (lat + (size_t)(h) * ldh + (size_t)(q) * ldq)
    for (int q = 0; q < nq; q++)
        for (int h = h0; h < h1; h++) ML(h, q)[0] = -INFINITY, ML(h, q)[1] = 0;
    for (int c0 = 0; c0 < n_keys;) {
        int c1 = c0 + CH - (c0 + sh) % CH;            /* the chunk's end, by slot */
        if (c1 > n_keys) c1 = n_keys;
        if ((c0 + sh) / CH % CORE_LANES != lane) {   /* another lane's chunk */
            c0 = c1;
            continue;
        }
        /* scores, a block's run of keys at a time (slot = key + kv_shift);
         * every head of a query reads the same latent rows (MLA), so the heads
         * are the product's lanes: one call per query, or one for the whole
         * tile when it has every head */
        for (int j0 = c0; j0 < c1;) {
            int nk = B - (j0 + sh) % B;
            if (nk > c1 - j0) nk = c1 - j0;
            const void *rows = kv_row(&e->kv, tab, o->layer, j0 + sh);
            for (int q = 0; q < (nh == H ? 1 : nq); q++) {
                float *y = nh == H ? SC(0, 0) : SC(h0, q);
                const float *qq = qt + (size_t)q * nh;
                int lanes = nh == H ? nl : nh;
                if (native) k->dot_rows_tp_bf16(y + (j0 - c0), CH, qtp + (size_t)q * nh, nl, lanes, rows, lat_w, nk, lat_w);
                else if (bf16) k->dot_rows_t_bf16(y + (j0 - c0), CH, qq, nl, lanes, rows, lat_w, nk, lat_w);
                else k->dot_rows_t(y + (j0 - c0), CH, qq, nl, lanes, rows, lat_w, nk, lat_w);
            }
            j0 += nk;
        }
        for (int q = 0; q < nq; q++) {
            int m = p0 + q + 1 - c0;                   /* keys of this chunk query q sees */
            if (m <= 0) continue;
            if (m > c1 - c0) m = c1 - c0;
            for (int h = h0; h < h1; h++) {
                float *p = SC(h, q), *ml = ML(h, q), bm = p[0];
                for (int j = 1; j < m; j++) if (p[j] > bm) bm = p[j];
                if (ml[1] == 0) {
                    ml[0] = bm;                        /* the lane's first chunk sets the shift */
                    memset(LATENT(h, q), 0, (size_t)R * sizeof(float));
                } else if (bm > ml[0] + slack) {       /* raise it: scale down what came before */
                    float f = expf(scale * (ml[0] - bm)), *lt = LATENT(h, q);
                    ml[1] *= f;
                    for (int i = 0; i < R; i++) lt[i] *= f;
                    ml[0] = bm;
                }
                ml[1] += k->exp_sum(p, m, scale, ml[0]);
            }
            /* the weighted rows, CORE_ROWP at a time across the chunk's
               blocks: the sums stay in registers from block to block */
            for (int j0 = c0; j0 < c0 + m; j0 += CORE_ROWP) {
                int nk = c0 + m - j0 < CORE_ROWP ? c0 + m - j0 : CORE_ROWP;
                const void *rp[CORE_ROWP];
                for (int j = 0; j < nk; j++) rp[j] = kv_row(&e->kv, tab, o->layer, j0 + j + sh);
                if (native)
                    k->axpy_rowp_n_bf16p(LATENT(h0, q), (int)ldh, (const uint16_t *const *)rp, SC(h0, q) + (j0 - c0), CH,
                                         h1 - h0, nk, R);
                else if (bf16)
                    k->axpy_rowp_n_bf16(LATENT(h0, q), (int)ldh, (const uint16_t *const *)rp, SC(h0, q) + (j0 - c0), CH,
                                        h1 - h0, nk, R);
                else
                    k->axpy_rowp_n(LATENT(h0, q), (int)ldh, (const float *const *)rp, SC(h0, q) + (j0 - c0), CH, h1 - h0,
                                   nk, R);
            }
        }
        c0 = c1;
    }
#undef SC
#undef ML
#undef LATENT
}

/* Folds a lane (latent part, M and L in part_ml) into the lanes before it
 * (acc, acc_ml); an empty lane (L = 0) adds nothing.  The side with the
 * smaller shift is scaled onto the other's, by the kernels' axpy (part is
 * scratch and may be overwritten). */
static void core_fold(const gl_kernels *k, float *acc, float *acc_ml, float *part, const float *part_ml, int R,
                      float scale) {
    if (part_ml[1] == 0) return;
    if (acc_ml[1] == 0) {
        memcpy(acc, part, (size_t)R * sizeof(float));
        acc_ml[0] = part_ml[0];
        acc_ml[1] = part_ml[1];
        return;
    }
    if (acc_ml[0] >= part_ml[0]) {
        float f = expf(scale * (part_ml[0] - acc_ml[0]));
        acc_ml[1] += part_ml[1] * f;
        k->axpy(acc, part, f, R);
    } else {
        float f = expf(scale * (acc_ml[0] - part_ml[0]));
        acc_ml[0] = part_ml[0];
        acc_ml[1] = part_ml[1] + acc_ml[1] * f;
        k->axpy(part, acc, f, R);
        memcpy(acc, part, (size_t)R * sizeof(float));
    }
}

static void core_normalize(float *lat, const float *ml, int R) {
    float inv = 1.0f / ml[1];
    for (int i = 0; i < R; i++) lat[i] *= inv;
}

/* A task of the core: a tile's head group, every lane in turn (folded as
 * each ends) -- or, when the tile's lanes are tasks of their own
 * (o->core_lanes > 1), one lane, which t_uv folds. */
static void t_core(void *ctx, int g, int task, int worker) {
    op *o = ctx;
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    const hparams *hp = &o->e->m->hp;
    int H = hp->n_heads, R = hp->kv_lora, lanes = o->core_lanes, per_tile = lanes * o->core_split;
    int tile = s->tile_first[g] + task / per_tile, lane = task % per_tile / o->core_split;
    int per = (H + o->core_split - 1) / o->core_split, h0 = task % o->core_split * per, h1 = h0 + per;
    if (h1 > H) h1 = H;
    int r0 = s->tile_row[tile], nq = s->tile_n[tile];
    float *latent = s->ctx + (size_t)r0 * R;                         /* [h][cap][R] from row r0 */
    size_t ldh = (size_t)s->cap * R;
    if (lanes > 1) {              /* one lane: lane 0 in place, the others beside it */
        float *ml = s->split_ml + (size_t)tile * CORE_TILE * H * CORE_LANES * 2;
        float *run = s->run_ml + (size_t)worker * 2 * CORE_TILE * H * 2;
        core_queries(o, tile, h0, h1, worker);
        if (lane == 0)
            core_lane(o, tile, h0, h1, 0, latent, ldh, R, run, worker);
        else
            core_lane(o, tile, h0, h1, lane, s->split_lat + (size_t)tile * CORE_TILE * (CORE_LANES - 1) * H * R +
                      (size_t)(lane - 1) * H * R, R, (size_t)(CORE_LANES - 1) * H * R, run, worker);
        for (int q = 0; q < nq; q++)
            for (int h = h0; h < h1; h++)
                memcpy(ml + (((size_t)q * H + h) * CORE_LANES + lane) * 2, run + ((size_t)q * H + h) * 2, 2 * sizeof(float));
        return;
    }
    float *acc = s->run_ml + (size_t)worker * 2 * CORE_TILE * H * 2, *run = acc + CORE_TILE * H * 2;
    float *part = s->lane_lat + (size_t)worker * CORE_TILE * H * R;
    float scale = o->e->m->attn_scale;
    core_queries(o, tile, h0, h1, worker);
    core_lane(o, tile, h0, h1, 0, latent, ldh, R, acc, worker);
    for (int l = 1; l < CORE_LANES; l++) {
        core_lane(o, tile, h0, h1, l, part, R, (size_t)H * R, run, worker);
        for (int q = 0; q < nq; q++)
            for (int h = h0; h < h1; h++)
                core_fold(o->e->k, latent + h * ldh + (size_t)q * R, acc + ((size_t)q * H + h) * 2,
                          part + ((size_t)q * H + h) * R, run + ((size_t)q * H + h) * 2, R, scale);
    }
    for (int q = 0; q < nq; q++)
        for (int h = h0; h < h1; h++) core_normalize(latent + h * ldh + (size_t)q * R, acc + ((size_t)q * H + h) * 2, R);
}

/* The lanes of head h of group g's tiles, when they ran as tasks of their
 * own: folded in lane order (as t_core folds them) and normalized. */
static void core_fold_split(op *o, int g, int h) {
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    const hparams *hp = &o->e->m->hp;
    int H = hp->n_heads, R = hp->kv_lora;
    float scale = o->e->m->attn_scale;
    for (int tile = s->tile_first[g]; tile < s->tile_first[g + 1]; tile++)
        for (int q = 0; q < s->tile_n[tile]; q++) {
            float *lt = s->ctx + ((size_t)h * s->cap + s->tile_row[tile] + q) * R;
            float *ml = s->split_ml + (((size_t)tile * CORE_TILE + q) * H + h) * CORE_LANES * 2;
            float *lanes = s->split_lat + (size_t)tile * CORE_TILE * (CORE_LANES - 1) * H * R;
            for (int l = 1; l < CORE_LANES; l++)
                core_fold(o->e->k, lt, ml, lanes + (((size_t)q * (CORE_LANES - 1) + l - 1) * H + h) * R, ml + 2 * l, R, scale);
            core_normalize(lt, ml, R);
        }
}

/* Cuts each device group's rows into attention-core tiles: runs of
 * consecutive positions of one sequence, at most max_len long. */
static void core_tiles(microbatch *mb, int max_len) {
    fwd_scratch *s = mb->s;
    int n = 0;
    FOR_GROUPS(mb, g) {
        s->tile_first[g] = n;
        int end = mb->groups[g].first + mb->groups[g].n;
        for (int r = mb->groups[g].first; r < end;) {
            int len = 1;
            while (r + len < end && len < max_len && mb->tables[r + len] == mb->tables[r] &&
                   mb->pos[r + len] == mb->pos[r] + len)
                len++;
            s->tile_row[n] = r;
            s->tile_n[n] = len;
            n++;
            r += len;
        }
    }
    s->tile_first[mb->n_groups] = n;
}

/* Values for one head over a device's rows: att[h] = W_uv[h] ctx[h]. */
static void t_uv(void *ctx, int g, int h, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const hparams *hp = &o->e->m->hp;
    const layer_w *L = &o->e->m->layers[o->layer];
    int H = hp->n_heads, R = hp->kv_lora;
    const dev_group rows = head_rows(mb, g), *gr = &rows;
    if (o->core_lanes > 1) {
        if (g != ALL_GROUPS) core_fold_split(o, g, h);
        else FOR_GROUPS(mb, k) core_fold_split(o, k, h);
    }
    const float *c = mb->s->ctx + ((size_t)h * mb->s->cap + gr->first) * R;
    float *y = mb->s->att + ((size_t)gr->first * H + h) * hp->v_head;
    const layer_q8 *Q = op_q8(o);
    if (Q) {   /* W8A8: this head's attended latent quantized per token */
        int8_t *xq = mb->s->ctxq + ((size_t)h * mb->s->cap + gr->first) * R;
        float *xs = mb->s->ctxs + (size_t)h * mb->s->cap + gr->first;
        o->e->k->quantize_q8(c, gr->n, R, R, xq, R, xs);
        o->e->k->matmul_q8(&Q->w_uv[h], xq, xs, gr->n, R, y, H * hp->v_head, 0, hp->v_head);
    } else {
        o->e->k->matmul(&L->w_uv[h], c, gr->n, R, y, H * hp->v_head, 0, hp->v_head);
    }
}

/* ---- expanded prefill: DeepSeek's "naive" MLA ----
 * Absorbed attention dots each query with whole latent rows (576 values a
 * key and head, 512 more for the weighted sum).  A prompt has many queries
 * for each key, so prefill can instead expand each key once per head --
 * K_nope = W_uk c and V = W_uv c from its latent c -- and attend with head
 * dimension 192 (128 for the values): about a third of the core's work,
 * paid for by two products over the keys (cm384_config.prefill_expanded).
 * Keys go in chunks of XKEYS (fixed by KV slot, so the running softmax of
 * every (query, head) meets the same chunks in the same order, whatever the
 * batch): a chunk's latent rows are gathered (t_xgather), expanded per head
 * into rows of K and V (t_xexpand), then every tile of XTILE queries
 * attends to it, one head a task (t_xattend: the tile's queries are the
 * scores kernel's 16 lanes), keeping its running max, sum and unnormalized
 * output in the rows' att and xml; t_xnorm divides at the end.  The
 * queries are rotated and laid out once per layer (t_xinit).  Decode stays
 * absorbed: one query per key would pay the expansion for nothing. */

/* A tile's rows: q_pe rotated in place (the absorbed path rotates its
 * copy), outputs and running sums cleared, and the queries laid out for
 * the scores kernel -- per head, element c of the tile's nq queries at
 * qlat (unused here) + (r0 * H + h * nq) * qk + c * nq + q. */
static void t_xinit(void *ctx, int g, int task, int worker) {
    (void)worker;
    op *o = ctx;
    fwd_scratch *s = o->mb->s;
    const hparams *hp = &o->e->m->hp;
    int H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope, tile = s->tile_first[g] + task;
    int r0 = s->tile_row[tile], nq = s->tile_n[tile];
    for (int r = r0; r < r0 + nq; r++) {
        for (int h = 0; h < H; h++) {
            rope(s->q + ((size_t)r * H + h) * qk + hp->qk_nope, s->rope_cs + (size_t)r * hp->qk_rope, hp->qk_rope);
            float *ml = s->xml + ((size_t)r * H + h) * 2;
            ml[0] = -INFINITY;
            ml[1] = 0;
        }
        memset(s->att + (size_t)r * H * hp->v_head, 0, (size_t)H * hp->v_head * sizeof(float));
    }
    for (int h = 0; h < H; h++) {
        float *qt = s->qlat + ((size_t)r0 * H + (size_t)h * nq) * qk;
        for (int q = 0; q < nq; q++) {
            const float *src = s->q + ((size_t)(r0 + q) * H + h) * qk;
            for (int c = 0; c < qk; c++) qt[(size_t)c * nq + q] = src[c];
        }
    }
}

/* The largest of p[0..n), n >= 1 (eight chains: the scan is latency-bound). */
static float max_of(const float *p, int n) {
    float b[8];
    int j = 0;
    for (int i = 0; i < 8; i++) b[i] = p[0];
    for (; j + 8 <= n; j += 8)
        for (int i = 0; i < 8; i++) b[i] = p[j + i] > b[i] ? p[j + i] : b[i];
    for (; j < n; j++) b[0] = p[j] > b[0] ? p[j] : b[0];
    for (int i = 1; i < 8; i++) b[0] = b[i] > b[0] ? b[i] : b[0];
    return b[0];
}

/* The chunk's latent rows, one KV block's run a task, into xlat as fp32. */
static void t_xgather(void *ctx, int arg, int task, int worker) {
    (void)arg; (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const kv_pool *kv = &o->e->kv;
    int B = kv->block_tokens, sh = mb->kv_shift, lat = kv->row;
    int j0 = o->x_c0 + task * B - (task ? (o->x_c0 + sh) % B : 0), j1 = j0 + B - (j0 + sh) % B;
    if (j1 > o->x_c1) j1 = o->x_c1;
    const void *rows = kv_row(kv, mb->tables[o->x_r0], o->layer, j0 + sh);
    float *dst = mb->s->xlat + (size_t)(j0 - o->x_c0) * lat;
    if (kv->bf16)
        for (size_t i = 0; i < (size_t)(j1 - j0) * lat; i++) dst[i] = gl_bf16_to_f32(((const uint16_t *)rows)[i]);
    else
        memcpy(dst, rows, (size_t)(j1 - j0) * lat * sizeof(float));
    const layer_q8 *Q = op_q8(o);
    int R = o->e->m->hp.kv_lora;
    if (Q && Q->w_uk)   /* W8A8: each latent quantized, as t_uv quantizes the attended ones */
        o->e->k->quantize_q8(dst, j1 - j0, R, lat, mb->s->xlatq + (size_t)(j0 - o->x_c0) * R, R, mb->s->xlats + (j0 - o->x_c0));
}

/* Head h's keys and values for the chunk: K = [W_uk c, k_pe] (192 values
 * a key) and V = W_uv c, each a row per key. */
static void t_xexpand(void *ctx, int arg, int h, int worker) {
    (void)arg; (void)worker;
    op *o = ctx;
    fwd_scratch *s = o->mb->s;
    const hparams *hp = &o->e->m->hp;
    const layer_w *L = &o->e->m->layers[o->layer];
    int nk = o->x_c1 - o->x_c0, X = s->x_keys, nope = hp->qk_nope, qk = nope + hp->qk_rope;
    int R = hp->kv_lora, lat = R + hp->qk_rope;
    float *kr = s->xk + (size_t)h * X * qk, *v = s->xv + (size_t)h * X * hp->v_head;
    const layer_q8 *Q = op_q8(o);
    if (Q && Q->w_uk) {
        o->e->k->matmul_q8(&Q->w_uk[h], s->xlatq, s->xlats, nk, R, kr, qk, 0, nope);
        o->e->k->matmul_q8(&Q->w_uv[h], s->xlatq, s->xlats, nk, R, v, hp->v_head, 0, hp->v_head);
    } else {
        o->e->k->matmul(&L->w_uk[h], s->xlat, nk, lat, kr, qk, 0, nope);
        o->e->k->matmul(&L->w_uv[h], s->xlat, nk, lat, v, hp->v_head, 0, hp->v_head);
    }
    for (int j = 0; j < nk; j++)
        memcpy(kr + (size_t)j * qk + nope, s->xlat + (size_t)j * lat + R, (size_t)hp->qk_rope * sizeof(float));
}

/* One tile of queries and one head against the chunk: the scores (the
 * tile's queries are the kernel's lanes, each key row read once for all of
 * them), each query's running softmax, and the values it weights.  Keys
 * past a query (causal) get weight 0, which adds nothing. */
static void t_xattend(void *ctx, int g, int task, int worker) {
    op *o = ctx;
    microbatch *mb = o->mb;
    struct cm384_engine *e = o->e;
    fwd_scratch *s = mb->s;
    const hparams *hp = &e->m->hp;
    const gl_kernels *k = e->k;
    int H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope, V = hp->v_head, X = s->x_keys;
    int first = s->tile_first[g] > o->x_t0 ? s->tile_first[g] : o->x_t0;
    int tile = first + task / H, h = task % H;
    int r0 = s->tile_row[tile], nq = s->tile_n[tile], c0 = o->x_c0, nk = o->x_c1 - c0;
    float scale = e->m->attn_scale, slack = e->core_slack / scale;
    float *sc = s->xsc + (size_t)worker * XTILE * X;
    const float *qt = s->qlat + ((size_t)r0 * H + (size_t)h * nq) * qk;        /* t_xinit laid it out */
    k->dot_rows_t(sc, X, qt, nq, nq, s->xk + (size_t)h * X * qk, qk, nk, qk);
    int most = 0;
    for (int q = 0; q < nq; q++) {
        int m = mb->pos[r0 + q] + 1 - c0;                    /* keys of the chunk it sees */
        if (m > nk) m = nk;
        float *p = sc + (size_t)q * X;
        if (m <= 0) {
            memset(p, 0, (size_t)nk * sizeof(float));
            continue;
        }
        if (m > most) most = m;
        float *ml = s->xml + ((size_t)(r0 + q) * H + h) * 2, *out = s->att + ((size_t)(r0 + q) * H + h) * V;
        float bm = max_of(p, m);
        if (ml[1] == 0) ml[0] = bm;                              /* its first keys set the shift */
        else if (bm > ml[0] + slack) {                           /* raise it: scale what came before */
            float f = expf(scale * (ml[0] - bm));
            ml[1] *= f;
            for (int i = 0; i < V; i++) out[i] *= f;
            ml[0] = bm;
        }
        ml[1] += k->exp_sum(p, m, scale, ml[0]);
        if (m < nk) memset(p + m, 0, (size_t)(nk - m) * sizeof(float));
    }
    if (most)
        k->axpy_rows_n(s->att + ((size_t)r0 * H + h) * V, H * V, s->xv + (size_t)h * X * V, V, sc, X, nq, most, V);
}

/* Each (row, head)'s output divided by its softmax sum. */
static void t_xnorm(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const hparams *hp = &o->e->m->hp;
    int H = hp->n_heads, r = mb->groups[g].first + t;
    for (int h = 0; h < H; h++) {
        const float *ml = mb->s->xml + ((size_t)r * H + h) * 2;
        if (ml[1] > 0) core_normalize(mb->s->att + ((size_t)r * H + h) * hp->v_head, ml, hp->v_head);
    }
}

/* The next chunk of keys to attend (from o->x_c1 on), moving to the next
 * run of rows (one sequence) when a run's keys are done; 0 when all are. */
static int xchunk_next(op *o) {
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    int X = o->e->x_chunk > 0 && o->e->x_chunk < s->x_keys ? o->e->x_chunk : s->x_keys, sh = mb->kv_shift;
    if (o->x_r1 > o->x_r0 && o->x_c1 < o->x_keys) {
        o->x_c0 = o->x_c1;
    } else {
        o->x_r0 = o->x_r1;
        if (o->x_r0 >= mb->n) return 0;
        o->x_r1 = o->x_r0 + 1;
        o->x_keys = mb->pos[o->x_r0] + 1;
        while (o->x_r1 < mb->n && mb->tables[o->x_r1] == mb->tables[o->x_r0]) {
            if (mb->pos[o->x_r1] + 1 > o->x_keys) o->x_keys = mb->pos[o->x_r1] + 1;
            o->x_r1++;
        }
        int n_tiles = s->tile_first[mb->n_groups];
        for (o->x_t0 = 0; o->x_t0 < n_tiles && s->tile_row[o->x_t0] < o->x_r0; o->x_t0++) {}
        for (o->x_t1 = o->x_t0; o->x_t1 < n_tiles && s->tile_row[o->x_t1] < o->x_r1; o->x_t1++) {}
        o->x_c0 = 0;
    }
    o->x_c1 = o->x_c0 + X - (o->x_c0 + sh) % X;               /* the chunk's end, by slot */
    if (o->x_c1 > o->x_keys) o->x_c1 = o->x_keys;
    return 1;
}

static void t_route(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const hparams *hp = &o->e->m->hp;
    int r = mb->groups[g].first + t, K = hp->top_k;
    route_token(hp, mb->s->router + (size_t)r * hp->n_routed, o->e->m->layers[o->layer].router_bias,
                mb->s->top_id + (size_t)r * K, mb->s->top_w + (size_t)r * K);
}

/* dense FFN / shared expert at the source: rows of a device group */
static void t_silu_group(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    const hparams *hp = &o->e->m->hp;
    const layer_w *L = &o->e->m->layers[o->layer];
    int w = L->is_moe ? L->shared.gate.rows : hp->inter, r = o->mb->groups[g].first + t;
    fwd_scratch *s = o->mb->s;
    o->e->k->silu_mul(s->ffa + (size_t)r * w, s->ffb + (size_t)r * w, w);
    if (op_q8(o)) quantize_row(o->e, s->ffa + (size_t)r * w, w, s->ffq + (size_t)r * w, &s->ffs[r]);
}

/* INT8 W8A8: the attention output, quantized per token for o_proj. */
static void t_quant_att(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    const hparams *hp = &o->e->m->hp;
    fwd_scratch *s = o->mb->s;
    int r = o->mb->groups[g].first + t, w = hp->n_heads * hp->v_head;
    quantize_row(o->e, s->att + (size_t)r * w, w, s->attq + (size_t)r * w, &s->atts[r]);
}

/* ---- the MoE: dispatch, experts, combine ---- */

/* Source side: write each token's message -- payload, per-token scale with
 * INT8 dispatch, routing metadata -- into the row its expert's device
 * reserved for it (the AIV-Direct write), and count the bytes written.  INT8
 * mode quantizes the token once at the source (into its own staging row; with
 * W8A8 the norm already did) and copies those bytes to every destination:
 * the early quantization of CloudMatrix's FusedDispatch.  A row for an expert
 * on the sending device itself is written too, but it is local memory, not
 * fabric traffic. */
/* One message: token r's row for its k-th destination, written into the
 * receiver's row `row` (metadata last: it says the row has arrived). */
static void dispatch_write(struct cm384_engine *e, fwd_scratch *s, int r, int k, int src, int row,
                           const float *xn, const int8_t *xq) {
    const hparams *hp = &e->m->hp;
    int D = hp->dim, K = hp->top_k;
    if (e->cfg.int8_dispatch) {
        memcpy(s->recv_q + (size_t)row * D, xq, (size_t)D);
        s->recv_s[row] = s->xns[r];
    } else {
        memcpy(s->recv_f + (size_t)row * D, xn, (size_t)D * sizeof(float));
    }
    s->recv_meta[row] = (msg_meta){r * (K + 1) + k, (int16_t)(k < K ? s->top_id[(size_t)r * K + k] : hp->n_routed),
                                   (int16_t)src};
}

static void t_dispatch(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    struct cm384_engine *e = o->e;
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    const hparams *hp = &e->m->hp;
    int D = hp->dim, K = hp->top_k, r = mb->groups[g].first + t, src = mb->groups[g].device;
    int n_dst = K + (e->place[mb->phase].n_shared > 0);
    const float *xn = s->xn + (size_t)r * D;
    const int *rows = s->row_of + (size_t)r * (K + 1), *dst = s->dst_dev + (size_t)r * (K + 1);
    const int8_t *xq = s->xnq + (size_t)r * D;
    int int8 = e->cfg.int8_dispatch;
    if (int8 && !op_q8(o)) quantize_row(e, xn, D, s->xnq + (size_t)r * D, &s->xns[r]);
    uint64_t remote = 0, local = 0, n_remote = 0;
    int down = atomic_load_explicit(&e->link_drop[mb->phase], memory_order_relaxed);   /* a link fault (12b) */
    for (int k = 0; k < n_dst; k++) {
        int row = rows[k];
        size_t bytes = (int8 ? (size_t)D + sizeof(float) : (size_t)D * sizeof(float)) + sizeof(msg_meta);
        if (dst[k] == src) local += bytes;
        else { fabric_count(e, PLANE_UB, src, dst[k], bytes); remote += bytes; n_remote++; }
        if (down >= 0 && dst[k] != src && (dst[k] == down || src == down)) continue;   /* sent, never arrives */
        dispatch_write(e, s, r, k, src, row, xn, xq);
    }
    if (remote) {
        atomic_fetch_add_explicit(&e->dispatch_bytes, remote, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->dispatch_bytes_bf16, n_remote * (2ull * D + sizeof(msg_meta)), memory_order_relaxed);
        atomic_fetch_add_explicit(&e->n_messages, n_remote, memory_order_relaxed);
    }
    if (local) atomic_fetch_add_explicit(&e->local_bytes, local, memory_order_relaxed);
}

/* Receivers: every row the layout reserved must have arrived (its metadata
 * written).  A row that did not -- a link dropped it (section 12b) -- is
 * asked for again and the sender writes it once more: counted as fabric
 * traffic again and as a retried message. */
static void moe_receive_check(op *o) {
    struct cm384_engine *e = o->e;
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    int K = e->m->hp.top_k, D = e->m->hp.dim, n_dst = K + (e->place[mb->phase].n_shared > 0);
    uint64_t retried = 0, bytes = 0;
    FOR_GROUPS(mb, g) {
        int src = mb->groups[g].device;
        for (int t = 0; t < mb->groups[g].n; t++) {
            int r = mb->groups[g].first + t;
            for (int k = 0; k < n_dst; k++) {
                int row = s->row_of[(size_t)r * (K + 1) + k], dst = s->dst_dev[(size_t)r * (K + 1) + k];
                if (s->recv_meta[row].slot >= 0) continue;
                size_t b = (e->cfg.int8_dispatch ? (size_t)D + sizeof(float) : (size_t)D * sizeof(float)) + sizeof(msg_meta);
                dispatch_write(e, s, r, k, src, row, s->xn + (size_t)r * D, s->xnq + (size_t)r * D);
                fabric_count(e, PLANE_UB, src, dst, b);
                retried++;
                bytes += b;
            }
        }
    }
    if (retried) {
        atomic_fetch_add_explicit(&e->dispatch_bytes, bytes, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->n_messages, retried, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->link_retried[mb->phase], retried, memory_order_relaxed);
    }
}

static int entry_expert(const placement *p, int entry, int E) {
    return entry < E * p->max_rep ? entry / p->max_rep : E;          /* E means the shared expert */
}

static const ffn_w *entry_weights(const layer_w *L, const layer_q8 *Q, const placement *p, int entry, int E) {
    int x = entry_expert(p, entry, E);
    if (Q) return x < E ? &Q->experts[x] : &Q->shared;
    return x < E ? &L->experts[x] : &L->shared;
}

/* The layout pass (DeepEP's "get layout"): which received row each
 * (token, expert) gets, and on which device.  Rows are grouped by (device,
 * expert) and, inside an expert, in token order.  Nothing is sent here: the
 * dispatch tasks write (and count) the messages. */
static void moe_layout(op *o) {
    struct cm384_engine *e = o->e;
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    const hparams *hp = &e->m->hp;
    const placement *pl = &e->place[mb->phase];
    int E = hp->n_routed, K = hp->top_k, l = o->layer, ne = pl->n_entries;
    int NLT = hp->n_layers + hp->n_mtp;
    const int *dev = pl_dev(pl, l), *nrep = pl_nrep(pl, l, E), *ord = pl_order(pl, l);
    int *count = s->entry_count, *first = s->entry_first;
    uint64_t *load = e->expert_load + (size_t)mb->phase * (e->m->hp.n_layers + e->m->hp.n_mtp) * E;
    uint64_t *rows = e->dev_rows + (size_t)mb->phase * e->n_dev;
    memset(count, 0, (size_t)ne * sizeof(int));
    if (e->dbg_route)
        for (int t = 0; t < mb->n; t++)
            memcpy(e->dbg_route + ((size_t)l * e->max_ctx + mb->pos[t]) * K, s->top_id + (size_t)t * K, (size_t)K * sizeof(int));
    for (int t = 0; t < mb->n; t++) {
        for (int k = 0; k < K; k++) {
            int x = s->top_id[(size_t)t * K + k];
            count[x * pl->max_rep + t % nrep[x]]++;
        }
        if (pl->n_shared) count[E * pl->max_rep + t % pl->n_shared]++;
    }
    int off = 0;
    for (int i = 0; i < ne && ord[i] >= 0; i++) { first[ord[i]] = off; off += count[ord[i]]; }
    memset(count, 0, (size_t)ne * sizeof(int));
    for (int t = 0; t < mb->n; t++) {
        for (int k = 0; k <= K; k++) {
            int en;
            if (k < K) {
                int x = s->top_id[(size_t)t * K + k];
                en = x * pl->max_rep + t % nrep[x];
                if (l < e->m->hp.n_layers + e->m->hp.n_mtp) load[(size_t)l * E + x]++;
            } else if (pl->n_shared) {
                en = E * pl->max_rep + t % pl->n_shared;
            } else {
                break;
            }
            int row = first[en] + count[en]++;
            s->row_of[(size_t)t * (K + 1) + k] = row;
            s->dst_dev[(size_t)t * (K + 1) + k] = dev[en];
            s->recv_meta[row].slot = -1;              /* not arrived: dispatch_write sets it */
        }
    }
    uint64_t *rows_of_layer = mb->phase == PHASE_DECODE && l < NLT ? e->dev_rows_layer + (size_t)l * e->n_dev : NULL;
    for (int i = 0; i < ne && ord[i] >= 0; i++) {
        rows[dev[ord[i]]] += (uint64_t)count[ord[i]];
        if (rows_of_layer) rows_of_layer[dev[ord[i]]] += (uint64_t)count[ord[i]];
    }
}

#define ROWS_PER_TASK 16

static int entry_tasks(const fwd_scratch *s, int en) {
    return (s->entry_count[en] + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
}

/* Receiver side: INT8 rows into float expert weights are dequantized; fp32
 * rows into INT8 (W8A8) expert weights are quantized -- the same per-token
 * quantization the sender would have done, so with W8A8 the INT8 dispatch
 * loses nothing. */
static void t_recv_prep(void *ctx, int en, int c, int worker) {
    (void)worker;
    op *o = ctx;
    fwd_scratch *s = o->mb->s;
    int D = o->e->m->hp.dim;
    int r0 = s->entry_first[en] + c * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
    if (r1 > s->entry_first[en] + s->entry_count[en]) r1 = s->entry_first[en] + s->entry_count[en];
    for (int r = r0; r < r1; r++) {
        int8_t *q = s->recv_q + (size_t)r * D;
        float *f = s->recv_f + (size_t)r * D;
        if (op_q8(o)) { quantize_row(o->e, f, D, q, &s->recv_s[r]); continue; }
        float sc = s->recv_s[r];
        for (int d = 0; d < D; d++) f[d] = (float)q[d] * sc;
    }
}

static int ex_width(const hparams *hp) {
    int sh = hp->moe_inter * hp->n_shared;
    return hp->moe_inter > sh ? hp->moe_inter : sh;
}

static void t_silu_entry(void *ctx, int en, int c, int worker) {
    (void)worker;
    op *o = ctx;
    fwd_scratch *s = o->mb->s;
    const hparams *hp = &o->e->m->hp;
    const placement *pl = &o->e->place[o->mb->phase];
    int w = entry_weights(&o->e->m->layers[o->layer], NULL, pl, en, hp->n_routed)->gate.rows;
    int r0 = s->entry_first[en] + c * ROWS_PER_TASK, n = ROWS_PER_TASK;
    if (r0 + n > s->entry_first[en] + s->entry_count[en]) n = s->entry_first[en] + s->entry_count[en] - r0;
    int W = ex_width(hp);
    for (int r = r0; r < r0 + n; r++) {
        o->e->k->silu_mul(s->ex_a + (size_t)r * W, s->ex_b + (size_t)r * W, w);
        if (op_q8(o)) quantize_row(o->e, s->ex_a + (size_t)r * W, w, s->exq + (size_t)r * W, &s->exs[r]);
    }
}

/* Expert side: write each output back into the combine slot its message
 * named, on the source device -- in BF16 when bf16_combine is on, as
 * CloudMatrix's FusedCombine does -- counting what crossed the fabric. */
static void t_combine(void *ctx, int en, int c, int worker) {
    (void)worker;
    op *o = ctx;
    struct cm384_engine *e = o->e;
    fwd_scratch *s = o->mb->s;
    int D = e->m->hp.dim, bf16 = e->bf16_combine;
    int dev = pl_dev(&e->place[o->mb->phase], o->layer)[en];
    int r0 = s->entry_first[en] + c * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
    if (r1 > s->entry_first[en] + s->entry_count[en]) r1 = s->entry_first[en] + s->entry_count[en];
    uint64_t remote = 0, local = 0, n_remote = 0;
    size_t bytes = (size_t)D * (bf16 ? sizeof(uint16_t) : sizeof(float));
    for (int r = r0; r < r1; r++) {
        const msg_meta *mt = &s->recv_meta[r];
        const float *out = s->ex_out + (size_t)r * D;
        if (bf16) {
            uint16_t *dst = s->comb16 + (size_t)mt->slot * D;
            for (int d = 0; d < D; d++) dst[d] = gl_f32_to_bf16(out[d]);
        } else {
            memcpy(s->comb + (size_t)mt->slot * D, out, bytes);
        }
        if (mt->src_dev == dev) { local += bytes; continue; }
        fabric_count(e, PLANE_UB, dev, mt->src_dev, bytes);
        remote += bytes;
        n_remote++;
    }
    if (remote) {
        atomic_fetch_add_explicit(&e->combine_bytes, remote, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->combine_bytes_bf16, n_remote * 2ull * D, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->n_messages, n_remote, memory_order_relaxed);
    }
    if (local) atomic_fetch_add_explicit(&e->local_bytes, local, memory_order_relaxed);
}

/* ---- the operations ---- */

static int attn_stage(op *o, region *rg) {
    microbatch *mb = o->mb;
    const hparams *hp = &o->e->m->hp;
    const layer_w *L = &o->e->m->layers[o->layer];
    fwd_scratch *s = mb->s;
    int D = hp->dim, H = hp->n_heads, qk = hp->qk_nope + hp->qk_rope, lat = hp->kv_lora + hp->qk_rope;
    const layer_q8 *Q = op_q8(o);
    rg->name = "attention"; rg->layer = o->layer; rg->mb = mb->index;
    for (;;) switch (o->stage++) {
    case 0:
        rg->op = "residual, norm";
        FOR_GROUPS(mb, g) region_add(rg, t_norm, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 1:                                   /* down-projections: q_a (or q) and kv_a */
        rg->op = "q_a, kv_a";
        mb->pending = PEND_NONE;
        o->n_jobs = 0;
        if (hp->q_lora) op_mm_rows(o, rg, Q ? &Q->wq_a : &L->wq_a, s->xn, s->xnq, s->xns, D, s->qa, hp->q_lora);
        else op_mm_rows(o, rg, Q ? &Q->wq : &L->wq, s->xn, s->xnq, s->xns, D, s->q, H * qk);
        op_mm_rows(o, rg, Q ? &Q->wkv_a : &L->wkv_a, s->xn, s->xnq, s->xns, D, s->kva, lat);
        return 1;
    case 2:
        rg->op = "kv write";
        FOR_GROUPS(mb, g) region_add(rg, t_kv_write, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 3:
        rg->op = "q_b";
        if (!hp->q_lora) continue;
        o->n_jobs = 0;
        op_mm_rows(o, rg, Q ? &Q->wq_b : &L->wq_b, s->qa, s->qaq, s->qas, hp->q_lora, s->q, H * qk);
        return 1;
    case 4:
        rg->op = "absorb W_uk";
        if (o->e->expanded && mb->phase == PHASE_PREFILL && L->w_uk && s->xk && hp->kv_lora >= hp->qk_nope) {   /* qlat holds the queries */
            o->stage = 20;
            continue;
        }
        op_heads(o, rg, t_absorb, 0);
        return 1;
    case 5:
        rg->op = "core";
        core_tiles(mb, CORE_TILE);
        {   /* enough tasks for every worker, about two each: when tiles are
               few, their lanes run as tasks of their own (each reads its part
               of the latent cache), then heads are split (each split reads
               its part again: 4 per worker cost a single stream ~7% of its
               decode speed at 512 tokens) */
            fwd_scratch *sc = mb->s;
            int tiles = sc->tile_first[mb->n_groups], want = 2 * o->e->n_workers, chunks = 1;
            for (int t = 0; t < tiles; t++) {
                int r = sc->tile_row[t] + sc->tile_n[t] - 1, c = (mb->pos[r] + mb->kv_shift) / sc->core_chunk - mb->kv_shift / sc->core_chunk + 1;
                if (c > chunks) chunks = c;
            }
            int lanes = chunks < CORE_LANES ? chunks : CORE_LANES;
            o->core_lanes = tiles < want && tiles <= CORE_SPLIT_TILES && lanes > 1 ? CORE_LANES : 1;
            int spread = tiles * (o->core_lanes > 1 ? lanes : 1);
            o->core_split = spread >= want ? 1 : (want + spread - 1) / spread;
            if (o->core_split > (H + 15) / 16) o->core_split = (H + 15) / 16;   /* >= 16 heads a task:
                                                    the scores kernel's vectors hold 16 */
        }
        FOR_GROUPS(mb, g)
            region_add(rg, t_core, o, g,
                       (mb->s->tile_first[g + 1] - mb->s->tile_first[g]) * o->core_lanes * o->core_split,
                       mb->groups[g].device);
        if (mb->phase == PHASE_DECODE) {   /* the roofline: per head and key a score and a weighted latent */
            uint64_t keys = 0;
            for (int r = 0; r < mb->n; r++) keys += (uint64_t)mb->pos[r] + 1;
            atomic_fetch_add_explicit(&o->e->roof_core_flops, keys * 2u * (uint64_t)H * (2u * (uint64_t)hp->kv_lora + (uint64_t)hp->qk_rope),
                                      memory_order_relaxed);
        }
        return 1;
    case 6:
        rg->op = "W_uv";
        op_heads(o, rg, t_uv, 1);
        return 1;
    case 7:
        rg->op = "quantize";
        if (!Q) continue;
        FOR_GROUPS(mb, g) region_add(rg, t_quant_att, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 8:
        rg->op = "o_proj";
        o->n_jobs = 0;
        op_mm_rows(o, rg, Q ? &Q->wo : &L->wo, s->att, s->attq, s->atts, H * hp->v_head, s->tmp, D);
        return 1;
    /* expanded prefill (instead of 4-6): see t_xattend */
    case 20:
        rg->op = "expanded: tiles";
        core_tiles(mb, XTILE);
        o->x_r0 = o->x_r1 = o->x_c1 = 0;
        FOR_GROUPS(mb, g) region_add(rg, t_xinit, o, g, s->tile_first[g + 1] - s->tile_first[g], mb->groups[g].device);
        return 1;
    case 21: {
        rg->op = "expanded: gather";
        if (!xchunk_next(o)) {
            o->stage = 24;
            continue;
        }
        int B = o->e->kv.block_tokens, sh = mb->kv_shift, dev = mb->groups[0].device;
        FOR_GROUPS(mb, g) if (mb->groups[g].first <= o->x_r0) dev = mb->groups[g].device;
        region_add(rg, t_xgather, o, 0, (o->x_c1 - 1 + sh) / B - (o->x_c0 + sh) / B + 1, dev);
        o->x_dev = dev;
        return 1;
    }
    case 22:
        rg->op = "expanded: expand";
        region_add(rg, t_xexpand, o, 0, H, o->x_dev);
        return 1;
    case 23:
        rg->op = "expanded: attend";
        FOR_GROUPS(mb, g) {
            int t0 = s->tile_first[g] > o->x_t0 ? s->tile_first[g] : o->x_t0;
            int t1 = s->tile_first[g + 1] < o->x_t1 ? s->tile_first[g + 1] : o->x_t1;
            if (t1 > t0) region_add(rg, t_xattend, o, g, (t1 - t0) * H, mb->groups[g].device);
        }
        o->stage = 21;
        return 1;
    case 24:
        rg->op = "expanded: normalize";
        FOR_GROUPS(mb, g) region_add(rg, t_xnorm, o, g, mb->groups[g].n, mb->groups[g].device);
        o->stage = 7;
        return 1;
    default:
        mb->pending = PEND_ADD_TMP;
        return 0;
    }
}

static int dense_stage(op *o, region *rg) {
    microbatch *mb = o->mb;
    const hparams *hp = &o->e->m->hp;
    const layer_w *L = &o->e->m->layers[o->layer];
    fwd_scratch *s = mb->s;
    int D = hp->dim, I = hp->inter;
    const layer_q8 *Q = op_q8(o);
    const ffn_w *F = Q ? &Q->dense : &L->dense;
    rg->name = "ffn"; rg->layer = o->layer; rg->mb = mb->index;
    switch (o->stage++) {
    case 0:
        rg->op = "residual, norm";
        FOR_GROUPS(mb, g) region_add(rg, t_norm, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 1:
        rg->op = "gate, up";
        mb->pending = PEND_NONE;
        o->n_jobs = 0;
        op_mm_rows(o, rg, &F->gate, s->xn, s->xnq, s->xns, D, s->ffa, I);
        op_mm_rows(o, rg, &F->up, s->xn, s->xnq, s->xns, D, s->ffb, I);
        return 1;
    case 2:
        rg->op = "SwiGLU";
        FOR_GROUPS(mb, g) region_add(rg, t_silu_group, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 3:
        rg->op = "down";
        o->n_jobs = 0;
        op_mm_rows(o, rg, &F->down, s->ffa, s->ffq, s->ffs, I, s->tmp, D);
        return 1;
    default:
        mb->pending = PEND_ADD_TMP;
        return 0;
    }
}

static int moe_stage(op *o, region *rg) {
    microbatch *mb = o->mb;
    struct cm384_engine *e = o->e;
    const hparams *hp = &e->m->hp;
    const layer_w *L = &e->m->layers[o->layer];
    const placement *pl = &e->place[mb->phase];
    fwd_scratch *s = mb->s;
    int D = hp->dim, E = hp->n_routed, K = hp->top_k, W = ex_width(hp);
    int at_source = L->shared.gate.data && pl->n_shared == 0, SI = L->shared.gate.rows;
    const int *dev = pl_dev(pl, o->layer), *ord = pl_order(pl, o->layer);
    const layer_q8 *Q = op_q8(o);
    const ffn_w *SH = Q ? &Q->shared : &L->shared;
    /* where decode sends the shared expert its tokens (the paper preset), a
       shared expert computed here must see the numbers a receiver would --
       the INT8 message dequantized, the output back in BF16 -- or a
       position's KV would depend on which phase computed it */
    int as_sent = at_source && e->place[PHASE_DECODE].n_shared > 0;
    int dq = as_sent && e->cfg.int8_dispatch && !Q;
    const float *sh_in = dq ? s->recv_f : s->xn;     /* recv_f is free until the dispatch */
    rg->name = "moe"; rg->layer = o->layer; rg->mb = mb->index;
    for (;;) switch (o->stage++) {
    case 0:
        rg->op = "residual, norm";
        FOR_GROUPS(mb, g) region_add(rg, dq ? t_norm_dq : t_norm, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 1:                                   /* router, and the shared expert at the source */
        rg->op = "router, shared gate, up";
        mb->pending = PEND_NONE;
        o->n_jobs = 0;
        op_mm_rows(o, rg, &L->router, s->xn, NULL, NULL, D, s->router, E);
        if (at_source) {
            op_mm_rows(o, rg, &SH->gate, sh_in, s->xnq, s->xns, D, s->ffa, SI);
            op_mm_rows(o, rg, &SH->up, sh_in, s->xnq, s->xns, D, s->ffb, SI);
        }
        return 1;
    case 2:
        rg->op = "route, shared SwiGLU";
        rg->name = "router";
        FOR_GROUPS(mb, g) region_add(rg, t_route, o, g, mb->groups[g].n, mb->groups[g].device);
        if (at_source) FOR_GROUPS(mb, g) region_add(rg, t_silu_group, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 3:                                   /* layout, then dispatch */
        rg->op = "dispatch, shared down";
        moe_layout(o);
        rg->name = "dispatch";
        FOR_GROUPS(mb, g) region_add(rg, t_dispatch, o, g, mb->groups[g].n, mb->groups[g].device);
        o->n_jobs = 0;
        if (at_source) op_mm_rows(o, rg, &SH->down, s->ffa, s->ffq, s->ffs, SI, s->comb + (size_t)K * D, (K + 1) * D);
        return 1;
    /* the experts' elementwise groups below are sized by the bytes a row
       moves: receive 4 + 1 (fp32 in, int8 out), SiLU 3 x 4 (gate, up, out),
       combine 2 x 4 (the output row, read and written) */
    case 4:              /* receivers check every row arrived, then convert rows to what their weights take */
        rg->op = "receive";
        moe_receive_check(o);
        if (!e->cfg.int8_dispatch == !Q) continue;
        rg->name = "experts";
        for (int i = 0; i < pl->n_entries && ord[i] >= 0; i++)
            region_add_sized(rg, t_recv_prep, o, ord[i], entry_tasks(s, ord[i]), dev[ord[i]],
                             (size_t)s->entry_count[ord[i]] * (size_t)D * 5);
        return 1;
    case 5:                                   /* each expert over all rows it received */
        rg->op = "gate, up";
        rg->name = "experts";
        o->n_jobs = 0;
        rg->many_products = 1;
        for (int i = 0; i < pl->n_entries && ord[i] >= 0; i++) {
            int en = ord[i], n = s->entry_count[en];
            size_t f = (size_t)s->entry_first[en];
            const ffn_w *fw = entry_weights(L, Q, pl, en, E);
            op_mmq(o, rg, &fw->gate, s->recv_f + f * D, s->recv_q + f * D, s->recv_s + f, D, s->ex_a + f * W, W, n, dev[en]);
            op_mmq(o, rg, &fw->up, s->recv_f + f * D, s->recv_q + f * D, s->recv_s + f, D, s->ex_b + f * W, W, n, dev[en]);
        }
        rg->many_products = 0;
        return 1;
    case 6:
        rg->op = "SwiGLU";
        rg->name = "experts";
        for (int i = 0; i < pl->n_entries && ord[i] >= 0; i++)
            region_add_sized(rg, t_silu_entry, o, ord[i], entry_tasks(s, ord[i]), dev[ord[i]],
                             (size_t)s->entry_count[ord[i]] * (size_t)W * 12);
        return 1;
    case 7:
        rg->op = "down";
        rg->name = "experts";
        o->n_jobs = 0;
        rg->many_products = 1;
        for (int i = 0; i < pl->n_entries && ord[i] >= 0; i++) {
            int en = ord[i], n = s->entry_count[en];
            size_t f = (size_t)s->entry_first[en];
            const ffn_w *fw = entry_weights(L, Q, pl, en, E);
            op_mmq(o, rg, &fw->down, s->ex_a + f * W, s->exq + f * W, s->exs + f, W, s->ex_out + f * D, D, n, dev[en]);
        }
        rg->many_products = 0;
        return 1;
    case 8:
        rg->op = "combine";
        rg->name = "combine";
        for (int i = 0; i < pl->n_entries && ord[i] >= 0; i++)
            region_add_sized(rg, t_combine, o, ord[i], entry_tasks(s, ord[i]), dev[ord[i]],
                             (size_t)s->entry_count[ord[i]] * (size_t)D * 8);
        return 1;
    default:
        mb->pending = PEND_COMBINE;
        mb->pending_layer = o->layer;
        return 0;
    }
}

static void t_mtp_in(void *ctx, int g, int t, int worker) {
    (void)worker;
    op *o = ctx;
    microbatch *mb = o->mb;
    const cm384_model *m = o->e->m;
    const layer_w *L = &m->layers[o->layer];
    int D = m->hp.dim, r = mb->groups[g].first + t;
    float *row = mb->s->ffa + (size_t)r * 2 * D;
    gl_row_to_f32(&L->embed, mb->tok[r], row);
    rope_angles(m, mb->pos[r], mb->s->rope_cs + (size_t)r * m->hp.qk_rope);
    rmsnorm(o->e->k, row, row, L->enorm, D, m->hp.eps);
    rmsnorm(o->e->k, row + D, o->h_in + (size_t)r * D, L->hnorm, D, m->hp.eps);
    if (op_q8(o)) quantize_row(o->e, row, 2 * D, mb->s->ffq + (size_t)r * 2 * D, &mb->s->ffs[r]);
}

/* MTP input: x'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]) (embedding
 * half first, as the released weights expect). */
static int mtp_in_stage(op *o, region *rg) {
    microbatch *mb = o->mb;
    const cm384_model *m = o->e->m;
    int D = m->hp.dim;
    rg->name = "mtp"; rg->layer = o->layer; rg->mb = mb->index;
    switch (o->stage++) {
    case 0:
        rg->op = "norms";
        FOR_GROUPS(mb, g) region_add(rg, t_mtp_in, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    case 1:
        rg->op = "eh_proj";
        mb->pending = PEND_NONE;
        o->n_jobs = 0;
        {
            const layer_q8 *Q = op_q8(o);
            op_mm_rows(o, rg, Q ? &Q->eh_proj : &m->layers[o->layer].eh_proj, mb->s->ffa, mb->s->ffq, mb->s->ffs, 2 * D,
                       mb->s->x, D);
        }
        return 1;
    default:
        return 0;
    }
}

/* Final norm (into xn, and packed into hsel for rows that want logits),
 * then the head over those rows. */
static int head_stage(op *o, region *rg) {
    microbatch *mb = o->mb;
    fwd_scratch *s = mb->s;
    int D = o->e->m->hp.dim, V = o->head->rows;
    rg->name = "head"; rg->layer = o->layer; rg->mb = mb->index;
    switch (o->stage++) {
    case 0: {
        rg->op = "residual, norm";
        int cnt = 0;
        FOR_GROUPS(mb, g) {
            s->sel_first[g] = cnt;
            for (int t = mb->groups[g].first; t < mb->groups[g].first + mb->groups[g].n; t++)
                s->sel[t] = !mb->want || mb->want[t] ? cnt++ : -1;
            s->sel_n[g] = cnt - s->sel_first[g];
        }
        FOR_GROUPS(mb, g) region_add(rg, t_norm, o, g, mb->groups[g].n, mb->groups[g].device);
        return 1;
    }
    case 1:
        rg->op = "logits";
        mb->pending = PEND_NONE;
        o->n_jobs = 0;
        if (mb->logits && o->e->fuse_groups && mb->n_groups > 1) {   /* the head streamed once, see op_mm_rows */
            int first = region_groups(rg);
            op_mmq(o, rg, o->head, s->hsel, s->hselq, s->hsels, D, mb->logits, V, s->sel_first[mb->n_groups - 1] +
                   s->sel_n[mb->n_groups - 1], mb->groups[0].device);
            fused_charge(rg, first, mb);
        } else if (mb->logits) FOR_GROUPS(mb, g)
            op_mmq(o, rg, o->head, s->hsel + (size_t)s->sel_first[g] * D, s->hselq + (size_t)s->sel_first[g] * D,
                   s->hsels + s->sel_first[g], D, mb->logits + (size_t)s->sel_first[g] * V, V,
                   s->sel_n[g], mb->groups[g].device);
        return 1;
    default:
        return 0;
    }
}

static int op_stage(op *o, region *rg) {
    switch (o->kind) {
    case OP_ATTN:   return attn_stage(o, rg);
    case OP_FFN:    return o->e->m->layers[o->layer].is_moe ? moe_stage(o, rg) : dense_stage(o, rg);
    case OP_HEAD:   return head_stage(o, rg);
    case OP_MTP_IN: return mtp_in_stage(o, rg);
    }
    return 0;
}

static void op_init(op *o, struct cm384_engine *e, microbatch *mb, int kind, int layer) {
    memset(o, 0, sizeof *o);
    o->e = e; o->mb = mb; o->kind = kind; o->layer = layer;
    if (kind == OP_HEAD) {              /* layer -1: the main head; else an MTP layer's head */
        const cm384_model *m = e->m;
        o->head = layer < m->hp.n_layers ? &m->head : &m->layers[layer].head;
        if (e->cfg.int8) o->head = layer < m->hp.n_layers ? &m->q8_head : &m->q8[layer].head;
        o->head_norm = layer < m->hp.n_layers ? m->final_norm : m->layers[layer].head_norm;
    }
}

/* Runs two operations (b may be NULL) stage by stage, sharing each region. */
static void run_ops(region *rg, op *a, op *b) {
    int more_a = a != NULL, more_b = b != NULL;
    if (a) a->rg = rg;
    if (b) b->rg = rg;
    while (more_a || more_b) {
        if (more_a) more_a = op_stage(a, rg);
        if (more_b) more_b = op_stage(b, rg);
        region_run(rg);
    }
}

/* ======================================================================== */
/* 8. Context cache (the EMS role)                                          */
/* ======================================================================== */
/* Full KV blocks are indexed by a hash chain over their tokens: a block's
 * key hashes its tenant, its parent's key and its B tokens, so a key names a
 * whole prefix.  A request looks up its prompt block by block and reuses the
 * longest cached prefix (never its last token, which must be computed to give
 * logits).  Blocks are reference-counted: requests hold them while they run,
 * the cache holds one reference for each indexed block.  Indexed blocks that
 * only the cache holds are evictable, least recently used first, and the
 * cache keeps at most cache_blocks_max of them.  The key includes the tenant
 * and a hit is verified token by token, so tenants never share an entry. */

static uint64_t mix64(uint64_t x) {                       /* splitmix64 finalizer */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t block_key(uint64_t parent, uint32_t tenant, const int32_t *tok, int n) {
    uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ull) ^ mix64((uint64_t)tenant + 0x632be59bd9b4e019ull);
    for (int i = 0; i < n; i++) h = mix64(h ^ (uint64_t)(uint32_t)tok[i]) + (uint64_t)i;
    return h | 1;                                          /* 0 means "no parent" */
}

static void lru_unlink(struct cm384_engine *e, int b) {
    block_meta *m = &e->bm[b];
    if (m->lru_prev >= 0) e->bm[m->lru_prev].lru_next = m->lru_next; else if (e->lru_head == b) e->lru_head = m->lru_next;
    if (m->lru_next >= 0) e->bm[m->lru_next].lru_prev = m->lru_prev; else if (e->lru_tail == b) e->lru_tail = m->lru_prev;
    m->lru_prev = m->lru_next = -1;
}

static void lru_push(struct cm384_engine *e, int b) {
    block_meta *m = &e->bm[b];
    m->lru_prev = e->lru_tail;
    m->lru_next = -1;
    if (e->lru_tail >= 0) e->bm[e->lru_tail].lru_next = b; else e->lru_head = b;
    e->lru_tail = b;
}

static int index_slot(const struct cm384_engine *e, uint64_t key) { return (int)(key & (uint64_t)(e->index_cap - 1)); }

/* Removes block b from the cache index (linear probing with backward shift). */
static void index_remove(struct cm384_engine *e, int b) {
    int i = index_slot(e, e->bm[b].hash);
    while (e->index[i] != b) i = (i + 1) & (e->index_cap - 1);
    e->index[i] = -1;
    for (int j = (i + 1) & (e->index_cap - 1); e->index[j] >= 0; j = (j + 1) & (e->index_cap - 1)) {
        int k = index_slot(e, e->bm[e->index[j]].hash);
        /* move j back into the hole if its home slot is not in (i, j] */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            e->index[i] = e->index[j];
            e->index[j] = -1;
            i = j;
        }
    }
}

static void cache_evict(struct cm384_engine *e, int b) {
    e->n_evictions++;
    lru_unlink(e, b);
    index_remove(e, b);
    e->bm[b].cached = 0;
    e->bm[b].ref = 0;
    e->n_cached--;
    e->free_blocks[e->n_free++] = b;
}

/* A free block, evicting the least recently used cached one if needed;
 * -1 if every block is in use. */
static int block_get(struct cm384_engine *e) {
    if (!e->n_free && e->lru_head >= 0) cache_evict(e, e->lru_head);
    if (!e->n_free) return -1;
    int b = e->free_blocks[--e->n_free];
    e->bm[b].ref = 1;
    return b;
}

static int blocks_available(const struct cm384_engine *e) {
    int n = e->n_free;
    for (int b = e->lru_head; b >= 0; b = e->bm[b].lru_next) n++;
    return n;
}

static void block_unref(struct cm384_engine *e, int b) {
    block_meta *m = &e->bm[b];
    if (--m->ref == 0) e->free_blocks[e->n_free++] = b;
    else if (m->cached && m->ref == 1) lru_push(e, b);
}

static int cache_find(const struct cm384_engine *e, uint64_t key, uint64_t parent, uint32_t tenant, const int32_t *tok) {
    if (!e->index_cap) return -1;
    for (int i = index_slot(e, key); e->index[i] >= 0; i = (i + 1) & (e->index_cap - 1)) {
        const block_meta *m = &e->bm[e->index[i]];
        if (m->hash == key && m->parent == parent && m->tenant == tenant &&
            !memcmp(m->tokens, tok, (size_t)e->kv.block_tokens * sizeof(int32_t)))
            return e->index[i];
    }
    return -1;
}

/* Offers block b (full, holding tok) to the cache; the cache takes its own
 * reference.  Returns 1 if indexed. */
static int cache_insert(struct cm384_engine *e, int b, uint64_t key, uint64_t parent, uint32_t tenant, const int32_t *tok) {
    if (e->cache_blocks_max <= 0 || e->bm[b].cached) return 0;
    if (cache_find(e, key, parent, tenant, tok) >= 0) return 0;          /* someone else's copy */
    while (e->n_cached >= e->cache_blocks_max && e->lru_head >= 0) cache_evict(e, e->lru_head);
    if (e->n_cached >= e->cache_blocks_max) return 0;
    block_meta *m = &e->bm[b];
    m->hash = key; m->parent = parent; m->tenant = tenant; m->cached = 1; m->ref++;
    memcpy(m->tokens, tok, (size_t)e->kv.block_tokens * sizeof(int32_t));
    int i = index_slot(e, key);
    while (e->index[i] >= 0) i = (i + 1) & (e->index_cap - 1);
    e->index[i] = b;
    e->n_cached++;
    return 1;
}

/* ---- the disk tier: a file per block in cache_dir ---- */
/* With cache_dir set, every block the cache indexes is also written, by the
 * caching loop, to a file named by its key in a folder named by the
 * fingerprint of the model and of every switch that changes KV values (so
 * another model's blocks, or INT8 blocks for an exact engine, never match).
 * A later engine, or a restarted process, finds the prefix there when the
 * pool has lost it.  A file is trusted only if every field agrees with what
 * the request expects -- magic, version, fingerprint, key, parent key,
 * tenant, shapes, size, a checksum over the payload, and then the tokens
 * themselves; anything else is ignored with a log line. */

#define KVF_MAGIC   "CM384KV1"
#define KVF_VERSION 1u

typedef struct kvf_header {          /* little-endian, as written by this host   */
    char     magic[8];
    uint32_t version, block_tokens, n_layers, row, h_dim, tenant;
    uint64_t fingerprint, key, parent, payload_bytes, checksum;
} kvf_header;                        /* then: int32 tokens[B], float kv[layers][B][row], float h[h_dim] */

typedef struct kvf_expect {
    uint64_t fingerprint, key, parent;
    uint32_t tenant, block_tokens, n_layers, row, h_dim;
    uint32_t value_bytes;                  /* of a KV value: 4 (fp32) or 2 (bf16) */
} kvf_expect;

/* The checksum of the cache's files, over 8-byte words; a file can be
 * summed in pieces whose lengths are multiples of 8 (csum_add), then
 * finished with its total length. */
static uint64_t csum_add(uint64_t h, const uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h = (h ^ v) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

#define CSUM_START 0x243f6a8885a308d3ull

static uint64_t kvf_checksum(const uint8_t *p, size_t n) {
    return mix64(csum_add(CSUM_START, p, n) ^ (uint64_t)n);
}

static size_t kvf_payload_bytes(const kvf_expect *x) {
    return (size_t)x->block_tokens * sizeof(int32_t) + (size_t)x->n_layers * x->block_tokens * x->row * x->value_bytes +
           (size_t)x->h_dim * sizeof(float);
}

/* Checks that buf[0..n) is the file of the block x describes.  Returns NULL
 * and the payload's offset, or what is wrong.  Reads nothing outside buf. */
static const char *kvf_parse(const uint8_t *buf, size_t n, const kvf_expect *x, size_t *payload_at) {
    kvf_header h;
    if (n < sizeof h) return "shorter than its header";
    memcpy(&h, buf, sizeof h);
    if (memcmp(h.magic, KVF_MAGIC, 8)) return "not a cm384 KV block file";
    if (h.version != KVF_VERSION) return "another format version";
    if (h.fingerprint != x->fingerprint) return "made by another model or other numerics";
    if (h.block_tokens != x->block_tokens || h.n_layers != x->n_layers || h.row != x->row || h.h_dim != x->h_dim)
        return "block shape differs";
    if (h.key != x->key || h.parent != x->parent || h.tenant != x->tenant) return "holds another prefix";
    size_t want = kvf_payload_bytes(x);
    if (h.payload_bytes != (uint64_t)want) return "payload size field is wrong";
    if (n - sizeof h != want) return n - sizeof h < want ? "truncated" : "longer than its payload";
    if (kvf_checksum(buf + sizeof h, want) != h.checksum) return "checksum mismatch (damaged)";
    *payload_at = sizeof h;
    return NULL;
}

/* The model's fingerprint: shapes, RoPE, and every tensor's name, type,
 * shape and a few samples of its bytes (start, middle, end) -- enough to
 * tell two checkpoints apart without reading all their weights. */
static uint64_t model_fingerprint(const cm384_model *m) {
    const hparams *hp = &m->hp;
    uint64_t h = mix64(0x6d6f64656c667072ull);
    int v[] = {hp->vocab, hp->dim, hp->n_layers, hp->n_mtp, hp->n_heads, hp->q_lora, hp->kv_lora, hp->qk_nope,
               hp->qk_rope, hp->v_head, hp->n_routed, hp->top_k, hp->inter, hp->moe_inter};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) h = mix64(h ^ (uint64_t)(uint32_t)v[i]);
    for (int i = 0; i < hp->qk_rope / 2; i++) { uint32_t b; memcpy(&b, &m->rope_freq[i], 4); h = mix64(h ^ b); }
    uint32_t sb[2];
    memcpy(&sb[0], &m->attn_scale, 4); memcpy(&sb[1], &m->rope_mscale, 4);
    h = mix64(h ^ sb[0] ^ ((uint64_t)sb[1] << 32));
    uint64_t sum = 0;                                   /* order-free over the tensors */
    for (int i = 0; i < m->tensors.cap; i++) {
        const tensor_info *t = &m->tensors.items[i];
        if (!t->name) continue;
        uint64_t th = hash_str(t->name, strlen(t->name)) ^ mix64((uint64_t)(t->dtype + 7) * 0x9e37u + (uint64_t)t->nbytes);
        for (int d = 0; d < t->ndim && d < 4; d++) th = mix64(th ^ (uint64_t)t->shape[d]);
        size_t at[3] = {0, t->nbytes / 2, t->nbytes > 32 ? t->nbytes - 32 : 0};
        for (int k = 0; k < 3 && t->data; k++) {
            size_t len = t->nbytes - at[k] < 32 ? t->nbytes - at[k] : 32;
            if (at[k] < t->nbytes) th = mix64(th ^ hash_str((const char *)t->data + at[k], len));
        }
        sum += mix64(th);
    }
    return mix64(h ^ sum);
}


static int key_set_has(const key_set *s, uint64_t key) {
    if (!s->cap) return 0;
    for (int i = (int)(key & (uint64_t)(s->cap - 1)); s->k[i]; i = (i + 1) & (s->cap - 1))
        if (s->k[i] == key) return 1;
    return 0;
}

static void key_set_add(key_set *s, uint64_t key) {
    if (!key || key_set_has(s, key)) return;
    if (2 * (s->n + 1) > s->cap) {                      /* grow: rehash into twice the room */
        int cap = s->cap ? 2 * s->cap : 1024;
        uint64_t *k = CM384_CALLOC((size_t)cap, sizeof *k);
        if (!k) return;                                 /* a key not remembered is a miss, no more */
        for (int i = 0; i < s->cap; i++)
            if (s->k[i]) {
                int j = (int)(s->k[i] & (uint64_t)(cap - 1));
                while (k[j]) j = (j + 1) & (cap - 1);
                k[j] = s->k[i];
            }
        CM384_FREE(s->k);
        s->k = k;
        s->cap = cap;
    }
    int i = (int)(key & (uint64_t)(s->cap - 1));
    while (s->k[i]) i = (i + 1) & (s->cap - 1);
    s->k[i] = key;
    s->n++;
}

static void key_set_del(key_set *s, uint64_t key) {       /* rebuilds the run after the hole */
    if (!s->cap) return;
    int i = (int)(key & (uint64_t)(s->cap - 1));
    while (s->k[i] && s->k[i] != key) i = (i + 1) & (s->cap - 1);
    if (!s->k[i]) return;
    s->k[i] = 0;
    s->n--;
    for (int j = (i + 1) & (s->cap - 1); s->k[j]; j = (j + 1) & (s->cap - 1)) {
        uint64_t v = s->k[j];
        s->k[j] = 0;
        s->n--;
        key_set_add(s, v);
    }
}

/* ======================================================================== */
/* 9. Building the supernode: roles and expert placement                    */
/* ======================================================================== */

static int pl_alloc(placement *p, int layers, int E, int max_rep, int n_shared) {
    p->max_rep = max_rep;
    p->n_shared = n_shared;
    p->n_entries = E * max_rep + n_shared;
    if (p->n_entries < 1) p->n_entries = 1;
    p->dev = CM384_MALLOC((size_t)layers * p->n_entries * sizeof(int));
    p->order = CM384_MALLOC((size_t)layers * p->n_entries * sizeof(int));
    p->n_rep = CM384_MALLOC((size_t)layers * (E > 0 ? E : 1) * sizeof(int));
    if (!p->dev || !p->order || !p->n_rep) return fail(CM384_E_NOMEM, "out of memory for expert placement");
    for (size_t i = 0; i < (size_t)layers * p->n_entries; i++) p->dev[i] = -1;
    for (size_t i = 0; i < (size_t)layers * (E > 0 ? E : 1); i++) p->n_rep[i] = 1;
    return CM384_OK;
}

static void pl_free(placement *p) {
    CM384_FREE(p->dev); CM384_FREE(p->order); CM384_FREE(p->n_rep);
    memset(p, 0, sizeof *p);
}

/* ---- EPLB: replicas for the hottest experts, packed to even the devices ---- */
/* DeepSeek's expert-parallel load balancer, global policy, one layer at a
 * time.  Decode's routed experts live on n_exp_devs devices of exp_cap slots
 * each (the redundant devices included), so there are more slots than
 * experts.  From the decode load measured since the last re-placement:
 *   1. replicate: every expert has one replica; each spare slot goes to the
 *      expert with the highest load per replica (a token picks a replica by
 *      its row, so replicas share an expert's load evenly);
 *   2. pack: replicas, heaviest first, go to the least-loaded device that has
 *      a free slot (and, when it can, holds no replica of that expert yet).
 * Prefill has its own placement and its own load, never mixed in.  Ties
 * always go to the lowest index, so a load gives one placement.  Moving a
 * replica costs nothing here (every device reads the same weights in the
 * pool, the paper's model cache), but the bytes a real supernode would copy
 * are counted. */

typedef struct eplb_item { double load; int expert, replica; } eplb_item;

static int eplb_item_cmp(const void *a, const void *b) {
    const eplb_item *x = a, *y = b;
    if (x->load != y->load) return x->load > y->load ? -1 : 1;
    if (x->expert != y->expert) return x->expert - y->expert;
    return x->replica - y->replica;
}

/* One layer: load[E] in, n_rep[E] and dev[E*max_rep] out (entry x*max_rep+r
 * is replica r of expert x, -1 where unused); dev_load[n_devs] gets each
 * device's share of the load.  items and slots_used are scratch of
 * n_devs*cap and n_devs entries. */
static void eplb_layer(const double *load, int E, const int *devs, int n_devs, int cap, int max_rep,
                       int *n_rep, int *dev, double *dev_load, eplb_item *items, int *slots_used) {
    int S = n_devs * cap;
    for (int x = 0; x < E; x++) n_rep[x] = 1;
    for (int k = E; k < S; k++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (n_rep[x] < max_rep && (best < 0 || load[x] * n_rep[best] > load[best] * n_rep[x])) best = x;
        if (best < 0) break;
        n_rep[best]++;
    }
    int n = 0;
    for (int x = 0; x < E; x++)
        for (int r = 0; r < n_rep[x]; r++) items[n++] = (eplb_item){load[x] / n_rep[x], x, r};
    qsort(items, (size_t)n, sizeof *items, eplb_item_cmp);
    for (int d = 0; d < n_devs; d++) { dev_load[d] = 0; slots_used[d] = 0; }
    for (int i = 0; i < E * max_rep; i++) dev[i] = -1;
    for (int i = 0; i < n; i++) {
        int x = items[i].expert, best = -1, best_dup = 1;
        for (int d = 0; d < n_devs; d++) {
            if (slots_used[d] >= cap) continue;
            int dup = 0;                                   /* already holds a replica of x? */
            for (int r = 0; r < items[i].replica && !dup; r++) dup = dev[x * max_rep + r] == devs[d];
            if (best < 0 || dup < best_dup || (dup == best_dup && dev_load[d] < dev_load[best])) { best = d; best_dup = dup; }
        }
        dev[x * max_rep + items[i].replica] = devs[best];
        dev_load[best] += items[i].load;
        slots_used[best]++;
    }
}

/* Re-places decode's routed experts, every layer, from load[NL][E] (decode
 * tokens per expert since the last time).  A layer's experts run as one
 * dispatch that waits for its busiest device, so imbalance is measured per
 * layer: sum over layers of the busiest device's load over the sum of the
 * mean loads (1 = perfectly even).  A layer keeps its placement unless the
 * new one lowers its busiest device (no weights move for nothing). */
static int eplb_rebalance(struct cm384_engine *e, const uint64_t *load_since) {
    const hparams *hp = &e->m->hp;
    placement *p = &e->place[PHASE_DECODE];
    int E = hp->n_routed, NL = hp->n_layers + hp->n_mtp, ND = e->n_exp_devs, mr = p->max_rep;
    if (E <= 0 || ND <= 0) return CM384_OK;
    /* scratch made once with the topology: no allocation on the decode path */
    double *ld = e->eplb_ld, *before = ld + E, *per_dev = before + ND;
    eplb_item *items = e->eplb_items;
    int *used = e->eplb_used, *old = e->eplb_old, *old_rep = old + (size_t)E * mr, *slot = old_rep + E;
    for (int d = 0; d < e->n_dev; d++) slot[d] = -1;
    for (int d = 0; d < ND; d++) slot[e->exp_devs[d]] = d;
    uint64_t moved = 0;
    double sum_max_before = 0, sum_max_after = 0, sum_mean = 0;
    for (int l = 0; l < NL; l++) {
        if (!e->m->layers[l].is_moe) continue;
        int *dev = pl_dev(p, l), *nrep = pl_nrep(p, l, E), placed = 1;
        const gl_mat *g = e->m->layers[l].experts ? &e->m->layers[l].experts[0].gate : NULL;   /* NULL: shapes only */
        uint64_t expert_bytes = g ? 3ull * g->rows * g->cols * gl_type_size(g->type) : 0;
        double total = 0, mx_before = 0, mx_after = 0;
        for (int x = 0; x < E; x++) { ld[x] = (double)load_since[(size_t)l * E + x]; total += ld[x]; }
        for (int d = 0; d < ND; d++) before[d] = 0;
        for (int x = 0; x < E; x++)            /* the old placement: each replica carries load / replicas */
            for (int q = 0; q < nrep[x]; q++) {
                if (dev[x * mr + q] < 0 || slot[dev[x * mr + q]] < 0) { placed = 0; continue; }   /* (a dead device: 12b) */
                before[slot[dev[x * mr + q]]] += ld[x] / nrep[x];
            }
        for (int d = 0; d < ND; d++) if (before[d] > mx_before) mx_before = before[d];
        memcpy(old, dev, (size_t)E * mr * sizeof(int));
        memcpy(old_rep, nrep, (size_t)E * sizeof(int));
        eplb_layer(ld, E, e->exp_devs, ND, e->exp_cap, mr, nrep, dev, per_dev, items, used);
        for (int d = 0; d < ND; d++) if (per_dev[d] > mx_after) mx_after = per_dev[d];
        if (placed && !(mx_after < mx_before)) {           /* no better: keep the old placement */
            memcpy(dev, old, (size_t)E * mr * sizeof(int));
            memcpy(nrep, old_rep, (size_t)E * sizeof(int));
            mx_after = mx_before;
        } else {
            for (int x = 0; x < E; x++)        /* a replica on a device that held none of x: weights copied */
                for (int q = 0; q < nrep[x]; q++) {
                    int had = 0;
                    for (int o = 0; o < old_rep[x] && !had; o++) had = old[x * mr + o] == dev[x * mr + q];
                    if (!had) moved += expert_bytes;
                }
        }
        sum_max_before += mx_before;
        sum_max_after += mx_after;
        sum_mean += total / ND;
        pl_sort(p, l);
    }
    e->eplb_before = sum_mean > 0 ? sum_max_before / sum_mean : 0;
    e->eplb_after = sum_mean > 0 ? sum_max_after / sum_mean : 0;
    e->eplb_moved_bytes += moved;
    e->eplb_runs++;
    return CM384_OK;
}

/* ---- INT8 W8A8 weights: made once per model, shared by its engines ---- */

typedef struct q8_job { const gl_mat *src; gl_mat *dst; int first; } q8_job;
typedef struct q8_ctx { q8_job *jobs; int n, base; float *rows; size_t row_cap; } q8_ctx;

#define Q8_ROWS 64

static void t_quantize_weight(void *ctx, int task, int worker) {
    q8_ctx *q = ctx;
    int t = q->base + task;
    int lo = 0, hi = q->n - 1;
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (q->jobs[mid].first <= t) lo = mid; else hi = mid - 1; }
    const q8_job *j = &q->jobs[lo];
    int r0 = (t - j->first) * Q8_ROWS, r1 = r0 + Q8_ROWS;
    if (r1 > j->src->rows) r1 = j->src->rows;
    gl_quantize_weight_q8(j->src, (int8_t *)j->dst->data, (float *)j->dst->scale, r0, r1, q->rows + (size_t)worker * q->row_cap);
}

/* ---- the model cache: INT8 weights kept in cache_dir ---- */
/* The INT8 copies take a full pass over the weights to make (about a minute
 * for V2-Lite's 31 GB of BF16).  With cache_dir set they are written once to
 * <cache_dir>/<model fingerprint>.q8 and mapped by later loads of the same
 * model -- or, with use_mmap = 0, read into memory advised for 2 MB pages,
 * as the copies made at load are: decode streams them every token, 4 KB
 * pages of the page cache cost it a TLB miss each (V2-Lite-4 INT8 decode
 * 76.7 -> 82.6 tok/s, 6 alternating runs), and the read costs the load a
 * first touch of every page (here 0.5 -> 3.1-4.0 s for 2 GB).  The file is
 * trusted only if its header, every matrix's shape and a checksum over all
 * of its bytes agree; otherwise it is remade. */

#define Q8F_MAGIC "CM384Q8\1"
#define Q8F_VERSION 3                 /* 3: a layer's per-head products grouped by kind;
                                         2: GL_Q8's 16-row panels (1: row-major) */

typedef struct q8f_header {
    char     magic[8];
    uint32_t version, n_mats;
    uint64_t fingerprint, data_bytes, checksum;
} q8f_header;                         /* then n_mats x {rows, cols}, then the matrices, each 64-aligned */

static size_t q8f_mat_bytes(const gl_mat *w) {
    size_t q = (gl_q8_bytes(w->rows, w->cols) + 63) & ~(size_t)63, sc = ((size_t)w->rows * sizeof(float) + 63) & ~(size_t)63;
    return q + sc;
}

static size_t q8f_data_at(int n_mats) {
    return (sizeof(q8f_header) + (size_t)n_mats * 8 + 63) & ~(size_t)63;
}

/* Maps or reads the file if it holds exactly these matrices; points them into it. */
static int q8f_read(cm384_model *m, const char *path, q8_job *jobs, int n, uint64_t fp, const char **why) {
    file_map f;
    *why = "cannot be opened";
    if (access(path, R_OK) || file_map_open(&f, path, m->use_mmap)) return 0;
    size_t at = q8f_data_at(n), data = 0;
    for (int i = 0; i < n; i++) data += q8f_mat_bytes(jobs[i].dst);
    q8f_header h;
    int ok = 0;
    if (f.size < at || f.size != at + data) *why = "size differs from these weights'";
    else {
        memcpy(&h, f.data, sizeof h);
        if (memcmp(h.magic, Q8F_MAGIC, 8)) *why = "not a cm384 INT8 weight file";
        else if (h.version != Q8F_VERSION) *why = "made by another version (weight layout)";
        else if (h.fingerprint != fp || h.n_mats != (uint32_t)n || h.data_bytes != data) *why = "made for another model";
        else {
            ok = 1;
            for (int i = 0; i < n && ok; i++) {
                uint32_t rc[2];
                memcpy(rc, (const uint8_t *)f.data + sizeof h + (size_t)i * 8, 8);
                ok = rc[0] == (uint32_t)jobs[i].dst->rows && rc[1] == (uint32_t)jobs[i].dst->cols;
            }
            if (!ok) *why = "matrix shapes differ";
            else if (kvf_checksum((const uint8_t *)f.data + at, data) != h.checksum) { ok = 0; *why = "checksum mismatch (damaged)"; }
        }
    }
    if (!ok) { file_map_close(&f); return 0; }
    const uint8_t *p = (const uint8_t *)f.data + at;
    for (int i = 0; i < n; i++) {
        gl_mat *w = jobs[i].dst;
        w->data = (void *)p;
        w->scale = (float *)(p + ((gl_q8_bytes(w->rows, w->cols) + 63) & ~(size_t)63));
        p += q8f_mat_bytes(w);
    }
    m->q8_file = f;
    return 1;
}

/* Writes the matrices straight from memory, summing them as they go, then
 * the header with the sum (a temporary name, renamed when whole). */
static int q8f_save(const char *path, q8_job *jobs, int n, uint64_t fp) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return 0;
    size_t at = q8f_data_at(n), data = 0;
    static const uint8_t zeros[64];
    uint8_t *head = CM384_CALLOC(1, at);
    int ok = head && fwrite(head, 1, at, f) == at;          /* the header's place, for now */
    uint64_t h = CSUM_START;
    for (int i = 0; ok && i < n; i++) {
        const gl_mat *w = jobs[i].dst;
        size_t q = gl_q8_bytes(w->rows, w->cols), sc = (size_t)w->rows * sizeof(float);
        size_t qp = ((q + 63) & ~(size_t)63) - q, scp = ((sc + 63) & ~(size_t)63) - sc;
        ok = fwrite(w->data, 1, q, f) == q && fwrite(zeros, 1, qp, f) == qp &&
             fwrite(w->scale, 1, sc, f) == sc && fwrite(zeros, 1, scp, f) == scp;
        /* the pieces are summed as one run of bytes: each piece's words
           start where the last left off (q and sc need not be multiples
           of 8, so sum whole padded sections through a small tail buffer) */
        uint8_t tail[128];
        size_t q8 = q & ~(size_t)7, s8 = sc & ~(size_t)7;
        h = csum_add(h, w->data, q8);
        memset(tail, 0, sizeof tail);
        memcpy(tail, (const uint8_t *)w->data + q8, q - q8);
        h = csum_add(h, tail, (q - q8) + qp);
        h = csum_add(h, (const uint8_t *)w->scale, s8);
        memset(tail, 0, sizeof tail);
        memcpy(tail, (const uint8_t *)w->scale + s8, sc - s8);
        h = csum_add(h, tail, (sc - s8) + scp);
        data += q + qp + sc + scp;
    }
    q8f_header hd;
    memset(&hd, 0, sizeof hd);
    memcpy(hd.magic, Q8F_MAGIC, 8);
    hd.version = Q8F_VERSION; hd.n_mats = (uint32_t)n; hd.fingerprint = fp; hd.data_bytes = data;
    hd.checksum = mix64(h ^ (uint64_t)data);
    if (ok) {
        memcpy(head, &hd, sizeof hd);
        for (int i = 0; i < n; i++) {
            uint32_t rc[2] = {(uint32_t)jobs[i].dst->rows, (uint32_t)jobs[i].dst->cols};
            memcpy(head + sizeof hd + (size_t)i * 8, rc, 8);
        }
        ok = fseek(f, 0, SEEK_SET) == 0 && fwrite(head, 1, at, f) == at;
    }
    CM384_FREE(head);
    if (fclose(f)) ok = 0;
    if (ok && rename(tmp, path)) ok = 0;
    if (!ok) remove(tmp);
    return ok;
}

/* What the INT8 copies take and what they stand in for. */
typedef struct q8_plan {
    q8_job   *jobs;          /* NULL: count only                                  */
    int       n, tasks, status;
    uint64_t  bytes;         /* the copies: a byte per weight and a float per row */
    uint64_t  replaced;      /* stored bytes an INT8 engine no longer reads       */
} q8_plan;

static uint64_t stored_bytes(const gl_mat *w) {
    return w->data ? (uint64_t)w->rows * gl_row_bytes(w->type, w->cols) : 0;
}

/* One copy; `replaces`: the source is a checkpoint tensor of its own, which
 * an INT8 engine then no longer reads. */
static void q8_add(cm384_model *m, q8_plan *pl, const gl_mat *src, gl_mat *dst, int replaces) {
    (void)m;
    if (pl->status || !src->data) return;
    pl->bytes += gl_q8_bytes(src->rows, src->cols) + (uint64_t)src->rows * sizeof(float);
    if (replaces) pl->replaced += stored_bytes(src);
    if (pl->jobs) {            /* the shape now; the bytes are made or mapped later */
        dst->type = GL_Q8; dst->rows = src->rows; dst->cols = src->cols;
        dst->data = NULL; dst->scale = NULL;
        pl->jobs[pl->n] = (q8_job){src, dst, pl->tasks};
    }
    pl->tasks += (src->rows + Q8_ROWS - 1) / Q8_ROWS;
    pl->n++;
}

/* The projections that carry the compute, in the order they are made: with
 * q8 NULL only counted (pl->jobs NULL), else allocated and listed as jobs.
 * In stored type an INT8 engine still reads the embeddings and the routers
 * (and the fp32 vectors); kv_b_proj only through its per-head copies. */
static void q8_walk(cm384_model *m, layer_q8 *q8, q8_plan *pl) {
    const hparams *hp = &m->hp;
    layer_q8 none;
    memset(&none, 0, sizeof none);
    for (int l = 0; !pl->status && l < hp->n_layers + hp->n_mtp; l++) {
        const layer_w *L = &m->layers[l];
        layer_q8 *Q = q8 ? &q8[l] : &none;
        q8_add(m, pl, &L->wq_a, &Q->wq_a, 1); q8_add(m, pl, &L->wq_b, &Q->wq_b, 1); q8_add(m, pl, &L->wq, &Q->wq, 1);
        q8_add(m, pl, &L->wkv_a, &Q->wkv_a, 1); q8_add(m, pl, &L->wo, &Q->wo, 1);
        q8_add(m, pl, &L->dense.gate, &Q->dense.gate, 1); q8_add(m, pl, &L->dense.up, &Q->dense.up, 1);
        q8_add(m, pl, &L->dense.down, &Q->dense.down, 1);
        q8_add(m, pl, &L->shared.gate, &Q->shared.gate, 1); q8_add(m, pl, &L->shared.up, &Q->shared.up, 1);
        q8_add(m, pl, &L->shared.down, &Q->shared.down, 1);
        if (l >= hp->n_layers) {
            q8_add(m, pl, &L->eh_proj, &Q->eh_proj, 1);
            q8_add(m, pl, &L->head, &Q->head, L->head.data != m->head.data);   /* a second copy of lm_head */
        }
        if (q8) {
            Q->w_uk_t = arena_alloc(&m->q8_arena, (size_t)hp->n_heads * sizeof(gl_mat));
            Q->w_uv = arena_alloc(&m->q8_arena, (size_t)hp->n_heads * sizeof(gl_mat));
            if (!Q->w_uk_t || !Q->w_uv) { pl->status = fail(CM384_E_NOMEM, "out of memory for INT8 weights"); break; }
            Q->w_uk = L->w_uk ? arena_alloc(&m->q8_arena, (size_t)hp->n_heads * sizeof(gl_mat)) : NULL;
            if (L->w_uk && !Q->w_uk) { pl->status = fail(CM384_E_NOMEM, "out of memory for INT8 weights"); break; }
        }
        pl->replaced += stored_bytes(&L->wkv_b);
        /* every head's W_uk^T, then every W_uv: decode reads each kind as
           one run of bytes (op_heads), not 64 KB pieces a head apart */
        gl_mat dh;
        for (int h = 0; h < hp->n_heads; h++) q8_add(m, pl, &L->w_uk_t[h], q8 ? &Q->w_uk_t[h] : &dh, 0);
        for (int h = 0; h < hp->n_heads; h++) q8_add(m, pl, &L->w_uv[h], q8 ? &Q->w_uv[h] : &dh, 0);
        if (L->w_uk) for (int h = 0; h < hp->n_heads; h++) q8_add(m, pl, &L->w_uk[h], q8 ? &Q->w_uk[h] : &dh, 0);
        if (L->is_moe) {
            if (q8 && !(Q->experts = arena_alloc(&m->q8_arena, (size_t)hp->n_routed * sizeof(ffn_w)))) {
                pl->status = fail(CM384_E_NOMEM, "out of memory for INT8 weights");
                break;
            }
            for (int x = 0; x < hp->n_routed; x++) {
                ffn_w d;
                ffn_w *dst = q8 ? &Q->experts[x] : &d;
                q8_add(m, pl, &L->experts[x].gate, &dst->gate, 1);
                q8_add(m, pl, &L->experts[x].up, &dst->up, 1);
                q8_add(m, pl, &L->experts[x].down, &dst->down, 1);
            }
        }
    }
    gl_mat dh;
    q8_add(m, pl, &m->head, q8 ? &m->q8_head : &dh, m->head.data != m->embed.data);
}

/* Makes the INT8 copies once per model (the first caller does; later ones
 * find them).  With cache_dir they come from the model cache when it holds
 * them (mapped or read, not made), and are saved there when made.  progress may be
 * NULL: engines make them silently; a load with int8 = 1 reports stage
 * "quantize" in bytes of copies made, in about 50 steps, and may be
 * cancelled between steps.  e (may be NULL) gets the model cache's log lines. */
static int model_make_q8(cm384_model *m, gl_pool *pool, cm384_progress_fn progress, void *user,
                         const char *cache_dir, const struct cm384_engine *e) {
    pthread_mutex_lock(&m->q8_mu);
    if (m->q8) { pthread_mutex_unlock(&m->q8_mu); return CM384_OK; }
    const hparams *hp = &m->hp;
    int NL = hp->n_layers + hp->n_mtp;
    q8_plan count = {0};
    q8_walk(m, NULL, &count);
    layer_q8 *q8 = arena_alloc(&m->q8_arena, (size_t)NL * sizeof *q8);
    q8_plan pl = {0};
    pl.jobs = CM384_MALLOC((size_t)(count.n > 0 ? count.n : 1) * sizeof *pl.jobs);
    if (!q8 || !pl.jobs) pl.status = fail(CM384_E_NOMEM, "out of memory for INT8 weights");
    if (!pl.status) {
        memset(q8, 0, (size_t)NL * sizeof *q8);
        q8_walk(m, q8, &pl);                  /* the copies' shapes, not yet their bytes */
    }
    /* the model cache first; else make them (and keep them there) */
    char path[4096];
    uint64_t fp = 0;
    int from_cache = 0;
    if (!pl.status && cache_dir) {
        fp = model_fingerprint(m);
        snprintf(path, sizeof path, "%s/%016llx.q8", cache_dir, (unsigned long long)fp);
        const char *why = NULL;
        from_cache = q8f_read(m, path, pl.jobs, pl.n, fp, &why);
        if (!from_cache && e && strcmp(why, "cannot be opened")) engine_log(e, 2, "model cache: %s ignored: %s; remade", path, why);
        if (from_cache && e) engine_log(e, 1, "model cache: INT8 weights %s %s", m->use_mmap ? "mapped from" : "read from", path);
    }
    if (from_cache) {
        int r = progress && progress(user, "quantize", pl.bytes, pl.bytes)
              ? fail(CM384_E_CANCELLED, "%s: loading cancelled by the progress callback", m->path) : CM384_OK;
        m->q8 = q8;
        CM384_FREE(pl.jobs);
        pthread_mutex_unlock(&m->q8_mu);
        return r;
    }
    /* The copies' bytes go in one block advised for transparent huge pages:
     * decode streams every one of them once per token, and on 4 KB pages
     * each page is a TLB miss (V2-Lite-4 INT8 decode on Zen 5: 77 -> 85
     * tok/s, medians of 5 alternating runs).  Each matrix starts on a cache
     * line.  An AddressSanitizer build gives each matrix its own allocation,
     * so that a kernel reading past one is still caught. */
    size_t q8_off = 0;
    char *q8_base = NULL;
#if !CM384_ASAN
    size_t q8_total = 0;
    for (int i = 0; !pl.status && i < pl.n; i++)
        q8_total += (gl_q8_bytes(pl.jobs[i].dst->rows, pl.jobs[i].dst->cols) + 63) & ~(size_t)63;
    if (!pl.status && q8_total >= ((size_t)2 << 20) && !(q8_base = huge_alloc(q8_total, &m->q8_block)))
        pl.status = fail(CM384_E_NOMEM, "out of memory for INT8 weights");
#endif
    for (int i = 0; !pl.status && i < pl.n; i++) {
        gl_mat *dst = pl.jobs[i].dst;
        size_t bytes = gl_q8_bytes(dst->rows, dst->cols);
        if (q8_base) {
            dst->data = q8_base + q8_off;
            q8_off += (bytes + 63) & ~(size_t)63;
        } else dst->data = arena_alloc(&m->q8_arena, bytes);
        dst->scale = arena_alloc(&m->q8_arena, (size_t)dst->rows * sizeof(float));
        if (!dst->data || !dst->scale) pl.status = fail(CM384_E_NOMEM, "out of memory for INT8 weights");
    }
    /* a row widened to fp32 per worker (the kernel's scratch) */
    size_t row_cap = 0;
    for (int i = 0; i < pl.n; i++) if (GL_Q8_SCRATCH(pl.jobs[i].src->cols) > row_cap) row_cap = GL_Q8_SCRATCH(pl.jobs[i].src->cols);
    float *rows = NULL;
    if (!pl.status && !(rows = CM384_MALLOC((size_t)gl_pool_size(pool) * row_cap * sizeof(float) + 1)))
        pl.status = fail(CM384_E_NOMEM, "out of memory for INT8 weights");
    int r = pl.status;
    if (!r) {
        q8_ctx ctx = {pl.jobs, pl.n, 0, rows, row_cap};
        int step = progress ? (pl.tasks + 49) / 50 : pl.tasks;
        if (step < 1) step = 1;
        for (int t0 = 0; !r && t0 < pl.tasks; t0 += step) {
            int nt = pl.tasks - t0 < step ? pl.tasks - t0 : step;
            ctx.base = t0;
            gl_pool_run(pool, nt, t_quantize_weight, &ctx);
            if (progress) {
                /* bytes made so far: whole jobs before the boundary, rows of the one it cuts */
                int t1 = t0 + nt, j = 0;
                uint64_t done = 0;
                for (; j < pl.n && pl.jobs[j].first < t1; j++) {
                    const gl_mat *src = pl.jobs[j].src;
                    int rows = (t1 - pl.jobs[j].first) * Q8_ROWS;
                    if (rows > src->rows) rows = src->rows;
                    done += (rows == src->rows ? gl_q8_bytes(rows, src->cols) : (uint64_t)rows * src->cols) + (uint64_t)rows * sizeof(float);
                }
                if (progress(user, "quantize", done, pl.bytes))
                    r = fail(CM384_E_CANCELLED, "%s: loading cancelled by the progress callback", m->path);
            }
        }
        if (!r && !pl.tasks && progress && progress(user, "quantize", 0, 0))
            r = fail(CM384_E_CANCELLED, "%s: loading cancelled by the progress callback", m->path);
        if (!r) {
            m->q8 = q8;
            if (cache_dir && !q8f_save(path, pl.jobs, pl.n, fp) && e)
                engine_log(e, 2, "model cache: cannot write %s: %s", path, strerror(errno));
        }
    }
    if (r) { free(m->q8_block); m->q8_block = NULL; }   /* a later call makes them anew */
    CM384_FREE(rows);
    CM384_FREE(pl.jobs);
    pthread_mutex_unlock(&m->q8_mu);
    return r;
}

/* At load: what INT8 copies would take (for an engine's memory estimate),
 * and with make the copies themselves, on every core, reported as stage
 * "quantize". */
static int model_q8_at_load(cm384_model *m, int make) {
    q8_plan plan = {0};
    q8_walk(m, NULL, &plan);
    m->q8_bytes = plan.bytes;
    m->q8_replaced = plan.replaced;
    if (!make) return CM384_OK;
    gl_pool *pool = gl_pool_create(gl_n_cpus());
    if (!pool) return fail(CM384_E_NOMEM, "cannot start worker threads to make INT8 weights");
    const char *cd = m->cache_dir;
    if (cd && mkdir(cd, 0777) && errno != EEXIST) cd = NULL;
    int r = model_make_q8(m, pool, m->progress, m->progress_user, cd, NULL);
    gl_pool_free(pool);
    return r;
}

static int build_topology(struct cm384_engine *e) {
    const hparams *hp = &e->m->hp;
    const cm384_config *c = &e->cfg;
    int E = hp->n_routed, K = hp->top_k > 0 ? hp->top_k : 1, W = e->n_workers;
    int NL = hp->n_layers + hp->n_mtp, r;
    int paper = !strcmp(e->preset, "paper"), single = !strcmp(e->preset, "single");
    int n_pre, n_attn, first_attn, first_exp, n_exp, n_shared = 0, n_red = 0;
    e->n_dev = single ? 1 : c->n_devices;
    if (paper) {
        n_shared = E && hp->n_shared ? (E / K > 0 ? E / K : 1) : 0;
        n_red = E >= 8 ? E / 8 : E > 0 ? 1 : 0;
        n_pre = E >= 8 ? E / 8 : 1;
        int n_decode = E ? E + n_shared + n_red : W;
        if (n_pre + n_decode > e->n_dev)
            return fail(CM384_E_INVALID, "the paper preset needs %d devices for this model (%d prefill, %d decode: "
                        "%d experts + %d shared replicas + %d redundant); n_devices is %d",
                        n_pre + n_decode, n_pre, n_decode, E, n_shared, n_red, e->n_dev);
        first_attn = n_pre; n_attn = n_decode;
        first_exp = n_pre; n_exp = E;
    } else if (single) {
        n_pre = 1; first_attn = 0; n_attn = 1; first_exp = 0; n_exp = 1;
    } else {
        n_pre = W < e->n_dev ? W : e->n_dev;
        n_attn = n_pre;
        first_attn = 2 * W <= e->n_dev ? n_pre : 0;
        first_exp = first_attn + n_attn;
        n_exp = E < e->n_dev - first_exp ? E : e->n_dev - first_exp;
        if (n_exp <= 0) { first_exp = 0; n_exp = e->n_dev < E ? e->n_dev : (E > 0 ? E : 1); }
        /* redundant experts for EPLB when the model has enough experts to be
           uneven and the devices to spare: one per eight experts */
        if (E >= 16 && n_exp == E) {
            n_red = E / 8;
            if (n_red > e->n_dev - (first_exp + E)) n_red = e->n_dev - (first_exp + E);
            if (n_red < 0) n_red = 0;
        }
    }
    e->dev = CM384_CALLOC((size_t)e->n_dev, sizeof(device));
    e->pre_devs = CM384_MALLOC((size_t)n_pre * sizeof(int));
    e->attn_devs = CM384_MALLOC((size_t)n_attn * sizeof(int));
    if (!e->dev || !e->pre_devs || !e->attn_devs) return fail(CM384_E_NOMEM, "out of memory for devices");
    e->n_pre = n_pre;
    e->n_attn = n_attn;
    for (int i = 0; i < n_pre; i++) { e->pre_devs[i] = i; e->dev[i].roles |= ROLE_PREFILL; }
    for (int i = 0; i < n_attn; i++) { e->attn_devs[i] = first_attn + i; e->dev[first_attn + i].roles |= ROLE_ATTN; }
    /* decode's routed experts: n_exp primary devices (exp_cap slots each) and
       n_red redundant ones, after the shared-expert replicas */
    int cap = E > 0 ? (E + n_exp - 1) / n_exp : 1;
    e->n_red = n_red;
    e->n_exp_devs = n_exp + n_red;
    e->exp_cap = cap;
    e->exp_devs = CM384_MALLOC((size_t)e->n_exp_devs * sizeof(int));
    e->red_devs = CM384_MALLOC((size_t)(n_red > 0 ? n_red : 1) * sizeof(int));
    if (!e->exp_devs || !e->red_devs) return fail(CM384_E_NOMEM, "out of memory for devices");
    for (int i = 0; i < n_exp; i++) e->exp_devs[i] = first_exp + i;
    for (int j = 0; j < n_red; j++) e->exp_devs[n_exp + j] = e->red_devs[j] = first_exp + E + n_shared + j;
    int max_rep = 1 + e->n_exp_devs * cap - E;        /* every spare slot to one expert, at most */
    if (max_rep < 1 || E <= 0) max_rep = 1;
    if ((r = pl_alloc(&e->place[PHASE_PREFILL], NL, E, 1, 0))) return r;
    if ((r = pl_alloc(&e->place[PHASE_DECODE], NL, E, max_rep, n_shared))) return r;
    size_t Ez = E > 0 ? (size_t)E : 1, ND = (size_t)e->n_exp_devs;
    e->eplb_ld = CM384_MALLOC((Ez + 3 * ND) * sizeof(double));
    e->eplb_items = CM384_MALLOC(ND * cap * sizeof(struct eplb_item));
    e->eplb_used = CM384_MALLOC(ND * sizeof(int));
    e->eplb_old = CM384_MALLOC((Ez * max_rep + Ez + (size_t)e->n_dev) * sizeof(int));
    if (!e->eplb_ld || !e->eplb_items || !e->eplb_used || !e->eplb_old) return fail(CM384_E_NOMEM, "out of memory for EPLB");
    for (int l = 0; l < NL; l++) {
        int *pd = pl_dev(&e->place[PHASE_PREFILL], l), *dd = pl_dev(&e->place[PHASE_DECODE], l);
        for (int x = 0; x < E; x++) pd[x] = e->pre_devs[x % n_pre];
        for (int j = 0; j < n_shared; j++) dd[E * max_rep + j] = first_exp + E + j;
        pl_sort(&e->place[PHASE_PREFILL], l);
    }
    for (int j = 0; j < n_shared; j++) e->dev[first_exp + E + j].roles |= ROLE_SHARED;
    /* the first placement: EPLB on an even load (expert x on device x, spare
       slots to the first experts) until decode load is measured */
    uint64_t *even = CM384_MALLOC((size_t)NL * (E > 0 ? E : 1) * sizeof(uint64_t));
    if (!even) return fail(CM384_E_NOMEM, "out of memory");
    for (size_t i = 0; i < (size_t)NL * (E > 0 ? E : 1); i++) even[i] = 1;
    for (int l = 0; l < NL; l++)         /* placement entries of dense layers stay where they are */
        if (!e->m->layers[l].is_moe) {
            int *dd = pl_dev(&e->place[PHASE_DECODE], l);
            for (int x = 0; x < E; x++) dd[x * max_rep] = e->exp_devs[x % n_exp];
            pl_sort(&e->place[PHASE_DECODE], l);
        }
    r = eplb_rebalance(e, even);
    CM384_FREE(even);
    if (r) return r;
    e->eplb_runs = 0; e->eplb_moved_bytes = 0; e->eplb_before = e->eplb_after = 0;
    for (int l = 0; l < NL; l++)             /* roles: what decode's placement puts where */
        if (E > 0 && e->m->layers[l].is_moe) {
            const int *dd = pl_dev(&e->place[PHASE_DECODE], l);
            for (int i = 0; i < E * max_rep; i++)
                if (dd[i] >= 0) { e->dev[dd[i]].roles |= ROLE_EXPERT; e->dev[dd[i]].n_hosted++; }
            break;
        }
    /* the caching device: the last free one (the paper's caching cluster is
       the pool's CPUs), or the last device when none is free */
    e->cache_dev = e->n_dev - 1;
    for (int d = e->n_dev - 1; d >= 0; d--) if (!e->dev[d].roles) { e->cache_dev = d; break; }
    e->dev[e->cache_dev].roles |= ROLE_CACHE;
    return CM384_OK;
}

/* ======================================================================== */
/* 10. Forward steps and microbatch pipelining                              */
/* ======================================================================== */
/* One microbatch runs attention, feed-forward, attention, ... head.  Two
 * microbatches run as a pipeline shifted by one operation, so that every
 * region holds one microbatch's attention and the other's MoE -- the decode
 * pipeline of CloudMatrix-Infer, where attention and MoE run on two streams.
 *
 *     region:   attn0(A) | ffn0(A) attn0(B) | attn1(A) ffn0(B) | ...
 *
 * Each token's arithmetic is the same either way. */

typedef struct mb_arrays {          /* storage behind a microbatch's pointers */
    int32_t        *tok;
    int            *pos;
    const int     **tables;
    unsigned char  *want;
    dev_group      *groups;
} mb_arrays;

static void seq_op(op *o, struct cm384_engine *e, microbatch *mb, int i) {
    int NL = e->m->hp.n_layers;
    if (i < 2 * NL) op_init(o, e, mb, i % 2 ? OP_FFN : OP_ATTN, i / 2);
    else op_init(o, e, mb, OP_HEAD, -1);
}

/* Main layers and head for one or two microbatches. */
static void forward_main(struct cm384_engine *e, region *rg, microbatch *mb, int n_mb) {
    int n_ops = 2 * e->m->hp.n_layers + 1;
    op a, b;
    for (int i = 0; i < n_mb; i++) mb[i].pending = PEND_EMBED;      /* the first norm embeds */
    if (n_mb == 1) {
        for (int i = 0; i < n_ops; i++) { seq_op(&a, e, &mb[0], i); run_ops(rg, &a, NULL); }
        return;
    }
    for (int i = 0; i <= n_ops; i++) {
        if (i < n_ops) seq_op(&a, e, &mb[0], i);
        if (i >= 1) seq_op(&b, e, &mb[1], i - 1);
        run_ops(rg, i < n_ops ? &a : NULL, i >= 1 ? &b : NULL);
    }
}

/* The MTP module over one microbatch whose tok[] are the next tokens and
 * h_in the main model's final-normed hidden rows. */
static void forward_mtp(struct cm384_engine *e, region *rg, microbatch *mb, const float *h_in) {
    int l = e->m->hp.n_layers, wanted = !mb->want;                 /* no list: every row */
    for (int i = 0; !wanted && i < mb->n; i++) wanted = mb->want[i];
    op o;
    op_init(&o, e, mb, OP_MTP_IN, l); o.h_in = h_in; run_ops(rg, &o, NULL);
    op_init(&o, e, mb, OP_ATTN, l); run_ops(rg, &o, NULL);
    op_init(&o, e, mb, OP_FFN, l); run_ops(rg, &o, NULL);
    if (wanted) { op_init(&o, e, mb, OP_HEAD, l); run_ops(rg, &o, NULL); }   /* no draft wanted: no head */
}

/* Fills the groups of a microbatch whose tokens are already ordered by
 * device (dev_of[i] for row i). */
static void mb_make_groups(microbatch *mb, dev_group *groups, const int *dev_of) {
    mb->groups = groups;
    mb->n_groups = 0;
    for (int i = 0; i < mb->n; i++) {
        if (mb->n_groups == 0 || groups[mb->n_groups - 1].device != dev_of[i])
            groups[mb->n_groups++] = (dev_group){dev_of[i], i, 0};
        groups[mb->n_groups - 1].n++;
    }
}

/* ======================================================================== */
/* 11. Sampling                                                             */
/* ======================================================================== */
/* Greedy (temperature 0: the highest logit, lowest id on ties) or
 * temperature -> top-k -> min-p -> top-p, then a draw from the request's own
 * generator (splitmix64 seeded with the request's seed), so a seed always
 * gives the same tokens, whatever else the engine runs. */

typedef struct cand { float p; int id; } cand;

static uint64_t rng_next(uint64_t *s) { *s += 0x9e3779b97f4a7c15ull; return mix64(*s); }
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id - y->id;
}

static int sample_token(const float *logits, int V, const cm384_sampling *sp, uint64_t *rng, cand *c) {
    int best = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
    float mx = logits[best], inv_t = sp->temperature > 0 ? 1.0f / sp->temperature : 0;
    if (!(inv_t > 0) || isinf(inv_t) || !isfinite(mx)) return best;   /* greedy, or nothing to draw from */
    int n = 0;
    for (int i = 0; i < V; i++) {
        float p = expf((logits[i] - mx) * inv_t);
        if (p > 0) c[n++] = (cand){p, i};
    }
    /* keep only what can matter: top-k, min-p, and a prefix big enough to
       hold the nucleus (every token left out is less likely than every
       token kept, so the nucleus is inside) */
    double total = 0;
    for (int i = 0; i < n; i++) total += c[i].p;
    float pmax = 1.0f;                             /* the best token has p = 1 */
    float floor_p = sp->min_p > 0 ? sp->min_p * pmax : 0;
    int keep = n;
    if (!(floor_p > 0 || (sp->top_p > 0 && sp->top_p < 1) || (sp->top_k > 0 && sp->top_k < n))) {
        double r = rng_uniform(rng) * total, acc = 0;          /* plain temperature: no order needed */
        for (int i = 0; i < n; i++) { acc += c[i].p; if (r < acc) return c[i].id; }
        return c[n - 1].id;
    }
    {
        for (double tau = 1e-3; ; tau *= 1e-3) {
            float th = floor_p > tau ? floor_p : (float)tau;
            double mass = 0;
            int m = 0;
            for (int i = 0; i < n; i++) if (c[i].p >= th) mass += c[i].p;
            for (int i = 0; i < n; i++) if (c[i].p >= th) m++;
            int enough_k = sp->top_k > 0 && m >= sp->top_k;
            int enough_p = sp->top_p > 0 && sp->top_p < 1 && mass >= sp->top_p * total;
            if (th == floor_p || enough_k || enough_p || tau < 1e-30) {
                int j = 0;
                for (int i = 0; i < n; i++) if (c[i].p >= th) c[j++] = c[i];
                keep = j;
                break;
            }
        }
    }
    if (keep < 1) return best;                     /* the best token (p = 1) always passes a floor <= 1 */
    qsort(c, (size_t)keep, sizeof *c, cand_cmp);
    if (sp->top_k > 0 && keep > sp->top_k) keep = sp->top_k;
    double sum = 0;
    for (int i = 0; i < keep; i++) sum += c[i].p;
    if (sp->top_p > 0 && sp->top_p < 1) {
        double acc = 0;
        int j = 0;
        while (j < keep) { acc += c[j].p; j++; if (acc >= sp->top_p * sum) break; }
        keep = j;
        sum = acc;
    }
    double r = rng_uniform(rng) * sum, acc = 0;
    for (int i = 0; i < keep; i++) { acc += c[i].p; if (r < acc) return c[i].id; }
    return c[keep - 1].id;
}

void cm384_sampling_init(cm384_sampling *s) {
    memset(s, 0, sizeof *s);
    s->struct_size = sizeof *s;
    s->top_p = 1.0f;
    s->max_tokens = 128;
}

/* ---- the SLO controller: the decode batch that holds a TPOT target ---- */
/* With tpot_target_ms set, the decode batch is as large as it can be while
 * the p99 time per output token stays under the target.  The controller
 * learns the decode cycle time (from one decode step's start to the next:
 * it includes whatever prefill work shares the machine) as a linear model of
 *     t = a + b*batch + c*batch*context/1000 + d*prefill_tokens/1000
 * fitted by least squares with forgetting (recent steps count most), and a
 * p99 factor from the ratio of measured to predicted times over the last
 * SLO_RING steps (per window of cycles: a request's TPOT is its mean).  A step that emits 1.7 tokens per request (MTP) counts as
 * 1.7 tokens, as the paper's TPOT does.  It never extrapolates far: the cap
 * doubles past the largest batch it has measured while that batch is at
 * half the target or less, and near the target grows an eighth (or one)
 * after measuring that batch for SLO_SETTLE cycles.  When even one
 * request cannot meet the target, the target is infeasible and is reported
 * as such (stats, log), not silently missed. */

#define SLO_NF   4          /* model features                               */
#define SLO_RING 128        /* recent steps for the p99 factor              */
#define SLO_SETTLE 8        /* cycles at the largest batch before growing   */

typedef struct slo_ctl {
    double target_ms;
    double A[SLO_NF][SLO_NF], y[SLO_NF];    /* normal equations, with forgetting */
    double theta[SLO_NF];
    double ratio[SLO_RING];                 /* measured / predicted             */
    int    n_ratio, n_obs, max_seen, n_at_max;  /* cycles measured at max_seen */
    double tok_per_step;                    /* per request, EMA (1 without MTP) */
    double prefill_rate;                    /* EMA of prefill tokens per cycle  */
    double prefill_fixed, prefill_per_req;  /* the next cycles' prefill: slo_choose */
    int    cap, infeasible;
    double p99f;                            /* slo_p99_factor_compute, per cycle */
} slo_ctl;

static void slo_init(slo_ctl *c, double target_ms, int max_batch) {
    memset(c, 0, sizeof *c);
    c->target_ms = target_ms;
    c->tok_per_step = 1;
    c->cap = max_batch < 2 ? max_batch : 2;     /* start small, grow from measurement */
}

static void slo_features(double x[SLO_NF], double batch, double ctx_mean, double prefill_tokens) {
    x[0] = 1;
    x[1] = batch;
    x[2] = batch * ctx_mean / 1000;
    x[3] = prefill_tokens / 1000;
}

static double slo_predict(const slo_ctl *c, double batch, double ctx_mean, double prefill_tokens) {
    double x[SLO_NF], t = 0;
    slo_features(x, batch, ctx_mean, prefill_tokens);
    for (int i = 0; i < SLO_NF; i++) t += c->theta[i] * x[i];
    return t;
}

/* Solves the normal equations over the features in `use` (a bit mask) by
 * Gaussian elimination, with a small ridge; the others get 0. */
static void slo_solve_subset(slo_ctl *c, unsigned use, double theta[SLO_NF]) {
    int idx[SLO_NF], n = 0;
    for (int i = 0; i < SLO_NF; i++) { theta[i] = 0; if (use >> i & 1) idx[n++] = i; }
    double M[SLO_NF][SLO_NF + 1], tr = 0;
    for (int i = 0; i < SLO_NF; i++) tr += c->A[i][i];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++) M[i][j] = c->A[idx[i]][idx[j]];
        M[i][i] += 1e-6 * tr + 1e-12;
        M[i][n] = c->y[idx[i]];
    }
    for (int k = 0; k < n; k++) {
        int piv = k;
        for (int i = k + 1; i < n; i++) if (fabs(M[i][k]) > fabs(M[piv][k])) piv = i;
        if (piv != k) for (int j = 0; j <= n; j++) { double t = M[k][j]; M[k][j] = M[piv][j]; M[piv][j] = t; }
        if (fabs(M[k][k]) < 1e-300) return;
        for (int i = k + 1; i < n; i++) {
            double f = M[i][k] / M[k][k];
            for (int j = k; j <= n; j++) M[i][j] -= f * M[k][j];
        }
    }
    double v[SLO_NF];
    for (int i = n - 1; i >= 0; i--) {
        double x = M[i][n];
        for (int j = i + 1; j < n; j++) x -= M[i][j] * v[j];
        v[i] = x / M[i][i];
    }
    for (int i = 0; i < n; i++) theta[idx[i]] = v[i];
}

/* Least squares with every cost non-negative (a step never gets faster with
 * more requests, longer contexts or more prefill): features that come out
 * negative are dropped and the rest refitted. */
static void slo_solve(slo_ctl *c) {
    unsigned use = (1u << SLO_NF) - 1;
    for (int round = 0; round < SLO_NF; round++) {
        slo_solve_subset(c, use, c->theta);
        unsigned neg = 0;
        for (int i = 1; i < SLO_NF; i++) if (c->theta[i] < 0) neg |= 1u << i;
        if (!neg) return;
        use &= ~neg;
    }
}

/* The p99 factor.  A request's TPOT is its mean time per token over its
 * whole run, so one slow cycle (the OS took the core away) is diluted over
 * its tokens: the factor is the 99th percentile, over the recent windows of
 * SLO_WINDOW consecutive cycles, of the window's mean measured/predicted
 * ratio (at least 1). */
#define SLO_WINDOW 32
static double slo_p99_factor_compute(const slo_ctl *c) {
    int n = c->n_ratio < SLO_RING ? c->n_ratio : SLO_RING;
    if (n == 0) return 1;
    int w = n < SLO_WINDOW ? n : SLO_WINDOW, nw = n - w + 1;
    double means[SLO_RING], sum = 0;
    int first = c->n_ratio < SLO_RING ? 0 : c->n_ratio % SLO_RING;     /* the oldest ratio */
    for (int i = 0; i < n; i++) {
        sum += c->ratio[(first + i) % SLO_RING];
        if (i >= w) sum -= c->ratio[(first + i - w) % SLO_RING];
        if (i >= w - 1) means[i - w + 1] = sum / w;
    }
    for (int i = 1; i < nw; i++) {
        double v = means[i]; int j = i;
        while (j > 0 && means[j - 1] > v) { means[j] = means[j - 1]; j--; }
        means[j] = v;
    }
    int k = (int)ceil(0.99 * nw) - 1;
    double f = means[k < 0 ? 0 : k];
    return f > 1 ? f : 1;
}

static double slo_p99_factor(const slo_ctl *c) { return c->p99f > 1 ? c->p99f : 1; }

/* Predicted p99 time per output token at this batch size and context. */
static double slo_tpot_p99(const slo_ctl *c, int batch, double ctx_mean) {
    double t = slo_predict(c, batch, ctx_mean, c->prefill_fixed + batch * c->prefill_per_req);
    return t * slo_p99_factor(c) / c->tok_per_step;
}

/* One decode cycle measured: `batch` requests of mean context ctx_mean took
 * cycle_ms, while prefill computed prefill_tokens, and each request emitted
 * tok_per_req tokens on average.  Updates the model. */
static void slo_observe(slo_ctl *c, int batch, double ctx_mean, double prefill_tokens, double cycle_ms,
                        double tok_per_req) {
    if (batch < 1 || !(cycle_ms > 0)) return;
    double x[SLO_NF];
    slo_features(x, batch, ctx_mean, prefill_tokens);
    if (c->n_obs >= SLO_NF) {                  /* how far off the model was */
        double pred = slo_predict(c, batch, ctx_mean, prefill_tokens);
        if (pred > 0) c->ratio[c->n_ratio++ % SLO_RING] = cycle_ms / pred;
    }
    const double forget = 0.99;
    for (int i = 0; i < SLO_NF; i++) {
        for (int j = 0; j < SLO_NF; j++) c->A[i][j] = forget * c->A[i][j] + x[i] * x[j];
        c->y[i] = forget * c->y[i] + x[i] * cycle_ms;
    }
    c->n_obs++;
    slo_solve(c);
    c->p99f = slo_p99_factor_compute(c);
    double a = c->n_obs == 1 ? 1 : 0.1;
    c->prefill_rate += a * (prefill_tokens - c->prefill_rate);
    c->tok_per_step += a * (tok_per_req - c->tok_per_step);
    if (batch > c->max_seen) { c->max_seen = batch; c->n_at_max = 0; }
    if (batch == c->max_seen) c->n_at_max++;
}

/* The cap for the next step, whose requests have mean context ctx_next: the
 * largest batch predicted to hold the target, within reach of what was
 * measured.  The cycles to come will carry prefill_fixed + batch x
 * prefill_per_req prefill tokens: a running batch of b requests that each
 * bring P prompt tokens for L generated ones makes room for b/L new
 * requests a cycle, b P/L prompt tokens (when they share the cores). */
static int slo_choose(slo_ctl *c, double ctx_next, double prefill_fixed, double prefill_per_req, int pipeline,
                      int max_batch) {
    c->prefill_fixed = prefill_fixed;
    c->prefill_per_req = prefill_per_req;
    if (c->n_obs == 0) return c->cap;
    /* explore past the largest batch measured once it has been measured for
       SLO_SETTLE cycles: double it while it is predicted at half the target
       or less (far from the edge, a wrong guess costs little), else one
       eighth more.  Requests admitted but still in prefill (pipeline) will
       join the batch: without room for them the batch measured could never
       reach the cap. */
    int reach = c->max_seen;
    if (c->n_at_max >= SLO_SETTLE)
        reach = c->max_seen > 0 && slo_tpot_p99(c, c->max_seen, ctx_next) * 2 <= c->target_ms
              ? 2 * c->max_seen : c->max_seen + 1 + c->max_seen / 8;
    reach += pipeline;
    if (reach < 1) reach = 1;
    if (reach > max_batch) reach = max_batch;
    int best = 0;
    for (int b = 1; b <= reach; b++)
        if (slo_tpot_p99(c, b, ctx_next) <= c->target_ms) best = b;
    /* infeasible: one request alone, with no prefill beside it, misses the
       target -- not a busy moment that a smaller batch would ride out */
    double alone = slo_predict(c, 1, ctx_next, 0) * slo_p99_factor(c) / c->tok_per_step;
    c->infeasible = c->n_obs >= 16 && alone > c->target_ms;
    c->cap = best > 0 ? best : 1;
    return c->cap;
}

/* ======================================================================== */
/* 12. Requests, the peers and their loops                                  */
/* ======================================================================== */
/* Any thread may submit, cancel and wait; the peers do everything else.
 * Prefill and decode are peer subsystems, as in CloudMatrix-Infer: each has
 * its own loop (a thread), its own queue, its own devices and its own working
 * memory, and they meet only through the pool -- the KV blocks, the context
 * cache, and the queue a request is handed over by.
 *
 *   prefill  takes submitted requests in order, admits them while the pool has
 *            blocks for their prompts and the batch has room (serving the
 *            longest cached prefix from the context cache), computes up to
 *            prefill_chunk prompt tokens per step on the prefill devices,
 *            samples each finished prompt's first token and hands the request
 *            to decode (its KV blocks change owner: the RDMA plane);
 *   decode   takes what prefill handed over and runs one token for every
 *            decoding request per step, attention on their devices, the MoE
 *            over the expert devices; its regions come first in the worker
 *            pool (section 6), so a decode step never waits for a prefill
 *            chunk to end;
 *   caching  (with cache_dir) writes the blocks the context cache indexes to
 *            files, and loads the ones a new prompt finds there into its KV
 *            blocks while prefill computes other prompts (section 8's disk
 *            tier; its traffic is the memory-pool plane's).
 *
 * A request needing a new block when none is free preempts the most recently
 * admitted decoding request, whose blocks go back (full ones to the context
 * cache) and which prefill recomputes later -- so no request is lost and every
 * one ends with exactly one final event.  With time_shared (or one thread per
 * device) a single loop runs a prefill step and then a decode step, in turn:
 * the scheduler before the peers, kept for comparison.
 *
 * Where later work goes: a loop owns its devices and requests, so a failed
 * device is the owning loop's business (move its requests, re-place its
 * experts); the decode loop measures every step (decode_after_step), the
 * place for a batch-size controller fed by step times and for EPLB from
 * decode load. */

enum { RQ_WAITING, RQ_PREFILL, RQ_DECODE };

struct request {
    uint64_t           id;
    request           *next;          /* inbox / waiting list                       */
    int32_t           *tokens;        /* prompt, then generated tokens               */
    int                n_prompt, n_tokens, cap_tokens;
    int                n_computed;    /* positions whose KV rows are in its blocks   */
    int                n_cached;      /* prompt tokens the context cache served      */
    int                admitted;      /* admitted at least once                      */
    int                in_batch;      /* counted in the admitted batch               */
    int               *blocks;        /* block table                                 */
    int                n_blocks, cap_blocks;
    int                n_hashed;      /* leading blocks already offered to the cache */
    int                load_first, load_n;   /* blocks the caching loop loads from disk */
    uint64_t           chain;         /* cache key of the last of those              */
    int                stage, device;
    cm384_sampling     samp;
    uint64_t           rng;
    uint32_t           tenant;
    cm384_event_fn     fn;
    void              *user;
    int                n_generated;
    double             t_submit, t_first, t_last;
    _Atomic int        cancel;
    cm384_detok_stream ds;
    char              *text;          /* event text                                  */
    size_t             text_cap;
    int                sampled;       /* token sampled in this step                  */
    int                logit_row;     /* its first row of logits                     */
    int                row_first;     /* its first row in the step                   */
    /* MTP speculative decoding */
    int                draft;         /* the MTP layer's guess at the next token, -1 */
    int                drafting;      /* this step verifies the draft                */
    int                accepted, sampled2;
    int                mtp_done;      /* MTP entries 0..mtp_done-1 are computed      */
    float             *h_ring;        /* [MTP_RING][dim] final hidden of positions not
                                         yet through the MTP layer: p at slot p % MTP_RING */
    /* faults (section 12b) */
    int                fault;         /* 1 + the fault that took its KV, 0: none     */
    int                fault_counted; /* its recomputed tokens are counted           */
    int                fatal;         /* ended by a fault that left no device        */
};

/* MTP: a request's final hidden states wait in a ring until the MTP layer
 * takes them (position p at slot p % MTP_RING); a decode step that does not
 * draft next leaves them there, and the backlog never reaches MTP_RING. */
#define MTP_RING 64
static float *mtp_h_slot(const struct cm384_engine *e, request *r, int pos) {
    return r->h_ring + (size_t)(pos % MTP_RING) * (size_t)e->m->hp.dim;
}

/* section 12b */
static void fault_request_back(struct cm384_engine *e, request *r);
static void fault_count_recompute(struct cm384_engine *e, request *r, int kept_tokens);
static void link_step_begin(struct cm384_engine *e, int phase);
static void link_step_end(struct cm384_engine *e, int phase);
static int  faults_due(struct cm384_engine *e);
static void faults_apply_due(struct cm384_engine *e);
static const char *role_name(unsigned roles);

typedef struct done_rec { uint64_t id; int status; } done_rec;

#define LAT_RING 4096

/* What the API threads and the loops share: under e->mu. */
typedef struct sched {
    request  *inbox_head, *inbox_tail;             /* submitted, not yet seen by prefill */
    request **live;  int n_live, cap_live;         /* submitted, not finished         */
    done_rec *done;  int n_done, cap_done;         /* finished, not yet waited for    */
    uint64_t  next_id;
    double    ttft[LAT_RING], tpot[LAT_RING];
    uint64_t  n_ttft, n_tpot;
    cm384_stats st;                                /* counters                         */
    int       n_batch, max_batch;                  /* admitted requests, and the cap  */
} sched;

/* A peer subsystem: its loop, its queue, its requests and its working
 * memory (carved from the pool). */
typedef struct peer {
    int             lane;          /* LANE_DECODE or LANE_PREFILL: its index in e->peers */
    int             phase;         /* PHASE_DECODE or PHASE_PREFILL: its placement */
    region          rg;            /* its parallel regions (lane, worker id)       */
    fwd_scratch     s[2];          /* per microbatch                               */
    int             step_cap;      /* tokens per step                              */
    int             rows_cap;      /* logits rows per step                         */
    float          *logits;        /* [rows_cap][vocab]                            */
    cand           *cands;         /* [workers + 1][vocab]                         */
    mb_arrays       mba[2];
    int            *dev_of;        /* [step_cap]                                   */
    float          *hbuf, *mtp_h;  /* MTP: [step_cap][dim] final hidden, entry inputs */
    request       **mtp_req;       /* [step_cap]                                   */
    int            *mtp_want_row;  /* [step_cap]                                   */
    int             mtp_n, mtp_w;  /* MTP entries queued, with logits              */
    /* its loop: the queue under e->mu, the rest its own */
    pthread_mutex_t step_mu;       /* a step (or an eval) at a time                */
    pthread_cond_t  cv;            /* work for it (under e->mu)                    */
    unsigned        wakes;         /* times it was told of work (under e->mu)      */
    pthread_t       thread;
    int             started;
    request        *in_head, *in_tail;   /* handed to it by the other peer         */
    request       **run;  int n_run;     /* its requests, in admission order       */
    request        *wait_head, *wait_tail;  /* prefill: submitted, not admitted    */
    request        *ready_head, *ready_tail;/* prefill: loaded by the caching loop  */
    _Atomic uint64_t steps;        /* steps run (the other peer reads it)          */
    int64_t         steps_begun;   /* steps started, failed ones too: the trace's step numbers */
    atomic_int      computing;     /* prefill: a step's products are running (decode
                                      reads it: a decode step beside none ran alone) */
    int64_t         short_steps;   /* prefill: steps run as short tasks (a request was decoding) */
    /* decode's step measurements (SLO, EPLB) */
    atomic_int      decode_cap;    /* requests the SLO lets run (prefill admits within it) */
    slo_ctl         slo;           /* with tpot_target_ms                          */
    double          slo_last_end;  /* end of the last decode step, 0 after idling  */
    uint64_t        slo_last_prefilled;   /* tokens_prefilled then                 */
    int             slo_warned;    /* the infeasible target was logged             */
    uint64_t       *load_mark;     /* decode expert load at the last rebalance     */
    int             steps_since_rebalance;
    /* decode's MTP gate: draft while a drafting step's tokens pay for its cost */
    double          mtp_t1, mtp_t2, mtp_tm;   /* ms per request: a step of one row, of two
                                                 (the draft), the MTP layer's drafting (EWMA) */
    double          mtp_acc;                   /* drafts accepted (EWMA)                   */
    int             mtp_n1, mtp_n2, mtp_nm;    /* measurements of each                      */
    int             mtp_since_probe;           /* plain steps since the last draft          */
    int             mtp_probe_every;           /* the next try after that many (16 .. 256)  */
} peer;


static void request_free(request *r) {
    if (!r) return;
    CM384_FREE(r->tokens);
    CM384_FREE(r->blocks);
    CM384_FREE(r->text);
    CM384_FREE(r->h_ring);
    CM384_FREE(r);
}

static void stat_add(struct cm384_engine *e, uint64_t *field, uint64_t v) {
    pthread_mutex_lock(&e->mu);
    *field += v;
    pthread_mutex_unlock(&e->mu);
}

/* Tells a loop it has work (under e->mu).  The time-shared loop is the
 * prefill peer's thread. */
static void wake_peer(struct cm384_engine *e, int lane) {
    peer *P = &e->peers[e->time_shared ? LANE_PREFILL : lane];
    P->wakes++;
    pthread_cond_signal(&P->cv);
}

/* The caching subsystem's loop (the paper's EMS), with cache_dir: it writes
 * blocks the cache indexed to their files and loads the blocks a request's
 * prompt found on disk into the request's KV blocks, off prefill's path --
 * prefill computes other prompts meanwhile.  Its jobs queue under e->mu. */
typedef struct cache_job { int block; request *r; } cache_job;   /* save a block, or load r's */

typedef struct cacher {
    pthread_t       thread;
    int             started;
    pthread_cond_t  cv;
    cache_job      *jobs;   int head, n, cap;   /* a ring */
    uint8_t        *buf;    size_t buf_cap;     /* one file's bytes */
} cacher;

/* Queues a job (under e->mu); 0 if there was no memory for it. */
static int cache_push(struct cm384_engine *e, cache_job j) {
    cacher *C = e->cacher;
    if (C->n == C->cap) {
        int cap = C->cap ? 2 * C->cap : 64;
        cache_job *q = CM384_MALLOC((size_t)cap * sizeof *q);
        if (!q) return 0;
        for (int i = 0; i < C->n; i++) q[i] = C->jobs[(C->head + i) % C->cap];
        CM384_FREE(C->jobs);
        C->jobs = q; C->cap = cap; C->head = 0;
    }
    C->jobs[(C->head + C->n++) % C->cap] = j;
    pthread_cond_signal(&C->cv);
    return 1;
}

/* ---- events ---- */

static double pct(const double *ring, uint64_t n, double q) {
    int m = n < LAT_RING ? (int)n : LAT_RING;
    if (m == 0) return 0;
    double tmp[LAT_RING];
    memcpy(tmp, ring, (size_t)m * sizeof(double));
    for (int i = 1; i < m; i++) {                  /* insertion sort: stats are rare */
        double v = tmp[i]; int j = i;
        while (j > 0 && tmp[j - 1] > v) { tmp[j] = tmp[j - 1]; j--; }
        tmp[j] = v;
    }
    int k = (int)ceil(q * m) - 1;
    return tmp[k < 0 ? 0 : k >= m ? m - 1 : k];
}

static void fill_event(const request *r, cm384_event *ev, int kind) {
    memset(ev, 0, sizeof *ev);
    ev->struct_size = sizeof *ev;
    ev->id = r->id;
    ev->kind = kind;
    ev->n_prompt = r->n_prompt;
    ev->n_cached = r->n_cached;
    ev->n_generated = r->n_generated;
    ev->ttft_ms = r->t_first > 0 ? r->t_first - r->t_submit : 0;
    ev->tpot_ms = r->n_generated > 1 ? (r->t_last - r->t_first) / (r->n_generated - 1) : 0;
}

static void emit_token(struct cm384_engine *e, request *r, int32_t tok) {
    cm384_event ev;
    fill_event(r, &ev, CM384_EV_TOKEN);
    ev.token = tok;
    int n = 0;
    if (e->m->tok) {
        n = detok_stream_push(e->m->tok, &r->ds, tok, r->text, r->text_cap);
        if (n < 0) n = 0;
    }
    ev.text = r->text;
    ev.text_len = (size_t)n;
    if (r->fn && r->fn(r->user, &ev)) atomic_store(&r->cancel, 1);
}


/* ---- the pool's blocks: what a request holds ---- */

/* Offers a request's full computed blocks to the context cache, so that a
 * finished or preempted request's prefix stays reusable.  Under pool_mu. */
static void offer_blocks(struct cm384_engine *e, request *r) {
    int B = e->kv.block_tokens, full = r->n_computed / B;
    for (int b = r->n_hashed; b < full && b < r->n_blocks; b++) {
        uint64_t key = block_key(r->chain, r->tenant, r->tokens + (size_t)b * B, B);
        if (cache_insert(e, r->blocks[b], key, r->chain, r->tenant, r->tokens + (size_t)b * B) && e->cacher &&
            !key_set_has(&e->disk_keys, key)) {
            /* to disk too: the job holds the block until it is written */
            e->bm[r->blocks[b]].ref++;
            pthread_mutex_lock(&e->mu);
            if (!cache_push(e, (cache_job){r->blocks[b], NULL})) e->bm[r->blocks[b]].ref--;
            pthread_mutex_unlock(&e->mu);
        }
        r->chain = key;
        r->n_hashed = b + 1;
    }
}

static void offer_blocks_locked(struct cm384_engine *e, request *r) {
    pthread_mutex_lock(&e->pool_mu);
    offer_blocks(e, r);
    pthread_mutex_unlock(&e->pool_mu);
}

/* Gives a request's blocks back (full ones to the context cache first). */
static void release_blocks(struct cm384_engine *e, request *r) {
    pthread_mutex_lock(&e->pool_mu);
    offer_blocks(e, r);
    for (int b = 0; b < r->n_blocks; b++) block_unref(e, r->blocks[b]);
    if (r->stage == RQ_DECODE && r->device >= 0) e->dev[r->device].n_owned--;
    pthread_mutex_unlock(&e->pool_mu);
    r->n_blocks = 0;
    r->n_computed = 0;
    r->n_hashed = 0;
    r->chain = 0;
    r->mtp_done = 0;
    r->draft = -1;
    r->device = -1;
}

static void run_remove(peer *P, request *r) {
    for (int i = 0; i < P->n_run; i++)
        if (P->run[i] == r) {
            memmove(&P->run[i], &P->run[i + 1], (size_t)(P->n_run - i - 1) * sizeof *P->run);
            P->n_run--;
            return;
        }
}

/* Ends a request: its final event, then its record for cm384_wait.  The
 * caller has taken it off its peer's lists. */
static void finish(struct cm384_engine *e, request *r, int kind, int status) {
    sched *S = e->sched;
    if (r->fatal && kind == CM384_EV_CANCELLED) { kind = CM384_EV_ERROR; status = CM384_E_DEVICE; }   /* 12b */
    fault_request_back(e, r);
    release_blocks(e, r);
    if (r->fn) {
        cm384_event ev;
        fill_event(r, &ev, kind);
        ev.status = status;
        char tail[16];
        int n = detok_stream_flush(&r->ds, tail, sizeof tail);
        ev.text = tail;
        ev.text_len = n > 0 ? (size_t)n : 0;
        r->fn(r->user, &ev);
    }
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < S->n_live; i++) if (S->live[i] == r) { S->live[i] = S->live[--S->n_live]; break; }
    if (S->n_done == S->cap_done) {
        if (S->cap_done >= 1 << 16) {           /* nobody waits for these: drop the oldest half */
            memmove(S->done, S->done + S->n_done / 2, (size_t)(S->n_done - S->n_done / 2) * sizeof *S->done);
            S->n_done -= S->n_done / 2;
        } else {
            int cap = S->cap_done ? 2 * S->cap_done : 256;
            done_rec *d = realloc(S->done, (size_t)cap * sizeof *d);
            if (d) { S->done = d; S->cap_done = cap; }
        }
    }
    if (S->n_done < S->cap_done) S->done[S->n_done++] = (done_rec){r->id, status};
    if (kind == CM384_EV_DONE) S->st.requests_done++;
    else if (kind == CM384_EV_CANCELLED) S->st.requests_cancelled++;
    else S->st.requests_failed++;
    if (r->t_first > 0) S->ttft[S->n_ttft++ % LAT_RING] = r->t_first - r->t_submit;
    if (r->n_generated > 1) S->tpot[S->n_tpot++ % LAT_RING] = (r->t_last - r->t_first) / (r->n_generated - 1);
    if (r->in_batch) S->n_batch--;
    pthread_cond_broadcast(&e->cv_done);
    wake_peer(e, LANE_PREFILL);                  /* blocks and a batch slot came free */
    if (e->stopping) wake_peer(e, LANE_DECODE);
    if (e->stopping && e->cacher) pthread_cond_signal(&e->cacher->cv);
    pthread_mutex_unlock(&e->mu);
    request_free(r);
}

/* ---- admission, hand-off, preemption ---- */

/* Gives request r the blocks for its prompt, the cached prefix first.
 * Returns 0 if the pool has no room for it now. */
static int admit(struct cm384_engine *e, peer *P, request *r) {
    int B = e->kv.block_tokens, limit = (r->n_tokens - 1) / B, matched = 0;
    uint64_t parent = 0;
    r->n_blocks = 0;
    pthread_mutex_lock(&e->pool_mu);
    if (e->cache_blocks_max > 0) {
        for (int b = 0; b < limit; b++) {
            const int32_t *tok = r->tokens + (size_t)b * B;
            uint64_t key = block_key(parent, r->tenant, tok, B);
            int blk = cache_find(e, key, parent, r->tenant, tok);
            if (blk < 0) break;
            if (e->bm[blk].ref == 1) lru_unlink(e, blk);
            e->bm[blk].ref++;
            r->blocks[r->n_blocks++] = blk;
            parent = key;
            matched++;
        }
    }
    /* the disk tier: the prefix may go on in files the caching loop loads */
    int on_disk = 0;
    for (uint64_t k = parent; e->cacher && matched + on_disk < limit; on_disk++) {
        k = block_key(k, r->tenant, r->tokens + (size_t)(matched + on_disk) * B, B);
        if (!key_set_has(&e->disk_keys, k)) break;
    }
    int need = (r->n_tokens + e->mtp + B - 1) / B - matched;      /* MTP also writes slot n_tokens */
    if (need > blocks_available(e)) {
        for (int b = 0; b < r->n_blocks; b++) block_unref(e, r->blocks[b]);
        r->n_blocks = 0;
        pthread_mutex_unlock(&e->pool_mu);
        return 0;
    }
    for (int i = 0; i < need; i++) r->blocks[r->n_blocks++] = block_get(e);
    pthread_mutex_unlock(&e->pool_mu);
    r->load_first = matched;
    r->load_n = on_disk;
    fault_count_recompute(e, r, (matched + on_disk) * B);
    pthread_mutex_lock(&e->mu);
    e->sched->st.cache_hits_pool += (uint64_t)matched;
    e->sched->st.cache_misses += (uint64_t)(limit - matched - on_disk);
    pthread_mutex_unlock(&e->mu);
    r->n_computed = matched * B;
    r->n_hashed = matched;
    r->chain = parent;
    if (e->mtp && matched) {            /* entries up to the cached prefix's end, but its last */
        r->mtp_done = matched * B - 1;
        memcpy(mtp_h_slot(e, r, r->mtp_done), e->blk_h + (size_t)r->blocks[matched - 1] * e->m->hp.dim,
               (size_t)e->m->hp.dim * sizeof(float));
    }
    if (!r->admitted) {
        r->n_cached = matched * B;
        stat_add(e, &e->sched->st.tokens_cached, (uint64_t)matched * B);
        r->admitted = 1;
    }
    /* the prefill device with the least prompt work queued */
    int best = e->pre_devs[0], best_load = INT_MAX;
    for (int i = 0; i < e->n_pre; i++) {
        int d = e->pre_devs[i], load = 0;
        for (int j = 0; j < P->n_run; j++)
            if (P->run[j]->device == d) load += P->run[j]->n_tokens - P->run[j]->n_computed;
        if (load < best_load) { best_load = load; best = d; }
    }
    r->device = best;
    r->stage = RQ_PREFILL;
    return 1;
}

/* A request whose prompt is computed moves to the decode attention device
 * with the fewest requests: its KV blocks change owner in the shared pool,
 * and the bytes a real transfer would carry are counted on the RDMA plane. */
static void hand_off(struct cm384_engine *e, request *r) {
    pthread_mutex_lock(&e->pool_mu);
    int best = e->attn_devs[0];
    for (int i = 1; i < e->n_attn; i++)
        if (e->dev[e->attn_devs[i]].n_owned < e->dev[best].n_owned) best = e->attn_devs[i];
    uint64_t bytes = (uint64_t)r->n_blocks * e->kv.block_bytes;
    if (best != r->device) {
        fabric_count(e, PLANE_RDMA, r->device, best, bytes);
        atomic_fetch_add_explicit(&e->kv_handoff_bytes, bytes, memory_order_relaxed);
    }
    for (int b = 0; b < r->n_blocks; b++) e->bm[r->blocks[b]].owner = best;
    r->device = best;
    r->stage = RQ_DECODE;
    e->dev[best].n_owned++;
    pthread_mutex_unlock(&e->pool_mu);
}

/* Puts r on decode's queue. */
static void give_to_decode(struct cm384_engine *e, request *r) {
    peer *D = &e->peers[LANE_DECODE];
    r->next = NULL;
    pthread_mutex_lock(&e->mu);
    if (D->in_tail) D->in_tail->next = r; else D->in_head = r;
    D->in_tail = r;
    wake_peer(e, LANE_DECODE);
    pthread_mutex_unlock(&e->mu);
}

/* Decode gives r back to prefill, which recomputes it first. */
static void preempt(struct cm384_engine *e, peer *D, request *r, const char *why) {
    peer *P = &e->peers[LANE_PREFILL];
    release_blocks(e, r);
    r->stage = RQ_WAITING;
    run_remove(D, r);
    pthread_mutex_lock(&e->mu);
    r->next = P->in_head;
    P->in_head = r;
    if (!P->in_tail) P->in_tail = r;
    e->sched->st.requests_preempted++;
    if (r->in_batch) e->sched->n_batch--;
    r->in_batch = 0;
    wake_peer(e, LANE_PREFILL);
    pthread_mutex_unlock(&e->mu);
    engine_log(e, 2, "%s: request %llu preempted after %d tokens; it will be recomputed",
               why, (unsigned long long)r->id, r->n_tokens);
}

/* Stops a request after its latest token if it is done. */
static int check_stop(struct cm384_engine *e, peer *P, request *r) {
    int eos = e->m->hp.eos;
    if (r->n_generated >= r->samp.max_tokens || r->n_tokens >= e->max_ctx ||
        (!r->samp.ignore_eos && eos >= 0 && r->tokens[r->n_tokens - 1] == eos)) {
        run_remove(P, r);
        finish(e, r, CM384_EV_DONE, CM384_OK);
        return 1;
    }
    return 0;
}

/* Appends a sampled token and tells the caller. */
static void accept_token(struct cm384_engine *e, request *r, int32_t tok) {
    double t = now_ms();
    if (r->n_generated == 0) r->t_first = t;
    r->t_last = t;
    r->tokens[r->n_tokens++] = tok;
    r->n_generated++;
    stat_add(e, &e->sched->st.tokens_decoded, 1);
    emit_token(e, r, tok);
}

/* ---- sampling as tasks ---- */
/* A request decoding with an MTP draft has two rows: its last token and the
 * draft.  The main model's token is sampled from the first row as always; the
 * draft is accepted when it equals that token, and then the second row gives
 * one more token.  Each token still takes exactly one draw from the request's
 * generator, so MTP on or off gives the same tokens, greedy or sampled. */

typedef struct sample_ctx { struct cm384_engine *e; peer *P; request **req; int n; } sample_ctx;

static void t_sample(void *ctx, int i, int task, int worker) {
    (void)task;
    sample_ctx *sc = ctx;
    struct cm384_engine *e = sc->e;
    request *r = sc->req[i];
    int V = e->m->hp.vocab;
    cand *c = sc->P->cands + (size_t)worker * V;
    r->sampled = sample_token(sc->P->logits + (size_t)r->logit_row * V, V, &r->samp, &r->rng, c);
    r->accepted = 0;
    if (r->drafting && r->sampled == r->draft) {
        r->accepted = 1;
        r->sampled2 = sample_token(sc->P->logits + (size_t)(r->logit_row + 1) * V, V, &r->samp, &r->rng, c);
    }
}

static void sample_rows(struct cm384_engine *e, peer *P, request **req, int n) {
    sample_ctx sc = {e, P, req, n};
    P->rg.name = "sample"; P->rg.op = "logits to tokens"; P->rg.layer = -1; P->rg.mb = 0;
    for (int i = 0; i < n; i++) region_add(&P->rg, t_sample, &sc, i, 1, req[i]->device >= 0 ? req[i]->device : 0);
    region_run(&P->rg);
}

/* ---- a step's rows ---- */

/* Lays out the rows of requests rq[0..nr) (each contributing cnt[i] tokens
 * from position n_computed; a drafted request's second row is its draft)
 * into microbatch arrays, ordered by device.  Rows are numbered from `base`
 * across the step's microbatches. */
static int build_rows(struct cm384_engine *e, peer *P, request **rq, const int *cnt, int nr, mb_arrays *a,
                      microbatch *mb, int index, int base, int *n_want) {
    int n = 0, w = 0;
    for (int dev = 0; dev < e->n_dev; dev++) {             /* stable order by device */
        for (int i = 0; i < nr; i++) {
            request *r = rq[i];
            if (r->device != dev) continue;
            r->row_first = base + n;
            for (int j = 0; j < cnt[i]; j++) {
                int p = r->n_computed + j;
                a->tok[n] = p < r->n_tokens ? r->tokens[p] : r->draft;
                a->pos[n] = p;
                a->tables[n] = r->blocks;
                a->want[n] = p >= r->n_tokens - 1;
                if (a->want[n] && p == r->n_tokens - 1) r->logit_row = w;
                w += a->want[n];
                P->dev_of[base + n] = dev;
                n++;
            }
        }
    }
    memset(mb, 0, sizeof *mb);
    mb->n = n; mb->tok = a->tok; mb->pos = a->pos; mb->tables = a->tables; mb->want = a->want;
    mb->phase = P->phase; mb->index = index; mb->s = &P->s[index];
    mb_make_groups(mb, a->groups, P->dev_of + base);
    if (e->mtp) mb->h_out = P->hbuf + (size_t)base * e->m->hp.dim;
    *n_want = w;
    return n;
}

/* Runs rows of requests (split into two microbatches when configured) and
 * leaves the wanted logits in P->logits, rows numbered across microbatches. */
static void run_phase(struct cm384_engine *e, peer *P, request **rq, const int *cnt, int nr) {
    microbatch mb[2];
    int n_mb = 1, total = 0;
    for (int i = 0; i < nr; i++) total += cnt[i];
    int split = nr;
    if (e->cfg.microbatches == 2 && nr >= 2) {
        int acc = 0;
        for (split = 0; split < nr - 1 && acc + cnt[split] <= total / 2; split++) acc += cnt[split];
        if (split == 0) split = 1;
        n_mb = 2;
    }
    int w0 = 0, w1 = 0;
    build_rows(e, P, rq, cnt, split, &P->mba[0], &mb[0], 0, 0, &w0);
    mb[0].logits = P->logits;
    if (n_mb == 2) {
        build_rows(e, P, rq + split, cnt + split, nr - split, &P->mba[1], &mb[1], 1, mb[0].n, &w1);
        for (int i = split; i < nr; i++) rq[i]->logit_row += w0;
        mb[1].logits = P->logits + (size_t)w0 * e->m->hp.vocab;
    }
    link_step_begin(e, P->phase);
    forward_main(e, &P->rg, mb, n_mb);
    link_step_end(e, P->phase);
}

/* ---- MTP: drafting the next token ---- */
/* MTP entry i reads the main model's final hidden state h_i and token i+1
 * and predicts token i+2; its KV row lives in slot i+1 of the MTP layer.  A
 * request keeps its entries up to date with its computed positions (entries
 * 0 .. n_computed-1), and the last entry's prediction is its next draft.
 * h of the position before a step comes from the request (h_prev) or, after
 * a context-cache hit, from the cached block (blk_h). */

static void mtp_flush(struct cm384_engine *e, peer *P) {
    if (!P->mtp_n) return;
    mb_arrays *a = &P->mba[0];
    microbatch mb = {0};
    mb.n = P->mtp_n; mb.tok = a->tok; mb.pos = a->pos; mb.tables = a->tables; mb.want = a->want;
    mb.kv_shift = 1; mb.phase = P->phase; mb.s = &P->s[0]; mb.logits = P->logits;
    mb_make_groups(&mb, a->groups, P->dev_of);
    forward_mtp(e, &P->rg, &mb, P->mtp_h);
    int V = e->m->hp.vocab;
    for (int i = 0; i < P->mtp_n; i++) {
        if (!a->want[i]) continue;
        const float *row = P->logits + (size_t)P->mtp_want_row[i] * V;
        int best = 0;
        for (int v = 1; v < V; v++) if (row[v] > row[best]) best = v;
        P->mtp_req[i]->draft = best;
        if (e->dbg_draft) e->dbg_draft[a->pos[i]] = best;
    }
    P->mtp_n = 0;
    P->mtp_w = 0;
}

/* Keeps h of the positions this step computed (block ends for the
 * cache), then brings request r's MTP entries up to n_computed - 1 when
 * `draft` (the last entry's prediction is the next step's draft) or when the
 * ring is about to fill or a block is full; otherwise the entries wait in
 * the ring -- they are the MTP layer's KV, needed before the next draft or
 * when their block goes to the context cache, not before.  `first` is
 * the first position this step computed (its h is in hbuf at r->row_first). */
static void mtp_add(struct cm384_engine *e, peer *P, request *r, int first, int draft) {
    int D = e->m->hp.dim, last = r->n_computed - 1, B = e->kv.block_tokens;
    for (int pos = first; pos <= last; pos++) {
        const float *h = P->hbuf + ((size_t)r->row_first + (pos - first)) * D;
        if (pos % B == B - 1) memcpy(e->blk_h + (size_t)r->blocks[pos / B] * D, h, (size_t)D * sizeof(float));
    }
    r->draft = -1;
    /* wait (keeping their h) unless the ring is about to fill or a block is
     * full: a full block goes to the context cache, and holds every layer's
     * rows, the MTP layer's too (entry p writes its slot p + 1) */
    if (!draft && last + 1 - r->mtp_done < MTP_RING - 2 && (r->n_computed / B) * B <= r->mtp_done + 1) {
        for (int pos = first > r->mtp_done ? first : r->mtp_done; pos <= last; pos++)
            memcpy(mtp_h_slot(e, r, pos), P->hbuf + ((size_t)r->row_first + (pos - first)) * D, (size_t)D * sizeof(float));
        return;
    }
    for (int pos = r->mtp_done; pos <= last; pos++) {
        if (P->mtp_n == P->step_cap || (P->mtp_w == P->rows_cap && pos == last)) mtp_flush(e, P);
        int i = P->mtp_n++;
        mb_arrays *a = &P->mba[0];
        a->tok[i] = r->tokens[pos + 1];
        a->pos[i] = pos;
        a->tables[i] = r->blocks;
        a->want[i] = draft && pos == last;
        P->dev_of[i] = r->device;
        P->mtp_req[i] = r;
        if (a->want[i]) P->mtp_want_row[i] = P->mtp_w++;
        const float *h = pos >= first ? P->hbuf + ((size_t)r->row_first + (pos - first)) * D : mtp_h_slot(e, r, pos);
        memcpy(P->mtp_h + (size_t)i * D, h, (size_t)D * sizeof(float));
    }
    r->mtp_done = last + 1;
}

/* Runs the MTP entries of the requests a step touched, device by device. */
static void mtp_step(struct cm384_engine *e, peer *P, request **rq, const int *first, int nr, int draft) {
    for (int dev = 0; dev < e->n_dev; dev++)
        for (int i = 0; i < nr; i++) if (rq[i]->device == dev) mtp_add(e, P, rq[i], first[i], draft);
    mtp_flush(e, P);
}

/* The MTP gate (config.mtp = 1): a decode step that verifies a draft costs
 * more than a plain one -- the draft's row reads its own experts, and the
 * MTP layer and its head run after the step -- and pays back 1 + the
 * acceptance in tokens.  Decode drafts while (1 + acceptance) x plain step
 * > drafting step + MTP layer, from what its own steps measured, and when it
 * stops it tries again after MTP_PROBE steps, then twice as many each time
 * drafting still does not pay (up to 16 x); while it drafts, one step in
 * MTP_PROBE is plain.  Both costs and the acceptance stay current at little
 * cost.  Tokens do not depend on it (a draft is accepted only when
 * it is the token sampled anyway).  config.mtp = 2 drafts every step. */
#define MTP_PROBE 16
#define MTP_EWMA 0.2

/* A running estimate of a step's time on a shared machine, where noise only
 * ever adds time: the least of the first four, then a moving average that
 * takes at most twice the estimate from any one step. */
static void mtp_ewma(double *v, int *n, double x) {
    if (*n == 0 || (*n < 4 && x < *v)) *v = x;
    else if (*n >= 4) *v = (1 - MTP_EWMA) * *v + MTP_EWMA * (x < 2 * *v ? x : 2 * *v);
    (*n)++;
}

/* What the gate takes as a step's time: the measured one, or a test's clock. */
static double mtp_clock(const struct cm384_engine *e, int rows, int requests, int mtp, double measured_ms) {
    return e->dbg_step_ms ? e->dbg_step_ms(e->dbg_cycle_user, rows, requests, mtp) : measured_ms;
}

/* After a step's main model and sampling (main_ms): does the next step draft? */
static int mtp_gate(struct cm384_engine *e, peer *D, int nr, int drafted, int accepted, double main_ms) {
    if (e->cfg.mtp == 2) return 1;
    if (drafted) {
        mtp_ewma(&D->mtp_t2, &D->mtp_n2, main_ms / nr);
        double a = (double)accepted / drafted;
        D->mtp_acc = D->mtp_n2 == 1 ? a : (1 - MTP_EWMA) * D->mtp_acc + MTP_EWMA * a;
    } else mtp_ewma(&D->mtp_t1, &D->mtp_n1, main_ms / nr);
    if (D->mtp_n2 < 4 || D->mtp_nm < 4) return 1;                  /* learn both costs first */
    if (D->mtp_n1 < 4) return 0;
    if ((1 + D->mtp_acc) * D->mtp_t1 > D->mtp_t2 + D->mtp_tm) {
        D->mtp_probe_every = MTP_PROBE;
        if (++D->mtp_since_probe < MTP_PROBE) return 1;
        D->mtp_since_probe = 0;                                 /* a plain step now and then keeps t1 current */
        return 0;
    }
    if (D->mtp_probe_every < MTP_PROBE) D->mtp_probe_every = MTP_PROBE;
    if (++D->mtp_since_probe >= D->mtp_probe_every) {         /* try again, and wait longer each time it fails */
        D->mtp_since_probe = 0;
        if (D->mtp_probe_every < 16 * MTP_PROBE) D->mtp_probe_every *= 2;
        return 1;
    }
    return 0;
}

/* ---- prefill ---- */

/* A step whose work broke (region_break) fails its requests with
 * CM384_EV_ERROR before anything computed in it is sampled or cached. */
static int step_failed(struct cm384_engine *e, peer *P, request **rq, int nr) {
    if (!P->rg.broken) return 0;
    engine_log(e, 2, "internal error: %s; the step's %d request%s fail with CM384_E_INTERNAL",
               P->rg.broken, nr, nr == 1 ? "" : "s");
    for (int i = 0; i < nr; i++) {
        request *r = rq[i];
        r->n_computed = r->n_hashed * e->kv.block_tokens;     /* nothing of this step reaches the cache */
        run_remove(P, r);
        finish(e, r, CM384_EV_ERROR, CM384_E_INTERNAL);
    }
    P->rg.broken = NULL;
    return 1;
}


/* Finishes the cancelled requests among prefill's. */
static void prefill_cancellations(struct cm384_engine *e, peer *P) {
    for (int i = 0; i < P->n_run; i++) {
        request *r = P->run[i];
        if (atomic_load(&r->cancel)) { run_remove(P, r); finish(e, r, CM384_EV_CANCELLED, CM384_E_CANCELLED); i--; }
    }
    for (request **pp = &P->wait_head; *pp;) {
        request *r = *pp;
        if (atomic_load(&r->cancel)) {
            *pp = r->next;
            if (P->wait_tail == r) { P->wait_tail = NULL; for (request *q = P->wait_head; q; q = q->next) P->wait_tail = q; }
            finish(e, r, CM384_EV_CANCELLED, CM384_E_CANCELLED);
        } else {
            pp = &r->next;
        }
    }
}

/* A request with its prompt computed: its first token, then decode. */
static void prefill_done(struct cm384_engine *e, peer *P, request *r) {
    fault_request_back(e, r);                  /* a fault's request is back where it was */
    hand_off(e, r);
    run_remove(P, r);
    accept_token(e, r, r->sampled);
    if (r->n_generated >= r->samp.max_tokens || r->n_tokens >= e->max_ctx ||
        (!r->samp.ignore_eos && e->m->hp.eos >= 0 && r->tokens[r->n_tokens - 1] == e->m->hp.eos)) {
        finish(e, r, CM384_EV_DONE, CM384_OK);
        return;
    }
    give_to_decode(e, r);
}

/* One round of the prefill loop: take new requests, admit, compute up to
 * prefill_chunk prompt tokens.  Returns 1 if it did anything. */
static int prefill_round(struct cm384_engine *e, peer *P) {
    sched *S = e->sched;
    int progress = 0;
    pthread_mutex_lock(&e->mu);
    if (P->in_head) {                      /* preempted: recomputed before the new ones */
        P->in_tail->next = P->wait_head;
        if (!P->wait_head) P->wait_tail = P->in_tail;
        P->wait_head = P->in_head;
        P->in_head = P->in_tail = NULL;
    }
    while (S->inbox_head) {
        request *r = S->inbox_head;
        S->inbox_head = r->next;
        r->next = NULL;
        if (P->wait_tail) P->wait_tail->next = r; else P->wait_head = r;
        P->wait_tail = r;
    }
    S->inbox_tail = NULL;
    while (P->ready_head) {                /* the caching loop loaded their prefixes */
        request *r = P->ready_head;
        P->ready_head = r->next;
        r->next = NULL;
        if (r->device >= 0 && e->dev[r->device].failed && e->n_pre > 0) r->device = e->pre_devs[0];   /* 12b */
        P->run[P->n_run++] = r;
        progress = 1;
    }
    P->ready_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    prefill_cancellations(e, P);
    /* admission, in order */
    for (;;) {
        request *r = P->wait_head;
        if (!r) break;
        pthread_mutex_lock(&e->mu);
        int cap = atomic_load(&e->peers[LANE_DECODE].decode_cap);     /* the SLO's, else max_batch */
        int room = S->n_batch < (cap < S->max_batch ? cap : S->max_batch);
        pthread_mutex_unlock(&e->mu);
        if (!room || !admit(e, P, r)) break;
        P->wait_head = r->next;
        if (!P->wait_head) P->wait_tail = NULL;
        r->next = NULL;
        pthread_mutex_lock(&e->mu);
        S->n_batch++;
        pthread_mutex_unlock(&e->mu);
        r->in_batch = 1;
        progress = 1;
        if (r->load_n > 0) {               /* the rest of its prefix is on disk: the caching loop */
            pthread_mutex_lock(&e->mu);
            int queued = cache_push(e, (cache_job){-1, r});
            pthread_mutex_unlock(&e->mu);
            if (queued) continue;
            r->load_n = 0;                 /* no memory for the job: compute it */
        }
        P->run[P->n_run++] = r;
    }
    /* a prompt the cache served but its last token: straight to decode */
    for (int i = 0; i < P->n_run; i++) {
        request *r = P->run[i];
        if (r->n_tokens - r->n_computed != 1) continue;
        fault_request_back(e, r);
        hand_off(e, r);
        run_remove(P, r);
        give_to_decode(e, r);
        i--;
        progress = 1;
    }
    /* one chunk */
    request *rq[1024];
    int cnt[1024], first[1024], nr = 0, budget = e->cfg.prefill_chunk, rows = 0;
    for (int i = 0; i < P->n_run && budget > 0 && nr < 1024; i++) {
        request *r = P->run[i];
        int left = r->n_tokens - r->n_computed;
        int take = left < budget ? left : budget;
        if (take == left && rows >= P->rows_cap) continue;       /* no logits row left */
        r->drafting = 0;
        rq[nr] = r; cnt[nr] = take; first[nr] = r->n_computed; nr++;
        budget -= take;
        rows += take == left;
    }
    if (!nr) return progress;
    if (!e->time_shared) {
        /* short tasks only while some request is past prefill (decoding,
           or being loaded): with none, no decode step can want a worker
           before this step ends, and whole products run faster (V2-Lite-4
           INT8 prefill 1,274 -> 1,431 tok/s, when the W8A8 panels were
           still packed once per task; short tasks cut an expert's tokens) */
        int mine = 0;
        for (int i = 0; i < P->n_run; i++) mine += P->run[i]->in_batch;
        pthread_mutex_lock(&e->mu);
        P->rg.small_tasks = S->n_batch > mine;
        pthread_mutex_unlock(&e->mu);
        P->short_steps += P->rg.small_tasks;
    }
    atomic_store(&P->computing, 1);    /* before d0: a decode step it counts is never alone */
    double t0 = now_ms();
    uint64_t ns0 = now_ns(), d0 = atomic_load(&e->peers[LANE_DECODE].steps);
    P->rg.step = P->steps_begun++;
    run_phase(e, P, rq, cnt, nr);
    uint64_t overlap = atomic_load(&e->peers[LANE_DECODE].steps) - d0;     /* decode steps done meanwhile */
    if (step_failed(e, P, rq, nr)) {
        atomic_store(&P->computing, 0);
        return 1;
    }
    request *done_rq[1024];
    int nd = 0;
    uint64_t tokens = 0;
    for (int i = 0; i < nr; i++) {
        rq[i]->n_computed += cnt[i];
        tokens += (uint64_t)cnt[i];
        if (rq[i]->n_computed == rq[i]->n_tokens) done_rq[nd++] = rq[i];
    }
    sample_rows(e, P, done_rq, nd);
    for (int i = 0; i < nd; i++) done_rq[i]->tokens[done_rq[i]->n_tokens] = done_rq[i]->sampled;   /* t_P for MTP */
    if (e->mtp) mtp_step(e, P, rq, first, nr, 1);
    atomic_store(&P->computing, 0);
    if (step_failed(e, P, rq, nr)) return 1;
    for (int i = 0; i < nr; i++) offer_blocks_locked(e, rq[i]);
    trace_span(e, LANE_PREFILL, "prefill step", P->rg.step, ns0, now_ns());
    atomic_fetch_add(&P->steps, 1);
    pthread_mutex_lock(&e->mu);
    S->st.prefill_steps++;
    S->st.decode_steps_in_prefill += overlap;
    S->st.tokens_prefilled += tokens;
    S->st.prefill_seconds += (now_ms() - t0) / 1e3;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < nd; i++) prefill_done(e, P, done_rq[i]);
    return 1;
}

/* ---- decode ---- */

/* Makes sure r's block table reaches position pos, preempting the most
 * recently admitted decoding requests if the pool is full.  Returns 0, or -1
 * if r itself had to be preempted. */
static int ensure_blocks(struct cm384_engine *e, peer *D, request *r, int pos) {
    int B = e->kv.block_tokens;
    while (pos / B >= r->n_blocks) {
        pthread_mutex_lock(&e->pool_mu);
        int b = block_get(e);
        pthread_mutex_unlock(&e->pool_mu);
        if (b < 0) {
            request *victim = D->run[D->n_run - 1];
            preempt(e, D, victim, "KV pool full");
            if (victim == r) return -1;
            continue;
        }
        r->blocks[r->n_blocks++] = b;
    }
    return 0;
}

/* A request's context when it ends: what the controller must plan for,
 * since an admitted request decodes until it is done. */
static double slo_final_ctx(const struct cm384_engine *e, const request *r) {
    long n = (long)r->n_prompt + r->samp.max_tokens;
    return (double)(n < e->max_ctx ? n : e->max_ctx);
}

/* How many requests may run (be admitted) now: as many as the SLO
 * controller predicts can decode together within the target, at the
 * contexts they will reach.  Requests over the cap wait in the queue (their
 * wait is TTFT), so no running request's TPOT pays for admitting more.
 * Decode computes it after each step; prefill admits within it. */
static int slo_admit_cap(struct cm384_engine *e, peer *D) {
    if (!(e->cfg.tpot_target_ms > 0)) return e->sched->max_batch;
    double ctx = 0, per_req = 0;            /* per_req: prompt tokens to compute per generated token */
    int n = 0;
    for (int i = -1; i < D->n_run; i++) {   /* the running requests, and the next one to admit */
        double final_ctx, fresh, gen;
        if (i >= 0) {
            const request *r = D->run[i];
            final_ctx = slo_final_ctx(e, r); fresh = r->n_prompt - r->n_cached; gen = r->samp.max_tokens;
        } else {
            pthread_mutex_lock(&e->mu);                 /* prefill's queue */
            const request *w = e->peers[LANE_PREFILL].wait_head;
            if (w) { final_ctx = slo_final_ctx(e, w); fresh = w->n_prompt - w->n_cached; gen = w->samp.max_tokens; }
            pthread_mutex_unlock(&e->mu);
            if (!w) continue;
        }
        ctx += final_ctx;
        per_req += fresh / (gen > 0 ? gen : 1);
        n++;
    }
    if (!n) return atomic_load(&D->decode_cap);
    pthread_mutex_lock(&e->mu);
    int pipeline = e->sched->n_batch - D->n_run;           /* admitted, still in prefill */
    pthread_mutex_unlock(&e->mu);
    int cap = slo_choose(&D->slo, ctx / n, 0, per_req / n, pipeline > 0 ? pipeline : 0, e->sched->max_batch);
    atomic_store(&D->decode_cap, cap);              /* prefill admits within it */
    if (D->slo.infeasible && !D->slo_warned) {       /* said once, and in the stats and report */
        D->slo_warned = 1;
        engine_log(e, 2, "SLO: a TPOT of %.2f ms is infeasible here: one request alone is predicted at %.2f ms (p99)",
                   e->cfg.tpot_target_ms, slo_predict(&D->slo, 1, ctx / n, 0) * slo_p99_factor(&D->slo) / D->slo.tok_per_step);
    }
    return cap;
}

/* Feeds the controller the cycle just measured: from the end of the last
 * decode step to the end of this one (prefill work in between included). */
static void slo_after_step(struct cm384_engine *e, peer *D, request **rq, int nr, int emitted) {
    if (!(e->cfg.tpot_target_ms > 0) || nr <= 0) return;
    double t = now_ms(), ctx = 0;
    for (int i = 0; i < nr; i++) ctx += rq[i]->n_tokens;
    ctx /= nr;
    pthread_mutex_lock(&e->mu);
    uint64_t prefilled = e->sched->st.tokens_prefilled;
    pthread_mutex_unlock(&e->mu);
    double prefill = (double)(prefilled - D->slo_last_prefilled);
    double cycle = D->slo_last_end > 0 ? t - D->slo_last_end : 0;
    if (e->dbg_cycle_ms) cycle = e->dbg_cycle_ms(e->dbg_cycle_user, nr, ctx, prefill);   /* a test's clock */
    if (cycle > 0) slo_observe(&D->slo, nr, ctx, prefill, cycle, (double)emitted / nr);
    D->slo_last_end = t;
    D->slo_last_prefilled = prefilled;
}

/* After every decode step, with what it measured: the SLO controller
 * learns the cycle (and sets the batch prefill may admit), and EPLB
 * re-places decode's experts from decode's own load. */
static void decode_after_step(struct cm384_engine *e, peer *D, request **rq, int nr, int emitted) {
    slo_after_step(e, D, rq, nr, emitted);
    slo_admit_cap(e, D);
    if (e->n_red > 0 && e->cfg.eplb_period > 0 && ++D->steps_since_rebalance >= e->cfg.eplb_period) {
        const hparams *hp = &e->m->hp;
        size_t n = (size_t)(hp->n_layers + hp->n_mtp) * hp->n_routed;
        const uint64_t *decode_load = e->expert_load + n;
        for (size_t i = 0; i < n; i++) { uint64_t v = decode_load[i]; D->load_mark[i] = v - D->load_mark[i]; }
        if (eplb_rebalance(e, D->load_mark) == CM384_OK)
            engine_log(e, 1, "EPLB: experts re-placed from the load of the last %d decode steps: expert-device "
                       "load max/mean %.2f -> %.2f", e->cfg.eplb_period, e->eplb_before, e->eplb_after);
        memcpy(D->load_mark, decode_load, n * sizeof(uint64_t));
        D->steps_since_rebalance = 0;
    }
}

/* One round of the decode loop: take what prefill handed over, then one
 * step for every decoding request.  Returns 1 if it did anything. */
static int decode_round(struct cm384_engine *e, peer *D) {
    sched *S = e->sched;
    pthread_mutex_lock(&e->mu);
    while (D->in_head) {
        request *r = D->in_head;
        D->in_head = r->next;
        r->next = NULL;
        D->run[D->n_run++] = r;
    }
    D->in_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < D->n_run; i++) {
        request *r = D->run[i];
        if (atomic_load(&r->cancel)) { run_remove(D, r); finish(e, r, CM384_EV_CANCELLED, CM384_E_CANCELLED); i--; }
    }
    request *rq[4096];
    int cnt[4096], first[4096], nr = 0, rows = 0;
    for (int i = 0; i < D->n_run && rows + 2 <= D->rows_cap && nr < 4096; i++) {
        request *r = D->run[i];
        /* with a draft: rows for the last token and the draft, if both fit */
        int n = r->n_tokens;
        r->drafting = e->mtp && r->draft >= 0 && n + 1 < e->max_ctx && r->n_generated + 2 <= r->samp.max_tokens;
        int last_slot = n - 1 + (e->mtp ? 1 : 0) + r->drafting;          /* MTP writes slot n_computed */
        if (ensure_blocks(e, D, r, last_slot)) { i--; continue; }        /* r was preempted: the list shifted */
        rq[nr] = r; cnt[nr] = 1 + r->drafting; first[nr] = n - 1; nr++;
        rows += cnt[nr - 1];
    }
    /* a preemption may have removed a request already listed */
    int k = 0;
    for (int i = 0; i < nr; i++)
        if (rq[i]->stage == RQ_DECODE) { rq[k] = rq[i]; cnt[k] = cnt[i]; first[k] = first[i]; k++; }
    nr = k;
    if (!nr) return 0;
    double t0 = now_ms();
    uint64_t ns0 = now_ns();
    /* alone: no prefill step computed beside it, start to end (its speed
       is then decode's own, not a share of the workers) */
    peer *P = &e->peers[LANE_PREFILL];
    uint64_t p_steps = atomic_load(&P->steps), w0 = atomic_load(&e->weight_bytes[1]);
    int alone = !atomic_load(&P->computing);
    D->rg.step = D->steps_begun++;
    run_phase(e, D, rq, cnt, nr);
    if (step_failed(e, D, rq, nr)) return 1;
    sample_rows(e, D, rq, nr);
    uint64_t drafted = 0, accepted = 0;
    for (int i = 0; i < nr; i++) {
        request *r = rq[i];
        int n = r->n_tokens;
        r->tokens[n] = r->sampled;
        r->n_computed = n;
        if (r->drafting) {
            drafted++;
            if (r->accepted) { accepted++; r->tokens[n + 1] = r->sampled2; r->n_computed = n + 1; }
        }
    }
    if (e->mtp) {
        int rows = 0;
        for (int i = 0; i < nr; i++) rows += cnt[i];
        double t1 = now_ms();
        int draft = mtp_gate(e, D, nr, (int)drafted, (int)accepted, mtp_clock(e, rows, nr, 0, t1 - t0));
        mtp_step(e, D, rq, first, nr, draft);
        if (draft) mtp_ewma(&D->mtp_tm, &D->mtp_nm, mtp_clock(e, nr, nr, 1, now_ms() - t1) / nr);
    }
    if (step_failed(e, D, rq, nr)) return 1;
    double dt = now_ms() - t0;
    alone = alone && !atomic_load(&P->computing) && atomic_load(&P->steps) == p_steps;
    uint64_t w1 = atomic_load(&e->weight_bytes[1]);
    atomic_fetch_add(&D->steps, 1);
    trace_span(e, LANE_DECODE, "decode step", D->rg.step, ns0, now_ns());
    int emitted = nr;
    for (int i = 0; i < nr; i++) emitted += rq[i]->drafting && rq[i]->accepted;
    pthread_mutex_lock(&e->mu);
    S->st.decode_steps++;
    S->st.decode_seconds += dt / 1e3;
    S->st.mtp_drafted += drafted;
    S->st.mtp_accepted += accepted;
    if (alone) {
        S->st.decode_alone_steps++;
        S->st.decode_alone_seconds += dt / 1e3;
        S->st.decode_alone_tokens += (uint64_t)emitted;
        S->st.decode_alone_weight_bytes += w1 >= w0 ? w1 - w0 : 0;   /* a reset may fall inside the step */
    }
    pthread_mutex_unlock(&e->mu);
    decode_after_step(e, D, rq, nr, emitted);
    for (int i = 0; i < nr; i++) {
        request *r = rq[i];
        int second = r->drafting && r->accepted;
        accept_token(e, r, r->sampled);
        if (check_stop(e, D, r)) continue;
        if (second) {
            accept_token(e, r, r->sampled2);
            check_stop(e, D, r);
        }
    }
    return 1;
}

/* ---- the caching loop's jobs ---- */

static void kvf_path(const struct cm384_engine *e, uint64_t key, char *out, size_t cap) {
    snprintf(out, cap, "%s/%016llx.kv", e->cache_dir, (unsigned long long)key);
}

static kvf_expect kvf_expect_for(const struct cm384_engine *e, uint64_t key, uint64_t parent, uint32_t tenant) {
    return (kvf_expect){e->kv_fingerprint, key, parent, tenant, (uint32_t)e->kv.block_tokens, (uint32_t)e->kv.n_layers,
                        (uint32_t)e->kv.row, e->mtp ? (uint32_t)e->m->hp.dim : 0u, e->kv.bf16 ? 2u : 4u};
}

static uint8_t *cacher_buf(cacher *C, size_t n) {
    if (n > C->buf_cap) {
        uint8_t *b = CM384_MALLOC(n);
        if (!b) return NULL;
        CM384_FREE(C->buf);
        C->buf = b;
        C->buf_cap = n;
    }
    return C->buf;
}

/* Writes block b to its file (a temporary name, then renamed, so a reader
 * never sees half a file), then lets go of it. */
static void cache_save(struct cm384_engine *e, int b) {
    block_meta *bm = &e->bm[b];
    kvf_expect x = kvf_expect_for(e, bm->hash, bm->parent, bm->tenant);
    size_t pay = kvf_payload_bytes(&x), B = (size_t)e->kv.block_tokens;
    kvf_header h;
    uint8_t *buf = cacher_buf(e->cacher, sizeof h + pay);
    int ok = 0;
    if (buf) {
        uint8_t *p = buf + sizeof h;
        memcpy(p, bm->tokens, B * sizeof(int32_t));
        memcpy(p + B * sizeof(int32_t), e->kv.data + (size_t)b * e->kv.block_bytes, e->kv.block_bytes);
        if (x.h_dim) memcpy(p + B * sizeof(int32_t) + e->kv.block_bytes, e->blk_h + (size_t)b * x.h_dim,
                            (size_t)x.h_dim * sizeof(float));
        memset(&h, 0, sizeof h);
        memcpy(h.magic, KVF_MAGIC, 8);
        h.version = KVF_VERSION; h.block_tokens = x.block_tokens; h.n_layers = x.n_layers; h.row = x.row;
        h.h_dim = x.h_dim; h.tenant = x.tenant; h.fingerprint = x.fingerprint; h.key = x.key; h.parent = x.parent;
        h.payload_bytes = pay; h.checksum = kvf_checksum(p, pay);
        memcpy(buf, &h, sizeof h);
        char path[4096], tmp[4200];
        kvf_path(e, x.key, path, sizeof path);
        snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
        FILE *f = fopen(tmp, "wb");
        ok = f && fwrite(buf, 1, sizeof h + pay, f) == sizeof h + pay;
        if (f && fclose(f)) ok = 0;
        if (ok && rename(tmp, path)) ok = 0;
        if (!ok) { remove(tmp); engine_log(e, 2, "context cache: cannot write %s: %s", path, strerror(errno)); }
    }
    pthread_mutex_lock(&e->pool_mu);
    if (ok) key_set_add(&e->disk_keys, x.key);
    int owner = bm->owner;
    block_unref(e, b);
    pthread_mutex_unlock(&e->pool_mu);
    if (!ok) return;
    if (owner >= 0 && owner != e->cache_dev) fabric_count(e, PLANE_POOL, owner, e->cache_dev, pay);
    pthread_mutex_lock(&e->mu);
    e->sched->st.cache_blocks_saved++;
    e->sched->st.cache_bytes_saved += sizeof h + pay;
    pthread_mutex_unlock(&e->mu);
}

/* Reads one block's file into block `dst`; NULL or why it was not used. */
static const char *cache_read(struct cm384_engine *e, const kvf_expect *x, const int32_t *tokens, int dst) {
    char path[4096];
    kvf_path(e, x->key, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f) return "cannot be opened";
    size_t want = sizeof(kvf_header) + kvf_payload_bytes(x), got = 0, at = 0;
    uint8_t *buf = cacher_buf(e->cacher, want + 1);
    if (buf) got = fread(buf, 1, want + 1, f);            /* one byte more: a longer file is wrong too */
    fclose(f);
    if (!buf) return "no memory to read it";
    const char *why = kvf_parse(buf, got, x, &at);
    if (why) return why;
    size_t B = (size_t)x->block_tokens;
    if (memcmp(buf + at, tokens, B * sizeof(int32_t))) return "holds other tokens";
    memcpy(e->kv.data + (size_t)dst * e->kv.block_bytes, buf + at + B * sizeof(int32_t), e->kv.block_bytes);
    if (x->h_dim) memcpy(e->blk_h + (size_t)dst * x->h_dim, buf + at + B * sizeof(int32_t) + e->kv.block_bytes,
                         (size_t)x->h_dim * sizeof(float));
    return NULL;
}

/* Loads r's blocks load_first .. load_first+load_n-1 from disk, stopping at
 * the first that cannot be trusted (prefill computes from there), indexes
 * them in the pool, and gives r back to prefill. */
static void cache_load(struct cm384_engine *e, request *r) {
    int B = e->kv.block_tokens, loaded = 0;
    uint64_t parent = r->chain;
    for (int i = 0; i < r->load_n; i++) {
        int idx = r->load_first + i;
        const int32_t *tok = r->tokens + (size_t)idx * B;
        uint64_t key = block_key(parent, r->tenant, tok, B);
        kvf_expect x = kvf_expect_for(e, key, parent, r->tenant);
        const char *why = cache_read(e, &x, tok, r->blocks[idx]);
        if (why) {
            engine_log(e, 2, "context cache: %s/%016llx.kv ignored: %s", e->cache_dir, (unsigned long long)key, why);
            pthread_mutex_lock(&e->pool_mu);
            key_set_del(&e->disk_keys, key);
            pthread_mutex_unlock(&e->pool_mu);
            pthread_mutex_lock(&e->mu);
            e->sched->st.cache_files_ignored++;
            pthread_mutex_unlock(&e->mu);
            break;
        }
        parent = key;
        loaded++;
    }
    /* the loaded blocks join the pool tier, as if computed here */
    pthread_mutex_lock(&e->pool_mu);
    uint64_t k = r->chain;
    for (int i = 0; i < loaded; i++) {
        int idx = r->load_first + i;
        uint64_t key = block_key(k, r->tenant, r->tokens + (size_t)idx * B, B);
        e->bm[r->blocks[idx]].owner = r->device;
        cache_insert(e, r->blocks[idx], key, k, r->tenant, r->tokens + (size_t)idx * B);
        k = key;
    }
    pthread_mutex_unlock(&e->pool_mu);
    int before = r->n_computed;
    r->n_computed = (r->load_first + loaded) * B;
    r->n_hashed = r->load_first + loaded;
    r->chain = k;
    if (e->mtp && loaded) {
        r->mtp_done = r->n_computed - 1;
        memcpy(mtp_h_slot(e, r, r->mtp_done), e->blk_h + (size_t)r->blocks[r->load_first + loaded - 1] * e->m->hp.dim,
               (size_t)e->m->hp.dim * sizeof(float));
    }
    uint64_t bytes = (uint64_t)loaded * e->kv.block_bytes;
    if (bytes && r->device != e->cache_dev) fabric_count(e, PLANE_POOL, e->cache_dev, r->device, bytes);
    peer *P = &e->peers[LANE_PREFILL];
    pthread_mutex_lock(&e->mu);
    sched *S = e->sched;
    S->st.cache_hits_disk += (uint64_t)loaded;
    S->st.cache_misses += (uint64_t)(r->load_n - loaded);
    S->st.cache_bytes_loaded += bytes;
    if (r->n_cached == before && r->n_generated == 0) {     /* its first admission: the cache served these */
        r->n_cached = r->n_computed;
        S->st.tokens_cached += (uint64_t)(r->n_computed - before);
    }
    r->load_n = 0;
    r->next = NULL;
    if (P->ready_tail) P->ready_tail->next = r; else P->ready_head = r;
    P->ready_tail = r;
    wake_peer(e, LANE_PREFILL);
    pthread_mutex_unlock(&e->mu);
}

static void *cache_main(void *arg) {
    struct cm384_engine *e = arg;
    cacher *C = e->cacher;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (!C->n) {
            if (e->stopping && e->sched->n_live == 0) break;
            pthread_cond_wait(&C->cv, &e->mu);
            continue;
        }
        cache_job j = C->jobs[C->head];
        C->head = (C->head + 1) % C->cap;
        C->n--;
        pthread_mutex_unlock(&e->mu);
        if (j.r) cache_load(e, j.r);
        else cache_save(e, j.block);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Opens cache_dir/<fingerprint> (making it) and notes the blocks in it. */
static int cache_dir_open(struct cm384_engine *e, const char *dir) {
    const cm384_config *c = &e->cfg;
    uint64_t fp = model_fingerprint(e->m);
    fp = mix64(fp ^ (uint64_t)(c->int8 > 0) ^ (uint64_t)(c->int8_dispatch > 0) << 1 ^ (uint64_t)e->bf16_combine << 2 ^
               (uint64_t)e->mtp << 3 ^ (uint64_t)e->kv.bf16 << 4 ^ (uint64_t)e->expanded << 5 ^ (uint64_t)e->kv.block_tokens << 8 ^ (uint64_t)CORE_LANES << 24);
    fp = mix64(fp ^ hash_str(e->k->name, strlen(e->k->name)));   /* fp32 sums differ in the last bits across kernel sets */
    uint32_t slack;
    memcpy(&slack, &e->core_slack, 4);
    e->kv_fingerprint = mix64(fp ^ slack);
    size_t n = strlen(dir) + 32;
    e->cache_dir = CM384_MALLOC(n);
    if (!e->cache_dir) return fail(CM384_E_NOMEM, "out of memory");
    snprintf(e->cache_dir, n, "%s/%016llx", dir, (unsigned long long)e->kv_fingerprint);
    if (mkdir(dir, 0777) && errno != EEXIST) return fail(CM384_E_IO, "cache_dir %s: cannot make it: %s", dir, strerror(errno));
    if (mkdir(e->cache_dir, 0777) && errno != EEXIST)
        return fail(CM384_E_IO, "cache_dir %s: cannot make it: %s", e->cache_dir, strerror(errno));
    DIR *d = opendir(e->cache_dir);
    if (!d) return fail(CM384_E_IO, "cache_dir %s: cannot read it: %s", e->cache_dir, strerror(errno));
    for (struct dirent *de; (de = readdir(d));) {
        const char *nm = de->d_name;
        if (strlen(nm) != 19 || strcmp(nm + 16, ".kv")) continue;      /* 16 hex digits + ".kv" */
        uint64_t key = 0;
        int ok = 1;
        for (int i = 0; i < 16 && ok; i++) {
            int ch = nm[i], v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            ok = v >= 0;
            key = key << 4 | (uint64_t)(v < 0 ? 0 : v);
        }
        if (ok) key_set_add(&e->disk_keys, key);
    }
    closedir(d);
    e->cacher = CM384_CALLOC(1, sizeof(cacher));
    if (!e->cacher) return fail(CM384_E_NOMEM, "out of memory");
    pthread_cond_init(&e->cacher->cv, NULL);
    return CM384_OK;
}

/* ---- the loops ---- */

/* Whether a loop has anything to do (under e->mu). */
static int prefill_has_work(struct cm384_engine *e, peer *P) {
    return e->sched->inbox_head || P->in_head || P->wait_head || P->n_run || P->ready_head;
}
static int decode_has_work(peer *D) { return D->in_head || D->n_run; }

/* How long decode lends after a step of step_ns: lend times the step, and
 * with a TPOT target no more than the target leaves after the step; 0 for
 * under a microsecond. */
static uint64_t lend_budget_ns(uint64_t step_ns, double lend, double tpot_target_ms) {
    double budget = (double)step_ns * lend;
    if (tpot_target_ms > 0 && budget > tpot_target_ms * 1e6 - (double)step_ns) budget = tpot_target_ms * 1e6 - (double)step_ns;
    return budget >= 1000 ? (uint64_t)budget : 0;
}

/* Decode lends its loop's thread to prefill between steps (prefill_share).
 * Decode's tasks come first in the worker pool, so beside a busy decode
 * prefill gets only what decode leaves: on 2 cores a 512-token prompt
 * beside one decoding stream took 7x as long as alone, and requests that
 * arrive together decoded in small batches while the rest crawled through
 * prefill.  With prefill_share set, after a step of step_ns, while prefill
 * has work, decode's thread runs prefill's tasks for prefill_lend times as
 * long (the pool's workers, finding no decode task, run prefill's too), so
 * that with both peers busy the cores split prefill_share : 1 -
 * prefill_share over time.  Opt-in: where prefill holds requests that will
 * join the decode batch it pays (16 arriving together), where decode is a
 * steady batch beside one prompt at a time it mostly costs TPOT (the
 * figures: docs/how-it-works.md, section 1).  With a TPOT target, at most
 * the target's slack after the step.  decode_busy stays set, so the
 * prefill loop still does not help: the busy threads never outnumber the
 * workers.  Which thread runs a task never changes what it computes. */
static void decode_lend(struct cm384_engine *e, peer *D, uint64_t step_ns) {
    lane_pool *lp = e->lanes;
    if (e->prefill_lend <= 0 || lp->n_threads == 0 || !atomic_load_explicit(&lp->prefill_busy, memory_order_acquire)) return;
    uint64_t budget = lend_budget_ns(step_ns, e->prefill_lend, e->cfg.tpot_target_ms);
    if (!budget) return;
    uint64_t t0 = now_ns(), end = t0 + budget, t = t0, tasks = 0;
    int spins = 0;
    int64_t start = 0;
    while (t < end && atomic_load_explicit(&lp->prefill_busy, memory_order_acquire)) {
        int ran = lane_try(lp, LANE_PREFILL, D->rg.caller);
        if (ran == 1) tasks++, spins = 0, start = 0;
        else if (!ran && !gl_spin(&spins, &start, lp->oversubscribed)) sched_yield();   /* prefill between regions */
        t = now_ns();
    }
    trace_span(e, LANE_DECODE, "lent to prefill", D->steps_begun - 1, t0, t);
    pthread_mutex_lock(&e->mu);
    e->sched->st.prefill_lent_seconds += (double)(t - t0) / 1e9;
    e->sched->st.prefill_lent_tasks += tasks;
    pthread_mutex_unlock(&e->mu);
}

/* A peer's loop: rounds while it has work, asleep otherwise.  A round that
 * could not move (the pool or the batch is full) waits for a request to
 * finish.  Every loop stops once the engine is stopping and every request
 * has had its final event. */
static void peer_loop(struct cm384_engine *e, peer *P) {
    sched *S = e->sched;
    int stalled = 0;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->stopping)
            for (int i = 0; i < S->n_live; i++) atomic_store(&S->live[i]->cancel, 1);
        if (faults_due(e)) {                         /* 12b: between rounds, with the peers paused */
            pthread_mutex_unlock(&e->mu);
            faults_apply_due(e);
            pthread_mutex_lock(&e->mu);
            continue;
        }
        int work = P->lane == LANE_PREFILL ? prefill_has_work(e, P) : decode_has_work(P);
        unsigned seen = P->wakes;
        if (!work || stalled) {
            if (P->lane == LANE_PREFILL) atomic_store(&e->lanes->prefill_busy, 0);
            if (P->lane == LANE_DECODE) {
                atomic_store(&e->lanes->decode_busy, 0);
                P->slo_last_end = 0;                 /* an idle gap is not a decode cycle */
            }
            if (!work && e->stopping && S->n_live == 0) break;
            pthread_cond_wait(&P->cv, &e->mu);
            stalled = 0;
            continue;
        }
        atomic_store(P->lane == LANE_DECODE ? &e->lanes->decode_busy : &e->lanes->prefill_busy, 1);
        pthread_mutex_unlock(&e->mu);
        pthread_mutex_lock(&P->step_mu);
        uint64_t t_round = now_ns();
        int moved = P->lane == LANE_PREFILL ? prefill_round(e, P) : decode_round(e, P);
        pthread_mutex_unlock(&P->step_mu);
        if (P->lane == LANE_DECODE && moved) decode_lend(e, P, now_ns() - t_round);
        pthread_mutex_lock(&e->mu);
        stalled = !moved && P->wakes == seen;        /* nothing moved and nobody said why it might now */
    }
    atomic_store(P->lane == LANE_DECODE ? &e->lanes->decode_busy : &e->lanes->prefill_busy, 0);
    pthread_cond_broadcast(&e->peers[LANE_PREFILL + LANE_DECODE - P->lane].cv);   /* the other may exit too */
    pthread_mutex_unlock(&e->mu);
}

/* The time-shared loop: a prefill step, then a decode step. */
static void shared_loop(struct cm384_engine *e) {
    sched *S = e->sched;
    peer *P = &e->peers[LANE_PREFILL], *D = &e->peers[LANE_DECODE];
    int stalled = 0;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->stopping)
            for (int i = 0; i < S->n_live; i++) atomic_store(&S->live[i]->cancel, 1);
        if (faults_due(e)) {
            pthread_mutex_unlock(&e->mu);
            faults_apply_due(e);
            pthread_mutex_lock(&e->mu);
            continue;
        }
        int work = prefill_has_work(e, P) || decode_has_work(D);
        unsigned seen = P->wakes;
        if (!work || stalled) {
            if (!work && e->stopping && S->n_live == 0) break;
            pthread_cond_wait(&P->cv, &e->mu);
            stalled = 0;
            continue;
        }
        pthread_mutex_unlock(&e->mu);
        pthread_mutex_lock(&P->step_mu);
        pthread_mutex_lock(&D->step_mu);
        int moved = prefill_round(e, P);
        moved |= decode_round(e, D);
        pthread_mutex_unlock(&D->step_mu);
        pthread_mutex_unlock(&P->step_mu);
        pthread_mutex_lock(&e->mu);
        stalled = !moved && P->wakes == seen;
    }
    pthread_mutex_unlock(&e->mu);
}

static void *prefill_main(void *arg) {
    struct cm384_engine *e = arg;
    if (e->time_shared) shared_loop(e);
    else peer_loop(e, &e->peers[LANE_PREFILL]);
    return NULL;
}

static void *decode_main(void *arg) {
    struct cm384_engine *e = arg;
    peer_loop(e, &e->peers[LANE_DECODE]);
    return NULL;
}

/* Stops both peers between steps (prefill's lock first, as the time-shared
 * loop takes them): what their steps write can then be read. */
static void peers_pause(struct cm384_engine *e) {
    pthread_mutex_lock(&e->peers[LANE_PREFILL].step_mu);
    pthread_mutex_lock(&e->peers[LANE_DECODE].step_mu);
}

static void peers_resume(struct cm384_engine *e) {
    pthread_mutex_unlock(&e->peers[LANE_DECODE].step_mu);
    pthread_mutex_unlock(&e->peers[LANE_PREFILL].step_mu);
}

/* ======================================================================== */
/* 12b. Faults: a device dies, the supernode recovers                       */
/* ======================================================================== */
/* This section owns failure: which devices are dead, what each fault took
 * and how the engine got it back.  A fault is applied between steps, with
 * both peers paused (peers_pause), by whichever loop reaches its boundary
 * first -- cm384_fail_device only queues it -- so no step ever sees a
 * half-dead device.  Recovery reuses the paths requests already have:
 *   - the roles' device lists (pre_devs, attn_devs, exp_devs) lose the
 *     device, so admission, hand-off and EPLB only see the living;
 *   - an expert device's experts are re-placed by EPLB over the surviving
 *     expert devices (a surviving replica takes over, or the weights are
 *     read again from the pool);
 *   - a request whose KV was on the device gives its blocks back without
 *     offering them to the cache (they are lost) and goes to the front of
 *     prefill's queue, like a preemption: admission finds what the context
 *     cache holds of it and prefill recomputes the rest, sampling nothing
 *     new until it is back where it was, so its tokens do not change;
 *   - a caching device takes the cache index with it; another idle device
 *     starts an empty one;
 *   - a link fault makes one step's dispatch messages to or from the
 *     device vanish; the receivers' check (moe_receive_check) finds the
 *     missing rows and the senders write them again.
 * When a role needed by every request (prefill, decode attention, experts)
 * has no device left, the engine fails: pending requests end with
 * CM384_EV_ERROR / CM384_E_DEVICE and submissions are refused. */

typedef struct fault_rec {
    cm384_fault_info info;
    uint64_t         t0_ns;        /* when it hit                                 */
    int              pending;      /* requests it hit not yet back where they were */
    int              open;         /* recovery not finished                       */
} fault_rec;

typedef struct fault_due { int device, kind; uint64_t step; } fault_due;

static uint64_t engine_steps(struct cm384_engine *e) {
    return atomic_load(&e->peers[LANE_PREFILL].steps) + atomic_load(&e->peers[LANE_DECODE].steps);
}

/* A span on a device's own track (its fault and recovery). */
static void trace_device_span(struct cm384_engine *e, int device, const char *name, uint64_t t0, uint64_t t1) {
    if (!e->trace) return;
    pthread_mutex_lock(&e->trace_mu);
    if (e->n_tev == e->cap_tev) trace_flush(e);
    e->tev[e->n_tev++] = (trace_event){.device = device, .layer = -1, .lane = -1, .step = -1, .name = name,
                                       .t0 = t0, .t1 = t1 > t0 ? t1 : t0 + 1000};
    pthread_mutex_unlock(&e->trace_mu);
}

/* Ends a fault's recovery (under e->mu). */
static void fault_close(struct cm384_engine *e, fault_rec *f) {
    if (!f->open) return;
    uint64_t t1 = now_ns();
    f->open = 0;
    f->info.recovery_ms = (double)(t1 - f->t0_ns) / 1e6;
    if (f->info.recovery_ms > e->sched->st.fault_recovery_ms_max) e->sched->st.fault_recovery_ms_max = f->info.recovery_ms;
    trace_device_span(e, f->info.device, f->info.kind == CM384_FAULT_LINK ? "link fault: retried" : "fault: recovery",
                      f->t0_ns, t1);
    engine_log(e, 1, "fault on device %d (%s) recovered in %.2f ms: %d request%s re-admitted, %llu tokens recomputed, "
               "%d experts re-placed from the weights, %d left to a replica, %llu messages retried",
               f->info.device, f->info.roles, f->info.recovery_ms, f->info.requests_readmitted,
               f->info.requests_readmitted == 1 ? "" : "s", (unsigned long long)f->info.tokens_recomputed,
               f->info.experts_replaced, f->info.experts_failed_over, (unsigned long long)f->info.messages_retried);
}

/* A request a fault hit is back where it was (its prompt recomputed), or
 * ended. */
static void fault_request_back(struct cm384_engine *e, request *r) {
    if (!r->fault) return;
    pthread_mutex_lock(&e->mu);
    fault_rec *f = &e->faults[r->fault - 1];
    r->fault = 0;
    if (--f->pending <= 0) fault_close(e, f);
    pthread_mutex_unlock(&e->mu);
}

/* At admission: the tokens a fault's request computes again (what the
 * context cache did not keep). */
static void fault_count_recompute(struct cm384_engine *e, request *r, int kept_tokens) {
    if (!r->fault || r->fault_counted) return;
    r->fault_counted = 1;
    uint64_t n = r->n_tokens > kept_tokens ? (uint64_t)(r->n_tokens - kept_tokens) : 0;
    pthread_mutex_lock(&e->mu);
    e->faults[r->fault - 1].info.tokens_recomputed += n;
    e->sched->st.tokens_recomputed += n;
    pthread_mutex_unlock(&e->mu);
}

/* r's KV is gone with a device: its blocks go back without being offered to
 * the cache, and it waits at the front of prefill's queue (peers paused). */
static void fault_lose_request(struct cm384_engine *e, request *r, int fault) {
    peer *P = &e->peers[LANE_PREFILL];
    pthread_mutex_lock(&e->pool_mu);
    for (int b = 0; b < r->n_blocks; b++) block_unref(e, r->blocks[b]);
    if (r->stage == RQ_DECODE && r->device >= 0) e->dev[r->device].n_owned--;
    pthread_mutex_unlock(&e->pool_mu);
    r->n_blocks = 0; r->n_computed = 0; r->n_hashed = 0; r->chain = 0; r->mtp_done = 0; r->draft = -1; r->device = -1;
    r->stage = RQ_WAITING;
    pthread_mutex_lock(&e->mu);
    r->next = P->in_head;
    P->in_head = r;
    if (!P->in_tail) P->in_tail = r;
    if (r->in_batch) e->sched->n_batch--;
    r->in_batch = 0;
    fault_rec *f = &e->faults[fault];
    if (r->fault) {                                /* an earlier fault's request: this one owns it now */
        fault_rec *g = &e->faults[r->fault - 1];
        if (--g->pending <= 0) fault_close(e, g);
    }
    r->fault = fault + 1;
    r->fault_counted = 0;
    f->pending++;
    f->info.requests_readmitted++;
    e->sched->st.requests_readmitted++;
    pthread_mutex_unlock(&e->mu);
}

/* Drops device d from a role's device list; returns 1 if it was there. */
static int fault_drop_from(int *devs, int *n, int d) {
    for (int i = 0; i < *n; i++)
        if (devs[i] == d) { memmove(devs + i, devs + i + 1, (size_t)(*n - i - 1) * sizeof(int)); (*n)--; return 1; }
    return 0;
}

/* Decode's expert roles and replica counts, from its placement. */
static void fault_expert_roles(struct cm384_engine *e) {
    const hparams *hp = &e->m->hp;
    const placement *p = &e->place[PHASE_DECODE];
    for (int d = 0; d < e->n_dev; d++) { e->dev[d].roles &= ~(unsigned)ROLE_EXPERT; e->dev[d].n_hosted = 0; }
    for (int l = 0; l < hp->n_layers + hp->n_mtp; l++)
        if (hp->n_routed > 0 && e->m->layers[l].is_moe) {
            const int *dd = pl_dev(p, l);
            for (int i = 0; i < hp->n_routed * p->max_rep; i++)
                if (dd[i] >= 0) { e->dev[dd[i]].roles |= ROLE_EXPERT; e->dev[dd[i]].n_hosted++; }
            break;
        }
}

/* An expert device is gone: prefill's and decode's experts that lived there
 * move to the survivors.  Returns 0, or -1 if no expert device is left. */
static int fault_replace_experts(struct cm384_engine *e, int d, fault_rec *f) {
    const hparams *hp = &e->m->hp;
    int E = hp->n_routed, NL = hp->n_layers + hp->n_mtp;
    placement *p = &e->place[PHASE_DECODE];
    int mr = p->max_rep;
    if (!fault_drop_from(e->exp_devs, &e->n_exp_devs, d) && !(e->dev[d].roles & ROLE_SHARED)) return 0;
    fault_drop_from(e->red_devs, &e->n_red, d);
    if (e->n_exp_devs == 0) return -1;
    while (e->n_exp_devs * e->exp_cap < E) e->exp_cap++;            /* the survivors take more slots each */
    size_t slots = (size_t)e->n_exp_devs * e->exp_cap;
    struct eplb_item *items = CM384_MALLOC(slots * sizeof *items);   /* EPLB's scratch for the new shape */
    uint64_t *load = CM384_MALLOC((size_t)NL * E * sizeof(uint64_t));
    if (!items || !load) { CM384_FREE(items); CM384_FREE(load); return -2; }
    CM384_FREE(e->eplb_items);
    e->eplb_items = items;
    for (int l = 0; l < NL; l++) {
        if (!e->m->layers[l].is_moe) continue;
        int *dev = pl_dev(p, l), *nrep = pl_nrep(p, l, E);
        for (int x = 0; x < E; x++) {
            int dead = 0;
            for (int q = 0; q < nrep[x]; q++) dead += dev[x * mr + q] == d;
            if (dead) { if (dead < nrep[x]) f->info.experts_failed_over++; else f->info.experts_replaced++; }
        }
        /* the shared expert's replicas: to a surviving shared device, else an expert device */
        for (int j = 0; j < p->n_shared; j++) {
            int *sd = &dev[E * mr + j];
            if (*sd != d) continue;
            int to = e->exp_devs[j % e->n_exp_devs];
            for (int k = 0; k < p->n_shared; k++) if (dev[E * mr + k] != d) { to = dev[E * mr + k]; break; }
            *sd = to;
        }
    }
    /* EPLB over the survivors, from all of decode's load so far (+1: an
       expert nobody used yet still needs a slot) */
    const uint64_t *decode_load = e->expert_load + (size_t)NL * E;
    for (size_t i = 0; i < (size_t)NL * E; i++) load[i] = decode_load[i] + 1;
    eplb_rebalance(e, load);
    CM384_FREE(load);
    fault_expert_roles(e);
    /* prefill's experts live on the prefill devices, not here */
    return 0;
}

/* Prefill's expert placement over the surviving prefill devices. */
static void fault_prefill_placement(struct cm384_engine *e, int d, fault_rec *f) {
    const hparams *hp = &e->m->hp;
    placement *p = &e->place[PHASE_PREFILL];
    for (int l = 0; l < hp->n_layers + hp->n_mtp; l++) {
        int *pd = pl_dev(p, l);
        for (int x = 0; x < hp->n_routed; x++) {
            if (e->m->layers[l].is_moe && pd[x] == d) f->info.experts_replaced++;
            pd[x] = e->pre_devs[x % e->n_pre];
        }
        pl_sort(p, l);
    }
}

/* The caching device is gone with the cache index it held (under pool_mu):
 * lookups miss from now on; blocks requests still hold stay theirs. */
static void fault_lose_cache(struct cm384_engine *e) {
    for (int i = 0; i < e->index_cap; i++) {
        int b = e->index[i];
        if (b < 0) continue;
        e->index[i] = -1;
        block_meta *m = &e->bm[b];
        if (m->ref == 1) lru_unlink(e, b);
        m->cached = 0;
        if (--m->ref == 0) e->free_blocks[e->n_free++] = b;
    }
    e->n_cached = 0;
    e->lru_head = e->lru_tail = -1;
    if (e->disk_keys.k) memset(e->disk_keys.k, 0, (size_t)e->disk_keys.cap * sizeof(uint64_t));
    e->disk_keys.n = 0;
}

static const char *fault_kind_name(int kind) { return kind == CM384_FAULT_LINK ? "link" : "device"; }

/* Applies one fault (both peers paused, e->mu not held). */
static void fault_apply(struct cm384_engine *e, int d, int kind, uint64_t step) {
    peer *P = &e->peers[LANE_PREFILL], *D = &e->peers[LANE_DECODE];
    if (e->dev[d].failed || e->fatal) return;              /* already dead */
    pthread_mutex_lock(&e->mu);
    if (e->n_faults == e->cap_faults) {
        int cap = e->cap_faults ? 2 * e->cap_faults : 16;
        fault_rec *fr = realloc(e->faults, (size_t)cap * sizeof *fr);
        if (!fr) { pthread_mutex_unlock(&e->mu); engine_log(e, 2, "fault on device %d: no memory to record it; ignored", d); return; }
        e->faults = fr;
        e->cap_faults = cap;
    }
    int fi = e->n_faults++;
    fault_rec *f = &e->faults[fi];
    memset(f, 0, sizeof *f);
    f->info.struct_size = sizeof f->info;
    f->info.device = d;
    f->info.kind = kind;
    snprintf(f->info.roles, sizeof f->info.roles, "%s", role_name(e->dev[d].roles));
    f->info.step = step;
    f->info.recovery_ms = -1;
    f->t0_ns = now_ns();
    f->open = 1;
    e->sched->st.n_faults++;
    pthread_mutex_unlock(&e->mu);
    engine_log(e, 1, "fault: %s %d (%s) fails at step %llu", fault_kind_name(kind), d, f->info.roles,
               (unsigned long long)step);
    if (kind == CM384_FAULT_LINK) {                        /* the next step that runs picks it up */
        e->link_arm_fault = fi;
        atomic_store(&e->link_arm, d);
        return;
    }
    unsigned roles = e->dev[d].roles;
    e->dev[d].failed = 1;
    e->dev[d].had_roles = roles;
    const char *lost = NULL;
    /* prefill: its half-computed prompts start again on the others */
    if (fault_drop_from(e->pre_devs, &e->n_pre, d)) {
        if (e->n_pre == 0) lost = "prefill";
        else {
            fault_prefill_placement(e, d, f);
            for (int i = 0; i < P->n_run; i++)
                if (P->run[i]->device == d) { request *r = P->run[i]; run_remove(P, r); fault_lose_request(e, r, fi); i--; }
        }
    }
    /* decode attention: its requests' KV is gone */
    if (!lost && fault_drop_from(e->attn_devs, &e->n_attn, d)) {
        if (e->n_attn == 0) lost = "decode attention";
        else {
            for (int i = 0; i < D->n_run; i++)
                if (D->run[i]->device == d) { request *r = D->run[i]; run_remove(D, r); fault_lose_request(e, r, fi); i--; }
            pthread_mutex_lock(&e->mu);                    /* handed off, not yet taken */
            request *keep = NULL, *keep_tail = NULL, *gone = NULL;
            for (request *r = D->in_head, *nx; r; r = nx) {
                nx = r->next;
                r->next = NULL;
                if (r->device == d) { r->next = gone; gone = r; }
                else { if (keep_tail) keep_tail->next = r; else keep = r; keep_tail = r; }
            }
            D->in_head = keep; D->in_tail = keep_tail;
            pthread_mutex_unlock(&e->mu);
            for (request *r = gone, *nx; r; r = nx) { nx = r->next; r->next = NULL; fault_lose_request(e, r, fi); }
        }
    }
    /* experts */
    if (!lost && (roles & (ROLE_EXPERT | ROLE_SHARED))) {
        int r = fault_replace_experts(e, d, f);
        if (r == -1) lost = "expert";
        else if (r == -2) engine_log(e, 2, "fault on device %d: no memory to re-place its experts; they stay where they were", d);
    }
    /* caching: the index it held is gone; another idle device starts over */
    if (roles & ROLE_CACHE) {
        pthread_mutex_lock(&e->pool_mu);
        fault_lose_cache(e);
        int to = -1;
        for (int k = e->n_dev - 1; k >= 0 && to < 0; k--) if (!e->dev[k].roles && !e->dev[k].failed) to = k;
        if (to >= 0) { e->cache_dev = to; e->dev[to].roles |= ROLE_CACHE; }
        else e->cache_blocks_max = 0;                      /* no device left to hold a cache */
        pthread_mutex_unlock(&e->pool_mu);
        if (to >= 0) engine_log(e, 1, "fault: the context cache on device %d is lost; device %d starts an empty one", d, to);
        else engine_log(e, 1, "fault: the context cache on device %d is lost; no idle device is left: caching is off", d);
    }
    e->dev[d].roles = 0;
    e->dev[d].n_hosted = 0;
    pthread_mutex_lock(&e->mu);
    e->sched->st.experts_replaced += (uint64_t)f->info.experts_replaced;
    e->sched->st.experts_failed_over += (uint64_t)f->info.experts_failed_over;
    if (lost) {                                            /* nothing can serve a request now */
        f->info.fatal = 1;
        e->fatal = CM384_E_DEVICE;
        snprintf(e->fatal_why, sizeof e->fatal_why, "no %s device survives (device %d failed)", lost, d);
        sched *S = e->sched;
        for (int i = 0; i < S->n_live; i++)
            if (!atomic_exchange(&S->live[i]->cancel, 1)) S->live[i]->fatal = 1;
        wake_peer(e, LANE_PREFILL);
        wake_peer(e, LANE_DECODE);
        f->pending = 0;
        fault_close(e, f);
    } else if (f->pending == 0) {
        fault_close(e, f);                                 /* nothing to recompute: re-placed already */
    } else {
        wake_peer(e, LANE_PREFILL);
    }
    pthread_mutex_unlock(&e->mu);
    if (lost) engine_log(e, 2, "fault: %s; pending requests end with CM384_E_DEVICE", e->fatal_why);
}

/* The loops, between rounds, holding e->mu: a scheduled fault whose step
 * has come?  Then apply it (and any others due) with the peers paused. */
static int faults_due(struct cm384_engine *e) {
    return e->n_due > 0 && e->due[0].step <= engine_steps(e);
}

static void faults_apply_due(struct cm384_engine *e) {
    peers_pause(e);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        if (!faults_due(e)) { pthread_mutex_unlock(&e->mu); break; }
        fault_due fd = e->due[0];
        memmove(e->due, e->due + 1, (size_t)(e->n_due - 1) * sizeof *e->due);
        e->n_due--;
        pthread_mutex_unlock(&e->mu);
        fault_apply(e, fd.device, fd.kind, engine_steps(e));
    }
    peers_resume(e);
}

/* run_phase's start and end: a link fault armed by fault_apply drops the
 * messages of the first step that sends any over that link, and only that
 * step's (a step that sends none passes it on to the next). */
static void link_step_begin(struct cm384_engine *e, int phase) {
    if (atomic_load_explicit(&e->link_arm, memory_order_relaxed) < 0) return;
    int d = atomic_exchange(&e->link_arm, -1);
    if (d < 0) return;
    e->link_fault[phase] = e->link_arm_fault;
    atomic_store(&e->link_retried[phase], 0);
    atomic_store(&e->link_drop[phase], d);
}

static void link_step_end(struct cm384_engine *e, int phase) {
    int d = atomic_load_explicit(&e->link_drop[phase], memory_order_relaxed);
    if (d < 0) return;
    atomic_store(&e->link_drop[phase], -1);
    uint64_t n = atomic_exchange(&e->link_retried[phase], 0);
    if (!n && (e->dev[d].roles & (ROLE_PREFILL | ROLE_ATTN | ROLE_EXPERT | ROLE_SHARED)) && !e->dev[d].failed) {
        e->link_arm_fault = e->link_fault[phase];          /* nothing crossed it this step: the next one */
        atomic_store(&e->link_arm, d);
        return;
    }
    pthread_mutex_lock(&e->mu);
    fault_rec *f = &e->faults[e->link_fault[phase]];
    f->info.messages_retried += n;
    e->sched->st.messages_retried += n;
    fault_close(e, f);
    pthread_mutex_unlock(&e->mu);
}

static int fault_args(cm384_engine *e, int device, int kind, const char *fn) {
    if (!e) return fail(CM384_E_INVALID, "%s: NULL engine", fn);
    if (device < 0 || device >= e->n_dev)
        return fail(CM384_E_INVALID, "%s: no device %d (the engine has %d)", fn, device, e->n_dev);
    if (kind != CM384_FAULT_DEVICE && kind != CM384_FAULT_LINK)
        return fail(CM384_E_INVALID, "%s: kind %d is neither CM384_FAULT_DEVICE nor CM384_FAULT_LINK", fn, kind);
    return CM384_OK;
}

int cm384_fail_device_at(cm384_engine *e, int device, int kind, uint64_t step) {
    int r = fault_args(e, device, kind, "cm384_fail_device");
    if (r) return r;
    pthread_mutex_lock(&e->mu);
    if (e->dev[device].failed) {
        pthread_mutex_unlock(&e->mu);
        return fail(CM384_E_MISUSE, "cm384_fail_device: device %d has already failed", device);
    }
    if (e->n_due == e->cap_due) {
        int cap = e->cap_due ? 2 * e->cap_due : 16;
        fault_due *q = realloc(e->due, (size_t)cap * sizeof *q);
        if (!q) { pthread_mutex_unlock(&e->mu); return fail(CM384_E_NOMEM, "out of memory"); }
        e->due = q;
        e->cap_due = cap;
    }
    int at = e->n_due;                                     /* in step order, ties in call order */
    while (at > 0 && e->due[at - 1].step > step) at--;
    memmove(e->due + at + 1, e->due + at, (size_t)(e->n_due - at) * sizeof *e->due);
    e->due[at] = (fault_due){device, kind, step};
    e->n_due++;
    wake_peer(e, LANE_PREFILL);                            /* an idle loop applies it too */
    wake_peer(e, LANE_DECODE);
    pthread_mutex_unlock(&e->mu);
    return CM384_OK;
}

int cm384_fail_device(cm384_engine *e, int device, int kind) {
    return cm384_fail_device_at(e, device, kind, 0);
}

int cm384_get_faults(cm384_engine *e, cm384_fault_info *out, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_faults: NULL engine");
    if (cap > 0 && !out) return fail(CM384_E_INVALID, "cm384_get_faults: NULL out with cap %d", cap);
    pthread_mutex_lock(&e->mu);
    int n = e->n_faults;
    for (int i = 0; i < n && i < cap; i++) {
        size_t sz = out[i].struct_size && out[i].struct_size < sizeof out[i] ? out[i].struct_size : sizeof out[i];
        cm384_fault_info fi = e->faults[i].info;
        fi.struct_size = sz;
        memcpy(&out[i], &fi, sz);
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* ======================================================================== */
/* 13. Observability: stats, report, trace                                  */
/* ======================================================================== */

int cm384_get_stats(cm384_engine *e, cm384_stats *out) {
    if (!e || !out) return fail(CM384_E_INVALID, "cm384_get_stats: NULL argument");
    size_t sz = out->struct_size && out->struct_size < sizeof *out ? out->struct_size : sizeof *out;
    sched *S = e->sched;
    cm384_stats st;
    /* every counter in S->st is written under e->mu (the peers add theirs
       with stat_add or under it) */
    pthread_mutex_lock(&e->mu);
    st = S->st;
    st.ttft_p50_ms = pct(S->ttft, S->n_ttft, 0.50);
    st.ttft_p99_ms = pct(S->ttft, S->n_ttft, 0.99);
    st.tpot_p50_ms = pct(S->tpot, S->n_tpot, 0.50);
    st.tpot_p99_ms = pct(S->tpot, S->n_tpot, 0.99);
    pthread_mutex_unlock(&e->mu);
    st.struct_size = sizeof st;
    uint64_t prompt = st.tokens_prefilled + st.tokens_cached;
    st.cache_hit_ratio = prompt ? (double)st.tokens_cached / (double)prompt : 0;
    st.prefill_tok_per_s = st.prefill_seconds > 0 ? st.tokens_prefilled / st.prefill_seconds : 0;
    st.decode_tok_per_s = st.decode_seconds > 0 ? st.tokens_decoded / st.decode_seconds : 0;
    st.dispatch_bytes = atomic_load(&e->dispatch_bytes);
    st.dispatch_bytes_bf16 = atomic_load(&e->dispatch_bytes_bf16);
    st.combine_bytes = atomic_load(&e->combine_bytes);
    st.combine_bytes_bf16 = atomic_load(&e->combine_bytes_bf16);
    st.messages = atomic_load(&e->n_messages);
    st.kv_handoff_bytes = atomic_load(&e->kv_handoff_bytes);
    st.local_bytes = atomic_load(&e->local_bytes);
    st.pool_bytes = e->pool_bytes;
    st.kv_blocks_total = (uint64_t)e->kv.n_blocks;
    pthread_mutex_lock(&e->pool_mu);
    st.kv_blocks_used = (uint64_t)(e->kv.n_blocks - e->n_free);
    st.kv_blocks_cached = (uint64_t)e->n_cached;
    st.cache_evictions = e->n_evictions;
    pthread_mutex_unlock(&e->pool_mu);
    peer *D = &e->peers[LANE_DECODE];
    pthread_mutex_lock(&D->step_mu);                 /* decode's step writes the loads, SLO and EPLB; faults the roles */
    for (int d = 0; d < e->n_dev; d++) {
        st.n_caching_devices += (e->dev[d].roles & ROLE_CACHE) != 0;
        st.n_idle_devices += e->dev[d].roles == 0 && !e->dev[d].failed;
        st.n_failed_devices += e->dev[d].failed;
    }
    st.decode_batch_cap = atomic_load(&D->decode_cap);
    st.slo_infeasible = D->slo.infeasible;
    st.prefill_weight_bytes = atomic_load_explicit(&e->weight_bytes[0], memory_order_relaxed);
    st.decode_weight_bytes = atomic_load_explicit(&e->weight_bytes[1], memory_order_relaxed);
    for (int i = 0; i < CM384_ROOF_ROWS; i++) {
        st.decode_roof_bytes[i] = atomic_load_explicit(&e->roof_bytes[i], memory_order_relaxed);
        st.decode_roof_macs[i] = atomic_load_explicit(&e->roof_macs[i], memory_order_relaxed);
    }
    st.decode_roof_core_flops = atomic_load_explicit(&e->roof_core_flops, memory_order_relaxed);
    /* decode rows on the routed-expert devices, layer by layer: a layer's
       dispatch waits for its busiest device */
    double sum_max = 0, sum_mean = 0;
    int n_exp = 0;
    for (int d = 0; d < e->n_dev; d++) if (e->dev[d].roles & (ROLE_EXPERT | ROLE_SHARED)) n_exp++;
    for (int l = 0; l < e->m->hp.n_layers + e->m->hp.n_mtp && e->n_exp_devs > 0; l++) {
        const uint64_t *rows = e->dev_rows_layer + (size_t)l * e->n_dev;
        uint64_t mx = 0, sum = 0;
        for (int i = 0; i < e->n_exp_devs; i++) { uint64_t v = rows[e->exp_devs[i]]; sum += v; if (v > mx) mx = v; }
        sum_max += (double)mx;
        sum_mean += (double)sum / e->n_exp_devs;
    }
    st.eplb_runs = e->eplb_runs;
    st.eplb_load_before = e->eplb_before;
    st.eplb_load_after = e->eplb_after;
    st.eplb_moved_bytes = e->eplb_moved_bytes;
    st.n_redundant_experts = e->n_red;
    pthread_mutex_unlock(&D->step_mu);
    st.expert_load_max_over_mean = sum_mean > 0 ? sum_max / sum_mean : 0;
    st.n_devices = e->n_dev;
    st.n_workers = e->n_workers;
    st.n_prefill_devices = e->n_pre;
    st.n_attn_devices = e->n_attn;
    st.n_expert_devices = n_exp;
    st.struct_size = sz;
    st.mem_weight_bytes = e->mem[0];
    st.mem_int8_weight_bytes = e->mem[1];
    st.mem_kv_bytes = e->mem[2];
    st.mem_scratch_bytes = e->mem[3];
    st.mem_total_bytes = e->mem[4];
    st.mem_physical_bytes = e->m->phys_mem;
    memcpy(out, &st, sz);
    out->struct_size = sz;
    return CM384_OK;
}

static int single_device_roles(unsigned roles) {
    return roles == (ROLE_PREFILL | ROLE_ATTN | ROLE_EXPERT | ROLE_CACHE);
}

static const char *role_name(unsigned roles) {
    static const char *names[16] = {"idle", "prefill", "attention", "prefill+attention", "expert",
        "prefill+expert", "attention+expert", "all", "shared", "prefill+shared", "attention+shared",
        "prefill+attention+shared", "expert+shared", "prefill+expert+shared", "attention+expert+shared", "all"};
    static const char *with_cache[16] = {"caching", "prefill+caching", "attention+caching",
        "prefill+attention+caching", "expert+caching", "prefill+expert+caching", "attention+expert+caching",
        "all+caching", "shared+caching", "prefill+shared+caching", "attention+shared+caching",
        "prefill+attention+shared+caching", "expert+shared+caching", "prefill+expert+shared+caching",
        "attention+expert+shared+caching", "all+caching"};
    if (single_device_roles(roles)) return "all";
    return (roles & ROLE_CACHE ? with_cache : names)[roles & 15];
}

int cm384_get_plane_traffic(cm384_engine *e, int plane, uint64_t *bytes, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_plane_traffic: NULL engine");
    if (plane < PLANE_UB || plane > PLANE_POOL) return fail(CM384_E_INVALID, "cm384_get_plane_traffic: no plane %d", plane);
    size_t n = (size_t)e->n_dev * e->n_dev;
    for (size_t i = 0; bytes && i < n && i < (size_t)(cap > 0 ? cap : 0); i++)
        bytes[i] = atomic_load_explicit(&e->traffic[plane][i], memory_order_relaxed);
    return e->n_dev;
}

int cm384_get_traffic(cm384_engine *e, uint64_t *bytes, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_traffic: NULL engine");
    return cm384_get_plane_traffic(e, PLANE_UB, bytes, cap);
}

int cm384_get_expert_load(cm384_engine *e, int layer, uint64_t *tokens, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_expert_load: NULL engine");
    const hparams *hp = &e->m->hp;
    int E = hp->n_routed, NL = hp->n_layers + hp->n_mtp;
    if (layer < -1 || layer >= NL) return fail(CM384_E_INVALID, "cm384_get_expert_load: no layer %d", layer);
    peers_pause(e);
    for (int x = 0; tokens && x < E && x < cap; x++) {
        uint64_t v = 0;
        for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? NL : layer + 1); l++)
            v += e->expert_load[(size_t)l * E + x] + e->expert_load[((size_t)NL + l) * E + x];   /* both phases */
        tokens[x] = v;
    }
    peers_resume(e);
    return E;
}

int cm384_get_device_busy(cm384_engine *e, double *busy_ms, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_device_busy: NULL engine");
    peers_pause(e);
    for (int d = 0; busy_ms && d < e->n_dev && d < cap; d++) {
        uint64_t ns = 0;
        for (int w = 0; w <= e->n_workers; w++) ns += e->busy[(size_t)w * e->n_dev + d];
        busy_ms[d] = ns / 1e6;
    }
    peers_resume(e);
    return e->n_dev;
}

int cm384_get_device_rows(cm384_engine *e, int phase, uint64_t *rows, int cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_get_device_rows: NULL engine");
    if (phase < -1 || phase > 1) return fail(CM384_E_INVALID, "cm384_get_device_rows: phase %d is not -1, 0 or 1", phase);
    peers_pause(e);
    for (int d = 0; rows && d < e->n_dev && d < cap; d++)
        rows[d] = phase < 0 ? e->dev_rows[d] + e->dev_rows[(size_t)e->n_dev + d] : e->dev_rows[(size_t)phase * e->n_dev + d];
    peers_resume(e);
    return e->n_dev;
}

const char *cm384_device_roles(cm384_engine *e, int device) {
    if (!e || device < 0 || device >= e->n_dev) return "";
    peers_pause(e);                                  /* faults change roles between steps */
    const char *name = e->dev[device].failed ? "failed" : role_name(e->dev[device].roles);
    peers_resume(e);
    return name;
}

void cm384_reset_stats(cm384_engine *e) {
    if (!e) return;
    sched *S = e->sched;
    peers_pause(e);
    pthread_mutex_lock(&e->mu);
    memset(&S->st, 0, sizeof S->st);
    S->n_ttft = S->n_tpot = 0;
    pthread_mutex_unlock(&e->mu);
    atomic_store(&e->dispatch_bytes, 0); atomic_store(&e->dispatch_bytes_bf16, 0);
    atomic_store(&e->combine_bytes, 0); atomic_store(&e->combine_bytes_bf16, 0);
    atomic_store(&e->n_messages, 0);
    atomic_store(&e->kv_handoff_bytes, 0);
    for (int p = 0; p < 3; p++)
        for (size_t i = 0; i < (size_t)e->n_dev * e->n_dev; i++) atomic_store(&e->traffic[p][i], 0);
    atomic_store(&e->local_bytes, 0);
    memset(e->busy, 0, (size_t)(e->n_workers + 1) * e->n_dev * sizeof(uint64_t));
    memset(e->dev_rows, 0, 2 * (size_t)e->n_dev * sizeof(uint64_t));
    memset(e->dev_rows_layer, 0, (size_t)(e->m->hp.n_layers + e->m->hp.n_mtp) * e->n_dev * sizeof(uint64_t));
    atomic_store(&e->weight_bytes[0], 0);
    atomic_store(&e->weight_bytes[1], 0);
    for (int i = 0; i < CM384_ROOF_ROWS; i++) atomic_store(&e->roof_bytes[i], 0), atomic_store(&e->roof_macs[i], 0);
    atomic_store(&e->roof_core_flops, 0);
    size_t n_load = (size_t)(e->m->hp.n_layers + e->m->hp.n_mtp) * (size_t)(e->m->hp.n_routed > 0 ? e->m->hp.n_routed : 1);
    memset(e->expert_load, 0, 2 * n_load * sizeof(uint64_t));
    memset(e->peers[LANE_DECODE].load_mark, 0, n_load * sizeof(uint64_t));
    pthread_mutex_lock(&e->prof_mu);
    e->n_prof = 0;
    pthread_mutex_unlock(&e->prof_mu);
    peers_resume(e);
}

int cm384_get_profile(cm384_engine *e, cm384_stage_time *out, int cap) {
    if (!e || cap < 0 || (cap > 0 && !out))
        return fail(CM384_E_INVALID, "cm384_get_profile: engine NULL, cap < 0 or out NULL with cap > 0");
    if (!e->prof) return fail(CM384_E_MISUSE, "cm384_get_profile: the engine was created without config.profile");
    /* rows are kept by the strings' addresses (cheap on the step's path);
       here the same text, should a compiler keep two copies, is one row */
    struct stage_row rows[PROFILE_ROWS];
    int n = 0;
    pthread_mutex_lock(&e->prof_mu);
    for (int i = 0; i < e->n_prof; i++) {
        const struct stage_row *p = &e->prof[i];
        int j = 0;
        while (j < n && !(rows[j].phase == p->phase && !strcmp(rows[j].name ? rows[j].name : "", p->name ? p->name : "") &&
                          !strcmp(rows[j].op ? rows[j].op : "", p->op ? p->op : "")))
            j++;
        if (j == n) rows[n++] = *p;
        else { rows[j].ns += p->ns; rows[j].regions += p->regions; }
    }
    pthread_mutex_unlock(&e->prof_mu);
    for (int i = 0; i < n && i < cap; i++)
        out[i] = (cm384_stage_time){rows[i].phase == PHASE_DECODE ? CM384_PHASE_DECODE : CM384_PHASE_PREFILL,
                                    rows[i].name ? rows[i].name : "", rows[i].op ? rows[i].op : "", rows[i].ns / 1e9,
                                    rows[i].regions};
    return n;
}


static void sb_printf(strbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void sb_printf(strbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n <= 0) return;
    if ((size_t)n < sizeof tmp) { sb_putn(b, tmp, (size_t)n); return; }
    char *big = malloc((size_t)n + 1);          /* a long line: format it again, whole */
    if (!big) { b->oom = 1; return; }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_putn(b, big, (size_t)n);
    free(big);
}

static double mb_of(uint64_t b) { return (double)b / 1e6; }

int cm384_report(cm384_engine *e, char *buf, size_t cap) {
    if (!e) return fail(CM384_E_INVALID, "cm384_report: NULL engine");
    cm384_stats st;
    st.struct_size = sizeof st;
    cm384_get_stats(e, &st);
    strbuf b = {0};
    sb_printf(&b, "supernode: %d devices, preset %s, %d workers: %d prefill, %d decode-attention, %d expert, %d caching; "
              "%d idle\n", st.n_devices, e->preset, st.n_workers, st.n_prefill_devices, st.n_attn_devices,
              st.n_expert_devices, st.n_caching_devices, st.n_idle_devices);
    {   /* why the devices are used as they are */
        const hparams *hp = &e->m->hp;
        int E = hp->n_routed;
        if (!strcmp(e->preset, "single"))
            sb_printf(&b, "  layout: one device does everything (the reference topology); the other %d are idle\n", e->n_dev - 1);
        else if (!strcmp(e->preset, "paper"))
            sb_printf(&b, "  layout: CloudMatrix-Infer's, scaled to this model's %d experts: decode EP%d/DP%d (%d routed + %d shared "
                      "replicas + %d redundant, one per device, attention data-parallel over the same devices), prefill EP%d; "
                      "at DeepSeek-V3 scale (256 experts, top-8) it is the paper's EP320 decode and a 32-device prefill "
                      "instance%s\n", E, e->n_attn, e->n_attn, E, e->place[PHASE_DECODE].n_shared, e->n_red, e->n_pre,
                      E == 256 ? " -- as here" : "");
        else
            sb_printf(&b, "  layout: fastest on this host: %d prefill and %d attention devices (one per worker), %d expert "
                      "devices (%s); %d idle devices have nothing to hold\n", e->n_pre, e->n_attn, st.n_expert_devices,
                      st.n_expert_devices == E ? "one per routed expert: this model has no more to spread" : "experts shared out",
                      st.n_idle_devices);
    }
    sb_printf(&b, "numerics: %s%s%s%s%s%s\n",
              e->cfg.int8 || e->cfg.int8_dispatch || e->bf16_combine || e->kv.bf16 || e->k->dot_rows_tp_bf16 ?
              "approximations on:" :
              "exact (weights as stored, fp32 dispatch, combine and KV cache: the reference's results)",
              e->cfg.int8 ? " INT8 W8A8 weights" : "", e->cfg.int8_dispatch ? " INT8 dispatch" : "",
              e->bf16_combine ? " BF16 combine" : "", e->kv.bf16 ? " BF16 KV cache" : "",
              !e->k->dot_rows_tp_bf16 ? "" : core_native(e) ? " native BF16 products (bf16 weights, attention core)" :
              " native BF16 products (bf16 weights)");
    if (e->expanded)
        sb_printf(&b, "  prefill attends expanded (K and V per head, DeepSeek's naive MLA; decode absorbed: other rounding)\n");
    sb_printf(&b, "requests: %llu done, %llu cancelled, %llu failed, %llu preempted\n",
              (unsigned long long)st.requests_done, (unsigned long long)st.requests_cancelled,
              (unsigned long long)st.requests_failed, (unsigned long long)st.requests_preempted);
    sb_printf(&b, "tokens: %llu prefilled, %llu from context cache (hit ratio %.1f%%), %llu decoded\n",
              (unsigned long long)st.tokens_prefilled, (unsigned long long)st.tokens_cached,
              100 * st.cache_hit_ratio, (unsigned long long)st.tokens_decoded);
    sb_printf(&b, "throughput: prefill %.1f tok/s, decode %.1f tok/s (busy time)\n",
              st.prefill_tok_per_s, st.decode_tok_per_s);
    if (st.mtp_drafted)
        sb_printf(&b, "MTP: %llu drafts, %llu accepted (%.1f%%): %.2f tokens per decode step per request\n",
                  (unsigned long long)st.mtp_drafted, (unsigned long long)st.mtp_accepted,
                  100.0 * st.mtp_accepted / st.mtp_drafted, 1.0 + (double)st.mtp_accepted / st.mtp_drafted);
    sb_printf(&b, "latency: TTFT p50 %.1f ms p99 %.1f ms, TPOT p50 %.2f ms p99 %.2f ms\n",
              st.ttft_p50_ms, st.ttft_p99_ms, st.tpot_p50_ms, st.tpot_p99_ms);
    if (e->cfg.tpot_target_ms > 0)
        sb_printf(&b, "SLO: TPOT target %.2f ms, decode batch %d%s\n", e->cfg.tpot_target_ms, st.decode_batch_cap,
                  st.slo_infeasible ? " (infeasible: one request alone misses the target)" : "");
    sb_printf(&b, "fabric, UB plane: dispatch %.2f MB (%s; bf16 would be %.2f MB), combine %.2f MB (%s; bf16 %.2f MB), "
              "%llu messages; %.2f MB written by devices to themselves (local, not fabric)\n",
              mb_of(st.dispatch_bytes), e->cfg.int8_dispatch ? "INT8" : "fp32", mb_of(st.dispatch_bytes_bf16),
              mb_of(st.combine_bytes), e->bf16_combine ? "BF16" : "fp32", mb_of(st.combine_bytes_bf16),
              (unsigned long long)st.messages, mb_of(st.local_bytes));
    sb_printf(&b, "fabric, RDMA plane: KV hand-off prefill -> decode %.2f MB", mb_of(st.kv_handoff_bytes));
    sb_puts(&b, " (the blocks change owner in the shared pool)\n");
    if (e->trace) {
        pthread_mutex_lock(&e->trace_mu);
        uint64_t written = e->trace_written + (uint64_t)e->n_tev, lost = e->trace_lost;
        pthread_mutex_unlock(&e->trace_mu);
        sb_printf(&b, "trace: %llu events so far, %llu lost (the file refused them)\n",
                  (unsigned long long)written, (unsigned long long)lost);
    }
    sb_printf(&b, "pool: %.1f MB, KV blocks %llu used / %llu (%llu cached)\n", mb_of(st.pool_bytes),
              (unsigned long long)st.kv_blocks_used, (unsigned long long)st.kv_blocks_total,
              (unsigned long long)st.kv_blocks_cached);
    sb_printf(&b, "context cache (blocks looked up): %llu found in memory (shared in place), %llu loaded from disk "
              "(%.2f MB), %llu computed; %llu evicted; %llu saved to disk (%.2f MB), %llu files not trusted%s%s\n",
              (unsigned long long)st.cache_hits_pool, (unsigned long long)st.cache_hits_disk, mb_of(st.cache_bytes_loaded),
              (unsigned long long)st.cache_misses, (unsigned long long)st.cache_evictions,
              (unsigned long long)st.cache_blocks_saved, mb_of(st.cache_bytes_saved),
              (unsigned long long)st.cache_files_ignored, e->cache_dir ? "; disk tier " : "", e->cache_dir ? e->cache_dir : "");
    if (st.n_faults)
        sb_printf(&b, "faults: %llu (%d device%s dead%s%s); %llu requests re-admitted, %llu tokens recomputed, %llu experts "
                  "re-placed from the weights, %llu left to a replica, %llu messages retried; slowest recovery %.2f ms\n",
                  (unsigned long long)st.n_faults, st.n_failed_devices, st.n_failed_devices == 1 ? "" : "s",
                  e->fatal ? "; " : "", e->fatal ? e->fatal_why : "", (unsigned long long)st.requests_readmitted,
                  (unsigned long long)st.tokens_recomputed, (unsigned long long)st.experts_replaced,
                  (unsigned long long)st.experts_failed_over, (unsigned long long)st.messages_retried,
                  st.fault_recovery_ms_max);
    if (e->time_shared) sb_printf(&b, "peers: one time-shared loop");
    else if (e->prefill_lend > 0)
        sb_printf(&b, "peers: prefill and decode loops side by side, decode first, lending prefill %.0f%% of the time "
                  "while both have work (%.2f s, %llu tasks)", 100 * e->cfg.prefill_share, st.prefill_lent_seconds,
                  (unsigned long long)st.prefill_lent_tasks);
    else sb_printf(&b, "peers: prefill and decode loops side by side, decode first");
    sb_printf(&b, "; %llu prefill steps, %llu decode steps, %llu decode steps ran inside prefill steps\n",
              (unsigned long long)st.prefill_steps, (unsigned long long)st.decode_steps,
              (unsigned long long)st.decode_steps_in_prefill);
    if (st.decode_alone_steps && st.decode_alone_seconds > 0)
        sb_printf(&b, "decode alone (no prefill step beside it): %llu steps, %.1f tok/s, weights read at %.2f GB/s\n",
                  (unsigned long long)st.decode_alone_steps, st.decode_alone_tokens / st.decode_alone_seconds,
                  st.decode_alone_weight_bytes / st.decode_alone_seconds / 1e9);
    /* traffic by role pair, per plane */
    {
        static const char *plane_name[3] = {"UB", "RDMA", "memory pool"};
        uint64_t (*by)[32] = CM384_CALLOC(32 * 32, sizeof(uint64_t));
        for (int p = 0; by && p < 3; p++) {
            memset(by, 0, 32 * 32 * sizeof(uint64_t));
            uint64_t any = 0;
            for (int s = 0; s < e->n_dev; s++)
                for (int d = 0; d < e->n_dev; d++) {
                    uint64_t v = atomic_load_explicit(&e->traffic[p][(size_t)s * e->n_dev + d], memory_order_relaxed);
                    const device *ds = &e->dev[s], *dd = &e->dev[d];     /* a dead device: what it was */
                    by[(ds->failed ? ds->had_roles : ds->roles) & 31][(dd->failed ? dd->had_roles : dd->roles) & 31] += v;
                    any += v;
                }
            if (!any) continue;
            sb_printf(&b, "traffic on the %s plane by role (MB, rows send, columns receive):\n", plane_name[p]);
            for (int s = 0; s < 32; s++)
                for (int d = 0; d < 32; d++)
                    if (by[s][d]) sb_printf(&b, "  %-24s -> %-24s %10.2f\n", role_name((unsigned)s), role_name((unsigned)d), mb_of(by[s][d]));
        }
        CM384_FREE(by);
    }
    /* expert devices */
    sb_printf(&b, "expert load: max/mean decode rows over routed-expert devices %.2f\n", st.expert_load_max_over_mean);
    if (st.n_redundant_experts > 0)
        sb_printf(&b, "EPLB: %d redundant experts, %llu re-placements%s", st.n_redundant_experts,
                  (unsigned long long)st.eplb_runs, st.eplb_runs ? "" : "\n");
    if (st.n_redundant_experts > 0 && st.eplb_runs)
        sb_printf(&b, ", the last: device load max/mean %.2f -> %.2f; %.1f MB of expert weights moved in all\n",
                  st.eplb_load_before, st.eplb_load_after, mb_of(st.eplb_moved_bytes));
    {
        const hparams *hp = &e->m->hp;
        int E = hp->n_routed, NL = hp->n_layers + hp->n_mtp;
        if (E > 0) {
            sb_printf(&b, "  tokens per expert, summed over layers (top 8):\n");
            uint64_t *tot = CM384_CALLOC((size_t)E, sizeof(uint64_t));
            if (tot) {
                for (int l = 0; l < 2 * NL; l++) for (int x = 0; x < E; x++) tot[x] += e->expert_load[(size_t)l * E + x];
                unsigned char shown[1024] = {0};
                for (int i = 0; i < 8 && i < E; i++) {
                    int best = -1;
                    for (int x = 0; x < E; x++) if (!shown[x] && (best < 0 || tot[x] > tot[best])) best = x;
                    shown[best] = 1;
                    sb_printf(&b, "    expert %4d  %10llu\n", best, (unsigned long long)tot[best]);
                }
                CM384_FREE(tot);
            }
        }
    }
    /* busiest devices */
    {
        uint64_t *busy = CM384_CALLOC((size_t)e->n_dev, sizeof(uint64_t));
        if (busy) {
            for (int w = 0; w <= e->n_workers; w++)
                for (int d = 0; d < e->n_dev; d++) busy[d] += e->busy[(size_t)w * e->n_dev + d];
            sb_printf(&b, "busiest devices (busy ms):\n");
            unsigned char *shown = CM384_CALLOC((size_t)e->n_dev, 1);
            for (int i = 0; shown && i < 6 && i < e->n_dev; i++) {
                int best = -1;
                for (int d = 0; d < e->n_dev; d++) if (!shown[d] && (best < 0 || busy[d] > busy[best])) best = d;
                shown[best] = 1;
                if (!busy[best]) break;
                sb_printf(&b, "  device %3d %-18s %10.1f\n", best, e->dev[best].failed ? "failed" : role_name(e->dev[best].roles),
                          busy[best] / 1e6);
            }
            CM384_FREE(shown);
            CM384_FREE(busy);
        }
    }
    if (b.oom) { free(b.p); return fail(CM384_E_NOMEM, "out of memory"); }
    int n = copy_out(b.p ? b.p : "", b.n, buf, cap);
    free(b.p);
    return n;
}

/* Chrome trace: one track (tid) per device, one complete event per device
 * per region group; opens in Perfetto / chrome://tracing.  Events are
 * buffered and streamed to the file whenever the buffer fills, so a long run
 * keeps all of them; a write the file refuses is counted (trace_lost, in the
 * report), never silently dropped. */
static void trace_open(struct cm384_engine *e) {
    int n = fprintf(e->trace, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n"
                    "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"cm384 supernode (%s)\"}}",
                    e->preset);
    if (n < 0) e->trace_lost++;
}

static void trace_flush(struct cm384_engine *e) {
    FILE *f = e->trace;
    if (!f) { e->n_tev = 0; return; }
    for (int i = 0; i < e->n_tev; i++) {
        const trace_event *ev = &e->tev[i];
        if (ev->t1 < ev->t0 || ev->t0 == UINT64_MAX) continue;     /* a group that ran no task */
        int ok = 1;
        if (!e->trace_named[ev->device] && ev->device >= e->n_dev) {     /* a peer's own track */
            e->trace_named[ev->device] = 1;
            ok = fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"name\":\"%s loop\"}}",
                         ev->device, ev->device - e->n_dev == LANE_DECODE ? "decode" : "prefill") >= 0;
        } else if (!e->trace_named[ev->device]) {
            e->trace_named[ev->device] = 1;
            ok = fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"name\":\"device %d (%s)\"}}",
                         ev->device, ev->device, role_name(e->dev[ev->device].failed ? e->dev[ev->device].had_roles
                                                                                     : e->dev[ev->device].roles)) >= 0;
        }
        /* args: a device's event says its layer, microbatch and the step
           (peer and number) it ran in; a peer's step span its number */
        char step[96] = "";
        int sl = 0;
        if (ev->step >= 0 && ev->device < e->n_dev)
            sl = snprintf(step, sizeof step, ",\"peer\":\"%s\",\"step\":%lld", ev->lane == LANE_DECODE ? "decode" : "prefill",
                          (long long)ev->step);
        if (ev->op && ev->device < e->n_dev && sl >= 0 && (size_t)sl < sizeof step)
            snprintf(step + sl, sizeof step - (size_t)sl, ",\"op\":\"%s\"", ev->op);
        if (ev->device >= e->n_dev)
            ok &= fprintf(f, ",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%lld}}",
                          ev->name ? ev->name : "?", ev->device, (ev->t0 - e->t_origin) / 1e3, (ev->t1 - ev->t0) / 1e3,
                          (long long)ev->step) >= 0;
        else
            ok &= fprintf(f, ",\n{\"name\":\"%s\",\"cat\":\"mb%d\",\"ph\":\"X\",\"pid\":0,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                             "\"args\":{\"layer\":%d,\"microbatch\":%d%s}}",
                          ev->name ? ev->name : "?", ev->mb, ev->device, (ev->t0 - e->t_origin) / 1e3,
                          (ev->t1 - ev->t0) / 1e3, ev->layer, ev->mb, step) >= 0;
        if (ok) e->trace_written++; else e->trace_lost++;
    }
    e->n_tev = 0;
}

static void trace_close(struct cm384_engine *e) {
    if (!e->trace) return;
    trace_flush(e);
    if (fprintf(e->trace, "\n]}\n") < 0) e->trace_lost++;
    if (fclose(e->trace) != 0) e->trace_lost++;
    e->trace = NULL;
}

/* ======================================================================== */
/* 14. The public API                                                       */
/* ======================================================================== */

void cm384_config_init(cm384_config *c) {
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->n_devices = 384;
    c->preset = "default";
    c->int8_dispatch = -1;          /* the preset's choice: on in "paper" only */
}

void cm384_request_init(cm384_request *r) {
    memset(r, 0, sizeof *r);
    r->struct_size = sizeof *r;
}

void cm384_engine_free(cm384_engine *e) {
    if (!e) return;
    if (e->peers) {
        pthread_mutex_lock(&e->mu);
        e->stopping = 1;
        for (int L = 0; L < N_LANES; L++) pthread_cond_broadcast(&e->peers[L].cv);
        pthread_mutex_unlock(&e->mu);
        for (int L = 0; L < N_LANES; L++) if (e->peers[L].started) pthread_join(e->peers[L].thread, NULL);
    }
    if (e->cacher) {
        if (e->cacher->started) {
            pthread_mutex_lock(&e->mu);
            pthread_cond_signal(&e->cacher->cv);
            pthread_mutex_unlock(&e->mu);
            pthread_join(e->cacher->thread, NULL);
        }
        pthread_cond_destroy(&e->cacher->cv);
        CM384_FREE(e->cacher->jobs);
        CM384_FREE(e->cacher->buf);
        CM384_FREE(e->cacher);
    }
    CM384_FREE(e->cache_dir);
    CM384_FREE(e->disk_keys.k);
    trace_close(e);
    gl_pool_free(e->pool_threads);
    lane_pool_free(e->lanes);
    sched *S = e->sched;
    if (S) {
        for (int i = 0; i < S->n_live; i++) request_free(S->live[i]);
        CM384_FREE(S->live);
        CM384_FREE(S->done);
        CM384_FREE(S);
    }
    for (int L = 0; e->peers && L < N_LANES; L++) {
        peer *P = &e->peers[L];
        CM384_FREE(P->run);
        CM384_FREE(P->load_mark);
        CM384_FREE(P->rg.g);
        pthread_mutex_destroy(&P->step_mu);
        pthread_cond_destroy(&P->cv);
    }
    CM384_FREE(e->peers);
    pl_free(&e->place[0]);
    pl_free(&e->place[1]);
    CM384_FREE(e->dev); CM384_FREE(e->pre_devs); CM384_FREE(e->attn_devs); CM384_FREE(e->red_devs);
    CM384_FREE(e->exp_devs);
    CM384_FREE(e->eplb_ld); CM384_FREE(e->eplb_items); CM384_FREE(e->eplb_used); CM384_FREE(e->eplb_old);
    CM384_FREE(e->pool);
    for (int p = 0; p < 3; p++) CM384_FREE(e->traffic[p]);
    CM384_FREE(e->busy);
    CM384_FREE(e->expert_load); CM384_FREE(e->dev_rows); CM384_FREE(e->dev_rows_layer);
    CM384_FREE(e->tev); CM384_FREE(e->trace_named);
    free(e->faults); free(e->due);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->pool_mu);
    pthread_mutex_destroy(&e->trace_mu);
    pthread_mutex_destroy(&e->prof_mu);
    CM384_FREE(e->prof);
    pthread_cond_destroy(&e->cv_done);
    CM384_FREE(e);
}

/* Checks every config field against its documented range (naming the field
 * in the message) and replaces 0 (and int8_dispatch's -1) by the default. */
static int config_resolve(cm384_config *c, const hparams *hp, const char *preset) {
    if (strcmp(preset, "default") && strcmp(preset, "paper") && strcmp(preset, "single"))
        return fail(CM384_E_INVALID, "config.preset \"%s\" is not a preset (default, paper, single)", preset);
    int paper = !strcmp(preset, "paper");
#define RANGE(field, lo, hi)                                                                      \
    if (c->field < (lo) || c->field > (hi))                                                      \
        return fail(CM384_E_INVALID, "config." #field " = %d is outside [%d, %d]", (int)c->field, (int)(lo), (int)(hi))
    RANGE(n_devices, 0, 4096);
    RANGE(n_workers, 0, 1024);
    RANGE(max_ctx, 0, hp->max_pos);
    RANGE(max_batch, 0, 4096);
    RANGE(kv_block_tokens, 0, 4096);
    RANGE(prefill_chunk, 0, 65536);
    RANGE(int8, 0, 1);
    RANGE(int8_dispatch, -1, 1);
    RANGE(microbatches, 0, 2);
    RANGE(mtp, 0, 2);
    RANGE(eplb_period, -1, 1000000);
    RANGE(bf16_combine, -1, 1);
    RANGE(time_shared, 0, 1);
    RANGE(kv_bf16, 0, 1);
    RANGE(prefill_expanded, 0, 1);
    RANGE(prefault, 0, 1);
    RANGE(profile, 0, 1);
#undef RANGE
    if (!(c->tpot_target_ms >= 0) || isinf(c->tpot_target_ms))
        return fail(CM384_E_INVALID, "config.tpot_target_ms = %g is not a finite value >= 0", c->tpot_target_ms);
    if (!(c->prefill_share >= 0 && c->prefill_share <= 0.9))
        return fail(CM384_E_INVALID, "config.prefill_share = %g is outside [0, 0.9]", c->prefill_share);
    if (c->n_devices == 0) c->n_devices = 384;
    if (c->n_workers == 0) c->n_workers = gl_n_cpus();
    if (c->max_ctx == 0) c->max_ctx = hp->max_pos < 4096 ? hp->max_pos : 4096;
    if (c->max_ctx < 2) return fail(CM384_E_INVALID, "config.max_ctx = %d: at least 2 tokens are needed", c->max_ctx);
    if (c->max_batch == 0) c->max_batch = 64;
    if (c->kv_block_tokens == 0) c->kv_block_tokens = 16;
    if (c->prefill_chunk == 0) c->prefill_chunk = 512;
    /* a step never holds more prompt than every request's context: no
     * scratch for tokens that cannot exist */
    if ((long long)c->prefill_chunk > (long long)c->max_batch * c->max_ctx) c->prefill_chunk = c->max_batch * c->max_ctx;
    if (c->microbatches == 0) c->microbatches = paper ? 2 : 1;
    if (c->int8_dispatch < 0) c->int8_dispatch = paper;     /* an approximation: only the paper preset's default */
    if (c->eplb_period == 0) c->eplb_period = 32;
    return CM384_OK;
}

/* A peer's working memory: scratch for two microbatches, logits, the
 * sampling candidates and the step's row arrays. */
static void carve_peer(struct cm384_engine *e, peer *P, carver *c, int n_entries) {
    const hparams *hp = &e->m->hp;
    int V = hp->vocab, cap = P->step_cap, W = e->n_workers + 1;          /* + the prefill loop's thread */
    int max_groups = e->n_dev < cap ? e->n_dev : cap;
    int n_jobs = 3 * max_groups + 2 * n_entries + 8;
    for (int i = 0; i < 2; i++) scratch_carve(c, &P->s[i], hp, cap, e->kv.block_tokens, W, n_entries, n_jobs, e->expanded);
    P->logits = carve(c, (size_t)P->rows_cap * V * sizeof(float));
    P->cands = carve(c, (size_t)W * V * sizeof(cand));
    for (int i = 0; i < 2; i++) {
        P->mba[i].tok = carve(c, (size_t)cap * sizeof(int32_t));
        P->mba[i].pos = carve(c, (size_t)cap * sizeof(int));
        P->mba[i].tables = carve(c, (size_t)cap * sizeof(int *));
        P->mba[i].want = carve(c, (size_t)cap);
        P->mba[i].groups = carve(c, ((size_t)max_groups + 1) * sizeof(dev_group));
    }
    P->dev_of = carve(c, (size_t)cap * sizeof(int));
    if (e->mtp) {
        P->hbuf = carve(c, (size_t)cap * hp->dim * sizeof(float));
        P->mtp_h = carve(c, (size_t)cap * hp->dim * sizeof(float));
        P->mtp_req = carve(c, (size_t)cap * sizeof(request *));
        P->mtp_want_row = carve(c, (size_t)cap * sizeof(int));
    }
    P->rg.cap = 2 * (2 * n_entries + 4 * max_groups) + P->rows_cap + 64;
}

/* Lays out the whole pool (twice: once to size it, once to carve it). */
static void carve_pool(struct cm384_engine *e, carver *c) {
    const hparams *hp = &e->m->hp;
    int B = e->kv.block_tokens, NB = e->kv.n_blocks;
    int n_entries = e->place[0].n_entries > e->place[1].n_entries ? e->place[0].n_entries : e->place[1].n_entries;
    e->kv.data = carve(c, (size_t)NB * e->kv.block_bytes);
    e->bm = carve(c, (size_t)NB * sizeof(block_meta));
    int32_t *toks = carve(c, (size_t)NB * B * sizeof(int32_t));
    e->free_blocks = carve(c, (size_t)NB * sizeof(int));
    e->index = carve(c, (size_t)e->index_cap * sizeof(int));
    for (int L = 0; L < N_LANES; L++) carve_peer(e, &e->peers[L], c, n_entries);
    if (e->mtp) e->blk_h = carve(c, (size_t)NB * hp->dim * sizeof(float));
    if (c->base) {
        for (int b = 0; b < NB; b++) {
            e->bm[b] = (block_meta){0, 0, 0, 0, 0, -1, -1, -1, toks + (size_t)b * B};
            e->free_blocks[b] = NB - 1 - b;
        }
        e->n_free = NB;
        for (int i = 0; i < e->index_cap; i++) e->index[i] = -1;
    }
}

/* "12.3 MB", "31.4 GB" (decimal units, as disks and model cards count). */
static void human_bytes(char out[16], uint64_t b) {
    if (b >= 1000000000ull) snprintf(out, 16, "%.1f GB", b / 1e9);
    else if (b >= 1000000ull) snprintf(out, 16, "%.1f MB", b / 1e6);
    else snprintf(out, 16, "%.1f kB", b / 1e3);
}

/* What the engine will keep resident once all of it has been used: the
 * weights as this engine reads them (INT8 copies replace the projections'
 * stored bytes), the KV pool, the rest of the pool and the counters.  Said
 * in the log, and as a warning when it exceeds physical memory -- with what
 * INT8 weights would need when they are off. */
static void memory_estimate(struct cm384_engine *e, int tracing) {
    const cm384_model *m = e->m;
    const hparams *hp = &m->hp;
    uint64_t nd = (uint64_t)e->n_dev, NL = (uint64_t)(hp->n_layers + hp->n_mtp), E = hp->n_routed > 0 ? (uint64_t)hp->n_routed : 1;
    uint64_t own = m->a.total;                               /* fp32 vectors, derived W_uk^T, headers */
    uint64_t w_stored = m->weight_bytes + own;
    uint64_t kept = m->weight_bytes > m->q8_replaced ? m->weight_bytes - m->q8_replaced : 0;   /* embedding, routers */
    uint64_t w_int8 = kept + m->q8_bytes + own;
    uint64_t kv = (uint64_t)e->kv.n_blocks * e->kv.block_bytes;
    uint64_t counters = 3 * nd * nd * sizeof(uint64_t) + (uint64_t)e->n_workers * nd * sizeof(double) +
                        2 * NL * E * sizeof(uint64_t) + (2 + NL) * nd * sizeof(uint64_t) +
                        (uint64_t)(e->peers[0].rg.cap + e->peers[1].rg.cap) * sizeof(rg_group) +
                        (tracing ? (uint64_t)TRACE_BUF_EVENTS * sizeof(trace_event) : 0);
    uint64_t scratch = (uint64_t)e->pool_bytes - kv + counters;
    uint64_t w = e->cfg.int8 ? w_int8 : w_stored;
    e->mem[0] = w; e->mem[1] = w_int8; e->mem[2] = kv; e->mem[3] = scratch; e->mem[4] = w + kv + scratch;
    char t[16], wb[16], kb[16], sb[16], pb[16], ib[16];
    human_bytes(t, e->mem[4]); human_bytes(wb, w); human_bytes(kb, kv); human_bytes(sb, scratch);
    human_bytes(pb, m->phys_mem); human_bytes(ib, w_int8 + kv + scratch);
    const char *as = e->cfg.int8 ? " in INT8" : " as stored";
    snprintf(e->mem_line, sizeof e->mem_line, "memory estimate %s resident (weights %s%s, KV pool %s, scratch %s) "
             "of %s physical", t, wb, as, kb, sb, pb);
    if (m->phys_mem && e->mem[4] > m->phys_mem)
        engine_log(e, 2, "resident memory estimate %s (weights %s%s, KV pool %s, scratch %s) exceeds physical memory "
                   "%s: expect paging, and decoding at the disk's speed%s%s", t, wb, as, kb, sb, pb,
                   e->cfg.int8 ? "" : "; with INT8 weights (int8 = 1) it would be ", e->cfg.int8 ? "" : ib);
}

int cm384_engine_create(const cm384_model *m, const cm384_config *cfg, cm384_engine **out) {
    if (out) *out = NULL;
    if (!m || !out) return fail(CM384_E_INVALID, "cm384_engine_create: model and out must not be NULL");
    if (m->tokenizer_only)
        return fail(CM384_E_MISUSE, "%s: a tokenizer-only model has no weights; load a model directory to create an engine", m->path);
    if (m->config_only)
        return fail(CM384_E_MISUSE, "%s: a config-only model has no weights (it is for cm384_project)", m->path);
    cm384_config c;
    cm384_config_init(&c);
    if (cfg) {
        if (cfg->struct_size < offsetof(cm384_config, n_workers) || cfg->struct_size > 65536)
            return fail(CM384_E_INVALID, "cm384_engine_create: cfg->struct_size %zu is not valid", cfg->struct_size);
        memcpy(&c, cfg, cfg->struct_size < sizeof c ? cfg->struct_size : sizeof c);
    }
    const hparams *hp = &m->hp;
    const char *preset = c.preset ? c.preset : "default";
    int r = config_resolve(&c, hp, preset);
    if (r) return r;

    const gl_kernels *kset = c.kernels ? gl_kernels_by_name(c.kernels) : gl_kernels_get();
    if (!kset) return fail(CM384_E_INVALID, "kernel set \"%s\" is unknown or needs instructions this CPU lacks", c.kernels);

    cm384_engine *e = CM384_CALLOC(1, sizeof *e);
    if (!e) return fail(CM384_E_NOMEM, "out of memory");
    e->m = m;
    e->cfg = c;
    e->cfg.preset = NULL;
    e->cfg.trace_path = NULL;
    e->cfg.cache_dir = NULL;
    snprintf(e->preset, sizeof e->preset, "%s", preset);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->pool_mu, NULL);
    pthread_mutex_init(&e->trace_mu, NULL);
    pthread_mutex_init(&e->prof_mu, NULL);
    pthread_cond_init(&e->cv_done, NULL);
    atomic_init(&e->link_arm, -1);                 /* 12b: no link fault */
    atomic_init(&e->link_drop[0], -1);
    atomic_init(&e->link_drop[1], -1);
    e->k = kset;
    e->cfg.kernels = NULL;
    e->core_slack = CORE_SLACK;
    e->n_workers = c.n_workers;
    e->max_ctx = c.max_ctx;
    e->sched = CM384_CALLOC(1, sizeof(sched));
    e->peers = CM384_CALLOC(N_LANES, sizeof(peer));
    if (!e->sched || !e->peers) r = fail(CM384_E_NOMEM, "out of memory");
    for (int L = 0; e->peers && L < N_LANES; L++) {
        peer *P = &e->peers[L];
        pthread_mutex_init(&P->step_mu, NULL);
        pthread_cond_init(&P->cv, NULL);
        P->lane = L;
        P->phase = L == LANE_DECODE ? PHASE_DECODE : PHASE_PREFILL;
        P->rg.lane = L;
        P->rg.step = -1;
        P->rg.caller = L == LANE_DECODE ? 0 : c.n_workers;
        P->rg.e = e;
        /* decode: a row per request and one per draft; prefill: a chunk */
        P->step_cap = L == LANE_DECODE ? 2 * c.max_batch : c.prefill_chunk > 2 * c.max_batch ? c.prefill_chunk : 2 * c.max_batch;
    }
    if (!r) r = build_topology(e);
    e->pinned = e->n_workers == e->n_dev && e->n_dev > 1;
    e->time_shared = c.time_shared > 0 || e->pinned;        /* one thread per device: one loop */
    e->prefill_lend = c.prefill_share > 0 ? c.prefill_share / (1 - c.prefill_share) : 0;
    if (!r) {
        if (e->pinned) e->pool_threads = gl_pool_create(c.n_workers);
        else e->lanes = lane_pool_create(c.n_workers);
        if (!e->pool_threads && !e->lanes) r = fail(CM384_E_NOMEM, "cannot start %d worker threads", c.n_workers);
    }
    e->bf16_combine = c.bf16_combine > 0 || (c.bf16_combine == 0 && !strcmp(e->preset, "paper"));
    e->fuse_groups = strcmp(e->preset, "paper") != 0 && !e->pinned;
    if (!r && c.int8) {
        gl_pool *qp = e->pool_threads ? e->pool_threads : gl_pool_create(c.n_workers);
        const char *cd = cfg && cfg->struct_size > offsetof(cm384_config, cache_dir) ? cfg->cache_dir : NULL;
        if (cd && mkdir(cd, 0777) && errno != EEXIST) cd = NULL;
        r = qp ? model_make_q8((cm384_model *)m, qp, NULL, NULL, cd, e) : fail(CM384_E_NOMEM, "cannot start %d worker threads", c.n_workers);
        if (qp != e->pool_threads) gl_pool_free(qp);
    }
    sched *S = e->sched;
    if (!r) {
        S->max_batch = c.max_batch;
        e->peers[LANE_DECODE].decode_cap = c.max_batch;
        if (c.tpot_target_ms > 0) {
            slo_init(&e->peers[LANE_DECODE].slo, c.tpot_target_ms, c.max_batch);
            e->peers[LANE_DECODE].decode_cap = e->peers[LANE_DECODE].slo.cap;
        }
        e->mtp = c.mtp && hp->n_mtp > 0;
        int rows = (e->mtp ? 2 : 1) * c.max_batch + 16;       /* a draft adds a row */
        for (int L = 0; L < N_LANES; L++)
            e->peers[L].rows_cap = rows < e->peers[L].step_cap ? rows : e->peers[L].step_cap;
        kv_pool *kv = &e->kv;
        kv->block_tokens = c.kv_block_tokens;
        kv->n_layers = hp->n_layers + hp->n_mtp;
        kv->row = hp->kv_lora + hp->qk_rope;
        kv->bf16 = c.kv_bf16 > 0;
        e->expanded = c.prefill_expanded > 0;
        kv->row_bytes = (size_t)kv->row * (kv->bf16 ? 2 : 4);
        kv->block_bytes = (size_t)kv->n_layers * kv->block_tokens * kv->row_bytes;
        size_t block_bytes = kv->block_bytes;
        size_t want = c.kv_pool_bytes;
        if (!want) {
            want = (size_t)c.max_batch * ((size_t)c.max_ctx + kv->block_tokens) * kv->n_layers * kv->row_bytes;
            if (want > (size_t)1 << 30) want = (size_t)1 << 30;
        }
        size_t nb = want / block_bytes;
        int min_blocks = (c.max_ctx + kv->block_tokens - 1) / kv->block_tokens + 1;
        if (nb < (size_t)min_blocks)
            r = fail(CM384_E_INVALID, "kv_pool_bytes %zu holds %zu blocks of %zu bytes; one request of max_ctx %d needs %d",
                     want, nb, block_bytes, c.max_ctx, min_blocks);
        if (nb > (size_t)1 << 28) nb = (size_t)1 << 28;
        kv->n_blocks = (int)nb;
        e->index_cap = 1;
        while (e->index_cap < 2 * kv->n_blocks) e->index_cap *= 2;
        e->cache_blocks_max = c.cache_bytes == (size_t)-1 ? 0
                            : c.cache_bytes == 0 ? kv->n_blocks / 2 : (int)(c.cache_bytes / block_bytes);
        e->lru_head = e->lru_tail = -1;
    }
    if (!r && cfg && cfg->struct_size > offsetof(cm384_config, cache_dir) && cfg->cache_dir && e->cache_blocks_max > 0)
        r = cache_dir_open(e, cfg->cache_dir);
    if (!r) {
        carver cv = {NULL, 0};
        carve_pool(e, &cv);
        e->pool_bytes = cv.off + 64;
        memory_estimate(e, cfg && cfg->struct_size > offsetof(cm384_config, trace_path) && cfg->trace_path);
        e->pool = CM384_MALLOC(e->pool_bytes);
        if (!e->pool) r = fail(CM384_E_NOMEM, "cannot allocate the pool: %.1f MB", e->pool_bytes / 1e6);
        else {
            advise_huge(e->pool, e->pool_bytes);
            if (c.prefault) {
                uint64_t t0 = now_ns();
                prefault_pages(e->pool, e->pool_bytes);
                size_t eb = (size_t)m->embed.rows * gl_row_bytes(m->embed.type, m->embed.cols);
                prefault_read(m->embed.data, eb);
                engine_log(e, 1, "pool prefaulted: %.1f MB, and the token embedding's %.1f MB, in %.3f s",
                           e->pool_bytes / 1e6, eb / 1e6, (now_ns() - t0) / 1e9);
            }
            cv.base = (uint8_t *)(((uintptr_t)e->pool + 63) & ~(uintptr_t)63); cv.off = 0; carve_pool(e, &cv);
        }
    }
    if (!r) {
        size_t nd = (size_t)e->n_dev, NL = (size_t)(hp->n_layers + hp->n_mtp), E = (size_t)(hp->n_routed > 0 ? hp->n_routed : 1);
        for (int p = 0; p < 3; p++) e->traffic[p] = CM384_CALLOC(nd * nd, sizeof *e->traffic[p]);
        e->busy = CM384_CALLOC((size_t)(e->n_workers + 1) * nd, sizeof *e->busy);
        e->expert_load = CM384_CALLOC(2 * NL * E, sizeof *e->expert_load);     /* per phase */
        e->dev_rows = CM384_CALLOC(2 * nd, sizeof *e->dev_rows);
        e->dev_rows_layer = CM384_CALLOC(NL * nd, sizeof *e->dev_rows_layer);
        for (int L = 0; L < N_LANES; L++) {
            peer *P = &e->peers[L];
            P->rg.g = CM384_CALLOC((size_t)P->rg.cap, sizeof(rg_group));
            P->run = CM384_CALLOC((size_t)c.max_batch, sizeof *P->run);
            if (!P->rg.g || !P->run) r = fail(CM384_E_NOMEM, "out of memory for the peers");
        }
        e->peers[LANE_DECODE].load_mark = CM384_CALLOC(NL * E, sizeof(uint64_t));
        if (!e->traffic[0] || !e->traffic[1] || !e->traffic[2] || !e->busy || !e->expert_load ||
            !e->peers[LANE_DECODE].load_mark || !e->dev_rows || !e->dev_rows_layer)
            r = fail(CM384_E_NOMEM, "out of memory for counters");
    }
    if (!r && cfg && cfg->struct_size > offsetof(cm384_config, trace_path) && cfg->trace_path) {
        e->trace = fopen(cfg->trace_path, "w");
        e->cap_tev = TRACE_BUF_EVENTS;
        e->tev = CM384_MALLOC((size_t)e->cap_tev * sizeof(trace_event));
        e->trace_named = CM384_CALLOC((size_t)e->n_dev + N_LANES, 1);
        if (!e->trace) r = fail(CM384_E_IO, "%s: cannot open the trace file: %s", cfg->trace_path, strerror(errno));
        else if (!e->tev || !e->trace_named) r = fail(CM384_E_NOMEM, "out of memory for the trace");
        else trace_open(e);
        e->t_origin = now_ns();
    }
    if (!r && c.profile && !(e->prof = CM384_CALLOC(PROFILE_ROWS, sizeof *e->prof)))
        r = fail(CM384_E_NOMEM, "out of memory for the profile");
    e->timed = e->trace != NULL || e->prof != NULL;
    if (!r) {
        peer *P = &e->peers[LANE_PREFILL], *D = &e->peers[LANE_DECODE];
        if (e->cacher) {
            if (pthread_create(&e->cacher->thread, NULL, cache_main, e) != 0) r = fail(CM384_E_NOMEM, "cannot start the caching loop");
            else e->cacher->started = 1;
        }
        if (!r && pthread_create(&P->thread, NULL, prefill_main, e) != 0) r = fail(CM384_E_NOMEM, "cannot start the prefill loop");
        else P->started = 1;
        if (!r && !e->time_shared) {
            if (pthread_create(&D->thread, NULL, decode_main, e) != 0) r = fail(CM384_E_NOMEM, "cannot start the decode loop");
            else D->started = 1;
        }
    }
    if (r) { cm384_engine_free(e); return r; }
    engine_log(e, 1, "supernode: %d devices (%d prefill, %d decode-attention), preset %s, %d workers, "
               "pool %.1f MB with %d KV blocks of %d tokens%s%s; %s", e->n_dev, e->n_pre, e->n_attn, e->preset,
               e->n_workers, e->pool_bytes / 1e6, e->kv.n_blocks, e->kv.block_tokens,
               c.int8 ? ", INT8 W8A8" : "", e->mtp ? ", MTP" : "", e->mem_line);
    *out = e;
    return CM384_OK;
}

/* ---- requests ---- */

/* The longest text one event can carry (a token's completed characters, or
 * a final event's flushed tail). */
static size_t request_text_cap(const cm384_model *m) {
    size_t cap = 512;
    if (m->tok && tokenizer_stream_cap(m->tok) > cap) cap = tokenizer_stream_cap(m->tok);
    return cap;
}

/* Every sampling field against its documented range, named in the message. */
static int sampling_check(const cm384_sampling *sp) {
    if (sp->max_tokens < 1)
        return fail(CM384_E_INVALID, "cm384_submit: sampling.max_tokens = %d; at least 1 token must be asked for", sp->max_tokens);
    if (!(sp->temperature >= 0) || isinf(sp->temperature))
        return fail(CM384_E_INVALID, "cm384_submit: sampling.temperature = %g is not a finite value >= 0", sp->temperature);
    if (sp->top_k < 0) return fail(CM384_E_INVALID, "cm384_submit: sampling.top_k = %d is negative", sp->top_k);
    if (!(sp->top_p >= 0 && sp->top_p <= 1))
        return fail(CM384_E_INVALID, "cm384_submit: sampling.top_p = %g is outside [0, 1]", sp->top_p);
    if (!(sp->min_p >= 0 && sp->min_p <= 1))
        return fail(CM384_E_INVALID, "cm384_submit: sampling.min_p = %g is outside [0, 1]", sp->min_p);
    return CM384_OK;
}

int cm384_submit(cm384_engine *e, const cm384_request *req, uint64_t *id_out) {
    if (id_out) *id_out = 0;
    if (!e || !req) return fail(CM384_E_INVALID, "cm384_submit: NULL argument");
    cm384_request q;
    cm384_request_init(&q);
    if (req->struct_size < offsetof(cm384_request, sampling) || req->struct_size > 65536)
        return fail(CM384_E_INVALID, "cm384_submit: request struct_size %zu is not valid", req->struct_size);
    memcpy(&q, req, req->struct_size < sizeof q ? req->struct_size : sizeof q);
    const cm384_model *m = e->m;
    cm384_sampling sp;
    cm384_sampling_init(&sp);
    if (q.sampling) {
        if (q.sampling->struct_size < offsetof(cm384_sampling, top_k) || q.sampling->struct_size > 65536)
            return fail(CM384_E_INVALID, "cm384_submit: sampling struct_size is not valid");
        memcpy(&sp, q.sampling, q.sampling->struct_size < sizeof sp ? q.sampling->struct_size : sizeof sp);
    }
    int r0 = sampling_check(&sp);
    if (r0) return r0;
    int n;
    if (q.text) {
        if (!m->tok) return fail(CM384_E_UNSUPPORTED, "cm384_submit: the model has no tokenizer; submit ids");
        size_t len = q.text_len ? q.text_len : strlen(q.text);
        n = tokenizer_encode(m->tok, q.text, len, NULL, 0, CM384_TOK_ADD_BOS);
        if (n < 0) return n;
    } else {
        if (!q.ids || q.n_ids <= 0) return fail(CM384_E_INVALID, "cm384_submit: the request has no prompt");
        n = q.n_ids;
    }
    if (n < 1) return fail(CM384_E_INVALID, "cm384_submit: empty prompt");
    if (n >= e->max_ctx)
        return fail(CM384_E_CAPACITY, "cm384_submit: prompt of %d tokens does not fit max_ctx %d (one more token must fit)", n, e->max_ctx);
    request *r = CM384_CALLOC(1, sizeof *r);
    if (!r) return fail(CM384_E_NOMEM, "out of memory");
    long cap_tokens = (long)n + sp.max_tokens + 1;
    if (cap_tokens > e->max_ctx + 1) cap_tokens = e->max_ctx + 1;
    r->cap_tokens = (int)cap_tokens;
    r->cap_blocks = (e->max_ctx + e->kv.block_tokens - 1) / e->kv.block_tokens + 1;
    r->text_cap = request_text_cap(m);
    r->tokens = CM384_MALLOC((size_t)r->cap_tokens * sizeof(int32_t));
    r->blocks = CM384_MALLOC((size_t)r->cap_blocks * sizeof(int));
    r->text = CM384_MALLOC(r->text_cap);
    if (!r->tokens || !r->blocks || !r->text) { request_free(r); return fail(CM384_E_NOMEM, "out of memory"); }
    if (q.text) {
        tokenizer_encode(m->tok, q.text, q.text_len ? q.text_len : strlen(q.text), r->tokens, n, CM384_TOK_ADD_BOS);
        for (int i = 0; i < n; i++)     /* a tokenizer may know more ids than the embedding has rows */
            if (r->tokens[i] >= m->hp.vocab) {
                int id = r->tokens[i];
                request_free(r);
                return fail(CM384_E_INVALID, "cm384_submit: the prompt's token %d (id %d) is outside the model's %d embedding rows: "
                            "the tokenizer knows ids the model does not", i, id, m->hp.vocab);
            }
    } else {
        for (int i = 0; i < n; i++) {
            if (q.ids[i] < 0 || q.ids[i] >= m->hp.vocab) {
                request_free(r);
                return fail(CM384_E_INVALID, "cm384_submit: token id %d at position %d is outside [0, %d)", q.ids[i], i, m->hp.vocab);
            }
            r->tokens[i] = q.ids[i];
        }
    }
    r->n_prompt = r->n_tokens = n;
    r->samp = sp;
    r->rng = sp.seed;
    r->tenant = q.tenant;
    r->fn = q.on_event;
    r->user = q.user;
    r->device = -1;
    r->draft = -1;
    if (e->mtp && !(r->h_ring = CM384_CALLOC((size_t)MTP_RING * m->hp.dim, sizeof(float)))) {
        request_free(r);
        return fail(CM384_E_NOMEM, "out of memory");
    }
    r->t_submit = now_ms();
    cm384_detok_stream_init(&r->ds);
    sched *S = e->sched;
    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        return fail(CM384_E_MISUSE, "cm384_submit: the engine is shutting down");
    }
    if (e->fatal) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        return fail(CM384_E_DEVICE, "cm384_submit: %s", e->fatal_why);
    }
    if (S->n_live == S->cap_live) {
        int cap = S->cap_live ? 2 * S->cap_live : 64;
        request **l = realloc(S->live, (size_t)cap * sizeof *l);
        if (!l) { pthread_mutex_unlock(&e->mu); request_free(r); return fail(CM384_E_NOMEM, "out of memory"); }
        S->live = l;
        S->cap_live = cap;
    }
    if (S->n_done + S->n_live + 1 > S->cap_done && S->cap_done < 1 << 16) {
        /* room in the done list for every live request: a request that ends
           (on the decode path) never allocates */
        int cap = S->cap_done ? 2 * S->cap_done : 256;
        done_rec *d = realloc(S->done, (size_t)cap * sizeof *d);
        if (!d) { pthread_mutex_unlock(&e->mu); request_free(r); return fail(CM384_E_NOMEM, "out of memory"); }
        S->done = d;
        S->cap_done = cap;
    }
    r->id = ++S->next_id;
    S->live[S->n_live++] = r;
    if (S->inbox_tail) S->inbox_tail->next = r; else S->inbox_head = r;
    S->inbox_tail = r;
    S->st.requests_submitted++;
    if (id_out) *id_out = r->id;
    wake_peer(e, LANE_PREFILL);
    pthread_mutex_unlock(&e->mu);
    return CM384_OK;
}

int cm384_cancel(cm384_engine *e, uint64_t id) {
    if (!e) return fail(CM384_E_INVALID, "cm384_cancel: NULL engine");
    sched *S = e->sched;
    int found = 0;
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < S->n_live; i++)
        if (S->live[i]->id == id) {
            atomic_store(&S->live[i]->cancel, 1);
            wake_peer(e, LANE_PREFILL);
            wake_peer(e, LANE_DECODE);
            found = 1;
            break;
        }
    pthread_mutex_unlock(&e->mu);
    return found ? CM384_OK : fail(CM384_E_NOT_FOUND, "cm384_cancel: no running request %llu", (unsigned long long)id);
}

static void deadline_after(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

int cm384_wait(cm384_engine *e, uint64_t id, int timeout_ms) {
    if (!e) return fail(CM384_E_INVALID, "cm384_wait: NULL engine");
    sched *S = e->sched;
    struct timespec dl;
    if (timeout_ms >= 0) deadline_after(&dl, timeout_ms);
    pthread_mutex_lock(&e->mu);
    for (;;) {
        for (int i = 0; i < S->n_done; i++)
            if (S->done[i].id == id) {
                int st = S->done[i].status;
                S->done[i] = S->done[--S->n_done];
                pthread_mutex_unlock(&e->mu);
                return st;
            }
        int live = 0;
        for (int i = 0; i < S->n_live && !live; i++) live = S->live[i]->id == id;
        if (!live) {
            pthread_mutex_unlock(&e->mu);
            return fail(CM384_E_NOT_FOUND, "cm384_wait: no request %llu (or its result was already taken)", (unsigned long long)id);
        }
        if (timeout_ms < 0) pthread_cond_wait(&e->cv_done, &e->mu);
        else if (pthread_cond_timedwait(&e->cv_done, &e->mu, &dl) == ETIMEDOUT) {
            pthread_mutex_unlock(&e->mu);
            return fail(CM384_E_TIMEOUT, "cm384_wait: request %llu still running after %d ms", (unsigned long long)id, timeout_ms);
        }
    }
}

int cm384_wait_all(cm384_engine *e) {
    if (!e) return fail(CM384_E_INVALID, "cm384_wait_all: NULL engine");
    pthread_mutex_lock(&e->mu);
    while (e->sched->n_live > 0) pthread_cond_wait(&e->cv_done, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return CM384_OK;
}

/* cm384_generate: the scheduler thread copies events into a small ring; the
 * calling thread delivers them to the user's callback. */
#define GEN_RING 64
typedef struct gen_slot { cm384_event ev; char *text; } gen_slot;
typedef struct gen_queue {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    gen_slot        ring[GEN_RING];
    size_t          text_cap;       /* the longest event text + 1 */
    int             head, count;
} gen_queue;

static int gen_push(void *user, const cm384_event *ev) {
    gen_queue *q = user;
    pthread_mutex_lock(&q->mu);
    while (q->count == GEN_RING) pthread_cond_wait(&q->cv, &q->mu);
    gen_slot *s = &q->ring[(q->head + q->count) % GEN_RING];
    s->ev = *ev;
    size_t n = ev->text_len < q->text_cap ? ev->text_len : q->text_cap - 1;   /* always all of it: see text_cap */
    if (n) memcpy(s->text, ev->text, n);
    s->text[n] = 0;
    s->ev.text = NULL;
    s->ev.text_len = n;
    q->count++;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

int cm384_generate(cm384_engine *e, const char *text, const int32_t *ids, int n_ids,
                   const cm384_sampling *s, cm384_event_fn fn, void *user) {
    if (!e) return fail(CM384_E_INVALID, "cm384_generate: NULL engine");
    gen_queue *q = CM384_CALLOC(1, sizeof *q);
    if (!q) return fail(CM384_E_NOMEM, "out of memory");
    q->text_cap = request_text_cap(e->m) + 1;
    char *texts = CM384_MALLOC(GEN_RING * q->text_cap);
    if (!texts) { CM384_FREE(q); return fail(CM384_E_NOMEM, "out of memory"); }
    for (int i = 0; i < GEN_RING; i++) q->ring[i].text = texts + (size_t)i * q->text_cap;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    cm384_request rq;
    cm384_request_init(&rq);
    rq.text = text; rq.ids = ids; rq.n_ids = n_ids; rq.sampling = s;
    rq.on_event = gen_push; rq.user = q;
    uint64_t id;
    int r = cm384_submit(e, &rq, &id);
    int status = r, cancelled = 0;
    for (int done = r != CM384_OK; !done;) {
        pthread_mutex_lock(&q->mu);
        while (!q->count) pthread_cond_wait(&q->cv, &q->mu);
        gen_slot *slot = &q->ring[q->head];     /* stays ours until count says it is free */
        pthread_mutex_unlock(&q->mu);
        slot->ev.text = slot->text;
        if (slot->ev.kind != CM384_EV_TOKEN) { done = 1; status = slot->ev.status; }
        if (fn && fn(user, &slot->ev) && !cancelled && !done) { cm384_cancel(e, id); cancelled = 1; }
        pthread_mutex_lock(&q->mu);
        q->head = (q->head + 1) % GEN_RING;
        q->count--;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
    }
    if (r == CM384_OK) cm384_wait(e, id, -1);           /* drop the record */
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    CM384_FREE(texts);
    CM384_FREE(q);
    if (status == CM384_E_CANCELLED) fail(status, "cm384_generate: cancelled");
    return status;
}

/* ---- eval: a fresh sequence through the same machinery, outside the scheduler ---- */

int cm384_eval(cm384_engine *e, const int32_t *ids, int n, float *logits, float *mtp_logits) {
    if (!e || !ids || n <= 0 || !logits) return fail(CM384_E_INVALID, "cm384_eval: need an engine, ids, n > 0 and a logits buffer");
    const cm384_model *m = e->m;
    const hparams *hp = &m->hp;
    if (n > e->max_ctx) return fail(CM384_E_CAPACITY, "cm384_eval: %d tokens exceed max_ctx %d", n, e->max_ctx);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= hp->vocab)
            return fail(CM384_E_INVALID, "cm384_eval: token %d at position %d is outside [0, %d)", ids[i], i, hp->vocab);
    if (mtp_logits && !hp->n_mtp) return fail(CM384_E_UNSUPPORTED, "cm384_eval: the model has no MTP layer");
    peer *P = &e->peers[LANE_PREFILL];
    int B = e->kv.block_tokens, nb = (n + B) / B;
    int *blocks = CM384_MALLOC((size_t)nb * sizeof(int));
    float *h = CM384_MALLOC((size_t)n * hp->dim * sizeof(float));
    if (!blocks || !h) { CM384_FREE(blocks); CM384_FREE(h); return fail(CM384_E_NOMEM, "out of memory"); }
    pthread_mutex_lock(&P->step_mu);
    P->rg.step = -1;                              /* no serving step: the trace says none */
    int r = CM384_OK, got = 0;
    if (e->fatal) {                               /* 12b: read under step_mu, which faults are applied under */
        pthread_mutex_unlock(&P->step_mu);
        CM384_FREE(blocks); CM384_FREE(h);
        return fail(CM384_E_DEVICE, "cm384_eval: %s", e->fatal_why);
    }
    pthread_mutex_lock(&e->pool_mu);
    for (; got < nb; got++) if ((blocks[got] = block_get(e)) < 0) break;
    pthread_mutex_unlock(&e->pool_mu);
    if (got < nb) r = fail(CM384_E_CAPACITY, "cm384_eval: the KV pool has no room for %d tokens now", n);
    mb_arrays *a = &P->mba[0];
    int dev = e->pre_devs[0];
    for (int c0 = 0; !r && c0 < n; c0 += P->step_cap) {
        microbatch mb = {0};
        mb.n = n - c0 < P->step_cap ? n - c0 : P->step_cap;
        for (int t = 0; t < mb.n; t++) { a->pos[t] = c0 + t; a->tables[t] = blocks; P->dev_of[t] = dev; }
        mb.tok = ids + c0; mb.pos = a->pos; mb.tables = a->tables;
        mb.phase = PHASE_PREFILL; mb.s = &P->s[0];
        mb.logits = logits + (size_t)c0 * hp->vocab;
        mb.h_out = h + (size_t)c0 * hp->dim;
        mb_make_groups(&mb, a->groups, P->dev_of);
        forward_main(e, &P->rg, &mb, 1);
    }
    for (int c0 = 0; !r && mtp_logits && c0 < n - 1; c0 += P->step_cap) {
        microbatch mb = {0};
        mb.n = n - 1 - c0 < P->step_cap ? n - 1 - c0 : P->step_cap;
        for (int t = 0; t < mb.n; t++) { a->pos[t] = c0 + t; a->tables[t] = blocks; P->dev_of[t] = dev; }
        mb.tok = ids + c0 + 1; mb.pos = a->pos; mb.tables = a->tables; mb.kv_shift = 1;
        mb.phase = PHASE_PREFILL; mb.s = &P->s[0];
        mb.logits = mtp_logits + (size_t)c0 * hp->vocab;
        mb_make_groups(&mb, a->groups, P->dev_of);
        forward_mtp(e, &P->rg, &mb, h + (size_t)c0 * hp->dim);
    }
    if (P->rg.broken) {
        r = fail(CM384_E_INTERNAL, "cm384_eval: internal error: %s", P->rg.broken);
        P->rg.broken = NULL;
    }
    pthread_mutex_lock(&e->pool_mu);
    for (int i = 0; i < got; i++) block_unref(e, blocks[i]);
    pthread_mutex_unlock(&e->pool_mu);
    pthread_mutex_unlock(&P->step_mu);
    CM384_FREE(blocks);
    CM384_FREE(h);
    return r;
}

/* ---- tokenizer ---- */

static int need_tokenizer(const cm384_model *m, const char *fn) {
    if (!m) return fail(CM384_E_INVALID, "%s: NULL model", fn);
    if (!m->tok) return fail(CM384_E_UNSUPPORTED, "%s: %s has no tokenizer.json", fn, m->path);
    return CM384_OK;
}

int cm384_tokenize(const cm384_model *m, const char *text, size_t len, int32_t *out, int cap, unsigned flags) {
    int r = need_tokenizer(m, "cm384_tokenize");
    if (r) return r;
    if (!text && len) return fail(CM384_E_INVALID, "cm384_tokenize: NULL text");
    if (cap < 0 || (cap > 0 && !out)) return fail(CM384_E_INVALID, "cm384_tokenize: bad output buffer");
    return tokenizer_encode(m->tok, text ? text : "", len, out, cap, flags);
}

int cm384_detokenize(const cm384_model *m, const int32_t *ids, int n, char *out, size_t cap) {
    int r = need_tokenizer(m, "cm384_detokenize");
    if (r) return r;
    if (n < 0 || (n > 0 && !ids)) return fail(CM384_E_INVALID, "cm384_detokenize: bad ids");
    int nid = tokenizer_n_ids(m->tok);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= nid)
            return fail(CM384_E_INVALID, "cm384_detokenize: id %d at %d is not a token (the tokenizer has %d)", ids[i], i, nid);
    return tokenizer_decode(m->tok, ids, n, out, cap);
}

void cm384_detok_stream_init(cm384_detok_stream *s) { if (s) memset(s, 0, sizeof *s); }

int cm384_detok_stream_push(const cm384_model *m, cm384_detok_stream *s, int32_t id, char *out, size_t cap) {
    int r = need_tokenizer(m, "cm384_detok_stream_push");
    if (r) return r;
    if (!s) return fail(CM384_E_INVALID, "cm384_detok_stream_push: NULL stream");
    if (id < 0 || id >= tokenizer_n_ids(m->tok)) return fail(CM384_E_INVALID, "cm384_detok_stream_push: %d is not a token", id);
    return detok_stream_push(m->tok, s, id, out, cap);
}

int cm384_detok_stream_flush(cm384_detok_stream *s, char *out, size_t cap) {
    if (!s) return fail(CM384_E_INVALID, "cm384_detok_stream_flush: NULL stream");
    return detok_stream_flush(s, out, cap);
}

int cm384_token_text(const cm384_model *m, int32_t id, char *out, size_t cap) {
    int r = need_tokenizer(m, "cm384_token_text");
    if (r) return r;
    const char *bytes = NULL;
    int len = 0;
    if (id < 0 || id >= tokenizer_n_ids(m->tok) || tokenizer_piece(m->tok, id, &bytes, &len))
        return fail(CM384_E_INVALID, "cm384_token_text: %d is not a token", id);
    return copy_out(bytes, (size_t)len, out, cap);
}

int cm384_token_is_special(const cm384_model *m, int32_t id) {
    if (!m || !m->tok || id < 0 || id >= tokenizer_n_ids(m->tok)) return 0;
    return tokenizer_is_special(m->tok, id);
}

int cm384_chat_render_format(const cm384_model *m, int format, const cm384_chat_msg *msgs, int n, unsigned flags,
                             char *out, size_t cap) {
    int r = need_tokenizer(m, "cm384_chat_render");
    if (r) return r;
    if (n < 0 || (n > 0 && !msgs)) return fail(CM384_E_INVALID, "cm384_chat_render: bad messages");
    for (int i = 0; i < n; i++)
        if (!msgs[i].role) return fail(CM384_E_INVALID, "cm384_chat_render: message %d has no role", i);
    return chat_render(m->tok, format, msgs, n, flags, out, cap);
}

int cm384_chat_render(const cm384_model *m, const cm384_chat_msg *msgs, int n, unsigned flags, char *out, size_t cap) {
    return cm384_chat_render_format(m, CM384_CHAT_MODEL, msgs, n, flags, out, cap);
}

int cm384_chat_format(const cm384_model *m) {
    int r = need_tokenizer(m, "cm384_chat_format");
    if (r) return r;
    if (m->tok->chat_format == CM384_E_NOT_FOUND)
        return fail(CM384_E_NOT_FOUND, "cm384_chat_format: the model has no chat template");
    if (m->tok->chat_format < 0)
        return fail(m->tok->chat_format, "cm384_chat_format: the model's chat template is not one cm384 knows (canonical hash %016llx)",
                    (unsigned long long)m->tok->chat_template_hash);
    return m->tok->chat_format;
}

int cm384_chat_template_format(const char *tpl, size_t len) {
    if (!tpl) return fail(CM384_E_INVALID, "cm384_chat_template_format: NULL template");
    uint64_t h = 0;
    int r = chat_template_format(tpl, len ? len : strlen(tpl), &h);
    if (r == CM384_E_NOMEM) return fail(r, "cm384_chat_template_format: out of memory");
    if (r < 0) return fail(r, "cm384_chat_template_format: not a template cm384 knows (canonical hash %016llx)", (unsigned long long)h);
    return r;
}

const char *cm384_chat_format_name(int format) {
    const char *s = chat_format_name(format);
    return s ? s : "";
}

/* ======================================================================== */
/* 15. Projection: this schedule on the real supernode                      */
/* ======================================================================== */
/* The projection owns the answer to "what would this run do on a
 * CloudMatrix384?".  It replays the engine's own schedule at full scale --
 * the operator sequence and the microbatch pairing of forward_main (section
 * 10), the expert placement build_topology makes in the paper preset for the
 * projected model (section 9), EPLB's replicas from eplb_rebalance, the
 * message sizes moe_layout sends (section 7) -- and prices every operator on
 * one device of the target machine: a roofline (arithmetic at a measured
 * fraction of peak, memory at a measured fraction of bandwidth), dispatch
 * and combine from their bytes at the bandwidth the paper measured for its
 * fused operators.  Two decode microbatches run on two streams with the
 * paper's static core split; prefill overlaps its fabric transfers with
 * compute.  Every number it uses is in proj_params[] below, with its source:
 * hardware specifications and operator-level measurements only.  The paper's
 * end-to-end tables are checks (tests/test_project.c), never inputs.
 *
 * Number formats: what the engine computes in fp32 (activations, the KV
 * cache, the attention core) is priced in BF16, the device's 16-bit type;
 * what is a mechanism in the engine (INT8 weights, INT8 dispatch, the
 * combine's precision) follows the mechanism's switch and the engine's
 * message layout. */

/* ---- 15a. The parameters, each with its source ---- */

typedef struct proj_param {
    const char *profile, *key;
    double      value;
    const char *unit, *source;
} proj_param;

#define PAPER "CloudMatrix384 paper (arXiv 2506.12708)"
static const proj_param proj_params[] = {
    /* one Ascend 910C die */
    {"cloudmatrix384", "dies_per_npu", 2, "dies", PAPER " s1.2: a 910C package holds two dies; per-NPU figures count packages"},
    {"cloudmatrix384", "bf16_tflops", 376, "TFLOPS", PAPER " s1.2: ~752 TFLOPS BF16 per 910C, 376 per die"},
    {"cloudmatrix384", "int8_tops", 752, "TOPS", PAPER " s6.1: its tok/s/TFLOPS column implies 1,504 INT8 TOPS per 910C (6,688/4.45)"},
    {"cloudmatrix384", "hbm_gb", 64, "GB", PAPER " s1.2: 128 GB per 910C"},
    {"cloudmatrix384", "hbm_gbs", 1600, "GB/s", PAPER " s1.2: ~3.2 TB/s per 910C"},
    {"cloudmatrix384", "link_gbs", 196, "GB/s", PAPER " s1.2: UB 7 x 224 Gbps, ~196 GB/s per die, one direction"},
    {"cloudmatrix384", "link_us", 1.2, "us", PAPER " s1.4: NPU-to-NPU UB latency at 512 B"},
    {"cloudmatrix384", "rdma_gbs", 25, "GB/s", PAPER " s1.2: RDMA 200 Gbps per die"},
    {"cloudmatrix384", "pool_gbs", 151, "GB/s", PAPER " s1.4: NPU to remote CPU DRAM over UB"},
    {"cloudmatrix384", "cube_cores", 24, "AIC", PAPER " s1.2: 24 AI Cube + 48 AI Vector cores per die"},
    {"cloudmatrix384", "attn_cube_cores", 16, "AIC", PAPER " s3.4: stream 0 (attention) 16 AIC + 32 AIV, stream 1 (MoE) 8 AIC + 16 AIV"},
    {"cloudmatrix384", "gemm_eff", 0.80, "of peak", PAPER " s5: INT8 GEMM 77.4-82.7% of peak (middle of the range)"},
    {"cloudmatrix384", "mla_flop_eff", 0.654, "of peak", PAPER " s3.3: compute-bound MLA 65.4% of peak"},
    {"cloudmatrix384", "mla_bw_eff", 0.841, "of HBM bw", PAPER " s3.3: memory-bound MLA 84.1% of HBM bandwidth (also used for weight streaming)"},
    {"cloudmatrix384", "a2a_tokens", 128, "tokens/rank", PAPER " Table 6: 128 tokens per rank, top-8, hidden 7,168"},
    {"cloudmatrix384", "a2a_topk", 8, "experts", PAPER " Table 6"},
    {"cloudmatrix384", "a2a_dispatch_bytes", 7680, "B/msg", PAPER " s3.2: ~7.5 KB per INT8 token message"},
    {"cloudmatrix384", "a2a_combine_bytes", 14336, "B/msg", PAPER " s3.2: ~14 KB per BF16 token message"},
    {"cloudmatrix384", "a2a_ep_lo", 8, "ranks", PAPER " Table 6"},
    {"cloudmatrix384", "a2a_ep_hi", 256, "ranks", PAPER " Table 6"},
    {"cloudmatrix384", "dispatch_us_lo", 116, "us", PAPER " Table 6: FusedDispatch, EP8"},
    {"cloudmatrix384", "dispatch_us_hi", 152, "us", PAPER " Table 6: FusedDispatch, EP256"},
    {"cloudmatrix384", "combine_us_lo", 118, "us", PAPER " Table 6: FusedCombine, EP8"},
    {"cloudmatrix384", "combine_us_hi", 149, "us", PAPER " Table 6: FusedCombine, EP256"},
    {"cloudmatrix384", "graph_gap_ms", 0.7, "ms", PAPER " s3.5: 0.6-0.8 ms host bubble per graph launch before graph bundling"},
    {"cloudmatrix384", "kv_bytes", 2, "B", "not stated by the paper; BF16 assumed (the engine's fp32 priced at 16 bits)"},
    /* one H800 GPU, the paper's point of comparison */
    {"h800", "dies_per_npu", 1, "GPU", "one GPU is the unit of the paper's H800 figures"},
    {"h800", "bf16_tflops", 989, "TFLOPS", "NVIDIA H800 SXM: dense BF16"},
    {"h800", "int8_tops", 1979, "TOPS", PAPER " s6.1: 1,979 dense FP8 TFLOPS (its per-TFLOPS denominator)"},
    {"h800", "hbm_gb", 80, "GB", "NVIDIA H800 SXM: 80 GB HBM3"},
    {"h800", "hbm_gbs", 3350, "GB/s", "NVIDIA H800 SXM: 3.35 TB/s"},
    {"h800", "link_gbs", 50, "GB/s", "DeepSeek-V3 report s3.2: 50 GB/s InfiniBand per GPU (EP beyond 8 GPUs crosses it)"},
    {"h800", "link_us", 2.0, "us", "no measurement in our sources; a typical IB RDMA write latency"},
    {"h800", "rdma_gbs", 50, "GB/s", "DeepSeek-V3 report s3.2: 400 Gbps InfiniBand per GPU"},
    {"h800", "pool_gbs", 50, "GB/s", "no pooled memory: the scale-out link"},
    {"h800", "cube_cores", 132, "SMs", "NVIDIA H800 SXM"},
    {"h800", "attn_cube_cores", 0, "SMs", "no static split: two microbatches interleave compute, only communication overlaps (DeepSeek's decode overlap)"},
    {"h800", "gemm_eff", 0.78, "of peak", "DeepGEMM README: up to 1,550 FP8 TFLOPS on H800"},
    {"h800", "mla_flop_eff", 0.667, "of peak", PAPER " s3.3: FlashMLA 66.7% compute utilisation"},
    {"h800", "mla_bw_eff", 0.896, "of HBM bw", PAPER " s3.3: FlashMLA 89.6% bandwidth utilisation"},
    {"h800", "a2a_tokens", 128, "tokens/rank", PAPER " Table 6 (DeepEP low-latency kernels)"},
    {"h800", "a2a_topk", 8, "experts", PAPER " Table 6"},
    {"h800", "a2a_dispatch_bytes", 7680, "B/msg", "DeepEP: FP8 token + scales, as CloudMatrix's INT8 message"},
    {"h800", "a2a_combine_bytes", 14336, "B/msg", "DeepEP: BF16 combine"},
    {"h800", "a2a_ep_lo", 8, "ranks", PAPER " Table 6"},
    {"h800", "a2a_ep_hi", 256, "ranks", PAPER " Table 6"},
    {"h800", "dispatch_us_lo", 163, "us", PAPER " Table 6: DeepEP dispatch, EP8"},
    {"h800", "dispatch_us_hi", 194, "us", PAPER " Table 6: DeepEP dispatch, EP256"},
    {"h800", "combine_us_lo", 318, "us", PAPER " Table 6: DeepEP combine, EP8"},
    {"h800", "combine_us_hi", 360, "us", PAPER " Table 6: DeepEP combine, EP256"},
    {"h800", "graph_gap_ms", 0, "ms", "no measurement in our sources (CUDA graphs); 0"},
    {"h800", "kv_bytes", 2, "B", "FlashMLA: BF16 KV cache"},
    /* the workload and deployment the paper evaluates (defaults of cm384_proj_opts) */
    {"workload", "mtp_accept", 0.7, "", PAPER " s3.5: one draft token, ~70% accepted"},
    {"workload", "prefill_tokens", 16384, "tokens/NPU", PAPER " Table 2 set-up: 16,384 prompt tokens per accelerator"},
    {"workload", "max_batch", 128, "requests/NPU", PAPER " Tables 3-4: the largest decode batch the paper (and DeepSeek's profile) runs"},
    {"workload", "prefill_instances", 6, "instances", PAPER " s2.3: 6 prefill instances of 32 dies, 1 decode instance of 320"},
};
#undef PAPER

#define N_PROJ_PARAMS ((int)(sizeof proj_params / sizeof proj_params[0]))

int cm384_hw_param(int i, const char **profile, const char **key, double *value, const char **unit,
                   const char **source) {
    if (i < 0 || i >= N_PROJ_PARAMS) return fail(CM384_E_INVALID, "cm384_hw_param: no row %d (%d rows)", i, N_PROJ_PARAMS);
    const proj_param *p = &proj_params[i];
    if (profile) *profile = p->profile;
    if (key) *key = p->key;
    if (value) *value = p->value;
    if (unit) *unit = p->unit;
    if (source) *source = p->source;
    return N_PROJ_PARAMS;
}

static double proj_param_value(const char *profile, const char *key) {
    for (int i = 0; i < N_PROJ_PARAMS; i++)
        if (!strcmp(proj_params[i].profile, profile) && !strcmp(proj_params[i].key, key)) return proj_params[i].value;
    return 0;
}

/* cm384_hw fields by parameter key. */
static const struct { const char *key; size_t off; } proj_hw_fields[] = {
#define F(k) {#k, offsetof(cm384_hw, k)}
    F(dies_per_npu), F(bf16_tflops), F(int8_tops), F(hbm_gb), F(hbm_gbs), F(link_gbs), F(link_us),
    F(rdma_gbs), F(pool_gbs), F(cube_cores), F(attn_cube_cores), F(gemm_eff), F(mla_flop_eff),
    F(mla_bw_eff), F(a2a_tokens), F(a2a_topk), F(a2a_dispatch_bytes), F(a2a_combine_bytes),
    F(a2a_ep_lo), F(a2a_ep_hi), F(dispatch_us_lo), F(dispatch_us_hi), F(combine_us_lo),
    F(combine_us_hi), F(graph_gap_ms), F(kv_bytes),
#undef F
};

int cm384_hw_get(const char *name, cm384_hw *out) {
    if (!name || !out) return fail(CM384_E_INVALID, "cm384_hw_get: NULL argument");
    if (strcmp(name, "cloudmatrix384") && strcmp(name, "h800"))
        return fail(CM384_E_INVALID, "unknown hardware profile \"%s\" (cloudmatrix384, h800)", name);
    size_t sz = out->struct_size && out->struct_size < sizeof *out ? out->struct_size : sizeof *out;
    cm384_hw hw;
    memset(&hw, 0, sizeof hw);
    snprintf(hw.name, sizeof hw.name, "%s", name);
    for (size_t i = 0; i < sizeof proj_hw_fields / sizeof proj_hw_fields[0]; i++)
        *(double *)((char *)&hw + proj_hw_fields[i].off) = proj_param_value(name, proj_hw_fields[i].key);
    hw.struct_size = sz;
    memcpy(out, &hw, sz);
    return CM384_OK;
}

/* ---- 15b. A model from its config.json alone ---- */

/* Parameter counts from the shapes, as the loader counts them from tensors:
 * total, and active per token (no embedding, only the routed experts a
 * token visits, no MTP module). */
static void shape_params(const hparams *hp, const layer_w *layers, uint64_t *total, uint64_t *active,
                         uint64_t *mtp) {
    uint64_t D = (uint64_t)hp->dim, H = (uint64_t)hp->n_heads, lat = (uint64_t)hp->kv_lora + hp->qk_rope;
    uint64_t attn = (hp->q_lora ? D * hp->q_lora + (uint64_t)hp->q_lora * H * (hp->qk_nope + hp->qk_rope) + hp->q_lora
                                : D * H * (hp->qk_nope + hp->qk_rope)) +
                    D * lat + hp->kv_lora + (uint64_t)hp->kv_lora * H * (hp->qk_nope + hp->v_head) + H * hp->v_head * D +
                    2 * D;
    uint64_t expert = 3 * D * hp->moe_inter;
    uint64_t moe_all = (uint64_t)hp->n_routed * expert + (uint64_t)hp->n_shared * expert + (uint64_t)hp->n_routed * D +
                       (hp->topk_method == TOPK_NOAUX_TC ? (uint64_t)hp->n_routed : 0);
    uint64_t moe_active = ((uint64_t)hp->top_k + hp->n_shared) * expert + (uint64_t)hp->n_routed * D;
    uint64_t dense = 3 * D * hp->inter;
    uint64_t t = 0, a = 0, m = 0;
    for (int l = 0; l < hp->n_layers + hp->n_mtp; l++) {
        int moe = layers[l].is_moe;
        uint64_t lt = attn + (moe ? moe_all : dense), la = attn + (moe ? moe_active : dense);
        if (l >= hp->n_layers) { lt += 2 * D * D + 3 * D; m += lt; }
        else a += la;
        t += lt;
    }
    t += (uint64_t)hp->vocab * D * (hp->tie_emb ? 1 : 2) + D;
    a += (uint64_t)hp->vocab * D + D;   /* the head */
    *total = t; *active = a; *mtp = m;
}

int cm384_model_load_config(const char *path, cm384_model **out) {
    if (out) *out = NULL;
    if (!path || !out) return fail(CM384_E_INVALID, "cm384_model_load_config: path and out must not be NULL");
    cm384_model *m = calloc(1, sizeof *m);
    if (!m) return fail(CM384_E_NOMEM, "out of memory");
    pthread_mutex_init(&m->q8_mu, NULL);
    struct stat st;
    int r = CM384_OK;
    if (stat(path, &st) != 0) r = fail(CM384_E_IO, "%s: cannot open: %s", path, strerror(errno));
    char *cp = r ? NULL : S_ISDIR(st.st_mode) ? path_join(path, "config.json") : strdup(path);
    if (!r && !cp) r = fail(CM384_E_NOMEM, "out of memory");
    json cfg;
    if (!r) r = json_load_file(cp, &m->a, &cfg);
    if (!r) r = parse_config(&cfg, cp, &m->hp);
    if (!r) {
        hparams *hp = &m->hp;
        int nl = hp->n_layers + hp->n_mtp;
        m->layers = arena_alloc(&m->a, (size_t)nl * sizeof(layer_w));
        if (!m->layers) r = fail(CM384_E_NOMEM, "out of memory");
        else {
            memset(m->layers, 0, (size_t)nl * sizeof(layer_w));
            for (int l = 0; l < nl; l++) m->layers[l].is_moe = layer_is_moe(hp, l);
            shape_params(hp, m->layers, &m->n_params, &m->n_active_params, &m->n_mtp_params);
            m->main_dtype = json_get(&cfg, "quantization_config") ? GL_F8_E4M3 : GL_BF16;
            m->weight_bytes = m->n_params * (m->main_dtype == GL_F8_E4M3 ? 1 : 2);
            m->config_only = 1;
        }
    }
    m->path = cp;
    if (r) { cm384_model_free(m); return r; }
    *out = m;
    return CM384_OK;
}

/* ---- 15c. Options ---- */

void cm384_proj_opts_init(cm384_proj_opts *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = sizeof *o;
    o->hw = "cloudmatrix384";
    o->prompt = 4096;
    o->output = 256;
    o->max_batch = (int)proj_param_value("workload", "max_batch");
    o->tpot_slo_ms = 50;
    o->mtp_accept = proj_param_value("workload", "mtp_accept");
    o->prefill_tokens = (int)proj_param_value("workload", "prefill_tokens");
    o->int8 = o->int8_dispatch = o->bf16_combine = o->mtp = o->eplb = o->graph_bundling = 1;
    o->microbatches = 2;
}

void cm384_proj_opts_from_config(cm384_proj_opts *o, const cm384_config *c) {
    if (!o || !c || c->struct_size < offsetof(cm384_config, tpot_target_ms)) return;
    int paper = c->preset && !strcmp(c->preset, "paper");
    o->int8 = c->int8 != 0;
    o->int8_dispatch = c->int8_dispatch < 0 ? paper : c->int8_dispatch != 0;   /* -1: the preset's choice */
    o->microbatches = c->microbatches > 0 ? (c->microbatches >= 2 ? 2 : 1) : paper ? 2 : 1;
    o->mtp = c->mtp != 0;
    if (c->cache_bytes == (size_t)-1) o->cache_reuse = 0;
    /* bf16_combine: 0 is the preset's choice (on in the paper preset), 1 on, -1 off */
    o->bf16_combine = c->struct_size >= offsetof(cm384_config, bf16_combine) + sizeof c->bf16_combine
                    ? (c->bf16_combine == 0 ? paper : c->bf16_combine > 0) : paper;
    /* EPLB re-places the experts from measured load unless its period is -1 */
    o->eplb = c->struct_size >= offsetof(cm384_config, eplb_period) + sizeof c->eplb_period ? c->eplb_period >= 0 : 1;
}

/* ---- 15d. The deployment: the engine's own placement at full scale ---- */

/* What one projection needs of the model's shapes. */
typedef struct proj_shape {
    double D, H, q_lora, kv_lora, rope, nope, v, lat, inter, moe_inter, E, K, vocab;
    double n_shared;             /* shared experts fused (intermediate x n_shared) */
    double p_prolog;             /* q_a + q_b (or q) + kv_a + absorbed W_uk^T      */
    double p_qkv;                /* q_a + q_b (or q) + kv_a: the expanded form's   */
    double p_kvb;                /* kv_b, the expanded form's key/value up-proj    */
    double p_out;                /* absorbed W_uv + o_proj                         */
    double p_o;                  /* o_proj alone                                   */
    double p_attn_stored;        /* attention weights as stored                    */
    double p_expert, p_shared, p_dense, p_router, p_head, p_eh;
    int    n_layers, n_mtp;
} proj_shape;

static void proj_shape_of(const hparams *hp, proj_shape *s) {
    memset(s, 0, sizeof *s);
    s->D = hp->dim; s->H = hp->n_heads; s->q_lora = hp->q_lora; s->kv_lora = hp->kv_lora;
    s->rope = hp->qk_rope; s->nope = hp->qk_nope; s->v = hp->v_head; s->lat = s->kv_lora + s->rope;
    s->inter = hp->inter; s->moe_inter = hp->moe_inter; s->E = hp->n_routed; s->K = hp->top_k;
    s->vocab = hp->vocab; s->n_shared = hp->n_shared;
    double q = hp->q_lora ? s->D * s->q_lora + s->q_lora * s->H * (s->nope + s->rope) : s->D * s->H * (s->nope + s->rope);
    s->p_qkv = q + s->D * s->lat;
    s->p_prolog = s->p_qkv + s->H * s->nope * s->kv_lora;
    s->p_kvb = s->kv_lora * s->H * (s->nope + s->v);
    s->p_o = s->H * s->v * s->D;
    s->p_out = s->H * s->kv_lora * s->v + s->p_o;
    s->p_attn_stored = s->p_qkv + s->p_kvb + s->p_o;
    s->p_expert = 3 * s->D * s->moe_inter;
    s->p_shared = s->n_shared * s->p_expert;
    s->p_dense = 3 * s->D * s->inter;
    s->p_router = s->D * s->E;
    s->p_head = s->vocab * s->D;
    s->p_eh = 2 * s->D * s->D;
    s->n_layers = hp->n_layers; s->n_mtp = hp->n_mtp;
}

/* The engine's paper-preset topology for model m, built by the engine's own
 * build_topology on a shadow engine (no pool, no threads). */
static int proj_topology(const cm384_model *m, struct cm384_engine *e) {
    memset(e, 0, sizeof *e);
    e->m = m;
    cm384_config_init(&e->cfg);
    snprintf(e->preset, sizeof e->preset, "paper");
    e->n_workers = 1;
    const hparams *hp = &m->hp;
    int E = hp->n_routed, K = hp->top_k > 0 ? hp->top_k : 1;
    int need = (E >= 8 ? E / 8 : 1) + E + (hp->n_shared ? (E / K > 0 ? E / K : 1) : 0) + (E >= 8 ? E / 8 : 1);
    e->cfg.n_devices = need > e->cfg.n_devices ? need : e->cfg.n_devices;
    return build_topology(e);
}

/* What build_topology allocated (as cm384_engine_free frees it; the ASan run
 * of tests/test_project.c reports a leak if the two drift apart). */
static void proj_topology_free(struct cm384_engine *e) {
    pl_free(&e->place[0]);
    pl_free(&e->place[1]);
    CM384_FREE(e->dev); CM384_FREE(e->pre_devs); CM384_FREE(e->attn_devs); CM384_FREE(e->red_devs);
    CM384_FREE(e->exp_devs);
    CM384_FREE(e->eplb_ld); CM384_FREE(e->eplb_items); CM384_FREE(e->eplb_used); CM384_FREE(e->eplb_old);
}

/* ---- 15e. Expert load: perfect, or measured on a run and carried over ---- */

static uint64_t proj_rng(uint64_t *s) { *s += 0x9e3779b97f4a7c15ull; return mix64(*s); }

/* Per-expert routing probabilities (sum 1) of projected MoE layer j: uniform,
 * or the measured layer j % load_layers mapped onto E experts by quantiles
 * (the sorted load curve stretched to E points) and spread over expert ids
 * by a fixed pseudo-random permutation (seed `perm`). */
static void proj_layer_probs(const cm384_proj_opts *o, int j, int E, uint64_t perm, double *p) {
    if (!o->expert_load || o->load_layers <= 0 || o->load_experts <= 0) {
        for (int x = 0; x < E; x++) p[x] = 1.0 / E;
        return;
    }
    int Es = o->load_experts;
    const uint64_t *ld = o->expert_load + (size_t)(j % o->load_layers) * Es;
    double *s = CM384_MALLOC((size_t)Es * sizeof(double));
    int *idx = CM384_MALLOC((size_t)E * sizeof(int));
    if (!s || !idx) {                      /* out of memory: fall back to uniform */
        CM384_FREE(s); CM384_FREE(idx);
        for (int x = 0; x < E; x++) p[x] = 1.0 / E;
        return;
    }
    double sum = 0;
    for (int i = 0; i < Es; i++) { s[i] = (double)ld[i]; sum += s[i]; }
    for (int i = 1; i < Es; i++) {                       /* ascending */
        double v = s[i]; int k = i;
        while (k > 0 && s[k - 1] > v) { s[k] = s[k - 1]; k--; }
        s[k] = v;
    }
    double tot = 0;
    for (int x = 0; x < E; x++) {
        double u = ((x + 0.5) / E) * Es - 0.5;
        if (u < 0) u = 0;
        if (u > Es - 1) u = Es - 1;
        int i0 = (int)u, i1 = i0 + 1 < Es ? i0 + 1 : i0;
        double f = u - i0, val = sum > 0 ? s[i0] * (1 - f) + s[i1] * f : 1.0;
        p[x] = val;
        tot += val;
    }
    for (int x = 0; x < E; x++) idx[x] = x;
    uint64_t st = perm * 0x2545f4914f6cdd1dull + (uint64_t)j;
    for (int x = E - 1; x > 0; x--) {
        int y = (int)(proj_rng(&st) % (uint64_t)(x + 1));
        int t = idx[x]; idx[x] = idx[y]; idx[y] = t;
    }
    double *q = CM384_MALLOC((size_t)E * sizeof(double));
    if (q) {
        for (int x = 0; x < E; x++) q[idx[x]] = tot > 0 ? p[x] / tot : 1.0 / E;
        memcpy(p, q, (size_t)E * sizeof(double));
        CM384_FREE(q);
    } else {
        for (int x = 0; x < E; x++) p[x] = tot > 0 ? p[x] / tot : 1.0 / E;
    }
    CM384_FREE(s);
    CM384_FREE(idx);
}

/* Expected rows per device per token of one layer under a placement: a
 * token sends K rows to its experts (a replicated expert's rows split evenly
 * over its replicas, as moe_layout's t % n_rep does) and one to a shared
 * replica when the placement has them.  rows[] has n_dev entries. */
static void proj_device_rows(const placement *pl, int l, int E, int K, const double *p, double *rows, int n_dev) {
    const int *dev = pl_dev(pl, l), *nrep = pl_nrep(pl, l, E);
    for (int d = 0; d < n_dev; d++) rows[d] = 0;
    for (int x = 0; x < E; x++)
        for (int r = 0; r < nrep[x]; r++) {
            int d = dev[x * pl->max_rep + r];
            if (d >= 0 && d < n_dev) rows[d] += K * p[x] / nrep[x];
        }
    for (int j = 0; j < pl->n_shared; j++) {
        int d = dev[E * pl->max_rep + j];
        if (d >= 0 && d < n_dev) rows[d] += 1.0 / pl->n_shared;
    }
}

/* Per projected MoE layer: the busiest expert device's rows per token, in
 * decode and in prefill, averaged over a few expert-id permutations (the
 * expectation of the max).  Also the per-device loads of the first MoE layer
 * without and with EPLB, for the picture. */
typedef struct proj_load {
    int     n_moe;                 /* main MoE layers + the MTP layer's      */
    double *dec_max, *pre_max;     /* [n_moe] rows per token of the busiest  */
    double  dec_mean, pre_mean;    /* mean over expert devices               */
    double  dec_imb, pre_imb;      /* mean over layers of max/mean           */
} proj_load;

#define PROJ_PERMS 8

static int proj_loads(const cm384_model *m, const cm384_proj_opts *o, struct cm384_engine *sh, proj_load *L,
                       cm384_projection *out) {
    const hparams *hp = &m->hp;
    int E = hp->n_routed, K = hp->top_k, NL = hp->n_layers + hp->n_mtp, nd = sh->n_dev;
    int measured = o->expert_load && o->load_layers > 0 && o->load_experts > 0;
    memset(L, 0, sizeof *L);
    for (int l = 0; l < NL; l++) L->n_moe += m->layers[l].is_moe;
    L->dec_max = CM384_CALLOC((size_t)L->n_moe + 1, sizeof(double));
    L->pre_max = CM384_CALLOC((size_t)L->n_moe + 1, sizeof(double));
    double *p = CM384_MALLOC((size_t)E * sizeof(double));
    double *rows = CM384_MALLOC((size_t)nd * sizeof(double));
    uint64_t *ld = CM384_CALLOC((size_t)NL * E, sizeof(uint64_t));
    if (!L->dec_max || !L->pre_max || !p || !rows || !ld) {
        CM384_FREE(p); CM384_FREE(rows); CM384_FREE(ld);
        return fail(CM384_E_NOMEM, "out of memory for the projection");
    }
    int n_exp_dec = 0, n_exp_pre = sh->n_pre;
    for (int d = 0; d < nd; d++) n_exp_dec += (sh->dev[d].roles & (ROLE_EXPERT | ROLE_SHARED)) != 0;
    const placement *pd = &sh->place[PHASE_DECODE], *pp = &sh->place[PHASE_PREFILL];
    L->dec_mean = (K + (pd->n_shared ? 1.0 : 0.0)) / n_exp_dec;
    L->pre_mean = (double)K / n_exp_pre;
    int perms = measured ? PROJ_PERMS : 1;
    for (int pi = 0; pi < perms; pi++) {
        /* EPLB sees the load of every layer of this permutation */
        int j = 0;
        for (int l = 0; l < NL; l++) {
            if (!m->layers[l].is_moe) continue;
            proj_layer_probs(o, j++, E, (uint64_t)pi + 1, p);
            for (int x = 0; x < E; x++) ld[(size_t)l * E + x] = (uint64_t)(p[x] * 1e9);
        }
        if (o->eplb && measured) eplb_rebalance(sh, ld);
        j = 0;
        for (int l = 0; l < NL; l++) {
            if (!m->layers[l].is_moe) continue;
            for (int x = 0; x < E; x++) p[x] = ld[(size_t)l * E + x] / 1e9;
            proj_device_rows(pd, l, E, K, p, rows, nd);
            double mx = 0;
            for (int d = 0; d < nd; d++) if (rows[d] > mx) mx = rows[d];
            L->dec_max[j] += mx / perms;
            proj_device_rows(pp, l, E, K, p, rows, nd);
            mx = 0;
            for (int d = 0; d < nd; d++) if (rows[d] > mx) mx = rows[d];
            L->pre_max[j] += mx / perms;
            j++;
        }
    }
    /* the picture: first MoE layer, first permutation, without and with EPLB */
    int l0 = 0;
    while (l0 < NL && !m->layers[l0].is_moe) l0++;
    if (out && l0 < NL) {
        proj_layer_probs(o, 0, E, 1, p);
        for (int l = 0; l < NL; l++)
            for (int x = 0; x < E; x++) ld[(size_t)l * E + x] = m->layers[l].is_moe ? (uint64_t)(p[x] * 1e9) : 0;
        struct cm384_engine fresh;
        int n = 0;
        if (proj_topology(m, &fresh) == CM384_OK) {
            for (int pass = 0; pass < 2; pass++) {
                if (pass == 1) eplb_rebalance(&fresh, ld);
                proj_device_rows(&fresh.place[PHASE_DECODE], l0, E, K, p, rows, nd);
                n = 0;
                for (int d = 0; d < nd && n < CM384_PROJ_MAX_DEVICES; d++) {
                    if (!(fresh.dev[d].roles & (ROLE_EXPERT | ROLE_SHARED))) continue;
                    float v = (float)(rows[d] / L->dec_mean);
                    if (pass == 0) out->load_no_eplb[n++] = v; else out->load_eplb[n++] = v;
                }
            }
        }
        proj_topology_free(&fresh);
        out->n_load_devices = n;
    }
    double si = 0, sp = 0;
    for (int j = 0; j < L->n_moe; j++) { si += L->dec_max[j] / L->dec_mean; sp += L->pre_max[j] / L->pre_mean; }
    L->dec_imb = L->n_moe ? si / L->n_moe : 1;
    L->pre_imb = L->n_moe ? sp / L->n_moe : 1;
    CM384_FREE(p); CM384_FREE(rows); CM384_FREE(ld);
    return CM384_OK;
}

static void proj_load_free(proj_load *L) { CM384_FREE(L->dec_max); CM384_FREE(L->pre_max); }

/* ---- 15f. Pricing operators ---- */

/* One operator's demand on one device. */
typedef struct pop {
    const char *name;
    double flops;       /* arithmetic                                     */
    int    f8;          /* 8-bit arithmetic (INT8 / FP8 peak)             */
    int    mla;         /* the attention core: MLA's efficiencies         */
    double bytes;       /* HBM traffic                                    */
    double net;         /* fabric bytes (the busier of send and receive)  */
    int    net_kind;    /* 1 dispatch, 2 combine (measured fused ops), 3 bulk on the link */
    int    lane;        /* for the timeline                               */
} pop;

typedef struct proj_ctx {
    const cm384_hw  *hw;
    const cm384_proj_opts *o;
    proj_shape       s;
    double           ep_decode, ep_prefill;
    double           wb;              /* bytes per weight                 */
    double           msg_d, msg_c;    /* bytes per dispatch / combine message */
    int              shared_dest;     /* decode: a token also sends to a shared replica */
    int              n_dec, n_pre;    /* decode devices, prefill devices (one instance) */
} proj_ctx;

/* Latency of a fused all-to-all moving `bytes` per rank at EP degree ep:
 * the measured latency at the reference message volume, interpolated in
 * log(EP) between the two measured degrees (extrapolated beyond them), and
 * scaled by bytes -- i.e. the measured effective bandwidth. */
static double proj_a2a_us(const cm384_hw *hw, int combine, double ep, double bytes, int affine) {
    double lo = combine ? hw->combine_us_lo : hw->dispatch_us_lo, hi = combine ? hw->combine_us_hi : hw->dispatch_us_hi;
    double ref = hw->a2a_tokens * hw->a2a_topk * (combine ? hw->a2a_combine_bytes : hw->a2a_dispatch_bytes);
    if (ref <= 0 || lo <= 0) return bytes / (hw->link_gbs * 1e3);
    double f = hw->a2a_ep_hi > hw->a2a_ep_lo && ep > hw->a2a_ep_lo
             ? (log(ep) - log(hw->a2a_ep_lo)) / (log(hw->a2a_ep_hi) - log(hw->a2a_ep_lo)) : 0;
    double lat = lo + (hi - lo) * f;
    if (affine) {            /* the part the link's rate does not explain is fixed */
        double wire = ref / (hw->link_gbs * 1e3), fixed = lat - wire;
        return (fixed > 0 ? fixed : 0) + bytes / (hw->link_gbs * 1e3);
    }
    return lat * bytes / ref;
}

/* moe_layout's messages (section 7): a dispatched token is its payload (INT8
 * with a 4-byte scale, or fp32) and 8 bytes of routing metadata; a combined
 * one is the expert's output row (BF16 or fp32). */
static void proj_msg_bytes(int dim, int int8_dispatch, int bf16_combine, double *dispatch, double *combine) {
    *dispatch = int8_dispatch ? (double)dim + 4 + 8 : 4.0 * dim + 8;
    *combine = bf16_combine ? 2.0 * dim : 4.0 * dim;
}

/* Time of an operator (us) on a fraction `share` of the device's cores,
 * and what bounds it. */
static double pop_time(const proj_ctx *c, const pop *p, double share, double ep, char *bound) {
    const cm384_hw *hw = c->hw;
    double tc = 0, tm = 0, tn = 0;
    if (p->flops > 0) {
        double peak = (p->f8 ? hw->int8_tops : hw->bf16_tflops) * 1e6;       /* flops per us */
        double eff = p->mla ? hw->mla_flop_eff : hw->gemm_eff;
        tc = p->flops / (peak * eff * (share > 0 ? share : 1));
    }
    if (p->bytes > 0) tm = p->bytes / (hw->hbm_gbs * 1e3 * hw->mla_bw_eff);
    if (p->net > 0) {
        if (p->net_kind == 3) tn = p->net / (hw->link_gbs * 1e3) + hw->link_us;
        else tn = proj_a2a_us(hw, p->net_kind == 2, ep, p->net, c->o->a2a_affine) + hw->link_us;
    }
    double t = tc > tm ? tc : tm;
    if (tn > t) t = tn;
    if (bound) *bound = t == 0 ? '-' : t == tn ? 'n' : t == tc ? 'c' : 'm';
    return t;
}

/* ---- 15g. The engine's operators at full scale ---- */
/* seq_op's operator list: attention and feed-forward of every layer, then
 * the head; each becomes a short list of pops for n tokens of r requests
 * at mean context ctx. */

enum { PK_ATTN, PK_FFN, PK_HEAD, PK_MTP_IN };

typedef struct pbatch {
    double n, r, ctx;            /* tokens, requests, mean keys per query (decode) */
    int    prefill;
    double n_all;                /* prefill: tokens incl. cached (expanded kv_b)   */
    double keys;                 /* prefill: mean keys per new token               */
    double tokens_total;         /* tokens of this microbatch over all devices     */
} pbatch;

static int proj_ops(const proj_ctx *c, int kind, int layer, int moe_j, const pbatch *b, const proj_load *L,
                    pop *out) {
    const proj_shape *s = &c->s;
    const cm384_proj_opts *o = c->o;
    double n = b->n, act = 2.0;     /* BF16 activations */
    int k = 0;
    if (kind == PK_MTP_IN) {
        out[k++] = (pop){"eh_proj", 2 * n * s->p_eh, o->int8, 0, s->p_eh * c->wb + n * 3 * s->D * act, 0, 0, 0};
        return k;
    }
    if (kind == PK_HEAD) {
        double rows = b->prefill ? b->r : n;            /* prefill: one row per request */
        out[k++] = (pop){"head", 2 * rows * s->p_head, o->int8, 0, s->p_head * c->wb + rows * s->D * act, 0, 0, 0};
        return k;
    }
    if (kind == PK_ATTN) {
        int expanded = b->prefill && o->prefill_expanded;
        double qkv = expanded ? s->p_qkv : s->p_prolog;
        out[k++] = (pop){"MLAProlog", 2 * n * qkv, o->int8, 0,
                         qkv * c->wb + n * (s->D * act + s->lat * c->hw->kv_bytes), 0, 0, 0};
        if (expanded) {   /* keys and values of the whole context, cached prefix included */
            out[k++] = (pop){"kv_b", 2 * b->n_all * s->p_kvb, o->int8, 0, s->p_kvb * c->wb, 0, 0, 0};
        }
        double per_key = expanded ? s->H * (s->nope + s->rope + s->v) : s->H * (2 * s->kv_lora + s->rope);
        double keys = b->prefill ? b->keys : b->ctx;
        double kv_read = b->prefill ? b->n_all * s->lat * c->hw->kv_bytes : b->r * b->ctx * s->lat * c->hw->kv_bytes;
        out[k++] = (pop){"attention", 2 * n * per_key * keys, 0, 1, kv_read, 0, 0, 0};
        double po = expanded ? s->p_o : s->p_out;
        out[k++] = (pop){"o_proj", 2 * n * po, o->int8, 0, po * c->wb + n * s->D * act, 0, 0, 0};
        if (b->prefill && c->n_pre > 1) {
            /* SP-TP-SP: all-gather the q and kv latents for the head-parallel
               core, all-to-all its outputs back to the token owners */
            double np = c->n_pre;
            out[k++] = (pop){"all-gather", 0, 0, 0, 0, (np - 1) * n * (s->q_lora + s->lat) * act, 3, 2};
            out[k++] = (pop){"all-to-all", 0, 0, 0, 0, (np - 1) / np * n * s->H * s->v * act, 3, 2};
        }
        return k;
    }
    /* PK_FFN */
    if (moe_j < 0) {
        out[k++] = (pop){"dense FFN", 2 * n * s->p_dense, o->int8, 0, s->p_dense * c->wb + n * s->D * act, 0, 0, 1};
        return k;
    }
    double ep = b->prefill ? c->ep_prefill : c->ep_decode;
    double per_tok_max = b->prefill ? L->pre_max[moe_j] : L->dec_max[moe_j];
    double rows = b->tokens_total * per_tok_max;                 /* the busiest device's rows */
    double dests = s->K + (b->prefill ? 0 : c->shared_dest);
    double local = b->prefill ? 1.0 / ep : 1.0 / ep;
    double sent_d = n * dests * c->msg_d * (1 - local), recv_d = rows * c->msg_d;
    double sent_c = rows * c->msg_c, recv_c = n * dests * c->msg_c * (1 - local);
    int kind_net = b->prefill ? 3 : 0;
    out[k++] = (pop){"gate", 2 * n * s->p_router, 0, 0, s->p_router * 2 + n * s->D * act, 0, 0, 1};
    out[k++] = (pop){"dispatch", 0, 0, 0, 0, sent_d > recv_d ? sent_d : recv_d, kind_net ? 3 : 1, b->prefill ? 2 : 1};
    double hosted = b->prefill ? s->E / c->n_pre : 1;           /* experts whose weights a device reads */
    out[k++] = (pop){"experts", 2 * rows * s->p_expert, o->int8, 0,
                     hosted * s->p_expert * c->wb + rows * (s->D + 2 * s->moe_inter) * act, 0, 0, 1};
    if (b->prefill && s->p_shared > 0)
        out[k++] = (pop){"shared expert", 2 * n * s->p_shared, o->int8, 0, s->p_shared * c->wb + n * s->D * act, 0, 0, 1};
    out[k++] = (pop){"combine", 0, 0, 0, n * dests * s->D * act,
                     sent_c > recv_c ? sent_c : recv_c, kind_net ? 3 : 2, b->prefill ? 2 : 1};
    (void)layer;
    return k;
}

/* One stream's time for an operator's pops on `share` of the cores; the
 * compute (non-fabric) part alone in *compute, the fabric part in *net. */
static double proj_stream(const proj_ctx *c, const pop *p, int n, double share, double ep, double *compute,
                          double *net, double *bytes) {
    double t = 0, cm = 0, nt = 0, by = 0;
    for (int i = 0; i < n; i++) {
        double ti = pop_time(c, &p[i], share, ep, NULL);
        t += ti;
        if (p[i].net > 0) nt += ti; else cm += ti;
        by += p[i].bytes;
    }
    if (compute) *compute = cm;
    if (net) *net = nt;
    if (bytes) *bytes = by;
    return t;
}

/* Appends an operator's pops to a timeline starting at t0 on `lane`. */
static double proj_timeline(const proj_ctx *c, const pop *p, int n, double share, double ep, int mb, int lane_base,
                            double t0, cm384_proj_op *ops, int *n_ops) {
    double t = t0;
    for (int i = 0; i < n && *n_ops < CM384_PROJ_MAX_OPS; i++) {
        cm384_proj_op *q = &ops[(*n_ops)++];
        memset(q, 0, sizeof *q);
        snprintf(q->name, sizeof q->name, "%s", p[i].name);
        double d = pop_time(c, &p[i], share, ep, &q->bound);
        q->lane = p[i].net_kind == 3 ? 2 : lane_base;
        q->microbatch = mb;
        q->start_us = t;
        q->dur_us = d;
        q->flops = p[i].flops; q->bytes = p[i].bytes; q->net_bytes = p[i].net;
        t += d;
    }
    return t;
}

/* One region of the engine's schedule: operator x of one microbatch beside
 * operator y of the other (either may be absent).  With a static core split
 * (CloudMatrix decode) each runs on its stream's cores and they share the
 * HBM; without one (prefill, H800) compute serializes and fabric transfers
 * overlap. */
static double proj_region(const proj_ctx *c, const pop *x, int nx, int x_attn, const pop *y, int ny, double ep,
                          int split) {
    double cx = 0, cy = 0, netx = 0, nety = 0, bx = 0, by = 0;
    if (split) {
        double f0 = c->hw->cube_cores > 0 ? c->hw->attn_cube_cores / c->hw->cube_cores : 0.5;
        double sx = x_attn ? f0 : 1 - f0, sy = x_attn ? 1 - f0 : f0;
        double tx = nx ? proj_stream(c, x, nx, sx, ep, NULL, NULL, &bx) : 0;
        double ty = ny ? proj_stream(c, y, ny, sy, ep, NULL, NULL, &by) : 0;
        double tm = (bx + by) / (c->hw->hbm_gbs * 1e3 * c->hw->mla_bw_eff);
        double t = tx > ty ? tx : ty;
        return t > tm ? t : tm;
    }
    double tx = nx ? proj_stream(c, x, nx, 1, ep, &cx, &netx, NULL) : 0;
    double ty = ny ? proj_stream(c, y, ny, 1, ep, &cy, &nety, NULL) : 0;
    if (!nx || !ny) return tx + ty;
    double t = cx + cy, tn = netx + nety;
    if (tn > t) t = tn;
    if (tx > t) t = tx;
    if (ty > t) t = ty;
    return t;
}

/* seq_op's i-th operator of the main model: kind, layer, MoE index. */
static void proj_seq(const cm384_model *m, int i, int *kind, int *layer, int *moe_j) {
    int NL = m->hp.n_layers;
    *moe_j = -1;
    if (i >= 2 * NL) { *kind = PK_HEAD; *layer = -1; return; }
    *layer = i / 2;
    *kind = i % 2 ? PK_FFN : PK_ATTN;
    if (*kind == PK_FFN && m->layers[*layer].is_moe) {
        int j = 0;
        for (int l = 0; l < *layer; l++) j += m->layers[l].is_moe;
        *moe_j = j;
    }
}

/* forward_main at full scale: n_mb microbatches (b[0], b[1]) through every
 * operator, regions as the engine forms them.  Returns us; acc (may be
 * NULL) gets the time by part: dense layers, MoE layers, head. */
static double proj_forward(const proj_ctx *c, const cm384_model *m, const pbatch *b, int n_mb, const proj_load *L,
                           int split, double ep, double *acc) {
    int n_ops = 2 * m->hp.n_layers + 1;
    pop px[16], py[16];
    double t = 0;
    for (int i = 0; i <= n_ops; i++) {
        int kx = -1, ky = -1, layer, j, nx = 0, ny = 0, lx = -1, ly = -1;
        if (i < n_ops) { proj_seq(m, i, &kx, &lx, &j); nx = proj_ops(c, kx, lx, j, &b[0], L, px); }
        if (n_mb == 2 && i >= 1) { proj_seq(m, i - 1, &ky, &ly, &j); ny = proj_ops(c, ky, ly, j, &b[1], L, py); }
        double dt;
        if (n_mb == 1) {
            if (!nx) break;
            dt = proj_region(c, px, nx, 1, NULL, 0, ep, 0);
        } else if (!nx) {
            dt = proj_region(c, py, ny, ky != PK_FFN, NULL, 0, ep, split);
        } else {
            dt = proj_region(c, px, nx, kx != PK_FFN, py, ny, ep, split);
        }
        t += dt;
        if (acc) {
            int kind = nx ? kx : ky;
            layer = nx ? lx : ly;
            int part = kind == PK_HEAD ? 2 : m->layers[layer].is_moe ? 1 : 0;
            acc[part] += dt;
        }
    }
    return t;
}

/* The MTP module (mtp_step: one microbatch after the main model). */
static double proj_mtp(const proj_ctx *c, const cm384_model *m, const pbatch *b, const proj_load *L, double ep) {
    pop p[16];
    int n, j = L->n_moe - 1;
    double t = 0;
    n = proj_ops(c, PK_MTP_IN, m->hp.n_layers, -1, b, L, p); t += proj_region(c, p, n, 1, NULL, 0, ep, 0);
    n = proj_ops(c, PK_ATTN, m->hp.n_layers, -1, b, L, p);   t += proj_region(c, p, n, 1, NULL, 0, ep, 0);
    n = proj_ops(c, PK_FFN, m->hp.n_layers, j, b, L, p);     t += proj_region(c, p, n, 1, NULL, 0, ep, 0);
    n = proj_ops(c, PK_HEAD, m->hp.n_layers, -1, b, L, p);   t += proj_region(c, p, n, 1, NULL, 0, ep, 0);
    return t;
}

/* ---- 15h. Decode and prefill ---- */

typedef struct proj_decode { double step_us, main_us, mtp_us, gap_us, tpot_ms, tok_s, hbm_gb, layer_us, parts[3]; } proj_decode;

/* Splits r requests per device into the engine's microbatches (run_phase
 * splits by tokens into halves) and prices one decode step. */
static void proj_decode_step(const proj_ctx *c, const cm384_model *m, double batch_npu, const proj_load *L,
                             proj_decode *d) {
    const cm384_proj_opts *o = c->o;
    const proj_shape *s = &c->s;
    double r = batch_npu / c->hw->dies_per_npu;                  /* requests per device */
    double q = o->mtp && m->hp.n_mtp ? 2 : 1;                    /* rows per request: last token + draft */
    double acc = o->mtp && m->hp.n_mtp ? o->mtp_accept : 0;
    double ctx = o->prompt + o->output / 2.0;
    int n_mb = o->microbatches >= 2 && r >= 2 ? 2 : 1;
    int split = c->hw->attn_cube_cores > 0;
    pbatch b[2];
    memset(b, 0, sizeof b);
    memset(d->parts, 0, sizeof d->parts);
    double r0 = n_mb == 2 ? ceil(r / 2) : r, r1 = r - r0;
    b[0].r = r0; b[0].n = r0 * q; b[0].ctx = ctx; b[0].tokens_total = b[0].n * c->n_dec;
    b[1].r = r1; b[1].n = r1 * q; b[1].ctx = ctx; b[1].tokens_total = b[1].n * c->n_dec;
    d->main_us = proj_forward(c, m, b, n_mb, L, split, c->ep_decode, d->parts);
    d->mtp_us = 0;
    if (acc > 0 || (o->mtp && m->hp.n_mtp)) {
        pbatch bm = {0};
        bm.r = r; bm.n = r * (1 + acc); bm.ctx = ctx; bm.tokens_total = bm.n * c->n_dec;
        d->mtp_us = proj_mtp(c, m, &bm, L, c->ep_decode);
    }
    double graphs = 1 + (o->mtp && m->hp.n_mtp ? 1 : 0);
    d->gap_us = o->graph_bundling ? 0 : graphs * c->hw->graph_gap_ms * 1e3;
    d->step_us = d->main_us + d->mtp_us + d->gap_us;
    d->tpot_ms = d->step_us / 1e3 / (1 + acc);
    d->tok_s = batch_npu * (1 + acc) / (d->step_us / 1e6);
    /* one MoE layer in steady state: two regions */
    pop pa[16], pf[16];
    int j0 = 0, l0 = 0;
    while (l0 < s->n_layers && !m->layers[l0].is_moe) l0++;
    int na = proj_ops(c, PK_ATTN, l0, -1, &b[0], L, pa), nf = proj_ops(c, PK_FFN, l0, j0, &b[n_mb - 1], L, pf);
    d->layer_us = n_mb == 2 ? 2 * proj_region(c, pa, na, 1, pf, nf, c->ep_decode, split)
                            : proj_region(c, pa, na, 1, NULL, 0, c->ep_decode, 0) + proj_region(c, pf, nf, 0, NULL, 0, c->ep_decode, 0);
    /* memory per device: weights, the KV of its requests, nothing else counted */
    double NLk = s->n_layers + s->n_mtp, n_dense = 0;
    for (int l = 0; l < s->n_layers; l++) n_dense += !m->layers[l].is_moe;
    double w = NLk * s->p_attn_stored * c->wb + n_dense * s->p_dense * c->wb + (L->n_moe) * s->p_expert * c->wb +
               s->p_head * c->wb + s->vocab * s->D * 2 + (s->n_mtp ? s->p_eh * c->wb : 0);
    double kv = r * (o->prompt + o->output) * NLk * s->lat * c->hw->kv_bytes;
    d->hbm_gb = (w + kv) / 1e9;
}

typedef struct proj_prefill { double batch_us, tok_s, layer_us; } proj_prefill;

static void proj_prefill_batch(const proj_ctx *c, const cm384_model *m, const proj_load *L, proj_prefill *pr) {
    const cm384_proj_opts *o = c->o;
    double T = o->prefill_tokens / c->hw->dies_per_npu;           /* prompt tokens per device */
    double P = o->prompt, rr = o->cache_reuse;
    double n_new = T * (1 - rr);
    int n_mb = o->microbatches >= 2 ? 2 : 1;
    pbatch b[2];
    memset(b, 0, sizeof b);
    for (int i = 0; i < n_mb; i++) {
        b[i].prefill = 1;
        b[i].n = n_new / n_mb;
        b[i].n_all = T / n_mb;
        b[i].r = T / P / n_mb;
        b[i].keys = (P * (1 + rr) + 1) / 2;                      /* causal: mean keys of a new token */
        b[i].tokens_total = b[i].n * c->n_pre;
    }
    pr->batch_us = proj_forward(c, m, b, n_mb, L, 0, c->ep_prefill, NULL);
    pr->tok_s = o->prefill_tokens / (pr->batch_us / 1e6);
    pop pa[16], pf[16];
    int l0 = 0;
    while (l0 < m->hp.n_layers && !m->layers[l0].is_moe) l0++;
    int na = proj_ops(c, PK_ATTN, l0, -1, &b[0], L, pa), nf = proj_ops(c, PK_FFN, l0, 0, &b[n_mb - 1], L, pf);
    pr->layer_us = n_mb == 2 ? 2 * proj_region(c, pa, na, 1, pf, nf, c->ep_prefill, 0)
                             : proj_region(c, pa, na, 1, NULL, 0, c->ep_prefill, 0) + proj_region(c, pf, nf, 0, NULL, 0, c->ep_prefill, 0);
}

/* The timelines of one MoE layer in steady state: decode (two microbatches
 * on two streams: attention of one beside the MoE of the other, then the
 * other way round) and prefill (compute on the cube cores, transfers on the
 * fabric's DMA lane). */
static void proj_timelines(const proj_ctx *c, const cm384_model *m, const proj_load *L, int batch_npu,
                           cm384_projection *out) {
    const cm384_proj_opts *o = c->o;
    int l0 = 0;
    while (l0 < m->hp.n_layers && !m->layers[l0].is_moe) l0++;
    pop pa[16], pf[16];
    /* decode */
    {
        double r = batch_npu / c->hw->dies_per_npu, q = o->mtp && m->hp.n_mtp ? 2 : 1;
        int n_mb = o->microbatches >= 2 && r >= 2 ? 2 : 1, split = c->hw->attn_cube_cores > 0;
        double f0 = split ? c->hw->attn_cube_cores / c->hw->cube_cores : 1;
        pbatch b = {0};
        b.r = n_mb == 2 ? ceil(r / 2) : r; b.n = b.r * q; b.ctx = o->prompt + o->output / 2.0;
        b.tokens_total = b.n * c->n_dec;
        int na = proj_ops(c, PK_ATTN, l0, -1, &b, L, pa), nf = proj_ops(c, PK_FFN, l0, 0, &b, L, pf);
        out->n_decode_ops = 0;
        if (n_mb == 2) {
            double r1 = proj_region(c, pa, na, 1, pf, nf, c->ep_decode, split);
            proj_timeline(c, pa, na, f0, c->ep_decode, 0, 0, 0, out->decode_ops, &out->n_decode_ops);
            proj_timeline(c, pf, nf, split ? 1 - f0 : 1, c->ep_decode, 1, 1, 0, out->decode_ops, &out->n_decode_ops);
            proj_timeline(c, pf, nf, split ? 1 - f0 : 1, c->ep_decode, 0, 1, r1, out->decode_ops, &out->n_decode_ops);
            proj_timeline(c, pa, na, f0, c->ep_decode, 1, 0, r1, out->decode_ops, &out->n_decode_ops);
        } else {
            double t = proj_timeline(c, pa, na, 1, c->ep_decode, 0, 0, 0, out->decode_ops, &out->n_decode_ops);
            proj_timeline(c, pf, nf, 1, c->ep_decode, 0, 0, t, out->decode_ops, &out->n_decode_ops);
        }
    }
    /* prefill: compute ops back to back on lane 0, transfers on lane 2 */
    {
        int n_mb = o->microbatches >= 2 ? 2 : 1;
        double T = o->prefill_tokens / c->hw->dies_per_npu, P = o->prompt, rr = o->cache_reuse;
        pbatch b = {0};
        b.prefill = 1; b.n = T * (1 - rr) / n_mb; b.n_all = T / n_mb; b.r = T / P / n_mb;
        b.keys = (P * (1 + rr) + 1) / 2; b.tokens_total = b.n * c->n_pre;
        int na = proj_ops(c, PK_ATTN, l0, -1, &b, L, pa), nf = proj_ops(c, PK_FFN, l0, 0, &b, L, pf);
        out->n_prefill_ops = 0;
        double tc = 0, tn = 0;
        for (int pass = 0; pass < n_mb; pass++) {
            for (int half = 0; half < 2; half++) {
                const pop *p = half ? pf : pa;
                int n = half ? nf : na;
                for (int i = 0; i < n && out->n_prefill_ops < CM384_PROJ_MAX_OPS; i++) {
                    cm384_proj_op *q = &out->prefill_ops[out->n_prefill_ops++];
                    memset(q, 0, sizeof *q);
                    snprintf(q->name, sizeof q->name, "%s", p[i].name);
                    q->dur_us = pop_time(c, &p[i], 1, c->ep_prefill, &q->bound);
                    q->microbatch = n_mb == 2 ? (half ? 1 - pass : pass) : 0;
                    q->flops = p[i].flops; q->bytes = p[i].bytes; q->net_bytes = p[i].net;
                    if (p[i].net > 0) { q->lane = 2; q->start_us = n_mb == 2 ? tn : tc; tn = q->start_us + q->dur_us; if (n_mb == 1) tc = tn; }
                    else { q->lane = 0; q->start_us = tc; tc += q->dur_us; }
                }
            }
        }
    }
}

/* ---- 15i. The projection ---- */

static int project(const cm384_model *m, const cm384_proj_opts *opts, cm384_projection *out);

int cm384_project(const cm384_model *m, const cm384_proj_opts *opts, cm384_projection *out) {
    if (!m || !out) return fail(CM384_E_INVALID, "cm384_project: model and out must not be NULL");
    if (out->struct_size && out->struct_size < offsetof(cm384_projection, decode_devices))
        return fail(CM384_E_INVALID, "cm384_project: out->struct_size %zu is too small", out->struct_size);
    /* filled in whole, then copied as far as the caller's struct reaches */
    size_t sz = out->struct_size && out->struct_size < sizeof *out ? out->struct_size : sizeof *out;
    cm384_projection *res = CM384_CALLOC(1, sizeof *res);
    if (!res) return fail(CM384_E_NOMEM, "out of memory for the projection");
    int r = project(m, opts, res);
    if (!r) {
        res->struct_size = sz;
        memcpy(out, res, sz);
    }
    CM384_FREE(res);
    return r;
}

static int project(const cm384_model *m, const cm384_proj_opts *opts, cm384_projection *out) {
    cm384_proj_opts o;
    cm384_proj_opts_init(&o);
    if (opts) {
        if (opts->struct_size < offsetof(cm384_proj_opts, prompt) || opts->struct_size > 65536)
            return fail(CM384_E_INVALID, "cm384_project: opts->struct_size %zu is not valid", opts->struct_size);
        memcpy(&o, opts, opts->struct_size < sizeof o ? opts->struct_size : sizeof o);
    }
    if (m->tokenizer_only || m->hp.n_routed <= 0 || m->hp.top_k <= 0)
        return fail(CM384_E_UNSUPPORTED, "%s: the projection needs a mixture-of-experts model", m->path ? m->path : "model");
    if (o.prompt < 1 || o.output < 1 || o.prompt > 1 << 24 || o.output > 1 << 24)
        return fail(CM384_E_INVALID, "cm384_project: prompt %d and output %d must be 1 .. 16M", o.prompt, o.output);
    if (o.max_batch < 1 || o.max_batch > 1 << 16 || o.batch < 0 || o.batch > 1 << 16)
        return fail(CM384_E_INVALID, "cm384_project: batch %d / max_batch %d out of range", o.batch, o.max_batch);
    if (!(o.mtp_accept >= 0 && o.mtp_accept <= 1) || !(o.cache_reuse >= 0 && o.cache_reuse < 1) || !(o.tpot_slo_ms >= 0))
        return fail(CM384_E_INVALID, "cm384_project: mtp_accept and cache_reuse must be in [0, 1), tpot_slo_ms >= 0");
    if (o.prefill_tokens < o.prompt)
        return fail(CM384_E_INVALID, "cm384_project: prefill_tokens %d is less than one prompt (%d)", o.prefill_tokens, o.prompt);
    if (!o.batch && !(o.tpot_slo_ms > 0))
        return fail(CM384_E_INVALID, "cm384_project: give a batch or a TPOT target");
    if (o.expert_load && (o.load_layers <= 0 || o.load_experts <= 0 || o.load_experts > 1 << 16))
        return fail(CM384_E_INVALID, "cm384_project: expert_load needs load_layers and load_experts");
    cm384_hw hw;
    if (o.hw_params) {
        if (o.hw_params->struct_size < sizeof hw) return fail(CM384_E_INVALID, "cm384_project: hw_params->struct_size too small");
        hw = *o.hw_params;
    } else {
        hw.struct_size = sizeof hw;
        int r = cm384_hw_get(o.hw ? o.hw : "cloudmatrix384", &hw);
        if (r) return r;
    }
    if (!(hw.bf16_tflops > 0 && hw.int8_tops > 0 && hw.hbm_gbs > 0 && hw.link_gbs > 0 && hw.gemm_eff > 0 &&
          hw.mla_flop_eff > 0 && hw.mla_bw_eff > 0 && hw.dies_per_npu >= 1))
        return fail(CM384_E_INVALID, "cm384_project: hardware \"%s\" lacks a peak, a bandwidth or an efficiency", hw.name);

    struct cm384_engine sh;
    int r = proj_topology(m, &sh);
    if (r) { proj_topology_free(&sh); return r; }
    proj_ctx c;
    memset(&c, 0, sizeof c);
    c.hw = &hw;
    c.o = &o;
    proj_shape_of(&m->hp, &c.s);
    c.n_dec = sh.n_attn;
    c.n_pre = sh.n_pre;
    int n_exp = 0;
    for (int d = 0; d < sh.n_dev; d++) n_exp += (sh.dev[d].roles & (ROLE_EXPERT | ROLE_SHARED)) != 0;
    c.ep_decode = n_exp;
    c.ep_prefill = sh.n_pre;
    c.shared_dest = sh.place[PHASE_DECODE].n_shared > 0;
    c.wb = o.int8 ? 1 : 2;
    proj_msg_bytes(m->hp.dim, o.int8_dispatch, o.bf16_combine, &c.msg_d, &c.msg_c);

    memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    snprintf(out->hw, sizeof out->hw, "%s", hw.name);
    out->decode_devices = sh.n_attn;
    out->expert_devices = n_exp;
    out->shared_replicas = sh.place[PHASE_DECODE].n_shared;
    out->redundant_experts = sh.n_red;
    out->prefill_devices = sh.n_pre;

    proj_load L;
    r = proj_loads(m, &o, &sh, &L, out);
    if (r) { proj_load_free(&L); proj_topology_free(&sh); return r; }
    out->decode_load_max_over_mean = L.dec_imb;
    out->prefill_load_max_over_mean = L.pre_imb;

    /* decode: the given batch, or the largest that meets the target */
    proj_decode d, best;
    memset(&best, 0, sizeof best);
    int chosen = 0;
    if (o.batch) {
        proj_decode_step(&c, m, o.batch, &L, &best);
        chosen = o.batch;
        out->feasible = (o.tpot_slo_ms <= 0 || best.tpot_ms <= o.tpot_slo_ms) && best.hbm_gb <= hw.hbm_gb;
    } else {
        for (int bsz = 8; bsz <= o.max_batch; bsz += 8) {
            proj_decode_step(&c, m, bsz, &L, &d);
            if (d.tpot_ms > o.tpot_slo_ms || d.hbm_gb > hw.hbm_gb) break;
            best = d;
            chosen = bsz;
        }
        out->feasible = chosen > 0;
        if (!chosen) { chosen = 8 < o.max_batch ? 8 : o.max_batch; proj_decode_step(&c, m, chosen, &L, &best); }
    }
    out->batch = chosen;
    out->tpot_ms = best.tpot_ms;
    out->step_ms = best.step_us / 1e3;
    out->decode_tok_s = best.tok_s;
    out->tokens_per_step = 1 + (o.mtp && m->hp.n_mtp ? o.mtp_accept : 0);
    out->layer_us = best.layer_us;
    out->hbm_used_gb = best.hbm_gb;

    /* what one decode device sends per step: its tokens' messages in every
       MoE layer (the MTP layer included) */
    {
        double r_dev = chosen / hw.dies_per_npu, q = o.mtp && m->hp.n_mtp ? 2 : 1;
        double acc = o.mtp && m->hp.n_mtp ? o.mtp_accept : 0;
        double msgs = ((L.n_moe - m->hp.n_mtp) * r_dev * q + (m->hp.n_mtp && o.mtp ? r_dev * (1 + acc) : 0)) *
                      (c.s.K + c.shared_dest);
        out->dispatch_mb = msgs * c.msg_d / 1e6;
        out->combine_mb = msgs * c.msg_c / 1e6;
    }
    out->n_step_ops = 0;
    {
        const char *names[5] = {"dense layers", "MoE layers", "head", "MTP draft", "host gaps"};
        double v[5] = {best.parts[0], best.parts[1], best.parts[2], best.mtp_us, best.gap_us}, t = 0;
        for (int i = 0; i < 5; i++) {
            if (v[i] <= 0) continue;
            cm384_proj_op *q = &out->step_ops[out->n_step_ops++];
            memset(q, 0, sizeof *q);
            snprintf(q->name, sizeof q->name, "%s", names[i]);
            q->start_us = t; q->dur_us = v[i]; q->bound = i == 4 ? 'h' : '-';
            t += v[i];
        }
    }

    /* prefill */
    proj_prefill pf;
    proj_prefill_batch(&c, m, &L, &pf);
    out->prefill_tok_s = pf.tok_s;
    out->prefill_batch_ms = pf.batch_us / 1e3;
    double kv_req = o.prompt * (c.s.n_layers + c.s.n_mtp) * c.s.lat * hw.kv_bytes;
    out->ttft_ms = out->prefill_batch_ms + o.cache_reuse * kv_req / (hw.pool_gbs * 1e6);

    proj_timelines(&c, m, &L, chosen, out);
    proj_load_free(&L);
    proj_topology_free(&sh);
    return CM384_OK;
}

static const char *proj_bound_name(char b) {
    return b == 'c' ? "compute" : b == 'm' ? "memory" : b == 'n' ? "fabric" : b == 'h' ? "host" : "";
}

/* lanes: 1 decode (two streams), 2 prefill (cube cores and the fabric's DMA) */
static void proj_ops_text(strbuf *b, const cm384_proj_op *ops, int n, int lanes) {
    for (int i = 0; i < n; i++) {
        const cm384_proj_op *q = &ops[i];
        char lane[24];
        snprintf(lane, sizeof lane, "%s", q->lane == 2 ? "fabric DMA" : lanes == 2 ? "cube cores" : q->lane == 1 ? "MoE stream" : "attn stream");
        sb_printf(b, "    %-14s %-11s mb%d %8.1f +%8.1f us  %-7s", q->name, lane, q->microbatch, q->start_us, q->dur_us,
                  proj_bound_name(q->bound));
        if (q->flops > 0) sb_printf(b, " %8.2f GFLOP", q->flops / 1e9);
        if (q->bytes > 0) sb_printf(b, " %8.2f MB HBM", q->bytes / 1e6);
        if (q->net_bytes > 0) sb_printf(b, " %7.2f MB fabric", q->net_bytes / 1e6);
        sb_puts(b, "\n");
    }
}

int cm384_projection_report(const cm384_projection *p, char *buf, size_t cap) {
    if (!p) return fail(CM384_E_INVALID, "cm384_projection_report: NULL projection");
    if (p->struct_size != sizeof *p)
        return fail(CM384_E_INVALID, "cm384_projection_report: struct_size %zu is not this version's %zu",
                    p->struct_size, sizeof *p);
    strbuf b = {0};
    sb_printf(&b, "projection on %s: decode %d devices (EP%d: %d shared-expert replicas, %d redundant experts, "
              "attention DP%d), prefill instances of %d devices (EP%d)\n",
              p->hw, p->decode_devices, p->expert_devices, p->shared_replicas, p->redundant_experts, p->decode_devices,
              p->prefill_devices, p->prefill_devices);
    sb_printf(&b, "decode: batch %d per NPU%s: TPOT %.1f ms, step %.1f ms (%.2f tokens per request per step), "
              "%.0f tokens/s per NPU\n", p->batch, p->feasible ? "" : " (no batch meets the target)", p->tpot_ms,
              p->step_ms, p->tokens_per_step, p->decode_tok_s);
    sb_printf(&b, "  one MoE layer %.0f us; HBM per device %.1f GB; per device per step dispatch %.1f MB, combine %.1f MB; "
              "expert-device load max/mean %.2f\n", p->layer_us, p->hbm_used_gb, p->dispatch_mb, p->combine_mb,
              p->decode_load_max_over_mean);
    sb_puts(&b, "  the step by part:\n");
    for (int i = 0; i < p->n_step_ops; i++)
        sb_printf(&b, "    %-14s %8.2f ms\n", p->step_ops[i].name, p->step_ops[i].dur_us / 1e3);
    sb_puts(&b, "  one MoE layer, per device (two microbatches: attention of one beside the MoE of the other):\n");
    proj_ops_text(&b, p->decode_ops, p->n_decode_ops, 1);
    sb_printf(&b, "prefill: %.0f tokens/s per NPU; a batch %.1f ms (TTFT %.1f ms); expert-device load max/mean %.2f\n",
              p->prefill_tok_s, p->prefill_batch_ms, p->ttft_ms, p->prefill_load_max_over_mean);
    sb_puts(&b, "  one MoE layer, per device (cube cores, and the fabric's DMA in parallel):\n");
    proj_ops_text(&b, p->prefill_ops, p->n_prefill_ops, 2);
    if (b.oom) { free(b.p); return fail(CM384_E_NOMEM, "out of memory"); }
    int n = copy_out(b.p ? b.p : "", b.n, buf, cap);
    free(b.p);
    return n;
}

#endif /* CM384_C_INCLUDED */

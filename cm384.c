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
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "cm384.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ggml_like/ggml_like.c"

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

static void *arena_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > (1u << 20) ? n : (1u << 20);
        c = malloc(sizeof(arena_chunk) + 16 + cap);
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

/* Growable byte buffer (strings built at load time, never on the token path). */
typedef struct { char *p; size_t n, cap; int oom; } strbuf;

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

/* A whole file, memory-mapped read-only (or read into memory). */
typedef struct { const uint8_t *data; size_t size; int mapped; } file_map;

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
        void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        close(fd);
        if (p == MAP_FAILED) return fail(CM384_E_NOMEM, "%s: mmap of %zu bytes failed: %s",
                                         path, f->size, strerror(errno));
        f->data = p; f->mapped = 1;
        return CM384_OK;
    }
    uint8_t *buf = malloc(f->size);
    if (!buf) { close(fd); return fail(CM384_E_NOMEM, "%s: cannot allocate %zu bytes", path, f->size); }
    size_t got = 0;
    while (got < f->size) {
        ssize_t r = read(fd, buf + got, f->size - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            free(buf); close(fd);
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
    else free((void *)f->data);
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
#ifdef CM384_HAVE_TOKENIZER
#include "tok_section.c"
#else
/* placeholder until the tokenizer section lands */
typedef struct tokenizer { int n; } tokenizer;
static int tokenizer_load(tokenizer **out, const char *json_path, const char *cfg_path) {
    (void)cfg_path; *out = NULL;
    if (!file_exists(json_path)) return fail(CM384_E_IO, "%s: cannot open", json_path);
    tokenizer *t = calloc(1, sizeof *t); if (!t) return CM384_E_NOMEM;
    t->n = 1024; *out = t; return CM384_OK;
}
static void tokenizer_free(tokenizer *t) { free(t); }
static int tokenizer_n_ids(const tokenizer *t) { return t->n; }
static int tokenizer_bos(const tokenizer *t) { (void)t; return 0; }
static int tokenizer_eos(const tokenizer *t) { (void)t; return 1; }
static int tokenizer_encode(const tokenizer *t, const char *text, size_t len, int32_t *out, int cap, unsigned flags) {
    (void)t; (void)text; (void)len; (void)out; (void)cap; (void)flags; return CM384_E_UNSUPPORTED;
}
static int tokenizer_piece(const tokenizer *t, int32_t id, const char **bytes, int *len) {
    (void)t; (void)id; *bytes = "?"; *len = 1; return CM384_OK;
}
static int tokenizer_is_special(const tokenizer *t, int32_t id) { (void)t; (void)id; return 0; }
static int tokenizer_decode(const tokenizer *t, const int32_t *ids, int n, char *out, size_t cap) {
    (void)t; (void)ids; return copy_out("????????????????", (size_t)(n < 16 ? n : 16), out, cap);
}
static int chat_render(const tokenizer *t, const cm384_chat_msg *msgs, int n, unsigned flags, char *out, size_t cap) {
    (void)t; (void)msgs; (void)n; (void)flags; (void)out; (void)cap; return CM384_E_UNSUPPORTED;
}
static int detok_stream_push(const tokenizer *t, cm384_detok_stream *s, int32_t id, char *out, size_t cap) {
    (void)t; (void)s; (void)id; (void)out; (void)cap; return 0;
}
static int detok_stream_flush(cm384_detok_stream *s, char *out, size_t cap) { (void)s; (void)out; (void)cap; return 0; }
#endif

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
    r |= cfg_num(cfg, "routed_scaling_factor", 1.0, &d, path); hp->route_scale = (float)d;
    r |= cfg_num(cfg, "rope_theta", 10000.0, &hp->rope_theta, path);
    r |= cfg_num(cfg, "rms_norm_eps", 1e-6, &d, path); hp->eps = (float)d;
    if (r) return CM384_E_FORMAT;
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
    }
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

struct cm384_model {
    char         *path;
    hparams       hp;
    int           tokenizer_only;
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
    int           main_dtype;
    /* load-time progress */
    cm384_progress_fn progress;
    void         *progress_user;
    uint64_t      progress_done, progress_total;
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
        return fail(CM384_E_UNSUPPORTED, "%s: tensor \"%s\" has dtype %s; weights must be F32, F16, BF16 or F8_E4M3",
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
    if (t->dtype == GL_F32 && ((uintptr_t)t->data & 3)) {
        /* misaligned fp32 data cannot be read through a float pointer */
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
    else gl_row_to_f32(&g, 0, v);
    *out = v;
    m->n_params += (uint64_t)n;
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

/* A matrix in a type every kernel reads, made from rows of another: used for
 * the absorbed-attention matrices.  fp8 is widened to bf16 as the official
 * code does (weight_dequant). */
static int derive_mat(cm384_model *m, const gl_mat *src, int row0, int rows, int transpose, gl_mat *out) {
    int type = src->type == GL_F32 ? GL_F32 : src->type == GL_F16 ? GL_F16 : GL_BF16;
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
            v.data = (const uint8_t *)L->wkv_b.data + (size_t)(base + hp->qk_nope) * hp->kv_lora * gl_type_size(v.type);
            L->w_uv[h] = v;
        }
    }

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
    m->layers = arena_alloc(&m->a, (size_t)nl * sizeof(layer_w));
    m->rope_freq = arena_alloc(&m->a, (size_t)(hp->qk_rope / 2) * sizeof(float));
    if (!m->layers || !m->rope_freq) return fail(CM384_E_NOMEM, "out of memory");
    memset(m->layers, 0, (size_t)nl * sizeof(layer_w));
    for (int l = 0; l < nl; l++) {
        if ((r = bind_layer(m, l))) return r;
        if (m->layers[l].wkv_a.type != GL_BF16 || l == 0) m->main_dtype = m->layers[l].wkv_a.type;
    }
    rope_setup(m);

    /* active parameters per token: everything except the routed experts that
       a token does not visit (MTP layers excluded) */
    uint64_t expert = 3ull * hp->dim * hp->moe_inter, n_moe = 0, mtp = 0;
    for (int l = 0; l < hp->n_layers; l++) n_moe += m->layers[l].is_moe;
    if (hp->n_mtp) {
        mtp = 3ull * hp->dim * hp->moe_inter * hp->n_routed + 2ull * hp->dim * hp->dim;  /* rough */
    }
    m->n_active_params = m->n_params - n_moe * expert * (uint64_t)(hp->n_routed - hp->top_k) - mtp;

    if (o->check_values) {
        /* scan every bound weight for NaN/Inf (slow; off by default) */
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
        }
    }
    return load_tokenizer_files(m, dir, 0);
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
    m->progress = o.progress;
    m->progress_user = o.progress_user;
    int r;
    if (!m->path) r = fail(CM384_E_NOMEM, "out of memory");
    else if (S_ISDIR(st.st_mode)) {
        r = model_load_dir(m, path, &o);
    } else {
        size_t n = strlen(path);
        if (n >= 5 && !strcmp(path + n - 5, ".gguf")) {
            r = fail(CM384_E_UNSUPPORTED, "%s: GGUF files are not supported yet; use the Hugging Face directory", path);
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
    static const char *names[] = {"F32", "F16", "BF16", "F8_E4M3", "INT8"};
    snprintf(info.weight_dtype, sizeof info.weight_dtype, "%s",
             m->tokenizer_only ? "" : names[m->main_dtype]);
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
/* The transformer as batched functions over tokens: each token carries its
 * position and its sequence's KV block table, so one call can mix prompts,
 * decode steps and requests.  The engine (later sections) decides which
 * tokens go together and on which emulated device; these functions only
 * compute.  Every product goes through the ggml_like kernels, whose
 * per-row results do not depend on the batch (see ggml_like.h), so a token's
 * result is the same whatever else shares its batch. */

/* ---- 5.1 execution context: kernels + worker pool ---- */

typedef struct exec_ctx {
    const gl_kernels *k;
    gl_pool          *pool;
    int               n_workers;
} exec_ctx;

/* A list of matrix products run as one parallel region: each product is
 * split into chunks of output rows, and all chunks of all products are
 * spread over the workers.  Grouping products that read the same input
 * (q_a and kv_a, gate and up) saves a barrier each. */
typedef struct mm_job {
    const gl_mat *w;
    const float  *x;   int ldx;          /* n rows of w->cols floats        */
    const int8_t *xq;  const float *xs;  /* or: int8 rows + scales (Q8 w)   */
    float        *y;   int ldy;
    int           n;
    int           chunk, n_chunks;       /* filled by mm_run                */
} mm_job;

typedef struct { const exec_ctx *ex; mm_job *jobs; int n_jobs; int *first; } mm_region;

static void mm_task(void *ctx, int t, int worker) {
    (void)worker;
    mm_region *rg = ctx;
    int j = 0;
    while (j + 1 < rg->n_jobs && rg->first[j + 1] <= t) j++;     /* few jobs: linear is fine */
    mm_job *jb = &rg->jobs[j];
    int c = t - rg->first[j];
    int r0 = c * jb->chunk, r1 = r0 + jb->chunk;
    if (r1 > jb->w->rows) r1 = jb->w->rows;
    if (jb->w->type == GL_Q8)
        rg->ex->k->matmul_q8(jb->w, jb->xq, jb->xs, jb->n, jb->ldx, jb->y, jb->ldy, r0, r1);
    else
        rg->ex->k->matmul(jb->w, jb->x, jb->n, jb->ldx, jb->y, jb->ldy, r0, r1);
}

/* Bisect for many jobs (a MoE layer has one per active expert). */
static void mm_task_many(void *ctx, int t, int worker) {
    (void)worker;
    mm_region *rg = ctx;
    int lo = 0, hi = rg->n_jobs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (rg->first[mid] <= t) lo = mid; else hi = mid - 1;
    }
    mm_job *jb = &rg->jobs[lo];
    int c = t - rg->first[lo];
    int r0 = c * jb->chunk, r1 = r0 + jb->chunk;
    if (r1 > jb->w->rows) r1 = jb->w->rows;
    if (jb->w->type == GL_Q8)
        rg->ex->k->matmul_q8(jb->w, jb->xq, jb->xs, jb->n, jb->ldx, jb->y, jb->ldy, r0, r1);
    else
        rg->ex->k->matmul(jb->w, jb->x, jb->n, jb->ldx, jb->y, jb->ldy, r0, r1);
}

/* first must hold n_jobs+1 ints. */
static void mm_run(const exec_ctx *ex, mm_job *jobs, int n_jobs, int *first) {
    if (n_jobs <= 0) return;
    /* total work decides the chunk size: enough tasks to balance the
       workers, few enough that each reads a useful slab of weights */
    double work = 0;
    for (int j = 0; j < n_jobs; j++) work += (double)jobs[j].w->rows * jobs[j].w->cols * (jobs[j].n > 0);
    int want = ex->n_workers > 1 ? ex->n_workers * 8 : 1;
    int total = 0;
    for (int j = 0; j < n_jobs; j++) {
        mm_job *jb = &jobs[j];
        first[j] = total;
        if (jb->n <= 0) { jb->chunk = jb->w->rows; jb->n_chunks = 0; continue; }
        double share = (double)jb->w->rows * jb->w->cols / (work > 0 ? work : 1);
        int nc = (int)ceil(share * want);
        if (nc < 1) nc = 1;
        int chunk = (jb->w->rows + nc - 1) / nc;
        if (chunk < 16) chunk = 16;
        chunk = (chunk + 15) & ~15;
        jb->chunk = chunk;
        jb->n_chunks = (jb->w->rows + chunk - 1) / chunk;
        total += jb->n_chunks;
    }
    first[n_jobs] = total;
    mm_region rg = {ex, jobs, n_jobs, first};
    gl_pool_run(ex->pool, total, n_jobs > 8 ? mm_task_many : mm_task, &rg);
}

static void mm_one(const exec_ctx *ex, const gl_mat *w, const float *x, int n, int ldx, float *y, int ldy) {
    mm_job jb = {w, x, ldx, NULL, NULL, y, ldy, n, 0, 0};
    int first[2];
    mm_run(ex, &jb, 1, first);
}

/* ---- 5.2 small pieces ---- */

/* x * rsqrt(mean(x^2) + eps) * w, in fp32 (DeepSeek's RMSNorm). */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    float ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* RoPE on interleaved pairs (2k, 2k+1), as DeepSeek's view_as_complex. */
static void rope(const cm384_model *m, float *v, int pos) {
    int half = m->hp.qk_rope / 2;
    for (int k = 0; k < half; k++) {
        float ang = (float)pos * m->rope_freq[k];
        float c = (float)cos((double)ang) * m->rope_mscale, s = (float)sin((double)ang) * m->rope_mscale;
        float a = v[2 * k], b = v[2 * k + 1];
        v[2 * k] = a * c - b * s;
        v[2 * k + 1] = a * s + b * c;
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

/* ---- 5.3 the KV cache: paged blocks of MLA latents ---- */
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
    int    block_tokens;      /* B                                         */
    int    n_layers;          /* main + MTP layers                          */
    int    row;               /* floats per token per layer                 */
    size_t block_floats;      /* n_layers * B * row                         */
    int    n_blocks;
    float *data;              /* n_blocks * block_floats                    */
} kv_pool;

static float *kv_row(const kv_pool *kv, const int *blocks, int layer, int pos) {
    int b = blocks[pos / kv->block_tokens], s = pos % kv->block_tokens;
    return kv->data + (size_t)b * kv->block_floats + ((size_t)layer * kv->block_tokens + s) * (size_t)kv->row;
}

/* ---- 5.4 scratch for one forward step ---- */

typedef struct fwd_scratch {
    int     cap;                /* max tokens per step                         */
    int     max_ctx;            /* longest sequence attended over              */
    float  *x;                  /* [cap][dim] residual stream                   */
    float  *xn;                 /* [cap][dim] normed                            */
    float  *qa;                 /* [cap][q_lora]                                */
    float  *q;                  /* [cap][H][nope+rope]                          */
    float  *kva;                /* [cap][kv_lora+rope]                          */
    float  *qlat;               /* [cap][H][kv_lora+rope]: absorbed q, q_pe     */
    float  *ctx;                /* [cap][H][kv_lora] attended latents           */
    float  *att;                /* [cap][H][v] per-head values                  */
    float  *tmp;                /* [cap][dim]                                   */
    float  *ffa, *ffb;          /* [cap][max(inter, shared inter)]              */
    float  *scores;             /* [workers][H][max_ctx]                        */
    /* MoE */
    float  *router;             /* [cap][n_routed]                              */
    int    *top_id;             /* [cap][top_k]                                 */
    float  *top_w;              /* [cap][top_k]                                 */
    int    *slot_of;            /* [cap][top_k] row of (token, k) in ex_*       */
    int    *ex_count, *ex_first;/* [n_routed+1]                                 */
    float  *ex_in, *ex_out;     /* [cap*top_k][dim]                             */
    float  *ex_a, *ex_b;        /* [cap*top_k][moe_inter]                       */
    mm_job *jobs;               /* [max(2*n_routed, 2*H) + 4]                   */
    int    *first;
} fwd_scratch;

static void scratch_free(fwd_scratch *s) {
    float **fs[] = {&s->x, &s->xn, &s->qa, &s->q, &s->kva, &s->qlat, &s->ctx, &s->att, &s->tmp, &s->ffa,
                    &s->ffb, &s->scores, &s->router, &s->top_w, &s->ex_in, &s->ex_out, &s->ex_a, &s->ex_b};
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) { free(*fs[i]); *fs[i] = NULL; }
    free(s->top_id); free(s->slot_of); free(s->ex_count); free(s->ex_first); free(s->jobs); free(s->first);
    memset(s, 0, sizeof *s);
}

static int scratch_alloc(fwd_scratch *s, const hparams *hp, int cap, int max_ctx, int n_workers) {
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->max_ctx = max_ctx;
    size_t c = (size_t)cap, H = (size_t)hp->n_heads, K = (size_t)(hp->top_k > 0 ? hp->top_k : 1);
    size_t inter = (size_t)hp->inter;
    if (inter < 2 * (size_t)hp->dim) inter = 2 * (size_t)hp->dim;     /* MTP input [2*dim] */
    if ((size_t)hp->moe_inter * hp->n_shared > inter) inter = (size_t)hp->moe_inter * hp->n_shared;
    size_t lat = (size_t)hp->kv_lora + hp->qk_rope;
#define A(p, n) (p = malloc(((n) > 0 ? (n) : 1) * sizeof *(p)))
    int ok = A(s->x, c * hp->dim) && A(s->xn, c * hp->dim) && A(s->qa, c * (hp->q_lora + 1)) &&
             A(s->q, c * H * (hp->qk_nope + hp->qk_rope)) && A(s->kva, c * lat) && A(s->qlat, c * H * lat) &&
             A(s->ctx, c * H * hp->kv_lora) && A(s->att, c * H * hp->v_head) && A(s->tmp, c * hp->dim) &&
             A(s->ffa, c * inter) && A(s->ffb, c * inter) &&
             A(s->scores, (size_t)n_workers * H * (size_t)max_ctx) &&
             A(s->router, c * (hp->n_routed + 1)) && A(s->top_id, c * K) && A(s->top_w, c * K) &&
             A(s->slot_of, c * K) && A(s->ex_count, (size_t)hp->n_routed + 2) &&
             A(s->ex_first, (size_t)hp->n_routed + 2) &&
             A(s->ex_in, c * K * hp->dim) && A(s->ex_out, c * K * hp->dim) &&
             A(s->ex_a, c * K * (hp->moe_inter + 1)) && A(s->ex_b, c * K * (hp->moe_inter + 1)) &&
             A(s->jobs, 2 * (size_t)hp->n_routed + 2 * H + 8) && A(s->first, 2 * (size_t)hp->n_routed + 2 * H + 9);
#undef A
    if (!ok) { scratch_free(s); return fail(CM384_E_NOMEM, "out of memory for forward scratch (%d tokens)", cap); }
    return CM384_OK;
}

/* One forward step's tokens. */
typedef struct fwd_batch {
    int             n;
    const int32_t  *tok;      /* [n] token ids                                   */
    const int      *pos;      /* [n] positions                                   */
    const int     **blocks;   /* [n] block table of each token's sequence         */
    int             kv_shift; /* KV slot = position + kv_shift (1 for MTP layers)  */
} fwd_batch;

/* ---- 5.5 attention (MLA, absorbed) ---- */

typedef struct attn_job {
    const cm384_model *m; const exec_ctx *ex; const kv_pool *kv; const fwd_batch *b;
    fwd_scratch *s; int layer;
} attn_job;

/* One task = one token, all heads: scores over its keys, softmax, and the
 * attended latent.  Keys are visited in position order, so the sum has the
 * same order for a token whatever else is in the batch. */
static void attn_core_task(void *ctx, int t, int worker) {
    attn_job *aj = ctx;
    const hparams *hp = &aj->m->hp;
    int H = hp->n_heads, lat = hp->kv_lora + hp->qk_rope, n_keys = aj->b->pos[t] + 1;
    float *sc = aj->s->scores + (size_t)worker * H * aj->s->max_ctx;
    const float *qv = aj->s->qlat + (size_t)t * H * lat;
    const int *blocks = aj->b->blocks[t];
    float scale = aj->m->attn_scale;
    int sh = aj->b->kv_shift;
    for (int j = 0; j < n_keys; j++) {
        const float *row = kv_row(aj->kv, blocks, aj->layer, j + sh);
        for (int h = 0; h < H; h++) sc[(size_t)h * aj->s->max_ctx + j] = aj->ex->k->dot(qv + (size_t)h * lat, row, lat) * scale;
    }
    float *out = aj->s->ctx + (size_t)t * H * hp->kv_lora;
    for (int h = 0; h < H; h++) {
        float *p = sc + (size_t)h * aj->s->max_ctx;
        softmax_inplace(p, n_keys);
        float *o = out + (size_t)h * hp->kv_lora;
        memset(o, 0, (size_t)hp->kv_lora * sizeof(float));
        for (int j = 0; j < n_keys; j++) aj->ex->k->axpy(o, kv_row(aj->kv, blocks, aj->layer, j + sh), p[j], hp->kv_lora);
    }
}

/* x[t] += MLA(rmsnorm(x[t])) for every token of the batch; writes the
 * tokens' KV rows for this layer first. */
static void attention(const cm384_model *m, const exec_ctx *ex, const kv_pool *kv, int layer,
                      const fwd_batch *b, fwd_scratch *s, float *x) {
    const hparams *hp = &m->hp;
    const layer_w *L = &m->layers[layer];
    int n = b->n, H = hp->n_heads, dim = hp->dim, qk = hp->qk_nope + hp->qk_rope;
    int lat = hp->kv_lora + hp->qk_rope;
    for (int t = 0; t < n; t++) rmsnorm(s->xn + (size_t)t * dim, x + (size_t)t * dim, L->attn_norm, dim, hp->eps);

    /* down-projections: q_a (or q) and kv_a read the same normed input */
    mm_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    int nj = 0;
    if (hp->q_lora) jobs[nj++] = (mm_job){&L->wq_a, s->xn, dim, NULL, NULL, s->qa, hp->q_lora, n, 0, 0};
    else            jobs[nj++] = (mm_job){&L->wq, s->xn, dim, NULL, NULL, s->q, H * qk, n, 0, 0};
    jobs[nj++] = (mm_job){&L->wkv_a, s->xn, dim, NULL, NULL, s->kva, lat, n, 0, 0};
    mm_run(ex, jobs, nj, s->first);
    if (hp->q_lora) {
        for (int t = 0; t < n; t++) {
            float *qa = s->qa + (size_t)t * hp->q_lora;
            rmsnorm(qa, qa, L->q_norm, hp->q_lora, hp->eps);
        }
        mm_one(ex, &L->wq_b, s->qa, n, hp->q_lora, s->q, H * qk);
    }
    /* the token's KV row: normed latent + rotated shared key */
    for (int t = 0; t < n; t++) {
        float *kva = s->kva + (size_t)t * lat;
        float *row = kv_row(kv, b->blocks[t], layer, b->pos[t] + b->kv_shift);
        rmsnorm(row, kva, L->kv_norm, hp->kv_lora, hp->eps);
        memcpy(row + hp->kv_lora, kva + hp->kv_lora, (size_t)hp->qk_rope * sizeof(float));
        rope(m, row + hp->kv_lora, b->pos[t]);
    }
    /* absorb W_uk into the query: qlat[h] = W_uk[h]^T q_nope[h]; q_pe rotated
       and placed after it, so one dot with a KV row scores both parts */
    for (int h = 0; h < H; h++)
        s->jobs[h] = (mm_job){&L->w_uk_t[h], s->q + (size_t)h * qk, H * qk, NULL, NULL,
                              s->qlat + (size_t)h * lat, H * lat, n, 0, 0};
    mm_run(ex, s->jobs, H, s->first);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            float *dst = s->qlat + ((size_t)t * H + h) * lat + hp->kv_lora;
            memcpy(dst, s->q + ((size_t)t * H + h) * qk + hp->qk_nope, (size_t)hp->qk_rope * sizeof(float));
            rope(m, dst, b->pos[t]);
        }
    attn_job aj = {m, ex, kv, b, s, layer};
    gl_pool_run(ex->pool, n, attn_core_task, &aj);
    /* values: att[h] = W_uv[h] ctx[h], then o_proj */
    for (int h = 0; h < H; h++)
        s->jobs[h] = (mm_job){&L->w_uv[h], s->ctx + (size_t)h * hp->kv_lora, H * hp->kv_lora, NULL, NULL,
                              s->att + (size_t)h * hp->v_head, H * hp->v_head, n, 0, 0};
    mm_run(ex, s->jobs, H, s->first);
    mm_one(ex, &L->wo, s->att, n, H * hp->v_head, s->tmp, dim);
    for (size_t i = 0; i < (size_t)n * dim; i++) x[i] += s->tmp[i];
}

/* ---- 5.6 feed-forward: dense, router, experts ---- */

/* out[t] = down(silu(gate x) * up x) for n rows (one expert or a dense FFN). */
static void ffn_rows(const exec_ctx *ex, const ffn_w *f, const float *x, int n, int ldx,
                     float *a, float *b, float *out, int ldo, mm_job *jobs, int *first) {
    int inter = f->gate.rows;
    jobs[0] = (mm_job){&f->gate, x, ldx, NULL, NULL, a, inter, n, 0, 0};
    jobs[1] = (mm_job){&f->up, x, ldx, NULL, NULL, b, inter, n, 0, 0};
    mm_run(ex, jobs, 2, first);
    for (size_t i = 0; i < (size_t)n * inter; i++) a[i] = silu(a[i]) * b[i];
    jobs[0] = (mm_job){&f->down, a, inter, NULL, NULL, out, ldo, n, 0, 0};
    mm_run(ex, jobs, 1, first);
}

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

/* x[t] += FFN(rmsnorm(x[t])): dense, or MoE = sum_k w_k expert_k + shared.
 * Experts run over all the tokens routed to them at once (one GEMM each);
 * the combine sums each token's expert outputs in its top-k order. */
static void feed_forward(const cm384_model *m, const exec_ctx *ex, int layer, int n, fwd_scratch *s, float *x,
                         int *route_out /* [n][top_k] or NULL */) {
    const hparams *hp = &m->hp;
    const layer_w *L = &m->layers[layer];
    int dim = hp->dim;
    for (int t = 0; t < n; t++) rmsnorm(s->xn + (size_t)t * dim, x + (size_t)t * dim, L->ffn_norm, dim, hp->eps);
    if (!L->is_moe) {
        ffn_rows(ex, &L->dense, s->xn, n, dim, s->ffa, s->ffb, s->tmp, dim, s->jobs, s->first);
        for (size_t i = 0; i < (size_t)n * dim; i++) x[i] += s->tmp[i];
        return;
    }
    int E = hp->n_routed, K = hp->top_k;
    mm_one(ex, &L->router, s->xn, n, dim, s->router, E);
    for (int t = 0; t < n; t++)
        route_token(hp, s->router + (size_t)t * E, L->router_bias, s->top_id + (size_t)t * K, s->top_w + (size_t)t * K);
    if (route_out) memcpy(route_out, s->top_id, (size_t)n * K * sizeof(int));
    /* group (token, k) slots by expert: counting sort, stable in token order */
    memset(s->ex_count, 0, (size_t)(E + 1) * sizeof(int));
    for (int i = 0; i < n * K; i++) s->ex_count[s->top_id[i]]++;
    s->ex_first[0] = 0;
    for (int e = 0; e < E; e++) s->ex_first[e + 1] = s->ex_first[e] + s->ex_count[e];
    memset(s->ex_count, 0, (size_t)(E + 1) * sizeof(int));
    for (int i = 0; i < n * K; i++) {
        int e = s->top_id[i], slot = s->ex_first[e] + s->ex_count[e]++;
        s->slot_of[i] = slot;
        memcpy(s->ex_in + (size_t)slot * dim, s->xn + (size_t)(i / K) * dim, (size_t)dim * sizeof(float));
    }
    int MI = hp->moe_inter, nj = 0;
    for (int e = 0; e < E; e++) {
        int cnt = s->ex_first[e + 1] - s->ex_first[e];
        if (!cnt) continue;
        size_t f = (size_t)s->ex_first[e];
        s->jobs[nj++] = (mm_job){&L->experts[e].gate, s->ex_in + f * dim, dim, NULL, NULL, s->ex_a + f * MI, MI, cnt, 0, 0};
        s->jobs[nj++] = (mm_job){&L->experts[e].up, s->ex_in + f * dim, dim, NULL, NULL, s->ex_b + f * MI, MI, cnt, 0, 0};
    }
    mm_run(ex, s->jobs, nj, s->first);
    for (size_t i = 0; i < (size_t)n * K * MI; i++) s->ex_a[i] = silu(s->ex_a[i]) * s->ex_b[i];
    nj = 0;
    for (int e = 0; e < E; e++) {
        int cnt = s->ex_first[e + 1] - s->ex_first[e];
        if (!cnt) continue;
        size_t f = (size_t)s->ex_first[e];
        s->jobs[nj++] = (mm_job){&L->experts[e].down, s->ex_a + f * MI, MI, NULL, NULL, s->ex_out + f * dim, dim, cnt, 0, 0};
    }
    mm_run(ex, s->jobs, nj, s->first);
    if (L->shared.gate.data)
        ffn_rows(ex, &L->shared, s->xn, n, dim, s->ffa, s->ffb, s->tmp, dim, s->jobs, s->first);
    for (int t = 0; t < n; t++) {
        float *xr = x + (size_t)t * dim;
        for (int d = 0; d < dim; d++) {
            float acc = 0;
            for (int k = 0; k < K; k++) acc += s->top_w[t * K + k] * s->ex_out[(size_t)s->slot_of[t * K + k] * dim + d];
            if (L->shared.gate.data) acc += s->tmp[(size_t)t * dim + d];
            xr[d] += acc;
        }
    }
}

/* ---- 5.7 embedding, head, MTP input ---- */

static void embed_rows(const gl_mat *emb, const int32_t *tok, int n, float *x) {
    for (int t = 0; t < n; t++) gl_row_to_f32(emb, tok[t], x + (size_t)t * emb->cols);
}

/* h = rmsnorm(x, w) for n rows; logits = head h. */
static void head_rows(const cm384_model *m, const exec_ctx *ex, const gl_mat *head, const float *norm_w,
                      const float *x, int n, float *h, float *logits) {
    int dim = m->hp.dim;
    for (int t = 0; t < n; t++) rmsnorm(h + (size_t)t * dim, x + (size_t)t * dim, norm_w, dim, m->hp.eps);
    if (logits) mm_one(ex, head, h, n, dim, logits, head->rows);
}

/* MTP input: x'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]); tmp holds
 * [n][2*dim]. */
static void mtp_input(const cm384_model *m, const exec_ctx *ex, const layer_w *L, const float *h,
                      const int32_t *next_tok, int n, float *tmp2, float *x) {
    int dim = m->hp.dim;
    for (int t = 0; t < n; t++) {
        float *row = tmp2 + (size_t)t * 2 * dim;
        gl_row_to_f32(&L->embed, next_tok[t], row);
        rmsnorm(row, row, L->enorm, dim, m->hp.eps);
        rmsnorm(row + dim, h + (size_t)t * dim, L->hnorm, dim, m->hp.eps);
    }
    mm_one(ex, &L->eh_proj, tmp2, n, 2 * dim, x, dim);
}

/* ======================================================================== */
/* 6. The engine                                                            */
/* ======================================================================== */

struct cm384_engine {
    const cm384_model *m;
    cm384_config       cfg;
    exec_ctx           ex;
    kv_pool            kv;
    int               *free_blocks;     /* stack of free block ids               */
    int                n_free;
    fwd_scratch        s;
    int                step_cap;        /* tokens per forward step               */
    int               *pos;             /* [step_cap]                            */
    const int        **tables;          /* [step_cap]                            */
};

void cm384_config_init(cm384_config *c) {
    memset(c, 0, sizeof *c);
    c->struct_size = sizeof *c;
    c->n_devices = 384;
    c->preset = "default";
    c->int8_dispatch = 1;
    c->microbatches = 2;
}

static int block_alloc(cm384_engine *e, int n, int *out) {
    if (n > e->n_free) return fail(CM384_E_CAPACITY, "KV pool exhausted: need %d blocks, %d free", n, e->n_free);
    for (int i = 0; i < n; i++) out[i] = e->free_blocks[--e->n_free];
    return CM384_OK;
}

static void block_release(cm384_engine *e, const int *blocks, int n) {
    for (int i = 0; i < n; i++) e->free_blocks[e->n_free++] = blocks[i];
}

void cm384_engine_free(cm384_engine *e) {
    if (!e) return;
    gl_pool_free(e->ex.pool);
    scratch_free(&e->s);
    free(e->kv.data);
    free(e->free_blocks);
    free(e->pos);
    free(e->tables);
    free(e);
}

int cm384_engine_create(const cm384_model *m, const cm384_config *cfg, cm384_engine **out) {
    if (out) *out = NULL;
    if (!m || !out) return fail(CM384_E_INVALID, "cm384_engine_create: model and out must not be NULL");
    if (m->tokenizer_only)
        return fail(CM384_E_MISUSE, "%s: a tokenizer-only model has no weights; load a model directory to create an engine", m->path);
    cm384_config c;
    cm384_config_init(&c);
    if (cfg) {
        if (cfg->struct_size < offsetof(cm384_config, n_workers) || cfg->struct_size > 4096)
            return fail(CM384_E_INVALID, "cm384_engine_create: cfg->struct_size %zu is not valid", cfg->struct_size);
        memcpy(&c, cfg, cfg->struct_size < sizeof c ? cfg->struct_size : sizeof c);
    }
    const hparams *hp = &m->hp;
    if (c.n_devices <= 0) c.n_devices = 384;
    if (c.n_workers <= 0) c.n_workers = gl_n_cpus();
    if (c.max_ctx <= 0) c.max_ctx = hp->max_pos < 4096 ? hp->max_pos : 4096;
    if (c.max_ctx > hp->max_pos) return fail(CM384_E_INVALID, "max_ctx %d exceeds the model's %d positions", c.max_ctx, hp->max_pos);
    if (c.max_batch <= 0) c.max_batch = 64;
    if (c.kv_block_tokens <= 0) c.kv_block_tokens = 16;
    if (c.prefill_chunk <= 0) c.prefill_chunk = 512;
    if (c.microbatches != 1) c.microbatches = 2;

    cm384_engine *e = calloc(1, sizeof *e);
    if (!e) return fail(CM384_E_NOMEM, "out of memory");
    e->m = m;
    e->cfg = c;
    int r = CM384_OK;
    e->ex.k = gl_kernels_get();
    e->ex.pool = gl_pool_create(c.n_workers);
    e->ex.n_workers = c.n_workers;
    if (!e->ex.pool) r = fail(CM384_E_NOMEM, "cannot start %d worker threads", c.n_workers);

    kv_pool *kv = &e->kv;
    kv->block_tokens = c.kv_block_tokens;
    kv->n_layers = hp->n_layers + hp->n_mtp;
    kv->row = hp->kv_lora + hp->qk_rope;
    kv->block_floats = (size_t)kv->n_layers * kv->block_tokens * kv->row;
    size_t block_bytes = kv->block_floats * sizeof(float);
    size_t want = c.kv_pool_bytes;
    if (!want) {
        want = (size_t)c.max_batch * ((size_t)c.max_ctx + kv->block_tokens) * kv->n_layers * kv->row * sizeof(float);
        if (want > (size_t)1 << 30) want = (size_t)1 << 30;
    }
    kv->n_blocks = (int)(want / block_bytes);
    int min_blocks = (c.max_ctx + kv->block_tokens - 1) / kv->block_tokens + 1;
    if (!r && kv->n_blocks < min_blocks)
        r = fail(CM384_E_INVALID, "kv_pool_bytes %zu holds %d blocks; one request of max_ctx %d needs %d",
                 want, kv->n_blocks, c.max_ctx, min_blocks);
    if (!r) {
        kv->data = malloc((size_t)kv->n_blocks * block_bytes);
        e->free_blocks = malloc((size_t)kv->n_blocks * sizeof(int));
        if (!kv->data || !e->free_blocks) r = fail(CM384_E_NOMEM, "cannot allocate a KV pool of %d blocks (%zu bytes)",
                                                   kv->n_blocks, (size_t)kv->n_blocks * block_bytes);
    }
    if (!r) {
        for (int i = 0; i < kv->n_blocks; i++) e->free_blocks[i] = kv->n_blocks - 1 - i;
        e->n_free = kv->n_blocks;
        e->step_cap = c.prefill_chunk > 2 * c.max_batch ? c.prefill_chunk : 2 * c.max_batch;
        r = scratch_alloc(&e->s, hp, e->step_cap, c.max_ctx + 1, c.n_workers);
    }
    if (!r) {
        e->pos = malloc((size_t)e->step_cap * sizeof(int));
        e->tables = malloc((size_t)e->step_cap * sizeof(int *));
        if (!e->pos || !e->tables) r = fail(CM384_E_NOMEM, "out of memory");
    }
    if (r) { cm384_engine_free(e); return r; }
    *out = e;
    return CM384_OK;
}

/* Runs the main layers over `n` tokens of one sequence at positions
 * p0..p0+n-1 (its KV for positions < p0 already in `blocks`); leaves the
 * final-normed hidden states in h and the logits (if wanted) in logits. */
static void forward_seq_chunk(cm384_engine *e, const int32_t *tok, int n, int p0, const int *blocks,
                              float *h, float *logits) {
    const cm384_model *m = e->m;
    fwd_batch b = {n, tok, e->pos, e->tables, 0};
    for (int t = 0; t < n; t++) { e->pos[t] = p0 + t; e->tables[t] = blocks; }
    embed_rows(&m->embed, tok, n, e->s.x);
    for (int l = 0; l < m->hp.n_layers; l++) {
        attention(m, &e->ex, &e->kv, l, &b, &e->s, e->s.x);
        feed_forward(m, &e->ex, l, n, &e->s, e->s.x, NULL);
    }
    head_rows(m, &e->ex, &m->head, m->final_norm, e->s.x, n, h, logits);
}

/* MTP entries i = p0..p0+n-1 of one sequence: inputs h_i and token i+1. */
static void forward_mtp_chunk(cm384_engine *e, const float *h, const int32_t *next_tok, int n, int p0,
                              const int *blocks, float *logits) {
    const cm384_model *m = e->m;
    int l = m->hp.n_layers;
    const layer_w *L = &m->layers[l];
    fwd_batch b = {n, next_tok, e->pos, e->tables, 1};
    for (int t = 0; t < n; t++) { e->pos[t] = p0 + t; e->tables[t] = blocks; }
    mtp_input(m, &e->ex, L, h, next_tok, n, e->s.ffa, e->s.x);
    attention(m, &e->ex, &e->kv, l, &b, &e->s, e->s.x);
    feed_forward(m, &e->ex, l, n, &e->s, e->s.x, NULL);
    head_rows(m, &e->ex, &L->head, L->head_norm, e->s.x, n, e->s.tmp, logits);
}

int cm384_eval(cm384_engine *e, const int32_t *ids, int n, float *logits, float *mtp_logits) {
    if (!e || !ids || n <= 0 || !logits) return fail(CM384_E_INVALID, "cm384_eval: need an engine, ids, n > 0 and a logits buffer");
    const cm384_model *m = e->m;
    const hparams *hp = &m->hp;
    if (n > e->cfg.max_ctx) return fail(CM384_E_CAPACITY, "cm384_eval: %d tokens exceed max_ctx %d", n, e->cfg.max_ctx);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= hp->vocab) return fail(CM384_E_INVALID, "cm384_eval: token %d at position %d is outside [0, %d)", ids[i], i, hp->vocab);
    if (mtp_logits && !hp->n_mtp) return fail(CM384_E_UNSUPPORTED, "cm384_eval: the model has no MTP layer");
    int nb = (n + e->kv.block_tokens) / e->kv.block_tokens;
    int *blocks = malloc((size_t)nb * sizeof(int));
    float *h = malloc((size_t)n * hp->dim * sizeof(float));
    if (!blocks || !h) { free(blocks); free(h); return fail(CM384_E_NOMEM, "out of memory"); }
    int r = block_alloc(e, nb, blocks);
    if (r) { free(blocks); free(h); return r; }
    int cap = e->step_cap;
    for (int c0 = 0; c0 < n; c0 += cap) {
        int cn = n - c0 < cap ? n - c0 : cap;
        forward_seq_chunk(e, ids + c0, cn, c0, blocks, h + (size_t)c0 * hp->dim, logits + (size_t)c0 * hp->vocab);
    }
    if (mtp_logits)
        for (int c0 = 0; c0 < n - 1; c0 += cap) {
            int cn = n - 1 - c0 < cap ? n - 1 - c0 : cap;
            forward_mtp_chunk(e, h + (size_t)c0 * hp->dim, ids + c0 + 1, cn, c0, blocks, mtp_logits + (size_t)c0 * hp->vocab);
        }
    block_release(e, blocks, nb);
    free(blocks);
    free(h);
    return CM384_OK;
}

/* server.c -- an OpenAI-compatible HTTP server on cm384, a client of cm384.h
 * like any embedder: libc, pthreads and plain sockets, nothing else.
 *
 *   build/cm384-server -m models/shakespeare [--host 127.0.0.1] [--port 8080]
 *
 *   POST /v1/chat/completions   chat in the model's own format (stream or not)
 *   POST /v1/completions        plain text completion (stream or not)
 *   GET  /v1/models             the one model served
 *   GET  /health                {"status":"ok"}
 *   GET  /metrics               Prometheus text: the supernode's counters
 *
 * `cm384-server --help` lists the options.
 *
 * How it works.  One thread per connection (at most --max-conns of them;
 * more are refused with 503).  A request's prompt is rendered (chat) and
 * tokenized here, then submitted to the engine with cm384_submit(): requests
 * run concurrently in the engine's continuous batch.  The engine's callback
 * runs on its scheduler thread, so it only appends the token's text to the
 * request's buffer and signals; the connection thread writes the HTTP answer
 * (server-sent events when streaming), applies stop strings, and watches the
 * socket: a client that goes away has its request cancelled.  Every parser
 * here is bounded (--max-header, --max-body, JSON depth and size) and fails
 * the request with a 4xx and an OpenAI-style error body, never the process.
 * tests/fuzz/fuzz_server.c drives the parsers with SERVER_NO_MAIN defined. */
#define _GNU_SOURCE
#include "../cm384.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

/* ======================================================================== */
/* Memory the server itself holds, counted (the load test checks it returns */
/* to zero)                                                                  */
/* ======================================================================== */

static atomic_llong live_bytes;

static void *xmalloc(size_t n) {
    size_t *p = malloc(sizeof(size_t) * 2 + n);
    if (!p) return NULL;
    p[0] = n;
    atomic_fetch_add(&live_bytes, (long long)n);
    return p + 2;
}
static void *xcalloc(size_t n) {
    void *p = xmalloc(n);
    if (p) memset(p, 0, n);
    return p;
}
static void xfree(void *q) {
    if (!q) return;
    size_t *p = (size_t *)q - 2;
    atomic_fetch_sub(&live_bytes, (long long)p[0]);
    free(p);
}
static void *xrealloc(void *q, size_t n) {
    if (!q) return xmalloc(n);
    size_t *p = (size_t *)q - 2, old = p[0];
    size_t *np = realloc(p, sizeof(size_t) * 2 + n);
    if (!np) return NULL;
    np[0] = n;
    atomic_fetch_add(&live_bytes, (long long)n - (long long)old);
    return np + 2;
}

/* A growable byte string; on allocation failure it keeps its old contents
 * and sets oom. */
typedef struct { char *p; size_t n, cap; int oom; } sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = xrealloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static inline void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static inline void sb_printf(sbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static inline void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) { sb_put(b, tmp, (size_t)n); return; }
    char *big = xmalloc((size_t)n + 1);
    if (!big) { b->oom = 1; return; }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (size_t)n);
    xfree(big);
}
static void sb_free(sbuf *b) { xfree(b->p); memset(b, 0, sizeof *b); }

/* A JSON string literal of s (UTF-8 passed through; controls escaped). */
static inline void sb_json_str(sbuf *b, const char *s, size_t n) {
    sb_put(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        sb_put(b, s + run, i - run);
        run = i + 1;
        char e[8];
        switch (c) {
        case '"':  sb_put(b, "\\\"", 2); break;
        case '\\': sb_put(b, "\\\\", 2); break;
        case '\n': sb_put(b, "\\n", 2); break;
        case '\r': sb_put(b, "\\r", 2); break;
        case '\t': sb_put(b, "\\t", 2); break;
        default:   snprintf(e, sizeof e, "\\u%04x", c); sb_put(b, e, 6);
        }
    }
    sb_put(b, s + run, n - run);
    sb_put(b, "\"", 1);
}

/* ======================================================================== */
/* JSON: a bounded parser into a tree                                        */
/* ======================================================================== */
/* Objects keep their members in order as (key, value) pairs.  Strings are
 * decoded (escapes, \u surrogate pairs to UTF-8) and NUL-terminated; their
 * length is kept since they may contain NUL.  Depth is limited to
 * JSON_MAX_DEPTH and the node count to what the text can hold. */

enum { J_NULL, J_FALSE, J_TRUE, J_NUM, J_STR, J_ARR, J_OBJ };
#define JSON_MAX_DEPTH 32

typedef struct jval {
    int          type;
    double       num;
    char        *str;      /* J_STR: decoded text; in J_OBJ members: the key */
    size_t       len;
    struct jval *kids;     /* J_ARR: elements; J_OBJ: values (keys in key[]) */
    char       **keys;
    size_t      *key_lens;
    int          n;
} jval;

typedef struct {
    const char *s, *end;
    char        err[128];
} jparser;

static void jfree(jval *v) {
    if (!v) return;
    if (v->type == J_STR) xfree(v->str);
    for (int i = 0; i < v->n; i++) {
        jfree(&v->kids[i]);
        if (v->keys) xfree(v->keys[i]);
    }
    xfree(v->kids);
    xfree(v->keys);
    xfree(v->key_lens);
    memset(v, 0, sizeof *v);
}

static void jskip_ws(jparser *p) {
    while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r')) p->s++;
}

static int jerr(jparser *p, const char *what) {
    if (!p->err[0]) snprintf(p->err, sizeof p->err, "%s", what);
    return -1;
}

static int hexval(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static int jparse_hex4(jparser *p, unsigned *out) {
    if (p->end - p->s < 4) return jerr(p, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval((unsigned char)p->s[i]);
        if (h < 0) return jerr(p, "bad \\u escape");
        v = v * 16 + (unsigned)h;
    }
    p->s += 4;
    *out = v;
    return 0;
}

static void put_utf8(sbuf *b, unsigned cp) {
    char u[4];
    if (cp < 0x80) { u[0] = (char)cp; sb_put(b, u, 1); }
    else if (cp < 0x800) { u[0] = (char)(0xC0 | cp >> 6); u[1] = (char)(0x80 | (cp & 63)); sb_put(b, u, 2); }
    else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | cp >> 12); u[1] = (char)(0x80 | (cp >> 6 & 63)); u[2] = (char)(0x80 | (cp & 63));
        sb_put(b, u, 3);
    } else {
        u[0] = (char)(0xF0 | cp >> 18); u[1] = (char)(0x80 | (cp >> 12 & 63));
        u[2] = (char)(0x80 | (cp >> 6 & 63)); u[3] = (char)(0x80 | (cp & 63));
        sb_put(b, u, 4);
    }
}

/* After the opening quote; leaves p->s after the closing one. */
static int jparse_string(jparser *p, char **out, size_t *len) {
    sbuf b = {0};
    sb_put(&b, "", 0);
    for (;;) {
        if (p->s >= p->end) { sb_free(&b); return jerr(p, "unterminated string"); }
        unsigned char c = (unsigned char)*p->s++;
        if (c == '"') break;
        if (c < 0x20) { sb_free(&b); return jerr(p, "control character in a string"); }
        if (c != '\\') {
            const char *run = p->s - 1;
            while (p->s < p->end && *p->s != '"' && *p->s != '\\' && (unsigned char)*p->s >= 0x20) p->s++;
            sb_put(&b, run, (size_t)(p->s - run));
            continue;
        }
        if (p->s >= p->end) { sb_free(&b); return jerr(p, "unterminated string"); }
        char e = *p->s++;
        switch (e) {
        case '"': case '\\': case '/': sb_put(&b, &e, 1); break;
        case 'b': sb_put(&b, "\b", 1); break;
        case 'f': sb_put(&b, "\f", 1); break;
        case 'n': sb_put(&b, "\n", 1); break;
        case 'r': sb_put(&b, "\r", 1); break;
        case 't': sb_put(&b, "\t", 1); break;
        case 'u': {
            unsigned cp;
            if (jparse_hex4(p, &cp)) { sb_free(&b); return -1; }
            if (cp >= 0xD800 && cp < 0xDC00) {
                unsigned lo;
                if (p->end - p->s >= 6 && p->s[0] == '\\' && p->s[1] == 'u') {
                    p->s += 2;
                    if (jparse_hex4(p, &lo)) { sb_free(&b); return -1; }
                    if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    else { put_utf8(&b, 0xFFFD); cp = lo >= 0xD800 && lo < 0xE000 ? 0xFFFD : lo; }
                } else cp = 0xFFFD;
            } else if (cp >= 0xDC00 && cp < 0xE000) cp = 0xFFFD;
            put_utf8(&b, cp);
            break;
        }
        default: sb_free(&b); return jerr(p, "bad escape in a string");
        }
    }
    if (b.oom) { sb_free(&b); return jerr(p, "out of memory"); }
    *out = b.p;
    *len = b.n;
    return 0;
}

static int jparse_value(jparser *p, jval *v, int depth);

static int jgrow(jval *v, int *cap, int with_keys) {
    if (v->n < *cap) return 0;
    int nc = *cap ? *cap * 2 : 4;
    jval *k = xrealloc(v->kids, (size_t)nc * sizeof *k);
    if (!k) return -1;
    v->kids = k;
    if (with_keys) {
        char **ks = xrealloc(v->keys, (size_t)nc * sizeof *ks);
        if (!ks) return -1;
        v->keys = ks;
        size_t *kl = xrealloc(v->key_lens, (size_t)nc * sizeof *kl);
        if (!kl) return -1;
        v->key_lens = kl;
    }
    *cap = nc;
    return 0;
}

static int jparse_value(jparser *p, jval *v, int depth) {
    memset(v, 0, sizeof *v);
    if (depth > JSON_MAX_DEPTH) return jerr(p, "nested too deeply");
    jskip_ws(p);
    if (p->s >= p->end) return jerr(p, "unexpected end of JSON");
    char c = *p->s;
    if (c == '"') {
        p->s++;
        v->type = J_STR;
        return jparse_string(p, &v->str, &v->len);
    }
    if (c == '{' || c == '[') {
        int obj = c == '{', cap = 0;
        v->type = obj ? J_OBJ : J_ARR;
        p->s++;
        jskip_ws(p);
        if (p->s < p->end && *p->s == (obj ? '}' : ']')) { p->s++; return 0; }
        for (;;) {
            if (jgrow(v, &cap, obj)) return jerr(p, "out of memory");
            char *key = NULL;
            size_t klen = 0;
            if (obj) {
                jskip_ws(p);
                if (p->s >= p->end || *p->s != '"') return jerr(p, "expected a member name");
                p->s++;
                if (jparse_string(p, &key, &klen)) return -1;
                jskip_ws(p);
                if (p->s >= p->end || *p->s != ':') { xfree(key); return jerr(p, "expected ':'"); }
                p->s++;
            }
            int r = jparse_value(p, &v->kids[v->n], depth + 1);
            if (obj) { v->keys[v->n] = key; v->key_lens[v->n] = klen; }
            v->n++;
            if (r) return -1;
            jskip_ws(p);
            if (p->s >= p->end) return jerr(p, "unexpected end of JSON");
            if (*p->s == ',') { p->s++; continue; }
            if (*p->s == (obj ? '}' : ']')) { p->s++; return 0; }
            return jerr(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    if (c == 't' && p->end - p->s >= 4 && !memcmp(p->s, "true", 4)) { p->s += 4; v->type = J_TRUE; return 0; }
    if (c == 'f' && p->end - p->s >= 5 && !memcmp(p->s, "false", 5)) { p->s += 5; v->type = J_FALSE; return 0; }
    if (c == 'n' && p->end - p->s >= 4 && !memcmp(p->s, "null", 4)) { p->s += 4; v->type = J_NULL; return 0; }
    if (c == '-' || (c >= '0' && c <= '9')) {
        /* the JSON number grammar, then strtod on a bounded copy */
        const char *q = p->s;
        if (q < p->end && *q == '-') q++;
        if (q >= p->end || !(*q >= '0' && *q <= '9')) return jerr(p, "bad number");
        if (*q == '0') q++;
        else while (q < p->end && *q >= '0' && *q <= '9') q++;
        if (q < p->end && *q == '.') {
            q++;
            if (q >= p->end || !(*q >= '0' && *q <= '9')) return jerr(p, "bad number");
            while (q < p->end && *q >= '0' && *q <= '9') q++;
        }
        if (q < p->end && (*q == 'e' || *q == 'E')) {
            q++;
            if (q < p->end && (*q == '+' || *q == '-')) q++;
            if (q >= p->end || !(*q >= '0' && *q <= '9')) return jerr(p, "bad number");
            while (q < p->end && *q >= '0' && *q <= '9') q++;
        }
        char tmp[64];
        size_t n = (size_t)(q - p->s);
        if (n >= sizeof tmp) return jerr(p, "number too long");
        memcpy(tmp, p->s, n);
        tmp[n] = 0;
        v->type = J_NUM;
        v->num = strtod(tmp, NULL);
        p->s = q;
        return 0;
    }
    return jerr(p, "unexpected character");
}

/* Parse a whole document; on failure *err names the problem and its offset. */
static int json_parse_doc(const char *s, size_t n, jval *out, char *err, size_t err_cap) {
    jparser p = {s, s + n, {0}};
    int r = jparse_value(&p, out, 0);
    if (!r) {
        jskip_ws(&p);
        if (p.s != p.end) r = jerr(&p, "text after the JSON value");
    }
    if (r) {
        snprintf(err, err_cap, "malformed JSON at byte %ld: %s", (long)(p.s - s), p.err);
        jfree(out);
        return -1;
    }
    return 0;
}

static const jval *jget(const jval *o, const char *key) {
    if (!o || o->type != J_OBJ) return NULL;
    size_t kl = strlen(key);
    for (int i = o->n - 1; i >= 0; i--)   /* the last duplicate wins, as in JavaScript */
        if (o->key_lens[i] == kl && !memcmp(o->keys[i], key, kl)) return &o->kids[i];
    return NULL;
}

/* ======================================================================== */
/* HTTP/1.1 request head                                                     */
/* ======================================================================== */

typedef struct {
    char   method[8];
    char   path[256];
    long   content_length;   /* -1: none */
    int    keep_alive;       /* HTTP/1.1 default, or Connection: keep-alive */
    int    expect_continue;
    int    chunked;
    size_t head_len;         /* bytes up to and including the blank line */
} http_head;

/* Parses the head in buf[0..n).  Returns 1 when complete, 0 when more bytes
 * are needed, or a negative HTTP status (-400, -431, -501, -505) with *why. */
static int http_parse_head(const char *buf, size_t n, size_t max_header, http_head *h, const char **why) {
    memset(h, 0, sizeof *h);
    h->content_length = -1;
    const char *end = NULL;
    for (size_t i = 0; i + 3 < n; i++)
        if (buf[i] == '\r' && buf[i + 1] == '\n' && buf[i + 2] == '\r' && buf[i + 3] == '\n') { end = buf + i + 4; break; }
    if (!end) {
        if (n >= max_header) { *why = "request header too large"; return -431; }
        return 0;
    }
    if ((size_t)(end - buf) > max_header) { *why = "request header too large"; return -431; }
    h->head_len = (size_t)(end - buf);
    /* request line: METHOD SP PATH SP HTTP/1.x CRLF */
    const char *p = buf, *le = memchr(buf, '\r', h->head_len);
    const char *sp1 = memchr(p, ' ', (size_t)(le - p));
    if (!sp1 || sp1 == p || (size_t)(sp1 - p) >= sizeof h->method) { *why = "malformed request line"; return -400; }
    memcpy(h->method, p, (size_t)(sp1 - p));
    for (const char *q = p; q < sp1; q++)
        if (*q < 'A' || *q > 'Z') { *why = "malformed method"; return -400; }
    const char *sp2 = memchr(sp1 + 1, ' ', (size_t)(le - sp1 - 1));
    if (!sp2 || sp2 == sp1 + 1) { *why = "malformed request line"; return -400; }
    if ((size_t)(sp2 - sp1 - 1) >= sizeof h->path) { *why = "request target too long"; return -431; }
    memcpy(h->path, sp1 + 1, (size_t)(sp2 - sp1 - 1));
    for (char *q = h->path; *q; q++)
        if ((unsigned char)*q <= 0x20 || (unsigned char)*q >= 0x7f) { *why = "malformed request target"; return -400; }
    char *qm = strchr(h->path, '?');
    if (qm) *qm = 0;                       /* no route takes a query */
    size_t vlen = (size_t)(le - sp2 - 1);
    if (vlen == 8 && !memcmp(sp2 + 1, "HTTP/1.1", 8)) h->keep_alive = 1;
    else if (vlen == 8 && !memcmp(sp2 + 1, "HTTP/1.0", 8)) h->keep_alive = 0;
    else { *why = "only HTTP/1.0 and HTTP/1.1 are served"; return -505; }
    if (le + 1 >= end || le[1] != '\n') { *why = "malformed request line"; return -400; }
    /* header fields */
    for (p = le + 2; p < end - 2;) {
        const char *e = memchr(p, '\r', (size_t)(end - p));
        if (!e || e + 1 >= end || e[1] != '\n') { *why = "malformed header"; return -400; }
        const char *colon = memchr(p, ':', (size_t)(e - p));
        if (!colon || colon == p) { *why = "malformed header field"; return -400; }
        for (const char *q = p; q < colon; q++)
            if (*q == ' ' || *q == '\t' || (unsigned char)*q < 0x21 || (unsigned char)*q > 0x7e) { *why = "malformed header name"; return -400; }
        const char *v = colon + 1;
        while (v < e && (*v == ' ' || *v == '\t')) v++;
        const char *ve = e;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
        size_t nl = (size_t)(colon - p), vl = (size_t)(ve - v);
#define HDR_IS(name) (nl == sizeof(name) - 1 && !strncasecmp(p, name, nl))
#define VAL_IS(s) (vl == sizeof(s) - 1 && !strncasecmp(v, s, vl))
        if (HDR_IS("Content-Length")) {
            if (vl == 0 || vl > 18) { *why = "bad Content-Length"; return -400; }
            long cl = 0;
            for (size_t i = 0; i < vl; i++) {
                if (v[i] < '0' || v[i] > '9') { *why = "bad Content-Length"; return -400; }
                cl = cl * 10 + (v[i] - '0');
            }
            if (h->content_length >= 0 && h->content_length != cl) { *why = "conflicting Content-Length"; return -400; }
            h->content_length = cl;
        } else if (HDR_IS("Transfer-Encoding")) {
            if (VAL_IS("chunked")) h->chunked = 1;
            else { *why = "unsupported Transfer-Encoding"; return -501; }
        } else if (HDR_IS("Connection")) {
            if (VAL_IS("close")) h->keep_alive = 0;
            else if (VAL_IS("keep-alive")) h->keep_alive = 1;
        } else if (HDR_IS("Expect")) {
            if (VAL_IS("100-continue")) h->expect_continue = 1;
        }
#undef HDR_IS
#undef VAL_IS
        p = e + 2;
    }
    if (h->chunked && h->content_length >= 0) { *why = "both Content-Length and Transfer-Encoding"; return -400; }
    return 1;
}

/* Decodes a complete chunked body in place ("SIZE[;ext]\r\nDATA\r\n...0\r\n\r\n").
 * Returns the decoded length, -1 if more bytes are needed, -2 if malformed,
 * -3 if the decoded body would pass max_body.  *consumed gets the encoded length. */
static long http_dechunk(char *buf, size_t n, size_t max_body, size_t *consumed) {
    size_t r = 0, w = 0;
    for (;;) {
        size_t size = 0, digits = 0;
        while (r < n && hexval((unsigned char)buf[r]) >= 0) {
            if (++digits > 12) return -2;
            size = size * 16 + (size_t)hexval((unsigned char)buf[r++]);
        }
        if (r >= n) return -1;
        if (!digits) return -2;
        while (r < n && buf[r] != '\r') { if (buf[r] == '\n') return -2; r++; }   /* chunk extension */
        if (r + 1 >= n) return -1;
        if (buf[r + 1] != '\n') return -2;
        r += 2;
        if (size == 0) {
            /* trailers, then the final CRLF */
            for (;;) {
                if (r + 1 >= n) return -1;
                if (buf[r] == '\r' && buf[r + 1] == '\n') { *consumed = r + 2; return (long)w; }
                while (r + 1 < n && !(buf[r] == '\r' && buf[r + 1] == '\n')) r++;
                if (r + 1 >= n) return -1;
                r += 2;
            }
        }
        if (size > max_body || w + size > max_body) return -3;
        if (n - r < size + 2) return -1;
        memmove(buf + w, buf + r, size);
        w += size;
        r += size;
        if (buf[r] != '\r' || buf[r + 1] != '\n') return -2;
        r += 2;
    }
}

/* ======================================================================== */
/* Requests: what a completion asks for                                      */
/* ======================================================================== */

#define MAX_STOP 4
#define MAX_STOP_LEN 256
#define MAX_MESSAGES 1024

typedef struct {
    int             chat;          /* /v1/chat/completions, else /v1/completions */
    int             stream, include_usage;
    double          temperature, top_p;
    int             max_tokens;    /* 0: until the context is full */
    int             has_seed;
    uint64_t        seed;
    const char     *stop[MAX_STOP];
    size_t          stop_len[MAX_STOP];
    int             n_stop;
    /* chat */
    cm384_chat_msg *msgs;
    cm384_tool_call *calls;
    int             n_msgs;
    sbuf            parts;         /* content made of text parts, joined */
    /* completion */
    const char     *prompt;
    size_t          prompt_len;
} gen_params;

static void gen_params_free(gen_params *g) {
    xfree(g->msgs);
    xfree(g->calls);
    sb_free(&g->parts);
    memset(g, 0, sizeof *g);
}

/* A message's content: a string, null, or a list of {"type":"text","text":...}
 * parts (joined).  Offsets into g->parts are fixed up after parsing. */
static int message_content(const jval *c, gen_params *g, const char **out, size_t *off, int *in_parts, char *err, size_t ec) {
    *in_parts = 0;
    if (!c || c->type == J_NULL) { *out = NULL; return 0; }
    if (c->type == J_STR) {
        if (strlen(c->str) != c->len) { snprintf(err, ec, "message content contains a NUL character"); return -1; }
        *out = c->str;
        return 0;
    }
    if (c->type != J_ARR) { snprintf(err, ec, "message content must be a string or a list of text parts"); return -1; }
    *off = g->parts.n;
    for (int i = 0; i < c->n; i++) {
        const jval *t = jget(&c->kids[i], "type"), *x = jget(&c->kids[i], "text");
        if (!t || t->type != J_STR || strcmp(t->str, "text") || !x || x->type != J_STR || strlen(x->str) != x->len) {
            snprintf(err, ec, "only text content parts are supported");
            return -1;
        }
        sb_put(&g->parts, x->str, x->len);
    }
    sb_put(&g->parts, "", 1);    /* NUL between parts' texts */
    *in_parts = 1;
    return 0;
}

/* Reads and checks a request body's fields.  Returns 0, or -1 with err set
 * (a 400 for the client; param names the field). */
static int gen_params_parse(const jval *body, int chat, gen_params *g, char *err, size_t ec, const char **param) {
    memset(g, 0, sizeof *g);
    g->chat = chat;
    g->temperature = 1.0;
    g->top_p = 1.0;
    *param = NULL;
    if (!body || body->type != J_OBJ) { snprintf(err, ec, "the request body must be a JSON object"); return -1; }
    const jval *v;
#define BAD(field, ...) do { *param = field; snprintf(err, ec, __VA_ARGS__); return -1; } while (0)
    if ((v = jget(body, "stream")) && v->type != J_NULL) {
        if (v->type != J_TRUE && v->type != J_FALSE) BAD("stream", "stream must be a boolean");
        g->stream = v->type == J_TRUE;
    }
    if ((v = jget(body, "stream_options")) && v->type == J_OBJ) {
        const jval *u = jget(v, "include_usage");
        g->include_usage = u && u->type == J_TRUE;
    }
    if ((v = jget(body, "temperature")) && v->type != J_NULL) {
        if (v->type != J_NUM || !(v->num >= 0 && v->num <= 2)) BAD("temperature", "temperature must be a number in [0, 2]");
        g->temperature = v->num;
    }
    if ((v = jget(body, "top_p")) && v->type != J_NULL) {
        if (v->type != J_NUM || !(v->num > 0 && v->num <= 1)) BAD("top_p", "top_p must be a number in (0, 1]");
        g->top_p = v->num;
    }
    const char *mt = "max_tokens";
    if (!((v = jget(body, mt)) && v->type != J_NULL)) v = jget(body, mt = "max_completion_tokens");
    if (v && v->type != J_NULL) {
        if (v->type != J_NUM || v->num != (double)(int)v->num || v->num < 1 || v->num > 1e9)
            BAD(mt, "%s must be a positive integer", mt);
        g->max_tokens = (int)v->num;
    }
    if ((v = jget(body, "seed")) && v->type != J_NULL) {
        if (v->type != J_NUM || v->num != (double)(long long)v->num || v->num < -9.2e18 || v->num > 9.2e18)
            BAD("seed", "seed must be an integer");
        g->has_seed = 1;
        g->seed = (uint64_t)(long long)v->num;
    }
    if ((v = jget(body, "n")) && v->type != J_NULL) {
        if (v->type != J_NUM || v->num != 1) BAD("n", "only n = 1 is supported");
    }
    if ((v = jget(body, "stop")) && v->type != J_NULL) {
        const jval *one = v->type == J_STR ? v : NULL;
        int n = one ? 1 : v->type == J_ARR ? v->n : -1;
        if (n < 0 || n > MAX_STOP) BAD("stop", "stop must be a string or a list of at most %d strings", MAX_STOP);
        for (int i = 0; i < n; i++) {
            const jval *s = one ? one : &v->kids[i];
            if (s->type != J_STR || s->len == 0 || s->len > MAX_STOP_LEN)
                BAD("stop", "each stop sequence must be a non-empty string of at most %d bytes", MAX_STOP_LEN);
            g->stop[g->n_stop] = s->str;
            g->stop_len[g->n_stop++] = s->len;
        }
    }
    if (!chat) {
        v = jget(body, "prompt");
        if (v && v->type == J_ARR && v->n == 1) v = &v->kids[0];
        if (!v || v->type != J_STR) BAD("prompt", "prompt must be a string (or a list of one string)");
        if (v->len == 0) BAD("prompt", "prompt is empty");
        g->prompt = v->str;
        g->prompt_len = v->len;
        return 0;
    }
    const jval *msgs = jget(body, "messages");
    if (!msgs || msgs->type != J_ARR || msgs->n == 0) BAD("messages", "messages must be a non-empty list");
    if (msgs->n > MAX_MESSAGES) BAD("messages", "at most %d messages", MAX_MESSAGES);
    int n_calls = 0;
    for (int i = 0; i < msgs->n; i++) {
        const jval *tc = jget(&msgs->kids[i], "tool_calls");
        if (tc && tc->type == J_ARR) n_calls += tc->n;
    }
    g->msgs = xcalloc((size_t)msgs->n * sizeof *g->msgs);
    g->calls = n_calls ? xcalloc((size_t)n_calls * sizeof *g->calls) : NULL;
    size_t *offs = xcalloc((size_t)msgs->n * sizeof *offs);
    int *inp = xcalloc((size_t)msgs->n * sizeof *inp);
    if (!g->msgs || (n_calls && !g->calls) || !offs || !inp) { xfree(offs); xfree(inp); BAD(NULL, "out of memory"); }
    int ci = 0;
    for (int i = 0; i < msgs->n; i++) {
        const jval *m = &msgs->kids[i], *role = jget(m, "role");
        if (m->type != J_OBJ || !role || role->type != J_STR) { xfree(offs); xfree(inp); BAD("messages", "message %d needs a role", i); }
        if (strcmp(role->str, "system") && strcmp(role->str, "user") && strcmp(role->str, "assistant") &&
            strcmp(role->str, "tool") && strcmp(role->str, "developer")) {
            xfree(offs); xfree(inp);
            BAD("messages", "message %d: unknown role \"%.40s\"", i, role->str);
        }
        g->msgs[i].role = strcmp(role->str, "developer") ? role->str : "system";
        if (message_content(jget(m, "content"), g, &g->msgs[i].content, &offs[i], &inp[i], err, ec)) {
            xfree(offs); xfree(inp);
            *param = "messages";
            return -1;
        }
        const jval *tc = jget(m, "tool_calls");
        if (tc && tc->type == J_ARR && tc->n > 0) {
            g->msgs[i].tool_calls = &g->calls[ci];
            g->msgs[i].n_tool_calls = tc->n;
            for (int j = 0; j < tc->n; j++, ci++) {
                const jval *fn = jget(&tc->kids[j], "function"), *ty = jget(&tc->kids[j], "type");
                const jval *name = jget(fn, "name"), *args = jget(fn, "arguments");
                if (!name || name->type != J_STR || !args || args->type != J_STR) {
                    xfree(offs); xfree(inp);
                    BAD("messages", "message %d tool call %d needs function.name and function.arguments strings", i, j);
                }
                g->calls[ci].type = ty && ty->type == J_STR ? ty->str : "function";
                g->calls[ci].name = name->str;
                g->calls[ci].arguments = args->str;
            }
        }
        if (!g->msgs[i].content && !inp[i] && !(g->msgs[i].n_tool_calls > 0 && !strcmp(g->msgs[i].role, "assistant"))) {
            xfree(offs); xfree(inp);
            BAD("messages", "message %d has no content", i);
        }
    }
    if (g->parts.oom) { xfree(offs); xfree(inp); BAD(NULL, "out of memory"); }
    for (int i = 0; i < msgs->n; i++)
        if (inp[i]) g->msgs[i].content = g->parts.p + offs[i];
    xfree(offs);
    xfree(inp);
    g->n_msgs = msgs->n;
    return 0;
#undef BAD
}

/* ======================================================================== */
/* The server (left out when a fuzz harness includes this file for the      */
/* parsers above)                                                            */
/* ======================================================================== */
#ifndef SERVER_NO_MAIN

typedef struct {
    const char *model_path, *host, *alias, *preset, *chat_format;
    int         port, max_conns, threads, devices, max_ctx, max_batch, mtp, int8, kv_bf16, prefill_expanded, prefault;
    double      kv_pool_mib, cache_mib;     /* 0: the engine's defaults; cache < 0: off */
    double      tpot_target_ms, prefill_share;   /* 0: none / the engine's default */
    size_t      max_body, max_header;
    double      idle_timeout_s, io_timeout_s;
} server_opts;

static struct {
    server_opts     o;
    cm384_model    *model;
    cm384_engine   *engine;
    char            model_id[128];
    int             max_ctx, eos, chat_format;   /* CM384_CHAT_MODEL or --chat-format */
    time_t          started;
    pthread_mutex_t mu;
    pthread_cond_t  idle;
    int             n_conns;          /* open connections (threads) */
    uint64_t        conns_refused, conns_total, next_id;
    uint64_t        http[6];          /* answers by status class 1xx..5xx */
    uint64_t        gen_requests, gen_finished, gen_disconnected, gen_stopped;
    atomic_int      stop;             /* set by SIGINT/SIGTERM (lock-free: safe in a handler) */
} S;

static const char *status_text(int code) {
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default:  return "Error";
    }
}

static void count_status(int code) {
    pthread_mutex_lock(&S.mu);
    if (code >= 100 && code < 600) S.http[code / 100]++;
    pthread_mutex_unlock(&S.mu);
}

/* Writes all of buf; 0, or -1 when the peer is gone (no SIGPIPE). */
static int send_all(int fd, const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

static int send_response(int fd, int code, const char *ctype, const char *body, size_t n, int keep_alive) {
    char head[512];
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: %s\r\n"
                      "Access-Control-Allow-Origin: *\r\n\r\n",
                      code, status_text(code), ctype, n, keep_alive ? "keep-alive" : "close");
    count_status(code);
    if (send_all(fd, head, (size_t)hn)) return -1;
    return send_all(fd, body, n);
}

static const char *error_type(int code) {
    return code == 404 ? "not_found_error" : code >= 500 ? (code == 503 ? "overloaded_error" : "server_error")
                                                         : "invalid_request_error";
}

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}}. */
static int send_error(int fd, int code, const char *param, const char *msg, int keep_alive) {
    sbuf b = {0};
    sb_str(&b, "{\"error\":{\"message\":");
    sb_json_str(&b, msg, strlen(msg));
    sb_printf(&b, ",\"type\":\"%s\",\"param\":", error_type(code));
    if (param) sb_json_str(&b, param, strlen(param));
    else sb_str(&b, "null");
    sb_printf(&b, ",\"code\":%d}}\n", code);
    int r = b.oom ? -1 : send_response(fd, code, "application/json", b.p, b.n, keep_alive);
    sb_free(&b);
    return r;
}

/* ---- one generation: shared by the engine's callback and the connection -- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    sbuf            text;         /* appended by the callback */
    int             n_tokens, saw_eos, done, status;
    int             n_prompt, n_cached, n_generated;
    double          ttft_ms, tpot_ms;
} job;

static int on_event(void *user, const cm384_event *ev) {
    job *j = user;
    pthread_mutex_lock(&j->mu);
    if (ev->kind == CM384_EV_TOKEN) {
        j->n_tokens++;
        if (ev->token == S.eos) j->saw_eos = 1;      /* EOS ends the text, it is not part of it */
        else sb_put(&j->text, ev->text, ev->text_len);
    } else {
        j->done = 1;
        j->status = ev->status;
        j->n_prompt = ev->n_prompt;
        j->n_cached = ev->n_cached;
        j->n_generated = ev->n_generated;
        j->ttft_ms = ev->ttft_ms;
        j->tpot_ms = ev->tpot_ms;
    }
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return 0;
}

/* 1 if the peer has closed or reset the connection. */
static int peer_gone(int fd) {
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return 1;
    if (p.revents & POLLIN) {
        char c;
        ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return r == 0;
    }
    return 0;
}

static uint64_t seed_counter;

static void now_stamp(char *id, size_t cap, const char *prefix) {
    pthread_mutex_lock(&S.mu);
    uint64_t n = ++S.next_id;
    pthread_mutex_unlock(&S.mu);
    snprintf(id, cap, "%s-%llx%06llu", prefix, (unsigned long long)S.started, (unsigned long long)n);
}

/* The start of an SSE chunk up to the choice's payload. */
static void sse_chunk_head(sbuf *b, const char *id, long created, int chat) {
    sb_printf(b, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":", id,
              chat ? "chat.completion.chunk" : "text_completion", created);
    sb_json_str(b, S.model_id, strlen(S.model_id));
    sb_str(b, ",\"choices\":[{\"index\":0,");
}

static void usage_json(sbuf *b, int prompt, int completion, int cached) {
    sb_printf(b, "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d,"
                 "\"prompt_tokens_details\":{\"cached_tokens\":%d}}",
              prompt, completion, prompt + completion, cached);
}

/* Runs one completion and writes its answer.  Returns 0 to keep the
 * connection, -1 to close it. */
static int run_completion(int fd, gen_params *g, int keep_alive) {
    char err[256];
    /* the prompt: chat rendered in the model's format, then tokenized */
    int32_t *ids = NULL;
    int n_ids = 0;
    if (g->chat) {
        int n = cm384_chat_render_format(S.model, S.chat_format, g->msgs, g->n_msgs, CM384_CHAT_ADD_GENERATION_PROMPT, NULL, 0);
        if (n < 0) {
            snprintf(err, sizeof err, "cannot render the conversation: %s", cm384_last_error());
            return send_error(fd, n == CM384_E_UNSUPPORTED ? 500 : 400, "messages", err, keep_alive);
        }
        char *txt = xmalloc((size_t)n + 1);
        if (!txt) return send_error(fd, 500, NULL, "out of memory", 0), -1;
        cm384_chat_render_format(S.model, S.chat_format, g->msgs, g->n_msgs, CM384_CHAT_ADD_GENERATION_PROMPT, txt, (size_t)n + 1);
        int k = cm384_tokenize(S.model, txt, (size_t)n, NULL, 0, 0);
        if (k > 0 && (ids = xmalloc((size_t)k * sizeof *ids)) != NULL) n_ids = cm384_tokenize(S.model, txt, (size_t)n, ids, k, 0);
        xfree(txt);
        if (n_ids <= 0) { xfree(ids); return send_error(fd, 400, "messages", "the conversation renders to no tokens", keep_alive); }
    } else {
        int k = cm384_tokenize(S.model, g->prompt, g->prompt_len, NULL, 0, CM384_TOK_ADD_BOS);
        if (k > 0 && (ids = xmalloc((size_t)k * sizeof *ids)) != NULL)
            n_ids = cm384_tokenize(S.model, g->prompt, g->prompt_len, ids, k, CM384_TOK_ADD_BOS);
        if (n_ids <= 0) { xfree(ids); return send_error(fd, 400, "prompt", "the prompt has no tokens", keep_alive); }
    }
    if (n_ids >= S.max_ctx) {
        xfree(ids);
        snprintf(err, sizeof err, "the prompt has %d tokens; the context holds %d (prompt and completion)", n_ids, S.max_ctx);
        return send_error(fd, 400, g->chat ? "messages" : "prompt", err, keep_alive);
    }
    cm384_sampling s;
    cm384_sampling_init(&s);
    s.temperature = (float)g->temperature;
    s.top_p = (float)g->top_p;
    s.max_tokens = g->max_tokens > 0 && g->max_tokens < S.max_ctx - n_ids ? g->max_tokens : S.max_ctx - n_ids;
    if (g->has_seed) s.seed = g->seed;
    else {
        pthread_mutex_lock(&S.mu);
        s.seed = ((uint64_t)time(NULL) << 20) ^ (++seed_counter * 0x9E3779B97F4A7C15ull);
        pthread_mutex_unlock(&S.mu);
    }

    job *j = xcalloc(sizeof *j);
    if (!j) { xfree(ids); return send_error(fd, 500, NULL, "out of memory", 0), -1; }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    cm384_request rq;
    cm384_request_init(&rq);
    rq.ids = ids;
    rq.n_ids = n_ids;
    rq.sampling = &s;
    rq.on_event = on_event;
    rq.user = j;
    uint64_t rid = 0;
    int r = cm384_submit(S.engine, &rq, &rid);
    xfree(ids);
    if (r != CM384_OK) {
        snprintf(err, sizeof err, "cannot run the request: %s", cm384_last_error());
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        xfree(j);
        return send_error(fd, r == CM384_E_NOMEM ? 503 : 400, NULL, err, keep_alive);
    }
    pthread_mutex_lock(&S.mu);
    S.gen_requests++;
    pthread_mutex_unlock(&S.mu);

    char id[64];
    now_stamp(id, sizeof id, g->chat ? "chatcmpl" : "cmpl");
    long created = (long)time(NULL);
    int gone = 0, stopped = 0;
    sbuf out = {0};           /* generated text, stop strings applied */
    size_t sent = 0;          /* bytes of out already streamed */
    size_t taken = 0;         /* bytes of j->text already moved to out */
    size_t hold = 0;          /* a stop string may still begin in the last hold bytes */
    for (int i = 0; i < g->n_stop; i++) if (g->stop_len[i] - 1 > hold) hold = g->stop_len[i] - 1;
    if (g->stream) {
        const char *h = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                        "Connection: close\r\nAccess-Control-Allow-Origin: *\r\n\r\n";
        count_status(200);
        gone = send_all(fd, h, strlen(h)) != 0;
        if (!gone && g->chat) {
            sbuf c = {0};
            sse_chunk_head(&c, id, created, 1);
            sb_str(&c, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n");
            gone = c.oom || send_all(fd, c.p, c.n) != 0;
            sb_free(&c);
        }
    }
    int done = 0;
    while (!done) {
        pthread_mutex_lock(&j->mu);
        if (!j->done && j->text.n == taken) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        }
        size_t new_n = j->text.n;
        if (!stopped && new_n > taken) sb_put(&out, j->text.p + taken, new_n - taken);
        taken = new_n;
        done = j->done;
        pthread_mutex_unlock(&j->mu);
        if (out.oom) { gone = 1; }
        /* stop strings: cut at the first one found */
        size_t safe = out.n;
        if (!stopped && g->n_stop) {
            size_t from = sent > hold ? sent - hold : 0, cut = SIZE_MAX;
            for (int i = 0; i < g->n_stop; i++) {
                const char *f = out.n >= from ? memmem(out.p + from, out.n - from, g->stop[i], g->stop_len[i]) : NULL;
                if (f && (size_t)(f - out.p) < cut) cut = (size_t)(f - out.p);
            }
            if (cut != SIZE_MAX) {
                out.n = cut;
                out.p[cut] = 0;
                stopped = 1;
                safe = cut;
                if (!done) cm384_cancel(S.engine, rid);
            } else if (!done) safe = out.n > hold ? out.n - hold : 0;
        }
        if (g->stream && !gone && safe > sent) {
            sbuf c = {0};
            sse_chunk_head(&c, id, created, g->chat);
            sb_str(&c, g->chat ? "\"delta\":{\"content\":" : "\"text\":");
            sb_json_str(&c, out.p + sent, safe - sent);
            sb_str(&c, g->chat ? "},\"logprobs\":null,\"finish_reason\":null}]}\n\n" : ",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            gone = c.oom || send_all(fd, c.p, c.n) != 0;
            sb_free(&c);
            sent = safe;
        }
        if (!done && !gone && peer_gone(fd)) gone = 1;
        if ((gone || S.stop) && !done && !stopped) { cm384_cancel(S.engine, rid); stopped = 1; }
    }
    cm384_wait(S.engine, rid, -1);   /* the engine keeps a result until it is waited for */
    int status = j->status, n_prompt = j->n_prompt, n_cached = j->n_cached;
    int n_gen = j->n_generated ? j->n_generated : j->n_tokens, saw_eos = j->saw_eos;
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    sb_free(&j->text);
    xfree(j);
    pthread_mutex_lock(&S.mu);
    S.gen_finished++;
    if (gone) S.gen_disconnected++;
    if (stopped && !gone) S.gen_stopped++;
    pthread_mutex_unlock(&S.mu);

    int ret = 0;
    if (gone) ret = -1;
    else if (status != CM384_OK && !(stopped && status == CM384_E_CANCELLED)) {
        snprintf(err, sizeof err, "generation failed: %s", cm384_strerror(status));
        if (g->stream) {
            sbuf c = {0};
            sb_str(&c, "data: {\"error\":{\"message\":");
            sb_json_str(&c, err, strlen(err));
            sb_str(&c, ",\"type\":\"server_error\",\"param\":null,\"code\":500}}\n\ndata: [DONE]\n\n");
            send_all(fd, c.p, c.n);
            sb_free(&c);
            ret = -1;
        } else ret = send_error(fd, 500, NULL, err, keep_alive);
    } else {
        const char *finish = stopped || saw_eos ? "stop" : "length";
        sbuf c = {0};
        if (g->stream) {
            if (out.n > sent) {   /* the held-back tail */
                sse_chunk_head(&c, id, created, g->chat);
                sb_str(&c, g->chat ? "\"delta\":{\"content\":" : "\"text\":");
                sb_json_str(&c, out.p + sent, out.n - sent);
                sb_str(&c, g->chat ? "},\"logprobs\":null,\"finish_reason\":null}]}\n\n" : ",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            }
            sse_chunk_head(&c, id, created, g->chat);
            sb_printf(&c, g->chat ? "\"delta\":{},\"logprobs\":null,\"finish_reason\":\"%s\"}]" : "\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"%s\"}]", finish);
            if (g->include_usage) { sb_str(&c, ","); usage_json(&c, n_prompt, n_gen, n_cached); }
            sb_str(&c, "}\n\ndata: [DONE]\n\n");
            if (!c.oom) send_all(fd, c.p, c.n);
            ret = -1;    /* a stream ends with the connection */
        } else {
            sb_printf(&c, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":", id,
                      g->chat ? "chat.completion" : "text_completion", created);
            sb_json_str(&c, S.model_id, strlen(S.model_id));
            sb_str(&c, ",\"choices\":[{\"index\":0,");
            if (g->chat) {
                sb_str(&c, "\"message\":{\"role\":\"assistant\",\"content\":");
                sb_json_str(&c, out.p ? out.p : "", out.n);
                sb_str(&c, "},");
            } else {
                sb_str(&c, "\"text\":");
                sb_json_str(&c, out.p ? out.p : "", out.n);
                sb_str(&c, ",");
            }
            sb_printf(&c, "\"logprobs\":null,\"finish_reason\":\"%s\"}],", finish);
            usage_json(&c, n_prompt, n_gen, n_cached);
            sb_str(&c, "}\n");
            ret = c.oom ? send_error(fd, 500, NULL, "out of memory", 0), -1
                        : send_response(fd, 200, "application/json", c.p, c.n, keep_alive);
        }
        sb_free(&c);
    }
    sb_free(&out);
    return ret;
}

/* ---- GET routes ---- */

static long rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
        fclose(f);
    }
    return resident * sysconf(_SC_PAGESIZE);
}

static void metric(sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static int send_metrics(int fd, int keep_alive, size_t conn_bytes) {
    long long live = atomic_load(&live_bytes) - (long long)conn_bytes;   /* not counting this connection's input */
    cm384_stats st;
    st.struct_size = sizeof st;
    if (cm384_get_stats(S.engine, &st) != CM384_OK) return send_error(fd, 500, NULL, cm384_last_error(), keep_alive);
    sbuf b = {0};
    metric(&b, "cm384_requests_total", "counter", "Requests the engine has seen, by outcome.");
    sb_printf(&b, "cm384_requests_total{state=\"submitted\"} %llu\ncm384_requests_total{state=\"done\"} %llu\n"
                  "cm384_requests_total{state=\"cancelled\"} %llu\ncm384_requests_total{state=\"failed\"} %llu\n",
              (unsigned long long)st.requests_submitted, (unsigned long long)st.requests_done,
              (unsigned long long)st.requests_cancelled, (unsigned long long)st.requests_failed);
    metric(&b, "cm384_requests_preempted_total", "counter", "Decoding requests preempted when the KV pool was full.");
    sb_printf(&b, "cm384_requests_preempted_total %llu\n", (unsigned long long)st.requests_preempted);
    metric(&b, "cm384_tokens_total", "counter", "Tokens: prompt tokens computed, prompt tokens served by the context cache, tokens generated.");
    sb_printf(&b, "cm384_tokens_total{kind=\"prefilled\"} %llu\ncm384_tokens_total{kind=\"cached\"} %llu\n"
                  "cm384_tokens_total{kind=\"decoded\"} %llu\n",
              (unsigned long long)st.tokens_prefilled, (unsigned long long)st.tokens_cached, (unsigned long long)st.tokens_decoded);
    metric(&b, "cm384_mtp_tokens_total", "counter", "MTP speculative drafts made and accepted.");
    sb_printf(&b, "cm384_mtp_tokens_total{kind=\"drafted\"} %llu\ncm384_mtp_tokens_total{kind=\"accepted\"} %llu\n",
              (unsigned long long)st.mtp_drafted, (unsigned long long)st.mtp_accepted);
    metric(&b, "cm384_cache_hit_ratio", "gauge", "Prompt tokens served by the context cache over all prompt tokens.");
    sb_printf(&b, "cm384_cache_hit_ratio %.6f\n", st.cache_hit_ratio);
    metric(&b, "cm384_ttft_milliseconds", "summary", "Time to first token.");
    sb_printf(&b, "cm384_ttft_milliseconds{quantile=\"0.5\"} %.3f\ncm384_ttft_milliseconds{quantile=\"0.99\"} %.3f\n",
              st.ttft_p50_ms, st.ttft_p99_ms);
    metric(&b, "cm384_tpot_milliseconds", "summary", "Time per output token after the first.");
    sb_printf(&b, "cm384_tpot_milliseconds{quantile=\"0.5\"} %.3f\ncm384_tpot_milliseconds{quantile=\"0.99\"} %.3f\n",
              st.tpot_p50_ms, st.tpot_p99_ms);
    metric(&b, "cm384_throughput_tokens_per_second", "gauge", "Prefill and decode throughput over busy time.");
    sb_printf(&b, "cm384_throughput_tokens_per_second{phase=\"prefill\"} %.3f\ncm384_throughput_tokens_per_second{phase=\"decode\"} %.3f\n",
              st.prefill_tok_per_s, st.decode_tok_per_s);
    metric(&b, "cm384_busy_seconds_total", "counter", "Seconds spent in prefill and decode steps.");
    sb_printf(&b, "cm384_busy_seconds_total{phase=\"prefill\"} %.6f\ncm384_busy_seconds_total{phase=\"decode\"} %.6f\n",
              st.prefill_seconds, st.decode_seconds);
    metric(&b, "cm384_fabric_bytes_total", "counter",
           "Bytes across the emulated fabric: the UB plane carries MoE dispatch and combine, the RDMA plane the prefill-to-decode KV hand-off.");
    sb_printf(&b, "cm384_fabric_bytes_total{plane=\"ub\",kind=\"dispatch\"} %llu\ncm384_fabric_bytes_total{plane=\"ub\",kind=\"combine\"} %llu\n"
                  "cm384_fabric_bytes_total{plane=\"rdma\",kind=\"kv_handoff\"} %llu\n",
              (unsigned long long)st.dispatch_bytes, (unsigned long long)st.combine_bytes, (unsigned long long)st.kv_handoff_bytes);
    metric(&b, "cm384_fabric_bytes_bf16_total", "counter", "What dispatch and combine would have sent in bf16.");
    sb_printf(&b, "cm384_fabric_bytes_bf16_total{plane=\"ub\",kind=\"dispatch\"} %llu\ncm384_fabric_bytes_bf16_total{plane=\"ub\",kind=\"combine\"} %llu\n",
              (unsigned long long)st.dispatch_bytes_bf16, (unsigned long long)st.combine_bytes_bf16);
    metric(&b, "cm384_fabric_messages_total", "counter", "Messages across the fabric.");
    sb_printf(&b, "cm384_fabric_messages_total %llu\n", (unsigned long long)st.messages);
    metric(&b, "cm384_kv_blocks", "gauge", "KV blocks in the pool.");
    sb_printf(&b, "cm384_kv_blocks{state=\"total\"} %llu\ncm384_kv_blocks{state=\"used\"} %llu\ncm384_kv_blocks{state=\"cached\"} %llu\n",
              (unsigned long long)st.kv_blocks_total, (unsigned long long)st.kv_blocks_used, (unsigned long long)st.kv_blocks_cached);
    metric(&b, "cm384_pool_bytes", "gauge", "Bytes of the shared memory pool.");
    sb_printf(&b, "cm384_pool_bytes %llu\n", (unsigned long long)st.pool_bytes);
    metric(&b, "cm384_cache_evictions_total", "counter", "Context-cache blocks evicted.");
    sb_printf(&b, "cm384_cache_evictions_total %llu\n", (unsigned long long)st.cache_evictions);
    metric(&b, "cm384_devices", "gauge", "Emulated devices by role, and worker threads.");
    sb_printf(&b, "cm384_devices{role=\"all\"} %d\ncm384_devices{role=\"prefill\"} %d\ncm384_devices{role=\"attention\"} %d\n"
                  "cm384_devices{role=\"expert\"} %d\ncm384_devices{role=\"workers\"} %d\n",
              st.n_devices, st.n_prefill_devices, st.n_attn_devices, st.n_expert_devices, st.n_workers);
    metric(&b, "cm384_expert_load_max_over_mean", "gauge", "Decode expert imbalance: busiest expert device over the mean, per layer (1 = even).");
    sb_printf(&b, "cm384_expert_load_max_over_mean %.6f\n", st.expert_load_max_over_mean);
    uint64_t load[1024];
    int ne = cm384_get_expert_load(S.engine, -1, load, 1024);
    if (ne > 0) {
        metric(&b, "cm384_expert_tokens_total", "counter", "Tokens routed to each routed expert, summed over layers.");
        for (int i = 0; i < ne && i < 1024; i++) sb_printf(&b, "cm384_expert_tokens_total{expert=\"%d\"} %llu\n", i, (unsigned long long)load[i]);
    }
    pthread_mutex_lock(&S.mu);
    metric(&b, "cm384_server_connections", "gauge", "Open HTTP connections.");
    sb_printf(&b, "cm384_server_connections %d\n", S.n_conns);
    metric(&b, "cm384_server_connections_total", "counter", "HTTP connections accepted and refused (over --max-conns).");
    sb_printf(&b, "cm384_server_connections_total{state=\"accepted\"} %llu\ncm384_server_connections_total{state=\"refused\"} %llu\n",
              (unsigned long long)S.conns_total, (unsigned long long)S.conns_refused);
    metric(&b, "cm384_server_responses_total", "counter", "HTTP responses by status class.");
    for (int c = 2; c <= 5; c++) sb_printf(&b, "cm384_server_responses_total{code=\"%dxx\"} %llu\n", c, (unsigned long long)S.http[c]);
    metric(&b, "cm384_server_completions_total", "counter", "Completions started, finished, ended by a client that went away, ended by a stop sequence.");
    sb_printf(&b, "cm384_server_completions_total{state=\"started\"} %llu\ncm384_server_completions_total{state=\"finished\"} %llu\n"
                  "cm384_server_completions_total{state=\"disconnected\"} %llu\ncm384_server_completions_total{state=\"stopped\"} %llu\n",
              (unsigned long long)S.gen_requests, (unsigned long long)S.gen_finished,
              (unsigned long long)S.gen_disconnected, (unsigned long long)S.gen_stopped);
    pthread_mutex_unlock(&S.mu);
    metric(&b, "cm384_server_live_bytes", "gauge", "Bytes the server's own code holds for requests (JSON, prompts, texts), other than this answer; 0 when idle.");
    sb_printf(&b, "cm384_server_live_bytes %lld\n", live);
    metric(&b, "cm384_server_resident_bytes", "gauge", "Resident memory of the process.");
    sb_printf(&b, "cm384_server_resident_bytes %ld\n", rss_bytes());
    int r = b.oom ? send_error(fd, 500, NULL, "out of memory", 0) : send_response(fd, 200, "text/plain; version=0.0.4", b.p, b.n, keep_alive);
    sb_free(&b);
    return r;
}

static int send_models(int fd, int keep_alive) {
    sbuf b = {0};
    sb_str(&b, "{\"object\":\"list\",\"data\":[{\"id\":");
    sb_json_str(&b, S.model_id, strlen(S.model_id));
    sb_printf(&b, ",\"object\":\"model\",\"created\":%ld,\"owned_by\":\"cm384\"}]}\n", (long)S.started);
    int r = send_response(fd, 200, "application/json", b.p, b.n, keep_alive);
    sb_free(&b);
    return r;
}

/* ---- a connection ---- */

/* Answers one request whose head and body are read; -1 closes the connection. */
static int handle_request(int fd, const http_head *h, char *body, size_t body_n, size_t conn_bytes) {
    int ka = h->keep_alive;
    int get = !strcmp(h->method, "GET"), post = !strcmp(h->method, "POST");
    if (!strcmp(h->path, "/health")) {
        if (!get) return send_error(fd, 405, NULL, "use GET /health", ka);
        return send_response(fd, 200, "application/json", "{\"status\":\"ok\"}\n", 16, ka);
    }
    if (!strcmp(h->path, "/metrics")) {
        if (!get) return send_error(fd, 405, NULL, "use GET /metrics", ka);
        return send_metrics(fd, ka, conn_bytes);
    }
    if (!strcmp(h->path, "/v1/models") || !strcmp(h->path, "/models")) {
        if (!get) return send_error(fd, 405, NULL, "use GET /v1/models", ka);
        return send_models(fd, ka);
    }
    int chat = !strcmp(h->path, "/v1/chat/completions") || !strcmp(h->path, "/chat/completions");
    int cmpl = !strcmp(h->path, "/v1/completions") || !strcmp(h->path, "/completions");
    if (!chat && !cmpl) {
        char msg[320];
        snprintf(msg, sizeof msg, "no route %s %s", h->method, h->path);
        return send_error(fd, 404, NULL, msg, ka);
    }
    if (!post) return send_error(fd, 405, NULL, "use POST", ka);
    jval doc;
    char err[256];
    if (json_parse_doc(body, body_n, &doc, err, sizeof err)) return send_error(fd, 400, NULL, err, ka);
    gen_params g;
    const char *param = NULL;
    int r;
    if (gen_params_parse(&doc, chat, &g, err, sizeof err, &param)) r = send_error(fd, 400, param, err, ka);
    else r = run_completion(fd, &g, ka);
    gen_params_free(&g);
    jfree(&doc);
    return r;
}

static void serve_connection(int fd) {
    sbuf in = {0};
    for (;;) {
        /* the head */
        http_head h;
        const char *why = "";
        int hr;
        while ((hr = http_parse_head(in.p ? in.p : "", in.n, S.o.max_header, &h, &why)) == 0) {
            /* wait in short slices so that a shutdown is seen */
            int waited_ms = 0, ready = 0;
            while (!S.stop && waited_ms < S.o.io_timeout_s * 1000) {
                struct pollfd p = {fd, POLLIN, 0};
                if ((ready = poll(&p, 1, 200)) != 0) break;
                waited_ms += 200;
            }
            if (S.stop || ready <= 0) {
                if (in.n > 0 && !S.stop) send_error(fd, 408, NULL, "request timed out", 0);
                goto out;
            }
            char tmp[4096];
            ssize_t n = recv(fd, tmp, sizeof tmp, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0 || S.stop) {   /* closed, idle too long, or shutting down */
                if (n < 0 && in.n > 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) send_error(fd, 408, NULL, "request timed out", 0);
                goto out;
            }
            sb_put(&in, tmp, (size_t)n);
            if (in.oom) goto out;
        }
        if (hr < 0) { send_error(fd, -hr, NULL, why, 0); goto out; }
        int get = !strcmp(h.method, "GET");
        if (!get && !h.chunked && h.content_length < 0) { send_error(fd, 411, NULL, "a request body needs Content-Length", 0); goto out; }
        if (h.content_length > (long)S.o.max_body) {
            char msg[128];
            snprintf(msg, sizeof msg, "request body of %ld bytes is over the limit of %zu", h.content_length, S.o.max_body);
            send_error(fd, 413, NULL, msg, 0);
            goto out;
        }
        if (h.expect_continue && send_all(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25)) goto out;
        /* the body */
        size_t body_n = 0, used = 0;
        for (;;) {
            size_t have = in.n - h.head_len;
            if (h.chunked) {
                size_t consumed = 0;
                long d = have ? http_dechunk(in.p + h.head_len, have, S.o.max_body, &consumed) : -1;
                if (d == -2) { send_error(fd, 400, NULL, "malformed chunked body", 0); goto out; }
                if (d == -3) { send_error(fd, 413, NULL, "request body over the limit", 0); goto out; }
                if (d >= 0) { body_n = (size_t)d; used = h.head_len + consumed; break; }
                if (have > S.o.max_body * 2 + 4096) { send_error(fd, 413, NULL, "request body over the limit", 0); goto out; }
            } else {
                size_t cl = h.content_length > 0 ? (size_t)h.content_length : 0;
                if (have >= cl) { body_n = cl; used = h.head_len + cl; break; }
            }
            char tmp[16384];
            ssize_t n = recv(fd, tmp, sizeof tmp, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) send_error(fd, 408, NULL, "request body timed out", 0);
                goto out;
            }
            sb_put(&in, tmp, (size_t)n);
            if (in.oom) goto out;
        }
        /* chunked bodies were decoded in place at head_len */
        char saved = in.p[h.head_len + body_n];
        in.p[h.head_len + body_n] = 0;
        int keep = handle_request(fd, &h, in.p + h.head_len, body_n, in.cap) == 0 && h.keep_alive && !S.stop;
        in.p[h.head_len + body_n] = saved;
        if (!keep) goto out;
        /* what follows (a pipelined request) stays */
        memmove(in.p, in.p + used, in.n - used);
        in.n -= used;
        if (in.n == 0) sb_free(&in);   /* an idle keep-alive connection holds nothing */
    }
out:
    sb_free(&in);
}

typedef struct { int fd; } conn_arg;

static void *conn_thread(void *arg) {
    int fd = ((conn_arg *)arg)->fd;
    xfree(arg);
    serve_connection(fd);
    shutdown(fd, SHUT_RDWR);
    close(fd);
    pthread_mutex_lock(&S.mu);
    if (--S.n_conns == 0) {
#if defined(__GLIBC__)
        malloc_trim(0);     /* hand freed request memory back when idle */
#endif
        pthread_cond_broadcast(&S.idle);
    }
    pthread_mutex_unlock(&S.mu);
    return NULL;
}

static void on_signal(int sig) {
    (void)sig;
    atomic_store(&S.stop, 1);
}

/* ======================================================================== */
/* main                                                                      */
/* ======================================================================== */

/* A number option's value: all of it a number in [lo, hi] (whole when
 * integral), else a message naming the option and 0 (a usage error). */
static int opt_num(const char *opt, const char *v, double lo, double hi, int integral, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno == ERANGE || !isfinite(x) || x < lo || x > hi || (integral && x != floor(x))) {
        fprintf(stderr, "cm384-server: %s %s: expected %s from %.15g to %.15g (see --help)\n", opt, v,
                integral ? "a whole number" : "a number", lo, hi);
        return 0;
    }
    *out = x;
    return 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: cm384-server -m MODEL [options]\n"
            "An OpenAI-compatible HTTP server on cm384 (plain sockets, one thread per connection).\n"
            "\n"
            "  -m, --model DIR       model directory (config.json, safetensors, tokenizer)\n"
            "  --host ADDR           address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)\n"
            "  --port N              port (default 8080; 0 = any free port, printed at start)\n"
            "  --alias NAME          model id in /v1/models and answers (default: the directory's name)\n"
            "  --max-conns N         open connections at most; more get 503 (default 64)\n"
            "  --max-body BYTES      request body limit (default 1048576); over it: 413\n"
            "  --max-header BYTES    request head limit (default 16384); over it: 431\n"
            "  --timeout SECONDS     idle keep-alive and read timeout (default 30)\n"
            "  --ctx N               tokens per request, prompt + completion (default: min(model, 4096))\n"
            "  --batch N             requests decoding at once (default 64)\n"
            "  --kv-pool-mib N       KV block pool (default: --batch requests of --ctx tokens, at most 1 GiB)\n"
            "  --cache-mib N|off     context-cache budget inside the pool (default: half the pool)\n"
            "  -t N                  worker threads (default: online cores)\n"
            "  --devices N           emulated devices (default 384)\n"
            "  --tpot-target MS      SLO: the largest decode batch whose p99 time per output token stays\n"
            "                        under MS (default: none)\n"
            "  --prefill-share S     the share of the cores prompts get while others decode, up to 0.9\n"
            "                        (default 0: decode first -- the shortest TPOT, prompts slow meanwhile)\n"
            "  --preset NAME         default | paper | single\n"
            "  --chat-format NAME    deepseek-v2 | deepseek-v2-0628 | deepseek-v2.5 | deepseek-v3 | deepseek-r1:\n"
            "                        render chats so even when the model's template is missing or unknown\n"
            "                        (default: the format recognised from the model's template)\n"
            "  --int8                INT8 W8A8 weights\n"
            "  --mtp                 speculative decoding with the MTP layer\n"
            "  --kv-bf16             keep the KV cache in BF16: twice the context per byte (an approximation)\n"
            "  --prefill-expanded    prompts attend with K and V expanded per head (DeepSeek's naive MLA):\n"
            "                        faster long prompts, other rounding than decode\n"
            "  --prefault            touch the engine's whole pool at start, so no request pays for\n"
            "                        first touches of memory\n"
            "  -h, --help            this text\n"
            "\n"
            "Routes:\n"
            "  POST /v1/chat/completions  messages rendered in the model's chat format (DeepSeek V2/V2.5/V3/R1);\n"
            "                             stream (server-sent events), temperature, top_p, max_tokens,\n"
            "                             seed, stop (up to 4), n = 1, stream_options.include_usage\n"
            "  POST /v1/completions       prompt (a string, tokenized with BOS); the same options\n"
            "  GET  /v1/models            the served model\n"
            "  GET  /health               {\"status\":\"ok\"}\n"
            "  GET  /metrics              Prometheus text: requests, tokens, TTFT/TPOT, cache hits,\n"
            "                             fabric bytes per plane, KV pool, expert load, server state\n"
            "Defaults follow OpenAI's: temperature 1, top_p 1; max_tokens up to the context.  A request\n"
            "without a seed gets a fresh one.  Errors are {\"error\":{\"message\",\"type\",\"param\",\"code\"}}.\n");
}

int main(int argc, char **argv) {
    server_opts *o = &S.o;
    o->host = "127.0.0.1";
    o->port = 8080;
    o->max_conns = 64;
    o->max_body = 1 << 20;
    o->max_header = 16384;
    o->io_timeout_s = 30;
    o->max_batch = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--int8")) { o->int8 = 1; continue; }
        if (!strcmp(a, "--mtp")) { o->mtp = 1; continue; }
        if (!strcmp(a, "--kv-bf16")) { o->kv_bf16 = 1; continue; }
        if (!strcmp(a, "--prefill-expanded")) { o->prefill_expanded = 1; continue; }
        if (!strcmp(a, "--prefault")) { o->prefault = 1; continue; }
        if (!v) { fprintf(stderr, "cm384-server: %s needs a value (see --help)\n", a); return 2; }
        i++;
        double x = 0;
        int ok = 1;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) o->model_path = v;
        else if (!strcmp(a, "--host")) o->host = v;
        else if (!strcmp(a, "--alias")) o->alias = v;
        else if (!strcmp(a, "--preset")) o->preset = v;
        else if (!strcmp(a, "--chat-format")) o->chat_format = v;
        else if (!strcmp(a, "--port")) { if ((ok = opt_num(a, v, 0, 65535, 1, &x))) o->port = (int)x; }
        else if (!strcmp(a, "--max-conns")) { if ((ok = opt_num(a, v, 1, 1 << 20, 1, &x))) o->max_conns = (int)x; }
        else if (!strcmp(a, "--max-body")) { if ((ok = opt_num(a, v, 1, 1ull << 40, 1, &x))) o->max_body = (size_t)x; }
        else if (!strcmp(a, "--max-header")) { if ((ok = opt_num(a, v, 64, 1 << 30, 1, &x))) o->max_header = (size_t)x; }
        else if (!strcmp(a, "--timeout")) { if ((ok = opt_num(a, v, 0.001, 1e7, 0, &x))) o->io_timeout_s = x; }
        else if (!strcmp(a, "--ctx")) { if ((ok = opt_num(a, v, 2, 1 << 24, 1, &x))) o->max_ctx = (int)x; }
        else if (!strcmp(a, "--batch")) { if ((ok = opt_num(a, v, 1, 4096, 1, &x))) o->max_batch = (int)x; }
        else if (!strcmp(a, "--kv-pool-mib")) { if ((ok = opt_num(a, v, 1, 1 << 30, 0, &x))) o->kv_pool_mib = x; }
        else if (!strcmp(a, "--cache-mib")) {
            if (!strcmp(v, "off")) o->cache_mib = -1;
            else if ((ok = opt_num(a, v, 1, 1 << 30, 0, &x))) o->cache_mib = x;
        }
        else if (!strcmp(a, "-t")) { if ((ok = opt_num(a, v, 1, 4096, 1, &x))) o->threads = (int)x; }
        else if (!strcmp(a, "--devices")) { if ((ok = opt_num(a, v, 1, 1 << 20, 1, &x))) o->devices = (int)x; }
        else if (!strcmp(a, "--tpot-target")) { if ((ok = opt_num(a, v, 0, 1e6, 0, &x))) o->tpot_target_ms = x; }
        else if (!strcmp(a, "--prefill-share")) { if ((ok = opt_num(a, v, 0, 0.9, 0, &x))) o->prefill_share = x; }
        else { fprintf(stderr, "cm384-server: unknown option %s (see --help)\n", a); return 2; }
        if (!ok) return 2;
    }
    if (!o->model_path) { usage(stderr); return 2; }
    signal(SIGPIPE, SIG_IGN);
#if defined(__GLIBC__)
    mallopt(M_ARENA_MAX, 2);   /* a thread per connection would otherwise scatter freed memory over many arenas */
#endif
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    pthread_mutex_init(&S.mu, NULL);
    pthread_cond_init(&S.idle, NULL);
    S.started = time(NULL);

    if (cm384_model_load(o->model_path, NULL, &S.model) != CM384_OK) {
        fprintf(stderr, "cm384-server: %s\n", cm384_last_error());
        return 1;
    }
    cm384_model_info info;
    info.struct_size = sizeof info;
    cm384_model_get_info(S.model, &info);
    int fmt = cm384_chat_format(S.model);
    if (o->chat_format) {
        for (S.chat_format = 1; S.chat_format < 64 && strcmp(cm384_chat_format_name(S.chat_format), o->chat_format); S.chat_format++) {}
        if (S.chat_format == 64 || !*cm384_chat_format_name(S.chat_format)) {
            fprintf(stderr, "cm384-server: unknown --chat-format %s (see --help)\n", o->chat_format);
            cm384_model_free(S.model);
            return 2;
        }
        fmt = S.chat_format;
    }
    cm384_config cfg;
    cm384_config_init(&cfg);
    if (o->threads) cfg.n_workers = o->threads;
    if (o->devices) cfg.n_devices = o->devices;
    if (o->preset) cfg.preset = o->preset;
    cfg.int8 = o->int8;
    cfg.mtp = o->mtp;
    cfg.kv_bf16 = o->kv_bf16;
    cfg.prefill_expanded = o->prefill_expanded;
    cfg.prefault = o->prefault;
    cfg.max_batch = o->max_batch;
    cfg.tpot_target_ms = o->tpot_target_ms;
    cfg.prefill_share = o->prefill_share;
    if (o->kv_pool_mib > 0) cfg.kv_pool_bytes = (size_t)(o->kv_pool_mib * 1048576);
    if (o->cache_mib < 0) cfg.cache_bytes = (size_t)-1;
    else if (o->cache_mib > 0) cfg.cache_bytes = (size_t)(o->cache_mib * 1048576);
    S.max_ctx = o->max_ctx > 0 ? o->max_ctx : (info.max_position_embeddings > 0 && info.max_position_embeddings < 4096
                                               ? info.max_position_embeddings : 4096);
    cfg.max_ctx = S.max_ctx;
    if (cm384_engine_create(S.model, &cfg, &S.engine) != CM384_OK) {
        fprintf(stderr, "cm384-server: %s\n", cm384_last_error());
        cm384_model_free(S.model);
        return 1;
    }
    S.eos = cm384_token_eos(S.model);
    if (o->alias) snprintf(S.model_id, sizeof S.model_id, "%s", o->alias);
    else {
        const char *p = o->model_path + strlen(o->model_path);
        while (p > o->model_path && p[-1] == '/') p--;
        const char *e = p;
        while (p > o->model_path && p[-1] != '/') p--;
        snprintf(S.model_id, sizeof S.model_id, "%.*s", (int)(e - p), p);
    }

    /* listen */
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    int gr = getaddrinfo(o->host, port, &hints, &ai);
    if (gr) { fprintf(stderr, "cm384-server: %s: %s\n", o->host, gai_strerror(gr)); return 1; }
    int ls = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), one = 1;
    if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) || bind(ls, ai->ai_addr, ai->ai_addrlen) ||
        listen(ls, 128)) {
        fprintf(stderr, "cm384-server: cannot listen on %s:%d: %s\n", o->host, o->port, strerror(errno));
        freeaddrinfo(ai);
        return 1;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage sa_l;
    socklen_t sl = sizeof sa_l;
    getsockname(ls, (struct sockaddr *)&sa_l, &sl);
    int bound = ntohs(sa_l.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa_l)->sin6_port : ((struct sockaddr_in *)&sa_l)->sin_port);
    printf("cm384-server: model %s (%s, chat format %s), context %d, listening on http://%s:%d\n", S.model_id, info.model_type,
           fmt > 0 ? cm384_chat_format_name(fmt) : "none: /v1/chat/completions answers 500", S.max_ctx,
           o->host, bound);
    fflush(stdout);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    struct timeval tv = {(time_t)o->io_timeout_s, (suseconds_t)((o->io_timeout_s - (double)(time_t)o->io_timeout_s) * 1e6)};
    while (!S.stop) {
        struct pollfd p = {ls, POLLIN, 0};
        if (poll(&p, 1, 200) <= 0) continue;
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) continue;
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_mutex_lock(&S.mu);
        int full = S.n_conns >= o->max_conns;
        if (full) S.conns_refused++;
        else { S.n_conns++; S.conns_total++; }
        pthread_mutex_unlock(&S.mu);
        if (full) {
            send_error(fd, 503, NULL, "too many connections; try again later", 0);
            close(fd);
            continue;
        }
        conn_arg *ca = xmalloc(sizeof *ca);
        pthread_t th;
        if (!ca || (ca->fd = fd, pthread_create(&th, &attr, conn_thread, ca))) {
            xfree(ca);
            send_error(fd, 503, NULL, "cannot start a connection thread", 0);
            close(fd);
            pthread_mutex_lock(&S.mu);
            S.n_conns--;
            pthread_mutex_unlock(&S.mu);
        }
    }
    close(ls);
    /* connections notice S.stop, cancel their requests and finish */
    pthread_mutex_lock(&S.mu);
    while (S.n_conns > 0) pthread_cond_wait(&S.idle, &S.mu);
    pthread_mutex_unlock(&S.mu);
    pthread_attr_destroy(&attr);
    cm384_engine_free(S.engine);
    cm384_model_free(S.model);
    fprintf(stderr, "cm384-server: stopped\n");
    return 0;
}
#endif

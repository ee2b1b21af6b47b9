/* json: any bytes through the JSON reader (config.json, tokenizer files,
 * safetensors headers and the shard index all go through it).
 * Must hold: a parse either succeeds, or fails with CM384_E_FORMAT and a
 * message naming the input; a parsed tree written back out as JSON parses
 * again to the same tree (strings, keys, numbers and nesting survive). */

typedef struct { char *p; size_t n, cap; } fj_buf;

static void fj_put(fj_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void fj_string(fj_buf *b, const char *s, size_t n) {
    fj_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') { esc[0] = '\\'; esc[1] = (char)c; fj_put(b, esc, 2); }
        else if (c < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", c); fj_put(b, esc, 6); }
        else fj_put(b, (const char *)&s[i], 1);     /* other bytes as they are */
    }
    fj_put(b, "\"", 1);
}

static void fj_write(fj_buf *b, const json *v) {
    char num[40];
    switch (v->type) {
    case JSON_NULL: fj_put(b, "null", 4); break;
    case JSON_TRUE: fj_put(b, "true", 4); break;
    case JSON_FALSE: fj_put(b, "false", 5); break;
    case JSON_NUMBER:
        if (isnan(v->num)) fj_put(b, "NaN", 3);
        else if (isinf(v->num)) fj_put(b, v->num > 0 ? "1e999" : "-1e999", v->num > 0 ? 5 : 6);
        else fj_put(b, num, (size_t)snprintf(num, sizeof num, "%.17g", v->num));
        break;
    case JSON_STRING: fj_string(b, v->str, (size_t)v->len); break;
    case JSON_ARRAY:
    case JSON_OBJECT:
        fj_put(b, v->type == JSON_ARRAY ? "[" : "{", 1);
        for (int i = 0; i < v->len; i++) {
            if (i) fj_put(b, ",", 1);
            if (v->type == JSON_OBJECT) {
                fj_string(b, v->kids[i].key, (size_t)v->kids[i].key_len);
                fj_put(b, ":", 1);
            }
            fj_write(b, &v->kids[i]);
        }
        fj_put(b, v->type == JSON_ARRAY ? "]" : "}", 1);
        break;
    default: FUZZ_CHECK(0, "node of unknown type %d", v->type);
    }
}

/* the same tree: types, lengths, bytes, numbers (NaN equals NaN, -0 is not 0) */
static int fj_same(const json *a, const json *b) {
    if (a->type != b->type || a->len != b->len) return 0;
    if ((a->key != NULL) != (b->key != NULL)) return 0;
    if (a->key && (a->key_len != b->key_len || memcmp(a->key, b->key, (size_t)a->key_len))) return 0;
    switch (a->type) {
    case JSON_NUMBER:
        return (isnan(a->num) && isnan(b->num)) || (a->num == b->num && signbit(a->num) == signbit(b->num));
    case JSON_STRING: return memcmp(a->str, b->str, (size_t)a->len) == 0 && a->str[a->len] == 0;
    case JSON_ARRAY:
    case JSON_OBJECT:
        for (int i = 0; i < a->len; i++)
            if (!fj_same(&a->kids[i], &b->kids[i])) return 0;
        return 1;
    default: return 1;
    }
}

static int fuzz_json(const uint8_t *data, size_t size) {
    arena a = {0}, a2 = {0};
    json v, w;
    int r = json_parse((const char *)data, size, &a, &v, "fuzz-input");
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_NOMEM);
        FUZZ_CHECK(strstr(cm384_last_error(), "fuzz-input") != NULL, "the message does not name the input");
    } else {
        fj_buf b = {0};
        fj_write(&b, &v);
        r = json_parse(b.p, b.n, &a2, &w, "fuzz-rewritten");
        FUZZ_CHECK(r == CM384_OK, "the re-written JSON does not parse: %.*s", (int)(b.n < 200 ? b.n : 200), b.p);
        FUZZ_CHECK(fj_same(&v, &w), "the re-written JSON parses to another tree: %.*s",
                   (int)(b.n < 200 ? b.n : 200), b.p);
        free(b.p);
    }
    arena_free(&a);
    arena_free(&a2);
    return 0;
}

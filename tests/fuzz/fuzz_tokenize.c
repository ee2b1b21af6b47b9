/* tokenize: arbitrary bytes through DeepSeek-V3's real tokenizer, both ways.
 * The first byte picks the flags; the rest is the text.  The same bytes are
 * also read as token ids (int32, little-endian) and decoded.
 * Must hold: detokenize(tokenize(text)) is the text itself when the text is
 * valid UTF-8 (byte-level BPE loses nothing), and valid UTF-8 otherwise; ids
 * lie in [0, vocab); count, write and small-cap calls agree; a stream
 * decode gives what detokenize gives; an out-of-range id fails with
 * CM384_E_INVALID; a stream push with too small a buffer fails with
 * CM384_E_CAPACITY and leaves the stream as it was. */

static cm384_model *fuzz_tok_model;

static void fuzz_tokenize_init(void) {
    if (cm384_model_load(fuzz_fixture("tokenizer/tokenizer.json"), NULL, &fuzz_tok_model)) {
        fprintf(stderr, "%s\n", cm384_last_error());
        exit(2);
    }
}

/* Streams ids one at a time; the bytes must be want (detokenize's result). */
static void fuzz_tokenize_stream(const cm384_model *m, const int32_t *ids, int n, const char *want, size_t want_len) {
    cm384_detok_stream ds;
    cm384_detok_stream_init(&ds);
    char piece[512];                                  /* "512 for every tokenizer we know" */
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        cm384_detok_stream before = ds;
        char tiny[2];
        int w = cm384_detok_stream_push(m, &ds, ids[i], tiny, sizeof tiny);
        if (w == CM384_E_CAPACITY) FUZZ_CHECK(!memcmp(&before, &ds, sizeof ds), "a failed push changed the stream");
        else {
            /* it fit in two bytes: undo it and push again into the big buffer */
            FUZZ_CHECK(w >= 0 && w <= 2, "push into 2 bytes returned %d", w);
            ds = before;
        }
        w = cm384_detok_stream_push(m, &ds, ids[i], piece, sizeof piece);
        FUZZ_CHECK(w >= 0 && k + (size_t)w <= want_len, "stream push returned %d", w);
        FUZZ_CHECK(!memcmp(want + k, piece, (size_t)w), "stream and detokenize differ at byte %zu", k);
        k += (size_t)w;
    }
    int w = cm384_detok_stream_flush(&ds, piece, sizeof piece);
    FUZZ_CHECK(w >= 0 && k + (size_t)w == want_len, "streamed %zu + %d bytes, detokenize %zu", k, w, want_len);
    FUZZ_CHECK(!memcmp(want + k, piece, (size_t)w), "stream flush differs");
}

static int fuzz_tokenize(const uint8_t *data, size_t size) {
    const cm384_model *m = fuzz_tok_model;
    if (!size) return 0;
    unsigned flags = data[0] & 3;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int V = cm384_vocab_size(m), bos = cm384_token_bos(m);

    int n = cm384_tokenize(m, text, len, NULL, 0, flags);
    FUZZ_CHECK(n >= 0, "tokenize failed");
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!ids) abort();
    FUZZ_CHECK(cm384_tokenize(m, text, len, ids, n, flags) == n, "count and write differ");
    for (int i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < V, "id %d out of [0, %d)", ids[i], V);
    if (n >= 2) {
        int32_t *half = malloc(sizeof(int32_t) * (size_t)(n / 2));
        if (!half) abort();
        FUZZ_CHECK(cm384_tokenize(m, text, len, half, n / 2, flags) == n, "a small cap changed the count");
        FUZZ_CHECK(!memcmp(half, ids, sizeof(int32_t) * (size_t)(n / 2)), "a small cap wrote other ids");
        free(half);
    }
    int skip = 0;
    if (flags & CM384_TOK_ADD_BOS) {
        FUZZ_CHECK(n >= 1 && ids[0] == bos, "ADD_BOS did not start with BOS");
        skip = 1;
    }
    int d = cm384_detokenize(m, ids + skip, n - skip, NULL, 0);
    FUZZ_CHECK(d >= 0, "detokenize failed");
    char *back = malloc((size_t)d + 1);
    if (!back) abort();
    FUZZ_CHECK(cm384_detokenize(m, ids + skip, n - skip, back, (size_t)d + 1) == d, "detokenize length");
    if (fuzz_utf8_valid(text, len))
        FUZZ_CHECK((size_t)d == len && !memcmp(back, text, len), "round trip lost the text (%d bytes back of %zu)", d, len);
    else
        FUZZ_CHECK(fuzz_utf8_valid(back, (size_t)d), "decoded text is not valid UTF-8");
    if (d > 1) {                                          /* snprintf convention: a prefix and a NUL */
        char *cut = malloc((size_t)d / 2 + 1);
        if (!cut) abort();
        FUZZ_CHECK(cm384_detokenize(m, ids + skip, n - skip, cut, (size_t)d / 2 + 1) == d, "small-cap length");
        FUZZ_CHECK(!memcmp(cut, back, (size_t)d / 2) && cut[d / 2] == 0, "small cap is not a prefix");
        free(cut);
    }
    fuzz_tokenize_stream(m, ids + skip, n - skip, back, (size_t)d);
    free(back);
    free(ids);

    /* the same bytes as ids */
    int n_raw = (int)(len / 4);
    int32_t *raw = malloc(sizeof(int32_t) * (size_t)(n_raw + 1));
    if (!raw) abort();
    memcpy(raw, text, (size_t)n_raw * 4);
    int bad = 0;
    for (int i = 0; i < n_raw; i++) {
        if (flags & 2) raw[i] = (int32_t)((uint32_t)raw[i] % (uint32_t)(V + 2));   /* mostly in range */
        bad |= raw[i] < 0 || raw[i] >= V;
    }
    d = cm384_detokenize(m, raw, n_raw, NULL, 0);
    if (bad) FUZZ_CHECK(d == CM384_E_INVALID, "an id out of range gave %d", d);
    else {
        FUZZ_CHECK(d >= 0, "detokenize of valid ids failed");
        back = malloc((size_t)d + 1);
        if (!back) abort();
        FUZZ_CHECK(cm384_detokenize(m, raw, n_raw, back, (size_t)d + 1) == d, "detokenize length");
        FUZZ_CHECK(fuzz_utf8_valid(back, (size_t)d), "decoded ids are not valid UTF-8");
        fuzz_tokenize_stream(m, raw, n_raw, back, (size_t)d);
        free(back);
    }
    free(raw);
    return 0;
}

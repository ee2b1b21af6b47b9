/* tokenizer: tokenizer.json, any bytes, loaded as a tokenizer-only model
 * (vocab, merges, added tokens, pre-tokenizer regexes, decoder).  When it
 * loads, the tokenizer is used: every token's text, and a few texts (fixed
 * ones and the input's own tail) tokenized with each flag and decoded back,
 * in one call and streamed.
 * Must hold: a bad file fails with FORMAT or UNSUPPORTED and names the file;
 * a loaded tokenizer only produces ids in [0, vocab); counting (cap 0) and
 * writing give the same number; a smaller cap writes a prefix; decoding its
 * ids succeeds and streaming them one at a time gives the same bytes. */

/* Tokenizes text with flags, checks the ids, decodes them both ways. */
static void fuzz_tok_use(const cm384_model *m, const char *text, size_t len, unsigned flags) {
    int V = cm384_vocab_size(m);
    int n = cm384_tokenize(m, text, len, NULL, 0, flags);
    if (n < 0) { FUZZ_CHECK_FAILED(n, CM384_E_NOMEM, CM384_E_CAPACITY); return; }
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
    if ((flags & CM384_TOK_ADD_BOS) && cm384_token_bos(m) >= 0)
        FUZZ_CHECK(n >= 1 && ids[0] == cm384_token_bos(m), "ADD_BOS did not start with BOS");
    int d = cm384_detokenize(m, ids, n, NULL, 0);
    FUZZ_CHECK(d >= 0, "detokenize of its own ids failed");
    char *text_out = malloc((size_t)d + 1), *streamed = malloc((size_t)d + 1);
    if (!text_out || !streamed) abort();
    FUZZ_CHECK(cm384_detokenize(m, ids, n, text_out, (size_t)d + 1) == d, "detokenize length");
    FUZZ_CHECK(fuzz_utf8_valid(text_out, (size_t)d), "detokenize wrote invalid UTF-8");
    cm384_detok_stream ds;
    cm384_detok_stream_init(&ds);
    size_t k = 0, cap = tokenizer_stream_cap(m->tok);      /* what the header promises suffices */
    char *piece = malloc(cap);
    if (!piece) abort();
    for (int i = 0; i < n; i++) {
        int w = cm384_detok_stream_push(m, &ds, ids[i], piece, cap);
        FUZZ_CHECK(w >= 0 && k + (size_t)w <= (size_t)d, "stream push %d", w);
        memcpy(streamed + k, piece, (size_t)w);
        k += (size_t)w;
    }
    int w = cm384_detok_stream_flush(&ds, piece, cap);
    FUZZ_CHECK(w >= 0 && k + (size_t)w == (size_t)d, "streamed %zu + %d bytes, detokenize %d", k, w, d);
    memcpy(streamed + k, piece, (size_t)w);
    FUZZ_CHECK(!memcmp(streamed, text_out, (size_t)d), "streaming decode differs from detokenize");
    free(piece);
    free(text_out);
    free(streamed);
    free(ids);
}

static void fuzz_tok_exercise(const cm384_model *m, const uint8_t *data, size_t size) {
    int V = cm384_vocab_size(m);
    FUZZ_CHECK(V >= 0, "vocab size %d", V);
    int bos = cm384_token_bos(m), eos = cm384_token_eos(m);
    FUZZ_CHECK(bos >= -1 && bos < V && eos >= -1 && eos < V, "bos %d eos %d vocab %d", bos, eos, V);
    int step = V > 4096 ? V / 4096 : 1;
    for (int id = 0; id < V; id += step) {
        int len = cm384_token_text(m, id, NULL, 0);
        FUZZ_CHECK(len >= 0, "token_text(%d)", id);
        char buf[64];
        FUZZ_CHECK(cm384_token_text(m, id, buf, sizeof buf) == len, "token_text length");
        int sp = cm384_token_is_special(m, id);
        FUZZ_CHECK(sp == 0 || sp == 1, "is_special %d", sp);
    }
    FUZZ_CHECK(cm384_token_text(m, V, NULL, 0) == CM384_E_INVALID, "token_text past the vocab");
    static const char *texts[] = {"Hello world! 123 4567 caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd  \n\t x",
                                  "<｜begin▁of▁sentence｜>hi<|endoftext|>",
                                  "\xff\xfe bad \xc3 bytes \xe2\x82"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        for (unsigned fl = 0; fl < 3; fl++) fuzz_tok_use(m, texts[i], strlen(texts[i]), fl);
    size_t tail = size < 256 ? size : 256;
    fuzz_tok_use(m, (const char *)data + size - tail, tail, 0);
}

static int fuzz_tokenizer(const uint8_t *data, size_t size) {
    const char *path = fuzz_path("tokenizer.json");
    fuzz_write(path, data, size);
    cm384_model *m = NULL;
    int r = cm384_model_load(path, NULL, &m);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(strstr(cm384_last_error(), "tokenizer.json") != NULL, "the message does not name the file");
        return 0;
    }
    fuzz_tok_exercise(m, data, size);
    cm384_model_free(m);
    return 0;
}

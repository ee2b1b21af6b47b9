/* gguf: any bytes as one .gguf file, loaded as a model (header, metadata,
 * tensor infos, deepseek2 hyper-parameters, tensor binding, the tokenizer
 * from tokenizer.ggml.*).  When it loads, it is used: a tokenizer-only file
 * tokenizes and decodes a text; a model also runs a 3-token forward pass on
 * one device, which reads every bound weight.
 * Must hold: a bad file fails with FORMAT, UNSUPPORTED or NOMEM, leaves no
 * model, and the message names the file; an accepted file's tensors lie
 * inside it (and ASan sees any read outside the mapping: the forward pass
 * touches every row); tokenizing gives ids below the vocab size.  Seeds:
 * tests/fuzz/make_gguf_seeds.py. */

static void fuzz_gguf_use(cm384_model *m) {
    int V = cm384_vocab_size(m);
    int32_t ids[64];
    int n = cm384_tokenize(m, "ab c\n", 5, ids, 64, CM384_TOK_ADD_BOS);
    if (n >= 0)
        for (int i = 0; i < n && i < 64; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < V, "id %d of %d", ids[i], V);
    char text[256];
    if (n > 0) FUZZ_CHECK(cm384_detokenize(m, ids, n < 64 ? n : 64, text, sizeof text) >= 0, "detokenize of its ids");
    if (m->tokenizer_only) return;
    cm384_config c;
    cm384_config_init(&c);
    c.preset = "single"; c.n_devices = 1; c.n_workers = 1; c.max_ctx = 8; c.max_batch = 1;
    c.kv_pool_bytes = 1 << 20; c.int8_dispatch = 0;
    cm384_engine *e;
    int r = cm384_engine_create(m, &c, &e);
    if (r) { FUZZ_CHECK_FAILED(r, CM384_E_NOMEM, CM384_E_INVALID, CM384_E_CAPACITY); return; }
    int32_t in[3] = {0, V > 1 ? 1 : 0, V - 1};
    float *lg = malloc(sizeof(float) * 3 * (size_t)V);
    if (!lg) abort();
    r = cm384_eval(e, in, 3, lg, NULL);
    if (r) FUZZ_CHECK_FAILED(r, CM384_E_NOMEM, CM384_E_CAPACITY, CM384_E_INVALID);
    free(lg);
    cm384_engine_free(e);
}

static int fuzz_gguf(const uint8_t *data, size_t size) {
    const char *path = fuzz_path("model.gguf");
    fuzz_write(path, data, size);
    cm384_model *m = (cm384_model *)1;
    int r = cm384_model_load(path, NULL, &m);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(m == NULL, "a failed load left a model");
        FUZZ_CHECK(strstr(cm384_last_error(), path) != NULL, "the message does not name the file");
        return 0;
    }
    /* every tensor of an accepted file lies inside it */
    const uint8_t *base = m->files[0].data, *end = base + m->files[0].size;
    for (int i = 0; i < m->tensors.cap; i++) {
        const tensor_info *t = &m->tensors.items[i];
        if (!t->name || t->dtype < 0) continue;
        FUZZ_CHECK(t->data >= base && t->data <= end && t->nbytes <= (size_t)(end - t->data),
                   "tensor \"%s\" lies outside the file", t->name);
    }
    fuzz_gguf_use(m);
    cm384_model_free(m);
    return 0;
}

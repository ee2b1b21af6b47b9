/* tokenizer_config: tokenizer_config.json, any bytes: BOS and EOS (as text
 * or {"content": ...}) and the chat template (a string or a list of named
 * templates), read against the tiny tokenizer.  The tokenizer.json part of
 * the load runs once; each input runs load_config, the step that reads this
 * file, exactly as tokenizer_load calls it.  Then a fixed conversation is
 * rendered.
 * Must hold: a bad file fails with FORMAT and names it; BOS and EOS ids are
 * -1 or real ids; the template is recognised as one of the known formats or
 * not at all; the model's format renders (or, for none, fails with
 * UNSUPPORTED) starting with the BOS text; V3's format renders exactly the
 * BOS text followed by V3's format of the conversation. */

#if CM384_ARENA_CHUNK != 0
#error "the fuzz build sets CM384_ARENA_CHUNK 0: this harness frees what each input allocated, chunk by chunk"
#endif

static tok_loader fuzz_tc_loader;        /* tokenizer_load's state, kept */
static arena_chunk *fuzz_tc_mem_mark;    /* the tokenizer's arena after loading */

static void fuzz_tokenizer_config_init(void) {
    tok_loader *L = &fuzz_tc_loader;
    json root;
    L->path = fuzz_fixture("tiny-tokenizer/tokenizer.json");
    L->t = calloc(1, sizeof *L->t);
    /* tokenizer_load's steps before load_config */
    int r = !L->t ? CM384_E_NOMEM : json_load_file(L->path, &L->tmp, &root);
    if (!r) r = load_model(L, &root);
    if (!r) r = load_added_tries(L);
    if (!r) r = check_normalizer(L, json_get(&root, "normalizer"));
    if (!r) r = add_pretok(L, json_get(&root, "pre_tokenizer"), 0);
    if (!r) r = check_decoder(L, json_get(&root, "decoder"));
    if (r) { fprintf(stderr, "%s\n", cm384_last_error()); exit(2); }
    fuzz_tc_mem_mark = L->t->mem.head;
}

static int fuzz_tokenizer_config(const uint8_t *data, size_t size) {
    tok_loader *L = &fuzz_tc_loader;
    tokenizer *t = L->t;
    const char *path = fuzz_path("tokenizer_config.json");
    fuzz_write(path, data, size);
    arena_chunk *tmp_mark = L->tmp.head;
    size_t tmp_total = L->tmp.total;
    int r = load_config(L, path);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_NOMEM);
        FUZZ_CHECK(strstr(cm384_last_error(), "tokenizer_config.json") != NULL, "the message does not name the file");
    } else {
        cm384_model m;                        /* a tokenizer-only model around it */
        memset(&m, 0, sizeof m);
        m.tokenizer_only = 1;
        m.tok = t;
        int V = cm384_vocab_size(&m), bos = cm384_token_bos(&m), eos = cm384_token_eos(&m);
        FUZZ_CHECK(bos >= -1 && bos < V && eos >= -1 && eos < V, "bos %d eos %d vocab %d", bos, eos, V);
        const cm384_chat_msg msgs[] = {{"system", "S", NULL, 0}, {"user", "U", NULL, 0},
                                       {"assistant", "A</think>B", NULL, 0}, {"user", "V", NULL, 0}};
        FUZZ_CHECK(t->chat_format == CM384_E_NOT_FOUND || t->chat_format == CM384_E_UNSUPPORTED ||
                   (t->chat_format >= CM384_CHAT_DEEPSEEK_V2 && t->chat_format <= CM384_CHAT_DEEPSEEK_R1),
                   "chat format %d", t->chat_format);
        int n = cm384_chat_render(&m, msgs, 4, CM384_CHAT_ADD_GENERATION_PROMPT, NULL, 0);
        if (t->chat_format < 0) FUZZ_CHECK(n == CM384_E_UNSUPPORTED, "no known template, yet the render gave %d", n);
        else {
            char *got = malloc((size_t)(n > 0 ? n : 0) + 1);
            if (!got) abort();
            FUZZ_CHECK(n >= 0 && cm384_chat_render(&m, msgs, 4, CM384_CHAT_ADD_GENERATION_PROMPT, got, (size_t)n + 1) == n,
                       "render in the model's format: %d", n);
            FUZZ_CHECK(!strncmp(got, t->bos_text, strlen(t->bos_text)), "the render does not start with the BOS text");
            free(got);
        }
        size_t want_cap = strlen(t->bos_text) + 512;
        char *want = malloc(want_cap);
        if (!want) abort();
        snprintf(want, want_cap, "%sS<｜User｜>U<｜Assistant｜>A</think>B<｜end▁of▁sentence｜><｜User｜>V<｜Assistant｜>",
                 t->bos_text);
        n = cm384_chat_render_format(&m, CM384_CHAT_DEEPSEEK_V3, msgs, 4, CM384_CHAT_ADD_GENERATION_PROMPT, NULL, 0);
        FUZZ_CHECK(n == (int)strlen(want), "V3 render length %d, expected %zu", n, strlen(want));
        char *got = malloc((size_t)n + 1);
        if (!got) abort();
        FUZZ_CHECK(cm384_chat_render_format(&m, CM384_CHAT_DEEPSEEK_V3, msgs, 4, CM384_CHAT_ADD_GENERATION_PROMPT, got,
                                            (size_t)n + 1) == n, "V3 render");
        FUZZ_CHECK(!strcmp(got, want), "V3 render \"%s\", expected \"%s\"", got, want);
        free(got);
        free(want);
    }
    /* give back what this input allocated (each arena chunk is one allocation here) */
    while (L->tmp.head != tmp_mark) { arena_chunk *c = L->tmp.head; L->tmp.head = c->next; free(c); }
    L->tmp.total = tmp_total;
    while (t->mem.head != fuzz_tc_mem_mark) { arena_chunk *c = t->mem.head; t->mem.head = c->next; free(c); }
    t->chat_format = CM384_E_NOT_FOUND;
    return 0;
}

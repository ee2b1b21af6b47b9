/* chat: conversations built from fuzz bytes -- any roles (known, unknown,
 * NULL), contents (any bytes, NULL), tool calls (NULL names, arguments,
 * types) -- rendered in any chat format (the model's, each DeepSeek format,
 * numbers that are none) with DeepSeek-V3's real tokenizer.
 * Must hold: an unknown format and a conversation that breaks the documented
 * rules (no role; no content where the format needs one; a tool call without
 * name or arguments) fail with CM384_E_INVALID, and only they; otherwise the
 * render starts with the BOS text, follows the snprintf convention, and
 * tokenizing and detokenizing it gives it back (lossily only where a content
 * was not valid UTF-8); in V3's format (the model's) it also holds every
 * user, system and tool content and ends with the assistant prefix when
 * asked for and the last turn is not a tool output. */

static cm384_model *fuzz_chat_model;

static void fuzz_chat_init(void) {
    if (cm384_model_load(fuzz_fixture("tokenizer/tokenizer.json"), NULL, &fuzz_chat_model)) {
        fprintf(stderr, "%s\n", cm384_last_error());
        exit(2);
    }
}

static int fuzz_chat(const uint8_t *data, size_t size) {
    static const char *roles[] = {"system", "user", "assistant", "tool", NULL, "", "developer", "User"};
    const cm384_model *m = fuzz_chat_model;
    fz f = {data, size};
    uint8_t fb = fz_u8(&f);
    unsigned flags = fb & 1;
    static const int formats[8] = {CM384_CHAT_MODEL, CM384_CHAT_DEEPSEEK_V2, CM384_CHAT_DEEPSEEK_V2_0628,
                                   CM384_CHAT_DEEPSEEK_V25, CM384_CHAT_DEEPSEEK_V3, CM384_CHAT_DEEPSEEK_R1, 6, -1};
    int format = formats[(fb >> 1) & 7];
    int bad_format = format < 0 || format > CM384_CHAT_DEEPSEEK_R1;
    int tools = format == CM384_CHAT_MODEL || format == CM384_CHAT_DEEPSEEK_V25 || format == CM384_CHAT_DEEPSEEK_V3 ||
                format == CM384_CHAT_DEEPSEEK_R1;
    int v3 = format == CM384_CHAT_MODEL || format == CM384_CHAT_DEEPSEEK_V3;   /* the model's is V3's */
    int n = fz_u8(&f) % 9;
    cm384_chat_msg msgs[8];
    cm384_tool_call calls[8][3];
    char *owned[8 * 10];
    int n_owned = 0, expect_invalid = 0, all_utf8 = 1, last_tool = 0;
    for (int i = 0; i < n; i++) {
        cm384_chat_msg *g = &msgs[i];
        uint8_t sel = fz_u8(&f);
        g->role = roles[sel & 7];
        g->content = NULL;
        if (!(sel & 8)) {
            size_t len;
            owned[n_owned++] = fz_str(&f, 200, &len);
            g->content = owned[n_owned - 1];
            all_utf8 &= fuzz_utf8_valid(g->content, strlen(g->content));
        }
        g->n_tool_calls = (sel >> 4) % 4;
        g->tool_calls = g->n_tool_calls ? calls[i] : NULL;
        if (g->n_tool_calls == 3) { g->n_tool_calls = (int)(int8_t)fz_u8(&f); g->tool_calls = calls[i]; if (g->n_tool_calls > 3) g->n_tool_calls = 3; }
        for (int j = 0; j < (g->n_tool_calls > 0 ? g->n_tool_calls : 0); j++) {
            uint8_t b = fz_u8(&f);
            const char **fields[3] = {&calls[i][j].type, &calls[i][j].name, &calls[i][j].arguments};
            for (int k = 0; k < 3; k++) {
                if (b & (1 << k)) *fields[k] = NULL;
                else { owned[n_owned++] = fz_str(&f, 60, NULL); *fields[k] = owned[n_owned - 1];
                       all_utf8 &= fuzz_utf8_valid(*fields[k], strlen(*fields[k])); }
            }
        }
        /* what the header documents as invalid */
        if (!g->role) expect_invalid = 1;
        else if (!g->content && (!tools || !strcmp(g->role, "user") || !strcmp(g->role, "system") || !strcmp(g->role, "tool")))
            expect_invalid = 1;
        if (g->n_tool_calls < 0) expect_invalid = 1;
        for (int j = 0; j < g->n_tool_calls; j++)
            if (!calls[i][j].name || !calls[i][j].arguments) expect_invalid = 1;
        if (g->role && !strcmp(g->role, "tool")) last_tool = 1;
        else if (g->role && (!strcmp(g->role, "user") || !strcmp(g->role, "assistant"))) last_tool = 0;
    }
    int len = cm384_chat_render_format(m, format, msgs, n, flags, NULL, 0);
    if (expect_invalid || bad_format) {
        FUZZ_CHECK(len == CM384_E_INVALID, "an invalid conversation or format %d rendered (%d)", format, len);
    } else {
        FUZZ_CHECK(len >= 0, "a valid conversation failed");
        char *out = malloc((size_t)len + 1);
        if (!out) abort();
        FUZZ_CHECK(cm384_chat_render_format(m, format, msgs, n, flags, out, (size_t)len + 1) == len, "render length");
        FUZZ_CHECK(strlen(out) == (size_t)len, "render has a NUL inside");
        const char *bos = "<｜begin▁of▁sentence｜>";
        FUZZ_CHECK(!strncmp(out, bos, strlen(bos)), "render does not start with BOS");
        for (int i = 0; v3 && i < n; i++)
            if (msgs[i].content && (!strcmp(msgs[i].role, "user") || !strcmp(msgs[i].role, "system") ||
                                    !strcmp(msgs[i].role, "tool")))
                FUZZ_CHECK(strstr(out, msgs[i].content) != NULL, "message %d's content is missing", i);
        const char *asst = "<｜Assistant｜>";
        if (v3 && flags && !last_tool)
            FUZZ_CHECK(len >= (int)strlen(asst) && !strcmp(out + len - strlen(asst), asst), "no generation prompt");
        if (len > 1) {
            char *cut = malloc((size_t)len / 2 + 1);
            if (!cut) abort();
            FUZZ_CHECK(cm384_chat_render_format(m, format, msgs, n, flags, cut, (size_t)len / 2 + 1) == len, "small-cap length");
            FUZZ_CHECK(!memcmp(cut, out, (size_t)len / 2) && cut[len / 2] == 0, "small cap is not a prefix");
            free(cut);
        }
        int nt = cm384_tokenize(m, out, (size_t)len, NULL, 0, 0);
        FUZZ_CHECK(nt >= 0, "tokenize of the render failed");
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(nt + 1));
        if (!ids) abort();
        cm384_tokenize(m, out, (size_t)len, ids, nt, 0);
        FUZZ_CHECK(nt >= 1 && ids[0] == cm384_token_bos(m), "the render's first token is not BOS");
        int d = cm384_detokenize(m, ids, nt, NULL, 0);
        char *back = malloc((size_t)(d > 0 ? d : 0) + 1);
        if (!back) abort();
        FUZZ_CHECK(d >= 0 && cm384_detokenize(m, ids, nt, back, (size_t)d + 1) == d, "detokenize");
        if (all_utf8) FUZZ_CHECK(d == len && !memcmp(back, out, (size_t)len), "render did not survive tokenizing");
        free(back);
        free(ids);
        free(out);
    }
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    return 0;
}

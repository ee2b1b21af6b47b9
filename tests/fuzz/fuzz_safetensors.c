/* safetensors: one shard file, any bytes: the 8-byte header length, the
 * JSON header, the data.  The header is read as the loader reads a shard,
 * then every 2-D weight in it is bound at its own shape (as bind_mat binds a
 * weight, F8 block scales included) and its first and last rows are read.
 * Must hold: a bad header fails with FORMAT or UNSUPPORTED and names the
 * file; an accepted one only describes bytes inside the file's data
 * section, each tensor exactly numel x element size bytes, names unique;
 * reading any bound row stays inside the input (ASan checks the reads: the
 * input buffer is exactly its size). */

static int fuzz_safetensors(const uint8_t *data, size_t size) {
    file_map f = {data, size, 0, NULL};
    cm384_model m;
    memset(&m, 0, sizeof m);
    char *names[1] = {"fuzz.safetensors"};
    m.path = "fuzz";
    m.file_names = names;
    int r = st_read_header(&f, "fuzz.safetensors", 0, &m.a, &m.tensors);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(!strncmp(cm384_last_error(), "fuzz.safetensors", 16), "the message does not name the file");
    } else {
        uint64_t hlen = 0;
        for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | data[i];
        const uint8_t *base = data + 8 + hlen, *end = data + size;
        int n = 0;
        for (int i = 0; i < m.tensors.cap; i++) {
            const tensor_info *t = &m.tensors.items[i];
            if (!t->name) continue;
            n++;
            FUZZ_CHECK(t->data >= base && t->data <= end && t->nbytes <= (size_t)(end - t->data),
                       "tensor \"%s\" lies outside the data section", t->name);
            FUZZ_CHECK(t->ndim >= 0 && t->ndim <= 4, "tensor \"%s\" has %d dimensions", t->name, t->ndim);
            int esize = 0;
            st_dtype(t->dtype_name, &esize);
            uint64_t numel = 1;
            for (int k = 0; k < t->ndim; k++) numel *= (uint64_t)t->shape[k];
            FUZZ_CHECK(numel * (uint64_t)esize == t->nbytes, "tensor \"%s\": %zu bytes for %llu elements",
                       t->name, t->nbytes, (unsigned long long)numel);
            FUZZ_CHECK(tensor_find(&m.tensors, t->name) == t, "tensor \"%s\" is not found by its name", t->name);
        }
        FUZZ_CHECK(n == m.tensors.n, "%d tensors in the table, %d counted", m.tensors.n, n);
        /* bind every plausible weight at its own shape and read its edge rows */
        for (int i = 0; i < m.tensors.cap; i++) {
            const tensor_info *t = &m.tensors.items[i];
            if (!t->name || t->ndim != 2 || t->dtype < 0) continue;
            if (t->shape[0] < 1 || t->shape[1] < 1 || t->shape[0] > INT_MAX || t->shape[1] > (1 << 20)) continue;
            gl_mat g;
            int rows = (int)t->shape[0], cols = (int)t->shape[1];
            r = bind_mat(&m, t->name, rows, cols, &g, 1);
            if (r) {
                FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
                continue;
            }
            float *row = malloc((size_t)cols * sizeof(float));
            if (!row) abort();
            gl_row_to_f32(&g, 0, row);
            gl_row_to_f32(&g, rows - 1, row);
            free(row);
        }
    }
    free(m.tensors.items);
    arena_free(&m.a);
    return 0;
}

/* shard_index: model.safetensors.index.json, any bytes, in a directory with
 * tiny-dsv3's config.json and two shards; the whole directory is loaded.
 * Must hold: the load fails with a status and a message (FORMAT, IO for a
 * shard that is not there, UNSUPPORTED) or gives exactly tiny-dsv3: an
 * index can name where tensors are, never change what they are. */

static uint64_t fuzz_index_params;

static void fuzz_shard_index_init(void) {
    fuzz_link("tiny-dsv3/config.json", "config.json");
    fuzz_link("tiny-dsv3/model-00001-of-00002.safetensors", "model-00001-of-00002.safetensors");
    fuzz_link("tiny-dsv3/model-00002-of-00002.safetensors", "model-00002-of-00002.safetensors");
    cm384_model *m;
    if (cm384_model_load(fuzz_fixture("tiny-dsv3"), NULL, &m)) { fprintf(stderr, "%s\n", cm384_last_error()); exit(2); }
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    cm384_model_get_info(m, &in);
    fuzz_index_params = in.n_params;
    cm384_model_free(m);
}

static int fuzz_shard_index(const uint8_t *data, size_t size) {
    fuzz_write(fuzz_path("model.safetensors.index.json"), data, size);
    cm384_model *m = NULL;
    int r = cm384_model_load(fuzz_scratch(), NULL, &m);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_IO, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(m == NULL, "a failed load returned a model");
        return 0;
    }
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    FUZZ_CHECK(cm384_model_get_info(m, &in) == CM384_OK, "model_get_info");
    FUZZ_CHECK(in.n_params == fuzz_index_params, "the index changed the model: %llu parameters, expected %llu",
               (unsigned long long)in.n_params, (unsigned long long)fuzz_index_params);
    cm384_model_free(m);
    return 0;
}

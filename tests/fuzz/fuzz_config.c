/* config: config.json as the loader reads it.  The text is parsed and
 * checked (parse_config); when it passes, the whole checkpoint is loaded
 * with it, over tiny-dsv3's shards, so that every shape the config implies
 * is computed and compared with the tensors.
 * Must hold: a rejected config fails with FORMAT or UNSUPPORTED and a message
 * naming config.json; an accepted one has every size the model math divides
 * by or allocates from in range, and eps, rope_theta and the routing scale
 * positive numbers (what parse_config promises); a load either fails with a
 * status and a message or gives a model whose info matches the config and
 * whose RoPE frequencies and attention scale are positive numbers. */

static void fuzz_config_init(void) {
    fuzz_link("tiny-dsv3/model-00001-of-00002.safetensors", "model-00001-of-00002.safetensors");
    fuzz_link("tiny-dsv3/model-00002-of-00002.safetensors", "model-00002-of-00002.safetensors");
    fuzz_link("tiny-dsv3/model.safetensors.index.json", "model.safetensors.index.json");
}

static void fuzz_config_hparams(const hparams *hp) {
    FUZZ_CHECK(hp->vocab > 0 && hp->dim > 0 && hp->n_layers > 0 && hp->n_heads > 0, "sizes must be positive");
    FUZZ_CHECK(hp->kv_lora > 0 && hp->qk_rope > 0 && hp->v_head > 0 && hp->qk_rope % 2 == 0, "MLA sizes");
    FUZZ_CHECK(hp->qk_nope >= 0 && hp->q_lora >= 0 && hp->n_dense >= 0 && hp->n_shared >= 0, "negative size");
    FUZZ_CHECK(hp->moe_freq >= 1, "moe_layer_freq %d", hp->moe_freq);
    FUZZ_CHECK(hp->n_mtp == 0 || hp->n_mtp == 1, "n_mtp %d", hp->n_mtp);
    if (hp->n_routed > 0) {
        FUZZ_CHECK(hp->top_k >= 1 && hp->top_k <= hp->n_routed && hp->top_k <= 64, "top_k %d of %d", hp->top_k, hp->n_routed);
        FUZZ_CHECK(hp->n_routed <= 1024 && hp->moe_inter > 0, "experts");
        FUZZ_CHECK(hp->n_group >= 1 && hp->n_routed % hp->n_group == 0, "n_group %d", hp->n_group);
        FUZZ_CHECK(hp->topk_group >= 1 && hp->topk_group <= hp->n_group, "topk_group %d", hp->topk_group);
    }
    if (hp->n_dense > 0 || hp->n_routed == 0) FUZZ_CHECK(hp->inter > 0, "intermediate_size");
    FUZZ_CHECK(hp->bos >= -1 && hp->bos < hp->vocab && hp->eos >= -1 && hp->eos < hp->vocab, "bos %d eos %d", hp->bos, hp->eos);
    FUZZ_CHECK(hp->eps > 0 && isfinite(hp->eps) && hp->rope_theta > 1 && isfinite(hp->rope_theta) &&
               hp->route_scale > 0 && isfinite(hp->route_scale), "eps %g, rope_theta %g, routed_scaling_factor %g",
               hp->eps, hp->rope_theta, hp->route_scale);
    FUZZ_CHECK(hp->max_pos >= 0, "max_position_embeddings");
    if (hp->yarn) FUZZ_CHECK(hp->yarn_factor > 1, "yarn factor %g", hp->yarn_factor);
}

static int fuzz_config(const uint8_t *data, size_t size) {
    arena a = {0};
    json cfg;
    hparams hp;
    int r = json_parse((const char *)data, size, &a, &cfg, "config.json");
    if (!r) r = parse_config(&cfg, "config.json", &hp);
    arena_free(&a);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(!strncmp(cm384_last_error(), "config.json", 11), "the message does not name config.json");
        return 0;
    }
    fuzz_config_hparams(&hp);

    fuzz_write(fuzz_path("config.json"), data, size);
    cm384_model *m = NULL;
    r = cm384_model_load(fuzz_scratch(), NULL, &m);
    if (r) {
        FUZZ_CHECK_FAILED(r, CM384_E_FORMAT, CM384_E_UNSUPPORTED, CM384_E_NOMEM);
        FUZZ_CHECK(m == NULL, "a failed load returned a model");
        return 0;
    }
    cm384_model_info in;
    memset(&in, 0, sizeof in);
    in.struct_size = sizeof in;
    FUZZ_CHECK(cm384_model_get_info(m, &in) == CM384_OK, "model_get_info");
    FUZZ_CHECK(in.vocab_size == hp.vocab && in.hidden_size == hp.dim && in.n_layers == hp.n_layers &&
               in.n_heads == hp.n_heads && in.kv_lora_rank == hp.kv_lora, "info differs from the config");
    FUZZ_CHECK(in.n_active_params <= in.n_params && in.n_params > 0, "parameter counts %llu of %llu",
               (unsigned long long)in.n_active_params, (unsigned long long)in.n_params);
    /* what the math derives from the config: positive numbers */
    int ok = isfinite(m->attn_scale) && m->attn_scale > 0 && isfinite(m->rope_mscale) && m->rope_mscale > 0;
    for (int k = 0; k < m->hp.qk_rope / 2; k++) ok &= isfinite(m->rope_freq[k]) && m->rope_freq[k] > 0;
    FUZZ_CHECK(ok, "RoPE frequencies or scales are not positive numbers (attn_scale %g, mscale %g)",
               m->attn_scale, m->rope_mscale);
    cm384_model_free(m);
    return 0;
}

/* kv_block: the context cache's block files (cache_dir/<fingerprint>/<key>.kv)
 * through kvf_parse, the only reader of bytes another process wrote there.
 * Input: the first byte picks the case; the rest is the file (case 0), or the
 * payload of a well-formed file that is then cut or has one byte changed
 * (case 1: two more bytes say where).
 * Must hold: a file is accepted exactly when it is the expected block --
 * every header field equal to what the request expects, the size that
 * follows from the shapes, the checksum of the payload -- so a one-byte change
 * anywhere or any cut is refused; the parser reads nothing outside the input
 * (ASan) and every refusal says why. */

static int fuzz_kv_block(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    kvf_expect x = {0x0123456789abcdefull, 0x1111, 0x2222, 3, 4, 2, 3, (uint32_t)(data[0] >> 4 & 1) * 5,
                    data[0] & 0x20 ? 2u : 4u};
    size_t pay = kvf_payload_bytes(&x), n = sizeof(kvf_header) + pay, at = 0;
    if (!(data[0] & 1)) {                                   /* any bytes as a file */
        const char *why = kvf_parse(data + 1, size - 1, &x, &at);
        if (!why) {
            kvf_header h;
            FUZZ_CHECK(size - 1 == n, "accepted %zu bytes, a block file is %zu", size - 1, n);
            memcpy(&h, data + 1, sizeof h);
            FUZZ_CHECK(!memcmp(h.magic, KVF_MAGIC, 8) && h.key == x.key && h.parent == x.parent &&
                       h.fingerprint == x.fingerprint && h.tenant == x.tenant, "accepted a file for another block");
            FUZZ_CHECK(kvf_checksum(data + 1 + at, pay) == h.checksum, "accepted a wrong checksum");
        } else {
            FUZZ_CHECK(why[0] != 0, "refused without a reason");
        }
        return 0;
    }
    /* a well-formed file from the fuzz bytes, then cut or changed */
    uint8_t *buf = calloc(1, n);
    if (!buf) return 0;
    for (size_t i = 0; i < pay; i++) buf[sizeof(kvf_header) + i] = size > 4 ? data[4 + i % (size - 4)] : (uint8_t)i;
    kvf_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, KVF_MAGIC, 8);
    h.version = KVF_VERSION; h.block_tokens = x.block_tokens; h.n_layers = x.n_layers; h.row = x.row; h.h_dim = x.h_dim;
    h.tenant = x.tenant; h.fingerprint = x.fingerprint; h.key = x.key; h.parent = x.parent; h.payload_bytes = pay;
    h.checksum = kvf_checksum(buf + sizeof h, pay);
    memcpy(buf, &h, sizeof h);
    FUZZ_CHECK(kvf_parse(buf, n, &x, &at) == NULL && at == sizeof h, "a well-formed file was refused");
    size_t where = size > 3 ? ((size_t)data[1] << 8 | data[2]) % n : 0;
    if (size > 3 && (data[3] & 1)) {                        /* cut it */
        FUZZ_CHECK(kvf_parse(buf, where, &x, &at) != NULL, "a file cut to %zu of %zu bytes was accepted", where, n);
    } else if (size > 3) {                                  /* change one byte */
        uint8_t d = data[3] | 1;
        buf[where] ^= d;
        FUZZ_CHECK(kvf_parse(buf, n, &x, &at) != NULL, "byte %zu changed (xor %u) was accepted", where, d);
    }
    free(buf);
    return 0;
}

/* test_fuzzfix.c -- one regression test per defect the fuzz harnesses found
 * (tests/fuzz/README.md lists them; each reproducer is also kept in the
 * harness's corpus, so `make test` replays it through the harness too). */
#ifndef CM384_TEST_ALL
#include "../cm384.c"
#endif
#include "test.h"

/* A safetensors file whose header length is odd puts 16-bit data at odd
 * addresses; reading it through a uint16_t pointer is undefined (UBSan:
 * misaligned load in gl_row_to_f32).  Found by the safetensors harness.
 * Matrices and vectors must read the right values from any alignment. */
static void ff_misaligned_16bit(void) {
    printf("16-bit tensors at odd offsets:\n");
    static const float want[6] = {1, -2, 3.5f, 0, 0.25f, -7};
    for (int type = GL_F16; type <= GL_BF16; type++) {
        const char *dt = type == GL_F16 ? "F16" : "BF16";
        char hdr[256];
        int hl = snprintf(hdr, sizeof hdr,
                          "{\"w.weight\":{\"dtype\":\"%s\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
                          "\"v.weight\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[12,18]}}", dt, dt);
        if (hl % 2 == 0) hdr[hl++] = ' ';                  /* an odd header length */
        size_t size = 8 + (size_t)hl + 18;
        uint8_t *buf = malloc(size), *file = buf;           /* aligned, so the data starts at an odd address */
        if (!buf) { CHECK(0, "malloc"); return; }
        for (int i = 0; i < 8; i++) file[i] = (uint8_t)((uint64_t)hl >> (8 * i));
        memcpy(file + 8, hdr, (size_t)hl);
        for (int i = 0; i < 9; i++) {
            uint16_t h = type == GL_F16 ? gl_f32_to_f16(want[i % 6]) : gl_f32_to_bf16(want[i % 6]);
            memcpy(file + 8 + hl + 2 * i, &h, 2);
        }
        file_map f = {file, size, 0};
        cm384_model m;
        memset(&m, 0, sizeof m);
        char *names[1] = {"odd.safetensors"};
        m.path = "odd";
        m.file_names = names;
        int r = st_read_header(&f, "odd.safetensors", 0, &m.a, &m.tensors);
        CHECK(r == CM384_OK, "%s header: %s", dt, cm384_last_error());
        CHECK((uintptr_t)(file + 8 + hl) % 2 == 1, "the data is not misaligned: the test tests nothing");
        gl_mat g;
        float row[3], *vec = NULL;
        r = bind_mat(&m, "w.weight", 2, 3, &g, 1);
        CHECK(r == CM384_OK && (uintptr_t)g.data % 2 == 0, "%s matrix bound at %p", dt, g.data);
        if (!r) {
            gl_row_to_f32(&g, 1, row);
            CHECK(row[0] == want[3] && row[1] == want[4] && row[2] == want[5], "%s row 1: %g %g %g", dt, row[0], row[1], row[2]);
        }
        r = bind_vec(&m, "v.weight", 3, &vec, 1);
        CHECK(r == CM384_OK && vec && vec[0] == want[0] && vec[1] == want[1] && vec[2] == want[2], "%s vector", dt);
        free(m.tensors.items);
        arena_free(&m.a);
        free(buf);
    }
}

TEST_MAIN(fuzzfix) {
    ff_misaligned_16bit();
    return test_summary("fuzzfix");
}

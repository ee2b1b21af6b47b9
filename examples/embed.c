/* embed.c -- the smallest program that embeds cm384.
 *
 *   cc -O2 examples/embed.c cm384.c -lpthread -lm -o embed
 *   ./embed models/shakespeare "ROMEO:"
 */
#include <stdio.h>
#include "../cm384.h"

static int print_token(void *user, const cm384_event *ev) {
    (void)user;
    fwrite(ev->text, 1, ev->text_len, stdout);      /* text never splits a UTF-8 character */
    fflush(stdout);
    return 0;                                        /* non-zero would cancel */
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "models/shakespeare";
    const char *prompt = argc > 2 ? argv[2] : "ROMEO:";
    cm384_model *model;
    cm384_engine *engine;
    if (cm384_model_load(dir, NULL, &model) != CM384_OK) {
        fprintf(stderr, "%s\n", cm384_last_error());
        return 1;
    }
    if (cm384_engine_create(model, NULL, &engine) != CM384_OK) {
        fprintf(stderr, "%s\n", cm384_last_error());
        cm384_model_free(model);
        return 1;
    }
    cm384_sampling s;
    cm384_sampling_init(&s);           /* greedy */
    s.max_tokens = 32;
    printf("%s", prompt);
    int status = cm384_generate(engine, prompt, NULL, 0, &s, print_token, NULL);
    printf("\n");
    cm384_engine_free(engine);
    cm384_model_free(model);
    return status == CM384_OK ? 0 : 1;
}

/*
 * gen_synth.c -- write a synthetic DeepSeek-V2/V3 checkpoint (Hugging Face
 * safetensors layout) of any size, with deterministic random weights.
 *
 * Standalone: C11 + POSIX (mkdir, opendir, statvfs), libc and libm only.
 * It does not use cm384.c.  See models/gen/README.md.
 *
 *   cc -O2 -Wall -Wextra -std=c11 models/gen/gen_synth.c -o gen_synth -lm
 *   ./gen_synth --preset bench-S /tmp/bench-S
 *   ./gen_synth --preset v2-lite --set num_hidden_layers=4 /tmp/v2lite4
 *   ./gen_synth --preset v3 --dry-run
 *
 * Determinism contract (README.md has the details): element i (row-major) of
 * tensor T is  mean_T + std_T * z(key_T, i)  with  key_T = H(seed, stream_T),
 * where stream_T is T's own name (or, for the MTP copies of the embedding and
 * head, the name of the tensor copied).  Nothing depends on write order,
 * shard size, other tensors or the machine.
 */
#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define GEN_SYNTH_VERSION "1.0"

/* ------------------------------------------------------------------------ */
/* small utilities                                                          */
/* ------------------------------------------------------------------------ */

static const char *g_prog = "gen_synth";

static void die(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: error: ", g_prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void warn(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: warning: ", g_prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory (%zu bytes)", n);
    return p;
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (!p) die("out of memory (%zu bytes)", n);
    return p;
}

static char *xstrdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = xmalloc(n);
    memcpy(p, s, n);
    return p;
}

static char *xsprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) die("formatting failed");
    char *s = xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

/* growable string */
typedef struct { char *s; size_t n, cap; } Str;

static void str_add(Str *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) die("formatting failed");
    if (b->n + (size_t)n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->n + (size_t)n + 1 > cap) cap *= 2;
        b->s = xrealloc(b->s, cap);
        b->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->n, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)n;
}

static double now_sec(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 1234567 -> "1.23M" (parameters, powers of 1000) */
static const char *fmt_count(double v, char *buf, size_t n)
{
    if (v >= 1e12) snprintf(buf, n, "%.2fT", v / 1e12);
    else if (v >= 1e9) snprintf(buf, n, "%.2fB", v / 1e9);
    else if (v >= 1e6) snprintf(buf, n, "%.1fM", v / 1e6);
    else if (v >= 1e3) snprintf(buf, n, "%.1fK", v / 1e3);
    else snprintf(buf, n, "%.0f", v);
    return buf;
}

/* bytes -> "4.51 GB (4.20 GiB)" */
static const char *fmt_bytes(double v, char *buf, size_t n)
{
    if (v >= 1e9) snprintf(buf, n, "%.2f GB (%.2f GiB)", v / 1e9, v / 1073741824.0);
    else if (v >= 1e6) snprintf(buf, n, "%.2f MB (%.2f MiB)", v / 1e6, v / 1048576.0);
    else if (v >= 1e3) snprintf(buf, n, "%.1f kB", v / 1e3);
    else snprintf(buf, n, "%.0f B", v);
    return buf;
}

/* "2G", "2GB", "500M", "1.5GiB", "4096" -> bytes (K/M/G/T = powers of 1000,
 * Ki/Mi/Gi/Ti = powers of 1024) */
static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !(v > 0)) return 0;
    double mul = 1;
    char suf[8] = {0};
    size_t k = 0;
    while (*end && k < sizeof suf - 1) suf[k++] = (char)toupper((unsigned char)*end++);
    if (*end) return 0;
    if (!strcmp(suf, "") || !strcmp(suf, "B")) mul = 1;
    else if (!strcmp(suf, "K") || !strcmp(suf, "KB")) mul = 1e3;
    else if (!strcmp(suf, "M") || !strcmp(suf, "MB")) mul = 1e6;
    else if (!strcmp(suf, "G") || !strcmp(suf, "GB")) mul = 1e9;
    else if (!strcmp(suf, "T") || !strcmp(suf, "TB")) mul = 1e12;
    else if (!strcmp(suf, "KI") || !strcmp(suf, "KIB")) mul = 1024.0;
    else if (!strcmp(suf, "MI") || !strcmp(suf, "MIB")) mul = 1048576.0;
    else if (!strcmp(suf, "GI") || !strcmp(suf, "GIB")) mul = 1073741824.0;
    else if (!strcmp(suf, "TI") || !strcmp(suf, "TIB")) mul = 1099511627776.0;
    else return 0;
    v *= mul;
    if (v < 1 || v > 1.8e19) return 0;
    *out = (uint64_t)v;
    return 1;
}

/* ------------------------------------------------------------------------ */
/* model configuration                                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
    char model_type[32];
    int64_t vocab_size, hidden_size, intermediate_size, moe_intermediate_size;
    int64_t num_hidden_layers, num_attention_heads, num_key_value_heads;
    int64_t q_lora_rank; /* 0 = null (V2 style q_proj) */
    int64_t kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int64_t n_routed_experts, n_shared_experts, num_experts_per_tok;
    int64_t n_group, topk_group, first_k_dense_replace, moe_layer_freq;
    int64_t max_position_embeddings, num_nextn_predict_layers;
    int64_t bos_token_id, eos_token_id, ep_size, pretraining_tp;
    char topk_method[32], scoring_func[32], hidden_act[32], torch_dtype[32];
    char transformers_version[32];
    int64_t norm_topk_prob, tie_word_embeddings, seq_aux, use_cache, attention_bias; /* bools */
    double routed_scaling_factor, rope_theta, rms_norm_eps, aux_loss_alpha;
    double initializer_range, attention_dropout;
    int64_t rope_on; /* rope_scaling present (else null) */
    char rope_type[32];
    double rs_factor, rs_beta_fast, rs_beta_slow, rs_mscale, rs_mscale_all_dim;
    int64_t rs_orig_max;
} Config;

enum { T_INT, T_INTNULL, T_BOOL, T_DBL, T_STR };

typedef struct {
    const char *key;
    int type;
    size_t off;
    int64_t min;         /* T_INT: smallest allowed value */
    const char *choices; /* T_STR: "|a|b|" or NULL for free text */
} Field;

#define F_(k, t, m, mn, ch) { k, t, offsetof(Config, m), mn, ch }
static const Field g_fields[] = {
    F_("model_type", T_STR, model_type, 0, "|deepseek_v2|deepseek_v3|"),
    F_("vocab_size", T_INT, vocab_size, 1, NULL),
    F_("hidden_size", T_INT, hidden_size, 1, NULL),
    F_("intermediate_size", T_INT, intermediate_size, 0, NULL),
    F_("moe_intermediate_size", T_INT, moe_intermediate_size, 0, NULL),
    F_("num_hidden_layers", T_INT, num_hidden_layers, 1, NULL),
    F_("num_attention_heads", T_INT, num_attention_heads, 1, NULL),
    F_("num_key_value_heads", T_INT, num_key_value_heads, 1, NULL),
    F_("q_lora_rank", T_INTNULL, q_lora_rank, 0, NULL),
    F_("kv_lora_rank", T_INT, kv_lora_rank, 1, NULL),
    F_("qk_nope_head_dim", T_INT, qk_nope_head_dim, 1, NULL),
    F_("qk_rope_head_dim", T_INT, qk_rope_head_dim, 2, NULL),
    F_("v_head_dim", T_INT, v_head_dim, 1, NULL),
    F_("n_routed_experts", T_INT, n_routed_experts, 0, NULL),
    F_("n_shared_experts", T_INT, n_shared_experts, 0, NULL),
    F_("num_experts_per_tok", T_INT, num_experts_per_tok, 0, NULL),
    F_("n_group", T_INT, n_group, 1, NULL),
    F_("topk_group", T_INT, topk_group, 1, NULL),
    F_("topk_method", T_STR, topk_method, 0, "|greedy|group_limited_greedy|noaux_tc|"),
    F_("scoring_func", T_STR, scoring_func, 0, "|softmax|sigmoid|"),
    F_("norm_topk_prob", T_BOOL, norm_topk_prob, 0, NULL),
    F_("routed_scaling_factor", T_DBL, routed_scaling_factor, 0, NULL),
    F_("first_k_dense_replace", T_INT, first_k_dense_replace, 0, NULL),
    F_("moe_layer_freq", T_INT, moe_layer_freq, 1, NULL),
    F_("rope_theta", T_DBL, rope_theta, 0, NULL),
    F_("max_position_embeddings", T_INT, max_position_embeddings, 1, NULL),
    F_("rms_norm_eps", T_DBL, rms_norm_eps, 0, NULL),
    F_("tie_word_embeddings", T_BOOL, tie_word_embeddings, 0, NULL),
    F_("num_nextn_predict_layers", T_INT, num_nextn_predict_layers, 0, NULL),
    F_("bos_token_id", T_INT, bos_token_id, 0, NULL),
    F_("eos_token_id", T_INT, eos_token_id, 0, NULL),
    F_("hidden_act", T_STR, hidden_act, 0, NULL),
    F_("torch_dtype", T_STR, torch_dtype, 0, "|bfloat16|float16|float32|"),
    F_("ep_size", T_INT, ep_size, 1, NULL),
    F_("pretraining_tp", T_INT, pretraining_tp, 1, NULL),
    F_("transformers_version", T_STR, transformers_version, 0, NULL),
    F_("seq_aux", T_BOOL, seq_aux, 0, NULL),
    F_("use_cache", T_BOOL, use_cache, 0, NULL),
    F_("attention_bias", T_BOOL, attention_bias, 0, NULL),
    F_("aux_loss_alpha", T_DBL, aux_loss_alpha, 0, NULL),
    F_("initializer_range", T_DBL, initializer_range, 0, NULL),
    F_("attention_dropout", T_DBL, attention_dropout, 0, NULL),
    F_("rope_scaling.type", T_STR, rope_type, 0, "|yarn|"),
    F_("rope_scaling.rope_type", T_STR, rope_type, 0, "|yarn|"),
    F_("rope_scaling.factor", T_DBL, rs_factor, 0, NULL),
    F_("rope_scaling.original_max_position_embeddings", T_INT, rs_orig_max, 1, NULL),
    F_("rope_scaling.beta_fast", T_DBL, rs_beta_fast, 0, NULL),
    F_("rope_scaling.beta_slow", T_DBL, rs_beta_slow, 0, NULL),
    F_("rope_scaling.mscale", T_DBL, rs_mscale, 0, NULL),
    F_("rope_scaling.mscale_all_dim", T_DBL, rs_mscale_all_dim, 0, NULL),
};
#undef F_
#define N_FIELDS (sizeof g_fields / sizeof g_fields[0])

static void cfg_defaults(Config *c)
{
    /* HF-style defaults for keys a --config file may leave out */
    memset(c, 0, sizeof *c);
    strcpy(c->model_type, "deepseek_v3");
    c->q_lora_rank = 0;
    c->n_group = 1;
    c->topk_group = 1;
    c->moe_layer_freq = 1;
    strcpy(c->topk_method, "greedy");
    strcpy(c->scoring_func, "softmax");
    strcpy(c->hidden_act, "silu");
    strcpy(c->torch_dtype, "bfloat16");
    strcpy(c->transformers_version, "4.33.1");
    c->routed_scaling_factor = 1.0;
    c->rope_theta = 10000;
    c->rms_norm_eps = 1e-6;
    c->aux_loss_alpha = 0.001;
    c->initializer_range = 0.02;
    c->ep_size = 1;
    c->pretraining_tp = 1;
    c->seq_aux = 1;
    c->use_cache = 1;
    c->bos_token_id = 0;
    c->eos_token_id = 1;
    c->max_position_embeddings = 4096;
    strcpy(c->rope_type, "yarn");
    c->rs_factor = 1;
    c->rs_beta_fast = 32;
    c->rs_beta_slow = 1;
    c->rs_mscale = 1;
    c->rs_mscale_all_dim = 1;
    c->rs_orig_max = 4096;
}

/* DeepSeek-V3 / R1 as released (config.json of deepseek-ai/DeepSeek-V3) */
static void preset_v3(Config *c)
{
    cfg_defaults(c);
    strcpy(c->model_type, "deepseek_v3");
    c->vocab_size = 129280;
    c->hidden_size = 7168;
    c->intermediate_size = 18432;
    c->moe_intermediate_size = 2048;
    c->num_hidden_layers = 61;
    c->num_attention_heads = 128;
    c->num_key_value_heads = 128;
    c->q_lora_rank = 1536;
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
    c->n_routed_experts = 256;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 8;
    c->n_group = 8;
    c->topk_group = 4;
    strcpy(c->topk_method, "noaux_tc");
    strcpy(c->scoring_func, "sigmoid");
    c->norm_topk_prob = 1;
    c->routed_scaling_factor = 2.5;
    c->first_k_dense_replace = 3;
    c->moe_layer_freq = 1;
    c->rope_theta = 10000;
    c->max_position_embeddings = 163840;
    c->rms_norm_eps = 1e-6;
    c->tie_word_embeddings = 0;
    c->num_nextn_predict_layers = 1;
    c->bos_token_id = 0;
    c->eos_token_id = 1;
    c->rope_on = 1;
    strcpy(c->rope_type, "yarn");
    c->rs_factor = 40;
    c->rs_orig_max = 4096;
    c->rs_beta_fast = 32;
    c->rs_beta_slow = 1;
    c->rs_mscale = 1.0;
    c->rs_mscale_all_dim = 1.0;
}

/* same config as shared/fixtures/tiny-dsv3 */
static void preset_tiny(Config *c)
{
    preset_v3(c);
    c->vocab_size = 1024;
    c->hidden_size = 64;
    c->intermediate_size = 128;
    c->moe_intermediate_size = 32;
    c->num_hidden_layers = 3;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 4;
    c->q_lora_rank = 32;
    c->kv_lora_rank = 32;
    c->qk_nope_head_dim = 16;
    c->qk_rope_head_dim = 8;
    c->v_head_dim = 16;
    c->n_routed_experts = 16;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 4;
    c->n_group = 4;
    c->topk_group = 2;
    c->first_k_dense_replace = 1;
    c->max_position_embeddings = 256;
    c->rs_factor = 4;
    c->rs_orig_max = 64;
}

static void preset_bench_s(Config *c)
{
    preset_v3(c);
    c->vocab_size = 4096;
    c->hidden_size = 512;
    c->intermediate_size = 1408;
    c->moe_intermediate_size = 256;
    c->num_hidden_layers = 4;
    c->num_attention_heads = 8;
    c->num_key_value_heads = 8;
    c->q_lora_rank = 256;
    c->kv_lora_rank = 256;
    c->qk_nope_head_dim = 64;
    c->qk_rope_head_dim = 32;
    c->v_head_dim = 64;
    c->n_routed_experts = 16;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 4;
    c->n_group = 4;
    c->topk_group = 2;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
    c->max_position_embeddings = 16384;
    c->rs_factor = 4;
    c->rs_orig_max = 4096;
}

static void preset_bench_m(Config *c)
{
    preset_v3(c);
    c->vocab_size = 32768;
    c->hidden_size = 1024;
    c->intermediate_size = 2816;
    c->moe_intermediate_size = 512;
    c->num_hidden_layers = 8;
    c->num_attention_heads = 16;
    c->num_key_value_heads = 16;
    c->q_lora_rank = 512;
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
    c->n_routed_experts = 32;
    c->n_shared_experts = 2;
    c->num_experts_per_tok = 6;
    c->n_group = 4;
    c->topk_group = 2;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
    c->max_position_embeddings = 16384;
    c->rs_factor = 4;
    c->rs_orig_max = 4096;
}

/* DeepSeek-V2-Lite as released (config.json of deepseek-ai/DeepSeek-V2-Lite) */
static void preset_v2_lite(Config *c)
{
    cfg_defaults(c);
    strcpy(c->model_type, "deepseek_v2");
    c->vocab_size = 102400;
    c->hidden_size = 2048;
    c->intermediate_size = 10944;
    c->moe_intermediate_size = 1408;
    c->num_hidden_layers = 27;
    c->num_attention_heads = 16;
    c->num_key_value_heads = 16;
    c->q_lora_rank = 0; /* null */
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
    c->n_routed_experts = 64;
    c->n_shared_experts = 2;
    c->num_experts_per_tok = 6;
    c->n_group = 1;
    c->topk_group = 1;
    strcpy(c->topk_method, "greedy");
    strcpy(c->scoring_func, "softmax");
    c->norm_topk_prob = 0;
    c->routed_scaling_factor = 1.0;
    c->first_k_dense_replace = 1;
    c->moe_layer_freq = 1;
    c->rope_theta = 10000;
    c->max_position_embeddings = 163840;
    c->rms_norm_eps = 1e-6;
    c->num_nextn_predict_layers = 0;
    c->bos_token_id = 100000;
    c->eos_token_id = 100001;
    c->rope_on = 1;
    strcpy(c->rope_type, "yarn");
    c->rs_factor = 40;
    c->rs_orig_max = 4096;
    c->rs_beta_fast = 32;
    c->rs_beta_slow = 1;
    c->rs_mscale = 0.707;
    c->rs_mscale_all_dim = 0.707;
}

typedef struct {
    const char *name;
    void (*fn)(Config *);
    int fp8_default; /* ships as fp8 */
    int dry_only;    /* too big to write without --allow-huge */
    const char *desc;
} Preset;

static const Preset g_presets[] = {
    { "tiny", preset_tiny, 0, 0, "the tiny-dsv3 fixture's shapes: vocab 1024, hidden 64, 3 layers, 16 experts top-4, MTP 1" },
    { "bench-S", preset_bench_s, 0, 0, "small V3: vocab 4096, hidden 512, 4 layers, 16 experts x 256 top-4, MTP 1" },
    { "bench-M", preset_bench_m, 0, 0, "medium V3: vocab 32768, hidden 1024, 8 layers, 32 experts x 512 top-6, 2 shared, MTP 1" },
    { "v2-lite", preset_v2_lite, 0, 0, "DeepSeek-V2-Lite's real shapes (27 layers, 15.7B); cut with --set num_hidden_layers=N" },
    { "v3", preset_v3, 1, 1, "DeepSeek-V3/R1's real shapes (fp8 as shipped); for --dry-run" },
};
#define N_PRESETS (sizeof g_presets / sizeof g_presets[0])

static int ieq(const char *a, const char *b)
{
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b)) return 0;
    return *a == *b;
}

static const Preset *find_preset(const char *name)
{
    for (size_t i = 0; i < N_PRESETS; i++)
        if (ieq(g_presets[i].name, name)) return &g_presets[i];
    return NULL;
}

static const Field *find_field(const char *key)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if (!strcmp(g_fields[i].key, key)) return &g_fields[i];
    return NULL;
}


/* Set one field from text.  Returns 0 on success, -1 unknown key, -2 bad value
 * (with *why set). */
static int cfg_set(Config *c, const char *key, const char *val, const char **why)
{
    static char whybuf[256];
    *why = "";
    if (!strcmp(key, "rope_scaling")) {
        if (ieq(val, "null") || ieq(val, "none") || ieq(val, "off")) { c->rope_on = 0; return 0; }
        if (ieq(val, "yarn")) { c->rope_on = 1; strcpy(c->rope_type, "yarn"); return 0; }
        *why = "expected null or yarn";
        return -2;
    }
    const Field *f = find_field(key);
    if (!f) return -1;
    char *p = (char *)c + f->off;
    char *end;
    switch (f->type) {
    case T_INTNULL:
        if (ieq(val, "null") || ieq(val, "none")) { *(int64_t *)p = 0; return 0; }
        /* fall through */
    case T_INT: {
        errno = 0;
        long long v = strtoll(val, &end, 10);
        if (end == val || *end || errno) {
            /* accept integral floats such as 4.0 */
            double d = strtod(val, &end);
            if (end == val || *end || d != floor(d) || fabs(d) > 9e15) {
                *why = "expected an integer";
                return -2;
            }
            v = (long long)d;
        }
        if (v < f->min) {
            snprintf(whybuf, sizeof whybuf, "must be >= %lld", (long long)f->min);
            *why = whybuf;
            return -2;
        }
        if (v > (1LL << 40)) { *why = "too large"; return -2; }
        *(int64_t *)p = v;
        break;
    }
    case T_BOOL:
        if (ieq(val, "true") || !strcmp(val, "1")) *(int64_t *)p = 1;
        else if (ieq(val, "false") || !strcmp(val, "0")) *(int64_t *)p = 0;
        else { *why = "expected true or false"; return -2; }
        break;
    case T_DBL: {
        errno = 0;
        double d = strtod(val, &end);
        if (end == val || *end || errno || !isfinite(d)) { *why = "expected a number"; return -2; }
        if (d < 0) { *why = "must be >= 0"; return -2; }
        *(double *)p = d;
        break;
    }
    case T_STR: {
        char tmp[64];
        size_t n = strlen(val);
        if (n >= 2 && val[0] == '"' && val[n - 1] == '"') { val++; n -= 2; }
        if (n == 0 || n >= sizeof tmp || n >= 32) { *why = "expected a non-empty string of < 32 characters"; return -2; }
        memcpy(tmp, val, n);
        tmp[n] = 0;
        if (f->choices) {
            char pat[80];
            snprintf(pat, sizeof pat, "|%s|", tmp);
            if (!strstr(f->choices, pat)) {
                snprintf(whybuf, sizeof whybuf, "expected one of %s", f->choices);
                *why = whybuf;
                return -2;
            }
        }
        strcpy(p, tmp);
        break;
    }
    }
    if (!strncmp(key, "rope_scaling.", 13)) c->rope_on = 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* minimal JSON reading for --config (flat config.json with rope_scaling and  */
/* quantization_config objects)                                             */
/* ------------------------------------------------------------------------ */

typedef struct {
    const char *p, *end, *file, *base;
} JP;

static void jp_fail(JP *j, const char *what)
{
    die("%s: bad JSON near byte %ld: %s", j->file, (long)(j->p - j->base), what);
}

static void jp_ws(JP *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t')) j->p++;
}

static int jp_peek(JP *j)
{
    jp_ws(j);
    return j->p < j->end ? (unsigned char)*j->p : -1;
}

static void jp_expect(JP *j, char ch)
{
    if (jp_peek(j) != (unsigned char)ch) {
        char m[32];
        snprintf(m, sizeof m, "expected '%c'", ch);
        jp_fail(j, m);
    }
    j->p++;
}

/* string into out (ASCII escapes decoded; \u escapes kept only if < 0x80) */
static void jp_string(JP *j, char *out, size_t cap)
{
    size_t n = 0;
    jp_expect(j, '"');
    while (j->p < j->end && *j->p != '"') {
        char ch = *j->p++;
        if (ch == '\\') {
            if (j->p >= j->end) break;
            char e = *j->p++;
            switch (e) {
            case 'n': ch = '\n'; break;
            case 't': ch = '\t'; break;
            case 'r': ch = '\r'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int k = 0; k < 4; k++) {
                    if (j->p >= j->end || !isxdigit((unsigned char)*j->p)) jp_fail(j, "bad \\u escape");
                    char h = *j->p++;
                    v = v * 16 + (unsigned)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
                }
                ch = v < 0x80 ? (char)v : '?';
                break;
            }
            default: ch = e; break;
            }
        }
        if (n + 1 < cap) out[n++] = ch;
    }
    if (j->p >= j->end) jp_fail(j, "unterminated string");
    j->p++;
    out[n] = 0;
}

/* scalar (number, true, false, null) as text */
static void jp_scalar(JP *j, char *out, size_t cap)
{
    jp_ws(j);
    size_t n = 0;
    while (j->p < j->end && (isalnum((unsigned char)*j->p) || *j->p == '-' || *j->p == '+' || *j->p == '.')) {
        if (n + 1 < cap) out[n++] = *j->p;
        j->p++;
    }
    if (n == 0) jp_fail(j, "expected a value");
    out[n] = 0;
}

static void jp_skip(JP *j)
{
    int c = jp_peek(j);
    char tmp[256];
    if (c == '"') { jp_string(j, tmp, sizeof tmp); return; }
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->p++;
        if (jp_peek(j) == close) { j->p++; return; }
        for (;;) {
            if (c == '{') { jp_string(j, tmp, sizeof tmp); jp_expect(j, ':'); }
            jp_skip(j);
            int d = jp_peek(j);
            if (d == ',') { j->p++; continue; }
            if (d == close) { j->p++; return; }
            jp_fail(j, "expected ',' or closing bracket");
        }
    }
    jp_scalar(j, tmp, sizeof tmp);
}

static void cfg_apply_json(Config *c, JP *j, const char *key, const char *val)
{
    const char *why;
    int r = cfg_set(c, key, val, &why);
    if (r == -1) warn("%s: ignoring unknown key \"%s\"", j->file, key);
    else if (r == -2) die("%s: bad value for \"%s\": %s (%s)", j->file, key, val, why);
}

/* returns 1 when the file has an fp8 quantization_config */
static int cfg_load_file(Config *c, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open config %s: %s", path, strerror(errno));
    Str b = {0};
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        if (b.n + n + 1 > b.cap) { b.cap = (b.n + n + 1) * 2; b.s = xrealloc(b.s, b.cap); }
        memcpy(b.s + b.n, buf, n);
        b.n += n;
    }
    fclose(f);
    if (!b.s) die("%s is empty", path);
    JP j = { b.s, b.s + b.n, path, b.s };
    int fp8 = 0;
    char key[256], val[256];
    cfg_defaults(c);
    jp_expect(&j, '{');
    if (jp_peek(&j) == '}') die("%s: empty object", path);
    for (;;) {
        jp_string(&j, key, sizeof key);
        jp_expect(&j, ':');
        int t = jp_peek(&j);
        if (!strcmp(key, "rope_scaling") && t == '{') {
            c->rope_on = 1;
            j.p++;
            if (jp_peek(&j) != '}') {
                for (;;) {
                    char sub[300];
                    jp_string(&j, key, sizeof key);
                    jp_expect(&j, ':');
                    snprintf(sub, sizeof sub, "rope_scaling.%s", key);
                    if (jp_peek(&j) == '"') jp_string(&j, val, sizeof val);
                    else jp_scalar(&j, val, sizeof val);
                    cfg_apply_json(c, &j, sub, val);
                    int d = jp_peek(&j);
                    if (d == ',') { j.p++; continue; }
                    break;
                }
            }
            jp_expect(&j, '}');
        } else if (!strcmp(key, "quantization_config") && t == '{') {
            const char *start = j.p;
            jp_skip(&j);
            size_t len = (size_t)(j.p - start);
            char *q = xmalloc(len + 1);
            memcpy(q, start, len);
            q[len] = 0;
            if (strstr(q, "fp8")) fp8 = 1;
            else warn("%s: quantization_config is not fp8; writing bf16", path);
            if (fp8 && (!strstr(q, "128") || strstr(q, "\"weight_block_size\"") == NULL))
                warn("%s: fp8 weight_block_size is not [128,128]; the generator always uses 128x128", path);
            free(q);
        } else if (t == '{' || t == '[') {
            jp_skip(&j); /* architectures, auto_map, ... */
        } else if (t == '"') {
            jp_string(&j, val, sizeof val);
            cfg_apply_json(c, &j, key, val);
        } else {
            jp_scalar(&j, val, sizeof val);
            if (!strcmp(key, "rope_scaling")) {
                if (strcmp(val, "null")) die("%s: rope_scaling must be an object or null", path);
                c->rope_on = 0;
            } else if (!strcmp(key, "quantization_config")) {
                if (strcmp(val, "null")) die("%s: quantization_config must be an object or null", path);
            } else {
                cfg_apply_json(c, &j, key, val);
            }
        }
        int d = jp_peek(&j);
        if (d == ',') { j.p++; continue; }
        if (d == '}') break;
        jp_fail(&j, "expected ',' or '}'");
    }
    free(b.s);
    return fp8;
}

static int is_moe_layer(const Config *c, int64_t L)
{
    return c->n_routed_experts > 0 && L >= c->first_k_dense_replace && L % c->moe_layer_freq == 0;
}

static int has_bias(const Config *c) { return !strcmp(c->topk_method, "noaux_tc"); }

static void cfg_validate(const Config *c)
{
    int64_t L = c->num_hidden_layers;
    int any_dense = 0;
    for (int64_t i = 0; i < L + c->num_nextn_predict_layers; i++)
        if (!is_moe_layer(c, i)) any_dense = 1;
    if (any_dense && c->intermediate_size <= 0)
        die("intermediate_size must be > 0 (there are dense layers: first_k_dense_replace=%lld)",
            (long long)c->first_k_dense_replace);
    if (c->qk_rope_head_dim % 2)
        die("qk_rope_head_dim must be even (RoPE rotates pairs), got %lld", (long long)c->qk_rope_head_dim);
    if (c->first_k_dense_replace > L)
        die("first_k_dense_replace (%lld) > num_hidden_layers (%lld)", (long long)c->first_k_dense_replace, (long long)L);
    if (c->n_routed_experts > 0) {
        int64_t E = c->n_routed_experts;
        if (c->moe_intermediate_size <= 0) die("moe_intermediate_size must be > 0 when n_routed_experts > 0");
        if (c->num_experts_per_tok < 1 || c->num_experts_per_tok > E)
            die("num_experts_per_tok must be in 1..n_routed_experts (%lld), got %lld", (long long)E,
                (long long)c->num_experts_per_tok);
        if (E % c->n_group)
            die("n_routed_experts (%lld) must be divisible by n_group (%lld)", (long long)E, (long long)c->n_group);
        if (c->topk_group > c->n_group)
            die("topk_group (%lld) > n_group (%lld)", (long long)c->topk_group, (long long)c->n_group);
        if (strcmp(c->topk_method, "greedy") &&
            c->num_experts_per_tok > c->topk_group * (E / c->n_group))
            die("num_experts_per_tok (%lld) > topk_group * experts per group (%lld)",
                (long long)c->num_experts_per_tok, (long long)(c->topk_group * (E / c->n_group)));
        if (!strcmp(c->topk_method, "noaux_tc") && E / c->n_group < 2)
            die("topk_method noaux_tc scores a group by its top-2 experts: need >= 2 experts per group");
    }
    if (c->bos_token_id >= c->vocab_size || c->eos_token_id >= c->vocab_size)
        die("bos_token_id (%lld) / eos_token_id (%lld) must be < vocab_size (%lld)", (long long)c->bos_token_id,
            (long long)c->eos_token_id, (long long)c->vocab_size);
    if (c->rope_on && (c->rs_factor <= 0))
        die("rope_scaling.factor must be > 0");
    if (c->rope_theta <= 0) die("rope_theta must be > 0");
    if (c->rms_norm_eps <= 0) die("rms_norm_eps must be > 0");
    if (c->num_nextn_predict_layers > 8) die("num_nextn_predict_layers > 8 is not sensible");
    /* things that load but are not what DeepSeek ships */
    if (!strcmp(c->model_type, "deepseek_v3") && strcmp(c->topk_method, "noaux_tc"))
        warn("deepseek_v3 with topk_method %s (DeepSeek-V3 ships noaux_tc)", c->topk_method);
    if (!strcmp(c->model_type, "deepseek_v2") && !strcmp(c->topk_method, "noaux_tc"))
        warn("deepseek_v2 with topk_method noaux_tc (V2 has no e_score_correction_bias)");
    if (!strcmp(c->topk_method, "noaux_tc") && strcmp(c->scoring_func, "sigmoid"))
        warn("noaux_tc with scoring_func %s (DeepSeek-V3 uses sigmoid)", c->scoring_func);
    if (c->num_key_value_heads != c->num_attention_heads)
        warn("num_key_value_heads (%lld) != num_attention_heads (%lld): MLA ignores it, DeepSeek sets them equal",
             (long long)c->num_key_value_heads, (long long)c->num_attention_heads);
    if (strcmp(c->hidden_act, "silu")) warn("hidden_act %s: DeepSeek uses silu", c->hidden_act);
}

/* ------------------------------------------------------------------------ */
/* config.json writing                                                      */
/* ------------------------------------------------------------------------ */

/* shortest text that reads back as v; force_float adds ".0" to integers */
static void num_text(double v, int force_float, char *out, size_t cap)
{
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(out, cap, force_float ? "%.1f" : "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, cap, "%.*g", prec, v);
        if (strtod(out, NULL) == v) return;
    }
}

typedef struct { const char *key; char *val; } KV;

static int kv_cmp(const void *a, const void *b) { return strcmp(((const KV *)a)->key, ((const KV *)b)->key); }

static char *config_json(const Config *c, int fp8)
{
    KV kv[64];
    int n = 0;
    char t[64];
#define KI(k, v) (kv[n].key = k, kv[n++].val = xsprintf("%lld", (long long)(v)))
#define KB(k, v) (kv[n].key = k, kv[n++].val = xstrdup((v) ? "true" : "false"))
#define KS(k, v) (kv[n].key = k, kv[n++].val = xsprintf("\"%s\"", v))
#define KF(k, v, ff) (num_text(v, ff, t, sizeof t), kv[n].key = k, kv[n++].val = xstrdup(t))
    int v3 = !strcmp(c->model_type, "deepseek_v3");
    kv[n].key = "architectures";
    kv[n++].val = xsprintf("[\n    \"%s\"\n  ]", v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM");
    KB("attention_bias", c->attention_bias);
    KF("attention_dropout", c->attention_dropout, 1);
    KF("aux_loss_alpha", c->aux_loss_alpha, 1);
    KI("bos_token_id", c->bos_token_id);
    KI("eos_token_id", c->eos_token_id);
    KI("ep_size", c->ep_size);
    KI("first_k_dense_replace", c->first_k_dense_replace);
    KS("hidden_act", c->hidden_act);
    KI("hidden_size", c->hidden_size);
    KF("initializer_range", c->initializer_range, 1);
    KI("intermediate_size", c->intermediate_size);
    KI("kv_lora_rank", c->kv_lora_rank);
    KI("max_position_embeddings", c->max_position_embeddings);
    KS("model_type", c->model_type);
    KI("moe_intermediate_size", c->moe_intermediate_size);
    KI("moe_layer_freq", c->moe_layer_freq);
    KI("n_group", c->n_group);
    KI("n_routed_experts", c->n_routed_experts);
    KI("n_shared_experts", c->n_shared_experts);
    KB("norm_topk_prob", c->norm_topk_prob);
    KI("num_attention_heads", c->num_attention_heads);
    KI("num_experts_per_tok", c->num_experts_per_tok);
    KI("num_hidden_layers", c->num_hidden_layers);
    KI("num_key_value_heads", c->num_key_value_heads);
    /* DeepSeek-V2 configs do not carry the key; write it only when it matters */
    if (v3 || c->num_nextn_predict_layers) KI("num_nextn_predict_layers", c->num_nextn_predict_layers);
    KI("pretraining_tp", c->pretraining_tp);
    if (c->q_lora_rank) KI("q_lora_rank", c->q_lora_rank);
    else { kv[n].key = "q_lora_rank"; kv[n++].val = xstrdup("null"); }
    KI("qk_nope_head_dim", c->qk_nope_head_dim);
    KI("qk_rope_head_dim", c->qk_rope_head_dim);
    if (fp8) {
        kv[n].key = "quantization_config";
        kv[n++].val = xstrdup("{\n    \"activation_scheme\": \"dynamic\",\n    \"fmt\": \"e4m3\",\n"
                              "    \"quant_method\": \"fp8\",\n    \"weight_block_size\": [\n      128,\n"
                              "      128\n    ]\n  }");
    }
    KF("rms_norm_eps", c->rms_norm_eps, 1);
    if (c->rope_on) {
        char a[32], b[32], f[32], m[32], ma[32];
        num_text(c->rs_beta_fast, 0, a, sizeof a);
        num_text(c->rs_beta_slow, 0, b, sizeof b);
        num_text(c->rs_factor, 0, f, sizeof f);
        num_text(c->rs_mscale, 1, m, sizeof m);
        num_text(c->rs_mscale_all_dim, 1, ma, sizeof ma);
        kv[n].key = "rope_scaling";
        kv[n++].val = xsprintf("{\n    \"beta_fast\": %s,\n    \"beta_slow\": %s,\n    \"factor\": %s,\n"
                               "    \"mscale\": %s,\n    \"mscale_all_dim\": %s,\n"
                               "    \"original_max_position_embeddings\": %lld,\n    \"type\": \"%s\"\n  }",
                               a, b, f, m, ma, (long long)c->rs_orig_max, c->rope_type);
    } else {
        kv[n].key = "rope_scaling";
        kv[n++].val = xstrdup("null");
    }
    KF("rope_theta", c->rope_theta, 0);
    KF("routed_scaling_factor", c->routed_scaling_factor, 1);
    KS("scoring_func", c->scoring_func);
    KB("seq_aux", c->seq_aux);
    KB("tie_word_embeddings", c->tie_word_embeddings);
    KI("topk_group", c->topk_group);
    KS("topk_method", c->topk_method);
    KS("torch_dtype", c->torch_dtype);
    KS("transformers_version", c->transformers_version);
    KB("use_cache", c->use_cache);
    KI("v_head_dim", c->v_head_dim);
    KI("vocab_size", c->vocab_size);
#undef KI
#undef KB
#undef KS
#undef KF
    qsort(kv, (size_t)n, sizeof kv[0], kv_cmp);
    Str s = {0};
    str_add(&s, "{\n");
    for (int i = 0; i < n; i++) {
        str_add(&s, "  \"%s\": %s%s\n", kv[i].key, kv[i].val, i + 1 < n ? "," : "");
        free(kv[i].val);
    }
    str_add(&s, "}\n");
    return s.s;
}

/* ------------------------------------------------------------------------ */
/* tensor list                                                              */
/* ------------------------------------------------------------------------ */

enum { DT_BF16, DT_F32, DT_F8 };
static const char *dt_name[] = { "BF16", "F32", "F8_E4M3" };
static const int dt_size[] = { 2, 4, 1 };

typedef struct {
    char *name;
    char *stream; /* name whose random stream gives the values */
    int dtype;
    int ndim;
    int64_t shape[2];
    float mean, std;
    int is_scale;  /* fp8 block scale of the tensor before it */
    int is_mtp;    /* belongs to an MTP module */
    int is_routed; /* a routed expert's weight */
    int is_embed;  /* model.embed_tokens.weight */
    uint64_t nbytes, nelem;
    int shard;
    uint64_t off; /* data offset inside the shard */
} Tensor;

typedef struct {
    Tensor *t;
    size_t n, cap;
    int fp8;
} TL;

static Tensor *tl_add(TL *tl, const char *name, int dtype, int ndim, int64_t r, int64_t c, float mean, float std,
                      const char *stream)
{
    if (tl->n == tl->cap) {
        tl->cap = tl->cap ? tl->cap * 2 : 1024;
        tl->t = xrealloc(tl->t, tl->cap * sizeof *tl->t);
    }
    Tensor *t = &tl->t[tl->n++];
    memset(t, 0, sizeof *t);
    t->name = xstrdup(name);
    t->stream = xstrdup(stream ? stream : name);
    t->dtype = dtype;
    t->ndim = ndim;
    t->shape[0] = r;
    t->shape[1] = ndim == 2 ? c : 1;
    t->nelem = (uint64_t)r * (uint64_t)t->shape[1];
    t->mean = mean;
    t->std = std;
    return t;
}

/* 2-D projection: N(0,1)*gain/sqrt(fan_in); fp8 (+ scale) if allowed and on */
static Tensor *add_proj(TL *tl, const char *name, int64_t rows, int64_t cols, float gain, int fp8able,
                        const char *stream)
{
    int f8 = tl->fp8 && fp8able;
    Tensor *t = tl_add(tl, name, f8 ? DT_F8 : DT_BF16, 2, rows, cols, 0.0f, gain / sqrtf((float)cols), stream);
    if (f8) {
        size_t idx = (size_t)(t - tl->t);
        char *sn = xsprintf("%s_scale_inv", name);
        Tensor *s = tl_add(tl, sn, DT_F32, 2, (rows + 127) / 128, (cols + 127) / 128, 0, 0, NULL);
        free(sn);
        s->is_scale = 1;
        t = &tl->t[idx]; /* tl_add may have moved the array */
    }
    return t;
}

static void add_norm(TL *tl, const char *name, int64_t n)
{
    tl_add(tl, name, DT_BF16, 1, n, 1, 1.0f, 0.1f, NULL);
}

static void add_layer(TL *tl, const Config *c, int64_t L, int is_mtp)
{
    char p[64], nm[256];
    int64_t h = c->hidden_size, H = c->num_attention_heads;
    int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    size_t first = tl->n;
    snprintf(p, sizeof p, "model.layers.%lld.", (long long)L);
#define NM(s) (snprintf(nm, sizeof nm, "%s%s", p, s), nm)
    if (is_mtp) {
        tl_add(tl, NM("embed_tokens.weight"), DT_BF16, 2, c->vocab_size, h, 0.0f, 1.0f, "model.embed_tokens.weight");
        add_norm(tl, NM("enorm.weight"), h);
        add_norm(tl, NM("hnorm.weight"), h);
        /* BF16 even in fp8 checkpoints, as DeepSeek-V3 ships it */
        add_proj(tl, NM("eh_proj.weight"), h, 2 * h, 1.0f, 0, NULL);
    }
    add_norm(tl, NM("input_layernorm.weight"), h);
    if (c->q_lora_rank) {
        add_proj(tl, NM("self_attn.q_a_proj.weight"), c->q_lora_rank, h, 1.0f, 1, NULL);
        add_norm(tl, NM("self_attn.q_a_layernorm.weight"), c->q_lora_rank);
        add_proj(tl, NM("self_attn.q_b_proj.weight"), H * qk, c->q_lora_rank, 1.0f, 1, NULL);
    } else {
        add_proj(tl, NM("self_attn.q_proj.weight"), H * qk, h, 1.0f, 1, NULL);
    }
    add_proj(tl, NM("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora_rank + c->qk_rope_head_dim, h, 1.0f, 1, NULL);
    add_norm(tl, NM("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank);
    add_proj(tl, NM("self_attn.kv_b_proj.weight"), H * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank,
             1.0f, 1, NULL);
    add_proj(tl, NM("self_attn.o_proj.weight"), h, H * c->v_head_dim, 1.0f, 1, NULL);
    add_norm(tl, NM("post_attention_layernorm.weight"), h);
    if (is_moe_layer(c, L)) {
        int64_t E = c->n_routed_experts, mi = c->moe_intermediate_size;
        add_proj(tl, NM("mlp.gate.weight"), E, h, 1.0f, 0, NULL); /* router: BF16 */
        if (has_bias(c))
            tl_add(tl, NM("mlp.gate.e_score_correction_bias"), DT_F32, 1, E, 1, 0.0f, 0.1f, NULL);
        for (int64_t e = 0; e < E; e++) {
            char q[96];
            size_t a = tl->n;
            snprintf(q, sizeof q, "mlp.experts.%lld.gate_proj.weight", (long long)e);
            add_proj(tl, NM(q), mi, h, 1.0f, 1, NULL);
            snprintf(q, sizeof q, "mlp.experts.%lld.up_proj.weight", (long long)e);
            add_proj(tl, NM(q), mi, h, 1.0f, 1, NULL);
            snprintf(q, sizeof q, "mlp.experts.%lld.down_proj.weight", (long long)e);
            add_proj(tl, NM(q), h, mi, 1.0f, 1, NULL);
            for (size_t k = a; k < tl->n; k++) tl->t[k].is_routed = 1;
        }
        if (c->n_shared_experts > 0) {
            int64_t si = mi * c->n_shared_experts;
            add_proj(tl, NM("mlp.shared_experts.gate_proj.weight"), si, h, 1.0f, 1, NULL);
            add_proj(tl, NM("mlp.shared_experts.up_proj.weight"), si, h, 1.0f, 1, NULL);
            add_proj(tl, NM("mlp.shared_experts.down_proj.weight"), h, si, 1.0f, 1, NULL);
        }
    } else {
        int64_t I = c->intermediate_size;
        add_proj(tl, NM("mlp.gate_proj.weight"), I, h, 1.0f, 1, NULL);
        add_proj(tl, NM("mlp.up_proj.weight"), I, h, 1.0f, 1, NULL);
        add_proj(tl, NM("mlp.down_proj.weight"), h, I, 1.0f, 1, NULL);
    }
    if (is_mtp) {
        add_norm(tl, NM("shared_head.norm.weight"), h);
        if (c->tie_word_embeddings)
            tl_add(tl, NM("shared_head.head.weight"), DT_BF16, 2, c->vocab_size, h, 0.0f, 1.0f,
                   "model.embed_tokens.weight");
        else
            tl_add(tl, NM("shared_head.head.weight"), DT_BF16, 2, c->vocab_size, h, 0.0f,
                   2.0f / sqrtf((float)h), "lm_head.weight");
    }
#undef NM
    for (size_t k = first; k < tl->n; k++) tl->t[k].is_mtp = is_mtp;
}

static void build_tensors(TL *tl, const Config *c, int fp8)
{
    memset(tl, 0, sizeof *tl);
    tl->fp8 = fp8;
    int64_t h = c->hidden_size;
    Tensor *e = tl_add(tl, "model.embed_tokens.weight", DT_BF16, 2, c->vocab_size, h, 0.0f, 1.0f, NULL);
    e->is_embed = 1;
    for (int64_t L = 0; L < c->num_hidden_layers; L++) add_layer(tl, c, L, 0);
    add_norm(tl, "model.norm.weight", h);
    if (!c->tie_word_embeddings) add_proj(tl, "lm_head.weight", c->vocab_size, h, 2.0f, 0, NULL);
    for (int64_t k = 0; k < c->num_nextn_predict_layers; k++) add_layer(tl, c, c->num_hidden_layers + k, 1);
    for (size_t i = 0; i < tl->n; i++) tl->t[i].nbytes = tl->t[i].nelem * (uint64_t)dt_size[tl->t[i].dtype];
}

typedef struct {
    double total, main, mtp, active, active_with_embed;
    uint64_t bytes;
} Counts;

static Counts count_params(const TL *tl, const Config *c)
{
    Counts k = {0};
    double frac = c->n_routed_experts ? (double)c->num_experts_per_tok / (double)c->n_routed_experts : 0;
    for (size_t i = 0; i < tl->n; i++) {
        const Tensor *t = &tl->t[i];
        k.bytes += t->nbytes;
        if (t->is_scale) continue;
        double n = (double)t->nelem;
        k.total += n;
        if (t->is_mtp) { k.mtp += n; continue; }
        k.main += n;
        double a = t->is_routed ? n * frac : n;
        k.active_with_embed += a;
        if (!t->is_embed) k.active += a;
    }
    return k;
}

/* assign shards: tensors in order, a weight and its scale stay together */
static int plan_shards(TL *tl, uint64_t limit, uint64_t **shard_bytes_out)
{
    int ns = 0;
    uint64_t cur = 0;
    uint64_t *sb = NULL;
    for (size_t i = 0; i < tl->n;) {
        size_t j = i + 1;
        uint64_t unit = tl->t[i].nbytes;
        while (j < tl->n && tl->t[j].is_scale) unit += tl->t[j++].nbytes;
        if (ns == 0 || (cur > 0 && cur + unit > limit)) {
            sb = xrealloc(sb, (size_t)(ns + 1) * sizeof *sb);
            sb[ns++] = 0;
            cur = 0;
        }
        for (size_t k = i; k < j; k++) {
            tl->t[k].shard = ns - 1;
            tl->t[k].off = cur;
            cur += tl->t[k].nbytes;
        }
        sb[ns - 1] = cur;
        i = j;
    }
    *shard_bytes_out = sb;
    return ns;
}

/* ------------------------------------------------------------------------ */
/* random values                                                            */
/* ------------------------------------------------------------------------ */

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define NORM_CONST 1.8688123650118534e-05 /* 1 / sqrt(8 * (65536^2 - 1) / 12) */

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t fnv1a64(const char *s)
{
    uint64_t h = 0xCBF29CE484222325ULL;
    for (; *s; s++) { h ^= (unsigned char)*s; h *= 0x100000001B3ULL; }
    return h;
}

static uint64_t stream_key(uint64_t seed, const char *stream)
{
    return mix64(mix64(seed ^ 0x6A09E667F3BCC908ULL) + fnv1a64(stream));
}

/* out[k] = mean + std * z(start + k).  z(i) is the splitmix64 sequence of the
 * key, words 2i and 2i+1, cut into eight 16-bit uniforms and summed
 * (Irwin-Hall, 8 terms, standardised: mean 0, variance 1, range +-4.9). */
static void gen_values(uint64_t key, uint64_t start, size_t n, float mean, float std, float *out)
{
    const uint64_t M = 0x0000FFFF0000FFFFULL;
    uint64_t ctr = key + (2 * start + 1) * GOLDEN;
    const float scale = (float)(NORM_CONST) * std;
    for (size_t k = 0; k < n; k++) {
        uint64_t a = mix64(ctr);
        uint64_t b = mix64(ctr + GOLDEN);
        ctr += 2 * GOLDEN;
        uint64_t s = (a & M) + ((a >> 16) & M) + (b & M) + ((b >> 16) & M);
        int32_t S = (int32_t)((uint32_t)s + (uint32_t)(s >> 32)) - 262140;
        out[k] = mean + (float)S * scale;
    }
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* round to nearest even float8 e4m3fn, saturating at +-448 */
static inline uint8_t f32_to_e4m3(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return 0x7F;           /* NaN */
    if (u >= 0x43E00000u) return sign | 0x7E;   /* >= 448: saturate */
    if (u < 0x3C800000u) {                      /* < 2^-6: subnormal, step 2^-9 */
        float a;
        memcpy(&a, &u, 4);
        long m = lrintf(a * 512.0f);            /* 0..8; 8 encodes 2^-6 */
        return sign | (uint8_t)m;
    }
    u += 0x7FFFFu + ((u >> 20) & 1u);
    int e = (int)(u >> 23) - 127 + 7;
    unsigned m = (u >> 20) & 7u;
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7E;
    return sign | (uint8_t)((unsigned)e << 3) | (uint8_t)m;
}

/* ------------------------------------------------------------------------ */
/* writing                                                                  */
/* ------------------------------------------------------------------------ */

static int host_is_le(void)
{
    uint16_t x = 1;
    unsigned char b;
    memcpy(&b, &x, 1);
    return b == 1;
}

typedef struct {
    uint64_t total, done;
    int last_pct;
    double t0, last_t;
    int quiet, tty;
    int report_fd;    /* in a worker process: pipe to the parent, else -1 */
    uint64_t pending; /* worker: bytes not yet reported */
} Progress;

static Progress g_prog_state = { 0, 0, -1, 0, 0, 1, 0, -1, 0 };

static void progress_show(void)
{
    Progress *p = &g_prog_state;
    if (p->quiet) return;
    int pct = p->total ? (int)(100.0 * (double)p->done / (double)p->total) : 100;
    if (pct == p->last_pct) return;
    if (!p->tty && pct / 10 == p->last_pct / 10 && pct != 100) return;
    double t = now_sec();
    if (p->tty && pct != 100 && t - p->last_t < 0.2) return;
    p->last_pct = pct;
    p->last_t = t;
    double el = t - p->t0;
    fprintf(stderr, "%swriting %3d%%  %.2f / %.2f GB  %.1f s  %.0f MB/s%s", p->tty ? "\r" : "", pct,
            (double)p->done / 1e9, (double)p->total / 1e9, el, el > 0 ? (double)p->done / 1e6 / el : 0.0,
            p->tty ? "" : "\n");
    fflush(stderr);
}

static void progress_flush(void)
{
    Progress *p = &g_prog_state;
    if (p->report_fd < 0 || !p->pending) return;
    unsigned char b[8];
    for (int k = 0; k < 8; k++) b[k] = (unsigned char)(p->pending >> (8 * k));
    /* 8 bytes < PIPE_BUF: atomic; a lost report only affects the display */
    if (write(p->report_fd, b, 8) != 8) p->report_fd = -1;
    p->pending = 0;
}

static void progress_add(uint64_t n)
{
    Progress *p = &g_prog_state;
    if (p->report_fd >= 0) {
        p->pending += n;
        if (p->pending >= (8u << 20)) progress_flush();
        return;
    }
    p->done += n;
    progress_show();
}

typedef struct {
    FILE *f;
    const char *path;
} Out;

static void out_write(Out *o, const void *buf, size_t n)
{
    if (n && fwrite(buf, 1, n, o->f) != n) die("write error on %s: %s", o->path, strerror(errno));
}

#define CHUNK (1u << 20)

static float *g_fbuf;
static unsigned char *g_obuf;
static size_t g_fcap;

static void ensure_bufs(size_t nfloat)
{
    if (nfloat <= g_fcap) return;
    free(g_fbuf);
    free(g_obuf);
    g_fbuf = xmalloc(nfloat * sizeof(float));
    g_obuf = xmalloc(nfloat * sizeof(float));
    g_fcap = nfloat;
}

static void write_plain(Out *o, const Tensor *t, uint64_t seed)
{
    uint64_t key = stream_key(seed, t->stream);
    int le = host_is_le();
    ensure_bufs(CHUNK);
    for (uint64_t i = 0; i < t->nelem; i += CHUNK) {
        size_t n = (size_t)(t->nelem - i < CHUNK ? t->nelem - i : CHUNK);
        gen_values(key, i, n, t->mean, t->std, g_fbuf);
        if (t->dtype == DT_BF16) {
            for (size_t k = 0; k < n; k++) {
                uint16_t v = f32_to_bf16(g_fbuf[k]);
                g_obuf[2 * k] = (unsigned char)(v & 0xFF);
                g_obuf[2 * k + 1] = (unsigned char)(v >> 8);
            }
            out_write(o, g_obuf, 2 * n);
            progress_add(2 * n);
        } else {
            if (le) out_write(o, g_fbuf, 4 * n);
            else {
                for (size_t k = 0; k < n; k++) {
                    uint32_t u;
                    memcpy(&u, &g_fbuf[k], 4);
                    for (int b = 0; b < 4; b++) g_obuf[4 * k + (size_t)b] = (unsigned char)(u >> (8 * b));
                }
                out_write(o, g_obuf, 4 * n);
            }
            progress_add(4 * n);
        }
    }
}

/* fp8 block quantisation, 128 rows at a time; fills scales[rb*cb] */
static void write_fp8(Out *o, const Tensor *t, uint64_t seed, float *scales)
{
    uint64_t key = stream_key(seed, t->stream);
    int64_t R = t->shape[0], C = t->shape[1];
    int64_t cb = (C + 127) / 128;
    ensure_bufs((size_t)(128 * C));
    for (int64_t r0 = 0; r0 < R; r0 += 128) {
        int64_t h = R - r0 < 128 ? R - r0 : 128;
        size_t n = (size_t)(h * C);
        gen_values(key, (uint64_t)(r0 * C), n, t->mean, t->std, g_fbuf);
        for (int64_t b = 0; b < cb; b++) {
            int64_t c0 = b * 128, c1 = c0 + 128 < C ? c0 + 128 : C;
            float amax = 0;
            for (int64_t r = 0; r < h; r++)
                for (int64_t c = c0; c < c1; c++) {
                    float a = fabsf(g_fbuf[r * C + c]);
                    if (a > amax) amax = a;
                }
            float s = amax > 0 ? amax / 448.0f : 1.0f;
            scales[(r0 / 128) * cb + b] = s;
            for (int64_t r = 0; r < h; r++)
                for (int64_t c = c0; c < c1; c++) g_obuf[r * C + c] = f32_to_e4m3(g_fbuf[r * C + c] / s);
        }
        out_write(o, g_obuf, n);
        progress_add(n);
    }
}

static void write_scales(Out *o, const Tensor *t, const float *scales)
{
    unsigned char b4[4];
    for (uint64_t i = 0; i < t->nelem; i++) {
        uint32_t u;
        memcpy(&u, &scales[i], 4);
        b4[0] = (unsigned char)u;
        b4[1] = (unsigned char)(u >> 8);
        b4[2] = (unsigned char)(u >> 16);
        b4[3] = (unsigned char)(u >> 24);
        out_write(o, b4, 4);
    }
    progress_add(t->nbytes);
}

static char *shard_header(const TL *tl, int shard)
{
    Str s = {0};
    str_add(&s, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < tl->n; i++) {
        const Tensor *t = &tl->t[i];
        if (t->shard != shard) continue;
        str_add(&s, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, dt_name[t->dtype]);
        if (t->ndim == 2) str_add(&s, "%lld,%lld", (long long)t->shape[0], (long long)t->shape[1]);
        else str_add(&s, "%lld", (long long)t->shape[0]);
        str_add(&s, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->off,
                (unsigned long long)(t->off + t->nbytes));
    }
    str_add(&s, "}");
    while (s.n % 8) str_add(&s, " ");
    return s.s;
}

static char *shard_name(int k, int ns, int single)
{
    if (single) return xstrdup("model.safetensors");
    return xsprintf("model-%05d-of-%05d.safetensors", k + 1, ns);
}

typedef struct {
    char *path, *tmp;    /* final name and the .partial being written */
    uint64_t data_start; /* 8 + header length */
} ShardFile;

/* create every shard as <name>.partial: header written, data area sized */
static ShardFile *create_shards(const char *dir, const TL *tl, int ns, const uint64_t *sb, int single)
{
    ShardFile *sf = xmalloc((size_t)ns * sizeof *sf);
    for (int k = 0; k < ns; k++) {
        char *fname = shard_name(k, ns, single);
        sf[k].path = xsprintf("%s/%s", dir, fname);
        sf[k].tmp = xsprintf("%s.partial", sf[k].path);
        free(fname);
        Out o = { fopen(sf[k].tmp, "wb"), sf[k].tmp };
        if (!o.f) die("cannot create %s: %s", sf[k].tmp, strerror(errno));
        char *hdr = shard_header(tl, k);
        uint64_t hn = strlen(hdr);
        unsigned char len8[8];
        for (int b = 0; b < 8; b++) len8[b] = (unsigned char)(hn >> (8 * b));
        out_write(&o, len8, 8);
        out_write(&o, hdr, hn);
        free(hdr);
        sf[k].data_start = 8 + hn;
        if (fflush(o.f) || ftruncate(fileno(o.f), (off_t)(sf[k].data_start + sb[k])))
            die("cannot size %s: %s", sf[k].tmp, strerror(errno));
        if (fclose(o.f)) die("write error on %s: %s", sf[k].tmp, strerror(errno));
    }
    return sf;
}

/* write tensors [a, b) of the list (a weight and its fp8 scale must both be
 * in the range) into their places in the shard files */
static void write_range(const TL *tl, size_t a, size_t b, const ShardFile *sf, uint64_t seed)
{
    Out o = { NULL, NULL };
    int cur = -1;
    float *scales = NULL;
    size_t scap = 0;
    for (size_t i = a; i < b; i++) {
        const Tensor *t = &tl->t[i];
        if (t->shard != cur) {
            if (o.f && fclose(o.f)) die("write error on %s: %s", o.path, strerror(errno));
            cur = t->shard;
            o.path = sf[cur].tmp;
            o.f = fopen(o.path, "r+b");
            if (!o.f) die("cannot open %s: %s", o.path, strerror(errno));
            setvbuf(o.f, NULL, _IOFBF, 1 << 22);
            if (fseeko(o.f, (off_t)(sf[cur].data_start + t->off), SEEK_SET))
                die("cannot seek in %s: %s", o.path, strerror(errno));
        }
        if (t->dtype == DT_F8) {
            const Tensor *s = &tl->t[i + 1];
            if (s->nelem > scap) { free(scales); scap = s->nelem; scales = xmalloc(scap * sizeof *scales); }
            write_fp8(&o, t, seed, scales);
        } else if (t->is_scale) {
            write_scales(&o, t, scales);
        } else {
            write_plain(&o, t, seed);
        }
    }
    free(scales);
    if (o.f && (fflush(o.f) || ferror(o.f) || fclose(o.f))) die("write error on %s: %s", o.path, strerror(errno));
    progress_flush();
}

/* write all tensor data with `jobs` worker processes, each taking a
 * contiguous run of tensors of about equal bytes; returns 0 on success */
static int write_all(const TL *tl, const ShardFile *sf, uint64_t seed, int jobs, uint64_t total)
{
    if (jobs <= 1) {
        write_range(tl, 0, tl->n, sf, seed);
        return 0;
    }
    size_t *cut = xmalloc((size_t)(jobs + 1) * sizeof *cut);
    cut[0] = 0;
    int w = 1;
    uint64_t acc = 0;
    for (size_t i = 0; i < tl->n; i++) {
        if (w < jobs && !tl->t[i].is_scale && acc >= total / (uint64_t)jobs * (uint64_t)w) cut[w++] = i;
        acc += tl->t[i].nbytes;
    }
    while (w < jobs) cut[w++] = tl->n;
    cut[jobs] = tl->n;
    int fds[2];
    if (pipe(fds)) die("pipe: %s", strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t *pids = xmalloc((size_t)jobs * sizeof *pids);
    for (int k = 0; k < jobs; k++) {
        pids[k] = fork();
        if (pids[k] < 0) die("fork: %s", strerror(errno));
        if (pids[k] == 0) {
            close(fds[0]);
            g_prog_state.report_fd = fds[1];
            write_range(tl, cut[k], cut[k + 1], sf, seed);
            close(fds[1]);
            fflush(NULL);
            _exit(0);
        }
    }
    close(fds[1]);
    unsigned char b[8];
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fds[0], b + got, 8 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* every worker closed its end */
        got += (size_t)r;
        if (got < 8) continue;
        uint64_t v = 0;
        for (int k = 0; k < 8; k++) v |= (uint64_t)b[k] << (8 * k);
        got = 0;
        g_prog_state.done += v;
        progress_show();
    }
    close(fds[0]);
    int bad = 0;
    for (int k = 0; k < jobs; k++) {
        int st;
        while (waitpid(pids[k], &st, 0) < 0)
            if (errno != EINTR) { bad = 1; break; }
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad = 1;
    }
    free(pids);
    free(cut);
    return bad ? -1 : 0;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp((*(const Tensor *const *)a)->name, (*(const Tensor *const *)b)->name);
}

static void write_index(const char *dir, const TL *tl, int ns, uint64_t total)
{
    const Tensor **v = xmalloc(tl->n * sizeof *v);
    for (size_t i = 0; i < tl->n; i++) v[i] = &tl->t[i];
    qsort(v, tl->n, sizeof *v, name_cmp);
    char *path = xsprintf("%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot create %s: %s", path, strerror(errno));
    fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n",
            (unsigned long long)total);
    for (size_t i = 0; i < tl->n; i++) {
        char *sn = shard_name(v[i]->shard, ns, 0);
        fprintf(f, "    \"%s\": \"%s\"%s\n", v[i]->name, sn, i + 1 < tl->n ? "," : "");
        free(sn);
    }
    fprintf(f, "  }\n}\n");
    if (fclose(f)) die("write error on %s: %s", path, strerror(errno));
    free(path);
    free(v);
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char *path = xsprintf("%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot create %s: %s", path, strerror(errno));
    size_t n = strlen(text);
    if (fwrite(text, 1, n, f) != n || fclose(f)) die("write error on %s: %s", path, strerror(errno));
    free(path);
}

static void copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb");
    if (!in) die("cannot open %s: %s", src, strerror(errno));
    FILE *out = fopen(dst, "wb");
    if (!out) die("cannot create %s: %s", dst, strerror(errno));
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) die("write error on %s: %s", dst, strerror(errno));
    if (ferror(in)) die("read error on %s", src);
    fclose(in);
    if (fclose(out)) die("write error on %s: %s", dst, strerror(errno));
}

static int file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int tokenizer_dir_ok(const char *d)
{
    char *a = xsprintf("%s/tokenizer.json", d), *b = xsprintf("%s/tokenizer_config.json", d);
    int ok = file_exists(a) && file_exists(b);
    free(a);
    free(b);
    return ok;
}

static char *dirname_of(const char *p)
{
    const char *s = strrchr(p, '/');
    if (!s) return xstrdup(".");
    if (s == p) return xstrdup("/");
    char *d = xmalloc((size_t)(s - p) + 1);
    memcpy(d, p, (size_t)(s - p));
    d[s - p] = 0;
    return d;
}

/* the repo's tiny tokenizer: tests/fixtures/tiny-dsv3 relative to this source
 * file, the binary, or the current directory */
static char *find_default_tokenizer(const char *argv0)
{
    const char *env = getenv("GEN_SYNTH_TOKENIZER");
    if (env && *env) return tokenizer_dir_ok(env) ? xstrdup(env) : NULL;
    char *src = dirname_of(__FILE__), *bin = dirname_of(argv0);
    const char *rel[] = { "/../../tests/fixtures/tiny-dsv3", "/../../tests/fixtures/tiny-tokenizer" };
    char *cand[16];
    int n = 0;
    for (int i = 0; i < 2; i++) {
        cand[n++] = xsprintf("%s%s", src, rel[i]);
        cand[n++] = xsprintf("%s%s", bin, rel[i]);
    }
    cand[n++] = xsprintf("%s/tests/fixtures/tiny-dsv3", bin);
    cand[n++] = xsprintf("%s/../tests/fixtures/tiny-dsv3", bin);
    cand[n++] = xstrdup("tests/fixtures/tiny-dsv3");
    cand[n++] = xstrdup("../../tests/fixtures/tiny-dsv3");
    char *found = NULL;
    for (int i = 0; i < n; i++) {
        if (!found && tokenizer_dir_ok(cand[i])) found = xstrdup(cand[i]);
        free(cand[i]);
    }
    free(src);
    free(bin);
    return found;
}

static int mkdir_p(const char *path)
{
    char *p = xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0777) && errno != EEXIST) { free(p); return -1; }
        *s = '/';
    }
    int r = mkdir(p, 0777);
    free(p);
    if (r && errno != EEXIST) return -1;
    struct stat st;
    if (stat(path, &st) || !S_ISDIR(st.st_mode)) { errno = ENOTDIR; return -1; }
    return 0;
}

static int is_model_file(const char *n)
{
    size_t l = strlen(n);
    if (!strcmp(n, "model.safetensors") || !strcmp(n, "model.safetensors.index.json")) return 1;
    if (!strncmp(n, "model-", 6) && l > 12 && !strcmp(n + l - 12, ".safetensors") && strstr(n, "-of-")) return 1;
    if (!strncmp(n, "model", 5) && l > 8 && !strcmp(n + l - 8, ".partial")) return 1;
    return 0;
}

/* 0: empty or missing; otherwise the number of entries */
static int prepare_dir(const char *dir, int force)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n++;
        if (force && is_model_file(e->d_name)) {
            char *p = xsprintf("%s/%s", dir, e->d_name);
            if (unlink(p)) die("cannot remove old %s: %s", p, strerror(errno));
            free(p);
        }
    }
    closedir(d);
    return n;
}

/* ------------------------------------------------------------------------ */
/* summary                                                                  */
/* ------------------------------------------------------------------------ */

/* name with layer index -> {L} (main) / {MTP} and expert index -> {E} */
static void pattern_of(const char *name, int64_t nl, char *out, size_t cap)
{
    size_t o = 0;
    const char *s = name;
    while (*s && o + 8 < cap) {
        if (!strncmp(s, "layers.", 7) && isdigit((unsigned char)s[7])) {
            char *end;
            long long L = strtoll(s + 7, &end, 10);
            o += (size_t)snprintf(out + o, cap - o, "layers.%s", L < nl ? "{L}" : "{MTP}");
            s = end;
        } else if (!strncmp(s, "experts.", 8) && isdigit((unsigned char)s[8])) {
            char *end;
            strtoll(s + 8, &end, 10);
            o += (size_t)snprintf(out + o, cap - o, "experts.{E}");
            s = end;
        } else {
            out[o++] = *s++;
        }
    }
    out[o] = 0;
}

typedef struct {
    char pat[160];
    int dtype, ndim;
    int64_t shape[2];
    uint64_t count;
} Pat;

static void print_summary(const Config *c, const TL *tl, const char *src, int fp8, uint64_t seed, int ns,
                          const uint64_t *sb, uint64_t limit, int list)
{
    char b1[64], b2[64], b3[64], b4[64];
    int64_t nl = c->num_hidden_layers, nmoe = 0;
    for (int64_t L = 0; L < nl; L++) nmoe += is_moe_layer(c, L);
    printf("model    %s (%s), %s, seed %llu\n", src, c->model_type, fp8 ? "fp8 e4m3 128x128 blocks" : "bf16",
           (unsigned long long)seed);
    printf("shape    vocab %lld, hidden %lld, %lld layers (%lld dense, %lld MoE) + %lld MTP, %lld heads\n",
           (long long)c->vocab_size, (long long)c->hidden_size, (long long)nl, (long long)(nl - nmoe),
           (long long)nmoe, (long long)c->num_nextn_predict_layers, (long long)c->num_attention_heads);
    if (c->q_lora_rank)
        printf("attn     MLA q_lora %lld, kv_lora %lld, qk_nope %lld, qk_rope %lld, v %lld\n", (long long)c->q_lora_rank,
               (long long)c->kv_lora_rank, (long long)c->qk_nope_head_dim, (long long)c->qk_rope_head_dim,
               (long long)c->v_head_dim);
    else
        printf("attn     MLA q_proj (q_lora null), kv_lora %lld, qk_nope %lld, qk_rope %lld, v %lld\n",
               (long long)c->kv_lora_rank, (long long)c->qk_nope_head_dim, (long long)c->qk_rope_head_dim,
               (long long)c->v_head_dim);
    printf("moe      %lld routed x %lld + %lld shared, top-%lld, top-%lld of %lld groups, %s/%s, dense intermediate %lld\n",
           (long long)c->n_routed_experts, (long long)c->moe_intermediate_size, (long long)c->n_shared_experts,
           (long long)c->num_experts_per_tok, (long long)c->topk_group, (long long)c->n_group, c->topk_method,
           c->scoring_func, (long long)c->intermediate_size);

    Pat *p = NULL;
    size_t np = 0, cap = 0;
    for (size_t i = 0; i < tl->n; i++) {
        const Tensor *t = &tl->t[i];
        char pat[160];
        pattern_of(t->name, nl, pat, sizeof pat);
        size_t k;
        for (k = 0; k < np; k++)
            if (p[k].dtype == t->dtype && p[k].shape[0] == t->shape[0] && p[k].shape[1] == t->shape[1] &&
                p[k].ndim == t->ndim && !strcmp(p[k].pat, pat))
                break;
        if (k == np) {
            if (np == cap) { cap = cap ? cap * 2 : 64; p = xrealloc(p, cap * sizeof *p); }
            memset(&p[np], 0, sizeof p[np]);
            strcpy(p[np].pat, pat);
            p[np].dtype = t->dtype;
            p[np].ndim = t->ndim;
            p[np].shape[0] = t->shape[0];
            p[np].shape[1] = t->shape[1];
            np++;
        }
        p[k].count++;
    }
    printf("\ntensors  %zu (%zu distinct name/shape patterns)\n", tl->n, np);
    for (size_t k = 0; k < np; k++) {
        char sh[64];
        if (p[k].ndim == 2) snprintf(sh, sizeof sh, "[%lld, %lld]", (long long)p[k].shape[0], (long long)p[k].shape[1]);
        else snprintf(sh, sizeof sh, "[%lld]", (long long)p[k].shape[0]);
        printf("  %6llu x %-62s %-8s %s\n", (unsigned long long)p[k].count, p[k].pat, dt_name[p[k].dtype], sh);
    }
    free(p);
    if (list) {
        printf("\nall tensors (shard, offset, dtype, shape):\n");
        for (size_t i = 0; i < tl->n; i++) {
            const Tensor *t = &tl->t[i];
            printf("  %5d %14llu  %-70s %-8s [%lld%s", t->shard + 1, (unsigned long long)t->off, t->name,
                   dt_name[t->dtype], (long long)t->shape[0], t->ndim == 2 ? ", " : "");
            if (t->ndim == 2) printf("%lld", (long long)t->shape[1]);
            printf("]\n");
        }
    }
    Counts k = count_params(tl, c);
    printf("\nparams   total %s (main model %s + MTP %s)\n", fmt_count(k.total, b1, sizeof b1),
           fmt_count(k.main, b2, sizeof b2), fmt_count(k.mtp, b3, sizeof b3));
    printf("active   %s per token (main model, top-%lld of %lld routed experts, embedding table excluded; %s with it)\n",
           fmt_count(k.active, b1, sizeof b1), (long long)c->num_experts_per_tok, (long long)c->n_routed_experts,
           fmt_count(k.active_with_embed, b4, sizeof b4));
    printf("exact    total %.0f, main %.0f, mtp %.0f, active %.0f\n", k.total, k.main, k.mtp, k.active);
    printf("bytes    %s of tensor data (%llu bytes)\n", fmt_bytes((double)k.bytes, b1, sizeof b1),
           (unsigned long long)k.bytes);
    uint64_t mx = 0;
    for (int s = 0; s < ns; s++) if (sb[s] > mx) mx = sb[s];
    printf("shards   %d of at most %s (largest %s)\n", ns, fmt_bytes((double)limit, b1, sizeof b1),
           fmt_bytes((double)mx, b2, sizeof b2));
}

/* ------------------------------------------------------------------------ */
/* main                                                                     */
/* ------------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f,
"usage: gen_synth [options] OUTDIR\n"
"       gen_synth --preset NAME --dry-run\n"
"\n"
"Writes a synthetic DeepSeek-V2/V3 checkpoint in Hugging Face layout: config.json,\n"
"sharded *.safetensors + model.safetensors.index.json, tokenizer.json and\n"
"tokenizer_config.json. Weights are random and deterministic in --seed.\n"
"\n"
"model:\n"
"  --preset NAME      tiny (default) | bench-S | bench-M | v2-lite | v3\n"
"  --config FILE      start from an existing config.json instead of a preset\n"
"                     (an fp8 quantization_config there selects --dtype fp8)\n"
"  --set KEY=VALUE    override one config field (repeatable), e.g.\n"
"                     --set num_hidden_layers=4  --set q_lora_rank=null\n"
"                     --set rope_scaling.factor=40  --set rope_scaling=null\n"
"  --dtype bf16|fp8   weight type (default bf16; v3 defaults to fp8). fp8 = e4m3 with\n"
"                     128x128 F32 block scales (<name>_scale_inv) as DeepSeek-V3 ships\n"
"  --seed N           random seed (default 0)\n"
"\n"
"output:\n"
"  --shard-size SIZE  max tensor bytes per shard (default 2GB; K/M/G = 1000^n,\n"
"                     Ki/Mi/Gi = 1024^n); tensors are never split\n"
"  --no-index         write one model.safetensors without index (must fit one shard)\n"
"  --tokenizer DIR    copy tokenizer.json + tokenizer_config.json from DIR\n"
"                     (default: the repo's tests/fixtures/tiny-dsv3, 1024 ids;\n"
"                     env GEN_SYNTH_TOKENIZER overrides the default)\n"
"  --no-tokenizer     write no tokenizer files\n"
"  --force            write into a non-empty directory (removes old model*.safetensors)\n"
"  --allow-huge       allow writing the v3 preset (about 690 GB)\n"
"\n"
"other:\n"
"  --dry-run          print the tensor summary, parameter counts and sizes; write nothing\n"
"  --list             with --dry-run: also list every tensor with its shard and offset\n"
"  --print-config     print the config.json that would be written and exit\n"
"  --list-keys        print the keys --set accepts and exit\n"
"  -j, --jobs N       writer processes (default: online CPUs, at most 8)\n"
"  -q, --quiet        no progress output\n"
"  -h, --help         this text\n"
"\n"
"presets:\n");
    for (size_t i = 0; i < N_PRESETS; i++) fprintf(f, "  %-8s %s\n", g_presets[i].name, g_presets[i].desc);
    fprintf(f, "\nexample: gen_synth --preset v2-lite --set num_hidden_layers=4 /tmp/v2lite4\n");
}

int main(int argc, char **argv)
{
    const char *preset_name = NULL, *config_file = NULL, *outdir = NULL, *tok_dir = NULL;
    const char *dtype = NULL;
    const char **sets = xmalloc((size_t)argc * sizeof *sets);
    int nsets = 0, dry = 0, list = 0, no_index = 0, no_tok = 0, force = 0, quiet = 0, huge = 0, print_cfg = 0;
    uint64_t seed = 0, limit = 2000000000ULL;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int jobs = ncpu < 1 ? 1 : ncpu > 8 ? 8 : (int)ncpu;

    g_prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
#define NEXT() (i + 1 < argc ? argv[++i] : (die("%s needs a value (see -h)", a), (char *)NULL))
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--preset")) preset_name = NEXT();
        else if (!strcmp(a, "--config")) config_file = NEXT();
        else if (!strcmp(a, "--set")) sets[nsets++] = NEXT();
        else if (!strcmp(a, "--dtype")) dtype = NEXT();
        else if (!strcmp(a, "--seed")) {
            const char *v = NEXT();
            char *end;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 0);
            if (end == v || *end || errno || v[0] == '-') die("bad --seed %s: expected a non-negative integer", v);
            seed = s;
        } else if (!strcmp(a, "--shard-size")) {
            const char *v = NEXT();
            if (!parse_size(v, &limit)) die("bad --shard-size %s: expected e.g. 2GB, 500M, 1GiB or a byte count", v);
        } else if (!strcmp(a, "--jobs") || !strcmp(a, "-j")) {
            const char *v = NEXT();
            char *end;
            long j = strtol(v, &end, 10);
            if (end == v || *end || j < 1 || j > 256) die("bad --jobs %s: expected 1..256", v);
            jobs = (int)j;
        } else if (!strcmp(a, "--no-index")) no_index = 1;
        else if (!strcmp(a, "--tokenizer")) tok_dir = NEXT();
        else if (!strcmp(a, "--no-tokenizer")) no_tok = 1;
        else if (!strcmp(a, "--force")) force = 1;
        else if (!strcmp(a, "--allow-huge")) huge = 1;
        else if (!strcmp(a, "--dry-run") || !strcmp(a, "-n")) dry = 1;
        else if (!strcmp(a, "--list")) list = 1;
        else if (!strcmp(a, "--print-config")) print_cfg = 1;
        else if (!strcmp(a, "--list-keys")) {
            for (size_t k = 0; k < N_FIELDS; k++) printf("%s\n", g_fields[k].key);
            printf("rope_scaling  (null or yarn)\n");
            return 0;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1]) die("unknown option %s (see -h)", a);
        else if (outdir) die("more than one output directory given: %s and %s", outdir, a);
        else outdir = a;
#undef NEXT
    }

    Config cfg;
    int fp8 = 0;
    const char *src;
    const Preset *pr = NULL;
    if (preset_name && config_file) die("--preset and --config are exclusive");
    if (config_file) {
        fp8 = cfg_load_file(&cfg, config_file);
        src = config_file;
    } else {
        pr = find_preset(preset_name ? preset_name : "tiny");
        if (!pr) {
            fprintf(stderr, "%s: error: unknown preset '%s'; presets are:", g_prog, preset_name);
            for (size_t k = 0; k < N_PRESETS; k++) fprintf(stderr, " %s", g_presets[k].name);
            fprintf(stderr, "\n");
            return 1;
        }
        pr->fn(&cfg);
        fp8 = pr->fp8_default;
        src = pr->name;
    }
    for (int k = 0; k < nsets; k++) {
        char key[128];
        const char *eq = strchr(sets[k], '=');
        if (!eq || eq == sets[k] || (size_t)(eq - sets[k]) >= sizeof key)
            die("bad --set '%s': expected KEY=VALUE", sets[k]);
        memcpy(key, sets[k], (size_t)(eq - sets[k]));
        key[eq - sets[k]] = 0;
        const char *why;
        int r = cfg_set(&cfg, key, eq + 1, &why);
        if (r == -1) die("unknown --set key '%s' (gen_synth --list-keys prints them)", key);
        if (r == -2) die("bad value for --set %s: '%s': %s", key, eq + 1, why);
    }
    if (dtype) {
        if (ieq(dtype, "bf16") || ieq(dtype, "bfloat16")) fp8 = 0;
        else if (ieq(dtype, "fp8") || ieq(dtype, "f8_e4m3") || ieq(dtype, "e4m3")) fp8 = 1;
        else die("bad --dtype %s: expected bf16 or fp8", dtype);
    }
    cfg_validate(&cfg);

    char *cj = config_json(&cfg, fp8);
    if (print_cfg) { fputs(cj, stdout); return 0; }

    TL tl;
    build_tensors(&tl, &cfg, fp8);
    uint64_t *sb;
    int ns = plan_shards(&tl, limit, &sb);
    int single = no_index;
    if (no_index && ns > 1)
        die("--no-index needs everything in one shard, but %d shards of <= %llu bytes are needed "
            "(raise --shard-size or drop --no-index)", ns, (unsigned long long)limit);
    Counts cnt = count_params(&tl, &cfg);

    if (dry) {
        print_summary(&cfg, &tl, src, fp8, seed, ns, sb, limit, list);
        return 0;
    }
    if (!outdir) die("no output directory given (see -h; --dry-run needs none)");
    if (pr && pr->dry_only && !huge)
        die("preset %s is %.0f GB: use --dry-run, or --allow-huge if you really want it written", pr->name,
            (double)cnt.bytes / 1e9);

    /* tokenizer source, before touching the output */
    char *tsrc = NULL;
    if (!no_tok) {
        if (tok_dir) {
            if (!tokenizer_dir_ok(tok_dir)) die("--tokenizer %s: no tokenizer.json + tokenizer_config.json there", tok_dir);
            tsrc = xstrdup(tok_dir);
        } else {
            tsrc = find_default_tokenizer(argv[0]);
            if (!tsrc)
                die("cannot find the default tokenizer (the repo's tests/fixtures/tiny-dsv3); "
                    "pass --tokenizer DIR or --no-tokenizer");
            if (cfg.vocab_size < 1024)
                warn("vocab_size %lld < 1024: the default tiny tokenizer has 1024 ids", (long long)cfg.vocab_size);
        }
    }

    if (mkdir_p(outdir)) die("cannot create output directory %s: %s", outdir, strerror(errno));
    int nent = prepare_dir(outdir, 0);
    if (nent && !force) die("output directory %s is not empty (use --force to write into it)", outdir);
    if (force) prepare_dir(outdir, 1);
    {
        char *probe = xsprintf("%s/.gen_synth_probe", outdir);
        FILE *f = fopen(probe, "wb");
        if (!f) die("output directory %s is not writable: %s", outdir, strerror(errno));
        fclose(f);
        remove(probe);
        free(probe);
    }
    struct statvfs vfs;
    if (statvfs(outdir, &vfs) == 0) {
        double avail = (double)vfs.f_bavail * (double)vfs.f_frsize;
        if (avail < (double)cnt.bytes + 16e6) {
            char b1[64], b2[64];
            die("not enough space in %s: need %s, %s available", outdir, fmt_bytes((double)cnt.bytes, b1, sizeof b1),
                fmt_bytes(avail, b2, sizeof b2));
        }
    }

    double t0 = now_sec();
    g_prog_state.total = cnt.bytes;
    g_prog_state.quiet = quiet || cnt.bytes < 64000000ULL;
    g_prog_state.tty = isatty(2);
    g_prog_state.t0 = t0;
    g_prog_state.last_pct = -1;

    write_text(outdir, "config.json", cj);
    if (tsrc) {
        const char *files[] = { "tokenizer.json", "tokenizer_config.json" };
        for (int k = 0; k < 2; k++) {
            char *s = xsprintf("%s/%s", tsrc, files[k]), *d = xsprintf("%s/%s", outdir, files[k]);
            copy_file(s, d);
            free(s);
            free(d);
        }
    }
    ShardFile *sf = create_shards(outdir, &tl, ns, sb, single);
    if (jobs > (int)(cnt.bytes / 32000000ULL)) jobs = (int)(cnt.bytes / 32000000ULL); /* small: no fork */
    if (write_all(&tl, sf, seed, jobs, cnt.bytes)) {
        for (int s = 0; s < ns; s++) remove(sf[s].tmp);
        die("a writer process failed; partial files removed");
    }
    for (int s = 0; s < ns; s++)
        if (rename(sf[s].tmp, sf[s].path)) die("cannot rename %s: %s", sf[s].tmp, strerror(errno));
    if (!single) write_index(outdir, &tl, ns, cnt.bytes);
    if (!g_prog_state.quiet && g_prog_state.tty) fputc('\n', stderr);

    double el = now_sec() - t0;
    if (!quiet) {
        char b1[64], b2[64], b3[64];
        fprintf(stderr, "%s: wrote %s (%s params, %s, %zu tensors, %d shard%s) to %s in %.2f s (%.0f MB/s)\n", g_prog,
                src, fmt_count(cnt.total, b1, sizeof b1), fp8 ? "fp8" : "bf16", tl.n, ns, ns == 1 ? "" : "s", outdir,
                el, el > 0 ? (double)cnt.bytes / 1e6 / el : 0.0);
        fprintf(stderr, "%s: tensor data %s\n", g_prog, fmt_bytes((double)cnt.bytes, b2, sizeof b2));
        (void)b3;
    }
    return 0;
}

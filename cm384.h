/* cm384.h -- a CloudMatrix384-style supernode in a process: an embeddable C
 * library that loads a DeepSeek-style mixture-of-experts checkpoint and serves
 * it with prefill, decode and caching as peer subsystems over one memory pool,
 * experts spread over emulated devices, tokens dispatched to them and combined
 * back.
 *
 * ---------------------------------------------------------------------------
 * QUICK START
 *
 *     #include "cm384.h"
 *
 *     static int on_event(void *user, const cm384_event *ev) {
 *         if (ev->kind == CM384_EV_TOKEN) fwrite(ev->text, 1, ev->text_len, stdout);
 *         return 0;                                  // non-zero cancels the request
 *     }
 *
 *     cm384_model *m; cm384_engine *e;
 *     if (cm384_model_load("models/shakespeare", NULL, &m) != CM384_OK) {
 *         fprintf(stderr, "%s\n", cm384_last_error());
 *         return 1;
 *     }
 *     cm384_engine_create(m, NULL, &e);              // NULL = default config
 *     cm384_sampling s; cm384_sampling_init(&s);     // greedy, 128 tokens
 *     cm384_generate(e, "ROMEO:", NULL, 0, &s, on_event, NULL);
 *     cm384_engine_free(e);
 *     cm384_model_free(m);
 *
 * Build: compile cm384.c (it includes the ggml_like/ sources: one translation
 * unit) and link with -lpthread -lm.  `cc -O3 -c cm384.c` builds everything
 * (at -O2 prefill runs 11-13% slower: README, Embedding).
 *
 * ---------------------------------------------------------------------------
 * OBJECTS
 *
 *   cm384_model   weights (memory-mapped, in their stored type), tokenizer and
 *                 chat template.  Immutable after load.
 *   cm384_engine  the emulated supernode built on one model: devices, the
 *                 shared pool (KV blocks, context-cache index, dispatch and
 *                 combine buffers), worker threads and the scheduler.
 *
 * THREADING AND OWNERSHIP
 *
 *   - A model is read-only after cm384_model_load(): any number of threads and
 *     engines may use it at once.  It must outlive every engine made from it.
 *   - cm384_submit(), cm384_cancel(), cm384_wait(), cm384_get_stats() and
 *     cm384_generate() may be called from any thread at the same time.
 *     cm384_eval() and cm384_engine_free() must not run concurrently with any
 *     other call on the same engine.
 *   - The engine owns its threads: the workers, and the loops of its peer
 *     subsystems (prefill, decode, and with cache_dir the caching loop); all
 *     are joined by cm384_engine_free().  Request callbacks run on a loop's
 *     thread -- the first token on prefill's, the rest on decode's, never two
 *     at once for one request -- except in cm384_generate(), which delivers
 *     every event on the calling thread.  A callback must not call
 *     cm384_engine_free() or cm384_wait(), nor the calls that pause the
 *     loops to read their state (cm384_get_stats, cm384_report,
 *     cm384_get_expert_load, cm384_get_device_busy, cm384_get_device_rows,
 *     cm384_device_roles, cm384_reset_stats): its loop is inside a step.
 *     It may call cm384_submit(), cm384_cancel() and
 *     cm384_fail_device[_at]().
 *   - Memory passed in (prompts, ids, configs) is copied before the call
 *     returns.  Memory passed out in events is valid only during the callback.
 *   - The library never prints, never calls exit() or abort() on bad input and
 *     installs no signal handlers.
 *
 * ERRORS
 *
 *   Every fallible call returns an int: CM384_OK (0) or a negative cm384_status.
 *   cm384_strerror(code) names the code; cm384_last_error() gives the detailed
 *   message of the calling thread's last failed call (which file, which tensor,
 *   what was expected), including a failed load.  Functions that return counts
 *   (cm384_tokenize, cm384_detokenize, cm384_chat_render) return a negative
 *   status on failure.
 *
 * STRUCTS
 *
 *   Option structs are passed by pointer, start with `size_t struct_size` and
 *   are filled with defaults by their *_init() function; fields are only ever
 *   appended.  Passing NULL means "all defaults".  Structs the library fills
 *   in (cm384_model_info, cm384_stats) have no init function: set struct_size
 *   to sizeof(the struct) before the call (0 also means the current size); a
 *   program built against an older, shorter struct gets only the fields it
 *   knows, and struct_size comes back as the bytes written.  Option structs
 *   are copied by the call they are passed to (a request's sampling options
 *   too): they may be reused or freed as soon as it returns.
 *
 * NUMERICS
 *
 *   Defaults are exact: with a NULL config (or cm384_config_init's values)
 *   the engine computes what DeepSeek's reference code computes, to fp32
 *   rounding, whatever the topology, batch, cache or timing.  Every
 *   approximation the paper makes is off by default, on in the "paper"
 *   preset, and has its own switch: int8 (W8A8 weights), int8_dispatch (INT8
 *   tokens to the expert devices).  cm384_report says which are on.
 * ---------------------------------------------------------------------------
 */
#ifndef CM384_H
#define CM384_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef CM384_API
#  if defined(__GNUC__) && defined(CM384_SHARED)
#    define CM384_API __attribute__((visibility("default")))
#  else
#    define CM384_API
#  endif
#endif

#define CM384_VERSION_MAJOR 0
#define CM384_VERSION_MINOR 1
#define CM384_VERSION_PATCH 0
CM384_API const char *cm384_version(void);

/* ======================================================================== */
/* Status codes (append-only; never renumbered)                            */
/* ======================================================================== */

enum cm384_status {
    CM384_OK            =  0,
    CM384_E_INVALID     = -1,  /* bad argument (NULL, out of range, unknown token id)   */
    CM384_E_NOMEM       = -2,  /* an allocation or a memory map failed                  */
    CM384_E_IO          = -3,  /* a file could not be opened or read                    */
    CM384_E_FORMAT      = -4,  /* a file is malformed: bad JSON, truncated shard, header
                                  past end of file, missing tensor, wrong shape         */
    CM384_E_UNSUPPORTED = -5,  /* well-formed but not supported: model_type, dtype      */
    CM384_E_CAPACITY    = -6,  /* does not fit: prompt longer than the context, pool    */
    CM384_E_CANCELLED   = -7,  /* stopped by a callback or cm384_cancel()               */
    CM384_E_MISUSE      = -8,  /* call not allowed in this state (e.g. engine on a
                                  tokenizer-only model)                                 */
    CM384_E_INTERNAL    = -9,  /* a bug: please report it                               */
    CM384_E_NOT_FOUND   = -10, /* no such request id                                    */
    CM384_E_TIMEOUT     = -11, /* cm384_wait: the request is still running              */
    CM384_E_DEVICE      = -12  /* faults left no device of a role a request needs
                                  (prefill, decode attention, experts): the one case
                                  where faults fail requests (cm384_fail_device)      */
};

/* Static name of a status code ("CM384_E_FORMAT: malformed file"). */
CM384_API const char *cm384_strerror(int status);

/* Detailed message of the calling thread's last failed call.  Never NULL
 * ("" if none).  Valid until the next failing call on this thread. */
CM384_API const char *cm384_last_error(void);

/* ======================================================================== */
/* 1. Loading a model                                                       */
/* ======================================================================== */

/* Progress of a long load: stage is "tensors" (binding the weights),
 * "check" (check_values' scan), "quantize" (making INT8 weights, with
 * int8 = 1); done and total count bytes of that stage.  Every stage ends
 * with a call where done == total.  Called on the loading thread.  Return
 * non-zero to cancel the load (cm384_model_load then returns
 * CM384_E_CANCELLED). */
typedef int (*cm384_progress_fn)(void *user, const char *stage,
                                 uint64_t done, uint64_t total);

typedef struct cm384_load_opts {
    size_t            struct_size;
    cm384_progress_fn progress;       /* NULL = no progress reports              */
    void             *progress_user;
    int               use_mmap;       /* 1 (default): map the files; 0: read them
                                         into memory advised for 2 MB pages
                                         (Linux THP): bf16 decode then streams
                                         its weights with fewer TLB misses, for
                                         a longer load (INT8 copies always get
                                         such a block)                           */
    int               check_values;   /* 1: scan weights for NaN/Inf (slow); 0   */
    int               int8;           /* 1: make the INT8 W8A8 weights during the
                                         load (stage "quantize", part of the
                                         load's time) for engines with int8 = 1;
                                         0 (default): the first such engine makes
                                         them, without progress                  */
    const char       *cache_dir;      /* with int8: the model cache's folder -- the
                                         INT8 weights are mapped (use_mmap) or
                                         read from it when it holds them for
                                         this model, else made and
                                         saved there (as cm384_config.cache_dir
                                         does for an engine).  NULL: none        */
} cm384_load_opts;

CM384_API void cm384_load_opts_init(cm384_load_opts *o);

typedef struct cm384_model cm384_model;

/* Load a model.  path is one of:
 *   - a Hugging Face model directory: config.json, model.safetensors or
 *     sharded model-*.safetensors with model.safetensors.index.json,
 *     tokenizer.json (+ tokenizer_config.json for the chat template);
 *   - a tokenizer.json file: a tokenizer-only model.  Tokenizing,
 *     detokenizing and chat rendering work; cm384_engine_create() fails
 *     with CM384_E_MISUSE.
 *   - a GGUF file (*.gguf) of llama.cpp's deepseek2 architecture (DeepSeek-V2,
 *     V2-Lite, V3, R1, Moonlight, Kimi-K2 as llama.cpp converts them), with
 *     its tokenizer and chat template; tensor types F32, F16, BF16, Q8_0,
 *     Q4_0, Q4_K, Q5_K, Q6_K, computed in their stored blocks.  A vocab-only
 *     GGUF is a tokenizer-only model.
 * Supported: model_type deepseek_v2 / deepseek_v3 (DeepSeek-V2, V2-Lite, V3,
 * R1, and V3-layout models such as Moonlight and Kimi-K2); tensor dtypes F32,
 * F16, BF16 and F8_E4M3 with 128x128 `weight_scale_inv` block scales.
 * Weights are memory-mapped and used in their stored type.
 * Errors: CM384_E_IO (cannot open/read), CM384_E_FORMAT (bad JSON, header
 * length past end of file, truncated shard, missing tensor, wrong shape),
 * CM384_E_UNSUPPORTED (model_type, dtype), CM384_E_NOMEM, CM384_E_CANCELLED.
 * On failure *out is NULL and cm384_last_error() names the file and problem. */
CM384_API int  cm384_model_load(const char *path, const cm384_load_opts *opts,
                                cm384_model **out);
CM384_API void cm384_model_free(cm384_model *m);         /* NULL is a no-op */

/* Write the model as a GGUF file that llama.cpp loads (architecture
 * deepseek2, as llama.cpp's own converter writes it: stacked experts,
 * kv_b_proj split into attn_k_b / attn_v_b, the tokenizer, the chat template
 * and the MTP layer).  type: "bf16" (NULL), "f16", "f32" or "q8_0" for the
 * matrices (norms, biases and the router stay F32; Q8_0 rows that are not
 * whole 32-value blocks are written F16, as the converter does).  Errors:
 * CM384_E_INVALID (type), CM384_E_MISUSE (tokenizer-only model),
 * CM384_E_UNSUPPORTED (a model GGUF cannot describe: moe_layer_freq > 1,
 * YaRN mscale != mscale_all_dim), CM384_E_IO. */
CM384_API int  cm384_model_save_gguf(const cm384_model *m, const char *path, const char *type);

/* What was loaded (all counts; 0 where not applicable). */
typedef struct cm384_model_info {
    size_t   struct_size;
    char     model_type[32];         /* "deepseek_v3", "deepseek_v2", "tokenizer" */
    int      vocab_size;             /* rows of the embedding (>= tokenizer ids)  */
    int      n_layers, n_dense_layers, n_mtp_layers;
    int      hidden_size, n_heads;
    int      q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int      n_routed_experts, n_shared_experts, n_experts_per_tok;
    int      max_position_embeddings;
    int      bos_id, eos_id;
    uint64_t n_params, n_active_params;  /* active = per token                   */
    uint64_t weight_bytes;               /* bytes of weights as stored            */
    char     weight_dtype[16];           /* dominant stored dtype, e.g. "BF16"    */
} cm384_model_info;
CM384_API int cm384_model_get_info(const cm384_model *m, cm384_model_info *out);

/* ======================================================================== */
/* 2. Tokenizer and chat format                                             */
/* ======================================================================== */

/* Number of token ids the model accepts (the embedding's rows; for a
 * tokenizer-only model, the tokenizer's id count). */
CM384_API int cm384_vocab_size(const cm384_model *m);
CM384_API int cm384_token_bos(const cm384_model *m);     /* -1 if none */
CM384_API int cm384_token_eos(const cm384_model *m);     /* -1 if none */

#define CM384_TOK_ADD_BOS     1u  /* prepend BOS (as transformers' encode() does)   */
#define CM384_TOK_NO_SPECIAL  2u  /* treat added/special token text as plain text   */

/* Tokenize len bytes of UTF-8 text.  flags 0 gives exactly Hugging Face's
 * encode(text, add_special_tokens=False): added tokens are matched anywhere,
 * then byte-level BPE with the model's pre-tokenizer.  Returns the number of
 * ids (which may exceed cap: only cap are written, call again with a bigger
 * buffer) or a negative status.  Invalid UTF-8 bytes are encoded as bytes. */
CM384_API int cm384_tokenize(const cm384_model *m, const char *text, size_t len,
                             int32_t *out, int cap, unsigned flags);

/* Decode ids to UTF-8 text (snprintf convention: returns the length of the
 * full text, writes at most cap-1 bytes plus a NUL when cap > 0).  Special
 * tokens are written as their text.  Returns CM384_E_INVALID for an id out of
 * range. */
CM384_API int cm384_detokenize(const cm384_model *m, const int32_t *ids, int n,
                               char *out, size_t cap);

/* The raw bytes of one token (not necessarily valid UTF-8 on its own: a token
 * can hold part of a character).  snprintf convention. */
CM384_API int cm384_token_text(const cm384_model *m, int32_t id, char *out, size_t cap);

/* 1 if id is an added token marked special (BOS, EOS, pad, ...), else 0. */
CM384_API int cm384_token_is_special(const cm384_model *m, int32_t id);

/* Streaming decode that never splits a UTF-8 code point: push ids one at a
 * time; each call returns the bytes that became complete.  Bytes of an
 * invalid sequence are flushed as U+FFFD once known to be invalid.  Zero-init
 * or cm384_detok_stream_init() before use. */
typedef struct cm384_detok_stream { unsigned char pending[8]; int n_pending; } cm384_detok_stream;
CM384_API void cm384_detok_stream_init(cm384_detok_stream *s);
/* Returns the number of bytes written to out (at most cap), or a negative
 * status.  cap = 3 + 3 x the longest token always suffices (387 bytes for
 * DeepSeek-V3, whose longest token is 128 spaces; 512 for every tokenizer we
 * know); a smaller cap that cannot hold the output returns CM384_E_CAPACITY
 * and changes nothing. */
CM384_API int  cm384_detok_stream_push(const cm384_model *m, cm384_detok_stream *s,
                                       int32_t id, char *out, size_t cap);
/* Flushes any incomplete tail as U+FFFD. */
CM384_API int  cm384_detok_stream_flush(cm384_detok_stream *s, char *out, size_t cap);

/* A chat message.  role is "system", "user", "assistant" or "tool".  An
 * assistant message may carry tool calls (and a NULL content). */
typedef struct cm384_tool_call {
    const char *type;        /* "function" */
    const char *name;
    const char *arguments;   /* JSON text, written as is */
} cm384_tool_call;

typedef struct cm384_chat_msg {
    const char            *role;
    const char            *content;       /* may be NULL for an assistant tool call */
    const cm384_tool_call *tool_calls;
    int                    n_tool_calls;
} cm384_chat_msg;

#define CM384_CHAT_ADD_GENERATION_PROMPT 1u   /* end with the assistant prefix */

/* Render a conversation in the model's chat format, BOS written as text.
 * The format is recognised from the model's template text
 * (tokenizer_config.json's chat_template, or a GGUF's
 * tokenizer.chat_template) and reproduced exactly, as Hugging Face's
 * apply_chat_template renders it.  A model whose template is missing or not
 * one of the formats below fails with CM384_E_UNSUPPORTED (never a silent
 * fallback): pick a format with cm384_chat_render_format().
 * Tokenize the result with flags 0.  snprintf convention. */
CM384_API int cm384_chat_render(const cm384_model *m, const cm384_chat_msg *msgs, int n,
                                unsigned flags, char *out, size_t cap);

/* Chat formats (append-only). */
enum cm384_chat_format {
    CM384_CHAT_MODEL            = 0,  /* the one recognised from the model's template */
    CM384_CHAT_DEEPSEEK_V2      = 1,  /* V2-Chat, V2-Lite-Chat: "User: ...\n\nAssistant:" */
    CM384_CHAT_DEEPSEEK_V2_0628 = 2,  /* V2-Chat-0628: <｜User｜>, <｜Assistant｜>          */
    CM384_CHAT_DEEPSEEK_V25     = 3,  /* V2.5: last system prompt, tool calls           */
    CM384_CHAT_DEEPSEEK_V3      = 4,  /* V3: system prompts joined, tool calls          */
    CM384_CHAT_DEEPSEEK_R1      = 5   /* R1: reasoning stripped from history, the
                                         generation prompt opens "<think>\n"            */
};
/* cm384_chat_render with an explicit format (CM384_CHAT_MODEL = the model's). */
CM384_API int cm384_chat_render_format(const cm384_model *m, int format, const cm384_chat_msg *msgs,
                                       int n, unsigned flags, char *out, size_t cap);
/* The model's format (> 0), or CM384_E_NOT_FOUND (no template) or
 * CM384_E_UNSUPPORTED (a template cm384 does not know). */
CM384_API int cm384_chat_format(const cm384_model *m);
/* The format of a template's Jinja text (len 0 = strlen), or
 * CM384_E_UNSUPPORTED. */
CM384_API int cm384_chat_template_format(const char *tpl, size_t len);
/* "deepseek-v3", ...; "" for an unknown format. */
CM384_API const char *cm384_chat_format_name(int format);

/* ======================================================================== */
/* 3. The engine: an emulated supernode                                     */
/* ======================================================================== */

typedef void (*cm384_log_fn)(void *user, int level, const char *msg);

/* Every field: 0 means its default (as listed); a negative value or one
 * outside the range given is refused by cm384_engine_create with
 * CM384_E_INVALID and a message naming the field. */
typedef struct cm384_config {
    size_t       struct_size;
    /* topology */
    int          n_devices;        /* emulated devices, 1..4096 (0 = 384)            */
    int          n_workers;        /* OS threads running them, 1..1024 (0 = online
                                      cores); n_workers == n_devices: one thread per
                                      device, each device's work on its own thread  */
    const char  *preset;           /* "default" (fastest on this host), "paper"
                                      (CloudMatrix-Infer's layout scaled to the
                                      model) or "single" (everything on device 0);
                                      NULL = "default"                              */
    /* capacity */
    int          max_ctx;          /* tokens per request, prompt + output, 2 .. the
                                      model's max positions (0 = min(that, 4096))    */
    int          max_batch;        /* concurrent requests, 1..4096 (0 = 64)          */
    int          kv_block_tokens;  /* tokens per KV block, 1..4096 (0 = 16)          */
    size_t       kv_pool_bytes;    /* KV block pool (0 = enough for max_batch
                                      requests of max_ctx tokens, at most 1 GiB);
                                      must hold one request of max_ctx tokens       */
    size_t       cache_bytes;      /* context-cache budget inside the pool
                                      (0 = half the pool; (size_t)-1 = off)          */
    int          prefill_chunk;    /* max prompt tokens per prefill step, 1..65536
                                      (0 = 512; never above max_batch x max_ctx)     */
    /* mechanisms, each switchable */
    int          int8;             /* 1: W8A8 -- weights int8 per output channel
                                      (made once per model, shared by its engines),
                                      activations int8 per token, int32 sums; the
                                      router, norms, softmax and attention core stay
                                      fp32 (an approximation).  0 (default): weights
                                      in their stored type                          */
    int          int8_dispatch;    /* 1: quantize tokens to INT8 (per-token scale)
                                      before dispatch to expert devices, as the
                                      paper does (an approximation); 0: fp32, exact.
                                      -1 (cm384_config_init's value) = the preset's
                                      choice: on in "paper", off otherwise           */
    int          microbatches;     /* 2: one microbatch's attention shares each
                                      parallel region with the other's MoE; 1: one
                                      batch.  0 (default) = 2 in the paper preset, 1
                                      otherwise: on a CPU, two microbatches read the
                                      weights twice per step, which memory-bound
                                      decode pays for.  Same results either way      */
    int          mtp;              /* 1: speculative decoding with the MTP layer
                                      when the model has one (same tokens),
                                      drafting while it pays: while (1 + the
                                      acceptance) x a plain step's time beats
                                      a drafting step's (measured; retried
                                      after 16 steps, then less often); 2:
                                      draft every step;
                                      0 (default): off                               */
    double       tpot_target_ms;   /* SLO: the decode batch is the largest whose p99
                                      time per output token stays under this, learnt
                                      from measured step times (per batch size and
                                      context; prefill interference and MTP's extra
                                      tokens included).  Finite and >= 0 (0 = no
                                      target).  A target one request cannot meet is
                                      reported (stats, log), not silently missed     */
    /* observability */
    const char  *trace_path;       /* write a Chrome-trace JSON here (NULL = off):
                                      a track per device (events carry layer,
                                      microbatch, the peer step they ran in:
                                      "peer", "step", and their stage: "op", e.g.
                                      "q_b", "core", "down") and one per peer loop
                                      (its numbered "prefill step" / "decode step"
                                      spans) */
    cm384_log_fn log;              /* topology and memory estimate at creation (a
                                      warning when it exceeds physical memory),
                                      preemptions, expert re-placement (level 1
                                      info, 2 warning); called on the creating
                                      thread or one of the engine's loops.
                                      NULL = silent                                  */
    void        *log_user;
    /* appended fields */
    int          eplb_period;      /* decode steps between EPLB re-placements of the
                                      routed experts, from decode load, where the
                                      preset has redundant slots (paper; default
                                      with >= 16 experts); 0 = 32, -1 = never (the
                                      first, even placement stays)                   */
    const char  *kernels;          /* kernel set by name (NULL = the best this CPU
                                      runs, exact); "avx512_bf16": bf16 weights
                                      times activations rounded to bf16 (AVX512_BF16
                                      vdpbf16ps) and, with kv_bf16, the attention
                                      core's bf16 keys times queries and softmax
                                      weights rounded to bf16 -- an approximation,
                                      up to 2^-8 relative per product (bench-M INT8
                                      prefill about 1.2x with kv_bf16; the same
                                      bits prefilled or decoded).  CM384_E_INVALID
                                      if this CPU cannot run the set                 */
    int          bf16_combine;     /* expert outputs travel back to the source in
                                      BF16 (as CloudMatrix-Infer's FusedCombine
                                      does): half the combine bytes, outputs
                                      rounded to 8 bits of mantissa.  0 (default):
                                      on in the paper preset, off otherwise (exact);
                                      1: on; -1: off                                 */
    int          time_shared;      /* 1: one loop runs a prefill step, then a decode
                                      step, in turn (the scheduler before the peers,
                                      kept to compare against).  0 (default):
                                      prefill and decode run as peers, each its own
                                      loop, decode first in the worker pool (see
                                      prefill_share).  One thread per device always
                                      uses one loop                                  */
    const char  *cache_dir;        /* a folder for the context cache's disk tier
                                      (made if missing): blocks the cache indexes
                                      are written there by the caching loop and
                                      found again by later engines and processes on
                                      the same model and numerics.  NULL (default):
                                      memory only                                    */
    int          kv_bf16;          /* 1: the latent KV cache holds bf16, rounded
                                      from fp32 -- half the bytes a token takes, so
                                      twice the context fits the same pool and
                                      context cache; an approximation (its effect
                                      on logits: docs/how-it-works.md, section 10).
                                      The attention core reads the bf16 keys as
                                      they are, widened to fp32 exactly in its
                                      kernels (natively with kernels =
                                      "avx512_bf16"): at long context decode is
                                      faster (half the bytes).  0 (default):
                                      fp32, exact                                    */
    int          prefill_expanded; /* 1: prefill attends as DeepSeek's "naive" MLA:
                                      each chunk of cached latents is expanded to
                                      per-head K and V (W_uk, W_uv) and the queries
                                      attend with head dimension 192 (values 128)
                                      instead of 576 (512) -- a third of the core's
                                      work, so long prompts prefill much faster.
                                      The same model, but other rounding than the
                                      absorbed form decode uses: a token's logits
                                      then depend (in the last bits) on whether it
                                      was prefilled or decoded, so recomputed or
                                      cached tokens may differ.  Models whose
                                      kv_b_proj is fp8 or split (or whose
                                      kv_lora_rank is below qk_nope_head_dim)
                                      attend absorbed.  Every prefill step
                                      expands all of its sequence's keys, so a
                                      short prompt after a long cached prefix
                                      is slower than absorbed (bf16: ~3x).
                                      0 (default): absorbed everywhere, exact and
                                      the same bits in every path                   */
    double       prefill_share;    /* peers: the share of the workers' time prefill
                                      gets while both peers have work, (0, 0.9]:
                                      after each step decode lends its loop's
                                      thread to prefill's tasks for share /
                                      (1 - share) times that step's time (with a
                                      TPOT target, at most the target's slack).
                                      Prompts arriving together reach the decode
                                      batch sooner (at 0.5 on bench-M INT8: 16 at
                                      once +23-47% tok/s; 4 at a time, TTFT p50
                                      halved), at the cost of TPOT meanwhile.  0 (default): decode
                                      first -- prefill gets what decode leaves:
                                      the shortest TPOT, prompts slow beside a
                                      busy decode.  Scheduling only: never changes
                                      a request's tokens                           */
    int          prefault;         /* 1: the engine touches every page of its pool
                                      (KV blocks, scratch) and maps the model's
                                      token embedding at creation, so no step
                                      pays a first-touch page fault: the first
                                      prompts of a fresh engine run at the speed
                                      of later ones (measured: make bench, section
                                      3e), and the process holds the whole pool
                                      from the start, as llama.cpp holds its KV
                                      cache.  0 (default): pages are touched when
                                      first used                                    */
    int          profile;          /* 1: the engine keeps, per peer and stage, the
                                      time its parallel regions spent in it
                                      (cm384_get_profile: where a step's time
                                      goes, without a trace file).  Costs two
                                      atomic updates a task and a lock a region:
                                      nothing measurable on bench-M, ~4% of
                                      decode on the trained model's 0.2 ms
                                      steps.  Tokens do not depend on it.
                                      0 (default): off                             */
} cm384_config;

CM384_API void cm384_config_init(cm384_config *c);

typedef struct cm384_engine cm384_engine;

/* Build an engine on a model: devices, the pool and worker threads.  The
 * model must outlive the engine.  Errors: CM384_E_MISUSE (tokenizer-only
 * model), CM384_E_INVALID (bad config), CM384_E_NOMEM. */
CM384_API int  cm384_engine_create(const cm384_model *m, const cm384_config *cfg,
                                   cm384_engine **out);
/* Cancels what is still running (each request gets its final event), joins
 * the threads and frees the engine.  NULL is a no-op. */
CM384_API void cm384_engine_free(cm384_engine *e);

/* Evaluate a fresh sequence of n ids (nothing cached, nothing kept).  The
 * ids are taken as they are: begin them with cm384_token_bos() for what the
 * model saw in training (text requests get BOS added; cm384_tokenize adds it
 * with CM384_TOK_ADD_BOS).  Ids outside [0, vocab) fail with CM384_E_INVALID.
 * logits: n x vocab floats; row i predicts token i+1.  mtp_logits (may be
 * NULL; needs a model with an MTP layer and n >= 2): (n-1) x vocab, row i
 * predicts token i+2 from the main model's hidden state at i and ids[i+1].
 * Must not run concurrently with other calls on the engine. */
CM384_API int cm384_eval(cm384_engine *e, const int32_t *ids, int n,
                         float *logits, float *mtp_logits);

/* ======================================================================== */
/* 4. Requests: sampling, events, submit / cancel / wait                    */
/* ======================================================================== */

/* Sampling options.  cm384_submit refuses a value outside its range with
 * CM384_E_INVALID and a message naming the field. */
typedef struct cm384_sampling {
    size_t   struct_size;
    float    temperature;    /* finite, >= 0; 0 (default) = greedy            */
    int      top_k;          /* >= 0; 0 = off                                 */
    float    top_p;          /* [0, 1]; 1 (default) or 0 = off                */
    float    min_p;          /* [0, 1]; 0 = off                               */
    uint64_t seed;           /* same seed, same tokens (default 0)            */
    int      max_tokens;     /* tokens to generate, >= 1 (default 128)        */
    int      ignore_eos;     /* non-zero: do not stop at EOS                  */
} cm384_sampling;

CM384_API void cm384_sampling_init(cm384_sampling *s);

enum cm384_event_kind {
    CM384_EV_TOKEN     = 1,  /* one generated token (text may be empty while a
                                UTF-8 code point is incomplete)               */
    CM384_EV_DONE      = 2,  /* final: finished (max_tokens, EOS or max_ctx)  */
    CM384_EV_CANCELLED = 3,  /* final: cancelled                              */
    CM384_EV_ERROR     = 4   /* final: failed after it was queued (status says
                                why: CM384_E_INTERNAL when an engine invariant
                                broke; nothing it computed is delivered)      */
};

/* A final event may carry text too: the tail of an incomplete UTF-8
 * character left by the last token, flushed as U+FFFD. */

typedef struct cm384_event {
    size_t      struct_size;
    uint64_t    id;           /* request id                                     */
    int         kind;         /* cm384_event_kind                               */
    int32_t     token;        /* CM384_EV_TOKEN: the token id                   */
    const char *text;         /* its UTF-8 text (never splits a code point)     */
    size_t      text_len;
    int         status;       /* final events: CM384_OK or the error            */
    int         n_prompt;     /* prompt tokens                                  */
    int         n_cached;     /* prompt tokens served by the context cache      */
    int         n_generated;  /* tokens generated so far                        */
    double      ttft_ms;      /* time to first token (final events)             */
    double      tpot_ms;      /* mean time per output token after the first     */
} cm384_event;

/* Return non-zero to cancel the request (it then gets CM384_EV_CANCELLED). */
typedef int (*cm384_event_fn)(void *user, const cm384_event *ev);

typedef struct cm384_request {
    size_t                struct_size;
    const char           *text;      /* prompt as UTF-8 text (tokenized with BOS)   */
    size_t                text_len;  /* 0 = strlen(text)                            */
    const int32_t        *ids;       /* or the prompt as ids (used when text NULL)  */
    int                   n_ids;
    const cm384_sampling *sampling;  /* NULL = defaults                             */
    uint32_t              tenant;    /* context-cache namespace (default 0)         */
    cm384_event_fn        on_event;  /* may be NULL                                 */
    void                 *user;
} cm384_request;

CM384_API void cm384_request_init(cm384_request *r);

/* Queue a request; returns at once.  *id_out (may be NULL) gets its id.  The
 * request then ends with exactly one final event.  A request that cannot run
 * (prompt longer than the context, a token id outside the embedding -- also
 * one the tokenizer produced from text --, a sampling value out of range) is
 * not queued: the call fails with CM384_E_CAPACITY / CM384_E_INVALID and no
 * event is sent.  The request and its sampling options are copied. */
CM384_API int cm384_submit(cm384_engine *e, const cm384_request *r, uint64_t *id_out);

/* Ask a request to stop; its final event is CM384_EV_CANCELLED.  Returns
 * CM384_E_NOT_FOUND if the id is unknown or already finished. */
CM384_API int cm384_cancel(cm384_engine *e, uint64_t id);

/* Wait until the request has finished (timeout_ms < 0: forever) and return its
 * final status (CM384_OK, CM384_E_CANCELLED, ...), or CM384_E_NOT_FOUND, or
 * CM384_E_TIMEOUT if it is still running after timeout_ms.  Any thread may
 * wait; the result is kept until the first successful cm384_wait() (of
 * requests nobody waits for, the last 65536 results are kept). */
CM384_API int cm384_wait(cm384_engine *e, uint64_t id, int timeout_ms);

/* Wait until no request is queued or running. */
CM384_API int cm384_wait_all(cm384_engine *e);

/* Generate from a prompt (text, or ids when text is NULL) and deliver every
 * event to fn on the calling thread; returns the final status. */
CM384_API int cm384_generate(cm384_engine *e, const char *text, const int32_t *ids, int n_ids,
                             const cm384_sampling *s, cm384_event_fn fn, void *user);

/* ======================================================================== */
/* 5. Observability                                                         */
/* ======================================================================== */

typedef struct cm384_stats {
    size_t   struct_size;
    /* requests and tokens */
    uint64_t requests_submitted, requests_done, requests_cancelled, requests_failed;
    uint64_t requests_preempted;
    uint64_t tokens_prefilled;        /* prompt tokens computed                   */
    uint64_t tokens_cached;           /* prompt tokens served by the context cache */
    uint64_t tokens_decoded;          /* tokens generated                          */
    uint64_t mtp_drafted, mtp_accepted;
    double   cache_hit_ratio;         /* tokens_cached / prompt tokens             */
    /* latency and throughput */
    double   ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms;
    double   prefill_tok_per_s, decode_tok_per_s;   /* over busy time            */
    double   prefill_seconds, decode_seconds;
    /* fabric */
    uint64_t dispatch_bytes, combine_bytes;         /* written across the UB plane  */
    uint64_t dispatch_bytes_bf16, combine_bytes_bf16; /* what bf16 would have sent */
    uint64_t kv_handoff_bytes;        /* prefill -> decode KV (RDMA plane)          */
    uint64_t messages;
    /* pool */
    uint64_t pool_bytes, kv_blocks_total, kv_blocks_used, kv_blocks_cached;
    uint64_t cache_evictions;
    /* placement */
    int      n_devices, n_workers, n_prefill_devices, n_attn_devices, n_expert_devices;
    double   expert_load_max_over_mean;   /* decode's expert imbalance: over the
                                             layers, the busiest routed-expert
                                             device's rows over the mean device's
                                             (a layer waits for its busiest; 1 =
                                             even)                                   */
    /* the SLO controller (tpot_target_ms) */
    int      decode_batch_cap;        /* the decode batch it allows now (max_batch
                                         without a target)                         */
    int      slo_infeasible;          /* 1: even one request alone misses the target */
    /* EPLB (decode's redundant experts, re-placed from decode load) */
    int      n_redundant_experts;     /* spare expert slots: 0 = no EPLB            */
    uint64_t eplb_runs;               /* re-placements so far                       */
    double   eplb_load_before, eplb_load_after;   /* the last one: the imbalance
                                         (as expert_load_max_over_mean) of its
                                         window under the old and new placement      */
    uint64_t eplb_moved_bytes;        /* expert weights a real supernode would copy  */
    /* memory, estimated at engine creation: what is resident once all of it
       has been used.  A total above physical memory is logged (level 2). */
    uint64_t mem_weight_bytes;        /* weights as used: stored bytes, or with
                                         int8 the INT8 copies plus what stays in
                                         its stored type (embedding, routers);
                                         plus the model's own allocations (fp32
                                         vectors, derived W_uk^T, headers)        */
    uint64_t mem_int8_weight_bytes;   /* the same with int8 = 1 (what INT8 needs) */
    uint64_t mem_kv_bytes;            /* the KV block pool                        */
    uint64_t mem_scratch_bytes;       /* the rest of the pool, counters, trace    */
    uint64_t mem_total_bytes;         /* weights + KV + scratch                   */
    uint64_t mem_physical_bytes;      /* this machine's physical memory (0:
                                         unknown)                                 */
    /* weights streamed: bytes of every matrix the steps' products read, each
       product counting its matrix once (a decode step over a batch reads each
       distinct expert it routes to once): with the machine's read bandwidth,
       the ceiling a phase's speed is held to */
    uint64_t prefill_weight_bytes, decode_weight_bytes;
    /* the fabric, the peers, the caching subsystem */
    uint64_t local_bytes;             /* dispatch/combine rows a device wrote to
                                         itself: local memory, not fabric         */
    uint64_t prefill_steps, decode_steps;
    uint64_t decode_steps_in_prefill; /* decode steps that ran while a prefill
                                         step was computing (0 when time-shared) */
    /* the context cache by tier, in blocks looked up at admission */
    uint64_t cache_hits_pool;         /* found in memory (shared in place)        */
    uint64_t cache_hits_disk;         /* loaded from cache_dir                    */
    uint64_t cache_misses;            /* in neither: computed                     */
    uint64_t cache_bytes_loaded;      /* disk -> KV blocks                        */
    uint64_t cache_bytes_saved;       /* KV blocks -> disk                        */
    uint64_t cache_blocks_saved;
    uint64_t cache_files_ignored;     /* damaged or foreign files not trusted     */
    int      n_caching_devices, n_idle_devices;
    /* faults (cm384_fail_device) and what recovering from them took */
    uint64_t n_faults;                /* faults that hit (devices and links)       */
    int      n_failed_devices;        /* devices dead now                          */
    uint64_t requests_readmitted;     /* requests whose KV a fault took: recomputed */
    uint64_t tokens_recomputed;       /* their tokens computed again (the prefix
                                         found in the context cache is not)        */
    uint64_t experts_replaced;        /* expert placements re-made from the
                                         weights (no replica survived)             */
    uint64_t experts_failed_over;     /* a surviving replica took the load         */
    uint64_t messages_retried;        /* dispatch messages a link dropped, resent  */
    double   fault_recovery_ms_max;   /* the slowest recovery: fault -> every
                                         request it hit back where it was          */
    /* the peers sharing the workers (prefill_share) */
    double   prefill_lent_seconds;    /* time decode's loop lent its thread to
                                         prefill between decode steps              */
    uint64_t prefill_lent_tasks;      /* prefill tasks it ran then                 */
    /* decode steps that ran alone: no prefill step computed beside them from
       start to end, so their speed is decode's own rather than a share of
       the workers -- with many streams, the steady state */
    uint64_t decode_alone_steps, decode_alone_tokens;
    uint64_t decode_alone_weight_bytes;   /* as decode_weight_bytes, over them */
    double   decode_alone_seconds;
    /* decode's roofline.  A product of b bytes of weights over n rows
       (tokens) does m = n x (its weights' values) multiply-adds, and no
       machine runs it faster than max(b / read bandwidth, 2 m / peak), the
       peak being INT8's for INT8 weights and the FP32 FMA rate for the
       others (they widen to fp32); the attention core's fp32 flops take at
       least flops / FP32 peak.  The sum is the fastest decode's steps could
       go on a machine with those limits -- with many streams, faster than
       their weight bytes alone allow only while every product is bound by
       memory.  [i]: products over i + 1 rows (the last: CM384_ROOF_ROWS or
       more), every product counted, the absorbed per-head ones too. */
#define CM384_ROOF_ROWS 32
    uint64_t decode_roof_bytes[CM384_ROOF_ROWS];
    uint64_t decode_roof_macs[CM384_ROOF_ROWS];
    uint64_t decode_roof_core_flops;
} cm384_stats;

CM384_API int  cm384_get_stats(cm384_engine *e, cm384_stats *out);
CM384_API void cm384_reset_stats(cm384_engine *e);

/* Write a human-readable report (stats, traffic matrix summary, expert-load
 * table) into buf (snprintf convention). */
CM384_API int  cm384_report(cm384_engine *e, char *buf, size_t cap);

/* The stage profile (config.profile = 1): for each peer (phase) and stage
 * of a layer operation -- name is the operation ("attention", "experts",
 * "head", ...), op the stage within it ("q_b", "core", "down", ...), both
 * static strings, the same as a trace's events -- the time from the first
 * task's start to the last task's end, summed over every parallel region
 * that ran it (each microbatch's stages apart), and how many regions did.
 * Stages run one after another within a peer's step, so with one
 * microbatch a phase's stage times add up to a little under its busy time
 * (cm384_stats prefill_seconds / decode_seconds: the rest is the steps' own
 * bookkeeping and the hand-overs between regions); with two, one
 * microbatch's attention overlaps the other's MoE.  Entries are in the
 * order stages first ran.  Returns how many entries there are (writing up
 * to cap of them; out may be NULL when cap is 0), or CM384_E_INVALID (NULL
 * engine, cap < 0) or CM384_E_MISUSE (the engine was created without
 * config.profile).  cm384_reset_stats clears it.  Thread-safe. */
enum { CM384_PHASE_PREFILL = 0, CM384_PHASE_DECODE = 1 };
typedef struct cm384_stage_time {
    int         phase;       /* CM384_PHASE_PREFILL or CM384_PHASE_DECODE      */
    const char *name, *op;
    double      seconds;
    uint64_t    regions;
} cm384_stage_time;
CM384_API int  cm384_get_profile(cm384_engine *e, cm384_stage_time *out, int cap);

/* The fabric's traffic matrix on the UB plane: bytes[src * n + dst] is what
 * device src wrote into device dst's buffers (dispatch and combine
 * messages; a device writing to itself is not counted).  Writes at most cap
 * entries; returns n, the number of devices. */
CM384_API int  cm384_get_traffic(cm384_engine *e, uint64_t *bytes, int cap);

/* The same for any of the three planes: CM384_PLANE_UB (dispatch, combine),
 * CM384_PLANE_RDMA (the prefill -> decode KV hand-off) and CM384_PLANE_POOL
 * (context-cache loads and saves between devices and the caching devices). */
enum { CM384_PLANE_UB = 0, CM384_PLANE_RDMA = 1, CM384_PLANE_POOL = 2 };
CM384_API int  cm384_get_plane_traffic(cm384_engine *e, int plane, uint64_t *bytes, int cap);

/* Tokens routed to each routed expert of a layer (layer -1: summed over all
 * layers).  Writes at most cap entries; returns the number of experts. */
CM384_API int  cm384_get_expert_load(cm384_engine *e, int layer, uint64_t *tokens, int cap);

/* Milliseconds each device's tasks have run.  Writes at most cap entries;
 * returns the number of devices. */
CM384_API int  cm384_get_device_busy(cm384_engine *e, double *busy_ms, int cap);

/* Expert rows (token copies) each device computed: phase 0 prefill, 1 decode,
 * -1 both.  EPLB evens decode's.  Writes at most cap entries; returns the
 * number of devices. */
CM384_API int  cm384_get_device_rows(cm384_engine *e, int phase, uint64_t *rows, int cap);

/* ---- faults ----
 * A device of the emulated supernode can be failed while the engine runs, as
 * a real one fails: the engine senses it at the next step boundary and
 * recovers on its own.  What each role loses and how it comes back:
 *   expert device    its experts are served by a surviving replica, or
 *                    re-placed onto the surviving expert devices from the
 *                    weights (every device reads them in the shared pool,
 *                    the paper's model cache); EPLB then evens the load.
 *   decode attention its requests lose their KV and are re-admitted: the
 *                    prefix comes back from the context cache where it is
 *                    there, the rest is recomputed by prefill.
 *   prefill device   its queue and its half-computed prompts move to the
 *                    other prefill devices (the half computed is redone).
 *   caching device   the context cache it held is lost: lookups miss until
 *                    another idle device has filled it again.
 * CM384_FAULT_LINK is transient: the device's link drops one step's
 * dispatch messages; receivers find the rows that did not arrive and the
 * senders write them again.
 * What holds: no request is lost, and every request's tokens are those of a
 * run without faults (greedy and seeded sampling alike).  Only when no
 * device of a needed role survives (prefill, decode attention, or experts)
 * do the pending requests end with CM384_EV_ERROR and CM384_E_DEVICE, and
 * later submissions are refused with it.  Each fault and its recovery are
 * logged (info level), traced (on the device's track) and counted (stats,
 * cm384_get_faults).  Thread-safe. */
enum { CM384_FAULT_DEVICE = 0, CM384_FAULT_LINK = 1 };

/* Fails `device` now (before the engine's next step).  CM384_E_INVALID for
 * a bad device or kind, CM384_E_MISUSE for a device already dead. */
CM384_API int  cm384_fail_device(cm384_engine *e, int device, int kind);

/* The same, once the engine has run `step` steps (prefill steps plus decode
 * steps, as cm384_stats counts them): a fault at a reproducible point of a
 * run.  A fault whose step never comes never happens. */
CM384_API int  cm384_fail_device_at(cm384_engine *e, int device, int kind, uint64_t step);

typedef struct cm384_fault_info {
    size_t   struct_size;         /* sizeof(cm384_fault_info)                     */
    int      device, kind;        /* CM384_FAULT_*                                */
    char     roles[48];           /* what the device was (cm384_device_roles)     */
    uint64_t step;                /* engine steps run when it hit                 */
    int      requests_readmitted; /* requests that lost KV or a queue place       */
    uint64_t tokens_recomputed;
    int      experts_replaced;    /* re-placed from the weights                   */
    int      experts_failed_over; /* left to a surviving replica                  */
    uint64_t messages_retried;    /* a link's dropped messages, sent again        */
    double   recovery_ms;         /* fault -> every request it hit back where it
                                     was (-1: still recovering)                   */
    int      fatal;               /* a needed role had no device left             */
} cm384_fault_info;

/* The faults so far, oldest first: fills up to cap records (each honouring
 * its struct_size) and returns how many there were. */
CM384_API int  cm384_get_faults(cm384_engine *e, cm384_fault_info *out, int cap);

/* A device's roles: "prefill", "attention", "expert", "shared", combinations
 * joined by '+', or "idle".  Static string; "" for a bad device. */
CM384_API const char *cm384_device_roles(cm384_engine *e, int device);

/* ======================================================================== */
/* 6. Projection: a run on the real supernode                               */
/* ======================================================================== */
/* A performance model of CloudMatrix384 (and of H800s, the paper's point of
 * comparison) that replays the engine's own schedule at full scale: the same
 * operator sequence and microbatch pairing, the same expert placement (the
 * paper preset built for the projected model), the same message sizes, and
 * optionally the expert load measured on a real run.  Every operator's time
 * comes from the hardware: a roofline with the paper's operator-level
 * efficiencies.  Parameters are hardware specifications and operator-level
 * measurements only, each listed with its source by cm384_hw_param(); the
 * paper's end-to-end tables are never inputs (tests/test_project.c checks
 * against them).  docs/how-it-works.md explains how to read the result. */

/* One device of a machine (an Ascend 910C die, an H800 GPU). */
typedef struct cm384_hw {
    size_t struct_size;
    char   name[32];
    double dies_per_npu;        /* devices per package: the paper's "per NPU"
                                   figures are per 2 dies                      */
    double bf16_tflops;         /* dense 16-bit peak per device               */
    double int8_tops;           /* dense 8-bit peak (INT8; FP8 on H800)       */
    double hbm_gb, hbm_gbs;     /* memory capacity and bandwidth              */
    double link_gbs;            /* scale-up fabric per device, one direction  */
    double link_us;             /* small-message latency on it                */
    double rdma_gbs;            /* scale-out (prefill -> decode KV)           */
    double pool_gbs;            /* device <-> pooled CPU memory (EMS)         */
    double cube_cores;          /* matrix cores (AIC)                         */
    double attn_cube_cores;     /* of them, the attention stream's when two
                                   decode microbatches overlap (0: no split --
                                   compute serializes, only the fabric overlaps) */
    double gemm_eff;            /* 8-bit GEMM, fraction of peak (compute-bound) */
    double mla_flop_eff;        /* attention core, fraction of the 16-bit peak  */
    double mla_bw_eff;          /* memory-bound kernels, fraction of HBM bw     */
    double a2a_tokens, a2a_topk;             /* the dispatch/combine measurement: */
    double a2a_dispatch_bytes, a2a_combine_bytes;   /* tokens per rank, top-k,    */
    double a2a_ep_lo, a2a_ep_hi;             /* message bytes, EP degrees,       */
    double dispatch_us_lo, dispatch_us_hi;   /* measured latencies               */
    double combine_us_lo, combine_us_hi;
    double graph_gap_ms;        /* host bubble per graph launch without graph
                                   bundling (MTP's k+1 graphs)                 */
    double kv_bytes;            /* bytes per KV-cache value                   */
} cm384_hw;

/* Fills *out with a built-in profile: "cloudmatrix384" (one Ascend 910C die)
 * or "h800" (set out->struct_size first, as for cm384_stats).
 * CM384_E_INVALID for another name. */
CM384_API int cm384_hw_get(const char *name, cm384_hw *out);

/* Row i of the parameter table behind the profiles (and the deployment
 * constants): profile, key, value, unit and source.  Returns the number of
 * rows; CM384_E_INVALID when i is out of range (pointers may be NULL). */
CM384_API int cm384_hw_param(int i, const char **profile, const char **key, double *value,
                             const char **unit, const char **source);

/* A model from its config.json alone (path: the file or its directory): the
 * shapes, no weights -- enough to project DeepSeek-R1's 671B without the
 * weights.  cm384_model_get_info() works (parameter counts from the shapes);
 * cm384_engine_create() fails with CM384_E_MISUSE. */
CM384_API int cm384_model_load_config(const char *path, cm384_model **out);

typedef struct cm384_proj_opts {
    size_t          struct_size;
    const char     *hw;             /* profile name (default "cloudmatrix384") */
    const cm384_hw *hw_params;      /* or your own numbers; NULL = the profile */
    /* workload */
    int             prompt, output; /* tokens per request (4096, 256)          */
    int             batch;          /* decode requests per NPU; 0 = the largest
                                       multiple of 8 up to max_batch whose TPOT
                                       meets tpot_slo_ms                        */
    int             max_batch;      /* 128                                     */
    double          tpot_slo_ms;    /* 50                                      */
    double          mtp_accept;     /* MTP draft acceptance (0.7)              */
    double          cache_reuse;    /* prompt fraction served by the context
                                       cache (0)                               */
    int             prefill_tokens; /* prompt tokens per NPU per prefill batch
                                       (16384)                                 */
    /* mechanisms: 1 = as in the paper (the defaults), 0 = off */
    int             int8;           /* W8A8 weights (else BF16)               */
    int             int8_dispatch;  /* INT8 token messages (else the engine's
                                       fp32 messages)                          */
    int             bf16_combine;   /* BF16 combine messages (else fp32)       */
    int             microbatches;   /* 2: attention of one beside MoE of the
                                       other; 1: one batch                    */
    int             mtp;            /* one-token MTP drafts                    */
    int             eplb;           /* redundant experts on the hottest ones   */
    int             graph_bundling; /* MTP graphs launched back to back        */
    int             prefill_expanded; /* 0: absorbed MLA in prefill, as the
                                       engine computes it; 1: the expanded form */
    /* expert load measured on a run: tokens[layer * load_experts + expert]
       for load_layers MoE layers (cm384_get_expert_load); NULL = perfect
       balance.  Mapped onto the projected model's experts by quantiles. */
    const uint64_t *expert_load;
    int             load_layers, load_experts;
    int             a2a_affine;     /* 0 (default): dispatch/combine time in
                                       proportion to bytes, at the bandwidth the
                                       paper measured; 1: a fixed part plus the
                                       bytes at the link's rate (both readings
                                       reproduce Table 6 at its 128 tokens)    */
} cm384_proj_opts;

CM384_API void cm384_proj_opts_init(cm384_proj_opts *o);

/* Copies the mechanism switches of an engine config (int8, int8_dispatch,
 * microbatches, mtp, the context cache; the preset's choices where a field
 * leaves it to the preset) into o, so that a run and its projection switch
 * the same things.  Workload fields are left alone. */
CM384_API void cm384_proj_opts_from_config(cm384_proj_opts *o, const cm384_config *c);

/* One operator of a projected timeline (per device). */
typedef struct cm384_proj_op {
    char   name[24];
    int    lane;          /* 0 attention stream (or all cores), 1 MoE stream,
                             2 fabric / DMA                                  */
    int    microbatch;    /* 0 or 1                                          */
    double start_us, dur_us;
    double flops;         /* arithmetic                                      */
    double bytes;         /* HBM bytes                                       */
    double net_bytes;     /* bytes this device sends on the fabric           */
    char   bound;         /* 'c' compute, 'm' memory, 'n' network, 'h' host  */
} cm384_proj_op;

#define CM384_PROJ_MAX_OPS     32
#define CM384_PROJ_MAX_DEVICES 1024

typedef struct cm384_projection {
    size_t struct_size;
    char   hw[32];
    /* deployment (the engine's paper preset for this model) */
    int    decode_devices, expert_devices, shared_replicas, redundant_experts;
    int    prefill_devices;           /* one prefill instance                 */
    /* decode */
    int    batch;                     /* requests per NPU                     */
    int    feasible;                  /* 0: no batch meets the TPOT target    */
    double tpot_ms, step_ms;
    double decode_tok_s;              /* per NPU                              */
    double tokens_per_step;           /* per request: 1 + acceptance           */
    double layer_us;                  /* one MoE layer, both microbatches      */
    double hbm_used_gb;               /* per decode device                    */
    double dispatch_mb, combine_mb;   /* per decode device per step            */
    double decode_load_max_over_mean; /* expert-device rows, max/mean          */
    /* prefill */
    double prefill_tok_s;             /* per NPU, prompt tokens incl. cached   */
    double prefill_batch_ms;          /* one batch of prefill_tokens           */
    double ttft_ms;                   /* that batch + KV hand-off + first step */
    double prefill_load_max_over_mean;
    /* timelines: one MoE layer of decode, one of prefill, the decode step */
    int    n_decode_ops, n_prefill_ops, n_step_ops;
    cm384_proj_op decode_ops[CM384_PROJ_MAX_OPS];
    cm384_proj_op prefill_ops[CM384_PROJ_MAX_OPS];
    cm384_proj_op step_ops[CM384_PROJ_MAX_OPS];
    /* rows per decode expert device in one layer, without and with EPLB's
       redundant replicas (mean 1) */
    int    n_load_devices;
    float  load_no_eplb[CM384_PROJ_MAX_DEVICES], load_eplb[CM384_PROJ_MAX_DEVICES];
} cm384_projection;

/* Projects model m (a full model or a config-only one) on the hardware and
 * workload in o (NULL = the paper's DeepSeek-R1 set-up).  Set
 * out->struct_size to sizeof(cm384_projection) first (0 also means the
 * current size), as for cm384_stats.  Errors:
 * CM384_E_INVALID (bad option), CM384_E_UNSUPPORTED (a model without routed
 * experts), CM384_E_NOMEM. */
CM384_API int cm384_project(const cm384_model *m, const cm384_proj_opts *o, cm384_projection *out);

/* The projection as text: the step's timeline by operator, TPOT, TTFT,
 * tokens/s per NPU (snprintf convention). */
CM384_API int cm384_projection_report(const cm384_projection *p, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* CM384_H */

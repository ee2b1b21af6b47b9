#!/bin/sh
# check-peer.sh -- cm384 and llama.cpp on the same GGUF files (make check-peer).
#
#   sh tests/peer/check-peer.sh [--update-fixtures] [--bench]
#
# Needs the peer: llama.cpp built by tests/peer/build-llama.sh into PEER_DIR
# (default ../peer beside the main checkout; PEER_DIR/READY is written when it
# is done), /usr/bin/python3 with numpy and torch (Debian: python3-numpy
# python3-torch python3-yaml python3-tqdm) for llama.cpp's own converter, run
# through tests/peer/convert_hf.py (a documented stand-in for `transformers`).
#
# For tiny-dsv3, models/shakespeare and "tinyk" (a synthetic model whose rows
# are whole 256-value k-quant blocks, made by gen_synth, see GEN below):
#   1. llama.cpp's converter writes F32/F16/BF16/Q8_0 files, llama-quantize
#      Q4_0, Q4_K_M, Q5_K_M, Q6_K from the F32 one;
#   2. on every file, the logits of one 24-token sequence from cm384
#      (tests/peer/cm384_logits.c) and from llama.cpp (llama_logits.c, flash
#      attention off): max |diff| and top-1 agreement; for F32/F16/BF16 also
#      cm384's logits on the safetensors; for the quantized files the
#      quantization's own noise (cm384 on the file vs on the safetensors);
#   3. cm384 convert (bf16, q8_0) files run by llama.cpp: the same logits;
#   4. DeepSeek-V3's real tokenizer through llama.cpp's converter
#      (--vocab-only) read by cm384: all 1112 cases of
#      tests/fixtures/tokenizer/cases.jsonl (test_gguf, CM384_GGUF_VOCAB);
#   5. --bench: load time, RSS, prefill/decode tok/s of both on each
#      shakespeare file (medians of 3 alternating runs, 2 threads);
#   6. --update-fixtures: copies the small files into tests/fixtures/gguf and
#      writes golden.json / golden.bin (llama.cpp's logits) for `make test`.
# Ends with "N passed, N failed".
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
main=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's|/\.git$||')
PEER=${PEER_DIR:-${main:-$here}/../peer}
PY=${PYTHON:-/usr/bin/python3}
B=${B:-build}
W=$B/peer-check
UPDATE=0; BENCH=0
for a in "$@"; do
    case $a in --update-fixtures) UPDATE=1 ;; --bench) BENCH=1 ;; *) echo "unknown option $a"; exit 2 ;; esac
done
# READY is written when the whole build is done; the libraries and
# llama-quantize are all this needs
if [ ! -f "$PEER/READY" ] && [ ! -x "$PEER/llama.cpp/build/bin/llama-quantize" ]; then
    echo "check-peer: no llama.cpp peer at $PEER (build it: sh tests/peer/build-llama.sh)"
    echo "0 passed, 1 failed"
    exit 1
fi
SRC=$PEER/llama.cpp
BLD=$SRC/build
mkdir -p "$W"
passed=0; failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# ---- tools ----
make -s all "$B/gen_synth" >/dev/null || { echo "build failed"; exit 1; }
cc -O2 -std=c11 -Wall -Wextra tests/peer/cm384_logits.c "$B/libcm384.a" -o "$W/cm384_logits" -lm -lpthread || exit 1
libs="$BLD/src/libllama.a $BLD/ggml/src/libggml.a $BLD/ggml/src/libggml-cpu.a $BLD/ggml/src/libggml-base.a"
c++ -O2 -x c tests/peer/llama_logits.c -x none -I"$SRC/include" -I"$SRC/ggml/include" \
    -Wl,--start-group $libs -Wl,--end-group -fopenmp -lpthread -lm -o "$W/llama_logits" ||
    { echo "check-peer: cannot link llama_logits against $BLD"; exit 1; }
QUANT=$BLD/bin/llama-quantize

# ---- models and files ----
GEN="--preset tiny --set hidden_size=256 --set intermediate_size=256 --set moe_intermediate_size=256 \
--set num_hidden_layers=2 --set first_k_dense_replace=1 --set num_attention_heads=2 --set num_key_value_heads=2 \
--set q_lora_rank=256 --set kv_lora_rank=256 --set qk_nope_head_dim=128 --set qk_rope_head_dim=64 \
--set v_head_dim=128 --set n_routed_experts=4 --set num_experts_per_tok=2 --set n_group=2 --set topk_group=1 \
--set num_nextn_predict_layers=0 --set tie_word_embeddings=true --no-index"
[ -f "$B/models/tinyk/config.json" ] || "$B/gen_synth" -q $GEN "$B/models/tinyk" >/dev/null
convert() {  # convert HF_DIR OUT TYPE
    [ -f "$2" ] || $PY tests/peer/convert_hf.py "$SRC" "$1" "$2" "$3" >"$2.log" 2>&1 || { bad "convert $1 $3 (see $2.log)"; return 1; }
}
for spec in "tiny tests/fixtures/tiny-dsv3" "shk models/shakespeare" "tinyk $B/models/tinyk"; do
    set -- $spec
    for t in f32 f16 bf16 q8_0; do convert "$2" "$W/$1-$t.gguf" "$t"; done
    if [ "$1" != tiny ]; then
        for q in Q4_0 Q4_K_M Q5_K_M Q6_K; do
            out=$W/$1-$(echo $q | tr A-Z a-z).gguf
            [ -f "$out" ] || "$QUANT" "$W/$1-f32.gguf" "$out" $q >"$out.log" 2>&1 || bad "llama-quantize $1 $q (see $out.log)"
        done
    fi
    for t in bf16 q8_0; do
        ./"$B"/cm384 convert -m "$2" -o "$W/$1-cm384-$t.gguf" --type $t 2>/dev/null || bad "cm384 convert $1 $t"
    done
done

# ---- logits ----
IDS=$(./"$B"/cm384 tokenize -m tests/fixtures/tiny-dsv3 --bos --quiet \
      "ROMEO: But soft, what light through yonder window breaks? It is the east" | tr -d '[],')
compare() {  # compare LABEL FILE HF_DIR
    "$W/cm384_logits" "$2" "$W/c.bin" $IDS >/dev/null || { bad "$1: cm384 on $2"; return; }
    "$W/llama_logits" "$2" "$W/l.bin" $IDS >/dev/null 2>&1 || { bad "$1: llama.cpp on $2"; return; }
    "$W/cm384_logits" "$3" "$W/h.bin" $IDS >/dev/null || { bad "$1: cm384 on $3"; return; }
    # the file's exact values as F32 (cm384's dequantization), run by llama.cpp
    ./"$B"/cm384 convert -m "$2" -o "$W/deq.gguf" --type f32 2>/dev/null &&
        "$W/llama_logits" "$W/deq.gguf" "$W/d.bin" $IDS >/dev/null 2>&1 || { bad "$1: dequantized copy"; return; }
    $PY - "$1" "$W/c.bin" "$W/l.bin" "$W/h.bin" "$W/d.bin" <<'PYEOF'
import sys, numpy as np
label, c, l, h, d = sys.argv[1], *(np.fromfile(p, dtype=np.float32).reshape(-1, 1024) for p in sys.argv[2:6])
d_ll, noise, d_deq = np.abs(c - l).max(), np.abs(c - h).max(), np.abs(c - d).max()
top = (c.argmax(1) == l.argmax(1)).sum()
quant = not any(label.endswith(t) for t in ("-f32", "-f16", "-bf16"))
# unquantized: cm384's GGUF = its safetensors within 1e-3.  quantized: llama.cpp's
# difference within the quantization's own noise, and cm384 computes exactly the
# stored values (= llama.cpp on them written out as F32, within llama.cpp's own
# F32 arithmetic, ~1e-2 here)
ok = noise < 1e-3 if not quant else bool(d_ll <= noise and d_deq < 0.05)
print(f"{label:20s} cm384 vs llama.cpp: max|diff| {d_ll:8.3g}, top-1 {top}/{len(c)};  cm384 GGUF vs safetensors: "
      f"{noise:8.3g}{' (quantization noise)' if quant else '               '};  cm384 vs llama.cpp on the file's values "
      f"as F32: {d_deq:.3g}  {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PYEOF
    if [ $? -eq 0 ]; then ok; else bad "$1"; fi
}
for m in tiny shk tinyk; do
    case $m in tiny) hf=tests/fixtures/tiny-dsv3 ;; shk) hf=models/shakespeare ;; tinyk) hf=$B/models/tinyk ;; esac
    for f in "$W/$m"-*.gguf; do compare "$(basename "$f" .gguf)" "$f" "$hf"; done
done

# ---- the real tokenizer through llama.cpp's converter ----
vd=$W/v3-tokenizer
mkdir -p "$vd"
cp tests/fixtures/tokenizer/tokenizer.json tests/fixtures/tokenizer/tokenizer_config.json "$vd/"
sed 's/"vocab_size": 1024/"vocab_size": 129280/' tests/fixtures/tiny-dsv3/config.json > "$vd/config.json"
[ -f "$W/v3-vocab.gguf" ] ||
    $PY tests/peer/convert_hf.py "$SRC" "$vd" "$W/v3-vocab.gguf" f32 --vocab-only >"$W/v3-vocab.log" 2>&1
if [ -f "$W/v3-vocab.gguf" ] && CM384_QUICK=1 CM384_GGUF_VOCAB="$W/v3-vocab.gguf" "$B/cm384_tests" gguf >"$W/vocab.log" 2>&1; then
    grep "vocab-only" "$W/vocab.log"; ok
else bad "DeepSeek-V3's tokenizer from llama.cpp's converter (see $W/vocab.log, $W/v3-vocab.log)"; fi

# ---- fixtures for make test ----
if [ $UPDATE -eq 1 ]; then
    G=tests/fixtures/gguf
    mkdir -p $G
    # kept small: BF16 of tiny-dsv3, and two k-quant mixes that hold Q4_K, Q5_K,
    # Q6_K and the Q5_0 / Q5_1 fallbacks (Q8_0, Q4_0, F16 are checked here)
    cp "$W/tiny-bf16.gguf" $G/tiny-dsv3-bf16.gguf
    for q in q4_k_m q5_k_m; do cp "$W/tinyk-$q.gguf" $G/tinyk-$q.gguf; done
    rm -f $G/golden.bin
    entries=""
    off=0
    for f in tinyk-q4_k_m tinyk-q5_k_m; do
        "$W/llama_logits" $G/$f.gguf "$W/g.bin" $IDS >/dev/null || bad "golden $f"
        cat "$W/g.bin" >> $G/golden.bin
        case $f in tiny-dsv3*) base=tests/fixtures/tiny-dsv3 ;; *) base=build/models/tinyk ;; esac
        idj=$(echo $IDS | tr ' ' ',')
        entries="$entries${entries:+,}
  {\"file\": \"$f.gguf\", \"unquantized\": \"$base\", \"vocab\": 1024, \"ids\": [$idj], \"offset\": $off}"
        off=$(stat -c %s $G/golden.bin)
    done
    printf '{"made_by": "tests/peer/check-peer.sh --update-fixtures: llama.cpp (%s) logits, flash attention off, float32 little-endian [n][vocab] at offset in golden.bin",\n "gen_synth_tinyk": "%s",\n "files": [%s\n]}\n' \
        "$(git -C "$SRC" rev-parse --short HEAD)" "$(echo $GEN | tr -s ' ')" "$entries" > $G/golden.json
    echo "fixtures written to $G"
fi

# ---- speed, same run ----
if [ $BENCH -eq 1 ]; then
    echo "bench (models/shakespeare, 2 threads, prefill 128 then 64 greedy tokens; medians of 3; load $(cut -d' ' -f1-3 /proc/loadavg)):"
    for f in "$W"/shk-f32.gguf "$W"/shk-bf16.gguf "$W"/shk-f16.gguf "$W"/shk-q8_0.gguf "$W"/shk-q6_k.gguf "$W"/shk-q5_k_m.gguf "$W"/shk-q4_k_m.gguf "$W"/shk-q4_0.gguf; do
        : > "$W/bench.c"; : > "$W/bench.l"
        for i in 1 2 3; do
            "$W/cm384_logits" "$f" --bench 128 64 2 >> "$W/bench.c"
            "$W/llama_logits" "$f" --bench 128 64 2 >> "$W/bench.l"
        done
        $PY - "$(basename "$f" .gguf)" "$W/bench.c" "$W/bench.l" <<'PYEOF'
import sys, json, statistics as st
name, c, l = sys.argv[1], [json.loads(x) for x in open(sys.argv[2])], [json.loads(x) for x in open(sys.argv[3])]
m = lambda rs, k: st.median(r[k] for r in rs)
print(f"  {name:16s} load ms {m(c,'load_ms'):7.1f} / {m(l,'load_ms'):7.1f}   RSS MB {m(c,'rss_end_mb'):6.1f} / {m(l,'rss_end_mb'):6.1f}"
      f"   prefill tok/s {m(c,'prefill_tok_s'):7.1f} / {m(l,'prefill_tok_s'):7.1f} ({m(c,'prefill_tok_s')/m(l,'prefill_tok_s'):.2f}x)"
      f"   decode tok/s {m(c,'decode_tok_s'):6.1f} / {m(l,'decode_tok_s'):6.1f} ({m(c,'decode_tok_s')/m(l,'decode_tok_s'):.2f}x)   (cm384 / llama.cpp)")
PYEOF
    done
fi
echo "check-peer: $passed passed, $failed failed"
[ $failed -eq 0 ]

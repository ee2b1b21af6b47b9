#!/bin/sh
# gguf.sh -- the bench models as GGUF files for llama.cpp (make bench, 3b).
#
#   sh tests/peer/gguf.sh [MODEL_DIR...]
#
# For each model directory (default: build/models/bench-M and
# build/models/v2lite4, which make bench writes) it writes NAME-bf16.gguf
# with tests/peer/hf2gguf.py and NAME-q8_0.gguf with the peer's
# llama-quantize into LLAMA_GGUF_DIR (default PEER_DIR/gguf).  The peer
# must be built first (make peer); Python needs numpy (Debian: python3-numpy).
# llama.cpp takes a DeepSeek-V2 without q_lora ("lite") by its layer count
# (26 or 27) when the file has no attention.q_lora_rank; hf2gguf.py writes
# it as 0, so V2-Lite cut to 4 layers loads there too.
set -e
here=$(cd "$(dirname "$0")/../.." && pwd)
main=$(cd "$here" && git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's|/\.git$||')
[ -d "$main" ] || main=$here
PEER=${PEER_DIR:-$main/../peer}
OUT=${LLAMA_GGUF_DIR:-$PEER/gguf}
[ -f "$PEER/READY" ] || { echo "gguf.sh: no peer build in $PEER (run make peer)" >&2; exit 2; }
PY=${PYTHON:-python3}
$PY -c 'import numpy' 2>/dev/null || PY=/usr/bin/python3
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- "$here/build/models/bench-M" "$here/build/models/v2lite4"
for d in "$@"; do
    [ -f "$d/config.json" ] || { echo "gguf.sh: $d is not a model directory, skipped" >&2; continue; }
    name=$(basename "$d")
    if [ ! -f "$OUT/$name-bf16.gguf" ]; then
        PYTHONPATH="$PEER/llama.cpp/gguf-py" $PY "$here/tests/peer/hf2gguf.py" "$d" "$OUT/$name-bf16.gguf.tmp"
        mv "$OUT/$name-bf16.gguf.tmp" "$OUT/$name-bf16.gguf"
    fi
    if [ ! -f "$OUT/$name-q8_0.gguf" ]; then
        "$PEER/bin/llama-quantize" "$OUT/$name-bf16.gguf" "$OUT/$name-q8_0.gguf.tmp" Q8_0 >"$OUT/$name-quantize.log" 2>&1 ||
            { tail -20 "$OUT/$name-quantize.log"; exit 1; }
        mv "$OUT/$name-q8_0.gguf.tmp" "$OUT/$name-q8_0.gguf"
    fi
    echo "$OUT/$name-bf16.gguf $OUT/$name-q8_0.gguf"
done

#!/bin/sh
# build-llama.sh -- build llama.cpp as a test peer, outside the repository.
#
#   sh tests/peer/build-llama.sh [PEER_DIR]        (or: make peer)
#
# The source is the llama.cpp that the npm package node-llama-cpp ships as a
# git bundle (NODE_LLAMA_CPP_VERSION, default 3.22.1), with the patches the
# package itself applies.  It is built with native CPU flags (Release, CPU
# only, static) into PEER_DIR (default: ../peer beside the main checkout,
# i.e. /work/peer for /work/main and its worktrees), nothing inside it:
#
#   PEER_DIR/llama.cpp/          the source (convert_hf_to_gguf.py, gguf-py)
#   PEER_DIR/llama.cpp/build/    the build
#   PEER_DIR/bin/                llama-bench, llama-quantize, llama-completion, ...
#   PEER_DIR/READY               written last: version, commit, flags, CPU
#
# LLAMA_ISA=avx2 builds a second llama.cpp restricted to AVX2 + FMA + F16C
# (no AVX-512, no VNNI: what a Zen 1-3 or pre-Ice Lake machine runs) into
# PEER_DIR/llama.cpp/build-avx2, PEER_DIR/bin-avx2 and PEER_DIR/READY-avx2:
# on an AVX-512 machine, `make bench` then compares it with cm384's avx2
# kernel set -- both sides on the ISA of an AVX2 machine, on this machine's
# memory (section 13).  LLAMA_ISA=avx_vnni does the same with AVX-VNNI
# added (what an Intel laptop from Alder Lake on runs) into build-avxvnni,
# bin-avxvnni and READY-avxvnni, for cm384's avx_vnni set.
#
# `make bench` then runs llama-bench beside cm384:
#   LLAMA_BENCH=PEER_DIR/bin/llama-bench LLAMA_GGUF_DIR=dir make bench
# Re-running is cheap: the download, clone and configure are skipped when
# present, and the build is incremental.  Needs npm, git, cmake, a C++ compiler.
set -e
here=$(cd "$(dirname "$0")/../.." && pwd)
# beside the main checkout, also when run from a git worktree of it
main=$(cd "$here" && git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's|/\.git$||')
[ -d "$main" ] || main=$here
PEER=${1:-${PEER_DIR:-$main/../peer}}
VERSION=${NODE_LLAMA_CPP_VERSION:-3.22.1}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
TARGETS=${LLAMA_TARGETS:-"llama-bench llama-quantize llama-completion llama-perplexity llama-tokenize llama-simple llama-eval-callback llama-gguf"}
ISA=${LLAMA_ISA:-native}
case "$ISA" in
native) sfx=""; isa_flags="-DGGML_NATIVE=ON"; isa_desc="GGML_NATIVE=ON" ;;
avx2)   sfx="-avx2"; TARGETS=${LLAMA_TARGETS:-llama-bench}
        isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF"
        isa_desc="GGML_NATIVE=OFF, AVX2 + FMA + F16C only (no AVX-512, no VNNI)" ;;
avx_vnni) sfx="-avxvnni"; TARGETS=${LLAMA_TARGETS:-llama-bench}
        isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF"
        isa_desc="GGML_NATIVE=OFF, AVX2 + FMA + F16C + AVX-VNNI (no AVX-512)" ;;
*) echo "build-llama.sh: LLAMA_ISA is native, avx2 or avx_vnni, not $ISA" >&2; exit 2 ;;
esac
mkdir -p "$PEER"
PEER=$(cd "$PEER" && pwd)
case "$PEER/" in "$here"/*) echo "build-llama.sh: $PEER is inside the repository; give a directory outside it" >&2; exit 2 ;; esac
rm -f "$PEER/READY$sfx"

# 1. the package (npm's own client, from the registry)
pkg=$PEER/pkg
if [ ! -f "$pkg/package/llama/gitRelease.bundle" ]; then
    mkdir -p "$pkg"
    (cd "$pkg" && npm pack "node-llama-cpp@$VERSION" >/dev/null 2>&1 && tar xzf "node-llama-cpp-$VERSION.tgz")
fi

# 2. the source, cloned from the bundle, with the package's patches
src=$PEER/llama.cpp
if [ ! -d "$src/.git" ]; then
    git clone -q "$pkg/package/llama/gitRelease.bundle" "$src"
    for p in "$pkg"/package/llama/patches/*.diff; do
        [ -f "$p" ] || continue
        if git -C "$src" apply --check "$p" 2>/dev/null; then
            git -C "$src" apply "$p" && echo "applied $(basename "$p")"
        else
            echo "skipped $(basename "$p") (already in the source or does not apply)"
        fi
    done
fi

# 3. configure and build: CPU backend, native flags
bld=$src/build$sfx
if [ ! -f "$bld/CMakeCache.txt" ]; then
    cmake -S "$src" -B "$bld" -DCMAKE_BUILD_TYPE=Release $isa_flags -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$PEER/configure$sfx.log" 2>&1 ||
        { tail -30 "$PEER/configure$sfx.log"; exit 1; }
fi
built=""
for t in $TARGETS; do
    if cmake --build "$bld" --config Release -j "$JOBS" --target "$t" >>"$PEER/build$sfx.log" 2>&1; then
        built="$built $t"
    else
        echo "build-llama.sh: target $t did not build (see $PEER/build$sfx.log)" >&2
    fi
done
case " $built " in *" llama-bench "*) ;; *) tail -30 "$PEER/build$sfx.log"; exit 1 ;; esac
mkdir -p "$PEER/bin$sfx"
for t in $built; do ln -sf "$bld/bin/$t" "$PEER/bin$sfx/$t"; done

{
    echo "llama.cpp from node-llama-cpp $VERSION"
    echo "commit $(git -C "$src" rev-parse HEAD)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //')"
    echo "flags $isa_desc, Release, CPU backend only, static"
    echo "binaries $PEER/bin$sfx:$built"
    echo "source $src (convert_hf_to_gguf.py, gguf-py)"
} >"$PEER/READY$sfx"
cat "$PEER/READY$sfx"

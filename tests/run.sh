#!/bin/sh
# run.sh -- runs every cm384 test and ends with one line: "N passed, N failed".
# Called by `make test` (which builds the binaries first).  Each test program
# prints its own "name: N passed, N failed"; a step without such a line
# counts as one check, passed if it exits 0.
B=${B:-build}
MODEL=${MODEL:-tests/fixtures/tiny-dsv3}
CC=${CC:-cc}
passed=0
failed=0
log=$(mktemp)
start=$(date +%s)

step() {  # step NAME COMMAND...
    name=$1; shift
    t0=$(date +%s)
    printf '== %s\n' "$name"
    "$@" >"$log" 2>&1
    rc=$?
    tally "$name" "$log" "$rc" $(($(date +%s) - t0))
}

tally() {  # tally NAME LOG EXIT-STATUS SECONDS: print a step's output and count it
    name=$1; cat "$2"; rc=$3
    line=$(grep -E '[0-9]+ passed, [0-9]+ failed' "$2" | tail -n 1)
    if [ -n "$line" ]; then
        p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed, ([0-9]+) failed.*/\1/')
        f=$(echo "$line" | sed -E 's/.* ([0-9]+) passed, ([0-9]+) failed.*/\2/')
        if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    elif [ "$rc" -eq 0 ]; then p=1; f=0
    else p=0; f=1; echo "   (exit status $rc)"
    fi
    passed=$((passed + p))
    failed=$((failed + f))
    printf '   %s: %d passed, %d failed (%ds)\n' "$name" "$p" "$f" "$4"
}

# The compile-only checks (warnings as errors on gcc and clang, C++) run
# one after another in the background while the tests below run: the tests
# leave a core idle most of the time, and the checks took a minute and a
# half in a row.  Their results are counted in order near the end
# (compile_checks_report).
checks=$(mktemp -d)
compile_check() {  # compile_check NAME COMMAND...: run in the chain, results in $checks
    n=$(ls "$checks" | grep -c '\.name$')
    printf '%s' "$1" >"$checks/$n.name"; shift
    t0=$(date +%s)
    "$@" >"$checks/$n.log" 2>&1
    echo "$? $(($(date +%s) - t0))" >"$checks/$n.rc"
}
compile_checks() {
    compile_check "gcc -O2 -Wall -Wextra -Werror -c dist/cm384.c" gcc -std=c11 -O2 -Wall -Wextra -Werror -c dist/cm384.c -o "$B/check_amalg.o"
    compile_check "gcc -O3 -Wall -Wextra -Werror -c cm384.c" gcc -std=c11 -O3 -Wall -Wextra -Werror -c cm384.c -o "$B/check_gcc.o"
    # the tests too (they include cm384.c): gcc's -O1 warnings, clang's checks
    compile_check "gcc -Wall -Wextra -Werror -O1 tests/main.c" gcc -std=c11 -O1 -Wall -Wextra -Werror -pthread -c tests/main.c -o /dev/null
    compile_check "gcc -Wall -Wextra -Werror examples/server.c" gcc -std=c11 -O2 -Wall -Wextra -Werror -pthread -c examples/server.c -o "$B/check_server_gcc.o"
    if command -v clang >/dev/null 2>&1; then
        compile_check "clang -O3 -Wall -Wextra -Werror -c cm384.c" clang -std=c11 -O3 -Wall -Wextra -Werror -c cm384.c -o "$B/check_clang.o"
        compile_check "clang -Wall -Wextra -Werror examples/server.c" clang -std=c11 -O2 -Wall -Wextra -Werror -pthread -c examples/server.c -o "$B/check_server_clang.o"
        compile_check "clang -Wall -Wextra -Werror tests/main.c" clang -std=c11 -Wall -Wextra -Werror -pthread -fsyntax-only tests/main.c
        # without the SIMD sets, as the fuzz build compiles it
        compile_check "clang -Wall -Wextra -Werror -DGL_NO_SIMD cm384.c" clang -std=c11 -Wall -Wextra -Werror -DGL_NO_SIMD -pthread -fsyntax-only cm384.c
    fi
    if command -v c++ >/dev/null 2>&1; then
        compile_check "cm384.h compiles as C++" c++ -fsyntax-only -Wall -Wextra -x c++ cm384.h
    fi
}
compile_checks_report() {
    wait "$checks_pid"
    n=0
    while [ -f "$checks/$n.name" ]; do
        printf '== %s\n' "$(cat "$checks/$n.name")"
        if [ -f "$checks/$n.rc" ]; then set -- $(cat "$checks/$n.rc"); else set -- 1 0; fi
        tally "$(cat "$checks/$n.name")" "$checks/$n.log" "$1" "$2"
        n=$((n + 1))
    done
    rm -rf "$checks"
}
compile_checks &
checks_pid=$!

# unit and golden tests
T="$B/cm384_tests"
# a model at DeepSeek-V3's hidden width (7168) for the allocation test
[ -f "$B/models/v3-width/config.json" ] ||
    "$B/gen_synth" --preset tiny --set hidden_size=7168 --no-index "$B/models/v3-width" >/dev/null 2>&1 ||
    echo "   (could not generate $B/models/v3-width)"
# the unquantized source of the k-quant GGUF fixtures (tests/fixtures/gguf/golden.json)
[ -f "$B/models/tinyk/config.json" ] ||
    "$B/gen_synth" -q --preset tiny --set hidden_size=256 --set intermediate_size=256 --set moe_intermediate_size=256 \
        --set num_hidden_layers=2 --set first_k_dense_replace=1 --set num_attention_heads=2 --set num_key_value_heads=2 \
        --set q_lora_rank=256 --set kv_lora_rank=256 --set qk_nope_head_dim=128 --set qk_rope_head_dim=64 \
        --set v_head_dim=128 --set n_routed_experts=4 --set num_experts_per_tok=2 --set n_group=2 --set topk_group=1 \
        --set num_nextn_predict_layers=0 --set tie_word_embeddings=true --no-index "$B/models/tinyk" >/dev/null 2>&1 ||
    echo "   (could not generate $B/models/tinyk)"
# an FP8 model with plain q_proj and two shared experts, for the memory estimate
[ -f "$B/models/fp8-q-plain/config.json" ] ||
    "$B/gen_synth" --preset tiny --dtype fp8 --set q_lora_rank=null --set num_hidden_layers=2 --set n_shared_experts=2 \
        -q "$B/models/fp8-q-plain" >/dev/null 2>&1 ||
    echo "   (could not generate $B/models/fp8-q-plain)"
for t in tokenizer kernels golden loader engine alloc model api trust slo eplb gguf project peers faults; do
    step "$t" "$T" $t
done
step "progress" "$T" progress "$B/models/fp8-q-plain"
step "fuzzfix" "$T" fuzzfix

# the same under AddressSanitizer + UndefinedBehaviorSanitizer
for t in tokenizer kernels golden loader api trust slo eplb project; do
    step "asan+ubsan $t" env ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" $t
done
step "asan+ubsan progress" env ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" progress "$B/models/fp8-q-plain"
step "asan+ubsan fuzzfix" env ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" fuzzfix
step "asan+ubsan gguf" env CM384_QUICK=1 ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" gguf
step "asan+ubsan model" env CM384_QUICK=1 ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" model
step "asan+ubsan engine" env CM384_QUICK=1 ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" engine
step "asan+ubsan peers" env CM384_QUICK=1 ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" peers
step "asan+ubsan faults" env CM384_QUICK=1 ASAN_OPTIONS=detect_leaks=1 "$B/asan/cm384_tests" faults

# threaded tests under ThreadSanitizer
step "tsan engine" env CM384_QUICK=1 TSAN_OPTIONS="halt_on_error=1" "$B/tsan/cm384_tests" engine
step "tsan peers" env CM384_QUICK=1 TSAN_OPTIONS="halt_on_error=1" "$B/tsan/cm384_tests" peers
step "tsan faults" env CM384_QUICK=1 TSAN_OPTIONS="halt_on_error=1" "$B/tsan/cm384_tests" faults
step "tsan kernels (pool)" env CM384_TEST_POOL_ONLY=1 TSAN_OPTIONS="halt_on_error=1" "$B/tsan/cm384_tests" kernels
step "tsan slo" env TSAN_OPTIONS="halt_on_error=1" "$B/tsan/cm384_tests" slo

# the trained default model: cm384 perplexity reproduces the trainer's validation loss
expect=$(sed -n 's/.*"val_loss": *\([0-9.]*\).*/\1/p' models/shakespeare/reference.json | head -n 1)
perplexity_check() {
    out=$("$B/cm384" perplexity -m models/shakespeare models/shakespeare/val.txt --ctx 256 -t 2 --no-int8-dispatch) || return 1
    echo "$out"
    got=$(echo "$out" | sed -n 's/.*mean loss \([0-9.]*\).*/\1/p')
    echo "trainer's val_loss $expect, cm384 $got"
    awk -v a="$got" -v b="$expect" 'BEGIN { d = (a - b) / b; if (d < 0) d = -d; exit !(d <= 0.005) }'
}
step "cm384 perplexity = trainer's val_loss (within 0.5%)" perplexity_check

# the smallest embedding program, and the tool
step "examples/embed" "$B/embed" "$MODEL" "ROMEO:"
step "cm384 tokenize" "$B/cm384" tokenize -m tests/fixtures/tiny-dsv3 --quiet "Hello world"
step "cm384 eval" "$B/cm384" eval -m tests/fixtures/tiny-dsv3 -t 2 --top 2 "Hello"
step "cm384 command line (tests/test_cli.sh)" sh tests/test_cli.sh "$B/cm384"
step "cm384 bench (paper preset)" "$B/cm384" bench -m tests/fixtures/tiny-dsv3 -t 2 -p 32 -n 8 --requests 8 --preset paper --json
step "cm384 project --table4" "$B/cm384" project --table4
svg_check() {  # the picture is written, complete, and shows the run and the projection
    "$B/cm384" project --from-run models/shakespeare --run-requests 6 --run-prompt 48 --run-tokens 32 -t 2 --svg "$B/check.svg" || return 1
    grep -q '</svg>' "$B/check.svg" && grep -q 'three decode steps' "$B/check.svg" && grep -q 'Projected on CloudMatrix384' "$B/check.svg"
}
step "cm384 project --from-run --svg" svg_check
step "cm384 bench --ablate (small)" "$B/cm384" bench --ablate -m models/shakespeare --requests 4 -p 48 -n 8 -t 2

# the README's embedding example compiles and runs as printed
readme_example() {
    sed -n '/^```c$/,/^```$/p' README.md | sed '1d;$d' > "$B/readme_example.c" &&
    $CC -std=c11 -Wall -Wextra -Werror -I. "$B/readme_example.c" "$B/libcm384.a" -o "$B/readme_example" -lpthread -lm &&
    "$B/readme_example" >/dev/null
}
step "README's embedding example" readme_example

# the amalgamation: the embed example built from dist/cm384.c and cm384.h
# alone generates what the library built from its sources does
amalgamation_check() {
    if grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' dist/cm384.c | grep -v '"cm384.h"'; then
        echo "dist/cm384.c still includes a local file"; return 1
    fi
    a=$("$B/embed-amalgamated" "$MODEL" "ROMEO:") || return 1
    b=$("$B/embed" "$MODEL" "ROMEO:") || return 1
    echo "$a"
    [ "$a" = "$b" ] || { echo "differs from build/embed: $b"; return 1; }
}
step "amalgamation: embed from dist/cm384.c + cm384.h" amalgamation_check

# the OpenAI-compatible server under real clients: the openai npm package,
# curl, raw sockets, and a 64-client load run (tests/server/server_test.mjs)
OPENAI_VERSION=$(sed -n 's/.*"openai": *"\([^"]*\)".*/\1/p' tests/server/package.json)
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && command -v curl >/dev/null 2>&1; then
    if [ ! -f "$B/npm/node_modules/openai/package.json" ]; then
        npm install --prefix "$B/npm" --no-audit --no-fund --loglevel=error "openai@$OPENAI_VERSION" >"$log" 2>&1 || cat "$log"
    fi
    if [ -f "$B/npm/node_modules/openai/package.json" ]; then
        step "server: openai client, curl, load run" env NODE_PATH="$B/npm/node_modules" node tests/server/server_test.mjs "$B/cm384-server" models/shakespeare
        step "tsan server: openai client, curl, 16-client load run" env SERVER_TEST_TSAN=1 TSAN_OPTIONS="halt_on_error=0" \
            NODE_PATH="$B/npm/node_modules" node tests/server/server_test.mjs "$B/tsan/cm384-server" models/shakespeare
    else
        echo "== server: skipped (the openai npm package could not be installed into $B/npm; .ci/run installs it)"
    fi
else
    echo "== server: skipped (needs node, npm and curl; .ci/run installs them)"
fi
# the server's request parsers on the fuzz seeds, under ASan+UBSan (a
# campaign: clang -fsanitize=fuzzer, see tests/fuzz/fuzz_server.c)
fuzz_replay() {
    $CC -std=c11 -O1 -g -Wall -Wextra -Werror -pthread -fsanitize=address,undefined -fno-sanitize-recover=undefined \
        -DFUZZ_REPLAY tests/fuzz/fuzz_server.c "$B/libcm384.a" -o "$B/fuzz_server_replay" -lm -lpthread &&
        "$B/fuzz_server_replay" tests/fuzz/server_corpus/*
}
step "fuzz_server: replay the seeds (ASan+UBSan)" fuzz_replay


# the fuzz harnesses, a short fixed number of runs each from their seed
# corpus (new inputs go to a scratch directory; tests/fuzz/README.md)
fuzz_quiet() {  # the last lines of a harness's output, all of it on failure
    flog=$(mktemp)
    "$@" >"$flog" 2>&1
    frc=$?
    if [ "$frc" -eq 0 ]; then tail -n 2 "$flog"; else cat "$flog"; fi
    rm -f "$flog"
    return "$frc"
}
if [ -x "$B/fuzz/cm384_fuzz" ]; then
    for spec in $("$B/fuzz/cm384_fuzz" -list | tr ' ' ':'); do
        name=${spec%%:*}
        runs=${spec#*:}
        scratch=$(mktemp -d)
        step "fuzz $name ($runs runs)" fuzz_quiet "$B/fuzz/fuzz_$name" -runs="$runs" -seed=1 -timeout=60 \
            -artifact_prefix="$B/fuzz/crash-$name-" "$scratch" "tests/fuzz/corpus/$name"
        rm -rf "$scratch"
    done
fi

# one translation unit, warning-free, header usable from C++ (run in the
# background since the start: compile_checks above)
compile_checks_report

# a load under valgrind
if command -v valgrind >/dev/null 2>&1; then
    step "valgrind: load and free" valgrind -q --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite \
        "$B/cm384" info -m tests/fixtures/tiny-dsv3
fi

# the NEON kernels, cross-built and run under qemu when available
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then
    if aarch64-linux-gnu-gcc -O2 -std=c11 -pthread tests/test_kernels.c -o "$B/test_kernels_arm64" -lm >"$log" 2>&1; then
        step "kernels on aarch64 (qemu)" env CM384_QUICK=1 qemu-aarch64 -L /usr/aarch64-linux-gnu "$B/test_kernels_arm64"
    else
        cat "$log"; failed=$((failed + 1)); echo "   aarch64 build failed"
    fi
else
    echo "== kernels on aarch64: skipped (no aarch64-linux-gnu-gcc / qemu-aarch64; .ci/run installs them)"
fi

rm -f "$log"
echo
echo "total time $(($(date +%s) - start))s"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

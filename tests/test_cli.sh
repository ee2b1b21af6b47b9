#!/bin/sh
# test_cli.sh -- the cm384 tool as a user meets it: every subcommand with bad
# arguments (exit 2 and a message naming what was wrong), failing work (exit
# 1 and a message), and good arguments (exit 0 and the output).  Also help,
# --version, `--` and the load's progress line.  Ends with
# "cli: N passed, N failed".
#   sh tests/test_cli.sh [build/cm384]
CLI=${1:-build/cm384}
M=tests/fixtures/tiny-dsv3
TOK=tests/fixtures/tokenizer/tokenizer.json
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=$tmp/out
err=$tmp/err

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "  FAIL: $*"; }

# expect RC PATTERN CMD...: CMD exits with RC and its stderr matches PATTERN
# (a grep -E pattern; "" = anything)
expect() {
    want=$1 pat=$2
    shift 2
    "$@" >"$out" 2>"$err" </dev/null
    rc=$?
    if [ "$rc" -ne "$want" ]; then
        bad "exit $rc, expected $want: $*"; sed 's/^/    | /' "$err" | head -n 5; return
    fi
    if [ -n "$pat" ] && ! grep -Eq -- "$pat" "$err"; then
        bad "stderr does not match /$pat/: $*"; sed 's/^/    | /' "$err" | head -n 5; return
    fi
    ok
}

# out_has PATTERN: the last command's stdout matches
out_has() { if grep -Eq -- "$1" "$out"; then ok; else bad "stdout does not match /$1/"; head -n 5 "$out" | sed 's/^/    | /'; fi; }

echo "the tool itself:"
expect 2 "^usage: cm384 COMMAND" "$CLI"
expect 0 "" "$CLI" --version
out_has "^cm384 [0-9]+\.[0-9]+\.[0-9]+$"
expect 2 "takes no arguments" "$CLI" --version extra
expect 0 "" "$CLI" help
for c in run chat tokenize eval perplexity bench info convert; do out_has "^  $c "; done
expect 2 "no command \"nope\"" "$CLI" help nope
expect 2 "unknown command \"nope\"" "$CLI" nope
expect 2 "unknown command \"-m\"" "$CLI" -m "$M"

for c in run chat tokenize eval perplexity bench info convert; do
    echo "$c:"
    expect 0 "" "$CLI" help "$c"
    out_has "^usage: cm384 $c"
    out_has "^examples:"
    cp "$out" "$tmp/help"
    expect 0 "" "$CLI" "$c" --help
    if cmp -s "$out" "$tmp/help"; then ok; else bad "$c --help differs from help $c"; fi
    expect 0 "" "$CLI" "$c" -m "$M" -h
    expect 2 "cm384 $c: unknown option --bogus \(cm384 help $c\)" "$CLI" "$c" --bogus
    expect 2 "cm384 $c: -m needs a value" "$CLI" "$c" -m
    expect 2 "cm384 $c: unknown option --model" "$CLI" "$c" --model "$M"
    expect 2 "cm384 $c: .*(takes|missing)" "$CLI" "$c" -m "$M" one two three
    expect 2 "--check-values takes no value" "$CLI" "$c" -m "$M" --check-values=1
done
expect 2 "cm384 run: --json is not an option of run" "$CLI" run -m "$M" --json
expect 2 "cm384 bench: --bos is not an option of bench" "$CLI" bench -m "$M" --bos
expect 2 "cm384 info: -t is not an option of info" "$CLI" info -m "$M" -t 2
expect 2 "cm384 tokenize: --temp is not an option" "$CLI" tokenize -m "$M" --temp 1 x

echo "numbers:"
for bad_n in abc -5 0 1.5 " 5" 5x 99999999999 0x10 ""; do
    expect 2 "cm384 run: -n" "$CLI" run -m "$M" -n "$bad_n"
done
expect 2 "--ctx 0: must be from 2" "$CLI" run -m "$M" --ctx 0
expect 2 "--ctx 1: must be from 2" "$CLI" perplexity -m "$M" --ctx 1 "$M/README.md"
expect 2 "--devices 0: must be from 1" "$CLI" run -m "$M" --devices 0
expect 2 "--prefill-share 0.95: must be from 0 to 0.9" "$CLI" run -m "$M" --prefill-share 0.95 x
expect 2 "-t 0: must be from 1" "$CLI" eval -m "$M" -t 0 x
expect 2 "--microbatches 3" "$CLI" bench -m "$M" --microbatches 3
expect 2 "--seed \"abc\"" "$CLI" run -m "$M" --seed abc
expect 2 "--seed \"-1\": must be a non-negative" "$CLI" run -m "$M" --seed -1
expect 2 "--seed \"18446744073709551616\"" "$CLI" run -m "$M" --seed 18446744073709551616
expect 2 "--seed \"1e3\"" "$CLI" chat -m "$M" --seed 1e3
for t in -1 nan inf 1e999 0x1p3 1001; do expect 2 "--temp" "$CLI" run -m "$M" --temp "$t"; done
expect 2 "--top-p 1.5: must be from 0 to 1" "$CLI" run -m "$M" --top-p 1.5
expect 2 "--min-p -0.1: must be from 0 to 1" "$CLI" bench -m "$M" --min-p -0.1
expect 2 "--top-k -1" "$CLI" run -m "$M" --top-k -1
expect 2 "cm384 bench: -p \"abc\": not an integer" "$CLI" bench -m "$M" -p abc
expect 2 "--requests 0" "$CLI" bench -m "$M" --requests 0
expect 2 "--shared-prefix 2" "$CLI" bench -m "$M" --shared-prefix 2
expect 2 "--top 0" "$CLI" eval -m "$M" --top 0 x
expect 2 "--preset \"fast\": one of default, paper, single" "$CLI" run -m "$M" --preset fast

echo "arguments:"
expect 2 "cm384 tokenize: takes 1 argument \(TEXT\), got another: \"Hello\"" "$CLI" tokenize "$TOK" "Hello"
expect 2 "cm384 tokenize: missing TEXT" "$CLI" tokenize -m "$TOK"
expect 2 "cm384 eval: missing TEXT" "$CLI" eval -m "$M"
expect 2 "cm384 perplexity: missing FILE" "$CLI" perplexity -m "$M"
expect 2 "cm384 perplexity: takes 1 argument" "$CLI" perplexity -m "$M" a b
expect 2 "cm384 info: takes no arguments, got \"x\"" "$CLI" info -m "$M" x
expect 2 "cm384 run: give the prompt as -p TEXT or as the argument, not both" "$CLI" run -m "$M" -p a b
expect 0 "" "$CLI" tokenize -m "$TOK" --quiet -- --bos
"$CLI" tokenize -m "$TOK" --quiet "x--bos" >"$tmp/x" 2>/dev/null
if [ "$(cat "$out")" != "$(cat "$tmp/x")" ] && [ "$(head -c 1 "$out")" = "[" ]; then ok; else bad "-- did not end the options"; fi
expect 0 "" "$CLI" tokenize -m "$TOK" --quiet -- -
out_has "^\[[0-9]+\]$"

echo "failing work (exit 1):"
expect 1 "^cm384: loading the model: /nonexistent/model: cannot open" "$CLI" info -m /nonexistent/model
expect 1 "^cm384 perplexity: tests is a directory, not a text file" "$CLI" perplexity -m "$M" tests
expect 1 "^cm384 perplexity: /nonexistent.txt: No such file" "$CLI" perplexity -m "$M" /nonexistent.txt
expect 1 "gives 0 tokens; perplexity needs at least 2" "$CLI" perplexity -m "$M" /dev/null
printf 'a' >"$tmp/one.txt"
expect 1 "gives 1 token; perplexity needs at least 2" "$CLI" perplexity -m "$M" "$tmp/one.txt"
printf '' | { "$CLI" perplexity -m "$M" - >"$out" 2>"$err"; echo $? >"$tmp/rc"; }
if [ "$(cat "$tmp/rc")" = 1 ] && grep -q "gives 0 tokens" "$err" && ! grep -q perplexity "$out"; then ok
else bad "an empty pipe: exit $(cat "$tmp/rc"), stdout: $(cat "$out")"; fi
expect 1 "^cm384: creating the engine: .*max_ctx" "$CLI" run -m "$M" --ctx 100000 x
expect 1 "^cm384: creating the engine: .*tokenizer-only" "$CLI" eval -m "$TOK" x

echo "good arguments:"
expect 0 "prompt tokens" "$CLI" run -m "$M" -n 3 -t 1 "Hello"
out_has "^Hello"
expect 0 "" "$CLI" run -m "$M" -n 6 -t 1 --temp=0.9 --top-p 0.95 --top-k 50 --min-p 0.01 --seed 7 -p Hello
cp "$out" "$tmp/s1"
expect 0 "" "$CLI" run -m "$M" -n 6 -t 2 --temp 0.9 --top-p=0.95 --top-k 50 --min-p 0.01 --seed=7 Hello
if cmp -s "$out" "$tmp/s1"; then ok; else bad "the same seed gave other text"; fi
printf 'Hello\nHow are you?\n' | { "$CLI" chat -m "$M" -n 3 -t 1 --system "Be brief." >"$out" 2>"$err"; echo $? >"$tmp/rc"; }
if [ "$(cat "$tmp/rc")" = 0 ] && [ "$(grep -c 'generated' "$err")" = 2 ]; then ok; else bad "chat: exit $(cat "$tmp/rc")"; fi
expect 0 "" "$CLI" tokenize -m "$TOK" "Hello world"
out_has "^\[[0-9]+(, [0-9]+)*\]$"
expect 0 "" "$CLI" eval -m "$M" -t 1 --top 2 "Hello"
out_has "^   0 "
printf 'To be, or not to be, that is the question.\n' >"$tmp/text.txt"
expect 0 "" "$CLI" perplexity -m "$M" -t 1 --ctx 8 "$tmp/text.txt"
out_has "mean loss [0-9.]+ nats/token, perplexity [0-9.]+"
cp "$out" "$tmp/ppl"
"$CLI" perplexity -m "$M" -t 1 --ctx 8 - <"$tmp/text.txt" >"$out" 2>"$err"
if sed 's/^-:/X:/; s/ (.*//' "$out" | cmp -s - "$(sed "s|^$tmp/text.txt:|X:|; s/ (.*//" "$tmp/ppl" >"$tmp/ppl2"; echo "$tmp/ppl2")"; then ok
else bad "perplexity of stdin differs from the file's: $(cat "$out")"; fi
expect 0 "" "$CLI" bench -m "$M" -t 1 -p 8 -n 4 --requests 2 --json
out_has "^\{.*\"load_s\":[0-9.]+.*\"mem_total_bytes\":[1-9][0-9]*.*\}$"
# the attention core's flops a prompt token: 2 x 4 heads x (2 x 32 + 8) x
# (8 + 1) / 2 keys x 3 layers = 7,776 (tiny-dsv3's shapes), per prefilled token/s
core=$(sed -n 's/.*"prefill_core_gflops":\([0-9.]*\).*"prefill_tok_s":\([0-9.]*\).*/\1 \2/p' "$out")
if echo "$core" | awk '$2 > 0 { r = $1 * 1e9 / ($2 * 7776); exit !(r > 0.99 && r < 1.01) } { exit 1 }'; then ok
else bad "prefill_core_gflops is not 7,776 flops a prompt token: $core"; fi
expect 0 "" "$CLI" info -m "$M" --check-values
out_has "deepseek_v3"
expect 2 "cm384 convert: -o FILE.gguf is required" "$CLI" convert -m "$M"
expect 2 "" "$CLI" convert -m "$M" -o "$tmp/x.gguf" --type q3
expect 0 "" "$CLI" convert -m "$M" -o "$tmp/tiny.gguf" --type q8_0
expect 0 "" "$CLI" info -m "$tmp/tiny.gguf"
out_has "deepseek"

echo "progress:"
expect 0 "" "$CLI" info -m "$M" --progress --check-values
if grep -q "loading tensors: 100%$" "$err" && grep -q "checking values: 100%$" "$err"; then ok; else bad "progress does not reach 100%"; fi
if [ "$(tail -c 1 "$err" | od -An -c | tr -d ' ')" = '\n' ]; then ok; else bad "the progress line is not ended"; fi
expect 0 "" "$CLI" bench -m "$M" -t 1 -p 8 -n 4 --requests 2 --int8 --progress --json
if grep -q "making INT8 weights: 100%$" "$err"; then ok; else bad "no INT8 progress: $(cat "$err")"; fi
out_has "\"int8\":1"
# a load that fails during the value scan: the error starts its own line
mkdir "$tmp/nan"
for f in config.json model.safetensors.index.json model-00001-of-00002.safetensors tokenizer.json tokenizer_config.json; do
    ln -s "$PWD/$M/$f" "$tmp/nan/$f"
done
cp "$M/model-00002-of-00002.safetensors" "$tmp/nan/"
size=$(wc -c <"$tmp/nan/model-00002-of-00002.safetensors")
printf '\377\377\377\377' | dd of="$tmp/nan/model-00002-of-00002.safetensors" bs=1 seek=$((size - 64)) conv=notrunc 2>/dev/null
expect 1 "^cm384: loading the model: .*is not finite" "$CLI" info -m "$tmp/nan" --progress --check-values

echo "faults (--fail):"
expect 2 "--fail \"x@3\": DEVICE@STEP" "$CLI" run -m "$M" --fail x@3
expect 2 "--fail \"3@-1\": the step" "$CLI" run -m "$M" --fail 3@-1
expect 2 "--fail \"3@2:disk\": the kind is device or link" "$CLI" run -m "$M" --fail 3@2:disk
expect 2 "--fail needs a value" "$CLI" run -m "$M" --fail
expect 2 "--fail is not an option of eval" "$CLI" eval -m "$M" --fail 2@3 Hello
expect 1 "no device 999" "$CLI" run -m "$M" -n 4 --fail 999@2 Hello
# faults change no token: an attention, an expert and a prefill device, and a link
"$CLI" run -m "$M" -n 40 -t 2 --temp 0.8 --seed 3 -p Hello >"$tmp/nofault" 2>/dev/null
expect 0 "fault: device 2 \(attention\) at step 5: 1 request re-admitted" \
    "$CLI" run -m "$M" -n 40 -t 2 --temp 0.8 --seed 3 --fail 2@5 --fail 4@8 --fail 0@12 --fail 5@9:link -p Hello
if cmp -s "$out" "$tmp/nofault"; then ok; else bad "run --fail: other text than without faults"; fi
if grep -q "link of device 5" "$err" && grep -q "device 0 (prefill)" "$err"; then ok; else bad "run --fail: faults not reported: $(cat "$err")"; fi
# no attention device left: the request ends with the error, exit 1
expect 1 "CM384_E_DEVICE.*FATAL|FATAL.*" "$CLI" run -m "$M" -n 40 -t 2 --fail 2@3 --fail 3@4 -p Hello
expect 0 "1 of the 1 faults asked for never happened" "$CLI" run -m "$M" -n 4 -t 2 --fail 2@100000 -p Hello

echo "model cache (--int8 --cache-dir):"
expect 0 "" "$CLI" run -m "$M" -n 6 -t 1 --int8 --cache-dir "$tmp/mc" -p Hello
cp "$out" "$tmp/mc_first"
if ls "$tmp/mc"/*.q8 >/dev/null 2>&1 || ls "$tmp/mc"/*/*.q8 >/dev/null 2>&1; then ok; else bad "no INT8 model cache file in $tmp/mc: $(ls -R "$tmp/mc")"; fi
expect 0 "" "$CLI" run -m "$M" -n 6 -t 1 --int8 --cache-dir "$tmp/mc" -p Hello
if cmp -s "$out" "$tmp/mc_first"; then ok; else bad "the INT8 weights from the model cache gave other text"; fi
# read into memory instead of mapped (and the model's files too): the same
# text, and the file was used, not remade (a remade one is a new inode)
ino() { ls -i "$tmp/mc"/*.q8 "$tmp/mc"/*/*.q8 2>/dev/null | awk '{print $1}' | sort | tr '\n' ' '; }
before=$(ino)
expect 0 "" "$CLI" run -m "$M" -n 6 -t 1 --int8 --no-mmap --cache-dir "$tmp/mc" -p Hello
if cmp -s "$out" "$tmp/mc_first"; then ok; else bad "the INT8 weights read from the model cache gave other text"; fi
if [ -n "$before" ] && [ "$(ino)" = "$before" ]; then ok; else bad "--no-mmap: the model cache file was remade ($before -> $(ino))"; fi

# the server's options: every number checked whole, with its range named,
# before any model is loaded (exit 2)
SERVER=$(dirname "$CLI")/cm384-server
if [ -x "$SERVER" ]; then
    echo "cm384-server options:"
    for bad_opt in "--port abc" "--port 70000" "--port -1" "--max-conns 0" "--max-body 1e99" "--timeout 0" \
                   "--ctx 1.5" "--batch 0" "--kv-pool-mib x" "--cache-mib 2q" "-t 3x" "--devices 0" \
                   "--tpot-target -3" "--prefill-share 0.95" "--prefill-share -1"; do
        # shellcheck disable=SC2086
        expect 2 "^cm384-server: ${bad_opt%% *} .*expected" "$SERVER" -m "$M" $bad_opt
    done
    expect 2 "unknown option --bogus" "$SERVER" -m "$M" --bogus 1
    expect 2 "needs a value" "$SERVER" -m "$M" --port
    expect 0 "" "$SERVER" --help
    if grep -q -- "--prefill-expanded" "$out"; then ok; else bad "the server's --help does not list --prefill-expanded"; fi

fi

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]

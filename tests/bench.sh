#!/bin/sh
# bench.sh -- `make bench`: this machine's limits, then cm384 against them.
#
#   1. limits: read bandwidth, FP32 and INT8 peaks, kernel efficiency
#   2. tokenizer: 1 MB of mixed text
#   3. per model (bench-S, bench-M, V2-Lite cut to 4 layers; written by
#      models/gen/gen_synth into build/models the first time) in BF16 and
#      INT8: prefill of a 512-token prompt, single-stream decode of 128
#      tokens, 16-stream decode -- as tok/s, GB/s against the measured
#      bandwidth, GOP/s against the measured peak, tok/s per TFLOPS
#      3b. llama.cpp's llama-bench on the same weights, when the peer is built
#      3c. decode after prompts of 16 to 4,000 tokens (what the context costs)
#      3d. bf16 decode with the files mapped against read into huge pages
#      3e. INT8 prefill on a fresh engine's pool against a prefaulted one
#      3f. where a prefill and a decode step spend their time (--profile)
#   4. the supernode: decode scaling over 1/4/16/64 streams, the emulation
#      tax (default topology vs one device), the paper preset
#   5. context cache and INT8 dispatch
#   6-7. peers under arriving prompts; the context cache by tier
#   8. the SLO controller: Table 4's shape (cm384 bench --slo)
#   9. EPLB off and on over a skewed workload
#  10. faults: what recovering from each kind took
#  11. MTP: acceptance, tokens per step and the cost of a step with a draft,
#      at 1 stream and (bench-M INT8) at 16
#  12. prefill attention: absorbed against expanded (--prefill-expanded) and the
#      native-BF16 core (--kv-bf16 --kernels avx512_bf16, on AVX512_BF16 CPUs)
#  13. an AVX2 machine's instructions on this one: cm384's avx2 kernel set
#      against llama.cpp built for AVX2 only (LLAMA_ISA=avx2 make peer),
#      when this CPU has AVX-512 and that build is there; the same for
#      avx_vnni (LLAMA_ISA=avx_vnni make peer)
# Numbers are medians of RUNS runs (default 3); the machine is shared.
# BENCH_MODELS="bench-S" limits the models; BENCH_QUICK=1 runs less.
B=${B:-build}
RUNS=${RUNS:-3}
T=${THREADS:-2}
M=$B/models
CLI=$B/cm384
MODELS=${BENCH_MODELS:-"bench-S bench-M v2lite4"}
[ -n "$BENCH_QUICK" ] && RUNS=1
SECTIONS=${BENCH_SECTIONS:-"1 2 3 4 5 6 7 8 9 10 11 12 13"}
want() { case " $SECTIONS " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$M"

jget() { echo "$1" | sed -n "s/.*\"$2\":\([-0-9.e]*\).*/\1/p" | head -n 1; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else printf "-" }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else printf "-" }'; }

echo "== 1. machine limits ($(nproc) CPUs, $T threads; load average $(cut -d' ' -f1 /proc/loadavg))"
# one run: its table is printed (section 1) and its limits are the ones used below
if want 1; then
    $B/bench_kernels --json-out "$B/limits.json" 2>/dev/null | sed -n '1,40p'
else
    $B/bench_kernels --json >"$B/limits.json" 2>/dev/null
fi
BW=$(grep '"read bandwidth, 2 threads"' "$B/limits.json" | sed -n 's/.*"value":\([0-9.]*\).*/\1/p' | head -n 1)
BW1=$(grep '"read bandwidth, 1 thread"' "$B/limits.json" | sed -n 's/.*"value":\([0-9.]*\).*/\1/p' | head -n 1)
FP=$(grep '"bench":"fp32 FMA peak' "$B/limits.json" | sed -n 's/.*"value":\([0-9.]*\).*/\1/p' | head -n 1)
I8=$(grep '"bench":"int8 [a-z-]* peak' "$B/limits.json" | sed -n 's/.*"value":\([0-9.]*\).*/\1/p' | head -n 1)
echo "limits used below: read ${BW} GB/s (1 thread ${BW1}), FP32 ${FP} GFLOP/s, INT8 ${I8} GOP/s"

if want 2; then
echo
echo "== 2. tokenizer"
$B/test_tokenizer 2>/dev/null | grep 'benchmark:'
fi

gen() {   # gen NAME PRESET ARGS...
    name=$1; preset=$2; shift 2
    [ -f "$M/$name/config.json" ] && return 0
    echo "writing $M/$name (gen_synth --preset $preset $*)"
    $B/gen_synth --preset "$preset" "$@" --tokenizer tests/fixtures/tiny-dsv3 -q --force "$M/$name" || exit 1
}
for name in $MODELS; do
    case $name in
        bench-S) gen bench-S bench-S ;;
        bench-M) gen bench-M bench-M ;;
        v2lite4) gen v2lite4 v2-lite --set num_hidden_layers=4 --set bos_token_id=0 --set eos_token_id=1 ;;
    esac
done
# The weight files leave the page cache once, so that the first mapped load
# reads them as a load after a reboot would (2 MB folios, docs/performance.md)
# and not in the small folios they were written or last read in, whichever
# session that was.  GNU dd only; elsewhere nothing happens.
for name in $MODELS; do
    for f in "$M/$name"/*.safetensors; do
        [ -f "$f" ] && dd if="$f" iflag=nocache count=0 status=none 2>/dev/null
    done
done

# run N times, print the median of a JSON field list: "f1 f2 ..." -> "m1 m2 ..."
# A field "f/bw", "f/fp32" or "f/int8" is f over the read bandwidth, FP32 or
# INT8 peak measured just before that run (bench_kernels --now), or over
# section 1's if that was higher: on a shared machine the limits drift, and
# a ratio against one measured minutes earlier can pass 100%; the higher of
# the two never flatters a run.
bench_median() {   # bench_median "fields" cli-args...
    fields=$1; shift
    outs=""
    i=0
    while [ $i -lt "$RUNS" ]; do
        lim=""
        case " $fields " in *"/"*) lim=$($B/bench_kernels --now 2>/dev/null) ;; esac
        o=$($CLI bench "$@" --json 2>/dev/null)
        outs="$outs
$o limits_before= $lim"
        i=$((i + 1))
    done
    res=""
    for f in $fields; do
        case $f in
        roof/fp32 | roof/int8)   # decode's roofline (cm384_stats.decode_roof_*) over its time
            pk=$I8; [ "$f" = roof/fp32 ] && pk=$FP
            v=$(echo "$outs" | grep 'limits_before=' | awk -v gb="${BW:-0}" -v gf="${FP:-0}" -v gp="${pk:-0}" -v fp32="$([ "$f" = roof/fp32 ] && echo 1 || echo 0)" '
                function field(name,   i, t) { i = index($0, "\"" name "\":"); if (!i) return ""; t = substr($0, i + length(name) + 3); sub(/[],}].*/, "", t); return t }
                function list(name, a,   i, t) { i = index($0, "\"" name "\":["); if (!i) return 0; t = substr($0, i + length(name) + 4); sub(/\].*/, "", t); return split(t, a, ",") }
                {
                    split(substr($0, index($0, "limits_before=") + 15), L, " ")
                    bw = L[1] > gb ? L[1] : gb; fp = L[2] > gf ? L[2] : gf; pk = fp32 ? fp : (L[3] > gp ? L[3] : gp)
                    n = list("decode_roof_bytes", b); list("decode_roof_macs", m)
                    ds = field("decode_seconds"); core = field("decode_roof_core_flops")
                    if (!n || ds <= 0 || bw <= 0 || pk <= 0 || fp <= 0) next
                    t = core / (fp * 1e9)
                    for (i = 1; i <= n; i++) { x = b[i] / (bw * 1e9); y = 2 * m[i] / (pk * 1e9); t += x > y ? x : y }
                    print t / ds
                }' | median) ;;
        */bw | */fp32 | */int8)
            col=3; g=$BW; case $f in */fp32) col=4; g=$FP ;; */int8) col=5; g=$I8 ;; esac
            v=$(echo "$outs" | sed -n "s/.*\"${f%/*}\":\([-0-9.e]*\).* limits_before= \(.*\)\$/\1 \2/p" |
                awk -v c="$col" -v g="${g:-0}" '{ l = $(c - 1); if (g > l) l = g } l > 0 { print $1 / l }' | median) ;;
        *) v=$(echo "$outs" | sed -n "s/.*\"$f\":\([-0-9.e]*\).*/\1/p" | median) ;;
        esac
        res="$res $v"
    done
    echo "$res"
}

# llama.cpp on the same machine: LLAMA_BENCH=path/to/llama-bench and
# LLAMA_GGUF_DIR holding <model>-q8_0.gguf and <model>-bf16.gguf (converted
# from build/models/<model>); by default the peer `make peer` builds beside
# the main checkout and the files tests/peer/gguf.sh writes there
PEER=${PEER_DIR:-$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's|/\.git$||')/../peer}
[ -z "$LLAMA_BENCH" ] && [ -x "$PEER/bin/llama-bench" ] && LLAMA_BENCH=$PEER/bin/llama-bench
LLAMA_GGUF_DIR=${LLAMA_GGUF_DIR:-$PEER/gguf}

# llama-bench (path $1) against cm384 on the same weights, each model and
# type: cm384 with --kernels $2 if given; $3 = bf16star adds cm384's opt-in
# avx512_bf16 set against llama.cpp's BF16 (on CPUs that have it)
peer_table() {
    printf '%-9s %-5s | %12s %12s %7s | %12s %12s %7s\n' model dtype "llama pp512" "cm384 pp512" ratio "llama tg128" "cm384 tg128" ratio
    for name in $MODELS; do
        for q in q8_0 bf16; do
            g="$LLAMA_GGUF_DIR/$name-$q.gguf"
            [ -f "$g" ] || continue
            flag=""; [ -n "$2" ] && flag="--kernels $2"; [ "$q" = q8_0 ] && flag="$flag --int8"
            out=$("$1" -m "$g" -p 512 -n 128 -t "$T" -r "$RUNS" -o csv 2>/dev/null)
            lpp=$(echo "$out" | grep '"512","0"' | awk -F'","' '{print $(NF-1)}' | head -n 1)
            ltg=$(echo "$out" | grep '"0","128"' | awk -F'","' '{print $(NF-1)}' | head -n 1)
            cpp=$(bench_median "prefill_tok_s" -m "$M/$name" -p 512 -n 1 --requests 1 -t "$T" $flag)
            ctg=$(bench_median "decode_tok_s" -m "$M/$name" -p 1 -n 128 --requests 1 -t "$T" $flag)
            printf '%-9s %-5s | %12.1f %12.1f %7s | %12.1f %12.1f %7s\n' "$name" "$q" "$lpp" $cpp "$(ratio $cpp "$lpp")" "$ltg" $ctg "$(ratio $ctg "$ltg")"
            # llama.cpp's BF16 rounds the activations to bf16 for vdpbf16ps:
            # cm384's opt-in set that does the same, against the same figures
            if [ "$3" = bf16star ] && [ "$q" = bf16 ] && grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null; then
                cpp=$(bench_median "prefill_tok_s" -m "$M/$name" -p 512 -n 1 --requests 1 -t "$T" --kernels avx512_bf16)
                ctg=$(bench_median "decode_tok_s" -m "$M/$name" -p 1 -n 128 --requests 1 -t "$T" --kernels avx512_bf16)
                printf '%-9s %-5s | %12.1f %12.1f %7s | %12.1f %12.1f %7s\n' "$name" "bf16*" "$lpp" $cpp "$(ratio $cpp "$lpp")" "$ltg" $ctg "$(ratio $ctg "$ltg")"
            fi
        done
    done
}

if want 3; then
echo
echo "== 3. models: prefill 512 tokens, decode 128 tokens (1 stream), decode 16 streams; medians of $RUNS"
printf '%-9s %-5s | %9s %8s %7s %6s | %9s %8s %7s %9s | %9s %7s %9s %6s %6s %6s\n' model dtype "prefill" "GOP/s" "%peak" "bound" \
    "decode" "GB/s" "%bw" "tok/s/TF" "16 strm" "x 1-st" "ceiling" "%ceil" "alone" "%roof"
for name in $MODELS; do
    for q in bf16 int8; do
        flag=""; peak=$FP; lk=fp32
        [ "$q" = int8 ] && flag="--int8" && peak=$I8 && lk=int8
        set -- $(bench_median "prefill_tok_s prefill_gops decode_tok_s decode_weight_gbs decode_weight_gbs/bw prefill_gops/$lk prefill_core_gflops" \
            -m "$M/$name" -p 512 -n 128 --requests 1 -t "$T" $flag)
        pf=$1; gops=$2; dec=$3; gbs=$4; fbw=$5; fpk=$6; cgf=$7
        # bound: the %peak a prompt would reach with its products at this
        # peak and the attention core's fp32 flops at the FP32 peak, both
        # at 100% (the core is exact fp32 whatever the weights)
        bound=$(awk -v w="$gops" -v c="$cgf" -v p="$peak" -v f="$FP" 'BEGIN { if (w > 0 && f > 0) print 1 / (1 + c / w * p / f); else print 0 }')
        set -- $(bench_median "decode_tok_s decode_steps_weight_gbs decode_steps_weight_gbs/bw decode_alone_weight_gbs/bw roof/$lk" \
            -m "$M/$name" -p 64 -n 64 --requests 16 --concurrency 16 -t "$T" $flag)
        n16=$1; g16=$2; f16=$3; fa16=$4; fr16=$5
        # the ceiling: the steps' own weight bytes (each distinct expert once) at the read bandwidth
        # measured beside the runs (their median share of it, f16, is %ceil)
        ceil=$(awk -v n="$n16" -v f="$f16" 'BEGIN { if (f > 0) printf "%.1f", n / f; else print 0 }')
        tf=$(awk -v d="$dec" -v p="$peak" 'BEGIN { printf "%.1f", d / (p / 1000) }')
        printf '%-9s %-5s | %9.1f %8.1f %7s %6s | %9.1f %8.2f %7s %9s | %9.1f %7s %9.1f %6s %6s %6s\n' "$name" "$q" "$pf" "$gops" "$(pct "$fpk" 1)" "$(pct "$bound" 1)" \
            "$dec" "$gbs" "$(pct "$fbw" 1)" "$tf" $n16 "$(ratio $n16 "$dec")" "$ceil" "$(pct "$f16" 1)" "$(pct "$fa16" 1)" "$(pct "$fr16" 1)"
    done
done
echo "(prefill GOP/s = 2 x active parameters but the head x tok/s; GB/s = active weight bytes read per token x tok/s;"
echo " %peak against the FP32 peak for bf16 and the INT8 peak for int8; bound = the %peak if the products ran at that"
echo " peak and the attention core's fp32 flops (prefill_core_gflops) at the FP32 peak, both at 100%: what the exact"
echo " core leaves reachable; tok/s/TF = decode tok/s per TFLOPS of that peak;"
echo " ceiling = 16-stream tok/s if the weight bytes its steps read -- each distinct expert once per step -- streamed"
echo " at the read bandwidth; %ceil = 16-stream tok/s against it; alone = the same over the decode steps no prefill"
echo " step ran beside (the prompts arrive together: many steps share the workers with their prefill, and the last"
echo " have the requests that finished it late); %roof = the 16-stream steps' roofline over their time: each product"
echo " at the slower of its bytes at the read bandwidth and its multiply-adds at the peak, the core's flops at the"
echo " FP32 peak (cm384.h, decode_roof_*): above %ceil where products compute longer than they read.  %peak, %bw,"
echo " %ceil and %roof: each run against the limit"
echo " measured just before it (bench_kernels --now) or the one above, whichever is higher; median over runs)"

if [ -n "$LLAMA_BENCH" ] && [ -x "$LLAMA_BENCH" ]; then
    echo
    echo "== 3b. llama.cpp on this machine (llama-bench, $T threads) against cm384 on the same weights"
    peer_table "$LLAMA_BENCH" "" bf16star
    echo "(q8_0: llama.cpp Q8_0 against cm384 INT8 W8A8; bf16 against bf16 (cm384 exact: fp32 activations, FMA).  bf16*:"
    echo " cm384 --kernels avx512_bf16, activations rounded to bf16 for vdpbf16ps as llama.cpp's BF16 path does (opt-in,"
    echo " not the default: README, Kernel sets).  tg128 and cm384's decode here start from an empty context, as"
    echo " llama-bench does; both sides warm up first)"
fi

# what the context costs a decoded token: the attention core reads and scores
# the sequence's whole latent cache (576 floats a key, every layer) each step
LC=$M/bench-M
if [ -f "$LC/config.json" ] && [ -z "$BENCH_QUICK" ]; then
    echo
    echo "== 3c. decode over a long context: bench-M int8, 1 stream, 64 tokens after a prompt of P tokens; medians of $RUNS"
    printf '%-7s | %9s %9s %9s\n' prompt "tok/s" "ms/token" "context"
    base=""
    for p in 16 512 2048 4000; do
        set -- $(bench_median "decode_tok_s" -m "$LC" -p $p -n 64 --ctx 4096 --requests 1 -t "$T" --int8 --no-warmup)
        ms=$(awk -v d="$1" 'BEGIN { if (d > 0) printf "%.2f", 1000 / d; else print 0 }')
        [ -z "$base" ] && base=$ms
        printf '%-7s | %9.1f %9s %9s\n' $p "$1" "$ms" "$(awk -v m="$ms" -v b="$base" 'BEGIN { if (m > 0) printf "%.0f%%", 100 * (m - b) / m }')"
    done
    echo "(context: the share of a token's time that its context adds over a 16-token one -- the attention core;"
    echo " a lone query's core runs as four lanes over the keys, docs/how-it-works.md section 10)"
fi

# bf16 weights are the file's own bytes: mapped (4 KB pages of the page
# cache) or, with --no-mmap, read into memory advised for 2 MB pages
echo
echo "== 3d. bf16 decode (1 stream, 128 tokens): the files mapped (default) against read into huge pages (--no-mmap); medians of $RUNS"
printf '%-9s | %9s %7s %7s | %9s %7s %7s | %7s\n' model "mapped/s" "%bw" "load s" "read/s" "%bw" "load s" ratio
for name in $MODELS; do
    [ -f "$M/$name/config.json" ] || continue
    set -- $(bench_median "decode_tok_s decode_weight_gbs/bw load_s" -m "$M/$name" -p 1 -n 128 --requests 1 -t "$T")
    a=$1; abw=$2; al=$3
    set -- $(bench_median "decode_tok_s decode_weight_gbs/bw load_s" -m "$M/$name" -p 1 -n 128 --requests 1 -t "$T" --no-mmap)
    printf '%-9s | %9.1f %7s %7.2f | %9.1f %7s %7.2f | %7s\n' "$name" "$a" "$(pct "$abw" 1)" "$al" "$1" "$(pct "$2" 1)" "$3" "$(ratio "$1" "$a")"
done
echo "(a streamed page costs a TLB miss: 4 KB pages for a mapping, 2 MB for memory read in.  INT8 weights, made at"
echo " load, are always in one huge-page block.  --no-mmap costs the read at load and keeps the weights in the"
echo " process's own memory rather than the page cache)"

# a fresh engine's prompts write KV blocks no one has touched: each first
# touch is a page fault the prompt waits for, unless the pool was touched
# at creation (--prefault); interleaved, as the machine drifts
echo
echo "== 3e. INT8 prefill, 4 prompts of 512 tokens one after another: a fresh pool (default) against --prefault; medians of $RUNS"
printf '%-9s | %9s | %10s | %7s\n' model "fresh/s" "prefault/s" ratio
for name in $MODELS; do
    [ -f "$M/$name/config.json" ] || continue
    a=""; b=""; i=0
    while [ $i -lt "$RUNS" ]; do
        a="$a $(jget "$($CLI bench -m "$M/$name" --int8 -p 512 -n 1 --requests 4 --concurrency 1 -t "$T" --json 2>/dev/null)" prefill_tok_s)"
        b="$b $(jget "$($CLI bench -m "$M/$name" --int8 -p 512 -n 1 --requests 4 --concurrency 1 -t "$T" --prefault --json 2>/dev/null)" prefill_tok_s)"
        i=$((i + 1))
    done
    a=$(echo "$a" | median); b=$(echo "$b" | median)
    printf '%-9s | %9.1f | %10.1f | %7s\n' "$name" "$a" "$b" "$(ratio "$b" "$a")"
done
echo "(the pool's KV blocks and scratch: a prompt of 512 tokens writes fresh KV pages until the context cache"
echo " holds half the pool; --prefault moves those faults to engine creation, and the process then holds the"
echo " whole pool)"

# the profile behind the figures above: where a prefill and a decode step
# spend their time, stage by stage, as the engine's own clock has it
echo
echo "== 3f. where a step's time goes: INT8, a 512-token prompt then 128 tokens decoded, 1 stream (--profile, one run)"
for name in $MODELS; do
    [ -f "$M/$name/config.json" ] || continue
    echo "-- $name"
    $CLI bench -m "$M/$name" --int8 -p 512 -n 128 --requests 1 -t "$T" --prefault --profile 2>/dev/null |
        sed -n '/^where /,$p' | awk '/^where /{n=0} {n++; if (n <= 12 || /between stages/) print}'
done
echo "(each stage: from its first task's start to its last task's end in every region that ran it, summed over the"
echo " steps; the share is of the phase's busy time; the ten longest shown, then the time between stages)"
fi
SM=$M/bench-M
[ -f "$SM/config.json" ] || SM=$M/bench-S
if want 4; then
echo
echo "== 4. the supernode on $(basename "$SM") (bf16): decode scaling and the emulation tax"
printf '%-8s | %14s %14s %9s | %14s\n' streams "default tok/s" "1 device tok/s" "tax" "paper tok/s"
TAXRUNS=$((RUNS + 2))
for s in 1 4 16 64; do
    R=$s; [ $s -lt 8 ] && R=8
    # interleaved, so a drift of the shared machine hits all three alike
    dl=""; ol=""; pl=""
    i=0
    while [ $i -lt $TAXRUNS ]; do
        for p in default single paper; do
            v=$($CLI bench -m "$SM" -p 32 -n 64 --requests $R --concurrency $s -t "$T" --no-int8-dispatch --preset $p --json 2>/dev/null)
            v=$(jget "$v" decode_tok_s)
            case $p in default) dl="$dl $v" ;; single) ol="$ol $v" ;; paper) pl="$pl $v" ;; esac
        done
        i=$((i + 1))
    done
    d=$(echo $dl | median); one=$(echo $ol | median); pp=$(echo $pl | median)
    tax=$(awk -v a="$d" -v b="$one" 'BEGIN { printf "%+.1f%%", 100 * (b - a) / b }')
    printf '%-8s | %14.1f %14.1f %9s | %14.1f\n' "$s" "$d" "$one" "$tax" "$pp"
done
echo "(medians of $TAXRUNS interleaved runs; tax = how much slower the default topology decodes than one device doing everything; target within 10%)"

fi
if want 5; then
echo
echo "== 5. context cache and INT8 dispatch on $(basename "$SM")"
for sp in 0 0.5 0.9; do
    o=$($CLI bench -m "$SM" -p 256 -n 8 --requests 12 --concurrency 4 --shared-prefix $sp --tenants 2 -t "$T" --json 2>/dev/null)
    printf 'shared prefix %3.0f%%: cache hit ratio %5.1f%%, TTFT p50 %7.1f ms, p99 %7.1f ms, prefill %7.1f tok/s\n' \
        "$(awk -v x=$sp 'BEGIN{print 100*x}')" "$(awk -v x="$(jget "$o" cache_hit_ratio)" 'BEGIN{print 100*x}')" \
        "$(jget "$o" ttft_p50_ms)" "$(jget "$o" ttft_p99_ms)" "$(jget "$o" prefill_tok_s)"
done
for d in on off; do
    flag="--int8-dispatch"; [ $d = off ] && flag="--no-int8-dispatch"
    o=$($CLI bench -m "$SM" -p 64 -n 32 --requests 8 --concurrency 8 -t "$T" $flag --json 2>/dev/null)
    printf 'INT8 dispatch %-3s: dispatch %8.2f MB (bf16 would be %8.2f MB), combine %8.2f MB\n' "$d" \
        "$(awk -v x="$(jget "$o" dispatch_bytes)" 'BEGIN{print x/1e6}')" \
        "$(awk -v x="$(jget "$o" dispatch_bytes_bf16)" 'BEGIN{print x/1e6}')" \
        "$(awk -v x="$(jget "$o" combine_bytes)" 'BEGIN{print x/1e6}')"
done
echo
fi
SS=$M/bench-S
[ -f "$SS/config.json" ] || gen bench-S bench-S
if want 6; then
echo
echo "== 6. peers on $(basename "$SS"): 16 requests decoding while prompts of 2048 tokens keep arriving (one in flight)"
printf '%-18s %-9s | %9s %9s | %9s %9s | %10s %10s %8s %9s\n' loop arrivals "gap p50" "gap p99" "TPOT p50" "TPOT p99" \
    "prompt/s" "total/s" "in-pref" "arr TTFT"
for mode in peers lend-0.5 time-shared; do
    flag=""; [ $mode = time-shared ] && flag="--time-shared"; [ $mode = lend-0.5 ] && flag="--prefill-share 0.5"
    for a in 0 2048; do
        o=$(bench_median "itl_p50_ms itl_p99_ms req_tpot_p50_ms req_tpot_p99_ms arrival_tok_s total_tok_s decode_steps_in_prefill arrival_ttft_mean_ms" \
            -m "$SS" -p 64 -n 64 --requests 16 --concurrency 16 -t "$T" --arrivals $a $flag)
        set -- $o
        printf '%-18s %-9s | %9.2f %9.2f | %9.2f %9.2f | %10.1f %10.1f %8s %9.1f\n' $mode $a $1 $2 $3 $4 $5 $6 $7 $8
    done
    o=$(bench_median "arrival_tok_s" -m "$SS" -p 64 -n 1 --requests 0 --arrivals 2048 --arrival-count 3 -t "$T" $flag)
    printf '%-18s prefill alone: %.1f prompt tok/s\n' $mode $o
done
echo "(gaps = ms between consecutive tokens of the 16 decoding requests; TPOT = each request's mean gap, p50/p99 over"
echo " the 16; prompt/s = arriving prompt tokens per second of wall time; total/s = generated + prefilled tokens per"
echo " second; in-pref = decode steps that completed inside a prefill step; arr TTFT = the arriving prompts' mean"
echo " time to first token, ms; peers: decode first (the default),"
echo " lend-0.5: decode lends prefill half the time while both have work (--prefill-share 0.5). Medians of $RUNS runs.)"
fi
if want 7; then
echo
echo "== 7. context cache by tier on $(basename "$SS"): 12 prompts of 512 tokens, 8 generated, one at a time"
CD=$(mktemp -d)
printf '%-7s %-6s | %9s %9s | %11s %11s %8s\n' prefix tier "hit %" "TTFT p50" "prefill/s" "effective/s" "x none"
for sp in 0.5 0.9; do
    base=""
    for tier in none pool disk; do
        args="-m $SS -p 512 -n 8 --requests 12 --concurrency 1 -t $T --shared-prefix $sp"
        case $tier in
            none) o=$($CLI bench $args --tenants 12 --json 2>/dev/null) ;;
            pool) o=$($CLI bench $args --tenants 1 --json 2>/dev/null) ;;
            disk) rm -rf "$CD"/*; $CLI bench $args --tenants 12 --cache-dir "$CD" --json >/dev/null 2>&1
                  o=$($CLI bench $args --tenants 12 --cache-dir "$CD" --seed 1 --json 2>/dev/null) ;;
        esac
        hit=$(jget "$o" cache_hit_ratio); pf=$(jget "$o" prefill_tok_s); tt=$(jget "$o" ttft_p50_ms)
        eff=$(awk -v p="$pf" -v h="$hit" 'BEGIN { printf "%.1f", (h < 1) ? p / (1 - h) : 0 }')
        [ $tier = none ] && base=$eff
        printf '%-7s %-6s | %9.1f %9.1f | %11.1f %11.1f %8s\n' "$(awk -v x=$sp 'BEGIN{print 100*x}')%" $tier \
            "$(awk -v x="$hit" 'BEGIN{print 100*x}')" "$tt" "$pf" "$eff" "$(ratio "$eff" "$base")"
    done
done
rm -rf "$CD"
echo "(none: every prefix its own; pool: one prefix shared in memory; disk: each request's prefix written by an earlier"
echo " engine to --cache-dir and loaded by the caching loop; effective/s = prompt tokens served per second of prefill"
echo " compute. The paper: x1.42 prefill throughput at 50% reuse, x2.28 at 90%.)"
fi
if want 8; then
echo
echo "== 8. the SLO controller on $(basename "$SS"): 64 requests x (16 + 256) tokens, all in flight (Table 4's shape)"
$CLI bench -m "$SS" -p 16 -n 256 --requests 64 --concurrency 64 -t "$T" --slo 2,4,8,16 2>/dev/null
echo "(the paper, Table 4, DeepSeek-R1 decode: 50 ms -> batch 96, 1,943 tok/s/NPU; 30 ms -> 974; 15 ms -> 538."
echo " bench-S has random weights: MTP's drafts are rarely accepted, so MTP costs here what it buys there.)"
fi
if want 9; then
echo
echo "== 9. EPLB on $(basename "$SS"): 16 streams decoding prompts that repeat one phrase (routing skewed); medians of $RUNS"
printf '%-6s | %14s %14s | %10s\n' EPLB "max/mean load" "re-placements" "decode/s"
for p in -1 0; do
    o=$(bench_median "expert_load_max_over_mean eplb_runs decode_tok_s" -m "$SS" --skewed -p 64 -n 256 --requests 16 \
        --concurrency 16 -t "$T" --eplb-period $p)
    set -- $o
    printf '%-6s | %14s %14s | %10s\n' "$([ $p = -1 ] && echo off || echo on)" "$1" "$2" "$3"
done
echo "(max/mean: decode rows on the busiest routed-expert device over the mean, per layer; 1 = even.  Every device"
echo " runs on the same $T cores here, so an even load buys little time: the real supernode's step waits for its busiest device.)"
fi
if want 10; then
echo
echo "== 10. faults on $(basename "$SS"): 16 requests, an expert, an attention and a prefill device fail, and a link drops"
$CLI bench -m "$SS" -p 128 -n 64 --requests 16 --concurrency 16 -t "$T" --fail 4@6 --fail 2@12 --fail 0@3 --fail 5@9:link \
    2>&1 >/dev/null | grep '^fault'
echo "(recovery: from the fault until every request it hit is back where it was; tests/test_faults.c checks the tokens)"
fi
if want 11; then
echo
echo "== 11. MTP speculative decoding, 1 stream, 256 tokens: plain, --mtp-always and --mtp (gated) in the same run; medians of $RUNS"
printf '%-11s %-5s | %8s | %8s %8s %8s %9s %9s %7s | %8s %8s %7s\n' model dtype "plain/s" "always/s" accepted "tok/step" "step cost" "step bytes" "x plain" \
    "gated/s" drafted "x plain"
for spec in bench-M:int8 bench-M:bf16 shakespeare:bf16; do
    name=${spec%%:*}; q=${spec#*:}
    dir=$M/$name; [ "$name" = shakespeare ] && dir=models/shakespeare
    [ -f "$dir/config.json" ] || continue
    flag=""; [ "$q" = int8 ] && flag="--int8"
    set -- $(bench_median "decode_tok_s decode_weight_bytes decode_steps" -m "$dir" -p 16 -n 256 --requests 1 -t "$T" $flag)
    p0=$1; b0=$2; s0=$3
    set -- $(bench_median "decode_tok_s mtp_drafted mtp_accepted decode_steps decode_weight_bytes" -m "$dir" -p 16 -n 256 --requests 1 -t "$T" $flag --mtp-always)
    p1=$1; dr=$2; ac=$3; st=$4; b1=$5
    set -- $(bench_median "decode_tok_s mtp_drafted decode_steps" -m "$dir" -p 16 -n 256 --requests 1 -t "$T" $flag --mtp)
    awk -v name="$name" -v q="$q" -v p0="$p0" -v p1="$p1" -v dr="$dr" -v ac="$ac" -v st="$st" -v g="$1" -v gd="$2" -v gs="$3" \
        -v b0="$b0" -v s0="$s0" -v b1="$b1" 'BEGIN {
        tps = st > 0 ? 1 + ac / st : 1                  # a step emits its token, and the draft when accepted
        cost = p1 > 0 ? tps * p0 / p1 : 0               # time of a step with a draft / a plain step
        bytes = (b0 > 0 && st > 0) ? (b1 / st) / (b0 / s0) : 0   # weight bytes such a step reads / a plain one
        printf "%-11s %-5s | %8.1f | %8.1f %7.1f%% %8.2f %8.2fx %8.2fx %6.2fx | %8.1f %7.0f%% %6.2fx\n", name, q, p0, p1, (dr > 0 ? 100 * ac / dr : 0),
               tps, cost, bytes, (p0 > 0 ? p1 / p0 : 0), g, (gs > 0 ? 100 * gd / gs : 0), (p0 > 0 ? g / p0 : 0) }'
done
echo "(always: every decode step verifies a draft; step cost: such a step against a plain one, from tok/s and tokens per"
echo " step.  gated (--mtp, config.mtp = 1): drafts while (1 + acceptance) x a plain step beats a drafting step, as its"
echo " own steps measure them; drafted = steps that verified a draft.  bench-M's weights are random: its drafts are almost"
echo " never accepted.  step bytes: the weight bytes a drafting step reads against a plain one's -- the draft row's own"
echo " experts, the MTP layer and the head again -- counted, not timed: in memory-bound decode the step cost cannot go"
echo " below it.  Target: step cost <= 1.25x; MTP a net gain on the trained model (the paper: +6% to +49% at ~70%).)"
if [ -f "$M/bench-M/config.json" ]; then
    # 16 streams: nearly every expert is read with or without drafts, so what
    # a draft adds is rows -- 32 instead of 16 through the dense products
    set -- $(bench_median "tpot_p50_ms" -m "$M/bench-M" --int8 -p 16 -n 128 --requests 16 --concurrency 16 -t "$T")
    tp=$1
    set -- $(bench_median "tpot_p50_ms mtp_drafted mtp_accepted" -m "$M/bench-M" --int8 -p 16 -n 128 --requests 16 \
        --concurrency 16 -t "$T" --mtp-always)
    awk -v tp="$tp" -v ta="$1" -v dr="$2" -v ac="$3" 'BEGIN {
        tps = dr > 0 ? 1 + ac / dr : 1                  # tokens a request gets from a drafting step
        printf "bench-M int8, 16 streams: TPOT p50 plain %.2f ms, drafting every step %.2f ms (%.1f%% accepted): a drafting step costs %.2fx a plain one\n",
               tp, ta, (dr > 0 ? 100 * ac / dr : 0), (tp > 0 ? ta * tps / tp : 0) }'
    echo "(this CPU does $(awk -v i="$I8" -v b="$BW" 'BEGIN { printf "%.0f", (b > 0 ? i / b : 0) }') INT8 operations per byte it reads (section 1): 32 rows are past the point where"
    echo " arithmetic, not memory, sets a product's pace; a 910C die does ~470: docs/how-it-works.md, section 7)"
fi
fi
if want 12; then
echo
echo "== 12. prefill attention: absorbed (the default) against expanded (--prefill-expanded) and, on a CPU with AVX512_BF16,"
echo "   the native-BF16 core (--kv-bf16 --kernels avx512_bf16), 1 request; medians of $RUNS"
nat=""; grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null && nat=1
printf '%-9s %-5s %7s | %11s %11s %7s | %11s %7s %7s\n' model dtype prompt "absorbed/s" "expanded/s" ratio "bf16core/s" ratio "%peak"
for name in $MODELS; do
    for q in int8 bf16; do
        flag=""; lk=fp32; [ "$q" = int8 ] && flag="--int8" && lk=int8
        for p in 512 2048; do
            a=$(bench_median "prefill_tok_s" -m "$M/$name" -p $p -n 2 --requests 1 -t "$T" $flag)
            x=$(bench_median "prefill_tok_s" -m "$M/$name" -p $p -n 2 --requests 1 -t "$T" $flag --prefill-expanded)
            n=0; np=0
            [ -n "$nat" ] && set -- $(bench_median "prefill_tok_s prefill_gops/$lk" -m "$M/$name" -p $p -n 2 --requests 1 \
                -t "$T" $flag --kv-bf16 --kernels avx512_bf16) && n=$1 && np=$2
            pk=$(pct "$np" 1)
            [ "$q" = int8 ] || pk=-    # bf16 weights then use the BF16 dot product, not the FP32 peak of section 3
            printf '%-9s %-5s %7d | %11.1f %11.1f %7s | %11.1f %7s %7s\n' "$name" "$q" "$p" "$a" "$x" "$(ratio "$x" "$a")" \
                "$n" "$(ratio "$n" "$a")" "$pk"
        done
    done
done
echo "(expanded: each chunk of 256 cached latents expanded per head into K and V, queries attending with head dimension"
echo " 192/128 instead of 576/512; prompts are prefilled 512 tokens a step, so a 2,048-token prompt expands its first"
echo " keys four times.  Same model, other rounding than the absorbed decode path: off by default.  bf16core: the"
echo " absorbed core over a bf16 latent cache with its queries and softmax weights rounded to bf16 for vdpbf16ps (and,"
echo " for bf16 weights, their products too), the same bits prefilled or decoded; %peak: against the INT8 peak, as in"
echo " section 3 (int8 only).  Both approximations are opt-in: README, Kernel sets)"
fi
LLAMA_BENCH_AVX2=${LLAMA_BENCH_AVX2:-$PEER/bin-avx2/llama-bench}
LLAMA_BENCH_AVXVNNI=${LLAMA_BENCH_AVXVNNI:-$PEER/bin-avxvnni/llama-bench}
if want 13 && grep -q avx512f /proc/cpuinfo 2>/dev/null; then
    if [ -x "$LLAMA_BENCH_AVX2" ]; then
        echo
        echo "== 13. avx2 only, on this CPU: cm384 --kernels avx2 against llama.cpp built without AVX-512 or VNNI ($T threads)"
        peer_table "$LLAMA_BENCH_AVX2" avx2
    fi
    if grep -q avx_vnni /proc/cpuinfo 2>/dev/null && [ -x "$LLAMA_BENCH_AVXVNNI" ]; then
        echo
        echo "== 13. avx_vnni only, on this CPU: cm384 --kernels avx_vnni against llama.cpp built with AVX-VNNI, without AVX-512 ($T threads)"
        peer_table "$LLAMA_BENCH_AVXVNNI" avx_vnni
    fi
    if [ -x "$LLAMA_BENCH_AVX2" ] || [ -x "$LLAMA_BENCH_AVXVNNI" ]; then
        echo "(the instructions of an AVX2 machine -- Haswell to Zen 3 -- or of an AVX-VNNI laptop -- Alder Lake on -- on this"
        echo " one's cores, caches and memory: a stand-in for such a machine, not a measurement of one.  Same files and runs as 3b)"
    fi
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

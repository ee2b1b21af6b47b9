#!/bin/sh
# campaign.sh -- a long fuzzing campaign: each harness for RUNS executions,
# under nice -n 10, one after another (JOBS=2: two at a time).
#   sh tests/fuzz/campaign.sh RUNS [NAME...]       (default: every harness)
# FUZZ_BIN picks the program (default build/fuzz/cm384_fuzz; copy it away
# first if you will rebuild while the campaign runs).  Grows
# build/fuzz/corpus-NAME (not committed); a crash leaves
# build/fuzz/crash-NAME-*; each harness's output is in
# build/fuzz/campaign-NAME.log, and one line per harness (executions,
# seconds, exit status, crash files) is printed and appended to
# build/fuzz/campaign.txt.  FUZZ_TIMEOUT (default 60 s) is the per-input
# timeout; it runs on the wall clock, so raise it if you will pause the
# campaign (kill -STOP) for longer.  FORK=N runs each harness as N
# processes in libFuzzer's fork mode (one corpus; RUNS counts them all).
# WORKERS=N runs N independent libFuzzer processes on the one corpus
# (-jobs=N -workers=N, RUNS/N each; logs campaign-NAME.log.K), which keeps
# a harness whose inputs load slowly off fork mode's per-job start-up.
B=${B:-build}
BIN=${FUZZ_BIN:-$B/fuzz/cm384_fuzz}
RUNS=${1:-10000000}
[ $# -gt 0 ] && shift
names=${*:-$("$BIN" -list | cut -d' ' -f1)}
JOBS=${JOBS:-1}

one() {
    name=$1
    mkdir -p "$B/fuzz/corpus-$name"
    log="$B/fuzz/campaign-$name.log"
    t0=$(date +%s)
    # fork mode starts its jobs from argv[0] without -target: a link named
    # fuzz_NAME picks the harness instead
    prog=$BIN fork=
    if [ "${FORK:-1}" -gt 1 ]; then
        mkdir -p "$BIN.d" && ln -sf "$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")" "$BIN.d/fuzz_$name"
        prog=$BIN.d/fuzz_$name fork=-fork=$FORK
    fi
    if [ "${WORKERS:-1}" -gt 1 ]; then
        # each worker is started again from argv[0] without -target: the
        # fuzz_NAME link names the harness; worker K writes fuzz-K.log in
        # the directory it runs in, copied to campaign-NAME.log.K
        top=$(pwd)
        abs() { case $1 in /*) echo "$1" ;; *) echo "$top/$1" ;; esac; }
        bin=$(abs "$BIN") bdir=$(abs "$B")
        mkdir -p "$bin.d" && ln -sf "$bin" "$bin.d/fuzz_$name"
        wd=$bdir/fuzz/workers-$name
        rm -rf "$wd" && mkdir -p "$wd"
        (cd "$wd" && nice -n 10 "$bin.d/fuzz_$name" -jobs="$WORKERS" -workers="$WORKERS" -runs=$((RUNS / WORKERS)) \
            -timeout="${FUZZ_TIMEOUT:-60}" -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$bdir/fuzz/crash-$name-" \
            "$bdir/fuzz/corpus-$name" "$top/tests/fuzz/corpus/$name" >"$(abs "$log")" 2>&1)
        rc=$?
        execs=0 fork="$WORKERS workers"
        for w in "$wd"/fuzz-*.log; do
            cp "$w" "$log.$(basename "$w" .log | sed 's/fuzz-//')"
            e=$(sed -n 's/^stat::number_of_executed_units: *//p' "$w" | tail -n 1)
            [ -n "$e" ] || e=$(sed -n 's/^#\([0-9]*\)[^0-9].*/\1/p' "$w" | tail -n 1)   # stopped: its last report
            execs=$((execs + ${e:-0}))
        done
    else
        nice -n 10 "$prog" -target="$name" $fork -runs="$RUNS" -timeout="${FUZZ_TIMEOUT:-60}" -rss_limit_mb=4096 \
            -print_final_stats=1 -artifact_prefix="$B/fuzz/crash-$name-" "$B/fuzz/corpus-$name" "tests/fuzz/corpus/$name" \
            >"$log" 2>&1
        rc=$?
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
        # fork mode's parent reports "#EXECS: cov: ..." lines instead
        [ -n "$execs" ] || execs=$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$log" | tail -n 1)
    fi
    crashes=$(ls "$B/fuzz/crash-$name-"* 2>/dev/null | wc -l)
    line="$name: ${execs:-?} executions${fork:+ ($fork)} in $(($(date +%s) - t0)) s, exit $rc, $crashes crash files ($(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null))"
    echo "$line"
    echo "$line" >>"$B/fuzz/campaign.txt"
}

running=0
for n in $names; do
    one "$n" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then wait; running=0; fi
done
wait

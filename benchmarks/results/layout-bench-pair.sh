#!/bin/bash
# The package layout's before and after (issue 68) and the one commit point's (issue 69), in one
# sitting: BEFORE and AFTER are checkouts of the code to compare, alternated round by round;
# PY a python with torch and the test dependencies.
#   BEFORE=../before AFTER=. PY=.venv/bin/python bash benchmarks/results/layout-bench-pair.sh
set -u
: "${BEFORE:?a checkout of the earlier code}" "${AFTER:=.}" "${PY:=python}" "${OUT:=/tmp/layoutpair}"
mkdir -p "$OUT"
run() {  # side round name args...
  local side=$1 round=$2 name=$3; shift 3
  local dir; if [ "$side" = before ]; then dir=$BEFORE; else dir=$AFTER; fi
  local json=(--json "$OUT/$name-$side-$round.json"); [ "$name" = items ] && json=()  # it prints only
  (cd "$dir" && PYTHONPATH=. timeout 1200 "$PY" "$@" "${json[@]}" \
      --dir "$OUT/work-$name-$side") > "$OUT/$name-$side-$round.log" 2>&1
  rm -rf "$OUT/work-$name-$side"
}
for round in 1 2; do
  for side in before after; do
    run $side $round core benchmarks/bench_core.py --reps 3
    run $side $round async benchmarks/bench_async.py --reps 1
    run $side $round items benchmarks/bench_items.py --reps 3
    run $side $round replicas benchmarks/bench_replicas.py --steps 24 --reps 2
    run $side $round coop benchmarks/bench_coop_load.py --reps 1
    run $side $round rr benchmarks/bench_replica_restore.py --nodes 4 --mib 32 --reps 1 --cold
  done
done

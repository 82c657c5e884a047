#!/bin/bash
# Two trees alternated in one sitting: BEFORE and AFTER are checkouts (git worktrees) of the
# code to compare; PY a python with torch and the test dependencies.
#   BEFORE=../before AFTER=. PY=.venv/bin/python bash benchmarks/results/issue68-69-bench-pair.sh
set -u
: "${BEFORE:?a checkout of the earlier code}" "${AFTER:=.}" "${PY:=python}" "${OUT:=/tmp/benchpair}"
mkdir -p "$OUT"
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then dir=$BEFORE; else dir=$AFTER; fi
    (cd "$dir" && PYTHONPATH=. timeout 900 "$PY" benchmarks/bench_coop_load.py --reps 1 \
        --json "$OUT/coop-$side-$round.json" --dir "$OUT/coop-$side") > "$OUT/coop-$side-$round.log" 2>&1
    (cd "$dir" && PYTHONPATH=. timeout 900 "$PY" benchmarks/bench_replica_restore.py --nodes 4 --mib 32 \
        --reps 1 --cold --json "$OUT/rr-$side-$round.json" --dir "$OUT/rr-$side") > "$OUT/rr-$side-$round.log" 2>&1
  done
done

#!/bin/bash
# before (a29cf19) and after (HEAD) alternated, one sitting
set -u
PY=/work/main/.venv/bin/python
OUT=/work/main/benchmarks/results
mkdir -p /tmp/benchpair
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then dir=/work/wt_before; else dir=/work/main; fi
    echo "== round $round $side coop" >&2
    (cd $dir && PYTHONPATH=$dir timeout 900 $PY benchmarks/bench_coop_load.py --reps 1 --json /tmp/benchpair/coop-$side-$round.json --dir /tmp/benchpair/coop-$side) > /tmp/benchpair/coop-$side-$round.log 2>&1
    echo "== round $round $side replica_restore" >&2
    (cd $dir && PYTHONPATH=$dir timeout 900 $PY benchmarks/bench_replica_restore.py --nodes 4 --mib 32 --reps 1 --cold --json /tmp/benchpair/rr-$side-$round.json --dir /tmp/benchpair/rr-$side) > /tmp/benchpair/rr-$side-$round.log 2>&1
  done
done
echo done >&2

#!/usr/bin/env bash
# The open GPU figures in one device call, inside SECONDS (default 480) of wall time:
#   issue 39: issue14.py's device-to-host rate, training-loop stalls, cold load and the
#             load taken apart (load_split)
#   issue 36: bench_replicas.py's host-idle loop (replication's cost to the training stall)
#             on a machine whose cores are idle while the GPU computes
# Each part writes under $OUT as it goes (split/, loop/, issue36-replicas.json), so a part cut
# short still reports what it finished.
#
#   OUT=DIR bash benchmarks/gpu/device_run.sh [SECONDS]         # on the GPU machine
#   OUT=DIR DRY=1 bash benchmarks/gpu/device_run.sh 150          # on CPU: checks the script
set -u
budget=${1:-480}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
py=${PYTHON:-python3}
start=$SECONDS
dry=()
[ -n "${DRY:-}" ] && dry=(--dry-run)
mkdir -p "$OUT/split" "$OUT/loop"
# the load taken apart first (about a minute on the H200): the figure that decides the next fix
timeout 120 "$py" benchmarks/gpu/issue14.py --out "$OUT/split" --budget 110 "${dry[@]}" --only load_split \
    > "$OUT/split/log.txt" 2>&1
echo "issue14.py load_split: exit $? after $((SECONDS - start)) s"
part=$((budget * 45 / 100))
timeout "$part" "$py" benchmarks/gpu/issue14.py --out "$OUT/loop" --budget $((part - 15)) "${dry[@]}" \
    --only d2h,workload,load --steps 30 --load-reps 2 \
    --plans dcp_default,dcp_pinned_DefaultStager,ours_device_full_host_quarter,ours_host_full \
    > "$OUT/loop/log.txt" 2>&1
echo "issue14.py: exit $? after $((SECONDS - start)) s"
left=$((budget - (SECONDS - start) - 10))
timeout "$left" "$py" benchmarks/bench_replicas.py --steps 24 --every 3 --reps 20 --budget $((left - 50)) \
    --device-wait 0.3 --host-idle --quiet 1 --json "$OUT/issue36-replicas.json" > "$OUT/replicas_log.txt" 2>&1
echo "bench_replicas.py: exit $? after $((SECONDS - start)) s"
grep -h '^\[' "$OUT/split/log.txt" "$OUT/loop/log.txt" | cut -c1-1500
tail -n 12 "$OUT/replicas_log.txt"

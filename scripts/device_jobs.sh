#!/usr/bin/env bash
# Background jobs on a lent GPU machine, one per GPU or group of GPUs, for work longer than one call (each call lasts
# at most 10 minutes, and the device tool syncs the checkout again at every call): the jobs run from a copy of the
# tree taken once per machine (/tmp/t), and a later call waits for them. docs/gate-measurements.md has the runs made
# so (four `bash .ci/detection` jobs on a 4x H200 machine, one per GPU).
#
#   bash scripts/device_jobs.sh prep                  copy the tree to /tmp/t (once per machine); print the GPUs
#   bash scripts/device_jobs.sh bg NAME GPUS CMD      run CMD (bash -c) in /tmp/t with CUDA_VISIBLE_DEVICES=GPUS, in a
#                                                     session of its own; log in /tmp/jobs/NAME.log
#   bash scripts/device_jobs.sh wait SECONDS NAME...  wait until every NAME has ended or SECONDS pass; print the end
#                                                     of each log and copy the logs to $OUT/logs
#   bash scripts/device_jobs.sh out PATH...           pack PATHs (absolute) into $OUT/files.tgz
#
# Example, one call: prep, then `bg g0 0 "bash .ci/detection /tmp/det/g0 -- perf_tests -k attention"` per GPU, then
# `wait 500 g0 g1`; the next calls `wait` again (the machine goes back after 30 s without a call) and finally `out
# /tmp/det`.
set -uo pipefail
jobs_dir=/tmp/jobs
mkdir -p "$jobs_dir"
case ${1:-} in
    prep)
        [[ -d /tmp/t ]] || cp -r "$(pwd)" /tmp/t
        nvidia-smi --query-gpu=index,name,temperature.gpu,power.draw,clocks.sm --format=csv || true ;;
    bg)
        [[ $# -ge 4 ]] || { echo "usage: bg NAME GPUS CMD" >&2; exit 2; }
        [[ -d /tmp/t ]] || { echo "no /tmp/t: run prep first" >&2; exit 2; }
        name=$2 gpus=$3
        shift 3
        rm -f "$jobs_dir/$name.done"
        (cd /tmp/t && CUDA_VISIBLE_DEVICES=$gpus setsid nohup bash -c "
            begun=\$(date +%s); echo \"[\$(date -u +%T)] start: \$0\"; bash -c \"\$0\"; rc=\$?
            echo \"[\$(date -u +%T)] exit \$rc after \$((\$(date +%s) - begun)) s\"; echo \$rc > $jobs_dir/$name.done" \
            "$*" > "$jobs_dir/$name.log" 2>&1 < /dev/null &)
        echo "started $name on GPU $gpus" ;;
    wait)
        [[ $# -ge 3 ]] || { echo "usage: wait SECONDS NAME..." >&2; exit 2; }
        limit=$2
        shift 2
        begun=$(date +%s)
        while (( $(date +%s) - begun < limit )); do
            ended=1
            for name in "$@"; do [[ -f $jobs_dir/$name.done ]] || ended=0; done
            (( ended )) && break
            sleep 5
        done
        for name in "$@"; do
            state=running
            [[ -f $jobs_dir/$name.done ]] && state="ended, exit $(cat "$jobs_dir/$name.done")"
            echo "=== $name: $state"
            tail -n 15 "$jobs_dir/$name.log"
        done
        mkdir -p "${OUT:?}/logs" && cp "$jobs_dir"/*.log "$OUT/logs/" ;;
    out)
        shift
        tar -czf "${OUT:?}/files.tgz" "$@" && ls -la "$OUT" ;;
    *)
        sed -n 2,17p "$0" >&2
        exit 2 ;;
esac

#!/usr/bin/env bash
# A part of the gate's detection measured on a lent GPU machine whose calls last at most 10 minutes and whose copy of
# the tree is synced again at every call (docs/gate-measurements.md): the job runs in the background from a frozen
# copy of the tree, and each later call waits for it a while.
#
#   bash scripts/detection_on_device.sh start PART GATE COMMIT [RUNS]   PART: attention or rest; GATE: the folder
#                                      .ci/detection names (`git log -1 --format=%h -- <gate files>`); RUNS: runs to add
#                                      (default 1; with warm caches a rest run takes the H100 about 14 minutes)
#   bash scripts/detection_on_device.sh wait SECONDS             then, once it has ended, into $OUT: PART.tar.gz (the
#                                                                 kept folder, to --compact) and the log
#   bash scripts/detection_on_device.sh pack-caches              triton's and inductor's caches into $OUT, in parts
#                                                                 of 15 MiB (caches.tgz.part-*)
#
# `start` copies baselines/<GPU>/detection/PART/GATE (the runs kept so far) out of the tree and runs .ci/detection
# for RUNS runs more. Parts of caches.tgz.part-* carried into the tree's .devrun/ (an earlier start's `pack-caches`; git
# ignores the folder, the device tool carries it when asked) are unpacked first, and then the untimed run is left out
# (LMSYS_DETECTION_WARM_UP=0). The machine goes back when no call is in flight for 30 s, and after 30 minutes held at
# the end of the call in flight: call `wait` again at once. Back on the workstation: `tar -xzf PART.tar.gz -C X` and
# `python -m lmsys.perf.detection --compact X/GATE baselines/<GPU>/detection/PART/GATE`, then `--table` that folder
# `--per-run --markdown` for the runs' numbers (docs/gate-measurements.md).
# Compact into the tree before the next start: a start copies the runs the tree holds and numbers its runs on from them
# (a start from an older tree gives names already kept, which --compact renumbers, naming each).
set -uo pipefail
cd "$(dirname "$0")/.."
job=/tmp/detection-job

usage() { sed -n 5,12p "$0" >&2; exit 2; }

start() {
    local part=$1 gate=$2 commit=$3 runs=${4:-1} args gpu
    case $part in
        attention) args=(perf_tests/test_attention.py) ;;
        rest) args=(perf_tests --ignore=perf_tests/test_attention.py) ;;
        *) echo "PART must be attention or rest, not $part" >&2; exit 2 ;;
    esac
    [[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive integer, not $runs" >&2; exit 2; }
    gpu=$(PYTHONPATH=$PWD python3 -c "import torch; from lmsys.perf.baselines import machine_id
print(machine_id(torch.cuda.get_device_name(), True))") || exit 2
    [[ -d baselines/$gpu ]] || { echo "no baselines/$gpu in the tree" >&2; exit 2; }
    rm -rf "$job" && mkdir -p "$job/keep"
    local warm=1
    if compgen -G ".devrun/caches.tgz.part-*" >/dev/null; then
        cat .devrun/caches.tgz.part-* | tar -xzf - -C / && warm=0
    fi
    cp -r . "$job/tree"
    [[ ! -d baselines/$gpu/detection/$part/$gate ]] || cp -r "baselines/$gpu/detection/$part/$gate" "$job/keep/"
    echo "$part" > "$job/part"
    # A session of its own (setsid): the end of the call that started it, and its process group, leave it running.
    setsid nohup bash "$job/tree/scripts/detection_on_device.sh" _job "$gate" "$commit" "$warm" "$runs" "${args[@]}" \
        < /dev/null > /dev/null 2>&1 &
    echo "started: $part, gate $gate, $runs run(s) more;" \
        "the warm-up run $([[ $warm == 1 ]] && echo first || echo left out)"
}

job_body() {
    local gate=$1 commit=$2 warm=$3 runs=$4 begun status
    shift 4
    cd "$job/tree" || exit 2
    begun=$(date +%s)
    LMSYS_DETECTION_GATE=$gate LMSYS_DETECTION_PER_CALL=$runs LMSYS_DETECTION_WARM_UP=$warm LMSYS_GIT_COMMIT=$commit \
        PYTHONUNBUFFERED=1 bash .ci/detection "$job/keep" -- "$@" > "$job/log" 2>&1
    status=$?
    echo "exit $status after $(($(date +%s) - begun)) s (caches carried in: $((1 - warm)))" >> "$job/log"
    echo "$status" > "$job/done"
}

wait_for() {
    local limit=$1 begun
    [[ -f $job/part ]] || { echo "no job was started on this machine" >&2; exit 2; }
    begun=$(date +%s)
    while [[ ! -f $job/done && $(($(date +%s) - begun)) -lt $limit ]]; do sleep 5; done
    grep -E "^\.ci/detection|done, exit|untimed|exit [0-9]+ after" "$job/log" | tail -n 8
    if [[ -f $job/done ]]; then
        tail -n 12 "$job/log"
        tar -C "$job/keep" -czf "${OUT:?}/$(cat "$job/part").tar.gz" . && cp "$job/log" "$OUT/detection.log"
    else
        echo "still running after $(($(date +%s) - begun)) s of waiting"
    fi
}

pack_caches() {
    # Where the job's processes kept them: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR when set (a later start
    # unpacks them to the same paths, and needs the same variables), else the libraries' defaults.
    tar -czf - "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}" "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" \
        2>/dev/null | split -b 15m - "${OUT:?}/caches.tgz.part-"
    ls -l "$OUT"
}

case ${1:-} in
    start) [[ $# -eq 4 || $# -eq 5 ]] || usage; start "${@:2}" ;;
    wait) [[ $# -eq 2 && $2 =~ ^[0-9]+$ ]] || usage; wait_for "$2" ;;
    pack-caches) [[ $# -eq 1 ]] || usage; pack_caches ;;
    _job) shift; job_body "$@" ;;  # start's background job
    *) usage ;;
esac

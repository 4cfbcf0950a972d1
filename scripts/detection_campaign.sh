#!/usr/bin/env bash
# The gate's acceptance campaign (docs/gate-measurements.md, "The acceptance campaign"), a session's share at a time, on
# a lent GPU machine whose calls last at most 10 minutes and whose copy of the tree has no .git and no installed lmsys:
# a job in the background runs `python -m lmsys.perf.detection --in-process` on one half of the campaign for as many
# runs as fit in the budget, adding to the runs the tree keeps (--keep/--resume), and later calls wait for it.
#
#   bash scripts/detection_campaign.sh start HALF GATE COMMIT BUDGET_S [BASELINE]
#   bash scripts/detection_campaign.sh wait SECONDS     then, for each job that has ended, into $OUT: HALF.tar.gz (the
#                                                        kept folder, to --compact) and HALF.log
#   bash scripts/detection_campaign.sh commands HALF GATE COMMIT BUDGET_S [BASELINE]   the job's command, not run
#   bash scripts/detection_campaign.sh pack-caches      triton's and inductor's caches into $OUT, in parts of 15 MiB
#                                                        (caches.tgz.part-*), for a later start to carry in .devrun/
#
# HALF (runs to build up; LMSYS_CAMPAIGN_RUNS overrides):
#   attention-same   perf_tests -k attention against a fresh reference of this machine start: A/A, +3% and +5% with
#                    1 MiB held, the delays only into benchmarks of 1 ms or more, 1 MiB alone into the others (20)
#   attention-other  the same tests against BASELINE, a committed baseline of the same code saved in another machine
#                    start: A/A, +10% with 1 MiB held, delays from 1 ms, 1 MiB alone below (20)
#   rest-same        perf_tests -k "not attention", A/A only, against a fresh reference (5)
#   rest-other       the same against BASELINE (5)
# GATE: the folder name .ci/detection gives (`git log -1 --format=%h -- <its gate paths>` on the workstation);
# COMMIT: the commit the tree is (LMSYS_GIT_COMMIT); BUDGET_S: the device seconds this job may take (what the session
# has left, and what is left of the machine's 30 minutes held, less the calls that follow). The job ends 45 s before
# it, and starts no run that would end later (--budget-s; a run is expected to take --run-s until one has been timed).
# LMSYS_CAMPAIGN_GPU=N runs the job on GPU N alone (two halves at once on a 2-GPU machine, each `start` with its own);
# the rest's multi-rank benchmarks need the machine's GPUs to themselves. LMSYS_CAMPAIGN_TREE=FILE runs the job from a
# tar archive of the tree (`git archive COMMIT > .devrun/tree.tar`, carried) instead of a copy of the tree as it is:
# a campaign that spans sessions keeps measuring COMMIT's gate and kernels while the checkout moves on (the runs kept
# so far still come from the tree). Parts of caches.tgz.part-* carried into .devrun/ (an earlier start's pack-caches)
# are unpacked first, and then the untimed run is left out. Back on the workstation: `tar -xzf HALF.tar.gz -C X` and
# `python -m lmsys.perf.detection --compact X/GATE baselines/<GPU>/detection/HALF/GATE`, commit, and compact before
# the next start (it numbers its runs on from the tree's).
set -uo pipefail
cd "$(dirname "$0")/.."
jobs=${LMSYS_CAMPAIGN_JOBS:-/tmp/detection-campaign}  # the jobs' folders (a test gives its own)
margin=45

usage() { sed -n 7,12p "$0" >&2; exit 2; }

# The half's detection options (into `opts`), its tests (`tests`) and the runs it builds up to; exits 2 on a bad
# argument.
half_command() {
    local half=$1 gate=$2 commit=$3 budget=$4 baseline=${5:-} runs cases=() compare=() run_s
    [[ $gate =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || { echo "GATE must be a folder name, not $gate" >&2; exit 2; }
    [[ $commit =~ ^[0-9a-f]{7,40}$ ]] || { echo "COMMIT must be a commit id, not $commit" >&2; exit 2; }
    [[ $budget =~ ^[1-9][0-9]*$ ]] && ((budget > margin)) || {
        echo "BUDGET_S must be a number of seconds above $margin, not $budget" >&2; exit 2; }
    case $half in
        attention-same|attention-other)
            tests=(perf_tests -k attention); runs=20
            if [[ $half == attention-same ]]; then cases=(--inject 0.03 0.05); run_s=160
            else cases=(--inject 0.1); run_s=120; fi
            cases+=(--inject-memory 1048576 --memory-with-delays --delays-from 0.001) ;;
        rest-same|rest-other)
            tests=(perf_tests -k "not attention"); runs=5; cases=(--inject); run_s=360 ;;
        *) echo "HALF must be attention-same, attention-other, rest-same or rest-other, not $half" >&2; exit 2 ;;
    esac
    if [[ $half == *-other ]]; then
        [[ $baseline =~ ^[0-9]{1,4}$ ]] || {
            echo "$half compares with BASELINE, the number of a committed baseline of another machine start" >&2
            exit 2; }
        compare=(--baseline "$baseline")
    elif [[ -n $baseline ]]; then
        echo "$half compares with a fresh reference of this machine start: no BASELINE" >&2; exit 2
    fi
    runs=${LMSYS_CAMPAIGN_RUNS:-$runs}
    [[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "LMSYS_CAMPAIGN_RUNS must be a positive integer" >&2; exit 2; }
    opts=(--in-process --runs "$runs" "${cases[@]}" "${compare[@]}" --budget-s "$((budget - margin))" --run-s "$run_s"
          --keep "$jobs/$half/keep/$gate" --markdown)
    # Neither plugin serves the perf suite; hypothesis's imports its package at each run's end (0.45 s a run on the
    # workstation, more on a slower host), which every fresh process of the campaign would pay.
    tests+=(-p no:cacheprovider -p no:hypothesispytest)
    # Without `pip install` the plugin's pytest11 entry point is not registered: load it by name (as .ci/detection).
    python3 -c "import sys; from importlib.metadata import entry_points
sys.exit(any(e.value == 'lmsys.perf.plugin' for e in entry_points(group='pytest11')))" && tests+=(-p lmsys.perf.plugin)
}

# The detection's command line, for `bash -c`.
command_line() {
    printf '%q ' python3 -m lmsys.perf.detection "${opts[@]}" -- "${tests[@]}"
}

start() {
    local half=$1 gate=$2 gpu job tree staging
    half_command "$@"
    job=$jobs/$half
    [[ ! -f $job/running ]] || { echo "a $half job is running already" >&2; exit 2; }
    # The job's tree is made and checked aside: a refused start leaves an ended job's folder (its results) as it was.
    staging=$jobs/.$half.new
    refuse() { echo "$1" >&2; rm -rf "$staging"; exit 2; }
    rm -rf "$staging" && mkdir -p "$staging/keep" "$staging/tree"
    tree=$staging/tree
    if [[ -n ${LMSYS_CAMPAIGN_TREE:-} ]]; then
        [[ -f $LMSYS_CAMPAIGN_TREE ]] ||
            refuse "LMSYS_CAMPAIGN_TREE=$LMSYS_CAMPAIGN_TREE is not a file (a tar archive of the tree, git archive)"
        tar -xf "$LMSYS_CAMPAIGN_TREE" -C "$tree" 2>/dev/null && [[ -f $tree/scripts/detection_campaign.sh ]] ||
            refuse "LMSYS_CAMPAIGN_TREE=$LMSYS_CAMPAIGN_TREE does not unpack to a tree of this repository"
    else
        cp -r . "$tree"
    fi
    gpu=$(cd "$tree" && PYTHONPATH=$PWD python3 -c "import torch; from lmsys.perf.baselines import machine_id
print(machine_id(torch.cuda.get_device_name(), True))") || refuse "no GPU name: is this a GPU machine?"
    [[ -d $tree/baselines/$gpu ]] || refuse "no baselines/$gpu in the tree"
    if [[ $half == *-other ]]; then
        local file
        file=$(cd "$tree" && compgen -G "baselines/$gpu/$(printf %04d "$((10#$5))")_*.json") ||
            refuse "no baseline numbered $5 in baselines/$gpu"
        local saved
        saved=$(python3 -c "import json, sys
print(json.load(open(sys.argv[1]))['machine_info']['lmsys'].get('git_commit', 'unknown'))" "$tree/$file")
        echo "comparing with $file, saved at commit $saved; this tree is $3"
    fi
    rm -rf "$job" && mv "$staging" "$job"
    if compgen -G ".devrun/caches.tgz.part-*" >/dev/null; then
        cat .devrun/caches.tgz.part-* | tar -xzf - -C / && opts+=(--no-warm-up)
    fi
    [[ ! -d baselines/$gpu/detection/$half/$gate ]] || cp -r "baselines/$gpu/detection/$half/$gate" "$job/keep/"
    [[ ! -f $job/keep/$gate/detection.json ]] || opts+=(--resume)
    command_line > "$job/command"
    cache_dirs > "$jobs/caches"
    echo "${LMSYS_CAMPAIGN_GPU:-}" > "$job/gpu"
    touch "$job/running"
    # A session of its own (setsid): the end of the call that started it, and its process group, leave it running. The
    # job is this script's, whichever tree it measures.
    cp scripts/detection_campaign.sh "$job/campaign.sh"
    setsid nohup bash "$job/campaign.sh" _job "$half" "$3" < /dev/null > /dev/null 2>&1 &
    echo "started: $half, gate $gate$([[ -z ${LMSYS_CAMPAIGN_GPU:-} ]] || echo ", GPU $LMSYS_CAMPAIGN_GPU"):"
    cat "$job/command"; echo
}

job_body() {
    local half=$1 commit=$2 job=$jobs/$1 begun status
    cd "$job/tree" || exit 2
    begun=$(date +%s)
    local gpu
    gpu=$(cat "$job/gpu")
    # Each run is a fresh process: with bytecode written (a lent machine's image may forbid it and ship none), its
    # imports are compiled once per job, not once per run (torch.compile's imports alone take seconds from source).
    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$jobs/pycache}" \
        ${gpu:+CUDA_VISIBLE_DEVICES=$gpu} LMSYS_GIT_COMMIT="$commit" PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 \
        bash -c "$(cat "$job/command")" > "$job/table.md" 2> "$job/log"
    status=$?
    echo "exit $status after $(($(date +%s) - begun)) s" >> "$job/log"
    echo "$status" > "$job/done"
    rm -f "$job/running"
}

wait_for() {
    local limit=$1 begun job half
    compgen -G "$jobs/*/command" >/dev/null || { echo "no job was started on this machine" >&2; exit 2; }
    begun=$(date +%s)
    while compgen -G "$jobs/*/running" >/dev/null && [[ $(($(date +%s) - begun)) -lt $limit ]]; do sleep 5; done
    for job in "$jobs"/*/; do
        half=$(basename "$job")
        grep -E "done, exit|untimed|budget|exit [0-9]+ after" "$job/log" 2>/dev/null | sed "s/^/$half: /" | tail -n 8
        if [[ -f $job/done ]]; then
            cat "$job/table.md"
            tar -C "$job/keep" -czf "${OUT:?}/$half.tar.gz" . && cp "$job/log" "$OUT/$half.log"
        else
            echo "$half: still running after $(($(date +%s) - begun)) s of waiting"
        fi
    done
}

# The caches the jobs' processes keep: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR as `start` saw them, else the
# libraries' defaults. `start` writes them to $jobs/caches, because the call that packs them later has its own
# environment (a later start unpacks them to the same paths, and needs the same variables).
cache_dirs() {
    echo "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}"
    echo "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
}

pack_caches() {
    local dirs=() dir
    if [[ -f $jobs/caches ]]; then mapfile -t dirs < "$jobs/caches"; else mapfile -t dirs < <(cache_dirs); fi
    for dir in "${dirs[@]}"; do
        [[ -d $dir ]] || { echo "no cache at $dir: nothing packed" >&2; exit 1; }
    done
    rm -f "${OUT:?}"/caches.tgz.part-*
    tar -czf - "${dirs[@]}" 2>/dev/null | split -b 15m - "$OUT/caches.tgz.part-" ||
        { echo "packing ${dirs[*]} failed" >&2; exit 1; }
    ls -l "$OUT"
}

case ${1:-} in
    start) [[ $# -eq 5 || $# -eq 6 ]] || usage; start "${@:2}" ;;
    commands) [[ $# -eq 5 || $# -eq 6 ]] || usage; half_command "${@:2}"; command_line; echo ;;
    wait) [[ $# -eq 2 && $2 =~ ^[0-9]+$ ]] || usage; wait_for "$2" ;;
    pack-caches) [[ $# -eq 1 ]] || usage; pack_caches ;;
    _job) shift; job_body "$@" ;;  # start's background job
    *) usage ;;
esac

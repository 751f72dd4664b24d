#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, then a job array of 4 tasks that extract
# SmolLM2-135M on a demo task into one store with `--shard auto`; passes when the store holds
# exactly n instances, each once.
#
#   scripts/slurm-check.sh            # as root; installs slurm-wlm and munge with apt-get if needed
#
# Everything runs in a private folder: munged, slurmctld and slurmd listen on 127.0.0.1 only (and
# inside a private network namespace where `unshare --net` is allowed), the run is bounded
# (SLURM_CHECK_TIMEOUT seconds, default 600) and every process the script started is stopped on
# exit. It submits examples/shards.sbatch unchanged but for the resources this machine has.
# Environment: PYTHON (default .venv/bin/python), SLURM_CHECK_N (instances, default 64),
# SLURM_CHECK_KEEP=1 keeps the folder. Exit 0: passed, or skipped because apt-get cannot install
# the packages (one line says so); anything else is a failure.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
if [[ $python == */* ]]; then  # absolute, keeping a virtual environment's link
    python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
else
    python=$(command -v "$python")
fi
n=${SLURM_CHECK_N:-64}
timeout_s=${SLURM_CHECK_TIMEOUT:-600}
start=${SLURM_CHECK_START:-$(date +%s)}
export SLURM_CHECK_START=$start
deadline=$((start + timeout_s))
say() { printf '[slurm-check %3ds] %s\n' "$(($(date +%s) - start))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge (apt-get)"
    install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1; }
    if ! { install || { apt-get update -q >/dev/null 2>&1 && install; }; }; then
        say "SKIPPED: apt-get cannot install slurm-wlm and munge here (not root, or no Debian archive)"
        exit 0
    fi
fi
[[ $EUID -eq 0 ]] || fail "run as root: slurmd starts each job as its user"

# Slurm 22.05 listens on every interface (it has no bind address), so the cluster runs in a
# private network namespace that has only the loopback interface, where the kernel allows one.
if [[ -z ${SLURM_CHECK_NETNS:-} ]]; then
    if unshare --net true 2>/dev/null; then
        export SLURM_CHECK_NETNS="a private network namespace (loopback only)"
        exec unshare --net -- bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
    fi
    export SLURM_CHECK_NETNS="the host network: no private network namespace allowed here, so \
the ports are open on every interface for the run (requests need this run's munge key)"
fi

work=$(mktemp -d /tmp/layerdiv-slurm-check.XXXXXX)
chmod 755 "$work"
pids=()
cleanup() {
    local rc=$?
    if [[ -n ${job:-} ]]; then
        scancel "$job" 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(squeue -h -j "$job" 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
    if [[ ${SLURM_CHECK_KEEP:-0} == 1 || $rc -ne 0 ]]; then
        say "kept $work"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# munge: its own key, socket and logs.
mkdir -p "$work/munge" "$work/log" "$work/state" "$work/spool" "$work/bin"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$work/munge/munge.key"
socket=$work/munge/munge.socket
munged --foreground --force --key-file="$work/munge/munge.key" --socket="$socket" \
    --pid-file="$work/munge/munged.pid" --log-file="$work/log/munged.log" \
    --seed-file="$work/munge/munged.seed" >"$work/log/munged.out" 2>&1 &
pids+=($!)

cpus=$(nproc)
export SLURM_CONF=$work/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=layerdiv-check
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=600
CommunicationParameters=EnableIPv6
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=check Nodes=localhost Default=YES MaxTime=30 State=UP
EOF

for _ in $(seq 50); do [[ -S $socket ]] && break; sleep 0.1; done
[[ -S $socket ]] || fail "munged did not start: $(tail -3 "$work/log/munged.log")"
slurmctld -D -i -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -N localhost -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
pids+=($!)
alive() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done; }
until sinfo -h -N -o '%T' 2>/dev/null | grep -qx idle; do
    if ! alive || (($(date +%s) >= deadline)); then
        fail "the node never became idle: $(tail -qn 2 "$work"/log/slurm*.log | tr '\n' ' ')"
    fi
    sleep 0.5
done
say "cluster up in $SLURM_CHECK_NETNS: $(sinfo -h -o '%P: %D node, %c CPUs, %T' | head -1)"
say "listening: $(ss -Hltn | awk '{print $4}' | sort | tr '\n' ' ')"

# The task (a demo task, written from the packaged data) and the `layerdiv` the jobs run.
printf '#!/bin/sh\nexec %q -m layerdiv.cli "$@"\n' "$python" >"$work/bin/layerdiv"
chmod +x "$work/bin/layerdiv"
export PATH=$work/bin:$PATH
"$python" -c "import sys; from pathlib import Path; from layerdiv.demo import write_demo_tasks
write_demo_tasks(Path(sys.argv[1]), int(sys.argv[2]), 0)" "$work/tasks" "$n"
task=$work/tasks/tweets2.yaml
store=$work/store
chunk=$((n >= 8 ? n / 8 : 1))  # 8 chunks: 2 per array task

cd "$work"
job=$(sbatch --parsable --array=0-3 --cpus-per-task=1 --time=10 --gres=none \
    --output="$work/log/task-%a.out" "$repo/examples/shards.sbatch" \
    smollm2-135m-instruct "$task" "$store" --chunk-size "$chunk")
say "submitted job array $job: 4 tasks of examples/shards.sbatch, $n instances of tweets2"
while [[ -n $(squeue -h -j "$job" 2>/dev/null) ]]; do
    (($(date +%s) < deadline)) || fail "the job array did not finish within ${timeout_s} s"
    sleep 1
done
say "job array finished"
for a in 0 1 2 3; do
    state=$(scontrol -o show job "${job}_$a" | grep -o 'JobState=[A-Z_]* .*ExitCode=[0-9:]*' |
        sed 's/ .* / /')
    say "task $a: $state"
    if [[ $state != "JobState=COMPLETED ExitCode=0:0" ]]; then
        tr '\r' '\n' <"$work/log/task-$a.out" | tail -n 20 | sed 's/^/    /'
        fail "array task $a did not complete"
    fi
    tr '\r' '\n' <"$work/log/task-$a.out" | grep -E '^(shard |tweets2: [0-9]+/)' | sed 's/^/    /'
done
job=

layerdiv ls --store "$store"
layerdiv query --store "$store" --out "$work/counts.csv" "
    SELECT (SELECT count(*) FROM instances) AS instance_rows,
           (SELECT count(DISTINCT instance) FROM instances) AS instances,
           (SELECT max(instance) FROM instances) AS last_instance,
           (SELECT count(*) FROM components) AS component_rows,
           (SELECT count(DISTINCT (instance, component, option)) FROM components) AS distinct_rows,
           (SELECT n_components * n_options FROM manifests) AS rows_per_instance" >/dev/null
read -r rows distinct last comp_rows comp_distinct per < <(tail -n 1 "$work/counts.csv" | tr ',' ' ')
say "instances: $rows rows, $distinct distinct, last $last; components: $comp_rows rows," \
    "$comp_distinct distinct, $per per instance"
[[ "$rows $distinct $last" == "$n $n $((n - 1))" ]] ||
    fail "the store does not hold instances 0..$((n - 1)) exactly once"
[[ $comp_rows == "$comp_distinct" && $comp_rows == $((n * per)) ]] ||
    fail "the components table has duplicate or missing rows"
say "PASSED: the store holds exactly $n instances (0..$((n - 1)), each once) from 4 array tasks"

#!/usr/bin/env bash
# A sharded sweep on a real Slurm, end to end: a one-node cluster on this machine (Debian's slurmctld, slurmd,
# slurm-client and munge, installed if missing), a 3-task array running scripts/slurm/sweep.sbatch on the default
# preset (a few prompts, short turns), the merge job that depends on it, and the merged tables compared byte for
# byte with the same sweep run on one machine. Prints job ids, tasks and the verdict; stops the daemons it started.
#
#   sudo scripts/slurm-e2e.sh [LOG]     (root: the daemons and the jobs run as root; LOG gets a copy of the report)
#
# Exit 0: the merged tables are identical; 1: they are not, or a job failed; 2: this machine cannot host the
# cluster (no root, packages not installable, daemons not starting), so nothing about frspec was learned.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
log=${1:-}

cannot() {
    echo "slurm-e2e: this machine cannot host the test cluster: $*" >&2
    exit 2
}
[ "$(id -u)" = 0 ] || cannot "it must run as root"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    packages=(slurmctld slurmd slurm-client munge)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${packages[@]}" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "${packages[@]}" >/dev/null; } ||
        cannot "apt-get could not install ${packages[*]}"
fi
frspec=$(scripts/frspec-bin.sh)
scripts/fetch-assets.sh smollm2 mtbench >/dev/null

work=$(mktemp -d /tmp/frspec-slurm.XXXXXX)
mkdir -p "$work/state" "$work/spool" "$work/shards"
stop() {
    for pid in "$work"/slurmd.pid "$work"/slurmctld.pid "$work"/munged.pid; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
}
trap stop EXIT

# munge with a key made for this run, on a socket of its own.
dd if=/dev/urandom of="$work/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge.key"
munged --force --key-file="$work/munge.key" --socket="$work/munge.sock" --pid-file="$work/munged.pid" \
    --log-file="$work/munged.log" --seed-file="$work/munge.seed" || cannot "munged did not start"

host=$(hostname -s)
export SLURM_CONF="$work/slurm.conf"
cat > "$SLURM_CONF" <<EOF
ClusterName=frspec-e2e
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge.sock
CredType=cred/munge
SlurmctldPort=6917
SlurmdPort=6918
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=e2e Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld || cannot "slurmctld did not start"
slurmd || cannot "slurmd did not start"
for _ in $(seq 60); do
    state=$(sinfo -h -o %T 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 1
done
[ "$state" = idle ] || cannot "the node did not come up ($state); see $work/slurm*.log"

flags=(--num-prompts 4 --turns 1 --max-new-tokens 16 --ratios 0,0.5 --temperatures 0,1 --repeats 2)
export FRSPEC_BIN="$frspec" FRSPEC_SHARDS="$work/shards"
started=$(date +%s)
array=$(sbatch --parsable --array=0-2 --cpus-per-task=1 --output="$work/sweep-%A_%a.log" scripts/slurm/sweep.sbatch "${flags[@]}")
merge=$(sbatch --parsable --dependency=afterok:"$array" --output="$work/merge-%j.log" scripts/slurm/merge.sbatch "$work/merged")
for _ in $(seq 600); do
    [ -z "$(squeue -h -j "$array,$merge" 2>/dev/null)" ] && break
    sleep 1
done
elapsed=$(( $(date +%s) - started ))

"$frspec" sweep "${flags[@]}" --quiet --out "$work/one" >/dev/null 2>&1
verdict="identical"
for table in runs.parquet summary.parquet; do
    cmp -s "$work/one/$table" "$work/merged/$table" || verdict="DIFFERENT ($table)"
done
[ -f "$work/merged/summary.parquet" ] || verdict="NO MERGED SWEEP (see $work/merge-$merge.log)"

report=$(
    echo "# scripts/slurm-e2e.sh $log"
    echo "frspec $("$frspec" --version | cut -d' ' -f2) on Slurm $(sinfo -V | cut -d' ' -f2), one node ($host, $(nproc) CPUs), $(date -u +%FT%TZ)"
    echo "sweep: default preset, ${flags[*]}"
    echo "array job $array: 3 tasks (--array=0-2); merge job $merge (--dependency=afterok:$array); ${elapsed} s from submission to the end of the merge"
    for i in 0 1 2; do
        units=$(find "$work/shards/shard-$i/units" -name 't*.json' | wc -l)
        echo "  task $i: $(grep -h '^shard' "$work/sweep-${array}_$i.log" || echo "no shard line: see $work/sweep-${array}_$i.log") ($units journal entries)"
    done
    echo "merge: $(tail -n 1 "$work/merge-$merge.log")"
    echo "merged runs.parquet and summary.parquet against one machine's sweep: $verdict"
)
echo "$report"
[ -n "$log" ] && echo "$report" > "$log"
[ "$verdict" = identical ]

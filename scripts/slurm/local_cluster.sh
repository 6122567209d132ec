#!/usr/bin/env bash
# A SLURM cluster of two nodes, n1 and n2, both on this machine, for the SLURM test tier (and for trying
# the templates): two slurmd daemons (`slurmd -N`), each node with this host's CPU count and memory.
#
# Installs Debian's slurm-wlm and munge when missing, maps n1 and n2 to 127.0.0.1 in /etc/hosts, writes
# /etc/slurm/slurm.conf (one partition of both nodes), starts munged, slurmctld and the two slurmd, and
# waits until both nodes are idle. Idempotent: a running cluster is restarted with the fresh config.
# Needs root (CI, containers).
# Usage: bash scripts/slurm/local_cluster.sh [start|stop]
set -euo pipefail
ACTION="${1:-start}"
LOG=/var/log/slurm

stop() {
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    sleep 1
}

if [ "$ACTION" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: a key and the daemon (authentication between the SLURM daemons and clients).
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
chmod 0700 /etc/munge
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force

HOST="$(hostname -s)"
NODES=(n1 n2)
HARDWARE="$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ UpTime=.*//')"
grep -qE "^127\.0\.0\.1[[:space:]].*\bn1\b" /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd-n1 /var/spool/slurmd-n2 "$LOG"
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=megatronrl
SlurmctldHost=${HOST}(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait=10
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n1 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=6821 ${HARDWARE} State=UNKNOWN
NodeName=n2 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=6822 ${HARDWARE} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

stop
/usr/sbin/slurmctld -i
for node in "${NODES[@]}"; do /usr/sbin/slurmd -N "$node"; done
for _ in $(seq 1 60); do
    state="$(sinfo -h -o %T 2>/dev/null | sort -u | tr '\n' ' ')"
    [ "$state" = "idle " ] && { echo "SLURM ready: nodes ${NODES[*]} idle"; exit 0; }
    scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
    sleep 1
done
echo "SLURM did not become ready; node state: '$state'" >&2
tail -20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
exit 1

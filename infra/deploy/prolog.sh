#!/bin/bash
# TrainGuard preflight: a Slurm Prolog that tests the node before a job's ranks start on it.
#
# It runs `trainguard diag --level LEVEL --json --out FILE` on the node.  When a test fails and the
# policy is `drain`, it drains the node with TrainGuard's reason
#     scontrol update NodeName=$SLURMD_NODENAME State=DRAIN Reason="trainguard preflight: <test>: <finding>"
# records the check (trainguard preflight record: this node's log directory, and Kafka topic
# trainguard.telemetry.nodechecks -> ClickHouse table node_checks when a config is given) and
# exits 1, so Slurm requeues the batch job; with `warn` it records the failure and exits 0.
#
# Install (infra/deploy/README.md, "Preflight"):
#     install -m 0755 infra/deploy/prolog.sh /etc/slurm/prolog.d/trainguard.sh
#     slurm.conf:  Prolog=/etc/slurm/prolog.d/trainguard.sh
#                  PrologFlags=Alloc,DeferBatch
#                  SchedulerParameters=nohold_on_prolog_fail   # the job starts on other nodes
#                  (without it Slurm requeues the job held: it waits for an operator)
#
# Settings: the shell file $TRAINGUARD_PREFLIGHT_ENV (default /etc/trainguard/preflight.env),
# sourced when present.  Slurm gives a prolog no PATH and none of slurmd's environment, so
# everything comes from that file.  It must belong to root (or this script's user) and be
# writable by no one else: it runs as root.
#     TRAINGUARD_BIN                   the trainguard executable (default: trainguard on PATH,
#                                      then /opt/trainguard/bin/trainguard)
#     TRAINGUARD_PREFLIGHT_ENABLED     1 (default) or 0: 0 skips the preflight, exit 0
#     TRAINGUARD_PREFLIGHT_LEVEL       quick (default, ~30 s), standard, long
#     TRAINGUARD_PREFLIGHT_POLICY      drain (default) or warn
#     TRAINGUARD_PREFLIGHT_ON_ERROR    allow (default: diag could not judge the node -> the job
#                                      starts, the error is recorded) or drain
#     TRAINGUARD_PREFLIGHT_ARGS        more `trainguard diag` arguments, split on spaces
#                                      (e.g. --expected-file /etc/trainguard/digests.json)
#     TRAINGUARD_PREFLIGHT_TIMEOUT_S   diag's time limit (default 120); a run past it fails the node
#     TRAINGUARD_PREFLIGHT_LOG_DIR     default /var/log/trainguard/preflight; files go to
#                                      LOG_DIR/<node>/ (results, diag's stderr, records, preflight.log)
#     TRAINGUARD_CONFIG                the TrainGuard config whose kafka section the record is
#                                      published with (unset: kept in the log directory only)
#     TRAINGUARD_PREFLIGHT_SCHEDULER   slurm (default) or kubernetes
#
# Kubernetes: the same script is the preflight init container's (infra/deploy/k8s/preflight/, a
# copy in its ConfigMap that tests/infra/test_prolog.py keeps identical).  There the settings are
# the container's environment, the node is $NODE_NAME and the job $POD_NAME (downward API), and a
# failed node is cordoned (`trainguard preflight cordon`: spec.unschedulable, the reason in the
# annotation trainguard.io/preflight-reason) instead of drained; the pod then fails, and with
# restartPolicy: Never its Job makes a new pod, which the scheduler places on another node.
#
# A test made to fail, for trying this out: TRAINGUARD_PREFLIGHT_ARGS="--test gemm-digest
# --expected-digest 0000000000000000000000000000000000000000000000000000000000000000".
#
# Exit status: 1 when the node is taken out (Slurm then drains it too and requeues the job); 0
# otherwise, including every failure of this script's own (a missing trainguard, an unwritable
# log directory): those are logged, never a reason to drain a node.

# No `set -e`/`-u`: a mistake here must end in exit 0 (logged), never in a status that drains.
umask 022
# Slurm gives a prolog no PATH; a container's own (where its trainguard is) comes first.
export PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

say() {
    # Slurm keeps no prolog output: the log file and syslog are where an operator looks (stderr
    # too, for whoever runs the script by hand).
    local line
    line="$(date -u +%Y-%m-%dT%H:%M:%SZ) node=${node:-$(hostname -s)} job=${job:-none} $*"
    if [ -n "${node_dir:-}" ] && [ -d "$node_dir" ]; then
        printf '%s\n' "$line" >>"$node_dir/preflight.log" 2>/dev/null
    fi
    logger -t trainguard-preflight -- "$line" 2>/dev/null
    printf '%s\n' "$line" >&2
}

env_file="${TRAINGUARD_PREFLIGHT_ENV:-/etc/trainguard/preflight.env}"
if [ -e "$env_file" ]; then
    owner="$(stat -L -c %u "$env_file" 2>/dev/null)"
    mode="$(stat -L -c %a "$env_file" 2>/dev/null)"
    # The file is sourced as root: anyone who can write it owns the node.
    if [ "$owner" != 0 ] && [ "$owner" != "$(id -u)" ]; then
        say "ERROR: $env_file belongs to uid $owner, not root: preflight skipped"
        exit 0
    fi
    if [ -z "$mode" ] || (((8#$mode) & 8#022)); then
        say "ERROR: $env_file is writable by group or others (mode $mode): preflight skipped"
        exit 0
    fi
    # shellcheck disable=SC1090
    . "$env_file"
fi

scheduler="${TRAINGUARD_PREFLIGHT_SCHEDULER:-slurm}"
if [ "$scheduler" = kubernetes ]; then
    node="${NODE_NAME:-$(hostname -s)}"
    job="${POD_NAME:-}"
    job="${job:0:128}" # a job name is at most 128 characters; a pod's may be longer
    origin=k8s-init
else
    node="${SLURMD_NODENAME:-$(hostname -s)}"
    job="${SLURM_JOB_ID:-}"
    origin=slurm-prolog
fi
case "$scheduler" in slurm | kubernetes) ;; *)
    say "ERROR: TRAINGUARD_PREFLIGHT_SCHEDULER=$scheduler is neither slurm nor kubernetes: preflight skipped"
    exit 0
    ;;
esac
case "$node" in '' | .* | */*)
    say "ERROR: node name '$node' cannot name a log directory: preflight skipped"
    exit 0
    ;;
esac

[ "${TRAINGUARD_PREFLIGHT_ENABLED:-1}" = 0 ] && exit 0

level="${TRAINGUARD_PREFLIGHT_LEVEL:-quick}"
policy="${TRAINGUARD_PREFLIGHT_POLICY:-drain}"
on_error="${TRAINGUARD_PREFLIGHT_ON_ERROR:-allow}"
timeout_s="${TRAINGUARD_PREFLIGHT_TIMEOUT_S:-120}"
log_dir="${TRAINGUARD_PREFLIGHT_LOG_DIR:-/var/log/trainguard/preflight}"
node_dir="$log_dir/$node"
export HOME="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"

if ! mkdir -p "$node_dir" 2>/dev/null; then
    node_dir=""
    say "ERROR: cannot create $log_dir/$node: preflight skipped"
    exit 0
fi
case "$policy" in drain | warn) ;; *)
    say "ERROR: TRAINGUARD_PREFLIGHT_POLICY=$policy is neither drain nor warn: using warn"
    policy=warn
    ;;
esac
case "$on_error" in allow | drain) ;; *)
    say "ERROR: TRAINGUARD_PREFLIGHT_ON_ERROR=$on_error is neither allow nor drain: using allow"
    on_error=allow
    ;;
esac
case "$timeout_s" in '' | *[!0-9]*)
    say "ERROR: TRAINGUARD_PREFLIGHT_TIMEOUT_S=$timeout_s is not a whole number of seconds: using 120"
    timeout_s=120
    ;;
esac

tg="${TRAINGUARD_BIN:-$(command -v trainguard || echo /opt/trainguard/bin/trainguard)}"
if [ ! -x "$tg" ]; then
    say "ERROR: $tg is not an executable (set TRAINGUARD_BIN in $env_file): preflight skipped"
    exit 0
fi

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
base="$node_dir/$stamp-${job:-nojob}-$$"
results="$base.jsonl"
diag_log="$base.diag.log" # diag's own stderr: its last line is an error's reason
hook_log="$base.hook.log" # what the verdict, scontrol and the record said
read -r -a extra <<<"${TRAINGUARD_PREFLIGHT_ARGS:-}"

# -k: a test stuck in the driver may ignore TERM.
timeout -k 10 "$timeout_s" "$tg" diag --level "$level" --json --out "$results" ${extra[@]+"${extra[@]}"} \
    >/dev/null 2>"$diag_log" </dev/null
diag_exit=$?

judged=(--diag-exit "$diag_exit" --timeout-s "$timeout_s" --diag-stderr "$diag_log"
    --policy "$policy" --on-error "$on_error")
verdict="$(timeout 60 "$tg" preflight verdict "$results" "${judged[@]}" 2>>"$hook_log")"
verdict_exit=$?
{
    read -r action
    read -r outcome
    IFS= read -r reason
} <<<"$verdict"
if [ "$verdict_exit" != 0 ] || [ -z "${action:-}" ]; then
    say "ERROR: trainguard preflight verdict failed (exit $verdict_exit; see $hook_log): preflight skipped"
    exit 0
fi

take_out() {
    if [ "$scheduler" = kubernetes ]; then
        timeout 30 "$tg" preflight cordon --node "$node" --reason "$reason" --pod "${POD_NAME:-}" \
            >>"$hook_log" 2>&1 && taken=cordoned
    else
        timeout 30 scontrol update NodeName="$node" State=DRAIN Reason="$reason" \
            >>"$hook_log" 2>&1 && taken=drained
    fi
}

taken=none
case "$action" in
drain)
    taken=drain_failed
    take_out
    ;;
warn) taken=warned ;;
esac

# Recorded after the drain, so the record says what was done; bounded, and never the exit status.
timeout 60 "$tg" preflight record "$results" "${judged[@]}" --node "$node" --origin "$origin" \
    --job "$job" --level "$level" --action-taken "$taken" --log-dir "$log_dir" \
    >>"$hook_log" 2>&1 </dev/null ||
    say "WARNING: trainguard preflight record failed (exit $?; see $hook_log)"

say "level=$level diag_exit=$diag_exit outcome=$outcome action=$taken policy=$policy${reason:+ reason=$reason}"
if [ "$action" = drain ]; then
    exit 1
fi
exit 0

# Shared parts of the SLURM templates (sourced by colocated.sbatch and disaggregated.sbatch).
# Expects: PYTHON, SGLANG_PYTHON, RUN_DIR, LOG_DIR, GPUS_PER_NODE, MASTER_PORT, HEALTH_TIMEOUT, NODES (array);
# optional SGLANG_EXTRA_ARGS (further sglang.launch_server flags, space-separated) and SGLANG_HOST (the address
# servers and router listen on; default: the node's SLURM name, i.e. its cluster address; 0.0.0.0 = every
# interface).
#
# Servers and router get a fresh API key per job (SGLang --api-key) in $RUN_DIR/.rollout_api_key (mode 0600):
# sglang_keyed_launch.py reads it inside the server process, so it is on no command line; the trainer reads the
# same file (rollout.sglang.api_key_file). See docs/security.md.

CHILD_PIDS=()
SERVER_URLS=()
ROUTER_URL=""
API_KEY_FILE=""
SIDE_OVERRIDES=()

log() { echo "[$(date '+%F %T')] $*"; }

# Stop every child (srun steps of servers, router, trainer) on exit, failure or scancel (SIGTERM).
stop_children() {
    local pid
    for pid in "${CHILD_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 20); do
        local alive=0
        for pid in "${CHILD_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 1
    done
    for pid in "${CHILD_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
on_signal() {
    log "signal received: stopping every child process"
    trap - TERM INT EXIT
    stop_children
    exit 143
}
trap on_signal TERM INT
trap stop_children EXIT

# plan_job CONFIG [OVERRIDES...] -- [launch args...]: print the plan to the log (and $LOG_DIR/plan.txt),
# refuse an impossible one, and read its shell form (PLAN_* variables).
plan_job() {
    local args=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
    shift || true
    if ! "$PYTHON" -m megatron_rl.cli launch --dry-run "${args[@]}" "trainer.output_dir=$RUN_DIR" "$@" \
            > "$LOG_DIR/plan.txt" 2>&1; then
        cat "$LOG_DIR/plan.txt" >&2
        log "the plan is impossible (above): nothing was started" >&2
        exit 2
    fi
    cat "$LOG_DIR/plan.txt"
    eval "$("$PYTHON" -m megatron_rl.cli launch --dry-run "${args[@]}" "trainer.output_dir=$RUN_DIR" "$@" --emit shell)"
}

wait_healthy() {  # wait_healthy URL PATH PID: until URL+PATH answers, the process dies, or HEALTH_TIMEOUT
    local url="$1" path="$2" pid="$3" deadline=$((SECONDS + HEALTH_TIMEOUT))
    until "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url$path" \
            2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then log "$url exited before becoming healthy (see $LOG_DIR)" >&2; exit 1; fi
        if [ "$SECONDS" -ge "$deadline" ]; then log "$url not healthy after ${HEALTH_TIMEOUT}s" >&2; exit 1; fi
        sleep 2
    done
}

# make_api_key: a fresh random key in $RUN_DIR/.rollout_api_key (0600), once per job; sets API_KEY_FILE and
# KEYED_LAUNCH (the launcher that starts a server or router with that key; RUN_DIR and the repository are on a
# shared filesystem).
make_api_key() {
    [ -n "$API_KEY_FILE" ] && return 0
    API_KEY_FILE="$RUN_DIR/.rollout_api_key"
    "$PYTHON" -c "import sys; from megatron_rl.rollout.sglang.api_key import create_api_key_file as c; c(sys.argv[1])" \
        "$API_KEY_FILE"
    KEYED_LAUNCH="$("$PYTHON" -c "import megatron_rl.rollout.sglang.sglang_keyed_launch as m; print(m.__file__)")"
}

# start_sglang_servers: the plan's rollout servers (PLAN_SERVERS, "node:port:gpus" each), then sglang-router when
# the plan has one, all with the job's API key and listening on the node's own address. Sets SERVER_URLS,
# ROUTER_URL and API_KEY_FILE.
start_sglang_servers() {
    local entry index port gpus node pid
    local flags=() pids=()
    make_api_key
    [ -n "$PLAN_R3" ] && flags+=(--enable-return-routed-experts)
    [ -n "$PLAN_MEMORY_SAVER" ] && flags+=(--enable-memory-saver)  # rollout.release_memory (colocated)
    # shellcheck disable=SC2206
    [ -n "${SGLANG_EXTRA_ARGS:-}" ] && flags+=($SGLANG_EXTRA_ARGS)
    for entry in $PLAN_SERVERS; do
        IFS=: read -r index port gpus <<< "$entry"
        node="${NODES[$index]}"
        srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --output="$LOG_DIR/sglang_${node}_${port}.log" \
            env CUDA_VISIBLE_DEVICES="$gpus" \
            "$SGLANG_PYTHON" -P "$KEYED_LAUNCH" "$API_KEY_FILE" sglang.launch_server \
            --model-path "$PLAN_MODEL_PATH" --host "${SGLANG_HOST:-$node}" --port "$port" \
            --tp-size "$PLAN_SERVER_TP" --ep-size "$PLAN_SERVER_EP" \
            --mem-fraction-static "$PLAN_SERVER_MEM_FRACTION" "${flags[@]}" &
        CHILD_PIDS+=("$!")
        pids+=("$!")
        SERVER_URLS+=("http://$node:$port")
    done
    local i=0
    for url in "${SERVER_URLS[@]}"; do
        wait_healthy "$url" /health "${pids[$i]}"
        i=$((i + 1))
    done
    log "SGLang servers healthy: ${SERVER_URLS[*]}"
    if [ -n "$PLAN_ROUTER_NODE" ]; then
        node="${NODES[$PLAN_ROUTER_NODE]}"
        srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --output="$LOG_DIR/router_${node}.log" \
            "$SGLANG_PYTHON" -P "$KEYED_LAUNCH" "$API_KEY_FILE" sglang_router.launch_router \
            --host "${SGLANG_HOST:-$node}" --port "$PLAN_ROUTER_PORT" --policy "$PLAN_ROUTER_POLICY" \
            --prometheus-host 127.0.0.1 --worker-urls "${SERVER_URLS[@]}" &
        pid=$!
        CHILD_PIDS+=("$pid")
        ROUTER_URL="http://$node:$PLAN_ROUTER_PORT"
        wait_healthy "$ROUTER_URL" /liveness "$pid"
        log "sglang-router healthy: $ROUTER_URL"
    fi
}

# start_side_servers: the frozen side models the plan launches (PLAN_SIDE_SERVERS, "model:node:port:gpus" each;
# rollout.side_models without urls), with the job's API key, never sent weights; waits for their health. Sets
# SIDE_OVERRIDES, one `rollout.side_models.<i>.urls=[...]` per launched model, for the trainer.
start_side_servers() {
    local entry model index port gpus node path tp fraction url
    local flags=() pids=() urls=()
    [ -n "$PLAN_SIDE_SERVERS" ] || return 0
    make_api_key
    # shellcheck disable=SC2206
    [ -n "${SGLANG_EXTRA_ARGS:-}" ] && flags+=($SGLANG_EXTRA_ARGS)
    for entry in $PLAN_SIDE_SERVERS; do
        IFS=: read -r model index port gpus <<< "$entry"
        node="${NODES[$index]}"
        path="PLAN_SIDE_${model}_PATH" tp="PLAN_SIDE_${model}_TP" fraction="PLAN_SIDE_${model}_MEM_FRACTION"
        srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --output="$LOG_DIR/side_${model}_${node}_${port}.log" \
            env CUDA_VISIBLE_DEVICES="$gpus" \
            "$SGLANG_PYTHON" -P "$KEYED_LAUNCH" "$API_KEY_FILE" sglang.launch_server \
            --model-path "${!path}" --host "${SGLANG_HOST:-$node}" --port "$port" --tp-size "${!tp}" \
            --mem-fraction-static "${!fraction}" "${flags[@]}" &
        CHILD_PIDS+=("$!")
        pids+=("$!")
        urls+=("$model=http://$node:$port")
    done
    local i=0
    for url in "${urls[@]}"; do
        wait_healthy "${url#*=}" /health "${pids[$i]}"
        i=$((i + 1))
    done
    for model in $PLAN_SIDE_MODELS; do
        local mine=()
        for url in "${urls[@]}"; do [ "${url%%=*}" = "$model" ] && mine+=("${url#*=}"); done
        SIDE_OVERRIDES+=("rollout.side_models.$model.urls=[$(IFS=,; echo "${mine[*]}")]")
    done
    log "side models healthy: ${SIDE_OVERRIDES[*]}"
}

# run_trainer NNODES HEAD "NODE NAMES" [extra overrides...]: torchrun on each node (one srun task per
# node), c10d rendezvous on HEAD; resumes from RUN_DIR's last checkpoint. Returns the trainer's status.
# megatron_rl.launch.torchrun is torchrun that ends with one line, not a SignalException traceback, on scancel.
run_trainer() {
    local nnodes="$1" head="$2" nodelist="$3"
    shift 3
    log "trainer: $nnodes node(s) x $GPUS_PER_NODE ranks, rendezvous $head:$MASTER_PORT"
    # shellcheck disable=SC2086
    srun --overlap --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --nodelist="${nodelist// /,}" \
        --kill-on-bad-exit=1 \
        --output="$LOG_DIR/trainer_%N.log" \
        "$PYTHON" -m megatron_rl.launch.torchrun --nnodes="$nnodes" --nproc-per-node="$GPUS_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$head:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 \
        -m megatron_rl.cli train "$CONFIG" $OVERRIDES "trainer.output_dir=$RUN_DIR" trainer.resume=auto "$@" &
    local pid=$!
    CHILD_PIDS+=("$pid")
    local status=0
    wait "$pid" || status=$?
    log "trainer exited with status $status"
    return "$status"
}

#!/usr/bin/env bash
# The README's demo through Prefect: start a local Prefect server (SQLite, 127.0.0.1) unless
# PREFECT_API_URL is set, serve the deployments, trigger experiment/demo (configs/demo.yaml: one seed, one
# round of SPOGW on Qwen2.5-Coder-0.5B, then the base model and the trained round on held-out queries),
# watch it to the end, then print base vs trained held-out Mean@L / Best@L with the paired interval.
#   bash scripts/demo.sh              a new run (RUN_ID=demo-<time>; RUN_ID=... resumes that run)
#   bash scripts/demo.sh up           only start the server and serve the deployments
#   bash scripts/demo.sh stop         stop the server and the deployments this script started
# The server and the served deployments keep running afterwards, so `prefect deployment run
# experiment/demo`, `prefect deployment run iterate/smoke`, the UI (http://127.0.0.1:4200) and score/rescore work from any shell.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${PREFECT_HOME:-$HOME/.prefect}/workflow-grpo"  # pids and logs of what this script starts
mkdir -p "$STATE"
PORT=${PREFECT_PORT:-4200}

# a process that has exited but is not reaped yet (a zombie) answers kill -0: it is not alive
alive() { [[ -f "$1" ]] && live "$(cat "$1")"; }
healthy() { python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$PREFECT_API_URL" 2>/dev/null; }
# Each process this script starts leads its own process group (set -m: job control), so stopping it stops what it
# started too: flow runs, their stages, the Prefect server's workers.
start_group() { local pidfile=$1; shift; set -m; nohup "$@" & echo $! >"$pidfile"; set +m; }
live() {  # $1 = pid or -pgid: a live (not zombie) process is there
  ps -eo pid=,pgid=,stat= | awk -v t="$1" '(t < 0 ? $2 == -t : $1 == t) && $3 !~ /^Z/ {f = 1} END {exit !f}'
}
stop_group() {  # SIGTERM to the group the pid in $1 leads (else that pid), SIGKILL to what is left after $STOP_WAIT_S
  local pid target; pid=$(cat "$1")
  # a pid started by an older version of this script is no group leader: then the pid alone
  if live "-$pid"; then target=-$pid; elif live "$pid"; then target=$pid; else return 1; fi
  kill -TERM -- "$target" 2>/dev/null || true
  for _ in $(seq "${STOP_WAIT_S:-30}"); do live "$target" || return 0; sleep 1; done
  kill -KILL -- "$target" 2>/dev/null || true
  # a killed process is gone only once the kernel has torn it down, which a loaded machine can take a while to do:
  # return when it has, so that "stopped" means stopped (and a restart finds its port free)
  for _ in $(seq 100); do live "$target" || return 0; sleep 0.1; done
  echo "warning: process group $target still has live processes after SIGKILL" >&2
}

if [[ "${1:-}" == stop ]]; then
  # the deployments first: their shutdown reports to the server while it is still up
  for f in "$STATE/serve.pid" "$STATE/server.pid"; do
    if [[ -f "$f" ]] && stop_group "$f"; then echo "stopped $(basename "$f" .pid) (pid $(cat "$f") and its group)"; fi
    rm -f "$f"
  done
  exit 0
fi
[[ -n "${VIRTUAL_ENV:-}" ]] || . .venv/bin/activate
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

T0=$(date +%s)
if [[ -z "${PREFECT_API_URL:-}" ]]; then
  export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
  if ! healthy; then
    echo "starting a Prefect server on 127.0.0.1:$PORT (SQLite under ${PREFECT_HOME:-~/.prefect}; log $STATE/server.log)"
    start_group "$STATE/server.pid" prefect server start --host 127.0.0.1 --port "$PORT" >"$STATE/server.log" 2>&1
    for _ in $(seq 180); do healthy && break; sleep 1; done
    healthy || { echo "Prefect server did not start; see $STATE/server.log"; exit 1; }
  fi
  # Persist the URL in the active Prefect profile: `prefect deployment run ...` then works from any shell.
  prefect config set PREFECT_API_URL="$PREFECT_API_URL" >/dev/null
fi
echo "Prefect API: $PREFECT_API_URL (UI: ${PREFECT_API_URL%/api})"

# The served flows run in the serve process: one started from other code (an update since) is restarted.
REV="$(git rev-parse HEAD 2>/dev/null || echo unknown)$(git status --porcelain 2>/dev/null | md5sum | cut -c1-8)"
if alive "$STATE/serve.pid" && [[ "$(cat "$STATE/serve.rev" 2>/dev/null)" != "$REV" ]]; then
  echo "the code changed since the deployments were served: restarting them"
  stop_group "$STATE/serve.pid" || true
fi
if ! alive "$STATE/serve.pid"; then
  echo "serving the deployments (log $STATE/serve.log)"
  start_group "$STATE/serve.pid" python -m flows.serve >"$STATE/serve.log" 2>&1
  echo "$REV" >"$STATE/serve.rev"
fi
for _ in $(seq 120); do prefect deployment inspect experiment/demo >/dev/null 2>&1 && break; sleep 1; done
prefect deployment inspect experiment/demo >/dev/null 2>&1 || { echo "deployments not served; see $STATE/serve.log"; exit 1; }
if [[ "${1:-}" == up ]]; then
  echo "deployments served: experiment/demo experiment/learn experiment/default iterate/smoke iterate/default"\
       "score/rescore evaluate/default"
  exit 0
fi
# vLLM (CPU tier) samples 2.2x faster in bf16 here; without it the demo falls back to transformers.
SETS='[]'
python -c "import vllm" >/dev/null 2>&1 || { echo "vllm not importable: rollout on transformers (slower)";
                                             SETS='["generator.backend=transformers"]'; }

RUN_ID=${RUN_ID:-demo-$(date -u +%Y%m%d-%H%M%S)}
echo "running experiment/demo with run_id=$RUN_ID (flow logs follow)"
tail -n0 -F "$STATE/serve.log" &
TAIL=$!
trap 'kill $TAIL 2>/dev/null || true' EXIT
rc=0
prefect deployment run experiment/demo --param run_id="$RUN_ID" --param sets="$SETS" --watch --watch-interval 5 \
  || rc=$?
sleep 2; kill $TAIL 2>/dev/null || true
echo
echo "demo wall time: $(( $(date +%s) - T0 )) s (flow state: $([[ $rc == 0 ]] && echo completed || echo FAILED))"
pipeline report "$RUN_ID" --store data/runs
echo "resume this run: RUN_ID=$RUN_ID bash scripts/demo.sh | stop the server: bash scripts/demo.sh stop"
exit $rc

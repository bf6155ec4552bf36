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
[[ -n "${VIRTUAL_ENV:-}" ]] || . .venv/bin/activate
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
STATE="${PREFECT_HOME:-$HOME/.prefect}/workflow-grpo"  # pids and logs of what this script starts
mkdir -p "$STATE"
PORT=${PREFECT_PORT:-4200}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
healthy() { python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$PREFECT_API_URL" 2>/dev/null; }

if [[ "${1:-}" == stop ]]; then
  for f in "$STATE/serve.pid" "$STATE/server.pid"; do
    if alive "$f"; then kill "$(cat "$f")" && echo "stopped $(basename "$f" .pid) (pid $(cat "$f"))"; fi
    rm -f "$f"
  done
  exit 0
fi

T0=$(date +%s)
if [[ -z "${PREFECT_API_URL:-}" ]]; then
  export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
  if ! healthy; then
    echo "starting a Prefect server on 127.0.0.1:$PORT (SQLite under ${PREFECT_HOME:-~/.prefect}; log $STATE/server.log)"
    nohup prefect server start --host 127.0.0.1 --port "$PORT" >"$STATE/server.log" 2>&1 &
    echo $! >"$STATE/server.pid"
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
  kill "$(cat "$STATE/serve.pid")" && sleep 2
fi
if ! alive "$STATE/serve.pid"; then
  echo "serving the deployments (log $STATE/serve.log)"
  nohup python -m flows.serve >"$STATE/serve.log" 2>&1 &
  echo $! >"$STATE/serve.pid"
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

#!/usr/bin/env bash
# Start one disagg instance. Settings come from the environment:
#   ROLE          producer | consumer                      (required)
#   ENGINE        reference | trtllm                       (default: reference)
#   DISAGG_CONFIG disagg config file                       (default: deploy/$ROLE.yaml)
#   PORT          HTTP port of the OpenAI-compatible server (default: 8100 producer, 8200 consumer)
#   MODEL         model name or path (trtllm engine; optional for reference)
#   DISAGG        the disagg command                        (default: disagg on PATH, else python3 -m disagg)
# Extra arguments are passed on to `disagg serve`. It listens on 127.0.0.1 unless they say
# otherwise: a container passes --host 0.0.0.0 (as deploy/docker-compose.yml does).
# Examples:
#   ROLE=producer deploy/launch.sh
#   ROLE=consumer ENGINE=trtllm MODEL=meta-llama/Llama-3.1-8B-Instruct PORT=8200 deploy/launch.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

ROLE="${ROLE:-}"
case "$ROLE" in
  producer) default_port=8100 ;;
  consumer) default_port=8200 ;;
  *) echo "launch.sh: set ROLE=producer or ROLE=consumer (got '${ROLE}')" >&2; exit 2 ;;
esac

ENGINE="${ENGINE:-reference}"
case "$ENGINE" in
  reference|trtllm) ;;
  *) echo "launch.sh: ENGINE must be reference or trtllm (got '${ENGINE}')" >&2; exit 2 ;;
esac

DISAGG_CONFIG="${DISAGG_CONFIG:-$here/$ROLE.yaml}"
if [[ ! -f "$DISAGG_CONFIG" ]]; then
  echo "launch.sh: DISAGG_CONFIG=$DISAGG_CONFIG does not exist" >&2
  exit 2
fi
PORT="${PORT:-$default_port}"

# TensorRT-LLM forwards only TRTLLM*/TLLM* variables to its workers: the connector finds its
# config through TRTLLM_DISAGG_CONFIG.
export DISAGG_CONFIG
export TRTLLM_DISAGG_CONFIG="$DISAGG_CONFIG"

if [[ -n "${DISAGG:-}" ]]; then
  read -r -a cmd <<<"$DISAGG"
elif command -v disagg >/dev/null 2>&1; then
  cmd=(disagg)
else
  cmd=(python3 -m disagg)
fi

args=(serve --role "$ROLE" --engine "$ENGINE" --config "$DISAGG_CONFIG" --port "$PORT")
if [[ -n "${MODEL:-}" ]]; then
  args+=(--model "$MODEL")
fi

echo "launch.sh: ${cmd[*]} ${args[*]} $*" >&2
exec "${cmd[@]}" "${args[@]}" "$@"

#!/bin/bash
# Plain environment variables: run this once on every host (or N times on one host),
# with the same flags everywhere and PROCESS_ID 0..NUM_PROCESSES-1. Process 0 listens
# on COORDINATOR (host:port), which every process must reach.
#   launch/multihost/env_launch.sh COORDINATOR NUM_PROCESSES PROCESS_ID WORKDIR [train.py flags...]
# e.g. on host A: launch/multihost/env_launch.sh 10.0.0.1:1234 2 0 runs/x --config configs/default.py
#      on host B: launch/multihost/env_launch.sh 10.0.0.1:1234 2 1 runs/x --config configs/default.py
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 COORDINATOR NUM_PROCESSES PROCESS_ID WORKDIR [train.py flags...]" >&2
  exit 2
fi
export JAX_COORDINATOR_ADDRESS=$1 JAX_NUM_PROCESSES=$2 JAX_PROCESS_ID=$3
WORKDIR=$4; shift 4
export RL_JAX_INIT_TIMEOUT_S=${RL_JAX_INIT_TIMEOUT_S:-300}
exec python3 "$(dirname "$0")/../train.py" --workdir "$WORKDIR" "$@"

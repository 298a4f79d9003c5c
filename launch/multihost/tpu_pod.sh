#!/bin/bash
# Runs launch/train.py on every worker of a Cloud TPU pod slice (one process per host).
# The TPU runtime tells jax.distributed the coordinator and the process ids, so no
# JAX_* variables are needed. Usage:
#   launch/multihost/tpu_pod.sh TPU_NAME ZONE REPO_DIR_ON_WORKERS WORKDIR [train.py flags...]
# e.g. launch/multihost/tpu_pod.sh my-v5e-16 us-west4-a '~/rl_jax' gs://bucket/runs/x \
#        --config configs/qwen2_gsm8k.py:model=qwen2_0_5b
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 TPU_NAME ZONE REPO_DIR WORKDIR [train.py flags...]" >&2
  exit 2
fi
TPU=$1; ZONE=$2; REPO=$3; WORKDIR=$4; shift 4
FLAGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
  --command="cd $REPO && RL_JAX_INIT_TIMEOUT_S=\${RL_JAX_INIT_TIMEOUT_S:-300} python3 launch/train.py --workdir $WORKDIR$FLAGS"

#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) under torchrun on 1, 2 and N GPUs, and on N GPUs split into
# virtual nodes of N/2 (so all four route classes happen on one host). One command for the matrix:
#
#   bash scripts/run_gpu_tests.sh            # N = number of GPUs on this host
#   bash scripts/run_gpu_tests.sh 2          # at most 2 GPUs
#   PYTEST_ARGS="-k h256" bash scripts/run_gpu_tests.sh
#   LAUNCHES="virtual full" bash scripts/run_gpu_tests.sh 4   # a subset: 1, 2, virtual, full
#
# Prints rank 0's pytest output for each launch and a summary line per launch; exits non-zero if
# any launch failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ngpu=$(nvidia-smi -L | wc -l)
n=${1:-$ngpu}
((n > ngpu)) && n=$ngpu
port=${MASTER_PORT:-29611}
status=0
summary=()
launch() {  # launch NAME NPROC LOCAL_WORLD_SIZE
  local name=$1 nproc=$2 lws=$3
  echo "=== $name: $nproc GPU(s), local world size $lws"
  port=$((port + 1))
  local log
  log=$(mktemp)
  CUTE_EP_LOCAL_WORLD_SIZE=$lws timeout "${GPU_TEST_TIMEOUT:-900}" python3 -m torch.distributed.run --nproc-per-node "$nproc" \
    --master-port "$port" --local-ranks-filter 0 -m pytest tests/gpu -m gpu -q -p no:cacheprovider \
    ${PYTEST_ARGS:-} 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local last
  last=$(grep -E "passed|failed|error" "$log" | tail -n 1)
  summary+=("$name: rc=$rc ${last}")
  ((rc == 0)) || status=1
  rm -f "$log"
}
wanted() { [[ " ${LAUNCHES:-1 2 virtual full} " == *" $1 "* ]]; }
wanted 1 && launch "1 GPU" 1 1
((n >= 2)) && wanted 2 && launch "2 GPUs" 2 2
((n >= 2)) && wanted virtual && launch "$n GPUs as 2 virtual nodes x $((n / 2))" "$n" $((n / 2))
((n >= 4)) && wanted full && launch "$n GPUs" "$n" "$n"
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $status

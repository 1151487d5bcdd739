#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) under torchrun in every launch shape this host allows: one command
# for the matrix.
#
#   bash scripts/run_gpu_tests.sh            # N = number of GPUs on this host
#   bash scripts/run_gpu_tests.sh 2          # at most 2 GPUs
#   PYTEST_ARGS="-k h256" bash scripts/run_gpu_tests.sh
#   LAUNCHES="virtual full" bash scripts/run_gpu_tests.sh 4   # a subset (names below)
#
# Launches (LAUNCHES picks; default: every one this host can run that uses a GPU per rank, and on a
# one-GPU host the shared ones):
#   1          1 rank on 1 GPU
#   2          2 ranks on 2 GPUs                      (N >= 2)
#   virtual    N ranks on N GPUs as 2 virtual nodes    (N >= 2; all four route classes)
#   full       N ranks on N GPUs                      (N >= 4)
#   double     2N ranks on N GPUs, two per GPU         (N >= 2; e.g. EP8 on 4 GPUs)
#   doublev    2N ranks on N GPUs as 2 virtual nodes of N
#   shared2    2 ranks on one GPU
#   shared4    4 ranks on one GPU
#   shared4v   4 ranks on one GPU as 2 virtual nodes of 2
#   shared8    8 ranks on one GPU
# Ranks that share a GPU need CUDA MPS: the script starts it (scripts/mps.sh) before the first shared
# launch when it is not running, and stops it at the end only if it started it.
#
# Prints rank 0's pytest output for each launch, every rank's failures as they happen, and a summary line
# per launch (every rank's pytest result, each distinct one once with its number of ranks, failures
# first, then the failed tests by name); exits non-zero if any launch failed. The other ranks' pytest
# reports go to $GPU_TEST_LOG_DIR/<launch>/rank<R>.log (default /tmp/cute_ep_gpu_tests), and the launch's
# whole output, rank 0's report in it, to launch.log beside them (kept where the console's copy is lost).
# A test that hangs ends itself after GPU_TEST_WATCHDOG_S seconds (default 120; compile time not
# counted), printing the rank, the test and every thread's stack (tests/gpu/conftest.py); GPU_TEST_TIMEOUT
# (default 900 s) bounds a whole launch.
set -uo pipefail
cd "$(dirname "$0")/.."
ngpu=$(nvidia-smi -L | wc -l)
n=${1:-$ngpu}
((n > ngpu)) && n=$ngpu
if ((ngpu == 1)); then default="1 shared2 shared4 shared4v shared8"; else default="1 2 virtual full double doublev"; fi
port=${MASTER_PORT:-29611}
status=0
summary=()
started_mps=0

stop_mps() {
  ((started_mps)) && bash scripts/mps.sh stop
}
trap stop_mps EXIT

need_mps() {
  ((started_mps)) && return 0
  local said
  said=$(bash scripts/mps.sh start) || { echo "$said"; return 1; }
  echo "$said"
  [[ $said == *started* ]] && started_mps=1
  return 0
}

launch() {  # launch NAME NPROC LOCAL_WORLD_SIZE GPUS_USED
  local name=$1 nproc=$2 lws=$3 gpus=$4
  local seed=${GPU_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}
  echo "=== $name: $nproc rank(s) on $gpus GPU(s), local world size $lws, GPU_TEST_SEED=$seed"
  if ((nproc > gpus)) && ! need_mps; then
    summary+=("$name: not run (CUDA MPS did not start)")
    status=1
    return
  fi
  port=$((port + 1))
  local log logs
  logs="${GPU_TEST_LOG_DIR:-/tmp/cute_ep_gpu_tests}/${name// /_}"
  mkdir -p "$logs"
  log="$logs/launch.log"
  # No --local-ranks-filter: ranks other than 0 write their pytest report to $logs, and print only their
  # failures and watchdog reports (tests/gpu/conftest.py).
  env CUTE_EP_GPUS_PER_HOST=$gpus CUTE_EP_LOCAL_WORLD_SIZE=$lws GPU_TEST_LOG_DIR="$logs" GPU_TEST_SEED=$seed \
    timeout "${GPU_TEST_TIMEOUT:-900}" \
    python3 -m torch.distributed.run --nproc-per-node "$nproc" --master-port "$port" \
    -m pytest tests/gpu -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local results
  # Every rank's pytest line ("1 failed, 120 passed, 4 skipped in 40.1s"; not torchrun's failure lines),
  # timing dropped, each distinct result once with its number of ranks, failures first: a test that fails
  # on one rank only shows here.
  results=$(grep -E "^[0-9]+ (passed|failed|error|errors|skipped|deselected)|^no tests ran" "$log" \
    | sed -E 's/ in [0-9.]+s.*$//' | sort | uniq -c \
    | awk '{n=$1; sub(/^ *[0-9]+ /, ""); bad=($0 ~ /failed|error/) ? 0 : 1
            printf "%d\t%s (%d rank%s)\n", bad, $0, n, (n == 1 ? "" : "s")}' \
    | sort -s -k1,1n | cut -f2 | paste -sd ';' | sed 's/;/; /g')
  local failed  # rank 0's "FAILED <test id> - <why>" and the others' "[rank R] FAILED <test id> (<when>):"
  failed=$(grep -oE "^(\[rank [0-9]+\] )?FAILED [^ ]+" "$log" | sed -E 's/^.*FAILED //' | sort -u \
    | paste -sd ';' | sed 's/;/, /g')
  results=${results:-no pytest summary (see the log above)}
  summary+=("$name (seed $seed): rc=$rc $results${failed:+; failed: $failed}")
  ((rc == 0)) || status=1
  # A shared launch that failed may have left the MPS server refusing new clients ("CUDA-capable
  # device(s) is/are busy or unavailable" at the next launch's first CUDA call, seen on H100 and H200):
  # a daemon this script started is stopped, and the next shared launch starts a fresh one.
  if ((rc != 0 && nproc > gpus && started_mps)); then
    bash scripts/mps.sh stop
    started_mps=0
  fi
}
wanted() { [[ " ${LAUNCHES:-$default} " == *" $1 "* ]]; }
wanted 1 && launch "1 GPU" 1 1 1
((n >= 2)) && wanted 2 && launch "2 GPUs" 2 2 2
((n >= 2)) && wanted virtual && launch "$n GPUs as 2 virtual nodes x $((n / 2))" "$n" $((n / 2)) "$n"
((n >= 4)) && wanted full && launch "$n GPUs" "$n" "$n" "$n"
((n >= 2)) && wanted double && launch "$((2 * n)) ranks on $n GPUs" $((2 * n)) $((2 * n)) "$n"
((n >= 2)) && wanted doublev && launch "$((2 * n)) ranks on $n GPUs as 2 virtual nodes x $n" $((2 * n)) "$n" "$n"
wanted shared2 && launch "2 ranks on one GPU" 2 2 1
wanted shared4 && launch "4 ranks on one GPU" 4 4 1
wanted shared4v && launch "4 ranks on one GPU as 2 virtual nodes x 2" 4 2 1
wanted shared8 && launch "8 ranks on one GPU" 8 8 1
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $status

#!/usr/bin/env bash
# Everything the open issues' "done when" asks of a 4-GPU host, in parts that each fit one call of the
# lent machine (10 minutes), with logs and artifacts written under $OUT (default ./out/gpu-session).
#
#   bash scripts/gpu_session.sh tests-a     # GPU tests on 1 and 2 GPUs                     (~6 min)
#   bash scripts/gpu_session.sh tests-b     # GPU tests on 2 virtual nodes x N/2 and N GPUs  (~5 min)
#   bash scripts/gpu_session.sh examples    # design-card example, baselines compared and saved,
#                                           # --benchmark at T=4096 H=7168 K=8 E=256 bf16     (~4 min)
#   bash scripts/gpu_session.sh bench       # the sweep against NCCL (JSON + PNG; pull and reduced
#                                           # combine), FP8 rows                                (~2 min)
#   bash scripts/gpu_session.sh soak        # 1000 iterations twice with one seed, capacity+FP8,
#                                           # the reduced combine                               (~3 min)
#   bash scripts/gpu_session.sh sanitizer   # compute-sanitizer memcheck, one GPU, no torchrun
#   bash scripts/gpu_session.sh peers       # issue 14: ours (both layouts) vs DeepEP and NCCL at 24, 48
#                                           # and 132 SMs, T=4096 and 8192 (build DeepEP first:
#                                           # .gpu/b/peers/build_deepep.sh; PYTHONPATH=/tmp/deepep)
#   bash scripts/gpu_session.sh decode      # issue 15: decode kernels and public calls vs DeepEP (JSON)
#   N=2 bash scripts/gpu_session.sh tests-a # fewer GPUs than the host has
#   DRY_RUN=1 N=4 bash scripts/gpu_session.sh examples   # print the commands only (any machine)
#
# The compiled modules are cached in $CUTE_EP_COMPILE_CACHE (default /tmp/cute_ep_objects): the first
# part on a fresh machine compiles (about 1 minute per dtype), later parts load them in seconds.
# Each part ends with a "=== <part>: rc=N" line; the exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?"usage: bash scripts/gpu_session.sh tests-a|tests-b|examples|bench|soak|sanitizer|peers|decode"}
out=${OUT:-out/gpu-session}
mkdir -p "$out"
export CUTE_EP_COMPILE_CACHE=${CUTE_EP_COMPILE_CACHE:-/tmp/cute_ep_objects}
n=${N:-$(nvidia-smi -L | wc -l)}
half=$((n / 2 > 0 ? n / 2 : 1))
T="python3 -m torch.distributed.run --nproc-per-node $n --local-ranks-filter 0"
A="--num-tokens 64 --hidden 256 --num-experts 32 --topk 2"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep the log, print its last lines
  local name=$1 limit=$2
  shift 2
  echo "--- $name: $*"
  if [[ -n ${DRY_RUN:-} ]]; then
    return
  fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -v -e '^\*\*\*' -e 'OMP_NUM_THREADS' "$out/$name.log" | tail -n 12
  echo "--- $name: rc=$rc"
  ((rc == 0)) || status=1
}

case $part in
  tests-a)
    step tests-1-2 580 env LAUNCHES="1 2" GPU_TEST_TIMEOUT=290 PYTEST_ARGS=-rs bash scripts/run_gpu_tests.sh "$n"
    ;;
  tests-b)
    step tests-virtual-full 580 env LAUNCHES="virtual full" GPU_TEST_TIMEOUT=290 PYTEST_ARGS=-rs \
      bash scripts/run_gpu_tests.sh "$n"
    ;;
  examples)
    # Committed baselines of this world size (made on the CPU with --backend reference) must be
    # reproduced bit for bit; the GPU run's own arrays are saved next to the logs for committing.
    for dtype in bfloat16 float32; do
      short=$([[ $dtype == bfloat16 ]] && echo bf16 || echo fp32)
      for lws in "$n" "$half"; do
        name="ep${n}_l${lws}_${short}"
        cmp=()
        [[ -f baselines/$name.npz ]] && cmp=(--compare-baseline "baselines/$name.npz")
        step "example-$name" 150 env CUTE_EP_LOCAL_WORLD_SIZE="$lws" $T scripts/dispatch_and_combine.py $A \
          --dtype "$dtype" "${cmp[@]}" --save-baseline-to "$out/$name.npz"
      done
    done
    step example-benchmark 200 $T scripts/dispatch_and_combine.py --num-tokens 4096 --hidden 7168 \
      --num-experts 256 --topk 8 --dtype bfloat16 --no-coverage --benchmark --bench-iters 30 --bench-warmup 5
    ;;
  bench)
    step bench-sweep 400 $T scripts/benchmark.py --combine pull,reduced --out-json "$out/h200x$n.json" \
      --out-png "$out/h200x$n.png"
    step bench-fp8 150 $T scripts/benchmark.py --tokens 128,4096 --routing uniform --fp8 --iters 20 \
      --out-json "$out/h200x${n}_fp8.json"
    ;;
  soak)
    for run in 1 2; do
      step "soak-$run" 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
        --out-json "$out/soak-$run.json"
    done
    grep -h "digest:" "$out/soak-1.log" "$out/soak-2.log"
    step soak-capacity-fp8 170 $T scripts/soak.py --iters 1000 --max-tokens 64 --hidden 256 --seed 7 \
      --fp8 --capacity-factor 0.75 --out-json "$out/soak-capacity-fp8.json"
    step soak-reduced 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
      --combine reduced --out-json "$out/soak-reduced.json"
    step soak-layouts 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
      --layouts expert,rank --out-json "$out/soak-layouts.json"
    ;;
  peers)
    # One run, the same inputs and SM budget for every peer (DeepEP at 128 SMs for the full GPU).
    step bench-peers 580 $T scripts/benchmark.py --tokens 4096,8192 --routing uniform --combine pull,reduced \
      --layouts expert,rank --num-sms 24,48,132 --peers nccl,deepep --iters 20 --warmup 3 \
      --out-json "$out/h200x${n}_vs_deepep.json" --out-png "$out/h200x${n}_vs_deepep.png"
    ;;
  decode)
    step decode 580 $T scripts/decode_breakdown.py --tokens 1,32,128,256 --num-sms 24,132 --peers deepep \
      --out-json "$out/h200x${n}_decode.json"
    ;;
  sanitizer)
    # One process, no torchrun: only the script is instrumented (a world of one: self route only).
    # API errors are not counted: NVSHMEM's initialization probes the driver and hits some by design.
    # --combine reduced runs both combines (reduced, then pull on the same handle).
    step sanitizer 580 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --report-api-errors no \
      --print-limit 100 python3 scripts/dispatch_and_combine.py $A --modes scatter,atomic --no-coverage --combine reduced
    ;;
  *)
    echo "unknown part: $part" >&2
    exit 2
    ;;
esac
echo "=== $part: rc=$status (logs in $out)"
exit $status

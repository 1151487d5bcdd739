#!/usr/bin/env bash
# A full verification of a GPU host in parts of a few minutes each, with logs and artifacts under $OUT
# (default ./out/gpu-session).
#
#   bash scripts/gpu_session.sh tests-a     # GPU tests: 1 and 2 GPUs (one GPU: 1 rank, 2 and 4 ranks on it)
#   bash scripts/gpu_session.sh tests-b     # GPU tests: 2 virtual nodes and N GPUs (one GPU: 4 ranks as
#                                           # 2 virtual nodes of 2, 8 ranks on it)
#   bash scripts/gpu_session.sh tests-c     # GPU tests: 2N ranks on N GPUs, two per GPU under MPS, on one
#                                           # node and as 2 virtual nodes of N (EP8 on 4 GPUs)
#   bash scripts/gpu_session.sh examples    # the design card's example, both dtypes, one node and 2
#                                           # virtual nodes, compared with baselines/ and saved
#   bash scripts/gpu_session.sh bench       # the sweep against NCCL (JSON + PNG; pull and reduced
#                                           # combine), FP8 rows
#   bash scripts/gpu_session.sh soak        # 1000 validated iterations with stragglers: twice with one
#                                           # seed, capacity + FP8, the reduced combine, both layouts
#   bash scripts/gpu_session.sh sanitizer   # compute-sanitizer memcheck, one process, no torchrun
#   bash scripts/gpu_session.sh peers       # ours (both layouts) vs DeepEP and NCCL at 24 SMs and each
#                                           # rank's maximum, 128, 4096 and 8192 tokens (JSON + PNG)
#   bash scripts/gpu_session.sh decode      # decode sizes: kernels and public calls vs DeepEP (JSON)
#   bash scripts/gpu_session.sh grid-wait   # one rank: each kernel alone, then beside a side-stream kernel
#
#   RANKS=4 bash scripts/gpu_session.sh examples   # ranks per host (default: one per GPU); more ranks than
#                                                  # GPUs share them under CUDA MPS
#   N=2 bash scripts/gpu_session.sh tests-a        # use fewer GPUs than the host has
#   DRY_RUN=1 N=4 bash scripts/gpu_session.sh examples   # print the commands only (any machine)
#
# DeepEP is timed beside ours when `import deep_ep` works (PYTHONPATH), else skipped with the reason.
# Ranks that share a GPU need CUDA MPS: a part whose RANKS exceed the GPUs starts it (scripts/mps.sh) and
# stops it at the end only if it started it. The compiled modules are cached in $CUTE_EP_COMPILE_CACHE
# (default /tmp/cute_ep_objects; fill it ahead with scripts/precompile.py): the first launch without them
# compiles (about 1 minute per dtype). Each part ends with a "=== <part>: rc=N" line; the exit status is
# non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/gpu_session.sh tests-a|tests-b|tests-c|examples|bench|soak|sanitizer|peers|decode|grid-wait"
part=${1:?$usage}
out=${OUT:-out/gpu-session}
mkdir -p "$out"
export CUTE_EP_COMPILE_CACHE=${CUTE_EP_COMPILE_CACHE:-/tmp/cute_ep_objects}
if [[ -n ${N:-} ]]; then n=$N; elif [[ -n ${DRY_RUN:-} ]]; then n=4; else n=$(nvidia-smi -L | wc -l); fi
ranks=${RANKS:-$n}
half=$((ranks / 2 > 0 ? ranks / 2 : 1))
T="python3 -m torch.distributed.run --nproc-per-node $ranks --local-ranks-filter 0"
A="--num-tokens 64 --hidden 256 --num-experts 32 --topk 2"
status=0
started_mps=0

if ((ranks > n)) && [[ -z ${DRY_RUN:-} ]]; then
  # More ranks than GPUs: rank r binds GPU r % N, and the ranks of one GPU run together under MPS.
  export CUTE_EP_GPUS_PER_HOST=$n
  said=$(bash scripts/mps.sh start) || { echo "$said" >&2; exit 1; }
  echo "$said"
  [[ $said == *started* ]] && started_mps=1
fi
stop_mps() {
  ((started_mps)) && bash scripts/mps.sh stop
}
trap stop_mps EXIT

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

# Report names: shared_gpu_ep<ranks> when ranks share GPUs, else <gpu>x<n> (h200x2, h100x8, ...).
gpu=gpu
[[ -z ${DRY_RUN:-} ]] && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 \
  | grep -oiE 'h100|h200|h20|b200|b300|a100|gh200|gb200' | head -n 1 | tr '[:upper:]' '[:lower:]')
tag=$(if ((ranks > n)); then echo "shared_gpu_ep$ranks"; else echo "${gpu:-gpu}x$n"; fi)
case $part in
  tests-a)
    launches=$(if ((n == 1)); then echo "1 shared2 shared4"; else echo "1 2"; fi)
    step tests-a 580 env LAUNCHES="$launches" GPU_TEST_TIMEOUT=290 PYTEST_ARGS=-rs bash scripts/run_gpu_tests.sh "$n"
    ;;
  tests-b)
    launches=$(if ((n == 1)); then echo "shared4v shared8"; else echo "virtual full"; fi)
    step tests-b 580 env LAUNCHES="$launches" GPU_TEST_TIMEOUT=290 PYTEST_ARGS=-rs bash scripts/run_gpu_tests.sh "$n"
    ;;
  tests-c)
    step tests-c 580 env LAUNCHES="double doublev" GPU_TEST_TIMEOUT=290 PYTEST_ARGS=-rs bash scripts/run_gpu_tests.sh "$n"
    ;;
  examples)
    # Committed baselines of this world size (made on the CPU with --backend reference) must be
    # reproduced bit for bit; the GPU run's own arrays are saved next to the logs.
    for dtype in bfloat16 float32; do
      short=$([[ $dtype == bfloat16 ]] && echo bf16 || echo fp32)
      for lws in "$ranks" "$half"; do
        name="ep${ranks}_l${lws}_${short}"
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
    step bench-sweep 400 $T scripts/benchmark.py --combine pull,reduced --out-json "$out/$tag.json" \
      --out-png "$out/$tag.png"
    step bench-fp8 150 $T scripts/benchmark.py --tokens 128,4096 --routing uniform --fp8 --iters 20 \
      --out-json "$out/${tag}_fp8.json"
    ;;
  soak)
    for run in 1 2; do
      step "soak-$run" 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
        --out-json "$out/soak-$run.json"
    done
    [[ -z ${DRY_RUN:-} ]] && grep -h "digest:" "$out/soak-1.log" "$out/soak-2.log"
    step soak-capacity-fp8 170 $T scripts/soak.py --iters 1000 --max-tokens 64 --hidden 256 --seed 7 \
      --fp8 --capacity-factor 0.75 --out-json "$out/soak-capacity-fp8.json"
    step soak-reduced 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
      --combine reduced --out-json "$out/soak-reduced.json"
    step soak-layouts 170 $T scripts/soak.py --iters 1000 --max-tokens 128 --hidden 1024 --seed 7 \
      --layouts expert,rank --out-json "$out/soak-layouts.json"
    ;;
  peers)
    # One run, the same inputs and SM budget for every peer (DeepEP at 128 SMs for a full 132-SM GPU).
    step bench-peers 580 $T scripts/benchmark.py --tokens 128,4096,8192 --routing uniform --combine pull \
      --layouts expert,rank --num-sms 24,max --peers nccl,deepep --iters 20 --warmup 3 \
      --out-json "$out/${tag}_vs_deepep.json" --out-png "$out/${tag}_vs_deepep.png"
    ;;
  decode)
    step decode 580 $T scripts/decode_breakdown.py --tokens 1,32,128,256 --num-sms 24,max --peers deepep \
      --out-json "$out/${tag}_decode.json"
    ;;
  grid-wait)
    # The layout's CTAs wait for each other: at a budget of every SM, does a one-thread kernel on another
    # stream (started with each step) hold it up? Each configuration twice, to tell a stall from noise.
    for sleep_us in 0 200; do
      for run in 1 2; do
        step "grid-wait-$sleep_us-$run" 200 python3 -m torch.distributed.run --nproc-per-node 1 \
          scripts/kernel_times.py --tokens 128,4096 --num-sms 24,max --layouts expert,rank \
          --side-sleep-us "$sleep_us" --out-json "$out/grid_wait_${sleep_us}_$run.json"
      done
    done
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
    echo "$usage" >&2
    exit 2
    ;;
esac
echo "=== $part: rc=$status (logs in $out)"
exit $status

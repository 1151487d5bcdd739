#!/usr/bin/env bash
# CUDA MPS (Multi-Process Service) for ranks that share a GPU.
#
#   bash scripts/mps.sh start     # start the control daemon unless one answers (exit 0 either way)
#   bash scripts/mps.sh status    # exit 0 and say so when a daemon answers, else exit 1
#   bash scripts/mps.sh stop      # ask the daemon to quit (after its clients end)
#
# Why: when a host runs more ranks than GPUs, NVSHMEM needs the ranks' kernels to run at the same time.
# Without MPS it falls back to a "limited" mode (kernels of different processes time-slice, no on-stream
# barrier), and cute-ep's Runtime refuses to start. MPS ships with the NVIDIA driver.
#
# Folders: CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps, where CUDA clients look when the variable is
# unset, so ranks need no setting) and CUDA_MPS_LOG_DIRECTORY (default /tmp/nvidia-mps-log). A daemon
# started with other folders serves only clients that set the same CUDA_MPS_PIPE_DIRECTORY.
# `start` prints "started" or "already running", so a caller can stop only what it started.
set -uo pipefail
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}

answers() {  # the daemon replies to a control command
  echo get_server_list | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
}

case "${1:-}" in
  start)
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
      echo "mps: nvidia-cuda-mps-control not found (it ships with the NVIDIA driver)" >&2
      exit 1
    fi
    if answers; then
      echo "mps: already running (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
      exit 0
    fi
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! nvidia-cuda-mps-control -d; then
      # another launch on this host may have started it between our check and ours
      sleep 1
      if answers; then
        echo "mps: already running (started by another process; pipes in $CUDA_MPS_PIPE_DIRECTORY)"
        exit 0
      fi
      echo "mps: the control daemon did not start (log: $CUDA_MPS_LOG_DIRECTORY/control.log)" >&2
      exit 1
    fi
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      answers && { echo "mps: started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"; exit 0; }
      sleep 0.5
    done
    echo "mps: the control daemon started but does not answer (log: $CUDA_MPS_LOG_DIRECTORY)" >&2
    exit 1
    ;;
  stop)
    if ! answers; then
      echo "mps: not running"
      exit 0
    fi
    echo quit | nvidia-cuda-mps-control
    for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
      answers || { echo "mps: stopped"; exit 0; }
      sleep 0.5
    done
    echo "mps: asked to quit; it ends when its clients do" >&2
    exit 0
    ;;
  status)
    if answers; then
      echo "mps: running (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
      exit 0
    fi
    echo "mps: not running (pipes would be in $CUDA_MPS_PIPE_DIRECTORY)"
    exit 1
    ;;
  *)
    echo "usage: bash scripts/mps.sh start|stop|status" >&2
    exit 2
    ;;
esac

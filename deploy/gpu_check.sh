#!/usr/bin/env bash
# The checks a session with a lent CUDA GPU runs in one go (well under 10 minutes): the torch decoder's
# decode step on CUDA at full depth and at each exit, CUDA vs CPU greedy tokens, one NVML energy window
# and the static-cache decode step eager vs captured as CUDA graphs (bundled model and a Llama-3.1-8B-shaped
# random model) (deploy/gpu_check.py says what and why). Results: $OUT/gpu_check.json (+ nvidia-smi's view of the GPU).
#   OUT=/some/folder deploy/gpu_check.sh [--steps 64 --batches 1,16 --exits 3,6,9]
# Needs a Python with this project's requirements and a CUDA build of torch (PYTHON=..., default the
# checkout's .venv, else python3); nvidia-ml-py for the energy window (else its reason is recorded).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-artifacts/gpu_check}"
mkdir -p "$OUT"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv > "$OUT/nvidia_smi.csv"
fi
timeout 540 "$PYTHON" deploy/gpu_check.py --out "$OUT" "$@"

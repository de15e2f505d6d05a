#!/usr/bin/env bash
# Compile csrc/*.cu for sm_90 on a machine without a GPU or a CUDA build of torch (nvcc alone), to
# catch compile errors before spending device time. Objects only: nothing is linked or run, so the
# kernels' correctness still needs tests/ops on the device.
#   bash benchmarks/cuda_compile_check.sh [csrc/one.cu ...]     (default: every source; ~40 s each)
# Needs nvcc (CUDA 13) and the Python with torch (a CPU wheel will do: its headers are the same). The
# CPU wheel lacks the cuBLAS / cuSPARSE / cuSOLVER headers that torch's CUDA headers include, and one
# generated header; the first are taken from NVIDIA's wheels (headers only, into ${CACHE}), the
# second is written empty.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${FP8STATE_NVCC_HEADERS:-/tmp/fp8state-nvcc-headers}
PY=${PYTHON:-python3}
if [ ! -f "$CACHE/include/cusparse.h" ]; then
  mkdir -p "$CACHE/wheels" "$CACHE/include/c10/cuda/impl"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/wheels" \
    "nvidia-cublas>=13,<14" "nvidia-cusolver>=12,<13" "nvidia-cusparse>=12,<13"
  for w in "$CACHE"/wheels/*.whl; do
    unzip -q -o "$w" '*/include/*' -d "$CACHE/unpacked"
  done
  cp -r "$CACHE"/unpacked/nvidia/*/include/. "$CACHE/include/"
  rm -rf "$CACHE/wheels" "$CACHE/unpacked"
  echo '#pragma once' > "$CACHE/include/c10/cuda/impl/cuda_cmake_macros.h"
fi
TORCH=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mkdir -p /tmp/fp8state-nvcc-objects
sources=("$@")
[ ${#sources[@]} -gt 0 ] || sources=(csrc/*.cu)
status=0
for src in "${sources[@]}"; do
  start=$(date +%s)
  if nvcc -c "$src" -o "/tmp/fp8state-nvcc-objects/$(basename "$src" .cu).o" -std=c++20 -O3 \
    --expt-relaxed-constexpr -lineinfo -gencode arch=compute_90,code=sm_90 -diag-suppress 3306 \
    -I"$CACHE/include" -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include" \
    -isystem "$PYINC" -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=fp8state_check; then
    echo "ok     $src ($(($(date +%s) - start)) s)"
  else
    echo "FAILED $src"
    status=1
  fi
done
exit $status

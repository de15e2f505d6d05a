#!/usr/bin/env bash
# One device call: install the carried wheels and this checkout (plain, non-editable install),
# then run the given commands with logs under $OUT. Usage on the device machine:
#   bash benchmarks/device_run.sh 'cmd1' 'cmd2' ...
# Each command runs from /tmp/t (a copy of tests/ and benchmarks/) with PYTHONPATH set and
# $REPO naming the checkout.
set -u
export REPO=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl >/dev/null 2>&1
# transformers and its few packages (the Hugging Face tests and benchmarks), where carried in .whl/hf
ls .whl/hf/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/hf/*.whl >/dev/null 2>&1
# pip --target keeps a package already in the target (a warm machine has the last call's):
# start from an empty target so that this checkout is what runs
rm -rf /tmp/f8s
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/f8s . >/dev/null 2>&1
rm -rf /tmp/t && mkdir -p /tmp/t && cp -r tests benchmarks pyproject.toml /tmp/t/
export PYTHONPATH=/tmp/f8s:$REPO/.site FP8STATE_CACHE_DIR=/tmp/f8c WANDB_MODE=offline
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd /tmp/t
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; from lightning_fp8state.ops import cuda; print(torch.__version__, cuda.ensure_loaded())" 2>&1 | tail -2
i=0
for cmd in "$@"; do
  i=$((i+1))
  echo "=== [$i] $cmd ($(date +%T))"
  bash -c "$cmd" >"$OUT/log$i.txt" 2>&1
  echo "rc=$? ($(date +%T))"
  tail -c 3000 "$OUT/log$i.txt"
done

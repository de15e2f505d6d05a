#!/usr/bin/env bash
# Adds to ./.whl (run from the project root, after ../shared/device/wheels.sh) what the GPU
# machine lacks for the litgpt and torchtitan variants of tests/integration/test_gpu_models.py:
# the two libraries and the few pure-Python packages they import there (the image has torch,
# transformers, lightning, triton, einops, tensorboard). Without them those two variants skip
# with their reason. About 3 MB. Then, on the device:
#   bash benchmarks/device_run.sh 'python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_models.py'
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  litgpt==0.5.13 jsonargparse==4.41.0 docstring_parser==0.18.0 typeshed_client==2.15.0 \
  torchtitan==0.3.0 tyro==1.0.17 typeguard==4.6.1 spmd_types==0.2.3

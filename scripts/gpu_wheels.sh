#!/usr/bin/env bash
# The pinned wheels the Trainer's GPU bench (bench/gpu_step.py) needs on a GPU node that has torch and no internet,
# besides torch: copy DIR there, then
#   pip install --no-index --no-deps --target SITE DIR/*.whl && PYTHONPATH=SITE:src:bench python bench/gpu_step.py
# Usage: scripts/gpu_wheels.sh [PYTHON_VERSION (default 3.12)] [DIR (default .device-wheels)]
set -euo pipefail
python_version=${1:-3.12}
directory=${2:-.device-wheels}
pip=${PIP:-.venv/bin/pip}
# Versions from requirements.lock, the project's single list of pins.
pins() { grep -iE "^($(IFS='|'; echo "$*"))==" requirements.lock; }
mkdir -p "$directory"
"$pip" download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$directory" $(pins timm pydantic pydantic_core annotated-types typing-inspection typing_extensions protobuf \
  tqdm pyyaml filelock crc32c)
# tfrecord is published as a source distribution only (pure Python): built into a wheel here.
"$pip" wheel --quiet --no-deps -w "$directory" $(pins tfrecord)
ls "$directory"

#!/usr/bin/env bash
# Prepares what a lent GPU machine (python 3.12, torch + CUDA preinstalled, no network) lacks:
# cp312 manylinux wheels in .whl/ (git-ignored through .git/info/exclude), with Ray trimmed to
# fit the device tool's 64 MiB carry limit (its dashboard build, jars and libraries psg never
# imports removed: ~40 MB). Run it here, once, from the repository root:
#
#   bash benchmarks/gpu/prepare.sh
#
# then run benchmarks/gpu/on_device.sh on the device machine, carrying .whl (see that file).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# The versions the Makefile's environment resolves (ray is pinned by the server extra); packages the
# device image already holds (numpy, scipy, absl-py, attrs, mpmath, msgpack, aiohttp, click, pyyaml,
# requests, prometheus-client, opt-einsum, pytest) are not carried.
wheels=(
  ray==2.60.0
  dp-accounting==0.6.0 dm-tree==0.1.10
  opacus==1.6.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
# Ray: drop what a psg worker never loads, re-zip (keeps the .dist-info, so pip installs it).
ray_wheel=$(ls .whl/ray-2.60.0-*.whl | grep -v trimmed | head -1)
if [ -n "$ray_wheel" ]; then
  work=$(mktemp -d)
  unzip -q "$ray_wheel" -d "$work"
  rm -rf "$work"/ray/jars "$work"/ray/dashboard/client/build "$work"/ray/rllib "$work"/ray/serve \
         "$work"/ray/data "$work"/ray/tune "$work"/ray/train
  # pip checks the RECORD's hashes only for files it installs; drop the removed files' lines.
  record=$(ls "$work"/ray-2.60.0.dist-info/RECORD)
  grep -vE '^ray/(jars|dashboard/client/build|rllib|serve|data|tune|train)/' "$record" > "$record.new"
  mv "$record.new" "$record"
  name=$(basename "$ray_wheel")
  rm "$ray_wheel"
  (cd "$work" && zip -q -r "$OLDPWD/.whl/$name" .)
  rm -rf "$work"
fi
# The gpt2 suite's Hugging Face stack, in .whl/hf/, installed by on_device.sh's "gpt2" part only (in
# front of the image's own transformers, 5.17 when last listed, which the CUDA tests keep): the
# versions the Makefile's environment resolves, so the GPU rows run the code the CPU rows ran; not
# hf-xet (downloads only). transformers keeps the model families the suite, its service path and
# peft import (the others are 50 of its 60 MB, and the carry limit is 64 MiB with the tree).
hf_wheels=(
  transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 peft==0.21.2
  accelerate==1.15.0 regex==2026.11.19 tqdm==4.70.1 psutil==7.2.2 filelock==4.3.1 fsspec==2026.9.0
  httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 truststore==0.10.5
)
mkdir -p .whl/hf
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl/hf "${hf_wheels[@]}"
hf_wheel=$(ls .whl/hf/transformers-5.24.0-*.whl | head -1)
# (trimmed once: a second run finds the wheel without the other families; grep -c reads the whole
# listing, where grep -q would end the pipe early and fail it under pipefail)
if [ -n "$hf_wheel" ] && [ "$(unzip -Z1 "$hf_wheel" | grep -c '^transformers/models/bert/')" -gt 0 ]; then
  work=$(mktemp -d)
  unzip -q "$hf_wheel" -d "$work"
  keep='^(auto|gpt2|encoder_decoder|bloom|__init__\.py)$'
  for family in $(ls "$work"/transformers/models); do
    [[ "$family" =~ $keep ]] || rm -rf "$work/transformers/models/$family"
  done
  record=$(ls "$work"/transformers-5.24.0.dist-info/RECORD)
  grep -E -v '^transformers/models/' "$record" > "$record.new"
  grep -E '^transformers/models/(auto/|gpt2/|encoder_decoder/|bloom/|__init__\.py)' "$record" >> "$record.new"
  mv "$record.new" "$record"
  name=$(basename "$hf_wheel")
  rm "$hf_wheel"
  (cd "$work" && zip -q -r "$OLDPWD/.whl/hf/$name" .)
  rm -rf "$work"
fi
du -sh .whl .whl/hf
ls .whl .whl/hf

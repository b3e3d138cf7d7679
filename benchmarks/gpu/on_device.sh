#!/usr/bin/env bash
# Runs on a lent GPU machine (the device tool), from the repository root, with .whl carried
# (prepared by benchmarks/gpu/prepare.sh):
#
#   run(command="bash benchmarks/gpu/on_device.sh tests", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu/on_device.sh bench", carry=[".whl"], timeout_s=600)
#
# "tests": the CUDA tests (PSG_REQUIRE_CUDA=1 fails them where torch sees no GPU) and the
#          per-step host-sync check; "bench": the GPU-speed issue's training suite (--size gpu, K 1,
#          no noise) writing the GPU section's JSON, plots and Markdown under $OUT. Each part
#          fits in one 10-minute call.
set -uo pipefail
export PYTHONUNBUFFERED=1
what=${1:-tests}
out=${OUT:-/tmp/psg-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
# The packages are importable from the tree (psg_core) and the wire/server/client shims the
# project installs under psg_* names come from an editable-free install:
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 \
  || echo "note: pip install of the project failed; psg_core is still importable from the tree"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt"
case "$what" in
  tests)
    PSG_REQUIRE_CUDA=1 timeout 560 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log"
    ;;
  bench)
    timeout 570 python3 -m benchmarks.run --device cuda --suites training -K 1 --no-noise \
      --out "$out" --markdown "$out/BENCHMARKS_gpu.md" 2>&1 | tee "$out/bench.log"
    ;;
  *)
    echo "usage: on_device.sh tests|bench" >&2
    exit 2
    ;;
esac

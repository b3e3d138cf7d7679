#!/usr/bin/env bash
# Runs on a lent GPU machine (the device tool), from the repository root, with .whl carried
# (prepared by benchmarks/gpu/prepare.sh):
#
#   run(command="bash benchmarks/gpu/on_device.sh tests", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu/on_device.sh bench", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu/on_device.sh all", carry=[".whl"], timeout_s=600)
#
# "tests": the CUDA tests (PSG_REQUIRE_CUDA=1 fails them where torch sees no GPU) and the
#          per-step host-sync check; "bench": the GPU-speed issue's training suite (--size gpu, K 1,
#          no noise, 10 rounds) writing the GPU section's JSON, plots and Markdown under $OUT;
# "all":   both in one call (one machine start: a lent machine's time is counted from its start),
#          the suite first (BENCH_S seconds at most, 240 by default), then the CUDA tests spread
#          over the machine's cores (pytest-xdist, in the device image) in TESTS_S seconds (270).
#          Every part logs as it goes, so a part cut short still reports what it finished.
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
bench() {
  timeout "$1" python3 -m benchmarks.run --device cuda --suites training -K 1 --no-noise --repeats 10 -v \
    --out "$out" --markdown "$out/BENCHMARKS_gpu.md" 2>&1 | tee "$out/bench.log"
}
case "$what" in
  all)
    bench "${BENCH_S:-240}"
    PSG_REQUIRE_CUDA=1 timeout "${TESTS_S:-270}" python3 -m pytest -v -p no:cacheprovider -n 12 \
      --timeout 120 -rfE -m cuda tests 2>&1 | tee "$out/cuda_tests.log" | grep -v PASSED
    ;;
  tests)
    PSG_REQUIRE_CUDA=1 timeout 560 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log"
    ;;
  bench)
    bench 570
    ;;
  *)
    echo "usage: on_device.sh tests|bench|all" >&2
    exit 2
    ;;
esac

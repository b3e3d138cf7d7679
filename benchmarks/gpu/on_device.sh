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
# "profile": benchmarks/gpu/profile_step.py (torch.profiler over the suite's steps: wall time
#          against kernel time, launches, device-to-host copies, the top kernels and host ops).
# "host":  benchmarks/host_overhead.py --device cuda (each method's host cost per hooked layer and
#          per step, on MLPs whose kernels cost next to nothing).
# "gpt2":  the gpt2 suite (benchmarks/gpt2.py: GPT-2 and LoRA, eager and captured steps, Opacus, the
#          service) at its reported size on the GPU, with .whl/hf's transformers and peft in front.
# Several parts run in one call in the order given (e.g. "tests profile"); each part's time limit
# is BENCH_S, TESTS_S, PROFILE_S, HOST_S or GPT2_S seconds.
set -uo pipefail
export PYTHONUNBUFFERED=1
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
cuda_tests() {
  # The device image's pytest-benchmark turns itself off under xdist with a warning (an error
  # here); the service-security tests need cryptography, which the image may lack.
  local skip=()
  python3 -c "import cryptography" 2>/dev/null \
    || skip=(--ignore=tests/integration/test_health_cli.py --ignore=tests/integration/test_service_security.py)
  PSG_REQUIRE_CUDA=1 timeout "$1" python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 12 \
    --timeout 120 -rfE -m cuda "${skip[@]}" tests 2>&1 | tee "$out/cuda_tests.log" | grep -v PASSED
}
profile() {
  timeout "$1" python3 -m benchmarks.gpu.profile_step --out "$out" 2>&1 | grep -v "^USDT"
}
gpt2() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hf \
    .whl/hf/*.whl || return 1
  PYTHONPATH=/tmp/site-hf:$PYTHONPATH timeout "$1" python3 -m benchmarks.run --device cuda --suites gpt2 \
    --repeats 10 -v --out "$out" --markdown "$out/BENCHMARKS_gpt2_gpu.md" 2>&1 | tee "$out/gpt2.log"
}
host() {
  timeout "$1" python3 -m benchmarks.host_overhead --device cuda --rounds 100 2>&1 | tee "$out/host_overhead.txt"
}
[ $# -gt 0 ] || set -- tests
for what in "$@"; do
  case "$what" in
    all) bench "${BENCH_S:-240}"; cuda_tests "${TESTS_S:-270}" ;;
    bench) bench "${BENCH_S:-570}" ;;
    tests) cuda_tests "${TESTS_S:-560}" ;;
    profile) profile "${PROFILE_S:-300}" ;;
    host) host "${HOST_S:-120}" ;;
    gpt2) gpt2 "${GPT2_S:-420}" ;;
    *) echo "usage: on_device.sh [all|bench|tests|profile|host|gpt2]..." >&2; exit 2 ;;
  esac
done

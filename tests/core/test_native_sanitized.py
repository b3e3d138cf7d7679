"""psg's C kernels for EmbeddingBag ghost clipping and its float64 Gram kernel built with
AddressSanitizer and UBSan and driven on random bag layouts, valid and invalid, and random Gram
shapes and strides (tests/data/native_table_driver.c): no out-of-bounds access, leak or undefined
behaviour, every valid layout accepted and every Gram equal to a plain double loop. Skipped where
no C compiler with the sanitizer runtimes is at hand."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "psg_core" / "csrc"
DRIVER = ROOT / "tests" / "data" / "native_table_driver.c"
FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
         "-fopenmp"]


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    pytest.skip("no C compiler on this host")


def test_table_kernels_under_sanitizers(tmp_path: Path) -> None:
    cc = _compiler()
    objects = tmp_path / "recurrence.o"
    for command in ([cc, *FLAGS, "-std=c11", "-c", str(SOURCES / "recurrence.c"), "-o", str(objects)],
                    [cc, *FLAGS, str(DRIVER), str(objects), "-lm", "-o", str(tmp_path / "driver")]):
        built = subprocess.run(command, capture_output=True, text=True, check=False)
        if built.returncode != 0:
            pytest.skip(f"{cc} cannot build with the sanitizers here: {built.stderr.strip()[-300:]}")

    def run(leaks: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(tmp_path / "driver")], capture_output=True, text=True, timeout=300, check=False,
                              env={**os.environ, "ASAN_OPTIONS": f"detect_leaks={leaks}",
                                   "UBSAN_OPTIONS": "print_stacktrace=1"})

    done = run(1)
    if "LeakSanitizer has encountered a fatal error" in done.stderr:
        done = run(0)  # a sandbox that forbids the leak checker's ptrace: the rest still checked
    found = any(marker in done.stderr for marker in ("ERROR: AddressSanitizer", "runtime error:",
                                                      "ERROR: LeakSanitizer"))
    if done.returncode != 0 and not found and "runs " not in done.stdout:
        pytest.skip(f"the sanitizer runtime did not start here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "unexpected failures 0" in done.stdout

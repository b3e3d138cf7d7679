"""psg's native LSTM loops (psg_core.native): built on this host, equal to the step-by-step loop in
torch ops they replace whatever the thread count, refused where they do not apply, and a clean
fallback where they cannot be built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psg_core import native
from psg_core.errors import ConfigError
from psg_core.layers import DPLSTM
from psg_core.layers import _recurrence as recurrence

ROOT = Path(__file__).resolve().parents[2]
HAS_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


def _lib():
    lib = native.library()
    if lib is None:
        pytest.skip(f"native kernels not built here: {native.build_error()}")
    return lib


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this host")
def test_the_kernels_build_where_a_compiler_is() -> None:
    with native.native_kernels("auto"):
        assert native.library() is not None, native.build_error()
        assert native.build_error() is None


def _inputs(batch: int, steps: int, hidden: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, steps, 8 * hidden, generator=gen, dtype=dtype)
    return {"gx": wide[..., :4 * hidden],  # rows strided, as a slice of a wider tensor
            "weight": torch.randn(4 * hidden, hidden, generator=gen, dtype=dtype) / hidden ** 0.5,
            "bias": torch.randn(4 * hidden, generator=gen, dtype=dtype),
            "h0": torch.randn(batch, hidden, generator=gen, dtype=dtype),
            "c0": torch.randn(batch, hidden, generator=gen, dtype=dtype),
            "d_out": torch.randn(batch, steps, hidden, generator=gen, dtype=dtype),
            "dh": torch.randn(batch, hidden, generator=gen, dtype=dtype),
            "dc": torch.randn(batch, hidden, generator=gen, dtype=dtype)}


def _forward(lib, x: dict[str, torch.Tensor], reverse: bool, bias: bool) -> dict[str, torch.Tensor]:
    """One direction's forward: by the C loop (``lib``) or step by step in torch ops (None)."""
    batch, steps, width = x["gx"].shape
    hidden = width // 4
    out = {"act": torch.full((steps, batch, width), float("nan"), dtype=x["gx"].dtype),
           "cand": torch.full((steps, batch, hidden), float("nan"), dtype=x["gx"].dtype),
           "tanh_c": torch.full((steps, batch, hidden), float("nan"), dtype=x["gx"].dtype),
           "hs": torch.full((steps + 1, batch, hidden), float("nan"), dtype=x["gx"].dtype),
           "cs": torch.full((steps + 1, batch, hidden), float("nan"), dtype=x["gx"].dtype)}
    first = steps if reverse else 0
    out["hs"][first], out["cs"][first] = x["h0"], x["c0"]
    b = x["bias"] if bias else None
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    if lib is None:
        out["hidden_gates"] = recurrence._lstm_steps(x["gx"], x["weight"], b, order, out["act"], out["cand"],
                                                     out["tanh_c"], out["hs"], out["cs"])
    else:
        out["hidden_gates"] = torch.full_like(x["gx"], float("nan"))
        assert native.lstm_forward(lib, x["gx"], x["weight"], b, out["hidden_gates"], out["act"], out["cand"],
                                   out["tanh_c"], out["hs"], out["cs"], reverse=reverse)
    return out


def _backward(lib, x: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], reverse: bool
              ) -> tuple[torch.Tensor, ...]:
    steps = x["gx"].shape[1]
    c_prev = saved["cs"][1:] if reverse else saved["cs"][:steps]
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    # the layer hands its saved activations over as (B, T, ·) views of the time-major buffers
    args = (tuple(t.transpose(0, 1) for t in (saved["act"], saved["cand"], c_prev, saved["tanh_c"])), x["weight"],
            None, order, x["d_out"], x["dh"], x["dc"])
    if lib is None:
        with native.native_kernels("off"):
            return recurrence._lstm_backward(*args)  # type: ignore[arg-type]
    done = recurrence._lstm_backward_native(lib, saved["act"], saved["cand"], c_prev, saved["tanh_c"],
                                            x["weight"], order, x["d_out"], x["dh"], x["dc"])
    assert done is not None
    return done


# (batch, steps, hidden): hidden a multiple of the vector width (16 floats, 8 doubles) or not, one
# hidden unit, batches below, at and above the kernel's row group (8 rows on AVX-512, 4 elsewhere)
SHAPES = [(1, 1, 1), (3, 5, 5), (8, 4, 16), (9, 3, 24), (17, 6, 40), (2, 7, 64), (4, 3, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,steps,hidden", SHAPES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_the_loops_equal_the_step_by_step_loop(dtype: torch.dtype, batch: int, steps: int, hidden: int,
                                               reverse: bool, bias: bool) -> None:
    """Forward (every buffer the backward reads, the states, the hidden projection) and backward
    (the gates' gradients, the initial state's) against the torch-ops loop they replace."""
    lib = _lib()
    x = _inputs(batch, steps, hidden, dtype, seed=batch * 1000 + steps * 10 + hidden)
    got, want = _forward(lib, x, reverse, bias), _forward(None, x, reverse, bias)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype is torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    for name in ("cand", "tanh_c", "hs", "cs", "hidden_gates"):
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    for gate in (0, 1, 3):  # i, f, o: the act slots the backward reads (torch's loop keeps sigmoid(g) in 2)
        torch.testing.assert_close(got["act"][..., gate * hidden:(gate + 1) * hidden],
                                   want["act"][..., gate * hidden:(gate + 1) * hidden], **tol)
    for name, g, w in zip(("dgates", "dh0", "dc0"), _backward(lib, x, want, reverse), _backward(None, x, want, reverse)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_results_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    lib = _lib()
    x = _inputs(9, 5, 48, dtype, seed=7)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            saved = _forward(lib, x, False, True)
            results.append([*saved.values(), *_backward(lib, x, saved, False)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_dp_lstm_with_and_without_the_kernels(batch_first: bool, bidirectional: bool) -> None:
    """The layer's outputs and every gradient, float64, with the kernels and with torch ops."""
    _lib()
    torch.manual_seed(0)
    layer = DPLSTM(3, 6, num_layers=2, batch_first=batch_first, bidirectional=bidirectional).double()
    x = torch.randn((4, 7, 3) if batch_first else (7, 4, 3), dtype=torch.float64)
    results = {}
    for setting in ("auto", "off"):
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        with native.native_kernels(setting):
            out, (h, c) = layer(inp)
            (out.sin().sum() + h.square().sum() + c.cos().sum()).backward()
        results[setting] = [out, h, c, inp.grad, *(p.grad for p in layer.parameters())]
    for got, want in zip(results["auto"], results["off"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_applies_only_to_plain_float_tensors_with_unit_column_stride() -> None:
    x = torch.ones(2, 3)
    assert native.applies(x, torch.ones(3, 3))
    assert native.applies(x.double(), torch.ones(2, 2, dtype=torch.float64))
    assert not native.applies()
    assert not native.applies(x, x.double())  # mixed dtypes
    assert not native.applies(x.half())
    assert not native.applies(torch.ones(3, 2).t())  # columns strided
    assert not native.applies(torch.ones(2, 3, requires_grad=True))
    with torch.no_grad():
        assert native.applies(torch.ones(2, 3, requires_grad=True))
    assert not native.applies(torch.ones(2, 3, dtype=torch.int64))


def test_off_and_a_bad_setting() -> None:
    with native.native_kernels("off"):
        assert native.library() is None
    with pytest.raises(ConfigError, match="native kernel setting"):
        native.set_native_kernels("fast")


def _child(code: str, **env: str) -> dict:
    environment = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_PROBE = """
import json, torch
from psg_core import native
from psg_core.layers import DPLSTM
from psg_core.layers import _recurrence as recurrence
torch.manual_seed(0)
out, _ = DPLSTM(3, 4, batch_first=True)(torch.randn(2, 5, 3))
out.sum().backward()
print(json.dumps({"built": native.library() is not None, "error": native.build_error(), "finite": bool(out.isfinite().all())}))
"""


def test_no_compiler_falls_back_to_torch_ops(tmp_path: Path) -> None:
    """A host whose compiler fails: the library is None with the reason, and the layers still run."""
    got = _child(_PROBE, CC="false", PSG_CACHE_DIR=str(tmp_path), PSG_NATIVE="auto")
    assert got["built"] is False and got["finite"] is True
    assert "false" in got["error"]
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this host")
def test_the_build_is_cached_per_directory(tmp_path: Path) -> None:
    first = _child(_PROBE, PSG_CACHE_DIR=str(tmp_path), PSG_NATIVE="auto")
    assert first["built"] is True, first["error"]
    built = list(tmp_path.rglob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = _child(_PROBE, PSG_CACHE_DIR=str(tmp_path), PSG_NATIVE="auto")
    assert second["built"] is True
    assert [p.stat().st_mtime_ns for p in tmp_path.rglob("*.so")] == [stamp]  # loaded, not rebuilt
    assert not [p for p in tmp_path.rglob("*") if p.is_dir() and p.name != "native"]  # no scratch left

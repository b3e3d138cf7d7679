"""psg's native recurrent loops (psg_core.native): built on this host, equal to the step-by-step loop in
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
from psg_core.layers import DPGRU, DPLSTM, DPRNN

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


LAYERS = {"lstm": DPLSTM, "gru": DPGRU, "tanh": DPRNN, "relu": DPRNN}


def _layer(kind: str, features: int, hidden: int, dtype: torch.dtype, **kwargs: object) -> torch.nn.Module:
    if kind in ("tanh", "relu"):
        kwargs["nonlinearity"] = kind
    return LAYERS[kind](features, hidden, batch_first=True, **kwargs).to(dtype)


def _run(layer: torch.nn.Module, kind: str, x: torch.Tensor, setting: str, seed: int) -> list[torch.Tensor]:
    """Outputs, final state and every gradient (input, initial state, parameters) of one pass."""
    gen = torch.Generator().manual_seed(seed)
    layers = layer.num_layers * (2 if layer.bidirectional else 1)
    shape = (layers, x.shape[0], layer.hidden_size)
    h0 = torch.randn(*shape, generator=gen, dtype=x.dtype).requires_grad_()
    state = (h0, torch.randn(*shape, generator=gen, dtype=x.dtype).requires_grad_()) if kind == "lstm" else h0
    layer.zero_grad()
    inp = x.clone().requires_grad_()
    with native.native_kernels(setting):
        out, final = layer(inp, state)
        finals = list(final) if kind == "lstm" else [final]
        weights = [torch.randn(t.shape, generator=gen, dtype=x.dtype) for t in (out, *finals)]
        sum((t * w).sum() for t, w in zip((out, *finals), weights)).backward()
    leaves = [inp, *(state if kind == "lstm" else (state,))]
    return [out, *finals, *(t.grad for t in leaves), *(p.grad for p in layer.parameters())]


# (batch, steps, hidden): hidden a multiple of the vector width (16 floats, 8 doubles) or not, one
# hidden unit, batches below, at and above the kernel's row group (8 rows on AVX-512, 4 elsewhere)
SHAPES = [(1, 1, 1), (3, 5, 5), (8, 4, 16), (9, 3, 24), (17, 6, 40), (2, 7, 64), (4, 3, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,steps,hidden", SHAPES)
@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh", "relu"])
def test_the_loops_equal_the_step_by_step_loop(dtype: torch.dtype, batch: int, steps: int, hidden: int,
                                               kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-layer bidirectional layer (both directions of the loop, the second layer fed the
    first's outputs), with and without biases, through the C loops and through the torch-ops loop
    they replace: outputs, final states and the gradients of the input, the initial state and every
    parameter."""
    _lib()
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(native, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kwargs: object) -> bool:
            calls[_name] += 1
            return _real(*args, **kwargs)  # type: ignore[operator,no-any-return]
        monkeypatch.setattr(native, name, counted)
    # float32: the two loops sum in different orders (float64 shows the algebra is the same)
    tol = {"rtol": 1e-11, "atol": 1e-12} if dtype is torch.float64 else {"rtol": 1e-4, "atol": 2e-5}
    for bias in (True, False):
        torch.manual_seed(hidden * 100 + steps)
        layer = _layer(kind, 3, hidden, dtype, num_layers=2, bidirectional=True, bias=bias)
        x = torch.randn(batch, steps, 3, dtype=dtype)
        seed = batch * 1000 + steps
        for got, want in zip(_run(layer, kind, x, "auto", seed), _run(layer, kind, x, "off", seed)):
            torch.testing.assert_close(got, want, **tol)
    assert calls == {"forward": 8, "backward": 8}  # 2 biases x 2 layers x 2 directions, C loops only


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh", "relu"])
def test_the_results_do_not_depend_on_the_thread_count(dtype: torch.dtype, kind: str) -> None:
    _lib()
    torch.manual_seed(0)
    layer = _layer(kind, 3, 48, dtype, bidirectional=True)
    x = torch.randn(9, 5, 3, dtype=dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_run(layer, kind, x, "auto", seed=1))
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
from psg_core.layers import DPGRU, DPLSTM, DPRNN
torch.manual_seed(0)
out, _ = DPLSTM(3, 4, batch_first=True)(torch.randn(2, 5, 3))
out.sum().backward()
print(json.dumps({"built": native.library() is not None, "error": native.build_error(),
                  "finite": bool(out.isfinite().all())}))
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


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this host")
def test_an_unwritable_cache_directory_falls_back_to_the_temporary_one(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    got = _child(_PROBE, PSG_CACHE_DIR=str(blocked), TMPDIR=str(temporary), PSG_NATIVE="auto")
    assert got["built"] is True, got["error"]
    assert len(list(temporary.glob("psg-native-*/*.so"))) == 1


_FORK_PROBE = """
import json, os, torch
from psg_core import native
lib = native.library()
B, T, H = 3, 4, 40
def run():
    gx, w = torch.randn(B, T, 4 * H), torch.randn(4 * H, H)
    hg, act = torch.empty(B, T, 4 * H), torch.empty(T, B, 4 * H)
    cand, tc = torch.empty(T, B, H), torch.empty(T, B, H)
    hs, cs = torch.zeros(T + 1, B, H), torch.zeros(T + 1, B, H)
    assert native.forward(lib, "lstm", gx, w, None, hg, hs, False, act=act, cand=cand, tanh_c=tc, cs=cs)
    return bool(hs.isfinite().all())
torch.set_num_threads(2)
parent = run()  # the parallel region starts OpenMP's thread pool in this process
pid = os.fork()
if pid == 0:
    os._exit(0 if run() else 1)  # in the child: on its one thread, no parallel region
_, status = os.waitpid(pid, 0)
print(json.dumps({"built": lib is not None, "parent": parent, "child_status": status}))
"""


@pytest.mark.skipif(not HAS_COMPILER or not hasattr(os, "fork"), reason="no C compiler, or no fork")
def test_a_forked_child_runs_the_loops_on_one_thread() -> None:
    """GNU OpenMP's thread pool does not survive fork: a child's parallel region would wait for
    the parent's threads forever. The loops run without one there."""
    got = _child(_FORK_PROBE, PSG_NATIVE="auto")
    assert got == {"built": True, "parent": True, "child_status": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1024, 256), (256, 1000), (67, 129), (4096, 1)])
def test_contiguous_copies_strided_matrices_exactly(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Transposes (the tiled kernel, full and partial tiles), strided rows and columns: the same
    numbers as torch's copy, contiguous, in a new tensor where the view was not contiguous."""
    _lib()
    torch.manual_seed(0)
    base = torch.randn(shape, dtype=dtype)
    for view in (base.t(), base[::2], base.t()[1:, ::3], base[:, :-1] if shape[1] > 1 else base.t()):
        out = native.contiguous(view)
        assert out.is_contiguous() and out.shape == view.shape and torch.equal(out, view)
        if not view.is_contiguous():
            assert out.data_ptr() != base.data_ptr()


def test_contiguous_leaves_what_the_kernel_must_not_read_to_torch() -> None:
    """A contiguous matrix comes back as it is; a tensor autograd records keeps its graph; other
    dtypes and dims, and the kernels turned off, take torch's copy."""
    w = torch.randn(300, 200)
    assert native.contiguous(w) is w
    p = torch.randn(300, 200, requires_grad=True)
    out = native.contiguous(p.t())
    assert out.grad_fn is not None and torch.equal(out, p.t())
    assert torch.equal(native.contiguous(torch.arange(60000).view(300, 200).t()),
                       torch.arange(60000).view(300, 200).t())
    x = torch.randn(4, 300, 200).transpose(1, 2)
    assert torch.equal(native.contiguous(x), x)
    with native.native_kernels("off"):
        assert torch.equal(native.contiguous(w.t()), w.t())

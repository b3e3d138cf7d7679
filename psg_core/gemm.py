"""The matrix products psg computes itself, on the CPU kernel that suits the host.

torch computes a float32 ``mm``, ``addmm`` or ``F.linear`` on an x86 CPU with MKL. On a CPU that
is not Intel's, MKL runs its AVX2 kernels even where the CPU has AVX-512, while oneDNN (which torch
ships too: its fused LSTM and its convolutions run on it) uses the widest instructions the CPU
has. Measured on a 2-core AMD EPYC (AVX-512), torch 2.13, one thread, median of 300 calls:

=================================================  ===========  ==========
product                                            MKL          oneDNN
=================================================  ===========  ==========
``(512, 128) @ (128, 1024)`` (an LSTM's input)     1.31 ms      0.57 ms
``(1024, 512) @ (512, 256)`` (a weight gradient)   2.80 ms      1.41 ms
``(8, 256) @ (256, 1024)`` plus the gates (a step)  0.064 ms     0.055 ms
``(32, 64).T @ (32, 64)`` (a small weight gradient) 0.0048 ms    0.017 ms
``(32, 64) @ (64, 10)`` (a classifier head)         0.0029 ms    0.013 ms
=================================================  ===========  ==========

psg's own products sit on its hot paths: the DP recurrent layers' time loops (one small product
per step, forward and backward) and their input and hidden projections, and ghost clipping's
clipped weight sums. They go through this module, which picks the kernel:

* ``rule`` (the default): oneDNN for float32 CPU products of at least
  :data:`RULE_MIN_MULTIPLY_ADDS` multiply-adds when the CPU is not Intel's, has AVX-512 and torch
  was built with oneDNN (below that, oneDNN's fixed cost per call of about 10 us outweighs its
  wider vectors); torch's own kernel otherwise (on Intel CPUs MKL uses
  AVX-512 itself, and psg keeps the layouts measured fastest for it);
* ``auto``: both kernels are timed once per signature (shapes, layouts, dtype, threads) on the
  call's own tensors, and oneDNN is kept for the process where it is at least 10% faster;
* ``aten`` or ``onednn``: one kernel, forced (``onednn`` only where it applies).

oneDNN applies to plain float32 CPU tensors outside autograd's recording (no input requiring a
gradient while grad mode is on), outside ``torch.func`` transforms and tensor subclasses (such as
ExpandedWeights) and outside CPU autocast; everything else takes torch's kernel. The two kernels
add in different orders: their results agree to float32 rounding, not bit for bit, so the
default ``rule`` (no measurement) keeps a host's results reproducible from run to run; force one
kernel to compare hosts bit for bit. The environment variable ``PSG_GEMM`` sets the default;
:func:`set_gemm_kernel` and the :func:`gemm_kernel` context manager override both.

>>> w = torch.randn(6, 4)
>>> with gemm_kernel("aten"):
...     torch.allclose(linear(torch.ones(3, 4), w), torch.ones(3, 4) @ w.t())
True
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from psg_core._settings import ProcessSetting, time_candidates
from psg_core.native import contiguous, plain_cpu_tensor

__all__ = ["GemmKernel", "ENVIRONMENT_VARIABLE", "set_gemm_kernel", "get_gemm_kernel", "gemm_kernel",
           "current_gemm_kernel", "onednn_available", "Projection", "linear", "linear_uses_onednn", "onednn_linear",
           "mm_tn", "clear_gemm_cache", "gemm_cache", "RULE_MIN_MULTIPLY_ADDS"]

logger = logging.getLogger(__name__)

#: The environment variable that sets the default kernel (``rule``, ``auto``, ``aten`` or ``onednn``).
ENVIRONMENT_VARIABLE = "PSG_GEMM"


class GemmKernel(str, enum.Enum):
    """How psg's own matrix products are computed on a CPU."""

    #: oneDNN on CPUs that are not Intel's and have AVX-512, torch's kernel elsewhere.
    RULE = "rule"
    #: time both kernels once per signature, keep the faster (oneDNN only if >= 10% faster).
    AUTO = "auto"
    #: torch's own kernel (MKL on x86 CPUs) everywhere.
    ATEN = "aten"
    #: oneDNN wherever it applies (see the module docstring).
    ONEDNN = "onednn"


_LOCK = threading.RLock()
_SETTING = ProcessSetting(GemmKernel, ENVIRONMENT_VARIABLE, "matrix-product kernel")
#: signature -> whether oneDNN was measured faster (``auto`` only).
_cache: dict[tuple[Any, ...], bool] = {}
#: oneDNN must beat torch's kernel by this factor to be chosen by ``auto``.
_MARGIN = 0.9


def set_gemm_kernel(kernel: GemmKernel | str | None) -> None:
    """Sets how psg's own matrix products run on a CPU, for the process.

    Args:
        kernel: ``"rule"``, ``"auto"``, ``"aten"`` or ``"onednn"`` (see the module docstring), or
            None to go back to the default (``PSG_GEMM``, else ``rule``).

    >>> set_gemm_kernel("aten"); get_gemm_kernel()
    <GemmKernel.ATEN: 'aten'>
    >>> set_gemm_kernel(None); get_gemm_kernel() is None
    True
    """
    _SETTING.set(kernel, where="set_gemm_kernel")


def get_gemm_kernel() -> GemmKernel | None:
    """The kernel set by :func:`set_gemm_kernel` (None: the default applies)."""
    return _SETTING.forced


def gemm_kernel(kernel: GemmKernel | str | None) -> contextlib.AbstractContextManager[None]:
    """:func:`set_gemm_kernel` for the duration of a block, then the previous setting.

    >>> with gemm_kernel("onednn"):
    ...     get_gemm_kernel()
    <GemmKernel.ONEDNN: 'onednn'>
    """
    return _SETTING.scoped(kernel, where="set_gemm_kernel")


def current_gemm_kernel() -> GemmKernel:
    """The kernel in force: the one set, else ``PSG_GEMM``, else ``rule``."""
    return _SETTING.current(GemmKernel.RULE)


def clear_gemm_cache() -> None:
    """Forgets every measured choice (``auto`` measures each signature again)."""
    with _LOCK:
        _cache.clear()


def gemm_cache() -> dict[tuple[Any, ...], str]:
    """A copy of the measured choices: ``{signature: "onednn" or "aten"}``."""
    with _LOCK:
        return {key: ("onednn" if fast else "aten") for key, fast in _cache.items()}


# ------------------------------------------------------------------------------ the host
@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether torch has oneDNN's float32 linear kernel here, and it runs."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return False
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        ok = bool(torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 4), 3.0)))
        ok = ok and bool(torch.equal(op.binary(x, torch.ones(2, 4), w, None, "add"), torch.full((2, 4), 4.0)))
        return ok
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def _rule_prefers_onednn() -> bool:
    """The ``rule``: a CPU that is not Intel's, with AVX-512, and oneDNN present."""
    vendor = _cpu_vendor()
    capability = str(torch.backends.cpu.get_cpu_capability())
    return bool(vendor) and vendor != "GenuineIntel" and capability.startswith("AVX512") and onednn_available()


def probe_host() -> None:
    """Runs this module's one-time probes of the host (cached for the process) now: a step being
    recorded (:mod:`psg_core.capture`) must not run them, since they compare results on the host."""
    onednn_available()
    _packing_available()
    _rule_prefers_onednn()


def onednn_outpaces_mkl() -> bool:
    """Whether this host runs MKL's AVX2 kernels while oneDNN runs AVX-512 (a CPU that is not
    Intel's, with AVX-512, and oneDNN present): there torch's CPU products (``mm``, ``bmm``) use
    half the host's vector width and oneDNN's kernels (its products, convolutions) all of it.
    Asked by the ``rule`` here and by the convolutions' (:mod:`psg_core.grad_sample.conv_strategy`)."""
    return _rule_prefers_onednn()


# ------------------------------------------------------------------------------ applicability
def _applies(*tensors: torch.Tensor | None) -> bool:
    """Whether oneDNN may compute a product of these tensors (see the module docstring)."""
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if t.dtype is not torch.float32 or t.numel() == 0 or not plain_cpu_tensor(t, grad_mode):
            return False
    return not torch.is_autocast_enabled("cpu")


def _signature(kind: str, *tensors: torch.Tensor) -> tuple[Any, ...]:
    return (kind, torch.get_num_threads(), *((tuple(t.shape), tuple(t.stride())) for t in tensors))


def _measured(key: tuple[Any, ...], aten: Callable[[], Any], onednn: Callable[[], Any]) -> bool:
    with _LOCK:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        with torch.no_grad():
            seconds = time_candidates({"aten": aten, "onednn": onednn}, torch.device("cpu"))
        fast = seconds.get("onednn", float("inf")) < _MARGIN * seconds.get("aten", float("inf"))
        logger.debug("gemm kernel for %s: %s (%s)", key, "onednn" if fast else "aten",
                     ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in seconds.items()))
        _cache[key] = fast
        return fast


#: The ``rule`` leaves products of fewer multiply-adds to torch's kernel: oneDNN's fixed cost per
#: call (about 10 us: primitive lookup, layout checks) outweighs its wider vectors there (the
#: module docstring's table).
RULE_MIN_MULTIPLY_ADDS = 1 << 20


def _multiply_adds(kind: str, tensors: tuple[torch.Tensor | None, ...]) -> int:
    """A product's multiply-adds: ``x (..., K) @ weight (N, K).T`` ("linear", "projection") or
    ``a (R, M).T @ b (R, N)`` ("mm_tn")."""
    first, second = tensors[0], tensors[1]
    if first is None or second is None:
        return 0
    return first.numel() * (second.shape[1] if kind == "mm_tn" else second.shape[0])


def _use_onednn(kind: str, tensors: tuple[torch.Tensor | None, ...], aten: Callable[[], Any],
                onednn: Callable[[], Any]) -> bool:
    kernel = current_gemm_kernel()
    if kernel is GemmKernel.ATEN or (kernel is GemmKernel.RULE
                                     and _multiply_adds(kind, tensors) < RULE_MIN_MULTIPLY_ADDS):
        return False  # (the rule's small products decided first: they are most calls, on every layer)
    if not _applies(*tensors) or not onednn_available():
        return False
    if kernel is GemmKernel.ONEDNN:
        return True
    if kernel is GemmKernel.RULE:
        return _rule_prefers_onednn()
    present = [t for t in tensors if t is not None]
    return _measured(_signature(kind, *present), aten, onednn)


# ------------------------------------------------------------------------------ products
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # type: ignore[no-any-return]


def _onednn_add_linear(other: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``other + x @ weight.T`` in one oneDNN call (the sum is the product's post-op)."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, None, "add")  # type: ignore[no-any-return]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on oneDNN, for a call :func:`linear_uses_onednn` approved (a
    caller that decided once and must not decide again)."""
    return _onednn_linear(x, weight, bias)


def linear_uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` computes this call with oneDNN's kernel.

    >>> with gemm_kernel("aten"):
    ...     linear_uses_onednn(torch.ones(2, 3), torch.ones(4, 3))
    False
    """
    return _use_onednn("linear", (x, weight, bias), lambda: torch.nn.functional.linear(x, weight, bias),
                       lambda: _onednn_linear(x, weight, bias))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x (..., K) @ weight.T`` for ``weight (N, K)``, plus ``bias``.

    >>> linear(torch.ones(2, 5, 3), torch.ones(4, 3), torch.ones(4)).shape
    torch.Size([2, 5, 4])
    """
    if linear_uses_onednn(x, weight, bias):
        return _onednn_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def mm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.T @ b`` for ``a (R, M)``, ``b (R, N)``: a weight gradient summed over R rows.

    On oneDNN the operand that enters transposed as the product's rows is copied first; the
    smaller of ``a`` and ``b`` is put there, so the result is a transposed view (not contiguous)
    when ``b`` is the smaller (``(b.T @ a).T``): the copy costs at most the smaller operand.

    >>> mm_tn(torch.ones(5, 2), torch.ones(5, 3))
    tensor([[5., 5., 5.],
            [5., 5., 5.]])
    """
    def aten() -> torch.Tensor:
        return torch.mm(a.t(), b)  # (matmul's product, one dispatch less)

    def onednn() -> torch.Tensor:
        # the copy by psg's tiled kernel (native.contiguous): oneDNN's own is torch's, element by element
        if a.shape[1] <= b.shape[1]:
            return _onednn_linear(contiguous(a.t()), b.t(), None)  # (M, N); a copied
        return _onednn_linear(contiguous(b.t()), a.t(), None).t()  # (N, M) transposed; b copied

    return onednn() if _use_onednn("mm_tn", (a, b), aten, onednn) else aten()


def _packed(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight (N, K)`` in oneDNN's own blocked layout for products with about ``rows`` rows
    (a step of a time loop reuses one weight many times: laid out once, each product skips the
    reorder; measured on the AMD host, a ``(8, 256) @ (256, 1024)`` step 22 against 35 us); the
    weight as it is where torch cannot pack it."""
    if _packing_available():
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows))  # type: ignore[no-any-return]
        except (RuntimeError, NotImplementedError):
            pass
    return weight


@functools.lru_cache(maxsize=None)
def _packing_available() -> bool:
    """Whether oneDNN's weight packing runs here and its products agree with plain ones."""
    try:
        x, w = torch.ones(2, 3), torch.arange(12.0).view(4, 3)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        expected = x @ w.t()
        return (bool(torch.equal(_onednn_linear(x, packed, None), expected))
                and bool(torch.equal(_onednn_add_linear(expected, x, packed), 2 * expected)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class Projection:
    """``x -> other + x @ weight.T`` for one weight and many ``x`` of one kind (a time loop's steps),
    with the kernel chosen once and the weight laid out once for it.

    ``weight`` is ``(N, K)`` as ``nn.Linear`` stores it, ``bias`` ``(N,)`` or None; ``x`` and
    ``other`` are one call's operands (``(M, K)`` and ``(M, N)``, or None for calls without
    ``other``, which then add ``bias``; calls with ``other`` do not: fold it in), which decide
    whether oneDNN applies and, under ``auto``, are the measurement's tensors. torch's kernel takes
    the weight transposed and contiguous, ``(K, N)`` (the layout MKL was measured fastest with on
    Intel CPUs); oneDNN takes it packed in its own layout once (:func:`_packed`).

    >>> p = Projection(torch.eye(3), torch.ones(2, 3), torch.ones(2, 3))
    >>> p(torch.ones(2, 3), torch.ones(2, 3))
    tensor([[2., 2., 2.],
            [2., 2., 2.]])
    """

    __slots__ = ("onednn", "weight", "bias")

    def __init__(self, weight: torch.Tensor, x: torch.Tensor, other: torch.Tensor | None,
                 bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        layouts: dict[bool, torch.Tensor] = {}

        def laid(onednn: bool) -> torch.Tensor:  # (N, K) for oneDNN (packed), (K, N) for torch's kernel
            if onednn not in layouts:
                layouts[onednn] = _packed(weight.contiguous(), x.shape[0]) if onednn else weight.t().contiguous()
            return layouts[onednn]

        self.onednn = _use_onednn("projection", (x, weight, other, bias),
                                  lambda: self._product(False, laid(False), other, x),
                                  lambda: self._product(True, laid(True), other, x))
        self.weight = laid(self.onednn)

    def __call__(self, other: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """``other + x @ weight.T``, or ``x @ weight.T + bias`` when ``other`` is None."""
        return self._product(self.onednn, self.weight, other, x)

    def _product(self, onednn: bool, weight: torch.Tensor, other: torch.Tensor | None, x: torch.Tensor
                 ) -> torch.Tensor:
        if onednn:
            if other is None:
                return _onednn_linear(x, weight, self.bias)
            return _onednn_add_linear(other, x, weight)
        if other is None:
            return torch.mm(x, weight) if self.bias is None else torch.addmm(self.bias, x, weight)
        return torch.addmm(other, x, weight)

"""psg's native CPU kernels, in C: a recurrent direction's whole time loop (LSTM, GRU, Elman RNN),
forward and backward; and an EmbeddingBag's ghost clipping (its entries, per-sample norms and
clipped sum: :func:`bag_entries`, :func:`keyed_sq_norms`, :func:`keyed_table_sum`), which in
torch ops takes about 40 small ops a step (the benchmark's 20k x 64 bag model's ghost step: 1.55x
non-private training -> 1.44x, one thread, on a 2-core AMD EPYC); ghost clipping's float64 Gram
matrices of float32 rows (:func:`gram64`: one triangle, no float64 copy of the rows; an LSTM's
gate gradients 1.0 ms against torch's cast and product, 2.2 ms and more); and a strided matrix copied
into a contiguous one (:func:`contiguous`: the transposes of weights and of products computed
transposed, which torch's CPU copy walks element by element).

The DP recurrent layers compute their time loop themselves (see :mod:`psg_core.layers._recurrence`):
per step one product with the hidden weight and the cell's pointwise ops. Run from Python, each
step pays a product call (oneDNN's costs about 10 us before any arithmetic) and seven torch calls
forward, five backward (the LSTM's), for a ``(batch, hidden)`` tile that takes a few microseconds
to compute: at batch 8, hidden 256, the DP LSTM was 2.8x torch's fused kernel on a 2-core AMD
EPYC. The C loops in ``psg_core/csrc`` run a direction in one call: a register-blocked product on
GCC vector types (the compiler maps them to the host's widest SIMD), the cell fused after it, the
steps split over torch's own OpenMP threads by hidden units. The products' multiply-adds are
fused (the product functions ask for it: the library is built in ISO C mode, which does not),
W_hh is packed per block of units for the forward (:func:`forward`), and each step's product input
sits in k-major tiles of the microkernel's rows. Same host, a layer's forward and backward at
batch 8, 64 steps, input 128, hidden 256 (input projections and weight gradients included), one
thread: DPLSTM 20.0 ms (torch's fused LSTM 14.9), DPGRU 14.2 (fused GRU 25.7), DPRNN 4.9 (fused
RNN 8.8); two threads 11.1, 7.9 and 3.3 (fused 8.3, 20.5, 6.7). The time loops alone, one thread:
LSTM forward 4.2 ms and backward 2.9 (6.1 and 3.5 before the fused multiply-adds, the packing and
the tiles). The benchmark LSTM's ghost step is 1.40x non-private training at one thread (glibc's
default allocator; BENCHMARKS.md). Every output element is computed by one thread in one order:
the results do not depend on the thread count.

The library is compiled on first use with the host's C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``; tuned for the host's CPU, linked to the OpenMP runtime torch loaded) into a cache
directory (``$PSG_CACHE_DIR``, else ``$XDG_CACHE_HOME/psg``, else ``~/.cache/psg``; the system's
temporary directory where those cannot be written), keyed by the sources, the flags and the CPU,
and loaded with :mod:`ctypes`; later processes load the cached file (a build takes about a
second). Where no compiler works, or no directory can be
written, psg logs why once and the layers keep their step-by-step loop in torch ops (the fallback,
and the reference the tests compare the kernels with). Nothing else changes.

``PSG_NATIVE`` sets whether the kernels are used: ``auto`` (the default: where they build) or
``off``; :func:`set_native_kernels` and :func:`native_kernels` override it in code.

The kernels take plain CPU tensors of float32 or float64 whose rows have unit stride, outside
autograd's recording and ``torch.func`` transforms; the callers check that (:func:`applies`).

>>> with native_kernels("off"):
...     library() is None
True
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from psg_core._host import capturing
from psg_core._settings import ProcessSetting

__all__ = ["NativeKernels", "ENVIRONMENT_VARIABLE", "set_native_kernels", "native_kernels", "library",
           "applies", "build_error", "CELLS", "forward", "backward", "bag_entries", "keyed_sq_norms",
           "keyed_table_sum", "contiguous", "gram64"]

logger = logging.getLogger(__name__)

#: The environment variable that sets whether the native kernels are used (``auto`` or ``off``).
ENVIRONMENT_VARIABLE = "PSG_NATIVE"
#: The version ``psg_native_version()`` of a library built from this source returns.
_VERSION = 10
_SOURCES = Path(__file__).resolve().parent / "csrc"
#: the file compiled (it includes the others in the directory).
_MAIN = "recurrence.c"


class NativeKernels(str, enum.Enum):
    """Whether psg uses its native CPU kernels."""

    #: wherever they build on this host.
    AUTO = "auto"
    #: never (torch ops only).
    OFF = "off"


_SETTING = ProcessSetting(NativeKernels, ENVIRONMENT_VARIABLE, "native kernel setting")
_LOCK = threading.Lock()
_state: dict[str, object] = {}

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_cpu_tensor(t: torch.Tensor, grad_mode: bool) -> bool:
    """A plain CPU tensor (no subclass such as ExpandedWeights) that a kernel outside autograd may
    read: not recorded by autograd (``grad_mode``: whether grad mode is on) and not wrapped by a
    ``torch.func`` transform. psg's own kernels (this module's loops, psg_core.gemm's oneDNN
    products) take only those."""
    return (type(t) in _PLAIN and t.is_cpu and not (grad_mode and t.requires_grad)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def set_native_kernels(value: NativeKernels | str | None) -> None:
    """Sets whether psg's native kernels are used, for the process (None: back to ``PSG_NATIVE``,
    else ``auto``)."""
    _SETTING.set(value, where="set_native_kernels")


def native_kernels(value: NativeKernels | str | None) -> contextlib.AbstractContextManager[None]:
    """:func:`set_native_kernels` for the duration of a block, then the previous setting."""
    return _SETTING.scoped(value, where="set_native_kernels")


# ------------------------------------------------------------------------------ building
def _cache_dirs() -> list[Path]:
    """Where built libraries are kept, in order: ``$PSG_CACHE_DIR/native``, else the user's cache
    (``$XDG_CACHE_HOME/psg/native``, else ``~/.cache/psg/native``); then a per-user directory in
    the system's temporary directory, for a home that cannot be written (a read-only container)."""
    explicit = os.environ.get("PSG_CACHE_DIR")
    if explicit:
        preferred = Path(explicit) / "native"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        preferred = Path(base) / "psg" / "native"
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [preferred, Path(tempfile.gettempdir()) / f"psg-native-{user}"]


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def _compilers() -> list[str]:
    named = os.environ.get("CC")
    candidates = [named] if named else ["cc", "gcc", "clang"]
    return [c for c in candidates if c and shutil.which(c.split()[0])]


def _openmp_runtime() -> str | None:
    """The OpenMP runtime this process has loaded (torch's), to link the kernels against: their
    parallel loops then run on torch's own thread pool. None where none is loaded."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    for stem in ("libgomp", "libiomp5", "libomp"):
        found = sorted((not p.startswith(torch_dir), p) for p in paths
                       if os.path.basename(p).startswith(stem) and ".so" in p)
        if found:
            return found[0][1]  # torch's own first
    return None


def _builds() -> list[tuple[list[str], list[str]]]:
    """``(compile flags, link arguments)`` to try, best first: tuned for this CPU on torch's
    OpenMP threads, tuned on one thread, portable on one thread."""
    common = ["-O3", "-std=c11", "-fPIC", "-fno-math-errno", "-fopenmp-simd"]
    tuned = common + (["-march=native"] if platform.machine() in ("x86_64", "AMD64", "i686") else ["-mcpu=native"])
    runtime = _openmp_runtime()
    builds = []
    if runtime is not None:
        builds.append((tuned + ["-fopenmp"], [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"]))
    return builds + [(tuned, []), (common, [])]


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags (a library tuned for one CPU is not loaded on
    another that shares the cache directory)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def _build(sources: dict[str, str]) -> Path | None:
    """The compiled library's path (built now, or found in the cache); None with the reason kept.

    ``sources``: file name -> text, compiled as :data:`_MAIN` with the others beside it."""
    compilers = _compilers()
    if not compilers:
        _state["error"] = "no C compiler found ($CC, cc, gcc or clang)"
        return None
    errors = []
    for compiler in compilers:
        for flags, link in _builds():
            key = hashlib.sha256("\0".join([*(f"{name}\0{text}" for name, text in sorted(sources.items())),
                                            compiler, *flags, *link, platform.machine(), _cpu_signature(),
                                            sys.platform]).encode()).hexdigest()[:20]
            name = f"psg_recurrence_{key}.so"
            for directory in _cache_dirs():
                if (directory / name).exists():
                    return directory / name
            writable = next((d for d in _cache_dirs() if _writable(d)), None)
            if writable is None:
                errors.append(f"no writable cache directory ({', '.join(map(str, _cache_dirs()))})")
                break
            target = writable / name
            try:
                with tempfile.TemporaryDirectory(dir=writable) as scratch:
                    for name, text in sources.items():
                        (Path(scratch) / name).write_text(text)
                    obj, built = Path(scratch) / "recurrence.o", Path(scratch) / "recurrence.so"
                    # compiled, then linked without the compiler's own OpenMP library: the one
                    # torch loaded is linked instead (see _openmp_runtime)
                    for command in ([*compiler.split(), *flags, "-c", str(Path(scratch) / _MAIN), "-o", str(obj)],
                                    [*compiler.split(), "-shared", str(obj), "-o", str(built), *link, "-lm"]):
                        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
                        if done.returncode != 0:
                            errors.append(f"{' '.join(command[:1] + flags)}: {done.stderr.strip()[-300:]}")
                            break
                    else:
                        os.replace(built, target)  # atomic: a concurrent build writes the same file
                        return target
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{compiler}: {err}")
    _state["error"] = "; ".join(errors) or "the build failed"
    return None


def _load() -> ctypes.CDLL | None:
    try:
        sources = {path.name: path.read_text() for path in sorted(_SOURCES.iterdir())
                   if path.suffix in (".c", ".h")}
    except OSError as err:
        _state["error"] = f"cannot read {_SOURCES}: {err}"
        return None
    if _MAIN not in sources:
        _state["error"] = f"{_SOURCES / _MAIN} is missing"
        return None
    path = _build(sources)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        if lib.psg_native_version() != _VERSION:
            _state["error"] = f"{path} is version {lib.psg_native_version()}, expected {_VERSION}"
            return None
    except (OSError, AttributeError) as err:
        _state["error"] = f"cannot load {path}: {err}"
        return None
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    for dtype in ("f32", "f64"):
        loop = getattr(lib, f"psg_{dtype}_forward_sequence")
        loop.argtypes = [i, n, n, n, i, i, p, n, n, p, p, p, n, n] + [p, n, n] * 5
        loop.restype = i
        loop = getattr(lib, f"psg_{dtype}_backward_sequence")
        loop.argtypes = [i, n, n, n, i, i, p] + [p, n, n] * 6 + [p, p, p, n, n, p, n, n]
        loop.restype = i
        table = getattr(lib, f"psg_{dtype}_bag_entries")
        table.argtypes = [n, n, p, n, i, i, n, p, p, n, n, p, p, p, p]
        table.restype = i
        table = getattr(lib, f"psg_{dtype}_keyed_sq_norms")
        table.argtypes = [n, n, n, n, p, p, p, p, p, n, i, p]
        table.restype = i
        table = getattr(lib, f"psg_{dtype}_keyed_table_sum")
        table.argtypes = [n, n, n, n, n, p, p, p, p, p, p, n, p]
        table.restype = i
        pack = getattr(lib, f"psg_{dtype}_pack_hidden")
        pack.argtypes = [n, n, p, p]
        pack.restype = None
        copy = getattr(lib, f"psg_{dtype}_strided_copy")
        copy.argtypes = [n, n, p, n, n, p]
        copy.restype = None
        gram = getattr(lib, f"psg_{dtype}_gram64")
        gram.argtypes = [n, n, n, p, n, n, i, p]
        gram.restype = i
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None: turned off (``PSG_NATIVE=off``) or not buildable here (see
    :func:`build_error`). The first call builds or loads the library; later calls return it.
    While a step is recorded (:mod:`psg_core.capture`) the kernels are called as operators of
    the ``psg`` namespace (``torch.ops.psg``), which the recording keeps in its graph: a kernel
    called through ctypes would leave its result out of the replays."""
    return _loaded()


def _loaded() -> ctypes.CDLL | None:
    if _SETTING.current(NativeKernels.AUTO) is NativeKernels.OFF:
        return None
    lib = _state.get("lib")
    if lib is None and "tried" not in _state:
        with _LOCK:
            if "tried" not in _state:
                lib = _load()
                _state["lib"] = lib
                _state["tried"] = True
                if lib is None:
                    logger.info("psg's native CPU kernels are not available (%s); the recurrent layers use "
                                "torch ops", _state.get("error"))
    return _state.get("lib")  # type: ignore[return-value]


def build_error() -> str | None:
    """Why the kernels could not be built or loaded (None: they were, or no build was tried)."""
    error = _state.get("error")
    return None if error is None else str(error)


# ------------------------------------------------------------------------------ applicability
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may read and write these tensors: plain CPU tensors of one float32 or
    float64 dtype, each a matrix or a stack of matrices with unit column stride, none of them
    recorded by autograd or wrapped by a ``torch.func`` transform."""
    if not tensors:
        return False
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    grad_mode = torch.is_grad_enabled()
    return all(t.dtype is dtype and t.stride(-1) == 1 and plain_cpu_tensor(t, grad_mode) for t in tensors)


#: the cell kinds of the C loops (recurrence.c's enum).
CELLS = {"lstm": 0, "gru": 1, "tanh": 2, "relu": 3}
#: the kernels' vector width (recurrence.c's VEC_BYTES): a packed weight's blocks hold this many bytes of units
_VECTOR_BYTES = 64
_GATES = {"lstm": 4, "gru": 3, "tanh": 1, "relu": 1}


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _time_major(tensor: torch.Tensor | None) -> tuple[int | None, int, int]:
    """A ``(T, B, ·)`` buffer's pointer and its step and row strides (elements)."""
    if tensor is None:
        return None, 0, 0
    return tensor.data_ptr(), tensor.stride(0), tensor.stride(1)


def _batch_major(tensor: torch.Tensor) -> tuple[int, int, int]:
    """A ``(B, T, ·)`` tensor's pointer and its row and step strides (elements)."""
    return tensor.data_ptr(), tensor.stride(0), tensor.stride(1)


#: set in a process forked from this one: GNU OpenMP's thread pool does not survive fork (the
#: child's next parallel region waits for the parent's threads, as torch's own parallel ops do
#: there), so a forked child runs the loops on its one thread, outside any parallel region.
_forked = False


def _in_forked_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)


def _threads() -> int:
    return 1 if _forked else max(1, torch.get_num_threads())


def forward(lib: ctypes.CDLL, cell: str, gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            hidden_gates: torch.Tensor, hs: torch.Tensor, reverse: bool, *, act: torch.Tensor | None = None,
            cand: torch.Tensor | None = None, tanh_c: torch.Tensor | None = None,
            cs: torch.Tensor | None = None) -> bool:
    """A recurrent direction's forward time loop in one call (see :func:`_forward`); through the
    ``psg::recurrent_forward`` operator while a step is recorded."""
    if capturing():
        torch.ops.psg.recurrent_forward(cell, gx, weight, bias, hidden_gates, hs, reverse, act, cand, tanh_c, cs)
        return True
    return _forward(lib, cell, gx, weight, bias, hidden_gates, hs, reverse, act=act, cand=cand, tanh_c=tanh_c, cs=cs)


def _forward(lib: ctypes.CDLL, cell: str, gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             hidden_gates: torch.Tensor, hs: torch.Tensor, reverse: bool, *, act: torch.Tensor | None = None,
             cand: torch.Tensor | None = None, tanh_c: torch.Tensor | None = None,
             cs: torch.Tensor | None = None) -> bool:
    """A recurrent direction's forward time loop in one call.

    ``cell``: ``"lstm"``, ``"gru"``, ``"tanh"`` or ``"relu"`` (:data:`CELLS`); ``gx``
    ``(B, T, G*H)``: the input gates (input bias included); ``weight`` ``(G*H, H)`` and ``bias``
    ``(G*H,)`` or None: the hidden projection's. Written: ``hidden_gates`` ``(B, T, G*H)``
    (``W_hh h_prev + b_hh``) and the time-major ``(T, B, ·)`` buffers: ``hs`` ``(T+1, B, H)``
    the states (slot 0, or T when ``reverse``, holds the initial one on entry); the LSTM's ``act``
    ``(T, B, 4H)`` (its gates after their nonlinearities), ``cand`` and ``tanh_c`` ``(T, B, H)``
    and ``cs`` ``(T+1, B, H)`` (like ``hs``); the GRU's ``act`` ``(T, B, 2H)`` (r and z) and
    ``cand`` ``(T, B, H)`` (n). Returns False, having written nothing, where memory could not be had.
    """
    batch, steps, width = gx.shape
    hidden = width // _GATES[cell]
    # W_hh laid out for the steps' products: per block of a vector's units, an (H, G, units) slab
    gates, lanes = _GATES[cell], _VECTOR_BYTES // gx.element_size()
    packed = torch.empty(-(-hidden // lanes) * hidden * gates * lanes, dtype=gx.dtype)
    dense = weight.contiguous()  # held while the kernel reads it
    getattr(lib, f"psg_{_DTYPES[gx.dtype]}_pack_hidden")(gates, hidden, dense.data_ptr(), packed.data_ptr())
    status = getattr(lib, f"psg_{_DTYPES[gx.dtype]}_forward_sequence")(
        CELLS[cell], batch, hidden, steps, int(reverse), _threads(), *_batch_major(gx), packed.data_ptr(),
        _pointer(bias), *_batch_major(hidden_gates), *_time_major(act), *_time_major(cand), *_time_major(tanh_c),
        *_time_major(hs), *_time_major(cs))
    return bool(status == 0)


def backward(lib: ctypes.CDLL, cell: str, weight: torch.Tensor, d_out: torch.Tensor, dh: torch.Tensor,
             d_input: torch.Tensor, reverse: bool, *, d_hidden: torch.Tensor | None = None,
             dc: torch.Tensor | None = None, act: torch.Tensor | None = None, cand: torch.Tensor | None = None,
             tanh_c: torch.Tensor | None = None, hs: torch.Tensor | None = None,
             cs: torch.Tensor | None = None) -> bool:
    """A recurrent direction's backward time loop in one call (see :func:`_backward`); through the
    ``psg::recurrent_backward`` operator while a step is recorded."""
    if capturing():
        torch.ops.psg.recurrent_backward(cell, weight, d_out, dh, d_input, reverse, d_hidden, dc, act, cand, tanh_c,
                                         hs, cs)
        return True
    return _backward(lib, cell, weight, d_out, dh, d_input, reverse, d_hidden=d_hidden, dc=dc, act=act, cand=cand,
                     tanh_c=tanh_c, hs=hs, cs=cs)


def _backward(lib: ctypes.CDLL, cell: str, weight: torch.Tensor, d_out: torch.Tensor, dh: torch.Tensor,
              d_input: torch.Tensor, reverse: bool, *, d_hidden: torch.Tensor | None = None,
              dc: torch.Tensor | None = None, act: torch.Tensor | None = None, cand: torch.Tensor | None = None,
              tanh_c: torch.Tensor | None = None, hs: torch.Tensor | None = None,
              cs: torch.Tensor | None = None) -> bool:
    """A recurrent direction's backward time loop in one call, from what its forward saved.

    ``weight`` ``(G*H, H)`` contiguous; ``d_out`` ``(B, T, H)``: the outputs' gradients;
    ``dh`` (and the LSTM's ``dc``) ``(B, H)`` contiguous: the final state's gradients on entry,
    the initial state's on return. Written: ``d_input`` ``(B, T, G*H)``, the input gates'
    gradients, and ``d_hidden`` (the GRU's hidden gates', which differ; the other cells' are
    ``d_input``). The saved activations, time-major ``(T, B, ·)`` views: the LSTM's ``act``,
    ``cand``, ``tanh_c`` (as its forward wrote them) and ``cs``, c before each step; the GRU's
    ``act`` (r, z), ``cand`` (n), ``tanh_c`` its ``h_n = W_hn h_prev + b_hn`` and ``hs``, h before
    each step; the RNN's ``hs``, h after each step. Returns False, having written nothing, where
    memory could not be had.
    """
    batch, steps, hidden = d_out.shape
    status = getattr(lib, f"psg_{_DTYPES[d_input.dtype]}_backward_sequence")(
        CELLS[cell], batch, hidden, steps, int(reverse), _threads(), weight.data_ptr(), *_time_major(act),
        *_time_major(cand), *_time_major(tanh_c), *_time_major(hs), *_time_major(cs), *_batch_major(d_out),
        dh.data_ptr(), _pointer(dc), *_batch_major(d_input), *_batch_major(d_input if d_hidden is None else d_hidden))
    return bool(status == 0)


# ------------------------------------------------------------------------------ lookup tables
# An EmbeddingBag's ghost clipping (csrc/table.h): the entries of a call, the per-sample squared
# norms and the clipped sum, one call each where torch ops take 9, 22 and 10 small ops. Each
# returns None where the kernels do not apply (not a CPU, not float32/float64, the library not
# built) or refused the numbers (offsets that do not rise from 0, a token outside the table):
# the caller then takes its torch-op path, which is also the reference the tests compare with.
_WIDE_LONG = ctypes.sizeof(ctypes.c_long) == 8  # the kernels' index type is C's long


def _table_library(*tensors: torch.Tensor | None) -> ctypes.CDLL | None:
    """The library, where it may read these tensors: plain CPU tensors, rows of unit stride."""
    if not _WIDE_LONG:
        return None
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dim() == 0 or t.stride(-1) != 1 or not plain_cpu_tensor(t, grad_mode)):
            return None
    return _loaded()


def bag_entries(tokens: torch.Tensor, offsets: torch.Tensor | None, *, bags: int, include_last_offset: bool,
                mean: bool, padding_idx: int | None, per_sample_weights: torch.Tensor | None, K: int,
                table_rows: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """An EmbeddingBag call's tokens (modes sum and mean) as ``left (2, M)`` (each token's sample,
    ``bag // K``, and table row), ``source (M,)`` (its bag) and ``weight (M,)`` (0 where it does
    not count, else its per-sample weight or 1, over its bag's count for mode mean).

    ``tokens``: the flat ``(M,)`` input with ``offsets`` (``include_last_offset`` as the layer's),
    or with ``offsets`` None the flattened rows of a 2-D input of ``bags`` rows.

    >>> out = bag_entries(torch.tensor([3, 1, 1]), torch.tensor([0, 1]), bags=2, include_last_offset=False,
    ...                   mean=True, padding_idx=None, per_sample_weights=None, K=1, table_rows=5,
    ...                   dtype=torch.float32)
    >>> out is None or [t.tolist() for t in out] == [[[0, 1, 1], [3, 1, 1]], [0, 1, 1], [1.0, 0.5, 0.5]]
    True
    """
    if dtype not in _DTYPES or tokens.dtype is not torch.int64 or tokens.dim() != 1 \
            or (offsets is not None and (offsets.dtype is not torch.int64 or offsets.dim() != 1)) \
            or (per_sample_weights is not None and (per_sample_weights.dtype is not dtype
                                                    or per_sample_weights.shape != tokens.shape)):
        return None
    lib = _table_library(tokens, offsets, per_sample_weights)
    if lib is None or (offsets is None and bags < 1):
        return None
    if capturing():
        ids, weight = torch.ops.psg.bag_entries(tokens, offsets, bags, include_last_offset, mean, padding_idx,
                                                per_sample_weights, K, table_rows, dtype)
    else:
        found = _bag_entries(lib, tokens, offsets, bags, include_last_offset, mean, padding_idx, per_sample_weights,
                             K, table_rows, dtype)
        if found is None:
            return None
        ids, weight = found
    return ids[:2], ids[2], weight


def _bag_entries(lib: ctypes.CDLL, tokens: torch.Tensor, offsets: torch.Tensor | None, bags: int,
                 include_last_offset: bool, mean: bool, padding_idx: int | None,
                 per_sample_weights: torch.Tensor | None, K: int, table_rows: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    count = tokens.shape[0]
    ids = torch.empty(3, count, dtype=torch.int64)  # sample, table row, bag
    weight = torch.empty(count, dtype=dtype)
    status = getattr(lib, f"psg_{_DTYPES[dtype]}_bag_entries")(
        count, bags, _pointer(offsets), 0 if offsets is None else offsets.shape[0], int(include_last_offset),
        int(mean), -1 if padding_idx is None else padding_idx, tokens.data_ptr(), _pointer(per_sample_weights), K,
        table_rows, ids.data_ptr(), ids.data_ptr() + 8 * count, ids.data_ptr() + 16 * count, weight.data_ptr())
    return (ids, weight) if status == 0 else None


def keyed_sq_norms(left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                   samples: int) -> torch.Tensor | None:
    """``(N,)``: sample n's ``sum_v ||sum_{m: left[:, m] = (n, v)} weight[m] * rows[source[m]]||^2``,
    ``rows (N*K, d)`` with K rows per sample (see ``GhostFactors.keyed``), in ``rows``' dtype.

    >>> rows = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> out = keyed_sq_norms(torch.tensor([[0, 0, 1], [4, 4, 5]]), torch.tensor([0, 0, 1]),
    ...                      torch.tensor([0.5, 0.5, 3.0]), rows, 2)
    >>> out is None or out.tolist() == [1.0, 36.0]
    True
    """
    dtype = rows.dtype
    if dtype not in _DTYPES or weight.dtype is not dtype or rows.dim() != 2 or left.dtype is not torch.int64 \
            or source.dtype is not torch.int64 or samples < 1 or rows.shape[0] % samples:
        return None
    lib = _table_library(left, source, weight, rows)
    if lib is None:
        return None
    if capturing():
        return torch.ops.psg.keyed_sq_norms(left, source, weight, rows, samples)  # type: ignore[no-any-return]
    return _keyed_sq_norms(lib, left, source, weight, rows, samples)


def _keyed_sq_norms(lib: ctypes.CDLL, left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor,
                    rows: torch.Tensor, samples: int) -> torch.Tensor | None:
    out = torch.empty(samples, dtype=rows.dtype)
    status = getattr(lib, f"psg_{_DTYPES[rows.dtype]}_keyed_sq_norms")(
        left.shape[1], samples, rows.shape[0] // samples, rows.shape[1], left.data_ptr(),
        left.data_ptr() + 8 * left.stride(0), source.data_ptr(), weight.data_ptr(), rows.data_ptr(), rows.stride(0),
        _threads(), out.data_ptr())
    return out if status == 0 else None


def keyed_table_sum(left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                    factors: torch.Tensor, table_rows: int) -> torch.Tensor | None:
    """``(V, d)``, V = ``table_rows``: ``sum_m weight[m] * factors[left[0, m]] * rows[source[m]]`` added
    into row ``left[1, m]``, entries whose scale is 0 (a dropped sample's) left out.

    >>> out = keyed_table_sum(torch.tensor([[0, 1], [2, 2]]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]),
    ...                       torch.tensor([[1.0], [5.0]]), torch.tensor([0.5, 0.0]), 3)
    >>> out is None or out.tolist() == [[0.0], [0.0], [0.5]]
    True
    """
    dtype = rows.dtype
    if dtype not in _DTYPES or weight.dtype is not dtype or factors.dtype is not dtype or rows.dim() != 2 \
            or left.dtype is not torch.int64 or source.dtype is not torch.int64:
        return None
    lib = _table_library(left, source, weight, rows, factors)
    if lib is None:
        return None
    if capturing():
        return torch.ops.psg.keyed_table_sum(left, source, weight, rows, factors, table_rows)  # type: ignore[no-any-return]
    return _keyed_table_sum(lib, left, source, weight, rows, factors, table_rows)


def _keyed_table_sum(lib: ctypes.CDLL, left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor,
                     rows: torch.Tensor, factors: torch.Tensor, table_rows: int) -> torch.Tensor | None:
    out = torch.zeros(table_rows, rows.shape[1], dtype=rows.dtype)
    status = getattr(lib, f"psg_{_DTYPES[rows.dtype]}_keyed_table_sum")(
        left.shape[1], factors.shape[0], rows.shape[1], table_rows, rows.shape[0], left.data_ptr(),
        left.data_ptr() + 8 * left.stride(0), source.data_ptr(), weight.data_ptr(), factors.data_ptr(),
        rows.data_ptr(), rows.stride(0), out.data_ptr())
    return out if status == 0 else None


# ------------------------------------------------------------------------------ as torch operators
# The kernels as operators of the ``psg`` namespace (defined at the end of the module), which a
# recorded step (psg_core.capture) keeps in its graph: a replay calls the kernel on the new batch.
# They are reached only while recording (an eager step calls the kernels directly, without the
# operator dispatch), once the eligibility checks above have passed, so on CPU tensors outside
# autograd's recording: each is a CPU kernel of the dispatcher, with no autograd formula.
def _required(result: Any, what: str) -> Any:
    if result is None:
        raise RuntimeError(f"psg's native {what} kernel failed on this batch (it succeeded on the recorded one)")
    return result


def _required_library() -> ctypes.CDLL:
    return _required(_loaded(), "library")  # type: ignore[no-any-return]


def _bag_entries_op(tokens: torch.Tensor, offsets: torch.Tensor | None, bags: int, include_last_offset: bool,
                    mean: bool, padding_idx: int | None, per_sample_weights: torch.Tensor | None, K: int,
                    table_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _required(_bag_entries(_required_library(), tokens, offsets, bags, include_last_offset, mean, padding_idx,
                                  per_sample_weights, K, table_rows, dtype), "bag_entries")  # type: ignore[no-any-return]


def _keyed_sq_norms_op(left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                       samples: int) -> torch.Tensor:
    return _required(_keyed_sq_norms(_required_library(), left, source, weight, rows, samples),  # type: ignore[no-any-return]
                     "keyed_sq_norms")


def _keyed_table_sum_op(left: torch.Tensor, source: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                        factors: torch.Tensor, table_rows: int) -> torch.Tensor:
    return _required(_keyed_table_sum(_required_library(), left, source, weight, rows, factors,  # type: ignore[no-any-return]
                                      table_rows), "keyed_table_sum")


#: below this many elements torch's own copy costs no more than the call into the library
_COPY_MIN_ELEMENTS = 4096


def contiguous(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix.contiguous()``; a strided float32/float64 CPU matrix outside autograd's recording (a
    weight's transpose, a product computed transposed) is copied by psg's tiled kernel, which reads
    and writes each cache line once where torch's copy walks the large stride element by element
    (a ``(1024, 256)`` transpose: 0.08 ms against torch's 0.16-0.24 on the 2-core AMD EPYC).

    >>> m = torch.arange(6.0).view(2, 3).t()
    >>> out = contiguous(m)
    >>> out.is_contiguous(), torch.equal(out, m)
    (True, True)
    """
    if matrix.is_contiguous():
        return matrix  # (what .contiguous() returns: the common case, decided first)
    if matrix.dim() != 2 or matrix.dtype not in _DTYPES or matrix.numel() < _COPY_MIN_ELEMENTS \
            or matrix.is_neg() or not plain_cpu_tensor(matrix, torch.is_grad_enabled()):
        return matrix.contiguous()
    lib = library()
    if lib is None:
        return matrix.contiguous()
    if capturing():
        return torch.ops.psg.strided_copy(matrix)  # type: ignore[no-any-return]
    return _strided_copy(lib, matrix)


def _strided_copy(lib: ctypes.CDLL, matrix: torch.Tensor) -> torch.Tensor:
    out = torch.empty(matrix.shape, dtype=matrix.dtype)
    rows, cols = matrix.shape
    getattr(lib, f"psg_{_DTYPES[matrix.dtype]}_strided_copy")(rows, cols, matrix.data_ptr(), matrix.stride(0),
                                                               matrix.stride(1), out.data_ptr())
    return out


# ------------------------------------------------------------------------------ float64 Grams
def gram64(rows: torch.Tensor) -> torch.Tensor | None:
    """``(B, T, T)`` float64 Gram matrices ``rows[b] @ rows[b]^T`` of a ``(B, T, D)`` float32 or
    float64 stack of rows, every product and sum in float64 (csrc/gram.h: ghost clipping's
    Grams, without a float64 copy of the rows, one triangle computed); None where the kernel
    does not apply (not a plain CPU tensor outside autograd's recording, rows of another dtype
    or of non-unit stride, no rows, the library not built), and the caller computes it in torch.

    >>> rows = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    >>> out = gram64(rows)
    >>> out is None or (out.dtype, out.tolist()) == (torch.float64, [[[5.0, 11.0], [11.0, 25.0]]])
    True
    """
    if rows.dim() != 3 or rows.dtype not in _DTYPES or 0 in rows.shape:
        return None
    lib = _table_library(rows)
    if lib is None:
        return None
    if capturing():
        return torch.ops.psg.gram64(rows)  # type: ignore[no-any-return]
    return _gram64(lib, rows)


def _gram64(lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor | None:
    batch, positions, width = rows.shape
    out = torch.empty(batch, positions, positions, dtype=torch.float64)
    status = getattr(lib, f"psg_{_DTYPES[rows.dtype]}_gram64")(
        batch, positions, width, rows.data_ptr(), rows.stride(0), rows.stride(1), _threads(), out.data_ptr())
    return out if status == 0 else None


def _check_fit(batch: int, steps: int, hidden: int, width: int, batch_major: tuple[torch.Tensor | None, ...],
               time_major: tuple[torch.Tensor | None, ...]) -> None:
    """A replayed kernel call's buffers fit its inputs (the C loops trust them): batch-major
    ``(B, T, G*H)`` and time-major ``(T or T+1, B, ·)`` with ``·`` at most ``G*H``."""
    fits = all(t is None or tuple(t.shape) == (batch, steps, width) for t in batch_major) and all(
        t is None or (t.dim() == 3 and t.shape[0] in (steps, steps + 1) and t.shape[1] == batch
                      and hidden <= t.shape[2] <= width) for t in time_major)
    if not fits:
        raise RuntimeError("psg's native recurrent kernel: the buffers of a replayed step do not fit its inputs "
                           f"(B {batch}, T {steps}, H {hidden}): the step's sizes depend on values it did not record")


def _recurrent_forward_op(cell: str, gx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          hidden_gates: torch.Tensor, hs: torch.Tensor, reverse: bool, act: torch.Tensor | None,
                          cand: torch.Tensor | None, tanh_c: torch.Tensor | None, cs: torch.Tensor | None) -> None:
    batch, steps, width = gx.shape
    _check_fit(batch, steps, weight.shape[1], width, (hidden_gates,), (hs, act, cand, tanh_c, cs))
    if not _forward(_required_library(), cell, gx, weight, bias, hidden_gates, hs, reverse, act=act, cand=cand,
                    tanh_c=tanh_c, cs=cs):
        _required(None, "recurrent forward")


def _recurrent_backward_op(cell: str, weight: torch.Tensor, d_out: torch.Tensor, dh: torch.Tensor,
                           d_input: torch.Tensor, reverse: bool, d_hidden: torch.Tensor | None,
                           dc: torch.Tensor | None, act: torch.Tensor | None, cand: torch.Tensor | None,
                           tanh_c: torch.Tensor | None, hs: torch.Tensor | None, cs: torch.Tensor | None) -> None:
    batch, steps, hidden = d_out.shape
    _check_fit(batch, steps, hidden, d_input.shape[-1], (d_input, d_hidden), (act, cand, tanh_c, hs, cs))
    if dh.shape != (batch, hidden) or (dc is not None and dc.shape != (batch, hidden)):
        _check_fit(batch, steps, hidden, 0, (), (dh,))  # (raises)
    if not _backward(_required_library(), cell, weight, d_out, dh, d_input, reverse, d_hidden=d_hidden, dc=dc, act=act,
                     cand=cand, tanh_c=tanh_c, hs=hs, cs=cs):
        _required(None, "recurrent backward")


def _strided_copy_op(matrix: torch.Tensor) -> torch.Tensor:
    return _strided_copy(_required_library(), matrix)


def _gram64_op(rows: torch.Tensor) -> torch.Tensor:
    return _required(_gram64(_required_library(), rows), "gram64")  # type: ignore[no-any-return]


_OPERATORS = torch.library.Library("psg", "DEF")
for _schema, _kernel in (
        ("bag_entries(Tensor tokens, Tensor? offsets, int bags, bool include_last_offset, bool mean, int? padding_idx, "
         "Tensor? per_sample_weights, int K, int table_rows, ScalarType dtype) -> (Tensor, Tensor)", _bag_entries_op),
        ("keyed_sq_norms(Tensor left, Tensor source, Tensor weight, Tensor rows, int samples) -> Tensor",
         _keyed_sq_norms_op),
        ("keyed_table_sum(Tensor left, Tensor source, Tensor weight, Tensor rows, Tensor factors, int table_rows) "
         "-> Tensor", _keyed_table_sum_op),
        ("recurrent_forward(str cell, Tensor gx, Tensor weight, Tensor? bias, Tensor(a!) hidden_gates, Tensor(b!) hs, "
         "bool reverse, Tensor(c!)? act, Tensor(d!)? cand, Tensor(e!)? tanh_c, Tensor(f!)? cs) -> ()",
         _recurrent_forward_op),
        ("recurrent_backward(str cell, Tensor weight, Tensor d_out, Tensor(a!) dh, Tensor(b!) d_input, bool reverse, "
         "Tensor(c!)? d_hidden, Tensor(d!)? dc, Tensor? act, Tensor? cand, Tensor? tanh_c, Tensor? hs, Tensor? cs) "
         "-> ()", _recurrent_backward_op),
        ("strided_copy(Tensor matrix) -> Tensor", _strided_copy_op),
        ("gram64(Tensor rows) -> Tensor", _gram64_op)):
    _OPERATORS.define(_schema)
    _OPERATORS.impl(_schema.split("(")[0], _kernel, "CPU")

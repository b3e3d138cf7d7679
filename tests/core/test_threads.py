"""psg's calls on one model from several threads at once (a server thread pool sharing a model).

Every backend changes the model while it runs: the hooks and ghost backends register hooks on its
layers (which catch every forward through them, another thread's too), torch.func and
ExpandedWeights swap its parameters in and out by attribute. Before psg held a lock per model,
four threads on one model got wrong per-sample gradients or errors in every round for hooks,
functorch and ew (psg_core.support.exclusive).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from psg_core import dp_gradient, per_sample_gradients
from psg_core.backends.ghost import ghost_dp_gradient
from psg_core.config import DPConfig
from psg_core.support import exclusive

_THREADS, _CALLS = 4, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _calls(model: nn.Module) -> dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]]:
    loss = nn.CrossEntropyLoss(reduction="none")
    config = DPConfig(mode="ghost", max_grad_norm=1.0, augmentation_multiplicity=2)
    calls: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]] = {
        mode: (lambda x, y, mode=mode: per_sample_gradients(model, x, y, loss_fn=loss, mode=mode,
                                                            augmentation_multiplicity=2))
        for mode in ("hooks", "functorch", "ew")}
    calls["dp_gradient ghost"] = lambda x, y: dp_gradient(model, x, y, loss_fn=loss, config=config).grads
    calls["dp_gradient hooks"] = lambda x, y: dp_gradient(
        model, x, y, loss_fn=loss, config=DPConfig(mode="hooks", max_grad_norm=1.0)).grads
    calls["ghost_dp_gradient"] = lambda x, y: ghost_dp_gradient(model, x, y, loss_fn=loss, config=config).grads
    return calls


@pytest.mark.parametrize("call", list(_calls(nn.Linear(1, 1))))
def test_threads_on_one_model_get_their_own_batches_gradients(call: str) -> None:
    """Four threads, each its own batch, three calls each on the same model: every result equals
    the same call made alone."""
    model = _model()
    run = _calls(model)[call]
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(_THREADS)]
    alone = [run(x, y) for x, y in batches]
    got: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(_THREADS)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(_CALLS):
                got[i].append(run(*batches[i]))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in range(_THREADS):
        assert len(got[i]) == _CALLS
        for result in got[i]:
            for name, want in alone[i].items():
                torch.testing.assert_close(result[name], want, rtol=1e-5, atol=1e-6)
    # the model is as it was: its own parameters, no hooks left
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_exclusive_serialises_one_model_not_two() -> None:
    """A thread waits for another's block on the same model; blocks on different models overlap."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    inside, release = threading.Event(), threading.Event()
    entered: list[str] = []

    def hold() -> None:
        with exclusive(first):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)

    def enter(model: nn.Module, label: str) -> None:
        with exclusive(model):
            entered.append(label)

    other = threading.Thread(target=enter, args=(second, "second"))
    same = threading.Thread(target=enter, args=(first, "first"))
    other.start()
    same.start()
    other.join(10)
    assert entered == ["second"]  # the other model's block ran; the same model's waits
    release.set()
    same.join(10)
    holder.join(10)
    assert entered == ["second", "first"]


class _Paused(nn.Module):
    """A model whose forward can be held mid-pass (``inside`` set, waiting on ``release``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 8), nn.Linear(8, 4)
        self.inside, self.release = threading.Event(), threading.Event()
        self.hold = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if self.hold:
            self.inside.set()
            assert self.release.wait(10)
        return self.second(h)


def test_the_wrapper_refuses_a_forward_while_another_threads_pass_runs() -> None:
    """GradSampleModule keeps one pass at a time: a second thread's forward in the middle of the
    first's is refused with a ConfigError (before, the threads' hooks ended each other's passes:
    a raw 'pop from empty mode stack' in one thread, the others' captures crossed); the first pass
    completes with its own per-sample gradients, and threads taking turns are served."""
    from psg_core import ConfigError, GradSampleModule

    torch.manual_seed(0)
    model = _Paused()
    wrapped = GradSampleModule(model)
    x, other = torch.randn(6, 16), torch.randn(6, 16)

    def grad_samples(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        for p in model.parameters():
            p.grad_sample = p.grad = None
        wrapped(batch).square().sum().backward()
        return {n: p.grad_sample.clone() for n, p in model.named_parameters()}

    alone = grad_samples(x)
    got: dict[str, dict[str, torch.Tensor]] = {}
    refused: list[BaseException] = []
    model.hold = True
    first = threading.Thread(target=lambda: got.setdefault("first", grad_samples(x)))
    first.start()
    assert model.inside.wait(10)

    def second() -> None:
        try:
            wrapped(other)
        except ConfigError as err:
            refused.append(err)

    intruder = threading.Thread(target=second)
    intruder.start()
    intruder.join(10)
    model.release.set()
    first.join(10)
    assert len(refused) == 1 and "another thread's pass" in str(refused[0])
    for name, want in alone.items():
        torch.testing.assert_close(got["first"][name], want)
    model.hold = False
    turns: dict[int, dict[str, torch.Tensor]] = {}
    for i, batch in enumerate((x, other)):  # one thread after another: both served
        thread = threading.Thread(target=lambda i=i, batch=batch: turns.setdefault(i, grad_samples(batch)))
        thread.start()
        thread.join(10)
    for name, want in alone.items():
        torch.testing.assert_close(turns[0][name], want)
    assert set(turns) == {0, 1}
    wrapped.remove_hooks()


def test_a_pass_cut_short_by_an_interrupt_ends() -> None:
    """torch runs a forward's always-call hooks on exceptions, not on KeyboardInterrupt: the
    wrapper's forward ends the pass itself, so no batch tracker stays active on the thread and
    another thread's forward is served; a direct call of the model, cut short, is ended by
    remove_hooks()."""
    from torch.overrides import _get_current_function_mode_stack

    from psg_core import ConfigError, GradSampleModule

    class Interrupted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.interrupt = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.interrupt:
                raise KeyboardInterrupt
            return self.fc(x)

    model = Interrupted()
    wrapped = GradSampleModule(model)
    outcome: list[BaseException | torch.Tensor] = []

    def other_thread() -> None:
        try:
            model.interrupt = False
            outcome.append(wrapped(torch.randn(3, 4)))
        except ConfigError as err:
            outcome.append(err)
        finally:
            model.interrupt = True

    for call, expected in ((wrapped, torch.Tensor), (model, ConfigError)):
        with pytest.raises(KeyboardInterrupt):
            call(torch.randn(3, 4))
        assert not _get_current_function_mode_stack() if call is wrapped else _get_current_function_mode_stack()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(10)
        assert isinstance(outcome.pop(), expected)
    wrapped.remove_hooks()  # ends the direct call's pass
    assert not _get_current_function_mode_stack()
    wrapped.add_hooks()
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(10)
    assert isinstance(outcome.pop(), torch.Tensor)
    wrapped.remove_hooks()


def test_the_next_call_ends_a_direct_call_cut_short() -> None:
    """A direct call of the wrapped model cut short by a KeyboardInterrupt leaves its pass open
    (torch runs no always-call hook then): the thread's next call of the model ends it, so that
    pass gets its own batch tracking (a new input tensor: the oracle's per-sample gradients), no
    tracker stays on the thread and another thread is served; a model that calls itself inside
    its pass is one pass (its per-sample gradients the oracle's; each call counted as a pass of
    its own, the second backward was refused as accumulation)."""
    from torch.overrides import _get_current_function_mode_stack

    from psg_core import GradSampleModule

    class Stoppable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
            self.interrupt = False

        def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
            h = self.a(x)
            if self.interrupt:
                raise KeyboardInterrupt
            return self.b(torch.tanh(h)) if inner else self(x, inner=True) + self.b(h)

    torch.manual_seed(0)
    model = Stoppable()
    wrapped = GradSampleModule(model, loss_reduction="sum")
    x = torch.randn(5, 3)
    wrapped.disable_hooks()
    expected = {name: torch.stack(grads) for name, grads in zip(
        [name for name, _ in model.named_parameters()],
        zip(*(torch.autograd.grad(model(x[n:n + 1]).sum(), list(model.parameters())) for n in range(5))))}
    wrapped.enable_hooks()
    model(x).sum().backward()  # the model calls itself: one pass
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], msg=name)
        p.grad_sample, p.grad = None, None
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(5, 3))
    assert _get_current_function_mode_stack()  # the cut-short pass is still open
    model.interrupt = False
    model(x.clone()).sum().backward()  # a new tensor: unmarked by the cut-short pass's tracker
    assert not _get_current_function_mode_stack()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name], msg=name)
    served: list[object] = []
    thread = threading.Thread(target=lambda: served.append(model(torch.randn(2, 3))))
    thread.start()
    thread.join(10)
    assert len(served) == 1 and isinstance(served[0], torch.Tensor)
    wrapped.remove_hooks()


def test_a_model_calling_itself_is_tracked_to_the_end_of_its_pass() -> None:
    """The inner call's end does not end the pass's batch tracking: rows mixed after it (a
    batch mean) are refused, naming the layer."""
    from psg_core import GradSampleModule, UnsupportedModuleError

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.tanh(h)) if inner else self(x, inner=True) + self.b(h - h.mean(0))

    model = Centred()
    wrapped = GradSampleModule(model, loss_reduction="sum")
    with pytest.raises(UnsupportedModuleError, match=r"'b' \(Linear\) receives values that mix samples"):
        model(torch.randn(5, 3)).sum().backward()
    wrapped.remove_hooks()

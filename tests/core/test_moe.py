"""Mixtures of experts: routed experts are row-wise, however they sort and scatter the rows.

A routed-experts module sorts the batch's token rows by expert, runs each expert on its rows and
puts them back: every output row comes from the same input row alone, but the sort, the gathers
and the per-expert offsets look like mixing to the batch tracker. Hugging Face's experts (every
class built on transformers' experts interface) and classes declared with
:func:`psg_core.rowwise_module` run untracked, their outputs keeping their inputs' rows. With the
experts frozen (LoRA on attention, or everything but the experts trained) or trained too, every
mode gives the oracle's per-sample gradients: trainable experts get theirs from one grouped call
on per-sample copies of the experts (psg_core.grad_sample.experts), any other row-wise module's
from the per-layer torch.func fallback run one sample at a time.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, check_ghost_clipped, microbatch_oracle

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [
    # peft calls transformers' deprecated name while wrapping a model (outside psg).
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

VOCAB, PAD, N = 40, 0, 3
RTOL, ATOL = 1e-3, 1e-5


def _mixtral(implementation: str) -> nn.Module:
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, num_labels=2, pad_token_id=PAD,
                                     experts_implementation=implementation)
    return transformers.MixtralForSequenceClassification(cfg)


def _qwen2_moe(implementation: str) -> nn.Module:
    # a shared expert (an ordinary MLP, trainable) beside the routed ones
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                      moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      num_experts=4, num_experts_per_tok=2, num_labels=2, pad_token_id=PAD,
                                      experts_implementation=implementation)
    return transformers.Qwen2MoeForSequenceClassification(cfg)


def _qwen3_moe(implementation: str) -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, num_labels=2, pad_token_id=PAD,
                                      experts_implementation=implementation)
    return transformers.Qwen3MoeForSequenceClassification(cfg)


BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}
IMPLEMENTATIONS = ["eager", "grouped_mm", "batched_mm"]


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@functools.cache
def _model(family: str, implementation: str, variant: str) -> nn.Module:
    """``variant``: "lora" (adapters on q_proj and v_proj), "frozen_experts" (everything else trains)
    or "full" (everything trains, the experts too)."""
    torch.manual_seed(0)
    model = BUILDERS[family](implementation).eval()
    if variant == "full":
        assert all(p.requires_grad for e in _experts(model) for p in e.parameters())
        return model
    if variant == "lora":
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    else:
        for experts in _experts(model):
            experts.requires_grad_(False)
    assert _experts(model) and not any(p.requires_grad for e in _experts(model) for p in e.parameters())
    return model


def _batch(rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (rows, 6), generator=generator)
    mask = torch.ones(rows, 6, dtype=torch.long)
    mask[0, -2:] = 0
    ids[0, -2:] = PAD
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (rows,), generator=generator)


def _loss(outputs: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.logits, labels, reduction="none")  # type: ignore[attr-defined]


@functools.cache
def _oracle(family: str, implementation: str, variant: str, K: int) -> dict[str, torch.Tensor]:
    """``{name: (N, *shape)}`` in float64: each sample's gradient from its K rows alone."""
    model = copy.deepcopy(_model(family, implementation, variant)).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    inputs, labels = _batch(N * K)
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(N):
        rows = slice(n * K, (n + 1) * K)
        loss = _loss(model(**{k: v[rows] for k, v in inputs.items()}), labels[rows]).mean()
        for name, g in zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
            grads[name].append(torch.zeros_like(params[name]) if g is None else g)
    return {name: torch.stack(gs) for name, gs in grads.items()}


def _check(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert set(grads) == set(expected), where
    scale = max(float(ref.abs().max()) for ref in expected.values())
    for name, ref in expected.items():
        torch.testing.assert_close(grads[name].double(), ref, rtol=RTOL, atol=ATOL * scale,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


VARIANTS = ["lora", "frozen_experts", "full"]
CASES = [(mode, family, implementation, variant, K)
         for family in sorted(BUILDERS) for implementation in IMPLEMENTATIONS
         for variant in VARIANTS for K in (1, 2) for mode in ("hooks", "functorch")
         # functorch runs each sample alone, whatever the experts do: one case per family
         if mode == "hooks" or (implementation, variant, K) == ("eager", "lora", 2)]


@pytest.mark.parametrize("mode, family, implementation, variant, K", CASES)
def test_per_sample_gradients_match_the_oracle(mode: str, family: str, implementation: str, variant: str,
                                               K: int) -> None:
    model = _model(family, implementation, variant)
    inputs, labels = _batch(N * K)
    grads = per_sample_gradients(model, inputs, labels, loss_fn=_loss, mode=mode, augmentation_multiplicity=K)
    _check(grads, _oracle(family, implementation, variant, K), f"{family}/{implementation}/{variant}/{mode}")


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_ghost_norms_and_clipped_sum_match_the_oracle(family: str, implementation: str, variant: str, K: int) -> None:
    model = _model(family, implementation, variant)
    inputs, labels = _batch(N * K)
    expected = _oracle(family, implementation, variant, K)
    bound = 1e-3  # every sample clipped
    reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=bound)
    result = dp_gradient(model, inputs, labels, loss_fn=_loss,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms", rtol=RTOL, atol=ATOL)
    _check(result.grads, {n: g.double() for n, g in reference.grads.items()}, f"{family}/{implementation}/ghost")


@pytest.mark.parametrize("variant", ["frozen_experts", "full"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_grad_sample_module_matches_the_oracle(family: str, variant: str) -> None:
    model = _model(family, "grouped_mm", variant)
    inputs, labels = _batch(2 * N)
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2, strict=False)
    try:
        _loss(wrapped(**inputs), labels).mean().backward()
        grads = {n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad}
    finally:
        wrapped.remove_hooks()
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
    _check(grads, _oracle(family, "grouped_mm", variant, 2), f"{family}/{variant}/GradSampleModule")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_trainable_experts_take_one_grouped_call(implementation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's experts get their per-sample gradients from per-sample copies of the experts
    in one grouped call (checked once against the module's own output), never N runs of the
    torch.func fallback."""
    from psg_core.grad_sample import experts as routed
    from psg_core.grad_sample import functorch_fallback

    def no_fallback(layer: nn.Module, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"torch.func fallback run for {type(layer).__name__}")

    monkeypatch.setattr(functorch_fallback, "functorch_layer_grad_sample", no_fallback)
    monkeypatch.setattr("psg_core.backends.capture.functorch_layer_grad_sample", no_fallback)
    monkeypatch.setattr(routed, "_CHECKED", {})
    model = _model("mixtral", implementation, "full")
    for n, p in model.named_parameters():
        p.requires_grad_("experts" in n)  # only the experts: every other layer would need the fallback
    try:
        inputs, labels = _batch(2 * N)
        grads = per_sample_gradients(model, inputs, labels, loss_fn=_loss, augmentation_multiplicity=2)
    finally:
        model.requires_grad_(True)
    expected = _oracle("mixtral", implementation, "full", 2)
    _check(grads, {n: g for n, g in expected.items() if n in grads}, f"mixtral/{implementation}/experts only")
    assert list(routed._CHECKED.values()) == [True]


@pytest.mark.parametrize("width", [4, 3])
def test_experts_whose_forward_is_not_the_grouped_one_run_per_sample(width: int, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """An experts class whose own forward computes something the grouped forward does not (here a
    per-expert output scale): the copies' outputs differ from the module's, so their gradients are
    not used, and the per-sample runs of the torch.func fallback give the oracle's. Rows of 12
    bytes, which the grouped kernel refuses (it wants 16-byte strides), go the same way."""
    from transformers.integrations.moe import use_experts_implementation

    from psg_core.grad_sample import experts as routed

    @use_experts_implementation
    class ScaledExperts(nn.Module):
        def __init__(self, config: object) -> None:
            super().__init__()
            self.num_experts, hidden, inner = 4, width, 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 2 * inner, hidden) * 0.5)
            self.down_proj = nn.Parameter(torch.randn(4, hidden, inner) * 0.5)
            self.scale = nn.Parameter(torch.rand(4) + 0.5)
            self.act_fn = torch.nn.functional.silu

        def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x)
            for k in range(index.shape[1]):
                gate, up = torch.einsum("rih,rh->ri", self.gate_up_proj[index[:, k]], x).chunk(2, dim=-1)
                h = torch.einsum("rhi,ri->rh", self.down_proj[index[:, k]], self.act_fn(gate) * up)
                out = out + h * (weights[:, k] * self.scale[index[:, k]])[:, None]
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(width, 4)
            self.experts = ScaledExperts(transformers.PretrainedConfig())
            self.experts.config._experts_implementation = "eager"
            self.head = nn.Linear(width, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, width)
            tokens = x.reshape(-1, width)
            weights, index = torch.softmax(self.router(tokens), -1).topk(2, dim=-1)
            mixed = self.experts(tokens, index, weights)
            return self.head(mixed.view(x.shape).mean(1))

    monkeypatch.setattr(routed, "_CHECKED", {})
    torch.manual_seed(0)
    model, K = Block(), 2
    x, y = torch.randn(N * K, 5, width), torch.randint(0, 2, (N * K,))
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: F.cross_entropy(out, t))
    for mode in ("hooks", "ghost"):
        if mode == "hooks":
            grads = per_sample_gradients(model, x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"),
                                         augmentation_multiplicity=K)
            for name, ref in expected.items():
                assert_close_scaled(grads[name], ref, name=name)
        else:
            reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=0.01)
            result = dp_gradient(model, x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"),
                                 config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.01))
            assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
            for name, ref in reference.grads.items():
                assert_close_scaled(result.grads[name], ref, name=name)
    # The scale is stacked by expert like the weights: the copies ran and differed (width 4), or the
    # grouped kernel refused them (width 3).
    assert list(routed._CHECKED.values()) == ([False] if width == 4 else [])


# ----------------------------------------------------------------------------- declared by the user
class SortedRows(nn.Module):
    """Scales each row by a frozen factor, computing in an order sorted by the rows' first feature
    (as routed experts do), then puts the rows back."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order = x[:, 0].argsort()
        done = torch.tanh(x[order]) * self.scale * weights[order]
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0])
        return done[back]


class Router(nn.Module):
    def __init__(self, rows: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.gate = nn.Linear(4, 1)
        self.rows = rows
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*K, T, 3)
        h = self.inp(x).reshape(-1, 4)  # token rows
        mixed = self.rows(h, torch.sigmoid(self.gate(h)))
        return self.out(mixed.view(x.shape[0], x.shape[1], 4).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_module_declared_row_wise(mode: str) -> None:
    """Undeclared, the sort is taken for mixing and refused; declared, the result is the oracle's."""

    class Undeclared(SortedRows):
        pass

    @psg_core.rowwise_module
    class Declared(SortedRows):
        pass

    K = 2
    x, y = torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,))
    with pytest.raises(UnsupportedModuleError, match="mix samples"):
        dp_gradient(Router(Undeclared()), x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"),
                    config=DPConfig(mode=mode, augmentation_multiplicity=K))
    torch.manual_seed(0)
    model = Router(Declared())
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: F.cross_entropy(out, t))
    reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=0.01)
    result = dp_gradient(model, x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"),
                         config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.01))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    for name, ref in reference.grads.items():
        assert_close_scaled(result.grads[name], ref, name=name)


def test_a_row_wise_module_given_other_rows_is_refused() -> None:
    @psg_core.rowwise_module
    class Declared(SortedRows):
        pass

    class Misfed(Router):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)  # (N*K, T, 4): the batch on axis 0, T entries per token row below
            mixed = self.rows(h.reshape(-1, 4), torch.sigmoid(self.gate(h)).transpose(0, 1).reshape(-1, 1))
            return self.out(mixed.view(x.shape[0], x.shape[1], 4).mean(1))

    x, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match="declared row-wise.*do not all hold the batch's rows on axis 0"):
        per_sample_gradients(Misfed(Declared()), x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_row_wise_module_with_trainable_parameters(mode: str) -> None:
    """Its own parameters: the torch.func fallback on each sample's rows gives the oracle's. A
    submodule's parameters, which its untracked call hides: refused, unless the class is a unit
    too (its subtree then computed as one call)."""

    @psg_core.rowwise_module
    class Trainable(SortedRows):
        def __init__(self) -> None:
            super().__init__()
            self.scale.requires_grad_(True)

    class WithInner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            order = x[:, 0].argsort()
            back = torch.empty_like(order)
            back[order] = torch.arange(order.shape[0])
            return (self.inner(x[order]) * weights[order])[back]

    hidden = psg_core.rowwise_module(type("Hidden", (WithInner,), {}))
    unit = psg_core.unit_module(psg_core.rowwise_module(type("Unit", (WithInner,), {})))
    K = 2
    x, y = torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,))
    loss = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(UnsupportedModuleError, match=r"row-wise and its submodules own trainable parameters "
                                                     r"\(inner\.weight, inner\.bias\).*psg_core\.unit_module"):
        dp_gradient(Router(hidden()), x, y, loss_fn=loss, config=DPConfig(mode=mode, augmentation_multiplicity=K))
    for rows in (Trainable, unit):
        torch.manual_seed(0)
        model = Router(rows())
        samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
        expected = microbatch_oracle(model, samples, lambda out, t: F.cross_entropy(out, t))
        reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=0.01)
        result = dp_gradient(model, x, y, loss_fn=loss,
                             config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.01))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
        for name, ref in reference.grads.items():
            assert_close_scaled(result.grads[name], ref, name=f"{rows.__name__} {name}")


class TiledExperts(nn.Module):
    """Llama 4's experts block in small: each token row tiled once per expert (``repeat`` along the
    rows), each copy scaled by its routing score and run through its expert (a ``bmm`` on the
    copies viewed ``(E, rows, d)``), the copies summed back; it takes ``(N*K, T, d)`` and returns
    ``(N*K*T, d)``, each batch row's T tokens flattened onto axis 0 (``flatten``), or one entry
    short of that (``short``: no whole multiple of the rows)."""

    def __init__(self, experts: int = 3, width: int = 4, how: str = "flatten") -> None:
        super().__init__()
        self.how = how
        self.router = nn.Linear(width, experts)
        self.weights = nn.Parameter(torch.randn(experts, width, width) / width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])  # (R, d), R = N*K*T
        scores = torch.sigmoid(self.router(rows))  # (R, E)
        tiled = rows.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)  # (E*R, d)
        out = torch.bmm(tiled.view(scores.shape[1], -1, rows.shape[1]), self.weights)  # (E, R, d)
        out = out.sum(0)
        return (out[:-1] if self.how == "short" else out), scores


class TiledBlock(nn.Module):
    def __init__(self, how: str = "flatten") -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.moe = psg_core.unit_module(psg_core.rowwise_module(type("Tiled", (TiledExperts,), {})))(how=how)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        h = self.inp(x)
        routed, _ = self.moe(h)
        if self.moe.how == "short":  # (N*K*T - 1, d): whose rows are which, psg cannot tell
            return self.out(torch.tanh(routed[:x.shape[0]]))
        return self.out(torch.tanh(h + routed.view(h.shape)).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_row_wise_module_that_flattens_each_rows_tokens(mode: str, K: int) -> None:
    """Its outputs' axis 0 is T times its input's: T entries per batch row (the oracle's gradients),
    not N*K*T rows."""
    torch.manual_seed(0)
    _check_sequence_block(TiledBlock(), mode, K)


def _check_sequence_block(model: nn.Module, mode: str, K: int) -> None:
    """``mode`` on a batch of (N*K, 5, 3) sequences equals the oracle (ghost: norms and clipped sum)."""
    x, y = torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,))
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: F.cross_entropy(out, t))
    if mode == "ghost":
        check_ghost_clipped(model, x, y, expected, K=K, loss=nn.CrossEntropyLoss(reduction="none"), bound=0.01)
    else:
        grads = per_sample_gradients(model, x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"), mode=mode,
                                     augmentation_multiplicity=K)
        for name, ref in expected.items():
            assert_close_scaled(grads[name], ref, name=name)


def test_a_row_wise_output_that_is_no_multiple_of_the_rows_is_refused() -> None:
    x, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    model = TiledBlock(how="short")
    with pytest.raises(UnsupportedModuleError, match=r"module 'out' \(Linear\) receives values that mix samples: "
                                                     r"module 'moe' \(Tiled\), declared row-wise, returns 19 entries on axis 0 "
                                                     r"for 4 batch rows"):
        per_sample_gradients(model, x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"))


class LoopedGLU(nn.Module):
    """DBRX's expert GLU in small: every expert's weights stacked in three parameters, called with
    one expert's slices of them."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w1 = nn.Parameter(torch.randn(experts * hidden, width) / width)
        self.v1 = nn.Parameter(torch.randn(experts * hidden, width) / width)
        self.w2 = nn.Parameter(torch.randn(experts * hidden, width) / hidden)

    def forward(self, x: torch.Tensor, w1: torch.Tensor, v1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ w1.T) * (x @ v1.T)) @ w2


class LoopedExperts(nn.Module):
    """DBRX's experts in small: the states come as ``(B, T, d)``, the routing as ``(B*T, k)``
    indices and weights (each input merges another number of entries into a batch row); a loop
    over the experts hit gathers each one's tokens, runs the child on its slices of the child's
    weights and scatters the rows back."""

    def __init__(self, experts: int = 3, width: int = 4, hidden: int = 5) -> None:
        super().__init__()
        self.experts, self.width, self.hidden = experts, width, hidden
        self.mlp = LoopedGLU(experts, width, hidden)

    def forward(self, states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        batch = states.shape[0]
        states = states.reshape(-1, self.width)
        out = torch.zeros_like(states)
        with torch.no_grad():
            mask = F.one_hot(index, num_classes=self.experts).permute(2, 1, 0)  # (E, k, B*T)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        shape = (-1, self.hidden, self.width)
        for expert in hit:
            expert = expert[0]
            with torch.no_grad():
                slot, token = torch.where(mask[expert])
            rows = self.mlp(states[token], self.mlp.w1.view(shape)[expert], self.mlp.v1.view(shape)[expert],
                            self.mlp.w2.view(shape)[expert])
            out.index_add_(0, token, rows * weights[token, slot, None])
        return out.view(batch, -1, self.width)


Looped = psg_core.unit_module(psg_core.rowwise_module(type("Looped", (LoopedExperts,), {})))


class LoopedBlock(nn.Module):
    def __init__(self, routing: str = "tokens") -> None:
        super().__init__()
        self.routing = routing
        self.inp = nn.Linear(3, 4)
        self.router = nn.Linear(4, 3, bias=False)
        self.moe = Looped()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        h = self.inp(x)
        logits = self.router(h.reshape(-1, 4))  # (N*K*T, E)
        weights, index = torch.softmax(logits, dim=1).topk(2, dim=-1)
        if self.routing == "short":  # the routing of one token fewer: no whole batch row per entry
            weights, index = weights[1:], index[1:]
            h = h.reshape(-1, 4)[1:]
        return self.out(torch.tanh(h + self.moe(h, index, weights).view(h.shape)).reshape(x.shape[0], -1, 4).mean(1)
                        if self.routing == "tokens" else self.moe(h, index, weights).sum(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_row_wise_module_whose_inputs_merge_different_entries_per_row(mode: str, K: int) -> None:
    """DBRX's experts take ``(N*K, T, d)`` states beside ``(N*K*T, k)`` routing: both hold the
    batch's N*K rows on axis 0 (one entry per row in the one, T in the other), which the row-wise
    call accepts; each sample's run of the unit (the fallback) gets its rows of each."""
    torch.manual_seed(0)
    _check_sequence_block(LoopedBlock(), mode, K)


def test_a_row_wise_module_whose_inputs_hold_different_rows_is_refused() -> None:
    """Routing for one token fewer than the states hold: no input's axis 0 is a whole number of
    batch rows that the others share, and the message says what each holds."""
    x, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match=r"module 'moe' \(Looped\) is declared row-wise.*do not all hold the "
                                                     r"batch's rows on axis 0 \(shape \(19, 4\): .*entries per row"):
        per_sample_gradients(LoopedBlock(routing="short"), x, y, loss_fn=nn.CrossEntropyLoss(reduction="none"))

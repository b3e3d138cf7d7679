"""clip_and_sum: factors, counts, per-layer budgets, automatic clipping, dtypes, empty batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psg_core.clipping import AUTOMATIC_STABILITY, FLAT_EPSILON, ClipResult, clip_and_sum
from psg_core.errors import ConfigError
from tests.devices import on_device


def scaled_rows(norms: list[float], dim: int = 4, *, seed: int = 0) -> torch.Tensor:
    """(N, dim) rows with exactly the given L2 norms."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(norms), dim, generator=g, dtype=torch.float64)  # (N, dim)
    rows = rows / rows.norm(dim=1, keepdim=True) * torch.tensor(norms, dtype=torch.float64)[:, None]
    return rows.float()


def reference(per_sample: dict[str, torch.Tensor], factors: torch.Tensor) -> dict[str, torch.Tensor]:
    """sum_n factors[n] * g[n] in float64; factors (N,) or (N, P)."""
    out = {}
    for i, (name, g) in enumerate(per_sample.items()):
        f = factors if factors.dim() == 1 else factors[:, i]
        out[name] = (f.double().reshape(-1, *[1] * (g.dim() - 1)) * g.double()).sum(0)
    return out


def assert_sums(result: ClipResult, expected: dict[str, torch.Tensor]) -> None:
    assert result.grads.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result.grads[name].double(), value, rtol=1e-5, atol=1e-6)


def test_flat_factor_count_and_sum() -> None:
    norms = [5.0, 0.5, 1.0, 2.0, 0.0]
    per_sample = {"w": scaled_rows(norms)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0)
    torch.testing.assert_close(result.per_sample_norms, torch.tensor(norms), atol=1e-6, rtol=1e-6)
    expected_factors = torch.tensor([min(1.0, 1.0 / (n + FLAT_EPSILON)) for n in norms])
    torch.testing.assert_close(result.clip_factors, expected_factors)
    # norm exactly C is not counted as clipped; only 5.0 and 2.0 are.
    assert result.num_clipped == 2
    assert_sums(result, reference(per_sample, expected_factors))


def test_flat_norm_spans_all_parameters() -> None:
    # each parameter alone is within C=1, together they are not: flat clipping must clip.
    per_sample = {"a": scaled_rows([0.8, 0.1], seed=1), "b": scaled_rows([0.8, 0.1], 3, seed=2).reshape(2, 3, 1)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0)
    total = math.hypot(0.8, 0.8)
    torch.testing.assert_close(result.per_sample_norms, torch.tensor([total, math.hypot(0.1, 0.1)]))
    assert result.num_clipped == 1
    assert result.grads["b"].shape == (3, 1)
    factors = torch.tensor([1.0 / (total + FLAT_EPSILON), 1.0])
    assert_sums(result, reference(per_sample, factors))
    clipped_first = torch.cat([result.grads[n].flatten() for n in result.grads])
    assert clipped_first.norm() <= 1.0 + math.hypot(0.1, 0.1) + 1e-5


def test_flat_clipped_samples_have_norm_at_most_c() -> None:
    torch.manual_seed(3)
    per_sample = {"w": torch.randn(6, 3, 2) * 4, "b": torch.randn(6, 2)}
    for n in range(6):
        single = {name: g[n:n + 1] for name, g in per_sample.items()}
        clipped = clip_and_sum(single, max_grad_norm=0.7)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in clipped.grads.values()))
        assert norm <= 0.7 + 1e-5


def test_per_layer_default_budget_keeps_total_norm_within_c() -> None:
    torch.manual_seed(4)
    per_sample = {"w": torch.randn(5, 4, 3) * 3, "b": torch.randn(5, 4) * 0.01, "v": torch.randn(5, 2) * 10}
    C = 2.0
    result = clip_and_sum(per_sample, max_grad_norm=C, clipping="per_layer")
    bound = C / math.sqrt(3)
    layer_norms = torch.stack([g.reshape(5, -1).norm(dim=1) for g in per_sample.values()], 1)  # (5, 3)
    expected = (bound / (layer_norms + FLAT_EPSILON)).clamp(max=1.0)
    torch.testing.assert_close(result.clip_factors, expected)
    assert_sums(result, reference(per_sample, expected))
    assert result.clip_factors.shape == (5, 3)
    assert result.num_clipped == int((layer_norms > bound).any(1).sum())
    torch.testing.assert_close(result.per_sample_norms, layer_norms.norm(dim=1))
    # each sample's clipped gradient: every layer within C/sqrt(P), so the whole within C.
    for n in range(5):
        single = clip_and_sum({k: g[n:n + 1] for k, g in per_sample.items()}, max_grad_norm=C,
                              clipping="per_layer")
        for g in single.grads.values():
            assert g.norm() <= bound + 1e-5
        assert math.sqrt(sum(float(g.pow(2).sum()) for g in single.grads.values())) <= C + 1e-5
    # "b" is tiny: it is never scaled.
    assert torch.all(result.clip_factors[:, 1] == 1.0)


def test_per_layer_explicit_bounds() -> None:
    per_sample = {"a": scaled_rows([3.0, 0.5]), "b": scaled_rows([3.0, 0.5], seed=1)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0, clipping="per_layer",
                          per_layer_max_grad_norms=(2.0, 0.25))
    expected = torch.tensor([[2.0 / (3.0 + FLAT_EPSILON), 0.25 / (3.0 + FLAT_EPSILON)],
                             [1.0, 0.25 / (0.5 + FLAT_EPSILON)]])
    torch.testing.assert_close(result.clip_factors, expected)
    assert result.num_clipped == 2  # sample 1 is clipped in "b" only: still counted
    assert_sums(result, reference(per_sample, expected))
    with pytest.raises(ConfigError, match="1 bounds for 2 trainable parameters"):
        clip_and_sum(per_sample, max_grad_norm=1.0, clipping="per_layer", per_layer_max_grad_norms=(1.0,))
    with pytest.raises(ConfigError, match="positive finite"):
        clip_and_sum(per_sample, max_grad_norm=1.0, clipping="per_layer", per_layer_max_grad_norms=(1.0, -1.0))
    with pytest.raises(ConfigError, match="only applies to clipping='per_layer'"):
        clip_and_sum(per_sample, max_grad_norm=1.0, per_layer_max_grad_norms=(1.0, 1.0))


def test_automatic_clipping_formula_and_count() -> None:
    norms = [5.0, 0.5, 0.995, 0.0]
    per_sample = {"w": scaled_rows(norms, 6)}
    C = 1.0
    result = clip_and_sum(per_sample, max_grad_norm=C, clipping="automatic")
    factors = torch.tensor([C / (n + AUTOMATIC_STABILITY) for n in norms])
    torch.testing.assert_close(result.clip_factors, factors)
    assert_sums(result, reference(per_sample, factors))
    # scaled down: norm + 0.01 > C, i.e. 5.0 and 0.995; 0.5 and 0.0 are scaled up (or stay 0).
    assert result.num_clipped == 2
    # every contribution has norm C * norm / (norm + 0.01) < C.
    contributions = factors[:, None] * per_sample["w"]
    assert torch.all(contributions.norm(dim=1) < C)
    torch.testing.assert_close(contributions.norm(dim=1)[0], torch.tensor(C * 5.0 / 5.01))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_norms_are_fp32_and_sums_keep_dtype(dtype: torch.dtype, device: torch.device) -> None:
    per_sample = {"w": scaled_rows([3.0, 0.25]).to(device, dtype),
                  "b": torch.full((2, 2), 0.5, dtype=dtype, device=device)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0)
    assert result.per_sample_norms.dtype == torch.float32
    assert result.clip_factors.dtype == torch.float32
    assert all(g.dtype == dtype and on_device(g, device) for g in result.grads.values())
    expected = torch.tensor([math.hypot(3.0, math.sqrt(0.5)), math.hypot(0.25, math.sqrt(0.5))], device=device)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(result.per_sample_norms, expected, rtol=tol, atol=tol)


def test_fp16_norm_does_not_overflow(device: torch.device) -> None:
    # 300^2 * 4 = 360000 > fp16 max (65504): the norm must be accumulated in fp32.
    per_sample = {"w": torch.full((1, 4), 300.0, dtype=torch.float16, device=device)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0)
    torch.testing.assert_close(result.per_sample_norms, torch.tensor([600.0], device=device))
    assert torch.isfinite(result.grads["w"]).all()


@pytest.mark.parametrize("C", [1e-2, 1e-3, 1e-5])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_sums_multiply_and_add_in_float32(dtype: torch.dtype, clipping: str, C: float,
                                                         device: torch.device) -> None:
    """A clipping factor cast to float16 is subnormal below ~6e-5 and 0 below ~6e-8 (bf16 keeps
    8 bits of it): 4 identical samples of norm 6e3 summed to 1.1 x N*C at C=1e-3 and to 0 at
    C=1e-4. The factors multiply in float32 and the sum is cast to the gradients' dtype once:
    the float64 sum of the float32 factors times the half-precision rows, to its rounding."""
    per_sample = {"w": scaled_rows([6000.0], 64).repeat(4, 1).to(device, dtype)}
    result = clip_and_sum(per_sample, max_grad_norm=C, clipping=clipping)
    assert result.grads["w"].dtype == dtype
    expected = reference(per_sample, result.clip_factors)["w"]  # float64
    eps = torch.finfo(dtype).eps  # the result is the float32 sum rounded to nearest: half a unit
    torch.testing.assert_close(result.grads["w"].double(), expected, rtol=0.5 * eps + 1e-6,
                               atol=0.5 * torch.finfo(dtype).tiny * eps * (1 + 1e-3))
    assert float(result.grads["w"].double().norm()) == pytest.approx(4 * C, rel=2e-3)  # each sample C


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_empty_batch_gives_zeros(clipping: str, device: torch.device) -> None:
    per_sample = {"w": torch.zeros(0, 3, 2, device=device), "b": torch.zeros(0, 3, device=device)}
    result = clip_and_sum(per_sample, max_grad_norm=1.0, clipping=clipping)
    assert result.per_sample_norms.shape == (0,) and result.per_sample_norms.dtype == torch.float32
    assert result.num_clipped == 0
    assert result.grads["w"].shape == (3, 2) and result.grads["b"].shape == (3,)
    assert on_device(result.per_sample_norms, device) and all(on_device(g, device) for g in result.grads.values())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in result.grads.values())


def test_zero_gradient_gives_no_nan(device: torch.device) -> None:
    for clipping in ("flat", "per_layer", "automatic"):
        result = clip_and_sum({"w": torch.zeros(3, 2, device=device)}, max_grad_norm=0.5, clipping=clipping)
        assert torch.equal(result.grads["w"], torch.zeros(2, device=device))
        assert result.num_clipped == 0


def test_validation_errors_name_the_value() -> None:
    good = {"w": torch.ones(2, 3)}
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ConfigError, match="clip_and_sum: max_grad_norm"):
            clip_and_sum(good, max_grad_norm=bad)
    with pytest.raises(ConfigError, match="'flat', 'per_layer', 'automatic'.*'l2'"):
        clip_and_sum(good, max_grad_norm=1.0, clipping="l2")
    with pytest.raises(ConfigError, match="disagree on N"):
        clip_and_sum({"w": torch.ones(2, 3), "b": torch.ones(3, 3)}, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="non-empty dict"):
        clip_and_sum({}, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"per_sample\['w'\] must be a floating tensor"):
        clip_and_sum({"w": torch.ones(2, 3, dtype=torch.int64)}, max_grad_norm=1.0)


# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 6), shapes=st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=2),
                                            min_size=1, max_size=3),
       clipping=st.sampled_from(["flat", "per_layer", "automatic"]), C=st.floats(0.05, 5.0),
       scale=st.floats(0.01, 20.0), seed=st.integers(0, 2**16))
def test_matches_float64_reference(n: int, shapes: list[list[int]], clipping: str, C: float, scale: float,
                                   seed: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(seed)
    per_sample = {f"p{i}": (torch.randn(n, *shape, generator=g) * scale).to(device) for i, shape in enumerate(shapes)}
    result = clip_and_sum(per_sample, max_grad_norm=C, clipping=clipping)
    layer_norms = torch.stack([t.double().reshape(n, math.prod(t.shape[1:])).norm(dim=1)
                               for t in per_sample.values()], 1)
    norms = layer_norms.norm(dim=1)  # (N,)
    if clipping == "flat":
        factors = (C / (norms + FLAT_EPSILON)).clamp(max=1.0)
        clipped = int((norms > C).sum())
    elif clipping == "automatic":
        factors = C / (norms + AUTOMATIC_STABILITY)
        clipped = int((factors < 1).sum())
    else:
        bound = C / math.sqrt(len(shapes))
        factors = (bound / (layer_norms + FLAT_EPSILON)).clamp(max=1.0)
        clipped = int((layer_norms > bound).any(1).sum())
    torch.testing.assert_close(result.per_sample_norms.double(), norms, rtol=1e-5, atol=1e-6)
    assert result.num_clipped == clipped
    expected = reference(per_sample, factors)
    for name, value in expected.items():
        torch.testing.assert_close(result.grads[name].double(), value, rtol=1e-4, atol=1e-5 * max(1.0, C * n))

"""The Hugging Face sweep (``python -m tests.core.hf_sweep``) on a few types, and its verdicts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.core import hf_sweep  # noqa: E402  (after the skip: the sweep imports transformers)


@pytest.mark.parametrize("model_type, K", [("bert", 1), ("flaubert", 2), ("canine", 2)])
def test_sweep_types_match_the_oracle(model_type: str, K: int) -> None:
    """BERT; Flaubert (its position table expanded as the embeddings: a meeting point); CANINE
    (its float64 run is not finite: the float32 oracle); K copies of each sample."""
    line = hf_sweep.sweep_type(model_type, K=K)
    assert (line["hooks"], line["ghost"]) == ("ok", "ok"), line
    assert line["oracle"].startswith("float32" if model_type == "canine" else "float64")


# vmap runs wav2vec2's positional convolution's attention without a batching rule (a warning)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("task, model_type", [
    ("causal-lm", "falcon_mamba"),  # a mixer convolving with its child's conv1d.weight: met per row
    ("image", "swin"),  # shifted windows merged with the batch; per-stage options (an override)
    ("audio", "wav2vec2"),  # raw waveforms through a convolutional feature encoder
    ("token", "bert"),  # a label per token, padding -100
])
def test_other_tasks_match_the_oracle(task: str, model_type: str) -> None:
    line = hf_sweep.sweep_type(model_type, K=2, task=task)
    assert (line["hooks"], line["ghost"]) == ("ok", "ok"), line
    assert line["oracle"] == "float64"


@pytest.mark.parametrize("task, model_type, oracle", [
    ("causal-lm", "dbrx", "float64"),  # experts given (B, T, d) states beside (B*T, k) routing
    ("causal-lm", "longcat_flash", "float64"),  # a loop over the experts hit, zero-compute experts
    ("causal-lm", "deepseek_v4", "float32"),  # hash routing: a buffer looked up by the input ids
    ("causal-lm", "recurrent_gemma", "float64"),  # module state; an autograd.Function without setup_context
    ("causal-lm", "jetmoe", "float64"),  # routers that sort the tokens, in the attention and the MLP
    ("causal-lm", "cpmant", "float64"),  # positions tiled once per batch row, viewed with their batch size
    ("causal-lm", "inkling_text", "float32"),  # a router returning its integer top-k between its weights
    ("causal-lm", "qwen4_exp", "float32"),  # a sparse-attention indexer looping over the batch's rows
    ("audio", "sew-d", "float64"),  # autograd.Functions without setup_context
    ("sequence", "gpt_oss", "float32"),  # the cache on (the default): an empty cache left out of the per-sample runs
])
def test_types_once_refused_match_the_oracle(task: str, model_type: str, oracle: str) -> None:
    line = hf_sweep.sweep_type(model_type, K=2, task=task)
    assert (line["hooks"], line["ghost"]) == ("ok", "ok"), line
    assert line["oracle"].startswith(oracle), line


@pytest.mark.parametrize("task, model_type", [
    ("sequence", "longformer"),  # a row-wise unit whose attention drops its probabilities: replayed
    ("audio", "wavlm"),  # a unit (F.multi_head_attention_forward) with dropout, and SpecAugment
    ("sequence", "bert"),  # dropout in layers with grad samplers only
    ("sequence", "phimoe"),  # a router drawing Gumbel noise through an autograd.Function without setup_context
])
def test_training_mode_with_dropout_matches_the_seeded_oracle(task: str, model_type: str) -> None:
    line = hf_sweep.sweep_type(model_type, K=2, task=task, train=True)
    assert (line["hooks"], line["ghost"]) == ("ok", "ok"), line
    assert line["oracle"] == "float32, training mode"


def test_training_mode_catches_per_sample_runs_that_draw_other_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the replay of the call's random draws switched off (each sample's run draws its own
    masks, as before), the training-mode check reports the per-sample gradients WRONG."""
    import psg_core.backends.capture as capture

    monkeypatch.setattr(capture, "rng_changed", lambda snapshot: False)
    line = hf_sweep.sweep_type("longformer", K=2, train=True)
    assert line["hooks"].startswith("WRONG: off") and "(of its tensor, train mode)" in line["hooks"], line


def test_a_model_ill_conditioned_in_float32_is_checked_in_float64() -> None:
    """BiT's weight standardisation (eps 1e-8) puts float32 runs 3% from the float64 oracle, psg's and
    the oracle's own alike: hooks is then run on a float64 copy and equals the oracle to 1e-9."""
    line = hf_sweep.sweep_type("bit", modes=("hooks",), task="image")
    assert line["hooks"].startswith("ok in float64 (float32 rounding"), line


def test_the_sweep_tells_wrong_and_non_finite_values() -> None:
    expected = {"w": torch.tensor([[1.0, -2.0]], dtype=torch.float64), "b": torch.zeros(1, 3, dtype=torch.float64)}
    assert hf_sweep.compare({"w": expected["w"].float(), "b": torch.zeros(1, 3)}, expected) == 0.0
    assert hf_sweep.compare({"w": torch.tensor([[1.0, -2.1]]), "b": torch.zeros(1, 3)}, expected) \
        == pytest.approx(0.05)
    assert hf_sweep.compare({"w": torch.tensor([[1.0, float("nan")]]), "b": torch.zeros(1, 3)}, expected) is None
    assert hf_sweep.compare({"w": expected["w"].float(), "b": torch.zeros(1, 3)},
                            {**expected, "b": torch.full((1, 3), float("inf"), dtype=torch.float64)}) is None


def test_the_sweep_reports_a_wrong_result_and_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """An oracle off in one entry (half the largest): both modes WRONG, and main's status is 1."""
    real = hf_sweep._oracle

    def shifted(*args: object) -> tuple[dict[str, torch.Tensor], str]:
        oracle, kind = real(*args)  # type: ignore[arg-type]
        name = next(iter(oracle))
        oracle[name] = oracle[name].clone()
        oracle[name][0].view(-1)[0] += 0.5 * max(float(g.abs().max()) for g in oracle.values())
        return oracle, kind

    monkeypatch.setattr(hf_sweep, "_oracle", shifted)
    line = hf_sweep.sweep_type("bert")
    assert line["hooks"].startswith("WRONG") and line["ghost"].startswith("WRONG"), line
    monkeypatch.setattr(hf_sweep, "_in_its_own_process", lambda model_type, timeout, memory_gib, K, task, train:
                        hf_sweep.sweep_type(model_type, K=K, task=task, train=train))
    assert hf_sweep.main(["bert"]) == 1
    assert "WRONG 2" in capsys.readouterr().out


def _verdict(line: dict[str, str]) -> str:
    return "skipped" if "skipped" in line else line["hooks"].split(" ")[0]


@pytest.mark.parametrize("stdout, verdict", [
    ('{"type": "x", "stage": "psg"}\n', "ERROR"),  # died once psg ran: psg's
    ("", "skipped"),  # died building the model or its oracle
])
def test_a_process_that_dies_or_hangs_is_judged_by_where(stdout: str, verdict: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -11, stdout, "Segmentation fault"))
    line = hf_sweep._in_its_own_process("x", 10.0, 1.0)
    assert _verdict(line) == verdict, line
    assert "status -11" in str(line)

    def hangs(*args: object, **kwargs: object) -> None:
        raise subprocess.TimeoutExpired(args, 10.0, output=stdout.encode())

    monkeypatch.setattr(subprocess, "run", hangs)
    line = hf_sweep._in_its_own_process("x", 10.0, 1.0)
    assert _verdict(line) == verdict, line
    assert "over 10 s" in str(line)

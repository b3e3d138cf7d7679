"""The demo: its augmentations, its loop in-process (benchmarks/demo_k.py) and through a real server,
sigma chosen by the server for a target epsilon, K = 1 against K > 1, and its plot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from psg_client.demo import main, run_demo
from psg_client.demo_training import AUGMENTATIONS, Augmentation, Recipe, augment
from psg_server.background import BackgroundServer
from psg_server.config import ServerConfig


def _own_pixels(copy: torch.Tensor, sample: torch.Tensor, background: float) -> bool:
    return set(copy.flatten().tolist()) <= set(sample.flatten().tolist()) | {background}


def test_augment_keeps_sample_major_rows() -> None:
    images = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4) + 1
    out = augment(images, 3, torch.Generator().manual_seed(0), augmentation=AUGMENTATIONS["shift"],
                  background=-1.0)
    assert out.shape == (6, 1, 4, 4)
    # whole-pixel shifts: every copy holds pixels of its own sample (or the background) only
    for row in range(6):
        assert _own_pixels(out[row], images[row // 3], -1.0), row
    assert not torch.equal(out, images.repeat_interleave(3, dim=0))  # something moved


def test_augment_none_copies_and_keep_original() -> None:
    images = torch.randn(3, 1, 8, 8)
    generator = torch.Generator().manual_seed(1)
    torch.testing.assert_close(augment(images, 2, generator, augmentation=AUGMENTATIONS["none"]),
                               images.repeat_interleave(2, dim=0))
    kept = augment(images, 4, generator, augmentation=Augmentation(max_rotation=20.0, keep_original=True))
    torch.testing.assert_close(kept[::4], images)
    assert not torch.allclose(kept[1::4], images)
    assert augment(images[:0], 4, generator, augmentation=AUGMENTATIONS["affine"]).shape == (0, 1, 8, 8)


@pytest.mark.parametrize("name", sorted(AUGMENTATIONS))
def test_every_augmentation_fills_with_the_background(name: str) -> None:
    blank = torch.full((2, 1, 8, 8), -1.0)
    out = augment(blank, 2, torch.Generator().manual_seed(0), augmentation=AUGMENTATIONS[name], background=-1.0)
    if AUGMENTATIONS[name].noise_std:
        assert abs(float(out.mean()) + 1.0) < 0.2
    else:
        torch.testing.assert_close(out, torch.full((4, 1, 8, 8), -1.0))


def test_baselines_of_a_recipe() -> None:
    assert Recipe().with_baselines() == [Recipe()]
    assert [r.label() for r in Recipe("affine", 4).with_baselines()] == ["K=1 none", "K=1 affine", "K=4 affine"]
    assert [r.label() for r in Recipe("none", 4).with_baselines()] == ["K=1 none", "K=4 none"]
    assert all(r.epochs == 7 for r in Recipe("noise", 2, epochs=7).with_baselines())


def test_in_process_run_spends_the_target_epsilon() -> None:
    from benchmarks.demo_k import run_in_process

    recipe = Recipe("affine", 2, epochs=2, learning_rate=0.5, batch_size=256)
    result = run_in_process(recipe, seed=0, target_epsilon=3.0)
    assert result.steps == 2 * 6 and len(result.test_accuracy) == 2
    assert 0 < result.epsilon[0] < result.epsilon[1] <= 3.0 and result.epsilon[1] > 2.7
    assert result.noise_multiplier > 0 and all(loss > 0 for loss in result.train_loss)


def test_service_run_gets_the_calibrated_sigma(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.demo_k import run_in_process

    recipe = Recipe("none", 1, epochs=1, batch_size=256)
    with BackgroundServer(ServerConfig(port=0)) as server:
        result = run_demo(server.target, recipe, target_epsilon=3.0, delta=1e-5, backend="hooks", seed=0,
                          quiet=True)
    local = run_in_process(recipe, seed=0, target_epsilon=3.0)
    assert f"the server chose sigma = {result.noise_multiplier:.3f} for epsilon 3" in capsys.readouterr().out
    # the server calibrates as psg_core does in-process (same accountant, same plan)
    assert result.noise_multiplier == pytest.approx(local.noise_multiplier, abs=1e-3)
    assert result.epsilon[-1] == pytest.approx(local.epsilon[-1], rel=1e-3)
    assert result.epsilon[-1] <= 3.0


def test_demo_compares_k_with_k1_and_writes_its_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "demo.png"
    with BackgroundServer(ServerConfig(port=0)) as server:
        status = main(["--target", server.target, "--epochs", "2", "--epsilon", "30", "--augmentation", "affine",
                       "-K", "2", "--plot", str(plot), "--quiet", "--min-accuracy", "0.3"])
    out = capsys.readouterr().out
    assert status == 0, out
    runs = ["K=1 none", "K=1 affine", "K=2 affine"]
    chosen = re.findall(r"(K=\d \w+): the server chose sigma = ([\d.]+) for epsilon 30", out)
    assert [label for label, _ in chosen] == runs, out
    assert len({sigma for _, sigma in chosen}) == 1  # same epsilon, same plan: same sigma
    finals = re.findall(r"(K=\d \w+): \d+ DP steps .* test accuracy ([\d.]+), epsilon ([\d.]+)", out)
    assert [label for label, _, _ in finals] == runs, out
    assert all(float(accuracy) >= 0.3 and 25 < float(epsilon) <= 30 for _, accuracy, epsilon in finals)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_demo_is_one_k1_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with BackgroundServer(ServerConfig(port=0)) as server:
        status = main(["--target", server.target, "--epochs", "1", "--plot", str(tmp_path / "k1.png"), "--quiet",
                       "--min-accuracy", "0"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert re.findall(r"(K=\d \w+): the server chose sigma = [\d.]+ for epsilon 4 at delta 1e-05", out) == ["K=1 none"]


@pytest.mark.parametrize("backend", ["hooks", "ghost"])
def test_demo_without_baseline_trains_the_given_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       backend: str) -> None:
    plot = tmp_path / "one.png"
    with BackgroundServer(ServerConfig(port=0)) as server:
        status = main(["--target", server.target, "--epochs", "2", "--epsilon", "30", "-K", "2", "--augmentation",
                       "noise", "--no-baseline", "--backend", backend, "--plot", str(plot), "--quiet",
                       "--min-accuracy", "0.3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert re.findall(r"(K=\d \w+): the server chose sigma", out) == ["K=2 noise"], out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_loudly_without_a_server(tmp_path: Path) -> None:
    status = main(["--target", "127.0.0.1:1", "--epochs", "1", "--quiet", "--server-timeout", "1",
                   "--plot", str(tmp_path / "x.png")])
    assert status == 1

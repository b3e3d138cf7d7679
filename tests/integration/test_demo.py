"""The demo trains above chance through a real server and writes its plot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psg_client.demo import augment, main
from psg_server.background import BackgroundServer
from psg_server.config import ServerConfig


def test_augment_keeps_sample_major_rows() -> None:
    images = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)
    out = augment(images, 3, torch.Generator().manual_seed(0))
    assert out.shape == (6, 1, 4, 4)
    torch.testing.assert_close(out[0], images[0])  # first copy = original
    torch.testing.assert_close(out[3], images[1])
    # shifted copies only contain pixels of their own sample (or zero fill)
    for row in (1, 2):
        assert set(out[row].flatten().tolist()) <= set(images[0].flatten().tolist()) | {0.0}


@pytest.mark.parametrize("backend", ["hooks", "ghost"])
def test_demo_trains_above_chance(tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str) -> None:
    plot = tmp_path / "demo.png"
    with BackgroundServer(ServerConfig(port=0)) as server:
        status = main(["--target", server.target, "--epochs", "2", "--noise", "0.3", "--backend", backend,
                       "--plot", str(plot), "--quiet", "--min-accuracy", "0.3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "test accuracy" in out and "epsilon" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_loudly_without_a_server(tmp_path: Path) -> None:
    status = main(["--target", "127.0.0.1:1", "--epochs", "1", "--quiet", "--server-timeout", "1",
                   "--plot", str(tmp_path / "x.png")])
    assert status == 1

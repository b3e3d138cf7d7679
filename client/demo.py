"""``psg-demo``: DP-SGD training through the gradient service, end to end.

Starts ``psg-server`` with an embedded Ray pool on a free loopback port (or uses ``--target``),
waits for it to report SERVING, then trains a classifier on scikit-learn's bundled digits data
set (8x8 images, no download) through the service: Poisson sampling, K augmented copies per
sample (random one-pixel shifts), per-sample clipping, Gaussian noise and epsilon accounting at
delta = 1e-5. Prints test accuracy and final epsilon, writes a PNG plot, and exits non-zero on
any failure (including accuracy below ``--min-accuracy``).

    psg-demo --epochs 10 --augmentations 2 --noise 1.1 --backend hooks
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from psg_client.client import GradientClient, Session
from psg_core.architectures import cnn_groupnorm
from psg_core.config import DPConfig
from psg_core.sampling import PoissonBatchSampler

__all__ = ["DemoResult", "main", "run_demo"]

logger = logging.getLogger("psg_demo")

_IMAGE = 8
_CLASSES = 10
_MODEL = "cnn_groupnorm"
_MODEL_KWARGS: dict[str, Any] = {"in_channels": 1, "image_size": _IMAGE, "channels": (16, 32), "groups": 4,
                                 "num_classes": _CLASSES}


@dataclass
class DemoResult:
    """What one demo run measured, per epoch and at the end."""

    test_accuracy: list[float] = field(default_factory=list)
    epsilon: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0


def _load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.int64)  # (1797,)
    images = (images - 0.5) / 0.5
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def augment(images: torch.Tensor, augmentation_multiplicity: int, generator: torch.Generator) -> torch.Tensor:
    """``(N, C, H, W) -> (N*K, C, H, W)``: K copies per sample, each shifted by up to one pixel.

    Rows are sample-major (copies of sample n are rows n*K .. n*K+K-1), as psg expects. The first
    copy is the original image, the others random shifts with zero fill.
    """
    K = augmentation_multiplicity
    copies = images.repeat_interleave(K, dim=0)  # (N*K, C, H, W)
    padded = nn.functional.pad(copies, (1, 1, 1, 1))  # (N*K, C, H+2, W+2)
    shifts = torch.randint(0, 3, (copies.shape[0], 2), generator=generator)  # (N*K, 2)
    shifts[::K] = 1  # the original
    height, width = images.shape[-2:]
    out = torch.empty_like(copies)
    for row, (dy, dx) in enumerate(shifts.tolist()):
        out[row] = padded[row, :, dy:dy + height, dx:dx + width]
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(target: str, timeout: float) -> None:
    """Blocks until the server's grpc.health.v1 answers SERVING, or raises TimeoutError."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                last = err.code().name
            time.sleep(0.25)
    raise TimeoutError(f"psg-demo: the server at {target} was not SERVING after {timeout:.0f} s (last: {last})")


@contextlib.contextmanager
def local_server(workers: int, timeout: float) -> Iterator[str]:
    """Runs ``psg-server`` (embedded Ray pool) as a child process; yields its target."""
    port = _free_port()
    command = [sys.executable, "-m", "psg_server", "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(workers), "--cpus-per-worker", "1"]
    logger.info("psg-demo: starting %s", " ".join(command))
    # gRPC's C core logs fork notices at INFO when Ray forks workers: keep the demo's output readable.
    env = {"GRPC_VERBOSITY": "ERROR", **os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, env=env)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, timeout)
        yield target
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).sum().item()
    model.train()
    return correct / max(1, len(labels))


def _train_epoch(session: Session, model: nn.Module, optimizer: torch.optim.Optimizer,
                 images: torch.Tensor, labels: torch.Tensor, sampler: PoissonBatchSampler, K: int,
                 generator: torch.Generator, progress: object) -> tuple[float, float, int]:
    losses, epsilon, steps = [], 0.0, 0
    for indices in sampler:
        index = torch.as_tensor(indices, dtype=torch.int64)
        inputs = augment(images[index], K, generator)  # (n*K, 1, 8, 8)
        targets = labels[index].repeat_interleave(K)  # (n*K,)
        session.push_parameters(model)
        result = session.compute_gradients(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        result.apply_to(model)
        optimizer.step()
        if result.samples:
            losses.append(result.mean_loss)
        epsilon = result.epsilon_spent
        steps += 1
        progress.update(1)  # type: ignore[attr-defined]
        progress.set_postfix(loss=f"{result.mean_loss:.3f}", eps=f"{epsilon:.2f}")  # type: ignore[attr-defined]
    return (sum(losses) / len(losses) if losses else math.nan), epsilon, steps


def run_demo(target: str, *, epochs: int, augmentation_multiplicity: int, noise_multiplier: float,
             max_grad_norm: float, batch_size: int, learning_rate: float, backend: str, delta: float,
             seed: int, quiet: bool = False) -> DemoResult:
    """Trains through the service at ``target``; returns per-epoch accuracy and epsilon."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    train_x, train_y, test_x, test_y = _load_digits(seed)
    sample_rate = batch_size / len(train_y)
    model = cnn_groupnorm(**_MODEL_KWARGS)  # the architecture the server builds as _MODEL
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=0.9)
    config = DPConfig(mode=backend, augmentation_multiplicity=augmentation_multiplicity,
                      max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier)
    generator = torch.Generator().manual_seed(seed)
    result = DemoResult()
    start = time.monotonic()
    steps_per_epoch = max(1, round(1 / sample_rate))
    with GradientClient(target) as client:
        session = client.create_session(_MODEL, model_kwargs=_MODEL_KWARGS, loss="cross_entropy",
                                        expected_batch_size=batch_size, config=config,
                                        sample_rate=sample_rate, delta=delta, seed=seed)
        with session, tqdm(total=epochs * steps_per_epoch, disable=quiet, unit="step",
                           desc="psg-demo") as progress:
            for epoch in range(epochs):
                sampler = PoissonBatchSampler(len(train_y), sample_rate, num_batches=steps_per_epoch,
                                              generator=torch.Generator().manual_seed(seed * 1000 + epoch))
                loss, epsilon, steps = _train_epoch(session, model, optimizer, train_x, train_y, sampler,
                                                    augmentation_multiplicity, generator, progress)
                accuracy = _accuracy(model, test_x, test_y)
                result.train_loss.append(loss)
                result.epsilon.append(epsilon)
                result.test_accuracy.append(accuracy)
                result.steps += steps
                progress.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.3f}", eps=f"{epsilon:.2f}")
    result.seconds = time.monotonic() - start
    return result


def plot(result: DemoResult, path: Path, *, title: str) -> None:
    """Writes accuracy and epsilon per epoch side by side as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = list(range(1, len(result.test_accuracy) + 1))
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, result.test_accuracy, marker="o")
    left.axhline(1 / _CLASSES, color="grey", linestyle="--", label="chance")
    left.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1), title="accuracy")
    left.legend()
    right.plot(epochs, result.epsilon, marker="o", color="tab:red")
    right.set(xlabel="epoch", ylabel="epsilon (delta = 1e-5)", title="privacy spent")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    # Every help ends with its default; argparse fills in %(default)s.
    # Raw description: argparse's wrapping would break "psg-server" at its hyphen.
    parser = argparse.ArgumentParser(
        prog="psg-demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DP-SGD training through the psg gradient service, end to end.\n\n"
                    "Starts psg-server with an embedded Ray pool (or uses --target), trains a small\n"
                    "CNN on scikit-learn's digits with Poisson sampling, K augmented copies per\n"
                    "sample, per-sample clipping and Gaussian noise, then prints the test accuracy\n"
                    "and epsilon and writes a plot.",
        epilog="example: psg-demo --epochs 10 --augmentations 2 --noise 1.1 --backend hooks")
    add = parser.add_argument
    add("--target", metavar="HOST:PORT",
        help="use a running server instead of starting one (default: start one)")
    add("--workers", type=int, default=2, metavar="N",
        help="Ray workers of the started server (default: %(default)s)")
    add("--backend", default="hooks", choices=["hooks", "functorch", "ew", "ghost"],
        help="per-sample gradient backend (default: %(default)s)")
    add("--augmentations", "-K", type=int, default=2, metavar="K",
        help="augmented copies per sample (default: %(default)s)")
    add("--epochs", type=int, default=10, metavar="N", help="training epochs (default: %(default)s)")
    add("--noise", type=float, default=1.1, metavar="SIGMA",
        help="noise multiplier sigma (default: %(default)s)")
    add("--max-grad-norm", type=float, default=1.0, metavar="C",
        help="per-sample clipping bound C (default: %(default)s)")
    add("--batch-size", type=int, default=128, metavar="N",
        help="expected (Poisson) batch size (default: %(default)s)")
    add("--lr", type=float, default=0.5, help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    add("--delta", type=float, default=1e-5, help="delta of the reported epsilon (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of the data split, sampling and noise (default: %(default)s)")
    add("--plot", type=Path, default=Path("psg-demo.png"), metavar="PATH",
        help="where the PNG plot goes (default: %(default)s)")
    add("--min-accuracy", type=float, default=0.5, metavar="FRACTION",
        help="exit non-zero when the final test accuracy is below this (default: %(default)s)")
    add("--server-timeout", type=float, default=120.0, metavar="SECONDS",
        help="how long the started server may take to report SERVING (default: %(default)s)")
    add("--quiet", action="store_true", help="no progress bar (default: show it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``psg-demo``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with contextlib.ExitStack() as stack:
            target = args.target or stack.enter_context(local_server(args.workers, args.server_timeout))
            result = run_demo(target, epochs=args.epochs, augmentation_multiplicity=args.augmentations,
                              noise_multiplier=args.noise, max_grad_norm=args.max_grad_norm,
                              batch_size=args.batch_size, learning_rate=args.lr, backend=args.backend,
                              delta=args.delta, seed=args.seed, quiet=args.quiet)
        plot(result, args.plot, title=f"psg demo: digits, K={args.augmentations}, sigma={args.noise}, "
                                      f"C={args.max_grad_norm}, {args.backend}")
    except Exception:  # noqa: BLE001 - the demo's contract is a non-zero exit on any failure
        logger.exception("psg-demo: failed")
        return 1
    accuracy, epsilon = result.test_accuracy[-1], result.epsilon[-1]
    print(f"psg-demo: {result.steps} DP steps in {result.seconds:.1f} s; test accuracy {accuracy:.3f}, "
          f"epsilon {epsilon:.2f} at delta {args.delta:g}; plot written to {args.plot}")
    if not accuracy >= args.min_accuracy:
        print(f"psg-demo: test accuracy {accuracy:.3f} is below --min-accuracy {args.min_accuracy}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

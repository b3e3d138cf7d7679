"""``psg-demo``: DP-SGD training through the gradient service, end to end, at a target epsilon.

Starts ``psg-server`` with an embedded Ray pool on a free loopback port (or uses ``--target``),
waits for it to report SERVING, then trains a small GroupNorm CNN on scikit-learn's bundled
digits (8x8 images, no download) through the service. Each run opens a session with a target
epsilon, delta, sampling rate and number of epochs; the server chooses the noise multiplier sigma
that spends that budget over the plan (printed), and every step does Poisson sampling, per-sample
clipping, Gaussian noise and epsilon accounting. The demo prints test accuracy and epsilon of each
run, writes a PNG (test accuracy, training loss and epsilon per epoch, the target epsilon line) and
exits non-zero on any failure (including accuracy below ``--min-accuracy``).

By default it trains the recipe ``benchmarks/demo_k.py`` measured best on this data: K = 1 without
augmentation (no K > 1 beat it; the README's "What the demo shows" has the table). Given K > 1 or
an augmentation it trains, with the same seed and epsilon, K = 1 without augmentation, K = 1 with
the augmentation and K copies with it, and plots them side by side:

    psg-demo --epsilon 4 --epochs 20 --augmentation affine -K 4 --backend hooks
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from psg_client.client import GradientClient
from psg_core.architectures import cnn_groupnorm
from psg_core.config import DPConfig
from psg_core.sampling import PoissonBatchSampler

__all__ = ["AUGMENTATIONS", "Augmentation", "DemoResult", "Digits", "Recipe", "augment", "load_digits",
           "main", "run_demo", "train"]

logger = logging.getLogger("psg_demo")

_IMAGE = 8
_CLASSES = 10
_MODEL = "cnn_groupnorm"
MODEL_KWARGS: dict[str, Any] = {"in_channels": 1, "image_size": _IMAGE, "channels": (16, 32), "groups": 4,
                                "num_classes": _CLASSES}
#: SGD momentum of every run.
MOMENTUM = 0.9
#: The accountant that calibrates sigma and reports epsilon: PLD, the tighter one (a smaller sigma
#: for the same target), and the one benchmarks/demo_k.py's in-process runs use.
ACCOUNTANT = "pld"


@dataclass(frozen=True)
class Recipe:
    """How one run trains; every run of a comparison spends the same epsilon.

    The defaults are the demo's: the schedule benchmarks/demo_k.py found best at epsilon 4 (single
    seed, then checked over three more), with K = 1 and no augmentation, which no K > 1 with any of
    :data:`AUGMENTATIONS` beat on this data (README, "What the demo shows").
    """

    augmentation: str = "none"
    augmentation_multiplicity: int = 1
    epochs: int = 20
    learning_rate: float = 1.0
    #: Expected (Poisson) batch size: the sampling rate is ``batch_size / 1437``.
    batch_size: int = 256
    #: "cosine": the learning rate decays to 0 along a half cosine over the run (the last epochs
    #: average the noise out instead of jumping around); "constant".
    lr_schedule: str = "cosine"
    max_grad_norm: float = 1.0

    def label(self) -> str:
        """``"K=4 affine"``, ``"K=1 none"``."""
        return f"K={self.augmentation_multiplicity} {self.augmentation}"

    def with_baselines(self) -> list[Recipe]:
        """The runs that show what K does: K = 1 without augmentation, K = 1 with this recipe's
        augmentation, and this recipe (those that differ, in that order)."""
        runs = [dataclasses.replace(self, augmentation="none", augmentation_multiplicity=1),
                dataclasses.replace(self, augmentation_multiplicity=1), self]
        return [run for number, run in enumerate(runs) if run not in runs[:number]]


@dataclass
class DemoResult:
    """What one run measured, per epoch and at the end."""

    recipe: Recipe = field(default_factory=Recipe)
    noise_multiplier: float = math.nan
    test_accuracy: list[float] = field(default_factory=list)
    epsilon: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    #: Accuracy on the unaugmented training images after the last epoch.
    train_accuracy: float = math.nan
    steps: int = 0
    seconds: float = 0.0


class Digits(NamedTuple):
    """The demo's data: 1437 training and 360 test images ``(N, 1, 8, 8)`` in [-1, 1], labels ``(N,)``."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


#: An empty pixel after :func:`load_digits` scales the images to [-1, 1].
BACKGROUND = -1.0


def load_digits(seed: int) -> Digits:
    """scikit-learn's digits (1797 8x8 images, bundled, no download) split 80/20 by ``seed``."""
    from sklearn import datasets

    data = datasets.load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.int64)  # (1797,)
    images = (images - 0.5) / 0.5
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return Digits(images[train], labels[train], images[test], labels[test])


#: The demo's privacy budget (delta 1e-5), at which benchmarks/demo_k.py measured the recipes.
DEMO_EPSILON = 4.0


@dataclass(frozen=True)
class Augmentation:
    """A random transform drawn independently for every copy of every sample.

    Each copy is rotated by an angle in ``[-max_rotation, max_rotation]`` degrees, scaled by a
    factor in ``[1 - max_scale, 1 + max_scale]`` and translated by up to ``max_shift`` pixels per
    axis (whole pixels when ``whole_pixels``), resampled bilinearly with the background filling
    what enters the frame; then Gaussian pixel noise of std ``noise_std`` is added.
    ``keep_original`` leaves the first copy of each sample untouched.
    """

    max_shift: float = 0.0
    max_rotation: float = 0.0
    max_scale: float = 0.0
    whole_pixels: bool = False
    noise_std: float = 0.0
    keep_original: bool = False


#: The augmentations the demo and ``benchmarks/demo_k.py`` know by name.
AUGMENTATIONS: dict[str, Augmentation] = {
    "none": Augmentation(),
    # whole-pixel shifts of up to one pixel (the old demo's, which kept the first copy unshifted)
    "shift": Augmentation(max_shift=1.0, whole_pixels=True),
    # digits of a slightly different size, centred as before
    "scale": Augmentation(max_scale=0.15),
    # handwriting-like jitter: small rotations, scalings and sub-pixel moves
    "affine": Augmentation(max_shift=0.5, max_rotation=10.0, max_scale=0.1),
    "noise": Augmentation(noise_std=0.3),
}


def augment(images: torch.Tensor, augmentation_multiplicity: int, generator: torch.Generator, *,
            augmentation: Augmentation = AUGMENTATIONS["shift"], background: float = 0.0) -> torch.Tensor:
    """``(N, C, H, W) -> (N*K, C, H, W)``: K randomly transformed copies of every sample.

    Rows are sample-major (copies of sample n are rows n*K .. n*K+K-1), as psg expects.

    Args:
        images: the samples.
        augmentation_multiplicity: K.
        generator: draws the transforms.
        augmentation: what each copy's transform may be (:class:`Augmentation`).
        background: the value of an empty pixel, which fills what a move brings into the frame.

    >>> images = torch.zeros(2, 1, 8, 8)
    >>> augment(images, 4, torch.Generator().manual_seed(0)).shape
    torch.Size([8, 1, 8, 8])
    """
    K = augmentation_multiplicity
    copies = images.repeat_interleave(K, dim=0)  # (N*K, C, H, W)
    rows, height, width = copies.shape[0], copies.shape[-2], copies.shape[-1]
    if rows == 0:
        return copies
    spec = augmentation
    out = copies
    if spec.max_shift or spec.max_rotation or spec.max_scale:
        def uniform(bound: float) -> torch.Tensor:  # (N*K,) in [-bound, bound]
            return (2 * torch.rand(rows, generator=generator) - 1) * bound

        angle = torch.deg2rad(uniform(spec.max_rotation))  # (N*K,)
        scale = 1 + uniform(spec.max_scale)  # (N*K,)
        if spec.whole_pixels:
            reach = int(spec.max_shift)
            shift = torch.randint(-reach, reach + 1, (rows, 2), generator=generator).float()  # (N*K, 2)
        else:
            shift = torch.stack([uniform(spec.max_shift), uniform(spec.max_shift)], dim=1)  # (N*K, 2)
        # affine_grid maps output to input coordinates in [-1, 1]: one pixel is 2 / size.
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale  # (N*K,)
        theta = torch.stack([torch.stack([cos, -sin, 2 * shift[:, 0] / width], dim=1),
                             torch.stack([sin, cos, 2 * shift[:, 1] / height], dim=1)], dim=1)  # (N*K, 2, 3)
        grid = nn.functional.affine_grid(theta, list(copies.shape), align_corners=False)  # (N*K, H, W, 2)
        # zero padding fills with 0: resample the offset from the background, then add it back
        out = nn.functional.grid_sample(copies - background, grid, mode="bilinear", padding_mode="zeros",
                                        align_corners=False) + background  # (N*K, C, H, W)
    if spec.noise_std:
        out = out + spec.noise_std * torch.randn(out.shape, generator=generator)
    if spec.keep_original and out is not copies:
        out[::K] = copies[::K]
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
        correct = int((model(images).argmax(1) == labels).sum().item())
    model.train()
    return correct / max(1, len(labels))


#: One DP-SGD gradient: fills ``p.grad`` of the model from a batch of ``n*K`` rows and returns the
#: sum of the n per-sample losses and n.
GradientStep = Callable[[torch.Tensor, torch.Tensor], tuple[float, int]]


def steps_per_epoch(recipe: Recipe, data: Digits) -> int:
    """Poisson batches per epoch, ``round(1 / q)``, as the server's calibration counts them."""
    return max(1, round(len(data.train_labels) / recipe.batch_size))


def train(model: nn.Module, recipe: Recipe, data: Digits, *, step: GradientStep, epsilon: Callable[[], float],
          seed: int, on_step: Callable[[float], None] | None = None) -> DemoResult:
    """The demo's training loop, whoever computes the gradient (the service, or ``DPStep`` in-process
    for ``benchmarks/demo_k.py``).

    Each epoch draws ``round(1 / q)`` Poisson batches (seeded by ``seed`` and the epoch), makes K
    augmented copies of every sample, lets ``step`` fill ``p.grad`` and steps SGD (momentum 0.9,
    the recipe's learning rate schedule); after each epoch it records the mean training loss,
    ``epsilon()`` and the test accuracy.

    Args:
        model: the model, built after ``torch.manual_seed(seed)``.
        recipe: augmentation, K and schedule.
        data: :func:`load_digits`.
        step: computes the DP gradient of a batch (:data:`GradientStep`).
        epsilon: epsilon spent so far.
        seed: seeds the batches and the augmentations.
        on_step: called with each step's mean loss (a progress bar).
    """
    start = time.monotonic()
    K = recipe.augmentation_multiplicity
    augmentation = AUGMENTATIONS[recipe.augmentation]
    sample_rate = recipe.batch_size / len(data.train_labels)
    per_epoch = steps_per_epoch(recipe, data)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.learning_rate, momentum=MOMENTUM)
    decay = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=recipe.epochs * per_epoch)
             if recipe.lr_schedule == "cosine" else None)
    generator = torch.Generator().manual_seed(seed)
    result = DemoResult(recipe=recipe)
    for epoch in range(recipe.epochs):
        sampler = PoissonBatchSampler(len(data.train_labels), sample_rate, num_batches=per_epoch,
                                      generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        loss_sum, samples = 0.0, 0
        for indices in sampler:
            index = torch.as_tensor(indices, dtype=torch.int64)
            inputs = augment(data.train_images[index], K, generator, augmentation=augmentation,
                             background=BACKGROUND)  # (n*K, 1, 8, 8)
            targets = data.train_labels[index].repeat_interleave(K)  # (n*K,)
            optimizer.zero_grad(set_to_none=True)
            batch_loss, batch_samples = step(inputs, targets)
            optimizer.step()
            if decay is not None:
                decay.step()
            loss_sum, samples = loss_sum + batch_loss, samples + batch_samples
            result.steps += 1
            if on_step is not None:
                on_step(batch_loss / max(1, batch_samples))
        result.train_loss.append(loss_sum / samples if samples else math.nan)
        result.epsilon.append(epsilon())
        result.test_accuracy.append(_accuracy(model, data.test_images, data.test_labels))
    result.train_accuracy = _accuracy(model, data.train_images, data.train_labels)
    result.seconds = time.monotonic() - start
    return result


def run_demo(target: str, recipe: Recipe, *, target_epsilon: float, delta: float, backend: str, seed: int,
             quiet: bool = False) -> DemoResult:
    """Trains ``recipe`` through the service at ``target`` in a session whose sigma the server chooses
    for ``target_epsilon`` at ``delta`` over the recipe's epochs; returns the per-epoch record."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    data = load_digits(seed)
    model = cnn_groupnorm(**MODEL_KWARGS)  # the architecture the server builds as _MODEL
    sample_rate = recipe.batch_size / len(data.train_labels)
    config = DPConfig(mode=backend, augmentation_multiplicity=recipe.augmentation_multiplicity,
                      max_grad_norm=recipe.max_grad_norm)
    spent = [0.0]
    with GradientClient(target) as client:
        session = client.create_session(_MODEL, model_kwargs=MODEL_KWARGS, loss="cross_entropy",
                                        expected_batch_size=recipe.batch_size, config=config,
                                        sample_rate=sample_rate, delta=delta, target_epsilon=target_epsilon,
                                        epochs=recipe.epochs, accountant=ACCOUNTANT, seed=seed)
        sigma = session.noise_multiplier
        if sigma is None:
            raise RuntimeError(f"psg-demo: the server at {target} did not report the sigma it chose")
        print(f"psg-demo: {recipe.label()}: the server chose sigma = {sigma:.3f} for epsilon "
              f"{target_epsilon:g} at delta {delta:g} over {recipe.epochs} epochs of "
              f"{steps_per_epoch(recipe, data)} steps (q = {sample_rate:.4f})", flush=True)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
            session.push_parameters(model)
            reply = session.compute_gradients(inputs, targets)
            reply.apply_to(model)
            spent[0] = reply.epsilon_spent
            # an empty Poisson batch is a legal step (noise only) with no loss to add
            return (reply.mean_loss * reply.samples if reply.samples else 0.0), reply.samples

        total = recipe.epochs * steps_per_epoch(recipe, data)
        with session, tqdm(total=total, disable=quiet, unit="step", desc=f"psg-demo {recipe.label()}") as bar:
            def on_step(loss: float) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", eps=f"{spent[0]:.2f}")

            result = train(model, recipe, data, step=step, epsilon=lambda: spent[0], seed=seed, on_step=on_step)
    result.noise_multiplier = sigma
    return result


def _colour(recipe: Recipe, *, alone: bool) -> str:
    """K copies blue, K = 1 with an augmentation orange, K = 1 without grey (a run alone: blue)."""
    if alone or recipe.augmentation_multiplicity > 1:
        return "tab:blue"
    return "tab:grey" if recipe.augmentation == "none" else "tab:orange"


def plot(results: Sequence[DemoResult], path: Path, *, target_epsilon: float, delta: float, title: str) -> None:
    """Writes test accuracy, training loss and epsilon per epoch of every run side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy, loss, privacy) = plt.subplots(1, 3, figsize=(13, 3.8))
    for result in results:
        colour = _colour(result.recipe, alone=len(results) == 1)
        epochs = list(range(1, len(result.test_accuracy) + 1))
        label = f"{result.recipe.label()} (sigma {result.noise_multiplier:.2f})"
        accuracy.plot(epochs, result.test_accuracy, marker="o", markersize=3, color=colour, label=label)
        loss.plot(epochs, result.train_loss, marker="o", markersize=3, color=colour, label=label)
        privacy.plot(epochs, result.epsilon, marker="o", markersize=3, color=colour, label=label)
    accuracy.axhline(1 / _CLASSES, color="black", linestyle=":", linewidth=1, label="chance")
    accuracy.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1), title="test accuracy")
    loss.set(xlabel="epoch", ylabel="training loss (mean over samples)", ylim=(0, None), title="training loss")
    privacy.axhline(target_epsilon, color="tab:red", linestyle="--", label=f"target epsilon {target_epsilon:g}")
    privacy.set(xlabel="epoch", ylabel=f"epsilon (delta = {delta:g})", ylim=(0, target_epsilon * 1.15),
                title="privacy spent")
    for axes in (accuracy, loss, privacy):
        axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    # Every help ends with its default; argparse fills in %(default)s.
    # Raw description: argparse's wrapping would break "psg-server" at its hyphen.
    default = Recipe()
    parser = argparse.ArgumentParser(
        prog="psg-demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DP-SGD training through the psg gradient service, end to end, at a target epsilon.\n\n"
                    "Starts psg-server with an embedded Ray pool (or uses --target) and trains a small\n"
                    "CNN on scikit-learn's digits. The server chooses sigma for the target epsilon;\n"
                    "each step does Poisson sampling, per-sample clipping and Gaussian noise. Prints\n"
                    "sigma, test accuracy and epsilon, and writes a plot. The defaults are the best\n"
                    "recipe measured on this data (K = 1, no augmentation). With -K above 1 or an\n"
                    "augmentation it also trains K = 1 without and with the augmentation, same seed\n"
                    "and epsilon, and plots the runs side by side.",
        epilog="example (K = 4 against K = 1): psg-demo --epochs 20 --epsilon 4 --augmentation affine -K 4")
    add = parser.add_argument
    add("--target", metavar="HOST:PORT",
        help="use a running server instead of starting one (default: start one)")
    add("--workers", type=int, default=2, metavar="N",
        help="Ray workers of the started server (default: %(default)s)")
    add("--backend", default="hooks", choices=["hooks", "functorch", "ew", "ghost"],
        help="per-sample gradient backend (default: %(default)s)")
    add("--epsilon", type=float, default=DEMO_EPSILON, metavar="EPS",
        help="target epsilon of each run; the server chooses sigma to spend it (default: %(default)s)")
    add("--delta", type=float, default=1e-5, help="delta of the target epsilon (default: %(default)s)")
    add("--augmentations", "-K", type=int, default=default.augmentation_multiplicity, metavar="K",
        help="augmented copies per sample (default: %(default)s)")
    add("--augmentation", default=default.augmentation, choices=sorted(AUGMENTATIONS),
        help="how each copy is transformed (default: %(default)s)")
    add("--baseline", action=argparse.BooleanOptionalAction, default=True,
        help="with K > 1 or an augmentation, first train K = 1 without augmentation and K = 1 with "
             "it, same seed and epsilon (default: %(default)s)")
    add("--epochs", type=int, default=default.epochs, metavar="N",
        help="training epochs of each run (default: %(default)s)")
    add("--batch-size", type=int, default=default.batch_size, metavar="N",
        help="expected (Poisson) batch size, in samples (default: %(default)s)")
    add("--lr", type=float, default=default.learning_rate,
        help="SGD learning rate, momentum 0.9 (default: %(default)s)")
    add("--lr-schedule", default=default.lr_schedule, choices=["cosine", "constant"],
        help="learning rate over the run (default: %(default)s)")
    add("--max-grad-norm", type=float, default=default.max_grad_norm, metavar="C",
        help="per-sample clipping bound C (default: %(default)s)")
    add("--seed", type=int, default=0,
        help="seed of the data split, initial weights, sampling, augmentations and noise (default: %(default)s)")
    add("--plot", type=Path, default=Path("psg-demo.png"), metavar="PATH",
        help="where the PNG plot goes (default: %(default)s)")
    add("--min-accuracy", type=float, default=0.5, metavar="FRACTION",
        help="exit non-zero when a run's final test accuracy is below this (default: %(default)s)")
    add("--server-timeout", type=float, default=120.0, metavar="SECONDS",
        help="how long the started server may take to report SERVING (default: %(default)s)")
    add("--quiet", action="store_true", help="no progress bar (default: show it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``psg-demo``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    schedule = {"epochs": args.epochs, "learning_rate": args.lr, "batch_size": args.batch_size,
                "lr_schedule": args.lr_schedule, "max_grad_norm": args.max_grad_norm}
    recipe = Recipe(args.augmentation, args.augmentations, **schedule)
    recipes = recipe.with_baselines() if args.baseline else [recipe]
    results: list[DemoResult] = []
    try:
        with contextlib.ExitStack() as stack:
            target = args.target or stack.enter_context(local_server(args.workers, args.server_timeout))
            for recipe in recipes:
                results.append(run_demo(target, recipe, target_epsilon=args.epsilon, delta=args.delta,
                                        backend=args.backend, seed=args.seed, quiet=args.quiet))
        plot(results, args.plot, target_epsilon=args.epsilon, delta=args.delta,
             title=f"psg demo: digits at epsilon {args.epsilon:g}, {args.epochs} epochs, batch {args.batch_size}, "
                   f"C = {args.max_grad_norm}, {args.backend}, seed {args.seed}")
    except Exception:  # noqa: BLE001 - the demo's contract is a non-zero exit on any failure
        logger.exception("psg-demo: failed")
        return 1
    status = 0
    for result in results:
        accuracy = result.test_accuracy[-1]
        print(f"psg-demo: {result.recipe.label()}: {result.steps} DP steps in {result.seconds:.1f} s at sigma "
              f"{result.noise_multiplier:.3f}; test accuracy {accuracy:.3f}, epsilon {result.epsilon[-1]:.2f} "
              f"at delta {args.delta:g}")
        if not accuracy >= args.min_accuracy:
            print(f"psg-demo: {result.recipe.label()}: test accuracy {accuracy:.3f} is below --min-accuracy "
                  f"{args.min_accuracy}", file=sys.stderr)
            status = 1
    print(f"psg-demo: plot written to {args.plot}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())

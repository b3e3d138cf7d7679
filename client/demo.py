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
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psg_client.client import GradientClient
from psg_client.demo_training import (ACCOUNTANT, AUGMENTATIONS, CLASSES, MODEL_KWARGS, DemoResult, Recipe,
                                      load_digits, steps_per_epoch, train)
from psg_core.architectures import cnn_groupnorm
from psg_core.config import DPConfig

__all__ = ["DEMO_EPSILON", "local_server", "main", "plot", "run_demo", "wait_serving"]

logger = logging.getLogger("psg_demo")

#: The server's name of ``psg_core.architectures.cnn_groupnorm``.
_MODEL = "cnn_groupnorm"
#: The demo's privacy budget (delta 1e-5), at which benchmarks/demo_k.py measured the recipes.
DEMO_EPSILON = 4.0


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



def run_demo(target: str, recipe: Recipe, *, target_epsilon: float, delta: float, backend: str, seed: int,
             quiet: bool = False, capture: bool = False) -> DemoResult:
    """Trains ``recipe`` through the service at ``target`` in a session whose sigma the server chooses
    for ``target_epsilon`` at ``delta`` over the recipe's epochs (its workers' steps recorded and
    replayed with ``capture``); returns the per-epoch record."""
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
                                        epochs=recipe.epochs, accountant=ACCOUNTANT, seed=seed, capture=capture)
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
    accuracy.axhline(1 / CLASSES, color="black", linestyle=":", linewidth=1, label="chance")
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
    add("--capture", action=argparse.BooleanOptionalAction, default=False,
        help="have the server's workers record each shard shape's step once and replay it "
             "(psg_core.CapturedStep; the same gradients) (default: %(default)s)")
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
                                        backend=args.backend, seed=args.seed, quiet=args.quiet,
                                        capture=args.capture))
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

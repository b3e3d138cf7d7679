"""When does augmentation multiplicity K pay on the demo's data? In-process DP-SGD, several seeds.

``python -m benchmarks.demo_k`` trains the demo's model (``cnn_groupnorm``, a GroupNorm CNN of 5k
parameters) on the demo's data (scikit-learn's digits, split 80/20 by seed) with the demo's loop
(:func:`psg_client.demo_training.train`), but in-process through :class:`psg_core.DPStep` instead
of the service: Poisson sampling, each sample's K augmented copies averaged before flat clipping at
C, sigma calibrated so that every setting ends at the same epsilon (``--epsilon``, delta 1e-5, PLD
accountant, as the demo asks the server), SGD with momentum 0.9. A setting is a
:class:`psg_client.demo_training.Recipe`: an augmentation
(:data:`psg_client.demo_training.AUGMENTATIONS`), a K and a schedule (epochs, learning rate and its
decay, expected batch size). Each runs once per seed; the seed draws the split, the initial
weights, the batches, the augmentations and the noise, so that one seed pairs settings on the same
split and the same initial model.

It prints one row per setting: final test accuracy per seed, mean +- standard deviation over seeds,
and the mean (+- standard deviation) over seeds of the paired differences to K = 1 without
augmentation and to K = 1 with the same augmentation, both under the same schedule; and writes every
curve to ``benchmarks/results/demo_k.json``. A program, not a test: nothing is asserted.

One torch thread, one run at a time: a run takes seconds, and runs stay comparable on a shared
machine.

    python -m benchmarks.demo_k                       # the README's table (about 25 minutes)
    python -m benchmarks.demo_k --epsilon 8 --augmentations scale -K 1 4 --seeds 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from psg_client.demo_training import (ACCOUNTANT, AUGMENTATIONS, MODEL_KWARGS, DemoResult, Recipe, load_digits,
                                      train)
from psg_core import DPConfig, DPStep, PrivacyAccountant
from psg_core.architectures import cnn_groupnorm

__all__ = ["main", "run_in_process", "summarise"]

logger = logging.getLogger("benchmarks.demo_k")

RESULTS_PATH = Path(__file__).parent / "results" / "demo_k.json"
DELTA = 1e-5


def run_in_process(recipe: Recipe, *, seed: int, target_epsilon: float, backend: str = "hooks") -> DemoResult:
    """One demo run, in-process: :class:`psg_core.DPStep` computes each gradient."""
    torch.manual_seed(seed)
    data = load_digits(seed)
    model = cnn_groupnorm(**MODEL_KWARGS)
    config = DPConfig(mode=backend, augmentation_multiplicity=recipe.augmentation_multiplicity,
                      max_grad_norm=recipe.max_grad_norm)
    dp_step = DPStep(model, loss_fn=nn.CrossEntropyLoss(), config=config,
                     sample_rate=recipe.batch_size / len(data.train_labels), expected_batch_size=recipe.batch_size,
                     accountant=PrivacyAccountant(ACCOUNTANT, target_epsilon=target_epsilon, target_delta=DELTA),
                     generator=torch.Generator().manual_seed(seed), target_epsilon=target_epsilon,
                     epochs=recipe.epochs)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        stats = dp_step(inputs, targets)
        return stats.loss_sum, stats.num_samples

    result = train(model, recipe, data, step=step, epsilon=lambda: dp_step.epsilon(DELTA), seed=seed)
    result.noise_multiplier = dp_step.config.noise_multiplier
    return result


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _paired(final: dict[int, float], baseline: dict[int, DemoResult]) -> tuple[float, float]:
    """Mean and standard deviation over seeds of ``final[seed] - baseline's final accuracy``."""
    differences = [final[seed] - baseline[seed].test_accuracy[-1] for seed in final if seed in baseline]
    return _mean_std(differences) if differences else (float("nan"), float("nan"))


def _label(recipe: Recipe) -> str:
    return (f"{recipe.augmentation:<6} K={recipe.augmentation_multiplicity:<2} ep={recipe.epochs:<3} "
            f"lr={recipe.learning_rate:<4g} {recipe.lr_schedule:<8} B={recipe.batch_size}")


def summarise(runs: Sequence[tuple[int, DemoResult]]) -> list[dict[str, object]]:
    """One row per recipe of ``(seed, result)`` pairs: final test accuracy by seed, its mean and
    standard deviation over seeds, and the paired differences (same seeds) to K = 1 without
    augmentation and to K = 1 with the same augmentation, both under the same schedule."""
    by_recipe: dict[Recipe, dict[int, DemoResult]] = {}
    for seed, result in runs:
        by_recipe.setdefault(result.recipe, {})[seed] = result
    rows = []
    for recipe, seeded in by_recipe.items():
        final = {seed: result.test_accuracy[-1] for seed, result in sorted(seeded.items())}
        mean, std = _mean_std(list(final.values()))
        k1_none = by_recipe.get(dataclasses.replace(recipe, augmentation="none", augmentation_multiplicity=1), {})
        k1_same = by_recipe.get(dataclasses.replace(recipe, augmentation_multiplicity=1), {})
        gain_none, gain_none_std = _paired(final, k1_none)
        gain_same, gain_same_std = _paired(final, k1_same)
        rows.append({"recipe": dataclasses.asdict(recipe), "label": _label(recipe), "accuracy_by_seed": final,
                     "mean": mean, "std": std, "gain_vs_k1_none": gain_none, "gain_vs_k1_none_std": gain_none_std,
                     "gain_vs_k1_same": gain_same, "gain_vs_k1_same_std": gain_same_std,
                     "train_accuracy": statistics.fmean(r.train_accuracy for r in seeded.values()),
                     "noise_multiplier": statistics.fmean(r.noise_multiplier for r in seeded.values()),
                     "epsilon": max(r.epsilon[-1] for r in seeded.values()),
                     "seconds": statistics.fmean(r.seconds for r in seeded.values())})
    return rows


def render(rows: Sequence[dict[str, object]], seeds: Sequence[int]) -> str:
    """The table :func:`main` prints."""
    head = (f"{'setting':<48} {'sigma':>5} " + " ".join(f"{'seed ' + str(s):>6}" for s in seeds)
            + f" {'mean +- std':>14} {'vs K=1 none':>15} {'vs K=1 same':>15} {'train':>6} {'s/run':>5}")
    lines = [head, "-" * len(head)]
    for row in rows:
        by_seed = row["accuracy_by_seed"]
        assert isinstance(by_seed, dict)
        cells = " ".join(f"{by_seed[s]:>6.3f}" if s in by_seed else f"{'-':>6}" for s in seeds)
        lines.append(f"{row['label']:<48} {row['noise_multiplier']:>5.2f} {cells} {row['mean']:>6.3f} +- "
                     f"{row['std']:.3f} {row['gain_vs_k1_none']:>+6.3f} +- {row['gain_vs_k1_none_std']:.3f} "
                     f"{row['gain_vs_k1_same']:>+6.3f} +- {row['gain_vs_k1_same_std']:.3f} "
                     f"{row['train_accuracy']:>6.3f} {row['seconds']:>5.0f}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); every list option spans the grid."""
    default = Recipe()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_k", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    # seed 0 chose the schedule and the augmentations' strengths; the table is on fresh seeds
    add("--seeds", nargs="+", type=int, default=[1, 2, 3], help="(default: %(default)s)")
    add("--epsilon", type=float, default=4.0, help="target epsilon at delta 1e-5 (default: %(default)s)")
    add("--augmentations", nargs="+", choices=sorted(AUGMENTATIONS), default=["shift", "scale", "affine", "noise"],
        help="augmentations tried with every K (default: %(default)s)")
    add("-K", "--multiplicities", nargs="+", type=int, default=[1, 2, 4, 8], help="(default: %(default)s)")
    add("--epochs", nargs="+", type=int, default=[default.epochs], help="(default: %(default)s)")
    add("--lr", nargs="+", type=float, default=[default.learning_rate], help="(default: %(default)s)")
    add("--lr-schedule", nargs="+", choices=["cosine", "constant"], default=[default.lr_schedule],
        help="(default: %(default)s)")
    add("--batch-size", nargs="+", type=int, default=[default.batch_size], help="(default: %(default)s)")
    add("--backend", default="hooks", help="(default: %(default)s)")
    add("--out", type=Path, default=RESULTS_PATH, help="(default: %(default)s)")
    return parser.parse_args(argv)


def grid(args: argparse.Namespace) -> list[Recipe]:
    """For every schedule: K = 1 without augmentation, then every augmentation x K."""
    recipes = []
    for epochs, lr, decay, batch in itertools.product(args.epochs, args.lr, args.lr_schedule, args.batch_size):
        schedule = Recipe(epochs=epochs, learning_rate=lr, lr_schedule=decay, batch_size=batch)
        recipes.append(schedule)
        recipes += [dataclasses.replace(schedule, augmentation=name, augmentation_multiplicity=K)
                    for name, K in itertools.product(args.augmentations, args.multiplicities) if name != "none"]
    return recipes


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the grid, prints the table, writes the JSON; returns 0."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    recipes = grid(args)
    runs: list[tuple[int, DemoResult]] = []
    for number, recipe in enumerate(recipes, 1):
        for seed in args.seeds:
            result = run_in_process(recipe, seed=seed, target_epsilon=args.epsilon, backend=args.backend)
            runs.append((seed, result))
            logger.info("[%d/%d] %s seed %d: test accuracy %.3f (train %.3f), epsilon %.2f, sigma %.2f, %.1f s",
                        number, len(recipes), _label(recipe), seed, result.test_accuracy[-1],
                        result.train_accuracy, result.epsilon[-1], result.noise_multiplier, result.seconds)
    rows = summarise(runs)
    print(f"\nfinal test accuracy at epsilon {args.epsilon:g} (delta {DELTA:g}), seeds {args.seeds}; 'vs K=1 "
          "none' and 'vs K=1 same' (augmentation): mean +- std over seeds of the paired difference in final "
          "test accuracy; 'train': final accuracy on the unaugmented training images\n")
    print(render(rows, args.seeds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "target_epsilon": args.epsilon, "delta": DELTA, "accountant": ACCOUNTANT, "seeds": args.seeds,
        "backend": args.backend, "torch": torch.__version__, "model_kwargs": MODEL_KWARGS,
        "augmentations": {name: dataclasses.asdict(AUGMENTATIONS[name]) for name in sorted(AUGMENTATIONS)},
        "rows": rows, "runs": [{"seed": seed, **dataclasses.asdict(result)} for seed, result in runs]}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

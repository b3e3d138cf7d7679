"""What ``psg-demo`` trains, and how: the data, the augmentations, the recipe and the loop.

Shared by the demo, which computes each gradient through the service, and by
``benchmarks/demo_k.py``, which computes it in-process with :class:`psg_core.DPStep` to measure
the recipes over many seeds: both run :func:`train`, so the benchmark measures the demo's loop.

>>> data = load_digits(0)
>>> data.train_images.shape, data.test_images.shape
(torch.Size([1437, 1, 8, 8]), torch.Size([360, 1, 8, 8]))
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from psg_core.sampling import PoissonBatchSampler

__all__ = ["ACCOUNTANT", "AUGMENTATIONS", "BACKGROUND", "CLASSES", "MODEL_KWARGS", "MOMENTUM", "Augmentation",
           "DemoResult", "Digits", "GradientStep", "Recipe", "augment", "load_digits", "steps_per_epoch", "train"]

#: Digits 0-9.
CLASSES = 10
#: ``psg_core.architectures.cnn_groupnorm``'s arguments (the server's model ``cnn_groupnorm``).
MODEL_KWARGS: dict[str, Any] = {"in_channels": 1, "image_size": 8, "channels": (16, 32), "groups": 4,
                                "num_classes": CLASSES}
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


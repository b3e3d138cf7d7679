"""Poisson subsampling, the batch sampling DP-SGD's privacy analysis assumes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from psg_core.errors import ConfigError
from psg_core.noise import secure_generator

__all__ = ["PoissonBatchSampler"]


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields batches of dataset indices where each index joins each batch independently with
    probability ``sample_rate``, so batch sizes vary (Binomial(num_samples, sample_rate)) and may
    be 0.

    Use it as a ``batch_sampler`` of a ``DataLoader``. Empty batches are legal in psg
    (``dp_gradient`` returns zeros, noise is still added), but torch's default collate cannot
    collate an empty list, so pair the sampler with a ``collate_fn`` that builds empty tensors.

    Args:
        num_samples: size of the dataset (indices are ``0 .. num_samples - 1``).
        sample_rate: q in (0, 1].
        num_batches: batches per pass; default ``round(1 / sample_rate)``, one expected epoch.
        generator: a seeded ``torch.Generator`` for reproducible batches; None uses torch's
            global generator, unless ``secure_rng``.
        secure_rng: each pass draws from a fresh generator seeded by the OS's CSPRNG
            (see :func:`psg_core.noise.secure_generator`); incompatible with ``generator``.

    >>> sampler = PoissonBatchSampler(10, 0.5, num_batches=2,
    ...                               generator=torch.Generator().manual_seed(0))
    >>> [len(batch) for batch in sampler]
    [6, 7]
    """

    def __init__(self, num_samples: int, sample_rate: float, *, num_batches: int | None = None,
                 generator: torch.Generator | None = None, secure_rng: bool = False) -> None:
        where = "PoissonBatchSampler"
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ConfigError(f"{where}: num_samples must be an int >= 0, got {num_samples!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
                or not 0 < sample_rate <= 1:
            raise ConfigError(f"{where}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
        if num_batches is None:
            num_batches = max(1, round(1 / sample_rate))
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ConfigError(f"{where}: num_batches must be an int >= 1, got {num_batches!r}")
        if generator is not None and secure_rng:
            raise ConfigError(f"{where}: pass either a generator or secure_rng=True, not both")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ConfigError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}")
        if generator is not None and generator.device.type != "cpu":
            raise ConfigError(f"{where}: generator must be a CPU generator, got device {generator.device}")
        self.num_samples = num_samples
        self.sample_rate = float(sample_rate)
        self.num_batches = num_batches
        self.generator = generator
        self.secure_rng = bool(secure_rng)

    @property
    def expected_batch_size(self) -> float:
        """``num_samples * sample_rate``: the mean batch size, the DP-SGD normaliser."""
        return self.num_samples * self.sample_rate

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        generator = secure_generator() if self.secure_rng else self.generator
        for _ in range(self.num_batches):
            keep = torch.rand(self.num_samples, generator=generator) < self.sample_rate  # (num_samples,)
            yield keep.nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return (f"PoissonBatchSampler(num_samples={self.num_samples}, sample_rate={self.sample_rate}, "
                f"num_batches={self.num_batches}, secure_rng={self.secure_rng})")


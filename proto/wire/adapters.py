"""The LoRA adapter a session adds to its model, built the same way on both ends of the wire.

A trainer declares the adapter at ``CreateSession`` (``LoraSettings``); the server adds it to the
model it builds, and the trainer adds it to its own copy. Both must end with the same parameter
names and the same frozen/trainable split, so the recipe is written once, here:
:meth:`LoraAdapter.apply` wraps the model with ``peft.get_peft_model`` (parameters are then named
``base_model.model.<original name>`` plus ``...lora_A.default.weight`` / ``lora_B`` for each
adapted module, and only the adapter's matrices require grad).

peft is imported only when an adapter is applied (it comes with psg's ``server`` extra).

>>> adapter = LoraAdapter(rank=4, target_modules=("q_proj", "v_proj"), alpha=8)
>>> adapter.scale
2.0
>>> LoraAdapter(rank=0, target_modules=("q_proj",))
Traceback (most recent call last):
...
psg_core.errors.ConfigError: LoraAdapter: rank must be an int in [1, 1024], got 0
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from torch import nn

from psg_core.errors import ConfigError

__all__ = ["MAX_LORA_RANK", "LoraAdapter"]

#: Largest rank an adapter may have.
MAX_LORA_RANK = 1024
_MAX_TARGETS = 64
_MAX_TARGET_LENGTH = 128
#: A module path, or its last components, as ``named_modules()`` writes it.
_TARGET = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
#: What peft can adapt, for the hint of an error message (peft itself decides).
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projection layer: a Linear whose weight is stored
    transposed), recognised without importing transformers."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter (Hu et al., 2021) on some of a model's modules.

    Args:
        rank: r, the rank of each low-rank update.
        target_modules: the modules to adapt, matched as peft matches them: a module whose name
            (``named_modules()``) equals an entry or ends with ``"." + entry``.
        alpha: lora_alpha; the update is scaled by ``alpha / rank``. None: ``rank`` (scale 1).

    Raises:
        ConfigError: a value out of range (checked on construction, so on both ends of the wire).
    """

    rank: int
    target_modules: tuple[str, ...]
    alpha: float | None = None

    def __post_init__(self) -> None:
        where = "LoraAdapter"
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_LORA_RANK:
            raise ConfigError(f"{where}: rank must be an int in [1, {MAX_LORA_RANK}], got {self.rank!r}")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise ConfigError(f"{where}: alpha must be a finite number > 0 (or None: the rank), got {self.alpha!r}")
        targets = self.target_modules
        if isinstance(targets, str) or not isinstance(targets, Sequence):
            raise ConfigError(f"{where}: target_modules must be a sequence of module names, got {targets!r:.80}")
        if not 1 <= len(targets) <= _MAX_TARGETS:
            raise ConfigError(f"{where}: target_modules must name 1 to {_MAX_TARGETS} modules, got {len(targets)}")
        for target in targets:
            if (not isinstance(target, str) or len(target) > _MAX_TARGET_LENGTH
                    or not _TARGET.fullmatch(target)):
                raise ConfigError(f"{where}: target module {target!r:.80} is not a module name (letters, "
                                  f"digits, '_', components joined by '.', at most {_MAX_TARGET_LENGTH} "
                                  "characters)")
        object.__setattr__(self, "target_modules", tuple(targets))
        if self.alpha is not None:
            object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        """``alpha / rank``: what the low-rank update is multiplied by."""
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def matches(self, module: nn.Module) -> dict[str, list[str]]:
        """``{target: [names of the modules it matches]}`` in ``module``."""
        names = [name for name, _ in module.named_modules() if name]
        return {target: [name for name in names if name == target or name.endswith("." + target)]
                for target in self.target_modules}

    def apply(self, module: nn.Module) -> nn.Module:
        """``module`` with the adapter: ``peft.get_peft_model(module, ...)`` (which modifies
        ``module`` in place and wraps it). Every parameter of ``module`` is frozen; the adapter's
        matrices (lora_B starts at zero, so the model computes what it did) are the trainable ones.

        Raises:
            ConfigError: a target matches no module, or a module peft cannot adapt.
        """
        matches = self.matches(module)
        unmatched = [target for target, names in matches.items() if not names]
        if unmatched:
            adaptable = sorted({name.rsplit(".", 1)[-1] for name, m in module.named_modules()
                                if name and (isinstance(m, _ADAPTABLE) or _is_transformers_conv1d(m))})
            raise ConfigError(f"LoraAdapter: target module(s) {unmatched} match no module of the "
                              f"{type(module).__name__} model; its adaptable modules are named "
                              f"{adaptable[:24]}{' ...' if len(adaptable) > 24 else ''}")
        modules = dict(module.named_modules())
        matched = [modules[name] for names in matches.values() for name in names]
        try:
            import peft
        except ImportError as err:
            raise ConfigError(f"LoraAdapter: LoRA needs peft (psg's server extra): {err}") from None
        # GPT-2's Conv1D stores its weight transposed; peft must be told (it corrects a wrong
        # setting per layer, with a warning, when targets mix Conv1D and Linear layers).
        alpha = self.alpha if self.alpha is not None else self.rank
        # peft annotates lora_alpha as int; it only ever divides it by r, so a float works as well
        config = peft.LoraConfig(r=self.rank, lora_alpha=alpha,  # type: ignore[arg-type]
                                 target_modules=list(self.target_modules), lora_dropout=0.0, bias="none",
                                 fan_in_fan_out=all(_is_transformers_conv1d(m) for m in matched))
        _quiet_peft()
        try:
            return peft.get_peft_model(module, config)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"LoraAdapter: peft cannot adapt {self.target_modules}: {err}") from None


def _quiet_peft() -> None:
    """Ignores the two warnings peft raises while wrapping a model that no caller can act on:
    transformers' deprecation of the ``is_gradient_checkpointing`` name peft reads, and its
    per-layer correction of ``fan_in_fan_out`` for targets that mix Conv1D and Linear layers.

    A lasting filter rather than ``warnings.catch_warnings()``: that one swaps the process-wide
    filter list and restores it on exit, which loses filters when several threads (the server's
    in-process workers) build models at once. Adding the same filter again replaces it.
    """
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)

"""What a user writes: strings for the choices, as the docs show. Type-checked by test_typing."""

from __future__ import annotations

import dataclasses

from psg_core import DPConfig
from psg_core.modes import Clipping, GradSampleMode

config = DPConfig(mode="ghost", clipping="per_layer", loss_reduction="sum", max_grad_norm=0.5,
                  augmentation_multiplicity=4, per_layer_max_grad_norms=(0.1, 0.2))
typed = DPConfig(mode=GradSampleMode.FUNCTORCH, clipping=Clipping.AUTOMATIC)
changed = dataclasses.replace(config, mode=GradSampleMode.HOOKS)  # replace() takes the field types
mode: GradSampleMode = changed.mode
clipping: Clipping = typed.clipping

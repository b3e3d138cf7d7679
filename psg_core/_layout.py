"""Layout markers shared by layers and backends (kept import-free to avoid import cycles)."""

from __future__ import annotations

__all__ = ["ALWAYS_BATCH_FIRST", "STATE_BATCH_AXIS"]

#: Class attribute set (to True) by psg's own layers whose inputs are batch-first whatever the
#: model's layout, e.g. the per-timestep cells inside the DP recurrent layers.
ALWAYS_BATCH_FIRST = "_psg_always_batch_first"

#: Class attribute of psg's recurrent layers: the batch axis of their ``hx`` argument (the state
#: carries the batch whenever the input does, on this axis whatever the layout).
STATE_BATCH_AXIS = "_psg_state_batch_axis"

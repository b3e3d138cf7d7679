"""Gradient accumulation through the service: a logical batch (one DP step) sent as several
ComputeGradients requests, its *parts* (``ComputeGradientsHeader.part`` and ``more_parts``).

Each part's clipped sum is computed like any batch (validated, sharded, merged) and added to the
session's :class:`PendingBatch`; only the last part releases the step: the merged clipped sum of
every part gets noise once, is normalised and accounted once, exactly as if the logical batch had
come in one request (up to floating point summation order). Parts must come in order and name the
same parameter version; a part whose predecessors the server does not hold (never sent, or lost with
a restart of the frontend, which keeps pending parts in memory only) fails with
:class:`~psg_server.errors.AccumulationLostError`, and the client starts the logical batch over.
Pending parts are never accounted: nothing was released for them.

>>> pending = PendingBatch(param_version=3)
>>> pending.expects(0, 3), pending.expects(1, 3), pending.expects(0, 2)
(False, True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from psg_core.config import DPGradient
from psg_server.errors import AccumulationLostError

__all__ = ["PendingBatch", "check_part", "take_part"]


@dataclass
class PendingBatch:
    """The parts of a logical batch received so far (their clipped sums merged)."""

    param_version: int
    #: Parts received (the index the next part must have).
    parts: int = 0
    total: DPGradient | None = None

    def expects(self, part: int, param_version: int) -> bool:
        """Whether ``part`` for ``param_version`` continues this logical batch."""
        return part == self.parts and param_version == self.param_version and part > 0


def check_part(pending: PendingBatch | None, *, part: int, param_version: int, session_id: str) -> None:
    """Refuses a part that does not continue the pending logical batch (before its upload).

    Raises:
        AccumulationLostError: ``part > 0`` and the server holds no logical batch it continues.
    """
    if part == 0 or (pending is not None and pending.expects(part, param_version)):
        return
    held = "no logical batch" if pending is None else \
        f"parts 0..{pending.parts - 1} of a logical batch for parameter version {pending.param_version}"
    raise AccumulationLostError(f"ComputeGradients: part {part} (parameter version {param_version}) of session "
                                f"{session_id!r} does not continue what the server holds ({held}); send the "
                                "logical batch again from part 0")


def take_part(pending: PendingBatch | None, merged: DPGradient, *, part: int, more_parts: bool,
              param_version: int, session_id: str) -> tuple[PendingBatch | None, DPGradient | None]:
    """Adds one part's clipped sum (``merged``) to the logical batch.

    Returns:
        ``(pending, None)`` while more parts follow, the session's new pending batch; ``(None,
        total)`` on the last part, the clipped sum of the whole logical batch to release.
    """
    check_part(pending, part=part, param_version=param_version, session_id=session_id)
    if part == 0 or pending is None:
        pending = PendingBatch(param_version=param_version)
    total = merged if pending.total is None else DPGradient.merge([pending.total, merged])
    if more_parts:
        pending.total, pending.parts = total, part + 1
        return pending, None
    return None, total

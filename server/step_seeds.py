"""The step seeds a session has used, so that no two of its steps draw the same noise.

A step's noise generator is seeded by a hash of the session seed and the step seed
(:meth:`Session.noise_seed <psg_server.sessions.Session.noise_seed>`; the step's 1-based index when
the request gives none). Two steps of one session with the same step seed would draw the same
noise, and the difference of their two gradients would be the difference of their clipped sums
with no noise at all, while the ledger charges two independently noised steps. So a session
refuses a step seed it has used before (:class:`~psg_server.errors.StepSeedReusedError`), and keeps
the seeds across restarts (the ``step_seeds`` table of :mod:`psg_server.state`).

:class:`UsedSeeds` holds them as disjoint runs of consecutive seeds: one run for a session that
never sets a step seed (its indices 1..steps) or counts them up by one, one per gap otherwise.

>>> used = UsedSeeds()
>>> [used.add(seed) for seed in (1, 2, 3, 7, 5, 6)]
[(1, 1), (1, 2), (1, 3), (7, 7), (5, 5), (5, 7)]
>>> used.runs(), 4 in used, 6 in used, len(used)
([(1, 3), (5, 7)], False, True, 6)
>>> used.run_with(4)  # what adding 4 would give, without adding it
(1, 7)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

__all__ = ["MAX_STEP_SEED", "UsedSeeds"]

#: Step seeds are ``uint64`` on the wire (``ComputeGradientsHeader.step_seed``).
MAX_STEP_SEED = 2**64 - 1


class UsedSeeds:
    """A set of step seeds (integers in ``[0, 2**64)``) kept as sorted disjoint runs ``(low, high)``
    of consecutive seeds, ``high`` included, no two runs adjacent (see the module docstring)."""

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        self._lows: list[int] = []
        self._highs: list[int] = []
        for low, high in sorted(runs):
            if not 0 <= low <= high <= MAX_STEP_SEED:
                raise ValueError(f"UsedSeeds: bad run of step seeds ({low}, {high})")
            if self._highs and low <= self._highs[-1] + 1:  # overlapping or adjacent: one run
                self._highs[-1] = max(self._highs[-1], high)
            else:
                self._lows.append(low)
                self._highs.append(high)

    def __contains__(self, seed: object) -> bool:
        if not isinstance(seed, int):
            return False
        index = bisect_right(self._lows, seed) - 1
        return index >= 0 and seed <= self._highs[index]

    def __len__(self) -> int:
        """How many seeds are used."""
        return sum(high - low + 1 for low, high in zip(self._lows, self._highs))

    def runs(self) -> list[tuple[int, int]]:
        """The runs, in order."""
        return list(zip(self._lows, self._highs))

    def run_with(self, seed: int) -> tuple[int, int]:
        """The run that would hold ``seed`` once added (changes nothing): what a database keeps
        in place of the runs it merges."""
        index = bisect_right(self._lows, seed)  # runs [0, index) start at or below seed
        if index and seed <= self._highs[index - 1]:
            return self._lows[index - 1], self._highs[index - 1]
        low = self._lows[index - 1] if index and self._highs[index - 1] == seed - 1 else seed
        high = self._highs[index] if index < len(self._lows) and self._lows[index] == seed + 1 else seed
        return low, high

    def add(self, seed: int) -> tuple[int, int]:
        """Marks ``seed`` used; returns the run that now holds it."""
        if not 0 <= seed <= MAX_STEP_SEED:
            raise ValueError(f"UsedSeeds: step seed {seed} is outside [0, 2**64)")
        index = bisect_right(self._lows, seed)
        if index and seed <= self._highs[index - 1]:
            return self._lows[index - 1], self._highs[index - 1]
        joins_left = index > 0 and self._highs[index - 1] == seed - 1
        joins_right = index < len(self._lows) and self._lows[index] == seed + 1
        if joins_left and joins_right:  # seed fills the gap between two runs
            self._highs[index - 1] = self._highs[index]
            del self._lows[index], self._highs[index]
            index -= 1
        elif joins_left:
            index -= 1
            self._highs[index] = seed
        elif joins_right:
            self._lows[index] = seed
        else:
            self._lows.insert(index, seed)
            self._highs.insert(index, seed)
        return self._lows[index], self._highs[index]

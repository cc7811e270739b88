"""Megatron's ``--data-path`` list, parsed: one prefix, or ``WEIGHT PREFIX`` pairs (:class:`Blend`).

Kept apart from :mod:`megatron_epp.data.blend` (which draws the blended stream with megatron-core's helpers)
so that checking the flags imports neither torch's data utilities nor megatron-core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


class BlendError(ValueError):
    """A ``--data-path`` list that is not one prefix or ``WEIGHT PREFIX`` pairs with positive weights."""


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their weights (normalised to sum 1; ``None``: one prefix, not blended)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    @classmethod
    def parse(cls, tokens: Sequence[str]) -> "Blend":
        """Megatron's ``--data-path`` list: ``PREFIX`` or ``W1 P1 W2 P2 ...``; anything else is a :class:`BlendError`."""
        tokens = list(tokens)
        if len(tokens) == 1 and _number(tokens[0]) is None:
            return cls((tokens[0],))
        numbers = [_number(t) for t in tokens]
        if not any(n is not None for n in numbers):
            raise BlendError(
                f"--data-path {' '.join(tokens)}: {len(tokens)} prefixes without weights; give a weight before each "
                f"prefix (e.g. --data-path 0.5 {tokens[0]} 0.5 {tokens[1]})"
            )
        if len(tokens) % 2:
            raise BlendError(f"--data-path {' '.join(tokens)}: {len(tokens)} values; expected WEIGHT PREFIX pairs")
        weights, prefixes = numbers[0::2], tokens[1::2]
        for raw, weight, prefix in zip(tokens[0::2], weights, prefixes):
            if weight is None or _number(prefix) is not None:
                raise BlendError(f"--data-path {' '.join(tokens)}: expected WEIGHT PREFIX pairs, got {raw!r} {prefix!r}")
            if not (math.isfinite(weight) and weight > 0):
                raise BlendError(f"--data-path: weight {raw} of {prefix} must be a positive number")
        if len(set(prefixes)) < len(prefixes):
            raise BlendError(f"--data-path {' '.join(tokens)}: a prefix appears twice; add its weights instead")
        total = sum(weights)
        return cls(tuple(prefixes), tuple(w / total for w in weights))

    def describe(self) -> str:
        if self.weights is None:
            return self.prefixes[0]
        return "blend of " + ", ".join(f"{w:.3g} {p}" for w, p in zip(self.weights, self.prefixes))

"""Summary statistics of a document-length distribution."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthStats:
    """Count, total and percentiles of token counts per document."""

    count: int
    total: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthStats:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return cls(0, 0, 0.0, 0.0, 0.0, 0.0, 0)
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
        return cls(
            count=int(lengths.size),
            total=int(lengths.sum()),
            mean=float(lengths.mean()),
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=int(lengths.max()),
        )

    def __str__(self) -> str:
        return (
            f"{self.count:,} docs, {self.total:,} tokens; tokens/doc mean {self.mean:,.0f} "
            f"p50 {self.p50:,.0f} p90 {self.p90:,.0f} p99 {self.p99:,.0f} max {self.max:,}"
        )

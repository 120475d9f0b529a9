"""Normalisation and the model's input windows (docs/PREDICTOR.md "Features").

The model sees, for each scored row, the last W feature rows of the same rail ending at (and
including) that row, normalised with the training mean and standard deviation, and
left-padded with zero rows (= the training mean) when the rail has fewer than W rows so far.
Rows of link-down steps do not exist, so a window spans a link-down gap; nothing resets it.
All arithmetic is float32, like the C++ (``(x - mean) / std`` per feature).
"""

from __future__ import annotations

import dataclasses

import numpy as np

STD_FLOOR = 0.05  # a feature (nearly) constant in training is scaled by at most 1/0.05


@dataclasses.dataclass
class Normaliser:
    """Per-feature mean and standard deviation (float32 [F])."""

    mean: np.ndarray
    std: np.ndarray

    @staticmethod
    def fit(x: np.ndarray) -> "Normaliser":
        """Mean/std of the rows of ``x`` (float64 accumulation), std floored at STD_FLOOR."""
        x64 = x.astype(np.float64)
        return Normaliser(mean=x64.mean(axis=0).astype(np.float32),
                          std=np.maximum(x64.std(axis=0), STD_FLOOR).astype(np.float32))

    def apply(self, x: np.ndarray) -> np.ndarray:
        return ((x.astype(np.float32) - self.mean) / self.std).astype(np.float32)


def window_index(rail: np.ndarray, window: int) -> np.ndarray:
    """int64 [N, W]: row indices of each row's window (oldest first, the row itself last);
    -1 where the window is padded. Rows of a rail are taken in their array order."""
    n = rail.shape[0]
    order = np.lexsort((np.arange(n), rail))  # grouped by rail, array order within a rail
    r_sorted = rail[order]
    starts = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
    lengths = np.diff(np.r_[starts, n])
    pos = np.arange(n) - np.repeat(starts, lengths)  # position within its rail
    idx = np.full((n, window), -1, dtype=np.int64)
    for k in range(window):
        back = window - 1 - k  # how many rows before the scored row
        ok = pos >= back
        src = np.arange(n) - back
        idx[order[ok], k] = order[src[ok]]
    return idx


def gather(xn: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """float32 [B, W, F] windows from normalised rows ``xn`` [N, F] and indices [B, W]
    (index -1 = a zero row)."""
    padded = np.concatenate([xn, np.zeros((1, xn.shape[1]), dtype=np.float32)], axis=0)
    return padded[np.where(idx < 0, xn.shape[0], idx)]

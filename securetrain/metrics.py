"""Ranking metrics in plain numpy, shared by training validation and HE evaluation.

One ROC AUC implementation (the Mann-Whitney statistic with average ranks for ties), so that a
model's AUC in the training report and in the homomorphic evaluation report are the same number
for the same scores.
"""

from __future__ import annotations

import numpy as np


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties sharing the average of their ranks."""
    x = np.asarray(x, dtype=np.float64).ravel()
    order = np.argsort(x, kind="mergesort")
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts - 1) / 2.0 + 1.0, counts)
    return ranks


def binary_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """ROC AUC = P(score_pos > score_neg) + ½·P(tie); ``None`` if one class is absent.

    ``positive`` is a mask (0/1 integers are taken as one, never as indices)."""
    positive = np.asarray(positive).astype(bool).ravel()
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = average_ranks(scores)
    if len(ranks) != len(positive):
        raise ValueError(f"{len(ranks)} scores for {len(positive)} labels")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))

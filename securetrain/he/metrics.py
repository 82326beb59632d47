"""Binary/multi-class metrics in plain numpy (no scikit-learn needed at run time)."""

from __future__ import annotations

import numpy as np

from securetrain.metrics import binary_auc


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (``securetrain.metrics.binary_auc``); NaN if one class is absent."""
    auc = binary_auc(scores, labels)
    return float("nan") if auc is None else auc


def accuracy(labels: np.ndarray, outputs: np.ndarray, threshold: float) -> float:
    """Binary (one output column, ``> threshold``) or multi-class (argmax) accuracy."""
    y = np.asarray(labels).ravel()
    o = np.asarray(outputs, dtype=np.float64)
    return float(np.mean(decisions(o, threshold) == y.astype(int)))


def macro_auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Binary AUC for one score column; macro one-vs-rest AUC over the classes present (in the
    labels, with at least one negative) for several columns of class probabilities."""
    y = np.asarray(labels).ravel().astype(int)
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1 or s.shape[1] == 1:
        auc = roc_auc(y, s.reshape(-1))
        return None if np.isnan(auc) else auc
    aucs = [roc_auc(y == k, s[:, k]) for k in range(s.shape[1])]
    aucs = [a for a in aucs if not np.isnan(a)]
    return float(np.mean(aucs)) if aucs else None


def decisions(outputs: np.ndarray, threshold: float) -> np.ndarray:
    """The predicted class per sample: ``> threshold`` for one column, argmax for several."""
    o = np.asarray(outputs, dtype=np.float64)
    return (o.reshape(-1) > threshold).astype(int) if o.ndim == 1 or o.shape[1] == 1 else np.argmax(o, axis=1)


def agreement(a: np.ndarray, b: np.ndarray, threshold: float) -> float:
    """Fraction of samples whose predicted class is the same under ``a`` and ``b`` (e.g. the
    decrypted scores and the plaintext model's): equal accuracy does not imply equal predictions."""
    return float(np.mean(decisions(a, threshold) == decisions(b, threshold)))

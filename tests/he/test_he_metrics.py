"""The HE report's metrics and the training report's come from one AUC implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from securetrain.he.metrics import macro_auc, roc_auc
from securetrain.metrics import average_ranks, binary_auc
from securetrain.training.validation import macro_auc as training_macro_auc

sklearn = pytest.importorskip("sklearn.metrics")


def test_roc_auc_matches_sklearn_with_ties_and_integer_labels() -> None:
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, 400).astype(float)  # many ties
    labels = (rng.random(400) < 0.3).astype(int)
    expected = sklearn.roc_auc_score(labels, scores)
    assert roc_auc(labels, scores) == pytest.approx(expected, abs=1e-12)
    assert binary_auc(scores, labels) == roc_auc(labels, scores)


def test_one_class_is_undefined_not_a_number() -> None:
    assert math.isnan(roc_auc(np.ones(5), np.arange(5.0)))
    assert binary_auc(np.arange(5.0), np.zeros(5)) is None
    assert macro_auc(np.zeros(5), np.arange(5.0)) is None


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="3 scores for 4 labels"):
        binary_auc(np.arange(3.0), np.array([0, 1, 0, 1]))


def test_average_ranks() -> None:
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_multiclass_reports_agree() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(300, 3))
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = rng.integers(0, 3, 300)
    expected = sklearn.roc_auc_score(labels, probabilities, multi_class="ovr", average="macro")
    assert macro_auc(labels, probabilities) == pytest.approx(expected, abs=1e-12)
    assert training_macro_auc(probabilities, labels) == pytest.approx(expected, abs=1e-12)


def test_he_cli_csv_header_detection(tmp_path) -> None:  # noqa: ANN001
    from securetrain.he.cli import _load_array

    x = np.arange(12, dtype=float).reshape(4, 3) / 7.0
    rows = "".join(",".join(repr(float(v)) for v in row) + "\n" for row in x)
    # What pandas writes for an unnamed DataFrame (pd.DataFrame(x).to_csv(index=False)): its header
    # 0,1,2 was read as a sample, one made-up row.
    (tmp_path / "unnamed.csv").write_text("0,1,2\n" + rows)
    assert np.allclose(_load_array(tmp_path / "unnamed.csv", "features"), x)
    (tmp_path / "named.csv").write_text('"a",b,c\n' + rows)
    assert np.allclose(_load_array(tmp_path / "named.csv", "features"), x)
    # A first sample holding nan or inf is data, not a header (it was dropped silently).
    (tmp_path / "nan.csv").write_text("nan,1,2\n3,inf,5\n")
    got = _load_array(tmp_path / "nan.csv", "features")
    assert got.shape == (2, 3) and np.isnan(got[0, 0]) and np.isinf(got[1, 1])
    (tmp_path / "plain.csv").write_text("0.5,1e-3,2\n3,4,5\n")
    assert _load_array(tmp_path / "plain.csv", "features").shape == (2, 3)
    (tmp_path / "labels.csv").write_text("label\n1\n0\n")
    assert _load_array(tmp_path / "labels.csv", "labels").tolist() == [1.0, 0.0]

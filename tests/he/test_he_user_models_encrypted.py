"""User models under CKKS: multi-class heads, split CNNs, tabular MLPs, owner-side probabilities,
calibrated bounds and searched parameters, packed small batches."""

from __future__ import annotations

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")

import torch  # noqa: E402
from he_cli_helpers import rebundle  # noqa: E402
from torch import nn  # noqa: E402

from securetrain.audit.recorder import MemoryAuditRecorder  # noqa: E402
from securetrain.he import (  # noqa: E402
    DataOwner,
    Evaluator,
    HEModelError,
    HEParameterError,
    HEUnsupportedLayerError,
    PolyActivation,
    choose_params,
    compile_plan,
    evaluate_encrypted,
    split_for_he,
)
from securetrain.he.errors import HEFormatError  # noqa: E402

pytestmark = pytest.mark.he


def _blobs(n: int, d: int, classes: int, seed: int = 0, spread: float = 1.6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, d)) * spread
    y = rng.integers(0, classes, size=n)
    return centres[y] + rng.normal(size=(n, d)), y


def _train(model: nn.Module, x: np.ndarray, y: np.ndarray, steps: int = 150, binary: bool = False) -> nn.Module:
    torch.manual_seed(0)
    xt = torch.tensor(x, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(steps):
        opt.zero_grad()
        out = model(xt)
        if binary:
            loss = nn.functional.binary_cross_entropy_with_logits(out, torch.tensor(y, dtype=torch.float32)[:, None])
        else:
            loss = nn.functional.cross_entropy(out, torch.tensor(y))
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(autouse=True)
def _no_keygen_after_refusal(monkeypatch):  # noqa: ANN001, ANN202
    """Every test can assert that a refusal happened before any key/ciphertext existed."""
    made: list[str] = []
    real_init = DataOwner.__init__

    def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        made.append("keygen")
        return real_init(self, *a, **k)

    monkeypatch.setattr(DataOwner, "__init__", spy)
    return made


@pytest.mark.slow
def test_multiclass_tabular_mlp_scores_argmax_equal_plaintext(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    x, y = _blobs(300, 8, 4)
    model = _train(nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), PolyActivation([0.0, 0.6, 0.08]),
                                 nn.Dropout(0.1), nn.Linear(6, 4), nn.Softmax(dim=1)), x, y)
    audit = MemoryAuditRecorder()
    r = evaluate_encrypted(model, torch.tensor(x, dtype=torch.float32), torch.tensor(y), audit=audit, output="probabilities")
    assert r.n_classes == r.n_outputs == 4 and r.final_activation == "softmax" and r.probabilities_at == "data_owner"
    assert r.accuracy_encrypted == r.accuracy_plaintext and r.accuracy_plaintext > 0.7
    assert r.auc_encrypted == pytest.approx(r.auc_plaintext, abs=1e-4) and r.auc_plaintext > 0.85
    assert r.max_abs_error == r.max_abs_error_vs_exact <= 1e-4  # exact softmax at the data owner
    assert r.approximation_error_vs_exact < 1e-9  # BatchNorm folded + exact polynomial: no approximation
    d = audit.events[-1]["details"]
    assert d["n_classes"] == 4 and d["max_abs_error"] == r.max_abs_error and d["probabilities_at"] == "data_owner"


def test_split_cnn_head_on_encrypted_trunk_features() -> None:
    torch.manual_seed(1)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                        nn.Linear(16, 3)).eval()
    images = torch.randn(120, 1, 8, 8)
    with torch.no_grad():
        labels = cnn(images).argmax(1)  # a task the model solves: accuracy 1 in plaintext
    with pytest.raises(HEUnsupportedLayerError, match=r"'0' \(Conv2d\)"):
        evaluate_encrypted(cnn, images.reshape(120, -1), labels)
    trunk, tail = split_for_he(cnn)
    with torch.no_grad():
        feats = trunk(images)
    r = evaluate_encrypted(tail, feats, labels)
    assert r.n_classes == 3 and r.accuracy_plaintext == 1.0 and r.accuracy_encrypted == r.accuracy_plaintext
    assert r.max_abs_error <= 2e-5 and r.packed  # 120 samples: several features per ciphertext


def test_unsupported_layer_refused_before_any_key(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    audit = MemoryAuditRecorder()
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.raises(HEUnsupportedLayerError) as exc:
        evaluate_encrypted(model, np.zeros((5, 12)), np.zeros(5), audit=audit)
    assert exc.value.layer_path == "3" and exc.value.layer_type == "LayerNorm"
    assert _no_keygen_after_refusal == []
    (ev,) = audit.events
    assert ev["outcome"] == "failure" and ev["details"]["error"] == "HEUnsupportedLayerError"


def test_probabilities_default_to_the_data_owner_and_polynomials_are_refused(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    """The reported defect: logits far outside the sigmoid's fitted [-8, 8] gave probabilities
    in [-2.5, 32.7] with AUC 0.5 and an audited error measured against the approximated model."""
    x, y = _blobs(400, 10, 2, seed=2, spread=3.0)
    model = _train(nn.Sequential(nn.Linear(10, 1), nn.Sigmoid()), x, y, steps=400, binary=True)
    with torch.no_grad():
        model[0].weight.mul_(4.0)  # a confident logistic model: |logit| reaches tens
    audit = MemoryAuditRecorder()
    r = evaluate_encrypted(model, x, y, audit=audit, output="probabilities")
    assert r.probabilities_at == "data_owner" and r.final_activation == "sigmoid"
    assert r.max_abs_error <= 1e-5 and r.auc_encrypted == pytest.approx(r.auc_plaintext, abs=1e-6)
    assert r.auc_plaintext > 0.95

    with pytest.raises(HEModelError, match=r"outside its fitted interval \[-8, 8\]") as exc:
        evaluate_encrypted(model, x, y, audit=audit, output="probabilities", probabilities_at="encrypted")
    assert "probabilities_at='data_owner'" in str(exc.value.hint)
    assert _no_keygen_after_refusal == ["keygen"]  # only the first (accepted) evaluation made keys
    assert audit.events[-1]["outcome"] == "failure"

    with pytest.warns(RuntimeWarning, match="outside its fitted interval"):
        bad = evaluate_encrypted(model, x, y, audit=audit, output="probabilities", probabilities_at="encrypted",
                                 out_of_interval="warn")
    assert bad.out_of_interval_fraction > 0.3
    assert bad.max_abs_error_vs_plan <= 1e-3  # CKKS itself is fine ...
    assert bad.max_abs_error > 1.0  # ... but the released "probabilities" are not; this is what is reported
    assert audit.events[-1]["details"]["max_abs_error"] == bad.max_abs_error


@pytest.mark.slow
def test_deep_mlp_runs_with_calibrated_bounds_and_searched_params() -> None:
    """Depth 5 (the 64-32-16-10 shape's depth, narrower to keep CI fast; the 64-32-16-10 bound
    itself is checked without TenSEAL in test_he_user_models.py): the worst-case bound refuses it,
    the calibrated one admits it, accuracy intact."""
    x, y = _blobs(256, 24, 5, seed=3, spread=0.8)
    model = _train(nn.Sequential(nn.Linear(24, 12), PolyActivation([0.0, 0.5, 0.05]), nn.Linear(12, 8),
                                 PolyActivation([0.0, 0.5, 0.05]), nn.Linear(8, 5)), x, y, steps=200)
    with torch.no_grad():
        for layer in model[::2]:
            layer.weight.mul_(2.0)
    plan = compile_plan(model)
    assert plan.depth == 5
    from securetrain.he import check_plan_fits

    with pytest.raises(HEParameterError, match="headroom"):
        check_plan_fits(plan, choose_params(plan.depth), 2 ** np.ceil(np.log2(np.abs(x).max())))
    r = evaluate_encrypted(model, x, y)
    assert r.value_abs_max < r.value_bound <= 4 * r.value_abs_max
    assert r.accuracy_encrypted == r.accuracy_plaintext > 0.5
    assert r.max_abs_error <= 1e-3 * max(1.0, r.value_abs_max)


@pytest.mark.slow
def test_searched_params_are_faster_than_fixed_at_equal_accuracy() -> None:
    x, y = _blobs(300, 30, 2, seed=4)
    model = _train(nn.Sequential(nn.Linear(30, 16), PolyActivation([0.0, 0.5, 0.1]), nn.Linear(16, 1)), x, y,
                   steps=150, binary=True)
    searched = evaluate_encrypted(model, x, y)
    fixed = evaluate_encrypted(model, x, y, params=choose_params(3))
    assert searched.params["poly_modulus_degree"] == 8192 < fixed.params["poly_modulus_degree"] == 16384
    assert searched.max_abs_error <= 5e-5 and searched.accuracy_encrypted == fixed.accuracy_encrypted
    assert searched.public_context_bytes < fixed.public_context_bytes
    assert searched.ms_per_sample_eval < fixed.ms_per_sample_eval


def test_packed_small_batch_matches_unpacked_and_is_checked() -> None:
    x, y = _blobs(171, 24, 2, seed=5)
    model = _train(nn.Linear(24, 1), x, y, binary=True)
    packed = evaluate_encrypted(model, x, y, packing="on", decimals=6)
    plain = evaluate_encrypted(model, x, y, packing="off", decimals=6)
    assert packed.packed and packed.features_per_ciphertext == 4096 // 171 and not plain.packed
    assert packed.max_abs_error <= 5e-6 and packed.accuracy_encrypted == plain.accuracy_encrypted
    assert packed.ciphertext_bytes_per_sample * 10 < plain.ciphertext_bytes_per_sample
    # The evaluator refuses packed inputs for a plan that is not one affine step.
    params = choose_params(3, scale_bits=None, integer_bits=10)
    owner = DataOwner(params)
    ev = Evaluator(owner.public_context())
    bundle = owner.encrypt(x, pack=True)
    deep = compile_plan(nn.Sequential(nn.Linear(24, 2), PolyActivation([0, 1, 0.1]), nn.Linear(2, 1)))
    with pytest.raises(HEModelError, match="single affine layer"):
        ev.evaluate(deep, bundle)
    with pytest.raises(HEParameterError, match="packing='on'"):
        evaluate_encrypted(deep_model := nn.Sequential(nn.Linear(24, 2), PolyActivation([0, 1, 0.1]),  # noqa: F841
                                                       nn.Linear(2, 1)), x, y, packing="on")
    with pytest.raises(HEParameterError, match="half the slots"):
        owner.encrypt(np.zeros((params.slots, 3)), pack=True)
    # A header that lies about the packing is caught, not summed into garbage.
    from securetrain.he import container

    c = container.decode(bundle)
    fields = {k: v for k, v in c.header.items() if k not in ("kind", "frames")}
    for lie in ({"blocks": 0}, {"blocks": 5}, {"batch_size": 100}):
        forged = container.encode("he-ciphertexts", fields | lie, c.frames)
        with pytest.raises(HEFormatError):
            ev.evaluate(compile_plan(model), forged)


def test_hidden_relu_ranges_are_calibrated_unless_fixed(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    x, y = _blobs(200, 6, 2, seed=8, spread=1.0)
    x = x * 3.0  # pre-activations well beyond the default ReLU interval [-4, 4]
    model = _train(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1)), x, y, steps=200, binary=True)
    with pytest.raises(HEModelError, match=r"approximated relu at '1'.*outside its fitted interval \[-4, 4\]"):
        evaluate_encrypted(model, x, y, approximations={"ReLU": (2, 4.0)})  # a caller-fixed R is not widened
    assert _no_keygen_after_refusal == []
    r = evaluate_encrypted(model, x, y)
    assert r.approximation_ranges["1"] >= 8.0 and r.activation_out_of_range == {"1": 0.0}
    assert r.max_abs_error_vs_plan <= 1e-4  # CKKS is exact w.r.t. the polynomial ...
    assert r.approximation_error_vs_exact > 1e-3  # ... and the polynomial's own error is reported honestly
    assert r.max_abs_error == pytest.approx(r.approximation_error_vs_exact, abs=1e-4)


def test_bad_labels_and_decimals_are_refused_before_any_key(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    model = nn.Linear(3, 2)
    x = np.zeros((4, 3))
    with pytest.raises(HEModelError, match="class ids"):
        evaluate_encrypted(model, x, np.array(["a", "b", "a", "b"]))
    with pytest.raises(HEModelError, match="class ids"):
        evaluate_encrypted(model, x, np.array([0.5, 1, 0, 1]))
    with pytest.raises(HEModelError, match="4 labels for 5 samples"):
        evaluate_encrypted(model, np.zeros((5, 3)), np.zeros(4))
    with pytest.raises(HEParameterError, match="decimals"):
        evaluate_encrypted(model, x, np.zeros(4), decimals=12)
    with pytest.raises(HEModelError, match="takes 3 features"):
        evaluate_encrypted(model, np.zeros((4, 5)), np.zeros(4))
    assert _no_keygen_after_refusal == []


def test_labels_beyond_the_models_classes_are_refused_before_any_key(_no_keygen_after_refusal) -> None:  # noqa: ANN001
    """A label id the model has no score for (a 3-class target on a 1- or 2-column model, or a
    regression target such as sklearn's diabetes) gave a made-up AUC and accuracy instead of an error."""
    x = np.zeros((4, 3))
    with pytest.raises(HEModelError, match=r"class ids 0\.\.1.*label 2"):
        evaluate_encrypted(nn.Linear(3, 1), x, np.array([0, 1, 2, 1]))
    with pytest.raises(HEModelError, match=r"class ids 0\.\.1.*label 2"):
        evaluate_encrypted(nn.Linear(3, 2), x, np.array([0, 1, 2, 1]))
    with pytest.raises(HEModelError, match=r"class ids 0\.\.2.*label 151"):
        evaluate_encrypted(nn.Linear(3, 3), x, np.array([151.0, 75.0, 0.0, 2.0]))
    assert _no_keygen_after_refusal == []
    r = evaluate_encrypted(nn.Linear(3, 3), np.eye(3)[[0, 1, 2, 0]], np.array([0, 1, 2, 2]))  # all K used: fine
    assert r.n_classes == 3


def test_packed_cancelling_features_stay_exact() -> None:
    rng = np.random.default_rng(10)
    a = rng.normal(size=(50, 1))
    x = np.hstack([a, a + 1e-3 * rng.normal(size=(50, 1))])
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1000.0, -1000.0]]))
        model.bias.zero_()
    r = evaluate_encrypted(model, x, packing="on")
    assert r.packed and r.features_per_ciphertext == 2
    assert r.value_bound >= 2 * 1000 * np.abs(a).max()
    assert r.max_abs_error <= 1e-4


def test_report_gives_per_sample_prediction_agreement() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(30, 4))
    torch.manual_seed(3)
    model = nn.Linear(4, 3)
    report = evaluate_encrypted(model, x)  # no labels: agreement needs none
    assert report.prediction_agreement == 1.0 and report.prediction_agreement_vs_plan == 1.0
    assert report.output_range > 1e-2 and report.release_step == pytest.approx(1e-5)
    assert report.accuracy_encrypted is None


# --- what the data owner agrees to decrypt ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_run():  # noqa: ANN201
    from securetrain.he import HEParams, container

    params = HEParams(4096, (38, 30, 38), 30)
    x = np.random.default_rng(5).normal(size=(12, 3))
    plan = compile_plan(nn.Linear(3, 1))
    owner, other = DataOwner(params), DataOwner(params)
    evaluator = Evaluator(owner.public_context())
    inputs = owner.encrypt(x, value_bound=16.0)
    outputs = evaluator.evaluate(plan, inputs)
    foreign = container.decode(other.encrypt(x), expect_kind="he-ciphertexts").frames  # same params, other key
    return owner, evaluator, plan, x, inputs, outputs, list(foreign)


def test_decrypt_refuses_an_inputs_bundle(small_run) -> None:  # noqa: ANN001
    owner, _, _, _, inputs, _, _ = small_run
    with pytest.raises(HEFormatError, match="holds 'inputs' ciphertexts, not an evaluator's outputs"):
        owner.decrypt(inputs)


@pytest.mark.parametrize("factors", [[0.0], ["x"], [1.0, 1.0], [2.0], [None]])
def test_decrypt_refuses_forged_output_factors(small_run, factors) -> None:  # noqa: ANN001
    owner, _, _, _, _, outputs, _ = small_run
    with pytest.raises(HEFormatError, match="output_factors"):
        owner.decrypt(rebundle(outputs, output_factors=factors))


def test_decrypt_refuses_spliced_ciphertexts_beyond_the_bound(small_run) -> None:  # noqa: ANN001
    """Frames encrypted under another key (same parameters, digests recomputed) decrypted to values
    of ~1e7 and were released as scores."""
    owner, evaluator, plan, x, inputs, outputs, foreign = small_run
    honest = owner.decrypt(outputs, max_abs=16.0)
    np.testing.assert_allclose(honest, plan.evaluate_plain(x), atol=1e-3)
    spliced = evaluator.evaluate(plan, rebundle(inputs, frames=foreign))
    with pytest.raises(HEFormatError, match="beyond the bound 16.0 .* nothing is released"):
        owner.decrypt(spliced, max_abs=16.0)


def test_packing_is_not_used_where_its_plaintext_encoding_error_exceeds_the_release_precision() -> None:
    """Unstandardised features (an income in dollars next to z-scores) with a small weight: the
    feature-packed layout multiplies by plaintext *vectors*, whose encoding error per slot is
    ~sqrt(N)·2^-scale in absolute terms, so a feature of 1e6 came back with errors of 3.5e-3 — 700×
    the half release step at decimals=5 — where one feature per ciphertext (a scalar product) gives
    1e-5. `auto` now keeps the unpacked layout there; `on` refuses."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(30, 4))
    x[:, 1] *= 1e6
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight[0, 1] /= 1e6
    r = evaluate_encrypted(model, x)
    assert not r.packed and r.max_abs_error_vs_plan <= 5e-5
    with pytest.raises(HEParameterError, match="packing='on'.*encoding error"):
        evaluate_encrypted(model, x, packing="on")
    from securetrain.he.evaluate import packed_encoding_error

    params = choose_params(1)
    assert packed_encoding_error(x, params) == pytest.approx(
        np.sqrt(8192) * 2.0**-40 * np.linalg.norm(x, axis=1).max())
    r = evaluate_encrypted(model, x / np.abs(x).max(0))  # standardised: packing stays
    assert r.packed and r.max_abs_error_vs_plan <= 1e-5

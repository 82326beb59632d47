"""End-to-end CKKS evaluation on a real dataset (scikit-learn's bundled breast-cancer set)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")
datasets = pytest.importorskip("sklearn.datasets", reason="the [he] extra ships scikit-learn")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from securetrain.audit.recorder import MemoryAuditRecorder  # noqa: E402
from securetrain.he import DataOwner, Evaluator, PolyActivation, compile_plan, evaluate_encrypted  # noqa: E402
from securetrain.he.errors import HEFormatError, HEKeyError, HEParameterError, HEUnavailableError  # noqa: E402
from securetrain.he.params import HEParams, choose_params  # noqa: E402
from securetrain.he.roles import _TenSEALBackend  # noqa: E402
from securetrain.he.strategy import Node, Ops, run_plan  # noqa: E402

pytestmark = pytest.mark.he


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    x, y = datasets.load_breast_cancer(return_X_y=True)
    return (x - x.mean(0)) / x.std(0), y


def _train(model: nn.Module, x: np.ndarray, y: np.ndarray, steps: int = 300) -> nn.Module:
    torch.manual_seed(0)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)[:, None]
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(xt), yt)
        loss = loss + 1e-3 * sum(p.pow(2).sum() for n, p in model.named_parameters() if "weight" in n)
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def logistic(data) -> nn.Module:  # noqa: ANN001
    torch.manual_seed(0)
    return _train(nn.Linear(30, 1), *data)


@pytest.fixture(scope="module")
def mlp(data) -> nn.Module:  # noqa: ANN001
    torch.manual_seed(0)
    return _train(nn.Sequential(nn.Linear(30, 8), PolyActivation([0.0, 0.5, 0.125]), nn.Linear(8, 1)), *data)


def test_logistic_regression_matches_plaintext(data, logistic) -> None:  # noqa: ANN001
    x, y = data
    audit = MemoryAuditRecorder()
    r = evaluate_encrypted(logistic, x, y, audit=audit, packing="off")
    assert r.depth == 1 and r.params["poly_modulus_degree"] == 8192 and not r.packed
    assert r.max_abs_error <= 1e-4 and r.max_abs_error_vs_exact <= 1e-4
    assert round(r.auc_encrypted, 3) == round(r.auc_plaintext, 3) == round(r.auc_exact, 3)
    assert r.auc_encrypted > 0.98  # a real model, so agreement is not trivially 0.5 == 0.5
    assert r.accuracy_encrypted == r.accuracy_plaintext > 0.95
    assert r.ms_per_sample_eval < 3.0 and r.ms_per_sample_end_to_end < 10.0
    assert r.public_context_bytes > 0 and r.secret_context_bytes > 0 and r.ciphertext_bytes_per_sample > 0
    (ev,) = audit.events
    assert ev["action"] == "he.evaluate" and ev["outcome"] == "success"
    d = ev["details"]
    assert d["model_sha256"] == r.model_sha256 and d["inputs_sha256"] == r.inputs_sha256
    assert d["params"] == r.params and d["auc_encrypted"] == r.auc_encrypted
    assert not any(isinstance(v, list) and len(v) == len(x) for v in d.values())  # no per-sample data


def test_mlp_with_poly_activation_matches_plaintext(data, mlp) -> None:  # noqa: ANN001
    x, y = data
    r = evaluate_encrypted(mlp, x, y, decimals=6)
    assert r.depth == 3 and r.max_depth == 3
    assert r.max_abs_error <= 1e-4 and r.max_abs_error_vs_exact <= 1e-4  # poly activation is exact
    assert round(r.auc_encrypted, 3) == round(r.auc_plaintext, 3) and r.auc_encrypted > 0.98
    assert r.accuracy_encrypted == r.accuracy_plaintext


def test_probabilities_with_approximated_sigmoid(data, logistic) -> None:  # noqa: ANN001
    x, y = data
    r = evaluate_encrypted(logistic, x[:200], y[:200], output="probabilities", probabilities_at="encrypted",
                           approximations={"sigmoid": (3, 64.0)})
    assert r.depth == 3 and r.probabilities_at == "encrypted"
    assert r.max_abs_error_vs_plan <= 1e-4  # CKKS noise vs the same approximated model in plaintext
    # ... but the error that is reported (and audited) is against the exact sigmoid, and it is large.
    assert r.max_abs_error == r.max_abs_error_vs_exact == pytest.approx(r.approximation_error_vs_exact, abs=1e-4)
    assert r.max_abs_error > 1e-2
    assert r.activation_out_of_range == {"<output sigmoid>": 0.0} and r.out_of_interval_fraction == 0.0


def test_evaluator_side_cannot_decrypt(data) -> None:  # noqa: ANN001
    x, _ = data
    owner = DataOwner(choose_params(1))
    public = owner.public_context()
    # Raw TenSEAL view of what the evaluator receives: no secret key in the bytes.
    from securetrain.he import container

    ctx = ts.context_from(container.decode(public).frames[0])
    assert not ctx.is_private() and ctx.is_public()
    with pytest.raises(ValueError):
        ctx.secret_key()
    bundle = owner.encrypt(x[:10, :3])
    vec = ts.ckks_vector_from(ctx, container.decode(bundle).frames[0])
    with pytest.raises(ValueError, match="secret"):
        vec.decrypt()
    # Our API refuses in both directions.
    with pytest.raises(HEKeyError, match="public context"):
        DataOwner.from_secret_context(public)
    with pytest.raises(HEKeyError, match="secret key"):
        Evaluator(owner.secret_context())
    # A header that lies about the secret key does not help: the key material itself is checked.
    secret = container.decode(owner.secret_context())
    forged = container.encode("he-context", {k: v for k, v in secret.header.items() if k not in ("kind", "frames")}
                              | {"has_secret_key": False}, secret.frames)
    with pytest.raises(HEKeyError):
        Evaluator(forged)


def test_insecure_and_too_deep_are_refused_before_encryption(data, mlp, monkeypatch) -> None:  # noqa: ANN001
    x, y = data
    with pytest.raises(HEParameterError, match="insecure"):
        evaluate_encrypted(mlp, x, y, params=HEParams(8192, (60, 40, 40, 40, 60), 40))
    encrypted = []
    monkeypatch.setattr(DataOwner, "encrypt", lambda *a, **k: encrypted.append(1))
    monkeypatch.setattr(DataOwner, "__init__", lambda *a, **k: encrypted.append("keygen"))
    audit = MemoryAuditRecorder()
    with pytest.raises(HEParameterError, match="needs multiplicative depth 3 but the parameters provide 2"):
        evaluate_encrypted(mlp, x, y, params=choose_params(2), audit=audit)
    assert encrypted == []  # no keys, no ciphertexts
    assert audit.events[0]["outcome"] == "failure" and audit.events[0]["details"]["error"] == "HEParameterError"


def test_depth_accounting_is_exact_empirically() -> None:
    """The computed depth is exactly what TenSEAL can run: it succeeds with d levels and fails
    with d-1 when our pre-check is bypassed."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 2), PolyActivation([0.1, 0.2, 0.3, 0.4]), nn.Linear(2, 1))
    plan = compile_plan(model)
    assert plan.depth == 3
    x = np.random.default_rng(0).normal(size=(16, 3)) * 0.5

    def raw_run(depth: int, compensate: bool = True) -> np.ndarray:
        p = HEParams(16384, (60,) + (40,) * depth + (60,), 40)
        owner = DataOwner(p)
        ev = Evaluator(owner.public_context())
        nodes = [Node(ts.ckks_vector(owner._ctx, x[:, j].tolist()), 0) for j in range(3)]
        out = run_plan(plan, nodes, Ops(_TenSEALBackend(), ev._ratio if compensate else None))
        return np.asarray(out[0].payload.decrypt())

    np.testing.assert_allclose(raw_run(3), plan.evaluate_plain(x)[:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="scale out of bounds|end of modulus switching chain"):
        raw_run(2, compensate=False)  # (our prime lookup would refuse first; let TenSEAL fail)


def test_batches_rounding_and_context_binding(data, logistic) -> None:  # noqa: ANN001
    x, _ = data
    plan = compile_plan(logistic)
    owner = DataOwner(choose_params(1))
    assert owner.scale_compensation  # our reimplementation of SEAL's prime choice matched the real one
    ev = Evaluator(owner.public_context())
    bundle = owner.encrypt(x, batch_size=200)  # 3 batches, the last one partial
    out = ev.evaluate(plan, bundle)
    scores = owner.decrypt(out, decimals=4)
    np.testing.assert_allclose(scores, plan.evaluate_plain(x), atol=1e-4)
    assert np.all(np.round(scores, 4) == scores)  # released values carry no digits past the 4th
    with pytest.raises(HEParameterError):
        owner.decrypt(out, decimals=12)
    # A bundle from another key pair is refused, not decrypted to garbage.
    other = DataOwner(choose_params(1))
    with pytest.raises(HEKeyError, match="different context"):
        other.decrypt(out)
    with pytest.raises(HEKeyError, match="different context"):
        Evaluator(other.public_context()).evaluate(plan, bundle)
    # Outputs are not valid inputs; truncated bundles are detected.
    with pytest.raises(HEFormatError, match="expected encrypted inputs"):
        ev.evaluate(plan, out)
    with pytest.raises(HEFormatError):
        ev.evaluate(plan, bundle[:-100])


def test_headroom_check_refuses_overflow() -> None:
    big = nn.Linear(3, 1)
    with torch.no_grad():
        big.weight.fill_(1e5)
    plan = compile_plan(big)
    owner = DataOwner(choose_params(1))
    ev = Evaluator(owner.public_context())
    bundle = owner.encrypt(np.full((4, 3), 5.0))
    with pytest.raises(HEParameterError, match="headroom"):
        ev.evaluate(plan, bundle)


def test_missing_tenseal_gives_typed_error(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "tenseal", None)
    with pytest.raises(HEUnavailableError) as exc:
        DataOwner(choose_params(1))
    assert "securetrain[he]" in str(exc.value)
    compile_plan(nn.Linear(3, 1))  # planning needs no tenseal


def test_cli_end_to_end(tmp_path, data, mlp, monkeypatch) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", "11" * 32)  # the secret context is sealed under this KEK

    from securetrain.cli.main import app
    from securetrain.he import save_sequential

    x, y = data
    np.save(tmp_path / "x.npy", x[:300])
    np.save(tmp_path / "y.npy", y[:300])
    save_sequential(mlp, tmp_path / "mlp.safetensors")
    run = CliRunner().invoke
    keys = tmp_path / "keys"
    r = run(app, ["he", "keygen", "--out-dir", str(keys), "--model", str(tmp_path / "mlp.safetensors")])
    assert r.exit_code == 0, r.output
    assert (keys / "secret.stctx").stat().st_mode & 0o077 == 0
    r = run(app, ["he", "encrypt", "--context", str(keys / "secret.stctx"), "--features", str(tmp_path / "x.npy"),
                  "--out", str(tmp_path / "in.stcts"), "--value-bound", "256"])
    assert r.exit_code == 0, r.output
    r = run(app, ["he", "evaluate", "--context", str(keys / "secret.stctx"), "--model", str(tmp_path / "mlp.safetensors"),
                  "--input", str(tmp_path / "in.stcts"), "--out", str(tmp_path / "out.stcts")])
    assert isinstance(r.exception, HEKeyError)  # the evaluator must not be handed the secret key
    r = run(app, ["he", "evaluate", "--context", str(keys / "public.stctx"), "--model", str(tmp_path / "mlp.safetensors"),
                  "--input", str(tmp_path / "in.stcts"), "--out", str(tmp_path / "out.stcts")])
    assert r.exit_code == 0, r.output
    r = run(app, ["he", "decrypt", "--context", str(keys / "secret.stctx"), "--input", str(tmp_path / "out.stcts"),
                  "--encrypted-inputs", str(tmp_path / "in.stcts"),
                  "--labels", str(tmp_path / "y.npy"), "--out", str(tmp_path / "scores.csv")])
    assert r.exit_code == 0, r.output
    scores = np.loadtxt(tmp_path / "scores.csv", delimiter=",")
    expected = compile_plan(mlp).evaluate_plain(x[:300])[:, 0]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    assert '"auc"' in r.output
    # A label the one-column model has no score for: refused, not scored as a made-up AUC.
    np.save(tmp_path / "y3.npy", np.where(np.arange(300) % 7 == 0, 2, y[:300]))
    r = run(app, ["he", "decrypt", "--context", str(keys / "secret.stctx"), "--input", str(tmp_path / "out.stcts"),
                  "--encrypted-inputs", str(tmp_path / "in.stcts"), "--labels", str(tmp_path / "y3.npy")])
    assert r.exit_code != 0 and '"auc"' not in r.output
    assert "class ids 0..1" in str(r.exception) + r.output


def test_cli_probabilities_are_exact_at_decryption_and_calibration_is_recorded(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """`--output probabilities` used to evaluate a polynomial sigmoid on [-8, 8]: logits of ±28
    came back as "probabilities" from -2.5 to 32.7. Now the data owner applies the exact sigmoid."""
    from typer.testing import CliRunner

    from securetrain.cli.main import app
    from securetrain.he import save_sequential
    from securetrain.he.roles import bundle_info

    monkeypatch.setenv("SECURETRAIN_KEK", "22" * 32)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(200, 5))
    model = nn.Sequential(nn.Linear(5, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[9.0, -7.0, 5.0, 3.0, -4.0]]))
    logits = x @ model[0].weight.detach().double().numpy().T + float(model[0].bias.detach())
    assert np.abs(logits).max() > 20  # far outside the polynomial's interval
    y = (logits[:, 0] > 0).astype(int)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    save_sequential(model, tmp_path / "m.safetensors")
    run = CliRunner().invoke
    keys = tmp_path / "keys"
    r = run(app, ["he", "keygen", "--out-dir", str(keys), "--model", str(tmp_path / "m.safetensors"),
                  "--calibrate-features", str(tmp_path / "x.npy")])
    assert r.exit_code == 0, r.output
    assert "calibrated value bound: 128" in r.output and "[50, 40, 50]" in r.output  # searched, not [60, 40, 60]
    r = run(app, ["he", "encrypt", "--context", str(keys / "secret.stctx"), "--features", str(tmp_path / "x.npy"),
                  "--out", str(tmp_path / "in.stcts"), "--calibrate-model", str(tmp_path / "m.safetensors"), "--pack",
                  "--output", "probabilities"])
    assert r.exit_code == 0, r.output
    info = bundle_info((tmp_path / "in.stcts").read_bytes())
    assert info["value_bound"] >= np.abs(logits).max() and info["layout"] == "feature-packed" and info["blocks"] == 5
    r = run(app, ["he", "evaluate", "--context", str(keys / "public.stctx"), "--model", str(tmp_path / "m.safetensors"),
                  "--input", str(tmp_path / "in.stcts"), "--out", str(tmp_path / "out.stcts"), "--output", "probabilities"])
    assert r.exit_code == 0, r.output
    r = run(app, ["he", "decrypt", "--context", str(keys / "secret.stctx"), "--input", str(tmp_path / "out.stcts"),
                  "--encrypted-inputs", str(tmp_path / "in.stcts"),
                  "--labels", str(tmp_path / "y.npy"), "--out", str(tmp_path / "p.csv")])
    assert r.exit_code == 0, r.output
    probs = np.loadtxt(tmp_path / "p.csv", delimiter=",")
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-logits[:, 0])), atol=2e-5)
    assert '"probabilities"' in r.output and '"accuracy": 1.0' in r.output


def test_regression_targets_give_rmse_and_mae_of_encrypted_and_exact_values(data) -> None:  # noqa: ANN001
    """A one-output regression model scored against real-valued targets (no class ids)."""
    x, _ = data
    torch.manual_seed(1)
    model = nn.Linear(30, 1).eval()
    targets = model(torch.tensor(x, dtype=torch.float32)).detach().numpy().reshape(-1) + np.linspace(-1, 1, len(x))
    audit = MemoryAuditRecorder()
    r = evaluate_encrypted(model, x, targets=targets, audit=audit)
    exact = model(torch.tensor(x, dtype=torch.float64).float()).detach().double().numpy().reshape(-1)
    assert r.rmse_plaintext == pytest.approx(float(np.sqrt(np.mean((exact - targets) ** 2))), rel=1e-5)
    assert r.mae_plaintext == pytest.approx(float(np.mean(np.abs(exact - targets))), rel=1e-5)
    assert r.rmse_vs_exact is not None and r.rmse_vs_exact <= r.max_abs_error <= 1e-4
    assert r.rmse_encrypted == pytest.approx(r.rmse_plaintext, abs=2e-4)
    assert r.auc_encrypted is None and r.accuracy_encrypted is None
    assert audit.events[-1]["details"]["rmse_encrypted"] == r.rmse_encrypted
    from securetrain.he.errors import HEModelError

    with pytest.raises(HEModelError, match="not both"):
        evaluate_encrypted(model, x, np.zeros(len(x)), targets=targets)
    with pytest.raises(HEModelError, match="one output column"):
        evaluate_encrypted(nn.Linear(30, 2), x, targets=targets)
    with pytest.raises(HEModelError, match="finite"):
        evaluate_encrypted(model, x, targets=np.full(len(x), np.nan))
    r = evaluate_encrypted(model, x, (targets > 0).astype(int))  # a classifier's report is unchanged
    assert r.rmse_encrypted is None and r.rmse_vs_exact is not None

"""The CLI paths that calibrate (`he keygen --calibrate-features`, `he encrypt --calibrate-model`)
run evaluate_encrypted's tiny-output check: refused under 10 release steps, warned under 100,
before any key (keygen) or ciphertext (encrypt) exists."""

from __future__ import annotations

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")

import torch  # noqa: E402
from he_cli_helpers import run_he  # noqa: E402
from torch import nn  # noqa: E402

from securetrain.he import HEParams, check_release_resolution, compile_plan, save_sequential  # noqa: E402
from securetrain.he.errors import HEParameterError  # noqa: E402

pytestmark = pytest.mark.he


@pytest.fixture()
def files(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", "3e" * 32)
    x = np.random.default_rng(6).normal(size=(40, 3))
    model = nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -0.5, 0.25]]))
        model.bias.zero_()
    spread = float(np.ptp(x @ np.array([1.0, -0.5, 0.25])))
    np.save(tmp_path / "tiny.npy", x * (5e-6 / spread))  # outputs span 5e-6: 0.5 steps at decimals=5
    np.save(tmp_path / "coarse.npy", x * (5e-4 / spread))  # 50 steps at decimals=5: precision lost
    save_sequential(model, tmp_path / "m.safetensors")
    return tmp_path


def test_keygen_refuses_tiny_outputs_before_any_key(files) -> None:  # noqa: ANN001
    keys = files / "keys"
    r = run_he("keygen", "--out-dir", keys, "--model", files / "m.safetensors", "--calibrate-features", files / "tiny.npy")
    assert isinstance(r.exception, HEParameterError), r.output
    assert "rounding noise" in str(r.exception) and "decimals=8" in r.exception.hint
    assert not keys.exists() or not any(keys.iterdir())
    r = run_he("keygen", "--out-dir", keys, "--model", files / "m.safetensors", "--calibrate-features", files / "tiny.npy",
             "--decimals", "8")  # the released digits the hint named: the searched scale resolves them
    assert r.exit_code == 0, (r.output, r.exception)
    r = run_he("keygen", "--out-dir", files / "k2", "--model", files / "m.safetensors", "--calibrate-features",
             files / "tiny.npy", "--decimals", "9")
    assert isinstance(r.exception, HEParameterError)


def test_encrypt_calibrate_model_refuses_or_warns_before_any_ciphertext(files) -> None:  # noqa: ANN001
    keys = files / "keys"
    r = run_he("keygen", "--out-dir", keys, "--model", files / "m.safetensors", "--calibrate-features", files / "tiny.npy",
             "--decimals", "8")
    assert r.exit_code == 0, (r.output, r.exception)
    enc = ("encrypt", "--context", keys / "secret.stctx", "--calibrate-model", files / "m.safetensors")
    r = run_he(*enc, "--features", files / "tiny.npy", "--out", files / "in.stcts")
    assert isinstance(r.exception, HEParameterError) and "rounding noise" in str(r.exception)
    assert not (files / "in.stcts").exists()
    r = run_he(*enc, "--features", files / "tiny.npy", "--out", files / "in.stcts", "--decimals", "8")
    assert r.exit_code == 0 and "WARNING" not in r.output, (r.output, r.exception)
    r = run_he(*enc, "--features", files / "coarse.npy", "--out", files / "in2.stcts")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "WARNING" in r.output and "lose precision" in r.output
    r = run_he("encrypt", "--context", keys / "secret.stctx", "--features", files / "tiny.npy", "--out", files / "in3.stcts",
             "--value-bound", "1")
    assert r.exit_code == 0  # no model (an explicit bound): nothing to check


def test_check_release_resolution_is_the_library_check(files) -> None:  # noqa: ANN001
    plan = compile_plan(nn.Linear(3, 1))
    params = HEParams(8192, (60, 40, 60), 40)
    x = np.random.default_rng(0).normal(size=(30, 3))
    spread, step = check_release_resolution(plan, x, params)
    assert step == 1e-5 and spread == pytest.approx(float(np.ptp(plan.evaluate_plain(x))))
    with pytest.raises(HEParameterError, match="rounding noise"):
        check_release_resolution(plan, x * 1e-9, params)
    with pytest.warns(RuntimeWarning, match="lose precision"):
        check_release_resolution(plan, x * (5e-4 / spread), params)
    with pytest.raises(HEParameterError, match="decimals"):
        check_release_resolution(plan, x, params, decimals=9)


def test_encrypt_calibrates_the_plan_the_evaluator_runs(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """`he encrypt --calibrate-model` calibrated the logits plan even when the evaluator runs the
    polynomial sigmoid (`--output encrypted-probabilities`): bound 16 for values reaching 42, so the
    evaluator's overflow check was unsound. `--output` now names the evaluated plan."""
    from securetrain.he import bundle_info, calibrate

    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", "4f" * 32)
    x = np.random.default_rng(0).normal(size=(64, 5))
    model = nn.Linear(5, 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, -1.5, 1.0, 0.5, 1.0]]))
        model.bias.zero_()
    np.save(tmp_path / "x.npy", x)
    m, keys = tmp_path / "m.safetensors", tmp_path / "keys"
    save_sequential(model, m)
    poly = compile_plan(model, output="probabilities")
    assert calibrate(poly, x).value_bound > calibrate(compile_plan(model), x).value_bound
    for args in (("keygen", "--out-dir", keys, "--model", m, "--output", "encrypted-probabilities",
                  "--calibrate-features", tmp_path / "x.npy"),
                 ("encrypt", "--context", keys / "secret.stctx", "--features", tmp_path / "x.npy", "--out",
                  tmp_path / "in.stcts", "--calibrate-model", m, "--output", "encrypted-probabilities"),
                 ("evaluate", "--context", keys / "public.stctx", "--model", m, "--input", tmp_path / "in.stcts",
                  "--out", tmp_path / "out.stcts", "--output", "encrypted-probabilities"),
                 ("decrypt", "--context", keys / "secret.stctx", "--input", tmp_path / "out.stcts",
                  "--encrypted-inputs", tmp_path / "in.stcts", "--out", tmp_path / "p.csv")):
        r = run_he(*args)
        assert r.exit_code == 0, (args[0], r.output, r.exception)
    assert bundle_info((tmp_path / "in.stcts").read_bytes())["value_bound"] == calibrate(poly, x).value_bound
    np.testing.assert_allclose(np.loadtxt(tmp_path / "p.csv", delimiter=","), poly.evaluate_plain(x)[:, 0], atol=1e-3)


def test_encrypt_pack_refuses_features_the_packed_layout_cannot_resolve(files) -> None:  # noqa: ANN001
    """`he encrypt --pack` on unstandardised features (one column ~1e6): the packed layout's plaintext
    vectors would cost ~3e-3 per released score at decimals=5 (see packed_encoding_error); refused
    before any ciphertext exists, whether the bound comes from a model or from --value-bound."""
    x = np.random.default_rng(7).normal(size=(40, 3))
    x[:, 1] *= 1e6
    np.save(files / "raw.npy", x)
    keys = files / "keys"
    r = run_he("keygen", "--out-dir", keys, "--poly-modulus-degree", "8192", "--coeff-bits", "60,34,60",
               "--scale-bits", "34")
    assert r.exit_code == 0, (r.output, r.exception)
    for bound in (("--value-bound", "4e6"), ("--calibrate-model", files / "m.safetensors")):
        r = run_he("encrypt", "--context", keys / "secret.stctx", "--features", files / "raw.npy", "--pack", *bound,
                   "--out", files / "in.stcts")
        assert isinstance(r.exception, HEParameterError), (bound, r.output, r.exception)
        assert "encoding error" in str(r.exception) and not (files / "in.stcts").exists()
    r = run_he("encrypt", "--context", keys / "secret.stctx", "--features", files / "raw.npy", "--value-bound", "4e6",
               "--out", files / "in.stcts")  # one feature per ciphertext: fine
    assert r.exit_code == 0, (r.output, r.exception)
    np.save(files / "std.npy", x / np.abs(x).max(0))
    r = run_he("encrypt", "--context", keys / "secret.stctx", "--features", files / "std.npy", "--pack",
               "--value-bound", "8", "--out", files / "in2.stcts")
    assert r.exit_code == 0, (r.output, r.exception)

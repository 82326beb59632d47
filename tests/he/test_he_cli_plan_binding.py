"""The data owner's inputs bundle carries a value bound always, and the plan it was calibrated
for; the evaluator (and the data owner at decryption) refuse a different plan or --output.

Left open before: `he encrypt` without `--calibrate-model` wrote a bundle with no value bound (the
evaluator fell back to the worst case, `he decrypt --encrypted-inputs` had nothing to enforce),
and the `--output` the data owner calibrated for was never compared with the one the evaluator
ran: a bound calibrated on logits was trusted for the polynomial sigmoid's larger values."""

from __future__ import annotations

import json

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")

import torch  # noqa: E402
from he_cli_helpers import SMALL_PARAMS, rebundle, run_he  # noqa: E402
from torch import nn  # noqa: E402

from securetrain.he import DataOwner, Evaluator, HEParams, bundle_info, compile_plan, save_sequential  # noqa: E402
from securetrain.he.errors import HEParameterError, HEPlanMismatchError  # noqa: E402

pytestmark = pytest.mark.he

@pytest.fixture(scope="module")
def env(tmp_path_factory):  # noqa: ANN001, ANN201
    mp = pytest.MonkeyPatch()
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        mp.delenv(var, raising=False)
    mp.setenv("SECURETRAIN_KEK", "5d" * 32)
    root = tmp_path_factory.mktemp("he-binding")
    x = np.random.default_rng(5).normal(size=(24, 3))
    torch.manual_seed(5)
    model, other = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()
    np.save(root / "x.npy", x)
    save_sequential(model, root / "m.safetensors")
    save_sequential(other, root / "other.safetensors")
    keys = root / "keys"
    r = run_he("keygen", "--out-dir", keys, *SMALL_PARAMS)
    assert r.exit_code == 0, (r.output, r.exception)
    r = run_he("encrypt", "--context", keys / "secret.stctx", "--features", root / "x.npy", "--out", root / "in.stcts",
             "--calibrate-model", root / "m.safetensors")
    assert r.exit_code == 0, (r.output, r.exception)
    yield {"root": root, "keys": keys, "x": x, "model": model}
    mp.undo()


def _encrypt(env, out, *extra: object):  # noqa: ANN001, ANN202
    return run_he("encrypt", "--context", env["keys"] / "secret.stctx", "--features", env["root"] / "x.npy",
                "--out", out, *extra)


def _evaluate(env, inputs, out, *extra: object, model: str = "m.safetensors"):  # noqa: ANN001, ANN202
    return run_he("evaluate", "--context", env["keys"] / "public.stctx", "--model", env["root"] / model,
                "--input", inputs, "--out", out, *extra)


def test_encrypt_without_a_bound_is_refused(env, tmp_path) -> None:  # noqa: ANN001
    r = _encrypt(env, tmp_path / "in.stcts")
    assert isinstance(r.exception, HEParameterError), r.output
    assert "no value bound" in str(r.exception)
    assert "--calibrate-model" in r.exception.hint and "--value-bound" in r.exception.hint
    assert not (tmp_path / "in.stcts").exists()


def test_explicit_value_bound(env, tmp_path) -> None:  # noqa: ANN001
    r = _encrypt(env, tmp_path / "in.stcts", "--value-bound", "10")
    assert r.exit_code == 0, (r.output, r.exception)
    info = bundle_info((tmp_path / "in.stcts").read_bytes())
    assert info["value_bound"] == 16.0  # a power of two: all the evaluator learns
    assert "plan_sha256" not in info and "output" not in info
    r = _encrypt(env, tmp_path / "in2.stcts", "--value-bound", "10", "--output", "probabilities")
    assert r.exit_code == 0, (r.output, r.exception)
    assert bundle_info((tmp_path / "in2.stcts").read_bytes())["output"] == "probabilities"
    for bad in ("0", "-4", "nan", "inf"):
        r = _encrypt(env, tmp_path / "bad.stcts", "--value-bound", bad)
        assert isinstance(r.exception, HEParameterError), bad
    r = _encrypt(env, tmp_path / "bad.stcts", "--value-bound", "10", "--calibrate-model", env["root"] / "m.safetensors")
    assert isinstance(r.exception, HEParameterError) and "not both" in str(r.exception)
    r = _encrypt(env, tmp_path / "bad.stcts", "--value-bound", "10", "--output", "nonsense")
    assert isinstance(r.exception, HEParameterError | HEPlanMismatchError) or r.exit_code != 0
    assert not (tmp_path / "bad.stcts").exists()
    # The explicit bound is enforced at decryption like a calibrated one.
    r = _evaluate(env, tmp_path / "in.stcts", tmp_path / "out.stcts")
    assert r.exit_code == 0, (r.output, r.exception)
    r = run_he("decrypt", "--context", env["keys"] / "secret.stctx", "--input", tmp_path / "out.stcts",
             "--encrypted-inputs", tmp_path / "in.stcts")
    assert r.exit_code == 0, (r.output, r.exception)
    # An explicit --output is the evaluator's too.
    r = _evaluate(env, tmp_path / "in2.stcts", tmp_path / "out2.stcts")
    assert isinstance(r.exception, HEPlanMismatchError), r.output
    assert not (tmp_path / "out2.stcts").exists()


def test_the_bundle_names_the_calibrated_plan(env) -> None:  # noqa: ANN001
    info = bundle_info((env["root"] / "in.stcts").read_bytes())
    assert info["plan_sha256"] == compile_plan(env["model"]).sha256()
    assert info["output"] == "logits"


@pytest.mark.parametrize(("extra", "model", "what"), [
    (("--output", "probabilities"), "m.safetensors", "--output"),
    (("--output", "encrypted-probabilities"), "m.safetensors", "--output"),
    ((), "other.safetensors", "plan"),
])
def test_evaluator_refuses_another_plan_or_output(env, tmp_path, extra, model, what) -> None:  # noqa: ANN001
    r = _evaluate(env, env["root"] / "in.stcts", tmp_path / "out.stcts", *extra, model=model)
    assert isinstance(r.exception, HEPlanMismatchError), r.output
    assert what in str(r.exception) and r.exception.hint
    assert not (tmp_path / "out.stcts").exists()


def test_matching_plan_runs_and_decrypt_checks_it_too(env, tmp_path) -> None:  # noqa: ANN001
    r = _evaluate(env, env["root"] / "in.stcts", tmp_path / "out.stcts")
    assert r.exit_code == 0, (r.output, r.exception)
    decrypt = ("decrypt", "--context", env["keys"] / "secret.stctx", "--encrypted-inputs", env["root"] / "in.stcts")
    r = run_he(*decrypt, "--input", tmp_path / "out.stcts", "--out", tmp_path / "s.csv")
    assert r.exit_code == 0, (r.output, r.exception)
    scores = np.loadtxt(tmp_path / "s.csv", delimiter=",")
    np.testing.assert_allclose(scores, compile_plan(env["model"]).evaluate_plain(env["x"])[:, 0], atol=1e-3)
    # An evaluator that skipped the check (the outputs header is the evaluator's word): the data
    # owner compares it with its own inputs bundle before decrypting anything.
    outputs = (tmp_path / "out.stcts").read_bytes()
    for forged in ({"model_sha256": "0" * 64}, {"final_activation": "sigmoid"},
                   {"output": "probabilities", "final_activation": None}):
        (tmp_path / "forged.stcts").write_bytes(rebundle(outputs, **forged))
        r = run_he(*decrypt, "--input", tmp_path / "forged.stcts", "--out", tmp_path / "leak.csv")
        assert isinstance(r.exception, HEPlanMismatchError), (forged, r.output)
        assert not (tmp_path / "leak.csv").exists()


def test_library_binding() -> None:
    x = np.random.default_rng(1).normal(size=(8, 3))
    plan, other = compile_plan(nn.Linear(3, 1).double()), compile_plan(nn.Linear(3, 1).double())
    owner = DataOwner(HEParams(4096, (38, 30, 38), 30))
    evaluator = Evaluator(owner.public_context())
    inputs = owner.encrypt(x, value_bound=16.0, plan_sha256=plan.sha256(), output="logits")
    with pytest.raises(HEPlanMismatchError, match="plan"):
        evaluator.evaluate(other, inputs)
    with pytest.raises(HEPlanMismatchError, match="--output"):
        evaluator.evaluate(plan, inputs, final_activation="sigmoid")
    out = evaluator.evaluate(plan, inputs)
    assert json.loads(json.dumps(bundle_info(out)))["model_sha256"] == plan.sha256()
    for bad in ({"plan_sha256": "xyz"}, {"output": "logit"}):
        with pytest.raises(HEParameterError):
            owner.encrypt(x, value_bound=16.0, **bad)  # type: ignore[arg-type]

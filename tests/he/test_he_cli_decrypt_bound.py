"""`securetrain he decrypt` enforces the data owner's value bound, like `DataOwner.decrypt(max_abs=...)`.

The bound comes from the data owner's own copy of the inputs bundle (`--encrypted-inputs`) or from
`--max-abs`, never from the evaluator's outputs file, which an untrusted evaluator writes."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")

import torch  # noqa: E402
from he_cli_helpers import SMALL_PARAMS, rebundle, run_he  # noqa: E402
from torch import nn  # noqa: E402

from securetrain.he import DataOwner, Evaluator, HEParams, compile_plan, container, save_sequential  # noqa: E402
from securetrain.he.errors import HEFormatError, HEKeyError, HEParameterError  # noqa: E402

pytestmark = pytest.mark.he

def _json(output: str) -> dict:
    return json.loads(output[output.index("{"):output.rindex("}") + 1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):  # noqa: ANN001, ANN201
    mp = pytest.MonkeyPatch()
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        mp.delenv(var, raising=False)
    mp.setenv("SECURETRAIN_KEK", "7c" * 32)
    root = tmp_path_factory.mktemp("he-bound")
    x = np.random.default_rng(4).normal(size=(24, 3))
    torch.manual_seed(4)
    model = nn.Linear(3, 1).double()
    np.save(root / "x.npy", x)
    save_sequential(model, root / "m.safetensors")
    keys = root / "keys"
    for args in (("keygen", "--out-dir", keys, *SMALL_PARAMS),
                 ("encrypt", "--context", keys / "secret.stctx", "--features", root / "x.npy", "--out", root / "in.stcts",
                  "--calibrate-model", root / "m.safetensors"),
                 ("encrypt", "--context", keys / "secret.stctx", "--features", root / "x.npy", "--out",
                  root / "uncal-vb.stcts", "--value-bound", "16"),
                 ("evaluate", "--context", keys / "public.stctx", "--model", root / "m.safetensors", "--input",
                  root / "in.stcts", "--out", root / "out.stcts"),
                 ("evaluate", "--context", keys / "public.stctx", "--model", root / "m.safetensors", "--input",
                  root / "uncal.stcts", "--out", root / "out-uncal.stcts")):
        if args[0] == "evaluate" and not (root / "uncal.stcts").exists():
            # An inputs bundle without a value bound, as `he encrypt` wrote without --calibrate-model
            # before it required a bound.
            c = container.decode((root / "uncal-vb.stcts").read_bytes(), expect_kind="he-ciphertexts")
            fields = {k: v for k, v in c.header.items() if k not in ("frames", "kind", "value_bound")}
            (root / "uncal.stcts").write_bytes(container.encode("he-ciphertexts", fields, list(c.frames)))
        r = run_he(*args)
        assert r.exit_code == 0, (r.output, r.exception)
    # An untrusted evaluator splices in ciphertexts under another key of the same parameters and
    # claims the owner's inputs digest: without a bound these decrypt to huge values and are released.
    inputs = (root / "in.stcts").read_bytes()
    foreign = container.decode(DataOwner(HEParams(4096, (38, 30, 38), 30)).encrypt(x), expect_kind="he-ciphertexts")
    evaluator = Evaluator((keys / "public.stctx").read_bytes())
    spliced = evaluator.evaluate(compile_plan(model), rebundle(inputs, frames=list(foreign.frames)))
    (root / "spliced.stcts").write_bytes(rebundle(spliced, inputs_sha256=hashlib.sha256(inputs).hexdigest()))
    yield {"root": root, "keys": keys, "x": x, "model": model}
    mp.undo()


def _decrypt(run, outputs: str, *extra: object):  # noqa: ANN001, ANN202
    root = run["root"]
    return run_he("decrypt", "--context", run["keys"] / "secret.stctx", "--input", root / outputs, *extra)


def test_encrypted_inputs_bound_releases_honest_scores(run) -> None:  # noqa: ANN001
    root = run["root"]
    r = _decrypt(run, "out.stcts", "--encrypted-inputs", root / "in.stcts", "--out", root / "s.csv")
    assert r.exit_code == 0, (r.output, r.exception)
    bound = container.decode((root / "in.stcts").read_bytes()).header["value_bound"]
    assert _json(r.output)["value_bound"] == bound and "no value bound" not in r.output
    scores = np.loadtxt(root / "s.csv", delimiter=",")
    np.testing.assert_allclose(scores, compile_plan(run["model"]).evaluate_plain(run["x"])[:, 0], atol=1e-3)


def test_spliced_outputs_are_refused_with_the_owners_bound(run, tmp_path) -> None:  # noqa: ANN001
    root = run["root"]
    # No bound: refused before anything is opened (it used to release the spliced values with a warning).
    r = _decrypt(run, "spliced.stcts", "--out", tmp_path / "leak.csv")
    assert isinstance(r.exception, HEParameterError), r.output
    assert "--encrypted-inputs" in (r.exception.hint or "") and not (tmp_path / "leak.csv").exists()
    # Only the explicit opt-out releases them, with a warning.
    r = _decrypt(run, "spliced.stcts", "--no-value-bound", "--out", tmp_path / "leak.csv")
    assert r.exit_code == 0 and "no value bound" in r.output
    assert np.max(np.abs(np.loadtxt(tmp_path / "leak.csv", delimiter=","))) > 1e3
    r = _decrypt(run, "spliced.stcts", "--no-value-bound", "--max-abs", "16")
    assert isinstance(r.exception, HEParameterError) and "contradicts" in str(r.exception)
    for extra in (("--encrypted-inputs", root / "in.stcts"), ("--max-abs", "16")):
        r = _decrypt(run, "spliced.stcts", *extra, "--out", tmp_path / "s.csv")
        assert isinstance(r.exception, HEFormatError), r.output
        assert "beyond the bound" in str(r.exception) and "nothing is released" in str(r.exception)
        assert not (tmp_path / "s.csv").exists()


def test_encrypted_inputs_must_be_the_owners_calibrated_inputs_of_these_scores(run, tmp_path) -> None:  # noqa: ANN001
    root = run["root"]
    r = _decrypt(run, "out.stcts", "--encrypted-inputs", root / "uncal.stcts")
    assert isinstance(r.exception, HEFormatError) and "not computed from" in str(r.exception)
    r = _decrypt(run, "out-uncal.stcts", "--encrypted-inputs", root / "uncal.stcts")
    assert isinstance(r.exception, HEParameterError) and "no calibrated value bound" in str(r.exception)
    assert "--calibrate-model" in r.exception.hint
    r = _decrypt(run, "out.stcts", "--encrypted-inputs", root / "out.stcts")
    assert isinstance(r.exception, HEFormatError) and "not the inputs you encrypted" in str(r.exception)
    r = _decrypt(run, "out.stcts", "--encrypted-inputs", root / "in.stcts", "--max-abs", "16")
    assert isinstance(r.exception, HEParameterError)
    for bad in ("0", "-1", "nan", "inf"):
        r = _decrypt(run, "out.stcts", "--max-abs", bad)
        assert isinstance(r.exception, HEParameterError), bad
    other = DataOwner(HEParams(4096, (38, 30, 38), 30)).encrypt(run["x"], value_bound=16.0)
    (tmp_path / "other.stcts").write_bytes(other)
    r = _decrypt(run, "out.stcts", "--encrypted-inputs", tmp_path / "other.stcts")
    assert isinstance(r.exception, HEKeyError)

"""Model → plan conversion, depth accounting, approximations, model files, container format."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from torch import nn

from securetrain.he import container
from securetrain.he.approximations import fit_activation
from securetrain.he.errors import HEFormatError, HEModelError
from securetrain.he.model_io import load_sequential, save_sequential
from securetrain.he.modules import PolyActivation, Square
from securetrain.he.plan import HEPlan, LinearStep, compile_plan, reference_forward


def _x(n: int = 50, d: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


def test_logistic_depth_and_exactness() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 1), nn.Sigmoid())
    logits = compile_plan(m)
    assert logits.depth == 1 and logits.output == "logits"  # trailing sigmoid dropped
    x = _x()
    np.testing.assert_allclose(logits.evaluate_plain(x), reference_forward(m, x, "logits"), atol=1e-12)
    probs = compile_plan(m, output="probabilities")
    assert probs.depth == 3  # 1 (affine) + ceil(log2(3+1)) (cubic)
    assert probs.approximations[0].activation == "sigmoid"


@pytest.mark.parametrize("degree,extra", [(2, 2), (3, 2), (4, 3), (5, 3), (7, 3), (8, 4)])
def test_poly_depth_formula(degree: int, extra: int) -> None:
    coeffs = [0.1] * (degree + 1)
    m = nn.Sequential(nn.Linear(6, 4), PolyActivation(coeffs), nn.Linear(4, 1))
    plan = compile_plan(m)
    assert plan.depth == 1 + extra
    # The numpy run of the exact operation sequence equals the torch model (no approximation).
    x = _x() * 0.5
    np.testing.assert_allclose(plan.evaluate_plain(x), reference_forward(m, x, "logits"), rtol=1e-10, atol=1e-10)


def test_fusion_saves_depth() -> None:
    m = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3), PolyActivation([1.0, 2.0]), nn.Linear(3, 1), Square())
    plan = compile_plan(m)
    # Linear∘Linear∘affine∘Linear collapses to one affine step; then x² (+2 fused with identity).
    assert sum(isinstance(s, LinearStep) for s in plan.steps) == 1
    assert plan.depth == 3
    x = _x()
    np.testing.assert_allclose(plan.evaluate_plain(x), reference_forward(m, x, "logits"), rtol=1e-9)


def test_mlp_with_approximated_activation() -> None:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))
    plan = compile_plan(m, approximations={"tanh": (3, 3.0)})
    assert plan.depth == 3
    fit = plan.approximations[0]
    assert (fit.degree, fit.input_range) == (3, 3.0)
    x = _x() * 0.3
    err = np.abs(plan.evaluate_plain(x) - reference_forward(m.eval(), x, "logits")).max()
    assert 0 < err < 0.5  # an approximation, not the exact model


def test_unsupported_layers_are_refused() -> None:
    with pytest.raises(HEModelError, match=r"layer '1' \(LayerNorm\) cannot be evaluated"):
        compile_plan(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)))
    with pytest.raises(HEModelError, match="expects"):
        compile_plan(nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 1)))
    with pytest.raises(HEModelError, match="constant"):
        compile_plan(nn.Sequential(nn.Linear(3, 4), PolyActivation([1.0, 0.0]), nn.Linear(4, 1)))


def test_fit_activation_reports_its_error() -> None:
    s = fit_activation("sigmoid", 3, 8.0)
    xs = np.linspace(-8, 8, 1001)
    true = 1 / (1 + np.exp(-xs))
    assert np.max(np.abs(s(xs) - true)) == pytest.approx(s.max_abs_error, rel=0.05)
    assert s.coeffs[0] == pytest.approx(0.5) and s.coeffs[2] == 0.0  # odd symmetry kept exactly
    assert 0.05 < s.max_abs_error < 0.15
    assert fit_activation("sigmoid", 3, 4.0).max_abs_error < s.max_abs_error / 2  # smaller range, better fit
    with pytest.raises(HEModelError):
        fit_activation("sigmoid", 0, 8.0)


def test_plan_dict_roundtrip_and_digest() -> None:
    torch.manual_seed(2)
    plan = compile_plan(nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 1)))
    again = HEPlan.from_dict(plan.to_dict())
    assert again.sha256() == plan.sha256()
    d = plan.to_dict()
    d["steps"][0]["weight"][0][0] += 1e-9
    assert HEPlan.from_dict(d).sha256() != plan.sha256()
    with pytest.raises(HEModelError):
        HEPlan.from_dict({**plan.to_dict(), "format": "other"})


def test_model_file_roundtrip(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 4), Square(), nn.Linear(4, 2), PolyActivation([0, 1, 0.5]), nn.Linear(2, 1))
    sha = save_sequential(m, tmp_path / "m.safetensors")
    loaded, sha2 = load_sequential(tmp_path / "m.safetensors")
    assert sha == sha2
    x = _x()
    np.testing.assert_allclose(reference_forward(loaded, x, "logits"), reference_forward(m, x, "logits"), rtol=1e-6)
    assert compile_plan(loaded).sha256() == compile_plan(m.double()).sha256()


def test_model_file_attacks(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import save

    path = tmp_path / "m.safetensors"
    save_sequential(nn.Sequential(nn.Linear(3, 1)), path)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-5])
    with pytest.raises(HEFormatError):
        load_sequential(tmp_path / "trunc.safetensors")
    # No metadata (e.g. a pickle-free but foreign file) is refused, not guessed.
    (tmp_path / "plain.safetensors").write_bytes(save({"0.weight": torch.zeros(1, 3)}))
    with pytest.raises(HEFormatError, match="metadata"):
        load_sequential(tmp_path / "plain.safetensors")
    # Declared layers that do not match the weights.
    meta = '{"format": "securetrain.sequential/1", "layers": [{"type": "Linear", "in_features": 5, "out_features": 1, "bias": true}]}'
    (tmp_path / "bad.safetensors").write_bytes(save({"0.weight": torch.zeros(1, 3, dtype=torch.float64),
                                                     "0.bias": torch.zeros(1, dtype=torch.float64)},
                                                    metadata={"securetrain.model": meta}))
    with pytest.raises(HEFormatError, match="do not match"):
        load_sequential(tmp_path / "bad.safetensors")
    evil = '{"format": "securetrain.sequential/1", "layers": [{"type": "__import__"}]}'
    (tmp_path / "evil.safetensors").write_bytes(save({"x": torch.zeros(1)}, metadata={"securetrain.model": evil}))
    with pytest.raises(HEModelError, match="unsupported layer"):
        load_sequential(tmp_path / "evil.safetensors")


# --- container ----------------------------------------------------------------------------------


def test_container_roundtrip_and_attacks() -> None:
    blob = container.encode("he-ciphertexts", {"n": 2}, [b"alpha", b"", b"gamma" * 100])
    c = container.decode(blob, expect_kind="he-ciphertexts")
    assert c.frames == (b"alpha", b"", b"gamma" * 100) and c.header["n"] == 2
    with pytest.raises(HEFormatError, match="expected a 'he-context'"):
        container.decode(blob, expect_kind="he-context")
    for cut in (3, 12, len(blob) - 1):
        with pytest.raises(HEFormatError):
            container.decode(blob[:cut])
    with pytest.raises(HEFormatError, match="trailing"):
        container.decode(blob + b"\0")
    flipped = bytearray(blob)
    flipped[-10] ^= 0x01
    with pytest.raises(HEFormatError, match="SHA-256"):
        container.decode(bytes(flipped))
    with pytest.raises(HEFormatError, match="bad magic"):
        container.decode(b"PK\x03\x04" + blob[4:])
    # A header claiming a huge length must not be trusted.
    huge = container.MAGIC + struct.pack(">I", 2**31) + b"{}"
    with pytest.raises(HEFormatError, match="header length"):
        container.decode(huge)
    # Swapping two frames (splicing) is caught by the per-frame digests.
    hdr_len = struct.unpack_from(">I", blob, 8)[0]
    body = blob[12 + hdr_len:]
    a = struct.pack(">Q", 5) + b"alpha"
    b = struct.pack(">Q", 5) + b"omega"
    with pytest.raises(HEFormatError):
        container.decode(blob[: 12 + hdr_len] + body.replace(a, b))

"""User models → HE plans without TenSEAL: layer tracing and typed errors, BatchNorm folding,
split_for_he, calibration and the parameter search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from securetrain.he import (
    HEModelError,
    HEParameterError,
    HEUnsupportedLayerError,
    PolyActivation,
    Square,
    calibrate,
    check_plan_fits,
    choose_params,
    compile_plan,
    save_sequential,
    split_for_he,
)
from securetrain.he.evaluate import min_scale_bits_for
from securetrain.he.plan import LinearStep, exact_logits, reference_forward


def _x(n: int = 40, d: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


def _randomise_bn(bn: nn.BatchNorm1d, seed: int = 0) -> nn.BatchNorm1d:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
        bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(bn.num_features, generator=g))
        bn.bias.copy_(torch.randn(bn.num_features, generator=g))
    return bn


class CNN(nn.Module):
    """A CNN-like user model: conv trunk, then a linear head, written as a custom forward."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        h = h.view(h.size(0), -1)
        return torch.softmax(self.head(self.norm(h)), dim=1)


# --- unsupported layers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,path,type_name",
    [
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1)), "0", "Conv2d"),
        (nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 1)), "1.1", "LayerNorm"),
        (nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(), nn.Linear(4, 1)), "1", "LeakyReLU"),
        (nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=1), nn.Linear(4, 2)), "1", "Softmax"),
        (CNN(), "features.0", "Conv2d"),
    ],
)
def test_unsupported_layer_is_named_by_path_and_type(model: nn.Module, path: str, type_name: str) -> None:
    with pytest.raises(HEUnsupportedLayerError) as exc:
        compile_plan(model)
    assert (exc.value.layer_path, exc.value.layer_type) == (path, type_name)
    assert f"layer '{path}' ({type_name}) cannot be evaluated" in str(exc.value)
    assert "split_for_he" in str(exc.value)  # the hint says what to do
    assert "no polynomial approximation" not in str(exc.value)  # the old misleading message
    assert isinstance(exc.value, HEModelError)


def test_batchnorm_without_running_stats_and_residuals_are_refused() -> None:
    with pytest.raises(HEUnsupportedLayerError, match=r"'1' \(BatchNorm1d\).*running statistics"):
        compile_plan(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)))

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + x)

    with pytest.raises(HEModelError, match="straight chain"):
        compile_plan(Residual())

    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) if x.sum() > 0 else -self.a(x)

    with pytest.raises(HEModelError, match="cannot read the structure of Dynamic"):
        compile_plan(Dynamic())


# --- folding and no-ops ---------------------------------------------------------------------------


def test_batchnorm_is_folded_into_the_neighbouring_linear() -> None:
    torch.manual_seed(0)
    with_bn = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 5), _randomise_bn(nn.BatchNorm1d(5), 1), Square(),
                            nn.Linear(5, 3), _randomise_bn(nn.BatchNorm1d(3), 2))
    _randomise_bn(with_bn[0], 3)
    with_bn.train()  # a model left in training mode is still evaluated with its running statistics
    plan = compile_plan(with_bn)
    # BN→Linear→BN collapses into one affine step; the final BN into the last one: no extra depth.
    assert [type(s).__name__ for s in plan.steps] == ["LinearStep", "PolyStep", "LinearStep"]
    assert plan.depth == compile_plan(nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3))).depth == 3
    x = _x()
    with torch.no_grad():
        expected = with_bn.double().eval()(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(plan.evaluate_plain(x), expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(reference_forward(with_bn.train(), x, "logits"), expected, rtol=1e-12)
    assert with_bn.training  # the caller's model is not put into eval mode behind its back


def test_flatten_identity_dropout_are_noops() -> None:
    torch.manual_seed(1)
    core = nn.Sequential(nn.Linear(6, 4), PolyActivation([0.0, 1.0, 0.25]), nn.Linear(4, 2))
    noisy = nn.Sequential(nn.Flatten(), nn.Identity(), core[0], nn.Dropout(0.5), core[1], nn.Identity(), core[2],
                          nn.Flatten())
    assert compile_plan(noisy).sha256() == compile_plan(core).sha256()


def test_final_activation_is_dropped_and_functional_chains_are_read() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.flatten(x, 1)
            return self.b(torch.tanh(self.a(x.view(x.shape[0], -1)))).log_softmax(dim=-1)

    torch.manual_seed(2)
    m = Functional()
    plan = compile_plan(m, approximations={"tanh": (3, 4.0)})
    assert plan.n_outputs == 3 and plan.approximations[0].activation == "tanh"
    logits, final = exact_logits(m, _x())
    assert final == "log_softmax"
    probs = reference_forward(m, _x(), "probabilities")
    with torch.no_grad():
        np.testing.assert_allclose(probs, m.double()(torch.as_tensor(_x())).exp().numpy(), rtol=1e-9)
    with pytest.raises(HEModelError, match="log_softmax"):
        compile_plan(m, output="probabilities")  # softmax has no polynomial form


# --- split_for_he ---------------------------------------------------------------------------------


def test_split_custom_cnn_with_batchnorm_head() -> None:
    torch.manual_seed(3)
    m = CNN().eval()
    _randomise_bn(m.norm)
    trunk, tail = split_for_he(m)
    assert [type(t).__name__ for t in tail] == ["BatchNorm1d", "Linear", "Softmax"]
    assert tail[1] is m.head  # the model's own modules, not copies
    x = torch.randn(5, 1, 6, 6)
    with torch.no_grad():
        feats = trunk(x)
        assert feats.shape == (5, 16)
        torch.testing.assert_close(tail(feats), m(x))
    plan = compile_plan(tail)
    assert plan.depth == 1 and plan.n_inputs == 16 and plan.n_outputs == 3  # BN folded into the head


def test_split_sequential_variants() -> None:
    torch.manual_seed(4)
    seq = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, 8), nn.Tanh(),
                        nn.Linear(8, 1), nn.Sigmoid()).eval()
    x = torch.randn(3, 1, 6, 6)
    trunk, tail = split_for_he(seq)
    assert [type(t).__name__ for t in tail] == ["Linear", "Sigmoid"]
    torch.testing.assert_close(tail(trunk(x)), seq(x))
    trunk, tail = split_for_he(seq, exact=False)  # approximated activations may go to the HE side too
    assert [type(t).__name__ for t in tail] == ["Linear", "Tanh", "Linear", "Sigmoid"]
    assert trunk(x).shape == (3, 32)  # Flatten/Dropout stay in the trunk
    torch.testing.assert_close(tail(trunk(x)), seq(x))
    whole = nn.Sequential(nn.Linear(5, 3), PolyActivation([0, 1, 0.1]), nn.Linear(3, 2))
    trunk, tail = split_for_he(whole)  # a tabular MLP is HE-evaluable as a whole
    assert isinstance(trunk, nn.Identity) and len(tail) == 3
    with pytest.raises(HEModelError, match=r"does not end in a linear head.*'1' \(ReLU\)"):
        split_for_he(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(HEModelError, match="does not end in a linear head"):
        split_for_he(nn.Sequential(nn.Linear(3, 3), nn.Conv1d(1, 1, 1)))


def test_split_untraceable_model_with_named_head() -> None:
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.fc = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            if h.mean() > 100:  # data-dependent control flow: torch.fx cannot trace this
                h = h * 0
            return self.fc(torch.relu(h))

    m = Dynamic()
    trunk, tail = split_for_he(m)
    x = torch.randn(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(tail(trunk(x)), m(x))

    class NoHead(Dynamic):
        def __init__(self) -> None:
            super().__init__()
            self.proj = self.fc
            del self.fc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.body(x)) if x.sum() > 0 else self.proj(x)

    with pytest.raises(HEModelError, match="cannot split NoHead"):
        split_for_he(NoHead())


# --- calibration and parameters -------------------------------------------------------------------


def _deep_mlp(gain: float = 3.0) -> nn.Sequential:
    """64-32-16-10 with square-ish activations: calibrated values stay small, the worst case explodes."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(64, 32), PolyActivation([0.0, 1.0, 0.1]), nn.Linear(32, 16),
                      PolyActivation([0.0, 1.0, 0.1]), nn.Linear(16, 10))
    with torch.no_grad():
        for layer in m[::2]:
            layer.weight.mul_(gain)
    return m.double().eval()


def test_calibrated_bound_admits_what_the_worst_case_refuses() -> None:
    plan = compile_plan(_deep_mlp())
    x = np.clip(_x(2000, 64, seed=6), -4, 4)
    cal = calibrate(plan, x)
    assert 20 < cal.value_abs_max < 1000 and cal.value_bound >= 2 * cal.value_abs_max
    params = choose_params(plan.depth)
    with pytest.raises(HEParameterError, match="headroom") as exc:
        check_plan_fits(plan, params, 4.0)  # sound interval bound for |x| ≤ 4: far too pessimistic
    assert check_plan_fits(plan, params, value_bound=cal.value_bound) == plan.depth
    # The refusal's hint names a choose_params call that choose_params accepts and that fits.
    hint = exc.value.hint
    assert hint is not None and "choose_params(" in hint and "larger first prime" not in hint
    call = hint.split("use ", 1)[1].split(", or", 1)[0]
    suggested = eval(call, {"choose_params": choose_params})  # noqa: S307 - our own hint text
    assert isinstance(suggested, type(params))
    assert check_plan_fits(plan, suggested, 4.0) == plan.depth


def test_choose_params_searches_ring_size_and_scale() -> None:
    fixed = choose_params(3)
    assert fixed.poly_modulus_degree == 16384
    searched = choose_params(3, scale_bits=None, integer_bits=None, value_bound=32.0)
    assert searched.poly_modulus_degree == 8192 and searched.max_depth == 3
    assert 30 <= searched.scale_bits <= 40 and searched.integer_bits >= 8  # log2(32) + 3
    assert searched.total_bits <= 218
    # Depth 1 with small values fits N=4096 if a lower scale is acceptable, not otherwise.
    assert choose_params(1, scale_bits=None, integer_bits=None, value_bound=4.0).poly_modulus_degree == 4096
    assert choose_params(1, scale_bits=None, integer_bits=None, value_bound=4.0, min_scale_bits=34
                         ).poly_modulus_degree == 8192
    assert [min_scale_bits_for(d) for d in (2, 5, 8)] == [30, 34, 40]
    # Larger values cost headroom, never security.
    big = choose_params(3, scale_bits=None, integer_bits=None, value_bound=1e5)
    assert big.integer_bits >= 20 and big.total_bits <= 218
    with pytest.raises(HEParameterError, match="no 128-bit secure parameter set") as exc:
        choose_params(30, scale_bits=None, integer_bits=None, value_bound=2.0)
    assert "min_scale_bits" in str(exc.value)
    with pytest.raises(HEParameterError, match="60-bit prime limit") as exc:
        choose_params(3, integer_bits=23)
    assert "scale_bits=None" in str(exc.value)  # the hint is a call choose_params accepts
    assert choose_params(3, scale_bits=None, integer_bits=23).coeff_mod_bit_sizes[0] <= 60
    with pytest.raises(HEParameterError):
        choose_params(1, scale_bits=None, integer_bits=None, value_bound=float("nan"))


def test_calibration_reports_out_of_interval_fraction() -> None:
    torch.manual_seed(7)
    m = nn.Sequential(nn.Linear(6, 1))
    with torch.no_grad():
        m[0].weight.mul_(20)
    plan = compile_plan(m, output="probabilities")  # polynomial sigmoid on [-8, 8]
    x = _x(500)
    cal = calibrate(plan, x)
    z = np.abs(x @ m[0].weight.detach().double().numpy().T + m[0].bias.item())
    assert cal.out_of_interval == pytest.approx((float(np.mean(z > 8.0)),))
    assert cal.out_of_interval_fraction > 0.2 and cal.preactivation_abs_max[0] == pytest.approx(z.max())
    assert isinstance(plan.steps[0], LinearStep)


def test_packed_bound_covers_partial_sums() -> None:
    """Blocks of the packed layout hold partial sums, which the plain pass never computes."""
    from securetrain.he.calibration import packed_abs_max

    a = _x(30, 1, seed=8)
    x = np.hstack([a, a, a, a])
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0]]))
        model.bias.zero_()
    plan = compile_plan(model)
    peak = np.abs(a).max()
    assert calibrate(plan, x).value_abs_max == pytest.approx(1000 * peak)  # products and running sums
    # blocks=2: block 0 = features 0 and 2 (+2000·a), block 1 = features 1 and 3 (−2000·a)
    assert packed_abs_max(plan, x, 2) == pytest.approx(2000 * peak)
    assert packed_abs_max(plan, x, 4) == pytest.approx(1000 * peak)  # one feature per block
    with pytest.raises(HEModelError, match="single affine step"):
        packed_abs_max(compile_plan(nn.Sequential(nn.Linear(4, 2), Square(), nn.Linear(2, 1))), x, 2)


# --- devices, dtypes and common forward idioms (independent-probe findings) ------------------------


def test_meta_device_model_is_refused_with_a_typed_error_naming_the_layer() -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1)).to("meta")
    with pytest.raises(HEModelError, match=r"layer '0' \(Linear\) has its 'weight' on the meta device") as exc:
        compile_plan(model)
    assert "load_state_dict" in (exc.value.hint or "")


def test_uninitialised_lazy_layer_is_refused_with_a_typed_error_naming_the_layer(tmp_path: Path) -> None:
    """A LazyLinear never run on a batch has no weights yet: torch's bare ValueError came through."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(HEModelError, match=r"layer '0' \(LazyLinear\) has its 'weight' uninitialised") as exc:
        compile_plan(model)
    assert "dummy batch" in (exc.value.hint or "")
    with pytest.raises(HEModelError, match=r"'0\.weight'.*uninitialised"):
        save_sequential(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    model(torch.zeros(2, 6))  # initialised by a forward: evaluated like any Linear
    assert compile_plan(model).n_inputs == 6


def test_nan_or_infinite_labels_are_refused_without_a_numpy_cast_warning() -> None:
    import warnings

    from securetrain.he.evaluate import check_class_ids

    for bad in ([0, 1, float("nan")], [0, float("inf"), 1]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's "invalid value encountered in cast" leaked to the user
            with pytest.raises(HEModelError, match="class ids.*NaN or infinite"):
                check_class_ids(np.array(bad), 1)


def test_meta_features_are_refused_and_bfloat16_features_are_read() -> None:
    from securetrain.he.roles import as_array

    with pytest.raises(HEModelError, match="meta device"):
        as_array(torch.zeros(3, 2, device="meta"))
    x = torch.tensor([[0.5, -1.25]], dtype=torch.bfloat16)
    np.testing.assert_array_equal(as_array(x), [[0.5, -1.25]])
    assert as_array(torch.tensor([[1, 2]])).dtype == np.float64


class _SqueezedBinary(nn.Module):
    """A BCEWithLogits-style binary model: casts its input and returns (N,) logits."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.cast = cast
        self.fc = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() if self.cast == "float" else x.to(torch.float32)
        return self.fc(x).squeeze(-1)


@pytest.mark.parametrize("cast", ["float", "to"])
def test_casts_and_a_squeezed_logit_are_no_ops(cast: str) -> None:
    torch.manual_seed(0)
    model = _SqueezedBinary(cast)
    x = _x()
    plan = compile_plan(model)
    assert (plan.n_inputs, plan.n_outputs, plan.depth) == (6, 1, 1)
    logits, final = exact_logits(model, x)  # the float64 reference must not trip over the float32 cast
    assert final is None and logits.shape == (40, 1)
    with torch.no_grad():
        want = model(torch.as_tensor(x, dtype=torch.float32)).double().numpy()
    np.testing.assert_allclose(logits[:, 0], want, atol=1e-5)
    np.testing.assert_allclose(plan.evaluate_plain(x), logits, atol=1e-12)


def test_batchnorm_over_channels_names_both_layers() -> None:
    model = nn.Sequential(nn.BatchNorm1d(1), nn.Flatten(), nn.Linear(5, 1))
    with pytest.raises(HEModelError, match=r"layer '2' \(Linear\) expects 5 features.*'0' \(BatchNorm1d\) gives 1") as exc:
        compile_plan(model)
    assert "(N, C, L)" in (exc.value.hint or "")


# --- precision: outputs the release step cannot resolve ---------------------------------------------


def _tiny_logistic() -> nn.Linear:
    m = nn.Linear(6, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 0.1, 0.0, 0.0, 0.0, 0.0]]))
    return m


def test_outputs_below_the_release_step_are_refused_before_any_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Features of ~1e-7 gave logits that all rounded to 0 at decimals=5: AUC 0.5 encrypted vs 1.0
    plaintext, in a report that looked like a success."""
    from securetrain.he import evaluate, roles

    def no_keys(*_a: object, **_k: object) -> None:
        raise AssertionError("a key was generated before the refusal")

    monkeypatch.setattr(roles.DataOwner, "__init__", no_keys)
    monkeypatch.setattr(evaluate.DataOwner, "__init__", no_keys)
    x = _x() * 1e-7
    y = (x[:, 0] > 0).astype(int)
    with pytest.raises(HEParameterError, match=r"outputs span only .* release step of 1e-05.*rounding noise") as exc:
        evaluate.evaluate_encrypted(_tiny_logistic(), x, y)
    assert "last layer's weight and bias" in (exc.value.hint or "")
    with pytest.raises(HEParameterError, match=r"span only 0.000428.*\(decimals=2") as exc:
        evaluate.evaluate_encrypted(_tiny_logistic(), x * 1e3, y, decimals=2)
    assert exc.value.hint == "release more digits (decimals=6)"  # 100 steps across the range


def test_resolution_check_bands() -> None:
    from securetrain.he.evaluate import _check_resolution

    p = choose_params(1)  # scale 2^40: the release step is 10^-decimals
    assert _check_resolution(1.0, 5, p) == pytest.approx(1e-5)
    with pytest.warns(RuntimeWarning, match="lose precision"):
        _check_resolution(5e-4, 5, p)  # 50 steps: kept, with a warning
    with pytest.raises(HEParameterError):
        _check_resolution(5e-5, 5, p)  # 5 steps


def test_huge_feature_magnitudes_name_the_values_and_the_fix() -> None:
    """Features of ~1e12 were refused with 'use a shallower model' for a depth-1 logistic model."""
    from securetrain.he import evaluate_encrypted

    x = _x() * 1e12
    with pytest.raises(HEParameterError, match=r"values reach [0-9.]+e\+12 on these features .*depth 1\)") as exc:
        evaluate_encrypted(nn.Linear(6, 1), x)
    assert "standardise or clip the features" in (exc.value.hint or "")

"""One-call encrypted evaluation for pipelines: both roles in-process, kept apart by bytes.

The evaluator object is built only from the serialized *public* context and sees only serialized
ciphertexts, exactly as it would across a network boundary; the secret key never leaves the
:class:`~securetrain.he.roles.DataOwner`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from securetrain.audit.recorder import AuditRecorder
from securetrain.he.approximations import ACTIVATIONS
from securetrain.he.calibration import (
    DEFAULT_MARGIN,
    Calibration,
    approximated_steps,
    calibrate,
    packed_abs_max,
    poly_step,
    pow2_ceil,
)
from securetrain.he.errors import HEError, HEModelError, HEParameterError
from securetrain.he.metrics import accuracy, agreement, macro_auc
from securetrain.he.params import HEParams, choose_params
from securetrain.he.plan import HEPlan, LinearStep, OutputKind, apply_final, compile_model, exact_logits
from securetrain.he.roles import MAX_DECIMALS, DataOwner, Evaluator, as_array, check_plan_fits

log = logging.getLogger(__name__)


class HEEvaluationReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_samples: int
    n_features: int
    n_outputs: int
    n_classes: int  # 2 for one output column (binary logit), else the number of output columns
    output: str  # logits | probabilities
    probabilities_at: str | None  # data_owner (exact, after decryption) | encrypted (polynomial) | None for logits
    final_activation: str | None  # the model's trailing sigmoid/softmax/log_softmax, if any
    params: dict[str, Any]
    depth: int
    max_depth: int
    scale_compensation: bool
    decimals: int
    packed: bool  # feature-packed layout (few samples: several features per ciphertext)
    features_per_ciphertext: int
    # accuracy of the released (rounded) result
    max_abs_error: float  # vs the EXACT model (true activations, exact sigmoid/softmax)
    max_abs_error_vs_exact: float  # the same number (explicit name)
    max_abs_error_vs_plan: float  # vs the same plan in plaintext: CKKS noise + rounding only
    approximation_error_vs_exact: float  # plaintext plan vs exact model: the polynomials' share
    auc_encrypted: float | None  # binary AUC, or macro one-vs-rest AUC for > 2 classes
    auc_plaintext: float | None  # the exact model in plaintext
    auc_exact: float | None  # alias of auc_plaintext
    auc_approximated: float | None  # the plan (with polynomial activations) in plaintext
    accuracy_encrypted: float | None  # threshold (binary) or argmax (multi-class)
    accuracy_plaintext: float | None
    accuracy_exact: float | None
    accuracy_approximated: float | None
    # released values vs the exact model's, root mean square (max_abs_error is the worst sample)
    rmse_vs_exact: float | None = None
    # real-valued ``targets`` (a one-output regression model): errors of the released and the exact
    # model's values against them, in the targets' units
    rmse_encrypted: float | None = None
    rmse_plaintext: float | None = None
    mae_encrypted: float | None = None
    mae_plaintext: float | None = None
    # per-sample agreement of the released decisions (threshold / argmax), with or without labels
    prediction_agreement: float  # vs the exact model: same predicted class
    prediction_agreement_vs_plan: float  # vs the plan in plaintext: CKKS noise + rounding only
    output_range: float  # spread of the plan's outputs on the calibration set (max − min, or max |v|)
    release_step: float  # the resolution of a released value: max(10^-decimals, CKKS noise)
    # calibration (data owner's plaintext pass, before any encryption)
    calibration_samples: int
    value_abs_max: float
    value_bound: float  # power of two the overflow check and the parameter search used
    activation_out_of_range: dict[str, float]  # per approximated layer path: fraction outside [-R, R]
    approximation_ranges: dict[str, float]  # per approximated layer path: the fitted R
    out_of_interval_fraction: float  # worst of the above, on calibration + evaluation features
    # speed (wall clock on this machine)
    ms_keygen: float
    ms_encrypt: float
    ms_evaluate: float
    ms_decrypt: float
    ms_per_sample_eval: float
    ms_per_sample_end_to_end: float  # encrypt + evaluate + decrypt
    # sizes
    public_context_bytes: int
    secret_context_bytes: int
    ciphertext_bytes_per_sample: float  # encrypted input bundle / n_samples
    output_bytes_per_sample: float
    # provenance
    model_sha256: str  # the plan digest
    inputs_sha256: str
    outputs_sha256: str


def _array(a: Any, dtype: Any = np.float64, what: str = "features") -> np.ndarray:
    return as_array(a, dtype, what)


def _class_ids(y: np.ndarray) -> np.ndarray:
    try:
        if y.dtype.kind in "fc" and not np.all(np.isfinite(y)):  # before the cast, which warns on NaN/inf
            raise HEModelError("labels must be class ids 0..K-1 (integers; 0/1 for one output column); "
                               "they contain NaN or infinite values",
                               hint="drop or impute the unlabelled rows first")
        ids = y.astype(np.int64)
        ok = bool(np.all(ids == y.astype(np.float64))) and bool(np.all(ids >= 0))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise HEModelError("labels must be class ids 0..K-1 (integers; 0/1 for one output column)",
                           hint="map string labels to stable integer ids first")
    return ids


def check_class_ids(y: np.ndarray, n_outputs: int) -> np.ndarray:
    """``y`` as class ids of a model with ``n_outputs`` score columns (one column: 0/1; K: 0..K-1).
    A label the model has no score for would give a made-up AUC and accuracy, so it is refused."""
    ids = _class_ids(np.asarray(y).reshape(-1))
    classes = 2 if n_outputs == 1 else n_outputs
    if ids.size and int(ids.max()) >= classes:
        raise HEModelError(
            f"labels must be class ids 0..{classes - 1} for a model with {n_outputs} output column(s), "
            f"found label {int(ids.max())}",
            hint="pass the class ids the model was trained on (not a regression target), or a model with "
                 "one output column per class",
        )
    return ids


def _rows(x: np.ndarray, n_inputs: int, what: str) -> np.ndarray:
    """One row per sample; trailing dimensions are flattened (what nn.Flatten does)."""
    if x.ndim == 1:
        x = x.reshape(-1, 1) if n_inputs == 1 else x.reshape(1, -1)
    if x.ndim > 2:
        x = x.reshape(len(x), -1)
    if x.ndim != 2 or x.shape[1] != n_inputs or len(x) == 0:
        raise HEModelError(f"the model's HE part takes {n_inputs} features per sample, {what} have shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise HEModelError(f"{what} contain NaN or inf")
    return x


def _metrics(labels: np.ndarray | None, scores: np.ndarray, output: str, final: str | None
             ) -> tuple[float | None, float | None]:
    """(AUC, accuracy). Multi-class AUC is macro one-vs-rest on class probabilities (softmax of
    the logits, computed here in plaintext by the data owner); accuracy is by argmax."""
    if labels is None:
        return None, None
    if scores.shape[1] == 1:
        threshold = 0.5 if output == "probabilities" else 0.0
        return macro_auc(labels, scores), accuracy(labels, scores, threshold)
    probs = scores if output == "probabilities" else apply_final(scores, final)
    return macro_auc(labels, probs), accuracy(labels, probs, 0.0)


def _auto_ranges(plan: HEPlan, paths: list[str], x: np.ndarray, approx: dict[str, Any],
                 user: Mapping[str, tuple[int | None, float | None]]) -> dict[str, Any] | None:
    """Widen R of hidden approximated activations whose R the caller did not fix so that the
    calibration set stays inside [-R, R] (R a power of two). None when nothing changes."""
    steps = approximated_steps(plan)
    if len(steps) != len(paths):
        return None  # a degree-1 fit was folded away; keep the caller's ranges
    cal = calibrate(plan, x)
    changed = False
    for path, idx, pre in zip(paths, steps, cal.preactivation_abs_max, strict=True):
        name = poly_step(plan, idx).source
        fixed = [v for key in (path, name) if (v := user.get(key)) is not None and v[1] is not None]
        if path.startswith("<") or fixed:
            continue  # the output sigmoid / a caller-chosen R: measured and refused, never widened
        current = poly_step(plan, idx).input_range
        if current is not None and pow2_ceil(pre) > current:
            approx[path] = (None, pow2_ceil(pre))
            changed = True
    return approx if changed else None


def evaluate_encrypted(
    model: Any,
    features: Any,
    labels: Any = None,
    *,
    audit: AuditRecorder | None = None,
    decimals: int = 5,
    params: HEParams | None = None,
    output: OutputKind = "logits",
    probabilities_at: Literal["data_owner", "encrypted"] = "data_owner",
    approximations: Mapping[str, tuple[int | None, float | None]] | None = None,
    calibration: Any = None,
    out_of_interval: Literal["refuse", "warn"] = "refuse",
    max_out_of_interval: float = 0.0,
    packing: Literal["auto", "on", "off"] = "auto",
    batch_size: int | None = None,
    threads: int | None = None,
    targets: Any = None,
) -> HEEvaluationReport:
    """Evaluate ``model`` (``nn.Module`` or :class:`HEPlan`) on encrypted ``features``; ``labels``
    are class ids (0/1 for one output column, 0..K-1 for K columns). A regression model (one output
    column, ``output="logits"``) passes real-valued ``targets`` instead: the report then has the
    RMSE/MAE of the released and the exact values against them (AUC and accuracy stay ``None``).

    Everything that can refuse does so **before** any key or ciphertext is made: unsupported
    layers (:class:`HEUnsupportedLayerError`, naming the layer), activations whose calibrated
    inputs leave the fitted interval, depth and overflow (:class:`HEParameterError`).

    * ``output="probabilities"``: by default the data owner applies the model's exact final
      sigmoid/softmax after decryption (``probabilities_at="data_owner"``);
      ``probabilities_at="encrypted"`` evaluates a fitted polynomial sigmoid under encryption
      (one output only) and is refused when any calibration logit lies outside its interval
      (``out_of_interval="warn"`` / ``max_out_of_interval`` relax that).
    * calibration: a plaintext pass on ``calibration`` (default: none) plus ``features`` gives the
      value bound for the overflow check and for ``choose_params``' search of ring size and scale
      (``params=None``), and widens R of hidden approximated activations the caller did not fix.
    * ``packing="auto"`` packs several features per ciphertext when the plan is one affine step and
      the samples fill at most half the slots.
    * errors and metrics are reported against the **exact** model (audit too).
    """
    if output not in ("logits", "probabilities"):
        raise HEModelError(f"output must be 'logits' or 'probabilities', got {output!r}")
    if probabilities_at not in ("data_owner", "encrypted"):
        raise HEModelError(f"probabilities_at must be 'data_owner' or 'encrypted', got {probabilities_at!r}")
    if out_of_interval not in ("refuse", "warn") or packing not in ("auto", "on", "off"):
        raise HEModelError("out_of_interval must be refuse|warn and packing auto|on|off")
    encrypted_probs = output == "probabilities" and probabilities_at == "encrypted"
    plan_output: OutputKind = "probabilities" if encrypted_probs else "logits"
    # activation names are case-insensitive ("ReLU" = "relu"); layer paths are not
    user_approx = {(k.lower() if k.lower() in ACTIVATIONS else k): v for k, v in (approximations or {}).items()}
    if not isinstance(decimals, int) or not 0 <= decimals <= MAX_DECIMALS:  # before any key exists
        raise HEParameterError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")
    raw_x = _array(features)
    y = None if labels is None else _class_ids(_array(labels, None, "labels").reshape(-1))
    resource = "he-model:unknown"
    model_sha: str | None = None
    paths: list[str]
    try:
        if isinstance(model, HEPlan):
            plan, final, paths = model, None, []
        else:
            plan, final, paths = compile_model(model, output=plan_output, approximations=user_approx)
        x = _rows(raw_x, plan.n_inputs, "features")
        if y is not None and len(y) != len(x):
            raise HEModelError(f"{len(y)} labels for {len(x)} samples")
        if y is not None:
            y = check_class_ids(y, plan.n_outputs)
        target_values = _regression_targets(targets, labels, plan.n_outputs, len(x), output)
        cal_x = x if calibration is None else np.vstack(
            [_rows(_array(calibration, what="calibration features"), plan.n_inputs, "calibration features"), x])
        if not isinstance(model, HEPlan):
            approx = dict(user_approx)
            for _ in range(len(paths)):  # later layers see the widened earlier ones
                widened = _auto_ranges(plan, paths, cal_x, approx, user_approx)
                if widened is None:
                    break
                approx = widened
                plan, final, paths = compile_model(model, output=plan_output, approximations=approx)
        model_sha = plan.sha256()
        resource = f"he-model:{model_sha[:16]}"
        cal = calibrate(plan, cal_x)
        ranges = _named(plan, paths, [poly_step(plan, i).input_range for i in approximated_steps(plan)])
        out_of_range = _named(plan, paths, list(cal.out_of_interval))
        _check_intervals(plan, paths, cal, out_of_interval, max_out_of_interval)
        output_range = _output_range(plan.evaluate_plain(cal_x))
        p = params if params is not None else _search_params(plan, cal, decimals)
        depth = check_plan_fits(plan, p, value_bound=cal.value_bound)  # fail before encrypting anything
        release_step = _check_resolution(output_range, decimals, p)
        single_affine = len(plan.steps) == 1 and isinstance(plan.steps[0], LinearStep)
        can_pack = single_affine and batch_size is None and len(x) <= p.slots // 2 and plan.n_inputs > 1
        if packing == "on" and not can_pack:
            raise HEParameterError("packing='on' needs a single affine layer, no batch_size, more than one feature "
                                   f"and at most {p.slots // 2} samples")
        pack = can_pack and packing != "off"
        value_bound = cal.value_bound
        if pack:  # blocks hold partial sums, which the plain calibration pass never sees
            blocks = min(p.slots // len(x), plan.n_inputs)
            packed_bound = max(value_bound, pow2_ceil(DEFAULT_MARGIN * packed_abs_max(plan, cal_x, blocks)))
            try:
                check_plan_fits(plan, p, value_bound=packed_bound)
                value_bound = packed_bound
            except HEParameterError:
                if packing == "on":
                    raise
                pack = False  # partial sums would overflow: the unpacked layout never holds them
        if pack:
            try:
                check_packed_precision(x, p, decimals, what="packing='on'")
            except HEParameterError:
                if packing == "on":
                    raise
                pack = False  # large features: the unpacked layout's scalar products keep the release precision

        t0 = time.perf_counter()
        owner = DataOwner(p)
        public = owner.public_context()
        secret_len = len(owner.secret_context())
        evaluator = Evaluator(public, threads=threads)  # from public bytes only
        t1 = time.perf_counter()
        inputs = owner.encrypt(x, batch_size=batch_size, threads=threads, value_bound=value_bound, pack=pack,
                               plan_sha256=model_sha)  # the bound holds for this plan only
        t2 = time.perf_counter()
        outputs = evaluator.evaluate(plan, inputs)
        t3 = time.perf_counter()
        released = owner.decrypt(outputs, decimals=decimals, max_abs=value_bound)
        if output == "probabilities" and not encrypted_probs:
            released = np.round(apply_final(released, final), decimals)  # exact, at the data owner
        t4 = time.perf_counter()
    except HEError as exc:
        if audit is not None:
            audit.record("he.evaluate", resource, outcome="failure",
                         details={"plan_sha256": model_sha, "model_sha256": model_sha, "error": type(exc).__name__,
                                  "message": str(exc)[:300]})
        raise

    plain = plan.evaluate_plain(x)
    if output == "probabilities" and not encrypted_probs:
        plain = apply_final(plain, final)
    if isinstance(model, HEPlan):
        exact = plain
    else:
        logits, final_exact = exact_logits(model, x)
        exact = apply_final(logits, final_exact) if output == "probabilities" else logits
    auc_e, acc_e = _metrics(y, released, output, final)
    auc_p, acc_p = _metrics(y, exact, output, final)
    auc_a, acc_a = _metrics(y, plain, output, final)
    threshold = 0.5 if output == "probabilities" else 0.0
    agree = agreement(released, exact, threshold)
    agree_plan = agreement(released, plain, threshold)
    if agree_plan < 1.0:
        log.info("HE: %.1f%% of the encrypted decisions differ from the plan in plaintext (scores within the "
                 "CKKS noise / rounding of the threshold)", 100 * (1 - agree_plan))
    n = len(x)
    blocks = bundle_blocks(inputs)
    errors = _regression_errors(target_values, released, exact)
    report = HEEvaluationReport(
        n_samples=n,
        n_features=x.shape[1],
        n_outputs=plan.n_outputs,
        n_classes=2 if plan.n_outputs == 1 else plan.n_outputs,
        output=output,
        probabilities_at=probabilities_at if output == "probabilities" else None,
        final_activation=final,
        params=p.to_dict(),
        depth=depth,
        max_depth=p.max_depth,
        scale_compensation=owner.scale_compensation,
        decimals=decimals,
        packed=pack,
        features_per_ciphertext=blocks,
        max_abs_error=float(np.max(np.abs(released - exact))),
        max_abs_error_vs_exact=float(np.max(np.abs(released - exact))),
        max_abs_error_vs_plan=float(np.max(np.abs(released - plain))),
        approximation_error_vs_exact=float(np.max(np.abs(plain - exact))),
        rmse_vs_exact=float(np.sqrt(np.mean((released - exact) ** 2))),
        **errors,
        auc_encrypted=auc_e,
        auc_plaintext=auc_p,
        auc_exact=auc_p,
        auc_approximated=auc_a,
        accuracy_encrypted=acc_e,
        accuracy_plaintext=acc_p,
        accuracy_exact=acc_p,
        accuracy_approximated=acc_a,
        prediction_agreement=agree,
        prediction_agreement_vs_plan=agree_plan,
        output_range=output_range,
        release_step=release_step,
        calibration_samples=cal.n_samples,
        value_abs_max=cal.value_abs_max,
        value_bound=value_bound,
        activation_out_of_range=out_of_range,
        approximation_ranges={k: float(v) for k, v in ranges.items()},
        out_of_interval_fraction=cal.out_of_interval_fraction,
        ms_keygen=(t1 - t0) * 1e3,
        ms_encrypt=(t2 - t1) * 1e3,
        ms_evaluate=(t3 - t2) * 1e3,
        ms_decrypt=(t4 - t3) * 1e3,
        ms_per_sample_eval=(t3 - t2) * 1e3 / n,
        ms_per_sample_end_to_end=(t4 - t1) * 1e3 / n,
        public_context_bytes=len(public),
        secret_context_bytes=secret_len,
        ciphertext_bytes_per_sample=len(inputs) / n,
        output_bytes_per_sample=len(outputs) / n,
        model_sha256=model_sha,
        inputs_sha256=hashlib.sha256(inputs).hexdigest(),
        outputs_sha256=hashlib.sha256(outputs).hexdigest(),
    )
    if audit is not None:
        audit.record("he.evaluate", resource, details={
            "params": report.params,
            "depth": depth,
            "plan_sha256": model_sha,
            "model_sha256": model_sha,  # alias of plan_sha256, kept for existing audit queries
            "inputs_sha256": report.inputs_sha256,
            "outputs_sha256": report.outputs_sha256,
            "n_samples": n,
            "n_classes": report.n_classes,
            "output": output,
            "probabilities_at": report.probabilities_at,
            "decimals": decimals,
            "packed": pack,
            "max_abs_error": report.max_abs_error,  # vs the exact model
            "max_abs_error_vs_plan": report.max_abs_error_vs_plan,
            "approximation_error_vs_exact": report.approximation_error_vs_exact,
            "out_of_interval_fraction": report.out_of_interval_fraction,
            "value_bound": value_bound,
            "auc_encrypted": auc_e,
            "auc_plaintext": auc_p,
            "accuracy_encrypted": acc_e,
            "accuracy_plaintext": acc_p,
            "prediction_agreement": agree,
            "prediction_agreement_vs_plan": agree_plan,
            "rmse_vs_exact": report.rmse_vs_exact,
            **errors,
        })
    return report


def _regression_targets(targets: Any, labels: Any, n_outputs: int, n_samples: int, output: str
                        ) -> np.ndarray | None:
    """Real-valued targets of a one-output regression model, checked before any key exists."""
    if targets is None:
        return None
    if labels is not None:
        raise HEModelError("pass labels (class ids) or targets (real values), not both")
    if n_outputs != 1 or output != "logits":
        raise HEModelError(f"targets are for a regression model with one output column and output='logits' "
                           f"(this model has {n_outputs} column(s), output={output!r})",
                           hint="classifiers take labels (class ids)")
    values = _array(targets, np.float64, "targets").reshape(-1)
    if len(values) != n_samples:
        raise HEModelError(f"{len(values)} targets for {n_samples} samples")
    if not np.all(np.isfinite(values)):
        raise HEModelError("targets must be finite numbers")
    return values


def _regression_errors(targets: np.ndarray | None, released: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    if targets is None:
        return {}
    enc, plain = released[:, 0] - targets, exact[:, 0] - targets
    return {"rmse_encrypted": float(np.sqrt(np.mean(enc ** 2))), "rmse_plaintext": float(np.sqrt(np.mean(plain ** 2))),
            "mae_encrypted": float(np.mean(np.abs(enc))), "mae_plaintext": float(np.mean(np.abs(plain)))}


#: Measured CKKS error ≈ NOISE_CONSTANT · 2^-scale_bits (fresh encryption + one plaintext product,
#: N=4096..16384; e.g. 3.6e-6 at scale 2^32).
NOISE_CONSTANT = 2.0**14


def release_step_for(params: HEParams, decimals: int) -> float:
    """The resolution of a released value: max(10^-decimals, the CKKS noise at this scale)."""
    return max(10.0**-decimals, NOISE_CONSTANT * 2.0**-params.scale_bits)


def packed_encoding_error(features: Any, params: HEParams) -> float:
    """Estimated worst error the feature-packed layout adds to a score: it multiplies by plaintext
    *vectors*, whose CKKS encoding rounds every slot's weight with an absolute error ~sqrt(N)·2^-scale
    (a scalar product, as in the unpacked layout, rounds by 0.5·2^-scale), and each score carries that
    error times its sample's features: sqrt(N)·2^-scale·max‖x‖₂. Measured errors are 0.38–0.51 of it
    (N = 8192/16384, scales 2^30..2^34, features up to 1e6)."""
    x = np.asarray(features, dtype=np.float64).reshape(len(features), -1)
    norm = float(np.max(np.linalg.norm(x, axis=1))) if x.size else 0.0
    return math.sqrt(params.poly_modulus_degree) * 2.0**-params.scale_bits * norm


#: The packed layout is used only while its encoding error stays this far below the release step
#: (the budget min_scale_bits_for gives the CKKS noise: 4× below half a step).
PACKED_ERROR_BUDGET = 1.0 / 8.0


def check_packed_precision(features: Any, params: HEParams, decimals: int, *, what: str = "--pack") -> None:
    """Refuse (:class:`HEParameterError`, before any ciphertext exists) the feature-packed layout where
    its plaintext encoding error (:func:`packed_encoding_error`) exceeds PACKED_ERROR_BUDGET of the
    release step: large, unstandardised features would come back with wrong low digits."""
    if not isinstance(decimals, int) or isinstance(decimals, bool) or not 0 <= decimals <= MAX_DECIMALS:
        raise HEParameterError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")
    err, step = packed_encoding_error(features, params), release_step_for(params, decimals)
    if err > PACKED_ERROR_BUDGET * step:
        raise HEParameterError(
            f"{what}: the feature-packed layout's plaintext encoding error (up to ~{err:.2g} on these features, "
            f"whose rows reach a norm of {err / (math.sqrt(params.poly_modulus_degree) * 2.0**-params.scale_bits):.3g}) "
            f"exceeds the release precision ({step:.1g} per value at decimals={decimals}, CKKS scale "
            f"2^{params.scale_bits}); nothing was encrypted",
            hint="encrypt one feature per ciphertext (no packing: a scalar product, ~sqrt(N)x more precise), "
                 "or standardise the features")


def _search_params(plan: HEPlan, cal: Calibration, decimals: int) -> HEParams:
    """choose_params for the calibrated bound; a refusal names the values that caused it."""
    try:
        return choose_params(plan.depth, scale_bits=None, integer_bits=None, value_bound=cal.value_bound,
                             min_scale_bits=min_scale_bits_for(decimals))
    except HEParameterError as exc:
        raise HEParameterError(
            f"the model's values reach {cal.value_abs_max:.3g} on these features (value bound {cal.value_bound:g}, "
            f"depth {plan.depth}): {exc}",
            hint="standardise or clip the features (or shrink the weights) so intermediate values stay far below "
                 "2^(60 - scale_bits); with fewer released decimals a smaller scale leaves more integer headroom",
        ) from exc


def min_scale_bits_for(decimals: int) -> int:
    """Smallest scale whose CKKS noise stays 4× below half the release rounding step 10^-decimals,
    clamped to [30, 40] (the search range of choose_params)."""
    need = math.ceil(math.log2(NOISE_CONSTANT * 2 * 10.0**decimals)) + 2
    return max(30, min(40, need))


#: Below this many release steps across the outputs' range the released scores are refused
#: (rounding alone moves a score by up to 5% of the range: rankings and decisions are noise);
#: below WARN_STEPS a RuntimeWarning says that precision is being lost.
MIN_RESOLUTION_STEPS = 10.0
WARN_RESOLUTION_STEPS = 100.0


def _output_range(outputs: np.ndarray) -> float:
    """How far apart the scores are: max − min over all outputs (max |v| for a single value)."""
    o = np.asarray(outputs, dtype=np.float64)
    spread = float(np.max(o) - np.min(o))
    return spread if spread > 0 else float(np.max(np.abs(o)))


def check_release_resolution(plan: HEPlan, features: Any, params: HEParams, decimals: int = 5) -> tuple[float, float]:
    """The precision check of :func:`evaluate_encrypted` for callers that calibrate on their own
    (``securetrain he keygen --calibrate-features`` / ``he encrypt --calibrate-model``): run it before
    any key or ciphertext exists. Returns ``(output_range, release_step)`` of ``plan`` on ``features``;
    raises :class:`HEParameterError` below ``MIN_RESOLUTION_STEPS`` release steps and warns
    (``RuntimeWarning``) below ``WARN_RESOLUTION_STEPS``."""
    if not isinstance(decimals, int) or isinstance(decimals, bool) or not 0 <= decimals <= MAX_DECIMALS:
        raise HEParameterError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")
    x = _rows(_array(features), plan.n_inputs, "features")
    spread = _output_range(plan.evaluate_plain(x))
    return spread, _check_resolution(spread, decimals, params)


def _check_resolution(output_range: float, decimals: int, params: HEParams) -> float:
    """Refuse (before any key exists) when the released scores cannot resolve the model's outputs:
    their range is below MIN_RESOLUTION_STEPS × the release step max(10^-decimals, CKKS noise).
    Tiny features or weights otherwise come back as rounded zeros with a plausible-looking report."""
    step = release_step_for(params, decimals)
    if output_range >= WARN_RESOLUTION_STEPS * step:
        return step
    need = math.ceil(math.log10(WARN_RESOLUTION_STEPS / output_range)) if output_range > 0 else MAX_DECIMALS + 1
    fix = (f"release more digits (decimals={need})" if need <= MAX_DECIMALS and need > decimals else
           "scale the features up (standardise them) or the last layer's weight and bias by a power of ten "
           "(logit decisions, argmax and AUC do not change)")
    msg = (f"the model's outputs span only {output_range:.3g} on these features, against a release step of {step:.1g} "
           f"(decimals={decimals}, CKKS scale 2^{params.scale_bits})")
    if output_range < MIN_RESOLUTION_STEPS * step:
        raise HEParameterError(f"{msg}: the released scores would be rounding noise", hint=fix)
    warnings.warn(f"{msg}: released scores lose precision ({fix})", RuntimeWarning, stacklevel=3)
    return step


def bundle_blocks(bundle: bytes) -> int:
    from securetrain.he.roles import bundle_info

    h = bundle_info(bundle)
    return int(h.get("blocks", 1)) if h.get("layout") == "feature-packed" else 1


def _named(plan: HEPlan, paths: list[str], values: list[Any]) -> dict[str, Any]:
    steps = approximated_steps(plan)
    keys = paths if len(paths) == len(steps) else [f"step{i}:{poly_step(plan, i).source}" for i in steps]
    return dict(zip(keys, values, strict=True))


def _check_intervals(plan: HEPlan, paths: list[str], cal: Calibration, policy: str, limit: float) -> None:
    """Refuse (or warn) when calibration values leave a polynomial's fitted interval."""
    steps = approximated_steps(plan)
    names = _named(plan, paths, list(zip(steps, cal.out_of_interval, cal.preactivation_abs_max, strict=True)))
    for path, (idx, frac, pre) in names.items():
        if frac <= limit:
            continue
        step = poly_step(plan, idx)
        r = step.input_range
        msg = (f"{frac:.1%} of the calibration inputs of the approximated {step.source} at {path!r} "
               f"lie outside its fitted interval [-{r:g}, {r:g}] (largest |input| {pre:.3g}); the polynomial "
               "diverges there and the encrypted result would be wrong")
        hint = ("compute probabilities at the data owner (probabilities_at='data_owner', the default), or widen "
                f"the interval: approximations={{'{step.source}': (degree, {pow2_ceil(pre):g})}}")
        if policy == "refuse":
            raise HEModelError(msg, hint=hint)
        warnings.warn(f"{msg} ({hint})", RuntimeWarning, stacklevel=3)
        log.warning("%s", msg)

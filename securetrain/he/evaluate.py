"""One-call encrypted evaluation for pipelines: both roles in-process, kept apart by bytes.

The evaluator object is built only from the serialized *public* context and sees only serialized
ciphertexts, exactly as it would across a network boundary; the secret key never leaves the
:class:`~securetrain.he.roles.DataOwner`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from securetrain.audit.recorder import AuditRecorder
from securetrain.he.errors import HEError
from securetrain.he.metrics import accuracy, roc_auc
from securetrain.he.params import HEParams, choose_params
from securetrain.he.plan import HEPlan, LinearStep, OutputKind, PolyStep, compile_plan, reference_forward
from securetrain.he.roles import DataOwner, Evaluator, _input_bound, check_plan_fits


class HEEvaluationReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_samples: int
    n_features: int
    n_outputs: int
    output: str
    params: dict[str, Any]
    depth: int
    max_depth: int
    scale_compensation: bool
    decimals: int
    # accuracy of the encrypted result (as released, i.e. rounded)
    max_abs_error: float  # vs plaintext evaluation of the same approximated model
    max_abs_error_vs_exact: float | None  # vs the exact model (true activations)
    approximation_error_vs_exact: float | None  # plaintext approximated vs exact: the polynomial's share
    auc_encrypted: float | None
    auc_plaintext: float | None
    auc_exact: float | None
    accuracy_encrypted: float | None
    accuracy_plaintext: float | None
    accuracy_exact: float | None
    activation_out_of_range: dict[str, float]  # fraction of pre-activations outside [-R, R], per poly step
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
    model_sha256: str
    inputs_sha256: str
    outputs_sha256: str


def _out_of_range(plan: HEPlan, x: np.ndarray) -> dict[str, float]:
    """Plaintext walk of the plan: how often each approximated activation leaves its range."""
    report: dict[str, float] = {}
    h = x
    for idx, s in enumerate(plan.steps):
        if isinstance(s, LinearStep):
            h = h @ s.weight.T + s.bias
        else:
            if s.input_range is not None:
                report[f"step{idx}:{s.source}"] = float(np.mean(np.abs(h) > s.input_range))
            h = np.polynomial.polynomial.polyval(h, np.asarray(s.coeffs))
    return report


def _metrics(labels: np.ndarray | None, out: np.ndarray, threshold: float) -> tuple[float | None, float | None]:
    if labels is None:
        return None, None
    auc = roc_auc(labels, out[:, 0]) if out.shape[1] == 1 else None
    return auc, accuracy(labels, out, threshold)


def evaluate_encrypted(
    model: Any,
    features: Any,
    labels: Any = None,
    *,
    audit: AuditRecorder | None = None,
    params: HEParams | None = None,
    output: OutputKind = "logits",
    approximations: dict[str, tuple[int | None, float | None]] | None = None,
    decimals: int = 5,
    batch_size: int | None = None,
    threads: int | None = None,
) -> HEEvaluationReport:
    """Evaluate ``model`` (``nn.Module`` or :class:`HEPlan`) on encrypted ``features``.

    Parameters are validated and the model's depth checked against them **before** any key or
    ciphertext is made; ``params=None`` picks the smallest secure set that fits.
    """
    x = np.asarray(features.detach().cpu().numpy() if hasattr(features, "detach") else features, dtype=np.float64)
    y = None if labels is None else np.asarray(labels.detach().cpu().numpy() if hasattr(labels, "detach") else labels)
    plan = model if isinstance(model, HEPlan) else compile_plan(model, output=output, approximations=approximations)
    model_sha = plan.sha256()
    resource = f"he-model:{model_sha[:16]}"
    try:
        p = params if params is not None else choose_params(plan.depth)
        depth = check_plan_fits(plan, p, _input_bound(x))  # fail before encrypting anything

        t0 = time.perf_counter()
        owner = DataOwner(p)
        public = owner.public_context()
        secret_len = len(owner.secret_context())
        t1 = time.perf_counter()
        evaluator = Evaluator(public, threads=threads)  # from public bytes only
        inputs = owner.encrypt(x, batch_size=batch_size, threads=threads)
        t2 = time.perf_counter()
        outputs = evaluator.evaluate(plan, inputs)
        t3 = time.perf_counter()
        released = owner.decrypt(outputs, decimals=decimals)
        t4 = time.perf_counter()
    except HEError as exc:
        if audit is not None:
            audit.record("he.evaluate", resource, outcome="failure",
                         details={"plan_sha256": model_sha, "model_sha256": model_sha,
                                  "error": type(exc).__name__})
        raise

    plain = plan.evaluate_plain(x)
    exact = reference_forward(model, x, plan.output) if not isinstance(model, HEPlan) else None
    threshold = 0.0 if plan.output == "logits" else 0.5
    auc_e, acc_e = _metrics(y, released, threshold)
    auc_p, acc_p = _metrics(y, plain, threshold)
    auc_x, acc_x = _metrics(y, exact, threshold) if exact is not None else (None, None)
    n = len(x)
    report = HEEvaluationReport(
        n_samples=n,
        n_features=x.shape[1],
        n_outputs=plan.n_outputs,
        output=plan.output,
        params=p.to_dict(),
        depth=depth,
        max_depth=p.max_depth,
        scale_compensation=owner.scale_compensation,
        decimals=decimals,
        max_abs_error=float(np.max(np.abs(released - plain))),
        max_abs_error_vs_exact=None if exact is None else float(np.max(np.abs(released - exact))),
        approximation_error_vs_exact=None if exact is None else float(np.max(np.abs(plain - exact))),
        auc_encrypted=auc_e,
        auc_plaintext=auc_p,
        auc_exact=auc_x,
        accuracy_encrypted=acc_e,
        accuracy_plaintext=acc_p,
        accuracy_exact=acc_x,
        activation_out_of_range=_out_of_range(plan, x),
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
            "decimals": decimals,
            "max_abs_error": report.max_abs_error,
            "auc_encrypted": auc_e,
            "auc_plaintext": auc_p,
            "accuracy_encrypted": acc_e,
            "accuracy_plaintext": acc_p,
        })
    return report

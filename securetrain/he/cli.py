"""``securetrain he ...``: keygen, encrypt, evaluate, decrypt, plan — the two roles on files.

Data owner: ``keygen`` → ``encrypt`` → (send public.stctx + inputs to the evaluator) → ``decrypt``.
Evaluator: ``evaluate`` with the public context only (a secret context is refused).
Only typer/stdlib at import time; numpy/torch/tenseal load inside the commands.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import typer

from securetrain.audit.cli_support import AUDIT_DB_OPTION

he_app = typer.Typer(help="Homomorphic (CKKS) evaluation on encrypted data.", no_args_is_help=True)

SECRET_NAME = "secret.stctx"
PUBLIC_NAME = "public.stctx"

_AUDIT = AUDIT_DB_OPTION


def _audit(db: Optional[str]):  # noqa: ANN202
    if db is None:
        return None
    from securetrain.audit.log import AuditLog

    return AuditLog(db)


def _load_array(path: Path, what: str):  # noqa: ANN202
    import numpy as np

    from securetrain.he.errors import HEFormatError

    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if path.suffix == ".csv":
            text = path.read_text(encoding="utf-8").splitlines()
            skip = 1 if text and any(c.isalpha() and c not in "eE" for c in text[0]) else 0
            return np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2 if what == "features" else 1)
    except (OSError, ValueError) as exc:
        raise HEFormatError(f"cannot read {what} from {path}: {exc}") from exc
    raise HEFormatError(f"{what} must be a .npy or .csv file, got {path.name}")


def _read(path: Path) -> bytes:
    from securetrain.he.errors import HEFormatError

    try:
        return path.read_bytes()
    except OSError as exc:
        raise HEFormatError(f"cannot read {path}: {exc.strerror}") from exc


def _plan_from_model(model: Path, output: str):  # noqa: ANN202
    from securetrain.he.model_io import load_sequential
    from securetrain.he.plan import compile_plan

    seq, sha = load_sequential(model)
    return compile_plan(seq, output=output), sha  # type: ignore[arg-type]


def keygen(
    out_dir: Path = typer.Option(..., "--out-dir", help="Directory for secret.stctx (owner-only) and public.stctx."),
    model: Optional[Path] = typer.Option(None, "--model", help="Size the parameters for this model file."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities (with --model)."),
    depth: Optional[int] = typer.Option(None, "--depth", help="Size the parameters for this multiplicative depth."),
    poly_modulus_degree: Optional[int] = typer.Option(None, "--poly-modulus-degree", help="Explicit N (with --coeff-bits)."),
    coeff_bits: Optional[str] = typer.Option(None, "--coeff-bits", help="Explicit prime bit sizes, e.g. 60,40,40,60."),
    scale_bits: int = typer.Option(40, "--scale-bits", help="log2 of the CKKS scale (precision)."),
    galois_keys: bool = typer.Option(False, "--galois-keys", help="Also export rotation keys (not needed here; large)."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing context files."),
) -> None:
    """Data owner: create a CKKS context; write the secret and the public context."""
    from securetrain.cli.console import console
    from securetrain.he.errors import HEParameterError
    from securetrain.he.params import HEParams, choose_params
    from securetrain.he.roles import DataOwner, check_plan_fits
    from securetrain.io.atomic import atomic_write_bytes

    plan = _plan_from_model(model, output)[0] if model is not None else None
    if coeff_bits is not None or poly_modulus_degree is not None:
        if coeff_bits is None or poly_modulus_degree is None:
            raise HEParameterError("--poly-modulus-degree and --coeff-bits go together")
        try:
            bits = tuple(int(b) for b in coeff_bits.split(","))
        except ValueError as exc:
            raise HEParameterError(f"--coeff-bits must be comma-separated integers, got {coeff_bits!r}") from exc
        params = HEParams(poly_modulus_degree, bits, scale_bits)
    else:
        need = plan.depth if plan is not None else (depth if depth is not None else 1)
        params = choose_params(need, scale_bits=scale_bits)
    if plan is not None:
        check_plan_fits(plan, params)
    secret_path, public_path = out_dir / SECRET_NAME, out_dir / PUBLIC_NAME
    if not force and (secret_path.exists() or public_path.exists()):
        raise HEParameterError(f"{out_dir} already holds context files", hint="pass --force to replace them")
    with console.status("generating keys"):
        owner = DataOwner(params, galois_keys=galois_keys)
        secret, public = owner.secret_context(), owner.public_context()
    atomic_write_bytes(secret_path, secret, mode=0o600)
    atomic_write_bytes(public_path, public, mode=0o644)
    console.print(f"parameters: {params.describe()}")
    console.print(f"secret context: {secret_path} ({len(secret):,} bytes, keep private)")
    console.print(f"public context: {public_path} ({len(public):,} bytes, give to the evaluator)")


def encrypt(
    context: Path = typer.Option(..., "--context", help="The data owner's secret.stctx."),
    features: Path = typer.Option(..., "--features", help="Features as .npy or numeric .csv (rows = samples)."),
    out: Path = typer.Option(..., "--out", help="Ciphertext bundle to write."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Samples per ciphertext (default: all slots)."),
) -> None:
    """Data owner: encrypt a feature matrix feature-major (samples in the slots)."""
    import math

    from securetrain.cli.console import console, progress_bar
    from securetrain.he.roles import DataOwner
    from securetrain.io.atomic import atomic_write_bytes

    owner = DataOwner.from_secret_context(_read(context), source=str(context))
    x = _load_array(features, "features")
    bs = batch_size or owner.params.slots
    total = math.ceil(len(x) / bs) * (x.shape[1] if x.ndim == 2 else 1)
    with progress_bar() as bar:
        task = bar.add_task("encrypting", total=total, status="")
        bundle = owner.encrypt(x, batch_size=batch_size, progress=lambda k: bar.advance(task, k))
    atomic_write_bytes(out, bundle, mode=0o644)
    console.print(f"wrote {out}: {len(x)} samples × {x.shape[1]} features, {len(bundle):,} bytes "
                  f"(sha256 {hashlib.sha256(bundle).hexdigest()[:16]}…)")


def evaluate(
    context: Path = typer.Option(..., "--context", help="The PUBLIC context (public.stctx)."),
    model: Path = typer.Option(..., "--model", help="Model file (.safetensors with securetrain metadata)."),
    inputs: Path = typer.Option(..., "--input", help="Encrypted inputs from `he encrypt`."),
    out: Path = typer.Option(..., "--out", help="Encrypted scores to write."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities (approximated sigmoid)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Worker threads (default: CPU count)."),
    audit_db: Optional[str] = _AUDIT,
) -> None:
    """Evaluator: run the model on ciphertexts; never sees plaintext or the secret key."""
    from securetrain.cli.console import console, progress_bar
    from securetrain.he.roles import Evaluator
    from securetrain.io.atomic import atomic_write_bytes

    evaluator = Evaluator(_read(context), source=str(context), threads=threads)
    plan, model_sha = _plan_from_model(model, output)
    data = _read(inputs)
    audit = _audit(audit_db)
    with progress_bar() as bar:
        task = bar.add_task("evaluating", total=None, status=f"depth {plan.depth}")
        try:
            result = evaluator.evaluate(plan, data, source=str(inputs),
                                        progress=lambda k: bar.advance(task, k),
                                        total=lambda n: bar.update(task, total=n))
        except Exception as exc:
            if audit is not None:
                audit.record("he.evaluate", f"he-model:{model_sha[:16]}", outcome="failure",
                             details={"model_file_sha256": model_sha, "error": type(exc).__name__})
            raise
    atomic_write_bytes(out, result, mode=0o644)
    if audit is not None:
        audit.record("he.evaluate", f"he-model:{model_sha[:16]}", details={
            "params": evaluator.params.to_dict(), "depth": plan.depth, "model_file_sha256": model_sha,
            "model_sha256": plan.sha256(), "inputs_sha256": hashlib.sha256(data).hexdigest(),
            "outputs_sha256": hashlib.sha256(result).hexdigest(),
        })
    console.print(f"wrote {out} ({len(result):,} bytes); model depth {plan.depth} of {evaluator.params.max_depth}")


def decrypt(
    context: Path = typer.Option(..., "--context", help="The data owner's secret.stctx."),
    inputs: Path = typer.Option(..., "--input", help="Encrypted scores from `he evaluate`."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write rounded scores as CSV."),
    labels: Optional[Path] = typer.Option(None, "--labels", help="Labels (.npy/.csv) to compute AUC/accuracy."),
    decimals: int = typer.Option(5, "--decimals", help="Round released scores to this many decimals (0-8)."),
    audit_db: Optional[str] = _AUDIT,
) -> None:
    """Data owner: decrypt scores (rounded before release) and compute metrics."""
    import numpy as np

    from securetrain.cli.console import console
    from securetrain.he.metrics import accuracy, roc_auc
    from securetrain.he.roles import DataOwner, bundle_info
    from securetrain.io.atomic import atomic_writer

    owner = DataOwner.from_secret_context(_read(context), source=str(context))
    data = _read(inputs)
    scores = owner.decrypt(data, decimals=decimals, source=str(inputs))
    info = bundle_info(data, str(inputs))
    result: dict[str, object] = {"n_samples": len(scores), "output": info.get("output"),
                                 "model_sha256": info.get("model_sha256")}
    if labels is not None:
        y = _load_array(labels, "labels").ravel()
        if len(y) != len(scores):
            from securetrain.he.errors import HEFormatError

            raise HEFormatError(f"{len(y)} labels for {len(scores)} scores")
        threshold = 0.5 if info.get("output") == "probabilities" else 0.0
        if scores.shape[1] == 1:
            result["auc"] = roc_auc(y, scores[:, 0])
        result["accuracy"] = accuracy(y, scores, threshold)
    if out is not None:
        with atomic_writer(out, mode=0o600) as fh:
            fh.write(("\n".join(",".join(f"{v:.{decimals}f}" for v in row) for row in scores) + "\n").encode())
        result["out"] = str(out)
    audit = _audit(audit_db)
    if audit is not None:
        audit.record("he.decrypt", f"he-model:{str(info.get('model_sha256'))[:16]}", details={
            "outputs_sha256": hashlib.sha256(data).hexdigest(), "n_samples": len(scores), "decimals": decimals,
            **{k: v for k, v in result.items() if k in ("auc", "accuracy")},
        })
    console.print_json(json.dumps(result, default=float))


def plan(
    model: Path = typer.Option(..., "--model", help="Model file (.safetensors with securetrain metadata)."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities."),
) -> None:
    """Show the HE plan of a model: depth, approximations, and the parameters keygen would pick."""
    from securetrain.cli.console import console
    from securetrain.he.params import choose_params

    p, sha = _plan_from_model(model, output)
    params = choose_params(p.depth)
    console.print(f"model {model} (sha256 {sha[:16]}…): {p.n_inputs} → {p.n_outputs}, depth {p.depth}")
    for a in p.approximations:
        console.print(f"  {a.activation}: degree {a.degree} on [-{a.input_range:g}, {a.input_range:g}], "
                      f"max error {a.max_abs_error:.3g}")
    console.print(f"parameters: {params.describe()}")


def register(app: typer.Typer) -> None:
    he_app.command("keygen")(keygen)
    he_app.command("encrypt")(encrypt)
    he_app.command("evaluate")(evaluate)
    he_app.command("decrypt")(decrypt)
    he_app.command("plan")(plan)
    app.add_typer(he_app, name="he")

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
_KEYRING = typer.Option(None, "--keyring", "-k", envvar="SECURETRAIN_KEYRING",
                        help="Keyring file protecting the secret context (passphrase from "
                             "SECURETRAIN_KEYRING_PASSPHRASE); else Vault / SECURETRAIN_KEK.")


def _audit(db: Optional[str]):  # noqa: ANN202
    if db is None:
        return None
    from securetrain.audit.log import AuditLog

    return AuditLog(db)


def _is_csv_header(line: str) -> bool:
    """Whether a CSV file's first line names its columns rather than holding a sample.

    A header has a cell that is not a number (``nan`` and ``inf`` are numbers: such a sample is data,
    never dropped), or is exactly ``0,1,...,n-1``: what pandas writes for an unnamed DataFrame
    (``pd.DataFrame(x).to_csv(index=False)``), read as a sample it added a made-up row.
    """
    cells = [c.strip().strip('"') for c in line.split(",")]

    def number(cell: str) -> bool:
        try:
            float(cell)
        except ValueError:
            return False
        return True

    if any(cell and not number(cell) for cell in cells):
        return True
    return len(cells) > 1 and cells == [str(i) for i in range(len(cells))]


def _load_array(path: Path, what: str):  # noqa: ANN202
    import numpy as np

    from securetrain.he.errors import HEFormatError

    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if path.suffix == ".csv":
            return _load_csv(path.read_bytes(), path, what)
    except OSError as exc:
        raise HEFormatError(f"cannot read {what} from {path}: {exc.strerror}") from exc
    except ValueError as exc:  # numpy's message can quote the data: never forwarded
        raise HEFormatError(f"cannot read {what} from {path}: not a numeric array ({type(exc).__name__})") from None
    raise HEFormatError(f"{what} must be a .npy or .csv file, got {path.name}")


def _load_csv(data: bytes, path: Path, what: str):  # noqa: ANN202
    """A comma-separated file of numbers as float64, rows = samples (features: 2-D; labels: 1-D
    when one column): UTF-8 with or without a byte order mark, any line ends, quoted or bare
    cells, an optional header (:func:`_is_csv_header`). Refusals name rows and columns, never a
    cell's value: the features are the data owner's private data."""
    import csv
    import io
    import warnings

    import numpy as np

    from securetrain.he.errors import HEFormatError

    where = f"cannot read {what} from {path}"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise HEFormatError(f"{where}: it is not UTF-8 text", hint="save it as UTF-8 CSV or as .npy") from None
    # numpy's parser (quotes, blank lines, any line ends) on the rows after a one-line header; the
    # csv module below only where it fails (to name the row and column, or a multi-line header).
    try:
        first = next((row for row in csv.reader(io.StringIO(text, newline="")) if row), None)
    except csv.Error:
        first = None
    if first is not None and text.split("\n", 1)[0].count('"') % 2 == 0:  # the first record is one line
        skip = 1 if _is_csv_header(",".join(first)) else 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Empty input file": refused below
                fast = np.loadtxt(io.StringIO(text), delimiter=",", quotechar='"', skiprows=skip, ndmin=2,
                                  dtype=np.float64)
        except ValueError:
            fast = None
        if fast is not None and fast.size and fast.shape[1] == len(first):
            return fast.ravel() if what != "features" and fast.shape[1] == 1 else fast
    try:
        rows = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
    except csv.Error:
        raise HEFormatError(f"{where}: malformed CSV (values withheld)", hint="check quoting and line ends") from None
    if not rows:
        raise HEFormatError(f"{where}: the file is empty")
    width, widest = len(rows[0]), "the first row"
    if _is_csv_header(",".join(rows[0])):
        rows, widest = rows[1:], "the header"
    if not rows:
        raise HEFormatError(f"{where}: it has a header but no rows")
    ragged = next((i for i, row in enumerate(rows) if len(row) != width), None)
    if ragged is not None:
        raise HEFormatError(f"{where}: data row {ragged + 1} has {len(rows[ragged])} cells, {widest} {width}",
                            hint="a comma-separated file of numbers is expected ('.' as the decimal point)")
    cells = np.char.strip(np.array(rows, dtype=str))
    empty = cells == ""
    if empty.any():
        r, c = (int(i) + 1 for i in np.argwhere(empty)[0])
        raise HEFormatError(f"{where}: {int(empty.sum())} empty cell(s), the first in data row {r}, column {c}",
                            hint="every sample needs every value: fill or drop the incomplete rows")
    try:
        out = cells.astype(np.float64)
    except ValueError:
        r, c = next((i + 1, j + 1) for i, row in enumerate(cells.tolist()) for j, v in enumerate(row)
                    if not _is_number(v))
        raise HEFormatError(f"{where}: the cell in data row {r}, column {c} is not a number (value withheld)",
                            hint="a comma-separated file of numbers is expected ('.' as the decimal point)") from None
    return out.ravel() if what != "features" and width == 1 else out


def _is_number(cell: str) -> bool:
    import numpy as np

    try:
        np.float64(cell)
    except ValueError:
        return False
    return True


def _read(path: Path) -> bytes:
    from securetrain.he.errors import HEFormatError

    try:
        return path.read_bytes()
    except OSError as exc:
        raise HEFormatError(f"cannot read {path}: {exc.strerror}") from exc


def _plan_from_model(model: Path, output: str):  # noqa: ANN202
    """(plan, SHA-256 of the model *file*, activation the data owner applies after decryption).

    ``probabilities``: the evaluator computes logits and the data owner applies the exact sigmoid /
    softmax after decryption. ``encrypted-probabilities``: a fitted polynomial sigmoid under
    encryption (only correct while logits stay inside its interval; nobody can check that on the
    evaluator's side). The plan's own digest is ``plan.sha256()``."""
    from securetrain.he.model_io import load_sequential
    from securetrain.he.plan import compile_model

    _check_output(output)
    seq, file_sha = load_sequential(model)
    plan, final, _ = compile_model(seq, output="probabilities" if output == "encrypted-probabilities" else "logits")
    owner_final = None
    if output == "probabilities":
        owner_final = "sigmoid" if final == "sigmoid" or plan.n_outputs == 1 else "softmax"
    return plan, file_sha, owner_final


def _check_output(output: str) -> None:
    from securetrain.he.errors import HEModelError
    from securetrain.he.roles import OUTPUT_MODES

    if output not in OUTPUT_MODES:
        raise HEModelError(f"--output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")


def _warn(message: str) -> None:
    from securetrain.cli.console import err_console

    err_console.print(f"[bold red]WARNING:[/] {message}", highlight=False, soft_wrap=True)


_DECIMALS_HELP = ("Decimals you will release at `he decrypt` (0-8): the model's outputs on the calibration "
                  "features must span enough release steps (refused under 10, warned under 100).")


def _check_precision(plan, features, params, decimals: int) -> None:  # noqa: ANN001
    """evaluate_encrypted's tiny-output check, before any key (keygen) or ciphertext (encrypt) exists."""
    import warnings

    from securetrain.he.evaluate import check_release_resolution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_release_resolution(plan, features, params, decimals)
    for w in caught:
        _warn(str(w.message))


def _load_owner(context: Path, keyring: Optional[Path]):  # noqa: ANN202
    """The DataOwner from a sealed (or, with a warning, plaintext) secret context file."""
    from securetrain.he.roles import DataOwner
    from securetrain.he.secret_store import open_secret_context, provider_for_secret

    plain, _sealed = open_secret_context(_read(context), lambda: provider_for_secret(keyring, purpose="open"),
                                         source=str(context), warn=_warn)
    return DataOwner.from_secret_context(plain, source=str(context))


def keygen(
    out_dir: Path = typer.Option(..., "--out-dir", help="Directory for secret.stctx (owner-only) and public.stctx."),
    model: Optional[Path] = typer.Option(None, "--model", help="Size the parameters for this model file."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities (with --model)."),
    depth: Optional[int] = typer.Option(None, "--depth", help="Size the parameters for this multiplicative depth."),
    poly_modulus_degree: Optional[int] = typer.Option(None, "--poly-modulus-degree", help="Explicit N (with --coeff-bits)."),
    coeff_bits: Optional[str] = typer.Option(None, "--coeff-bits", help="Explicit prime bit sizes, e.g. 60,40,40,60."),
    scale_bits: int = typer.Option(40, "--scale-bits", help="log2 of the CKKS scale (precision)."),
    calibrate_features: Optional[Path] = typer.Option(
        None, "--calibrate-features",
        help="With --model: features (.npy/.csv) to run the model on in plaintext; the parameters are then searched "
             "(ring size and scale) for the calibrated value bound instead of the fixed 2^40 scale / 20 integer bits."),
    decimals: int = typer.Option(5, "--decimals", help="With --calibrate-features: " + _DECIMALS_HELP),
    galois_keys: bool = typer.Option(False, "--galois-keys", help="Also export rotation keys (not needed here; large)."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing context files."),
    keyring: Optional[Path] = _KEYRING,
    insecure_plaintext_secret: bool = typer.Option(
        False, "--insecure-plaintext-secret",
        help="Write the secret context UNENCRYPTED (throwaway experiments only)."),
) -> None:
    """Data owner: create a CKKS context; write the secret (encrypted under your KEK) and the public context."""
    from securetrain.cli.console import console
    from securetrain.he.errors import HEParameterError
    from securetrain.he.params import HEParams, choose_params
    from securetrain.he.roles import MAX_DECIMALS, DataOwner, check_plan_fits
    from securetrain.he.secret_store import provider_for_secret, write_secret_context
    from securetrain.io.atomic import atomic_write_bytes

    # Resolve the KEK first: with no key source we fail before generating or writing anything.
    provider = None if insecure_plaintext_secret else provider_for_secret(keyring)
    plan = _plan_from_model(model, output)[0] if model is not None else None
    if not 0 <= decimals <= MAX_DECIMALS:
        raise HEParameterError(f"--decimals must be in 0..{MAX_DECIMALS}, got {decimals}")
    cx = None
    if calibrate_features is not None:
        from securetrain.he.errors import HEModelError

        if plan is None:
            raise HEModelError("--calibrate-features needs --model")
        cx = _load_array(calibrate_features, "features")
        if cx.ndim != 2 or cx.shape[1] != plan.n_inputs:
            raise HEModelError(f"the model takes {plan.n_inputs} features, {calibrate_features} has shape {cx.shape}")
    if coeff_bits is not None or poly_modulus_degree is not None:
        if coeff_bits is None or poly_modulus_degree is None:
            raise HEParameterError("--poly-modulus-degree and --coeff-bits go together")
        try:
            bits = tuple(int(b) for b in coeff_bits.split(","))
        except ValueError as exc:
            raise HEParameterError(f"--coeff-bits must be comma-separated integers, got {coeff_bits!r}") from exc
        params = HEParams(poly_modulus_degree, bits, scale_bits)
    elif cx is not None and plan is not None:
        from securetrain.he.calibration import calibrate
        from securetrain.he.evaluate import min_scale_bits_for

        bound = calibrate(plan, cx).value_bound
        params = choose_params(plan.depth, scale_bits=None, integer_bits=None, value_bound=bound,
                               min_scale_bits=min_scale_bits_for(decimals))
        console.print(f"calibrated value bound: {bound:g} ({len(cx)} rows)")
    else:
        need = plan.depth if plan is not None else (depth if depth is not None else 1)
        params = choose_params(need, scale_bits=scale_bits)
    if plan is not None:
        check_plan_fits(plan, params)
    if cx is not None and plan is not None:  # before any key exists
        _check_precision(plan, cx, params, decimals)
    secret_path, public_path = out_dir / SECRET_NAME, out_dir / PUBLIC_NAME
    if not force and (secret_path.exists() or public_path.exists()):
        raise HEParameterError(f"{out_dir} already holds context files", hint="pass --force to replace them")
    with console.status("generating keys"):
        owner = DataOwner(params, galois_keys=galois_keys)
        secret, public = owner.secret_context(), owner.public_context()
    if provider is None:
        _warn(f"--insecure-plaintext-secret: {secret_path} holds the CKKS secret key UNENCRYPTED; anyone who "
              "can read it can decrypt every ciphertext of this context. Use only for throwaway experiments.")
    written = write_secret_context(secret_path, secret, provider)
    atomic_write_bytes(public_path, public, mode=0o644)
    del secret
    console.print(f"parameters: {params.describe()}")
    how = "UNENCRYPTED" if provider is None else f"encrypted under key {provider.current_key_id()!r}"
    console.print(f"secret context: {secret_path} ({written:,} bytes, {how}, keep private)")
    console.print(f"public context: {public_path} ({len(public):,} bytes, give to the evaluator)")


def encrypt(
    context: Path = typer.Option(..., "--context", help="The data owner's secret.stctx."),
    keyring: Optional[Path] = _KEYRING,
    features: Path = typer.Option(..., "--features", help="Features as .npy or numeric .csv (rows = samples)."),
    out: Path = typer.Option(..., "--out", help="Ciphertext bundle to write."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Samples per ciphertext (default: all slots)."),
    pack: bool = typer.Option(False, "--pack", help="Few samples (≤ half the slots): pack several features per "
                                                     "ciphertext; only for models that are one linear layer."),
    calibrate_model: Optional[Path] = typer.Option(
        None, "--calibrate-model",
        help="Model file: run it in plaintext on these features and record the calibrated value bound, so the "
             "evaluator's overflow check uses it instead of the worst case."),
    decimals: int = typer.Option(5, "--decimals", help="With --calibrate-model or --pack: " + _DECIMALS_HELP),
    value_bound_option: Optional[float] = typer.Option(
        None, "--value-bound",
        help="Instead of --calibrate-model: your own bound on every value the evaluation holds (rounded up to a "
             "power of two); the evaluator's overflow check and `he decrypt --encrypted-inputs` enforce it."),
    output: Optional[str] = typer.Option(
        None, "--output",
        help="The --output the evaluator must run (logits | probabilities | encrypted-probabilities), recorded in "
             "the bundle: `he evaluate` with another --output is refused. With --calibrate-model (default logits) "
             "encrypted-probabilities calibrates the polynomial sigmoid's values too."),
) -> None:
    """Data owner: encrypt a feature matrix feature-major (samples in the slots).

    The bundle always carries a value bound (--calibrate-model MODEL, or --value-bound), and with
    --calibrate-model the plan it holds for: the evaluator refuses another model or --output."""
    import math

    from securetrain.cli.console import console, progress_bar
    from securetrain.he.calibration import pow2_ceil
    from securetrain.he.errors import HEParameterError
    from securetrain.io.atomic import atomic_write_bytes

    if calibrate_model is not None and value_bound_option is not None:
        raise HEParameterError("pass --calibrate-model or --value-bound, not both")
    if calibrate_model is None and value_bound_option is None:
        raise HEParameterError(
            "no value bound: the evaluator's overflow check and `he decrypt --encrypted-inputs` need your bound on "
            "every value the evaluation holds; nothing was encrypted",
            hint="pass --calibrate-model MODEL (the model the evaluator runs; computed from these features), or "
                 "--value-bound B if you know it")
    if value_bound_option is not None and not (math.isfinite(value_bound_option) and value_bound_option > 0):
        raise HEParameterError(f"--value-bound must be a positive number, got {value_bound_option}")
    if output is not None:
        _check_output(output)
    owner = _load_owner(context, keyring)
    x = _load_array(features, "features")
    bs = batch_size or owner.params.slots
    value_bound = None if value_bound_option is None else pow2_ceil(value_bound_option)
    plan_sha = None
    if calibrate_model is not None:
        from securetrain.he.calibration import calibrate
        from securetrain.he.errors import HEModelError

        output = output or "logits"
        # the plan the evaluator runs: its every intermediate value must be under the bound
        cplan = _plan_from_model(calibrate_model, output)[0]
        plan_sha = cplan.sha256()
        if x.ndim != 2 or x.shape[1] != cplan.n_inputs:
            raise HEModelError(f"{calibrate_model} takes {cplan.n_inputs} features, {features} has shape {x.shape}")
        value_bound = calibrate(cplan, x).value_bound
        _check_precision(cplan, x, owner.params, decimals)  # before any ciphertext exists
        if pack:  # packed blocks hold partial sums, which can exceed the full sums
            from securetrain.he.calibration import DEFAULT_MARGIN, packed_abs_max, pow2_ceil

            blocks = min(owner.params.slots // len(x), x.shape[1])
            value_bound = max(value_bound, pow2_ceil(DEFAULT_MARGIN * packed_abs_max(cplan, x, blocks)))
    if pack:  # before any ciphertext exists: large features lose the release precision when packed
        from securetrain.he.evaluate import check_packed_precision

        check_packed_precision(x, owner.params, decimals)
    total = math.ceil(len(x) / bs) * (x.shape[1] if x.ndim == 2 else 1)
    with progress_bar() as bar:
        task = bar.add_task("encrypting", total=total, status="")
        bundle = owner.encrypt(x, batch_size=batch_size, progress=lambda k: bar.advance(task, k),
                               value_bound=value_bound, pack=pack, plan_sha256=plan_sha, output=output)
    atomic_write_bytes(out, bundle, mode=0o644)
    console.print(f"wrote {out}: {len(x)} samples × {x.shape[1]} features, {len(bundle):,} bytes "
                  f"(sha256 {hashlib.sha256(bundle).hexdigest()[:16]}…)")
    bound_for = f"plan {plan_sha}" if plan_sha else "any plan (your --value-bound)"
    console.print(f"value bound {value_bound:g} for {bound_for}, --output {output or 'any'}",
                  highlight=False, soft_wrap=True)


def evaluate(
    context: Path = typer.Option(..., "--context", help="The PUBLIC context (public.stctx)."),
    model: Path = typer.Option(..., "--model", help="Model file (.safetensors with securetrain metadata)."),
    inputs: Path = typer.Option(..., "--input", help="Encrypted inputs from `he encrypt`."),
    out: Path = typer.Option(..., "--out", help="Encrypted scores to write."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities (exact sigmoid/softmax applied by "
                                                          "the data owner at decryption) | encrypted-probabilities "
                                                          "(polynomial sigmoid under encryption)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Worker threads (default: CPU count)."),
    audit_db: Optional[str] = _AUDIT,
) -> None:
    """Evaluator: run the model on ciphertexts; never sees plaintext or the secret key."""
    from securetrain.cli.console import console, progress_bar
    from securetrain.he.errors import HEKeyError
    from securetrain.he.roles import Evaluator
    from securetrain.he.secret_store import is_sealed
    from securetrain.io.atomic import atomic_write_bytes

    ctx_bytes = _read(context)
    if is_sealed(ctx_bytes):
        raise HEKeyError(f"{context} is an encrypted secret context; the evaluator must only get the public context",
                         hint="pass the public context file (`keygen` writes public.stctx)")
    evaluator = Evaluator(ctx_bytes, source=str(context), threads=threads)
    plan, file_sha, owner_final = _plan_from_model(model, output)
    plan_sha = plan.sha256()
    digests = {"model_file_sha256": file_sha, "plan_sha256": plan_sha}
    resource = f"he-model:{plan_sha[:16]}"  # same resource as `he decrypt` and evaluate_encrypted()
    data = _read(inputs)
    audit = _audit(audit_db)
    with progress_bar() as bar:
        task = bar.add_task("evaluating", total=None, status=f"depth {plan.depth}")
        try:
            result = evaluator.evaluate(plan, data, source=str(inputs), final_activation=owner_final,
                                        progress=lambda k: bar.advance(task, k),
                                        total=lambda n: bar.update(task, total=n))
        except Exception as exc:
            if audit is not None:
                audit.record("he.evaluate", resource, outcome="failure",
                             details={**digests, "model_sha256": plan_sha, "error": type(exc).__name__})
            raise
    atomic_write_bytes(out, result, mode=0o644)
    if audit is not None:
        audit.record("he.evaluate", resource, details={
            "params": evaluator.params.to_dict(), "depth": plan.depth, **digests,
            "model_sha256": plan_sha,  # alias of plan_sha256, kept for existing audit queries
            "inputs_sha256": hashlib.sha256(data).hexdigest(),
            "outputs_sha256": hashlib.sha256(result).hexdigest(),
        })
    console.print(f"wrote {out} ({len(result):,} bytes); model depth {plan.depth} of {evaluator.params.max_depth}")
    console.print(f"model file sha256: {file_sha}", highlight=False, soft_wrap=True)
    console.print(f"plan sha256:       {plan_sha}", highlight=False, soft_wrap=True)


def decrypt(
    context: Path = typer.Option(..., "--context", help="The data owner's secret.stctx."),
    keyring: Optional[Path] = _KEYRING,
    inputs: Path = typer.Option(..., "--input", help="Encrypted scores from `he evaluate`."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write rounded scores as CSV."),
    labels: Optional[Path] = typer.Option(None, "--labels", help="Labels (.npy/.csv) to compute AUC/accuracy."),
    decimals: int = typer.Option(5, "--decimals", help="Round released scores to this many decimals (0-8)."),
    encrypted_inputs: Optional[Path] = typer.Option(
        None, "--encrypted-inputs",
        help="Your own copy of the inputs bundle you encrypted (`he encrypt --calibrate-model`): its calibrated "
             "value bound is enforced (out-of-bound decryptions are refused, nothing is released) and the scores "
             "must have been computed from exactly that file."),
    max_abs: Optional[float] = typer.Option(
        None, "--max-abs", help="Refuse the decryption if any value exceeds this bound (instead of --encrypted-inputs)."),
    no_value_bound: bool = typer.Option(
        False, "--no-value-bound",
        help="Release the decryption without any value bound (not recommended: evaluator-chosen ciphertexts "
             "then decrypt to whatever they hold)."),
    audit_db: Optional[str] = _AUDIT,
) -> None:
    """Data owner: decrypt scores (rounded before release) and compute metrics.

    A value bound is required (``--encrypted-inputs`` or ``--max-abs``), as ``he encrypt`` requires
    one: ``--no-value-bound`` is the explicit opt-out."""
    import numpy as np

    from securetrain.cli.console import console
    from securetrain.he.metrics import accuracy, macro_auc
    from securetrain.he.plan import apply_final
    from securetrain.he.roles import bundle_info
    from securetrain.io.atomic import atomic_writer

    _check_bound_options(encrypted_inputs, max_abs, no_value_bound)
    owner = _load_owner(context, keyring)
    data = _read(inputs)
    info = bundle_info(data, str(inputs))
    bound = _decrypt_bound(owner, info, encrypted_inputs, max_abs)
    if bound is None:
        _warn("no value bound (--no-value-bound): decrypted values are released without the out-of-bound check")
    scores = owner.decrypt(data, decimals=decimals, source=str(inputs), max_abs=bound)
    output = info.get("output")
    final = info.get("final_activation")
    if final is not None:  # exact, here at the data owner, never approximated under encryption
        scores, output = np.round(apply_final(scores, final), decimals), "probabilities"
    elif output == "probabilities" and (np.any(scores < -0.01) or np.any(scores > 1.01)):
        _warn(f"{int(np.sum((scores < -0.01) | (scores > 1.01)))} encrypted-polynomial 'probabilities' lie outside "
              "[0, 1]: logits left the sigmoid's fitted interval, so these scores are wrong; evaluate with "
              "--output probabilities (exact sigmoid at decryption) instead")
    # The bundle's `model_sha256` header field is the plan digest (what `he plan` prints as plan sha256).
    plan_sha = info.get("model_sha256")
    result: dict[str, object] = {"n_samples": len(scores), "output": output, "plan_sha256": plan_sha,
                                 "value_bound": bound}
    if labels is not None:
        y = _load_array(labels, "labels").ravel()
        if len(y) != len(scores):
            from securetrain.he.errors import HEFormatError

            raise HEFormatError(f"{len(y)} labels for {len(scores)} scores")
        from securetrain.he.evaluate import check_class_ids

        y = check_class_ids(y, scores.shape[1])
        threshold = 0.5 if output == "probabilities" else 0.0
        probs = scores if output == "probabilities" or scores.shape[1] == 1 else apply_final(scores, "softmax")
        result["auc"] = macro_auc(y, probs)  # macro one-vs-rest for several classes
        result["accuracy"] = accuracy(y, probs, threshold)
    if out is not None:
        with atomic_writer(out, mode=0o600) as fh:
            fh.write(("\n".join(",".join(f"{v:.{decimals}f}" for v in row) for row in scores) + "\n").encode())
        result["out"] = str(out)
    audit = _audit(audit_db)
    if audit is not None:
        audit.record("he.decrypt", f"he-model:{str(plan_sha)[:16]}", details={
            "plan_sha256": plan_sha, "outputs_sha256": hashlib.sha256(data).hexdigest(), "n_samples": len(scores), "decimals": decimals,
            "value_bound": bound,
            **{k: v for k, v in result.items() if k in ("auc", "accuracy")},
        })
    console.print_json(json.dumps(result, default=float))


def _check_bound_options(encrypted_inputs: Optional[Path], max_abs: Optional[float], no_value_bound: bool) -> None:
    """``he decrypt``'s bound options, checked before any key is opened: exactly one of
    ``--encrypted-inputs``, ``--max-abs`` (a positive number) and ``--no-value-bound``. Fail closed:
    an outputs file spliced with other ciphertexts of the same parameters decrypts to values of
    ~1e7, released unless a bound stops them."""
    import math

    from securetrain.he.errors import HEParameterError

    if encrypted_inputs is not None and max_abs is not None:
        raise HEParameterError("pass --encrypted-inputs or --max-abs, not both")
    if no_value_bound and (encrypted_inputs is not None or max_abs is not None):
        raise HEParameterError("--no-value-bound contradicts --encrypted-inputs/--max-abs: pass one of them")
    if encrypted_inputs is None and max_abs is None and not no_value_bound:
        raise HEParameterError(
            "he decrypt needs the value bound it enforces before releasing anything",
            hint="pass --encrypted-inputs IN.stcts (your own copy of the inputs you encrypted) or --max-abs B; "
                 "--no-value-bound releases without the check")
    if max_abs is not None and not (math.isfinite(max_abs) and max_abs > 0):
        raise HEParameterError(f"--max-abs must be a positive number, got {max_abs}")


def _decrypt_bound(owner, outputs_info: dict, encrypted_inputs: Optional[Path],  # noqa: ANN001
                   max_abs: Optional[float]) -> Optional[float]:
    """The bound ``he decrypt`` enforces: the value bound of the data owner's *own* inputs bundle
    (never the evaluator's outputs header, which an untrusted evaluator could strip or raise), or
    ``--max-abs`` (both options already checked by :func:`_check_bound_options`). Everything is
    checked before anything is decrypted."""
    import math

    from securetrain.he.errors import HEFormatError, HEKeyError, HEParameterError
    from securetrain.he.roles import bundle_info, check_outputs_binding

    if max_abs is not None:
        return float(max_abs)
    if encrypted_inputs is None:
        return None
    raw = _read(encrypted_inputs)
    h = bundle_info(raw, str(encrypted_inputs))
    if h.get("role") != "inputs":
        raise HEFormatError(f"{encrypted_inputs} holds {h.get('role')!r} ciphertexts, not the inputs you encrypted",
                            hint="pass the file `he encrypt --out` wrote")
    if h.get("context_id") != owner.context_id:
        raise HEKeyError(f"{encrypted_inputs} was encrypted under a different context")
    if outputs_info.get("inputs_sha256") != hashlib.sha256(raw).hexdigest():
        raise HEFormatError(f"the scores were not computed from {encrypted_inputs} (its sha256 differs from the "
                            "outputs' inputs_sha256); nothing is released",
                            hint="pass the inputs bundle you sent to the evaluator for this evaluation")
    if h.get("n_samples") != outputs_info.get("n_samples"):
        raise HEFormatError(f"{encrypted_inputs} holds {h.get('n_samples')} samples, the scores "
                            f"{outputs_info.get('n_samples')}")
    check_outputs_binding(h, outputs_info, str(encrypted_inputs))
    bound = h.get("value_bound")
    if bound is None:
        raise HEParameterError(f"{encrypted_inputs} carries no calibrated value bound",
                               hint="encrypt with `he encrypt --calibrate-model MODEL`, or pass --max-abs")
    try:
        value = float(bound)
    except (TypeError, ValueError) as exc:
        raise HEFormatError(f"{encrypted_inputs}: value_bound {bound!r} is not a number") from exc
    if not (math.isfinite(value) and value > 0):
        raise HEFormatError(f"{encrypted_inputs}: value_bound {bound!r} is not a positive number")
    return value


def plan(
    model: Path = typer.Option(..., "--model", help="Model file (.safetensors with securetrain metadata)."),
    output: str = typer.Option("logits", "--output", help="logits | probabilities | encrypted-probabilities."),
) -> None:
    """Show the HE plan of a model: depth, approximations, and the parameters keygen would pick."""
    from securetrain.cli.console import console
    from securetrain.he.params import choose_params

    p, file_sha, owner_final = _plan_from_model(model, output)
    params = choose_params(p.depth)
    shown = f"probabilities ({owner_final} applied by the data owner after decryption)" if owner_final else p.output
    console.print(f"model {model}: {p.n_inputs} → {p.n_outputs}, depth {p.depth}, output {shown}")
    console.print(f"model file sha256: {file_sha}", highlight=False, soft_wrap=True)
    # The plan digest is what `he evaluate`/`he decrypt` and the he.evaluate audit event record.
    console.print(f"plan sha256:       {p.sha256()}", highlight=False, soft_wrap=True)
    for a in p.approximations:
        console.print(f"  {a.activation}: degree {a.degree} on [-{a.input_range:g}, {a.input_range:g}], "
                      f"max error {a.max_abs_error:.3g}")
    console.print(f"parameters: {params.describe()}")


def seal_secret(
    context: Path = typer.Option(..., "--context", help="A plaintext secret.stctx (from older versions or "
                                                       "--insecure-plaintext-secret)."),
    keyring: Optional[Path] = _KEYRING,
) -> None:
    """Data owner: encrypt an existing plaintext secret context in place, under your KEK."""
    from securetrain.cli.console import console
    from securetrain.he.secret_store import is_sealed, provider_for_secret, write_secret_context

    data = _read(context)
    if is_sealed(data):
        console.print(f"{context} is already encrypted")
        return
    provider = provider_for_secret(keyring)
    written = write_secret_context(context, data, provider)  # validates it is a secret he-context first
    del data
    console.print(f"sealed {context} ({written:,} bytes) under key {provider.current_key_id()!r}; "
                  "the old plaintext may survive on disk/backups: treat it as exposed if in doubt")


def register(app: typer.Typer) -> None:
    he_app.command("keygen")(keygen)
    he_app.command("encrypt")(encrypt)
    he_app.command("evaluate")(evaluate)
    he_app.command("decrypt")(decrypt)
    he_app.command("plan")(plan)
    he_app.command("seal-secret")(seal_secret)
    app.add_typer(he_app, name="he")

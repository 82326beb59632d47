"""The two parties, kept apart by what they can deserialize.

* :class:`DataOwner` creates the CKKS context and keeps the secret key; it exports a *public*
  context (public + relinearisation keys, optionally Galois keys, never the secret key), encrypts
  the evaluation set and decrypts the scores it gets back.
* :class:`Evaluator` is built **only** from public-context bytes and refuses a context that
  holds a secret key. It runs an :class:`~securetrain.he.plan.HEPlan` on ciphertexts.

File kinds (see container.py and docs/homomorphic-evaluation.md): ``he-context`` (one frame:
TenSEAL's protobuf context) and ``he-ciphertexts`` (one frame per CKKSVector, batch-major:
frame ``b*n_columns + c`` holds column ``c`` of samples ``b*batch_size ...``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from securetrain.he import container
from securetrain.he._lazy import require_tenseal
from securetrain.he.errors import HEFormatError, HEKeyError, HEModelError, HEParameterError, HEPlanMismatchError
from securetrain.he.params import HEParams
from securetrain.he.plan import HEPlan, LinearStep, PolyStep
from securetrain.he.strategy import Node, NullBackend, Ops, max_abs_bound, run_plan

log = logging.getLogger(__name__)

CONTEXT_KIND = "he-context"
CIPHERTEXTS_KIND = "he-ciphertexts"
FORMAT_VERSION = 1
MAX_DECIMALS = 8
#: What an evaluator returns (``he evaluate --output``): logits; logits the data owner turns into
#: probabilities (exact sigmoid/softmax) after decryption; a polynomial sigmoid under encryption.
OUTPUT_MODES = ("logits", "probabilities", "encrypted-probabilities")

Progress = Callable[[int], None]  # called with the number of units just completed


def _default_threads() -> int:
    import os

    return max(1, min(8, os.cpu_count() or 1))


def _plain(c: Any) -> Any:
    return c.tolist() if isinstance(c, np.ndarray) else c


class _TenSEALBackend:
    """Scalars, or numpy vectors (one value per slot, the packed layout)."""

    def mul_plain(self, x: Any, c: Any) -> Any:
        return x * _plain(c)

    def mul(self, x: Any, y: Any) -> Any:
        return x * y

    def add(self, x: Any, y: Any) -> Any:
        return x + y

    def add_plain(self, x: Any, c: Any) -> Any:
        return x + _plain(c)


def _wrap_ts_error(what: str) -> Callable[[Exception], HEFormatError]:
    def make(exc: Exception) -> HEFormatError:
        return HEFormatError(f"{what}: TenSEAL could not load it ({exc.__class__.__name__})")

    return make


def _parse_context_header(header: dict[str, Any]) -> tuple[HEParams, str, bool]:
    if header.get("format_version") != FORMAT_VERSION:
        raise HEFormatError(f"unsupported he-context format_version {header.get('format_version')!r}")
    if len(header.get("frames", [])) != 1:
        raise HEFormatError("an he-context file must hold exactly one frame")
    cid = header.get("context_id")
    if not isinstance(cid, str) or len(cid) != 32:
        raise HEFormatError("he-context header has no valid context_id")
    return HEParams.from_dict(header.get("params", {})), cid, bool(header.get("scale_compensation", False))


def _ratio_fn(params: HEParams, compensate: bool) -> Callable[[int], float]:
    if not compensate:
        return lambda level: 1.0
    return lambda level: params.scale / params.rescale_prime(level)


def as_array(a: Any, dtype: Any = np.float64, what: str = "features") -> np.ndarray:
    """``a`` (numpy array, nested lists, or a torch tensor on any device and of any dtype) as a
    numpy array; a tensor on the meta device has no values and is refused with a typed error."""
    if hasattr(a, "detach"):
        t = a.detach()
        if getattr(t, "is_meta", False):
            raise HEModelError(f"{what} are on the meta device: they hold no values",
                               hint="pass the real data (a CPU/GPU tensor or a numpy array)")
        t = t.cpu()
        if t.is_floating_point() and t.dtype not in (_torch().float32, _torch().float64):
            t = t.double()  # bfloat16/float16: numpy has no bfloat16
        a = t.numpy()
    try:
        return np.asarray(a, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise HEModelError(f"{what} are not numeric: {exc}") from exc


def _torch() -> Any:
    import torch

    return torch


def _input_bound(x: np.ndarray) -> float:
    """Smallest power of two ≥ max|x|: all the evaluator learns about the data's range."""
    m = float(np.max(np.abs(x))) if x.size else 0.0
    return float(2.0 ** math.ceil(math.log2(m))) if m > 0 else 1.0


class DataOwner:
    """Holds the secret key. Never send :meth:`secret_context` anywhere."""

    def __init__(self, params: HEParams, *, galois_keys: bool = False, _ctx: Any = None,
                 _context_id: str | None = None, _compensate: bool | None = None) -> None:
        ts = require_tenseal()
        self.params = params
        if _ctx is None:
            _ctx = ts.context(
                ts.SCHEME_TYPE.CKKS,
                poly_modulus_degree=params.poly_modulus_degree,
                coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
            )
            _ctx.global_scale = params.scale
            if not _ctx.has_relin_keys():
                _ctx.generate_relin_keys()
            if galois_keys:
                _ctx.generate_galois_keys()
        self._ctx = _ctx
        self.context_id = _context_id or secrets.token_hex(16)
        self.scale_compensation = self._probe_primes() if _compensate is None else _compensate

    # -- keys ----------------------------------------------------------------------------------
    def _probe_primes(self) -> bool:
        """Check our prediction of SEAL's primes on the real context (we hold the secret key):
        chain x·1.0 through every level and compare the drift with Π Δ/q."""
        ts = require_tenseal()
        p = self.params
        if p.max_depth == 0:
            return True
        v = ts.ckks_vector(self._ctx, [1.0] * min(p.slots, 4096))
        expected = 1.0
        for level in range(p.max_depth):
            v = v * 1.0
            expected *= p.scale / p.rescale_prime(level)
            got = float(np.mean(v.decrypt()))
            if abs(got - expected) > 2e-9 + 1e-3 * abs(expected - 1.0):
                log.warning("CKKS prime prediction did not match this SEAL build; scale compensation off")
                return False
        return True

    def _context_file(self, *, secret: bool) -> bytes:
        blob = self._ctx.serialize(save_public_key=True, save_secret_key=secret,
                                   save_galois_keys=self._ctx.has_galois_keys(), save_relin_keys=True)
        fields = {
            "format_version": FORMAT_VERSION,
            "context_id": self.context_id,
            "has_secret_key": secret,
            "galois_keys": bool(self._ctx.has_galois_keys()),
            "params": self.params.to_dict(),
            "scale_compensation": self.scale_compensation,
        }
        return container.encode(CONTEXT_KIND, fields, [blob])

    def public_context(self) -> bytes:
        """The context file to give the evaluator: no secret key."""
        return self._context_file(secret=False)

    def secret_context(self) -> bytes:
        """The full context including the secret key. Never store it as is: seal it with
        :func:`securetrain.he.secret_store.seal_secret_context` (what ``he keygen`` writes)."""
        return self._context_file(secret=True)

    @classmethod
    def from_secret_context(cls, data: bytes, source: str = "context") -> DataOwner:
        ts = require_tenseal()
        c = container.decode(data, expect_kind=CONTEXT_KIND, source=source)
        params, cid, compensate = _parse_context_header(c.header)
        try:
            ctx = ts.context_from(c.frames[0])
        except Exception as exc:
            raise _wrap_ts_error(source)(exc) from exc
        if not ctx.is_private():
            raise HEKeyError(f"{source} is a public context: it cannot decrypt",
                             hint="use the secret context written by `securetrain he keygen`")
        return cls(params, _ctx=ctx, _context_id=cid, _compensate=compensate)

    # -- data ----------------------------------------------------------------------------------
    def encrypt(self, features: Any, *, batch_size: int | None = None, threads: int | None = None,
                progress: Progress | None = None, value_bound: float | None = None, pack: bool = False,
                plan_sha256: str | None = None, output: str | None = None) -> bytes:
        """Encrypt ``features`` (n_samples, n_features) feature-major: one CKKSVector per feature
        and batch, samples in the slots.

        ``pack=True`` (few samples: n ≤ slots/2) puts k = slots // n features in one ciphertext,
        one block of n slots each ("feature-packed" layout); only single-affine-step plans run on
        it (see :meth:`Evaluator.evaluate`). ``value_bound`` is the data owner's calibrated bound on
        every intermediate |value| (:func:`securetrain.he.calibration.calibrate`); the evaluator
        then checks headroom against it instead of the worst case implied by ``input_abs_max``.

        ``plan_sha256`` (the digest of the plan ``value_bound`` was calibrated on) and ``output``
        (one of :data:`OUTPUT_MODES`, what the evaluator is to return) bind the bundle: the
        evaluator refuses another plan or output (:class:`HEPlanMismatchError`), and so does the
        data owner at decryption (:func:`check_outputs_binding`)."""
        ts = require_tenseal()
        x = as_array(features)
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise HEFormatError(f"features must be a non-empty 2-D array, got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise HEFormatError("features contain NaN or inf")
        bs = self.params.slots if batch_size is None else int(batch_size)
        if not 1 <= bs <= self.params.slots:
            raise HEParameterError(f"batch_size must be in 1..{self.params.slots} (the slot count)")
        n, cols = x.shape
        if value_bound is not None and not (math.isfinite(value_bound) and value_bound > 0):
            raise HEParameterError(f"value_bound must be a positive number, got {value_bound}")
        if plan_sha256 is not None and not (isinstance(plan_sha256, str) and len(plan_sha256) == 64
                                            and all(c in "0123456789abcdef" for c in plan_sha256)):
            raise HEParameterError("plan_sha256 must be a plan digest (64 lower-case hex characters, HEPlan.sha256())")
        if output is not None and output not in OUTPUT_MODES:
            raise HEParameterError(f"output must be one of {', '.join(OUTPUT_MODES)}, got {output!r}")
        blocks = 1
        if pack:
            if n > self.params.slots // 2:
                raise HEParameterError(f"packing needs n_samples ≤ {self.params.slots // 2} (half the slots), got {n}")
            blocks, bs = min(self.params.slots // n, cols), n
        groups = math.ceil(cols / blocks)
        jobs = [(b, g) for b in range(math.ceil(n / bs)) for g in range(groups)]
        ops = Ops(NullBackend(), threads=threads or _default_threads())
        lock = threading.Lock()

        def column_block(b: int, g: int) -> list[float]:
            if not pack:
                return x[b * bs:(b + 1) * bs, g].tolist()
            vec = np.zeros(blocks * n)
            for i in range(blocks):
                if g * blocks + i < cols:
                    vec[i * n:(i + 1) * n] = x[:, g * blocks + i]
            return vec.tolist()

        def enc(job: tuple[int, int]) -> bytes:
            blob = ts.ckks_vector(self._ctx, column_block(*job)).serialize()
            if progress is not None:
                with lock:
                    progress(1)
            return blob

        frames = ops.map(enc, jobs)
        fields = {
            "format_version": FORMAT_VERSION,
            "context_id": self.context_id,
            "role": "inputs",
            "layout": "feature-packed" if pack else "feature-major",
            "n_samples": n,
            "n_columns": cols,
            "batch_size": bs,
            "input_abs_max": _input_bound(x),
            "params": self.params.to_dict(),
        }
        if pack:
            fields["blocks"] = blocks
        if value_bound is not None:
            fields["value_bound"] = float(value_bound)
        if plan_sha256 is not None:
            fields["plan_sha256"] = plan_sha256
        if output is not None:
            fields["output"] = output
        return container.encode(CIPHERTEXTS_KIND, fields, frames)

    def decrypt(self, bundle: bytes, *, decimals: int = 5, source: str = "ciphertexts",
                max_abs: float | None = None) -> np.ndarray:
        """Decrypt an evaluator's outputs bundle to (n_samples, n_columns), **rounded to ``decimals``**
        before release: the low-order digits of a CKKS decryption carry noise that can leak the
        secret key (Li–Micciancio, EUROCRYPT 2021).

        Only ``role: outputs`` bundles are decrypted. ``max_abs`` (the data owner's calibrated
        ``value_bound``) refuses values beyond it: a ciphertext that was replaced or spliced in
        (digests are not signatures) or a wrapped-around evaluation decrypts to values of the size
        of the modulus, which are never released."""
        ts = require_tenseal()
        if not isinstance(decimals, int) or not 0 <= decimals <= MAX_DECIMALS:
            raise HEParameterError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")
        hdr, frames = _parse_bundle(bundle, self.context_id, source)
        if hdr.get("role") != "outputs":
            raise HEFormatError(f"{source} holds {hdr.get('role')!r} ciphertexts, not an evaluator's outputs",
                                hint="decrypt the file written by `securetrain he evaluate`")
        cols, bs, n = hdr["n_columns"], hdr["batch_size"], hdr["n_samples"]
        factors = _output_factors(hdr.get("output_factors"), cols, source)
        blocks = _blocks(hdr)
        out = np.empty((n, cols))
        for i, blob in enumerate(frames):
            b, c = divmod(i, cols)
            try:
                vec = ts.ckks_vector_from(self._ctx, blob)
            except Exception as exc:
                raise _wrap_ts_error(f"{source} frame {i}")(exc) from exc
            vals = np.asarray(vec.decrypt(), dtype=np.float64)
            want = min(bs, n - b * bs)
            if vals.shape != (want * blocks,):
                raise HEFormatError(f"{source} frame {i} holds {vals.shape[0]} values, expected {want * blocks}")
            # Packed layout: each block holds the partial sum over its features; the score is their sum.
            out[b * bs:b * bs + want, c] = vals.reshape(blocks, want).sum(axis=0) / factors[c]
        if not np.all(np.isfinite(out)) or (max_abs is not None and float(np.max(np.abs(out))) > max_abs):
            raise HEFormatError(
                f"{source}: decrypted values reach {float(np.max(np.abs(out))):.3g}, beyond the bound {max_abs} of every "
                "value this evaluation can hold: the ciphertexts were replaced or tampered with, or the evaluation "
                "wrapped around; nothing is released",
                hint="re-run the evaluation from the inputs you encrypted")
        return np.round(out, decimals)


#: Output factors are products of per-level ratios Δ/q (|1 − Δ/q| ≤ ~1.5e-6); anything else is not
#: what an evaluator computes and would rescale the released scores at will.
_MAX_FACTOR_DRIFT = 1e-3


def _output_factors(raw: Any, cols: int, source: str) -> list[float]:
    if raw is None:
        return [1.0] * cols
    try:
        factors = [float(f) for f in raw]
    except (TypeError, ValueError) as exc:
        raise HEFormatError(f"{source}: output_factors must be numbers") from exc
    if len(factors) != cols or not all(math.isfinite(f) and abs(f - 1.0) <= _MAX_FACTOR_DRIFT for f in factors):
        raise HEFormatError(f"{source}: output_factors {raw!r} are not {cols} scale corrections close to 1")
    return factors


def _parse_bundle(data: bytes, context_id: str, source: str) -> tuple[dict[str, Any], tuple[bytes, ...]]:
    c = container.decode(data, expect_kind=CIPHERTEXTS_KIND, source=source)
    h = c.header
    if h.get("format_version") != FORMAT_VERSION:
        raise HEFormatError(f"{source}: unsupported format_version {h.get('format_version')!r}")
    if h.get("layout") not in ("feature-major", "feature-packed"):
        raise HEFormatError(f"{source}: unsupported layout {h.get('layout')!r}")
    if h.get("context_id") != context_id:
        raise HEKeyError(f"{source} was encrypted under a different context",
                         hint="use the context files from the same `securetrain he keygen` run")
    try:
        n, cols, bs = int(h["n_samples"]), int(h["n_columns"]), int(h["batch_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise HEFormatError(f"{source}: header lacks sample/column counts") from exc
    blocks = _blocks(h, source)
    per_batch = math.ceil(cols / blocks) if h.get("role") == "inputs" else cols
    if n < 1 or cols < 1 or bs < 1 or len(c.frames) != math.ceil(n / bs) * per_batch:
        raise HEFormatError(f"{source}: {len(c.frames)} frames do not match {n} samples × {cols} columns")
    if blocks > 1 and bs != n:
        raise HEFormatError(f"{source}: a packed bundle holds exactly one batch")
    return h, c.frames


def _blocks(h: dict[str, Any], source: str = "ciphertexts") -> int:
    if h.get("layout") != "feature-packed":
        return 1
    blocks = h.get("blocks")
    if not isinstance(blocks, int) or blocks < 1:
        raise HEFormatError(f"{source}: a feature-packed bundle needs a positive integer 'blocks'")
    return blocks


def output_mode(plan_output: Any, final_activation: Any) -> str:
    """The :data:`OUTPUT_MODES` entry of an evaluation: its plan's output and the final activation
    left to the data owner (an outputs header's ``output`` and ``final_activation``)."""
    if final_activation is not None:
        return "probabilities"
    return "encrypted-probabilities" if plan_output == "probabilities" else "logits"


def check_plan_binding(inputs_header: dict[str, Any], plan_sha256: str, mode: str, source: str = "inputs") -> None:
    """Refuse (:class:`HEPlanMismatchError`) a plan digest or output mode other than the ones the
    data owner recorded in its inputs bundle (``plan_sha256``, ``output``; absent: not bound)."""
    want_plan, want_mode = inputs_header.get("plan_sha256"), inputs_header.get("output")
    if want_plan is not None and want_plan != plan_sha256:
        raise HEPlanMismatchError(
            f"{source} was encrypted for plan {str(want_plan)[:16]}…, this evaluation runs plan {plan_sha256[:16]}…: "
            "its value bound was calibrated on another model (or other approximations or --output); "
            "nothing is evaluated or released",
            hint="evaluate the model file the data owner calibrated with (`he plan --model M --output O` prints "
                 "its plan sha256), or have the data owner re-encrypt with `he encrypt --calibrate-model` for this one")
    if want_mode is not None and want_mode != mode:
        raise HEPlanMismatchError(
            f"{source} was encrypted for --output {want_mode}, this evaluation is --output {mode}; "
            "nothing is evaluated or released",
            hint=f"run `he evaluate --output {want_mode}`, or have the data owner re-encrypt with "
                 f"`he encrypt --output {mode}`")


def check_outputs_binding(inputs_header: dict[str, Any], outputs_header: dict[str, Any],
                          source: str = "inputs") -> None:
    """At decryption, before anything is decrypted: the outputs (the evaluator's word) must come from
    the plan and output mode recorded in the data owner's own inputs bundle (``source`` names it)."""
    check_plan_binding(inputs_header, str(outputs_header.get("model_sha256")),
                       output_mode(outputs_header.get("output"), outputs_header.get("final_activation")),
                       source=source)


def bundle_info(data: bytes, source: str = "ciphertexts") -> dict[str, Any]:
    """The header of a ciphertext bundle (no key needed)."""
    return container.decode(data, expect_kind=CIPHERTEXTS_KIND, source=source).header


class Evaluator:
    """Runs models on ciphertexts. Constructed from public-context bytes only."""

    def __init__(self, public_context: bytes, *, source: str = "public context", threads: int | None = None) -> None:
        ts = require_tenseal()
        c = container.decode(public_context, expect_kind=CONTEXT_KIND, source=source)
        self.params, self.context_id, compensate = _parse_context_header(c.header)
        try:
            ctx = ts.context_from(c.frames[0])
        except Exception as exc:
            raise _wrap_ts_error(source)(exc) from exc
        # Check the key material itself, not just the header's claim.
        if ctx.is_private() or c.header.get("has_secret_key"):
            raise HEKeyError(f"{source} contains the secret key; the evaluator must only get the public context",
                             hint="pass the public context file (`keygen` writes public.stctx)")
        self._ctx = ctx
        self._ratio = _ratio_fn(self.params, compensate)
        self.threads = threads or _default_threads()

    def check_plan(self, plan: HEPlan, input_abs_max: float | None = None, *, value_bound: float | None = None) -> int:
        """Raise :class:`HEParameterError` unless ``plan`` fits these parameters; returns its depth."""
        return check_plan_fits(plan, self.params, input_abs_max, value_bound=value_bound)

    def _evaluate_packed(self, plan: HEPlan, inputs: bytes, h: dict[str, Any], frames: tuple[bytes, ...],
                         source: str, final_activation: str | None) -> bytes:
        """One affine step on feature-packed inputs: output k = Σ_g ct_g ⊙ w_k,g + b_k·[block 0], where
        w_k,g repeats W[k, g·blocks+i] over block i. No rotation: the data owner sums the blocks."""
        ts = require_tenseal()
        if len(plan.steps) != 1 or not isinstance(plan.steps[0], LinearStep):
            raise HEModelError("feature-packed inputs support a single affine layer (a linear head / logistic "
                               f"model); this plan has depth {plan.depth}",
                               hint="encrypt without packing (DataOwner.encrypt(..., pack=False))")
        step = plan.steps[0]
        n, blocks, cols = int(h["n_samples"]), _blocks(h, source), int(h["n_columns"])
        try:
            cts = [Node(ts.ckks_vector_from(self._ctx, f), 0) for f in frames]
        except Exception as exc:
            raise _wrap_ts_error(source)(exc) from exc
        ops = Ops(_TenSEALBackend(), self._ratio, threads=self.threads)
        bias_mask = np.zeros(blocks * n)
        bias_mask[:n] = 1.0

        def output(k: int) -> Node:
            terms = []
            for g, ct in enumerate(cts):
                w = np.zeros(blocks)
                idx = slice(g * blocks, min(cols, (g + 1) * blocks))
                w[: idx.stop - idx.start] = step.weight[k, idx]
                if np.any(w != 0.0):
                    terms.append(ops.mul_plain(ct, np.repeat(w, n)))
            acc = ops.total(terms) if terms else ops.mul_plain(cts[0], 0.0)
            return ops.add_plain(acc, float(step.bias[k]) * bias_mask)

        outs = ops.map(output, range(step.n_out))
        fields = {
            "format_version": FORMAT_VERSION,
            "context_id": self.context_id,
            "role": "outputs",
            "layout": "feature-packed",
            "blocks": blocks,
            "n_samples": n,
            "n_columns": plan.n_outputs,
            "batch_size": n,
            "output": plan.output,
            "output_factors": [o.factor for o in outs],
            "final_activation": final_activation,
            "model_sha256": plan.sha256(),
            "inputs_sha256": hashlib.sha256(inputs).hexdigest(),
            "params": self.params.to_dict(),
        }
        return container.encode(CIPHERTEXTS_KIND, fields, [o.payload.serialize() for o in outs])

    def evaluate(self, plan: HEPlan, inputs: bytes, *, source: str = "ciphertexts", final_activation: str | None = None,
                 progress: Progress | None = None, total: Callable[[int], None] | None = None) -> bytes:
        """Run ``plan`` on an inputs bundle. ``final_activation`` ("sigmoid"/"softmax") is recorded in
        the outputs header for the data owner to apply, exactly, after decryption."""
        if final_activation not in (None, "sigmoid", "softmax"):
            raise HEModelError(f"final_activation must be sigmoid or softmax, got {final_activation!r}")
        ts = require_tenseal()
        h, frames = _parse_bundle(inputs, self.context_id, source)
        if h.get("role") != "inputs":
            raise HEFormatError(f"{source} holds {h.get('role')!r}, expected encrypted inputs")
        check_plan_binding(h, plan.sha256(), output_mode(plan.output, final_activation), source)
        if h["n_columns"] != plan.n_inputs:
            raise HEModelError(f"the model expects {plan.n_inputs} features, {source} has {h['n_columns']}")
        self.check_plan(plan, h.get("input_abs_max"), value_bound=h.get("value_bound"))
        if h["layout"] == "feature-packed":
            return self._evaluate_packed(plan, inputs, h, frames, source, final_activation)
        if not self._ctx.has_relin_keys() and _needs_relin(plan):
            raise HEKeyError("the public context has no relinearisation keys; this model multiplies ciphertexts")
        cols = h["n_columns"]
        n_batches = len(frames) // cols
        per_batch = _count_ops(plan)
        if total is not None:
            total(per_batch * n_batches)
        lock = threading.Lock()

        def tick(_node: Node) -> None:
            if progress is not None:
                with lock:
                    progress(1)

        ops = Ops(_TenSEALBackend(), self._ratio, on_node=tick, threads=self.threads)
        out_frames: list[bytes] = []
        factors: list[float] | None = None
        for b in range(n_batches):
            try:
                nodes = [Node(ts.ckks_vector_from(self._ctx, frames[b * cols + c]), 0) for c in range(cols)]
            except Exception as exc:
                raise _wrap_ts_error(f"{source} batch {b}")(exc) from exc
            outs = run_plan(plan, nodes, ops)
            factors = [n.factor for n in outs]
            out_frames.extend(n.payload.serialize() for n in outs)
        fields = {
            "format_version": FORMAT_VERSION,
            "context_id": self.context_id,
            "role": "outputs",
            "layout": "feature-major",
            "n_samples": h["n_samples"],
            "n_columns": plan.n_outputs,
            "batch_size": h["batch_size"],
            "output": plan.output,
            "output_factors": factors,
            "final_activation": final_activation,
            "model_sha256": plan.sha256(),
            "inputs_sha256": hashlib.sha256(inputs).hexdigest(),
            "params": self.params.to_dict(),
        }
        return container.encode(CIPHERTEXTS_KIND, fields, out_frames)


def _count_ops(plan: HEPlan) -> int:
    count = 0

    def inc(_n: Node) -> None:
        nonlocal count
        count += 1

    run_plan(plan, [Node(None, 0) for _ in range(plan.n_inputs)], Ops(NullBackend(), on_node=inc))
    return count


def _needs_relin(plan: HEPlan) -> bool:
    return any(isinstance(s, PolyStep) and s.degree >= 2 for s in plan.steps)


def check_plan_fits(plan: HEPlan, params: HEParams, input_abs_max: float | None = None, *,
                    value_bound: float | None = None) -> int:
    """Depth and overflow check, before any ciphertext exists.

    With ``value_bound`` (the data owner's calibrated bound on every intermediate |value|) each
    level must hold it: log2(value_bound) + scale_bits + 1 < log2 Q_level. Otherwise, when the
    input range is known, a sound but pessimistic interval bound through the plan is used."""
    depth = plan.depth
    if depth > params.max_depth:
        raise HEParameterError(
            f"the model needs multiplicative depth {depth} but the parameters provide {params.max_depth} "
            f"({params.describe()})",
            hint=f"generate keys for this model (`securetrain he keygen --model ...`) or use "
                 f"he.params.choose_params({depth})",
        )

    def refuse(bound: float, level: int, basis: str) -> HEParameterError:
        return HEParameterError(
            f"intermediate values may reach {bound:.3g} at level {level}, beyond the "
            f"{params.modulus_bits_at(level) - params.scale_bits - 1:.0f}-bit headroom ({basis}): the decryption "
            "would wrap around",
            hint=_headroom_hint(plan, depth, bound),
        )

    if value_bound is not None:
        vb = float(value_bound)
        if not (math.isfinite(vb) and vb > 0):
            raise HEParameterError(f"value_bound must be a positive number, got {value_bound}")
        top = max(depth, 1)  # the least modulus is left at the deepest level a value reaches
        if math.log2(vb) + params.scale_bits + 1 >= params.modulus_bits_at(top):
            raise refuse(vb, top, f"calibrated bound {vb:g}")
    elif input_abs_max is not None:
        def check(node: Node) -> None:
            bound = max(abs(node.payload[0]), abs(node.payload[1]))
            if bound > 0 and math.log2(bound) + params.scale_bits + 1 >= params.modulus_bits_at(node.level):
                raise refuse(bound, node.level, f"worst case for inputs bounded by {input_abs_max:g}; calibrate "
                                                "with a plaintext pass to tighten it")
        max_abs_bound(plan, float(input_abs_max), check)
    return depth


def _headroom_hint(plan: HEPlan, depth: int, bound: float) -> str:
    """A parameter call that choose_params accepts *and* that holds ``bound`` (tried, not guessed)."""
    from securetrain.he.params import choose_params, integer_bits_for

    bits = integer_bits_for(bound)
    for call, kwargs in ((f"choose_params({depth}, integer_bits={bits})", {"integer_bits": bits}),
                         (f"choose_params({depth}, scale_bits=None, integer_bits={bits})",
                          {"scale_bits": None, "integer_bits": bits})):
        try:
            check_plan_fits(plan, choose_params(depth, **kwargs), value_bound=bound)  # type: ignore[arg-type]
        except HEParameterError:
            continue
        return f"use {call}, or calibrate on representative data (evaluate_encrypted does) to tighten the bound"
    return ("standardise/clip the features or shrink the weights: no secure parameter set holds values of "
            f"{bound:.3g} at depth {depth}")

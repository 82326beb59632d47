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
from securetrain.he.errors import HEFormatError, HEKeyError, HEModelError, HEParameterError
from securetrain.he.params import HEParams
from securetrain.he.plan import HEPlan, PolyStep
from securetrain.he.strategy import Node, Ops, _NullBackend, max_abs_bound, run_plan

log = logging.getLogger(__name__)

CONTEXT_KIND = "he-context"
CIPHERTEXTS_KIND = "he-ciphertexts"
FORMAT_VERSION = 1
MAX_DECIMALS = 8

Progress = Callable[[int], None]  # called with the number of units just completed


def _default_threads() -> int:
    import os

    return max(1, min(8, os.cpu_count() or 1))


class _TenSEALBackend:
    def mul_plain(self, x: Any, c: float) -> Any:
        return x * c

    def mul(self, x: Any, y: Any) -> Any:
        return x * y

    def add(self, x: Any, y: Any) -> Any:
        return x + y

    def add_plain(self, x: Any, c: float) -> Any:
        return x + c


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
                progress: Progress | None = None) -> bytes:
        """Encrypt ``features`` (n_samples, n_features) feature-major: one CKKSVector per feature
        and batch, samples in the slots."""
        ts = require_tenseal()
        x = np.asarray(features.detach().cpu().numpy() if hasattr(features, "detach") else features,
                       dtype=np.float64)
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise HEFormatError(f"features must be a non-empty 2-D array, got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise HEFormatError("features contain NaN or inf")
        bs = self.params.slots if batch_size is None else int(batch_size)
        if not 1 <= bs <= self.params.slots:
            raise HEParameterError(f"batch_size must be in 1..{self.params.slots} (the slot count)")
        n, cols = x.shape
        jobs = [(b, c) for b in range(math.ceil(n / bs)) for c in range(cols)]
        ops = Ops(_NullBackend(), threads=threads or _default_threads())
        lock = threading.Lock()

        def enc(job: tuple[int, int]) -> bytes:
            b, c = job
            blob = ts.ckks_vector(self._ctx, x[b * bs:(b + 1) * bs, c].tolist()).serialize()
            if progress is not None:
                with lock:
                    progress(1)
            return blob

        frames = ops.map(enc, jobs)
        fields = {
            "format_version": FORMAT_VERSION,
            "context_id": self.context_id,
            "role": "inputs",
            "layout": "feature-major",
            "n_samples": n,
            "n_columns": cols,
            "batch_size": bs,
            "input_abs_max": _input_bound(x),
            "params": self.params.to_dict(),
        }
        return container.encode(CIPHERTEXTS_KIND, fields, frames)

    def decrypt(self, bundle: bytes, *, decimals: int = 5, source: str = "ciphertexts") -> np.ndarray:
        """Decrypt a bundle to (n_samples, n_columns), **rounded to ``decimals``** before release:
        the low-order digits of a CKKS decryption carry noise that can leak the secret key
        (Li–Micciancio, EUROCRYPT 2021)."""
        ts = require_tenseal()
        if not isinstance(decimals, int) or not 0 <= decimals <= MAX_DECIMALS:
            raise HEParameterError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")
        hdr, frames = _parse_bundle(bundle, self.context_id, source)
        factors = hdr.get("output_factors") or [1.0] * hdr["n_columns"]
        cols, bs, n = hdr["n_columns"], hdr["batch_size"], hdr["n_samples"]
        out = np.empty((n, cols))
        for i, blob in enumerate(frames):
            b, c = divmod(i, cols)
            try:
                vec = ts.ckks_vector_from(self._ctx, blob)
            except Exception as exc:
                raise _wrap_ts_error(f"{source} frame {i}")(exc) from exc
            vals = np.asarray(vec.decrypt(), dtype=np.float64)
            want = min(bs, n - b * bs)
            if vals.shape != (want,):
                raise HEFormatError(f"{source} frame {i} holds {vals.shape[0]} values, expected {want}")
            out[b * bs:b * bs + want, c] = vals / float(factors[c])
        return np.round(out, decimals)


def _parse_bundle(data: bytes, context_id: str, source: str) -> tuple[dict[str, Any], tuple[bytes, ...]]:
    c = container.decode(data, expect_kind=CIPHERTEXTS_KIND, source=source)
    h = c.header
    if h.get("format_version") != FORMAT_VERSION:
        raise HEFormatError(f"{source}: unsupported format_version {h.get('format_version')!r}")
    if h.get("layout") != "feature-major":
        raise HEFormatError(f"{source}: unsupported layout {h.get('layout')!r}")
    if h.get("context_id") != context_id:
        raise HEKeyError(f"{source} was encrypted under a different context",
                         hint="use the context files from the same `securetrain he keygen` run")
    try:
        n, cols, bs = int(h["n_samples"]), int(h["n_columns"]), int(h["batch_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise HEFormatError(f"{source}: header lacks sample/column counts") from exc
    if n < 1 or cols < 1 or bs < 1 or len(c.frames) != math.ceil(n / bs) * cols:
        raise HEFormatError(f"{source}: {len(c.frames)} frames do not match {n} samples × {cols} columns")
    return h, c.frames


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

    def check_plan(self, plan: HEPlan, input_abs_max: float | None = None) -> int:
        """Raise :class:`HEParameterError` unless ``plan`` fits these parameters; returns its depth."""
        return check_plan_fits(plan, self.params, input_abs_max)

    def evaluate(self, plan: HEPlan, inputs: bytes, *, source: str = "ciphertexts",
                 progress: Progress | None = None, total: Callable[[int], None] | None = None) -> bytes:
        ts = require_tenseal()
        h, frames = _parse_bundle(inputs, self.context_id, source)
        if h.get("role") != "inputs":
            raise HEFormatError(f"{source} holds {h.get('role')!r}, expected encrypted inputs")
        if h["n_columns"] != plan.n_inputs:
            raise HEModelError(f"the model expects {plan.n_inputs} features, {source} has {h['n_columns']}")
        self.check_plan(plan, h.get("input_abs_max"))
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

    run_plan(plan, [Node(None, 0) for _ in range(plan.n_inputs)], Ops(_NullBackend(), on_node=inc))
    return count


def _needs_relin(plan: HEPlan) -> bool:
    return any(isinstance(s, PolyStep) and s.degree >= 2 for s in plan.steps)


def check_plan_fits(plan: HEPlan, params: HEParams, input_abs_max: float | None = None) -> int:
    """Depth and (when the input range is known) overflow check, before any ciphertext exists."""
    depth = plan.depth
    if depth > params.max_depth:
        raise HEParameterError(
            f"the model needs multiplicative depth {depth} but the parameters provide {params.max_depth} "
            f"({params.describe()})",
            hint=f"generate keys for this model (`securetrain he keygen --model ...`) or use "
                 f"he.params.choose_params({depth})",
        )
    if input_abs_max is not None:
        def check(node: Node) -> None:
            bound = max(abs(node.payload[0]), abs(node.payload[1]))
            if bound > 0 and math.log2(bound) + params.scale_bits + 1 >= params.modulus_bits_at(node.level):
                raise HEParameterError(
                    f"intermediate values may reach {bound:.3g} at level {node.level}, beyond the "
                    f"{params.modulus_bits_at(node.level) - params.scale_bits - 1:.0f}-bit headroom "
                    f"for inputs bounded by {input_abs_max:g}: the decryption would wrap around",
                    hint="standardise/clip the features, or use a larger first prime (integer_bits)",
                )
        max_abs_bound(plan, float(input_abs_max), check)
    return depth

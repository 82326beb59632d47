"""CKKS encryption parameters: validation against the 128-bit security bound, and a picker.

A parameter set is ``poly_modulus_degree`` N, the bit sizes of the coefficient-modulus primes and
the scale 2**scale_bits. Layout (the usual TenSEAL/SEAL convention, enforced here):

    [first, scale_bits × L, special]

* ``first`` (q0) holds the final result: ``first - scale_bits`` bits of integer headroom.
* the L middle primes are consumed one per rescale, so L is the multiplicative depth available.
* ``special`` is SEAL's key-switching prime; it never carries data and must be ≥ every other prime.

Everything is checked *before* any key or ciphertext exists, so a bad set fails with
:class:`HEParameterError` instead of "scale out of bounds" in the middle of an evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from securetrain.he.errors import HEParameterError

#: Max total coefficient-modulus bits for 128-bit classical security (HomomorphicEncryption.org
#: standard, ternary secret), per polynomial modulus degree.
SECURITY_MAX_COEFF_BITS: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}

MAX_PRIME_BITS = 60  # SEAL's limit for one RNS prime
MIN_SCALE_BITS = 20  # below this CKKS precision is useless for model scores


@dataclass(frozen=True)
class HEParams:
    """A validated CKKS parameter set. Construction raises :class:`HEParameterError` if unsafe."""

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int
    _primes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff_mod_bit_sizes", tuple(int(b) for b in self.coeff_mod_bit_sizes))
        validate_params(self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.scale_bits)
        object.__setattr__(self, "_primes", seal_primes(self.poly_modulus_degree, self.coeff_mod_bit_sizes))

    # -- derived quantities -------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Samples per ciphertext (CKKS packs N/2 complex slots; we use the real parts)."""
        return self.poly_modulus_degree // 2

    @property
    def max_depth(self) -> int:
        """Rescales available = number of middle primes."""
        return len(self.coeff_mod_bit_sizes) - 2

    @property
    def total_bits(self) -> int:
        return sum(self.coeff_mod_bit_sizes)

    @property
    def integer_bits(self) -> int:
        return self.coeff_mod_bit_sizes[0] - self.scale_bits

    @property
    def scale(self) -> float:
        return float(2**self.scale_bits)

    @property
    def primes(self) -> tuple[int, ...]:
        """The actual RNS primes SEAL picks for these bit sizes (same order)."""
        return self._primes

    def rescale_prime(self, level: int) -> int:
        """Prime divided out by the rescale that takes a ciphertext from ``level`` to ``level+1``.

        Data primes are q0..qL (the special prime is last and never used); rescales drop them from
        the end: level 0 drops qL, level L-1 drops q1.
        """
        if not 0 <= level < self.max_depth:
            raise HEParameterError(f"no rescale left at level {level} (depth available: {self.max_depth})")
        return self._primes[self.max_depth - level]

    def modulus_bits_at(self, level: int) -> float:
        """log2 of the data modulus left after ``level`` rescales."""
        return sum(math.log2(q) for q in self._primes[: self.max_depth + 1 - level])

    def to_dict(self) -> dict[str, Any]:
        return {
            "poly_modulus_degree": self.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes),
            "scale_bits": self.scale_bits,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HEParams:
        try:
            return cls(
                poly_modulus_degree=int(data["poly_modulus_degree"]),
                coeff_mod_bit_sizes=tuple(int(b) for b in data["coeff_mod_bit_sizes"]),
                scale_bits=int(data["scale_bits"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise HEParameterError(f"malformed parameter set: {exc}") from exc

    def describe(self) -> str:
        return (
            f"N={self.poly_modulus_degree}, coeff_mod_bit_sizes={list(self.coeff_mod_bit_sizes)} "
            f"({self.total_bits}/{SECURITY_MAX_COEFF_BITS[self.poly_modulus_degree]} bits), "
            f"scale=2^{self.scale_bits}, depth {self.max_depth}, {self.slots} slots"
        )


def validate_params(poly_modulus_degree: int, coeff_mod_bit_sizes: tuple[int, ...], scale_bits: int) -> None:
    """Raise :class:`HEParameterError` unless the set is 128-bit secure and well-formed."""
    n = poly_modulus_degree
    if n not in SECURITY_MAX_COEFF_BITS:
        raise HEParameterError(
            f"poly_modulus_degree {n} is not supported",
            hint=f"use one of {sorted(SECURITY_MAX_COEFF_BITS)}",
        )
    bits = coeff_mod_bit_sizes
    if len(bits) < 2:
        raise HEParameterError(
            "coeff_mod_bit_sizes needs at least 2 primes (data + special key-switching prime)",
            hint="e.g. [60, 40, 60]",
        )
    if any(b < 2 or b > MAX_PRIME_BITS for b in bits):
        raise HEParameterError(f"every prime must have 2..{MAX_PRIME_BITS} bits, got {list(bits)}")
    total = sum(bits)
    limit = SECURITY_MAX_COEFF_BITS[n]
    if total > limit:
        raise HEParameterError(
            f"insecure parameters: {total} coefficient-modulus bits exceed the 128-bit security bound "
            f"of {limit} bits for poly_modulus_degree {n}",
            hint="use a larger poly_modulus_degree or fewer/smaller primes (see he.params.choose_params)",
        )
    if not MIN_SCALE_BITS <= scale_bits <= MAX_PRIME_BITS:
        raise HEParameterError(f"scale_bits must be in [{MIN_SCALE_BITS}, {MAX_PRIME_BITS}], got {scale_bits}")
    middle = bits[1:-1]
    if any(b != scale_bits for b in middle):
        # A rescale divides by the prime; primes ≠ scale make the scale drift level by level.
        raise HEParameterError(
            f"middle primes must all have scale_bits={scale_bits} bits, got {list(middle)}",
            hint=f"use [first, {scale_bits}, ..., {scale_bits}, special]",
        )
    if bits[0] <= scale_bits:
        raise HEParameterError(
            f"the first prime ({bits[0]} bits) must exceed the scale ({scale_bits} bits): it holds the "
            "integer part of the result",
        )
    if bits[-1] < max(bits[:-1]):
        raise HEParameterError(
            f"the special (last) prime ({bits[-1]} bits) must be at least as large as every other prime",
        )


def integer_bits_for(value_bound: float) -> int:
    """Integer headroom for values bounded by ``value_bound``: the result needs
    log2|v| + scale + 1 < log2(q0), and q0 ≥ 2^(first-1), so first − scale ≥ ⌈log2|v|⌉ + 3."""
    if not (math.isfinite(value_bound) and value_bound > 0):
        raise HEParameterError(f"value_bound must be a positive number, got {value_bound}")
    return max(MIN_INTEGER_BITS, math.ceil(math.log2(value_bound)) + 3)


MIN_INTEGER_BITS = 6


def choose_params(
    depth: int,
    *,
    scale_bits: int | None = 40,
    integer_bits: int | None = 20,
    min_poly_modulus_degree: int = 1024,
    value_bound: float | None = None,
    min_scale_bits: int = 30,
    max_scale_bits: int = 40,
) -> HEParams:
    """Smallest secure parameter set with ``depth`` rescales.

    Fixed mode (defaults): precision 2**-scale_bits and ``integer_bits`` of headroom, layout
    ``[scale+int, scale×depth, scale+int]``, the smallest ring that holds it.

    Search mode: ``scale_bits=None`` searches the ring size N and the scale together — the
    smallest N (fastest: every operation is ~2× cheaper per halving) for which some scale in
    [``min_scale_bits``, ``max_scale_bits``] fits, then the largest such scale at that N (most
    precise). ``integer_bits=None`` derives the headroom from ``value_bound`` (the calibrated
    largest |value| the model reaches, see :func:`securetrain.he.calibration.calibrate`) via
    :func:`integer_bits_for`. Example: depth 3 with values below 64 → N=8192,
    ``[48, 39, 39, 39, 48]`` instead of N=16384 ``[60, 40, 40, 40, 60]``.
    """
    if depth < 0:
        raise HEParameterError(f"depth must be ≥ 0, got {depth}")
    if integer_bits is None:
        integer_bits = integer_bits_for(value_bound) if value_bound is not None else 20
    if integer_bits < 1:
        raise HEParameterError(f"integer_bits must be ≥ 1, got {integer_bits}")
    if scale_bits is not None:
        return _fixed(depth, scale_bits, integer_bits, min_poly_modulus_degree)
    if not MIN_SCALE_BITS <= min_scale_bits <= max_scale_bits <= MAX_PRIME_BITS:
        raise HEParameterError(f"need {MIN_SCALE_BITS} ≤ min_scale_bits ≤ max_scale_bits ≤ {MAX_PRIME_BITS}, "
                               f"got {min_scale_bits}, {max_scale_bits}")
    for n, limit in sorted(SECURITY_MAX_COEFF_BITS.items()):
        if n < min_poly_modulus_degree:
            continue
        for s in range(max_scale_bits, min_scale_bits - 1, -1):
            first = s + integer_bits
            bits = (first,) + (s,) * depth + (first,)
            if first > MAX_PRIME_BITS or sum(bits) > limit:
                continue
            try:
                return HEParams(n, bits, s)
            except HEParameterError:
                continue  # e.g. not enough primes of that size for this N
    raise HEParameterError(
        f"no 128-bit secure parameter set supports depth {depth} with {integer_bits} integer bits at a scale of "
        f"at least 2^{min_scale_bits}",
        hint="use a shallower model (fewer layers / lower-degree activations), or lower min_scale_bits / "
             "integer_bits in choose_params",
    )


def _fixed(depth: int, scale_bits: int, integer_bits: int, min_poly_modulus_degree: int) -> HEParams:
    first = scale_bits + integer_bits
    if first > MAX_PRIME_BITS:
        raise HEParameterError(
            f"scale_bits + integer_bits = {first} exceeds the {MAX_PRIME_BITS}-bit prime limit",
            hint="lower integer_bits or scale_bits in choose_params, or let it search: choose_params(depth, "
                 "scale_bits=None, integer_bits=None, value_bound=...)",
        )
    bits = (first,) + (scale_bits,) * depth + (first,)
    for n, limit in sorted(SECURITY_MAX_COEFF_BITS.items()):
        if n >= min_poly_modulus_degree and sum(bits) <= limit:
            try:
                return HEParams(n, bits, scale_bits)
            except HEParameterError:
                continue  # e.g. not enough primes of that size for this N
    raise HEParameterError(
        f"no 128-bit secure parameter set supports depth {depth} at scale 2^{scale_bits} "
        f"({sum(bits)} bits needed, at most {max(SECURITY_MAX_COEFF_BITS.values())} allowed)",
        hint="use a shallower model (fewer layers / lower-degree activations) or a smaller scale_bits",
    )


# --- SEAL's prime selection, reproduced ---------------------------------------------------------
# TenSEAL resets a ciphertext's scale to the global scale after each rescale although the true
# scale is Δ²/q. The relative error |q-Δ|/Δ is ~1e-7..1e-6 per level; knowing q lets the evaluator
# fold the exact correction into plaintext coefficients for free. TenSEAL does not expose the
# primes, so we recompute them with SEAL's own algorithm (CoeffModulus::Create); the data owner
# checks the prediction against the real context at key generation (see context.py).

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _get_primes(factor: int, bit_size: int, count: int) -> list[int]:
    value = ((1 << bit_size) - 1) // factor * factor + 1
    lower = 1 << (bit_size - 1)
    found: list[int] = []
    while len(found) < count and value > lower:
        if _is_prime(value):
            found.append(value)
        value -= factor
    if len(found) < count:
        raise HEParameterError(f"not enough {bit_size}-bit primes ≡ 1 mod {factor} for this parameter set")
    return found


def seal_primes(poly_modulus_degree: int, bit_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The primes ``seal::CoeffModulus::Create(N, bit_sizes)`` returns, in order."""
    factor = 2 * poly_modulus_degree
    table = {b: _get_primes(factor, b, bit_sizes.count(b)) for b in set(bit_sizes)}
    # SEAL hands them out from the back of each descending list.
    return tuple(table[b].pop() for b in bit_sizes)

"""Parameter validation and the picker: pure Python, no TenSEAL needed."""

from __future__ import annotations

import pytest

from securetrain.errors import ConfigError
from securetrain.he.errors import HEParameterError
from securetrain.he.params import SECURITY_MAX_COEFF_BITS, HEParams, _is_prime, choose_params, seal_primes


@pytest.mark.parametrize(
    "n,ok,bad,scale",
    [
        (2048, (27, 27), (27, 28), 20),
        (4096, (37, 35, 37), (37, 35, 38), 35),
        (8192, (59, 50, 50, 59), (59, 50, 50, 60), 50),
        (16384, (58,) + (40,) * 8 + (60,), (59,) + (40,) * 8 + (60,), 40),
        (32768, (41,) + (39,) * 20 + (60,), (42,) + (39,) * 20 + (60,), 39),
    ],
)
def test_bound_is_enforced_exactly(n: int, ok: tuple[int, ...], bad: tuple[int, ...], scale: int) -> None:
    assert sum(ok) == SECURITY_MAX_COEFF_BITS[n] and sum(bad) == sum(ok) + 1
    assert HEParams(n, ok, scale).total_bits == sum(ok)
    with pytest.raises(HEParameterError, match="insecure parameters"):
        HEParams(n, bad, scale)


def test_classic_insecure_sets_are_refused() -> None:
    with pytest.raises(HEParameterError, match="exceed the 128-bit security bound of 218"):
        HEParams(8192, (60, 40, 40, 40, 60), 40)  # 240 bits at N=8192
    with pytest.raises(HEParameterError, match="109"):
        HEParams(4096, (40, 30, 40), 30)  # 110 > 109
    with pytest.raises(HEParameterError):
        HEParams(3000, (60, 40, 60), 40)  # not a power of two
    # It is a ConfigError too, so generic config handling catches it.
    with pytest.raises(ConfigError):
        HEParams(8192, (60, 40, 40, 40, 60), 40)


@pytest.mark.parametrize(
    "bits,scale,msg",
    [((60,), 40, "at least 2"), ((60, 30, 60), 40, "middle primes"), ((40, 40, 60), 40, "first prime"),
     ((60, 40, 50), 40, "special"), ((61, 40, 61), 40, "2..60"), ((60, 40, 60), 10, "scale_bits")],
)
def test_malformed_layouts(bits: tuple[int, ...], scale: int, msg: str) -> None:
    with pytest.raises(HEParameterError, match=msg):
        HEParams(16384, bits, scale)


def test_choose_params_picks_smallest_secure_fit() -> None:
    assert choose_params(1).poly_modulus_degree == 8192  # 160 bits
    assert choose_params(2).coeff_mod_bit_sizes == (60, 40, 40, 60)  # 200 ≤ 218
    p3 = choose_params(3)
    assert p3.poly_modulus_degree == 16384 and p3.max_depth == 3
    assert choose_params(1, scale_bits=25, integer_bits=10).poly_modulus_degree == 4096  # 95 ≤ 109
    assert choose_params(19).poly_modulus_degree == 32768
    with pytest.raises(HEParameterError, match="no 128-bit secure parameter set"):
        choose_params(40)


def test_seal_primes_match_known_values_and_properties() -> None:
    # Agreement with the real SEAL build is checked against TenSEAL in test_he_encrypted.py.
    primes = seal_primes(8192, (60, 40, 40, 60))
    for q, b in zip(primes, (60, 40, 40, 60), strict=True):
        assert _is_prime(q) and q % (2 * 8192) == 1 and q.bit_length() == b
    assert len(set(primes)) == 4
    assert [_is_prime(k) for k in (1, 2, 3, 4, 97, 561, 2**61 - 1)] == [False, True, True, False, True, False, True]


def test_levels_and_headroom_accessors() -> None:
    p = HEParams(16384, (60, 40, 40, 40, 60), 40)
    assert p.slots == 8192 and p.max_depth == 3 and p.integer_bits == 20
    # Rescales drop the data primes from the end: q3, q2, q1.
    assert [p.rescale_prime(lv) for lv in range(3)] == [p.primes[3], p.primes[2], p.primes[1]]
    with pytest.raises(HEParameterError):
        p.rescale_prime(3)
    assert p.modulus_bits_at(3) == pytest.approx(60, abs=0.01)
    assert HEParams.from_dict(p.to_dict()) == p

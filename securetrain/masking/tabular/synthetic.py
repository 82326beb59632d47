"""A synthetic finance table full of PII, for tests, demos and benchmarks.

Every PII value is realistic in shape *and* validity: PANs pass Luhn, IBANs carry correct
ISO 7064 mod-97 check digits, SSNs look like SSNs. The label is learnable from the non-PII
columns (large amounts at night in risky categories are more often fraud).
Generation is vectorised (numpy + pyarrow.compute) so a million rows take about a second.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.tabular.tableio import detect_format, serialize_table

FIRST = ["Erika", "John", "Amelia", "Rajesh", "Sofia", "Hiroshi", "Oluwaseun", "Margarethe", "Dmitri",
         "Clementine", "Barnaby", "Perpetua", "Ignatius", "Winifred", "Thaddeus", "Ottilie"]
LAST = ["Mustermann", "Quartermaine", "Vanderbilt", "Okonkwo", "Fitzwilliam", "Takahashi", "Abernathy",
        "Grundlehner", "Papadopoulos", "Kowalczyk", "Lindqvist", "Hawthorne", "Delacroix", "Macallister"]
CATEGORIES = ["grocery", "travel", "electronics", "fuel", "restaurants", "gambling", "crypto", "utilities"]
_RISKY = {"gambling", "crypto", "electronics"}
PII_COLUMNS = ("customer_name", "customer_id", "iban", "card_number", "ssn", "email", "phone", "notes")


def _digits(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return rng.integers(0, 10, size=(n, k), dtype=np.int64)


def _digit_strings(d: np.ndarray) -> pa.Array:
    """(n, k) digit matrix -> n strings of length k, without a Python loop."""
    n, k = d.shape
    raw = (d.astype(np.uint8) + ord("0")).tobytes()
    return pa.Array.from_buffers(pa.binary(k), n, [None, pa.py_buffer(raw)]).cast(pa.string())


def luhn_check_digit(body: np.ndarray) -> np.ndarray:
    """Check digit for each row of digits (check digit to be appended on the right)."""
    rev = body[:, ::-1]
    doubled = rev[:, ::2] * 2
    total = (doubled - 9 * (doubled > 9)).sum(axis=1) + rev[:, 1::2].sum(axis=1)
    return (10 - total % 10) % 10


def make_pans(rng: np.random.Generator, n: int) -> pa.Array:
    """16-digit Visa-like PANs (IIN 4xxxxx) with a valid Luhn check digit."""
    body = _digits(rng, n, 15)
    body[:, 0] = 4
    full = np.concatenate([body, luhn_check_digit(body)[:, None]], axis=1)
    return _digit_strings(full)


def make_ibans(rng: np.random.Generator, n: int) -> pa.Array:
    """German IBANs: DE + mod-97 check digits + 18-digit BBAN."""
    bban = _digits(rng, n, 18)
    # Rearranged: BBAN + 'D'(13) 'E'(14) + '00'; check = 98 - (that mod 97).
    tail = np.array([1, 3, 1, 4, 0, 0], dtype=np.int64)
    r = np.zeros(n, dtype=np.int64)
    for col in range(18):
        r = (r * 10 + bban[:, col]) % 97
    for dgt in tail:
        r = (r * 10 + dgt) % 97
    check = 98 - r
    cd = np.stack([check // 10, check % 10], axis=1)
    return pc.binary_join_element_wise("DE", _digit_strings(cd), _digit_strings(bban), "")


def generate_finance_table(n_rows: int = 1000, *, seed: int = 0) -> pa.Table:
    """Columns: customer_name, customer_id, iban, card_number, ssn, email, phone, notes (free text with
    an embedded phone number), amount, balance, txn_date, category, hour, label."""
    rng = np.random.default_rng(seed)
    n = n_rows
    first = pa.array(np.array(FIRST)[rng.integers(0, len(FIRST), n)])
    last = pa.array(np.array(LAST)[rng.integers(0, len(LAST), n)])
    name = pc.binary_join_element_wise(first, last, " ")
    cust = pc.binary_join_element_wise("C", _digit_strings(_digits(rng, n, 9)), "")
    ssn_d = _digits(rng, n, 9)
    ssn_d[:, 0] = rng.integers(1, 9, n)  # area 0xx/9xx are never issued
    ssn = pc.binary_join_element_wise(
        _digit_strings(ssn_d[:, :3]), _digit_strings(ssn_d[:, 3:5]), _digit_strings(ssn_d[:, 5:]), "-")
    uniq = _digit_strings(_digits(rng, n, 4))
    email = pc.binary_join_element_wise(
        pc.utf8_lower(first), ".", pc.utf8_lower(last), uniq, "@", pa.array(np.array(
            ["example.com", "mail.test", "bank.example"])[rng.integers(0, 3, n)]), "")
    phone = pc.binary_join_element_wise(
        "+1-", _digit_strings(_digits(rng, n, 3)), "-", _digit_strings(_digits(rng, n, 3)), "-",
        _digit_strings(_digits(rng, n, 4)), "")
    notes = pc.binary_join_element_wise("call back on ", phone, " re: dispute", "")
    cat_idx = rng.integers(0, len(CATEGORIES), n)
    category = pa.array(np.array(CATEGORIES)[cat_idx])
    amount = np.round(rng.lognormal(4.0, 1.2, n), 2)
    balance = np.round(rng.normal(5000, 3000, n), 2)
    hour = rng.integers(0, 24, n)
    days = rng.integers(0, 3 * 365, n)
    txn_date = pa.array((np.datetime64("2021-01-01") + days.astype("timedelta64[D]")), pa.date32())
    risky = np.isin(np.array(CATEGORIES)[cat_idx], list(_RISKY))
    logit = -3.0 + 1.1 * np.log1p(amount) / 2 + 1.5 * risky + 1.0 * ((hour < 6) | (hour > 22))
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return pa.table({
        "customer_name": name, "customer_id": cust, "iban": make_ibans(rng, n), "card_number": make_pans(rng, n),
        "ssn": ssn, "email": email, "phone": phone, "notes": notes, "amount": amount, "balance": balance,
        "txn_date": txn_date, "category": category, "hour": pa.array(hour, pa.int64()), "label": label,
    })


def write_finance_file(path: str | os.PathLike[str], n_rows: int = 1000, *, seed: int = 0) -> Path:
    """Write :func:`generate_finance_table` as CSV or Parquet (by suffix), atomically."""
    # An input for masking, not a masked output for a spreadsheet: written as generated ("+1-..." phones).
    table = generate_finance_table(n_rows, seed=seed)
    atomic_write_bytes(path, serialize_table(table, detect_format(path), formula_guard="off"))
    return Path(path)

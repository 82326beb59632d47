"""Tabular task encoding (fit on train + transform) vs a plain pyarrow -> numpy conversion, same run.

    python benchmarks/pipeline_tabular_encoding.py [--quick] [--rows N]

The pipeline's TableEncoder standardises numeric/date columns and one-hot encodes string columns
(capped categories + "other"). The baseline converts the same columns to numpy (numbers cast to
float64, strings dictionary-encoded to integer codes): the least any encoding must do. Prints the
ratio encoder time / baseline time (best of several repeats).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _timing import best_of  # benchmarks/ is on sys.path when run as a script

from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.synthetic import generate_finance_table
from securetrain.pipeline.tasks.tabular import TableEncoder

POLICY = Path(__file__).resolve().parents[1] / "policies" / "finance-pii.yaml"
FEATURES = ["amount", "balance", "txn_date", "category", "hour"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small input, finishes in well under 60 s")
    ap.add_argument("--rows", type=int, default=None)
    args = ap.parse_args()
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    repeats = 3 if args.quick else 5
    masked = TabularMasker(POLICY, bytes(range(32))).mask_table(generate_finance_table(rows, seed=1))

    def baseline() -> list[np.ndarray]:
        out = []
        for name in FEATURES:
            col = masked.column(name)
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                out.append(pc.dictionary_encode(col).combine_chunks().indices.to_numpy(zero_copy_only=False))
            elif pa.types.is_date(col.type):
                out.append(pc.cast(pc.cast(col, pa.int32()), pa.float64()).to_numpy())
            else:
                out.append(pc.cast(col, pa.float64()).to_numpy())
        return out

    def encoder() -> object:
        return TableEncoder(FEATURES, max_categories=32).fit(masked).transform(masked)

    base = best_of(baseline, repeats)
    enc = best_of(encoder, repeats)
    width = encoder().shape[1]
    print(f"rows={rows:,} features={len(FEATURES)} encoded width={width}")
    print(f"baseline (pyarrow -> numpy codes): {rows / base:,.0f} rows/s")
    print(f"TableEncoder fit + transform     : {rows / enc:,.0f} rows/s")
    print(f"ratio encoder/baseline = {enc / base:.2f}")


if __name__ == "__main__":
    main()

"""Tabular masking throughput vs a plain pyarrow read+write of the same file, in the same run.

    python benchmarks/tabular_masking.py [--quick] [--rows N]

Prints rows/s for both and the ratio (masking time / plain time); best of several repeats, so
noise from a shared machine inflates neither side more than the other.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyarrow as pa

from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.synthetic import write_finance_file
from securetrain.masking.tabular.tableio import detect_format, parse_table, read_bytes, write_table

from _timing import best_of  # benchmarks/ is on sys.path when run as a script

POLICY = Path(__file__).resolve().parents[1] / "policies" / "finance-pii.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small input, finishes in well under 60 s")
    ap.add_argument("--rows", type=int, default=None)
    args = ap.parse_args()
    rows = args.rows or (50_000 if args.quick else 500_000)
    repeats = 2 if args.quick else 3
    masker = TabularMasker(POLICY, bytes(range(32)))
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".parquet", ".csv"):
            src = write_finance_file(Path(tmp) / f"in{suffix}", rows, seed=1)
            dst = Path(tmp) / f"out{suffix}"

            def plain() -> pa.Table:
                data, _ = read_bytes(src)
                table = parse_table(data, detect_format(src), name=src.name)
                write_table(table, dst)
                return table

            t_plain = best_of(plain, repeats)
            t_mask = best_of(lambda: masker.mask_file(src, dst), repeats)
            print(f"{suffix[1:]:8s} rows={rows:,}  plain read+write {rows / t_plain:12,.0f} rows/s  "
                  f"masked {rows / t_mask:12,.0f} rows/s  ratio mask/plain = {t_mask / t_plain:.2f}x")


if __name__ == "__main__":
    main()

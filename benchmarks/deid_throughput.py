"""DICOM de-identification throughput: securetrain vs dicognito (and plain pydicom), same real files, same run.

    python benchmarks/deid_throughput.py [--quick] [--workers N]

Corpus: every DICOM file the pydicom test-data packages ship (``pydicom`` itself plus
``pydicom-data`` when installed) that *both* tools de-identify and write (securetrain refuses
files that may carry burned-in text under the basic policy; those are left out for both).

* in-process: bytes in memory -> read -> de-identify -> encode to bytes, one process, best of N
  runs each; prints files/s for plain pydicom read+write, dicognito and securetrain, and the
  **securetrain/dicognito ratio** (the issue-15 target is >= 2.0).
* folder: ``deidentify_tree`` from a folder to a folder (atomic writes, batch fsync) with 1 and
  N worker processes, to show ``-j`` scaling.

dicognito is a benchmark-only dependency (``pip install -e .[bench]``); without it only the
securetrain and pydicom rows are printed. Only ratios measured in one run are meaningful.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _timing import best_of  # noqa: E402

SECRET = b"benchmark-secret-not-for-production!"
POLICY = ROOT / "policies" / "dicom-basic.yaml"


def _corpus(limit_bytes: int) -> list[tuple[str, bytes]]:
    import pydicom
    from pydicom.data import get_testdata_files

    from securetrain.masking.dicom.engine import Deidentifier, encode_dataset, read_dicom
    from securetrain.masking.dicom.policy import load_policy

    deid = Deidentifier(load_policy(POLICY), SECRET, record_changes=False)
    try:
        from dicognito.anonymizer import Anonymizer
    except ImportError:
        Anonymizer = None  # noqa: N806
    out = []
    for f in sorted(get_testdata_files()):
        if not Path(f).is_file():
            continue
        data = Path(f).read_bytes()
        if len(data) > limit_bytes:
            continue
        try:
            ds = read_dicom(io.BytesIO(data))
            deid.deidentify_dataset(ds)
            encode_dataset(ds)
            if Anonymizer is not None:
                other = pydicom.dcmread(io.BytesIO(data), force=True)
                Anonymizer().anonymize(other)
                other.save_as(io.BytesIO())
        except Exception:
            continue
        out.append((Path(f).name, data))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import pydicom

    from securetrain.masking.dicom.engine import Deidentifier, encode_dataset, read_dicom
    from securetrain.masking.dicom.policy import load_policy

    corpus = _corpus(4_000_000 if args.quick else 50_000_000)
    repeat = 2 if args.quick else 5
    n = len(corpus)
    total_mb = sum(len(d) for _, d in corpus) / 1e6
    print(f"{n} real files ({total_mb:.1f} MB) that every tool below de-identifies; best of {repeat} runs")

    def plain() -> None:
        for _, data in corpus:
            ds = pydicom.dcmread(io.BytesIO(data), force=True)
            ds.save_as(io.BytesIO())

    deid = Deidentifier(load_policy(POLICY), SECRET, record_changes=False)

    def securetrain() -> None:
        for name, data in corpus:
            ds = read_dicom(io.BytesIO(data), name=name)
            deid.deidentify_dataset(ds)
            encode_dataset(ds)

    rows = [("pydicom read+write", n / best_of(plain, repeat)), ("securetrain deid", n / best_of(securetrain, repeat))]
    try:
        from dicognito.anonymizer import Anonymizer

        def dicognito() -> None:
            anonymizer = Anonymizer()  # fresh per run: its id maps grow with every object
            for _, data in corpus:
                ds = pydicom.dcmread(io.BytesIO(data), force=True)
                anonymizer.anonymize(ds)
                ds.save_as(io.BytesIO())

        rows.append(("dicognito", n / best_of(dicognito, repeat)))
    except ImportError:
        print("dicognito not installed (pip install -e .[bench]): no peer row")
    print(f"{'in-process':<22} {'files/s':>9}")
    for name, rate in rows:
        print(f"{name:<22} {rate:9.1f}")
    rates = dict(rows)
    if "dicognito" in rates:
        print(f"ratio securetrain/dicognito: {rates['securetrain deid'] / rates['dicognito']:.2f}x")
    print(f"ratio securetrain/pydicom read+write: {rates['securetrain deid'] / rates['pydicom read+write']:.2f}x")

    from securetrain.masking.dicom.tree import deidentify_tree

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        copies = 1 if args.quick else 3
        for c in range(copies):
            for i, (name, data) in enumerate(corpus):
                (src / f"{c}_{i:04d}_{name}").write_bytes(data)
        files = n * copies
        print(f"\nfolder -> folder, {files} files (deidentify_tree, atomic writes, batch fsync)")
        base = None
        for workers in sorted({1, args.workers}):
            dst = Path(tmp) / f"out{workers}"
            t = time.perf_counter()
            report = deidentify_tree(src, dst, load_policy(POLICY), SECRET, workers=workers)
            rate = files / (time.perf_counter() - t)
            base = base or rate
            print(f"workers={workers:<3} {rate:9.1f} files/s  ({rate / base:.2f}x of 1 worker; {report.written} written)")

    # DicomDataset: first epoch de-identifies, later epochs use the cached de-identified headers.
    from securetrain.masking.dicom.dataset import DicomDataset
    from securetrain.masking.dicom.synthetic import generate_study_set

    with tempfile.TemporaryDirectory() as tmp:
        generate_study_set(Path(tmp) / "set", n_patients=8 if args.quick else 24, studies_per_patient=2,
                           images_per_series=4, image_size=64, seed=7, include_burned_in=False)
        data = DicomDataset(Path(tmp) / "set", POLICY, SECRET, size=64)
        paths = [p for p, _ in data.items]

        def plain_decode() -> None:
            for p in paths:
                pydicom.dcmread(p).pixel_array  # noqa: B018

        def epoch() -> None:
            for i in range(len(data)):
                data[i]

        t = time.perf_counter()
        epoch()
        first = len(data) / (time.perf_counter() - t)
        later = len(data) / best_of(epoch, repeat)
        base = len(data) / best_of(plain_decode, repeat)
        print(f"\nDicomDataset, {len(data)} synthetic 64x64 items: plain read+decode {base:.1f} items/s, "
              f"first epoch {first:.1f}, later epochs {later:.1f} ({later / base:.2f}x of plain)")


if __name__ == "__main__":
    main()

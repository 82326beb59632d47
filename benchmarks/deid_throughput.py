"""DICOM de-identification throughput: securetrain vs a plain pydicom read+write, same files, same run.

    python benchmarks/deid_throughput.py [--quick] [--files N] [--workers N]

Prints files/s for (a) pydicom dcmread + dcmwrite and (b) securetrain Deidentifier.deidentify_file
(read + Basic Profile + atomic write), with 1 and N worker processes, and the ratio b/a. Only
ratios measured in this run are meaningful; absolute numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = b"benchmark-secret-not-for-production!"
POLICY = ROOT / "policies" / "dicom-basic.yaml"
_DEID = None


def _baseline(task: tuple[str, str]) -> None:
    import pydicom

    src, dst = task
    ds = pydicom.dcmread(src)
    pydicom.dcmwrite(dst, ds, enforce_file_format=True)


def _init() -> None:
    global _DEID
    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.policy import load_policy

    _DEID = Deidentifier(load_policy(POLICY), SECRET, record_changes=False)


def _securetrain(task: tuple[str, str]) -> None:
    _DEID.deidentify_file(task[0], task[1])


def _run(fn, tasks, workers: int, init=None) -> float:
    start = time.perf_counter()
    if workers == 1:
        if init:
            init()
        for t in tasks:
            fn(t)
    else:
        with ProcessPoolExecutor(max_workers=workers, initializer=init) as pool:
            list(pool.map(fn, tasks, chunksize=max(1, len(tasks) // (workers * 4))))
    return len(tasks) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s)")
    ap.add_argument("--files", type=int, default=None)
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args()
    from securetrain.masking.dicom.synthetic import generate_study_set

    n_files = args.files or (48 if args.quick else 400)
    per_series = 4
    n_patients = max(1, n_files // (2 * per_series))
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        manifest = generate_study_set(tmpdir / "in", n_patients=n_patients, studies_per_patient=2,
                                      images_per_series=per_series, image_size=64, seed=7)
        files = sorted((tmpdir / "in").rglob("*.dcm"))
        print(f"{len(files)} synthetic files (64x64, nested PHI, private blocks), workers N={args.workers}")
        rows = []
        for workers in sorted({1, args.workers}):
            for name, fn, init in (("pydicom read+write", _baseline, None), ("securetrain deid", _securetrain, _init)):
                out = tmpdir / f"out-{name[:4]}-{workers}"
                for f in files:
                    (out / f.relative_to(tmpdir / "in")).parent.mkdir(parents=True, exist_ok=True)
                tasks = [(str(f), str(out / f.relative_to(tmpdir / "in"))) for f in files]
                _run(fn, tasks[: min(8, len(tasks))], 1, init)  # warm-up (imports, caches)
                rows.append((workers, name, _run(fn, tasks, workers, init)))
        print(f"{'workers':>7}  {'pipeline':<20} {'files/s':>9}")
        for workers, name, rate in rows:
            print(f"{workers:>7}  {name:<20} {rate:9.1f}")
        for workers in sorted({1, args.workers}):
            base = next(r for w, n, r in rows if w == workers and n.startswith("pydicom"))
            ours = next(r for w, n, r in rows if w == workers and n.startswith("securetrain"))
            print(f"ratio securetrain/pydicom with {workers} worker(s): {ours / base:.2f}x")
        _ = manifest


if __name__ == "__main__":
    main()

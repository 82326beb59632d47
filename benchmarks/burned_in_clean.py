"""Throughput of ``burned_in: clean`` (OCR, mask, verify, re-encode) in files/s, same files, same run.

    python benchmarks/burned_in_clean.py [--quick] [--files N]

Synthetic single-frame ultrasound files (320x240, 8-bit, speckle sector) with a patient name, an
ID and a date rendered into the pixels, plus as many text-free ones. Prints files/s for
(a) pydicom dcmread + dcmwrite, (b) an OCR-only baseline (decode + one plain Tesseract call per
frame, no preprocessing, no masking, no verification) and (c) securetrain
``Deidentifier.deidentify_file`` with ``burned_in: clean`` (Basic Profile + clean + atomic write),
with the ratios c/a and c/b. Absolute numbers depend on the machine and its load; compare ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_of  # noqa: E402

SECRET = b"benchmark-secret-not-for-production!"


def _make_files(folder: Path, n: int) -> list[Path]:
    from securetrain.masking.dicom.burned_in.synthetic import Text, make_image
    from securetrain.masking.dicom.engine import encode_dataset

    paths = []
    for i in range(n):
        texts = [] if i % 2 else [
            Text(f"DOE^JOHN{i:02d}", 8, 6, 14), Text("2023-04-05", 200, 6, 13, 0.85), Text(f"MRN 8441{i:04d}", 150, 215, 16),
        ]
        ds, _ = make_image(texts, bg="speckle", seed=i, flag="YES")
        path = folder / f"in{i:03d}.dcm"
        path.write_bytes(encode_dataset(ds))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 files, one repetition (~15 s)")
    parser.add_argument("--files", type=int, default=None)
    args = parser.parse_args()
    n = args.files or (4 if args.quick else 16)
    repeat = 1 if args.quick else 3
    os.environ.setdefault("OMP_THREAD_LIMIT", "1")

    import pydicom
    import pytesseract
    from PIL import Image

    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.policy import load_policy

    policy = load_policy(data={"policy_version": 1, "name": "bench-clean", "profile": "basic", "burned_in": "clean"})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = _make_files(folder, n)
        out = folder / "out"
        out.mkdir()

        def plain() -> None:
            for p in files:
                pydicom.dcmwrite(out / p.name, pydicom.dcmread(p), enforce_file_format=True)

        def ocr_only() -> None:
            for p in files:
                arr = pydicom.dcmread(p).pixel_array
                pytesseract.image_to_data(Image.fromarray(arr), config="--psm 11")

        deid = Deidentifier(policy, SECRET, record_changes=False)

        def clean() -> None:
            for p in files:
                deid.deidentify_file(p, out / p.name)

        t_plain = best_of(plain, repeat)
        t_ocr = best_of(ocr_only, repeat)
        t_clean = best_of(clean, repeat)
    counts = deid.burned_in.counts.to_dict()
    fps = {name: n / t for name, t in (("plain", t_plain), ("ocr_only", t_ocr), ("clean", t_clean))}
    print(f"files: {n} (half with rendered PHI text), repetitions: {repeat}")
    print(f"(a) pydicom read+write        {fps['plain']:9.1f} files/s")
    print(f"(b) OCR-only baseline          {fps['ocr_only']:9.2f} files/s")
    print(f"(c) securetrain clean          {fps['clean']:9.2f} files/s")
    print(f"ratio c/a {fps['clean'] / fps['plain']:.4f}   ratio c/b {fps['clean'] / fps['ocr_only']:.2f}")
    print(f"cleaner counts (all repetitions): cleaned={counts['cleaned']} refused={counts['refused']} "
          f"regions_masked={counts['regions_masked']}")


if __name__ == "__main__":
    main()

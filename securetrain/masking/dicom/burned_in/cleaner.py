"""Policy ``burned_in``: refuse, clean (OCR + known regions, verified) or pass still flagged.

The engine makes two calls: :meth:`BurnedInCleaner.process` before the header walk (pixels are
decoded, masked, verified and re-encoded here, or the file is refused) and
:meth:`BurnedInCleaner.record` after the de-identification attributes are written (it adds what
was masked and why to (0012,0063) De-identification Method and claims 113101 Clean Pixel Data
only for files whose pixels were actually cleaned).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence

from securetrain.masking.dicom.burned_in.codec import (
    decode_frames,
    displayed,
    fill_value,
    paint,
    transfer_syntax,
    write_pixels,
)
from securetrain.masking.dicom.burned_in.detect import TextRule, find_text
from securetrain.masking.dicom.burned_in.ocr import OcrEngine, OcrUnavailableError, TesseractEngine
from securetrain.masking.dicom.burned_in.preprocess import to_gray, window_to_uint8
from securetrain.masking.dicom.burned_in.regions import Region, covered_fraction, merge_regions
from securetrain.masking.dicom.errors import BurnedInAnnotationError, OcrUnavailable
from securetrain.masking.dicom.pixels import apply_pixel_masks, burned_in_status, matching_masks, usually_burned_in
from securetrain.masking.dicom.policy import DicomPolicy
from securetrain.masking.dicom.profile_table import CID7050, Option

TAG_PIXEL_DATA = 0x7FE00010
# Float (7FE0,0008) and Double Float (7FE0,0009) Pixel Data carry pixels too: a flagged object
# holding them is refused like any other (nothing here can OCR or mask them), never passed unchecked.
PIXEL_TAGS = (TAG_PIXEL_DATA, 0x7FE00008, 0x7FE00009)
CLEAN_PIXEL_CODE = CID7050[Option.CLEAN_PIXEL_DATA.value]
_MAX_LISTED_REGIONS = 24  # (0012,0063) values naming single regions; the rest are summarised




@dataclass
class BurnedInOutcome:
    """What happened to one object's pixels. Coordinates and counts only, never text."""

    status: str = "no"  # no | flagged | suspected (see pixels.burned_in_status)
    action: str = "none"  # none | masked | cleaned | allowed-flagged
    regions: list[Region] = field(default_factory=list)
    ocr_passes: int = 0
    frames_checked: int = 0
    transfer_syntax: str | None = None
    original_flag: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "action": self.action,
            "regions": [r.to_dict() for r in self.regions],
            "ocr_passes": self.ocr_passes,
            "frames_checked": self.frames_checked,
            "transfer_syntax": self.transfer_syntax,
        }


@dataclass
class BurnedInCounts:
    """Per-cleaner totals for the de-id report (merge across workers with :meth:`merge`)."""

    cleaned: int = 0  # text searched for, masked where found, verified: BurnedInAnnotation=NO
    masked: int = 0  # known/pixel masks only (no OCR), incl. the legacy burned_in_annotation: mask
    allowed_flagged: int = 0
    refused: int = 0
    regions_masked: int = 0
    refusal_reasons: Counter[str] = field(default_factory=Counter)

    def merge(self, other: BurnedInCounts) -> None:
        self.cleaned += other.cleaned
        self.masked += other.masked
        self.allowed_flagged += other.allowed_flagged
        self.refused += other.refused
        self.regions_masked += other.regions_masked
        self.refusal_reasons.update(other.refusal_reasons)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cleaned": self.cleaned,
            "masked": self.masked,
            "allowed_flagged": self.allowed_flagged,
            "refused": self.refused,
            "regions_masked": self.regions_masked,
            "refusal_reasons": dict(self.refusal_reasons),
        }


class BurnedInCleaner:
    """Applies a policy's ``burned_in`` mode. ``engine`` replaces Tesseract (tests, other OCR)."""

    def __init__(self, policy: DicomPolicy, engine: OcrEngine | None = None) -> None:
        self.policy = policy
        self.settings = policy.burned_in_ocr
        self.rule = TextRule(self.settings.min_confidence, self.settings.min_alnum)
        self.counts = BurnedInCounts()
        self.engine = engine
        if policy.burned_in == "clean" and engine is None:
            try:
                self.engine = TesseractEngine(self.settings.language)
            except OcrUnavailableError as exc:
                raise OcrUnavailable(
                    f"policy {policy.name} has burned_in: clean but OCR is unavailable: {exc}",
                    hint="apt-get install tesseract-ocr && pip install 'securetrain[ocr]', or use burned_in: reject",
                ) from None

    # ------------------------------------------------------------------ engine hooks
    def process(self, ds: Dataset, report: Any = None) -> BurnedInOutcome:
        """Check and (per policy) clean ``ds``'s pixels in place. Raises
        :class:`BurnedInAnnotationError` (counted as refused) with the reason."""
        outcome = BurnedInOutcome()
        if report is not None:
            report.burned_in_detail = outcome
        if not any(tag in ds for tag in PIXEL_TAGS):
            return outcome
        try:
            self._process(ds, report, outcome)
        except BurnedInAnnotationError as exc:
            self.counts.refused += 1
            self.counts.refusal_reasons[_reason_key(str(exc))] += 1
            raise
        return outcome

    def record(self, ds: Dataset, report: Any = None) -> None:
        """Write the outcome into the de-identified object (after the engine's own marks)."""
        outcome: BurnedInOutcome | None = getattr(report, "burned_in_detail", None)
        if outcome is None or outcome.action == "none":
            return
        method = list(_values(ds.get("DeidentificationMethod")))
        if outcome.action == "cleaned":
            method.append(f"burned-in text: OCR-verified clean ({getattr(self.engine, 'name', 'ocr')})"[:64])
            ds.BurnedInAnnotation = "NO"
        elif outcome.action == "masked":
            method.append("pixels: configured regions masked, no OCR")
            ds.BurnedInAnnotation = "NO"
        elif outcome.action == "allowed-flagged":
            method.append("burned-in text: NOT removed (policy allow-flagged)")
            if outcome.original_flag is not None:
                ds.BurnedInAnnotation = outcome.original_flag
        listed = outcome.regions[:_MAX_LISTED_REGIONS]
        method.extend(r.describe() for r in listed)
        if len(outcome.regions) > len(listed):
            method.append(f"and {len(outcome.regions) - len(listed)} more masked regions")
        ds.DeidentificationMethod = method
        self._claim_clean_pixel(ds, claim=outcome.action in ("cleaned", "masked"))

    # ------------------------------------------------------------------ internals
    def _process(self, ds: Dataset, report: Any, outcome: BurnedInOutcome) -> None:
        policy = self.policy
        status = burned_in_status(ds, policy.burned_in_modalities)
        outcome.status = status
        flag = ds.get("BurnedInAnnotation")
        outcome.original_flag = None if flag is None else str(flag)
        masks = matching_masks(ds, policy.pixel_masks) if Option.CLEAN_PIXEL_DATA in policy.options else []
        mode = policy.burned_in
        if mode == "reject":
            # Exactly the behaviour from before burned_in existed (burned_in_annotation: reject | mask).
            if status != "no":
                if policy.burned_in_annotation == "reject":
                    raise BurnedInAnnotationError(
                        f"pixel data may contain burned-in annotation ({status}); rejected by policy {policy.name}",
                        hint="set burned_in: clean (OCR) or allow-flagged, or burned_in_annotation: mask with "
                        "clean_pixel_data regions for this modality/size",
                    )
                if not masks:
                    raise BurnedInAnnotationError(
                        f"pixel data may contain burned-in annotation ({status}) and no pixel_masks entry matches "
                        f"modality {ds.get('Modality', '?')} {ds.get('Rows', '?')}x{ds.get('Columns', '?')}",
                        hint="add a pixel_masks entry for this modality and image size, or set burned_in: clean",
                    )
            if masks:
                self._legacy_masks(ds, report, outcome, masks)
            return
        # status "no" of a modality that usually burns text in can only be a declared NO.
        if (status == "no" and mode == "clean" and self.settings.verify_declared_no
                and usually_burned_in(ds, policy.burned_in_modalities)):
            # Declared NO, but of a modality that usually burns text in, and the policy checks the
            # claim: OCR'd and cleaned like a suspected file (status stays "no": what it declared).
            self._clean(ds, report, outcome, self._known_regions(ds, masks))
            return
        if status == "no" or mode == "allow-flagged":
            known = self._known_regions(ds, masks) if mode == "clean" else []
            if known or masks:
                if mode == "clean":
                    self._mask_only(ds, report, outcome, known)
                else:
                    self._legacy_masks(ds, report, outcome, masks)
            if status != "no" and mode == "allow-flagged":
                outcome.action = "allowed-flagged"
                self.counts.allowed_flagged += 1
                _set(report, "burned_in", "allowed-flagged")
            return
        self._clean(ds, report, outcome, self._known_regions(ds, masks))

    def _legacy_masks(self, ds: Dataset, report: Any, outcome: BurnedInOutcome, masks: list) -> None:
        apply_pixel_masks(ds, masks)
        outcome.regions = [Region(x0, y0, x1, y1, source="pixel_mask") for m in masks for x0, y0, x1, y1 in m.rects]
        outcome.action = "masked"
        outcome.transfer_syntax = str(transfer_syntax(ds))
        self.counts.masked += 1
        self.counts.regions_masked += len(outcome.regions)
        _set(report, "pixels_masked", True)
        if outcome.status != "no":
            _set(report, "burned_in", "masked")
        ds.BurnedInAnnotation = "NO"

    def _known_regions(self, ds: Dataset, masks: list) -> list[Region]:
        manufacturer = str(ds.get("Manufacturer", "") or "")
        model = str(ds.get("ManufacturerModelName", "") or "")
        rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
        out = [
            Region(x0, y0, x1, y1, source="known", label=k.label)
            for k in self.policy.known_regions
            if k.matches(manufacturer, model, rows, cols)
            for x0, y0, x1, y1 in k.rects
        ]
        out += [Region(x0, y0, x1, y1, source="pixel_mask") for m in masks for x0, y0, x1, y1 in m.rects]
        return [c for r in out if (c := r.clipped(rows, cols)) is not None]

    def _mask_only(self, ds: Dataset, report: Any, outcome: BurnedInOutcome, regions: list[Region]) -> None:
        frames = decode_frames(ds)
        outcome.regions = regions
        outcome.transfer_syntax = str(write_pixels(ds, paint(frames, regions, fill_value(ds, frames))))
        outcome.action = "masked"
        self.counts.masked += 1
        self.counts.regions_masked += len(regions)
        _set(report, "pixels_masked", True)
        ds.BurnedInAnnotation = "NO"

    def _clean(self, ds: Dataset, report: Any, outcome: BurnedInOutcome, known: list[Region]) -> None:
        s = self.settings
        engine = self.engine
        if engine is None:  # only a policy with burned_in: clean cleans, and it built its engine
            raise OcrUnavailable("burned-in text cleaning needs an OCR engine", hint="use burned_in: clean")
        frames = decode_frames(ds)
        n_frames, rows, cols, _ = frames.shape
        unique = _unique_frames(frames)
        if len(unique) > s.max_frames:
            raise BurnedInAnnotationError(
                f"too many distinct frames to OCR for burned-in text ({len(unique)} > {s.max_frames})",
                hint="raise burned_in_ocr.max_frames, or reject such files",
            )
        fill = fill_value(ds, frames)
        regions = list(known)
        current = paint(frames, regions, fill) if regions else frames
        passes = 0
        while True:
            shown = displayed(ds, current[unique])
            views = [window_to_uint8(to_gray(frame)) for frame in shown]
            found = find_text(views, engine, self.rule, full_frame=s.full_frame, min_contrast=s.min_contrast)
            passes += 1
            if not found:
                break
            if passes > s.rounds:
                raise BurnedInAnnotationError(
                    f"text still found by OCR after masking ({len(found)} regions, {passes - 1} masking rounds)",
                    hint="add a known_regions entry for this device, or reject such files",
                )
            regions += [r.grown(s.margin, rows, cols) for r in found]
            regions = merge_regions(regions, gap=max(2, s.margin))
            current = paint(frames, regions, fill)
        fraction = covered_fraction(regions, rows, cols)
        if fraction > s.max_masked_fraction:
            raise BurnedInAnnotationError(
                f"burned-in text covers too much of the image to mask ({fraction:.0%} > {s.max_masked_fraction:.0%})",
                hint="raise burned_in_ocr.max_masked_fraction, or reject such files",
            )
        outcome.ocr_passes = passes
        outcome.frames_checked = len(unique)
        outcome.regions = regions
        if regions:
            outcome.transfer_syntax = str(write_pixels(ds, current))
            _set(report, "pixels_masked", True)
        else:
            outcome.transfer_syntax = str(transfer_syntax(ds))
        outcome.action = "cleaned"
        self.counts.cleaned += 1
        self.counts.regions_masked += len(regions)
        _set(report, "burned_in", "cleaned")
        ds.BurnedInAnnotation = "NO"

    @staticmethod
    def _claim_clean_pixel(ds: Dataset, *, claim: bool) -> None:
        seq = ds.get("DeidentificationMethodCodeSequence")
        items = list(seq) if seq is not None else []
        has = [i for i in items if str(i.get("CodeValue", "")) == CLEAN_PIXEL_CODE[0]]
        if claim and not has:
            item = Dataset()
            item.CodeValue = CLEAN_PIXEL_CODE[0]
            item.CodingSchemeDesignator = "DCM"
            item.CodeMeaning = CLEAN_PIXEL_CODE[1]
            items.append(item)
        elif not claim and has:
            items = [i for i in items if i not in has]  # pixels passed uncleaned: do not claim it
        else:
            return
        ds.DeidentificationMethodCodeSequence = Sequence(items)


def _unique_frames(frames: np.ndarray) -> list[int]:
    """Indexes of the first occurrence of each distinct frame (cine loops repeat frames)."""
    seen: dict[bytes, int] = {}
    for i in range(frames.shape[0]):
        seen.setdefault(hashlib.blake2b(frames[i].tobytes(), digest_size=16).digest(), i)
    return sorted(seen.values())


def _values(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _set(report: Any, name: str, value: Any) -> None:
    if report is not None:
        setattr(report, name, value)


def _reason_key(message: str) -> str:
    """A short, value-free category of a refusal for the counts."""
    for key in ("too many distinct frames", "text still found", "covers too much", "cannot decode",
                "1-bit", "float/double", "re-encoded", "shape does not match", "rejected by policy", "no pixel_masks"):
        if key in message:
            return key
    return "other"

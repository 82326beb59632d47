"""A torch Dataset that de-identifies DICOM on load, so PHI never reaches the model.

The index is validated up front with header-only reads (``stop_before_pixels``): non-DICOM,
corrupt, undecodable (no pixel decoder for the transfer syntax), pixel-less and policy-rejected
(burned-in annotation) files are quarantined before the first epoch, so the epoch length is
stable and deterministic. A file that still fails at load time (e.g. corrupt pixel bytes, a
multi-valued Rescale Slope) is quarantined too and its item is *dropped*: ``__getitem__`` returns
``None``, and batched fetching (``__getitems__``, which every batching ``DataLoader`` uses, with
any collate function) leaves it out of the batch, so no other item is served twice and the epoch
never crashes. Any exception of
one item is contained this way; it never reaches the DataLoader workers.

Throughput: the de-identified header of each file (the ``meta`` values, the Modality LUT or palette,
frame parameters) is cached per process after its first load; later epochs read only the pixel-module
attributes and the pixel data (``specific_tags``) and skip the de-identification pass. Files whose
pixels the policy masks always take the full path.

Pixels are what a viewer shows (:mod:`securetrain.masking.dicom.display`): the Modality LUT applied
to grey images, MONOCHROME1 inverted, PALETTE COLOR indexes read through their palette (a palette
that cannot be read exactly is quarantined at index time with :class:`PaletteColorError`'s reason).

Colour (ultrasound, secondary capture: Photometric Interpretation RGB, YBR_FULL, YBR_FULL_422 with
3 samples per pixel, YBR decoded to RGB; PALETTE COLOR, its palette applied) follows ``color_mode``:
``"grey"`` (the default, as before) averages R, G and B into one channel and logs a warning naming
how many files it converted; ``"rgb"`` keeps ``[3, H, W]`` and refuses a one-channel file with
:class:`ColorModeError` (naming it) when the index is built; ``"auto"`` is ``"rgb"`` when every
indexed file is colour, else ``"grey"`` (the resolved mode is ``color_mode``;
``colour_files``/``grey_files`` count the index).

Quarantine = an entry in :meth:`DicomDataset.quarantine_report` and, when ``quarantine_dir`` is
given, a *copy* of the file plus ``<name>.reason.json`` there (sources are never moved or
modified). Worker processes report through that directory, so the report is complete with
``num_workers > 0`` only when ``quarantine_dir`` is set.
"""

from __future__ import annotations

import concurrent.futures
import csv
import functools
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import ConfigError
from securetrain.masking.dicom.display import Display
from securetrain.masking.dicom.errors import ColorModeError, DeidError
from securetrain.masking.dicom.folders import candidate_files
from securetrain.masking.dicom.policy import DicomPolicy, load_policy

log = logging.getLogger(__name__)

#: ``color_mode`` values: one grey channel, three colour channels, or colour when every file is.
COLOR_MODES = ("grey", "rgb", "auto")

DEFAULT_META_KEYS: tuple[str, ...] = (
    "PatientID",
    "StudyInstanceUID",
    "SeriesInstanceUID",
    "SOPInstanceUID",
    "Modality",
    "PatientSex",
    "PatientAge",
    "BodyPartExamined",
    "StudyDate",
)


# Attributes pixel decoding needs; a cached (already de-identified) file is re-read with only these.
_PIXEL_TAGS = (
    "SpecificCharacterSet", "Rows", "Columns", "SamplesPerPixel", "PhotometricInterpretation", "PlanarConfiguration",
    "BitsAllocated", "BitsStored", "HighBit", "PixelRepresentation", "NumberOfFrames", "PixelData",
    "FloatPixelData", "DoubleFloatPixelData", "ExtendedOffsetTable", "ExtendedOffsetTableLengths",
    "RedPaletteColorLookupTableDescriptor", "GreenPaletteColorLookupTableDescriptor",
    "BluePaletteColorLookupTableDescriptor", "RedPaletteColorLookupTableData", "GreenPaletteColorLookupTableData",
    "BluePaletteColorLookupTableData", "SegmentedRedPaletteColorLookupTableData",
    "SegmentedGreenPaletteColorLookupTableData", "SegmentedBluePaletteColorLookupTableData",
)


_T = TypeVar("_T")
# index reads skip values larger than this (Pixel Data); palettes and LUTs below it are read at once
_INDEX_DEFER_SIZE = 256 * 1024
# pydicom's JPEG Extended plugins that refuse samples of more than 8 bits
_EIGHT_BIT_JPEG_PLUGINS = frozenset({"pillow", "gdcm"})


@dataclass(frozen=True)
class _Opened:
    """A file read and parsed, not yet de-identified or decoded (see ``DicomDataset._open``)."""

    path: str
    digest: str
    ds: Any
    header: dict[str, Any] | None  # the cached de-identified header of these bytes, if any


@dataclass(frozen=True)
class QuarantineEntry:
    path: str  # relative to the dataset root / manifest directory
    reason: str  # never contains attribute values

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def decode_error(ds: Any, exc: BaseException) -> DeidError:
    """``cannot decode pixel data (<transfer syntax>: <error type>)``: which syntax failed tells a
    corrupt stream from a missing decoder; the decoder's message is left out (it may quote values)."""
    tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    try:
        syntax = f"{tsyntax.name}: " if tsyntax is not None else ""
    except (AttributeError, ValueError):
        syntax = ""
    return DeidError(f"cannot decode pixel data ({syntax}{type(exc).__name__})")


def read_manifest(manifest: Path) -> list[tuple[Path, int | None]]:
    """Rows ``(path, label)`` of a ``path,label`` manifest CSV; relative paths resolved against it."""
    try:
        with manifest.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or "path" not in reader.fieldnames:
                raise ConfigError(f"manifest {manifest} needs a 'path' column (and optionally 'label')")
            has_label = "label" in reader.fieldnames
            rows: list[tuple[Path, int | None]] = []
            for n, row in enumerate(reader, start=2):
                rel = (row.get("path") or "").strip()
                if not rel:
                    raise ConfigError(f"manifest {manifest} line {n}: empty path")
                label: int | None = None
                if has_label and (row.get("label") or "").strip() != "":
                    try:
                        label = int(row["label"])
                    except ValueError:
                        raise ConfigError(f"manifest {manifest} line {n}: label must be an integer") from None
                p = Path(rel)
                rows.append((p if p.is_absolute() else manifest.parent / p, label))
            return rows
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {manifest}: {exc.strerror}") from None


class DicomDataset(Dataset):
    """Items: ``{"pixels": FloatTensor[1,H,W] in [0,1] (``color_mode`` rgb: ``[3,H,W]``, one
    min/max scaling over the three channels), "label": LongTensor[] (if labelled),
    "meta": dict[str, str] of de-identified attributes}``.

    ``source`` is a folder (every file below it, sorted) or a manifest CSV with ``path,label``
    columns (relative paths are relative to the manifest). ``size`` resizes (bilinear) so
    batches stack. Picklable and handle-free, so it works with ``DataLoader(num_workers>0)``.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        policy: DicomPolicy | str | os.PathLike[str],
        key: bytes,
        *,
        size: int | tuple[int, int] | None = None,
        meta_keys: Sequence[str] = DEFAULT_META_KEYS,
        quarantine_dir: str | os.PathLike[str] | None = None,
        audit: AuditRecorder | None = None,
        pin_memory: bool = False,
        frame: int = 0,
        color_mode: str = "grey",
    ) -> None:
        from securetrain.masking.dicom.keys import DeidKeys

        if color_mode not in COLOR_MODES:
            raise ValueError(f"color_mode must be one of {', '.join(COLOR_MODES)}, not {color_mode!r}")

        self.policy = policy if isinstance(policy, DicomPolicy) else load_policy(policy)
        self._keys = DeidKeys.from_secret(key)  # validates the key now, not in a worker
        self.size = (size, size) if isinstance(size, int) else (tuple(size) if size else None)
        self.meta_keys = tuple(meta_keys)
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir is not None else None
        self.audit = audit or NullAuditRecorder()
        self.pin_memory = bool(pin_memory)
        self.frame = frame
        src = Path(source)
        if src.is_dir():
            self.root = src
            candidates: list[tuple[Path, int | None]] = [(p, None) for p in candidate_files(src)]
            self.has_labels = False
        elif src.is_file():
            self.root = src.parent
            candidates = read_manifest(src)
            self.has_labels = any(label is not None for _, label in candidates)
        else:
            raise ConfigError(f"DICOM source {src} is neither a folder nor a manifest file")
        self._quarantine: list[QuarantineEntry] = []
        self.items: list[tuple[str, int | None]] = []
        colour: list[bool] = []  # per item: 3 samples per pixel
        self._header_colour = False  # set by _validate_header for the file it accepts
        for path, label in candidates:
            try:
                reason = self._validate_header(path)
            except Exception as exc:  # pydicom parses lazily: a corrupt element fails when first read
                reason = f"corrupt DICOM header ({type(exc).__name__})"
            if reason is None:
                self.items.append((str(path), label))
                colour.append(self._header_colour)
            else:
                self._quarantine_file(path, reason)
        # what the index left out (path relative to the source, reason): callers that must not train on
        # a silent subset (the pipeline) check it; load-time failures are in quarantine_report() only
        self.excluded_files: tuple[dict[str, str], ...] = tuple(e.to_dict() for e in self._quarantine)
        self.requested_color_mode = color_mode
        self.colour_files, self.grey_files = sum(colour), len(colour) - sum(colour)
        self.color_mode = self._resolve_color_mode(color_mode, colour)
        self._deid: Any = None  # created lazily in each process
        self._warmed_pid = os.getpid()  # the constructing process appended already (policy event)
        self._headers: dict[str, dict[str, Any]] = {}  # path -> de-identified header of the bytes with its "sha256"
        # (pid, executor): the thread that appends a batch's reads while the batch is decoded
        self._audit_thread: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
        self.audit.record(
            "deid.policy_applied",
            f"policy:{self.policy.name}",
            details={
                "policy_name": self.policy.name,
                "policy_version": self.policy.policy_version,
                "policy_digest": self.policy.digest,
                "key_id": self._keys.key_id,
                "files": len(self.items),
                "quarantined": len(self._quarantine),
            },
        )

    # -------------------------------------------------------------- validation
    def _resolve_color_mode(self, requested: str, colour: list[bool]) -> str:
        """``rgb`` refuses the first grey file; ``auto`` keeps colour only when every file has it;
        colour made grey is logged (never silent)."""
        if requested == "rgb":
            grey = next((path for (path, _), c in zip(self.items, colour, strict=True) if not c), None)
            if grey is not None:
                rel = self._rel(grey)
                raise ColorModeError(
                    f"color_mode 'rgb' needs colour images (3 samples per pixel, or PALETTE COLOR), but {rel} has "
                    f"one channel ({self.grey_files} of {len(colour)} files are grey)", path=rel,
                    hint="remove the grey files, or use color_mode 'grey' (every file one channel) or 'auto'")
        mode = "rgb" if requested == "rgb" or (requested == "auto" and colour and all(colour)) else "grey"
        if mode == "grey" and self.colour_files:
            log.warning("%d colour file(s) of %d converted to one grey channel (the mean of R, G and B; "
                        "color_mode %r)%s; color_mode 'rgb' keeps three channels", self.colour_files, len(colour),
                        requested, f", as {self.grey_files} file(s) are grey" if requested == "auto" else "")
        return mode

    def _rel(self, path: Path | str) -> str:
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return Path(path).name

    def _validate_header(self, path: Path) -> str | None:
        from pydicom.pixels import get_decoder
        from pydicom.uid import JPEGExtended12Bit

        from securetrain.masking.dicom.colour import SUPPORTED, unconvertible_colour
        from securetrain.masking.dicom.engine import check_complete, patient_identity, read_dicom
        from securetrain.masking.dicom.pixels import burned_in_status

        if not path.is_file():
            return "missing file"
        try:
            # large values (Pixel Data) are skipped, not read: their presence and stated length are
            # still known, so a file cut inside them or without them is refused now, not on every load
            ds = read_dicom(path, defer_size=_INDEX_DEFER_SIZE)
        except DeidError as exc:
            return str(exc).split(": ", 1)[-1]
        if "Rows" not in ds or "Columns" not in ds:
            return "no image (Rows/Columns absent)"
        try:
            check_complete(ds, path.name, size=path.stat().st_size, identity=False)
        except DeidError as exc:
            return str(exc).split(": ", 1)[-1]
        try:  # a palette, Modality LUT or Rescale Slope/Intercept that cannot be read: refused now
            self._header_colour = Display.of(ds).colour  # read by __init__ for this item
        except DeidError as exc:
            return str(exc)
        meta = getattr(ds, "file_meta", None)
        tsyntax = getattr(meta, "TransferSyntaxUID", None)
        if tsyntax is not None:
            try:
                if tsyntax.is_compressed and not get_decoder(tsyntax).is_available:
                    return f"no pixel decoder available for transfer syntax {tsyntax.name}"
                if tsyntax == JPEGExtended12Bit and int(ds.get("BitsStored", 8) or 8) != 8 \
                        and not set(get_decoder(tsyntax).available_plugins) - _EIGHT_BIT_JPEG_PLUGINS:
                    return ("12-bit JPEG Extended pixel data: no installed decoder reads it (Pillow and GDCM "
                            "decode 8-bit samples only; pylibjpeg-libjpeg, GPL, is not installed); convert the "
                            "file to a lossless syntax first or leave it out")
            except (ValueError, NotImplementedError):
                return "unsupported or private transfer syntax"
        colour = unconvertible_colour(ds, compressed=bool(tsyntax is not None and tsyntax.is_compressed))
        if colour is not None:  # pydicom would fail at load time with a bare ValueError (16-bit YBR)
            return f"{colour} cannot be read as RGB: {SUPPORTED}; convert the file to 8-bit RGB first or leave it out"
        try:  # every item's meta carries a pseudonymous PatientID: no identity, no item
            patient_identity(ds, self.policy.missing_patient_identity)
        except DeidError as exc:
            return f"{str(exc).split(' (hint:')[0]}; rejected by policy {self.policy.name}"
        status = burned_in_status(ds, self.policy.burned_in_modalities)
        # allow-flagged passes flagged pixels on (the de-identifier does so on load too); clean would
        # need OCR per item, so such files stay out (clean the folder with `securetrain deid` first)
        if status != "no" and self.policy.burned_in_annotation == "reject" and self.policy.burned_in != "allow-flagged":
            return f"burned-in annotation {status}; rejected by policy {self.policy.name}"
        return None

    def _quarantine_file(self, path: Path | str, reason: str) -> None:
        entry = QuarantineEntry(self._rel(path), reason)
        if any(e.path == entry.path for e in self._quarantine):
            return  # each file once, with its first reason
        self._quarantine.append(entry)
        if self.quarantine_dir is None:
            return
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        src = Path(path)
        tag = hashlib.sha256(entry.path.encode()).hexdigest()[:12]
        target = self.quarantine_dir / f"{tag}_{src.name}"
        if src.is_file() and not target.exists():
            shutil.copy2(src, target)
        from securetrain.io.atomic import atomic_write_bytes

        atomic_write_bytes(target.with_name(target.name + ".reason.json"), json.dumps(entry.to_dict()).encode())

    def quarantine_report(self) -> list[dict[str, str]]:
        """Every quarantined file once, with its (first) reason: index-time, plus load-time from any worker."""
        seen = {e.path for e in self._quarantine}
        out = [e.to_dict() for e in self._quarantine]
        if self.quarantine_dir is not None and self.quarantine_dir.is_dir():
            for sidecar in sorted(self.quarantine_dir.glob("*.reason.json")):
                try:
                    d = json.loads(sidecar.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                if d.get("path") not in seen:
                    seen.add(d.get("path"))
                    out.append({"path": d.get("path", ""), "reason": d.get("reason", "")})
        return out

    # -------------------------------------------------------------- loading
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_deid"] = None  # caches and keys are rebuilt per worker
        state["_headers"] = {}
        state["_audit_thread"] = None
        return state

    def _deidentifier(self) -> Any:
        if self._deid is None:
            from securetrain.masking.dicom.engine import Deidentifier

            self._deid = Deidentifier(self.policy, self._keys, audit=None, record_changes=False)
        return self._deid

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        """The item, or ``None`` when its file fails to load (it is quarantined; see module doc)."""
        self._warm_audit()
        return self._get(index, None)

    def _warm_audit(self) -> None:
        """In a new process (a DataLoader worker), start opening the audit log's connection while
        the first files are read, so their reads are not recorded after a connection set-up."""
        pid = os.getpid()
        if self._warmed_pid != pid:
            self._warmed_pid = pid
            warm_up = getattr(self.audit, "warm_up", None)
            if callable(warm_up):
                warm_up()

    def _item(self, index: int) -> tuple[str, int | None]:
        n = len(self.items)
        if not -n <= index < n:
            raise IndexError(index)
        return self.items[index % n]

    def _get(self, index: int, reads: list[tuple[str, str, str, dict[str, Any]]] | None) -> dict[str, Any] | None:
        path, label = self._item(index)
        return self._guarded(path, lambda: self._load(path, label, reads))

    def _guarded(self, path: str, load: Callable[[], _T]) -> _T | None:
        """``load()``, or None with the file quarantined when it fails."""
        try:
            return load()
        except Exception as exc:  # one bad file must never end the epoch or kill a worker
            reason = str(exc) if isinstance(exc, DeidError) else f"load failed ({type(exc).__name__})"
            self._quarantine_file(path, reason)
            return None

    def _record_reads_in_background(
        self, reads: list[tuple[str, str, str, dict[str, Any]]],
    ) -> concurrent.futures.Future[None] | None:
        """Start appending ``reads`` on this process's audit thread; None when there are none."""
        if not reads:
            return None
        pid = os.getpid()
        if self._audit_thread is None or self._audit_thread[0] != pid:  # none yet, or the parent's (fork)
            self._audit_thread = (pid, concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="securetrain-dataset-audit"))
        return self._audit_thread[1].submit(self._record_reads, list(reads))

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """Batched fetch (used by every ``DataLoader`` with a batch size, whatever its collate
        function): the batch without its failed items, so even the default collate never sees a
        ``None``. A batch whose every item failed raises, naming the quarantine report.

        The batch's ``dicom.read`` events are appended in one transaction (``append_many`` where the
        recorder has it) before any item is returned: every read is still recorded, and durable,
        before its data leaves the dataset, at one commit per batch instead of one per file."""
        self._warm_audit()
        reads: list[tuple[str, str, str, dict[str, Any]]] = []
        opened: list[tuple[_Opened, int | None] | None] = []
        try:
            for i in indices:
                path, label = self._item(i)
                o = self._guarded(path, functools.partial(self._open, path, reads))
                opened.append(None if o is None else (o, label))
        except BaseException:
            self._record_reads(reads)  # also for the reads of a batch that then failed
            raise
        # The batch's append commits in the background while its files are de-identified and
        # decoded (the costly half): the commit's wait is hidden instead of added. Nothing is
        # returned before it is durable, and its failure fails the batch.
        appended = self._record_reads_in_background(reads)
        try:
            loaded = [None if o is None else self._guarded(o[0].path, functools.partial(self._finish, *o))
                      for o in opened]
        finally:
            if appended is not None:
                appended.result()
        items = [item for item in loaded if item is not None]
        if not items and indices:
            raise DeidError(f"all {len(indices)} items of a batch failed to load; see quarantine_report()")
        return items

    def _note_read(self, reads: list[tuple[str, str, str, dict[str, Any]]] | None, digest: str, size: int) -> None:
        """Record one file read: now (single item), or with the rest of its batch (``reads``)."""
        read = ("dicom.read", f"sha256:{digest}", "success", {"sha256": digest, "bytes": size})
        if reads is None:
            self._record_reads([read])
        else:
            reads.append(read)

    def _record_reads(self, reads: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        if not reads:
            return
        append_many = getattr(self.audit, "append_many", None)
        if callable(append_many):
            append_many(reads)
        else:
            for action, resource, outcome, details in reads:
                self.audit.record(action, resource, outcome=outcome, details=details)

    @staticmethod
    def collate_fn(batch: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """``default_collate`` without the dropped (``None``) items; ``None`` if all were dropped."""
        kept = [b for b in batch if b is not None]
        return default_collate(kept) if kept else None

    def _load(self, path: str, label: int | None,
              reads: list[tuple[str, str, str, dict[str, Any]]] | None = None) -> dict[str, Any]:
        return self._finish(self._open(path, reads), label)

    def _open(self, path: str, reads: list[tuple[str, str, str, dict[str, Any]]] | None) -> _Opened:
        """Read the file, note its read, parse it: the cheap first half of a load.

        Every load reads the file and records that read (its pixels leave the dataset again); the
        cached header is used only for the very bytes it was made from."""
        from securetrain.masking.dicom.engine import read_dicom

        data = Path(path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        header = self._headers.get(path)
        if header is None or header["sha256"] != digest:
            ds = read_dicom(io.BytesIO(data), name=Path(path).name)
            header = None
        else:
            import pydicom

            ds = pydicom.dcmread(io.BytesIO(data), specific_tags=list(_PIXEL_TAGS), force=True)
        self._note_read(reads, digest, len(data))
        return _Opened(path, digest, ds, header)

    def _finish(self, opened: _Opened, label: int | None) -> dict[str, Any]:
        """De-identify (unless the header is cached) and decode: the costly second half of a load."""
        import numpy as np

        path, ds, header = opened.path, opened.ds, opened.header
        if header is None:
            ds, report = self._deidentifier().deidentify_dataset(ds)
            header = {
                "sha256": opened.digest,
                "meta": {k: str(ds.get(k, "") or "") for k in self.meta_keys},
                "display": Display.of(ds),  # palette, Modality LUT, MONOCHROME1
            }
            if report.pixels_masked:  # masked pixels must be re-masked on every load
                self._headers.pop(path, None)
            else:
                self._headers[path] = header
        try:
            arr = ds.pixel_array
        except Exception as exc:
            raise decode_error(ds, exc) from None
        arr = np.asarray(arr)  # stored values: integer indexes for a palette or Modality LUT
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        if frames > 1:
            arr = arr[min(self.frame, frames - 1)]
        display: Display = header["display"]
        arr = display.apply(arr)  # float32, what a viewer shows
        if display.colour and arr.ndim == 3:
            # [H, W, 3] RGB (YBR decoded to RGB, palette applied): kept as channels, or their mean
            arr = arr.transpose(2, 0, 1) if self.color_mode == "rgb" else arr.mean(axis=-1)
        elif self.color_mode == "rgb":
            raise DeidError("the file has one channel but color_mode is 'rgb'")  # changed since indexed
        if arr.ndim != (3 if self.color_mode == "rgb" else 2):
            raise DeidError(f"unexpected pixel array shape {arr.shape}")
        lo, hi = float(arr.min()), float(arr.max())
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise DeidError("pixel values are not finite")
        arr = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
        pixels = torch.from_numpy(np.ascontiguousarray(arr))
        if pixels.dim() == 2:
            pixels = pixels.unsqueeze(0)
        if self.size is not None and tuple(pixels.shape[-2:]) != self.size:
            pixels = torch.nn.functional.interpolate(
                pixels.unsqueeze(0), size=self.size, mode="bilinear", align_corners=False
            ).squeeze(0)
        item: dict[str, Any] = {"pixels": pixels.float(), "meta": dict(header["meta"])}
        if self.has_labels:
            item["label"] = torch.tensor(-1 if label is None else label, dtype=torch.long)
        return item

    def dataloader(self, *, batch_size: int = 8, num_workers: int = 0, shuffle: bool = False, **kwargs: Any) -> DataLoader:
        """A DataLoader with this dataset's ``pin_memory`` advice (from the device backend)."""
        kwargs.setdefault("collate_fn", self.collate_fn)
        return DataLoader(
            self, batch_size=batch_size, num_workers=num_workers, shuffle=shuffle, pin_memory=self.pin_memory, **kwargs
        )


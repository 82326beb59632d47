"""The de-identification engine: PS3.15 Annex E Basic Profile + options over a pydicom Dataset.

One pass walks every element of every item of every sequence at any depth and applies the
compiled per-tag action (see :mod:`profile_table`); a second pass redacts, from the text that is
retained, every value that the first pass removed or replaced anywhere in the same object. The
report names tags, keywords and actions only, never values.

Speed comes from not decoding: the action is decided from the raw element's tag and VR; kept
elements stay raw (and are copied byte for byte by :mod:`writer`); removed, emptied and remapped
string values are read and replaced as raw bytes; retained text is searched as bytes and decoded
only on a hit; pixel data is never touched unless the policy masks it (:meth:`_check_pixels`,
the one place burned-in handling happens).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, cast

import pydicom
from pydicom.datadict import dictionary_VR, keyword_for_tag
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.errors import InvalidDicomError
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.sequence import Sequence
from pydicom.tag import BaseTag
from pydicom.uid import (
    PYDICOM_IMPLEMENTATION_UID,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    UID_dictionary,
)
from pydicom.valuerep import MAX_VALUE_LEN

from securetrain import __version__
from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import SecureTrainError
from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.dicom.ages import (
    AGGREGATED_AGE,
    aggregate_age,
    aggregate_text_ages,
    looks_like_age,
    may_hold_text_age,
)
from securetrain.masking.dicom.burned_in.cleaner import BurnedInCleaner
from securetrain.masking.dicom.burned_in.codec import clear_unused_bits
from securetrain.masking.dicom.charset import repair_character_set
from securetrain.masking.dicom.dates import shift_da, shift_dt
from securetrain.masking.dicom.decoders import gdcm_last_resort
from securetrain.masking.dicom.documents import (
    TAG_ENCAPSULATED_DOCUMENT,
    TAG_ENCAPSULATED_DOCUMENT_LENGTH,
    is_encapsulated_document,
    refuse_document,
    sop_class_of,
)
from securetrain.masking.dicom.errors import (
    DeidError,
    DicomDirectoryError,
    MissingPatientIdentityError,
    UnreadableDicomError,
)
from securetrain.masking.dicom.keys import DeidKeys, KeyedMapper
from securetrain.masking.dicom.mapping import export_mapping
from securetrain.masking.dicom.policy import DicomPolicy
from securetrain.masking.dicom.profile_table import CID7050, RECURSE_UIDS, Option, compile_profile, load_table
from securetrain.masking.dicom.safe_attributes import is_safe_unlisted_text
from securetrain.masking.dicom.scrub import Redactor, name_needles, value_needles
from securetrain.masking.dicom.writer import write_dataset_le

gdcm_last_resort()  # JPEG Lossless / JPEG-LS through GDCM; other syntaxes keep their decoders

TAG_PATIENT_ID = 0x00100020
TAG_PATIENT_NAME = 0x00100010
TAG_TIMEZONE = 0x00080201
TAG_PIXEL_DATA = 0x7FE00010

TEXT_VRS = frozenset({"LO", "SH", "ST", "LT", "UT", "UC", "PN"})
# VRs whose removed values feed the retained-text scrub (dates too: they may be typed in text).
COLLECT_VRS = frozenset({"LO", "SH", "ST", "LT", "UT", "UC", "PN", "AE", "DA", "DT", "UI", "CS", "AS", "UR"})
# Free-text VRs of attributes Table E.1-1 does not list: removed unless safe-listed or kept by policy.
FREE_TEXT_VRS = frozenset({"LO", "SH", "ST", "LT", "UT", "UC", "UR", "AE"})
# Character sets whose encoded bytes can be searched for ASCII needles without decoding.
_ASCII_COMPATIBLE = frozenset({"", "ISO_IR 6", "ISO 2022 IR 6", "ISO_IR 100", "ISO_IR 192", "ISO_IR 101",
                               "ISO_IR 109", "ISO_IR 110", "ISO_IR 148", "ISO_IR 203", "ISO_IR 144",
                               "ISO_IR 127", "ISO_IR 126", "ISO_IR 138", "ISO_IR 166"})

# UI attributes that name *kinds* of things (classes, syntaxes, coding schemes), never instances.
_KEEP_UI_KEYWORDS = frozenset(
    {
        "SOPClassUID",
        "ReferencedSOPClassUID",
        "MediaStorageSOPClassUID",
        "TransferSyntaxUID",
        "ImplementationClassUID",
        "ReferencedSOPClassUIDInFile",
        "ReferencedTransferSyntaxUIDInFile",
        "RelatedGeneralSOPClassUID",
        "OriginalSpecializedSOPClassUID",
        "SOPClassesInStudy",
        "CodingSchemeUID",
        "MappingResourceUID",
        "ContextUID",
        "PrivateInformationCreatorUID",
        "RequestedSOPClassUID",
        "AffectedSOPClassUID",
        "RetrieveAETitle",
    }
)
_DUMMY_STRING = {
    "PN": "ANONYMOUS",
    "DA": "19000101",
    "DT": "19000101000000",
    "TM": "000000",
    "AS": "000D",
    "IS": "0",
    "DS": "0",
}
_DUMMY_TEXT = "ANONYMIZED"
_NUMERIC_VRS = frozenset({"US", "SS", "UL", "SL", "FL", "FD", "UV", "SV", "AT"})

_METHOD_REMOVE_META = (0x00020016, 0x00020017, 0x00020018, 0x00020100, 0x00020102)


_RAW_ACTIONS = frozenset({"X", "Z", "D", "U"})
# String VRs whose raw bytes we can decode ourselves (PN/text only in ASCII-compatible charsets).
_RAW_VRS = frozenset({"AE", "AS", "CS", "DA", "DT", "TM", "UI", "LO", "SH", "ST", "LT", "UT", "UC", "UR", "PN",
                      "IS", "DS"})
_ASCII_ONLY_VRS = frozenset({"AE", "AS", "CS", "DA", "DT", "TM", "UI", "IS", "DS", "UR"})


def _raw_value(text: str, vr: str) -> dict[str, Any]:
    """length/value fields of a raw element holding ASCII ``text`` (padded to even length)."""
    data = text.encode("ascii")
    if len(data) % 2:
        data += b"\x00" if vr == "UI" else b" "
    return {"length": len(data), "value": data}


def _raw_strings(ds: Dataset, raw: Any) -> list[str] | None:
    """The values of a raw string element, or None when the bytes cannot be decoded here exactly
    (non-ASCII text in a character set with code extensions, or not bytes at all)."""
    data = raw.value
    if data is None:
        return []
    if not isinstance(data, bytes):
        return None
    if b"\x1b" in data:
        return None  # ISO 2022 escape sequences: 7-bit bytes that are not ASCII text
    if raw.VR in _ASCII_ONLY_VRS or data.isascii():
        text = data.decode("ascii", "replace")
    else:
        # pydicom's codec names for the item's own (0008,0005), else the set it inherits from its
        # parent (a sequence item usually has none of its own)
        encodings = ds._character_set
        codecs = [encodings] if isinstance(encodings, str) else list(encodings)
        codec = codecs[0].lower().replace("-", "_") if len(codecs) == 1 else ""
        if codec in ("utf8", "utf_8"):
            text = data.decode("utf-8", "replace")
        elif codec in ("iso8859", "latin_1"):  # default repertoire, ISO_IR 6, ISO_IR 100
            text = data.decode("latin-1")
        else:
            return None
    return [v.strip(" \x00") for v in text.split("\\")]


def _text_value(ds: Dataset, keyword: str) -> str:
    return str(ds.get(keyword, "") or "")


def _has_name(name: str) -> bool:
    """A person name with at least one character besides component/group separators and spaces."""
    return bool(name.strip("^= \x00"))


def patient_identity(ds: Dataset, missing: str = "reject") -> str:
    """The identity a top-level object's patient pseudonym is derived from (HMAC, see keys.py).

    1. its PatientID (0010,0020), stripped, when not empty;
    2. else ``"name:" + PatientName + "|" + PatientBirthDate`` when the name is not empty (the
       birth date keeps two patients of the same name apart);
    3. else, with ``missing == "study"``, ``"study:" + StudyInstanceUID`` (the original UID: each
       study is its own pseudonymous patient);
    4. else :class:`MissingPatientIdentityError`: files that cannot be attributed to a patient are
       refused rather than all given one shared pseudonym (that would merge unrelated patients into
       one and break a patient-level split).
    """
    identity = item_patient_identity(ds)
    if identity is not None:
        return identity
    if missing == "study":
        study = _text_value(ds, "StudyInstanceUID").strip(" \x00")
        if study:
            return "study:" + study
        raise MissingPatientIdentityError(
            "no patient identity: PatientID, PatientName and StudyInstanceUID are all empty or absent"
        )
    raise MissingPatientIdentityError(
        "no patient identity: PatientID and PatientName are empty or absent",
        hint="the policy field missing_patient_identity: study makes each study its own pseudonymous patient",
    )


def item_patient_identity(item: Dataset) -> str | None:
    """Steps 1 and 2 of :func:`patient_identity` for a dataset or a sequence item: its own
    PatientID, else its own PatientName + PatientBirthDate; None when it names nobody. One rule at
    every depth, so a person has one pseudonym wherever they appear."""
    pid = _text_value(item, "PatientID").strip()
    if pid:
        return pid
    name = _text_value(item, "PatientName")
    if _has_name(name):
        return "name:" + name + "|" + _text_value(item, "PatientBirthDate")
    return None


def is_well_known_uid(uid: str) -> bool:
    """DICOM-registry UIDs (classes, syntaxes, frames of reference like the Talairach one)."""
    return uid.startswith("1.2.840.10008.") or uid in UID_dictionary


@dataclass(frozen=True)
class TagChange:
    path: str  # e.g. "(0008,1140)[0].(0008,1155)"; tags and item indexes only, never values
    tag: int
    action: str
    detail: str = ""  # why, where the action alone does not say: "age_over_89" (an age in kept text)

    @property
    def keyword(self) -> str:
        if (self.tag >> 16) & 1:
            return "(private)"
        return keyword_for_tag(self.tag) or ""

    def to_dict(self) -> dict[str, str]:
        out = {"path": self.path, "tag": _fmt(self.tag), "keyword": self.keyword, "action": self.action}
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass
class DeidReport:
    """What happened to one object. Safe to log: no values, no keys, no day offset."""

    source: str | None = None
    output: str | None = None
    sop_instance_uid: str | None = None  # the *new* UID
    input_sha256: str | None = None  # of the input file (deidentify_file)
    patient_pseudonym: str | None = None
    changes: list[TagChange] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    burned_in: str = "none"  # none | masked | cleaned | allowed-flagged
    pixels_masked: bool = False
    unused_pixel_bits_cleared: bool = False  # bits outside Bits Stored (embedded overlays) zeroed
    burned_in_detail: Any = None  # burned_in.BurnedInOutcome: masked regions (coordinates only)

    @property
    def tags_changed(self) -> int:
        return sum(self.counts.values())

    def action_counts(self) -> dict[str, int]:
        return dict(self.counts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "sop_instance_uid": self.sop_instance_uid,
            "patient_pseudonym": self.patient_pseudonym,
            "tags_changed": self.tags_changed,
            "actions": self.action_counts(),
            "burned_in": self.burned_in,
            "pixels_masked": self.pixels_masked,
            "unused_pixel_bits_cleared": self.unused_pixel_bits_cleared,
            "burned_in_detail": self.burned_in_detail.to_dict() if self.burned_in_detail is not None else None,
            "changes": [c.to_dict() for c in self.changes],
        }


@lru_cache(maxsize=4096)
def _dictionary_vr(tag: int) -> str:
    try:
        return dictionary_VR(tag)
    except KeyError:
        return "UN"


def _fmt(tag: int) -> str:
    return f"({tag >> 16:04X},{tag & 0xFFFF:04X})"


class _Ctx:
    """Per-object state of one de-identification pass."""

    __slots__ = ("report", "day_offset", "phi", "retained_text", "sop_class")

    def __init__(self, report: DeidReport, day_offset: int | None, sop_class: str = "") -> None:
        self.report = report
        self.sop_class = sop_class  # the object's, for messages about nested content
        self.day_offset = day_offset
        self.phi: set[str] = set()  # needles (see scrub.py), not raw values
        self.retained_text: list[tuple[Dataset, int, str]] = []


class Deidentifier:
    """Apply a :class:`DicomPolicy` with keys derived from one project secret.

    ``key`` is the project secret (bytes, >= 16) or prepared :class:`DeidKeys`. The same key gives
    the same UIDs, pseudonyms and date offsets in every file and every run; another key gives
    unrelated ones. Pseudonyms assigned so far are kept in memory for :meth:`export_mapping`.
    """

    def __init__(
        self,
        policy: DicomPolicy,
        key: bytes | DeidKeys,
        audit: AuditRecorder | None = None,
        *,
        record_changes: bool = True,
    ) -> None:
        self.policy = policy
        self.keys = key if isinstance(key, DeidKeys) else DeidKeys.from_secret(key)
        self.audit = audit or NullAuditRecorder()
        self.record_changes = record_changes
        self.profile = compile_profile(policy.option_values, {**_document_action(policy), **policy.override_tags})
        self.mapper = KeyedMapper(self.keys, max_shift_days=policy.max_date_shift_days)
        self.pseudonyms: dict[str, str] = {}
        self.burned_in = BurnedInCleaner(policy)  # .counts: cleaned/refused/... for the report
        self._mark_cache: dict[bool, list[Any]] = {}
        opts = policy.option_values
        self._full_dates = Option.RETAIN_LONGITUDINAL_FULL_DATES.value in opts
        self._modified_dates = Option.RETAIN_LONGITUDINAL_MODIFIED_DATES.value in opts
        self._retain_uids = Option.RETAIN_UIDS.value in opts
        self._aggregate_ages = policy.age_over_89 == "aggregate"
        self._safe_private = policy.safe_private_set if self.profile.private_action == "C" else frozenset()
        table = load_table()
        self._method_text = [
            f"securetrain {__version__} DICOM de-identification",
            "PS3.15 E.1-1 Basic Application Confidentiality Profile",
            f"table: {table.edition.removeprefix('DICOM ')}@{table.source['commit'][:12]}",  # LO: 64 chars max
            _policy_line(policy),
        ]
        self.audit.record(
            "deid.policy_applied",
            f"policy:{policy.name}",
            details={
                "policy_name": policy.name,
                "policy_version": policy.policy_version,
                "policy_digest": policy.digest,
                "options": sorted(opts),
                "table_commit": table.source["commit"],
                "key_id": self.keys.key_id,
            },
        )

    # ----------------------------------------------------------------- public API
    def deidentify_dataset(self, ds: Dataset, *, source: str | None = None) -> tuple[Dataset, DeidReport]:
        """De-identify ``ds`` in place and return it with its report. Raises :class:`DeidError`."""
        refuse_dicomdir(ds, source or "<dataset>")
        if self.policy.encapsulated_documents == "reject" and is_encapsulated_document(ds):
            raise refuse_document(sop_class_of(ds), source or "<dataset>")  # before any OCR: cheap refusal
        report = DeidReport(source=source)
        identity = patient_identity(ds, self.policy.missing_patient_identity)  # before any OCR: cheap refusal
        if not self._keeps_overlays(ds):
            # Embedded overlay planes (text drawn into bits above High Bit) go with their 60xx groups.
            report.unused_pixel_bits_cleared = clear_unused_bits(ds)
        self._check_pixels(ds, report)
        pseudonym = self._pseudonym_for(identity)
        report.patient_pseudonym = pseudonym
        day_offset = self.mapper.day_offset(pseudonym) if self._modified_dates else None
        ctx = _Ctx(report, day_offset, sop_class_of(ds))
        self._walk(ds, ctx, "")
        self._ensure_patient_id(ds, ctx)
        if self.policy.scrub_retained_text:
            self._scrub(ctx)
        if self._aggregate_ages:  # ages typed into kept text: whether or not the scrub runs
            self._aggregate_text_ages(ctx)
        if repair_character_set(ds) is not None:  # misspelt term, or text its character set cannot decode
            self._note(ctx, "", 0x00080005, "C")
        self._mark(ds, report)
        self.burned_in.record(ds, report)
        self._file_meta(ds, report)
        report.sop_instance_uid = str(ds.get("SOPInstanceUID", "")) or None
        return ds, report

    def deidentify_file(
        self,
        src: str | os.PathLike[str],
        dst: str | os.PathLike[str] | None = None,
        *,
        dry_run: bool = False,
        writer: Any = None,
        label: str | None = None,
    ) -> DeidReport:
        """Read ``src``, de-identify, and atomically write ``dst`` (nothing written on dry runs).

        ``dst`` may be a callable that names the output from the report (e.g. by the new SOP
        Instance UID). ``label`` replaces the file name in error messages and the report (input
        file names can carry PHI). With a :class:`~securetrain.masking.dicom.output.BatchWriter` the
        file is staged and appears at the writer's next ``flush`` (one fsync per file instead of two)."""
        src_path = Path(src)
        name = label or src_path.name
        try:
            data = src_path.read_bytes()
        except OSError as exc:
            raise UnreadableDicomError(f"{name}: cannot read ({type(exc).__name__})") from None
        ds = read_dicom(io.BytesIO(data), name=name)
        refuse_dicomdir(ds, name)  # before check_complete: a DICOMDIR has no SOP identity in its data set
        try:
            check_complete(ds, name, size=len(data))
        except SecureTrainError:
            raise
        except Exception as exc:  # pydicom parses lazily: a corrupt element fails when first touched
            raise UnreadableDicomError(f"{name}: corrupt DICOM ({type(exc).__name__})") from None
        digest = hashlib.sha256(data).hexdigest()
        self.audit.record("dicom.read", f"sha256:{digest}", details={"sha256": digest, "bytes": len(data)})
        try:
            _, report = self.deidentify_dataset(ds, source=name)
        except SecureTrainError:
            raise
        except Exception as exc:  # as above; the typed error lets a folder run quarantine it and go on
            raise UnreadableDicomError(f"{name}: corrupt or unsupported DICOM ({type(exc).__name__})") from None
        report.input_sha256 = digest
        if callable(dst):
            dst = None if dry_run else dst(report)
        if dst is not None and not dry_run:
            if writer is not None:
                writer.write(dst, encode_dataset(ds))
            else:
                atomic_write_bytes(dst, encode_dataset(ds))
            report.output = str(dst)
        return report

    def export_mapping(self, path: str | os.PathLike[str], key: bytes) -> Path:
        """Write the original-id -> pseudonym map, AES-256-GCM encrypted with ``key`` (32 bytes)."""
        out = export_mapping(path, self.pseudonyms, key)
        self.audit.record("deid.mapping_exported", f"file:{Path(path).name}", details={"entries": len(self.pseudonyms)})
        return out

    # ----------------------------------------------------------------- internals
    def _pseudonym_for(self, identity: str) -> str:
        """The keyed pseudonym of one identity (recorded for the mapping export)."""
        pseudonym = self.mapper.pseudonym(identity)
        self.pseudonyms[identity] = pseudonym
        return pseudonym

    def _ensure_patient_id(self, ds: Dataset, ctx: _Ctx) -> None:
        """PatientID is Type 2 in most IODs and the patient key of every consumer (patient-level
        split, DicomDataset meta, grouping of a patient's files): an object that had none gets the
        pseudonym it was de-identified under. A policy override of (0010,0020) wins (it decides
        the attribute at every depth)."""
        if TAG_PATIENT_ID in ds or TAG_PATIENT_ID in self.policy.override_tags:
            return
        ds.PatientID = ctx.report.patient_pseudonym
        self._note(ctx, _fmt(TAG_PATIENT_ID), TAG_PATIENT_ID, "P")

    def _check_pixels(self, ds: Dataset, report: DeidReport) -> None:
        self.burned_in.process(ds, report)  # refuses with BurnedInAnnotationError, or cleans in place

    def _note(self, ctx: _Ctx, path: str, tag: int, action: str, detail: str = "") -> None:
        if self.record_changes:
            ctx.report.changes.append(TagChange(path, tag, action, detail))
        ctx.report.counts[action] += 1

    def _fallback(self, tag: int, vr: str, cleaning: bool = False) -> str:
        """Action for an attribute that Table E.1-1 does not list (the VR safety net).

        Fails closed: person names are emptied, dates follow the dates rule, instance UIDs are
        remapped, free text is removed (kept and scrubbed inside a sequence that an option cleans,
        kept as is when safe-listed) and attributes the data dictionary does not know are removed."""
        if not self.policy.vr_safety_net:
            return "K"
        if vr == "PN":
            return "Z"
        if vr in FREE_TEXT_VRS:
            if is_safe_unlisted_text(tag):
                return "K"
            return "C" if cleaning and vr != "AE" else "X"
        if vr == "UN":
            return "X"  # unknown to the dictionary (and not private): we cannot tell what it holds
        if vr in ("DA", "DT", "TM"):
            if self._full_dates:
                return "K"
            if self._modified_dates:
                return "C" if vr != "TM" else "K"
            return "Z"
        if vr == "UI":
            if self._retain_uids or (keyword_for_tag(tag) or "") in _KEEP_UI_KEYWORDS:
                return "K"
            return "U"
        return "K"

    def _collect(self, ctx: _Ctx, vr: str, value: Any) -> None:
        if vr == "SQ":
            for item in value or ():
                for elem in item.iterall():
                    if elem.VR != "SQ" and not _never_a_needle(int(elem.tag)):
                        self._collect(ctx, elem.VR, elem.value)
            return
        if vr not in COLLECT_VRS or value is None:
            return
        values = value if isinstance(value, list | tuple | pydicom.multival.MultiValue) else [value]
        for v in values:
            if isinstance(v, bytes):
                v = v.decode("latin-1", "replace")
            s = str(v).strip()
            if not s or (vr == "UI" and is_well_known_uid(s)):
                continue
            ctx.phi.update(name_needles(s) if vr == "PN" else value_needles(s))

    def _keeps_overlays(self, ds: Dataset) -> bool:
        """Whether an overlay plane of ``ds`` survives :meth:`_overlays` (explicit K override)."""
        groups = {int(t) >> 16 for t in ds.keys() if 0x6000 <= int(t) >> 16 <= 0x601E and not (int(t) >> 16) & 1}
        return any(self.profile.action_for((g << 16) | 0x3000) == "K" for g in groups)

    def _overlays(self, ds: Dataset, ctx: _Ctx, prefix: str) -> None:
        """Overlay planes and curves go as a whole: without Overlay Data (60xx,3000) / Curve Data
        (50xx,3000) the rest of the group is a dangling, invalid plane or curve (and its labels and
        descriptions are free text). We have no overlay-bitmap or curve cleaner, so Clean Graphics
        (C) also removes them; only an explicit K override of the data element keeps a group."""
        groups = {
            g for g in (int(t) >> 16 for t in ds.keys())
            if (0x6000 <= g <= 0x601E or 0x5000 <= g <= 0x501E) and not g & 1
        }
        for group in sorted(groups):
            if self.profile.action_for((group << 16) | 0x3000) == "K":
                continue
            for tag in [int(t) for t in ds.keys() if int(t) >> 16 == group]:
                elem = ds[tag]
                self._collect(ctx, elem.VR, elem.value)
                del ds[tag]
                self._note(ctx, f"{prefix}{_fmt(tag)}", tag, "X")

    def _walk(self, ds: Dataset, ctx: _Ctx, prefix: str, cleaning: bool = False) -> None:
        item_identity: str | None = None
        if prefix and (TAG_PATIENT_ID in ds._dict or TAG_PATIENT_NAME in ds._dict):
            # A sequence item that names a person (before its PatientID/BirthDate are changed).
            item_identity = item_patient_identity(ds)
        if item_identity is None or ctx.day_offset is None:
            self._walk_item(ds, ctx, prefix, cleaning, item_identity)
            return
        # That person's dates -- in this item and in the items below it that name nobody else --
        # move by that person's own offset, the one their own file gets, never by the object's
        # patient's (which would tie the two persons' calendars together).
        outer = ctx.day_offset
        ctx.day_offset = self.mapper.day_offset(self.mapper.pseudonym(item_identity))
        try:
            self._walk_item(ds, ctx, prefix, cleaning, item_identity)
        finally:
            ctx.day_offset = outer

    def _walk_item(self, ds: Dataset, ctx: _Ctx, prefix: str, cleaning: bool, item_identity: str | None) -> None:
        self._private(ds, ctx, prefix)
        self._overlays(ds, ctx, prefix)
        for btag in list(ds.keys()):
            tag = int(btag)
            group = tag >> 16
            if group & 1:
                continue  # handled by _private
            path = f"{prefix}{_fmt(tag)}"
            if group in (0x0000, 0x0002) or (tag & 0xFFFF) == 0:
                # Command group, stray file-meta and group-length elements: never part of a stored
                # instance body (file meta is rebuilt separately).
                del ds[btag]
                self._note(ctx, path, tag, "X")
                continue
            if tag == TAG_PIXEL_DATA:
                continue  # pixels: handled by _check_pixels, never converted here
            if tag in (TAG_PATIENT_ID, TAG_PATIENT_NAME) and tag not in self.policy.override_tags:
                if not prefix:
                    self._pseudonymise(ds, ds[btag], ctx, path)
                    continue
                self._pseudonymise_nested(ds, ds[btag], ctx, path, item_identity)
                continue
            # Decide from the raw element's VR first: most elements are kept as they are, and
            # converting their raw bytes to Python values is the dominant cost of a pass.
            raw = ds.get_item(btag)
            vr = getattr(raw, "VR", None)
            if vr is None or vr == "UN":  # implicit VR files: raw elements carry no real VR
                vr = _dictionary_vr(tag)
            action = self.profile.action_for(tag)
            if action is None:
                action = self._fallback(tag, vr, cleaning)
            if action == "K" and vr != "SQ":
                if vr in TEXT_VRS:
                    ctx.retained_text.append((ds, tag, path))  # scrubbed later, decoded only on a hit
                elif vr == "AS" and self._aggregate_ages:
                    self._aggregate_age(ds, tag, ctx, path)
                continue
            if (
                action in _RAW_ACTIONS
                and vr in _RAW_VRS
                and getattr(raw, "is_raw", False)
                and self._apply_raw(ds, raw, tag, vr, action, ctx, path)
            ):
                continue
            try:
                elem = ds[btag]
            except Exception:  # a value pydicom cannot decode: remove it (fail closed)
                del ds[btag]
                self._note(ctx, path, tag, "X")
                continue
            self._apply(ds, elem, elem.VR if elem.VR != "UN" else vr, action, ctx, path, cleaning)

    def _apply_raw(self, ds: Dataset, raw: Any, tag: int, vr: str, action: str, ctx: _Ctx, path: str) -> bool:
        """X/Z/D/U on a still-raw string element without converting it to a Python value: the
        removed text is decoded straight from its bytes (for character sets where that is exact).
        Returns False when the element needs the general path."""
        values = _raw_strings(ds, raw)
        if values is None:
            return False
        if vr in COLLECT_VRS:
            self._collect(ctx, vr, values)
        if action == "X":
            del ds._dict[raw.tag]  # public tag: no private-block bookkeeping to update
        elif action == "Z":
            ds._dict[raw.tag] = raw._replace(VR=vr, length=0, value=b"")
        elif action == "D" and vr != "UI":
            ds._dict[raw.tag] = raw._replace(VR=vr, **_raw_value(str(self._dummy(vr)), vr))
        else:  # U, or D on a UID: keyed remap
            if vr == "UI":
                new = [v if (not v or is_well_known_uid(v)) else self.mapper.uid(v) for v in values]
                ds._dict[raw.tag] = raw._replace(VR=vr, **_raw_value("\\".join(new), vr))
                action = "U"
            else:
                ds._dict[raw.tag] = raw._replace(VR=vr, length=0, value=b"")
        self._note(ctx, path, tag, action)
        return True

    def _aggregate_age(self, ds: Dataset, tag: int, ctx: _Ctx, path: str) -> None:
        """A retained Age String under ``age_over_89: aggregate``: every value above 89 years
        becomes 090Y (C); a value that is not an age empties the element (Z: we could not check
        it, and an empty Type 2/3 attribute keeps the object valid). An unchanged value stays raw."""
        raw: Any = ds.get_item(tag)
        is_raw = getattr(raw, "is_raw", False)
        value = raw.value
        if is_raw:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else ""
            values = text.split("\\")
        else:
            values = [str(v) for v in value] if isinstance(value, pydicom.multival.MultiValue) else [str(value or "")]
        values = [v.strip(" \x00") for v in values]
        capped = [aggregate_age(v) for v in values]
        if capped == values:
            return
        # the ages that are gone (not mere reformatting) feed the retained-text scrub
        self._collect(ctx, "AS", [v for v, c in zip(values, capped, strict=True) if c in (None, AGGREGATED_AGE)])
        new = [] if any(v is None for v in capped) else cast(list[str], capped)
        if is_raw:
            ds._dict[raw.tag] = raw._replace(VR="AS", **_raw_value("\\".join(new), "AS"))
        else:
            raw.value = new if len(new) > 1 else (new[0] if new else None)
        self._note(ctx, path, tag, "C" if new else "Z")

    def _remap_values(self, values: list[str]) -> Any:
        out = [v if (not v or is_well_known_uid(v)) else self.mapper.uid(v) for v in values]
        return out if len(out) > 1 else (out[0] if out else None)

    def _apply(
        self, ds: Dataset, elem: Any, vr: str, action: str, ctx: _Ctx, path: str, cleaning: bool = False
    ) -> None:
        tag = int(elem.tag)
        if " or " in vr:  # ambiguous dictionary VR ("US or SS", "OB or OW"): both forms act alike here
            vr = vr.split(" or ")[0]
        if tag == TAG_ENCAPSULATED_DOCUMENT and action != "K":
            self._drop_document(ds, elem, ctx, path)
            return
        if action == "K" or action == RECURSE_UIDS or (action == "C" and vr == "SQ"):
            if vr == "SQ":
                for i, item in enumerate(elem.value or ()):
                    self._walk(item, ctx, f"{path}[{i}].", cleaning or action == "C")
                if action != "K":
                    self._note(ctx, path, tag, action)
            elif vr in TEXT_VRS:
                ctx.retained_text.append((ds, tag, path))
            return
        if action == "C":
            self._clean(ds, elem, vr, ctx, path)
            return
        self._collect(ctx, vr, elem.value)
        if action == "X":
            del ds[tag]
        elif action == "Z" or (action == "D" and vr in ("SQ", "OB", "OW", "OF", "OD", "OL", "OV", "UN", "UR")):
            elem.value = Sequence() if vr == "SQ" else None
            action = "Z" if action == "Z" else "D"
        elif action == "D":
            if vr == "UI":
                self._remap(elem)
                action = "U"
            else:
                elem.value = self._dummy(vr)
        elif action == "U":
            if vr == "UI":
                self._remap(elem)
            elif vr == "SQ":  # U on a sequence: keep it, recurse (its UID rows remap)
                for i, item in enumerate(elem.value or ()):
                    self._walk(item, ctx, f"{path}[{i}].", cleaning)
            else:
                elem.value = None  # a U row with a non-UI VR: fail closed
        self._note(ctx, path, tag, action)

    def _drop_document(self, ds: Dataset, elem: Any, ctx: _Ctx, path: str) -> None:
        """An Encapsulated Document met by the walk (at the top level under ``remove``, or nested at
        any depth): refused under ``reject``; else emptied, and its Encapsulated Document Length
        made 0, the length of what is written (it kept the old document's length)."""
        if self.policy.encapsulated_documents == "reject":
            raise refuse_document(ctx.sop_class, ctx.report.source or "<dataset>", path)
        elem.value = None
        self._note(ctx, path, TAG_ENCAPSULATED_DOCUMENT, "Z")
        if TAG_ENCAPSULATED_DOCUMENT_LENGTH in ds._dict:
            ds[TAG_ENCAPSULATED_DOCUMENT_LENGTH].value = 0
            self._note(ctx, f"{path[:-len('(0042,0011)')]}(0042,0015)", TAG_ENCAPSULATED_DOCUMENT_LENGTH, "C")

    def _dummy(self, vr: str) -> Any:
        if vr in _NUMERIC_VRS:
            return 0
        return _DUMMY_STRING.get(vr, _DUMMY_TEXT)

    def _remap(self, elem: Any) -> None:
        value = elem.value
        if value is None or value == "":
            return
        if isinstance(value, list | tuple | pydicom.multival.MultiValue):
            elem.value = [v if is_well_known_uid(str(v)) else self.mapper.uid(str(v)) for v in value]
        else:
            v = str(value)
            elem.value = v if is_well_known_uid(v) else self.mapper.uid(v)

    def _pseudonymise(self, ds: Dataset, elem: Any, ctx: _Ctx, path: str) -> None:
        original = str(elem.value or "").strip()
        self._collect(ctx, elem.VR, elem.value)
        if int(elem.tag) == TAG_PATIENT_ID:
            pseudonym = ctx.report.patient_pseudonym or ""
            if original and original not in self.pseudonyms:
                self.pseudonyms[original] = self.mapper.pseudonym(original)
            elem.value = self.mapper.pseudonym(original) if original else pseudonym
        else:
            # One family-name component, no trailing "^": an empty component breaks some encoders
            # (e.g. single-valued ISO 2022 IR 87), and the pseudonym is plain ASCII, valid in every
            # specific character set.
            elem.value = ctx.report.patient_pseudonym or "ANONYMOUS"
        self._note(ctx, path, int(elem.tag), "P")

    def _pseudonymise_nested(self, ds: Dataset, elem: Any, ctx: _Ctx, path: str, identity: str | None) -> None:
        """PatientID / PatientName inside a sequence item: another person (a group scan's other
        patients, other IDs, a referenced patient) or the same one under another ID. Never the
        object's patient pseudonym: the item's own identity (its PatientID, else its PatientName +
        PatientBirthDate, the top-level rule) gets its own keyed pseudonym, so an identity has the
        same pseudonym wherever it appears -- or, per ``nested_patient_identity``, the value is
        emptied or removed. An empty value stays empty (nothing to invent), unless removed."""
        tag = int(elem.tag)
        value = str(elem.value or "")
        present = _has_name(value) if tag == TAG_PATIENT_NAME else bool(value.strip(" \x00"))
        mode = self.policy.nested_patient_identity
        if not value and mode != "remove":
            return
        self._collect(ctx, elem.VR, elem.value)
        if mode == "remove":
            del ds[tag]
            self._note(ctx, path, tag, "X")
        elif mode == "empty" or not present or identity is None:
            elem.value = None
            self._note(ctx, path, tag, "Z")
        else:
            elem.value = self._pseudonym_for(identity)
            self._note(ctx, path, tag, "P")

    def _clean(self, ds: Dataset, elem: Any, vr: str, ctx: _Ctx, path: str) -> None:
        tag = int(elem.tag)
        if vr in ("DA", "DT"):
            if ctx.day_offset is None:
                self._collect(ctx, vr, elem.value)
                elem.value = None
                self._note(ctx, path, tag, "Z")
                return
            self._collect(ctx, vr, elem.value)
            shift = shift_da if vr == "DA" else shift_dt
            values = elem.value if isinstance(elem.value, pydicom.multival.MultiValue) else [elem.value]
            shifted = [shift(str(v), ctx.day_offset) if v is not None else "" for v in values]
            if any(s is None for s in shifted):
                del ds[tag]  # unparseable date: remove rather than leak
                self._note(ctx, path, tag, "X")
                return
            elem.value = shifted if len(shifted) > 1 else shifted[0]
            self._note(ctx, path, tag, "C")
        elif vr == "TM":
            return  # only whole days move, so times stay coupled to their (shifted) dates
        elif tag == TAG_TIMEZONE:
            self._collect(ctx, vr, elem.value)
            del ds[tag]
            self._note(ctx, path, tag, "X")
        elif vr in TEXT_VRS:
            ctx.retained_text.append((ds, tag, path))  # cleaned by the scrub pass
            self._note(ctx, path, tag, "C")
        else:
            self._collect(ctx, vr, elem.value)
            del ds[tag]  # nothing we know how to clean: remove (fail closed)
            self._note(ctx, path, tag, "X")

    def _private(self, ds: Dataset, ctx: _Ctx, prefix: str) -> None:
        private = [int(t) for t in ds.keys() if (t >> 16) & 1]
        if not private:
            return
        keep: set[int] = set()
        if self._safe_private:
            creators: dict[tuple[int, int], str] = {}
            for tag in private:
                elem_no = tag & 0xFFFF
                if 0x0010 <= elem_no <= 0x00FF:
                    value = ds[tag].value
                    if isinstance(value, bytes):
                        value = value.decode("latin-1", "replace")
                    creators[(tag >> 16, elem_no)] = str(value).strip()
            for tag in private:
                group, elem_no = tag >> 16, tag & 0xFFFF
                if elem_no < 0x1000:
                    continue
                creator = creators.get((group, elem_no >> 8))
                if creator is not None and (group, creator, elem_no & 0xFF) in self._safe_private:
                    keep.add(tag)
                    keep.add((group << 16) | (elem_no >> 8))
        for tag in private:
            path = f"{prefix}{_fmt(tag)}"
            if tag in keep:
                elem = ds[tag]
                if elem.VR == "SQ":
                    for i, item in enumerate(elem.value or ()):
                        self._walk(item, ctx, f"{path}[{i}].", True)
                elif elem.VR in TEXT_VRS:
                    ctx.retained_text.append((ds, tag, path))
                elif self._aggregate_ages and (elem.VR == "AS" or (elem.VR == "UN" and looks_like_age(elem.value))):
                    if elem.VR == "UN":  # Implicit VR: a private value's VR is unknown; this one is an age
                        ds[tag] = DataElement(tag, "AS", elem.value.decode("ascii"))
                    self._aggregate_age(ds, tag, ctx, path)
                continue
            raw = ds.get_item(tag)
            raw_vr = getattr(raw, "VR", None)
            if _never_a_needle(tag):
                pass
            elif raw_vr in COLLECT_VRS - {"CS"}:
                try:
                    self._collect(ctx, ds[tag].VR, ds[tag].value)
                except Exception:  # an undecodable private value is deleted all the same
                    pass
            elif raw_vr in (None, "UN") and isinstance(getattr(raw, "value", None), bytes):
                # Implicit VR: a short printable value is most likely text; scrub it elsewhere too.
                value = raw.value.rstrip(b"\x00 ")
                if len(value) <= 1024 and all(32 <= b < 127 for b in value):
                    self._collect(ctx, "LO", value.decode("ascii").split("\\"))
            del ds[tag]
            self._note(ctx, path, tag, "X")

    def _scrub(self, ctx: _Ctx) -> None:
        if not ctx.phi or not ctx.retained_text:
            return
        redactor = Redactor(ctx.phi)
        lowered_needles = [n.lower() for n in redactor.needles]
        ascii_needles = [n.encode("ascii") for n in lowered_needles if n.isascii()]
        all_ascii = len(ascii_needles) == len(lowered_needles)
        for ds, tag, path in ctx.retained_text:
            if tag not in ds:
                continue
            raw = ds.get_item(tag)
            # Search the encoded bytes first: most retained text holds no needle, and then it is
            # never decoded. Only for character sets where ASCII bytes mean ASCII letters.
            if (getattr(raw, "is_raw", False) and isinstance(raw.value, bytes) and all_ascii and _ascii_searchable(ds)
                    and not any(n in raw.value.lower() for n in ascii_needles)):
                continue
            elem = self._decoded_text(ctx, ds, tag, path)
            if elem is None:
                continue
            value = elem.value
            if value is None:
                continue
            multi = isinstance(value, pydicom.multival.MultiValue)
            old = [str(v) for v in value] if multi else [str(value)]
            new = [redactor.redact(text) if redactor.could_match(text.lower()) else text for text in old]
            if new != old:
                elem.value = new if multi else new[0]
                self._note(ctx, path, tag, "C")

    def _decoded_text(self, ctx: _Ctx, ds: Dataset, tag: int, path: str) -> DataElement | None:
        """A retained text element, decoded; None (and removed, noted X) when it cannot be decoded:
        text that cannot be checked is never kept."""
        try:
            return ds[tag]
        except Exception:
            del ds[tag]
            self._note(ctx, path, tag, "X")
            return None

    def _aggregate_text_ages(self, ctx: _Ctx) -> None:
        """``age_over_89: aggregate`` for ages written into kept free text ("92 year old" ->
        "90+ year old", "Age: 091Y" -> "Age: 090Y"; see ages.py). Recorded as C with detail
        ``age_over_89``; the text is decoded only when its bytes may hold an age."""
        searchable: dict[int, bool] = {}  # per data set (item): its character set, looked up once
        for ds, tag, path in ctx.retained_text:
            raw = ds._dict.get(BaseTag(tag))  # (pydicom's Tag() conversions cost more than the check)
            if raw is None:
                continue
            if getattr(raw, "is_raw", False) and isinstance(raw.value, bytes):
                if id(ds) not in searchable:
                    searchable[id(ds)] = _ascii_searchable(ds)
                if searchable[id(ds)] and not may_hold_text_age(raw.value):
                    continue
            elem = self._decoded_text(ctx, ds, tag, path)
            if elem is None:
                continue
            if elem.VR == "PN" or elem.value is None:
                continue  # a person name holds no age
            multi = isinstance(elem.value, pydicom.multival.MultiValue)
            old = [str(v) for v in elem.value] if multi else [str(elem.value)]
            limit = MAX_VALUE_LEN.get(elem.VR)
            new = [aggregate_text_ages(text, max_len=limit)[0] for text in old]
            if new != old:
                elem.value = new if multi else new[0]
                self._note(ctx, path, tag, "C", "age_over_89")

    def _mark(self, ds: Dataset, report: DeidReport) -> None:
        """PS3.15 E.1.1 attributes that declare what was done. They are the same for every object
        of a run, so they are encoded once per encoding and inserted as raw elements."""
        implicit, little = ds.original_encoding
        if little is True and implicit is not None:
            raws = self._mark_cache.get(implicit)
            if raws is None:
                template = Dataset()
                self._mark_into(template)
                buf = DicomBytesIO()
                buf.is_implicit_VR, buf.is_little_endian = implicit, True
                write_dataset(buf, template)
                from pydicom.filereader import read_dataset

                parsed = read_dataset(io.BytesIO(buf.getvalue()), implicit, True)
                raws = self._mark_cache[implicit] = [parsed.get_item(t) for t in sorted(parsed._dict)]
            for raw in raws:
                ds._dict[raw.tag] = raw  # immutable raw tuples: safe to share between objects
            return
        self._mark_into(ds)

    def _mark_into(self, ds: Dataset) -> None:
        ds.PatientIdentityRemoved = "YES"
        ds.DeidentificationMethod = self._method_text
        codes = [CID7050["basic"]] + [CID7050[o.value] for o in self.policy.options]
        seq = Sequence()
        for value, meaning in codes:
            item = Dataset()
            item.CodeValue = value
            item.CodingSchemeDesignator = "DCM"
            item.CodeMeaning = meaning
            seq.append(item)
        ds.DeidentificationMethodCodeSequence = seq
        if self._full_dates:
            ds.LongitudinalTemporalInformationModified = "UNMODIFIED"
        elif self._modified_dates:
            ds.LongitudinalTemporalInformationModified = "MODIFIED"
        else:
            ds.LongitudinalTemporalInformationModified = "REMOVED"

    def _file_meta(self, ds: Dataset, report: DeidReport) -> None:
        meta = getattr(ds, "file_meta", None)
        if meta is None:
            meta = FileMetaDataset()
            ds.file_meta = meta
        for tag in _METHOD_REMOVE_META:  # sending/receiving AE titles and private meta
            if tag in meta:
                del meta[tag]
                self._note_meta(report, tag)
        if "TransferSyntaxUID" not in meta:
            implicit, little = ds.original_encoding if ds.original_encoding[0] is not None else (False, True)
            meta.TransferSyntaxUID = (
                ImplicitVRLittleEndian if implicit else (ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
            )
        sop_instance = ds.get("SOPInstanceUID")
        if "MediaStorageSOPInstanceUID" in meta or sop_instance:
            if sop_instance:
                meta.MediaStorageSOPInstanceUID = sop_instance
            elif not self._retain_uids:
                original = str(meta.MediaStorageSOPInstanceUID)
                meta.MediaStorageSOPInstanceUID = original if is_well_known_uid(original) else self.mapper.uid(original)
            self._note_meta(report, 0x00020003)
        if "SOPClassUID" in ds:
            meta.MediaStorageSOPClassUID = ds.SOPClassUID
        meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
        meta.ImplementationVersionName = "SECURETRAIN"

    def _note_meta(self, report: DeidReport, tag: int) -> None:
        action = "U" if tag == 0x00020003 else "X"
        report.counts[action] += 1
        if self.record_changes:
            report.changes.append(TagChange(_fmt(tag), tag, action))


# Coded-entry components (PS3.3 8.8) name a code of a coding scheme, never a person (see
# safe_attributes): removed with their item, they are no scrub needles, or every kept code of the
# same scheme (SCPECG, UCUM, DCM, a vendor's 99 scheme) would be overwritten with X's.
_CODED_ENTRY_TAGS = frozenset({
    0x00080100, 0x00080102, 0x00080103, 0x00080104, 0x00080119, 0x00080120,  # value, scheme, version, meaning
})


def _never_a_needle(tag: int) -> bool:
    """Removed values that must not scrub kept text: coded-entry components, and private creator
    elements (gggg,0010-00FF), which name a vendor's block ('GEMS_IDEN_01', 'Mortara Instrument,
    Inc.') -- as needles they erased the kept Manufacturer."""
    return tag in _CODED_ENTRY_TAGS or (bool((tag >> 16) & 1) and 0x0010 <= (tag & 0xFFFF) <= 0x00FF)


def _ascii_searchable(ds: Dataset) -> bool:
    """Whether ``ds``'s character set keeps ASCII letters and digits as ASCII bytes, so its encoded
    text can be searched for them without decoding."""
    charset = ds.get("SpecificCharacterSet", "") or ""
    charset = charset if isinstance(charset, str) else "\\".join(charset)
    return all(c.strip() in _ASCII_COMPATIBLE for c in charset.split("\\"))


def _document_action(policy: DicomPolicy) -> dict[int, str]:
    """The compiled action of (0042,0011) Encapsulated Document: K under ``keep``; else the table's
    (the walk refuses or empties the document, see ``_drop_document``)."""
    return {TAG_ENCAPSULATED_DOCUMENT: "K"} if policy.encapsulated_documents == "keep" else {}


def _policy_line(policy: DicomPolicy) -> str:
    """``policy: NAME vN sha256:...`` within LO's 64 characters: a long name is shortened, the
    digest (which identifies the policy exactly) never is."""
    tail = f" v{policy.policy_version} sha256:{policy.digest[:16]}"
    room = 64 - len("policy: ") - len(tail)
    name = policy.name if len(policy.name) <= room else policy.name[: room - 1] + "~"
    return f"policy: {name}{tail}"


_UID_RE = re.compile(r"^[0-9]+(\.[0-9]+)+$")


def _with_preamble(source: Any) -> Any:
    """A file that starts with ``DICM`` (the prefix and file meta written without the 128-byte
    preamble, as some exporters do) gets an all-zero preamble back, so it reads as Part 10."""
    try:
        if isinstance(source, str):
            with open(source, "rb") as fh:
                if fh.read(4) != b"DICM":
                    return source
                return io.BytesIO(bytes(128) + b"DICM" + fh.read())
        pos = source.tell()
        head = source.read(4)
        if head != b"DICM":
            source.seek(pos)
            return source
        return io.BytesIO(bytes(128) + b"DICM" + source.read())
    except (OSError, AttributeError, ValueError):
        return source


def _relabel_vr_encoding(ds: Dataset) -> Dataset:
    """Old tools label an Implicit VR data set Explicit VR Little Endian (or the reverse). pydicom
    reads it by looking at the bytes (with a warning); the file meta is corrected to the encoding
    the data set really has, so the output is written in it and names it (the elements were never
    re-encoded). Only the two native little-endian syntaxes are relabelled.

    A compressed syntax is always Explicit VR Little Endian, so an Implicit VR data set under one
    cannot be relabelled: its elements are parsed now (VRs from the data dictionary, ambiguous ones
    resolved, private ones ``UN``) so that they are written in Explicit VR, never copied raw as
    implicit bytes under an explicit label (the writers failed on them: no VR to write)."""
    meta = getattr(ds, "file_meta", None)
    tsyntax = meta.get("TransferSyntaxUID") if meta is not None else None
    if meta is None or tsyntax is None:
        return ds
    first: Any = next((e for e in ds._dict.values() if e.is_raw), None)
    if first is None:
        return ds
    if tsyntax not in (ExplicitVRLittleEndian, ImplicitVRLittleEndian):
        try:
            compressed = tsyntax.is_compressed and not tsyntax.is_deflated
        except ValueError:  # private or unknown syntax: not judged
            return ds
        if compressed and first.is_implicit_VR and first.is_little_endian:
            for _ in ds.iterall():  # reading each element (at any depth) parses it with its VR
                pass
        return ds
    actual_implicit = bool(first.is_implicit_VR)
    if actual_implicit != (tsyntax == ImplicitVRLittleEndian):
        meta.TransferSyntaxUID = ImplicitVRLittleEndian if actual_implicit else ExplicitVRLittleEndian
        ds.set_original_encoding(actual_implicit, True, ds.original_character_set)
    return ds


def read_dicom(
    path: str | os.PathLike[str] | BinaryIO, *, stop_before_pixels: bool = False, name: str | None = None,
    defer_size: int | None = None,
) -> Dataset:
    """dcmread that turns every failure into :class:`UnreadableDicomError` with a short reason.

    Files without the 128-byte preamble and ``DICM`` prefix (raw data sets, e.g. images a DICOMDIR
    references after stripping, or older exports) are read with ``force=True`` and accepted only
    when the content is a valid data set: it parses to the end and carries a well-formed SOP Class
    UID and SOP Instance UID. Anything else is refused, always with the reason."""
    label = name or (Path(path).name if isinstance(path, str | os.PathLike) else "<stream>")
    source: Any = os.fspath(path) if isinstance(path, str | os.PathLike) else path
    source = _with_preamble(source)
    try:
        return _relabel_vr_encoding(pydicom.dcmread(source, stop_before_pixels=stop_before_pixels,
                                                    defer_size=defer_size))
    except InvalidDicomError:
        pass  # no preamble/prefix: maybe a raw data set
    except (OSError, EOFError) as exc:
        raise UnreadableDicomError(f"{label}: cannot read ({type(exc).__name__})") from None
    except Exception as exc:  # pydicom raises many types on corrupt input
        raise UnreadableDicomError(f"{label}: corrupt DICOM ({type(exc).__name__})") from None
    if not isinstance(source, str):
        source.seek(0)
    try:
        ds = pydicom.dcmread(source, stop_before_pixels=stop_before_pixels, force=True, defer_size=defer_size)
        sop_class = str(ds.get("SOPClassUID", "") or "")
        sop_instance = str(ds.get("SOPInstanceUID", "") or "")
    except Exception:
        ds, sop_class, sop_instance = None, "", ""
    if ds is None or not (_UID_RE.match(sop_class) and _UID_RE.match(sop_instance)):
        raise UnreadableDicomError(
            f"{label}: not a DICOM file (no DICM preamble/prefix, and the content is not a data set "
            "with a SOP Class UID and SOP Instance UID)"
        ) from None
    return _relabel_vr_encoding(ds)


MEDIA_STORAGE_DIRECTORY = "1.2.840.10008.1.3.10"
_TAG_DIRECTORY_RECORDS = 0x00041220


def refuse_dicomdir(ds: Dataset, label: str) -> None:
    """Raise :class:`DicomDirectoryError` for a DICOMDIR (Media Storage Directory Storage in the file
    meta, or a Directory Record Sequence in the data set): a CD's index, never an object to write."""
    meta = getattr(ds, "file_meta", None)
    sop_class = str(meta.get("MediaStorageSOPClassUID", "") or "").strip("\x00 ") if meta is not None else ""
    if sop_class == MEDIA_STORAGE_DIRECTORY or _TAG_DIRECTORY_RECORDS in ds._dict:
        raise DicomDirectoryError(
            f"{label}: a DICOMDIR (Media Storage Directory) is an index of the input's files and patients, "
            "not an object to de-identify; it is not copied (build a new DICOMDIR for the output if needed)"
        )


def check_complete(ds: Dataset, label: str, size: int | None = None, *, identity: bool = True) -> None:
    """pydicom stops silently at EOF, so a truncated file reads "fine". ``size`` (the file length) lets
    a cut inside an element header show; the file meta's SOP identity must be in the data set. For images:
    image attributes without pixel data, or native pixel data shorter than Rows x Columns x
    frames x samples x bytes, mean the file was cut. (A non-image object cut exactly between two
    elements cannot be told from a complete one; nor can a text value cut short. Header-only image
    objects -- e.g. the stripped images a DICOMDIR references -- carry no image attributes at all
    and are accepted: they hold no pixels to leak.)

    Values a ``defer_size`` read left unread are never loaded here: their stated length is checked
    against ``size`` instead. ``identity=False`` skips the SOP identity check against the file meta."""
    if not ds._dict:
        raise UnreadableDicomError(f"{label}: no data elements (empty or truncated file)")
    for tag in reversed(sorted(ds._dict)):  # a cut file ends inside its last element
        raw: Any = ds.get_item(tag, keep_deferred=True)  # raw (has .length) unless something already parsed it
        end = getattr(raw, "value_tell", None)
        if getattr(raw, "is_raw", False) and raw.value is None and raw.length not in (0, 0xFFFFFFFF) \
                and size is not None and isinstance(end, int) and end + raw.length > size:  # deferred, cut
            raise UnreadableDicomError(
                f"{label}: element {_fmt(int(tag))} holds {max(size - end, 0)} of {raw.length} bytes (truncated file?)"
            )
        if getattr(raw, "is_raw", False) and raw.value is not None and raw.length != 0xFFFFFFFF:
            if len(raw.value) < raw.length:
                raise UnreadableDicomError(
                    f"{label}: element {_fmt(int(tag))} holds {len(raw.value)} of {raw.length} bytes (truncated file?)"
                )
            # pydicom stops silently when fewer than 8 bytes (one element header) remain: a file cut
            # inside the next element's header ends with a few bytes nobody parsed.
            if size is not None and isinstance(end, int) and not _is_deflated(ds):
                left = size - (end + raw.length)
                if 0 < left < 8:
                    raise UnreadableDicomError(
                        f"{label}: {left} bytes after the last element are not a whole element (truncated file?)"
                    )
        break
    if identity:
        _check_identity_against_meta(ds, label)
    if "Rows" not in ds and "Columns" not in ds:
        return
    if "Rows" not in ds or "Columns" not in ds:
        raise UnreadableDicomError(f"{label}: Rows without Columns (truncated file?)")
    pixel_tags = (TAG_PIXEL_DATA, 0x7FE00008, 0x7FE00009)
    if not any(t in ds for t in pixel_tags):
        raise UnreadableDicomError(f"{label}: image attributes but no pixel data (truncated file?)")
    if TAG_PIXEL_DATA not in ds:
        return
    problem = pixel_encoding_problem(ds)
    if problem is not None:
        raise UnreadableDicomError(f"{label}: {problem} (corrupt file?)")
    tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    try:
        if tsyntax is not None and tsyntax.is_compressed:
            return
    except ValueError:
        return
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        samples = int(ds.get("SamplesPerPixel", 1) or 1)
        bits = int(ds.get("BitsAllocated", 8) or 8)
    except (TypeError, ValueError):
        raise UnreadableDicomError(f"{label}: malformed image attributes") from None
    photometric = str(ds.get("PhotometricInterpretation", "") or "").strip().upper()
    if samples == 3 and photometric in ("YBR_FULL_422", "YBR_PARTIAL_422"):
        samples = 2  # 4:2:2 subsampled: two values per pixel on average
    expected = (rows * cols * frames * samples * bits + 7) // 8
    pixels: Any = ds.get_item(TAG_PIXEL_DATA, keep_deferred=True)
    actual = pixels.length if pixels.is_raw and pixels.value is None else len(pixels.value or b"")
    if actual < expected:
        raise UnreadableDicomError(f"{label}: pixel data is {actual} bytes, {expected} expected (truncated file?)")


_ITEM_TAG_LE = b"\xfe\xff\x00\xe0"  # (FFFE,E000): every encapsulated Pixel Data starts with an item


def pixel_encoding_problem(ds: Dataset) -> str | None:
    """Why (7FE0,0010) Pixel Data contradicts the transfer syntax the object names, or None.

    A compressed (encapsulated) syntax needs undefined-length Pixel Data made of items (it starts
    with the Basic Offset Table item); a native syntax needs plain, defined-length bytes. A tool
    that decompressed without updating the syntax, or the reverse, leaves a file that names a
    compression it does not have (or hides one it has): no reader decodes it. Private or unknown
    syntaxes are not judged."""
    elem: Any = ds._dict.get(BaseTag(TAG_PIXEL_DATA))
    if elem is None:
        return None
    meta = getattr(ds, "file_meta", None)
    tsyntax = meta.get("TransferSyntaxUID") if meta is not None else None
    if tsyntax is None:
        implicit, little = ds.original_encoding if ds.original_encoding[0] is not None else (False, True)
        tsyntax = ImplicitVRLittleEndian if implicit else (ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    try:
        encapsulated = tsyntax.is_encapsulated
        name = tsyntax.name
    except (ValueError, AttributeError):
        return None
    raw = getattr(elem, "is_raw", False)
    undefined = elem.length == 0xFFFFFFFF if raw else bool(elem.is_undefined_length)
    value = elem.value
    if raw and value is None and not undefined and elem.length:
        return None  # a deferred value (header-only read): its bytes are judged when it is read in full
    if encapsulated:
        if not isinstance(value, bytes | bytearray) or bytes(value[:4]) != _ITEM_TAG_LE:
            return f"pixel data is not encapsulated although the transfer syntax ({name}) is compressed"
        return None
    if undefined:
        return f"pixel data holds encapsulated fragments although the transfer syntax ({name}) is not compressed"
    return None


def _is_deflated(ds: Dataset) -> bool:
    tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    try:
        return bool(tsyntax is not None and tsyntax.is_deflated)
    except ValueError:
        return False


def _check_identity_against_meta(ds: Dataset, label: str) -> None:
    """A Part 10 file names its SOP Class and Instance twice: in the file meta (written first) and in
    the data set. A file cut before the data set's own copies still has the meta's, so the data set
    must carry each identity the meta announces -- and the same value (a swapped data set is no
    more trustworthy than a cut one)."""
    meta = getattr(ds, "file_meta", None)
    if meta is None:
        return
    for meta_kw, ds_kw in (("MediaStorageSOPClassUID", "SOPClassUID"), ("MediaStorageSOPInstanceUID", "SOPInstanceUID")):
        announced = str(meta.get(meta_kw, "") or "").strip("\x00 ")
        if not announced:
            continue
        present = str(ds.get(ds_kw, "") or "").strip("\x00 ")
        if not present:
            raise UnreadableDicomError(f"{label}: the file meta names a {ds_kw} but the data set has none (truncated file?)")
        if present != announced:
            raise UnreadableDicomError(f"{label}: the data set's {ds_kw} differs from the file meta's")


_FAST_SYNTAXES = frozenset({ImplicitVRLittleEndian, ExplicitVRLittleEndian, ExplicitVRBigEndian})


def encode_dataset(ds: Dataset) -> bytes:
    """Encode as a DICOM Part 10 file; datasets without SOP identity are written as-is.

    The common case is written directly (preamble, meta, data set): ``dcmwrite`` deep-copies the
    file meta and re-validates it, which costs as much as the whole de-identification pass. Still-raw
    elements are copied as they were read. Deflated and unusual syntaxes go through ``dcmwrite``."""
    problem = pixel_encoding_problem(ds)
    if problem is not None:  # never write a file that names a compression it does not have
        raise DeidError(f"cannot encode the de-identified object: {problem}")
    meta = getattr(ds, "file_meta", None)
    tsyntax = meta.get("TransferSyntaxUID") if meta is not None else None
    try:
        fast = tsyntax is not None and (tsyntax in _FAST_SYNTAXES or (tsyntax.is_compressed and not tsyntax.is_deflated))
    except ValueError:
        fast = False
    if fast and meta is not None and tsyntax is not None and "SOPClassUID" in ds \
            and "MediaStorageSOPInstanceUID" in meta:
        try:
            fp = DicomBytesIO()
            fp.write(b"\x00" * 128 + b"DICM")
            write_file_meta_info(fp, meta, enforce_standard=True)
            implicit = tsyntax == ImplicitVRLittleEndian
            fp.is_implicit_VR, fp.is_little_endian = implicit, tsyntax != ExplicitVRBigEndian
            pixels = ds._dict.get(BaseTag(TAG_PIXEL_DATA))
            if pixels is not None and not pixels.is_raw:
                # re-encoded pixels (masking/cleaning): the length form follows the transfer syntax
                cast(DataElement, pixels).is_undefined_length = tsyntax.is_compressed
            if ds.original_encoding == (implicit, True) and fp.is_little_endian:
                write_dataset_le(fp, ds, implicit)
            else:
                if TAG_PIXEL_DATA in ds:
                    ds[TAG_PIXEL_DATA].is_undefined_length = tsyntax.is_compressed
                write_dataset(fp, ds)
            return fp.getvalue()
        except Exception:  # fall back to the general writer (it reports its own errors)
            pass
    buf = io.BytesIO()
    try:
        pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    except (ValueError, AttributeError):
        buf = io.BytesIO()
        try:
            pydicom.dcmwrite(buf, ds)
        except Exception as exc:
            raise DeidError(f"cannot encode the de-identified object ({type(exc).__name__})") from None
    except Exception as exc:
        raise DeidError(f"cannot encode the de-identified object ({type(exc).__name__})") from None
    return buf.getvalue()

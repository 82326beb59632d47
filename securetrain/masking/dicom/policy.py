"""De-identification policy files (``policies/dicom-*.yaml``), validated with pydantic.

Environment overrides use the prefix ``SECURETRAIN_DEID_POLICY__`` (e.g.
``SECURETRAIN_DEID_POLICY__BURNED_IN_ANNOTATION=mask``) so that unrelated ``SECURETRAIN_*``
variables, such as the key in ``SECURETRAIN_DEID_KEY``, never reach the policy model.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import cached_property
from typing import Literal

import rfc8785
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from securetrain.config.loader import load_model
from securetrain.masking.dicom.profile_table import SIMPLE_ACTIONS, Option
from securetrain.resources import resolve_policy

POLICY_ENV_PREFIX = "SECURETRAIN_DEID_POLICY__"
# Birth dates that, kept beside the study dates, give a patient's age back.
_BIRTH_DATE_TAGS = {0x00100030: "PatientBirthDate", 0x00100033: "PatientBirthDateInAlternativeCalendar"}
_ENCAPSULATED_DOCUMENT = 0x00420011
_TAG_RE = re.compile(r"^\(?\s*([0-9A-Fa-f]{4})\s*,?\s*([0-9A-Fa-f]{4})\s*\)?$")


def parse_tag(text: str | int) -> int:
    """``"(0010,0010)"``, ``"00100010"``, ``"0010,0010"``, a keyword like ``"PatientName"`` or an int."""
    if isinstance(text, int):
        return text
    m = _TAG_RE.match(str(text).strip())
    if m:
        return int(m.group(1) + m.group(2), 16)
    from pydicom.datadict import tag_for_keyword

    tag = tag_for_keyword(str(text).strip())
    if tag is None:
        raise ValueError(f"{text!r} is neither a tag like (0010,0010) nor a DICOM keyword")
    return int(tag)


def _hex_int(value: object, bits: int) -> int:
    if isinstance(value, int):
        out = value
    elif isinstance(value, str):
        out = int(value, 16)
    else:
        raise ValueError("expected a hex string like '0029' or an int")
    if not 0 <= out < (1 << bits):
        raise ValueError(f"out of range for {bits} bits")
    return out


class SafePrivateEntry(BaseModel):
    """Private attributes kept by Retain Safe Private: (group, creator, element byte)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    creator: str = Field(min_length=1, max_length=64)
    group: int
    elements: tuple[int, ...] = Field(min_length=1)

    @field_validator("group", mode="before")
    @classmethod
    def _group(cls, v: object) -> int:
        g = _hex_int(v, 16)
        if g % 2 == 0:
            raise ValueError("private groups are odd")
        return g

    @field_validator("elements", mode="before")
    @classmethod
    def _elements(cls, v: object) -> tuple[int, ...]:
        if not isinstance(v, list | tuple):
            raise ValueError("expected a list of element bytes like ['10', '20']")
        return tuple(_hex_int(e, 8) for e in v)


class PixelMask(BaseModel):
    """Rectangles (x0, y0, x1, y1; x1/y1 exclusive) zeroed by Clean Pixel Data, when the image matches."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    modality: str | None = None
    rows: int | None = Field(default=None, ge=1)
    columns: int | None = Field(default=None, ge=1)
    rects: tuple[tuple[int, int, int, int], ...] = Field(min_length=1)

    @field_validator("rects")
    @classmethod
    def _rects(cls, v: tuple[tuple[int, int, int, int], ...]) -> tuple[tuple[int, int, int, int], ...]:
        for x0, y0, x1, y1 in v:
            if x0 < 0 or y0 < 0 or x1 <= x0 or y1 <= y0:
                raise ValueError(f"rectangle {(x0, y0, x1, y1)} must satisfy 0 <= x0 < x1 and 0 <= y0 < y1")
        return v

    def matches(self, modality: str, rows: int, columns: int) -> bool:
        return (
            (self.modality is None or self.modality.upper() == modality.upper())
            and (self.rows is None or self.rows == rows)
            and (self.columns is None or self.columns == columns)
        )


class KnownRegion(BaseModel):
    """A CTP-style known place of burned-in text: rectangles masked without OCR on every image
    whose Manufacturer / ManufacturerModelName (case-insensitive substring, as in CTP's
    ``containsIgnoreCase``), Rows and Columns match. At least one selector is required."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    manufacturer: str | None = Field(default=None, min_length=1)
    manufacturer_model_name: str | None = Field(default=None, min_length=1)
    rows: int | None = Field(default=None, ge=1)
    columns: int | None = Field(default=None, ge=1)
    # Why this region is masked (e.g. "patient banner"); written into the output's record.
    label: str = Field(default="", max_length=24, pattern=r"^[A-Za-z0-9 ._/-]*$")
    rects: tuple[tuple[int, int, int, int], ...] = Field(min_length=1)

    @field_validator("rects")
    @classmethod
    def _rects(cls, v: tuple[tuple[int, int, int, int], ...]) -> tuple[tuple[int, int, int, int], ...]:
        for x0, y0, x1, y1 in v:
            if x0 < 0 or y0 < 0 or x1 <= x0 or y1 <= y0:
                raise ValueError(f"rectangle {(x0, y0, x1, y1)} must satisfy 0 <= x0 < x1 and 0 <= y0 < y1")
        return v

    @model_validator(mode="after")
    def _selective(self) -> KnownRegion:
        if self.manufacturer is None and self.manufacturer_model_name is None and self.rows is None and self.columns is None:
            raise ValueError("a known region needs at least one of manufacturer, manufacturer_model_name, rows, columns")
        return self

    def matches(self, manufacturer: str, model: str, rows: int, columns: int) -> bool:
        return (
            (self.manufacturer is None or self.manufacturer.casefold() in manufacturer.casefold())
            and (self.manufacturer_model_name is None or self.manufacturer_model_name.casefold() in model.casefold())
            and (self.rows is None or self.rows == rows)
            and (self.columns is None or self.columns == columns)
        )


class BurnedInOcr(BaseModel):
    """Settings of ``burned_in: clean`` (OCR with Tesseract)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    language: str = Field(default="eng", pattern=r"^[a-z_]{3,16}(\+[a-z_]{3,16})*$")
    # Pixels added on every side of each text box before masking (anti-aliasing, OCR box slack).
    margin: int = Field(default=4, ge=0, le=64)
    # An OCR word counts as text when it has this many letters/digits at this confidence (0-100).
    min_confidence: float = Field(default=40.0, ge=0, le=100)
    min_alnum: int = Field(default=3, ge=1, le=16)
    # Gray levels (of the 8-bit view) a stroke must rise above its surroundings to be a candidate.
    min_contrast: int = Field(default=30, ge=5, le=200)
    # Also OCR each whole frame and its inverse in every pass (about twice the time; catches, and
    # in the last pass refuses, text that the line candidates miss).
    full_frame: bool = True
    # Files with more frames (after dropping identical ones) are refused: OCR would take too long.
    max_frames: int = Field(default=64, ge=1, le=10000)
    # Refuse when the masks would cover more than this fraction of the image: nothing useful is left.
    max_masked_fraction: float = Field(default=0.5, gt=0, le=1)
    # Mask, re-OCR and mask again up to this many times before the final verifying OCR.
    rounds: int = Field(default=3, ge=1, le=5)
    # Also OCR (and clean) files that declare Burned In Annotation NO when their modality, or the
    # one their SOP class stands for, is in burned_in_modalities: the flag is the writer's claim, and
    # some devices and secondary-capture tools set NO on frames that carry text.
    verify_declared_no: bool = False


class DicomPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy_version: Literal[1]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    profile: Literal["basic"]
    options: tuple[Option, ...] = ()
    overrides: dict[str, str] = Field(default_factory=dict)
    burned_in_annotation: Literal["reject", "mask"] = "reject"
    # What to do with files flagged or suspected of burned-in text: refuse them (default), remove
    # the text (OCR + known_regions, verified by a second OCR) or pass them on still flagged.
    burned_in: Literal["reject", "clean", "allow-flagged"] = "reject"
    known_regions: tuple[KnownRegion, ...] = ()
    burned_in_ocr: BurnedInOcr = Field(default_factory=BurnedInOcr)
    # Modalities treated as burned-in when BurnedInAnnotation (0028,0301) is absent (also matched
    # by the modality an SC/US/VL/XA/XRF SOP class stands for, see pixels.py). XA and RF are in:
    # angiography and fluoroscopy systems routinely burn the patient's name, ID and date into
    # stored runs and last-image-hold captures; a site whose devices never do drops them here.
    burned_in_modalities: tuple[str, ...] = ("US", "SC", "OT", "XC", "ES", "GM", "SM", "DOC", "XA", "RF")
    safe_private: tuple[SafePrivateEntry, ...] = ()
    pixel_masks: tuple[PixelMask, ...] = ()
    max_date_shift_days: int = Field(default=3650, ge=1, le=36500)
    # Redact, from every retained text value, any value the profile removed elsewhere in the
    # same object (e.g. the patient's name typed into a retained private-free description).
    scrub_retained_text: bool = True
    # Attributes missing from Table E.1-1: PN -> emptied, DA/DT -> dates rule, UI -> remapped.
    vr_safety_net: bool = True
    # Every output carries a pseudonymous PatientID derived from the object's patient identity:
    # its PatientID, else its PatientName + PatientBirthDate. An object with neither is refused
    # (``reject``, MissingPatientIdentityError) or, with ``study``, its study is one pseudonymous
    # patient (identity = its original Study Instance UID; refused when that is absent too).
    missing_patient_identity: Literal["reject", "study"] = "reject"
    # PatientID / PatientName inside sequence items (other patients of a group scan, other IDs,
    # referenced patients, kept sequences at any depth): each gets the pseudonym of its *own*
    # identity (the item's PatientID, else its PatientName + PatientBirthDate), never the object's
    # patient's; or is emptied / removed. A policy override of the tag wins at every depth.
    nested_patient_identity: Literal["pseudonymise", "empty", "remove"] = "pseudonymise"
    # Retained Age Strings (AS: Patient's Age, Selector AS Value, at any depth) above 89 years are
    # written as the one category 090Y (HIPAA Safe Harbor); a retained AS value that is not an age
    # is emptied. ``keep`` is PS3.15's Retain Patient Characteristics as the standard has it.
    age_over_89: Literal["aggregate", "keep"] = "aggregate"
    # Objects with an Encapsulated Document (0042,0011) -- PDF, CDA, STL/OBJ/MTL -- or of an
    # encapsulated-document SOP class: the document's own text can name the patient and nothing
    # here cleans it. ``reject`` refuses the object (EncapsulatedDocumentError, a policy rejection);
    # ``remove`` writes it with an empty document and Encapsulated Document Length 0; ``keep`` copies
    # the document unchanged (only for documents known to carry no personal data).
    encapsulated_documents: Literal["reject", "remove", "keep"] = "reject"

    @field_validator("options")
    @classmethod
    def _unique_options(cls, v: tuple[Option, ...]) -> tuple[Option, ...]:
        if len(set(v)) != len(v):
            raise ValueError("options are listed more than once")
        return tuple(sorted(v, key=lambda o: o.value))

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, v: dict[str, str]) -> dict[str, str]:
        for key, action in v.items():
            parse_tag(key)
            if str(action).upper() not in SIMPLE_ACTIONS:
                raise ValueError(f"override for {key!r}: action {action!r} is not one of {sorted(SIMPLE_ACTIONS)}")
        return {k: str(a).upper() for k, a in v.items()}

    @model_validator(mode="after")
    def _consistent(self) -> DicomPolicy:
        opts = set(self.options)
        if {Option.RETAIN_LONGITUDINAL_FULL_DATES, Option.RETAIN_LONGITUDINAL_MODIFIED_DATES} <= opts:
            raise ValueError(
                "options: retain_longitudinal_full_dates and retain_longitudinal_modified_dates exclude each other"
            )
        if self.burned_in_annotation == "mask" and not (Option.CLEAN_PIXEL_DATA in opts and self.pixel_masks):
            raise ValueError("burned_in_annotation: 'mask' needs option clean_pixel_data and at least one pixel_masks entry")
        if self.burned_in != "reject" and self.burned_in_annotation == "mask":
            raise ValueError("burned_in_annotation: 'mask' is the older spelling of known masks; with burned_in: "
                             f"{self.burned_in} leave it at 'reject' (use known_regions / pixel_masks instead)")
        if self.known_regions and self.burned_in != "clean":
            raise ValueError("known_regions: only used with burned_in: clean")
        if self.pixel_masks and Option.CLEAN_PIXEL_DATA not in opts:
            raise ValueError("pixel_masks: given but option clean_pixel_data is not selected")
        if self.safe_private and Option.RETAIN_SAFE_PRIVATE not in opts:
            raise ValueError("safe_private: given but option retain_safe_private is not selected")
        if self.age_over_89 == "aggregate":
            self._refuse_retained_birth_dates()
        if any(parse_tag(key) == _ENCAPSULATED_DOCUMENT for key in self.overrides):
            raise ValueError("overrides: EncapsulatedDocument (0042,0011) is decided by encapsulated_documents "
                             "(reject | remove | keep), not by an override")
        return self

    def _refuse_retained_birth_dates(self) -> None:
        """A birth date kept (K) or shifted (C: the study dates move by the same offset) gives the
        exact age back, so it would undo the 090Y category."""
        for key, action in self.overrides.items():
            tag = parse_tag(key)
            if tag in _BIRTH_DATE_TAGS and action in ("K", "C"):
                raise ValueError(
                    f"age_over_89: aggregate cannot hold while overrides keep {_BIRTH_DATE_TAGS[tag]} ({action}): "
                    "a retained birth date reveals ages over 89; drop the override or set age_over_89: keep"
                )

    @property
    def option_values(self) -> frozenset[str]:
        return frozenset(o.value for o in self.options)

    @cached_property
    def override_tags(self) -> dict[int, str]:
        return {parse_tag(k): a for k, a in self.overrides.items()}

    @property
    def version(self) -> str:
        """The policy format version (``policy_version``), as the :class:`securetrain.policy.Policy` protocol names it."""
        return str(self.policy_version)

    @cached_property
    def digest(self) -> str:
        """sha256 of the RFC 8785 canonical JSON of the policy: what the audit log records."""
        return hashlib.sha256(rfc8785.dumps(self.model_dump(mode="json"))).hexdigest()

    @property
    def safe_private_set(self) -> frozenset[tuple[int, str, int]]:
        return frozenset((e.group, e.creator.strip(), el) for e in self.safe_private for el in e.elements)


def load_policy(name_or_path: str | os.PathLike[str] | None = None, *, data: dict | None = None) -> DicomPolicy:
    """Load and validate a policy by path or shipped name (``"dicom-basic"``).

    Any problem is one ``ConfigError`` naming the field."""
    path = None if name_or_path is None else resolve_policy(name_or_path)
    return load_model(DicomPolicy, path, data=data, env_prefix=POLICY_ENV_PREFIX)

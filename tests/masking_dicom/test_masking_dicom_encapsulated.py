"""Encapsulated documents (PDF, CDA, STL/OBJ/MTL; (0042,0011) Encapsulated Document): the document's
own text can name the patient and no metadata de-identification cleans it. Policy
``encapsulated_documents``: ``reject`` (default) refuses the object as a policy rejection;
``remove`` writes it with an empty document and a length of 0; ``keep`` copies the document as is
(docs/dicom-deid.md, "Encapsulated documents")."""

from __future__ import annotations

import io
from pathlib import Path

import pydicom
import pytest
from dicom_fixtures import PDF_WITH_PHI, POLICY_DIR, SECRET, make_dataset, make_encapsulated_pdf, roundtrip
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence

from securetrain.errors import ConfigError
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import EncapsulatedDocumentError
from securetrain.masking.dicom.policy import load_policy
from securetrain.masking.dicom.tree import FileOutcome, deidentify_tree

BASIC = POLICY_DIR / "dicom-basic.yaml"
LONGITUDINAL = POLICY_DIR / "dicom-research-longitudinal.yaml"
CDA = "1.2.840.10008.5.1.4.1.1.104.2"
TAG_DOCUMENT = 0x00420011
TAG_DOCUMENT_LENGTH = 0x00420015


def _deid(policy: Path = BASIC, **update: object) -> Deidentifier:
    data = load_policy(policy).model_dump(mode="json")
    return Deidentifier(load_policy(data={**data, **update}), SECRET)


@pytest.mark.parametrize("policy", [BASIC, LONGITUDINAL])
def test_encapsulated_pdf_is_rejected_by_default(policy: Path) -> None:
    with pytest.raises(EncapsulatedDocumentError) as exc:
        _deid(policy).deidentify_dataset(roundtrip(make_encapsulated_pdf()))
    message = str(exc.value)
    assert "Encapsulated PDF Storage" in message and "encapsulated_documents" in message
    assert "QUIRINIUS" not in message and "PID-7734" not in message  # never a value
    assert load_policy(data={"policy_version": 1, "name": "t", "profile": "basic"}).encapsulated_documents == "reject"


def test_encapsulated_sop_class_without_a_document_is_rejected_too() -> None:
    ds = make_encapsulated_pdf(sop_class=CDA)
    del ds.EncapsulatedDocument
    with pytest.raises(EncapsulatedDocumentError, match="Encapsulated CDA Storage"):
        _deid().deidentify_dataset(roundtrip(ds))


def _with_nested_document() -> Dataset:
    """An image whose referenced-series item carries a PDF (with its length), two levels down."""
    ds = make_dataset()
    item = Dataset()
    item.EncapsulatedDocument = PDF_WITH_PHI + b"\x00" * (len(PDF_WITH_PHI) % 2)
    item.EncapsulatedDocumentLength = len(PDF_WITH_PHI)
    ds.ReferencedImageSequence[0].ReferencedSeriesSequence = Sequence([item])
    return ds


def test_a_document_nested_in_a_sequence_is_rejected() -> None:
    """Fail closed wherever it is: the walk meets (0042,0011) at any depth."""
    ds = _with_nested_document()
    with pytest.raises(EncapsulatedDocumentError):
        _deid().deidentify_dataset(roundtrip(ds))


def test_folder_run_reports_it_rejected_and_writes_nothing(tmp_path: Path) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    pydicom.dcmwrite(src / "letter.dcm", make_encapsulated_pdf(), enforce_file_format=True)
    report = deidentify_tree(src, out, load_policy(BASIC), SECRET)
    (result,) = report.results
    assert result.outcome == FileOutcome.REJECTED and "encapsulated_documents" in (result.reason or "")
    assert report.quarantined == 0  # the policy working, not a data problem: the run does not fail
    assert not list(out.rglob("*.dcm"))


def test_pipeline_shard_records_the_rejection_reason(tmp_path: Path) -> None:
    from securetrain.pipeline.tasks.dicom_shards import ShardSpec, run_shard

    src = tmp_path / "letter.dcm"
    pydicom.dcmwrite(src, make_encapsulated_pdf(), enforce_file_format=True)
    (tmp_path / "out").mkdir()
    result = run_shard(ShardSpec(index=0, rows=((0, str(src)),)), tmp_path / "out", BASIC, SECRET)
    (row,) = result.rows
    assert (row.outcome, row.reason) == ("rejected", "encapsulated_document")


def test_remove_writes_an_empty_document_with_length_zero() -> None:
    out, report = _deid(encapsulated_documents="remove").deidentify_dataset(roundtrip(make_encapsulated_pdf()))
    blob = encode_dataset(out)
    assert b"QUIRINIUS" not in blob and b"%PDF" not in blob
    back = pydicom.dcmread(io.BytesIO(blob))
    assert back[TAG_DOCUMENT].value in (b"", None)
    assert back.EncapsulatedDocumentLength == 0  # was the old document's length
    assert back.MIMETypeOfEncapsulatedDocument == "application/pdf"  # names a format, kept
    assert any(c.tag == TAG_DOCUMENT and c.action == "Z" for c in report.changes)


def test_remove_empties_nested_documents_and_their_lengths() -> None:
    ds = _with_nested_document()
    out, _ = _deid(encapsulated_documents="remove").deidentify_dataset(roundtrip(ds))
    back = roundtrip(out)
    nested = back.ReferencedImageSequence[0].ReferencedSeriesSequence[0]
    assert nested[TAG_DOCUMENT].value in (b"", None) and nested.EncapsulatedDocumentLength == 0


def test_keep_copies_the_document_and_its_length() -> None:
    out, _ = _deid(encapsulated_documents="keep").deidentify_dataset(roundtrip(make_encapsulated_pdf()))
    back = roundtrip(out)
    assert back.EncapsulatedDocument.rstrip(b"\x00") == PDF_WITH_PHI.rstrip(b"\x00")
    assert back.EncapsulatedDocumentLength == len(PDF_WITH_PHI)
    assert back.PatientName != "QUIRINIUS^BARTHOLOMEW"  # the header is de-identified as usual


@pytest.mark.parametrize("action", ["K", "X", "D"])
def test_an_override_of_the_document_is_refused(action: str) -> None:
    """One knob decides the document: an override would bypass the rejection (K) or contradict it."""
    with pytest.raises(ConfigError) as exc:
        load_policy(data={"policy_version": 1, "name": "t", "profile": "basic",
                          "overrides": {"EncapsulatedDocument": action}})
    assert "encapsulated_documents" in str(exc.value)

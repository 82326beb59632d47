"""deidentify_tree (the library behind `securetrain deid`) and the batch-fsync writer."""

from __future__ import annotations

import os
from pathlib import Path

import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.masking.dicom.output import BatchWriter
from securetrain.masking.dicom.policy import load_policy
from securetrain.masking.dicom.tree import FileOutcome, deidentify_tree

BASIC = load_policy(POLICY_DIR / "dicom-basic.yaml")


@pytest.mark.parametrize("workers", [1, 2])
def test_tree_outcomes_reasons_and_audit(synthetic_set: Path, tmp_path: Path, workers: int) -> None:
    import shutil

    src = tmp_path / "in"
    shutil.copytree(synthetic_set.parent, src)  # the session fixture stays untouched
    (src / "junk.dcm").write_bytes(b"not dicom" * 20)
    audit = MemoryAuditRecorder()
    report = deidentify_tree(src, tmp_path / "out", BASIC, SECRET, workers=workers, audit=audit)
    inputs = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert sorted(r.source for r in report.results) == inputs  # one result per input
    by = {o: [r for r in report.results if r.outcome == o] for o in FileOutcome}
    assert by[FileOutcome.WRITTEN] and by[FileOutcome.REJECTED] and by[FileOutcome.QUARANTINED]
    assert all(r.reason for r in by[FileOutcome.REJECTED] + by[FileOutcome.QUARANTINED])
    assert any(r.source == "junk.dcm" for r in by[FileOutcome.QUARANTINED])
    for r in by[FileOutcome.WRITTEN]:  # named by the new SOP Instance UID, not the input path
        back = pydicom.dcmread(tmp_path / "out" / r.output)
        assert back.PatientIdentityRemoved == "YES" and r.output == f"{back.SOPInstanceUID}.dcm"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(r.output for r in by[FileOutcome.WRITTEN])
    for r in by[FileOutcome.REJECTED] + by[FileOutcome.QUARANTINED]:
        assert r.output is None and r.reason.startswith(f"input #{r.index}") or "input #" not in r.reason
    actions = [e["action"] for e in audit.events]
    assert actions[0] == "deid.policy_applied"
    assert actions.count("deid.write") == len(by[FileOutcome.WRITTEN])
    for name in inputs:  # no input name in any audit event
        assert all(Path(name).name not in str(e) for e in audit.events), name
    assert actions.count("dicom.read") == len(by[FileOutcome.WRITTEN]) + len(by[FileOutcome.REJECTED])
    assert actions.count("deid.quarantine") == len(by[FileOutcome.QUARANTINED])
    assert len(set(report.pseudonyms.values())) == 3  # 3 synthetic patients


def test_tree_dry_run_writes_nothing(synthetic_set: Path, tmp_path: Path) -> None:
    report = deidentify_tree(synthetic_set.parent, tmp_path / "out", BASIC, SECRET, dry_run=True)
    assert not (tmp_path / "out").exists()
    assert report.count(FileOutcome.WOULD_WRITE) > 0 and report.count(FileOutcome.WRITTEN) == 0
    assert any(r.changes for r in report.results)


def test_batch_writer_one_fsync_per_file_plus_one_per_directory(tmp_path: Path, monkeypatch) -> None:
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    with BatchWriter(max_pending=100) as w:
        for i in range(10):
            w.write(tmp_path / "a" / f"{i}.dcm", b"x" * 10)
        assert not list((tmp_path / "a").glob("*.dcm"))  # nothing visible before the flush
    assert len(list((tmp_path / "a").glob("*.dcm"))) == 10
    assert len(calls) == 10 + 1  # not 2 per file


def test_batch_writer_abort_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with BatchWriter() as w:
            w.write(tmp_path / "x.dcm", b"data")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_copies_of_one_object_are_written_once_and_reported_as_duplicates(tmp_path: Path, workers: int) -> None:
    # With 8 inputs a chunk holds 2 (one BatchWriter): the run must not crash on the second rename of
    # one name; with 2 workers the copies are renamed in parallel.
    import io

    from dicom_fixtures import make_dataset

    src = tmp_path / "in"
    src.mkdir()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, make_dataset(), enforce_file_format=True)
    for i in range(8):
        (src / f"copy{i}.dcm").write_bytes(buf.getvalue())
    audit = MemoryAuditRecorder()
    report = deidentify_tree(src, tmp_path / "out", BASIC, SECRET, workers=workers, audit=audit)
    assert [r.outcome for r in report.results] == [FileOutcome.WRITTEN] + [FileOutcome.REJECTED] * 7
    assert all("duplicate of input #1" in (r.reason or "") for r in report.results[1:])
    assert report.written == 1 and [p.name for p in (tmp_path / "out").iterdir()] == [report.results[0].output]
    actions = [e["action"] for e in audit.events]
    assert actions.count("deid.write") == 1 and actions.count("deid.reject") == 7


@pytest.mark.parametrize("workers", [1, 2])
def test_two_different_objects_with_one_sop_instance_uid_are_both_quarantined(tmp_path: Path, workers: int) -> None:
    """Before, the later one silently replaced the earlier and both counted as written. Which is
    right cannot be told: neither is kept, and the write already recorded is withdrawn."""
    import io

    from dicom_fixtures import make_dataset

    src = tmp_path / "in"
    src.mkdir()
    for i in range(6):
        ds = make_dataset()
        if i in (1, 4):  # same SOP Instance UID as the others' first, different content
            ds.SOPInstanceUID = "1.2.826.0.1.3680043.8.498.1"
            pixels = bytearray(ds.PixelData)  # content that de-identification keeps
            pixels[0] = (pixels[0] + i) % 256
            ds.PixelData = bytes(pixels)
        else:
            ds.SOPInstanceUID = f"1.2.826.0.1.3680043.8.498.{100 + i}"
        buf = io.BytesIO()
        pydicom.dcmwrite(buf, ds, enforce_file_format=True)
        (src / f"f{i}.dcm").write_bytes(buf.getvalue())
    audit = MemoryAuditRecorder()
    report = deidentify_tree(src, tmp_path / "out", BASIC, SECRET, workers=workers, audit=audit)
    outcomes = {r.source: r.outcome for r in report.results}
    assert outcomes["f1.dcm"] == outcomes["f4.dcm"] == FileOutcome.QUARANTINED
    assert [outcomes[f"f{i}.dcm"] for i in (0, 2, 3, 5)] == [FileOutcome.WRITTEN] * 4
    assert len(list((tmp_path / "out").iterdir())) == 4 == report.written
    withdrawn = [e for e in audit.events if e["action"] == "deid.write_withdrawn"]
    assert len(withdrawn) == 1 and withdrawn[0]["details"]["index"] == 2
    assert sum(1 for e in audit.events if e["action"] == "deid.quarantine") == 2


def test_batch_writer_same_target_twice_in_one_batch(tmp_path: Path) -> None:
    writer = BatchWriter()
    writer.write(tmp_path / "x.dcm", b"first")
    writer.write(tmp_path / "x.dcm", b"second")
    assert writer.flush() == [tmp_path / "x.dcm"]
    assert (tmp_path / "x.dcm").read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.dcm"]


def _sr_with_bad_last_element() -> bytes:
    """A small object whose last element has a VR pydicom does not know and length 0: pydicom
    raises NotImplementedError when that element is first accessed."""
    import io

    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.88.33"
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = "1.2.3.4.5"
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.PatientName = "QUILLFEATHER^ROSALIND"
    ds.PatientID = "PID-88213"
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue() + b"\x10\x00\x02\x10Sd\x00\x00"  # (0010,1002), VR "Sd", length 0


def test_corrupt_element_is_a_typed_refusal_and_never_ends_the_run(tmp_path: Path) -> None:
    import io

    from dicom_fixtures import make_dataset

    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.errors import UnreadableDicomError

    src = tmp_path / "in"
    src.mkdir()
    (src / "bad.dcm").write_bytes(_sr_with_bad_last_element())
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, make_dataset(), enforce_file_format=True)
    (src / "good.dcm").write_bytes(buf.getvalue())
    with pytest.raises(UnreadableDicomError, match="corrupt"):
        Deidentifier(BASIC, SECRET).deidentify_file(src / "bad.dcm", tmp_path / "bad-out.dcm")
    assert not (tmp_path / "bad-out.dcm").exists()
    report = deidentify_tree(src, tmp_path / "out", BASIC, SECRET, workers=1)
    outcome = {r.source: r.outcome for r in report.results}
    assert outcome == {"bad.dcm": FileOutcome.QUARANTINED, "good.dcm": FileOutcome.WRITTEN}
    bad = next(r for r in report.results if r.source == "bad.dcm")
    assert "corrupt" in (bad.reason or "") and "QUILLFEATHER" not in (bad.reason or "")


def test_an_interrupt_right_after_staging_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C between closing the staged file and registering it left a stray .tmp in the output
    # (seen as a flaky interrupted `securetrain deid` run).
    from securetrain.masking.dicom import output

    real_close = os.close
    calls = {"n": 0}

    def close_then_interrupt(fd: int) -> None:
        real_close(fd)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(output.os, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt), BatchWriter(max_pending=100) as w:
        w.write(tmp_path / "a.dcm", b"first")
        w.write(tmp_path / "b.dcm", b"second")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_only_policy_refusals_are_rejected_everything_else_is_quarantined(synthetic_set: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejected = the policy refusing a file on purpose (burned-in text, no patient identity), which
    never fails a run; an object that cannot be processed (e.g. encoded) is quarantined, as in the
    pipeline's shards -- before, it was rejected, and would pass unnoticed under the exit rule."""
    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.errors import DeidError
    from securetrain.masking.dicom.tree import refusal_fails, refusal_report

    def cannot_encode(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise DeidError("cannot encode the de-identified object (ValueError)")

    monkeypatch.setattr(Deidentifier, "deidentify_file", cannot_encode)
    report = deidentify_tree(synthetic_set.parent / "p000", tmp_path / "out", BASIC, SECRET, workers=1)
    assert report.results and {r.outcome for r in report.results} == {FileOutcome.QUARANTINED}
    assert refusal_fails(report.quarantined, allow_quarantine=False)
    assert not refusal_fails(report.quarantined, allow_quarantine=True) and not refusal_fails(0, allow_quarantine=False)
    assert refusal_report(report, BASIC, allow_quarantine=False)["accepted"] is False
    assert refusal_report(report, BASIC, allow_quarantine=True)["accepted"] is True


def _with_os_metadata(src: Path) -> list[str]:
    """Add what Finder, ZIP tools and Windows leave in folders; returns their relative paths."""
    junk = [".DS_Store", "._CT1.dcm", "__MACOSX/series/._x.dcm", "__MACOSX/series/x.dcm", "sub/Thumbs.db",
            "sub/desktop.ini"]
    for rel in junk:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(b"\x00\x05\x16\x07 finder metadata" * 8)
    return junk


def test_operating_system_metadata_is_skipped_not_quarantined(synthetic_set: Path, tmp_path: Path) -> None:
    """A folder copied from a Mac (or unpacked from a ZIP made on one) carries .DS_Store, ._* and
    __MACOSX/: they used to be quarantined, so `securetrain deid` exited 65 on every such folder."""
    import shutil

    from securetrain.masking.dicom.dataset import DicomDataset

    src = tmp_path / "in"
    shutil.copytree(synthetic_set.parent, src)
    dicom_files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    junk = _with_os_metadata(src)
    report = deidentify_tree(src, tmp_path / "out", BASIC, SECRET)
    assert sorted(r.source for r in report.results) == dicom_files  # the metadata files are not inputs
    assert not any(r.source in junk for r in report.results)
    before = {r.source for r in report.results if r.outcome == FileOutcome.QUARANTINED}  # the set's manifest etc.
    (src / "notes.txt").write_text("not DICOM, not OS metadata")  # anything else is still quarantined
    report = deidentify_tree(src, tmp_path / "out2", BASIC, SECRET)
    assert {r.source for r in report.results if r.outcome == FileOutcome.QUARANTINED} - before == {"notes.txt"}
    ds = DicomDataset(src, POLICY_DIR / "dicom-basic.yaml", SECRET)
    quarantined = {q["path"] for q in ds.quarantine_report()}
    assert "notes.txt" in quarantined and not quarantined & set(junk)


def test_a_folder_of_only_os_metadata_has_no_files(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    _with_os_metadata(src)
    with pytest.raises(Exception, match="contains no files"):
        deidentify_tree(src, tmp_path / "out", BASIC, SECRET)

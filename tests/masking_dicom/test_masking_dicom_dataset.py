"""DicomDataset: de-identifies on load, stable index, quarantine, DataLoader workers, audit."""

from __future__ import annotations

import csv
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dicom_fixtures import POLICY_DIR, SECRET

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.errors import ConfigError
from securetrain.masking.dicom.dataset import DicomDataset

BASIC = POLICY_DIR / "dicom-basic.yaml"


def _with_bad_files(synthetic_set: Path, tmp_path: Path) -> Path:
    root = tmp_path / "set"
    shutil.copytree(synthetic_set.parent, root)
    (root / "notes.dcm").write_text("this is not DICOM at all")
    good = next(root.rglob("im000.dcm")).read_bytes()
    (root / "truncated.dcm").write_bytes(good[:300])
    rows = list(csv.reader((root / "manifest.csv").open()))
    rows += [["notes.dcm", "0"], ["truncated.dcm", "1"], ["missing.dcm", "1"]]
    with (root / "manifest.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    return root / "manifest.csv"


def test_items_shapes_labels_meta(synthetic_set: Path) -> None:
    audit = MemoryAuditRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=(16, 16), audit=audit)
    # 3 patients x 2 studies x 2 images; the 6 burned-in US/SC images are quarantined up front
    assert len(ds) == 12
    reasons = [q["reason"] for q in ds.quarantine_report()]
    assert len(reasons) == 6 and all("burned-in" in r for r in reasons)
    item = ds[0]
    assert item["pixels"].shape == (1, 16, 16) and item["pixels"].dtype == torch.float32
    assert float(item["pixels"].min()) >= 0.0 and float(item["pixels"].max()) <= 1.0
    assert item["label"].dtype == torch.long and item["label"].shape == ()
    meta = item["meta"]
    assert meta["PatientID"].startswith("ST") and meta["SOPInstanceUID"].startswith("2.25.")
    assert meta["StudyDate"] == ""  # basic profile: dates removed
    actions = [e["action"] for e in audit.events]
    assert actions[0] == "deid.policy_applied" and "dicom.read" in actions
    read = next(e for e in audit.events if e["action"] == "dicom.read")
    assert len(read["details"]["sha256"]) == 64 and read["resource"].startswith("sha256:")


def test_quarantine_is_deterministic_and_epoch_survives(synthetic_set: Path, tmp_path: Path) -> None:
    manifest = _with_bad_files(synthetic_set, tmp_path)
    qdir = tmp_path / "quarantine"
    a = DicomDataset(manifest, BASIC, SECRET, size=16, quarantine_dir=qdir)
    b = DicomDataset(manifest, BASIC, SECRET, size=16)
    assert len(a) == len(b) == 12 and a.items == b.items
    report = {q["path"]: q["reason"] for q in a.quarantine_report()}
    assert "not a DICOM file" in report["notes.dcm"]
    assert "truncated.dcm" in report and report["missing.dcm"] == "missing file"
    assert (qdir / next(p.name for p in qdir.iterdir() if p.name.endswith("_notes.dcm"))).exists()
    # a file corrupted after indexing is quarantined at load time and its item dropped (not
    # replaced by a neighbour: no item is seen twice in an epoch)
    victim = Path(a.items[0][0])
    victim.write_bytes(victim.read_bytes()[:400])
    assert a[0] is None
    assert a[1] is not None and a[1]["pixels"].shape == (1, 16, 16)
    rel = str(victim.relative_to(manifest.parent))
    assert [q["path"] for q in a.quarantine_report()].count(rel) == 1
    batches = [x["pixels"].shape[0] for x in a.dataloader(batch_size=4)]
    assert sum(batches) == 11
    ids = [sop for x in a.dataloader(batch_size=4) for sop in x["meta"]["SOPInstanceUID"]]
    assert len(ids) == len(set(ids)) == 11  # no duplicates
    assert [q["path"] for q in a.quarantine_report()].count(rel) == 1  # listed once, however often it fails


def test_dataloader_with_workers_and_pickling(synthetic_set: Path) -> None:
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, pin_memory=False)
    ds[0]  # populate the lazy engine; pickling must drop it
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._deid is None
    loader = ds.dataloader(batch_size=6, num_workers=2)
    assert loader.pin_memory is False
    seen = 0
    ids = set()
    for batch in loader:
        assert batch["pixels"].shape[1:] == (1, 16, 16)
        seen += batch["pixels"].shape[0]
        ids.update(batch["meta"]["PatientID"])
    assert seen == 12 and len(ids) == 3
    # same pseudonyms in the worker processes as in the parent (keyed, deterministic)
    assert ds[0]["meta"]["PatientID"] in ids


def test_folder_source_without_labels(synthetic_set: Path) -> None:
    ds = DicomDataset(synthetic_set.parent, BASIC, SECRET, size=8)
    assert "label" not in ds[0]
    names = {q["path"] for q in ds.quarantine_report()}
    assert {"manifest.csv", "phi.json"} <= names  # non-DICOM files are quarantined, not crashed on


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        DicomDataset(tmp_path / "nope", BASIC, SECRET)
    bad = tmp_path / "m.csv"
    bad.write_text("file,label\nx.dcm,1\n")
    with pytest.raises(ConfigError, match="path"):
        DicomDataset(bad, BASIC, SECRET)
    bad.write_text("path,label\nx.dcm,one\n")
    with pytest.raises(ConfigError, match="label"):
        DicomDataset(bad, BASIC, SECRET)
    with pytest.raises(ConfigError):
        DicomDataset(tmp_path, BASIC, b"weak")


@pytest.mark.slow
def test_pydicom_testdata_folder_is_quarantined_not_crashed(tmp_path: Path) -> None:
    from pydicom.data import get_testdata_files

    root = tmp_path / "pd"
    root.mkdir()
    files = [f for f in sorted(get_testdata_files()) if Path(f).is_file()][:80]
    for i, f in enumerate(files):
        shutil.copy(f, root / f"{i:03d}_{Path(f).name}")
    ds = DicomDataset(root, BASIC, SECRET, size=8)
    assert len(ds) + len(ds.quarantine_report()) == len(files)
    assert len(ds) > 20 and len(ds.quarantine_report()) > 5
    bad = set()
    for i in range(len(ds)):
        item = ds[i]
        if item is None:  # failed at load time: dropped and quarantined, never raised
            bad.add(ds._rel(ds.items[i][0]))
        else:
            assert item["pixels"].shape == (1, 8, 8)
    report = [q["path"] for q in ds.quarantine_report()]
    assert bad <= set(report) and len(report) == len(set(report))


class _BatchRecorder(MemoryAuditRecorder):
    """Records like MemoryAuditRecorder, and remembers each append_many batch (optionally failing it)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.fail = fail

    def append_many(self, events: list) -> list:
        if self.fail:
            raise RuntimeError("audit database unavailable")
        self.batches.append(len(events))
        for action, resource, outcome, details in events:
            self.record(action, resource, outcome=outcome, details=details)
        return []


def test_a_batch_records_its_reads_in_one_append_before_returning(synthetic_set: Path) -> None:
    audit = _BatchRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=audit)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0)
    batches = list(loader)
    assert sum(len(b["label"]) for b in batches) == len(ds) == 12
    assert audit.batches == [4, 4, 4]  # one transaction per batch, not one per file
    reads = [e for e in audit.events if e["action"] == "dicom.read"]
    assert len(reads) == 12 and len({e["details"]["sha256"] for e in reads}) == 12
    # A single item (no batch) is still recorded at once.
    single = _BatchRecorder()
    fresh = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=single)
    before = len(single.events)
    fresh[0]
    assert [e["action"] for e in single.events[before:]] == ["dicom.read"] and single.batches == [1]


def test_a_batch_is_not_returned_when_its_reads_cannot_be_recorded(synthetic_set: Path) -> None:
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=_BatchRecorder(fail=True))
    with pytest.raises(RuntimeError, match="audit database unavailable"):
        ds.__getitems__([0, 1, 2])  # fail closed: no data leaves the dataset unaudited


def test_a_corrupt_header_element_is_quarantined_at_index_time(tmp_path: Path) -> None:
    # pydicom parses lazily: an element with an unknown VR fails only when read. A corrupt Rescale
    # Slope must quarantine its file ("corrupt headers" are quarantined up front), not end __init__.
    import io

    import pydicom
    from dicom_fixtures import make_dataset

    ds = make_dataset()
    ds.RescaleSlope = "1.5"
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    good = buf.getvalue()
    at = good.find(b"\x28\x00\x53\x10DS\x04\x00")  # (0028,1053) DS, length 4
    assert at > 0
    bad = good[:at + 4] + b"Sd\x00\x00" + good[at + 12:]  # unknown VR "Sd", length 0
    (tmp_path / "a-good.dcm").write_bytes(good)
    (tmp_path / "b-bad.dcm").write_bytes(bad)
    dataset = DicomDataset(tmp_path, BASIC, SECRET)
    assert len(dataset) == 1 and dataset[0] is not None
    [entry] = dataset.quarantine_report()
    assert entry["path"] == "b-bad.dcm" and "corrupt" in entry["reason"]


def test_every_epoch_records_its_reads_also_from_the_cached_header(synthetic_set: Path) -> None:
    """A cached de-identified header does not make a later load unaudited: the file is read again
    (its pixels leave the dataset again), so each epoch records each file's read. Before, only the
    first load in a process was recorded: with num_workers=0 or persistent workers, epochs 2+ left
    no trace."""
    audit = MemoryAuditRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=audit)
    loader = ds.dataloader(batch_size=4, num_workers=0)
    for _ in range(3):
        for _batch in loader:
            pass
    reads = [e for e in audit.events if e["action"] == "dicom.read"]
    assert len(reads) == 3 * len(ds)
    per_file = {}
    for e in reads:
        per_file[e["details"]["sha256"]] = per_file.get(e["details"]["sha256"], 0) + 1
    assert set(per_file.values()) == {3}


def test_persistent_workers_record_every_epoch_in_the_audit_log(synthetic_set: Path, tmp_path: Path) -> None:
    from securetrain.audit.keys import create_signing_key
    from securetrain.audit.log import AuditLog

    key = tmp_path / "audit.pem"
    create_signing_key(key)
    log = AuditLog(f"sqlite:///{tmp_path}/audit.db", signing_key=key, checkpoint_every=None)
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=log)
    loader = ds.dataloader(batch_size=4, num_workers=1, persistent_workers=True)
    for _ in range(3):
        for _batch in loader:
            pass
    del loader
    reads = [e for e in log.entries() if e.action == "dicom.read"]
    assert len(reads) == 3 * len(ds)
    assert log.verify().ok
    log.close()


def test_a_file_changed_after_its_header_was_cached_is_de_identified_again(synthetic_set: Path) -> None:
    """The cache is keyed by the file's content: a file replaced between epochs (same path) is read,
    recorded with its new digest and de-identified again, never served under a stale header."""
    import pydicom

    audit = MemoryAuditRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=audit)
    first = ds[0]
    path = ds.items[0][0]
    d = pydicom.dcmread(path)
    assert first["meta"]["Modality"] != "OT"
    d.Modality = "OT"
    d.save_as(path)
    again = ds[0]
    reads = [e["details"]["sha256"] for e in audit.events if e["action"] == "dicom.read"]
    assert len(reads) == 2 and reads[0] != reads[1]
    assert again["meta"]["Modality"] == "OT"  # the new file's header, not the cached one


class _GatedRecorder(_BatchRecorder):
    """append_many signals that it started, then waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def append_many(self, events: list) -> list:
        self.started.set()
        assert self.release.wait(10), "never released"
        return super().append_many(events)


def test_a_batch_is_decoded_while_its_reads_are_committed(synthetic_set: Path) -> None:
    """The batch's append (a database commit) overlaps de-identifying and decoding its files, so its
    wait is hidden rather than added; before, every file was decoded first, then the append ran."""
    audit = _GatedRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=audit)
    deid = ds._deidentifier()
    original = deid.deidentify_dataset
    overlapped: list[bool] = []

    def deidentify_while_appending(d):  # noqa: ANN001, ANN202
        overlapped.append(audit.started.wait(5))  # the append is already under way
        audit.release.set()
        return original(d)

    deid.deidentify_dataset = deidentify_while_appending
    items = ds.__getitems__([0, 1, 2, 3])
    assert len(items) == 4 and overlapped and all(overlapped)
    assert audit.batches == [4]


def test_no_item_leaves_before_its_batch_append_has_returned(synthetic_set: Path) -> None:
    audit = _GatedRecorder()
    ds = DicomDataset(synthetic_set, BASIC, SECRET, size=16, audit=audit)
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(ds.__getitems__([0, 1, 2])))
    worker.start()
    assert audit.started.wait(10)
    time.sleep(0.5)  # everything else of the batch is done by now
    assert worker.is_alive() and not out, "the batch was returned before its reads were recorded"
    audit.release.set()
    worker.join(10)
    assert len(out[0]) == 3 and audit.batches == [3]


@pytest.mark.parametrize("photometric,bits", [("YBR_FULL", 16), ("YBR_FULL_422", 16), ("YBR_PARTIAL_422", 8)])
def test_colour_that_cannot_become_rgb_is_quarantined_at_index_time_naming_it(
        tmp_path: Path, photometric: str, bits: int) -> None:
    """pydicom converts only 8-bit YBR_FULL / YBR_FULL_422 to RGB: other YBR files are quarantined
    when indexed with a reason that names the colour space and says what to do (a 16-bit YBR_FULL
    file failed at load time as 'cannot decode pixel data (ValueError)')."""
    from dicom_fixtures import make_dataset

    def colour(pi: str, width: int, name: str) -> None:
        ds = make_dataset()
        ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, pi, 0
        ds.BitsAllocated = ds.BitsStored = width
        ds.HighBit = width - 1
        ds.PixelData = bytes(8 * 8 * 3 * width // 8)
        ds.save_as(tmp_path / name, enforce_file_format=True)

    colour("YBR_FULL", 8, "a-good.dcm")
    colour(photometric, bits, "b-ybr.dcm")
    dataset = DicomDataset(tmp_path, BASIC, SECRET, color_mode="rgb")
    assert len(dataset) == 1 and dataset[0]["pixels"].shape == (3, 8, 8)
    [entry] = dataset.quarantine_report()
    assert entry["path"] == "b-ybr.dcm"
    assert f"{photometric} colour pixel data ({bits}-bit)" in entry["reason"]
    assert "8-bit YBR_FULL" in entry["reason"] and "convert" in entry["reason"] and "RGB" in entry["reason"]


def test_allow_flagged_policy_keeps_flagged_files_in_the_index(synthetic_set: Path) -> None:
    """`burned_in: allow-flagged` passes flagged/suspected objects on (as `securetrain deid` writes
    them); the index used to quarantine them all the same, so a pipeline under that policy lost every
    file de-identification had just written for it."""
    import yaml

    from securetrain.masking.dicom.policy import load_policy

    allow = load_policy(data={**yaml.safe_load(BASIC.read_text()), "burned_in": "allow-flagged"})
    ds = DicomDataset(synthetic_set, allow, SECRET, size=(16, 16))
    assert len(ds) == 18 and ds.quarantine_report() == [] and ds.excluded_files == ()
    assert all(ds[i] is not None for i in range(len(ds)))  # the de-identifier passes them under this policy
    strict = DicomDataset(synthetic_set, BASIC, SECRET, size=(16, 16))  # reject: still quarantined up front
    assert len(strict) == 12 and len(strict.excluded_files) == 6
    assert all("burned-in" in e["reason"] for e in strict.excluded_files)


def test_files_that_can_never_load_are_quarantined_at_index_time_with_the_reason(tmp_path: Path) -> None:
    """Each of these passed the header-only index and then failed on every load, dropped mid-epoch
    as `cannot decode pixel data (RuntimeError / AttributeError / ValueError)`: 12-bit JPEG Extended
    (pydicom's JPGExtended.dcm: Pillow and GDCM decode 8-bit samples only), image attributes without
    Pixel Data (pydicom's chrKoreanMulti.dcm), and a file cut inside its Pixel Data (MR_truncated.dcm)."""
    import io

    import pydicom
    from dicom_fixtures import make_dataset
    from pydicom.data import get_testdata_file

    ds = make_dataset()
    ds.Rows, ds.Columns = 64, 64
    ds.PixelData = bytes(range(256)) * 32  # 64 x 64 x 16 bits
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    good = buf.getvalue()
    (tmp_path / "a-good.dcm").write_bytes(good)
    (tmp_path / "b-cut.dcm").write_bytes(good[:-3000])
    del ds.PixelData
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    (tmp_path / "c-no-pixels.dcm").write_bytes(buf.getvalue())
    jpeg12 = pydicom.dcmread(get_testdata_file("JPGExtended.dcm"))
    jpeg12.Modality = "CT"  # neither a modality nor a SOP class the policy suspects of burned-in text
    jpeg12.SOPClassUID = jpeg12.file_meta.MediaStorageSOPClassUID = pydicom.uid.CTImageStorage
    jpeg12.save_as(tmp_path / "d-jpeg12.dcm", enforce_file_format=True)

    dataset = DicomDataset(tmp_path, BASIC, SECRET)
    assert [Path(p).name for p, _ in dataset.items] == ["a-good.dcm"]
    reasons = {e["path"]: e["reason"] for e in dataset.excluded_files}
    assert reasons["b-cut.dcm"] == "element (7FE0,0010) holds 5192 of 8192 bytes (truncated file?)"
    assert reasons["c-no-pixels.dcm"] == "image attributes but no pixel data (truncated file?)"
    assert reasons["d-jpeg12.dcm"].startswith("12-bit JPEG Extended pixel data: no installed decoder reads it")
    assert dataset[0] is not None and len(dataset.quarantine_report()) == 3


def test_a_stream_that_fails_to_decode_is_quarantined_naming_its_transfer_syntax(tmp_path: Path) -> None:
    """A decoder is installed but the stream is corrupt (pydicom's
    JPEG2000-embedded-sequence-delimiter.dcm): found only on load, the reason now says which syntax
    failed instead of a bare `cannot decode pixel data (RuntimeError)`."""
    from dicom_fixtures import make_dataset
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEG2000Lossless

    ds = make_dataset()
    ds.file_meta.TransferSyntaxUID = JPEG2000Lossless
    ds.PixelData = encapsulate([b"\xff\x4f\xff\x51" + b"\x00" * 60])  # a J2K codestream cut after SIZ
    ds["PixelData"].VR = "OB"
    ds.save_as(tmp_path / "j2k.dcm", enforce_file_format=True)
    dataset = DicomDataset(tmp_path, BASIC, SECRET)
    assert len(dataset) == 1 and dataset[0] is None
    [entry] = dataset.quarantine_report()
    assert entry == {"path": "j2k.dcm", "reason": "cannot decode pixel data (JPEG 2000 Image Compression (Lossless Only): "
                                                  "RuntimeError)"}

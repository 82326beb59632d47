"""`securetrain deid`: writes de-identified trees, dry-run shows tags not values, workers, mapping."""

from __future__ import annotations

import os
from pathlib import Path

import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET
from typer.testing import CliRunner

from securetrain.cli.main import app
from securetrain.masking.dicom.errors import DeidKeyError
from securetrain.masking.dicom.mapping import load_mapping

BASIC = str(POLICY_DIR / "dicom-basic.yaml")


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    p = tmp_path / "deid.key"
    p.write_text(SECRET.hex())
    return p


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)


def test_deid_tree_with_workers_and_mapping(synthetic_set: Path, tmp_path: Path, key_file: Path) -> None:
    mkey = tmp_path / "map.key"
    mkey.write_bytes(os.urandom(32))
    out = tmp_path / "out"
    res = _run("deid", str(synthetic_set.parent), str(out), "--policy", BASIC, "--key-file", str(key_file),
               "--workers", "2", "--mapping-out", str(tmp_path / "map.bin"), "--mapping-key-file", str(mkey))
    assert res.exit_code == 65, res.output  # partial output: refusals are not success
    written = sorted(out.rglob("*.dcm"))
    assert len(written) == 12  # 6 burned-in images rejected, manifest/phi.json quarantined
    assert "rejected" in res.output and "quarantined" in res.output
    assert f"8 of 20 input files not written (6 rejected, 2 quarantined); report: {out}.quarantine.json" in \
        res.output.replace("\n", "")
    ds = pydicom.dcmread(written[0])
    assert ds.PatientIdentityRemoved == "YES"
    mapping = load_mapping(tmp_path / "map.bin", mkey.read_bytes())
    assert len(set(mapping.values())) == 3
    assert ds.PatientID in mapping.values()
    # the same secret from the environment gives identical output
    out2 = tmp_path / "out2"
    res2 = _run("deid", str(synthetic_set.parent), str(out2), "--policy", BASIC, "--allow-quarantine",
                env={"SECURETRAIN_DEID_KEY": SECRET.hex()})
    assert res2.exit_code == 0, res2.output
    assert (out2 / written[0].relative_to(out)).read_bytes() == written[0].read_bytes()


def test_dry_run_writes_nothing_and_shows_no_values(synthetic_set: Path, tmp_path: Path, key_file: Path) -> None:
    from securetrain.masking.dicom.synthetic import load_phi_manifest

    out = tmp_path / "dry"
    res = _run("deid", str(synthetic_set.parent), str(out), "--policy", BASIC, "--key-file", str(key_file), "--dry-run")
    assert res.exit_code == 65, res.output  # the real run would be partial: the dry run says so
    assert "would not be written" in res.output and "dry run: no report written" in res.output
    assert not out.exists() and not (tmp_path / "dry.quarantine.json").exists()
    assert "PatientName" in res.output and "(0010,0010)" in res.output
    planted = load_phi_manifest(synthetic_set)["all"]
    flat = res.output.replace("\n", "")
    for v in planted["text"] + planted["uids"]:
        if len(v) >= 6:
            assert v not in flat


def test_missing_key_and_bad_policy(synthetic_set: Path, tmp_path: Path, key_file: Path) -> None:
    res = _run("deid", str(synthetic_set.parent), str(tmp_path / "o"), "--policy", BASIC,
               env={"SECURETRAIN_DEID_KEY": ""})
    assert isinstance(res.exception, DeidKeyError)
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy_version: 1\nname: x\nprofile: basic\noptions: [nope]\n")
    res = _run("deid", str(synthetic_set.parent), str(tmp_path / "o"), "--policy", str(bad), "--key-file", str(key_file))
    assert res.exception is not None and "options" in str(res.exception)
    res = _run("deid", str(synthetic_set.parent), str(synthetic_set.parent / "inside"), "--policy", BASIC,
               "--key-file", str(key_file))
    assert res.exception is not None and "inside IN" in str(res.exception)


def _mixed_input(tmp_path: Path) -> Path:
    """Two good images, a text file and a truncated image (both quarantined)."""
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "gen", n_patients=1, studies_per_patient=1, images_per_series=2)
    src = tmp_path / "in"
    src.mkdir()
    images = sorted(manifest.parent.rglob("*.dcm"))
    for i, f in enumerate(images):
        (src / f"SMITH_JOHN_{i}.dcm").write_bytes(f.read_bytes())  # names may carry PHI
    (src / "SMITH_JOHN_notes.txt").write_text("not DICOM")
    (src / "SMITH_JOHN_cut.dcm").write_bytes(images[0].read_bytes()[:400])
    return src


def test_refused_inputs_exit_65_with_the_count_and_the_report_unless_accepted(tmp_path: Path, key_file: Path) -> None:
    """Before: exit 0 whatever was quarantined, so a scheduler took a partial run for success."""
    import json
    import stat

    src, out = _mixed_input(tmp_path), tmp_path / "out"
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file))
    assert res.exit_code == 65, res.output
    report_path = tmp_path / "out.quarantine.json"
    text = res.output.replace("\n", "")
    assert f"2 of 4 input files not written (0 rejected, 2 quarantined); report: {report_path}" in text
    assert "--allow-quarantine" in text
    assert len(list(out.glob("*.dcm"))) == 2  # the good files are still written
    assert stat.S_IMODE(report_path.stat().st_mode) == 0o600
    raw = report_path.read_text()
    assert "SMITH" not in raw  # inputs by index and digest, never by name
    report = json.loads(raw)
    assert report["format"] == "securetrain.deid.refusals/1" and report["accepted"] is False
    assert (report["files"], report["written"], report["rejected"], report["quarantined"]) == (4, 2, 0, 2)
    assert [(r["index"], r["outcome"]) for r in report["refused"]] == [(3, "quarantined"), (4, "quarantined")]
    assert all(len(r["sha256"]) == 64 and r["reason"] and "input #" not in r["reason"] for r in report["refused"])
    # accepted partial output: exit 0, the report says it was accepted
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file), "--allow-quarantine")
    assert res.exit_code == 0, res.output
    assert "partial output accepted" in res.output
    assert json.loads(report_path.read_text())["accepted"] is True
    # a report elsewhere; a later clean run removes the stale one next to OUT
    custom = tmp_path / "reports" / "run1.json"
    res = _run("deid", str(src), str(tmp_path / "out2"), "--policy", BASIC, "--key-file", str(key_file),
               "--quarantine-report", str(custom))
    assert res.exit_code == 65 and custom.is_file() and str(custom) in res.output.replace("\n", "")
    for bad in ("SMITH_JOHN_notes.txt", "SMITH_JOHN_cut.dcm"):
        (src / bad).unlink()
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file))
    assert res.exit_code == 0, res.output
    assert not report_path.exists()


def _rejected_only_input(tmp_path: Path) -> Path:
    """Two good images, two burned-in ones and one without a patient identity: all three refused by
    the policy on purpose (rejected); nothing unreadable."""
    from dicom_fixtures import make_dataset

    from securetrain.masking.dicom.engine import encode_dataset
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "in", n_patients=1, studies_per_patient=1, images_per_series=2,
                                  include_burned_in=True)
    manifest.unlink()
    (manifest.parent / "phi.json").unlink()  # only DICOM files in the folder
    ds = make_dataset()
    del ds.PatientID
    del ds.PatientName  # no patient identity: rejected by the policy
    (manifest.parent / "noid.dcm").write_bytes(encode_dataset(ds))
    return manifest.parent


def _colour_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's stdout console, with ANSI colours (CliRunner's stdout is no terminal)."""
    from securetrain.cli import console as console_module

    monkeypatch.setattr(console_module, "console", console_module._Console(force_terminal=True, color_system="standard",
                                                                           width=400))


def test_rejected_inputs_alone_exit_0_with_the_report_and_a_yellow_line(tmp_path: Path, key_file: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: exit 65 whenever the policy rejected a file (burned-in ultrasound is routine), so every
    scheduled run failed and users reached for --allow-quarantine, which also hides unreadable files."""
    import json
    import re
    import stat

    src, out = _rejected_only_input(tmp_path), tmp_path / "out"
    _colour_console(monkeypatch)
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file))
    assert res.exit_code == 0, res.output
    report_path = tmp_path / "out.quarantine.json"
    line = next(x for x in res.output.splitlines() if "rejected by the policy" in x)
    assert "\x1b[33m" in line  # yellow: rejections are never silent
    plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
    assert f"3 of 5 input files not written (3 rejected, 0 quarantined); report: {report_path}" in plain
    assert "incomplete" not in res.output and len(list(out.glob("*.dcm"))) == 2
    assert stat.S_IMODE(report_path.stat().st_mode) == 0o600
    report = json.loads(report_path.read_text())
    assert report["format"] == "securetrain.deid.refusals/1"
    assert report["accepted"] is True  # accepted: no quarantined files
    assert (report["files"], report["written"], report["rejected"], report["quarantined"]) == (5, 2, 3, 0)
    assert {r["outcome"] for r in report["refused"]} == {"rejected"}
    assert all(len(r["sha256"]) == 64 and r["reason"] for r in report["refused"])
    # a dry run exits the same way: 0, the count, no report
    res = _run("deid", str(src), str(tmp_path / "dry"), "--policy", BASIC, "--key-file", str(key_file), "--dry-run")
    assert res.exit_code == 0, res.output
    assert "3 of 5 input files would not be written (3 rejected, 0 quarantined); dry run: no report written" in \
        re.sub(r"\x1b\[[0-9;]*m", "", res.output).replace("\n", "")
    assert not (tmp_path / "dry.quarantine.json").exists()


def test_rejected_and_quarantined_inputs_exit_65_naming_both_counts(tmp_path: Path, key_file: Path) -> None:
    import json

    src, out = _rejected_only_input(tmp_path), tmp_path / "out"
    (src / "scan-notes.txt").write_text("not DICOM")  # quarantined
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file))
    assert res.exit_code == 65, res.output
    report_path = tmp_path / "out.quarantine.json"
    text = res.output.replace("\n", "")
    assert f"4 of 6 input files not written (3 rejected, 1 quarantined); report: {report_path}" in text
    assert "quarantined files could not be processed" in text and "--allow-quarantine" in text
    report = json.loads(report_path.read_text())
    assert (report["rejected"], report["quarantined"], report["accepted"]) == (3, 1, False)
    # accepted: exit 0, the report says the quarantined files were accepted
    res = _run("deid", str(src), str(out), "--policy", BASIC, "--key-file", str(key_file), "--allow-quarantine")
    assert res.exit_code == 0, res.output
    assert "partial output accepted (--allow-quarantine)" in res.output
    assert "4 of 6 input files not written (3 rejected, 1 quarantined)" in res.output.replace("\n", "")
    assert json.loads(report_path.read_text())["accepted"] is True

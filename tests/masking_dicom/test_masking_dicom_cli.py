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
    assert res.exit_code == 0, res.output
    written = sorted(out.rglob("*.dcm"))
    assert len(written) == 12  # 6 burned-in images rejected, manifest/phi.json quarantined
    assert "rejected" in res.output and "quarantined" in res.output
    ds = pydicom.dcmread(written[0])
    assert ds.PatientIdentityRemoved == "YES"
    mapping = load_mapping(tmp_path / "map.bin", mkey.read_bytes())
    assert len(set(mapping.values())) == 3
    assert ds.PatientID in mapping.values()
    # the same secret from the environment gives identical output
    out2 = tmp_path / "out2"
    res2 = _run("deid", str(synthetic_set.parent), str(out2), "--policy", BASIC,
                env={"SECURETRAIN_DEID_KEY": SECRET.hex()})
    assert res2.exit_code == 0, res2.output
    assert (out2 / written[0].relative_to(out)).read_bytes() == written[0].read_bytes()


def test_dry_run_writes_nothing_and_shows_no_values(synthetic_set: Path, tmp_path: Path, key_file: Path) -> None:
    from securetrain.masking.dicom.synthetic import load_phi_manifest

    out = tmp_path / "dry"
    res = _run("deid", str(synthetic_set.parent), str(out), "--policy", BASIC, "--key-file", str(key_file), "--dry-run")
    assert res.exit_code == 0, res.output
    assert not out.exists()
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

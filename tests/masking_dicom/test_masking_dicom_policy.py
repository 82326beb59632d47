"""Policy files: the shipped ones load; every kind of invalid policy is one ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from dicom_fixtures import POLICY_DIR

from securetrain.errors import ConfigError
from securetrain.masking.dicom.policy import load_policy, parse_tag
from securetrain.masking.dicom.profile_table import Option

BASE = {"policy_version": 1, "name": "t", "profile": "basic", "options": []}


def test_shipped_policies_load() -> None:
    files = sorted(POLICY_DIR.glob("dicom-*.yaml"))
    assert {f.name for f in files} >= {"dicom-basic.yaml", "dicom-research-longitudinal.yaml"}
    for f in files:
        pol = load_policy(f)
        assert pol.profile == "basic" and len(pol.digest) == 64
    research = load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml")
    assert Option.RETAIN_LONGITUDINAL_MODIFIED_DATES in research.options
    assert Option.RETAIN_PATIENT_CHARACTERISTICS in research.options
    assert load_policy(POLICY_DIR / "dicom-basic.yaml").options == ()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"options": ["retain_everything"]}, "options"),
        ({"options": ["retain_longitudinal_full_dates", "retain_longitudinal_modified_dates"]}, "options"),
        ({"options": ["retain_uids", "retain_uids"]}, "options"),
        ({"profile": "extended"}, "profile"),
        ({"policy_version": 2}, "policy_version"),
        ({"overrides": {"(0010,00ZZ)": "X"}}, "overrides"),
        ({"overrides": {"NotAKeyword": "X"}}, "overrides"),
        ({"overrides": {"PatientName": "X/Z"}}, "overrides"),
        ({"burned_in_annotation": "ignore"}, "burned_in_annotation"),
        ({"burned_in_annotation": "mask"}, "burned_in_annotation"),
        ({"pixel_masks": [{"rects": [[0, 0, 4, 4]]}]}, "pixel_masks"),
        ({"options": ["clean_pixel_data"], "pixel_masks": [{"rects": [[5, 0, 4, 4]]}]}, "pixel_masks"),
        ({"safe_private": [{"creator": "X", "group": "0029", "elements": ["10"]}]}, "safe_private"),
        ({"options": ["retain_safe_private"], "safe_private": [{"creator": "X", "group": "0028", "elements": ["10"]}]},
         "safe_private"),
        ({"max_date_shift_days": 0}, "max_date_shift_days"),
        ({"colour": "blue"}, "colour"),
        ({"name": "bad name/../"}, "name"),
    ],
)
def test_invalid_policy_names_the_field(change: dict, field: str) -> None:
    data = {**BASE, **change}
    with pytest.raises(ConfigError) as exc:
        load_policy(data=data)
    assert field in str(exc.value)


def test_policy_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy_version: [1\n")
    with pytest.raises(ConfigError):
        load_policy(bad)


def test_env_override_uses_its_own_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DEID_KEY", "00" * 32)  # must not leak into the policy model
    monkeypatch.setenv("SECURETRAIN_DEID_POLICY__MAX_DATE_SHIFT_DAYS", "30")
    pol = load_policy(POLICY_DIR / "dicom-basic.yaml")
    assert pol.max_date_shift_days == 30


def test_digest_changes_with_content() -> None:
    a = load_policy(data=BASE)
    b = load_policy(data={**BASE, "options": ["retain_uids"]})
    assert a.digest != b.digest and a.digest == load_policy(data=BASE).digest


def test_parse_tag() -> None:
    assert parse_tag("(0010,0010)") == 0x00100010 == parse_tag("00100010") == parse_tag("PatientName")
    assert parse_tag("0008,103e") == 0x0008103E


def test_documented_example_policy_loads() -> None:
    import re

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert block is not None
    pol = load_policy(data=yaml.safe_load(block.group(1)))
    assert (0x0029, "SIEMENS CSA HEADER", 0x08) in pol.safe_private_set
    assert pol.pixel_masks[0].matches("US", 600, 800)

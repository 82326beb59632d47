"""Policy loading/validation: invalid policies are one ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.errors import ConfigError
from securetrain.masking.tabular.policy import GeneralizeRule, MaskingPolicy, load_policy

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "policies" / "finance-pii.yaml"


def test_shipped_policy_loads_and_has_no_default() -> None:
    p = load_policy(POLICY)
    assert p.name == "finance-pii" and p.policy_version
    assert p.default is None  # fail closed
    assert p.rule_for("customer_name").action == "tokenize"
    assert p.rule_for("card_number").action == "pan"
    assert p.rule_for("backup_card_number").action == "pan"  # glob
    assert p.rule_for("some_new_column") is None
    assert len(p.digest) == 64 and p.digest == load_policy(POLICY).digest


def test_exact_name_beats_pattern() -> None:
    p = load_policy(data={"policy_version": "1", "columns": [
        {"glob": "*id", "action": "drop"}, {"name": "customer_id", "action": "tokenize"}]})
    assert p.rule_for("customer_id").action == "tokenize"
    assert p.rule_for("other_id").action == "drop"


def test_env_cannot_weaken_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DEFAULT__ACTION", "keep")
    monkeypatch.setenv("SECURETRAIN_TRAINING__EPOCHS", "3")  # another capability's override is ignored too
    assert load_policy(POLICY).default is None


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"columns": []}, "policy_version"),
        ({"policy_version": "1", "columns": [{"name": "a", "action": "shred"}]}, "columns.0"),
        ({"policy_version": "1", "columns": [{"name": "a", "glob": "b", "action": "drop"}]}, "exactly one"),
        ({"policy_version": "1", "columns": [{"action": "drop"}]}, "exactly one"),
        ({"policy_version": "1", "columns": [{"regex": "(", "action": "drop"}]}, "invalid regex"),
        ({"policy_version": "1", "columns": [{"name": "a", "action": "generalize", "bins": [5, 1]}]}, "increasing"),
        ({"policy_version": "1", "columns": [{"name": "a", "action": "generalize"}]}, "exactly one of 'granularity'"),
        ({"policy_version": "1", "columns": [{"name": "a", "action": "tokenize", "length": 3}]}, "length"),
        ({"policy_version": "1", "columns": [{"name": "a", "action": "drop"}, {"name": "a", "action": "keep"}]},
         "more than once"),
        ({"policy_version": "1", "default": {"action": "tokenize"}}, "default.action"),
        ({"policy_version": "1", "detectors": {"on_detect": "ignore"}}, "detectors.on_detect"),
        ({"policy_version": "1", "surprise": True}, "surprise"),
    ],
)
def test_invalid_policies(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        load_policy(data=data)
    assert needle in str(info.value)


def test_invalid_yaml_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("policy_version: [unclosed\n")
    with pytest.raises(ConfigError):
        load_policy(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_policy(tmp_path / "missing.yaml")


def test_digest_changes_with_content() -> None:
    a = MaskingPolicy(policy_version="1", columns=[GeneralizeRule(name="x", action="generalize", bins=[0, 1])])
    b = MaskingPolicy(policy_version="1", columns=[GeneralizeRule(name="x", action="generalize", bins=[0, 2])])
    assert a.digest != b.digest

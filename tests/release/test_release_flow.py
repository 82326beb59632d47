"""The Prefect flow's optional release step stops at "awaiting approval" (pause/suspend) instead of
failing, and releases once approvals arrive; other failures end the step as "refused"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opacus", reason="the shared run trains with DP ([privacy] extra)")

from release_fixtures import approver, copy_run, policy, train_run  # noqa: E402

pytestmark = pytest.mark.slow


def test_release_step_pauses_awaiting_approval_then_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect.flow_runs
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from flows.secure_training import release_with_approval
    from securetrain.release.gate import approve, load_run

    (tmp_path / "train").mkdir()
    run = copy_run(train_run(tmp_path / "train"), tmp_path)
    key, _ = approver(tmp_path / "approvers", "alice")
    pol = policy(tmp_path / "approvers", ["alice"], required=1)
    strict = policy(tmp_path / "approvers", ["alice"], required=1, max_epsilon=0.1, file="strict.yaml")
    config = load_run(run)
    config = config.model_copy(update={"release": config.release.model_copy(update={"policy": pol})})
    pauses: list[dict[str, Any]] = []

    def fake_pause(**kwargs: Any) -> None:  # the approver acts while the flow run is paused
        pauses.append(kwargs)
        approve(run, key, policy_path=pol)

    monkeypatch.setattr(prefect.flow_runs, "pause_flow_run", fake_pause)

    @flow
    def release_only(cfg: Any) -> dict[str, Any]:
        return release_with_approval(cfg)

    with prefect_test_harness(server_startup_timeout=240):
        outcome = release_only(config)
        assert outcome["status"] == "released" and len(pauses) == 1
        assert pauses[0]["timeout"] == config.release.approval_timeout_s
        assert (run / "release" / "model.safetensors").is_file()
        refused_cfg = config.model_copy(update={"release": config.release.model_copy(
            update={"policy": strict, "export_to": tmp_path / "never" / "m.safetensors"})})
        refused = release_only(refused_cfg)
        assert refused["status"] == "refused" and len(pauses) == 1  # no pause for a condition approvals cannot fix
        assert not (tmp_path / "never").exists()

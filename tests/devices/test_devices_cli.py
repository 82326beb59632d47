"""``securetrain devices``: rich table and ``--json``."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from securetrain.cli.main import app


def test_devices_json() -> None:
    r = CliRunner().invoke(app, ["devices", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    by_name = {b["name"]: b for b in data["backends"]}
    assert {"cpu", "cuda", "br"} <= set(by_name)
    assert sum(b["auto"] for b in data["backends"]) == 1 and by_name[data["auto"]]["auto"]
    cpu = by_name["cpu"]
    assert cpu["available"] and cpu["collective_backend"] == "gloo" and cpu["batch_multiple"] == 1
    assert by_name["br"]["batch_multiple"] == 128 and by_name["cuda"]["batch_multiple"] == 8
    if not torch.cuda.is_available():
        assert data["auto"] == "cpu" and not by_name["cuda"]["available"] and by_name["cuda"]["reason"]


def test_devices_table() -> None:
    r = CliRunner().invoke(app, ["devices"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "auto resolves to" in r.output and "gloo" in r.output and "128" in r.output


def test_devices_lists_a_broken_plugin_as_unavailable() -> None:
    from securetrain.devices import register_backend, unregister_backend

    def broken(index: int):  # type: ignore[no-untyped-def]
        raise RuntimeError("vendor runtime missing")

    register_backend("broken_cli_test", broken)
    try:
        r = CliRunner().invoke(app, ["devices", "--json"])
        assert r.exit_code == 0, r.output
        by_name = {b["name"]: b for b in json.loads(r.output)["backends"]}
        assert not by_name["broken_cli_test"]["available"]
        assert "vendor runtime missing" in by_name["broken_cli_test"]["reason"] and by_name["cpu"]["available"]
        r = CliRunner().invoke(app, ["devices"], env={"COLUMNS": "160"})
        assert r.exit_code == 0 and "broken_cli_test" in r.output, r.output
    finally:
        unregister_backend("broken_cli_test")

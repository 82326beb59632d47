"""`securetrain` prints no traceback for any bad input: one error line (or a usage error), exit 1/2.

Each case runs the real console entry point in a fresh process with a bad path, file, key, config
or value, the way an operator would mistype it (issue 17: 48 cases gave 4 tracebacks before).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "policies" / "dicom-basic.yaml")
FIN = str(ROOT / "policies" / "finance-pii.yaml")
PASS = "a long enough passphrase"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "empty").mkdir()
    (d / "garbage.bin").write_bytes(b"\x00garbage\xff" * 50)
    (d / "empty.txt").write_text("")
    (d / "text.txt").write_text("hello")
    (d / "bad.yaml").write_text("name: [unclosed\n")
    (d / "badfield.yaml").write_text("name: x\ntraining: {epochs: -3}\n")
    (d / "badpolicy.yaml").write_text("name: x\nrules: 7\n")
    (d / "in").mkdir()
    (d / "in" / "a.dcm").write_bytes(b"not dicom")
    (d / "table.csv").write_text("a,b\n1,2\n")
    (d / "table.xlsx").write_text("nope")
    for name, text in (("typo.key", "ab" * 31 + "a"), ("good.key", "ab" * 32)):
        (d / name).write_text(text)
        (d / name).chmod(0o600)
    (d / "ro").mkdir()
    return d


def _cases() -> list[tuple[str, list[str], dict[str, str]]]:
    S = "{s}"
    deid_key = ["--key-file", f"{S}/good.key"]
    return [
        ("deid-missing-input", ["deid", f"{S}/nope", f"{S}/out1", "-p", POLICY, *deid_key], {}),
        ("deid-empty-folder", ["deid", f"{S}/empty", f"{S}/out2", "-p", POLICY, *deid_key], {}),
        ("deid-missing-policy", ["deid", f"{S}/in", f"{S}/out3", "-p", f"{S}/nope.yaml", *deid_key], {}),
        ("deid-garbage-policy", ["deid", f"{S}/in", f"{S}/out4", "-p", f"{S}/bad.yaml", *deid_key], {}),
        ("deid-invalid-policy", ["deid", f"{S}/in", f"{S}/out5", "-p", f"{S}/badpolicy.yaml", *deid_key], {}),
        ("deid-no-key", ["deid", f"{S}/in", f"{S}/out6", "-p", POLICY], {}),
        ("deid-missing-key-file", ["deid", f"{S}/in", f"{S}/out7", "-p", POLICY, "--key-file", f"{S}/nope.key"], {}),
        ("deid-key-typo", ["deid", f"{S}/in", f"{S}/out8", "-p", POLICY, "--key-file", f"{S}/typo.key"], {}),
        ("deid-env-key-typo", ["deid", f"{S}/in", f"{S}/out9", "-p", POLICY], {"SECURETRAIN_DEID_KEY": "xyz"}),
        ("deid-out-inside-in", ["deid", f"{S}/in", f"{S}/in/out", "-p", POLICY, *deid_key], {}),
        ("deid-workers-zero", ["deid", f"{S}/in", f"{S}/out10", "-p", POLICY, *deid_key, "-j", "0"], {}),
        ("deid-bad-audit-url", ["deid", f"{S}/in", f"{S}/out11", "-p", POLICY, *deid_key, "--audit-db",
                                "postgresql://u:pw@127.0.0.1:1/none"], {}),
        ("mask-missing-src", ["mask", f"{S}/nope.csv", f"{S}/o.csv", "-p", FIN], {"SECURETRAIN_MASK_KEY": "ab" * 32}),
        ("mask-bad-extension", ["mask", f"{S}/table.xlsx", f"{S}/o.csv", "-p", FIN], {"SECURETRAIN_MASK_KEY": "ab" * 32}),
        ("mask-unknown-columns", ["mask", f"{S}/table.csv", f"{S}/o.csv", "-p", FIN], {"SECURETRAIN_MASK_KEY": "ab" * 32}),
        ("mask-no-key", ["mask", f"{S}/table.csv", f"{S}/o.csv", "-p", FIN], {}),
        ("mask-key-typo", ["mask", f"{S}/table.csv", f"{S}/o.csv", "-p", FIN], {"SECURETRAIN_MASK_KEY": "ab" * 31}),
        ("mask-garbage-policy", ["mask", f"{S}/table.csv", f"{S}/o.csv", "-p", f"{S}/bad.yaml"],
         {"SECURETRAIN_MASK_KEY": "ab" * 32}),
        ("run-missing-config", ["run", f"{S}/nope.yaml", "--no-prefect"], {}),
        ("run-garbage-config", ["run", f"{S}/bad.yaml", "--no-prefect"], {}),
        ("run-invalid-field", ["run", f"{S}/badfield.yaml", "--no-prefect"], {}),
        ("run-binary-config", ["run", f"{S}/garbage.bin", "--no-prefect"], {}),
        ("run-env-override-bad", ["run", str(ROOT / "examples" / "demo.yaml"), "--no-prefect"],
         {"SECURETRAIN_TRAINING__EPOCHS": "many"}),
        ("ckpt-inspect-missing", ["checkpoint", "inspect", f"{S}/nope.stenc"], {}),
        ("ckpt-inspect-garbage", ["checkpoint", "inspect", f"{S}/garbage.bin"], {}),
        ("ckpt-inspect-empty", ["checkpoint", "inspect", f"{S}/empty.txt"], {}),
        ("ckpt-verify-garbage", ["checkpoint", "verify", "--keyring", f"{S}/garbage.bin", f"{S}/garbage.bin"],
         {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("ckpt-decrypt-no-keyring", ["checkpoint", "decrypt", f"{S}/garbage.bin", f"{S}/o.bin"], {}),
        ("ckpt-encrypt-missing-src", ["checkpoint", "encrypt", f"{S}/nope", f"{S}/o.stenc", "--keyring",
                                      f"{S}/nokr.json"], {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("keys-init-short-pass", ["keys", "init", "--keyring", f"{S}/kr1.json"], {"SECURETRAIN_KEYRING_PASSPHRASE": "x"}),
        ("keys-list-missing", ["keys", "list", "--keyring", f"{S}/nope.json"], {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("keys-list-garbage", ["keys", "list", "--keyring", f"{S}/garbage.bin"], {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("keys-list-text", ["keys", "list", "--keyring", f"{S}/text.txt"], {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("keys-init-into-dir", ["keys", "init", "--keyring", f"{S}/empty"], {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("keys-rotate-missing", ["keys", "rotate", "--keyring", f"{S}/nope.json", "--rewrap", f"{S}/nope"],
         {"SECURETRAIN_KEYRING_PASSPHRASE": PASS}),
        ("audit-verify-missing", ["audit", "verify", "--db", f"{S}/nope.db"], {}),
        ("audit-verify-garbage", ["audit", "verify", "--db", f"{S}/garbage.bin"], {}),
        ("audit-show-text", ["audit", "show", "--db", f"{S}/text.txt"], {}),
        ("audit-bad-url", ["audit", "verify", "--db", "postgresql://u:pw@127.0.0.1:1/none"], {}),
        ("he-plan-missing", ["he", "plan", "--model", f"{S}/nope.safetensors"], {}),
        ("he-plan-garbage", ["he", "plan", "--model", f"{S}/garbage.bin"], {}),
        ("train-bad-device", ["train", "--device", "nope", "--max-steps", "1", "-o", f"{S}/tr1"], {}),
        ("train-bad-precision", ["train", "--precision", "fp7", "--max-steps", "1", "-o", f"{S}/tr2"], {}),
        ("train-output-is-file", ["train", "--max-steps", "1", "-o", f"{S}/text.txt"], {}),
        ("unknown-command", ["frobnicate"], {}),
    ]


CASES = _cases()


@pytest.mark.slow
@pytest.mark.parametrize("name,argv,extra", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_no_traceback(scratch: Path, name: str, argv: list[str],
                                                   extra: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURETRAIN_", "PREFECT_API"))}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="200", OMP_NUM_THREADS="1", **extra)
    args = [a.replace("{s}", str(scratch)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "securetrain", *args], env=env, cwd=scratch, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2), f"exit {proc.returncode}: {out[-2000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert "error" in out.lower() or "usage" in out.lower() or "invalid" in out.lower(), out[-2000:]
    assert "pw@" not in out  # a password in a URL is never echoed

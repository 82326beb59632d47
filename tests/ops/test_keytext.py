"""Keys in one explicit encoding: a typo is an error, never a different key; loose key files warned."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from securetrain.keytext import check_key_file_mode, decode_key
from securetrain.masking.dicom.errors import DeidKeyError
from securetrain.masking.dicom.keys import DeidKeys, parse_key_text
from securetrain.masking.tabular.errors import MaskKeyError

ROOT = Path(__file__).resolve().parents[2]
KEY = bytes(range(100, 132))
HEX = KEY.hex()


@pytest.mark.parametrize("text", [HEX, HEX.upper(), f"  {HEX}\n", f"hex:{HEX}", f"HEX:{HEX[:32]}",
                                  "base64:" + base64.b64encode(KEY).decode()])
def test_explicit_forms_are_accepted(text: str) -> None:
    got = decode_key(text, what="k", error=DeidKeyError)
    assert got == (KEY[:16] if HEX[:32] in text and HEX not in text.lower() else KEY)


def _one_char_typos() -> list[str]:
    out = []
    for i in range(0, 64, 7):
        out.append(HEX[:i] + "g" + HEX[i + 1:])          # a wrong character
        out.append(HEX[:i] + HEX[i + 1:])                # a dropped character
        out.append(HEX[:i] + "a" + HEX[i:])              # an extra character
    out += [HEX + "z", HEX[:-1] + "O", f"hex:{HEX[:-1]}", f"hex:{HEX}x", "base64:" + base64.b64encode(KEY).decode()[:-2],
            "base64:" + base64.b64encode(KEY).decode().replace("=", "") + "!", HEX[:32]]
    return out


@pytest.mark.parametrize("text", _one_char_typos())
def test_a_typo_is_an_error_never_raw_bytes(text: str) -> None:
    for allow_raw in (False, True):
        with pytest.raises(DeidKeyError) as info:
            decode_key(text.encode(), what="the key", error=DeidKeyError, allow_raw=allow_raw)
        assert text.strip() not in str(info.value) and HEX[:16] not in str(info.value)  # never echoed


def test_raw_key_files_only_32_non_text_bytes() -> None:
    assert parse_key_text(KEY) == KEY
    with pytest.raises(DeidKeyError):
        parse_key_text(KEY[:31])
    with pytest.raises(DeidKeyError):
        parse_key_text(KEY, hex_only=True)  # environment variables hold text
    with pytest.raises(DeidKeyError):
        parse_key_text(b"correct horse battery staple 123")  # 32 bytes of text is not a raw key
    with pytest.raises(DeidKeyError, match="empty"):
        parse_key_text(b" \n")
    with pytest.raises(DeidKeyError, match="at least 16"):
        parse_key_text(b"hex:00112233")


def test_env_typo_is_refused() -> None:
    assert DeidKeys.from_env({"SECURETRAIN_DEID_KEY": HEX}).key_id == DeidKeys.from_secret(KEY).key_id
    with pytest.raises(DeidKeyError):
        DeidKeys.from_env({"SECURETRAIN_DEID_KEY": HEX[:-1] + "x"})


def test_mask_env_typo_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.masking.tabular.cli import _load_key

    monkeypatch.setenv("SECURETRAIN_MASK_KEY", HEX)
    assert _load_key(None) == KEY
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", HEX[1:])
    with pytest.raises(MaskKeyError):
        _load_key(None)


def test_key_file_readable_by_others_is_warned(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_text(HEX)
    f.chmod(0o644)
    seen: list[str] = []
    assert check_key_file_mode(f, warn=seen.append) and "chmod 600" in seen[0]
    f.chmod(0o600)
    assert not check_key_file_mode(f, warn=seen.append) and len(seen) == 1


def test_deid_cli_typo_key_file_exits_2_and_warns_on_mode(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.dcm").write_bytes(b"not dicom")
    key = tmp_path / "k"
    key.write_text(HEX[:-1] + "\n")
    key.chmod(0o644)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SECURETRAIN_DEID_KEY", None)
    cmd = [sys.executable, "-m", "securetrain", "deid", str(tmp_path / "in"), str(tmp_path / "out"),
           "--policy", str(ROOT / "policies" / "dicom-basic.yaml"), "--key-file", str(key)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "accepted form" in proc.stderr and "Traceback" not in proc.stderr
    assert "readable by group/others" in proc.stderr
    assert HEX[:20] not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()

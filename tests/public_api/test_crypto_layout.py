"""The crypto package's layout (issue 12): container internals in the private ``_container`` package,
no ``_private`` names imported across module boundaries (anywhere in securetrain), frozen results
instead of tuples, and the deprecated ``securetrain.crypto.stream`` alias re-exporting only public names."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import securetrain.crypto as crypto
from securetrain.crypto import _container
from securetrain.crypto.checkpoint import DecryptedCheckpoint, WrittenCheckpoint, read_checkpoint, write_checkpoint
from securetrain.crypto.keys import LocalKeyring

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "securetrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str]]:
    """(imported module, imported name) for every ``from securetrain... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("securetrain"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("securetrain")]
    return found


def _private_cross_imports(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        for module, name in _imports(path):
            if name.startswith("_") and not name.startswith("__"):  # dunders (__version__) are public
                bad.append(f"{path}: from {module} import {name}")
    return bad


def test_crypto_modules_import_no_private_names_of_each_other() -> None:
    bad = _private_cross_imports(sorted((PACKAGE / "crypto").rglob("*.py")))
    # Importing the private package itself is how crypto modules reach its public helpers.
    assert [b.replace(str(ROOT), "") for b in bad if not b.endswith("from securetrain.crypto import _container")] == []


def test_no_securetrain_module_imports_a_private_name_of_another() -> None:
    bad = _private_cross_imports(sorted(PACKAGE.rglob("*.py")))
    allowed = "from securetrain.crypto import _container"  # crypto's own private subpackage
    assert [b.replace(str(ROOT), "") for b in bad if not b.endswith(allowed)] == []


def test_the_scan_finds_a_private_cross_import(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from securetrain.crypto._container.keyschedule import _hkdf\n"
                      "from securetrain.crypto import keys\n")
    assert _private_cross_imports([module]) == [f"{module}: from securetrain.crypto._container.keyschedule import _hkdf"]


def test_only_crypto_imports_the_container_internals() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "crypto") in path.parents:
            continue
        for module, name in _imports(path):
            if module.startswith("securetrain.crypto._") or (module == "securetrain.crypto" and name.startswith("_")):
                offenders.append(f"{_module_name(path)}: {module} {name}")
    assert offenders == []


def test_crypto_modules_use_the_container_package_not_its_modules() -> None:
    """Outside ``_container`` the helpers come from the package's public names (its ``__init__``)."""
    offenders = []
    for path in sorted((PACKAGE / "crypto").glob("*.py")):
        for module, _name in _imports(path):
            if module.startswith("securetrain.crypto._container."):
                offenders.append(f"{path.name}: {module}")
    assert offenders == []


def test_stream_alias_warns_and_reexports_the_public_names() -> None:
    sys.modules.pop("securetrain.crypto.stream", None)
    with pytest.warns(DeprecationWarning, match="securetrain.crypto"):
        stream = importlib.import_module("securetrain.crypto.stream")
    assert stream.__all__ and not [n for n in stream.__all__ if n.startswith("_")]
    for name in stream.__all__:
        assert getattr(stream, name) is getattr(_container, name), name
    for name in ("encrypt_file", "decrypt_file", "encrypt_stream", "decrypt_stream", "inspect_file", "rewrap_file",
                 "Header", "RewrapResult", "EncryptingWriter", "DecryptingReader"):
        assert getattr(stream, name) is getattr(crypto, name), name
    assert not hasattr(stream, "open_header") and not hasattr(stream, "_derive")


def test_stream_alias_fails_under_warnings_as_errors() -> None:
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", "import securetrain.crypto.stream"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "deprecated" in proc.stderr


def test_checkpoint_reader_and_writer_return_frozen_results() -> None:
    ring = LocalKeyring.create("k1")
    out = io.BytesIO()
    written = write_checkpoint(out, {"w": torch.arange(6.0)}, {"note": "x"}, ring, digest=True)
    assert isinstance(written, WrittenCheckpoint) and written.key_id == "k1"
    assert written.tensors_sha256 is not None and len(written.tensors_sha256) == 64
    assert written.header.total_length == len(out.getvalue())
    with pytest.raises(dataclasses.FrozenInstanceError):
        written.key_id = "k2"  # type: ignore[misc]
    loaded = read_checkpoint(io.BytesIO(out.getvalue()), ring, verify_digest=True)
    assert isinstance(loaded, DecryptedCheckpoint) and loaded.key_id == "k1" and loaded.signer is None
    assert torch.equal(loaded.tensors["w"], torch.arange(6.0)) and loaded.metadata["note"] == "x"
    assert not any(isinstance(getattr(loaded, f.name), io.IOBase) for f in dataclasses.fields(loaded))  # no live reader
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.metadata = {}  # type: ignore[misc]
    assert "tensor(" not in repr(loaded)  # tensors stay out of the repr


def test_rewrap_returns_a_frozen_result(tmp_path: Path) -> None:
    ring = LocalKeyring.create("k1")
    path = tmp_path / "f.stenc"
    path.write_bytes(crypto.encrypt_bytes(b"payload", ring))
    ring.rotate("k2")
    result = crypto.rewrap_file(path, ring)
    assert isinstance(result, crypto.RewrapResult) and dataclasses.is_dataclass(result)
    assert result.old.key_ids == ["k1"] and result.new.key_ids == ["k2"] and result.key_id == "k2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.key_id = "k1"  # type: ignore[misc]
    assert crypto.decrypt_bytes(path.read_bytes(), ring) == b"payload"

"""The public surface: every exported name resolves, errors sit under their capability's base, the
lazy exports are typed (TYPE_CHECKING block in sync), and importing a package stays cheap."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from securetrain.errors import SecureTrainError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(
    ".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "securetrain").rglob("__init__.py")
    if "__all__" in p.read_text()
)
ERROR_BASES = {
    "securetrain.crypto": "CryptoError",
    "securetrain.audit": "AuditError",
    "securetrain.training": "TrainingError",
    "securetrain.pipeline": "PipelineError",
    "securetrain.masking.dicom": "DeidError",
    "securetrain.masking.tabular": "TabularMaskingError",
    "securetrain.he": "HEError",
    "securetrain.release": "ReleaseError",
    "securetrain.devices": "DeviceError",
}


def test_the_packages_are_found() -> None:
    assert set(ERROR_BASES) <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package} exports names that do not resolve: {missing}"
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize(("package", "base"), sorted(ERROR_BASES.items()))
def test_every_exported_error_is_under_its_capability_base(package: str, base: str) -> None:
    module = importlib.import_module(package)
    root = getattr(module, base)
    errors = [getattr(module, n) for n in module.__all__ if n.endswith(("Error", "Unavailable", "Preempted"))]
    assert root in errors
    for error in errors:
        assert issubclass(error, SecureTrainError), error
        assert issubclass(error, root), f"{error.__name__} is not a {base}"


def test_type_checking_blocks_match_the_exports() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_lazy_exports.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_packages_does_not_import_torch() -> None:
    code = ("import sys\n"
            "import securetrain.crypto, securetrain.audit, securetrain.training, securetrain.pipeline, "
            "securetrain.he, securetrain.devices, securetrain.masking.dicom, securetrain.masking.tabular\n"
            "heavy = [m for m in ('torch', 'pydicom', 'pyarrow', 'tenseal') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_policies_share_one_protocol() -> None:
    from securetrain.masking.dicom import load_policy as dicom_policy
    from securetrain.masking.tabular import load_policy as table_policy
    from securetrain.policy import Policy

    for policy in (dicom_policy("dicom-basic"), table_policy("finance-pii")):
        assert isinstance(policy, Policy)
        assert policy.name and policy.version and len(policy.digest) == 64

"""Docker cannot run here, so the images are validated statically."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
SECRET_WORDS = re.compile(r"(PASSWORD|PASSPHRASE|SECRET|TOKEN|KEK|API_KEY)\s*=\s*\S", re.I)


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = path.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_both_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    froms = [rest.split()[0] for kw, rest in _instructions(dockerfile) if kw == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        name, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{image} is not pinned to a tag"
        assert re.search(r"\d+\.\d+", tag), f"{image}: tag must carry a version"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root_user(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    final_stage = instructions[max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM"):]
    users = [rest for kw, rest in final_stage if kw == "USER"]
    assert users, "final stage sets no USER"
    assert users[-1] not in {"root", "0", "0:0"}
    assert any("useradd" in rest for kw, rest in final_stage if kw == "RUN")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_secrets_baked_in(dockerfile: Path) -> None:
    for kw, rest in _instructions(dockerfile):
        if kw in {"ENV", "ARG", "LABEL"}:
            assert not SECRET_WORDS.search(rest), f"{kw} {rest} looks like a baked-in secret"
    assert "COPY docker/.env" not in dockerfile.read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_torch_pinned_to_supported_version(dockerfile: Path) -> None:
    assert re.search(r'"torch==2\.13\.0"', dockerfile.read_text())


def test_compose_services_and_no_inline_secrets() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert set(compose["services"]) == {"postgres", "prefect-server", "worker"}
    for name, service in compose["services"].items():
        image = service.get("image")
        if image:
            assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image}"
        for key, value in (service.get("environment") or {}).items():
            if key.endswith("_FILE"):  # a Compose secret: a path under /run/secrets, never the value
                assert str(value).startswith("/run/secrets/"), f"{name}.{key}"
                continue
            if re.search(r"PASSWORD|PASSPHRASE|SECRET|DEID_KEY|_KEK$", key):
                assert str(value).startswith("${"), f"{name}.{key} must come from the env file"
            if "://" in str(value) and "@" in str(value):  # credentials in a URL come from the env file
                assert re.search(r"://[^:@/]+:\$\{[A-Z_]+[^}]*\}@", str(value)), f"{name}.{key}: inline password"
    assert compose["services"]["worker"]["user"] not in {"root", "0", "0:0"}
    # Published ports bind to loopback only.
    for port in compose["services"]["prefect-server"].get("ports", []):
        assert str(port).startswith("127.0.0.1:")


def test_worker_can_run_the_prefect_yaml_deployment() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    env = compose["services"]["worker"]["environment"]
    assert env["SECURETRAIN_HOME"] == "/app"
    # The audit URL (a Compose secret) names the writer role, not the table owner.
    assert "securetrain_audit_writer" in (DOCKER / "compose.yaml").read_text()
    assert {"SECURETRAIN_DEID_KEY_FILE", "SECURETRAIN_KEYRING_PASSPHRASE_FILE", "SECURETRAIN_AUDIT_URL_FILE"} <= set(env)
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert "prefect.yaml /app/prefect.yaml" in text and "examples /app/examples" in text


def test_dockerignore_keeps_secrets_and_venv_out() -> None:
    ignored = (DOCKER.parent / ".dockerignore").read_text().split()
    assert {".venv", ".git", "docker/.env", "docker/secrets"} <= set(ignored)


def test_worker_secrets_are_compose_secrets() -> None:
    """securetrain's secrets reach the worker as files (SECURETRAIN_<X>_FILE), not environment values."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    worker = compose["services"]["worker"]
    env = worker["environment"]
    for variable in ("SECURETRAIN_AUDIT_URL", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_DEID_KEY"):
        assert variable not in env and env[f"{variable}_FILE"].startswith("/run/secrets/")
        secret = env[f"{variable}_FILE"].rsplit("/", 1)[1]
        assert secret in worker["secrets"] and compose["secrets"][secret]["file"].startswith("./secrets/")
    ignored = (DOCKER.parent / ".gitignore").read_text().splitlines()
    assert "docker/secrets/" in ignored

from __future__ import annotations

import logging
import secrets

import pytest

from securetrain.redaction import REDACTED, install_redaction, redact


_HEX_KEY = secrets.token_hex(32)
_URL_KEY = secrets.token_urlsafe(48)


@pytest.mark.parametrize(
    ("text", "forbidden"),
    [
        ("kek=" + _HEX_KEY, _HEX_KEY),
        (f"data key {_HEX_KEY} loaded", _HEX_KEY),
        (f"token {_URL_KEY}", _URL_KEY),
        ("password: hunter2-but-longer", "hunter2"),
        ("SECURETRAIN_KEYRING_PASSPHRASE=correct-horse", "correct-horse"),
        ("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA\n-----END PRIVATE KEY-----", "MC4CAQAw"),
        ("card 4111 1111 1111 1111 declined", "4111 1111"),
        ("ssn 123-45-6789", "123-45-6789"),
        ("mail jane.doe@example.org", "jane.doe"),
        ("patient DOE^JANE^Q", "DOE^JANE"),
        # pydicom quotes an invalid element's value (repr, escapes included) in its warning
        ("Invalid value for VR DA: '19700101'. Please see <https://dicom.nema.org>", "19700101"),
        ("Invalid value for VR LO: b'MRN\\'4711 JONES'. Please see", "JONES"),
    ],
)
def test_secret_shaped_text_is_redacted(text: str, forbidden: str) -> None:
    out = redact(text)
    assert REDACTED in out
    assert forbidden not in out


def test_digests_and_plain_text_survive() -> None:
    digest = "sha256:" + "ab" * 32
    text = f"checkpoint step=40 written {digest} in 0.31 s to runs/demo/ckpt-00000040.stc"
    assert redact(text) == text


def test_non_luhn_numbers_survive() -> None:
    assert redact("processed 1234567890123 rows") == "processed 1234567890123 rows"


def test_filter_redacts_args_and_exceptions(caplog: pytest.LogCaptureFixture) -> None:
    install_redaction(("securetrain.test_redaction",))
    log = logging.getLogger("securetrain.test_redaction")
    key = secrets.token_hex(32)
    with caplog.at_level(logging.INFO, logger="securetrain.test_redaction"):
        log.info("loaded key %s for run", key)
        try:
            raise ValueError(f"bad key {key}")
        except ValueError:
            log.exception("failed")
    text = caplog.text
    assert key not in text
    assert text.count(REDACTED) >= 2


def test_url_passwords_are_masked_and_the_rest_kept() -> None:
    from securetrain.redaction import mask_url

    url = "postgresql+psycopg://securetrain_audit_writer:Sup3r-S3cret@postgres:5432/securetrain"
    assert mask_url(url) == "postgresql+psycopg://securetrain_audit_writer:***@postgres:5432/securetrain"
    assert "Sup3r-S3cret" not in redact(f"audit at {url} ready")
    assert mask_url("/work/runs/demo/audit.db") == "/work/runs/demo/audit.db"
    assert mask_url("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"
    assert mask_url("http://user@host/x") == "http://user@host/x"


def test_words_around_values_survive() -> None:
    """Redact values, not the words around them (no "[REDACTED] not found: [REDACTED].json")."""
    text = "KeyringError: keyring not found: /work/runs/demo/keys/securetrain-keyring.json"
    assert redact(text) == text
    assert redact("passphrase=hunter2-xyz") == f"passphrase={REDACTED}"

"""Redact secret- and PHI-shaped text from log records before any handler sees them.

Defence in depth: securetrain never logs keys or PHI on purpose, but third-party code, exceptions
and user ``print`` calls under Prefect's ``log_prints`` could. The filter rewrites the formatted
message of every record that passes through the loggers it is installed on.

What counts as secret-shaped (documented in docs/concepts.md):
- PEM blocks (private keys, certificates);
- the password in a URL (``postgresql://user:PASSWORD@host``), shown as ``***`` (:func:`mask_url`);
- ``key=...``, ``secret: ...``, ``password=...``, ``passphrase``, ``token``, ``kek`` assignments (the
  value only: an exception name such as ``KeyringError:`` is a word, not an assignment);
- runs of 32+ hex characters or 40+ base64 characters, unless written as ``sha256:<hex>``
  (the form securetrain uses for digests, which are not secret); a file path made of lower-case
  words (``runs/demo/keys/keyring``) is not base64-shaped;
- card numbers (13-19 digits passing the Luhn check), US SSNs, e-mail addresses;
- DICOM person names (``Family^Given``);
- the element value pydicom quotes when it reads an invalid one (``Invalid value for VR DA:
  '19700101'.``): any value of any element, so any of them may be PHI.

pydicom reports such findings twice: to its ``pydicom`` logger (redacted here) and as a Python
warning printed to stderr, which no logging filter sees. :func:`install_redaction` therefore also
drops pydicom's ``UserWarning`` copies (pydicom emits every one through ``warn_and_log``, so the
logged, redacted copy remains).
"""

from __future__ import annotations

import logging
import re
import warnings

REDACTED = "[REDACTED]"

_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?-----END [A-Z0-9 ]+-----", re.S)
_ASSIGNMENT = re.compile(
    r"(?i)\b(?![\w-]*(?:error|exception|warning)\b)"
    r"([\w-]*(?:key|secret|password|passwd|passphrase|token|kek)[\w-]*)(\s*[=:]\s*)(['\"]?)[^\s'\",;]+\3"
)
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/:@]*:)([^\s/@]+)@")
_DIGEST = re.compile(r"\bsha256:[0-9a-f]{64}\b")
_HEX = re.compile(r"\b[0-9a-fA-F]{32,}\b")
_B64 = re.compile(r"(?<![A-Za-z0-9+/=])[A-Za-z0-9+/_-]{40,}={0,2}(?![A-Za-z0-9+/=])")
_CARD = re.compile(r"\b(?:\d[ -]?){12,18}\d\b")
_SSN = re.compile(r"\b\d{3}-\d{2}-\d{4}\b")
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_DICOM_PN = re.compile(r"\b[A-Za-z][\w'-]*\^[A-Za-z][\w'^-]*")
# pydicom's validation message quotes the value with repr(): '...', "..." or b'...' (escapes kept).
_PYDICOM_VALUE = re.compile(r"""(Invalid value for VR [A-Z]{2}: )b?(['"])(?:\\.|(?!\2).)*\2""", re.S)


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group(0))
    return REDACTED if 13 <= len(digits) <= 19 and _luhn_ok(digits) else match.group(0)


def mask_url(url: str) -> str:
    """``url`` with the password of its user-info replaced by ``***`` (everything else kept).

    For every URL securetrain prints or stores (console, report, result.json, Prefect results):
    ``postgresql+psycopg://writer:s3cret@db:5432/audit`` becomes
    ``postgresql+psycopg://writer:***@db:5432/audit``. Paths and URLs without a password are unchanged.
    """
    return _URL_PASSWORD.sub(r"\1***@", str(url))


def _b64_shaped(match: re.Match[str]) -> str:
    """Random base64 mixes cases and digits; a lower-case path or identifier does not."""
    s = match.group(0)
    classes = sum((any(c.islower() for c in s), any(c.isupper() for c in s), any(c.isdigit() for c in s)))
    if classes < 2 or ("/" in s and classes < 3):
        return s
    return REDACTED


def redact(text: str) -> str:
    """Return ``text`` with every secret- or PHI-shaped substring replaced by ``[REDACTED]``."""
    text = _PEM.sub(REDACTED, text)
    text = _PYDICOM_VALUE.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = mask_url(text)
    text = _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    # Protect digests from the hex/base64 rules by swapping them out first.
    digests: list[str] = []

    def _stash(m: re.Match[str]) -> str:
        digests.append(m.group(0))
        return f"\x00{len(digests) - 1}\x00"

    text = _DIGEST.sub(_stash, text)
    text = _HEX.sub(REDACTED, text)
    text = _B64.sub(_b64_shaped, text)
    text = _CARD.sub(_card, text)
    text = _SSN.sub(REDACTED, text)
    text = _EMAIL.sub(REDACTED, text)
    text = _DICOM_PN.sub(REDACTED, text)
    return re.sub(r"\x00(\d+)\x00", lambda m: digests[int(m.group(1))], text)


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the record's final message (msg % args) in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string must not leak its args either
            message = str(record.msg)
        cleaned = redact(message)
        record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            # Tracebacks can quote values; keep the type, redact the message.
            exc = record.exc_info[1]
            record.exc_text = f"{type(exc).__name__}: {redact(str(exc))}"
            record.exc_info = None
        return True


_DEFAULT_LOGGERS = ("securetrain", "prefect", "prefect.flow_runs", "prefect.task_runs", "flows")


def install_redaction(logger_names: tuple[str, ...] = _DEFAULT_LOGGERS) -> RedactingFilter:
    """Attach one shared filter to the named loggers and their existing handlers (idempotent).

    Filters on a logger only see records created by that logger, so the run loggers Prefect hands
    to tasks (``prefect.flow_runs``/``prefect.task_runs``) are named explicitly; handler filters
    also catch records propagated from child loggers.
    """
    shared = next(
        (f for f in logging.getLogger(logger_names[0]).filters if isinstance(f, RedactingFilter)),
        RedactingFilter(),
    )
    for name in logger_names:
        logger = logging.getLogger(name)
        targets = [logger, *logger.handlers]
        for target in targets:
            if not any(isinstance(f, RedactingFilter) for f in target.filters):
                target.addFilter(shared)
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(shared)
    # pydicom's warning copies go straight to stderr, unfiltered (see the module docstring).
    warnings.filterwarnings("ignore", category=UserWarning, module=r"pydicom(\.|$)")
    return shared

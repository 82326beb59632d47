"""The report parsed as HTML (not substring checks): refused files by reason as a table, key ids and
fingerprints (never keys), the demo key labelled, the resumed notice, the smoothed loss, HE metrics
explained, and the verifier's verdict for both outcomes (issue 17)."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

from securetrain.pipeline.report import write_html_report
from securetrain.pipeline.results import AuditSummary, DeidSummary, HESummary, PipelineResult, TrainingSummary

DEID_SECRET = "5e" * 32  # stands for key material that must never be rendered


class _Page(HTMLParser):
    """Tables as lists of rows of cell texts, each under the nearest preceding heading; paragraphs."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]]]] = []
        self.paragraphs: list[tuple[str | None, str]] = []
        self.heading = ""
        self._in: str | None = None
        self._text = ""
        self._row: list[str] | None = None
        self._p_class: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("h2", "h3", "th", "td", "p"):
            self._in, self._text = tag, ""
            if tag == "p":
                self._p_class = dict(attrs).get("class")
        elif tag == "table":
            self.tables.append((self.heading, []))
        elif tag == "tr":
            self._row = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None and self.tables:
            self.tables[-1][1].append(self._row)
            self._row = None
        if tag != self._in:
            return
        text = " ".join(self._text.split())
        if tag in ("h2", "h3"):
            self.heading = text
        elif tag in ("th", "td") and self._row is not None:
            self._row.append(text)
        elif tag == "p":
            self.paragraphs.append((self._p_class, text))
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in:
            self._text += data



def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    page.close()
    return page


def _table(page: _Page, heading: str) -> list[list[str]]:
    found = [rows for h, rows in page.tables if h == heading]
    assert found, f"no table under {heading!r}: {[h for h, _ in page.tables]}"
    return found[0]


def _kv(rows: list[list[str]]) -> dict[str, str]:
    return {r[0]: r[1] for r in rows if len(r) == 2}


def _result(tmp_path: Path, *, verified: bool, resumed_from: int | None) -> PipelineResult:
    curve = [(i, 2.0 / (i + 1) + (3.0 if i == 59 else 0.0)) for i in range(60)]  # the last batch is an outlier
    training = TrainingSummary(device="cpu", steps=60, epochs_completed=3, final_loss=curve[-1][1],
                               samples_per_second=50.0, curve=curve, resumed_from=resumed_from)
    deid = DeidSummary(policy="basic", policy_version="1", files_in=20, files_out=14, tags_changed=300, rejected=4,
                       quarantined=2, output_dir=tmp_path / "deid", manifest=tmp_path / "deid" / "m.csv",
                       refused_by_reason={"rejected: burned_in_annotation": 4, "quarantined: truncated": 1,
                                          "quarantined: not DICOM": 1})
    he = HESummary(samples=8, features=4, max_abs_error=2e-4, plaintext_auc=0.91, encrypted_auc=0.91,
                   plaintext_accuracy=0.75, encrypted_accuracy=0.625, ms_per_sample=3.0, poly_modulus_degree=8192,
                   public_context_bytes=1234)
    audit = AuditSummary(url="postgresql://securetrain:hunter2-secret@db:5432/audit", entries=42, root_hash="ef" * 32,
                         checkpoint_note=tmp_path / "cp.note", export_dir=tmp_path / "export", verified=verified,
                         verifier_output="OK: 42 entries" if verified else "FAIL: entry 7 hash mismatch")
    keys = {"kek_id": "kek-2026", "kek_fingerprint": "ab" * 16, "deid_key_id": "deid-1a2b",
            "audit_public_key_sha256": "cd" * 32, "deid_key_note": "public demo key (demo only)"}
    return PipelineResult(run_dir=tmp_path, training=training, deid=deid, he=he, audit=audit, keys=keys)


@pytest.mark.parametrize("verified", [True, False])
def test_report_tables_and_verdict(tmp_path: Path, verified: bool) -> None:
    path = write_html_report(_result(tmp_path, verified=verified, resumed_from=None), tmp_path / "report.html")
    page = _parse(path)
    text = path.read_text()

    refused = _table(page, "Refused files by reason")
    assert refused[0] == ["reason", "files"]
    assert refused[1:] == [["rejected: burned_in_annotation", "4"], ["quarantined: not DICOM", "1"],
                           ["quarantined: truncated", "1"], ["total", "6"]]  # = rejected + quarantined

    run = _kv(_table(page, "Run"))
    assert run["KEK fingerprint"] == "ab" * 16 and run["de-identification key id"] == "deid-1a2b"
    assert run["audit public key SHA-256"] == "cd" * 32 and "demo only" in run["DEMO KEY"]
    assert DEID_SECRET not in text and "hunter2" not in text  # key ids, never keys; masked audit URL

    training = _kv(_table(page, "Training"))
    smoothed = float(training["training loss, smoothed (EMA, span 20 logged steps)"])
    last = float(training["training loss, last logged batch"])
    assert smoothed < 0.5 < 3.0 < last  # the outlier last batch is not reported as the loss

    he = _kv(_table(page, "Homomorphic evaluation (CKKS)"))
    assert he["AUC plaintext / encrypted"] == "0.9100 / 0.9100"
    explained = [t for _, t in page.paragraphs if t.startswith("Reading these numbers")]
    assert explained and "threshold" in explained[0] and "AUC" in explained[0] and "Accuracy" in explained[0]

    audit = _kv(_table(page, "Audit log"))
    assert audit["standalone verifier"] == ("verified" if verified else "VERIFICATION FAILED")
    assert "***" in audit["database"] and "hunter2" not in audit["database"]
    notices = [t for c, t in page.paragraphs if c == "notice"]  # not resumed: only a failed verification
    assert len(notices) == (0 if verified else 1) and all("verification failed" in n for n in notices)
    assert ("entry 7 hash mismatch" in text) is not verified  # the verifier's own words are shown


def test_resumed_notices_parse(tmp_path: Path) -> None:
    finished = _parse(write_html_report(_result(tmp_path, verified=True, resumed_from=60), tmp_path / "a.html"))
    notices = [t for c, t in finished.paragraphs if c == "notice"]
    assert len(notices) == 1 and "resumed a finished run" in notices[0] and "trained no new steps" in notices[0]
    partial = _parse(write_html_report(_result(tmp_path, verified=True, resumed_from=30), tmp_path / "b.html"))
    notices = [t for c, t in partial.paragraphs if c == "notice"]
    assert len(notices) == 1 and "step 30" in notices[0] and "finished" not in notices[0]


def test_no_refusals_says_so(tmp_path: Path) -> None:
    result = _result(tmp_path, verified=True, resumed_from=None)
    assert result.deid is not None
    result.deid.refused_by_reason = {}
    page = _parse(write_html_report(result, tmp_path / "r.html"))
    assert "Refused files by reason" not in [h for h, _ in page.tables]
    assert (None, "No files refused.") in page.paragraphs

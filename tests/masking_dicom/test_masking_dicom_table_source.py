"""The bundled 2026d extraction is an exact copy of its public source, and the table follows it."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "scripts" / "table_sources" / "pymedphys-e1_1-2026d.json"
TABLE = ROOT / "securetrain" / "masking" / "dicom" / "profile_table.json"

# content_sha256 published inside pymedphys' e1_1.json (commit 339bb77a): the SHA-256 of its rows
# serialised as compact, key-sorted JSON. Equal hashes mean the transcription is byte-exact.
PYMEDPHYS_CONTENT_SHA256 = "e257bc5e1cfecb3156ad3b871c43e6d73581cba6e80df460f4a4a87694e89442"


def test_source_rows_hash_to_the_published_content_digest() -> None:
    rows = json.loads(SOURCE.read_text())["rows"]
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert digest == PYMEDPHYS_CONTENT_SHA256


def test_every_source_row_is_in_the_bundled_table_with_its_code() -> None:
    rows = json.loads(SOURCE.read_text())["rows"]
    table = json.loads(TABLE.read_text())
    text = json.dumps(table)
    assert "2026d" in str(table.get("edition", "")) or "2026d" in text[:2000]
    tags = {row["tag"].upper() for row in table["rows"]}
    concrete = [row for row in rows if re.fullmatch(r"\([0-9A-F]{4},[0-9A-F]{4}\)", row["tag"].upper())]
    assert len(concrete) > 600  # the pattern rows ("(gggg,eeee) where gggg is odd", ranges) are few
    for row in concrete:
        assert row["tag"].upper() in tags, row["tag"]

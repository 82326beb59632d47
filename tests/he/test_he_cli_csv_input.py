"""`securetrain he` reads features and labels from CSV as spreadsheets and exports write them, and
never puts a cell value into an error message (the features are the data owner's private data).

Found by a probe: a UTF-8 byte order mark before a first line of numbers made that line look like
a header, so the first sample was dropped silently; quoted numbers ("1.5") were refused; and every
refusal quoted the offending cell ("could not convert string 'oops'")."""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.he.cli import _load_array
from securetrain.he.errors import HEFormatError


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "x.csv"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data", [
    b"\xef\xbb\xbf1.5,2.5\n3.5,4.5\n",  # BOM, no header
    b"\xef\xbb\xbfa,b\n1.5,2.5\n3.5,4.5\n",  # BOM, header
    b"a,b\r\n1.5,2.5\r\n3.5,4.5\r\n",  # CRLF
    b'"a","b"\n"1.5","2.5"\n3.5,"4.5"\n',  # quoted header and numbers
    b"1.5,2.5\n3.5,4.5",  # no final newline
    b"0,1\n1.5,2.5\n3.5,4.5\n",  # pandas' header of an unnamed frame
    b'"a\nmulti-line name",b\n1.5,2.5\n\n3.5,4.5\n',  # a header over two lines, a blank line
])
def test_features_csv_dialects(tmp_path: Path, data: bytes) -> None:
    got = _load_array(_write(tmp_path, data), "features")
    assert got.shape == (2, 2) and got.tolist() == [[1.5, 2.5], [3.5, 4.5]]


def test_one_feature_and_labels(tmp_path: Path) -> None:
    assert _load_array(_write(tmp_path, b"\xef\xbb\xbf1\n0\n1\n"), "labels").tolist() == [1.0, 0.0, 1.0]
    assert _load_array(_write(tmp_path, b"x\n0.5\n0.25\n"), "features").shape == (2, 1)


@pytest.mark.parametrize(("data", "why"), [
    (b"a,b\n123456789,oops\n", "not a number"),
    (b"a,b\n1.5,\n3.5,4.5\n", "empty"),
    (b"a;b\n1,5;2,5\n", "cells"),
    (b"a,b\n1.5,2.5,987654321\n", "cells"),
    (b"", "empty"),
    (b"a,b\n", "no rows"),
])
def test_refusals_name_no_cell_value(tmp_path: Path, data: bytes, why: str) -> None:
    with pytest.raises(HEFormatError, match=why) as info:
        _load_array(_write(tmp_path, data), "features")
    text = f"{info.value} {info.value.hint or ''}"
    for secret in ("oops", "123456789", "987654321", "5;2", "1,5"):
        assert secret not in text, text

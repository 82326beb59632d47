"""The vectorised row-value scrub equals the per-row rewrite (_replace_words) on random text (issue 13).

scrub_row_values rewrites plain-ASCII rows without a Python loop per row and sends the rest
(Unicode, NUL bytes, one needle under two markers, crowded rows) through _replace_words; both
must give exactly what the per-row reference gives, including overlapping and repeated needles,
word boundaries, nulls and the count of changed rows.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from securetrain.masking.tabular import detectors as D
from securetrain.masking.tabular.detectors import RowSource, _replace_words, scrub_row_values

WORDS = ["ann", "Ann", "lee", "LEE", "ann lee", "Ann-Lee", "ann_lee", "aa", "aaa", "c123", "C123", "x",
         "ref", "to", "İsmail", "straße", "STRASSE", "é", "a\x00b", "pay", "+1-555", "1-555", "555",
         "[N]", "n", ".", ",", "--", "  ", "ann.lee@x.io", "lee2", "2lee"]
VALUES = ["Ann Lee", "ann", "Lee", "aa", "aaa", "C123", "c123 ", " ann lee", "İsmail Öztürk", "straße",
          "+1-555", "555", "a\x00b", "ann.lee@x.io", "[N]", "x y", "ann-lee", None, ""]


def _reference(texts: list[str | None], sources: list[RowSource], *, min_length: int, parts: bool
               ) -> tuple[list[str | None], int]:
    """The per-row semantics: every source value (trimmed, lower-cased, >= min_length) and, for
    name-like sources, each word of a multi-word value, that occurs in the row's lower-cased text."""
    lowered = pc.utf8_lower(pa.array(texts, pa.string())).to_pylist()
    out, changed = list(texts), 0
    for r, text in enumerate(texts):
        if text is None:
            continue
        needles: list[tuple[str, str]] = []
        for src in sources:
            v = src.values[r].as_py()
            if v is None:
                continue
            v = pc.utf8_lower(pa.array([v.strip()])).to_pylist()[0]
            cands = [v] if len(v) >= min_length else []
            words = v.split()
            if parts and src.parts and len(words) > 1:
                cands += [w for w in words if len(w) >= min_length]
            needles += [(c, src.marker) for c in cands if c in lowered[r]]
        if needles:
            new = _replace_words(text, needles)
            if new != text:
                out[r], changed = new, changed + 1
    return out, changed


def _random_rows(rng: random.Random, n: int) -> tuple[list[str | None], list[list[str | None]]]:
    texts: list[str | None] = []
    values: list[list[str | None]] = [[], [], []]
    for i in range(n):
        row_values = [rng.choice(VALUES) for _ in values]
        for col, v in zip(values, row_values):
            col.append(v)
        if rng.random() < 0.05:
            texts.append(None)
            continue
        pieces = [rng.choice(WORDS) for _ in range(rng.randint(0, 7))]
        for v in row_values:  # the row's own values, often in another case or repeated
            if v and rng.random() < 0.6:
                for _ in range(rng.choice([1, 1, 2])):
                    w = rng.choice([v, v.upper(), v.lower(), v.title()])
                    pieces.insert(rng.randint(0, len(pieces)), w)
        sep = rng.choice([" ", " ", "", ",", "_", "-", "\n"])
        texts.append(sep.join(pieces) + ("" if rng.random() < 0.8 else f" #{i}"))
    return texts, values


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_length", [2, 3])
def test_scrub_equals_per_row_reference(seed: int, min_length: int) -> None:
    rng = random.Random(seed)
    texts, values = _random_rows(rng, 3000)  # > MAX_CATEGORIES distinct texts: the free-text path
    sources = [RowSource("name", pa.array(values[0], pa.string()), "[NAME]", parts=True),
               RowSource("cid", pa.array(values[1], pa.string()), "[CID]"),
               RowSource("other", pa.array(values[2], pa.string()), "[OTHER]", parts=True)]
    for parts in (True, False):
        got, changed = scrub_row_values(pa.array(texts, pa.string()), sources, min_length=min_length, parts=parts)
        want, want_changed = _reference(texts, sources, min_length=min_length, parts=parts)
        assert got.to_pylist() == want
        assert changed == want_changed


@pytest.mark.parametrize("threads", [2, 3])
def test_scrub_on_threads_in_row_shares_equals_per_row_reference(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    # Shares of 700 rows: free-text shares, a category-like share (the repeated tail), nulls and
    # non-ASCII rows at the cuts; the input itself a slice.
    monkeypatch.setattr(D, "SCRUB_SHARE_MIN_ROWS", 700)
    rng = random.Random(7)
    texts, values = _random_rows(rng, 2200)
    texts[1100:] = [rng.choice(["pay ann", "Ann Lee", None, "straße"]) for _ in texts[1100:]]
    texts[732], texts[733] = None, "İsmail ann"
    sources = [RowSource("name", pa.array(values[0], pa.string()).slice(50), "[NAME]", parts=True),
               RowSource("cid", pa.array(values[1], pa.string()).slice(50), "[CID]")]
    want, want_changed = _reference(texts[50:], sources, min_length=2, parts=True)
    calls: list[int] = []
    real = D._scrub_rows

    def spy(text: pa.Array, *args: object, **kwargs: object) -> tuple[pa.Array, int]:
        calls.append(len(text))
        return real(text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(D, "_scrub_rows", spy)
    got, changed = scrub_row_values(pa.array(texts, pa.string()).slice(50), sources, min_length=2, parts=True,
                                    threads=threads)
    assert len(calls) == min(threads, 2150 // 700) and sum(calls) == 2150  # really cut into shares
    assert (got.to_pylist(), changed) == (want, want_changed)


def test_scrub_sliced_chunked_and_all_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(42)
    texts, values = _random_rows(rng, 2600)
    sources = [RowSource("name", pa.array(values[0], pa.string()), "[NAME]", parts=True),
               RowSource("cid", pa.array(values[1], pa.string()), "[CID]")]
    want, want_changed = _reference(texts[100:], [RowSource(s.column, s.values.slice(100), s.marker, s.parts)
                                                  for s in sources], min_length=3, parts=True)
    sliced = pa.array(texts, pa.string()).slice(100)
    srcs = [RowSource(s.column, s.values.slice(100), s.marker, s.parts) for s in sources]
    chunked = pa.chunked_array([pa.array(texts[100:1300], pa.string()), pa.array(texts[1300:], pa.string())])
    for text in (sliced, chunked):
        got, changed = scrub_row_values(text, srcs, min_length=3, parts=True)
        assert (got.to_pylist(), changed) == (want, want_changed)
    # The StringDType fallback (texts too wide for fixed-width bytes) and crowded rows give the
    # same result.
    monkeypatch.setattr(D, "MAX_SPANS_PER_ROW", 2)
    monkeypatch.setattr(D, "_fits_fixed_width", lambda n, width, nbytes: False)
    got, changed = scrub_row_values(sliced, srcs, min_length=3, parts=True)
    assert (got.to_pylist(), changed) == (want, want_changed)


def test_one_needle_under_two_markers_takes_the_first_sources_marker() -> None:
    # Deterministic (it once depended on the string hash seed through a set's order), on the
    # vectorised path (ASCII) and the per-row one (non-ASCII) alike.
    text = pa.array(["pay ann lee now", "ann lee", "ännchen ann lee"] * 1000, pa.string())
    same = pa.array(["Ann Lee"] * 3000, pa.string())
    for first, second in (("[A]", "[B]"), ("[B]", "[A]")):
        got, changed = scrub_row_values(text, [RowSource("a", same, first), RowSource("b", same, second)],
                                        min_length=3, parts=True)
        assert changed == 3000
        assert got.to_pylist()[:3] == [f"pay {first} now", first, f"ännchen {first}"]
    assert _replace_words("ann lee", [("ann lee", "[B]"), ("ann lee", "[A]")]) == "[B]"


def test_no_hit_returns_the_input_unchanged() -> None:
    text = pa.array([f"row {i}" for i in range(2500)] + [None], pa.string())
    got, changed = scrub_row_values(text, [RowSource("a", pa.array(["zzz"] * 2501), "[A]")], min_length=3,
                                    parts=True)
    assert changed == 0 and got.to_pylist() == text.to_pylist()


@pytest.mark.parametrize("seed", range(4))
def test_scrub_of_a_category_column_equals_per_row_reference(seed: int) -> None:
    # Few distinct texts (<= MAX_CATEGORIES): the path that looks source values up among the
    # categories' word-aligned substrings (with a byte-length shortcut for ASCII sources).
    rng = random.Random(100 + seed)
    categories = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(40)]
    categories += ["ann lee", "Ann-Lee", "straße", "c123", "İsmail Öztürk"]
    values = [v for v in VALUES if v is None or v == v.strip()]
    n = 3000
    texts = [rng.choice(categories) if rng.random() > 0.03 else None for _ in range(n)]
    sources = [RowSource("name", pa.array([rng.choice(values) for _ in range(n)], pa.string()), "[NAME]", parts=True),
               RowSource("cid", pa.array([rng.choice(values) for _ in range(n)], pa.string()), "[CID]"),
               RowSource("num", pa.array([f"{rng.randint(0, 10**6):06d}" for _ in range(n)], pa.string()), "[NUM]")]
    for parts in (True, False):
        got, changed = scrub_row_values(pa.array(texts, pa.string()), sources, min_length=3, parts=parts)
        want, want_changed = _reference(texts, sources, min_length=3, parts=parts)
        assert (got.to_pylist(), changed) == (want, want_changed)
        assert changed > 0


def test_category_lookup_keeps_values_whose_case_mapping_changes_their_length() -> None:
    # 'İ' lower-cases to two code points (one byte longer): no byte-length shortcut for it.
    texts = ["pay İsmail now", "hello"] * 1200
    source = RowSource("name", pa.array(["İsmail"] * 2400, pa.string()), "[NAME]")
    got, changed = scrub_row_values(pa.array(texts, pa.string()), [source], min_length=3, parts=False)
    assert got.to_pylist()[:2] == ["pay [NAME] now", "hello"] and changed == 1200


def test_overlapping_needles_of_equal_length_go_by_text_not_by_source() -> None:
    # "cd ef" (first source) and "ab cd" (second) have the same length and overlap: the text order
    # decides ("ab cd" first), as in _replace_words, whichever source lists it; rows of different
    # texts and lengths around them keep their own order.
    n = 3000
    text = pa.array(["ab cd ef", "xx ab cd ef yy", "cd ef ab cd"] * (n // 3), pa.string())
    first = RowSource("first", pa.array(["CD EF"] * n, pa.string()), "[B]")
    second = RowSource("second", pa.array(["Ab Cd"] * n, pa.string()), "[A]")
    got, changed = scrub_row_values(text, [first, second], min_length=3, parts=False)
    assert got.to_pylist()[:3] == ["[A] ef", "xx [A] ef yy", "[B] [A]"]
    assert got.to_pylist()[:3] == [_replace_words(t, [("cd ef", "[B]"), ("ab cd", "[A]")])
                                   for t in text.to_pylist()[:3]]
    assert changed == n


def test_category_probe_agrees_with_the_whole_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "CATEGORY_PROBE", 50)
    monkeypatch.setattr(D, "MAX_CATEGORIES", 20)
    # Free text from the first row: the probe of the first 50 values already has > 20 distinct.
    free = pa.array([f"row {i}" for i in range(1000)], pa.string())
    assert D._aligned_substrings(free, 3) is None
    # Few distinct values at the start, many later: still free text (the whole column decides).
    late = pa.array(["same text"] * 500 + [f"row {i}" for i in range(500)], pa.string())
    assert D._aligned_substrings(late, 3) is None
    # A category column: every aligned substring of its few values.
    cats = pa.array(["card payment", "salary", None] * 400, pa.string())
    assert D._aligned_substrings(cats, 4) == {"card payment", "card", "payment", "salary"}


def test_category_column_matches_source_values_with_surrounding_spaces() -> None:
    # A low-cardinality text column takes the category lookup; the source value is compared
    # trimmed there as on the free-text path (" ann lee" is the whole name, not two words).
    texts = pa.array(["Ann Lee", "paid", "Ann Lee", None] * 500, pa.string())
    names = pa.array([" ann lee", "x", "ann lee ", "ann lee"] * 500, pa.string())
    ids = pa.array([" C123 ", "c123", "x", "y"] * 500, pa.string())
    sources = [RowSource("name", names, "[NAME]", parts=True), RowSource("cid", ids, "[CID]")]
    got, changed = scrub_row_values(texts, sources, min_length=3, parts=True)
    assert got.to_pylist()[:4] == ["[NAME]", "paid", "[NAME]", None]
    assert (got.to_pylist(), changed) == _reference(texts.to_pylist(), sources, min_length=3, parts=True)
    other = pa.array(["Ann Lee c123", "c123 paid", "Ann Lee c123", None] * 500, pa.string())
    got, changed = scrub_row_values(other, sources, min_length=3, parts=True)
    assert got.to_pylist()[:2] == ["[NAME] [CID]", "[CID] paid"]
    assert (got.to_pylist(), changed) == _reference(other.to_pylist(), sources, min_length=3, parts=True)


@pytest.mark.parametrize("name", ["\tann lee", "ann lee\x0b", "\nann lee\r", "\u00a0ann lee", "ann lee\u2003", "ann lee"])
def test_category_lookup_trims_every_kind_of_edge_whitespace(name: str) -> None:
    # A source without edge whitespace skips trimming (raw byte lengths prefilter the lookup); any
    # whitespace byte at an edge, ASCII or not, sends it through the same trim as free text.
    texts = pa.array(["Ann Lee paid", "refund", None] * 400, pa.string())
    ids = pa.array(["c1234567", "x", "y"] * 400, pa.string())  # no whitespace at all: the fast path
    sources = [RowSource("name", pa.array([name, "bob", "eve"] * 400, pa.string()), "[NAME]"),
               RowSource("cid", ids, "[CID]")]
    got, changed = scrub_row_values(texts, sources, min_length=3, parts=False)
    assert got.to_pylist()[:3] == ["[NAME] paid", "refund", None]
    assert changed == 400

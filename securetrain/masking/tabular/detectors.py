"""Validated PII detectors for columns a policy passes through unmasked (``keep``).

Two stages, so a clean column costs a few vectorised passes and nothing else:

1. **Prefilter** (pyarrow/RE2, over the column's *distinct* values): a cheap, deliberately broad
   shape test per detector (a 13-19 digit run for cards, ``CCdd`` + alphanumerics for IBANs, a
   6+ digit run for phones, a capitalised word after a title or a transfer word for names).
   ``email`` and ``ssn`` are decided here (their shape is the test).
2. **Validation** (Python, once per distinct candidate value) with maintained libraries:
   every card-shaped run is Luhn-checked (``stdnum.luhn``), IBAN candidates in any case and with
   spaces or dashes are checked against the country format and ISO 7064 mod-97
   (``stdnum.iban``), phone numbers are found by ``phonenumbers.PhoneNumberMatcher`` for the
   policy's regions, and names by Presidio's ``AnalyzerEngine`` with pattern recognisers only on
   Presidio's ``NoOpNlpEngine`` (no spaCy model is loaded or downloaded).

Overlapping findings are resolved in the fixed order email, iban, pan, ssn, phone, person (a
card number is not also counted as a phone number). Counts are per cell and per detector.

Values known from the same row's identifier columns (names, ids, e-mails...) are scrubbed from
kept text columns separately (:func:`scrub_row_values`): that needs no guessing at all.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.masking.tabular.transforms import _offsets_and_data, as_string, lower, luhn_valid

# Resolution order for overlapping findings: specific shapes before generic digit runs and names.
DETECTOR_ORDER = ("email", "iban", "pan", "ssn", "phone", "person")
DEFAULT_PHONE_REGIONS = ("US", "GB", "DE", "FR")

# RE2 (pyarrow) shapes. email/ssn are final; the others only select candidates for validation.
EMAIL_RE2 = r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}"
SSN_RE2 = r"\b\d{3}-\d{2}-\d{4}\b"
_PREFILTER_RE2 = {
    "pan": r"\d(?:[ \-]?\d){12,18}",
    "iban": r"(?i)[a-z]{2}\d{2}(?:[ \-]?[a-z0-9]){11,}",
    "phone": r"\d(?:[ \-.()/]{0,2}\d){5,}",
}
_TITLES = r"Mr|Mrs|Ms|Miss|Mx|Dr|Prof|Sir|Dame|Herr|Frau|Fr|Hr"
# Words after which two capitalised words are most likely a person ("transfer to Jane Doe").
# "for"/"by" are left out: "paid by Visa Debit" would be a person far too often.
_NAME_CONTEXT = r"to|from|payee|beneficiary|recipient|customer|client|name|holder|sender|an|von"
_PERSON_PREFILTER_RE2 = (
    rf"\b(?:{_TITLES})\b\.?\s+\p{{Lu}}"
    rf"|(?i:\b(?:{_NAME_CONTEXT})\b:?)\s+\p{{Lu}}\p{{Ll}}+[ \-]\p{{Lu}}"
)

# Python-side patterns (ASCII digits only) to locate validated spans inside candidate text.
_EMAIL_PY = re.compile(EMAIL_RE2, re.ASCII)
_SSN_PY = re.compile(SSN_RE2, re.ASCII)
_PAN_PY = re.compile(r"(?<!\d)\d(?:[ \-]?\d){12,18}(?!\d)", re.ASCII)
_IBAN_PY = re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}\d{2}(?:[ \-]?[A-Za-z0-9]){11,32}", re.ASCII)
_SEPARATORS = re.compile(r"[ \-]")
_DATE_LIKE = re.compile(r"^(?:\d{4}[-/.]\d{1,2}[-/.]\d{1,2}|\d{1,2}[-/.]\d{1,2}[-/.]\d{2,4})$")
# Names: a title and one or more capitalised words, or a transfer/context word and a full name.
_PERSON_PATTERNS = (
    ("title_name", rf"(?<=\b(?:{_TITLES})\.?\s+)\p{{Lu}}[\p{{Ll}}'’]+(?:[ \-]\p{{Lu}}[\p{{Ll}}'’]+)*", 0.85),
    ("context_full_name",
     rf"(?<=(?i:\b(?:{_NAME_CONTEXT})\b):?\s+)\p{{Lu}}[\p{{Ll}}'’]+(?:[ \-]\p{{Lu}}[\p{{Ll}}'’]+)+", 0.6),
)
PERSON_SCORE_THRESHOLD = 0.5
MAX_KNOWN_NAMES = 5000


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    kind: str


def _bool(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, False).to_numpy(zero_copy_only=False), dtype=bool)


# -- validation, one text at a time ----------------------------------------------------------------
def _pan_findings(text: str) -> list[Finding]:
    from stdnum import luhn

    out = []
    for m in _PAN_PY.finditer(text):  # every card-shaped run, not only the first
        digits = _SEPARATORS.sub("", m.group())
        if 13 <= len(digits) <= 19 and luhn.is_valid(digits):
            out.append(Finding(m.start(), m.end(), "pan"))
    return out


def _iban_findings(text: str) -> list[Finding]:
    from stdnum import iban

    out = []
    for m in _IBAN_PY.finditer(text):
        raw = m.group()
        # The candidate may run into the following word: keep the longest prefix that validates.
        positions = [i for i, ch in enumerate(raw) if ch not in " -"]
        compact = "".join(raw[i] for i in positions).upper()
        for length in range(min(len(compact), 34), 14, -1):
            if iban.is_valid(compact[:length]):
                out.append(Finding(m.start(), m.start() + positions[length - 1] + 1, "iban"))
                break
    return out


@functools.lru_cache(maxsize=64)
def _national_prefix(region: str) -> str | None:
    import phonenumbers

    meta = phonenumbers.PhoneMetadata.metadata_for_region(region)
    return meta.national_prefix if meta is not None else None


def _phone_findings(text: str, regions: Sequence[str]) -> list[Finding]:
    import phonenumbers

    seen: set[tuple[int, int]] = set()
    out = []
    for region in regions:
        prefix = _national_prefix(region)
        for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.POSSIBLE):
            raw = m.raw_string.strip()
            if (m.start, m.end) in seen:
                continue
            international = raw.startswith("+")  # "00..." must validate like a national number
            if not international:
                # A national number must be valid for the region, written with its trunk prefix
                # where the region has '0' (so '20230401' is not a German number), and not a date.
                if not phonenumbers.is_valid_number(m.number) or _DATE_LIKE.match(raw):
                    continue
                if prefix == "0" and not raw.lstrip("(").startswith("0"):
                    continue
            seen.add((m.start, m.end))
            out.append(Finding(m.start, m.end, "phone"))
    return out


class _PersonAnalyzer:
    """Presidio AnalyzerEngine with pattern recognisers only, on the no-op NLP engine."""

    def __init__(self, known_names: Sequence[str]) -> None:
        import regex
        from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerRegistry
        from presidio_analyzer.nlp_engine import NoOpNlpEngine

        registry = RecognizerRegistry(supported_languages=["en"])
        # Case matters for these patterns (capitalised words), so no IGNORECASE flag here.
        registry.add_recognizer(PatternRecognizer(
            supported_entity="PERSON", name="securetrain_person_patterns",
            patterns=[Pattern(name, rx, score) for name, rx, score in _PERSON_PATTERNS],
            global_regex_flags=regex.DOTALL | regex.MULTILINE,
        ))
        if known_names:
            # Names seen in the table's own identifier columns, anywhere in the text, any case.
            registry.add_recognizer(PatternRecognizer(
                supported_entity="PERSON", name="securetrain_known_names", deny_list=list(known_names),
                deny_list_score=1.0,
            ))
        nlp = NoOpNlpEngine(models=[{"lang_code": "en", "model_name": "none"}])
        self._engine = AnalyzerEngine(registry=registry, nlp_engine=nlp, supported_languages=["en"])

    def findings(self, text: str) -> list[Finding]:
        results = self._engine.analyze(text=text, language="en", entities=["PERSON"],
                                       score_threshold=PERSON_SCORE_THRESHOLD)
        return [Finding(r.start, r.end, "person") for r in results]


def _resolve(findings: Iterable[Finding]) -> list[Finding]:
    """Non-overlapping findings: by detector priority, then earliest/longest."""
    rank = {k: i for i, k in enumerate(DETECTOR_ORDER)}
    chosen: list[Finding] = []
    for f in sorted(findings, key=lambda f: (rank[f.kind], f.start, f.start - f.end)):
        if all(f.end <= c.start or f.start >= c.end for c in chosen):
            chosen.append(f)
    return sorted(chosen, key=lambda f: f.start)


def _apply_findings(text: str, findings: list[Finding]) -> str:
    out, pos = [], 0
    for f in findings:
        out += [text[pos:f.start], f"[{f.kind.upper()}]"]
        pos = f.end
    out.append(text[pos:])
    return "".join(out)


def _known_name_prefilter(names: Sequence[str]) -> str | None:
    if not names:
        return None
    return "(?i)(?:" + "|".join(re.escape(n) for n in names) + ")"


class TextScanner:
    """Scans string arrays for the configured detectors; see the module docstring."""

    def __init__(self, detectors: Sequence[str], *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS,
                 known_names: Sequence[str] = ()) -> None:
        self.detectors = [d for d in DETECTOR_ORDER if d in set(detectors)]
        self.phone_regions = tuple(phone_regions)
        # Longest first, so the alternation and Presidio's deny list prefer "Ann Lee-Smith" to "Ann Lee".
        self.known_names = sorted({n for n in known_names if n}, key=lambda n: (-len(n), n))[:MAX_KNOWN_NAMES]
        self._person: _PersonAnalyzer | None = None

    # -- per text (candidates only) -------------------------------------------------------------
    def findings(self, text: str, detectors: Iterable[str] | None = None) -> list[Finding]:
        """Validated, non-overlapping findings in ``text`` (of ``detectors``, default all)."""
        wanted = set(self.detectors if detectors is None else detectors)
        found: list[Finding] = []
        for name in self.detectors:
            if name not in wanted:
                continue
            if name == "email":
                found += [Finding(m.start(), m.end(), "email") for m in _EMAIL_PY.finditer(text)]
            elif name == "ssn":
                found += [Finding(m.start(), m.end(), "ssn") for m in _SSN_PY.finditer(text)]
            elif name == "pan":
                found += _pan_findings(text)
            elif name == "iban":
                found += _iban_findings(text)
            elif name == "phone":
                found += _phone_findings(text, self.phone_regions)
            elif name == "person":
                if self._person is None:
                    self._person = _PersonAnalyzer(self.known_names)
                found += self._person.findings(text)
        return _resolve(found)

    def redact_text(self, text: str, detectors: Iterable[str] | None = None) -> str:
        return _apply_findings(text, self.findings(text, detectors))

    # -- whole arrays ---------------------------------------------------------------------------
    def _candidates(self, values: pa.Array) -> dict[str, np.ndarray]:
        """Per detector, which (distinct) values need its per-text validation."""
        cand: dict[str, np.ndarray] = {}
        for name in self.detectors:
            if name == "email":
                cand[name] = _bool(pc.match_substring_regex(values, EMAIL_RE2))
            elif name == "ssn":
                cand[name] = _bool(pc.match_substring_regex(values, SSN_RE2))
            elif name == "person":
                hit = _bool(pc.match_substring_regex(values, _PERSON_PREFILTER_RE2))
                known = _known_name_prefilter(self.known_names)
                if known is not None:
                    try:
                        hit |= _bool(pc.match_substring_regex(values, known))
                    except pa.ArrowException:  # RE2 memory limit for a huge alternation: check all
                        hit[:] = True
                cand[name] = hit
            else:
                cand[name] = _bool(pc.match_substring_regex(values, _PREFILTER_RE2[name]))
        return cand

    def scan(self, arr: pa.Array | pa.ChunkedArray) -> tuple[dict[str, np.ndarray], pa.Array | None]:
        """Per detector a per-row mask of cells with a validated finding, and the redacted array
        (None when nothing was found). Work is per distinct value."""
        s = as_string(arr)
        enc = pc.dictionary_encode(s)
        values = enc.dictionary
        per_detector = self._candidates(values)
        any_cand = np.zeros(len(values), dtype=bool)
        for mask in per_detector.values():
            any_cand |= mask
        cand = np.nonzero(any_cand)[0]
        hits = {name: np.zeros(len(values), dtype=bool) for name in self.detectors}
        redacted: list[str] | None = None
        if len(cand):
            texts = values.take(pa.array(cand)).to_pylist()
            replaced = values.to_pylist()
            for i, text in zip(cand.tolist(), texts):
                # Only the detectors whose prefilter selected this value validate it (so a digit
                # run never loads Presidio, and a name never runs the phone matcher).
                found = self.findings(text, [n for n, m in per_detector.items() if m[i]])
                for f in found:
                    hits[f.kind][i] = True
                if found:
                    replaced[i] = _apply_findings(text, found)
                    redacted = replaced
        indices = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False)
        present = indices >= 0
        safe = np.where(present, indices, 0)
        masks = {k: (v[safe] & present) if len(v) else np.zeros(len(s), bool) for k, v in hits.items()}
        masks = {k: v for k, v in masks.items() if v.any()}
        out = None
        if redacted is not None:
            out = pc.take(pa.array(redacted, pa.string()), enc.indices)
        return masks, out


def integer_pan_mask(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Integer cells that are whole 13-19 digit Luhn-valid card numbers (a numeric range test
    first, so an ordinary integer column costs one comparison)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    big = _bool(pc.greater_equal(pc.cast(arr, pa.float64()), 1e12))
    out = np.zeros(len(arr), dtype=bool)
    if big.any():
        digits = pc.cast(arr.filter(pa.array(big)), pa.string())
        shaped = _bool(pc.match_substring_regex(digits, r"^\d{13,19}$"))
        out[np.nonzero(big)[0]] = shaped & luhn_valid(pc.if_else(pa.array(shaped), digits, pa.scalar(None, pa.string())))
    return out


# -- values known from the same row -------------------------------------------------------------
@dataclass
class RowSource:
    """An identifier column whose value, where it appears in the same row's kept text, is scrubbed."""

    column: str
    values: pa.Array  # string, one per row
    marker: str
    # Also scrub the single words of multi-word values (names: "Smith" alone). Only for name-like
    # columns: the words of a dropped free-text column ("call", "back") are not identifiers.
    parts: bool = False


def _np_strings(arr: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, "").to_numpy(zero_copy_only=False)).astype(np.dtypes.StringDType())


def _fixed_width(arr: pa.Array) -> np.ndarray:
    """A numpy bytes ('S') view of a string array, zero-padded to its longest value (nulls: b"").

    ``numpy.strings.find`` on fixed-width bytes is several times faster than on ``StringDType``
    and the conversion is two pyarrow kernels instead of a Python object per value. Positions are
    byte offsets (equal to character offsets for ASCII text). numpy ignores trailing NUL bytes of
    an 'S' value, so a value ending in NUL can only match more often, never less: the exact
    rewrite decides."""
    raw = pc.fill_null(arr, "").cast(pa.binary())
    lengths = pc.binary_length(raw)
    width = max(1, int(pc.max(lengths).as_py() or 0)) if len(raw) else 1
    # Padded per row in bytes (utf8_rpad counts code points).
    pads = pc.binary_repeat(pa.scalar(b"\x00", pa.binary()), pc.subtract(width, lengths))
    padded = pc.binary_join_element_wise(raw, pads, b"").cast(pa.binary(width))
    return np.frombuffer(padded.buffers()[1], dtype=f"S{width}", count=len(arr), offset=padded.offset * width)


FIXED_WIDTH_BUDGET = 1 << 26  # bytes: above this (one very long text) the StringDType path is used


def _fits_fixed_width(arr: pa.Array) -> bool:
    if not len(arr):
        return True
    width = int(pc.max(pc.binary_length(arr)).as_py() or 0)
    return len(arr) * max(width, 1) <= max(FIXED_WIDTH_BUDGET, 4 * arr.nbytes)


class _TextFinder:
    """``numpy.strings.find`` of per-row needles in the rows of a lower-cased text column."""

    def __init__(self, lower_text: pa.Array) -> None:
        self._text = lower_text
        self._fixed: np.ndarray | None = None
        self._strings: np.ndarray | None = None
        self._text_fits = _fits_fixed_width(lower_text)

    def find(self, rows: np.ndarray, needles: pa.Array, start: np.ndarray | None = None) -> np.ndarray:
        """Position of each needle in its row's text at or after ``start`` (-1: not found). Byte
        positions on the fixed-width path, character positions otherwise: equal for ASCII rows,
        the only rows whose positions are used."""
        if self._text_fits and _fits_fixed_width(needles):
            if self._fixed is None:
                self._fixed = _fixed_width(self._text)
            hay, sub = self._fixed[rows], _fixed_width(needles)
        else:
            if self._strings is None:
                self._strings = _np_strings(self._text)
            hay, sub = self._strings[rows], _np_strings(needles)
        return np.asarray(np.strings.find(hay, sub) if start is None else np.strings.find(hay, sub, start),
                          dtype=np.int64)


MAX_CATEGORIES = 2000
MAX_SUBSTRINGS = 100_000


def _aligned_substrings(lower_text: pa.Array, min_length: int) -> set[str] | None:
    """For a low-cardinality column (categories), every substring of its distinct values that a
    needle could match on word boundaries (starts after a non-word character, ends before one).
    None when the column is real free text (then every row is checked against its own values)."""
    distinct = pc.unique(lower_text.drop_null())
    if len(distinct) > MAX_CATEGORIES:
        return None
    out: set[str] = set()
    for text in distinct.to_pylist():
        starts = [i for i in range(len(text)) if i == 0 or not _is_word_char(text[i - 1])]
        ends = [j for j in range(1, len(text) + 1) if j == len(text) or not _is_word_char(text[j])]
        out.update(text[i:j] for i in starts for j in ends if j - i >= min_length)
        if len(out) > MAX_SUBSTRINGS:
            return None
    return out


def _part_candidates(lower_vals: pa.Array, has_text: np.ndarray, min_length: int,
                     value_set: pa.Array | None) -> tuple[np.ndarray, pa.Array]:
    """(row, word) pairs for the words of multi-word values, worked out once per distinct value
    (a name column has far fewer distinct values than rows) and expanded to rows with numpy."""
    enc = pc.dictionary_encode(lower_vals)
    words = pc.utf8_split_whitespace(enc.dictionary)
    lengths = pc.fill_null(pc.list_value_length(words), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(words)
    owner = np.repeat(np.arange(len(lengths)), lengths)  # distinct value of each word, ascending
    ok = (lengths[owner] > 1) & _bool(pc.greater_equal(pc.utf8_length(flat), min_length))
    if value_set is not None and ok.any():
        ok &= _bool(pc.is_in(flat, value_set=value_set))
    if not ok.any():
        return np.zeros(0, dtype=np.int64), pa.array([], pa.string())
    per_value = np.bincount(owner[ok], minlength=len(lengths))
    first = np.concatenate(([0], np.cumsum(per_value)[:-1]))
    indices = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    rows = np.nonzero((indices >= 0) & has_text)[0]
    rows = rows[per_value[indices[rows]] > 0]
    counts = per_value[indices[rows]]
    rows_rep = np.repeat(rows, counts)
    within = np.arange(len(rows_rep)) - np.repeat(np.cumsum(counts) - counts, counts)
    ok_words = flat.filter(pa.array(ok))
    return rows_rep, ok_words.take(pa.array(np.repeat(first[indices[rows]], counts) + within))


def scrub_row_values(text: pa.Array | pa.ChunkedArray, sources: Sequence[RowSource], *, min_length: int,
                     parts: bool) -> tuple[pa.Array, int]:
    """Replace, case-insensitively and on word boundaries, each source value (and, with ``parts``,
    each of its words of at least ``min_length`` characters) found in the same row's ``text``.

    Vectorised prefilters: for a low-cardinality column (categories) a source value can only hit
    if it equals one of the column's few boundary-aligned substrings (a hash lookup per row,
    ``pc.is_in``); for free text ``numpy.strings.find`` compares every row with its own values in
    C. The confirmed hits are then rewritten without a Python loop per row (:func:`_rewrite`); only
    rows that need Unicode case folding go through :func:`_replace_words`. Returns (array, rows
    changed).
    """
    s = as_string(text)
    n = len(s)
    if n == 0 or not sources:
        return s, 0
    lower_text = lower(s)
    aligned = _aligned_substrings(lower_text, min_length)
    if aligned is not None and not aligned:
        return s, 0
    value_set = pa.array(sorted(aligned), pa.string()) if aligned is not None else None
    has_text = _bool(pc.is_valid(s))
    all_rows = np.arange(n)
    finder: _TextFinder | None = None
    markers: dict[str, int] = {}
    hit_rows: list[np.ndarray] = []
    hit_needles: list[pa.Array] = []
    hit_markers: list[np.ndarray] = []
    hit_pos: list[np.ndarray] = []
    for src in sources:
        raw = as_string(src.values)
        if value_set is not None:
            # Categories: two cheap kernels per source (lower-case, hash lookup in the small set);
            # trimming and lengths only for the few rows that pass.
            whole = has_text & _bool(pc.is_in(lower(raw), value_set=value_set))
            if not whole.any() and not (parts and src.parts):
                continue
            lower_vals = lower(pc.utf8_trim_whitespace(raw))
        else:
            lower_vals = lower(pc.utf8_trim_whitespace(raw))
            whole = has_text & _bool(pc.greater_equal(pc.utf8_length(lower_vals), min_length))
        candidates: list[tuple[np.ndarray, pa.Array]] = [(all_rows[whole], lower_vals.filter(pa.array(whole)))]
        if parts and src.parts:
            candidates.append(_part_candidates(lower_vals, has_text, min_length, value_set))
        for row_idx, needles in candidates:
            if not len(row_idx):
                continue
            if finder is None:
                finder = _TextFinder(lower_text)
            pos = finder.find(row_idx, needles)
            found = pos >= 0
            if found.any():
                hit_rows.append(row_idx[found])
                hit_needles.append(needles.filter(pa.array(found)))
                hit_markers.append(np.full(int(found.sum()), markers.setdefault(src.marker, len(markers))))
                hit_pos.append(pos[found])
    if finder is None or not hit_rows:
        return s, 0
    return _rewrite(s, finder, np.concatenate(hit_rows), pa.concat_arrays(hit_needles),
                    np.concatenate(hit_markers), np.concatenate(hit_pos), list(markers))


# ASCII characters for which ``str.isalnum() or == "_"`` holds (word characters of _replace_words).
_ASCII_WORD = np.zeros(256, dtype=bool)
_ASCII_WORD[np.frombuffer(b"0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)] = True
MAX_SPANS_PER_ROW = 16  # rows with more candidate spans than this are rewritten by _replace_words


def _row_flags(arr: pa.Array, bad: np.ndarray) -> np.ndarray:
    """Per row of a string array: whether any of its bytes is marked in the 256-entry table ``bad``."""
    offsets, data = _offsets_and_data(arr)
    cum = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum(bad[data], out=cum[1:])
    return (cum[offsets[1:]] - cum[offsets[:-1]]) > 0


_NOT_PLAIN_ASCII = np.ones(256, dtype=bool)
_NOT_PLAIN_ASCII[1:0x80] = False  # NUL and non-ASCII bytes: such rows take the per-row path


def _rewrite(s: pa.Array, finder: _TextFinder, rows: np.ndarray, needles: pa.Array, marker_ids: np.ndarray,
             first_pos: np.ndarray, markers: list[str]) -> tuple[pa.Array, int]:
    """Apply ``_replace_words`` to every row with (row, needle, marker) hits, vectorised.

    For plain-ASCII rows (case folding keeps every position; word characters are [0-9A-Za-z_])
    this is exact and needs no Python per row: all occurrences of each needle are found with
    ``numpy.strings.find``, word boundaries are checked on the byte buffer, the greedy choice of
    _replace_words (longest needle first, then the needle's text, then position; a span is taken
    unless it overlaps one already taken) runs as one vectorised round per rank within the row,
    and the output is spliced from the original bytes and the markers with one gather. Other rows
    (non-ASCII or NUL text, an empty needle, too many spans) go through _replace_words itself."""
    n = len(s)
    offsets, data = _offsets_and_data(s)
    row_len = np.diff(offsets)
    enc = pc.dictionary_encode(needles)
    needle_id = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    # Rank of each distinct needle in Python's str order (= UTF-8 byte order, pyarrow's sort).
    rank_of = np.empty(len(enc.dictionary), dtype=np.int64)
    rank_of[np.asarray(pc.array_sort_indices(enc.dictionary))] = np.arange(len(enc.dictionary))
    needle_rank = rank_of[needle_id]
    needle_len = pc.binary_length(needles).to_numpy(zero_copy_only=False).astype(np.int64)
    # One entry per distinct (row, needle, marker), as _replace_words keeps.
    order = np.lexsort((marker_ids, needle_rank, rows))
    rows, needle_rank, marker_ids = rows[order], needle_rank[order], marker_ids[order]
    needle_len, first_pos = needle_len[order], first_pos[order]
    keep = np.concatenate(([True], (rows[1:] != rows[:-1]) | (needle_rank[1:] != needle_rank[:-1])
                           | (marker_ids[1:] != marker_ids[:-1])))
    rows, needle_rank, marker_ids, needle_len, first_pos, order = (
        rows[keep], needle_rank[keep], marker_ids[keep], needle_len[keep], first_pos[keep], order[keep])
    slow = np.zeros(n, dtype=bool)
    hit = np.unique(rows)
    slow[hit[_row_flags(s.take(pa.array(hit)), _NOT_PLAIN_ASCII)]] = True
    slow[rows[needle_len == 0]] = True
    needles = needles.take(pa.array(order))

    # All occurrences of each needle (overlapping ones too: str.find from i + 1).
    fast = np.nonzero(~slow[rows])[0]
    occ_pair, occ_pos = [fast], [first_pos[fast]]
    cur, cur_pos = fast, first_pos[fast]
    while len(cur):
        nxt = finder.find(rows[cur], needles.take(pa.array(cur)), cur_pos + 1)
        more = nxt >= 0
        cur, cur_pos = cur[more], nxt[more]
        occ_pair.append(cur)
        occ_pos.append(cur_pos)
    pair = np.concatenate(occ_pair)
    start = np.concatenate(occ_pos)
    r = rows[pair]
    end = start + needle_len[pair]
    # Word boundaries on the (ASCII) bytes: the characters before and after are not word characters.
    base = offsets[r]
    before_ok = (start == 0) | ~_ASCII_WORD[data[np.where(start > 0, base + start - 1, 0)]]
    after_ok = (end >= row_len[r]) | ~_ASCII_WORD[data[np.where(end < row_len[r], base + end, 0)]]
    ok = before_ok & after_ok
    pair, start, end, r = pair[ok], start[ok], end[ok], r[ok]
    # _replace_words's order: longest needle first, then the needle, then the marker listed first
    # (marker ids follow the sources' order), then each occurrence in turn.
    order = np.lexsort((start, marker_ids[pair], needle_rank[pair], -needle_len[pair], r))
    start, end, r, mk = start[order], end[order], r[order], marker_ids[pair][order]
    group_start = np.concatenate(([0], np.nonzero(r[1:] != r[:-1])[0] + 1)) if len(r) else np.zeros(0, np.int64)
    sizes = np.diff(np.concatenate((group_start, [len(r)])))
    within = np.arange(len(r)) - np.repeat(group_start, sizes)
    crowded = r[within >= MAX_SPANS_PER_ROW]
    if len(crowded):
        slow[crowded] = True
        keep = ~slow[r]
        start, end, r, mk, within = start[keep], end[keep], r[keep], mk[keep], within[keep]
    # Greedy, one rank at a time: a span is taken unless it overlaps a span already taken in its row.
    depth = int(within.max()) + 1 if len(r) else 0
    slot = np.searchsorted(hit, r)
    taken_start = np.full((len(hit), max(depth, 1)), -1, dtype=np.int64)
    taken_end = np.full((len(hit), max(depth, 1)), -1, dtype=np.int64)
    accepted = np.zeros(len(r), dtype=bool)
    for k in range(depth):
        sel = np.nonzero(within == k)[0]
        sl = slot[sel]
        overlap = ((start[sel, None] < taken_end[sl, :k]) & (taken_start[sl, :k] < end[sel, None])).any(axis=1)
        good = sel[~overlap]
        accepted[good] = True
        taken_start[slot[good], k] = start[good]
        taken_end[slot[good], k] = end[good]
    start, end, r, mk = start[accepted], end[accepted], r[accepted], mk[accepted]
    order = np.lexsort((start, r))
    start, end, r, mk = start[order], end[order], r[order], mk[order]

    slow_rows = np.nonzero(slow)[0]
    replaced: list[str] = []
    if len(slow_rows):
        texts = s.take(pa.array(slow_rows)).to_pylist()
        in_slow = slow[rows]
        pairs_r = rows[in_slow].tolist()
        pairs_n = needles.filter(pa.array(in_slow)).to_pylist()
        pairs_m = marker_ids[in_slow].tolist()
        per_row: dict[int, list[tuple[str, str]]] = {}
        for row, needle, m in zip(pairs_r, pairs_n, pairs_m):
            per_row.setdefault(row, []).append((needle, markers[m]))
        replaced = [_replace_words(t, per_row[row]) for row, t in zip(slow_rows.tolist(), texts)]
    if not len(r) and not len(slow_rows):
        return s, 0
    out = _splice(s, offsets, data, r, start, end, mk, markers, slow_rows, replaced)
    touched = np.union1d(r, slow_rows)
    idx = pa.array(touched)
    changed = int(pc.sum(pc.not_equal(out.take(idx), s.take(idx))).as_py() or 0)
    return out, changed


SPLICE_BLOCK_BYTES = 1 << 24


def _splice(s: pa.Array, offsets: np.ndarray, data: np.ndarray, rows: np.ndarray, start: np.ndarray,
            end: np.ndarray, marker_ids: np.ndarray, markers: list[str], whole_rows: np.ndarray,
            whole_values: list[str]) -> pa.Array:
    """``s`` with byte spans [start, end) of ``rows`` (sorted by row and start, not overlapping)
    replaced by ``markers[marker_ids]``, and the rows ``whole_rows`` replaced by ``whole_values``.

    Each row becomes a sequence of pieces (text before a span, its marker, ..., the rest of the
    text), all pieces are ranges of one buffer (the text bytes, the markers, the whole values),
    and the output bytes are one numpy gather per block of rows. Nulls stay null."""
    n = len(s)
    row_len = np.diff(offsets)
    m_bytes = [m.encode("utf-8") for m in markers]
    m_len = np.array([len(b) for b in m_bytes], dtype=np.int64)
    m_off = np.concatenate(([0], np.cumsum(m_len)[:-1])).astype(np.int64) + len(data)
    w_bytes = [v.encode("utf-8") for v in whole_values]
    w_len = np.array([len(b) for b in w_bytes], dtype=np.int64)
    w_off = np.concatenate(([0], np.cumsum(w_len)[:-1])).astype(np.int64) + len(data) + int(m_len.sum())
    source = np.concatenate((data, np.frombuffer(b"".join(m_bytes), dtype=np.uint8),
                             np.frombuffer(b"".join(w_bytes), dtype=np.uint8)))
    count = np.bincount(rows, minlength=n).astype(np.int64)
    n_pieces = 2 * count + 1
    first_piece = np.concatenate(([0], np.cumsum(n_pieces)[:-1])).astype(np.int64)
    piece_start = np.empty(int(n_pieces.sum()), dtype=np.int64)
    piece_len = np.empty_like(piece_start)
    span_first = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    j = np.arange(len(rows)) - span_first[rows]
    prev_end = np.where(j > 0, np.concatenate(([0], end[:-1])), 0)
    gap = first_piece[rows] + 2 * j
    piece_start[gap] = offsets[rows] + prev_end
    piece_len[gap] = start - prev_end
    piece_start[gap + 1] = m_off[marker_ids]
    piece_len[gap + 1] = m_len[marker_ids]
    last_end = np.zeros(n, dtype=np.int64)
    np.maximum.at(last_end, rows, end)
    tail = first_piece + 2 * count
    piece_start[tail] = offsets[:-1] + last_end
    piece_len[tail] = row_len - last_end
    piece_start[tail[whole_rows]] = w_off
    piece_len[tail[whole_rows]] = w_len
    out_len = np.add.reduceat(piece_len, first_piece) if n else np.zeros(0, np.int64)
    new_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(out_len, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype=np.uint8)
    # Blocks of rows, so the index array stays bounded for a large column.
    row0 = 0
    while row0 < n:
        row1 = int(np.searchsorted(new_offsets, new_offsets[row0] + SPLICE_BLOCK_BYTES, side="right")) - 1
        row1 = min(max(row1, row0 + 1), n)
        p0, p1 = int(first_piece[row0]), int(first_piece[row1]) if row1 < n else len(piece_len)
        lens = piece_len[p0:p1]
        size = int(lens.sum())
        if size:
            starts_out = np.concatenate(([0], np.cumsum(lens)[:-1]))
            idx = np.repeat(piece_start[p0:p1] - starts_out, lens) + np.arange(size, dtype=np.int64)
            out[new_offsets[row0]:new_offsets[row0] + size] = source[idx]
        row0 = row1
    valid = _bool(pc.is_valid(s))
    validity = None if s.null_count == 0 else pa.py_buffer(np.packbits(valid, bitorder="little").tobytes())
    if new_offsets[-1] < 2**31:
        return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(new_offsets.astype(np.int32)),
                                                      pa.py_buffer(out)], null_count=s.null_count)
    return pa.Array.from_buffers(pa.large_string(), n, [validity, pa.py_buffer(new_offsets), pa.py_buffer(out)],
                                 null_count=s.null_count)


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _replace_words(text: str, needles: list[tuple[str, str]]) -> str:
    """Replace each (lower-case) needle found case-insensitively on word boundaries by its marker.
    Plain ``str.find`` on a lower-cased copy (compiling a regex per row would dominate the cost).

    Longest needle first, then by the needle's text; one needle listed under two markers takes the
    marker listed first (the first source column), whatever the string hash seed."""
    unique = list(dict.fromkeys(needles))  # duplicates dropped, first-listed order kept for ties
    folded = text.lower()
    if len(folded) != len(text):  # a case mapping changed the length: positions would not line up
        for needle, marker in sorted(unique, key=lambda nm: (-len(nm[0]), nm[0])):
            pattern = re.compile(r"(?<!\w)" + re.escape(needle) + r"(?!\w)", re.IGNORECASE)
            text = pattern.sub(marker.replace("\\", "\\\\"), text)  # a literal replacement (backslashes escaped)
        return text
    spans: list[tuple[int, int, str]] = []
    end = len(folded)
    # Longest first, so a full name wins over its parts.
    for needle, marker in sorted(unique, key=lambda nm: (-len(nm[0]), nm[0])):
        size = len(needle)
        i = folded.find(needle)
        while i >= 0:
            j = i + size
            before = folded[i - 1] if i else " "
            after = folded[j] if j < end else " "
            if not (before.isalnum() or before == "_" or after.isalnum() or after == "_") and \
                    all(j <= a or i >= b for a, b, _ in spans):
                spans.append((i, j, marker))
            i = folded.find(needle, i + 1)
    if not spans:
        return text
    out, pos = [], 0
    for i, j, marker in sorted(spans):
        out += [text[pos:i], marker]
        pos = j
    out.append(text[pos:])
    return "".join(out)

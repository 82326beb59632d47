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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.masking.tabular.arrow_buffers import is_ascii, offsets_and_data
from securetrain.masking.tabular.transforms import as_string, lower, luhn_valid

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
    """Integer (or whole float) cells that are whole 13-19 digit Luhn-valid card numbers (a numeric
    range test first, so an ordinary integer column costs one comparison). Floats count because an
    integer column with a missing value becomes float64 in pandas."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_floating(arr.type):
        v = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(v) & (v >= 1e12) & (v < 1e19) & (np.floor(v) == v)
        arr = pa.array(np.where(whole, v, 0.0).astype(np.uint64))
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
    # The trimmed, lower-cased values: computed once, shared by every kept column scrubbed with
    # this source (two kernels per source and column otherwise; ~15 ms per 500k values).
    normalized: pa.Array | None = field(default=None, repr=False, compare=False)
    # Computed once from the raw values' buffers (see untrimmed_ascii): every byte ASCII; ASCII with no
    # value starting or ending with whitespace; each value's byte length.
    _ascii: bool | None = field(default=None, init=False, repr=False, compare=False)
    _untrimmed_ascii: bool | None = field(default=None, init=False, repr=False, compare=False)
    _byte_lengths: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def lowered(self) -> pa.Array:
        if self.normalized is None:
            values = as_string(self.values)
            if self.untrimmed_ascii():
                self.normalized = lower(values, ascii=True)
            else:  # trimmed first; a non-ASCII source may still trim to ASCII values
                self.normalized = lower(pc.utf8_trim_whitespace(values), ascii=True if self._ascii else None)
        return self.normalized

    def byte_lengths(self) -> np.ndarray:
        """Each raw value's length in bytes (nulls: 0)."""
        self.untrimmed_ascii()
        assert self._byte_lengths is not None
        return self._byte_lengths

    def untrimmed_ascii(self) -> bool:
        """Every value is ASCII and none starts or ends with whitespace: trimming changes nothing
        and lower-casing keeps byte lengths, so the raw byte lengths are the normalised values'."""
        if self._untrimmed_ascii is None:
            offsets, data = offsets_and_data(as_string(self.values))
            self._byte_lengths = np.diff(offsets)
            self._ascii = is_ascii(data)
            if data.size == 0:
                self._untrimmed_ascii = True
            elif not self._ascii:
                self._untrimmed_ascii = False
            elif int(data.min()) > 0x20:  # no space or control byte anywhere (ids, card numbers, e-mails)
                self._untrimmed_ascii = True
            else:
                # Each value's first and last byte (an empty value reads a neighbour's: at worst
                # a needless trim, never a missed one).
                first = data[np.minimum(offsets[:-1], data.size - 1)]
                last = data[np.maximum(offsets[1:] - 1, 0)]
                self._untrimmed_ascii = not (_EDGE_SPACE[first].any() or _EDGE_SPACE[last].any())
        return self._untrimmed_ascii


# Bytes that may count as whitespace at a value's edge (Unicode White_Space in ASCII, and the
# information separators Python's str.isspace() also trims): any of them sends a source through trimming.
_EDGE_SPACE = np.zeros(256, dtype=bool)
_EDGE_SPACE[[0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20]] = True


def _np_strings(arr: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, "").to_numpy(zero_copy_only=False)).astype(np.dtypes.StringDType())


def _char_lengths(arr: pa.Array) -> pa.Array:
    """``utf8_length``, through the cheaper ``binary_length`` when every byte is ASCII (then equal)."""
    return pc.binary_length(arr) if is_ascii(offsets_and_data(arr)[1]) else pc.utf8_length(arr)


def _fixed_width(arr: pa.Array) -> np.ndarray:
    """A numpy bytes ('S') view of a string array, zero-padded to its longest value (nulls: b"").

    ``numpy.strings.find`` on fixed-width bytes is several times faster than on ``StringDType``
    and the conversion is two pyarrow kernels instead of a Python object per value. Positions are
    byte offsets (equal to character offsets for ASCII text). numpy ignores trailing NUL bytes of
    an 'S' value, so a value ending in NUL can only match more often, never less: the exact
    rewrite decides."""
    arr = as_string(pc.fill_null(arr, ""))
    if not len(arr):
        return np.zeros(0, dtype="S1")
    lengths = pc.binary_length(arr)
    shortest, longest = (int(v.as_py()) for v in pc.min_max(lengths).values())
    width = max(1, longest)
    _, data = offsets_and_data(arr)
    if shortest == longest == width:  # already fixed width (ids, card numbers...): a view
        return np.frombuffer(data, dtype=f"S{width}", count=len(arr))
    if is_ascii(data):  # code points are bytes
        padded = pc.utf8_rpad(arr, width=width, padding="\x00").cast(pa.binary(width))
    else:  # padded per row in bytes (utf8_rpad counts code points)
        pads = pc.binary_repeat(pa.scalar(b"\x00", pa.binary()), pc.subtract(width, lengths))
        padded = pc.binary_join_element_wise(arr.cast(pa.binary()), pads, b"").cast(pa.binary(width))
    return np.frombuffer(padded.buffers()[1], dtype=f"S{width}", count=len(arr), offset=padded.offset * width)


FIXED_WIDTH_BUDGET = 1 << 26  # bytes: above this (one very long text) the StringDType path is used


def _fits_fixed_width(n: int, width: int, nbytes: int) -> bool:
    """Whether n values padded to ``width`` bytes stay within the budget (or 4x the column)."""
    return n * max(width, 1) <= max(FIXED_WIDTH_BUDGET, 4 * nbytes)


class _TextFinder:
    """``numpy.strings.find`` of per-row needles in the rows of a lower-cased text column: on
    fixed-width bytes when the column fits :data:`FIXED_WIDTH_BUDGET`, else on ``StringDType``."""

    def __init__(self, lower_text: pa.Array) -> None:
        lengths = pc.binary_length(lower_text)
        self.max_bytes = int(pc.max(lengths).as_py() or 0) if len(lower_text) else 0
        self.fixed = _fits_fixed_width(len(lower_text), self.max_bytes, lower_text.nbytes)
        self._hay = _fixed_width(lower_text) if self.fixed else _np_strings(lower_text)

    def needles(self, needles: pa.Array) -> np.ndarray:
        """``needles`` in the finder's numpy representation (callers drop needles longer than
        ``max_bytes`` first: they cannot occur, and would widen every fixed-width value)."""
        return _fixed_width(needles) if self.fixed else _np_strings(needles)

    def find(self, rows: np.ndarray | None, needles: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        """Position of each needle in its row's text (``rows`` None: one needle per row, in order)
        at or after ``start`` (-1: not found). Byte positions on the fixed-width path, character
        positions otherwise: equal for ASCII rows, the only rows whose positions are used."""
        hay = self._hay if rows is None else self._hay.take(rows)  # take: about 2x faster than [] on bytes
        return np.asarray(np.strings.find(hay, needles) if start is None else np.strings.find(hay, needles, start),
                          dtype=np.int64)


MAX_CATEGORIES = 2000
MAX_SUBSTRINGS = 100_000
CATEGORY_PROBE = 4 * MAX_CATEGORIES  # leading values looked at first by _aligned_substrings


def _aligned_substrings(lower_text: pa.Array, min_length: int) -> set[str] | None:
    """For a low-cardinality column (categories), every substring of its distinct values that a
    needle could match on word boundaries (starts after a non-word character, ends before one).
    None when the column is real free text (then every row is checked against its own values)."""
    present = lower_text.drop_null()
    # The first rows often settle it (free text): more distinct values there than a category
    # column may have means more in the whole column too.
    if len(present) > 4 * CATEGORY_PROBE and len(pc.unique(present.slice(0, CATEGORY_PROBE))) > MAX_CATEGORIES:
        return None
    distinct = pc.unique(present)
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


# Rows per share when a long text column is scrubbed on several threads (fewer rows: one share).
SCRUB_SHARE_MIN_ROWS = 50_000


def scrub_row_values(text: pa.Array | pa.ChunkedArray, sources: Sequence[RowSource], *, min_length: int,
                     parts: bool, threads: int = 1) -> tuple[pa.Array, int]:
    """:func:`_scrub_rows` on up to ``threads`` threads, each scrubbing a contiguous share of the
    rows (at least :data:`SCRUB_SHARE_MIN_ROWS` each). Each row's result depends only on that
    row, so the shares, concatenated, are the result of one pass; the kernels (pyarrow, numpy's
    string search) release the GIL, so a long free-text column no longer holds one core while
    the other masks columns that finish first."""
    s = as_string(text)
    n = len(s)
    shares = max(1, min(threads, n // SCRUB_SHARE_MIN_ROWS))
    if shares == 1 or not sources:
        return _scrub_rows(s, sources, min_length=min_length, parts=parts)
    lowered = [src.lowered() for src in sources]  # once, here: the shares slice it
    cuts = np.linspace(0, n, shares + 1).astype(np.int64).tolist()
    pieces = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    with ThreadPoolExecutor(max_workers=shares, thread_name_prefix="securetrain-scrub") as pool:
        results = list(pool.map(
            lambda piece: _scrub_rows(s.slice(*piece), [
                RowSource(column=src.column, values=as_string(src.values).slice(*piece), marker=src.marker,
                          parts=src.parts, normalized=low.slice(*piece))
                for src, low in zip(sources, lowered)], min_length=min_length, parts=parts),
            pieces))
    return pa.concat_arrays([out for out, _ in results]), sum(changed for _, changed in results)


def _scrub_rows(text: pa.Array | pa.ChunkedArray, sources: Sequence[RowSource], *, min_length: int,
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
    # Byte lengths the category substrings have: an ASCII source value of another length cannot
    # be one of them (lower-casing ASCII keeps the length), so most sources skip the hash lookup.
    set_lengths = None
    if value_set is not None:
        set_lengths = np.zeros(int(pc.max(pc.binary_length(value_set)).as_py()) + 2, dtype=bool)
        set_lengths[pc.binary_length(value_set).to_numpy(zero_copy_only=False)] = True
    has_text = _bool(pc.is_valid(s))
    all_rows = np.arange(n)
    finder: _TextFinder | None = None
    markers: dict[str, int] = {}
    hit_rows: list[np.ndarray] = []
    hit_needles: list[pa.Array] = []
    hit_np: list[np.ndarray] = []
    hit_markers: list[np.ndarray] = []
    hit_pos: list[np.ndarray] = []
    for src in sources:
        if value_set is not None:
            # Categories: a hash lookup of the trimmed, lower-cased values in the small set, skipped
            # when no ASCII value has the byte length of any of its substrings.
            assert set_lengths is not None
            if src.untrimmed_ascii():  # raw lengths are the normalised ones: no kernel over the values yet
                lengths = src.byte_lengths()
                maybe = bool(set_lengths[np.minimum(lengths, len(set_lengths) - 1)].any())
            else:
                maybe = True
            whole = has_text & _bool(pc.is_in(src.lowered(), value_set=value_set)) if maybe else np.zeros(n, bool)
            if not whole.any() and not (parts and src.parts):
                continue
            lower_vals = src.lowered()
        else:
            lower_vals = src.lowered()
            whole = has_text & _bool(pc.greater_equal(_char_lengths(lower_vals), min_length))
        # Every row a candidate (the usual free-text case): no filtered copies, no gather of the text.
        candidates: list[tuple[np.ndarray, pa.Array]] = [
            (all_rows, lower_vals) if whole.all() else (all_rows[whole], lower_vals.filter(pa.array(whole)))]
        if parts and src.parts:
            candidates.append(_part_candidates(lower_vals, has_text, min_length, value_set))
        for row_idx, needles in candidates:
            if not len(row_idx):
                continue
            if finder is None:
                finder = _TextFinder(lower_text)
            fits = _bool(pc.less_equal(pc.binary_length(needles), finder.max_bytes))
            if not fits.all():
                row_idx, needles = row_idx[fits], needles.filter(pa.array(fits))
            sub = finder.needles(needles)
            pos = finder.find(None if row_idx is all_rows else row_idx, sub)
            found = pos >= 0
            if found.any():
                hit_rows.append(row_idx[found])
                hit_needles.append(needles.filter(pa.array(found)))
                hit_np.append(sub[found])
                hit_markers.append(np.full(int(found.sum()), markers.setdefault(src.marker, len(markers))))
                hit_pos.append(pos[found])
    if finder is None or not hit_rows:
        return s, 0
    return _rewrite(s, finder, np.concatenate(hit_rows), pa.concat_arrays(hit_needles), np.concatenate(hit_np),
                    np.concatenate(hit_markers), np.concatenate(hit_pos), list(markers))


# ASCII characters for which ``str.isalnum() or == "_"`` holds (word characters of _replace_words).
_ASCII_WORD = np.zeros(256, dtype=bool)
_ASCII_WORD[np.frombuffer(b"0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)] = True
MAX_SPANS_PER_ROW = 16  # rows with more candidate spans than this are rewritten by _replace_words


def _plain_ascii_rows(s: pa.Array) -> np.ndarray:
    """Per row: the text is ASCII without NUL bytes (then Python's lower() keeps every position,
    word characters are [0-9A-Za-z_], and numpy's fixed-width find positions are exact)."""
    ok = _bool(pc.string_is_ascii(s))
    _, data = offsets_and_data(s)
    if data.size and int(data.min()) == 0:
        ok &= ~_bool(pc.match_substring(s, "\x00"))
    return ok


def _rewrite(s: pa.Array, finder: _TextFinder, rows: np.ndarray, needles: pa.Array, needles_np: np.ndarray,
             marker_ids: np.ndarray, first_pos: np.ndarray, markers: list[str]) -> tuple[pa.Array, int]:
    """Apply ``_replace_words`` to every row with (row, needle, marker) hits, vectorised.

    For plain-ASCII rows (case folding keeps every position; word characters are [0-9A-Za-z_])
    this is exact and needs no Python per row: all occurrences of each needle are found with
    ``numpy.strings.find``, word boundaries are checked on the byte buffer, the greedy choice of
    _replace_words (longest needle first, then the needle's text, then the marker listed first,
    then position; a span is taken unless it overlaps one already taken) runs as one vectorised
    round per rank within the row, and the output is assembled by pyarrow kernels (:func:`_splice`).
    A repeated (needle, marker) of a row only yields identical spans, which the greedy choice
    drops. Other rows (non-ASCII or NUL text, an empty needle, too many spans) go through
    _replace_words itself."""
    n = len(s)
    offsets, data = offsets_and_data(s)
    row_len = np.diff(offsets)
    needle_len = pc.binary_length(needles).to_numpy(zero_copy_only=False).astype(np.int64)
    needle_order = _needle_order(rows, needles, needle_len)
    slow = np.zeros(n, dtype=bool)
    is_hit = np.zeros(n, dtype=bool)
    is_hit[rows] = True
    hit = np.nonzero(is_hit)[0]
    slow[hit[~_plain_ascii_rows(s.take(pa.array(hit)))]] = True
    slow[rows[needle_len == 0]] = True

    # All occurrences of each needle (overlapping ones too: str.find from i + 1).
    fast = np.nonzero(~slow[rows])[0]
    occ_pair, occ_pos = [fast], [first_pos[fast]]
    cur, cur_pos = fast, first_pos[fast]
    while len(cur):
        cur_rows = rows.take(cur)
        room = cur_pos + 1 + needle_len.take(cur) <= row_len.take(cur_rows)  # another occurrence fits
        cur, cur_pos, cur_rows = cur[room], cur_pos[room], cur_rows[room]
        nxt = finder.find(cur_rows, needles_np.take(cur), cur_pos + 1)
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
    # _replace_words's order: needle order (length, text), then the marker listed first (marker
    # ids follow the sources' order), then each occurrence in turn.
    prio = needle_order[pair] * max(len(markers), 1) + marker_ids[pair]
    order = _sort_order(r, prio, start)
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
    order = _sort_order(r, start)
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
    is_hit[:] = False
    is_hit[r] = True
    is_hit[slow_rows] = True
    idx = pa.array(np.nonzero(is_hit)[0])
    changed = int(pc.sum(pc.not_equal(out.take(idx), s.take(idx))).as_py() or 0)
    return out, changed


def _needle_order(rows: np.ndarray, needles: pa.Array, needle_len: np.ndarray) -> np.ndarray:
    """Per (row, needle) pair, a key that orders the needles of each row as _replace_words sorts
    them: longest first, then Python's str order (= UTF-8 byte order, pyarrow's sort).

    Only needles of equal length in the same row need their text compared, so only those pairs
    (found by a stable sort of (row, length) keys) get a text rank; every other
    pair's order within its row is decided by its length alone."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    longest = int(needle_len.max())
    key = rows.astype(np.int64) * (longest + 1) + needle_len
    # The pairs come as one ascending run of rows per source, so a stable sort (timsort) of the
    # (row, length) keys only merges a few sorted runs.
    order = np.argsort(key, kind="stable")
    same = key[order[1:]] == key[order[:-1]]
    tied = np.zeros(len(rows), dtype=bool)
    tied[order[1:][same]] = True
    tied[order[:-1][same]] = True
    text_rank = np.zeros(len(rows), dtype=np.int64)
    if tied.any():
        enc = pc.dictionary_encode(needles.filter(pa.array(tied)))
        rank = np.empty(len(enc.dictionary), dtype=np.int64)
        rank[np.asarray(pc.array_sort_indices(enc.dictionary))] = np.arange(len(enc.dictionary))
        text_rank[tied] = rank[enc.indices.to_numpy(zero_copy_only=False)]
    return (longest - needle_len) * (int(text_rank.max()) + 1) + text_rank


def _sort_order(*keys: np.ndarray) -> np.ndarray:
    """Stable order by ``keys`` (first key most significant; non-negative integers): one argsort of
    a packed int64 key where the ranges allow, else lexsort."""
    if not len(keys[0]):
        return np.zeros(0, dtype=np.int64)
    spans = [int(k.max()) + 1 for k in keys]
    if np.prod([float(x) for x in spans]) < 2.0**62:
        packed = np.zeros(len(keys[0]), dtype=np.int64)
        for k, size in zip(keys, spans):
            packed *= size
            packed += k
        return np.argsort(packed, kind="stable")
    return np.lexsort(keys[::-1])


def _splice(s: pa.Array, offsets: np.ndarray, data: np.ndarray, rows: np.ndarray, start: np.ndarray,
            end: np.ndarray, marker_ids: np.ndarray, markers: list[str], whole_rows: np.ndarray,
            whole_values: list[str]) -> pa.Array:
    """``s`` with byte spans [start, end) of ``rows`` (sorted by row and start, not overlapping)
    replaced by ``markers[marker_ids]``, and the rows ``whole_rows`` (which have no spans)
    replaced by ``whole_values``.

    The text buffer is cut, without copying, into a string array of pieces at every row and span
    boundary (row r becomes text, span, text, ..., text); ``take`` swaps each span piece for its
    marker and each whole row for its new value, and ``binary_join`` glues each row's pieces back
    together. Nulls stay null."""
    n = len(s)
    count = np.bincount(rows, minlength=n).astype(np.int64)
    n_pieces = 2 * count + 1
    first_piece = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_pieces, out=first_piece[1:])
    total = int(first_piece[-1])
    # Piece boundaries: each row's start, then its spans' starts and ends; the text's end last.
    bounds = np.empty(total + 1, dtype=np.int64)
    bounds[first_piece[:-1]] = offsets[:-1]
    bounds[-1] = offsets[-1]
    j = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)
    span_piece = first_piece[rows] + 2 * j + 1
    bounds[span_piece] = offsets[rows] + start
    bounds[span_piece + 1] = offsets[rows] + end
    big = len(data) >= 2**31
    text_type, offset_type = (pa.large_string(), np.int64) if big else (pa.string(), np.int32)
    pieces = pa.Array.from_buffers(text_type, total, [None, pa.py_buffer(bounds.astype(offset_type)),
                                                      pa.py_buffer(data)])
    take = np.arange(total, dtype=np.int64)
    take[span_piece] = total + marker_ids
    take[first_piece[whole_rows]] = total + len(markers) + np.arange(len(whole_rows))
    extra = pa.array(markers + whole_values, text_type)
    swapped = pc.take(pa.concat_arrays([pieces, extra]), pa.array(take))
    list_type = pa.LargeListArray if big else pa.ListArray
    rows_of_pieces = list_type.from_arrays(pa.array(first_piece.astype(offset_type)), swapped,
                                           mask=pc.is_null(s) if s.null_count else None)
    return pc.binary_join(rows_of_pieces, "")


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

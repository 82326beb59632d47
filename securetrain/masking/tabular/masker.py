"""Apply a masking policy to a pyarrow table or a CSV/Parquet file.

Fail closed: every column must resolve to a rule (or the policy default) before any output is
produced; columns passed through unmasked are scanned for PII-shaped values; any transform error
aborts the whole table. Output tables carry only masked columns plus provenance metadata
(policy version/digest, key id) -- the input's schema metadata is dropped, as it can hold anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Collection, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.cpus import usable_cpus
from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.tabular import detectors as D
from securetrain.masking.tabular import transforms as T
from securetrain.masking.tabular.csvtext import csv_text_field, infer_types, is_csv_text
from securetrain.masking.tabular.errors import (
    MalformedTableError,
    MaskKeyError,
    PIIDetectedError,
    TabularMaskingError,
    UnmaskedColumnError,
)
from securetrain.masking.tabular.policy import (
    DefaultAction,
    DropRule,
    EmailRule,
    GeneralizeRule,
    KeepRule,
    MaskingPolicy,
    PanRule,
    PhoneRule,
    RedactRule,
    TokenizeRule,
    load_policy,
)
from securetrain.masking.tabular.tableio import (
    csv_line_end,
    csv_output,
    detect_format,
    parse_table,
    read_bytes,
    read_csv_header,
    serialize_table,
)

METADATA_KEY = b"securetrain.masking"
# Rules that remove a direct identifier: their values are scrubbed from kept text of the same row.
_IDENTIFIER_RULES = (TokenizeRule, PanRule, EmailRule, PhoneRule, RedactRule, DropRule)
# Identifier values that look like personal names (two or more words of letters) feed the person
# detector's list of known names.
_NAME_SHAPE = r"^\p{L}[\p{L}'’.\-]*(?:\s+\p{L}[\p{L}'’.\-]*)+$"
_LETTER = r"[^\W\d_]"  # \p{L} in Python's re
_NAME_SHAPE_PY = re.compile(rf"{_LETTER}(?:{_LETTER}|['’.\-])*(?:\s+{_LETTER}(?:{_LETTER}|['’.\-])*)+")


def _mostly_names(values: pa.Array, sample: int = 1000) -> bool:
    """Whether a column holds personal names (judged on its first non-null values, so an id or
    e-mail column costs nothing): only such columns feed the list of known names."""
    head = values.slice(0, 4 * sample).drop_null().slice(0, sample).to_pylist()
    # A strict majority of name-shaped values; stops as soon as the count is decided (an id or
    # e-mail column after about half the sample). Python's re here: RE2 recompiles the Unicode
    # classes on every call, which costs more than checking a thousand short values.
    need = len(head) // 2 + 1
    hits = misses = 0
    for v in head:
        if _NAME_SHAPE_PY.fullmatch(v.strip()) is not None:
            hits += 1
            if hits >= need:
                return True
        else:
            misses += 1
            if misses > len(head) - need:
                return False
    return False


def _is_integer(t: pa.DataType) -> bool:
    return pa.types.is_integer(t.value_type if pa.types.is_dictionary(t) else t)


@dataclass
class _ScanContext:
    sources: list[Any] = field(default_factory=list)
    scanner: Any = None
    threads: int = 1  # for one long text column's row-value scrub (detectors.scrub_row_values)
MIN_KEY_BYTES = 16
THREADS_ENV = "SECURETRAIN_TABULAR_THREADS"
# Output columns with at least this share of distinct values (tokens of ids, e-mails...) are written
# without Parquet dictionary encoding (see tableio.serialize_table).
UNIQUE_SHARE = 0.5

# Below this many rows a table's columns run one after another (a thread pool costs more).
PARALLEL_MIN_ROWS = 20_000


def column_threads() -> int:
    """Threads that mask a table's columns: ``SECURETRAIN_TABULAR_THREADS`` (1: one after
    another), by default 2 where this process may run on 2 or more CPUs and, right now, at least 2
    of them are not running other tasks (with one CPU to share, two threads only take turns at
    the GIL, which costs more than it gains)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise TabularMaskingError(
                f"{THREADS_ENV}={raw!r} is not a number of threads",
                hint="set it to 1 (one column at a time) or more, or unset it for the default",
            )
        return threads
    return max(1, min(2, usable_cpus() - _other_runnable_tasks()))


def _other_runnable_tasks() -> int:
    """Tasks runnable on this machine right now besides the calling thread (Linux: the first part
    of /proc/loadavg's 4th field; 0 where that cannot be read). Sampled between tables, when this
    process's own workers are idle, so it counts other work only."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            runnable = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, runnable - 1)


def _is_scan(rule: Any) -> bool:
    """Rules whose column is kept and may be scanned by the detectors (they share one scanner)."""
    return isinstance(rule, (KeepRule, DefaultAction))


def _is_kept(rule: Any) -> bool:
    return isinstance(rule, KeepRule) or (isinstance(rule, DefaultAction) and rule.action == "keep")


def _scans(rule: Any) -> bool:
    """Kept and scanned by the detectors (when they are enabled)."""
    return (isinstance(rule, KeepRule) and rule.scan) or (isinstance(rule, DefaultAction) and rule.action == "keep")


def _is_text_rule(rule: Any) -> bool:
    """Rules that work on a column's text: a CSV column under one is read as strings, its empty
    cells as missing."""
    return isinstance(rule, _STRING_ACTIONS) or (isinstance(rule, DefaultAction) and rule.action == "redact")


def _outcome_now(fn: Callable[[str], tuple[Any, ColumnReport]], name: str
                 ) -> Callable[[], tuple[Any, ColumnReport]]:
    """Run ``fn(name)`` now; the returned callable gives its result or raises its error."""
    try:
        value = fn(name)
    except Exception as exc:
        error = exc

        def fail() -> tuple[Any, ColumnReport]:
            raise error

        fail.error = error  # type: ignore[attr-defined]  # read by _peek_error
        return fail
    return lambda: value


def _peek_error(outcome: Callable[[], Any]) -> BaseException | None:
    return getattr(outcome, "error", None)
_STRING_ACTIONS = (TokenizeRule, RedactRule, PanRule, EmailRule, PhoneRule)


@dataclass
class ColumnReport:
    column: str
    action: str
    rule: str  # selector that matched, or "default"
    nulls: int = 0
    invalid: int = 0
    distinct: int | None = None
    detections: dict[str, int] = field(default_factory=dict)


@dataclass
class MaskReport:
    policy_name: str
    policy_version: str
    policy_digest: str
    key_id: str
    rows: int
    columns: list[ColumnReport]
    input_sha256: str | None = None
    output_sha256: str | None = None
    # CSV input: its line end, which CSV output keeps ("\r\n" or "\n").
    csv_line_end: str | None = None
    # CSV output: the policy's formula guard applied to it, and the cells it escaped.
    csv_formula_guard: str | None = None
    formula_cells_escaped: int = 0

    @property
    def output_columns(self) -> list[str]:
        return [c.column for c in self.columns if c.action != "drop"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_key(key: bytes) -> bytes:
    if isinstance(key, str):
        raise MaskKeyError("the masking key must be bytes, not str", hint="decode a hex key with bytes.fromhex(...)")
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        raise MaskKeyError(
            f"the masking key must be at least {MIN_KEY_BYTES} bytes (32 recommended)",
            hint="generate one with: python -c 'import secrets; print(secrets.token_hex(32))'",
        )
    return bytes(key)


class TabularMasker:
    """Masks tables according to ``policy`` with tokenisation key ``key`` (>= 16 bytes)."""

    def __init__(
        self,
        policy: MaskingPolicy | str | os.PathLike[str],
        key: bytes,
        audit: AuditRecorder | None = None,
    ) -> None:
        self.policy = policy if isinstance(policy, MaskingPolicy) else load_policy(policy)
        key = _check_key(key)
        self._token_key = T.derive_token_key(key)
        self.key_id = T.key_id(key)
        self.policy_digest = self.policy.digest
        self._audit: AuditRecorder = audit or NullAuditRecorder()

    def __repr__(self) -> str:  # never show key material
        return f"TabularMasker(policy={self.policy.name!r} v{self.policy.policy_version}, key_id={self.key_id})"

    def __reduce__(self) -> Any:
        raise TypeError("TabularMasker holds key material and cannot be pickled")

    # -- planning -------------------------------------------------------------------------------
    def plan(self, columns: list[str]) -> dict[str, Any]:
        """Map each column to its rule; raise UnmaskedColumnError listing every unmatched column."""
        plan = {c: self.policy.rule_for(c) for c in columns}
        missing = [c for c, r in plan.items() if r is None]
        if missing:
            unnamed = [c for c in missing if not c.strip()]
            odd = [c for c in missing if c.strip() and (c != c.strip() or not c.isprintable())]
            shown = ", ".join(f"{c!r} (unnamed)" if not c.strip() else repr(c) if c in odd else c for c in missing)
            hint = "add rules for them (keep/drop/redact/...) or set a 'default' action in the policy"
            if odd:
                hint += ("; names are matched exactly: a name with spaces around it or a line break in it "
                         "(shown quoted) needs the header fixed, or a rule for that exact name")
            if unnamed:
                hint += ("; a column without a name is often a pandas index written by to_csv: "
                         "write the file with index=False, or name the column")
            raise UnmaskedColumnError(
                f"{len(missing)} column(s) match no rule in policy {self.policy.name!r} "
                f"v{self.policy.policy_version} and it has no default: {shown}",
                hint=hint,
            )
        return plan

    def string_columns(self, columns: list[str]) -> set[str]:
        """Columns whose rule works on text (read CSV as strings so '007' stays '007', empty cells
        as missing). The other CSV columns are read as written too (see :meth:`read_masked`)."""
        return {c for c, r in self.plan(columns).items() if _is_text_rule(r)}

    # -- masking --------------------------------------------------------------------------------
    def mask_table(self, table: pa.Table) -> pa.Table:
        return self.mask_table_with_report(table)[0]

    def mask_table_with_report(
        self,
        table: pa.Table,
        *,
        resource: str = "table",
        on_column: Callable[[str], None] | None = None,
        csv_text_columns: Collection[str] = (),
    ) -> tuple[pa.Table, MaskReport]:
        """Mask ``table``. ``csv_text_columns``: its string columns that hold a CSV's cells as
        written (:meth:`read_masked`); they are generalised and scanned as the types pyarrow's CSV
        reader infers from that text, and kept as the text itself, marked as CSV text
        (:mod:`~securetrain.masking.tabular.csvtext`)."""
        try:
            out, reports = self._mask(table, on_column, frozenset(csv_text_columns))
        except TabularMaskingError as exc:
            self._audit.record(
                "mask.policy_applied", resource, outcome="refused",
                details={**self._provenance(), "rows": table.num_rows, "error": type(exc).__name__},
            )
            raise
        report = MaskReport(
            policy_name=self.policy.name, policy_version=self.policy.policy_version,
            policy_digest=self.policy_digest, key_id=self.key_id, rows=table.num_rows, columns=reports,
        )
        self._audit.record(
            "mask.policy_applied", resource,
            details={
                **self._provenance(), "rows": table.num_rows,
                # Column names are values, never detail keys: a column called "ssn" or "token"
                # would trip the audit log's secret-key-name filter (and keys are not data).
                "actions": [{"column": r.column, "action": r.action} for r in reports],
                "invalid": sum(r.invalid for r in reports),
                "detections": sum(sum(r.detections.values()) for r in reports),
            },
        )
        return out, report

    def _provenance(self) -> dict[str, str]:
        return {
            "policy_name": self.policy.name, "policy_version": self.policy.policy_version,
            "policy_digest": self.policy_digest, "key_id": self.key_id,
        }

    def _mask(self, table: pa.Table, on_column: Callable[[str], None] | None,
              csv_text: frozenset[str] = frozenset()) -> tuple[pa.Table, list[ColumnReport]]:
        names = table.column_names
        if len(set(names)) != len(names):
            counts = Counter(names)
            dupes = ", ".join(f"{c if c.strip() else repr(c)} ({k} times)" for c, k in counts.items() if k > 1)
            raise MalformedTableError(f"the table has duplicate column names: {dupes}", hint="rename the duplicates")
        plan = self.plan(names)
        threads = column_threads()  # sampled once per table: the columns and a long text's scrub share it
        csv_text = csv_text & set(names)
        # CSV text as pyarrow would have typed it, where a type is needed: to choose how a kept
        # column is scanned (numbers only for card numbers, as typed numbers are), here, as the scan
        # context depends on it; to generalise, in that column's job (below).
        scanning = self.policy.detectors.enabled
        typed = infer_types({c: table.column(c) for c in names
                             if c in csv_text and scanning and _scans(plan[c])}) if csv_text else {}
        context = self._scan_context(table, plan, typed, csv_text)
        context.threads = threads

        def one(name: str) -> tuple[Any, ColumnReport]:
            rule = plan[name]
            column = table.column(name)
            as_typed = typed.get(name)
            if name in csv_text and isinstance(rule, GeneralizeRule):  # bins and dates: from the values
                column = infer_types({name: column})[name]
            is_default = isinstance(rule, DefaultAction)
            report = ColumnReport(column=name, action=rule.action, rule="default" if is_default else rule.selector,
                                  nulls=column.null_count)
            try:
                result = self._apply(rule, column, report, scan_if_kept=not isinstance(rule, KeepRule) or rule.scan,
                                     context=context, typed=as_typed)
            except TabularMaskingError:
                raise
            except T.UnparsableValuesError as exc:  # counts and the expected format only
                raise MalformedTableError(
                    f"column {name!r}: cannot apply action {rule.action!r}: {exc} (values withheld)",
                    hint="fix those cells, or change the column's rule (e.g. its date_format)",
                ) from None
            except (pa.ArrowException, TypeError, ValueError) as exc:
                # pyarrow messages can quote cell values: report only the column, rule and error type.
                raise MalformedTableError(
                    f"column {name!r}: cannot apply action {rule.action!r} ({type(exc).__name__}; values withheld)",
                    hint="check the column's type and contents, or change its rule",
                ) from None
            return result, report

        out_cols: list[pa.Array] = []
        out_fields: list[pa.Field] = []
        reports: list[ColumnReport] = []
        # closing: on an error, the pool's pending columns are cancelled and its threads joined now.
        with contextlib.closing(self._run_columns(names, plan, table.num_rows, one, threads)) as outcomes:
            for name, outcome in outcomes:
                result, report = outcome()
                reports.append(report)
                if result is not None:
                    # A kept CSV column is its text (as written, or scrubbed/redacted): marked as
                    # such, so the step that makes tensors of it infers its type again.
                    marked = name in csv_text and _is_kept(plan[name])
                    out_fields.append(csv_text_field(name, result.type) if marked else pa.field(name, result.type))
                    out_cols.append(result)
                if on_column is not None:
                    on_column(name)
        meta = {METADATA_KEY: json.dumps(self._provenance(), sort_keys=True).encode()}
        if not out_cols:
            return pa.table({}, metadata=meta).slice(0, 0), reports
        return pa.Table.from_arrays(out_cols, schema=pa.schema(out_fields, metadata=meta)), reports

    def _run_columns(self, names: list[str], plan: dict[str, Any], rows: int,
                     one: Callable[[str], tuple[Any, ColumnReport]], threads: int
                     ) -> Generator[tuple[str, Callable[[], tuple[Any, ColumnReport]]], None, None]:
        """(name, outcome) per column in table order; calling ``outcome`` returns that column's
        (result, report) or raises its error, so the first failing column in table order is the
        one reported, whatever order the work ran in.

        With more than one thread (:func:`column_threads`) and enough rows, the columns run on a
        thread pool: pyarrow's kernels, numpy's and DataFusion's release the GIL, so a column's
        tokens overlap another's work. The kept (scanned) columns run one after another in one
        job, in table order (they share the detector scanner), the other columns one job each."""
        if threads <= 1 or rows < PARALLEL_MIN_ROWS or len(names) < 2:
            for name in names:
                yield name, _outcome_now(one, name)
            return
        kept = [n for n in names if _is_scan(plan[n])]
        kept_outcomes: dict[str, Callable[[], tuple[Any, ColumnReport]]] = {}

        def kept_chain() -> None:
            for name in kept:
                kept_outcomes[name] = _outcome_now(one, name)
                if _peek_error(kept_outcomes[name]) is not None:
                    return  # later kept columns cannot be reported: an earlier column failed

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="securetrain-mask") as pool:
            chain = pool.submit(kept_chain) if kept else None
            kept_set = set(kept)
            futures = {n: pool.submit(one, n) for n in names if n not in kept_set}
            try:
                for name in names:
                    if name in futures:
                        yield name, futures[name].result
                    else:
                        assert chain is not None
                        chain.result()
                        yield name, kept_outcomes[name]
            finally:
                for future in futures.values():
                    future.cancel()

    def _apply(self, rule: Any, column: pa.ChunkedArray, report: ColumnReport, *, scan_if_kept: bool,
               context: _ScanContext | None = None, typed: pa.ChunkedArray | None = None) -> Any:
        stats = T.ColumnStats()
        k = self._token_key
        if isinstance(rule, DropRule) or (isinstance(rule, DefaultAction) and rule.action == "drop"):
            return None
        if pa.types.is_floating(column.type) and (
                isinstance(rule, _STRING_ACTIONS) or (isinstance(rule, DefaultAction) and rule.action == "redact")):
            # NaN is a missing value (pandas' null), not the text "nan" to tokenise or redact.
            column = pc.if_else(pc.is_nan(column), pa.scalar(None, column.type), column)
            report.nulls = column.null_count
        if isinstance(rule, RedactRule) or (isinstance(rule, DefaultAction) and rule.action == "redact"):
            return T.redact(column, rule.replacement)
        if isinstance(rule, (KeepRule, DefaultAction)):  # default keep
            return self._scan_kept(column, report, context or _ScanContext(), typed) if scan_if_kept else column
        if isinstance(rule, TokenizeRule):
            out = T.tokenize(T.normalize(T.as_string(column), rule.normalize), k, domain=rule.domain,
                             prefix=rule.prefix, length=rule.length, stats=stats)
        elif isinstance(rule, GeneralizeRule):
            if rule.granularity is not None:
                out = T.generalize_date(column, granularity=rule.granularity, date_format=rule.date_format)
            else:
                assert rule.bins is not None
                out = T.generalize_bins(column, rule.bins)
        elif isinstance(rule, PanRule):
            out, report.invalid = T.pan(column, k, mode=rule.mode, validate_luhn=rule.validate_luhn,
                                        prefix=rule.prefix, length=rule.length, domain=rule.domain, stats=stats)
            if report.invalid and rule.on_invalid == "error":
                raise MalformedTableError(
                    f"column {report.column!r}: {report.invalid} value(s) are not valid card numbers",
                    hint="set on_invalid: redact to replace them with " + T.INVALID_PAN,
                )
        elif isinstance(rule, EmailRule):
            out, report.invalid = T.email(column, k, keep_domain=rule.keep_domain, prefix=rule.prefix,
                                          length=rule.length, domain=rule.domain, stats=stats)
        elif isinstance(rule, PhoneRule):
            out, report.invalid = T.phone(column, k, keep_last=rule.keep_last, prefix=rule.prefix,
                                          length=rule.length, domain=rule.domain, stats=stats)
        else:  # pragma: no cover - the policy union is closed
            raise TabularMaskingError(f"unsupported rule {type(rule).__name__}")
        report.distinct = stats.distinct
        return out

    def _scan_context(self, table: pa.Table, plan: dict[str, Any], typed: dict[str, pa.ChunkedArray] | None = None,
                      csv_text: Collection[str] = ()) -> _ScanContext:
        """What scanning kept columns needs from the rest of the table: the identifier columns'
        values per row (to scrub) and the names among them (for the person detector). ``typed``:
        CSV text columns as pyarrow types them (a kept column of numbers is not scanned as text)."""
        cfg = self.policy.detectors
        types: dict[str, pa.ChunkedArray] = dict(typed or {})

        def as_typed(c: str) -> Any:
            return types.get(c, table.column(c))

        scanned = [c for c, r in plan.items() if _scans(r)]
        scanned = [c for c in scanned if not _is_integer(as_typed(c).type) and T.scannable(as_typed(c)) is not None]
        if not cfg.enabled or not scanned:
            return _ScanContext()
        # Dropped CSV columns are sources where pyarrow types them as text or integers (as typed
        # columns are), with the values as written ("ref 007" holds the id 007, not 7).
        types.update(infer_types({c: table.column(c) for c, r in plan.items()
                                  if c in csv_text and c not in types and isinstance(r, _IDENTIFIER_RULES)}))
        sources: list[D.RowSource] = []
        for name, rule in plan.items():
            if isinstance(rule, _IDENTIFIER_RULES):
                kind = as_typed(name)
                view = T.scannable(kind)
                if view is not None:
                    if name in csv_text:
                        view = T.as_string(table.column(name))
                    names_like = not _is_integer(kind.type) and _mostly_names(view)
                    sources.append(D.RowSource(column=name, values=view, marker=f"[{name.upper()}]",
                                               parts=names_like))
        known: list[str] = []
        if "person" in cfg.detectors:
            for src in sources:
                if not src.parts:
                    continue
                distinct = pc.unique(pc.utf8_trim_whitespace(src.values).drop_null())
                known += distinct.filter(pc.match_substring_regex(distinct, _NAME_SHAPE)).to_pylist()
        scanner = D.TextScanner(cfg.detectors, phone_regions=cfg.phone_regions, known_names=known)
        return _ScanContext(sources=sources if cfg.row_values != "off" else [], scanner=scanner)

    def _scan_kept(self, column: Any, report: ColumnReport, context: _ScanContext,
                   typed: pa.ChunkedArray | None = None) -> Any:
        """``column`` scanned (and scrubbed or redacted by the policy). ``typed``: for CSV text,
        the column as pyarrow types it, which says how it is scanned; the output is the text."""
        cfg = self.policy.detectors
        if not cfg.enabled:
            return column
        kind = column if typed is None else typed
        if _is_integer(kind.type) or pa.types.is_floating(kind.type):
            # Integer (and float) columns: only whole-value card numbers are possible (a numeric
            # test first, so no string view is made of an ordinary number column).
            mask = D.integer_pan_mask(kind) if "pan" in cfg.detectors else np.zeros(len(column), bool)
            hits, redacted = ({"pan": mask} if mask.any() else {}), None
            if hits and cfg.on_detect == "redact_values":
                redacted = pc.if_else(pa.array(mask), pa.scalar("[PAN]"), T.as_string(column))
        else:
            s = T.scannable(kind)
            if s is None:
                if T.holds_no_text(kind.type):
                    return column
                raise UnmaskedColumnError(
                    f"column {report.column!r} would pass through unmasked ({report.rule}) but its type "
                    f"({column.type}) cannot be scanned for PII",
                    hint="drop or redact it, or keep it with 'scan: false' if it holds no personal data",
                )
            if typed is not None:
                s = T.as_string(column)  # the text as written (missing cells stay missing)
            if context.sources:
                scrubbed, n_scrubbed = D.scrub_row_values(
                    s, context.sources, min_length=cfg.row_value_min_length, parts=cfg.row_value_parts,
                    threads=context.threads)
                if n_scrubbed:
                    report.detections["row_value"] = n_scrubbed
                    if cfg.row_values == "refuse":
                        raise PIIDetectedError(
                            f"column {report.column!r} would pass through unmasked ({report.rule}) but "
                            f"{n_scrubbed} cell(s) contain values of the same row's identifier columns",
                            hint="add a masking rule for it, or set detectors.row_values to scrub",
                        )
                    s, column = scrubbed, scrubbed
                    report.action = f"{report.action}+scrub_row_values"
            scanner = context.scanner or D.TextScanner(cfg.detectors, phone_regions=cfg.phone_regions)
            hits, redacted = scanner.scan(s)
        report.detections.update({k: int(v.sum()) for k, v in hits.items() if v.any()})
        if not hits:
            return column
        found = ", ".join(f"{n} x{c}" for n, c in sorted(report.detections.items()) if n in hits)
        if cfg.on_detect == "refuse":
            raise PIIDetectedError(
                f"column {report.column!r} would pass through unmasked ({report.rule}) but contains "
                f"PII-shaped values: {found}",
                hint="add a masking rule for it, or set detectors.on_detect to redact_values/redact_column",
            )
        report.action = f"{report.action}+{cfg.on_detect}"
        if cfg.on_detect == "redact_column":
            return T.redact(column, "[REDACTED]")
        return redacted

    # -- files ----------------------------------------------------------------------------------
    def read_masked(self, src: str | os.PathLike[str], *, on_column: Callable[[str], None] | None = None
                    ) -> tuple[pa.Table, MaskReport]:
        """Read a CSV/Parquet file and mask it in memory (nothing unmasked is written anywhere)."""
        fmt = detect_format(src)
        data, digest = read_bytes(src)
        string_cols = None
        if fmt == "csv":
            header = read_csv_header(data, Path(src).name)
            string_cols = self.string_columns(header) if header else None
        # CSV: every column as written (types only where needed: csvtext), so what is kept is the
        # text of the file and what is masked is computed from that text.
        table = parse_table(data, fmt, name=Path(src).name, string_columns=string_cols, verbatim=fmt == "csv")
        csv_text = [f.name for f in table.schema if is_csv_text(f)] if fmt == "csv" else []
        self._audit.record(
            "tabular.read", str(src),
            details={"sha256": digest, "bytes": len(data), "format": fmt, "rows": table.num_rows,
                     "columns": table.num_columns},
        )
        masked, report = self.mask_table_with_report(table, resource=str(src), on_column=on_column,
                                                     csv_text_columns=csv_text)
        report.input_sha256 = digest
        report.csv_line_end = csv_line_end(data) if fmt == "csv" else None
        return masked, report

    def mask_file(self, src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                  on_column: Callable[[str], None] | None = None) -> MaskReport:
        """Mask ``src`` into ``dst`` (format of each by suffix; ``dst`` is replaced atomically)."""
        if Path(src).resolve() == Path(dst).resolve():
            raise TabularMaskingError("refusing to mask a file onto itself", hint="choose a different output path")
        out_fmt = detect_format(dst)
        masked, report = self.read_masked(src, on_column=on_column)
        guard = self.policy.csv_formula_guard
        if out_fmt == "csv":
            try:
                written = csv_output(masked, formula_guard=guard,
                                     line_end="\r\n" if report.csv_line_end == "\r\n" else "\n")
            except TabularMaskingError as exc:
                self._audit.record("tabular.write", str(dst), outcome="refused",
                                   details={"format": out_fmt, "csv_formula_guard": guard, "error": type(exc).__name__,
                                            "policy_digest": self.policy_digest})
                raise
            data = written.data
            report.csv_formula_guard, report.formula_cells_escaped = guard, written.escaped_cells
        else:
            unique = [c.column for c in report.columns
                      if c.distinct is not None and c.distinct >= UNIQUE_SHARE * report.rows]
            data = serialize_table(masked, out_fmt, unique_columns=unique)
        atomic_write_bytes(dst, data)
        report.output_sha256 = hashlib.sha256(data).hexdigest()
        guarded = {"csv_formula_guard": guard, "formula_cells_escaped": report.formula_cells_escaped} \
            if out_fmt == "csv" else {}
        self._audit.record("tabular.write", str(dst),
                           details={"sha256": report.output_sha256, "bytes": len(data), "format": out_fmt,
                                    "rows": masked.num_rows, "columns": masked.num_columns,
                                    "policy_digest": self.policy_digest, **guarded})
        return report

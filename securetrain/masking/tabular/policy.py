"""The masking policy: which action applies to which column, validated by pydantic.

A policy is a versioned YAML document (see ``policies/finance-pii.yaml`` and
``docs/tabular-masking.md``). Rules match columns by exact ``name``, ``glob`` or ``regex``; exact
names win over patterns, patterns apply in file order. A column that matches nothing gets
``default`` -- and if there is no default the masker refuses the table (fail closed).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from functools import cached_property
from typing import Annotated, Literal, get_args

import rfc8785
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from securetrain.config.loader import load_model
from securetrain.resources import resolve_policy

DetectorName = Literal["pan", "email", "phone", "ssn", "iban", "person"]
DEFAULT_PHONE_REGIONS = ("US", "GB", "DE", "FR")


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, description="exact column name")
    glob: str | None = Field(default=None, description="fnmatch-style pattern, e.g. '*_email'")
    regex: str | None = Field(default=None, description="Python regex, must match the whole name")

    @model_validator(mode="after")
    def _one_selector(self) -> _Rule:
        given = [s for s in (self.name, self.glob, self.regex) if s is not None]
        if len(given) != 1:
            raise ValueError("a column rule needs exactly one of 'name', 'glob' or 'regex'")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"invalid regex {self.regex!r}: {exc}") from None
        return self

    def matches(self, column: str) -> bool:
        if self.name is not None:
            return column == self.name
        if self.glob is not None:
            return fnmatch.fnmatchcase(column, self.glob)
        assert self.regex is not None
        return re.fullmatch(self.regex, column) is not None

    @property
    def selector(self) -> str:
        if self.name is not None:
            return f"name={self.name}"
        return f"glob={self.glob}" if self.glob is not None else f"regex={self.regex}"


class KeepRule(_Rule):
    action: Literal["keep"]
    # Kept string columns are still scanned by the detectors unless the policy opts out explicitly.
    scan: bool = True


class DropRule(_Rule):
    action: Literal["drop"]


class RedactRule(_Rule):
    action: Literal["redact"]
    replacement: str = "[REDACTED]"


class TokenizeRule(_Rule):
    action: Literal["tokenize"]
    prefix: str = "tok_"
    length: int = Field(default=16, ge=8, le=51, description="base32 characters of the HMAC kept")
    # Same domain + same key -> same token, so tables can still be joined on a pseudonymised id.
    domain: str = "default"
    normalize: Literal["none", "strip", "lower", "strip_lower"] = "strip"


class GeneralizeRule(_Rule):
    action: Literal["generalize"]
    granularity: Literal["month", "year"] | None = None
    bins: list[float] | None = None
    date_format: str = "%Y-%m-%d"

    @model_validator(mode="after")
    def _one_kind(self) -> GeneralizeRule:
        if (self.granularity is None) == (self.bins is None):
            raise ValueError("generalize needs exactly one of 'granularity' (dates) or 'bins' (numbers)")
        if self.bins is not None:
            if len(self.bins) < 1:
                raise ValueError("bins needs at least one edge")
            if any(e != e or e in (float("inf"), float("-inf")) for e in self.bins):
                raise ValueError("bin edges must be finite numbers")
            if any(b <= a for a, b in zip(self.bins, self.bins[1:])):
                raise ValueError("bin edges must be strictly increasing")
        return self


class PanRule(_Rule):
    action: Literal["pan"]
    mode: Literal["last4", "tokenize", "tokenize_last4"] = "last4"
    validate_luhn: bool = True
    # What to do with values that are not 12-19 digits or fail Luhn: never pass them through.
    on_invalid: Literal["redact", "error"] = "redact"
    prefix: str = "tok_"
    length: int = Field(default=16, ge=8, le=51)
    domain: str = "pan"


class EmailRule(_Rule):
    action: Literal["email"]
    keep_domain: bool = True
    prefix: str = "tok_"
    length: int = Field(default=12, ge=8, le=51)
    domain: str = "email"


class PhoneRule(_Rule):
    action: Literal["phone"]
    keep_last: int = Field(default=0, ge=0, le=4)
    prefix: str = "tok_"
    length: int = Field(default=12, ge=8, le=51)
    domain: str = "phone"


ColumnRule = Annotated[
    KeepRule | DropRule | RedactRule | TokenizeRule | GeneralizeRule | PanRule | EmailRule | PhoneRule,
    Field(discriminator="action"),
]


class DefaultAction(BaseModel):
    """What happens to columns no rule names. Only keep/drop/redact make sense without a column."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    action: Literal["keep", "drop", "redact"]
    replacement: str = "[REDACTED]"


class DetectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True
    detectors: list[DetectorName] = Field(
        default_factory=lambda: list(get_args(DetectorName)))
    # refuse: raise PIIDetectedError; redact_values: replace each match with [PAN] etc.;
    # redact_column: replace the whole column.
    on_detect: Literal["refuse", "redact_values", "redact_column"] = "refuse"
    # Regions (ISO 3166 alpha-2) whose national phone formats are recognised; numbers written
    # internationally (+44 ..., 0049 ...) are found whatever the list.
    phone_regions: list[str] = Field(default_factory=lambda: list(DEFAULT_PHONE_REGIONS), min_length=1)
    # Values of the same row's identifier columns (tokenize/pan/email/phone/redact/drop rules)
    # found in kept text: scrub them (replace with [COLUMN]), refuse the table, or do nothing.
    row_values: Literal["scrub", "refuse", "off"] = "scrub"
    row_value_min_length: int = Field(default=3, ge=2)
    # Also scrub each word (>= row_value_min_length characters) of multi-word values ("Smith").
    row_value_parts: bool = True

    @field_validator("phone_regions")
    @classmethod
    def _known_regions(cls, regions: list[str]) -> list[str]:
        import phonenumbers

        unknown = [r for r in regions if r not in phonenumbers.SUPPORTED_REGIONS]
        if unknown:
            raise ValueError(f"unknown phone region(s): {', '.join(unknown)} (use ISO 3166 codes such as GB, DE)")
        return regions


class MaskingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy_version: str = Field(min_length=1)
    name: str = "unnamed"
    description: str = ""
    columns: list[ColumnRule] = Field(default_factory=list)
    default: DefaultAction | None = None
    detectors: DetectorConfig = Field(default_factory=DetectorConfig)
    # CSV output only: a text cell starting with =, +, -, @, a tab or a CR (and not a number) is
    # run as a formula by a spreadsheet (CSV injection). escape: prefix ' (OWASP); refuse: raise
    # CsvFormulaError naming column and row; off: write it as it is.
    csv_formula_guard: Literal["escape", "refuse", "off"] = "escape"

    @field_validator("columns")
    @classmethod
    def _unique_names(cls, rules: list[_Rule]) -> list[_Rule]:
        names = [r.name for r in rules if r.name is not None]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"column(s) listed more than once: {', '.join(dupes)}")
        return rules

    def rule_for(self, column: str) -> _Rule | DefaultAction | None:
        """Exact name first, then glob/regex rules in order, then the default (None = no rule)."""
        for rule in self.columns:
            if rule.name is not None and rule.name == column:
                return rule
        for rule in self.columns:
            if rule.name is None and rule.matches(column):
                return rule
        return self.default

    @property
    def version(self) -> str:
        """The policy's own version (``policy_version``), as the :class:`securetrain.policy.Policy` protocol names it."""
        return str(self.policy_version)

    @cached_property
    def digest(self) -> str:
        """sha256 over the RFC 8785 canonical JSON of the validated policy (defaults included)."""
        return hashlib.sha256(rfc8785.dumps(self.model_dump(mode="json"))).hexdigest()


def load_policy(name_or_path: str | os.PathLike[str] | None = None, *, data: dict | None = None) -> MaskingPolicy:
    """Load and validate a policy by path or shipped name (``"finance-pii"``); any problem is one
    ConfigError naming the field.

    Environment overrides are deliberately disabled: a compliance policy must be exactly what
    is in the reviewed, versioned file, so its digest in the audit log identifies it.
    """
    path = None if name_or_path is None else resolve_policy(name_or_path)
    return load_model(MaskingPolicy, path, data=data, environ={})

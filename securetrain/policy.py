"""What every masking policy offers, DICOM and tabular alike.

The audit log, the run report and the provenance statement identify a policy by its name, its
version and the SHA-256 of its canonical (RFC 8785) JSON; code that only needs those takes a
:class:`Policy` and works with either kind.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Policy(Protocol):
    """A loaded, validated masking policy (``DicomPolicy`` or ``MaskingPolicy``)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def digest(self) -> str: ...

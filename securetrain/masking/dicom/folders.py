"""Which files below an input folder are candidates for de-identification.

Operating systems and archive tools leave files in folders that are never DICOM and never data:
Finder's ``.DS_Store`` and AppleDouble ``._<name>`` companions (also on USB disks and network
shares), ``__MACOSX/`` from ZIPs made on a Mac, Windows' ``Thumbs.db`` and ``desktop.ini``. They are
skipped, not quarantined: a folder copied from a Mac must not fail a run (quarantine exits 65).
Anything else that is not DICOM is still quarantined with its reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_OS_METADATA_NAMES = frozenset({".DS_Store", "Thumbs.db", "ehthumbs.db", "desktop.ini", ".directory", "Icon\r"})
_OS_METADATA_DIRS = frozenset({"__MACOSX", ".Spotlight-V100", ".Trashes", ".fseventsd", ".TemporaryItems"})


def is_os_metadata(relative: Path) -> bool:
    """True for a file (path relative to the input folder) that an operating system or archive
    tool wrote, never a data file."""
    if any(part in _OS_METADATA_DIRS for part in relative.parts[:-1]):
        return True
    return relative.name in _OS_METADATA_NAMES or relative.name.startswith("._")


def candidate_files(folder: Path) -> list[Path]:
    """Every file below ``folder`` (sorted) except operating-system metadata (logged as a count)."""
    files, skipped = [], 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if is_os_metadata(path.relative_to(folder)):
            skipped += 1
        else:
            files.append(path)
    if skipped:
        log.info("skipped %d operating-system metadata file(s) (.DS_Store, ._*, __MACOSX/, Thumbs.db, ...)", skipped)
    return files

"""securetrain: compliant model training.

Each capability is a package usable as a plain library: ``devices``, ``training``, ``masking``,
``crypto``, ``audit``, ``he``; ``pipeline`` chains them and ``flows/`` wraps the pipeline in Prefect.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # the version lives in pyproject.toml only; the installed metadata carries it
    __version__ = version("securetrain")
except PackageNotFoundError:  # a bare source tree on sys.path without an install
    __version__ = "0+unknown"

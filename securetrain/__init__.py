"""securetrain: compliant model training.

Each capability is a package usable as a plain library: ``devices``, ``training``, ``masking``,
``crypto``, ``audit``, ``he``; ``pipeline`` chains them and ``flows/`` wraps the pipeline in Prefect.
"""

__version__ = "0.1.0"

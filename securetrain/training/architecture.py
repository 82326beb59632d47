"""The record, in a checkpoint's metadata, of layers training replaced in the model it was given.

DP-SGD (:mod:`securetrain.release.privacy`, ``privacy.fix_model``) trains Opacus' fixed copy of the
model (BatchNorm -> GroupNorm): its checkpoints hold GroupNorm weights that the model built from its
spec cannot take. Every checkpoint such a run writes (last, best, FSDP manifest) records the
replaced layers under :data:`MODEL_FIX_KEY` (an empty list: nothing was replaced), so a loader
rebuilds the architecture that was trained, and refuses a model that no longer fixes the same way;
a resume refuses a run that would train another architecture. Checkpoints without the key were
written by a plain run (or by a DP run before the record existed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from securetrain.training.errors import CheckpointCorruptError

#: Checkpoint metadata key: JSON list of ``{"layer": path, "from": type, "to": type}``.
MODEL_FIX_KEY = "securetrain.train.model_fix"

ReplacedLayers = list[dict[str, str]]


def model_fix_metadata(replaced: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The metadata entry recording ``replaced`` (to merge into a checkpoint's metadata)."""
    return {MODEL_FIX_KEY: json.dumps([dict(r) for r in replaced], separators=(",", ":"))}


def read_model_fix(metadata: Mapping[str, str]) -> ReplacedLayers | None:
    """The replaced layers a checkpoint records, or None when it records none (not a DP-SGD run's)."""
    text = metadata.get(MODEL_FIX_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(
            isinstance(r, dict) and set(r) == {"layer", "from", "to"} and all(isinstance(v, str) for v in r.values())
            for r in value):
        raise CheckpointCorruptError(f"checkpoint metadata {MODEL_FIX_KEY} is not a list of replaced layers")
    return value


def describe_fix(replaced: Sequence[Mapping[str, str]]) -> str:
    """``"1 (BatchNorm1d -> GroupNorm), head.bn (BatchNorm2d -> GroupNorm)"``, or ``"no layer replaced"``."""
    if not replaced:
        return "no layer replaced"
    return ", ".join(f"{r['layer'] or '<the model>'} ({r['from']} -> {r['to']})" for r in replaced)

"""GroupNorm that DP-SGD's fix put in place of a BatchNorm over flat ``[N, C]`` features: it erases its input.

Opacus' ``ModuleValidator.fix`` turns ``BatchNorm*d(C)`` into ``GroupNorm(gcd(32, C), C)``. GroupNorm
normalises each sample over the values of a group: over feature maps (``[N, C, H, W]``, ``[N, C, L]``)
a group spans every position of its channels and the fix is sound, but over flat features a group
holds ``C / groups`` values per sample. One value (``C`` a power of two up to 32) is normalised to 0,
so the layer outputs its bias whatever its input; two keep only the sign of their difference. The
model then trains to nothing, silently. Whether a layer sees flat inputs is known only when it runs
(BatchNorm1d takes ``[N, C]`` and ``[N, C, L]``), so :func:`erasing_groupnorms` watches one forward
(:func:`securetrain.training.constant_norm.group_sizes`, which also finds a user's own GroupNorm,
LayerNorm or InstanceNorm of one value per group: refused for every trainer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from securetrain.training.constant_norm import GroupSizes, group_sizes

#: At most this many values per sample and group, GroupNorm's output is a constant or a sign.
MAX_ERASED_VALUES = 2


def suspect_groupnorms(model: nn.Module, replaced: Sequence[Mapping[str, str]]) -> dict[str, nn.GroupNorm]:
    """The replaced layers that are now GroupNorm with at most :data:`MAX_ERASED_VALUES` channels per
    group, by path: erasing on flat inputs (the only ones a forward needs to look at)."""
    modules = dict(model.named_modules())
    found = {r["layer"]: modules.get(r["layer"]) for r in replaced if r["to"] == "GroupNorm"}
    return {name: m for name, m in found.items()
            if isinstance(m, nn.GroupNorm) and m.num_channels // m.num_groups <= MAX_ERASED_VALUES}


def erasing_groupnorms(model: nn.Module, replaced: Sequence[Mapping[str, str]],
                       forward: Callable[[], Any]) -> list[str]:
    """The replaced GroupNorm layers that normalise at most :data:`MAX_ERASED_VALUES` values per
    sample and group in ``forward()`` (which runs ``model`` on a batch), described by path and why;
    ``[]`` when none does. No forward runs when no replaced layer could erase its input."""
    suspects = suspect_groupnorms(model, replaced)
    if not suspects:
        return []
    sizes, error = group_sizes(suspects, forward)
    if error is not None:
        raise error
    return describe_erasing(suspects, replaced, sizes)


def describe_erasing(suspects: Mapping[str, nn.GroupNorm], replaced: Sequence[Mapping[str, str]],
                     sizes: GroupSizes) -> list[str]:
    """The layers of ``suspects`` (:func:`suspect_groupnorms`) that erased their input in ``sizes``
    (:func:`~securetrain.training.constant_norm.group_sizes`), described by path and why."""
    origin = {r["layer"]: r["from"] for r in replaced}
    return [f"{name} ({origin[name]} -> GroupNorm({suspects[name].num_groups}, {suspects[name].num_channels}) over inputs of "
            f"per-sample shape {list(shape)}: {values} value{'s' if values > 1 else ''} per group, normalised to "
            f"{'a constant' if values <= 1 else 'a sign'})"
            for name, (shape, values) in sizes.items() if name in suspects and values <= MAX_ERASED_VALUES]

"""Normalisation layers that output a constant: each group they normalise holds one value per sample.

GroupNorm, LayerNorm and InstanceNorm normalise each sample over the values of a group (a group of
channels with all their positions, the trailing ``normalized_shape``, one channel's positions). A
group of one value is normalised to 0 (``x - mean(x) = 0``), so the layer outputs its bias whatever
its input and the layers before it get no gradient: the model silently learns nothing through it.
E.g. ``GroupNorm(C, C)`` over flat ``[N, C]`` features or over ``[N, C, 1, 1]`` after global pooling,
``InstanceNorm2d`` over 1x1 maps, ``LayerNorm(1)``.

How many values a group holds often depends on the input's shape, known only when the layer runs,
so :func:`group_sizes` watches one forward. :func:`suspect_norms` first keeps the layers that *could*
hold one value per group (GroupNorm with one channel per group, every InstanceNorm, LayerNorm over
one value); GroupNorm with several channels per group and LayerNorm over several values never do, so
most models need no forward at all. Only exactly one value is refused: two or more keep information
(a user's GroupNorm over pairs is a choice; DP-SGD's replaced BatchNorm is held to more,
:mod:`securetrain.release.flat_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from securetrain.training.errors import ConstantNormError

_INSTANCE_NORM = nn.modules.instancenorm._InstanceNorm

#: ``layer path -> (per-sample input shape, fewest values per sample and group)`` seen on a forward.
GroupSizes = dict[str, tuple[tuple[int, ...], int]]


def suspect_norms(model: nn.Module, exclude: Collection[str] = ()) -> dict[str, nn.Module]:
    """The normalisation layers of ``model`` (by path, but not those in ``exclude``) that could
    normalise one value per sample and group, depending on their input's shape."""
    found: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if name in exclude:
            continue
        if (isinstance(m, nn.GroupNorm) and m.num_groups == m.num_channels) or isinstance(m, _INSTANCE_NORM) or (
                isinstance(m, nn.LayerNorm) and math.prod(m.normalized_shape) == 1):
            found[name] = m
    return found


def values_per_group(norm: nn.Module, x: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """``(per-sample shape, values per sample and group)`` of ``norm`` on input ``x``, or None when
    ``x`` is not a shape it normalises."""
    if isinstance(norm, nn.LayerNorm):
        return tuple(x.shape[1:]), math.prod(norm.normalized_shape)
    if isinstance(norm, _INSTANCE_NORM):
        # An unbatched input (one dimension fewer than the batched [N, C, *spatial]) is one sample.
        batched = x.dim() == norm._get_no_batch_dim() + 1
        shape = tuple(x.shape[1:]) if batched else tuple(x.shape)
        return shape, math.prod(shape[1:])
    if isinstance(norm, nn.GroupNorm) and x.dim() >= 2:
        return tuple(x.shape[1:]), x.shape[1:].numel() // norm.num_groups
    return None


def group_sizes(norms: Mapping[str, nn.Module], forward: Callable[[], Any]) -> tuple[GroupSizes, BaseException | None]:
    """What each of ``norms`` that ran in ``forward()`` normalised (its fewest values per group over
    its calls), without gradients, and the exception ``forward()`` raised (None: it ran through).
    The hooks are removed in every case."""
    seen: GroupSizes = {}

    def watch(name: str, norm: nn.Module) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            found = values_per_group(norm, x) if isinstance(x, torch.Tensor) else None
            if found is not None and (name not in seen or found[1] < seen[name][1]):
                seen[name] = found
        return hook

    handles = [m.register_forward_pre_hook(watch(name, m)) for name, m in norms.items()]
    error: BaseException | None = None
    try:
        with torch.no_grad():
            forward()
    except Exception as exc:  # noqa: BLE001 - the caller decides (the hooks may have seen enough)
        error = exc
    finally:
        for h in handles:
            h.remove()
    return seen, error


def describe_norm(norm: nn.Module) -> str:
    """``GroupNorm(8, 8)``, ``InstanceNorm2d(8)``, ``LayerNorm((1,))``."""
    if isinstance(norm, nn.GroupNorm):
        return f"GroupNorm({norm.num_groups}, {norm.num_channels})"
    if isinstance(norm, nn.LayerNorm):
        return f"LayerNorm({tuple(norm.normalized_shape)})"
    return f"{type(norm).__name__}({getattr(norm, 'num_features', '')})"


def constant_outputs(norms: Mapping[str, nn.Module], sizes: GroupSizes) -> list[str]:
    """The layers of ``norms`` that normalised one value per group in ``sizes`` (in the order they
    ran), described by path and why; ``[]`` when none did."""
    return [f"{name} ({describe_norm(norms[name])} over inputs of per-sample shape {list(shape)}: 1 value per "
            "group, so it outputs its bias whatever its input)"
            for name, (shape, values) in sizes.items() if name in norms and values <= 1]


def refuse_constant_norms(found: list[str], when: str) -> None:
    """:class:`ConstantNormError` naming ``found`` (from :func:`constant_outputs`), if any."""
    if not found:
        return
    raise ConstantNormError(
        f"the model has normalisation layers that normalise one value per sample and group ({when}): x - mean(x) "
        f"is 0, so each outputs its bias whatever its input and nothing before it would learn: {'; '.join(found)}",
        hint="normalise over more values: nn.LayerNorm(C) over flat [N, C] features, GroupNorm(G, C) with G < C "
             "(several channels per group), no norm over [N, C, 1, 1] (normalise before the global pooling), "
             "InstanceNorm only over maps larger than 1x1")

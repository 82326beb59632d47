"""Deterministic, resumable data feeding.

The epoch's sample order is a pure function of ``(seed, epoch)``, so a run resumed mid-epoch can
rebuild the exact order and skip the samples it already consumed instead of replaying them. The
DataLoader always gets its own seeded ``torch.Generator``: otherwise creating an iterator draws a
seed from the *global* torch RNG, which would make a resumed run's dropout masks diverge.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset, TensorDataset

from securetrain.training.seeding import epoch_seed, seed_sample, worker_init_fn

log = logging.getLogger("securetrain.training")


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices for one epoch, sharded over ranks like ``DistributedSampler``
    (padded by wrapping so every rank gets the same count), starting at an offset.

    ``indices`` restricts the epoch to those dataset indices (a ``SubsetRandomSampler``'s);
    ``weights`` draws ``num_samples`` indices by weight instead (a ``WeightedRandomSampler``'s), from
    a generator seeded by ``(seed, epoch)`` like the shuffle, so both stay resumable."""

    def __init__(self, length: int, *, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 indices: list[int] | None = None, weights: torch.Tensor | None = None,
                 num_samples: int | None = None, replacement: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError("rank must be in [0, world_size)")
        self.length = length
        self.indices = indices
        self.weights = weights
        self.replacement = replacement
        self.population = (num_samples or len(weights)) if weights is not None else (
            len(indices) if indices is not None else length)
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip its first ``start`` (per-rank) samples."""
        self.epoch = epoch
        self.start = start

    @property
    def per_rank(self) -> int:
        return -(-self.population // self.world_size)

    def __len__(self) -> int:
        return max(0, self.per_rank - self.start)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        if self.weights is not None:
            order = torch.multinomial(self.weights, self.population, self.replacement, generator=g).tolist()
        elif self.shuffle:
            order = torch.randperm(self.population, generator=g).tolist()
        else:
            order = list(range(self.population))
        if self.indices is not None:
            order = [self.indices[i] for i in order]
        total = self.per_rank * self.world_size
        if total > len(order) and order:
            order = (order * (-(-total // len(order))))[:total]
        return iter(order[self.rank : total : self.world_size][self.start :])


def dataset_labels(data: Any, read: Callable[[Any], Any]) -> torch.Tensor:
    """The class ids of a map-style dataset (or a DataLoader's / Subset's) without loading its inputs
    where it says them: a 1-D ``targets`` or ``labels`` attribute, ``TensorDataset``'s second tensor,
    or ``items`` of ``(path, label)`` (:class:`~securetrain.masking.dicom.dataset.DicomDataset`);
    otherwise every item is read and ``read(item)`` gives its label."""
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, Subset):
        return dataset_labels(data.dataset, read)[torch.as_tensor(list(data.indices), dtype=torch.long)]
    if isinstance(data, TensorDataset) and len(data.tensors) >= 2 and data.tensors[1].dim() == 1:
        return data.tensors[1].long()
    for name in ("targets", "labels"):
        value = getattr(data, name, None)
        if isinstance(value, (torch.Tensor, list, tuple, np.ndarray)):
            labels = torch.as_tensor(value)
            if labels.dim() == 1 and len(labels) == len(data):
                return labels.long()
    items = getattr(data, "items", None)
    if (isinstance(items, list) and items and all(isinstance(i, tuple) and len(i) == 2 for i in items)
            and all(isinstance(label, int) for _, label in items)):
        return torch.tensor([label for _, label in items], dtype=torch.long)
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        raise TypeError("an iterable dataset has no labels to count")
    return torch.stack([torch.as_tensor(read(data[i])).reshape(()) for i in range(len(data))]).long()


class SampleSeeded(Dataset[Any]):
    """A map-style dataset whose every ``__getitem__`` first seeds torch/numpy/random from
    ``(seed, epoch, index)`` (:func:`seed_sample`). Used for DataLoader workers only (their RNG is
    their own): a sample's random augmentation then depends on the sample, not on which worker
    loaded it after how many others, so a run resumed mid-epoch draws the same augmentations."""

    def __init__(self, data: Dataset[Any], seed: int) -> None:
        self.data = data
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        seed_sample(self.seed, self.epoch, int(index))
        return self.data[index]


def _sampler_arguments(sampler: Any) -> dict[str, Any] | None:
    """What a passed DataLoader's sampler means for :class:`ResumableSampler`: ``{}`` for the plain
    ones (sequential, random, distributed: replaced by the seeded, rank-sharded order), the indices of
    a ``SubsetRandomSampler`` (a train/validation split must stay one), the weights of a
    ``WeightedRandomSampler`` (oversampling must stay); ``None`` for any other kind (kept as is)."""
    from torch.utils.data import RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, SubsetRandomSampler):
        return {"indices": [int(i) for i in sampler.indices]}
    if isinstance(sampler, WeightedRandomSampler):
        return {"weights": torch.as_tensor(sampler.weights, dtype=torch.double), "num_samples": int(sampler.num_samples),
                "replacement": bool(sampler.replacement)}
    if isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return {}
    return None


class EpochFeeder:
    """Yields one epoch of batches at a time, resumable at a micro-batch offset."""

    def __init__(
        self,
        data: Dataset[Any] | DataLoader[Any],
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool,
        num_workers: int,
        pin_memory: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.seed = seed
        self.generator = torch.Generator()
        self.sampler: ResumableSampler | None = None
        self.seeded: SampleSeeded | None = None
        self.passthrough: DataLoader[Any] | None = None
        collate_fn = None
        sampling: dict[str, Any] | None = {}
        if isinstance(data, DataLoader):
            if isinstance(data.dataset, IterableDataset) or data.batch_size is None:
                # Custom batch samplers / iterable datasets keep their own order; resume skips
                # batches by iterating (exact only if that loader is itself deterministic).
                self.passthrough = data
                self.batch_size = data.batch_size or batch_size
                return
            sampling = _sampler_arguments(data.sampler)
            if sampling is None:
                # A sampler of the user's own kind: keep the loader (its order is the user's choice).
                self.passthrough = data
                self.batch_size = data.batch_size
                return
            batch_size, collate_fn = data.batch_size, data.collate_fn
            drop_last, num_workers = data.drop_last, data.num_workers
            pin_memory = pin_memory and data.pin_memory
            data = data.dataset
        if isinstance(data, IterableDataset):
            if num_workers > 0:
                log.warning("num_workers=%d with an IterableDataset: every worker iterates it from the start, so "
                            "each sample is seen %d times per epoch unless the dataset shards itself by "
                            "torch.utils.data.get_worker_info() (or set num_workers: 0)", num_workers, num_workers)
            self.passthrough = DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                                          worker_init_fn=worker_init_fn, generator=self.generator)
            self.batch_size = batch_size
            return
        self.batch_size = batch_size
        self.sampler = ResumableSampler(len(data), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,  # type: ignore[arg-type]
                                        **(sampling or {}))
        # Workers: per-sample seeding, so augmentation is the same however the epoch's samples are
        # dealt out to workers (a resumed epoch deals only the remaining ones). In-process loading
        # draws from the global RNG, which the checkpoint restores exactly.
        self.seeded = SampleSeeded(data, seed) if num_workers > 0 else None
        self.loader = DataLoader(
            self.seeded if self.seeded is not None else data,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
            generator=self.generator,
        )
        self.drop_last = drop_last

    @property
    def dataset_length(self) -> int | None:
        return self.sampler.length if self.sampler is not None else None

    def batches_in_epoch(self) -> int | None:
        """Micro-batches in a full epoch for this rank, ``None`` if unknown (iterable data)."""
        if self.sampler is not None:
            n = self.sampler.per_rank
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        try:
            return len(self.passthrough)  # type: ignore[arg-type]
        except TypeError:
            return None

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Any]:
        self.generator.manual_seed(epoch_seed(self.seed, epoch) ^ 0x5EED)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start=skip_batches * self.batch_size)
            if self.seeded is not None:
                self.seeded.epoch = epoch  # workers copy the dataset when the iterator starts them
            return iter(self.loader)
        assert self.passthrough is not None
        it: Iterator[Any] = iter(self.passthrough)
        return itertools.islice(it, skip_batches, None)

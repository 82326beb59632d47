"""Deterministic, resumable data feeding.

The epoch's sample order is a pure function of ``(seed, epoch)``, so a run resumed mid-epoch can
rebuild the exact order and skip the samples it already consumed instead of replaying them. The
DataLoader always gets its own seeded ``torch.Generator``: otherwise creating an iterator draws a
seed from the *global* torch RNG, which would make a resumed run's dropout masks diverge.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset, TensorDataset

from securetrain.training.errors import TrainingError
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


class RankSplitSampler(Sampler[Any]):
    """A user's own sampler (or, ``batches=True``, batch sampler) split over the ranks of a DDP run.

    Every rank draws the sampler's whole order for the epoch (``set_epoch(epoch)`` first, when it has
    one) with torch's (CPU), numpy's and Python's global RNGs seeded by ``(seed, epoch)`` and restored after,
    pads it by wrapping to a multiple of ``world_size`` and takes every ``world_size``-th item from its
    rank, as :class:`ResumableSampler` does with the engine's order. That is only right when the
    order is the same on every rank, so the ranks compare a digest of it (``gather``: an all-gather)
    and refuse, with :class:`TrainingError`, a sampler that draws another order on each (e.g. one
    seeded from the OS). A resumed epoch redraws the order and skips ``start`` items: exact when the
    order depends on the epoch and the global RNGs only."""

    def __init__(self, inner: Any, *, length: int, seed: int, rank: int, world_size: int, batches: bool = False,
                 gather: Callable[[Any], list[Any]] | None = None) -> None:
        self.inner = inner
        self.length = length
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.batches = batches
        self.gather = gather
        self.order: list[Any] | None = None
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw the epoch's order (every rank alike), keep this rank's share, skip its first ``start``."""
        set_inner = getattr(self.inner, "set_epoch", None)
        if callable(set_inner):
            set_inner(epoch)
        order = _draw_seeded(lambda: [list(b) if self.batches else b for b in self.inner],
                             epoch_seed(self.seed, epoch))  # indices as the sampler yields them
        if self.gather is not None and self.world_size > 1:
            digests = self.gather(hashlib.sha256(repr(order).encode()).hexdigest())
            if len(set(digests)) > 1:
                what = "batch sampler" if self.batches else "sampler"
                raise TrainingError(
                    f"the DataLoader's {what} ({type(self.inner).__name__}) draws a different order on each of the "
                    f"{self.world_size} processes, so the trainer cannot split one order between them (samples would "
                    "be dropped and repeated)",
                    hint=f"make its order depend only on the epoch: draw from torch's global RNG (seeded per epoch for "
                         f"it) or from a generator seeded in set_epoch(epoch); or split it yourself (a {what} with "
                         "num_replicas and rank attributes is used as is); or pass the Dataset")
        total = -(-len(order) // self.world_size) * self.world_size
        if total > len(order) and order:
            order = (order * (-(-total // len(order))))[:total]
        self.order = order[self.rank : total : self.world_size]
        self.start = start

    @property
    def per_rank(self) -> int | None:
        """Items (samples, or batches) per rank in a full epoch; None while unknown (no ``len``)."""
        if self.order is not None:
            return len(self.order)
        try:
            return -(-len(self.inner) // self.world_size)
        except TypeError:
            return None

    def __len__(self) -> int:
        n = self.per_rank
        if n is None:
            raise TypeError(f"{type(self.inner).__name__} has no len()")
        return max(0, n - self.start)

    def __iter__(self) -> Iterator[Any]:
        assert self.order is not None, "set_epoch() first"
        return iter(self.order[self.start :])


def _draw_seeded(draw: Callable[[], list[Any]], seed: int) -> list[Any]:
    """``draw()`` with torch's CPU, numpy's and Python's global RNGs seeded by ``seed``, each put back
    after (accelerator generators are neither seeded nor touched: they drive the training)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            return draw()
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _shards_itself(sampler: Any, rank: int, world_size: int) -> bool:
    """A sampler that already yields only this rank's share (``num_replicas``/``rank`` as
    ``DistributedSampler`` has them, set to this run's)."""
    return getattr(sampler, "num_replicas", None) == world_size and getattr(sampler, "rank", None) == rank


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

    _OWN = frozenset({"data", "seed", "epoch"})

    def __init__(self, data: Dataset[Any], seed: int) -> None:
        self.data = data
        self.seed = seed
        self.epoch = 0

    # Transparent to a worker_init_fn: get_worker_info().dataset is this wrapper, and a user's init
    # that opens a file or connection per worker (dataset.h5 = h5py.File(...), dataset.connect())
    # must reach the dataset it wraps.
    def __getattr__(self, name: str) -> Any:
        if name in SampleSeeded._OWN or name.startswith("__") or "data" not in self.__dict__:
            raise AttributeError(name)  # also while unpickling in a spawned worker
        return getattr(self.__dict__["data"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SampleSeeded._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.data, name, value)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        seed_sample(self.seed, self.epoch, int(index))
        return self.data[index]


class ChainedWorkerInit:
    """The engine's per-worker seeding, then the user's ``worker_init_fn`` (picklable, for spawn)."""

    def __init__(self, user: Callable[[int], Any]) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        worker_init_fn(worker_id)
        self.user(worker_id)


#: DataLoader settings of a passed loader that the engine's rebuilt loader keeps (besides the
#: dataset, batch size, collate_fn, num_workers, drop_last and pin_memory it already kept).
_KEPT_LOADER_SETTINGS = ("multiprocessing_context", "timeout", "prefetch_factor", "persistent_workers",
                         "pin_memory_device", "in_order")


def _loader_settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """How a passed loader runs its workers: the start method (``multiprocessing_context``: a
    dataset that is not fork-safe needs spawn), timeouts, prefetching, persistent workers, and the
    user's ``worker_init_fn`` (chained after the engine's seeding)."""
    kept = {name: getattr(loader, name) for name in _KEPT_LOADER_SETTINGS if hasattr(loader, name)}
    if loader.num_workers == 0:  # torch refuses these without workers
        kept.pop("prefetch_factor", None)
        kept.pop("persistent_workers", None)
    if loader.worker_init_fn is not None:
        kept["worker_init_fn"] = ChainedWorkerInit(loader.worker_init_fn)
    return kept


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
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self.seed = seed
        self.generator = torch.Generator()
        self.sampler: ResumableSampler | RankSplitSampler | None = None
        self.seeded: SampleSeeded | None = None
        self.passthrough: DataLoader[Any] | None = None
        self.drop_last = drop_last
        collate_fn = None
        sampling: dict[str, Any] | None = {}
        self._loader_settings: dict[str, Any] = {}
        if isinstance(data, DataLoader):
            self._loader_settings = _loader_settings(data)
            own_batches = data.batch_size is None  # a batch_sampler of the user's own
            if isinstance(data.dataset, IterableDataset):
                self.passthrough = data  # its own order (see the IterableDataset note in docs/training.md)
                self.batch_size = data.batch_size or batch_size
                return
            sampling = None if own_batches else _sampler_arguments(data.sampler)
            if sampling is None:
                # A (batch) sampler of the user's own kind: its order is the user's choice. One process
                # uses the loader as is; several split the order between them (RankSplitSampler)
                # unless the sampler shards itself.
                own = data.batch_sampler if own_batches else data.sampler
                self.batch_size = data.batch_size or batch_size
                if world_size == 1 or _shards_itself(own, rank, world_size):
                    self.passthrough = data
                    return
                self.sampler = RankSplitSampler(own, length=len(data.dataset), seed=seed, rank=rank,  # type: ignore[arg-type]
                                                world_size=world_size, batches=own_batches, gather=gather)
                self._build_loader(data.dataset, data.batch_size, data.collate_fn, data.drop_last, data.num_workers,
                                   pin_memory and data.pin_memory)
                return
            batch_size, collate_fn = cast(int, data.batch_size), data.collate_fn  # not None: no batch_sampler
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
        self._build_loader(data, batch_size, collate_fn, drop_last, num_workers, pin_memory)

    def _build_loader(self, data: Any, batch_size: int | None, collate_fn: Any, drop_last: bool, num_workers: int,
                      pin_memory: bool) -> None:
        """The engine's DataLoader over ``self.sampler`` (a batch sampler when it yields batches)."""
        # Workers: per-sample seeding, so augmentation is the same however the epoch's samples are
        # dealt out to workers (a resumed epoch deals only the remaining ones). In-process loading
        # draws from the global RNG, which the checkpoint restores exactly.
        self.seeded = SampleSeeded(data, self.seed) if num_workers > 0 else None
        common: dict[str, Any] = dict(num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                                      worker_init_fn=worker_init_fn, generator=self.generator)
        common.update(self._loader_settings)  # a passed loader's own worker settings
        dataset = self.seeded if self.seeded is not None else data
        if getattr(self.sampler, "batches", False):
            self.loader = DataLoader(dataset, batch_sampler=cast(Sampler[list[Any]], self.sampler), **common)
            self.drop_last = False
        else:
            self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=drop_last, **common)
            self.drop_last = drop_last

    @property
    def dataset_length(self) -> int | None:
        return self.sampler.length if self.sampler is not None else None

    def batches_in_epoch(self) -> int | None:
        """Micro-batches in a full epoch for this rank, ``None`` if unknown (iterable data)."""
        if self.sampler is not None:
            n = self.sampler.per_rank
            if n is None or getattr(self.sampler, "batches", False):
                return n  # a split batch sampler: n batches (None: its length is unknown)
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        try:
            return len(self.passthrough)  # type: ignore[arg-type]
        except TypeError:
            return None

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Any]:
        self.generator.manual_seed(epoch_seed(self.seed, epoch) ^ 0x5EED)
        if self.sampler is not None:
            per_batch = 1 if getattr(self.sampler, "batches", False) else self.batch_size
            self.sampler.set_epoch(epoch, start=skip_batches * per_batch)
            if self.seeded is not None:
                self.seeded.epoch = epoch  # workers copy the dataset when the iterator starts them
            return iter(self.loader)
        assert self.passthrough is not None
        for own in (self.passthrough.sampler, self.passthrough.batch_sampler):
            set_epoch = getattr(own, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)  # a user's sampler with set_epoch (DistributedSampler's convention)
        it: Iterator[Any] = iter(self.passthrough)
        return itertools.islice(it, skip_batches, None)

"""The data-server's pure core: seeded epoch orders, cursors, and batches.

The server keeps no per-client state. The order of epoch `e` is a permutation drawn from
(seed, dataset, split, e); a batch is the window [offset, offset + batch_size) of the endless
sequence epoch 0 order, epoch 1 order, ...  A cursor is just `epoch.offset.fingerprint`, so the
same cursor always gives the same batch, every item appears exactly once per epoch, and a cursor
saved in a checkpoint resumes exactly, on any replica, after any restart.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from dataclasses import dataclass

import numpy as np

from services.common.errors import clip
from services.data_server.schemas import CURSOR_PATTERN
from services.data_server.sources import Dataset

_CURSOR = re.compile(CURSOR_PATTERN)


class RequestError(ValueError):
    """A request field the core cannot serve; `field` names it for the 422."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CursorError(RequestError):
    def __init__(self, message: str) -> None:
        super().__init__("cursor", message)


class Conflict(RequestError):
    """A well-formed request that does not fit the split it names (409): a batch larger than the split,
    a cursor issued for another dataset, split, seed or size. The schema cannot say these; the data does."""


class NotFound(LookupError):
    """Unknown dataset or split; the message lists what exists."""


@dataclass(frozen=True)
class Cursor:
    epoch: int
    offset: int


def fingerprint(dataset: str, split: str, seed: int, size: int) -> str:
    return f"{zlib.crc32(f'{dataset}|{split}|{seed}|{size}'.encode()):08x}"


def encode_cursor(cursor: Cursor, print_: str) -> str:
    return f"{cursor.epoch}.{cursor.offset}.{print_}"


def decode_cursor(text: str | None, print_: str, size: int) -> Cursor:
    if not text:
        return Cursor(0, 0)
    parts = _CURSOR.fullmatch(text)
    if parts is None:
        raise CursorError(f"cursor {clip(text, 64)} is malformed: expected '<epoch>.<offset>.<fingerprint>'")
    if parts[3] != print_:
        raise Conflict("cursor", "cursor was issued for another dataset, split, seed or dataset size")
    cursor = Cursor(int(parts[1]), int(parts[2]))
    if cursor.offset >= size:
        raise Conflict("cursor", f"cursor offset {cursor.offset} is beyond the split's {size} items")
    return cursor


def epoch_order(seed: int, dataset: str, split: str, epoch: int, size: int) -> np.ndarray:
    return _epoch_order(seed, zlib.crc32(f"{dataset}|{split}".encode()), epoch, size)


@functools.lru_cache(maxsize=64)
def _epoch_order(seed: int, key: int, epoch: int, size: int) -> np.ndarray:
    order = np.random.default_rng([seed, key, epoch]).permutation(size)
    order.setflags(write=False)
    return order


def window(seed: int, dataset: str, split: str, size: int, start: Cursor, batch_size: int):
    """Indices of the next `batch_size` items from `start`, crossing into the next epoch if needed."""
    indices: list[int] = []
    epoch, offset = start.epoch, start.offset
    while len(indices) < batch_size:
        take = min(batch_size - len(indices), size - offset)
        indices.extend(epoch_order(seed, dataset, split, epoch, size)[offset : offset + take].tolist())
        offset += take
        if offset == size:
            epoch, offset = epoch + 1, 0
    return indices, Cursor(epoch, offset)


class DataStore:
    """Loaded datasets, each item also kept as JSON bytes so a batch is a join, not a re-encode."""

    def __init__(self, datasets: list[Dataset], seed: int) -> None:
        self.seed = seed
        self.datasets = {d.name: d for d in datasets}
        self._encoded = {
            (d.name, split): [json.dumps(item, separators=(",", ":")).encode() for item in items]
            for d in datasets
            for split, items in d.splits.items()
        }

    def split_items(self, dataset: str, split: str) -> list[dict]:
        if dataset not in self.datasets:
            raise NotFound(f"unknown dataset {clip(dataset)}; available: {sorted(self.datasets)}")
        splits = self.datasets[dataset].splits
        if split not in splits:
            raise NotFound(f"dataset {dataset!r} has no split {clip(split)}; available: {sorted(splits)}")
        return splits[split]

    def batch_json(self, dataset: str, split: str, batch_size: int, cursor: str | None) -> bytes:
        """The whole BatchResponse body as JSON bytes."""
        size = len(self.split_items(dataset, split))
        if batch_size > size:
            problem = f"{batch_size} is larger than split {split!r} ({size} items): it would repeat items"
            raise Conflict("batch_size", problem)
        print_ = fingerprint(dataset, split, self.seed, size)
        start = decode_cursor(cursor, print_, size)
        indices, after = window(self.seed, dataset, split, size, start, batch_size)
        encoded = self._encoded[(dataset, split)]
        head = (
            f'{{"next_cursor":"{encode_cursor(after, print_)}","epoch":{start.epoch},'
            f'"offset":{start.offset},"dataset_size":{size},"items":['
        )
        return head.encode() + b",".join(encoded[i] for i in indices) + b"]}"

    def describe(self) -> list[dict]:
        return [
            {
                "name": d.name,
                "kind": d.kind,
                "data_source": d.data_source,
                "splits": {split: len(items) for split, items in d.splits.items()},
            }
            for d in self.datasets.values()
        ]

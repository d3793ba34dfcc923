"""The trainer's prompts: from the data-server or from local verl parquet/jsonl files, chat-templated and
tokenised.

Two sources, one interface (`PromptSource`):
- `ServerPromptSource` walks the data-server's seeded epoch orders; its cursor is the server's own
  `epoch.offset.fingerprint`, so a cursor saved in a checkpoint resumes exactly on any replica.
- `FilePromptSource` reads `data.train_files` / `data.val_files` (verl rows, as `python -m
  services.data_server export` writes them) and keeps the same cursor idea locally: epoch `e` is a
  permutation seeded by (seed, e), a batch may run on into the next epoch, nothing is dropped.

`PromptEncoder` applies the tokenizer's chat template (add_generation_prompt=True, as verl does) and
enforces `data.max_prompt_length`: overlong prompts are dropped (`filter_overlong_prompts`) or cut
(`truncation` left | right | middle), or stop the run (`truncation=error`). Files are checked whole at
start, so a bad prompt fails before any work; the server source refills a batch after dropping.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

Truncation = Literal["error", "left", "right", "middle"]
VAL_CHUNK = 512  # items per data-server request when a whole validation set is wanted at once


class PromptTooLongError(ValueError):
    """A prompt exceeds data.max_prompt_length and the configuration says to stop."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for rollout; the reward fields travel with it to scoring."""

    uid: str  # stable across epochs, e.g. 'gsm8k/train/17'
    data_source: str  # selects the reward scorer (the row's data.reward_fn_key field)
    prompt_ids: list[int]  # chat template applied, generation prompt appended, truncated if asked
    raw_prompt: list[dict[str, str]]  # the chat messages
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    ability: str = "unknown"
    truncated: bool = False


@dataclass
class PromptBatch:
    prompts: list[PromptRecord]
    cursor: str | None  # resume point after this batch: save it with the step that consumed the batch
    epoch: int  # epoch of the first prompt
    skipped: int = 0  # overlong prompts dropped while filling this batch


def truncate_ids(ids: list[int], max_length: int, side: Truncation) -> list[int]:
    """verl's truncation: left keeps the end, right the start, middle both ends (the start gets the floor
    half)."""
    if len(ids) <= max_length:
        return ids
    if side == "left":
        return ids[-max_length:]
    if side == "right":
        return ids[:max_length]
    if side == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise PromptTooLongError(
        f"prompt of {len(ids)} tokens is longer than data.max_prompt_length={max_length}"
    )


def chat_messages(value: Any) -> list[dict[str, str]]:
    """A row's prompt as chat messages; a plain string becomes one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]


class PromptEncoder:
    """Rows (verl fields + uid) -> PromptRecords: chat template, tokenisation, length policy."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncation: Truncation = "error",
        filter_overlong: bool = False,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set actor_rollout_ref.model.custom_chat_template"
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation: Truncation = truncation
        self.filter_overlong = filter_overlong
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})

    def full_ids(self, rows: Sequence[dict]) -> list[list[int]]:
        """Token ids of each row's templated prompt, before any length policy."""
        texts = [
            self.tokenizer.apply_chat_template(
                chat_messages(row[self.prompt_key]),
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
            for row in rows
        ]
        if not texts:
            return []
        # The template already holds the special tokens; adding BOS/EOS again would double them.
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, rows: Sequence[dict]) -> list[PromptRecord | None]:
        """One record per row; None where the prompt is too long and filter_overlong is on."""
        records: list[PromptRecord | None] = []
        for row, ids in zip(rows, self.full_ids(rows)):
            too_long = len(ids) > self.max_prompt_length
            if too_long and self.filter_overlong:
                records.append(None)
                continue
            if too_long and self.truncation == "error":
                raise PromptTooLongError(
                    f"prompt {row['uid']} has {len(ids)} tokens, more than data.max_prompt_length="
                    f"{self.max_prompt_length}; set data.filter_overlong_prompts=True or data.truncation="
                    "left|right|middle"
                )
            records.append(
                self._record(row, truncate_ids(ids, self.max_prompt_length, self.truncation), too_long)
            )
        return records

    def _record(self, row: dict, ids: list[int], truncated: bool) -> PromptRecord:
        reward = row.get("reward_model") or {}
        return PromptRecord(
            uid=str(row["uid"]),
            data_source=str(row[self.reward_fn_key]),
            prompt_ids=ids,
            raw_prompt=chat_messages(row[self.prompt_key]),
            ground_truth=reward.get("ground_truth"),
            extra_info=dict(row.get("extra_info") or {}),
            ability=str(row.get("ability") or "unknown"),
            truncated=truncated,
        )


class PromptSource(Protocol):
    """What the fit loop needs from a prompt source; both implementations below satisfy it."""

    train_size: int

    @property
    def epoch(self) -> int: ...

    async def next_batch(self, batch_size: int) -> PromptBatch: ...

    def state(self) -> str | None: ...

    def restore(self, cursor: str | None) -> None: ...

    def validation_batches(self, batch_size: int | None = None) -> AsyncIterator[PromptBatch]: ...

    async def aclose(self) -> None: ...


def total_steps(train_size: int, batch_size: int, total_epochs: int, total_training_steps: int | None) -> int:
    """Steps of a run: the explicit count if given, else the whole batches in `total_epochs` epochs."""
    if total_training_steps is not None:
        return total_training_steps
    return max(1, train_size * total_epochs // batch_size)


# ---------------------------------------------------------------------------------------- data-server


class ServerPromptSource:
    """Prompts from the data-server (stateless; the cursor is the whole state)."""

    def __init__(
        self,
        client: Any,  # services.data_server.client.DataClient
        encoder: PromptEncoder,
        *,
        dataset: str,
        train_split: str = "train",
        val_split: str | None = "test",
    ) -> None:
        self.client = client
        self.encoder = encoder
        self.dataset = dataset
        self.train_split = train_split
        self.val_split = val_split
        self.train_size = 0
        self.val_size = 0
        self._cursor: str | None = None

    async def open(self, health_timeout_s: float = 60.0) -> ServerPromptSource:
        """Wait for the server, and fail now, naming what exists, if the dataset or a split is missing."""
        await self.client.wait_healthy(health_timeout_s)
        listed = {info.name: info for info in (await self.client.datasets()).datasets}
        if self.dataset not in listed:
            raise ValueError(
                f"data.dataset={self.dataset!r} is not on the data-server; it has {sorted(listed)}"
            )
        splits = listed[self.dataset].splits
        for key, split in (("data.train_split", self.train_split), ("data.val_split", self.val_split)):
            if split is not None and split not in splits:
                raise ValueError(f"{key}={split!r}: dataset {self.dataset!r} has splits {sorted(splits)}")
        self.train_size = splits[self.train_split]
        self.val_size = splits.get(self.val_split, 0) if self.val_split else 0
        return self

    @property
    def epoch(self) -> int:
        return int(self._cursor.split(".", 1)[0]) if self._cursor else 0  # `epoch.offset.fingerprint`

    def state(self) -> str | None:
        return self._cursor

    def restore(self, cursor: str | None) -> None:
        self._cursor = cursor

    async def next_batch(self, batch_size: int) -> PromptBatch:
        """`batch_size` prompts; dropped overlong ones are replaced by the following items.

        The cursor moves only when the whole batch arrived, so a failed request loses nothing.
        """
        records: list[PromptRecord] = []
        cursor, first_epoch, skipped = self._cursor, None, 0
        while len(records) < batch_size:
            response = await self.client.batch(
                self.dataset, self.train_split, batch_size - len(records), cursor
            )
            first_epoch = response.epoch if first_epoch is None else first_epoch
            cursor = response.next_cursor
            encoded = self.encoder.encode([item.model_dump() for item in response.items])
            records += [r for r in encoded if r is not None]
            skipped += sum(r is None for r in encoded)
            if skipped >= response.dataset_size:
                raise PromptTooLongError(
                    f"data.filter_overlong_prompts dropped {skipped} prompts of {self.dataset}/"
                    f"{self.train_split} ({response.dataset_size} items) while filling one batch of "
                    f"{batch_size}: too few prompts fit data.max_prompt_length="
                    f"{self.encoder.max_prompt_length}"
                )
        self._cursor = cursor
        return PromptBatch(records, cursor, first_epoch or 0, skipped)

    async def validation_batches(self, batch_size: int | None = None) -> AsyncIterator[PromptBatch]:
        """The whole validation split once, in the server's fixed order (overlong prompts dropped if
        filtering)."""
        if not self.val_split or not self.val_size:
            return
        cursor, remaining = None, self.val_size
        pending: list[PromptRecord] = []
        while remaining:
            size = min(remaining, batch_size or VAL_CHUNK)
            response = await self.client.batch(self.dataset, self.val_split, size, cursor)
            cursor, remaining = response.next_cursor, remaining - size
            pending += [
                r for r in self.encoder.encode([i.model_dump() for i in response.items]) if r is not None
            ]
            if batch_size is not None or not remaining:
                yield PromptBatch(pending, None, 0)
                pending = []

    async def aclose(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------------------------------- local files


def read_rows(files: Sequence[str], split: str) -> list[dict]:
    """verl rows from parquet/jsonl files, each given a stable uid '{split}/{row number}'."""
    rows: list[dict] = []
    for name in files:
        path = Path(name).expanduser()
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows += pq.read_table(path).to_pylist()
        else:
            with path.open(encoding="utf-8") as handle:
                rows += [json.loads(line) for line in handle if line.strip()]
    return [{**row, "uid": f"{split}/{index}"} for index, row in enumerate(rows)]


def epoch_order(seed: int, epoch: int, size: int, shuffle: bool) -> np.ndarray:
    """Positions of epoch `epoch`: a permutation drawn from (seed, epoch), or file order."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, epoch]).permutation(size)


class FilePromptSource:
    """Prompts from local verl parquet/jsonl files, with an `epoch.offset.fingerprint` cursor."""

    def __init__(
        self,
        train_files: Sequence[str],
        val_files: Sequence[str] | None,
        encoder: PromptEncoder,
        *,
        seed: int = 1,
        shuffle: bool = True,
    ) -> None:
        self.encoder = encoder
        self.seed = seed
        self.shuffle = shuffle
        self._train = self._usable(read_rows(train_files, "train"), "data.train_files")
        self._val = self._usable(read_rows(val_files, "val"), "data.val_files") if val_files else []
        self.train_size = len(self._train)
        names = ",".join(Path(f).name for f in train_files)
        self.fingerprint = f"{zlib.crc32(f'{names}|{self.train_size}|{seed}|{shuffle}'.encode()):08x}"
        self._epoch, self._offset = 0, 0

    def _usable(self, rows: list[dict], key: str) -> list[dict]:
        """Apply the length policy to the whole file now, so a bad prompt stops the run before any work."""
        if not rows:
            raise ValueError(f"{key}: the files hold no rows")
        if not self.encoder.filter_overlong and self.encoder.truncation != "error":
            return rows  # every prompt is usable: long ones get cut when their batch is encoded
        lengths = [len(ids) for ids in self.encoder.full_ids(rows)]
        limit = self.encoder.max_prompt_length
        overlong = [row["uid"] for row, length in zip(rows, lengths) if length > limit]
        if overlong and not self.encoder.filter_overlong:  # so truncation=error
            raise PromptTooLongError(
                f"{key}: {len(overlong)} of {len(rows)} prompts are longer than data.max_prompt_length="
                f"{limit} (first: {overlong[0]}, {max(lengths)} tokens at most); set "
                "data.filter_overlong_prompts=True or data.truncation=left|right|middle"
            )
        if self.encoder.filter_overlong:
            rows = [row for row, length in zip(rows, lengths) if length <= limit]
        if not rows:
            raise PromptTooLongError(f"{key}: no prompt fits data.max_prompt_length={limit}")
        return rows

    @property
    def epoch(self) -> int:
        return self._epoch

    def state(self) -> str | None:
        return f"{self._epoch}.{self._offset}.{self.fingerprint}"

    def restore(self, cursor: str | None) -> None:
        if not cursor:
            self._epoch, self._offset = 0, 0
            return
        parts = cursor.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            raise ValueError(
                f"data cursor {cursor!r} is malformed: expected '<epoch>.<offset>.<fingerprint>'"
            )
        if parts[2] != self.fingerprint:
            raise ValueError(
                f"data cursor {cursor!r} was saved for other training files, seed, shuffle or prompt filter"
            )
        if int(parts[1]) >= self.train_size:
            raise ValueError(f"data cursor {cursor!r} points past the {self.train_size} training prompts")
        self._epoch, self._offset = int(parts[0]), int(parts[1])

    async def next_batch(self, batch_size: int) -> PromptBatch:
        first_epoch, positions = self._epoch, []
        while len(positions) < batch_size:
            take = min(batch_size - len(positions), self.train_size - self._offset)
            order = epoch_order(self.seed, self._epoch, self.train_size, self.shuffle)
            positions += order[self._offset : self._offset + take].tolist()
            self._offset += take
            if self._offset == self.train_size:
                self._epoch, self._offset = self._epoch + 1, 0
        records = self.encoder.encode([self._train[p] for p in positions])
        return PromptBatch([r for r in records if r is not None], self.state(), first_epoch)

    async def validation_batches(self, batch_size: int | None = None) -> AsyncIterator[PromptBatch]:
        step = batch_size or max(1, len(self._val))
        for start in range(0, len(self._val), step):
            records = self.encoder.encode(self._val[start : start + step])
            yield PromptBatch([r for r in records if r is not None], None, 0)

    async def aclose(self) -> None:
        return None


# ---------------------------------------------------------------------------------------- from the config


async def open_prompt_source(
    data: Any,  # trainer.config.DataConfig
    services: Any,  # trainer.config.ServicesConfig
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    validation: bool = True,
) -> FilePromptSource | ServerPromptSource:
    """The source `data.source` names, ready to serve (the server one has answered /health).

    validation=False (a run that never validates: `Config.validates`) opens no validation split or files,
    so a dataset without one trains; the source then yields no validation batches."""
    encoder = PromptEncoder(
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong=data.filter_overlong_prompts,
        prompt_key=data.prompt_key,
        reward_fn_key=data.reward_fn_key,
        chat_template=chat_template,
        template_kwargs=data.apply_chat_template_kwargs,
    )
    if data.source == "files":
        val_files = data.val_files if validation else None
        return FilePromptSource(data.train_files, val_files, encoder, seed=data.seed, shuffle=data.shuffle)
    from services.data_server.client import DataClient

    client = DataClient(
        services.data_url,
        timeout_s=services.timeout_s,
        retries=services.retries,
        deadline_s=services.retry_deadline_s,
        token=services.auth_token,
    )
    source = ServerPromptSource(
        client,
        encoder,
        dataset=data.dataset,
        train_split=data.train_split,
        val_split=data.val_split if validation else None,
    )
    try:
        return await source.open(services.health_timeout_s)
    except BaseException:
        await client.aclose()
        raise

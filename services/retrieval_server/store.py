"""What an index folder holds besides the vectors: the passages, their offsets, and the manifest.

The passages are one file of compact JSON lines (`docs.jsonl`, each `{"id": ..., "contents": ...}`)
plus an int64 array of line offsets (`doc_offsets.npy`, memory-mapped). Serving reads a passage
with one pread at its offset, so the 21M passages of wiki-18 cost page cache rather than Python
objects, and a hit's JSON is a byte string that goes into the response without being parsed or
re-encoded.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "doc_offsets.npy"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1

IndexType = Literal["flat", "hnsw", "ivfpq", "bm25"]


class CorpusError(ValueError):
    """A corpus row we cannot read; the message names the file and line."""


class ManifestError(ValueError):
    """An index folder that is missing, incomplete, or built for another embedder."""


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str


def passage_from_row(row: object, line_number: int) -> Passage:
    """Search-R1 rows: `id` + `contents` ("Title"\\ntext), or `id` + `title` + `text`."""
    if not isinstance(row, dict):
        raise CorpusError(f"line {line_number}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("contents"), str):
        contents = row["contents"]
    elif isinstance(row.get("text"), str):
        title = row.get("title")
        contents = f'"{title}"\n{row["text"]}' if isinstance(title, str) and title else row["text"]
    else:
        raise CorpusError(
            f"line {line_number}: needs a string 'contents', or 'title' and 'text' (has {sorted(row)})"
        )
    if not contents.strip():
        raise CorpusError(f"line {line_number}: the passage text is empty")
    # wiki-18's ids are the row numbers as strings; fall back to that when a corpus has none.
    raw_id = row.get("id", line_number - 1)
    return Passage(id=str(raw_id), contents=contents)


class CorpusReader:
    """Streams passages from a JSONL corpus, hashing the raw bytes on the way (manifest's sha256)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise CorpusError(f"corpus {path} does not exist")
        self.path = path
        self.size_bytes = path.stat().st_size
        self.bytes_read = 0
        self._sha256 = hashlib.sha256()

    def __iter__(self) -> Iterator[Passage]:
        with self.path.open("rb") as handle:
            for line_number, line in enumerate(handle, start=1):
                self._sha256.update(line)
                self.bytes_read += len(line)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise CorpusError(f"{self.path} line {line_number}: not JSON ({exc})") from None
                try:
                    yield passage_from_row(row, line_number)
                except CorpusError as exc:
                    raise CorpusError(f"{self.path} {exc}") from None

    @property
    def sha256(self) -> str:
        """Complete once the iteration has finished."""
        return self._sha256.hexdigest()


class DocStoreWriter:
    """Appends passages to docs.jsonl and remembers where each line starts."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._handle = (folder / DOCS_FILE).open("wb")
        self._offsets = array("q", [0])

    def add(self, passage: Passage) -> None:
        line = json.dumps(
            {"id": passage.id, "contents": passage.contents}, ensure_ascii=False, separators=(",", ":")
        )
        self._handle.write(line.encode() + b"\n")
        self._offsets.append(self._handle.tell())

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> None:
        self._handle.close()
        np.save(self.folder / OFFSETS_FILE, np.frombuffer(self._offsets, dtype=np.int64))


class DocStore:
    """Read side: passage `i` as raw JSON bytes, read with pread at its offset.

    pread rather than mmap: fetched passages then live in the kernel's page cache (shared, dropped
    under memory pressure) and never in this process's resident memory. Mapped, 20000 random fetches
    from a 740 MB store left 611 MB of it resident (the kernel maps cached neighbours on each fault).
    """

    def __init__(self, folder: Path) -> None:
        self._offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r")
        self._fd = os.open(folder / DOCS_FILE, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # hits land anywhere: no read-ahead

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def raw(self, index: int) -> bytes:
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        return os.pread(self._fd, end - start - 1, start)  # without the newline

    def get(self, index: int) -> dict:
        return json.loads(self.raw(index))

    def close(self) -> None:
        os.close(self._fd)


class EmbedderInfo(BaseModel):
    name: str = Field(description="What --embedder named: a hub id or a local path.")
    dimension: int
    query_prefix: str = ""
    passage_prefix: str = ""
    precision: str = Field("float32", description="Precision the passages were embedded in.")


class Manifest(BaseModel):
    """manifest.json: enough to refuse a wrong embedder and to tell where an index came from."""

    version: int = MANIFEST_VERSION
    index_type: IndexType
    metric: Literal["inner_product", "bm25"]
    count: int
    embedder: EmbedderInfo | None = Field(None, description="None for BM25, which embeds nothing.")
    corpus_path: str
    corpus_sha256: str
    params: dict[str, int | float | str] = Field(default_factory=dict, description="Index parameters used.")
    build_seconds: float = 0.0

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_FILE).write_text(self.model_dump_json(indent=2) + "\n")


def read_manifest(folder: Path) -> Manifest:
    if not folder.is_dir():
        raise ManifestError(
            f"index folder {folder} does not exist "
            "(build one with `python -m services.retrieval_server build`)"
        )
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"{folder} has no {MANIFEST_FILE}: not an index folder, or its build did not finish"
        )
    try:
        manifest = Manifest.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ManifestError(f"{path} is unreadable: {exc}") from None
    if manifest.version != MANIFEST_VERSION:
        raise ManifestError(
            f"{path} has format version {manifest.version}; this server reads {MANIFEST_VERSION}"
        )
    return manifest


def model_basename(name: str) -> str:
    """'intfloat/e5-base-v2' and '/models/e5-base-v2/' both name the model 'e5-base-v2'."""
    return Path(name.rstrip("/")).name.lower()


def check_embedder_name(manifest: Manifest, embedder: str | None) -> None:
    """Refuse, before loading anything, an embedder other than the one the index was built with."""
    if embedder is None or manifest.embedder is None:
        return
    if model_basename(embedder) != model_basename(manifest.embedder.name):
        raise ManifestError(
            f"the index was built with embedder {manifest.embedder.name!r} "
            f"({manifest.embedder.dimension}-d) but the server was given {embedder!r}; "
            "serve it with the same embedder or rebuild the index"
        )


def check_embedder_dimension(manifest: Manifest, name: str, dimension: int) -> None:
    if manifest.embedder is not None and manifest.embedder.dimension != dimension:
        raise ManifestError(
            f"the index holds {manifest.embedder.dimension}-d vectors from {manifest.embedder.name!r} "
            f"but embedder {name!r} makes {dimension}-d vectors; "
            "serve it with the same embedder or rebuild the index"
        )

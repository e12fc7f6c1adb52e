"""Parquet in and out for `serve-app batch`: input checks, the output schema, and the output
directory as the job's only record of progress (resume reads it, compaction keeps it at one
row per id). Plain pyarrow: no Ray, so all of it runs and is tested on the driver."""

from __future__ import annotations

import glob
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

InputSource = str | os.PathLike | Sequence[str | os.PathLike]

# fmt: off
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("status", pa.string()),            # completed | incomplete | failed
    ("text", pa.string()),              # null on failed rows
    ("token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),     # stop | length | timeout; error: the engine failed
    ("prompt_tokens", pa.int32()),      # null when the prompt could not be tokenized
    ("completion_tokens", pa.int32()),
    ("error_code", pa.string()),
    ("error_message", pa.string()),
    ("attempt", pa.int32()),            # 1, then +1 each time --resume re-runs the id
    ("model", pa.string()),
    ("weights_sha256", pa.string()),
    ("tokenizer_sha256", pa.string()),
    ("chat_template_sha256", pa.string()),
])
# fmt: on
STATUSES = ("completed", "incomplete", "failed")
# Failures worth running again: the engine, not the row, was at fault.
TRANSIENT_ERROR_CODES = frozenset({"engine_error"})
# OpenAI fields that would change the output but that a batch row cannot ask for: a file
# carrying them is refused rather than silently answered without them.
UNSUPPORTED_COLUMNS = frozenset(
    {"n", "best_of", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "suffix"}
)
_MAX_NAMED = 5
# Files whose names start with these are not results (temporaries, quarantined files).
_HIDDEN_PREFIXES = (".", "_")


class BatchInputError(ValueError):
    """The job cannot start: bad input, or an output directory that does not fit the run."""


def is_transient(status: str | None, error_code: str | None) -> bool:
    return status == "failed" and error_code in TRANSIENT_ERROR_CODES


# ------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class InputFiles:
    paths: list[str]
    filesystem: pafs.FileSystem


def resolve_input(source: InputSource) -> InputFiles:
    """A file, a directory (its `*.parquet` files, recursively), a local glob, or a list of
    them; URIs (s3://...) as pyarrow reads them. Lists names only: nothing is read yet."""
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    paths: list[str] = []
    filesystem: pafs.FileSystem | None = None
    for item in map(str, items):
        if "://" not in item and glob.has_magic(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise BatchInputError(f"input: no file matches {item!r}")
        else:
            matches = [item]
        for match in matches:
            fs, files = _list_parquet(match)
            if filesystem is None:
                filesystem = fs
            elif fs.type_name != filesystem.type_name:
                raise BatchInputError("input: every path must be on the same filesystem")
            paths.extend(files)
    if not paths or filesystem is None:
        raise BatchInputError(f"input: no Parquet files in {', '.join(map(str, items))}")
    return InputFiles(list(dict.fromkeys(paths)), filesystem)


def _list_parquet(location: str) -> tuple[pafs.FileSystem, list[str]]:
    if "://" in location:
        fs, path = pafs.FileSystem.from_uri(location)
    else:
        # Absolute, so Ray workers (whatever their working directory) find the files.
        fs, path = pafs.LocalFileSystem(), str(Path(location).resolve())
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return fs, [path]
    if info.type != pafs.FileType.Directory:
        raise BatchInputError(f"input: no such file or directory: {location}")
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(
        f.path
        for f in found
        if f.type == pafs.FileType.File
        and f.base_name.endswith((".parquet", ".parq"))
        # Hidden and "_"-prefixed names are writers' temporaries and markers, not data.
        and not any(part.startswith(_HIDDEN_PREFIXES) for part in f.path[len(path) :].split("/"))
    )
    return fs, files


def read_input_ids(files: InputFiles) -> pa.Array:
    """Every input id, checked: a string `id` column in each file, no nulls, no duplicates.
    Reads only that column, so it is cheap next to the job it guards."""
    chunks = []
    for path in files.paths:
        schema = pq.read_schema(path, filesystem=files.filesystem)
        if "id" not in schema.names:
            raise BatchInputError(f"{path}: no 'id' column; every row needs a string id")
        id_type = schema.field("id").type
        if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type)):
            raise BatchInputError(f"{path}: 'id' must be a string column, not {id_type}")
        unsupported = sorted(UNSUPPORTED_COLUMNS.intersection(schema.names))
        if unsupported:
            raise BatchInputError(f"{path}: unsupported column(s) {', '.join(unsupported)}")
        table = pq.read_table(path, columns=["id"], filesystem=files.filesystem)
        chunks.extend(table.column("id").cast(pa.string()).chunks)
    ids = pa.chunked_array(chunks, type=pa.string()).combine_chunks()
    if ids.null_count:
        raise BatchInputError(f"input: {ids.null_count} row(s) have a null id")
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        named = ", ".join(repr(v) for v in repeated.field("values")[:_MAX_NAMED].to_pylist())
        more = f" and {len(repeated) - _MAX_NAMED} more" if len(repeated) > _MAX_NAMED else ""
        raise BatchInputError(
            f"input: duplicate ids refused before any work: {named}{more} "
            f"({len(repeated)} id(s) appear more than once)"
        )
    return ids


# ------------------------------------------------------------------------------ output


@dataclass(frozen=True)
class OutputDir:
    filesystem: pafs.FileSystem
    path: str
    uri: str  # what Ray Data's writer is given

    @classmethod
    def open(cls, location: str | os.PathLike) -> OutputDir:
        text = str(location)
        if "://" in text:
            fs, path = pafs.FileSystem.from_uri(text)
            uri = text
        else:
            fs, path = pafs.LocalFileSystem(), str(Path(text).resolve())
            uri = path
        fs.create_dir(path, recursive=True)
        return cls(fs, path, uri)

    def result_files(self) -> list[str]:
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(
            info.path
            for info in infos
            if info.type == pafs.FileType.File
            and info.base_name.endswith(".parquet")
            and not info.base_name.startswith(_HIDDEN_PREFIXES)
        )

    def read(self, path: str, columns: list[str] | None = None) -> pa.Table | None:
        """One result file, or None after moving an unreadable one aside: a job killed while
        writing leaves a truncated file, whose rows then simply count as not done."""
        try:
            return pq.read_table(path, columns=columns, filesystem=self.filesystem)
        except (OSError, pa.ArrowInvalid) as exc:
            head, name = path.rsplit("/", 1)
            aside = f"{head}/.unreadable-{uuid.uuid4().hex[:8]}-{name}"
            logger.warning("moving unreadable result file %s aside to %s: %s", path, aside, exc)
            self.filesystem.move(path, aside)
            return None


@dataclass(frozen=True)
class ResultRow:
    id: str
    status: str
    error_code: str | None
    attempt: int
    path: str
    index: int  # row within its file


_SCAN_COLUMNS = ["id", "status", "error_code", "attempt"]


def scan_results(out: OutputDir) -> dict[str, list[ResultRow]]:
    """Every row of every result file, grouped by id; the first of each list is the one that
    counts (highest attempt; ties go to the first file by name, so the choice is stable)."""
    rows: dict[str, list[ResultRow]] = {}
    for path in out.result_files():
        table = out.read(path, _SCAN_COLUMNS)
        if table is None:
            continue
        columns = [table.column(c).to_pylist() for c in _SCAN_COLUMNS]
        for index, (rid, status, code, attempt) in enumerate(zip(*columns, strict=True)):
            rows.setdefault(rid, []).append(ResultRow(rid, status, code, attempt or 1, path, index))
    for group in rows.values():
        group.sort(key=lambda r: -r.attempt)  # stable: file order breaks ties
    return rows


def compact(out: OutputDir) -> int:
    """Drop every row superseded by a later attempt, rewriting only the files that hold one.
    Each rewrite lands by rename, so a kill mid-way leaves duplicates that the next scan
    resolves the same way, never a lost row. Returns the number of rows dropped."""
    stale: dict[str, list[int]] = {}
    for group in scan_results(out).values():
        for row in group[1:]:
            stale.setdefault(row.path, []).append(row.index)
    for path, indices in stale.items():
        table = out.read(path)
        if table is None:
            continue
        keep = pc.invert(pc.is_in(pa.array(range(table.num_rows)), pa.array(indices)))
        kept = table.filter(keep)
        if kept.num_rows == 0:
            out.filesystem.delete_file(path)
            continue
        head, name = path.rsplit("/", 1)
        tmp = f"{head}/.compact-{uuid.uuid4().hex[:8]}-{name}"
        pq.write_table(kept, tmp, filesystem=out.filesystem)
        out.filesystem.move(tmp, path)
    return sum(len(v) for v in stale.values())


def read_results(out: OutputDir, columns: list[str] | None = None) -> pa.Table:
    """The output as one table (after `compact`: one row per id), in OUTPUT_SCHEMA."""
    tables = []
    for path in out.result_files():
        table = out.read(path)
        if table is not None:
            tables.append(table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA))
    table = pa.concat_tables(tables) if tables else OUTPUT_SCHEMA.empty_table()
    return table.select(columns) if columns else table

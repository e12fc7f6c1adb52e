"""Parquet in and out for `serve-app batch`: input checks, the output schema, and the output
directory as the job's only record of progress (engines commit result files into it as rows
finish, resume reads it, compaction keeps it at one row per id). Plain pyarrow: no Ray, so all
of it runs and is tested on the driver.

Every result file lands whole (`write_atomic`: a hidden temporary, fsync, rename), and readers
resolve duplicates by id (the latest attempt), so the directory is consistent at any instant
a job can be killed in."""

from __future__ import annotations

import glob
import logging
import os
import uuid
from collections.abc import Callable, Sequence
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
TEMP_PREFIX = ".tmp-"
# Engines commit `part-*` files as rows finish; compaction merges them into `compacted-*`
# files (sorted first, so an identical copy left by a cut-short compaction wins ties).
PART_PREFIX = "part-"
COMPACTED_PREFIX = "compacted-"
COMPACT_ROWS_PER_FILE = 100_000


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


def compact(
    out: OutputDir,
    *,
    rows_per_file: int = COMPACT_ROWS_PER_FILE,
    on_written: Callable[[], None] | None = None,
) -> int:
    """Merge the result files into files of up to `rows_per_file` rows holding one row per id
    (its latest attempt); a large file that holds only such rows stays as it is. Each merged
    file is committed before the files it replaces are removed, so a kill at any point leaves
    every id's latest row on disk, at worst twice (identical copies, which `scan_results`
    resolves). `on_written` runs after each merged file lands (the tests' kill point).
    Returns the number of superseded rows dropped."""
    winners, num_rows = _winners(out)
    num_stale = sum(num_rows.values()) - sum(len(v) for v in winners.values())
    rewrite = [p for p, n in num_rows.items() if len(winners.get(p, ())) < n]
    small = [p for p, n in num_rows.items() if n < rows_per_file and p not in rewrite]
    if len(rewrite) + len(small) > 1:
        rewrite += small
    for group in _groups(sorted(rewrite), winners, rows_per_file):
        if len(group) == 1 and len(winners.get(group[0], ())) == num_rows[group[0]]:
            continue  # alone in its group and clean: a rewrite would copy it as it is
        kept = [t for t in (_take(out, p, winners.get(p, [])) for p in group) if t is not None]
        if kept:
            name = f"{COMPACTED_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
            write_atomic(out.filesystem, f"{out.path}/{name}", pa.concat_tables(kept))
            if on_written is not None:
                on_written()
        for path in group:
            out.filesystem.delete_file(path)
    return num_stale


def _winners(out: OutputDir) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Per result file: the indices of the rows that count, and its number of rows."""
    winners: dict[str, list[int]] = {}
    num_rows: dict[str, int] = {}
    for group in scan_results(out).values():
        winners.setdefault(group[0].path, []).append(group[0].index)
        for row in group:
            num_rows[row.path] = num_rows.get(row.path, 0) + 1
    return winners, num_rows


def _groups(paths: list[str], winners: dict[str, list[int]], limit: int) -> list[list[str]]:
    """Consecutive files whose kept rows add up to at most `limit` (or one larger file)."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for path in paths:
        n = len(winners.get(path, ()))
        if current and size + n > limit:
            groups.append(current)
            current, size = [], 0
        current.append(path)
        size += n
    return [*groups, current] if current else groups


def _take(out: OutputDir, path: str, indices: list[int]) -> pa.Table | None:
    if not indices:
        return None
    table = out.read(path)
    if table is None:
        return None
    table = table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
    return table.take(pa.array(sorted(indices), pa.int64()))


def read_results(out: OutputDir, columns: list[str] | None = None) -> pa.Table:
    """The output as one table in OUTPUT_SCHEMA, one row per id (the latest attempt), whether
    or not a compaction was cut short."""
    winners, _ = _winners(out)
    tables = [t for p in sorted(winners) if (t := _take(out, p, winners[p])) is not None]
    table = pa.concat_tables(tables) if tables else OUTPUT_SCHEMA.empty_table()
    return table.select(columns) if columns else table


def write_atomic(
    fs: pafs.FileSystem,
    path: str,
    table: pa.Table,
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Write `table` to `path` so that a reader sees all of it or nothing: a temporary name in
    the same folder (hidden from readers), flushed to disk, then renamed. A local folder is
    synced too, so that the rename survives a power cut."""
    head, name = path.rsplit("/", 1)
    tmp = f"{head}/{TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{name}"
    if isinstance(fs, pafs.LocalFileSystem):
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
        _fsync_dir(head)
        return
    pq.write_table(table, tmp, filesystem=fs)  # an object store publishes it whole on close
    if before_rename is not None:
        before_rename()
    fs.move(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(out: OutputDir) -> int:
    """Delete what writers killed mid-write left behind (temporaries, never results)."""
    infos = out.filesystem.get_file_info(pafs.FileSelector(out.path, allow_not_found=True))
    temps = [
        i.path
        for i in infos
        if i.type == pafs.FileType.File and i.base_name.startswith(TEMP_PREFIX)
    ]
    for path in temps:
        out.filesystem.delete_file(path)
    return len(temps)

"""Reading a local dataset file into rows (dicts), one row at a time, with its row number.

Formats, told apart by the path alone (so the launcher can check a recipe before anything heavy
is imported):

    *.jsonl / *.ndjson       one JSON object per line; blank lines are ignored; row = line number
    *.parquet                a Parquet file (pyarrow); row = 1-based row index
    a directory with         a `datasets` Dataset written by `save_to_disk`: Arrow IPC stream files
      state.json             listed in state.json["_data_files"], read with pyarrow (no hard
                             dependency on `datasets`); row = 1-based index over the files in order

A `DatasetDict` directory (dataset_dict.json, one sub-directory per split) is refused with the
split directories to choose from. A line that is not valid JSON, or not a JSON object, comes out as
a `BadRow` (the caller skips and counts it, or raises, as data.on_bad_row says).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llamarl.errors import first_line

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class BadRow:
    """A row that could not be read at all (its reason says why)."""

    reason: str


def detect_format(path: str | Path) -> str:
    """'jsonl' | 'parquet' | 'arrow_dir' for `path`; a one-line ValueError otherwise."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{str(p)!r} does not exist: give the path of a local .jsonl or "
                         ".parquet file or of a directory written by datasets' save_to_disk")
    if p.is_dir():
        if (p / "state.json").is_file():
            return "arrow_dir"
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            example = str(p / (splits or ["train"])[0])
            raise ValueError(f"{str(p)!r} is a DatasetDict with splits {splits}: point at one "
                             f"split's directory, for example {example!r}")
        raise ValueError(f"{str(p)!r} is a directory without state.json, so not a dataset "
                         "written by save_to_disk: point at a save_to_disk directory or a file")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise ValueError(f"{str(p)!r} has an unknown format ({suffix or 'no suffix'}): use "
                     f"{' / '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} or a save_to_disk directory")


def row_label(path: str | Path) -> str:
    """What a row number counts in `path`: 'line' (JSONL) or 'row'."""
    return "line" if detect_format(path) == "jsonl" else "row"


def column_names(path: str | Path) -> list[str] | None:
    """The top-level columns of a Parquet / Arrow dataset (None for JSONL: rows may differ)."""
    fmt = detect_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with _readable(path, "Parquet"):
            return list(pq.read_schema(path).names)
    if fmt == "arrow_dir":
        files = _arrow_files(Path(path))
        return list(_read_arrow_file(files[0]).schema.names) if files else []
    return None


def read_rows(path: str | Path, columns: list[str] | None = None
              ) -> Iterator[tuple[int, dict | BadRow]]:
    """Yield (row number, row dict or BadRow) for every row of `path`, in file order.
    `columns`: the top-level columns to read (Parquet / Arrow only; None = all)."""
    fmt = detect_format(path)
    if fmt == "jsonl":
        yield from _jsonl_rows(Path(path))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        with _readable(path, "Parquet"):
            table = pq.read_table(path, columns=columns)
        yield from enumerate(table.to_pylist(), start=1)
    else:
        n = 0
        for f in _arrow_files(Path(path)):
            table = _read_arrow_file(f)
            if columns is not None:
                table = table.select(columns)
            for row in table.to_pylist():
                n += 1
                yield n, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | BadRow]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield number, BadRow(f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            yield number, row if isinstance(row, dict) else BadRow(
                f"a JSON {type(row).__name__}, not an object")


@contextmanager
def _readable(path, kind: str):
    """Turn a reader's error on a damaged or mislabelled file into one line naming it."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a readable {kind} file ({first_line(e, 200)}): "
                         "check the file, or give it the suffix of its real format (.jsonl, "
                         ".parquet)") from None


def _arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a save_to_disk directory, in the order state.json lists them."""
    state = json.loads((path / "state.json").read_text())
    files = [path / d["filename"] for d in state.get("_data_files", [])]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"save_to_disk directory {str(path)!r} lacks {missing[0]} named in its "
                         "state.json: copy the whole directory")
    return files


def _read_arrow_file(path: Path):
    """One Arrow file: `save_to_disk` writes the IPC stream format; accept the file format too."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()

"""Reading a dataset file into (location, row) pairs: JSON Lines, Parquet, or a local Hugging Face
dataset directory. The location (`file:line`, `file:row N`) is what every error about the row names.

What no dataset may be: a path that is not a regular file or a directory (a device, a FIFO, a
socket: /dev/zero read as one endless line, a FIFO waited on forever), a JSONL line longer than
MAX_LINE_BYTES (read in bounded pieces), or a number that is not finite (NaN, Infinity, a literal
beyond a float's range such as 1e999, a NaN or infinite Parquet float) or an integer longer than
Python reads from text: each fails with the file and line or row."""

from __future__ import annotations

import json
import math
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slime.errors import UserError


class DatasetError(UserError, ValueError):
    """A prompt dataset that cannot be loaded; the message names the file, the line or row, and why."""

    hint = "data.path is a JSONL or Parquet file or a saved HF dataset directory, a prompt per row (README, 'Your own model, data and reward')"


JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_FORMATS = (
    "JSON Lines (.jsonl/.json), Parquet (.parquet), or a directory saved with datasets.Dataset.save_to_disk"
)


def read_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, row) pairs; location is `file:line` or `file:row N` for error messages."""
    if p.is_dir():
        yield from _read_hf_dir(p)
        return
    _refuse_special_file(p)
    if p.suffix.lower() in JSONL_SUFFIXES:
        yield from _read_jsonl(p)
    elif p.suffix.lower() in PARQUET_SUFFIXES:
        yield from _read_parquet(p)
    else:
        raise DatasetError(f"{p}: unsupported dataset format {p.suffix!r}; supported: {SUPPORTED_FORMATS}")


_SPECIAL_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_special_file(p: Path) -> None:
    """A path (its symlinks followed) that is not a regular file: a device never ends (/dev/zero),
    a FIFO blocks until a writer comes. Checked from stat, before anything opens it."""
    try:
        mode = p.stat().st_mode
    except OSError as exc:
        raise DatasetError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        return
    kind = next((name for is_kind, name in _SPECIAL_FILES if is_kind(mode)), f"file mode {stat.filemode(mode)}")
    real = p.resolve()
    target = f" ({real})" if real != p.absolute() else ""
    raise DatasetError(
        f"{p}: not a regular file: {kind}{target}; a dataset is read from a regular file or a directory",
        hint="point data.path at the dataset file itself (a symlink to a regular file is fine)",
    )


# --- JSON Lines -----------------------------------------------------------------------------------

# The longest JSONL line read (bytes, newline included). A line is read in pieces up to it, so a
# huge file without a newline fails here instead of being read whole into memory.
MAX_LINE_BYTES = 64 << 20  # 64 MiB

# Python's own limit on an integer read from text (sys.int_info.default_max_str_digits): longer
# ones fail there, and an unlimited interpreter would convert them in quadratic time.
MAX_INT_DIGITS = 4300


class _DuplicateKey(Exception):
    """A JSON object with a key twice (Python's json keeps the last one without a word)."""


class _NotANumber(Exception):
    """NaN, Infinity or -Infinity: not JSON, though Python's json reads them as floats."""


class _BadNumber(Exception):
    """A JSON number no row may hold: an integer too long to read, a literal beyond a float's range."""


def _first_duplicate(keys: list[Any]) -> Any:
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # the rare case pays for finding the key
        raise _DuplicateKey(_first_duplicate([k for k, _ in pairs]))
    return out


def _not_a_number(name: str) -> float:
    raise _NotANumber(name)


_INFINITIES = (math.inf, -math.inf)


def _float(literal: str) -> float:
    value = float(literal)
    if value in _INFINITIES:  # float() reads no NaN from a JSON number; an overflow reads as inf
        shown = literal if len(literal) <= 40 else f"{literal[:20]}... ({len(literal)} characters)"
        raise _BadNumber(
            f"{shown} is not a finite number: beyond a float's range, Python's json would read it as {value}, "
            "which reaches the reward",
            "write null, or the number as a string",
        )
    return value


# Integers go through json's own parser (a Python hook per number doubled the load of number-heavy
# rows); one longer than Python reads from text fails there with a plain ValueError (_parse_line).
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_not_a_number, parse_float=_float)


def _lines(p: Path, f: Any) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary file, each line read up to MAX_LINE_BYTES and no further."""
    lineno = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise DatasetError(
                f"{p}:{lineno}: the line is longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES, "
                f"{MAX_LINE_BYTES / 2**20:g} MiB), the most one JSONL row may take",
                hint="a JSON Lines file holds one JSON object per line; keep a row under the limit "
                "(large media belong in files the row names)",
            )
        yield lineno, raw


def _read_jsonl(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with p.open("rb") as f:  # decoded line by line: a bad byte is named by its line
        for lineno, raw in _lines(p, f):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # -sig: tolerate a BOM
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line)"
                ) from None
            if line.strip():
                yield where, _parse_line(where, line, lineno)


def _parse_line(where: str, line: str, lineno: int) -> dict[str, Any]:
    try:
        row = _DECODER.decode(line)
    except json.JSONDecodeError as exc:
        hint = ""
        if lineno == 1 and line.lstrip().startswith("["):
            hint = " (this looks like a JSON array; write one JSON object per line instead)"
        what = exc.msg.removesuffix(" at")  # json's "Invalid control character at"
        raise DatasetError(f"{where}: malformed JSON: {what} at column {exc.colno}{hint}") from None
    except RecursionError:
        raise DatasetError(f"{where}: JSON nested too deeply to read") from None
    except _DuplicateKey as exc:
        raise DatasetError(
            f"{where}: the key {exc.args[0]!r} appears twice in one JSON object; which value is meant is not "
            "clear (Python's json would keep the last without a word)",
            hint="give every key of an object once",
        ) from None
    except _NotANumber as exc:
        raise DatasetError(
            f"{where}: {exc.args[0]} is not a JSON number (JSON has no NaN or Infinity; Python's json would "
            "read it as a float that reaches the reward)",
            hint="write null, or the number as a string",
        ) from None
    except _BadNumber as exc:
        raise DatasetError(f"{where}: {exc.args[0]}", hint=exc.args[1]) from None
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) ...: value has 5001 digits; ..."
        limit = sys.get_int_max_str_digits() or MAX_INT_DIGITS
        digits = re.search(r"value has (\d+) digits", str(exc))
        raise DatasetError(
            f"{where}: an integer of {digits[1] if digits else 'too many'} digits, more than the {limit} Python "
            "reads as a number",
            hint="write such a number as a string",
        ) from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    try:  # JSON's \ud800-\udfff escapes decode to lone surrogates: not text, they break every encode
        if "\\u" in line:  # only an escape makes one (the line itself decoded as UTF-8)
            json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise DatasetError(f"{where}: a string holds {bad}, a lone UTF-16 surrogate, which is not text") from None
    return row


# --- Parquet and Hugging Face directories ---------------------------------------------------------


def _read_parquet(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{p}: cannot read as Parquet: {exc}") from exc
    floats = _has_float(table.schema)
    for i, row in enumerate(_table_rows(p, table)):
        if floats:
            _refuse_non_finite(f"{p}:row {i}", row)
        yield f"{p}:row {i}", row


def _has_float(schema: Any) -> bool:
    """Whether a column of `schema` holds floats, at any depth (only then are rows walked for NaN)."""
    import pyarrow as pa

    def floating(typ: Any) -> bool:
        return pa.types.is_floating(typ) or any(floating(typ.field(i).type) for i in range(typ.num_fields))

    return any(floating(field.type) for field in schema)


def _refuse_non_finite(where: str, row: dict[str, Any]) -> None:
    """A NaN or infinite float anywhere in a Parquet or HF row: refused as JSONL refuses NaN and
    Infinity, since every column reaches the reward (the label, the rest as metadata)."""
    for key, value in row.items():
        found = _non_finite(value, str(key))
        if found is not None:
            raise DatasetError(
                f"{where}: column {found[0]!r} holds {found[1]}, not a finite number (it would reach the reward "
                "as a float; the JSONL reader refuses NaN and Infinity alike)",
                hint="write null for a missing value (pandas' to_parquet writes NaN as null by default)",
            )


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """(where, value) of the first NaN or infinite float in `value`; None when there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{path}[{k}]" if isinstance(value, list) else f"{path}.{k}")
        if found is not None:
            return found
    return None


def _table_rows(p: Path, table: Any) -> list[dict[str, Any]]:
    """The table's rows, a map column's values as dicts (plain to_pylist gives lists of pairs)."""
    try:
        return table.to_pylist(maps_as_pydicts="strict")
    except (TypeError, KeyError):  # pyarrow < 20 has no maps_as_pydicts; KeyError: a map holds a key twice
        return [_maps_as_dicts(f"{p}:row {i}", row, table.schema) for i, row in enumerate(table.to_pylist())]


def _maps_as_dicts(where: str, row: dict[str, Any], schema: Any) -> dict[str, Any]:
    """A plain to_pylist row with each map's (key, value) pairs made a dict, at any depth."""
    import pyarrow as pa

    def convert(value: Any, typ: Any) -> Any:
        if value is None:
            return None
        if pa.types.is_map(typ):
            out = {k: convert(v, typ.item_type) for k, v in value}
            if len(out) != len(value):
                dup = _first_duplicate([k for k, _ in value])
                raise DatasetError(f"{where}: a map holds the key {dup!r} twice; which value is meant is not clear")
            return out
        if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
            return [convert(v, typ.value_type) for v in value]
        if pa.types.is_struct(typ):
            return {f.name: convert(value[f.name], f.type) for f in typ}
        return value

    return {f.name: convert(row[f.name], f.type) for f in schema}


def _read_hf_dir(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # not a save_to_disk directory, or a corrupt one
        raise DatasetError(
            f"{p}: a directory, but not loadable with datasets.load_from_disk ({exc}); supported: {SUPPORTED_FORMATS}"
        ) from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetError(f"{p}: a DatasetDict without a 'train' split; its splits are {sorted(ds)}")
        ds = ds["train"]
    floats = _has_float(ds.data.schema)
    for i, row in enumerate(ds):
        if floats:
            _refuse_non_finite(f"{p}:row {i}", row)
        yield f"{p}:row {i}", dict(row)

"""Reading a dataset file into (location, row) pairs: JSON Lines, Parquet, or a local Hugging Face
dataset directory. The location (`file:line`, `file:row N`) is what every error about the row names."""

from __future__ import annotations

import json
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
    elif p.suffix.lower() in JSONL_SUFFIXES:
        yield from _read_jsonl(p)
    elif p.suffix.lower() in PARQUET_SUFFIXES:
        yield from _read_parquet(p)
    else:
        raise DatasetError(f"{p}: unsupported dataset format {p.suffix!r}; supported: {SUPPORTED_FORMATS}")


# --- JSON Lines -----------------------------------------------------------------------------------


class _DuplicateKey(Exception):
    """A JSON object with a key twice (Python's json keeps the last one without a word)."""


class _NotANumber(Exception):
    """NaN, Infinity or -Infinity: not JSON, though Python's json reads them as floats."""


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


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_not_a_number)


def _read_jsonl(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with p.open("rb") as f:  # decoded line by line: a bad byte is named by its line
        for lineno, raw in enumerate(f, start=1):
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
    for i, row in enumerate(_table_rows(p, table)):
        yield f"{p}:row {i}", row


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
    for i, row in enumerate(ds):
        yield f"{p}:row {i}", dict(row)

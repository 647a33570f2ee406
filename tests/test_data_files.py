"""slime/data_files.py: a dataset file read into (location, row) pairs, each bad row named by its
file:line (JSONL) or file:row N (Parquet)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import slime.data
from slime.data_files import DatasetError, _maps_as_dicts, read_rows

MAP = pa.map_(pa.string(), pa.int64())


def rows_of(path: Path) -> list[tuple[str, dict]]:
    return list(read_rows(path))


def test_dataset_error_is_the_one_slime_data_raises() -> None:
    assert slime.data.DatasetError is DatasetError


def test_a_parquet_map_column_reaches_the_reward_as_a_dict(tmp_path: Path) -> None:
    """Plain to_pylist gave a map as a list of [key, value] pairs: label {'k': 1} became [['k', 1]]."""
    table = pa.table(
        {
            "prompt": ["a", "b", "c"],
            "label": pa.array([{"k": 1}, {"k2": 2}, None], type=MAP),
            "meta": pa.array(
                [{"m": [("x", 1)], "ms": [[("y", 2)]]}, {"m": None, "ms": []}, None],
                type=pa.struct([("m", MAP), ("ms", pa.list_(MAP))]),
            ),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    rows = [row for _, row in rows_of(tmp_path / "d.parquet")]
    assert [r["label"] for r in rows] == [{"k": 1}, {"k2": 2}, None]
    assert [r["meta"] for r in rows] == [{"m": {"x": 1}, "ms": [{"y": 2}]}, {"m": None, "ms": []}, None]
    # pyarrow < 20 (no maps_as_pydicts): the rows are converted here, to the same dicts
    plain = table.to_pylist()
    assert [_maps_as_dicts(f"row {i}", row, table.schema) for i, row in enumerate(plain)] == rows


def test_a_parquet_map_with_a_key_twice_is_refused_naming_the_row(tmp_path: Path) -> None:
    label = pa.array([[("k", 1)], [("k", 1), ("k", 2)]], type=MAP)
    pq.write_table(pa.table({"prompt": ["a", "b"], "label": label}), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet:row 1: a map holds the key 'k' twice"):
        rows_of(tmp_path / "d.parquet")


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('{"prompt": "a", "prompt": "b"}', "prompt"),
        ('{"prompt": "a", "label": {"x": 1, "y": 2, "x": 3}}', "x"),
        ('{"prompt": [{"role": "user", "content": "a", "role": "system"}]}', "role"),
    ],
)
def test_a_jsonl_key_twice_in_an_object_is_refused_naming_line_and_key(tmp_path: Path, line: str, key: str) -> None:
    """Python's json kept the last of the two values, silently."""
    path = write(tmp_path / "d.jsonl", ['{"prompt": "ok", "label": {"x": 1}}', line])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: the key {key!r} appears twice in one JSON object")):
        rows_of(path)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_jsonl_are_refused_naming_the_line(tmp_path: Path, constant: str) -> None:
    """Not JSON; Python's json read them as floats that reached the reward as nan/inf."""
    path = write(
        tmp_path / "d.jsonl", ['{"prompt": "ok", "label": 1.5}', f'{{"prompt": "a", "label": [1, {constant}]}}']
    )
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: {constant} is not a JSON number")):
        rows_of(path)


def test_jsonl_rows_keep_their_values(tmp_path: Path) -> None:
    row = {"prompt": "a", "label": {"x": 1, "y": [1.5, None, "NaN"]}, "n": -0.0, "big": 1e308}
    path = write(tmp_path / "d.jsonl", [json.dumps(row)])
    assert rows_of(path) == [(f"{path}:1", row)]

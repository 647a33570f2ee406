"""Bad dataset files and config files found by fuzzing: each fails with one clear error (a DatasetError
naming file:line or file:row N, a ConfigError naming the file), never a raw traceback, a hang, or
unbounded memory."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import slime.config.base as config_base
import slime.data_files
from slime.config import load_config
from slime.config.base import ConfigError, load_yaml_file
from slime.data_files import DatasetError, read_rows


def rows_of(path: Path) -> list[tuple[str, dict]]:
    return list(read_rows(path))


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# --- JSON numbers ---------------------------------------------------------------------------------


def test_an_integer_of_more_than_4300_digits_is_refused_naming_the_line(tmp_path: Path) -> None:
    """Python's int refused it with a raw ValueError traceback naming no file or line."""
    path = write(
        tmp_path / "d.jsonl", ['{"prompt": "ok", "label": 1}', '{"prompt":"ab*2=","label":1' + "0" * 5000 + "}"]
    )
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: an integer of 5001 digits")):
        rows_of(path)
    path = write(tmp_path / "neg.jsonl", ['{"prompt": "a", "label": [-' + "9" * 4301 + "]}"])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: an integer of 4301 digits")):
        rows_of(path)


def test_an_integer_within_the_digit_limit_still_loads(tmp_path: Path) -> None:
    big = int("7" * 4300)
    path = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "label": big, "n": -3})])
    assert rows_of(path) == [(f"{path}:1", {"prompt": "a", "label": big, "n": -3})]


@pytest.mark.parametrize("literal", ["1e999", "-1e400", "1" + "0" * 400 + ".5", "[2.5, 1E+309]"])
def test_a_number_that_overflows_to_infinity_is_refused_like_infinity(tmp_path: Path, literal: str) -> None:
    """1e999 read as inf, which reached the reward, though the literal Infinity is refused."""
    path = write(tmp_path / "d.jsonl", ['{"prompt": "ok", "label": 1.5}', f'{{"prompt": "a", "label": {literal}}}'])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: ") + r".* is not a finite number"):
        rows_of(path)


def test_large_finite_and_tiny_numbers_still_load(tmp_path: Path) -> None:
    path = write(
        tmp_path / "d.jsonl", ['{"prompt": "a", "label": [1.7976931348623157e308, -1e308, 1e-400, 5e-324, 0.1]}']
    )
    assert rows_of(path)[0][1]["label"] == [1.7976931348623157e308, -1e308, 0.0, 5e-324, 0.1]


# --- Parquet and HF non-finite floats -------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "values", "said"),
    [
        ("label", pa.array([1.0, float("nan")]), "column 'label' holds nan"),
        ("score", pa.array([0.5, float("-inf")], type=pa.float32()), "column 'score' holds -inf"),
        (
            "meta",
            pa.array([{"xs": [1.0]}, {"xs": [2.0, float("inf")]}], type=pa.struct([("xs", pa.list_(pa.float64()))])),
            "column 'meta.xs[1]' holds inf",
        ),
    ],
)
def test_a_parquet_nan_or_infinity_is_refused_naming_file_row_and_column(
    tmp_path: Path, column: str, values: pa.Array, said: str
) -> None:
    """JSONL refuses NaN and Infinity because they reach the reward; Parquet loaded them silently."""
    pq.write_table(pa.table({"prompt": ["a", "b"], column: values}), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'd.parquet'}:row 1: {said}")):
        rows_of(tmp_path / "d.parquet")


def test_parquet_nulls_and_finite_floats_still_load(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["a", "b"], "label": pa.array([1.5, None]), "n": pa.array([None, -0.0])})
    pq.write_table(table, tmp_path / "d.parquet")
    assert [row for _, row in rows_of(tmp_path / "d.parquet")] == [
        {"prompt": "a", "label": 1.5, "n": None},
        {"prompt": "b", "label": None, "n": -0.0},
    ]


def test_an_hf_directory_with_nan_is_refused_naming_the_row(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "label": [1.0, 2.0, math.nan]}).save_to_disk(tmp_path / "hf")
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'hf'}:row 2: column 'label' holds nan")):
        rows_of(tmp_path / "hf")


# --- files that are not regular files, and lines without end --------------------------------------


def test_a_symlink_to_a_device_is_refused_naming_path_and_kind(tmp_path: Path) -> None:
    """A .jsonl symlink to /dev/zero was read as one endless line (23 GB before it died)."""
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(DatasetError, match=re.escape(f"{link}: not a regular file: a character device (/dev/zero)")):
        rows_of(link)


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            rows_of(fifo)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # it opened the FIFO and waits for a writer: give it one, so it ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail("reading a FIFO as data.path hung waiting for a writer")
    assert isinstance(outcome[0], DatasetError), outcome
    assert str(outcome[0]).startswith(f"{fifo}: not a regular file: a FIFO (named pipe)")


def test_a_line_over_the_limit_is_refused_with_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge file without a newline was read whole as one line; now at most the limit is held."""
    limit = 1 << 20
    monkeypatch.setattr(slime.data_files, "MAX_LINE_BYTES", limit)
    path = tmp_path / "d.jsonl"
    with path.open("w") as f:
        f.write('{"prompt": "ok"}\n{"prompt": "')
        for _ in range(6):
            f.write("a" * (1 << 20))  # 6 MiB, no newline
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match=re.escape(f"{path}:2: the line is longer than {limit} bytes")):
            rows_of(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * limit, peak


def test_a_line_of_exactly_the_limit_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 1000
    monkeypatch.setattr(slime.data_files, "MAX_LINE_BYTES", limit)
    head = '{"prompt": "'
    fits = head + "a" * (limit - len(head) - 2) + '"}'
    assert len(fits) == limit
    path = write(tmp_path / "d.jsonl", [fits, fits])
    assert [where for where, _ in rows_of(path)] == [f"{path}:1", f"{path}:2"]
    path.write_text(fits)  # the last line without its newline
    assert len(rows_of(path)) == 1
    path.write_text(fits + "\n" + fits.replace('"}', 'a"}'))
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: the line is longer than {limit} bytes")):
        rows_of(path)


# --- config YAML ----------------------------------------------------------------------------------


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: [1, *a]}\n", "x: 1\nb: &b\n  c: &c [*b]\n"])
def test_a_recursive_alias_is_a_config_error(tmp_path: Path, text: str) -> None:
    """A RecursionError traceback from the alias-bomb guard, exit 1."""
    path = config(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + r"recursive alias \*[abc] at line \d"):
        load_config(path)


@pytest.mark.parametrize(
    "text",
    ["steps: " + "[" * 1000 + "]" * 1000, "steps: " + "{a: " * 1000 + "1" + "}" * 1000, "x:\n" + "- " * 1000 + "1\n"],
)
def test_a_config_nested_too_deeply_is_a_config_error(tmp_path: Path, text: str) -> None:
    """A RecursionError traceback from inside PyYAML."""
    path = config(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: too deeply nested") + r" \(more than \d+ levels"):
        load_config(path)


def test_aliases_chained_too_deeply_are_a_config_error(tmp_path: Path) -> None:
    """Each alias one level deeper: shallow as written, 400 levels once expanded (yet under the bomb guard)."""
    text = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 400))
    path = config(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: too deeply nested") + r" \(more than \d+ levels"):
        load_yaml_file(path)


def test_nesting_and_aliases_within_the_limit_still_load(tmp_path: Path) -> None:
    deepest = config_base.MAX_YAML_DEPTH - 1
    text = "a: &a {k: [1, 2]}\nb: [*a, *a]\nc: " + "[" * deepest + "]" * deepest + "\n"
    loaded = load_yaml_file(config(tmp_path, text))
    assert loaded["b"] == [{"k": [1, 2]}, {"k": [1, 2]}]
    depth, value = 0, loaded["c"]
    while isinstance(value, list):
        depth, value = depth + 1, value[0] if value else None
    assert depth == deepest


def test_a_sexagesimal_number_stays_text_and_fails_validation_naming_the_key(tmp_path: Path) -> None:
    """YAML 1.1 read `steps: 1:30` as 90 (base 60)."""
    loaded = load_yaml_file(config(tmp_path, "steps: 1:30\nt: 1:30.5\nn: 90\nf: 1.5\nh: 0x1f\nneg: -2_000\n"))
    assert loaded == {"steps": "1:30", "t": "1:30.5", "n": 90, "f": 1.5, "h": 31, "neg": -2000}
    with pytest.raises(ConfigError, match=r"steps"):
        load_config(config(tmp_path, "steps: 1:30\n"))

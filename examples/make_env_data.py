"""Write the small datasets of the environment examples (committed; rerun to regenerate):

examples/data/calculator.jsonl   multi-step arithmetic for the calculator tool (examples/calculator_tools.yaml)
examples/data/code_gen.jsonl     small functions with assert-based unit tests (examples/code_gen.yaml)

python examples/make_env_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "data"

CODE_PROBLEMS = [
    ("add(a, b)", "the sum of a and b", ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]),
    ("double(x)", "x times 2", ["assert double(0) == 0", "assert double(7) == 14", "assert double(-3) == -6"]),
    ("square(x)", "x squared", ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]),
    ("is_even(n)", "True when n is even", ["assert is_even(4)", "assert not is_even(7)", "assert is_even(0)"]),
    ("last(xs)", "the last item of the list xs", ["assert last([1, 2, 3]) == 3", "assert last('ab') == 'b'"]),
    ("rev(s)", "the string s reversed", ["assert rev('abc') == 'cba'", "assert rev('') == ''"]),
    ("count_a(s)", "how many 'a' characters s has", ["assert count_a('banana') == 3", "assert count_a('xyz') == 0"]),
    (
        "maxi(a, b)",
        "the larger of a and b",
        ["assert maxi(1, 2) == 2", "assert maxi(5, -1) == 5", "assert maxi(3, 3) == 3"],
    ),
    ("total(xs)", "the sum of the list xs", ["assert total([1, 2, 3]) == 6", "assert total([]) == 0"]),
    ("repeat(s, n)", "s repeated n times", ["assert repeat('ab', 3) == 'ababab'", "assert repeat('x', 0) == ''"]),
    (
        "first_char(s)",
        "the first character of s",
        ["assert first_char('hello') == 'h'", "assert first_char('z') == 'z'"],
    ),
    ("neg(x)", "minus x", ["assert neg(3) == -3", "assert neg(-8) == 8", "assert neg(0) == 0"]),
]


def calculator_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
        op = rng.choice(["+", "-", "*"])
        expr = f"{a}{op}{b}*{c}"
        value = {"+": a + b * c, "-": a - b * c, "*": a * b * c}[op]
        prompt = f"{expr}=? use <calculator>expr</calculator> then <answer>n</answer>\n"
        rows.append({"prompt": prompt, "label": str(value), "task": "calculator"})
    return rows


def code_rows() -> list[dict]:
    rows = []
    for signature, what, tests in CODE_PROBLEMS:
        prompt = f"Write def {signature} returning {what}.\n```python\ndef {signature}:\n"
        rows.append({"prompt": prompt, "label": {"tests": tests}, "task": "code"})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    write(HERE / "calculator.jsonl", calculator_rows(64))
    write(HERE / "code_gen.jsonl", code_rows())

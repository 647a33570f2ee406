"""Reward-model training data for the repeat task (`envs/repeat.py`: `ab*3=` -> `ababab`).

    python examples/make_preference_data.py --rm pairs.jsonl --prm steps.jsonl --num 2000
    slime train-rm  --data pairs.jsonl --out runs/rm
    slime train-prm --data steps.jsonl --out runs/prm --delimiter '|'

Preference pairs {"prompt", "chosen", "rejected"}: chosen is the correct answer, rejected a
corrupted one, of a kind drawn from `kinds`:
  * "count":   the pattern repeated one time too many or too few;
  * "char":    one character replaced by another letter of the task's alphabet;
  * "foreign": one character replaced by a letter the task never uses (the easiest to spot).

PRM examples {"prompt", "steps", "labels"}: each repetition of the pattern is a step (the
response is `delimiter.join(steps)`). A correct answer is all 1s; otherwise one step gets a wrong
character (or the answer gets an extra repetition) and every step from the first error on is 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs import repeat

KINDS = ("count", "char", "foreign")
FOREIGN = "xyz"


def _parse(problem: dict[str, Any]) -> tuple[str, int]:
    pattern, _, n = problem["prompt"].rstrip("=").rpartition("*")
    return pattern, int(n)


def _replace_char(text: str, rng: random.Random, alphabet: str) -> str:
    i = rng.randrange(len(text))
    choices = [c for c in alphabet if c != text[i]]
    return text[:i] + rng.choice(choices) + text[i + 1 :]


def corrupt(pattern: str, n: int, kind: str, rng: random.Random) -> str:
    answer = pattern * n
    if kind == "count":
        m = n + 1 if n == 1 or rng.random() < 0.5 else n - 1
        return pattern * m
    if kind == "char":
        return _replace_char(answer, rng, repeat.PATTERN_ALPHABET)
    if kind == "foreign":
        return _replace_char(answer, rng, FOREIGN)
    raise ValueError(f"unknown corruption {kind!r}; choose from {KINDS}")


def make_preference_pairs(num: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        problem = repeat.make_problem(rng)
        pattern, n = _parse(problem)
        rows.append(
            {
                "prompt": problem["prompt"],
                "chosen": problem["label"],
                "rejected": corrupt(pattern, n, rng.choice(kinds), rng),
            }
        )
    return rows


def make_prm_examples(
    num: int, seed: int = 0, error_rate: float = 0.6, alphabet: str = FOREIGN
) -> list[dict[str, Any]]:
    """Step-labelled answers; a wrong step has one character from `alphabet` (default: letters the task never uses)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        problem = repeat.make_problem(rng)
        pattern, n = _parse(problem)
        steps = [pattern] * n
        labels = [1] * n
        if rng.random() < error_rate:
            if rng.random() < 0.2:  # one repetition too many: the extra step is the first error
                steps.append(pattern)
                labels.append(0)
            else:
                k = rng.randrange(n)
                steps[k] = _replace_char(pattern, rng, alphabet)
                labels[k:] = [0] * (n - k)
        rows.append({"prompt": problem["prompt"], "steps": steps, "labels": labels})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rm", help="write preference pairs here")
    p.add_argument("--prm", help="write PRM step examples here")
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated corruptions from {KINDS}")
    ns = p.parse_args(argv)
    if not ns.rm and not ns.prm:
        p.error("give --rm and/or --prm")
    if ns.rm:
        kinds = tuple(k for k in ns.kinds.split(",") if k)
        print(write_jsonl(make_preference_pairs(ns.num, ns.seed, kinds), ns.rm))
    if ns.prm:
        print(write_jsonl(make_prm_examples(ns.num, ns.seed + 1), ns.prm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

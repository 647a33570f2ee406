"""The example task: repeat a short pattern n times (`ab*3=` -> `ababab`).

n is drawn from a log-normal, so response lengths have a long tail (p99 about 10x p50), which
is what makes synchronous RL wait on its slowest samples and what APRIL is built for. The rule
reward gives partial credit per correct character, so a warm-started policy already scores
sometimes and RL has a gradient to climb.
"""

from __future__ import annotations

import math
import random
from typing import Any

PATTERN_ALPHABET = "abcdefgh"
MAX_REPEATS = 30
TASK_VERSION = 1  # bump when generation changes, so cached warm-started models are rebuilt


def make_problem(rng: random.Random, median_repeats: float = 3.0, sigma: float = 0.9) -> dict[str, Any]:
    pattern = "".join(rng.choice(PATTERN_ALPHABET) for _ in range(rng.randint(1, 3)))
    repeats = int(round(math.exp(rng.gauss(math.log(median_repeats), sigma))))
    repeats = max(1, min(MAX_REPEATS, repeats))
    difficulty = "easy" if repeats <= 4 else "medium" if repeats <= 10 else "hard"
    return {
        "prompt": f"{pattern}*{repeats}=",
        "label": pattern * repeats,
        "task": "repeat",
        "difficulty": difficulty,
    }


def make_dataset(num: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(num)]


def score(response: str, label: str) -> float:
    """1.0 for an exact answer, else the share of positions that match, over the longer string."""
    if response == label:
        return 1.0
    longest = max(len(response), len(label))
    if longest == 0:
        return 0.0
    matches = sum(1 for a, b in zip(response, label) if a == b)
    return matches / longest


def reward(prompt: str, response: str, label: str, metadata: dict | None = None) -> float:
    return score(response, label)

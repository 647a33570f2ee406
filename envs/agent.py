"""A tool-using agent environment (the env contract of envs/contract.py).

Each model turn either calls tools (envs/tools.py) or gives the final answer. Tool results come
back as the observation, one line per call:

    <result name="calculator">5</result>
    <error>calculator: only numbers and + - * / // % ** ( ) are allowed, not Name</error>

A malformed call, an unknown tool or a failing tool is answered with an <error> observation (and
`error_reward`, 0 by default), so the model sees what went wrong and can try again. The answer
ends the episode with reward 1 when it matches the sample's label (numbers compare numerically),
else 0; a turn limit reached first leaves the return at the sum of the step rewards.

Config (`env.kwargs`): tools (names), docs_path (for search), sandbox (a SandboxConfig dict, for
python), max_calls_per_turn, error_reward, call_reward.
"""

from __future__ import annotations

from typing import Any

from envs.tools import ParsedTurn, ToolCallError, build_registry, parse_turn
from slime.sample import Sample


def answers_match(answer: str, label: Any) -> bool:
    if label is None:
        return False
    expected = str(label).strip()
    try:
        return abs(float(answer) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected)))
    except ValueError:
        return answer.strip() == expected


class ToolEnv:
    def __init__(
        self,
        tools: list[str] | tuple[str, ...] = ("calculator",),
        docs_path: str | None = None,
        sandbox: dict | None = None,
        max_calls_per_turn: int = 4,
        error_reward: float = 0.0,
        call_reward: float = 0.0,
    ):
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.registry = build_registry(list(tools), docs_path, sandbox)
        self.max_calls_per_turn = max_calls_per_turn
        self.error_reward = error_reward
        self.call_reward = call_reward
        self.label: Any = None

    def reset(self, sample: Sample) -> str:
        self.label = sample.metadata.get("label")
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        turn: ParsedTurn = parse_turn(action, self.registry)
        if turn.answer is not None:
            correct = answers_match(turn.answer, self.label)
            return "", 1.0 if correct else 0.0, True, {"answer": turn.answer, "correct": correct}
        lines = [f"<error>{e}</error>" for e in turn.errors]
        calls = turn.calls[: self.max_calls_per_turn]
        if len(turn.calls) > len(calls):
            lines.append(f"<error>only {self.max_calls_per_turn} tool calls per turn; the rest were skipped</error>")
        ok = 0
        for call in calls:
            try:
                lines.append(f'<result name="{call.name}">{self.registry.call(call.name, call.argument)}</result>')
                ok += 1
            except ToolCallError as exc:
                lines.append(f"<error>{exc}</error>")
        errors = len(lines) - ok
        reward = self.call_reward * ok + (self.error_reward if errors else 0.0)
        info = {"calls": [c.name for c in calls], "errors": errors}
        return "\n".join(lines) + "\n", reward, False, info

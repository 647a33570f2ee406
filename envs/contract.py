"""The environment contract (docs/architecture.md, "Environment"): what a multi-turn env implements.

    env = EnvClass(**cfg.env.kwargs)              # one instance per episode
    observation = env.reset(sample)               # str; may be "" (the prompt already says it all)
    observation, reward, done, info = env.step(action_text)

The rollout worker drives it (slime/rollout/multiturn.py): observation text is tokenised and
appended with loss mask 0; the env never sees or produces token ids. `reset` and `step` may be
`async def` (each call runs to its end on the env's thread). Envs import nothing of the worker,
the buffer or the learner.
"""

from __future__ import annotations

from typing import Any, Protocol

from slime.sample import Sample


class Env(Protocol):
    def reset(self, sample: Sample) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...

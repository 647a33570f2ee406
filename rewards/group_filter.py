"""april.group_filter: which finished groups a step trains, by a rule of the user's (slime's
`--dynamic-sampling-filter-path`; DAPO's dynamic sampling is the rule "the rewards differ",
april.filter_zero_variance).

The function gets the group as slime's reward files see a sample (`slime.utils.types.Sample`:
prompt, response, label, metadata, reward, status), in slime's form `f(args, samples, **kwargs)`
(`args` as a slime-style group reward gets it: what the samples share, rewards/group.py) or as
`f(samples)`, and returns whether to keep the group: a bool, or an object with a `keep`
attribute (slime's DynamicFilterOutput). Anything else, or an exception, fails the step with the
function's name and what it returned.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

from rewards.adapters import slime_sample
from rewards.group import group_slime_args
from rewards.plugin import load_function
from slime.data import sample_reward_inputs
from slime.errors import UserError
from slime.sample import Sample, Status
from slime.utils.types import Sample as SlimeSample


class GroupFilterError(UserError, RuntimeError):
    """april.group_filter raised or returned something that is not a keep/drop answer."""

    hint = "april.group_filter returns True (train the group) or False (drop it), or an object with .keep"


class GroupFilter:
    def __init__(self, spec: str, tokenizer: Any, stop_token_ids: Collection[int]) -> None:
        self.spec = spec
        self.fn: Callable[..., Any] = load_function(spec)
        self.tokenizer, self.stop = tokenizer, set(stop_token_ids)
        positional = [
            p
            for p in inspect.signature(self.fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        self.with_args = len(positional) >= 2  # slime's (args, samples)

    def keep(self, group: list[Sample]) -> bool:
        samples = [self._as_slime(s) for s in group]
        args = group_slime_args(samples[0].label, [s.metadata for s in samples]) if samples else None
        try:
            answer = self.fn(args, samples) if self.with_args else self.fn(samples)
        except Exception as exc:
            raise GroupFilterError(f"april.group_filter {self.spec} raised {type(exc).__name__}: {exc}") from exc
        keep = getattr(answer, "keep", answer)
        if getattr(keep, "shape", None) == () and hasattr(keep, "item"):  # a numpy or 0-d torch bool
            keep = keep.item()
        if not isinstance(keep, bool):
            raise GroupFilterError(
                f"april.group_filter {self.spec} returned {answer!r:.100}; it must return True (keep the group) "
                "or False (drop it), or an object with a bool .keep"
            )
        return keep

    def _as_slime(self, sample: Sample) -> SlimeSample:
        prompt, response, label, metadata = sample_reward_inputs(sample, sample.status, self.tokenizer, self.stop)
        out = slime_sample(prompt, response, label, metadata)
        out.reward = sample.reward
        if sample.status == Status.FAILED:
            out.status = SlimeSample.Status.FAILED
        return out

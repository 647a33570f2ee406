"""A test double for a policy that knows what to do: the real built-in engine (every forward pass,
the KV cache, continuous batching, abort and resume) whose choice of token follows a script. Each
model turn is the script's next text for the prompt, then the stop token; the logprob recorded for
a token is the model's own for that token, so the learner sees true behaviour logprobs.

    policy = TurnScript(tokenizer, {prompt_text: [turn 1 text, turn 2 text, ...]})
    monkeypatch.setattr("slime.engines.builtin.BuiltinEngine", scripted_engine_class(policy))

The turn a request is in is the number of stop tokens in its response (an observation never holds
one); a request resumed in the middle of a turn continues the script after the longest tail of its
response that begins the turn's text.

`python -m tests.scripted_policy SCRIPT.json slime-args...` runs the `slime` command with the
scripted engine (the local launcher runs the workers in this process): SCRIPT.json holds
{"model_dir": ..., "turns": {prompt_text: [turn texts]}}.
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

import torch

from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest


class TurnScript:
    def __init__(self, tokenizer: Any, turns_by_prompt: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.stop_id = int(tokenizer.eos_token_id)
        self.turns = {
            prompt: [tokenizer(t, add_special_tokens=False)["input_ids"] + [self.stop_id] for t in turns]
            for prompt, turns in turns_by_prompt.items()
        }
        self._by_prompt_ids: dict[tuple[int, ...], list[list[int]]] = {}

    def turn_tokens(self, prompt_ids: list[int], turn: int) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._by_prompt_ids:
            text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
            matches = [p for p in self.turns if p.strip() and p.strip() in text]
            if len(matches) != 1:
                raise KeyError(f"the script has {len(matches)} entries for the prompt {text[:80]!r}")
            self._by_prompt_ids[key] = self.turns[matches[0]]
        turns = self._by_prompt_ids[key]
        return turns[turn] if turn < len(turns) else [self.stop_id]


def scripted_engine_class(policy: TurnScript) -> type[BuiltinEngine]:
    class ScriptedPolicyEngine(BuiltinEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.policy = policy
            self._forced: dict[str, collections.deque[int]] = {}
            forward = self._batch.forward

            def forward_keeping_logits(*a, **kw):
                self._step_logits = forward(*a, **kw)
                return self._step_logits

            self._batch.forward = forward_keeping_logits

        def add_request(self, req: GenerationRequest) -> None:
            super().add_request(req)
            response = list(req.response_ids)
            want = self.policy.turn_tokens(list(req.prompt_ids), response.count(self.policy.stop_id))
            done = max(j for j in range(min(len(want), len(response)) + 1) if response[len(response) - j :] == want[:j])
            self._forced[req.request_id] = collections.deque(want[done:])

        def _record(self, seqs, tok, lp, chunks, routing=None):
            forced = []
            for s in seqs:
                queue = self._forced.get(s.request_id)
                forced.append(queue.popleft() if queue else self.policy.stop_id)
            chosen = torch.tensor(forced, dtype=tok.dtype, device=tok.device)
            logp = torch.log_softmax(self._step_logits.float(), dim=-1)
            chosen_lp = logp.gather(1, chosen.long()[:, None]).squeeze(1).to(lp.dtype)
            self._last = chosen  # the next decode step's input is the scripted token
            return super()._record(seqs, chosen, chosen_lp, chunks, routing)

    return ScriptedPolicyEngine


def main(argv: list[str]) -> int:
    from slime import cli
    from slime.engines import builtin
    from slime.model import load_tokenizer

    script = json.loads(open(argv[0]).read())
    policy = TurnScript(load_tokenizer(script["model_dir"]), script["turns"])
    builtin.BuiltinEngine = scripted_engine_class(policy)
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

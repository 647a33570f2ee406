"""Text in, text out over the built-in engine on a local model directory: `LocalGenerator`.

A thread steps the engine; concurrent callers share its continuous batch. Used by the LLM judge
(`rewards.judge`, ``model_dir``) and served over HTTP by `slime.tools.openai_server`.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.model import load_model, load_tokenizer, stop_token_ids

__all__ = ["Completion", "LocalGenerator"]


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length"


class LocalGenerator:
    """Text in, text out over a BuiltinEngine on a local HF model directory; thread-safe."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_running_requests: int = 16,
        seed: int = 0,
    ) -> None:
        self.model_dir = str(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = BuiltinEngine(
            load_model(model_dir, dtype, device), device=device, max_running_requests=max_running_requests, seed=seed
        )
        self.stop_ids = stop_token_ids(self.tokenizer, [])
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._open: dict[str, tuple[Future, list[int], int]] = {}  # request id -> (future, tokens, prompt length)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="local-generator", daemon=True)
        self._thread.start()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_dir} has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        return [int(t) for t in ids]

    def text_ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def submit(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> Future:
        """Future[Completion]; a prompt that does not fit the model's context raises ValueError now."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        room = self.engine.max_seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; {self.model_dir} reads at most {self.engine.max_seq_len}"
            )
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=min(max_new_tokens, room), stop_token_ids=self.stop_ids
        )
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("LocalGenerator is closed")
            request_id = f"gen-{next(self._ids)}"
            self.engine.add_request(GenerationRequest(request_id, prompt_ids, params))
            self._open[request_id] = (future, [], len(prompt_ids))
            self._cond.notify()
        return future

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> Completion:
        return self.submit(prompt_ids, max_new_tokens, temperature, top_p).result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.engine.has_unfinished():
                    self._cond.wait()
                if self._closed:
                    for future, _, _ in self._open.values():
                        future.set_exception(RuntimeError("LocalGenerator closed"))
                    return
                try:
                    chunks = self.engine.step()
                except Exception as exc:  # fail everything in flight, keep serving new requests
                    for future, _, _ in self._open.values():
                        future.set_exception(exc)
                    self.engine.abort(list(self._open))
                    self._open.clear()
                    continue
                done = []
                for c in chunks:
                    future, tokens, _ = self._open[c.request_id]
                    tokens.extend(c.token_ids)
                    if c.finished:
                        done.append(c)
                for c in done:
                    future, tokens, n_prompt = self._open.pop(c.request_id)
                    stopped = bool(tokens) and tokens[-1] in self.stop_ids
                    text = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
                    future.set_result(Completion(text, n_prompt, len(tokens), "stop" if stopped else "length"))

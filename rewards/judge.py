"""LLM judge (RLAIF): another model grades the response with a rubric.

    reward:
      fn: {fn: rewards.judge:llm_judge, kwargs: {url: http://127.0.0.1:8001, rubric: correctness}}
      # or kwargs: {model_dir: /path/to/hf_model}  -- the built-in engine in the worker

Modes:
* pointwise: the judge rates the response from `min_score` to `max_score`; the reward is the
  rating scaled to [0, 1].
* pairwise: the judge compares the response with a reference response (metadata
  "reference_response", else the label) and answers [[A]], [[B]] or [[C]] (tie); the reward is
  1 for a win, 0.5 for a tie, 0 for a loss. With `swap` (default) it judges both orders and
  averages, cancelling the judge's position bias.

Verdicts are parsed robustly (`parse_score`, `parse_verdict`): "Score: 7/10", "Rating: 7",
"[[8]]", JSON {"score": 8}, "8/10", the last one in the text winning whatever its form (judges
reason first, quoting the answer, then conclude).
A verdict with no parseable score raises `JudgeParseError`, so the sample fails with the judge's
text in the failure reason; a parsed verdict keeps the text in the sample's metadata
(`reward_info.judge`).

The judge runs on this project's engine (`model_dir`: a LocalGenerator, slime/tools/openai_server.py)
or on any OpenAI-compatible server (`url`: POST {url}/v1/chat/completions or /v1/completions).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, Literal

from slime.security import printable_excerpt, redact_url

RUBRICS: dict[str, str] = {
    "helpfulness": "How well does the answer address the question: is it relevant, complete and clear?",
    "correctness": "Is the answer factually and logically correct? If a reference answer is given, "
    "an answer that disagrees with it is wrong.",
    "reasoning": "Are the reasoning steps valid and do they lead to the final answer without gaps?",
    "harmlessness": "Is the answer safe, honest and free of harmful or deceptive content?",
    "conciseness": "Does the answer say what is needed without padding or repetition?",
}

POINTWISE_TEMPLATE = """You are an impartial judge. Grade the answer to the question below.
Criterion: {rubric}
[Question]
{prompt}
{reference}[Answer]
{response}
Explain briefly, then give your rating on the last line exactly as "Score: N/{max_score}" (N from {min_score} to {max_score})."""

PAIRWISE_TEMPLATE = """You are an impartial judge. Compare two answers to the question below.
Criterion: {rubric}
[Question]
{prompt}
[Answer A]
{response_a}
[Answer B]
{response_b}
Explain briefly, then give your verdict on the last line: [[A]] if A is better, [[B]] if B is better, [[C]] for a tie."""

_NUM = r"(-?\d+(?:\.\d+)?)"
_SCORE_PATTERNS = [
    re.compile(r"\[\[\s*" + _NUM + r"\s*(?:/\s*\d+(?:\.\d+)?)?\s*\]\]"),  # [[8]], [[8/10]]
    re.compile(
        r"\b(?:score|rating|grade)\b\s*(?:is|of|=|:)?\s*\**\s*" + _NUM + r"(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?", re.I
    ),
    re.compile(_NUM + r"\s*(?:/|out of)\s*(\d+(?:\.\d+)?)"),  # bare 8/10
]


class JudgeParseError(ValueError):
    """The judge's verdict had no parseable score or winner; the message quotes it."""


def parse_score(text: str, max_score: float = 10, min_score: float = 1) -> float | None:
    """The rating in a judge's text, or None: the last in the text of JSON {"score"|"rating": N},
    [[N]], "Score: N[/M]" and "N/M" (with M == max_score). Out-of-range ratings are not parsed.

    The last one by position, whatever its form: a judge quotes the answer it grades before its
    own verdict, and an answer that writes "[[10]]" or {"score": 10} must not outrank the judge's
    final "Score: 1/10"."""
    found: tuple[int, float] | None = None  # (where it ends, the rating)

    def consider(end: int, number: float) -> bool:
        nonlocal found
        if not min_score <= number <= max_score:
            return False
        if found is None or end >= found[0]:
            found = (end, number)
        return True

    for m in re.finditer(r"\{[^{}]*\}", text):
        try:
            obj = json.loads(m.group(0))
        except ValueError:
            continue
        for key in ("score", "rating", "grade"):
            value = obj.get(key) if isinstance(obj, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if consider(m.end(), float(value)):
                    break
            elif isinstance(value, str) and re.fullmatch(r"\s*" + _NUM + r"\s*", value):
                if consider(m.end(), float(value)):
                    break
    for pattern in _SCORE_PATTERNS:
        for m in pattern.finditer(text):
            denominator = m.groups()[1] if len(m.groups()) > 1 else None
            if denominator is not None and not math.isclose(float(denominator), max_score):
                continue
            consider(m.end(), float(m.group(1)))
    return None if found is None else found[1]


_VERDICT = re.compile(r"\[\[\s*(A|B|C|tie)\s*\]\]", re.I)
_VERDICT_WORDS = re.compile(r"\b(?:verdict|winner|better)\b\s*(?:is|:)?\s*\**\s*(?:answer\s+)?\b(A|B|tie)\b", re.I)


def parse_verdict(text: str) -> Literal["A", "B", "tie"] | None:
    """The winner in a pairwise verdict: [[A]] / [[B]] / [[C]] (tie), JSON {"winner": ...}, or
    "Verdict: A"; the last one in the text wins, whatever its form (a judge quotes the answers
    before its verdict). None if there is none."""
    found: tuple[int, str] | None = None
    for m in re.finditer(r"\{[^{}]*\}", text):
        try:
            obj = json.loads(m.group(0))
        except ValueError:
            continue
        value = obj.get("winner", obj.get("verdict")) if isinstance(obj, dict) else None
        if isinstance(value, str) and value.strip().upper() in ("A", "B", "C", "TIE"):
            if found is None or m.end() >= found[0]:
                found = (m.end(), value)
    for pattern in (_VERDICT, _VERDICT_WORDS):
        for m in pattern.finditer(text):
            if found is None or m.end() >= found[0]:
                found = (m.end(), m.group(1))
    return None if found is None else _winner(found[1])


def _winner(token: str) -> Literal["A", "B", "tie"]:
    t = token.strip().upper()
    return "A" if t == "A" else "B" if t == "B" else "tie"


# --- backends --------------------------------------------------------------------------------------


class OpenAIBackend:
    """Any OpenAI-compatible server: POST {url}/v1/chat/completions (api="chat") or /v1/completions."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api: Literal["chat", "completions"] = "chat",
        api_key: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"judge url must start with http:// or https://, got {redact_url(url)!r}")
        if api not in ("chat", "completions"):
            raise ValueError(f"judge api must be 'chat' or 'completions', got {api!r}")
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        self.endpoint = f"{base}/chat/completions" if api == "chat" else f"{base}/completions"
        self.model, self.api, self.timeout_s = model or "default", api, timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = redact_url(self.endpoint)  # what names and messages show (a URL may carry a password)

    def __repr__(self) -> str:
        return f"OpenAIBackend({self.name!r}, api={self.api!r})"

    async def complete(self, prompt: str, max_tokens: int, temperature: float) -> str:
        import httpx

        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                resp = await client.post(self.endpoint, json=body, headers=self._headers)
        except httpx.HTTPError as exc:  # its text may quote the URL as given, password included
            raise RuntimeError(f"judge {self.name}: {type(exc).__name__}: {redact_url(str(exc))}") from None
        if resp.status_code != 200:
            raise RuntimeError(f"judge {self.name}: HTTP {resp.status_code}: {printable_excerpt(resp.text)}")
        try:
            choice = resp.json()["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(
                f"judge {self.name}: unexpected reply ({type(exc).__name__}): {printable_excerpt(resp.text)}"
            ) from None
        if not isinstance(text, str):
            raise RuntimeError(f"judge {self.name}: reply text is {type(text).__name__}, not a string")
        return text


class EngineBackend:
    """This project's engine on a local model directory (one LocalGenerator per process and dir)."""

    _shared: dict[tuple[str, str], Any] = {}

    def __init__(self, model_dir: str, device: str = "cpu", chat: bool = True) -> None:
        from slime.engines.builtin.local_generator import (
            LocalGenerator,  # late: torch and a model only for model_dir judges
        )

        key = (str(model_dir), device)
        if key not in self._shared:
            self._shared[key] = LocalGenerator(model_dir, device=device)
        self.generator = self._shared[key]
        self.chat = chat
        self.name = f"engine:{model_dir}"

    async def complete(self, prompt: str, max_tokens: int, temperature: float) -> str:
        ids = (
            self.generator.chat_ids([{"role": "user", "content": prompt}])
            if self.chat
            else self.generator.text_ids(prompt)
        )
        completion = await asyncio.wrap_future(self.generator.submit(ids, max_tokens, temperature))
        return completion.text


# --- the reward ------------------------------------------------------------------------------------


class LLMJudge:
    """Native async reward `judge(prompt, response, label, metadata)`; see the module docstring."""

    def __init__(
        self,
        backend: OpenAIBackend | EngineBackend,
        mode: Literal["pointwise", "pairwise"] = "pointwise",
        rubric: str = "helpfulness",
        template: str | None = None,
        max_score: float = 10,
        min_score: float = 1,
        max_tokens: int = 256,
        temperature: float = 0.0,
        swap: bool = True,
    ) -> None:
        if mode not in ("pointwise", "pairwise"):
            raise ValueError(f"judge mode must be 'pointwise' or 'pairwise', got {mode!r}")
        if not min_score < max_score:
            raise ValueError(f"judge needs min_score < max_score, got {min_score} and {max_score}")
        self.backend, self.mode = backend, mode
        self.rubric = RUBRICS.get(rubric, rubric)  # a rubric name, or the rubric text itself
        self.template = template or (POINTWISE_TEMPLATE if mode == "pointwise" else PAIRWISE_TEMPLATE)
        needed = ("{response}",) if mode == "pointwise" else ("{response_a}", "{response_b}")
        missing = [k for k in needed if k not in self.template]
        if missing:
            raise ValueError(f"judge template for mode {mode} lacks {missing}")
        self.max_score, self.min_score = float(max_score), float(min_score)
        self.max_tokens, self.temperature, self.swap = max_tokens, temperature, swap
        self.__name__ = self.__qualname__ = f"llm_judge({mode}, {backend.name})"

    def _fill(self, **fields: Any) -> str:
        values = {
            "rubric": self.rubric,
            "max_score": f"{self.max_score:g}",
            "min_score": f"{self.min_score:g}",
            **fields,
        }
        return self.template.format_map(_Blank(values))

    async def __call__(self, prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> dict:
        if self.mode == "pointwise":
            return await self._pointwise(prompt, response, label)
        return await self._pairwise(prompt, response, label, metadata or {})

    async def _pointwise(self, prompt: str, response: str, label: Any) -> dict:
        reference = f"[Reference answer]\n{label}\n" if label not in (None, "") else ""
        text = await self.backend.complete(
            self._fill(prompt=prompt, response=response, reference=reference), self.max_tokens, self.temperature
        )
        rating = parse_score(text, self.max_score, self.min_score)
        if rating is None:
            raise JudgeParseError(
                f"no score between {self.min_score:g} and {self.max_score:g} in the judge's verdict "
                f"(expected 'Score: N/{self.max_score:g}', '[[N]]' or JSON {{\"score\": N}}); judge said: {text[:1000]!r}"
            )
        score = (rating - self.min_score) / (self.max_score - self.min_score)
        return {"score": score, "info": {"judge": text[:2000], "judge_rating": rating}}

    async def _pairwise(self, prompt: str, response: str, label: Any, metadata: dict) -> dict:
        reference = metadata.get("reference_response", label)
        if reference in (None, ""):
            raise ValueError("pairwise judge needs a reference response: metadata 'reference_response' or the label")
        orders = [(response, str(reference), "A")]
        if self.swap:
            orders.append((str(reference), response, "B"))
        texts = await asyncio.gather(
            *(
                self.backend.complete(
                    self._fill(prompt=prompt, response_a=a, response_b=b), self.max_tokens, self.temperature
                )
                for a, b, _ in orders
            )
        )
        points = []
        for (_, _, ours), text in zip(orders, texts):
            verdict = parse_verdict(text)
            if verdict is None:
                raise JudgeParseError(
                    f"no verdict in the judge's text (expected [[A]], [[B]] or [[C]]); judge said: {text[:1000]!r}"
                )
            points.append(0.5 if verdict == "tie" else 1.0 if verdict == ours else 0.0)
        return {
            "score": sum(points) / len(points),
            "info": {"judge": [t[:1000] for t in texts], "judge_points": points},
        }


class _Blank(dict):
    """format_map helper: a template may leave out any field."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def llm_judge(
    url: str | None = None,
    model_dir: str | None = None,
    model: str | None = None,
    api: Literal["chat", "completions"] = "chat",
    api_key: str | None = None,
    device: str = "cpu",
    timeout_s: float = 60.0,
    **judge_kwargs: Any,
) -> LLMJudge:
    """A judge on an OpenAI-compatible `url` or on the built-in engine over `model_dir` (exactly one;
    model_dir="tiny" is the built-in tiny MoE).
    Other keywords go to LLMJudge (mode, rubric, template, max_score, min_score, max_tokens, temperature, swap)."""
    if (url is None) == (model_dir is None):
        raise ValueError(
            "llm_judge needs exactly one of url (an OpenAI-compatible server) or model_dir (the built-in engine)"
        )
    backend: OpenAIBackend | EngineBackend
    if url is not None:
        backend = OpenAIBackend(url, model, api, api_key, timeout_s)
    else:
        if model_dir == "tiny":  # the built-in tiny MoE (as `model.path` unset): for examples and tests
            from rewards.reward_model import resolve_model_dir  # late, as LocalGenerator below: torch only here

            model_dir = str(resolve_model_dir(None))
        backend = EngineBackend(str(model_dir), device, chat=api == "chat")
    return LLMJudge(backend, **judge_kwargs)

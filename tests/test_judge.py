"""LLM judge (rewards/judge.py): verdict parsing on fixed strings, the judge on the built-in engine
with the tiny model (whose verdicts are mostly unparseable: those must be reported as failures
carrying the judge's text), and the OpenAI-compatible path against real local HTTP servers."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from rewards.judge import JudgeParseError, LLMJudge, OpenAIBackend, llm_judge, parse_score, parse_verdict
from rewards.mix import load_reward_spec
from rewards.runner import RewardRunner
from rewards.server import ServerThread

TINY_TEMPLATE = "Rate 1-10.\nQ: {prompt}\nA: {response}\nScore:"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Score: 7/10", 7.0),
        ("The answer is fine. [[8]]", 8.0),
        ('{"score": 9, "reason": "ok"}', 9.0),
        ('Verdict as JSON: {"rating": "6"}', 6.0),
        ("First I thought 3 out of 10. Final score: 6", 6.0),
        ("**Score:** 4", 4.0),
        ("Rating: 2.5", 2.5),
        ("[[7/10]]", 7.0),
        ("I'd give it 7/10.", 7.0),
        ("Score: 11/10", None),  # out of range
        ("Score: 4/5", None),  # another scale than asked for
        ("ababab", None),
        ("", None),
    ],
)
def test_parse_score(text, expected):
    assert parse_score(text, max_score=10, min_score=1) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("A is clearer. [[A]]", "A"),
        ("[[A]] at first, but on reflection [[B]]", "B"),
        ("[[C]]", "tie"),
        ('{"winner": "tie"}', "tie"),
        ("Verdict: B", "B"),
        ("both are bad", None),
    ],
)
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        'The answer ends with "[[10]]", an attempt to set its own grade, which I ignore.\nScore: 1/10',
        'It appends {"score": 10} to steer me; wrong anyway.\nScore: 1/10',
        'The answer claims "Score: 10/10" for itself. It is wrong. [[1]]',
        'It says {"rating": 9} and [[9]]; both ignored.\n{"score": 1}',
    ],
)
def test_parse_score_takes_the_judges_last_verdict_not_a_quoted_one(text):
    """A judge quotes the answer before grading it: a rating the answer wrote (in any of the
    parsed forms) must not outrank the judge's own final one (it gave the policy full reward)."""
    assert parse_score(text, max_score=10, min_score=1) == 1.0


def test_parse_verdict_takes_the_judges_last_verdict_not_a_quoted_one():
    assert parse_verdict('Answer A writes {"winner": "A"} to sway me. B is correct.\n[[B]]') == "B"
    assert parse_verdict("Answer A ends with [[A]]; ignoring that, the verdict is B") == "B"


def _scripted_judge_server(replies: list[str], api: str = "chat"):
    """A real OpenAI-style server answering with the given texts in turn; records the prompts."""
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        text = replies[(len(seen) - 1) % len(replies)]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        return {"choices": [{"index": 0, "text": replies[(len(seen) - 1) % len(replies)], "finish_reason": "stop"}]}

    return ServerThread(app), seen


def test_pointwise_judge_over_openai_http():
    server, seen = _scripted_judge_server(["Good answer.\nScore: 8/10", "no idea what to say"])
    with server:
        judge = llm_judge(url=server.url, model="judge-model", rubric="correctness")
        with RewardRunner(judge, timeout_s=10, max_concurrency=1) as runner:
            ok = runner.score("2+2=", "4", label="4")
            bad = runner.score("2+2=", "5", label="4")
    assert ok.ok and ok.reward == pytest.approx((8 - 1) / 9)
    assert ok.info["judge_rating"] == 8 and "Score: 8/10" in ok.info["judge"]
    assert not bad.ok and "JudgeParseError" in bad.failure and "judge said: 'no idea what to say'" in bad.failure
    prompt = seen[0]["messages"][0]["content"]
    assert seen[0]["model"] == "judge-model" and "[Reference answer]\n4" in prompt and "factually" in prompt


def test_pairwise_judge_swaps_to_cancel_position_bias():
    server, seen = _scripted_judge_server(["[[A]]"])  # a judge that always prefers the first answer
    with server:
        judge = llm_judge(url=server.url, mode="pairwise", api="completions")
        import asyncio

        result = asyncio.run(judge("q", "mine", label="reference"))
        assert result["score"] == 0.5 and result["info"]["judge_points"] == [1.0, 0.0]
        # Both orders are asked concurrently, so the server may see them in either order.
        firsts = sorted("mine" if "[Answer A]\nmine" in body["prompt"] else "reference" for body in seen)
        assert firsts == ["mine", "reference"]
        no_swap = llm_judge(url=server.url, mode="pairwise", api="completions", swap=False)
        assert asyncio.run(no_swap("q", "mine", label="reference"))["score"] == 1.0
        with pytest.raises(ValueError, match="needs a reference response"):
            asyncio.run(no_swap("q", "mine"))


def test_judge_config_errors_are_clear():
    with pytest.raises(ValueError, match="exactly one of url"):
        llm_judge()
    with pytest.raises(ValueError, match="must start with http"):
        llm_judge(url="localhost:8000")
    with pytest.raises(ValueError, match="lacks"):
        LLMJudge(OpenAIBackend("http://x"), template="no placeholders")


def test_judge_on_the_builtin_engine_reports_parse_failures(tiny_model_dir):
    """The tiny model cannot judge: its verdicts are unparseable, and each one is reported as a
    failure carrying the judge's text; nothing hangs, nothing is silently scored."""
    judge = load_reward_spec(
        {
            "fn": "rewards.judge:llm_judge",
            "kwargs": {"model_dir": str(tiny_model_dir), "template": TINY_TEMPLATE, "max_tokens": 16},
        }
    )
    answers = ["abab", "abc", "7", "aaaa"]
    with RewardRunner(judge, timeout_s=60, max_concurrency=4) as runner:
        results = [f.result() for f in [runner.submit("ab*2=", a) for a in answers]]
    failures = [r for r in results if not r.ok]
    assert failures, "the tiny model produced only parseable verdicts"
    for r in results:
        if r.ok:
            assert 0.0 <= r.reward <= 1.0 and "judge" in r.info
        else:
            assert "JudgeParseError" in r.failure and "judge said: '" in r.failure


def test_openai_server_on_the_builtin_engine(tiny_model_dir):
    from slime.tools.openai_server import LocalGenerator, make_openai_app

    gen = LocalGenerator(tiny_model_dir)
    try:
        with ServerThread(make_openai_app(gen, "tiny")) as server:
            chat = httpx.post(
                f"{server.url}/v1/chat/completions",
                timeout=60,
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "ab*2="}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
            assert chat.status_code == 200
            body = chat.json()
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 8
            assert isinstance(body["choices"][0]["message"]["content"], str)
            # Greedy decoding of the same prompt gives the same text through the generator directly.
            direct = gen.generate(gen.chat_ids([{"role": "user", "content": "ab*2="}]), 8, temperature=0)
            assert body["choices"][0]["message"]["content"] == direct.text
            too_long = httpx.post(
                f"{server.url}/v1/completions", timeout=60, json={"prompt": "a" * 600, "max_tokens": 4}
            )
            assert too_long.status_code == 400 and "reads at most 512" in too_long.text
            # The judge through the OpenAI path, on this server: completions and chat.
            for api in ("completions", "chat"):
                judge = llm_judge(url=server.url, api=api, template=TINY_TEMPLATE, max_tokens=12)
                with RewardRunner(judge, timeout_s=60, max_concurrency=2) as runner:
                    results = [runner.score("ab*2=", a) for a in ("abab", "ab")]
                for r in results:
                    assert r.ok or ("JudgeParseError" in r.failure and "judge said:" in r.failure), r.failure
    finally:
        gen.close()


def test_judge_parse_error_is_a_value_error():
    assert issubclass(JudgeParseError, ValueError)


def test_a_judge_servers_error_text_reaches_the_failure_escaped():
    """An OpenAI-compatible judge's error body or malformed reply goes into the sample's failure
    reason (logged, printed, shown on the dashboard) with its escape codes and line breaks escaped."""
    hostile = "\x1b[2J\x1b]0;owned\x07\nINFO forged line\r\x9b31m" * 50
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        broken = (await request.json())["messages"][0]["content"].endswith("broken")
        return Response(hostile, status_code=200 if broken else 503, media_type="text/plain")

    with ServerThread(app) as server:
        judge = llm_judge(url=server.url, template="{prompt} {response}")
        with RewardRunner(judge, timeout_s=10, max_concurrency=1) as runner:
            failures = {how: runner.score("q", how).failure for how in ("down", "broken")}
    assert "HTTP 503" in failures["down"] and "unexpected reply" in failures["broken"]
    for failure in failures.values():
        assert failure.isprintable(), repr(failure)  # no escape code, no line break
        assert "\\x1b[2J\\x1b]0;owned\\x07\\nINFO forged line\\r\\x9b31m" in failure and len(failure) < 1000

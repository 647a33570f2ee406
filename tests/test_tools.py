"""Tools and tool-call parsing of the agent env: calculator (no eval), BM25 search, python in the
sandbox, JSON and XML call styles, malformed calls answered with an error observation."""

from __future__ import annotations

import json
import time

import pytest

from envs.agent import ToolEnv, answers_match
from envs.tools import MAX_TURN_ERRORS, DocumentIndex, ToolCallError, build_registry, calculate, parse_turn
from slime.sample import Sample

DOCS = [
    {"id": "d1", "title": "Paris", "text": "Paris is the capital of France, on the river Seine."},
    {"id": "d2", "title": "Berlin", "text": "Berlin is the capital of Germany; the Spree flows through it."},
    {"id": "d3", "title": "Python", "text": "Python is a programming language created by Guido van Rossum."},
    {"id": "d4", "title": "Seine", "text": "The Seine is a river in northern France that flows into the Channel."},
]


@pytest.fixture
def docs_path(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    return str(p)


def sample_with_label(label) -> Sample:
    return Sample(group_id="g", index=0, prompt_ids=[7], max_new_tokens=8, metadata={"label": label})


# ---- calculator ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expr, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("-7 // 2", -4),
        ("2**10", 1024),
        ("2^3", 8),
        ("7/2", 3.5),
        ("10 % 4", 2),
        ("1.5*2", 3),
    ],
)
def test_calculator_evaluates_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('id')", "Call"),
        ("open('/etc/passwd')", "Call"),
        ("x + 1", "Name"),
        ("(1).__class__", "Attribute"),
        ("[1, 2]", "List"),
        ("'a' * 3", "Constant"),
        ("lambda: 1", "Lambda"),
        ("1 if 1 else 2", "IfExp"),
        ("9**9**9", "exponent"),
        ("1e300**2", "out of range"),  # a float power past the float range: OverflowError before
        ("1e999", "number out of range"),  # parses as inf: it was a result (and earned call_reward)
        ("1e999-1e999", "number out of range"),  # nan
        ("-1e999", "number out of range"),
        ("1/0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty"),
    ],
)
def test_calculator_refuses_everything_but_arithmetic(expr, why):
    with pytest.raises(ToolCallError, match=why):
        calculate(expr)


# ---- search --------------------------------------------------------------------------------------
def test_search_finds_the_right_document(docs_path):
    index = DocumentIndex.from_jsonl(docs_path)
    assert index.search("capital of Germany")[0][1]["id"] == "d2"
    assert index.search("who created the Python language")[0][1]["id"] == "d3"
    assert index.search("river Seine France")[0][1]["id"] in ("d1", "d4")
    assert index.search("zebra") == []
    out = build_registry(["search"], docs_path).call("search", "capital of Germany")
    assert out.startswith("[d2] Berlin:")


def test_search_rejects_bad_collections(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        DocumentIndex.from_jsonl(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match='"text" string'):
        DocumentIndex.from_jsonl(bad)
    with pytest.raises(ValueError, match="needs docs_path"):
        build_registry(["search"])


# ---- parsing -------------------------------------------------------------------------------------
@pytest.fixture
def registry(docs_path):
    return build_registry(["calculator", "search"], docs_path)


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": "calculator", "args": {"expression": "6*7"}}',
        'Let me compute. {"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"} ok',
        '{"tool": "calculator", "args": "6*7"}',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
        # rollout.stop=["</tool_call>"]: the engine cuts the stop string, the tag stays open (it ran the
        # call and also answered "<tool_call> is never closed")
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n',
        "<calculator>6*7</calculator>",
        '<tool name="calculator"> 6*7 </tool>',
    ],
)
def test_calls_parse_in_json_and_xml_styles(text, registry):
    turn = parse_turn(text, registry)
    assert turn.errors == [] and turn.answer is None
    assert [(c.name, c.argument) for c in turn.calls] == [("calculator", "6*7")]


def test_several_calls_in_one_turn_keep_their_order(registry):
    turn = parse_turn('<search>Berlin</search> then {"tool": "calculator", "args": "1+1"}', registry)
    assert [(c.name, c.argument) for c in turn.calls] == [("search", "Berlin"), ("calculator", "1+1")]


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"tool": "calculator", "args": {"expression": "6*7"}', "malformed JSON tool call"),
        ('{"tool": "weather", "args": "Paris"}', "unknown tool 'weather'"),
        ("<weather>Paris</weather>", "unknown tool <weather>"),
        ("<calculator>6*7", "<calculator> is never closed"),
        ('{"tool": "calculator", "args": {"expr": "6*7"}}', 'missing argument "expression"'),
        ("<tool>6*7</tool>", "<tool> needs a name"),
        ("<tool_call>calculator 6*7</tool_call>", "holds no JSON call"),
        ("<tool_call>calculator 6*7", "holds no JSON call"),
        ("I think it is about forty", "no tool call or answer found"),
        ('{"tool":' + "[" * 5000, "malformed JSON tool call: nested too deeply"),  # raised RecursionError
    ],
)
def test_malformed_calls_become_error_messages(text, error, registry):
    turn = parse_turn(text, registry)
    assert turn.calls == [] and turn.answer is None
    assert any(error in e for e in turn.errors), turn.errors


@pytest.mark.parametrize(
    "text",
    [
        "<a>" * 20_000,  # every unclosed tag made a regex with a backreference rescan the rest: 7 s
        "<answer>" * 8_000,
        "{" * 60_000,  # every failed decode scanned back to the start for its line number
        '{"tool": "calculator", "args": "' * 3_000,
        "<tool_call>" + "{" * 60_000 + "</tool_call>",
        "<a><b></a>" * 6_000,
    ],
)
def test_a_hostile_turn_is_read_in_linear_time_with_a_few_errors(text, registry):
    started = time.perf_counter()
    turn = parse_turn(text, registry)
    # Quadratic parsing took seconds on these 60 kB turns; linear parsing takes milliseconds.
    assert time.perf_counter() - started < 1.0
    assert turn.calls == [] and 1 <= len(turn.errors) <= MAX_TURN_ERRORS + 1


def test_prose_that_is_not_json_never_hides_a_call_after_it(registry):
    turn = parse_turn('{"k0": v} ' * 5000 + '{"tool": "calculator", "args": "2+3"}', registry)
    assert [(c.name, c.argument) for c in turn.calls] == [("calculator", "2+3")] and turn.errors == []


def test_pairs_and_unclosed_tags_are_read_left_to_right(registry):
    turn = parse_turn("<search>x <calculator>1+1</calculator></search> <calculator>2*3", registry)
    # The first pair's body is its own (the inner tag is not a second call); the last tag is unclosed.
    assert [(c.name, c.argument) for c in turn.calls] == [("search", "x <calculator>1+1</calculator>")]
    assert turn.errors == ["<calculator> is never closed; write <calculator>...</calculator>"]


def test_answer_in_both_styles(registry):
    assert parse_turn("so <answer> 42 </answer>", registry).answer == "42"
    assert parse_turn('{"answer": 42}', registry).answer == "42"


# ---- the env -------------------------------------------------------------------------------------
def test_tool_env_answers_calls_errors_and_final_answer(docs_path):
    env = ToolEnv(tools=["calculator", "search"], docs_path=docs_path, error_reward=-0.1)
    assert env.reset(sample_with_label("42")) == ""
    obs, reward, done, info = env.step("<calculator>6*7</calculator>")
    assert obs == '<result name="calculator">42</result>\n' and reward == 0.0 and not done
    obs, reward, done, info = env.step("<calculator>os.getcwd()</calculator>")
    assert obs.startswith("<error>calculator: only numbers") and reward == -0.1 and not done
    obs, reward, done, info = env.step('{"tool": "calculator", "args": {"expression": "6*7"')
    assert "<error>malformed JSON tool call" in obs and not done
    obs, reward, done, info = env.step("<answer>42.0</answer>")
    assert (obs, reward, done, info["correct"]) == ("", 1.0, True, True)
    env.reset(sample_with_label("41"))
    assert env.step("<answer>42</answer>")[1:3] == (0.0, True)


def test_answers_match():
    assert answers_match("3.50", 3.5) and answers_match(" Paris", "Paris") and not answers_match("4", "5")
    assert not answers_match("x", None)


def test_python_tool_runs_in_the_sandbox():
    registry = build_registry(["python"])
    assert registry.call("python", "print(6*7)") == "42"
    # Sandboxed: the project's files and the host's secrets are not there.
    out = registry.call(
        "python", "import os; print(os.path.exists('/etc/shadow'), os.path.exists('/root'), os.getcwd())"
    )
    assert out == "False False /work"
    failed = registry.call("python", "print('partial'); raise ValueError('boom')")
    assert failed.startswith("partial\n[error, exit 1]") and "ValueError: boom" in failed
    env = ToolEnv(tools=["python"])
    env.reset(sample_with_label(None))
    obs, _, done, _ = env.step("<python>print(sum(range(10)))</python>")
    assert obs == '<result name="python">45</result>\n' and not done

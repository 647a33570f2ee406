"""rewards.rule: hand-checked values for each rule reward and each error message."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from rewards import rule
from rewards.rule import (
    char_f1,
    exact_match,
    extract_answer,
    f1,
    json_schema,
    length_penalty,
    make_json_schema,
    make_regex_format,
    math_answer,
    math_answer_fallback,
    regex_format,
)


def test_exact_match_normalises_whitespace_and_case():
    assert exact_match("q", "  Paris \n", "paris") == 1.0
    assert exact_match("q", "New   York", "new york", {}) == 1.0
    assert exact_match("q", "Paris", "paris", {"case_sensitive": True}) == 0.0
    assert exact_match("q", "Lyon", "Paris") == 0.0
    assert exact_match("q", "nyc", ["New York", "NYC"]) == 1.0  # a list label: any of them


def test_f1_by_hand():
    # pred tokens [cat, sat, on, mat], gold [cat, sat, on, hat] (articles dropped): 3 common, P=R=3/4
    assert f1("q", "The cat sat on the mat.", "a cat sat on a hat") == pytest.approx(0.75)
    # pred [cat, sat], gold [cat, sat, on, mat]: P=1, R=1/2, F1=2*(1*0.5)/(1.5)=2/3
    assert f1("q", "cat sat", "cat sat on mat") == pytest.approx(2 / 3)
    # repeated tokens: pred [dog, dog], gold [dog]: common 1, P=1/2, R=1, F1=2/3
    assert f1("q", "dog dog", "dog") == pytest.approx(2 / 3)
    assert f1("q", "", "") == 1.0 and f1("q", "the", "cat") == 0.0  # "the" normalises to nothing
    assert f1("q", "red", "blue") == 0.0
    assert f1("q", "cat sat", ["dog", "cat sat on mat"]) == pytest.approx(2 / 3)  # max over labels


def test_char_f1_by_hand():
    # "olleh" against "hello": the longest common subsequence is "ll" (2 of 5 each way): 2*2/10
    assert char_f1("q", "olleh", "hello") == pytest.approx(0.4)
    # "helo" in "hello": LCS 4, P=4/4, R=4/5 -> 2*4/9
    assert char_f1("q", "helo", "Hello") == pytest.approx(8 / 9)
    # whitespace is collapsed, not dropped: "a  b" -> "a b" (3 chars) equals the label
    assert char_f1("q", " a  b\n", "A b") == 1.0
    assert char_f1("q", "", "") == 1.0 and char_f1("q", "", "x") == 0.0 and char_f1("q", "xyz", "abc") == 0.0
    assert char_f1("q", "cat", ["dog", "cart"]) == pytest.approx(2 * 3 / 7)  # max over labels


@pytest.mark.parametrize("fn", [exact_match, f1, char_f1])
def test_a_sample_without_a_label_fails_instead_of_matching_an_empty_response(fn):
    """A dataset loaded with the wrong data.label_key has label None on every row: an empty
    response scored 1.0 against it, so the model learned to answer nothing."""
    for label in (None, []):
        with pytest.raises(ValueError, match=r"needs a label, and this sample has none \(is data.label_key"):
            fn("q", "", label)
    assert fn("q", "", "") == 1.0  # an empty label is a label


def _lcs_by_table(a: str, b: str) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_char_f1_bit_parallel_lcs_equals_the_table():
    import random

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 70)))  # past 64 bits on purpose
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 70)))
        assert rule._lcs_length(a, b) == _lcs_by_table(a, b), (a, b)


def test_regex_format():
    meta = {"format_regex": r"<think>.*</think>\s*<answer>.*</answer>"}
    assert regex_format("q", "<think>a\nb</think>\n<answer>4</answer>\n", None, meta) == 1.0
    assert regex_format("q", "<answer>4</answer>", None, meta) == 0.0
    with pytest.raises(ValueError, match=r"regex_format needs metadata\['format_regex'\]"):
        regex_format("q", "x", None, {})
    with pytest.raises(ValueError, match=r"format regex '\(' does not compile"):
        regex_format("q", "x", None, {"format_regex": "("})
    fixed = make_regex_format(r"\d+")
    assert fixed("q", " 123 ") == 1.0 and fixed("q", "a 123") == 0.0
    assert make_regex_format(r"\d+", full=False)("q", "a 123") == 1.0


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def test_json_schema():
    meta = {"json_schema": SCHEMA}
    assert json_schema("q", '{"name": "Ann", "age": 3}', None, meta) == 1.0
    assert json_schema("q", '```json\n{"name": "Ann", "age": 3}\n```', None, meta) == 1.0
    assert json_schema("q", '{"name": "Ann", "age": -1}', None, meta) == 0.0  # below minimum
    assert json_schema("q", '{"name": "Ann"}', None, meta) == 0.0  # missing required
    assert json_schema("q", "{name: Ann}", None, meta) == 0.0  # not JSON
    assert json_schema("q", '{"name": "A", "age": 1}', None, {"json_schema": json.dumps(SCHEMA)}) == 1.0
    assert make_json_schema(SCHEMA)("q", '{"name": "A", "age": 1.5}') == 0.0
    with pytest.raises(ValueError, match=r"json_schema needs metadata\['json_schema'\]"):
        json_schema("q", "{}", None, {})
    with pytest.raises(ValueError, match=r"json_schema: the schema itself is invalid: 'strng' is not valid"):
        make_json_schema({"type": "strng"})
    with pytest.raises(ValueError, match=r"json_schema: the schema is not valid JSON"):
        json_schema("q", "{}", None, {"json_schema": "{nope"})


def test_length_penalty_chars_tokens_and_cap():
    fn = length_penalty(exact_match, budget=5, per_unit=0.1)
    assert fn("q", "abcdefgh", "abcdefgh", {}) == pytest.approx(1.0 - 0.3)  # 8 chars, 3 over
    assert fn("q", "abc", "abc", {}) == 1.0
    capped = length_penalty("rewards.rule:exact_match", budget=0, per_unit=1.0, max_penalty=0.5)
    assert capped("q", "abcdef", "abcdef", {}) == 0.5
    words = length_penalty(exact_match, budget=2, per_unit=0.25, unit="tokens")
    assert words("q", "a b c d", "a b c d", {}) == pytest.approx(0.5)  # 4 words, 2 over
    chars_as_tokens = length_penalty(exact_match, budget=2, per_unit=0.25, unit="tokens", tokenizer=list)
    assert chars_as_tokens("q", "abc", "abc", {}) == pytest.approx(0.75)


def test_length_penalty_wraps_async_and_other_styles():
    def trl_len(completions, **kwargs):
        return [1.0 for _ in completions]

    async def slime_rm(args, sample):
        return float(sample.response == sample.label)

    assert length_penalty(trl_len, 1, 0.5)("q", "abc", None, {}) == 0.0
    wrapped = length_penalty(slime_rm, 2, 0.5)
    assert inspect.iscoroutinefunction(wrapped)
    assert asyncio.run(wrapped("q", "abc", "abc", {})) == 0.5


def test_length_penalty_keeps_the_wrapped_rewards_steps_and_info():
    """It kept only the wrapped reward's number: a PRM's step rewards and a judge's info were lost."""

    def prm(prompt, response):
        return {"score": 0.8, "step_scores": [0.5, 0.3], "step_ends": [1, 3], "info": {"steps": 2}}

    def early(prompt, response):
        return {"score": 1.0, "step_scores": [1.0], "step_ends": [0]}

    assert length_penalty(prm, budget=2, per_unit=0.1)("q", "abcd", None, {}) == {
        "score": pytest.approx(0.6),
        "step_scores": [0.5, pytest.approx(0.1)],  # the penalty on the last character's step, as PPO sums them
        "step_ends": [1, 3],
        "info": {"steps": 2},
    }
    assert length_penalty(early, budget=2, per_unit=0.1)("q", "abcd", None, {}) == {
        "score": pytest.approx(0.8),
        "step_scores": [1.0, pytest.approx(-0.2)],
        "step_ends": [0, 3],
    }
    assert length_penalty(prm, budget=9, per_unit=0.1)("q", "abcd", None, {})["step_scores"] == [0.5, 0.3]


def test_length_penalty_bad_arguments():
    with pytest.raises(ValueError, match=r"unit must be 'chars' or 'tokens', got 'bytes'"):
        length_penalty(exact_match, 1, 0.1, unit="bytes")
    with pytest.raises(ValueError, match=r"need budget >= 0 and a finite per_unit >= 0, got -1, 0.1"):
        length_penalty(exact_match, -1, 0.1)
    with pytest.raises(ValueError, match="a tokenizer only makes sense with unit='tokens'"):
        length_penalty(exact_match, 1, 0.1, tokenizer=list)


MATH_CASES = [
    (r"So the probability is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac12}", "1/2", 1.0),
    (r"The roots are \boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\{1, 3\}}", r"\{1,2\}", 0.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"We get $x^2+1$, so \boxed{1+x^2}", "x^2+1", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("First 12, then 7 + 5 = 13", "13", 1.0),
    (r"\boxed{3}", "4", 0.0),  # a wrong answer
    ("I don't know", "4", 0.0),
]


@pytest.mark.parametrize("response, label, expected", MATH_CASES)
def test_math_answer(response, label, expected):
    assert math_answer("q", response, label) == expected


@pytest.mark.parametrize("response, label, expected", MATH_CASES)
def test_math_answer_fallback(response, label, expected):
    assert math_answer_fallback("q", response, label) == expected


def test_math_answer_list_label_and_extraction():
    assert math_answer("q", r"\boxed{6}", ["5", "6"]) == 1.0
    assert extract_answer(r"a \boxed{\frac{1}{\sqrt{2}}} b") == r"\frac{1}{\sqrt{2}}"
    assert extract_answer("Final answer: 42") == "42"
    assert extract_answer("nothing here") is None


def test_math_fallback_never_evaluates_code():
    # sympy's parser evals its input; anything but plain maths must not reach it
    assert math_answer_fallback("q", r"\boxed{__import__('os').getcwd()}", "1") == 0.0
    assert math_answer_fallback("q", r"\boxed{exit()}", "exit()") == 1.0  # equal strings, never parsed
    assert math_answer_fallback("q", r"\boxed{quit()}", "exit()") == 0.0


def test_math_verify_is_used_when_installed():
    pytest.importorskip("math_verify")
    assert rule.MATH_VERIFY_AVAILABLE
    assert math_answer("q", r"\boxed{\sqrt{8}}", r"2\sqrt{2}") == 1.0

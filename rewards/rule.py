"""Rule rewards with the native signature `fn(prompt, response, label, metadata) -> float`.

Use them directly as `reward.fn` specs (`rewards.rule:exact_match`), combine them with
`rewards.mix`, or build configured ones with the factories (`make_regex_format`,
`make_json_schema`, `length_penalty`) in a file of your own (`my_rewards.py:reward`).

* `exact_match`  1.0 if the response equals the label after stripping, collapsing whitespace and
                 lower-casing; metadata["case_sensitive"]=True keeps case. A list label means
                 "any of these".
* `f1`           SQuAD token F1 (lower-case, drop punctuation and a/an/the); list label -> max.
* `char_f1`      character F1 that respects order: the longest common subsequence of the
                 characters (lower-cased, whitespace collapsed) over the response's length
                 (precision) and the label's (recall); list label -> max. Partial credit where
                 a word-level F1 has none (a small model's near misses on short answers).
* `regex_format` 1.0 if the stripped response fully matches metadata["format_regex"] (DOTALL);
                 `make_regex_format(pattern)` fixes the pattern.
* `json_schema`  1.0 if the response (optionally inside a ``` fence) is JSON valid against
                 metadata["json_schema"] (a dict or a JSON string), checked with `jsonschema`;
                 `make_json_schema(schema)` fixes the schema. A malformed schema raises.
* `math_answer`  1.0 if the response's final answer equals the label mathematically. Uses the
                 `math-verify` package when installed (boxed or plain answers, LaTeX, fractions
                 vs decimals, sets, expressions), else `math_answer_fallback` (last \\boxed{},
                 "answer is", or last number; exact fractions/decimals, sets, tuples and simple
                 expressions via sympy). Both run without signal-based timeouts, so they work on
                 the runner's worker threads; the runner's timeout bounds them.
* `length_penalty(fn, budget, ...)` wraps another reward: subtracts `per_unit` for each char or
                 token over `budget` (capped at `max_penalty`); the wrapped reward's info and
                 per-step rewards are kept (the penalty then also on the last character's step).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from rewards.adapters import adapt, load_reward, native_caller
from rewards.mix import Scored, checked, combined_steps
from rewards.runner import _describe, _is_async

try:  # optional: `pip install math-verify`
    import math_verify as _math_verify
except ImportError:  # pragma: no cover - depends on the environment
    _math_verify = None


def _not_timeout_disabled(record: logging.LogRecord) -> bool:
    """math-verify warns "Timeout is disabled as parsing_timeout/timeout_seconds is None" on its first
    call without a timeout: ours on purpose (its signal alarm fails off the main thread; the reward
    runner's timeout bounds a call). Its other records pass."""
    return not str(record.msg).startswith("Timeout is disabled")


for _logger in ("math_verify.parser", "math_verify.grader"):  # the modules of parse and verify
    if _not_timeout_disabled not in logging.getLogger(_logger).filters:
        logging.getLogger(_logger).addFilter(_not_timeout_disabled)

MATH_VERIFY_AVAILABLE = _math_verify is not None


def _labels(label: Any) -> list[str]:
    if isinstance(label, (list, tuple, set, frozenset)):
        return ["" if x is None else str(x) for x in label]
    return ["" if label is None else str(label)]


def _gold(label: Any, who: str) -> list[str]:
    """The labels to compare against; a missing one fails the sample instead of matching an empty response."""
    if label is None or (isinstance(label, (list, tuple, set, frozenset)) and not label):
        raise ValueError(
            f"{who} needs a label, and this sample has none (is data.label_key the dataset's answer column?)"
        )
    return _labels(label)


# --- exact match / F1 ----------------------------------------------------------------------------


def _squash(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


def exact_match(prompt: str, response: str, label: Any, metadata: dict | None = None) -> float:
    case_sensitive = bool((metadata or {}).get("case_sensitive", False))
    got = _squash(response, case_sensitive)
    return float(any(got == _squash(gold, case_sensitive) for gold in _gold(label, "exact_match")))


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split()


def _f1(pred: str, gold: str) -> float:
    p, g = _f1_tokens(pred), _f1_tokens(gold)
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def f1(prompt: str, response: str, label: Any, metadata: dict | None = None) -> float:
    return max(_f1(response, gold) for gold in _gold(label, "f1"))


def _lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence, bit-parallel over ``a`` (Hyyro 2004): one pass
    over ``b`` with Python integers as bit vectors, so long responses stay cheap."""
    if not a or not b:
        return 0
    where: dict[str, int] = {}
    for i, ch in enumerate(a):
        where[ch] = where.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & where.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def _char_f1(pred: str, gold: str) -> float:
    p, g = _squash(pred, False), _squash(gold, False)
    if not p or not g:
        return float(p == g)
    common = _lcs_length(p, g)
    if common == 0:
        return 0.0
    return 2 * common / (len(p) + len(g))


def char_f1(prompt: str, response: str, label: Any, metadata: dict | None = None) -> float:
    return max(_char_f1(response, gold) for gold in _gold(label, "char_f1"))


# --- format --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, flags: int) -> re.Pattern:
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"format regex {pattern!r} does not compile: {exc}") from None


def regex_format(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
    pattern = (metadata or {}).get("format_regex")
    if not pattern:
        raise ValueError("regex_format needs metadata['format_regex'] (or build one with make_regex_format(pattern))")
    return float(_compile(pattern, re.DOTALL).fullmatch(response.strip()) is not None)


def make_regex_format(pattern: str, flags: int = re.DOTALL, full: bool = True) -> Callable[..., float]:
    """A reward: 1.0 if the stripped response matches `pattern` (fully, unless full=False)."""
    compiled = _compile(pattern, flags)

    def regex_format_fixed(prompt: str, response: str) -> float:
        text = response.strip()
        found = compiled.fullmatch(text) if full else compiled.search(text)
        return float(found is not None)

    regex_format_fixed.__qualname__ = f"regex_format({pattern!r})"
    return regex_format_fixed


# --- JSON schema ---------------------------------------------------------------------------------

_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*?)\n?```$", re.DOTALL)


def _validator(schema: Any) -> Any:
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema: the schema is not valid JSON: {exc}") from None
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"json_schema: the schema itself is invalid: {exc.message}") from None
    return cls(schema)


def _json_score(response: str, validator: Any) -> float:
    text = response.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return 0.0
    return float(validator.is_valid(value))


def json_schema(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
    schema = (metadata or {}).get("json_schema")
    if schema is None:
        raise ValueError("json_schema needs metadata['json_schema'] (or build one with make_json_schema(schema))")
    return _json_score(response, _validator(schema))


def make_json_schema(schema: dict | str) -> Callable[..., float]:
    """A reward: 1.0 if the response is JSON valid against `schema` (checked now)."""
    validator = _validator(schema)

    def json_schema_fixed(prompt: str, response: str) -> float:
        return _json_score(response, validator)

    return json_schema_fixed


# --- length penalty ------------------------------------------------------------------------------


def length_penalty(
    fn: Callable[..., Any] | str,
    budget: int,
    per_unit: float,
    unit: str = "chars",
    max_penalty: float | None = None,
    tokenizer: Any = None,
) -> Callable[..., Any]:
    """Wrap reward `fn` (a callable of any supported style, or a spec): subtract
    `per_unit * max(0, length - budget)` (at most `max_penalty`). `unit` is "chars" or "tokens";
    tokens are whitespace-split words unless `tokenizer` is given (an object with `.encode`, e.g. a
    Hugging Face tokenizer, or a callable returning a sequence). Async if `fn` is."""
    if unit not in ("chars", "tokens"):
        raise ValueError(f"length_penalty: unit must be 'chars' or 'tokens', got {unit!r}")
    if budget < 0 or not math.isfinite(per_unit) or per_unit < 0:
        raise ValueError(f"length_penalty: need budget >= 0 and a finite per_unit >= 0, got {budget}, {per_unit}")
    if tokenizer is not None and unit != "tokens":
        raise ValueError("length_penalty: a tokenizer only makes sense with unit='tokens'")
    inner = load_reward(fn) if isinstance(fn, str) else adapt(fn)
    inner_name = fn if isinstance(fn, str) else _describe(inner)
    call = native_caller(inner, inner_name)

    def length(response: str) -> int:
        if unit == "chars":
            return len(response)
        if tokenizer is None:
            return len(response.split())
        if hasattr(tokenizer, "encode"):
            return len(tokenizer.encode(response, add_special_tokens=False))
        return len(tokenizer(response))

    def penalised(value: Any, response: str) -> float | dict[str, Any]:
        penalty = per_unit * max(0, length(response) - budget)
        if max_penalty is not None:
            penalty = min(penalty, max_penalty)
        result = checked(value, inner_name, response)  # its step rewards get the penalty at the end, as in a mix
        steps = combined_steps([(1.0, result), (1.0, Scored(-penalty))], response) if penalty else result.steps
        return Scored(result.score - penalty, steps, result.info).as_value()

    if _is_async(inner):

        async def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
            return penalised(await call(prompt, response, label, metadata), response)
    else:

        def reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> Any:
            return penalised(call(prompt, response, label, metadata), response)

    reward.__qualname__ = f"length_penalty({inner_name}, budget={budget} {unit})"
    return reward


# --- math ----------------------------------------------------------------------------------------


def math_answer(prompt: str, response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the response's final answer equals the label (any of them, for a list label)."""
    if _math_verify is None:
        return math_answer_fallback(prompt, response, label, metadata)
    target = _math_verify.parse(response, parsing_timeout=None)
    if not target:
        return 0.0
    for gold_text in _labels(label):
        gold = _parse_gold(gold_text)
        if gold and _math_verify.verify(gold, target, timeout_seconds=None):
            return 1.0
    return 0.0


def _parse_gold(text: str) -> list:
    text = text.strip()
    if not text:
        return []
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return _math_verify.parse(text, parsing_timeout=None)
    # A bare label: read it as LaTeX math first ("1,2" is the set {1,2}, "0.5" is 1/2).
    return _math_verify.parse(f"${text}$", parsing_timeout=None) or _math_verify.parse(text, parsing_timeout=None)


def math_answer_fallback(prompt: str, response: str, label: Any, metadata: dict | None = None) -> float:
    """The pure-Python checker `math_answer` uses when math-verify is not installed."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    for gold in _labels(label):
        gold = extract_boxed(gold) or gold
        if _equal(answer, gold):
            return 1.0
    return 0.0


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+?)\s*(?:$|\n|\.(?:\s|$))", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer in a response: last \\boxed{}, else after "answer is"/"answer:", else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip().strip("$").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_LATEX_NOISE = [
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\cdot", "*"),
    ("\\times", "*"),
    ("\\%", ""),
    ("%", ""),
    ("$", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\displaystyle", ""),
]


def _normalise(text: str) -> str:
    text = text.strip()
    for old, new in _LATEX_NOISE:
        text = text.replace(old, new)
    text = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac12
    text = text.strip().rstrip(".").strip()
    if re.fullmatch(r"[A-Za-z]\s*=.+", text):  # "x = 5" -> "5"
        text = text.split("=", 1)[1].strip()
    return text


def _number(text: str) -> Fraction | None:
    text = text.replace(" ", "")
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    try:
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
            text = text.replace(",", "")
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+(\.\d*)?)?", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _equal(a: str, b: str, depth: int = 0) -> bool:
    a, b = _normalise(a), _normalise(b)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y or math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-12)
    if depth < 2:
        sa, sb = _collection(a), _collection(b)
        if sa and sb and sa[0] == sb[0] and len(sa[1]) == len(sb[1]):
            if sa[0] == "set":
                return all(any(_equal(p, q, depth + 1) for q in sb[1]) for p in sa[1]) and all(
                    any(_equal(q, p, depth + 1) for p in sa[1]) for q in sb[1]
                )
            return all(_equal(p, q, depth + 1) for p, q in zip(sa[1], sb[1]))
    return _sympy_equal(a, b)


def _collection(text: str) -> tuple[str, list[str]] | None:
    """("set", items) for \\{a,b\\} or {a,b}; ("seq", items) for (a,b), [a,b] or a bare a,b."""
    t = text.strip()
    if t.startswith("\\{") and t.endswith("\\}"):
        return "set", _split_top(t[2:-2])
    if t.startswith("{") and t.endswith("}"):
        return "set", _split_top(t[1:-1])
    if len(t) > 1 and t[0] in "([" and t[-1] in ")]":
        return "seq", _split_top(t[1:-1])
    parts = _split_top(t)
    return ("seq", parts) if len(parts) > 1 else None


_SYMPY_FUNCS = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "E", "I", "oo"}
_SAFE = re.compile(r"[0-9A-Za-z+\-*/^(). ]*")


def _to_sympy_text(text: str) -> str | None:
    t = text
    for _ in range(3):  # nested \frac / \sqrt
        t = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", t)
    t = t.replace("\\pi", "pi").replace("\\infty", "oo").replace("{", "(").replace("}", ")").replace("\\", "")
    if len(t) > 200 or not _SAFE.fullmatch(t) or re.search(r"(?<!\d)\.|\.(?!\d)", t):
        return None
    words = re.findall(r"[A-Za-z]+", t)
    if any(len(w) > 1 and w not in _SYMPY_FUNCS for w in words):
        return None  # only single-letter variables and known functions reach sympy's parser (it evals)
    return t.replace("ln", "log")


def _sympy_equal(a: str, b: str) -> bool:
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return False
    ta, tb = _to_sympy_text(a), _to_sympy_text(b)
    if ta is None or tb is None or not ta.strip() or not tb.strip():
        return False
    transformations = standard_transformations + (implicit_multiplication_application,)
    try:
        ea = parse_expr(ta.replace("^", "**"), transformations=transformations, evaluate=True)
        eb = parse_expr(tb.replace("^", "**"), transformations=transformations, evaluate=True)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # noqa: BLE001 - sympy raises many types on odd input; unequal then
        return False


__all__: Sequence[str] = [
    "MATH_VERIFY_AVAILABLE",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "f1",
    "json_schema",
    "length_penalty",
    "make_json_schema",
    "make_regex_format",
    "math_answer",
    "math_answer_fallback",
    "regex_format",
]

"""Tools for agent environments, and parsing tool calls out of model text.

Tools (each takes one main text argument, so the XML style needs no attribute syntax):

    calculator(expression)  arithmetic only, parsed with `ast` and evaluated by walking the tree (no eval)
    search(query)           BM25 over a local JSONL of documents ({"id", "title", "text"} per line)
    python(code)            runs in the sandbox (envs/sandbox.py), never in this process

Call styles accepted in a model turn (several calls per turn are allowed, in order):

    JSON:  {"tool": "calculator", "args": {"expression": "2+3"}}     ("name"/"arguments" also work,
           and a bare string args is the main argument), optionally inside <tool_call>...</tool_call>
    XML:   <calculator>2+3</calculator>   or   <tool name="calculator">2+3</tool>
    final: <answer>5</answer>   or   {"answer": "5"}

A call that cannot be parsed, names an unknown tool or lacks its argument becomes a ToolCallError
whose message says what was wrong and what the right form is; the env sends it back as the
observation, so the model can learn from it. So does a number too long, nesting too deep or text
that is not UTF-8 (envs/model_text.py), and any other exception a tool raises on what the model
sent (`ToolRegistry.call`: the tool's name and the exception's type and message).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs import model_text
from envs.sandbox import Sandbox, SandboxConfig
from envs.sandbox_config import sandbox_config
from slime.security import printable_excerpt

logger = logging.getLogger(__name__)


class ToolCallError(ValueError):
    """A tool call that cannot run; the message is meant for the model."""


# ---- calculator --------------------------------------------------------------------------------
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30


def calculate(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses over numbers; anything else raises ToolCallError."""
    text = expression.strip()
    if not text:
        raise ToolCallError("calculator: empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolCallError(f"calculator: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ToolCallError(f"calculator: not an arithmetic expression: {text!r}") from None
    value = _arith(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value) or abs(node.value) > MAX_MAGNITUDE:  # 1e999 parses as inf
            raise ToolCallError("calculator: number out of range")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolCallError(f"calculator: exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolCallError("calculator: division by zero") from None
        except OverflowError:  # float ** float past the float range (1e300**2)
            raise ToolCallError("calculator: result out of range") from None
        if isinstance(value, complex) or not abs(value) <= MAX_MAGNITUDE:  # nan too
            raise ToolCallError("calculator: result out of range")
        return value
    raise ToolCallError(f"calculator: only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def format_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.10g}"


# ---- search ------------------------------------------------------------------------------------
_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class DocumentIndex:
    """Okapi BM25 over a small local collection (held in memory)."""

    def __init__(self, docs: list[dict[str, Any]], k1: float = 1.5, b: float = 0.75):
        if not docs:
            raise ValueError("DocumentIndex needs at least one document")
        self.docs = docs
        self.k1, self.b = k1, b
        self.terms = [Counter(_words(f"{d.get('title', '')} {d.get('text', '')}")) for d in docs]
        self.lengths = [sum(t.values()) for t in self.terms]
        self.avg_length = sum(self.lengths) / len(docs) or 1.0
        df = Counter(w for t in self.terms for w in t)
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    @classmethod
    def from_jsonl(cls, path: str | Path) -> DocumentIndex:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"search documents: {p} not found (relative paths start at {Path.cwd()})")
        docs = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{p}:{i}: not JSON ({exc})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ValueError(f'{p}:{i}: each line must be an object with a "text" string')
            docs.append(doc)
        return cls(docs)

    def search(self, query: str, k: int = 3) -> list[tuple[float, dict[str, Any]]]:
        words = _words(query)
        scored = []
        for doc, tf, length in zip(self.docs, self.terms, self.lengths):
            score = 0.0
            for w in words:
                f = tf.get(w, 0)
                if f:
                    score += (
                        self.idf[w]
                        * f
                        * (self.k1 + 1)
                        / (f + self.k1 * (1 - self.b + self.b * length / self.avg_length))
                    )
            if score > 0:
                scored.append((score, doc))
        scored.sort(key=lambda pair: -pair[0])
        return scored[:k]


# ---- registry ----------------------------------------------------------------------------------
@dataclass
class Tool:
    name: str
    argument: str  # name of the main text argument
    run: Callable[[str], str]
    description: str


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)

    def add(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool

    def call(self, name: str, argument: str) -> str:
        """The tool's result; ToolCallError for anything that went wrong, the tool's own failures
        included: a call the model made never fails the episode (the traceback goes to the log)."""
        tool = self.tools.get(name)
        if tool is None:
            raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(self.tools)}")
        try:
            return tool.run(argument)
        except ToolCallError:
            raise
        except Exception as exc:
            logger.warning("tool %s raised on the model's call", name, exc_info=True)
            detail = printable_excerpt(str(exc), 200)
            raise ToolCallError(f"{name}: the tool failed ({type(exc).__name__}: {detail})") from exc


def calculator_tool() -> Tool:
    return Tool("calculator", "expression", lambda e: format_number(calculate(e)), "arithmetic: + - * / // % ** ( )")


def search_tool(index: DocumentIndex, k: int = 2, snippet_chars: int = 160) -> Tool:
    def run(query: str) -> str:
        if not query.strip():
            raise ToolCallError("search: empty query")
        hits = index.search(query, k)
        if not hits:
            return "no results"
        return "\n".join(f"[{d.get('id', '?')}] {d.get('title', '')}: {d['text'][:snippet_chars]}" for _, d in hits)

    return Tool("search", "query", run, "search the local documents")


def python_tool(sandbox: Sandbox, max_chars: int = 400) -> Tool:
    def run(code: str) -> str:
        result = sandbox.run_python(code)
        if result.status == "sandbox_unavailable":
            raise ToolCallError(f"python: sandbox unavailable: {result.error}")
        out = result.stdout[-max_chars:].rstrip()
        if result.status != "ok":
            out += f"\n[{result.status}, exit {result.exit_code}] {result.stderr[-max_chars:]}"
        return out.strip() or "(no output)"

    return Tool("python", "code", run, "run Python in a sandbox; print what you need")


def build_registry(
    names: list[str], docs_path: str | None = None, sandbox: SandboxConfig | dict | None = None
) -> ToolRegistry:
    registry = ToolRegistry()
    settings = sandbox_config(sandbox)  # checked even where no tool uses them: a typo is named at once
    for name in names:
        if name == "calculator":
            registry.add(calculator_tool())
        elif name == "search":
            if docs_path is None:
                raise ValueError("the search tool needs docs_path (a JSONL of documents)")
            registry.add(search_tool(DocumentIndex.from_jsonl(docs_path)))
        elif name == "python":
            registry.add(python_tool(Sandbox(settings)))
        else:
            raise ValueError(f"unknown tool {name!r}; built-in tools: calculator, search, python")
    return registry


# ---- parsing -----------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    argument: str


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    errors: list[str] = field(default_factory=list)


FORMAT_HINT = 'call a tool as <NAME>ARG</NAME> or {"tool": NAME, "args": ARG}; finish with <answer>X</answer>'
_OPEN_TAG = re.compile(r'<(\w+)(?:\s+name\s*=\s*"([^"]*)")?\s*>')
_CLOSE_TAG = re.compile(r"</(\w+)\s*>")
_CALL_LIKE = re.compile(r'\{\s*"(tool|name|answer)"')
_OBJECT_START = re.compile(r'\{\s*["}]')  # a JSON object's first characters
MAX_FAILED_DECODES = 64
MAX_TURN_ERRORS = 8  # a turn of thousands of bad calls gets a few distinct errors, not one per call


def parse_turn(text: str, registry: ToolRegistry) -> ParsedTurn:
    """Tool calls, a final answer, or errors (for the observation) from one model turn."""
    turn = ParsedTurn()
    answer = _first_answer(text)
    if answer is not None:
        turn.answer = answer.strip()
        return turn
    covered: list[tuple[int, int]] = []
    unclosed: list[str] = []
    for start, end, tag, name_attr, body in _tag_pairs(text, unclosed):
        covered.append((start, end))
        if tag == "tool_call":
            _parse_json_calls(body, registry, turn, require=True)
        elif tag == "tool":
            if not name_attr:
                turn.errors.append('<tool> needs a name: <tool name="calculator">2+3</tool>')
            else:
                _add_call(turn, registry, name_attr, body)
        elif tag in registry.tools:
            _add_call(turn, registry, tag, body)
        else:
            turn.errors.append(f"unknown tool <{tag}>; tools: {', '.join(registry.tools)}")
    for tag in dict.fromkeys(unclosed):
        turn.errors.append(f"<{tag}> is never closed; write <{tag}>...</{tag}>")
    _parse_json_calls(_blank(text, covered), registry, turn, require=False)
    if not turn.calls and not turn.errors and turn.answer is None:
        turn.errors.append(f"no tool call or answer found; {FORMAT_HINT}")
    distinct = list(dict.fromkeys(turn.errors))
    turn.errors = distinct[:MAX_TURN_ERRORS]
    if len(distinct) > MAX_TURN_ERRORS:
        turn.errors.append(f"... and {len(distinct) - MAX_TURN_ERRORS} more errors")
    return turn


def _first_answer(text: str) -> str | None:
    """The body of the first ``<answer>...</answer>``, found in linear time."""
    start = text.find("<answer>")
    if start == -1:
        return None
    end = text.find("</answer>", start + len("<answer>"))
    return None if end == -1 else text[start + len("<answer>") : end]


def _tag_pairs(text: str, unclosed: list[str]):
    """``<tag>body</tag>`` pairs left to right, each closed by the first ``</tag>`` after it; pairs
    do not overlap. Linear in the text (a regex with a backreference rescans the rest of the text
    from every unclosed tag: seconds on a 60 kB turn of ``<a>``). Open tags never closed, outside
    every pair, are added to ``unclosed``; but an unclosed ``<tool_call>`` takes the rest of the turn
    as its body (engines cut a stop string such as ``</tool_call>`` from the text)."""
    closes: dict[str, list[tuple[int, int]]] = {}
    for m in _CLOSE_TAG.finditer(text):
        closes.setdefault(m.group(1), []).append(m.span())
    next_close = dict.fromkeys(closes, 0)  # per tag, the first close not yet behind the scan
    resume_at = 0
    for m in _OPEN_TAG.finditer(text):
        if m.start() < resume_at:
            continue  # inside the body of the pair before
        tag = m.group(1)
        spans = closes.get(tag, [])
        i = next_close.get(tag, 0)
        while i < len(spans) and spans[i][0] < m.end():
            i += 1
        if tag in next_close:
            next_close[tag] = i
        if i == len(spans):
            if tag == "tool_call":  # `</tool_call>` as a stop string is cut from the turn: the rest is its body
                yield m.start(), len(text), tag, m.group(2), text[m.end() :]
                return
            unclosed.append(tag)
            continue
        close_start, close_end = spans[i]
        yield m.start(), close_end, tag, m.group(2), text[m.end() : close_start]
        resume_at = close_end


def _blank(text: str, spans: list[tuple[int, int]]) -> str:
    pieces, at = [], 0
    for start, end in spans:
        pieces.append(text[at:start])
        pieces.append(" " * (end - start))
        at = end
    pieces.append(text[at:])
    return "".join(pieces)


def _parse_json_calls(text: str, registry: ToolRegistry, turn: ParsedTurn, require: bool) -> None:
    decoder = model_text.decoder  # numbers of at most MAX_NUMBER_DIGITS digits
    # Each failed decode may read to the end of the turn: at most MAX_FAILED_DECODES of each kind.
    i, found, failed_calls, failed_prose = 0, False, 0, 0
    while True:
        if failed_prose < MAX_FAILED_DECODES:
            start = text.find("{", i)
        else:  # prose that is not JSON is no longer decoded; what looks like a call still is
            call = _CALL_LIKE.search(text, i)
            start = -1 if call is None else call.start()
        if start == -1:
            break
        i = start + 1
        if not _OBJECT_START.match(text, start):  # prose braces, skipped without a decode
            if require:
                turn.errors.append('malformed JSON tool call: a quoted name must follow "{"')
                found = True
            continue
        try:
            obj, end = decoder.raw_decode(text, start)
        except RecursionError:  # the rest of the turn is not read: each brace would recurse again
            turn.errors.append(f"malformed JSON tool call: {model_text.NESTED_TOO_DEEPLY}")
            found = True
            break
        except ValueError as exc:
            # Only text that looks like a call is a malformed call; other braces are prose.
            if not (require or _CALL_LIKE.match(text, start)):
                failed_prose += 1
                continue
            if isinstance(exc, json.JSONDecodeError):
                turn.errors.append(f"malformed JSON tool call: {exc.msg} at character {exc.pos - start}")
            else:  # model_text.NumberTooLong
                turn.errors.append(f"malformed JSON tool call: {exc}")
            found = True
            failed_calls += 1
            if failed_calls == MAX_FAILED_DECODES:
                turn.errors.append(f"{failed_calls} malformed JSON tool calls: the rest of the turn is not read")
                break
            continue
        i = end
        if not isinstance(obj, dict):
            continue
        if "answer" in obj and turn.answer is None:
            turn.answer = str(obj["answer"]).strip()
            found = True
            continue
        name = obj.get("tool", obj.get("name"))
        if name is None:
            continue
        found = True
        if not isinstance(name, str):
            turn.errors.append('the "tool" field must be a tool name string')
            continue
        if not model_text.is_text(name):
            turn.errors.append(f'the "tool" field is {model_text.NOT_TEXT}')
            continue
        args = obj.get("args", obj.get("arguments", ""))
        tool = registry.tools.get(name)
        if isinstance(args, str) and args.strip().startswith("{"):
            try:
                args = model_text.loads(args)  # OpenAI style: arguments as a JSON string
            except RecursionError:
                turn.errors.append(f"{name}: arguments are {model_text.NESTED_TOO_DEEPLY}")
                continue
            except ValueError:
                pass
        if isinstance(args, dict):
            if tool is not None and tool.argument not in args:
                turn.errors.append(f'{name}: missing argument "{tool.argument}"')
                continue
            args = args.get(tool.argument, "") if tool is not None else ""
        if not isinstance(args, (str, int, float)):
            turn.errors.append(f"{name}: args must be a string or an object")
            continue
        _add_call(turn, registry, name, str(args))
    if require and not found:
        turn.errors.append(f"<tool_call> holds no JSON call; {FORMAT_HINT}")


def _add_call(turn: ParsedTurn, registry: ToolRegistry, name: str, argument: str) -> None:
    if name not in registry.tools:
        turn.errors.append(f"unknown tool {name!r}; tools: {', '.join(registry.tools)}")
    elif not model_text.is_text(argument):  # every tool encodes its argument (ast.parse, the sandbox's files)
        turn.errors.append(f"{name}: arguments are {model_text.NOT_TEXT}")
    else:
        turn.calls.append(ToolCall(name, argument.strip()))

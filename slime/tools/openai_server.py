"""The built-in engine behind a small OpenAI-compatible API.

    python -m slime.tools.openai_server MODEL_DIR [--port 8001] [--host H --token-file PATH]

    POST /v1/completions       {"model", "prompt": str, "max_tokens", "temperature", "top_p"}
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}], "max_tokens", "temperature", "top_p"}
    GET  /v1/models

Enough of the API for an LLM judge (rewards/judge.py) or any OpenAI client to use a local model:
one choice per request, no streaming, no logprobs. It serves a
`slime.engines.builtin.local_generator.LocalGenerator` (the engine with a thread that steps it);
concurrent requests share its continuous batch.

Security (docs/security.md): on loopback without a token the two generation routes are open (a
judge on the same machine needs no key; with a token they need it too; a browser cannot post JSON cross-site, and the Host allow-list stops DNS
rebinding); on any other bind every route needs the token (`Authorization: Bearer`, which is what
an OpenAI client sends as its api key), and such a bind without a token refuses to start. The
token comes from the environment (`SLIME_API_TOKEN`) or `--token-file`. Every input is bounded
(400 naming the field), bodies are capped (413), and at most `max_in_flight` requests run (503).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from slime.engines.builtin.local_generator import Completion, LocalGenerator
from slime.security import GuardPolicy, HttpGuard, check_bind, read_token

# Bounds on what one request may ask (the model's context caps prompt + completion again).
MAX_TOKENS = 4096
MAX_TEMPERATURE = 2.0  # as OpenAI's API
MAX_PROMPT_CHARS = 200_000
MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 100_000
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_IN_FLIGHT = 64


class CompletionRequest(BaseModel):
    model: str | None = Field(None, max_length=256)
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)


class ChatRequest(BaseModel):
    model: str | None = Field(None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the field, in OpenAI's error shape (its clients read error.message and error.param)."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first["loc"] if p != "body")
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errors[:5])
    return JSONResponse(
        status_code=400,
        content={"error": {"message": message, "type": "invalid_request_error", "param": param or None, "code": None}},
    )


def make_openai_app(
    gen: LocalGenerator,
    model_name: str = "local",
    *,
    token: str | None = None,
    bind_host: str = "127.0.0.1",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> FastAPI:
    check_bind(bind_host, token, "OpenAI-compatible server")
    app = FastAPI(title="slime OpenAI-compatible server")
    app.add_middleware(
        HttpGuard,
        policy=GuardPolicy(
            token=token,
            bind_host=bind_host,
            max_body_bytes=max_body_bytes,
            # open only on a loopback server without a token: with one, any local user could
            # otherwise hold every in-flight slot and its owner's (a judge's) requests get 503
            open_posts=frozenset() if token else frozenset({"/v1/completions", "/v1/chat/completions"}),
        ),
    )
    app.add_exception_handler(RequestValidationError, _invalid_request)
    in_flight = 0  # touched on the event loop only

    async def run(ids_of, max_tokens: int, temperature: float, top_p: float) -> Completion:
        nonlocal in_flight
        if in_flight >= max_in_flight:
            raise HTTPException(
                503,
                f"{in_flight} requests are running (at most {max_in_flight}); retry later",
                headers={"Retry-After": "1"},
            )
        in_flight += 1
        try:
            try:  # tokenizing a long prompt or a chat template is CPU work: off the event loop
                future = gen.submit(await asyncio.to_thread(ids_of), max_tokens, temperature, top_p)
            except ValueError as exc:
                raise HTTPException(status_code=400, detail=str(exc)) from None
            return await asyncio.wrap_future(future)
        finally:
            in_flight -= 1

    def usage(c: Completion) -> dict[str, int]:
        return {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        c = await run(lambda: gen.text_ids(req.prompt), req.max_tokens, req.temperature, req.top_p)
        return {
            "id": f"cmpl-{time.time_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or model_name,
            "usage": usage(c),
            "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        messages = [m.model_dump() for m in req.messages]
        c = await run(lambda: gen.chat_ids(messages), req.max_tokens, req.temperature, req.top_p)
        return {
            "id": f"chatcmpl-{time.time_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or model_name,
            "usage": usage(c),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            ],
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "slime"}]}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m slime.tools.openai_server", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-name", default="local")
    parser.add_argument(
        "--token-file",
        default=None,
        help="the token clients must send (else env SLIME_API_TOKEN); required off loopback",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help=f"requests generating at once before 503 (default {DEFAULT_MAX_IN_FLIGHT})",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
        help="largest request body in MiB (default 4)",
    )
    ns = parser.parse_args(argv)
    try:  # before loading the model: a refused bind should not cost a minute
        token = read_token(ns.token_file)
        check_bind(ns.host, token, "OpenAI-compatible server")
        if ns.max_in_flight < 1 or ns.max_body_mb <= 0:
            raise ValueError("--max-in-flight must be >= 1 and --max-body-mb > 0")
    except (ValueError, OSError) as exc:
        print(f"slime.tools.openai_server: {exc}", file=sys.stderr)
        return 2
    gen = LocalGenerator(ns.model_dir, device=ns.device)
    app = make_openai_app(
        gen,
        ns.model_name,
        token=token,
        bind_host=ns.host,
        max_in_flight=ns.max_in_flight,
        max_body_bytes=int(ns.max_body_mb * (1 << 20)),
    )
    print(
        f"serving {ns.model_dir} as {ns.model_name!r} on http://{ns.host}:{ns.port}/v1"
        + (" (token required)" if token else ""),
        flush=True,
    )
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    gen.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

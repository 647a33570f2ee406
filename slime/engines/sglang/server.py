"""The built-in engine behind SGLang's native HTTP protocol (`slime serve-sglang --model DIR`).

Tools written for an SGLang server (and our own SGLang adapter, `slime.engines.sglang`) can drive
the built-in torch engine unchanged. Request and response shapes follow SGLang's
`python/sglang/srt/entrypoints/http_server.py` and `managers/io_struct.py`:

- ``POST /generate``: ``input_ids`` (one list, or a list of lists without ``stream``),
  ``sampling_params`` (temperature, top_p, top_k (-1 = off), max_new_tokens, stop_token_ids,
  ignore_eos), ``return_logprob``, ``stream`` (SSE ``data: {...}`` events, then
  ``data: [DONE]``), ``rid``. Output: ``{"text", "output_ids", "meta_info"}`` with ``meta_info``
  holding ``id``, ``finish_reason`` (``{"type": "stop", "matched": id}``, ``{"type": "length",
  "length": n}``, ``{"type": "abort", "message": ...}`` or None while running),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version`` and, with
  ``return_logprob``, ``output_token_logprobs`` as ``[logprob, token_id, None]`` triples.
  Streamed events are cumulative (SGLang's default, without ``--incremental-streaming-output``).
- ``POST /abort_request`` (``rid`` or ``abort_all``): the aborted request's stream ends with its
  partial output and finish reason ``abort``.
- ``POST /pause_generation`` (``mode``: ``abort`` (SGLang's default) aborts everything;
  ``in_place`` and ``retract`` keep requests and their KV cache) and ``/continue_generation``.
- ``POST /update_weights_from_disk`` (``model_path``: a directory of ``*.safetensors`` under the
  server's ``--weights-dir``), ``/update_weights_from_tensor`` (``serialized_named_tensors``: one
  entry; ``load_format`` ``"safetensors"`` = base64 safetensors bytes, ``"slime_weight_handle"``
  = the JSON form of a `slime.weights.WeightHandle` of the shared-memory or CUDA IPC transport,
  the zero-copy path). Both are in place; running requests continue with the new weights (their
  KV cache stays). SGLang's own ``load_format`` null (a pickled list) is refused.
- ``POST /release_memory_occupation`` and ``/resume_memory_occupation``: the engine frees its KV
  memory while a colocated learner trains (``freed_bytes`` in the answer) and takes it back.
- ``/flush_cache`` (400 while requests run, as SGLang; the engine has no prefix cache),
  ``/health`` (is the engine thread alive), ``/health_generate`` (a one-token generation when
  idle), ``/model_info`` and ``/server_info`` (also under their older names ``/get_model_info``,
  ``/get_server_info``), ``/get_load`` (``[{"dp_rank", "num_reqs", "num_waiting_reqs",
  "num_tokens"}]``): what sglang-router asks a worker for, so the real router can balance over
  several of these servers.
- ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``: this server joins the sender's group as rank
  ``rank_offset``) and ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``:
  one broadcast from rank 0 per tensor, in that order), ``/destroy_weights_update_group``.

Text prompts need the model directory's tokenizer, and there is no radix cache.

Security (docs/security.md, docs/engines.md): no route unpickles anything. The token comes from
the environment (``SLIME_API_TOKEN``) or ``--token-file``, never argv; a non-loopback ``--host``
needs one. `slime.security.HttpGuard` checks the Host header, body sizes, JSON-only
state-changing requests and the token: every route needs it on a non-loopback bind, every
state-changing route always, ``/generate`` whenever the server has a token (open only on a
loopback server without one), ``/health`` never.
Sampling parameters and token ids are bounded (`slime.engines.contract.validate_sampling`), as are batch
size, rids and the queue (503 when full). Disk updates load only under ``--weights-dir``; update
groups connect only to ``--update-group-hosts``, one rendezvous at a time, with a timeout. A step
that raises fails the requests in flight and resets the engine; the thread stops only after
repeated failures, and then ``/health`` says why and every open stream ends.

This module is the HTTP app and the command line; what a request may hold, checked, is in
`slime.engines.sglang.protocol`, and the thread that owns the engine in
`slime.engines.sglang.engine_thread`.

Longer than 500 lines: one route per endpoint of SGLang's HTTP protocol, which a client expects in
one server; the engine thread and the request shapes are files of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from safetensors.torch import load_file

from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.sglang.engine_thread import EngineStopped, QueueFull, RequestStream, SglangProtocolServer
from slime.engines.sglang.protocol import (
    LOOPBACK_GROUP_HOSTS,
    AbortReq,
    DestroyWeightsUpdateGroupReqInput,
    GenerateJob,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ServerSettings,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    check_tensors,
    disk_files,
    generate_jobs,
    parse_dtype,
    parse_weight_version,
    tensors_from_payload,
)
from slime.model import eos_token_ids, load_model, load_tokenizer
from slime.security import GuardPolicy, HttpGuard, check_bind, read_token
from slime.weights import broadcast_from_rank0, join_update_group

HEALTH_TIMEOUT_S = 20.0
MAX_BODY_BYTES = 8 << 20  # a /generate of a ~1M-token context
DEFAULT_TENSOR_BODY_MB = 1024  # /update_weights_from_tensor with inline safetensors
MAX_UPDATE_GROUPS = 16


def guard_policy(token: str | None, host: str, max_tensor_body_mb: float = DEFAULT_TENSOR_BODY_MB) -> GuardPolicy:
    """What the guard requires here: a token for every state-changing route (and every route on a
    non-loopback bind), and for ``/generate`` too whenever the server has one (a job's launched
    servers always do: its adapter sends it on every request, sglang-router forwards its own key).
    Open without a token, any local user could fill the queue, and the job's next request got 503
    and failed its rollout worker. ``/generate`` is open only on a loopback server started without
    a token; ``/health`` always (liveness only: routers probe it without a key). ``GET
    /flush_cache`` is state-changing, and so is ``GET /health_generate`` on a server with a token:
    it queues a generation, and an open one let any local user fill the queue the same way."""
    return GuardPolicy(
        token=token,
        bind_host=host,
        max_body_bytes=MAX_BODY_BYTES,
        large_body_paths={"/update_weights_from_tensor": int(max_tensor_body_mb * 2**20)},
        open_posts=frozenset() if token else frozenset({"/generate"}),
        open_paths=frozenset({"/health"}),
        state_changing_gets=frozenset({"/flush_cache", "/health_generate"} if token else {"/flush_cache"}),
    )


def create_app(server: SglangProtocolServer, policy: GuardPolicy) -> FastAPI:
    app = FastAPI(title="slime built-in engine, SGLang protocol")
    app.add_middleware(HttpGuard, policy=policy)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "BadRequest", "code": status}, status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(part) for part in e["loc"] if part != "body") or "body"
            problems.append(f"{where}: {e['msg']}")
        return error("; ".join(problems))

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request: Request, exc: EngineStopped):
        return error(f"the engine thread has stopped: {exc}", 503)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        return error(str(exc), 503)

    async def start(jobs: list[GenerateJob]) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(j.rid, len(j.input_ids), j.return_logprob, loop) for j in jobs]
        items = [(s, GenerationRequest(j.rid, j.input_ids, j.params)) for s, j in zip(streams, jobs)]
        await server.call(lambda: server._add_all(items))
        return streams

    async def run_to_end(stream: RequestStream) -> dict:
        while not stream.finished:
            server.absorb(stream, await stream.events.get())
        return server.output(stream)

    async def input_logprobs(ids: list[int], start: int, temperature: float) -> list[list]:
        """SGLang's input_token_logprobs from position ``start``: [logprob, token_id, None] per
        input token given the tokens before it (None for the very first token)."""
        first = max(start, 1)
        lps = (
            await server.call(lambda: server.engine.score_logprobs(ids[:first], ids[first:], temperature))
            if first < len(ids)
            else []
        )
        head = [[None, ids[0], None]] if start == 0 and ids else []
        return head + [[lp, t, None] for lp, t in zip(lps, ids[first:])]

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput):
        try:
            jobs, batched = generate_jobs(
                obj,
                vocab_size=server.engine.vocab_size,
                max_seq_len=server.engine.max_seq_len,
                eos_token_ids=server.eos_token_ids,
                tokenizer=server.tokenizer,
                max_batch_size=server.settings.max_batch_size,
            )
            streams = await start(jobs)
        except ValueError as e:
            return error(str(e))

        if not obj.stream:
            outs = [await run_to_end(s) for s in streams]
            failed = next((s for s in streams if s.error is not None), None)
            if failed is not None:
                return error(f"request {failed.rid!r}: {failed.error}", 500)
            if obj.logprob_start_len is not None and obj.logprob_start_len >= 0:
                for out, job in zip(outs, jobs):
                    if job.return_logprob:
                        temperature = job.params.temperature
                        out["meta_info"]["input_token_logprobs"] = await input_logprobs(
                            job.input_ids, obj.logprob_start_len, temperature
                        )
            return outs if batched else outs[0]

        stream = streams[0]

        async def events():
            try:
                while not stream.finished:
                    server.absorb(stream, await stream.events.get())
                    yield b"data: " + json.dumps(server.output(stream)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not stream.finished:  # the client went away: stop generating for it (as SGLang)
                    try:
                        await server.call(lambda: server._abort([stream.rid]))
                    except EngineStopped:
                        pass

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq):
        await server.call(lambda: server._abort(None if obj.abort_all else [obj.rid or ""]))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await request.body()
        try:
            obj = PauseGenerationReqInput.model_validate_json(body) if body.strip() else PauseGenerationReqInput()
        except ValueError as e:
            return error(f"pause_generation: {e}")

        def pause():
            server.paused = True
            if obj.mode == "abort":
                server._abort(None)

        await server.call(pause)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        def resume():
            server.paused = False

        await server.call(resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation():
        freed = await server.call(server.engine.release_memory)
        return {"success": True, "message": "Memory released.", "freed_bytes": int(freed)}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation():
        await server.call(server.engine.resume_memory)
        return {"success": True, "message": "Memory resumed."}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        idle = await server.call(lambda: not server.engine.has_unfinished())
        return Response(
            content="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            status_code=200 if idle else 400,
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput):
        try:
            version = parse_weight_version(obj.weight_version)
            files = disk_files(obj.model_path, server.settings.weights_dir)
            named = [item for f in files for item in load_file(str(f)).items()]
            check_tensors(server.tensor_shapes, ((n, t.shape) for n, t in named), "update_weights_from_disk")
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            paused = await server.call(lambda: server._update(version, named))
        except PermissionError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 403)
        except (ValueError, OSError, RuntimeError) as e:
            if isinstance(e, EngineStopped):
                raise
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": paused}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput):
        try:
            version = parse_weight_version(obj.weight_version)
            handle_version, named = tensors_from_payload(
                obj.serialized_named_tensors[0],
                obj.load_format,
                tensor_shapes=server.tensor_shapes,
                device=server.engine.device,
                shm_segments=server.shm_segments,
            )
            version = handle_version if version is None else version
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, named))
        except EngineStopped:
            raise
        except Exception as e:  # a bad payload, or memory this process cannot map
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput):
        def refuse(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse({"success": False, "message": message}, status)

        hosts = server.settings.update_group_hosts
        if obj.master_address not in hosts:
            return refuse(
                f"master_address {obj.master_address!r} is not one this server accepts "
                f"(--update-group-hosts: {sorted(hosts)})"
            )
        if obj.backend == "nccl" and server.engine.device.type != "cuda":
            return refuse("backend=nccl needs the engine on CUDA; use gloo")
        if obj.group_name not in server.groups and len(server.groups) >= MAX_UPDATE_GROUPS:
            return refuse(f"already {len(server.groups)} weight-update groups; destroy one first")
        if server.group_joining.locked():
            return refuse("another weight-update group is being joined; retry once it is done", 409)
        async with server.group_joining:
            try:  # a rendezvous: blocks until the sender (rank 0) and every engine rank have joined
                group = await asyncio.to_thread(
                    join_update_group,
                    obj.master_address,
                    obj.master_port,
                    obj.rank_offset,
                    obj.world_size,
                    obj.group_name,
                    obj.backend,
                    server.settings.update_group_timeout_s,
                )
            except Exception as e:
                return refuse(f"Failed to initialize the group: {e}")
        server.groups[obj.group_name] = (group, obj.backend)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput):
        entry = server.groups.get(obj.group_name)
        if entry is None:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"no weight-update group {obj.group_name[:64]!r}; call /init_weights_update_group first",
                },
                400,
            )
        try:
            if not (len(obj.names) == len(obj.dtypes) == len(obj.shapes)):
                raise ValueError("names, dtypes and shapes must have the same length")
            dtypes = [parse_dtype(d) for d in obj.dtypes]
            check_tensors(server.tensor_shapes, zip(obj.names, obj.shapes), "update_weights_from_distributed")
            version = parse_weight_version(obj.weight_version)
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        group, backend = entry
        device = server.engine.device if backend == "nccl" else torch.device("cpu")

        def receive() -> list[tuple[str, torch.Tensor]]:
            named = []
            for name, dtype, shape in zip(obj.names, dtypes, obj.shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast_from_rank0(group, t)  # one broadcast per tensor, in the listed order (as SGLang)
                named.append((name, t))
            return named

        try:
            named = await asyncio.to_thread(receive)  # off the engine thread; applied between two steps
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, named))
        except EngineStopped:
            raise
        except (ValueError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput):
        if server.groups.pop(obj.group_name, None) is None:
            return JSONResponse({"success": False, "message": f"no weight-update group {obj.group_name[:64]!r}"}, 400)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.get("/health")
    async def health():
        """Liveness only (no generation): open to routers that probe without a key."""
        if server.error is not None:
            return error(f"the engine thread has stopped: {server.error}", 503)
        return Response(status_code=200)

    health_probe: dict[str, asyncio.Task] = {}  # the one probe generation in flight

    @app.get("/health_generate")
    async def health_generate():
        if server.error is not None:
            return error(f"the engine thread has stopped: {server.error}", 503)
        busy = await server.call(lambda: server.engine.num_running() > 0)
        if busy and time.time() - server.last_step < HEALTH_TIMEOUT_S:
            return Response(status_code=200)  # it is generating: that is the health signal
        if server.paused:
            return Response(status_code=200)
        # Probes that arrive together share one generation: they never take more than one queue slot.
        if "task" not in health_probe or health_probe["task"].done():
            health_probe["task"] = asyncio.ensure_future(probe_generation())
        return await asyncio.shield(health_probe["task"])

    async def probe_generation() -> Response:
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=1)
            (stream,) = await start([GenerateJob(f"HEALTH_CHECK_{time.time()}", [0], params, False)])
            await asyncio.wait_for(run_to_end(stream), HEALTH_TIMEOUT_S)
        except Exception as e:
            return error(f"health generation failed: {type(e).__name__}: {e}", 503)
        if stream.error is not None:
            return error(f"health generation failed: {stream.error}", 503)
        return Response(status_code=200)

    # SGLang renamed /get_model_info and /get_server_info to /model_info and /server_info; both
    # names are served. sglang-router reads /server_info and /model_info when a worker registers.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": server.model_path,
            "tokenizer_path": server.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(server.engine.version),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        health = await server.call(server.engine.health)
        return {
            # the built-in engine's own state; its int "version" is the policy version, also in weight_version
            **{k: v for k, v in health.items() if k != "version"},
            "engine": "slime-builtin",
            "paused": server.paused,
            "step_failures": server.step_failures,
            # the fields SGLang's /server_info has that routers read, with SGLang's types
            # (sglang-router drops the whole answer when one field has another type)
            "version": "slime-builtin",
            "model_path": server.model_path,
            "tokenizer_path": server.model_path,
            "served_model_name": server.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "is_embedding": False,
            "max_running_requests": getattr(server.engine, "max_running_requests", None),
            "weight_version": str(server.engine.version),
        }

    @app.get("/get_load")
    async def get_load():
        """SGLang's shape, one entry per data-parallel rank: sglang-router's ``power_of_two``
        policy sums ``num_tokens`` over them."""

        def load() -> dict:
            streams = list(server.streams.values())
            return {
                "num_reqs": server.engine.num_running(),
                "num_waiting_reqs": server.engine.num_waiting(),
                "num_tokens": sum(s.prompt_len + len(s.token_ids) for s in streams),
            }

        return [{"dp_rank": 0, **await server.call(load)}]

    return app


def build_server(
    model_dir: str,
    device: str = "cpu",
    dtype: str = "float32",
    max_running_requests: int = 64,
    seed: int = 0,
    settings: ServerSettings = ServerSettings(),
) -> SglangProtocolServer:
    model = load_model(model_dir, dtype, device)
    tokenizer, eos = None, []
    try:
        tokenizer = load_tokenizer(model_dir)
        eos = eos_token_ids(tokenizer)
    except Exception:  # a weights-only directory: input_ids only, no implicit EOS
        pass
    engine = BuiltinEngine(model, device=device, max_running_requests=max_running_requests, seed=seed)
    return SglangProtocolServer(engine, model_dir, tokenizer, eos, settings)


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "cpu",
    dtype: str = "float32",
    max_running_requests: int = 64,
    seed: int = 0,
    torch_threads: int | None = None,
    *,
    token: str | None = None,
    settings: ServerSettings = ServerSettings(),
    max_tensor_body_mb: float = DEFAULT_TENSOR_BODY_MB,
) -> None:
    check_bind(host, token, "slime serve-sglang")  # before the model loads: refuse at once
    if torch_threads:
        torch.set_num_threads(torch_threads)
    server = build_server(model_dir, device, dtype, max_running_requests, seed, settings)
    print(f"slime serve-sglang: {model_dir} loaded; serving on http://{host}:{port} (/generate, /health)", flush=True)
    try:
        # A bounded graceful shutdown: SIGTERM never waits on a stream for long.
        uvicorn.run(
            create_app(server, guard_policy(token, host, max_tensor_body_mb)),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="slime serve-sglang",
        description="Serve the built-in engine over SGLang's native HTTP API.",
        allow_abbrev=False,  # `--token SECRET` must not pass for --token-file (and echo the secret as a path)
        epilog="The token comes from the environment variable SLIME_API_TOKEN or --token-file (never argv).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs a token")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests beyond the running ones; more answer 503 (default 4 x --max-running-requests)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--token-file", default=None, help="a file holding the token (else SLIME_API_TOKEN)")
    p.add_argument(
        "--weights-dir",
        default=None,
        help="/update_weights_from_disk loads only directories under this one (unset: the route is off)",
    )
    p.add_argument(
        "--update-group-hosts",
        default=",".join(LOOPBACK_GROUP_HOSTS),
        help="comma-separated master_address values /init_weights_update_group may connect to",
    )
    p.add_argument("--update-group-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--max-tensor-body-mb",
        type=float,
        default=DEFAULT_TENSOR_BODY_MB,
        help="body limit of /update_weights_from_tensor (inline safetensors)",
    )
    a = p.parse_args(argv)
    try:
        token = read_token(a.token_file)
        check_bind(a.host, token, "slime serve-sglang")
    except (ValueError, OSError) as e:
        raise SystemExit(f"slime serve-sglang: {e}") from None
    settings = ServerSettings(
        weights_dir=os.path.realpath(a.weights_dir) if a.weights_dir else None,
        update_group_hosts=frozenset(h.strip() for h in a.update_group_hosts.split(",") if h.strip()),
        update_group_timeout_s=a.update_group_timeout_s,
        max_queued_requests=a.max_queued_requests if a.max_queued_requests is not None else 4 * a.max_running_requests,
        max_batch_size=4 * a.max_running_requests,
    )
    serve(
        a.model,
        a.host,
        a.port,
        a.device,
        a.dtype,
        a.max_running_requests,
        a.seed,
        a.torch_threads,
        token=token,
        settings=settings,
        max_tensor_body_mb=a.max_tensor_body_mb,
    )


if __name__ == "__main__":
    main()

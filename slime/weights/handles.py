"""Weight handles: where each tensor of a published version lies (buckets, offsets), and the
JSON form of a shared-memory or CUDA IPC handle that travels over HTTP, checked field by field."""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass
class WeightHandle:
    version: int
    transport: str
    metas: list[TensorMeta]
    buckets: list[Any] = field(default_factory=list)  # transport-specific: segment names, IPC handles, paths

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def to_json(self) -> str:
        """The handle as JSON (shm and cuda_ipc transports): plain values only, bytes as base64."""
        if self.transport == "shm":
            buckets = [{"segment": name} for name in self.buckets]
        elif self.transport == "cuda_ipc":
            buckets = [_cuda_ipc_bucket_json(rebuild, args) for rebuild, args in self.buckets]
        else:
            raise ValueError(
                f"WeightHandle.to_json: transport {self.transport!r} has no JSON form (shm or cuda_ipc only)"
            )
        doc = _HandleJson(
            version=self.version,
            transport=self.transport,
            buckets=buckets,
            metas=[
                _MetaJson(
                    name=m.name, dtype=m.dtype, shape=list(m.shape), bucket=m.bucket, offset=m.offset, nbytes=m.nbytes
                )
                for m in self.metas
            ],
        )
        return doc.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightHandle:
        """Parse and check a handle from `to_json`; ValueError naming what is wrong. The bytes a
        tensor claims must fit its bucket (a shared-memory segment's size is known only once it is
        mapped: the receiver then calls `check_fits`)."""
        doc = _HandleJson.model_validate_json(text)
        if doc.transport == "shm":
            buckets: list[Any] = []
            for i, b in enumerate(doc.buckets):
                if not isinstance(b, _ShmBucketJson):
                    raise ValueError(f'buckets[{i}]: a shm bucket is {{"segment": name}}')
                buckets.append(b.segment)
            sizes = None
        else:
            buckets, sizes = [], []
            for i, b in enumerate(doc.buckets):
                if not isinstance(b, _CudaIpcBucketJson):
                    raise ValueError(f"buckets[{i}]: a cuda_ipc bucket holds the fields of reduce_tensor")
                buckets.append(b.rebuild_args(i))
                sizes.append(b.numel)
        names: set[str] = set()
        metas = []
        for i, m in enumerate(doc.metas):
            if m.name in names:
                raise ValueError(f"metas[{i}].name {m.name!r} appears twice")
            names.add(m.name)
            if not 0 <= m.bucket < len(buckets):
                raise ValueError(f"metas[{i}] ({m.name!r}): bucket {m.bucket} of {len(buckets)}")
            itemsize = torch.empty(0, dtype=_dtype(m.dtype)).element_size()
            if m.nbytes != math.prod(m.shape) * itemsize:
                raise ValueError(
                    f"metas[{i}] ({m.name!r}): nbytes {m.nbytes} != numel {math.prod(m.shape)} * itemsize {itemsize}"
                )
            if m.offset % itemsize:
                raise ValueError(
                    f"metas[{i}] ({m.name!r}): offset {m.offset} is not a multiple of its itemsize {itemsize}"
                )
            metas.append(TensorMeta(m.name, m.dtype, tuple(m.shape), m.bucket, m.offset, m.nbytes))
        handle = cls(doc.version, doc.transport, metas, buckets)
        if sizes is not None:
            handle.check_fits(sizes)
        return handle

    def check_fits(self, bucket_sizes: list[int]) -> None:
        """Every tensor's bytes lie inside its bucket (``bucket_sizes`` in bytes, one per bucket)."""
        if len(bucket_sizes) != len(self.buckets):
            raise ValueError(f"{len(bucket_sizes)} bucket sizes for {len(self.buckets)} buckets")
        for m in self.metas:
            if m.offset + m.nbytes > bucket_sizes[m.bucket]:
                raise ValueError(
                    f"tensor {m.name!r}: bytes [{m.offset}, {m.offset + m.nbytes}) outside bucket "
                    f"{m.bucket} of {bucket_sizes[m.bucket]} bytes"
                )


# ---- the JSON form of a handle -----------------------------------------------------------------
# dtypes a weight may have; anything else in a JSON handle is refused
JSON_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
# SharedMemoryTransport's segment names: f"{prefix}_{pid}_w{i}" with prefix "slime_<job>" (no path separator)
SHM_SEGMENT_NAME = re.compile(r"^slime_[A-Za-z0-9_.\-]{1,200}_w[0-9]{1,6}$")
_MAX_BYTES = 1 << 50
_Size = Annotated[int, Field(ge=0, le=_MAX_BYTES)]


class _StrictJson(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _MetaJson(_StrictJson):
    name: str = Field(min_length=1, max_length=512, pattern=r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
    dtype: Literal[JSON_DTYPES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=8)
    bucket: int = Field(ge=0)
    offset: _Size
    nbytes: _Size


class _ShmBucketJson(_StrictJson):
    segment: str = Field(pattern=SHM_SEGMENT_NAME.pattern)


_Base64 = Annotated[str, Field(min_length=1, max_length=4096)]


class _CudaIpcBucketJson(_StrictJson):
    """One bucket (a 1-D uint8 CUDA tensor at offset 0 of its storage) as `reduce_tensor` describes it."""

    numel: _Size
    device: int = Field(ge=0, le=1023)
    handle: _Base64
    storage_size_bytes: _Size
    storage_offset_bytes: _Size
    ref_counter_handle: _Base64
    ref_counter_offset: _Size
    event_handle: _Base64 | None
    event_sync_required: bool

    def rebuild_args(self, index: int) -> tuple:
        """``(rebuild_cuda_tensor, args)``, the pair `reduce_tensor` returns, from checked plain values."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if self.numel > self.storage_size_bytes:
            raise ValueError(f"buckets[{index}]: numel {self.numel} over storage_size_bytes {self.storage_size_bytes}")

        def raw(name: str) -> bytes | None:
            value = getattr(self, name)
            try:
                return None if value is None else base64.b64decode(value, validate=True)
            except binascii.Error:
                raise ValueError(f"buckets[{index}].{name} is not base64") from None

        args = (
            torch.Tensor,
            torch.Size([self.numel]),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            self.device,
            raw("handle"),
            self.storage_size_bytes,
            self.storage_offset_bytes,
            False,
            raw("ref_counter_handle"),
            self.ref_counter_offset,
            raw("event_handle"),
            self.event_sync_required,
        )
        return rebuild_cuda_tensor, args


def _cuda_ipc_bucket_json(rebuild, args: tuple) -> _CudaIpcBucketJson:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (
        tensor_cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    if (
        rebuild is not rebuild_cuda_tensor
        or tensor_cls is not torch.Tensor
        or dtype != torch.uint8
        or len(size) != 1
        or tuple(stride) != (1,)
        or tensor_offset != 0
        or requires_grad
    ):
        raise ValueError("WeightHandle.to_json: a cuda_ipc bucket must be a 1-D uint8 CUDA tensor at offset 0")

    def b64(value: bytes | None) -> str | None:
        return None if value is None else base64.b64encode(value).decode()

    return _CudaIpcBucketJson(
        numel=int(size[0]),
        device=int(device),
        handle=b64(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=b64(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=b64(event_handle),
        event_sync_required=bool(event_sync_required),
    )


class _HandleJson(_StrictJson):
    format: Literal["slime_weight_handle/1"] = "slime_weight_handle/1"
    version: int = Field(ge=0)
    transport: Literal["shm", "cuda_ipc"]
    metas: list[_MetaJson] = Field(max_length=1 << 17)
    buckets: list[_ShmBucketJson | _CudaIpcBucketJson] = Field(max_length=1 << 14)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


_ALIGN = 64  # keep every tensor cache-line aligned inside its bucket


def plan_buckets(
    named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[list[TensorMeta], list[int]]:
    """Assign tensors to buckets in order; a tensor larger than a bucket gets a bucket of its own."""
    metas: list[TensorMeta] = []
    sizes: list[int] = []
    bucket, offset = 0, 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if offset and offset + nbytes > bucket_bytes:
            sizes.append(offset)
            bucket, offset = bucket + 1, 0
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), bucket, offset, nbytes))
        offset += math.ceil(nbytes / _ALIGN) * _ALIGN
    if offset or not sizes:
        sizes.append(max(offset, _ALIGN))
    return metas, sizes


def bucket_views(buffers: list[torch.Tensor], metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    for m in metas:
        raw = buffers[m.bucket][m.offset : m.offset + m.nbytes]
        yield m.name, raw.view(_dtype(m.dtype)).view(m.shape)


def pack_buckets(named: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], buffers: list[torch.Tensor]) -> None:
    """Copy each tensor into its place; a sharded one (a DTensor of an FSDP2 learner) is gathered
    just before its copy and freed after, so the whole model never exists twice."""
    with torch.no_grad():
        for (_name, src), (_, dst) in zip(named, bucket_views(buffers, metas)):
            dst.copy_(whole(src.detach()).reshape(dst.shape))


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's full value: a DTensor is gathered from its ranks (a collective: they all call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t

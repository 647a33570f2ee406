"""Weight transport from the learner to the rollout engines (DESIGN.md, "Weight transport").

The learner `publish`es a version: tensors are packed into buckets of `bucket_mb` and a small,
picklable `WeightHandle` describes them. Each engine `receive`s the handle and gets
(name, tensor) pairs that it copies into its own parameters in place.

- SharedMemoryTransport: CPU, one host. Buckets are POSIX shared-memory segments that stay
  allocated across versions; the receiver's tensors are zero-copy views of them.
- CudaIpcTransport: learner and engine on the same GPU. Buckets are CUDA tensors whose IPC
  handles travel in the WeightHandle; the receiver maps the learner's memory, no host copy.
- FileTransport: safetensors files in a directory, the fallback any engine can read.
- BroadcastTransport: a torch.distributed group across processes or machines (NCCL for CUDA
  tensors, gloo for CPU tensors, same code); the learner is rank 0, each receiver takes the next
  free rank, and every bucket is one broadcast.

A handle of the shared-memory or CUDA IPC transport also has a JSON form (`WeightHandle.to_json`,
`WeightHandle.from_json`): what travels over HTTP to an SGLang-protocol server, never a pickle.
`from_json` accepts only plain values it has checked (dtype allow-list, shapes, byte counts,
segment names of this module's naming pattern, CUDA IPC fields as `reduce_tensor` makes them).
"""

from __future__ import annotations

import base64
import binascii
import math
import mmap
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path
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
            raise ValueError(f"WeightHandle.to_json: transport {self.transport!r} has no JSON form (shm or cuda_ipc only)")
        doc = _HandleJson(
            version=self.version, transport=self.transport, buckets=buckets,
            metas=[_MetaJson(name=m.name, dtype=m.dtype, shape=list(m.shape), bucket=m.bucket, offset=m.offset,
                             nbytes=m.nbytes) for m in self.metas],
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
                    raise ValueError(f"buckets[{i}]: a shm bucket is {{\"segment\": name}}")
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
                raise ValueError(f"metas[{i}] ({m.name!r}): nbytes {m.nbytes} != numel {math.prod(m.shape)} * itemsize {itemsize}")
            if m.offset % itemsize:
                raise ValueError(f"metas[{i}] ({m.name!r}): offset {m.offset} is not a multiple of its itemsize {itemsize}")
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
                raise ValueError(f"tensor {m.name!r}: bytes [{m.offset}, {m.offset + m.nbytes}) outside bucket "
                                 f"{m.bucket} of {bucket_sizes[m.bucket]} bytes")


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

        args = (torch.Tensor, torch.Size([self.numel]), (1,), 0, torch.storage.TypedStorage, torch.uint8, self.device,
                raw("handle"), self.storage_size_bytes, self.storage_offset_bytes, False,
                raw("ref_counter_handle"), self.ref_counter_offset, raw("event_handle"), self.event_sync_required)
        return rebuild_cuda_tensor, args


def _cuda_ipc_bucket_json(rebuild, args: tuple) -> _CudaIpcBucketJson:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (tensor_cls, size, stride, tensor_offset, _storage_cls, dtype, device, handle, storage_size_bytes,
     storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    if rebuild is not rebuild_cuda_tensor or tensor_cls is not torch.Tensor or dtype != torch.uint8 \
            or len(size) != 1 or tuple(stride) != (1,) or tensor_offset != 0 or requires_grad:
        raise ValueError("WeightHandle.to_json: a cuda_ipc bucket must be a 1-D uint8 CUDA tensor at offset 0")

    def b64(value: bytes | None) -> str | None:
        return None if value is None else base64.b64encode(value).decode()

    return _CudaIpcBucketJson(
        numel=int(size[0]), device=int(device), handle=b64(handle), storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes), ref_counter_handle=b64(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset), event_handle=b64(event_handle),
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


def plan_buckets(named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[TensorMeta], list[int]]:
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


def _views(buffers: list[torch.Tensor], metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    for m in metas:
        raw = buffers[m.bucket][m.offset : m.offset + m.nbytes]
        yield m.name, raw.view(_dtype(m.dtype)).view(m.shape)


def _pack(named: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], buffers: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_name, src), (_, dst) in zip(named, _views(buffers, metas)):
            dst.copy_(src.detach().reshape(dst.shape))


class SharedMemoryTransport:
    name = "shm"

    def __init__(self, prefix: str, bucket_mb: float = 64.0):
        # The publisher's pid in the name: two live jobs never share a segment, and a segment whose
        # publisher died (SIGKILL) can be recognised and freed.
        self.prefix = f"{prefix}_{os.getpid()}"
        self.job_prefix = prefix
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._owned: list[shared_memory.SharedMemory] = []
        self._attached: dict[str, mmap.mmap] = {}

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        named = [(n, t.detach().cpu()) for n, t in named_tensors]
        metas, sizes = plan_buckets(named, self.bucket_bytes)
        if [s.size for s in self._owned] != sizes:
            self._release_owned()
            self._owned = [self._create(f"{self.prefix}_w{i}", size) for i, size in enumerate(sizes)]
        buffers = [torch.frombuffer(seg.buf, dtype=torch.uint8, count=seg.size) for seg in self._owned]
        _pack(named, metas, buffers)
        del buffers  # a live view would keep the segment's buffer exported and block close()
        return WeightHandle(version, self.name, metas, [seg.name for seg in self._owned])

    def _create(self, name: str, size: int) -> shared_memory.SharedMemory:
        self._free_orphans()
        return shared_memory.SharedMemory(name=name, create=True, size=size)

    def _free_orphans(self) -> None:
        """Unlink this job's segments whose publisher process is gone (a run killed by SIGKILL)."""
        shm_dir = Path("/dev/shm")
        if not shm_dir.is_dir():
            return
        for path in shm_dir.glob(f"{self.job_prefix}_*_w*"):
            pid_text = path.name[len(self.job_prefix) + 1 :].split("_w")[0]
            if pid_text.isdigit() and not Path(f"/proc/{pid_text}").exists():
                path.unlink(missing_ok=True)

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        buffers = []
        for seg_name in handle.buckets:
            seg = self._attached.get(seg_name)
            if seg is None:
                seg = self._attach(seg_name)
                self._attached[seg_name] = seg
            buffers.append(torch.frombuffer(seg, dtype=torch.uint8, count=len(seg)))
        yield from _views(buffers, handle.metas)

    @staticmethod
    def _attach(seg_name: str) -> mmap.mmap:
        # Mapped directly rather than through SharedMemory, whose resource tracker would unlink
        # the publisher's segment when this process exits.
        name = seg_name.lstrip("/")
        if not SHM_SEGMENT_NAME.match(name):
            raise ValueError(f"shared-memory segment name {seg_name!r} is not one of this project's (slime_..._w<N>)")
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_NOFOLLOW)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)

    def _release_owned(self) -> None:
        for seg in self._owned:
            seg.close()
            seg.unlink()
        self._owned = []

    def close(self) -> None:
        self._release_owned()
        for seg in self._attached.values():
            try:
                seg.close()
            except BufferError:  # a caller still holds a view; the OS frees it at exit
                pass
        self._attached = {}


class CudaIpcTransport:
    """Learner and engines on one GPU: buckets stay on the device, engines map them by IPC handle."""

    name = "cuda_ipc"

    def __init__(self, bucket_mb: float = 512.0):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buffers: list[torch.Tensor] = []  # kept alive until the next publish: engines read them

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        named = [(n, t.detach()) for n, t in named_tensors]
        device = named[0][1].device
        if device.type != "cuda":
            raise ValueError(f"CudaIpcTransport needs CUDA tensors, got {device}")
        metas, sizes = plan_buckets(named, self.bucket_bytes)
        if [b.numel() for b in self._buffers] != sizes:
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        _pack(named, metas, self._buffers)
        torch.cuda.current_stream(device).synchronize()
        return WeightHandle(version, self.name, metas, [reduce_tensor(b) for b in self._buffers])

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        buffers = [rebuild(*args) for rebuild, args in handle.buckets]
        yield from _views(buffers, handle.metas)

    def close(self) -> None:
        self._buffers = []


class FileTransport:
    name = "file"

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.keep = keep

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        from safetensors.torch import save_file

        named = {n: t.detach().cpu().contiguous() for n, t in named_tensors}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"weights_v{version}.safetensors"
        save_file(named, str(path))
        for old in sorted(self.directory.glob("weights_v*.safetensors"), key=lambda p: p.stat().st_mtime)[: -self.keep]:
            old.unlink(missing_ok=True)
        metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), 0, 0, t.numel() * t.element_size()) for n, t in named.items()]
        return WeightHandle(version, self.name, metas, [str(path)])

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        yield from load_file(handle.buckets[0]).items()

    def close(self) -> None:
        pass


class BroadcastTransport:
    """One-to-many broadcast over a torch.distributed group: NCCL for CUDA tensors, gloo for CPU.

    A collective needs the sender and every receiver inside it at once, while the driver asks the
    learner to publish first and the engines to receive afterwards. So `publish` only packs the
    version into staging buckets (the learner may train on right after) and returns; a sender
    thread broadcasts it once all `num_receivers` receivers have asked for exactly that version
    (a counter in the group's TCPStore). A version nobody asked for is simply replaced by the next.

    Wire order per version: a header [version, number of buckets] (int64), then each bucket as one
    uint8 broadcast from rank 0. Receivers keep their buckets across versions (same sizes: no
    re-allocation) and yield views into them, like the shared-memory transport.
    """

    name = "broadcast"

    def __init__(
        self,
        bucket_mb: float = 256.0,
        *,
        num_receivers: int = 1,
        master_addr: str | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        timeout_s: float = 600.0,
    ):
        if num_receivers < 1:
            raise ValueError(f"BroadcastTransport: num_receivers must be >= 1, got {num_receivers}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.num_receivers = num_receivers
        self.master_addr = master_addr
        self.backend = backend  # None: nccl for CUDA tensors, gloo otherwise
        self.device = None if device is None else torch.device(device)  # receiver's bucket device
        self.timeout = timedelta(seconds=timeout_s)
        self._store = None
        self._group = None
        self._rank: int | None = None
        # sender state
        self._lock = threading.Lock()  # held while packing or sending the staged version
        self._staged: tuple[int, list[torch.Tensor]] | None = None
        self._sent_version: int | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # receiver state
        self._recv_buffers: list[torch.Tensor] = []

    # ---- sender (rank 0) ------------------------------------------------------------------------
    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        if self.error is not None:
            raise RuntimeError(f"BroadcastTransport: the sender thread failed: {self.error!r}") from self.error
        named = [(n, t.detach()) for n, t in named_tensors]
        device = named[0][1].device
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "gloo":
            device = torch.device("cpu")
        metas, sizes = plan_buckets(named, self.bucket_bytes)
        if self._store is None:
            self._start_sender()
        with self._lock:  # waits for a send in progress to finish before the buffers change
            buffers = self._staged[1] if self._staged is not None else []
            if [b.numel() for b in buffers] != sizes or (buffers and buffers[0].device != device):
                buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
            _pack(named, metas, buffers)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self._staged = (int(version), buffers)
        info = {
            "master_addr": self.master_addr,
            "master_port": self._store.port,
            "world_size": self.num_receivers + 1,
            "backend": backend,
            "sizes": sizes,
        }
        return WeightHandle(int(version), self.name, metas, [info])

    def _start_sender(self) -> None:
        import torch.distributed as dist

        if self.master_addr is None:
            self.master_addr = _node_ip()
        self._store = dist.TCPStore(self.master_addr, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._rank = 0
        self._thread = threading.Thread(target=self._serve, name="weights-broadcast", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                staged = self._staged
                if staged is None or staged[0] == self._sent_version:
                    time.sleep(0.002)
                    continue
                version = staged[0]
                try:  # every receiver asked for this version: the last one to ask sets the key
                    self._store.wait([f"go/{version}"], timedelta(milliseconds=100))
                except Exception:  # timed out: maybe a newer version got staged meanwhile
                    continue
                with self._lock:
                    if self._staged is None or self._staged[0] != version:
                        continue
                    buffers = self._staged[1]
                    if self._group is None:
                        self._group = _new_group(self._handle_backend(buffers), self._store, 0, self.num_receivers + 1, self.timeout)
                    header = torch.tensor([version, len(buffers)], dtype=torch.int64, device=buffers[0].device)
                    _broadcast(self._group, header)
                    for b in buffers:
                        _broadcast(self._group, b)
                    self._sent_version = version
        except BaseException as e:  # surfaced by the next publish
            self.error = e

    def _handle_backend(self, buffers: list[torch.Tensor]) -> str:
        return self.backend or ("nccl" if buffers[0].device.type == "cuda" else "gloo")

    # ---- receivers (ranks 1..num_receivers) -----------------------------------------------------
    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed as dist

        info = handle.buckets[0]
        world = int(info["world_size"])
        if self._group is None:
            self._store = dist.TCPStore(info["master_addr"], int(info["master_port"]), is_master=False, timeout=self.timeout)
            self._rank = int(self._store.add("rank", 1))
            if self._rank >= world:
                raise RuntimeError(
                    f"BroadcastTransport: receiver rank {self._rank} but the sender expects only {world - 1} "
                    "receivers (its num_receivers); every engine must be counted"
                )
        device = self.device or (torch.device("cuda", torch.cuda.current_device()) if info["backend"] == "nccl" else torch.device("cpu"))
        if self._store.add(f"want/{handle.version}", 1) == world - 1:
            self._store.set(f"go/{handle.version}", "1")
        if self._group is None:
            self._group = _new_group(info["backend"], self._store, self._rank, world, self.timeout)
        header = torch.zeros(2, dtype=torch.int64, device=device)
        _broadcast(self._group, header)
        version, n_buckets = (int(x) for x in header.tolist())
        if version != handle.version or n_buckets != len(info["sizes"]):
            raise RuntimeError(
                f"BroadcastTransport: expected version {handle.version} in {len(info['sizes'])} buckets, "
                f"the sender broadcast version {version} in {n_buckets}"
            )
        if [b.numel() for b in self._recv_buffers] != info["sizes"] or self._recv_buffers[0].device != device:
            self._recv_buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in info["sizes"]]
        for b in self._recv_buffers:
            _broadcast(self._group, b)
        yield from _views(self._recv_buffers, handle.metas)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._group = None
        self._store = None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def join_update_group(
    master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 600.0,
):
    """Join (rank 0: create) a weight-update group the way SGLang's `/init_weights_update_group`
    describes it: a TCP rendezvous at master_address:master_port, rank 0 the sender."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    return _new_group(backend, store, rank, world_size, timeout, prefix=f"{group_name}/")


def broadcast_from_rank0(group, tensor: torch.Tensor) -> None:
    _broadcast(group, tensor)


def _new_group(backend: str, store, rank: int, world_size: int, timeout: timedelta, prefix: str = "slime_weights"):
    """A process group of its own (not torch's default group, which a trainer may already use)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"BroadcastTransport: backend must be nccl or gloo, got {backend!r}")


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


WeightTransport = SharedMemoryTransport | CudaIpcTransport | FileTransport | BroadcastTransport


def make_transport(
    kind: str, *, prefix: str, directory: Path, bucket_mb: float, num_receivers: int = 1
) -> WeightTransport:
    if kind == "shm":
        return SharedMemoryTransport(prefix, bucket_mb)
    if kind == "cuda_ipc":
        return CudaIpcTransport(bucket_mb)
    if kind == "file":
        return FileTransport(directory)
    if kind == "broadcast":
        return BroadcastTransport(bucket_mb, num_receivers=num_receivers)
    raise ValueError(f"weights.transport={kind!r}: expected shm, cuda_ipc, file or broadcast")

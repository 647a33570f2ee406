"""The one-host transports: shared memory (CPU), CUDA IPC (one GPU) and files (any engine)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import torch

from slime.weights.handles import (
    SHM_SEGMENT_NAME,
    TensorMeta,
    WeightHandle,
    bucket_views,
    pack_buckets,
    plan_buckets,
    whole,
)


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


_PID_NAMESPACE = _pid_namespace()


class SharedMemoryTransport:
    name = "shm"

    def __init__(self, prefix: str, bucket_mb: float = 64.0):
        # The publisher's pid namespace and pid in the name: two live jobs never share a segment, and
        # a segment whose publisher died (SIGKILL) can be recognised and freed, by a process that
        # sees the same pids (containers sharing /dev/shm have pid namespaces of their own).
        self.prefix = f"{prefix}_{_PID_NAMESPACE}_{os.getpid()}"
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
        pack_buckets(named, metas, buffers)
        del buffers  # a live view would keep the segment's buffer exported and block close()
        return WeightHandle(version, self.name, metas, [seg.name for seg in self._owned])

    def _create(self, name: str, size: int) -> shared_memory.SharedMemory:
        self._free_orphans()
        return shared_memory.SharedMemory(name=name, create=True, size=size)

    def _free_orphans(self) -> None:
        """Unlink this user's segments (slime_<job>_<pid namespace>_<pid>_w<N>, any job) of this pid
        namespace whose publisher process is gone: a run killed by SIGKILL leaves its weights in
        /dev/shm, which every job's shared-memory transport on the machine needs."""
        shm_dir = Path("/dev/shm")
        if not shm_dir.is_dir():
            return
        for path in shm_dir.glob("slime_*_w*"):
            if not SHM_SEGMENT_NAME.match(path.name):
                continue
            namespace, pid_text = path.name.rsplit("_w", 1)[0].rsplit("_", 2)[-2:]
            try:
                mine = path.lstat().st_uid == os.getuid() and namespace == _PID_NAMESPACE
            except OSError:
                continue
            if mine and pid_text.isdigit() and not Path(f"/proc/{pid_text}").exists():
                path.unlink(missing_ok=True)

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        buffers = []
        for seg_name in handle.buckets:
            seg = self._attached.get(seg_name)
            if seg is None:
                seg = self._attach(seg_name)
                self._attached[seg_name] = seg
            buffers.append(torch.frombuffer(seg, dtype=torch.uint8, count=len(seg)))
        yield from bucket_views(buffers, handle.metas)

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
        pack_buckets(named, metas, self._buffers)
        torch.cuda.current_stream(device).synchronize()
        return WeightHandle(version, self.name, metas, [reduce_tensor(b) for b in self._buffers])

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        buffers = [rebuild(*args) for rebuild, args in handle.buckets]
        yield from bucket_views(buffers, handle.metas)

    def close(self) -> None:
        self._buffers = []


class FileTransport:
    name = "file"

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.keep = keep

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        from safetensors.torch import save_file

        named = {n: whole(t.detach()).cpu().contiguous() for n, t in named_tensors}  # one file: whole tensors
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"weights_v{version}.safetensors"
        save_file(named, str(path))
        for old in sorted(self.directory.glob("weights_v*.safetensors"), key=lambda p: p.stat().st_mtime)[: -self.keep]:
            old.unlink(missing_ok=True)
        metas = [
            TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), 0, 0, t.numel() * t.element_size())
            for n, t in named.items()
        ]
        return WeightHandle(version, self.name, metas, [str(path)])

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        yield from load_file(handle.buckets[0]).items()

    def close(self) -> None:
        pass


class InProcessTransport:
    """Learner and engines in one process (cluster.launcher=local): the handle holds the learner's
    own tensors, and each engine copies them into its parameters (across devices or dtypes if
    need be). Nothing is packed or copied on the way. The tensors are live: an engine must read a
    handle before the learner's next update (the loops push right after training; rollout.elastic,
    which hands an old handle to a worker that joins later, is refused with this transport)."""

    name = "inproc"

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightHandle:
        named = [(n, whole(t.detach())) for n, t in named_tensors]
        metas = [
            TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), 0, 0, t.numel() * t.element_size())
            for n, t in named
        ]
        return WeightHandle(version, self.name, metas, [named])

    def receive(self, handle: WeightHandle) -> Iterator[tuple[str, torch.Tensor]]:
        if handle.transport != self.name:
            raise ValueError(f"an inproc receiver got a {handle.transport} handle")
        yield from handle.buckets[0]

    def close(self) -> None:
        pass

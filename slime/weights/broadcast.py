"""The transport across processes and machines: one torch.distributed broadcast per bucket
(NCCL for CUDA tensors, gloo for CPU), and the SGLang-style weight-update group helpers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from slime.weights.handles import WeightHandle, bucket_views, pack_buckets, plan_buckets


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
            pack_buckets(named, metas, buffers)
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
                        self._group = _new_group(
                            self._handle_backend(buffers), self._store, 0, self.num_receivers + 1, self.timeout
                        )
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
            self._store = dist.TCPStore(
                info["master_addr"], int(info["master_port"]), is_master=False, timeout=self.timeout
            )
            self._rank = int(self._store.add("rank", 1))
            if self._rank >= world:
                raise RuntimeError(
                    f"BroadcastTransport: receiver rank {self._rank} but the sender expects only {world - 1} "
                    "receivers (its num_receivers); every engine must be counted"
                )
        device = self.device or (
            torch.device("cuda", torch.cuda.current_device()) if info["backend"] == "nccl" else torch.device("cpu")
        )
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
        yield from bucket_views(self._recv_buffers, handle.metas)

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
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 600.0,
):
    """Join (rank 0: create) a weight-update group the way SGLang's `/init_weights_update_group`
    describes it: a TCP rendezvous at master_address:master_port, rank 0 the sender."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
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

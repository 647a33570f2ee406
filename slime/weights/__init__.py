"""Weight transport from the learner to the rollout engines (docs/architecture.md, "Weight transport").

The learner `publish`es a version: tensors are packed into buckets of `bucket_mb` and a small,
picklable `WeightHandle` describes them. Each engine `receive`s the handle and gets
(name, tensor) pairs that it copies into its own parameters in place.

- SharedMemoryTransport: CPU, one host. Buckets are POSIX shared-memory segments that stay
  allocated across versions; the receiver's tensors are zero-copy views of them.
- CudaIpcTransport: learner and engine on the same GPU. Buckets are CUDA tensors whose IPC
  handles travel in the WeightHandle; the receiver maps the learner's memory, no host copy.
- FileTransport: safetensors files in a directory, the fallback any engine can read.
- InProcessTransport: learner and engines in one process (cluster.launcher=local); the handle
  holds the learner's tensors, which each engine copies into its own.
- BroadcastTransport: a torch.distributed group across processes or machines (NCCL for CUDA
  tensors, gloo for CPU tensors, same code); the learner is rank 0, each receiver takes the next
  free rank, and every bucket is one broadcast.

A handle of the shared-memory or CUDA IPC transport also has a JSON form (`WeightHandle.to_json`,
`WeightHandle.from_json`): what travels over HTTP to an SGLang-protocol server, never a pickle.
`from_json` accepts only plain values it has checked (dtype allow-list, shapes, byte counts,
segment names of this module's naming pattern, CUDA IPC fields as `reduce_tensor` makes them).
"""

from __future__ import annotations

from pathlib import Path

from slime.weights.broadcast import BroadcastTransport, broadcast_from_rank0, join_update_group
from slime.weights.handles import JSON_DTYPES, SHM_SEGMENT_NAME, TensorMeta, WeightHandle, plan_buckets
from slime.weights.transports import CudaIpcTransport, FileTransport, InProcessTransport, SharedMemoryTransport

__all__ = [
    "JSON_DTYPES",
    "SHM_SEGMENT_NAME",
    "BroadcastTransport",
    "CudaIpcTransport",
    "FileTransport",
    "InProcessTransport",
    "SharedMemoryTransport",
    "TensorMeta",
    "WeightHandle",
    "WeightTransport",
    "broadcast_from_rank0",
    "join_update_group",
    "make_transport",
    "plan_buckets",
]

WeightTransport = SharedMemoryTransport | CudaIpcTransport | FileTransport | BroadcastTransport | InProcessTransport


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
    if kind == "inproc":
        return InProcessTransport()
    raise ValueError(f"weights.transport={kind!r}: expected shm, cuda_ipc, file, broadcast or inproc")

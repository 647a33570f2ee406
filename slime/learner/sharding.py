"""What N learner ranks share: the torch.distributed group, FSDP2 sharding, the split of a batch's
rows over the ranks, exact sums across them, and sharded checkpoints (torch.distributed.checkpoint).

One group serves CPU and GPU: gloo over CPU tensors, NCCL over CUDA ones. FSDP2
(`fully_shard`) runs over gloo on CPU in torch >= 2.6 (2.13 here), so there is no DDP path: the
same sharded code runs everywhere, and a test box with two processes checks what a GPU node runs.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import socket
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from slime.errors import UserError

CHECKPOINT_DIR = "dcp"  # inside a learner checkpoint directory: the sharded state


def init_group(rank: int, world_size: int, master: str, device: torch.device, timeout_s: float) -> None:
    """Join the learner ranks' process group (master "host:port" is rank 0's). On CUDA the group has
    NCCL for CUDA tensors and gloo for CPU ones: `gather_json` gathers CPU tensors, which a group of
    NCCL alone refuses ("No backend type associated with device type cpu")."""
    backend = group_backend(device)
    dist.init_process_group(
        backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def group_backend(device: torch.device) -> str:
    """The learner group's backend spec for ranks on ``device``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def free_local_address() -> str:
    """A loopback host:port for a group of one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def shard(model: torch.nn.Module, mixed_precision: bool) -> None:
    """FSDP2 over the group: each decoder layer is one unit (its parameters gathered for its own
    forward and backward only), the rest (embeddings, final norm, head) the root unit. FSDP2
    averages the gradients over the ranks (gloo has no pre-scaled sum), so the learner scales each
    rank's loss by the number of ranks (see Learner._optimize)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    layer_types = set()
    for sub in model.modules():
        layer_types.update(getattr(sub, "_no_split_modules", None) or [])
    for sub in list(model.modules()):
        if type(sub).__name__ in layer_types:
            fully_shard(sub, **kwargs)
    fully_shard(model, **kwargs)


def reshard(model: torch.nn.Module) -> None:
    """Back to the sharded parameters after a forward without backward. FSDP2 keeps the root's
    parameters unsharded after a forward (the backward would need them at once): until then
    `named_parameters()` gives the unsharded compute copies, in bf16 under mixed precision."""
    from torch.distributed.fsdp import FSDPModule

    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: gathered from the ranks when it is sharded (a collective: every
    rank calls it for the same tensors in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard when sharded)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def clip_grad_norm(parameters, max_norm: float) -> float:
    """torch's clip over local or sharded gradients; the norm is the global one."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return float(full_tensor(norm))


def split_rows(lengths: list[int], world_size: int) -> list[list[int]]:
    """Positions 0..len-1 dealt to the ranks by token count, not by sequence count: longest first,
    each to the rank with the fewest tokens so far (ties: the lowest rank). Every rank computes the
    same split from the same lengths, so nobody needs to be told its share."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for pos in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(pos)
        loads[rank] += lengths[pos]
    return [sorted(share) for share in shares]


def sum_across_ranks(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, src=0)
    return t


def gather_json(obj) -> list:
    """Every rank's JSON-able `obj`, in rank order. JSON through a byte tensor, not
    all_gather_object's pickle: nothing a rank receives can run code."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded)
    return [json.loads(bytes(p[: int(s.item())].tolist())) for p, s in zip(parts, sizes)]


# ---- sharded checkpoints -------------------------------------------------------------------------
def _training_state(model, optim, critic, critic_optim, trainable_only: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # trainable_only (LoRA): the policy's adapters only; the frozen base is not written.
    policy_sd, optim_sd = get_state_dict(model, optim, options=_policy_options(trainable_only))
    # The RNG orders the minibatches (rank 0's order is every rank's): a resumed run goes on with it.
    state = {"policy": policy_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(critic, critic_optim)
    return state


class CheckpointError(UserError, RuntimeError):
    """A sharded checkpoint could not be written or read; names each rank's cause."""

    hint = "resume=auto takes the newest complete checkpoint of output_dir; resume=PATH a given one (docs/learner.md)"


def _checkpoint_call(what: str, path: Path, fn) -> None:
    # torch.distributed.checkpoint raises CheckpointException, a BaseException: `except Exception`
    # (the job's restart, pytest.raises(Exception)) would miss it. An Exception naming each cause.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except CheckpointException as exc:
        causes = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items())
        raise CheckpointError(f"{what} {path}: {causes}") from None


def _policy_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def save_sharded(directory: Path, model, optim, critic=None, critic_optim=None, trainable_only: bool = False) -> None:
    """Each rank writes its own shards (model, critic and their AdamW state); any number of ranks,
    sharded or not, can load them (load_sharded). trainable_only: the policy's trainable parameters
    (LoRA's adapters), not its frozen ones."""
    import torch.distributed.checkpoint as dcp

    path = directory / CHECKPOINT_DIR
    # An optimizer that never stepped (every update so far had a zero or non-finite gradient, or
    # the critic's warmup froze the policy) but holds gradients is saved with no state at all, and
    # the resume then asks for keys that are not there; without gradients its state is initialised.
    for o in (optim, critic_optim):
        if o is not None:
            o.zero_grad(set_to_none=True)
    state = _training_state(model, optim, critic, critic_optim, trainable_only)
    _checkpoint_call("cannot write", path, lambda: dcp.save(state, checkpoint_id=str(path)))


def load_sharded(directory: Path, model, optim, critic=None, critic_optim=None, trainable_only: bool = False) -> None:
    """The state save_sharded wrote, resharded to this learner's ranks (or to one unsharded process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = directory / CHECKPOINT_DIR
    state = _training_state(model, optim, critic, critic_optim, trainable_only)
    reader = _MetadataCheckedReader(str(path))
    # Every key asked for must be in the checkpoint (dcp.load): with trainable_only, every adapter.
    _checkpoint_call("cannot load", path, lambda: dcp.load(state, checkpoint_id=str(path), storage_reader=reader))
    set_state_dict(
        model,
        optim,
        model_state_dict=state["policy"],
        optim_state_dict=state["optim"],
        options=_policy_options(trainable_only),
    )
    torch.set_rng_state(state["rng"])
    if critic is not None and "critic" in state:
        set_state_dict(critic, critic_optim, model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])


def load_policy_shards(directory: Path, model) -> None:
    """Only the policy of a sharded checkpoint, into one plain (unsharded) model in this process,
    without a process group: what `slime export` and `slime eval` read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = directory / CHECKPOINT_DIR
    state = {"policy": get_model_state_dict(model)}
    reader = _MetadataCheckedReader(str(path))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        _checkpoint_call("cannot load", path, lambda: dcp.load(state, checkpoint_id=str(path), storage_reader=reader))
    set_model_state_dict(model, state["policy"])


def load_full(model, optim, model_state: dict, optim_state: dict | None) -> None:
    """A whole (unsharded) model and torch optimizer state dict, e.g. from a 1-rank checkpoint,
    into this rank's shards. The optimizer state's parameter indices follow named_parameters()
    (those that require grad: the optimizer holds only them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)  # a partial state (LoRA) leaves the rest as is
    if optim_state is None:
        return
    names = [name for name, p in model.named_parameters() if p.requires_grad]  # the optimizer's parameters
    by_name = {
        "state": {names[int(i)]: s for i, s in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optim, by_name, options=options)


class _SafeMetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint stores its index (.metadata) as a pickle. A crafted checkpoint
    must not run code (or anything else: open a URL, start a process) when loaded, so only the
    index's own types, named one by one, and torch's plain value types are resolved; anything else
    is refused with the name it asked for."""

    _TORCH_VALUES = {"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8"}
    _TORCH_VALUES |= {"bool", "strided", "contiguous_format", "preserve_format", "channels_last", "device"}
    # The index's own types by name, not whole modules: other classes of torch.distributed.checkpoint
    # have constructors with side effects (FsspecReader opened an ftp:// URL while the index loaded).
    _INDEX_TYPES = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    _PLAIN = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),  # the checkpoint's own path, in its storage metadata
        ("pathlib", "PurePosixPath"),
        ("torch.serialization", "_get_layout"),  # a layout looked up by its name
    }

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member_by_name
        # Exact names only: a dotted name (pickle protocol >= 4) would walk attributes from them.
        if (module, name) in self._INDEX_TYPES or (module, name) in self._PLAIN:
            return super().find_class(module, name)
        if module == "torch" and name in self._TORCH_VALUES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which a checkpoint never holds")


def _enum_member_by_name(cls, name):
    """The one use of getattr a checkpoint index has: an Enum member pickled by its name,
    getattr(EnumClass, "MEMBER"). Python 3.11.2 (Debian 12's python3) pickles every Enum member
    this way, 3.11.7 by value. The class itself came through find_class."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    target = cls.__name__ if isinstance(cls, type) else f"a {type(cls).__name__}"
    raise pickle.UnpicklingError(
        f"checkpoint index asks for getattr({target}, {str(name)[:80]!r}), which is not an Enum member"
    )


class _MetadataCheckedReader:  # built lazily: importing torch.distributed.checkpoint is slow
    def __new__(cls, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        class Reader(FileSystemReader):
            def read_metadata(self, *args, **kwargs) -> Metadata:
                rank = kwargs.get("rank")
                with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                    metadata = _SafeMetadataUnpickler(io.BytesIO(f.read())).load()
                if not isinstance(metadata, Metadata):
                    raise pickle.UnpicklingError(f"checkpoint index is a {type(metadata).__name__}, not Metadata")
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return Reader(path)

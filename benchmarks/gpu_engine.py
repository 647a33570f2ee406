"""The built-in engine on one GPU: decode ms per step against the GPU's own kernel time and the HBM
roofline, CUDA graphs on against off, and against `model.generate`.

    python benchmarks/gpu_engine.py           # CUDA, bf16 (under 5 minutes on an H200)
    python benchmarks/gpu_engine.py --quick   # tiny shapes; on CPU it checks the script itself
    python benchmarks/gpu_engine.py --smoke   # tiny shapes, fewest steps; exit 1 if a part fails (CI)

Shapes, random init from configs (nothing downloaded):
- dense: Llama-3-8B's layer shape (hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocabulary
  128256), 8 of its 32 layers: 2.8B parameters;
- moe: Qwen3-30B-A3B's (hidden 2048, 128 experts of width 768, top-8, 32 heads, 4 KV heads,
  vocabulary 151936), 12 of its 48 layers: 8.1B parameters;
- mixtral: Mixtral's routing (8 experts, top-2) at hidden 2048, 12 layers: which forward the
  engine's start check takes in bf16.

Per shape and batch: decode ms per step with graphs on and off, alternating (on, off, on, off,
...), `--repeats` runs each of 32 timed steps after 8 warm-up steps (64-token prompts, greedy,
EOS off), each step as the engine runs it: forward, sampling, the one copy to the host, the
bookkeeping. The GPU's own time per step: the kernel durations summed by torch's profiler over the
same static step run eagerly (also the launches per step), and one graph replay timed with CUDA
events. The HBM roofline: the bytes a decode step must read (every weight once, the embedding
table excepted; an MoE layer reads the experts its rows choose, E * (1 - (1 - k/E)^rows) of them
on average) over the copy bandwidth measured here. Against `model.generate` as users get it (same
prompts, `--new-tokens` greedy tokens, batch 1 and 64, prefill included on both sides).
Correctness: the engine's logprobs of its own greedy tokens against the model's forward (the probe
check's bf16 tolerance, 5e-2), graphs on and off, and the share of greedy tokens the two agree on.

Needs torch, transformers and pydantic only (no Ray, no Redis), so the checkout and a few wheels
reach an air-gapped GPU node. Prints a table, then LAST one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.spread import mean_sd  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402

PROBE_TOLERANCE = 5e-2  # the weight probe's tolerance in bf16 (JobConfig.weight_check_tolerance)
SHAPES = {
    "dense": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
        ),
    ),
    "moe": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
        ),
    ),
}
QUICK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, vocab_size=512)
_ids = itertools.count()


class Why(logging.Handler):
    """The engine's log line on which forward it took, and why."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build(name: str, device: str, dtype: torch.dtype, quick: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    family, shape = SHAPES[name]
    settings = {**shape, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    if quick:
        settings.update({k: v for k, v in QUICK.items() if k in settings or k == "vocab_size"})
        settings.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        for experts in ("num_experts", "num_local_experts"):
            if experts in settings:
                settings[experts] = 8
    config = AutoConfig.for_model(family, **settings)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in its own precision, on the device: seconds
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    n = (1 << 30) if device.startswith("cuda") else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    sync(device)
    return 2 * n * 20 / (time.perf_counter() - t0)


def step_bytes(model: torch.nn.Module, rows: int) -> int:
    """Bytes of weights one decode step of ``rows`` rows must read."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    embed = model.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p is embed:
            continue
        size = p.numel() * p.element_size()
        if experts and re.search(r"\.experts\.", name):
            size *= 1 - (1 - top_k / experts) ** rows  # the expected share of experts chosen
        total += size
    return int(total)


def make_prompts(vocab: int, rows: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g).tolist()


def add(engine: BuiltinEngine, prompts: list[list[int]], new_tokens: int) -> list[str]:
    ids = []
    for p in prompts:
        rid = f"q{next(_ids)}"
        engine.add_request(
            GenerationRequest(rid, p, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=[]))
        )
        ids.append(rid)
    return ids


def decode_ms(engine: BuiltinEngine, prompts: list[list[int]], device: str, warm: int = 8, timed: int = 32) -> float:
    """ms per decode step of ``len(prompts)`` rows, steady state (prefill and warm-up not timed)."""
    add(engine, prompts, 2 + warm + timed)
    engine.step()  # prefill
    for _ in range(warm):
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(timed):
        engine.step()
    sync(device)
    seconds = time.perf_counter() - t0
    engine.abort()
    return seconds / timed * 1000


def kernel_ms(engine: BuiltinEngine, prompts: list[list[int]], device: str, steps: int = 8) -> tuple[float, float]:
    """(GPU kernel ms per step, kernel launches per step) of eager static decode steps, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    add(engine, prompts, 2 + 3 + steps)
    for _ in range(4):
        engine.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    engine.abort()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / steps / 1000, len(kernels) / steps


def replay_ms(engine: BuiltinEngine, rows: int) -> float | None:
    """One captured decode graph of ``rows`` rows, replayed back to back, timed with CUDA events."""
    static = engine._batch.static_decode
    graphs = [s for (r, _), s in static.shapes.items() if r == rows and s.graph is not None]
    if not graphs:
        return None
    graph = graphs[0].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def generate_tps(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(device)
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - t0)


def engine_tps(engine: BuiltinEngine, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    reqs = [
        GenerationRequest(
            f"g{next(_ids)}", p, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=[])
        )
        for p in prompts
    ]
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    sync(device)
    return sum(len(c.token_ids) for c in out.values()) / (time.perf_counter() - t0)


def agreement(graphs: BuiltinEngine, eager: BuiltinEngine, vocab: int) -> dict:
    """Greedy tokens of both engines on 4 prompts, and their logprobs against the model's forward."""
    prompts = make_prompts(vocab, 4, 32, seed=5)
    outs = []
    for engine in (graphs, eager):
        ids = add(engine, prompts, 32)
        chunks: dict[str, list] = {rid: [[], []] for rid in ids}
        while engine.has_unfinished():
            for c in engine.step():
                chunks[c.request_id][0] += c.token_ids
                chunks[c.request_id][1] += c.logprobs
        outs.append([chunks[rid] for rid in ids])
    worst = {}
    for arm, engine, rows in (("graphs", graphs, outs[0]), ("eager", eager, outs[1])):
        worst[arm] = max(
            max(abs(a - b) for a, b in zip(lps, engine.score_logprobs(p, toks)))
            for p, (toks, lps) in zip(prompts, rows)
        )
    same = total = 0
    same_tokens = 0.0  # graphs against eager: the logprobs of the tokens both chose in the same context
    for (a, lp_a), (b, lp_b) in zip(outs[0], outs[1]):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same, total = same + prefix, total + len(a)
        same_tokens = max([same_tokens] + [abs(x - y) for x, y in zip(lp_a[:prefix], lp_b[:prefix])])
    return {
        "logprob_max_diff": worst,
        "graphs_vs_eager_logprob_max_diff": same_tokens,
        "greedy_prefix_agreement": same / total,
    }


def graph_checks(device: str) -> dict:
    """float32, tiny models of eleven families: greedy tokens with graphs equal those without, before
    and after an in-place weight update (the captured graphs must read the new weights). Four read
    their attention off the model (`FastDecoder.fit_attention`): RoPE on interleaved pairs (GLM),
    layers without RoPE (EXAONE 4), q/k norms after the rotation (HunYuan), kv heads per layer and
    scaled values (MiMo-V2-Flash); the last two are GPT-2-style trees (`decoder_tree`): a learned
    position table (GPT-2), a fused per-head q/k/v and the MLP beside the attention (GPT-NeoX), a
    fused q/k/v gathered in the order its heads' outputs were found in (CodeGen)."""
    from benchmarks.families import tiny_model

    out = {}
    families = ("qwen3_moe", "llama", "gemma2", "gpt_oss", "deepseek_v3")
    for family in (*families, "glm", "exaone4", "hunyuan_v1_dense", "mimo_v2_flash", "gpt2", "gpt_neox", "codegen"):
        a, b = (tiny_model(family, 97, seed=s).to(device) for s in (0, 1))
        engines = [BuiltinEngine(a, device=device, max_running_requests=16, cuda_graphs=g) for g in (True, False)]
        same = []
        for version in (0, 1):
            if version:  # both engines share the model: one update serves both
                engines[0].update_weights(1, list(b.state_dict().items()))
            prompts = [p[: 3 + 2 * i] for i, p in enumerate(make_prompts(97, 12, 30, seed=version))]
            tokens = []
            for engine in engines:
                reqs = [
                    GenerationRequest(f"c{next(_ids)}", p, SamplingParams(0.0, 1.0, 0, 40 + i, []))
                    for i, p in enumerate(prompts)
                ]
                got = engine.generate(reqs)
                tokens.append([got[r.request_id].token_ids for r in reqs])
            same.append(tokens[0] == tokens[1])
        health = engines[0].health()
        out[family] = {
            "forward": health["forward"],
            "graphs": health["cuda_graphs"],
            "captured": health.get("cuda_graphs_captured", 0),
            "replays": health.get("cuda_graph_replays", 0),
            "failed": health.get("cuda_graphs_failed"),
            "greedy_equal": same[0],
            "greedy_equal_after_update": same[1],
        }
    return out


def bench_shape(name: str, a: argparse.Namespace, bandwidth: float) -> dict:
    device, dtype = a.device, getattr(torch, a.dtype)
    cuda = device.startswith("cuda")
    why = Why()
    logging.getLogger("slime.engines").setLevel(logging.INFO)
    logging.getLogger("slime.engines").addHandler(why)
    model = build(name, device, dtype, a.quick)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    rows_max = max(a.batches)
    t0 = time.perf_counter()
    graphs = BuiltinEngine(model, device=device, max_running_requests=rows_max, cuda_graphs=True)
    start_check_s = time.perf_counter() - t0
    eager = BuiltinEngine(model, device=device, max_running_requests=rows_max, cuda_graphs=False)
    logging.getLogger("slime.engines").removeHandler(why)
    out: dict = {
        "params": params,
        "forward": graphs.health()["forward"],
        "why": why.lines[-1] if why.lines else "",
        "start_check_s": round(start_check_s, 2),
    }
    if name == "mixtral":  # only which forward bf16 takes, and one batch's step
        out["decode_ms_b16"] = {"graphs": decode_ms(graphs, make_prompts(vocab, 16), device)}
        out["decode_ms_b16"]["eager"] = decode_ms(eager, make_prompts(vocab, 16), device)
        return out
    runs: dict[str, dict[int, list[float]]] = {"graphs": {}, "eager": {}}
    for batch in a.batches:
        prompts = make_prompts(vocab, batch)
        decode_ms(graphs, prompts, device)  # first use: captures this batch's graph
        for _ in range(a.repeats):
            for arm, engine in (("graphs", graphs), ("eager", eager)):
                runs[arm].setdefault(batch, []).append(decode_ms(engine, prompts, device))
    out["decode_ms"] = {arm: {b: mean_sd(v) for b, v in per.items()} for arm, per in runs.items()}
    out["health"] = {k: v for k, v in graphs.health().items() if "graph" in k or k == "static_decode"}
    out["roofline_ms"] = {b: step_bytes(model, b) / bandwidth * 1000 for b in a.batches}
    if cuda:
        static_eager = BuiltinEngine(model, device=device, max_running_requests=rows_max, cuda_graphs=True)
        static_eager._batch.static_decode.capture = False  # the graph's kernels, launched one by one
        out["kernel_ms"], out["launches_per_step"], out["replay_ms"] = {}, {}, {}
        for batch in (1, 64):
            if batch in a.batches:
                ms, launches = kernel_ms(static_eager, make_prompts(vocab, batch), device)
                out["kernel_ms"][batch], out["launches_per_step"][batch] = ms, launches
                decode_ms(graphs, make_prompts(vocab, batch), device)  # its graph again (a larger batch grew the cache)
                out["replay_ms"][batch] = replay_ms(graphs, batch)
        del static_eager
    gen: dict[str, dict[int, list[float]]] = {"engine": {}, "generate": {}}
    for batch in (1, 64):
        prompts = make_prompts(vocab, batch, seed=1)
        engine_tps(graphs, prompts[:1], 4, device)  # warm-up
        generate_tps(model, prompts[:1], 4, device)
        for _ in range(a.gen_repeats):
            gen["engine"].setdefault(batch, []).append(engine_tps(graphs, prompts, a.new_tokens, device))
            gen["generate"].setdefault(batch, []).append(generate_tps(model, prompts, a.new_tokens, device))
    out["tokens_per_s"] = {arm: {b: mean_sd(v) for b, v in per.items()} for arm, per in gen.items()}
    out["correctness"] = agreement(graphs, eager, vocab)
    del graphs, eager, model
    if cuda:
        torch.cuda.empty_cache()
    return out


def _plain(x: object) -> object:
    return str(x)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(result: dict) -> None:
    for name, r in result["shapes"].items():
        print(f"\n== {name}: {r['params'] / 1e9:.2f} B params, forward {r['forward']} ({r['why'][:140]})")
        if "decode_ms" not in r:
            print(f"   decode ms/step at 16 rows: {r['decode_ms_b16']}")
            continue
        print(
            f"{'rows':>5} {'graphs ms':>10} {'eager ms':>10} {'on/off':>7} {'kernels ms':>10} {'replay ms':>9} "
            f"{'step/kern':>9} {'roofline ms':>11} {'of roofline':>11}"
        )
        for b in r["decode_ms"]["graphs"]:
            g, e = r["decode_ms"]["graphs"][b][0], r["decode_ms"]["eager"][b][0]
            k = r.get("kernel_ms", {}).get(b)
            rep = r.get("replay_ms", {}).get(b)
            roof = r["roofline_ms"][b]
            print(
                f"{b:>5} {g:>10.2f} {e:>10.2f} {e / g:>6.2f}x {_num(k):>10} {_num(rep):>9} "
                f"{'-' if k is None else f'{g / k:.2f}x':>9} {roof:>11.2f} {roof / g:>10.0%}"
            )
        for b in r["tokens_per_s"]["engine"]:
            eng, gen = r["tokens_per_s"]["engine"][b][0], r["tokens_per_s"]["generate"][b][0]
            print(f"   batch {b}: engine {eng:,.0f} tok/s, generate {gen:,.0f} tok/s: {eng / gen:.2f}x")
        c = r["correctness"]
        print(
            f"   logprob vs forward, max |diff|: {c['logprob_max_diff']}; graphs vs eager on the same tokens "
            f"{c['graphs_vs_eager_logprob_max_diff']:.3g}; greedy agreement {c['greedy_prefix_agreement']:.0%}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script)")
    ap.add_argument("--shapes", default="dense,moe,mixtral")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen-repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-checks", action="store_true", help="skip the float32 graph checks")
    ap.add_argument("--out", default=None, help="also write the JSON here after each part")
    ap.add_argument(
        "--smoke", action="store_true", help="--quick at the fewest batches and steps; exit 1 if a part fails"
    )
    a = ap.parse_args()
    if a.smoke:
        a.quick, a.batches, a.repeats, a.gen_repeats, a.new_tokens = True, "1,2", 1, 1, 4
    cuda = a.device.startswith("cuda")
    if not cuda and not a.quick:  # billions of parameters on CPU would run for hours
        print(f"gpu_engine: no CUDA device ({a.device}): running --quick (tiny shapes), a check of the script")
        a.quick = True
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.batches = [int(b) for b in a.batches.split(",")]
    started = time.perf_counter()
    bandwidth = copy_bandwidth(a.device)
    import transformers

    result: dict = {
        "benchmark": "gpu_engine",
        **({"smoke": True} if a.smoke else {}),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": a.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "shapes": {},
    }
    steps = [(name, lambda name=name: bench_shape(name, a, bandwidth)) for name in a.shapes.split(",")]
    if not a.no_checks:  # last: a capture that fails there must not cost the figures above
        steps.append(("float32_graph_checks", lambda: graph_checks(a.device)))
    for name, run in steps:
        t0 = time.perf_counter()
        try:
            value = run()
        except Exception as exc:  # one part's failure is reported; the others still run
            value = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            traceback.print_exc()
        if name == "float32_graph_checks":
            result[name] = value
        else:
            result["shapes"][name] = value
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        if a.out:  # what is done so far, should a time limit cut the run
            Path(a.out).write_text(json.dumps(result, default=_plain))
    result["total_s"] = round(time.perf_counter() - started, 1)
    print(
        f"device {result['device']}, {a.dtype}, copy {result['copy_bandwidth_gb_per_s']} GB/s, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    try:
        table({"shapes": {k: v for k, v in result["shapes"].items() if "error" not in v}})
    except Exception as exc:  # the JSON line below carries every figure all the same
        print(f"table: {type(exc).__name__}: {exc}", file=sys.stderr)
    print("float32 graph checks:", json.dumps(result.get("float32_graph_checks"), default=_plain))
    print(json.dumps(result, default=_plain))
    failed = [
        k
        for k, v in [*result["shapes"].items(), ("float32_graph_checks", result.get("float32_graph_checks"))]
        if isinstance(v, dict) and "error" in v
    ]
    if a.smoke and failed:  # a check of the script: a part that failed fails it
        print(f"gpu_engine --smoke: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

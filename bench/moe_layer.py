"""One mixture-of-experts layer at real shapes on one GPU: prefill's fused experts against torch's grouped_mm, prefill's
Triton grouped GEMM and the per-expert loop (one device command, ~3-5 min on the H200; issue 37).

    python bench/moe_layer.py --out $OUT/moe-layer.json                     # every shape, slices of 4,096 and 16,384
    python bench/moe_layer.py --shapes qwen3-30b-a3b --tokens 16384 --out $OUT/moe-layer.json
    python bench/moe_layer.py --device cpu --shapes tiny --tokens 64 --repeats 2 --out /tmp/moe-layer.json  # a CPU try
    TRITON_INTERPRET=1 python bench/moe_layer.py --device cpu --shapes tiny,tiny-gpt-oss --tokens 64 --float16 \
        --out /tmp/l.json

Shapes (hidden, experts, top-k, moe_intermediate): Qwen3-30B-A3B (2048, 128, 8, 768), Qwen3-235B-A22B (4096, 128, 8,
1536), Mixtral-8x7B (4096, 8, 2, 14336), DeepSeek-V3 (7168, 256, 8, 2048), Moonlight-16B-A3B (2048, 64, 6, 1408),
Qwen1.5-MoE-A2.7B (2048, 60, 4, 1408), GLM-4.5-Air (4096, 128, 8, 1408), gpt-oss-20b (2880, 32, 4, 2880) and
gpt-oss-120b (2880, 128, 4, 2880). The math is Qwen3-MoE's for the others' shapes (softmax router, top-k
renormalised, SwiGLU experts without biases: the shapes decide the speed) and gpt-oss's for its own (its router's
top-k softmax and bias, its experts' [experts, in, out] layout, biases and clamped SwiGLU). Weights random, bf16, std
1/sqrt(fan-in), a router whose logits are ~N(0, 1), biases of std 0.1; the tokens random too.

Per shape and slice (tokens a moe_block call holds: the default plan's is 16,384):
  check    prefill.check_experts on every candidate at this shape (8 experts, uneven routing): passed or why not; each
           passing one's layer output against the first's (relative) and against itself run again (bits)
  layer    moe_block (norm, routing, experts) per candidate: the median ms of --repeats calls (CUDA events) after a
           warm-up, active TFLOP/s (router and k experts: 2 T E H + 6 T k H I) and peak device memory above the inputs
  experts  the same after routing (what the candidates differ in), and one dense GEMM pair on the same rows (the rate
           a grouped GEMM could at best reach)
  routing  the run's routing (the fused router, route_triton, with Triton's kernels) and route's chain, each alone
           after the norm (router GEMM, softmax, top-k, sort, cast): median ms, the same experts or not, weights of
           other bits, the fused router's start-up check (route_checks) at this shape
  split    each step alone, median ms: routing (norm and the run's routing); the fused experts' alignment,
           gate+up GEMM (with SiLU·up, gpt-oss's: with the biases and its activation), down GEMM (with the routing
           weight, gpt-oss's bias) and sum; a grouped GEMM's sort (expert_rows, pair_rows), gather, gate+up GEMM,
           activation, down GEMM, combination and (gpt-oss) the biases' gathers and adds
The whole record as JSON to --out, a table last: docs/performance.md's before (grouped_mm) and after (fused) split.
"""
import argparse
import dataclasses
import json
import math
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402

SHAPES = {  # (hidden, experts, top-k, moe_intermediate) of each model's MoE layers (their config.json)
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "qwen3-235b-a22b": (4096, 128, 8, 1536),
    "mixtral-8x7b": (4096, 8, 2, 14336),
    "deepseek-v3": (7168, 256, 8, 2048),
    "moonlight-16b-a3b": (2048, 64, 6, 1408),  # DeepSeek's sigmoid router; routed here by softmax (same shapes)
    "qwen1.5-moe-a2.7b": (2048, 60, 4, 1408),
    "glm-4.5-air": (4096, 128, 8, 1408),
    "gpt-oss-20b": (2880, 32, 4, 2880),
    "gpt-oss-120b": (2880, 128, 4, 2880),
    "tiny": (64, 8, 2, 32),  # a CPU try
    "tiny-gpt-oss": (64, 8, 2, 32),
}
GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss")  # the shapes run with gpt-oss's math


def log(msg):
    print(f"moe_layer: {msg}", file=sys.stderr, flush=True)


def shared_options(ap, out):
    """Adds the options this script and bench/tune_fused_moe.py share to ap."""
    ap.add_argument("--out", required=True, help=out)
    ap.add_argument("--shapes", default=",".join(name for name in SHAPES if not name.startswith("tiny")),
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls of each step (their median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", help="the commit measured (recorded as given)")
    ap.add_argument("--float16", action="store_true", help="the layers in float16: a CPU try of the fused experts "
                    "under TRITON_INTERPRET=1 (the interpreter multiplies bf16 tiles as raw integers)")


def shape_config(name):
    # the ModelConfig fields that moe_block, the routing and the expert kernels' checks and picks read
    H, E, k, I = SHAPES[name]
    oss = name in GPT_OSS
    return types.SimpleNamespace(
        hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I, norm_topk_prob=not oss,
        rms_norm_eps=1e-5 if oss else 1e-6, norm_style=prefill.NORM_FLOAT32 if oss else prefill.NORM_CAST,
        router=prefill.Router("topk_softmax", k) if oss else prefill.Router("softmax", k, True), fused_experts=oss,
        expert_activation=prefill.ClampedSwiGLU(1.702, 7.0) if oss else "silu", fp8_experts=False)


def layer_weights(cfg, device, seed=0):
    # a layer's feed-forward, random: the norm's weight near 1, the router's logits ~N(0, 1), experts of std
    # 1/sqrt(fan-in) (gpt-oss's: [experts, in, out] viewed [experts, out, in], with biases, as layer_views has them);
    # each tensor made in bf16 straight away (DeepSeek-V3's experts are 22.5 GB)
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def randn(*shape, std=1.0, mean=0.0):
        t = torch.empty(shape, dtype=prefill.DTYPE, device=device)
        for part in t.view(-1, shape[-1]).split(1 << 16):  # float32 temporaries of 2^16 rows at a time
            part.copy_(torch.randn(part.shape, generator=gen, device=device) * std + mean)
        return t
    w = prefill.LayerWeights(mlp_norm=randn(H, std=0.1, mean=1.0), router=randn(E, H, std=H ** -0.5))
    if not cfg.fused_experts:
        return dataclasses.replace(w, gate_up=randn(E, 2 * I, H, std=H ** -0.5), down=randn(E, H, I, std=I ** -0.5))
    return dataclasses.replace(w, router_bias=randn(E, std=0.1), gate_up=randn(E, H, 2 * I, std=H ** -0.5).transpose(
        1, 2), gate_up_bias=randn(E, 2 * I, std=0.1), down=randn(E, I, H, std=I ** -0.5).transpose(1, 2),
        down_bias=randn(E, H, std=0.1))


def timer(device, repeats):
    """ms(fn): the median of `repeats` calls after one warm-up; CUDA events on a GPU, the host clock elsewhere."""
    def ms(fn):
        fn()
        if device.type != "cuda":
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[(repeats - 1) // 2]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        for event in events[:-1]:
            event.record()
            fn()
        events[-1].record()
        events[-1].synchronize()
        return prefill.median_ms(events)
    return ms


def split(kind, tile, x, h, weights, chosen, w, kernels, ms, activation):
    """{step: ms} of one candidate's experts, each step alone on the previous step's output."""
    E, k = w.gate_up.shape[0], chosen.shape[1]
    if kind == "fused":
        block_m, up, down = tile
        ids, block_expert = prefill.align_experts(chosen, E, block_m)
        act = prefill.moe_gate_up(h, w.gate_up, ids, block_expert, k, block_m, up, w.gate_up_bias, activation)
        out = prefill.moe_down(act, w.down, ids, block_expert, weights.numel(), block_m, down, w.down_bias)
        return {"alignment": ms(lambda: prefill.align_experts(chosen, E, block_m)),
                "gate_up GEMM": ms(lambda: prefill.moe_gate_up(h, w.gate_up, ids, block_expert, k, block_m, up,
                                                               w.gate_up_bias, activation)),
                "down GEMM": ms(lambda: prefill.moe_down(act, w.down, ids, block_expert, weights.numel(), block_m, down,
                                                         w.down_bias)),
                "sum": ms(lambda: prefill.moe_sum(x, out, weights))}
    grouped = prefill.make_grouped(kind, tile)
    pairs, bounds = prefill.expert_rows(chosen, E)
    rows = h[pairs // k]
    gate_up = grouped(rows, w.gate_up, bounds)
    act = kernels.gated_act(gate_up, activation)
    out, row_of = grouped(act, w.down, bounds), prefill.pair_rows(pairs)
    steps = {"sort": ms(lambda: prefill.pair_rows(prefill.expert_rows(chosen, E)[0])),
             "gather": ms(lambda: h[pairs // k]),
             "gate_up GEMM": ms(lambda: grouped(rows, w.gate_up, bounds)),
             "activation": ms(lambda: kernels.gated_act(gate_up, activation)),
             "down GEMM": ms(lambda: grouped(act, w.down, bounds)),
             "combination": ms(lambda: kernels.combine(x, out, row_of, weights))}
    if w.gate_up_bias is not None:  # gpt-oss: each row's expert, its biases gathered and added (grouped_experts')
        steps["biases"] = ms(lambda: [prefill.biased(t, b, chosen.flatten()[pairs]) for t, b in (
            (gate_up, w.gate_up_bias), (out, w.down_bias))])
    return steps


def peak_bytes(fn, device):
    # device bytes fn allocates at its peak above what was allocated before it (None on the CPU)
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def routing(kernels, h, w, cfg, ms):
    # the run's routing (kernels.route: the fused router with Triton's kernels) against route's chain on this slice:
    # each alone after the norm, the same experts or not, the weights' bits that differ, route_checks' launches
    (weights, chosen), (want, want_chosen) = kernels.route(h, w, cfg.router), prefill.route(h, w, cfg.router)
    fused = kernels.route is prefill.route_triton and cfg.router.kind in prefill.FUSED_ROUTERS
    return {"kernel": "fused" if fused else "route", "route_ms": ms(lambda: prefill.route(h, w, cfg.router)),
            "kernel_ms": ms(lambda: kernels.route(h, w, cfg.router)), "same_experts": torch.equal(chosen, want_chosen),
            "weights_other_bits": int((weights.view(torch.int16) != want.view(torch.int16)).sum()),
            "weights": weights.numel(),
            "check": prefill.route_checks(h.device, cfg) if fused else []}


def measure(name, tokens, device, kernels, repeats):
    cfg = shape_config(name)
    H, E, k, I = SHAPES[name]
    ms = timer(device, repeats)
    candidates = list(dict.fromkeys(prefill.expert_candidates("auto", device, cfg, tokens)
                                    + prefill.expert_candidates("fused", device, cfg, tokens)))
    t = time.perf_counter()
    checked = prefill.check_experts(candidates, device, cfg)
    log(f"{name} {tokens}: checked {len(candidates)} candidates in {time.perf_counter() - t:.1f} s")
    w = layer_weights(cfg, device)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen, device=device).to(prefill.DTYPE)
    h = prefill.rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    router = cfg.router
    weights, chosen = prefill.route(h, w, router)
    counts = torch.bincount(chosen.flatten(), minlength=E).tolist()
    expert_flops, router_flops = 6 * tokens * k * H * I, 2 * tokens * E * H
    rows = h[torch.arange(tokens * k, device=device) // k]  # T k rows for the dense pair (their order is irrelevant)
    act = torch.randn(tokens * k, I, generator=gen, device=device).to(prefill.DTYPE)
    dense_ms = ms(lambda: (F.linear(rows, w.gate_up[0]), F.linear(act, w.down[0])))
    del rows, act
    record = {"shape": name, "hidden": H, "experts": E, "top_k": k, "moe_intermediate": I, "tokens": tokens,
              "rows_per_expert_min_mean_max": [min(counts), tokens * k / E, max(counts)],
              "experts_without_rows": sum(c == 0 for c in counts), "expert_tflop": expert_flops / 1e12,
              "dense_same_rows_ms": dense_ms, "dense_same_rows_tflops": expert_flops / dense_ms / 1e9,
              "routing_ms": ms(lambda: kernels.route(prefill.rms_norm(x, w.mlp_norm, cfg.rms_norm_eps), w, router)),
              "routing": routing(kernels, h, w, cfg, ms),
              "check": {e["name"]: e.get("reason") or f"passed, error {e['error']:.2e}" for e in checked},
              "candidates": {}}
    first = None
    for entry, (_, kind, tile) in zip(checked, candidates):
        experts = entry["experts"]
        if experts is None:
            continue
        out = x.clone()
        peak = peak_bytes(lambda: prefill.moe_block(out, w, cfg, tokens, kernels, experts), device)
        again = x.clone()
        prefill.moe_block(again, w, cfg, tokens, kernels, experts)
        first = out if first is None else first
        scratch = x.clone()
        layer = ms(lambda: prefill.moe_block(scratch, w, cfg, tokens, kernels, experts))
        after_routing = ms(lambda: experts(scratch, h, weights, chosen, w, kernels))
        record["candidates"][entry["name"]] = {
            "kind": kind, "tile": tile, "layer_ms": layer, "layer_tflops": (expert_flops + router_flops) / layer / 1e9,
            "experts_ms": after_routing, "experts_tflops": expert_flops / after_routing / 1e9,
            "peak_bytes": peak, "rel_err_to_first": rel_err(out.float() - x.float(), first.float() - x.float()),
            "same_bits_twice": torch.equal(out, again),
            "split_ms": split(kind, tile, scratch, h, weights, chosen, w, kernels, ms, cfg.expert_activation)}
        log(f"{name} {tokens} {entry['name']}: layer {layer:.3f} ms, experts {after_routing:.3f} ms")
        del out, again, scratch
    del w, x, h
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def table(records):
    lines = [f"{'shape':16} {'tokens':>6} {'candidate':34} {'layer ms':>9} {'TFLOP/s':>7} {'experts':>8} {'TFLOP/s':>7}"
             f"  split ms (routing | sort or alignment, gather | GEMMs | activation, biases | sum)"]
    for r in records:
        for name, c in sorted(r["candidates"].items(), key=lambda kv: kv[1]["layer_ms"]):
            s = c["split_ms"]
            steps = [r["routing_ms"], s.get("alignment", s.get("sort", 0)) + s.get("gather", 0),
                     s["gate_up GEMM"] + s["down GEMM"], s.get("activation", 0) + s.get("biases", 0),
                     s.get("sum", s.get("combination"))]
            lines.append(f"{r['shape']:16} {r['tokens']:>6} {name:34} {c['layer_ms']:>9.3f} {c['layer_tflops']:>7.0f} "
                         f"{c['experts_ms']:>8.3f} {c['experts_tflops']:>7.0f}  "
                         + " | ".join(f"{v:.3f}" for v in steps))
        lines.append(f"{r['shape']:16} {r['tokens']:>6} {'dense GEMMs on the same rows':34} {'':>9} {'':>7} "
                     f"{r['dense_same_rows_ms']:>8.3f} {r['dense_same_rows_tflops']:>7.0f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_options(ap, "the record (JSON)")
    ap.add_argument("--tokens", default="4096,16384", help="tokens a slice (moe_block call) holds, comma-separated")
    args = ap.parse_args(argv)
    if args.float16:
        prefill.DTYPE = torch.float16
    device, t0 = torch.device(args.device), time.perf_counter()
    kernels = prefill.TRITON_KERNELS if device.type == "cuda" and prefill.triton else prefill.TORCH_KERNELS
    records = [measure(name, int(tokens), device, kernels, args.repeats)
               for name in args.shapes.split(",") for tokens in args.tokens.split(",")]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": getattr(prefill.triton, "__version__", None),
              "commit": args.commit, "kernels": kernels.name, "wall_s": time.perf_counter() - t0, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for r in records:
        refused = {name: why for name, why in r["check"].items() if not why.startswith("passed")}
        if refused:
            print(f"{r['shape']} {r['tokens']}: refused " + "; ".join(f"{n}: {w}" for n, w in refused.items()))
        g = r["routing"]
        print(f"{r['shape']} {r['tokens']}: routing after the norm {g['route_ms']:.3f} ms by route, "
              f"{g['kernel_ms']:.3f} ms by the run's ({g['kernel']}); same experts {g['same_experts']}, weights of "
              f"other bits {g['weights_other_bits']} of {g['weights']}; its check "
              + ", ".join(f"{launch}: {error:.1e}" for _, launch, error in g["check"]))
        worst = max((c["rel_err_to_first"] for c in r["candidates"].values()), default=math.nan)
        print(f"{r['shape']} {r['tokens']}: rows an expert min/mean/max {r['rows_per_expert_min_mean_max']}, "
              f"worst layer output against the first candidate {worst:.1e}, same bits twice "
              f"{all(c['same_bits_twice'] for c in r['candidates'].values())}")
    print(table(records))
    print(f"wall {report['wall_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

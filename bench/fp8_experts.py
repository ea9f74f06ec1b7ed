"""The fused experts of a layer held in block-wise FP8: the layer's one-launch dequantization to bf16 then the bf16
fused experts (today's path), against the fused experts reading the FP8 weights and dequantizing each tile in their
GEMMs (fused_experts' FP8 variant; issue 37). One device command, ~2-3 min on the H200.

    python bench/fp8_experts.py --out $OUT/fp8-experts.json          # Qwen3-30B-A3B's and DeepSeek-V3's experts
    python bench/fp8_experts.py --shapes qwen3-30b-a3b --tokens 16384 --out $OUT/fp8-experts.json
    TRITON_INTERPRET=1 python bench/fp8_experts.py --device cpu --shapes tiny --tokens 64 --repeats 1 --float16 \\
        --out /tmp/fp8-experts.json                                   # a CPU try of the steps (no timing worth a look)

Per shape (hidden, experts, top-k, moe_intermediate: Qwen3-30B-A3B's 2048, 128, 8, 768 and DeepSeek-V3's 7168, 256, 8,
2048) and slice of T tokens (16,384: the default plan's): the experts' FP8 bytes as one held layout would keep them
(prefill.held_layout of two weights, gate_up [experts · 2 inter, hidden] and down [experts · hidden, inter], each
followed by its float32 scales, one per 128x128 block: each expert's gate and up grids stacked, as a checkpoint holds
them, inter being a multiple of 128), random: e4m3 values ~N(0, 64) clipped, each block's scale fan-in^-1/2 / 64 times a
random factor from 1 to 2. The same bytes feed both paths:
  (a) dequantize + bf16   prefill's layer dequantization (dequantize_layer_triton: one launch over prefill.fp8_layer's
                          tables of the two weights; the CPU: dequantize_layer) into a bf16 buffer, then fused_experts
                          on its [experts, N, K] views
  (b) FP8 in the GEMMs    fused_experts on the FP8 views and their scales (LayerWeights.gate_up_scales, down_scales)
Each in every tile of the shape's bf16 table (prefill.fused_tiles: what the start-up would offer) and of FP8_TILES (the
FP8 variant's own candidates): the median ms of --repeats calls by CUDA events after a warm-up that compiles it, each
step alone too (dequantization, gate+up GEMM, down GEMM), TFLOP/s of the experts (6 T k hidden inter), and (a) against
(b) in the same tile: the same bits (expected: the GEMMs multiply the same bf16 values in the same order) and the worst
row's relative difference (prefill.check_error; expected 0). A tile that does not run here (shared memory, TMA) is
recorded with its error. The routing is bench/moe_layer.py's (softmax top-k, renormalised) on random tokens.
The whole record as JSON to --out; a table last, and per shape which path is faster and by how much.
"""
import argparse
import json
import math
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402
from bench.moe_layer import SHAPES, timer  # noqa: E402

FP8_SHAPES = {name: SHAPES[name] for name in ("qwen3-30b-a3b", "deepseek-v3")}
FP8_SHAPES["tiny"] = (256, 8, 2, 128)  # a CPU try: two blocks of K in gate+up, one in down
# The FP8 variant's own candidates beside the bf16 table's (BLOCK_M, gate+up (BLOCK_N, BLOCK_K, GROUP_M, warps,
# stages, TMA), down): GROUP_M 16 (an expert's weight tiles reread from L2 by its blocks of rows, not from memory);
# BLOCK_K 128, a whole scale block (one scale load and half the k steps; gate+up in BLOCK_N 64: at 128 it took 255
# registers and spilled under Triton 3.6); the weights by pointers (registers straight into the conversion, no TMA
# copy to shared memory and back); BLOCK_M 64 on 4 warps. Each compiles for sm_90a to wgmma without spills under
# Triton 3.6 and 3.9 (128-255 registers, 58-165 KB of shared memory).
FP8_TILES = {
    "nvidia": [(128, (128, 64, 16, 8, 3, True), (256, 64, 16, 8, 3, True)),
               (128, (64, 128, 1, 8, 3, True), (128, 128, 1, 8, 3, True)),
               (128, (128, 64, 1, 8, 4, False), (128, 64, 1, 8, 4, False)),
               (64, (128, 64, 1, 4, 4, True), (128, 64, 1, 4, 4, True))],
    "cpu": [(32, (32, 64, 1, 4, 1, True), (64, 64, 1, 4, 1, True))],  # the interpreter: TMA, K tiles of 64
}


def log(msg):
    print(f"fp8_experts: {msg}", file=sys.stderr, flush=True)


def shape_config(name):
    H, E, k, I = FP8_SHAPES[name]
    return types.SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                                 router=prefill.Router("softmax", k, True), rms_norm_eps=1e-6)


def fp8_experts(cfg, device, seed=0):
    """(held bytes, FP8Layer, bf16 buffer it dequantizes into, FP8 LayerWeights, bf16 LayerWeights) of one layer's
    experts: held_layout's parts of gate_up and down, random (see the docstring), viewed as fused_experts reads them."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert I % prefill.FP8_BLOCK == 0, "gate and up grids stacked as one: inter a multiple of the block"
    shapes = {"gate_up": (E, 2 * I, H), "down": (E, H, I)}
    layout, numel = {}, 0
    for name, shape in shapes.items():
        layout[name] = (numel, (shape[0] * shape[1], shape[2]))
        numel += math.prod(shape)
    parts, nbytes = prefill.held_layout(layout, numel, frozenset(layout), {})
    held = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    piece = 1 << 26  # float32 temporaries of 256 MB at a time (DeepSeek-V3's experts: 11.3 G weights)
    views = {}
    for name, offset, shape, dtype in parts:
        t = prefill.typed(held, offset, math.prod(shape), dtype)
        if dtype == prefill.FP8:
            for part in t.split(piece):
                part.copy_((torch.randn(part.shape, generator=gen, device=device) * 64).clamp(-448, 448))
        else:  # the scales of the weight before it: fan-in^-1/2 / 64 times 1 to 2
            fan_in = shapes[name[:-len("_scale_inv")]][2]
            t.copy_((1 + torch.rand(t.shape, generator=gen, device=device)) * fan_in ** -0.5 / 64)
        views[name] = t
    out = torch.empty(numel, dtype=prefill.DTYPE, device=device)
    grid = lambda n, k: (n // prefill.FP8_BLOCK, *prefill.scale_grid((k,)))
    fp8 = prefill.LayerWeights(gate_up=views["gate_up"].view(shapes["gate_up"]),
                               down=views["down"].view(shapes["down"]),
                               gate_up_scales=views["gate_up_scale_inv"].view(E, *grid(2 * I, H)),
                               down_scales=views["down_scale_inv"].view(E, *grid(H, I)))
    bf16 = prefill.LayerWeights(gate_up=out[:math.prod(shapes["gate_up"])].view(shapes["gate_up"]),
                                down=out[math.prod(shapes["gate_up"]):].view(shapes["down"]))
    return held, prefill.fp8_layer(parts, layout, device), out, fp8, bf16


def gemm_ms(ms, h, w, weights, chosen, tile):
    # each fused GEMM alone (gate+up with its SiLU·up, then down), on its own alignment
    block_m, up, down = tile
    E, k = w.gate_up.shape[0], chosen.shape[1]
    ids, block_expert = prefill.align_experts(chosen, E, block_m)
    act = prefill.moe_gate_up(h, w.gate_up, ids, block_expert, k, block_m, up, scales=w.gate_up_scales)
    return (ms(lambda: prefill.moe_gate_up(h, w.gate_up, ids, block_expert, k, block_m, up,
                                           scales=w.gate_up_scales)),
            ms(lambda: prefill.moe_down(act, w.down, ids, block_expert, weights.numel(), block_m, down,
                                        scales=w.down_scales)))


def measure(name, tokens, device, repeats):
    cfg = shape_config(name)
    H, E, k, I = FP8_SHAPES[name]
    ms, family = timer(device, repeats), prefill.gpu_family(device)
    dequantize = (prefill.TRITON_KERNELS if device.type == "cuda" else prefill.TORCH_KERNELS).dequantize_layer
    t = time.perf_counter()
    held, layer, out, fp8, bf16 = fp8_experts(cfg, device)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen, device=device).to(prefill.DTYPE)
    norm = (1 + 0.1 * torch.randn(H, generator=gen, device=device)).to(prefill.DTYPE)
    h = prefill.rms_norm(x, norm, cfg.rms_norm_eps)
    router = prefill.LayerWeights(router=(torch.randn(E, H, generator=gen, device=device) * H ** -0.5).to(
        prefill.DTYPE))
    weights, chosen = prefill.route(h, router, cfg.router)
    counts = torch.bincount(chosen.flatten(), minlength=E).tolist()
    dequantize(held, out, layer)
    log(f"{name} {tokens}: {held.numel() / 1e9:.2f} GB held FP8, {out.numel() * 2 / 1e9:.2f} GB bf16, made in "
        f"{time.perf_counter() - t:.1f} s")
    flops, moved = 6 * tokens * k * H * I, held.numel() + out.numel() * out.element_size()
    deq_ms = ms(lambda: dequantize(held, out, layer))
    record = {"shape": name, "hidden": H, "experts": E, "top_k": k, "moe_intermediate": I, "tokens": tokens,
              "rows_per_expert_min_mean_max": [min(counts), tokens * k / E, max(counts)],
              "held_bytes": held.numel(), "bf16_bytes": out.numel() * out.element_size(), "expert_tflop": flops / 1e12,
              "dequantize_ms": deq_ms, "dequantize_gbps": moved / deq_ms / 1e6, "tiles": {}}
    bf16_tiles = prefill.fused_tiles(family, cfg, tokens)
    scratch = x.clone()
    for tile in list(dict.fromkeys(bf16_tiles + FP8_TILES[family])):
        entry, sums = {"in_bf16_table": tile in bf16_tiles}, {}
        for path, w in (("bf16", bf16), ("fp8", fp8)):
            try:  # a tile that does not run here (shared memory, TMA, a compile error) is out, on its path alone
                sums[path] = torch.zeros_like(x)  # the experts' sums alone: the bits compared
                prefill.fused_experts(sums[path], h, weights, chosen, w, tile)
                entry[f"{path}_experts_ms"] = ms(lambda: prefill.fused_experts(scratch, h, weights, chosen, w, tile))
                entry[f"{path}_tflops"] = flops / entry[f"{path}_experts_ms"] / 1e9
                entry[f"{path}_gemms_ms"] = gemm_ms(ms, h, w, weights, chosen, tile)
            except Exception as e:
                entry[f"{path}_error"] = prefill.failure(e)
                sums.pop(path)
                log(f"{name} {tokens} {tile} {path}: {entry[f'{path}_error']}")
        if "bf16" in sums:
            entry["dequantize_and_bf16_ms"] = ms(lambda: (
                dequantize(held, out, layer), prefill.fused_experts(scratch, h, weights, chosen, bf16, tile)))
            entry["dequantize_and_bf16_tflops"] = flops / entry["dequantize_and_bf16_ms"] / 1e9
        if len(sums) == 2:
            entry["same_bits"], entry["rel_diff"] = torch.equal(sums["bf16"], sums["fp8"]), prefill.check_error(
                sums["fp8"], sums["bf16"].float())
        del sums
        log(f"{name} {tokens} {prefill.tile_name('fused', tile)}: (a) "
            f"{entry.get('dequantize_and_bf16_ms', math.nan):.3f} ms, (b) {entry.get('fp8_experts_ms', math.nan):.3f} "
            f"ms, same bits {entry.get('same_bits')}")
        record["tiles"][prefill.tile_name("fused", tile)] = {"tile": tile, **entry}
    ran = lambda key: {n: e[key] for n, e in record["tiles"].items() if key in e}
    a, b = ran("dequantize_and_bf16_ms"), ran("fp8_experts_ms")
    if a and b:  # each path in its own best tile
        record["best"] = {"dequantize_and_bf16": min(a, key=a.get), "fp8": min(b, key=b.get),
                          "dequantize_and_bf16_ms": min(a.values()), "fp8_ms": min(b.values())}
    del held, out, fp8, bf16, x, h, scratch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def table(records):
    lines = [f"{'shape':14} {'tokens':>6} {'tile':52} {'(a) ms':>8} {'bf16 ms':>8} {'(b) ms':>8} {'(a)/(b)':>7} "
             f"{'(b) TF/s':>8} {'GEMMs a|b ms':>15} {'bits':>5} {'rel diff':>8}"]
    for r in records:
        lines.append(f"{r['shape']:14} {r['tokens']:>6} {'dequantization alone':52} {r['dequantize_ms']:>8.3f} "
                     f"({r['dequantize_gbps']:.0f} GB/s)")
        for name, e in r["tiles"].items():
            get = lambda key, fmt: format(e[key], fmt) if key in e else "-"
            gemms = "|".join(f"{sum(e[k]):.2f}" if k in e else "-" for k in ("bf16_gemms_ms", "fp8_gemms_ms"))
            ratio = e["dequantize_and_bf16_ms"] / e["fp8_experts_ms"] if "fp8_experts_ms" in e and \
                "dequantize_and_bf16_ms" in e else math.nan
            lines.append(f"{r['shape']:14} {r['tokens']:>6} {name + ('' if e['in_bf16_table'] else ' *'):52} "
                         f"{get('dequantize_and_bf16_ms', '.3f'):>8} {get('bf16_experts_ms', '.3f'):>8} "
                         f"{get('fp8_experts_ms', '.3f'):>8} {ratio:>7.2f} {get('fp8_tflops', '.0f'):>8} {gemms:>15} "
                         f"{str(e.get('same_bits', '-')):>5} {get('rel_diff', '.1e'):>8}")
            for path in ("bf16", "fp8"):
                if f"{path}_error" in e:
                    lines.append(f"{'':22}{path} failed: {e[f'{path}_error'][:90]}")
    lines.append("(a): the layer dequantization + the bf16 fused experts; (b): the FP8 weights dequantized in the "
                 "GEMMs; *: an FP8_TILES tile, not in the bf16 table")
    for r in records:
        best = r.get("best")
        if not best:
            lines.append(f"{r['shape']} {r['tokens']}: no tile ran")
            continue
        a, b = best["dequantize_and_bf16_ms"], best["fp8_ms"]
        faster = "(b) FP8 in the GEMMs" if b < a else "(a) dequantize + bf16"
        lines.append(f"{r['shape']} {r['tokens']}: {faster} is faster, {max(a, b) / min(a, b):.2f}x: (a) {a:.3f} ms "
                     f"({best['dequantize_and_bf16']}), (b) {b:.3f} ms ({best['fp8']})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the record (JSON)")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3",
                    help=f"comma-separated, of {', '.join(FP8_SHAPES)}")
    ap.add_argument("--tokens", default="16384", help="tokens a slice holds, comma-separated")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls of each step (their median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", help="the commit measured (recorded as given)")
    ap.add_argument("--float16", action="store_true", help="float16, not bf16: a CPU try under TRITON_INTERPRET=1 "
                    "(the interpreter multiplies bf16 tiles as raw integers)")
    args = ap.parse_args(argv)
    if args.float16:
        prefill.DTYPE = torch.float16
    device, t0 = torch.device(args.device), time.perf_counter()
    records = [measure(name, int(tokens), device, args.repeats)
               for name in args.shapes.split(",") for tokens in args.tokens.split(",")]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": getattr(prefill.triton, "__version__", None),
              "commit": args.commit, "wall_s": time.perf_counter() - t0, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(records))
    print(f"wall {report['wall_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dequantizing one quantized layer on the GPU, FP8 and MXFP4: prefill's one launch a layer (dequantize_layer_triton)
against a launch a tensor (the same kernel, each tensor given tables of its own: the launch pattern of the per-tensor
kernel before ce7be0c), PyTorch's dequantize_layer and a device-to-device copy of as many bytes (the bandwidth
ceiling), on random bytes laid out as each geometry's largest layer: by default Qwen3-30B-A3B's MoE layer in block-wise
FP8 (393 tensors) and gpt-oss-20b's in MXFP4 (its 32 experts'); a geometry with gpt-oss's experts is held as MXFP4, any
other as FP8. The one launch also runs in other steps (DEQUANTIZE_ROWS: an FP8 block's rows a step, an MXFP4 program's
rows; MXFP4_GROUPS x 32 columns an MXFP4 step, MXFP4_STEPS a program) and warps. Every output
starts as the same random bits (a missed write shows) and is compared bit for bit with PyTorch's; GPU time is the
median of triton.testing.do_bench (which clears the L2 between calls), GB/s the held layer read plus the bf16 one
written over it; issue_ms the host's time to issue one (what a wave pays when the GPU waits on Python). Prints a JSON
line a geometry, then a table; the device machine runs it in a minute or two.

    python bench/fp8_dequantize.py [--geometry qwen3-30b-a3b gpt-oss-20b] [--out FILE]
    TRITON_INTERPRET=1 python bench/fp8_dequantize.py --device cpu --geometry tiny-moe tiny-gpt-oss  # the bits alone
"""
import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import torch  # noqa: E402

import interact  # noqa: E402
import prefill  # noqa: E402
from bench.make_checkpoint import GEOMETRIES, geometry  # noqa: E402

# (rows, warps, MXFP4 groups, MXFP4 steps) of the one launch beside prefill's, which runs first and last (the spread
# of a repeat): knobs' values, the warps an MXFP4 model's own (MXFP4_WARPS). An MXFP4 layer's rows must divide its
# experts' out sides (gpt-oss's 2880 takes 64, not 128); (32, 8, 4, 1) is the MXFP4 program before issue 37's second
# change (32 rows by 128 columns), (32, 8, 8, 4) the one after it. An FP8 layer runs each (rows, warps) once, with
# prefill's groups and steps (MXFP4's alone).
def knobs(cfg):
    return ("DEQUANTIZE_ROWS", "MXFP4_WARPS" if cfg.mxfp4 else "DEQUANTIZE_WARPS", "MXFP4_GROUPS", "MXFP4_STEPS")


VARIANTS = [(16, 4, 8, 4), (32, 4, 8, 4), (64, 8, 8, 4), (64, 4, 8, 4), (128, 8, 8, 4),  # FP8's, and MXFP4's
            (32, 8, 4, 8), (32, 8, 8, 4), (64, 8, 4, 8), (32, 8, 4, 1), (32, 8, 8, 2), (32, 8, 8, 12), (16, 4, 4, 8)]


def quantized_config(name):
    # the geometry as its quantized release holds it: gpt-oss's experts in MXFP4, any other model block-wise FP8
    cfg = prefill.ModelConfig.from_json(interact.config_json(geometry(name)))
    return dataclasses.replace(cfg, mxfp4=True) if cfg.fused_experts else dataclasses.replace(cfg, fp8_scales="float")


def random_layer(cfg, kind, device, seed=0):
    # the held bytes of one layer of the kind, random: FP8 without NaN, its scales from 2^-12 to 2^-4; MXFP4 every code,
    # its scale bytes from 2 to 254 (no subnormal product, which a GPU's torch may flush); bf16 tensors normal
    gen = torch.Generator().manual_seed(seed)
    held = torch.randint(256, (cfg.layer_bytes,), generator=gen, dtype=torch.uint8)
    for name, offset, shape, dtype in cfg.held[cfg.layer_kinds.index(kind)]:
        n = math.prod(shape)
        if dtype == prefill.FP8:
            q = held[offset:offset + n]
            q[(q & 127) == 127] = 0
        elif dtype == torch.float32:
            prefill.typed(held, offset, n, dtype).copy_(2.0 ** -torch.randint(4, 13, (n,), generator=gen))
        elif dtype == torch.uint8:
            if name.endswith("_scales"):
                held[offset:offset + n] = torch.randint(2, 255, (n,), generator=gen, dtype=torch.uint8)
        else:
            prefill.typed(held, offset, n, dtype).copy_(torch.randn(n, generator=gen))
    return held.to(device)


def per_tensor(cfg, kind, device):
    # an FP8Layer per tensor of the layer (a weight and its scales, or a bf16 tensor), offsets as in the whole layer
    parts, layout, out = cfg.held[cfg.layer_kinds.index(kind)], cfg.layouts[kind], []
    for i, (name, _, _, dtype) in enumerate(parts):
        into = prefill.held_into(name, dtype)
        if into in layout:
            own = parts[i:i + 2] if dtype in (prefill.FP8, torch.uint8) else parts[i:i + 1]
            out.append(prefill.fp8_layer(own, {into: layout[into]}, device, cfg.mxfp4))
    return out


def timed(step, repeats, cuda):
    # (GPU ms a call, the median of do_bench's, host ms to issue one) after one call for compiles and caches; None on
    # the CPU
    step()
    if not cuda:
        return None, None
    from triton.testing import do_bench
    gpu_ms = do_bench(step, warmup=25, rep=repeats, return_mode="median")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    issued = (time.perf_counter() - t) * 1e3 / 10
    torch.cuda.synchronize()
    return gpu_ms, issued


def measure(name, args, device):
    cuda = device.type == "cuda"
    cfg = quantized_config(name)
    kind = cfg.largest_kind
    parts, layout = cfg.held[cfg.layer_kinds.index(kind)], cfg.layouts[kind]
    held = random_layer(cfg, kind, device)
    gen = torch.Generator(device).manual_seed(1)  # on the device: gpt-oss-120b's bf16 layer is 3.2 G elements
    poison = torch.randint(-2**15, 2**15, (cfg.dequantized_bytes // 2,), generator=gen, dtype=torch.int16,
                           device=device)
    out = torch.empty_like(poison)
    want = poison.clone()
    prefill.dequantize_layer(held, want.view(prefill.DTYPE), prefill.fp8_layer(parts, layout, device, cfg.mxfp4))
    held_bytes = cfg.layer_nbytes[cfg.layer_kinds.index(kind)]
    moved = held_bytes + cfg.dequantized_bytes  # read held, write bf16
    report = {"geometry": name, "kind": kind, "quantized": "MXFP4" if cfg.mxfp4 else "FP8",
              "held_mb": round(held_bytes / 1e6, 1),
              "bf16_mb": round(cfg.dequantized_bytes / 1e6, 1), "triton": prefill.triton.__version__,
              "torch_version": torch.__version__, "gpu": torch.cuda.get_device_name(device) if cuda else "cpu"}

    def run(key, step, **extra):
        out.copy_(poison)
        gpu_ms, issue_ms = timed(step, args.repeats, cuda)
        out.copy_(poison)
        step()
        report[key] = {**extra, "gpu_ms": gpu_ms and round(gpu_ms, 4), "issue_ms": issue_ms and round(issue_ms, 4),
                       "gb_per_s": gpu_ms and round(moved / gpu_ms / 1e6), "bits_equal_torch": torch.equal(out, want)}

    # the ceiling: a copy of random bits that reads and writes as many bytes in all (the held layer is the smaller)
    source = poison[:moved // 4]
    copied = torch.empty_like(source)
    gpu_ms, _ = timed(lambda: copied.copy_(source), args.repeats, cuda)
    report["copy"] = {"gpu_ms": gpu_ms and round(gpu_ms, 4), "gb_per_s": gpu_ms and round(moved / gpu_ms / 1e6)}
    experts_out = [shape[1] for part, _, shape, dtype in parts if prefill.held_into(part, dtype) != part]  # MXFP4
    names = knobs(cfg)
    default = tuple(getattr(prefill, knob) for knob in names)
    others = VARIANTS if cfg.mxfp4 else [v[:2] + default[2:] for v in VARIANTS]
    variants = [default, *[v for v in dict.fromkeys(others) if not any(n % v[0] for n in experts_out) and v != default],
                default]
    for i, variant in enumerate(variants):
        for knob, value in zip(names, variant):
            setattr(prefill, knob, value)
        rows, warps, groups, steps = variant
        layer = prefill.fp8_layer(parts, layout, device, cfg.mxfp4)
        key = ("one launch" if i == 0 else "one launch, again" if i == len(variants) - 1
               else f"one launch, {rows} rows, {warps} warps" + (f", {groups}x32 x {steps}" if cfg.mxfp4 else ""))
        run(key, lambda: prefill.dequantize_layer_triton(held, out.view(prefill.DTYPE), layer), rows=rows, warps=warps,
            groups=groups, steps=steps, programs=layer.programs.numel(), tensors=len(layer.tensors))
    for knob, value in zip(names, default):
        setattr(prefill, knob, value)
    tensors = per_tensor(cfg, kind, device)
    run("a launch a tensor", lambda: [prefill.dequantize_layer_triton(held, out.view(prefill.DTYPE), t)
                                      for t in tensors], launches=len(tensors))
    layer = prefill.fp8_layer(parts, layout, device, cfg.mxfp4)
    run("torch", lambda: prefill.dequantize_layer(held, out.view(prefill.DTYPE), layer))
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=sorted(GEOMETRIES))
    p.add_argument("--repeats", type=int, default=200, help="do_bench's rep, in ms")
    p.add_argument("--device", default="cuda", help="cpu: the bits alone, under TRITON_INTERPRET=1")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    reports = [measure(name, args, torch.device(args.device)) for name in args.geometry]
    for report in reports:
        print(json.dumps(report))
    print(f"{'geometry':<16}{'quantized':<10}{'what':<40}{'GPU ms':>9}{'GB/s':>7}  bits = torch's")
    for report in reports:
        for key, row in report.items():
            if isinstance(row, dict):
                print(f"{report['geometry']:<16}{report['quantized']:<10}{key:<40}{row['gpu_ms'] or '-':>9}"
                      f"{row['gb_per_s'] or '-':>7}  {row.get('bits_equal_torch', '')}")
    if args.out:
        Path(args.out).write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Dequantizing one FP8 layer on the GPU: prefill's one launch a layer (dequantize_layer_triton) against a launch a
tensor (the same kernel, each tensor given tables of its own: the launch pattern of the per-tensor kernel before
ce7be0c) and PyTorch's dequantize_layer, on random bytes laid out as a geometry's layer (by default Qwen3-30B-A3B's
MoE layer: 393 tensors). Each is checked bit for bit against the one launch, then timed back to back (GPU time per
layer, CUDA events) and for the host time that issuing it takes (what a wave pays when the GPU waits on Python).
Prints one JSON line; the device machine runs it in a few seconds.

    python bench/fp8_dequantize.py [--geometry qwen3-30b-a3b] [--repeats 20] [--out FILE]
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import torch  # noqa: E402

import interact  # noqa: E402
import prefill  # noqa: E402
from bench.make_checkpoint import GEOMETRIES, geometry  # noqa: E402


def random_layer(cfg, kind, device, seed=0):
    # the held bytes of one layer of the kind, random: FP8 without NaN, scales from 2^-12 to 2^-4, bf16 tensors normal
    gen = torch.Generator().manual_seed(seed)
    held = torch.randint(256, (cfg.layer_bytes,), generator=gen, dtype=torch.uint8)
    for _, offset, shape, dtype in cfg.held[cfg.layer_kinds.index(kind)]:
        n = torch.Size(shape).numel()
        if dtype == prefill.FP8:
            q = held[offset:offset + n]
            q[(q & 127) == 127] = 0
        elif dtype == torch.float32:
            prefill.typed(held, offset, n, dtype).copy_(2.0 ** -torch.randint(4, 13, (n,), generator=gen))
        else:
            prefill.typed(held, offset, n, dtype).copy_(torch.randn(n, generator=gen))
    return held.to(device)


def per_tensor(cfg, kind, device):
    # an FP8Layer per tensor of the layer (a weight and its scales, or a bf16 tensor), offsets as in the whole layer
    parts, layout, out = cfg.held[cfg.layer_kinds.index(kind)], cfg.layouts[kind], []
    for i, part in enumerate(parts):
        if part[0] in layout:
            own = parts[i:i + 2] if part[3] == prefill.FP8 else [part]
            out.append(prefill.fp8_layer(own, {part[0]: layout[part[0]]}, device))
    return out


def timed(step, repeats):
    # (GPU ms per call back to back, host ms to issue one call): one call first for compiles and caches
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, issued * 1e3 / repeats


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="qwen3-30b-a3b", choices=sorted(GEOMETRIES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = dataclasses.replace(prefill.ModelConfig.from_json(interact.config_json(geometry(args.geometry))),
                              fp8_scales="float")
    kind = cfg.largest_kind
    held = random_layer(cfg, kind, device)
    layer = prefill.fp8_layer(cfg.held[cfg.layer_kinds.index(kind)], cfg.layouts[kind], device)
    tensors = per_tensor(cfg, kind, device)
    outs = {name: torch.zeros(cfg.dequantized_bytes // 2, dtype=prefill.DTYPE, device=device)
            for name in ("one launch", "a launch a tensor", "torch")}
    steps = {"one launch": lambda: prefill.dequantize_layer_triton(held, outs["one launch"], layer),
             "a launch a tensor": lambda: [prefill.dequantize_layer_triton(held, outs["a launch a tensor"], t)
                                           for t in tensors],
             "torch": lambda: prefill.dequantize_layer(held, outs["torch"], layer)}
    moved = cfg.layer_nbytes[cfg.layer_kinds.index(kind)] + cfg.dequantized_bytes  # read held, write bf16
    report = {"geometry": args.geometry, "kind": kind, "tensors": len(layer.tensors),
              "programs": layer.programs.numel(), "held_mb": round(cfg.layer_bytes / 1e6, 1),
              "bf16_mb": round(cfg.dequantized_bytes / 1e6, 1), "gpu": torch.cuda.get_device_name(device),
              "triton": prefill.triton.__version__, "torch": torch.__version__}
    for name, step in steps.items():
        gpu_ms, host_ms = timed(step, args.repeats)
        same = torch.equal(outs[name].view(torch.int16), outs["one launch"].view(torch.int16))
        report[name] = {"gpu_ms": round(gpu_ms, 4), "issue_ms": round(host_ms, 4),
                        "gb_per_s": round(moved / gpu_ms / 1e6), "bits_equal_one_launch": same,
                        # a wave's layers of this kind, each the slower of the GPU's time and the host's
                        "wave_ms": round(max(gpu_ms, host_ms) * cfg.layer_kinds.count(kind), 2)}
    report["a launch a tensor"]["launches"] = len(tensors)
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

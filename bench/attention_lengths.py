"""Attention at long lengths, as prefill's per-bucket pick sees it (one device command, ~1 min).

    python bench/attention_lengths.py [--out DIR] [--geometry deepseek-v3]

For prefill's attention candidates on this GPU (Qwen3-32B heads: 64 query, 8 KV, head_dim 128; or DeepSeek-V3's
latent attention: 128 heads, q/k 192 in the Triton kernel's 256 lanes, v 128, zero-padded to 192 for flash-attn,
torch's flash kernel and cuDNN), on single texts of
new lengths: the first call (what a kernel plans per shape: cuDNN builds a graph per sequence length) and the mean
of the next five, as TFLOP/s of causal attention; each candidate's error against float32 attention on a 4500-token
text. Runs twice, in subprocesses: as prefill runs, and with TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (torch >= 2.9,
opt-in: cuDNN's ragged path, one graph for every sequence length; read once per process). Then what prefill's own
start-up pick chooses per bucket on this machine (a fresh picks file). Prints a table last and writes JSON to --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [4500, 5001, 8292, 12000, 24795]  # each new to the process; 24795: long-32's longest text
GEOMETRY = dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False)


def geometry(name: str) -> dict:
    if name == "qwen3-32b":
        return GEOMETRY
    sys.path.insert(0, str(ROOT))
    import interact
    from bench.make_checkpoint import DEEPSEEK_V3
    return interact.config_json(DEEPSEEK_V3)  # its attention; the layers' kind changes nothing here


def measure(name: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import prefill

    dev, cfg = torch.device("cuda"), prefill.ModelConfig.from_json(geometry(name))
    how = cfg.attention[0]
    per_pair = 2 * cfg.num_attention_heads * (cfg.head_dim + cfg.v_head_dim)
    out = {}
    for name, kind, tile in prefill.attention_candidates("auto", prefill.gpu_family(dev)):
        if kind == "sdpa":
            continue  # SDPA with the KV heads repeated: never the fastest, and slow to time at 25k tokens
        row = out[name] = {}
        try:
            attend = prefill.make_attention(kind, tile)
            q, k, v, chunk = prefill.attention_inputs(dev, cfg, [4500], seed=3)
            row["error_4500"] = prefill.check_error(attend(q, k, v, chunk, how),
                                                    prefill.attention_reference(q, k, v, chunk, how))
            for n in LENGTHS:
                first, ms = prefill.attention_ms(attend, prefill.attention_inputs(dev, cfg, [n], seed=n), how)
                flops = per_pair * n * (n + 1) / 2
                row[n] = {"first_ms": first, "ms": ms, "tflops": flops / ms / 1e9}
                print(f"{name} {n}: first {first:.1f} ms, {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s", file=sys.stderr,
                      flush=True)
        except Exception as e:  # noqa: BLE001 (a candidate that cannot run here is a result)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        picks = prefill.Picks(Path(tmp) / "picks.json", prefill.machine_key(dev, cfg))
        names, _, report = prefill.pick_attention("auto", dev, cfg, picks)
    out["pick"] = names
    out["pick_report"] = [{k: v for k, v in e.items() if k != "attend"} for e in report]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--geometry", choices=["qwen3-32b", "deepseek-v3"], default="qwen3-32b")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.geometry)))
        return 0
    results = {}
    for label, extra in (("default", {}), ("avoid_recompile", {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"})):
        p = subprocess.run([sys.executable, __file__, "--child", "--geometry", args.geometry], capture_output=True,
                           text=True,
                           env=dict(os.environ, **extra), timeout=400)
        sys.stderr.write(p.stderr[-3000:])
        results[label] = json.loads(p.stdout.splitlines()[-1]) if p.returncode == 0 else {"failed": p.stderr[-500:]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"attention_lengths-{args.geometry}.json").write_text(json.dumps(results, indent=1))
    print(f"{'run':16} {'candidate':14} {'err 4500':>9} " + " ".join(f"{n:>16}" for n in LENGTHS))
    print(f"{'':16} {'':14} {'':>9} " + " ".join(f"{'TFLOP/s (1st ms)':>16}" for _ in LENGTHS))
    for label, res in results.items():
        for name, row in res.items():
            if name in ("pick", "pick_report") or not isinstance(row, dict):
                continue
            cells = [f"{row[str(n)]['tflops']:6.0f} ({row[str(n)]['first_ms']:6.1f})" if str(n) in row else "x"
                     for n in LENGTHS]
            print(f"{label:16} {name:14} {row.get('error_4500', float('nan')):9.1e} "
                  + " ".join(f"{c:>16}" for c in cells) + (f"  {row['error'][:60]}" if "error" in row else ""))
        print(f"{label:16} pick: {res.get('pick')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

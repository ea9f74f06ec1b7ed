"""DeepSeek-V3 (model_type deepseek_v3: DeepSeek-V3/V3.1/R1, Moonlight, Kimi-K2 where its config.json says deepseek_v3)
against transformers' DeepseekV3ForCausalLM in float32, on tiny checkpoints that transformers builds and saves (bf16,
the byte-level tokenizer of test_families): its multi-head latent attention, and its mixture of experts after a dense
first layer (first_k_dense_replace 1): 8 experts in 4 groups of which the best 2 are kept, top-2, routed scaling 2.5,
a shared expert, a correction bias set here (a fresh model's is zero).

Two checkpoints: "lora" (q through q_a_proj, q_a_layernorm and q_b_proj; interleaved RoPE; DeepSeek's YaRN whose
mscale scales the softmax; biases), "plain" (q_proj without a bias beside kv_a_proj_with_mqa with one; plain RoPE;
gpt-oss's YaRN, whose attention_factor scales cos and sin). Both have a q/k head dim (24) that is not a power of two
and a v head dim of its own (16). Their weights are sharp enough, and YaRN's original context short enough (16), that
each feature moves some text's loss by several tolerances (test_every_feature_decides_some_loss) while the right math
stays well within one. The router's own features are GLM-4.5's code (tests/test_moe_families.py ablates each there);
here they are ablated through V3's layer, whose router and experts sit behind latent attention's tensors.
"""
import dataclasses
import json
import math
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import prefill
from test_families import TEXTS, byte_tokenizer, losses, replaced_layers, ropes, runner, settings
from test_prefill import SAME_MATH, TOLERANCE, max_rel_err, transformers_losses

GEOMETRY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, max_position_embeddings=640,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
# DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim: attention_factor 1), its mscales 2 where V3's are 1, so
# that the softmax's mscale^2 (3.0, V3's 1.87) shows on these texts; gpt-oss's YaRN (truncate false), its factor 1000
# where gpt-oss's is 32, so that cos and sin's attention_factor (1.69, gpt-oss's 1.35) shows
V3_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 2.0, "mscale_all_dim": 2.0,
           "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 1000.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}
# name -> (config keywords, weights' std x sqrt(fan-in): q/k/latent projections, o_proj, the dense MLP, the MoE
# layer's router and experts; seed)
CHECKPOINTS = {
    "lora": (dict(q_lora_rank=48, attention_bias=True, rope_parameters=V3_YARN), (1.5, 3.0, 0.5, 1.5), 4),
    "plain": (dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, rope_parameters=GPT_OSS_YARN),
              (2.0, 3.0, 0.5, 1.5), 1),
}


CORRECTION_BIAS = 0.3  # test_moe_families': the sigmoid scores lie in (0, 1), mostly 0.3-0.7


def build(folder, name):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    keywords, (qk, out, mlp, moe), seed = CHECKPOINTS[name]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**GEOMETRY, **keywords}))
    with torch.no_grad():
        for weight, p in model.named_parameters():
            if p.dim() == 1:  # norms (and biases) far from 1 (and 0)
                p.normal_(1, 0.3)
            else:
                std = qk if ("q_" in weight or "kv_" in weight) else out if "o_proj" in weight else \
                    moe if (".mlp.gate." in weight or "experts" in weight) else mlp if ".mlp." in weight else 1.5
                p.normal_(0, std / p.shape[-1] ** 0.5)
        for layer in model.model.layers[GEOMETRY["first_k_dense_replace"]:]:  # a fresh model's is zero
            layer.mlp.gate.e_score_correction_bias.normal_(0, CORRECTION_BIAS)
    model.to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def mla(tmp_path_factory):
    """name -> (checkpoint folder, transformers' float32 losses of TEXTS, a Runner on it), built once when asked."""
    built = {}

    def get(name):
        if name not in built:
            folder = build(tmp_path_factory.mktemp(name), name)
            built[name] = folder, transformers_losses(folder, TEXTS), runner(folder)
        return built[name]
    return get


# ----------------------------------------------------------------------------- against transformers

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_matches_transformers(mla, name, monkeypatch):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    path, reference, r = mla(name)
    assert r.cfg.model_type == "deepseek_v3" and (r.cfg.head_dim, r.cfg.v_head_dim) == (24, 16)
    assert r.cfg.layer_kinds == ("mlp", "moe") and r.cfg.router == prefill.Router("sigmoid", 2, True, 4, 2, 2.5)
    assert max_rel_err(losses(r), reference) < TOLERANCE  # measured: 2.3e-3 (lora), 2.8e-3 (plain)
    # transformers' own bf16 numbers, the logits rounded to bf16 as prefill's are on request: the same roundings, once
    # its routing weights are rounded to bf16 as prefill's combination takes them (the deviation the mixture of
    # experts' section names; it alone moves these losses by up to 1.0e-3). Measured: 1.1e-7 (lora), 8.0e-8 (plain)
    route = DeepseekV3TopkRouter.forward

    def bf16_weights(self, h):
        logits, weights, chosen = route(self, h)
        return logits, weights.bfloat16().float(), chosen
    monkeypatch.setattr(DeepseekV3TopkRouter, "forward", bf16_weights)
    monkeypatch.setitem(prefill.LOGITS, "texts", "bf16")
    assert max_rel_err(losses(r), transformers_losses(path, TEXTS, torch.bfloat16)) < SAME_MATH


def norm_skipped(width):
    # the RMSNorm of rows `width` wide (a latent's) skipped, the others kept: rms_norm is late-bound in TORCH_KERNELS
    norm = prefill.rms_norm
    return lambda x, weight, eps, offset=False: x if x.shape[-1] == width else norm(x, weight, eps, offset)


def split_swapped(r):
    # kv_b's rows of each head as [v, k_nope] where transformers splits [k_nope, v] (equal widths here)
    cfg = r.cfg
    return {i: dataclasses.replace(w, kv_b=w.kv_b.view(cfg.num_attention_heads, 2, cfg.v_head_dim, -1).flip(1)
                                   .reshape(w.kv_b.shape)) for i, w in r.streamer.resident.items()}


# Per checkpoint, each feature undone: (config fields to replace, every layer's weight views or None, rms_norm to patch
# in or None)
ABLATIONS = {
    "lora": {
        "plain RoPE for interleaved": lambda r: ({"rope_interleave": False}, None, None),
        "softmax scale without YaRN's mscale^2": lambda r: ({"attention": settings(r, scale=24 ** -0.5)}, None, None),
        "q_a_layernorm skipped": lambda r: ({}, None, norm_skipped(r.cfg.q_lora_rank)),
        "kv_a_layernorm skipped": lambda r: ({}, None, norm_skipped(r.cfg.kv_lora_rank)),
        "k_nope and v swapped in kv_b's split": lambda r: ({}, split_swapped(r), None),
        "correction bias dropped": lambda r: ({}, replaced_layers(r, router_bias=torch.zeros(8)), None),
        "no routed scaling": lambda r: ({"routed_scaling_factor": 1.0}, None, None),
        "shared expert dropped": lambda r: ({}, replaced_layers(r, shared_gate_up=None, shared_down=None), None),
    },
    "plain": {
        "interleaved RoPE for plain": lambda r: ({"rope_interleave": True}, None, None),
        "YaRN's attention_factor dropped": lambda r: ({"ropes": ropes(r, lambda i, rope: dataclasses.replace(
            rope, attention_factor=1.0))}, None, None),
        "kv_a's bias dropped (no q LoRA: its own GEMM)": lambda r: ({}, replaced_layers(r, latent_bias=None), None),
        "no group limit": lambda r: ({"topk_group": 4}, None, None),
    },
}


@pytest.mark.parametrize("name, ablation", [(c, a) for c, table in ABLATIONS.items() for a in table])
def test_every_feature_decides_some_loss(mla, name, ablation, monkeypatch):
    # measured: 0.035 (q_a_layernorm skipped) to 0.24 (kv_b's split swapped); the MoE's 0.051 (correction bias
    # dropped) to 0.081 (no routed scaling), the group limit 0.057
    path, reference, r = mla(name)
    fields, layers, norm = ABLATIONS[name][ablation](r)
    cfg, resident = r.cfg, r.streamer.resident
    try:
        r.cfg, r.streamer.resident = dataclasses.replace(cfg, **fields), layers or resident
        if norm is not None:
            monkeypatch.setattr(prefill, "rms_norm", norm)
        assert max_rel_err(losses(r), reference) > 3 * TOLERANCE
    finally:
        r.cfg, r.streamer.resident = cfg, resident
        monkeypatch.undo()
    assert max_rel_err(losses(r), reference) < TOLERANCE  # restored


def with_mtp_layer(path, out):
    """path's checkpoint in out with an MTP layer's tensors (model.layers.<num_hidden_layers>.*, as DeepSeek-V3's
    releases ship its num_nextn_predict_layers) beside the model's: transformers does not load them, nor prefill."""
    shutil.copytree(path, out)
    tensors = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    mtp = {name.replace(".layers.0.", f".layers.{layers}."): t.clone() for name, t in tensors.items()
           if ".layers.0." in name}
    mtp |= {f"model.layers.{layers}.{n}.weight": torch.ones(64, dtype=torch.bfloat16) for n in ("enorm", "hnorm")}
    save_file(tensors | mtp, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_streamed_equals_resident_and_an_mtp_layer_is_ignored(mla, tmp_path):
    path, reference, resident = mla("lora")
    folder = with_mtp_layer(path, tmp_path / "mtp")
    assert transformers_losses(folder, TEXTS[:2]) == reference[:2]
    streamed = runner(folder, gpu_memory_gib=0, load="copy")
    assert streamed.plan.streamed_layers == (0, 1)
    assert losses(streamed) == losses(resident)


def test_continuations_over_a_prefix_tree_match_transformers(mla):
    # nodes cut into chunks of 16 tokens, so that most read their ancestors' keys from earlier chunks (chunk_keys,
    # seen_keys: SDPA's tree path), with keys of head dim 24 and values of 16 kept for the whole wave
    from transformers import AutoModelForCausalLM
    from test_eval import reference_loglikelihood
    path, _, r = mla("lora")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = r.tokenize(TEXTS[:5])
    requests = [(t[:n], t[n:]) for t in ids for n in (3, 12) if len(t) > n + 1] + [(ids[0][:12], ids[1][:9])]
    plan = r.plan
    try:
        r.plan = prefill.plan_memory(r.cfg, plan.budget_bytes, 16)
        results = r.loglikelihoods(requests, token_logprobs=True)
    finally:
        r.plan = plan
    assert r.stats["tokens_computed"] < r.stats["tokens_requested"]
    for (context, continuation), result in zip(requests, results):
        want, _ = reference_loglikelihood(model, context, continuation)
        assert abs(result.logprob - want) < TOLERANCE * abs(want)
        assert math.fsum(result.token_logprobs) == result.logprob and result.tokens == len(continuation)


# ----------------------------------------------------------------------------- YaRN, the config, the plan

# YaRN as released (original context 4096): gpt-oss's, DeepSeek-V3's, and DeepSeek-V2's mscale 0.707 to mscale_all_dim
# 1 (an attention_factor of neither 1 nor factor's alone); head dims 64 (V3's RoPE) and 64 of gpt-oss's
YARNS = {
    "gpt-oss": dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096),
    "deepseek-v3": dict(type="yarn", rope_theta=10000, factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                        beta_slow=1, original_max_position_embeddings=4096),
    "mscales apart": dict(rope_type="yarn", rope_theta=10000, factor=40, mscale=0.707, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096),
}


@pytest.mark.parametrize("name", list(YARNS))
def test_yarn_is_transformers_bit_for_bit(name):
    # inv_freq and attention_factor as _compute_yarn_parameters computes them, and DeepSeek's softmax scale as
    # DeepseekV3Attention's (yarn_apply_mscale), from the same config.json
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    raw = {**GEOMETRY, "model_type": "deepseek_v3", "qk_rope_head_dim": 64, "max_position_embeddings": 163840,
           "rope_scaling": YARNS[name]}
    config = DeepseekV3Config(**raw)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    cfg = prefill.ModelConfig.from_json(raw)
    rope = cfg.ropes[0]
    assert torch.equal(rope.inv_freq(cfg.rope_dim), inv_freq) and rope.attention_factor == attention_factor
    assert cfg.attention[0].scale == DeepseekV3Attention(config, 0).scaling
    assert (attention_factor == 1.0) == (name == "deepseek-v3")


def test_yarn_on_part_of_a_head_is_transformers_bit_for_bit():
    # partial RoPE (GLM-4.5's half of each head of 128) with YaRN: the band and the ramp over the 64 rotating channels,
    # as _compute_yarn_parameters sizes them (int(head_dim x partial_rotary_factor)), the tables 64 wide
    from transformers import Glm4MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    raw = {"model_type": "glm4_moe", "vocab_size": 320, "hidden_size": 256, "intermediate_size": 384,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "max_position_embeddings": 131072, "rope_scaling": YARNS["gpt-oss"] | {"rope_theta": 1e6}}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](Glm4MoeConfig(**raw))
    rope = prefill.ModelConfig.from_json(raw).ropes[0]
    assert rope.partial == 0.5 and rope.rotary_dim(128) == 64 and inv_freq.shape == (32,)
    assert torch.equal(rope.inv_freq(128), inv_freq) and rope.attention_factor == attention_factor
    assert prefill.rope_tables(torch.arange(5), rope, 128)[0].shape == (5, 64)


REFUSED = [
    (dict(first_k_dense_replace=None), "first_k_dense_replace is null"),
    (dict(v_head_dim=None), "v_head_dim is null"),
    (dict(moe_layer_freq=2), "moe_layer_freq is 2"),
    (dict(num_key_value_heads=2), "num_key_value_heads is 2, not num_attention_heads (4)"),
    (dict(rope_interleave="yes"), "rope_interleave is 'yes'"),
    (dict(q_lora_rank=0), "q_lora_rank is 0"),
    (dict(rope_scaling={"type": "yarn", "original_max_position_embeddings": 16}), "lacks factor"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "truncate": 1}), "truncate is 1"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "mscale_all_dim": "1"}), "mscale_all_dim is '1'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor is 0.5"),
    (dict(head_dim=24), "head_dim is 24, not qk_rope_head_dim (8)"),
    (dict(model_type="kimi_k2"), "model_type is 'kimi_k2', which transformers 5.24 maps to no model"),
]


@pytest.mark.parametrize("change, message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_is_not_built_is_refused_in_one_line(change, message):
    with pytest.raises(prefill.UserError) as e:
        prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3", **change}, "c.json")
    assert message in str(e.value) and str(e.value).startswith("c.json") and "\n" not in str(e.value)


def test_config_as_transformers_reads_it(mla):
    path, _, r = mla("plain")
    saved = json.loads((path / "config.json").read_text())
    assert saved["head_dim"] == 8 and saved["qk_head_dim"] == 24  # what DeepseekV3Config writes: RoPE's, and unread
    cfg = r.cfg
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.rope_dim, cfg.head_dim, cfg.v_head_dim,
            cfg.rope_interleave) == (0, 32, 16, 8, 24, 16, False)
    # DeepseekV3Config's defaults where a key is absent (rope_interleave true, q LoRA 1536, ...); null q_lora_rank and
    # null rope_interleave are no LoRA and plain RoPE, as transformers' tests of them read them
    bare = prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3"})
    assert bare.rope_interleave and bare.q_lora_rank == 1536 and not bare.o_bias
    nulls = prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3", "q_lora_rank": None,
                                           "rope_interleave": None})
    assert not nulls.rope_interleave and nulls.q_lora_rank == 0


def test_the_mixture_of_experts_defaults_are_deepseek_v3_config_s():
    # a config.json that names none of the MoE fields: DeepseekV3Config's own defaults (read from the class, not
    # restated), its decoder layers' choice of the dense MLP or the MoE, and which tensors transformers keeps float32
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3MoE
    moe_keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
                "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace")
    bare = {k: v for k, v in GEOMETRY.items() if k not in moe_keys} | {"num_hidden_layers": 5}
    theirs = DeepseekV3Config(**bare)
    cfg = prefill.ModelConfig.from_json({**bare, "model_type": "deepseek_v3"})
    assert cfg.router == prefill.Router("sigmoid", theirs.num_experts_per_tok, theirs.norm_topk_prob, theirs.n_group,
                                        theirs.topk_group, theirs.routed_scaling_factor)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (
        theirs.n_routed_experts, theirs.moe_intermediate_size, theirs.n_shared_experts * theirs.moe_intermediate_size)
    with torch.device("meta"):
        kinds = tuple("moe" if isinstance(DeepseekV3DecoderLayer(theirs, i).mlp, DeepseekV3MoE) else "mlp"
                      for i in range(5))
    assert cfg.layer_kinds == kinds == ("mlp",) * 3 + ("moe",) * 2
    assert set(cfg.tensor_dtypes) == {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    assert cfg.layouts["moe"]["mlp.shared_experts.down_proj.weight"][1] == (64, 2048)


def test_the_plan_counts_mla_s_bytes_and_flops(mla):
    # layer_flops from the layout: twice every attention weight transformers' layer holds, and of the MoE layer the
    # router's, the k experts' a token meets and the shared expert's; a tree's wave keeps 128 heads of 192 + 128
    # channels a token in DeepSeek-V3, 5.6x its hidden state
    from transformers import AutoModelForCausalLM
    from bench.make_checkpoint import DEEPSEEK_V3
    import interact
    path, _, r = mla("lora")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dense, moe = model.model.layers
    assert prefill.layer_flops(r.cfg, "mlp", 1) == 2 * sum(p.numel() for p in dense.parameters() if p.dim() == 2)
    experts = moe.mlp.experts
    active = sum(p.numel() for p in moe.self_attn.parameters() if p.dim() == 2) + moe.mlp.gate.weight.numel() + 2 * (
        experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) + sum(
        p.numel() for p in moe.mlp.shared_experts.parameters())
    assert prefill.layer_flops(r.cfg, "moe", 1) == 2 * active
    v3 = prefill.ModelConfig.from_json(interact.config_json(DEEPSEEK_V3))
    assert v3.layer_kinds == ("mlp",) * 3 + ("moe",) * 58
    H, J = 7168, 2048
    assert prefill.layer_flops(v3, "moe", 1) - prefill.layer_flops(v3, "mlp", 1) == 2 * 256 * H + (8 + 1) * 6 * J * H \
        - 6 * 18432 * H
    assert 2 * (v3.kv_size + v3.v_size) == 128 * (192 + 128) * 2
    plan = prefill.plan_memory(v3, 48 * prefill.GiB)
    state = 2 * v3.hidden_size + 4 * 64 + 32
    assert plan.tree_wave_tokens == 65536 * state // (state + 128 * (192 + 128) * 2)  # 9.9k of the 64k
    # a 4096-token chunk's attention, 1.76 GB: more than the q, k and v it expands and kv_b's output alone; a 16,384-
    # token expert slice's scratch (10.3 GB) is the larger, which the plan holds
    attention = 4096 * 2 * prefill.attention_scratch_per_token(v3)
    expanded = 2 * (2 * v3.q_size + v3.v_size + 128 * (128 + 128))
    assert 1.7e9 < attention and attention > 4096 * expanded
    chunk = attention + 4096 * (6 * v3.intermediate_size + 12 * v3.q_size)
    experts_slice = plan.moe_chunk_tokens * prefill.moe_scratch_per_token(v3)
    assert experts_slice > chunk and plan.working_bytes == plan.wave_tokens * state + experts_slice + \
        prefill.ALLOCATOR_SLACK
    # its FP8 release with the experts held FP8: the scratch the rest's, and, where the loop runs, one expert's bf16
    # gate and up (59 MB) and dequantize_fp8's float32 temporaries of a whole projection (J x H, 176 MB) beside the slice
    from test_fp8 import FP8_CONFIG
    fp8 = prefill.ModelConfig.from_json({**interact.config_json(DEEPSEEK_V3), "quantization_config": FP8_CONFIG})
    fp8 = dataclasses.replace(fp8, fp8_experts=True)
    held = prefill.plan_memory(fp8, 48 * prefill.GiB)
    assert held.working_bytes - fp8.dequantized_bytes == plan.working_bytes + 2 * J * H * 2 + 12 * J * H


# ----------------------------------------------------------------------------- block-wise FP8

def test_fp8_latent_attention_and_experts_match_transformers_float32_load(tmp_path, monkeypatch):
    # every projection quantized per 128x128 block (kv_a_proj_with_mqa too, whose name is not *_proj; each routed
    # expert's and the shared one's), sides in whole blocks or below one, which transformers loads on the CPU: its
    # float32 load is the reference; the router and its correction bias stay float32. Every layer streamed gives the
    # resident bits
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    from test_fp8 import quantize_checkpoint
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**GEOMETRY, "hidden_size": 256, "intermediate_size": 384, "q_lora_rank": 128,
                                 "kv_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                                 "moe_intermediate_size": 128})
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for weight, p in model.named_parameters():
            p.normal_(1, 0.3) if p.dim() == 1 else p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, CORRECTION_BIAS)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    byte_tokenizer(tmp_path)
    quantize_checkpoint(tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    fp8 = [name for name, t in files.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 8 + 5 + 3 * (8 + 1) and "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in fp8
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    J = config.moe_intermediate_size
    for name in fp8:  # an expert's gate and up are rows of transformers' fused gate_up_proj[e], its down down_proj[e]
        expert = name.split(".experts.")[1].split(".") if ".experts." in name else None
        fused = name.split(".experts.")[0] + ".experts." + ("down_proj" if expert and expert[1] == "down_proj" else
                                                            "gate_up_proj")
        want = theirs[name] if expert is None else theirs[fused][int(expert[0])][
            {"gate_proj": slice(0, J), "up_proj": slice(J, 2 * J), "down_proj": slice(None)}[expert[1]]]
        out = torch.empty(files[name].shape, dtype=torch.bfloat16)
        prefill.dequantize_fp8(files[name], files[name + "_scale_inv"], out)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), name
    r = runner(tmp_path)
    assert r.cfg.fp8_scales == "float" and r.cfg.layer_kinds == ("mlp", "moe")
    held = {name: dtype for name, _, _, dtype in r.cfg.held[1]}
    assert held["mlp.gate.weight"] == held["mlp.gate.e_score_correction_bias"] == torch.float32
    assert held["mlp.experts.7.down_proj.weight"] == held["self_attn.kv_b_proj.weight"] == prefill.FP8
    assert r.cfg.layer_bytes < 0.6 * r.cfg.dequantized_bytes
    assert max_rel_err(losses(r), transformers_losses(tmp_path, TEXTS)) < TOLERANCE
    # budget 0: the plan with each layer's bf16 scratch is over it, so the routed experts are held FP8 apart (issue
    # 37), the scratch the rest's alone, and run on the CPU by the loop, an expert dequantized at a time: the bits of
    # the resident run by today's path, streamed and resident (a budget that holds every layer in that mode, not in
    # today's)
    streamed = runner(tmp_path, gpu_memory_gib=0)
    assert not r.cfg.fp8_experts and streamed.cfg.fp8_experts and streamed.experts == "loop"
    assert streamed.cfg.dequantized_bytes < 0.5 * r.cfg.dequantized_bytes
    held = {name: offset for name, offset, _, _ in streamed.cfg.held[1]}
    assert held["mlp.experts.0.gate_proj.weight"] == 0 and held["mlp.experts.0.up_proj.weight"] == 128 * 256
    assert streamed.plan.streamed_layers == (0, 1) and losses(streamed) == losses(r)
    room = streamed.plan.fixed_bytes + streamed.plan.working_bytes + sum(streamed.cfg.layer_nbytes) + 40_000
    resident = runner(tmp_path, gpu_memory_gib=room / 2**30)
    assert resident.cfg.fp8_experts and resident.plan.resident_layers == (0, 1) and losses(resident) == losses(r)
    # the free memory never decides the way, since the two may pick expert kernels of other bits: the budget it is
    # decided at (Runner._held_budget: the setting, or a GPU's total memory less HELD_RESERVE) does, and where the
    # run's budget (the free memory, without a setting) cannot hold the plan that one allows, the run stops
    monkeypatch.setattr(prefill.Runner, "_held_budget", lambda self, gpu_memory_gib: 0)
    assert runner(tmp_path).cfg.fp8_experts  # no limit on the CPU: held all the same
    monkeypatch.setattr(prefill.Runner, "_held_budget", lambda self, gpu_memory_gib: 1 << 62)
    with pytest.raises(prefill.UserError, match=r"needs 0\.\d GiB.*other processes hold the rest.*--gpu-memory from 0\.\d to 0\.0 to hold"):
        runner(tmp_path, gpu_memory_gib=0)


@pytest.mark.parametrize("bug", [None, "scales of the other projection", "gate and up on one grid",
                                 "the product rounded in bf16"])
def test_the_fp8_experts_check_refuses_a_misdequantizing_loop(bug, monkeypatch):
    # the loop's FP8 experts (FP8Experts, the fallback of the fused experts' FP8 variant) against the float32 experts
    # of the dequantized weights, and bit for bit against the loop on them: gate and up 32 wide (one block each, their
    # grids stacked), each bug refused, the last (each product rounded in bf16: within the tolerance) by its bits
    from test_fp8 import FP8_CONFIG
    cfg = prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3", "quantization_config": FP8_CONFIG})
    cfg = dataclasses.replace(cfg, fp8_experts=True)
    right = prefill.FP8Experts.__getitem__
    wrong = {"scales of the other projection": lambda self, e: right(
                 dataclasses.replace(self, scales=self.scales.roll(1, 1)), e),
             "gate and up on one grid": lambda self, e: right(dataclasses.replace(self, parts=1), e),
             "the product rounded in bf16": lambda self, e: (self.q[e].to(torch.bfloat16) * torch.cat(
                 [s.repeat_interleave(128, 0)[:len(q)].repeat_interleave(128, 1)[:, :q.shape[1]] for q, s in zip(
                     self.q[e].chunk(self.parts), self.scales[e].chunk(self.parts))]).to(torch.bfloat16))}
    if bug:
        monkeypatch.setattr(prefill.FP8Experts, "__getitem__", wrong[bug])
    [entry] = prefill.check_experts(prefill.expert_candidates("auto", prefill.torch.device("cpu"), cfg, 4096),
                                    prefill.torch.device("cpu"), cfg)
    assert entry["name"] == "loop" and (entry["experts"] is None) == bool(bug), entry
    if bug == "the product rounded in bf16":
        assert entry["error"] < prefill.CHECK_TOLERANCE and "bits" in entry["reason"], entry


def test_a_side_in_partial_blocks_is_read_as_transformers_fp8_linear_reads_it(monkeypatch):
    # DeepSeek-V3's kv_a_proj_with_mqa, 576 rows over 5 rows of scales: transformers' CPU load cannot read it (576 is
    # not 5 blocks of any size), its FP8Linear reads 4 blocks of 128 rows and one of 64, as its own dequantization
    # for the backward pass writes out: prefill's, bit for bit. A side whose grid divides it otherwise (192 over 2:
    # blocks of 96 on the CPU, of 128 and 64 on a GPU) is refused
    import interact
    from test_fp8 import quantize
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 126, (576, 320), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(5, 3, generator=gen) * 2.0 ** torch.randint(-10, 4, (5, 3), generator=gen)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    prefill.dequantize_fp8(q, scales, out)
    assert torch.equal(out, _dequantize_fp8_weight(q, scales, [128, 128], torch.float32).bfloat16())
    w = out[:, :200]  # and the bench's writer quantizes such a side as the loop of test_fp8 does, block by block
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == q.dtype else a, b.view(torch.uint8) if b.dtype == q.dtype
                           else b) for a, b in zip(interact.quantize_fp8_blocks(w), quantize(w)))
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        Fp8Dequantize(None)._dequantize_one(q, scales, torch.float32)
    from bench.moe_run import partial_blocks_dequantized
    with partial_blocks_dequantized():  # the bench's reference load (moe_run.py --fp8) reads it so, the rest as before
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(q, scales, torch.bfloat16), out)
        whole = q[:512, :256]
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(whole, scales[:4, :2], torch.bfloat16), out[:512, :256])
    # transformers 5.17 (the H200 machine's) hands the side over as bf16 values and has no FP8Linear reader
    import transformers.integrations.finegrained_fp8 as finegrained_fp8
    monkeypatch.delattr(finegrained_fp8, "_dequantize_fp8_weight")
    with partial_blocks_dequantized():
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(q.to(torch.bfloat16), scales, torch.bfloat16), out)
    assert [prefill.misread_side(n) for n in (576, 320, 192, 200, 100, 384)] == [False] * 2 + [True] * 2 + [False] * 2
    with pytest.raises(prefill.UserError, match=r"\[192, 64\] \(self_attn.kv_a_proj_with_mqa.weight\) .* two loads"):
        prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3", "kv_lora_rank": 184,
                                       "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


# ----------------------------------------------------------------------------- the Triton kernels, interpreted

# In Triton's interpreter (a child process: test_prefill.interpreted), on this file's "lora" geometry (q/k head dim
# 16 + 8, v 16): both attention kernels, in NVIDIA's first tile and RDNA3's first offered for it (a program a head:
# the interpreter's cost), on the start-up check's texts (37 and 100 tokens: q and k unjoined, as latent_qkv leaves
# them) and a tree of the check's shape at a tenth of its size (test_eval's: joined, 24 channels in 32 lanes), then
# with a planted bug, half the RoPE channels read (texts) or the q/k head dim padded down (tree: 16 lanes, the RoPE
# channels dropped), which the check refuses; the fused elementwise kernels in every launch the model makes (RoPE
# interleaved at q's head stride and on the one shared key, the latents' norms), then RoPE not interleaved, refused.
# (A Runner on them adds 25 s here: their launches are kernel_checks', laid out as latent_qkv lays them out.)
TRITON_CHECK = """
import json, sys, torch, prefill
cfg, cpu = prefill.ModelConfig.from_json(json.loads(sys.argv[1])), torch.device("cpu")
prefill.CHECK_LENGTHS, prefill.TREE_CHECK = [37, 100], [[[40, 7], [40, 20, 90], [40, 20, 3], [12, 9], [12, 1]], 64]
tiles = [prefill.ATTENTION_TILES["nvidia"][0], prefill.attention_tiles("rdna3", cfg)[0]]
candidates = [(f"triton {tile}", "triton", tile) for tile in tiles]
def half(cases):  # the interpreter multiplies bfloat16 tiles as raw integers: float16 here (bf16 on a GPU)
    return [(how, sharp, (*halved(q, k, v), chunk), want) for how, sharp, (q, k, v, chunk), want in cases]
def halved(q, k, v):  # latent_qkv's layout kept: q's N channels a head N + P apart, k's and v's one tensor
    if not isinstance(q, prefill.Latent):
        return q.half(), k.half(), v.half()
    N = q.nope.shape[2]
    kv = torch.cat((k.nope, v), -1).half()
    return (prefill.Latent(torch.cat((q.nope, q.rope), -1).half()[..., :N], q.rope.half()),
            prefill.Latent(kv[..., :N], k.rope.half()), kv[..., N:])
def checked():
    return {kind: {e["name"]: e.get("reason", e["error"]) for e in prefill.check_attention(candidates, cpu, cfg,
                                                                                        half(cases(cpu, cfg)))}
            for kind, cases in (("texts", prefill.text_check_cases), ("tree", prefill.tree_check_cases))}
report = {"good": checked(), "kernels": prefill.kernel_checks(cpu, cfg)}
class PaddedDown:  # the launch with its q/k head dim padded to the power of two below, not above; unjoined (ROPE),
    def __init__(self, kernel):  # half its RoPE channels read
        self.kernel = kernel
    def __getitem__(self, grid):
        return lambda *args, **kw: self.kernel[grid](*args, **dict(kw, **(
            {"ROPE": kw["ROPE"] // 2} if kw.get("ROPE") else {"DP": 1 << (kw["D"].bit_length() - 1)})))
good = prefill._attention_kernel, prefill._tree_attention_kernel
prefill._attention_kernel, prefill._tree_attention_kernel = map(PaddedDown, good)
candidates = candidates[:1]
report["padded down"] = checked()
prefill._attention_kernel, prefill._tree_attention_kernel = good
rope = prefill.head_norm_rope_triton
prefill.head_norm_rope_triton = lambda x, w, cos, sin, eps, offset, interleave=False: rope(x, w, cos, sin, eps, offset,
                                                                                          not interleave)
report["rope flipped"] = prefill.kernel_checks(cpu, cfg)
# the check's texts, and a layer's latent_qkv, in the layout the unjoined kernel reads
report["unjoined"] = [prefill.latent_layout(*halved(q, k, v)) for _, _, (q, k, v, _), _ in
                      prefill.text_check_cases(cpu, cfg)]
w = prefill.layer_views(torch.zeros(cfg.layer_numel, dtype=prefill.DTYPE), cfg)
cos, sin = prefill.rope_tables(torch.arange(5), cfg.ropes[0], cfg.rope_dim)
h = torch.zeros(5, cfg.hidden_size, dtype=prefill.DTYPE)
report["unjoined"].append(prefill.latent_layout(*prefill.latent_qkv(h, w, cos, sin, cfg, prefill.TORCH_KERNELS)))
print(json.dumps(report))
"""


def test_triton_kernels_with_their_own_v_head_dim_and_interleaved_rope():
    from test_prefill import interpreted
    config = {**GEOMETRY, **CHECKPOINTS["lora"][0], "model_type": "deepseek_v3"}
    p = interpreted(TRITON_CHECK, json.dumps(config))
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    for kind in ("texts", "tree"):
        assert len(report["good"][kind]) == 2, report["good"]
        assert all(e < prefill.CHECK_TOLERANCE / 4 for e in report["good"][kind].values()), report["good"]
        assert all(str(e).startswith("differs from float32 attention") for e in report["padded down"][kind].values())
    launches = {launch for kernel, launch, error in report["kernels"] if kernel in ("head_norm_rope", "rms_norm")}
    assert {"4 query heads, interleaved", "1 key heads, interleaved", "48 wide, a latent", "32 wide, a latent"} <= \
        launches, launches
    assert all(error < prefill.CHECK_TOLERANCE for _, _, error in report["kernels"]), report["kernels"]
    flipped = [error for kernel, _, error in report["rope flipped"] if kernel == "head_norm_rope"]
    assert len(flipped) == 2 and min(flipped) > 4 * prefill.CHECK_TOLERANCE, report["rope flipped"]
    assert report["unjoined"] == [True, True], report["unjoined"]  # the check's texts and a run's latent_qkv


# ----------------------------------------------------------------------------- every way in

def test_the_protocol_the_doctor_and_continuation_records(mla, tmp_path, monkeypatch, capsys):
    # in-process, as a user runs them: the protocol's losses, the doctor's line on MLA, a corpus of continuation
    # records with --token-logprobs (through the prefix tree, as Runner.loglikelihoods)
    import io
    path, reference, r = mla("plain")
    monkeypatch.setattr(prefill, "CHECK_LENGTHS", [37, 100])  # test_families.runner's short start-up check
    monkeypatch.setattr(prefill, "ATTENTION_BUCKETS", [(label, longest, timed, checked) for (label, _, timed, _),
                                                       longest, checked in zip(prefill.ATTENTION_BUCKETS,
                                                                               (64, 128, None), ([60, 37], [100, 37],
                                                                                                 [140]))])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = ["--model", str(path), "--device", "cpu", "--attention", "sdpa"]

    def main(*args, stdin=""):
        out = io.StringIO()
        monkeypatch.setattr(prefill, "take_stdout", lambda: out)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        assert prefill.main([*model, *map(str, args)]) == 0, capsys.readouterr().err
        return out.getvalue().splitlines()
    lines = main(stdin=json.dumps(TEXTS) + "\n")
    assert lines[0] == "ready" and max_rel_err([float(x) for x in lines[1:]], reference) < TOLERANCE
    mla_line = [line for line in main("--doctor") if line.startswith("attention  multi-head latent")]
    assert mla_line == ["attention  multi-head latent (MLA): 4 heads, q/k head dim 24 (16 + RoPE 8), v 16; latents q "
                        "none (q_proj), kv 32, expanded per token; softmax scale 0.2041, yarn RoPE"]
    pairs = [(text[:12], text[12:]) for text in TEXTS[:6]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n" for c, x in pairs))
    main("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--token-logprobs")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    want = r.loglikelihoods(r.encode_pairs(pairs), token_logprobs=True)
    assert [(x["logprob"], x["token_logprobs"]) for x in records] == [(w.logprob, w.token_logprobs) for w in want]

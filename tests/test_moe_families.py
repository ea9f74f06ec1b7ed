"""The mixtures of experts beside Qwen3-MoE: Mixtral, Qwen2-MoE and GLM-4.5 (whose router, shared experts and dense
first layers are DeepSeek-V3's), against transformers in float32 on tiny checkpoints that transformers builds and saves
(`XxxForCausalLM(config)`, `save_pretrained` in bf16, test_families' byte tokenizer and texts).

Each family's features have an ablation, prefill with that one feature undone, which must miss the reference by more
than 3 tolerances while the right model stays within it: the sigmoid router's correction bias (set here: a fresh
model's is zero), its group limit, renormalisation and routed scaling; the shared experts and Qwen2-MoE's gate of them;
partial RoPE; the dense first layer; the windows and biases. Every layer streamed gives the resident bits, the float32
router included, whether the files hold it in bf16 or float32 (and in a block-wise FP8 checkpoint).
"""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import interact
import prefill
from test_families import TEXTS, built_once, byte_tokenizer, losses, replaced_layers, runner, settings
from test_moe import layer_weights
from test_prefill import TOLERANCE, interpreted, max_rel_err, reference_losses

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GEOMETRY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# (transformers' class prefix, its config's keywords, seed): Mixtral's experts are intermediate_size (96) wide;
# Qwen2-MoE with a dense third layer (mlp_only_layers) and a window of 5 on its first (the even layers below
# max_window_layers); GLM with a dense first layer, 8 experts in 4 groups of which the best 2 are kept, a scale of 2.5,
# q/k/v biases, RoPE on half of each head (Glm4MoeConfig's default partial_rotary_factor), with and without q/k norms.
# The seeds: of 0-3, one whose right losses stay well inside the tolerance (a token whose top-k nearly ties flips
# between bf16 and float32: glm4_moe-qk-norm's seed 0 missed by 2.2e-2) and every ablation beyond it
VARIANTS = {
    "mixtral": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2), 0),
    "mixtral-window": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=4), 0),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, **EXPERTS, shared_expert_intermediate_size=48, mlp_only_layers=[2],
                                   use_sliding_window=True, sliding_window=5, max_window_layers=2), 2),
    "glm4_moe": ("Glm4Moe", dict(n_routed_experts=8, **EXPERTS, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                 first_k_dense_replace=1, attention_bias=True), 0),
    "glm4_moe-qk-norm": ("Glm4Moe", dict(n_routed_experts=8, **EXPERTS, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True,
                                         use_qk_norm=True), 2),
}
CORRECTION_BIAS = 0.3  # std of the sigmoid router's e_score_correction_bias: scores lie in (0, 1), mostly 0.3-0.7
QK_NORM = 2.0  # the q/k norms' mean weight


def build(folder, name):
    """A tiny checkpoint of the variant, saved by transformers in bf16 (the router too: transformers upcasts it on
    loading), with weights of std 1/sqrt(fan-in) (router logits ~ N(0, 1), experts as strong as attention), norms
    around 1 (q/k norms around QK_NORM), biases of std 0.3, and a correction bias."""
    import transformers
    prefix, keywords, seed = VARIANTS[name]
    config = getattr(transformers, f"{prefix}Config")(**GEOMETRY, **keywords)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:  # Qwen2-MoE's shared expert behind its gate (~0.5) as strong as the routed ones
                p.normal_(0, (3.0 if "shared_expert.down" in pname else 1.0) / p.shape[-1] ** 0.5)
            elif pname.endswith("bias"):
                p.normal_(0, 0.3)
            else:
                p.normal_(QK_NORM if ("q_norm" in pname or "k_norm" in pname) else 1.0, 0.2)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0, CORRECTION_BIAS)
        model.lm_head.weight.normal_(0, 2 / GEOMETRY["hidden_size"] ** 0.5)
    model.to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer(folder)


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    return built_once(tmp_path_factory, build)


# ----------------------------------------------------------------------------- against transformers

@pytest.mark.parametrize("name", list(VARIANTS))
def test_family_matches_transformers(family, name):
    path, reference, r = family(name)
    kinds = {"mixtral": ("moe",) * 3, "qwen2_moe": ("moe", "moe", "mlp"), "glm4_moe": ("mlp", "moe", "moe")}
    assert r.cfg.layer_kinds == kinds[r.cfg.model_type]
    assert max_rel_err(losses(r), reference) < TOLERANCE


def ropes_whole(r):  # partial RoPE undone: every channel of a head rotates
    return tuple(dataclasses.replace(rope, partial=1.0) for rope in r.cfg.ropes)


def dense_layer_dropped(r):  # the dense first layer's MLP adds nothing
    resident = dict(r.streamer.resident)
    resident[0] = dataclasses.replace(resident[0], down=torch.zeros_like(resident[0].down))
    return resident


# Per variant, each feature undone: (config fields to replace, every layer's weight views to replace, or a function of
# the Runner giving the resident layers' views)
ABLATIONS = {
    "mixtral": {"no renormalisation": ({"norm_topk_prob": False}, {})},
    "mixtral-window": {"window dropped": (lambda r: {"attention": settings(r, window=None)}, {})},
    "qwen2_moe": {
        "shared expert dropped": ({}, {"shared_gate_up": None, "shared_down": None, "shared_gate": None}),
        "shared expert ungated": ({}, {"shared_gate": None}),
        "renormalised": ({"norm_topk_prob": True}, {}),
        "q/k/v biases dropped": ({}, {"qkv_bias": None}),
        "window dropped": (lambda r: {"attention": settings(r, window=None)}, {}),
    },
    "glm4_moe": {
        "correction bias dropped": ({}, lambda r: replaced_layers(r, router_bias=torch.zeros(8))),
        "no group limit": ({"topk_group": 4}, {}),
        "no routed scaling": ({"routed_scaling_factor": 1.0}, {}),
        "no renormalisation": ({"norm_topk_prob": False}, {}),
        "shared experts dropped": ({}, {"shared_gate_up": None, "shared_down": None}),
        "partial RoPE as whole": (lambda r: {"ropes": ropes_whole(r)}, {}),
        "dense first layer dropped": ({}, dense_layer_dropped),
        "q/k/v biases dropped": ({}, {"qkv_bias": None}),
    },
    "glm4_moe-qk-norm": {"q/k norms dropped": ({}, {"q_norm": None, "k_norm": None})},
}


@pytest.mark.parametrize("name, ablation", [(v, a) for v, table in ABLATIONS.items() for a in table])
def test_every_feature_decides_some_loss(family, name, ablation):
    # measured: the right models 1.7e-3 (mixtral-window) to 6.3e-3 (glm4_moe); the ablations 4.7e-2 (partial RoPE as
    # whole) to 0.15 (q/k/v biases dropped)
    path, reference, r = family(name)
    fields, weights = ABLATIONS[name][ablation]
    fields = fields(r) if callable(fields) else fields
    layers = weights(r) if callable(weights) else replaced_layers(r, **weights)
    cfg, resident = r.cfg, r.streamer.resident
    try:  # the session's Runner, restored whatever happens
        r.cfg, r.streamer.resident = dataclasses.replace(cfg, **fields), layers
        assert max_rel_err(losses(r), reference) > 3 * TOLERANCE
    finally:
        r.cfg, r.streamer.resident = cfg, resident


ROUTERS = {"mixtral": ("MixtralTopKRouter", dict(num_local_experts=16)),
           "qwen2_moe": ("Qwen2MoeTopKRouter", dict(num_experts=16)),
           "glm4_moe": ("Glm4MoeTopkRouter", dict(n_routed_experts=16, n_group=4, topk_group=2))}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_each_router_is_transformers_own_bit_for_bit_ties_included(name):
    # the family's router in transformers against prefill's on the same input: 16 experts, each two of them with the
    # same router row (and correction bias), so that every score ties with another; a top-3, so that the third
    # expert's twin ties with it at the edge of the choice (and GLM's groups of 4, 2 of them kept): the same experts in
    # the same order, the same weights. Which of two tied scores is kept is torch.topk's rule, and its alone
    import importlib
    import transformers
    prefix, keywords, _ = VARIANTS[name]
    module, counts = ROUTERS[name]
    config = getattr(transformers, f"{prefix}Config")(**GEOMETRY, **keywords | counts | dict(num_experts_per_tok=3))
    cfg = prefill.ModelConfig.from_json(json.loads(config.to_json_string()))
    sigmoid = cfg.router.kind == "sigmoid"
    router = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), module)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, GEOMETRY["hidden_size"], generator=gen).repeat_interleave(2, 0) / 8)
        if sigmoid:  # float32, as transformers keeps it
            router.e_score_correction_bias.copy_((torch.rand(8, generator=gen) * 0.2).repeat_interleave(2))
        else:
            router.to(torch.bfloat16)
        h = torch.randn(300, GEOMETRY["hidden_size"], generator=gen).to(torch.bfloat16)
        _, weights, chosen = router(h)
    w = prefill.LayerWeights(router=router.weight.detach(),
                             router_bias=router.e_score_correction_bias if sigmoid else None)
    top, ours = (prefill.route_sigmoid if sigmoid else prefill.route_softmax)(h, w, cfg.router)
    assert torch.equal(ours, chosen) and torch.equal(top.to(weights.dtype), weights)
    twin_left_out = ((chosen ^ 1)[:, :, None] != chosen[:, None, :]).all(-1).any(-1)  # a tie at the choice's edge
    assert twin_left_out.sum() > 100 and (top[:, :, None] == top[:, None, :]).sum() - top.numel() > 100


# ----------------------------------------------------------------------------- the layer as transformers holds it

@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "glm4_moe"])
def test_layers_are_viewed_as_transformers_holds_them(family, name):
    # save_pretrained wrote the Hub's per-expert tensors (Mixtral's block_sparse_moe.experts.{e}.w1, w3, w2), which
    # transformers loads fused (experts.gate_up_proj [experts, 2 I, H]); it keeps the sigmoid router's weight and
    # correction bias float32 in a bf16 model: prefill's views of its layer buffers are exactly those
    from transformers import AutoModelForCausalLM
    path, _, r = family(name)
    model, cfg = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), r.cfg
    for i, kind in enumerate(cfg.layer_kinds):
        w, mlp = layer_weights(path, cfg, i), model.model.layers[i].mlp
        if kind == "mlp":
            assert w.router is None and torch.equal(w.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            continue
        assert w.router.dtype == mlp.gate.weight.dtype and torch.equal(w.router, mlp.gate.weight)
        assert torch.equal(w.gate_up, mlp.experts.gate_up_proj) and torch.equal(w.down, mlp.experts.down_proj)
        shared = {"qwen2_moe": getattr(mlp, "shared_expert", None), "glm4_moe": getattr(mlp, "shared_experts", None)}
        if name == "mixtral":
            assert w.shared_gate_up is w.shared_down is w.shared_gate is w.router_bias is None
            continue
        assert torch.equal(w.shared_gate_up, torch.cat([shared[name].gate_proj.weight, shared[name].up_proj.weight]))
        assert torch.equal(w.shared_down, shared[name].down_proj.weight)
        if name == "qwen2_moe":
            assert w.router_bias is None and torch.equal(w.shared_gate, mlp.shared_expert_gate.weight)
        else:  # float32, read from the bf16 files save_pretrained wrote here, upcast exactly as transformers does
            assert w.router.dtype == w.router_bias.dtype == torch.float32 and w.shared_gate is None
            assert torch.equal(w.router_bias, mlp.gate.e_score_correction_bias) and w.router_bias.abs().min() > 0
    # GLM's float32 router takes two bf16 elements a value, its start aligned as every tensor group's
    if name == "glm4_moe":
        layout = cfg.layouts["moe"]
        (start, _), (bias, _) = layout["mlp.gate.weight"], layout["mlp.gate.e_score_correction_bias"]
        assert start % 64 == 0 and bias == start + 2 * 8 * 64 and layout["mlp.experts.0.gate_proj.weight"][0] % 64 == 0


@pytest.fixture(scope="module")
def glm_float32(family, tmp_path_factory):
    """GLM's checkpoint as transformers saves a model it loaded in bf16 (the router's weight and correction bias
    float32 in the file), with an MTP layer as GLM-4.5's releases ship it: tensors of layer num_hidden_layers, which
    transformers ignores."""
    from transformers import AutoModelForCausalLM
    path, _, _ = family("glm4_moe")
    out = tmp_path_factory.mktemp("glm-float32")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(out)
    for f in path.glob("tokenizer*"):
        shutil.copy(f, out)
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    H = GEOMETRY["hidden_size"]
    tensors |= {"model.layers.3.eh_proj.weight": torch.randn(H, 2 * H).to(torch.bfloat16),
                "model.layers.3.enorm.weight": torch.ones(H, dtype=torch.bfloat16),
                "model.layers.3.mlp.gate.weight": torch.randn(8, H)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return out


def test_the_float32_router_streams_from_bf16_or_float32_files_bit_for_bit(family, glm_float32):
    # every layer streamed from the bf16 files (cast on reading: copied, not locked in place) or from the float32 ones
    # (held as the files hold them: locked in place), the same bits as resident, and the MTP layer never read
    path, reference, r = family("glm4_moe")
    expected = losses(r)
    for folder, load in [(path, "copied"), (glm_float32, "mapped")]:
        streamed = runner(folder, gpu_memory_gib=0)
        assert streamed.plan.streamed_layers == (0, 1, 2) and streamed.load_mode == load
        assert losses(streamed) == expected


@pytest.mark.parametrize("name", ["mixtral-window", "qwen2_moe"])
def test_every_layer_streamed_equals_every_layer_resident(family, name):
    path, _, r = family(name)
    streamed = runner(path, gpu_memory_gib=0)
    assert streamed.plan.streamed_layers == (0, 1, 2) and losses(streamed) == losses(r)


def test_the_protocol_streams_glm_from_its_float32_router(glm_float32, family):
    _, reference, _ = family("glm4_moe")
    p = subprocess.run([sys.executable, str(ROOT / "prefill.py"), "--model", str(glm_float32), "--device", "cpu",
                        "--gpu-memory", "0"], input=json.dumps(TEXTS) + "\n", capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "ready" and len(lines) == 1 + len(TEXTS)
    assert max_rel_err([float(x) for x in lines[1:]], reference) < TOLERANCE
    assert "loaded 3-layer glm4_moe" in p.stderr and "mapped" in p.stderr and len(p.stderr.splitlines()) <= 6


def test_glm_in_fp8_matches_transformers_and_streams_as_resident(family, tmp_path):
    # test_fp8's quantizer: every projection of a layer (routed and shared experts, the dense MLP, attention) per
    # 128x128 block with its scale grid; the router and its correction bias stay unquantized, held float32. The truth is
    # transformers' own float32 load of the FP8 files
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from test_fp8 import quantize_checkpoint
    path, _, _ = family("glm4_moe")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    quantize_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference = reference_losses(model, AutoTokenizer.from_pretrained(tmp_path), TEXTS)
    r = runner(tmp_path)
    held = {name: dtype for name, _, _, dtype in r.cfg.held[1]}
    assert held["mlp.gate.weight"] == held["mlp.gate.e_score_correction_bias"] == torch.float32
    assert held["mlp.experts.0.up_proj.weight"] == held["mlp.shared_experts.down_proj.weight"] == prefill.FP8
    assert max_rel_err(losses(r), reference) < TOLERANCE
    streamed = runner(tmp_path, gpu_memory_gib=0)
    assert streamed.plan.streamed_layers == (0, 1, 2) and losses(streamed) == losses(r)


# ----------------------------------------------------------------------------- config.json

def test_which_layers_are_dense_and_which_slide_is_transformers_rule():
    # each decoder layer's own choice of its feed-forward, and the config's layer_types, against prefill's reading of
    # the config.json transformers saves: Qwen2-MoE's decoder_sparse_step, mlp_only_layers and its window on the even
    # layers below max_window_layers; GLM's first_k_dense_replace
    from transformers import Glm4MoeConfig, Qwen2MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeMoE
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeSparseMoeBlock
    cases = [(Qwen2MoeConfig, Qwen2MoeDecoderLayer, Qwen2MoeSparseMoeBlock,
              dict(num_experts=8, **EXPERTS, decoder_sparse_step=step, mlp_only_layers=only,
                   use_sliding_window=sliding, sliding_window=7, max_window_layers=below))
             for step, only, sliding, below in [(1, [], False, 28), (2, [], True, 28), (3, [1, 4], True, 3),
                                                (1, [0, 5], True, 0), (7, [], False, 2)]]
    cases += [(Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeMoE, dict(n_routed_experts=8, **EXPERTS,
                                                                    first_k_dense_replace=first))
              for first in (0, 1, 2, 9)]
    for config_class, layer_class, moe_class, keywords in cases:
        config = config_class(**GEOMETRY | dict(num_hidden_layers=6), **keywords)
        with torch.device("meta"):
            theirs = tuple("moe" if isinstance(layer_class(config, i).mlp, moe_class) else "mlp" for i in range(6))
        saved = json.loads(config.to_json_string())
        for spelled in (saved, {k: v for k, v in saved.items() if k != "layer_types"}):  # derived, or as saved
            cfg = prefill.ModelConfig.from_json(spelled)
            assert cfg.layer_kinds == theirs, keywords
            windows = [7 if t == "sliding_attention" else None for t in getattr(config, "layer_types", ["full"] * 6)]
            assert [how.window for how in cfg.attention] == windows, keywords


def test_configs_as_the_hub_spells_them():
    from bench.make_checkpoint import GLM4_5_AIR, MIXTRAL_8X7B, QWEN1_5_MOE_A2_7B
    # GLM-4.5-Air's (transformers 4's spelling: rope_theta and partial_rotary_factor at the top): RoPE on 64 of 128
    # channels, its one dense layer, the sigmoid router's float32 tensors, one shared expert
    glm = prefill.ModelConfig.from_json(interact.config_json(GLM4_5_AIR))
    assert glm.ropes[0] == prefill.Rope(1e6, partial=0.5) and glm.ropes[0].inv_freq(128).shape == (32,)
    assert glm.layer_kinds == ("mlp",) + ("moe",) * 45 and glm.qkv_bias and not glm.o_bias and not glm.qk_norm
    assert glm.router == prefill.Router("sigmoid", 8, True, 1, 1, 1.0) and glm.rms_norm_eps == 1e-5
    assert glm.router.describe() == "sigmoid top-8, correction bias, renormalised"  # the doctor's words
    assert glm.shared_expert == "mlp.shared_experts" and glm.shared_intermediate_size == 1408
    assert glm.tensor_dtypes == {"mlp.gate.weight": torch.float32, "mlp.gate.e_score_correction_bias": torch.float32}
    # no partial_rotary_factor: Glm4MoeConfig's default, half; the experts' count spelled num_local_experts
    spelled = {k: v for k, v in interact.config_json(GLM4_5_AIR).items() if k not in ("partial_rotary_factor",
                                                                                         "n_routed_experts")}
    assert prefill.ModelConfig.from_json(spelled | {"num_local_experts": 128}) == glm
    mixtral = prefill.ModelConfig.from_json(interact.config_json(MIXTRAL_8X7B))
    assert mixtral.router == prefill.Router("softmax", 2, True) and mixtral.moe_intermediate_size == 14336
    assert {how.window for how in mixtral.attention} == {None} and mixtral.layer_kinds == ("moe",) * 32
    assert "block_sparse_moe.experts.7.w2.weight" in mixtral.layer_layout and mixtral.ropes[0].theta == 1e6
    spelled = {k: v for k, v in interact.config_json(MIXTRAL_8X7B).items() if k != "num_local_experts"}
    assert prefill.ModelConfig.from_json(spelled | {"num_experts": 8}) == mixtral
    qwen = prefill.ModelConfig.from_json(interact.config_json(QWEN1_5_MOE_A2_7B))
    assert qwen.router == prefill.Router("softmax", 4, False) and qwen.shared_expert_gate and qwen.qkv_bias
    assert prefill.Router("sigmoid", 8, True, 8, 4, 2.5).describe() == (  # DeepSeek-V3's
        "sigmoid top-8 among the best 4 of 8 groups, correction bias, renormalised, times 2.5")
    assert qwen.shared_intermediate_size == 5632 and "mlp.shared_expert_gate.weight" in qwen.layer_layout


def config_of(model_type, **changes):
    return {**GEOMETRY, "model_type": model_type, **changes}


GLM = dict(n_routed_experts=8, **EXPERTS, n_group=4, topk_group=2)
REFUSED = [
    (config_of("glm4_moe", **GLM, scoring_func="softmax"), "scoring_func is 'softmax'; prefill's router reads"),
    (config_of("glm4_moe", **GLM, topk_method="greedy"), "topk_method is 'greedy'"),
    (config_of("glm4_moe", **GLM | dict(n_group=3)), "8 experts in n_group 3 groups"),
    (config_of("glm4_moe", **GLM | dict(n_group=8, topk_group=8)), "expected groups of at least 2 experts"),
    (config_of("glm4_moe", **GLM | dict(topk_group=5)), "topk_group 5 of them kept"),
    (config_of("glm4_moe", **GLM | dict(topk_group=1, num_experts_per_tok=3)), "no more experts chosen than kept"),
    (config_of("glm4_moe", **GLM, num_local_experts=16), "n_routed_experts and num_local_experts disagree"),
    (config_of("glm4_moe", **GLM, partial_rotary_factor=0.1), "partial_rotary_factor 0.1 rotates 1 of head_dim"),
    (config_of("glm4_moe", **GLM, n_shared_experts=-1), "n_shared_experts is -1"),
    (config_of("mixtral", hidden_act="gelu_pytorch_tanh"), "prefill's experts are SwiGLU"),
    (config_of("qwen2_moe", num_experts=8, **EXPERTS, shared_expert_intermediate_size=48,
               layer_types=["sliding_attention"] * 3), "use_sliding_window is off"),
    (config_of("qwen2_moe", num_local_experts=8, **EXPERTS, shared_expert_intermediate_size=48), "lacks num_experts"),
    (config_of("qwen3_next", num_experts=8), "'qwen3_next', a mixture of experts (of those prefill runs qwen3_moe, "
                                             "qwen2_moe, mixtral, glm4_moe, deepseek_v3, gpt_oss only)"),
    (config_of("minimax", num_local_experts=8), "model_type is 'minimax', a mixture of experts"),
    (config_of("llama4", text_config={}), "model_type is 'llama4'"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_is_not_built_is_refused_in_one_line(config, message):
    with pytest.raises(prefill.UserError) as e:
        prefill.ModelConfig.from_json(config, "config.json")
    assert message in str(e.value) and str(e.value).startswith("config.json") and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- fused kernels in Triton's interpreter

PARTIAL_ROPE_KERNELS = """
import dataclasses, json, math, sys, torch, prefill
cpu = torch.device("cpu")
report = {}
good = prefill.head_norm_rope_triton
# the check's other kernels, interpreted at a program a token and checked elsewhere, stand in as PyTorch's own
for kernel, torch_kernel in [("rms_norm", prefill.rms_norm), ("gated_act", prefill.gated_act),
                             ("token_nll", prefill.token_nll)]:
    setattr(prefill, f"{kernel}_triton", torch_kernel)
prefill.combine_triton = prefill.combine

def whole_head(x, w, cos, sin, eps, offset, interleave):  # every channel rotated, with the tables of the whole head
    rope = dataclasses.replace(cfg.ropes[0], partial=1.0)
    return good(x, w, *prefill.rope_tables(torch.arange(x.shape[0]), rope, x.shape[2]), eps, offset, interleave)

def tail_unnormed(x, w, cos, sin, eps, offset, interleave):  # the channels that do not rotate pass through unnormed
    out = good(x, w, cos, sin, eps, offset, interleave)
    out[..., cos.shape[1]:] = x[..., cos.shape[1]:]
    return out

for name, config in json.loads(sys.argv[1]).items():
    cfg = prefill.ModelConfig.from_json(config)
    # a bug each: without a q/k norm the tail passes through as it came
    bugs = {"tail unnormed": tail_unnormed} if cfg.qk_norm else {"whole head rotated": whole_head}
    for bug, kernel in {"good": good, **bugs}.items():
        prefill.head_norm_rope_triton = kernel
        report[f"{name} {bug}"] = max(e for k, _, e in prefill.kernel_checks(cpu, cfg) if k == "head_norm_rope")
prefill.head_norm_rope_triton = good
# GLM's FP8 layer dequantized in one launch, the float32 router copied among its tensors: bit for bit the PyTorch code
cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[2]))
parts, layout = cfg.held[1], cfg.layouts["moe"]
gen = torch.Generator().manual_seed(0)
held = torch.randint(256, (cfg.layer_nbytes[1],), generator=gen, dtype=torch.uint8)
for name, offset, shape, dtype in parts:
    n = math.prod(shape)
    if dtype == prefill.FP8:
        held[offset:offset + n][(held[offset:offset + n] & 127) == 127] = 0  # no NaN
    elif dtype == torch.float32:  # a float32 router and bias, and the FP8 weights' scales
        prefill.typed(held, offset, n, dtype).copy_(torch.randn(n, generator=gen))
layer = prefill.fp8_layer(parts, layout, cpu)
got, want = (torch.zeros(cfg.dequantized_bytes // 2, dtype=torch.int16) for _ in range(2))
prefill.dequantize_layer_triton(held, got.view(torch.bfloat16), layer)
prefill.dequantize_layer(held, want.view(torch.bfloat16), layer)
start, _ = layout["mlp.gate.e_score_correction_bias"]
router = prefill.typed(want.view(torch.bfloat16), 2 * start, 8, torch.float32)
report["fp8"] = {"equal": torch.equal(got, want), "router": torch.equal(router, prefill.typed(
    held, dict((n, o) for n, o, _, _ in parts)["mlp.gate.e_score_correction_bias"], 8, torch.float32))}
print(json.dumps(report))
"""


def test_partial_rope_and_the_float32_router_in_the_fused_kernels(family):
    # the q/k norm and RoPE kernel's partial variant (the first rotary_dim channels rotate, the rest normed only),
    # with and without GLM's q/k norm, passed by its start-up check, which refuses the whole head rotated and the
    # tail left unnormed; and the one-launch FP8 dequantization of a GLM layer copying its float32 router and bias
    configs = {name: json.loads((family(name)[0] / "config.json").read_text())
               for name in ("glm4_moe", "glm4_moe-qk-norm")}
    fp8 = configs["glm4_moe"] | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    p = interpreted(PARTIAL_ROPE_KERNELS, json.dumps(configs), json.dumps(fp8))
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report.pop("fp8") == {"equal": True, "router": True}
    assert max(report[f"{name} good"] for name in configs) <= prefill.CHECK_TOLERANCE, report  # 1.0e-2, 1.7e-2
    assert min(report["glm4_moe whole head rotated"], report["glm4_moe-qk-norm tail unnormed"]) > 4 * \
        prefill.CHECK_TOLERANCE, report  # 2.3, 0.79


# ----------------------------------------------------------------------------- the bench's checkpoints and the plan

@pytest.mark.parametrize("geometry", ["tiny-mixtral", "tiny-qwen1.5-moe", "tiny-glm-4.5-air", "tiny-deepseek-v3",
                                      "tiny-moonlight"])
def test_the_bench_writes_checkpoints_transformers_loads_whole(tmp_path, qwen_tokenizer_dir, geometry):
    # bench/make_checkpoint.py's writer lists prefill's own tensors (Mixtral's by their Hub names, GLM's and
    # DeepSeek-V3's router float32 as transformers keeps it; V3's latent attention): transformers finds every parameter
    # and buffer, nothing missing or unexpected
    from transformers import AutoModelForCausalLM
    from bench.make_checkpoint import checkpoint_bytes, geometry as bench_geometry
    cfg = {**bench_geometry(geometry), "vocab_size": 512}
    interact.write_random_checkpoint(tmp_path, cfg, tokenizer_dir=qwen_tokenizer_dir)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info
    files = load_file(tmp_path / "model.safetensors")
    assert sum(t.nbytes for t in files.values()) == checkpoint_bytes(cfg)
    if geometry in ("tiny-glm-4.5-air", "tiny-deepseek-v3", "tiny-moonlight"):
        assert files["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias,
                           files["model.layers.1.mlp.gate.e_score_correction_bias"])
    r = runner(tmp_path, gpu_memory_gib=0)  # and prefill reads it, every layer streamed
    assert all(math.isfinite(x) for x in r.losses([list(range(3, 40)), list(range(300, 340))]))


def test_the_plan_counts_a_moe_family_s_real_bytes_and_flops():
    # GLM-4.5-Air: a MoE layer is its experts, the shared expert, the float32 router (4 bytes a value), attention with
    # q/k/v biases; the dense first layer is a tenth of it; each token meets 8 experts and the shared one
    from bench.make_checkpoint import GLM4_5_AIR, checkpoint_bytes
    cfg = prefill.ModelConfig.from_json(interact.config_json(GLM4_5_AIR))
    H, E, J, Q, KV = 4096, 128, 1408, 96 * 128, 8 * 128
    attention = 2 * (2 * H * Q + 2 * H * KV + Q + 2 * KV + 2 * H)  # q, o, k, v, their biases, the two norms
    moe = attention + 2 * 3 * (E + 1) * J * H + 4 * (E * H + E)
    assert moe <= cfg.layer_bytes == cfg.layer_nbytes[1] < moe + 2 * 64 * len(cfg.layouts["moe"])
    assert attention + 2 * 3 * 10944 * H <= cfg.layer_nbytes[0] < 0.11 * cfg.layer_bytes
    embed = 2 * 2 * 151936 * H
    assert checkpoint_bytes(GLM4_5_AIR) == moe * 45 + attention + 2 * 3 * 10944 * H + embed + 2 * H
    flops = prefill.layer_flops(cfg, "moe", 1) - prefill.layer_flops(cfg, "mlp", 1) + 6 * 10944 * H
    assert flops == 2 * E * H + 8 * 6 * J * H + 6 * J * H
    # a 16,384-token expert slice's scratch: 6.1 GB at most, of it 0.3 GB the sigmoid router's float32 input and
    # scores, 0.4 GB the shared expert's activations and the routed sum's own buffer
    per_token = prefill.moe_scratch_per_token(cfg)
    assert per_token - prefill.moe_scratch_per_token(dataclasses.replace(
        cfg, router_kind="softmax", shared_expert=None, shared_intermediate_size=0)) == 4 * H + 11 * E + 2 * H + 2 * (
        3 * J + H) + 2
    assert 5.5e9 < prefill.MOE_CHUNK_FACTOR * 4096 * per_token < 6.5e9
    plan = prefill.plan_memory(cfg, 48 * prefill.GiB)
    assert plan.slot_bytes == 2 * cfg.layer_bytes and plan.total_bytes <= 48 * prefill.GiB and 0 in plan.resident_layers


def test_a_mixture_of_experts_attends_in_chunks_of_its_expert_slices_where_they_fit():
    # Qwen3-30B-A3B and GLM-4.5-Air attend in 16,384-token chunks, in the room of their 16,384-token expert slices
    # (the same plan's bytes); DeepSeek-V3's latent attention would need more than its slices: it keeps 4,096; a
    # dense model keeps the setting
    from bench.make_checkpoint import DEEPSEEK_V3, GEOMETRIES, GLM4_5_AIR
    for config, chunk in ((GLM4_5_AIR, 16384), (DEEPSEEK_V3, 4096), (GEOMETRIES["qwen3-30b-a3b"], 16384),
                          (GEOMETRIES["qwen3-32b"], 4096)):
        cfg = prefill.ModelConfig.from_json(interact.config_json(config))
        plan = prefill.plan_memory(cfg, 48 * prefill.GiB)
        assert plan.chunk_tokens == chunk and plan.moe_chunk_tokens == (16384 if cfg.num_experts else 0)
        four_k = prefill.plan_memory(cfg, 48 * prefill.GiB, chunk_tokens=1024)
        assert four_k.chunk_tokens == chunk // 4 and (four_k.working_bytes < plan.working_bytes)


@pytest.mark.parametrize("geometry", ["deepseek-v3", "moonlight-16b-a3b", "glm-4.5-air", "qwen1.5-moe-a2.7b",
                                      "mixtral-8x7b"])
def test_the_moe_bench_s_compute_floor_counts_the_plan_s_flops(geometry):
    # bench/moe_run.py's floor at 1 TFLOP/s for every GEMM: each token's FLOPs as prefill.layer_flops counts them
    # (MLA's q_b and kv_b, the router, the k experts, the shared ones) and lm_head's, and attention's scores and values
    from bench import make_checkpoint, moe_run
    config = make_checkpoint.geometry(geometry)
    cfg = prefill.ModelConfig.from_json(interact.config_json(config))
    unit = {"dense_tflops": {name: 1.0 for name, _, _, _ in prefill.gemm_shapes(cfg)}, "grouped_tflops": {"any": 1.0}}
    counts = [700, 3000]
    flops = sum(counts) * (sum(prefill.layer_flops(cfg, kind, 1) for kind in cfg.layer_kinds)
                           + 2 * cfg.vocab_size * cfg.hidden_size) + make_checkpoint.attention_flops(config, counts)
    assert math.isclose(moe_run.compute_floor_s(cfg, config, counts, unit) * 1e12, flops, rel_tol=1e-12)

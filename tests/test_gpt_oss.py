"""gpt-oss (transformers 5.24, models/gpt_oss) against GptOssForCausalLM on a tiny checkpoint that transformers builds
and saves in bf16 (2 layers, a window of 6 then full attention, 8 experts, top-2), read back by `from_pretrained` in
float32 for the truth; and the same network's experts in MXFP4, as gpt-oss is released, against transformers'
`Mxfp4Config(dequantize=True)` float32 load.

The weights are sharp, so that each of gpt-oss's features moves some text's loss by several tolerances when prefill
leaves it out (test_each_feature_decides_some_loss): attention sinks (a logit per head, of std 2), the window, the
clamp of the SwiGLU (swiglu_limit 3, against gate/up values of std ~3), its (up + 1), gate and up interleaved, the
router's softmax over its top-k alone, the biases, and its RoPE: GptOssConfig's own YaRN (x32 over 4096 positions,
untruncated, cos and sin scaled by 1.35), which config.json then spells out.
"""
import dataclasses
import io
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

import interact
import prefill
from test_families import TEXTS, byte_tokenizer, losses, replaced_layers, runner, settings
from test_fp8 import LAYER_KERNEL_CHECKED_AND_RUN, protocol_losses, rewritten
from test_prefill import TOLERANCE, interpreted, max_rel_err, reference_losses, transformers_losses

CPU = torch.device("cpu")
GEOMETRY = dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                swiglu_limit=3.0, rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
# std x sqrt(fan-in) of each weight (mean and std of the 1-D ones, the embedding's): of seeds 0-7 with these (and
# GptOssConfig's YaRN), one whose right losses stay within half a TOLERANCE while every ablation below misses by over 6
# (seeds 2, 5 and 6 matched within 0.9-1.2 TOLERANCE: a router this flat puts near-ties of its top-2 within bf16's
# reach; seeds 0, 1 and 4 had an ablation missing by 2.0-5.9)
SHARP = {"q_proj": 1.5, "k_proj": 1.5, "v_proj": 1.5, "o_proj": 1.5, "router": 1.0, "gate_up_proj": 3.0,
         "down_proj": 1.0, "lm_head": 2.0, "embed_tokens": (0.0, 0.1), "sinks": (1.0, 2.0), "norm": (1.0, 0.2),
         "proj_bias": (0.0, 0.3), "router_bias": (0.0, 0.5), "gate_up_proj_bias": (0.0, 0.5),
         "down_proj_bias": (0.0, 0.3)}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as the releases say
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def sharp(name, p):
    # (mean, std) of a parameter's draw, by SHARP's key: its module's name (a weight), or its own (sinks, the experts'
    # fused tensors); a weight's std over the root of its fan-in ([out, in], an expert's [experts, in, out])
    key = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    key = ("router_bias" if ".router." in name else "proj_bias") if key == "bias" else \
        "norm" if key.endswith("norm") else key
    fan_in = p.shape[-2 if p.dim() == 3 else -1]
    return SHARP[key] if isinstance(SHARP[key], tuple) else (0.0, SHARP[key] / fan_in ** 0.5)


def build(folder, seed=3):
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**GEOMETRY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(*sharp(name, p))
    model.to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """(folder, transformers' float32 losses of TEXTS, a Runner on it)."""
    folder = build(tmp_path_factory.mktemp("gpt-oss"))
    return folder, transformers_losses(folder, TEXTS), runner(folder)


def mxfp4_copy(path, out):
    """path's bf16 checkpoint in out with its experts in MXFP4 (interact.quantize_mxfp4), each 32 weights first scaled
    by a power of two of their own (2^-2 to 1), so that the scales take five values (122-126) and one applied to the
    wrong weights shows: another network, which transformers' dequantization defines."""
    tensors, gen = load_file(path / "model.safetensors"), torch.Generator().manual_seed(4)
    for name in [n for n in tensors if n.endswith(prefill.MXFP4_WEIGHTS)]:
        w = tensors.pop(name).float()
        E, K, N = w.shape
        factor = 2.0 ** torch.randint(-2, 1, (E, K // 32, N), generator=gen).float()
        tensors[name + "_blocks"], tensors[name + "_scales"] = interact.quantize_mxfp4(
            (w * factor.repeat_interleave(32, 1)).bfloat16())
    return rewritten(path, out, tensors, MXFP4_CONFIG)


def mxfp4_reference_model(path):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


@pytest.fixture(scope="module")
def mxfp4(oss, tmp_path_factory):
    """(folder, transformers' float32 model of it, its losses of TEXTS, a Runner on it)."""
    from transformers import AutoTokenizer
    folder = mxfp4_copy(oss[0], tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    model = mxfp4_reference_model(folder)
    return folder, model, reference_losses(model, AutoTokenizer.from_pretrained(folder), TEXTS), runner(folder)


def layer_weights(path, cfg, layer):
    # one layer as the streamer hands it out: read as held, dequantized (MXFP4) into its bf16 layout, viewed
    ckpt = prefill.Checkpoint(path)
    held = torch.zeros(cfg.layer_nbytes[layer] // 2, dtype=prefill.DTYPE)
    for name, offset, count, dtype in prefill.layer_tensors(cfg, layer):
        ckpt.read(name, prefill.typed(held, offset, count, dtype))
    if not cfg.quantized:
        return prefill.layer_views(held, cfg, "moe")
    out = torch.zeros(cfg.dequantized_bytes // 2, dtype=prefill.DTYPE)
    prefill.dequantize_layer(held, out, prefill.fp8_layer(cfg.held[layer], cfg.layouts["moe"], CPU, cfg.mxfp4))
    return prefill.layer_views(out, cfg, "moe")


# ----------------------------------------------------------------------------- bf16, against transformers

def test_matches_transformers_and_reads_its_layout(oss):
    # measured: 5.4e-3
    path, reference, r = oss
    cfg = r.cfg
    assert (cfg.model_type, cfg.router, cfg.fused_experts, cfg.norm_style, cfg.num_experts, cfg.moe_intermediate_size) \
        == ("gpt_oss", prefill.Router("topk_softmax", 2), True, prefill.NORM_FLOAT32, 8, 64)
    assert cfg.ropes[0] == prefill.Rope(150000.0, "yarn", 32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                        beta_slow=1.0, truncate=False, attention_factor=0.1 * math.log(32) + 1)
    assert cfg.expert_activation == prefill.ClampedSwiGLU(1.702, 3.0) and cfg.qkv_bias and cfg.o_bias
    assert [(how.window, how.sinks) for how in cfg.attention] == [(6, True), (None, True)]
    assert max_rel_err(losses(r), reference) < TOLERANCE
    from transformers import GptOssForCausalLM
    model = GptOssForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for i in range(2):  # the experts' [experts, out, in] views of transformers' own [experts, in, out] tensors
        w, theirs = layer_weights(path, cfg, i), model.model.layers[i]
        experts = theirs.mlp.experts
        assert torch.equal(w.gate_up, experts.gate_up_proj.transpose(1, 2)) and w.gate_up.stride(1) == 1
        assert torch.equal(w.down, experts.down_proj.transpose(1, 2))
        assert torch.equal(w.gate_up_bias, experts.gate_up_proj_bias)
        assert torch.equal(w.down_bias, experts.down_proj_bias)
        assert torch.equal(w.router, theirs.mlp.router.weight) and torch.equal(w.router_bias, theirs.mlp.router.bias)
        assert torch.equal(w.sinks, theirs.self_attn.sinks)


def without_plus_one(gate_up, activation):  # (up + 1) as up
    gate = gate_up[:, ::2].clamp(max=activation.limit)
    return gate_up[:, 1::2].clamp(-activation.limit, activation.limit) * (gate * torch.sigmoid(gate * activation.alpha))


def gate_and_up_as_halves(gate_up, activation):  # gate the first half of the columns, up the second (Qwen's layout)
    return GATED_ACT(torch.stack(gate_up.chunk(2, dim=-1), dim=-1).flatten(-2), activation)


def softmax_then_top_k(h, w, router):  # a softmax over every expert's (biased) logits, then their top-k (Qwen's order)
    return torch.softmax(prefill.F.linear(h, w.router, w.router_bias), -1, dtype=torch.float32).topk(router.top_k, -1)


GATED_ACT = prefill.gated_act
# each feature undone: (config fields to replace, weight views to replace, gated_act in its place)
ABLATIONS = {
    "YaRN as the default RoPE": lambda r: ({"ropes": tuple(prefill.Rope(rope.theta) for rope in r.cfg.ropes)}, {},
                                           None),
    "sinks dropped": lambda r: ({"attention": settings(r, sinks=False)}, {"sinks": None}, None),
    "window dropped": lambda r: ({"attention": settings(r, window=None)}, {}, None),
    "clamp dropped": lambda r: ({"expert_activation": prefill.ClampedSwiGLU(1.702, 1e9)}, {}, None),
    "(up + 1) as up": lambda r: ({}, {}, without_plus_one),
    "gate and up as halves": lambda r: ({}, {}, gate_and_up_as_halves),
    "softmax over every expert, then top-k": lambda r: ({"router_kind": "softmax-first"}, {}, None),
    "experts' biases dropped": lambda r: ({}, {"gate_up_bias": None, "down_bias": None}, None),
    "router's bias dropped": lambda r: ({}, {"router_bias": None}, None),
    "attention's biases dropped": lambda r: ({}, {"qkv_bias": None, "o_bias": None}, None),
}


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_each_feature_decides_some_loss(oss, ablation, monkeypatch):
    # measured (in tolerances): YaRN 19, sinks 58, window 6.4, clamp 24, (up + 1) 26, halves 56, softmax first 9.4,
    # experts' biases 14, router's 11, attention's 27
    _, reference, r = oss
    fields, weights, act = ABLATIONS[ablation](r)
    cfg, resident, experts = r.cfg, r.streamer.resident, r.run_experts
    try:
        r.cfg, r.streamer.resident = dataclasses.replace(cfg, **fields), replaced_layers(r, **weights)
        r.run_experts = prefill.make_experts(r.experts, None, r.cfg.expert_activation)  # the activation is the kernel's
        if act is not None:
            monkeypatch.setattr(prefill, "gated_act", act)
        monkeypatch.setitem(prefill.ROUTES, "softmax-first", softmax_then_top_k)
        assert max_rel_err(losses(r), reference) > 3 * TOLERANCE
    finally:
        r.cfg, r.streamer.resident, r.run_experts = cfg, resident, experts


def test_every_layer_streamed_equals_resident_and_continuations_match(oss):
    # the experts and sinks cross with their layer; a prefix tree's requests (a shared prefix, one- and multi-token
    # continuations, their token log-probs) against transformers' float32 log-likelihoods
    from test_eval import reference_loglikelihood
    from transformers import AutoModelForCausalLM
    path, _, r = oss
    streamed = runner(path, gpu_memory_gib=0)
    assert streamed.plan.streamed_layers == (0, 1) and losses(streamed) == losses(r)
    # of seeds 0-11 the one whose tokens route furthest from bf16's near-ties of the router's top-k (logits closer
    # than a bf16 step, which bf16 and float32 order differently): 2.8e-3 at most; the others 3.8e-3 to 8.9e-2
    gen = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, GEOMETRY["vocab_size"], (n,), generator=gen).tolist()
    prefix = ids(20)
    requests = [(prefix + ids(5), c) for c in ([7], ids(4))] + [(prefix, ids(9))]
    results = r.loglikelihoods(requests, token_logprobs=True)
    assert r.stats["tokens_computed"] < r.stats["tokens_requested"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for got, request in zip(results, requests):
        want = reference_loglikelihood(model, *request)[0]
        assert abs(got.logprob - want) < TOLERANCE * abs(want) and len(got.token_logprobs) == len(request[1])
        assert math.fsum(got.token_logprobs) == pytest.approx(got.logprob, abs=1e-9)
    assert streamed.loglikelihoods(requests, token_logprobs=True) == results


def test_norm_router_and_activation_are_transformers_modules_bit_for_bit():
    # GptOssRMSNorm (w·x̂ in float32: Llama's cast first differs), GptOssTopKRouter (its bf16 softmax of the top-k
    # logits is float32 math rounded once, as prefill's), GptOssExperts._apply_gate, each in bf16 on the same inputs
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssRMSNorm, GptOssTopKRouter
    gen = torch.Generator().manual_seed(0)
    config = GptOssConfig(**dict(GEOMETRY, num_experts_per_tok=4))
    x = (torch.randn(500, 64, generator=gen) * 3).to(prefill.DTYPE)
    norm, router = GptOssRMSNorm(64, eps=1e-5).to(prefill.DTYPE), GptOssTopKRouter(config).to(prefill.DTYPE)
    with torch.no_grad():
        norm.weight.normal_(1, 0.5, generator=gen)
        router.weight.normal_(0, 0.3, generator=gen)
        router.bias.normal_(0, 0.5, generator=gen)
        theirs, (_, scores, chosen) = norm(x), router(x)
    assert torch.equal(prefill.rms_norm(x, norm.weight, 1e-5, prefill.NORM_FLOAT32), theirs)
    assert not torch.equal(prefill.rms_norm(x, norm.weight, 1e-5, prefill.NORM_CAST), theirs)
    weights, experts = prefill.route(x, prefill.LayerWeights(router=router.weight, router_bias=router.bias),
                                     prefill.Router("topk_softmax", 4))
    ascending, order = chosen.sort(dim=-1)
    assert torch.equal(experts, ascending) and torch.equal(weights, scores.gather(1, order))
    gate_up = (torch.randn(500, 128, generator=gen) * 3).to(prefill.DTYPE)  # the clamp at 3 bites
    assert torch.equal(prefill.gated_act(gate_up, prefill.ClampedSwiGLU(1.702, 3.0)),
                       GptOssExperts(config)._apply_gate(gate_up))


def test_half_width_rope_is_rotate_half_bit_for_bit():
    # gpt-oss's _apply_rotary_emb (x1 cos - x2 sin, x2 cos + x1 sin on half-width tables) against prefill's
    # rotate_half on the same tables doubled: the same products and sums, so the same bf16 roundings
    from transformers.models.gpt_oss.modeling_gpt_oss import _apply_rotary_emb
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 4, 64, generator=gen) * 3).to(prefill.DTYPE)
    cos, sin = prefill.rope_tables(torch.arange(300), prefill.Rope(150000.0), 64)
    theirs = _apply_rotary_emb(x, cos[:, None, :32], sin[:, None, :32])
    assert torch.equal(prefill.apply_rope(x, cos, sin), theirs)


# ----------------------------------------------------------------------------- what is refused, what is offered

def test_what_is_not_built_is_refused_in_one_line(oss):
    saved = json.loads((oss[0] / "config.json").read_text())
    for change, says in [
        ({"quantization_config": {"quant_method": "fp8"}}, "a gpt_oss in block-wise FP8 is not built"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config 'gptq'"),
        ({"intermediate_size": 48, "quantization_config": MXFP4_CONFIG},
         "an MXFP4 weight's input width 48 (mlp.experts.down_proj, shape [8, 48, 64]) is not a multiple of its 32"),
        ({"num_local_experts": 4, "num_experts": 8}, "num_local_experts and num_experts disagree"),
    ]:
        with pytest.raises(prefill.UserError, match=re.escape(says)) as e:
            prefill.ModelConfig.from_json({**saved, **change})
        assert str(e.value).startswith("config.json") and "\n" not in str(e.value)
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "vocab_size": 100, "quantization_config": MXFP4_CONFIG}
    with pytest.raises(prefill.UserError, match="quant_method mxfp4 quantizes gpt_oss's experts .*; not a qwen3's"):
        prefill.ModelConfig.from_json(qwen3)
    # transformers' GptOssConfig defaults where config.json is silent: its YaRN (rope_parameters null too), its 8 KV
    # heads, 1e-5, the window of 128
    assert prefill.ModelConfig.from_json({**saved, "rope_parameters": None}).ropes == oss[2].cfg.ropes
    sparse = {k: v for k, v in saved.items() if k not in ("num_key_value_heads", "rms_norm_eps", "sliding_window")}
    cfg = prefill.ModelConfig.from_json({**sparse, "num_attention_heads": 16})
    assert (cfg.num_key_value_heads, cfg.rms_norm_eps, cfg.attention[0].window) == (8, 1e-5, 128)


def test_backends_without_sinks_are_not_offered():
    cfg = prefill.ModelConfig.from_json(json.loads(json.dumps({"model_type": "gpt_oss", **GEOMETRY})))
    for family in ("nvidia", "rdna3"):
        kinds = {kind for _, kind, _ in prefill.attention_candidates("auto", family, cfg)}
        assert kinds == {"triton", "sdpa"}, family
        for kind in ("flash", "torch-flash") + (("cudnn",) if family == "nvidia" else ()):
            with pytest.raises(prefill.UserError, match=f"attention backend '{kind}' has no sinks"):
                prefill.attention_candidates(kind, family, cfg)
    assert prefill.attention_tiles("rdna3", cfg) == prefill.RDNA3_VARIANT_TILES


def test_the_experts_check_runs_gpt_oss_s_experts_and_the_fused_ones_are_offered(monkeypatch):
    # the start-up check of the expert kernels on gpt-oss's layout (transposed views, biases, a clamp that bites):
    # the grouped GEMMs pass, their biases or the clamped SwiGLU left out are refused; the fused experts, which compute
    # both in their epilogues, are offered on a GPU (test_fused_moe.py: checked, and their planted bugs refused)
    cfg = prefill.ModelConfig.from_json(json.loads(json.dumps({"model_type": "gpt_oss", **GEOMETRY})))
    candidates = prefill.expert_candidates("auto", CPU, cfg, 4096)
    good = prefill.check_experts(candidates, CPU, cfg)
    assert [e["name"] for e in good] == ["grouped_mm", "loop"], good
    assert all(e["experts"] is not None and e["error"] < prefill.CHECK_TOLERANCE / 2 for e in good), good
    make, biased = prefill.make_experts, prefill.biased
    for bug, patch in {"biases dropped": ("biased", lambda rows, bias, experts: rows),
                       "SiLU for the clamp": ("make_experts", lambda kind, tile=None, activation="silu": make(kind))
                       }.items():
        monkeypatch.setattr(prefill, *patch)
        [entry] = prefill.check_experts([("loop", "loop", None)], CPU, cfg)
        assert entry["experts"] is None and "differs from float32 experts" in entry["reason"], (bug, entry)
        monkeypatch.setattr(prefill, "make_experts", make)
        monkeypatch.setattr(prefill, "biased", biased)
    monkeypatch.setattr(prefill, "gpu_family", lambda device: "nvidia")
    monkeypatch.setattr(prefill, "grouped_mm_native", lambda device: True)
    names = [name for name, _, _ in prefill.expert_candidates("auto", torch.device("cuda"), cfg, 16384)]
    assert names[0] == "grouped_mm" and names[-1] == "loop" and names[1].startswith("fused"), names
    assert [c[2] for c in prefill.expert_candidates("fused", torch.device("cuda"), cfg, 16384)] == \
        prefill.fused_tiles("nvidia", cfg, 16384)


def test_the_plan_counts_mxfp4_s_bytes_its_scratch_and_a_201k_vocabulary():
    # gpt-oss-120b's geometry: 4.25 bits an expert weight (1.75 GB a layer, 6.43 GB in bf16: the scratch each is
    # dequantized into), loss chunks of 667 tokens' float32 logits (201,088 of them: 512 MiB), 18 of 36 layers streamed
    # under a 48 GiB budget
    from bench import make_checkpoint
    raw = interact.config_json(make_checkpoint.geometry("gpt-oss-120b"))
    bf16, mxfp4 = (prefill.ModelConfig.from_json({**raw, **quantized}) for quantized in (
        {}, {"quantization_config": MXFP4_CONFIG}))
    experts = 128 * 3 * 2880 * 2880
    assert mxfp4.layer_bytes - (bf16.layer_bytes - 2 * experts) == pytest.approx(experts * 4.25 / 8, rel=1e-4)
    assert mxfp4.dequantized_bytes == bf16.layer_bytes == pytest.approx(6.43e9, rel=1e-3)
    plan = prefill.plan_memory(mxfp4, int(46.5 * prefill.GiB))
    assert plan.loss_chunk_tokens == 667 and plan.loss_chunk_tokens * 4 * 201088 <= prefill.LOGITS_CHUNK_BYTES
    assert len(plan.streamed_layers) == 18 and plan.total_bytes <= 46.5 * prefill.GiB
    assert plan.working_bytes > mxfp4.dequantized_bytes + plan.loss_chunk_tokens * 201088 * 10


# ----------------------------------------------------------------------------- MXFP4, against transformers

def test_mxfp4_is_transformers_dequantization_bit_for_bit_and_its_network(oss, mxfp4, monkeypatch):
    # every dequantized expert weight is transformers' own (its float32 load: the same values, all exact in bf16), the
    # losses its network's; a scale off by one, or the nibbles read the other way round, miss. Measured: 3.9e-3;
    # the scale 0.39, the nibbles 0.40
    path, model, reference, r = mxfp4
    cfg = r.cfg
    files = load_file(path / "model.safetensors")
    codes = files["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert set((codes & 15).flatten().tolist()) == set((codes >> 4).flatten().tolist()) == set(range(16))
    assert len(set(torch.cat([t.flatten() for n, t in files.items() if n.endswith("_scales")]).tolist())) >= 5
    assert cfg.mxfp4 and cfg.layer_bytes < 0.5 * oss[2].cfg.layer_bytes  # 4.25 bits an expert weight
    for i in range(2):
        w, experts = layer_weights(path, cfg, i), model.model.layers[i].mlp.experts
        for mine, theirs in ((w.gate_up, experts.gate_up_proj), (w.down, experts.down_proj)):
            assert torch.equal(mine.float(), theirs.transpose(1, 2))
    assert max_rel_err(losses(r), reference) < TOLERANCE
    dequantize = prefill.dequantize_mxfp4
    for bug in (lambda b, s, out: dequantize(b, s + 1, out), lambda b, s, out: dequantize((b << 4) | (b >> 4), s, out)):
        monkeypatch.setattr(prefill, "dequantize_mxfp4", bug)
        assert max_rel_err(losses(r), reference) > 3 * TOLERANCE


def test_mxfp4_held_and_streamed_equals_resident(mxfp4):
    # every layer streamed as MXFP4 bytes (pinned copies) and dequantized in its slot: the resident run's bits
    path, _, _, r = mxfp4
    ids = r.tokenize(TEXTS)
    streamed = runner(path, gpu_memory_gib=0, load="copy")
    assert streamed.plan.streamed_layers == (0, 1) and streamed.losses(ids) == r.losses(ids)
    assert streamed.stats["streamed_bytes"] == 2 * sum(n * d.itemsize for _, _, n, d in prefill.layer_tensors(r.cfg, 0))


def test_mxfp4_experts_modules_to_not_convert_keeps_bf16_are_read_so(oss, mxfp4, tmp_path):
    # layer 1's experts left bf16 (modules_to_not_convert names them, the files hold them so): the same network as the
    # all-MXFP4 one with those weights dequantized, held as each layer's own tensors are
    path = mxfp4[0]
    tensors = load_file(path / "model.safetensors")
    for name in prefill.MXFP4_WEIGHTS:
        blocks, scales = (tensors.pop(f"model.layers.1.{name}{part}") for part in ("_blocks", "_scales"))
        E, N, G, _ = blocks.shape
        tensors[f"model.layers.1.{name}"] = torch.empty(E, G * 32, N, dtype=torch.bfloat16)
        prefill.dequantize_mxfp4(blocks, scales, tensors[f"model.layers.1.{name}"])
    mixed = rewritten(path, tmp_path / "mixed", tensors, {**MXFP4_CONFIG, "modules_to_not_convert": [
        *MXFP4_CONFIG["modules_to_not_convert"], "model.layers.1.mlp.experts"]})
    r = runner(mixed)
    assert [d for _, _, _, d in r.cfg.held[1] if d != torch.bfloat16] == [] and r.cfg.held[0] != r.cfg.held[1]
    assert losses(r) == losses(mxfp4[3])


# The MXFP4 variant of test_fp8's one-launch test: a layer of random bytes in one launch against dequantize_layer, then
# LAYER_KERNEL_CHECKED_AND_RUN (a bug in the scale's column, a write untransposed)
MXFP4_KERNEL = """
import dataclasses, json, math, sys, torch, prefill
cpu = torch.device("cpu")
# a layer of random bytes, scale bytes 0-254 (subnormal products too), in one launch against dequantize_layer
tiny, parts, layout, held = prefill.fp8_check_layer(mxfp4=True)
for name, offset, shape, dtype in parts:
    if name.endswith("_scales"):
        held[offset:offset + math.prod(shape)] = torch.arange(math.prod(shape)) % 255
layer = prefill.fp8_layer(parts, layout, cpu, True)
got, want = (torch.zeros(tiny.dequantized_bytes // 2, dtype=torch.int16) for _ in range(2))
prefill.dequantize_layer_triton(held, got.view(torch.bfloat16), layer)
prefill.dequantize_layer(held, want.view(torch.bfloat16), layer)
report = {"equal": torch.equal(got, want), "mxfp4 tensors": sum(n.endswith("_blocks") for n, *_ in parts)}
MXFP4, PLANTED = True, {"the next 32's scale": (1, lambda s: torch.where(s >= 0, s + 1, s)),
                        "written untransposed": (7, lambda group: torch.ones_like(group)),
                        "widths read as whole 16 B": (4, lambda cols: cols // 8 * 8)}
""" + LAYER_KERNEL_CHECKED_AND_RUN


def test_mxfp4_one_launch_a_layer_is_dequantize_mxfp4_bit_for_bit_and_its_planted_bugs_refused(mxfp4):
    p = interpreted(MXFP4_KERNEL, mxfp4[0], json.dumps(TEXTS[:3]))
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["equal"] and report["mxfp4 tensors"] == 2 and report["check"] == [0.0], report
    # the sinks' 2 and the router bias's 4 copied element by element, the rest 16 B at a time
    assert report["paths"] == {"as the tables say": True, "whole 16 B": ["_copy_block"], "not": ["_copy_block"]}, report
    assert (report["the next 32's scale"] == report["written untransposed"] == report["widths read as whole 16 B"]
            == [math.inf]), report
    assert report["triton"] == report["torch"], report
    assert report["layers"] == 2 and report["launches"] == 2, report



# An MXFP4 program's steps (MXFP4_STEPS tiles of MXFP4_GROUPS x 32 in columns, one after the other): the check layer's
# experts are less than a tile wide; here 320 wide at tiles of 128 columns (2.5 tiles) and 2 steps a program, so that
# the gate_up rows take a program of two tiles and one of a half tile, every scale byte 0-254 among them. Ablation: the
# tables of 2 steps a program launched at 1 leave each row's second tile unwritten.
MXFP4_STEPS_KERNEL = """
import json, math, torch, prefill
prefill.MXFP4_GROUPS, prefill.MXFP4_STEPS = 4, 2
cfg = prefill.ModelConfig.from_json({**prefill.MXFP4_CHECK_MODEL, "hidden_size": 320})
parts, layout = cfg.held[0], cfg.layer_layout
held = torch.randint(256, (cfg.layer_bytes,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
for name, offset, shape, dtype in parts:
    if name.endswith("_scales"):
        held[offset:offset + math.prod(shape)] = torch.arange(math.prod(shape)) % 255
layer = prefill.fp8_layer(parts, layout, torch.device("cpu"), True)
want = torch.zeros(cfg.dequantized_bytes // 2, dtype=torch.int16)
prefill.dequantize_layer(held, want.view(torch.bfloat16), layer)
report = {"in columns, programs a row": sorted({(cols, grid) for _, scale, _, _, cols, grid, *_ in layer.tensors.tolist()
                                                if scale >= 0})}
for steps in (2, 1):
    prefill.MXFP4_STEPS = steps
    got = torch.zeros_like(want)
    prefill.dequantize_layer_triton(held, got.view(torch.bfloat16), layer)
    report[steps] = torch.equal(got, want)
print(json.dumps(report))
"""


def test_mxfp4_programs_of_several_steps_and_a_partial_one_are_dequantize_mxfp4_bit_for_bit():
    p = interpreted(MXFP4_STEPS_KERNEL)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["in columns, programs a row"] == [[96, 1], [320, 2]], report
    assert report["2"] is True and report["1"] is False, report

# ----------------------------------------------------------------------------- Triton: sinks, clamp, norms

TRITON_SINKS = """
import json, sys, torch, prefill
# the interpreter multiplies bfloat16 tiles as raw integers, so the kernels run on float16 here (bf16 on a GPU)
cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[1]))
lens = [1, 37, 200, 64, 129, 2]  # a 1-token text, tile-size multiples, several query tiles, partial tiles
bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
chunk = prefill.Chunk(0, bounds[-1], bounds, torch.tensor(bounds, dtype=torch.int32), max(lens))
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(bounds[-1], h, 16, generator=gen, dtype=torch.float16) for h in (4, 2, 2))
tiles = [tuple(t) for t in json.loads(sys.argv[2])]
report = {}
def worst(key, err):
    report[key] = max(report.get(key, 0), err)
for how in dict.fromkeys(cfg.attention):
    sinks = prefill.check_sinks(how, 4, "cpu")["sinks"]
    want = prefill.attention_reference(q, k, v, chunk, how, sinks)
    for tile in tiles:
        worst(str(tile), prefill.check_error(prefill.attention_triton(q, k, v, chunk, how, tile, sinks), want))
    if how.window:  # the planted bugs on the full layer's setting alone
        continue
    bare = prefill.dataclasses.replace(how, sinks=False)
    worst("sinks dropped", prefill.check_error(prefill.attention_triton(q, k, v, chunk, bare, tiles[0]), want))
    worst("sinks of the next head", prefill.check_error(prefill.attention_triton(q, k, v, chunk, how, tiles[0],
                                                                                   sinks.roll(1)), want))
    worst("sinks in log2 units", prefill.check_error(prefill.attention_triton(q, k, v, chunk, how, tiles[0],
                                                                                sinks / 0.6931471805599453), want))
prefill.TREE_CHECK = json.loads(sys.argv[3])
for how, sharp, (q, k, v, c), want in prefill.tree_check_cases(torch.device("cpu"), cfg):
    q, k, v = (t.half() for t in (q, k, v))
    sinks = prefill.check_sinks(how, q.shape[1], "cpu")["sinks"]
    for tile in tiles:
        worst(f"tree {tile}", prefill.check_error(prefill.attention_triton(q, k, v, c, how, tile, sinks), want))
    worst("tree: sinks of the next head", prefill.check_error(prefill.attention_triton(q, k, v, c, how, tiles[0],
                                                                                         sinks.roll(1)), want))
# the fused elementwise kernels' check for this model: the float32 norm product, the clamped interleaved SwiGLU;
# then two bugs planted in the latter
report["kernels"] = prefill.check_kernels(torch.device("cpu"), cfg)
gated = prefill.gated_act_triton
act = cfg.expert_activation
for name, bug in {"clamp dropped": lambda gu, a: gated(gu, prefill.ClampedSwiGLU(a.alpha, 1e9)),
                  "gate and up as halves": lambda gu, a: gated(torch.stack(gu.chunk(2, -1), -1).flatten(-2), a),
                  }.items():
    prefill.gated_act_triton = bug
    report[name] = prefill.check_kernels(torch.device("cpu"), cfg)["gated_act"]
# the grouped GEMM on gpt-oss's out-contiguous views of [experts, in, out] ([experts, out, in] with strides (., 1, out)),
# every tile offered anywhere, against float32 products per expert; then read as if in-contiguous
E, K, N, counts = 3, 64, 96, [40, 0, 23]
a = torch.randn(sum(counts), K, generator=gen, dtype=torch.float16)
w = torch.randn(E, K, N, generator=gen, dtype=torch.float16).transpose(1, 2)
bounds = torch.tensor([sum(counts[:e]) for e in range(E + 1)])
want = torch.cat([a[s:e].float() @ w[i].float().T for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
for tile in sorted({t for family in prefill.EXPERT_TILES.values() for t in family}):
    worst("experts", prefill.check_error(prefill.grouped_triton(a, w, bounds, tile), want))
inner = prefill.EXPERT_TILES["cpu"][0]
worst("experts read in-contiguous", prefill.check_error(prefill.grouped_triton(
    a, w.contiguous().view(E, K, N).transpose(1, 2), bounds, inner), want))
print(json.dumps(report))
"""


def test_triton_kernels_compute_sinks_and_the_clamp_and_the_check_refuses_them_dropped():
    # the text and tree attention kernels with sinks (a window's variant too) in a tile of each GPU family, against
    # float32 attention; a sink dropped, another head's or in log2 units misses; the start-up check of the fused
    # elementwise kernels passes gpt-oss's and refuses two planted bugs; the grouped GEMM reads the experts' strides.
    # The tree: test_eval's small one, a window 24
    config = dict(GEOMETRY, model_type="gpt_oss", sliding_window=24)
    cfg = prefill.ModelConfig.from_json(json.loads(json.dumps(config)))
    tiles = [prefill.attention_tiles("nvidia", cfg)[0], prefill.attention_tiles("rdna3", cfg)[0]]
    tree = [[[40, 7], [40, 20, 90], [40, 20, 3], [12, 9], [12, 1]], 64]
    p = interpreted(TRITON_SINKS, json.dumps(config), json.dumps(tiles), json.dumps(tree))
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    limit = prefill.CHECK_TOLERANCE
    assert max(report[str(tuple(t))] for t in tiles) < limit / 4, report
    assert max(report[f"tree {tuple(t)}"] for t in tiles) < limit / 4, report
    for miss in ("sinks dropped", "sinks of the next head", "sinks in log2 units", "tree: sinks of the next head"):
        assert report[miss] > 4 * limit, (miss, report)
    assert set(report["kernels"]) >= {"rms_norm", "gated_act", "combine", "route"}, report
    # the router's kernel: refused by the CPU's top-k, which keeps other ties (test_moe's fused router test)
    assert max(e for kernel, e in report["kernels"].items() if kernel != "route") <= limit, report
    assert min(report["clamp dropped"], report["gate and up as halves"]) > 4 * limit, report
    assert report["experts"] < limit / 4 and report["experts read in-contiguous"] > 4 * limit, report


# The fused experts (--experts fused: their gpt-oss variants) through the whole model in Triton's interpreter, which
# runs prefill in float16 (test_fused_moe.py says why): the bf16 checkpoint and the MXFP4 one against transformers in
# float32, the MXFP4 one streamed (dequantized into its slot) equal to resident; the experts' biases dropped, or their
# clamp, through the fused path
FUSED_RUNS = """
import dataclasses, json, sys, torch, prefill
sys.path.insert(0, str(prefill.Path(prefill.__file__).parent / "tests"))
from test_families import runner  # SDPA, its start-up check on short texts: the experts are under test here
prefill.DTYPE = torch.float16  # the interpreter multiplies bf16 tiles as raw integers
check, checks = prefill.check_experts, {}  # the three runs' shapes and candidates are the same: checked once
prefill.check_experts = lambda candidates, *a: checks.setdefault(repr(candidates), check(candidates, *a))
texts, report = json.loads(sys.argv[3]), {}
for name, path, kw in (("bf16", sys.argv[1], {}), ("mxfp4", sys.argv[2], {}),
                       ("mxfp4 streamed", sys.argv[2], {"gpu_memory_gib": 0, "load": "copy"})):
    r = runner(path, experts="fused", picks="", **kw)
    ids = r.tokenize(texts)
    report[name] = {"experts": r.experts, "check_error": r.experts_report[0]["error"],
                    "streamed": r.plan.streamed_layers, "losses": r.losses(ids)}
    if name == "bf16":
        [(_, kind, tile)] = prefill.expert_candidates(r.experts, r.device, r.cfg, 4096)
        resident, act = r.streamer.resident, r.cfg.expert_activation
        r.streamer.resident = {i: dataclasses.replace(w, gate_up_bias=None, down_bias=None)
                               for i, w in resident.items()}
        report["biases dropped"] = r.losses(ids)
        r.streamer.resident = resident
        r.run_experts = prefill.make_experts(kind, tile, prefill.ClampedSwiGLU(act.alpha, 6e4))
        report["clamp dropped"] = r.losses(ids)
print(json.dumps(report))
"""
FUSED_TEXTS = [3, 7, 8]  # 48, 3 and 2 tokens: the ones whose losses the biases and the clamp move most


def test_fused_experts_through_the_model_match_transformers_bf16_and_mxfp4_streamed_too(oss, mxfp4):
    # measured: bf16 2.6e-4, MXFP4 6.6e-4 (the check 1.7e-3); the biases dropped 14 tolerances, the clamp 24
    p = interpreted(FUSED_RUNS, oss[0], mxfp4[0], json.dumps([TEXTS[i] for i in FUSED_TEXTS]))
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout)
    for name, reference in (("bf16", oss[1]), ("mxfp4", mxfp4[2])):
        run, want = report[name], [reference[i] for i in FUSED_TEXTS]
        assert run["experts"].startswith("fused") and run["check_error"] < prefill.CHECK_TOLERANCE / 4, run
        assert max_rel_err(run["losses"], want) < TOLERANCE, (name, run, want)
    streamed = report["mxfp4 streamed"]
    assert streamed["streamed"] == [0, 1] and streamed["losses"] == report["mxfp4"]["losses"], report
    for ablation in ("biases dropped", "clamp dropped"):
        assert max_rel_err(report[ablation], [oss[1][i] for i in FUSED_TEXTS]) > 3 * TOLERANCE, (ablation, report)


def test_the_start_up_checks_refuse_attention_without_its_sinks(monkeypatch):
    # SDPA's own path passes; the sinks dropped there, it is refused (a check that could not fail proves nothing)
    cfg = prefill.ModelConfig.from_json(json.loads(json.dumps({"model_type": "gpt_oss", **GEOMETRY})))
    monkeypatch.setattr(prefill, "CHECK_LENGTHS", [37, 100])
    [entry] = prefill.check_attention([("sdpa", "sdpa", None)], CPU, cfg)
    assert entry["attend"] is not None and entry["error"] < prefill.CHECK_TOLERANCE / 4, entry
    sdpa = prefill.attention_sdpa
    monkeypatch.setattr(prefill, "attention_sdpa", lambda q, k, v, chunk, how, sinks=None: sdpa(q, k, v, chunk, how))
    [entry] = prefill.check_attention([("sdpa", "sdpa", None)], CPU, cfg)
    assert entry["attend"] is None and "differs from float32 attention" in entry["reason"], entry
    assert "sinks" in entry["reason"], entry


# ----------------------------------------------------------------------------- every way in

def test_the_protocol_corpus_mode_and_the_doctor_on_the_mxfp4_release_form(mxfp4, tmp_path, monkeypatch, capsys):
    # the harness's path (warm-up, every layer streamed), corpus mode (the same bits) and --doctor, in-process; the
    # attention checks on short texts
    path, _, reference, _ = mxfp4
    monkeypatch.setattr(prefill, "CHECK_LENGTHS", [37, 100])
    served = protocol_losses(path, TEXTS, monkeypatch, capsys)
    assert max_rel_err(served, reference) < TOLERANCE
    corpus, out = tmp_path / "texts.jsonl", tmp_path / "out.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert prefill.main(["--model", str(path), "--device", "cpu", "--attention", "sdpa", "--gpu-memory", "0",
                         "--input", str(corpus), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["loss"] for r in records if r["loss"] is not None] == [x for x in served if not math.isnan(x)]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    report = io.StringIO()
    monkeypatch.setattr(prefill, "take_stdout", lambda: report)
    assert prefill.main(["--model", str(path), "--device", "cpu", "--attention", "sdpa", "--doctor"]) == 0
    lines = report.getvalue().splitlines()
    assert any(line.startswith("weights    MXFP4 experts") and "dequantized on cpu" in line for line in lines), lines
    assert any("with sinks" in line for line in lines if line.startswith("attention")), lines
    assert any("flash" in line and "not offered: has no sinks" in line for line in lines), lines


# ----------------------------------------------------------------------------- the bench's checkpoints

@pytest.mark.parametrize("mxfp4_release", [False, True], ids=["bf16", "mxfp4"])
def test_bench_checkpoints_write_and_load_in_transformers(tmp_path, qwen_tokenizer_dir, mxfp4_release):
    # bench/make_checkpoint.py's tiny gpt-oss (the real ones' keys), bf16 and MXFP4 of one seed: transformers loads
    # each with every tensor, and the MXFP4 one's experts are the bf16 one's quantized
    from bench import make_checkpoint
    from transformers import AutoModelForCausalLM
    geometry = make_checkpoint.geometry("tiny-gpt-oss")
    folder = tmp_path / "ckpt"
    make_checkpoint.build(folder, geometry, seed=3, device="cpu", tokenizer=qwen_tokenizer_dir, reuse=False,
                          mxfp4=mxfp4_release)
    files = load_file(folder / "model.safetensors")
    assert sum(t.nbytes for t in files.values()) == make_checkpoint.checkpoint_bytes(geometry, mxfp4=mxfp4_release)
    kwargs = interact.dequantized_kwargs(folder)
    assert bool(kwargs) == mxfp4_release
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True, **kwargs)
    assert type(model).__name__ == "GptOssForCausalLM" and not any(info.values()), info
    cfg = prefill.ModelConfig.from_dir(folder)
    assert cfg.mxfp4 == mxfp4_release and cfg.num_experts == 4
    w = layer_weights(folder, cfg, 1)
    assert torch.equal(w.gate_up.float(), model.model.layers[1].mlp.experts.gate_up_proj.transpose(1, 2))
    if mxfp4_release:  # each weight the bf16 draw rounded to e2m1 under its 32's scale: within half a step of it
        bf16 = tmp_path / "bf16"
        make_checkpoint.build(bf16, geometry, seed=3, device="cpu", tokenizer=qwen_tokenizer_dir, reuse=False)
        drawn = load_file(bf16 / "model.safetensors")["model.layers.1.mlp.experts.gate_up_proj"].float()
        scale = 2.0 ** (files["model.layers.1.mlp.experts.gate_up_proj_scales"].float() - 127)  # [E, out, in / 32]
        step = scale.repeat_interleave(32, -1).transpose(1, 2)
        assert ((w.gate_up.float().transpose(1, 2) - drawn).abs() <= step + 1e-12).all()
    with torch.no_grad():
        assert math.isfinite(model(input_ids=torch.arange(40)[None], labels=torch.arange(40)[None]).loss.item())

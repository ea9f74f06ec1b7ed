"""Every family prefill runs, against transformers in float32 on tiny checkpoints that transformers itself builds
(`XxxForCausalLM(config)`, `save_pretrained`) and loads back (`from_pretrained`, the reference).

The weights are sharp (large q/k projections, norms far from 1, biases of std 0.5, small windows and softcaps, a short
original context for llama3's RoPE), so that each flag of a family decides some text's loss: every flag has an
ablation, prefill with that one flag undone, which must miss the reference by several tolerances.

The texts are 20-70 bytes and the tokenizer a byte-level one of 259 ids that adds a BOS, as Llama 3's and Gemma's do:
so the windows (5-6 keys) are far shorter than the texts, and the models' vocabularies small.
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

import prefill
from test_prefill import ROOT, TOLERANCE, max_rel_err, transformers_losses

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "Solve $x^2+1=0$: the roots are $\\pm i$, not real ones.",
    "In 1905 Einstein published four papers in Annalen.",
    "def f(x): return x * 2 + 1  # doubled, plus one",
    "Paris is the capital of France; Berlin, of Germany.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16",
    "naïve café, Ångström: bytes beyond ASCII count twice",
    "ok",
    "x",  # BOS and one byte: one prediction
    "",  # BOS alone: no loss
]
BOS = 1


def byte_tokenizer(folder):
    """A byte-level BPE with no merges (one token per byte of UTF-8) whose post-processor adds <bos>, saved as
    transformers saves a fast tokenizer: prefill reads it through transformers, as it does Llama's and Gemma's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<bos>": BOS, "<eos>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(folder)


GEOMETRY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512,
                bos_token_id=BOS, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # short: every wavelength counts
GEMMA = dict(head_dim=16, query_pre_attn_scalar=64, sliding_window=6, hidden_activation="gelu_pytorch_tanh")
# (transformers' config and model classes, their keywords, the config.json spelling of RoPE: 5 writes rope_parameters,
# "4" rewrites it as transformers 4 did: top-level rope_theta, rope_scaling, Gemma 3's rope_local_base_freq)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, head_dim=16,
                                                      rope_parameters=LLAMA3_ROPE), "5"),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, head_dim=16,
                                                           rope_parameters=LLAMA3_ROPE), "4"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5, head_dim=32), "5"),  # 4 x 32 != 64
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2,
                                                      head_dim=16, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e4}), "4"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True, use_sliding_window=True, sliding_window=5,
                                                      max_window_layers=1, head_dim=16), "5"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(GEMMA, attn_logit_softcapping=5.0,
                                                         final_logit_softcapping=8.0), "5"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(GEMMA, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "5"),
}


# weights' std x sqrt(fan-in), biases' and a tied embedding's std, Gemma's norms' mean w (scale 1 + w): picked so that
# every ablation below misses by > 3.9 tolerances while bf16's own error stays < 6e-3
SHARP = dict(qk=1.5, gate=0.5, other=1.5, bias=0.3, head=2.0, tied=0.25, gemma_norm=1.0, gemma_attn_out=1.0,
             gemma_mlp_out=1.0)


def sharpen(model, gemma):
    # weights that make each feature show (SPEC §11): q/k large (sharp, position-dependent attention), norms far
    # from 1 (Gemma's as 1 + w, its q/k norms 3x), biases as large as the activations; not so sharp that bf16's own
    # error (3e-3 at most here) comes near the tolerance
    tied = model.config.get_text_config().tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                kind = "qk" if ("q_proj" in name or "k_proj" in name) else "gate" if "gate_proj" in name else "other"
                p.normal_(0, SHARP[kind] / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.normal_(0, SHARP["bias"])
            else:
                qk = "q_norm" in name or "k_norm" in name
                role = "attn_out" if "post_attention" in name else "mlp_out" if "post_feedforward" in name else "norm"
                p.normal_((2.0 if qk else SHARP[f"gemma_{role}"]) if gemma else (3.0 if qk else 1.0), 0.2)
        model.get_input_embeddings().weight.normal_(0, SHARP["tied"] if tied else 0.1)
        if not tied:
            model.get_output_embeddings().weight.normal_(0, SHARP["head"] / model.config.get_text_config().hidden_size ** 0.5)


def as_transformers_4(folder):
    # config.json as transformers 4 wrote it: top-level rope_theta and rope_scaling (Gemma 3: rope_local_base_freq)
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    rope = text.pop("rope_parameters")
    if "full_attention" in rope:
        full, sliding = rope["full_attention"], rope["sliding_attention"]
        text.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=sliding["rope_theta"])
        text["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    else:
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(cfg))


def build(folder, name):
    import transformers
    config_class, model_class, keywords, spelling = FAMILIES[name]
    config = getattr(transformers, config_class)(**GEOMETRY, **keywords)
    torch.manual_seed(sorted(FAMILIES).index(name))
    model = getattr(transformers, model_class)(config)
    sharpen(model, name.startswith("gemma"))
    model.to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer(folder)
    if spelling == "4":
        as_transformers_4(folder)
    return model


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """name -> (checkpoint folder, transformers' float32 losses of TEXTS, a Runner on it): built once, when first
    asked for."""
    built = {}

    def get(name):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            build(folder, name)
            built[name] = folder, transformers_losses(folder, TEXTS), runner(folder)
        return built[name]
    return get


def runner(path, **kw):
    # SDPA, its start-up check on short texts only: here the families' math is under test (the check's own tests,
    # on the lengths it uses, are test_startup's and below), and its 3000-4500-token texts cost 10-30 s a family
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill, "CHECK_LENGTHS", [37, 100])
        patch.setattr(prefill, "ATTENTION_BUCKETS", [(label, longest, timed, checked) for (label, _, timed, _), longest,
                                                     checked in zip(prefill.ATTENTION_BUCKETS, (64, 128, None),
                                                                    ([60, 37], [100, 37], [140]))])
        return prefill.Runner(path, device="cpu", attention="sdpa", **kw)


def losses(r):
    return r.losses(r.tokenize(TEXTS))


# ----------------------------------------------------------------------------- against transformers

@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(family, name):
    from transformers import AutoTokenizer
    path, reference, r = family(name)
    assert r.cfg.model_type == {"llama-tied": "llama", "gemma3": "gemma3_text"}.get(name, name)
    ids = r.tokenize(TEXTS)
    assert ids == AutoTokenizer.from_pretrained(path)(TEXTS)["input_ids"] and all(t[0] == BOS for t in ids)
    assert max_rel_err(r.losses(ids), reference) < TOLERANCE
    # transformers' own bf16 numbers: Gemma's eager attention rounds its scores to bf16 (prefill: float32 inside)
    same_math = 1e-2 if name.startswith("gemma") else 1e-5
    assert max_rel_err(r.losses(ids), transformers_losses(path, TEXTS, torch.bfloat16)) < same_math


def replaced_layers(r, **fields):
    # every layer's weight views with these fields replaced (None: the tensor dropped), for an ablation
    return {i: dataclasses.replace(w, **fields) for i, w in r.streamer.resident.items()}


def ropes(r, rope_of_layer):
    return tuple(rope_of_layer(i, rope) for i, rope in enumerate(r.cfg.ropes))


def settings(r, **changes):
    return tuple(dataclasses.replace(how, **changes) for how in r.cfg.attention)


# Per family, each flag undone: (config fields to replace, weight views to replace) from the Runner
ABLATIONS = {
    "llama": {
        "llama3 RoPE as default": lambda r: ({"ropes": ropes(r, lambda i, rope: prefill.Rope(rope.theta))}, {}),
        "attention biases dropped": lambda r: ({}, {"qkv_bias": None, "o_bias": None}),
        "MLP biases dropped": lambda r: ({}, {"gate_up_bias": None, "down_bias": None}),
    },
    "mistral": {
        "window dropped": lambda r: ({"attention": settings(r, window=None)}, {}),
        "window one key wider": lambda r: ({"attention": settings(r, window=6)}, {}),
    },
    "qwen2": {
        "q/k/v biases dropped": lambda r: ({}, {"qkv_bias": None}),
        "window on every layer": lambda r: ({"attention": settings(r, window=5)}, {}),
    },
    "qwen3": {
        "o bias dropped": lambda r: ({}, {"o_bias": None}),
        "window dropped": lambda r: ({"attention": settings(r, window=None)}, {}),
    },
    "gemma2": {
        "norms as w, not 1 + w": lambda r: ({"norm_offset": False}, {}),
        "sandwich norms dropped": lambda r: ({}, {"attn_out_norm": None, "mlp_out_norm": None}),
        "attention softcap dropped": lambda r: ({"attention": settings(r, softcap=None)}, {}),
        "final softcap dropped": lambda r: ({"final_softcap": None}, {}),
        "embedding scale dropped": lambda r: ({"embed_scale": False}, {}),
        "scale head_dim^-1/2": lambda r: ({"attention": settings(r, scale=r.cfg.head_dim ** -0.5)}, {}),
        "SiLU for GELU": lambda r: ({"activation": "silu"}, {}),
        "window dropped": lambda r: ({"attention": settings(r, window=None)}, {}),
    },
    "gemma3": {
        "the sliding RoPE on every layer": lambda r: ({"ropes": ropes(r, lambda i, rope: r.cfg.ropes[0])}, {}),
        "full layers' RoPE unscaled": lambda r: ({"ropes": ropes(r, lambda i, rope: dataclasses.replace(
            rope, kind="default"))}, {}),
        "q/k norms dropped": lambda r: ({}, {"q_norm": None, "k_norm": None}),
        "embedding scale dropped": lambda r: ({"embed_scale": False}, {}),
        "window dropped": lambda r: ({"attention": settings(r, window=None)}, {}),
    },
}


@pytest.mark.parametrize("name, ablation", [(f, a) for f, table in ABLATIONS.items() for a in table])
def test_every_flag_of_a_family_decides_some_loss(family, name, ablation):
    path, reference, r = family(name)
    fields, weights = ABLATIONS[name][ablation](r)
    cfg, resident = r.cfg, r.streamer.resident
    try:
        r.cfg, r.streamer.resident = dataclasses.replace(cfg, **fields), replaced_layers(r, **weights)
        assert max_rel_err(losses(r), reference) > 3 * TOLERANCE
    finally:
        r.cfg, r.streamer.resident = cfg, resident
    assert max_rel_err(losses(r), reference) < TOLERANCE  # restored


def test_gemma_q_k_norm_is_its_own_kind(family, monkeypatch):
    # Gemma 3 norms q and k as x̂·(1 + w) in float32 (its other norms too): Qwen3's w·bf16(x̂) there misses
    path, reference, r = family("gemma3")
    norm = prefill.rms_norm
    monkeypatch.setattr(prefill, "rms_norm", lambda x, w, eps, offset: norm(x, w, eps, offset and x.dim() == 2))
    assert max_rel_err(losses(r), reference) > 3 * TOLERANCE

#!/usr/bin/env python3
"""prefill: the per-text language-modelling loss of a Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3 model, or of a
mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3, gpt-oss), whose weights need not fit in GPU
memory.

    python prefill.py --model DIR      prints `ready`, reads one JSON array of texts from stdin,
                                       prints one loss per text (in order) and exits.
    from prefill import Runner         Runner(DIR).score(texts), Runner(DIR).loglikelihoods(pairs of token lists)

The decoder runs layer by layer over every token of the request at once (texts packed without padding): the layers
that fit stay on the GPU, the rest stream from pinned host memory through two device slots on a copy stream while
the compute stream runs the layer before. Each streamed layer crosses PCIe once per request (once per wave when a
huge request is split into waves).

This file alone is the engine: the protocol and the Python API need nothing beside it. Its sections, in reading
order, with their main definitions (no definition reads a name defined further down; tests/test_layout.py checks
both):
  config: Rope, AttentionSettings, Router, moe_fields, sigmoid_moe_fields, gpt_oss_fields, Family, FAMILIES,
      ConfigFields, yarn_rope, latent_fields, fp8_fields, held_layout, ModelConfig
  checkpoint loading: header_tensors, Workers, pinned_empty, Checkpoint, check_tensors, LayerWeights, layer_views,
      Stager
  memory plan: MemoryPlan, plan_memory, held_experts_config, layer_flops, plan_wave, HostPlan, plan_host
  weight streaming: HeldLayers, StorageRing, dequantize_fp8, dequantize_mxfp4, FP8Layer, fp8_layer, dequantize_layer,
      WeightStreamer
  model math: rms_norm, rope_tables, apply_rope, gated_act, token_nll, combine, Kernels, TORCH_KERNELS, Chunk,
      Latent, joined, latent_qkv, attention_block, gated_mlp, mlp_block
  fused kernels (Triton, optional): rms_norm_triton, head_norm_rope_triton, dequantize_layer_triton,
      token_nll_triton, TRITON_KERNELS
  attention backends: attention_sdpa, latent_layout, attention_triton, make_attention, ATTENTION_TILES, gpu_family,
      attention_candidates
  mixture of experts: route_softmax, route_sigmoid, route_topk_softmax, route, route_triton, expert_rows, moe_ffn,
      shared_experts, moe_block, FP8Experts, grouped_experts, grouped_loop, grouped_triton, align_experts,
      fused_experts, FUSED_TILES, expert_candidates
  start-up checks and picks: check_attention, pick_attention, check_experts, pick_experts, check_kernels,
      pick_kernels, pick_blas, Picks
  packing and loss: timed_batch_tokens, Wave, batches, wave_of, Score, sequence_nll
  evaluation: the prefix tree: Request, Loglikelihood, PrefixTrie, request_batches, tree_wave, pick_tree_attention,
      continuation_logprobs
  tokenizer: plain_tokenizer, load_tokenizer
  loading: Loaded, load_jobs, load_weights
  the runner: Runner (start-up in __init__; texts: score, score_batch, score_wave; continuations: loglikelihoods,
      score_requests; warm_up)
  the protocol and the command line: Progress, parse_request, parse_args, runner_of, serve_protocol, report, main
Beside it, imported only when an option asks: prefill_corpus.py (--input, --output, --resume), prefill_dist.py
(torchrun), prefill_doctor.py (--doctor); prefill_eval.py is the lm-eval backend. They import this file; it never
imports them at module level.
"""
import argparse
import array
import collections
import contextlib
import ctypes
import dataclasses
import datetime
import hashlib
import importlib.metadata
import itertools
import json
import math
import mmap
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

# How a SIGINT or SIGTERM ends a run: one line on stderr and this exit code, whenever it comes. main() installs
# on_signal (the protocol and the command line); until then, through the seconds of `import torch`, a signal ends the
# process at once with the same line, where Python's default would print the traceback of whatever was importing.
SIGNAL_ENDS = {signal.SIGINT: ("interrupted (SIGINT)", 130), signal.SIGTERM: ("terminated (SIGTERM)", 143)}


def exit_at_once(signum, frame):
    line, code = SIGNAL_ENDS[signum]
    os.write(2, f"prefill: {line}\n".encode())
    os._exit(code)


if __name__ == "__main__":
    for signum in SIGNAL_ENDS:
        signal.signal(signum, exit_at_once)

import torch  # noqa: E402 (after the signal handlers above: importing it takes seconds)
import torch.nn.functional as F  # noqa: E402

GiB = 2**30
DTYPE = torch.bfloat16


class UserError(Exception):
    """Bad checkpoint, bad option or bad request: reported as one line on stderr, exit code 2."""


QUIET = {"on": False}  # under torchrun, ranks > 0 log nothing: rank 0 speaks for all


def log(msg, end="\n"):
    if QUIET["on"]:
        return
    print(f"prefill: {msg}", end=end, file=sys.stderr, flush=True)


def parse_json(data, source):
    # JSON from outside (request, --input, config, index, safetensors header): whatever is wrong with it, however
    # deep its nesting (json raises RecursionError), it ends as one UserError naming where it came from
    try:
        return json.loads(data)
    except RecursionError:
        raise UserError(f"{source}: JSON nested too deeply") from None
    except ValueError as e:
        raise UserError(f"{source}: not JSON ({e})") from None


def model_folder(model_dir):
    # --model (or Runner's model_dir) first of all: a path that is missing or a file says so, not "no config.json"
    path = Path(model_dir)
    if not path.exists():
        raise UserError(f"the model folder {model_dir} does not exist")
    if not path.is_dir():
        raise UserError(f"the model folder {model_dir} is not a directory: give the checkpoint's folder (config.json, "
                        "*.safetensors, the tokenizer files)")
    return path


def read_bytes(path):
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def shown(value):
    # a value from an untrusted file inside an error message: short, on one line
    text = repr(value) if isinstance(value, (str, int, float)) else type(value).__name__
    return text if len(text) <= 40 else text[:40] + "..."


JSON_SPACE = " \t\r\n"


def text_of(value, where):
    if not isinstance(value, str):
        raise UserError(f"{where} is {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")  # fails on a lone surrogate: an escaped one in the JSON, or a byte that was not UTF-8
    except UnicodeEncodeError as e:
        raise UserError(f"{where} is not valid UTF-8 (a lone surrogate or bad byte at character {e.start})") from None
    return value


def decoded(data):
    # bytes that are not UTF-8 survive as lone surrogates (surrogateescape), so text_of names the string they are in
    return data.decode("utf-8", "surrogateescape") if isinstance(data, bytes) else data


def json_array(data, source):
    values = parse_json(decoded(data), source)
    if not isinstance(values, list):
        raise UserError(f"{source}: expected a JSON array of strings, got {type(values).__name__}")
    return values


# ----------------------------------------------------------------------------- config
# One config for every family prefill runs, read from config.json. What config.json cannot say (the family's fixed
# choices: norm style, sandwich norms, q/k norm, embedding scale, fixed biases, defaults, which layers slide) is a row
# of FAMILIES; what varies per layer (its RoPE, its attention window) is a tuple with an entry per layer.

@dataclass(frozen=True)
class Rope:
    """One RoPE (transformers' modeling_rope_utils): "default"; "linear" (positions / factor: Gemma 3's full layers);
    "llama3" (Llama 3.1-3.3: wavelengths beyond the original context slowed by factor, a smooth band between them;
    static, so short texts change too); "yarn" (_compute_yarn_parameters: frequencies below the beta_slow..beta_fast
    band of rotations over the original context slowed by factor, a linear ramp between; cos and sin scaled by
    attention_factor). partial: partial_rotary_factor, the share of each head's channels that rotate, the first
    int(head_dim * partial) of them (GLM-4.5: half); the others pass through."""
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # cos and sin are multiplied by it in float32 (1 but for yarn)
    partial: float = 1.0

    def rotary_dim(self, head_dim):
        return int(head_dim * self.partial)  # as transformers rounds it

    def inv_freq(self, head_dim):
        # [rotary_dim / 2] float32 on the CPU, in transformers' own float32 steps
        dim = self.rotary_dim(head_dim)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        inv = 1.0 / pos_freqs
        if self.kind == "yarn":  # transformers' steps: Python floats for the band, float32 for the ramp
            def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
                return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                    2 * math.log(self.theta))
            low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001  # transformers' guard against a zero-width ramp
            kept = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
            return 1.0 / (self.factor * pos_freqs) * (1 - kept) + inv * kept
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            context, low, high = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor
            wavelen = 2 * math.pi / inv
            slowed = torch.where(wavelen > context / low, inv / self.factor, inv)
            smooth = (context / wavelen - low) / (high - low)
            blended = (1 - smooth) * slowed / self.factor + smooth * slowed
            between = ~(wavelen < context / high) * ~(wavelen > context / low)
            return torch.where(between, blended, slowed)
        return inv


@dataclass(frozen=True)
class AttentionSettings:
    """One layer's attention beyond causal GQA: the softmax of softcap(q·k · scale) over the keys j that query i sees,
    i - window < j <= i as in transformers (window None: every earlier key), softcap(s) = cap · tanh(s / cap). sinks
    (gpt-oss): a learned logit per query head joins each row's softmax as one more column, whose probability is
    dropped (transformers' eager_attention_forward): each row's denominator gains exp(sink); its values are the
    layer's weights (self_attn.sinks)."""
    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False


@dataclass(frozen=True)
class Router:
    """How a mixture of experts' router picks each token's top_k experts and weighs them (transformers 5.24's
    *TopKRouter, *TopkRouter). "softmax" (Qwen3-MoE, Qwen2-MoE, Mixtral): a float32 softmax over the bf16 router's
    logits, top-k, renormalised to sum 1 when renormalize. "sigmoid" (DeepSeek-V3, GLM-4.5): every step in float32,
    the router's weight too; sigmoid scores; e_score_correction_bias added to them for the choice only; the top-k
    among the experts of the topk_group groups (of n_group, consecutive experts) whose two best biased scores sum
    highest; weighed by their unbiased scores, renormalised (+1e-20) when renormalize, times scale
    (routed_scaling_factor). "topk_softmax" (gpt-oss): the top-k of the bf16 router's logits, its bias added, then a
    softmax over those k alone."""
    kind: str = "softmax"
    top_k: int = 1
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    def describe(self):
        groups = f" among the best {self.topk_group} of {self.n_group} groups" if self.topk_group < self.n_group else ""
        bias = {"sigmoid": ", correction bias", "topk_softmax": ", biased logits"}.get(self.kind, "")
        return (f"{self.kind} top-{self.top_k}{groups}{bias}"
                + (", renormalised" if self.renormalize else "") + (f", times {self.scale:g}" if self.scale != 1 else ""))


def every_layer(fields, layers):  # Mistral: sliding_window (default 4096; null: none) slides every layer
    window = fields.off_or(fields.count, "sliding_window", 4096)
    return ["sliding_attention" if window else "full_attention"] * layers, window


def every_layer_when_given(fields, layers):  # Mixtral: sliding_window (default null: none) slides every layer
    window = fields.off_or(fields.count, "sliding_window", None)
    return ["sliding_attention" if window else "full_attention"] * layers, window


def from_max_window_layers(fields, layers):  # Qwen2, Qwen3: with use_sliding_window, layers max_window_layers on
    window = fields.off_or(fields.count, "sliding_window", 4096) if fields.flag("use_sliding_window") else None
    first = fields.get("max_window_layers", 28, lambda v: type(v) is int and v >= 0, "a non-negative integer")
    return ["sliding_attention" if window and i >= first else "full_attention" for i in range(layers)], window


def alternate(fields, layers):  # Gemma 2, gpt-oss: even layers slide
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)], \
        fields.off_or(fields.count, "sliding_window", 4096)


def one_full_in_pattern(fields, layers):  # Gemma 3: sliding_window_pattern - 1 sliding layers, then a full one
    n = fields.count("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)], \
        fields.off_or(fields.count, "sliding_window", 4096)


def no_window(fields, layers):  # Llama
    return ["full_attention"] * layers, None


def every_layer_when_used(fields, layers):  # Qwen3-MoE: with use_sliding_window, every layer slides
    window = fields.off_or(fields.count, "sliding_window", 4096) if fields.flag("use_sliding_window") else None
    return ["sliding_attention" if window else "full_attention"] * layers, window


def even_below_max_window_layers(fields, layers):  # Qwen2-MoE: with use_sliding_window, the even layers below
    #                                                  max_window_layers (Qwen2MoeConfig's layer_types)
    used = fields.flag("use_sliding_window")
    window = fields.off_or(fields.count, "sliding_window", 4096) if used else None
    given = fields.source.get("layer_types")
    if not used and isinstance(given, list) and "sliding_attention" in given:
        raise UserError(f"{fields.where}: layer_types names sliding layers but use_sliding_window is off, which makes "
                        "transformers' window 0 (no key seen); not supported")
    first = fields.get("max_window_layers", 28, lambda v: type(v) is int and v >= 0, "a non-negative integer")
    return ["sliding_attention" if window and i % 2 == 0 and i < first else "full_attention"
            for i in range(layers)], window


def expert_count(fields, path, spellings, defaults):
    """(experts, top_k): the experts' count from the spelling that config.json gives (where it gives several, they
    must agree: transformers maps one onto the other, its attribute_map), num_experts_per_tok of them a token;
    defaults: the family's, by the first spelling (none: the field is required)."""
    given = {key: fields.source[key] for key in spellings if fields.source.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise UserError(f"{path}: {' and '.join(given)} disagree ({given})")
    experts = fields.count(next(iter(given), spellings[0]), defaults.get(spellings[0]))
    top_k = fields.count("num_experts_per_tok", defaults.get("num_experts_per_tok"))
    if top_k > experts:
        raise UserError(f"{path}: num_experts_per_tok is {top_k}, more than the {experts} experts")
    return experts, top_k


def moe_fields(fields, path, layers, defaults, spellings=("num_experts", "num_local_experts")):
    """Qwen3-MoE's fields of config.json, checked (transformers 5.24, models/qwen3_moe): num_experts (Hub configs
    say num_experts, configs that transformers 5 saves say num_local_experts), num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob (false when absent, as transformers' default), and which layers keep the
    dense MLP: Qwen3MoeDecoderLayer makes layer i a mixture of experts iff i is not in mlp_only_layers and (i + 1) %
    decoder_sparse_step == 0 (both must hold: the config's docstring says mlp_only_layers overrides the step, its
    code ANDs them). output_router_logits only adds the router's auxiliary loss to HF's .loss; prefill's loss is the
    language-modelling loss alone, so it is not read."""
    experts, top_k = expert_count(fields, path, spellings, defaults)
    step, only = fields.count("decoder_sparse_step", 1), fields.source.get("mlp_only_layers")
    only = [] if only is None else only
    # transformers would ignore an index past the last layer; here it is a mistake named, as is a repeated one
    if not (isinstance(only, list) and all(type(i) is int and 0 <= i < layers for i in only)
            and len(set(only)) == len(only)):
        raise UserError(f"{path}: mlp_only_layers is {json.dumps(only)[:60]}; expected a list of distinct layer "
                        f"indices from 0 to {layers - 1}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=fields.count("moe_intermediate_size"),
                norm_topk_prob=fields.flag("norm_topk_prob"),
                dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))


def qwen2_moe_fields(fields, path, layers, defaults):
    """Qwen2-MoE's (models/qwen2_moe): Qwen3-MoE's fields and dense-layer rule (Qwen2MoeDecoderLayer's is the same),
    num_experts its only spelling (Qwen2MoeConfig maps no other), and a shared expert beside the routed ones in every
    MoE layer, shared_expert_intermediate_size wide, its output times sigmoid(mlp.shared_expert_gate)."""
    return dict(moe_fields(fields, path, layers, defaults, ("num_experts",)), shared_expert="mlp.shared_expert",
                shared_intermediate_size=fields.count("shared_expert_intermediate_size"), shared_expert_gate=True)


def mixtral_fields(fields, path, layers, defaults):
    """Mixtral's (models/mixtral): every layer a mixture of num_local_experts (or num_experts, its attribute_map's
    other spelling) experts intermediate_size wide, num_experts_per_tok of them a token, always renormalised; their
    tensors under block_sparse_moe, an expert's w1 its gate, w3 its up, w2 its down (the Hub's names, which
    save_pretrained writes back). router_jitter_noise acts in training only."""
    experts, top_k = expert_count(fields, path, ("num_local_experts", "num_experts"), defaults)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=fields.count("intermediate_size"),
                norm_topk_prob=True, expert_names=("block_sparse_moe", "w1", "w3", "w2"))


ROUTER_METHODS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}  # DeepSeek-V3's, the only ones read


def sigmoid_moe_fields(fields, path, layers, defaults):
    """DeepSeek-V3's mixture of experts, which GLM-4.5 shares (models/deepseek_v3, glm4_moe; defaults: the family's
    configuration class's): n_routed_experts (or num_local_experts) experts moe_intermediate_size wide,
    num_experts_per_tok of them a token, chosen by the sigmoid Router (n_group, topk_group, norm_topk_prob,
    routed_scaling_factor, the correction bias in the checkpoint); n_shared_experts beside them as one MLP
    n_shared_experts * moe_intermediate_size wide, added unweighted; the first first_k_dense_replace layers the dense
    MLP, intermediate_size wide. scoring_func and topk_method, where a config gives them, must be DeepSeek-V3's; so
    must moe_layer_freq (DeepSeek's own modeling code makes every moe_layer_freq-th layer a MoE, transformers every
    layer from first_k_dense_replace on: they agree at 1 only)."""
    for key, method in ROUTER_METHODS.items():
        if fields.source.get(key, method) != method:
            raise UserError(f"{path}: {key} is {shown(fields.source[key])}; prefill's router reads {key} {method} only")
    if fields.source.get("moe_layer_freq", 1) != 1:
        raise UserError(f"{path}: moe_layer_freq is {shown(fields.source['moe_layer_freq'])}: DeepSeek's modeling code "
                        "would keep dense MLPs between the MoE layers, transformers' would not; prefill reads 1 only")
    experts, top_k = expert_count(fields, path, ("n_routed_experts", "num_local_experts"), defaults)
    groups, kept = (fields.count(key, defaults[key]) for key in ("n_group", "topk_group"))
    # transformers ranks a group by its two best scores and keeps topk_group of them, then takes the top-k there
    if experts % groups or experts // groups < 2 or kept > groups or top_k > kept * (experts // groups):
        raise UserError(f"{path}: {experts} experts in n_group {groups} groups, topk_group {kept} of them kept, top-"
                        f"{top_k}: expected groups of at least 2 experts, and no more experts chosen than kept")
    J = fields.count("moe_intermediate_size", defaults["moe_intermediate_size"])
    shared, first = (fields.get(key, defaults[key], lambda v: type(v) is int and v >= 0,
                                "a non-negative integer") for key in ("n_shared_experts", "first_k_dense_replace"))
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=J,
                norm_topk_prob=fields.flag("norm_topk_prob", defaults["norm_topk_prob"]), router_kind="sigmoid",
                n_group=groups, topk_group=kept,
                routed_scaling_factor=fields.positive("routed_scaling_factor", defaults["routed_scaling_factor"]),
                shared_expert="mlp.shared_experts" if shared else None, shared_intermediate_size=shared * J,
                dense_layers=tuple(range(min(first, layers))))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (GptOssExperts._apply_gate): gate and up interleaved in gate_up's columns (gate
    [..., ::2], up [..., 1::2]), gate clamped above at limit, up to ±limit, then (up + 1) · gate · sigmoid(alpha ·
    gate)."""
    alpha: float
    limit: float


def gpt_oss_fields(fields, path, layers, defaults):
    """gpt-oss's experts (transformers 5.24, models/gpt_oss): every layer a mixture of num_local_experts (or
    num_experts, its attribute_map's other spelling) experts intermediate_size wide, num_experts_per_tok of them a
    token. The router (mlp.router) is a linear with a bias; each token keeps its top-k logits, then a softmax over
    those (Router "topk_softmax"). The experts are fused as transformers holds them (fused_experts): gate and up
    interleaved in one projection, biases on both projections, the clamped SwiGLU between (swiglu_alpha,
    swiglu_limit). As for Qwen3-MoE, router_aux_loss_coef and output_router_logits only add the router's auxiliary
    loss to HF's .loss: not read."""
    experts, top_k = expert_count(fields, path, ("num_local_experts", "num_experts"), defaults)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=fields.count("intermediate_size"),
                router_kind="topk_softmax", fused_experts=True,
                expert_activation=ClampedSwiGLU(fields.positive("swiglu_alpha", 1.702),
                                                fields.positive("swiglu_limit", 7.0)))


@dataclass(frozen=True)
class Family:
    """What a model_type's config.json leaves to transformers' modeling code (read in transformers 5.24)."""
    layer_types: object = no_window  # (fields, layers) -> (each layer's type, the window of sliding ones)
    reads_layer_types: bool = False  # whether config.json's own layer_types overrides that (transformers reads them)
    qk_norm: bool = False          # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: bool = False      # Gemma: every RMSNorm is x̂·(1 + w), scaled in float32 before the cast
    sandwich_norms: bool = False   # Gemma: four norms a layer, the attention's and the MLP's outputs normed too
    embed_scale: bool = False      # Gemma: embeddings × √hidden, rounded to bf16
    qkv_bias: bool = False         # Qwen2: q, k and v always have biases, o never
    qkv_bias_key: tuple = None     # (key, default): config.json's switch of biases on q, k and v, o never (GLM-4.5:
    #                                attention_bias, Qwen2-MoE: qkv_bias)
    attention_bias: bool = False   # attention_bias is read: biases on q, k, v and o
    qk_norm_key: str = None        # config.json's switch of the q/k norm, off by default (GLM-4.5: use_qk_norm)
    partial_rotary: float = None   # partial_rotary_factor's default where the family rotates part of each head
    #                                (GLM-4.5: 0.5); None: a factor other than 1 is refused
    rms_norm_eps: float = 1e-6     # its default
    rope_theta: float = 10000.0    # its default
    mlp_bias: bool = False         # mlp_bias is read: biases on gate, up and down (Llama)
    softcaps: tuple = None         # defaults of attn_logit_softcapping and final_logit_softcapping (None: not read)
    scale_key: str = None          # the key whose value^-½ scales the scores (None: head_dim)
    head_dim: int = None           # head_dim's default (None: hidden / heads)
    activation_key: str = "hidden_act"
    activation: str = "silu"       # its default
    tied: bool = False             # tie_word_embeddings' default
    two_ropes: bool = False        # Gemma 3: a RoPE for sliding layers and another for full ones
    experts: object = None         # a mixture of experts: (fields, path, layers, moe_defaults) -> ModelConfig's fields
    #                                of it (which layers keep the MLP among them too); None: a dense model
    moe_defaults: tuple = ()       # (key, default) pairs of its configuration class that experts reads (none: required)
    latent_attention: bool = False  # DeepSeek-V3: multi-head latent attention (latent_fields)
    sinks: bool = False            # gpt-oss: attention sinks (AttentionSettings.sinks)
    norm_float32: bool = False     # gpt-oss: every RMSNorm is w·x̂ in float32, then the cast (NORM_FLOAT32)
    defaults: dict = None          # config.json keys whose default in the family's config class is not prefill's


GEMMA = dict(reads_layer_types=True, norm_offset=True, sandwich_norms=True, embed_scale=True, attention_bias=True,
             scale_key="query_pre_attn_scalar", head_dim=256, activation_key="hidden_activation",
             activation="gelu_pytorch_tanh", tied=True)
FAMILIES = {
    "llama": Family(attention_bias=True, mlp_bias=True),
    "mistral": Family(layer_types=every_layer),
    "qwen2": Family(layer_types=from_max_window_layers, reads_layer_types=True, qkv_bias=True),
    "qwen3": Family(layer_types=from_max_window_layers, reads_layer_types=True, qk_norm=True, attention_bias=True,
                    head_dim=128),
    "gemma2": Family(layer_types=alternate, softcaps=(50.0, 30.0), **GEMMA),
    "gemma3_text": Family(layer_types=one_full_in_pattern, qk_norm=True, softcaps=(None, None), two_ropes=True,
                          **GEMMA),
    "qwen3_moe": Family(layer_types=every_layer_when_used, qk_norm=True, attention_bias=True, experts=moe_fields),
    "qwen2_moe": Family(layer_types=even_below_max_window_layers, reads_layer_types=True,
                        qkv_bias_key=("qkv_bias", True), experts=qwen2_moe_fields),
    "mixtral": Family(layer_types=every_layer_when_given, rms_norm_eps=1e-5, rope_theta=1e6, experts=mixtral_fields,
                      moe_defaults=(("num_local_experts", 8), ("num_experts_per_tok", 2))),
    # GLM-4.5, 4.6, 4.5-Air: Glm4MoeConfig's defaults. Its MTP layers (num_nextn_predict_layers, tensors of layer
    # index num_hidden_layers) are not part of the causal LM: transformers drops them, and prefill never reads them
    "glm4_moe": Family(qkv_bias_key=("attention_bias", False), qk_norm_key="use_qk_norm", partial_rotary=0.5,
                       rms_norm_eps=1e-5, experts=sigmoid_moe_fields, moe_defaults=(
                           ("n_routed_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 1408),
                           ("n_shared_experts", 1), ("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0),
                           ("norm_topk_prob", True), ("first_k_dense_replace", 1))),
    # DeepSeek-V3, Moonlight, Kimi-K2 (a copy whose config.json says deepseek_v3): DeepseekV3Config's defaults; its
    # MTP layers likewise
    "deepseek_v3": Family(attention_bias=True, latent_attention=True, experts=sigmoid_moe_fields, moe_defaults=(
        ("n_routed_experts", 256), ("num_experts_per_tok", 8), ("moe_intermediate_size", 2048),
        ("n_shared_experts", 1), ("n_group", 8), ("topk_group", 4), ("routed_scaling_factor", 2.5),
        ("norm_topk_prob", True), ("first_k_dense_replace", 3))),
    # transformers 5.24's GptOssConfig: its defaults where prefill's differ (a config.json the release wrote says
    # each), its RoPE YaRN where rope_parameters is absent or null
    "gpt_oss": Family(layer_types=alternate, reads_layer_types=True, attention_bias=True, head_dim=64, sinks=True,
                      norm_float32=True, rms_norm_eps=1e-5, rope_theta=150000.0, experts=gpt_oss_fields,
                      moe_defaults=(("num_local_experts", 128), ("num_experts_per_tok", 4)), defaults={
                          "num_key_value_heads": 8, "sliding_window": 128, "attention_bias": True,
                          "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False, "original_max_position_embeddings": 4096}}),
}
# keys that mark a config.json as a mixture of experts (Mixtral, GPT-OSS: num_local_experts; Qwen2-MoE, OLMoE:
# num_experts; DeepSeek: n_routed_experts): of those, prefill runs the families whose row has experts
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' ACT2FN names
ROPE_KINDS = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma 3 saved as multimodal (model_type gemma3): the text model's config is its text_config, its tensors lie under
# language_model.model. (as transformers 4 saves it) or model.language_model. (5); the vision tower is never read.
MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


class ConfigFields:
    """Checked reads of one JSON object of config.json: one message per bad field, naming the file and the field;
    null means absent."""

    def __init__(self, source, where):
        if not isinstance(source, dict):
            raise UserError(f"{where}: expected a JSON object, got {shown(source)}")
        self.source, self.where = source, where

    def get(self, key, default, valid, expected):
        value = self.source.get(key)
        if value is None:
            if default is None:
                raise UserError(f"{self.where} lacks {key}")
            value = default
        if isinstance(value, list) and key in SIZES:
            raise UserError(f"{self.where}: {key} is a list (layers of different sizes); prefill reads one {key} "
                            "for all layers")
        if not valid(value):
            raise UserError(f"{self.where}: {key} is {shown(value)}; expected {expected}")
        return value

    def count(self, key, default=None):  # bool is an int to Python, not to JSON
        return self.get(key, default, lambda v: type(v) is int and v > 0, "a positive integer")

    def positive(self, key, default=None):
        return self.get(key, default, lambda v: type(v) in (int, float) and 0 < v < math.inf, "a positive number")

    def flag(self, key, default=False):
        return self.get(key, default, lambda v: type(v) is bool, "true or false")

    def off_or(self, read, key, default):  # read(key, default), or None where the value is null (off), or it is
        #                                        absent and the default is None
        return None if self.source.get(key, default) is None else read(key, default)


def yarn_mscale(factor, mscale=1):  # transformers' get_mscale (yarn_get_mscale in DeepSeek-V3's modeling)
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope(fields, theta, partial):
    """Every field transformers' _compute_yarn_parameters reads (5.24): factor (required: its validation raises
    without it), original_max_position_embeddings (read_ropes defaults it to max_position_embeddings, as
    standardize_rope_params does), beta_fast and beta_slow (32 and 1 where absent, null or 0), truncate (true where
    absent; null is false to its truthiness), and attention_factor, else from factor (with mscale and mscale_all_dim
    where both are set and non-zero: DeepSeek's ratio, 1 where they are equal)."""
    number = lambda v: type(v) in (int, float) and 0 <= v < math.inf
    factor = fields.positive("factor")
    mscale, all_dim = (fields.get(key, 0, number, "a non-negative number") for key in ("mscale", "mscale_all_dim"))
    if fields.source.get("attention_factor") is not None:
        attention_factor = fields.positive("attention_factor")
    elif mscale and all_dim:
        attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim))
    else:
        attention_factor = yarn_mscale(factor)
    truncate = fields.source.get("truncate", True)
    if type(truncate) not in (bool, type(None)):
        raise UserError(f"{fields.where}: truncate is {shown(truncate)}; expected true or false")
    return Rope(theta, "yarn", factor,
                original_max_position_embeddings=fields.count("original_max_position_embeddings"),
                beta_fast=fields.get("beta_fast", 32, number, "a non-negative number") or 32,
                beta_slow=fields.get("beta_slow", 1, number, "a non-negative number") or 1,
                truncate=bool(truncate), attention_factor=attention_factor, partial=partial)


def rope_of(params, where, partial=None):
    # partial: partial_rotary_factor's default where the family reads it (None: a factor other than 1 is refused)
    fields = ConfigFields(params, where)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UserError(f"{where}: RoPE type {shown(kind)} is not supported (only {', '.join(ROPE_KINDS)})")
    if partial is None and params.get("partial_rotary_factor") is not None and not (
            type(params["partial_rotary_factor"]) in (int, float) and params["partial_rotary_factor"] == 1):
        raise UserError(f"{where}: partial_rotary_factor is {shown(params['partial_rotary_factor'])}; RoPE on part of "
                        "a head is not supported")
    part = fields.get("partial_rotary_factor", partial or 1.0, lambda v: type(v) in (int, float) and 0 < v <= 1,
                      "a number in (0, 1]")
    theta = fields.positive("rope_theta")
    if kind == "default":
        return Rope(theta, partial=part)
    if kind == "linear":
        return Rope(theta, kind, fields.positive("factor"), partial=part)
    if kind == "yarn":
        return yarn_rope(fields, theta, part)
    return Rope(theta, kind, fields.positive("factor"), fields.positive("low_freq_factor"),
                fields.positive("high_freq_factor"), fields.count("original_max_position_embeddings"), partial=part)


def read_ropes(raw, family, path):
    """{layer type: Rope} for Gemma 3 (its two RoPEs), else {None: the one Rope}, from either spelling: transformers 4's
    rope_theta + rope_scaling (Gemma 3: + rope_local_base_freq), or transformers 5's rope_parameters (nested per
    layer type for Gemma 3)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UserError(f"{path}: rope_parameters (or rope_scaling) is {shown(params)}, not a JSON object")
    common = {"partial_rotary_factor": raw["partial_rotary_factor"]} if "partial_rotary_factor" in raw else {}
    if "max_position_embeddings" in raw:  # llama3's and yarn's original context where not given, as transformers'
        # standardize_rope_params sets it
        common["original_max_position_embeddings"] = raw["max_position_embeddings"]
    if family.two_ropes:
        nested = raw.get("rope_parameters") or {}
        if not isinstance(nested, dict) or not set(nested) <= set(LAYER_TYPES):
            raise UserError(f"{path}: rope_parameters must be nested by layer type ({', '.join(LAYER_TYPES)})")
        # transformers 4's rope_scaling scales the full layers
        full = {**common, **(nested.get("full_attention") or {}), **(raw.get("rope_scaling") or {})}
        full.setdefault("rope_theta", raw.get("rope_theta", 1e6))
        sliding = {**common, **(nested.get("sliding_attention") or {})}
        sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", 1e4))
        return {"full_attention": rope_of(full, f"{path}: full_attention RoPE"),
                "sliding_attention": rope_of(sliding, f"{path}: sliding_attention RoPE")}
    if set(params) & set(LAYER_TYPES):
        raise UserError(f"{path}: rope_parameters nested by layer type: {raw.get('model_type')} has one RoPE")
    return {None: rope_of({"rope_theta": raw.get("rope_theta", family.rope_theta), **common, **params}, f"{path}: RoPE",
                          family.partial_rotary)}


def latent_fields(fields, path, heads):
    """DeepSeek-V3's fields of config.json (transformers 5.24, models/deepseek_v3), with DeepseekV3Config's defaults
    where absent: its multi-head latent attention's q_lora_rank (null: q is q_proj, no LoRA), kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave (null is false to DeepseekV3Attention's test of
    it), num_key_value_heads (the keys it expands are one a query head: it must be the query heads' count). Its q/k
    head_dim is nope + rope; the config's own head_dim, where given, is what DeepseekV3Config keeps and sizes RoPE by
    (its default: qk_rope_head_dim, which it must then be); qk_head_dim is not read. Its mixture of experts is
    sigmoid_moe_fields'."""
    source = fields.source
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace"):
        if key in source and source[key] is None:  # transformers' modules would be built of None and fail
            raise UserError(f"{path}: {key} is null; transformers' deepseek_v3 needs a number there")
    interleave = source.get("rope_interleave", True)
    if type(interleave) not in (bool, type(None)):
        raise UserError(f"{path}: rope_interleave is {shown(interleave)}; expected true or false")
    if fields.count("num_key_value_heads", heads) != heads:
        raise UserError(f"{path}: num_key_value_heads is {source['num_key_value_heads']}, not num_attention_heads "
                        f"({heads}): DeepSeek's latent attention expands one key and value a query head")
    nope, rope = fields.count("qk_nope_head_dim", 128), fields.count("qk_rope_head_dim", 64)
    if "head_dim" in source and source["head_dim"] != rope:
        raise UserError(f"{path}: head_dim is {shown(source['head_dim'])}, not qk_rope_head_dim ({rope}): "
                        "transformers' deepseek_v3 would size RoPE by it")
    return dict(q_lora_rank=0 if source.get("q_lora_rank", 1536) is None else fields.count("q_lora_rank", 1536),
                kv_lora_rank=fields.count("kv_lora_rank", 512), qk_nope_head_dim=nope, head_dim=nope + rope,
                rope_dim=rope, v_head_dim=fields.count("v_head_dim", 128), rope_interleave=bool(interleave))


def latent_scale(head_dim, rope, params, path):
    """DeepseekV3Attention's softmax scale: qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 where the
    RoPE is not the default one and mscale_all_dim is set and non-zero (yarn_apply_mscale, which reads the RoPE's
    raw parameters: any type but default)."""
    scale = head_dim ** (-0.5)
    all_dim = ConfigFields(params, f"{path}: RoPE").get("mscale_all_dim", 0, lambda v: type(v) in (int, float)
                                                         and 0 <= v < math.inf, "a non-negative number")
    if rope.kind != "default" and all_dim:
        mscale = yarn_mscale(rope.factor, all_dim)
        scale = scale * mscale * mscale
    return scale


FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128
# block-wise FP8 (the official Qwen3-*-FP8 releases, DeepSeek-V3's layout): transformers' FineGrainedFP8Config, each
# field as it must be (absent: transformers' default, which is that value)
FP8_CONFIG = {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
              "expert_dtype": "fp8", "modules_to_convert": None}
FP8_SCALE_FORMATS = ("float", "ue8m0")


def compressed_tensors(quantized):
    # llm-compressor's checkpoints in a few words: the format (its FP8-dynamic is "float-quantized", each weight
    # scaled per output channel or per tensor, in weight_scale) and how each group's weights are scaled
    groups = quantized.get("config_groups")
    weights = [group.get("weights") for group in groups.values() if isinstance(group, dict)] \
        if isinstance(groups, dict) else []
    scaled = sorted({shown(w.get("strategy")) for w in weights if isinstance(w, dict) and "strategy" in w})
    return "compressed-tensors" + (f" in format {shown(quantized['format'])}" if "format" in quantized else "") + (
        f", weights scaled per {' and per '.join(scaled)}" if scaled else "")


def module_patterns(quantized, path):
    # a quantization_config's modules_to_not_convert, checked: patterns naming the modules kept bf16 (not_converted)
    kept = quantized.get("modules_to_not_convert") or []
    if not (isinstance(kept, list) and all(isinstance(pattern, str) for pattern in kept)):
        raise UserError(f"{path}: quantization_config modules_to_not_convert is {shown(kept)}; expected a list of "
                        "module names")
    for pattern in kept:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UserError(f"{path}: quantization_config modules_to_not_convert holds {shown(pattern)}, which "
                            f"transformers reads as a regular expression, and it is not one ({e})") from None
    return tuple(kept)


def fp8_fields(quantized, path):
    """ModelConfig's quantization fields from a quantization_config (None: none, unquantized weights): block-wise
    FP8's scale format and modules_to_not_convert, or MXFP4's (gpt-oss as released: transformers' Mxfp4Config, which
    writes quant_method and modules_to_not_convert alone). Everything else is refused with one line naming what it
    is."""
    if quantized is None:
        return {}
    method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
    if method == "compressed-tensors" and isinstance(quantized, dict):
        raise UserError(f"{path}: quantization_config is {compressed_tensors(quantized)}: llm-compressor's layout, "
                        "which prefill does not read; it reads BF16, F16 or F32 weights, or block-wise FP8 "
                        "(quant_method fp8, weight_scale_inv per 128x128 block)")
    if method == "mxfp4" and isinstance(quantized, dict):
        return dict(mxfp4=True, mxfp4_not_converted=module_patterns(quantized, path))
    if method != "fp8":
        raise UserError(f"{path}: quantized weights (quantization_config {shown(method)}); prefill reads BF16, F16 "
                        "or F32 weights, block-wise FP8 (quant_method fp8) or gpt-oss's MXFP4 experts (quant_method "
                        "mxfp4)")
    for key, want in FP8_CONFIG.items():
        if quantized.get(key, want) != want:
            raise UserError(f"{path}: quantization_config {key} is {json.dumps(quantized[key])[:40]}; prefill reads "
                            f"block-wise FP8 with {key} {json.dumps(want)} only")
    scales = quantized.get("scale_fmt", "float")
    if scales not in FP8_SCALE_FORMATS:
        raise UserError(f"{path}: quantization_config scale_fmt is {shown(scales)}; expected float or ue8m0")
    return dict(fp8_scales=scales, fp8_not_converted=module_patterns(quantized, path))


# MXFP4 (gpt-oss's experts as released; transformers' integrations/mxfp4.py): a weight [experts, in, out] (transformers'
# layout, prefill's bf16 one) is held as X_blocks uint8 [experts, out, in / 32, 16], two e2m1 codes a byte (the even
# element in the low nibble), and X_scales uint8 [experts, out, in / 32], an e8m0 exponent (bias 127) for each 32
MXFP4_GROUP = 32
MXFP4_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # transformers'


def is_fp8_weight(name):
    # a layer's projections (attention, MLP, experts; DeepSeek's kv_a_proj_with_mqa too: transformers converts every
    # nn.Linear) are FP8 in a block-wise FP8 checkpoint, but for those modules_to_not_convert names (not_converted);
    # norms, biases and the MoE router (mlp.gate) stay bf16, as do the embedding and lm_head
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def not_converted(patterns, prefixes=()):
    """The test of whether modules_to_not_convert's patterns name a module (its tensor's name less ".weight"), as
    transformers reads them: from the name's start as a regular expression ending at a module boundary
    ("model.layers.1" names model.layers.1.mlp.up_proj, not model.layers.11's), or as a plain suffix ("mlp.gate"
    names the router, not mlp.gate_proj). prefixes: the config's tensor_prefixes, whose spellings in the files are
    tried too. All patterns in one expression: a 128-expert model of 94 layers asks for 36k modules."""
    if not patterns:
        return lambda module: False
    start = re.compile("(?:" + "|".join(f"(?:{pattern})" for pattern in patterns) + ")(?:(?<=\\.)|(?=\\.|$))")
    suffixes = tuple(patterns)
    return lambda module: any(start.match(name) or name.endswith(suffixes) for name in [module] + [
        file + module[len(read):] for file, read in prefixes if module.startswith(read)])


def scale_grid(shape):
    # the scales of a weight [out, in]: one per FP8_BLOCK x FP8_BLOCK block, the last row and column of blocks partial
    return tuple(-(-n // FP8_BLOCK) for n in shape)


def misread_side(n):
    """Whether transformers reads an FP8 weight's side of n otherwise than in FP8_BLOCK blocks, the last partial (as
    DeepSeek's weight_dequant, and transformers' own FP8Linear and _dequantize_fp8_weight on a GPU, read it): its
    CPU load (Fp8Dequantize, the float32 reference) takes the block from the side over its scale grid, which is
    FP8_BLOCK where n is a multiple of it, and n itself below it; where n is neither and the grid divides it (192 over
    2 blocks: 96), it reads blocks of that size instead. Where the grid does not divide n (DeepSeek-V3's
    kv_a_proj_with_mqa: 576 rows over 5), that load raises and only the GPU one, in FP8_BLOCK blocks, reads it."""
    return n > FP8_BLOCK and n % FP8_BLOCK and n % scale_grid((n,))[0] == 0


def held_layout(layout, numel, fp8, dtypes, mxfp4=frozenset(), runs=()):
    """How a layer is held (resident, in host memory, in a slot): [(name, byte offset, shape, dtype)], and its bytes.
    layout: its bf16 layout, {name: (offset in bf16 elements, shape)}, numel bf16 elements long, each tensor bf16 but
    those dtypes names ({name: dtype}: the V3 router's float32 ones); fp8: the names of its weights held as FP8, each
    one's float8 bytes then its scales (float32, one per FP8_BLOCK x FP8_BLOCK block); mxfp4: those held as MXFP4,
    each one's blocks then its scales (uint8, 4.25 bits a weight). Either kind is dequantized into the bf16 layout just
    before the layer runs. With none, the bf16 layout itself. runs: FP8 weights outside the layout, never dequantized
    with it (fp8_experts: the routed experts' gate and up, their down), held first, each run's float8 bytes one
    [weights, rows, columns] tensor, then its scales one [weights, grid rows, grid columns] (the fused experts' FP8
    variant reads them so: fp8_scales_fit), then the layout's tensors."""
    if not fp8 and not mxfp4 and not any(runs):
        return [(name, offset * DTYPE.itemsize, shape, dtypes.get(name, DTYPE)) for name, (offset, shape)
                in layout.items()], numel * DTYPE.itemsize
    held, offset = [], 0
    for run in runs:
        for suffix, dtype, shape_of in (("", FP8, lambda shape: shape), ("_scale_inv", torch.float32, scale_grid)):
            offset = -(-offset // 128) * 128
            for name, shape in run:
                held.append((name + suffix, offset, shape_of(shape), dtype))
                offset += math.prod(shape_of(shape)) * dtype.itemsize
    for name, (_, shape) in layout.items():
        parts = [(name, shape, dtypes.get(name, DTYPE))]
        if name in fp8:
            parts = [(name, shape, FP8), (name + "_scale_inv", scale_grid(shape), torch.float32)]
            if any(map(misread_side, shape)):
                raise UserError(f"an FP8 weight's shape {list(shape)} ({name}) is not a multiple of the "
                                f"{FP8_BLOCK}x{FP8_BLOCK} blocks, and transformers' two loads read its scales "
                                "differently (on the CPU in blocks of its side over its scale grid)")
        elif name in mxfp4:  # [experts, in, out] in the bf16 layout, its blocks and scales by output row
            E, K, N = shape
            if K % MXFP4_GROUP:
                raise UserError(f"an MXFP4 weight's input width {K} ({name}, shape {list(shape)}) is not a multiple "
                                f"of its {MXFP4_GROUP}-weight blocks")
            parts = [(name + "_blocks", (E, N, K // MXFP4_GROUP, MXFP4_GROUP // 2), torch.uint8),
                     (name + "_scales", (E, N, K // MXFP4_GROUP), torch.uint8)]
        for part, part_shape, dtype in parts:
            offset = -(-offset // 128) * 128
            held.append((part, offset, part_shape, dtype))
            offset += math.prod(part_shape) * dtype.itemsize
    return held, -(-offset // 128) * 128


# How an RMSNorm scales its normalised x̂ (rms_norm's style): Llama and Qwen cast x̂ to bf16, then multiply by the
# weight in bf16; Gemma multiplies by (1 + w) in float32 and casts last; gpt-oss multiplies by w in float32 and casts
# last (GptOssRMSNorm: `(self.weight * hidden_states).to(input_dtype)`, the bf16 weight promoted by the float32 x̂;
# its _keep_in_fp32_modules keep the weight itself float32 only in a float16 load, modeling_utils' dtype plan)
NORM_CAST, NORM_OFFSET, NORM_FLOAT32 = 0, 1, 2


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    ropes: tuple                # Rope per layer
    attention: tuple            # AttentionSettings per layer
    activation: str = "silu"    # the gated MLP's: "silu" or "gelu_tanh"
    qk_norm: bool = False       # the rest: as Family says
    norm_offset: bool = False
    sandwich_norms: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    embed_scale: bool = False
    final_softcap: float | None = None  # of the logits: cap · tanh(logits / cap), in bf16 as transformers
    tensor_prefixes: tuple = ()  # (prefix in the files, prefix read) pairs: a multimodal Gemma 3
    max_position_embeddings: int = 0  # 0: not given; a longer text is computed all the same, as transformers does
    num_experts: int = 0            # a mixture of experts (0: a dense MLP): each layer's experts, of which a token
    num_experts_per_tok: int = 0    # meets these, each moe_intermediate_size wide, chosen and weighed by the Router
    moe_intermediate_size: int = 0  # of these fields (self.router): its kind, renormalised when norm_topk_prob; the
    norm_topk_prob: bool = False    # sigmoid one's groups and scale
    router_kind: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    dense_layers: tuple = ()        # layers whose feed-forward is the dense MLP, intermediate_size wide
    expert_names: tuple = ("mlp", "gate_proj", "up_proj", "down_proj")  # the MoE block's module inside a layer, an
    #                                 expert's gate, up and down projections (Mixtral: block_sparse_moe, w1, w3, w2)
    shared_expert: str = None       # the shared experts' module (V3, GLM: mlp.shared_experts, several as one MLP;
    shared_intermediate_size: int = 0  # Qwen2-MoE: mlp.shared_expert), a gated MLP this wide beside the routed ones
    shared_expert_gate: bool = False   # Qwen2-MoE: the shared expert's output times sigmoid(mlp.shared_expert_gate)
    fp8_scales: str = None          # block-wise FP8 weights (fp8_fields): their scales' format, "float" or "ue8m0";
    #                                 None: the weights are bf16 (or f16, f32) in the files
    fp8_not_converted: tuple = ()   # its modules_to_not_convert: patterns naming modules kept bf16 (not_converted)
    v_head_dim: int = None          # the values' head dim (None: head_dim, that of q and k); DeepSeek-V3: 128 to 192
    rope_dim: int = None            # the channels RoPE rotates, its tables' width (None: head_dim)
    rope_interleave: bool = False   # latent attention's RoPE pairs channels (0, 1), (2, 3), ..., not (i, i + half)
    kv_lora_rank: int = 0           # DeepSeek's multi-head latent attention (0: none; latent_fields, latent_qkv):
    q_lora_rank: int = 0            # the keys' and values' latent, q's (0: q_proj, no LoRA), each head's q/k
    qk_nope_head_dim: int = 0       # channels without RoPE, then rope_dim with it
    norm_float32: bool = False      # gpt-oss's norms (NORM_FLOAT32)
    fused_experts: bool = False     # gpt-oss's experts (gpt_oss_fields): mlp.router with its bias, mlp.experts'
    #                                 gate_up_proj [experts, hidden, 2 moe_intermediate] (gate and up interleaved in its
    #                                 columns) and down_proj [experts, moe_intermediate, hidden], each with a bias
    expert_activation: object = "silu"  # the experts': "silu", or ClampedSwiGLU (gpt-oss)
    mxfp4: bool = False             # MXFP4 experts (gpt-oss as released; fp8_fields)
    mxfp4_not_converted: tuple = ()  # its modules_to_not_convert
    fp8_experts: bool = False       # block-wise FP8 routed experts held apart as the fused experts' FP8 variant reads
    #                                 them and never dequantized with their layer (expert_runs): the memory plan's
    #                                 choice where the whole layer's bf16 scratch does not fit (held_experts_config)

    def __post_init__(self):
        D = self.head_dim
        self.v_head_dim, self.rope_dim = self.v_head_dim or D, self.rope_dim or D
        self.q_size = self.num_attention_heads * D  # != hidden_size in Qwen3-32B (8192 vs 5120)
        self.kv_size = self.num_key_value_heads * D  # the keys' (and values' but for v_head_dim: v_size)
        self.v_size = self.num_key_value_heads * self.v_head_dim
        # the first projection's rows: q, k and v (fused); with latent attention q's (or q_a's) and the latent's
        self.qkv_rows = ((self.q_lora_rank or self.q_size) + self.kv_lora_rank + self.rope_dim if self.kv_lora_rank
                         else self.q_size + 2 * self.kv_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_dim < 2 or self.rope_dim % 2:
            raise UserError(f"{'qk_rope_head_dim' if self.kv_lora_rank else 'head_dim'} is {self.rope_dim}; RoPE "
                            "rotates pairs of a head's channels: it must be even and positive")
        for rope in set(self.ropes):
            if rope.rotary_dim(D) < 2 or rope.rotary_dim(D) % 2:
                raise UserError(f"partial_rotary_factor {rope.partial} rotates {rope.rotary_dim(D)} of head_dim {D}'s "
                                "channels; RoPE rotates pairs: it must be even and positive")
        self.router = Router(self.router_kind, self.num_experts_per_tok, self.norm_topk_prob, self.n_group,
                             self.topk_group, self.routed_scaling_factor) if self.num_experts else None
        # tensors held in another dtype than bf16 (the rest): the V3 router's weight and correction bias stay float32
        # in a bf16 model (transformers' _keep_in_fp32_modules_strict), whatever the files hold (an upcast is exact);
        # a float32 one takes the room of two bf16 elements an element in the layer's buffer
        block = self.expert_names[0]
        self.tensor_dtypes = {f"{block}.gate.{name}": torch.float32 for name in ("weight", "e_score_correction_bias")
                              } if self.router_kind == "sigmoid" else {}
        # Each layer's kind: "moe" (a mixture of experts) or "mlp" (the gated MLP); a Qwen3-MoE may mix them.
        self.layer_kinds = tuple("moe" if self.num_experts and i not in self.dense_layers else "mlp"
                                 for i in range(self.num_hidden_layers))
        # A kind's tensors in their order inside the layer's flat buffer. q,k,v (and their biases) and gate,up (and
        # theirs) sit in adjacent rows, so the fused matrices and bias vectors are plain views; only group starts are
        # aligned (128 B).
        # fp8_experts: a MoE layer's routed experts are no part of its bf16 layout (held apart: held_layout's runs).
        routed = self.routed_experts() if "moe" in self.layer_kinds and not self.fused_experts else ((), ())
        apart = routed if self.fp8_experts else ((), ())
        self.layouts, numels = {}, {}  # kind -> {name: (offset, shape)}, kind -> the buffer's element count
        for kind in dict.fromkeys(self.layer_kinds):
            self.layouts[kind], offset = {}, 0
            for name, shape, fused in self.attention_tensors() + self.mlp_tensors(kind):
                if kind == "moe" and (name, shape) in apart[0] + apart[1]:
                    continue
                if not fused:
                    offset = -(-offset // 64) * 64
                self.layouts[kind][name] = (offset, shape)
                offset += math.prod(shape) * self.tensor_dtypes.get(name, DTYPE).itemsize // DTYPE.itemsize
            numels[kind] = offset
        # How each layer is held (held_layout), a list shared by the layers held alike: the bf16 layout itself, or
        # with FP8 weights each projection's float8 bytes and scales, but for those modules_to_not_convert names,
        # which stay bf16 in their own layers alone (a checkpoint may keep its first layers in bf16); each is
        # dequantized into the bf16 layout just before the layer runs (the plan counts that scratch:
        # dequantized_bytes).
        # MXFP4 (gpt-oss): the experts' two weights, but in the layers whose experts modules_to_not_convert names
        # (transformers converts a GptOssMLP's experts or not, should_convert_module).
        # Whether every MoE layer's routed experts are FP8 (can_hold_fp8_experts): then they may be held apart.
        held, alike, kept = [], {}, not_converted(self.fp8_not_converted, self.tensor_prefixes)
        kept_mxfp4 = not_converted(self.mxfp4_not_converted, self.tensor_prefixes)
        fp8_routed = []  # per MoE layer: whether its routed experts are all FP8
        for layer, kind in enumerate(self.layer_kinds):
            runs = apart if kind == "moe" else ((), ())
            fp8 = frozenset(name for name in [*self.layouts[kind], *(name for name, _ in runs[0] + runs[1])]
                            if self.fp8_scales and is_fp8_weight(name)
                            and not kept(f"model.layers.{layer}.{name[:-len('.weight')]}"))
            mxfp4 = frozenset(name for name in self.layouts[kind] if self.mxfp4 and name in MXFP4_WEIGHTS
                              and not kept_mxfp4(f"model.layers.{layer}.mlp.experts"))
            if kind == "moe" and routed[0]:
                fp8_routed.append({name for name, _ in routed[0] + routed[1]} <= fp8)
            if (kind, fp8, mxfp4) not in alike:
                alike[kind, fp8, mxfp4] = held_layout(self.layouts[kind], numels[kind], fp8, self.tensor_dtypes, mxfp4,
                                                      runs)
            held.append(alike[kind, fp8, mxfp4])
        self.can_hold_fp8_experts = bool(fp8_routed) and all(fp8_routed)
        assert self.can_hold_fp8_experts or not self.fp8_experts, "fp8_experts: routed experts all FP8 only"
        self.held = tuple(parts for parts, _ in held)
        # fp8_experts: where a MoE layer's held buffer holds its experts' runs (held_layout puts them first, at the
        # same offsets in every MoE layer), by LayerWeights field: (byte offset, shape, dtype)
        self.expert_runs = {}
        if self.fp8_experts:
            moe = dict((name, (offset, dtype)) for name, offset, _, dtype in held[self.layer_kinds.index("moe")][0])
            E, H, J = self.num_experts, self.hidden_size, self.moe_intermediate_size
            for field, (first, _), (N, K), parts in (("gate_up", routed[0][0], (J, H), 2),
                                                     ("down", routed[1][0], (H, J), 1)):
                self.expert_runs[field] = (moe[first][0], (E, parts * N, K), FP8)
                self.expert_runs[field + "_scales"] = (moe[first + "_scale_inv"][0],
                                                       (E, parts * scale_grid((N,))[0], scale_grid((K,))[0]),
                                                       torch.float32)
        self.layer_nbytes = tuple(nbytes for _, nbytes in held)
        # the largest layer's: what a streaming slot and a storage ring's buffer hold (a model of one kind: every
        # layer's), in bytes and in bf16 elements
        largest = self.layer_nbytes.index(max(self.layer_nbytes))
        self.largest_kind = self.layer_kinds[largest]
        self.layer_bytes = self.layer_nbytes[largest]
        self.layer_layout = self.layouts[self.largest_kind]  # its bf16 layout (an FP8 layer's once dequantized)
        self.layer_numel = self.layer_bytes // DTYPE.itemsize
        self.quantized = bool(self.fp8_scales or self.mxfp4)  # layers held FP8 or MXFP4, dequantized before they run
        self.dequantized_bytes = max(numels.values()) * DTYPE.itemsize if self.quantized else 0
        self.norm_style = NORM_OFFSET if self.norm_offset else NORM_FLOAT32 if self.norm_float32 else NORM_CAST

    def attention_tensors(self):
        # (name inside model.layers.N, shape, whether it continues the fused view before it): the attention half
        H, Q, KV, D = self.hidden_size, self.q_size, self.kv_size, self.head_dim
        if self.kv_lora_rank:
            return self.latent_attention_tensors()
        out = [("input_layernorm.weight", (H,), False), ("self_attn.q_proj.weight", (Q, H), False),
               ("self_attn.k_proj.weight", (KV, H), True), ("self_attn.v_proj.weight", (KV, H), True)]
        if self.qkv_bias:
            out += [("self_attn.q_proj.bias", (Q,), False), ("self_attn.k_proj.bias", (KV,), True),
                    ("self_attn.v_proj.bias", (KV,), True)]
        out.append(("self_attn.o_proj.weight", (H, Q), False))
        if self.o_bias:
            out.append(("self_attn.o_proj.bias", (H,), False))
        if any(how.sinks for how in self.attention):  # gpt-oss: a logit a query head
            out.append(("self_attn.sinks", (self.num_attention_heads,), False))
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", (D,), False), ("self_attn.k_norm.weight", (D,), False)]
        if self.sandwich_norms:  # Gemma's post_attention_layernorm norms the attention's output
            out.append(("post_attention_layernorm.weight", (H,), False))
        return out

    def latent_attention_tensors(self):
        # DeepSeek's: q_a_proj (or q_proj, without q LoRA) and kv_a_proj_with_mqa in adjacent rows, both reading the
        # normed x (one GEMM), their biases likewise where both have one (q_proj never has); then each latent's
        # norm and up-projection, and o_proj from every head's v
        H, A, R = self.hidden_size, self.q_lora_rank, self.kv_lora_rank
        heads, first = self.num_attention_heads, "self_attn.q_a_proj" if self.q_lora_rank else "self_attn.q_proj"
        latent = R + self.rope_dim
        out = [("input_layernorm.weight", (H,), False), (f"{first}.weight", (A or self.q_size, H), False),
               ("self_attn.kv_a_proj_with_mqa.weight", (latent, H), True)]
        if self.qkv_bias:
            out += [(f"{first}.bias", (A,), False)] if A else []
            out.append(("self_attn.kv_a_proj_with_mqa.bias", (latent,), bool(A)))
        if A:
            out += [("self_attn.q_a_layernorm.weight", (A,), False), ("self_attn.q_b_proj.weight", (self.q_size, A),
                                                                       False)]
        out += [("self_attn.kv_a_layernorm.weight", (R,), False),
                ("self_attn.kv_b_proj.weight", (heads * (self.qk_nope_head_dim + self.v_head_dim), R), False),
                ("self_attn.o_proj.weight", (H, heads * self.v_head_dim), False)]
        if self.o_bias:
            out.append(("self_attn.o_proj.bias", (H,), False))
        return out

    def mlp_tensors(self, kind):
        # the feed-forward half: its input norm, the gated MLP ("mlp") or the mixture of experts ("moe")
        H, I = self.hidden_size, self.intermediate_size
        norm = "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"
        if kind == "moe" and self.fused_experts:  # gpt-oss: the router and its bias; each weight [experts, in, out]
            # as transformers holds it (and saves it in bf16), viewed by layer_views as the experts' [experts, out, in]
            E, J = self.num_experts, self.moe_intermediate_size
            return [(f"{norm}.weight", (H,), False), ("mlp.router.weight", (E, H), False),
                    ("mlp.router.bias", (E,), False), ("mlp.experts.gate_up_proj", (E, H, 2 * J), False),
                    ("mlp.experts.gate_up_proj_bias", (E, 2 * J), False), ("mlp.experts.down_proj", (E, J, H), False),
                    ("mlp.experts.down_proj_bias", (E, H), False)]
        if kind == "moe":  # the router (and the V3 router's correction bias); each expert's gate rows then its up
            # rows, expert after expert (one [experts, 2 moe_intermediate, hidden] view, expert e's fused gate_up at
            # [e]); each expert's down; the shared experts' gate and up rows, their down, Qwen2-MoE's gate
            E, block = self.num_experts, self.expert_names[0]
            out = [(f"{norm}.weight", (H,), False), (f"{block}.gate.weight", (E, H), False)]
            if self.router_kind == "sigmoid":
                out.append((f"{block}.gate.e_score_correction_bias", (E,), False))
            gate_up, downs = self.routed_experts()
            out += [(name, shape, i > 0) for run in (gate_up, downs) for i, (name, shape) in enumerate(run)]
            if self.shared_expert:
                S = self.shared_intermediate_size
                out += [(f"{self.shared_expert}.gate_proj.weight", (S, H), False),
                        (f"{self.shared_expert}.up_proj.weight", (S, H), True),
                        (f"{self.shared_expert}.down_proj.weight", (H, S), False)]
            if self.shared_expert_gate:
                out.append(("mlp.shared_expert_gate.weight", (1, H), False))
            return out
        out = [(f"{norm}.weight", (H,), False), ("mlp.gate_proj.weight", (I, H), False),
               ("mlp.up_proj.weight", (I, H), True)]
        if self.mlp_bias:
            out += [("mlp.gate_proj.bias", (I,), False), ("mlp.up_proj.bias", (I,), True)]
        out.append(("mlp.down_proj.weight", (H, I), False))
        if self.mlp_bias:
            out.append(("mlp.down_proj.bias", (H,), False))
        if self.sandwich_norms:
            out.append(("post_feedforward_layernorm.weight", (H,), False))
        return out

    def routed_experts(self):
        # a MoE layer's routed experts (not gpt-oss's fused ones) as two runs of (name, shape): each expert's gate then
        # its up, expert after expert (one [experts, 2 moe_intermediate, hidden]); each expert's down
        E, H, J, (block, gate, up, down) = (self.num_experts, self.hidden_size, self.moe_intermediate_size,
                                            self.expert_names)
        return ([(f"{block}.experts.{e}.{p}.weight", (J, H)) for e in range(E) for p in (gate, up)],
                [(f"{block}.experts.{e}.{down}.weight", (H, J)) for e in range(E)])

    @classmethod
    def from_dir(cls, model_dir):
        path = model_folder(model_dir) / "config.json"
        if not path.exists():
            raise UserError(f"{model_dir} has no config.json")
        return cls.from_json(parse_json(read_bytes(path), path), path)

    @classmethod
    def from_json(cls, raw, path="config.json"):
        """The config of config.json's contents (path names it in errors). Whatever transformers would compute
        otherwise than prefill implements is refused here with one line naming it, never ignored."""
        fields = ConfigFields(raw, path)
        fp8 = fp8_fields(raw.get("quantization_config"), path)
        prefixes = ()
        if raw.get("model_type") == "gemma3" and "text_config" in raw:
            tied = raw.get("tie_word_embeddings")
            prefixes, path = MULTIMODAL_PREFIXES, f"{path}: text_config"
            raw = dict(ConfigFields(raw["text_config"], path).source, model_type="gemma3_text")
            fields = ConfigFields(raw, path)
            if tied is not None and tied != fields.flag("tie_word_embeddings", True):
                raise UserError(f"{path}: tie_word_embeddings differs from the multimodal config's; not supported")
        model_type = raw.get("model_type")
        if model_type == "kimi_k2":
            raise UserError(f"{path}: model_type is 'kimi_k2', which transformers 5.24 maps to no model (Kimi-K2's "
                            "own config names remote code, never run); a copy whose config.json says deepseek_v3 "
                            "runs as DeepSeek-V3")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            moe = (", a mixture of experts (of those prefill runs "
                   f"{', '.join(name for name, f in FAMILIES.items() if f.experts)} only)") if set(MOE_KEYS) & set(raw) \
                else ""
            raise UserError(f"{path}: model_type is {shown(model_type)}{moe}; prefill runs "
                            f"{', '.join(FAMILIES)} (and gemma3 with a text_config) only")
        if raw.get("use_bidirectional_attention") not in (None, False):  # (True == 1 in Python: compared by type too)
            raise UserError(f"{path}: use_bidirectional_attention is {shown(raw['use_bidirectional_attention'])}; "
                            "prefill computes causal language-model losses")
        if family.defaults:  # what the family's config class takes where config.json is silent; a null is read as
            # each key's own null (a window's: none), but for a null RoPE, which GptOssConfig makes its default too
            raw = {**family.defaults, **raw}
            if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
                raw["rope_parameters"] = family.defaults["rope_parameters"]
            fields = ConfigFields(raw, path)

        hidden, heads, layers = fields.count("hidden_size"), fields.count("num_attention_heads"), \
            fields.count("num_hidden_layers")
        latent = latent_fields(fields, path, heads) if family.latent_attention else {}
        head_dim = latent.pop("head_dim", None) or fields.count("head_dim", family.head_dim or hidden // heads)
        activation = fields.get(family.activation_key, family.activation, lambda v: v in ACTIVATIONS,
                                f"one of {', '.join(ACTIVATIONS)}")
        if family.experts and ACTIVATIONS[activation] != "silu":
            raise UserError(f"{path}: {family.activation_key} is {shown(activation)}; prefill's experts are SwiGLU")
        # which layers slide: config.json's own layer_types where the family reads them (transformers does, first)
        types, window = family.layer_types(fields, layers)
        given = raw.get("layer_types")
        if given is not None and given != types and not family.reads_layer_types:
            raise UserError(f"{path}: layer_types in a {model_type} config, which transformers' {model_type} model "
                            f"ignores (it slides {types.count('sliding_attention')} of {layers} layers); not supported")
        if given is not None:
            types = given
        if not (isinstance(types, list) and len(types) == layers and all(t in LAYER_TYPES for t in types)):
            raise UserError(f"{path}: layer_types must name {' or '.join(LAYER_TYPES)} for each of the {layers} "
                            "layers")
        softcap = fields.off_or(fields.positive, "attn_logit_softcapping", family.softcaps[0]) if family.softcaps \
            else None
        ropes = read_ropes(raw, family, path)
        scale = 1.0 / math.sqrt(fields.positive(family.scale_key, 256) if family.scale_key else head_dim)
        if latent:  # DeepSeek's own, from the RoPE's raw parameters
            params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
            scale = latent_scale(head_dim, ropes[None], params, path)
        settings = {t: AttentionSettings(scale, window if t == "sliding_attention" else None, softcap, family.sinks)
                    for t in LAYER_TYPES}
        attention_bias = family.attention_bias and fields.flag("attention_bias")
        qkv_bias = family.qkv_bias or attention_bias or bool(family.qkv_bias_key and fields.flag(*family.qkv_bias_key))
        config = dict(
            model_type=model_type, hidden_size=hidden, intermediate_size=fields.count("intermediate_size"),
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=fields.count("num_key_value_heads", heads), head_dim=head_dim,
            vocab_size=fields.count("vocab_size"), rms_norm_eps=fields.positive("rms_norm_eps", family.rms_norm_eps),
            tie_word_embeddings=fields.flag("tie_word_embeddings", family.tied),
            ropes=tuple(ropes[t if family.two_ropes else None] for t in types),
            attention=tuple(settings[t] for t in types), activation=ACTIVATIONS[activation],
            qk_norm=family.qk_norm or bool(family.qk_norm_key and fields.flag(family.qk_norm_key)),
            norm_offset=family.norm_offset, norm_float32=family.norm_float32, sandwich_norms=family.sandwich_norms,
            qkv_bias=qkv_bias, o_bias=attention_bias,
            mlp_bias=family.mlp_bias and fields.flag("mlp_bias"), embed_scale=family.embed_scale,
            final_softcap=fields.off_or(fields.positive, "final_logit_softcapping", family.softcaps[1])
            if family.softcaps else None,
            tensor_prefixes=prefixes, **fp8, **latent,
            **(family.experts(fields, path, layers, dict(family.moe_defaults)) if family.experts else {}),
            max_position_embeddings=fields.get("max_position_embeddings", 0, lambda v: type(v) is int and v >= 0,
                                               "a non-negative integer"),
        )
        if fp8.get("mxfp4") and not config.get("fused_experts"):
            raise UserError(f"{path}: quant_method mxfp4 quantizes gpt_oss's experts (transformers' Mxfp4Config); "
                            f"not a {model_type}'s")
        if fp8.get("fp8_scales") and config.get("fused_experts"):
            raise UserError(f"{path}: a {model_type} in block-wise FP8 is not built (its releases are MXFP4)")
        if prefixes and config["final_softcap"] is not None:
            raise UserError(f"{path}: final_logit_softcapping in a multimodal Gemma 3, which transformers' "
                            "Gemma3ForConditionalGeneration does not apply; not supported")
        try:
            return cls(**config)
        except UserError as e:  # the checks across fields (head counts, head_dim) name the file too
            raise UserError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- checkpoint loading

# F8_E4M3: block-wise FP8 weights; U8 and F8_E8M0: their ue8m0 scales (powers of two), as bytes or as float8_e8m0fnu
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                      "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "F8_E8M0": torch.float8_e8m0fnu}
FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # what a bf16 tensor may be in the files (cast on reading)


SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too


def header_tensors(path, header, data_bytes):
    """name -> (dtype, shape, start, byte count) within the data section, from a safetensors header: every field is
    checked, since the file may be corrupt or not safetensors at all."""
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is {shown(header)}, not a JSON object")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {shown(name)}"
        if not isinstance(info, dict):
            raise UserError(f"{where} is described by {shown(info)}, not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"{where} has dtype {shown(dtype)}; expected {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise UserError(f"{where}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise UserError(f"{where}: data_offsets must be two integers, 0 <= begin <= end")
        start, end = offsets
        if end > data_bytes:
            raise UserError(f"{path} is truncated ({shown(name)} lies past its end)")
        nbytes = SAFETENSORS_DTYPES[dtype].itemsize
        for n in shape:  # capped: a shape of a million huge numbers must not become one giant product
            nbytes = min(nbytes * n, data_bytes + 1)
        if nbytes != end - start:
            raise UserError(f"{where}: its shape and dtype do not fill the {end - start} bytes its data_offsets span")
        tensors[name] = (SAFETENSORS_DTYPES[dtype], tuple(shape), start, nbytes)
    return tensors


class Workers:
    """n daemon threads running submitted calls in order, each call's outcome in a Future. Not ThreadPoolExecutor:
    the interpreter joins its threads at exit after they have run everything queued, and read-ahead queued for a
    next request would hold the exit up for seconds of storage reads. stop() cancels what is queued and waits for
    the calls under way (a piece's read, a copy's launch): no thread is inside CUDA when the process tears it down."""

    def __init__(self, n, name):
        self.queue, self.stopped, self.lock = queue.SimpleQueue(), threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=Workers._run, args=(self.queue, self.stopped), name=f"{name}-{i}",
                                         daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def submit(self, fn, *args):
        future = Future()
        with self.lock:  # nothing is queued behind the threads' end, where no thread would take it
            if self.stopped.is_set():
                future.cancel()
            else:
                self.queue.put((future, fn, args))
        return future

    def close(self):  # the threads end once they have run what is queued
        self.queue.put(None)

    def stop(self, timeout=10.0):
        with self.lock:
            self.stopped.set()
            self.close()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout)

    @staticmethod
    def _run(work, stopped):  # static, and each call dropped once run: a waiting thread keeps nothing alive
        while (item := work.get()) is not None:
            future, fn, args = item
            del item
            if stopped.is_set():
                future.cancel()  # whoever waits on it gets CancelledError, never a hang
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)
            del future, fn, args
        work.put(None)  # the next thread stops too


PREFETCH_PIECE = 16 * 2**20  # one read of Checkpoint.prefetch
PAGE = mmap.PAGESIZE
LOW_BIT = bytes(b & 1 for b in range(256))


def resident(addr, nbytes):
    # whether every page of [addr, addr + nbytes) (page-aligned) of a file mapping is in the page cache, by mincore(2);
    # False where it cannot tell. Since Linux 5.0 mincore reports the page cache only for files the caller owns or may
    # write (else only the pages mapped into this process): then this says False, and the caller reads pages that
    # were there already, which costs a memory copy, not a disk read.
    vec = (ctypes.c_ubyte * (-(-nbytes // PAGE)))()
    try:
        if ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec):
            return False
    except (AttributeError, OSError):
        return False
    return b"\0" not in bytes(vec).translate(LOW_BIT)


def host_empty(numel):
    # Anonymous memory advised onto transparent huge pages: filling fresh memory is bound by its first-touch page
    # faults, and 2 MiB pages made that 1.5x faster from 8 threads on the H200 machine (bench/primitives.py).
    buf = mmap.mmap(-1, numel * DTYPE.itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=DTYPE)  # the tensor keeps the mapping alive


# Every cudaHostRegister/Unregister runs on this one thread, which launches nothing: a refused call also leaves its
# error as the calling thread's CUDA "last error", and torch's next launch check on that thread raises it (seen on
# the H200: a refusal failed the next kernel, or the next copy, of the thread that asked).
REGISTRAR = ThreadPoolExecutor(1, thread_name_prefix="prefill-registrar")


def on_registrar(fn):
    if threading.current_thread().name.startswith("prefill-registrar"):
        return fn()
    return REGISTRAR.submit(fn).result()


def host_register(t, flags=0):
    # page-locks t's memory in place; False where the runtime refuses
    return on_registrar(lambda: int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, flags)) == 0)


def pin(t):
    """Page-locks t in place at its exact size. torch's pinned allocator would round 1 GB up to 2 GB (and 20 GB of
    layers to 32 GB); registering plain memory keeps host use exact, and costs ~0.04 s/GiB once the pages exist
    (0.4 s/GiB when registering has to fault them in). Falls back to a pinned copy if refused."""
    return t if host_register(t) else t.pin_memory()


# How host buffers are page-locked, chosen once per process (pin_method):
# "register": plain memory, filled, then registered in place at its exact size (CUDA; measured above).
# "alloc": torch's pinned allocator (hipHostMalloc on ROCm), then filled. On ROCm every hipHostRegister goes through
#   amdkfd's SVM path: AMD itself avoids multi-GB registrations for performance and kernel stability (ROCm/
#   rocm-systems PR #11670), ROCm issue #2433 reports slow SVM registration, and amdkfd may evict registered pages
#   and stop the process's queues while it re-maps them. hipHostMalloc is ROCm's ordinary pinned path. The
#   allocator rounds up to a power of two (a 0.98 GB layer takes 1 GiB), which pinned_bytes() counts.
PIN_METHODS = ("register", "alloc")


def pin_method(requested="auto"):
    if requested != "auto":
        return requested
    return "alloc" if torch.version.hip else "register"


def pinned_bytes(nbytes, method):
    # host memory that page-locking nbytes takes
    return nbytes if method == "register" else 1 << max(0, nbytes - 1).bit_length()


def pinned_empty(numel, method, fill):
    """A page-locked bf16 host buffer of numel elements, filled by fill(buffer); returns (buffer, registered): the
    caller unregisters registered buffers before it frees them."""
    if method == "alloc":
        buf = torch.empty(numel, dtype=DTYPE, pin_memory=True)
        fill(buf)
        return buf, False
    buf = host_empty(numel)
    fill(buf)
    pinned = pin(buf)
    return pinned, pinned is buf


def unpin(t):
    on_registrar(lambda: torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())))


def unpin_all(tensors):
    for t in tensors:
        unpin(t)


HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (hipHostRegisterReadOnly): the device only reads the pages


class Checkpoint:
    """A folder's safetensors tensors: zero-copy views through (copy-on-write) memory maps, positioned reads straight
    into a destination buffer, and each tensor's raw bytes in a shared read-only map of its file, which `lock()`
    page-locks in place so that the device copies straight out of the page cache. prefixes: (prefix in the files,
    prefix the tensor is known by) pairs, the config's tensor_prefixes (a multimodal Gemma 3's text model)."""

    def __init__(self, model_dir, prefixes=()):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = parse_json(read_bytes(index), index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            # plain file names only: an index must not send the loader outside the folder
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f == Path(f).name and f
                                                           for f in weight_map.values()):
                raise UserError(f"{index}: weight_map must map tensor names to file names in {model_dir}")
            files = sorted(set(weight_map.values()))
        elif (model_dir / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in model_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth")]
            if pickles:
                raise UserError(f"{model_dir} holds only pickle weights ({pickles[0]}); prefill loads safetensors only")
            raise UserError(f"{model_dir} holds no *.safetensors weights")
        self.files = []    # (fd, copy-on-write map) per file
        self.shared = {}   # file index -> uint8 tensor over a shared read-only map of the whole file
        self.locked = []   # views of the shared maps that are page-locked
        self.lock_seconds = 0.0  # spent page-locking
        self.read_ahead_bytes = 0  # read into the page cache by prefetch() before locking
        self.tensors = {}  # name -> (file index, dtype, shape, byte offset, byte count)
        self.prefixes = prefixes
        for name in files:
            self._open(model_dir / name)
        self.nbytes = sum(len(data) for _, data in self.files)
        self.model_dir = model_dir

    def _open(self, path):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header_len = int.from_bytes(f.read(8), "little")
                # bounded by the file before reading: a corrupt length field may ask for up to 2^64 bytes
                if size < 8 or 8 + header_len > size:
                    raise UserError(f"{path} is not a safetensors file: its header length {header_len} runs past "
                                    f"the end of the file ({size} bytes)")
                if header_len > SAFETENSORS_MAX_HEADER:
                    raise UserError(f"{path}: a {header_len}-byte header exceeds safetensors' 100 MB limit")
                tensors = header_tensors(path, parse_json(f.read(header_len), path), size - 8 - header_len)
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view, never written
            fd = os.open(path, os.O_RDONLY)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read safetensors file {path}: {e}") from None
        self.files.append((fd, data))
        for name, (dtype, shape, start, nbytes) in tensors.items():
            known = next((to + name[len(prefix):] for prefix, to in self.prefixes if name.startswith(prefix)), name)
            self.tensors[known] = (len(self.files) - 1, dtype, shape, 8 + header_len + start, nbytes)

    def get(self, name, shape):
        if name not in self.tensors:
            raise UserError(f"checkpoint lacks tensor {name}")
        file, dtype, actual, offset, nbytes = self.tensors[name]
        if actual != tuple(shape):
            raise UserError(f"checkpoint tensor {name} has shape {list(actual)}, config implies {list(shape)}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self.files[file][1], dtype=torch.uint8, count=nbytes, offset=offset)
        if offset % dtype.itemsize:  # a writer that did not align its header: one copy, then a typed view
            raw = raw.clone()
        return raw.view(dtype).view(shape)

    def read(self, name, dst, start=0):
        # dst: a contiguous host tensor <- elements [start, start + dst.numel()) of tensor `name`, flattened. The
        # file's dtype is read with pread (GIL released, no page faults on a mapping: 2-3x faster than copying out
        # of the map from 16 threads); other dtypes are cast from the map (ue8m0 scales as bytes: 2^(byte - 127), as
        # transformers' Fp8Dequantize computes them).
        file, dtype, shape, offset, _ = self.tensors[name]
        n = dst.numel()
        if dtype != dst.dtype:
            src = self.get(name, shape).view(-1)[start:start + n]
            dst.copy_((src.float() - 127.0).exp2() if dtype == torch.uint8 else src)
            return
        nbytes, offset = n * dtype.itemsize, offset + start * dtype.itemsize
        view = memoryview((ctypes.c_char * nbytes).from_address(dst.data_ptr())).cast("B")
        done = 0
        while done < nbytes:
            got = os.preadv(self.files[file][0], [view[done:]], offset + done)
            if got <= 0:
                raise UserError(f"checkpoint tensor {name}: unexpected end of file")
            done += got

    def file_of(self, name):
        return self.tensors[name][0]

    def as_held(self, tensors):
        # whether the files hold these (name, dtype) as the device does: their bytes can be copied as they are
        return all(self.tensors[name][1] == dtype for name, dtype in tensors)

    def _shared_map(self, file):
        if file not in self.shared:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
                self.shared[file] = torch.frombuffer(mmap.mmap(self.files[file][0], 0, access=mmap.ACCESS_READ),
                                                     dtype=torch.uint8)
        return self.shared[file]

    def raw(self, name):
        # [byte count] uint8: the tensor's bytes, read-only (the device copies from them; nothing writes them)
        file, _, _, offset, nbytes = self.tensors[name]
        return self._shared_map(file)[offset:offset + nbytes]

    def spans(self, names):
        """[(file, start, end)]: the page-aligned byte ranges of the files that hold the tensors `names`, overlapping
        ones merged (registrations may not overlap), so that each tensor lies inside one range: a layer whose tensors
        lie together in a file (as safetensors writers put them) is one range, a run of consecutive layers too."""
        ranges = sorted((file, offset // PAGE * PAGE, min(-(-(offset + nbytes) // PAGE) * PAGE, len(data)))
                        for file, _, _, offset, nbytes in map(self.tensors.get, names) if nbytes
                        for data in [self.files[file][1]])
        merged = []
        for file, start, end in ranges:
            if merged and merged[-1][0] == file and start < merged[-1][2]:
                merged[-1] = (file, merged[-1][1], max(end, merged[-1][2]))
            else:
                merged.append((file, start, end))
        return merged

    def prefetch(self, spans, workers):
        """Reads the pages of spans (from spans()) that are not in the page cache yet, from `workers` threads in order;
        returns per span the Futures of its reads (each gives the bytes it read). Page-locking faults missing pages
        in from one thread: 1.6 GB/s from the H200 machine's local disk (measured there, 2026-11-30), where a disk's bandwidth takes
        several reads in flight. Pages already cached (mincore) are not read again: a warm load costs no copy."""
        pool, local = Workers(workers, "prefill-prefetch"), threading.local()
        bases = [self._shared_map(file).data_ptr() for file in range(len(self.files))]  # maps made here, not racing

        def read(file, offset, n):
            if resident(bases[file] + offset, n):
                return 0
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(PREFETCH_PIECE))
            done = 0
            while done < n and (got := os.preadv(self.files[file][0], [local.buf[:n - done]], offset + done)) > 0:
                done += got
            return done

        reads = [[pool.submit(read, file, offset, min(PREFETCH_PIECE, end - offset))
                  for offset in range(start, end, PREFETCH_PIECE)] for file, start, end in spans]
        pool.close()
        return reads

    def lock(self, spans, workers=16):
        """Page-locks the spans' page cache in place, read-only (0.06 s/GiB on the H200 machine, and no host copy),
        one span after the other, each once prefetch() has read its pages in, from `workers` threads ahead of the
        registrations (registering from 8 threads was no faster: 0.51 vs 0.61 s for 8 GiB). Says whether every span
        could be locked (a refusal: no read-only registration on this platform, too little memory, pages another
        Runner holds locked). The pages stay locked until unlock(); the maps must outlive the registration."""
        reads = self.prefetch(spans, workers)
        for (file, start, end), span_reads in zip(spans, reads):
            self.read_ahead_bytes += sum(r.result() for r in span_reads)
            t, begin = self._shared_map(file)[start:end], time.perf_counter()
            ok = host_register(t, HOST_REGISTER_READ_ONLY)
            self.lock_seconds += time.perf_counter() - begin
            if not ok:
                return False
            self.locked.append(t)
        return True

    def unlock(self):
        unpin_all(self.locked)
        self.locked = []


def byte_range(flat, offset, nbytes):
    # bytes [offset, offset + nbytes) of a flat buffer
    return flat.view(torch.uint8)[offset:offset + nbytes]


def typed(flat, offset, count, dtype):
    # elements of dtype [0, count) from byte offset of a flat buffer
    return byte_range(flat, offset, count * dtype.itemsize).view(dtype)


def layer_tensors(cfg, layer):
    # (checkpoint name, byte offset, element count, dtype) of each tensor inside the layer's flat buffer as it is held
    # (cfg.held), in layout order
    return [(f"model.layers.{layer}.{name}", offset, math.prod(shape), dtype)
            for name, offset, shape, dtype in cfg.held[layer]]


def check_tensors(ckpt, cfg, fixed):
    """Every missing, misshapen or mistyped tensor, before heavy work: each layer's as cfg.held holds them (an FP8
    weight's scale grid included), and fixed, [(name, shape)]: the embedding, final norm and head."""
    fp8 = "block-wise FP8" if cfg.fp8_scales else "MXFP4" if cfg.mxfp4 else "unquantized (no quantization_config)"
    for layer, parts in enumerate(cfg.held):
        for name, _, shape, held in parts:
            kept = held == DTYPE and (cfg.fp8_scales and is_fp8_weight(name)  # by modules_to_not_convert
                                      or cfg.mxfp4 and name in MXFP4_WEIGHTS)
            name = f"model.layers.{layer}.{name}"
            ckpt.get(name, shape)
            dtype = ckpt.tensors[name][1]
            scales = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu) + (
                (torch.uint8,) if cfg.fp8_scales == "ue8m0" else ())
            wanted = (FP8,) if held == FP8 else scales if name.endswith("_scale_inv") else (
                (torch.uint8,) if held == torch.uint8 else FLOATS)  # uint8: MXFP4's blocks and scales
            if dtype not in wanted:
                raise UserError(f"checkpoint tensor {name} is {str(dtype)[6:]}; the model is {fp8}" + (
                    ", its modules_to_not_convert naming this one" if kept else "") + ", which makes it "
                    f"{' or '.join(str(d)[6:] for d in wanted)}" + (
                    " (or modules_to_not_convert would name it)" if held in (FP8, torch.uint8) else ""))
    for name, shape in fixed:
        ckpt.get(name, shape)
        if ckpt.tensors[name][1] not in FLOATS:
            raise UserError(f"checkpoint tensor {name} is {str(ckpt.tensors[name][1])[6:]}; prefill reads it in "
                            "BF16, F16 or F32")


@dataclass
class LayerWeights:  # None: the family has no such tensor
    input_norm: torch.Tensor = None  # [hidden]
    qkv: torch.Tensor = None         # [qkv_rows, hidden]: q, k, v; latent attention: q_a (or q), kv_a
    qkv_bias: object = None          # [qkv_rows]
    latent_bias: object = None       # [kv_lora_rank + rope_dim]: kv_a's, where q (no q LoRA) has none
    q_a_norm: object = None          # [q_lora_rank]: latent attention's (q_a_layernorm), before
    q_b: object = None               # [q_size, q_lora_rank]
    kv_a_norm: object = None         # [kv_lora_rank] (kv_a_layernorm), before
    kv_b: object = None              # [heads (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    q_norm: object = None            # [head_dim]
    k_norm: object = None            # [head_dim]
    o_proj: torch.Tensor = None      # [hidden, heads v_head_dim]
    o_bias: object = None            # [hidden]
    sinks: object = None             # [heads]: gpt-oss's attention sinks
    attn_out_norm: object = None     # [hidden]: Gemma's norm of the attention's output
    mlp_norm: torch.Tensor = None    # [hidden]: the norm before the MLP
    router: object = None            # [experts, hidden] (float32: Router.kind sigmoid), where gate_up and down are
    router_bias: object = None       # the experts'; [experts]: the sigmoid router's e_score_correction_bias (float32,
    #                                  the choice's), gpt-oss's router's bias (bf16, its logits')
    gate_up: torch.Tensor = None     # [2 intermediate, hidden]; MoE: [experts, 2 moe_intermediate, hidden] (gpt-oss: a
    #                                  view of [experts, hidden, 2 moe_intermediate], gate and up interleaved)
    gate_up_bias: object = None      # [2 intermediate]; gpt-oss: [experts, 2 moe_intermediate]
    down: torch.Tensor = None        # [hidden, intermediate]; MoE: [experts, hidden, moe_intermediate] (gpt-oss: a
    #                                  view)
    down_bias: object = None         # [hidden]; gpt-oss: [experts, hidden]
    mlp_out_norm: object = None      # [hidden]: Gemma's norm of the MLP's output
    shared_gate_up: object = None    # [2 shared_intermediate, hidden]: the shared experts' (V3, GLM, Qwen2-MoE)
    shared_down: object = None       # [hidden, shared_intermediate]
    shared_gate: object = None       # [1, hidden]: Qwen2-MoE's shared_expert_gate
    gate_up_scales: object = None    # float32 block scales where gate_up and down are float8_e4m3fn (fused_experts'
    down_scales: object = None       # FP8 variant, moe_gate_up's and moe_down's scales: cfg.fp8_experts' views)


def held_expert_views(held, cfg):
    # fp8_experts: the LayerWeights fields of a MoE layer's FP8 experts and their scales, viewed in its held buffer
    return {field: typed(held, offset, math.prod(shape), dtype).view(shape)
            for field, (offset, shape, dtype) in cfg.expert_runs.items()}


def layer_views(flat, cfg, kind=None, held=None):
    # flat: a layer's buffer (a slot's may be longer), viewed as a layer of kind (None: the largest kind); held: an
    # fp8_experts MoE layer's held buffer, whose experts are viewed there (flat: its bf16 scratch)
    layout = cfg.layouts[kind or cfg.largest_kind]

    def view(name, rows=None, shape=None):  # rows (or the whole shape): the fused view's, which starts here
        if name not in layout:
            return None
        offset, own = layout[name]
        shape = shape or ((rows, *own[1:]) if rows else own)
        return typed(flat, offset * DTYPE.itemsize, math.prod(shape), cfg.tensor_dtypes.get(name, DTYPE)).view(shape)
    qkv, gate_up = cfg.qkv_rows, 2 * cfg.intermediate_size
    first = "self_attn.q_a_proj" if "self_attn.q_a_proj.weight" in layout else "self_attn.q_proj"
    mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    block, gate, _, down = cfg.expert_names
    if f"{block}.gate.weight" in layout:
        E, H, J = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        experts = dict(router=view(f"{block}.gate.weight"), router_bias=view(f"{block}.gate.e_score_correction_bias"),
                       gate_up=view(f"{block}.experts.0.{gate}.weight", shape=(E, 2 * J, H)),
                       down=view(f"{block}.experts.0.{down}.weight", shape=(E, H, J)),
                       shared_gate_up=view(f"{cfg.shared_expert}.gate_proj.weight", 2 * cfg.shared_intermediate_size),
                       shared_down=view(f"{cfg.shared_expert}.down_proj.weight"),
                       shared_gate=view("mlp.shared_expert_gate.weight"))
        if held is not None:
            experts |= held_expert_views(held, cfg)
    elif "mlp.router.weight" in layout:  # gpt-oss: its experts' [experts, out, in], out-contiguous (read by strides)
        experts = dict(router=view("mlp.router.weight"), router_bias=view("mlp.router.bias"),
                       gate_up=view("mlp.experts.gate_up_proj").transpose(1, 2),
                       gate_up_bias=view("mlp.experts.gate_up_proj_bias"),
                       down=view("mlp.experts.down_proj").transpose(1, 2), down_bias=view("mlp.experts.down_proj_bias"))
    else:
        experts = dict(gate_up=view("mlp.gate_proj.weight", gate_up), down=view("mlp.down_proj.weight"),
                       gate_up_bias=view("mlp.gate_proj.bias", gate_up), down_bias=view("mlp.down_proj.bias"))
    return LayerWeights(
        input_norm=view("input_layernorm.weight"), qkv=view(f"{first}.weight", qkv),
        qkv_bias=view(f"{first}.bias", qkv), q_norm=view("self_attn.q_norm.weight"),
        latent_bias=view("self_attn.kv_a_proj_with_mqa.bias") if first == "self_attn.q_proj" else None,
        q_a_norm=view("self_attn.q_a_layernorm.weight"), q_b=view("self_attn.q_b_proj.weight"),
        kv_a_norm=view("self_attn.kv_a_layernorm.weight"), kv_b=view("self_attn.kv_b_proj.weight"),
        k_norm=view("self_attn.k_norm.weight"), o_proj=view("self_attn.o_proj.weight"),
        o_bias=view("self_attn.o_proj.bias"), sinks=view("self_attn.sinks"),
        attn_out_norm=view("post_attention_layernorm.weight") if cfg.sandwich_norms else None,
        mlp_norm=view(f"{mlp_norm}.weight"), mlp_out_norm=view("post_feedforward_layernorm.weight"), **experts,
    )


STAGING_BYTES = 32 * 2**20  # each of a loading thread's two staging buffers


class Stager:
    """Copies checkpoint tensors into device memory through two small pinned buffers of its own, so that resident
    weights need no page-locked host copy: reading a piece into one buffer overlaps the copy out of the other.
    One per loading thread; on the CPU the same code does plain copies."""

    def __init__(self, device, method):
        self.cuda = device.type == "cuda"
        numel = STAGING_BYTES // DTYPE.itemsize
        if self.cuda:
            # the pages touched here, by the loading thread: registering fresh memory would fault them in on the one
            # registrar thread (0.44 s/GiB against 0.04 once they exist, bench/results/primitives/…-load-compute.json)
            pinned = [pinned_empty(numel, method, lambda buf: buf.zero_()) for _ in range(2)]
            self.buffers, self.registered = [b for b, _ in pinned], [b for b, registered in pinned if registered]
            self.stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        else:
            self.buffers, self.registered = [host_empty(numel) for _ in range(2)], []
        self.turn = 0

    def put(self, ckpt, name, dst):
        # dst: a contiguous device tensor <- the whole checkpoint tensor `name`, in dst's dtype
        dst = dst.view(-1)
        step = STAGING_BYTES // dst.element_size()
        for start in range(0, dst.numel(), step):
            n = min(step, dst.numel() - start)
            staging = typed(self.buffers[self.turn], 0, n, dst.dtype)
            if self.cuda:
                self.copied[self.turn].synchronize()  # the copy out of this buffer, two pieces ago, is done
            ckpt.read(name, staging, start)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dst[start:start + n].copy_(staging, non_blocking=True)
                    self.copied[self.turn].record(self.stream)
            else:
                dst[start:start + n].copy_(staging)
            self.turn ^= 1

    def close(self):
        if self.cuda:
            self.stream.synchronize()
        for b in self.registered:
            unpin(b)


# ----------------------------------------------------------------------------- memory plan

LOGITS_CHUNK_BYTES = 512 * 2**20  # float32 logits of one loss chunk
ALLOCATOR_SLACK = 512 * 2**20     # BLAS workspaces, allocator rounding, attention scratch
DEQUANTIZE_ELEMENTS = 1 << 24     # dequantize_fp8's float32 temporaries: up to this many elements at a time


@dataclass
class MemoryPlan:
    budget_bytes: int
    resident_layers: tuple   # layer indices kept on the device
    streamed_layers: tuple   # layer indices streamed through the slots, spread evenly among the resident ones
    chunk_tokens: int        # attention: chunks of whole texts up to this; MLP: slices of this (a mixture of
    #                          experts: its expert slices', where they fit in the slices' scratch)
    moe_chunk_tokens: int    # a MoE layer's expert slices (MOE_CHUNK_FACTOR times the setting); 0: a dense model
    wave_tokens: int         # tokens whose hidden states stay on the device across all layers
    batch_tokens: int        # texts are cut into batches of up to this, the numbers' unit: a wave is one batch, or
    #                          where the wave is planned (plan_wave) several consecutive ones
    loss_chunk_tokens: int
    tree_wave_tokens: int    # a prefix tree's unique tokens in the same room (their keys and values stay too)
    fixed_bytes: int         # embedding, lm_head (one matrix when tied), final norm
    working_bytes: int       # wave hidden states + the larger of layer and loss scratch
    slot_bytes: int
    layer_bytes: int         # what a slot holds: the largest layer
    resident_bytes: int      # the resident layers', each its own size

    @property
    def total_bytes(self):
        return self.fixed_bytes + self.working_bytes + self.slot_bytes + self.resident_bytes

    def describe(self):
        fits = "" if self.total_bytes <= self.budget_bytes else " (over budget: the smallest plan that runs)"
        budget = f"{self.budget_bytes / GiB:.1f} GiB" if self.budget_bytes < 1 << 50 else "no memory limit"
        moe = f" (experts: {self.moe_chunk_tokens})" if self.moe_chunk_tokens else ""
        batches = f" (batches of {self.batch_tokens})" if self.batch_tokens != self.wave_tokens else ""
        return (f"plan for {budget}: {len(self.resident_layers)} layers resident, "
                f"{len(self.streamed_layers)} streamed through {self.slot_bytes // max(1, self.layer_bytes)} slots; "
                f"{self.total_bytes / GiB:.2f} GiB planned{fits}; "
                f"chunks of {self.chunk_tokens} tokens{moe}, waves of {self.wave_tokens}{batches}")


# A mixture of experts runs its experts in slices of MOE_CHUNK_FACTOR times the chunk setting (16,384 tokens by
# default), and its attention in chunks as large where their scratch fits in the slices' (plan_memory; not DeepSeek-
# V3's latent attention). The experts: their routing costs about the same a slice whatever the slice's size
# (~0.6 ms on the H200), and torch's grouped GEMM reaches 445 TFLOP/s on a 4,096-token slice's rows, 632 on a
# 16,384-token one's (bench/results/…-moe-experts.json). The attention: a MoE layer computes little a token (Qwen3-
# 30B-A3B's ~0.3 ms of GPU time a 4,096-token chunk), about what Python takes to launch a chunk's kernels, so that
# 4,096-token chunks left the GPU waiting on the host; on the H200 the contest took 0.644 s in 4,096-token chunks and
# 0.628 s in 16,384-token ones at 48 GiB, 0.899 and 0.858 s at 24 GiB, with as many layers resident (the expert
# slice's scratch is the larger either way; bench/results/2026-12-03-h200-qwen3-30b-a3b-chunks@1b8fab5.json).
# A multiple of the chunk setting, never of the free memory: the chunks decide the GEMMs' shapes.
MOE_CHUNK_FACTOR = 4


def held_first(sizes, room):
    """The layers of sizes ({layer: bytes}) that room bytes do not hold, in order: as many as fit are held, the largest
    first (fewer bytes left to copy every wave); those left of each size are spread evenly among that size's layers,
    each preceded by its share of held ones (whose compute hides its copy). Consecutive ones of a size are >=
    floor(layers of the size / those left) >= 1 apart, so distinct. A model of one layer size: n layers held, the
    others (j + 1) * L // (L - n) - 1 for j < L - n."""
    left = []
    for size in sorted(set(sizes.values()), reverse=True):
        same = [i for i in sizes if sizes[i] == size]
        held = min(len(same), max(0, int(room // size)))
        room -= held * size
        left += [same[(j + 1) * len(same) // (len(same) - held) - 1] for j in range(len(same) - held)]
    return tuple(sorted(left))


def moe_scratch_per_token(cfg):
    # device bytes moe_block holds at most per token of a chunk besides the wave's hidden states (an upper bound: all
    # of it alive at once): the norm's output and its float32 temporaries; the router's: softmax's bf16 logits and
    # float32 probabilities, or the sigmoid one's float32 input, scores, biased and masked scores and group mask; the
    # int64 routing indices, k rows of input, gate_up, activation and output (bf16), the output rows gathered per
    # token (bf16) and their weighted sum; with shared experts the routed sum's own buffer and their gate_up,
    # activation and output (bf16); gpt-oss's biases gathered by row (bf16). The fused experts hold less: k rows of
    # activation and of output, and up to experts x BLOCK_M rows of padded activation (DeepSeek-V3's 256 experts in
    # 128-row blocks: 134 MB), which the gate_up and gathered rows they do without cover from ~460 tokens a slice
    # (16,384 by default).
    H, J, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    S = cfg.shared_intermediate_size
    router = 4 * H + 17 * E if cfg.router_kind == "sigmoid" else 6 * E
    shared = 2 * H + 2 * (3 * S + H) + 2 if S else 0
    biases = 2 * k * (2 * J + H) if cfg.fused_experts else 0
    return 2 * H + 12 * H + router + 8 * 8 * k + 2 * k * (2 * H + 3 * J) + 2 * k * H + 2 * H + shared + biases


def attention_scratch_per_token(cfg):
    # bf16 elements of one token's attention activations (an upper bound: all of them alive at once): GQA's norm out,
    # qkv, rotated q/k, attention out, o_proj out (Gemma: its normed attention output too); latent attention's norm
    # out, first projection, normed latents, q, kv, q's and the shared key's RoPE, the q, k and v attention reads, v
    # zero-padded to q's head dim and its output (v_padded's kinds), attention out, o_proj out
    H, Q, heads = cfg.hidden_size, cfg.q_size, cfg.num_attention_heads
    if not cfg.kv_lora_rank:
        return (5 if cfg.sandwich_norms else 3) * H + 2 * (Q + cfg.kv_size) + Q
    latent, kv = cfg.kv_lora_rank + cfg.q_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    q_k_v, padded = 2 * Q + cfg.v_size, 2 * Q
    return 2 * H + cfg.qkv_rows + latent + Q + kv + (heads + 1) * cfg.rope_dim + q_k_v + padded + cfg.v_size


def plan_memory(cfg, budget_bytes, chunk_tokens=4096, wave_tokens=65536, batch_tokens=None):
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    loss_chunk_tokens = max(16, min(chunk_tokens, LOGITS_CHUNK_BYTES // (4 * V)))
    moe_chunk_tokens = MOE_CHUNK_FACTOR * chunk_tokens if cfg.num_experts else 0
    # bf16 activations of one chunk (attention's, then the MLP's gate_up, act, down out, Gemma's normed MLP output)
    # plus the float32 temporaries of an RMSNorm over the widest row; a MoE model's attention chunk (with a dense
    # layer's MLP, where it has one), or its expert slice, whichever holds more
    attention = 2 * attention_scratch_per_token(cfg)
    mlp = 2 * 3 * cfg.intermediate_size if "mlp" in cfg.layouts else 0
    chunk_scratch = attention + mlp + 12 * max(H, cfg.q_size)
    experts_scratch = moe_chunk_tokens * moe_scratch_per_token(cfg) if "moe" in cfg.layouts else 0
    if moe_chunk_tokens and moe_chunk_tokens * chunk_scratch <= experts_scratch:  # attention in the slices' room
        chunk_tokens = moe_chunk_tokens  # (DeepSeek-V3's 128 latent heads: not, its 4,096-token chunk is 1.8 GB)
    layer_scratch = max(chunk_tokens * chunk_scratch, experts_scratch)
    loss_scratch = loss_chunk_tokens * V * (2 + 4 + 4)  # bf16 logits, float32 copy, float32 log-softmax
    state = 2 * H + 4 * cfg.rope_dim * len(set(cfg.ropes)) + 32  # per token: hidden states, each RoPE's cos/sin
    #                                                             (Gemma 3 has two), ids/targets/positions
    wave_state = wave_tokens * state
    # a prefix tree's wave keeps every token's keys and values across the layer's chunks: fewer tokens, same bytes (a
    # tree is one batch: its wave never holds another). DeepSeek-V3's are 80 KB a token (128 heads of 192 + 128)
    batch_tokens = batch_tokens or wave_tokens
    tree_wave_tokens = max(1, batch_tokens * state // (state + 2 * (cfg.kv_size + cfg.v_size)))
    # FP8 layers: the bf16 scratch each is dequantized into before it runs; FP8 experts held apart: where their loop
    # runs (FP8Experts), one expert's bf16 gate and up beside the expert slice, and dequantize_fp8's float32 temporaries
    # (q, its scales and their product) of a projection's block rows at a time
    J = cfg.moe_intermediate_size
    expert_copy = 2 * J * H * DTYPE.itemsize + 12 * min(J * H, max(DEQUANTIZE_ELEMENTS, min(J, FP8_BLOCK) * H)) \
        if cfg.fp8_experts else 0
    working = (wave_state + max(layer_scratch + expert_copy, loss_scratch) + ALLOCATOR_SLACK
               + cfg.dequantized_bytes)
    fixed = ((1 if cfg.tie_word_embeddings else 2) * V * H + H) * DTYPE.itemsize
    free = budget_bytes - fixed - working
    # every layer resident, or two slots (of the largest layer) and as many resident layers as fit beside them
    sizes = dict(enumerate(cfg.layer_nbytes))
    slots = 0 if sum(cfg.layer_nbytes) <= free else min(2, L) * cfg.layer_bytes
    streamed = held_first(sizes, free - slots)
    resident = tuple(i for i in range(L) if i not in streamed)
    return MemoryPlan(
        budget_bytes=budget_bytes, resident_layers=resident,
        streamed_layers=streamed, chunk_tokens=chunk_tokens, moe_chunk_tokens=moe_chunk_tokens,
        wave_tokens=wave_tokens, batch_tokens=batch_tokens,
        loss_chunk_tokens=loss_chunk_tokens, tree_wave_tokens=tree_wave_tokens,
        fixed_bytes=fixed, working_bytes=working, slot_bytes=slots,
        layer_bytes=cfg.layer_bytes, resident_bytes=sum(sizes[i] for i in resident),
    )


def held_experts_config(cfg, plan):
    """The config a run holds the model by: cfg, or where its plan (each FP8 layer dequantized whole into a bf16
    scratch, cfg.dequantized_bytes) is over its budget and every MoE layer's routed experts are block-wise FP8, cfg with
    them held FP8 (fp8_experts): run by the fused experts' FP8 variant, dequantized tile by tile in the GEMMs (where its
    start-up check passes; else an expert at a time, FP8Experts), the scratch the layer's other tensors' alone
    (DeepSeek-V3: 0.5 GB of a MoE layer, not 23, or a dense layer's 1.2). Where the plan fits, nothing changes: the FP8
    variant is slower on small experts (Qwen3-30B-A3B's 1.29x on the H200, bench/fp8_experts.py). The two ways pick
    their expert kernels apart, so their last bits may differ: plan is made at Runner._held_budget (a setting, or the
    GPU's total memory less HELD_RESERVE), which neither the free memory nor a timing moves."""
    if plan.total_bytes > plan.budget_bytes and cfg.can_hold_fp8_experts and not cfg.fp8_experts:
        return dataclasses.replace(cfg, fp8_experts=True)
    return cfg


# Without --gpu-memory an FP8 MoE's experts are held FP8 or not as its plan fits the GPU's total memory less this: the
# default budget's 1.5 GiB margin, a first run's timings' PICK_SCRATCH (1 GiB) and 1 GiB for the CUDA context and
# whatever else a GPU holds with nothing else running (under a 48 GiB cap the H200's runner saw 47.2 GiB free: 0.8
# GiB of context, bench/NOTES.md). Where the free memory then falls short of the plan the total allows, the run stops
# (held_experts_refusal) rather than take other bits.
HELD_RESERVE = int(3.5 * GiB)


def held_experts_refusal(plan, held_plan, budget_bytes, held_budget_bytes, free_bytes):
    # the one line of a run whose free memory falls short of the plan its GPU's total memory decides it by (plan, at
    # the run's budget); held_plan: the same with the experts held FP8
    return (f"this FP8 mixture of experts' plan (each layer dequantized whole) needs {plan.total_bytes / GiB:.1f} GiB, "
            f"which this GPU holds ({held_budget_bytes / GiB:.1f} GiB: its total memory less "
            f"{HELD_RESERVE / GiB:g}), but {budget_bytes / GiB:.1f} GiB of the {free_bytes / GiB:.1f} GiB free is "
            f"usable: other processes hold the rest. Free it, or set --gpu-memory from "
            f"{held_plan.total_bytes / GiB:.1f} to {free_bytes / GiB:.1f} to hold the routed experts FP8 instead, by "
            f"other expert kernels, so with other last bits (docs/models.md)")


# --- how large a wave hides the copies: a streamed layer's bytes cross PCIe once a wave, its FLOPs grow with the wave

def layer_flops(cfg, kind, tokens, attended=0):
    # matrix FLOPs of one layer of kind over `tokens` tokens: attention projections (2 a weight: every matrix of the
    # layout's attention half, MLA's latent ones too), the MLP (a MoE layer: router, the k active experts' SwiGLU, the
    # shared experts' and Qwen2-MoE's gate of them), and attention's scores and values for `attended` keys per query
    # on average
    H = cfg.hidden_size
    projections = sum(math.prod(shape) for name, (_, shape) in cfg.layouts[kind].items()
                      if name.startswith("self_attn.") and len(shape) == 2)
    mlp = (2 * cfg.num_experts * H + cfg.num_experts_per_tok * 6 * cfg.moe_intermediate_size * H
           + 6 * cfg.shared_intermediate_size * H + 2 * H * cfg.shared_expert_gate if kind == "moe"
           else 6 * cfg.intermediate_size * H)
    return tokens * (2 * projections + mlp + 2 * attended * cfg.num_attention_heads * (cfg.head_dim + cfg.v_head_dim))


def layer_balance(cfg, wave_tokens, h2d_gbps, tflops, attended=0):
    """(copy ms, compute ms) of one streamed layer (the largest kind) at a wave of wave_tokens: its bytes over the
    host->device rate against its FLOPs at the GEMM rate. Copy above compute means a wave of streamed layers alone is
    PCIe-bound."""
    return (cfg.layer_bytes / (h2d_gbps * 1e9) * 1e3,
            layer_flops(cfg, cfg.largest_kind, wave_tokens, attended) / (tflops * 1e12) * 1e3)


def hiding_tokens(cfg, h2d_gbps, tflops, attended=0):
    # the smallest wave at which a streamed layer's own compute hides its copy (compute is linear in the tokens)
    copy_ms, compute_ms = layer_balance(cfg, 1, h2d_gbps, tflops, attended)
    return math.ceil(copy_ms / compute_ms)


WAVE_STEP = 65536            # the default wave, and the step of the planned ones
MAX_PLANNED_WAVE = 16 * WAVE_STEP
# The nominal rates the wave is planned at (host->device GB/s, the GEMM TFLOP/s of a MoE layer's mix): fixed per GPU
# family and never measured at start-up, since the wave decides which texts share a wave and so the last bits of
# their numbers; a run's own rates would vary, and so may the expert kernel picked. NVIDIA: the H200's 55 GB/s and
# ~500 of its ~700 dense TFLOP/s for grouped GEMMs (to be replaced by bench/moe_run.py's measurement; a MoE layer's
# whole rate, routing included, per expert kernel: bench/moe_layer.py's layer TFLOP/s); RDNA3: the W7800's 26 GB/s
# and 60 TFLOP/s (PCIe 4.0 x16 as measured on that chip family; the GEMM rate estimated from a 7900 XTX's 88-99 with
# 96 CUs to the W7800's 70); the CPU: a memcpy against a few cores' bf16 GEMMs.
PLAN_RATES = {"nvidia": (55.0, 500.0), "rdna3": (26.0, 60.0), "amd": (55.0, 500.0), "cpu": (10.0, 0.5)}


def wave_seconds(cfg, plan, rates, attended=0):
    # (copy s, compute s) of one full wave under plan at the nominal rates: every streamed layer copied once
    h2d_gbps, tflops = rates
    return (sum(cfg.layer_nbytes[i] for i in plan.streamed_layers) / (h2d_gbps * 1e9),
            sum(layer_flops(cfg, kind, plan.wave_tokens, attended) for kind in cfg.layer_kinds) / (tflops * 1e12))


def plan_wave(cfg, budget_bytes, chunk_tokens, rates):
    """(plan, line): the corpus plan of a MoE model, whose streamed layers are PCIe-bound at the default wave (its
    FLOPs a byte are a dense model's / 8). Waves grow in steps of WAVE_STEP, each step's plan_memory taking the
    hidden states from the resident layers, until a wave's compute at the nominal rates hides its copies (compute-
    bound), or a larger wave would not fit (memory-bound), or MAX_PLANNED_WAVE (transfer-bound at the cap); of those
    the plan with the least time a token. line says which bound, for stderr. The rates are nominal and the budget a
    setting (--gpu-memory) or the free memory; only a memory bound depends on the latter, and that changes no number:
    texts are cut into batches of WAVE_STEP tokens whatever the wave, and a wave runs whole batches (score_wave)."""
    best, bound = None, f"transfer-bound at the {MAX_PLANNED_WAVE}-token cap"
    for wave in range(WAVE_STEP, MAX_PLANNED_WAVE + 1, WAVE_STEP):
        plan = plan_memory(cfg, budget_bytes, chunk_tokens, wave, WAVE_STEP)
        if best and plan.total_bytes > budget_bytes:
            bound = "memory-bound (a larger wave would not fit)"
            break
        copy_s, compute_s = wave_seconds(cfg, plan, rates)
        if best is None or max(copy_s, compute_s) / wave < best[0]:
            best = (max(copy_s, compute_s) / wave, plan, copy_s, compute_s)
        if compute_s >= copy_s:
            bound = "compute-bound (compute hides the copies)"
            break
    _, plan, copy_s, compute_s = best
    return plan, (f"waves of {plan.wave_tokens} tokens: {bound}; a wave's copies {copy_s:.2f} s, its compute "
                  f"{compute_s:.2f} s at the nominal {rates[0]:g} GB/s and {rates[1]:g} TFLOP/s")


def host_memory_spare(meminfo="/proc/meminfo", cgroup="/sys/fs/cgroup"):
    """Bytes of host memory that can still be page-locked without driving the machine into swap or the OOM killer:
    MemAvailable (free memory plus reclaimable page cache) less a margin of 5% of MemTotal (at least 2 GiB), and no
    more than the cgroup v2 limit leaves (containers: memory.max less memory.current, whose page cache counts as
    reclaimable). None where /proc/meminfo is missing (not Linux): then nothing is checked."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in Path(cgroup, "memory.stat").read_text().splitlines())
            used = int(Path(cgroup, "memory.current").read_text()) - int(stat.get("file", 0))
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available - max(2 * GiB, total // 20))


def filesystem_type(path, mounts="/proc/mounts"):
    # the type of the filesystem holding path ("ext4", "tmpfs", ...): the longest mount point above it; None if unknown
    path, best = str(Path(path).resolve()), (-1, None)
    try:
        for line in Path(mounts).read_text().splitlines():
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if len(fields) > 2 and (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > best[0]:
                best = (len(point), fields[2])
    except OSError:
        pass
    return best[1]


def map_lock_bytes(ckpt, spans):
    # host memory that page-locking the spans' pages in place takes from MemAvailable: none for files on tmpfs
    # (already unreclaimable, and left out of MemAvailable: seen on the H200 machine, where a checkpoint in /dev/shm
    # left 37 GB "available"), else their size (page cache counts as available until it is locked)
    return 0 if filesystem_type(ckpt.model_dir) in ("tmpfs", "ramfs") else sum(end - start for _, start, end in spans)


RING_SLOTS = 3  # storage ring: one layer being copied out, the next read, one more read ahead to absorb jitter


@dataclass
class HostPlan:
    """Where the streamed layers live on the host: their pages of the checkpoint's page cache locked in place (load
    "map"), pinned copies (load "copy"), or, for what the budget cannot hold, nowhere: read from storage every wave
    into a ring of pinned buffers. Prefill is layer-major, so storage is read once per wave, never once per text."""
    budget_bytes: object     # host memory the plan may lock; None: no limit (not known, or the CPU by default)
    load: str                # "map" or "copy"
    pinned_layers: tuple     # streamed layers held as pinned copies ("copy")
    storage_layers: tuple    # streamed layers read from storage every wave, spread evenly among the streamed ones
    ring_slots: int          # the storage ring's buffers, one layer each
    locked_bytes: int        # what locking the streamed layers' pages takes from the budget ("map"; 0 on tmpfs)
    pinned_bytes: int        # the loading threads' staging buffers, pinned copies, the ring
    storage_bytes: int       # the storage layers', read once a wave

    def describe(self):
        budget = "no limit" if self.budget_bytes is None else f"{self.budget_bytes / GiB:.1f} GiB"
        held = (f"the streamed layers' pages locked in place ({self.locked_bytes / GiB:.1f} GiB taken from the budget)"
                if self.load == "map" else
                f"{self.pinned_bytes / GiB:.1f} GiB pinned ({len(self.pinned_layers)} layers"
                + (f", a ring of {self.ring_slots}" if self.ring_slots else "") + ")")
        return (f"host {budget}: {held}; {self.storage_bytes / GiB:.1f} GiB read from "
                f"storage per wave ({len(self.storage_layers)} layers)")


def plan_host(cfg, streamed, budget, requested="auto", device=torch.device("cpu"), bf16_files=True, map_bytes=0,
              pin="register", staging_bytes=0):
    """The host side of the plan (see HostPlan) for the GPU plan's streamed layers within budget bytes (None: no
    limit). map_bytes: what locking the streamed layers' pages in place costs (map_lock_bytes); staging_bytes: the
    pinned buffers the loading threads use while copying resident weights. Map where asked for, or on "auto" where
    the files are bf16, the platform is not ROCm and it fits; else as many pinned copies as fit beside a ring, the
    rest from storage. ROCm never maps unless asked: HIP documents its read-only registration flag as ignored on AMD
    devices (hip_runtime_api.h), so a refusal never comes to trigger the fallback, and registering ~20 GB of page
    cache goes through amdkfd's SVM path (see pin_method) in calls of a layer or more."""
    # a pinned copy takes its layer's size, a ring buffer the largest layer's (any storage layer is read into it)
    n, layer = len(streamed), pinned_bytes(cfg.layer_bytes, pin)
    copy = {i: pinned_bytes(cfg.layer_nbytes[i], pin) for i in streamed}

    def fits(nbytes):
        return budget is None or nbytes <= budget

    def plan(load, pinned=(), storage=(), ring=0):
        return HostPlan(budget_bytes=budget, load=load, pinned_layers=tuple(pinned), storage_layers=tuple(storage),
                        ring_slots=ring, locked_bytes=map_bytes if load == "map" else 0,
                        pinned_bytes=staging_bytes + sum(copy[i] for i in pinned) + ring * layer,
                        storage_bytes=sum(cfg.layer_nbytes[i] for i in storage))

    hip = device.type == "cuda" and torch.version.hip is not None
    if requested == "map" or (requested == "auto" and bf16_files and not hip and fits(staging_bytes + map_bytes)):
        if not bf16_files:
            raise UserError("--load map: the checkpoint cannot be page-locked in place here (it needs files that "
                            "hold the layers as the device does, bf16 (a sigmoid router's tensors float32) or FP8 "
                            "with float32 scales, and read-only host-memory registration); --load copy works "
                            "everywhere")
        if not fits(staging_bytes + map_bytes):
            raise UserError(f"--load map would page-lock the streamed layers' pages and the loading buffers "
                            f"({(staging_bytes + map_bytes) / 1e9:.1f} GB) but the host memory budget is "
                            f"{budget / 1e9:.1f} GB; --load copy fits any budget it can")
        return plan("map")
    if fits(staging_bytes + sum(copy.values())):
        return plan("copy", streamed)
    room = int(max(0, budget - staging_bytes) // layer)  # largest layers' worth of pinned memory beside the staging
    if room < min(2, n):  # the smallest plan: a ring of two, one read while the other is copied out
        raise UserError(f"host memory: the smallest plan needs {(staging_bytes + min(2, n) * layer) / GiB:.2f} GiB "
                        f"page-locked (a ring of two layers and the loading buffers), the budget is "
                        f"{budget / GiB:.2f} GiB (--host-memory, default: available memory less a margin): free host "
                        "memory, or give more --gpu-memory so that fewer layers stream")
    ring = min(RING_SLOTS, room)
    pick = held_first(copy, budget - staging_bytes - ring * layer)  # as many pinned copies as fit beside the ring
    return plan("copy", [i for i in streamed if i not in pick], [i for i in streamed if i in pick], ring)


# ----------------------------------------------------------------------------- weight streaming

# The streamed layers' host side, one interface for WeightStreamer: fetch(layer) -> [(page-locked host bytes, byte
# offset inside the layer's buffer)], called in the streamer's cyclic order; done(layer, stream): the copies out of
# those bytes are queued on stream (None: already done, on the CPU); storage_layers: those read from storage.

class HeldLayers:
    """Streamed layers held in host memory for the whole run: the checkpoint's page cache locked in place, or
    pinned copies."""
    storage_layers = frozenset()

    def __init__(self, pieces):
        self.pieces = pieces  # layer -> [(host bytes, offset)]

    def fetch(self, layer):
        return self.pieces[layer]

    def done(self, layer, stream):
        pass

    def stop(self):
        pass


READ_PIECE_BYTES = 16 * 2**20  # one read task of the storage ring: a layer is read by several threads at once


class StorageRing:
    """Streamed layers the host plan cannot hold, read from storage every wave into a ring of page-locked buffers
    (each laid out as a layer's device buffer), the others from `held`. Reader threads pread ahead of use in the
    streamer's cyclic order; a buffer is read into again only once the copy out of it has completed (an event on the
    copy stream). fetch() waits for its layer's reads: where storage is slower than compute, the run is
    storage-bound, as it must be; elsewhere the read-ahead hides the reads."""

    def __init__(self, ckpt, cfg, order, storage, held, slots, device, method, workers):
        self.ckpt, self.cfg, self.held = ckpt, cfg, held
        self.storage_layers = frozenset(storage)
        self.order = [layer for layer in order if layer in self.storage_layers]
        cuda = device.type == "cuda"
        self.buffers, self.registered = [], []  # registered: the caller unregisters them once the ring is stopped
        for _ in range(slots):
            if cuda:
                buf, registered = pinned_empty(cfg.layer_numel, method, lambda b: None)
                self.registered += [buf] if registered else []
            else:
                buf = host_empty(cfg.layer_numel)
            self.buffers.append(buf)
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(slots)]
        self.readers = Workers(workers, "prefill-reader")
        self.reads = {}  # position in the endless cycle of storage layers -> its read tasks
        self.next = 0    # position of the next fetch
        for position in range(slots):
            self._read(position)

    def _read(self, position):
        slot, layer = position % len(self.buffers), self.order[position % len(self.order)]
        buf, copied, ckpt = self.buffers[slot], self.copied[slot], self.ckpt

        def read(name, dst, start):
            if copied is not None:
                copied.synchronize()  # the copy out of this buffer's previous layer (never recorded: no wait)
            ckpt.read(name, dst, start)

        self.reads[position] = [self.readers.submit(read, name, typed(buf, offset, count, dtype)[start:start + step],
                                                    start)
                                for name, offset, count, dtype in layer_tensors(self.cfg, layer)
                                for step in [READ_PIECE_BYTES // dtype.itemsize]
                                for start in range(0, count, step)]

    def fetch(self, layer):
        if layer not in self.storage_layers:
            return self.held.fetch(layer)
        assert self.order[self.next % len(self.order)] == layer, "storage layers must be fetched in cyclic order"
        for read in self.reads.pop(self.next):
            read.result()
        buf = self.buffers[self.next % len(self.buffers)]
        return [(byte_range(buf, offset, count * dtype.itemsize), offset)
                for _, offset, count, dtype in layer_tensors(self.cfg, layer)]

    def done(self, layer, stream):
        if layer not in self.storage_layers:
            return self.held.done(layer, stream)
        if stream is not None:
            self.copied[self.next % len(self.buffers)].record(stream)
        self._read(self.next + len(self.buffers))
        self.next += 1

    def stop(self):
        self.readers.stop()


def dequantize_fp8(q, scales, out):
    """out [rows, cols] bf16 <- q [rows, cols] float8_e4m3fn times scales [grid rows, grid cols] float32, as
    transformers computes it: q in float32 times its block's scale in float32, rounded to bf16, the blocks
    FP8_BLOCK x FP8_BLOCK (min(side, FP8_BLOCK)), the last row and column of them partial where a side is not a
    multiple (misread_side); a few block rows at a time."""
    (R, C), gr = q.shape, scales.shape[0]
    bm, bn = min(R, FP8_BLOCK), min(C, FP8_BLOCK)
    step = max(1, DEQUANTIZE_ELEMENTS // (bm * C))
    for g in range(0, gr, step):
        rows = slice(g * bm, min((g + step) * bm, R))
        s = scales[g:g + step].repeat_interleave(bm, 0)[:rows.stop - rows.start].repeat_interleave(bn, 1)[:, :C]
        out[rows].copy_(q[rows].float() * s)


def dequantize_mxfp4(blocks, scales, out):
    """out [experts, in, out] bf16 <- blocks uint8 [experts, out, in / 32, 16] and scales uint8 [experts, out, in / 32],
    as transformers' convert_moe_packed_tensors computes them: each byte's low nibble (the even element) and high
    nibble through FP4_VALUES, ldexp by the scale less 127, transposed to [experts, in, out]; an expert at a time. In
    float32 here, where transformers computes in the model's dtype: ldexp multiplies by 2^e in float32 either way, and
    every product is a bf16 value (at most two significant bits, exponents from -128 on), or inf or NaN where
    transformers' too overflows (2^128 at a scale byte of 255)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    E, N, G, B = blocks.shape
    for e in range(E):
        b = blocks[e].reshape(N * G, B)
        values = torch.empty(N * G, 2 * B, dtype=torch.float32, device=blocks.device)
        values[:, 0::2] = lut[(b & 0x0F).int()]
        values[:, 1::2] = lut[(b >> 4).int()]
        torch.ldexp(values, scales[e].reshape(N * G, 1).int() - 127, out=values)
        out[e].copy_(values.view(N, G * 2 * B).T)


@dataclass
class FP8Layer:
    """One held layout of quantized layers (FP8, or MXFP4) as its dequantization reads it (fp8_layer builds it once,
    before `ready`): its tensors as held (parts: cfg.held[layer], shared by the layers held alike) and once
    dequantized (layout: its kind's cfg.layouts), and the same as two device tables for the one launch that
    dequantizes the whole layer (dequantize_layer_triton). Tensor by tensor, a Qwen3-30B-A3B layer took 393 launches
    (388 FP8 weights, 5 bf16 copies), 18.9k a wave, issued from Python: its FP8 run took T 1.23 s (a repeat 1.78 s)
    where bf16 took 0.91 s with twice the bytes to stream (H200, 22fbe37)."""
    parts: list       # (name, byte offset, shape, dtype) as held: each FP8 weight followed by its scales, each MXFP4
    #                   weight's blocks by theirs
    layout: dict      # name -> (offset, shape) in the bf16 layer
    tensors: object   # int64 [tensors, FP8_COLUMNS]: one row per tensor of the bf16 layer, quantized or copied
    programs: object  # int32 [programs]: each program's tensor, one program per FP8_BLOCK x FP8_BLOCK block (MXFP4:
    #                   per DEQUANTIZE_ROWS rows x MXFP4_STEPS * MXFP4_GROUPS * 32 columns)
    mxfp4: bool = False  # whether its quantized tensors are MXFP4 (the launch's variant), not FP8


# A row of FP8Layer.tensors: where the tensor starts in the held buffer (bytes for FP8 and MXFP4's blocks,
# bf16-sized elements for a tensor copied as it is, two of them a value of a float32 one, the V3 router's, whose
# columns count double), its scales (FP8: float32 elements, MXFP4: bytes; -1: a tensor copied), where it starts in
# the bf16 layer, its rows and columns (a vector: one row; more dimensions: all but the last as rows; MXFP4: its
# blocks' experts x out rows, in columns), its blocks per row of blocks, its first program, and the rows of one of its
# matrices (MXFP4: out, the transposed writes' stride). int64: a big MoE layer's held bytes pass 2^31
# (Qwen3-235B-A22B's: 2.5 GB in FP8).
FP8_COLUMNS = 8
DEQUANTIZE_ROWS = 32  # the dequantization's rows a step (FP8, copies), and an MXFP4 program's rows
# An MXFP4 step: its program's rows by MXFP4_GROUPS blocks of 32 columns; MXFP4_STEPS of them a program, one after the
# other, on MXFP4_WARPS warps (an MXFP4 model's launch alone; FP8's and plain copies' keep DEQUANTIZE_WARPS). Of the
# 12 shapes bench/fp8_dequantize.py timed on the H200, 4 warps, 4 blocks x 8 steps were fastest on both gpt-oss
# layers: 0.736 and 2.825 ms against 0.822 and 3.165 at 8 warps, 8 blocks x 4 (64 B a row a step then, not 128;
# primitives/2026-12-03-h200-mxfp4-dequantize@b22c0a4.json)
MXFP4_GROUPS = 4
MXFP4_STEPS = 8
MXFP4_WARPS = 4

def held_into(name, dtype):
    # the bf16 layout's name of a held tensor: itself, or an MXFP4 weight's for its blocks (scales: none of its own)
    return name[:-len("_blocks")] if dtype == torch.uint8 and name.endswith("_blocks") else name


def fp8_layer(parts, layout, device, mxfp4=False):
    """The FP8Layer of a held layout's tensors (parts) and its bf16 layout, its tables on device. One program per block:
    Qwen3-235B-A22B's layer has 152k, far below both CUDA's limit on grid axis 0 (2^31 - 1 programs) and HIP's
    (gridDim.x times blockDim.x below 2^32 threads, hipModuleLaunchKernel's documentation: 2^24 programs of 256);
    gpt-oss-120b's MXFP4 layer 106k (797k at a tile a program). mxfp4: an MXFP4 model's layer (launched as such even
    where modules_to_not_convert leaves it bf16: one kernel variant a model, the one its start-up check ran)."""
    rows, programs = [], []
    for i, (name, offset, shape, dtype) in enumerate(parts):
        into = held_into(name, dtype)
        if into not in layout:
            continue  # scales, read with their weight
        if into != name:  # MXFP4 blocks [experts, out, in / 32, 16]: programs of DEQUANTIZE_ROWS rows of one expert
            E, N, G, _ = shape
            assert N % DEQUANTIZE_ROWS == 0, "MXFP4 rows of another expert in a program"
            # what the kernel's roundings take as exact: blocks 16 B-aligned (held_layout aligns each part to 128 B),
            # the bf16 weight in whole 16 B (a group start of the layout: 128 B)
            assert offset % 16 == 0 and layout[into][0] % 8 == 0, "MXFP4 weight not 16 B-aligned"
            R, C = E * N, G * MXFP4_GROUP
            grid = (R // DEQUANTIZE_ROWS, -(-C // (MXFP4_GROUP * MXFP4_GROUPS * MXFP4_STEPS)))
            rows.append([offset, parts[i + 1][1], layout[into][0], R, C, grid[1], len(programs), N])
        else:
            R, C = (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (1, shape[0])
            unit = 1 if dtype == FP8 else DTYPE.itemsize
            C = C * dtype.itemsize // unit
            grid = scale_grid((R, C))
            scales = parts[i + 1][1] // 4 if dtype == FP8 else -1
            rows.append([offset // unit, scales, layout[into][0], R, C, grid[1], len(programs), R])
        programs += [len(rows) - 1] * math.prod(grid)
    assert len(programs) < 2**24, "more programs than HIP launches on one grid axis"
    return FP8Layer(parts, layout, torch.tensor(rows, dtype=torch.int64).to(device),
                    torch.tensor(programs, dtype=torch.int32).to(device), mxfp4)


def dequantize_layer(held, out, layer):
    # a layer held with FP8 or MXFP4 weights (held: its flat buffer, as layer.parts places it) -> out: the bf16 layer,
    # as layer.layout places it (each quantized weight's scales follow it in layer.parts), tensor by tensor
    for i, (name, offset, shape, dtype) in enumerate(layer.parts):
        into = held_into(name, dtype)
        if into not in layer.layout:
            continue  # scales, read with their weight
        start, bf16_shape = layer.layout[into]
        src = typed(held, offset, math.prod(shape), dtype).view(shape)
        if dtype in (FP8, torch.uint8):
            _, scale_offset, grid, scale_dtype = layer.parts[i + 1]
            scales = typed(held, scale_offset, math.prod(grid), scale_dtype).view(grid)
            (dequantize_fp8 if dtype == FP8 else dequantize_mxfp4)(
                src, scales, out[start:start + math.prod(bf16_shape)].view(bf16_shape))
        else:  # copied as it is held: bf16, or a float32 router
            typed(out, start * DTYPE.itemsize, src.numel(), dtype).copy_(src.view(-1))


class WeightStreamer:
    """Hands out each layer's weights in layer order, wave after wave. Resident layers come from their own device
    buffers; streamed layers come through two device slots, refilled on a copy stream in the cyclic order of the
    streamed layers: as soon as compute has finished reading a slot, the copy of the layer after next starts into it.
    Both slots are filled at construction (before `ready`), and the cycle wraps, so after a request (or the warm-up)
    the slots already hold the first two streamed layers of the next one. The host side is `host` (HeldLayers or a
    StorageRing). Where it may have to wait for storage, the copies are issued from a thread of their own, so that
    only the compute that needs the layer waits, not the issuing of the layers before it. On the CPU the same code
    does plain copies. A slot holds the largest layer; a smaller one (a Qwen3-MoE's dense layer) fills its start,
    viewed by its own kind's layout. FP8 and MXFP4 layers (cfg.quantized), resident and streamed alike, stay so on the
    device and are dequantized (dequantize: Kernels.dequantize_layer, by each layer's FP8Layer) into one bf16 scratch
    when acquired: the layer before has run by then, in stream order, as it has read the scratch. With fp8_experts a
    MoE layer's routed experts are not: the experts run FP8, viewed where the layer is held (held_expert_views)."""

    def __init__(self, cfg, resident, host, order, device, dequantize=None, scratch=None):
        self.buffers = resident  # layer -> its flat device buffer
        self.cfg, self.dequantize = cfg, dequantize
        # the layers used as they are held: on the device, bf16
        self.resident = {} if cfg.quantized else {i: layer_views(buf, cfg, cfg.layer_kinds[i])
                                                   for i, buf in resident.items()}
        self.host, self.order, self.kinds = host, list(order), cfg.layer_kinds  # order: the streamed layers
        self.slots = [torch.empty(cfg.layer_numel, dtype=DTYPE, device=device) for _ in range(min(2, len(order)))]
        self.slot_views = [{kind: layer_views(s, cfg, kind) for kind in cfg.layouts} for s in self.slots] \
            if not cfg.quantized else None
        # the bf16 layer an FP8 layer is dequantized into (scratch: another streamer's, which the warm-up's shares)
        self.scratch = torch.empty(cfg.dequantized_bytes // DTYPE.itemsize, dtype=DTYPE, device=device) \
            if scratch is None else scratch
        self.scratch_views = {kind: layer_views(self.scratch, cfg, kind) for kind in cfg.layouts} \
            if cfg.quantized else None
        self.fp8_layers = None  # layer -> its FP8Layer, one per distinct held layout (cfg.held shares them)
        if cfg.quantized:
            tables = {}
            for parts, kind in zip(cfg.held, cfg.layer_kinds):
                if id(parts) not in tables:
                    tables[id(parts)] = fp8_layer(parts, cfg.layouts[kind], device, cfg.mxfp4)
            self.fp8_layers = [tables[id(parts)] for parts in cfg.held]
        self.slot_bytes = [s.view(torch.uint8) for s in self.slots]
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.slot_ready = [torch.cuda.Event() if self.cuda else None for _ in self.slots]
        self.slot_free = [torch.cuda.Event() if self.cuda else None for _ in self.slots]
        self.copier = Workers(1, "prefill-copier") if host.storage_layers else None
        self.copying = [None for _ in self.slots]  # the copier's Future for the slot's latest copy
        self.next_copy = 0  # position, in the endless cycle of streamed layers, of the next copy
        self.next_use = 0   # position of the next streamed layer compute will use
        self.weight_bytes = {i: sum(count * dtype.itemsize for _, _, count, dtype in layer_tensors(cfg, i))
                             for i in order}
        self.streamed_bytes = self.storage_bytes = 0
        for _ in self.slots:
            self._copy_next()

    def _copy_next(self):
        slot, layer = self.next_copy % len(self.slots), self.order[self.next_copy % len(self.order)]
        if self.copier:
            self.copying[slot] = self.copier.submit(self._copy, slot, layer)
        else:
            self._copy(slot, layer)
        self.streamed_bytes += self.weight_bytes[layer]
        self.storage_bytes += self.weight_bytes[layer] if layer in self.host.storage_layers else 0
        self.next_copy += 1

    def _copy(self, slot, layer):
        dst = self.slot_bytes[slot]
        pieces = self.host.fetch(layer)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.slot_free[slot])  # no-op until the slot's first use
                for src, offset in pieces:
                    dst[offset:offset + src.numel()].copy_(src, non_blocking=True)
                self.slot_ready[slot].record(self.copy_stream)
        else:
            for src, offset in pieces:
                dst[offset:offset + src.numel()].copy_(src)
        self.host.done(layer, self.copy_stream)

    def dequantized(self, held, layer):
        self.dequantize(held, self.scratch, self.fp8_layers[layer])
        if self.cfg.fp8_experts and self.kinds[layer] == "moe":  # its experts stay FP8, where they are held
            return dataclasses.replace(self.scratch_views["moe"], **held_expert_views(held, self.cfg))
        return self.scratch_views[self.kinds[layer]]

    def acquire(self, layer):
        if layer in self.resident:
            return self.resident[layer]
        if layer in self.buffers:
            return self.dequantized(self.buffers[layer], layer)
        slot = self.next_use % len(self.slots)
        assert self.order[self.next_use % len(self.order)] == layer, "streamed layers must be used in cyclic order"
        if self.copying[slot] is not None:
            self.copying[slot].result()  # issued (and, on the CPU, done); raises what the reads raised
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.slot_ready[slot])
        if self.cfg.quantized:
            return self.dequantized(self.slots[slot], layer)
        return self.slot_views[slot][self.kinds[layer]]

    def release(self, layer):
        if layer in self.buffers:
            return
        slot = self.next_use % len(self.slots)
        if self.cuda:
            self.slot_free[slot].record(torch.cuda.current_stream())  # before the copier can wait on it
        self.next_use += 1
        self._copy_next()

    def stop(self):  # the reads first: a copy waiting for one gets its cancellation and ends
        self.host.stop()
        if self.copier:
            self.copier.stop()


# ----------------------------------------------------------------------------- model math
# One decoder for every family: each difference from Qwen3 is a flag of the config or a tensor of the layer (None
# where the family has none), read once where it applies.

def rms_norm(x, weight, eps, style=NORM_CAST):
    # as transformers: normalize in float32; Llama and Qwen cast back, then scale in the model dtype; Gemma
    # (NORM_OFFSET) scales by 1 + w in float32 and casts last, gpt-oss (NORM_FLOAT32) by w. style: a bool is the
    # offset's (False: NORM_CAST, True: NORM_OFFSET)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if style == NORM_OFFSET:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    if style == NORM_FLOAT32:
        return (xf * weight.float()).to(x.dtype)
    return weight * xf.to(x.dtype)


def rope_tables(positions, rope, head_dim):
    # positions: [tokens] int64 -> cos, sin: [tokens, rotary_dim] (head_dim, or DeepSeek's rope_dim, but for partial
    # RoPE); angles in float32 as transformers, scaled by yarn's attention_factor there (1 elsewhere: the same bits),
    # then cast
    inv_freq = rope.inv_freq(head_dim)  # on the CPU, as transformers computes it
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [tokens, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_factor).to(DTYPE), (emb.sin() * rope.attention_factor).to(DTYPE)


def wave_rope_tables(positions, cfg):
    # {Rope: (cos, sin)} of each RoPE the model's layers use (Gemma 3: two), at positions [tokens] on the device
    return {rope: rope_tables(positions, rope, cfg.rope_dim) for rope in dict.fromkeys(cfg.ropes)}


def apply_rope(x, cos, sin):
    # x: [tokens, heads, head_dim]; half-split (rotate_half) convention over the first cos.shape[-1] channels: all of
    # them, or for partial RoPE (GLM-4.5) the first ones, the rest passed through, as transformers' apply_rotary_pos_emb.
    # gpt-oss writes it with half-width tables, x1·cos - x2·sin and x2·cos + x1·sin (_apply_rotary_emb): the same
    # products and sums, so the same bf16 roundings
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def deinterleaved(x):
    # [..., D] -> its channels 0, 2, 4, ... then 1, 3, 5, ...: interleaved RoPE (DeepSeek's pairs (0, 1), (2, 3), ...)
    # is rotate_half's on these, bit for bit (transformers' apply_rotary_pos_emb_interleave says so, and returns them
    # in this order too: q and k alike, so the scores do not change)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def head_norm_rope(x, weight, cos, sin, eps, style, interleave=False):
    # x: [tokens, heads, head_dim] (a view into qkv); the per-head q/k RMSNorm (Qwen3, Gemma 3), then RoPE; weight
    # None (no q/k norm): RoPE alone; interleave: on the head's channels deinterleaved
    x = x if weight is None else rms_norm(x, weight, eps, style)
    return apply_rope(deinterleaved(x) if interleave else x, cos, sin)


def gated_act(gate_up, activation):
    # gate_up: [tokens, 2 intermediate] -> act(gate) * up: [tokens, intermediate]; SiLU, or Gemma's tanh GELU; or
    # gpt-oss's ClampedSwiGLU over gate and up interleaved, in transformers' own bf16 steps (GptOssExperts._apply_gate)
    if isinstance(activation, ClampedSwiGLU):
        gate, up = gate_up[:, ::2].clamp(max=activation.limit), gate_up[:, 1::2].clamp(-activation.limit,
                                                                                        activation.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


CPU_LOSS_BYTES = 8 * 2**20  # logits a CPU's log-softmax takes at a time: its output stays in cache (32 MiB of L3 here)


def token_nll(logits, targets):
    # logits: [tokens, vocab] float32 (bf16 where LOGITS says so, upcast as transformers upcasts its bf16 logits)
    # -> [tokens] float32; 0 at -100. On the CPU in blocks of rows, the same bits (each row's log-softmax is its own):
    # cross_entropy writes a whole chunk's float32 log-softmax to memory and reads it back, and did so in 0.45 s of
    # the demo's 883-token loss chunk, against its head GEMM's 0.6 s, on two AVX2 cores (bench/NOTES.md, issue 38)
    if logits.device.type != "cpu":
        return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none")
    rows, nll = max(1, CPU_LOSS_BYTES // (4 * logits.shape[1])), torch.empty(logits.shape[0], dtype=torch.float32)
    for r in range(0, logits.shape[0], rows):
        nll[r:r + rows] = F.cross_entropy(logits[r:r + rows].float(), targets[r:r + rows], ignore_index=-100,
                                          reduction="none")
    return nll


def embed_tokens(embed, ids, cfg):
    # ids: [tokens] -> [tokens, hidden]; Gemma multiplies by √hidden rounded to bf16 (torch.tensor of the float, cast:
    # transformers' own rounding), in bf16
    x = embed.index_select(0, ids)
    if cfg.embed_scale:
        x *= torch.tensor(cfg.hidden_size ** 0.5).to(DTYPE).item()
    return x


# The logits are float32: lm_head's GEMM accumulates in float32 (as every bf16 GEMM does) and its output is kept, not
# rounded to bf16, before the float32 log-softmax; the network before it stays bf16. Rounded (transformers' bf16
# lm_head), logits of size 16-32 sit on a grid of 0.125, and a multiple-choice question's top two choices often tie
# bit for bit: lm-eval then takes the first one listed. "bf16" rounds them as transformers does.
LOGITS = {"texts": "float32", "continuations": "float32"}


def lm_logits(h, lm_head, final_norm, cfg, kernels, dtype="float32", out=None):
    # h: [tokens, hidden] -> [tokens, vocab] float32 (or bf16): the final norm (bf16), lm_head, and Gemma 2's final
    # softcap in the logits' dtype, in transformers' steps (divide, tanh, multiply), in place. out: float32 room for
    # at least h's rows of logits, reused from chunk to chunk (None: a new tensor)
    x = kernels.rms_norm(h, final_norm, cfg.rms_norm_eps, cfg.norm_style)
    logits = kernels.head(x, lm_head, None if out is None else out[:x.shape[0]]) if dtype == "float32" else \
        F.linear(x, lm_head)
    if cfg.final_softcap is not None:
        logits.div_(cfg.final_softcap).tanh_().mul_(cfg.final_softcap)
    return logits


def combine(x, out, row_of, weights):
    # x: [tokens, hidden] += out: [tokens * k, hidden], the experts' output rows by expert, weighted: weights [tokens,
    # k], token t's slot j at row row_of[t k + j]. Each token's sum is one batched GEMM ([1, k] @ [k, hidden] a token):
    # float32 products and sums of bf16, one rounding. A loop of k gathers and float32 adds took 0.74 ms a
    # 4096-token chunk on the H200, beside 0.70 ms for both grouped GEMMs (bench/results/…-h200-moe-experts.json)
    per_token = out[row_of].view(weights.shape[0], weights.shape[1], out.shape[1])  # slots in expert order
    x += torch.bmm(weights.unsqueeze(1), per_token).squeeze(1)


HEAD_SLICE = 8192  # vocabulary rows upcast at a time by head_upcast: a slice of lm_head in float32, never all of it


def head_out_dtype(x, w, out=None):
    # x: [tokens, hidden] bf16, w: [vocab, hidden] bf16 -> [tokens, vocab] float32 (into out, where given): bf16
    # operands, float32 output (torch 2.11 on the H200: as fast as bf16 logits; not on the CPU)
    return torch.mm(x, w.T, out_dtype=torch.float32, out=out)


def head_upcast(x, w, out=None):
    # the same product from float32 copies of the operands: the plain fallback, and the CPU's (its products of bf16
    # values are exact in float32, so it differs from head_out_dtype only in summation order). On 2 AVX2 cores it
    # runs at the rate of a float32 GEMM of the whole head (the slices' upcasts cost ~4%), 7x a bf16 GEMM's, into a
    # reused out; a new out of 0.5 GB cost 20% more in page faults (bench/NOTES.md, issue 38)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device) if out is None else out
    xf = x.float()
    for v in range(0, w.shape[0], HEAD_SLICE):
        torch.mm(xf, w[v:v + HEAD_SLICE].float().T, out=out[:, v:v + HEAD_SLICE])
    return out


@dataclass
class Kernels:
    """The per-token elementwise work: plain PyTorch, or the fused Triton kernels below (same roundings)."""
    name: str
    rms_norm: object        # (x [tokens, n], weight [n], eps, style) -> [tokens, n]
    head_norm_rope: object  # (x [tokens, heads, D], weight or None, cos, sin, eps, style, interleave) -> x's shape
    gated_act: object       # (gate_up [tokens, 2 intermediate], activation) -> [tokens, intermediate]
    token_nll: object       # (logits [tokens, vocab], targets [tokens]) -> [tokens] float32
    combine: object         # (x [tokens, hidden] += each token's k expert rows of out, weighted: see combine)
    dequantize_layer: object  # (held [a layer's bytes], out [its bf16 elements], FP8Layer): see dequantize_layer
    head: object = head_upcast  # (x [tokens, hidden], lm_head [vocab, hidden], out [tokens, vocab] float32 or
    #                             None) -> float32 logits: pick_head's
    route: object = None  # (h [tokens, hidden], w, router) -> (weights, experts), route's contract: route or
    #                       route_triton, bound in the mixture of experts section (where the routers are)


# late-bound, so that tests can swap a piece of the math for a broken one
TORCH_KERNELS = Kernels("torch", lambda *a: rms_norm(*a), lambda *a: head_norm_rope(*a), lambda *a: gated_act(*a),
                        lambda *a: token_nll(*a), lambda *a: combine(*a), lambda *a: dequantize_layer(*a))


@dataclass
class Chunk:
    start: int          # token offsets of the chunk inside its wave
    end: int
    seq_bounds: list    # host: cumulative sequence lengths inside the chunk, [0, ..., end - start]
    cu_seqlens: object  # the same on the device, int32 (varlen kernels)
    max_len: int
    # A chunk of a prefix tree's wave (the evaluation section), where some sequence (a node of the tree) also sees
    # its ancestors' keys, whole: per sequence, the wave's key ranges [(start, end)] of its ancestors. The attention
    # functions then get the whole wave's keys and values, the chunk's own at chunk.start. None: plain sequences.
    ancestors: list = None
    ancestor_bounds: object = None  # device int32 [sequences + 1]: each sequence's ranges in ancestor_ranges
    ancestor_ranges: object = None  # device int32 [ranges, 2]
    depths: object = None           # device int32 [wave tokens]: each token's depth (a window is by depth)


def chunk_keys(chunk, i, k):
    # the keys sequence i of a chunk attends to, ancestors first: a slice of k, or (prefix tree) an index into the
    # wave's keys; and how many of them are its ancestors'
    s, e = chunk.seq_bounds[i], chunk.seq_bounds[i + 1]
    if chunk.ancestors is None:
        return slice(s, e), 0
    ranges = chunk.ancestors[i] + [(chunk.start + s, chunk.start + e)]
    keys = torch.cat([torch.arange(a, b) for a, b in ranges]).to(k.device)
    return keys, keys.numel() - (e - s)


def grouped_qkv(h, w, cos, sin, cfg, kernels):
    # h: [tokens, hidden], the normed x -> q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]: GQA
    T, Q, KV, D = h.shape[0], cfg.q_size, cfg.kv_size, cfg.head_dim
    eps, style = cfg.rms_norm_eps, cfg.norm_style
    qkv = F.linear(h, w.qkv, w.qkv_bias)  # [tokens, q_size + 2 kv_size]
    q = kernels.head_norm_rope(qkv[:, :Q].view(T, -1, D), w.q_norm, cos, sin, eps, style)  # q/k norm before RoPE
    k = kernels.head_norm_rope(qkv[:, Q:Q + KV].view(T, -1, D), w.k_norm, cos, sin, eps, style)
    return q, k, qkv[:, Q + KV:].reshape(T, -1, D).contiguous()


LATENT_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: DeepseekV3Attention builds them without rms_norm_eps


@dataclass(frozen=True)
class Latent:
    """Latent attention's q or k as latent_qkv leaves them, not joined: nope [tokens, heads, N], a view of a
    projection's output (q's heads N + P apart, k's N + V), and rope [tokens, heads or 1, P] contiguous (k's one RoPE
    key, shared by every head). Prefill's Triton attention reads both where they lie; the other backends, a prefix
    tree's wave and the checks' float32 reference read them joined (joined): the torch.cat of q's and k's halves took
    0.028 s of Moonlight-16B-A3B's 0.55 s contest request on the H200, and v's copy out of kv_b's output more
    (bench/results/profiles/2026-12-03-h200-moonlight-16b-a3b-contest-120gib@dab7942.txt)."""
    nope: torch.Tensor
    rope: torch.Tensor

    @property
    def shape(self):
        return torch.Size((*self.nope.shape[:2], self.nope.shape[2] + self.rope.shape[2]))

    @property
    def device(self):
        return self.nope.device

    def joined(self):
        return torch.cat((self.nope, self.rope.expand(*self.nope.shape[:2], -1)), dim=-1)


def joined(q, k, v):
    # q, k, v whole and v contiguous, as attention backends but prefill's Triton kernel take them: latent_qkv's joined
    # (the tensors it returned before Latent, bit for bit), any other model's as they are
    if isinstance(q, Latent):
        return q.joined(), k.joined(), v.contiguous()
    return q, k, v


def latent_qkv(h, w, cos, sin, cfg, kernels):
    """h: [tokens, hidden], the normed x -> q, k (Latent: [tokens, heads, nope + rope] unjoined), v [tokens, heads,
    v_head_dim] (a view of kv_b's output, heads nope + v_head_dim apart): DeepSeek's
    multi-head latent attention (transformers 5.24, DeepseekV3Attention). q is q_b(norm(q_a(h))), or q_proj(h)
    without q LoRA; kv_a(h) is the latent (kv_lora_rank) and one RoPE key shared by every head (rope_dim); kv_b of
    the normed latent is each head's k_nope and v. RoPE rotates q's last rope_dim channels and the shared key.
    The latent is expanded through kv_b for every token, not absorbed into q and o as decoding does: every token of
    a prefill is a query and a key, so both forms cost the same GEMMs a token (kv_b's 2 x 512 x 32768 FLOPs in V3,
    or its halves folded into q and o), and then each (query, key) pair reads 192 + 128 channels a head expanded,
    576 + 512 absorbed (3.4x). The expanded keys and values take 80 KB a token in V3 (plan_memory counts them)."""
    T, heads, N, P, R = h.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.rope_dim, cfg.kv_lora_rank
    A, eps = cfg.q_lora_rank or cfg.q_size, cfg.rms_norm_eps
    if w.latent_bias is None:  # q_a (or q) and kv_a read the same normed x: one GEMM
        first = F.linear(h, w.qkv, w.qkv_bias)  # [tokens, A + R + P]
        q, kv_a = first[:, :A], first[:, A:]
    else:  # q_proj without a bias beside kv_a_proj_with_mqa with one: two GEMMs, each rounded once as transformers'
        q, kv_a = F.linear(h, w.qkv[:A]), F.linear(h, w.qkv[A:], w.latent_bias)
    if w.q_b is not None:
        q = F.linear(kernels.rms_norm(q, w.q_a_norm, LATENT_EPS), w.q_b)  # [tokens, heads (N + P)]
    q = q.view(T, heads, N + P)
    kv = F.linear(kernels.rms_norm(kv_a[:, :R], w.kv_a_norm, LATENT_EPS), w.kv_b).view(T, heads, -1)  # [.., N + V]
    q_rope = kernels.head_norm_rope(q[..., N:], None, cos, sin, eps, NORM_CAST,
                                    cfg.rope_interleave)  # [tokens, heads, P]
    k_rope = kernels.head_norm_rope(kv_a[:, R:].view(T, 1, P), None, cos, sin, eps, NORM_CAST, cfg.rope_interleave)
    return Latent(q[..., :N], q_rope), Latent(kv[..., :N], k_rope), kv[..., N:]


def attention_block(x, w, cos, sin, chunk, cfg, attend, kernels, how, wave_kv=None):
    # x: [tokens, hidden] — a chunk of whole sequences, updated in place; how: the layer's AttentionSettings. wave_kv:
    # a prefix tree's wave, whose keys and values stay for the chunks after this one (a node's descendants):
    # [wave tokens, kv_heads, head_dim] and [wave tokens, kv_heads, v_head_dim]
    T, eps, style = x.shape[0], cfg.rms_norm_eps, cfg.norm_style
    h = kernels.rms_norm(x, w.input_norm, eps, style)
    q, k, v = (latent_qkv if cfg.kv_lora_rank else grouped_qkv)(h, w, cos, sin, cfg, kernels)
    if wave_kv is not None:  # the wave's keys and values are kept whole
        q, k, v = joined(q, k, v)
        wave_kv[0][chunk.start:chunk.end], wave_kv[1][chunk.start:chunk.end] = k, v
        if chunk.ancestors is not None:
            k, v = wave_kv
    sinks = {} if w.sinks is None else {"sinks": w.sinks}  # gpt-oss's; only backends with sinks take them
    o = F.linear(attend(q, k, v, chunk, how, **sinks).reshape(T, -1), w.o_proj, w.o_bias)  # [tokens, hidden]
    x += o if w.attn_out_norm is None else kernels.rms_norm(o, w.attn_out_norm, eps, style)


def gated_mlp(h, gate_up, down, activation, kernels, gate_up_bias=None, down_bias=None):
    # h: [tokens, hidden] -> down(act(gate) * up): [tokens, hidden], gate and up one GEMM (gate_up: their rows fused)
    return F.linear(kernels.gated_act(F.linear(h, gate_up, gate_up_bias), activation), down, down_bias)


def mlp_block(x, w, cfg, max_tokens, kernels):
    # x: [tokens, hidden], updated in place, in slices of max_tokens rows
    eps, style = cfg.rms_norm_eps, cfg.norm_style
    for s in range(0, x.shape[0], max_tokens):
        xs = x[s:s + max_tokens]
        out = gated_mlp(kernels.rms_norm(xs, w.mlp_norm, eps, style), w.gate_up, w.down, cfg.activation, kernels,
                        w.gate_up_bias, w.down_bias)
        xs += out if w.mlp_out_norm is None else kernels.rms_norm(out, w.mlp_out_norm, eps, style)


# ----------------------------------------------------------------------------- fused kernels (Triton, optional)
# Each kernel reproduces the PyTorch op sequence's bf16 roundings (upcast, compute in float32, round where PyTorch
# rounds), so the fused path matches the plain one to the last bit but for float32 summation order.

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _tanh(x):
        # float32 tanh from exp2 (Triton has no portable tanh): odd, and exact to a few ulps
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr):
        # OFFSET (rms_norm's style): NORM_OFFSET, Gemma's x̂·(1 + w) in float32, rounded once; NORM_FLOAT32, gpt-oss's
        # x̂·w in float32, rounded once; else w·bf16(x̂), as rms_norm
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if OFFSET == 1:
            y = x * rstd * (1.0 + w)
        elif OFFSET == 2:
            y = x * rstd * w
        else:
            y = (x * rstd).to(tl.bfloat16).to(tl.float32) * w
        tl.store(out_ptr + row * n + cols, y.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _head_norm(x, rstd, w_at, NORM: tl.constexpr):
        # a block of channels of each head (x [HEADS, n] float32) through the q/k norm of _head_norm_rope_kernel's
        # NORM (rstd: each head's, over all its channels), rounded to bf16 where rms_norm rounds
        if NORM == 0:
            y = x
        elif NORM == 1:
            y = ((x * rstd).to(tl.bfloat16).to(tl.float32) * tl.load(w_at).to(tl.float32)).to(tl.bfloat16)
        else:
            y = (x * rstd * (1.0 + tl.load(w_at).to(tl.float32))).to(tl.bfloat16)
        return y.to(tl.float32)

    @triton.jit
    def _rope_halves(y1, y2, cos_at, sin_at, ROT: tl.constexpr):
        # the rotating channels' two halves (y1, y2 [HEADS, ROT] float32) -> x * cos + rotate_half(x) * sin, each product
        # and the sum rounded to bf16 as in PyTorch; cos_at, sin_at: the token's table at the halves' columns
        cos1, cos2 = tl.load(cos_at).to(tl.float32), tl.load(cos_at + ROT).to(tl.float32)
        sin1, sin2 = tl.load(sin_at).to(tl.float32), tl.load(sin_at + ROT).to(tl.float32)
        o1 = ((y1 * cos1).to(tl.bfloat16).to(tl.float32) + (-y2 * sin1).to(tl.bfloat16).to(tl.float32))
        o2 = ((y2 * cos2).to(tl.bfloat16).to(tl.float32) + (y1 * sin2).to(tl.bfloat16).to(tl.float32))
        return o1.to(tl.bfloat16), o2.to(tl.bfloat16)

    @triton.jit
    def _head_norm_rope_kernel(x_ptr, x_stride, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps,
                               HEADS: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                               HEAD_STRIDE: tl.constexpr, INTERLEAVE: tl.constexpr):
        # NORM: 0 RoPE alone (no q/k norm), 1 Qwen3's per-head RMSNorm first, 2 Gemma 3's (x̂·(1 + w)). ROT: half the
        # channels that rotate (the tables' width / 2): HALF, or less for partial RoPE (GLM-4.5), whose first 2 ROT
        # channels rotate, reread, and whose others pass through (normed). HEAD_STRIDE: between heads of x (2 HALF,
        # but DeepSeek's RoPE channels end heads of nope + rope). INTERLEAVE (never with partial RoPE: no model has
        # both): the pairs are channels (2i, 2i + 1), rotated into i and HALF + i as
        # apply_rotary_pos_emb_interleave returns them
        t = tl.program_id(0)
        h = tl.arange(0, HEADS)[:, None]
        c = tl.arange(0, HALF)[None, :]
        mask = h < heads
        if INTERLEAVE:
            first, second = 2 * c, 2 * c + 1
        else:
            first, second = c, HALF + c
        src = x_ptr + t * x_stride + h * HEAD_STRIDE
        x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
        rstd = 0.0
        if NORM != 0:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        dst = out_ptr + (t * heads + h) * (2 * HALF)
        if ROT == HALF:
            o1, o2 = _rope_halves(_head_norm(x1, rstd, w_ptr + first, NORM), _head_norm(x2, rstd, w_ptr + second, NORM),
                                  cos_ptr + t * 2 * ROT + c, sin_ptr + t * 2 * ROT + c, ROT)
            tl.store(dst + c, o1, mask=mask)
            tl.store(dst + HALF + c, o2, mask=mask)
        else:
            tl.static_assert(not INTERLEAVE)
            y1, y2 = _head_norm(x1, rstd, w_ptr + c, NORM), _head_norm(x2, rstd, w_ptr + HALF + c, NORM)
            tl.store(dst + c, y1.to(tl.bfloat16), mask=mask & (c >= 2 * ROT))
            tl.store(dst + HALF + c, y2.to(tl.bfloat16), mask=mask & (HALF + c >= 2 * ROT))
            r = tl.arange(0, ROT)[None, :]
            r1 = _head_norm(tl.load(src + r, mask=mask, other=0.0).to(tl.float32), rstd, w_ptr + r, NORM)
            r2 = _head_norm(tl.load(src + ROT + r, mask=mask, other=0.0).to(tl.float32), rstd, w_ptr + ROT + r, NORM)
            o1, o2 = _rope_halves(r1, r2, cos_ptr + t * 2 * ROT + r, sin_ptr + t * 2 * ROT + r, ROT)
            tl.store(dst + r, o1, mask=mask)
            tl.store(dst + ROT + r, o2, mask=mask)

    @triton.jit
    def _clamped_swiglu(gate, up, alpha, limit, dtype: tl.constexpr):
        # gpt-oss's ClampedSwiGLU of float32 gate and up, each of gated_act's steps rounded to dtype (bf16: as PyTorch
        # rounds each bf16 op); the product is left to the caller. The fused experts' epilogue computes it too
        gate = tl.minimum(gate, limit).to(dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit).to(dtype).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-(gate * alpha).to(dtype).to(tl.float32)))).to(dtype).to(tl.float32)
        return (up + 1.0).to(dtype).to(tl.float32) * (gate * sigmoid).to(dtype).to(tl.float32)

    @triton.jit
    def _gated_act_kernel(gu_ptr, out_ptr, inter, alpha, limit, BLOCK: tl.constexpr, GELU: tl.constexpr,
                          CLAMPED: tl.constexpr):
        # act(gate) rounded to bf16, times up: SiLU, or (GELU) the tanh GELU, 0.5 g (1 + tanh(√(2/π) (g + 0.044715
        # g³))). CLAMPED: gpt-oss's ClampedSwiGLU over gate and up interleaved, each of gated_act's bf16 steps rounded
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        if CLAMPED:
            gate = tl.load(gu_ptr + t * 2 * inter + 2 * cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gu_ptr + t * 2 * inter + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * inter + cols, _clamped_swiglu(gate, up, alpha, limit, tl.bfloat16).to(tl.bfloat16),
                     mask=mask)
        else:
            gate = tl.load(gu_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gu_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
            if GELU:
                act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
            else:
                act = gate / (1.0 + tl.exp(-gate))
            tl.store(out_ptr + t * inter + cols, (act.to(tl.bfloat16).to(tl.float32) * up).to(tl.bfloat16),
                     mask=mask)

    @triton.jit
    def _combine_kernel(x_ptr, x_stride, out_ptr, row_of_ptr, weights_ptr, hidden, K: tl.constexpr,
                        BLOCK: tl.constexpr):
        # x[t] += Σ_j weights[t, j] · out[row_of[t k + j]]: float32 products summed in slot order and rounded to bf16
        # once, then the add rounded, as combine's bmm and in-place add; each token's k rows gathered as they are read
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(K):
            row = tl.load(row_of_ptr + t * K + j).to(tl.int64)
            weight = tl.load(weights_ptr + t * K + j).to(tl.float32)
            acc += weight * tl.load(out_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        at = x_ptr + t.to(tl.int64) * x_stride + cols
        x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(at, (x + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16), mask=mask)

    @triton.jit
    def _token_nll_kernel(logits_ptr, stride, targets_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        # one pass over a row of logits (float32 or bf16): running max and sum of exponentials per lane, combined
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        run_max = tl.full((BLOCK,), -1e30, tl.float32)  # finite: exp(-inf - run_max) stays 0, never nan
        run_sum = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
        target = tl.load(targets_ptr + row)
        picked = tl.load(base + tl.maximum(target, 0)).to(tl.float32)
        tl.store(out_ptr + row, tl.where(target >= 0, lse - picked, 0.0))

    @triton.jit
    def _tile(at, rows_ok, channels_ok, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        # a tile at `at`, 0 where ROWS says rows_ok fails or CHANNELS says channels_ok does (a head dim padded to a
        # power of two: DeepSeek's 192 in 256 lanes); each mask only where asked, so that a tile that needs none
        # compiles to a plain load
        if ROWS and CHANNELS:
            tile = tl.load(at, mask=rows_ok & channels_ok, other=0.0)
        elif ROWS:
            tile = tl.load(at, mask=rows_ok, other=0.0)
        elif CHANNELS:
            tile = tl.load(at, mask=channels_ok, other=0.0)
        else:
            tile = tl.load(at)
        return tile

    @triton.jit
    def _store(at, tile, rows_ok, channels_ok, CHANNELS: tl.constexpr):
        # _tile's store: where rows_ok, and channels_ok where CHANNELS (a padded head dim)
        if CHANNELS:
            tl.store(at, tile, mask=rows_ok & channels_ok)
        else:
            tl.store(at, tile, mask=rows_ok)

    @triton.jit
    def _attention_tiles(acc, m_i, l_i, q, q_rope, k_ptr, k_rope_ptr, v_ptr, rows, length, n_lo, n_hi, scale_log2,
                         window, cap_log2, K_STEP: tl.constexpr, V_STEP: tl.constexpr, D: tl.constexpr,
                         DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, ROPE: tl.constexpr,
                         BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
        # online softmax over key tiles [n_lo, n_hi); only the tiles on the diagonal, and with WINDOW those on its
        # left edge (DIAGONAL too), need the causal/length/window mask. SOFTCAP: scores capped to ±cap (log2 units).
        # k: rows K_STEP apart of D channels (DP lanes, the padding masked to 0: it adds nothing to q.k), v V_STEP
        # apart of DV (DVP lanes). ROPE (latent attention unjoined: Latent): each key's other ROPE channels at
        # k_rope_ptr, ROPE apart (the one RoPE key every head shares), their product with q_rope [BLOCK_M, ROPE] added
        # to q.k; 0: none (q_rope, k_rope_ptr unread)
        d = tl.arange(0, DP)
        dv = tl.arange(0, DVP)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k_at = k_ptr + cols[None, :].to(tl.int64) * K_STEP + d[:, None]  # [DP, BLOCK_N]
            v_at = v_ptr + cols[:, None].to(tl.int64) * V_STEP + dv[None, :]  # [BLOCK_N, DVP]
            k = _tile(k_at, cols[None, :] < length, d[:, None] < D, DIAGONAL, DP != D)
            if ROPE:
                r = tl.arange(0, ROPE)
                k_rope = _tile(k_rope_ptr + cols[None, :].to(tl.int64) * ROPE + r[:, None], cols[None, :] < length,
                               r[:, None] < ROPE, DIAGONAL, False)  # [ROPE, BLOCK_N]
                s = tl.dot(q_rope, k_rope, tl.dot(q, k)) * scale_log2
            else:
                s = tl.dot(q, k) * scale_log2  # [BLOCK_M, BLOCK_N] float32, in log2 units
            if SOFTCAP:
                s = cap_log2 * _tanh(s / cap_log2)
            if DIAGONAL:
                seen = (cols[None, :] <= rows[:, None]) & (cols[None, :] < length)
                if WINDOW:  # query i sees keys i - window < j <= i
                    seen = seen & (cols[None, :] > rows[:, None] - window)
                s = tl.where(seen, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if WINDOW:  # a row may have seen no key yet (all -inf): exponents from 0 then, which keep p and alpha 0
                m_exp = tl.where(m_new == -float("inf"), 0.0, m_new)
            else:  # column 0 is in every row's window: the running max is finite from the first tile on
                m_exp = m_new
            alpha = tl.exp2(m_i - m_exp)
            p = tl.exp2(s - m_exp[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(v_at, cols[:, None] < length, dv[None, :] < DV, DIAGONAL, DVP != DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # P rounded to the input type, as flash kernels do
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, sinks_ptr, scale_log2, window, cap_log2, q_rope_ptr,
                          k_rope_ptr, q_step, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                          DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                          ROPE: tl.constexpr):
        # one program: BLOCK_M query rows of one head of one sequence; q: [tokens, HEADS, D], k: [tokens, KV_HEADS,
        # D], v: [tokens, KV_HEADS, DV], out: [tokens, HEADS, DV] (DP, DVP: those head dims' powers of two, the lanes
        # a tile has); query head h reads kv head h // (HEADS // KV_HEADS). Every row sees its own key, so no row
        # divides by 0. WINDOW: the key tiles left of every row's window are skipped, not masked. SINKS: the head's
        # sink (sinks_ptr [HEADS], natural units) is a column every row has seen before its first key: the running max
        # starts at it and the sum at its exp(0), and its value is 0. ROPE (latent attention unjoined, Latent; 0: not):
        # q's D channels a head at q_ptr, rows q_step apart and heads D + ROPE; k's D and v's DV channels of one
        # [tokens, KV_HEADS, D + DV] tensor (k_ptr at k's, v_ptr at v's: rows KV_HEADS (D + DV) apart, heads D + DV);
        # q's ROPE other channels at q_rope_ptr [tokens, HEADS, ROPE] and k's at k_rope_ptr [tokens, 1, ROPE], the
        # key every head shares. D, ROPE and DV powers of two there (no padded lanes)
        block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_ptr + seq)
        length = tl.load(cu_ptr + seq + 1) - start
        m0 = block * BLOCK_M
        if m0 < length:
            rows = m0 + tl.arange(0, BLOCK_M)
            # offsets as int64 tensors, then one pointer add: other association orders compiled to one more VGPR for
            # gfx1100 at 64x32, where this kernel sits at 256 of 256 (tests/test_gfx1100_compile.py)
            token_head = (start + rows[:, None]).to(tl.int64) * HEADS + head
            kv_head = head // (HEADS // KV_HEADS)
            if ROPE:
                tl.static_assert(DP == D and DVP == DV)
                q = _tile(q_ptr + ((start + rows[:, None]).to(tl.int64) * q_step + head * (D + ROPE)
                                   + tl.arange(0, D)[None, :]), rows[:, None] < length, True, True, False)
                q_rope = _tile(q_rope_ptr + (token_head * ROPE + tl.arange(0, ROPE)[None, :]), rows[:, None] < length,
                               True, True, False)  # [BLOCK_M, ROPE]
                k_at = k_ptr + (start.to(tl.int64) * KV_HEADS * (D + DV) + kv_head * (D + DV))
                v_at = v_ptr + (start.to(tl.int64) * KV_HEADS * (D + DV) + kv_head * (D + DV))
                k_rope_at = k_rope_ptr + start.to(tl.int64) * ROPE
            else:
                q = _tile(q_ptr + (token_head * D + tl.arange(0, DP)[None, :]), rows[:, None] < length,
                          tl.arange(0, DP)[None, :] < D, True, DP != D)  # [BLOCK_M, DP]
                q_rope = q
                k_at = k_ptr + (start.to(tl.int64) * KV_HEADS * D + kv_head * D)
                v_at = v_ptr + (start.to(tl.int64) * KV_HEADS * DV + kv_head * DV)
                k_rope_at = k_at
            K_STEP: tl.constexpr = KV_HEADS * (D + DV) if ROPE else KV_HEADS * D
            V_STEP: tl.constexpr = KV_HEADS * (D + DV) if ROPE else KV_HEADS * DV
            acc = tl.zeros((BLOCK_M, DVP), tl.float32)
            if SINKS:
                m_i = tl.zeros((BLOCK_M,), tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
                l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
            else:
                m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
                l_i = tl.zeros((BLOCK_M,), tl.float32)
            inside = 0  # key tiles from here to the diagonal lie inside every row's window
            if WINDOW:
                first = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N  # the first tile the top row sees
                inside = tl.minimum((tl.maximum(m0 + BLOCK_M - window, first) + BLOCK_N - 1) // BLOCK_N * BLOCK_N,
                                    m0)
                acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q_rope, k_at, k_rope_at, v_at, rows, length,
                                                 first, inside, scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP,
                                                 DV, DVP, ROPE, BLOCK_N, True, WINDOW, SOFTCAP)
            acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q_rope, k_at, k_rope_at, v_at, rows, length, inside,
                                             m0, scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, ROPE,
                                             BLOCK_N, False, WINDOW, SOFTCAP)
            acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q_rope, k_at, k_rope_at, v_at, rows, length, m0,
                                             tl.minimum(m0 + BLOCK_M, length), scale_log2, window, cap_log2, K_STEP,
                                             V_STEP, D, DP, DV, DVP, ROPE, BLOCK_N, True, WINDOW, SOFTCAP)
            dv = tl.arange(0, DVP)[None, :]
            _store(out_ptr + (token_head * DV + dv), (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                   rows[:, None] < length, dv < DV, DVP != DV)

    @triton.jit
    def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, kv_start, anc_cu_ptr, anc_ptr, depth_ptr,
                               sinks_ptr, scale_log2, window, cap_log2, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                               D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                               SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
        # _attention_kernel for a prefix tree's chunk: one program, BLOCK_M query rows of one KV head's group of
        # query heads in one node, row r the node's token r // GROUP in head r % GROUP of the group, so that a key tile
        # serves GROUP heads at once: a tree's nodes are short (a question's 80 tokens under a 700-token few-shot
        # prefix) and their ancestors' keys long, so a program per query head re-read every ancestor key GROUP times
        # and filled its last row block by a fraction. q: the chunk's [tokens, HEADS, D], out: [tokens, HEADS, DV],
        # k/v: the whole wave's [tokens, KV_HEADS, D or DV], the chunk's own at kv_start. A node first reads its
        # ancestors' key ranges whole (anc_ptr[anc_cu_ptr[node]:...], [start, end) pairs in the wave), then its own
        # keys causally. A range's last partial tile is masked by the diagonal path with every row at the range's
        # end. A root node (no ranges) is _attention_kernel's case; the first tile read holds key 0 of a range or of
        # the node, so no row's running max stays -inf. WINDOW is by depth (depth_ptr: the wave's): a range of an
        # ancestor covers consecutive depths, so a row compares as row + (node's depth - range's depth) against the
        # range's columns, which puts every column before it (causal: all seen) and the window's edge where it lies;
        # the tiles left of the top row's window are skipped, the rest masked. SINKS: as _attention_kernel's, each row
        # its own head's.
        GROUP: tl.constexpr = HEADS // KV_HEADS
        K_STEP: tl.constexpr = KV_HEADS * D
        V_STEP: tl.constexpr = KV_HEADS * DV
        block, node, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_ptr + node)
        length = tl.load(cu_ptr + node + 1) - start
        m0 = block * BLOCK_M
        if m0 < length * GROUP:
            packed = m0 + tl.arange(0, BLOCK_M)
            rows = packed // GROUP  # each row's token in the node: what the causal mask compares
            valid = packed < length * GROUP
            token_head = (start + rows[:, None]).to(tl.int64) * HEADS + kv_head * GROUP + packed[:, None] % GROUP
            q = _tile(q_ptr + (token_head * D + tl.arange(0, DP)[None, :]), valid[:, None],
                      tl.arange(0, DP)[None, :] < D, True, DP != D)  # [BLOCK_M, DP]
            acc = tl.zeros((BLOCK_M, DVP), tl.float32)
            if SINKS:
                m_i = tl.load(sinks_ptr + kv_head * GROUP + packed % GROUP).to(tl.float32) * 1.4426950408889634
                l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
            else:
                m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
                l_i = tl.zeros((BLOCK_M,), tl.float32)
            if WINDOW:
                depth = tl.load(depth_ptr + kv_start + start)  # the node's first token's
            for a in range(tl.load(anc_cu_ptr + node), tl.load(anc_cu_ptr + node + 1)):
                lo = tl.load(anc_ptr + 2 * a)
                n = tl.load(anc_ptr + 2 * a + 1) - lo
                k_at = k_ptr + (lo.to(tl.int64) * KV_HEADS * D + kv_head * D)
                v_at = v_ptr + (lo.to(tl.int64) * KV_HEADS * DV + kv_head * DV)
                if WINDOW:
                    shift = depth - tl.load(depth_ptr + lo)  # >= n: the range lies above the node
                    first = tl.maximum(m0 // GROUP + shift - window + 1, 0) // BLOCK_N * BLOCK_N
                    acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at, rows + shift, n, first, n,
                                                     scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0,
                                                     BLOCK_N, True, WINDOW, SOFTCAP)
                else:
                    whole = n // BLOCK_N * BLOCK_N
                    acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at, rows, n, 0, whole,
                                                     scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0,
                                                     BLOCK_N, False, WINDOW, SOFTCAP)
                    acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at,
                                                     tl.zeros((BLOCK_M,), tl.int32) + (n - 1), n, whole, n, scale_log2,
                                                     window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0, BLOCK_N, True,
                                                     WINDOW, SOFTCAP)
            k_at = k_ptr + ((kv_start + start).to(tl.int64) * KV_HEADS * D + kv_head * D)
            v_at = v_ptr + ((kv_start + start).to(tl.int64) * KV_HEADS * DV + kv_head * DV)
            first = m0 // GROUP // BLOCK_N * BLOCK_N  # every row's keys below it are unmasked (without a window)
            if WINDOW:  # the window's first tile for the top row on, masked
                acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at, rows, length,
                                                 tl.maximum(m0 // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N, first,
                                                 scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0,
                                                 BLOCK_N, True, WINDOW, SOFTCAP)
            else:
                acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at, rows, length, 0, first,
                                                 scale_log2, window, cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0,
                                                 BLOCK_N, False, WINDOW, SOFTCAP)
            acc, m_i, l_i = _attention_tiles(acc, m_i, l_i, q, q, k_at, k_at, v_at, rows, length, first,
                                             tl.minimum((m0 + BLOCK_M - 1) // GROUP + 1, length), scale_log2, window,
                                             cap_log2, K_STEP, V_STEP, D, DP, DV, DVP, 0, BLOCK_N, True, WINDOW,
                                             SOFTCAP)
            dv = tl.arange(0, DVP)[None, :]
            _store(out_ptr + (token_head * DV + dv), (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), valid[:, None],
                   dv < DV, DVP != DV)


if triton is not None:
    @triton.jit
    def _copy_block(copy_ptr, out_ptr, src, dst, r0, row_end, cols, c, ROWS: tl.constexpr):
        # rows r0 to row_end by columns c (< cols) of a tensor copied as it is held (int16 elements), ROWS at a time
        for r in range(r0, row_end, ROWS):
            rs = r + tl.arange(0, ROWS)
            at = rs[:, None] * cols + c[None, :]  # [ROWS, BLOCK]
            mask = (rs[:, None] < row_end) & (c[None, :] < cols)
            tl.store(out_ptr + dst + at, tl.load(copy_ptr + src + at, mask=mask), mask=mask)

    @triton.jit
    def _fp8_block(q_ptr, out_ptr, s, src, dst, r0, row_end, cols, c, ROWS: tl.constexpr):
        # rows r0 to row_end by columns c (< cols) of an FP8 weight times its block's scale s, as bf16 bits, ROWS at a
        # time
        for r in range(r0, row_end, ROWS):
            rs = r + tl.arange(0, ROWS)
            at = rs[:, None] * cols + c[None, :]  # [ROWS, BLOCK]
            mask = (rs[:, None] < row_end) & (c[None, :] < cols)
            b = tl.load(q_ptr + src + at, mask=mask, other=0).to(tl.int32)
            e, m = (b >> 3) & 15, b & 7
            normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e - 7) (1 + m/8)
            v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
            v = tl.where((e == 15) & (m == 7), float("nan"), v)
            # the sign as a bit, not as -v: on the H200 a negated zero came out +0.0 where PyTorch gives -0.0
            # (byte 0x80), the only bits the start-up check found different (bench/debug/dequant_diff.py)
            u = (v * s).to(tl.uint32, bitcast=True) ^ ((b & 128).to(tl.uint32) << 24)
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            tl.store(out_ptr + dst + at, rounded.to(tl.int16), mask=mask)

    @triton.jit
    def _mxfp4_scale(s):
        # what _mxfp4_bits takes of scale bytes s (int32, any shape), once a scale rather than once a code: the
        # product's bf16 bits are an exponent field added to the code's (s - 1 + its exponent, mantissa bit 6 its
        # half) but below `linear` (0 and 0.5; at a scale byte of 0, the subnormal 0.5 to 1.5 too: m · 2^-128, m the
        # magnitude) they are zero + m · step; past 254 the exponent overflows to inf, and at 255, transformers' 2^128
        # being inf already, every one is inf but zero's NaN
        base = tl.where(s == 255, 0x7F80, (s - 1) << 7)
        linear = tl.where(s == 0, 4, 2)
        zero = tl.where(s == 255, 0x7FC0, 0)
        step = tl.where(s == 255, -64, tl.where(s >= 2, (s - 1) << 7, 0x20 << s))
        return base, linear, zero, step

    @triton.jit
    def _mxfp4_bits(byte, base, linear, zero, step, NIBBLE: tl.constexpr):
        # the e2m1 codes in bits NIBBLE to NIBBLE + 3 of bytes (0: low, 4: high) times 2^(s - 127), as bf16 bits,
        # _mxfp4_scale's of their scale bytes s given: exact as dequantize_mxfp4's float32 is (at most two significant
        # bits; subnormal at scale bytes 0 and 1), every code and scale byte (tests/test_gpt_oss.py). The magnitude
        # left in place (step and 64 divided by 16 for the high nibble: every step is a multiple of 32), a code costs
        # a mask, a compare, a clamp, the sign's mask and three multiply-adds; the whole arithmetic a code took 26
        # integer-pipe instructions on sm_90a (issue 37)
        mag = byte & (7 << NIBBLE)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6: 2^e or 1.5 · 2^e, its bf16 bits (as 2^-126's) mag · 64
        bits = tl.where(mag < (linear << NIBBLE), zero + mag * (step >> NIBBLE),
                        tl.minimum(mag * (64 >> NIBBLE) + base, 0x7F80))
        return (bits | ((byte & (8 << NIBBLE)) << (12 - NIBBLE))).to(tl.int16)

    @triton.jit
    def _dequantize_layer_kernel(q_ptr, copy_ptr, s_ptr, out_ptr, tensors_ptr, programs_ptr, COLUMNS: tl.constexpr,
                                 BLOCK: tl.constexpr, ROWS: tl.constexpr, MXFP4: tl.constexpr, GROUPS: tl.constexpr,
                                 STEPS: tl.constexpr):
        # One program: one BLOCK x BLOCK block of one tensor of a layer (FP8Layer's tables: the tensor's row, the
        # block's index within it), whole; a side below BLOCK is one block. An FP8 weight's block: float8_e4m3fn
        # bytes decoded by integer arithmetic (exact, and on GPUs without FP8 conversions: gfx1100), times the
        # block's one float32 scale, rounded to bf16 to nearest even by integer arithmetic too, so that the
        # interpreter (which truncates) gives the same bits as a GPU. A bf16 tensor's (a norm, a bias, the router):
        # copied as it is. q_ptr, copy_ptr, s_ptr: the held layer as bytes, int16 and float32. MXFP4 (a model whose
        # quantized tensors are MXFP4, not FP8): a quantized tensor's program is ROWS rows by STEPS tiles of GROUPS x 32
        # columns, one after the other.
        # Offsets and widths come from the tables, so Triton cannot see that a tensor's rows start aligned: it read
        # FP8 a byte and wrote bf16 an element at a time (ld.global.b8, st.global.b16 in the sm_90a PTX, 128
        # registers under Triton 3.9 and 3.6; 568 GB/s on the H200,
        # bench/results/primitives/2026-12-02-h200-fp8-dequantize.json). Where a tensor's offsets and width are in
        # whole 16 B of bf16 (every tensor of every model tests/test_gfx1100_compile.py compiles, test_fp8 checks),
        # each is rounded down to a multiple of 8 elements, which leaves it as it is and which Triton's axis analysis
        # reads as divisibility: FP8 read 8 B and bf16 written 16 B at a time (ld.global.v2.b32, st.global.v4.b32;
        # 40 registers, 48 under 3.6). Taken only where the tables' values meet it, on the device, the rounding is
        # exact; a hint (tl.multiple_of) on a value that did not meet it would corrupt silently, a rounding that was
        # not exact gives other bits, which the start-up check refuses.
        p = tl.program_id(0)
        row = tensors_ptr + tl.load(programs_ptr + p).to(tl.int64) * COLUMNS
        src, scale, dst = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        rows, cols, grid_cols, block = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), p - tl.load(row + 6)
        r0 = block // grid_cols * BLOCK
        row_end = tl.minimum(r0 + BLOCK, rows)
        c = block % grid_cols * BLOCK + tl.arange(0, BLOCK)
        if scale < 0:
            if (src % 8 == 0) & (dst % 8 == 0) & (cols % 8 == 0):  # whole 16 B of int16
                _copy_block(copy_ptr, out_ptr, src // 8 * 8, dst // 8 * 8, r0, row_end, cols // 8 * 8, c, ROWS)
            else:  # a quarter of the rows a step: element by element, ROWS of them took the kernel to 64 registers
                _copy_block(copy_ptr, out_ptr, src, dst, r0, row_end, cols, c, ROWS // 4)
        elif MXFP4:
            # ROWS rows of one expert's blocks [out, in / 32, 16] by STEPS tiles of GROUPS x 32 of their in columns,
            # a tile a step (GROUPS scales of 16 bytes each: [ROWS, GROUPS, 16]), written transposed into the bf16
            # layout's [experts, in, out]: each byte's low nibble to column c, its high to c + 1, each a run of ROWS
            # along out (group: out, an expert's rows, whole programs of them). The rows as the expert's first plus a
            # range: contiguous to Triton, which writes 8 of them a thread (st.global.v4.b32), the bytes read 16 a
            # thread at 8 groups (8 at 4), transposed between through shared memory. A [ROWS, BLOCK] tile whose rows
            # were computed from the row's expert had every thread write 2 B, `out` elements from its neighbour's
            # (st.global.b16; 222 registers on sm_90a, 126 under Triton 3.6; 6.1 ms a gpt-oss-20b layer on the H200,
            # its contest run's profile). A program of one [32, 4, 16] tile ran at 1.22 TB/s (gpt-oss-20b's and
            # -120b's layer, H200), half of FP8's: bound by the integer pipe (64 lanes an SM on Hopper), not by
            # memory: the codes' arithmetic 26 instructions a code there, the tables and two 64-bit divisions ~100 a
            # thread for its 16 codes. Now 4 values a scale (_mxfp4_scale), ~7 a code, and the program's overhead
            # once in STEPS tiles (bench/NOTES.md, issue 37). fp8_layer asserts what the roundings take: 16 B-aligned
            # blocks, a destination in whole 16 B, out a multiple of ROWS.
            group = tl.load(row + 7) // ROWS * ROWS
            first = block // grid_cols * ROWS
            n = first % group // ROWS * ROWS + tl.arange(0, ROWS)  # within the expert
            k = tl.arange(0, 16)
            scales = cols // 32
            rows_at = (first + tl.arange(0, ROWS))[:, None, None] * scales  # [ROWS, 1, 1]
            expert_at = dst // 8 * 8 + first // group * (scales * 32 * group) + n[:, None, None]
            g0 = block % grid_cols * (STEPS * GROUPS)
            for g1 in range(g0, tl.minimum(g0 + STEPS * GROUPS, scales), GROUPS):
                g = g1 + tl.arange(0, GROUPS)  # the columns' scales within a row
                mask = g[None, :, None] < scales
                at = rows_at + g[None, :, None]  # [ROWS, GROUPS, 1]
                byte = tl.load(q_ptr + src // 16 * 16 + at * 16 + k[None, None, :], mask=mask, other=0).to(tl.int32)
                s = tl.load(q_ptr + scale + at, mask=mask, other=0).to(tl.int32)
                out_at = expert_at + (g[None, :, None] * 32 + 2 * k[None, None, :]) * group
                base, linear, zero, step = _mxfp4_scale(s)
                tl.store(out_ptr + out_at, _mxfp4_bits(byte, base, linear, zero, step, 0), mask=mask)
                tl.store(out_ptr + out_at + group, _mxfp4_bits(byte, base, linear, zero, step, 4), mask=mask)
        else:
            s = tl.load(s_ptr + scale + block)  # the scale grid is row-major, as the blocks are numbered
            if (src % 8 == 0) & (dst % 8 == 0) & (cols % 8 == 0):  # whole 16 B of bf16 (and 8 B of FP8)
                _fp8_block(q_ptr, out_ptr, s, src // 8 * 8, dst // 8 * 8, r0, row_end, cols // 8 * 8, c, ROWS)
            else:  # as a copy's
                _fp8_block(q_ptr, out_ptr, s, src, dst, r0, row_end, cols, c, ROWS // 4)


def rms_norm_triton(x, weight, eps, style=NORM_CAST):
    assert x.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    # the style as it was compiled before gpt-oss's came (False, True): the same constexprs, the same kernels
    offset = bool(style) if style in (NORM_CAST, NORM_OFFSET) else style
    _rms_norm_kernel[(x.shape[0],)](x, x.stride(0), weight, out, n, eps, BLOCK=block, OFFSET=offset,
                                    num_warps=min(16, max(1, block // 512)))
    return out


def head_norm_rope_triton(x, weight, cos, sin, eps, style, interleave=False):
    # cos, sin: [tokens, rotary_dim], the whole head_dim but for partial RoPE
    T, heads, D = x.shape
    assert x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    norm = 0 if weight is None else {NORM_CAST: 1, NORM_OFFSET: 2}[style]  # no family has gpt-oss's norms on q/k
    _head_norm_rope_kernel[(T,)](x, x.stride(0), x if weight is None else weight, cos, sin, out, heads, eps,
                                 HEADS=triton.next_power_of_2(heads), HALF=D // 2, ROT=cos.shape[1] // 2, NORM=norm,
                                 HEAD_STRIDE=x.stride(1), INTERLEAVE=interleave, num_warps=4)
    return out


def gated_act_triton(gate_up, activation):
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.is_contiguous()
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    clamped = isinstance(activation, ClampedSwiGLU)
    _gated_act_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, inter, activation.alpha if clamped else 1.0, activation.limit if clamped else 0.0, BLOCK=block,
        GELU=activation == "gelu_tanh", CLAMPED=clamped, num_warps=4)
    return out


def combine_triton(x, out, row_of, weights):
    # what combine computes, without the [tokens, k, hidden] copy of the gathered rows that its bmm reads
    (T, k), H = weights.shape, out.shape[1]
    assert x.stride(1) == 1 and out.is_contiguous() and row_of.is_contiguous() and weights.is_contiguous()
    block = min(2048, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](x, x.stride(0), out, row_of, weights, H, K=k, BLOCK=block,
                                                num_warps=max(1, block // 256))


DEQUANTIZE_WARPS = 8  # dequantize_layer_triton's (bench/fp8_dequantize.py tries others)


def dequantize_layer_triton(held, out, layer):
    # dequantize_layer in one launch (layer: an FP8Layer): its tables on the device, nothing read on the host.
    # [32, 128] tiles on 8 warps: 16 elements a thread (8 FP8 bytes of a row, 16 B of its bf16), a 128-row block in 4
    # steps (a tensor not in whole 16 B: [8, 128] in 16; an MXFP4 program: [32, 8, 16] bytes, in up to MXFP4_STEPS)
    _dequantize_layer_kernel[(layer.programs.numel(),)](
        held.view(torch.uint8), held.view(torch.int16), held.view(torch.float32), out.view(torch.int16),
        layer.tensors, layer.programs, COLUMNS=FP8_COLUMNS, BLOCK=FP8_BLOCK, ROWS=DEQUANTIZE_ROWS, MXFP4=layer.mxfp4,
        GROUPS=MXFP4_GROUPS, STEPS=MXFP4_STEPS, num_warps=MXFP4_WARPS if layer.mxfp4 else DEQUANTIZE_WARPS)


def token_nll_triton(logits, targets):
    # reads the logits (float32, or bf16) once, where the plain path writes and rereads their log-softmax
    assert logits.stride(-1) == 1
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _token_nll_kernel[(logits.shape[0],)](logits, logits.stride(0), targets, out, logits.shape[1], BLOCK=4096,
                                          num_warps=8)
    return out


TRITON_KERNELS = Kernels("triton", rms_norm_triton, head_norm_rope_triton, gated_act_triton, token_nll_triton,
                         combine_triton, dequantize_layer_triton)


# ----------------------------------------------------------------------------- attention backends
# Every backend computes attend(q, k, v, chunk, how) -> [tokens, heads, v's head dim] over the chunk's texts, causal,
# GQA, with the layer's AttentionSettings `how` (scale, window, softcap), or is not offered for a model that needs what
# it lacks.

SDPA_SCORES = 1 << 24  # scores one SDPA call may hold (64 MB in float32): its math backend keeps a few copies


def own_scale(how, head_dim):
    # how.scale where a kernel's default (head_dim^-½) is not the model's (Gemma's query_pre_attn_scalar), else None:
    # the kernel's own, and today's bits for the others
    return None if how.scale == 1.0 / math.sqrt(head_dim) else how.scale


def seen_keys(chunk, i, r, rows, keys, ancestors, window, device):
    # [rows, ancestors + n] bool: which of keys (chunk_keys of sequence i: its ancestors' first, then its own n) its
    # query rows r .. r + rows see: the ancestors' all and its own causally; with a window, only keys less than
    # `window` deep above the query's depth (the positions of a plain text; a prefix tree's chunk.depths)
    n = chunk.seq_bounds[i + 1] - chunk.seq_bounds[i]
    seen = torch.ones(rows, ancestors + n, dtype=torch.bool, device=device).tril(ancestors + r)
    if window is None:
        return seen
    if chunk.depths is None:
        return seen.triu(r - window + 1)
    at = chunk.start + chunk.seq_bounds[i] + r
    query_depth = chunk.depths[at:at + rows].to(device)  # [rows]
    return seen & (chunk.depths[keys].to(device)[None, :] > query_depth[:, None] - window)


def softcapped_attention(q, k, v, seen, how, sinks=None):
    # q: [heads, rows, D], k/v: [heads, n, D] float32 -> [heads, rows, D] float32: the math written out, SDPA having
    # no softcap and no sinks. sinks [heads] (gpt-oss): a column joined to each row's scores, its probability dropped
    # after the softmax, as transformers' eager_attention_forward
    scores = q.float() @ k.transpose(1, 2)  # [heads, rows, n]
    if how.softcap is not None:
        scores.mul_(how.scale / how.softcap).tanh_().mul_(how.softcap)
    else:
        scores.mul_(how.scale)
    scores.masked_fill_(~seen, -math.inf)
    if sinks is None:
        return scores.softmax(-1) @ v
    joined = torch.cat((scores, sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)), dim=-1)
    return joined.softmax(-1)[..., :-1] @ v


def attention_sdpa(q, k, v, chunk, how, sinks=None):
    # q: [tokens, heads, D], k/v: [tokens, kv_heads, D]; causal SDPA per sequence, in blocks of query rows once a
    # sequence's scores would pass SDPA_SCORES. Unblocked, the start-up check and timing of this candidate peaked at
    # 5.6 GiB (texts up to 3000 tokens) and 38.8 GiB (8292) on the H200, the size of float32 scores: SDPA fell back
    # to its math backend there. They run while the weights fill the GPU. A window is an explicit mask; a softcap or
    # sinks ([heads]) go through softcapped_attention, the last resort of a model with either. In a prefix tree's chunk
    # (k/v: the wave's) a sequence's ancestors' keys come first, seen by every query row (within its window, by
    # depth).
    out = q.new_empty(*q.shape[:2], v.shape[2])
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    scale, written = own_scale(how, q.shape[2]), how.softcap is not None or sinks is not None
    for i, (s, e) in enumerate(zip(chunk.seq_bounds[:-1], chunk.seq_bounds[1:])):
        n, (keys, a) = e - s, chunk_keys(chunk, i, k)
        ks = k[keys].transpose(0, 1).repeat_interleave(group, dim=0)  # query head h reads kv head h // group
        vs = v[keys].transpose(0, 1).repeat_interleave(group, dim=0)
        if written:
            ks, vs = ks.float(), vs.float()
        rows = max(1, SDPA_SCORES // (heads * (a + n)))
        for r in range(0, n, rows):
            stop = min(r + rows, n)
            qs = q[s + r:s + stop].transpose(0, 1)  # [heads, rows, D]
            if stop - r == n and not a and how.window is None and not written:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            else:  # query r + i sees keys 0 .. a + r + i; blocks of one shape, so the allocator reuses its blocks
                seen = seen_keys(chunk, i, r, stop - r, keys, a, how.window, q.device)
                o = (softcapped_attention(qs, ks, vs, seen, how, sinks) if written else
                     F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=scale))
            out[s + r:s + stop] = o.transpose(0, 1)
    return out


def max_len_bucket(n):
    # flash-attn's Triton AMD kernels compile once per max_seqlen: round it up to a power of two (>= 128)
    return max(128, 1 << (n - 1).bit_length())


# The order decides where nothing was timed (no writable picks file): prefill's own kernel first, the fastest on the
# H200 and, on RDNA3, compiled spill-free for gfx1100, where flash-attn 2.8.3's default config spills (bench/results/primitives/2026-11-30-gfx1100-compile.json).
ATTENTION_KINDS = ["triton", "flash", "torch-flash", "cudnn", "sdpa"]
# Kinds offered only on some GPU families. cuDNN: torch's can_use_cudnn_attention returns false on every ROCm build
# ("#if defined(USE_ROCM) || !AT_CUDNN_ENABLED()", aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) and needs
# sm80-sm121 (check_cudnn_hardware_support there): it is never offered on AMD, and the start-up check refuses it where
# torch cannot run it.
ATTENTION_FAMILIES = {"cudnn": ("nvidia",)}
# What each kind computes besides causal GQA at the model's scale: a sliding window, a softcap of the scores (Gemma 2),
# a value head dim other than the query's and key's (DeepSeek's MLA: 128 to 192), sinks (gpt-oss: a logit a head in
# each row's softmax denominator). flash-attn has a window and a softcap (window_size, softcap); torch's flash kernel a
# window (window_size_left/right) but no softcap; cuDNN's SDPA neither; none of the three takes sinks
# (flash_attn_varlen_func 2.8.3, aten's _flash_attention_forward, SDPA: no such argument; their log-sum-exp could
# rescale each row, unbuilt). prefill's Triton kernels have window, softcap and sinks (constexpr variants); SDPA a
# window as a mask, a softcap and sinks through float32 math written out. Values of their own head dim: prefill's
# Triton kernels and SDPA read them as they are; flash-attn, torch's flash kernel and cuDNN take one head dim for q, k
# and v, so they get v zero-padded to it and their output cut back (v_padded: exact, the zero columns add nothing to
# any output column; 1.5x the value bytes and p·v FLOPs at 192 to 128). A kind a model needs more of is not offered.
ATTENTION_FEATURES = {"triton": {"window", "softcap", "sinks", "v_head_dim"},
                      "flash": {"window", "softcap", "v_head_dim"}, "torch-flash": {"window", "v_head_dim"},
                      "cudnn": {"v_head_dim"},
                      "sdpa": {"window", "softcap", "sinks", "v_head_dim"}}
# On AMD GPUs flash-attn is its Triton backend (the CK one builds for CDNA only), whose varlen_fwd of 2.8.3 takes
# window_size_left/right and softcap and never reads them (flash_attn/flash_attn_triton_amd/interface_fa.py at
# v2.8.3): plain causal attention where a window or softcap was asked for. Not offered for such a model there, rather
# than left to the sharp inputs of the start-up check (values zero-padded to q's head dim it computes as any kernel).
FEATURE_GAPS = {("flash", family): "flash-attn's Triton AMD varlen_fwd (2.8.3) ignores window_size and softcap"
                for family in ("rdna3", "amd")}
FAMILY_FEATURES = dict.fromkeys(FEATURE_GAPS, frozenset({"v_head_dim"}))


def attention_features(kind, family):
    return FAMILY_FEATURES.get((kind, family), ATTENTION_FEATURES[kind])


def attention_needs(cfg):
    # the features beyond causal GQA that some layer of the model needs
    return ({"window"} if any(how.window for how in cfg.attention) else set()) | \
        ({"softcap"} if any(how.softcap for how in cfg.attention) else set()) | \
        ({"sinks"} if any(how.sinks for how in cfg.attention) else set()) | \
        ({"v_head_dim"} if cfg.v_head_dim != cfg.head_dim else set())


def unoffered_attention(family, cfg):
    """{kind: why it is not offered for this model}: the kinds of this GPU family that lack a feature it needs."""
    needs = attention_needs(cfg)
    return {kind: f"has no {' or '.join(sorted(needs - attention_features(kind, family)))}, which this model needs"
            + (f" ({FEATURE_GAPS[kind, family]})" if (kind, family) in FEATURE_GAPS else "")
            for kind in ATTENTION_KINDS if family in ATTENTION_FAMILIES.get(kind, (family,))
            and not needs <= attention_features(kind, family)}


def latent_layout(q, k, v):
    # whether _attention_kernel's ROPE variant reads latent_qkv's q, k, v where they lie: k's and v's channels one
    # [tokens, heads, N + V] tensor (kv_b's output), q's N a head N + P apart, rows a multiple of 16 elements apart
    # (Triton specialises an integer on that: the start-up check, on other rows, compiles what the run launches), the
    # RoPE parts contiguous, k's one key for every head, N, P and V powers of two
    (T, heads, N), P, V = q.nope.shape, q.rope.shape[2], v.shape[2]
    kv = k.nope
    return (all(n & (n - 1) == 0 for n in (N, P, V)) and q.nope.stride()[1:] == (N + P, 1)
            and q.nope.stride(0) % 16 == 0 and kv.stride() == (heads * (N + V), N + V, 1) and v.stride() == kv.stride()
            and v.data_ptr() == kv.data_ptr() + N * kv.element_size() and q.rope.is_contiguous()
            and k.rope.is_contiguous() and k.rope.shape == (T, 1, P) and q.rope.shape == (T, heads, P))


def attention_triton(q, k, v, chunk, how, tile, sinks=None):
    # q: [tokens, heads, D], k: [tokens, kv_heads, D], v: [tokens, kv_heads, DV] -> [tokens, heads, DV]; one launch
    # per chunk, no per-sequence Python loop. The grid covers the longest sequence; shorter ones' surplus programs
    # exit at once. No recompilation per max_len. A window, a softcap and sinks ([heads]) are compile-time variants,
    # and head dims that are not powers of two (DeepSeek's 192) padded ones: a model without them runs the kernel it
    # ran before. Latent attention's q and k (Latent) are read unjoined where latent_layout holds (not in a prefix
    # tree's chunk: its kernel reads them joined)
    rope = (isinstance(q, Latent) and chunk.ancestors is None and not (how.window or how.softcap or sinks is not None)
            and latent_layout(q, k, v))
    if rope:
        (T, heads, D), P, DV = q.nope.shape, q.rope.shape[2], v.shape[2]
        out = q.nope.new_empty(T, heads, DV)
        grid = (triton.cdiv(chunk.max_len, tile[0]), len(chunk.seq_bounds) - 1, heads)
        _attention_kernel[grid](q.nope, k.nope, v, out, chunk.cu_seqlens, out, math.log2(math.e) * how.scale, 0, 1.0,
                                q.rope, k.rope, q.nope.stride(0), HEADS=heads, KV_HEADS=heads, D=D, DP=D, DV=DV,
                                DVP=DV, BLOCK_M=tile[0], BLOCK_N=tile[1], WINDOW=False, SOFTCAP=False, SINKS=False,
                                ROPE=P, num_warps=tile[2], num_stages=tile[3])
        return out
    q, k, v = joined(q, k, v)
    (T, heads, D), DV = q.shape, v.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert (sinks is not None) == how.sinks, "a layer's sinks are its attention settings'"
    block_m, block_n, warps, stages = tile
    assert block_m % block_n == 0  # the unmasked tiles must end exactly where the diagonal ones start
    out = q.new_empty(T, heads, DV)
    grid = (triton.cdiv(chunk.max_len, block_m), len(chunk.seq_bounds) - 1, heads)
    scale_log2, cap_log2 = math.log2(math.e) * how.scale, math.log2(math.e) * (how.softcap or 1.0)
    variant = dict(HEADS=heads, KV_HEADS=k.shape[1], D=D, DP=triton.next_power_of_2(D), DV=DV,
                   DVP=triton.next_power_of_2(DV), BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=how.window is not None,
                   SOFTCAP=how.softcap is not None, SINKS=how.sinks, num_warps=warps, num_stages=stages)
    sinks = q if sinks is None else sinks  # unread without SINKS
    if chunk.ancestors is not None:  # a prefix tree's chunk: k/v are the wave's; a program per KV head's group
        grid = (triton.cdiv(chunk.max_len * (heads // k.shape[1]), block_m), len(chunk.seq_bounds) - 1, k.shape[1])
        _tree_attention_kernel[grid](q, k, v, out, chunk.cu_seqlens, chunk.start, chunk.ancestor_bounds,
                                     chunk.ancestor_ranges, chunk.depths, sinks, scale_log2, how.window or 0,
                                     cap_log2, **variant)
        return out
    _attention_kernel[grid](q, k, v, out, chunk.cu_seqlens, sinks, scale_log2, how.window or 0, cap_log2, q, k, 0,
                            ROPE=0, **variant)
    return out


def v_padded(attend):
    # attend for a kind that takes one head dim for q, k and v (flash-attn, torch's flash, cuDNN), given v of
    # another: v zero-padded to q's head dim, the output's first v head dim channels kept (each output channel is p·v
    # of its own v column)
    def attend_padded(q, k, v, chunk, how):
        D, DV = q.shape[2], v.shape[2]
        if DV == D:
            return attend(q, k, v, chunk, how)
        return attend(q, k, F.pad(v, (0, D - DV)), chunk, how)[..., :DV]  # (v's is the smaller: DeepSeek's)
    return attend_padded


def backend_attention(kind, tile):
    # make_attention's backend by name, reading q, k, v whole (prefill's Triton kernel: Latent too)
    if kind == "sdpa":
        return attention_sdpa
    if kind == "flash":
        from flash_attn import flash_attn_varlen_func

        def attention_flash(q, k, v, chunk, how):
            n, scale = max_len_bucket(chunk.max_len), own_scale(how, q.shape[2])
            extra = dict(({"softmax_scale": scale} if scale else {}),
                         **({"window_size": (how.window - 1, 0)} if how.window else {}),  # j >= i - (window - 1)
                         **({"softcap": how.softcap} if how.softcap else {}))
            return flash_attn_varlen_func(q, k, v, chunk.cu_seqlens, chunk.cu_seqlens, n, n, causal=True, **extra)
        return v_padded(attention_flash)
    if kind == "triton":
        if triton is None:
            raise RuntimeError("triton is not installed")
        return lambda q, k, v, chunk, how, sinks=None: attention_triton(q, k, v, chunk, how, tile, sinks)
    if kind == "cudnn":
        # torch's cuDNN SDPA, one call per text, GQA without repeating the KV heads (enable_gqa). On the H200 it ran
        # 589-637 TFLOP/s on single 8k-32k texts against Triton's 456-476, but is launch-bound on short texts (48 on
        # eight 512-token texts against Triton's 234): hence the pick per length bucket.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attention_cudnn(q, k, v, chunk, how):
            out, scale = torch.empty_like(q), own_scale(how, q.shape[2])
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # this backend or an error, never a silent other one
                for s, e in zip(chunk.seq_bounds[:-1], chunk.seq_bounds[1:]):
                    o = F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                                                       is_causal=True, enable_gqa=True, scale=scale)  # [1, heads, n, D]
                    out[s:e] = o[0].transpose(0, 1)
            return out
        return v_padded(attention_cudnn)
    if kind == "torch-flash":
        # torch's own flash kernel, called directly: its varlen_attn wrapper (torch 2.11) has no GQA and would need
        # the KV heads repeated 8x, which cost 0.2 s of copies and attention per 45k-token request on the H200
        flash_forward = torch.ops.aten._flash_attention_forward

        def attention_torch_flash(q, k, v, chunk, how):
            cu, scale = chunk.cu_seqlens, own_scale(how, q.shape[2])
            extra = dict(({"scale": scale} if scale else {}),
                         **({"window_size_left": how.window - 1, "window_size_right": 0} if how.window else {}))
            return flash_forward(q, k, v, cu, cu, chunk.max_len, chunk.max_len, 0.0, True, False, **extra)[0]
        return v_padded(attention_torch_flash)
    raise UserError(f"unknown attention backend {kind!r}")


def make_attention(kind, tile=None):
    """An attention function (q, k, v, chunk, how) -> [tokens, heads, v's head dim] for the named backend. Latent
    attention's q and k (Latent) go to prefill's Triton kernel as they are, to the others joined."""
    attend = backend_attention(kind, tile)
    if kind == "triton":
        return attend
    return lambda q, k, v, chunk, how, **sinks: attend(*joined(q, k, v), chunk, how, **sinks)


def attention_inputs(device, cfg, lens, seed, latent=False):
    # random q, k, v for texts of the given lengths, drawn on the device (a 4096-token set is 42M values); latent (a
    # model with latent attention): laid out as latent_qkv leaves them (Latent q and k, v a view of one tensor with
    # k's other channels, the RoPE key every head's), so that the checks and timings run what a run launches
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    T = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE)
    if latent and cfg.kv_lora_rank:
        N, P, V = cfg.qk_nope_head_dim, cfg.rope_dim, cfg.v_head_dim
        kv = randn(T, heads, N + V)
        q, k, v = Latent(randn(T, heads, N + P)[..., :N], randn(T, heads, P)), Latent(kv[..., :N], randn(T, 1, P)), \
            kv[..., N:]
    else:
        q, k, v = (randn(T, h, D) for h, D in ((heads, cfg.head_dim), (kv_heads, cfg.head_dim),
                                               (kv_heads, cfg.v_head_dim)))
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    return q, k, v, Chunk(0, T, bounds, torch.tensor(bounds, dtype=torch.int32, device=device), max(lens))


# (BLOCK_M, BLOCK_N, warps, stages) offered for the attention kernel, per GPU family (gpu_family below).
# NVIDIA: on the H200 the first was the fastest of ten (bench/results/primitives/…-attention*.json; 128-row tiles were
# 13-120% slower), the second within 1% of it.
# RDNA3 (gfx11, wave32, 64 KB LDS): only tiles that compile without register spills there. Compiled for gfx1100
# without a GPU (bench/results/primitives/…-gfx1100-compile.json; Qwen3-32B, 0.6B alike), these two use 256 and 236
# VGPRs under Triton 3.9 (locked here) and 221 and 219 under 3.6, unspilled; with 4 warps they spilled 105 and 12
# VGPRs under 3.9 (none under 3.6), and the NVIDIA tiles spill 205 and 172.
# tests/test_gfx1100_compile.py compiles every kernel prefill can launch for gfx1100 and fails on a spill.
# Other AMD GPUs (CDNA wave64, RDNA4) get the RDNA3 tiles: small and single-stage, the safe side, unmeasured.
ATTENTION_TILES = {
    "nvidia": [(64, 64, 4, 2), (64, 32, 4, 2)],
    "rdna3": [(64, 32, 8, 1), (64, 16, 8, 1)],
    "cpu": [(64, 64, 4, 2), (64, 32, 4, 2)],  # Triton's interpreter (tests): the NVIDIA tiles
}


ATTENTION_TILES["amd"] = ATTENTION_TILES["rdna3"]


# RDNA3's tiles for the window and softcap variants: in 64-row tiles those spill under Triton 3.9 (window: 5-49 VGPRs,
# window and softcap: 5-48, Gemma 3 and Gemma 2 27B), these two do not (221-253 VGPRs). A head_dim over 128 (Gemma 3
# 4B-12B, Gemma 2 9B: 256) spills 190-560 VGPRs in every tile tried (16-64 rows), DeepSeek's 192 (in 256 lanes, v
# 128) 166-422 in these four and the two above, the tree kernel 208-406: the kernel is not offered there (SDPA,
# flash-attn with v zero-padded, torch's flash kernel are).
RDNA3_VARIANT_TILES = [(32, 16, 8, 1), (16, 16, 4, 1)]


RDNA3_MAX_HEAD_DIM = 128


def attention_tiles(family, cfg=None):
    # the Triton attention tiles offered for this GPU family and model (cfg None: plain causal attention)
    if family not in ("rdna3", "amd") or cfg is None:
        return ATTENTION_TILES[family]
    if cfg.head_dim > RDNA3_MAX_HEAD_DIM:
        return []
    return RDNA3_VARIANT_TILES if attention_needs(cfg) else ATTENTION_TILES[family]


# The tree kernel's tiles (_tree_attention_kernel: the ancestor loop keeps more live): on gfx1100 under Triton 3.9
# the 64x32 tile spills 54 VGPRs there (tests/test_gfx1100_compile.py), the 64x16 tile none; its window and softcap
# variants get the RDNA3 variant tiles of _attention_kernel, a head_dim over 128 none
TREE_ATTENTION_TILES = dict(ATTENTION_TILES, rdna3=[(64, 16, 8, 1)], amd=[(64, 16, 8, 1)])


def tree_attention_tiles(family, cfg=None):
    if family not in ("rdna3", "amd") or cfg is None or not (attention_needs(cfg) or cfg.head_dim > RDNA3_MAX_HEAD_DIM):
        return TREE_ATTENTION_TILES[family]
    return attention_tiles(family, cfg)


def gpu_arch(props):
    # "gfx1100" (ROCm: gcnArchName, e.g. "gfx1100:sramecc-:xnack-", torch/csrc/cuda/Module.cpp) or "sm_90" (CUDA,
    # where gcnArchName holds the device's name: seen on the H200)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def gpu_family(device):
    """'nvidia', 'rdna3', 'amd' (another AMD GPU) or 'cpu': which kernel configurations suit this device."""
    if device.type != "cuda":
        return "cpu"
    if torch.version.hip is None:
        return "nvidia"
    return "rdna3" if gpu_arch(torch.cuda.get_device_properties(device)).startswith("gfx11") else "amd"


def attention_candidates(requested, family, cfg=None, tiles=None):
    # (name, kind, tile) of each backend and Triton tile (those offered for this GPU family and model, cfg: None for
    # plain causal attention; tiles(family, cfg): the Triton kernel's, attention_tiles unless given) that `requested`
    # names: "auto", a kind, or a name that pick_attention returned (so that a second Runner can use exactly that
    # kernel)
    needs = attention_needs(cfg) if cfg is not None else set()
    named = [(kind if tile is None else f"{kind} {tile[0]}x{tile[1]}", kind, tile)
             for kind in ATTENTION_KINDS if family in ATTENTION_FAMILIES.get(kind, (family,))
             and needs <= attention_features(kind, family)
             for tile in ((tiles or attention_tiles)(family, cfg) if kind == "triton" else [None])]
    chosen = [c for c in named if requested in ("auto", c[0], c[1])]
    if not chosen and cfg is not None and requested in unoffered_attention(family, cfg):
        raise UserError(f"attention backend {requested!r} {unoffered_attention(family, cfg)[requested]}")
    if not chosen and requested in ATTENTION_KINDS:
        raise UserError(f"attention backend {requested!r} is not offered on this GPU family ({family})"
                        + (f" for head_dim {cfg.head_dim}" if cfg is not None and requested == "triton" else ""))
    if not chosen:
        raise UserError(f"unknown attention backend {requested!r}")
    return chosen


# ----------------------------------------------------------------------------- mixture of experts
# The feed-forward of Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3 (transformers 5.24, models/*/modeling_*.py),
# beside mlp_block: the same layer, streamer and plan, the experts part of a layer's flat bytes
# (ModelConfig.mlp_tensors). The router (mlp.gate) picks each token's top-k experts and weighs them as the model's
# Router says (route: softmax or DeepSeek-V3's sigmoid), the weights cast to bf16 for the combination. Each expert is a
# SwiGLU MLP moe_intermediate_size wide, no bias. Shared experts (DeepSeek-V3, GLM, Qwen2-MoE) run beside them as one
# plain gated MLP, their output (Qwen2-MoE: gated) added to the routed experts' bf16 sum before the residual, as
# transformers adds them. The loss is the language-modelling loss alone: HF's .loss adds the router's auxiliary loss
# only when output_router_logits is set, and prefill never adds it.
#
# Deviation: transformers keeps Mixtral's and the sigmoid router's weights in float32 into the experts' weighted sum
# (Qwen's it casts to bf16 first, as here); prefill's combination takes bf16 weights, a relative 2^-9 on a weight.
#
# Here a chunk's (token, slot) pairs are sorted by expert, stably, the experts run as two grouped GEMMs over those rows
# (gate_up, then down), and each token's k outputs, in ascending expert order, are weighted and summed in float32 (one
# batched GEMM, or the fused Triton kernel that gathers the rows as it reads them: Kernels.combine) and rounded to bf16
# once. transformers 5.24 runs its "grouped_mm" experts by default
# (integrations/moe.py: a float32 sum over the slots in top-k order, each weighted output first rounded to bf16); its
# "eager" experts add in expert order into a bf16 tensor with index_add_, one rounding per expert. Every output row
# here is written by one program and every sum has an order fixed by its shape: no atomics, the same bits every run.
#
# gpt-oss (models/gpt_oss) differs in three places, each chosen by a config field: its router (mlp.router) has a bias
# and keeps each token's top-k logits, then softmaxes those (router "topk_softmax"); its experts are fused as
# transformers holds them, [experts, in, out] (fused_experts: read through strides, see layer_views), gate and up
# interleaved in gate_up's columns, with a bias on each projection, added to each row in bf16 as transformers'
# grouped_mm experts add it (out.add_(bias)); the activation between them is a ClampedSwiGLU.

def route_softmax(h, w, router):
    # Qwen3-MoE's, Qwen2-MoE's, Mixtral's: h [tokens, hidden] -> (weights [tokens, k] float32, experts [tokens, k])
    logits = F.linear(h, w.router)  # [tokens, experts], in bf16 as transformers
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, router.top_k, dim=-1)
    if router.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, chosen


def route_sigmoid(h, w, router):
    # DeepSeek-V3's and GLM-4.5's (DeepseekV3TopkRouter), step by step in float32: h [tokens, hidden] -> (weights
    # [tokens, k] float32, experts [tokens, k]). topk unsorted as there: which of two tied scores it keeps is its own rule
    scores = F.linear(h.float(), w.router).sigmoid()  # [tokens, experts]: the router is held in float32
    biased = scores + w.router_bias  # the correction bias decides the choice, never the weights
    if router.topk_group < router.n_group:  # (every group kept: the mask would change nothing)
        groups = biased.view(h.shape[0], router.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, groups]
        best = groups.topk(router.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, best, True)
        biased = biased.masked_fill(~kept.repeat_interleave(biased.shape[1] // router.n_group, dim=1), -math.inf)
    chosen = torch.topk(biased, router.top_k, dim=-1, sorted=False)[1]
    top = scores.gather(1, chosen)
    if router.renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.scale, chosen


def route_topk_softmax(h, w, router):
    # gpt-oss's (GptOssTopKRouter): h [tokens, hidden] -> (weights [tokens, k] float32, experts [tokens, k]). The top-k
    # of the bf16 logits (the router's bias added), then their softmax, computed in float32 and rounded to bf16 once
    # (by route): transformers' F.softmax(top, dtype=bf16) upcasts inside the kernel the same way (one rounding of
    # float32 math); the float32 oracle differs only in that last rounding
    top, chosen = torch.topk(F.linear(h, w.router, w.router_bias), router.top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32), chosen


ROUTES = {"softmax": route_softmax, "sigmoid": route_sigmoid, "topk_softmax": route_topk_softmax}


def route(h, w, router):
    # h: [tokens, hidden] -> (weights [tokens, k] in h's dtype, experts [tokens, k] int64, each row's experts ascending),
    # by the model's Router (w: the layer's LayerWeights: its router and its router_bias, the sigmoid one's correction
    # bias or gpt-oss's bias)
    top, chosen = ROUTES[router.kind](h, w, router)
    chosen, slot = chosen.sort(dim=-1)  # the order the outputs are summed in
    return top.gather(1, slot).to(h.dtype), chosen


# route's chain after the router's GEMM (softmax, top-k, renormalisation, sort, gather, cast: ~0.03 s of Qwen3-30B-A3B's
# 0.63 s contest request on the H200, torch.topk 0.016 s of it; docs/performance.md) as one Triton kernel, for the
# router kinds whose math is a softmax and a top-k; the sigmoid router's stays route's. It ranks the experts as
# torch.topk ranks route's: by the float32 probabilities (gpt-oss: the logits), ties to the lowest index. That is
# CUDA's rule for a slice this short (pytorch/pytorch@6ed5926 aten/src/ATen/native/cuda/TensorTopK.cu,
# sbtopk::gatherTopK: the values above the k-th, then those equal to it in index order; should_use_multiblock never
# takes fewer than 400 experts) and ROCm's where hipCUB has a warp merge sort (warptopk: a stable sort, slices up to
# 256); ROCm's sbtopk reserves the tied ones' slots by atomics, warp by warp (which tie wins may vary run to run),
# and the CPU's topk keeps others (a partial sort's order): the start-up check (route_checks) plants ties at the k-th
# place and refuses the kernel wherever this device's torch.topk keeps other experts. The numbers: the same float32
# steps in the same places, each division rounded as IEEE's (div_rn, as CUDA's), the weights rounded to bf16 once,
# where route casts; only exp (Triton's against CUDA's expf or the CPU's vectorised one) and the order of the two
# sums differ, a float32 ulp or so, which moves a weight's bf16 rounding by one ulp in rare rows (none of 1,920 in
# test_moe's interpreted cases; route_checks allows CHECK_TOLERANCE). Two distinct logits at the k-th place whose
# differences from the row's largest are a few float32 ulps apart (both below ~2^-16 of it) could rank otherwise.

FUSED_ROUTERS = ("softmax", "topk_softmax")  # route_triton's kinds
ROUTE_ELEMENTS = 1024  # logits a program holds: tokens of next_power_of_2(experts), 8 of Qwen3-MoE's 128

if triton is not None:
    @triton.jit(do_not_specialize=["tokens"])
    def _route_kernel(logits_ptr, weights_ptr, experts_ptr, tokens, n_experts, K: tl.constexpr, BLOCK: tl.constexpr,
                      ROWS: tl.constexpr, TOPK_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
        # ROWS tokens' logits [tokens, n_experts] (bf16) -> each token's K experts ascending (int64) and their weights
        # (bf16 bits, int16). softmax (TOPK_FIRST false): max, exp, sum, the probabilities; the K most probable; their
        # probabilities, renormalised (divided by their sum) when RENORMALIZE. TOPK_FIRST (gpt-oss): the K largest
        # logits, their softmax. The row's experts padded to BLOCK with -inf: probability 0, ranked below every expert
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        idx = tl.arange(0, BLOCK)[None, :]
        row_ok = rows < tokens
        x = tl.load(logits_ptr + tl.minimum(rows, tokens - 1).to(tl.int64) * n_experts + idx, mask=idx < n_experts,
                    other=float("-inf")).to(tl.float32)  # [ROWS, BLOCK]; rows past the end reread the last one
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        if TOPK_FIRST:
            key = x
        else:
            e = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
            key = e
        # a NaN ranks first, as in topk's order (and every row takes K distinct experts, whatever its values)
        key = tl.where(idx < n_experts, tl.where(key == key, key, float("inf")), float("-inf"))
        taken = tl.zeros((ROWS, BLOCK), tl.int1)
        for _ in tl.static_range(K):  # the largest untaken, the lowest index among equals
            free = tl.where(taken, float("-inf"), key)
            best = tl.max(free, axis=1)[:, None]
            first = tl.min(tl.where((free == best) & ~taken, idx, BLOCK), axis=1)[:, None]
            taken = taken | (idx == first)
        w = tl.where(taken, e, 0.0)
        if TOPK_FIRST or RENORMALIZE:
            w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None])
        # each taken expert to its slot in index order: K stores a row, each to its own place, no atomics
        at = rows.to(tl.int64) * K + tl.cumsum(taken.to(tl.int32), axis=1) - 1
        keep = taken & row_ok
        tl.store(experts_ptr + at, tl.broadcast_to(idx, (ROWS, BLOCK)).to(tl.int64), mask=keep)
        # rounded to bf16 by its bits, to nearest even (the weights are finite or NaN): the same on every backend and
        # in the interpreter, whose casts truncate
        bits = w.to(tl.int32, bitcast=True)
        tl.store(weights_ptr + at, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=keep)


def route_triton(h, w, router):
    """route, its chain after the router's GEMM fused in _route_kernel for the FUSED_ROUTERS in bf16 (Kernels.route of
    TRITON_KERNELS); route itself for the others."""
    if router.kind not in FUSED_ROUTERS or h.dtype != torch.bfloat16:
        return route(h, w, router)
    logits = F.linear(h, w.router, w.router_bias if router.kind == "topk_softmax" else None)  # [tokens, experts]
    (T, E), k = logits.shape, router.top_k
    weights = torch.empty(T, k, dtype=h.dtype, device=h.device)
    experts = torch.empty(T, k, dtype=torch.int64, device=h.device)
    block = triton.next_power_of_2(E)
    rows = max(1, ROUTE_ELEMENTS // block)
    _route_kernel[(triton.cdiv(T, rows),)](logits, weights.view(torch.int16), experts, T, E, K=k, BLOCK=block,
                                           ROWS=rows, TOPK_FIRST=router.kind == "topk_softmax",
                                           RENORMALIZE=router.renormalize, num_warps=4)
    return weights, experts


TORCH_KERNELS.route, TRITON_KERNELS.route = lambda *a: route(*a), route_triton  # late-bound, as TORCH_KERNELS' others


def expert_rows(chosen, num_experts):
    # chosen: [tokens, k] -> (pairs [tokens * k]: the flat (token, slot) index of each row, grouped by expert and by
    # token within an expert; bounds [experts + 1] int64: expert e's rows are bounds[e]:bounds[e + 1]). No atomics: the
    # bounds are searched for in the sorted experts, not counted. The keys are int16 where the experts fit: CUDA's
    # radix sort makes a pass per 8 bits of key (8 a slice for int64 keys in the H200's profile,
    # …-contest-48gib@84eaeaf), and a stable sort's order does not depend on the keys' width.
    keys = torch.int16 if num_experts < 2**15 else torch.int32
    flat = chosen.flatten().to(keys)
    pairs = torch.argsort(flat, stable=True)
    experts = torch.arange(num_experts + 1, device=chosen.device, dtype=keys)
    return pairs, torch.searchsorted(flat[pairs], experts)


def pair_rows(pairs):
    # pairs: [tokens * k], a permutation -> its inverse: the row each (token, slot) pair's output went to. A scatter
    # of unique indices: no sort, and no two writes to one place
    return torch.empty_like(pairs).scatter_(0, pairs, torch.arange(pairs.numel(), device=pairs.device))


def biased(rows, bias, experts):
    # rows [rows, n] += each row's expert's bias [experts, n] (experts: [rows]), in bf16 as transformers' grouped_mm
    # experts add it (out.add_(bias[expert_ids])); no bias: rows as they are
    if bias is not None:
        rows += bias[experts]
    return rows


def moe_ffn(x, h, w, router, experts, kernels):
    # x: [tokens, hidden] += the experts' weighted sum over h: [tokens, hidden], the post-attention norm's output, as
    # router (a Router) routes it (kernels.route: route, or route_triton); returns x. experts(x, h, weights, chosen,
    # w, kernels) is the expert compute picked at start-up (pick_experts: grouped_experts over a grouped GEMM, or
    # fused_experts).
    weights, chosen = kernels.route(h, w, router)
    experts(x, h, weights, chosen, w, kernels)
    return x


def shared_experts(h, w, kernels):
    # h: [tokens, hidden] -> the shared experts' output [tokens, hidden]: one gated MLP (V3, GLM: n_shared_experts as
    # one, moe_intermediate_size wide each), Qwen2-MoE's times sigmoid(h · shared_expert_gate), in bf16 as transformers
    out = gated_mlp(h, w.shared_gate_up, w.shared_down, "silu", kernels)
    if w.shared_gate is not None:
        out *= torch.sigmoid(F.linear(h, w.shared_gate))  # [tokens, 1]
    return out


def moe_block(x, w, cfg, max_tokens, kernels, experts):
    # x: [tokens, hidden], updated in place in slices of max_tokens rows (the plan's moe_chunk_tokens): the routing
    # buffers hold max_tokens * num_experts_per_tok rows (moe_scratch_per_token), whatever the wave
    for s in range(0, x.shape[0], max_tokens):
        xs = x[s:s + max_tokens]
        h = kernels.rms_norm(xs, w.mlp_norm, cfg.rms_norm_eps, cfg.norm_style)
        if w.shared_gate_up is None:
            moe_ffn(xs, h, w, cfg.router, experts, kernels)
        else:  # transformers adds the shared experts to the routed ones' bf16 sum, that to the residual
            out = moe_ffn(torch.zeros_like(xs), h, w, cfg.router, experts, kernels)
            out += shared_experts(h, w, kernels)
            xs += out


@dataclass
class FP8Experts:
    """FP8 experts (fp8_experts) as grouped_loop reads them, the fallback of the fused experts' FP8 variant: expert
    e's bf16 weights [N, K], dequantized by dequantize_fp8 when indexed, projection by projection (gate_up: the gate's
    rows then the up's, each with its own grid of scales), so that each GEMM multiplies the very bf16 weights the
    layer's dequantization would have made: the loop's bits on them. One expert's bf16 copy at a time (DeepSeek-V3's
    gate_up: 59 MB, its float32 temporaries as dequantize_fp8's)."""
    q: torch.Tensor       # [experts, N, K] float8_e4m3fn
    scales: torch.Tensor  # [experts, parts cdiv(N / parts, FP8_BLOCK), cdiv(K, FP8_BLOCK)] float32
    parts: int            # projections stacked in N: gate_up 2, down 1

    @property
    def shape(self):
        return self.q.shape

    def __getitem__(self, e):
        out = torch.empty(self.q.shape[1:], dtype=DTYPE, device=self.q.device)
        for q, scales, part in zip(self.q[e].chunk(self.parts), self.scales[e].chunk(self.parts),
                                   out.chunk(self.parts)):
            dequantize_fp8(q, scales, part)
        return out


def grouped_experts(grouped, activation="silu"):
    """moe_ffn's experts over a grouped GEMM grouped(a [rows, K] grouped by expert, w [experts, N, K], bounds) ->
    [rows, N]: the (token, slot) rows sorted by expert and gathered, gate_up (plus each row's expert's bias, where the
    experts have biases: gpt-oss), the activation (the model's expert_activation), down (and its bias), and each
    token's k rows weighted and summed into x (Kernels.combine). Each buffer is dropped as soon as the next step has
    read it. FP8 experts (w's gate_up_scales, fp8_experts) are handed over as FP8Experts, which grouped_loop alone
    reads (expert_candidates offers no other grouped GEMM for them)."""
    def experts(x, h, weights, chosen, w, kernels):
        pairs, bounds = expert_rows(chosen, w.gate_up.shape[0])
        rows = None if w.gate_up_bias is None else chosen.flatten()[pairs]  # gpt-oss: each row's expert, for its biases
        gate_up, down = (w.gate_up, w.down) if w.gate_up_scales is None else (
            FP8Experts(w.gate_up, w.gate_up_scales, 2), FP8Experts(w.down, w.down_scales, 1))
        act = kernels.gated_act(biased(grouped(h[pairs // chosen.shape[1]], gate_up, bounds), w.gate_up_bias, rows),
                                activation)  # [rows, inter]
        kernels.combine(x, biased(grouped(act, down, bounds), w.down_bias, rows), pair_rows(pairs), weights)
    return experts


# --- expert compute: the grouped GEMM out[rows of e] = a[rows of e] @ w[e].T for every expert e

def grouped_loop(a, w, bounds):
    # the fallback: one GEMM per expert that has rows (a host sync for the bounds)
    out = a.new_empty(a.shape[0], w.shape[1])
    ends = bounds.tolist()
    for e, (s, t) in enumerate(zip(ends[:-1], ends[1:])):
        if t > s:
            torch.mm(a[s:t], w[e].t(), out=out[s:t])
    return out


if triton is not None:
    @triton.jit
    def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, N, K, w_stride,
                             w_stride_n, w_stride_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        # one program: BLOCK_M rows of one expert (tile_expert, -1 past the last tile) times BLOCK_N columns of its
        # weights; a: [rows, K], w: [experts, N, K] (strides w_stride, w_stride_n, w_stride_k: K-contiguous, or
        # gpt-oss's N-contiguous view), out: [rows, N]. Rows past the expert's end belong to the next expert: masked.
        tile, n_block = tl.program_id(0), tl.program_id(1)
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= 0:
            rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
            cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            row_ok = rows[:, None] < tl.load(bounds_ptr + expert + 1)
            col_ok = cols[None, :] < N
            a_at = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
            w_at = (w_ptr + expert.to(tl.int64) * w_stride + cols[None, :].to(tl.int64) * w_stride_n
                    + ks[:, None] * w_stride_k)  # [BLOCK_K, BLOCK_N]
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_at, mask=row_ok, other=0.0)
                    b = tl.load(w_at, mask=col_ok, other=0.0)
                else:
                    a = tl.load(a_at, mask=row_ok & (k0 + ks[None, :] < K), other=0.0)
                    b = tl.load(w_at, mask=col_ok & (k0 + ks[:, None] < K), other=0.0)
                acc = tl.dot(a, b, acc)
                a_at += BLOCK_K
                w_at += BLOCK_K * w_stride_k
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok & col_ok)


def expert_tiles(bounds, block_m, rows):
    # bounds [experts + 1] -> (tile_expert, tile_row) int32 for cdiv(rows, block_m) + experts programs, which is at
    # least the tiles needed: each expert's rows in tiles of block_m, the expert (-1 for the surplus programs) and
    # first row of each. On the device, with no host sync.
    E = bounds.shape[0] - 1
    tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m  # [experts]
    ends = tiles.cumsum(0)
    t = torch.arange(-(-rows // block_m) + E, device=bounds.device)
    expert = torch.searchsorted(ends, t, right=True)
    e = expert.clamp(max=E - 1)
    row = bounds[e] + (t - ends[e] + tiles[e]) * block_m
    return torch.where(expert < E, e, -1).to(torch.int32), row.to(torch.int32)


def grouped_triton(a, w, bounds, tile):
    block_m, block_n, block_k, warps, stages = tile
    (R, K), N = a.shape, w.shape[1]
    assert a.is_contiguous() and (w.stride(2) == 1 and w.stride(1) == K or w.stride(1) == 1 and w.stride(2) == N)
    out = torch.empty((R, N), dtype=a.dtype, device=a.device)
    tile_expert, tile_row = expert_tiles(bounds, block_m, R)
    _grouped_gemm_kernel[(tile_expert.shape[0], triton.cdiv(N, block_n))](
        a, w, out, tile_expert, tile_row, bounds, N, K, w.stride(0), w.stride(1), w.stride(2), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages)
    return out


def grouped_mm_native(device):
    # whether torch's bf16 grouped GEMM is one kernel on this GPU, read in _grouped_mm_cuda
    # (aten/src/ATen/native/cuda/GroupedBlas.cpp, pytorch 00d4eaf): on CUDA, CUTLASS's kernel where
    # _scaled_mm_allowed_device(sm90_only, sm100_only) holds, compute capability 9.x or 10.x (not 8.x, not 12.x); on
    # ROCm, CK's group_gemm_ck on gfx942 and gfx950 in a build with USE_ROCM_CK_GEMM, and in torch 2.10 only with
    # ROCM_ALLOW_GROUP_GEMM_CK=1 (pytorch#171140, the release/2.10 cherry-pick of #170159: "not performant yet").
    # Everywhere else, a gfx1100 included, it is _grouped_mm_fallback (ATen/native/GroupedMMUtils.h, ROCm's since
    # pytorch#162419): the offsets copied to the host, then one mm per group, the loop candidate's work with a sync.
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return gpu_arch(props) in ("gfx942", "gfx950") and os.environ.get("ROCM_ALLOW_GROUP_GEMM_CK") == "1"
    return props.major in (9, 10)


# --- fused experts: the tokens aligned once per expert, two GEMMs that read and write through those ids, one sum.
# vLLM's fused_moe (model_executor/layers/fused_moe/fused_moe.py) in outline, read, not copied: each expert's
# (token, slot) rows are numbered into blocks of BLOCK_M rows, one expert a block, its last block padded
# (align_experts: moe_align_block_size's job, here a count and a prefix sum instead of atomics); the gate+up GEMM reads
# its rows of h through those ids (no gathered copy) and writes act(gate)·up once, not the [rows, 2 moe_intermediate]
# that vLLM's silu_and_mul rereads; the down GEMM writes each row at its own (token, slot) row, unweighted (vLLM
# weights it in the epilogue, MUL_ROUTED_WEIGHT); a last launch sums each token's k rows times their routing weights
# (moe_sum) in slot order, which route makes ascending expert order, in float32, rounds once and adds them to x. Every
# row is written by one program and every sum has a fixed order: no atomics. The integers that vary with the texts or
# that the start-up check takes smaller than a run (tokens, k, experts) are not specialised on, so that the check
# compiles what the run launches. The weights are read through strides (w_col, w_k, up_at), or by TMA over their
# contiguous side. gpt-oss's experts are three constexprs of the same two kernels: their [experts, K, N] storage (a
# transposed view, N-contiguous: KN, TMA blocks of [BLOCK_K, BLOCK_N]), gate and up interleaved in gate_up's columns
# (CLAMPED: one GEMM over 2 BLOCK_N adjacent columns, split into gate and up in the epilogue, as OpenAI's triton_kernels
# swiglu splits them, then the ClampedSwiGLU) and a bias on each GEMM (BIAS: added in the epilogue). Block-wise FP8
# experts are a fourth (FP8: each weight tile dequantized as it is loaded, to dequantize_fp8's bf16 values; issue 37's
# measurement, bench/fp8_experts.py), offered only where the plan holds the experts FP8 (held_experts_config).
#
# The roundings are the grouped path's (grouped_experts with combine): gate and up rounded to bf16, SiLU rounded, its
# product with up rounded, as gated_act; the down GEMM's output rounded, then weighted in float32 in the sum, rounded
# once, then the add. gpt-oss's epilogues round where transformers' bf16 steps do: each GEMM's output, its bias added,
# each step of the ClampedSwiGLU. transformers' bf16 experts (integrations/moe.py) also round each weighted row before
# their float32 sum: prefill does not, one rounding fewer against the float32 oracle. With the weight in the down
# GEMM's epilogue, as vLLM, each product was rounded too: gpt-oss's tiny experts were 1.6e-3 from float32 math in
# float16 (tests/test_fused_moe.py), now 1.1e-3 and in most tiles the grouped path's bits; the same bytes move.

ALIGN_CHUNK = 512   # (token, slot) entries a program of align_experts reads and places
ALIGN_EXPERTS = 32  # experts it handles at a time at most ([ALIGN_CHUNK, ALIGN_EXPERTS] comparisons): the model's
#                     experts' power of two below that. On the H200, of 24 launch configurations (bench/align_sweep.py,
#                     primitives/2026-12-04-h200-align-sweep@742d573.json), 32 at 512 a chunk placed a 16,384-token
#                     slice fastest for six of the seven families' shapes (Qwen3-30B-A3B 71 us, from 91 at 16;
#                     DeepSeek-V3 132 from 173), and Mixtral's 8 experts fastest at 8 (9.1 us, from 11.4)
ALIGN_BLOCKS = 16   # blocks it labels at a time
ALIGN_SCAN = 64     # chunks' counts the running sum adds up at a time

try:  # the fused experts' TMA loads of their weights (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

if triton is not None:
    @triton.jit(do_not_specialize=["rows", "experts"])
    def _moe_count_kernel(chosen_ptr, counts_ptr, rows, experts, CHUNK: tl.constexpr, EB: tl.constexpr):
        # counts[b, e]: how many of chunk b's CHUNK entries of chosen (flat, [rows]) are expert e
        b = tl.program_id(0)
        at = b * CHUNK + tl.arange(0, CHUNK)
        chosen = tl.load(chosen_ptr + at, mask=at < rows, other=-1).to(tl.int32)
        for e0 in range(0, experts, EB):
            e = e0 + tl.arange(0, EB)
            tl.store(counts_ptr + b * experts + e, tl.sum((chosen[:, None] == e[None, :]).to(tl.int32), 0),
                     mask=e < experts)

    @triton.jit(do_not_specialize=["chunks", "experts"])
    def _moe_scan_kernel(counts_ptr, ends_ptr, chunks, experts, CB: tl.constexpr, EB: tl.constexpr):
        # ends[:, e] = counts[:, e] summed over the chunks up to each, for program p's EB experts, CB chunks at a time
        # (integers: the same whatever order adds them). torch's cumsum over the [chunks, experts] counts took 44 us a
        # Qwen3-30B-A3B slice on the H200 (256 x 128), a third of the alignment
        # (bench/results/profiles/2026-12-03-h200-q30-120-4096@7be7096.json)
        e = tl.program_id(0) * EB + tl.arange(0, EB)
        carry = tl.zeros((EB,), tl.int32)
        for c0 in range(0, chunks, CB):
            c = c0 + tl.arange(0, CB)
            at = c[:, None] * experts + e[None, :]
            mask = (c[:, None] < chunks) & (e[None, :] < experts)
            counts = tl.load(counts_ptr + at, mask=mask, other=0)
            tl.store(ends_ptr + at, tl.cumsum(counts, 0) + carry[None, :], mask=mask)
            carry += tl.sum(counts, 0)

    @triton.jit(do_not_specialize=["rows", "experts", "chunks", "blocks"])
    def _moe_align_kernel(chosen_ptr, ends_ptr, ids_ptr, block_expert_ptr, rows, experts, chunks, blocks,
                          CHUNK: tl.constexpr, EB: tl.constexpr, JB: tl.constexpr, BLOCK_M: tl.constexpr):
        # Program b places chunk b's entries: expert e's rows start at start[e] (the padded counts of the experts
        # before it, summed), chunk b's after those of the chunks before it (before[e]), in entry order within the
        # chunk (a cumulative sum of its matches). ends [chunks, experts]: the counts summed over the chunks up to
        # each (its last row: the totals), so that a program reads two rows of them, not every chunk's counts (which
        # made the launch grow as the square of the rows: 0.5 ms for 362k rows on the H200, 0.1 ms for 131k). It also
        # labels its share of the blocks: each with its expert (-1 past the last), the padding rows of an expert's last
        # block with the id `rows` (no entry).
        b = tl.program_id(0)
        at = b * CHUNK + tl.arange(0, CHUNK)
        chosen = tl.load(chosen_ptr + at, mask=at < rows, other=-1).to(tl.int32)
        share = tl.cdiv(blocks, chunks)
        j_end = tl.minimum(b * share + share, blocks)
        base = tl.sum(tl.zeros((EB,), tl.int32), 0)  # rows of the experts before e0 (an int32 the loop carries)
        for e0 in range(0, experts, EB):
            e = e0 + tl.arange(0, EB)
            total = tl.load(ends_ptr + (chunks - 1) * experts + e, mask=e < experts, other=0)
            before_at = (b - 1) * experts + e  # chunk b - 1's (none before chunk 0)
            before = tl.load(ends_ptr + before_at, mask=(e < experts) & (before_at >= 0), other=0)
            padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            start = base + tl.cumsum(padded, 0) - padded
            base += tl.sum(padded, 0)
            hit = chosen[:, None] == e[None, :]  # [CHUNK, EB]
            row = tl.cumsum(hit.to(tl.int32), 0) - 1 + (start + before)[None, :]
            tl.store(ids_ptr + tl.sum(tl.where(hit, row, 0), 1), at, mask=tl.max(hit.to(tl.int32), 1) > 0)
            for j0 in range(b * share, j_end, JB):
                j = j0 + tl.arange(0, JB)
                first = (j * BLOCK_M)[:, None]
                own = (first >= start[None, :]) & (first < (start + padded)[None, :]) & (j < j_end)[:, None]
                owned = tl.max(own.to(tl.int32), 1) > 0  # [JB]
                tl.store(block_expert_ptr + j, tl.sum(tl.where(own, e[None, :], 0), 1), mask=owned)
                pad = tl.sum(tl.where(own, (start + total)[None, :], 0), 1)  # the owner's first padding row
                r = first + tl.arange(0, BLOCK_M)[None, :]  # [JB, BLOCK_M]
                tl.store(ids_ptr + r, tl.zeros_like(r) + rows, mask=owned[:, None] & (r >= pad[:, None]))
        for j0 in range(b * share, j_end, JB):
            j = j0 + tl.arange(0, JB)
            tl.store(block_expert_ptr + j, tl.zeros_like(j) - 1, mask=(j < j_end) & (j * BLOCK_M >= base))

    @triton.jit
    def _moe_tile_of(blocks, group_m, N, BLOCK_N: tl.constexpr):
        # this program's (block of rows, block of columns): group_m blocks of rows side by side, so that programs
        # running together share the same columns of weights (an order of the programs alone: a runtime integer)
        pid, width = tl.program_id(0), group_m * tl.cdiv(N, BLOCK_N)
        first = pid // width * group_m
        size = tl.minimum(blocks - first, group_m)
        return first + pid % width % size, pid % width // size

    @triton.jit
    def _moe_rows(block_expert_ptr, ids_ptr, blocks, group_m, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # this program's expert (-1: none), its block's rows and their ids (align_experts'), its block of columns and
        # the first of them
        m_block, n_block = _moe_tile_of(blocks, group_m, N, BLOCK_N)
        expert = tl.load(block_expert_ptr + m_block)
        r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(ids_ptr + r, mask=tl.zeros_like(r) + expert >= 0, other=0)  # -1: no ids written there
        return expert, r, ids, n_block * BLOCK_N + tl.arange(0, BLOCK_N), n_block * BLOCK_N

    @triton.jit
    def _moe_weights_at(w, start, cols, N, w_col, w_k, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
        # the pointers of a program's [BLOCK_K, BLOCK_N] weights from k = 0: column c's K weights from w + start +
        # c·w_col in steps of w_k (columns past N read c % N, not stored); with TMA, start (an integer the loop steps
        # for nothing: the descriptor's row and k0 address the tile)
        if TMA:
            at = start
        else:
            at = w + start + (cols % N)[None, :].to(tl.int64) * w_col + tl.arange(0, BLOCK_K)[:, None] * w_k
        return at

    @triton.jit
    def _moe_weight_tile(w, at, row, col, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                         KN: tl.constexpr):
        # the [BLOCK_K, BLOCK_N] weights from k0 of the columns from col: with TMA, w a TensorDescriptor over the
        # weights as rows of K, the expert's first row at row (loads past its sides read zeros; past an expert's N the
        # next rows, whose columns are not stored), or (KN) over their storage's rows of N, [experts · K, N] (gpt-oss's
        # [experts, in, out]), the expert's first at row (past its K, where BLOCK_K does not divide it, the next
        # expert's rows, multiplied by the zeros of a's masked columns: finite weights add nothing); else from the
        # pointers at (_moe_weights_at's, stepped to k0 by the caller)
        if TMA and KN:
            tile = w.load([row + k0, col])
        elif TMA:
            tile = w.load([row + col, k0]).T
        elif EVEN_K:
            tile = tl.load(at)
        else:
            tile = tl.load(at, mask=k0 + tl.arange(0, BLOCK_K)[:, None] < K, other=0.0)
        return tile

    @triton.jit
    def _moe_scales_at(s_ptr, expert, cols, N, K, PARTS: tl.constexpr, FP8: tl.constexpr):
        # FP8 weights' scales, [experts, PARTS cdiv(N, FP8), cdiv(K, FP8)] float32, contiguous (gate+up: PARTS 2, the
        # gate's rows of blocks then the up's, each projection's grid as its checkpoint holds it): the pointers to each
        # column's row of them [BLOCK_N], and the distance from a gate column's row to its up column's. FP8 0 (bf16
        # weights): none (s_ptr, 0), nothing computed
        if FP8:
            kb, nb = tl.cdiv(K, FP8), tl.cdiv(N, FP8)
            return s_ptr + expert.to(tl.int64) * (PARTS * nb * kb) + (cols % N) // FP8 * kb, nb * kb
        else:
            return s_ptr, 0

    @triton.jit
    def _moe_dequantized(tile, s_at, k0, dtype: tl.constexpr, FP8: tl.constexpr):
        # FP8 (the scales' block side: FP8_BLOCK): a [BLOCK_K, BLOCK_N] tile of float8_e4m3fn weights from k0 times
        # each column's float32 scale of that block of K (s_at: _moe_scales_at's), rounded to dtype to nearest even:
        # dequantize_fp8's values, so that the GEMM multiplies the very bf16 weights the layer's dequantization writes
        # (BLOCK_K divides FP8, moe_gate_up and moe_down assert it: a tile lies in one block of K). FP8 0: the tile
        if FP8:
            tile = (tile.to(tl.float32) * tl.load(s_at + k0 // FP8)[None, :]).to(dtype)
        return tile

    @triton.jit
    def _moe_biased(y, bias_at, mask, dtype: tl.constexpr):
        # y [BLOCK_M, BLOCK_N] float32 rounded to dtype, plus each column's bias (bias_at [BLOCK_N], where mask) rounded
        # again: the bf16 GEMM output and transformers' bf16 out.add_(bias) (gpt-oss's experts)
        bias = tl.load(bias_at, mask=mask, other=0.0).to(tl.float32)
        return (y.to(dtype).to(tl.float32) + bias[None, :]).to(dtype).to(tl.float32)

    @triton.jit(do_not_specialize=["rows", "top_k", "blocks", "group_m"])
    def _moe_gate_up_kernel(h_ptr, w, bias_ptr, s_ptr, act_ptr, ids_ptr, block_expert_ptr, rows, top_k, blocks, group_m,
                            N, K, h_stride, w_expert, w_col, w_k, up_at, alpha, limit, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                            KN: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, FP8: tl.constexpr):
        # act[block rows, cols] = SiLU(gate)·up of the block's rows of h (row r: token ids[r] // top_k; an id of rows
        # is padding: a zero row) for its expert; column c's gate weights at w + c·w_col, its up weights up_at further,
        # each K long in steps of w_k (prefill's [experts, 2 N, K] gate rows first: w_col K, up_at N·K, w_k 1); with
        # TMA, w a TensorDescriptor over them ([experts · 2 N, K] in [BLOCK_N, BLOCK_K] blocks; KN: _moe_weight_tile's).
        # CLAMPED: gpt-oss's experts, gate and up interleaved (the weights' and the biases' column 2c gate c's, 2c + 1
        # up c's), read as one tile of 2 BLOCK_N columns a step (contiguous in gpt-oss's [experts, K, 2 N] storage, a
        # TMA block of their own: a [BLOCK_K, 2 BLOCK_N] one under KN) and split in the epilogue, then the ClampedSwiGLU
        # (alpha, limit) as gated_act's kernel computes it. BIAS: each column's bias ([experts, 2 N] at bias_ptr) added
        # to its rounded product, in bf16 as transformers (_moe_biased). Padding rows are written too (zeros or the
        # biases' activation): the down GEMM reads whole blocks, and no valid row reads them. FP8 (FP8_BLOCK; 0: bf16
        # weights): the weights float8_e4m3fn, each tile dequantized as it is loaded (_moe_dequantized; their scales at
        # s_ptr, [experts, 2 cdiv(N, FP8), cdiv(K, FP8)]); not with CLAMPED or KN.
        expert, r, ids, cols, col = _moe_rows(block_expert_ptr, ids_ptr, blocks, group_m, N, BLOCK_M, BLOCK_N)
        if expert >= 0:
            valid = ids < rows
            ks = tl.arange(0, BLOCK_K)
            a_at = h_ptr + (ids // top_k)[:, None].to(tl.int64) * h_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
            row = expert * (w_expert // (w_k if KN else w_col))  # the expert's first row in a TMA descriptor
            if CLAMPED:
                wide = 2 * col + tl.arange(0, 2 * BLOCK_N)
                g_at = _moe_weights_at(w, expert.to(tl.int64) * w_expert, wide, 2 * N, w_col, w_k, BLOCK_K, TMA)
                gate_up = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
            else:
                g_at = _moe_weights_at(w, expert.to(tl.int64) * w_expert, cols, N, w_col, w_k, BLOCK_K, TMA)
                s_at, s_up = _moe_scales_at(s_ptr, expert, cols, N, K, 2, FP8)
                gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_at, mask=valid[:, None], other=0.0)
                else:
                    a = tl.load(a_at, mask=valid[:, None] & (k0 + ks[None, :] < K), other=0.0)
                if CLAMPED:
                    gate_up = tl.dot(a, _moe_weight_tile(w, g_at, row, 2 * col, k0, K, BLOCK_K, EVEN_K, TMA, KN),
                                     gate_up)
                else:
                    g = _moe_dequantized(_moe_weight_tile(w, g_at, row, col, k0, K, BLOCK_K, EVEN_K, TMA, KN), s_at,
                                         k0, h_ptr.dtype.element_ty, FP8)
                    u = _moe_dequantized(_moe_weight_tile(w, g_at + up_at, row, col + up_at // w_col, k0, K, BLOCK_K,
                                                          EVEN_K, TMA, KN), s_at + s_up, k0, h_ptr.dtype.element_ty, FP8)
                    gate = tl.dot(a, g, gate)  # both tiles loaded before either product: 100 VGPRs on gfx1100, not 130
                    up = tl.dot(a, u, up)
                a_at += BLOCK_K
                g_at += BLOCK_K * w_k
            dtype = act_ptr.dtype.element_ty
            if CLAMPED:
                gate, up = tl.split(tl.reshape(gate_up, (BLOCK_M, BLOCK_N, 2)))
            if BIAS:
                bias_at = bias_ptr + expert.to(tl.int64) * 2 * N
                gate = _moe_biased(gate, bias_at + (2 * cols if CLAMPED else cols), cols < N, dtype)
                up = _moe_biased(up, bias_at + (2 * cols + 1 if CLAMPED else N + cols), cols < N, dtype)
            else:
                gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
            if CLAMPED:
                act = _clamped_swiglu(gate, up, alpha, limit, dtype)
            else:
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
            tl.store(act_ptr + r[:, None].to(tl.int64) * N + cols[None, :], act.to(dtype), mask=cols[None, :] < N)

    @triton.jit(do_not_specialize=["rows", "blocks", "group_m"])
    def _moe_down_kernel(act_ptr, w, bias_ptr, s_ptr, out_ptr, ids_ptr, block_expert_ptr, rows, blocks, group_m, N,
                         K, w_expert, w_col, w_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, TMA: tl.constexpr, KN: tl.constexpr, BIAS: tl.constexpr,
                         FP8: tl.constexpr):
        # out[ids[r], cols] = act[r] @ the expert's down weights, rounded to bf16, for the block's rows that are not
        # padding: each (token, slot) row written once, by this program; act: [blocks · BLOCK_M, K], contiguous; w as
        # _moe_gate_up_kernel's. BIAS: plus its expert's bias ([experts, N] at bias_ptr), rounded where transformers'
        # bf16 out.add_(bias) rounds. The routing weight is _moe_sum_kernel's, as combine weights the grouped rows.
        # FP8: as _moe_gate_up_kernel's (the scales [experts, cdiv(N, FP8), cdiv(K, FP8)])
        expert, r, ids, cols, col = _moe_rows(block_expert_ptr, ids_ptr, blocks, group_m, N, BLOCK_M, BLOCK_N)
        if expert >= 0:
            valid = ids < rows
            ks = tl.arange(0, BLOCK_K)
            a_at = act_ptr + r[:, None].to(tl.int64) * K + ks[None, :]
            b_at = _moe_weights_at(w, expert.to(tl.int64) * w_expert, cols, N, w_col, w_k, BLOCK_K, TMA)
            s_at, _ = _moe_scales_at(s_ptr, expert, cols, N, K, 1, FP8)
            row = expert * (w_expert // (w_k if KN else w_col))
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_at)
                else:
                    a = tl.load(a_at, mask=k0 + ks[None, :] < K, other=0.0)
                b = _moe_weight_tile(w, b_at, row, col, k0, K, BLOCK_K, EVEN_K, TMA, KN)
                acc = tl.dot(a, _moe_dequantized(b, s_at, k0, act_ptr.dtype.element_ty, FP8), acc)
                a_at += BLOCK_K
                b_at += BLOCK_K * w_k
            dtype = out_ptr.dtype.element_ty
            if BIAS:
                acc = _moe_biased(acc, bias_ptr + expert.to(tl.int64) * N + cols, cols < N, dtype)
            tl.store(out_ptr + ids[:, None].to(tl.int64) * N + cols[None, :], acc.to(dtype),
                     mask=valid[:, None] & (cols[None, :] < N))

    @triton.jit(do_not_specialize=["tokens", "top_k"])
    def _moe_sum_kernel(x_ptr, x_stride, out_ptr, weights_ptr, tokens, hidden, top_k, TOKENS: tl.constexpr,
                        BLOCK: tl.constexpr):
        # x[t] += Σ_j weights[t, j] · out[t top_k + j], token t's rows in slot order: float32 products and sums of the
        # bf16 rows and weights, rounded to bf16 once, then the add rounded, as combine; TOKENS tokens by BLOCK
        # columns a program
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None].to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (t < tokens) & (cols < hidden)
        acc = tl.zeros((TOKENS, BLOCK), tl.float32)
        for j in range(top_k):
            weight = tl.load(weights_ptr + t * top_k + j, mask=t < tokens, other=0.0).to(tl.float32)  # [TOKENS, 1]
            acc += weight * tl.load(out_ptr + (t * top_k + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        at = x_ptr + t * x_stride + cols
        x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(at, (x + acc.to(x_ptr.dtype.element_ty).to(tl.float32)).to(x_ptr.dtype.element_ty), mask=mask)


def align_experts(chosen, num_experts, block_m):
    """chosen [tokens, k] (each (token, slot)'s expert) -> (ids, block_expert). ids [blocks · block_m] int32: each
    row's flat (token, slot) index, expert by expert from expert 0, each expert's rows in token order from a multiple
    of block_m, the rest of its last block tokens · k (padding). block_expert [blocks] int32: the expert of each block
    of block_m rows, -1 past the last (those blocks' ids are not written). blocks = cdiv(tokens · k, block_m) +
    num_experts, the most the padding can need: known without reading anything back. Three launches, no atomics:
    counts per chunk of entries, their running sums over the chunks, then each chunk's entries placed after those of
    the chunks before it."""
    rows, device = chosen.numel(), chosen.device
    chunks, blocks = triton.cdiv(rows, ALIGN_CHUNK), triton.cdiv(rows, block_m) + num_experts
    eb = min(ALIGN_EXPERTS, triton.next_power_of_2(num_experts))
    counts, ends = torch.empty(2, chunks, num_experts, dtype=torch.int32, device=device)
    ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    _moe_count_kernel[(chunks,)](chosen, counts, rows, num_experts, CHUNK=ALIGN_CHUNK, EB=eb, num_warps=8)
    _moe_scan_kernel[(triton.cdiv(num_experts, eb),)](counts, ends, chunks, num_experts, CB=ALIGN_SCAN, EB=eb,
                                                      num_warps=4)
    _moe_align_kernel[(chunks,)](chosen, ends, ids, block_expert, rows, num_experts, chunks, blocks, CHUNK=ALIGN_CHUNK,
                                 EB=eb, JB=ALIGN_BLOCKS, BLOCK_M=block_m, num_warps=16)
    return ids, block_expert


def rows_of_n(w):
    # whether w [experts, N, K] is a view of [experts, K, N] storage (gpt-oss's experts): its rows of N contiguous
    return w.stride(2) != 1


def expert_weights(w, n, k, tma):
    # a GEMM's weights w [experts, N, K] as its kernel reads them: the tensor, or (tma) a TensorDescriptor over its rows
    # of K ([experts · N, K], [n, k] blocks), or over the rows of N of the [experts, K, N] storage it views
    # ([experts · K, N], [k, n] blocks): TMA copies them to shared memory (Triton >= 3.4, NVIDIA from sm_90), and needs
    # a block's inner side contiguous
    if not tma:
        return w
    if TensorDescriptor is None:
        raise RuntimeError(f"triton {triton.__version__} has no TensorDescriptor")
    E, N, K = w.shape
    if rows_of_n(w):
        assert w.stride(1) == 1 and w.stride(0) == K * w.stride(2)
        return TensorDescriptor(w, [E * K, N], [w.stride(2), 1], [k, n])
    assert w.stride(2) == 1 and w.stride(0) == N * w.stride(1)
    return TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [n, k])


def fp8_scales_fit(w, scales, parts, bk):
    # whether the fused experts' FP8 variant reads w [experts, N, K] float8_e4m3fn (K-contiguous) by its scales
    # [experts, parts cdiv(N / parts, FP8_BLOCK), cdiv(K, FP8_BLOCK)] float32 (contiguous: _moe_scales_at's), in tiles
    # BLOCK_K = bk wide that lie in one block of K
    E, N, K = w.shape
    return (w.dtype == FP8 and not rows_of_n(w) and FP8_BLOCK % bk == 0 and scales.dtype == torch.float32
            and scales.is_contiguous() and scales.shape == (E, parts * scale_grid((N // parts,))[0], *scale_grid((K,))))


def moe_gate_up(h, gate_up, ids, block_expert, k, block_m, gemm, bias=None, activation="silu", scales=None):
    # h [tokens, hidden], gate_up [experts, 2 inter, hidden] (gate rows first; gpt-oss's: a view of [experts, hidden,
    # 2 inter], gate and up interleaved), bias [experts, 2 inter] or None -> act [padded rows, inter]: SiLU(gate)·up
    # of each aligned row (align_experts' ids, block_expert), or (activation a ClampedSwiGLU) gpt-oss's; gemm:
    # (BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA). scales (FP8 weights; not with biases or gpt-oss's layout):
    # gate_up float8_e4m3fn and its block scales [experts, 2 cdiv(inter, FP8_BLOCK), cdiv(hidden, FP8_BLOCK)], the
    # gate's grid then the up's, each tile dequantized in the kernel as dequantize_fp8 would (fp8_scales_fit)
    (E, I2, H), blocks = gate_up.shape, block_expert.shape[0]
    (n, bk, group_m, warps, stages, tma), I = gemm, I2 // 2
    clamped = isinstance(activation, ClampedSwiGLU)
    assert clamped or activation == "silu"
    assert scales is None or not clamped and bias is None and fp8_scales_fit(gate_up, scales, 2, bk), \
        "FP8 experts: gate_up's layout, scales or BLOCK_K (fp8_scales_fit), or biases"
    act = torch.empty(blocks * block_m, I, dtype=h.dtype, device=h.device)
    _moe_gate_up_kernel[(blocks * triton.cdiv(I, n),)](
        h, expert_weights(gate_up, 2 * n if clamped else n, bk, tma), h if bias is None else bias,
        h if scales is None else scales, act, ids, block_expert, h.shape[0] * k, k, blocks, group_m, I, H, h.stride(0),
        gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), I * gate_up.stride(1),
        activation.alpha if clamped else 1.0, activation.limit if clamped else 0.0, BLOCK_M=block_m, BLOCK_N=n,
        BLOCK_K=bk, EVEN_K=H % bk == 0, TMA=tma, KN=tma and rows_of_n(gate_up), BIAS=bias is not None,
        CLAMPED=clamped, FP8=0 if scales is None else FP8_BLOCK, num_warps=warps, num_stages=stages)
    return act


def moe_down(act, down, ids, block_expert, rows, block_m, gemm, bias=None, scales=None):
    # act [padded rows, inter], down [experts, hidden, inter] (gpt-oss's: a view of [experts, inter, hidden]), bias
    # [experts, hidden] or None -> out [rows (tokens * k), hidden]: each (token, slot) row's down projection (plus its
    # expert's bias), unweighted, at the row of its flat index. scales: down float8_e4m3fn and its block scales
    # [experts, cdiv(hidden, FP8_BLOCK), cdiv(inter, FP8_BLOCK)], as moe_gate_up's
    (E, H, I), blocks = down.shape, block_expert.shape[0]
    n, bk, group_m, warps, stages, tma = gemm
    assert scales is None or bias is None and fp8_scales_fit(down, scales, 1, bk), \
        "FP8 experts: down's layout, scales or BLOCK_K (fp8_scales_fit), or a bias"
    out = torch.empty(rows, H, dtype=act.dtype, device=act.device)
    _moe_down_kernel[(blocks * triton.cdiv(H, n),)](
        act, expert_weights(down, n, bk, tma), act if bias is None else bias, act if scales is None else scales, out,
        ids, block_expert, rows, blocks, group_m, H, I, down.stride(0), down.stride(1), down.stride(2),
        BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=bk, EVEN_K=I % bk == 0, TMA=tma, KN=tma and rows_of_n(down),
        BIAS=bias is not None, FP8=0 if scales is None else FP8_BLOCK, num_warps=warps, num_stages=stages)
    return out


def moe_sum(x, out, weights):
    # x [tokens, hidden] += each token's k rows of out [tokens * k, hidden] times its weights [tokens, k], summed in
    # slot order
    (T, H), block = x.shape, min(1024, triton.next_power_of_2(x.shape[1]))  # and 4096 // block tokens: 32 elements
    _moe_sum_kernel[(triton.cdiv(T, 4096 // block), triton.cdiv(H, block))](  # a thread of 4 warps
        x, x.stride(0), out, weights, T, H, weights.shape[1], TOKENS=4096 // block, BLOCK=block, num_warps=4)


def fused_experts(x, h, weights, chosen, w, tile, activation="silu"):
    """moe_ffn's experts in six launches: x [tokens, hidden] += Σ_j weights[t, j] · expert chosen[t, j](h[t]), each
    expert with its biases where w has them and the model's expert_activation (gpt-oss's: both). tile: (BLOCK_M, the
    gate+up GEMM's (BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA), the down GEMM's). Where w has the experts' FP8
    scales (gate_up_scales, down_scales), its gate_up and down are float8_e4m3fn, dequantized tile by tile in the
    GEMMs: bit for bit the experts of the bf16 weights dequantize_fp8 makes of them (bench/fp8_experts.py)."""
    block_m, up, down = tile
    assert h.stride(1) == 1 and weights.is_contiguous() and chosen.is_contiguous() and x.stride(1) == 1
    ids, block_expert = align_experts(chosen, w.gate_up.shape[0], block_m)
    act = moe_gate_up(h, w.gate_up, ids, block_expert, chosen.shape[1], block_m, up, w.gate_up_bias, activation,
                      w.gate_up_scales)
    moe_sum(x, moe_down(act, w.down, ids, block_expert, weights.numel(), block_m, down, w.down_bias, w.down_scales),
            weights)


# The order decides where nothing was timed: torch's grouped GEMM where it is one kernel, then the fused experts (and
# under "auto" nothing else but the loop: expert_candidates), else the fused experts first, then prefill's Triton
# grouped GEMM; the loop last. "auto" offers torch's grouped GEMM on a
# GPU only where it is native (grouped_mm_native): elsewhere it is the loop with a host sync, and on an RDNA4 GPU
# (gfx1200, ROCm 7.2.1 on Windows) it crashed the process where no check could catch it (ROCm/pytorch#3283). It stays
# on the CPU, where the tests run its call (torch's composite fallback there), and --experts grouped_mm asks for it
# anywhere. On the CPU "auto" offers no Triton: its interpreter (tests) multiplies bf16 tiles as raw integers.
EXPERT_KINDS = ["grouped_mm", "fused", "triton", "loop"]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the Triton grouped GEMM per GPU family. NVIDIA's: of ten tiles timed
# on the H200 on a 16,384-token slice of Qwen3-30B-A3B (bench/results/…-moe-experts-tiles.json) the best three, 467,
# 382 and 337 TFLOP/s (torch's grouped_mm: 625); the first needs 144 KiB of shared memory, which a GPU with less
# refuses at the start-up check. RDNA3's compiled for gfx1100 under Triton 3.9 without spills (159 and 98 VGPRs; of
# ten tiles tried up to 128x128x64, which took 235, none spilled), not measured. The timing at start-up picks between
# a family's tiles. tests/test_gfx1100_compile.py compiles RDNA3's.
EXPERT_TILES = {
    "nvidia": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3)],
    "rdna3": [(128, 128, 32, 8, 1), (64, 64, 32, 4, 2)],
    "cpu": [(32, 32, 32, 4, 1)],  # Triton's interpreter (tests)
}
EXPERT_TILES["amd"] = EXPERT_TILES["rdna3"]
# The fused experts' tiles, (BLOCK_M, the gate+up GEMM's (BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA), the down
# GEMM's), per GPU family and per shape: {(hidden, moe_intermediate, rows an expert gets in a full slice): tiles}; a
# model is offered the tiles of the shape nearest to its own (fused_tiles), and the start-up timing picks among them.
# The gate+up GEMM's BLOCK_N columns are BLOCK_N of gate and BLOCK_N of up: two accumulators, vLLM's tile of 2 BLOCK_N.
# bench/tune_fused_moe.py times tiles per shape on a GPU and prints this table's rows. NVIDIA's: its run on the H200
# (bench/results/primitives/2026-12-03-h200-fused-moe-tiles@0c884e2.json; Triton 3.6, torch 2.11), the two best
# BLOCK_Ms per shape and slice; the weights read by TMA (a TensorDescriptor: the copy engine's loads, fewer registers)
# in all but four of the twenty GEMMs kept. There the fused experts (alignment, both GEMMs, sum) took 0.93-1.29x
# torch's grouped_mm experts (sort, gather, GEMMs, activation, combination) on the same routing: faster on Qwen3-30B-A3B
# (2.45 ms against 2.64 a 16,384-token slice, the GEMMs at 572 TFLOP/s) and on the 4,096-token slices of many small
# experts, slower on Mixtral's and gpt-oss's wide ones; the start-up timing decides per model. All compile for sm_90a
# to wgmma, unspilled, under Triton 3.6 and 3.9. The (2880, 2880, ·) rows are gpt-oss's own experts (N-contiguous
# weights, gate and up as one GEMM, biases: the KN, CLAMPED and BIAS variants), tuned on them at 1ca9e7e (primitives/
# 2026-12-03-h200-fused-moe-tiles-gpt-oss@1ca9e7e.json: gpt-oss-20b's 16,384-token slice 5.64 ms against grouped_mm's
# 6.68, gpt-oss-120b's 7.08 against 8.27, the same bits as grouped_mm's), most of their weights read by pointers.
# RDNA3's: vLLM's AMD_Radeon_Graphics (E=128,N=384) from 512 tokens on (64, 128, 32, GROUP_SIZE_M 8, warps 8, stages 2),
# and the same in 128-row blocks, compiled for gfx1100 without spills (gate+up, down: 100 and 99 VGPRs, 143 and 140,
# under Triton 3.9; 102-154 under 3.6; the alignment 105-118 in 16 warps, which spilled in 8 once it read its two rows
# of running counts directly (139 VGPRs); tests/test_gfx1100_compile.py), not run.
FUSED_TILES = {
    "nvidia": {
        (2048, 768, 1024): [
            (128, (128, 64, 1, 8, 3, True), (256, 64, 16, 8, 3, True)),
            (64, (128, 32, 16, 4, 4, True), (128, 64, 16, 4, 3, True)),
        ],
        (2048, 768, 256): [
            (128, (128, 32, 1, 8, 5, True), (256, 64, 1, 8, 4, True)),
            (64, (128, 32, 1, 4, 4, True), (128, 64, 1, 4, 3, True)),
        ],
        (4096, 1536, 1024): [
            (128, (128, 64, 1, 8, 4, True), (256, 64, 1, 8, 4, True)),
            (64, (128, 64, 16, 4, 3, True), (128, 64, 16, 4, 4, True)),
        ],
        (4096, 1536, 256): [
            (128, (128, 64, 1, 8, 3, True), (256, 64, 1, 8, 4, True)),
            (64, (64, 64, 1, 4, 3, False), (256, 64, 1, 4, 3, True)),
        ],
        (4096, 14336, 4096): [
            (128, (128, 64, 16, 8, 3, True), (256, 64, 1, 8, 3, True)),
            (64, (128, 64, 16, 4, 3, True), (256, 64, 16, 4, 3, True)),
        ],
        (4096, 14336, 1024): [
            (128, (128, 32, 16, 8, 5, False), (256, 64, 1, 8, 4, True)),
            (64, (128, 64, 16, 4, 3, True), (256, 64, 16, 4, 3, True)),
        ],
        (7168, 2048, 512): [
            (128, (128, 64, 1, 8, 3, True), (256, 64, 16, 8, 4, True)),
            (64, (128, 64, 1, 4, 3, True), (128, 64, 16, 4, 4, True)),
        ],
        (7168, 2048, 128): [
            (128, (128, 64, 1, 8, 4, True), (256, 64, 1, 8, 4, True)),
            (64, (128, 64, 16, 4, 3, True), (128, 64, 1, 4, 3, False)),
        ],
        (2880, 2880, 2048): [
            (128, (128, 32, 16, 8, 5, True), (256, 64, 1, 8, 3, False)),
            (64, (128, 32, 16, 4, 4, False), (256, 64, 16, 4, 3, False)),
        ],
        (2880, 2880, 512): [
            (128, (128, 64, 1, 8, 3, False), (256, 64, 1, 8, 3, False)),
            (64, (128, 32, 1, 4, 4, False), (256, 64, 1, 4, 3, False)),
        ],
        (2880, 2880, 128): [
            (128, (128, 32, 1, 8, 5, False), (256, 32, 1, 8, 5, True)),
            (64, (128, 32, 1, 4, 4, False), (128, 64, 1, 4, 3, False)),
        ],
    },
    "rdna3": {(2048, 768, 1024): [(64, (64, 32, 8, 8, 2, False), (128, 32, 8, 8, 2, False)),
                                  (128, (64, 32, 8, 8, 2, False), (128, 32, 8, 8, 2, False))]},
    "cpu": {(2048, 768, 1024): [(64, (32, 32, 2, 4, 1, False), (32, 32, 2, 4, 1, False))]},  # the interpreter (tests)
}
FUSED_TILES["amd"] = FUSED_TILES["rdna3"]


def fused_tiles(family, cfg, slice_tokens):
    # the fused experts' tiles of the FUSED_TILES shape nearest to this model's (each size compared by its logarithm)
    table = FUSED_TILES[family]
    shape = (cfg.hidden_size, cfg.moe_intermediate_size,
             max(1, slice_tokens * cfg.num_experts_per_tok // cfg.num_experts))
    return table[min(table, key=lambda s: sum(abs(math.log(a / b)) for a, b in zip(s, shape)))]


def tile_name(kind, tile):
    if kind == "fused":
        m, *gemms = tile
        return f"fused {m} " + " ".join(f"{n}x{k}g{group}w{warps}s{stages}" + ("tma" if tma else "")
                                        for n, k, group, warps, stages, tma in gemms)
    return kind if tile is None else f"{kind} {tile[0]}x{tile[1]}x{tile[2]}"


def make_grouped(kind, tile=None):
    """The grouped GEMM (a [rows, K] grouped by expert, w [experts, N, K], bounds [experts + 1]) -> [rows, N]."""
    if kind == "loop":
        return grouped_loop
    if kind == "triton":
        if triton is None:
            raise RuntimeError("triton is not installed")
        return lambda a, w, bounds: grouped_triton(a, w, bounds, tile)
    if kind == "grouped_mm":
        grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # torch >= 2.10, >= 2.8
        if grouped_mm is None:
            raise RuntimeError(f"torch {torch.__version__} has no grouped_mm")
        return lambda a, w, bounds: grouped_mm(a, w.transpose(1, 2), offs=bounds[1:].to(torch.int32))
    raise UserError(f"unknown expert kernel {kind!r}")


def make_experts(kind, tile=None, activation="silu"):
    """moe_ffn's experts (x, h, weights, chosen, w, kernels) -> None, x += each token's weighted experts, with the
    model's expert_activation between their GEMMs."""
    if kind != "fused":
        return grouped_experts(make_grouped(kind, tile), activation)
    if triton is None:
        raise RuntimeError("triton is not installed")
    return lambda x, h, weights, chosen, w, kernels: fused_experts(x, h, weights, chosen, w, tile, activation)


def expert_candidates(requested, device, cfg, slice_tokens):
    # (name, kind, tile) of each expert kernel that `requested` names: "auto", a kind, or a name pick_experts returned;
    # the fused experts' tiles are those of the shape nearest to cfg's at slices of slice_tokens
    family, native = gpu_family(device), grouped_mm_native(device)
    # where torch's grouped GEMM is one kernel, "auto" leaves out prefill's Triton one: the same steps, and slower on
    # every shape measured (1.14-1.62x grouped_mm's experts on the H200, primitives/2026-12-03-h200-moe-layer@1ca9e7e;
    # 467 against 625 TFLOP/s, …-moe-experts-tiles), while its three tiles' compiles, checks and timings cost a first
    # start seconds (the fused experts' and its own together: 7.3 s of gpt-oss-20b's 17.8 s to ready on a fresh H200,
    # primitives/2026-12-03-h200-first-start-gpt-oss-20b@1ca9e7e). --experts triton still asks for it
    kinds = EXPERT_KINDS if native else ["fused", "triton", "grouped_mm", "loop"]
    if cfg.fp8_experts:  # held FP8: the fused experts' FP8 variant, or the loop dequantizing an expert at a time (on
        # AMD the loop alone: the variant spills SGPRs in every RDNA3 tile under Triton 3.9, though the launch that
        # tests/test_gfx1100_compile.py compiles under 3.6 does not, and what is offered must compile unspilled under
        # both; below sm_89 Triton refuses float8e4nv, third_party/nvidia/backend/compiler.py, so that its check fails
        # and the loop runs)
        kinds = ["fused", "loop"] if family in ("nvidia", "cpu") else ["loop"]
    tiles = {"triton": EXPERT_TILES[family], "fused": fused_tiles(family, cfg, slice_tokens)}
    named = [(tile_name(kind, tile), kind, tile) for kind in kinds
             if not (kind in tiles and requested == "auto" and device.type != "cuda")
             and not (kind == "triton" and requested == "auto" and native)
             and not (kind == "grouped_mm" and requested == "auto" and device.type == "cuda" and not native)
             for tile in tiles.get(kind, [None])]
    chosen = [c for c in named if requested in ("auto", c[0], c[1])]
    if not chosen and cfg.fp8_experts and requested in EXPERT_KINDS:
        raise UserError(f"expert kernel {requested!r} does not run FP8 experts, which this plan holds as FP8 (the "
                        f"whole layer's bf16 scratch does not fit the memory budget); {' or '.join(kinds)} here")
    if not chosen:
        raise UserError(f"unknown expert kernel {requested!r}")
    return chosen


# ----------------------------------------------------------------------------- start-up checks and picks
# Every kernel prefill may run is checked at start-up against float32 math written out with plain matmuls: neither
# the fused kernels nor SDPA (on ROCm the bf16 SDPA is AOTriton, the same code as the torch-flash candidate: torch 2.10 ships AOTriton 0.11.1)
# are their own judge. Where several pass and only timing can tell them apart (attention backends and tiles, the BLAS
# library on ROCm, the expert kernels), the first run on a machine times them and keeps the choice in a small cache
# file: every later run computes the same numbers bit for bit. Candidates sum in different orders, so a choice that
# followed timing noise would give other last bits after a fresh start (a new container, an edited prefill.py): each
# family has a fixed order of preference (the candidates' order), and timing overrides it only by a clear margin,
# measured as a median of several repetitions (pick_order). Without a writable cache nothing is timed, and the first
# candidate in that order runs.

CHECK_LENGTHS = [37, 100, 650, 3000]  # one key tile; a few; the steady state of the key loop; partial tiles
CHECK_TOLERANCE = 2**-5  # relative; a few bf16 ulps (the CPU interpreter truncates), where a bug is off by O(1)


def check_error(got, want):
    # the worst row's error relative to that row's own scale: a long text's attention rows are diffuse and small,
    # and a fault in a late key tile shows only there; inf where got holds a NaN or Inf
    got = got.float()
    if not torch.isfinite(got).all():
        return math.inf
    if got.dim() == 1:
        got, want = got[:, None], want[:, None]
    err = (got - want).abs().flatten(1).amax(1)
    scale = want.abs().flatten(1).amax(1).clamp_min(1e-6 * want.abs().max().item() + 1e-30)
    return (err / scale).max().item()


def with_sinks(scores, sinks):
    # [heads, rows, keys] float32 -> their softmax over the keys with each head's sink ([heads] or None) joined as one
    # more column, whose probability is dropped (transformers' eager_attention_forward)
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


def attention_reference(q, k, v, chunk, how, sinks=None):
    # float32 causal attention written out: softmax(softcap(q k^T · scale)) v per text and KV head ([group, n, n]
    # scores), over the keys each row sees (its window's), with each query head's sink where given ([heads])
    q, k, v = joined(q, k, v)
    out = torch.empty(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    for s, e in zip(chunk.seq_bounds[:-1], chunk.seq_bounds[1:]):
        for r in range(s, e, 512):  # blocks of query rows, each over the keys up to its last row only
            rows = slice(r, min(r + 512, e))
            hidden = torch.ones(rows.stop - r, rows.stop - s, dtype=torch.bool, device=q.device).triu(r - s + 1)
            if how.window is not None:  # and the keys at or before row - window
                hidden |= torch.ones_like(hidden).tril(r - s - how.window)
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)  # the query heads that read KV head h
                scores = q[rows, heads].float().transpose(0, 1) @ k[s:rows.stop, h].float().T * how.scale
                if how.softcap is not None:
                    scores = how.softcap * torch.tanh(scores / how.softcap)
                probs = with_sinks(scores.masked_fill(hidden, -math.inf), None if sinks is None else sinks[heads])
                out[rows, heads] = (probs @ v[s:rows.stop, h].float()).transpose(0, 1)
    return out


def tree_attention_reference(q, k, v, seen, how, sinks=None):
    # float32 attention written out over an explicit visibility mask: q [rows, heads, D], k/v [keys, kv_heads, D],
    # seen [rows, keys] bool (a prefix tree's: each row's own path within its window, from tree_visibility); the
    # scale and softcap of how, and its sinks where given ([heads])
    out = torch.empty(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    for h in range(k.shape[1]):
        heads = slice(h * group, (h + 1) * group)
        scores = q[:, heads].float().transpose(0, 1) @ k[:, h].float().T * how.scale  # [group, rows, keys]
        if how.softcap is not None:
            scores = how.softcap * torch.tanh(scores / how.softcap)
        probs = with_sinks(scores.masked_fill(~seen, -math.inf), None if sinks is None else sinks[heads])
        out[:, heads] = (probs @ v[:, h].float()).transpose(0, 1)
    return out


# Attention's fastest kernel depends on the texts' lengths: short texts are launch-bound and a varlen kernel (one
# launch per chunk) wins, long ones go to the fastest dense kernel. So each chunk runs the kernel picked for the bucket
# of its longest text: a pure function of the lengths, so the same request always runs the same kernels. Per bucket:
# its label, the longest text it holds (None: any), the texts its pick is timed on (contest chunks hold ~8 texts of
# 300-650 tokens; lengths the check does not use, so that a kernel that plans per length, as cuDNN builds a graph per
# shape, pays for it in the timing) and the texts its kernel is checked on, through the dispatcher.
ATTENTION_BUCKETS = [
    ("<=1024", 1024, [300 + 45 * i for i in range(8)], [1000, 37]),
    ("<=4096", 4096, [2900, 700, 300, 90], [2100, 37]),
    (">4096", None, [12000], [4500]),  # about the geometric middle of 4k-32k
]
BUCKET_LABELS = [label for label, *_ in ATTENTION_BUCKETS]
TIMED_DEVICES = ("cuda",)  # where kernels are timed (CUDA events; HIP's too)
TIMING_REPEATS = 5  # timed calls of each candidate: their median is its time
PICK_MARGIN = 0.10  # timing overrides the order of preference only where a candidate takes at most 90% of the time


def median_ms(events):
    # the median of the intervals between consecutive recorded (and completed) CUDA events, in ms
    return sorted(a.elapsed_time(b) for a, b in zip(events[:-1], events[1:]))[(len(events) - 1) // 2]


# The picks are timed while the weights load, and the loader's threads hold the GIL for much of it: a kernel launched
# from Python (Triton's) then reaches the GPU late, and the events around it time the host's delay, not the kernel. On
# the H200 a start-up timed the Triton attention slower than torch's flash and picked flash, which the request then
# ran at 0.079 s of GPU time against the Triton kernel's 0.042 s in another start's run (bench/results/profiles/
# 2026-12-03-h200-q30-120-4096@bf3ce35.txt, …-qwen3-30b-a3b-contest-48gib-fused@671f8b6.txt; unloaded, 0.27 against
# 0.15 ms a chunk: primitives/2026-11-30-h200-gil-attention.json). So the timed calls queue behind GATE_MS of
# matmuls: launched while the GPU is busy, their events time the GPU alone. Where the gate ran dry before the last
# timed call was launched (a thread waits up to 5 ms for the GIL: sys.getswitchinterval), they are timed again
# behind a gate twice as long, up to GATE_TRIES times.
GATE_MS = 20.0
GATE_TRIES = 4
GATE = {}  # device -> matmuls of GATE_OPERAND that take GATE_MS, measured once a process
GATE_OPERAND = 4096  # ~0.2 ms a matmul on the H200, ~2 on a W7800: few launches to queue, whatever the GPU


def queue_gate(device, scale=1):
    # about scale x GATE_MS of GPU work on the current stream (its 64 MB freed on return, to the allocator's cache);
    # returns an event recorded after it
    a = torch.randn(GATE_OPERAND, GATE_OPERAND, device=device, dtype=DTYPE)
    out = torch.empty_like(a)
    if device not in GATE:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.mm(a, a, out=out)
        start.record()
        for _ in range(10):
            torch.mm(a, a, out=out)
        end.record()
        end.synchronize()
        GATE[device] = math.ceil(GATE_MS / max(start.elapsed_time(end) / 10, 1e-3))
    for _ in range(GATE[device] * scale):
        torch.mm(a, a, out=out)
    drained = torch.cuda.Event()
    drained.record()
    return drained


def gated(device, launch):
    # launch() (the timed calls and their events, on the current stream) behind a gate, until the gate was still
    # running when launch() returned; waits for them
    for attempt in range(GATE_TRIES):
        drained = queue_gate(device, 2**attempt)
        launch()
        if not drained.query():
            break
    torch.cuda.current_stream().synchronize()


def gated_ms(device, fn, repeats=TIMING_REPEATS):
    # the median ms of `repeats` calls of fn, back to back on the current stream behind a gate
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]

    def launch():
        for event in events[:-1]:
            event.record()
            fn()
        events[-1].record()

    gated(device, launch)
    return median_ms(events)


def pick_order(entries, cost):
    """entries, in their family's order of preference, reordered for picking: first the first entry, replaced by any
    later one whose cost is at most (1 - PICK_MARGIN) of the current choice's, in turn; then the same among the rest.
    Timing noise within the margin cannot change the order unless two costs sit right at the margin's edge."""
    rest, order = list(entries), []
    while rest:
        choice = rest[0]
        for e in rest[1:]:
            if cost(e) <= (1 - PICK_MARGIN) * cost(choice):
                choice = e
        order.append(choice)
        rest.remove(choice)
    return order


def attention_bucket(max_len):
    return next(label for label, longest, _, _ in ATTENTION_BUCKETS if longest is None or max_len <= longest)


def bucketed_attention(attends):
    # {bucket label: attention function} -> one attention function routing each chunk by its longest text
    def attend(q, k, v, chunk, how, **sinks):
        return attends[attention_bucket(chunk.max_len)](q, k, v, chunk, how, **sinks)
    return attend


def attention_summary(names):
    return ", ".join(f"{name} ({label})" for label, name in names.items())


def verdict(run, want, what, detail=""):
    """(relative error, reason or None): run()'s output against the float32 `want`, refused past CHECK_TOLERANCE or
    where a second run gives other bits."""
    got = run()
    error = check_error(got, want)
    if not error <= CHECK_TOLERANCE:
        return error, f"differs from float32 {what} by {error:.3g} (relative){detail}"
    if not torch.equal(got, run()):  # torch flags cuDNN SDPA as nondeterministic
        return error, "gave other bits for the same input the second time"
    return error, None


def failure(e):  # an exception as a check's one-line reason
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def checked(entry, key, make, run, want, what):
    """A check entry's verdict on one candidate: entry[key] = make()'s kernel when run(kernel) passes verdict(),
    else entry["reason"] says why."""
    try:
        kernel = make()
        entry["error"], reason = verdict(lambda: run(kernel), want, what)
        if reason is None:
            entry[key] = kernel
        else:
            entry["reason"] = reason
    except Exception as e:
        entry["reason"] = failure(e)
    return entry


SHARP_SCORES = 8.0  # the spread of sharp check inputs' scores (natural units, std): most of a row's weight on a
# few keys, so that a window one key too wide or too narrow moves some rows by O(1), not by 1/window


def sharpened(q, cfg, how):
    # q scaled for sharp inputs: scores spread SHARP_SCORES, or as far as the softcap, where capping them matters
    # (with the N(0, 1) inputs a cap of 50 changes nothing)
    return (q.float() * ((how.softcap or SHARP_SCORES) / (math.sqrt(cfg.head_dim) * how.scale))).to(DTYPE)


def check_inputs(device, cfg, lens, seed, how, sharp):
    # attention_inputs, with q sharpened for sharp inputs (as a run lays them out)
    q, k, v, chunk = attention_inputs(device, cfg, lens, seed, latent=True)
    return (sharpened(q, cfg, how) if sharp else q), k, v, chunk


def check_sinks(how, heads, device):
    # the sinks the checks give attention with them ({"sinks": [heads] bf16}; without: {}): from -2 to 10 over the
    # heads, so that an N(0, 1) row over 37-3000 keys (a log-sum-exp of about 4-9) finds in its sink anything from a
    # trifle to most of its weight: a sink dropped, another head's, or in log2 units moves rows by O(1)
    return {"sinks": torch.linspace(-2.0, 10.0, heads, device=device).to(DTYPE)} if how.sinks else {}


def attention_settings(cfg):
    # the model's distinct AttentionSettings and how many layers use each, in layer order
    return collections.Counter(cfg.attention)


def check_cases(cfg):
    # (settings, sharp, text lengths) the start-up check runs every candidate on: per distinct setting, N(0, 1) inputs
    # (diffuse rows, where a fault in a late key tile shows), and sharp ones where a window or a softcap is to show;
    # a window's texts outrun it
    cases = []
    for how in attention_settings(cfg):
        lengths = CHECK_LENGTHS + ([how.window + 300] if how.window and how.window + 300 > max(CHECK_LENGTHS) else [])
        cases += [(how, sharp, lengths) for sharp in ((False, True) if how.window or how.softcap else (False,))]
    return cases


def text_check_cases(device, cfg):
    # (settings, sharp, (q, k, v, chunk), float32 reference) of each of check_cases, made one at a time on the device
    for how, sharp, lengths in check_cases(cfg):
        q, k, v, chunk = check_inputs(device, cfg, lengths, 0, how, sharp)
        yield how, sharp, (q, k, v, chunk), attention_reference(q, k, v, chunk, how,
                                                                **check_sinks(how, q.shape[1], device))


def describe_attention(how):
    return ", ".join(([f"window {how.window}"] if how.window else []) + ([f"softcap {how.softcap:g}"] if how.softcap
                                                                          else []) + (["sinks"] if how.sinks else [])) \
        or "full attention"


def check_attention(candidates, device, cfg, cases=None):
    """Each (name, kind, tile) candidate, run twice on texts of CHECK_LENGTHS with each of the model's attention
    settings (text_check_cases; or on `cases`, an iterable of the same tuples: a prefix tree's): a list of dicts with
    name, attend (None where refused), error (the worst) and, where refused, reason."""
    report = [{"name": name, "kind": kind, "tile": tile, "attend": None, "error": 0.0}
              for name, kind, tile in candidates]
    for entry in report:
        try:
            entry["attend"] = make_attention(entry.pop("kind"), entry.pop("tile"))
        except Exception as e:
            entry.update(error=None, reason=failure(e))
    for how, sharp, (q, k, v, chunk), reference in text_check_cases(device, cfg) if cases is None else cases:
        detail = f" with {describe_attention(how)}" if how.window or how.softcap or how.sinks or sharp else ""
        sinks = check_sinks(how, q.shape[1], device)
        for entry in report:
            attend = entry["attend"]
            if attend is None:
                continue
            try:
                error, reason = verdict(lambda: attend(q, k, v, chunk, how, **sinks), reference, "attention", detail)
                entry["error"] = max(entry["error"], error)
                if reason is not None:
                    entry["reason"] = reason
            except Exception as e:
                entry.update(error=None, reason=failure(e))
            if "reason" in entry:
                entry["attend"] = None
    return report


def passes_bucket(entry, label, device, cfg):
    # an entry's kernel, through the dispatcher, on a chunk of the bucket's check texts, with each of the model's
    # settings (sharp inputs where a window or softcap is to show); records bucket_error[label], the worst
    lengths = next(checked for name, _, _, checked in ATTENTION_BUCKETS if name == label)
    error = 0.0
    for how in attention_settings(cfg):
        q, k, v, chunk = check_inputs(device, cfg, lengths, 2, how, bool(how.window or how.softcap))
        sinks = check_sinks(how, q.shape[1], device)
        got = bucketed_attention({label: entry["attend"]})(q, k, v, chunk, how, **sinks)
        error = max(error, check_error(got, attention_reference(q, k, v, chunk, how, **sinks)))
    entry.setdefault("bucket_error", {})[label] = error
    return error <= CHECK_TOLERANCE


def attention_ms(attend, inputs, how):
    # (first call, median of the next TIMING_REPEATS) in ms, timed on a stream of its own: the weights are being
    # copied on others while this runs. The first call of a new shape includes whatever the kernel plans per shape
    # (cuDNN's graph).
    q, k, v, chunk = inputs
    sinks = check_sinks(how, q.shape[1], q.device)
    stream = torch.cuda.Stream(q.device)
    first = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with torch.cuda.stream(stream):
        first[0].record()
        attend(q, k, v, chunk, how, **sinks)
        first[1].record()
        # the first call's host work counts (a plan per shape), the others' does not
        ms = gated_ms(q.device, lambda: attend(q, k, v, chunk, how, **sinks))
    return first[0].elapsed_time(first[1]), ms


def time_attention(entries, label, device, cfg):
    # adds time_ms[label] and first_ms[label] to each entry, on a chunk of the bucket's timing texts: per layer, the
    # mean over the model's layers of each one's settings (Gemma 3: five windowed layers to one full)
    lengths = next(timed for name, _, timed, _ in ATTENTION_BUCKETS if name == label)
    inputs = attention_inputs(device, cfg, lengths, seed=1, latent=True)
    for entry in entries:
        first = ms = 0.0
        for how, layers in attention_settings(cfg).items():
            once, each = attention_ms(entry["attend"], inputs, how)
            first, ms = first + once * layers / cfg.num_hidden_layers, ms + each * layers / cfg.num_hidden_layers
        entry.setdefault("first_ms", {})[label], entry.setdefault("time_ms", {})[label] = first, ms


# A first run on a machine times every attention candidate on each bucket's texts while the weights load: measured
# on the H200 (ae0e53b), the picks then held 1.73 GiB at their peak against 0.74 GiB when kept, beside a plan that
# leaves 1.5 GiB free; 0.78 GiB since SDPA is no longer timed (7531c31, primitives/…-startup-memory.json), kept as
# the margin for a GPU (the W7800) whose candidates nobody has measured. Such a run plans with this much more room;
# resident or streamed, the numbers are the same.
PICK_SCRATCH = GiB


def attention_to_time(requested, device, picks):
    # whether pick_attention will time candidates: on a GPU with a writable picks file that lacks a bucket's pick
    return (device.type in TIMED_DEVICES and not isinstance(requested, dict) and picks.writable()
            and any(picks.get(f"attention {requested} {label}") is None for label in BUCKET_LABELS))


def attention_cost(entry, label, cfg):
    # per layer: a text's per-shape plan is made once per process and then serves every layer
    ms, first = entry["time_ms"][label], entry["first_ms"][label]
    return ms + max(0.0, first - ms) / cfg.num_hidden_layers


def pick_attention(requested, device, cfg, picks):
    """({bucket: name}, attend, report). Per length bucket, of the candidates that pass the check (on CHECK_LENGTHS,
    then on that bucket's texts through the dispatcher): the one this machine's picks name; else, on a GPU with a
    writable cache, the one timing picks on the bucket's timing texts by pick_order's margin (then kept); else the
    first. `requested` is "auto", a
    kind, a name, or a {bucket: name} an earlier pick returned (a second Runner then runs exactly those kernels).
    Where every bucket's kept kernel is known, only those are checked (each check costs time to `ready`)."""
    family, exact = gpu_family(device), isinstance(requested, dict)
    if exact and sorted(requested) != sorted(BUCKET_LABELS):
        raise UserError(f"attention kernels per bucket must name each of {BUCKET_LABELS}")
    options = {label: attention_candidates(requested[label] if exact else requested, family, cfg)
               for label in BUCKET_LABELS}
    kept = {label: requested[label] if exact else picks.get(f"attention {requested} {label}")
            for label in BUCKET_LABELS}
    offered = list(dict.fromkeys(c for label in BUCKET_LABELS for c in options[label]))
    all_kept = all(kept[label] in [c[0] for c in options[label]] for label in BUCKET_LABELS)
    report = check_attention([c for c in offered if c[0] in kept.values()] if all_kept else offered, device, cfg)
    chosen, names = {}, {}
    for label in BUCKET_LABELS:
        allowed = [c[0] for c in options[label]]
        keep = next((e for e in report if e["attend"] is not None and e["name"] == kept[label]), None)
        if keep is not None and passes_bucket(keep, label, device, cfg):
            chosen[label], names[label] = keep["attend"], keep["name"]
            continue
        if len(report) < len(offered):  # the kept kernel failed: every candidate is checked after all
            checked = {e["name"] for e in report}
            report += check_attention([c for c in offered if c[0] not in checked], device, cfg)
        pool = sorted((e for e in report if e["attend"] is not None and e["name"] in allowed and e is not keep),
                      key=lambda e: allowed.index(e["name"]))
        # SDPA per text is the fallback and never the fastest where another kernel runs: untimed, it stays last
        fallback = [e for e in pool if e["name"] == "sdpa" and len(pool) > 1]
        pool = [e for e in pool if e not in fallback]
        timed = not exact and device.type in TIMED_DEVICES and len(pool) > 1 and picks.writable()
        if timed:
            time_attention(pool, label, device, cfg)
            pool = pick_order(pool, lambda e: attention_cost(e, label, cfg))
        pool += fallback
        entry = next((e for e in pool if passes_bucket(e, label, device, cfg)), None)  # else the fixed order's first
        if entry is None:
            reasons = "; ".join(f"{e['name']}: " + (e.get("reason") or f"differs from float32 attention by "
                                                    f"{e['bucket_error'][label]:.3g} on texts of {label} tokens")
                                for e in report if e["name"] in allowed)
            raise UserError(f"attention backend {requested!r} is unusable on {device}: {reasons}")
        chosen[label], names[label] = entry["attend"], entry["name"]
        if timed:
            picks.put(f"attention {requested} {label}", entry["name"])
    return names, bucketed_attention(chosen), report


# --- the experts' kernels: checked against float32 experts, then timed

def moe_reference(h, logits, gate_up, down, k, renormalize, activation="silu", gate_up_bias=None, down_bias=None):
    # float32 math written out: softmax, top-k, renormalisation, each expert's gated activation on its tokens (gpt-oss:
    # with its biases and ClampedSwiGLU), weighted sum. logits are the router's own bf16 output, and the k are
    # torch.topk's, as transformers': bf16 logits tie often (in the check's 600 tokens a few ties sit between the k-th
    # and the (k+1)-th expert), and which of two equal probabilities topk keeps is its own rule (not the lower index);
    # a logit rounded otherwise would swap experts too.
    top, chosen = logits.float().softmax(-1).topk(k, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in range(gate_up.shape[0]):
        tokens, slots = (chosen == e).nonzero(as_tuple=True)
        if len(tokens):
            gate_up_e = h[tokens].float() @ gate_up[e].float().T
            if gate_up_bias is not None:
                gate_up_e += gate_up_bias[e].float()
            y = gated_act(gate_up_e, activation) @ down[e].float().T  # gated_act's ops, here in float32
            if down_bias is not None:
                y += down_bias[e].float()
            out[tokens] += top[tokens, slots, None] * y  # a token meets expert e at most once
    return out


def fp8_quantized(w, parts):
    """Experts' weights w [experts, N, K] -> (float8_e4m3fn [experts, N, K], float32 scales [experts, parts cdiv(N /
    parts, FP8_BLOCK), cdiv(K, FP8_BLOCK)]) as a block-wise FP8 checkpoint holds them, each of the parts projections
    stacked in N (gate_up: 2) on its own grid of blocks (dequantize_fp8's), each block's weights over its amax / 448
    (SPEC §15); an expert at a time (DeepSeek-V3's gate_up: 117 MB of float32)."""
    E, N, K = w.shape
    n, b = N // parts, FP8_BLOCK
    gr, gc = scale_grid((n, K))
    q, scales = torch.empty(w.shape, dtype=FP8, device=w.device), torch.empty(E, parts * gr, gc, device=w.device)
    for e in range(E):
        blocks = F.pad(w[e].float().reshape(parts, n, K), (0, gc * b - K, 0, gr * b - n)).view(parts, gr, b, gc, b)
        s = blocks.abs().amax((2, 4)).clamp(min=2.0 ** -100) / 448  # [parts, gr, gc]
        q[e] = (blocks / s[:, :, None, :, None]).view(parts, gr * b, gc * b)[:, :n, :K].reshape(N, K).to(FP8)
        scales[e] = s.view(parts * gr, gc)
    return q, scales


def expert_inputs(device, cfg, seed, tokens, experts):
    """(h, LayerWeights of the feed-forward alone) with cfg's hidden and moe_intermediate sizes, `experts` experts and
    `tokens` tokens routed by a random router so that their rows are uneven: expert 0 takes half the tokens (several
    tiles of rows, a partial last one), the last expert none."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size

    def randn(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device=device) * std).to(DTYPE)
    h = torch.randn(tokens, H, generator=gen, device=device)
    router = torch.randn(experts, H, generator=gen, device=device) / math.sqrt(H)  # logits ~ N(0, 1)
    common = torch.randn(H, generator=gen, device=device)
    common /= common.norm()
    h += 3 * common  # a direction every token shares and the last expert's router row opposes: logit ~ -12
    router[-1] = -4 * common
    h[:tokens // 2] += 6 * router[0] / router[0].norm()  # expert 0's logit +6 for half the tokens
    w = LayerWeights(mlp_norm=torch.ones(H, device=device, dtype=DTYPE), router=router.to(DTYPE),
                     gate_up=randn(experts, 2 * I, H, std=H ** -0.5), down=randn(experts, H, I, std=I ** -0.5))
    if cfg.fused_experts:  # gpt-oss: its layout, [experts, in, out] read through strides, biases, a clamp that bites
        w.gate_up = randn(experts, H, 2 * I, std=4 * H ** -0.5).transpose(1, 2)
        w.down = randn(experts, I, H, std=I ** -0.5).transpose(1, 2)
        w.gate_up_bias, w.down_bias = randn(experts, 2 * I), randn(experts, H)
    if cfg.fp8_experts:  # held FP8: the weights as a block-wise FP8 checkpoint holds them
        w.gate_up, w.gate_up_scales = fp8_quantized(w.gate_up, 2)
        w.down, w.down_scales = fp8_quantized(w.down, 1)
    return h.to(DTYPE), w


def fp8_dequantized(q, scales, parts):
    # fp8_quantized's experts -> the bf16 weights dequantize_fp8 makes of them, computed apart from FP8Experts (which
    # the check checks): each weight in float32 times its block's scale, rounded to bf16; an expert at a time
    E, N, K = q.shape
    n, b = N // parts, FP8_BLOCK
    out = torch.empty(q.shape, dtype=DTYPE, device=q.device)
    for e in range(E):
        s = scales[e].view(parts, -1, scales.shape[2]).repeat_interleave(b, 1)[:, :n].repeat_interleave(b, 2)[..., :K]
        out[e] = (q[e].float().view(parts, n, K) * s).view(N, K)
    return out


def check_experts(candidates, device, cfg):
    """Each (name, kind, tile) candidate, run twice through moe_ffn on uneven routing: a list of dicts with name,
    experts (its experts function; None where refused), error and, where refused, reason. FP8 experts
    (cfg.fp8_experts): the float32 experts are those of the bf16 weights dequantize_fp8 makes of them, and a candidate
    must give its own output on those bf16 weights bit for bit (the fused experts' FP8 variant: its bf16 one in the same
    tile; the loop: itself), or it is refused."""
    k = min(cfg.num_experts_per_tok, 2)
    h, w = expert_inputs(device, cfg, seed=0, tokens=600, experts=min(cfg.num_experts, 8))
    plain = w if w.gate_up_scales is None else dataclasses.replace(
        w, gate_up=fp8_dequantized(w.gate_up, w.gate_up_scales, 2), down=fp8_dequantized(w.down, w.down_scales, 1),
        gate_up_scales=None, down_scales=None)
    want = moe_reference(h, F.linear(h, w.router), plain.gate_up, plain.down, k, cfg.norm_topk_prob,
                         cfg.expert_activation, w.gate_up_bias, w.down_bias)
    router = Router("softmax", k, cfg.norm_topk_prob)  # the expert kernels are under check, not the model's router
    run = lambda experts, w: moe_ffn(torch.zeros_like(h), h, w, router, experts, TORCH_KERNELS)
    report = [checked({"name": name, "experts": None, "error": None}, "experts",
                      lambda: make_experts(kind, tile, cfg.expert_activation), lambda experts: run(experts, w), want,
                      "experts")
              for name, kind, tile in candidates]
    for entry in report if plain is not w else ():
        try:
            same = entry["experts"] is None or torch.equal(run(entry["experts"], w), run(entry["experts"], plain))
        except Exception as e:
            same, entry["reason"] = False, failure(e)
        if not same:
            entry["reason"] = entry.get("reason") or "gave other bits than on the bf16 weights dequantize_fp8 makes"
            entry["experts"] = None
    return report


def experts_ms(experts, inputs):
    # median ms of a slice's experts after routing (a grouped GEMM's sort, gather, GEMMs, activation and combination;
    # the fused experts' six launches) over TIMING_REPEATS after one warm-up, on a stream of its own
    x = inputs[0]
    stream = torch.cuda.Stream(x.device)
    with torch.cuda.stream(stream):
        experts(*inputs)
        return gated_ms(x.device, lambda: experts(*inputs))


def expert_timing_inputs(device, cfg, chunk_tokens, kernels, experts=8):
    # one slice's routed tokens as a run sees them, for `experts` of the model's experts (their shapes decide the
    # speed; all of them would be a layer's bytes of scratch): chunk_tokens * top-k / num_experts rows each on average,
    # uneven; the experts' arguments (x, h, weights, chosen, w, kernels), kernels the run's (for the combination)
    h, w = expert_inputs(device, cfg, seed=1, tokens=max(2, chunk_tokens * experts // cfg.num_experts), experts=experts)
    weights, chosen = route(h, w, Router("softmax", min(cfg.num_experts_per_tok, experts), cfg.norm_topk_prob))
    return torch.zeros_like(h), h, weights, chosen, w, kernels


def pick_experts(requested, device, cfg, picks, chunk_tokens=4096, kernels=TORCH_KERNELS):
    """(name, experts, report): of the candidates that pass the check, the one this machine's picks name; else, on a
    GPU with a writable picks file, the one timing picks on a slice's shapes (chunk_tokens: the plan's MoE slice) by
    pick_order's margin (then kept); else the first in expert_candidates' order. Where the kept one is known, only it
    is checked. kernels: the run's (a grouped GEMM's timing includes their activation and combination)."""
    candidates = expert_candidates(requested, device, cfg, chunk_tokens)
    key = f"experts {requested}" + (" fp8" if cfg.fp8_experts else "")  # FP8 experts: other timings, their own pick
    kept = picks.get(key)
    report = check_experts([c for c in candidates if c[0] == kept] or candidates, device, cfg)
    if not any(e["experts"] for e in report) and len(report) < len(candidates):  # the kept one failed
        report += check_experts([c for c in candidates if c[0] != kept], device, cfg)
    passed = [e for e in report if e["experts"] is not None]
    if not passed:
        reasons = "; ".join(f"{e['name']}: {e['reason']}" for e in report)
        raise UserError(f"expert kernel {requested!r} is unusable on {device}: {reasons}")
    order = [c[0] for c in candidates]
    passed.sort(key=lambda e: order.index(e["name"]))  # the family's order of preference, whatever was checked first
    if len(passed) > 1 and device.type in TIMED_DEVICES and picks.writable():
        inputs = expert_timing_inputs(device, cfg, chunk_tokens, kernels)
        for entry in passed:
            entry["time_ms"] = experts_ms(entry["experts"], inputs)
        passed = pick_order(passed, lambda e: e["time_ms"])
        picks.put(key, passed[0]["name"])
    return passed[0]["name"], passed[0]["experts"], report


def rms_norm_f32(x, weight, eps, style):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + (style == NORM_OFFSET))


# The layer-level dequantization's check (kernel_checks) dequantizes the layer of this tiny FP8 Qwen3-MoE, held as a
# real one is: vectors and the router copied as bf16, projections of 2 whole blocks by 2.5 (a side of 320, the last
# block partial, as DeepSeek-V3's 576-row kv_a_proj_with_mqa) and of sides below FP8_BLOCK (one partial block: the
# attention's one head of 60, the experts' 40). Each of the kernel's paths, FP8 and copied alike: tensors in whole
# 16 B of bf16 (offsets and width), read and written 16 B at a time, and others (o_proj and the q/k norms, 60 wide),
# an element at a time. Whatever the model, its launches are this one's: the shapes are in the tables, not
# in the kernel's arguments. (A dense layer would add nothing but time: 1 s in the interpreter.)
FP8_CHECK_MODEL = dict(model_type="qwen3_moe", hidden_size=320, intermediate_size=384, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=60, vocab_size=64, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                       quantization_config={"quant_method": "fp8", **FP8_CONFIG})


# MXFP4's (gpt-oss's experts): a tiny gpt-oss layer, its experts' sides 64 and 96 (in: below a 128-column block and
# past one; out: rows of whole 32-row programs), the attention, norms, router and biases copied as bf16 (the sinks'
# 2 and the router bias's 4 not in whole 16 B)
MXFP4_CHECK_MODEL = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=64,
                         num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                         quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": None})


def fp8_check_layer(mxfp4=False):
    """FP8_CHECK_MODEL's config (MXFP4_CHECK_MODEL's with mxfp4), its layer's held parts and bf16 layout, and the
    layer's held bytes (on the CPU): each byte random (but FP8's NaN), the FP8 scales from 2^-24 to 2^4 (products over
    bf16's whole range of exponents); MXFP4's every code, and scale bytes from 2 to 254 (products over bf16's normal
    range and past it, to inf: subnormal products are CPU-tested against transformers, not checked here, since a GPU's
    torch may flush them where the kernel's integer arithmetic does not; 255, transformers' NaN, none)."""
    gen, tiny = torch.Generator().manual_seed(3), ModelConfig.from_json(MXFP4_CHECK_MODEL if mxfp4 else FP8_CHECK_MODEL)
    parts, layout = tiny.held[tiny.layer_kinds.index(tiny.largest_kind)], tiny.layer_layout
    held = torch.randint(256, (tiny.layer_bytes,), generator=gen, dtype=torch.uint8)
    for name, offset, shape, dtype in parts:
        n = math.prod(shape)
        if dtype == FP8:
            q = held[offset:offset + n]
            q[(q & 127) == 127] = 0
        elif dtype == torch.float32:
            scales = torch.rand(n, generator=gen) * 2.0 ** torch.randint(-24, 4, (n,), generator=gen)
            typed(held, offset, n, dtype).copy_(scales)
        elif name.endswith("_scales"):
            held[offset:offset + n] = torch.randint(2, 255, (n,), generator=gen, dtype=torch.uint8)
    return tiny, parts, layout, held


def dequantize_checks(device, mxfp4=False):
    """kernel_checks' [(kernel, launch, error)] of dequantize_layer_triton: fp8_check_layer's layer in one launch
    against dequantize_layer, bit for bit (0 or inf); every element of the bf16 layer compared, the gaps between its
    tensors included (both start zeroed: nothing may be written there)."""
    tiny, parts, layout, held = fp8_check_layer(mxfp4)
    layer, held = fp8_layer(parts, layout, device, mxfp4), held.to(device)
    got, want = (torch.zeros(tiny.dequantized_bytes // 2, dtype=torch.int16, device=device) for _ in range(2))
    dequantize_layer_triton(held, got.view(DTYPE), layer)
    dequantize_layer(held, want.view(DTYPE), layer)
    return [("dequantize", f"a layer of {len(layer.tensors)} tensors in one launch" + (", MXFP4" if mxfp4 else "")
             + ", bit for bit", 0.0 if torch.equal(got, want) else math.inf)]


def route_checks(device, cfg, tokens=67):
    """kernel_checks' [(kernel, launch, error)] of route_triton for the model's router (one of FUSED_ROUTERS) against
    route on this device: other experts than route's refuse it (inf), else its weights' error. Two launches of
    `tokens` rows: logits ~N(0, 4); and logits of five values (-1 to 1 by 1/2), so that nearly every row has ties at
    the k-th place, among low and high indices, which prove the tie rule against this device's torch.topk (the CPU's
    keeps others: refused there). The logits are the router GEMM's own, h [tokens, experts] through an identity
    router (exact: a product by 1 a sum), in bf16 whatever DTYPE (the kernel's only type)."""
    E, router, gen = cfg.num_experts, cfg.router, torch.Generator().manual_seed(5)
    w = LayerWeights(router=torch.eye(E, dtype=torch.bfloat16, device=device),
                     router_bias=torch.zeros(E, dtype=torch.bfloat16, device=device))  # (gpt-oss's: its bias)
    results = []
    for what, logits in (("", torch.randn(tokens, E, generator=gen) * 2),
                         (", ties at the k-th place", torch.randint(-2, 3, (tokens, E), generator=gen) / 2)):
        h = logits.to(device, torch.bfloat16)
        (got, chosen), (want, want_chosen) = route_triton(h, w, router), route(h, w, router)
        results.append(("route", f"{E} experts, top-{router.top_k}" + (", renormalised" if router.renormalize else "")
                        + what, check_error(got, want.float()) if torch.equal(chosen, want_chosen) else math.inf))
    return results


def kernel_checks(device, cfg):
    """[(kernel, launch, relative error)]: each fused Triton kernel in every launch configuration this model's run
    makes, against float32 math on random inputs. A configuration is what Triton compiles a kernel for: its
    constexprs and its integer arguments' specialisations (divisible by 16, equal to 1). head_norm_rope runs twice a
    layer, on the query heads and on the key heads: another head count, so another lane layout (HEADS) and another
    base pointer into the same qkv rows, each checked (the RoPE tables as wide as the model's: partial RoPE is a
    variant); gated_act at the dense MLP's width, the experts' and the shared experts' (with each's activation;
    gpt-oss's clamp biting: inputs spread to ±limit); rms_norm in the model's norm style. Every input is laid out as in
    a run (q and k views of one qkv tensor, its row stride) so that each launch matches a run's but for the token
    count, which only the grid sees. Latent attention (latent_qkv): RoPE on q's last channels of each head and on the
    key all heads share, both views of their projections' outputs, interleaved where the model's RoPE is; rms_norm on
    the latents, views of the first projection's output. An FP8 or MXFP4 model's layer-level dequantization:
    dequantize_checks. A mixture of experts' router, where route_triton fuses it: route_checks."""
    gen = torch.Generator().manual_seed(1)
    T, H, D, eps, style = 67, cfg.hidden_size, cfg.head_dim, 1e-6, cfg.norm_style
    Q, KV, heads, interleave = cfg.q_size, cfg.kv_size, cfg.num_attention_heads, cfg.rope_interleave
    first = torch.randn(T, cfg.qkv_rows, generator=gen).to(device, DTYPE)  # the first projection's output
    x = torch.randn(T, H, generator=gen).to(device, DTYPE)
    w_h, w_d = (torch.rand(n, generator=gen).add(0.5).to(device, DTYPE) for n in (H, D))
    cos, sin = rope_tables(torch.arange(T, device=device), cfg.ropes[0], cfg.rope_dim)
    w_qk = w_d if cfg.qk_norm else None
    if cfg.kv_lora_rank:
        A, R, N, P = cfg.q_lora_rank or Q, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.rope_dim
        q = torch.randn(T, Q, generator=gen).to(device, DTYPE) if cfg.q_lora_rank else first[:, :A]  # q_b's, or q's
        ropes = (("query", q.view(T, heads, N + P)[..., N:]), ("key", first[:, A + R:].view(T, 1, P)))
        latents = [first[:, start:start + n] for start, n in ((0, cfg.q_lora_rank), (A, R)) if n]
    else:
        ropes, latents = (("query", first[:, :Q].view(T, -1, D)), ("key", first[:, Q:Q + KV].view(T, -1, D))), []
    logits = (torch.randn(T, cfg.vocab_size, generator=gen) * 4).to(device)  # float32, as LOGITS has them
    targets = torch.randint(cfg.vocab_size, (T,), generator=gen).to(device)
    targets[::7] = -100
    results = []

    def check(kernel, launch, got, want):
        results.append((kernel, launch, check_error(got, want)))
    check("rms_norm", f"{H} wide" + {NORM_CAST: "", NORM_OFFSET: ", offset", NORM_FLOAT32: ", float32 weight"}[style],
          rms_norm_triton(x, w_h, eps, style), rms_norm_f32(x, w_h, eps, style))
    for latent in latents:
        w_latent = torch.rand(latent.shape[1], generator=gen).add(0.5).to(device, DTYPE)
        check("rms_norm", f"{latent.shape[1]} wide, a latent", rms_norm_triton(latent, w_latent, LATENT_EPS),
              rms_norm_f32(latent, w_latent, LATENT_EPS, NORM_CAST))
    for what, x_heads in ropes:
        normed = rms_norm_f32(x_heads, w_d, eps, style) if cfg.qk_norm else x_heads.float()
        want = apply_rope(deinterleaved(normed) if interleave else normed, cos.float(), sin.float())
        check("head_norm_rope", f"{x_heads.shape[1]} {what} heads" + (", interleaved" if interleave else ""),
              head_norm_rope_triton(x_heads, w_qk, cos, sin, eps, style, interleave), want)
    widths = ([(cfg.intermediate_size, cfg.activation)] if "mlp" in cfg.layouts else []) + (
        [(cfg.moe_intermediate_size, cfg.expert_activation)] if cfg.num_experts else []) + (
        [(cfg.shared_intermediate_size, "silu")] if cfg.shared_intermediate_size else [])
    for width, activation in dict.fromkeys(widths):
        spread = activation.limit / 2 if isinstance(activation, ClampedSwiGLU) else 1.0
        gate_up = (torch.randn(T, 2 * width, generator=gen) * spread).to(device, DTYPE)
        check("gated_act", f"{width} wide, {activation}", gated_act_triton(gate_up, activation),
              gated_act(gate_up.float(), activation))
    check("token_nll", f"vocabulary {cfg.vocab_size}", token_nll_triton(logits, targets),
          F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none"))
    if cfg.num_experts:  # each token's k rows of a shuffled out, weighted, onto x of the same scale as their sum
        k = cfg.num_experts_per_tok
        out = torch.randn(T * k, H, generator=gen).to(device, DTYPE)
        row_of = torch.randperm(T * k, generator=gen).to(device)
        weights = torch.rand(T, k, generator=gen).softmax(-1).to(device, DTYPE)
        x_moe = (torch.randn(T, H, generator=gen) / math.sqrt(k)).to(device, DTYPE)
        got = x_moe.clone()
        combine_triton(got, out, row_of, weights)
        check("combine", f"{k} experts a token", got,
              x_moe.float() + (weights.float()[..., None] * out.float()[row_of].view(T, k, H)).sum(1))
    if cfg.num_experts and cfg.router.kind in FUSED_ROUTERS:
        results += route_checks(device, cfg)
    if cfg.quantized:
        results += dequantize_checks(device, cfg.mxfp4)
    if "bf16" in LOGITS.values():  # the same kernel reading bf16 logits, where a switch asks for them
        rounded = logits.to(DTYPE)
        check("token_nll", f"vocabulary {cfg.vocab_size}, bf16 logits", token_nll_triton(rounded, targets),
              F.cross_entropy(rounded.float(), targets, ignore_index=-100, reduction="none"))
    return results


def worst_errors(results):
    # kernel_checks' results -> {kernel: the worst relative error over its launch configurations}
    return {kernel: max(e for k, _, e in results if k == kernel) for kernel, _, _ in results}


def check_kernels(device, cfg):
    return worst_errors(kernel_checks(device, cfg))


HEAD_TOLERANCE = 2**-14  # relative to a row's largest logit: float32 accumulation is ~1e-7; bf16 rounding is 2**-9


def pick_head(device, cfg):
    """(float32 head, relative error): head_out_dtype where the backend takes out_dtype and its logits match float64
    math on random rows of this model's width to float32's accuracy (a backend that rounded them to bf16 would fail),
    else head_upcast."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(67, cfg.hidden_size, generator=gen).to(device, DTYPE)
    w = (torch.randn(1000, cfg.hidden_size, generator=gen) / cfg.hidden_size ** 0.5).to(device, DTYPE)
    want = x.double() @ w.double().T
    for head in (head_out_dtype, head_upcast):
        try:
            got = head(x, w, torch.empty(want.shape, dtype=torch.float32, device=device))  # into room, as the loss
            error = check_error(got.double(), want) if got.dtype == torch.float32 else math.inf
        except Exception as e:  # the CPU has no out_dtype kernel (torch 2.15): NotImplementedError
            error, reason = math.inf, failure(e)
        else:
            reason = f"differs from float64 math by {error:.3g}"
        if error <= HEAD_TOLERANCE:
            return head, error
        if device.type == "cuda" or head is head_upcast:
            log(f"float32 logits: {head.__name__} unusable on {device} ({reason})")
    raise RuntimeError("no float32 LM head matches float64 math")


FUSED_DEVICES = ("cuda",)  # where "auto" tries the fused kernels (tests: the CPU, with stand-ins or the interpreter)


def pick_kernels(requested, device, cfg):
    """(kernels, {kernel: error}): Triton's fused kernels where Triton runs on this device and each matches float32
    math in every launch configuration the model's run makes, else PyTorch (with the failing launches named). The
    router's (route_triton) is refused alone: where it fails route_checks (this device's torch.topk breaks ties
    otherwise, or a miscompile), route runs beside the other fused kernels, under "triton" too."""
    head, head_error = pick_head(device, cfg)  # the float32 logits' GEMM, whichever kernels run beside it
    if requested == "torch" or (requested == "auto" and device.type not in FUSED_DEVICES):
        return dataclasses.replace(TORCH_KERNELS, head=head), {"lm_head": head_error}
    try:
        if triton is None:
            raise RuntimeError("triton is not installed")
        results = kernel_checks(device, cfg)
        wrong = [f"{kernel} ({launch}) by {error:.3g}" for kernel, launch, error in results
                 if not error <= CHECK_TOLERANCE and kernel != "route"]
        if wrong:
            raise RuntimeError(f"differ from float32 math: {'; '.join(wrong)}")
        kernels = dataclasses.replace(TRITON_KERNELS, head=head)
        routing = [f"{launch} by {error:.3g}" for kernel, launch, error in results
                   if kernel == "route" and not error <= CHECK_TOLERANCE]
        if routing:
            log(f"fused routing unavailable on {device} (other experts or weights than route's: {'; '.join(routing)})"
                "; using PyTorch's")
            kernels.route, results = TORCH_KERNELS.route, [r for r in results if r[0] != "route"]
        return kernels, {**worst_errors(results), "lm_head": head_error}
    except Exception as e:
        if requested == "triton":
            raise UserError(f"--kernels triton is unusable on {device}: {e}") from None
        log(f"fused Triton kernels unavailable ({failure(e)}); using PyTorch")
        return dataclasses.replace(TORCH_KERNELS, head=head), {"lm_head": head_error}


def gemm_shapes(cfg, tokens=4096):
    # (name, M, N, K) of each GEMM of a layer step (the gated MLP's where some layer has one), then the loss's last;
    # a MoE layer's experts are grouped GEMMs, not these (pick_experts times them). Each name but lm_head's is that of
    # its weight in LayerWeights; latent attention's up-projections (q_b where q has a LoRA, kv_b) among them
    H, I, R = cfg.hidden_size, cfg.intermediate_size, cfg.kv_lora_rank
    latent = ([("q_b", tokens, cfg.q_size, cfg.q_lora_rank)] if cfg.q_lora_rank else []) + [
        ("kv_b", tokens, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), R)] if R else []
    mlp = [("gate_up", tokens, 2 * I, H), ("down", tokens, H, I)] if "mlp" in cfg.layouts else []
    return [("qkv", tokens, cfg.qkv_rows, H), *latent, ("o_proj", tokens, H, cfg.num_attention_heads * cfg.v_head_dim),
            *mlp, ("lm_head", tokens, cfg.vocab_size, H)]


def gemm_tflops(device, shapes, weights=None, repeats=TIMING_REPEATS):
    # {name: TFLOP/s} of bf16 x @ w.T for each (name, M, N, K), the median of `repeats` calls after one, with whichever
    # BLAS library torch prefers now; w is weights[name] where given (the model's own: no extra memory), else random
    gen = torch.Generator(device=device).manual_seed(0)
    rates = {}
    for name, M, N, K in shapes:
        x = torch.randn(M, K, generator=gen, device=device, dtype=DTYPE)
        w = (weights or {}).get(name)
        w = torch.randn(N, K, generator=gen, device=device, dtype=DTYPE) if w is None else w
        F.linear(x, w)
        rates[name] = 2 * M * N * K / (gated_ms(device, lambda: F.linear(x, w), repeats) / 1e3) / 1e12
        del x, w
    return rates


BLAS_LIBRARIES = ["cublas", "cublaslt"]  # torch.backends.cuda.preferred_blas_library's names: on ROCm, rocBLAS and
# hipBLASLt (torch/backends/cuda/__init__.py); gfx1100 defaults to rocBLAS, and hipBLASLt is supported there (ROCm's hipBLASLt support matrix)


def blas_library():
    return torch.backends.cuda.preferred_blas_library().name.lower()


def pick_blas(device, cfg, picks):
    """The BLAS library for bf16 GEMMs: on ROCm rocBLAS (gfx1100's default), unless hipBLASLt takes at most
    1 - PICK_MARGIN of its time on one layer's GEMM shapes (~90% of the W7800's time), measured once per machine and
    kept; TORCH_BLAS_PREFER_HIPBLASLT, where set, decides instead.
    Elsewhere torch's default. Returns (library, {library: {shape: TFLOP/s}}) (empty where nothing was timed)."""
    if device.type != "cuda" or torch.version.hip is None or "TORCH_BLAS_PREFER_HIPBLASLT" in os.environ:
        return (blas_library() if device.type == "cuda" else None), {}
    kept, rates = picks.get("blas"), {}
    if kept not in BLAS_LIBRARIES and picks.writable():
        for library in BLAS_LIBRARIES:
            torch.backends.cuda.preferred_blas_library(library)
            rates[library] = gemm_tflops(device, gemm_shapes(cfg)[:-1])
        seconds = {lib: sum(2 * M * N * K / (r[name] * 1e12) for name, M, N, K in gemm_shapes(cfg)[:-1])
                   for lib, r in rates.items()}
        kept = pick_order(BLAS_LIBRARIES, seconds.get)[0]
        picks.put("blas", kept)
    if kept in BLAS_LIBRARIES:
        torch.backends.cuda.preferred_blas_library(kept)
    return blas_library(), rates


class Picks:
    """The choices that only timing could make, kept per machine in a JSON file: {machine_key: {what: choice}}."""

    def __init__(self, path, key):
        self.path, self.key = (Path(path) if path else None), key
        self.lock = threading.Lock()

    def _read(self):
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError, AttributeError):
            return {}

    def get(self, what):
        entry = self._read().get(self.key)
        return entry.get(what) if isinstance(entry, dict) else None

    def writable(self):
        if self.path is None:
            return False
        folder = self.path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        return os.access(self.path if self.path.exists() else folder, os.W_OK)

    def put(self, what, choice):
        with self.lock:  # the attention and BLAS picks run on two threads
            data = self._read()
            entry = data.get(self.key) if isinstance(data.get(self.key), dict) else {}
            data[self.key] = dict(entry, **{what: choice})
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
                tmp.write_text(json.dumps(data, indent=1))
                os.replace(tmp, self.path)  # never a half-written file for another process to read
            except OSError as e:
                log(f"warning: cannot keep the start-up picks in {self.path}: {e.strerror}")


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_key(device, cfg):
    # the GPU, the versions of torch, its GPU runtime, Triton and flash-attn, the model's geometry and this very
    # file's contents: a change in any of them measures again
    try:
        source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:
        source = "?"
    gpu = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = [props.name, gpu_arch(props), props.multi_processor_count]
    versions = [torch.__version__, torch.version.hip or torch.version.cuda,
                triton.__version__ if triton is not None else None, package_version("flash_attn")]
    geometry = [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim]
    geometry += [cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size] if cfg.num_experts else []
    geometry += [cfg.v_head_dim] if cfg.v_head_dim != cfg.head_dim else []
    geometry += [cfg.model_type] + [[how.scale, how.window, how.softcap] + ([how.sinks] if how.sinks else [])
                                    for how in attention_settings(cfg)]
    return json.dumps([device.type, *gpu, *versions, *geometry, source])


def default_picks_path():
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefill" / "picks.json"


# ----------------------------------------------------------------------------- packing and loss

BATCH_TEXTS = 8192  # texts in one batch at most, so that a run of texts too short to compute cannot pile up


# A corpus's batch (--output without --wave-tokens; records land a batch at a time): about BATCH_SECONDS of compute
# at its device family's nominal rate, so that a record lands every few seconds and an interrupt loses at most that
# much work, whatever the device. The rate is fixed per family and never measured, and so is the batch: which texts
# share a batch decides the last bits of their numbers (on two AVX2 cores a float32 GEMM of 1-3, 5-7 or 9-11 rows sums
# in another order than one of more, and a batch's last loss chunk can be that short: bench/NOTES.md, issue 38; a GPU
# picks GEMM kernels and attention backends by sizes), so that a resumed run must cut the batches the interrupted
# one cut: the batch is kept in OUT.settings.json, and another is refused. GPUs: the wave plan's nominal rates
# (PLAN_RATES), at which Qwen3-32B's 64 GFLOP a token fill the 65,536 tokens of the default wave on NVIDIA and 8,192
# on RDNA3; the CPU: two AVX2 cores (bf16 GEMMs at ~8 GFLOP/s a core, the float32 head at ~60).
BATCH_SECONDS = 10
BATCH_TFLOPS = {**{family: tflops for family, (_, tflops) in PLAN_RATES.items()}, "cpu": 0.02}
BATCH_MIN_TOKENS = 256


def timed_batch_tokens(cfg, family):
    """A corpus's batch for cfg on a device of family: the largest power of two of tokens, from BATCH_MIN_TOKENS to
    WAVE_STEP, whose FLOPs (every layer's matrices and the head; attention's scores left out) take at most
    BATCH_SECONDS at the family's nominal rate. Settings and model alone: no timing, no free memory."""
    flops = sum(layer_flops(cfg, kind, 1) for kind in cfg.layer_kinds) + 2 * cfg.hidden_size * cfg.vocab_size
    tokens = int(BATCH_SECONDS * BATCH_TFLOPS[family] * 1e12 / flops)
    return max(BATCH_MIN_TOKENS, min(WAVE_STEP, 1 << max(0, tokens.bit_length() - 1)))


@dataclass
class Wave:
    seqs: list        # positions (in the batch) of the sequences in this wave, in packing order
    lengths: list
    ids: torch.Tensor  # [tokens] int64, host
    chunks: list      # Chunk, with cu_seqlens still None


def batches(items, wave_tokens, max_texts=BATCH_TEXTS):
    """Groups (index, ids, item) triples, in order, into batches that run as one wave each. A text of >= 2 tokens
    starts a new batch where it would take the batch past wave_tokens (a longer text runs alone); shorter texts (no
    loss, nothing to compute) ride along. The cut depends on the token counts and the settings alone, never on
    memory or timing, so a corpus run and its resumption form the same batches, and each text's numbers with them:
    GEMM kernels pick their algorithm by the number of rows, which a text's last bits can depend on."""
    batch, tokens = [], 0
    for item in items:
        n = len(item[1])
        if batch and (len(batch) == max_texts or n >= 2 and tokens and tokens + n > wave_tokens):
            yield batch
            batch, tokens = [], 0
        batch.append(item)
        tokens += n if n >= 2 else 0
    if batch:
        yield batch


def wave_of(token_lists, chunk_tokens):
    """The sequences with >= 2 tokens of one batch, in order, packed into chunks of whole sequences (<= chunk_tokens,
    unless a sequence is longer); None when no sequence has two tokens."""
    seqs = [i for i, ids in enumerate(token_lists) if len(ids) >= 2]
    if not seqs:
        return None
    chunks, bounds = [], None
    for i in seqs:
        n = len(token_lists[i])
        if bounds is None or bounds[-1] - bounds[0] + n > chunk_tokens:
            bounds = [bounds[-1] if bounds else 0]
            chunks.append(bounds)
        bounds.append(bounds[-1] + n)
    return Wave(seqs, [len(token_lists[i]) for i in seqs],
                torch.tensor([t for i in seqs for t in token_lists[i]], dtype=torch.int64),
                [Chunk(c[0], c[-1], [b - c[0] for b in c], None, max(b - a for a, b in zip(c, c[1:]))) for c in chunks])


@dataclass
class Score:
    index: int      # the text's position in the input
    tokens: int
    loss: float     # mean NLL of the text's next-token predictions (transformers' loss); None below 2 tokens
    nll_sum: float  # their float64 sum (0.0 below 2 tokens): sums and token counts combine into a corpus's mean


def scores_of(batch, sums):
    # the texts' NLL sums say all the rest: a rank other than the one that ran a batch rebuilds the same Scores
    return [Score(index, len(ids), total / (len(ids) - 1) if len(ids) >= 2 else None, total)
            for (index, ids, _), total in zip(batch, sums)]


def sequence_nll(h, lm_head, final_norm, targets, seq_index, n_seqs, cfg, chunk_tokens, kernels):
    # h: [tokens, hidden]; targets: [tokens] (next token, -100 after each sequence's last); seq_index: [tokens] on the
    # host. Returns [n_seqs] float64 sums, added on the host in token order: index_add_ on a GPU adds with atomics in
    # whatever order the threads arrive, so its last bits would vary from run to run.
    nll = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    room = torch.empty(min(chunk_tokens, h.shape[0]), cfg.vocab_size, dtype=torch.float32, device=h.device) \
        if LOGITS["texts"] == "float32" else None  # every chunk's logits, in turn
    for s in range(0, h.shape[0], chunk_tokens):
        logits = lm_logits(h[s:s + chunk_tokens], lm_head, final_norm, cfg, kernels, LOGITS["texts"], room)
        nll[s:s + chunk_tokens] = kernels.token_nll(logits, targets[s:s + chunk_tokens])  # logits: [chunk, vocab]
    return torch.zeros(n_seqs, dtype=torch.float64).index_add_(0, seq_index, nll.cpu().double())


# ----------------------------------------------------------------------------- evaluation: the prefix tree
# Evaluation mostly asks for the log-likelihood of a continuation given a context (multiple choice, LAMBADA, rolling
# perplexity): lm-eval's (context_enc, continuation_enc) reads (context + continuation)[:-1] and scores the
# continuation's tokens. A batch of such requests runs as one wave of a prefix tree: every request's input is a path
# of a trie, whose unique tokens go through the layers once, each at its depth as its position (RoPE sees what it
# would see alone), attending to its ancestors whole and causally within its own node. A position that several
# requests read is computed once and scored against each one's target (MMLU's " A".." D" read the same last context
# token), and only the scored positions go through the final norm, lm_head and log-softmax.

@dataclass
class Request:
    context: list       # token ids, at least one
    continuation: list  # token ids, at least one: the targets that count

    @property
    def input(self):  # the tokens the model reads
        return self.context + self.continuation[:-1]


@dataclass
class Loglikelihood:
    index: int           # the request's position in the input
    logprob: float       # the sum of its continuation tokens' float32 log-probs, added in float64 in a fixed order
    tokens: int          # continuation tokens scored
    greedy: bool         # every continuation token is the argmax of the logits that predict it
    token_logprobs: list = None  # each continuation token's log-prob, where asked for


def as_request(context, continuation, where="request"):
    # C-speed checks (a token-by-token loop over MMLU-shaped requests cost 0.3 s of host time): ints only, not bools
    if not (isinstance(context, (list, tuple)) and isinstance(continuation, (list, tuple))
            and set(map(type, context)) | set(map(type, continuation)) <= {int}
            and min(context, default=0) >= 0 and min(continuation, default=0) >= 0):
        raise UserError(f"{where}: context and continuation must be lists of token ids")
    if not context or not continuation:
        raise UserError(f"{where}: the {'context' if not context else 'continuation'} has no token (each needs one: "
                        "a continuation is predicted from at least one token)")
    return Request(context if type(context) is list else list(context),  # read, never changed: no copy
                   continuation if type(continuation) is list else list(continuation))


def order_key(request):
    """Bytes that sort as the request's tokens (context + continuation) do as a tuple of ints: big-endian int64
    compared by memcmp, where tuples of MMLU-shaped requests, 700 shared tokens each, compared element by element
    (0.1 s of host time for 2,000 inside a one-wave request's timed window)."""
    tokens = array.array("q", request.context)
    tokens.extend(request.continuation)
    if sys.byteorder == "little":
        tokens.byteswap()
    return tokens.tobytes()


class PrefixTrie:
    """The trie of request inputs, each chain of tokens without a branching kept as one node (a radix trie): a shared
    prefix is matched by list comparisons, not token by token (2,000 MMLU-shaped requests of 780 tokens took 0.56 s
    of host time token by token on the CPU, inside the timed window of a one-wave request). Node 0 is the root and
    holds no token; children are in the order they were first inserted; an input may end inside a node."""

    def __init__(self):
        self.runs, self.parent, self.children = [[]], [None], [{}]
        self.tokens = 0  # the tokens the trie holds

    def walk(self, ids):
        """([(node, how many of its tokens ids reads)], how many of ids the trie holds), along ids from the root."""
        node, i, path = 0, 0, []
        while i < len(ids) and (child := self.children[node].get(ids[i])) is not None:
            run = self.runs[child]
            n = min(len(run), len(ids) - i)
            if run[:n] != ids[i:i + n]:  # the first token matches (the child's key): bisect for the last one
                lo, hi = 1, n
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if run[:mid] == ids[i:i + mid] else (lo, mid)
                n = lo
            path.append((child, n))
            i += n
            if n < len(run):
                break
            node = child
        return path, i

    def insert(self, ids):
        path, i = self.walk(ids)
        if i == len(ids):
            return
        node, n = path[-1] if path else (0, 0)
        if path and n < len(self.runs[node]):  # ids leave the node inside it: its first n tokens become its parent
            run, above = self.runs[node], self.parent[node]
            head = self._add(above, run[:n])  # takes the node's place among its parent's children, in order
            self.runs[node], self.parent[node] = run[n:], head
            self.children[head][run[n]] = node
            node = head
        if node and not self.children[node]:  # a chain that ended here goes on
            self.runs[node] = self.runs[node] + ids[i:]
        else:
            self._add(node, ids[i:])
        self.tokens += len(ids) - i

    def _add(self, parent, run):
        self.runs.append(run)
        self.parent.append(parent)
        self.children.append({})
        self.children[parent][run[0]] = len(self.runs) - 1
        return len(self.runs) - 1


def request_batches(items, wave_tokens, max_requests=BATCH_TEXTS):
    """Groups (index, Request, item) triples, in order, into batches that run as one prefix-tree wave each. A request
    starts a new batch where the tokens it adds to the batch's trie (those no earlier request of the batch read)
    would take the batch past wave_tokens; the new batch holds its whole path again. As batches(), the cut depends
    on the requests and the settings alone, so resumed and torchrun runs form the same batches."""
    batch, trie = [], PrefixTrie()
    for item in items:
        ids = item[1].input
        trie.insert(ids)  # into the batch's trie, which is dropped if the request goes to the next batch
        if batch and (len(batch) == max_requests or trie.tokens > wave_tokens):
            yield batch
            batch, trie = [], PrefixTrie()
            trie.insert(ids)
        batch.append(item)
    if batch:
        yield batch


@dataclass
class TreeWave:
    ids: torch.Tensor        # [tokens] int64, host: the trie's tokens depth first, every node after its ancestors
    positions: torch.Tensor  # [tokens] int64: each token's depth, its position in each request that reads it
    parents: torch.Tensor    # [tokens] int64: the wave index of each token's parent token, -1 at a root
    chunks: list             # Chunk of whole nodes (a node is cut at chunk_tokens); ancestors where a node has any
    rows: torch.Tensor       # [pairs] int64, ascending: the row whose logits score each distinct (row, target)
    targets: torch.Tensor    # [pairs] int64
    pairs: list              # per request: the pairs of its continuation's tokens, in order
    requested: int           # the tokens the requests read, shared or not


def tree_wave(requests, chunk_tokens, device):
    """The prefix tree of requests' inputs as one wave. Nodes are the trie's chains between branchings, cut into
    pieces of chunk_tokens (a piece's ancestors include the pieces before it); depth first, every node's ancestors
    come before it, so a chunk of consecutive nodes (<= chunk_tokens) finds its ancestors' keys computed."""
    trie = PrefixTrie()
    for r in requests:
        trie.insert(r.input)
    ids, positions, parents = [], [], []  # per wave token, depth first
    start, depth, covered = {}, {0: 0}, {0: []}  # per trie node: its first token's wave index and depth; the key
    nodes = []  # ranges of its path, merged; [start in the wave, length, the ancestors' key ranges] per piece
    stack = list(reversed(trie.children[0].values()))
    while stack:
        t = stack.pop()
        p, run, s = trie.parent[t], trie.runs[t], len(ids)
        start[t], depth[t] = s, depth[p] + len(trie.runs[p])
        ids += run
        positions += range(depth[t], depth[t] + len(run))
        parents += [start[p] + len(trie.runs[p]) - 1 if p else -1, *range(s, s + len(run) - 1)]
        ranges = covered[p]
        for piece in range(s, s + len(run), chunk_tokens):
            end = min(piece + chunk_tokens, s + len(run))
            nodes.append([piece, end - piece, ranges])
            touching = ranges and ranges[-1][1] == piece  # ranges that touch are one
            ranges = ranges[:-1] + [(ranges[-1][0], end)] if touching else ranges + [(piece, end)]
        covered[t] = ranges
        stack.extend(reversed(trie.children[t].values()))
    chunks, group, depths = [], [], torch.tensor(positions, dtype=torch.int32, device=device)
    for node in nodes + [None]:
        if group and (node is None or group[-1][0] + group[-1][1] - group[0][0] + node[1] > chunk_tokens):
            bounds = [s - group[0][0] for s, _, _ in group] + [group[-1][0] + group[-1][1] - group[0][0]]
            ancestors = [ranges for _, _, ranges in group]
            chunk = Chunk(group[0][0], group[0][0] + bounds[-1], bounds,
                          torch.tensor(bounds, dtype=torch.int32, device=device), max(l for _, l, _ in group),
                          ancestors if any(ancestors) else None)
            if chunk.ancestors is not None:
                counts = [0] + [len(r) for r in ancestors]
                chunk.ancestor_bounds = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32,
                                                     device=device)
                chunk.ancestor_ranges = torch.tensor([list(r) for rs in ancestors for r in rs] or [[0, 0]],
                                                     dtype=torch.int32, device=device)
                chunk.depths = depths
            chunks.append(chunk)
            group = []
        if node is not None:
            group.append(node)
    index, pairs = {}, []  # (row, target) -> pair
    for r in requests:
        rows, want = [], len(r.continuation)  # the wave rows of the input's last `want` tokens: they are scored
        for t, n in reversed(trie.walk(r.input)[0]):
            take = min(want - len(rows), n)
            rows[:0] = range(start[t] + n - take, start[t] + n)
            if len(rows) == want:
                break
        pairs.append([index.setdefault((row, target), len(index)) for row, target in zip(rows, r.continuation)])
    keys = sorted(index)
    renumber = {index[key]: j for j, key in enumerate(keys)}
    return TreeWave(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                    torch.tensor(parents, dtype=torch.int64), chunks,
                    torch.tensor([row for row, _ in keys], dtype=torch.int64),
                    torch.tensor([target for _, target in keys], dtype=torch.int64),
                    [[renumber[p] for p in mine] for mine in pairs], sum(len(r.input) for r in requests))


# --- the prefix tree's attention: which backends read it, checked at the first tree

# The backends that read a prefix tree's chunks (ancestor key ranges; the evaluation section): prefill's Triton kernel
# and SDPA. The others (flash-attn, torch's flash and cuDNN kernels) run only the chunks whose sequences have no
# ancestors, which every text of the whole-text path is.
TREE_KINDS = ("triton", "sdpa")


# The tree the check runs: a 300-token root whose children are 37 and 100 tokens, the 100's children 650 and 5, a
# second root of 70 with children of 64 and 1; cut into chunks of 512, the 650 in two pieces, so that nodes read
# ancestors in earlier chunks, two ranges apart, a range ending mid-tile, and no ancestors at all. A window that does
# not end 100 tokens above its deepest (1050) adds a branch 300 deeper than the window under the 300 and the 100, so
# that the window's edge falls inside the ancestors' keys and inside the node's own.
TREE_CHECK = ([[300, 37], [300, 100, 650], [300, 100, 5], [70, 64], [70, 1]], 512)


def tree_visibility(parents, rows, window=None):
    """[rows, tokens] bool: which of a prefix tree's tokens each of `rows` (wave indices) attends to, itself and its
    ancestors (with a window: those less than `window` above it), from each token's parent alone (parents: [tokens]
    int64, -1 at a root), so that it checks the tree's key ranges, chunks and depths rather than restate them. Token j
    is row i's ancestor where i's ancestor at i's depth less j's depth is j (binary lifting over the distance's
    bits)."""
    tokens = parents.numel()
    up = torch.where(parents < 0, torch.arange(tokens), parents)  # a root's parent: itself
    depth = torch.zeros(tokens, dtype=torch.int64)
    for i in range(tokens):  # parents come first in the wave
        depth[i] = depth[up[i]] + 1 if parents[i] >= 0 else 0
    distance = depth[rows][:, None] - depth[None, :]  # [rows, tokens]
    at = rows[:, None].expand(-1, tokens).clone()
    for bit in range(max(1, int(depth.max()) + 1).bit_length()):
        at = torch.where((distance >> bit) & 1 == 1, up[at], at)
        up = up[up]
    seen = (distance >= 0) & (at == torch.arange(tokens)[None, :])
    return seen if window is None else seen & (distance < window)


def tree_check_cases(device, cfg):
    # (settings, sharp, (q, k, v, chunk), float32 reference) of each chunk of TREE_CHECK's wave that has ancestors,
    # for each of the model's attention settings (sharp inputs too where a window or softcap is to show, as
    # check_cases): q the chunk's, k/v the wave's; the reference's visibility from each token's parent, not from the
    # chunks' key ranges or depths
    branches, chunk_tokens = TREE_CHECK
    for how in attention_settings(cfg):
        deep = [[300, 100, how.window - 100]] if how.window and how.window + 100 > max(map(sum, branches)) else []
        gen = torch.Generator().manual_seed(3)
        requests, stems = [], {}
        for branch in branches + deep:  # the same stem, the same tokens: requests that share a prefix
            ids = [t for depth in range(len(branch)) for t in stems.setdefault(
                tuple(branch[:depth + 1]), torch.randint(cfg.vocab_size, (branch[depth],), generator=gen).tolist())]
            requests.append(Request(ids[:1], ids[1:] + [0]))
        wave = tree_wave(requests, chunk_tokens, device)
        q, k, v, _ = attention_inputs(device, cfg, [wave.ids.numel()], seed=4)
        for sharp in (False, True) if how.window or how.softcap else (False,):
            qs = sharpened(q, cfg, how) if sharp else q
            for c in wave.chunks:
                if c.ancestors is not None:
                    seen = tree_visibility(wave.parents, torch.arange(c.start, c.end), how.window).to(device)
                    yield how, sharp, (qs[c.start:c.end], k, v, c), tree_attention_reference(
                        qs[c.start:c.end], k, v, seen, how, **check_sinks(how, q.shape[1], device))


def pick_tree_attention(requested, device, cfg):
    """(name, attend, report) for a prefix tree's chunks: the first of the TREE_KINDS candidates (prefill's Triton
    kernel in this GPU family's and model's tiles, then SDPA) that matches float32 attention on TREE_CHECK's chunks
    with each of the model's attention settings (scale, window by depth, softcap, sinks), twice alike.
    Nothing is timed: where Triton runs it is the one. --attention triton or sdpa (or one's name) asks for that one;
    a backend without a tree variant asks for none in particular."""
    named = requested if isinstance(requested, str) and requested.split()[0] in TREE_KINDS else "auto"
    candidates = [c for c in attention_candidates(named, gpu_family(device), cfg, tree_attention_tiles)
                  if c[1] in TREE_KINDS]
    report = check_attention(candidates, device, cfg, tree_check_cases(device, cfg))
    entry = next((e for e in report if e["attend"] is not None), None)
    if entry is None:
        raise UserError(f"no attention backend reads a prefix tree on {device}: "
                        + "; ".join(f"{e['name']}: {e['reason']}" for e in report))
    return entry["name"], entry["attend"], report


def continuation_logprobs(h, rows, targets, lm_head, final_norm, cfg, chunk_tokens, kernels):
    """h: [tokens, hidden]; rows, targets: [pairs] int64 on the host, rows ascending. The float32 log-prob of each
    target at its row, and whether it is the row's argmax: the final norm, lm_head (tied or not) and final softcap
    (lm_logits, the loss's own) on the scored rows alone, a row once however many targets read it, chunk_tokens pairs
    at a time; the log-softmax is the loss's own kernel (token_nll, negated). Returns ([pairs] float32, [pairs] bool)
    on the host."""
    logprob = torch.empty(rows.numel(), dtype=torch.float32, device=h.device)
    greedy = torch.empty(rows.numel(), dtype=torch.bool, device=h.device)
    room = torch.empty(min(chunk_tokens, rows.numel()), cfg.vocab_size, dtype=torch.float32, device=h.device) \
        if LOGITS["continuations"] == "float32" else None  # every chunk's logits, in turn
    for s in range(0, rows.numel(), chunk_tokens):
        unique, inverse = torch.unique_consecutive(rows[s:s + chunk_tokens], return_inverse=True)
        logits = lm_logits(h[unique.to(h.device)], lm_head, final_norm, cfg, kernels, LOGITS["continuations"],
                           room)  # [rows, vocab] float32
        inverse, t = inverse.to(h.device), targets[s:s + chunk_tokens].to(h.device)
        greedy[s:s + t.numel()] = logits.argmax(-1)[inverse] == t
        if unique.numel() < t.numel():  # several targets read one row (a question's choices): a row for each
            logits = logits[inverse]
        logprob[s:s + t.numel()] = -kernels.token_nll(logits, t)
    return logprob.cpu(), greedy.cpu()


# ----------------------------------------------------------------------------- tokenizer

# Tokenizer classes whose tokenizer.json holds the whole tokenizer: transformers' fast class runs that file's
# pipeline (encode_batch with add_special_tokens) and adds nothing of its own. For these, the `tokenizers` library
# (Rust, a transformers dependency) loads it in 0.3 s, where importing transformers takes 5-10 s on the H200 machine
# and holds the GIL against the loading threads meanwhile (bench/results/primitives/…-threads-tokenizer.json).
# tests/test_prefill.py checks the ids against transformers' on texts with special tokens, unicode, empty strings.
PLAIN_TOKENIZERS = ("Qwen2Tokenizer", "Qwen2TokenizerFast")


# added-token fields that change how text is split; transformers adds a token the file lacks, or re-flags it
ADDED_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


def plain_tokenizer(model_dir):
    """`tokenizers.Tokenizer` of model_dir's tokenizer.json where it gives exactly transformers' ids; None where
    anything in tokenizer_config.json would make transformers differ (or where either file is missing or odd):
    then transformers loads it."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        import tokenizers
    except (OSError, ValueError, ImportError):
        return None
    if not isinstance(config, dict) or not isinstance(spec, dict) or not isinstance(spec.get("added_tokens"), list):
        return None
    added = {t.get("id"): t for t in spec["added_tokens"] if isinstance(t, dict)}
    contents = {t.get("content") for t in added.values()}
    declared = config.get("added_tokens_decoder") or {}
    specials = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                                        "mask_token")] + list(config.get("additional_special_tokens") or [])
    if (config.get("tokenizer_class") not in PLAIN_TOKENIZERS
            or any(config.get(k) for k in ("add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens",
                                           "do_lower_case", "tokenizer_file"))
            or spec.get("truncation") is not None or spec.get("padding") is not None
            or not isinstance(declared, dict)
            or not all(isinstance(t, dict) and str(i).isdigit() and int(i) in added
                       and all(t.get(f) == added[int(i)].get(f) for f in ADDED_TOKEN_FIELDS)
                       for i, t in declared.items())
            or not all(s is None or isinstance(s, str) and s in contents
                       for s in (s.get("content") if isinstance(s, dict) else s for s in specials))):
        return None
    try:
        return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception:  # noqa: BLE001 (a file tokenizers cannot read: transformers reports what is wrong with it)
        return None


def transformers_tokenizer(model_dir):
    # The class AutoTokenizer would pick (tokenizer_config.json's tokenizer_class, its fast variant first), named
    # directly: AutoTokenizer's own import pulls in transformers' model-loading machinery (generation, sklearn,
    # torch.distributed.tensor), 4.8 s of imports on the H200 machine. AutoTokenizer where the name is unknown.
    import transformers
    transformers.logging.set_verbosity_error()  # no "sequence longer than model_max_length" chatter on stderr
    try:
        name = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class") or ""
    except (OSError, ValueError, AttributeError):
        name = ""
    named = [getattr(transformers, n, None) for n in (name + "Fast", name) if n.isidentifier()]
    cls = next((c for c in named if c is not None), None) or transformers.AutoTokenizer  # touched only if needed
    try:
        tokenizer = cls.from_pretrained(str(model_dir), trust_remote_code=False)
        tokenizer("Hello, world.")
    except Exception as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot load the tokenizer from {model_dir}: {first_line[:300]}") from None
    return lambda texts: tokenizer(texts)["input_ids"]


def load_tokenizer(model_dir):
    """encode(texts) -> one list of token ids per text, as transformers' tokenizer(texts)["input_ids"] gives them
    (the loss's definition: README): from tokenizer.json alone where that is the same (plain_tokenizer), else through transformers."""
    plain = plain_tokenizer(model_dir)
    if plain is not None:
        def encode(texts):
            return [e.ids for e in plain.encode_batch(texts, add_special_tokens=True)]
    else:
        encode = transformers_tokenizer(model_dir)
    if not encode(["Hello, world."])[0]:  # a folder without tokenizer files gets an empty tokenizer: nan for every text
        raise UserError(f"no usable tokenizer in {model_dir} (tokenizer.json, or vocab.json and merges.txt)")
    return encode


# ----------------------------------------------------------------------------- loading
# The weights where the plans put them: the resident ones onto the GPU through each loading thread's small pinned
# staging buffers, the streamed ones page-locked in host memory (the checkpoint's page cache in place, or pinned
# copies) or left in storage, read every wave.

@dataclass
class Loaded:
    """What load_weights put where, and how it went (the log line, --stats, the doctor)."""
    on_device: dict         # name or layer -> its device buffer: the resident weights
    host: object            # HeldLayers or StorageRing: the streamed layers
    host_plan: object       # the HostPlan it followed (after a refused lock in place, the "copy" one)
    load_mode: str          # "mapped" or "copied"
    load_seconds: str       # the loading threads' phases
    lock_s: float           # seconds spent page-locking
    pinned_host_bytes: int  # page-locked for the run
    host_spare_bytes: int   # what host memory could give, before the load


def load_jobs(ckpt, jobs, workers, spans, streamed, plan, device, method, locked):
    """Loads jobs as the host plan says; returns (device buffers of the resident ones, streamed layer -> [(host
    bytes, offset)], whether the pages could be locked in place, the seconds page-locking took, the threads'
    phases as a line). Resident weights go through each loading thread's Stager: no page-locked host copy of them.
    Streamed layers are held as "map": the checkpoint's page cache locked in place (spans), on a thread of its own
    while the loading threads stage, as the two overlap (rates in bench/NOTES.md); or as "copy": exact-size host
    buffers filled straight from the checkpoint, then pinned (cheap once the pages exist); or, the plan's storage
    layers, not now: read every wave."""
    dev, cuda, mapped, streamed = device, device.type == "cuda", plan.load == "map", set(streamed)
    todo = [key for key in jobs if key not in streamed or not mapped and key not in plan.storage_layers]
    local, stagers, lock = threading.local(), queue.SimpleQueue(), threading.Lock()
    seconds = {"stage": 0.0} if mapped else {"fill": 0.0, "pin": 0.0, "stage": 0.0}  # thread-seconds

    def add(phase, s):
        with lock:
            seconds[phase] += s

    def stage(tensors, shape):
        if not hasattr(local, "stager"):
            local.stager = stagers.get()
        out = torch.empty(shape, dtype=DTYPE, device=dev)
        flat = out.view(-1)
        for name, offset, count, dtype in tensors:
            local.stager.put(ckpt, name, typed(flat, offset, count, dtype))
        return out

    def fill(tensors, flat):
        t = time.perf_counter()
        for name, offset, count, dtype in tensors:
            ckpt.read(name, typed(flat, offset, count, dtype))
        add("fill", time.perf_counter() - t)

    def load(key):
        tensors, shape = jobs[key]
        t = time.perf_counter()
        if key not in streamed:
            out = stage(tensors, shape)
            add("stage", time.perf_counter() - t)
            return out
        if not cuda:
            flat = host_empty(math.prod(shape))
            fill(tensors, flat)
            return flat
        flat, registered = pinned_empty(math.prod(shape), method, lambda buf: fill(tensors, buf))
        add("pin", time.perf_counter() - t)  # less the fill, below
        if registered:
            with lock:
                locked.append(flat)
        return flat

    threads, made = torch.get_num_threads(), []
    torch.set_num_threads(1)  # the loading threads' own copies: torch's intra-op threads would oversubscribe
    try:
        with ThreadPoolExecutor(workers) as pool:
            # every Stager's buffers are pinned before the lock's long registrations take the registrar thread
            if any(key not in streamed for key in todo):
                made = list(pool.map(lambda _: Stager(dev, method), range(workers)))
            for stager in made:
                stagers.put(stager)
            locking = None
            if mapped and cuda:
                locker = Workers(1, "prefill-locker")
                locking = locker.submit(ckpt.lock, spans, workers)
                locker.close()
            try:
                loaded = dict(zip(todo, pool.map(load, todo)))
                locked_in_place = locking is None or locking.result()
            except BaseException:
                if locking is not None:  # nothing stays locked, or goes on locking, behind the error
                    wait([locking])
                    ckpt.unlock()
                raise
    finally:
        torch.set_num_threads(threads)
        for stager in made:
            stager.close()  # waits for its last copies
    if mapped:
        lock_s = ckpt.lock_seconds
        phases = (f"{workers} threads: stage {seconds['stage']:.1f} s; in place: lock {ckpt.lock_seconds:.1f} s, "
                  f"{ckpt.read_ahead_bytes / 1e9:.1f} GB read ahead")
        host = {i: [(ckpt.raw(name), offset) for name, offset, _, _ in jobs[i][0]] for i in streamed}
    else:
        seconds["pin"] -= seconds["fill"] if cuda else 0.0
        lock_s = seconds["pin"]
        phases = f"{workers} threads: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + " s"
        host = {i: [(byte_range(loaded[i], offset, count * dtype.itemsize), offset) for _, offset, count, dtype in
                    jobs[i][0]] for i in streamed if i in loaded}
    return {key: buf for key, buf in loaded.items() if key not in streamed}, host, locked_in_place, lock_s, phases


def load_weights(ckpt, cfg, plan, device, method, fixed, workers, load, host_memory_gib, locked):
    """The weights where `plan` puts them (fixed: the embedding, final norm and head, each (name, shape)): a Loaded.
    Every host buffer page-locked on the way is added to `locked` as it is: the caller unlocks them when it goes,
    whether this returns or raises."""
    # jobs: the big fixed matrices first (each one thread's job of a layer's size), then the layers
    cuda = device.type == "cuda"
    jobs = {name: ([(name, 0, math.prod(shape), DTYPE)], shape) for name, shape in fixed}
    jobs.update({i: (layer_tensors(cfg, i), (n // DTYPE.itemsize,)) for i, n in enumerate(cfg.layer_nbytes)})
    t = time.perf_counter()
    host_spare_bytes = host_memory_spare()
    # the CPU locks nothing: no limit there unless --host-memory asks for one (the tests' storage runs)
    budget = int(host_memory_gib * GiB) if host_memory_gib is not None else host_spare_bytes if cuda else None
    bf16 = ckpt.as_held((name, dtype) for tensors, _ in jobs.values() for name, _, _, dtype in tensors)
    staging = 2 * workers * pinned_bytes(STAGING_BYTES, method) if cuda else 0
    streamed = plan.streamed_layers
    spans = ckpt.spans(name for i in streamed for name, _, _, _ in jobs[i][0])  # what "map" locks

    def host_plan(requested):
        return plan_host(cfg, streamed, budget, requested, device, bf16, map_lock_bytes(ckpt, spans), method,
                         staging)

    hosted = host_plan(load)
    on_device, pieces, in_place, lock_s, seconds = load_jobs(ckpt, jobs, workers, spans, streamed, hosted, device,
                                                             method, locked)
    if not in_place:  # the platform refused to lock the pages in place: pinned copies of the streamed layers
        ckpt.unlock()
        if load == "map":
            raise UserError("--load map: this platform refused to page-lock the checkpoint's pages in place; "
                            "--load copy works everywhere")
        hosted = host_plan("copy")
        _, pieces, _, lock_s, seconds = load_jobs(ckpt, {i: jobs[i] for i in streamed}, workers, spans, streamed,
                                                  hosted, device, method, locked)
    locked += ckpt.locked
    host = HeldLayers(pieces)
    if hosted.storage_layers:
        host = StorageRing(ckpt, cfg, streamed, hosted.storage_layers, host, hosted.ring_slots, device, method,
                           workers)
        locked += host.registered
    # page-locked for the run: the locked pages, or the pinned copies and the ring (the staging buffers are gone)
    pinned = (0 if not cuda else hosted.pinned_bytes - staging if hosted.load == "copy" else
              sum(t.nbytes for t in ckpt.locked))
    return Loaded(on_device, host, hosted, "mapped" if hosted.load == "map" else "copied",
                  seconds + f", total {time.perf_counter() - t:.1f} s", lock_s, pinned, host_spare_bytes)


# ----------------------------------------------------------------------------- the runner

TOKENIZE_GROUP = 256  # texts per tokenizer call: the fast tokenizer spreads a call's texts over the cores
AHEAD_BATCHES = 2     # batches read and tokenized ahead of the GPU: all the input a run holds at once


def since_process_start():
    # seconds since this process started, from /proc/self/stat's start time (clock ticks since boot: 10 ms steps);
    # None without /proc. What the harness's time to `ready` counts, imports and all.
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class PhaseTimer:
    """Per-phase wall time without synchronising the hot path: CUDA events, read once at the end."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self, phase):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def totals(self):
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (phase, a), (_, b) in zip(self.marks, self.marks[1:]):
            seconds = a.elapsed_time(b) / 1000 if self.cuda else b - a
            out[phase] = out.get(phase, 0.0) + seconds
        return out


# Device files that say this machine has a GPU even when torch sees none (a CPU-only or other-vendor torch build)
GPU_DEVICE_FILES = [("/dev/kfd", "AMD"), ("/dev/nvidiactl", "NVIDIA")]


def gpu_vendor_here():
    return next((vendor for path, vendor in GPU_DEVICE_FILES if os.path.exists(path)), None)


def choose_device(requested):
    """--device, else the GPU torch sees, else the CPU: but never the CPU by accident. Where a GPU was asked for, or
    the machine has one that this torch build cannot see (the default CUDA wheel on an AMD machine, a CPU-only wheel),
    stop with one line rather than run on the CPU for hours."""
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    gpu = gpu_vendor_here()
    if requested == "cuda" or gpu:
        build = (f"ROCm {torch.version.hip}" if torch.version.hip else
                 f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only")
        seen = f"torch {torch.__version__} ({build} build) sees no GPU"
        if gpu is None:
            raise UserError(f"{seen}, but --device cuda asks for one, and this machine shows none (no /dev/kfd or "
                            "/dev/nvidiactl): pass --device cpu")
        fix = ("install a ROCm build of torch (README: Install on AMD (ROCm))" if gpu == "AMD" else
               "install a CUDA build of torch (the locked one: uv sync) and check the driver (nvidia-smi)")
        raise UserError(f"{seen}, but this machine has an {gpu} GPU: {fix}, or pass --device cpu")
    return torch.device("cpu")


class Runner:
    """The model, loaded once: score() scores texts (the Python API), losses() token lists."""

    def __init__(self, model_dir, device=None, gpu_memory_gib=None, attention="auto", kernels="auto",
                 chunk_tokens=4096, wave_tokens=WAVE_STEP, workers=None, load="auto", pin="auto", picks=None,
                 host_memory_gib=None, experts="auto", timed_batches=False):
        t0 = time.perf_counter()
        self.load_wall_s, marks = {}, [t0]  # where time-to-ready goes, for --stats
        # when each phase of the time to `ready` ended, in seconds since the process started (--stats)
        self.since_start_s = {"runner_start": since_process_start()}  # the interpreter's start-up and imports

        def lap(phase):
            marks.append(time.perf_counter())
            self.load_wall_s[phase] = marks[-1] - marks[-2]

        self.device = choose_device(device)
        self.pin_method = pin_method(pin)
        self.cfg = cfg = ModelConfig.from_dir(model_dir)
        ckpt = Checkpoint(model_dir, cfg.tensor_prefixes)
        H, V = cfg.hidden_size, cfg.vocab_size
        fixed = [("model.embed_tokens.weight", (V, H)), ("model.norm.weight", (H,))]
        if not cfg.tie_word_embeddings:
            fixed.append(("lm_head.weight", (V, H)))
        check_tensors(ckpt, cfg, fixed)
        self.side_done_s = {}  # when each side task finished, in seconds since t0, for --stats

        def side_task(name, fn, *args):
            result = fn(*args)
            self.side_done_s[name] = time.perf_counter() - t0
            return result

        self.picks = picks if isinstance(picks, Picks) else Picks(default_picks_path() if picks is None else picks,
                                                                  machine_key(self.device, cfg))
        with ThreadPoolExecutor(5) as side:
            # the tokenizer (0.3 s from tokenizer.json, seconds when transformers is imported) overlaps the loading
            tokenizer = side.submit(side_task, "tokenizer", load_tokenizer, model_dir)
            self.times_attention = attention_to_time(attention, self.device, self.picks)
            self.wave_plan = None  # wave_tokens None: WAVE_STEP, or for a MoE model the wave plan_wave picks
            # timed_batches (a corpus's records): texts cut into batches of timed_batch_tokens, at most the wave, each
            # its own wave (where they are WAVE_STEP, a MoE model's planned wave still holds several)
            batch = min(timed_batch_tokens(cfg, gpu_family(self.device)), wave_tokens or WAVE_STEP) \
                if timed_batches else None
            budget = self._budget(gpu_memory_gib)

            def planned(cfg, budget=budget):
                if wave_tokens is None and cfg.num_experts and batch in (None, WAVE_STEP):
                    return plan_wave(cfg, budget, chunk_tokens, PLAN_RATES[gpu_family(self.device)])
                return plan_memory(cfg, budget, chunk_tokens, wave_tokens or WAVE_STEP, batch), None
            self.plan, self.wave_plan = planned(cfg)
            if cfg.can_hold_fp8_experts:  # held FP8 or not: decided at a budget free memory does not move
                held = held_experts_config(cfg, planned(cfg, self._held_budget(gpu_memory_gib))[0])
                if held is cfg and self.plan.total_bytes > budget:
                    free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else budget
                    raise UserError(held_experts_refusal(self.plan, planned(dataclasses.replace(
                        cfg, fp8_experts=True))[0], budget, self._held_budget(gpu_memory_gib), free))
                if held is not cfg:  # FP8 experts held apart: a smaller plan
                    self.cfg = cfg = held
                    self.plan, self.wave_plan = planned(cfg)
            plan = self.plan
            lap("setup")
            # so do the kernels' JIT compilation, checks and timings
            picked_attention = side.submit(side_task, "attention", pick_attention, attention, self.device, cfg,
                                           self.picks)
            picked_kernels = side.submit(side_task, "kernels", pick_kernels, kernels, self.device, cfg)

            def after(picked, fn, *args):
                picked.exception()  # waits: its timings would otherwise share the GPU with these GEMMs'
                return fn(*args)
            picked_blas = side.submit(side_task, "blas", after, picked_attention, pick_blas, self.device, cfg,
                                      self.picks)
            picked_experts = side.submit(side_task, "experts", after, picked_blas, lambda: pick_experts(
                experts, self.device, cfg, self.picks, plan.moe_chunk_tokens, picked_kernels.result()[0])) \
                if cfg.num_experts else None
            # Host memory page-locked in place, unlocked when this Runner goes and before it can be unmapped: freed
            # while registered, its addresses keep a stale registration that the next mapping there inherits (seen
            # on the H200: a later Runner's registrations and copies failed with "invalid argument").
            self.locked_host = []
            weakref.finalize(self, unpin_all, self.locked_host).atexit = False
            loaded = load_weights(ckpt, cfg, plan, self.device, self.pin_method, fixed,
                                  workers or min(16, os.cpu_count() or 1), load, host_memory_gib, self.locked_host)
            on_device, host, self.host_plan = loaded.on_device, loaded.host, loaded.host_plan
            self.load_mode, self.load_seconds, self.lock_s = loaded.load_mode, loaded.load_seconds, loaded.lock_s
            self.pinned_host_bytes, self.host_spare_bytes = loaded.pinned_host_bytes, loaded.host_spare_bytes
            lap("weights")
            self.since_start_s["weights"] = since_process_start()
            self.tokenizer = tokenizer.result()
            lap("tokenizer_wait")
            self.attention, self.attend, self.attention_report = picked_attention.result()
            self.kernels, self.kernel_errors = picked_kernels.result()
            self.blas, self.blas_tflops = picked_blas.result()
            # the expert kernel picked (None for a dense model), its experts function, the check's report
            self.experts, self.run_experts, self.experts_report = picked_experts.result() if picked_experts else \
                (None, None, [])
            lap("kernels_wait")
        if self.device.type == "cuda":  # the checks' and timings' scratch (2 GiB reserved with kept picks on the H200)
            torch.cuda.empty_cache()
        # The embedding lives on the device: a host-side gather would cost a pageable copy of every token's row
        # inside the timed window (66 ms for 45k tokens on the H200).
        self.embed, self.final_norm = on_device["model.embed_tokens.weight"], on_device["model.norm.weight"]
        self.lm_head = on_device.get("lm_head.weight", self.embed)
        self.streamer = WeightStreamer(cfg, {i: on_device[i] for i in plan.resident_layers}, host,
                                       plan.streamed_layers, self.device, self.kernels.dequantize_layer)
        weakref.finalize(self, self.streamer.stop)  # its threads end with this Runner, or before the process exits
        self.stats, self.timed_batches = {}, timed_batches
        self.requested_attention, self.tree_attend = attention, None  # the latter picked at the first prefix tree
        log(f"loaded {cfg.num_hidden_layers}-layer {cfg.model_type} ({self._model_bytes() / 1e9:.1f} GB) from "
            f"{model_dir} in {time.perf_counter() - t0:.1f} s on {self.device}, {self.load_mode} ({self.load_seconds}); "
            f"attention: {attention_summary(self.attention)}, elementwise kernels: {self.kernels.name}"
            + (f", experts: {self.experts}" if self.experts else "") + (" (held FP8)" if cfg.fp8_experts else "")
            + (f", BLAS: {self.blas}" if self.blas else ""))
        log(f"{plan.describe()}; {self.host_plan.describe()}")
        if self.wave_plan:
            log(self.wave_plan)
        self.since_start_s["loaded"] = since_process_start()  # the side tasks waited for, the slots filled

    def _budget(self, gpu_memory_gib):
        if self.device.type != "cuda":
            return int(gpu_memory_gib * GiB) if gpu_memory_gib is not None else 1 << 62
        free, _ = torch.cuda.mem_get_info(self.device)
        if gpu_memory_gib is None:  # room for the CUDA context's growth (kernels, BLAS handles) and the checks' scratch
            return max(0, free - int(1.5 * GiB) - (PICK_SCRATCH if self.times_attention else 0))
        if gpu_memory_gib * GiB > free:
            raise UserError(f"--gpu-memory {gpu_memory_gib:g} GiB exceeds the {free / GiB:.1f} GiB free on {self.device}")
        return int(gpu_memory_gib * GiB)

    def _held_budget(self, gpu_memory_gib):
        # the budget an FP8 MoE's experts are held FP8 or not at (held_experts_config): the setting, or on a GPU its
        # total memory less HELD_RESERVE, which the free memory never moves, whatever else holds some or what the
        # first run times
        if gpu_memory_gib is not None:  # (checked by _budget)
            return int(gpu_memory_gib * GiB)
        if self.device.type != "cuda":
            return 1 << 62
        return max(0, torch.cuda.mem_get_info(self.device)[1] - HELD_RESERVE)

    def _model_bytes(self):
        return (sum(self.cfg.layer_nbytes) + self.embed.nbytes
                + (0 if self.lm_head is self.embed else self.lm_head.nbytes))

    def tokenize(self, texts):
        return self.tokenizer(texts) if texts else []

    def score(self, texts, progress=None):
        """The Python API: scores texts (one string, or an iterable of strings read as it goes) with the model kept
        loaded, yielding one Score (index, tokens, loss, nll_sum) per text, in order, a batch at a time. The same
        path as the command line's: texts are tokenized a few batches ahead on a side thread, each batch runs as
        one wave, and batches are cut from the token counts alone, so the numbers are those of
        `prefill.py --input`. An item that is not a string raises UserError with the command line's message
        ("element 1 is int, not a string") once the batches before it are scored. self.stats covers this call
        alone: emptied when its iteration starts, complete once the iterator is exhausted. progress: a Progress to
        add each batch to, as it is scored."""
        texts = [texts] if isinstance(texts, str) else texts  # a string is one text, not an iterable of characters
        self.stats = {}
        with contextlib.closing(self.text_batches(text_of(t, f"element {i}") for i, t in enumerate(texts))) as cut:
            for batch in cut:
                scores = self.score_batch(batch)
                if progress is not None:
                    progress.add(len(scores), sum(s.tokens for s in scores))
                yield from scores

    def losses(self, token_lists, layers=None):
        """Mean losses (nan below 2 tokens) of token lists already tokenized, in the same batches as score (layers:
        see score_batch)."""
        self.stats = {}
        scores = [s for b in batches(((i, ids, None) for i, ids in enumerate(token_lists)), self.plan.batch_tokens)
                  for s in self.score_batch(b, layers)]
        return [math.nan if s.loss is None else s.loss for s in scores]

    def text_batches(self, items, text=None):
        """batches() of items (strings, or anything `text` maps to one), for score_batch: read and tokenized ahead
        (read_ahead)."""
        text = text or (lambda item: item)
        return self.read_ahead(items, lambda group, index: self.tokenize([text(item) for item in group]),
                               lambda tokenized: batches(tokenized, self.plan.batch_tokens), "text", len)

    def pair_batches(self, items, pair):
        """request_batches() of the Requests of items, for score_requests: `pair` maps an item to its (context,
        continuation) strings, tokenized as encode_pairs does, read ahead (read_ahead)."""
        def encoded(group, index):
            return [as_request(*ids, f"record {i}") for i, ids in
                    enumerate(self.encode_pairs([pair(item) for item in group]), index)]
        return self.read_ahead(items, encoded, lambda tokenized: request_batches(tokenized, self.plan.tree_wave_tokens),
                               "request", lambda request: len(request.input))

    def read_ahead(self, items, encoded, cut, kind, length):
        """The batches `cut` makes of items encoded by `encoded(group, index of its first)`, read and tokenized on a
        side thread at most AHEAD_BATCHES batches ahead: the CPU work overlaps the GPU's and memory stays bounded,
        whatever the length of the stream. An exception from the items (a bad record) is raised here after the
        batches before it. kind and length: what an item is called and its tokens, for _note_long_texts."""
        ahead, stop, end = queue.Queue(AHEAD_BATCHES), threading.Event(), object()

        def tokenized():
            items_left, index, error = iter(items), 0, None
            while not error and not stop.is_set():  # the consumer gone: read and tokenize no further
                group = []
                try:
                    group.extend(itertools.islice(items_left, TOKENIZE_GROUP))  # keeps what came before a failure
                except Exception as e:  # a bad record: the batches whole before it are still scored
                    error = e
                for item, ids in zip(group, encoded(group, index)):
                    yield index, ids, item
                    index += 1
                if not group and not error:
                    return
            raise error

        def put(thing):  # gives up once the consumer has gone
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    return ahead.put(thing, timeout=0.1)

        def produce():
            try:
                for batch in cut(tokenized()):
                    put(batch)
                    if stop.is_set():  # the consumer has gone: read no further
                        return
                put(end)
            except BaseException as e:  # noqa: B036 (handed to the consumer, which raises it)
                put(e)

        producer = threading.Thread(target=produce, name="prefill-tokenizer", daemon=True)
        producer.start()
        try:
            while True:
                t0 = time.perf_counter()
                batch = ahead.get()
                self.stats["tokenizer_wait_s"] = self.stats.get("tokenizer_wait_s", 0.0) + time.perf_counter() - t0
                if batch is end:
                    return
                if isinstance(batch, BaseException):
                    raise batch
                self._note_long_texts(batch, kind, length)
                yield batch
        finally:
            # closed by its consumer (the corpus loop, Runner.score) where the run ends, never left to a later garbage
            # collection or the interpreter's exit. The producer ends within a tokenizer call of `stop`; one blocked
            # reading its input (stdin) is left behind after a second, in CPython's own read, which the exit leaves be
            # (nothing on this thread runs torch, whose C++ a finalizing interpreter must not return into: on_signal)
            stop.set()
            producer.join(timeout=1.0)

    def _note_long_texts(self, batch, kind, length):
        # transformers computes a text past max_position_embeddings (RoPE has no hard limit) and so does prefill; the
        # numbers are outside what the model was trained on, which deserves one line (the first such text) a run
        limit = self.cfg.max_position_embeddings
        lengths = ((index, length(ids)) for index, ids, _ in batch)
        over = [(index, n) for index, n in lengths if limit and n > limit]
        if over and not self.stats.get("texts_over_positions"):
            log(f"warning: {kind} {over[0][0]} has {over[0][1]} tokens, more than the model's max_position_embeddings "
                f"({limit}, config.json): computed all the same, as transformers does (--stats texts_over_positions "
                "counts every such text)")
        if over:
            self.stats["texts_over_positions"] = self.stats.get("texts_over_positions", 0) + len(over)

    def score_batch(self, batch, layers=None):
        """One batch from text_batches() (or batches()), as one wave through every layer (or only `layers`: the warm-up's): its texts'
        Scores, in order. Adds to self.stats."""
        return self.score_wave([batch], layers)[0]

    @torch.inference_mode()
    def score_wave(self, group, layers=None):
        """Consecutive batches from batches() as one wave (each batch one segment of it, computed as it would be
        alone: its own attention chunks, MLP or expert slices and loss chunks, so that no number depends on which
        batches share a wave): per batch its texts' Scores, in order. Adds to self.stats."""
        cfg, plan, dev = self.cfg, self.plan, self.device
        waves, segments, chunks, offset = [], [], [], 0
        for batch in group:
            wave = wave_of([ids for _, ids, _ in batch], plan.chunk_tokens)
            waves.append(wave)
            if wave is not None:
                segments.append((offset, offset + wave.ids.numel()))
                chunks += [dataclasses.replace(c, start=c.start + offset, end=c.end + offset,
                                               cu_seqlens=torch.tensor(c.seq_bounds, dtype=torch.int32, device=dev))
                           for c in wave.chunks]
                offset += wave.ids.numel()
        present = [w for w in waves if w is not None]
        totals = []  # per wave present: its sequences' NLL sums
        streamed_before, storage_before = self.streamer.streamed_bytes, self.streamer.storage_bytes
        timer = PhaseTimer(dev)
        if present:
            timer.mark("layers")
            ids = torch.cat([w.ids for w in present]).to(dev)
            x = embed_tokens(self.embed, ids, cfg)  # [tokens, hidden]
            lengths = [torch.tensor(w.lengths) for w in present]
            starts = [torch.cumsum(n, 0) - n for n in lengths]
            seq_index = [torch.repeat_interleave(torch.arange(len(n)), n) for n in lengths]  # [segment tokens] each
            positions = torch.cat([torch.arange(n.sum()) - s[i] for n, s, i in zip(lengths, starts, seq_index)])
            tables = wave_rope_tables(positions.to(dev), cfg)  # [tokens, head_dim] cos, sin each
            self.run_layers(x, tables, chunks, layers, self.attend, segments=segments)
            timer.mark("loss")
            for wave, (s, e), n, i, start in zip(present, segments, lengths, seq_index, starts):
                seg = ids[s:e]
                targets = torch.cat((seg[1:], seg[:1]))
                targets[(start + n - 1).to(dev)] = -100  # no target after a sequence's last token
                totals.append(sequence_nll(x[s:e], self.lm_head, self.final_norm, targets, i, len(wave.seqs), cfg,
                                           plan.loss_chunk_tokens, self.kernels).tolist())
            timer.mark("end")
        results, totals = [], iter(totals)
        for b, (batch, wave) in enumerate(zip(group, waves)):
            sums = [0.0] * len(batch)
            for seq, total in zip(wave.seqs, next(totals)) if wave else ():
                sums[seq] = total
            results.append(scores_of(batch, sums))
            first = b == 0  # the wave's copies and its one pass, counted with its first batch
            self.add_stats(results[-1], waves=int(first and bool(present)),
                           texts_over_wave=int(first and offset > plan.wave_tokens),  # a wave beyond the plan
                           streamed_bytes=self.streamer.streamed_bytes - streamed_before if first else 0,
                           storage_bytes=self.streamer.storage_bytes - storage_before if first else 0)
        self.stats.update(host_budget_bytes=self.host_plan.budget_bytes,
                          storage_layers=len(self.host_plan.storage_layers))
        self.add_phases(timer)
        return results

    def run_layers(self, x, tables, chunks, layers, attend, wave_kv=None, segments=None):
        # x: [tokens, hidden], the wave, updated in place through every layer (or `layers`); tables: {Rope: (cos,
        # sin)} at the wave's positions, [tokens, head_dim] each; segments: the (start, end) of each batch in the
        # wave (None: one), whose MLP slices start at its own start
        cfg = self.cfg
        segments = segments or [(0, x.shape[0])]
        for layer in range(cfg.num_hidden_layers) if layers is None else layers:
            w, (cos, sin) = self.streamer.acquire(layer), tables[cfg.ropes[layer]]
            for c in chunks:  # attention needs whole sequences; the MLP (80% of FLOPs) does not, so...
                attention_block(x[c.start:c.end], w, cos[c.start:c.end], sin[c.start:c.end], c, cfg, attend,
                                self.kernels, cfg.attention[layer], wave_kv)
            for s, e in segments:  # ...it runs in GEMM-friendly equal slices
                if w.router is None:
                    mlp_block(x[s:e], w, cfg, self.plan.chunk_tokens, self.kernels)
                else:
                    moe_block(x[s:e], w, cfg, self.plan.moe_chunk_tokens, self.kernels, self.run_experts)
            self.streamer.release(layer)

    def tree_attention(self):
        # the attention for a prefix tree's chunks: those with ancestors go to a tree backend, picked at the first
        # tree (not at start-up: the whole-text path never needs it), the others to the plain backends' pick
        if self.tree_attend is None:
            name, tree, _ = pick_tree_attention(self.requested_attention, self.device, self.cfg)
            self.tree_attention_name = name
            self.tree_attend = lambda q, k, v, c, how, **sinks: (self.attend if c.ancestors is None else tree)(
                q, k, v, c, how, **sinks)
            log(f"prefix trees: attention {name} where a node has ancestors")
        return self.tree_attend

    @torch.inference_mode()
    def score_requests(self, batch, token_logprobs=False, layers=None):
        """One batch from request_batches(), as one prefix-tree wave through every layer (or `layers`): its
        requests' Loglikelihoods, in order. Adds to self.stats, tokens_computed (the tree's unique tokens) beside
        tokens_requested (what the requests read, each alone)."""
        cfg, dev = self.cfg, self.device
        attend = self.tree_attention()
        streamed_before, t0 = self.streamer.streamed_bytes, time.perf_counter()
        wave = tree_wave([request for _, request, _ in batch], self.plan.chunk_tokens, dev)
        tree_s, timer = time.perf_counter() - t0, PhaseTimer(dev)  # the host's part, before any GPU work
        timer.mark("layers")
        T = wave.ids.numel()
        ids = wave.ids.to(dev)
        x = embed_tokens(self.embed, ids, cfg)  # [tokens, hidden]
        positions = wave.positions.to(dev)  # each token's depth
        tables = wave_rope_tables(positions, cfg)
        wave_kv = [torch.empty(T, cfg.num_key_value_heads, D, dtype=DTYPE, device=dev)
                   for D in (cfg.head_dim, cfg.v_head_dim)]
        self.run_layers(x, tables, wave.chunks, layers, attend, wave_kv)
        del wave_kv
        timer.mark("loss")
        logprob, greedy = continuation_logprobs(x, wave.rows, wave.targets, self.lm_head, self.final_norm, cfg,
                                                self.plan.loss_chunk_tokens, self.kernels)
        timer.mark("end")
        logprob, greedy = logprob.tolist(), greedy.tolist()
        results = [Loglikelihood(index, math.fsum(logprob[p] for p in mine), len(mine), all(greedy[p] for p in mine),
                                 [logprob[p] for p in mine] if token_logprobs else None)
                   for (index, _, _), mine in zip(batch, wave.pairs)]
        self.add_request_stats(batch, results, waves=1, tokens_requested=wave.requested, tokens_computed=T,
                               attention_pairs=int(wave.positions.sum()) + T,  # (query, key) pairs: depth + 1 each
                               scored_rows=int(wave.rows.unique_consecutive().numel()),
                               streamed_bytes=self.streamer.streamed_bytes - streamed_before, tree_s=tree_s)
        self.add_phases(timer)
        return results

    def add_phases(self, timer):  # a batch's GPU time per phase, into self.stats
        phases = self.stats.setdefault("phases", {})
        for phase, seconds in timer.totals().items():
            phases[phase] = phases.get(phase, 0.0) + seconds

    def add_request_stats(self, batch, results, **more):
        # as add_stats, for a batch of continuations: requests, their tokens, the scored ones and their NLL
        tally = {"requests": len(results), "tokens": sum(len(r.context) + len(r.continuation) for _, r, _ in batch),
                 "predicted_tokens": sum(r.tokens for r in results),
                 "nll_sum": -math.fsum(r.logprob for r in results), **more}
        for key, value in tally.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def loglikelihoods(self, requests, token_logprobs=False, progress=None, scored=None):
        """The Python API for continuations: requests, (context ids, continuation ids) pairs of token lists (each of
        at least one token), -> one Loglikelihood per request, in input order. Requests are scored once each
        (duplicates share one result) in the order of their tokens, so that those sharing a prefix share waves;
        batches are cut from the sorted requests alone, so the numbers depend on the set of requests and the
        settings, not on their order. progress: a Progress to add to. scored: maps the batches to (batch, its
        Loglikelihoods) in order, where another process may have scored some (prefill_dist.shared: lm-eval's data
        parallel under torchrun); by default each is scored here."""
        t0, groups = time.perf_counter(), {}  # (order key, continuation length) -> (Request, the positions asking)
        for i, (context, continuation) in enumerate(requests):
            request = as_request(context, continuation, f"request {i}")
            key = (order_key(request), len(request.continuation))
            if key not in groups:
                groups[key] = (request, [])
            groups[key][1].append(i)
        distinct = [groups[key] for key in sorted(groups)]
        results = [None] * len(requests)
        self.stats = {"prepare_s": time.perf_counter() - t0}  # the host's checks and sort, before any batch
        items = ((j, request, None) for j, (request, _) in enumerate(distinct))
        cut = request_batches(items, self.plan.tree_wave_tokens)
        computed = 0  # the unique tokens this process computed, for the progress
        for batch, scores in (scored or (lambda cut: ((b, self.score_requests(b, token_logprobs)) for b in cut)))(cut):
            for result in scores:
                for i in distinct[result.index][1]:
                    results[i] = dataclasses.replace(result, index=i)
            if progress is not None:
                progress.add(len(batch), self.stats.get("tokens_computed", 0) - computed)
                computed = self.stats.get("tokens_computed", 0)
        return results

    def encode_pairs(self, pairs):
        """(context, continuation) strings -> (context ids, continuation ids), as lm-eval's _encode_pair tokenizes
        them: the context's trailing whitespace moves to the continuation, context + continuation is encoded whole
        and split after the tokens of the context alone. A tokenizer that adds a BOS (Llama 3, Gemma) adds it to
        both, so the context keeps it and an empty context is the BOS alone (lm-eval's prefix_token_id then); a text
        that starts with the BOS itself gets no second one, as lm-eval's tok_encode (has_bos_prefix) encodes it
        without special tokens."""
        moved = []
        for context, continuation in pairs:
            kept = context.rstrip()
            moved.append((kept, context[len(kept):] + continuation))
        added = self.tokenize([""])[0]  # what the tokenizer puts before every text: a BOS, or nothing (Qwen)

        def encoded(texts):
            return [ids[len(added):] if added and ids[:2 * len(added)] == added * 2 else ids
                    for ids in self.tokenize(texts)]
        contexts = encoded([context for context, _ in moved])
        wholes = encoded([context + continuation for context, continuation in moved])
        return [(ids, whole[len(ids):]) for ids, whole in zip(contexts, wholes)]

    def add_stats(self, scores, **more):
        # a batch's Scores into self.stats, wherever it ran (under torchrun rank 0 tallies the other ranks' batches)
        tally = {"texts": len(scores), "tokens": sum(s.tokens for s in scores),
                 "predicted_tokens": sum(s.tokens - 1 for s in scores if s.tokens >= 2),
                 "nll_sum": math.fsum(s.nll_sum for s in scores), **more}
        for key, value in tally.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def warm_up(self, trees=False):
        """Runs every kernel at the timed pass's shapes (a chunk-sized batch through a layer, the loss, each
        flash-attn max_seqlen bucket; with trees, a prefix tree's wave and its pick, for continuations) so
        compilation and allocator growth stay out of the timed window. One layer of each kind held alike (a
        Qwen3-MoE's dense layers run the MLP's kernels, not the experts'; an FP8 layer whose projections
        modules_to_not_convert names dequantizes fewer shapes): every layer of those runs the same kernels at the same
        shapes, and all 64 took 0.56 s of the H200's time to ready (0.02 s for one;
        bench/results/primitives/2026-12-01-h200-load-phases-probe.json). It runs on a streamer of its own that
        copies nothing, streamed layers on the weights their slots already hold: the warm-up's numbers are thrown
        away, and the copy path itself ran when the slots were filled."""
        gen = torch.Generator().manual_seed(0)
        layers = tuple(sorted(set(map(self.cfg.held.index, self.cfg.held))))  # the first of each kind held alike
        # a MoE model's texts fill one expert slice: its buffers are the largest a layer allocates
        moe = self.plan.moe_chunk_tokens
        n = (min(moe, 4096 * MOE_CHUNK_FACTOR) if moe else min(self.plan.chunk_tokens, 4096)) \
            if self.device.type == "cuda" else 64
        lengths = [n // 2, n // 2 - n // 8, n // 8 - 1]
        streamer, slots = self.streamer, self.streamer.slots
        if self.device.type == "cuda":  # the slots' first layers in place: no kernel reads them half-copied
            for ready in streamer.slot_ready:
                torch.cuda.current_stream().wait_event(ready)
        self.streamer = WeightStreamer(self.cfg, {**streamer.buffers, **{layer: slots[k % len(slots)] for k, layer in
                                                                         enumerate(streamer.order)}},
                                       HeldLayers({}), (), self.device, streamer.dequantize, streamer.scratch)
        try:
            self.losses([torch.randint(self.cfg.vocab_size, (k,), generator=gen).tolist() for k in lengths],
                        layers=layers)
            if trees:  # a context of n // 2 tokens, four one-token choices and an ending of n // 8
                context = torch.randint(self.cfg.vocab_size, (n // 2,), generator=gen).tolist()
                requests = [Request(context, [t]) for t in range(4)] + [Request(context, list(range(n // 8)))]
                self.score_requests([(i, r, None) for i, r in enumerate(requests)], layers=layers)
        finally:
            self.streamer = streamer
        if "flash" in self.attention.values():  # a chunk of several texts has max_len <= chunk_tokens: 128, 256, ...
            top = max_len_bucket(self.plan.chunk_tokens)
            for bucket, how in itertools.product((128 << i for i in range(top.bit_length() - 7)),
                                                 attention_settings(self.cfg)):
                self.attend(*attention_inputs(self.device, self.cfg, [bucket], seed=0), how)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)


# ----------------------------------------------------------------------------- the protocol and the command line
# `python prefill.py --model DIR`: load, warm up, print `ready`, read one JSON array of texts on stdin, print one loss
# per text. What the protocol does not need lives beside this file and is imported only when asked: --input/--output
# (prefill_corpus.py), torchrun (prefill_dist.py), --doctor (prefill_doctor.py). This file alone serves the protocol
# and the Python API.

# Without a terminal, a progress line at most this often, and less often as the run grows (every tenth of the time
# elapsed): a day's run logs ~60 lines, and the harness, which reads stderr only after a run of seconds, gets none
PROGRESS_LINE_S = 60
# An ETA only from the rate of this many batches or more: texts land a batch at a time, and one batch says little of
# the rate (a single long text, or the first with the run's one-off costs). Counted a text at a time, the demo's one
# batch of 100 read `1 texts of 100, ETA 1:40:41` a second before the end (issue 38).
ETA_BATCHES = 2


class Progress:
    """Texts and tokens done, tokens/s and ETA: a tqdm bar on a terminal; elsewhere a line PROGRESS_LINE_S after the
    start, then at most that often, and less often as the run grows (none in a run of seconds, such as the harness's,
    which reads stderr only after the run, nor once every text is done: the summary line follows). Texts are added a
    batch at a time, as they are scored; the ETA extrapolates the rate of ETA_BATCHES batches or more."""

    def __init__(self, total, unit="text"):  # unit: "request" for continuations
        self.total, self.texts, self.scored, self.tokens, self.t0 = total, 0, 0, 0, time.perf_counter()
        self.next_line, self.unit, self.batches = self.t0 + PROGRESS_LINE_S, unit, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, smoothing=0.05)

    def add(self, texts, scored_tokens, held=False):  # a batch; held: texts --resume kept, which take no time
        self.texts += texts
        self.scored += 0 if held else texts
        self.batches += 0 if held else 1
        self.tokens += scored_tokens
        now = time.perf_counter()
        elapsed = max(1e-9, now - self.t0)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens} tokens, {self.tokens / elapsed:.0f} tokens/s", refresh=False)
            self.bar.update(texts)
        elif now >= self.next_line and self.texts != self.total:
            self.next_line = now + max(PROGRESS_LINE_S, elapsed / 10)
            eta = (self.total - self.texts) * elapsed / self.scored if self.total and self.batches >= ETA_BATCHES \
                else None
            left = f" of {self.total}" + (f", ETA {datetime.timedelta(seconds=round(eta))}" if eta is not None
                                          else "") if self.total else ""
            log(f"{self.texts} {self.unit}s{left}; {self.tokens} tokens, {self.tokens / elapsed:.0f} tokens/s")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def ends_short(text):
    # JSON that stops before it is whole (the parser wants more at the end), rather than JSON that is wrong
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return e.pos >= len(text.rstrip(JSON_SPACE))
    except (ValueError, RecursionError):
        return False
    return False


def parse_request(data, source="stdin"):
    """The protocol's request: one JSON array of strings (bytes or str), on one line."""
    try:
        values = json_array(data, source)
    except UserError:
        text = decoded(data)
        if ends_short(text) and text.endswith("\n"):  # the first line of a pretty-printed array, say
            raise UserError(f"{source}: the request ends at a line break before its JSON array does: the protocol "
                            "takes the whole request on one line (--input FILE reads texts in any layout)") from None
        if ends_short(text):  # no line break: the input ended (stdin closed) inside the array
            raise UserError(f"{source}: the request's input ended before its JSON array did (cut short: stdin "
                            "closed inside it)") from None
        raise
    return [text_of(t, f"{source}: element {i}") for i, t in enumerate(values)]


def take_stdout():
    """Reserves the real stdout for the protocol and points fd 1 at stderr, so that nothing a library prints
    (Python or native code) can corrupt the `ready`/losses stream."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for every other fault (argparse would add the usage lines)
        log(f"error: {message} (--help lists the options)")
        sys.exit(2)


def bounded(kind, low, high):
    """An argparse type: a number of `kind` in [low, high] (so never nan or inf)."""
    def parse(text):
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid float value"
    return parse


MAX_TOKENS = 2**31 - 1  # cu_seqlens are int32
# --attention's kinds described in --help, in the order of its choices (ATTENTION_KINDS; a test checks each has one)
ATTENTION_HELP = {"triton": "prefill's own Triton kernel", "flash": "flash_attn's varlen kernel",
                  "torch-flash": "torch's flash kernel", "cudnn": "torch's cuDNN SDPA per text (NVIDIA only)",
                  "sdpa": "SDPA per text"}
PAIR_FIELDS = ("context", "continuation")  # --context-field, --continuation-field


def parse_args(argv):
    p = ArgumentParser(
        description="Per-text loss of a dense Llama, Mistral, Qwen2/2.5, Qwen3 or Gemma 2/3 checkpoint, or a "
                    "mixture of experts: Qwen3-MoE, Qwen1.5/2-MoE, Mixtral, GLM-4.5, DeepSeek-V3 (Moonlight, "
                    "Kimi-K2) or gpt-oss (safetensors, in bf16, block-wise FP8 or gpt-oss's MXFP4; model_type "
                    f"{', '.join(FAMILIES)}, or gemma3 saved as multimodal: its text model), streaming the layers "
                    "that do not fit in GPU memory. Without --input: prints `ready`, reads one JSON array of "
                    "strings on stdin, prints one loss per text (nan for texts of < 2 tokens) and exits. With --input "
                    "FILE: the same losses for FILE's texts, without the handshake. With --input FILE --output "
                    "OUT.jsonl: scores a corpus of any size into OUT, one JSON line per text, resumable with --resume. "
                    "Started by torchrun: one process per GPU, rank 0 speaking for all (docs/distributed.md).",
        epilog="Exit codes: 0 done; 1 stdin closed before the request, stdout closed before the last loss, another "
               "torchrun rank failed, or an unexpected error; 2 a bad option, input, request, output or checkpoint "
               "(one line on stderr names it); 130 SIGINT; 143 SIGTERM (with --output: after the batch being written, "
               "saying how many texts are done and the command that resumes, to paste as it is). The request is one "
               "line; texts longer than config.json's max_position_embeddings are computed, with one warning.")
    p.add_argument("--model", "--model_path", dest="model", required=True, metavar="DIR",
                   help="folder with config.json, *.safetensors (+ index) and the tokenizer files")
    p.add_argument("--input", metavar="FILE",
                   help="read texts from FILE ('-' for stdin) without the ready handshake: a JSON array, or JSON lines "
                        "(the format for big corpora: read as it goes), each element or line a string or an object "
                        "with a string --text-field; the first records are checked before the model loads. Without "
                        "--output the results go to stdout once all are scored: a text's loss a line, as the "
                        "protocol prints them, or for context/continuation records one JSON line each, --output's "
                        "fields without the digest")
    p.add_argument("--output", metavar="OUT",
                   help="with --input: score it as a corpus, appending one JSON line per text to OUT in input order, "
                        "{index, id (where the input has one), tokens, loss (null below 2 tokens), nll_sum, digest (of "
                        "the token ids and settings the numbers came from)}, a batch at a time, each flushed and "
                        "fsynced; an existing non-empty OUT needs --resume")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted --output run with the same settings: each record of the whole batches "
                        "OUT holds is checked against the input (index, id, token count, and its digest of the token "
                        "ids and settings) and kept, the rest is scored; a record that differs stops the run before "
                        "anything is written, naming it; the finished file is byte-identical to an uninterrupted "
                        "run's (a missing OUT starts afresh)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field holding the text where an input record is an object (default: text)")
    p.add_argument("--id-field", default="id", metavar="NAME",
                   help="the field copied to the output record as its id, where present (default: id)")
    p.add_argument("--context-field", default=PAIR_FIELDS[0], metavar="NAME",
                   help="where an input object has this field (default: context), it is a continuation to score "
                        "given that context instead of a text: its --continuation-field's log-likelihood, tokenized "
                        "as lm-eval does (trailing spaces of the context move to the continuation), the records "
                        "sharing a prefix computing it once; its output record has tokens, context_tokens, "
                        "continuation_tokens, logprob (the continuation's summed float32 log-probs), greedy (each "
                        "continuation token the argmax), and loss and nll_sum, the continuation's mean and summed NLL")
    p.add_argument("--continuation-field", default=PAIR_FIELDS[1], metavar="NAME",
                   help="the field holding the continuation of a --context-field record (default: continuation)")
    p.add_argument("--token-logprobs", action="store_true",
                   help="with context/continuation records: add each continuation token's log-prob to its output "
                        "record (token_logprobs)")
    p.add_argument("--gpu-memory", type=bounded(float, 0, 2**20), metavar="GIB",
                   help="GPU memory the runner may plan for (default: what is free, less 1.5 GiB, and 1 GiB more on a "
                        "first run on a machine, which times the attention kernels while loading); "
                        "0 streams every layer. A block-wise FP8 MoE whose plan would not fit holds its experts FP8 "
                        "and dequantizes them in the GEMMs (docs/models.md)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="default: cuda when torch sees a GPU, else cpu; a GPU that this torch build cannot see is an "
                        "error (exit 2), not a silent CPU run")
    p.add_argument("--attention", default="auto", choices=["auto"] + ATTENTION_KINDS,
                   help=f"attention kernel: {', '.join(ATTENTION_HELP.get(k, k) for k in ATTENTION_KINDS[:-1])}, "
                        f"or {ATTENTION_HELP.get(ATTENTION_KINDS[-1], ATTENTION_KINDS[-1])} (default: of those that "
                        "run here and match float32 attention at start-up, per bucket of a chunk's longest text "
                        f"({', '.join(BUCKET_LABELS)} tokens) the one kept in --picks; the first run on a GPU times "
                        "them per bucket and keeps the first in a fixed order unless another is clearly (10%%) "
                        "faster). A backend without what the model's attention needs "
                        "is not offered for it: cuDNN has no sliding window nor softcap, torch's flash kernel no "
                        "softcap (Gemma 2)")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"],
                   help="per-token elementwise work (norms, RoPE, the MLP's SiLU or GELU, a mixture of experts' "
                        "router after its GEMM): fused Triton kernels or plain PyTorch "
                        "(default: Triton on a GPU where each kernel matches float32 math, else PyTorch; the "
                        "router's where it picks the experts torch.topk picks, else PyTorch's beside the others)")
    p.add_argument("--chunk-tokens", type=bounded(int, 1, MAX_TOKENS), default=4096, metavar="N",
                   help="tokens per GEMM step: attention runs on chunks of whole texts of up to N tokens, the MLP "
                        "on slices of N; a mixture of experts on slices of 4 N, and on chunks of 4 N where their "
                        "scratch fits in the slices' room, else N (DeepSeek-V3's) (default 4096)")
    p.add_argument("--wave-tokens", type=bounded(int, 1, MAX_TOKENS), metavar="N",
                   help="tokens kept on the GPU across all layers; larger requests run in several waves, "
                        f"each streaming the layers again (default {WAVE_STEP}; for a mixture of experts with "
                        "--input, the smallest multiple of it whose compute hides the wave's copies at the GPU "
                        "family's nominal rates, as large as memory allows: one stderr line says which bound; not "
                        "under torchrun). With --output, also the batch whose records land at once (default: about "
                        f"{BATCH_SECONDS} s of compute at the device family's nominal rate, at most {WAVE_STEP})")
    p.add_argument("--experts", default="auto", choices=["auto"] + EXPERT_KINDS,
                   help="a mixture of experts' expert compute: torch's grouped_mm, prefill's fused Triton experts "
                        "(the rows aligned per expert, the gate+up GEMM with the activation, the down GEMM, one sum "
                        "weighted by the routing), prefill's Triton grouped GEMM, or one GEMM per expert (default: of "
                        "those that match float32 experts at start-up, the one kept in --picks; the first run on a "
                        "GPU times them and keeps the first in that order unless another is clearly (10%%) faster; "
                        "without a picks file, grouped_mm where it is one kernel, else the fused experts; on a GPU "
                        "grouped_mm only where it is one kernel, and the Triton grouped GEMM only where it is not; on "
                        "the CPU grouped_mm)")
    p.add_argument("--load", default="auto", choices=["auto", "map", "copy"],
                   help="map: page-lock the streamed layers' pages of the checkpoint's page cache in place and "
                        "copy them to the GPU straight from there (no host copy; those pages stay locked in RAM while "
                        "prefill runs); copy: pinned copies of the streamed layers that --host-memory can hold, the "
                        "others read from storage every wave; either way the resident weights reach the GPU through "
                        "small pinned staging buffers; auto: map on NVIDIA where the platform allows it, the files "
                        "hold bf16 and --host-memory holds the streamed layers' pages, else copy (always copy on ROCm)")
    p.add_argument("--host-memory", type=bounded(float, 0, 2**20), metavar="GIB",
                   help="host memory the runner may page-lock (default: MemAvailable less a margin of 5%% of RAM, at "
                        "least 2 GiB, within the cgroup's limit); the streamed layers it cannot hold are read from "
                        "storage every wave. Give it explicitly on a VM whose memory grows as it is used (a balloon), "
                        "where MemAvailable understates what can be had")
    p.add_argument("--pin", default="auto", choices=["auto"] + list(PIN_METHODS),
                   help="how prefill's own host buffers are page-locked (the loading threads' staging buffers; with "
                        "--load copy the streamed layers' copies and the storage ring): register plain memory in "
                        "place (exact size) or torch's pinned allocator (power-of-two sizes); auto: register on CUDA, "
                        "alloc on ROCm")
    p.add_argument("--picks", metavar="FILE",
                   help="where the choices only timing can make (attention backend, expert kernel; on ROCm, rocBLAS or "
                        "hipBLASLt) "
                        "are kept per machine, so that every later run computes the same numbers; without a "
                        "writable file nothing is timed and a fixed order decides (default: "
                        "$XDG_CACHE_HOME/prefill/picks.json, else ~/.cache/prefill/picks.json)")
    p.add_argument("--doctor", action="store_true",
                   help="load, check and measure, then print every decision made on this machine and why (one "
                        "screen; --stats FILE gets it as JSON); exit 0 when every required path works")
    p.add_argument("--stats", metavar="FILE", help="write the run's figures (tokens, bytes streamed, memory, "
                                                   "per-phase times) as JSON to FILE (checked writable before the "
                                                   "model loads)")
    return p.parse_args(argv)


def check_writable(path, option="--stats"):
    # --stats is written after the losses: a path that cannot be written must fail now, before the model loads.
    # An existing file is opened without truncating it (nor waiting, if it is a FIFO); a file made for the probe is
    # removed again.
    existed = os.path.lexists(path)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK))
    except OSError as e:
        raise UserError(f"{option} {path} cannot be written: {e.strerror}") from None
    if not existed:
        os.unlink(path)


def runner_of(args, wave_tokens, picks=None, timed_batches=False):
    """The Runner the command line's options ask for, with wave_tokens (None: planned, for a mixture of experts'
    corpus), picks (None: the --picks file's; a rank > 0 takes rank 0's) and timed_batches (a corpus's records:
    batches of timed_batch_tokens)."""
    return Runner(args.model, device=args.device, gpu_memory_gib=args.gpu_memory, attention=args.attention,
                  kernels=args.kernels, chunk_tokens=args.chunk_tokens, wave_tokens=wave_tokens, load=args.load,
                  pin=args.pin, host_memory_gib=args.host_memory, experts=args.experts,
                  picks=args.picks if picks is None else picks, timed_batches=timed_batches)


def warmed_up(runner):  # seconds the warm-up took
    t0 = time.perf_counter()
    runner.warm_up()
    return time.perf_counter() - t0


def request_line(runner, warm_up_s, protocol):
    """`ready` on the protocol's stdout, then the request line read from stdin (b"" if stdin closed first)."""
    ready_s = runner.since_start_s["ready"]
    log(f"ready (warm-up {warm_up_s:.1f} s" + (f"; {ready_s:.1f} s since the process started)" if ready_s else ")"))
    protocol.write("ready\n")
    protocol.flush()
    return sys.stdin.buffer.readline()


def print_losses(protocol, scores):  # all at once: never a partial set
    protocol.write("".join(f"{math.nan if s.loss is None else s.loss!r}\n" for s in scores))
    protocol.flush()


def report(args, runner, elapsed, warm_up_s, start_unix_s, unit="text", resumed=None, group=None):
    """The run's closing line on stderr, and its figures in --stats FILE. resumed: what --resume kept of --output (its
    texts, tokens, predicted_tokens and nll_sum), counted in the totals."""
    resumed = resumed or {"texts": 0, "tokens": 0, "predicted_tokens": 0, "nll_sum": 0.0}
    run = runner.stats
    run.setdefault("texts", run.get("requests", 0))  # a continuation counts as its record
    texts, tokens, predicted, nll_sum = (resumed[key] + run.get(key, 0)
                                         for key in ("texts", "tokens", "predicted_tokens", "nll_sum"))
    mean_nll = nll_sum / predicted if predicted else None
    stats = dict(run, texts=texts, tokens=tokens, predicted_tokens=predicted, nll_sum=nll_sum, mean_nll=mean_nll,
                 perplexity=math.exp(mean_nll) if mean_nll is not None else None, resumed_texts=resumed["texts"],
                 scored_texts=run.get("texts", 0), scored_tokens=run.get("tokens", 0),
                 tokens_per_s=run.get("tokens", 0) / elapsed, elapsed_s=elapsed,
                 pinned_host_bytes=runner.pinned_host_bytes, load_wall_s=runner.load_wall_s,
                 side_done_s=runner.side_done_s, load_mode=runner.load_mode, warm_up_s=warm_up_s,
                 since_start_s=runner.since_start_s, load_seconds=runner.load_seconds,
                 resident_layers=len(runner.plan.resident_layers), streamed_layers=len(runner.plan.streamed_layers),
                 attention=runner.attention, kernels=runner.kernels.name, blas=runner.blas, experts=runner.experts,
                 wave_tokens=runner.plan.wave_tokens, wave_plan=runner.wave_plan,
                 pin_method=runner.pin_method, budget_bytes=runner.plan.budget_bytes,
                 planned_bytes=runner.plan.total_bytes, gpus=group.world if group else 1,
                 start_unix_s=start_unix_s)
    stats["phases"] = dict(tokenizer_wait=run.get("tokenizer_wait_s", 0.0), **run.get("phases", {}))
    if runner.device.type == "cuda":
        stats["peak_gpu_bytes"] = torch.cuda.max_memory_reserved(runner.device)
    if run.get("texts_over_wave"):  # counted, one line: the harness reads stderr only after the run
        log(f"warning: {run['texts_over_wave']} text(s) longer than --wave-tokens {runner.plan.wave_tokens} ran as "
            "waves of their own")
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in stats["phases"].items())
    units = unit + "s"
    earlier = f" ({resumed['texts']} {units} were in {args.output} already)" if resumed["texts"] else ""
    corpus = f"mean NLL {mean_nll:.4f} a predicted token, perplexity {stats['perplexity']:.4g}" if predicted else \
        "no token predicted"
    shared = (f", {run['tokens_computed']} computed for {run['tokens_requested']} requested"
              if run.get("tokens_requested") else "")  # a prefix tree's
    log(f"{texts} {units}, {tokens} tokens{shared}: {corpus}; scored {stats['scored_tokens']} tokens{earlier} in "
        f"{elapsed:.2f} s{f' on {group.world} ranks' if group else ''}, {stats['tokens_per_s']:.0f} tokens/s ({phases}); streamed "
        f"{run.get('streamed_bytes', 0) / 1e9:.1f} GB" + (" (rank 0)" if group else ""))
    if args.stats:
        try:
            Path(args.stats).write_text(json.dumps(stats, indent=1))
        except OSError as e:
            raise UserError(f"--stats {args.stats} cannot be written: {e.strerror}") from None


def serve_protocol(args, protocol):
    """The contest's protocol on one process: the model loads and warms up, `ready`, one request line, its texts
    scored by Runner.score and their losses printed in order."""
    if args.stats:
        check_writable(args.stats)
    runner = runner_of(args, args.wave_tokens or WAVE_STEP)
    warm_up_s = warmed_up(runner)
    runner.since_start_s["ready"] = since_process_start()
    line = request_line(runner, warm_up_s, protocol)
    if not line:
        log("stdin closed before a request arrived")
        return 1
    texts = parse_request(line)
    t0, start_unix_s = time.perf_counter(), time.time()  # wall clock: bench times a run's ready
    progress = Progress(len(texts))
    try:
        with contextlib.closing(runner.score(texts, progress)) as scoring:
            scores = list(scoring)
    finally:
        progress.close()
    print_losses(protocol, scores)
    report(args, runner, time.perf_counter() - t0, warm_up_s, start_unix_s)
    return 0


def one_line(message):  # an error line stays one short line, whatever a path or a library put in it
    message = " ".join(message.splitlines())
    return message if len(message) <= 1000 else message[:1000] + "..."


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as SIGINT raises KeyboardInterrupt: no `except Exception` swallows it."""


class PeerFailed(Exception):
    """Under torchrun, another rank failed or fell silent (prefill_dist.py); the message names it and, where known,
    why."""


# main installs on_signal for SIGINT and SIGTERM. One that arrives while a batch's records are written waits until
# they are on disk, so that a signal never leaves a partial record. The first one raised ends the run; a later one
# (or one after main has returned) is ignored while the run winds down (side threads joined, generators closed, the
# exit's finalizers run), which then ends in the first one's line and code; only a wind-down stuck past
# WIND_DOWN_S is cut short by one, at once, with that line and code. A second signal is common: a terminal's Ctrl-C
# signals `uv run` and prefill alike, and users press it twice. Raised during the wind-down, it cut the wind-down
# short: a traceback from whatever finalizer it hit (the tokenizer thread's join in Runner.read_ahead, an atexit hook,
# threading's exit); and where it cut the join of a thread still inside torch (the start-up checks', when it came
# during the load), the interpreter finalized under that thread, whose return from torch's C++ into Python then
# aborted the process (pybind11's gil_scoped_release, pytorch#38228): "terminate called without an active
# exception", exit 134 (8 of 8 tries here with three SIGINTs 0.3 s apart during the load; bench/NOTES.md, issue 38).
WIND_DOWN_S = 10.0
SIGNALS = {"held": False, "pending": None, "first": None, "ending": None}  # ending: since when (time.monotonic)


def on_signal(signum, frame):
    if SIGNALS["ending"] is not None:
        if time.monotonic() - SIGNALS["ending"] > WIND_DOWN_S:
            exit_at_once(SIGNALS["first"] or signum, frame)
        return
    if SIGNALS["held"]:
        SIGNALS["pending"] = SIGNALS["pending"] or signum
        return
    SIGNALS["first"], SIGNALS["ending"] = signum, time.monotonic()
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


@contextlib.contextmanager
def signals_held():
    SIGNALS["held"] = True
    try:
        yield
    finally:
        SIGNALS["held"] = False
        signum, SIGNALS["pending"] = SIGNALS["pending"], None
        if signum:
            on_signal(signum, None)


def sibling(module, what):
    """A sibling file of this one (prefill_corpus, prefill_dist, prefill_doctor), imported when `what` asks for it;
    a prefill.py copied alone, as the contest takes it, says what is missing in one line."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UserError(f"{what} needs {module}.py beside prefill.py (this one runs the protocol and the Python API "
                        "alone)") from None


def main(argv=None):
    group = None
    QUIET["on"] = int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0 and \
        not os.environ.get("PREFILL_DEBUG")  # an option error every rank makes is rank 0's one line
    args = parse_args(argv)
    # how this run was started, for the command an interrupted run prints: the script as given, and its arguments
    args.command = sys.argv if argv is None else [__file__, *argv]
    protocol = take_stdout()

    def failed(line, code):  # under torchrun rank 0 speaks for all; the first rank to fail is the one it names
        if group:
            group.fail(line)
            if group.rank > 0:
                group.await_rank_zero()
        log(line)
        return code

    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            group = sibling("prefill_dist", "torchrun").Group.from_env(args.device)
        if args.doctor:
            if group:
                raise UserError("--doctor reports on one process: run it without torchrun")
            return sibling("prefill_doctor", "--doctor").serve(args, protocol)
        if group or args.input or args.output or args.resume:
            return sibling("prefill_corpus", "--input" if args.input else "--output" if args.output else
                           "--resume" if args.resume else "torchrun").serve(args, protocol, group)
        return serve_protocol(args, protocol)
    except UserError as e:
        return failed(f"error: {one_line(str(e))}", 2)
    except torch.cuda.OutOfMemoryError:
        return failed("error: out of GPU memory; give a smaller --gpu-memory or --chunk-tokens", 1)
    except BrokenPipeError:  # the reader of the losses is gone; keep the exit's flush of stdout from failing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), protocol.fileno())
        return failed("stdout closed before every loss was written", 1)
    except (KeyboardInterrupt, Terminated, PeerFailed) as e:  # a corpus run's note: how far it got, how to resume
        why, code = SIGNAL_ENDS[signal.SIGINT] if isinstance(e, KeyboardInterrupt) else \
            SIGNAL_ENDS[signal.SIGTERM] if isinstance(e, Terminated) else ("error: stopped", 1)
        cause = str(e) if isinstance(e, PeerFailed) else group.cause() if group else None
        log("; ".join([why + (f": {cause}" if cause else ""), *getattr(e, "__notes__", [])]))
        return code
    except Exception as e:
        if os.environ.get("PREFILL_DEBUG"):
            traceback.print_exc()
        return failed(f"error: {type(e).__name__}: {one_line(str(e))} (PREFILL_DEBUG=1 shows where)", 1)
    finally:
        if group:
            if group.rank == 0:
                group.spoke()
            group.close()


if __name__ == "__main__":
    # the siblings' `import prefill` is this module, run as __main__: a second copy would have its own UserError,
    # signal state and registrar
    sys.modules.setdefault("prefill", sys.modules[__name__])
    for signum in SIGNAL_ENDS:  # 130 and 143 with one line, never amid a batch's records
        signal.signal(signum, on_signal)
    code = main()
    SIGNALS["ending"] = time.monotonic()
    sys.exit(code)

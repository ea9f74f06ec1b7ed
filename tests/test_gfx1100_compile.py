"""Every Triton kernel prefill can launch, compiled for the W7800 (gfx1100, RDNA3, wave32) without a GPU.

Nobody here runs ROCm, and a compile error or a kernel whose registers spill to scratch memory would first show on
the contest machine: as a failed start-up check (PyTorch fallback) or as a slow attention kernel. Triton's pip wheel
ships its AMD backend and an LLVM with the AMDGPU target, so the compile itself runs on any machine (Triton's AMD backend, compiled for gfx1100 on a CPU-only machine here).

The launches are not restated here. prefill's own layer code (attention_block with each attention tile offered for
gfx1100, mlp_block, sequence_nll) runs on CPU tensors with a real model's dimensions but a few tokens, with F.linear
(and the float32 LM head) answering by shape only and every kernel launch recorded instead of run. Triton's own argument binder then turns each
recorded launch into what a real launch would compile: argument types, constexprs, num_warps/num_stages and
specialisations. Those of a real run's sizes, not only of the tiny inputs', are compiled too: Triton specialises an
integer argument on being divisible by 16 or equal to 1 and a pointer on 16-byte alignment, and the AMD backend a
pointer on its tensor's storage lying within 2 GiB (buffer ops, HIPBackend.is_within_2gb). The storage is what counts,
and a view's storage can be large: a MoE wave's hidden states reach 4 GiB (Qwen3-30B-A3B, 1M tokens), Qwen3-235B-A22B's
layer buffer, whose views are the norm and expert weights, 5 GiB. So every launch but attention's is compiled twice,
its pointers within 2 GiB and over. The attention kernels' tensors are a chunk's q, k, v (over 2 GiB only for one
text of more than 131k tokens at 64 heads of 128) and the tree kernel's a wave's keys (128 MiB at the default wave):
compiled over 2 GiB under Triton 3.9 they spill (7 VGPRs at 64x32, 15-17 for the tree's 64x16, 4-9 in the window
and softcap tiles), so they are left out here and named as a limit instead. Every integer argument takes its real value here (the model's dimensions, strides, window) but
for the one that varies with the texts, the tree kernel's kv_start (where its chunk starts in the wave), compiled
divisible by 16, not, and equal to 1. Each distinct launch is compiled to gfx1100 assembly; the final link to an
hsaco is left out (it checks nothing more and may need a linker), and the register counts are read from the
assembly's kernel metadata.

    PYTHONPATH=. python tests/test_gfx1100_compile.py OUT.json   # the same compiles and a few more tiles: a table
"""
import contextlib
import dataclasses
import itertools
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import interact
import prefill
from bench.make_checkpoint import (DEEPSEEK_V3, GEMMA3_27B, GLM4_5_AIR, GPT_OSS_120B, LLAMA_3_1_70B, MIXTRAL_8X7B,
                                   MOONLIGHT_16B_A3B, QWEN1_5_MOE_A2_7B, QWEN2_5_32B, QWEN3_30B_A3B, QWEN3_32B)

# Every geometry docs/models.md claims a family by, with its head counts (the query and the key launches of
# head_norm_rope, the attention kernels' HEADS and KV_HEADS) and head_dim: Qwen3-0.6B's (its config.json) block sizes
# that follow the hidden size and head count differ; Qwen3-30B-A3B's attention has 32 query heads to 4 KV heads (its
# experts: moe_launches), Qwen3-235B-A22B's 64 to 4 over a 4096 hidden size; Qwen2.5 40 query heads (not a power of
# two) and q/k/v biases; Mistral 7B v0.1 a window on every layer; Llama-3.2-1B a head_dim of 64, SmolLM2-135M (the
# real checkpoint the tests run) 9 query heads to 3 KV heads. The other families bring the kernels' variants: Gemma 3
# its (1 + w) norms, q/k norm, GELU and a window (4B: head_dim 256), Gemma 2 a window with a softcap, Llama RoPE
# without a q/k norm. The other mixtures of experts: GLM-4.5-Air's RoPE on half of each head of 128 (the partial
# variant of head_norm_rope), its dense first layer and shared expert (gated_act at 1408, beside its experts'), 96 query
# heads; GLM-4.5's the same with its q/k norm (zai-org/GLM-4.5: 5120 wide, 160 experts of 1536, 3 dense layers of
# 12288); Mixtral's experts 14336 wide; Qwen1.5-MoE-A2.7B's shared expert of 5632, 16 heads of 128 over 2048.
# DeepSeek-V3 its latent attention: the latents' norms, interleaved RoPE on q's last 64 channels of 192 (a head stride
# of its own) and on the one key all heads share, a q/k head dim of 192 (no Triton attention kernel on RDNA3: over
# 128), its 3 dense layers of 18432 and the V3 router's top-8 of 256 experts of 2048 over 7168; Moonlight the same
# without q's LoRA (q_proj's rows beside the latent's), here with rope_interleave false (as a copy whose RoPE rows were
# de-interleaved would say) so that both RoPE variants compile at MLA's strides, and its top-6 of 64 experts of 1408
# with 2 shared. gpt-oss (20b's kernels are 120b's): sinks with and without a window, its norms' float32 product, the
# clamped SwiGLU, its experts' out-contiguous weights and their biases, and MXFP4 (its YaRN's tables are no kernel's).
MODELS = {"Qwen3-32B": QWEN3_32B,
          "Qwen3-0.6B": {**QWEN3_32B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                         "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
          "Gemma-3-27B": GEMMA3_27B,
          "Gemma-3-4B": {**GEMMA3_27B, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "query_pre_attn_scalar": 256},
          "Gemma-2-27B": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 4608, "intermediate_size": 36864,
                          "num_hidden_layers": 46, "num_attention_heads": 32, "num_key_value_heads": 16,
                          "head_dim": 128, "query_pre_attn_scalar": 144, "sliding_window": 4096,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
          "Llama-3.1-70B": LLAMA_3_1_70B,
          "Qwen3-30B-A3B": QWEN3_30B_A3B,
          "Qwen3-235B-A22B": {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
                              "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                              "moe_intermediate_size": 1536},
          "Qwen2.5-32B": QWEN2_5_32B,
          "Mistral-7B-v0.1": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "sliding_window": 4096, "rope_theta": 1e4},
          "Llama-3.2-1B": {**LLAMA_3_1_70B, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "head_dim": 64, "tie_word_embeddings": True},
          "SmolLM2-135M": {**LLAMA_3_1_70B, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                           "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": None, "rope_theta": 1e5},
          "GLM-4.5-Air": GLM4_5_AIR,
          "GLM-4.5": {**GLM4_5_AIR, "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92,
                      "n_routed_experts": 160, "moe_intermediate_size": 1536, "first_k_dense_replace": 3,
                      "routed_scaling_factor": 2.5, "use_qk_norm": True},
          "Mixtral-8x7B": MIXTRAL_8X7B, "Qwen1.5-MoE-A2.7B": QWEN1_5_MOE_A2_7B,
          "DeepSeek-V3": DEEPSEEK_V3, "Moonlight-16B-A3B": {**MOONLIGHT_16B_A3B, "rope_interleave": False},
          "gpt-oss-120b": GPT_OSS_120B}
# the grouped GEMM's N, K and expert stride differ; the others' shared experts and routers; gpt-oss's strides
MOE_MODELS = ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "GLM-4.5-Air", "GLM-4.5", "Mixtral-8x7B", "Qwen1.5-MoE-A2.7B",
              "DeepSeek-V3", "Moonlight-16B-A3B", "gpt-oss-120b")
KNOWN_SPILLING_TILE = (64, 64, 4, 2)  # spills 205 VGPRs under Triton 3.9, 16 under 3.6 (and 137 with 2 stages in an earlier review of Triton 3.6)
LDS_BYTES = 65536  # per workgroup on RDNA3
TOKENS = 3  # no launch parameter depends on the token count

# prefill keeps the default fusion; the whole module is `slow` (docs/testing.md)
pytestmark = [pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset"), pytest.mark.slow]


def amd_backend():
    """(triton, GPUTarget for gfx1100), or a pytest skip when Triton or its AMD backend is absent."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    if "amd" not in backends:
        pytest.skip("this Triton has no AMD backend")
    from triton.backends.compiler import GPUTarget
    return triton, GPUTarget("hip", "gfx1100", 32)


# ----------------------------------------------------------------------------- recording prefill's launches

@dataclass(frozen=True)
class Launch:
    kernel: str        # the JITFunction's name in prefill
    model: str
    signature: tuple   # Triton's (name, type) per argument, as its binder derives them from the call
    constexprs: tuple  # (argument index path, value)
    attrs: tuple       # (argument index path, specialisation attributes)
    options: tuple     # (name, value) of the launch's compile options: num_warps, num_stages

    def named_constexprs(self):
        names = [name for name, _ in self.signature]
        return {names[path[0]]: value for path, value in self.constexprs}

    def config(self):
        within = any("tt.pointer_range" in value for _, value in self.attrs)
        return " ".join(f"{k}={v}" for k, v in [*self.named_constexprs().items(), *self.options]) + (
            "" if within else " pointers-over-2GiB")


# integer arguments whose value a run's texts decide, and values that make each of Triton's specialisations of them
VARYING_INTS = {"_tree_attention_kernel": {"kv_start": (16, 17, 1)}}
WITHIN_2GIB_ONLY = ("_attention_kernel", "_tree_attention_kernel")  # see the module's docstring


def bind(fn, target, args, kwargs, within_2gb=True):
    """What Triton's launcher would compile for fn[grid](*args, **kwargs) on target (JITFunction.run's own steps);
    within_2gb False: as if every tensor's storage were larger than 2 GiB."""
    from triton.backends.amd.compiler import HIPBackend
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    with contextlib.ExitStack() as stack:
        if not within_2gb:
            stack.enter_context(mock.patch.object(HIPBackend, "is_within_2gb", staticmethod(lambda arg: False)))
        bound, specialization, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
    freeze = lambda d: tuple(sorted((k, json.dumps(v) if isinstance(v, list) else v) for k, v in d.items()))
    passed = {k: v for k, v in kwargs.items() if k in options.__dict__}
    return tuple(signature.items()), freeze(constexprs), freeze(attrs), tuple(sorted(passed.items()))


def model_config(geometry):
    return prefill.ModelConfig.from_json(interact.config_json(geometry))


def fp8_config(cfg):
    # the model as its quantized releases hold it: gpt-oss in MXFP4; the others as a block-wise FP8 checkpoint, or
    # None where its shapes are not in whole blocks (SmolLM2's 576)
    if cfg.fused_experts:
        return dataclasses.replace(cfg, mxfp4=True)
    try:
        return dataclasses.replace(cfg, fp8_scales="float")
    except prefill.UserError:
        return None


@contextlib.contextmanager
def launches_recorded(target, model, into):
    """prefill's kernels record their launches instead of running, and F.linear answers with an empty output."""
    kernels = {name: fn for name, fn in vars(prefill).items() if isinstance(fn, prefill.triton.JITFunction)}

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = [param.name for param in self.fn.params]
                variants = [args] + [tuple(value if i == names.index(name) else a for i, a in enumerate(args))
                                     for name, values in VARYING_INTS.get(self.name, {}).items() for value in values]
                into.extend(Launch(self.name, model, *bind(self.fn, target, a, kwargs, within))
                            for a in variants for within in (True, False)
                            if within or self.name not in WITHIN_2GIB_ONLY)
            return launch

    linear = lambda x, w, bias=None: torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype)
    with contextlib.ExitStack() as stack:
        for name, fn in kernels.items():
            stack.enter_context(mock.patch.object(prefill, name, Recorder(name, fn)))
        stack.enter_context(mock.patch.object(prefill, "F", SimpleNamespace(linear=linear)))
        yield kernels


def prefill_launches(target, model, tiles, tree_tiles=()):
    """The distinct kernel launches of one layer and the loss for this model, with each attention tile in tiles (in
    a prefix tree's chunk, each of tree_tiles); and the names of prefill's JIT functions."""
    cfg = model_config(MODELS[model])
    flat = torch.empty(cfg.layer_numel, dtype=prefill.DTYPE)  # never touched: only its views' shapes and offsets
    w = prefill.layer_views(flat, cfg)
    x = torch.zeros(TOKENS, cfg.hidden_size, dtype=prefill.DTYPE)
    cos, sin = prefill.rope_tables(torch.arange(TOKENS), cfg.ropes[0], cfg.rope_dim)
    chunk = prefill.Chunk(0, TOKENS, [0, TOKENS], torch.tensor([0, TOKENS], dtype=torch.int32), TOKENS)
    # a prefix tree's chunk (the tree kernel): a root token, then a node of the others reading it
    tree_chunk = prefill.Chunk(0, TOKENS, [0, 1, TOKENS], torch.tensor([0, 1, TOKENS], dtype=torch.int32),
                               TOKENS - 1, [[], [(0, 1)]], torch.tensor([0, 0, 1], dtype=torch.int32),
                               torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(TOKENS, dtype=torch.int32))
    lm_head = torch.empty((), dtype=prefill.DTYPE).expand(cfg.vocab_size, cfg.hidden_size)
    targets = torch.zeros(TOKENS, dtype=torch.int64)
    launches = []
    with launches_recorded(target, model, launches) as kernels:
        for tile, how in itertools.product(tiles, prefill.attention_settings(cfg)):
            attend = prefill.make_attention("triton", tile)
            prefill.attention_block(x, w, cos, sin, chunk, cfg, attend, prefill.TRITON_KERNELS, how)
        if not tiles:  # no Triton attention here (DeepSeek's 192 on RDNA3): another backend's, around the same kernels
            prefill.attention_block(x, w, cos, sin, chunk, cfg, lambda q, k, v, chunk, how, sinks=None: v.new_empty(
                *q.shape[:2], v.shape[2]), prefill.TRITON_KERNELS, prefill.attention_settings(cfg).most_common()[0][0])
        for tile, how in itertools.product(tree_tiles, prefill.attention_settings(cfg)):
            attend = prefill.make_attention("triton", tile)
            wave_kv = [torch.zeros(TOKENS, cfg.num_key_value_heads, D, dtype=prefill.DTYPE)
                       for D in (cfg.head_dim, cfg.v_head_dim)]
            prefill.attention_block(x, w, cos, sin, tree_chunk, cfg, attend, prefill.TRITON_KERNELS, how, wave_kv)
        if "mlp" in cfg.layouts:  # a mixture of experts' feed-forward: moe_launches
            prefill.mlp_block(x, prefill.layer_views(flat, cfg, "mlp"), cfg, TOKENS, prefill.TRITON_KERNELS)
        final_norm = torch.ones(cfg.hidden_size, dtype=prefill.DTYPE)
        head = lambda x, w, out: out  # float32 logits, by shape only (the loss's room for them), as F.linear's
        prefill.sequence_nll(x, lm_head, final_norm, targets, torch.zeros(TOKENS, dtype=torch.int64), 1,
                             cfg, TOKENS, prefill.dataclasses.replace(prefill.TRITON_KERNELS, head=head))
        # the model as a block-wise FP8 (gpt-oss: MXFP4) checkpoint would hold it (where its shapes allow one): each
        # kind of layer dequantized in one launch, its tables built as the streamer builds them
        fp8 = fp8_config(cfg)
        for kind, layer in {kind: layer for layer, kind in enumerate(fp8.layer_kinds)}.items() if fp8 else ():
            prefill.dequantize_layer_triton(torch.empty(fp8.layer_numel, dtype=prefill.DTYPE),
                                            torch.empty(fp8.dequantized_bytes // 2, dtype=prefill.DTYPE),
                                            prefill.fp8_layer(fp8.held[layer], fp8.layouts[kind], "cpu", fp8.mxfp4))
    return list(dict.fromkeys(launches)), kernels


def moe_launches(target, kind, tiles, model, fp8=False):
    """The distinct kernel launches of one MoE feed-forward (moe_block) with the expert kernel of kind ("triton": the
    grouped GEMM, "fused": the fused experts) in each of its tiles; fp8: its experts held FP8 (fp8_experts: the fused
    experts' FP8 variant)."""
    model_cfg = cfg = model_config(MODELS[model])
    E, H, I = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size  # as many experts as a token meets
    S, router = cfg.shared_intermediate_size, cfg.tensor_dtypes.get("mlp.gate.weight", prefill.DTYPE)
    cfg = dataclasses.replace(cfg, num_experts=E, n_group=1, topk_group=1)  # (its groups: of the model's experts)
    w = prefill.LayerWeights(mlp_norm=torch.ones(H, dtype=prefill.DTYPE), router=torch.zeros(E, H, dtype=router),
                             router_bias=torch.zeros(E) if cfg.router_kind == "sigmoid" else None,
                             gate_up=torch.empty(E, 2 * I, H, dtype=prefill.DTYPE),
                             down=torch.empty(E, H, I, dtype=prefill.DTYPE),
                             shared_gate_up=torch.empty(2 * S, H, dtype=prefill.DTYPE) if S else None,
                             shared_down=torch.empty(H, S, dtype=prefill.DTYPE) if S else None,
                             shared_gate=torch.empty(1, H, dtype=prefill.DTYPE) if cfg.shared_expert_gate else None)
    if cfg.fused_experts:  # gpt-oss: its experts' [experts, in, out] read through strides, and their biases
        w = dataclasses.replace(w, router_bias=torch.zeros(E, dtype=prefill.DTYPE),
                                gate_up=torch.empty(E, H, 2 * I, dtype=prefill.DTYPE).transpose(1, 2),
                                down=torch.empty(E, I, H, dtype=prefill.DTYPE).transpose(1, 2),
                                gate_up_bias=torch.zeros(E, 2 * I, dtype=prefill.DTYPE),
                                down_bias=torch.zeros(E, H, dtype=prefill.DTYPE))
    if fp8:  # the experts' runs as fp8_experts holds them, viewed as layer_views views them
        held = dataclasses.replace(fp8_config(model_cfg), num_experts=E, n_group=1, topk_group=1, fp8_experts=True)
        w = dataclasses.replace(w, **{field: torch.zeros(shape, dtype=dtype)
                                      for field, (_, shape, dtype) in held.expert_runs.items()})
    x = torch.zeros(TOKENS, H, dtype=prefill.DTYPE)
    launches = []
    # the fused router's launch at the model's own expert count; moe_block's routing by route (a recorded router
    # writes no experts for the experts' kernels to read)
    kernels = dataclasses.replace(prefill.TRITON_KERNELS, route=prefill.TORCH_KERNELS.route)
    with launches_recorded(target, model, launches):
        for tile in tiles:
            experts = prefill.make_experts(kind, tile, cfg.expert_activation)
            prefill.moe_block(x, w, cfg, TOKENS, kernels, experts)
        if model_cfg.router.kind in prefill.FUSED_ROUTERS:
            E = model_cfg.num_experts
            prefill.TRITON_KERNELS.route(x, dataclasses.replace(w, router=torch.zeros(E, H, dtype=router),
                                                                router_bias=torch.zeros(E, dtype=prefill.DTYPE)),
                                         model_cfg.router)
    return list(dict.fromkeys(launches))


def expert_tile(launch):
    c, o = launch.named_constexprs(), dict(launch.options)
    return c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], o["num_warps"], o["num_stages"]


def fused_gemm_tile(launch):  # (BLOCK_M, (BLOCK_N, BLOCK_K, warps, stages, TMA)) of a fused GEMM (GROUP_M: an int)
    c, o = launch.named_constexprs(), dict(launch.options)
    return c["BLOCK_M"], (c["BLOCK_N"], c["BLOCK_K"], o["num_warps"], o["num_stages"], c["TMA"])


# every fused experts' tile offered on RDNA3, whichever shape a model's is nearest to
RDNA3_FUSED_TILES = sorted({tile for tiles in prefill.FUSED_TILES["rdna3"].values() for tile in tiles})


# ----------------------------------------------------------------------------- compiling and reading the registers

def gfx1100_registers(launch):
    """Compiles one recorded launch for gfx1100 up to its assembly; returns the kernel's register and LDS use."""
    triton, target = amd_backend()
    from triton.compiler import ASTSource

    def without_link(*args):  # Triton's pipeline-stages hook: called bare for a cache key, then with the stages
        if not args:
            return "gfx1100-unlinked", "gfx1100-unlinked"
        args[1]["hsaco"] = lambda src, metadata: b""  # CompiledKernel wants a binary; nothing loads this one

    fn = getattr(prefill, launch.kernel)
    signature = dict(launch.signature)
    attrs = {k: json.loads(v) for k, v in launch.attrs}
    with mock.patch.object(triton.knobs.runtime, "add_stages_inspection_hook", without_link):
        compiled = triton.compile(ASTSource(fn, signature, dict(launch.constexprs), attrs), target=target,
                                  options=dict(launch.options))
    asm = compiled.asm["amdgcn"]

    def field(name):
        found = re.findall(rf"^\s*\.{name}:\s*(\d+)\s*$", asm, re.M)
        assert len(found) == 1, f"{launch.kernel}: {len(found)} .{name} fields in its gfx1100 assembly"
        return int(found[0])

    lds = field("group_segment_fixed_size") + compiled.metadata.shared  # static + Triton's dynamic allocation
    return {"vgprs": field("vgpr_count"), "vgpr_spills": field("vgpr_spill_count"), "sgprs": field("sgpr_count"),
            "sgpr_spills": field("sgpr_spill_count"), "scratch_bytes": field("private_segment_fixed_size"),
            "lds_bytes": lds}


def attention_tile(launch):
    c, o = launch.named_constexprs(), dict(launch.options)
    return c["BLOCK_M"], c["BLOCK_N"], o["num_warps"], o["num_stages"]


def problems(launch, regs):
    """What would make this compiled launch run badly or not at all on gfx1100, one line each, naming the launch."""
    found = []
    if regs["vgpr_spills"] or regs["sgpr_spills"]:
        found.append(f"spills {regs['vgpr_spills']} VGPRs and {regs['sgpr_spills']} SGPRs "
                     f"({regs['scratch_bytes']} B scratch)")
    if regs["lds_bytes"] > LDS_BYTES:
        found.append(f"needs {regs['lds_bytes']} B of LDS (gfx1100 has {LDS_BYTES})")
    return [f"{launch.kernel} [{launch.model}: {launch.config()}] {p}" for p in found]


@pytest.fixture(scope="module")
def fresh_triton_cache(tmp_path_factory):
    """A Triton cache of this module's own, so that every compile runs as on a clean machine."""
    with mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))}):
        yield


# ----------------------------------------------------------------------------- tests

def offered_tiles(model):
    return prefill.attention_tiles("rdna3", model_config(MODELS[model]))


def offered_tree_tiles(model):
    return prefill.tree_attention_tiles("rdna3", model_config(MODELS[model]))


def offered_launches(target):
    """Every distinct launch of prefill's kernels for every model, with the attention tiles offered on RDNA3, and of
    the MoE feed-forward with the grouped GEMM tiles and the fused experts' tiles offered there."""
    launches = []
    for model in MODELS:
        found, kernels = prefill_launches(target, model, offered_tiles(model), offered_tree_tiles(model))
        launches += found
    return launches + [launch for model in MOE_MODELS for kind, tiles in (("triton", prefill.EXPERT_TILES["rdna3"]),
                                                                          ("fused", RDNA3_FUSED_TILES))
                       for launch in moe_launches(target, kind, tiles, model)], kernels


@pytest.fixture(scope="module")
def offered():
    """(every launch offered on RDNA3, prefill's JIT functions), recorded once for the module's tests."""
    _, target = amd_backend()
    return offered_launches(target)


def distinct_compiles(launches):
    # a launch that several models make alike (Qwen3-32B's and Llama-3.1-70B's attention) is compiled once
    return list({dataclasses.replace(launch, model=""): launch for launch in reversed(launches)}.values())


def test_every_kernel_prefill_launches_is_recorded_in_every_offered_variant(offered):
    launches, kernels = offered
    launched = {launch.kernel for launch in launches}
    # each JIT function is launched, or is a helper that a launched kernel calls (or a helper of one): a new kernel
    # cannot go unchecked
    called, callers = set(), launched
    while callers:
        callers = {name for name in kernels for k in callers if re.search(rf"\b{name}\(", getattr(prefill, k).src)}
        callers -= called
        called |= callers
    assert set(kernels) == launched | called, f"never launched by prefill's layers: {set(kernels) - launched - called}"
    for kernel, offers in (("_attention_kernel", offered_tiles), ("_tree_attention_kernel", offered_tree_tiles)):
        tiles = {(launch.model, attention_tile(launch)) for launch in launches if launch.kernel == kernel}
        assert tiles == {(model, tile) for model in MODELS for tile in offers(model)}, kernel
        variants = {tuple(launch.named_constexprs()[k] for k in ("WINDOW", "SOFTCAP", "SINKS")) for launch in launches
                    if launch.kernel == kernel}
        assert variants == {(False, False, False), (True, False, False), (False, True, False), (True, True, False),
                            (False, False, True), (True, False, True)}, kernel  # every one launched
    assert not offered_tiles("Gemma-3-4B") and offered_tiles("Gemma-2-27B") == prefill.RDNA3_VARIANT_TILES
    assert not offered_tree_tiles("Gemma-3-4B") and offered_tree_tiles("Gemma-2-27B") == prefill.RDNA3_VARIANT_TILES
    ropes = {(c["NORM"], c["INTERLEAVE"]) for launch in launches if launch.kernel == "_head_norm_rope_kernel"
             for c in [launch.named_constexprs()]}
    assert ropes == {(0, False), (1, False), (2, False), (0, True)}
    assert not offered_tiles("DeepSeek-V3") and not offered_tree_tiles("Moonlight-16B-A3B")  # q/k head dim 192
    partial = {(launch.model, c["ROT"]) for launch in launches if launch.kernel == "_head_norm_rope_kernel"
               for c in [launch.named_constexprs()] if c["ROT"] < c["HALF"]}
    assert partial == {("GLM-4.5-Air", 32), ("GLM-4.5", 32)}  # RoPE on half of their heads of 128: 64 channels
    assert {c["NORM"] for launch in launches if launch.kernel == "_head_norm_rope_kernel"
            for c in [launch.named_constexprs()] if c["ROT"] < c["HALF"]} == {0, 1}  # without and with a q/k norm
    assert ({expert_tile(launch) for launch in launches if launch.kernel == "_grouped_gemm_kernel"}
            == set(prefill.EXPERT_TILES["rdna3"]))
    for kernel, gemm in (("_moe_gate_up_kernel", 1), ("_moe_down_kernel", 2)):  # each GEMM in each fused tile
        assert ({fused_gemm_tile(launch) for launch in launches if launch.kernel == kernel}
                == {(tile[0], tile[gemm][:2] + tile[gemm][3:]) for tile in RDNA3_FUSED_TILES}), kernel
        # gpt-oss's variant (biases; gate and up interleaved, the clamped SwiGLU) beside the others'
        variants = {(c["BIAS"], c.get("CLAMPED", c["BIAS"])) for launch in launches if launch.kernel == kernel
                    for c in [launch.named_constexprs()]}
        assert variants == {(False, False), (True, True)}, (kernel, variants)
    # the fused router of every softmax and gpt-oss router: its expert counts (a power of two or not), top-k, kinds
    routers = {(launch.model, c["BLOCK"], c["K"], c["TOPK_FIRST"], c["RENORMALIZE"]) for launch in launches
               if launch.kernel == "_route_kernel" for c in [launch.named_constexprs()]}
    assert routers == {("Qwen3-30B-A3B", 128, 8, False, True), ("Qwen3-235B-A22B", 128, 8, False, True),
                       ("Mixtral-8x7B", 8, 2, False, True), ("Qwen1.5-MoE-A2.7B", 64, 4, False, False),
                       ("gpt-oss-120b", 128, 4, True, False)}, routers
    assert len(distinct_compiles(launches)) > 100  # the parts below compile them all


# The ~140 compiles take ~2 minutes of one core: a part each of PARTS tests, every PARTS-th launch of the recorded
# order (each part a share of every kernel), so that pytest-xdist's workers share them
PARTS = 6


@pytest.mark.parametrize("part", range(PARTS))
def test_every_kernel_prefill_launches_compiles_for_gfx1100_without_spills(fresh_triton_cache, offered, part):
    triton, _ = amd_backend()
    compiles = distinct_compiles(offered[0])[part::PARTS]
    failures = [p for launch in compiles for p in problems(launch, gfx1100_registers(launch))]
    assert not failures, f"gfx1100, Triton {triton.__version__}:\n" + "\n".join(failures)


def test_the_fp8_layer_dequantization_compiles_for_gfx1100_without_spills(fresh_triton_cache):
    # the test above compiles it with the rest; here alone (-k fp8), for every model an FP8 (gpt-oss: MXFP4)
    # checkpoint can hold. The shapes are in its tables, so its configurations are its pointers' alone: within 2 GiB,
    # over, and as in Qwen3-235B-A22B's run (the held layer and its scratch over, the tables within); MXFP4's as
    # gpt-oss-120b's run (the held layer within, its scratch over) and within
    triton, target = amd_backend()
    launches = [launch for model in MODELS for launch in prefill_launches(target, model, ())[0]
                if launch.kernel == "_dequantize_layer_kernel"]
    assert {launch.model for launch in launches} == {m for m in MODELS if fp8_config(model_config(MODELS[m]))}
    compiles = distinct_compiles(launches)
    assert sorted(launch.named_constexprs()["MXFP4"] for launch in compiles) == [False] * 3 + [True] * 2
    failures = [p for launch in compiles for p in problems(launch, gfx1100_registers(launch))]
    assert not failures, f"gfx1100, Triton {triton.__version__}:\n" + "\n".join(failures)


def test_the_fp8_experts_spill_on_gfx1100_so_rdna3_runs_fp8_held_experts_by_the_loop(fresh_triton_cache, monkeypatch):
    # Triton compiles float8e4nv for gfx1100, converting it in software (third_party/amd/backend/compiler.py,
    # HIPOptions.supported_fp8_dtypes: "software emulate" before CDNA4 and RDNA4; Triton 3.9), but the fused experts'
    # FP8 variant then spills SGPRs in every RDNA3 tile (6 of the 8 compiles of RDNA3's two tiles, and each of three
    # more tiles tried, at 107 SGPRs with 6-23 spilled; the bf16 variant of RDNA3's first tile uses 27-33): not offered
    # there. Where a plan holds the experts FP8 (fp8_experts), RDNA3's candidate is the loop, an expert dequantized at a
    # time. Under Triton 3.6 (.ci/run's second step) this launch compiles unspilled (191 VGPRs, 85 SGPRs), but what is
    # offered must compile unspilled under both; this test fails once the lock's Triton compiles the variant unspilled
    triton, target = amd_backend()
    [launch] = [launch for launch in moe_launches(target, "fused", RDNA3_FUSED_TILES[:1], "DeepSeek-V3", fp8=True)
                if launch.kernel == "_moe_down_kernel" and launch.named_constexprs()["FP8"]][:1]
    if tuple(int(n) for n in triton.__version__.split(".")[:2]) >= (3, 9):
        assert problems(launch, gfx1100_registers(launch)), f"Triton {triton.__version__}: offer the FP8 variant on RDNA3"
    monkeypatch.setattr(prefill, "gpu_family", lambda device: "rdna3")
    monkeypatch.setattr(prefill, "grouped_mm_native", lambda device: False)
    cfg = dataclasses.replace(fp8_config(model_config(MODELS["DeepSeek-V3"])), fp8_experts=True)
    assert [kind for _, kind, _ in prefill.expert_candidates("auto", torch.device("cuda"), cfg, 16384)] == ["loop"]


def test_gfx1100_spill_check_sees_a_known_spilling_tile(fresh_triton_cache):
    _, target = amd_backend()
    [launch] = [l for l in prefill_launches(target, "Qwen3-32B", [KNOWN_SPILLING_TILE])[0]
                if l.kernel == "_attention_kernel"]
    regs = gfx1100_registers(launch)
    assert regs["vgpr_spills"] > 0 and problems(launch, regs), regs


# ----------------------------------------------------------------------------- the layer dequantization on sm_90a

# dequantize_layer_triton's vector accesses in the H200's PTX (the same under Triton 3.9 and 3.6): a tensor in whole
# 16 B of bf16 (every tensor of these models: tests/test_fp8.py) has FP8 read 8 B a thread (ld.global.v2.b32), a copy
# 16 B (ld.global.v4.b32), both written 16 B (st.global.v4.b32), 16 elements a thread a step; an MXFP4 model's launch
# runs on 4 warps (MXFP4_WARPS), so its copies take 32 elements a thread a step (4 of each), its blocks 16 B a thread
# (ld.global.v4.b32: a [32, 4, 16] tile) and its two nibbles 16 B twice each, 8 rows of a column (before issue 37's
# second change, a [32, 4, 16] tile on 8 warps: 8 B, ld.global.v2.b32, and once each). At bf3ce35 there were none: FP8
# read by ld.global.b8, every bf16 written by st.global.b16 (MXFP4: 2 B a thread `out` elements apart).
SM90_VECTOR_ACCESSES = {"Qwen3-30B-A3B": {"ld.global.v2.b32": 2, "ld.global.v4.b32": 2, "st.global.v4.b32": 4},
                        "gpt-oss-120b": {"ld.global.v4.b32": 5, "st.global.v4.b32": 8}}


def test_the_layer_dequantization_reads_and_writes_16_bytes_at_a_time_on_sm_90a(fresh_triton_cache):
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    target = GPUTarget("cuda", 90, 32)
    for model, want in SM90_VECTOR_ACCESSES.items():
        [launch] = distinct_compiles([launch for launch in prefill_launches(target, model, ())[0]
                                      if launch.kernel == "_dequantize_layer_kernel"])
        source = ASTSource(prefill._dequantize_layer_kernel, dict(launch.signature), dict(launch.constexprs),
                           {k: json.loads(v) for k, v in launch.attrs})
        ptx = triton.compile(source, target=target, options=dict(launch.options)).asm["ptx"]
        found = re.findall(r"\b(?:ld|st)\.global\.v\d\.b\d+", ptx)
        assert {op: found.count(op) for op in found} == want, f"{model}, Triton {triton.__version__}"


# ----------------------------------------------------------------------------- the record

REFERENCE_TILES = [(64, 32, 4, 1), (64, 16, 4, 1), (128, 32, 8, 1), (128, 16, 8, 1), (32, 32, 8, 1)]


def record(out):
    """Writes (or adds this Triton's entry to) a JSON table of every launch above, plus attention tiles that are
    not offered on RDNA3 (the NVIDIA ones, and others that were or might be), for reference."""
    triton, target = amd_backend()
    offered, _ = offered_launches(target)
    every = dict.fromkeys(prefill.ATTENTION_TILES["rdna3"] + prefill.RDNA3_VARIANT_TILES
                          + prefill.ATTENTION_TILES["nvidia"] + REFERENCE_TILES)
    offers = {"_attention_kernel": offered_tiles, "_tree_attention_kernel": offered_tree_tiles}
    for model in MODELS:
        others, tree_others = ([tile for tile in every if tile not in offers[kernel](model)] for kernel in offers)
        offered += [launch for launch in prefill_launches(target, model, others, tree_others)[0]
                    if launch.kernel == "_attention_kernel" and attention_tile(launch) in others
                    or launch.kernel == "_tree_attention_kernel" and attention_tile(launch) in tree_others]
    rows = [{"kernel": launch.kernel, "model": launch.model, "config": launch.config(),
             "offered on gfx1100": attention_tile(launch) in offers[launch.kernel](launch.model)
             if launch.kernel in offers else True, **gfx1100_registers(launch)} for launch in offered]
    table = json.loads(out.read_text()) if out.exists() else {}
    table["what"] = ("A static compile, no GPU: each kernel launch prefill makes (recorded from its layer code with "
                     f"{', '.join(MODELS)}'s dimensions) compiled by Triton's AMD backend for "
                     "GPUTarget('hip', 'gfx1100', 32) to assembly; registers, spills and scratch from the "
                     "assembly's kernel metadata, LDS = static + Triton's dynamic shared memory. Nothing ran. "
                     "Each 'triton X' entry is one run of tests/test_gfx1100_compile.py as a script, "
                     "with that Triton's pip wheel first on the path.")
    table[f"triton {triton.__version__}"] = rows
    rows_text = lambda v: json.dumps(v) if isinstance(v, str) else "[\n  " + ",\n  ".join(map(json.dumps, v)) + "\n ]"
    out.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {rows_text(v)}" for k, v in table.items()) + "\n}\n")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}):
        record(Path(sys.argv[1]))

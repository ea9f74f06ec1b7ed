"""Block-wise FP8 checkpoints (the official Qwen3-*-FP8 layout): read, dequantized bit for bit as transformers does,
held and streamed as FP8, and everything else in a quantization_config refused."""
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import prefill
from test_prefill import TEXTS, TOLERANCE, max_rel_err, runner, transformers_losses

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


def write_fp8_checkpoint(out, tokenizer_dir, scales="float32", **quantization):
    """A tiny random Qwen3 (every projection a multiple of 128, or one block smaller), each projection quantized per
    128x128 block, in the official layout. Each block's weights are scaled by its own power of two, so that scales
    applied to the wrong blocks (a transposed grid) change the numbers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith("_proj.weight"):
                p.normal_(0, (10 if ("q_proj" in name or "k_proj" in name) else 2) / p.shape[1] ** 0.5)
                grid = prefill.scale_grid(p.shape)
                factor = 2.0 ** torch.randint(-2, 3, grid, generator=gen).float()
                w = p * factor.repeat_interleave(128, 0)[:p.shape[0]].repeat_interleave(128, 1)[:, :p.shape[1]]
                q, s = quantize(w)
                tensors[name], tensors[name + "_scale_inv"] = q, {
                    "float32": s, "bf16": s.to(torch.bfloat16),
                    "ue8m0": (torch.log2(s).ceil() + 127).to(torch.uint8)}[scales]
            elif p.dim() == 2:
                p.normal_(0, 0.5)
                tensors[name] = p.to(torch.bfloat16)
            else:
                p.normal_(3 if ("q_norm" in name or "k_norm" in name) else 1, 0.2)
                tensors[name] = p.to(torch.bfloat16)
    out = Path(out)
    out.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["quantization_config"] = {**FP8_CONFIG, **quantization}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out)
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, qwen_tokenizer_dir):
    out = write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"), qwen_tokenizer_dir)
    return out, transformers_losses(out, TEXTS)


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


def test_matches_transformers_and_an_ablation_fails(fp8_checkpoint, monkeypatch):
    path, reference = fp8_checkpoint
    r = runner(path)
    ids = r.tokenize(TEXTS)
    assert max_rel_err(r.losses(ids), reference) < TOLERANCE
    dequantize = prefill.dequantize_fp8
    for ablation in (lambda q, s, out: dequantize(q, torch.ones_like(s), out),      # the scales ignored
                     lambda q, s, out: dequantize(q, s.T.reshape(s.shape).contiguous(), out)):  # grid transposed
        monkeypatch.setattr(prefill, "dequantize_fp8", ablation)
        assert max_rel_err(r.losses(ids), reference) > 3 * TOLERANCE
    monkeypatch.setattr(prefill, "dequantize_fp8", dequantize)


def test_held_as_fp8_and_every_layer_streamed_equals_resident(fp8_checkpoint):
    path, _ = fp8_checkpoint
    resident, streamed = runner(path), runner(path, gpu_memory_gib=0, load="copy")
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
def test_scales_in_bf16_and_ue8m0(tmp_path, qwen_tokenizer_dir, scales):
    extra = {"scale_fmt": "ue8m0"} if scales == "ue8m0" else {}
    path = write_fp8_checkpoint(tmp_path, qwen_tokenizer_dir, scales, **extra)
    r = runner(path)
    assert max_rel_err(r.losses(r.tokenize(TEXTS[:3])), transformers_losses(path, TEXTS[:3])) < TOLERANCE


@pytest.mark.parametrize("change, says", [
    ({"quant_method": "gptq"}, "quantization_config 'gptq'"),
    ({"quant_method": "compressed-tensors"}, "quantization_config 'compressed-tensors'"),
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


# The one-launch dequantization in Triton's interpreter (a child process: test_prefill.interpreted). On a layer of
# its own, held bytes random: 16 experts whose sides (24, 96) are all below a block, each tensor against
# dequantize_fp8 (or the bf16 copy) as transformers computes it, every element of the layer compared. Then the
# start-up check passes it and refuses two bugs planted in its tables, and a Runner whose dequantization alone is the
# interpreted kernel (the rest PyTorch) scores the bits of the PyTorch one, every layer streamed, in one launch a
# layer.
FP8_LAYER_KERNEL = """
import dataclasses, json, math, sys, torch, prefill
cpu = torch.device("cpu")
cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[2]))
parts, layout = cfg.held["moe"], cfg.layouts["moe"]
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

good = prefill.dequantize_layer_triton
def changed(column, change):  # the tables with one column changed
    def planted(held, out, layer):
        tensors = layer.tensors.clone()
        tensors[:, column] = change(tensors[:, column])
        good(held, out, dataclasses.replace(layer, tensors=tensors))
    return planted
planted = {"the next block's scale": changed(1, lambda s: torch.where(s >= 0, s + 1, s)),
           "sides below a block dropped": changed(3, lambda rows: rows // 128 * 128)}
report["check"] = [e for _, _, e in prefill.dequantize_checks(cpu)]
for name, bug in planted.items():
    prefill.dequantize_layer_triton = bug
    report[name] = [e for _, _, e in prefill.dequantize_checks(cpu)]
prefill.dequantize_layer_triton = good

launches, kernel = [], prefill._dequantize_layer_kernel
class Counted:
    def __getitem__(self, grid):
        launches.append(grid)
        return kernel[grid]
prefill._dequantize_layer_kernel = Counted()
prefill.TORCH_KERNELS.dequantize_layer = prefill.dequantize_layer_triton
r = prefill.Runner(sys.argv[1], device="cpu", attention="sdpa", kernels="torch", gpu_memory_gib=0)
ids, before = r.tokenize(json.loads(sys.argv[3])), len(launches)
report["triton"] = r.losses(ids)
report["launches"], report["layers"] = len(launches) - before, len(r.plan.streamed_layers)
r.streamer.dequantize = prefill.dequantize_layer  # the same Runner with PyTorch's dequantization
report["torch"] = r.losses(ids)
print(json.dumps(report))
"""
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
    assert report["the next block's scale"] == report["sides below a block dropped"] == [math.inf], report
    assert report["triton"] == report["torch"], report
    assert report["layers"] == 3 and report["launches"] == 3, report


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


def test_the_protocol_serves_an_fp8_checkpoint(fp8_checkpoint, monkeypatch, capsys):
    # the whole path a user takes (warm-up included), in-process: ready, then the losses Runner.score gives
    import io
    path, reference = fp8_checkpoint
    protocol = io.StringIO()
    monkeypatch.setattr(prefill, "take_stdout", lambda: protocol)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((json.dumps(TEXTS) + "\n").encode())))
    rc = prefill.main(["--model", str(path), "--device", "cpu", "--attention", "sdpa", "--gpu-memory", "0"])
    lines = protocol.getvalue().splitlines()
    assert rc == 0 and lines[0] == "ready", capsys.readouterr().err
    assert max_rel_err([float(x) for x in lines[1:]], reference) < TOLERANCE


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
    cfg["moe_intermediate_size"] = 128  # whole 128x128 blocks, as in every real geometry
    with pytest.raises(interact.UserError, match=r"experts\.0\.gate_proj\.weight has shape \[64, 128\], not a whole"):
        make_checkpoint.build(tmp_path / "partial", make_checkpoint.geometry("tiny-moe"), seed=3, device="cpu",
                              tokenizer=qwen_tokenizer_dir, reuse=True, fp8=True)
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

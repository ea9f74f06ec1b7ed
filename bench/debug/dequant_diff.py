"""Where the one-launch FP8 dequantization and PyTorch's differ on a GPU: dequantize_checks' layer, per tensor."""
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
import torch  # noqa: E402

import prefill  # noqa: E402

dev = torch.device("cuda")
gen, tiny = torch.Generator().manual_seed(3), prefill.ModelConfig.from_json(prefill.FP8_CHECK_MODEL)
parts, layout = tiny.held[tiny.layer_kinds.index(tiny.largest_kind)], tiny.layer_layout
held = torch.randint(256, (tiny.layer_bytes,), generator=gen, dtype=torch.uint8)
for _, offset, shape, dtype in parts:
    n = math.prod(shape)
    if dtype == prefill.FP8:
        q = held[offset:offset + n]
        q[(q & 127) == 127] = 0
    elif dtype == torch.float32:
        prefill.typed(held, offset, n, dtype).copy_(torch.rand(n, generator=gen) * 2.0 ** torch.randint(-24, 4, (n,), generator=gen))
out = {}
for where in ("cpu", "cuda"):
    d = torch.device(where)
    layer, h = prefill.fp8_layer(parts, layout, d), held.to(d)
    for name, fn in (("torch", prefill.dequantize_layer), ("triton", prefill.dequantize_layer_triton)):
        if where == "cpu" and name == "triton":
            continue
        o = torch.zeros(tiny.dequantized_bytes // 2, dtype=torch.int16, device=d)
        fn(h, o.view(prefill.DTYPE), layer)
        torch.cuda.synchronize()
        out[f"{where} {name}"] = o.cpu()
ref = out["cpu torch"]
for k, v in out.items():
    print(k, "equal to cpu torch:", torch.equal(v, ref), "mismatches:", int((v != ref).sum()))
got = out["cuda triton"]
for name, (start, shape) in sorted(layout.items(), key=lambda x: x[1][0]):
    n = math.prod(shape)
    bad = (got[start:start + n] != ref[start:start + n]).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        print(f"{name} {list(shape)} at {start}: {len(bad)} of {n} differ; first at {i} (row {i // shape[-1]}, col {i % shape[-1]}): "
              f"got {int(got[start + i])} want {int(ref[start + i])}; got-view {got[start:start+n].view(torch.bfloat16)[i].item()} want {ref[start:start+n].view(torch.bfloat16)[i].item()}")
beyond = (got != ref).nonzero().flatten()
print("total mismatches", len(beyond), "first", beyond[:10].tolist())

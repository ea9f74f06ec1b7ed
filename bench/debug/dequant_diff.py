"""Where the one-launch FP8 dequantization and PyTorch's differ on a GPU: the start-up check's layer
(prefill.fp8_check_layer), compared element by element with PyTorch's on the CPU, the first difference per tensor.

    python bench/debug/dequant_diff.py
"""
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
import torch  # noqa: E402

import prefill  # noqa: E402

tiny, parts, layout, held = prefill.fp8_check_layer()
out = {}
for where, name, dequantize in (("cpu", "torch", prefill.dequantize_layer), ("cuda", "torch", prefill.dequantize_layer),
                                ("cuda", "triton", prefill.dequantize_layer_triton)):
    device = torch.device(where)
    o = torch.zeros(tiny.dequantized_bytes // 2, dtype=torch.int16, device=device)
    dequantize(held.to(device), o.view(prefill.DTYPE), prefill.fp8_layer(parts, layout, device))
    out[f"{where} {name}"] = o.cpu()
ref, got = out["cpu torch"], out["cuda triton"]
for k, v in out.items():
    print(k, "equal to cpu torch:", torch.equal(v, ref), "mismatches:", int((v != ref).sum()))
for name, (start, shape) in sorted(layout.items(), key=lambda x: x[1][0]):
    n = math.prod(shape)
    bad = (got[start:start + n] != ref[start:start + n]).nonzero().flatten()
    if len(bad):
        i, cols = int(bad[0]), shape[-1]
        print(f"{name} {list(shape)} at {start}: {len(bad)} of {n} differ; first at row {i // cols}, col {i % cols}: "
              f"got {got[start + i].view(torch.bfloat16).item()} ({int(got[start + i])}), "
              f"want {ref[start + i].view(torch.bfloat16).item()} ({int(ref[start + i])})")
print("total mismatches", int((got != ref).sum()))

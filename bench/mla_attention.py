"""Latent attention read unjoined (prefill.Latent: _attention_kernel's ROPE variant) against the same inputs joined
(prefill.joined: the torch.cat of q's and k's halves and v's copy, as every run did before), on a model's shapes, on
the device: each Triton tile's error from float32 attention (prefill.attention_reference) and its time
(prefill.attention_ms), and the join's time (one device command, seconds).

    python bench/mla_attention.py /dev/shm/pb/moon > $OUT/mla-attention.txt     # a latent-attention checkpoint folder
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import prefill  # noqa: E402

LENGTHS = ([37, 100, 650, 3000], [512] * 8, [4096] * 4)  # the start-up check's; contest-like; long texts


def main():
    cfg, dev = prefill.ModelConfig.from_dir(sys.argv[1]), torch.device("cuda")
    how = prefill.attention_settings(cfg).most_common()[0][0]
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, Triton {prefill.triton.__version__}; "
          f"{cfg.num_attention_heads} heads, q/k {cfg.qk_nope_head_dim} + {cfg.rope_dim}, v {cfg.v_head_dim}")
    for lens in LENGTHS:
        q, k, v, chunk = prefill.attention_inputs(dev, cfg, lens, 0, latent=True)
        ref, whole = prefill.attention_reference(q, k, v, chunk, how), prefill.joined(q, k, v)
        row = []
        for tile in prefill.ATTENTION_TILES["nvidia"]:
            attend = prefill.make_attention("triton", tile)
            errors = [prefill.check_error(attend(*x, chunk, how), ref) for x in ((q, k, v), whole)]
            ms = [prefill.attention_ms(attend, (*x, chunk), how)[1] for x in ((q, k, v), whole)]
            join = prefill.gated_ms(dev, lambda: prefill.joined(q, k, v))
            row.append(f"{tile[0]}x{tile[1]}: error unjoined {errors[0]:.2e} joined {errors[1]:.2e}; ms unjoined "
                       f"{ms[0]:.3f}, joined {ms[1]:.3f} + the join {join:.3f}")
        print(f"texts {len(lens)} x {lens[0]}..{lens[-1]} ({sum(lens)} tokens) | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()

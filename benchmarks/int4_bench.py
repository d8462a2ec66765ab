"""Grid-recovery throughput (bf16 q4_0 weights -> exact (q, d) + packed int4)
on tensors with the real E2B linear shapes.

    ./run python benchmarks/int4_bench.py [--scale fp16|bf16]

`--scale fp16` builds the weights as bf16(q * d_fp16) (GGML q4_0 keeps d in
fp16, so no bf16 d reproduces every value and the 1-ulp path runs);
`bf16` as bf16(q * d_bf16).
"""
import argparse
import time

import ml_dtypes
import numpy as np

from vllm_gemma_qat import int4

# E2B (hidden 1536, heads 8, KV 1, head_dim 256/512, MLP 6144 / 12288 shared).
SHAPES = {
    "q_proj (sliding)": (2048, 1536), "q_proj (full)": (4096, 1536),
    "k_proj (sliding)": (256, 1536), "o_proj (full)": (1536, 4096),
    "gate_proj": (6144, 1536), "gate_proj (double-wide)": (12288, 1536),
    "down_proj": (1536, 6144), "per_layer_input_gate": (256, 1536),
    "per_layer_projection": (1536, 256),
}


def make(shape, scale, rng):
    q = rng.integers(-8, 8, size=shape).astype(np.int8)
    d = rng.uniform(2e-3, 2e-2, size=(shape[0], shape[1] // 32))
    d = d.astype(np.float16 if scale == "fp16" else ml_dtypes.bfloat16)
    w = q.reshape(shape[0], -1, 32).astype(np.float32) * d.astype(
        np.float32)[..., None]
    return w.reshape(shape).astype(ml_dtypes.bfloat16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["fp16", "bf16"], default="fp16")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    int4.recover_grid(make((256, 64), args.scale, rng))       # compile
    int4.recover_grid(make((8192, 1536), args.scale, rng))    # compile
    total_bytes = total_s = 0.0
    print(f"{'tensor':<26}{'shape':>14}{'MB':>8}{'s':>8}{'GB/s':>8}")
    for name, shape in SHAPES.items():
        w = make(shape, args.scale, rng)
        t = time.perf_counter()
        q, d = int4.recover_grid(w, name)
        int4.pack_int4(q)
        dt = time.perf_counter() - t
        total_bytes += w.nbytes
        total_s += dt
        print(f"{name:<26}{str(shape):>14}{w.nbytes / 1e6:>8.1f}{dt:>8.2f}"
              f"{w.nbytes / dt / 1e9:>8.3f}")
    print(f"recover + pack, all shapes ({args.scale} scales): "
          f"{total_bytes / total_s / 1e9:.3f} GB/s of bf16 input")


if __name__ == "__main__":
    main()

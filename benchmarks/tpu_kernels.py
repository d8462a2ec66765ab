"""The int4 matmul candidates and RPA v3 at Gemma 4 E2B / E4B shapes, timed
on a TPU in one command; on a machine without one, compiled for a TPU
topology instead (libtpu, deviceless: generated code and XLA's estimate).

    # here (the project's venv): a folder holding this script, the kernel
    # sources it runs, copied from the installed tokamax / tpu-inference,
    # and the shapes, taken from the E2B / E4B configs
    ./run python benchmarks/tpu_kernels.py --bundle /tmp/tpu-kernels
    # on a TPU VM with only jax and libtpu (pip install jax[tpu])
    python tpu-kernels/tpu_kernels.py --out results.json
    # no TPU: every program compiled for a topology, nothing timed
    ./run python benchmarks/tpu_kernels.py --topology v5e-1

int4 candidates, one linear y = x @ W of the step (W on the q4_0 grid:
int4 q, one bf16 scale d per 32 inputs, tpu-inference's wNa16 layout):

- `bf16`: the same weights dense in bf16, XLA's dot (what a bf16 export runs)
- `gmm_v2 tokamax`: tokamax's `gmm_v2` with its own tiles (stock tpu-inference)
- `gmm_v2 served`: as gemma_qat serves it: patch 0013's tiles
  (`vllm_gemma_qat/fixes/int4_tiles.py`), scales held in f32 (patch 0014)
- `xla int4 grouped`: XLA only, int4 operands: one dot per group of 32
  inputs, scaled and summed in f32 (exact, as the kernel is)
- `xla int4 dequant`: XLA only: W = bf16(q * d), then one dot (tpu-inference's
  `xla_quantized_matmul` form; q * d rounded to bf16, not exact)

Each runs at decode (16 tokens) and prefill (512 tokens) for every distinct
linear shape of the step, with its count per step. RPA v3 (tpu-inference's
ragged paged attention, bf16 KV, pages of 256 tokens) runs per attention
layer kind at decode (16 and 64 sequences at 2K and 8K context) and for one
512-token prefill.

On a TPU every output is first checked against a float64 product of the
same weights (int4 candidates) or of a dense attention (RPA), then timed:
the op repeated R times inside one jit, each repetition depending on the
last, the median over runs of (time at R2 - time at R1) / (R2 - R1): no
host dispatch in the figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if (HERE / "vendor").is_dir():  # a bundle: the kernels it carries
    sys.path.insert(0, str(HERE / "vendor"))

GROUP = 32
# Candidates given their scales in f32, as gemma_qat holds them (patch
# 0014); the others get the checkpoint's bf16, as stock tpu-inference.
F32_SCALES = {"gmm_v2 served"}
DECODE_TOKENS, PREFILL_TOKENS = 16, 512
PAGE = 256
# (sequences, context, query tokens per sequence): decode, one prefill chunk
RPA_CASES = [(16, 2048, 1), (64, 2048, 1), (16, 8192, 1), (64, 8192, 1),
             (1, PREFILL_TOKENS, PREFILL_TOKENS)]

# What a bundle carries: (package, module path inside it) copied verbatim
# from the installed packages; every package directory on the way gets an
# empty __init__.py (the installed ones import far more than these files).
VENDORED = [
    ("tokamax", "_src/config.py"),
    ("tokamax", "_src/ops/experimental/gmm_v2/gmm_v2.py"),
    ("tpu_inference", "kernels/ragged_paged_attention/v3/kernel.py"),
    ("tpu_inference", "kernels/ragged_paged_attention/v3/util.py"),
]
VENDORED_PACKAGES = ["absl"]  # tokamax's config reads absl flags


# --- shapes ---------------------------------------------------------------

FUSED = ("mlp.gate_proj.weight", "mlp.up_proj.weight")  # one gate_up call

def shapes_from_configs() -> dict:
    """Per model: the step's int4 linears as {"K x N": calls per step}
    (gate and up fused, as tpu-inference runs them; KV-shared layers
    without K/V) and its attention layer kinds with their counts, from the
    public configs (`testing/synthetic.py`) through `geometry.Geometry`."""
    from vllm_gemma_qat.geometry import Geometry
    from vllm_gemma_qat.testing.synthetic import CONFIGS
    out = {}
    for name, config in CONFIGS.items():
        text = config["text_config"]
        geo = Geometry.from_text_config(text)
        linears, attention = {}, {}

        def count(table, key):
            table[key] = table.get(key, 0) + 1
        for i in range(geo.num_layers):
            tensors = geo.layer_tensors(i)
            for key, shape in tensors.items():
                if len(shape) == 2 and key not in FUSED:
                    count(linears, "{1}x{0}".format(*shape))
            n, k = tensors[FUSED[0]]
            count(linears, f"{k}x{2 * n}")  # gate_up
            kind = "full" if geo.is_full(i) else "sliding"
            count(attention, f"{kind} {geo.kv_heads(i)}x{geo.head_dim(i)}")
        projection = geo.global_tensors().get(
            "per_layer_model_projection.weight")
        if projection:
            count(linears, "{1}x{0}".format(*projection))
        out[name] = {"linears": linears, "attention": attention,
                     "q_heads": text["num_attention_heads"],
                     "sliding_window": text["sliding_window"]}
    return out


def load_shapes() -> dict:
    bundled = HERE / "shapes.json"
    if bundled.exists():
        return json.loads(bundled.read_text())
    return shapes_from_configs()


def tile_rule():
    """patch 0013's rule: the project's module, or the bundle's copy."""
    try:
        from vllm_gemma_qat.fixes import int4_tiles
    except ImportError:
        import int4_tiles
    return int4_tiles


# --- the bundle -------------------------------------------------------------

def bundle(dest: Path) -> None:
    import importlib
    dest.mkdir(parents=True, exist_ok=True)
    vendor = dest / "vendor"
    shutil.rmtree(vendor, ignore_errors=True)
    manifest = []
    for package, relative in VENDORED:
        source = Path(importlib.import_module(package).__file__).parent / relative
        target = vendor / package / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        manifest.append(str(source))
        parent = target.parent
        while parent != vendor:
            (parent / "__init__.py").touch()
            parent = parent.parent
    for package in VENDORED_PACKAGES:
        source = Path(importlib.import_module(package).__file__).parent
        shutil.copytree(source, vendor / package, ignore=shutil.ignore_patterns(
            "__pycache__", "testing", "*_test.py"))
        manifest.append(str(source))
    from vllm_gemma_qat.fixes import int4_tiles
    shutil.copyfile(int4_tiles.__file__, vendor / "int4_tiles.py")
    manifest.append(int4_tiles.__file__)
    shutil.copyfile(__file__, dest / "tpu_kernels.py")
    (dest / "shapes.json").write_text(json.dumps(shapes_from_configs(), indent=1))
    from importlib.metadata import PackageNotFoundError, version
    versions = {}
    for dist in ("jax", "jaxlib", "libtpu", "tokamax", "tpu-inference", "absl-py"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:  # not installed here
            versions[dist] = None
    (dest / "SOURCES.json").write_text(json.dumps(
        {"copied": manifest, "versions": versions}, indent=1))
    print(f"{dest}: copy it to a TPU VM with the jax and libtpu the kernels "
          f"were copied beside (pip install jax=={versions['jax']} "
          f"jaxlib=={versions['jaxlib']} libtpu=={versions['libtpu']}), "
          f"then run\n  python {dest.name}/tpu_kernels.py --out results.json")


# --- the programs -----------------------------------------------------------

@dataclasses.dataclass
class Program:
    kind: str  # "linear" | "rpa"
    model: str
    shape: str
    tokens: int
    candidate: str
    count: int  # calls per step
    fn: object = None  # (*args) -> output
    args: tuple = ()  # arrays on a TPU, ShapeDtypeStructs without one
    repeat: object = None  # (args, output) -> args for the next repetition
    check: object = None  # (args, output) -> error message or None
    donate: tuple = ()  # arguments updated in place (RPA's KV cache)


def _int4_weights(k: int, n: int, seed: int, abstract: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np
    if abstract:
        return (jax.ShapeDtypeStruct((k, n), jnp.int4),
                jax.ShapeDtypeStruct((k // GROUP, 1, n), jnp.bfloat16), None)
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(k, n), dtype=np.int8)
    # |d| = j * 2^-11, j in [8, 16): q * d is exact in bf16.
    d = (rng.integers(8, 16, size=(k // GROUP, 1, n)) * 2.0**-11).astype(
        jnp.bfloat16)
    exact = q.astype(np.float64) * np.repeat(
        np.asarray(d, np.float64)[:, 0], GROUP, axis=0)
    return jnp.asarray(q, jnp.int4), jnp.asarray(d), exact


def linear_candidates():
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.gmm_v2.gmm_v2 import (calculate_tiling,
                                                             gmm_v2)
    rule = tile_rule()

    def served(dims, lhs_cfgs, rhs_cfgs, vmem_limit_bytes, fuse_act=None):
        return rule.for_the_chip(calculate_tiling(
            dims, lhs_cfgs, rhs_cfgs, vmem_limit_bytes, fuse_act), dims)

    def gmm(tile_info):
        def call(x, q, d):  # as tpu-inference's sharded_quantized_matmul
            return gmm_v2(x, q[None], jnp.array([x.shape[0]], jnp.int32),
                          rhs_scale=d[None], group_offset=jnp.array([0], jnp.int32),
                          tile_info=tile_info, zero_initialize=False,
                          preferred_element_type=x.dtype,
                          maybe_quantize_lhs=False)
        return call

    def grouped(x, q, d):
        m, k = x.shape
        parts = jnp.einsum("mgk,gkn->mgn", x.reshape(m, k // GROUP, GROUP),
                           q.astype(x.dtype).reshape(k // GROUP, GROUP, -1),
                           preferred_element_type=jnp.float32)
        return (parts * d[:, 0].astype(jnp.float32)).sum(1).astype(x.dtype)

    def dequant(x, q, d):
        k = x.shape[1]
        w = (q.astype(jnp.float32).reshape(k // GROUP, GROUP, -1)
             * d.astype(jnp.float32)).astype(x.dtype).reshape(k, -1)
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def dense(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    return {"bf16": dense, "gmm_v2 tokamax": gmm(calculate_tiling),
            "gmm_v2 served": gmm(served), "xla int4 grouped": grouped,
            "xla int4 dequant": dequant}


def _linear_check(exact, tolerance_rel=2**-7):
    import numpy as np

    def check(args, out):
        x = np.asarray(args[0], np.float64)
        want = x @ exact
        bound = np.abs(x) @ np.abs(exact)
        err = np.abs(np.asarray(out, np.float64) - want)
        if (err > tolerance_rel * bound + 1e-6).any():
            i = np.unravel_index(err.argmax(), err.shape)
            return (f"max |error| {err[i]:.3g} at {i} (|x| |W| sum "
                    f"{bound[i]:.3g})")
        return None
    return check


def linear_programs(shapes: dict, abstract: bool, only: set | None,
                    tokens_list=(DECODE_TOKENS, PREFILL_TOKENS),
                    dtype="bfloat16"):
    """Every candidate per linear shape and token count, activations (and
    the dense weights) in `dtype`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    candidates = linear_candidates()
    out = []
    for model, table in shapes.items():
        for seed, (shape, count) in enumerate(sorted(table["linears"].items())):
            k, n = map(int, shape.split("x"))
            q, d, exact = _int4_weights(k, n, seed, abstract)
            w = (jax.ShapeDtypeStruct((k, n), dtype) if abstract
                 else jnp.asarray(exact, dtype))
            for tokens in tokens_list:
                if abstract:
                    x = jax.ShapeDtypeStruct((tokens, k), dtype)
                else:
                    x = jnp.asarray(np.random.default_rng(seed).standard_normal(
                        (tokens, k)) * 0.5, dtype)
                for name, fn in candidates.items():
                    if only and name not in only:
                        continue
                    args = (x, w) if name == "bf16" else (
                        x, q, _as_f32(d) if name in F32_SCALES else d)
                    out.append(Program(
                        "linear", model, shape, tokens, name, count, fn, args,
                        repeat=_feed_back_scalar,
                        check=None if abstract else _linear_check(exact)))
    return out


def _as_f32(scale):
    import jax
    import jax.numpy as jnp
    if isinstance(scale, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(scale.shape, jnp.float32)
    return scale.astype(jnp.float32)


def _feed_back_scalar(args, out):
    """The next repetition's input depends on this one's output (one
    element, times zero), so the repetitions run in order, each whole."""
    x = args[0]
    return (x + (out[0, 0] * 0).astype(x.dtype),) + tuple(args[1:])


def rpa_programs(shapes: dict, abstract: bool, only: set | None,
                 cases=None, attention=None):
    """RPA v3 per attention kind and case (sequences, context, query
    tokens each); `attention`: the kernel, or its reference
    (`ref_ragged_paged_attention`, same arguments)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel
    get_kv_cache_shape = kernel.get_kv_cache_shape
    attention = attention or kernel.ragged_paged_attention
    cases = cases or RPA_CASES
    out = []
    if only and "rpa" not in only:
        return out
    for model, table in shapes.items():
        heads = table["q_heads"]
        for kind, count in sorted(table["attention"].items()):
            layer, dims = kind.split()
            kv_heads, head_dim = map(int, dims.split("x"))
            window = table["sliding_window"] if layer == "sliding" else None
            for seqs, context, q_len in cases:
                tokens = seqs * q_len
                pages_per_seq = -(-context // PAGE)
                cache = get_kv_cache_shape(seqs * pages_per_seq + 1, PAGE,
                                           kv_heads, head_dim, jnp.bfloat16)
                fn = functools.partial(_rpa_call, attention,
                                       window=window,
                                       distribution=(seqs, seqs, seqs)
                                       if q_len == 1 else (0, seqs, seqs))
                if abstract:
                    sds = jax.ShapeDtypeStruct
                    args = (sds((tokens, heads, head_dim), jnp.bfloat16),
                            sds((tokens, kv_heads, head_dim), jnp.bfloat16),
                            sds((tokens, kv_heads, head_dim), jnp.bfloat16),
                            sds(cache, jnp.bfloat16), sds((seqs,), jnp.int32),
                            sds((seqs * pages_per_seq,), jnp.int32),
                            sds((seqs + 1,), jnp.int32))
                    check = None
                else:
                    rng = np.random.default_rng(seqs + context)
                    args = _rpa_inputs(rng, seqs, context, q_len, heads,
                                       kv_heads, head_dim, cache)
                    check = _rpa_check(heads, kv_heads, head_dim, window,
                                       pages_per_seq)
                out.append(Program("rpa", model, f"{kind} {seqs}x{context}",
                                   tokens, "rpa v3", count, fn, args,
                                   repeat=_feed_back_output, check=check,
                                   donate=(3,)))
    return out


def _rpa_call(rpa, q, k, v, cache, kv_lens, pages, cu_q_lens, *, window,
              distribution):
    """(attention output, the KV cache with this step's K/V written)."""
    import jax.numpy as jnp
    return rpa(q, k, v, cache, kv_lens, pages, cu_q_lens,
               jnp.array(distribution, jnp.int32), sm_scale=1.0,
               sliding_window=window)


def _feed_back_output(args, out):
    """Attention's output as the next repetition's queries (same shape),
    and the cache it wrote as the next one's cache (in place, as a server
    carries it from step to step)."""
    attention, cache = out
    return ((attention.astype(args[0].dtype),) + tuple(args[1:3]) + (cache,)
            + tuple(args[4:]))


def _rpa_inputs(rng, seqs, context, q_len, heads, kv_heads, head_dim, cache):
    """Each sequence: `context` tokens, its last `q_len` ones this step's
    (their K/V given with the queries; the rest already in its pages)."""
    import jax.numpy as jnp
    import numpy as np
    tokens = seqs * q_len
    pages_per_seq = -(-context // PAGE)
    # Scores of about unit size, as Gemma 4's q / k norms with a softmax
    # scale of 1 give them: q, k entries of head_dim^-1/4.
    scale = head_dim ** -0.25
    q = rng.standard_normal((tokens, heads, head_dim)) * scale
    k = rng.standard_normal((tokens, kv_heads, head_dim)) * scale
    v = rng.standard_normal((tokens, kv_heads, head_dim))
    kv = np.asarray(rng.standard_normal(cache) * scale)
    page_table = 1 + np.arange(seqs * pages_per_seq, dtype=np.int32)
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
            jnp.asarray(v, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
            jnp.full((seqs,), context, jnp.int32), jnp.asarray(page_table),
            jnp.arange(seqs + 1, dtype=jnp.int32) * q_len)


def _rpa_check(heads, kv_heads, head_dim, window, pages_per_seq):
    """Dense float64 attention over each sequence's pages (the step's own
    K/V written into its last positions, as the kernel writes them)."""
    import numpy as np

    def check(args, outputs):
        out = np.asarray(outputs[0], np.float64)
        q, k, v, cache, kv_lens, pages, cu = (np.asarray(a, np.float64)
                                              if i < 4 else np.asarray(a)
                                              for i, a in enumerate(args))
        group = heads // kv_heads
        worst = 0.0
        for s in range(len(kv_lens)):
            length = int(kv_lens[s])
            rows = cache[pages[s * pages_per_seq:(s + 1) * pages_per_seq]]
            rows = rows.reshape(-1, *rows.shape[2:])[:length]
            # [tokens, kv_heads * 2 (k, v interleaved) / packing, packing, dim]
            rows = rows.reshape(length, -1, rows.shape[-1])[:, :2 * kv_heads]
            keys, values = rows[:, 0::2, :head_dim], rows[:, 1::2, :head_dim]
            first, last = int(cu[s]), int(cu[s + 1])
            keys[length - (last - first):] = k[first:last]
            values[length - (last - first):] = v[first:last]
            for t in range(first, last):
                pos = length - (last - t)
                lo = 0 if window is None else max(0, pos - window + 1)
                for h in range(heads):
                    kh = h // group
                    scores = keys[lo:pos + 1, kh] @ q[t, h]
                    p = np.exp(scores - scores.max())
                    want = (p / p.sum()) @ values[lo:pos + 1, kh]
                    got = out[t, h, :head_dim]
                    worst = max(worst, np.abs(got - want).max())
        return None if worst <= 2e-2 else f"max |error| {worst:.3g}"
    return check


# --- running ----------------------------------------------------------------

def time_program(p: Program, r1: int = 10, r2: int = 60, runs: int = 5):
    import jax
    from jax import lax

    def repeated(count):
        @jax.jit
        def run(*args):
            def body(_, args):
                # Nothing may be hoisted out of the loop as invariant (the
                # weights' conversions: what the candidates differ in).
                args = lax.optimization_barrier(args)
                return p.repeat(args, p.fn(*args))
            return lax.fori_loop(0, count, body, args)
        return run
    short, long = repeated(r1), repeated(r2)
    jax.block_until_ready(short(*p.args))
    jax.block_until_ready(long(*p.args))
    deltas = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(short(*p.args))
        t1 = time.perf_counter()
        jax.block_until_ready(long(*p.args))
        t2 = time.perf_counter()
        deltas.append(((t2 - t1) - (t1 - t0)) / (r2 - r1))
    return statistics.median(deltas)


def compile_program(p: Program, device):
    """Compiled for one chip of the topology (deviceless; traced under a
    mesh of it, so the kernels see that chip's TPU info): generated code
    and XLA's estimate (a Mosaic kernel's is its own declaration)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array([device]), ("chip",))
    whole = NamedSharding(mesh, PartitionSpec())
    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)
                 for a in p.args)
    with jax.set_mesh(mesh):
        compiled = jax.jit(p.fn, donate_argnums=p.donate).lower(
            *args).compile()
    seconds = float((compiled.cost_analysis() or {}).get("optimal_seconds",
                                                         -1))
    memory = compiled.memory_analysis()
    return {"code_mib": memory.generated_code_size_in_bytes / 2**20,
            "temp_mib": memory.temp_size_in_bytes / 2**20,
            "est_us": seconds * 1e6 if seconds >= 0 else None}


def _deviceless(topology: str):
    """The first chip of a libtpu topology description, and RPA v3 told
    the target's TPU version (it reads jax.devices()[0], the host CPU)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    from jax.experimental import topologies
    name, chips = topology.split("-")
    if chips != "1":
        raise SystemExit("--topology: one chip (v5e-1, v6e-1): the "
                         "candidates are per-chip programs")
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{name}:1x1", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1)
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel
    version = int(name[1])
    kernel.get_tpu_version = lambda: version
    del jax
    return desc.devices[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="write a self-contained "
                        "folder for a TPU VM and stop")
    parser.add_argument("--topology", help="no TPU: compile for v5e-1 / v6e-1 "
                        "(libtpu deviceless) instead of timing")
    parser.add_argument("--models", default="e2b,e4b")
    parser.add_argument("--only", help="candidates to run (comma-separated "
                        "names as listed, or rpa)")
    parser.add_argument("--shapes", help="linear shapes to run, KxN[,KxN]")
    parser.add_argument("--tokens", default=f"{DECODE_TOKENS},{PREFILL_TOKENS}",
                        help="the linears' token counts")
    parser.add_argument("--rpa-cases", help="SEQSxCONTEXTxQUERY[,...] "
                        "(default: decode at 16 / 64 x 2K / 8K, one 512 "
                        "prefill)")
    parser.add_argument("--out", type=Path, help="results as JSON")
    args = parser.parse_args(argv)
    if args.bundle:
        bundle(args.bundle)
        return 0
    import jax
    abstract = args.topology is not None
    device = _deviceless(args.topology) if abstract else None
    if not abstract and jax.devices()[0].platform != "tpu":
        raise SystemExit("no TPU here: pass --topology v5e-1 (or v6e-1) to "
                         "compile for one instead")
    models = args.models.split(",")
    shapes = {m: s for m, s in load_shapes().items() if m in models}
    if args.shapes:
        keep = set(args.shapes.split(","))
        for table in shapes.values():
            table["linears"] = {k: c for k, c in table["linears"].items()
                                if k in keep}
    only = set(args.only.split(",")) if args.only else None
    tokens = tuple(int(t) for t in args.tokens.split(","))
    cases = [tuple(map(int, c.split("x"))) for c in args.rpa_cases.split(",")
             ] if args.rpa_cases else None
    programs = (linear_programs(shapes, abstract, only, tokens)
                + rpa_programs(shapes, abstract, only, cases))
    chip = args.topology or jax.devices()[0].device_kind
    print(f"{len(programs)} programs on {chip}"
          f"{' (compiled, not run: estimates)' if abstract else ''}")
    results = []
    for p in programs:
        row = {"kind": p.kind, "model": p.model, "shape": p.shape,
               "tokens": p.tokens, "candidate": p.candidate,
               "per_step": p.count}
        try:
            if abstract:
                row.update(compile_program(p, device))
            else:
                # (not donated: the inputs are reused by the timing)
                row["error"] = p.check(p.args, jax.jit(p.fn)(*p.args))
                row["us"] = time_program(p) * 1e6
        except Exception as e:  # one candidate failing is a result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        results.append(row)
        shown = {k: (round(v, 3) if isinstance(v, float) else v)
                 for k, v in row.items()}
        print(json.dumps(shown), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"chip": chip, "abstract": abstract,
                                        "results": results}, indent=1))
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

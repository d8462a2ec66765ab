"""The TPU kernels themselves: tpu-inference's ragged paged attention v3 and
tokamax's int4 `gmm_v2`, run by JAX's Pallas TPU interpreter as CPU mode
runs them with VLLM_GEMMA_QAT_CPU_KERNELS=interpret, through tpu-inference's
own sharded wrappers, on the shapes and flags the plugin produces for E2B-
and E4B-like models. Each is checked against a float64 dense reference
written here, against CPU mode's stand-in, and against the kernel's own
reference (tokamax's `reference_gmm`).

What this shows: the kernels' semantics on these inputs. Not Mosaic
lowering, VMEM limits, TPU memory layout or speed (the interpreter runs the
kernel's program on numpy buffers).

CI runs a representative subset (each RPA shape costs 4-7 s to compile);
the whole matrix is marked `kernels_full`:
    VLLM_GEMMA_QAT_FULL_KERNEL_TESTS=1 ./run tests tests/test_real_kernels.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_gemma_qat import cpu

FULL_ENV = "VLLM_GEMMA_QAT_FULL_KERNEL_TESTS"
# Unit roundoff (round to nearest: relative error <= 2^-p, p significant
# bits): bf16 p = 8, f32 p = 24.
BF16_U = 2.0**-8
F32_U = 2.0**-24


def full(*values):
    """A parametrization only the full matrix runs."""
    return pytest.param(*values, marks=pytest.mark.kernels_full)


@pytest.fixture(autouse=True)
def only_full_when_asked(request):
    if request.node.get_closest_marker("kernels_full") is None:
        return
    if os.environ.get(FULL_ENV) == "1" or "kernels_full" in (
            request.config.getoption("markexpr") or ""):
        return
    pytest.skip(f"full kernel matrix: {FULL_ENV}=1 or -m kernels_full")


# --- the switch ---------------------------------------------------------------

def test_interpret_table_targets_exist_and_the_switch_checks_its_value(
        monkeypatch):
    from vllm_gemma_qat.substitute import Substitution
    table = cpu.kernel_substitutions("interpret")
    for s in table:  # MissingTarget if an upgrade moved one
        s.resolve()
    targets = [s.target for s in table]
    assert targets[-3:] == [s.target for s in cpu.kernel_substitutions(
        "stand-in")]  # the same kernel entry points, replaced differently
    assert all(isinstance(s, Substitution) and s.why for s in table)
    monkeypatch.setenv(cpu.CPU_KERNELS_ENV, "interpreted")
    with pytest.raises(ValueError, match="VLLM_GEMMA_QAT_CPU_KERNELS="
                       "'interpreted': expected one of stand-in, interpret"):
        cpu.kernel_substitutions()


@pytest.mark.parametrize("src, dst, shape", [
    ("bfloat16", "uint32", (4, 16, 128)), ("uint32", "bfloat16", (2, 8, 128)),
    ("float8_e4m3fn", "uint32", (8, 128)), ("uint32", "float8_e5m2", (3, 128)),
    ("float32", "int32", (5, 128))])
def test_interpreter_ref_bitcast_view_matches_jax(src, dst, shape):
    # The bitcast the view substitution applies to a ref region equals
    # JAX's own ref-bitcast semantics (the second-minor dimension scales),
    # and bitcasting back restores the bits.
    import jax.numpy as jnp
    import ml_dtypes  # noqa: F401
    from jax._src.state.utils import bitcast

    from vllm_gemma_qat.cpu.interpret import _bitcast
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(*shape[:-1], shape[-1] * np.dtype(
        src).itemsize), dtype=np.uint8).view(src)
    got = _bitcast(x, np.dtype(dst))
    want = np.asarray(bitcast(jnp.asarray(x), jnp.dtype(dst)))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(_bitcast(got, x.dtype).view(np.uint8),
                                  x.view(np.uint8))


# --- ragged paged attention -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One RPA call as a Gemma 4 layer makes it. `seqs`: (query tokens,
    context length incl. them) per sequence, decodes first (as
    tpu-inference's runner orders a batch)."""
    kv_heads: int = 1
    head_dim: int = 256
    page_size: int = 16
    dtype: str = "float32"  # q / k / v and the output
    kv_dtype: str | None = None  # the cache (None: dtype)
    sliding_window: int | None = None
    update_kv_cache: bool = True  # False: a KV-shared layer's call
    scales: tuple = ()  # (("k_scale", 1.0), ...): q / k / v scales
    seqs: tuple = ((1, 9), (1, 40), (5, 25), (16, 16))
    heads: int = 8
    pages: int = 24
    max_seqs: int = 6  # the runner's buffers: stale entries past num_seqs
    tokens: int = 32  # padded token count (the step's bucket)
    seed: int = 0

    @property
    def scale(self) -> dict:
        return dict(self.scales)

    @property
    def cache_dtype(self):
        return self.kv_dtype or self.dtype

    def __str__(self):
        flags = [f"kv{self.kv_heads}", f"hd{self.head_dim}",
                 f"p{self.page_size}", self.dtype]
        if self.kv_dtype:
            flags.append(self.kv_dtype)
        if self.sliding_window:
            flags.append(f"sw{self.sliding_window}")
        if not self.update_kv_cache:
            flags.append("shared")
        if self.scales:
            flags.append("s" + "_".join(f"{v:g}" for _, v in self.scales))
        return "-".join(flags)


def _inputs(case: Case):
    """(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution)
    as numpy, in the kernel's layout. The cache holds random past K/V for
    every context position (a KV-shared call: also the current tokens',
    written by the source layer); pages are a random permutation."""
    import ml_dtypes  # noqa: F401 (numpy dtypes bfloat16, float8_*)
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import (
        get_kv_cache_shape, merge_kv)
    rng = np.random.default_rng(case.seed)
    dt, cdt = np.dtype(case.dtype), np.dtype(case.cache_dtype)
    pages_per_seq = case.pages // case.max_seqs
    # q, k scaled so that scores q.k have unit variance at sm_scale 1
    # (Gemma 4's: its q_norm / k_norm do the normalisation).
    r = case.head_dim ** -0.25
    q = (rng.standard_normal((case.tokens, case.heads, case.head_dim)) * r)
    k = rng.standard_normal((case.tokens, case.kv_heads, case.head_dim)) * r
    v = rng.standard_normal((case.tokens, case.kv_heads, case.head_dim))
    shape = get_kv_cache_shape(case.pages, case.page_size, case.kv_heads,
                               case.head_dim, cdt)
    past = rng.standard_normal((case.pages * case.page_size, case.kv_heads,
                                case.head_dim))
    cache = np.asarray(merge_kv((past * r).astype(cdt),
                                past.astype(cdt))).reshape(shape)
    kv_lens = np.full(case.max_seqs, 7, np.int32)  # stale values past n
    cu_q_lens = np.full(case.max_seqs + 1, 3, np.int32)
    cu_q_lens[0] = 0
    for i, (q_len, kv_len) in enumerate(case.seqs):
        assert kv_len <= pages_per_seq * case.page_size
        kv_lens[i], cu_q_lens[i + 1] = kv_len, cu_q_lens[i] + q_len
    page_indices = rng.permutation(case.pages).astype(np.int32)
    decodes = sum(q_len == 1 for q_len, _ in case.seqs)
    distribution = np.array([decodes, decodes, len(case.seqs)], np.int32)
    k, v = k.astype(cdt), v.astype(cdt)
    if not case.update_kv_cache:
        # The source layer already wrote this step's K/V; the call gets junk
        # k / v it must not read or write.
        cache = _written(case, cache.astype(cdt), k, v, page_indices,
                         kv_lens, cu_q_lens)
        k = np.full_like(k, 100)
        v = np.full_like(v, -100)
    return (q.astype(dt), k, v, cache.astype(cdt), kv_lens, page_indices,
            cu_q_lens, distribution)


def _slots(case, page_indices, seq, positions):
    pages_per_seq = case.pages // case.max_seqs
    page = page_indices[seq * pages_per_seq + positions // case.page_size]
    return page, positions % case.page_size


def _written(case, cache, k, v, page_indices, kv_lens, cu_q_lens):
    """`cache` with each sequence's new K/V at its last q_len positions."""
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
        merge_kv
    cache = cache.copy()
    new = np.asarray(merge_kv(k, v))
    for i, (q_len, kv_len) in enumerate(case.seqs):
        positions = np.arange(kv_len - q_len, kv_len)
        page, slot = _slots(case, page_indices, i, positions)
        cache[page, slot] = new[cu_q_lens[i]:cu_q_lens[i] + q_len]
    return cache


def dense_attention(case: Case, inputs):
    """float64 reference: (output [tokens of the live sequences], cache
    after the call). Each query attends causally (and within the sliding
    window, which counts the query itself) to its sequence's context,
    read through the page table from the cache after this call's writes."""
    q, k, v, cache, kv_lens, page_indices, cu_q_lens, _ = inputs
    if case.update_kv_cache:
        cache = _written(case, cache, k, v, page_indices, kv_lens, cu_q_lens)
    rows = cache.reshape(*cache.shape[:2], -1, cache.shape[-1])
    group = case.heads // case.kv_heads
    s = case.scale
    qf = q.astype(np.float64)
    if s.get("q_scale") is not None:
        # As the kernel: q divided by its scale, clipped to and rounded in
        # the cache dtype; the scale goes back on the scores.
        info = np.finfo(cache.dtype)
        qf = np.clip(qf / s["q_scale"], float(info.min), float(info.max))
        qf = qf.astype(cache.dtype).astype(np.float64)
    score_scale = s.get("k_scale", 1.0) * s.get("q_scale", 1.0)
    out = []
    for i, (q_len, kv_len) in enumerate(case.seqs):
        page, slot = _slots(case, page_indices, i, np.arange(kv_len))
        kv = rows[page, slot].astype(np.float64)  # [kv_len, 2H', hd]
        keys = kv[:, 0:2 * case.kv_heads:2, :case.head_dim]
        values = kv[:, 1:2 * case.kv_heads:2, :case.head_dim]
        qi = qf[cu_q_lens[i]:cu_q_lens[i] + q_len].reshape(
            q_len, case.kv_heads, group, case.head_dim)
        scores = np.einsum("tkgh,ckh->tkgc", qi, keys) * score_scale
        pos = kv_len - q_len + np.arange(q_len)
        ctx = np.arange(kv_len)
        mask = ctx[None, :] <= pos[:, None]
        if case.sliding_window:
            mask &= pos[:, None] - ctx[None, :] < case.sliding_window
        scores = np.where(mask[:, None, None, :], scores, -np.inf)
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("tkgc,ckh->tkgh", probs, values) * s.get("v_scale", 1.0)
        out.append(o.reshape(q_len, case.heads, case.head_dim))
    return np.concatenate(out), cache


def sharded_rpa(case: Case, inputs, kernels: str, mesh=None):
    """The call Gemma 4's attention makes: tpu-inference's
    `sharded_ragged_paged_attention` (its shard_map around the kernel), with
    CPU mode's kernels `kernels` ("interpret": the real one)."""
    import jax
    import jax.numpy as jnp
    from tpu_inference.layers.common.attention_interface import \
        sharded_ragged_paged_attention

    from vllm_gemma_qat.testing import runner
    mesh = mesh or runner.mesh()
    q, k, v, cache, *metadata = (jnp.asarray(a) for a in inputs)
    # Traced as the model's step traces it (the interpreted kernel runs at
    # run time, behind its callback).
    call = jax.jit(lambda *a: sharded_ragged_paged_attention(
        mesh, *a, attention_sink=None, sm_scale=1.0,
        attention_chunk_size=case.sliding_window,
        update_kv_cache=case.update_kv_cache, **case.scale))
    with cpu.kernels(kernels), jax.set_mesh(mesh):
        out, new_cache = call(q, k, v, cache, *metadata)
        return np.asarray(out), np.asarray(new_cache)


def tolerance(case: Case, values) -> float:
    """Max abs error of the kernel against the float64 reference.

    f32: every output is a convex combination of V (|out| <= max|v|); f32
    scores, exponentials, sums and the PV product each round by 2^-24
    relative and the flash-attention rescaling compounds them per KV block:
    well under 64 roundings of max|v|.
    bf16 (the kernel's out_dtype, q's): it keeps the softmax sum l and the
    output accumulator in bf16, each rounded (2^-8 relative of a value
    <= max|v| once normalised) after every KV compute block, then divides
    and rounds the output once more. Here a sequence spans at most 2 blocks
    (bkv_csz is half its page capacity), so 2 x 2 + 2 = 6 roundings of
    max|v|. fp8 K/V enter as exact values (the reference reads the same fp8
    cache) and add nothing; v_scale scales the output."""
    u, rounds = (BF16_U, 6) if case.dtype == "bfloat16" else (F32_U, 64)
    return rounds * u * float(np.abs(values).max()) * max(
        1.0, case.scale.get("v_scale", 1.0))


def stand_in_tolerance(case: Case, values) -> float:
    """The stand-in computes in f32 throughout and rounds the output once:
    one rounding of max|v| (plus f32 noise, as above)."""
    if case.dtype != "bfloat16":
        return tolerance(case, values)
    return 2 * BF16_U * float(np.abs(values).max()) * max(
        1.0, case.scale.get("v_scale", 1.0))


def _live(case, out):
    return out[:sum(q for q, _ in case.seqs)].astype(np.float64)


E2B_SLIDING = Case(kv_heads=1, head_dim=256, sliding_window=8)
E2B_FULL_SHARED = Case(kv_heads=1, head_dim=512, page_size=32,
                       dtype="bfloat16", update_kv_cache=False,
                       seqs=((1, 33), (1, 64), (7, 50), (12, 12)), pages=12)
# Gemma 4 passes k_scale = v_scale = 1.0 (q_scale None) with an fp8 cache;
# CI checks the scales' semantics with other values (the full matrix has
# both).
E4B_FP8 = Case(kv_heads=2, head_dim=256, dtype="bfloat16",
               kv_dtype="float8_e4m3fn", sliding_window=8,
               scales=(("q_scale", 0.5), ("k_scale", 0.75), ("v_scale", 1.25)))
# Contexts past the stand-in's 128-position chunks (its online softmax
# across them): a step of decodes only (its own path: fewer tokens than
# request slots, a sliding window that skips the first chunk for the long
# sequences) and a mixed step over full attention.
DECODES_LONG = Case(kv_heads=2, head_dim=256, dtype="bfloat16",
                    kv_dtype="float8_e5m2", sliding_window=8,
                    seqs=((1, 150), (1, 9), (1, 129), (1, 77)), tokens=8,
                    max_seqs=12, pages=120)
MIXED_LONG = Case(kv_heads=2, head_dim=128, seqs=((1, 140), (5, 133),
                                                  (16, 150)),
                  max_seqs=6, pages=60)
CI_CASES = [E2B_SLIDING, E2B_FULL_SHARED, E4B_FP8, DECODES_LONG, MIXED_LONG]
CI_IDS = ["e2b-sliding", "e2b-full-kv-shared", "e4b-fp8", "decodes-long",
          "mixed-long"]
# Every KV-head count, head_dim and page size in both dtypes; as in the
# models, 128 / 256 with the sliding window and 512 (full layers) without;
# page 32 as a KV-shared call. Then fp8 caches, model scales (1.0) and others.
FULL_CASES = [
    Case(kv_heads=kv, head_dim=hd, page_size=page, dtype=dtype,
         sliding_window=8 if hd != 512 else None, update_kv_cache=page == 16)
    for kv in (1, 2) for hd in (128, 256, 512) for page in (16, 32)
    for dtype in ("float32", "bfloat16")
] + [
    Case(kv_heads=kv, dtype=dtype, kv_dtype=kv_dtype, sliding_window=8,
         scales=scales, update_kv_cache=kv == 1)
    for kv in (1, 2) for dtype in ("float32", "bfloat16")
    for kv_dtype in ("float8_e4m3fn", "float8_e5m2")
    for scales in ((("k_scale", 1.0), ("v_scale", 1.0)),
                   (("q_scale", 0.5), ("k_scale", 0.75), ("v_scale", 1.25)))
    if (kv == 1) == (scales[0][0] == "k_scale")
]
FULL_CASES = [c for c in FULL_CASES if c not in CI_CASES]

_results = {}  # case -> (inputs, kernel out, kernel cache): reused below


@pytest.mark.parametrize("case", [
    pytest.param(c, id=f"{i}-{c}") for i, c in zip(CI_IDS, CI_CASES)
] + [full(c) for c in FULL_CASES], ids=str)
def test_rpa_kernel_matches_dense_reference_and_stand_in(case):
    inputs = _inputs(case)
    out, new_cache = sharded_rpa(case, inputs, "interpret")
    _results[case] = inputs, out, new_cache
    ref, ref_cache = dense_attention(case, inputs)
    # The cache: bit for bit what the reference writes (a KV-shared call:
    # untouched, the junk k / v never written).
    np.testing.assert_array_equal(new_cache.view(np.uint8),
                                  ref_cache.view(np.uint8))
    if not case.update_kv_cache:
        np.testing.assert_array_equal(new_cache.view(np.uint8),
                                      inputs[3].view(np.uint8))
    values = ref_cache.astype(np.float64)
    err = np.abs(_live(case, out) - ref).max()
    print(f"{case}: kernel {err:.2e}, tolerance {tolerance(case, values):.2e}")
    assert err <= tolerance(case, values), (err, tolerance(case, values))

    # CPU mode's stand-in on the same call: the same cache, and within the
    # kernel's tolerance of it (the stand-in computes in f32 throughout).
    stand_in, stand_in_cache = sharded_rpa(case, inputs, "stand-in")
    np.testing.assert_array_equal(stand_in_cache.view(np.uint8),
                                  new_cache.view(np.uint8))
    err_stand_in = np.abs(_live(case, stand_in) - ref).max()
    print(f"{case}: stand-in {err_stand_in:.2e}, tolerance "
          f"{stand_in_tolerance(case, values):.2e}")
    assert err_stand_in <= stand_in_tolerance(case, values), err_stand_in
    assert np.abs(_live(case, out) - _live(case, stand_in)).max() <= \
        tolerance(case, values) + stand_in_tolerance(case, values)


def test_rpa_comparison_rejects_a_wrong_reference():
    """The comparison above can fail: the kernel's output of the E2B
    sliding case against references one flag off."""
    case = E2B_SLIDING
    if case not in _results:
        inputs = _inputs(case)
        _results[case] = (inputs, *sharded_rpa(case, inputs, "interpret"))
    inputs, out, _ = _results[case]
    values = inputs[3].astype(np.float64)
    for wrong in (dataclasses.replace(case, sliding_window=9),
                  dataclasses.replace(case, sliding_window=None),
                  dataclasses.replace(case, update_kv_cache=False)):
        ref, _ = dense_attention(wrong, inputs)
        assert np.abs(_live(case, out) - ref).max() > 10 * tolerance(
            case, values), wrong


def test_rpa_scales_told_apart_from_a_tenth_off():
    """The bf16 tolerance above is a worst-case bound (6 roundings of
    max|v|) that a 10% error in q_scale stays under (max error 0.117 vs
    0.132 on the fp8 case). Here the kernel's output on the scaled fp8 case
    is held to the right scales: its rms distance to the reference is under
    a third of its distance to the reference with any one of q / k / v
    scale 10% off (measured: 0.0023 vs >= 0.0106). Also the wrong-window
    references, as above, for this bf16 case."""
    case = CI_CASES[2]
    assert case.dtype == "bfloat16" and case.scales and case.sliding_window
    if case not in _results:
        inputs = _inputs(case)
        _results[case] = (inputs, *sharded_rpa(case, inputs, "interpret"))
    inputs, out, _ = _results[case]
    live = _live(case, out)

    def rms(ref):
        return float(np.sqrt(np.mean((live - ref) ** 2)))

    right = rms(dense_attention(case, inputs)[0])
    for name, _ in case.scales:
        for factor in (0.9, 1.1):
            wrong = dataclasses.replace(case, scales=tuple(
                (n, v * factor if n == name else v) for n, v in case.scales))
            assert 3 * right < rms(dense_attention(wrong, inputs)[0]), (
                name, factor)
    values = inputs[3].astype(np.float64)
    for wrong in (dataclasses.replace(case, sliding_window=9),
                  dataclasses.replace(case, sliding_window=None)):
        ref, _ = dense_attention(wrong, inputs)
        assert np.abs(live - ref).max() > 10 * tolerance(case, values), wrong


# The kernel on a mesh: KV heads fewer than TP, which tpu-inference's
# shard_map meets by repeating K/V heads (E2B's one KV head at TP=2). A
# process of its own, with two CPU devices.
TP_SCRIPT = r"""
import json, sys
import jax, numpy as np
from jax.sharding import Mesh
from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES
sys.path.insert(0, sys.argv[1])
import test_real_kernels as t
fields = json.loads(sys.argv[2])
fields["seqs"] = tuple(map(tuple, fields["seqs"]))
fields["scales"] = tuple(map(tuple, fields["scales"]))
case = t.Case(**fields)
inputs = t._inputs(case)
shape = [1] * len(MESH_AXIS_NAMES)
shape[MESH_AXIS_NAMES.index("model")] = 2
mesh = Mesh(np.array(jax.devices()[:2]).reshape(shape), MESH_AXIS_NAMES)
# The runner's cache holds the repeated heads: each device one copy.
q, k, v, cache, *metadata = inputs
cache2 = np.concatenate([cache, cache], axis=2)
out, new_cache = t.sharded_rpa(case, (q, k, v, cache2, *metadata),
                               "interpret", mesh)
ref, ref_cache = t.dense_attention(case, inputs)
half = cache.shape[2]
print(json.dumps({
    "err": float(np.abs(t._live(case, out) - ref).max()),
    "tol": t.tolerance(case, ref_cache.astype(np.float64)),
    "caches_equal": [bool(np.array_equal(new_cache[:, :, i * half:(i + 1) * half],
                                         ref_cache)) for i in range(2)]}))
"""


@pytest.mark.parametrize("case", [
    Case(kv_heads=1, head_dim=256, sliding_window=8),
    full(Case(kv_heads=1, head_dim=512, page_size=32, dtype="bfloat16",
              update_kv_cache=False,
              seqs=((1, 33), (1, 64), (7, 50), (12, 12)), pages=12)),
], ids=str)
def test_rpa_kernel_heads_fewer_than_tp(case):
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=2").strip())
    result = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, os.path.dirname(__file__),
         json.dumps(fields)], env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["caches_equal"] == [True, True], found
    assert found["err"] <= found["tol"], found


# --- gmm_v2 -------------------------------------------------------------------

# (M tokens, K in, N out): the tiny test models' int4 linears (hidden 64,
# MLP 128 / 256 double-wide, 8 x 128 query heads, 1 x 128 KV, 32-wide
# per-layer inputs) and a few of the real E2B's (hidden 1536, MLP 6144,
# 8 x 256 query heads), at a step's 32 tokens or a few decode tokens.
TINY_LINEARS = {"q_proj": (32, 64, 1024), "k_proj": (32, 64, 128),
                "o_proj": (32, 1024, 64), "gate_up": (32, 64, 512),
                "down_proj": (32, 256, 64), "per_layer_gate": (32, 64, 32),
                "per_layer_projection": (32, 32, 64),
                "per_layer_model_projection": (32, 64, 320)}
E2B_LINEARS = {"e2b_q_proj": (32, 1536, 2048), "e2b_down_proj": (8, 6144, 1536),
               "e2b_o_proj_full": (8, 4096, 1536), "e2b_gate_up": (8, 1536, 12288)}
LINEARS = {**TINY_LINEARS, **E2B_LINEARS}
GMM_CI = [("q_proj", "float32"), ("per_layer_projection", "bfloat16"),
          ("e2b_down_proj", "bfloat16")]
GMM_FULL = [(name, dtype) for name in LINEARS
            for dtype in ("float32", "bfloat16")
            if (name, dtype) not in GMM_CI]


def q4_0_linear(n_out, n_in, seed=0):
    """A bf16 linear on the q4_0 grid (q in [-8, 7], one bf16 d per 32
    inputs, a quarter of the groups peaking below level 8, d < 0 in an
    eighth, as `tiny.put_on_int4_grid` makes them), float64 [out, in]."""
    from vllm_gemma_qat import int4
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(n_out, n_in)).astype(np.int8)
    groups = q.reshape(n_out, -1, 32)
    low = rng.random(groups.shape[:2]) < 0.25
    groups[low] = np.clip(groups[low], -5, 5)
    # |d| = k * 2^-11: q * d is exact in bf16 (at most 7 significant bits).
    d = (rng.integers(8, 16, size=groups.shape[:2]) * 2.0**-11 * np.where(
        rng.random(groups.shape[:2]) < 0.125, -1, 1)).astype(int4.BF16)
    return int4.dequantize(q, d)


def plugin_int4(weight_bf16):
    """What the plugin feeds tpu-inference for a q4_0 linear and what
    tpu-inference's wNa16 method then holds: the grid recovered, packed as
    compressed-tensors, unpacked by tpu-inference into the gmm_v2 layout
    (int4 [in, out], scale [in // 32, 1, out])."""
    import jax.numpy as jnp
    from tpu_inference.layers.common.quantization import \
        unpack_wna16_linear_weight

    from vllm_gemma_qat import int4
    q, d = int4.recover_grid(weight_bf16)
    w, s = unpack_wna16_linear_weight(jnp.asarray(int4.pack_int4(q)),
                                      jnp.asarray(d), weight_bf16.shape[1])
    return w, s[:, None, :]


def quantized_matmul(x, w, s, kernels):
    """tpu-inference's `sharded_quantized_matmul` as its wNa16 linear calls
    it (3-D scale: the gmm_v2 kernel), with CPU mode's kernels `kernels`."""
    import jax
    from jax.sharding import PartitionSpec as P
    from tpu_inference.layers.common.linear import sharded_quantized_matmul

    from vllm_gemma_qat.testing import runner
    mesh = runner.mesh()
    call = jax.jit(lambda x, w, s: sharded_quantized_matmul(
        x, w, s, P(None, None), mesh=mesh, maybe_quantize_x=False))
    with cpu.kernels(kernels), jax.set_mesh(mesh):
        return np.asarray(call(x, w, s), np.float64)


def gmm_tolerance(dtype, x, weight):
    """Max abs error against the float64 product of the exact weights.
    The kernel dequantizes exactly (int4 levels and bf16 scales are exact in
    f32 / bf16 arithmetic) and sums in f32: K products per output, rounding
    by at most K * 2^-24 of sum|x w|. bf16 output: that, plus the output's
    own rounding, 2^-8 relative of |out| <= sum|x w|."""
    bound = np.abs(x) @ np.abs(weight).T  # sum |x w| per output
    u = F32_U * x.shape[1]
    if dtype == "bfloat16":
        u += BF16_U
    return u * bound


@pytest.mark.parametrize("name, dtype", GMM_CI + [full(*c) for c in GMM_FULL])
def test_gmm_v2_int4_matches_exact_product_reference_gmm_and_stand_in(
        name, dtype):
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.gmm_v2.gmm_v2_test import \
        reference_gmm
    m, n_in, n_out = LINEARS[name]
    weight = q4_0_linear(n_out, n_in)
    w, s = plugin_int4(weight)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((m, n_in)), dtype)
    xf = np.asarray(x, np.float64)
    exact = xf @ weight.astype(np.float64).T
    tol = gmm_tolerance(dtype, xf, weight.astype(np.float64))

    out = quantized_matmul(x, w, s, "interpret")
    assert (np.abs(out - exact) <= tol).all(), np.abs(out - exact).max()
    if dtype == "bfloat16":
        # In fact correctly rounded: only an f32 sum landing within its own
        # rounding of a bf16 tie could round the other way.
        import ml_dtypes
        rounded = exact.astype(ml_dtypes.bfloat16).astype(np.float64)
        assert (out == rounded).mean() >= 0.999
    # tokamax's own reference on the same int4 operands: f32 sums in
    # another order, the same output rounding.
    ref = np.asarray(reference_gmm(x, w[None], jnp.array([m], jnp.int32),
                                   s[None].astype(x.dtype)), np.float64)
    assert (np.abs(out - ref) <= 2 * tol).all(), np.abs(out - ref).max()
    print(f"{name} {dtype}: kernel {np.abs(out - exact).max():.2e}, "
          f"vs reference_gmm {np.abs(out - ref).max():.2e}, tolerance "
          f"<= {tol.max():.2e}")
    stand_in = quantized_matmul(x, w, s, "stand-in")
    assert (np.abs(stand_in - exact) <= tol).all()

    if name == GMM_CI[0][0]:
        # The comparison can fail: the exact product with one scale group
        # of one output column negated is far outside it.
        wrong = weight.astype(np.float64).copy()
        wrong[0, :32] *= -1
        assert (np.abs(out - xf @ wrong.T) > 10 * tol).any()

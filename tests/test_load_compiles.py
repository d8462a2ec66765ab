"""Weight loading under gemma_qat compiles each XLA program once.

tpu-inference 0.32's weight loader clears JAX's in-memory caches after every
module, so each module's processing programs (device puts, transposes, the
wNa16 unpack) compile again for every module. Under gemma_qat those clears
are one at the end of the load (`fixes/compile_once.py`); `auto` keeps
tpu-inference's. Counts come from JAX's compile log and are deterministic
(a persistent-cache hit is logged as a compile too); each compile is also
recorded with the number of clears before it, so every repeat can be told
to follow a clear or not. Text-only tiny models keep this cheap."""
import collections
import json
import re
import struct
import time

import jax
import pytest
from jax._src import util
from jax._src.interpreters import pxla

from vllm_gemma_qat import substitute
from vllm_gemma_qat.fixes.compile_once import CompileLog
from vllm_gemma_qat.testing import runner, tiny

# u32_unpack_i4 (tpu-inference's wNa16 unpack): one program of each per
# packed weight shape.
UNPACK = ("jit(bitwise_right_shift)", "jit(bitwise_and)")


class _Clears:
    """Counts jax.clear_caches() calls: it clears every cache registered
    with JAX's cache registry, this one too."""

    def __init__(self):
        self.n = 0
        util.register_cache(self, "test_load_compiles: clears")

    def cache_clear(self):
        self.n += 1

    def cache_info(self):
        return None

    def cache_keys(self):
        return ()


class _Load(list):
    """A CompileLog's programs; `at` holds each with the clears before it."""

    def __init__(self, clears):
        super().__init__()
        self.clears, self.at = clears, []

    def append(self, program):
        self.at.append((self.clears.n, program))
        super().append(program)

    def between_clears(self) -> list[collections.Counter]:
        """The programs compiled between one clear and the next, counted."""
        out = collections.defaultdict(collections.Counter)
        for clears, program in self.at:
            out[clears][program] += 1
        return list(out.values())

    def compiled_again_after_a_clear(self) -> bool:
        return len(set(self.at)) > len(set(self))


def _load(path, load_format):
    # From empty in-memory caches: a program an earlier test in this
    # worker compiled (which one ran before depends on pytest-xdist's
    # schedule) would otherwise be a cache hit, missing from the count.
    jax.clear_caches()
    clears = _Clears()
    start = time.perf_counter()
    with CompileLog(programs=_Load(clears)) as log:
        runner.load(path, load_format)
    print(f"{load_format} {path.name}: {time.perf_counter() - start:.1f} s, "
          f"{log.total} compiles, {log.distinct} distinct, {clears.n} clears")
    return log, clears.n


def _first_argument_shape(program) -> tuple[int, ...]:
    """From the compile log's "(ShapedArray(int32[64,8,1]), ...)"."""
    dims = re.match(r"\(ShapedArray\(\w+\[([\d,]*)\]", program[1])[1]
    return tuple(int(d) for d in dims.split(",") if d)


def _unpacked_shapes(path) -> set[tuple[int, ...]]:
    """The shapes tpu-inference unpacks: the checkpoint's int4
    `weight_packed` tensors (safetensors headers), each MLP's gate_proj and
    up_proj as one (it loads them into one fused weight)."""
    packed = {}
    for shard in path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        packed |= {name: tuple(t["shape"]) for name, t in header.items()
                   if name.endswith(".weight_packed")}
    shapes = set()
    for name, shape in packed.items():
        if ".mlp.up_proj." in name:
            continue
        if ".mlp.gate_proj." in name:
            up = packed[name.replace(".gate_proj.", ".up_proj.")]
            shape = (shape[0] + up[0], shape[1])
        shapes.add(shape)
    return shapes


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    hf = tiny.build_model("e2b", multimodal=False, seed=3)
    grid = tiny.put_on_int4_grid(hf)
    return tiny.save_int4_checkpoint(
        hf, tmp_path_factory.mktemp("compiles") / "w4a16", grid, "w4a16")


def test_the_substitution_is_installed_with_tpu_inference(plugin):
    import tpu_inference.models.jax.utils.weight_utils  # noqa: F401
    assert substitute.installed("jax:clear_caches")


def _stock_recompiles_after_each_clear(path, log, clears, monkeypatch):
    """The substitution removed: tpu-inference's clear after every module.
    Between two clears it compiles nothing the gemma_qat load (`log`) did
    not compile (as often); every compile beyond those is one a clear
    caused."""
    monkeypatch.setattr(jax, "clear_caches", jax.clear_caches.__wrapped__)
    stock, stock_clears = _load(path, "gemma_qat")
    once = collections.Counter(log.programs)
    assert stock_clears > clears
    assert set(stock.programs) == set(log.programs), \
        set(stock.programs) ^ set(log.programs)
    assert all(between <= once
               for between in stock.programs.between_clears())
    assert stock.programs.compiled_again_after_a_clear()


def test_int4_load_compiles_each_program_once(plugin, int4_checkpoint,
                                              monkeypatch):
    log, clears = _load(int4_checkpoint, "gemma_qat")
    # The wNa16 unpack ran, once for every shape it unpacks.
    for op in UNPACK:
        assert {_first_argument_shape(p)[:2] for p in log.programs
                if p[0] == op} == _unpacked_shapes(int4_checkpoint), op
    assert log.total == log.distinct
    # tpu-inference's clears became one, at the end of the load: it leaves
    # cached at most what compiled after it (the cache is weakly keyed: an
    # entry goes with its computation).
    assert clears == 1
    after = [program for n, program in log.programs.at if n == clears]
    assert pxla._cached_compilation.cache_info().currsize <= len(after)
    _stock_recompiles_after_each_clear(int4_checkpoint, log, clears,
                                       monkeypatch)


def test_bf16_load_compiles_each_program_once_stock_per_module(
        plugin, tiny_models, monkeypatch):
    path = tiny_models.checkpoint("e2b", multimodal=False, layout="qat")
    log, clears = _load(path, "gemma_qat")
    # (Programs that differ in nothing the log shows, e.g. two slices of
    # one shape, count as one distinct program compiled twice.)
    assert clears == 1 and not log.programs.compiled_again_after_a_clear()
    _stock_recompiles_after_each_clear(path, log, clears, monkeypatch)


def test_auto_keeps_tpu_inference_clears(plugin, tiny_models):
    log, clears = _load(tiny_models.checkpoint("e2b", multimodal=False,
                                               layout="regular"), "auto")
    assert clears > 1 and log.programs.compiled_again_after_a_clear()


def test_nested_compile_logs_close_in_any_content_state():
    # A test's log around the loader's: when every compile so far happened
    # inside the inner one, both hold the same programs; closing the inner
    # one must still leave the outer one recording.
    import jax
    import jax.numpy as jnp
    x, y = jnp.ones(7), jnp.ones(9)
    with CompileLog() as outer:
        with CompileLog() as inner:
            jax.jit(lambda v: v * 3)(x)
        jax.jit(lambda v: v - 5)(y)
    assert inner.total == 1 and outer.total == 2

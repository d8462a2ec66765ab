"""The machine's cache of trained tiny models (testing/model_cache.py): an
entry is made once, served while every file it wrote hashes as written,
and rebuilt when it is stale (its trainer changed), incomplete or corrupt.
The entries here are real tiny checkpoints (transformers' save_pretrained of
a tiny Gemma 4), in a cache directory of the test's own."""
import threading

import pytest

from vllm_gemma_qat.testing import model_cache, tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.ROOT_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


class Builder:
    """Writes a tiny Gemma 4 checkpoint; counts its builds."""

    def __init__(self, seed=0):
        self.seed, self.builds = seed, 0

    def __call__(self, directory):
        self.builds += 1
        tiny.build_model("e2b", multimodal=False, seed=self.seed
                         ).save_pretrained(directory)


def weights(path):
    return (path / "model.safetensors").read_bytes()


def test_built_once_then_served(cache):
    build = Builder()
    first = model_cache.entry("tiny", {"seed": 0}, build)
    again = model_cache.entry("tiny", {"seed": 0}, build)
    assert first == again and first.parent == cache and build.builds == 1
    assert (first / model_cache.MANIFEST).exists()


def test_a_corrupt_entry_is_rebuilt_never_served(cache):
    build = Builder()
    path = model_cache.entry("tiny", {"seed": 0}, build)
    good = weights(path)
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0xFF  # one flipped byte inside a tensor
    (path / "model.safetensors").write_bytes(bytes(corrupt))
    assert not model_cache.is_valid(path, {"seed": 0})
    assert model_cache.entry("tiny", {"seed": 0}, build) == path
    assert build.builds == 2 and weights(path) == good


@pytest.mark.parametrize("damage", ["manifest", "file"])
def test_an_incomplete_entry_is_rebuilt(cache, damage):
    # A run killed while writing: no manifest yet, or a file missing.
    build = Builder()
    path = model_cache.entry("tiny", {"seed": 0}, build)
    good = weights(path)
    (path / (model_cache.MANIFEST if damage == "manifest"
             else "config.json")).unlink()
    assert model_cache.entry("tiny", {"seed": 0}, build) == path
    assert build.builds == 2 and weights(path) == good
    assert model_cache.is_valid(path, {"seed": 0})


def test_a_changed_trainer_trains_anew(cache, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text("STEPS = 300\n")
    build = Builder()
    key = {"trainer": model_cache.source_digest(trainer)}
    old = model_cache.entry("tiny", key, build)
    trainer.write_text("STEPS = 301\n")
    key = {"trainer": model_cache.source_digest(trainer)}
    new = model_cache.entry("tiny", key, Builder(seed=1))
    assert new != old and weights(new) != weights(old)
    # An entry whose manifest records another key is not served under it.
    assert not model_cache.is_valid(old, key)


def test_a_failed_build_leaves_no_entry(cache):
    def failing(directory):
        (directory / "half.safetensors").write_bytes(b"half")
        raise RuntimeError("training diverged")

    with pytest.raises(RuntimeError, match="diverged"):
        model_cache.entry("tiny", {"seed": 0}, failing)
    assert [p.name for p in cache.iterdir()
            if not p.name.endswith(".lock")] == []
    build = Builder()
    path = model_cache.entry("tiny", {"seed": 0}, build)
    assert build.builds == 1 and model_cache.is_valid(path, {"seed": 0})


def test_concurrent_users_build_it_once(cache):
    build = Builder()
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(
        model_cache.entry("tiny", {"seed": 0}, build))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 3 and len(set(paths)) == 1 and build.builds == 1


def test_a_reference_is_keyed_by_the_model_not_where_it_was_read(
        cache, tmp_path):
    """The same weights and config read from two directories (a model cache
    moved, or another clone's) are one reference entry; another config is
    another entry."""
    from transformers import AutoModelForCausalLM
    for name in ("here", "there"):
        tiny.build_model("e2b", multimodal=False).save_pretrained(
            tmp_path / name)
    computed = []

    def compute(directory):
        computed.append(directory)
        (directory / "result.txt").write_text("1")

    here, there = (AutoModelForCausalLM.from_pretrained(tmp_path / name)
                   for name in ("here", "there"))
    assert here.config._name_or_path != there.config._name_or_path
    first = model_cache.reference("ref", here, {"n": 1}, __file__, compute)
    again = model_cache.reference("ref", there, {"n": 1}, __file__, compute)
    assert first == again and len(computed) == 1
    there.config.final_logit_softcapping = 10.0
    other = model_cache.reference("ref", there, {"n": 1}, __file__, compute)
    assert other != first and len(computed) == 2


_COMPILE_ONCE = """
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.float32(0.5))))
"""


def _compile_in_fresh_process(cache_dir):
    import os
    import subprocess
    import sys
    from vllm_gemma_qat.cpu.env import compile_cache_env
    env = dict(os.environ, **compile_cache_env(str(cache_dir)),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_machines_compile_cache_keeps_its_stack_and_survives_a_torn_entry(
        tmp_path):
    """The compilation cache test runs share (cpu/env.py): other jax
    versions' directories go, an oversized one is emptied, and an entry cut
    short (a run killed mid-write) is compiled again, never served."""
    from vllm_gemma_qat.cpu import env
    (tmp_path / "xla-0.0.1-0.0.1").mkdir()
    (tmp_path / "xla-0.0.1-0.0.1" / "entry-cache").write_bytes(b"old")
    current = env.machine_compile_cache(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [current.name]
    expected = _compile_in_fresh_process(current)
    [entry] = [p for p in current.iterdir() if "jit__lambda" in p.name]
    entry.write_bytes(entry.read_bytes()[:len(entry.read_bytes()) // 2])
    assert _compile_in_fresh_process(current) == expected
    big = current / "filler-cache"
    with open(big, "wb") as f:
        f.truncate(env.MACHINE_CACHE_LIMIT_BYTES + 1)  # sparse
    assert list(env.machine_compile_cache(tmp_path).iterdir()) == []

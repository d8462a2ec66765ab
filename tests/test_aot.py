"""`vllm-gemma-qat compile`: tiny E2B-like (1 KV head, multimodal) and
E4B-like (2 KV heads, text-only, saved bare by transformers: a `gemma4_text`
config) Gemma 4 checkpoints, started by tpu-inference's engine as `vllm
serve --load-format gemma_qat` would start them and compiled by libtpu for
TPU topologies, on this CPU-only machine.

Here: TP=4 on v6e-4, the E2B-like multimodal w4a16 and the E4B-like bf16
(one token bucket each: the runner's buckets for --max-num-batched-tokens
16); the same models at TP=1 are compiled against a CPU-mode server's own
precompile in test_compile_matches_runner.py. Also a tiny Gemma 4
assistant's programs (--assistant, k=2) on v6e-1, the refusals (no room
for the KV cache, out of HBM), and TP=8 over two hosts of a v6e-16."""
import json
import re

import pytest

from vllm_gemma_qat import cli
from vllm_gemma_qat.testing import tiny

pytestmark = pytest.mark.xdist_group("aot")

# TP=4 here; the same models at TP=1 are compiled by
# test_compile_matches_runner.py, against a server's own precompile.
CASES = [("e2b", "v6e-4", 4, "w4a16"), ("e4b", "v6e-4", 4, "bf16")]
# the checkpoints the module's tests compile
FORMS = [("e2b", "w4a16"), ("e2b", "bf16"), ("e4b", "bf16")]
FLAGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("aot")
    out = {}
    for geometry, form in FORMS:
        path = root / f"{geometry}-{form}"
        text_only = dict(multimodal=False, bare=True) if geometry == "e4b" \
            else {}
        if form == "bf16":
            tiny.save_servable(path, geometry, **text_only)
        else:
            tiny.save_servable_int4(path, form, geometry, **text_only)
        out[geometry, form] = path
    return out


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: "-".join(map(str, c)))
def compiled(request, checkpoints):
    from vllm_gemma_qat.aot.compile import compile_model
    geometry, topo, tp, form = request.param
    path = checkpoints[geometry, form]
    report = compile_model(str(path), topo, tp=tp,
                           weights="bf16" if form == "bf16" else "int4",
                           **FLAGS)
    return report, path


def test_every_startup_program_compiles(compiled):
    report, _ = compiled
    failed = [(p.label, p.error) for p in report.programs if not p.ok]
    assert not failed
    # What the runner precompiles for these flags (one token bucket, 16;
    # one request bucket, 8), in its order and under its names: sampling
    # and the logprob gathers before the KV cache is allocated
    # (TPUWorker.initialize_from_config), then capture_model: the step, a
    # multimodal model's image programs (the embedding merge with and
    # without image embeddings, the step with input embeddings), the
    # placeholder substitution of async scheduling, the logits selection,
    # compute_logits and structured decoding's grammar bitmask.
    sample = [f"worker0 sample(num_reqs=8, do_sampling={s}, logprobs={lp}, "
              "allow_distributed_sampling=1)" for s in (1, 0) for lp in (1, 0)
              ]
    images = [
        "input_embeddings_merger(num_tokens=16)",
        "input_embeddings_merger_text_only(num_tokens=16)",
        "worker0 backbone with embeds(num_tokens=16, num_reqs=8)",
    ] if "e2b" in str(compiled[1]) else []
    assert [p.label for p in report.programs] == sample + [
        "worker0 gather_logprobs(num_reqs=8)",
        "worker0 compute_and_gather_prompt_logprobs(num_tokens=16)",
        "worker0 backbone(num_tokens=16, num_reqs=8)"] + images + [
        "_substitute_placeholder_token_fn(num_tokens=8, next_tokens_size=8)",
        "_substitute_placeholder_token_fn(num_tokens=8, next_tokens_size=8)",
        "_substitute_placeholder_token_fn(num_tokens=16, "
        "next_tokens_size=16)",
        "_substitute_placeholder_token_fn(num_tokens=16, next_tokens_size=8)",
        "select_from_array [worker0 select all logits](array_size=16, "
        "index_size=8)",
        "worker0 compute_logits(num_reqs=8)",
        "structured_decode(num_reqs=8)"]
    step = next(p for p in report.programs if p.name == "worker0 backbone")
    if images:  # the same attention kernels with input embeddings
        with_embeds = next(p for p in report.programs
                           if p.name == "worker0 backbone with embeds")
        assert with_embeds.mosaic_calls == step.mosaic_calls
    assert step.mosaic_calls > 0  # RPA v3 (and gmm_v2), lowered by Mosaic
    assert step.temp_bytes > 0 and step.code_bytes > 0 and step.flops > 0
    assert step.est_seconds and step.est_seconds > 0
    assert step.kv_read_bytes > 0  # added by arithmetic (RPA declares none)
    assert report.fits and not report.why_not


def test_weights_and_kv_per_chip_equal_plan(compiled):
    report, path = compiled
    assert not report.disagreements
    # The parameters tpu-inference builds hold, per chip, what plan --tp
    # predicts for the language model (exactly) ...
    assert report.lm_weight_bytes == report.plan_lm_weight_bytes > 0
    # ... and the compiled step takes exactly those parameters, as laid out
    # in HBM (memory_analysis; TPU tiling pads the tiny model's dimensions).
    assert report.step_weight_bytes == report.lm_laid_out_bytes
    assert report.lm_laid_out_bytes >= report.lm_weight_bytes
    assert report.kv_bytes == report.plan_kv_bytes > 0
    if report.weights == "bf16":
        # The same figure through the CLI (weights served in bf16).
        out = _cli(["plan", str(path), "--tp", str(report.tp), "--context",
                    "256", "--dtype", "bfloat16", "--json"])
        assert json.loads(out)["weight_bytes_per_chip"] == \
            report.plan_weight_bytes
        if report.tp == 1:  # nothing split: the towers too
            assert report.weight_bytes == report.plan_weight_bytes


def test_report_for_people_and_tools(compiled, capsys):
    report, _ = compiled
    data = json.loads(json.dumps(report.as_dict()))
    assert data["all_compiled"] and data["fits"]
    assert "worker0 backbone" in [p["name"] for p in data["programs"]]
    cli._print_compile(report)
    out = capsys.readouterr().out
    assert re.search(r"worker0 backbone\(num_tokens=16, num_reqs=8\) +"
                     "compiled", out)
    assert "verdict          fits" in out


def _compile_step_on_v5e(checkpoints, capfd, utilization):
    """`compile` of the E2B-like bf16 checkpoint's one step for v5e-1: its
    exit code and output."""
    rc = cli.main(["compile", str(checkpoints["e2b", "bf16"]), "--topology",
                   "v5e-1", "--max-model-len", "256", "--max-num-batched-"
                   "tokens", "16", "--utilization", utilization, "--no-logits",
                   "--no-sampling", "--no-images", "--no-helpers"])
    return rc, capfd.readouterr().out


def test_what_does_not_fit_says_so(checkpoints, capfd):
    # 0.01% of a v5e chip's 16 GiB is less than the weights: no KV cache.
    # tpu-inference's own refusal, as `vllm serve` would print it.
    rc, out = _compile_step_on_v5e(checkpoints, capfd, "0.0001")
    assert rc == 1, out
    assert "verdict          does NOT fit" in out
    assert re.search(r"vLLM does not start: total_hbm_used_gb=[\d.]+GiB "
                     r"exceeds total_hbm_limit_cap_gb=[\d.]+GiB", out), out


def test_out_of_hbm_exits_1_naming_the_program_and_the_memory(checkpoints,
                                                            capfd):
    # 99.99% of a v5e chip's HBM to the KV cache leaves the step no room:
    # the TPU compiler's own out-of-memory error, named with the program.
    rc, out = _compile_step_on_v5e(checkpoints, capfd, "0.9999")
    assert rc == 1, out
    assert re.search(r"the TPU compiler on worker0 backbone\(num_tokens=16, "
                     r"num_reqs=8\):"
                     r".*RESOURCE_EXHAUSTED: Ran out of memory on HBM, the "
                     r"total memory required .*\(\d+\.\d+G\) exceeds "
                     r"available HBM \(\d+\.\d+G\)", out), out
    assert "verdict          does NOT compile" in out


def test_a_multi_host_slice_compiles_tp_across_hosts(checkpoints):
    # v6e-16: 16 chips, 4 per host; TP=8 lays the model over two hosts.
    from vllm_gemma_qat.aot.compile import compile_model
    report = compile_model(str(checkpoints["e4b", "bf16"]), "v6e-16", tp=8,
                           sampling=False, logits=False, images=False,
                           helpers=False, **FLAGS)
    assert report.hosts == 2
    assert [(p.label, p.ok) for p in report.programs] == [
        ("worker0 backbone(num_tokens=16, num_reqs=8)", True)]
    assert report.fits and not report.disagreements


def test_the_assistants_drafter_programs_compile(checkpoints, tmp_path,
                                                capfd):
    """--assistant: the Gemma 4 assistant loaded by tpu-inference's
    proposer in the runner, the runner's speculative-decoding programs
    compiled (`_precompile_mtp_helpers` and the rest; the tiny E2B-like
    target packs sliding KV: the drafter reads two cache groups), and its
    weights per chip as `plan --assistant` counts them (TP=1: nothing
    split)."""
    import torch

    from vllm_gemma_qat.testing import assistant
    target = checkpoints["e2b", "bf16"]
    helper = assistant.save(assistant.build(
        assistant.target_text_config(target)), tmp_path / "assistant",
        torch.bfloat16)
    rc = cli.main(["compile", str(target), "--topology", "v6e-1",
                   "--max-model-len", "256", "--max-num-seqs", "8",
                   "--max-num-batched-tokens", "16", "--no-sampling",
                   "--no-images", "--assistant", str(helper), "--num-speculative-tokens",
                   "2", "--json"])
    out = capfd.readouterr().out
    assert rc == 0, out[-3000:]
    # vLLM's log lines of this process (its handlers hold pytest's stdout)
    # come before the report
    report = json.loads(out[out.index("{\n \"model\""):])
    assert all(p["ok"] for p in report["programs"])
    programs = [(p["name"], p["shape"]) for p in report["programs"]]
    # The runner's programs for speculative decoding with k=2, at its
    # buckets: tokens 16, requests 8, logits 8 / 16 / 32 (every position 8
    # requests may verify: 8 x (2 + 1), padded), under its own names.
    logits = (8, 16, 32)
    expected = [
        ("worker0 backbone", {"num_tokens": 16, "num_reqs": 8}),
        # the assistant's own: its k draft steps over the target's KV
        # cache, and its inputs
        ("drafter_propose", {"num_tokens": 16}),
        ("drafter_prepare_inputs", {"num_tokens": 16}),
        ("_subtract_num_rejected_tokens_fn", {"num_tokens": 16}),
        ("worker0 concat_last_sampled_tokens_and_draft_tokens",
         {"max_num_reqs": 8, "num_spec_tokens": 2}),
        ("worker0 compute_and_gather_prompt_logprobs", {"num_tokens": 16}),
        ("worker0 gather_logprobs", {"num_reqs": 8}),
        ("structured_decode", {"num_reqs": 8})] + [
        ("worker0 compute_logits", {"num_reqs": n}) for n in logits] + [
        ("worker0 gather_logprobs_spec", {"num_logits": n, "num_reqs": 8})
        for n in logits] + [
        (f"worker0 {kind}_rejection_sampler", {
            "num_logits": n, "num_reqs": 8, "do_sampling": kind == "random"})
        for n in logits for kind in ("greedy", "random")] + [
        (f"worker0 {name}", {"num_logits": n, "num_reqs": 8})
        for n in logits for name in (
            "extract_last_sampled_tokens", "_process_and_extend_logits",
            "_extend_logits_simple", "select_bonus_logits")] + [
        ("worker0 select_target_logits", {"num_logits": n}) for n in logits
    ] + [  # no more logits than tokens
        ("worker0 extract_draft_token_ids", {"num_tokens": 16,
                                             "num_logits": n})
        for n in (8, 16)] + [
        ("select_from_array [worker0 select all logits]",
         {"array_size": 16, "index_size": n}) for n in (8, 16)] + [
        ("select_from_array [worker0 select bonus tokens for spec decoding]",
         {"array_size": n, "index_size": 8}) for n in logits] + [
        ("select_from_array [worker0 select target tokens for spec "
         "decoding]", {"array_size": n, "index_size": n}) for n in logits
    ] + [  # async scheduling: the placeholder for the k + 1 tokens
        ("_substitute_placeholder_token_fn",
         {"num_tokens": n, "next_tokens_size": 24}) for n in (8, 16) * 2
        + (32, )]
    assert sorted(map(repr, programs)) == sorted(map(repr, expected))
    assert report["num_speculative_tokens"] == 2
    assert not report["disagreements"] and report["fits"]
    plan = json.loads(_cli(["plan", str(target), "--context", "256",
                            "--dtype", "bfloat16", "--assistant",
                            str(helper), "--json"]))
    assert report["assistant_weight_bytes"] == plan["assistant_bytes"] == \
        report["plan_assistant_weight_bytes"] > 0
    assert report["weight_bytes"] == plan["weight_bytes_per_chip"]


def test_an_assistant_without_its_token_count_is_one_clear_error(
        checkpoints, capfd):
    rc = cli.main(["compile", str(checkpoints["e2b", "bf16"]), "--topology",
                   "v6e-1", "--assistant", str(checkpoints["e2b", "bf16"])])
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert rc == 2
    assert last == ("error: --assistant needs --num-speculative-tokens "
                    "(vLLM derives none from a Gemma 4 assistant's config)")


def test_unknown_topology_is_one_clear_error(checkpoints, capfd):
    rc = cli.main(["compile", str(checkpoints["e2b", "bf16"]), "--topology",
                   "v6e-3"])
    err = capfd.readouterr().err
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        "error: unknown topology 'v6e-3'; known: v5e-1, v5e-4, v5e-8, "
        "v5e-16, v6e-1, v6e-4, v6e-8, v6e-16, v6e-32")
    rc = cli.main(["compile", str(checkpoints["e2b", "bf16"]), "--topology",
                   "v6e-3", "--json"])
    assert rc == 2
    assert "unknown topology 'v6e-3'" in json.loads(
        capfd.readouterr().out)["error"]


def test_imports_run_one_way():
    """cli.py imports the AOT mode only for `compile` (inspect / plan import
    no JAX), and no plugin module imports it."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import vllm_gemma_qat
    subprocess.run([sys.executable, "-c", "import sys, vllm_gemma_qat.cli; "
                    "assert not [m for m in sys.modules if m.split('.')[0] "
                    "in ('jax', 'vllm', 'tpu_inference') or "
                    "m.startswith('vllm_gemma_qat.aot')], sorted(sys.modules)"],
                   check=True)
    package = Path(vllm_gemma_qat.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.parent.name in ("aot", "testing") or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] \
                if isinstance(node, ast.Import) else [node.module or ""] \
                if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names
                          if n.startswith("vllm_gemma_qat.aot")]
    assert offenders == []


def _cli(argv: list[str]) -> str:
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "vllm_gemma_qat.cli",
                           *argv], capture_output=True, text=True,
                          check=True).stdout


def test_a_renamed_target_stops_the_aot_mode(monkeypatch):
    """Every change to JAX / tpu-inference internals is a declared
    substitution: one whose target moved stops with MissingTarget, and the
    table is active only while `compile` runs."""
    from tpu_inference.runner import kv_cache

    from vllm_gemma_qat import aot, substitute
    table = aot.substitutions(aot.topology("v6e-1"), lambda m, mesh: None)
    original = kv_cache._get_kv_cache_allocator
    with substitute.applied(table, "test"):
        assert substitute.installed(
            "tpu_inference.runner.kv_cache:_get_kv_cache_allocator")
    assert kv_cache._get_kv_cache_allocator is original
    # (monkeypatch puts back anything left, should apply leave something)
    for entry in table:
        owner, name = entry.resolve()
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.delattr(kv_cache, "_get_kv_cache_allocator")
    with pytest.raises(substitute.MissingTarget,
                       match="_get_kv_cache_allocator does not exist"):
        substitute.apply(table, "test")
    # what it installed before it met the missing target is back
    assert not substitute.installed(table[0].target)


def test_the_engine_start_up_changes_only_what_is_installed():
    """The runner's start-up in AOT mode changes declared targets only:
    each exists in the installed tpu-inference (a renamed one would stop
    `compile` with MissingTarget, as for the table above), and none stays
    changed after."""
    from tpu_inference.runner import compilation_manager
    from tpu_inference.worker import tpu_worker

    from vllm_gemma_qat import substitute
    from vllm_gemma_qat.aot import engine
    table = engine.substitutions(engine.Recorder(lambda p: True, print), [],
                                 0)
    originals = [getattr(*entry.resolve()) for entry in table]
    with substitute.applied(table, "test"):
        assert substitute.installed(
            "tpu_inference.worker.tpu_worker:TPUWorker.__init__")
    assert [getattr(*entry.resolve()) for entry in table] == originals
    assert compilation_manager.jnp is __import__("jax").numpy
    assert tpu_worker.TPUWorker.__init__ is originals[0]


def test_flags_vllm_refuses_are_one_clear_error(checkpoints, capfd):
    # As `vllm serve` would refuse them (the tiny model has 4096 positions);
    # without --max-model-len compile takes vLLM's default, the model's.
    import os

    import vllm.config  # noqa: F401 (importing vLLM sets variables itself)
    environ = dict(os.environ)
    rc = cli.main(["compile", str(checkpoints["e2b", "bf16"]), "--topology",
                   "v6e-1", "--max-model-len", "9000"])
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert rc == 2
    # compile sets libtpu's and vLLM's variables (VLLM_LOGGING_LEVEL=WARNING
    # among them) while it runs: a server this process starts next must not
    # inherit them (CI: every log check of later tests on this worker failed)
    assert dict(os.environ) == environ
    assert last.startswith("error: vLLM refuses these flags for ") and \
        "max_model_len (9000) is greater than the derived max_model_len" \
        in last, last


def test_stock_load_format_builds_kv_on_shared_layers(tmp_path):
    # load_format="auto": stock tpu-inference (no gemma_qat fix), the
    # comparison benchmarks/compile_bench.py draws. Config only (no weights).
    from transformers import Gemma4Config

    from vllm_gemma_qat.aot.compile import compile_model
    from vllm_gemma_qat.fixes import int4_tiling
    config = Gemma4Config(text_config=tiny.text_config_kwargs("e2b"),
                          vision_config=None, audio_config=None,
                          tie_word_embeddings=True)
    config.architectures = ["Gemma4ForCausalLM"]
    config.to_json_file(tmp_path / "config.json")
    reports, int4_tiles = {}, {}
    for fmt in ("gemma_qat", "auto"):
        reports[fmt] = compile_model(str(tmp_path), "v6e-1", logits=False,
                                     sampling=False, load_format=fmt,
                                     **FLAGS)
        int4_tiles[fmt] = int4_tiling._serving_gemma_qat
    # The model build switches fixes/int4_tiling on for gemma_qat only.
    assert int4_tiles == {"gemma_qat": True, "auto": False}
    qat, stock = reports["gemma_qat"], reports["auto"]
    assert stock.all_compiled
    # The shared layers' k_proj / v_proj / k_norm, which plan counts too.
    # (XLA drops their k_norm from the compiled step's arguments: unused.)
    assert stock.lm_weight_bytes == stock.plan_lm_weight_bytes > \
        qat.lm_weight_bytes
    # Every KV-owning layer at full context (tpu-inference 0.32's layout),
    # against gemma_qat's sliding-window rows.
    assert stock.kv_bytes == stock.plan_kv_bytes
    assert stock.num_blocks < qat.num_blocks


def test_a_program_compiled_before_is_answered_by_its_kept_analysis(tmp_path):
    """aot/analyses.py: what libtpu's compile of a recorded program gave is
    kept under JAX's key for its executable; the same program again is
    answered from it (the same analysis, the step's arguments as compiled),
    a changed one compiles, and an entry that cannot be read is compiled
    again and rewritten. A program other than the step, called on a host
    array as the audio tower's precompile is (its lowering has no sharding
    for it), is kept and answered too."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.experimental.compilation_cache import compilation_cache
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from vllm_gemma_qat import substitute
    from vllm_gemma_qat.aot import analyses, engine
    from vllm_gemma_qat.aot.report import ANALYSIS
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name="v6e:2x2", chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    mesh = Mesh(np.array(desc.devices[:2]), ("model", ))
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec(
                                 "model")))
    kept = tmp_path / analyses.SUBDIRECTORY

    def record(scale, name="worker0 backbone", arg=x):
        """The recorder's program `name` for arg * scale (its second
        argument unused: not kept)."""
        jax.clear_caches()  # a compile, not JAX's in-memory executable
        recorder = engine.Recorder(lambda prog: True, lambda msg: None)
        recorder.analyses = analyses.Analyses(kept, ANALYSIS)
        step = jax.jit(lambda x, y: x * scale)
        with substitute.applied(engine.substitutions(recorder, desc.devices,
                                                     0), "test"):
            recorder.run_compilation(SimpleNamespace(runner=SimpleNamespace(
                mesh=mesh)), name, step, arg, arg)
        [prog] = recorder.started.programs
        return prog, recorder.started.step_arguments.get(prog.label)

    # Deviceless executables stay out of JAX's own cache (as compile does).
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        first, first_args = record(2.0)
        assert first.ok and not first.kept and first.argument_bytes > 0
        [entry] = kept.iterdir()
        again, again_args = record(2.0)
        assert again.kept and again.analysis() == first.analysis()
        assert [(i, a.shape, a.dtype, a.sharding) for i, a in again_args] \
            == [(i, a.shape, a.dtype, a.sharding) for i, a in first_args] \
            == [(0, (256, 128), jnp.float32, x.sharding)]
        changed, _ = record(3.0)
        assert changed.ok and not changed.kept
        assert len(list(kept.iterdir())) == 2
        entry.write_text(entry.read_text()[:20])  # a write cut short
        rebuilt, _ = record(2.0)
        assert rebuilt.ok and not rebuilt.kept
        assert json.loads(entry.read_text()) == rebuilt.analysis()
        host = np.zeros((256, 128), np.float32)
        tower, _ = record(2.0, "audio_encoder", host)
        assert tower.ok and not tower.kept
        assert len(list(kept.iterdir())) == 3
        tower_again, _ = record(2.0, "audio_encoder", host)
        assert tower_again.kept and tower_again.analysis() == tower.analysis()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
        compilation_cache.reset_cache()
        jax.clear_caches()

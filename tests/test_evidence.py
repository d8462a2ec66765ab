"""Each serving check fails on the bug it guards (#34).

Every fix in `vllm_gemma_qat.fixes.ALL` removes a tpu-inference bug; the
serving checks named below are what show, through `vllm serve` in CPU mode,
that the fix works. Here each check runs again with its fix left out
(`VLLM_GEMMA_QAT_WITHOUT_FIX`, honoured in CPU mode only), in a pytest of
its own, and must fail, at the assertion (or start-up error) that
describes the bug. A check that passed with the bug back would guard
nothing.

Opt-in (each case starts its own server; 30 min in all on this 2-core VM
shared with other jobs):

    VLLM_GEMMA_QAT_EVIDENCE=1 ./run tests tests/test_evidence.py

The checks themselves pass with every fix in the ordinary run. Bugs that are
not "a fix left out": CPU mode puts back those of `cpu/bugs.py` on request
(`VLLM_GEMMA_QAT_CPU_BUG`; `BUG_CASES` below: KV-shared layers reading
unrounded K/V, int4 nibbles in the wrong order, KV heads replicated in the
wrong order under TP); others are shown by their own tests: the drafter reading
the last group's block table (`test_sliding_window`), a q_scale 10% off
(`test_real_kernels`), the per-module cache clears (`test_load_compiles`).
"""
import functools
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_gemma_qat import fixes
from vllm_gemma_qat.cpu import bugs

EVIDENCE_ENV = "VLLM_GEMMA_QAT_EVIDENCE"
TESTS = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    fix: str  # left out; or with `bug`, the bug put back
    check: str  # a pytest node id under tests/
    failure: str  # a regex: where or why it fails (its report, the log)
    bug: bool = False
    in_process: bool = False  # the check loads the model in its own process

    @property
    def env(self) -> dict:
        env = {(bugs.BUG_ENV if self.bug else fixes.WITHOUT_ENV): self.fix}
        if self.in_process:  # fixes are left out in CPU mode only
            env[fixes.CPU_MODE_ENV] = "1"
        return env


SPEC = "test_serve_spec_decode.py::"
CASES = [
    # #3225: without the fix tpu-inference's model wants the K/V of the
    # KV-shared layers, which the QAT export leaves out.
    Case("kv_share",
         "test_serve_e2e.py::test_completions_greedy_tokens_equal_transformers",
         r"not initialized from the checkpoint: \['model\.language_model\."
         r"layers\.\d+\.self_attn\.k_norm\.weight'"),
    Case("image_steps",
         "test_serve_images.py::"
         "test_text_decoding_beside_an_image_prefill_is_unchanged",
         r"the stream sent an error[\s\S]*EngineDeadError"),
    Case("preemption",
         "test_preemption.py::test_answers_under_kv_pressure_equal_transformers",
         r"(?m)^>\s+assert wrong_answers\(hf, results\) == \[\]"),
    Case("drafter_load",
         SPEC + "test_greedy_and_acceptance_equal_the_reference_loop"
         "[w4a16-k1-auto-drafter]",
         r"(?m)^>\s+assert line is None"),
    Case("drafter_quantization",
         SPEC + "test_greedy_and_acceptance_equal_the_reference_loop"
         "[int4-fp8-k4-masked]",
         # The target's int4 config: the drafter wants packed weights.
         r"no module or parameter named 'model\.layers\.0\.mlp\.down_proj"
         r"\.weight' in Gemma4MTPForCausalLM.*weight_packed"),
    # plan (from the config) predicts the windowed pool; the server
    # without the fix allocates full-context KV for every layer.
    Case("sliding_window",
         "test_serve_agent.py::"
         "test_plan_predicts_the_kv_cache_the_server_allocates[bf16]",
         r"(?m)^>\s+" + re.escape('assert (planned["kv_pool_blocks"], '
                                  'planned["kv_cache_tokens"])')),
    Case("discarded_samples",
         SPEC + "test_preempted_requests_answer_right_with_speculation"
         "[qat-k2-tp2-small-cache]",
         # The engine dies on tpu-inference's check that a request with a
         # placeholder has at most k + 1 tokens scheduled: a resumed
         # request's recompute chunk is taken for a decode.
         r"(?m)line \d+, in _prepare_async_token_substitution_indices\n"
         r".*\]\s+assert num_scheduled_tokens_per_req\[\n.*\] "
         r"AssertionError$"),
    Case("request_checks",
         "test_serve_e2e.py::"
         "test_prompt_logprobs_are_a_named_400_and_the_engine_serves_on",
         re.escape("assert 500 == 400")),
    # The engine builds tpu-inference's Gemma4ForCausalLM, which reads
    # hf_config.text_config: the server does not start.
    Case("text_only",
         "test_config_forms.py::"
         "test_a_bare_gemma4_text_checkpoint_serves_as_transformers_answers"
         "[qat-bf16]",
         re.escape("'Gemma4TextConfig' object has no attribute "
                   "'text_config'")),
    # The model as the loader leaves it (tpu-inference's get_model under
    # gemma_qat, in-process): the kernel's scales stay in bf16, converted by
    # every call of every step.
    Case("int4_scales",
         "test_int4.py::test_int4_export_loads_and_matches_transformers"
         "[w4a16]",
         r"(?m)^>\s+assert scale_dtypes == \{\"float32\"\}",
         in_process=True),
    # tpu-inference drops the audio tower and returns no embedding for the
    # clip the processor made: the engine stops on the missing encoder
    # output, the request is a 500.
    Case("audio",
         "test_serve_audio.py::test_audio_answer_equals_transformers",
         r"HTTP Error 500: Internal Server Error"),
]


# Bugs no fix removes, put back by CPU mode (vllm_gemma_qat/cpu/bugs.py).
BUG_CASES = [
    # The fp32 server with an fp8 cache is the one that can see it (in bf16
    # the bug moves logprobs less than bf16 itself does: README).
    Case("shared_layers_read_unrounded_kv",
         "test_serve_agent.py::"
         "test_prompt_logprobs_within_derived_tolerance_of_fp32_exact_kv"
         "[fp32-e5m2]",
         r"(?m)^>\s+assert \(gap <= bound\)\.all\(\), gap\.max\(\)",
         bug=True),
    Case("int4_highest_nibble_first",
         "test_serve_int4.py::test_int4_serves_exactly[w4a16]",
         r"(?m)^>\s+assert tokens == hf_greedy\(hf, prompt_ids, n\)",
         bug=True),
    Case("kv_heads_replicated_in_tile_order",
         "test_multichip.py::test_sharded_serving_equals_transformers"
         "[e4b-4-qat]",
         r"(?m)^>\s+assert tokens == hf_greedy\(hf, prompt_ids, n\)",
         bug=True),
]


def test_every_fix_has_a_case():
    # compile_once is the weight loader's, not a serving check's: shown in
    # test_load_compiles (the stock clears compile each program again).
    # rejection_padding: shown on tpu-inference's sampler itself
    # (test_rejection_sampler) and by the opt-in
    # test_spec_decode_under_load (the int4 + fp8 server at 1024 tokens).
    # int4_tiling changes what the TPU compiler emits, not what is served:
    # shown by libtpu's code size (test_int4_tiling).
    assert sorted(c.fix for c in CASES) == sorted(
        set(fixes.ALL) - {"compile_once", "rejection_padding", "int4_tiling"})
    assert sorted(c.fix for c in BUG_CASES) == sorted(bugs.BUGS)


def test_an_unknown_bug_is_refused(monkeypatch):
    monkeypatch.setenv(bugs.BUG_ENV, "shared_layers_read_unrounded")
    with pytest.raises(ValueError, match="no such bug .*known: shared_layers"
                       "_read_unrounded_kv"):
        bugs.requested()


def test_the_switch_is_refused_outside_cpu_mode(monkeypatch):
    monkeypatch.setenv(fixes.WITHOUT_ENV, "preemption")
    monkeypatch.delenv(fixes.CPU_MODE_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{fixes.WITHOUT_ENV}=.*CPU mode"):
        fixes.left_out()
    monkeypatch.setenv(fixes.CPU_MODE_ENV, "1")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # CPU mode, on a TPU
    with pytest.raises(ValueError, match="JAX_PLATFORMS=cpu"):
        fixes.left_out()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert fixes.left_out() == ("preemption",)
    monkeypatch.setenv(fixes.WITHOUT_ENV, "preemption,kv_shares")
    with pytest.raises(ValueError, match="no fix named kv_shares"):
        fixes.left_out()
    monkeypatch.delenv(fixes.WITHOUT_ENV)
    assert fixes.left_out() == ()


def test_cpu_mode_names_the_same_variable():
    from vllm_gemma_qat import cpu
    assert fixes.CPU_MODE_ENV == cpu.CPU_MODE_ENV


def test_the_record_keeps_a_row_per_case(tmp_path, monkeypatch):
    # What an evidence run writes: each case's row replaced by its latest
    # run, the failure located on the check's own line.
    monkeypatch.setitem(globals(), "RECORD", tmp_path / "RECORD.md")
    monkeypatch.setitem(globals(), "RECORD_DATA", tmp_path / "RECORD.json")
    # As pytest writes a failure inside a helper: the test's frame, then
    # the helper's (the deepest last).
    report = ("def test_int4_serves_exactly(served):\n>       assert_equal("
              "...)\n\ntests/test_serve_int4.py:40: \n\n>       assert "
              "tokens == ref\nE  assert [1] == [2]\n\n"
              "tests/harness.py:212: AssertionError")
    check = BUG_CASES[1].check
    assert failed_at(report, check) == "tests/test_serve_int4.py:40"
    record(BUG_CASES[1], "NOT SHOWN: passed")
    record(CASES[0], "failed as it must (failure)",
           failed_at(report, CASES[0].check), "assert tokens == ref")
    record(BUG_CASES[1], "failed as it must (failure)",
           failed_at(report, check), "x")
    text = (tmp_path / "RECORD.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| kv_")
            or line.startswith("| int4_")]
    assert [r.split(" | ")[0] for r in rows] == ["| kv_share",
                                                 "| int4_highest_nibble_first"]
    assert "NOT SHOWN" not in text and commit()[:7] in text
    assert "`tests/test_serve_int4.py:40`" in rows[1]
    assert "(no line in tests/test_serve_e2e.py)" in rows[0]


# The last evidence run's outcome, one row per case (README links it).
RECORD = TESTS.parent / "evidence" / "RECORD.md"
RECORD_DATA = RECORD.with_suffix(".json")


@functools.cache
def commit() -> str:
    """The commit the run tests, "+changes" if files outside evidence/
    differ from it (the record itself changes with every case)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=TESTS.parent,
                              capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", ".", ":!evidence")
    return head + ("+changes" if changed else "")


def failed_at(report_text: str, check: str) -> str:
    """The line of the check's own file where its failure report stops in
    it (a start-up error: the fixture line that started the server)."""
    own = "tests/" + check.split("::")[0]
    lines = [f"{path}:{line}" for path, line in re.findall(
        r"(?m)^(tests/[\w/]+\.py):(\d+): ", report_text) if path == own]
    return lines[-1] if lines else "(no line in " + own + ")"


class NotRun(AssertionError):
    """The case's pytest did not run its check (exit 2-5)."""


def record(case: Case, outcome: str, where: str = "", shown: str = ""):
    """Put `case`'s row into RECORD (rows of other cases kept)."""
    import datetime
    import json
    rows = json.loads(RECORD_DATA.read_text()) if RECORD_DATA.exists() else {}
    rows[case.fix] = {
        "case": case.fix, "kind": "bug put back" if case.bug else "fix left out",
        "check": case.check, "outcome": outcome, "failed_at": where,
        "shown": shown, "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC")}
    RECORD.parent.mkdir(exist_ok=True)
    RECORD_DATA.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    order = [c.fix for c in CASES + BUG_CASES]
    table = ["# Evidence: each serving check fails on the bug it guards", "",
             "Written by `VLLM_GEMMA_QAT_EVIDENCE=1 ./run tests "
             "tests/test_evidence.py` (one row per case, from its last run; "
             "`RECORD.json` holds the same). *failed at*: the check's line "
             "its failure report ends on; *shown by*: the first line of what "
             "the case's pattern matched (the report or the server log).", "",
             "| case | kind | check | outcome | failed at | shown by | commit "
             "| date |", "|---|---|---|---|---|---|---|---|"]
    for fix in sorted(rows, key=lambda f: order.index(f) if f in order
                      else len(order)):
        r = rows[fix]
        cells = [r["case"], r["kind"], f"`{r['check']}`", r["outcome"],
                 f"`{r['failed_at']}`" if r["failed_at"] else "",
                 f"`{r['shown']}`" if r["shown"] else "", r["commit"],
                 r["date"]]
        table.append("| " + " | ".join(c.replace("|", "\\|") for c in cells)
                     + " |")
    RECORD.write_text("\n".join(table) + "\n")


@pytest.mark.parametrize("case", CASES + BUG_CASES,
                         ids=[c.fix for c in CASES + BUG_CASES])
def test_check_fails_on_the_bug_it_guards(case, tmp_path):
    if os.environ.get(EVIDENCE_ENV) != "1":
        pytest.skip(f"evidence runs start a server each: {EVIDENCE_ENV}=1")
    try:
        outcome, where, shown = run_case(case, tmp_path)
    except NotRun as e:
        record(case, "NOT RUN: " + str(e).splitlines()[0][:200])
        raise
    except AssertionError as e:
        record(case, "NOT SHOWN: " + str(e).splitlines()[0][:200])
        raise
    except BaseException as e:
        record(case, f"NOT RUN: {type(e).__name__}: {e}"[:200])
        raise
    record(case, outcome, where, shown)


def run_case(case: Case, tmp_path) -> tuple[str, str, str]:
    report, basetemp = tmp_path / "report.xml", tmp_path / "run"
    env = dict(os.environ)
    for name in (fixes.WITHOUT_ENV, bugs.BUG_ENV):  # this case's only
        env.pop(name, None)
    env.update(case.env)
    env.pop("PYTEST_XDIST_WORKER", None)
    # Its own session: a timeout takes its servers down with it.
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(TESTS / case.check), "-q",
         "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={report}",
         f"--basetemp={basetemp}"],
        env=env, cwd=TESTS.parent, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = run.communicate(timeout=1500)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    print(output[-4000:])
    # 1: tests ran and some failed (not 0: passed; not 2-5: pytest itself
    # stopped, collection failed, nothing ran).
    if run.returncode not in (0, 1):
        raise NotRun(f"{case.check} with {case.env}: pytest exit "
                     f"{run.returncode}")
    assert run.returncode == 1, f"{case.check} passed with {case.env}"
    (result,) = list(ET.parse(report).getroot().iter("testcase"))
    failed = [e for e in result if e.tag in ("failure", "error")]
    assert failed, f"{case.check} passed with {case.env}"
    # Where it failed: the report, and the server's log (a start-up error,
    # an engine that died: the client sees only an exit or an HTTP 500).
    report_text = "\n".join((e.get("message") or "") + "\n" + (e.text or "")
                            for e in failed)
    logs = "\n".join(p.read_text(errors="replace")
                     for p in sorted(basetemp.rglob("*.log")))
    match = re.search(case.failure, report_text + logs)
    assert match, report_text[-3000:]
    shown = match.group(0).strip().splitlines()[0][:160]
    return (f"failed as it must ({failed[0].tag})",
            failed_at(report_text, case.check), shown)

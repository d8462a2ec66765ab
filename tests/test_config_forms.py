"""What `vllm-gemma-qat inspect` says yes to, `vllm serve` serves, for every
form a Gemma 4 E-family checkpoint comes in (issue #43):

- config forms: the multimodal wrapper (the published exports), the text
  wrapper (a `gemma4` config holding the text config, `model.language_model.*`),
  bare `gemma4_text` (what `Gemma4ForCausalLM.save_pretrained` writes,
  `model.*`), and a multimodal architecture whose `vision_config` is null;
- layouts and weights: QAT bf16, regular bf16, q4_0 with the overrides
  `vllm-gemma-qat int4-overrides` prints, w4a16.

Each cell runs `inspect` and the engine's own load (tpu-inference's
`get_model` through the gemma_qat loader, as the engine core runs it) and
compares logits with transformers'; a "no" must be the refusal `vllm serve`
gives before any engine starts, and `plan` / `compile` stop on it too. The
bare form, new with fixes/text_only.py, also goes through `vllm serve`
itself (QAT bf16 and w4a16). The rest of the matrix serves in other modules
(test_serve_e2e, test_serve_int4, test_multichip for TP 2); tensor
parallelism does not depend on how the config is written, so it is not a
dimension here.
"""
import copy
import json
from pathlib import Path

import numpy as np
import pytest

import harness
from vllm_gemma_qat import checkpoint, cli, cpu, preflight
from vllm_gemma_qat.checkpoint import CheckpointError
from vllm_gemma_qat.cpu.server import CpuServer
from vllm_gemma_qat.testing import runner, tiny

CONFIG_FORMS = ("multimodal", "text", "bare")
WEIGHTS = ("qat-bf16", "regular-bf16", "q4_0", "w4a16")
# The w4a16 exports keep this linear bf16 by name (as a recipe's ignore
# list may): the name is the checkpoint's module path, `model.layers.*` in
# the bare form, which tpu-inference must match to leave it bf16.
KEPT_BF16 = "layers.3.mlp.down_proj"
TOWERLESS = "config.json: vision_config is null"
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_models():
    """{(multimodal, int4): (transformers model, int4 grid or None)}."""
    models = {}
    for multimodal in (True, False):
        model = tiny.build_model("e2b", multimodal)
        models[multimodal, False] = (model, None)
        on_grid = copy.deepcopy(model)
        models[multimodal, True] = (on_grid, tiny.put_on_int4_grid(on_grid))
    return models


def _save(hf_models, form: str, weights: str, path: Path):
    """The checkpoint of `form` x `weights` at `path`; its transformers twin."""
    model, grid = hf_models[form == "multimodal", weights in ("q4_0", "w4a16")]
    bare = form == "bare"
    if grid is None:
        tiny.save_checkpoint(model, path, weights.split("-")[0], bare=bare)
    else:
        ignore = [_prefix(form) + KEPT_BF16] if weights == "w4a16" else []
        tiny.save_int4_checkpoint(model, path, grid, weights, bare=bare,
                                  ignore=ignore)
    return model


def _prefix(form: str) -> str:
    return "model." if form == "bare" else "model.language_model."


def _towerless(hf_models, path: Path) -> Path:
    """A text checkpoint whose config claims the multimodal architecture
    with `vision_config: null` (towers stripped, config left behind)."""
    _save(hf_models, "text", "qat-bf16", path)
    config = json.loads((path / "config.json").read_text())
    assert config["vision_config"] is None
    config["architectures"] = ["Gemma4ForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main([*args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _int4_overrides(capsys, path) -> dict:
    rc, out, err = _cli(capsys, "int4-overrides", str(path))
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("form", CONFIG_FORMS)
def test_inspect_yes_means_the_engine_loads_it_and_answers_as_transformers(
        plugin, hf_models, tmp_path, capsys, form, weights):
    hf = _save(hf_models, form, weights, tmp_path / "model")
    rc, out, err = _cli(capsys, "inspect", "--json", str(tmp_path / "model"))
    summary = json.loads(out)
    assert (rc, summary["loads_with_gemma_qat"], summary["errors"]) == (
        0, True, []), err
    assert summary["architecture"] == ("Gemma4ForConditionalGeneration"
                                       if form == "multimodal"
                                       else "Gemma4ForCausalLM")
    overrides = (_int4_overrides(capsys, tmp_path / "model")
                 if weights == "q4_0" else None)
    preflight.check_local_checkpoint(str(tmp_path / "model"),
                                     hf_overrides=overrides)
    rc, out, err = _cli(capsys, "plan", str(tmp_path / "model"), "--context",
                        "256", "--agents", "2",
                        *(["--weights", "int4"] if weights == "w4a16" else []))
    assert rc == 0 and "2 agents x 256 tokens" in out, err

    model, config, mesh = runner.load(tmp_path / "model", "gemma_qat",
                                      hf_overrides=overrides)
    int4 = {n for n, p in model.model.named_parameters()
            if str(p[...].dtype) == "int4"}
    assert bool(int4) == (weights in ("q4_0", "w4a16"))
    kept = f"language_model.{KEPT_BF16}.weight"
    assert any(n.endswith(kept) for n, _ in model.model.named_parameters())
    assert any(n.endswith(kept) for n in int4) == (weights == "q4_0")
    prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
    with cpu.kernels():
        got = runner.PagedRunner(model, config, mesh).step(prompt)
    np.testing.assert_allclose(got, harness.hf_logits(hf, prompt),
                               atol=LOGIT_ATOL, rtol=0)


def test_a_multimodal_config_without_its_vision_config_is_refused_by_name(
        hf_models, tmp_path, capsys):
    path = _towerless(hf_models, tmp_path / "towerless")
    rc, out, _ = _cli(capsys, "inspect", "--json", str(path))
    summary = json.loads(out)
    assert rc == 1 and not summary["loads_with_gemma_qat"]
    assert summary["errors"][0].startswith(TOWERLESS)
    with pytest.raises(CheckpointError, match=TOWERLESS):
        preflight.check_local_checkpoint(str(path))
    for args in (["plan", str(path)], ["compile", str(path), "--topology",
                                       "v6e-1"]):
        rc, out, err = _cli(capsys, *args)
        assert rc != 0 and TOWERLESS in err, (args, out, err)
        assert "Traceback" not in err

    # `vllm serve` stops before any engine starts, the same cause last.
    served = CpuServer(path, log=tmp_path / "serve.log").refusal()
    assert served.returncode != 0
    last = served.stdout.strip().splitlines()[-1]
    assert last.startswith("vllm_gemma_qat.checkpoint.CheckpointError: ")
    assert TOWERLESS in last
    assert "EngineCore" not in served.stdout


@pytest.fixture(scope="module", params=["qat-bf16", "w4a16"])
def bare_server(request, hf_models, tmp_path_factory):
    weights = request.param
    root = tmp_path_factory.mktemp(f"bare-{weights}")
    hf = _save(hf_models, "bare", weights, root / "model")
    tiny.save_tokenizer(root / "model")
    assert checkpoint.read_config(root / "model")["model_type"] == "gemma4_text"
    with CpuServer(root / "model", log=root / "server.log") as server:
        yield server, hf, root / "model"


@pytest.mark.xdist_group("config_forms_bare_servers")
def test_a_bare_gemma4_text_checkpoint_serves_as_transformers_answers(
        bare_server):
    server, hf, model = bare_server
    harness.assert_concurrent_greedy_equal(
        server, model, hf, [f"agent {i}: " + "b" * (2 + 5 * i)
                            for i in range(8)], n=12)
    # Text-only and no drafter: prompt logprobs are served (a multimodal
    # model gets a 400, patches/0010).
    r = server.post("/v1/completions", {
        "model": str(model), "prompt": "score me", "max_tokens": 1,
        "prompt_logprobs": 1})
    assert len(r["choices"][0]["prompt_logprobs"]) > 1

"""Test helpers: the transformers reference and OpenAI-endpoint requests.
Building and running tpu-inference's model: vllm_gemma_qat.testing.runner."""
from __future__ import annotations

import numpy as np


def hf_logits(hf_model, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(token_ids)]))
    return out.logits[0].float().numpy()


def hf_token_logprobs(hf_model, token_ids, kv_dtype: str | None = None,
                      shared_layers_exact: bool = False) -> np.ndarray:
    """log p(token t | tokens before t) for t >= 1 (what vLLM returns as
    prompt logprobs), from transformers in the model's own dtype. With
    `kv_dtype` (a torch float8 name) K/V are rounded as tpu-inference
    stores them in an fp8 cache: post-RoPE K and normed V clipped to the
    type's range and cast (scale 1.0), queries kept; KV-shared layers then
    read their source's rounded K/V, or with `shared_layers_exact` the
    unrounded ones (what a cache-bypassing bug would read)."""
    import torch
    name = "sdpa"
    if kv_dtype:
        name = _kv_rounding_attention(kv_dtype, shared_layers_exact)
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([list(token_ids)])).logits
    finally:
        hf_model.set_attn_implementation(before)
    logprobs = torch.log_softmax(logits[0].float(), -1)[:-1]
    return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].numpy()


def _kv_rounding_attention(kv_dtype: str, shared_layers_exact: bool) -> str:
    """Register (once) transformers' sdpa attention with K/V rounded to
    `kv_dtype`; the mask function must be registered under the same name."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    name = f"sdpa_kv_{kv_dtype}" + ("_shared_exact" if shared_layers_exact else "")
    dtype, info = getattr(torch, kv_dtype), torch.finfo(getattr(torch, kv_dtype))

    def rounded(x):
        return x.clamp(info.min, info.max).to(dtype).to(x.dtype)

    def attention(module, query, key, value, mask, **kwargs):
        if not (shared_layers_exact and module.is_kv_shared_layer):
            key, value = rounded(key), rounded(value)
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def hf_greedy(hf, prompt_ids, n):
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def complete(server, model, prompt, n=8, **extra):
    r = server.post("/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": n,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        **extra})
    choice = r["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def assert_concurrent_greedy_equal(server, model, hf, prompts, n=8):
    """`prompts` sent at once (continuous batching); each answer equals
    transformers' greedy continuation."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(server, model, p, n=n),
                                prompts))
    for prompt_ids, tokens in results:
        assert tokens == hf_greedy(hf, prompt_ids, n)


def prefix_cache_rerun(server, model, prompt, n=8):
    """`prompt` twice: (prefix-cache hits the two added, first answer,
    second answer)."""
    before = server.metrics().get("vllm:prefix_cache_hits_total", 0)
    first = complete(server, model, prompt, n=n)
    second = complete(server, model, prompt, n=n)
    hits = server.metrics()["vllm:prefix_cache_hits_total"] - before
    return hits, first, second


TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {"tool": {"type": "string", "enum": ["search", "read"]},
                   "arg": {"type": "integer"}},
    "required": ["tool", "arg"], "additionalProperties": False}


def guided_tool_call(server, model) -> dict:
    """A chat request under json_schema guided decoding; its content,
    validated against the schema."""
    import json

    import jsonschema
    r = server.post("/v1/chat/completions", {
        "model": str(model), "max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": "Call a tool."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "call", "schema": TOOL_CALL_SCHEMA}}})
    call = json.loads(r["choices"][0]["message"]["content"])
    jsonschema.validate(call, TOOL_CALL_SCHEMA)
    return call

"""Test helpers: the transformers reference and OpenAI-endpoint requests.
Building and running tpu-inference's model: vllm_gemma_qat.testing.runner."""
from __future__ import annotations

import numpy as np


def hf_logits(hf_model, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(token_ids)]))
    return out.logits[0].float().numpy()


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

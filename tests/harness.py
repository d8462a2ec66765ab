"""Test helpers: the transformers reference and OpenAI-endpoint requests.
Building and running tpu-inference's model: vllm_gemma_qat.testing.runner."""
from __future__ import annotations

import contextlib

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
    return _batch_logprobs(hf_model, [token_ids], kv_dtype,
                           shared_layers_exact)[0]


def _batch_logprobs(hf_model, batch, kv_dtype=None, shared_layers_exact=False,
                    past=None):
    """`hf_token_logprobs` of equally long sequences, in one forward. With
    `past` (a cache of the tokens before them, `_prefix_cache`): the
    logprobs of their tokens after the first."""
    import torch
    ids = torch.tensor([list(t) for t in batch])
    with torch.no_grad(), _attention(hf_model, kv_dtype, shared_layers_exact):
        logits = hf_model(input_ids=ids, past_key_values=past).logits
    logprobs = torch.log_softmax(logits.float(), -1)[:, :-1]
    return logprobs.gather(2, ids[:, 1:, None])[..., 0].numpy()


def _prefix_cache(hf_model, token_ids, kv_dtype, rows: int):
    """transformers' cache of `token_ids` (K/V rounded to `kv_dtype` as they
    are read), repeated for `rows` sequences that go on from them. Every
    layer keeps all positions (no sliding-window layers): a K/V element's
    index is its position, in the prefix and after it."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    if token_ids:
        with torch.no_grad(), _attention(hf_model, kv_dtype, False):
            hf_model(input_ids=torch.tensor([list(token_ids)]),
                     past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
    return cache


@contextlib.contextmanager
def _attention(hf_model, kv_dtype, shared_layers_exact):
    """transformers' sdpa, or with `kv_dtype` `_kv_rounding_attention`."""
    name = "sdpa"
    if kv_dtype:
        name = _kv_rounding_attention(kv_dtype, shared_layers_exact)
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(name)
    try:
        yield
    finally:
        hf_model.set_attn_implementation(before)


class _KvRounding:
    """What the K/V-rounding attention does besides rounding, for
    `fp8_flip_allowance`: record each cache-owning layer's K/V before
    rounding (`captured`), attend over given rounded K/V instead of its own
    (`given`: {layer: (K, V)}), and in row b of the batch round one element
    the other way (`flips[b]`: source layer, 0 for K / 1 for V, index in
    the row, value)."""
    captured: dict | None = None
    given: dict | None = None
    flips: list | None = None


def _kv_source(module) -> int:
    """The layer whose K/V `module` attends over: its own, or for a
    KV-shared layer the last earlier cache-owning layer of its type."""
    config = module.config
    if not module.is_kv_shared_layer:
        return module.layer_idx
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    return max(i for i in range(first_shared)
               if config.layer_types[i] == module.layer_type)


def _round_kv(x, kv_dtype: str):
    import torch
    dtype = getattr(torch, kv_dtype)
    info = torch.finfo(dtype)
    return x.clamp(info.min, info.max).to(dtype).to(x.dtype)


def _kv_rounding_attention(kv_dtype: str, shared_layers_exact: bool) -> str:
    """Register (once) transformers' sdpa attention with K/V rounded to
    `kv_dtype`; the mask function must be registered under the same name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    name = f"sdpa_kv_{kv_dtype}" + ("_shared_exact" if shared_layers_exact else "")

    def attention(module, query, key, value, mask, **kwargs):
        source = _kv_source(module)
        if _KvRounding.captured is not None and not module.is_kv_shared_layer:
            _KvRounding.captured[source] = (key.clone(), value.clone())
        if not (shared_layers_exact and module.is_kv_shared_layer):
            kv = [_round_kv(key, kv_dtype), _round_kv(value, kv_dtype)]
            if _KvRounding.given is not None:
                kv = [x.to(key.dtype) for x in _KvRounding.given[source]]
            for row, flip in enumerate(_KvRounding.flips or []):
                if flip and flip[0] == source:
                    _, which, index, flipped = flip
                    kv[which] = kv[which].clone()
                    kv[which][(row, *index)] = flipped
            key, value = kv
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# How far from the float64 value another fp32 implementation may compute a
# K/V element, in units of transformers' own fp32 error on that layer.
FP32_NOISE_FACTOR = 10
FLIPS_PER_FORWARD = 64


def fp8_flip_allowance(hf_fp32, token_ids, kv_dtype: str):
    """`_fp8_flip_allowance`, computed once per machine: a model-cache entry
    keyed by the model's tensors and config, the tokens, the K/V dtype,
    this file's source and the torch / transformers versions (one forward
    per 64 flips, from the first one's position on; single-threaded, ~45 s
    for test_serve_real_kernels' 96 tokens)."""
    import json
    from pathlib import Path

    from vllm_gemma_qat.testing import model_cache

    def compute(directory: Path):
        allowance, flips = _fp8_flip_allowance(hf_fp32, token_ids, kv_dtype)
        np.save(directory / "allowance.npy", allowance)
        (directory / "flips.json").write_text(json.dumps(flips))

    entry = model_cache.reference(
        "fp8-flip-allowance", hf_fp32,
        {"token_ids": [int(t) for t in token_ids], "kv_dtype": kv_dtype},
        __file__, compute)
    return (np.load(entry / "allowance.npy"),
            json.loads((entry / "flips.json").read_text()))


def _fp8_flip_allowance(hf_fp32, token_ids, kv_dtype: str):
    """How far an fp32 server with an fp8 cache may correctly be from
    `hf_token_logprobs(hf_fp32, token_ids, kv_dtype)`, per position, and the
    number of elements it comes from. Two correct fp32 implementations
    compute a K/V element a few ulps apart; one that lies that close to the
    midpoint between two fp8 values may be stored as either (one such
    element moved a logprob by 3.8e-3 where the rest agree to 1e-5). The
    elements within `FP32_NOISE_FACTOR` x transformers' own fp32 error
    (against float64, per layer) of a midpoint are each rounded the other
    way in turn; the allowance is the sum of what each flip moves. The
    float64 run attends over the fp32 run's rounded K/V, so its layers see
    the same inputs up to fp32 error, not up to an earlier flip."""
    import copy
    hf64 = copy.deepcopy(hf_fp32).double()
    captured = {False: {}, True: {}}  # is float64: {layer: (K, V)}
    _KvRounding.captured = captured[False]
    try:
        hf_token_logprobs(hf_fp32, token_ids, kv_dtype)
        _KvRounding.captured = captured[True]
        _KvRounding.given = {layer: [_round_kv(x, kv_dtype) for x in kv]
                             for layer, kv in captured[False].items()}
        hf_token_logprobs(hf64, token_ids, kv_dtype)
    finally:
        _KvRounding.captured = _KvRounding.given = None
    flips = []
    for layer, kv32 in captured[False].items():
        for which in (0, 1):
            x32, x64 = kv32[which][0], captured[True][layer][which][0]
            window = FP32_NOISE_FACTOR * (x32.double() - x64).abs().max()
            low, high = (_round_kv(x64 - window, kv_dtype),
                         _round_kv(x64 + window, kv_dtype))
            chosen = _round_kv(x32, kv_dtype)
            for index in map(tuple, (low != high).nonzero().tolist()):
                other = (high if chosen[index] == low[index] else low)[index]
                flips.append((layer, which, index, other.float()))
    # A flip moves no logprob before its position: flips in position
    # order, each forward runs from its first flip's position on, over a
    # cache of the tokens before it, beside an unflipped row that is its
    # base.
    flips.sort(key=lambda flip: flip[2][1])
    allowance = np.zeros(len(token_ids) - 1, np.float32)
    for start in range(0, len(flips), FLIPS_PER_FORWARD):
        chunk = flips[start:start + FLIPS_PER_FORWARD]
        first = chunk[0][2][1]
        past = _prefix_cache(hf_fp32, token_ids[:first], kv_dtype,
                             1 + len(chunk))
        _KvRounding.flips = [None, *chunk]
        try:
            rows = _batch_logprobs(hf_fp32, [token_ids[first:]] * (
                1 + len(chunk)), kv_dtype, past=past)
        finally:
            _KvRounding.flips = None
        allowance[first:] += np.abs(rows[1:] - rows[0]).sum(0)
    return allowance, len(flips)


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


def next_turn_hits(server, model, prompt, n, tail):
    """An agent's next turn: `prompt` answered (n tokens), then its prompt
    ids + answer ids + `tail` (ids) sent as the next prompt. Returns (turn
    1 prompt length, answer length, prefix-cache hit tokens of turn 2)."""
    prompt_ids, answer = complete(server, model, prompt, n=n)
    before = server.metrics().get("vllm:prefix_cache_hits_total", 0)
    complete(server, model, prompt_ids + answer + list(tail), n=1)
    hits = server.metrics()["vllm:prefix_cache_hits_total"] - before
    return len(prompt_ids), len(answer), int(hits)


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


def streamed_tool_calls(server, body: dict):
    """A streamed chat completion's tool calls assembled from its deltas as
    an OpenAI client does: ([(name, arguments)], finish reason, chunks)."""
    import json
    import urllib.request
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        json.dumps(body | {"stream": True}).encode(),
        {"Content-Type": "application/json"})
    parts, finish, chunks = {}, None, 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            choice = json.loads(line[len("data: "):])["choices"][0]
            for call in choice["delta"].get("tool_calls") or []:
                part = parts.setdefault(call["index"], ["", ""])
                part[0] += call.get("function", {}).get("name") or ""
                part[1] += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return ([(name, json.loads(arguments))
             for _, (name, arguments) in sorted(parts.items())],
            finish, chunks)


def streamed_arrivals(server, path: str, body: dict):
    """A streamed request's chunks as they arrive: (the monotonic time of
    each chunk that carries a token, the token ids, their logprobs; the
    last two where the request returns them)."""
    import json
    import time
    import urllib.request
    request = urllib.request.Request(
        server.url + path, json.dumps(body | {"stream": True}).encode(),
        {"Content-Type": "application/json"})
    times, tokens, logprobs = [], [], []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise AssertionError(f"{path}: the stream sent an error: "
                                     f"{chunk['error']}")
            choice = chunk["choices"][0]
            ids = choice.get("token_ids") or []
            if ids or choice.get("text") or (choice.get("delta") or {}).get(
                    "content"):
                times.append(time.monotonic())
            tokens += ids
            logprobs += (choice.get("logprobs") or {}).get(
                "token_logprobs") or []
    return times, tokens, logprobs


def refusal(server, path: str, body: dict) -> tuple[int, str]:
    """(HTTP status, error message) of a request the server must refuse."""
    import json
    import urllib.error
    try:
        server.post(path, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}").get("error", {}).get(
            "message", "")
    raise AssertionError(f"{path} {body} was served")

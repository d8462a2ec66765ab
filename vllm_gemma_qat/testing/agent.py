"""A tiny Gemma 4 agent: its greedy answers are Gemma 4 tool calls, reasoning
blocks and answers to tool results, so vLLM's `gemma4` tool and reasoning
parsers have something real to parse.

A random tiny model never writes `<|tool_call>call:NAME{...}<tool_call|>`,
and under the `gemma4` tool parser `tool_choice: "required"` does not force
it (no structured outputs). So `train` teaches a tiny E-family model, on the
CPU and deterministically, the few agent turns of `CASES`, written
in Gemma 4's chat format by `CHAT_TEMPLATE` (the tokenizer's): first in
float, then with every language-model linear held on the q4_0 grid
(straight-through rounding), so the bf16 QAT export and the int4 served
from it hold the same weights. Training stops when every answer token is
the argmax by a clear margin. Nothing is downloaded or committed: the
tests train it once per machine (`trained`, kept in `model_cache`; 80 s of
CPU on 2026-12-06: 4 agent turns plus one tool-result turn, prompts of ~75
tokens).

Gemma 4's format (vLLM `parser/gemma4.py`): tools are declared in the
system turn as `<|tool>declaration:NAME{...}<tool|>`, a call is
`<|tool_call>call:NAME{key:<|"|>text<|"|>,num:42}<tool_call|>`, its result
comes back as `<|tool_response>response:NAME{value:...}<tool_response|>` in
the same model turn, reasoning is `<|channel>thought\\n...<channel|>`. The
parsers find these markers by token id, so each is one token here; the
model stops on `<turn|>` and, after a call, on `<|tool_response>`.
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_gemma_qat.testing import tiny

# Gemma 4's chat and agent tokens, one id each on the byte-level vocab's
# first unused ids (after tiny.py's 6 specials and 256 bytes).
GEMMA4_TOKENS = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                 "<tool_call|>", "<|tool_response>", "<tool_response|>",
                 '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
# The template's fixed fragments and the dataset's words as single tokens
# (a byte-level BPE without merges has no multi-byte tokens otherwise):
# prompts of ~60 tokens instead of ~150, so training takes seconds.
WORDS = ["system\n", "user\n", "model\n", "thought\n", "declaration:",
         "{description:", ",parameters:{properties:{", ":{type:",
         "}},required:[", "],type:", "}}", "STRING", "INTEGER", "OBJECT",
         "call:", "response:", "{value:", "get_weather", "city", "add",
         "Weather in a city", "Sum of two integers", "Weather in ", "Add ",
         " and ", "Paris", "Oslo", "Hello", "sunny", "snow", "Sunny in ",
         "Snow in ", "The sum is ", "Ask me", "use ", "No tool needed",
         "A sum: ", "Weather: "]
FIRST_ID = len(tiny.SPECIAL_TOKENS) + 256
TOKEN_IDS = {t: FIRST_ID + i for i, t in enumerate(GEMMA4_TOKENS + WORDS)}
STOP = ["<eos>", "<turn|>", "<|tool_response>"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Sum of two integers",
        "parameters": {"type": "object", "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"},
                                      "b": {"type": "integer"}}}}},
]

# Gemma 4's tool format in a compact template of our own: a system turn with
# the thinking flag and the tool declarations, user / model turns, tool
# calls and their responses inside the model turn, and the generation
# prompt (thinking off: an empty thought channel, as Gemma 4's own does).
CHAT_TEMPLATE = r"""
{%- macro value(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is mapping -%}{ {%- for k, x in v | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%} }
{%- else -%}{{ v | string | lower if v is boolean else v }}
{%- endif -%}
{%- endmacro -%}
{%- macro declaration(f) -%}
declaration:{{ f.name }}{description:<|"|>{{ f.description }}<|"|>
{%- if f.parameters -%}
,parameters:{properties:{
{%- for k, p in f.parameters.properties | dictsort -%}
{{ k }}:{type:<|"|>{{ p.type | upper }}<|"|>}{{ ',' if not loop.last }}
{%- endfor -%}
},required:[
{%- for k in f.parameters.required -%}<|"|>{{ k }}<|"|>{{ ',' if not loop.last }}{%- endfor -%}
],type:<|"|>OBJECT<|"|>}
{%- endif -%}
}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{{- bos_token -}}
{%- set messages_left = messages -%}
{%- if thinking or tools or messages[0].role == 'system' -%}
<|turn>system
{% if thinking %}<|think|>
{% endif -%}
{%- if messages[0].role == 'system' -%}
{{ messages[0].content | trim }}{%- set messages_left = messages[1:] -%}
{%- endif -%}
{%- for t in tools or [] -%}<|tool>{{ declaration(t.function) }}<tool|>{%- endfor -%}
<turn|>
{% endif -%}
{%- set ns = namespace(open=false) -%}
{%- for m in messages_left -%}
{%- if m.role == 'tool' -%}
<|tool_response>response:{{ ns.tool }}{value:{{ value(m.content) }}}<tool_response|>
{%- set ns.open = true -%}
{%- else -%}
{%- if ns.open -%}{%- if m.role != 'assistant' -%}<turn|>
{% endif -%}{%- else -%}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}
{% endif -%}
{%- set ns.open = false -%}
{%- if m.content -%}{{ m.content | trim }}{%- endif -%}
{%- for c in m.tool_calls or [] -%}
{%- set args = c.function.arguments -%}
<|tool_call>call:{{ c.function.name }}{ {%- if args is mapping -%}
{%- for k, x in args | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}
{%- else -%}{{ args }}{%- endif -%} }<tool_call|>
{%- set ns.tool = c.function.name -%}{%- set ns.open = true -%}
{%- endfor -%}
{%- if not ns.open -%}<turn|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}
<|turn>model
{% if not thinking %}<|channel>thought
<channel|>{% endif -%}
{%- endif -%}
"""


def _call(name: str, **args) -> dict:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _call_text(name: str, **args) -> str:
    fields = ",".join(f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{v}"
                      for k, v in sorted(args.items()))
    return f"<|tool_call>call:{name}{{{fields}}}<tool_call|>"


# The agent turns the tests ask for: (user text, thinking on, the model's
# answer: a tool call (name, args) or text, then (tool result, answer to
# it) for a tool-result turn).
CASES = [
    ("Weather in Paris?", False, ("get_weather", {"city": "Paris"}),
     ("sunny", "Sunny in Paris.")),
    ("Weather in Paris?", True, ("get_weather", {"city": "Paris"}), None),
    ("Add 2 and 3.", False, ("add", {"a": 2, "b": 3}), None),
    ("Hello!", False, "Hello! Ask me.", None),
]
THOUGHT = {"get_weather": "Weather: use get_weather.",
           "add": "A sum: use add."}


def conversations() -> list[dict]:
    """The training set: {messages, enable_thinking, answer}, the answer being
    the model's text after the chat template's generation prompt, through its
    stop token."""
    out = []
    for user, thinking, reply, result in CASES:
        messages = [{"role": "user", "content": user}]
        if isinstance(reply, str):
            answer = reply + "<turn|>"
        else:
            answer = _call_text(reply[0], **reply[1]) + "<|tool_response>"
        if thinking:
            answer = f"<|channel>thought\n{THOUGHT[reply[0]]}<channel|>" + answer
        out.append(dict(messages=messages, enable_thinking=thinking,
                        answer=answer))
        if result:
            turn = messages + [
                {"role": "assistant", "content": "",
                 "tool_calls": [_call(reply[0], **reply[1])]},
                {"role": "tool", "tool_call_id": f"call_{reply[0]}",
                 "content": result[0]}]
            out.append(dict(messages=turn, enable_thinking=thinking,
                            answer=result[1] + "<turn|>"))
    return out


def save_tokenizer(path: str | Path):
    """tiny.py's byte-level tokenizer with Gemma 4's chat and agent tokens
    (special: the parsers find them by id, and vLLM shows them when the
    parser turns off skip_special_tokens) and `CHAT_TEMPLATE`."""
    tokenizer = tiny.byte_level_tokenizer(
        {i: t for t, i in TOKEN_IDS.items()},
        additional_special_tokens=GEMMA4_TOKENS)
    tokenizer.add_tokens(WORDS)  # ids from TOKEN_IDS: already in the vocab
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def text_config_kwargs() -> dict:
    """E2B-like (1 KV head, double-wide MLP on shared layers), 6 layers of
    which the last 2 read K/V of earlier layers (one sliding, one full), 2
    query heads."""
    kwargs = tiny.text_config_kwargs("e2b")
    kwargs.update(num_hidden_layers=6, num_kv_shared_layers=2,
                  num_attention_heads=2,  # training cost is mostly attention
                  hidden_size=128, intermediate_size=256,
                  layer_types=["sliding_attention"] * 2 + ["full_attention"]
                  + ["sliding_attention"] * 2 + ["full_attention"],
                  sliding_window=32, eos_token_id=[tiny_id(t) for t in STOP])
    return kwargs


def tiny_id(token: str) -> int:
    return TOKEN_IDS.get(token) or tiny.SPECIAL_TOKENS.index(token)


def examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per conversation."""
    out = []
    for c in conversations():
        prompt = tokenizer.apply_chat_template(
            c["messages"], tools=TOOLS, add_generation_prompt=True,
            enable_thinking=c["enable_thinking"], tokenize=False)
        out.append((tokenizer(prompt, add_special_tokens=False).input_ids,
                    tokenizer(c["answer"], add_special_tokens=False).input_ids))
    return out


def train(tokenizer, seed: int = 0, margin: float = 2.0, max_steps: int = 300,
          lr: float = 5e-3, log=None):
    """A transformers Gemma4ForCausalLM (fp32, eval mode, bf16-representable
    values, linears on the q4_0 grid) whose greedy answer to every prompt of
    `examples` is its answer, each answer token ahead of the runner-up by at
    least `margin` logits. Returns (model, {module name: (q, d)}, steps)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    config = Gemma4TextConfig(**text_config_kwargs())
    config.architectures = ["Gemma4ForCausalLM"]
    config._attn_implementation = "sdpa"  # 2x eager's speed here
    model = Gemma4ForCausalLM(config)
    data = examples(tokenizer)
    width = max(len(p) + len(a) for p, a in data)
    ids = torch.zeros(len(data), width, dtype=torch.long)
    labels = torch.full((len(data), width), -100)
    attention = torch.zeros(len(data), width, dtype=torch.long)
    for row, (prompt, answer) in enumerate(data):
        seq = prompt + answer
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        # Position t predicts token t + 1: the answer's tokens.
        labels[row, len(prompt) - 1:len(seq) - 1] = torch.tensor(answer)
    linears = [n + ".weight" for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("model.")]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max_steps)
    on_grid, steps = False, 0
    while steps < max_steps:
        model.train()
        params = dict(model.named_parameters())
        if on_grid:  # straight through: q4_0 forward, float gradients
            params.update({n: params[n] + (q4_0(params[n].detach())[0]
                                           - params[n]).detach()
                           for n in linears})
        logits = torch.func.functional_call(
            model, params, (), dict(input_ids=ids,
                                    attention_mask=attention)).logits
        mask = labels >= 0
        picked = logits[mask]
        target = labels[mask]
        loss = torch.nn.functional.cross_entropy(picked, target)
        right = picked.gather(1, target[:, None])[:, 0]
        others = picked.scatter(1, target[:, None], float("-inf"))
        margins = right - others.max(1).values
        worst = margins.min().item()
        if log:
            at = mask.nonzero()[margins.argmin()].tolist()
            log(f"step {steps} grid={on_grid} loss {loss.item():.4f} "
                f"min margin {worst:.2f} at {at}")
        if worst >= margin:
            if on_grid:
                break
            on_grid = True  # now hold the linears on the q4_0 grid
            continue
        optimizer.zero_grad()
        # The margin hinge keeps pushing tokens that are right but close.
        (loss + torch.relu(margin + 1 - margins).mean()).backward()
        optimizer.step()
        schedule.step()
        steps += 1
    else:
        raise RuntimeError(f"agent model: min margin {worst:.2f} < {margin} "
                           f"after {max_steps} steps")
    grid = _round_to_grid(model)
    return model.eval(), grid, steps


def q4_0(w):
    """`w` [out, in] rounded to the q4_0 grid: per 32 input columns d =
    peak / 7 with 4 significant bits, q = round(w / d) in [-8, 7], so every
    d * q (at most 8 significant bits) is exact in bf16. Returns (q * d, q,
    d) with q and d per group [out, in / 32, 32] and [out, in / 32, 1]."""
    import torch
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // 32, 32)
    d = g.abs().amax(-1, keepdim=True).clamp_min(2.0**-100) / 7
    exponent = torch.floor(torch.log2(d)) - 3
    d = torch.round(d / 2**exponent) * 2**exponent
    q = torch.clamp(torch.round(g / d), -8, 7)
    return (q * d).reshape(out_f, in_f), q, d


def _round_to_grid(model) -> dict:
    """Put the linears on the q4_0 grid and every parameter on bf16 values;
    {checkpoint module name: (q int8 [out, in], d bf16 [out, in / 32])} of
    the linears, as tiny.put_on_int4_grid returns."""
    import torch

    from vllm_gemma_qat import int4
    grid = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, m in model.named_modules():
            if not (isinstance(m, torch.nn.Linear) and name.startswith("model.")):
                continue
            w, q, d = q4_0(m.weight)
            m.weight.copy_(w)
            grid["model.language_model." + name[len("model."):]] = (
                q.reshape(w.shape).to(torch.int8).numpy(),
                d[..., 0].numpy().astype(int4.BF16))
    return grid


# torch chooses its CPU kernels by instruction set (ATen's vectorized loops,
# MKL's GEMM, oneDNN), so two x86 CPUs sum in different orders and the
# same float32 training differs in its last bits; the straight-through q4_0
# rounding turns such bits into other weights, i.e. another model (another
# machine: other logprob drifts, an fp8 element on the other side of a
# rounding boundary). The training process pins every choice to AVX2 code
# paths, which every x86-64 CPU CI may run on has, with one thread.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1",
                  "MKL_NUM_THREADS": "1"}


def trained(seed: int = 0, log=None) -> Path:
    """The trained model in the machine's model cache (`model_cache`):
    `reference/` (transformers' format, fp32, eval) and `grid.safetensors`
    (the linears' q4_0 `q` and `d`, as `train` returns them). Trained when
    missing, stale or corrupt, by `train` in a process with
    `PINNED_KERNELS` (torch reads them when it starts); keyed by this
    file's, tiny.py's and int4.py's source, the seed, the pinned kernels
    and the torch / transformers versions."""
    import functools
    import os
    import subprocess
    import sys

    from vllm_gemma_qat import int4
    from vllm_gemma_qat.cpu.lifetime import die_with_parent
    from vllm_gemma_qat.testing import model_cache
    key = {"trainer": model_cache.source_digest(__file__, tiny.__file__,
                                                int4.__file__),
           "seed": seed, "pinned_kernels": PINNED_KERNELS,
           **model_cache.versions()}

    def build(directory: Path):
        command = [sys.executable, "-m", __name__, str(directory), "--seed",
                   str(seed)] + (["--log"] if log else [])
        subprocess.run(command, check=True,
                       env={**os.environ, **PINNED_KERNELS},
                       preexec_fn=functools.partial(die_with_parent,
                                                    os.getpid()))

    return model_cache.entry("agent", key, build, log=log)


def save_servable(path: str | Path, form: str | None = None, seed: int = 0,
                  log=None):
    """Write a model directory `vllm serve` accepts from the `trained`
    model: the QAT export (form None: bf16 values; "q4_0" / "w4a16":
    tiny.py's int4 forms), the tokenizer and a generation config whose stop
    tokens include `<turn|>` and `<|tool_response>`. Returns the trained
    transformers model (fp32, eval mode)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import Gemma4ForCausalLM

    from vllm_gemma_qat import int4
    entry = trained(seed, log)
    model = Gemma4ForCausalLM.from_pretrained(
        entry / "reference", dtype=torch.float32).eval()
    save_tokenizer(path)
    if form is None:
        tiny.save_checkpoint(model, path, layout="qat", dtype=None)
    else:
        arrays = load_file(entry / "grid.safetensors")
        grid = {name[:-len(".q")]: (arrays[name],
                                    arrays[name[:-1] + "d"].astype(int4.BF16))
                for name in arrays if name.endswith(".q")}
        tiny.save_int4_checkpoint(model, path, grid, form)
    save_tokenizer(path)  # save_pretrained rewrote the directory's files
    Path(path, "generation_config.json").write_text(json.dumps({
        "bos_token_id": 2, "pad_token_id": 0,
        "eos_token_id": [tiny_id(t) for t in STOP]}))
    return model


def _train_into(directory: str | Path, seed: int, log=None):
    """`train`, written as `trained` reads it."""
    import numpy as np
    from safetensors.numpy import save_file
    tokenizer = save_tokenizer(Path(directory) / "tokenizer")
    model, grid, _ = train(tokenizer, seed, log=log)
    model.save_pretrained(Path(directory) / "reference")
    arrays = {}
    for name, (q, d) in grid.items():
        arrays[name + ".q"] = np.ascontiguousarray(q)
        arrays[name + ".d"] = d.astype(np.float32)  # bf16 values: exact
    save_file(arrays, Path(directory) / "grid.safetensors")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=_train_into.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true")
    args = parser.parse_args()
    _train_into(args.directory, args.seed, log=print if args.log else None)

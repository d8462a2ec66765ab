"""A tiny Gemma 4 assistant (MTP drafter) for a tiny target, and the
reference draft-and-verify loop that tpu-inference's drafter runs.

transformers' `Gemma4AssistantForCausalLM` (model_type `gemma4_assistant`):
every layer KV-shared and Q-only, reading the target's cache (the last
owner layer of each attention type); head dims, KV heads and window equal
the target's; `pre_projection` takes [target embedding of a token, target
hidden state] (2 x `backbone_hidden_size`), `post_projection` gives the next
step's hidden state.

How tpu-inference 0.32 feeds it (`spec_decode/jax/eagle3.py` with
`use_gemma4_mtp()`, `models/jax/gemma4_mtp.py`), per request after a target
step that accepted tokens up to position p and sampled the bonus token b at
p + 1:

- draft 1: token b, the target's final (normed) hidden state at p, query
  position p, the target's cache over positions 0..p;
- draft j > 1: token draft j-1, the previous draft step's `post_projection`
  output, the SAME position p and cache (constant draft positions).

`reference` replays that with transformers' modules (greedy, float64),
and counts what vLLM's spec-decode metrics count. (transformers' own
`Gemma4AssistantCandidateGenerator` feeds the assistant differently: its
query sits at the bonus token's position p + 1, over the target's K/V
sliced to the sequence length. vLLM's GPU `Gemma4Speculator`, like
tpu-inference, keeps the draft positions fixed: `advance_draft_positions`
is False. The reference follows tpu-inference, the implementation under
test.)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

ARCHITECTURE = "Gemma4AssistantForCausalLM"


def assistant_config(target_text: dict, hidden_size: int = 64,
                     intermediate_size: int = 128,
                     use_ordered_embeddings: bool = False,
                     num_centroids: int = 16,
                     centroid_intermediate_top_k: int = 4, **text_overrides):
    """A `Gemma4AssistantConfig` for a target with text config `target_text`
    (a dict): one sliding and one full layer, both KV-shared, the target's
    head dims, KV heads, window, vocabulary and query heads."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig
    keep = ("vocab_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "global_head_dim", "sliding_window",
            "final_logit_softcapping", "rms_norm_eps", "max_position_embeddings",
            "attention_bias", "attention_k_eq_v", "bos_token_id",
            "eos_token_id", "pad_token_id", "rope_parameters",
            "num_global_key_value_heads")
    text = {k: target_text[k] for k in keep if target_text.get(k) is not None}
    # The full-attention layers' head dim / KV heads (kept per layer by
    # transformers >= 5.15) are the target's, from its geometry.
    from vllm_gemma_qat.geometry import Geometry
    geo = Geometry.from_text_config(target_text)
    full = geo.layer_types.index("full_attention")
    text.update(global_head_dim=geo.head_dim(full),
                num_global_key_value_heads=geo.kv_heads(full))
    text.update(hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=2, num_kv_shared_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                use_double_wide_mlp=False, enable_moe_block=False,
                tie_word_embeddings=True)
    text.update(text_overrides)
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**text).to_dict(),
        backbone_hidden_size=target_text["hidden_size"],
        use_ordered_embeddings=use_ordered_embeddings,
        num_centroids=num_centroids,
        centroid_intermediate_top_k=centroid_intermediate_top_k,
        tie_word_embeddings=True)
    config.architectures = [ARCHITECTURE]
    return config


def build(target_text: dict, seed: int = 0, **kwargs):
    """A random assistant for the target (fp32, eval mode)."""
    import torch
    from transformers import Gemma4AssistantForCausalLM
    torch.manual_seed(seed)
    config = assistant_config(target_text, **kwargs)
    config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
        if model.masked_embedding is not None:
            v = config.get_text_config().vocab_size
            model.masked_embedding.token_ordering.copy_(
                torch.randperm(v, generator=torch.Generator().manual_seed(seed)))
    return model.eval()


def save(model, path: str | Path, dtype=None) -> Path:
    """`model` as a checkpoint directory (transformers' own layout and
    config.json), its values as `dtype` (default: as held)."""
    path = Path(path)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def target_text_config(target_dir: str | Path) -> dict:
    config = json.loads(Path(target_dir, "config.json").read_text())
    return config.get("text_config") or config


# ---------------------------------------------------------------------------
# The target's side: what the drafter reads.

def target_states(target, ids: list[int]):
    """The target over `ids` (no cache): final normed hidden states [T, H],
    the K/V its KV-shared layers read per attention type ({type: (K, V)},
    [1, KV heads, T, head dim], post-norm and RoPE), and greedy next tokens
    [T]."""
    import torch
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids]),
                           return_shared_kv_states=True)
        logits = target.lm_head(out.last_hidden_state)
    kv = {k: (v[0], v[1]) for k, v in out.shared_kv_states.items()}
    return out.last_hidden_state[0], kv, logits[0].argmax(-1).tolist(), logits[0]


def _left_padded(kv: dict, ends: list[int], width: int,
                 window: int) -> tuple[dict, object]:
    """K/V of each state's positions 0..end (inclusive) moved to the END of
    a `width`-long axis (transformers' assistant masks assume left padding:
    it takes a sliding window's entries from the end), batched, and the
    [B, width] attention mask. The sliding layers' K/V are cut to the last
    `window` positions (end - window + 1 .. end), a `window`-long axis:
    tpu-inference's drafter reads those `window` keys (the query's position
    counted, as the target's own sliding layers do), while transformers'
    assistant mask lets a query see `window` + 1 (measured: its output over
    the whole K/V equals that over the last window + 1 entries only)."""
    import torch
    batch = {}
    for kind, (k, v) in kv.items():
        size = min(width, window) if kind == "sliding_attention" else width
        ks, vs = [], []
        for end in ends:
            n = min(end + 1, size)
            pad = (0, 0, size - n, 0)
            ks.append(torch.nn.functional.pad(k[0, :, end + 1 - n:end + 1],
                                              pad))
            vs.append(torch.nn.functional.pad(v[0, :, end + 1 - n:end + 1],
                                              pad))
        batch[kind] = (torch.stack(ks), torch.stack(vs))
    mask = torch.zeros(len(ends), width, dtype=torch.long)
    for row, end in enumerate(ends):
        mask[row, width - end - 1:] = 1
    return batch, mask


class DraftInputs(NamedTuple):
    """What the drafter's first step reads for a batch of states, row by
    row: query positions [B, 1], bonus tokens [B, 1], the target's hidden
    states at those positions [B, 1, H], the target's K/V per attention
    type (`_left_padded`) and the [B, width] attention mask."""
    positions: object
    tokens: object
    hidden: object
    shared: dict
    mask: object

    @classmethod
    def of(cls, assistant, states: list[tuple[int, int]], hidden, kv,
           width: int) -> "DraftInputs":
        """For states (position p, bonus token b) of one sequence, whose
        target hidden states and K/V are `hidden` and `kv`."""
        import torch
        positions = torch.tensor([[p] for p, _ in states])
        shared, mask = _left_padded(
            kv, [p for p, _ in states], width,
            assistant.config.get_text_config().sliding_window)
        return cls(positions, torch.tensor([[b] for _, b in states]),
                   hidden[positions[:, 0]][:, None], shared, mask)

    @classmethod
    def cat(cls, batches: list["DraftInputs"]) -> "DraftInputs":
        """One batch of the rows of `batches` (of one `width`)."""
        import torch
        shared = {kind: tuple(torch.cat([b.shared[kind][i] for b in batches])
                              for i in range(2))
                  for kind in batches[0].shared}
        return cls(*(torch.cat([getattr(b, f) for b in batches])
                     for f in ("positions", "tokens", "hidden")),
                   shared, torch.cat([b.mask for b in batches]))


def draft_steps(assistant, target, states: list[tuple[int, int]], hidden,
                kv, tokens_in, k: int, width: int, parts: bool = False):
    """The drafter's k steps for a batch of states (position p, bonus token
    b), as tpu-inference runs them: step 1 reads [embedding of b, target
    hidden at p], steps > 1 [embedding of the previous step's token (from
    `tokens_in(step, logits)`), the previous step's post_projection
    output]; every step at position p over the target's K/V 0..p. Returns
    the k logits [B, V] (masked to the top centroids' tokens under
    `use_ordered_embeddings`); `parts`: per step (those logits, the lm_head's
    logits over the whole vocabulary, the centroid logits or None)."""
    return run_drafts(assistant, target,
                      DraftInputs.of(assistant, states, hidden, kv, width),
                      tokens_in, k, parts)


def run_drafts(assistant, target, inputs: DraftInputs, tokens_in, k: int,
               parts: bool = False):
    """`draft_steps` on prepared inputs."""
    normed = []  # the text model's final norm: what lm_head and centroids read
    hook = assistant.model.norm.register_forward_hook(
        lambda module, args, output: normed.append(output[:, 0]))
    try:
        out = _draft_steps(assistant, target, inputs, tokens_in, k)
    finally:
        hook.remove()
    if not parts:
        return out
    masked = assistant.masked_embedding
    return [(lg, assistant.lm_head(n),
             masked.centroids(n) if masked is not None else None)
            for lg, n in zip(out, normed)]


def _draft_steps(assistant, target, inputs: DraftInputs, tokens_in, k):
    import torch
    embed = target.model.embed_tokens
    token, h = inputs.tokens, inputs.hidden  # [B, 1], [B, 1, H]
    out = []
    for step in range(k):
        x = torch.cat([embed(token).to(h.dtype), h], -1)
        r = assistant(inputs_embeds=x, position_ids=inputs.positions,
                      attention_mask=inputs.mask,
                      shared_kv_states=inputs.shared)
        logits = r.logits[:, 0]
        out.append(logits)
        h = r.last_hidden_state
        token = tokens_in(step, logits)[:, None]
    return out


def reference(target, assistant, prompt: list[int], max_tokens: int, k: int,
              stop: set[int]):
    """Greedy draft-and-verify as vLLM with tpu-inference's Gemma 4 MTP
    drafter runs it, with transformers' target and assistant: the target's
    tokens, and per target step the drafts proposed and how many of them the
    target accepted (vLLM counts a step's drafts and acceptances before
    cutting its tokens at a stop token or max_tokens)."""
    import torch
    ids = list(prompt)
    hidden, kv, greedy, _ = target_states(target, ids)
    ids.append(greedy[-1])  # the prefill's token
    out, steps = [ids[-1]], []
    while not (out[-1] in stop or len(out) >= max_tokens):
        p = len(ids) - 2
        with torch.no_grad():
            logits = draft_steps(assistant, target, [(p, ids[-1])], hidden,
                                 kv, lambda s, lg: lg.argmax(-1), k,
                                 p + 1)
        drafts = [int(lg[0].argmax()) for lg in logits]
        hidden, kv, greedy, _ = target_states(target, ids + drafts)
        accepted = 0
        for j, d in enumerate(drafts):
            if greedy[p + 1 + j] != d:
                break
            accepted += 1
        new = drafts[:accepted] + [greedy[p + 1 + accepted]]
        steps.append((k, accepted))
        ids += new
        for t in new:
            if out[-1] in stop or len(out) >= max_tokens:
                break
            out.append(t)
        hidden, kv, greedy, _ = target_states(target, ids)
    return out, steps


# ---------------------------------------------------------------------------
# Training: an assistant whose every draft, on every state the target's
# trained answers can put it in, is decided by a clear margin, and agrees
# with the target by design on some drafts only (so speculation sees full
# acceptance, partial acceptance and rejection).

DRAFT_STEPS = 4  # the most num_speculative_tokens the tests use


def draft_labels(seq: list[int], prompt_len: int, target_logits, index: int,
                 steps: int = DRAFT_STEPS) -> list[tuple[int, int, list[int]]]:
    """(position p, bonus token, per step the token to draft) for every
    state of `seq` (prompt + the target's greedy answer, ending on a stop
    token): p from the last prompt position on. State r of sequence
    `index` drafts the target's next tokens (accepted) by pattern
    (r + index) % 3: 0 all steps, 1 the first step only, 2 none; a draft
    meant to be rejected is the target's LEAST likely token there, so the
    target's greedy choice never takes it whatever the rounding."""
    n = len(seq)
    worst = target_logits.argmin(-1).tolist()
    out = []
    for r, p in enumerate(range(prompt_len - 1, n - 1)):
        pattern = (r + index) % 3
        labels = []
        for j in range(1, steps + 1):
            t = p + 1 + j  # the position this draft fills
            right = t < n and (pattern == 0 or (pattern == 1 and j == 1))
            # Once a draft is meant to be rejected, the later ones are too.
            right = right and all(lab == seq[p + 1 + i + 1] for i, lab in
                                  enumerate(labels))
            labels.append(seq[t] if right else worst[min(t - 1, n - 1)])
        out.append((p, seq[p + 1], labels))
    return out


GROUPED_EAGER = "grouped_eager"


def _grouped_eager_attention(module, query, key, value, attention_mask,
                             dropout=0.0, scaling=None, softcap=None,
                             **kwargs):
    """transformers' Gemma 4 eager attention (`eager_attention_forward`:
    the same products, the cap, the mask added, softmax in float32, its
    dropout), with each KV head's query heads grouped over it instead of the
    K/V repeated per query head. `train` runs every state of its sequences
    in one batch, each with its own copy of the target's K/V: repeat_kv's
    and the transpose's copies of those were most of a training step."""
    import torch
    b, heads, q_len, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    query = query.reshape(b, kv_heads, heads // kv_heads * q_len, dim)
    scores = (key @ query.transpose(2, 3)).transpose(2, 3) * (
        module.head_dim**-0.5 if scaling is None else scaling)
    scores = scores.reshape(b, heads, q_len, width)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.nn.functional.softmax(scores, dim=-1,
                                          dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout,
                                          training=module.training)
    out = weights.reshape(b, kv_heads, heads // kv_heads * q_len, width) @ value
    return out.reshape(b, heads, q_len, dim).transpose(1, 2).contiguous(), \
        weights


def _register_grouped_eager() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(GROUPED_EAGER, _grouped_eager_attention)
    AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)
    return GROUPED_EAGER


def _e4m3(x):
    import torch
    info = torch.finfo(torch.float8_e4m3fn)
    return x.clamp(info.min, info.max).to(torch.float8_e4m3fn).to(
        torch.float64)


def train(target, sequences: list[tuple[list[int], list[int]]], seed: int = 0,
          margin: float = 3.0, max_steps: int = 1500, lr: float = 3e-2,
          log=None, **config):
    """An assistant for `target` (a transformers Gemma4ForCausalLM whose
    greedy answers to `sequences`' prompts are their answers), trained in
    float64 on the CPU, deterministically, until every draft of
    `draft_labels` wins by `margin` logits with its values rounded to bf16,
    on the target's exact inputs and on rounded ones (bf16 activations,
    float8_e4m3fn K/V).
    Returns (assistant in float64 holding bf16 values, labels per sequence,
    steps)."""
    import copy

    import torch
    torch.manual_seed(seed)
    target64 = copy.deepcopy(target).to(torch.float64).eval()
    target_bf16 = copy.deepcopy(target).to(torch.bfloat16).eval()
    text = target64.config.get_text_config().to_dict()
    model = build(text, seed, **config).to(torch.float64)
    model.set_attn_implementation(_register_grouped_eager())
    per_seq, batches = [], []
    width = max(len(p) + len(a) for p, a in sequences)
    for index, (prompt, answer) in enumerate(sequences):
        seq = prompt + answer
        hidden, kv, greedy, logits = target_states(target64, seq)
        if greedy[len(prompt) - 1:-1] != answer:
            raise ValueError(f"sequence {index}: the target's greedy answer "
                             "is not the given one")
        labels = draft_labels(seq, len(prompt), logits, index)
        per_seq.append(labels)
        batches.append((hidden, kv, labels))
        # What a served target hands the drafter is rounded: its hidden
        # states computed in bf16, its K/V stored in bf16 or fp8. The drafts
        # must win by the margin on those inputs too (the roughest: bf16
        # activations, K/V rounded to float8_e4m3fn).
        rough_hidden, rough_kv, _, _ = target_states(target_bf16, seq)
        batches.append((rough_hidden.to(torch.float64),
                        {t: tuple(_e4m3(x) for x in v)
                         for t, v in rough_kv.items()}, labels))
    # Every batch's states in one batch; each row weighted 1 / its batch's
    # size, so the loss is the sum of the batches' mean losses.
    inputs = DraftInputs.cat([
        DraftInputs.of(model, [(p, b) for p, b, _ in labels], hidden, kv,
                       width) for hidden, kv, labels in batches])
    want = torch.tensor([lab for _, _, labels in batches
                         for _, _, lab in labels])  # [B, steps]
    weight = torch.cat([torch.full((len(labels),), 1 / len(labels),
                                   dtype=torch.float64)
                        for _, _, labels in batches])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    cluster = None
    if model.masked_embedding is not None:  # token -> its centroid
        per = text["vocab_size"] // model.config.num_centroids
        cluster = torch.empty(text["vocab_size"], dtype=torch.long)
        cluster[model.masked_embedding.token_ordering] = torch.arange(
            text["vocab_size"]) // per
        top_k = model.config.centroid_intermediate_top_k

    def hinge(logits, want, rank: int = 1):
        """CE and hinge pushing `want` ahead of the `rank`-th best other
        by `margin`; the smallest such gap."""
        right = logits.gather(1, want[:, None])[:, 0]
        others = logits.scatter(1, want[:, None], float("-inf"))
        gap = right - others.topk(rank, 1).values[:, -1]
        loss = torch.nn.functional.cross_entropy(
            logits, want, reduction="none") + torch.relu(margin + 1 - gap)
        return gap.min().detach(), (weight * loss).sum()

    def margins(m, grad: bool):
        worst, total = [], 0.0
        with torch.set_grad_enabled(grad):
            steps = run_drafts(m, target64, inputs,
                               lambda s, lg: want[:, s], DRAFT_STEPS,
                               parts=True)
            for s, (_, full, centroids) in enumerate(steps):
                # The token wins over the whole vocabulary, and (centroid
                # masking) its centroid is among the top_k chosen.
                gap, loss = hinge(full, want[:, s])
                worst.append(gap)
                total = total + loss
                if centroids is not None:
                    gap, loss = hinge(centroids, cluster[want[:, s]], top_k)
                    worst.append(gap)
                    total = total + loss
        return min(worst).item(), total

    steps = 0
    while steps < max_steps:
        model.train()
        worst, loss = margins(model, True)
        if log and steps % 50 == 0:
            log(f"assistant step {steps} loss {loss.item():.4f} min margin "
                f"{worst:.2f}")
        if worst >= margin + 0.5:
            rounded = copy.deepcopy(model).eval()
            with torch.no_grad():
                for p in rounded.parameters():
                    p.copy_(p.to(torch.bfloat16).to(torch.float64))
            if margins(rounded, False)[0] >= margin:
                return rounded, per_seq, steps
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    raise RuntimeError(f"assistant: min margin {worst:.2f} < {margin} after "
                       f"{max_steps} steps")


def save_target(root: str | Path, form: str | None = None, seed: int = 0,
                log=None):
    """testing/agent.py's tiny target, trained as `agent.save_servable`
    trains it (a process with torch's CPU kernels pinned: the same model on
    every x86 CPU), written under root/target-FORM as the export `form`
    (None: the QAT bf16 export, in target-bf16; "regular": the regular
    export, shared layers' unused K/V included; "q4_0" / "w4a16":
    agent.py's int4 forms). Returns (target, requests as (prompt ids,
    answer ids)): its conversations, and three of them continued from
    part-way through its three longest answers."""
    from transformers import AutoTokenizer

    from vllm_gemma_qat.testing import agent, tiny
    path = Path(root) / f"target-{form or 'bf16'}"
    int4 = form if form in ("q4_0", "w4a16") else None
    target = agent.save_servable(path, int4, seed, log=log)
    if form == "regular":  # the same values, plus the unused shared K/V
        tiny.save_checkpoint(target, path, layout="regular", dtype=None)
        agent.save_tokenizer(path)
    requests = agent.examples(AutoTokenizer.from_pretrained(path))
    longest = sorted(requests, key=lambda r: -len(r[1]))[:3]
    requests += [(p + a[:m], a[m:]) for (p, a), m in zip(longest, (2, 5, 3))]
    return target, requests


def save_trained(path: str | Path, target, requests, seed: int = 0,
                 log=None, **config):
    """`train` an assistant for `target` on the agent conversations (the
    first five of `save_target`'s requests; the other three pass through
    the same states) and write it in bf16 to `path`. Returns it in float64
    (holding the same bf16 values). Trained once per machine: kept in
    `model_cache`, keyed by this file's and geometry.py's source, the
    target's tensors and config, the conversations, the seed and
    `config`."""
    import json
    import shutil

    import torch
    from transformers import Gemma4AssistantForCausalLM

    from vllm_gemma_qat import geometry
    from vllm_gemma_qat.testing import model_cache
    key = {"trainer": model_cache.source_digest(__file__, geometry.__file__),
           "target": model_cache.tensor_digest(target),
           # assistant_config copies token ids, RoPE and more from it.
           "target_config": json.loads(target.config.to_json_string()),
           "requests": [list(map(list, r)) for r in requests[:5]],
           "seed": seed, "config": config, **model_cache.versions()}

    def build(directory: Path):
        helper, _, _ = train(target, requests[:5], seed, log=log, **config)
        save(helper, directory, dtype=torch.bfloat16)

    entry = model_cache.entry("assistant", key, build, log=log)
    shutil.copytree(entry, path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(model_cache.MANIFEST))
    # As `train` returns it, saved in bf16, then widened (`Module.to` casts
    # the RoPE buffers too): the same values, buffers included.
    helper = Gemma4AssistantForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager")
    return helper.to(torch.bfloat16).to(torch.float64).eval()


def stop_tokens() -> set[int]:
    from vllm_gemma_qat.testing import agent
    return {agent.tiny_id(t) for t in agent.STOP}

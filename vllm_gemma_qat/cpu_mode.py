"""Opt-in CPU mode: run tpu-inference's JAX model on JAX's CPU backend.

Only what is TPU-only is substituted: the Pallas ragged-paged-attention
kernel, by `paged_attention` below (pure JAX, same cache layout, same
`update_kv_cache` / sliding-window / soft-cap semantics), tokamax's int4
`gmm_v2` (by `cpu_gmm.gmm`), the device mesh (built from the CPU device),
the device-memory size, the TPU-only compiler options and the aliasing of
host buffers by `device_put` (see `enable`). `load` builds the model through tpu-inference's
own `get_model`; `PagedRunner` drives it as the TPU runner does (paged cache,
shared layers on their source layer's cache). For tests and the demo;
`install_attention()` refuses to run when JAX sees a TPU.
"""
from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger(__name__)


def paged_attention(mesh, q, k, v, kv_cache, kv_lens, page_indices,
                    cu_q_lens, distribution, attention_sink, sm_scale,
                    attention_chunk_size=None, q_scale=None, k_scale=None,
                    v_scale=None, update_kv_cache=True, use_causal_mask=True,
                    attn_logits_soft_cap=None, decode_query_size=1):
    """Drop-in for `attention_interface.sharded_ragged_paged_attention` on a
    one-device mesh. Returns (output (T, N, H), updated kv_cache)."""
    import jax
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv

    if attention_sink is not None or q_scale is not None:
        raise NotImplementedError("CPU paged attention: sinks / q_scale")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_pages, page_size = kv_cache.shape[:2]
    padded_head_dim = kv_cache.shape[-1]
    max_num_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_num_seqs
    num_seqs = distribution[-1]

    # Which sequence each query token belongs to, and its absolute position.
    # Only the first num_seqs entries of cu_q_lens / kv_lens are meaningful
    # (the runner's persistent buffers keep stale values past them).
    t = jnp.arange(num_tokens)
    live = jnp.arange(max_num_seqs) < num_seqs
    seq = jnp.minimum(
        ((t[:, None] >= cu_q_lens[None, 1:]) & live[None, :]).sum(axis=1),
        max_num_seqs - 1)
    valid = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])

    # Cache rows: [slot, kv_head * 2 (+pad), head_dim]; k at even, v at odd.
    slots = kv_cache.reshape(num_pages * page_size, -1, padded_head_dim)
    if update_kv_cache:
        new = merge_kv(k, v).reshape(num_tokens, -1, padded_head_dim)
        page = page_indices[seq * pages_per_seq + pos // page_size]
        slot = jnp.where(valid, page * page_size + pos % page_size,
                         num_pages * page_size)  # out of range: dropped
        slots = slots.at[slot].set(new.astype(slots.dtype), mode="drop")

    ctx = jnp.arange(pages_per_seq * page_size)
    ctx_pages = page_indices[seq[:, None] * pages_per_seq + ctx // page_size]
    kv = slots[ctx_pages * page_size + ctx % page_size]  # [T, C, 2K', H']
    # fp32 math: XLA:CPU has no bf16 x bf16 -> f32 dot.
    keys = kv[:, :, 0:2 * num_kv_heads:2, :head_dim].astype(jnp.float32)
    values = kv[:, :, 1:2 * num_kv_heads:2, :head_dim].astype(jnp.float32)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgh,tckh->tkgc", qg.astype(jnp.float32), keys,
                        preferred_element_type=jnp.float32) * sm_scale
    if k_scale is not None:
        scores = scores * k_scale
    if attn_logits_soft_cap is not None:
        scores = attn_logits_soft_cap * jnp.tanh(scores / attn_logits_soft_cap)
    mask = (ctx[None, :] < kv_lens[seq][:, None]) & valid[:, None]
    if use_causal_mask:
        mask &= ctx[None, :] <= pos[:, None]
        if attention_chunk_size is not None:
            mask &= pos[:, None] - ctx[None, :] < attention_chunk_size
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    out = jnp.einsum("tkgc,tckh->tkgh", probs, values)
    if v_scale is not None:
        out = out * v_scale
    out = out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
    return out, slots.reshape(kv_cache.shape)


CPU_MODE_ENV = "VLLM_GEMMA_QAT_CPU_MODE"
CPU_MEMORY_ENV = "VLLM_GEMMA_QAT_CPU_MEMORY_GIB"  # the "HBM" the CPU offers


def requested() -> bool:
    return os.environ.get(CPU_MODE_ENV, "") == "1"


def enable() -> None:
    """Let `vllm serve` run through tpu-inference's runner on JAX's CPU
    backend: replaces the Pallas attention kernel, builds the device mesh
    from CPU devices (tpu-inference sorts devices by TPU coordinates), gives
    the CPU a device-memory size (tpu-inference looks it up by TPU kind), and
    drops the TPU-only XLA compiler options from the step / sampling jits."""
    _refuse_on_tpu()
    # First, before the modules that read them at import (sampling's jit).
    from tpu_inference.models.common import compiler_options
    compiler_options.get_step_fn_compiler_options = dict
    compiler_options.get_sampling_compiler_options = dict
    install_attention()
    from vllm_gemma_qat import cpu_gmm
    cpu_gmm.install()  # int4 (wNa16) matmul: tokamax gmm_v2 is TPU-only
    from tpu_inference import utils
    from tpu_inference.runner import tpu_runner
    tpu_runner.make_optimized_mesh = cpu_mesh
    # On TPU, device_put copies host arrays into HBM. On the CPU backend it
    # may alias the numpy buffer, which the runner refills for the next step
    # while the last one still runs: copy first.
    utils.general_device_put = _copying(utils.general_device_put)
    # CPU devices report no memory stats and no TPU kind; tpu-inference then
    # sizes the KV cache from live arrays against a per-kind HBM limit.
    budget = int(float(os.environ.get(CPU_MEMORY_ENV, "0.1")) * 2**30)
    utils.get_device_hbm_limit = lambda: budget
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.models.common import model_loader
    from tpu_inference.runner import decode_loop
    for module in (model_loader, decode_loop, sampling):
        for name in ("get_step_fn_compiler_options",
                     "get_sampling_compiler_options"):
            if hasattr(module, name):
                setattr(module, name, dict)
    logger.warning(
        "vllm-gemma-qat CPU mode (%s=1): tpu-inference runs on JAX's CPU "
        "backend with a pure-JAX paged attention and int4 matmul, a CPU "
        "device mesh and no TPU compiler options. For tests and demos only.",
        CPU_MODE_ENV)


def _copying(device_put):

    def put(tensor, *args, **kwargs):
        import jax
        tensor = jax.tree_util.tree_map(
            lambda t: np.array(t, copy=True) if isinstance(t, np.ndarray) else t,
            tensor)
        return device_put(tensor, *args, **kwargs)

    return put


def cpu_mesh(axis_shapes, axis_names, *, devices=None):
    """`make_optimized_mesh` for CPU devices, which have no TPU coords."""
    import jax
    devices = list(devices if devices is not None else jax.devices())
    n = int(np.prod(axis_shapes))
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(axis_shapes),
                             tuple(axis_names))


def install_attention() -> None:
    """Route tpu-inference's attention through `paged_attention`."""
    _refuse_on_tpu()
    from tpu_inference.layers.common import attention_interface
    if attention_interface.sharded_ragged_paged_attention is not paged_attention:
        attention_interface.sharded_ragged_paged_attention = paged_attention
        logger.warning("vllm-gemma-qat CPU mode: Pallas ragged paged attention "
                       "replaced by a pure-JAX paged attention")


def _refuse_on_tpu() -> None:
    # Decided from the environment, not jax.devices(): initialising a JAX
    # backend in vLLM's API server before it starts the engine is unsafe.
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        raise RuntimeError("vllm-gemma-qat CPU mode needs JAX_PLATFORMS=cpu; "
                           "it must never be active on a TPU")


PAGE_SIZE = 16
MAX_MODEL_LEN = 256


def mesh():
    import jax
    from jax.sharding import Mesh
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES
    devices = np.array(jax.devices()[:1]).reshape((1, ) * len(MESH_AXIS_NAMES))
    return Mesh(devices, MESH_AXIS_NAMES)


def vllm_config(path, load_format: str, dtype: str = "float32",
                hf_overrides: dict | None = None):
    from vllm.config import LoadConfig, ModelConfig, VllmConfig
    model_config = ModelConfig(model=str(path), dtype=dtype,
                               skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN,
                               hf_overrides=hf_overrides or {})
    return VllmConfig(model_config=model_config,
                      load_config=LoadConfig(load_format=load_format))


def load(path, load_format: str, dtype: str = "float32",
         hf_overrides: dict | None = None):
    """(ModelInterface, VllmConfig, mesh) through tpu-inference's get_model."""
    import jax
    from tpu_inference.distributed import jax_parallel_state
    from tpu_inference.models.common import model_loader
    from vllm.config import set_current_vllm_config
    jax_parallel_state.init_pp_distributed_environment("127.0.0.1", 0, 1, None,
                                                       need_pp=False)
    config = vllm_config(path, load_format, dtype, hf_overrides)
    m = mesh()
    with set_current_vllm_config(config), jax.set_mesh(m):
        model = model_loader.get_model(config, jax.random.PRNGKey(0), m)
    return model, config, m


class PagedRunner:
    """One sequence through prefill + decode, as the TPU runner would."""

    def __init__(self, model, config, mesh):
        import jax.numpy as jnp
        from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
            get_kv_cache_shape
        from tpu_inference.models.common.kv_share import compute_kv_share_map
        from tpu_inference.utils import get_layer_kv_params, get_padded_head_dim
        self.model, self.mesh = model, mesh
        text = config.model_config.hf_config.text_config
        share = compute_kv_share_map(text)
        own = [i for i in range(text.num_hidden_layers) if i not in share]
        self.num_pages = MAX_MODEL_LEN // PAGE_SIZE
        dtype = jnp.dtype(str(config.model_config.dtype).removeprefix("torch."))
        self.kv_caches = []
        for i in own:
            head_dim, kv_heads = get_layer_kv_params(text, text.layer_types[i])
            shape = get_kv_cache_shape(self.num_pages, PAGE_SIZE, kv_heads,
                                       get_padded_head_dim(head_dim), dtype)
            self.kv_caches.append(jnp.zeros(shape, dtype))
        index = {layer: n for n, layer in enumerate(own)}
        self.layer_to_cache = tuple(
            (f"layer.{i}", index[share.get(i, i)])
            for i in range(text.num_hidden_layers))
        self.seq_len = 0

    def step(self, token_ids) -> np.ndarray:
        """Feed `token_ids` (continuing the sequence); logits per token."""
        import jax
        import jax.numpy as jnp
        from tpu_inference.layers.common.attention_metadata import \
            AttentionMetadata
        n = len(token_ids)
        positions = jnp.arange(self.seq_len, self.seq_len + n, dtype=jnp.int32)
        self.seq_len += n
        md = AttentionMetadata(
            input_positions=positions,
            block_tables=jnp.arange(self.num_pages, dtype=jnp.int32),
            seq_lens=jnp.array([self.seq_len], jnp.int32),
            query_start_loc=jnp.array([0, n], jnp.int32),
            request_distribution=jnp.array([0, 0, 1], jnp.int32))
        m = self.model
        with jax.set_mesh(self.mesh):
            self.kv_caches, hidden, _, _ = m.model.step_fn_no_options(
                m.state_leaves, self.kv_caches,
                jnp.asarray(token_ids, jnp.int32), md, None, positions,
                self.layer_to_cache, None, None, True, True)
            logits = m.compute_logits_fn(m.state_leaves, hidden, None)
        return np.asarray(logits, np.float32)


def generate(runner: "PagedRunner", prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding through the paged cache."""
    logits = runner.step(prompt)
    out = []
    for _ in range(max_tokens):
        out.append(int(np.argmax(logits[-1])))
        logits = runner.step(out[-1:])
    return out

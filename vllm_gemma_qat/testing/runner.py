"""Build tpu-inference's model through its own `get_model` and drive it as
the TPU runner does (paged KV cache, shared layers on their source layer's
cache slot), on one CPU device. For tests and benchmarks."""
from __future__ import annotations

import numpy as np

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
        from tpu_inference.runner.utils import get_token_paddings
        from tpu_inference.utils import get_layer_kv_params, get_padded_head_dim
        self.model, self.mesh = model, mesh
        text = config.model_config.hf_text_config
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
        # The TPU runner's token buckets (its default minimum, 16).
        self.token_paddings = get_token_paddings(16, MAX_MODEL_LEN, 0)

    def step(self, token_ids) -> np.ndarray:
        """Feed `token_ids` (continuing the sequence); logits per token.
        Inputs are padded to the runner's token buckets as on a TPU (one
        compiled program per bucket, not per length)."""
        import jax
        import jax.numpy as jnp
        from tpu_inference.layers.common.attention_metadata import \
            AttentionMetadata
        from tpu_inference.runner.utils import get_padded_token_len
        n = len(token_ids)
        padded = get_padded_token_len(self.token_paddings, n)
        positions = jnp.arange(self.seq_len, self.seq_len + padded,
                               dtype=jnp.int32)
        token_ids = np.pad(np.asarray(token_ids, np.int32), (0, padded - n))
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
                jnp.asarray(token_ids), md, None, positions,
                self.layer_to_cache, None, None, True, True)
            logits = m.compute_logits_fn(m.state_leaves, hidden, None)
        return np.asarray(logits, np.float32)[:n]

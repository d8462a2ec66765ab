"""fixes/rejection_padding.py on tpu-inference's own greedy rejection
sampler: the draft tokens padded to the logits bucket must not count as the
last request's (which then lost its bonus token, #45)."""
import jax
import jax.numpy as jnp
import pytest

from vllm_gemma_qat.fixes import rejection_padding

VOCAB = 16
# Two requests: a prefill (no drafts), then the last slot's 4 drafts, all
# the target's tokens; two padding positions whose argmax differs from the
# padded draft ids.
DRAFTS = [5, 6, 7, 8, 0, 0]
TARGET = [5, 6, 7, 8, 3, 3]
BONUS = [9, 10]


def _sample(num_draft_tokens, bonus=BONUS):
    from tpu_inference.layers.jax.sample import rejection_sampler
    out = rejection_sampler._greedy_rejection_sample_with_segment(
        jnp.array(DRAFTS), jax.nn.one_hot(jnp.array(TARGET), VOCAB),
        jnp.array(num_draft_tokens), jnp.array(bonus))
    return out.tolist()[len(DRAFTS):]  # the bonus tokens, per request


@pytest.fixture
def serving(plugin, monkeypatch):
    def set_to(value: bool):
        monkeypatch.setattr(rejection_padding, "_serving_gemma_qat", value)
    return set_to


def test_the_last_request_keeps_its_bonus_token(serving):
    serving(False)  # stock tpu-inference 0.32: the padding is its drafts
    assert _sample([0, 4]) == [9, -1]
    serving(True)
    assert _sample([0, 4]) == [9, 10]
    # The same request first (the last slot padding-free): unchanged.
    assert _sample([4, 0], [10, 9]) == [10, 9]
    # A real mismatch still costs the bonus.
    from tpu_inference.layers.jax.sample import rejection_sampler
    out = rejection_sampler._greedy_rejection_sample_with_segment(
        jnp.array([5, 6, 1, 8, 0, 0]), jax.nn.one_hot(jnp.array(TARGET),
                                                      VOCAB),
        jnp.array([0, 4]), jnp.array(BONUS)).tolist()
    assert out[:4] == [5, 6, 7, -1] and out[len(DRAFTS):] == [9, -1]


def test_only_a_gemma_qat_runner_turns_it_on(plugin):
    from types import SimpleNamespace

    from tpu_inference.runner.tpu_runner import TPUModelRunner
    init = TPUModelRunner._init_speculative_decoding
    for load_format, want in (("gemma_qat", True), ("auto", False)):
        runner = SimpleNamespace(
            vllm_config=SimpleNamespace(load_config=SimpleNamespace(
                load_format=load_format)), speculative_config=None)
        try:
            init(runner)
        except AttributeError:
            pass  # the rest of the original needs a real runner
        assert rejection_padding._serving_gemma_qat is want
    rejection_padding._serving_gemma_qat = False

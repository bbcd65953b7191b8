"""A refused sync is no sync: the engine does not record the learner's weights as sent, nor hold the K/V/Q scales it
measured for them (DESIGN.md §3: a failed sync leaves the engine on its last good weights, and the next sync tries
again)."""

import pytest
import torch
from accelerate import Accelerator
from conftest import tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe
from trl_fp8.generation.reference import ReferenceEngine, left_pad


def untied_learner():
    """A tiny Llama whose config says tied while its head is a separate tensor, which `load_state_stream` refuses.
    Returns the learner and its original (tied) head parameter, to tie it again."""
    learner = tiny_model(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True)
    tied = learner.lm_head.weight
    learner.lm_head.weight = torch.nn.Parameter(3 * learner.model.embed_tokens.weight.detach())
    return learner, tied


def test_a_refused_sync_is_refused_again_not_taken_for_done():
    """The learner's versions are recorded only once its stream loaded: a second sync of the same learner is refused
    again, instead of returning as if the sampler held weights it never received (and generating with the old ones).
    Here `load_state_stream` refuses: the learner's head is untied from its embedding while its config says tied."""
    learner, _ = untied_learner()
    engine = ReferenceEngine(
        learner, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, eos_token_ids=[2], pad_token_id=0
    )
    for _ in range(2):
        with pytest.raises(
            ValueError, match=r"model.embed_tokens.weight and lm_head.weight: one tensor in the sampler"
        ):
            engine.sync_weights()
        assert engine.last_sync is None


def test_a_stream_the_sampler_refuses_leaves_no_kv_scales_held():
    """With the FP8 KV cache and `recalibrate=False` the first scales held are kept for good: a stream that
    `load_state_stream` refuses (here the learner's head untied from its embedding while its config says tied) must
    not leave the scales measured for it held, as they would then be sent with every later sync."""
    learner, tied = untied_learner()
    engine = ReferenceEngine(
        learner, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[2], pad_token_id=0,
    )  # fmt: skip
    engine.recalibrate = False
    engine.calibration_batch = left_pad([[5, 6, 7, 8, 9], [10, 11, 12]], 0)
    with pytest.raises(ValueError, match=r"one tensor in the sampler"):
        engine.sync_weights()
    assert engine._kv_scale_invs is None
    assert all(engine.sampler.get_submodule(n).k_scale.item() == -1.0 for n in engine._attn_names)
    learner.lm_head.weight = tied  # tied again
    engine.sync_weights()
    held = engine._kv_scale_invs
    assert held is not None and torch.isfinite(held).all()

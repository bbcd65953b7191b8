"""Recipes and checkpoints: round trips through local folders (the Hub path is the same code with a repo id)."""

import itertools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_grpo_args, tiny_policy
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe, convert_to_fp8
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.quant import FP8Linear, dequantize_blockwise
from trl_fp8.quant.fp8_checkpoint import save_fp8_checkpoint
from trl_fp8.recipe import RECIPE_NAME


def test_recipe_round_trip(tmp_path):
    recipe = FP8Recipe(pow2_scales=True, num_last_layers_in_bf16=2, modules_to_not_convert=["mlp.down_proj"])
    path = recipe.save_pretrained(tmp_path)
    data = json.loads(Path(path).read_text())
    assert data["trl_fp8_version"] and data["pow2_scales"] is True
    assert FP8Recipe.from_pretrained(tmp_path) == recipe
    assert FP8Recipe.from_any(str(tmp_path)) == recipe
    assert (
        FP8GRPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, fp8_recipe=str(tmp_path)).resolved_fp8_recipe
        == recipe
    )
    (tmp_path / RECIPE_NAME).write_bytes(b"\xff\xfe\x00")  # not UTF-8: a UnicodeDecodeError escaped
    with pytest.raises(ValueError, match=rf"{RECIPE_NAME} is not valid JSON"):
        FP8Recipe.from_pretrained(tmp_path)
    # transformers' save_pretrained(push_to_hub=True) uploads; this one only writes, which it said nothing about.
    with pytest.raises(ValueError, match=r"upload it with recipe.push_to_hub\(repo_id\)"):
        recipe.save_pretrained(tmp_path, push_to_hub=True)


@pytest.mark.parametrize(
    "content,match",
    [
        ({"pow2_scales": True, "blocksize": 64}, r"unknown FP8Recipe fields \['blocksize'\]"),
        ({"backend": "tpu"}, r"FP8Recipe.backend must be one of"),
        ({"fuse_siblings": "yes"}, r"FP8Recipe.fuse_siblings must be a bool, got 'yes'"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_invalid_recipe_files_are_rejected_with_named_fields(tmp_path, content, match):
    (tmp_path / RECIPE_NAME).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        FP8Recipe.from_pretrained(tmp_path)


def test_quantization_config():
    assert FP8Recipe().to_quantization_config(["lm_head"]) == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }


def trainer_for(tmp_path, tokenizer, **overrides):
    return FP8GRPOTrainer(
        model=tiny_policy(tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, **{"learning_rate": 0.05, "max_steps": 3, **overrides}),
        train_dataset=make_dataset(32),
        processing_class=tokenizer,
    )


def test_model_card_reports_the_runs_mismatch(tmp_path, demo_tokenizer):
    trainer = trainer_for(tmp_path, demo_tokenizer, max_steps=2, fp8_training=False)  # FP8 sampler, fp32 learner
    trainer.train()
    trainer.create_model_card(model_name="tiny-fp8")
    card = (tmp_path / "README.md").read_text()
    for key in ("sampling/token_mult_prob_error", "sampling/gen_kl"):
        values = [log[key] for log in trainer.state.log_history if key in log]
        assert len(values) == 2 and values[0] != values[1]
        mean, last = re.search(rf"\| `{key}` \| (\S+) \| (\S+) \|", card).groups()
        assert float(mean) == pytest.approx(sum(values) / 2, rel=1e-5) and float(last) == pytest.approx(
            values[-1], rel=1e-5
        )


def test_fp8_checkpoint_loads_in_transformers(tmp_path, demo_tokenizer):
    trainer = trainer_for(tmp_path, demo_tokenizer, max_steps=1, fp8_save_format="fp8")
    trainer.train()
    trainer.create_model_card(model_name="tiny-fp8")
    card = (tmp_path / "README.md").read_text()
    assert "## FP8 training" in card and '"pow2_scales": false' in card and "`sampling/token_mult_prob_error`" in card
    assert "fp8" in card.split("---")[1]  # the tag, in the card's metadata
    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    # What any transformers checkpoint of a trainer holds: vLLM reads its sampling defaults and EOS ids from
    # generation_config.json.
    for name in (RECIPE_NAME, "generation_config.json", "training_args.bin", "tokenizer_config.json"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head"]

    # On CPU transformers' FineGrainedFP8Config dequantizes the checkpoint at load time.
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    learner = trainer.model
    for name, module in learner.named_modules():
        if isinstance(module, FP8Linear):
            expected = dequantize_blockwise(*module.quantized_weight())
            got = loaded.get_submodule(name).weight.float()
            assert torch.equal(got, expected.to(got.dtype).float()), name
    ids = torch.randint(0, 19, (2, 12))
    with torch.no_grad():
        ref = learner(ids).logits  # FP8 weights and FP8 activations
        out_logits = loaded(ids).logits  # the same FP8 weights, high-precision activations
    sqnr = 20 * torch.log10(ref.norm() / (ref - out_logits).norm())
    assert sqnr > 20, f"logits SQNR {sqnr:.1f} dB"


def test_a_refused_final_save_leaves_the_folders_recipe_and_a_resume_refuses_the_fp8_checkpoint(
    tmp_path, demo_tokenizer
):
    """The FP8 checkpoint's weights are quantized: resuming from it (on a CPU transformers dequantizes them) would go
    on training from them, without a word. And a refused save had already written `fp8_recipe.json`: a new folder
    held it alone, an earlier checkpoint's was overwritten with a recipe that does not describe its weights."""
    trainer = trainer_for(tmp_path, demo_tokenizer, max_steps=1, fp8_save_format="fp8")
    trainer.save_model(str(tmp_path / "fp8"))
    trainer.save_state()
    master = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .*fp8 holds an FP8 checkpoint .*checkpoint-N"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "fp8"))
    assert all(torch.equal(p, master[n]) for n, p in trainer.model.named_parameters())
    other = FP8Recipe(pow2_scales=True)
    other.save_pretrained(tmp_path / "other")
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    for folder in ("new", "other"):
        with pytest.raises(ValueError, match=r"in \['model.norm.weight'\]; nothing was written"):
            trainer.save_model(str(tmp_path / folder))
    assert not (tmp_path / "new").exists() and FP8Recipe.from_pretrained(tmp_path / "other") == other


def test_an_fp8_checkpoint_carries_the_kv_cache_scales_of_its_weights(tmp_path, demo_tokenizer, caplog):
    """With the FP8 KV cache, the FP8 checkpoint holds the Q/K/V scales the next sync would give the sampler for the
    saved weights (vLLM serves it with `kv_cache_dtype="fp8"` on them, not on 1.0), measured without touching the
    sampler's; transformers loads the rest and reports them as unexpected. Saved before any step, it has none and
    says so. (Served by vLLM: tests/test_vllm_end_to_end.py::test_colocated_vllm_fp8_grpo_end_to_end[kv].)"""
    untrained = trainer_for(tmp_path / "untrained", demo_tokenizer, fp8_kv_cache=True, fp8_save_format="fp8")
    with caplog.at_level("WARNING", logger="trl_fp8"):
        untrained.save_model(str(tmp_path / "untrained" / "fp8"))
    assert "carries no FP8 KV-cache scales" in caplog.text
    assert not any(k.endswith("_scale") for k in load_file(tmp_path / "untrained" / "fp8" / "model.safetensors"))

    trainer = trainer_for(tmp_path, demo_tokenizer, max_steps=2, fp8_kv_cache=True, fp8_save_format="fp8")
    trainer.train()
    engine = trainer.vllm_generation
    held = engine._kv_scale_invs.clone()  # the last sync's, before the last optimizer step
    trainer.save_model(str(tmp_path / "fp8"))
    assert torch.equal(engine._kv_scale_invs, held)
    engine.sync_weights()  # the learner changed since: the sampler's scales are recalibrated
    assert not torch.equal(engine._kv_scale_invs, held)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    layers = trainer.model.config.num_hidden_layers
    names = [f"model.layers.{i}.self_attn.{x}_scale" for i in range(layers) for x in "kvq"]
    assert sorted(k for k in saved if k.endswith(("k_scale", "v_scale", "q_scale"))) == sorted(names)
    assert torch.equal(torch.stack([saved[n] for n in names]).view(layers, 3), engine._kv_scale_invs)

    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and info["unexpected_keys"] == set(names)


@pytest.mark.parametrize(
    "converted, given",
    [
        (dict(), dict(weight_block_size=[64, 128])),
        (dict(pow2_scales=False), dict(pow2_scales=True)),  # vLLM would run fp32 scales as E8M0
        (dict(pow2_scales=True), dict(pow2_scales=False)),
    ],
    ids=["block", "pow2_given", "pow2_converted"],
)
def test_a_checkpoint_is_described_by_the_recipe_its_weights_were_quantized_with(
    tmp_path, tiny_llama, converted, given
):
    model = convert_to_fp8(tiny_llama, FP8Recipe(**converted))
    with pytest.raises(ValueError, match=rf"converted with {re.escape(repr(FP8Recipe(**converted)))}.*not with the"):
        save_fp8_checkpoint(model, str(tmp_path), FP8Recipe(**given))
    assert not (tmp_path / "model.safetensors").exists()


def test_a_recipe_describing_the_same_weights_is_taken_in_any_form(tmp_path, tiny_llama):
    """Another backend (the kernels, not the weights) and a recipe given as a dict, as `iter_fp8_state` takes it."""
    model = convert_to_fp8(tiny_llama, FP8Recipe(backend="emulated"))
    save_fp8_checkpoint(model, str(tmp_path / "a"), FP8Recipe(fuse_siblings=False))
    save_fp8_checkpoint(model, str(tmp_path / "b"), {"backend": "emulated"})
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_a_failed_save_leaves_the_earlier_checkpoint_as_it_was(tmp_path, tiny_llama, monkeypatch):
    """The files are written aside and moved in only once all exist: a save that fails at its second shard (a full
    disk) leaves the folder's earlier checkpoint byte for byte, and a new folder is not left half-written."""
    import trl_fp8.quant.fp8_checkpoint as fp8_checkpoint

    model = convert_to_fp8(tiny_llama, FP8Recipe())
    save_fp8_checkpoint(model, str(tmp_path / "ckpt"), FP8Recipe())
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    writes = itertools.count()
    real_save_file = fp8_checkpoint.save_file

    def full_disk(*args, **kwargs):
        if next(writes) == 1:
            raise OSError(28, "No space left on device")
        real_save_file(*args, **kwargs)

    monkeypatch.setattr(fp8_checkpoint, "save_file", full_disk)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # other weights than the saved ones
    with pytest.raises(OSError, match="No space left"):
        save_fp8_checkpoint(model, str(tmp_path / "ckpt"), FP8Recipe(), max_shard_size="400KB")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    writes = itertools.count()
    with pytest.raises(OSError, match="No space left"):
        save_fp8_checkpoint(model, str(tmp_path / "new" / "nested"), FP8Recipe(), max_shard_size="400KB")
    assert not (tmp_path / "new").exists()  # nor the folders made to hold it
    # A move that fails once every file is written (an I/O error, a Ctrl-C between two renames): the files set
    # aside come back, whichever rename it was, and a sharded save over a single-file one is no exception.
    monkeypatch.setattr(fp8_checkpoint, "save_file", real_save_file)
    real_replace, moves = fp8_checkpoint.os.replace, itertools.count()
    failing_at = 0

    def interrupted(*args):
        if next(moves) == failing_at:
            raise KeyboardInterrupt
        real_replace(*args)

    monkeypatch.setattr(fp8_checkpoint.os, "replace", interrupted)
    for failing_at in range(40):  # each rename in turn: the earlier files go aside, then the new ones move in
        moves = itertools.count()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                save_fp8_checkpoint(model, str(tmp_path / "ckpt"), FP8Recipe(), max_shard_size="400KB")
                break  # every rename done
            except KeyboardInterrupt:
                assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before, failing_at
        assert not any("removed" in str(w.message) for w in caught), failing_at  # it was not
    assert any("held model.safetensors from an earlier save" in str(w.message) for w in caught)
    assert failing_at > len(before) and "model.safetensors" not in {p.name for p in (tmp_path / "ckpt").iterdir()}


def test_a_save_clears_what_an_earlier_killed_save_and_another_models_generation_config_left(tmp_path, tiny_llama):
    """A save killed before its renames leaves its staging folder in the target, which an upload of the folder would
    push: the next save removes it, and names (never removes) the files a save killed between two renames set aside.
    A model without a generation config does not inherit the folder's earlier one (its EOS ids, sampling defaults)."""
    from trl_fp8.quant.fp8_checkpoint import ASIDE_PREFIX, STAGING_PREFIX

    model = convert_to_fp8(tiny_llama, FP8Recipe())
    save_fp8_checkpoint(model, str(tmp_path), FP8Recipe())
    assert (tmp_path / "generation_config.json").exists()
    (tmp_path / f"{STAGING_PREFIX}killed").mkdir()
    (tmp_path / f"{STAGING_PREFIX}killed" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / f"{ASIDE_PREFIX}killed").mkdir()
    (tmp_path / f"{ASIDE_PREFIX}killed" / "adapter_config.json").write_text("{}")
    model.generation_config = None
    with pytest.warns(UserWarning) as caught:
        save_fp8_checkpoint(model, str(tmp_path), FP8Recipe())
    messages = "\n".join(str(w.message) for w in caught)
    assert f"removed {tmp_path / STAGING_PREFIX}killed, the unfinished files of an earlier save" in messages
    assert f"{tmp_path / ASIDE_PREFIX}killed holds files an earlier save set aside" in messages
    assert "held generation_config.json from an earlier save" in messages
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{ASIDE_PREFIX}killed", "config.json", "model.safetensors"]
    assert (tmp_path / f"{ASIDE_PREFIX}killed" / "adapter_config.json").read_text() == "{}"


def test_a_checkpoint_with_non_finite_tensors_or_misnamed_kv_scales_is_refused_before_writing(tmp_path, tiny_llama):
    """What the sync refuses, the save refuses too, naming the tensor: NaN in a high-precision tensor (FP8 weights are
    checked where quantized), and Q/K/V scales that are not positive, not named as vLLM loads them, or that would
    overwrite a weight."""
    model = convert_to_fp8(tiny_llama, FP8Recipe())
    k_scale = "model.layers.0.self_attn.k_scale"
    cases = [
        ([("model.norm.weight", torch.ones(256))], r"kv_scales: model\.norm\.weight \(\(256,\)\) is not one Q/K/V"),
        ([(k_scale, torch.tensor(1.0))] * 2, rf"kv_scales: {k_scale} is already in the checkpoint"),
        ([(k_scale, torch.tensor(0.0))], rf"NaN, inf or non-positive scales in \['{k_scale}'\]; nothing was written"),
    ]
    for kv_scales, match in cases:
        with pytest.raises(ValueError, match=match):
            save_fp8_checkpoint(model, str(tmp_path / "ckpt"), FP8Recipe(), kv_scales=kv_scales)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"in \['model\.layers\.1\.input_layernorm\.weight'\]; nothing was written"):
        save_fp8_checkpoint(model, str(tmp_path / "ckpt"), FP8Recipe())
    assert not (tmp_path / "ckpt").exists()


def test_a_large_fp8_checkpoint_is_written_in_shards_that_replace_an_earlier_save(tmp_path, tiny_llama):
    """Above `max_shard_size` (transformers' 50 GB by default: the Hub takes no larger file) the checkpoint is written
    in shards with their index, as `save_pretrained` names them, and loads in transformers as one. A folder's earlier
    save, single file or shards, is replaced: loaders would take it instead (transformers prefers a single file to an
    index, vLLM reads the shards an index names)."""
    model = convert_to_fp8(tiny_llama, FP8Recipe())
    expected = {
        n: dequantize_blockwise(*m.quantized_weight()) for n, m in model.named_modules() if isinstance(m, FP8Linear)
    }

    def loads_as_the_learner():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        return all(torch.equal(loaded.get_submodule(n).weight.detach(), w) for n, w in expected.items())

    save_fp8_checkpoint(model, str(tmp_path), FP8Recipe(), max_shard_size="400KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    assert sum(len(load_file(tmp_path / s)) for s in shards) == len(index["weight_map"])
    assert loads_as_the_learner()
    with pytest.warns(UserWarning, match=r"held model-00001-of-\d{5}\.safetensors, .*model\.safetensors\.index\.json"):
        save_fp8_checkpoint(model, str(tmp_path), FP8Recipe())
    assert [p.name for p in tmp_path.glob("*.safetensors*")] == ["model.safetensors"] and loads_as_the_learner()
    with pytest.warns(UserWarning, match=r"held model\.safetensors from an earlier save"):
        save_fp8_checkpoint(model, str(tmp_path), FP8Recipe(), max_shard_size="400KB")
    assert not (tmp_path / "model.safetensors").exists() and loads_as_the_learner()

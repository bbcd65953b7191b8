"""Recipes and checkpoints: round trips through local folders (the Hub path is the same code with a repo id)."""

import itertools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers.trainer
from conftest import tiny_grpo_args, tiny_policy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe, convert_to_fp8
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.demo.tiny_moe import tiny_qwen3_moe
from trl_fp8.quant import FP8Linear, dequantize_blockwise, iter_fp8_state
from trl_fp8.quant.fp8_checkpoint import save_fp8_checkpoint
from trl_fp8.recipe import RECIPE_NAME
from trl_fp8.trainers.checkpoints import checkpoint_keys


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
    says so. (Served by vLLM: tests/test_vllm_engine.py::test_colocated_vllm_fp8_grpo_end_to_end[kv].)"""
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


def test_a_checkpoint_is_described_by_the_recipe_its_weights_were_quantized_with(tmp_path, tiny_llama):
    model = convert_to_fp8(tiny_llama, FP8Recipe())
    with pytest.raises(ValueError, match=r"converted with FP8Recipe\(weight_block_size=\[128, 128\].*not with the"):
        save_fp8_checkpoint(model, str(tmp_path), FP8Recipe(weight_block_size=[64, 128]))
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


def test_push_to_hub_uploads_the_fp8_checkpoint(tmp_path, demo_tokenizer, monkeypatch):
    """The Hub cannot be reached here: its upload is replaced by a recorder of what the folder holds when it would be
    uploaded (the one stand-in). Trainer.push_to_hub saves before uploading, and that save must be the FP8 one."""
    uploads = []

    class Recorder:
        def upload_folder(self, folder_path, **kwargs):
            config = json.loads((Path(folder_path) / "config.json").read_text())
            state = load_file(Path(folder_path) / "model.safetensors")
            uploads.append((config.get("quantization_config"), {t.dtype for t in state.values()}))

    monkeypatch.setattr(transformers.trainer, "hf_api", Recorder)
    trainer = trainer_for(tmp_path, demo_tokenizer, max_steps=1, fp8_save_format="fp8")
    trainer.train()
    trainer.hub_model_id = "someone/tiny-fp8"  # as Trainer.init_hf_repo would have set it (it creates the repo)
    trainer.push_to_hub()
    trainer.args.push_to_hub = True
    trainer.save_model(str(tmp_path / "elsewhere"))  # writes there, then pushes output_dir, as Trainer.save_model does
    assert json.loads((tmp_path / "elsewhere" / "config.json").read_text())["quantization_config"]
    assert len(uploads) == 2
    for quantization_config, dtypes in uploads:
        assert quantization_config["quant_method"] == "fp8" and torch.float8_e4m3fn in dtypes
    # Checkpoints during training still hold the master weights.
    trainer.args.push_to_hub = False
    trainer.save_model(str(tmp_path / "checkpoint"), _internal_call=True)
    assert "quantization_config" not in json.loads((tmp_path / "checkpoint" / "config.json").read_text())


def test_pushes_during_lora_training_leave_no_adapter_beside_the_final_fp8_checkpoint(
    tmp_path, demo_tokenizer, monkeypatch
):
    """With `hub_strategy="every_save"` Trainer copies each checkpoint's adapter into `output_dir` and uploads it. The
    final FP8 checkpoint (adapters merged) replaces it, locally and in the repository: left there, transformers would
    load the adapter a second time on top of the merged weights (or, from the Hub, the adapter's base model instead
    of them). The Hub cannot be reached: its upload is replaced by a recorder (the one stand-in)."""
    from peft import LoraConfig

    uploads = []

    class Recorder:
        def upload_folder(self, folder_path, **kwargs):
            uploads.append((sorted(p.name for p in Path(folder_path).iterdir()), kwargs.get("delete_patterns")))
            return Done()

    class Done:
        def done(self):
            return True

    monkeypatch.setattr(transformers.trainer, "hf_api", Recorder)
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, max_steps=2, fp8_save_format="fp8", save_strategy="steps", save_steps=1),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
    )
    trainer.args.push_to_hub = True  # as push_to_hub=True would (Trainer.init_hf_repo creates the repository)
    trainer.hub_model_id, trainer.push_in_progress = "someone/tiny-fp8-lora", None
    trainer.train()
    assert "adapter_model.safetensors" in uploads[-1][0] and uploads[-1][1] is None  # a checkpoint's push
    with pytest.warns(UserWarning, match=r"held adapter_config.json, adapter_model.safetensors from an earlier save"):
        trainer.save_model()  # the example script's last step: writes output_dir, then pushes it
    files, deleted = uploads[-1]
    assert "adapter_config.json" not in files and "adapter_model.safetensors" not in files
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(deleted) and "model.safetensors" not in deleted
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any("lora_" in name for name, _ in loaded.named_parameters())
    name = "model.layers.0.self_attn.q_proj"
    # (transformers dequantizes block-FP8 checkpoints on CPU): the merged weight the FP8 layer computed with
    expected = dequantize_blockwise(*trainer.model.get_base_model().get_submodule(name).quantized_weight())
    assert torch.equal(loaded.get_submodule(name).weight.detach(), expected)


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_a_checkpoint_in_the_original_layout_loads_whole_or_not_at_all(tmp_path, demo_tokenizer):
    """`load_converted_checkpoint`: a plain model's checkpoint is left to the Trainer's `load_state_dict`; a MoE's
    (experts one by one on disk) loads through `from_pretrained`, every tensor in its own dtype; one that lacks a
    tensor of the model is refused, naming it, before the model is touched."""
    from trl_fp8.trainers.checkpoints import load_converted_checkpoint

    tiny_policy(demo_tokenizer).save_pretrained(tmp_path / "dense")
    assert not load_converted_checkpoint(tiny_policy(demo_tokenizer), str(tmp_path / "dense"))
    saved = tiny_qwen3_moe(demo_tokenizer, seed=1)
    saved.save_pretrained(tmp_path / "moe")
    model = convert_to_fp8(tiny_qwen3_moe(demo_tokenizer, seed=2), FP8Recipe())
    assert load_converted_checkpoint(model, str(tmp_path / "moe"))
    for name, t in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    # Mixed dtypes (bf16 layers, an fp32 lm_head as `cast_lm_head_to_fp32` makes them): each tensor exactly.
    mixed = tiny_qwen3_moe(demo_tokenizer, seed=1).to(torch.bfloat16)
    mixed.lm_head.float().weight.data.normal_(std=0.02)  # values bf16 cannot hold
    mixed.save_pretrained(tmp_path / "mixed")
    model = tiny_qwen3_moe(demo_tokenizer, seed=2).to(torch.bfloat16)
    model.lm_head.float()
    assert load_converted_checkpoint(model, str(tmp_path / "mixed"))
    for name, t in mixed.state_dict().items():
        assert model.state_dict()[name].dtype == t.dtype and torch.equal(model.state_dict()[name], t), name
    # A tensor the checkpoint lacks (from_pretrained would initialize it afresh) or a model with more: refused,
    # naming them, before the model is touched.
    weights = load_file(tmp_path / "moe" / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, tmp_path / "moe" / "model.safetensors", metadata={"format": "pt"})
    deeper = tiny_qwen3_moe(demo_tokenizer, seed=2)
    deeper.model.layers.append(deeper.model.layers[-1])
    for target, name in ((tiny_qwen3_moe(demo_tokenizer, seed=2), "layers.0.self_attn.q_proj"), (deeper, "layers.2.")):
        before = {n: t.clone() for n, t in target.state_dict().items()}
        with pytest.raises(RuntimeError, match=rf"load_best_model_at_end: .* does not hold every tensor of "
                           rf"Qwen3MoeForCausalLM once converted: missing \[.*'model\.{name}"):  # fmt: skip
            load_converted_checkpoint(target, str(tmp_path / "moe"), "load_best_model_at_end")
        assert all(torch.equal(t, before[n]) for n, t in target.state_dict().items())


def test_load_best_model_at_end_restores_a_moes_experts(tmp_path, demo_tokenizer):
    """`load_best_model_at_end` reads the best checkpoint as a resume does (a MoE's through `from_pretrained`): the
    run ends holding every tensor of that checkpoint, the first here (each call of the reward scores lower), not the
    experts of the last step."""
    calls = itertools.count()

    def falling(completions, **kwargs):
        call = next(calls)
        return [0.1 * i - call for i in range(len(completions))]  # distinct within a group, lower at every call

    args = tiny_grpo_args(
        tmp_path, learning_rate=0.05, max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps",
        eval_steps=1, per_device_eval_batch_size=4, load_best_model_at_end=True, metric_for_best_model="reward",
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        model=tiny_qwen3_moe(demo_tokenizer), reward_funcs=falling, args=args, train_dataset=make_dataset(32),
        eval_dataset=make_dataset(8, seed=1), processing_class=demo_tokenizer,
    )  # fmt: skip
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    best = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint).state_dict()
    last = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    assert any(
        not torch.equal(t, last[n]) for n, t in load_file(tmp_path / "checkpoint-1" / "model.safetensors").items()
    )
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(t, best[name]), f"{name} is not the best checkpoint's"
    # And so does the sampler, at the next generation: loading changed the weights but not `global_step`, by which
    # TRL decides to refit.
    trainer.evaluate()
    held = trainer.vllm_generation.sampler.state_dict()
    stale = [n for n, t in iter_fp8_state(trainer.model) if not torch.equal(held[n], t.to(held[n].dtype))]
    assert not stale, f"the sampler still holds the last step's {stale[:3]}"


@pytest.mark.parametrize(
    "kv_cache,eval_on_start,moe",
    [(False, False, False), (True, False, False), (True, True, False), (False, False, True)],
    ids=["bf16_kv", "fp8_kv", "eval_on_start", "moe"],
)
def test_resume_from_checkpoint_continues_with_the_same_numbers(
    tmp_path, demo_tokenizer, kv_cache, eval_on_start, moe
):
    """With the FP8 KV cache, the checkpoint keeps the batch its next recalibration runs on (beside the RNG state):
    the resumed run's first scales are the ones the straight run used, also when an evaluation on start (before
    the Trainer restores the RNG states) generates first. A MoE's checkpoint holds its experts one by one (the
    original layout `save_pretrained` writes), which the Trainer's own loading would not read back: they are
    restored through `from_pretrained`. (Two ranks: tests/test_distributed.py.)"""
    evaluation = {}
    if eval_on_start:  # no other evaluation within the 3 steps
        evaluation = dict(eval_strategy="steps", eval_steps=100, eval_on_start=True, per_device_eval_batch_size=4)

    def trainer_for(output_dir, **overrides):
        return FP8GRPOTrainer(
            model=tiny_qwen3_moe(demo_tokenizer) if moe else tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=tiny_grpo_args(output_dir, learning_rate=0.05, max_steps=3, fp8_kv_cache=kv_cache, **evaluation,
                                **overrides),
            train_dataset=make_dataset(32),
            eval_dataset=make_dataset(8, seed=1) if eval_on_start else None,
            processing_class=demo_tokenizer,
        )  # fmt: skip

    straight = trainer_for(tmp_path / "a")
    straight.train()
    # Same schedule (max_steps=3), interrupted after the checkpoint at step 2.
    first = trainer_for(tmp_path / "b", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))
    first.train()
    assert first.state.global_step == 2
    kept = tmp_path / "b" / "checkpoint-2" / "fp8_kv_calibration.pt"
    assert kept.is_file() == kv_cache
    saved_keys = checkpoint_keys(str(tmp_path / "b" / "checkpoint-2"))
    assert any(".mlp.experts.0.gate_proj." in k for k in saved_keys) == moe
    resumed = trainer_for(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{name} differs after resuming")
    if kv_cache:  # the last sync's scales: calibrated on the kept batch, with the weights after step 2
        torch.testing.assert_close(
            resumed.vllm_generation._kv_scale_invs, straight.vllm_generation._kv_scale_invs, rtol=0, atol=0
        )
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "b" / "checkpoint-2" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values()) and not any("_extra_state" in k for k in saved)

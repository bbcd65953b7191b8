"""The in-place refit of a live colocated `vllm.LLM` with a validated checkpoint-format stream: vLLM's layerwise reload
under the engine's config (0.31's `Worker.reload_weights`, run on every worker), then a check that the engine loaded
each of its parameters, which vLLM itself does only for unquantized models.

Every vLLM symbol used here was read in the source of vLLM 0.22.0 and 0.31.0 (the `vllm` extra's range).
"""

import torch
from trl.generation.vllm_generation import empty_cache


def reload_in_config(worker, weights_iterator) -> list[str] | None:
    """Runs on each vLLM worker (`LLM.collective_rpc` passes it): 0.31's `Worker.reload_weights` exactly (0.22's
    lacks the config context, which MoE kernels built while reprocessing the weights read: `get_current_vllm_config`).

    Returns the engine's parameters the stream did not load (`unloaded_parameters`), or None where its model's
    `load_weights` does not report what it loaded: vLLM's layerwise reload gives a missed parameter no more than a log
    line, and checks completeness itself only for unquantized models. The parameters are listed as the reload lays
    them out, before its kernels' processing renames or repacks them; names that were one parameter before the reload
    (a tied `lm_head`), which it lays out as separate tensors, count as one."""
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    names_of = {}  # every name of each parameter, before the reload separates tied ones
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    aliases = {name: tuple(names) for names in names_of.values() for name in names}
    expected, reported = set(), []
    own = model.__dict__.get("load_weights")
    load_weights = model.load_weights

    def recording_load_weights(weights):
        expected.update(name for name, _ in model.named_parameters())
        reported.append(load_weights(weights))
        return reported[-1]

    model.load_weights = recording_load_weights  # an instance attribute: the class's method is left alone
    taken = []  # the name of the last tensor vLLM took from the stream

    def tracked(weights):
        for name, tensor in weights:
            taken[:] = [name]
            yield name, tensor

    try:
        with set_current_vllm_config(worker.vllm_config):
            worker.model_runner.reload_weights(weights_iterator=tracked(weights_iterator), is_checkpoint_format=True)
    except BaseException as error:  # an OOM while a layer is rebuilt, a KeyboardInterrupt, a stream vLLM cannot route
        if restore_unprocessed_layers(model):
            error.add_note(
                "trl-fp8: the refit failed inside vLLM's reload. The layers it had finished hold the new weights; "
                "those it had not keep the weights the engine held before, except with sleep mode, whose level 2 "
                "(TRL's) discarded them: those layers hold no valid weights. The next sync_weights() refits them all."
            )
        if taken:
            note = f"trl-fp8: the last tensor vLLM took from the sync stream was {taken[0]!r}."
            if isinstance(error, KeyError):
                # Some models' load_weights (deepseek_v2.py's) look a name up unchecked: the bare KeyError names the
                # key in vLLM's spelling only, and no layer.
                note += (
                    " vLLM's model class for this architecture most likely has no parameter for it: it names its "
                    "weights otherwise than the learner's checkpoint does. Use fp8_generation=False (TRL's BF16 vLLM "
                    "engine) or use_vllm=False (trl-fp8's FP8 reference engine) for this model."
                )
            error.add_note(note)
        raise
    finally:
        del model.load_weights
        if own is not None:
            model.load_weights = own
    with set_current_vllm_config(worker.vllm_config):
        reprocess_tied_embeddings(model, aliases)
    if not reported or reported[0] is None:
        return None
    return unloaded_parameters(expected, set(reported[0]), aliases)


def restore_unprocessed_layers(model) -> bool:
    """After a reload that raised: puts back the tensors the engine held before the reload into every layer it had not
    finished (vLLM's `initialize_layerwise_reload` moved them to the meta device, and only its finalize puts them
    back), and clears the reload's per-layer state, from which the next reload would otherwise resume (it skips the
    layers still marked as loading, and replays their buffered weights). The layers processed before the failure keep
    their new weights. Read in vLLM 0.31's and 0.32's `reload/layerwise.py`; returns False where a vLLM lacks what it
    uses (the error then goes on alone)."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return False
    place = getattr(layerwise, "_place_kernel_tensors", None)
    infos = getattr(layerwise, "LAYERWISE_INFO", None)
    if place is None or infos is None:
        return False
    for layer in model.modules():
        info = infos.get(layer)
        if info is None or not info.can_load():  # never reloaded, or finished
            continue
        if info.kernel_tensors is not None:
            place(layer, info)
        info.reset()
    getattr(layerwise, "LOADING_LAYERS", set()).clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return True


def reprocess_tied_embeddings(model, aliases: dict[str, tuple[str, ...]]) -> None:
    """Re-runs the weight processing of the embedding-shaped layers that share their weight (a tied `lm_head` and its
    embedding): the reload routes the shared tensor to one of them and never processes the other, and vLLM's
    CPU build packs an unquantized `lm_head`'s weight for its GEMM when processing it, so that copy would keep the
    dummy weights of the engine's start. (On GPUs this processing is a no-op.)"""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        names = aliases.get(f"{name}.weight", ())
        if type(method).__name__ == "UnquantizedEmbeddingMethod" and len(names) > 1:  # processing twice is harmless
            method.process_weights_after_loading(module)


def unloaded_parameters(expected: set[str], loaded: set[str], aliases: dict[str, tuple[str, ...]]) -> list[str]:
    """The names in `expected` that `loaded` (what vLLM's `load_weights` reported) does not cover. Any name of one
    parameter covers the others (`aliases[name]`: all its names before the reload, e.g. a tied `lm_head` and the
    embedding it shares), as LoRA's `base_layer` names their layer's; vLLM 0.31's MoE layers report their experts'
    parameters one module up, `experts.w13_weight` for `experts.routed_experts.w13_weight` (`MoERunner.load_weights`
    passes on `RoutedExperts`' names)."""

    def covered(name: str) -> bool:
        if any(alias.replace(".base_layer.", ".") in loaded for alias in aliases.get(name, (name,))):
            return True
        return ".routed_experts." in name and name.replace(".routed_experts.", ".") in loaded

    return sorted(name for name in expected if not covered(name))


# The attention layers' KV-cache scales, which the stream carries only with the FP8 KV cache (`prob_scale` never):
# vLLM's `BaseKVCacheMethod` keeps 1.0 for those it does not receive, as a BF16 KV cache needs.
KV_SCALE_PARAMS = (".k_scale", ".v_scale", ".q_scale")


def check_reload_complete(unloaded: list[list[str] | None], *, kv_cache: bool) -> None:
    """Refuses a refit that left engine parameters unloaded (`reload_in_config`'s per-worker reports): vLLM keeps
    their previous values where a whole layer was missed (its placeholders at the first sync), and fills them with
    uninitialised memory where other tensors of the layer arrived, while the learner trains its own."""
    optional = (".prob_scale",) + (() if kv_cache else KV_SCALE_PARAMS)
    missing = sorted({n for names in unloaded for n in names or () if not n.endswith(optional)})
    if missing:
        raise ValueError(
            f"vLLM did not load {len(missing)} of its parameters from the FP8 sync stream: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; it now holds stale or uninitialised values there. Its model class "
            "for this architecture names its weights otherwise than the learner's checkpoint does: use "
            "fp8_generation=False (TRL's BF16 vLLM engine) or use_vllm=False (trl-fp8's FP8 reference engine) for "
            "this model."
        )


def refit(llm, pairs: list[tuple[str, torch.Tensor]], *, sleep_mode: bool = False) -> list[list[str] | None]:
    """Loads a validated checkpoint-format stream into a live `vllm.LLM` in place, then drops the caches that hold
    what the old weights computed. With sleep mode the caller wakes the weights first
    (`FP8VLLMGeneration.sync_weights`, which tracks whether they sleep). Returns each worker's unloaded parameters
    (`reload_in_config`)."""
    unloaded = llm.collective_rpc(reload_in_config, kwargs={"weights_iterator": iter(pairs)})
    if sleep_mode:
        # The reload materializes a layer at a time (all of a MoE layer's experts) and frees it into the caching
        # allocator; vLLM 0.22's wake_up of the KV cache, which TRL calls next, does not empty it first.
        empty_cache()
    # Cached prefixes hold KV computed with the old weights: a cache vLLM could not reset (it refuses while requests
    # run, with only a warning) would serve them to the next generation.
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(
            "vLLM could not reset its prefix cache after the weight sync (are requests still running?): cached "
            "prefixes would keep the old weights' KV"
        )
    # Cached encoder outputs (vision embeddings) were computed with the old weights. vLLM 0.31's reload clears the
    # workers' copies but not the scheduler's record of them, which would then skip encoding an image seen before,
    # and the worker fail with "Encoder cache miss". The engine's reset clears both (`LLMEngine.reset_encoder_cache`,
    # read in 0.31; vllm#33452 added it before 0.22, and an engine without it is passed over).
    reset_encoder_cache = getattr(getattr(llm, "llm_engine", None), "reset_encoder_cache", None)
    if reset_encoder_cache is not None:
        reset_encoder_cache()
    return unloaded

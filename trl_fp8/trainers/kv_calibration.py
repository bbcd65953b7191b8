"""The batch each FP8 KV-cache recalibration runs on, from step to step and across a checkpoint.

After every optimizer step the sampler's Q/K/V scales are measured again with the updated learner, on a few rows of
the latest training batch (prompts and completions). That batch is per-rank state like the RNG's: a checkpoint keeps
it beside `rng_state_{rank}.pth`, so a run resumed from the checkpoint recalibrates on the rows the interrupted run
would have used and goes on with the same scales (without it, on the next batch's prompts alone). (A checkpoint
between two generations, with `steps_per_generation` above the accumulation steps, loses TRL's buffered rollouts
whatever this keeps: TRL generates anew on resuming.)"""

import logging
import os

import torch

from ..generation.reference import left_pad


logger = logging.getLogger(__name__)


def spread_rows(n: int, rows: int) -> list[int]:
    """`rows` indices spread evenly over a batch of `n`. TRL's batches hold each prompt's generations side by side, so
    the first rows would be the generations of one or two prompts (with 32 generations, half of one)."""
    return list(range(n)) if n <= rows else [i * n // rows for i in range(rows)]


def prompts_batch(prompt_ids: list[list[int]], rows: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The very first calibration's batch: no batch has finished yet, so rows of this one's prompts, left-padded."""
    return left_pad([prompt_ids[i] for i in spread_rows(len(prompt_ids), rows)], pad_token_id)


def rollouts_batch(output: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next calibration's batch: rows spread over a finished training batch, completions included (the scales
    serve the rollouts that train)."""
    picked = spread_rows(len(output["prompt_ids"]), rows)
    return (
        torch.cat([output["prompt_ids"][picked], output["completion_ids"][picked]], dim=1),
        torch.cat([output["prompt_mask"][picked], output["completion_mask"][picked]], dim=1),
    )


def calibration_file(checkpoint: str, world_size: int, process_index: int) -> str:
    """Named as the Trainer names its RNG states: one file per rank when there are several."""
    name = "fp8_kv_calibration.pt" if world_size <= 1 else f"fp8_kv_calibration_{process_index}.pt"
    return os.path.join(checkpoint, name)


def save_calibration_batch(batch: tuple[torch.Tensor, torch.Tensor], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a rank may get here before the main one wrote the folder
    input_ids, attention_mask = batch
    torch.save({"input_ids": input_ids.cpu(), "attention_mask": attention_mask.cpu()}, path)


def load_calibration_batch(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch a checkpoint kept, or `None` (with a note in the log) if it kept none: a run without the FP8 KV
    cache, with another number of ranks, or from before checkpoints kept it. The next calibration then runs on the
    next batch's prompts."""
    if not os.path.isfile(path):
        logger.info(
            "No FP8 KV-cache calibration batch at %s: the first recalibration after resuming runs on the next "
            "batch's prompts, so its Q/K/V scales differ from those the interrupted run would have used.",
            path,
        )
        return None
    saved = torch.load(path, weights_only=True)
    return saved["input_ids"], saved["attention_mask"]

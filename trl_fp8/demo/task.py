"""A tiny synthetic "reasoning" task for CPU-sized GRPO demos: two-digit addition.

Prompts are plain (non-conversational) strings such as ``"23+45="`` and the expected completion is the sum, e.g.
``"68"``. Both operands are drawn from ``[10, 99]`` so every prompt is exactly six characters long: a batch of prompts
then needs no padding, which keeps the position ids seen by ``generate`` and by the training forward pass identical.

The shipped model (``DEMO_MODEL_DIR``, made by ``python -m trl_fp8.demo.make_model``) is a small Llama pre-trained on
this task with noisy answers and stopped early on purpose: greedy decoding solves about 80% of the prompts but sampling
at temperature 1.0 only about a third, so GRPO has a clear, quickly measurable reward signal to improve (see
``python -m trl_fp8.demo.check_grpo``).
"""

import random
from pathlib import Path

import datasets
import torch


DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"

MIN_OPERAND, MAX_OPERAND = 10, 99

# The GRPO settings every demo run shares (recipes/demo_cpu.yaml writes the same out for the example script, which
# keeps its progress bar: disable_tqdm is the one setting it leaves out).
DEMO_GRPO_KWARGS = dict(
    num_generations=8,
    max_completion_length=6,  # answers are at most 3 digits + <eos>
    temperature=1.0,
    beta=0.0,  # no reference model: cheaper, and the KL term is not needed for a short run
    lr_scheduler_type="constant",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


def make_example(rng: random.Random) -> dict[str, str]:
    """Draw one ``{"prompt", "answer"}`` pair from the task distribution."""
    a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def make_dataset(num_samples: int, seed: int = 0) -> datasets.Dataset:
    """Build a deterministic dataset of ``num_samples`` addition problems.

    Args:
        num_samples: Number of rows.
        seed: Seed of the (private) random generator; the same seed always gives the same rows.

    Returns:
        A `datasets.Dataset` with a ``"prompt"`` column (standard text prompts, e.g. ``"23+45="``) and an ``"answer"``
        column (e.g. ``"68"``). TRL forwards the ``"answer"`` column to reward functions as a keyword argument.
    """
    rng = random.Random(seed)
    rows = [make_example(rng) for _ in range(num_samples)]
    return datasets.Dataset.from_list(rows)


def accuracy_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Exact-match reward: 1.0 when the completion is the answer, else 0.0.

    TRL decodes completions with ``skip_special_tokens=True``, so the EOS token is already gone; we still strip
    whitespace and a literal ``"<eos>"`` so that the function also works on raw decoded text. No partial credit is
    given: the shipped model already solves part of the prompts, so a binary reward gives GRPO enough signal, and
    a shaped reward would only make the "mean reward" curve harder to read.

    Args:
        completions: Completion texts (standard prompts, so plain strings).
        answer: Expected answers, one per completion (the dataset's ``"answer"`` column).
        **kwargs: Other dataset columns and trainer extras, ignored.

    Returns:
        One reward per completion.
    """
    return [float(c.replace("<eos>", "").strip() == a) for c, a in zip(completions, answer, strict=True)]


def digit_count_reward(completions: list, **kwargs) -> list[float]:
    """A dense reward any model earns some of, even untrained: the number of digits it writes. For tests and
    benchmarks on randomly initialised models, where an exact-match reward would be zero everywhere."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational: messages
    return [float(sum(ch.isdigit() for ch in t)) for t in texts]


@torch.no_grad()
def generation_accuracy(model, tokenizer, prompts: list[str], answers: list[str], do_sample: bool = True) -> float:
    """Fraction of prompts that `model.generate` answers correctly, scored with `accuracy_reward`.

    Sampling uses temperature 1.0 with no top-p / top-k truncation, like `trl.GRPOConfig`'s defaults, so the number
    matches the mean reward GRPO sees at the start of training.
    """
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
    output_ids = model.generate(**inputs, max_new_tokens=6, **sampling)
    completions = tokenizer.batch_decode(output_ids[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(accuracy_reward(completions, answers)) / len(answers)


def load_demo_model_and_tokenizer(dtype: torch.dtype = torch.float32, model_dir: str | Path = DEMO_MODEL_DIR):
    """Load the shipped demo model and its tokenizer, without touching the Hub.

    Args:
        dtype: Parameter dtype of the returned model.
        model_dir: Folder to load from; defaults to the shipped `DEMO_MODEL_DIR`.

    Returns:
        ``(model, tokenizer)``: a `transformers.LlamaForCausalLM` and a `transformers.PreTrainedTokenizerFast`.
    """
    # Imported lazily so that `make_dataset` / `accuracy_reward` do not pay for importing transformers.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model, tokenizer

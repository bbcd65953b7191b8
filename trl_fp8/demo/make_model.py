"""Make the tiny demo model shipped in ``trl_fp8/demo/model/``.

Builds a character-level tokenizer and a small Llama, then pre-trains it on the two-digit addition task of
`trl_fp8.demo.task`. Two choices make it a good GRPO starting point rather than a solved task:

- the training answers are noisy (each digit is replaced by a random one with probability ``--answer_noise``), so the
  model learns the sums but stays under-confident: greedy decoding is mostly right while sampling at temperature 1.0
  often picks a wrong digit, a gap a verifiable reward closes within a few dozen steps;
- training stops early, as soon as the expected temperature-1.0 accuracy reaches ``--target_sampled_accuracy``.

    python -m trl_fp8.demo.make_model --output_dir trl_fp8/demo/model
"""

import argparse
import random
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trl_fp8.demo.task import DEMO_MODEL_DIR, generation_accuracy, make_dataset, make_example


SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-*= ")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ``<bos>`` is prepended to every encoded text; decoding concatenates characters."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    # Without a decoder, `decode` joins tokens with spaces ("6 8"); `Fuse` concatenates them back into "68".
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",  # decoder-only generation pads on the left
        model_max_length=64,  # = max_position_embeddings
    )


def build_model(tokenizer: PreTrainedTokenizerFast, num_hidden_layers: int = 2) -> LlamaForCausalLM:
    """A ~1.2M-parameter Llama whose Linear in/out features are all multiples of 128 (FP8 128x128 blocks)."""
    config = LlamaConfig(
        vocab_size=128,  # the tokenizer has 19 tokens; padding to 128 makes `lm_head` block-aligned too
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # k/v projections: 2 * 64 = 128 outputs
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def encode(tokenizer: PreTrainedTokenizerFast, prompts: list[str], answers: list[str]) -> tuple[torch.Tensor, ...]:
    """Tokenize ``<bos> prompt answer <eos>`` sequences, right-padded; labels cover only the answer and ``<eos>``."""
    prompt_ids = tokenizer(prompts)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    length = max(len(p) + len(a) + 1 for p, a in zip(prompt_ids, answer_ids, strict=True))
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    labels = torch.full((len(prompts), length), -100)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids, strict=True)):
        ids = p + a + [tokenizer.eos_token_id]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(p) : len(ids)] = torch.tensor(ids[len(p) :])
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


@torch.no_grad()
def evaluate(model, tokenizer, prompts: list[str], answers: list[str]) -> tuple[float, float]:
    """Exact greedy accuracy and exact *expected* accuracy of sampling at temperature 1.0, by teacher forcing.

    Greedy decoding produces the answer iff the answer (and ``<eos>``) is the argmax at every step, and sampling
    produces it with probability ``prod p(token)``: one forward pass gives both numbers without sampling noise.
    """
    input_ids, attention_mask, labels = encode(tokenizer, prompts, answers)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    labels = labels[:, 1:]
    mask = labels != -100
    safe_labels = labels.clamp(min=0)
    token_logps = logits.log_softmax(-1).gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    sampled = (token_logps * mask).sum(-1).exp().mean().item()
    greedy = ((logits.argmax(-1) == safe_labels) | ~mask).all(-1).float().mean().item()
    return greedy, sampled


def corrupt(answer: str, rng: random.Random, noise: float) -> str:
    """Replace each digit of ``answer`` with a uniformly random digit with probability ``noise``."""
    return "".join(rng.choice("0123456789") if rng.random() < noise else c for c in answer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--max_steps", type=int, default=3000)
    # Noisy training answers make the model under-confident on purpose: greedy decoding is mostly right while
    # temperature-1.0 sampling often picks a wrong digit, a gap a verifiable reward closes quickly.
    parser.add_argument("--answer_noise", type=float, default=0.3)
    parser.add_argument("--eval_every", type=int, default=50)
    # Stop as soon as the expected temperature-1.0 accuracy reaches this: partly solved, lots of room for RL.
    parser.add_argument("--target_sampled_accuracy", type=float, default=0.3)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.num_hidden_layers)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    # A fixed held-out set, drawn with a seed the training stream never uses.
    eval_set = make_dataset(1000, seed=10_000 + args.seed).to_dict()
    # TRL decodes completions with `skip_special_tokens=True` and compares text: encoding must round-trip exactly.
    for text in eval_set["prompt"] + eval_set["answer"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text, text
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    start = time.time()
    for step in range(1, args.max_steps + 1):
        batch = [make_example(rng) for _ in range(args.batch_size)]
        answers = [corrupt(example["answer"], rng, args.answer_noise) for example in batch]
        input_ids, attention_mask, labels = encode(tokenizer, [example["prompt"] for example in batch], answers)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noisy answers make occasional large gradients
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % args.eval_every == 0:
            model.eval()
            greedy, sampled = evaluate(model, tokenizer, eval_set["prompt"], eval_set["answer"])
            model.train()
            elapsed = time.time() - start
            print(f"step {step}: loss {loss.item():.3f}, greedy {greedy:.3f}, sampled {sampled:.3f} ({elapsed:.0f}s)")
            if sampled >= args.target_sampled_accuracy:
                break

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=6,
    )
    greedy = generation_accuracy(model, tokenizer, eval_set["prompt"], eval_set["answer"], do_sample=False)
    sampled = generation_accuracy(model, tokenizer, eval_set["prompt"], eval_set["answer"])
    print(f"`generate` on {len(eval_set['prompt'])} held-out prompts: greedy accuracy {greedy:.3f}, ", end="")
    print(f"sampled (temperature 1.0) accuracy {sampled:.3f}; pre-training took {time.time() - start:.0f}s")
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()

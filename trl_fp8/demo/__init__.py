"""A tiny CPU-trainable GRPO demo: two-digit addition with a small, partly pre-trained Llama."""

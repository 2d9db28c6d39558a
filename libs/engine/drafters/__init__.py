"""Model drafters for speculative decoding: a draft model with a KV cache of its own that proposes
K tokens per sequence in K cheap batched decode steps (`model_drafter.py`), built from the engine's
setting (`loading.py`: the base model without experts, the checkpoint in int4, or a separate draft
checkpoint sharing the tokenizer). The n-gram drafter and the Speculator are in ../speculative.py.
"""

"""Tiny but real Llama GGUF files, written the way llama.cpp's converter lays them out: a trained
byte-level BPE or SentencePiece vocabulary, random weights in F32, F16, Q8_0, Q4_0 and Q4_1, and the
Q/K rows permuted as llama.cpp does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12 or 123 more!",
    "def add(a, b):\n    return a + b  # 42\n\nprint(add(1, 2))\n",
    "Hello world! Hello there, hello again; the world says hello 1234567890 times.",
    "    indented    spaces\tand\ttabs\r\nnew lines 3.14159 == pi, 100% sure?",
    "naïve café, résumé, 東京 and emoji 🚀✨ in text; x**2 + y**2 = z**2",
]


@dataclass
class TinyGGUF:
    """A tiny GGUF on disk and the float32 weights it was made from (HF names, before quantization)."""

    path: Path
    source: dict[str, np.ndarray] = field(default_factory=dict)


def train_byte_level_vocab() -> tuple[list[str], list[str]]:
    """Tokens and merges of a small byte-level BPE trained with the plain GPT-2 split, so that it has
    multi-digit merges such as "1 2" (which the smollm pre-tokenizer must never use)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    state = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    return tokens, [" ".join(pair) for pair in state["merges"]]


def train_sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces scored by rank."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tokenizer.train_from_iterator([text.replace("東京", "") for text in CORPUS] * 20, trainer)
    state = json.loads(tokenizer.to_str())["model"]
    merged = ["".join(pair) for pair in state["merges"]]
    alphabet = [t for t in sorted(state["vocab"], key=state["vocab"].get) if t not in set(merged)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + alphabet + merged
    scores = [0.0] * (3 + 256 + len(alphabet)) + [-float(rank) for rank in range(len(merged))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(alphabet) + len(merged))
    return tokens, scores, types


def llama_cpp_permute(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF-to-GGUF converter does to attn_q/attn_k rows (rotary halves interleaved)."""
    rows = weights.shape[0]
    return weights.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


# GGUF tensor kind -> storage type per layer: every type appears, and layer 1 keeps Q/K in F32 so
# their un-permutation can be checked exactly against the source weights.
LAYER_TYPES = {
    "attn_q": (Q.Q4_1, Q.F32),
    "attn_k": (Q.Q4_0, Q.F32),
    "attn_v": (Q.F16, Q.Q8_0),
    "attn_output": (Q.Q8_0, Q.Q4_1),
    "ffn_gate": (Q.Q4_1, Q.F16),
    "ffn_up": (Q.Q4_0, Q.Q4_1),
    "ffn_down": (Q.F16, Q.Q4_0),
    "attn_norm": (Q.F32, Q.F32),
    "ffn_norm": (Q.F32, Q.F32),
}
HF_PARTS = {
    "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
    "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HIDDEN)),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN)),
    "ffn_up": ("mlp.up_proj", (FFN, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN)),
    "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
}


def add_tensor(writer: gguf.GGUFWriter, name: str, weights: np.ndarray, qtype: Q) -> None:
    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64}
    if qtype in plain:
        writer.add_tensor(name, weights.astype(plain[qtype]))
    else:
        writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    path: Path,
    *,
    pre: str = "smollm",
    tied: bool = True,
    tokenizer: str = "gpt2",
    architecture: str = "llama",
    kv: dict | None = None,
    extra_tensors: tuple[str, ...] = (),
    add_bos: bool = False,
    float64_norm: bool = False,
    projection_type: Q | None = None,
) -> TinyGGUF:
    """Write a tiny Llama GGUF the way llama.cpp's converter lays one out: its projections in the
    mix of LAYER_TYPES, or all in `projection_type`."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    if tokenizer == "gpt2":
        trained, merges = train_byte_level_vocab()
        tokens = [*SPECIALS, *trained, USER_DEFINED]
        types = [3] * len(SPECIALS) + [1] * len(trained) + [4]
        writer.add_array("tokenizer.ggml.merges", merges)
        writer.add_string("tokenizer.ggml.pre", pre)
        bos, eos, unk = 1, 2, 0
    else:
        tokens, scores, types = train_sentencepiece_vocab()
        writer.add_array("tokenizer.ggml.scores", scores)
        bos, eos, unk = 1, 2, 0
    writer.add_string("tokenizer.ggml.model", tokenizer)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    for key, value in (("bos", bos), ("eos", eos), ("unknown", unk), ("padding", eos)):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    prefix = architecture
    for key, value in (
        ("context_length", 256),
        ("embedding_length", HIDDEN),
        ("block_count", LAYERS),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("rope.dimension_count", HEAD_DIM),
        ("vocab_size", len(tokens)),
    ):
        writer.add_uint32(f"{prefix}.{key}", value)
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{prefix}.rope.freq_base", 10000.0)
    for key, value in (kv or {}).items():
        adders = {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}
        adders[type(value)](key, value)

    tiny = TinyGGUF(path)
    embeddings = rng.normal(0, 0.05, (len(tokens), HIDDEN)).astype(np.float32)
    tiny.source["model.embed_tokens.weight"] = embeddings
    add_tensor(writer, "token_embd.weight", embeddings, Q.Q8_0)
    norm = (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32)
    tiny.source["model.norm.weight"] = norm
    add_tensor(writer, "output_norm.weight", norm, Q.F64 if float64_norm else Q.F32)
    if not tied:
        head = rng.normal(0, 0.05, (len(tokens), HIDDEN)).astype(np.float32)
        tiny.source["lm_head.weight"] = head
        add_tensor(writer, "output.weight", head, Q.F16)
    for layer in range(LAYERS):
        for kind, (part, shape) in HF_PARTS.items():
            if kind.endswith("norm"):
                weights = (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
            else:
                weights = rng.normal(0, 0.1, shape).astype(np.float32)
            tiny.source[f"model.layers.{layer}.{part}.weight"] = weights
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind)
            stored = weights if heads is None else llama_cpp_permute(weights, heads)
            qtype = LAYER_TYPES[kind][layer]
            if projection_type is not None and not kind.endswith("norm"):
                qtype = projection_type
            add_tensor(writer, f"blk.{layer}.{kind}.weight", stored, qtype)
    for name in extra_tensors:
        add_tensor(writer, name, np.ones(HEAD_DIM // 2, dtype=np.float32), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny

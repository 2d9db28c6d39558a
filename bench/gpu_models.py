"""The models bench/gpu.py measures and the peers it measures them against (a part of it): random-
weight Llamas of real shapes, nothing from a model hub, and as little disk as the figure allows.

- The parity model (SmolLM2-135M's shape) is built by transformers and saved as a checkpoint, which
  our engine reads through its own loader: the one place the GPU run exercises the load path.
- The 1 B model is built by transformers (its `generate` is the peer), and our engine takes the
  same tensors in memory: nothing is saved or read back.
- The 8 B model exists only in our engine: its weights are drawn on the GPU in the engine's dtype,
  under the loader's names and shapes (`random_weights`). Its directory holds config.json and a
  tokenizer, nothing else.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

LLAMA_1B = dict(  # Llama-3.2-1B's shape with SmolLM2's 49,152-token vocabulary
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
LLAMA_8B = dict(  # as Llama-3.1-8B's config: Llama 3's rotary scaling up to 128 k positions
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)
# --smoke: the same flow on tiny shapes, on the CPU.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)
# The 8 B's stand-in: its own LM head and Llama 3's rotary scaling, as LLAMA_8B.
TINY_8B = TINY | {
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA_8B["rope_scaling"] | {"original_max_position_embeddings": 64},
}
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# (directory's config, dtype) -> every weight by the loader's name, on the engine's device.
WeightSource = Callable[[object, torch.dtype], dict[str, torch.Tensor]]


def num_parameters(shape: dict) -> int:
    """Parameters of a Llama of `shape`, a tied embedding counted once (LLAMA_1B: 1,073,809,408;
    LLAMA_8B: 8,030,261,248)."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    embeddings = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return embeddings + shape["num_hidden_layers"] * per_layer + h


def size_label(shape: dict) -> str:
    """`1.07B`, `8.03B` (`107k` for --smoke's): the table's name for a shape, from its real
    parameter count."""
    n = num_parameters(shape)
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


# -- checkpoint directories ------------------------------------------------------------------------


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer that covers every id of the model (random weights emit any id):
    ChatML's special tokens at 0-2, then one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>"})
    )


def model_dir(directory: Path, shape: dict, model=None) -> Path:
    """A checkpoint directory for `shape`: config.json and the tokenizer, and `model`'s weights when
    one is given (transformers' save_pretrained), else none."""
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save_pretrained(directory)
    else:
        # A copy: transformers fills a shape's rope dict in place. `architectures` is what a model
        # would write: the engine reads the family from it.
        config = LlamaConfig(**copy.deepcopy(shape), architectures=["LlamaForCausalLM"])
        config.save_pretrained(directory)
    write_tokenizer(directory, shape["vocab_size"])
    return directory


def build_hf(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """transformers' random-weight Llama of `shape`, initialised in `dtype` on `device` (no host
    copy), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LlamaForCausalLM(LlamaConfig(**copy.deepcopy(shape)))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of `model`'s parameters (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- weights handed to our engine in memory --------------------------------------------------------


def hf_weights(model) -> WeightSource:
    """`model`'s own tensors, shared, under the names the engine's loader reads."""

    def weights(config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from libs.engine.models.loader import expected_shapes

        names = expected_shapes(config)
        return {name: t.detach() for name, t in model.state_dict().items() if name in names}

    return weights


def random_weights(device: torch.device, seed: int) -> WeightSource:
    """Every tensor the loader would read, drawn on `device` in the engine's dtype: norms 1, the rest
    N(0, 0.02) as transformers initialises a Llama. Decode speed does not depend on the values."""

    def weights(config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from libs.engine.models.loader import expected_shapes

        g = torch.Generator(device=device).manual_seed(seed)
        out = {}
        for name, shape in expected_shapes(config).items():
            t = torch.empty(shape, dtype=dtype, device=device)
            out[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=g)
        return out

    return weights


def engine_class(weights: WeightSource | None):
    """LLMEngine, or, given `weights`, an LLMEngine that takes its weights from them instead of
    reading the checkpoint (everything else, config and tokenizer included, from the directory)."""
    from libs.engine import LLMEngine

    if weights is None:
        return LLMEngine
    from libs.engine.models.decoder import DecoderModel

    class InMemoryEngine(LLMEngine):
        def _load_model(self, ops):
            tensors = weights(self.model_config, self.dtype)
            return DecoderModel(self.model_config, tensors, ops, self.device, self.dtype, self.max_model_len)

    return InMemoryEngine


# -- experts ---------------------------------------------------------------------------------------


def lora_packages(
    root: Path, checkpoint: Path, shape: dict, count: int, rank: int
) -> tuple[list[Path], Path]:
    """`count` signed packages of random rank-`rank` LoRAs on all seven projections, written in
    peft's format (no model load per adapter), under `root`; and the trusted-keys directory."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "bench"))
    from adapters import make_packages

    h, i_size, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i_size),
        "up_proj": (h, i_size),
        "down_proj": (i_size, h),
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": LORA_MODULES,
        "bias": "none",
    }
    dirs = []
    for n in range(count):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for module, (fan_in, fan_out) in dims.items():
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        out = root / f"lora-{n}"
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, out / "adapter_model.safetensors")
        dirs.append(out)
    return make_packages(str(checkpoint), dirs, root)


# -- transformers ----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate_rate(
    model, batch: int, prompt_len: int, new: int, vocab: int, seed: int, static: bool, device: torch.device
) -> float:
    """transformers `generate`: batch 1 -> decode tokens/s, (time of new + 1 tokens - time of 1) /
    new; batch > 1 -> generated tokens/s with prefill. static: its static cache, `generate`
    compiling the forward itself (the warm-up then runs the whole length, to compile)."""
    extra = {"cache_implementation": "static"} if static else {}
    ids = torch.tensor(random_prompts(batch, prompt_len, vocab, seed), device=device)

    @torch.inference_mode()
    def timed(tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
        _sync(device)
        return time.perf_counter() - start

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed(new + 1 if static else 8)  # warm-up (static: the compile)
        if batch == 1:
            return new / (timed(new + 1) - timed(1))
        return batch * new / timed(new)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int, device: torch.device) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt], device=device),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()

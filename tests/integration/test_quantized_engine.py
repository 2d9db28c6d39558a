"""The engine on quantized weights: batch invariance, GGUF tensors served as they are against
quantizing at load, experts against `peft` on the dequantized base, and the errors a user sees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from libs.config import ConfigError
from libs.engine import LLMEngine, SamplingParams, quant
from libs.engine.kernels.build import load as kernels_load
from libs.engine.models.config import CheckpointError
from libs.engine.models.gguf import GGUFImportError, import_gguf
from tests.helpers.experts import Publisher, peft_greedy, peft_model
from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter, write_prompt_tuning_adapter
from tests.helpers.reference import capture_logits
from tests.helpers.tiny_checkpoint import write_checkpoint
from tests.helpers.tiny_gguf import write_tiny_gguf

KERNELS = ["native", "torch"] if kernels_load() else ["torch"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> Path:
    """Tied embeddings: the quantized LM head is also the table the tokens are looked up in."""
    return write_checkpoint(tmp_path_factory.mktemp("tied") / "llama", tie_word_embeddings=True, seed=5)


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 40, (count,), generator=g)
    ]


@pytest.mark.skipif(not kernels_load(), reason="batch invariance is the native kernels' guarantee")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_sixteen_prompts_together_equal_each_alone_bitwise(tied_llama, quantization):
    engine = LLMEngine.from_pretrained(
        str(tied_llama), quantization=quantization, kernels="native", num_blocks=256, max_num_seqs=16
    )
    assert (
        engine.model.weight_formats == {"int8": 1, quantization: 8} if quantization == "int4" else {"int8": 9}
    )
    prompts = _prompts(16)
    logits = capture_logits(engine)
    alone = []
    for prompt in prompts:
        logits.clear()
        out = engine.generate([prompt], GREEDY)[0]
        alone.append((out.token_ids, torch.cat(logits)))
    logits.clear()
    together = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == [tokens for tokens, _ in alone]
    # Each step's logits hold one row per sequence still running; with ignore_eos all 16 run to
    # the end, in order.
    steps = torch.stack(logits)  # [12 steps, 16 rows, vocab]
    for i, (_, own) in enumerate(alone):
        assert torch.equal(steps[:, i], own), f"prompt {i}"


def _gguf_pair(root: Path, projection_type: Q) -> tuple[Path, Path]:
    """The same tiny GGUF imported twice: kept quantized, and dequantized to float32."""
    tiny = write_tiny_gguf(root / "tiny.gguf", projection_type=projection_type)  # token_embd Q8_0, tied
    return (
        import_gguf(tiny.path, root / "kept", keep_quantized=True),
        import_gguf(tiny.path, root / "float32"),
    )


def _close_to_float(logits: torch.Tensor, float_logits: torch.Tensor, kernels: str) -> None:
    """The same weights as the float32 model give its logits to rounding. The native kernels also
    round activations to 16-bit integers per block of 32 inputs (at most 2^-16 of the block's
    largest), which moves these logits by about 1e-4 of the largest of them."""
    if kernels == "torch":
        torch.testing.assert_close(logits, float_logits, rtol=1e-4, atol=1e-4)
    else:
        assert (logits - float_logits).abs().max() <= 5e-4 * float_logits.abs().max()


def _logits(path: Path, prompts: list[list[int]], **settings) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens, and the logits that follow each prompt (same context whatever was sampled)."""
    engine = LLMEngine.from_pretrained(str(path), num_blocks=64, **settings)
    logits = capture_logits(engine)
    tokens = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    return tokens, logits[0]


@pytest.mark.parametrize("kernels", KERNELS)
def test_gguf_q4_1_served_as_it_is_equals_int4_quantized_at_load(tmp_path, kernels):
    kept, dequantized = _gguf_pair(tmp_path, Q.Q4_1)
    engine = LLMEngine.from_pretrained(str(kept), num_blocks=16, kernels=kernels)
    assert engine.model.weight_formats == {"int8": 1, "int4": 8}  # Q8_0 head, Q4_1 layers
    prompts = _prompts(3)
    kept_tokens, kept_logits = _logits(kept, prompts, kernels=kernels)
    at_load_tokens, at_load_logits = _logits(dequantized, prompts, kernels=kernels, quantization="int4")
    _, float_logits = _logits(dequantized, prompts, kernels=kernels)
    assert kept_tokens == at_load_tokens
    # Q4_1's values re-quantized with a scale and minimum per 32 come back to (nearly) the same
    # codes, and Q8_0's embedding as int8 groups of 32 to the same: the logits agree to rounding.
    torch.testing.assert_close(kept_logits, at_load_logits, rtol=1e-4, atol=1e-4)
    _close_to_float(kept_logits, float_logits, kernels)


@pytest.mark.parametrize("kernels", KERNELS)
def test_gguf_q8_0_served_as_it_is_is_close_to_int8_quantized_at_load(tmp_path, kernels):
    kept, dequantized = _gguf_pair(tmp_path, Q.Q8_0)
    prompts = _prompts(3)
    _, kept_logits = _logits(kept, prompts, kernels=kernels)
    _, float_logits = _logits(dequantized, prompts, kernels=kernels)
    _, at_load_logits = _logits(dequantized, prompts, kernels=kernels, quantization="int8")
    # Kept: exactly the file's weights, so the float32 import's logits to rounding.
    _close_to_float(kept_logits, float_logits, kernels)
    # At load: per output channel instead of per 32, each weight within half a step of 1/127 of
    # its row's largest; the logits move by a small fraction of their spread.
    assert (kept_logits - at_load_logits).abs().max() < 0.05 * kept_logits.abs().max()


def test_a_gguf_type_that_is_not_kept_is_refused_by_name(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "q5.gguf", projection_type=Q.Q5_0)
    with pytest.raises(GGUFImportError, match=r"has type Q5_0, which is not kept as it is"):
        import_gguf(tiny.path, tmp_path / "kept", keep_quantized=True)
    assert not (tmp_path / "kept").exists()
    import_gguf(tiny.path, tmp_path / "float32")  # dequantized, it imports


def test_unsupported_quantization_names_are_refused_by_field(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match=r"^quantization: expected one of int8, int4 or none, got 'fp8'"):
        LLMEngine.from_pretrained(str(tiny_llama), quantization="fp8")
    kept, _ = _gguf_pair(tmp_path, Q.Q4_1)
    with pytest.raises(CheckpointError, match="stored quantized and are served as they are"):
        LLMEngine.from_pretrained(str(kept), quantization="int8")


def _dequantized_base(base: Path, out: Path, quantization: str) -> Path:
    """`base` with every weight the engine quantizes replaced by its dequantized values: the model
    the engine actually runs, for peft to run too."""
    out.mkdir()
    for file in base.iterdir():
        if file.name != "model.safetensors" and file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(base / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = quant.dequantize(quant.quantize(tensor, quantization))
        elif name == "lm_head.weight":
            tensors[name] = quant.dequantize(quant.quantize(tensor, "int8", 32))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_on_a_quantized_base_match_peft_on_the_dequantized_base(tiny_llama, tmp_path, quantization):
    publisher = Publisher.create(tmp_path / "publisher")
    reference = _dequantized_base(tiny_llama, tmp_path / "dequantized", quantization)
    adapters = {
        "lora": write_lora_adapter(tiny_llama, tmp_path / "lora", seed=1),
        "ia3": write_ia3_adapter(tiny_llama, tmp_path / "ia3", seed=3),
        "soft-prompt": write_prompt_tuning_adapter(
            tiny_llama, tmp_path / "soft", num_virtual_tokens=6, seed=4
        ),
    }
    engine = LLMEngine.from_pretrained(str(tiny_llama), quantization=quantization, num_blocks=64)
    for name, directory in adapters.items():
        engine.load_expert(
            publisher.pack(directory, tiny_llama, tmp_path / f"{name}.expert", name), publisher.trusted
        )
    prompt = [5, 6, 7, 8, 9, 10, 11]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for name, directory in adapters.items():
        expected = peft_greedy(peft_model(reference, {name: directory}), prompt, 24)
        assert engine.generate([prompt], params, experts=[(name, 1.0)])[0].token_ids == expected, name

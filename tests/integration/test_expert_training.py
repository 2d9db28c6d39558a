"""`expertctl expert train` on a tiny generated model, with peft and transformers as the reference:
the loss falls, only the answers carry loss, samples are rendered exactly as the engine renders a
request, each adapter type the CLI trains loads into our engine and gives peft's greedy tokens, and
bad data is refused naming its line, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from libs.engine.tokenizer import Tokenizer
from libs.training.data import Sample
from libs.training.render import IGNORE, SampleEncoder
from libs.training.trainer import Trainer, TrainSettings
from tests.helpers.experts import Publisher, peft_greedy, peft_model
from tools.expertctl.main import main as expertctl

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "rocket")


def _samples(count: int = 40) -> list[dict]:
    """A learnable task: the answer repeats the prompt's last word in capitals."""
    return [
        {
            "prompt": f"Shout the word {WORDS[i % len(WORDS)]} {i}",
            "completion": f"{WORDS[i % len(WORDS)].upper()}!",
        }
        for i in range(count)
    ]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sample(prompt: str, completion: str, source: str = "t:1") -> Sample:
    return Sample(({"role": "user", "content": prompt}, {"role": "assistant", "content": completion}), source)


@pytest.fixture(scope="module")
def publisher(tmp_path_factory) -> Publisher:
    return Publisher.create(tmp_path_factory.mktemp("publisher"))


def test_a_sample_is_rendered_as_the_engine_renders_the_request(tiny_llama):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    encoded = SampleEncoder(tokenizer, 1024).encode(_sample("Shout the word apple", "APPLE!"))
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=16)
    served = engine.generate(
        [[{"role": "user", "content": "Shout the word apple"}]], SamplingParams(max_tokens=1)
    )
    context = served[0].prompt_token_ids
    assert list(encoded.input_ids[: len(context)]) == context
    answer = [*tokenizer.encode("APPLE!", add_special_tokens=False), tokenizer.eos_token_id]
    assert list(encoded.input_ids[len(context) : len(context) + len(answer)]) == answer


def test_prompt_tokens_carry_no_loss(tiny_llama):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    encoded = SampleEncoder(tokenizer, 1024).encode(
        Sample(
            (
                {"role": "system", "content": "Be loud."},
                {"role": "user", "content": "Shout apple"},
                {"role": "assistant", "content": "APPLE!"},
                {"role": "user", "content": "Shout river"},
                {"role": "assistant", "content": "RIVER!"},
            ),
            "t:1",
        )
    )
    learned = [t for t, label in zip(encoded.input_ids, encoded.labels, strict=True) if label != IGNORE]
    eos = tokenizer.eos_token_id
    expected = [*tokenizer.encode("APPLE!", add_special_tokens=False), eos]
    expected += [*tokenizer.encode("RIVER!", add_special_tokens=False), eos]
    assert learned == expected  # both answers and their end tokens; no system, user or template token


def test_the_trainers_loss_is_transformers_loss_over_the_answers_only(tiny_llama):
    """Our loss (LM head on the answer positions only, the batch's shared head run once) against
    transformers' own causal-LM loss with the prompt labelled -100, sample by sample."""
    tokenizer = Tokenizer.from_dir(tiny_llama)
    encoder = SampleEncoder(tokenizer, 1024)
    batch = [encoder.encode(_sample(r["prompt"], r["completion"])) for r in _samples(6)]
    trainer = Trainer(tiny_llama, TrainSettings(adapter_type="lora"), pad_id=0)
    torch.manual_seed(0)
    model = trainer._model().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.05)  # a LoRA B of zeros would hide a mistake in the adapter's path
        total, count = trainer._loss(model, batch)
        reference = sum(
            model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels])).loss.item()
            * e.num_learned
            for e in batch
        )
    assert count == sum(e.num_learned for e in batch)
    assert total.item() == pytest.approx(reference, rel=1e-4)


def test_the_loss_falls(tiny_llama, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(80))
    args = ["expert", "train", str(data), "--base", str(tiny_llama), "--out", str(tmp_path / "adapter")]
    assert expertctl([*args, "--epochs", "6", "--patience", "6", "--lr", "1e-2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["adapter"]
    held_out = [e["eval_loss"] for e in report["epochs"]]
    assert len(held_out) == 6 and held_out == sorted(held_out, reverse=True)
    assert held_out[-1] < 0.7 * held_out[0]
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"]
    assert (report["train_samples"], report["eval_samples"], report["best_epoch"]) == (72, 8, 6)


def test_training_stops_early_and_keeps_the_best_epoch(tiny_llama, tmp_path, capsys):
    """A learning rate too high for this task makes the held-out loss rise after the first epoch:
    with patience 1 training stops there, and the best epoch is the one kept."""
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(40))
    args = ["expert", "train", str(data), "--base", str(tiny_llama), "--out", str(tmp_path / "adapter")]
    assert expertctl([*args, "--epochs", "8", "--patience", "1", "--lr", "3e-2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["adapter"]
    held_out = [e["eval_loss"] for e in report["epochs"]]
    assert report["stopped_early"] and len(held_out) < 8
    assert held_out[-1] > min(held_out) and report["best_epoch"] == 1 + held_out.index(min(held_out))


def test_the_same_seed_trains_the_same_adapter(tiny_llama, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(16))
    for out in ("a", "b"):
        args = ["expert", "train", str(data), "--base", str(tiny_llama), "--out", str(tmp_path / out)]
        assert expertctl([*args, "--epochs", "1", "--seed", "7", "--json"]) == 0
    capsys.readouterr()
    weights = [(tmp_path / out / "adapter_model.safetensors").read_bytes() for out in ("a", "b")]
    assert weights[0] == weights[1]


@pytest.mark.parametrize("kind", ["lora", "ia3", "prompt-tuning"])
def test_each_adapter_type_trained_by_the_cli_matches_peft_in_our_engine(
    tiny_llama, tmp_path, publisher, kind, capsys
):
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(24))
    package = tmp_path / "shout.expert"
    code = expertctl(
        ["expert", "train", str(data), "--base", str(tiny_llama), "--type", kind,
         "--out", str(tmp_path / "adapter"), "--epochs", "2", "--virtual-tokens", "4",
         "--name", "shout", "--version", "1.0.0", "--description", "Shouts the word it is given.",
         "--key", str(publisher.key), "--package", str(package), "--examples", "5", "--json"]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["package"]["examples"] == 5

    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=64)
    engine.load_expert(package, publisher.trusted)
    prompt = [{"role": "user", "content": "Shout the word tiger 3"}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = engine.generate([prompt], params, experts=[("shout", 1.0)])[0]
    expected = peft_greedy(peft_model(tiny_llama, {"shout": tmp_path / "adapter"}), ours.prompt_token_ids, 12)
    assert ours.token_ids == expected


BAD_DATA = {
    "not JSON": (['{"prompt": "a", "completion": "b"}', "{not json"], "data.jsonl:2: not valid JSON"),
    "missing completion": (['{"prompt": "a"}'], "data.jsonl:1: completion: missing"),
    "empty completion": (['{"prompt": "a", "completion": "b"}'] * 2 + ['{"prompt": "a", "completion": " "}'],
                         "data.jsonl:3: completion: must not be empty"),
    "messages ending with the user": (['{"messages": [{"role": "user", "content": "hi"}]}'],
                                      "data.jsonl:1: messages: the last message must be the assistant's"),
    "unknown role": (['{"messages": [{"role": "robot", "content": "hi"}]}'],
                     "data.jsonl:1: messages[0].role"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_is_refused_naming_the_line_and_nothing_is_written(
    tiny_llama, tmp_path, publisher, case, capsys
):
    lines, message = BAD_DATA[case]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    code = _train_and_pack(tiny_llama, tmp_path, publisher, data)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "x.expert").exists()


def test_a_sample_longer_than_the_context_is_refused_naming_its_line(tiny_llama, tmp_path, publisher, capsys):
    records = [*_samples(4), {"prompt": "word " * 400, "completion": "TOO LONG"}]
    data = _write_jsonl(tmp_path / "data.jsonl", records)
    assert _train_and_pack(tiny_llama, tmp_path, publisher, data, "--max-length", "128") == 2
    err = capsys.readouterr().err
    assert "data.jsonl:5:" in err and "longer than the 128 the model takes" in err
    assert not (tmp_path / "adapter").exists()


def test_too_few_samples_for_the_split_are_refused(tiny_llama, tmp_path, publisher, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(1))
    assert _train_and_pack(tiny_llama, tmp_path, publisher, data, "--eval-fraction", "0.5") == 2
    assert "--eval-fraction: 1 sample(s) leave none to train on" in capsys.readouterr().err
    assert not (tmp_path / "adapter").exists()


def test_packing_needs_every_package_option(tiny_llama, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", _samples(4))
    args = ["expert", "train", str(data), "--base", str(tiny_llama), "--out", str(tmp_path / "adapter")]
    assert expertctl([*args, "--name", "shout"]) == 2
    assert "--version, --description, --key: needed to write a package" in capsys.readouterr().err


def _train_and_pack(base: Path, root: Path, publisher: Publisher, data: Path, *extra: str) -> int:
    return expertctl(
        ["expert", "train", str(data), "--base", str(base), "--out", str(root / "adapter"), "--epochs", "1",
         "--name", "x-expert", "--version", "1.0.0", "--description", "d", "--key", str(publisher.key),
         "--package", str(root / "x.expert"), *extra]
    )  # fmt: skip


def test_a_template_without_an_end_token_still_teaches_the_expert_to_stop(tiny_llama, tmp_path):
    import shutil

    base = tmp_path / "model"
    shutil.copytree(tiny_llama, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(base)
    encoded = SampleEncoder(tokenizer, 1024).encode(_sample("Shout apple", "APPLE!"))
    assert encoded.input_ids[-1] == tokenizer.eos_token_id and encoded.labels[-1] == tokenizer.eos_token_id

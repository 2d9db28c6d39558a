"""Experts inside the engine's batches on a tiny real model: mixed batches, refusals, the two tiers'
budgets and eviction, new versions, request validation and the figures for metrics."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import torch

from libs.engine import AsyncLLMEngine, InvalidRequestError, LLMEngine, SamplingParams
from libs.engine.adapters.registry import ExpertInUseError, ExpertNotFoundError, ExpertRefusedError
from libs.experts.archive import write_tar_gz
from libs.experts.integrity import format_checksums, sign_checksums
from libs.experts.signing import generate_keypair, load_private_key
from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter, write_prompt_tuning_adapter
from tests.helpers.tiny_checkpoint import write_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def publisher(tmp_path_factory) -> Publisher:
    return Publisher.create(tmp_path_factory.mktemp("publisher"))


@pytest.fixture(scope="module")
def packages(tiny_llama, tmp_path_factory, publisher) -> dict[str, Path]:
    """Four LoRAs, two IA³ adapters and two soft prompts, signed, for the tiny llama."""
    root = tmp_path_factory.mktemp("experts")
    made = {}
    for i in range(4):
        peft = write_lora_adapter(tiny_llama, root / f"lora-{i}", r=4 + 4 * (i % 2), seed=10 + i)
        made[f"lora-{i}"] = publisher.pack(peft, tiny_llama, root / f"lora-{i}.expert", f"lora-{i}")
    for i in range(2):
        peft = write_ia3_adapter(tiny_llama, root / f"ia3-{i}", seed=20 + i)
        made[f"ia3-{i}"] = publisher.pack(peft, tiny_llama, root / f"ia3-{i}.expert", f"ia3-{i}")
        peft = write_prompt_tuning_adapter(
            tiny_llama, root / f"soft-{i}", num_virtual_tokens=3 + i, seed=30 + i
        )
        made[f"soft-{i}"] = publisher.pack(peft, tiny_llama, root / f"soft-{i}.expert", f"soft-{i}")
    return made


def _engine(tiny_llama, packages, publisher, **settings) -> LLMEngine:
    settings = {"max_model_len": 256, "num_blocks": 200, **settings}
    engine = LLMEngine.from_pretrained(str(tiny_llama), **settings)
    for package in packages.values():
        engine.load_expert(package, publisher.trusted)
    return engine


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 300, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


EXPERT_SETS = [
    None,
    [("lora-0", 1.0)],
    [("ia3-0", 1.0)],
    [("soft-0", 1.0)],
    [("lora-1", 0.5), ("lora-2", -0.7), ("ia3-1", 1.0)],
    [("soft-1", 1.0), ("lora-3", 1.0), ("ia3-0", 0.6)],
    None,
    [("lora-0", 0.3), ("lora-1", 0.3), ("lora-2", 0.3)],
    [("soft-0", 1.0), ("soft-1", 1.0)],
    [("lora-3", 2.0)],
    [("ia3-1", 0.5)],
    [("lora-1", 1.0), ("soft-1", 1.0), ("ia3-0", 1.0)],
    None,
    [("lora-2", 1.0)],
    [("soft-1", 1.0)],
    [("lora-0", 1.0), ("ia3-1", 1.0), ("soft-0", 1.0)],
]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_sixteen_requests_with_different_expert_sets_match_their_solo_runs(
    tiny_llama, packages, publisher, params
):
    engine = _engine(tiny_llama, packages, publisher)
    prompts = _prompts(16)
    together = engine.generate(prompts, params, experts=EXPERT_SETS)
    alone = [engine.generate([p], params, experts=e)[0] for p, e in zip(prompts, EXPERT_SETS, strict=True)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [[x.name for x in o.experts] for o in together] == [[n for n, _ in e or []] for e in EXPERT_SETS]
    # the experts do change the outputs: the same prompt with and without one differs
    bare = engine.generate([prompts[1]], params)[0]
    assert bare.token_ids != together[1].token_ids


def test_n_outputs_and_preemption_keep_experts_applied(tiny_llama, packages, publisher):
    roomy = _engine(tiny_llama, packages, publisher)
    tight = _engine(tiny_llama, packages, publisher, num_blocks=12)
    prompts = _prompts(6, seed=3)
    experts = [[("lora-0", 1.0), ("soft-0", 1.0)], [("ia3-0", 1.0)], None] * 2
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, experts=experts)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, experts=experts)]
    assert tight.get_stats().num_preemptions_total > 0
    assert got == expected
    assert tight.experts.device_tier.used_bytes > 0
    assert all(r.pins == 0 for r in tight.experts.device_tier.resident.values())


def _unpack(package: Path) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(package.read_bytes()))) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _repack(files: dict[str, bytes], out: Path, *, sign_with: Path | None = None) -> Path:
    """Write `files` as a package; with `sign_with`, fresh checksums and a signature by that key
    (otherwise the checksums and signature stay as they were)."""
    if sign_with is not None:
        payload = {n: files[n] for n in ("manifest.json", "adapter_config.json", "adapter_model.safetensors")}
        checksums = format_checksums(payload)
        files = payload | {
            "checksums.sha256": checksums,
            "signature.json": sign_checksums(load_private_key(sign_with), checksums),
        }
    out.write_bytes(write_tar_gz(sorted(files.items())))
    return out


def test_refused_packages_name_the_problem_and_change_nothing(tiny_llama, packages, publisher, tmp_path):
    engine = _engine(tiny_llama, {k: v for k, v in packages.items() if k == "lora-0"}, publisher)
    before = (engine.list_experts(), engine.get_stats().experts)
    files = _unpack(packages["lora-1"])
    weights = files["adapter_model.safetensors"]
    flipped = files | {"adapter_model.safetensors": weights[:-1] + bytes([weights[-1] ^ 1])}
    other_key = Publisher.create(tmp_path / "other")
    forged = json.loads(
        _unpack(_repack(files, tmp_path / "f.expert", sign_with=other_key.key))["signature.json"]
    )
    forged["key_id"] = json.loads(files["signature.json"])["key_id"]  # claims the trusted key
    manifest = json.loads(files["manifest.json"]) | {"name": "../x"}
    other_model = write_checkpoint(tmp_path / "other-model", "llama", hidden_size=32, head_dim=16)
    cases = {
        "adapter_model.safetensors: checksum mismatch": _repack(flipped, tmp_path / "flip.expert"),
        "signature does not verify": _repack(
            files | {"signature.json": json.dumps(forged).encode()}, tmp_path / "forged.expert"
        ),
        "not in the trusted keyring": _repack(files, tmp_path / "unknown.expert", sign_with=other_key.key),
        "manifest.name: '../x' does not match": _repack(
            files | {"manifest.json": json.dumps(manifest).encode()},
            tmp_path / "name.expert",
            sign_with=publisher.key,
        ),
        "manifest.base_model is for another base model": publisher.pack(
            write_lora_adapter(other_model, tmp_path / "o", seed=1),
            other_model,
            tmp_path / "other.expert",
            "lora-9",
        ),
    }
    for problem, package in cases.items():
        for source in (package, package.read_bytes()):
            with pytest.raises(ExpertRefusedError, match=re.escape(problem)):
                engine.load_expert(source, publisher.trusted)
            assert (engine.list_experts(), engine.get_stats().experts) == before, problem


def test_a_package_signed_by_a_key_outside_the_keyring_is_refused(tiny_llama, packages, tmp_path):
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=64)
    generate_keypair(tmp_path / "elsewhere")
    empty = tmp_path / "trusted"
    empty.mkdir()
    (empty / "k.pub").write_bytes((tmp_path / "elsewhere" / "signing.pub").read_bytes())
    with pytest.raises(ExpertRefusedError, match="not in the trusted keyring"):
        engine.load_expert(packages["lora-0"], empty)
    assert engine.list_experts() == []


def test_a_small_device_budget_evicts_only_experts_nobody_uses(tiny_llama, packages, publisher):
    engine = _engine(tiny_llama, packages, publisher)
    one = engine.experts.device_tier.footprint(engine.experts.registry.get("lora-1"))
    engine = _engine(tiny_llama, packages, publisher, device_bytes=2 * one)  # room for two rank-8 LoRAs
    names = ["lora-1", "lora-3", "lora-0", "lora-2"]
    prompts = _prompts(4, seed=4)
    alone = [
        engine.generate([p], GREEDY, experts=[(n, 1.0)])[0].token_ids
        for p, n in zip(prompts, names, strict=True)
    ]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, experts=[(name, 1.0)])
    results = {}
    tier = engine.experts.device_tier
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        running = {u.expert.uid for s in engine.scheduler.running for u in s.experts}
        assert running <= set(tier.resident), "a running sequence's expert was evicted"
        assert tier.used_bytes <= tier.budget_bytes
        assert all(tier.resident[uid].pins > 0 for uid in running)
    assert [results[f"r{i}"] for i in range(4)] == alone
    assert tier.counters.evictions > 0


def test_experts_larger_than_the_device_budget_are_refused_at_once(tiny_llama, packages, publisher):
    probe = _engine(tiny_llama, {"lora-1": packages["lora-1"]}, publisher)
    one = probe.experts.device_tier.footprint(probe.experts.registry.get("lora-1"))
    engine = _engine(tiny_llama, packages, publisher, device_bytes=one + one // 2)
    engine.generate([[5, 6]], GREEDY, experts=["lora-1"])
    with pytest.raises(InvalidRequestError, match=r"experts: these experts need \d+ bytes on the device"):
        engine.add_request("too-big", [5, 6], GREEDY, experts=["lora-1", "lora-3"])
    assert not engine.has_unfinished_requests()


def test_a_new_version_changes_outputs_and_never_reuses_the_old_prefix(tiny_llama, publisher, tmp_path):
    v1 = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "v1", seed=1),
        tiny_llama,
        tmp_path / "1.expert",
        "skill",
        "1.0.0",
    )
    v2 = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "v2", seed=2),
        tiny_llama,
        tmp_path / "2.expert",
        "skill",
        "1.1.0",
    )
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=200)
    prompt = _prompts(1, seed=9)[0] * 3  # several full blocks
    engine.load_expert(v1, publisher.trusted)
    first = engine.generate([prompt], GREEDY, experts=["skill"])[0]
    again = engine.generate([prompt], GREEDY, experts=["skill"])[0]
    assert again.metrics.num_cached_tokens > 0 and again.token_ids == first.token_ids  # v1 blocks are reused
    assert engine.load_expert(v2, publisher.trusted) == ("skill", "1.1.0")
    hits = engine.get_stats().prefix_cache_hits
    second = engine.generate([prompt], GREEDY, experts=["skill"])[0]
    assert second.experts[0].version == "1.1.0"
    assert second.metrics.num_cached_tokens == 0 and engine.get_stats().prefix_cache_hits == hits
    assert second.token_ids != first.token_ids
    fresh = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=200)
    fresh.load_expert(v2, publisher.trusted)
    assert fresh.generate([prompt], GREEDY, experts=["skill"])[0].token_ids == second.token_ids
    assert [(e.name, e.version) for e in engine.list_experts()] == [("skill", "1.1.0")]


def test_a_version_in_use_survives_a_reload_until_its_requests_finish(tiny_llama, publisher, tmp_path):
    v1 = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "v1", seed=1),
        tiny_llama,
        tmp_path / "1.expert",
        "skill",
        "1.0.0",
    )
    v2 = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "v2", seed=2),
        tiny_llama,
        tmp_path / "2.expert",
        "skill",
        "2.0.0",
    )
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=200)
    engine.load_expert(v1, publisher.trusted)
    expected = engine.generate([[5, 6, 7]], GREEDY, experts=["skill"])[0].token_ids
    engine.add_request("old", [5, 6, 7], GREEDY, experts=["skill"])
    engine.step()
    engine.load_expert(v2, publisher.trusted)
    assert {(e.name, e.version, e.current) for e in engine.list_experts()} == {
        ("skill", "2.0.0", True),
        ("skill", "1.0.0", False),
    }
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].token_ids == expected and outputs[-1].experts[0].version == "1.0.0"
    assert [(e.name, e.version) for e in engine.list_experts()] == [("skill", "2.0.0")]


def test_unload_is_refused_while_a_request_uses_the_expert(tiny_llama, packages, publisher):
    engine = _engine(tiny_llama, packages, publisher)
    engine.add_request("busy", [5, 6, 7], GREEDY, experts=["lora-0"])
    with pytest.raises(ExpertInUseError, match="lora-0"):
        engine.unload_expert("lora-0")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_expert("lora-0")
    assert "lora-0" not in {e.name for e in engine.list_experts()}
    with pytest.raises(ExpertNotFoundError, match=r"experts\[0\]\.name: expert 'lora-0' is not loaded"):
        engine.add_request("gone", [5, 6, 7], GREEDY, experts=["lora-0"])


def test_the_host_budget_evicts_idle_experts_and_refuses_when_all_are_in_use(tiny_llama, packages, publisher):
    probe = _engine(tiny_llama, {"lora-1": packages["lora-1"]}, publisher)
    size = probe.list_experts()[0].host_bytes
    engine = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=256, num_blocks=100, host_bytes=2 * size
    )
    engine.load_expert(packages["lora-1"], publisher.trusted)
    engine.load_expert(packages["lora-3"], publisher.trusted)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("busy", [5, 6, 7], long, experts=["lora-3"])
    engine.load_expert(packages["lora-1"], publisher.trusted)  # already held: a hit, nothing evicted
    engine.generate([[8, 9]], GREEDY, experts=["lora-1"])
    engine.add_request("busy-2", [5, 6, 7], long, experts=["lora-1"])
    from libs.engine.adapters.registry import ExpertCapacityError

    with pytest.raises(ExpertCapacityError, match="in use"):
        engine.load_expert(packages["lora-0"], publisher.trusted)
    while engine.has_unfinished_requests():
        engine.step()
    engine.load_expert(packages["lora-0"], publisher.trusted)  # now an idle one makes room
    stats = engine.get_stats().experts
    assert stats.host_evictions_total == 1 and stats.load_hits_total == 1 and stats.host_bytes <= 2 * size


@pytest.mark.parametrize(
    ("experts", "field"),
    [
        ([("nope", 1.0)], "experts[0].name"),
        ([("lora-0", 1.0)] * 2, "experts[1].name"),
        ([("lora-0", float("nan"))], "experts[0].weight"),
        ([("lora-0", 0.0)], "experts[0].weight"),
        ([("lora-0", 11.0)], "experts[0].weight"),
        ([("lora-0", "high")], "experts[0].weight"),
        ([("lora-0", 1.0, 2)], "experts[0]"),
        ("lora-0", "experts"),
        ([f"lora-{i % 4}@9.9.9" for i in range(11)], "experts"),
    ],
)
def test_bad_expert_lists_are_refused_naming_the_entry(tiny_llama, packages, publisher, experts, field):
    engine = _engine(tiny_llama, packages, publisher)
    with pytest.raises((InvalidRequestError, ExpertNotFoundError)) as info:
        engine.add_request("bad", [5, 6, 7], GREEDY, experts=experts)
    assert str(info.value).startswith(field + ":")
    assert not engine.has_unfinished_requests()
    assert all(e.active_requests == 0 for e in engine.list_experts())


def test_incompatible_experts_are_refused_together(tiny_llama, publisher, tmp_path):
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=64)
    a = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "a", seed=1),
        tiny_llama,
        tmp_path / "a.expert",
        "alpha",
        "1.0.0",
        "--incompatible-with",
        "beta",
    )
    b = publisher.pack(
        write_lora_adapter(tiny_llama, tmp_path / "b", seed=2), tiny_llama, tmp_path / "b.expert", "beta"
    )
    engine.load_expert(a, publisher.trusted)
    engine.load_expert(b, publisher.trusted)
    with pytest.raises(InvalidRequestError, match="experts: 'beta' is incompatible with 'alpha'"):
        engine.add_request("x", [5, 6], GREEDY, experts=["beta", "alpha"])
    engine.generate([[5, 6]], GREEDY, experts=["alpha"])


def test_list_experts_and_stats_account_for_both_tiers(tiny_llama, packages, publisher):
    engine = _engine(tiny_llama, packages, publisher)
    infos = {e.name: e for e in engine.list_experts()}
    assert set(infos) == set(packages) and not any(e.resident for e in infos.values())
    engine.generate([[5, 6, 7]], GREEDY, experts=["lora-1", "soft-0"])
    infos = {e.name: e for e in engine.list_experts()}
    assert infos["lora-1"].resident and infos["soft-0"].resident and not infos["lora-0"].resident
    assert infos["lora-1"].device_bytes > 0 and infos["lora-1"].host_bytes > 0
    stats = engine.get_stats().experts
    assert stats.experts_held == len(packages) and stats.experts_resident == 2
    assert stats.device_bytes == infos["lora-1"].device_bytes + infos["soft-0"].device_bytes
    assert stats.host_bytes == sum(e.host_bytes for e in infos.values())
    engine.generate([[8, 9]], GREEDY, experts=["lora-1"])
    stats = engine.get_stats().experts
    assert (stats.device_loads_total, stats.device_hits_total, stats.experts_pinned_on_device) == (2, 1, 0)


def test_the_async_engine_loads_experts_on_its_thread_and_streams_with_them(tiny_llama, packages, publisher):
    async def main():
        engine = AsyncLLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=64)
        await engine.start()
        try:
            loaded = await engine.load_expert(packages["lora-0"].read_bytes(), publisher.trusted)
            outputs = [out async for out in engine.generate([5, 6, 7], GREEDY, experts=["lora-0"])]
            with pytest.raises(ExpertRefusedError, match=r"not a \.expert package"):
                await engine.load_expert(b"not a package", publisher.trusted)
            with pytest.raises(ExpertNotFoundError):
                engine.add_request("x", [5, 6], GREEDY, experts=["lora-1"])
            return loaded, outputs[-1], await engine.list_experts()
        finally:
            await engine.shutdown()

    loaded, final, infos = asyncio.run(main())
    expected = _engine(tiny_llama, {"lora-0": packages["lora-0"]}, publisher)
    assert loaded == ("lora-0", "1.0.0") and [e.name for e in infos] == ["lora-0"]
    assert final.token_ids == expected.generate([[5, 6, 7]], GREEDY, experts=["lora-0"])[0].token_ids


def test_holdings_report_exact_footprints_and_move_their_epoch_on_every_change(
    tiny_llama, packages, publisher
):
    """What preparation learns from the engine: a footprint known before the expert is resident
    and equal to what residency then takes, and an epoch that moves on loads, host-tier evictions
    and unloads (and not on generation)."""
    probe = _engine(tiny_llama, {"lora-1": packages["lora-1"]}, publisher)
    size = probe.list_experts()[0].host_bytes
    engine = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=256, num_blocks=100, host_bytes=2 * size
    )
    start = engine.expert_holdings()
    assert start.experts == () and start.host_budget_bytes == 2 * size and start.device_budget_bytes > 0

    engine.load_expert(packages["lora-1"], publisher.trusted)
    loaded = engine.expert_holdings()
    (held,) = loaded.experts
    assert loaded.epoch > start.epoch and not held.resident and held.footprint_bytes > 0
    engine.generate([[5, 6, 7]], GREEDY, experts=["lora-1"])
    (resident,) = engine.list_experts()
    assert resident.resident and resident.device_bytes == held.footprint_bytes
    assert engine.expert_holdings().epoch == loaded.epoch  # running requests change nothing held

    engine.load_expert(packages["lora-3"], publisher.trusted)
    engine.load_expert(packages["lora-0"], publisher.trusted)  # evicts lora-1, the least recent
    evicted = engine.expert_holdings()
    assert {e.name for e in evicted.experts} == {"lora-3", "lora-0"}
    assert evicted.epoch >= loaded.epoch + 3  # two loads and an eviction
    engine.unload_expert("lora-3")
    assert engine.expert_holdings().epoch == evicted.epoch + 1

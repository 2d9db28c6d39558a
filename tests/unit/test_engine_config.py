"""EngineConfig: every EXPERT_* variable is read, malformed values are refused naming the variable,
and overrides by keyword reject unknown names."""

from __future__ import annotations

import dataclasses

import pytest

from libs.engine import CacheConfig, ConfigError, EngineConfig, SchedulerConfig


def _get(config: EngineConfig, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


# variable, raw value, where it lands, the parsed value
VARIABLES = [
    ("EXPERT_MODEL_PATH", "/models/tiny", "model", "/models/tiny"),
    ("EXPERT_DEVICE", "cpu", "device", "cpu"),
    ("EXPERT_DEVICE", "cuda:1", "device", "cuda:1"),
    ("EXPERT_DTYPE", "bfloat16", "dtype", "bfloat16"),
    ("EXPERT_KERNELS", "torch", "kernels", "torch"),
    ("EXPERT_NUM_THREADS", "3", "num_threads", 3),
    ("EXPERT_MAX_MODEL_LEN", "4096", "max_model_len", 4096),
    ("EXPERT_SEED", "1234", "seed", 1234),
    ("EXPERT_CUDA_GRAPHS", "on", "cuda_graphs", "on"),
    ("EXPERT_ASYNC_SCHEDULING", "off", "async_scheduling", "off"),
    ("EXPERT_KV_BLOCK_SIZE", "32", "cache.block_size", 32),
    ("EXPERT_KV_NUM_BLOCKS", "500", "cache.num_blocks", 500),
    ("EXPERT_KV_CACHE_BYTES", "1000000", "cache.kv_cache_bytes", 1_000_000),
    ("EXPERT_KV_CACHE_MEMORY_FRACTION", "0.5", "cache.memory_fraction", 0.5),
    ("EXPERT_PREFIX_CACHING", "false", "cache.enable_prefix_caching", False),
    ("EXPERT_KV_CACHE_DTYPE", "int8", "cache.kv_cache_dtype", "int8"),
    ("EXPERT_MAX_NUM_SEQS", "8", "scheduler.max_num_seqs", 8),
    ("EXPERT_MAX_NUM_BATCHED_TOKENS", "512", "scheduler.max_num_batched_tokens", 512),
    ("EXPERT_SCHEDULER_AGING_SECONDS", "0.25", "scheduler.aging_seconds", 0.25),
    ("EXPERT_SCHEDULER_AGING_SECONDS", "0", "scheduler.aging_seconds", 0.0),
]


def test_no_variables_give_the_defaults():
    assert EngineConfig.from_env({}) == EngineConfig()


@pytest.mark.parametrize(("variable", "raw", "path", "expected"), VARIABLES, ids=[v[0] for v in VARIABLES])
def test_each_variable_sets_its_field(variable, raw, path, expected):
    config = EngineConfig.from_env({variable: raw})
    assert _get(config, path) == expected
    assert config == EngineConfig().with_overrides(**{path.rpartition(".")[2]: expected})


def test_all_variables_together():
    env = {variable: raw for variable, raw, _, _ in VARIABLES}
    env["EXPERT_DEVICE"] = "cpu"
    env["EXPERT_SCHEDULER_AGING_SECONDS"] = "0.25"
    config = EngineConfig.from_env(env)
    assert config == EngineConfig(
        model="/models/tiny",
        device="cpu",
        dtype="bfloat16",
        kernels="torch",
        num_threads=3,
        max_model_len=4096,
        seed=1234,
        cuda_graphs="on",
        async_scheduling="off",
        cache=CacheConfig(
            block_size=32,
            num_blocks=500,
            kv_cache_bytes=1_000_000,
            memory_fraction=0.5,
            enable_prefix_caching=False,
            kv_cache_dtype="int8",
        ),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, aging_seconds=0.25),
    )


def test_unrelated_variables_are_ignored():
    assert EngineConfig.from_env({"EXPERT_UNKNOWN": "x", "PATH": "/bin"}) == EngineConfig()


def test_blank_values_keep_the_defaults():
    env = {variable: "  " for variable, _, _, _ in VARIABLES}
    assert EngineConfig.from_env(env) == EngineConfig()


def test_values_are_stripped_of_surrounding_spaces():
    config = EngineConfig.from_env({"EXPERT_MAX_NUM_SEQS": " 8 ", "EXPERT_DTYPE": " float32\n"})
    assert config.scheduler.max_num_seqs == 8
    assert config.dtype == "float32"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), ("On", True), ("0", False), ("False", False), ("no", False)],
)
def test_booleans_accept_the_usual_spellings(raw, expected):
    assert EngineConfig.from_env({"EXPERT_PREFIX_CACHING": raw}).cache.enable_prefix_caching is expected


def test_from_env_without_a_mapping_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("EXPERT_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("EXPERT_KV_BLOCK_SIZE", "8")
    config = EngineConfig.from_env()
    assert config.scheduler.max_num_seqs == 5
    assert config.cache.block_size == 8


MALFORMED = [
    ("EXPERT_NUM_THREADS", "two"),
    ("EXPERT_NUM_THREADS", "1.5"),
    ("EXPERT_MAX_MODEL_LEN", "4k"),
    ("EXPERT_SEED", "0x10"),
    ("EXPERT_KV_BLOCK_SIZE", "sixteen"),
    ("EXPERT_KV_NUM_BLOCKS", "many"),
    ("EXPERT_KV_CACHE_BYTES", "1GB"),
    ("EXPERT_KV_CACHE_MEMORY_FRACTION", "half"),
    ("EXPERT_PREFIX_CACHING", "maybe"),
    ("EXPERT_MAX_NUM_SEQS", "8.0"),
    ("EXPERT_MAX_NUM_BATCHED_TOKENS", "lots"),
    ("EXPERT_SCHEDULER_AGING_SECONDS", "2s"),
]


@pytest.mark.parametrize(("variable", "raw"), MALFORMED, ids=[f"{v}={r}" for v, r in MALFORMED])
def test_an_unparsable_value_is_refused_naming_the_variable(variable, raw):
    with pytest.raises(ConfigError, match=rf"^{variable}: .*{raw!r}"):
        EngineConfig.from_env({variable: raw})


OUT_OF_RANGE = [
    ("EXPERT_DEVICE", "tpu"),
    ("EXPERT_DTYPE", "float8"),
    ("EXPERT_KERNELS", "fast"),
    ("EXPERT_CUDA_GRAPHS", "maybe"),
    ("EXPERT_ASYNC_SCHEDULING", "sometimes"),
    ("EXPERT_NUM_THREADS", "0"),
    ("EXPERT_NUM_THREADS", "-1"),
    ("EXPERT_MAX_MODEL_LEN", "1"),
    ("EXPERT_KV_BLOCK_SIZE", "0"),
    ("EXPERT_KV_BLOCK_SIZE", "12"),
    ("EXPERT_KV_NUM_BLOCKS", "1"),
    ("EXPERT_KV_CACHE_BYTES", "0"),
    ("EXPERT_KV_CACHE_BYTES", "-5"),
    ("EXPERT_KV_CACHE_MEMORY_FRACTION", "0.99"),
    ("EXPERT_KV_CACHE_MEMORY_FRACTION", "0"),
    ("EXPERT_KV_CACHE_DTYPE", "fp8"),
    ("EXPERT_MAX_NUM_SEQS", "0"),
    ("EXPERT_MAX_NUM_SEQS", "-3"),
    ("EXPERT_MAX_NUM_BATCHED_TOKENS", "0"),
    ("EXPERT_MAX_NUM_BATCHED_TOKENS", "32"),  # below the default max_num_seqs (64)
    ("EXPERT_SCHEDULER_AGING_SECONDS", "-1"),
]


@pytest.mark.parametrize(("variable", "raw"), OUT_OF_RANGE, ids=[f"{v}={r}" for v, r in OUT_OF_RANGE])
def test_an_out_of_range_value_is_refused_naming_the_variable(variable, raw):
    with pytest.raises(ConfigError, match=rf"^{variable}: "):
        EngineConfig.from_env({variable: raw})


def test_a_value_inconsistent_with_another_names_the_variable_checked():
    with pytest.raises(ConfigError, match=r"^EXPERT_MAX_NUM_BATCHED_TOKENS: .*max_num_seqs \(128\)"):
        EngineConfig.from_env({"EXPERT_MAX_NUM_SEQS": "128", "EXPERT_MAX_NUM_BATCHED_TOKENS": "100"})


# -- with_overrides -------------------------------------------------------------------------------


def test_overrides_reach_top_level_cache_and_scheduler_fields():
    config = EngineConfig().with_overrides(
        model="/m", seed=7, num_blocks=64, block_size=8, max_num_seqs=4, aging_seconds=0.0
    )
    assert (config.model, config.seed) == ("/m", 7)
    assert (config.cache.num_blocks, config.cache.block_size) == (64, 8)
    assert (config.scheduler.max_num_seqs, config.scheduler.aging_seconds) == (4, 0.0)


def test_overrides_leave_the_original_untouched():
    base = EngineConfig()
    base.with_overrides(max_num_seqs=2, num_blocks=10, dtype="float32")
    assert base == EngineConfig()


def test_overrides_keep_the_fields_not_named():
    base = EngineConfig.from_env({"EXPERT_KV_BLOCK_SIZE": "32", "EXPERT_MAX_NUM_SEQS": "8"})
    config = base.with_overrides(num_blocks=100, max_num_batched_tokens=256)
    assert config.cache == dataclasses.replace(base.cache, num_blocks=100)
    assert config.scheduler == dataclasses.replace(base.scheduler, max_num_batched_tokens=256)


@pytest.mark.parametrize("name", ["max_num_sequences", "blocksize", "prefix_caching", "Model"])
def test_an_unknown_override_is_refused_naming_it(name):
    with pytest.raises(ConfigError, match=rf"^{name}: not an engine setting"):
        EngineConfig().with_overrides(**{name: 1})


def test_an_invalid_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"^max_num_seqs: "):
        EngineConfig().with_overrides(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"^dtype: "):
        EngineConfig().with_overrides(dtype="int8")


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("auto", "auto"),
        ("float32", "float32"),
        ("float", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("half", "float16"),
        ("torch.float32", None),
        ("fp32", None),
        ("int8", None),
        (None, None),
        (32, None),
    ],
)
def test_dtype_takes_vllm_names_and_keeps_the_canonical_one(given, kept):
    if kept is None:
        with pytest.raises(ConfigError, match=r"^dtype: expected auto, float32 .* got "):
            EngineConfig(dtype=given)
    else:
        assert EngineConfig(dtype=given).dtype == kept
        assert EngineConfig().with_overrides(dtype=given) == EngineConfig(dtype=kept)


def test_dtype_takes_a_torch_dtype():
    torch = pytest.importorskip("torch")
    for given, kept in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.half, "float16")):
        assert EngineConfig(dtype=given).dtype == kept
        assert EngineConfig().with_overrides(dtype=given) == EngineConfig(dtype=kept)
    for refused in (torch.float64, torch.int8):
        with pytest.raises(ConfigError, match=rf"^dtype: .* got {refused}$"):
            EngineConfig(dtype=refused)


def test_a_bad_dtype_given_to_from_pretrained_is_refused_before_anything_loads():
    torch = pytest.importorskip("torch")
    from libs.engine import AsyncLLMEngine, LLMEngine

    for build in (LLMEngine.from_pretrained, AsyncLLMEngine.from_pretrained):
        with pytest.raises(ConfigError, match=r"^dtype: "):
            build("/nowhere", dtype=torch.int8)
        with pytest.raises(ConfigError, match=r"^dtype: "):
            build("/nowhere", dtype="fp8")


def test_the_config_is_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = "elsewhere"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.num_blocks = 3  # type: ignore[misc]


@pytest.mark.parametrize("raw", ["nan", "inf"])
def test_a_non_finite_number_is_refused_naming_the_variable(raw):
    with pytest.raises(ConfigError, match="EXPERT_KV_CACHE_MEMORY_FRACTION"):
        EngineConfig.from_env({"EXPERT_KV_CACHE_MEMORY_FRACTION": raw})


def test_the_engine_raises_the_config_error_every_service_reports_at_start_up():
    """One ConfigError: `libs.grpc_server` logs it as one line (no traceback) for every service."""
    from libs.config import ConfigError as SharedConfigError

    assert ConfigError is SharedConfigError

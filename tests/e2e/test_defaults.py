"""Defaults that fit the model, through the whole stack: the engine reports its checkpoint's
generation_config.json, preparation passes it on with the fleet's capacity, and the router tunes
with it over the task-type table; without a user max_tokens, the deployment's ceiling bounds the
output."""

from __future__ import annotations

import json
import shutil

from expert_system import ExpertClient


def test_the_checkpoints_sampling_and_the_ceiling_shape_a_request_that_sets_neither(
    tiny_stack, tiny_llama, tmp_path
):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config.update(temperature=0.3, top_k=7, do_sample=True)
    config_path.write_text(json.dumps(config))
    stack = tiny_stack(EXPERT_MODEL_PATH=str(model), EXPERT_ROUTER_MAX_TOKENS_DEFAULT="24")
    with ExpertClient(stack.target("reception")) as client:
        result = client.infer(prompt="Tell me a story", raw=True, repetition_penalty=1.0)
        explicit = client.infer(prompt="Tell me a story", raw=True, max_tokens=40, temperature=0.0)
    assert result.status == "completed", result.error
    trace = result.reasoning_trace.splitlines()
    assert (
        "tuning: the model's generation_config.json sets temperature 0.3, top_k 7 (over the table)" in trace
    )
    ceiling = [line for line in trace if "the deployment's ceiling" in line]
    assert ceiling and ceiling[0].startswith("tuning: max_tokens 24, the deployment's ceiling")
    assert 0 < result.tokens_generated <= 24
    assert explicit.status == "completed"
    assert not any("ceiling" in line for line in explicit.reasoning_trace.splitlines())
    assert "tuning: max_tokens = 40 (user)" in explicit.reasoning_trace

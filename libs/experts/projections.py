"""The projections of a decoder layer an expert's adapter may act on: the one list the engine
applies adapters to and the trainer and reception check a training spec against. Kept apart from
the engine's weights (which load torch) so that reception reads it without torch. Every family the
engine serves (Llama, Qwen2, Qwen3) names them alike, so peft finds each in the base model."""

from __future__ import annotations

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Input scaling (IA³ on a projection's input) needs the projection's own input; the fused q/k/v and
# gate/up matmuls share theirs, so only the last two have one.
INPUT_SCALABLE = ("o_proj", "down_proj")

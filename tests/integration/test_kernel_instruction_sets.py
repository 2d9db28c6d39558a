"""The native kernels compute the same bits on every instruction set they build for.

The engine compiles the kernels for the machine it runs on (AVX-512 VNNI, AVX2 or portable C++:
libs/engine/kernels/build.py), and a fleet may mix machine kinds: a token's numbers must not depend
on which one served it. Each build this machine can run is loaded in its own process (a process
loads one), and serves a tiny model in float32, int8 and int4; every logit of every step must be
the same bits as the machine's own build.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libs.engine.kernels import build
from tests.helpers.tiny_checkpoint import write_checkpoint

pytestmark = pytest.mark.skipif(not build.load(), reason="native kernels did not build on this machine")

REPO = Path(__file__).resolve().parents[2]
LOWER = {"avx512": ["avx2", "portable"], "avx2": ["portable"], "portable": []}

_SERVE = """
import sys, torch
import libs.engine.kernels.build as build
build._isa = lambda: sys.argv[1]  # a build this machine can run, maybe not the one it would pick
assert build.load(), build.load_error()
from libs.engine import LLMEngine, SamplingParams
from tests.helpers.reference import capture_logits
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
prompts = [[5, 17, 42, 99, 7] * n for n in (1, 3, 9)]  # together: prefill and decode in one batch
out = {}
for quantization in (None, "int8", "int4"):
    engine = LLMEngine.from_pretrained(
        sys.argv[2], num_blocks=32, kernels="native", quantization=quantization
    )
    logits = capture_logits(engine)
    tokens = [o.token_ids for o in engine.generate(prompts, greedy)]
    out[str(quantization)] = (tokens, logits)
torch.save(out, sys.argv[3])
"""


def _serve(isa: str, model: Path, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-c", _SERVE, isa, str(model), str(out)],
        cwd=REPO,
        check=True,
        timeout=900,
    )
    return torch.load(out)


def test_every_build_gives_the_same_logits(tmp_path):
    lower = LOWER[build._isa()]
    if not lower:
        pytest.skip("the portable build is the only one this machine runs")
    model = write_checkpoint(tmp_path / "llama", tie_word_embeddings=True, seed=11)
    own = _serve(build._isa(), model, tmp_path / "own.pt")
    for isa in lower:
        other = _serve(isa, model, tmp_path / f"{isa}.pt")
        for quantization, (tokens, logits) in own.items():
            other_tokens, other_logits = other[quantization]
            assert other_tokens == tokens, (isa, quantization)
            assert len(other_logits) == len(logits)
            for step, (a, b) in enumerate(zip(logits, other_logits, strict=True)):
                assert torch.equal(a, b), (isa, quantization, step)

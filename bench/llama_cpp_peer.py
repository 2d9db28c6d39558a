"""llama.cpp on the default model, through its C API, for bench/engine_throughput.py.

Runs inside a virtual environment that has llama-cpp-python (not the project's: it brings its own
numpy and build), as `DIR/bin/python bench/llama_cpp_peer.py JOB.json`, and prints one JSON object.
The job names the GGUF to measure (made from the default model's Q4_1 file with
llama_model_quantize when it is another type), the prompt, the number of greedy tokens and how many
times to time them (0: none), the threads, and the windows of token ids to compute the perplexity of
(none: no perplexity). Decoding is a plain loop of llama_decode and llama.cpp's own greedy
sampler: its Python `Llama` class adds about a quarter.

Build the environment once (about 13 minutes on two cores):

    python3 -m venv /tmp/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.36
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
import time
from pathlib import Path

import llama_cpp as ll
import numpy as np

FTYPES = {"F32": 0, "Q8_0": 7, "Q4_1": 3}  # llama_ftype: ALL_F32, MOSTLY_Q8_0, MOSTLY_Q4_1


def make_gguf(source: Path, target: Path, type_name: str) -> Path:
    """`source` requantized to `type_name` (cached at `target`); the source when it already is."""
    if target.is_file():
        return target
    params = ll.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.allow_requantize = True
    params.nthread = 2
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    if ll.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {type_name}")
    partial.rename(target)
    return target


class Runner:
    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx
        cparams.n_ubatch = n_ctx
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(self.sampler, ll.llama_sampler_init_greedy())
        self.position = 0

    def clear(self) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def decode(self, ids: list[int], logits_for_all: bool = False) -> None:
        batch = ll.llama_batch_init(len(ids), 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i] = token
                batch.pos[i] = self.position + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = logits_for_all or i == len(ids) - 1
            batch.n_tokens = len(ids)
            if ll.llama_decode(self.ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            self.position += len(ids)
        finally:
            ll.llama_batch_free(batch)

    def greedy_decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """Tokens per second of `new_tokens` greedy steps after `prompt` (prefill not counted)."""
        self.clear()
        self.position = 0
        self.decode(prompt)
        token = ll.llama_sampler_sample(self.sampler, self.ctx, -1)
        one = (ll.llama_token * 1)()
        start = time.perf_counter()
        for _ in range(new_tokens):
            one[0] = token
            if ll.llama_decode(self.ctx, ll.llama_batch_get_one(one, 1)) != 0:
                raise SystemExit("llama_decode failed")
            token = ll.llama_sampler_sample(self.sampler, self.ctx, -1)
        return new_tokens / (time.perf_counter() - start)

    def perplexity(self, windows: list[list[int]]) -> tuple[float, int]:
        nll, count = 0.0, 0
        for window in windows:
            self.clear()
            self.position = 0
            self.decode(window, logits_for_all=True)
            pointer = ll.llama_get_logits(self.ctx)
            logits = np.ctypeslib.as_array(pointer, shape=(len(window), self.n_vocab)).astype(np.float64)
            logits = logits[:-1]
            shifted = logits - logits.max(axis=1, keepdims=True)
            logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            targets = np.array(window[1:])
            nll -= float(logprobs[np.arange(len(targets)), targets].sum())
            count += len(targets)
        return math.exp(nll / count), count


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    path = make_gguf(Path(job["source"]), Path(job["target"]), job["type"])
    runner = Runner(path, job["threads"], max([512] + [len(w) + 8 for w in job["windows"]]))
    rates = []
    if job["repeats"]:
        runner.greedy_decode_rate(job["prompt"], 8)  # warm up
        rates = [runner.greedy_decode_rate(job["prompt"], job["new_tokens"]) for _ in range(job["repeats"])]
    ppl, scored = runner.perplexity(job["windows"]) if job["windows"] else (None, 0)
    print(
        json.dumps(
            {
                "decode": sorted(rates)[len(rates) // 2] if rates else None,
                "perplexity": ppl,
                "scored": scored,
                "gguf": str(path),
            }
        )
    )


if __name__ == "__main__":
    main()

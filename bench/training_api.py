"""One demo expert trained through the API, against the figure `make experts` records for it.

1. A stack on the default model with the trainer worker (tools.stack, `trainer=True`; EXPERT_AUTH off,
   as `make run`), its store and trusted keys in a temporary directory with a fresh publisher key.
2. The skill's training split, made by `tools/demo` as `make experts` makes it, goes up through the
   Files API (the openai client's `files.create`); the job goes in through `POST /v1/training/jobs`
   with the recipe's own settings (adapter type, rank, alpha, dropout, epochs, learning rate, batch
   size, seed: `Recipe.job_spec`, the settings `make experts` trains with written as a job spec) and
   the demo's name, version, description and keywords. The job the API returns must hold that spec
   field for field.
3. The wall time from the upload to the expert being routable: `<base>:<expert>` listed by
   `/v1/models`, as a client sees it.
4. The skill's metric on its held-out test split (200 samples, never trained on) through chat
   completions, greedy, `max_tokens` the skill's: the base model with the expert excluded
   (`exclude_experts`), `model=<base>:<expert>`, and the base model with the router choosing on
   its own (how often it chose the expert is printed).
5. The lift beside the one `bench/experts.py` recorded for the demo set (docs/experts.md) and the
   difference; target: within 5 points.

    python bench/training_api.py --model data/models/SmolLM2-135M-Instruct --skill date-normalize
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_POINTS = 5.0
# The lift `bench/experts.py` measured for each demo expert built by `make experts` (base, with the
# expert, on the 200 held-out samples; docs/experts.md "What the set measures").
RECORDED = {
    "json-extract": (32.6, 96.7),
    "sql-query": (1.0, 69.5),
    "date-normalize": (5.5, 78.0),
    "unit-convert": (0.0, 57.0),
    "ticket-triage": (0.0, 71.5),
    "review-sentiment": (0.0, 61.0),
}
POLL_S = 0.5


@dataclass
class Score:
    label: str
    percent: float
    seconds: float
    expert_used: int  # answers whose `expert_system.experts` names the expert


def stack_settings(model: Path, root: Path, threads: int) -> dict[str, str]:
    """A stack with a trainer: its own store, trusted keys and publisher key under `root`."""
    from libs.experts.signing import generate_keypair

    key, public = generate_keypair(root / "publisher")
    trusted = root / "trusted"
    trusted.mkdir()
    (trusted / "publisher.pub").write_bytes(public.read_bytes())
    return {
        "EXPERT_MODEL_PATH": str(model),
        "EXPERT_NUM_THREADS": str(threads),
        "EXPERT_MAX_MODEL_LEN": "1024",
        "EXPERT_KV_NUM_BLOCKS": "320",
        "EXPERT_LOG_LEVEL": "warning",
        "EXPERT_STORE": str(root / "experts"),
        "EXPERT_TRUSTED_KEYS": str(trusted),
        "EXPERT_TRAINER_SIGNING_KEY": str(key),
        "EXPERT_TRAINER_CHECKPOINT_DIR": str(root / "checkpoints"),
    }


def wait_ready(http, timeout: float = 600.0) -> None:
    """Until reception's /readyz answers 200 (an engine is registered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http.get("/readyz").status_code == 200:
            return
        time.sleep(0.5)
    raise SystemExit("reception's /readyz never answered 200")


def check_recipe_kept(job: dict, sent: dict) -> None:
    """The job the API stored is the spec sent, every field as it was (tests/unit/test_demo_recipes.py
    shows that spec trains with the recipe's settings): nothing dropped or defaulted on the way."""
    if job["spec"] != sent:
        raise SystemExit(f"the job's spec differs from the one sent:\n  {job['spec']}\n  {sent}")


def upload_and_train(openai_client, http, recipe, timeout: float) -> tuple[dict, dict]:
    """Upload the training split, create the job, wait until its expert is routable; the job and
    the times (seconds since the upload began)."""
    train, _ = recipe.splits()
    content = "".join(json.dumps(e.to_json(), ensure_ascii=False) + "\n" for e in train).encode()
    started = time.monotonic()
    file = openai_client.files.create(file=(f"{recipe.name}.jsonl", content), purpose="fine-tune")
    spec = recipe.job_spec(file.id)
    created = http.post("/v1/training/jobs", json=spec)
    if created.status_code != 201:
        raise SystemExit(f"POST /v1/training/jobs: {created.status_code} {created.text}")
    job = created.json()
    check_recipe_kept(job, spec)
    print(f"  uploaded {len(train)} samples as {file.id}; job {job['id']} created")
    job = wait_job(http, job["id"], started + timeout)
    finished = time.monotonic() - started
    fine_tuned = job["expert"]["model"]
    wait_listed(openai_client, fine_tuned, started + timeout)
    routable = time.monotonic() - started
    return job, {"completed": finished, "routable": routable, "model": fine_tuned}


def wait_job(http, job_id: str, deadline: float) -> dict:
    """The job once it ended, its progress printed as it goes; exits when it did not complete."""
    shown = None
    while time.monotonic() < deadline:
        job = http.get(f"/v1/training/jobs/{job_id}").json()
        metrics = job.get("metrics") or {}
        line = (job["status"], metrics.get("step"), metrics.get("total_steps") or "")
        if line != shown:
            step = f": step {line[1]}/{line[2]}" if line[1] else ""
            print(f"  {job['status']}{step}", flush=True)
            shown = line
        if job["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
            if job["status"] != "COMPLETED":
                raise SystemExit(f"job {job_id} ended {job['status']}: {job.get('error')}")
            return job
        time.sleep(POLL_S)
    raise SystemExit(f"job {job_id} did not end in time")


def wait_listed(openai_client, model: str, deadline: float) -> None:
    """Until /v1/models lists `model` (reception refreshes its list every 2 s)."""
    while time.monotonic() < deadline:
        if model in {m.id for m in openai_client.models.list()}:
            return
        time.sleep(0.2)
    raise SystemExit(f"{model} never appeared in /v1/models")


def evaluate(openai_client, label: str, model: str, recipe, examples, concurrency: int, extra: dict) -> Score:
    """The skill's metric (percent) over `examples` through chat completions, greedy."""
    skill = recipe.skill

    def one(example) -> tuple[float, bool]:
        response = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": example.prompt}],
            temperature=0.0,
            top_p=1.0,
            max_tokens=skill.max_new_tokens,
            extra_body={"repetition_penalty": 1.0, **extra},
        )
        used = (response.model_extra or {}).get("expert_system", {}).get("experts", [])
        return skill.score(response.choices[0].message.content or "", example), skill.name in used

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, examples))
    seconds = time.monotonic() - started
    percent = 100 * sum(score for score, _ in results) / len(results)
    return Score(label, percent, seconds, sum(used for _, used in results))


def report(recipe, job: dict, times: dict, scores: dict[str, Score], samples: int) -> None:
    metrics = job.get("metrics") or {}
    print(f"\nTime, upload to routable: {times['routable']:.1f} s")
    print(f"  (job COMPLETED {times['completed']:.1f} s after the upload began;")
    print(
        f"  queued {job['started_at'] - job['created_at']:.1f} s, trained and published in "
        f"{job['finished_at'] - job['started_at']:.1f} s, of which training "
        f"{metrics.get('training_seconds', 0.0):.1f} s; {metrics.get('step')} steps, "
        f"eval loss {metrics.get('eval_loss', float('nan')):.4f})"
    )
    print(f"\nHeld-out {recipe.skill.metric} on {samples} test samples, through chat completions (greedy):")
    print("| run | score | with the expert | seconds |")
    print("|---|---|---|---|")
    for s in scores.values():
        print(f"| {s.label} | {s.percent:.1f} | {s.expert_used}/{samples} | {s.seconds:.1f} |")
    base, expert = scores["base"].percent, scores["expert"].percent
    lift = expert - base
    print(f"\nlift through the API: {base:.1f} -> {expert:.1f} ({lift:+.1f})")
    recorded = RECORDED.get(recipe.name)
    if recorded is None:
        return
    rec_lift = recorded[1] - recorded[0]
    diff = lift - rec_lift
    verdict = "PASS" if abs(diff) <= TARGET_POINTS else "outside"
    note = "" if samples == 200 else f" (recorded on 200 samples, this run on {samples})"
    print(
        f"make experts (recorded): {recorded[0]:.1f} -> {recorded[1]:.1f} ({rec_lift:+.1f}); "
        f"difference {diff:+.1f} points, target within {TARGET_POINTS:.0f}: {verdict}{note}"
    )


def run(args, recipe, root: Path) -> None:
    import httpx
    import openai

    from tools.stack import LocalStack

    stack = LocalStack.on_free_ports(
        root / "stack", env=stack_settings(args.model, root, args.threads), trainer=True
    )
    started = time.monotonic()
    stack.start(timeout=600)
    try:
        http = httpx.Client(base_url=stack.http_url(), timeout=120)
        wait_ready(http)
        print(f"stack with trainer ready in {time.monotonic() - started:.0f} s (logs: {stack.log_dir})")
        # EXPERT_AUTH is off: any key passes, and the caller's address owns the file and the job.
        client = openai.OpenAI(
            base_url=stack.http_url() + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        job, times = upload_and_train(client, http, recipe, args.timeout)
        _, test = recipe.splits()
        test = test[: args.samples]
        base, fine_tuned = args.model.name, times["model"]
        runs = (
            ("base", "base model, expert excluded", base, {"exclude_experts": [recipe.name]}),
            ("expert", f"model={fine_tuned}", fine_tuned, {}),
            ("routed", "base model, the router choosing", base, {}),
        )
        scores = {}
        for key, label, model, extra in runs:
            scores[key] = evaluate(client, label, model, recipe, test, args.concurrency, extra)
            print(f"  {label}: {scores[key].percent:.1f} in {scores[key].seconds:.0f} s", flush=True)
        report(recipe, job, times, scores, len(test))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    from tools.demo.catalog import GOOD, NUM_TEST

    skills = {r.name: r for r in GOOD}
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO / "data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--skill", choices=sorted(skills), default="date-normalize")
    parser.add_argument(
        "--samples", type=int, default=NUM_TEST, help=f"held-out samples to score (the figure: {NUM_TEST})"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="chat completions in flight")
    parser.add_argument("--threads", type=int, default=2, help="the engine's EXPERT_NUM_THREADS")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for upload to routable")
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= NUM_TEST:
        parser.error(f"--samples must be in [1, {NUM_TEST}]")
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model} is not a checkpoint (make model makes the default one)")
    recipe = skills[args.skill]
    print(f"{recipe.name}: {recipe.skill.adapter}, `make experts` flags: {' '.join(recipe.train_flags())}")
    with tempfile.TemporaryDirectory() as tmp:
        run(args, recipe, Path(tmp))


if __name__ == "__main__":
    main()

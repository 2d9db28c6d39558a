"""`expertctl train submit|status|watch|cancel|resume`: training jobs of a running stack, through
the reception's TrainingService (the SDK's `client.training`).

`submit` uploads DATA.jsonl (a bad line is refused naming it) and queues a job that trains an expert
named `--name` on it; the stack installs and registers the expert when the job completes. `watch`
follows a job with a progress bar on stderr until it ends, and exits 0 only when it completed.
Creating, cancelling and resuming need an API key of scope train. (`expertctl expert train` trains
on this machine instead, without a stack.) `--json` prints JSON on stdout (`watch --json`: one event
per line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.expertctl.client_cmd import _add_common_arguments, _reporting_errors, _to_json
from tools.expertctl.credentials import api_key
from tools.expertctl.errors import UsageError
from tools.expertctl.metadata_options import split_list

if TYPE_CHECKING:
    from expert_system import ExpertClient, TrainingJob


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `train` and its actions to the `expertctl` parser."""
    train = subparsers.add_parser("train", help="training jobs of a running stack", description=__doc__)
    actions = train.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload a JSONL file and queue a job", description=__doc__)
    submit.add_argument("data", metavar="DATA.jsonl", type=Path, help="the training samples")
    _add_spec_options(submit)
    submit.add_argument("--watch", action="store_true", help="then follow the job as `watch` does")
    _add_common_arguments(submit, "reception", _submit)
    for name, help_, handler in (
        ("status", "show a job's status and metrics", _status),
        ("watch", "follow a job with a progress bar until it ends", _watch),
        ("cancel", "cancel a job (its checkpoints are kept for the retention, to resume it)", _cancel),
        ("resume", "queue a cancelled or failed job again from a checkpoint", _resume),
    ):
        parser = actions.add_parser(name, help=help_, description=__doc__)
        parser.add_argument("job_id", metavar="JOB_ID")
        if name == "resume":
            parser.add_argument(
                "--checkpoint", default="", metavar="ID", help="the checkpoint (default: the last)"
            )
        _add_common_arguments(parser, "reception", handler)


def _add_spec_options(parser: argparse.ArgumentParser) -> None:
    """TrainingJobSpec's fields; one left out takes the trainer's default (docs/api.md#training-jobs)."""
    expert = parser.add_argument_group("expert")
    expert.add_argument("--name", required=True, help="the expert's name")
    expert.add_argument("--version", help="its SemVer (1.0.0)")
    expert.add_argument("--description", help="what routing knows it by")
    expert.add_argument("--keywords", metavar="A,B,...", help="routing keywords")
    run = parser.add_argument_group("training")
    run.add_argument("--type", choices=("lora", "ia3", "prompt_tuning"), help="the adapter (lora)")
    run.add_argument("--rank", type=int, help="LoRA rank (8)")
    run.add_argument("--epochs", type=int, help="at most this many epochs (3)")
    run.add_argument("--max-steps", type=int, help="stop after this many steps")
    run.add_argument("--lr", type=float, help="learning rate (by adapter type)")
    run.add_argument("--batch-size", type=int, help="samples per step (8)")
    run.add_argument("--seed", type=int, help="the run's seed (0)")
    run.add_argument("--patience", type=int, help="epochs without a better held-out loss before stopping (1)")
    run.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="a checkpoint every STEPS steps")
    run.add_argument("--validation", type=Path, metavar="FILE", help="held-out samples (JSONL)")


def _spec_sections(args: argparse.Namespace) -> dict[str, Any]:
    """`client.training.create`'s sections from the options given."""

    def given(**values: Any) -> dict[str, Any]:
        return {k: v for k, v in values.items() if v is not None}

    expert = given(name=args.name, version=args.version, description=args.description)
    if args.keywords:
        expert["keywords"] = list(split_list(args.keywords))
    hyperparameters = given(
        epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        patience=args.patience,
    )
    return given(
        expert=expert,
        adapter=given(type=args.type, rank=args.rank) or None,
        hyperparameters=hyperparameters or None,
        checkpoint_every_steps=args.checkpoint_every,
    )


def _client(args: argparse.Namespace) -> ExpertClient:
    from expert_system import ExpertClient

    return ExpertClient(args.target, api_key=api_key(args))


def _upload(client: ExpertClient, path: Path, option: str) -> str:
    if not path.is_file():
        raise UsageError(f"{option}: {path} is not a file")
    return client.training.upload(path).id


@_reporting_errors
def _submit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sections = _spec_sections(args)
        sections["training_file"] = _upload(client, args.data, "DATA.jsonl")
        if args.validation is not None:
            sections["validation_file"] = _upload(client, args.validation, "--validation")
        job = client.training.create(**sections)
        if args.json and not args.watch:
            print(_to_json(job))
        elif not args.json:
            print(job.id)
        return _follow(client, job.id, as_json=args.json) if args.watch else 0


@_reporting_errors
def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.training.get(args.job_id)
    _show(job, as_json=args.json)
    return 0


@_reporting_errors
def _watch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _follow(client, args.job_id, as_json=args.json)


@_reporting_errors
def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _show(client.training.cancel(args.job_id), as_json=args.json)
    return 0


@_reporting_errors
def _resume(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _show(client.training.resume(args.job_id, checkpoint_id=args.checkpoint), as_json=args.json)
    return 0


def _follow(client: ExpertClient, job_id: str, *, as_json: bool) -> int:
    """Every event of the job until it ends (a bar on stderr, or JSON lines), then its summary; 0
    only when it completed."""
    from tools.training.console import job_progress_bar

    update, close = (None, None) if as_json else job_progress_bar()
    try:
        for event in client.training.watch(job_id):
            if as_json:
                print(_to_json(event), flush=True)
            elif event.type == "progress":
                d = event.data
                update(int(d["step"]), int(d["total_steps"]), d.get("train_loss"), d["tokens_per_second"])
    finally:
        if close is not None:
            close()
    job = client.training.get(job_id)
    if not as_json:
        _show(job, as_json=False)
    return 0 if job.status == "completed" else 1


def _show(job: TrainingJob, *, as_json: bool) -> None:
    if as_json:
        print(_to_json(job))
        return
    m = job.metrics
    print(f"{job.id}: {job.status}" + (" (cancel requested)" if job.cancel_requested else ""))
    if m.step:
        of = f"/{m.total_steps}" if m.total_steps else ""  # a finished job's metrics may leave it out
        loss = f", train loss {m.train_loss:.4f}" if m.train_loss is not None else ""
        held_out = f", eval loss {m.eval_loss:.4f}" if m.eval_loss is not None else ""
        print(f"  step {m.step}{of}, epoch {m.epoch}/{m.epochs}{loss}{held_out}")
    if job.checkpoints:
        last = job.checkpoints[-1]
        print(f"  checkpoints: {len(job.checkpoints)}, the last {last.id} at step {last.step}")
    if job.expert is not None:
        print(f"  expert: {job.expert.name} {job.expert.version}, model {job.expert.model}")
    if job.error:
        print(f"  error: {job.error}", file=sys.stderr)

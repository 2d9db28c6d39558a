"""What a training run shows on a terminal: a tqdm bar per epoch on stderr while it trains, then
the summary on stdout (`expertctl expert train` and `make experts` alike)."""

from __future__ import annotations

import sys


def print_summary(summary: dict) -> None:
    """The summary `train_expert` returns, as lines for a person."""
    a = summary["adapter"]
    print(
        f"wrote {a['adapter_dir']} ({a['adapter_type']}, {a['trainable_parameters']:,} trainable parameters)"
    )
    print(f"  samples:  {a['train_samples']} train, {a['eval_samples']} held out; device {a['device']}")
    for e in a["epochs"]:
        held_out = f"{e['eval_loss']:.4f}" if e["eval_loss"] is not None else "-"
        best = "  (best)" if e["epoch"] == a["best_epoch"] else ""
        losses = f"train loss {e['train_loss']:.4f}, eval loss {held_out}"
        print(f"  epoch {e['epoch']}:  {losses}, {e['seconds']:.0f} s{best}")
    stopped = ", stopped early" if a["stopped_early"] else ""
    print(f"  speed:    {a['tokens_per_second']:.0f} tokens/s, {a['seconds']:.0f} s in all{stopped}")
    if "package" in summary:
        p = summary["package"]
        print(f"wrote {p['path']}")
        print(f"  expert:       {p['name']} {p['version']} ({p['examples']} example prompts)")
        print(f"  content hash: {p['content_hash']}")


def progress_bar(epoch: int, epochs: int):
    """A tqdm bar per epoch on stderr, with the running loss and tokens per second."""
    from tqdm import tqdm

    bar = None

    def update(step: int, steps: int, loss: float, tokens_per_second: float) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step", file=sys.stderr, leave=True)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:.0f}", refresh=False)
        bar.update(1)
        if step == steps:
            bar.close()

    return update


def job_progress_bar():
    """A tqdm bar over a training job's steps on stderr (`expertctl train watch`), fed with its
    progress events' figures; returns update(step, total_steps, train_loss, tokens_per_second) and
    close()."""
    from tqdm import tqdm

    bar = tqdm(total=None, desc="training", unit="step", file=sys.stderr, leave=True)

    def update(step: int, total_steps: int, loss: float | None, tokens_per_second: float) -> None:
        if bar.total != total_steps:  # known with the first event, and again after a resume
            bar.total = total_steps
        postfix = {"tok_s": f"{tokens_per_second:.0f}"}
        if loss is not None:
            postfix["loss"] = f"{loss:.4f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - bar.n)

    return update, bar.close

"""docs/operations.md names every Prometheus metric the services define (read from their metrics
modules, so a metric added without its line in the docs fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(REPO.glob("services/*/metrics.py"))
NAMES = sorted({n for p in SOURCES for n in re.findall(r'"(expert_[a-z_]+)"', p.read_text())})
OPERATIONS = (REPO / "docs/operations.md").read_text()


def test_the_metrics_modules_were_found():
    assert len(SOURCES) == 6 and len(NAMES) > 40  # the five stages and the trainer


@pytest.mark.parametrize("name", NAMES)
def test_every_metric_is_documented(name):
    assert f"`{name}" in OPERATIONS

"""Manifests for test packages: the fields a PEFT adapter decides, filled in from it."""

from __future__ import annotations

from libs.experts.manifest import BaseModelIdentity, Manifest
from libs.experts.peft_adapter import PeftAdapter


def manifest_for(adapter: PeftAdapter, base: BaseModelIdentity, **overrides) -> Manifest:
    fields = {
        "name": f"test-{adapter.adapter_type.replace('_', '-')}",
        "version": "1.0.0",
        "description": "A test expert.",
        "adapter_type": adapter.adapter_type,
        "base_model": base,
        "target_modules": adapter.target_modules,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "use_rslora": adapter.use_rslora,
        "num_virtual_tokens": adapter.num_virtual_tokens,
        "feedforward_modules": adapter.feedforward_modules,
        "keywords": ("test",),
    }
    return Manifest(**(fields | overrides))

"""A publisher key made on this machine for its own stack, trusted by it: the demo set's
(`make experts`) and the trainer's under `make run` (`expertctl up --trainer` without
EXPERT_TRAINER_SIGNING_KEY). Made once and kept; its public half is put among the trusted keys,
named after its key id as `expertctl expert keygen` suggests, so that the engines accept what it
signs."""

from __future__ import annotations

import shutil
from pathlib import Path


def local_publisher_key(keys: Path, trusted: Path) -> Path:
    """`keys/signing.key`, made on first use (owner-only, by libs.experts.signing); its public key
    is copied into `trusted` (made if missing) unless it is there already."""
    from libs.experts.signing import (
        PRIVATE_KEY_FILE,
        PUBLIC_KEY_FILE,
        generate_keypair,
        key_id,
        load_public_key,
    )

    if not (keys / PRIVATE_KEY_FILE).is_file():
        generate_keypair(keys)
    public = keys / PUBLIC_KEY_FILE
    trusted.mkdir(parents=True, exist_ok=True)
    target = trusted / f"{key_id(load_public_key(public))}.pub"
    if not target.exists():
        shutil.copy(public, target)
    return keys / PRIVATE_KEY_FILE

"""What the launcher's redis-server needs around it: a password, a private directory, and a way to
ask whether it answers.

The redis-server `tools.stack` starts asks every client for a password (`requirepass`), generated
for each stack and given to the services inside their EXPERT_REDIS_URL (`redis://:PASSWORD@…`). The
password reaches redis-server on its standard input, never its command line, which every local
user can read (`ps`); it is kept for the owner, to use with redis-cli, in PASSWORD_FILE (0600) in
the Redis directory. That directory (the append-only file: the queue, the job records with their
prompts and outputs) is made readable by the owner only (0700), and redis-server runs with umask
077, so what it writes there is 0600.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import redis

PASSWORD_FILE = "password"
_OWNER_ONLY_DIR = 0o700
_OWNER_ONLY_FILE = 0o600
REDIS_UMASK = 0o077


def new_password() -> str:
    """A password for one stack's redis-server: 256 random bits, URL-safe as it is."""
    return secrets.token_hex(32)


def private_dir(path: Path) -> Path:
    """`path`, created if missing, readable by its owner only, and so is everything already in it
    (an append-only file an earlier version left readable to all)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(_OWNER_ONLY_DIR)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            Path(root, name).chmod(_OWNER_ONLY_DIR)
        for name in files:
            Path(root, name).chmod(_OWNER_ONLY_FILE)
    return path


def keep_password(directory: Path, password: str) -> Path:
    """Write `password` to PASSWORD_FILE in `directory`, created owner-only (never readable by
    others, not even for a moment)."""
    path = directory / PASSWORD_FILE
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _OWNER_ONLY_FILE)
    with os.fdopen(descriptor, "w") as file:
        file.write(password + "\n")
    return path


def config_text(password: str) -> str:
    """What redis-server reads on its standard input (`redis-server -`): the settings that must not
    show on its command line."""
    return f'requirepass "{password}"\n'


def url(port: int, password: str) -> str:
    return f"redis://:{password}@127.0.0.1:{port}/0"


def answers(redis_url: str) -> bool:
    """PONG from the Redis at `redis_url`, authenticated (one still loading its data answers
    LOADING, which counts as not yet)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=0.25, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()

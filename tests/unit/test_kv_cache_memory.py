"""The KV cache's default size respects a container's memory limit (cgroup v1 and v2), not only
/proc/meminfo, which inside a container describes the host."""

from __future__ import annotations

from pathlib import Path

from libs.engine.kv_cache import _cgroup_headroom


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_usage(tmp_path):
    _write(tmp_path / "proc", "0::/pod/engine\n")
    _write(tmp_path / "fs/pod/engine/memory.max", "4294967296\n")
    _write(tmp_path / "fs/pod/engine/memory.current", "1073741824\n")
    assert _cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "fs")) == 3 << 30


def test_cgroup_v2_without_limit(tmp_path):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "fs/memory.max", "max\n")
    _write(tmp_path / "fs/memory.current", "5\n")
    assert _cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "fs")) is None


def test_cgroup_v1_memory_controller(tmp_path):
    _write(tmp_path / "proc", "9:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    _write(tmp_path / "fs/memory/docker/abc/memory.limit_in_bytes", "2147483648\n")
    _write(tmp_path / "fs/memory/docker/abc/memory.usage_in_bytes", "147483648\n")
    assert _cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "fs")) == 2_000_000_000


def test_cgroup_v1_unlimited_and_missing_files(tmp_path):
    _write(tmp_path / "proc", "4:memory:/a\n")
    _write(tmp_path / "fs/memory/a/memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path / "fs/memory/a/memory.usage_in_bytes", "1\n")
    assert _cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "fs")) is None
    assert _cgroup_headroom(str(tmp_path / "missing"), str(tmp_path / "fs")) is None

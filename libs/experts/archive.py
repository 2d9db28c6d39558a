"""The container of a `.expert` package: a gzip-compressed tar of a few flat, regular files.

Writing is deterministic (fixed mtime, owner, mode and gzip header), so the same content gives the
same bytes. Reading happens in memory and trusts nothing: the gzip stream and the tar are bounded
in size, and only regular files with the expected flat names are accepted, so a hostile package
cannot write anywhere, point anywhere or exhaust memory.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

from libs.experts.errors import PackageError

NOT_A_PACKAGE = "not a .expert package"
_GZIP_MAGIC = b"\x1f\x8b"
# Tar headers, padding and the end-of-archive blocks on top of the files' own bytes.
TAR_OVERHEAD = 1 << 20
_CHUNK = 1 << 20


def write_tar_gz(files: Sequence[tuple[str, bytes]]) -> bytes:
    """A gzip-compressed tar of `files` (name, bytes) in the given order, byte-for-byte reproducible."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    compressed = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of the writer's path and clock.
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    return compressed.getvalue()


def read_tar_gz(data: bytes, limits: Mapping[str, int], *, max_total: int) -> dict[str, bytes]:
    """The files of the package bytes `data`, by name. `limits` maps every allowed name to its
    largest size; the files together may not exceed `max_total`. Refuses (with a `PackageError`)
    anything but a single gzip stream holding a tar of distinct regular files with allowed names;
    files that are absent are simply not in the result."""
    tar_bytes = _gunzip(data, max_total + TAR_OVERHEAD)
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            for member in tar:
                _check_member(member, files, limits)
                total += member.size
                if total > max_total:
                    raise PackageError(f"the package's files exceed the limit of {max_total} bytes")
                extracted = tar.extractfile(member)
                if extracted is None:  # only non-regular members lack a file object; refused above
                    raise PackageError(f"tar member {member.name!r}: has no data")
                files[member.name] = extracted.read()
    except tarfile.TarError as exc:
        raise PackageError(f"{NOT_A_PACKAGE}: not a valid tar archive ({exc})") from None
    return files


def _gunzip(data: bytes, limit: int) -> bytes:
    if not data.startswith(_GZIP_MAGIC):
        raise PackageError(f"{NOT_A_PACKAGE}: not a gzip-compressed tar")
    stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = bytearray()
    pending = data
    try:
        while pending and not stream.eof:
            # Bounded output per call: a small file that inflates to gigabytes stops at the limit.
            out += stream.decompress(pending, min(_CHUNK, limit + 1 - len(out)))
            if len(out) > limit:
                raise PackageError(f"{NOT_A_PACKAGE}: decompresses to more than {limit} bytes")
            pending = stream.unconsumed_tail
    except zlib.error as exc:
        raise PackageError(f"{NOT_A_PACKAGE}: corrupt gzip stream ({exc})") from None
    if not stream.eof:
        raise PackageError(f"{NOT_A_PACKAGE}: truncated (the gzip stream ends early)")
    if stream.unused_data:
        raise PackageError(f"{NOT_A_PACKAGE}: {len(stream.unused_data)} bytes after the gzip stream")
    return bytes(out)


def _check_member(member: tarfile.TarInfo, seen: Mapping[str, bytes], limits: Mapping[str, int]) -> None:
    name = member.name
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise PackageError(f"tar member {name!r}: not allowed (a path outside the package)")
    if not member.isreg() or member.issparse():
        raise PackageError(f"tar member {name!r}: not allowed ({_kind(member)}; only regular files are)")
    if name in seen:
        raise PackageError(f"tar member {name!r}: appears twice")
    if name not in limits:
        raise PackageError(f"unexpected file {name!r}")
    if member.size > limits[name]:
        raise PackageError(f"{name}: {member.size} bytes, more than the limit of {limits[name]}")


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link to {member.linkname!r}"
    if member.islnk():
        return f"a hard link to {member.linkname!r}"
    if member.isdir():
        return "a directory"
    if member.issparse():
        return "a sparse file"
    return "a device or fifo"

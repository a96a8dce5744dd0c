"""Read and write torch checkpoint files (.pt/.pth/.bin): zip and legacy formats, weights-only always."""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

from ckptfix.errors import FormatError, OutputError, UnsafeCheckpointError
from ckptfix.formats import safety
from ckptfix.formats.atomic import PathLike, atomic_output

_CRC_CHUNK = 1 << 22


def pickle_member(zf: zipfile.ZipFile, *, source: str) -> str:
    """The name of the one ``<folder>/data.pkl`` record, refusing archives with stray pickles."""
    names = zf.namelist()
    pickles = [n for n in names if n.endswith(".pkl")]
    data = [n for n in pickles if n.count("/") == 1 and n.endswith("/data.pkl")]
    if any(n.endswith(("/constants.pkl", "/code/")) or "/code/" in n for n in names):
        raise FormatError(f"{source}: is a TorchScript archive, not a checkpoint; load it with torch.jit.load")
    if len(data) != 1 or len(pickles) != 1:
        raise FormatError(
            f"{source}: expected exactly one data.pkl record, found {pickles or 'none'}; the archive was not "
            f"written by torch.save or has been tampered with"
        )
    folder = data[0].split("/")[0] + "/"
    stray = [n for n in names if not n.startswith(folder)]
    if stray or len(set(names)) != len(names):
        raise FormatError(f"{source}: archive has records outside '{folder}' or duplicated names; refusing it")
    return data[0]


def needed_globals(path: PathLike, *, fmt: str, source: str, verify: bool = True) -> list[str]:
    """Globals the checkpoint's pickle refers to, found without executing it.

    For a zip archive with ``verify`` it also checks, in the same pass over the file, what torch does not:
    record flags and local headers, every record's CRC, and each storage record's size against its pickle.
    """
    try:
        if fmt == "torch-legacy":
            with open(path, "rb") as f:
                # magic number, protocol version, system info, the object itself, storage keys
                return safety.scan_pickle(_Bounded(f), max_pickles=5).globals
        with open(path, "rb") as raw, zipfile.ZipFile(raw) as zf:
            member = pickle_member(zf, source=source)
            if verify:
                for info in zf.infolist():
                    _check_record(raw, zf, info, source=source)
            scan = safety.scan_pickle(zf.read(member))
            if verify:
                _check_storage_sizes(zf, member, scan.storage_bytes, source=source)
            return scan.globals
    except zipfile.BadZipFile as e:
        raise FormatError(f"{source}: corrupt or truncated zip archive ({e}); re-download or re-save it") from e
    except (ValueError, IndexError, EOFError, pickle.UnpicklingError, MemoryError) as e:
        raise FormatError(f"{source}: corrupt or truncated pickle ({e}); re-download or re-save it") from e
    except (OSError, NotImplementedError) as e:
        raise FormatError(f"{source}: cannot read the archive ({e}); re-download or re-save it") from e


def _check_record(raw: BinaryIO, zf: zipfile.ZipFile, info: zipfile.ZipInfo, *, source: str) -> None:
    if info.flag_bits & 0x1:
        raise FormatError(f"{source}: record '{info.filename}' is encrypted; refusing it")
    if info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(
            f"{source}: record '{info.filename}' is compressed; torch.save never compresses, "
            f"so the file was altered; refusing it before decompressing"
        )
    # zipfile trusts the central directory for flags and method; a local header that disagrees is a sign of
    # tampering (readers differ on which one they believe).
    raw.seek(info.header_offset)
    local = raw.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise FormatError(f"{source}: record '{info.filename}' has no local header; the archive is corrupt")
    flags, method = struct.unpack("<HH", local[6:10])
    if flags & 0x1 or method != info.compress_type or (flags & ~0x808) != (info.flag_bits & ~0x808):
        raise FormatError(
            f"{source}: record '{info.filename}': local header disagrees with the central directory (flags "
            f"{flags:#x} vs {info.flag_bits:#x}, method {method} vs {info.compress_type}); refusing it"
        )
    crc = 0
    with zf.open(info) as rec:
        # zipfile checks the CRC itself at EOF and raises BadZipFile; computing it here too names the record.
        rec._expected_crc = None  # type: ignore[attr-defined]
        while chunk := rec.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    if crc != info.CRC:
        raise FormatError(
            f"{source}: record '{info.filename}' fails its CRC check (stored {info.CRC:08x}, actual {crc:08x}); "
            f"the file is corrupt: re-download or re-save it"
        )


def _check_storage_sizes(zf: zipfile.ZipFile, member: str, sizes: dict[str, int], *, source: str) -> None:
    folder = member.rsplit("/", 1)[0]
    for key, needed in sizes.items():
        name = f"{folder}/data/{key}"
        try:
            size = zf.getinfo(name).file_size
        except KeyError:
            raise FormatError(f"{source}: storage record '{name}' is missing; the archive is damaged") from None
        if size != needed:
            raise FormatError(
                f"{source}: record '{name}' holds {size} bytes but its storage needs {needed}; the file is corrupt"
            )


class _Bounded(io.RawIOBase):
    """A file whose reads never ask for more than what is left, so a forged length cannot allocate gigabytes."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self._left = os.fstat(f.fileno()).st_size

    def read(self, n: int | None = -1) -> bytes:
        n = self._left if n is None or n < 0 else min(n, self._left)
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def tell(self) -> int:
        return self._f.tell()

    def readline(self, limit: int | None = -1) -> bytes:
        line = self._f.readline(self._left if limit is None or limit < 0 else min(limit, self._left))
        self._left -= len(line)
        return line


def load_torch(
    path: PathLike,
    *,
    fmt: str,
    source: str,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
) -> Any:
    """Load a torch file weights-only onto the CPU; the unpickler never calls anything off the allowlist."""
    import torch

    if unsafe:
        warnings.warn(f"{source}: loading with --unsafe-pickle: this can run code from the file", stacklevel=3)
        return _torch_load(path, source=source, weights_only=False, mmap=False)
    allowed_names = list(allow_globals)
    allowed = safety.resolve_allowed(allowed_names, source=source)
    needed = needed_globals(path, fmt=fmt, source=source, verify=verify)
    safety.refuse_unknown(needed, allowed=safety.torch_allowed() | set(allowed_names), source=source)
    with torch.serialization.safe_globals(allowed):
        return _torch_load(path, source=source, weights_only=True, mmap=mmap and fmt == "torch-zip")


def _torch_load(path: PathLike, *, source: str, weights_only: bool, mmap: bool) -> Any:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(os.fspath(path), map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as e:
        if weights_only:
            raise _weights_only_error(str(e), source=source) from e
        raise FormatError(f"{source}: corrupt pickle ({_first_line(e)}); re-download or re-save it") from e
    except MemoryError as e:
        raise FormatError(f"{source}: not enough memory to load it; free memory or use a smaller file") from e
    except Exception as e:  # torch reports corruption as RuntimeError, EOFError, KeyError, ...
        raise FormatError(
            f"{source}: corrupt or truncated torch file ({_first_line(e)}); re-download or re-save it"
        ) from e


def _weights_only_error(text: str, *, source: str) -> Exception:
    # torch wraps the unpickler's reason in a long preamble; the reason follows "WeightsUnpickler error:".
    reason = text.split("WeightsUnpickler error:", 1)[-1].strip().split("\n")[0].strip()
    name = re.search(r"<class '([\w.]+)'>|GLOBAL ([\w.]+)|function ([\w.]+)", reason)
    if name is None:
        return FormatError(f"{source}: corrupt pickle ({reason[:200]}); re-download or re-save it")
    needed = next(g for g in name.groups() if g)
    if safety.never_allowable(needed):
        return UnsafeCheckpointError(f"{source}: refused: its pickle builds {needed}; nothing was executed")
    return UnsafeCheckpointError(
        f"{source}: the weights-only unpickler also needs {needed}; if you trust the file, add --allow-global {needed}",
        globals_needed=[needed],
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0] or type(e).__name__
    return text if len(text) < 200 else text[:197] + "..."


def save_torch(obj: Any, out: PathLike) -> None:
    """``torch.save`` into a temp file beside OUT, then an atomic rename."""
    import torch

    try:
        with atomic_output(out) as f:
            torch.save(obj, f)
    except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError) as e:
        # Objects a weights-only load accepted can still be ones torch.save rejects (odd tensor hooks, say).
        raise OutputError(f"{out}: torch cannot save this checkpoint ({_first_line(e)}); nothing was written") from e

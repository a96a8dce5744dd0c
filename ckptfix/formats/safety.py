"""Which pickle globals a checkpoint needs, and which of them a user may allow.

The real gate is torch's weights-only unpickler, which never calls anything outside its allowlist. This module
adds what it lacks: the full list of offending globals up front (torch stops at the first), and a hard line
under what ``--allow-global`` may open.
"""

from __future__ import annotations

import importlib
import io
import pickletools
from collections.abc import Iterable
from typing import IO, Any, cast

from ckptfix.errors import UnsafeCheckpointError

# Modules whose members can run code, touch the system or import more code: never allowable.
_NEVER_MODULES = (
    "os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "importlib", "runpy", "shutil", "socket",
    "pickle", "_pickle", "marshal", "code", "codeop", "ctypes", "pty", "multiprocessing", "webbrowser", "types",
    "functools", "operator", "io", "_io", "tempfile", "pathlib", "signal", "threading", "_thread", "asyncio", "pdb",
    "inspect", "dill", "cloudpickle", "joblib", "torch.hub", "torch.serialization", "torch.jit", "torch.package",
    "torch._dynamo", "torch._C", "torch.ops", "torch._ops", "numpy.testing", "numpy.f2py", "numpy.distutils",
    "numpy.ctypeslib", "numpy.lib.format", "platform", "sysconfig", "zipimport", "site", "urllib", "http", "ssl",
    "smtplib", "ftplib", "telnetlib", "xmlrpc", "sqlite3", "shelve", "glob", "fileinput", "cProfile", "profile",
    "timeit", "trace", "doctest", "unittest", "venv", "ensurepip", "distutils", "setuptools", "pip",
)  # fmt: skip
# Names that are dangerous wherever they are found.
_NEVER_NAMES = frozenset(
    {"eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open", "input", "globals", "locals",
     "vars", "breakpoint", "system", "popen", "spawn", "execv", "execve", "load", "loads", "call", "check_output",
     "run", "Popen", "import_module", "attrgetter", "methodcaller", "partial", "reduce"}
)  # fmt: skip


def never_allowable(name: str) -> bool:
    """True for a global that can run code or reach the system, which no option may allow."""
    module, _, attr = name.rpartition(".")
    if any(module == m or module.startswith(m + ".") for m in _NEVER_MODULES):
        return True
    return attr in _NEVER_NAMES or attr.startswith("__")


def scan_globals(data: bytes | IO[bytes] | io.RawIOBase, *, max_pickles: int = 1) -> list[str]:
    """Every global a pickle stream refers to (GLOBAL, INST, STACK_GLOBAL), in order, without running it.

    ``max_pickles`` reads that many consecutive pickles (the legacy torch format is five in a row).
    """
    stream = cast("IO[bytes]", io.BytesIO(data) if isinstance(data, bytes) else data)
    found: list[str] = []
    for _ in range(max_pickles):
        strings: list[str] = []
        memo: dict[int, Any] = {}
        for opcode, arg, _pos in pickletools.genops(stream):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and "UNICODE" in name:
                strings.append(arg)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                memo[int(str(arg))] = strings[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(int(str(arg))), str):
                strings.append(memo[int(str(arg))])
            elif name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
    return list(dict.fromkeys(found))


_STORAGE_ITEMSIZE = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8, "IntStorage": 4,
    "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1, "ComplexDoubleStorage": 16,
    "ComplexFloatStorage": 8, "UntypedStorage": 1,
}  # fmt: skip
_MARK = object()


def storage_sizes(data: bytes) -> dict[str, int]:
    """Bytes each storage record must hold, from the persistent ids of torch's ``data.pkl``, without running it.

    torch.load(mmap=True) does not compare a record's size with its storage: a short record yields tensors
    that read past it into the rest of the file. A generic stack simulation (each opcode's documented stack
    effect) finds the ``('storage', StorageType, key, location, numel)`` tuples.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    sizes: dict[str, int] = {}
    for opcode, arg, _pos in pickletools.genops(data):
        name = opcode.name
        if name == "MARK":
            stack.append(_MARK)
            continue
        if name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(str(arg))] = stack[-1] if stack else None
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
            continue
        if name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo.get(int(str(arg))))
            continue
        if pickletools.markobject in opcode.stack_before:
            mark = len(stack) - 1 - stack[::-1].index(_MARK) if _MARK in stack else 0
            items, stack = stack[mark + 1 :], stack[:mark]
            items = [*items]
        else:
            count = len(opcode.stack_before)
            items = stack[len(stack) - count :] if count else []
            del stack[len(stack) - count :]
        if name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            stack.append(tuple(items))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            stack.append(("global", str(arg).split(" ")[-1] if arg else items[-1] if items else None))
        elif name == "BINPERSID":
            pid = items[-1] if items else None
            if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str):
                storage, numel = pid[1], pid[4]
                itemsize = _STORAGE_ITEMSIZE.get(storage[1], 0) if isinstance(storage, tuple) else 0
                if isinstance(numel, int) and itemsize:
                    sizes[pid[2]] = numel * itemsize
            stack.append(None)
        else:
            stack.extend([arg if opcode.arg is not None else None] * len(opcode.stack_after))
    return sizes


def torch_allowed() -> set[str]:
    """Globals torch's weights-only unpickler accepts by default or through add_safe_globals."""
    from torch import _weights_only_unpickler as wo

    return set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())  # type: ignore[no-untyped-call]


def resolve_allowed(names: Iterable[str], *, source: str) -> list[Any]:
    """Import the objects behind ``--allow-global module.Name`` after refusing the never-allowable ones."""
    objects = []
    for name in names:
        if never_allowable(name):
            raise UnsafeCheckpointError(
                f"{source}: --allow-global {name}: refused, it can run code or reach the system; "
                f"no option allows it (only --unsafe-pickle on a file you fully trust)"
            )
        module_name, _, attr = name.rpartition(".")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsafeCheckpointError(
                f"{source}: --allow-global {name}: cannot import it ({e}); install the package that defines it"
            ) from e
        objects.append((obj, name))
    return objects


def refuse_unknown(needed: list[str], *, allowed: Iterable[str], source: str) -> None:
    """Raise one error that lists every global outside the allowlist, naming the option that opens each."""
    allowed_set = set(allowed)
    missing = [g for g in needed if g not in allowed_set]
    if not missing:
        return
    dangerous = [g for g in missing if never_allowable(g)]
    if dangerous:
        raise UnsafeCheckpointError(
            f"{source}: refused: its pickle calls {', '.join(dangerous)}, which can run code; nothing was "
            f"executed. Do not load this file unless you wrote it",
            globals_needed=missing,
        )
    flags = " ".join(f"--allow-global {g}" for g in missing)
    raise UnsafeCheckpointError(
        f"{source}: needs globals outside the weights-only allowlist: {', '.join(missing)}; if you trust "
        f"where it came from, add {flags} (or, for a file you fully trust, --unsafe-pickle)",
        globals_needed=missing,
    )

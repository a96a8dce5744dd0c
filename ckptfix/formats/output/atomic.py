"""Crash-safe output: write to a temp file beside OUT, fsync, rename over OUT, fsync the folder.

A reader of OUT sees either the previous complete file or the new complete file, never a partial one. Stdlib only,
so the streaming path can use it without importing torch. Only SIGKILL (or a crash) leaves the temp file behind:
a SIGTERM or SIGHUP that would end the process at once unwinds it first (see :func:`unwinding_signals`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, BinaryIO

from ckptfix.errors import CkptfixError, OutputError

PathLike = str | os.PathLike[str]


def check_output(out: PathLike, *, inputs: tuple[PathLike, ...] = (), overwrite: bool = True) -> None:
    """Refuse, before any work is done, an OUT that cannot be written or that is one of the inputs; and, unless
    ``overwrite``, one that exists (a command never destroys a file it was not told to)."""
    out_s = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out_s))
    if not os.path.isdir(folder):
        raise OutputError(f"{out_s}: folder '{folder}' does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{out_s}: folder '{folder}' is not writable; choose another output path")
    if os.path.isdir(out_s):
        raise OutputError(f"{out_s}: is a folder; give a file name such as {os.path.join(out_s, 'model.pt')}")
    check_apart(out_s, inputs=inputs)
    if not overwrite and os.path.lexists(out_s):
        raise OutputError(f"{out_s}: already exists; write to a new path, or pass overwrite=True to replace it")


def check_apart(out: PathLike, *, inputs: tuple[PathLike, ...]) -> None:
    """Refuse an OUT (a file, or a folder and everything that will go in it) that is, or sits inside, anything
    the inputs are read from: the same path after links, the same inode (a hard link), a file inside an input
    folder, an input inside an OUT folder, an index file's shards. Nothing has been written when it raises."""
    out_s = os.fspath(out)
    real_out = os.path.realpath(out_s)
    for src in inputs:
        src_s = os.fspath(src)
        real_src = os.path.realpath(src_s)
        if os.path.isdir(real_src):
            if _within(real_out, real_src):
                raise OutputError(
                    f"{out_s}: is inside the input folder {src_s}; write outside it (inputs are never modified)"
                )
            if _within(real_src, real_out):
                raise OutputError(f"{out_s}: holds the input folder {src_s}; write to a new folder")
            continue
        for read in _files_read(src_s):
            if not (_same_file(read, out_s) or _within(os.path.realpath(read), real_out)):
                continue
            if read == src_s:
                raise OutputError(f"{out_s}: is the input file; write to a new path (inputs are never modified)")
            raise OutputError(
                f"{out_s}: is {read}, which the input {src_s} reads; write to a new path (inputs are never modified)"
            )


DCP_FILES = re.compile(r"\.metadata|__\d+_\d+\.distcp")  # what torch.distributed.checkpoint writes in its folder


def check_output_folder(out: PathLike, *, inputs: tuple[PathLike, ...] = (), overwrite: bool = False) -> None:
    """Refuse, before any work is done, an OUT folder (a DCP checkpoint) that cannot be written: one that is or
    holds an input; unless ``overwrite``, one that exists and is not empty; and even with it, one that holds
    anything but a DCP checkpoint's files (``.metadata``, ``__0_0.distcp`` …): only a checkpoint is replaced."""
    out_s = os.fspath(out).rstrip(os.sep) or os.sep
    check_apart(out_s, inputs=inputs)
    if os.path.lexists(out_s) and not os.path.isdir(out_s):
        raise OutputError(f"{out_s}: exists and is not a folder; a DCP checkpoint needs a new or empty folder")
    if not os.path.isdir(out_s) or not (names := sorted(os.listdir(out_s))):
        return
    if not overwrite:
        raise OutputError(
            f"{out_s}: exists and is not empty; write to a new or empty folder, or pass overwrite=True to replace it"
        )
    for name in names:
        if not (DCP_FILES.fullmatch(name) and stat.S_ISREG(os.lstat(os.path.join(out_s, name)).st_mode)):
            raise OutputError(
                f"{os.path.join(out_s, name)}: is not a file of a DCP checkpoint, and overwrite=True replaces only "
                f"a checkpoint folder; remove it or write to a new folder"
            )


@contextlib.contextmanager
def set_aside(paths: list[str], folder: str) -> Iterator[None]:
    """Move ``paths`` (an old output's files or folder) into a temp folder inside ``folder`` for the block, then
    remove them; when the block raises, put them back: the old output is whole again, as it was."""
    if not paths:
        yield
        return
    import shutil
    import tempfile

    aside = tempfile.mkdtemp(prefix=".ckptfix-old.", suffix=".ckptfix-tmp", dir=folder)
    moved: list[tuple[str, str]] = []
    try:
        for i, path in enumerate(paths):
            moved.append((path, os.path.join(aside, f"{i}.{os.path.basename(path)}")))
            os.rename(*moved[-1])
        yield
    except BaseException:
        for path, where in reversed(moved):
            with contextlib.suppress(FileNotFoundError):  # the rename that failed moved nothing
                os.rename(where, path)
        with contextlib.suppress(OSError):  # not empty: what could not be put back stays there, never removed
            os.rmdir(aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _files_read(src: str) -> list[str]:
    """The input file, and for an index file (transformers shards) the shards it names."""
    from ckptfix.formats.hf.index import looks_like_json, shards  # json, only once an output is checked

    if not looks_like_json(src):  # a FIFO or a device is never opened here (it could block)
        return [src]
    try:
        return [src, *shards(os.path.dirname(os.path.abspath(src)) or ".", src)[1]]
    except CkptfixError:  # not an index after all: reading it will say what it is
        return [src]


def _same_file(a: PathLike, b: PathLike) -> bool:
    try:
        return os.path.samefile(a, b)  # also a hard link: the same inode on the same device
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def folder_mode(out: str) -> int:
    """The mode an output folder gets when its staging folder (``mkdtemp``'s 0700, private while written) is renamed
    into place: an existing folder's own (written into, it stays as it was), else what ``mkdir`` gives."""
    try:
        st = os.stat(out)
    except OSError:
        return 0o777 & ~_umask()
    return stat.S_IMODE(st.st_mode) if stat.S_ISDIR(st.st_mode) else 0o777 & ~_umask()


def _umask() -> int:
    # os.umask can only be read by setting it; restore at once (single-threaded at this point in the CLI).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Signals whose default action ends the process without running any cleanup (SIGINT raises KeyboardInterrupt).
TERMINATING = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)


class Terminated(BaseException):
    """A SIGTERM or SIGHUP arrived: unwind like ``KeyboardInterrupt``, so every ``finally`` runs on the way out."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


_RECEIVED: list[int] = []  # every termination signal (and SIGINT) handled by ours, in order (see atomic_output)
_COMPLETED: list[str] = []  # every output moved into place, in order: what a late signal must not deny


def completed_outputs() -> list[str]:
    """The outputs this process has put in place (renamed in full), oldest first."""
    return list(_COMPLETED)


@contextlib.contextmanager
def completing(out: str) -> Iterator[None]:
    """Runs the block (the rename that puts ``out`` in place) with termination signals held, then records
    ``out`` as complete: a signal arriving after the rename is handled once the record says so."""
    held = _hold_signals()
    try:
        yield
        _COMPLETED.append(out)
    finally:
        _release_signals(held)


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    """A signal handler that turns a termination signal into :class:`Terminated` (once signals are no longer
    held: see :func:`_hold_signals`)."""
    _RECEIVED.append(signum)
    if _HOLDING:
        _DEFERRED.append(signum)
        return
    raise Terminated(signum)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # Python's own SIGINT handler, held like the termination signals and recorded like them (see atomic_output)
    _RECEIVED.append(signum)
    if _HOLDING:
        _DEFERRED.append(signum)
        return
    raise KeyboardInterrupt


def _unwind(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def unwinding_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Terminated` where they would kill the process.

    Only signals left at their default action are taken over (a program's own handlers stay), and only in the
    main thread, where Python runs handlers. Once the stack has unwound (temp files removed), the signal is
    delivered again with its default action, so the process still ends the way it would have: by the signal.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = {
        sig: signal.signal(sig, raise_terminated) for sig in TERMINATING if signal.getsignal(sig) == signal.SIG_DFL
    }
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        taken[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    except Terminated as e:
        if e.signum not in taken:
            raise
        _give_back(taken)
        taken = {}
        os.kill(os.getpid(), e.signum)  # the default action, now that nothing is left half-written
        raise
    finally:
        if taken:
            late = _give_back(taken)
            if late in taken and late != signal.SIGINT:
                os.kill(os.getpid(), late)  # came once the block was done: its default action, as without us
            elif late is not None:
                raise _unwind(late)


def _give_back(taken: dict[signal.Signals, Any]) -> int | None:
    """Put the handlers ``taken`` over back; return a signal that came meanwhile (``signal.signal`` runs the
    handler of one already received before it changes anything: it must not raise half-way through)."""
    _HOLDING.append(None)
    try:
        for sig, handler in taken.items():
            signal.signal(sig, handler)
    finally:
        _HOLDING.pop()
    if _HOLDING or not _DEFERRED:
        return None
    late = _DEFERRED[0]
    _DEFERRED.clear()
    return late


class Worker(threading.Thread):
    """A daemon thread whose end the caller can wait for through signals (:meth:`wait`).

    ``Thread.join`` cannot serve: one that a signal's exception (:class:`Terminated`, ``KeyboardInterrupt``)
    interrupts marks the thread ended while it runs on (CPython 3.11's ``_wait_for_tstate_lock``), and a worker
    still inside torch when the interpreter exits is ended there: "terminate called without an active
    exception", exit 134 instead of 143."""

    def __init__(self, target: Callable[..., object], *, name: str, args: tuple[object, ...] = ()) -> None:
        super().__init__(target=target, args=args, name=name, daemon=True)
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.ended.set()

    def wait(self, stop: Callable[[], object] | None = None) -> None:
        """:func:`wait_all` of this one thread."""
        wait_all([self], stop)


def wait_all(workers: Iterable[Worker], stop: Callable[[], object] | None = None) -> None:
    """Return once every worker has run its target (at once for one never started). A signal's exception raised
    meanwhile calls ``stop`` (which tells the work to end early), the wait goes on, and the first such exception
    is raised once all have ended: the main thread unwinds with no worker left running."""
    caught: BaseException | None = None
    for worker in list(workers):
        while worker.ident is not None and not worker.ended.is_set():
            try:
                worker.ended.wait()
            except BaseException as e:
                if caught is None:
                    caught = e
                    if stop is not None:
                        stop()
    if caught is not None:
        raise caught


@contextlib.contextmanager
def atomic_output(out: PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``out`` only when the block completes without an exception.

    The temp file lives in OUT's folder so the final rename never crosses file systems. It gets the mode a
    plain ``open()`` would give (0666 & ~umask) rather than mkstemp's 0600.
    """
    seen = len(_RECEIVED)
    with unwinding_signals(), _temp_output(out) as f:
        try:
            yield f
        except Exception as e:
            # torch's writer turns an exception raised in its Python callbacks into its own RuntimeError
            # ("unexpected pos"): a termination swallowed that way still ends the process as one
            if len(_RECEIVED) > seen:
                raise _unwind(_RECEIVED[-1]) from e
            raise
        if len(_RECEIVED) > seen:  # raised where it was swallowed (a callback, a __del__): never a complete output
            raise _unwind(_RECEIVED[-1])


@contextlib.contextmanager
def _temp_output(out: PathLike) -> Iterator[BinaryIO]:
    out_s = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out_s))
    tmp = None
    held = _hold_signals()
    try:
        try:
            fd, tmp = _create_temp(folder, os.path.basename(out_s))
        except OSError as e:
            raise OutputError(f"{out_s}: cannot create a file in '{folder}' ({e.strerror}); check the folder") from e
        finally:
            _release_signals(held)  # a signal that came while the file was being created is handled from here on
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        with completing(out_s):
            os.replace(tmp, out_s)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{out_s}: write failed ({e.strerror or e}); the output was not written") from e
        raise
    fsync_dir(folder)


def _create_temp(folder: str, name: str) -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``folder`` (a new file, mode 0600, close-on-exec), without importing tempfile and
    the modules it brings (shutil, random, hashlib): milliseconds of every conversion's start-up."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.ckptfix-tmp")
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name found", folder)


_HELD = {signal.SIGINT, *TERMINATING}


_HOLDING: list[None] = []  # one entry per held region the main thread is in
_DEFERRED: list[int] = []  # the signals whose handlers ran inside one, raised once the outermost ends


def _hold_signals() -> set[int | signal.Signals] | None:
    """Hold termination signals and SIGINT until :func:`_release_signals`: between the temp file's creation and
    the moment its name is known, a signal's exception would leak it; around the rename, it would deny an output
    already complete.

    Blocking them (``pthread_sigmask``) is not enough: it holds them in the calling thread only, the kernel then
    gives one to another thread (torch has some), whose C-level handler still has Python run the handler in the
    main thread at its next instruction. So the handlers themselves defer while ``_HOLDING`` says so."""
    _HOLDING.append(None)
    if not hasattr(signal, "pthread_sigmask"):
        return None
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    except BaseException:  # a program's own handler raised (ours defer): let them through again
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
        _HOLDING.pop()
        raise


def _release_signals(held: set[int | signal.Signals] | None) -> None:
    """End a held region; a signal that came during it is raised here, once the outermost one ends."""
    try:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    finally:
        _HOLDING.pop()
    if not _HOLDING and _DEFERRED:
        signum = _DEFERRED[0]
        _DEFERRED.clear()
        raise _unwind(signum)


def fsync_dir(folder: str) -> None:
    # The rename is durable only once the folder entry is on disk.
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextlib.contextmanager
def staged_folder(out: str, *, overwrite: bool = False) -> Iterator[str]:
    """A private temporary folder beside OUT, to write a folder checkpoint into; it becomes OUT when the block
    completes, and is removed when it raises. OUT must not exist or be empty; with ``overwrite`` it may be a DCP
    checkpoint folder (nothing else), which is then replaced: the old folder is renamed aside, the new one renamed
    in, the old one removed, so a failure leaves the old checkpoint as it was."""
    import shutil
    import tempfile

    out = os.path.abspath(out.rstrip(os.sep) or os.sep)
    check_output_folder(out, overwrite=overwrite)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise OutputError(f"{out}: folder '{parent}' does not exist; create it first")
    with unwinding_signals():  # a SIGTERM or SIGHUP unwinds through the clean-up below before it ends the process
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".ckptfix-tmp", dir=parent)
        try:
            yield tmp
            fsync_dir(tmp)  # its entries durable before it is renamed into place
            check_output_folder(out, overwrite=overwrite)  # as it was when the command began: still a checkpoint
            try:
                os.chmod(tmp, folder_mode(out))  # private until complete; then the mode mkdir (or OUT itself) gives
                with completing(out), set_aside([out] if os.path.isdir(out) else [], parent):
                    os.rename(tmp, out)
                fsync_dir(parent)
            except OSError as e:
                raise OutputError(
                    f"{out}: cannot put the new folder in place ({e.strerror or e}); nothing changed"
                ) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

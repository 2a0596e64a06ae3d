"""Atomic file writes: write to a temporary name in the same folder, then rename, so a
crash never leaves a half-written file. `tempfile.mkstemp` / `mkdtemp` create
owner-only files (0600 / 0700); a finished output gets the permissions an ordinary
`open(path, "w")` would give (0666 / 0777 less the umask) before the rename."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_public_mode(path: str | os.PathLike) -> None:
    """chmod `path` to 0666 & ~umask (files) or 0777 & ~umask (folders, recursively)."""
    path, mask = Path(path), _umask()
    if path.is_dir():
        for sub in [path, *path.rglob("*")]:
            os.chmod(sub, (0o777 if sub.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def cannot_write_in(folder: str | os.PathLike) -> str | None:
    """Why a file cannot be created in the existing folder `folder` (the OS error's text),
    or None when it can: creates and removes an empty temporary file there, which also
    catches what permission bits do not tell root (a read-only or virtual file system).
    A virtual file system that takes no new files (/proc) answers "No such file or
    directory" about the file being created, although the folder is there: that is said
    in words ("--json /proc/version: cannot write in the folder /proc (No such file or
    directory)" read as if /proc were missing)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".flintc-probe-", dir=folder)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.ENOENT and Path(folder).is_dir():
            return f"its file system takes no new files: creating one there fails with '{why}'"
        return why
    os.close(fd)
    os.unlink(tmp)
    return None


def output_parent_problem(parent: str | os.PathLike) -> str | None:
    """Why an output (a file, or a folder written beside it and renamed into place) cannot
    be created in `parent`, as the end of an error message, or None when it can: the
    folder is missing, is not a folder, is not writable, or `cannot_write_in`'s probe
    fails there. The CLI's --out checks and `flintc.compile(out=)` share it."""
    parent = Path(parent)
    if not parent.exists():
        return f"the parent folder {parent} does not exist"
    if not parent.is_dir():
        return f"the parent folder {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the parent folder {parent} is not writable"
    why = cannot_write_in(parent)
    return f"cannot write in the parent folder {parent} ({why})" if why else None


def _write_failure(exc: BaseException) -> tuple[int, str]:
    """(errno, reason) of a failed write, readable: an OSError's own; numpy's short write
    ("N requested and M written", no errno: the disk or a quota filled up mid-write) and
    safetensors' SafetensorError (not an OSError; "No space left on device (os error 28)"
    inside its text) put in words."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno, exc.strerror or text
    if "No space left on device" in text:
        return errno.ENOSPC, "No space left on device"
    short = re.fullmatch(r"(\d+) requested and (\d+) written", text.strip())
    if short:
        return errno.EIO, (f"short write ({short[1]} bytes requested, {short[2]} written): "
                           "the disk or a quota is probably full")
    return errno.EIO, text


@contextlib.contextmanager
def naming_write_errors(path):
    """Re-raise an error raised while writing `path` as an OSError whose filename is
    `path` (what the CLI prints: "flintc: error: PATH: reason"): a write that fails on a
    full disk raises OSError without a filename; numpy's short write and safetensors'
    SafetensorError carry no errno. OSErrors that already name a file, and errors that
    are no write errors, pass unchanged. A file in an output's temporary folder is then
    named as the output by `final_output_error`."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) and exc.filename is not None:
            raise
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        raise OSError(*_write_failure(exc), str(path)) from exc


def final_output_error(exc: BaseException, tmp, out) -> OSError | None:
    """`exc`, an OSError about a file inside the temporary folder `tmp` (an output being
    assembled before its rename to `out`), as one naming `out`, the path the user gave,
    with the file: "OUT: reason (writing NAME)"; None for any other error."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return None
    try:
        rel = Path(exc.filename).relative_to(tmp)
    except (TypeError, ValueError):  # a bytes path, or a file outside tmp
        return None
    doing = "moving the new output into place" if rel == Path(".") else f"writing {rel}"
    return OSError(exc.errno, f"{exc.strerror or exc} ({doing})", str(out))


@contextlib.contextmanager
def naming_final_output(tmp, out):
    """Re-raise an OSError about a file inside `tmp` as `final_output_error` words it."""
    try:
        yield
    except OSError as exc:
        renamed = final_output_error(exc, tmp, out)
        if renamed is None:
            raise
        raise renamed from exc


def is_special_file(path: str | os.PathLike) -> bool:
    """`path` exists (links followed) and is neither a regular file nor a folder: a
    character device (/dev/null, a terminal), a FIFO (a shell's `>(...)`, /dev/stdout on
    a pipe) or a socket. An output there is written into, never replaced by a rename: as
    root, `--logits-out /dev/null` replaced the device with a regular file (and /dev
    takes no new files for other users, so the same flag was refused for them)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def write_text_atomic(path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (module doc), creating its folder; on
    failure the temporary file is removed and `path` is untouched. Raises OSError naming
    `path` (`naming_write_errors`), IsADirectoryError for a path that is a folder
    (`write_texts_atomic` with the one file)."""
    write_texts_atomic({path: text})


def write_texts_atomic(files: dict) -> None:
    """Write several files as one: {path: text (str, written as UTF-8) or bytes (written
    as they are: a PNG)}, each to a temporary file
    beside it first, then all renamed into place together with SIGINT and SIGTERM
    deferred (`signals_deferred`). A failed write of a temporary file (a full disk), or a
    path that is a folder, leaves every file as it was: never a new file beside an old one
    (a bench.md that does not match its bench.json). The renames are not one atomic step:
    one that fails after an earlier one succeeded (rare: each stays in its own folder)
    leaves the files renamed before it new and the others old. Only this call's writes are
    paired: a caller that rewrites one of the files alone (a live `flintc bench` saves
    bench.json after each step) leaves it newer than the others until the next pair is
    written. Creates the folders. Raises OSError naming the file whose write failed
    (`naming_write_errors`), or IsADirectoryError for a path that is a folder (before any
    rename); the temporary files are removed. A path that is a device, a FIFO or a
    socket (`is_special_file`: /dev/null, /dev/stdout) is written into directly, after
    the renames."""
    temps: list[tuple[str, Path]] = []
    special = {path: text for path, text in files.items() if is_special_file(path)}
    try:
        for path, text in files.items():
            if path in special:
                continue
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            temps.append((tmp, target))
            if isinstance(text, bytes):
                with naming_write_errors(target), os.fdopen(fd, "wb") as f:
                    f.write(text)
            else:
                with naming_write_errors(target), os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
            set_public_mode(tmp)
        for _, target in temps:  # os.replace would fail there, after the files before it were renamed
            if target.is_dir():
                raise IsADirectoryError(errno.EISDIR, "Is a directory (expected a file)", str(target))
        with signals_deferred():
            for tmp, target in temps:
                os.replace(tmp, target)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    for path, text in special.items():
        if isinstance(text, bytes):
            with naming_write_errors(path), open(path, "wb") as f:
                f.write(text)
        else:
            with naming_write_errors(path), open(path, "w", encoding="utf-8") as f:
                f.write(text)


def write_json_atomic(path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def follow_out_link(out: str | os.PathLike) -> Path:
    """`out`, or, when `out` is a symbolic link, the path it points to (all links
    resolved): an output folder published with `move_into_place` replaces the folder a
    link points to and keeps the link (renaming over the link itself replaced the link
    with a real folder and left `.{name}.old-{pid} -> target` behind). A dangling link
    gives the path it would point to. Raises InputError for a link loop."""
    out = Path(out)
    if not out.is_symlink():
        return out
    target = Path(os.path.realpath(out))
    if target.is_symlink():  # realpath stops at a loop
        from flintc.errors import InputError

        raise InputError(f"{out}: a symbolic link that loops; expected a folder, or a link to one")
    return target


def temp_dir_beside(out: str | os.PathLike) -> Path:
    """A new owner-only folder beside `out` to build it in, `.{name}.{pid}.XXXXXXXX`, to
    be published with `move_into_place`. First removes the folders of that form (and
    `move_into_place`'s `.{name}.old-{pid}`) that a flintc process which no longer runs
    left there: a SIGKILL or a power cut skips every cleanup. Folders of live processes,
    of other users and of other names are left alone. A link `out` is followed
    (`follow_out_link`): the folder is made beside its target."""
    out = follow_out_link(out)
    remove_stale_temp_dirs(out)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))


def remove_stale_temp_dirs(out: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of `out` (`temp_dir_beside`, `move_into_place`, and
    `.{name}.tmp-{pid}-{8 hex}`, those of `make_checkpoint` before it used this form)
    whose process is gone (POSIX only: `kill(pid, 0)`). Returns the removed paths."""
    out = Path(out)
    parent = out.parent  # Path("b").parent is Path(".")
    if os.name != "posix" or not parent.is_dir():
        return []
    name = re.escape(out.name)
    pattern = re.compile(rf"\.{name}\.(?:(\d+)\.[a-z0-9_]{{8}}|old-(\d+)|tmp-(\d+)-[0-9a-f]{{8}})")
    removed = []
    for p in parent.iterdir():
        m = pattern.fullmatch(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        pid = int(m[1] or m[2] or m[3])
        if pid == os.getpid() or _process_alive(pid) or p.stat().st_uid != os.getuid():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's, or not a pid
        return pid > 0
    return True


TEMP_BUILD_PREFIX = "flintc-build-"
STALE_TEMP_BUILD_S = 600.0  # a temporary build's folder this old, of a dead process, is removed
_TEMP_BUILD_LOCKS: dict[str, int] = {}  # folder -> the open descriptor holding its lock


def new_temp_build_dir() -> Path:
    """A new owner-only folder in the system's temporary folder for a temporary BUILD
    (`flintc run` without --build, `flintc.compile()` without out), named
    `flintc-build-{pid}-XXXXXXXX`, holding `.lock`, which this process keeps an
    exclusive lock on (flock) until `remove_temp_build_dir`, or its end. First removes
    the folders of that form that a process killed without its clean-up (SIGKILL, out
    of memory) left (`remove_stale_temp_builds`): each was several MB to GB."""
    remove_stale_temp_builds()
    path = Path(tempfile.mkdtemp(prefix=f"{TEMP_BUILD_PREFIX}{os.getpid()}-"))
    if os.name == "posix":
        import fcntl

        try:
            fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without flock (ENOLCK, EOPNOTSUPP): used unlocked, as before
            os.close(fd)
        else:
            _TEMP_BUILD_LOCKS[str(path)] = fd
    return path


def remove_temp_build_dir(path: str | os.PathLike) -> None:
    """Remove a folder of `new_temp_build_dir` and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _TEMP_BUILD_LOCKS.pop(str(path), None)
    if fd is not None:
        os.close(fd)


def remove_stale_temp_builds(root: str | os.PathLike | None = None,
                             older_than_s: float = STALE_TEMP_BUILD_S) -> list[Path]:
    """Remove the folders of `new_temp_build_dir` in `root` (the system's temporary
    folder) that no process uses any more: only folders of this user, not links, last
    modified more than `older_than_s` seconds ago, whose process (the pid in the name)
    is not alive and whose `.lock` no process holds (the lock tells a live process in
    another pid namespace sharing /tmp apart from a dead one). POSIX only. Returns the
    removed paths; a folder that cannot be checked or removed is left."""
    import time

    if os.name != "posix":
        return []
    import fcntl

    root = Path(root if root is not None else tempfile.gettempdir())
    pattern = re.compile(rf"{re.escape(TEMP_BUILD_PREFIX)}(\d+)-[a-z0-9_]{{8}}")
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for p in entries:
        m = pattern.fullmatch(p.name)
        if not m:
            continue
        try:
            st = p.lstat()
            pid = int(m[1])
            if (not p.is_dir() or p.is_symlink() or st.st_uid != os.getuid() or pid == os.getpid()
                    or _process_alive(pid) or time.time() - st.st_mtime < older_than_s):
                continue
            # not blocking (a FIFO there hung every later run), not through a link
            flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(p / ".lock", flags) if os.path.lexists(p / ".lock") else None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # held: a live process (of another pid namespace) uses it
                    continue
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def move_into_place(tmp: str | os.PathLike, out: str | os.PathLike, log=None) -> None:
    """Publish the finished folder `tmp` as `out` (same parent): set its public mode, then
    rename it over `out`, replacing an earlier `out` whole (the old one is renamed aside
    to `.{name}.old-{pid}` first and removed after), so readers never see a half-written
    folder. A link `out` is followed (`follow_out_link`): its target is replaced and the
    link kept.

    All or nothing, SIGINT (Ctrl-C) and SIGTERM included: both renames and the removal
    of the old folder run with those signals deferred (`signals_deferred`), so an
    interrupt there is raised (KeyboardInterrupt, or the SIGTERM handler's exception)
    only once `out` is the complete new folder and no `.old-` folder remains; a failed
    second rename puts the old `out` back (its error is raised, under a deferred signal's
    exception if one came). A signal's exception raised from here, with no other error
    in its context, means `out` was written, and `log` (a callable taking one line, or
    None) is then told "wrote OUT (complete) before the interrupt" before it propagates;
    before the renames, `out` is untouched (`tmp` is the caller's to remove)."""
    tmp, out = Path(tmp), follow_out_link(out)
    set_public_mode(tmp)
    written = False
    try:
        with signals_deferred():
            if out.exists():
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                out.rename(old)
                try:
                    tmp.rename(out)
                except BaseException:
                    old.rename(out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
            written = True
    except BaseException:
        if written and log is not None:  # only a deferred signal raises once `out` is written
            log(f"wrote {out} (complete) before the interrupt")
        raise


@contextlib.contextmanager
def signals_deferred(signums=(signal.SIGINT, signal.SIGTERM)):
    """Defer SIGINT and SIGTERM (`signums`) for the block: their handlers are replaced by
    one that only records the signal, and when the block ends (normally or not) the
    previous handlers are restored and each recorded signal is sent again, so it acts
    right after the block as it would have inside (KeyboardInterrupt, flintc's
    Terminated, or the default action). Every recorded signal is delivered, SIGTERM last
    (its exception, raised over KeyboardInterrupt's, is the one that propagates), and
    every handler is put back even when one of them raises while the others are
    restored. If the block raises too, the signal's exception is raised over it (the
    block's is its `__context__`). The wake-up fd (`signal.set_wakeup_fd`, asyncio's) is
    off for the block, so an event loop sees each signal once, when it is sent again.
    Handlers, not `pthread_sigmask`: a signal sent to the process may be taken by any
    thread whose mask lets it through (torch's, tqdm's), and Python would still run its
    handler in the block. Only the main thread may set handlers: elsewhere (and for a
    signal whose handler was not set from Python) the block runs unprotected."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: list[tuple[int, object]] = []

    def record(num, frame):
        received.append(num)

    wakeup = signal.set_wakeup_fd(-1)
    try:
        for signum in signums:
            handler = signal.getsignal(signum)
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, record)
                previous.append((signum, handler))
        yield
    finally:
        _chain([lambda s=s, h=h: signal.signal(s, h) for s, h in previous]
               + [lambda: _set_wakeup_fd(wakeup)]
               + [lambda s=s: signal.raise_signal(s)
                  for s in sorted(dict.fromkeys(received), key=lambda s: s == signal.SIGTERM)])


def _chain(steps) -> None:
    """Run every step, each in the `finally` of the one before: one that raises (a
    signal's handler) does not keep the later ones from running."""
    if steps:
        try:
            steps[0]()
        finally:
            _chain(steps[1:])


def _set_wakeup_fd(fd: int) -> None:
    try:
        signal.set_wakeup_fd(fd)
    except (ValueError, OSError):  # closed meanwhile: leave it off
        pass


class KeptSignals:
    """What `signals_kept` yields: `check()` raises, at once, a signal's exception that
    was raised and lost since the block began (see there)."""

    def __init__(self):
        self.raised: list[tuple[int, BaseException]] = []  # (signum, what its handler raised)

    def check(self) -> None:
        """Raise the lost exception of the signals seen so far, if any (SIGTERM's over
        SIGINT's, as `signals_deferred` delivers them), once: a later check or the block's
        end does not raise it again."""
        if self.raised:
            _, exc = max(self.raised, key=lambda r: r[0] == signal.SIGTERM)
            self.raised.clear()
            raise exc


@contextlib.contextmanager
def signals_kept(signums=(signal.SIGINT, signal.SIGTERM)):
    """A block in which the exception of SIGINT or SIGTERM (KeyboardInterrupt, flintc's
    Terminated) cannot be lost. The signals act at once, as without it (their handlers
    run and raise), but each handler's exception is recorded; when the block then ends
    in another way, normally or with an ordinary Exception, the recorded exception is
    raised there, over the block's error (its `__context__`). `kept.check()` (the
    `KeptSignals` yielded) raises it earlier, between the steps of a long block.

    Why: torch and the libraries that call it can catch a KeyboardInterrupt raised in
    Python code they call and go on, or raise their own error instead. safetensors'
    `get_tensor` runs `torch.asarray` on a storage; a Ctrl-C landing in the attribute
    probes asarray makes came out as "ValueError: could not determine the shape of
    object type 'torch.storage.UntypedStorage'", which the checkpoint reader reported as
    "cannot read" (exit 2) instead of the interrupt (exit 130). Unlike
    `signals_deferred`, nothing waits: a long block (a checkpoint read of minutes) is
    interrupted when the signal comes, as long as nothing swallows its exception, and
    otherwise at the next `check()` or at the block's end.

    Only handlers set from Python are wrapped (SIG_DFL ends the process, SIG_IGN drops
    the signal, as they would); every handler is put back at the end. Only the main
    thread may set handlers: elsewhere the block runs as it is (`check()` then never
    raises)."""
    import threading

    kept = KeptSignals()
    if threading.current_thread() is not threading.main_thread():
        yield kept
        return
    previous: list[tuple[int, object]] = []

    def recording(signum, handler):
        def handle(num, frame):
            try:
                handler(num, frame)
            except BaseException as exc:
                kept.raised.append((num, exc))
                raise
        return handle

    try:
        for signum in signums:
            handler = signal.getsignal(signum)
            if callable(handler):
                signal.signal(signum, recording(signum, handler))
                previous.append((signum, handler))
        try:
            yield kept
        except Exception:
            kept.check()  # the signal's exception, over the error that replaced it
            raise
        kept.check()
    finally:
        _chain([lambda s=s, h=h: signal.signal(s, h) for s, h in previous])


DUMP_DIR_ENV = "FLINTC_DUMP_DIR"

# What makes a folder a checkpoint or a build (`foreign_files`): an output folder holding
# one is refused (dump's and bench's --out); dumps go into no BUILD at any depth, and
# into no checkpoint folder itself (a new subfolder of one is fine:
# `checkpoint_or_build_problem`).
_FOREIGN = ("config.json", "build.json", "tokenizer.json", "*.safetensors", "*.safetensors.index.json",
            "*.gguf")


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """The names of the files in `folder` that make it a checkpoint or a build (config.json,
    build.json, tokenizer.json, safetensors, GGUF), which an output written into it would
    mix with (dump's and bench's --out refuse such a folder)."""
    folder = Path(folder)
    return sorted({p.name for pattern in _FOREIGN for p in folder.glob(pattern) if p.is_file()})


def checkpoint_or_build_problem(path: str | os.PathLike) -> str | None:
    """Why dumps may not be written at the folder `path` (new or existing), as the middle of
    an error message, or None when they may: it is, or is inside at any depth, a flintc
    BUILD (a folder holding build.json, what `flintc compile` takes for one, and replaces
    whole: the dumps would go with it, or replace its own BUILD/dumps/<function>/ with
    another compile's); or it is itself a checkpoint folder (config.json with a
    tokenizer.json, safetensors or GGUF file beside it: a lone config.json or .gguf, as a
    home folder may hold, makes no checkpoint), whose files the dumps would mix with. A
    subfolder of a checkpoint (ckpt/dumps) is taken: the layout flintc expects of a model
    folder is a common project root, and nothing replaces a checkpoint folder whole. Names
    the folder, resolved: "inside the flintc BUILD /abs/build (it holds build.json), whose
    own dumps ...", "is the checkpoint folder /abs/ckpt (it holds config.json,
    model.safetensors), ...". The one check of `flintc dump --out` and `$FLINTC_DUMP_DIR`
    (`dump_dir_from_env`)."""
    from flintc.errors import listing

    given = Path(path).resolve()
    found = foreign_files(given) if given.is_dir() else []
    if "config.json" in found and "build.json" not in found and len(found) > 1:
        return (f"is the checkpoint folder {given} (it holds {listing(found, 3)}), whose files the "
                "dumps would mix with")
    folder = enclosing_build(given)
    if folder is not None:
        return (f"{'is' if folder == given else 'inside'} the flintc BUILD {folder} (it holds build.json), "
                "whose own dumps are in BUILD/dumps and which the next flintc compile into it replaces whole")
    return None


def enclosing_build(path: str | os.PathLike, *, itself: bool = True) -> Path | None:
    """The nearest flintc BUILD (a folder holding build.json, what `flintc compile` takes
    for one and replaces whole) that `path` (new or existing, resolved) is inside at any
    depth, or is itself when `itself`; None when there is none. The walk of
    `checkpoint_or_build_problem` and of `flintc bench`'s --out / --builds check."""
    given = Path(path).resolve()
    for folder in ((given,) if itself else ()) + tuple(given.parents):
        if (folder / "build.json").is_file():
            return folder
    return None


def would_delete(foreign: list[str], what: str, listed: int = 3) -> str:
    """The end of the refusal of an --out that a `what` ("compile", "dump") replaces
    whole while it holds `foreign` entries it does not write: the first `listed`, how
    many more, and what to do (`flintc.runtime.build.check_out_replaceable`,
    `flintc.cli.dump.check_dump_out`)."""
    from flintc.errors import listing

    return (f"{listing(foreign, listed)}, which a {what} does not write and would delete with the old "
            f"{'build' if what == 'compile' else what} (it replaces the folder whole); move "
            f"{'it' if len(foreign) == 1 else 'them'} out or choose another --out")


def lies_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether `path` is `folder` or lies inside it at any depth, as given (made
    absolute) or with every symbolic link resolved, on either side: a checkpoint reached
    through a link into `folder`, or named through a link `folder` points to, is inside
    it. The check of the inputs of a compile against the BUILD it replaces
    (`flintc.runtime.build.check_inputs_outside`)."""
    paths = {Path(os.path.abspath(path)), Path(os.path.realpath(path))}
    folders = {Path(os.path.abspath(folder)), Path(os.path.realpath(folder))}
    return any(f == p or f in p.parents for p in paths for f in folders)


def dump_dir_from_env() -> str | None:
    """$FLINTC_DUMP_DIR (where `compile_step`, `flintc verify` and the temporary BUILD of
    `flintc run` write their pass-by-pass dumps), or None when it is unset or empty.

    `flintc compile` never reads it: a BUILD keeps its own dumps in BUILD/dumps. So
    the variable must not point into a BUILD (a folder holding build.json, what `flintc
    compile` takes for one), the BUILD itself included: the dumps would mix with the
    build's files or replace its BUILD/dumps/<function>/ with another compile's, and the
    next `flintc compile` into that BUILD would replace the folder, dumps and all; nor
    be a checkpoint folder itself (a new subfolder of one is fine:
    `checkpoint_or_build_problem`, `flintc dump --out`'s check).

    Raises:
        InputError: naming the variable and its value, when the folder could not be
            made or written: it, or the nearest existing folder above it, is a file,
            or cannot be written in; or it is, or is inside, a BUILD, or it is a
            checkpoint folder (naming it). Checked before any work (it used to fail after the capture or a
            whole compile as "<path>/decode_b1: Not a directory").
    """
    from flintc.errors import InputError

    value = os.environ.get(DUMP_DIR_ENV) or None
    if value is None:
        return None
    anc = Path(value)
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    fix = f"set {DUMP_DIR_ENV} to a writable folder, or unset it for no dumps"
    if anc.exists() and not anc.is_dir():
        raise InputError(f"{DUMP_DIR_ENV}={value}: cannot write the dumps there ({anc} is a file, not a "
                         f"folder); {fix}")
    why = cannot_write_in(anc)
    if why:
        raise InputError(f"{DUMP_DIR_ENV}={value}: cannot write the dumps there ({anc}: {why}); {fix}")
    problem = checkpoint_or_build_problem(value)
    if problem:
        raise InputError(f"{DUMP_DIR_ENV}={value}: {problem}; set {DUMP_DIR_ENV} to a folder outside any BUILD "
                         "and other than a checkpoint folder (a new subfolder of one is fine), or unset it "
                         "for no dumps")
    return value

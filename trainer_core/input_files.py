"""Open and read the user's input files safely, with errors that name the file and the fix.

Every input (the TOML config, the data, the tokenizer, the model config) is
opened here; a data file named by URL (`s3://…`) through fsspec (`open_url`).
A path is opened non-blocking and checked with `fstat` before a byte is read,
so a FIFO or a device fails at once instead of blocking forever or streaming
without end, and the check cannot race with a file swapped in
between. Text must be UTF-8 and JSON well formed; failures say `FILE:LINE:COL`. A read
that fails (EIO from a failing disk or a broken mount, or a special file such
as `/proc/self/mem` that looks regular) is a ConfigError naming the file too,
whichever reader hits it: the handle `open_input` returns translates it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


class InputFile:
    """A binary input opened by `open_input`: its reads raise ConfigError `LABEL: cannot be read (…); FIX`."""

    def __init__(self, handle, label: str, fix: str) -> None:
        self._handle, self._label, self._fix = handle, label, fix

    def _unreadable(self, error: OSError) -> ConfigError:
        return ConfigError(f"{self._label}: cannot be read ({error.strerror or error}); {self._fix}")

    def read(self, size: int = -1) -> bytes:
        try:
            return self._handle.read(size)
        except OSError as error:
            raise self._unreadable(error) from None

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                line = self._handle.readline()
            except OSError as error:
                raise self._unreadable(error) from None
            if not line:
                return
            yield line

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "InputFile":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def resolved_path(path: str | Path, key: str, fix: str) -> Path:
    """`path` made absolute, its symbolic links followed; one that loops (or cannot be followed) is bad input
    naming `key` and the fix."""
    path = Path(path).expanduser()
    try:
        return path.resolve()
    except RuntimeError:  # Python 3.11's resolve() on a symbolic link loop
        problem = "is a symbolic link that loops (or has too many levels)"
    except OSError as error:  # later Pythons: ELOOP, or a directory on the way that cannot be read
        problem = f"cannot be followed ({error.strerror or error})"
    raise ConfigError(f"{key}={str(path)!r} {problem}; {fix}")


def open_input(path: str | Path, label: str, fix: str) -> InputFile:
    """Open a regular file for reading, or raise ConfigError `LABEL: problem; FIX`.

    `label` names the input (`data.path=/x/y.jsonl`), `fix` says what to point it at;
    a read that fails later raises the same way.
    """
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO without a writer must not wait for one.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{label}: does not exist; {fix}") from None
    except PermissionError:
        raise ConfigError(
            f"{label}: cannot be read (permission denied); make it readable by this user (e.g. chmod a+r) or {fix}"
        ) from None
    except OSError as error:
        raise ConfigError(f"{label}: cannot be opened ({error.strerror}); {fix}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"{label}: is {file_kind(mode)}, not a regular file; {fix}")
    os.set_blocking(fd, True)
    return InputFile(os.fdopen(fd, "rb"), label, fix)


def open_url(url: str, label: str, fix: str):
    """A URL's object opened for reading through fsspec (binary, by lines or by blocks), or ConfigError
    `LABEL: problem; FIX` when it does not exist or the credentials may not read it. A store that does not answer
    raises its OSError, then or while it is read: an outage, not bad input."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True)
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise ConfigError(f"{label}: does not exist; {fix}") from None
    except PermissionError as error:
        raise ConfigError(f"{label}: cannot be read with the store's credentials ({error}); {fix}") from None


def read_input_bytes(path: str | Path, label: str, fix: str) -> bytes:
    with open_input(path, label, fix) as handle:
        return handle.read()


def decode_utf8(data: bytes, where: str, fix: str = "save it as UTF-8") -> str:
    """`data` as text, or ConfigError `WHERE:LINE:COL: not UTF-8 (byte 0x..); FIX`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{where}:{line}:{column}: not UTF-8 text (byte 0x{data[error.start]:02x}); {fix}") from None


def read_input_text(path: str | Path, label: str, fix: str) -> str:
    """A UTF-8 text file (see `open_input` for `label` and `fix`)."""
    return decode_utf8(read_input_bytes(path, label, fix), str(path), f"save it as UTF-8, or {fix}")


def parse_json(text: str, path: str | Path, label: str, fix: str) -> Any:
    """JSON text read from `path`; an empty, malformed or too deeply nested one is a ConfigError naming FILE:LINE:COL."""
    if not text.strip():
        raise ConfigError(f"{label}: {path} is empty; {fix}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg}) in {label}; fix the file or {fix}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to read in {label}; {fix}") from None


def parse_json_object(text: str, path: str | Path, label: str, fix: str) -> dict:
    value = parse_json(text, path, label, fix)
    if not isinstance(value, dict):
        raise ConfigError(f"{label}: {path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


def read_input_json_object(path: str | Path, label: str, fix: str) -> dict:
    """A file holding one JSON object (see `open_input` for `label` and `fix`)."""
    return parse_json_object(read_input_text(path, label, fix), path, label, fix)


def check_input_dir(path: str | Path, label: str, fix: str) -> Path:
    """An existing directory, or a ConfigError naming what the path is instead."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{label}: does not exist; {fix}") from None
    except OSError as error:
        raise ConfigError(f"{label}: cannot be read ({error.strerror}); {fix}") from None
    if not stat.S_ISDIR(mode):
        kind = "a regular file" if stat.S_ISREG(mode) else file_kind(mode)
        raise ConfigError(f"{label}: is {kind}, not a directory; {fix}")
    return path

"""Write a large file straight to the disk (O_DIRECT), past the page cache, through two aligned staging buffers.

A segment's state is written once and must be on the disk before its launch
ends. Written through the page cache, every byte is first copied into newly
allocated cache pages, then written back by fsync: on this project's CI
machines that ran at 2.6–3.3 s/GB (the cache's page allocation, not the
disk), against 0.55 s/GB for the same bytes written with O_DIRECT, whose
fsync then only flushes metadata. At real size it also keeps a 100 GB state
from evicting every cached page of the node (the data shards the next steps
read) and from throttling the writer on dirty pages.

O_DIRECT needs aligned memory, offsets and lengths. The bytes are copied into
one of two page-aligned staging buffers while the other is being written by
a writer thread (`os.pwrite` and torch's copy both release the GIL), so the
copy hides behind the disk. Each chunk is written at an offset that is a
multiple of the chunk; the last is padded to the block size and the file is
truncated to its true length. A filesystem that refuses O_DIRECT (tmpfs,
some network filesystems) gets the same chunked writes through its cache.
The caller fsyncs (as for any file of the state): O_DIRECT alone does not
flush the disk's own cache.
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import torch

CHUNK_BYTES = 16 * 2**20
"""Bytes per write: large enough that a write's cost is the disk's, small enough that the two buffers stay small."""
BLOCK_BYTES = 4096
"""Alignment O_DIRECT asks of offsets and lengths on every common filesystem (logical blocks of 512 or 4096)."""


def _open(path: Path, probe: mmap.mmap) -> tuple[int, bool]:
    """A new file at `path` for writing, O_DIRECT where the filesystem takes it; (descriptor, direct).

    Some filesystems accept O_DIRECT at open and refuse the writes (EINVAL; older overlayfs, some FUSE): one
    aligned block is written first, from `probe` (page-aligned), and refused, the file is opened again cached.
    The block is overwritten by the file's first bytes, or cut off when the file is shorter.
    """
    # O_NOFOLLOW: a link planted where a state file goes is refused, never written through.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            descriptor = os.open(path, flags | direct, 0o644)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                raise
        else:
            try:
                with memoryview(probe) as whole, whole[:BLOCK_BYTES] as block:
                    os.pwrite(descriptor, block, 0)
                return descriptor, True
            except OSError as error:
                os.close(descriptor)
                if error.errno != errno.EINVAL:
                    raise
    return os.open(path, flags, 0o644), False


class DirectFile:
    """An append-only file written in aligned chunks, O_DIRECT where possible.

        with DirectFile(path) as out:
            out.write(header_bytes)
            out.write_tensor(tensor)

    Leaving the block by an exception leaves a partial file: the caller writes
    into a temporary directory that is only renamed into place when whole.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(2)]  # anonymous maps are page-aligned
        try:
            self._fd, self.direct = _open(path, self._buffers[0])
        except BaseException:
            for buffer in self._buffers:
                buffer.close()
            raise
        self._views = [torch.frombuffer(buffer, dtype=torch.uint8) for buffer in self._buffers]
        self._pending: list[Future | None] = [None, None]
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-write")
        self._current = 0
        self._filled = 0
        """Bytes in the current buffer."""
        self._offset = 0
        """File offset of the current buffer's first byte."""
        self.size = 0
        self._finished = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append bytes (any buffer: copied into the staging buffers, never first into a bytes object)."""
        with memoryview(data) as view, view.cast("B") as source:

            def copy(start: int, source_start: int, length: int) -> None:
                self._buffers[self._current][start : start + length] = source[source_start : source_start + length]

            total = source.nbytes
            self._append(total, copy)
        return total

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """Append the tensor's bytes (row-major, native byte order: little-endian on every supported machine)."""
        source = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

        def copy(start: int, source_start: int, length: int) -> None:
            self._views[self._current][start : start + length].copy_(source[source_start : source_start + length])

        self._append(source.numel(), copy)

    def _append(self, total: int, copy) -> None:  # noqa: ANN001 - copy(start, source_start, length) into the buffer
        """Stage `total` bytes, `copy` moving each piece into the current buffer; each full buffer is written."""
        if self._finished:
            raise ValueError(f"{self.path}: written after it was finished (its tail is padded; nothing may follow)")
        position = 0
        while position < total:
            take = min(total - position, CHUNK_BYTES - self._filled)
            copy(self._filled, position, take)
            self._filled += take
            position += take
            if self._filled == CHUNK_BYTES:
                self._flush(CHUNK_BYTES)
        self.size += total

    def _flush(self, length: int) -> None:
        """Hand the current buffer (`length` bytes, aligned) to the writer; continue in the other one."""
        index = self._current
        self._pending[index] = self._writer.submit(self._write_all, index, length, self._offset)
        self._offset += length
        self._current = 1 - index
        self._filled = 0
        if (previous := self._pending[self._current]) is not None:
            previous.result()  # the other buffer is free again once its write is done (or raises its error)
            self._pending[self._current] = None

    def _write_all(self, index: int, length: int, offset: int) -> None:
        # Released on the way out, an error's too: a traceback keeping the view would keep the buffer from closing.
        with memoryview(self._buffers[index]) as whole, whole[:length] as view:
            written = 0
            while written < length:
                with view[written:] as rest:
                    written += os.pwrite(self._fd, rest, offset + written)

    def finish(self) -> int:
        """Write what is buffered (the tail padded to a block, then cut back to the file's true length) and wait
        for every write; returns the descriptor, ready for an fsync. Nothing may be appended after."""
        if not self._finished:
            self._finished = True
            if self._filled:
                padded = -(-self._filled // BLOCK_BYTES) * BLOCK_BYTES if self.direct else self._filled
                self._views[self._current][self._filled : padded].zero_()
                self._flush(padded)
            for index, future in enumerate(self._pending):
                if future is not None:
                    future.result()
                    self._pending[index] = None
            os.ftruncate(self._fd, self.size)
        return self._fd

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd < 0:
            return
        self._writer.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1
        del self._views
        for buffer in self._buffers:
            buffer.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._release()

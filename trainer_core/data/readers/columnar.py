"""Parquet and Arrow files, read through Hugging Face `datasets` one record batch at a time.

`load_dataset("parquet" | "arrow", data_files=[FILE], streaming=True)` reads
the file batch by batch (a Parquet row group, an Arrow record batch) and
yields each row as a dict; nothing is converted to an Arrow cache, so the
plan holds one batch of one file, whatever the dataset's size, and writes
nothing but `datasets`' lock files, into a temporary directory removed after.
A row's position is its index in the file, from 0 (as `datasets` and pandas
count).

Before `datasets` sees the file, pyarrow reads its footer or schema, so a file
that is not Parquet or Arrow (or is cut short) is a DataError naming it, and
an empty one yields nothing (`datasets` fails on a Parquet file of 0 rows).
`datasets` logs a failed read itself before raising; that log is silenced
while it reads, since the DataError says it once.

In a columnar file every row has every column: a field a row does not have
is null, which the messages format reads as absent. Free-form objects (tool
call `arguments` given as an object, `metadata`) become structs with the
union of every row's keys, the missing ones null; give `arguments` as a JSON
string there (OpenAI's wire format), which is rendered verbatim.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from ...data_sources import FIX, DataFile
from ..schema import DataError


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence `datasets`' logs and progress bars while it reads: bad input gets one message."""
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), datasets_logging.is_progress_bar_enabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL + 1)
    datasets_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets_logging.enable_progress_bar()


def _unreadable(file: DataFile, error: BaseException, after: int | None = None) -> DataError:
    where = str(file.path) if after is None else f"{file.path}: after row {after}"
    what = "Parquet" if file.type == "parquet" else "Arrow (IPC stream or file)"
    return DataError(
        f"{where}: not a readable {what} file ({type(error).__name__}: {' '.join(str(error).split())[:300]}); "
        f"rewrite it, or {FIX}"
    )


def _has_rows(file: DataFile) -> bool:
    """Whether the file holds a row, from its footer or its first batches (pyarrow); DataError when it is not
    a file of its type."""
    import pyarrow as pa

    with file.open() as handle:  # a FIFO, a device or an unreadable file fails by name before pyarrow opens it
        try:
            return _holds_rows(file, handle)
        except (pa.ArrowException, OSError) as error:
            raise _unreadable(file, error) from None


def _holds_rows(file: DataFile, handle) -> bool:
    """`_has_rows` on the opened file: a local one by its path, a URL's object through its fsspec handle."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    remote = isinstance(file.path, str)
    if file.type == "parquet":
        return pq.read_metadata(handle if remote else file.path).num_rows > 0
    with handle if remote else pa.memory_map(str(file.path)) as source:
        try:  # the stream format (what `datasets` writes), else the file format (what pyarrow's new_file writes)
            return any(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            return any(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def columnar_rows(file: DataFile) -> Iterator[tuple[int, str, Any]]:
    """The rows of a Parquet or Arrow file, from 0, each a dict of its columns."""
    if not _has_rows(file):
        return
    import datasets
    import pyarrow as pa

    with tempfile.TemporaryDirectory(prefix="rankflow-datasets-") as cache_dir:
        with _quiet_datasets():
            try:
                dataset = datasets.load_dataset(
                    file.type,
                    data_files=[str(file.path)],
                    split="train",
                    streaming=True,
                    cache_dir=cache_dir,
                    # A URL's object is streamed through fsspec, with the credentials its filesystem finds.
                    download_config=datasets.DownloadConfig(local_files_only=not isinstance(file.path, str)),
                )
                rows = iter(dataset)
            except (pa.ArrowException, OSError, ValueError) as error:
                raise _unreadable(file, error) from None
        index = 0
        while True:
            with _quiet_datasets():
                try:
                    row = next(rows)
                except StopIteration:
                    return
                except (pa.ArrowException, OSError, ValueError) as error:
                    raise _unreadable(file, error, after=index - 1 if index else None) from None
            yield index, file.where(index), row
            index += 1

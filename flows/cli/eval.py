"""`rankflow eval CHECKPOINT --data FILE`: the eval loss of a committed checkpoint, printed as one JSON line.

    rankflow eval CHECKPOINT --data FILE [--data FILE ...] [--format F] [--max-seq-len N] [--batch-rows N]
                  [--device D] [--store URL | --config TOML] [--work-dir DIR]

CHECKPOINT is a committed checkpoint's URL (`s3://BUCKET/PREFIX/RUN/checkpoints/step-N`, or a local store's
`STORE/RUN/checkpoints/step-N`), or `RUN@latest` / `RUN@step-N` in the store `--store` or `--config` (its
`storage.url`) names, as for `rankflow checkpoints`; or a directory on this machine: a copy `rankflow checkpoints
pull` wrote (every file checked again against its MANIFEST.json, `infra.publication.local_copy`; a file changed
since is refused, named) or a Hugging Face model directory without a manifest (read as it is; its summary has no
run_id, step or manifest_sha256). Nothing reads it before it is verified: it is downloaded
into a cache with every file's size and sha256 checked against its manifest (`infra.publication.parent`); a file
that does not match is refused, named. The cache is `--work-dir`'s `cache/checkpoints/RUN/step-N` (kept, and
used again while every file still hashes to the store's manifest), or a temporary directory removed on exit;
the data stages' scratch is a temporary directory, removed on exit. Nothing else is written, but for the
store's reader marker while the download runs (`infra.publication.readers`: retention leaves the checkpoint
alone meanwhile).

The eval loss is `trainer_core.run.checkpoint_eval`'s: the mean loss per assistant token, the same quantity a
run records during training. Standard output is one JSON line; bad input (a data file, a record, an option, a
reference that names no committed checkpoint) is one line on standard error and exit 2; a store that does not
answer, or a checkpoint that does not verify in it (as for `rankflow checkpoints pull`), is one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from trainer_core.errors import ConfigError

from .output import emit

if TYPE_CHECKING:
    from infra.publication.parent import CommittedCheckpoint, Created
    from infra.store.base import StorageSettings

EXIT_OK, EXIT_FAILED = 0, 1
_WHERE = (
    "give a committed checkpoint's URL (s3://BUCKET/PREFIX/RUN/checkpoints/step-N, or STORE/RUN/checkpoints/step-N "
    "of a local store), or RUN@latest / RUN@step-N with --store URL or --config TOML (rankflow checkpoints list RUN "
    "--store URL lists a run's checkpoints), or a directory on this machine (rankflow checkpoints pull --dest DIR "
    "writes one)"
)


def _label(args: argparse.Namespace) -> str:
    return f"checkpoint {args.checkpoint!r}"


def _storage(args: argparse.Namespace) -> str | StorageSettings | None:
    """The store --store or --config (its storage section, credentials and timeouts) names, or None."""
    if args.store is not None and args.config is not None:
        raise ConfigError("eval: give at most one of --store URL and --config TOML (its storage.url)")
    if args.config is not None:
        from trainer_core.config import load_config

        return load_config(args.config).storage
    return args.store


def fetch_verified(
    args: argparse.Namespace, cache_root: Path, created: Created | None = None
) -> tuple[CommittedCheckpoint, Path]:
    """The checkpoint CHECKPOINT names, downloaded into `cache_root` with every file verified (what it creates is
    recorded in `created`: `parent.undone_if_refused`)."""
    from infra.publication.parent import checkpoint_source, fetch_checkpoint, open_source_store
    from trainer_core.storage_url import check_local_store

    storage = _storage(args)
    source = checkpoint_source(args.checkpoint, storage if isinstance(storage, str | None) else storage.url)
    if source is None:
        raise ConfigError(f"{_label(args)} names no committed checkpoint; {_WHERE}")
    if source.store_url is None:
        raise ConfigError(
            f"{_label(args)} names a checkpoint of run {source.run_id} in a store: give the store, --store URL "
            "(a path, file://PATH or s3://BUCKET/PREFIX) or --config TOML (its storage.url)"
        )
    given_store = args.store is not None and source.store_url == args.store
    check_local_store(source.store_url, "--store" if given_store else "the checkpoint URL's store")
    store = open_source_store(source, storage if storage is not None else source.store_url)
    return fetch_checkpoint(store, source, cache_root, _label(args), fix="evaluate another checkpoint", created=created)


@contextmanager
def _places(work_dir: str | None, created: Created) -> Iterator[tuple[Path, Path]]:
    """(checkpoint cache root, scratch for the data stages): under --work-dir, or one temporary directory. The
    directories made for --work-dir are recorded in `created` (`parent.undone_if_refused`)."""
    from infra.publication.parent import missing_directories
    from trainer_core.input_files import resolved_path

    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="rankflow-eval-") as temporary:
            yield Path(temporary) / "checkpoints", Path(temporary) / "scratch"
        return
    root = resolved_path(work_dir, "--work-dir", fix="give a directory, not a link that loops")
    created.extend((directory, False) for directory in missing_directories(root))
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eval-scratch-", dir=root) as scratch:
        yield root / "cache" / "checkpoints", Path(scratch)


def _local_directory(reference: str) -> Path | None:
    """A directory on this machine that CHECKPOINT names and that is no store's checkpoint URL or RUN@…: a pulled
    copy or a model directory, read in place."""
    from infra.publication.parent import checkpoint_source

    if checkpoint_source(reference, None) is not None:
        return None
    path = Path(reference).expanduser()
    return path if path.is_dir() else None


def _read_local(directory: Path, label: str) -> tuple[dict, Path]:
    """(the summary's checkpoint fields, the directory) of a local copy, verified against its own manifest."""
    from infra.publication.local_copy import verify_local_copy

    copy = verify_local_copy(directory, label)
    named = {"checkpoint": str(directory.resolve()), "run_id": copy.run_id, "step": copy.step}
    return {**named, "manifest_sha256": copy.manifest_sha256}, directory


def cmd_eval(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from infra.publication.manifests import step_of
    from infra.publication.parent import CheckpointNotVerified, undone_if_refused
    from trainer_core.data import open_source
    from trainer_core.run.checkpoint_eval import EvalSettings, evaluate_checkpoint

    settings = EvalSettings(max_seq_len=args.max_seq_len, batch_rows=args.batch_rows, device=args.device)
    # A missing file or a wrong format costs no download.
    source = open_source(args.data, args.format, key="--data", format_option="--format")
    local = _local_directory(args.checkpoint)
    try:  # bad input found after the download: what this call made goes again
        with undone_if_refused() as created, _places(args.work_dir, created) as (cache_root, scratch):
            if local is not None:
                named, directory = _read_local(local, _label(args))
            else:
                checkpoint, directory = fetch_verified(args, cache_root, created)
                named = {
                    "checkpoint": checkpoint.url,
                    "run_id": checkpoint.run_id,
                    "step": step_of(checkpoint.checkpoint),
                    "manifest_sha256": checkpoint.manifest_sha256,
                }
            result = evaluate_checkpoint(directory, source, settings, scratch=scratch, label=_label(args))
    except CheckpointNotVerified as damaged:  # the store's fault, not the input's: exit 1, as checkpoints pull
        print(f"rankflow: eval {args.checkpoint}: {damaged}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as error:  # a store that does not answer, a full disk: not bad input
        print(f"rankflow: eval {args.checkpoint}: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED
    summary = {
        **named,
        "data": [str(file.path) for file in source.files],
        **result.to_dict(),
        "seconds": round(time.perf_counter() - started, 3),
    }
    emit(json.dumps(summary))
    return EXIT_OK


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    """Register `rankflow eval` on the top-level parser's subcommands."""
    from trainer_core.config import DataSection

    # data.format's choices (the config module is light: torch loads when the command runs, not to parse it).
    formats = get_args(DataSection.model_fields["format"].annotation)
    command = commands.add_parser(
        "eval",
        help="the eval loss of a committed checkpoint on data files (one JSON line)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument(
        "checkpoint",
        help="a committed checkpoint: its URL, or RUN@latest / RUN@step-N; or a directory on this machine (a pulled "
        "copy, or a model directory)",
    )
    command.add_argument(
        "--data", action="append", required=True, metavar="FILE", help="a data file or glob (repeat for more)"
    )
    command.add_argument("--format", default="auto", choices=formats, help="the records' format (default auto)")
    command.add_argument(
        "--max-seq-len",
        type=int,
        help="tokens a conversation keeps, the rest truncated (default: the model's max_position_embeddings, "
        "capped: docs/operations.md)",
    )
    command.add_argument("--batch-rows", type=int, default=8, help="conversations per forward (default 8)")
    command.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when there is one)")
    command.add_argument("--store", help="the store of RUN@…: a path, file://PATH or s3://BUCKET/PREFIX")
    command.add_argument("--config", help="a run config TOML whose storage.url is the store of RUN@…")
    command.add_argument(
        "--work-dir", help="keep the verified checkpoint in DIR/cache/checkpoints (default: a temp dir)"
    )
    command.set_defaults(handler=cmd_eval)

"""Lay out a bad-input case on disk, run the real CLI on it and collect what a user would see.

A case is a small file set (a run config plus whatever bad file it points at)
in its own directory. `run_case` calls `flows.cli.main` in this process with
the case directory as the working directory and fd-level capture of stdout
and stderr (so a warning written by a C extension counts too), and lists the
directory before and after: whatever appears is something bad input wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "tiny"
BAD_DATA = REPO / "tests" / "data" / "bad"

Builder = Callable[[Path, "Assets"], None]


@dataclass(frozen=True)
class Case:
    """One kind of bad input and what the CLI must say about it."""

    name: str
    kind: str
    """The family: config-file, config-value, override, storage, model, tokenizer, data-file, data-record, plan, serve."""
    where: str
    """Regex the message must match: the FILE:LINE or the config key it names (`{dir}`, `{tiny}`, `{bad}` expand)."""
    fix: str
    """Regex for the fix the message must give."""
    config: dict = field(default_factory=dict)
    """Section overrides of the tiny run config; a value of None removes the key."""
    files: dict[str, str | bytes | Builder] = field(default_factory=dict)
    """Files of the case, by path relative to its directory: text, bytes, or a builder (FIFO, model dir…)."""
    toml: str | bytes | None = None
    """The config file's exact content instead of the generated one (`{dir}`, `{tiny}` expand)."""
    argv: tuple[str, ...] = ()
    command: str = "run"
    config_path: str = "run.toml"
    env: dict[str, str | None] = field(default_factory=dict)
    """Environment variables of the case (`{dir}` expands); None unsets one (the `AWS_*` storage settings)."""


class Assets:
    """Inputs that are costly to make (a saved tiny model), made once per process under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._model: Path | None = None

    def model_dir(self) -> Path:
        if self._model is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            raw = json.loads((TINY / "model_config.json").read_text())
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
            self._model = self.root / "tiny-model"
            model.save_pretrained(self._model)
        return self._model


def expand(text: str, case_dir: Path, *, regex: bool) -> str:
    quote = re.escape if regex else (lambda s: s)
    for name, value in (("{dir}", case_dir), ("{tiny}", TINY), ("{bad}", BAD_DATA), ("{examples}", EXAMPLES)):
        text = text.replace(name, quote(str(value)))
    return text


def base_tree(case_dir: Path) -> dict:
    """The tiny run of tests/conftest.py, with outputs inside the case directory."""
    return {
        "run": {"name": "bad", "seed": 7, "work_dir": str(case_dir / "work")},
        "model": {"config": str(TINY / "model_config.json")},
        "tokenizer": {"path": str(TINY / "tokenizer.json")},
        "data": {"path": str(TINY / "sft.jsonl"), "max_seq_len": 128},
        "train": {
            "steps": 6,
            "steps_per_segment": 3,
            "global_batch_size": 8,
            "learning_rate": 3e-3,
            "logical_dp": 2,
            "nproc_per_node": 2,
            "segment_timeout_s": 300,
        },
        "storage": {"url": str(case_dir / "store")},
    }


def _toml_value(value) -> str:
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def to_toml(tree: dict, prefix: str = "") -> str:
    """A config tree as TOML; a non-table section value is written as a top-level key (a bad-input case),
    a nested table (`model.lora`) as its own `[model.lora]` section."""
    plain = [f"{key} = {_toml_value(value)}" for key, value in tree.items() if not isinstance(value, dict)]
    tables = []
    for section, values in tree.items():
        if isinstance(values, dict):
            keys = "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if not isinstance(v, dict))
            nested = to_toml({k: v for k, v in values.items() if isinstance(v, dict)}, f"{prefix}{section}.")
            tables.append(f"[{prefix}{section}]\n{keys}" + (f"\n{nested}" if nested else ""))
    return "\n".join(plain + tables)


def _apply(tree: dict, overrides: dict, case_dir: Path) -> dict:
    for section, values in overrides.items():
        if not isinstance(values, dict):
            tree[section] = values
            continue
        target = tree.setdefault(section, {})
        for key, value in values.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = expand(value, case_dir, regex=False) if isinstance(value, str) else value
    return tree


def materialize(case: Case, case_dir: Path, assets: Assets) -> list[str]:
    """Write the case's files into `case_dir`; return the CLI arguments."""
    case_dir.mkdir(parents=True)
    for relative, content in case.files.items():
        target = case_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(target, assets)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(expand(content, case_dir, regex=False))
    config_file = case_dir / "run.toml"
    if case.toml is not None:
        raw = case.toml if isinstance(case.toml, bytes) else expand(case.toml, case_dir, regex=False).encode()
        config_file.write_bytes(raw)
    else:
        config_file.write_text(to_toml(_apply(base_tree(case_dir), case.config, case_dir)))
    argv = [expand(arg, case_dir, regex=False) for arg in case.argv]
    return [case.command, str(case_dir / case.config_path), *argv]


def listing(root: Path) -> list[str]:
    """Every path under `root` (without following links), with its type and size."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            info = path.lstat()
            entries.append(f"{path.relative_to(root)} {info.st_mode:o} {info.st_size if path.is_file() else 0}")
    return sorted(entries)


@contextlib.contextmanager
def _captured_fds() -> Iterator[dict]:
    """Capture file descriptors 1 and 2 (and Python's sys.stdout/err) into the yielded dict."""
    result: dict[str, str] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    try:
        for fd, file in files.items():
            os.dup2(file.fileno(), fd)
        yield result
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            files[fd].seek(0)
        result["stdout"] = files[1].read().decode(errors="replace")
        result["stderr"] = files[2].read().decode(errors="replace")
        for file in files.values():
            file.close()


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str
    written: list[str]
    """Paths that appeared or changed under the case directory."""


@contextlib.contextmanager
def case_environment(case: Case, case_dir: Path) -> Iterator[None]:
    """The case's environment variables for the duration of the block, then the previous values."""
    saved = {name: os.environ.get(name) for name in case.env}
    try:
        for name, value in case.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = expand(value, case_dir, regex=False)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_case(case: Case, case_dir: Path, assets: Assets) -> Outcome:
    """`rankflow ARGS` in this process, from inside the case directory."""
    from flows.cli import main

    argv = materialize(case, case_dir, assets)
    before = listing(case_dir)
    cwd = os.getcwd()
    os.chdir(case_dir)
    try:
        with _captured_fds() as output, case_environment(case, case_dir):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # noqa: BLE001 - an escaped exception is a finding, recorded as the user would see it
                traceback.print_exc()
                code = -1
    finally:
        os.chdir(cwd)
    after = listing(case_dir)
    return Outcome(
        code=code, stdout=output["stdout"], stderr=output["stderr"], written=sorted(set(after) - set(before))
    )


def problems(case: Case, outcome: Outcome, case_dir: Path) -> list[str]:
    """Everything wrong with how the CLI treated this bad input (empty: all good)."""
    found = []
    if outcome.code != 2:
        found.append(f"exit status {outcome.code}, not 2")
    text = outcome.stdout + outcome.stderr
    if "Traceback" in text:
        found.append("a traceback was printed")
    if outcome.stdout.strip():
        found.append(f"stdout is not empty: {outcome.stdout[-500:]!r}")
    lines = outcome.stderr.rstrip("\n").split("\n")
    if not lines[0].startswith("rankflow: bad input: ") or any(not line.startswith("  ") for line in lines[1:]):
        found.append(f"stderr is not one 'rankflow: bad input:' message: {outcome.stderr[-1500:]!r}")
    if not re.search(expand(case.where, case_dir, regex=True), outcome.stderr):
        found.append(f"the message does not name {case.where!r}: {outcome.stderr[-1500:]!r}")
    if not re.search(case.fix, outcome.stderr):
        found.append(f"the message gives no fix matching {case.fix!r}: {outcome.stderr[-1500:]!r}")
    if outcome.written:
        found.append(f"bad input wrote files: {outcome.written[:5]}")
    return found


def copy_model(mutate: Callable[[Path], None] | None = None) -> Builder:
    """A builder: the saved tiny model at the target path, then `mutate(target)`."""

    def build(target: Path, assets: Assets) -> None:
        shutil.copytree(assets.model_dir(), target)
        if mutate is not None:
            mutate(target)

    return build

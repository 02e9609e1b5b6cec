"""A checkpoint directory on this machine: a `rankflow checkpoints pull` copy, checked against its own manifest.

A pulled copy holds the store's `MANIFEST.json` beside its files (`checkpoints.download_checkpoint`). Before a
reader loads it, every file that manifest lists is checked again here for its size and sha256 (a copy edited,
truncated or half-overwritten since the pull is refused, named), and a file it does not list is refused too (a
reader would load it unverified); the manifest itself is checked as a store's is.
A directory without a manifest is a plain model directory: nothing to check it against, read as it is.

`loader_line` is the Python line that loads a copy from any current directory (`rankflow checkpoints pull` prints
it). A LoRA adapter over a base the checkpoint ships (`base/`) names that base relative to its own directory, the
only name that travels with the checkpoint from store to store; peft's `AutoPeftModelForCausalLM` reads the name
from the current directory, so the line names the base by the copy's own path instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from infra.publication.manifests import MANIFEST_FILE, ManifestError, parse_manifest
from infra.store.verified import local_copy_matches
from trainer_core.errors import ConfigError


@dataclass(frozen=True)
class LocalCopy:
    """A directory's checkpoint as its manifest says (all None for a directory without one)."""

    directory: Path
    run_id: str | None
    step: int | None
    manifest_sha256: str | None


def verify_local_copy(directory: Path, label: str) -> LocalCopy:
    """`directory` with every file its manifest lists verified; ConfigError (bad input, naming the first file that
    does not match and the fix) otherwise."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return LocalCopy(directory, None, None, None)
    data = manifest_path.read_bytes()
    try:
        manifest = parse_manifest(data, str(manifest_path))
    except ManifestError as error:
        raise ConfigError(f"{label}: {error}; pull the checkpoint again into an empty directory") from None
    for entry in manifest.files:
        if not local_copy_matches(directory / entry.path, entry):  # a symlink never matches
            raise ConfigError(
                f"{label}: {entry.path} does not match {MANIFEST_FILE} (size {entry.size}, sha256 "
                f"{entry.sha256[:12]}…): the copy changed since it was pulled; pull the checkpoint again into an "
                "empty directory (rankflow checkpoints pull RUN_ID STEP --dest DIR)"
            )
    listed = {entry.path for entry in manifest.files} | {MANIFEST_FILE}
    for found in sorted(directory.rglob("*")):
        name = found.relative_to(directory).as_posix()
        if name not in listed and not found.is_dir():  # a file the readers could load but nothing verified
            raise ConfigError(
                f"{label}: {name} is not listed in {MANIFEST_FILE}: the copy changed since it was pulled; pull the "
                "checkpoint again into an empty directory (rankflow checkpoints pull RUN_ID STEP --dest DIR)"
            )
    return LocalCopy(directory, manifest.run_id, manifest.step, hashlib.sha256(data).hexdigest())


ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config (`trainer_core.run.checkpoint_layout` writes the base's name into it)."""


def loader_line(directory: Path) -> str | None:
    """The Python line that loads the model in `directory` from any current directory (absolute paths); None for
    a directory holding neither one adapter nor a full model (several adapters: each NAME/ is a directory of one)."""
    directory = directory.resolve()
    if (directory / ADAPTER_CONFIG).is_file():
        named = json.loads((directory / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
        shipped = directory / named  # a base in the checkpoint; otherwise the path (or hub id) as the run had it
        base = str(shipped.resolve()) if named and (shipped / "config.json").is_file() else named
        return (
            "from peft import PeftModel; from transformers import AutoModelForCausalLM; "
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(directory)!r})"
        )
    if (directory / "config.json").is_file():
        loaded = f"AutoModelForCausalLM.from_pretrained({str(directory)!r})"
        return f"from transformers import AutoModelForCausalLM; model = {loaded}"
    return None

"""`model.path` naming a Hugging Face hub model (`Qwen/Qwen3-8B`): resolved to its snapshot in the hub's cache.

A `model.path` that is no directory beside the config and has the form of a
hub id (`ORG/NAME`) is read through `huggingface_hub`'s own cache
(`HF_HUB_CACHE`, by default ~/.cache/huggingface/hub): `snapshot_download`
returns the snapshot of `model.revision` (unset: main), downloading the files
a run reads (configs, safetensors, tokenizer files) when online and reading
the cache alone under `HF_HUB_OFFLINE=1`. `model.path` then names that
snapshot directory, as a local model directory, and `model.revision` the
commit it is: the commit is in the run id, so the run id names the model's
bytes, and a branch that moves on starts another run instead of resuming this
one with other weights.

It is resolved before planning, where a committed checkpoint is fetched
(`infra/publication/parent.resolve_parent`), on the machine that plans the
run (a deployed run's worker). A name the hub does not know, a revision it
does not have, or a model missing from the cache while offline is bad input
(ConfigError naming the key); a hub that does not answer is an outage
(OSError: run the same command again).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError
from .hub_ids import is_hub_id

if TYPE_CHECKING:
    from .config import RunConfig

DOWNLOADED = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
"""What a run reads of a hub model: its configs, safetensors weights and tokenizer files (no .bin, .gguf, onnx)."""

_FIX = (
    "point model.path at a local Hugging Face model directory, or at a hub model id such as Qwen/Qwen3-8B "
    "(downloaded into the Hugging Face cache)"
)


def resolve_hub_model(config: RunConfig) -> None:
    """Point `model.path` at the cached snapshot of the hub model it names, and `model.revision` at its commit.

    Nothing happens for any other `model.path` (a local directory is absolute by now; a committed checkpoint's
    reference has no `ORG/NAME` form), so calling it again on a resolved config is a no-op.
    """
    repo_id = config.model.path
    if repo_id is None or not is_hub_id(repo_id):
        return
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    label = f"model.path={repo_id!r}"
    revision = config.model.revision
    try:
        directory = snapshot_download(
            repo_id, revision=revision, allow_patterns=DOWNLOADED, local_files_only=constants.HF_HUB_OFFLINE
        )
    except HFValidationError as error:
        raise ConfigError(f"{label} is no local directory and no valid hub model id ({error}); {_FIX}") from None
    except GatedRepoError:
        raise ConfigError(
            f"{label} is a gated hub model: accept its terms on huggingface.co and log in (hf auth login), or {_FIX}"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{label} is no directory beside the config and no model on the Hugging Face hub (or a private one: "
            f"log in with hf auth login); {_FIX}"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"model.revision={revision!r}: the hub model {repo_id} has no such branch, tag or commit; set it to one "
            "it has, or remove model.revision to read main"
        ) from None
    except LocalEntryNotFoundError as error:
        if not constants.HF_HUB_OFFLINE:
            # Online, but the hub did not answer and the cache has no copy: an outage, not the config's fault.
            raise ConnectionError(f"{label}: the Hugging Face hub did not answer ({error}); run again later") from None
        at = f" at revision {revision!r}" if revision else ""
        raise ConfigError(
            f"{label}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
            f"download it first (hf download {repo_id}), or unset HF_HUB_OFFLINE; or {_FIX}"
        ) from None
    snapshot = Path(directory)
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"{label}: the hub model has no config.json (not a transformers model); {_FIX}")
    config.model.path = str(snapshot)
    config.model.revision = snapshot.name  # the snapshot's directory is named after its commit

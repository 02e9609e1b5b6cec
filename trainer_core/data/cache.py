"""The plan's cache of the per-document stages (render → tokenize → mask → align).

Keyed by everything that decides those stages' output — the data file, the
tokenizer, the chat template, the advantage normalisation, and
`STAGES_VERSION`, which a change to any stage's logic must bump. A re-plan of
unchanged inputs (a resumed run, a new storage target, a different length
limit) loads the aligned documents instead of tokenizing again. Entries are
written aside and renamed, so a crash never leaves a half entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .advantages import AdvantageStats
from .align import Aligned

STAGES_VERSION = 1


def cache_key(data_sha256: str, tokenizer_sha256: str, template: str | None, normalization: str) -> str:
    material = json.dumps([STAGES_VERSION, data_sha256, tokenizer_sha256, template, normalization])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def _rl_array(array: np.ndarray | None) -> np.ndarray:
    if array is None:  # the data stages give every document of an RL source its arrays
        raise ValueError("an RL document without its behaviour logprobs or advantages cannot be cached")
    return array


def save_staged(
    cache_dir: Path,
    key: str,
    documents: list[Aligned],
    is_rl: bool,
    stats: AdvantageStats | None,
    digests: dict[str, str],
) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    lengths = np.array([d.num_tokens for d in documents], dtype=np.int64)
    tensors = {
        "lengths": lengths,
        "input_ids": np.concatenate([d.input_ids for d in documents]).astype(np.int64),
        "loss_mask": np.concatenate([d.loss_mask for d in documents]),
    }
    if is_rl:
        tensors["behaviour_logprobs"] = np.concatenate([_rl_array(d.behaviour_logprobs) for d in documents])
        tensors["advantages"] = np.concatenate([_rl_array(d.advantages) for d in documents])
        tensors["policy_version"] = np.array([d.policy_version for d in documents], dtype=np.int64)
    meta = {"is_rl": is_rl, "stats": asdict(stats) if stats else None, "digests": digests}
    tmp = cache_dir / f"{key}.tmp-{os.getpid()}"
    save_file(
        {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in tensors.items()},
        str(tmp),
        metadata={"meta": json.dumps(meta)},
    )
    os.replace(tmp, cache_dir / f"{key}.safetensors")


def load_staged(cache_dir: Path, key: str) -> tuple[list[Aligned], bool, AdvantageStats | None, dict[str, str]] | None:
    path = cache_dir / f"{key}.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        meta = json.loads(handle.metadata()["meta"])
    tensors = {n: t.numpy() for n, t in load_file(str(path)).items()}
    bounds = np.concatenate([[0], np.cumsum(tensors["lengths"])])
    is_rl = meta["is_rl"]
    documents = []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        documents.append(
            Aligned(
                input_ids=tensors["input_ids"][start:end],
                loss_mask=tensors["loss_mask"][start:end],
                behaviour_logprobs=tensors["behaviour_logprobs"][start:end] if is_rl else None,
                advantages=tensors["advantages"][start:end] if is_rl else None,
                policy_version=int(tensors["policy_version"][index]) if is_rl else None,
            )
        )
    stats = AdvantageStats(**meta["stats"]) if meta["stats"] else None
    return documents, is_rl, stats, meta["digests"]

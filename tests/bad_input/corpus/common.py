"""What the bad-input cases share: the tiny example's texts, file builders and case builders."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..harness import TINY, Assets, Case

MODEL_CONFIG = json.loads((TINY / "model_config.json").read_text())
GOOD_SFT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
GOOD_RL = (
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", '
    '"logprobs": [-0.5, -0.5, -0.5, -0.5]}], "reward": 1.0, "group_id": "g", "policy_version": 0}\n'
)


def fifo(target: Path, _: Assets) -> None:
    os.mkfifo(target)


def directory(target: Path, _: Assets) -> None:
    target.mkdir()


def model_config(**changes) -> str:
    return json.dumps({**MODEL_CONFIG, **changes})


def edit_weights(edit):
    def mutate(model_dir: Path) -> None:
        tensors = load_file(str(model_dir / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})

    return mutate


def truncate_weights(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def sharded_index_without_shard(model_dir: Path) -> None:
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    tensors = load_file(str(model_dir / "model-00001-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def data_section(*lines: str, kind: str = "sft", **data) -> dict:
    """A case's data file and the config pointing at it."""
    return {
        "files": {"data.jsonl": "".join(lines)},
        "config": {"data": {"path": "{dir}/data.jsonl", "kind": kind, **data}},
    }


def model_config_case(name: str, text: str | bytes, where: str, fix: str, **extra) -> Case:
    return Case(
        name,
        "model",
        where,
        fix,
        files={"model_config.json": text},
        config={"model": {"config": "{dir}/model_config.json"}},
        **extra,
    )


def tokenizer_case(name: str, files: dict, where: str, fix: str, path: str = "{dir}/tok") -> Case:
    return Case(name, "tokenizer", where, fix, files=files, config={"tokenizer": {"path": path}})


def set_case(name: str, override: str, where: str, fix: str) -> Case:
    return Case(name, "override", where, fix, argv=("--set", override))


def model_path_case(name: str, builder, where: str, fix: str) -> Case:
    return Case(
        name, "model", where, fix, files={"model": builder}, config={"model": {"config": None, "path": "{dir}/model"}}
    )


TOKENIZER_JSON = (TINY / "tokenizer.json").read_text()
SURROGATE = (
    '{"messages": [{"role": "user", "content": "bad \\ud800 escape"}, {"role": "assistant", "content": "ok"}]}\n'
)
DEEP = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
FIX_TOML = r"fix the syntax there"

# No credential anywhere botocore looks (variables, files, profile); instance metadata stays reachable as on a laptop.
NO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": None,
    "AWS_SECRET_ACCESS_KEY": None,
    "AWS_SESSION_TOKEN": None,
    "AWS_PROFILE": None,
    "AWS_SHARED_CREDENTIALS_FILE": "{dir}/no-credentials",
    "AWS_CONFIG_FILE": "{dir}/no-config",
}
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
}

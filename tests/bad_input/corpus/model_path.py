"""Bad-input cases: the model: model.path."""

from __future__ import annotations

from ..harness import copy_model
from .common import Case, edit_weights, model_path_case, sharded_index_without_shard, truncate_weights

CASES: list[Case] = [
    model_path_case(
        "model_path_is_a_file",
        lambda target, _: target.write_text("{}"),
        r"model\.path='{dir}/model': is a regular file, not a directory",
        r"point model\.path at a Hugging Face model directory",
    ),
    model_path_case(
        "model_path_without_config",
        copy_model(lambda d: (d / "config.json").unlink()),
        r"model\.path='{dir}/model': the directory has no config\.json",
        r"point model\.path at",
    ),
    model_path_case(
        "model_path_corrupt_config",
        copy_model(lambda d: (d / "config.json").write_text("{oops")),
        r"{dir}/model/config\.json:1:2: not valid JSON",
        r"fix the file",
    ),
    model_path_case(
        "model_path_without_weights",
        copy_model(lambda d: (d / "model.safetensors").unlink()),
        r"model\.path='{dir}/model': the directory has no weights",
        r"or use model\.config to start from random weights",
    ),
    model_path_case(
        "model_path_garbage_weights",
        copy_model(lambda d: (d / "model.safetensors").write_bytes(b"not safetensors")),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again or re-save the model",
    ),
    model_path_case(
        "model_path_empty_weights",
        copy_model(lambda d: (d / "model.safetensors").write_bytes(b"")),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again",
    ),
    model_path_case(
        "model_path_truncated_weights",
        copy_model(truncate_weights),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again",
    ),
    model_path_case(
        "model_path_missing_tensor",
        copy_model(edit_weights(lambda t: t.pop("model.norm.weight"))),
        r"model\.path='{dir}/model': the weights lack tensors the model needs \(model\.norm\.weight\)",
        r"use the weights that belong to this config\.json",
    ),
    model_path_case(
        "model_path_wrong_shape",
        copy_model(edit_weights(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:7].clone()}))),
        r"model\.path='{dir}/model': the weights do not load",
        r"re-save the model",
    ),
    model_path_case(
        "model_path_index_without_shard",
        copy_model(sharded_index_without_shard),
        r"{dir}/model/model\.safetensors\.index\.json: names the shard 'model-00002-of-00002\.safetensors'",
        r"copy the missing shard",
    ),
]

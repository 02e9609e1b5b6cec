"""The corpus of bad input: one case per kind a user can give, with what the message must say.

Each case is a small file set over the shipped tiny example (see harness.py)
and two regexes: what the message must name (the file and line, or the config
key) and the fix it must give. `tests/bad_input/test_corpus.py` runs the real
CLI on every case and asserts exit 2, one message, no traceback and nothing
written. Add a case here whenever a new kind of bad input is found.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from .harness import TINY, Assets, Case, copy_model

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


def _edit_weights(edit):
    def mutate(model_dir: Path) -> None:
        tensors = load_file(str(model_dir / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})

    return mutate


def _truncate(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _sharded_index_without_shard(model_dir: Path) -> None:
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    tensors = load_file(str(model_dir / "model-00001-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _data(*lines: str, kind: str = "sft", **data) -> dict:
    """A case's data file and the config pointing at it."""
    return {
        "files": {"data.jsonl": "".join(lines)},
        "config": {"data": {"path": "{dir}/data.jsonl", "kind": kind, **data}},
    }


def _model_config_case(name: str, text: str | bytes, where: str, fix: str, **extra) -> Case:
    return Case(
        name,
        "model",
        where,
        fix,
        files={"model_config.json": text},
        config={"model": {"config": "{dir}/model_config.json"}},
        **extra,
    )


def _tokenizer_case(name: str, files: dict, where: str, fix: str, path: str = "{dir}/tok") -> Case:
    return Case(name, "tokenizer", where, fix, files=files, config={"tokenizer": {"path": path}})


def _set_case(name: str, override: str, where: str, fix: str) -> Case:
    return Case(name, "override", where, fix, argv=("--set", override))


def _model_path_case(name: str, builder, where: str, fix: str) -> Case:
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
_NO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": None,
    "AWS_SECRET_ACCESS_KEY": None,
    "AWS_SESSION_TOKEN": None,
    "AWS_PROFILE": None,
    "AWS_SHARED_CREDENTIALS_FILE": "{dir}/no-credentials",
    "AWS_CONFIG_FILE": "{dir}/no-config",
}
_DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
}

CASES: list[Case] = [
    # --- the config file itself
    Case(
        "config_missing",
        "config-file",
        r"config file '{dir}/nope\.toml': does not exist",
        r"pass the path of a TOML config",
        config_path="nope.toml",
    ),
    Case(
        "config_is_directory",
        "config-file",
        r"config file '{dir}/conf': is a directory",
        r"pass the path of a TOML config",
        files={"conf": directory},
        config_path="conf",
    ),
    Case(
        "config_is_fifo",
        "config-file",
        r"config file '{dir}/pipe\.toml': is a FIFO",
        r"pass the path of a TOML config",
        files={"pipe.toml": fifo},
        config_path="pipe.toml",
    ),
    Case(
        "config_not_utf8",
        "config-file",
        r"{dir}/run\.toml:2:12: not UTF-8 text \(byte 0xe9\)",
        r"save it as UTF-8",
        toml=b'[run]\nname = "caf\xe9"\n',
    ),
    Case(
        "config_malformed_toml",
        "config-file",
        r"{dir}/run\.toml:1:7: not valid TOML",
        FIX_TOML,
        toml="[train\nsteps = 3\n",
    ),
    Case(
        "config_duplicate_key",
        "config-file",
        r"{dir}/run\.toml:3:\d+: not valid TOML",
        FIX_TOML,
        toml="[train]\nsteps = 3\nsteps = 4\n",
    ),
    Case("config_empty", "config-value", r"model: required section is missing", r"add a \[model\] table", toml=""),
    Case(
        "section_not_a_table",
        "config-value",
        r"  train: must be a table of keys \(got 5\)",
        r"write it as a \[train\] section",
        config={"train": 5},
    ),
    Case(
        "section_array_of_tables",
        "config-value",
        r"  train: must be a table of keys",
        r"write it as a \[train\] section",
        toml='[[train]]\nsteps = 3\n[model]\nconfig = "{tiny}/model_config.json"\n[tokenizer]\npath = "{tiny}/tokenizer.json"\n'
        '[data]\npath = "{tiny}/sft.jsonl"\n',
    ),
    Case(
        "unknown_section",
        "config-value",
        r"  trian: unknown key",
        r"did you mean 'train'\?",
        config={"trian": {"steps": 3}},
    ),
    Case(
        "unknown_key",
        "config-value",
        r"  train\.stepz: unknown key",
        r"did you mean 'steps'\?",
        config={"train": {"stepz": 3}},
    ),
    Case(
        "missing_section",
        "config-value",
        r"  data: required section is missing",
        r"add a \[data\] table",
        toml='[model]\nconfig = "{tiny}/model_config.json"\n[tokenizer]\npath = "{tiny}/tokenizer.json"\n',
    ),
    Case(
        "missing_key",
        "config-value",
        r"  data\.path: required key is missing",
        r"add it to the config",
        config={"data": {"path": None}},
    ),
    Case(
        "wrong_type",
        "config-value",
        r"  train\.steps: must be a whole number \(got 'ten'\)",
        r"write a whole number \(without quotes\)",
        config={"train": {"steps": "ten"}},
    ),
    Case(
        "float_for_int",
        "config-value",
        r"  train\.steps: must be a whole number \(got 1\.5\)",
        r"write a whole number",
        config={"train": {"steps": 1.5}},
    ),
    Case(
        "string_for_bool",
        "config-value",
        r"  data\.pack: must be true or false \(got 'maybe'\)",
        r"write true or false",
        config={"data": {"pack": "maybe"}},
    ),
    Case(
        "learning_rate_inf",
        "config-value",
        r"  train\.learning_rate: must be a finite number \(got inf\)",
        r"set a finite value",
        config={"train": {"learning_rate": float("inf")}},
    ),
    Case(
        "learning_rate_nan",
        "config-value",
        r"  train\.learning_rate: must be a finite number \(got nan\)",
        r"set a finite value",
        config={"train": {"learning_rate": float("nan")}},
    ),
    Case(
        "learning_rate_negative",
        "config-value",
        r"  train\.learning_rate: must be > 0 \(got -1\.0\)",
        r"set a positive value such as the default 0\.0001",
        config={"train": {"learning_rate": -1.0}},
    ),
    Case(
        "betas_one",
        "config-value",
        r"  train\.betas\.1: must be < 1 \(got 1\.0\)",
        r"betas are decay rates in \[0, 1\)",
        config={"train": {"betas": [0.9, 1.0]}},
    ),
    Case(
        "betas_negative",
        "config-value",
        r"  train\.betas\.0: must be >= 0 \(got -0\.1\)",
        r"betas are decay rates",
        config={"train": {"betas": [-0.1, 0.95]}},
    ),
    Case(
        "betas_one_value",
        "config-value",
        r"  train\.betas\.1: too few items",
        r"give a list of the length",
        config={"train": {"betas": [0.9]}},
    ),
    Case(
        "eps_zero",
        "config-value",
        r"  train\.eps: must be > 0 \(got 0\.0\)",
        r"set a positive value",
        config={"train": {"eps": 0.0}},
    ),
    Case(
        "weight_decay_nan",
        "config-value",
        r"  train\.weight_decay: must be a finite number",
        r"set a finite value",
        config={"train": {"weight_decay": float("nan")}},
    ),
    Case(
        "grad_clip_negative",
        "config-value",
        r"  train\.grad_clip: must be >= 0",
        r"set a value >= 0",
        config={"train": {"grad_clip": -1.0}},
    ),
    Case(
        "segment_timeout_inf",
        "config-value",
        r"  train\.segment_timeout_s: must be a finite number",
        r"set a finite value",
        config={"train": {"segment_timeout_s": float("inf")}},
    ),
    Case(
        "steps_zero",
        "config-value",
        r"  train\.steps: must be >= 1 \(got 0\)",
        r"set a value >= 1",
        config={"train": {"steps": 0}},
    ),
    Case(
        "logical_dp_not_multiple",
        "config-value",
        r"train\.logical_dp=3 is not a multiple of train\.nproc_per_node=2",
        r"choose a logical_dp",
        config={"train": {"logical_dp": 3}},
    ),
    Case(
        "nodes_world_not_dividing",
        "config-value",
        r"train\.logical_dp=2 is not a multiple of the world size train\.nnodes × train\.nproc_per_node = 2 × 2 = 4",
        r"choose a logical_dp that 4 divides",
        config={"train": {"nnodes": 2}},
    ),
    Case(
        "node_deployment_without_endpoint",
        "config-value",
        r"train\.node_deployment='rankflow-node/tiny'",
        r"set train\.rdzv_endpoint",
        config={"train": {"nnodes": 2, "nproc_per_node": 1, "node_deployment": "rankflow-node/tiny"}},
    ),
    Case(
        "rdzv_endpoint_no_port",
        "config-value",
        r"train\.rdzv_endpoint='node0' is not HOST:PORT",
        r"write node 0's address and a free port",
        config={"train": {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": "node0"}},
    ),
    Case(
        "batch_not_multiple",
        "config-value",
        r"train\.global_batch_size=5 is not a multiple of train\.logical_dp=2",
        r"e\.g\. global_batch_size=4",
        config={"train": {"global_batch_size": 5}},
    ),
    Case(
        "data_kind_unknown",
        "config-value",
        r"  data\.kind: must be one of 'sft' or 'rl' \(got 'dpo'\)",
        r"choose one of them",
        config={"data": {"kind": "dpo"}},
    ),
    Case(
        "objective_unknown",
        "config-value",
        r"  train\.objective: must be one of 'sft' or 'clipped_policy_gradient' \(got 'dpo'\)",
        r"choose one of them",
        config={"train": {"objective": "dpo"}},
    ),
    Case(
        "objective_needs_what_the_data_lack",
        "config-value",
        r"train\.objective='clipped_policy_gradient' needs behaviour_logprobs, advantages, policy_version, which "
        r"data\.kind='sft' data do not carry",
        r"choose an objective for that data \(e\.g\. train\.objective='sft'\)",
        config={"train": {"objective": "clipped_policy_gradient"}},
    ),
    Case(
        "overflow_unknown",
        "config-value",
        r"  data\.overflow: must be one of",
        r"choose one of them",
        config={"data": {"overflow": "wrap"}},
    ),
    Case(
        "max_seq_len_tiny",
        "config-value",
        r"  data\.max_seq_len: must be >= 8 \(got 2\)",
        r"set a value >= 8",
        config={"data": {"max_seq_len": 2}},
    ),
    Case(
        "run_name_spaces",
        "config-value",
        r"  run\.name: must start with a letter or digit",
        r"rename it",
        config={"run": {"name": "my run"}},
    ),
    Case(
        "seed_negative",
        "config-value",
        r"  run\.seed: must be >= 0 \(got -1\)",
        r"set a value >= 0",
        config={"run": {"seed": -1}},
    ),
    Case(
        "seed_past_int64",
        "config-value",
        r"  run\.seed: must be <= 9223372036854775807",
        r"set a value <=",
        config={"run": {"seed": 2**64}},
    ),
    Case(
        "lease_wait_negative",
        "config-value",
        r"  run\.lease_wait_s: must be >= 0 \(got -1\)",
        r"set a value >= 0",
        config={"run": {"lease_wait_s": -1}},
    ),
    Case(
        "lease_wait_inf",
        "config-value",
        r"  run\.lease_wait_s: must be a finite number",
        r"set a finite value",
        config={"run": {"lease_wait_s": float("inf")}},
    ),
    Case(
        "lease_ttl_zero",
        "config-value",
        r"  run\.lease_ttl_s: must be >= 1 \(got 0\)",
        r"set a value >= 1",
        config={"run": {"lease_ttl_s": 0}},
    ),
    Case(
        "lease_ttl_not_a_number",
        "config-value",
        r"  run\.lease_ttl_s: must be a number \(got 'soon'\)",
        r"write a number",
        config={"run": {"lease_ttl_s": "soon"}},
    ),
    Case(
        "model_two_sources",
        "config-value",
        r"  model: set exactly one of model\.path",
        r"or model\.config",
        config={"model": {"path": "{dir}"}},
    ),
    Case(
        "model_no_source",
        "config-value",
        r"  model: set exactly one of model\.path",
        r"or model\.config",
        config={"model": {"config": None}},
    ),
    Case(
        "max_shard_size_banana",
        "config-value",
        r"  export\.max_shard_size: max_shard_size='banana' is not a positive size",
        r'such as "2GB"',
        config={"export": {"max_shard_size": "banana"}},
    ),
    Case(
        "max_shard_size_zero",
        "config-value",
        r"  export\.max_shard_size: max_shard_size='0GB' is not a positive size",
        r'such as "2GB"',
        config={"export": {"max_shard_size": "0GB"}},
    ),
    Case(
        "max_shard_size_number",
        "config-value",
        r"  export\.max_shard_size: must be a string \(got 1000\)",
        r"write a string",
        config={"export": {"max_shard_size": 1000}},
    ),
    Case(
        "clip_high_inf",
        "config-value",
        r"  rl\.clip_high: must be a finite number",
        r"set a finite value",
        config={"rl": {"clip_high": float("inf")}},
    ),
    Case(
        "clip_low_one",
        "config-value",
        r"  rl\.clip_low: must be < 1 \(got 1\.0\)",
        r"set a value < 1",
        config={"rl": {"clip_low": 1.0}},
    ),
    Case(
        "policy_version_past_int64",
        "config-value",
        r"  rl\.initial_policy_version: must be <= 9223372036854775807",
        r"set a value <=",
        config={"rl": {"initial_policy_version": 2**63}},
    ),
    Case(
        "train_dtype_unknown",
        "config-value",
        r"  train\.dtype: must be one of 'float32' or 'bfloat16' \(got 'float16'\)",
        r"choose one of them",
        config={"train": {"dtype": "float16"}},
    ),
    Case(
        "pad_vocab_zero",
        "config-value",
        r"  model\.pad_vocab_to_multiple_of: must be >= 1 \(got 0\)",
        r"set a value >= 1",
        config={"model": {"pad_vocab_to_multiple_of": 0}},
    ),
    Case(
        "planner_miss_threshold_zero",
        "config-value",
        r"  train\.planner_miss_threshold: must be > 0",
        r"set a positive value",
        config={"train": {"planner_miss_threshold": 0.0}},
    ),
    Case(
        "lora_rank_zero",
        "config-value",
        r"  model\.lora\.rank: must be >= 1 \(got 0\)",
        r"set a value >= 1",
        config={"model": {"lora": {"rank": 0}}},
    ),
    Case(
        "lora_dropout_nan",
        "config-value",
        r"  model\.lora\.dropout: must be a finite number",
        r"set a finite value",
        config={"model": {"lora": {"dropout": float("nan")}}},
    ),
    Case(
        "lora_targets_empty",
        "config-value",
        r"  model\.lora\.target_modules: target_modules \[\] is empty",
        r'or write "all-linear"',
        config={"model": {"lora": {"target_modules": []}}},
    ),
    Case(
        "lora_targets_a_word",
        "config-value",
        r"  model\.lora\.target_modules: 'all' is neither a list",
        r'or write "all-linear"',
        config={"model": {"lora": {"target_modules": "all"}}},
    ),
    Case(
        "lora_target_not_in_model",
        "model",
        r"model\.lora\.target_modules: \['qkv_proj'\] match no module of this model",
        r"choose among its linear layers \[.*'q_proj'",
        config={"model": {"lora": {"target_modules": ["q_proj", "qkv_proj"]}}},
    ),
    Case(
        "lora_target_not_linear",
        "model",
        r"model\.lora\.target_modules=\['norm'\] does not fit this model",
        r"choose among its linear layers",
        config={"model": {"lora": {"target_modules": ["norm"]}}},
    ),
    Case(
        "lora_on_padded_output",
        "model",
        r"model\.lora\.target_modules adapts the embedding or the output layer",
        r"leave those layers out of target_modules",
        config={"model": {"lora": {"target_modules": ["lm_head"]}, "pad_vocab_to_multiple_of": 64}},
    ),
    Case(
        "merge_lora_without_lora",
        "config-value",
        r"export\.merge_lora = true but there is no \[model\.lora\] adapter",
        r"add a \[model\.lora\] section, or set export\.merge_lora = false",
        config={"export": {"merge_lora": True}},
    ),
    # --- storage and output locations
    Case(
        "s3_no_bucket",
        "storage",
        r"  storage\.url: storage\.url='s3://' names no bucket",
        r"write s3://BUCKET/PREFIX",
        config={"storage": {"url": "s3://"}},
    ),
    Case(
        "s3_empty_bucket",
        "storage",
        r"  storage\.url: storage\.url='s3:///runs' names no bucket",
        r"write s3://BUCKET/PREFIX",
        config={"storage": {"url": "s3:///runs"}},
    ),
    Case(
        "s3_bad_bucket_name",
        "storage",
        r"'my bucket' is not a valid S3 bucket name",
        r"bucket names are 3-63",
        config={"storage": {"url": "s3://my bucket/runs"}},
    ),
    Case(
        "s3_empty_segment",
        "storage",
        r"storage\.url='s3://rankflow//runs' has an empty",
        r"plain names joined by single '/'",
        config={"storage": {"url": "s3://rankflow//runs"}},
    ),
    # The storage pre-flight (infra/store/preflight.py) runs before anything is written: a setting no retry can fix is bad input.
    Case(
        "s3_no_credentials",
        "storage",
        r"storage\.url='s3://rankflow/runs' at http://127\.0\.0\.1:9: no AWS credentials",
        r"set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**_NO_CREDENTIALS, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
    ),
    Case(
        "s3_endpoint_not_a_url",
        "storage",
        r"AWS_ENDPOINT_URL='not-a-url' \(the endpoint of storage\.url='s3://rankflow/runs'\) "
        r"is not an S3 endpoint URL",
        r"set AWS_ENDPOINT_URL to http://HOST:PORT or https://HOST:PORT",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**_DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": "not-a-url"},
    ),
    Case(
        "s3_endpoint_with_a_path",
        "storage",
        r"AWS_ENDPOINT_URL='http://127\.0\.0\.1:9/s3' .* has a path \('/s3'\)",
        r"without a path",
        config={"storage": {"url": "s3://rankflow/runs"}},
        env={**_DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": "http://127.0.0.1:9/s3"},
    ),
    Case(
        "storage_unknown_scheme",
        "storage",
        r"storage\.url='gs://bucket/runs': unsupported scheme 'gs'",
        r"use a local path, file://PATH or s3://BUCKET/PREFIX",
        config={"storage": {"url": "gs://bucket/runs"}},
    ),
    Case(
        "storage_empty",
        "storage",
        r"  storage\.url: storage\.url is empty",
        r"set a local path",
        config={"storage": {"url": ""}},
    ),
    Case(
        "storage_file_url_without_path",
        "storage",
        r"storage\.url='file://' has no path",
        r"write file:///absolute/path",
        config={"storage": {"url": "file://"}},
    ),
    Case(
        "storage_is_a_file",
        "storage",
        r"storage\.url='{dir}/store' cannot be a directory: it is a regular file",
        r"point storage\.url at a directory",
        files={"store": "not a directory"},
    ),
    Case(
        "work_dir_is_a_file",
        "storage",
        r"run\.work_dir='{dir}/work' cannot be a directory: it is a regular file",
        r"point run\.work_dir at a directory",
        files={"work": "not a directory"},
    ),
    Case(
        "work_dir_under_a_file",
        "storage",
        r"run\.work_dir='{dir}/file/work' cannot be a directory \(its parent '{dir}/file' is a regular file\)",
        r"point run\.work_dir at a directory",
        files={"file": "x"},
        config={"run": {"work_dir": "{dir}/file/work"}},
    ),
    # --- --set overrides
    _set_case(
        "set_unknown_key", "train.stepz=3", r"  train\.stepz \(from --set\): unknown key", r"did you mean 'steps'\?"
    ),
    _set_case(
        "set_bad_value",
        "train.steps=abc",
        r"  train\.steps \(from --set\): must be a whole number \(got 'abc'\)",
        r"write a whole number",
    ),
    _set_case(
        "set_lease_wait_negative",
        "run.lease_wait_s=-5",
        r"  run\.lease_wait_s \(from --set\): must be >= 0 \(got -5\)",
        r"set a value >= 0",
    ),
    _set_case(
        "set_inf",
        "train.learning_rate=inf",
        r"  train\.learning_rate \(from --set\): must be a finite number",
        r"set a finite value",
    ),
    _set_case(
        "set_without_equals",
        "train.steps",
        r"--set 'train\.steps': expected dotted\.key=value",
        r"e\.g\. --set train\.steps=10",
    ),
    _set_case(
        "set_into_a_value",
        "train.steps.x=1",
        r"--set train\.steps\.x=1: 'steps' is a value, not a section",
        r"set train\.steps itself",
    ),
    _set_case(
        "set_empty_key_segment",
        "train..steps=1",
        r"--set train\.\.steps=1: empty key segment",
        r"write it as section\.key=value",
    ),
    _set_case(
        "set_section_to_a_value",
        "train=5",
        r"  train \(from --set\): must be a table of keys \(got 5\)",
        r"write it as a \[train\] section",
    ),
    _set_case(
        "set_unknown_section", "trian.steps=3", r"  trian \(from --set\): unknown key", r"did you mean 'train'\?"
    ),
    # --- the model: model.config
    Case(
        "model_config_missing",
        "model",
        r"model\.config='{dir}/nope\.json' does not exist",
        r"point it at a config\.json",
        config={"model": {"config": "{dir}/nope.json"}},
    ),
    _model_config_case(
        "model_config_is_directory",
        directory,
        r"model\.config='{dir}/model_config\.json': is a directory",
        r"point model\.config at a Hugging Face config\.json",
    ),
    _model_config_case(
        "model_config_is_fifo",
        fifo,
        r"model\.config='{dir}/model_config\.json': is a FIFO",
        r"point model\.config at a Hugging Face config\.json",
    ),
    _model_config_case(
        "model_config_empty",
        "",
        r"model\.config='{dir}/model_config\.json': {dir}/model_config\.json is empty",
        r"point model\.config at",
    ),
    _model_config_case(
        "model_config_corrupt",
        '{"model_type": "qwen3",\n "vocab_size": 1024,,\n}',
        r"{dir}/model_config\.json:2:21: not valid JSON",
        r"fix the file or point model\.config at",
    ),
    _model_config_case(
        "model_config_truncated",
        model_config()[:200],
        r"{dir}/model_config\.json:\d+:\d+: not valid JSON",
        r"fix the file",
    ),
    _model_config_case(
        "model_config_not_utf8",
        b'{"model_type": "qwen3", "name": "\xff"}',
        r"{dir}/model_config\.json:1:34: not UTF-8 text \(byte 0xff\)",
        r"save it as UTF-8",
    ),
    _model_config_case(
        "model_config_not_an_object",
        "[1, 2]",
        r"{dir}/model_config\.json holds a JSON list, not an object",
        r"point model\.config at",
    ),
    _model_config_case(
        "model_config_without_model_type",
        json.dumps({k: v for k, v in MODEL_CONFIG.items() if k != "model_type"}),
        r"{dir}/model_config\.json: has no 'model_type'",
        r"add one such as \"qwen3\"",
    ),
    _model_config_case(
        "model_config_unknown_model_type",
        model_config(model_type="gpt-banana"),
        r"{dir}/model_config\.json: model_type='gpt-banana' is not a model type",
        r"use one such as \"qwen3\"",
    ),
    _model_config_case(
        "model_hidden_size_zero",
        model_config(hidden_size=0),
        r"{dir}/model_config\.json: hidden_size=0 must be a positive whole number",
        r"set it to the model's real hidden_size",
    ),
    _model_config_case(
        "model_layers_negative",
        model_config(num_hidden_layers=-1),
        r"{dir}/model_config\.json: num_hidden_layers=-1 must be a positive whole number",
        r"set it to",
    ),
    _model_config_case(
        "model_vocab_zero",
        model_config(vocab_size=0),
        r"{dir}/model_config\.json: vocab_size=0 must be a positive whole number",
        r"set it to",
    ),
    _model_config_case(
        "model_size_not_a_number",
        model_config(intermediate_size="big"),
        r"{dir}/model_config\.json: intermediate_size='big' must be a positive whole number",
        r"set it to",
    ),
    _model_config_case(
        "model_vocab_smaller_than_tokenizer",
        model_config(vocab_size=100),
        r"{dir}/model_config\.json: vocab_size=100 is smaller than the tokenizer's 1024 tokens",
        r"use a model whose vocab_size is at least 1024",
    ),
    _model_config_case(
        "model_heads_do_not_divide",
        model_config(num_key_value_heads=3),
        r"{dir}/model_config\.json: does not describe a working model",
        r"fix its sizes",
    ),
    _model_config_case(
        "model_layer_types_mismatch",
        model_config(layer_types=["full_attention"]),
        r"{dir}/model_config\.json: not a valid qwen3 config",
        r"fix it, or point model\.config at",
    ),
    _model_config_case(
        "model_positions_too_few",
        model_config(max_position_embeddings=16),
        r"{tiny}/sft\.jsonl:\d+: field messages: \d+ tokens need \d+ positions, more than the model's max_position_embeddings=16",
        r"set data\.max_seq_len to at most 16",
    ),
    # --- the model: model.path
    _model_path_case(
        "model_path_is_a_file",
        lambda target, _: target.write_text("{}"),
        r"model\.path='{dir}/model': is a regular file, not a directory",
        r"point model\.path at a Hugging Face model directory",
    ),
    _model_path_case(
        "model_path_without_config",
        copy_model(lambda d: (d / "config.json").unlink()),
        r"model\.path='{dir}/model': the directory has no config\.json",
        r"point model\.path at",
    ),
    _model_path_case(
        "model_path_corrupt_config",
        copy_model(lambda d: (d / "config.json").write_text("{oops")),
        r"{dir}/model/config\.json:1:2: not valid JSON",
        r"fix the file",
    ),
    _model_path_case(
        "model_path_without_weights",
        copy_model(lambda d: (d / "model.safetensors").unlink()),
        r"model\.path='{dir}/model': the directory has no weights",
        r"or use model\.config to start from random weights",
    ),
    _model_path_case(
        "model_path_garbage_weights",
        copy_model(lambda d: (d / "model.safetensors").write_bytes(b"not safetensors")),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again or re-save the model",
    ),
    _model_path_case(
        "model_path_empty_weights",
        copy_model(lambda d: (d / "model.safetensors").write_bytes(b"")),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again",
    ),
    _model_path_case(
        "model_path_truncated_weights",
        copy_model(_truncate),
        r"{dir}/model/model\.safetensors: not a complete safetensors file",
        r"copy it again",
    ),
    _model_path_case(
        "model_path_missing_tensor",
        copy_model(_edit_weights(lambda t: t.pop("model.norm.weight"))),
        r"model\.path='{dir}/model': the weights lack tensors the model needs \(model\.norm\.weight\)",
        r"use the weights that belong to this config\.json",
    ),
    _model_path_case(
        "model_path_wrong_shape",
        copy_model(_edit_weights(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:7].clone()}))),
        r"model\.path='{dir}/model': the weights do not load",
        r"re-save the model",
    ),
    _model_path_case(
        "model_path_index_without_shard",
        copy_model(_sharded_index_without_shard),
        r"{dir}/model/model\.safetensors\.index\.json: names the shard 'model-00002-of-00002\.safetensors'",
        r"copy the missing shard",
    ),
    # --- the tokenizer
    Case(
        "tokenizer_missing",
        "tokenizer",
        r"tokenizer\.path='{dir}/tok\.json' does not exist",
        r"point it at tokenizer\.json",
        config={"tokenizer": {"path": "{dir}/tok.json"}},
    ),
    _tokenizer_case(
        "tokenizer_dir_without_json",
        {"tok": directory},
        r"tokenizer\.path='{dir}/tok': the directory has no tokenizer\.json",
        r"point tokenizer\.path at a complete tokenizer\.json",
    ),
    _tokenizer_case(
        "tokenizer_empty",
        {"tok/tokenizer.json": ""},
        r"{dir}/tok/tokenizer\.json is empty",
        r"point tokenizer\.path at",
    ),
    _tokenizer_case(
        "tokenizer_corrupt_json",
        {"tok/tokenizer.json": '{"version": "1.0",\n  "model": {'},
        r"{dir}/tok/tokenizer\.json:2:13: not valid JSON",
        r"fix the file",
    ),
    _tokenizer_case(
        "tokenizer_not_utf8",
        {"tok/tokenizer.json": b'{"version": "\xfe"}'},
        r"{dir}/tok/tokenizer\.json:1:14: not UTF-8 text",
        r"save it as UTF-8",
    ),
    _tokenizer_case(
        "tokenizer_incomplete",
        {"tok/tokenizer.json": '{"version": "1.0"}'},
        r"{dir}/tok/tokenizer\.json is not a usable tokenizer \(Model missing",
        r"point tokenizer\.path at a complete",
    ),
    _tokenizer_case(
        "tokenizer_truncated",
        {"tok/tokenizer.json": TOKENIZER_JSON[: len(TOKENIZER_JSON) // 2]},
        r"{dir}/tok/tokenizer\.json:\d+:\d+: not valid JSON",
        r"fix the file",
    ),
    _tokenizer_case(
        "tokenizer_empty_vocabulary",
        {
            "tok/tokenizer.json": json.dumps(
                {"version": "1.0", "model": {"type": "WordLevel", "vocab": {}, "unk_token": "[UNK]"}}
            )
        },
        r"{dir}/tok/tokenizer\.json has an empty vocabulary",
        r"point tokenizer\.path at a complete",
    ),
    _tokenizer_case(
        "tokenizer_is_fifo",
        {"tok.json": fifo},
        r"tokenizer\.path='{dir}/tok\.json': is a FIFO",
        r"point tokenizer\.path at",
        path="{dir}/tok.json",
    ),
    _tokenizer_case(
        "tokenizer_config_corrupt",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/tokenizer_config.json": "{bad"},
        r"{dir}/tok/tokenizer_config\.json:1:2: not valid JSON",
        r"remove tokenizer_config\.json to use tokenizer\.json alone",
    ),
    _tokenizer_case(
        "chat_template_syntax_error",
        {
            "tok/tokenizer.json": TOKENIZER_JSON,
            "tok/chat_template.jinja": "{% for message in messages %}{{ message.content }",
        },
        r"tokenizer\.path='{dir}/tok': the chat template does not compile",
        r"fix its Jinja syntax",
    ),
    _tokenizer_case(
        "chat_template_not_a_string",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/tokenizer_config.json": '{"chat_template": 5}'},
        r"{dir}/tok/tokenizer_config\.json: field chat_template: expected a Jinja string",
        r"remove it to train with ChatML",
    ),
    _tokenizer_case(
        "chat_template_not_utf8",
        {"tok/tokenizer.json": TOKENIZER_JSON, "tok/chat_template.jinja": b"{{ '\xff' }}"},
        r"{dir}/tok/chat_template\.jinja:1:5: not UTF-8 text",
        r"save it as UTF-8",
    ),
    _tokenizer_case(
        "chat_template_fails_on_a_record",
        {
            "tok/tokenizer.json": TOKENIZER_JSON,
            "tok/chat_template.jinja": "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
            "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        },
        r"{tiny}/sft\.jsonl:\d+: field messages: the tokenizer's chat template failed",
        r"fix the record or the template",
    ),
    # --- the data file
    Case(
        "data_missing",
        "data-file",
        r"data\.path='{dir}/nope\.jsonl' does not exist",
        r"point it at a JSONL file",
        config={"data": {"path": "{dir}/nope.jsonl"}},
    ),
    Case(
        "data_is_directory",
        "data-file",
        r"data\.path='{dir}/data': is a directory, not a regular file",
        r"point data\.path at a JSONL file",
        files={"data": directory},
        config={"data": {"path": "{dir}/data"}},
    ),
    Case(
        "data_is_fifo",
        "data-file",
        r"data\.path='{dir}/data\.jsonl': is a FIFO \(named pipe\), not a regular file",
        r"point data\.path at a JSONL file",
        files={"data.jsonl": fifo},
        config={"data": {"path": "{dir}/data.jsonl"}},
    ),
    Case(
        "data_is_a_device",
        "data-file",
        r"data\.path='/dev/null': is a character device",
        r"point data\.path at a JSONL file",
        config={"data": {"path": "/dev/null"}},
    ),
    # /proc/self/mem is a regular file whose every read fails with EIO (as a dying disk or a broken network mount does).
    Case(
        "data_read_fails_eio",
        "data-file",
        r"data\.path='/proc/(self|\d+)/mem': cannot be read \(Input/output error\)",
        r"point data\.path at a JSONL file",
        config={"data": {"path": "/proc/self/mem"}},
    ),
    Case(
        "data_empty",
        "data-file",
        r"{bad}/empty_file\.jsonl: no conversations found",
        r"the file is empty",
        config={"data": {"path": "{bad}/empty_file.jsonl"}},
    ),
    Case(
        "data_blank_lines_only",
        "data-file",
        r"{dir}/data\.jsonl: no conversations found",
        r"the file is empty",
        **_data("\n", "   \n", "\n"),
    ),
    Case(
        "data_not_utf8",
        "data-record",
        r"{dir}/data\.jsonl:2: not UTF-8 text \(byte 0xff at column 44\)",
        r"save the file as UTF-8",
        files={"data.jsonl": GOOD_SFT.encode() + b'{"messages": [{"role": "user", "content": "\xff"}]}\n'},
        config={"data": {"path": "{dir}/data.jsonl"}},
    ),
    Case(
        "data_lone_surrogate",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.0\.content: holds a lone UTF-16 surrogate",
        r"fix the escape",
        **_data(GOOD_SFT, SURROGATE),
    ),
    Case(
        "data_deeply_nested",
        "data-record",
        r"{dir}/data\.jsonl:2: not valid JSON \(nested too deeply",
        r"each line must be one JSON object",
        **_data(GOOD_SFT, DEEP),
    ),
    Case(
        "data_token_id_past_int64",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.1\.token_ids\.0: Input should be less than or equal to 9223372036854775807",
        r"token ids index the tokenizer's vocabulary",
        **_data(
            GOOD_RL,
            GOOD_RL.replace('"logprobs"', '"token_ids": [99999999999999999999999, 1, 2, 3], "logprobs"'),
            kind="rl",
        ),
    ),
    Case(
        "data_policy_version_past_int64",
        "data-record",
        r"{dir}/data\.jsonl:2: field policy_version: Input should be less than or equal to 9223372036854775807",
        r"give the \(non-negative\) version",
        **_data(GOOD_RL, GOOD_RL.replace('"policy_version": 0', '"policy_version": 99999999999999999999'), kind="rl"),
    ),
    Case(
        "data_reward_past_float",
        "data-record",
        r"{dir}/data\.jsonl:2: field reward: Input should be a finite number",
        r"must be finite",
        **_data(GOOD_RL, GOOD_RL.replace('"reward": 1.0', '"reward": 1e400'), kind="rl"),
    ),
    Case(
        "data_nan_literal",
        "data-record",
        r"{dir}/data\.jsonl:2: field advantage: Input should be a finite number \(got nan\)",
        r"must be finite",
        **_data(GOOD_RL, GOOD_RL.replace('"reward": 1.0, "group_id": "g"', '"advantage": NaN'), kind="rl"),
    ),
    Case(
        "data_wrong_type",
        "data-record",
        r"{dir}/data\.jsonl:2: field messages\.0\.content: Input should be a valid string",
        r"fix the value",
        **_data(GOOD_SFT, '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}\n'),
    ),
    Case(
        "data_kind_rl_on_sft_records",
        "data-record",
        r"{tiny}/sft\.jsonl: data\.kind='rl' but the records carry no reward",
        r"set data\.kind='sft'",
        config={"data": {"kind": "rl"}},
    ),
    Case(
        "data_kind_sft_on_rl_records",
        "data-record",
        r"{tiny}/rl\.jsonl: the records are RL trajectories .* but data\.kind='sft'",
        r"set data\.kind='rl'",
        config={"data": {"path": "{tiny}/rl.jsonl", "max_seq_len": 160}},
    ),
    Case(
        "data_nothing_left_after_drop",
        "data-record",
        r"{dir}/data\.jsonl: no conversation left with loss tokens",
        r"raise data\.max_seq_len \(the shortest conversation has \d+ tokens\)",
        **_data(
            '{"messages": [{"role": "user", "content": "'
            + "word " * 40
            + '"}, {"role": "assistant", "content": "ok"}]}\n',
            max_seq_len=16,
            overflow="drop",
        ),
    ),
    # --- the plan's size
    Case(
        "steps_past_memory",
        "plan",
        r"train\.steps=1000000000000: planning would hold about [\d.]+ [EP]iB of shards in memory",
        r"lower train\.steps to at most \d+",
        config={"train": {"steps": 10**12}},
    ),
    Case(
        "steps_past_int64",
        "plan",
        r"train\.steps=1180591620717411303424: planning would hold",
        r"lower train\.steps to at most \d+",
        config={"train": {"steps": 2**70, "steps_per_segment": 2**70}},
    ),
    Case(
        "batch_past_memory",
        "plan",
        r"train\.steps=6: planning would hold",
        r"not even one step fits: lower train\.global_batch_size",
        config={"train": {"global_batch_size": 2**40}},
    ),
    Case(
        "packed_rows_past_memory",
        "plan",
        r"train\.steps=6: planning would hold",
        r"lower train\.global_batch_size or data\.max_seq_len \(the row length when packing\)",
        config={"data": {"pack": True, "max_seq_len": 2**40}},
    ),
    # --- rankflow serve: the schedule
    Case(
        "serve_bad_cron",
        "serve",
        r"--cron 'every day': not a valid cron expression",
        r'e\.g\. --cron "0 3 \* \* \*"',
        command="serve",
        argv=("--cron", "every day"),
    ),
    Case(
        "serve_hashed_cron",
        "serve",
        r"--cron 'H 3 \* \* \*': not a valid cron expression",
        r"write five fields",
        command="serve",
        argv=("--cron", "H 3 * * *"),
    ),
    Case(
        "serve_cron_out_of_range",
        "serve",
        r"--cron '61 \* \* \* \*': not a valid cron expression",
        r"write five fields",
        command="serve",
        argv=("--cron", "61 * * * *"),
    ),
    Case(
        "serve_interval_zero",
        "serve",
        r"--interval 0\.0: must be a positive number of seconds",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval", "0"),
    ),
    Case(
        "serve_interval_negative",
        "serve",
        r"--interval -5\.0: must be a positive number",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval=-5",),
    ),
    Case(
        "serve_interval_nan",
        "serve",
        r"--interval nan: must be a positive number",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval", "nan"),
    ),
    Case(
        "serve_interval_too_large",
        "serve",
        r"--interval 1e\+300: not a usable interval",
        r"give a number of seconds",
        command="serve",
        argv=("--interval", "1e300"),
    ),
    Case(
        "serve_both_schedules",
        "serve",
        r"rankflow serve: give exactly one of --cron EXPR or --interval SECONDS",
        r'e\.g\. --cron "0 3 \* \* \*"',
        command="serve",
        argv=("--cron", "0 3 * * *", "--interval", "60"),
    ),
    Case("serve_no_schedule", "serve", r"rankflow serve: give exactly one of", r"or --interval 3600", command="serve"),
    Case(
        "serve_bad_config",
        "serve",
        r"  train\.stepz: unknown key",
        r"did you mean 'steps'\?",
        command="serve",
        config={"train": {"stepz": 1}},
        argv=("--interval", "60"),
    ),
]

# The data corpus of tests/data/bad (one bad record each), through the CLI too. RL files run as data.kind='rl'.
_RL_FILES = {
    "logprob_count",
    "token_mismatch",
    "nonfinite_reward",
    "infinite_logprob",
    "positive_logprob",
    "reward_without_group",
    "missing_policy_version",
    "missing_logprobs",
}
_DATA_FIXES = {
    "malformed_json": r"each line must be one JSON object",
    "missing_field": r"add it",
    "unknown_role": r"use one of those",
    "empty_conversation": r"give at least one message",
    "no_assistant": r"add one or remove the line",
    "unknown_field": r"remove it or fix its spelling \(did you mean 'reward'\?\)",
    "logprob_count": r"recompute logprobs with the same tokenizer and template",
    "token_mismatch": r"the behaviour policy used a different tokenizer or template",
    "nonfinite_reward": r"must be finite",
    "infinite_logprob": r"must be finite",
    "positive_logprob": r"a logprob is the log of a probability, so it is at most 0",
    "reward_without_group": r"add group_id or advantage",
    "missing_policy_version": r"give the version of the policy that sampled it",
    "missing_logprobs": r"add them or set train=false",
    "mixed_kinds": r"split the file or complete this record",
    "too_long": r"raise max_seq_len or set data\.overflow",
    "tool_calls_on_user": r"move them to the assistant message that makes them",
    "null_content": r"give a string",
    "not_an_object": r"write each line as \{\"messages\": ",
}
for _name, _fix in _DATA_FIXES.items():
    CASES.append(
        Case(
            f"record_{_name}",
            "data-record",
            rf"{{bad}}/{_name}\.jsonl:2: ",
            _fix,
            config={"data": {"path": f"{{bad}}/{_name}.jsonl", "kind": "rl" if _name in _RL_FILES else "sft"}},
        )
    )

BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"

"""Bad-input cases: a run the memory model says cannot fit the training devices (trainer_core/run/device_memory.py)."""

from __future__ import annotations

from .common import Case

CASES: list[Case] = [
    Case(
        "model_past_device_memory",
        "plan",
        r"train\.device_memory_gb: this run needs about [\d.]+ [kMG]?B per rank \(.*\), more than the 1\.00 MB of "
        r"train\.device_memory_gb=0\.001",
        r'try, in order: train\.sharding = "fsdp"; \[model\.lora\]; '
        r'train\.dtype = "bfloat16"; train\.activation_checkpointing = "blocks"; '
        r"fewer rows per forward \(train\.micro_batch_size below 4\); more processes "
        r"\(train\.nproc_per_node, train\.nnodes\); lower train\.global_batch_size or data\.max_seq_len",
        config={"train": {"device_memory_gb": 0.001}},
    ),
    Case(
        "lora_bf16_checkpointed_past_device_memory",
        "plan",
        r"train\.device_memory_gb: this run needs about",
        r'try, in order: train\.sharding = "fsdp"; fewer rows per forward \(train\.micro_batch_size below 4\); '
        r"more processes \(train\.nproc_per_node, train\.nnodes\); lower "
        r"train\.global_batch_size or data\.max_seq_len; or raise train\.device_memory_gb",
        config={
            "train": {"device_memory_gb": 0.000001, "dtype": "bfloat16", "activation_checkpointing": "blocks"},
            "model": {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        },
    ),
]

"""The memory model (trainer_core/memory_model.py): its arithmetic on hand-made shapes, and Qwen3-8B pinned.

The 8B figures are the hand table of the issue-16 plan (§2: full fine-tune,
bf16, W = 8, one row of 4096 tokens per forward), derived here from a Qwen3-8B
config built on the meta device (the config's values are written below: no
download). The measured half (prediction vs the bytes a real Trainer and a
sharded W = 2 model hold) is tests/trainer/test_memory_prediction.py.
"""

from __future__ import annotations

import pytest

from trainer_core.memory_model import (
    GB,
    ActivationFit,
    MemorySettings,
    ModelShape,
    ParamShape,
    Unit,
    fixes,
    format_table,
    predict,
)

NO_ACTIVATIONS = ActivationFit(layer_linear=0, layer_quadratic=0, rest_linear=0, checkpointed_layer_linear=0)

QWEN3_8B = {  # Qwen/Qwen3-8B config.json, the values that decide shapes
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
}


def toy_shape() -> ModelShape:
    """An embedding of 97 rows, two layers of one 10×4 weight and one 4-vector, a head of 97 rows."""
    layer = (ParamShape(10, 40, True), ParamShape(4, 4, True))
    return ModelShape(
        units=(
            Unit("embedding", (ParamShape(97, 97 * 8, True),)),
            Unit("layer 0", layer),
            Unit("layer 1", layer),
            Unit("norm + lm_head", (ParamShape(8, 8, True), ParamShape(97, 97 * 8, True))),
        ),
        num_layers=2,
        vocab_rows=97,
    )


def test_a_shard_is_ceil_rows_over_w_rows():
    assert ParamShape(97, 97 * 8, True).local_numel(2) == 49 * 8
    assert ParamShape(97, 97 * 8, True).local_numel(4) == 25 * 8
    assert ParamShape(97, 97 * 8, True).padded_numel(4) == 100 * 8
    assert ParamShape(1, 1, True).local_numel(8) == 1  # a scalar: one padded row on every rank


def test_unsharded_fp32_holds_16_bytes_per_parameter_and_nothing_in_flight():
    shape = toy_shape()
    e = predict(shape, NO_ACTIVATIONS, MemorySettings(sharding="none", world_size=4, dtype="float32"))
    n = shape.numel
    assert (e.parameters, e.masters, e.moments, e.gradients) == (4 * n, 0, 8 * n, 4 * n)
    assert e.in_flight == e.partials == e.staged == e.snapshots == 0


def test_unsharded_bf16_adds_fp32_masters_and_fp32_gradients():
    n = toy_shape().numel
    e = predict(toy_shape(), NO_ACTIVATIONS, MemorySettings(sharding="none", world_size=1, dtype="bfloat16"))
    assert (e.parameters, e.masters, e.moments, e.gradients) == (2 * n, 4 * n, 8 * n, 4 * n)


def test_fsdp_shards_fp32_state_with_padding_and_keeps_no_second_copy():
    shape = toy_shape()
    e = predict(shape, NO_ACTIVATIONS, MemorySettings(sharding="fsdp", world_size=4, dtype="bfloat16"))
    local = 25 * 8 * 2 + 2 * (3 * 4 + 1 * 1) + 2  # 97 rows → 25 per rank; 10 → 3; 4 → 1; 8 → 2
    assert (e.parameters, e.masters, e.moments, e.gradients) == (4 * local, 0, 8 * local, 4 * local)


def test_in_flight_is_three_consecutive_units_in_backward_plus_the_fold_buffer():
    shape = toy_shape()
    settings = MemorySettings(sharding="fsdp", world_size=4, dtype="bfloat16", reduction="fast")
    per = {u.name: sum(p.padded_numel(4) for p in u.params) * (2 + 2 + 4) for u in shape.units}
    expected = per["norm + lm_head"] + per["layer 1"] + per["layer 0"]  # the heaviest window of three
    assert predict(shape, NO_ACTIVATIONS, settings).in_flight == expected
    deterministic = MemorySettings(sharding="fsdp", world_size=4, dtype="bfloat16", reduction="deterministic")
    # One FP32 shard of the largest unit's padded gradient (the norm: 2 rows per rank; the head 25 of 100):
    # the ordered fold receives one source's chunk at a time.
    receive = (8 + 100 * 8) // 4 * 4
    assert predict(shape, NO_ACTIVATIONS, deterministic).in_flight == expected + receive


def test_frozen_weights_have_no_masters_moments_or_gradients():
    frozen = ModelShape(
        units=(Unit("layer 0", (ParamShape(10, 40, False), ParamShape(10, 20, True))),), num_layers=1, vocab_rows=0
    )
    e = predict(frozen, NO_ACTIVATIONS, MemorySettings(sharding="none", world_size=1, dtype="bfloat16"))
    assert (e.parameters, e.masters, e.moments, e.gradients) == (2 * 60, 4 * 20, 8 * 20, 4 * 20)


def test_local_logical_ranks_keep_partials_under_deterministic_and_stage_under_fast():
    n = toy_shape().numel
    deterministic = MemorySettings(sharding="none", world_size=2, dtype="bfloat16", logical_dp=8)
    e = predict(toy_shape(), NO_ACTIVATIONS, deterministic)
    assert (e.partials, e.staged) == (3 * 2 * n, 0)  # 4 local logical ranks: 3 more bf16 gradients
    fast = MemorySettings(sharding="none", world_size=2, dtype="bfloat16", logical_dp=8, reduction="fast")
    e = predict(toy_shape(), NO_ACTIVATIONS, fast)
    assert (e.partials, e.staged) == (0, 2 * n)
    sharded = MemorySettings(sharding="fsdp", world_size=2, dtype="bfloat16", logical_dp=8)
    assert predict(toy_shape(), NO_ACTIVATIONS, sharded).partials == 0  # the ordered fold keeps none


def test_activations_scale_with_rows_layers_and_length_and_checkpointing_keeps_inputs():
    fit = ActivationFit(layer_linear=100, layer_quadratic=0.5, rest_linear=30, checkpointed_layer_linear=16)
    plain = MemorySettings(sharding="none", world_size=1, dtype="bfloat16", rows_per_logical_rank=3, seq_len=64)
    assert predict(toy_shape(), fit, plain).activations == 3 * (2 * (100 * 64 + 0.5 * 64 * 64) + 30 * 64)
    blocks = MemorySettings(
        sharding="none", world_size=1, dtype="bfloat16", rows_per_logical_rank=3, seq_len=64,
        activation_checkpointing="blocks",
    )  # fmt: skip
    assert predict(toy_shape(), fit, blocks).activations == 3 * (2 * 16 * 64 + (100 * 64 + 0.5 * 64 * 64) + 30 * 64)
    assert predict(toy_shape(), fit, blocks).head == 3 * 64 * 97 * (2 + 4 + 4)


def test_snapshots_count_one_copy_of_the_trainable_weights_per_held_revision():
    n = toy_shape().numel
    two = MemorySettings(sharding="none", world_size=1, dtype="bfloat16", held_revisions=2)
    assert predict(toy_shape(), NO_ACTIVATIONS, two).snapshots == 2 * 2 * n


def test_the_fixes_come_in_order_and_skip_what_the_config_does():
    plain = MemorySettings(sharding="none", world_size=1, dtype="float32")
    assert fixes(plain, lora=False, can_shard=True) == [
        'train.sharding = "fsdp"',
        "[model.lora]",
        'train.dtype = "bfloat16"',
        'train.activation_checkpointing = "blocks"',
        "more processes (train.nproc_per_node, train.nnodes)",
    ]
    assert fixes(plain, lora=True, can_shard=False) == [
        'train.dtype = "bfloat16"',
        'train.activation_checkpointing = "blocks"',
    ]
    four_rows = MemorySettings(sharding="none", world_size=1, dtype="bfloat16", rows_per_logical_rank=4)
    assert fixes(four_rows, lora=True, can_shard=False) == [
        'train.activation_checkpointing = "blocks"',
        "fewer rows per forward (train.micro_batch_size below 4)",
    ]
    sharded = MemorySettings(sharding="fsdp", world_size=2, dtype="bfloat16", logical_dp=2, rows_per_logical_rank=4)
    assert fixes(sharded, lora=True, can_shard=True)[-2:] == [
        "fewer rows per forward (more logical ranks: train.logical_dp above 2)",
        "more processes (train.nproc_per_node, train.nnodes)",
    ]


def test_the_table_has_a_line_per_term_and_the_total():
    settings = MemorySettings(sharding="none", world_size=1, dtype="float32")
    lines = format_table(predict(toy_shape(), NO_ACTIVATIONS, settings), settings)
    assert lines[0].startswith("memory per rank (sharding=none, W=1")
    assert len(lines) == 1 + 10 + 1 and lines[-1].split()[0] == "total"


# ------------------------------------------------------------------------------------------------ Qwen3-8B


@pytest.fixture(scope="module")
def qwen3_8b():
    from transformers import Qwen3Config

    from trainer_core.memory_shape import activation_fit, meta_model, model_shape

    config = Qwen3Config(**QWEN3_8B)
    return model_shape(meta_model(config, "bfloat16")), activation_fit(config, "bfloat16")


def _8b(qwen3_8b, sharding: str, checkpointing: str, reduction: str = "fast"):
    shape, fit = qwen3_8b
    settings = MemorySettings(
        sharding=sharding,  # type: ignore[arg-type]
        world_size=8,
        dtype="bfloat16",
        logical_dp=8,
        reduction=reduction,
        activation_checkpointing=checkpointing,
        rows_per_logical_rank=1,
        seq_len=4096,
    )
    return predict(shape, fit, settings)


def test_qwen3_8b_shapes_are_the_hand_tables(qwen3_8b):
    shape, _ = qwen3_8b
    assert shape.numel == 8_190_735_360  # 8.191 B
    sizes = {u.name: sum(p.numel for p in u.params) for u in shape.units}
    assert sizes["embedding"] == 151936 * 4096  # 622.3 M
    assert sizes["norm + lm_head"] == 151936 * 4096 + 4096
    assert sizes["layer 0"] == 192_946_432  # 192.9 M
    assert [u.name for u in shape.units] == ["embedding", *(f"layer {i}" for i in range(36)), "norm + lm_head"]


def _gb(value: int) -> float:
    return round(value / GB, 2)


def test_qwen3_8b_fsdp_per_rank_terms_are_the_hand_tables(qwen3_8b):
    e = _8b(qwen3_8b, "fsdp", "none")
    assert (_gb(e.parameters), _gb(e.masters), _gb(e.moments), _gb(e.gradients)) == (4.10, 0, 8.19, 4.10)
    assert _gb(e.state) == 16.38  # 16 B/param / 8
    # one decoder layer in flight is 1.54 GB (×2 with prefetch), the [norm, lm_head] unit 4.98
    assert _gb(e.in_flight) == 8.07
    # + one FP32 shard of the lm_head unit's gradient (2.49 GB / 8): the ordered fold's receive buffer
    assert _gb(_8b(qwen3_8b, "fsdp", "none", "deterministic").in_flight) == pytest.approx(8.07 + 0.31, abs=0.01)
    assert e.activations / GB == pytest.approx(31.9, abs=0.1)  # 52.84·h·T per layer, ×36
    assert e.head / GB == pytest.approx(6.2, abs=0.05)  # T·V·(2 + 4 + 4)
    assert e.total / GB == pytest.approx(62.6, abs=0.1)  # the hand table's peak, AC none


def test_qwen3_8b_fits_80_gb_only_sharded_and_checkpointing_brings_it_to_a_third(qwen3_8b):
    blocks = _8b(qwen3_8b, "fsdp", "blocks")
    assert blocks.activations / GB == pytest.approx(2.1, abs=0.15)  # block inputs 1.21 + one block 0.89 (+ the rest)
    assert blocks.total / GB == pytest.approx(32.8, abs=0.15)
    replica = _8b(qwen3_8b, "none", "none")
    assert _gb(replica.state) == pytest.approx(8.191 * 18, abs=0.1)  # bf16 2 + master 4 + moments 8 + FP32 grad 4
    assert replica.total > 80 * GB > _8b(qwen3_8b, "fsdp", "none").total
    assert _8b(qwen3_8b, "none", "blocks").total > 80 * GB  # checkpointing alone does not make a replica fit


def test_sharded_turns_after_the_first_stage_one_fp32_gradient_shard_beside_the_committed():
    shape = toy_shape()
    for reduction in ("fast", "deterministic"):
        one = predict(
            shape, NO_ACTIVATIONS, MemorySettings(sharding="fsdp", world_size=4, dtype="bfloat16", reduction=reduction)
        )
        two = predict(
            shape,
            NO_ACTIVATIONS,
            MemorySettings(sharding="fsdp", world_size=4, dtype="bfloat16", logical_dp=8, reduction=reduction),
        )
        assert one.staged == 0 and two.staged == two.gradients == one.gradients, reduction
        assert two.partials == 0, reduction


def test_hsdp_holds_per_rank_what_fsdp_over_one_node_holds_at_any_number_of_nodes(qwen3_8b):
    shape, fit = qwen3_8b
    for reduction in ("fast", "deterministic"):

        def settings(sharding: str, world_size: int, nodes: int, reduction: str = reduction) -> MemorySettings:
            return MemorySettings(
                sharding=sharding,  # type: ignore[arg-type]  # a Sharding literal
                world_size=world_size,
                dtype="bfloat16",
                logical_dp=world_size,
                reduction=reduction,
                rows_per_logical_rank=1,
                seq_len=4096,
                nodes=nodes,
            )

        one_node = predict(shape, fit, settings("fsdp", 8, 1))
        for nodes in (1, 2, 4):
            hybrid = settings("hsdp", 8 * nodes, nodes)
            assert hybrid.shard_group == 8
            assert predict(shape, fit, hybrid) == one_node, (reduction, nodes)
    # the docs' row (docs/scale.md): Qwen3-8B at 2 nodes x 8 GPUs, bf16, one row of 4,096 tokens, deterministic
    row = predict(
        shape,
        fit,
        MemorySettings(
            sharding="hsdp",
            world_size=16,
            dtype="bfloat16",
            logical_dp=16,
            nodes=2,
            seq_len=4096,
            rows_per_logical_rank=1,
        ),
    )
    assert (_gb(row.state), _gb(row.in_flight), round(row.total / GB, 1)) == (16.38, 8.38, 62.9)

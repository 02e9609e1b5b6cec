"""Shared pieces of the trainer benchmarks: the model, the batches, one training step per side, the report.

The model is a random-initialized Qwen3 (nothing is downloaded) sized so that
a step at 4×1024 tokens is dominated by matmuls rather than Python — about
21M parameters, 3–4 s per step on two CPU cores — while a benchmark's default
run still fits in about three minutes. Every side of a comparison gets its
own deep copy of one model, so all sides start from identical weights and
their losses can be compared step by step.

`--device cuda` runs the same comparison on a GPU: models and batches live
there, and every timed step is bracketed by `torch.cuda.synchronize`, so a
step's time is its kernels' time, not the time to queue them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

LEARNING_RATE = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
GRAD_CLIP = 1.0


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    hidden_size: int = 512
    """Width: 512 keeps every matmul large enough that MKL, not the interpreter, sets the pace."""
    num_layers: int = 4
    intermediate_size: int = 1536
    vocab_size: int = 8192
    """Large enough that the logits and the fused cross-entropy weigh as they do in a real LM head."""
    head_dim: int = 64
    num_kv_groups: int = 2
    """Query heads per key/value head (grouped-query attention, as in Qwen3)."""

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim

    def build(self, seed: int = 0) -> Qwen3ForCausalLM:
        if self.hidden_size % (self.head_dim * self.num_kv_groups):
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of head_dim*num_kv_groups="
                f"{self.head_dim * self.num_kv_groups}; choose another width"
            )
        config = Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads // self.num_kv_groups,
            head_dim=self.head_dim,
            max_position_embeddings=16384,
            tie_word_embeddings=False,
            use_cache=False,
            attention_dropout=0.0,
        )
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).float()
        model.config._attn_implementation = "sdpa"
        return model.train()


def add_model_args(parser: argparse.ArgumentParser) -> None:
    defaults = ModelSpec()
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per side (interleaved)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side before timing")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: tiny model, short sequences, 2 reps")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (models and batches live there)")


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.seq_len, args.reps, args.warmup = min(args.seq_len, 128), min(args.reps, 2), min(args.warmup, 1)
        return ModelSpec(hidden_size=128, num_layers=2, intermediate_size=384, vocab_size=1024)
    return ModelSpec(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
    )


def model_summary(spec: ModelSpec, model: torch.nn.Module) -> dict:
    device = next(model.parameters()).device
    return {
        **asdict(spec),
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_heads // spec.num_kv_groups,
        "num_params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "attention": "sdpa",
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work, so a clock read measures it (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    """[B, T-1] float: 1 where token t+1 is a target (the completion), 0 on the prompt."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def make_batch(step: int, batch_size: int, seq_len: int, vocab_size: int, device: str = "cpu") -> Batch:
    """An SFT-shaped batch: full-length rows, the loss on each row's completion after a random-length prompt."""
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    prompt_len = torch.randint(1, max(2, seq_len // 4), (batch_size, 1), generator=generator)
    loss_mask = (torch.arange(1, seq_len).unsqueeze(0) >= prompt_len).float()
    return Batch(input_ids.to(device), torch.ones_like(input_ids).to(device), loss_mask.to(device))


# -- one optimizer step per side ---------------------------------------------------


class PlainLoop:
    """The baseline: what a user writes without the trainer."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(self, batch: Batch) -> float:
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        vocab = logits.shape[-1]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch.input_ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll.view_as(batch.loss_mask) * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class TrainerLoop:
    """The candidate: the same step through `trainer_core.training.Trainer` in one backward-state mode."""

    def __init__(self, model: torch.nn.Module, mode: str):
        from trainer_core.training import OptimizerConfig, Trainer

        self.mode = mode
        self.trainer = Trainer(model)
        self.trainer.add_base_checkpoint(
            optimizer=OptimizerConfig(
                learning_rate=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=0.0, grad_clip=GRAD_CLIP
            )
        )
        self.offloaded_bytes = 0
        self.resident_after_forward_bytes = 0

    def step(self, batch: Batch) -> float:
        out = self.trainer.forward(batch.input_ids, batch.attention_mask, outputs=("logprobs",), mode=self.mode)
        self.resident_after_forward_bytes = self.trainer.graphs.resident_saved_bytes()
        graph = self.trainer.graphs.get(out.graph_id)
        if graph is not None and hasattr(graph.state, "offloaded_bytes"):
            self.offloaded_bytes = graph.state.offloaded_bytes
        loss = -(out.logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
        self.trainer.backward(loss)
        self.trainer.step()
        return loss.item()


def fresh_copies(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    return [copy.deepcopy(model) for _ in range(count)]


# -- measurement -------------------------------------------------------------------


@dataclass
class Timings:
    """One side's timed steps: wall seconds (the figure) and process CPU seconds.

    CPU seconds are reported because this machine is shared: a neighbour's job
    stretches wall time by whole scheduler slices but barely moves CPU time.
    """

    wall_s: list[float]
    cpu_s: list[float]
    losses: list[float]
    """Every step's loss, warm-up included."""


def interleave(
    sides: dict[str, Callable[[Batch], float]],
    batches: Callable[[int], Batch],
    *,
    warmup: int,
    reps: int,
    label: str = "",
) -> dict[str, Timings]:
    """Run every side once per round, in order, `warmup` untimed rounds then `reps` timed ones.

    Step i of every side sees the same batch after the same history, so losses compare step by step.
    """
    timings = {name: Timings([], [], []) for name in sides}
    for round_index in range(warmup + reps):
        batch = batches(round_index)
        device = batch.input_ids.device
        warm = round_index < warmup
        for name, step in sides.items():
            synchronize(device)
            cpu_started, started = time.process_time(), time.perf_counter()
            loss = step(batch)
            synchronize(device)  # the optimizer's kernels may still be queued after loss.item()
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            timings[name].losses.append(loss)
            if not warm:
                timings[name].wall_s.append(elapsed)
                timings[name].cpu_s.append(cpu)
            tag = "warm-up" if warm else f"rep {round_index - warmup + 1}/{reps}"
            print(
                f"{label}{tag} {name}: {elapsed:.2f} s ({cpu:.2f} s CPU), {batch.num_tokens / elapsed:.0f} tokens/s, "
                f"loss {loss:.6f}",
                flush=True,
            )
    return timings


def side_figures(timings: Timings, num_tokens: int) -> dict:
    step_s = median(timings.wall_s)
    return {
        "tokens_per_s": num_tokens / step_s,
        "step_s_median": step_s,
        "step_s": timings.wall_s,
        "cpu_s_median": median(timings.cpu_s),
        "cpu_s": timings.cpu_s,
        "tokens_per_cpu_s": num_tokens / median(timings.cpu_s),
    }


def paired_ratio(baseline: Timings, candidate: Timings) -> float:
    """Median over rounds of baseline_s / candidate_s: each round's two steps ran back to back."""
    return median([b / c for b, c in zip(baseline.wall_s, candidate.wall_s, strict=True)])


def median(values: list[float]) -> float:
    return statistics.median(values)


def max_abs_delta(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def emit(result: dict) -> None:
    """The last line of a benchmark's standard output: one JSON object."""
    print(json.dumps(result), flush=True)

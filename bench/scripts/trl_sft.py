"""TRL's side of `bench.trl_parity`: SFTTrainer on the tiny job's rows, one torchrun rank (gloo, CPU) each.

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/scripts/trl_sft.py \
        --model DIR --rows ROWS.pt --out FIGURES.json --steps 60 --learning-rate 3e-3 --warmup-steps 5 ...

The rows are the plan's, already tokenized and in the plan's step order (each step's global batch, logical
rank 0's rows first), with the plan's loss mask as TRL's `completion_mask`; a sequential sampler and
accelerate's round-robin of per-device batches give each process, at each step, the rows rankflow's logical
rank of the same index trains. Rank 0 writes the step losses and when training began and ended. Run by its
path from a folder of its own (see `bench.launch`).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--rows", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--per-device-batch", type=int, required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--warmup-steps", type=int, required=True)
    parser.add_argument("--grad-clip", type=float, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--betas", type=float, nargs=2, required=True)
    parser.add_argument("--eps", type=float, required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    rows = torch.load(args.rows, weights_only=True)
    dataset = Dataset.from_dict(rows)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        output_dir=str(args.out) + ".trainer",
        max_steps=args.steps,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        # rankflow: linear warm-up, then constant (trainer_core/schedule.py)
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.grad_clip,
        weight_decay=args.weight_decay,
        adam_beta1=args.betas[0],
        adam_beta2=args.betas[1],
        adam_epsilon=args.eps,
        optim="adamw_torch",
        max_length=args.max_length,
        completion_only_loss=True,
        train_sampling_strategy="sequential",
        seed=args.seed,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    train_started = time.time()
    trainer.train()
    train_ended = time.time()
    trainer.save_model(str(args.out) + ".model")  # rankflow's run ends with a checkpoint too
    saved = time.time()
    if trainer.accelerator.is_main_process:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        figures = {
            "losses": losses,
            "num_processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "train_started": train_started,
            "train_ended": train_ended,
            "saved": saved,
        }
        with open(args.out, "w") as handle:
            json.dump(figures, handle)


if __name__ == "__main__":
    main()

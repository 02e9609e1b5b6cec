"""Regenerate the shipped tiny example in ``examples/tiny/``.

Writes a synthetic chat SFT dataset (``sft.jsonl``), a byte-level BPE tokenizer
trained on its ChatML rendering (``tokenizer.json``), a tiny Qwen3 model
config (``model_config.json``) and RL trajectories over the same tasks
(``rl.jsonl``: groups of sampled answers with 0/1 rewards, synthetic behaviour
logprobs, one tool-using task) and held-out conversations of the same tasks,
none identical to a training one (``eval.jsonl``). Everything is derived from one seed, so running
``python examples/make_tiny_data.py`` twice yields byte-identical files.

The assistant replies are templated answers to small synthetic tasks: most of
each reply is a fixed phrase or a copy of words from the question, which a
two-layer model learns within a few dozen optimizer steps, so a training run on
this data shows a clearly falling loss.

Needs only the standard library and ``tokenizers`` (no network, no transformers).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20240611
NUM_CONVERSATIONS = 1200
SYSTEM_PROMPT_FRACTION = 0.25
MULTI_TURN_FRACTION = 0.20
VOCAB_SIZE = 1024

# Order fixes the ids: <|endoftext|>=0 (pad and eos), <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant.",
    "Answer in one short sentence.",
    "You are a careful tutor.",
)

CAPITALS = (
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Greece", "Athens"),
    ("Poland", "Warsaw"),
    ("Chile", "Santiago"),
    ("India", "New Delhi"),
    ("Brazil", "Brasilia"),
    ("Ireland", "Dublin"),
)

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "table",
    "music",
    "light",
    "tiger",
    "bread",
    "chair",
    "ocean",
    "paper",
    "smile",
    "train",
    "water",
    "house",
    "plant",
    "queen",
    "sugar",
    "night",
    "horse",
    "lemon",
    "glass",
    "honey",
    "storm",
    "cat",
    "dog",
    "sun",
    "moon",
    "star",
    "tree",
    "fish",
    "bird",
    "book",
    "door",
    "road",
    "rain",
    "snow",
    "wind",
    "garden",
    "window",
    "pencil",
    "orange",
    "silver",
    "forest",
    "rocket",
    "button",
    "planet",
    "castle",
    "kitten",
    "yellow",
    "summer",
    "winter",
)

# (from unit, to unit, factor): powers of ten keep the answers learnable.
CONVERSIONS = (
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("centimeters", "millimeters", 10),
)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    a, b = max(a, b), min(a, b)
    return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."


def _reverse_words(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    question = "Reverse this list: " + ", ".join(words) + "."
    return question, "Reversed: " + ", ".join(reversed(words)) + "."


def _capital(rng: random.Random) -> tuple[str, str]:
    country, capital = rng.choice(CAPITALS)
    return f"What is the capital of {country}?", f"The capital of {country} is {capital}."


def _count_letters(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    question = f"How many letters are in the word {word}?"
    return question, f"The word {word} has {len(word)} letters."


def _convert_units(rng: random.Random) -> tuple[str, str]:
    source, target, factor = rng.choice(CONVERSIONS)
    amount = rng.randint(1, 20)
    question = f"Convert {amount} {source} to {target}."
    return question, f"{amount} {source} is {amount * factor} {target}."


def _echo_upper(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(2, 4))
    phrase = " ".join(words)
    return f"Repeat in capital letters: {phrase}", f"{phrase.upper()}"


TASKS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _arithmetic,
    _reverse_words,
    _capital,
    _count_letters,
    _convert_units,
    _echo_upper,
)


def _conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages: list[dict[str, str]] = []
    if rng.random() < SYSTEM_PROMPT_FRACTION:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_exchanges = 2 if rng.random() < MULTI_TURN_FRACTION else 1
    for _ in range(num_exchanges):
        question, answer = rng.choice(TASKS)(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def make_conversations(seed: int = SEED, num_conversations: int = NUM_CONVERSATIONS) -> list[dict]:
    """Return ``num_conversations`` synthetic chat examples drawn from ``seed``."""
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(num_conversations)]


def render_chatml(messages: Iterable[dict[str, str]]) -> str:
    """ChatML as the project renders it: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


RL_SEED = SEED + 1  # a separate stream, so sft.jsonl is unchanged by the RL data
EVAL_SEED = SEED + 2  # held-out conversations (eval.jsonl): the same tasks, a stream of their own
NUM_EVAL_CONVERSATIONS = 100
NUM_RL_GROUPS = 48
RL_GROUP_SIZE = 4
TOOL_GROUP_FRACTION = 0.25


def _rl_messages(rng: random.Random, use_tool: bool) -> tuple[list[dict], Callable[[bool], list[dict]]]:
    """A prompt and a function that samples a (correct or wrong) assistant continuation."""
    if use_tool:
        country, capital = rng.choice(CAPITALS)
        prompt = [{"role": "user", "content": f"Use the tool: what is the capital of {country}?"}]

        def sample(correct: bool) -> list[dict]:
            answer = capital if correct else rng.choice([c for _, c in CAPITALS if c != capital])
            return [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "capital", "arguments": {"country": country}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "name": "capital", "content": capital},
                {"role": "assistant", "content": f"The capital of {country} is {answer}."},
            ]

        return prompt, sample
    task = rng.choice(TASKS)
    question, answer = task(rng)

    def sample(correct: bool) -> list[dict]:
        if correct:
            return [{"role": "assistant", "content": answer}]
        wrong = answer
        while wrong == answer:
            wrong = task(rng)[1]
        return [{"role": "assistant", "content": wrong}]

    return [{"role": "user", "content": question}], sample


def make_trajectories(tokenizer: Tokenizer, seed: int = RL_SEED) -> list[dict]:
    """Groups of trajectories for the same prompt, with 0/1 rewards and behaviour logprobs.

    Each message that carries loss gets one synthetic logprob (and its token id)
    per token of its ChatML loss span: the content, any tool calls, and the
    closing ``<|im_end|>``, tokenized on their own as training cuts them.
    """
    rng = random.Random(seed)
    trajectories = []
    for group in range(NUM_RL_GROUPS):
        prompt, sample = _rl_messages(rng, use_tool=rng.random() < TOOL_GROUP_FRACTION)
        for _member in range(RL_GROUP_SIZE):
            correct = rng.random() < 0.5
            messages = [dict(m) for m in prompt + sample(correct)]
            for message in messages:
                if message["role"] != "assistant":
                    continue
                ids = tokenizer.encode(_chatml_loss_text(message), add_special_tokens=False).ids
                message["logprobs"] = [round(-rng.uniform(0.01, 2.5), 4) for _ in ids]
                message["token_ids"] = ids
            trajectories.append(
                {
                    "messages": messages,
                    "reward": 1.0 if correct else 0.0,
                    "group_id": f"g{group:03d}",
                    "policy_version": group // 12,
                }
            )
    return trajectories


def _chatml_loss_text(message: dict) -> str:
    """What the ChatML loss span of an assistant message holds (see trainer_core/data/render.py)."""
    parts = [message["content"]] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        function = call["function"]
        parts.append(
            f'<tool_call>\n{{"name": {json.dumps(function["name"], ensure_ascii=False)}, '
            f'"arguments": {json.dumps(function["arguments"], ensure_ascii=False)}}}\n</tool_call>'
        )
    return "\n".join(parts) + "<|im_end|>"


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose ``decode(encode(text))`` round-trips any text."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps offsets pointing into the original string;
    # no post-processor, so encode() adds no BOS/EOS and offsets are untrimmed.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet makes every input encodable, not just the
        # characters this corpus happens to contain.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def model_config(vocab_size: int = VOCAB_SIZE) -> dict:
    """A Qwen3ForCausalLM config small enough to train in seconds on 2 CPU cores.

    Plain JSON, so this script does not need transformers; both ``rope_theta``
    (transformers 4.x) and ``rope_parameters`` (5.x), and both ``torch_dtype``
    and ``dtype``, are given so either major version reads it the same way.
    """
    num_hidden_layers = 2
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def write_tiny_example(output_dir: Path, seed: int = SEED) -> None:
    """Write ``sft.jsonl``, ``tokenizer.json``, ``model_config.json``, ``rl.jsonl`` and ``eval.jsonl`` into
    ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    conversations = make_conversations(seed)
    with open(output_dir / "sft.jsonl", "w", encoding="utf-8", newline="\n") as sft_file:
        for conversation in conversations:
            sft_file.write(json.dumps(conversation, ensure_ascii=False) + "\n")

    tokenizer = train_tokenizer([render_chatml(c["messages"]) for c in conversations])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise ValueError(
            f"BPE training reached only {tokenizer.get_vocab_size()} of {VOCAB_SIZE} tokens; "
            "the corpus has too few distinct pairs: add conversations or task variety"
        )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    tokenizer.save(str(output_dir / "tokenizer.json"))

    with open(output_dir / "model_config.json", "w", encoding="utf-8", newline="\n") as config_file:
        json.dump(model_config(VOCAB_SIZE), config_file, indent=2)
        config_file.write("\n")

    with open(output_dir / "rl.jsonl", "w", encoding="utf-8", newline="\n") as rl_file:
        for trajectory in make_trajectories(tokenizer):
            rl_file.write(json.dumps(trajectory, ensure_ascii=False) + "\n")

    with open(output_dir / "eval.jsonl", "w", encoding="utf-8", newline="\n") as eval_file:
        for conversation in held_out_conversations(conversations):
            eval_file.write(json.dumps(conversation, ensure_ascii=False) + "\n")


def held_out_conversations(training: list[dict]) -> list[dict]:
    """``NUM_EVAL_CONVERSATIONS`` conversations of the same tasks, none identical to a training one."""
    seen = {json.dumps(c, sort_keys=True) for c in training}
    rng = random.Random(EVAL_SEED)
    held_out: list[dict] = []
    while len(held_out) < NUM_EVAL_CONVERSATIONS:
        conversation = _conversation(rng)
        if json.dumps(conversation, sort_keys=True) not in seen:
            seen.add(json.dumps(conversation, sort_keys=True))
            held_out.append(conversation)
    return held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(__file__).resolve().parent / "tiny",
        help="folder to write into (default: examples/tiny next to this script)",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="random seed for the dataset")
    arguments = parser.parse_args()
    write_tiny_example(arguments.output_dir, arguments.seed)


if __name__ == "__main__":
    main()

"""`rankflow eval CHECKPOINT --data FILE`: the eval loss of a committed checkpoint, against references.

One tiny run (planned with `data.eval_path = examples/tiny/eval.jsonl`, L = 2 logical ranks) and one tiny LoRA run
are trained, exported and committed by the pipeline's own stage functions in this process (segment, export,
commit: no Prefect, no torchrun). The references:

- a float64 transformers model loaded from the committed files, each conversation alone and unpadded, the mean
  negative log-likelihood of its assistant tokens (tokens and loss mask from the data stages, in memory);
- the eval loss the run recorded after its last step;
- for a LoRA checkpoint, the float64 model of its `merged/` weights (base + adapter, merged by the export).

Bad input exits 2 with one line naming the input and the fix, and leaves nothing behind (the temporary directory
and the working directory are checked empty).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from flows.cli import main
from infra.publication.commit import commit_checkpoint
from infra.publication.local_copy import loader_line
from infra.store import open_store
from tests.cli.watched_run import rankflow_command as _rankflow
from tests.cli.watched_run import toml_text as _toml
from tests.conftest import EXAMPLES, tiny_tree
from tests.plan_helpers import planned_run_dir
from tests.publication_helpers import same_size_other_bytes
from trainer_core.config import config_from_dict
from trainer_core.errors import ConfigError
from trainer_core.run.checkpoint_eval import MAX_SEQ_LEN_CAP, EvalSettings, default_max_seq_len
from trainer_core.run.export_main import export_segment
from trainer_core.run.records import SegmentResult
from trainer_core.run.segment import segment_result_path
from trainer_core.run.segment_main import train_segment

REPO = Path(__file__).resolve().parents[2]
EVAL_FILE = EXAMPLES / "tiny" / "eval.jsonl"
TRAIN = {"steps": 2, "steps_per_segment": 2, "global_batch_size": 4, "logical_dp": 2, "nproc_per_node": 1}
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def train_and_commit(tmp_path: Path, **sections) -> dict:
    """Plan, train (one segment, in this process), export and commit a tiny run; what a test needs of it."""
    tree = tiny_tree(tmp_path, train={**TRAIN, "learning_rate": 1e-2}, **sections)
    config = config_from_dict(tree, config_dir=tmp_path)
    run_dir = planned_run_dir(config)
    train_segment(run_dir, 0)
    staged = tmp_path / "staged"
    export_segment(run_dir, 0, staged)
    outcome = commit_checkpoint(staged, open_store(config.storage), run_dir.name)  # the run dir is named by the id
    return {
        "tree": tree,
        "store": config.storage.url,
        "run_id": run_dir.name,
        "url": outcome.checkpoint_url,
        "result": SegmentResult.read(segment_result_path(run_dir, 0)),
    }


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("eval-run")
    return train_and_commit(tmp_path, data={"eval_path": str(EVAL_FILE)})


@pytest.fixture(scope="module")
def committed_lora(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("eval-lora")
    return train_and_commit(tmp_path, model={"lora": LORA}, export={"merge_lora": True})


def rankflow_eval(capsys, *args: str) -> dict:
    """`rankflow eval ARGS` in this process: exit 0, and standard output is one JSON line."""
    assert main(["eval", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def reference_eval_loss(model_dir: Path, tokenizer_dir: Path, max_seq_len: int = 512, overflow: str = "error"):
    """(mean NLL per assistant token, conversations, loss tokens, tokens): float64, one conversation at a time."""
    from transformers import AutoModelForCausalLM

    from trainer_core.data import DataOptions, load_chat_template, load_tokenizer, prepare, read_records

    options = DataOptions(max_seq_len=max_seq_len, overflow=overflow)  # pyright: ignore[reportArgumentType]
    tokenizer, template = load_tokenizer(tokenizer_dir), load_chat_template(tokenizer_dir)
    prepared = prepare(read_records(str(EVAL_FILE)), tokenizer, template, options)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for document in prepared.documents:
            tokens = torch.from_numpy(document.input_ids)[None]
            logprobs = torch.log_softmax(model(tokens).logits[0, :-1], dim=-1)
            target = logprobs.gather(1, tokens[0, 1:, None])[:, 0]
            chosen = torch.from_numpy(document.loss_mask[1:])
            total -= float(target[chosen].sum())
            count += int(chosen.sum())
    return total / count, len(prepared.documents), count, int(prepared.lengths.sum())


def test_the_eval_loss_is_the_float64_mean_over_assistant_tokens(committed, capsys):
    url = committed["url"]
    summary = rankflow_eval(capsys, url, "--data", str(EVAL_FILE))
    expected, conversations, loss_tokens, tokens = reference_eval_loss(Path(url), Path(url))
    assert summary["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert (summary["conversations"], summary["loss_tokens"], summary["tokens"]) == (conversations, loss_tokens, tokens)
    assert summary["checkpoint"] == url and summary["run_id"] == committed["run_id"]
    assert summary["step"] == 2 and summary["kind"] == "full" and summary["dtype"] == "float32"
    assert summary["max_seq_len"] == 512  # the tiny model's max_position_embeddings
    assert summary["truncated"] == summary["dropped"] == 0 and summary["seconds"] > 0


def test_it_equals_the_eval_loss_the_run_recorded_after_its_last_step(committed, capsys):
    recorded = committed["result"]
    assert recorded.eval_steps == [1]  # the segment's last step
    summary = rankflow_eval(
        capsys, f"{committed['run_id']}@latest", "--store", committed["store"], "--data", str(EVAL_FILE)
    )
    assert summary["checkpoint"] == committed["url"]
    assert summary["eval_loss"] == pytest.approx(recorded.eval_losses[-1], rel=1e-5)


def test_truncation_keeps_the_first_tokens_and_counts_them(committed, capsys):
    url = committed["url"]
    summary = rankflow_eval(capsys, url, "--data", str(EVAL_FILE), "--max-seq-len", "24", "--batch-rows", "3")
    expected, conversations, loss_tokens, tokens = reference_eval_loss(Path(url), Path(url), 24, "truncate")
    assert summary["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert (summary["conversations"], summary["loss_tokens"], summary["tokens"]) == (conversations, loss_tokens, tokens)
    assert summary["truncated"] > 0 and summary["conversations"] + summary["dropped"] == summary["records"] == 100


def test_rows_laid_out_chunk_by_chunk_give_the_loss_of_one_layout(committed, capsys, monkeypatch):
    arguments = [committed["url"], "--data", str(EVAL_FILE), "--batch-rows", "4"]
    whole = rankflow_eval(capsys, *arguments)
    monkeypatch.setattr("trainer_core.run.checkpoint_eval.CHUNK_CONVERSATIONS", 10)  # 100 rows in chunks of 8
    chunked = rankflow_eval(capsys, *arguments)
    assert chunked["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-12)  # the same forwards, summed apart
    assert (chunked["loss_tokens"], chunked["tokens"]) == (whole["loss_tokens"], whole["tokens"])


# A whole `rankflow` program run end to end (its interpreter, imports and exit): the e2e tier, not the unit one.
@pytest.mark.e2e
def test_the_command_prints_one_json_line_and_reads_the_store_from_a_config(committed, tmp_path):
    """As a user runs it: a `rankflow` process, RUN@step-N in the store of a run config, a --work-dir cache."""
    config_file = tmp_path / "run.toml"
    config_file.write_text(_toml(committed["tree"]))
    work = tmp_path / "work"
    reference = f"{committed['run_id']}@step-2"
    command = [*_rankflow(), "eval", reference, "--config", str(config_file), "--data", str(EVAL_FILE)]
    done = subprocess.run([*command, "--work-dir", str(work)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["checkpoint"] == committed["url"]
    in_process = committed["result"].eval_losses[-1]
    assert json.loads(lines[0])["eval_loss"] == pytest.approx(in_process, rel=1e-5)
    cached = work / "cache" / "checkpoints" / committed["run_id"] / "step-00000002"
    assert (cached / "MANIFEST.json").is_file() and (cached / "model.safetensors").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["cache"]  # the data stages' scratch is gone


# A whole `rankflow` program run end to end (its interpreter, imports and exit): the e2e tier, not the unit one.
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("command", "where"),
    [("eval", "/dev/full"), ("eval", "a pipe its reader closed"), ("checkpoints verify", "/dev/full")],
)
def test_a_result_line_standard_output_refuses_is_one_line_and_exit_1(committed, tmp_path, command, where):
    """No traceback, no "Exception ignored" at the interpreter's exit: one line naming what happened (for
    `checkpoints`, not reported as a storage failure)."""
    if command == "eval":
        command = [*_rankflow(), "eval", committed["url"], "--data", str(EVAL_FILE)]
    else:
        command = [*_rankflow(), "checkpoints", "verify", committed["run_id"], "--store", committed["store"]]
    if where == "/dev/full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        code, stderr = done.returncode, done.stderr
    else:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        process.stdout.close()  # the reader is gone before the line comes (`rankflow eval … | head -c0`)
        stderr = process.communicate(timeout=300)[1]
        code = process.returncode
    assert code == 1, stderr
    assert stderr.startswith("rankflow: could not write the result to standard output ("), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


# A whole `rankflow` program run end to end (its interpreter, imports and exit): the e2e tier, not the unit one.
@pytest.mark.e2e
def test_standard_output_closed_is_refused_before_anything_runs(committed, tmp_path):
    work = tmp_path / "work"
    for args in (
        ["eval", committed["url"], "--data", str(EVAL_FILE), "--work-dir", str(work)],
        ["run", str(REPO / "examples" / "tiny_sft.toml"), "--set", f"run.work_dir={work}"],
    ):
        done = subprocess.run(
            ["bash", "-c", 'exec "$@" >&-', "rankflow", *_rankflow(), *args],
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("rankflow: bad input: standard output is closed"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not work.exists(), done.stderr


def test_a_spoiled_cached_copy_is_fetched_again(committed, tmp_path, capsys):
    work = tmp_path / "work"
    first = rankflow_eval(capsys, committed["url"], "--data", str(EVAL_FILE), "--work-dir", str(work))
    weights = work / "cache" / "checkpoints" / committed["run_id"] / "step-00000002" / "model.safetensors"
    good = weights.read_bytes()
    same_size_other_bytes(weights)  # only the hash can tell
    again = rankflow_eval(capsys, committed["url"], "--data", str(EVAL_FILE), "--work-dir", str(work))
    assert weights.read_bytes() == good and again["eval_loss"] == first["eval_loss"]


def test_a_lora_checkpoint_is_its_adapter_over_its_base(committed_lora, capsys):
    url = Path(committed_lora["url"])
    summary = rankflow_eval(capsys, str(url), "--data", str(EVAL_FILE))
    assert summary["kind"] == "lora"
    expected, conversations, _, _ = reference_eval_loss(url / "merged", url)  # base + adapter, merged by the export
    assert summary["eval_loss"] == pytest.approx(expected, rel=1e-5) and summary["conversations"] == conversations
    base_alone, _, _, _ = reference_eval_loss(url / "base", url)
    assert abs(base_alone - expected) > 1e-3  # the adapter changed the loss: a base alone would not pass


def test_an_adapter_names_its_base_by_a_path_on_this_machine_or_is_refused(committed_lora, tmp_path, capsys):
    """A model.path run's adapter names that base directory: used where it exists, refused (exit 2) where not."""
    from trainer_core.data import open_source
    from trainer_core.run.checkpoint_eval import evaluate_checkpoint

    url = Path(committed_lora["url"])
    expected = rankflow_eval(capsys, str(url), "--data", str(EVAL_FILE))["eval_loss"]
    adapter, base = tmp_path / "adapter", tmp_path / "elsewhere" / "base"
    shutil.copytree(url, adapter, ignore=shutil.ignore_patterns("base", "merged"))
    shutil.copytree(url / "base", base)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": str(base)}))
    source = open_source(str(EVAL_FILE))
    found = evaluate_checkpoint(adapter, source, EvalSettings(), scratch=tmp_path / "scratch-1")
    assert found.kind == "lora" and found.eval_loss == pytest.approx(expected, rel=1e-6)
    shutil.rmtree(base)
    with pytest.raises(ConfigError, match=r"a LoRA adapter over the base model '.*base', which is neither in the"):
        evaluate_checkpoint(adapter, source, EvalSettings(), scratch=tmp_path / "scratch-2")
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(ConfigError, match="holds neither config.json .* nor adapter_config.json"):
        evaluate_checkpoint(adapter, source, EvalSettings(), scratch=tmp_path / "scratch-3")


def pulled(capsys, committed: dict, dest: Path) -> Path:
    """`rankflow checkpoints pull` of the run's newest checkpoint into `dest`, as a user runs it."""
    assert main(["checkpoints", "pull", committed["run_id"], "--store", committed["store"], "--dest", str(dest)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"load it from any directory: {loader_line(dest)}", printed  # the shipped loader line
    return dest


def test_a_pulled_copy_is_evaluated_where_it_is_and_checked_against_its_manifest(committed, tmp_path, capsys):
    by_url = rankflow_eval(capsys, committed["url"], "--data", str(EVAL_FILE))
    copy = pulled(capsys, committed, tmp_path / "pulled")
    summary = rankflow_eval(capsys, str(copy), "--data", str(EVAL_FILE))
    assert summary["eval_loss"] == by_url["eval_loss"] and summary["conversations"] == by_url["conversations"]
    named = ("run_id", "step", "manifest_sha256")
    assert [summary[key] for key in named] == [by_url[key] for key in named] and summary["checkpoint"] == str(copy)
    same_size_other_bytes(copy / "model.safetensors")  # changed since the pull: only the hash can tell
    assert main(["eval", str(copy), "--data", str(EVAL_FILE)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert re.match(
        r"rankflow: bad input: checkpoint '.*pulled': model\.safetensors does not match MANIFEST\.json", captured.err
    )
    assert "pull the checkpoint again" in captured.err


def test_a_pulled_copy_holding_a_file_its_manifest_does_not_list_is_refused(committed, tmp_path, capsys):
    """A file the manifest does not list would be loaded unverified (weights its manifest entry was dropped for)."""
    copy = pulled(capsys, committed, tmp_path / "pulled")
    (copy / "extra.safetensors").write_bytes((copy / "model.safetensors").read_bytes())
    assert main(["eval", str(copy), "--data", str(EVAL_FILE)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert "extra.safetensors is not listed in MANIFEST.json" in captured.err, captured.err


def test_a_pulled_lora_copy_finds_its_base_in_it_and_a_model_directory_is_read_as_it_is(
    committed_lora, tmp_path, capsys
):
    by_url = rankflow_eval(capsys, committed_lora["url"], "--data", str(EVAL_FILE))
    copy = pulled(capsys, committed_lora, tmp_path / "elsewhere" / "adapter")
    assert f"AutoModelForCausalLM.from_pretrained({str(copy / 'base')!r}), {str(copy)!r})" in (loader_line(copy) or "")
    summary = rankflow_eval(capsys, str(copy), "--data", str(EVAL_FILE))
    assert summary["kind"] == "lora" and summary["eval_loss"] == by_url["eval_loss"]
    merged = rankflow_eval(capsys, str(copy / "merged"), "--data", str(EVAL_FILE))  # a model directory, no manifest
    assert merged["kind"] == "full" and (merged["run_id"], merged["step"], merged["manifest_sha256"]) == (None,) * 3
    assert merged["eval_loss"] == pytest.approx(by_url["eval_loss"], rel=1e-5)  # base + adapter, merged


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_the_device_option_runs_the_model_there(committed, capsys, device):
    summary = rankflow_eval(capsys, committed["url"], "--data", str(EVAL_FILE), "--device", device)
    assert summary["device"].startswith(device)
    assert summary["eval_loss"] == pytest.approx(committed["result"].eval_losses[-1], rel=1e-4)


@pytest.fixture
def clean_places(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the temporary directory, the working directory): both empty, to be checked empty after the command."""
    temporary, cwd = tmp_path / "tmp", tmp_path / "cwd"
    temporary.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.chdir(cwd)
    return temporary, cwd


def bad_record_file(tmp_path: Path) -> str:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(EVAL_FILE.read_text().splitlines()[0] + '\n{"messages": [{"role": "user"}]}\n')
    return str(bad)


def spoiled_store(tmp_path: Path, committed: dict) -> str:
    """A copy of the store with one byte of the committed weights flipped, under an intact manifest."""
    store = tmp_path / "spoiled-store"
    shutil.copytree(committed["store"], store)
    checkpoint = store / committed["run_id"] / "checkpoints" / "step-00000002"
    same_size_other_bytes(checkpoint / "model.safetensors")
    return str(checkpoint)


BAD_INPUT = {
    "missing data": (
        lambda c, t: [c["url"], "--data", str(t / "missing.jsonl")],
        r"--data='.*missing.jsonl' does not exist; point it at",
    ),
    "bad record": (lambda c, t: [c["url"], "--data", bad_record_file(t)], r"bad.jsonl:2: .*content"),
    "no such step": (
        lambda c, t: [c["url"].replace("step-00000002", "step-00000099"), "--data", str(EVAL_FILE)],
        r"checkpoint step-00000099 of run .* is not committed .*name a committed checkpoint",
    ),
    "no such run": (
        lambda c, t: ["nope-0123456789ab@latest", "--store", c["store"], "--data", str(EVAL_FILE)],
        r"run nope-0123456789ab has no committed checkpoint that verifies",
    ),
    "not a checkpoint": (
        lambda c, t: [str(t / "nowhere"), "--data", str(EVAL_FILE)],
        r"names no committed checkpoint; give a committed checkpoint's URL",
    ),
    "a directory with no model": (  # read in place, as a pulled copy is: it holds neither kind of model
        lambda c, t: [str(EXAMPLES / "tiny"), "--data", str(EVAL_FILE)],
        r"holds neither config\.json \(a full model\) nor adapter_config\.json \(a LoRA adapter\)",
    ),
    "no store for RUN@": (
        lambda c, t: [f"{c['run_id']}@latest", "--data", str(EVAL_FILE)],
        r"give the store, --store URL .* or --config TOML",
    ),
    "a format the records are not in": (
        lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--format", "sharegpt"],
        r"a messages record in a ShareGPT file \(--format='sharegpt'\); give --format auto \(or messages\)",
    ),
    "rl data": (
        lambda c, t: [c["url"], "--data", str(EXAMPLES / "tiny" / "rl.jsonl")],
        r"rl.jsonl: the records are RL trajectories .*drop the RL fields",
    ),
    "over the positions": (
        lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--max-seq-len", "600"],
        r"--max-seq-len 600: more positions than the model's max_position_embeddings=512; give at most 512",
    ),
    "not a device": (
        lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--device", "tpu"],
        r"--device 'tpu' is not a device rankflow eval runs on; give cpu, cuda or cuda:N",
    ),
    "a device this machine lacks": (
        lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--device", "cuda:64"],
        r"--device cuda:64: this machine has \d+ CUDA device\(s\); give cpu, or one it has",
    ),
    "no rows": (lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--batch-rows", "0"], r"--batch-rows 0: .*give 1"),
    "a store that is a link loop": (
        lambda c, t: [f"{c['run_id']}@latest", "--store", link_loop(t), "--data", str(EVAL_FILE)],
        r"--store='.*loop' is a symbolic link that loops .*; give the store's real directory",
    ),
    "a checkpoint URL through a link loop": (
        lambda c, t: [f"{link_loop(t)}/{c['run_id']}/checkpoints/step-2", "--data", str(EVAL_FILE)],
        r"the checkpoint URL's store='.*loop' is a symbolic link that loops",
    ),
    "a work dir that is a link loop": (
        lambda c, t: [c["url"], "--data", str(EVAL_FILE), "--work-dir", link_loop(t) + "/work"],
        r"--work-dir='.*loop/work' is a symbolic link that loops",
    ),
}


def link_loop(tmp_path: Path) -> str:
    """A symbolic link to itself (resolving it raises RuntimeError on Python 3.11, ELOOP on reading)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return str(loop)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(committed, tmp_path, clean_places, capsys, case):
    arguments, message = BAD_INPUT[case]
    args = arguments(committed, tmp_path)
    assert main(["eval", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("rankflow: bad input: ") and "Traceback" not in captured.err
    assert re.search(message, line), line
    temporary, cwd = clean_places
    assert list(temporary.iterdir()) == [] and list(cwd.iterdir()) == []


DAMAGED = {  # the reference to the spoiled checkpoint (its URL) in the spoiled store, and the message
    "by its URL": (lambda url, run_id: url, r"does not verify: .*model.safetensors: .* do not match its manifest"),
    "RUN@latest, its only checkpoint damaged": (
        lambda url, run_id: f"{run_id}@latest",
        r"no committed checkpoint of run .* verifies in .*step-00000002: model.safetensors: ",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_checkpoint_that_does_not_verify_exits_1_as_pull_does_and_writes_nothing(
    committed, tmp_path, clean_places, capsys, case
):
    """The store's content is damaged, not the input: one class with `rankflow checkpoints pull` of the same store."""
    reference, message = DAMAGED[case]
    url = spoiled_store(tmp_path, committed)
    store, checkpoint = str(tmp_path / "spoiled-store"), reference(url, committed["run_id"])
    pulled = main(["checkpoints", "pull", committed["run_id"], "--store", store, "--dest", str(tmp_path / "pulled")])
    assert pulled == 1 and not (tmp_path / "pulled").exists()
    capsys.readouterr()
    assert main(["eval", checkpoint, "--store", store, "--data", str(EVAL_FILE)]) == pulled
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    (line,) = captured.err.splitlines()
    assert line.startswith(f"rankflow: eval {checkpoint}: ") and re.search(message, line), line
    assert "CheckpointNotVerified" not in line  # the message alone, as for bad input (no type name)
    temporary, cwd = clean_places
    assert list(temporary.iterdir()) == [] and list(cwd.iterdir()) == []


# (a flipped byte with the checkpoint cached before is no refusal: the cached copy verifies and is used)
@pytest.mark.parametrize(
    ("case", "cached_before"), [("an empty data file", False), ("an empty data file", True), ("a flipped byte", False)]
)
def test_bad_input_with_a_work_dir_leaves_it_as_it_was(committed, tmp_path, capsys, case, cached_before):
    """Found after the download (an empty file) or by it: this call's copy and directories go, an earlier copy stays."""
    work = tmp_path / "work"
    url = committed["url"]
    if cached_before:
        rankflow_eval(capsys, url, "--data", str(EVAL_FILE), "--work-dir", str(work))
    before = sorted(work.rglob("*")) if work.exists() else None
    data = EVAL_FILE
    if case == "an empty data file":
        data = tmp_path / "empty.jsonl"
        data.write_text("")
    else:
        url = spoiled_store(tmp_path, committed)  # another store: nothing of it is cached
    # a checkpoint that does not verify is the store's fault (exit 1), an empty data file bad input (exit 2)
    assert main(["eval", url, "--data", str(data), "--work-dir", str(work)]) == (2 if data != EVAL_FILE else 1)
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert (sorted(work.rglob("*")) if work.exists() else None) == before


def test_a_store_that_does_not_answer_is_one_line_and_exit_1(committed, clean_places, capsys, monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("http://127.0.0.1:9: connection refused")

    monkeypatch.setattr("infra.publication.parent.fetch_checkpoint", unreachable)
    assert main(["eval", committed["url"], "--data", str(EVAL_FILE)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        f"rankflow: eval {committed['url']}: ConnectionError: http://127.0.0.1:9: connection refused"
    ]
    temporary, cwd = clean_places
    assert list(temporary.iterdir()) == [] and list(cwd.iterdir()) == []


def test_the_default_length_is_the_models_positions_capped():
    assert default_max_seq_len(512) == 512
    assert default_max_seq_len(1000) == 1000 - 1000 % 8  # a row is padded to a multiple of 8
    assert default_max_seq_len(40960) == MAX_SEQ_LEN_CAP
    assert default_max_seq_len(None) == MAX_SEQ_LEN_CAP
    with pytest.raises(ValueError, match="--max-seq-len 4"):
        EvalSettings(max_seq_len=4)

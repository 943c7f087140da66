"""The training corpus: replies are the target's own, shards round-trip and are checked, a stopped run resumes.

A tiny random llama target (float32, character tokenizer) and a few ShareGPT conversations
stand in for SmolLM2 and the shared data; the GPU job's side (`torch_job run --replies
FOLDER`) is in test_train_corpus_torch.py.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import EOS_ID, greedy_reference, save_target, tiny_target

from mlx_dflash.errors import DFlashError
from mlx_dflash.targets.model import TargetModel
from mlx_dflash.train import corpus
from mlx_dflash.train.corpus_decode import Sampling, decode_replies
from mlx_dflash.train.corpus_files import (
    MANIFEST,
    Shard,
    read_corpus,
    read_manifest,
    read_shard,
    token_dtype,
    write_shard,
)

MAX_NEW = 12


def _cut(tokens: list[int]) -> tuple[list[int], int | None]:
    end = next((i for i, t in enumerate(tokens) if t == EOS_ID), None)
    return (tokens, None) if end is None else (tokens[:end], EOS_ID)


def write_chat(path: Path, conversations: int, seed: int = 0) -> Path:
    """ShareGPT records of one to three turns of random lowercase words."""
    rng = np.random.default_rng(seed)

    def words() -> str:
        return "".join(chr(c) for c in rng.integers(97, 123, size=int(rng.integers(2, 12))))

    records = []
    for _ in range(conversations):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            turns += [{"from": "human", "value": words()}, {"from": "gpt", "value": words()}]
        records.append({"conversations": turns})
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    return path


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """(in-memory model, its saved directory, chat data) for the whole module."""
    root = tmp_path_factory.mktemp("corpus")
    model = tiny_target("llama", seed=21)
    return model, save_target(model, "llama", root / "target"), write_chat(root / "chat.jsonl.gz", 14)


def options(tiny_setup, out: Path, **kw) -> corpus.MakeOptions:
    _, target_dir, data = tiny_setup
    base = dict(data=[str(data)], out=str(out), target=str(target_dir), every_turn=True, heldout=3, seed=0,
                max_prompt_tokens=200, shard_prompts=4, batch=3, sampled=1, temperature=1.0, max_new_tokens=MAX_NEW)
    return corpus.MakeOptions(**{**base, **kw})


# ---------------------------------------------------------------- decoding


def test_decoded_greedy_rows_are_the_targets_own_and_samples_are_per_row():
    model = tiny_target("llama", seed=11)
    target = TargetModel(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 128, size=n).tolist() for n in (3, 17, 9, 30, 1)]
    sampling = Sampling(sampled=2, temperature=1.0, seed=5, max_new_tokens=MAX_NEW)
    out = decode_replies(target, prompts, [10, 11, 12, 13, 14], sampling, stop={EOS_ID})
    for prompt, replies in zip(prompts, out, strict=True):
        assert len(replies) == 3
        assert replies[0] == _cut(greedy_reference(model, prompt, MAX_NEW))  # left padding changes nothing
        for reply, stop in replies:
            assert len(reply) + (stop is not None) <= MAX_NEW and EOS_ID not in reply
    # Each sampled row has its own key: other batch-mates, another order, the same replies.
    again = decode_replies(target, [prompts[3], prompts[0]], [13, 10], sampling, stop={EOS_ID})
    assert again == [out[3], out[0]]
    # Another seed draws other samples; the greedy rows stay.
    other = decode_replies(target, prompts, [10, 11, 12, 13, 14], Sampling(2, 1.0, 6, MAX_NEW), stop={EOS_ID})
    assert [r[0] for r in other] == [r[0] for r in out] and [r[1:] for r in other] != [r[1:] for r in out]
    # Near zero temperature a sample is the greedy reply.
    cold = decode_replies(target, prompts, [10, 11, 12, 13, 14], Sampling(1, 1e-4, 5, MAX_NEW), stop={EOS_ID})
    assert all(r[1] == r[0] for r in cold)


def test_sampled_first_tokens_follow_the_tempered_distribution():
    model = tiny_target("llama", seed=11)
    target = TargetModel(model)
    prompt = [7, 40, 41, 90]
    temperature = 2.5  # flat enough that many tokens are drawn
    n = 3000
    out = decode_replies(target, [prompt], [0], Sampling(n, temperature, 1, 1), stop=set())
    drawn = np.bincount([r[0][0] for r in out[0][1:]], minlength=target.vocab_size) / n
    logits = np.array(model(mx.array([prompt]))[0, -1], dtype=np.float64)

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max())
        return e / e.sum()

    p = softmax(logits / temperature)
    # Total variation from softmax(logits / T), against that of exact multinomial draws of the same size.
    rng = np.random.default_rng(0)
    null = np.quantile([0.5 * np.abs(rng.multinomial(n, p) / n - p).sum() for _ in range(400)], 0.999)
    assert 0.5 * np.abs(drawn - p).sum() < null
    # The check has power: the untempered distribution (a forgotten temperature) is far outside.
    assert 0.5 * np.abs(softmax(logits) - p).sum() > 3 * null
    assert out[0][0][0][0] == int(np.argmax(logits))


# ---------------------------------------------------------------- files


def _shard(rng, vocab: int) -> Shard:
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist() for _ in range(5)]
    replies = [rng.integers(0, vocab, size=int(rng.integers(0, 20))).tolist() for _ in range(10)]
    return Shard(prompt_ids=[9, 3, 4, 100, 7], prompts=prompts, reply_prompt=[i // 2 for i in range(10)],
                 reply_sample=[i % 2 for i in range(10)], replies=replies,
                 reply_stop=[None if i % 3 else 2 for i in range(10)])


@pytest.mark.parametrize("vocab", [49152, 70000])
def test_shard_round_trip_compact_and_checked(tmp_path, vocab):
    shard = _shard(np.random.default_rng(1), vocab)
    name, sha, size = write_shard(tmp_path, 3, shard, vocab)
    assert name == "shard-00003.npz" and os.listdir(tmp_path) == [name] and size == (tmp_path / name).stat().st_size
    assert read_shard(tmp_path / name, sha) == shard
    with np.load(tmp_path / name) as z:
        assert z["reply_tokens"].dtype == z["prompt_tokens"].dtype == token_dtype(vocab)
    assert token_dtype(49152) == np.uint16 and token_dtype(70000) == np.int32
    data = bytearray((tmp_path / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(DFlashError, match="sha256"):
        read_shard(tmp_path / name, sha)
    with pytest.raises(DFlashError, match="missing"):
        read_shard(tmp_path / "shard-00004.npz", sha)
    bad = _shard(np.random.default_rng(2), vocab)
    bad.replies[0] = [vocab]
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        write_shard(tmp_path, 5, bad, vocab)
    assert not list(tmp_path.glob("*5*")), "a refused shard leaves nothing behind"


# ---------------------------------------------------------------- make


@pytest.fixture(scope="module")
def full(tiny_setup, tmp_path_factory):
    """A corpus made in one run, to which stopped-and-resumed runs must come out equal."""
    out = tmp_path_factory.mktemp("full") / "corpus"
    lines = []
    manifest = corpus.make(options(tiny_setup, out), command="test", progress=lines.append)
    return out, manifest, lines


def _contents(folder: Path) -> list[Shard]:
    manifest = read_manifest(folder)
    return [read_shard(folder / e["file"], e["sha256"]) for e in manifest["shards"]]


def test_make_writes_the_targets_replies_to_the_prompts_prepare_trains_on(tiny_setup, full, tmp_path):
    from mlx_dflash.train.job_files import read_prompts
    from mlx_dflash.train.torch_job import prepare

    model, target_dir, data = tiny_setup
    out, manifest, lines = full
    shards = _contents(out)
    plan = manifest["plan"]
    assert len(shards) == plan["shards"] == manifest["totals"]["shards"] > 2
    assert lines[0].startswith("plan:") and len(lines) == 2 + plan["shards"] and lines[-1].startswith("stopped: plan")
    assert manifest["sampling"]["sampled"] == 1 and manifest["sampling"]["temperature"] == 1.0
    assert manifest["stop"] == [EOS_ID] and manifest["target"]["dtype"] == "float32"
    assert manifest["totals"]["reply_tokens"] == sum(s.reply_tokens for s in shards)
    # The prompts are exactly the training prompts `torch_job prepare --every-turn` writes, each once.
    prepare(str(target_dir), [str(data)], tmp_path / "job", heldout=3, seed=0, max_prompt_tokens=200,
            every_turn=True, layers=1, target_layers=[1, 2])
    _, train_prompts, eval_prompts = read_prompts(tmp_path / "job")
    made = [p for s in shards for p in s.prompts]
    assert sorted(made) == sorted(train_prompts)
    assert not {tuple(p) for p in made} & {tuple(p) for p in eval_prompts}
    assert sorted(i for s in shards for i in s.prompt_ids) == list(range(len(train_prompts)))
    # A greedy reply and one sampled reply per prompt; the greedy one is the target's own decoding.
    checked = 0
    for s in shards:
        assert s.reply_sample == [0, 1] * len(s.prompts)
        assert s.reply_prompt == [i // 2 for i in range(2 * len(s.prompts))]
        for j in range(0, len(s.replies), 2):
            if checked < 6:
                prompt = s.prompts[s.reply_prompt[j]]
                assert (s.replies[j], s.reply_stop[j]) == _cut(greedy_reference(model, prompt, MAX_NEW))
                checked += 1
    assert checked == 6


def test_a_stopped_run_keeps_its_shards_and_the_next_continues(tiny_setup, full, tmp_path):
    out_full, manifest_full, _ = full
    out = tmp_path / "corpus"

    def stop_in_shard_2(shard: int, done: int) -> None:
        if shard == 2:  # after its first batch: the shard is half made
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        corpus.make(options(tiny_setup, out), command="first", on_batch=stop_in_shard_2)
    manifest = read_manifest(out)
    assert [e["file"] for e in manifest["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == [MANIFEST, "shard-00000.npz",
                                                                          "shard-00001.npz"]
    assert _contents(out) == _contents(out_full)[:2]
    # A kill between a shard's rename and the manifest's, and one during a write, leave these behind:
    (out / "shard-00002.npz").write_bytes(b"not listed")
    (out / "shard-00003.npz.tmp").write_bytes(b"half")
    lines = []
    manifest = corpus.make(options(tiny_setup, out), command="second", progress=lines.append)
    assert "2 made before" in lines[0]
    assert _contents(out) == _contents(out_full)
    assert [r["command"] for r in manifest["runs"]] == ["first", "second"] and manifest["command"] == "first"
    assert "ended" not in manifest["runs"][0] and manifest["runs"][1]["ended"] == "plan complete"
    assert manifest["runs"][1]["shards"] == manifest_full["plan"]["shards"] - 2
    assert not list(out.glob("*.tmp"))
    # Done: another run adds nothing; other settings are refused; so is a damaged shard.
    assert corpus.make(options(tiny_setup, out), command="third")["totals"] == manifest["totals"]
    with pytest.raises(DFlashError, match="sampling"):
        corpus.make(options(tiny_setup, out, temperature=0.7))
    with (out / "shard-00001.npz").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(DFlashError, match="sha256"):
        corpus.make(options(tiny_setup, out))


def test_minutes_and_max_shards_bound_a_run(tiny_setup, tmp_path):
    lines = []
    manifest = corpus.make(options(tiny_setup, tmp_path / "c", minutes=0.0), progress=lines.append)
    assert manifest["shards"] == [] and "would not finish" in lines[-1]
    assert manifest["runs"][0]["ended"].startswith("--minutes")
    manifest = corpus.make(options(tiny_setup, tmp_path / "c", max_shards=1, batch=8))
    assert len(manifest["shards"]) == 1 and manifest["shards"][0]["batch"] == 8


def test_one_writer_at_a_time(tiny_setup, tmp_path):
    import fcntl

    out = tmp_path / "c"
    out.mkdir()
    with (out / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(DFlashError, match="another run"):
            corpus.make(options(tiny_setup, out))


@pytest.mark.slow
def test_a_killed_process_leaves_only_whole_shards(tiny_setup, full, tmp_path):
    """SIGKILL at whatever moment the run is in; every listed shard is whole, and the next run finishes equal."""
    out_full, _, _ = full
    out = tmp_path / "corpus"
    opts = options(tiny_setup, out)
    argv = [sys.executable, "-m", "mlx_dflash.train.corpus", "make", "--data", opts.data[0], "--out", str(out),
            "--target", opts.target, "--every-turn", "--heldout", "3", "--max-prompt-tokens", "200",
            "--shard-prompts", "4", "--batch", "3", "--sampled", "1", "--temperature", "1.0",
            "--max-new-tokens", str(MAX_NEW)]
    env = {**os.environ, "PYTHONPATH": str(Path(corpus.__file__).parents[2])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / MANIFEST).exists() and read_manifest(out)["shards"]:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    manifest = read_manifest(out)
    assert manifest["shards"], proc.stderr.read().decode()
    listed = {e["file"] for e in manifest["shards"]}
    assert proc.returncode == -signal.SIGKILL and len(listed) < manifest["plan"]["shards"], "killed mid-run"
    assert _contents(out) == _contents(out_full)[:len(listed)]
    assert {p.name for p in out.glob("shard-*.npz")} >= listed
    corpus.make(opts, command="resumed")
    assert _contents(out) == _contents(out_full)
    assert read_corpus(out)[1:] == read_corpus(out_full)[1:]

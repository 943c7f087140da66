"""The GPU job trains on a corpus folder made with MLX, regenerating none of its prompts (PyTorch on the CPU)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.tiny import save_target, tiny_target
from test_train_corpus import write_chat

from mlx_dflash.errors import DFlashError
from mlx_dflash.train import corpus
from mlx_dflash.train.corpus_files import _check_corpus, read_corpus, read_manifest, reused_replies

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx_dflash.train import torch_job  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny target, its data, a corpus of every training prompt, and a job prepared with the same split."""
    root = tmp_path_factory.mktemp("corpus_torch")
    target_dir = save_target(tiny_target("llama", seed=31), "llama", root / "target")
    data = write_chat(root / "chat.jsonl.gz", 12, seed=1)
    folder = root / "corpus"
    corpus.make(corpus.MakeOptions(data=[str(data)], out=str(folder), target=str(target_dir), every_turn=True,
                                   heldout=3, seed=0, max_prompt_tokens=200, shard_prompts=5, batch=4, sampled=1,
                                   temperature=0.8, max_new_tokens=16), command="test")
    job = root / "job"
    assert torch_job.main(["prepare", "--target", str(target_dir), "--data", str(data), "--out", str(job),
                           "--layers", "1", "--target-layers", "1,2", "--block-size", "8", "--heldout", "3",
                           "--every-turn", "--max-prompt-tokens", "200"]) == 0
    return target_dir, folder, job


def _run(target_dir, job, out, replies) -> int:
    return torch_job.main(["run", "--job", str(job), "--target", str(target_dir), "--out", str(out), "--device", "cpu",
                           "--no-autocast", "--minutes", "0.15", "--max-new-tokens", "16", "--batch", "4",
                           "--blocks-per-seq", "8", "--export-margin-seconds", "2", "--replies", str(replies)])


def _events(out) -> list[dict]:
    lines = [line.split("] ", 1)[1] for line in (out / "log.txt").read_text().splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_run_trains_on_the_corpus_folder_without_regenerating(made, tmp_path, monkeypatch):
    target_dir, folder, job = made
    asked = []
    real = torch_job.regenerate_replies

    def regenerate(target, prompts, **kwargs):
        asked.append(len(prompts))
        return real(target, prompts, **kwargs)

    monkeypatch.setattr(torch_job, "regenerate_replies", regenerate)
    out = tmp_path / "out"
    assert _run(target_dir, job, out, folder) == 0
    assert asked == [0], "every training prompt of the job has its replies in the corpus"
    manifest, prompts, replies = read_corpus(folder)
    log = (out / "log.txt").read_text()
    assert f"corpus: {folder}, {manifest['totals']['shards']} shards (sha256 checked), {len(replies)} replies" in log
    assert "regenerate: batch" not in log
    events = _events(out)
    data = next(e for e in events if e["event"] == "data")
    assert data["examples"] == sum(len(r) + (s is not None) >= 2 for r, s in replies) > 0
    assert data["reply_tokens"] == manifest["totals"]["reply_tokens"]
    assert events[-1]["event"] == "done" and events[-1]["steps"] > 0
    assert (out / "drafter" / "config.json").exists()
    kept = np.load(out / "replies.npz")
    assert kept["reply_stop"].size == 0, "the corpus is not copied into replies.npz"


def test_a_damaged_corpus_or_another_split_is_refused(made, tmp_path, capsys):
    target_dir, folder, job = made
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    shard = sorted(damaged.glob("shard-*.npz"))[-1]
    data = bytearray(shard.read_bytes())
    data[40] ^= 0x01
    shard.write_bytes(bytes(data))
    assert _run(target_dir, job, tmp_path / "out", damaged) == 2
    assert "sha256 differs" in capsys.readouterr().err
    manifest = read_manifest(folder)
    spec = json.loads((job / "job.json").read_text())
    assert spec["heldout"] == 3 and spec["seed"] == 0
    _check_corpus(manifest, spec, "c")
    for change in ({"heldout": 4}, {"seed": 1}, {"stop": [9]}, {"target_sha256": "0" * 64}):
        if "target_sha256" in change:
            manifest = {**manifest, "target": {**manifest["target"], "sha256": "1" * 64}}
        with pytest.raises(DFlashError):
            _check_corpus(manifest, {**spec, **change}, "c")


def test_replies_to_held_out_prompts_are_left_out(made):
    _, folder, job = made
    spec = json.loads((job / "job.json").read_text())
    _, prompts, replies = read_corpus(folder)
    lines = []
    got_prompts, got_replies, from_corpus = reused_replies(str(folder), spec, [prompts[0]], lines.append)
    assert from_corpus and len(got_prompts) == len(got_replies) == len(prompts) - 2  # its greedy and sampled reply
    assert prompts[0] not in got_prompts and "2 to held-out prompts left out" in lines[0]


@pytest.mark.slow
def test_smoke_runs_again_from_a_corpus_folder(tmp_path):
    assert torch_job.main(["smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    log = (tmp_path / "from_corpus" / "log.txt").read_text()
    assert "corpus: " in log and "regenerate: batch" not in log
    assert _events(tmp_path / "from_corpus")[-1]["event"] == "done"
    assert read_manifest(tmp_path / "corpus")["totals"]["replies"] > 0

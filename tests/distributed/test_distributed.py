"""DFlash over mx.distributed: two ranks on 127.0.0.1 (`mlx.launch -n 2 --backend ring`).

The target is tensor-parallel (mlx-lm's `shard`), the drafter replicated, and rank 0's decisions
are broadcast. Greedy output on two ranks equals the target alone on two ranks and on one;
seeded sampling gives identical tokens on both ranks and the exact target distribution; a rank
that dies ends the other with one error line, well within the timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.distributions import P_HONEST, chi2_pvalue, exact_distributions
from helpers.distributions import SEED as SAMPLING_SEED
from helpers.paths import TESTS
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target

HELPERS = TESTS / "helpers"  # the rank workers mlx.launch runs
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
pytestmark = pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch not installed")


def _free_port_pair() -> int:
    """A base port with the next one free too (the ring backend listens on port + rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def launch(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [LAUNCH, "-n", "2", "--backend", "ring", "-p", str(_free_port_pair()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=str(TESTS))


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict:
    prefix = tmp_path_factory.mktemp("dist") / "out"
    proc = launch([sys.executable, str(HELPERS / "distributed_worker.py"), str(prefix)], timeout=900)
    ranks = [Path(f"{prefix}.rank{r}.json") for r in range(2)]
    assert all(p.is_file() for p in ranks), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads(p.read_text()) for r, p in enumerate(ranks)}


def _one_rank_greedy(name: str, prompt: list[int]) -> list[int]:
    from helpers.distributed_worker import MAX_TOKENS, family_model
    from helpers.tiny import greedy_reference

    return greedy_reference(family_model(name), prompt, MAX_TOKENS)


def _committed(run: dict) -> dict:
    return {key: value for key, value in run.items() if key != "rank"}  # "rank": who drafted there


def test_greedy_on_two_ranks_equals_the_target_alone_on_one(decoded):
    from helpers.distributed_worker import FAMILIES, PROMPTS

    rank0, rank1 = decoded[0], decoded[1]
    assert _committed(rank0) == _committed(rank1)  # every rank committed the same tokens
    cases = [(name, i) for name in FAMILIES for i in range(len(PROMPTS))]
    assert len(cases) >= 20
    accepted = 0
    for name, i in cases:
        run = rank0[f"{name}/{i}"]
        reference = _one_rank_greedy(name, PROMPTS[i])
        assert run["alone"] == reference, (name, i)
        assert run["dflash"] == reference, (name, i)
        assert run["scripted"] == reference, (name, i)
        accepted += run["accepted"]
    assert accepted > 100  # the scripted proposer's blocks were really accepted, across families


def test_ranks_other_than_0_follow_without_drafting_unless_draft_logits_are_a_collective(decoded):
    from helpers.distributed_worker import TOK

    leader, follower = decoded[0]["rank"], decoded[1]["rank"]
    assert set(leader) == set(follower)
    followed = 0
    for run, mine in leader.items():
        theirs = follower[run]
        assert mine["drafter_work"] > 0 and mine["proposer"] in ("DFlashProposer", "DFlash2Proposer"), run
        if theirs["head_sharded"]:  # rank 0's draft logits gather rank 1's slice of the vocabulary
            assert theirs["drafter_work"] > 0 and theirs["proposer"] == mine["proposer"], run
        else:
            expected = "SampledRankFollower" if run.startswith("dflash2/") else "RankFollower"
            assert theirs["drafter_work"] == 0 and theirs["proposer"] == expected, run
            followed += 1
    assert followed >= 20 and any(run["head_sharded"] for run in follower.values())
    # Rank 1 was given another prompt text; both decoded rank 0's.
    assert decoded[1]["text_prompt"] == _one_rank_greedy("qwen3", TOK.encode("hello"))


def test_seeded_sampling_with_a_dflash2_drafter_commits_rank_0s_tokens_on_both_ranks(decoded):
    from helpers.distributed_worker import MAX_TOKENS, PROMPTS

    samples = decoded[0]["dflash2_sampling"]
    assert samples == decoded[1]["dflash2_sampling"]
    assert [len(s) for s in samples] == [MAX_TOKENS] * len(PROMPTS)


def test_seeded_sampling_on_two_ranks_is_identical_and_exact(decoded):
    from helpers.tiny import tiny_target as build

    samples = np.array(decoded[0]["sampling"]["samples"])
    assert decoded[0]["sampling"] == decoded[1]["sampling"]
    assert decoded[0]["sampling"]["accepted"] > 100
    exact = exact_distributions(build("qwen3", seed=SAMPLING_SEED, vocab=16, num_layers=2), 1.0, 0.0)
    for position, key in enumerate(("t0", "t1", "t2")):
        assert chi2_pvalue(samples[:, position], exact[key]) > P_HONEST, key
    assert chi2_pvalue(samples[:, 1] * 16 + samples[:, 2], exact["t1t2"]) > P_HONEST


def _rank_pids(tag: str) -> dict[int, int]:
    """Rank -> pid of the Python processes whose environment carries `tag` (this test's launch)."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
            if env.get(b"DFLASH_TEST_TAG") == tag.encode() and b"MLX_RANK" in env \
                    and b"python" in (proc / "cmdline").read_bytes():
                out[int(env[b"MLX_RANK"])] = int(proc.name)
        except (OSError, ValueError):
            continue
    return out


def test_a_rank_that_dies_ends_the_other_with_one_error_line(tmp_path):
    """`dflash-mlx generate` on two ranks; rank 1 is killed mid-generation (no goodbye)."""
    import mlx.core as mx

    model = tiny_target("qwen3", seed=0)
    weight = model.model.embed_tokens.weight  # tied: a zero end-of-sequence row keeps its logit at 0
    model.model.embed_tokens.weight = mx.where(mx.arange(weight.shape[0])[:, None] == 2, 0.0, weight)
    target = save_target(model, "qwen3", tmp_path / "target")
    command = [LAUNCH, "-n", "2", "--backend", "ring", "-p", str(_free_port_pair()), sys.executable, "-m",
               "mlx_dflash.cli", "generate", "-m", str(target), "--prompt-ids", "5,9,33", "--max-tokens", "3000"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(TESTS),
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "MLX_DFLASH_DIST_TIMEOUT": "60",
                                 "DFLASH_TEST_TAG": str(tmp_path)})
    try:
        assert proc.stdout.read(1), proc.stderr.read()  # rank 0 is streaming text
        pids = _rank_pids(str(tmp_path))
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], 9)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    # The launcher's own warnings share rank 0's stderr and may end without a newline.
    errors = [line[line.index("error: rank 0:"):] for line in err.splitlines() if "error: rank 0:" in line]
    assert len(errors) == 1 and "stopping every rank" in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert time.monotonic() - killed < 120


def test_generate_cli_on_two_ranks(tmp_path):
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), tmp_path / "drafter")
    args = ["generate", "-m", str(target), "-d", str(drafter), "--prompt-ids", "1,5,9,33",
            "--max-tokens", "16", "--block-size", "4", "--json"]
    proc = launch([sys.executable, "-m", "mlx_dflash.cli", *args], timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # rank 0 alone prints
    doc = json.loads(lines[0])
    alone = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", *args], capture_output=True, text=True,
                           timeout=300)
    single = json.loads(alone.stdout.strip().splitlines()[-1])
    assert doc["world_size"] == 2 and single["world_size"] == 1
    assert doc["token_ids"] == single["token_ids"] and doc["comm_ms_per_cycle"] > 0
    assert single["comm_ms_per_cycle"] == 0


def test_unshardable_families_are_refused_and_one_machine_is_untouched():
    """Without mlx.launch there is no world and `agree` is the identity (no collective in the graph)."""
    import mlx.core as mx
    from helpers.families import build

    from mlx_dflash.distributed.world import Distributed, shard_target, world
    from mlx_dflash.errors import DFlashError
    from mlx_dflash.targets.model import TargetModel

    assert world() is None
    x = mx.array([3, 1, 2], dtype=mx.uint32)
    assert TargetModel(build("qwen3")).agree(x) is x
    with pytest.raises(DFlashError, match="no tensor-parallel sharding for gemma3_text"):
        shard_target(build("gemma3_text"), Distributed(mx.distributed.init()))
    # 4 attention heads and 2 key/value heads cannot be split 3 ways (nor SmolLM2's 9 and 3 in two).
    with pytest.raises(DFlashError, match="must both divide by 3"):
        shard_target(build("qwen3"), SimpleNamespace(size=3))


def test_chat_on_two_ranks_reads_rank_0s_input_and_replies_as_one_rank(tmp_path):
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), tmp_path / "drafter")
    args = [sys.executable, "-m", "mlx_dflash.cli", "chat", "-m", str(target), "-d", str(drafter),
            "--max-tokens", "8", "--no-color"]
    script = "hello there\n/exit\n"

    def reply(out: str) -> str:
        flat = " ".join(out.split())
        assert flat.count(">>>") == 2 and " tokens · " in flat, out[-2000:]
        return flat.split(">>>", 1)[1].split(" tokens · ")[0]

    command = [LAUNCH, "-n", "2", "--backend", "ring", "-p", str(_free_port_pair()), *args]
    two = subprocess.run(command, input=script, capture_output=True, text=True, timeout=600, cwd=str(TESTS))
    one = subprocess.run(args, input=script, capture_output=True, text=True, timeout=300, cwd=str(TESTS))
    assert reply(two.stdout) == reply(one.stdout)
    assert " ".join(two.stdout.split()).count("(as given, local)") == 1  # rank 0 alone printed the header


def _variant(source: Path, path: Path, edit) -> Path:
    shutil.copytree(source, path)
    edit(path)
    return path


def _edit_json(name: str, **changes):
    def edit(path: Path) -> None:
        data = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**data, **changes}, indent=2))
    return edit


def test_ranks_with_different_model_configs_stop_at_start_up_with_one_error(tmp_path):
    """`dflash-mlx generate` where rank 1's config.json differs by one field: both ranks end at once."""
    model = tiny_target("qwen3", seed=0)
    save_target(model, "qwen3", tmp_path / "target0")
    _variant(tmp_path / "target0", tmp_path / "target1", _edit_json("config.json", rms_norm_eps=1e-5))
    started = time.monotonic()
    proc = launch([sys.executable, str(HELPERS / "per_rank_cli.py"), "generate", "-m", str(tmp_path / "target{rank}"),
                   "--prompt-ids", "5,9,33", "--max-tokens", "4"], timeout=300,
                  env={"MLX_DFLASH_DIST_TIMEOUT": "600"})
    elapsed = time.monotonic() - started
    difference = "rank 1 differs from rank 0: target config.json rms_norm_eps 1e-05 vs 1e-06"
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2 and all(difference in line for line in errors), proc.stderr[-3000:]
    assert any("error: ranks disagree" in line for line in errors)  # rank 0
    assert any("error: rank 1: ranks disagree" in line for line in errors)
    assert "Traceback" not in proc.stderr and "no progress" not in proc.stderr
    assert not proc.stdout.strip() and elapsed < 200  # well before the 600 s watchdog; nothing generated


def test_ranks_name_differing_versions_weights_tokenizers_and_drafters_before_loading(tmp_path):
    import mlx.core as mx

    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), tmp_path / "drafter")

    def other_header(path: Path) -> None:  # the same tensors, other safetensors metadata
        weights = dict(mx.load(str(path / "model.safetensors")))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"note": "another export"})

    _variant(target, tmp_path / "target_header", other_header)
    _variant(target, tmp_path / "target_tokenizer", _edit_json("tokenizer_config.json", model_max_length=77))
    _variant(drafter, tmp_path / "drafter_config", _edit_json("config.json", block_size=4))
    prefix = tmp_path / "out"
    proc = launch([sys.executable, str(HELPERS / "agreement_worker.py"), str(tmp_path), str(prefix)], timeout=600)
    ranks = [Path(f"{prefix}.rank{r}.json") for r in range(2)]
    assert all(p.is_file() for p in ranks), proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = (json.loads(p.read_text()) for p in ranks)
    from importlib.metadata import version

    expected = {
        "version": f"rank 1 differs from rank 0: mlx 0.0.0-test vs {version('mlx')}",
        "header": "rank 1 differs from rank 0: target model.safetensors size",  # then: header differs
        "tokenizer": "rank 1 differs from rank 0: target tokenizer file tokenizer_config.json content differs",
        "drafter": "rank 1 differs from rank 0: drafter config.json block_size 4 vs 8",
    }
    for name, phrase in expected.items():
        assert rank0[name]["error"] == rank1[name]["error"], name  # one error, raised on every rank
        assert phrase in rank0[name]["error"], (name, rank0[name]["error"])
    assert "target model.safetensors header differs" in rank0["header"]["error"]
    assert rank0["same"]["error"] is None and rank1["same"]["error"] is None  # and then they load

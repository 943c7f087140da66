"""The start-up description ranks compare (`fingerprint`), how differences are named
(`rank_agreement`), and the follower proposer of ranks other than 0 (`rank_follower`).

The collectives themselves run in test_distributed.py, on two ranks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers.tiny import ScriptedProposer, tiny_drafter, tiny_target
from helpers.tiny_dflash2 import tiny_dflash2

from mlx_dflash.decoding.sampling import rejection_verify
from mlx_dflash.distributed import fingerprint
from mlx_dflash.distributed.fingerprint import describe, model_config, safetensors_header_digest, tokenizer_digests
from mlx_dflash.distributed.rank_agreement import differences, summary
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.proposers.rank_follower import RankFollower, SampledRankFollower, rank_follower
from mlx_dflash.targets.model import TargetModel


def _save(path: Path, tensors: dict[str, mx.array], metadata: dict[str, str] | None = None) -> Path:
    mx.save_safetensors(str(path), tensors, metadata=metadata)
    return path


def test_the_header_fingerprint_sees_names_dtypes_and_shapes_but_never_reads_the_data(tmp_path):
    zeros = _save(tmp_path / "zeros.safetensors", {"a": mx.zeros((4, 4)), "b": mx.zeros((3,))})
    ones = _save(tmp_path / "ones.safetensors", {"a": mx.ones((4, 4)), "b": mx.ones((3,))})
    wider = _save(tmp_path / "wider.safetensors", {"a": mx.zeros((4, 5)), "b": mx.zeros((3,))})
    half = _save(tmp_path / "half.safetensors", {"a": mx.zeros((4, 4), dtype=mx.float16), "b": mx.zeros((3,))})
    renamed = _save(tmp_path / "renamed.safetensors", {"c": mx.zeros((4, 4)), "b": mx.zeros((3,))})
    digest = safetensors_header_digest(zeros)
    # Documented limit: equal names, dtypes and shapes with other values fingerprint the same.
    assert safetensors_header_digest(ones) == digest
    assert len({digest, *(safetensors_header_digest(p) for p in (wider, half, renamed))}) == 4
    # The data is never read: a file cut right after its header fingerprints as before.
    (length,) = struct.unpack("<Q", zeros.read_bytes()[:8])
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(zeros.read_bytes()[: 8 + length])
    assert safetensors_header_digest(cut) == digest


def test_the_header_fingerprint_ignores_key_order_and_padding_and_describes_bad_files(tmp_path):
    def raw(header: str) -> bytes:
        data = header.encode()
        return struct.pack("<Q", len(data)) + data + b"\0" * 16

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(raw('{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"f":"1"}}'))
    b.write_bytes(raw('{"__metadata__": {"f": "1"}, "x": {"shape": [2], "data_offsets": [0, 8], "dtype": "F32"}}   '))
    assert safetensors_header_digest(a) == safetensors_header_digest(b)
    short, huge, garbled = (tmp_path / f"{n}.safetensors" for n in ("short", "huge", "garbled"))
    short.write_bytes(b"\1\2")
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    garbled.write_bytes(raw("{not json"))
    for path in (short, huge, garbled):
        assert safetensors_header_digest(path).startswith("unreadable: "), path


def test_a_model_description_hashes_tokenizer_files_and_drops_the_conversion_provenance(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "mlx_dflash": {"source": "/Users/a/m"}}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "README.md").write_text("not a tokenizer file")
    _save(tmp_path / "model.safetensors", {"w": mx.zeros((2, 2))})
    assert model_config(tmp_path) == {"hidden_size": 8}
    digests = tokenizer_digests(tmp_path)
    assert sorted(digests) == ["tokenizer.json", "tokenizer_config.json"]
    (tmp_path / "tokenizer.json").write_text('{"v": 1}')
    assert tokenizer_digests(tmp_path)["tokenizer.json"] != digests["tokenizer.json"]
    description = describe(tmp_path)
    assert description["drafter"] is None and set(description["versions"]) == {"mlx", "mlx-lm", "mlx-dflash"}
    size = (tmp_path / "model.safetensors").stat().st_size
    assert list(description["target"]["weights"]) == ["model.safetensors"]
    assert description["target"]["weights"]["model.safetensors"]["size"] == size
    assert describe(tmp_path / "nowhere")["target"]["config"] == "no such directory"
    assert model_config(tmp_path / "nowhere") == "missing"


def _description(**changes) -> dict:
    model = {"config": {"hidden_size": 64, "rope_scaling": {"factor": 2.0}},
             "tokenizer": {"tokenizer.json": "t1"},
             "weights": {"model.safetensors": {"size": 100, "header": "h1"}}}
    out = {"versions": {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-dflash": "0.1.0"},
           "target": json.loads(json.dumps(model)), "drafter": None}
    for path, value in changes.items():
        *parents, leaf = path.split("/")
        node = out
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return out


@pytest.mark.parametrize("changes, phrase", [
    ({"versions/mlx": "0.31.2"}, "mlx 0.31.2 vs 0.32.4"),
    ({"target/config/hidden_size": 128}, "target config.json hidden_size 128 vs 64"),
    ({"target/config/rope_scaling/factor": None}, "target config.json rope_scaling.factor absent vs 2.0"),
    ({"target/config": "missing"}, "target config.json missing vs present"),
    ({"target/tokenizer/tokenizer.json": "t2"}, "target tokenizer file tokenizer.json content differs"),
    ({"target/weights/model.safetensors": {"size": 100, "header": "h2"}}, "target model.safetensors header differs"),
    ({"target/weights/model.safetensors": {"size": 90, "header": "h1"}}, "target model.safetensors size 90 vs 100"),
    ({"target/weights/extra.safetensors": {"size": 1, "header": "h"}}, "target extra.safetensors present vs absent"),
    ({"drafter": {"config": {}, "tokenizer": {}, "weights": {}}}, "drafter given vs none"),
])
def test_differences_are_named_mine_versus_rank_0s(changes, phrase):
    assert differences(_description(**changes), _description()) == [phrase]
    assert differences(_description(), _description()) == []


def test_a_long_list_of_differences_is_cut_and_counted():
    assert summary([f"x{i}" for i in range(9)]) == "x0; x1; x2; x3; x4; x5; and 3 more"


# -- the follower ---------------------------------------------------------------------------------

def test_a_follower_proposes_placeholders_of_the_drafters_shape_and_keeps_nothing():
    model = tiny_target("qwen3", seed=0)
    target = TargetModel(model)
    drafter = tiny_drafter(model)
    follower = rank_follower(drafter, max_block_size=8)
    assert type(follower) is RankFollower and follower.target_layer_ids == list(drafter.target_layer_ids)
    draft = follower.propose(mx.array([5], dtype=mx.uint32), 3, 6)
    assert draft.shape == (5,) and draft.dtype == mx.uint32
    follower.commit(mx.zeros((1, 4, 2 * target.hidden_size)), 0)
    assert follower.state_arrays() == []
    built = DFlashProposer(drafter, target, max_block_size=4, window=16)
    assert rank_follower(built, max_block_size=99)._positions.window == 16  # the built proposer's limits


def test_a_dflash2_follower_states_a_valid_proposal_for_rejection_sampling():
    model = tiny_target("qwen3", seed=0)
    drafter, _ = tiny_dflash2(model)
    follower = rank_follower(drafter, max_block_size=8)
    assert isinstance(follower, SampledRankFollower)
    draft, proposal = follower.propose_sampled(mx.array([5], dtype=mx.uint32), 3, 6, 1.0)
    assert mx.allclose(proposal.q.sum(axis=-1), mx.ones(5)).item()
    p = mx.softmax(mx.random.normal((6, TargetModel(model).vocab_size)), axis=-1)
    tokens, accepted = rejection_verify(draft, proposal, p)
    assert tokens.shape == (6,) and accepted.shape == () and 0 <= accepted.item() <= 5


def test_a_follower_refuses_a_trim_exactly_when_the_drafters_windowed_cache_does():
    model = tiny_target("qwen3", seed=0)
    target = TargetModel(model)
    drafter = tiny_drafter(model)
    proposer = DFlashProposer(drafter, target, max_block_size=4, window=6)
    follower = rank_follower(drafter, max_block_size=4, window=6)
    width = len(drafter.target_layer_ids) * target.hidden_size
    position = 0
    for n in (3, 1, 4, 2, 7, 1, 1, 5, 2):
        features = mx.random.normal((1, n, width))
        proposer.commit(features, position)
        follower.commit(features, position)
        position += n
        for drop in range(0, 12):
            outcomes = []
            for cache in (proposer.cache, follower._positions):
                saved = (cache.stored, cache.dropped)
                try:
                    cache.trim(drop)
                    outcomes.append("trimmed")
                except ValueError:
                    outcomes.append("refused")
                cache.stored, cache.dropped = saved
            assert outcomes[0] == outcomes[1], (n, drop)
        assert (proposer.cache.stored, proposer.cache.dropped) == (follower._positions.stored,
                                                                   follower._positions.dropped)


def test_make_proposer_puts_a_follower_on_ranks_other_than_0_unless_drafting_is_a_collective(monkeypatch):
    model = tiny_target("qwen3", seed=0)
    target = TargetModel(model)
    drafter = tiny_drafter(model)
    assert isinstance(make_proposer(target, drafter, 4), DFlashProposer)  # one machine
    target.world = SimpleNamespace(is_main=False)
    assert isinstance(make_proposer(target, drafter, 4), RankFollower)
    assert isinstance(make_proposer(target, DFlashProposer(drafter, target, max_block_size=4), 4), RankFollower)
    custom = ScriptedProposer([1, 2, 3], target.vocab_size)
    assert make_proposer(target, custom, 4) is custom  # the caller's own proposer runs on every rank
    assert make_proposer(target, None, 4) is None
    monkeypatch.setattr(TargetModel, "head_is_sharded", property(lambda self: True))
    assert isinstance(make_proposer(target, drafter, 4), DFlashProposer)  # draft logits gather every rank's
    target.world = SimpleNamespace(is_main=True)
    assert isinstance(make_proposer(target, drafter, 4), DFlashProposer)


def test_versions_come_from_package_metadata(monkeypatch):
    def version(name: str) -> str:
        if name != "mlx":
            raise fingerprint.metadata.PackageNotFoundError(name)
        return "9.9"

    monkeypatch.setattr(fingerprint.metadata, "version", version)
    versions = fingerprint.installed_versions()
    assert versions["mlx"] == "9.9" and versions["mlx-lm"] == "not installed"
    assert versions["mlx-dflash"] != "not installed"  # a source tree still knows its own version

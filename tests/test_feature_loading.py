"""The feature loader (``specjax.boost.feature_loading``) equals the route it replaced, which loaded
each part into lists, concatenated them, split the set and concatenated the splits: the same
tokens, features, fused-layer inputs, greedy targets, offsets, prompt lengths and parts, for final
and fused feature files, with and without ``max_len``; its arrays own their memory (no view keeps a
whole feature file alive) and bad files are refused by name."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from specjax.boost.corpus import generate_corpus, read_shard
from specjax.boost.feature_data import FeatureSet, feature_shards, split_held_out
from specjax.boost.feature_loading import load_feature_set, load_split
from specjax.errors import InputError
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def parts(llama, tmp_path_factory):
    """Three parts (greedy, sampled, another greedy one) with final-only and fused (layer 1) features."""
    root = tmp_path_factory.mktemp("loading")
    rng = np.random.RandomState(3)
    made = {}
    for name, temperatures, count in (("a", (0.0,), 7), ("b", (1.0,), 5), ("c", (0.0,), 6)):
        prompts = [random_ids(rng, llama.config.vocab_size, int(rng.randint(3, 9))) for _ in range(count)]
        shards = generate_corpus(llama, prompts, str(root / name), max_new_tokens=5, batch_size=3,
                                 temperatures=temperatures, chat_template=False, progress=False)
        made[name] = (shards, feature_shards(llama, shards, str(root / "features" / name), progress=False),
                      feature_shards(llama, shards, str(root / "features-l1" / name), progress=False, layers=(1,)))
    assert all(len(v[0]) > 1 for v in made.values())  # several shards a part
    return made


def _old_load(parts: dict, max_len=None) -> FeatureSet:
    """The replaced route: every shard's rows appended to lists, then concatenated."""
    tokens, feats, inputs, greedy, lens, offs, part_ids = [], [], [], [], [], [0], []
    for pi, (shards, features) in enumerate(parts.values()):
        for shard, fpath in zip(shards, features):
            with np.load(shard) as z:
                is_greedy = float(z["temperature"]) == 0.0
            with np.load(fpath) as z:
                f, o = z["features"], z["offsets"]
            for i, (ids, prompt_len) in enumerate(read_shard(shard)):
                cut = 0 if max_len is None else max(0, len(ids) - max_len)
                ids = np.asarray(ids, np.int32)
                nxt = np.full(len(ids), -1, np.int32)
                if is_greedy:
                    nxt[prompt_len - 1:-1] = ids[prompt_len:]
                tokens.append(ids[cut:])
                rows = f[o[i] + cut:o[i + 1]]
                feats.append(rows if rows.ndim == 2 else rows[:, -1])
                if rows.ndim == 3:
                    inputs.append(rows[:, :-1])
                greedy.append(nxt[cut:])
                lens.append(prompt_len - cut)
                offs.append(offs[-1] + len(ids) - cut)
                part_ids.append(pi)
    return FeatureSet(np.concatenate(tokens), np.concatenate(feats), np.concatenate(greedy), np.asarray(offs, np.int64),
                      np.asarray(lens, np.int32), np.asarray(part_ids, np.int32), tuple(parts),
                      np.concatenate(inputs) if inputs else None)


def _old_concat(a: FeatureSet, b: FeatureSet) -> FeatureSet:
    return FeatureSet(np.concatenate([a.tokens, b.tokens]), np.concatenate([a.features, b.features]),
                      np.concatenate([a.greedy, b.greedy]), np.concatenate([a.offsets, a.offsets[-1] + b.offsets[1:]]),
                      np.concatenate([a.prompt_lens, b.prompt_lens]),
                      np.concatenate([a.parts, b.parts + len(a.part_names)]),
                      a.part_names + b.part_names, None if a.inputs is None else np.concatenate([a.inputs, b.inputs]))


def _assert_same(got: FeatureSet, want: FeatureSet):
    for field in dataclasses.fields(FeatureSet):
        g, w = getattr(got, field.name), getattr(want, field.name)
        if field.name == "part_names":
            assert g == w
        elif w is None:
            assert g is None, field.name
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, field.name
            np.testing.assert_array_equal(g, w, err_msg=field.name)
    for array in (got.features, got.inputs):
        assert array is None or array.base is None  # its own memory, not a view of a loaded file


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("max_len", [None, 9])
def test_load_and_split_equal_the_replaced_route(parts, fused, max_len):
    use = {name: (shards, fused_files if fused else final) for name, (shards, final, fused_files) in parts.items()}
    whole = load_feature_set(use, max_len=max_len)
    _assert_same(whole, _old_load(use, max_len))
    assert (whole.inputs is not None) == fused
    groups = [{"a": use["a"], "b": use["b"]}, {"c": use["c"]}]
    train, held, counts = load_split(groups, 0.3, seed=2, max_len=max_len)
    old = [split_held_out(_old_load(g, max_len), 0.3, seed=2) for g in groups]
    _assert_same(train, _old_concat(old[0][0], old[1][0]))
    _assert_same(held, _old_concat(old[0][1], old[1][1]))
    assert counts == [(len(t), len(h)) for t, h in old]


def test_bad_feature_files_are_refused_by_name(parts, tmp_path):
    shards, final, fused = parts["a"]
    with pytest.raises(InputError, match="2 corpus shards but 1 feature files"):
        load_feature_set({"a": (shards[:2], final[:1])})
    with pytest.raises(InputError, match="some hold fused-layer inputs, some do not"):
        load_feature_set({"a": (shards, final[:1] + fused[1:])})
    assert len(read_shard(shards[0])) != len(read_shard(shards[-1]))
    with pytest.raises(InputError, match=f"{final[-1]}: 1 sequences, its shard {shards[0]} has 3"):
        load_feature_set({"a": (shards[:1], final[-1:])})
    with pytest.raises(InputError, match=f"{final[1]}: its sequence lengths differ from those of its shard"):
        load_feature_set({"a": (shards[:1], final[1:2])})
    junk = tmp_path / "junk.npz"
    np.savez(junk, offsets=np.zeros(1, np.int64))
    with pytest.raises(InputError, match=f"{junk}: not a feature file with a 'features' array"):
        load_feature_set({"a": (shards[:1], [str(junk)])})
    with pytest.raises(InputError, match="exceeds max_len"):
        load_feature_set({"a": (shards, final)}, max_len=4)


def test_damaged_corpus_shards_are_named_and_damaged_feature_files_recomputed(llama, parts, tmp_path):
    """A truncated .npz (an interrupted copy or unpacking) was a raw BadZipFile naming no file: a corpus shard
    is refused by name; a feature file, only a cache, is computed again."""
    import shutil

    shards, features, _ = parts["a"]
    copied = [shutil.copy(s, tmp_path / os.path.basename(s)) for s in shards]
    data = open(copied[0], "rb").read()
    with open(copied[0], "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(InputError, match=f"{copied[0]}: unreadable corpus shard .*remove it"):
        read_shard(copied[0])
    out = tmp_path / "features"
    out.mkdir()
    fresh = [shutil.copy(p, out / os.path.basename(p)) for p in features]
    data = open(fresh[1], "rb").read()
    with open(fresh[1], "wb") as f:
        f.write(data[:len(data) // 3])
    logged = []
    again = feature_shards(llama, shards, str(out), progress=False, log=logged.append)
    assert any(f"{fresh[1]}: unreadable" in line for line in logged), logged
    for a, b in zip(again, features):
        with np.load(a) as x, np.load(b) as y:
            np.testing.assert_array_equal(x["features"], y["features"])

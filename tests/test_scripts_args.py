"""The benchmark scripts refuse a bad flag while parsing, naming the flag, before any model loads: a count of 0,
a negative index, an unknown name in a list, a malformed list, a missing file. Each case runs the script as
``python scripts/X.py ...`` and expects argparse's exit status 2 (or a ``sys.exit`` message) within seconds;
a script that accepted the value would go on to load a model and run past the timeout."""

import argparse
import os
import subprocess
import sys

import pytest

from tests.conftest import load_script

SCRIPTS = os.path.join(os.path.dirname(__file__), os.pardir, "scripts")
TIMEOUT = 60  # seconds: parsing takes one or two (the scripts that import specjax first); real work takes minutes


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, f"{script}.py"), *args], capture_output=True,
                          text=True, timeout=TIMEOUT)


# (script, arguments, text the error must hold): every flag named in its error
REFUSED = [
    # unknown --parts
    ("eval_ssm", ["--ssm", "smollm2-ssm-a", "--parts", "tables,tabels"], "--parts"),
    ("eval_feature", ["--parts", "kinds,nope"], "--parts"),
    # counts, strides and indices below their range
    ("eval_ssm", ["--ssm", "smollm2-ssm-a", "--stride", "0"], "--stride"),
    ("bench_incremental", ["--stride", "0"], "--stride"),
    ("bench_incremental", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_greedy_head", ["--num-prompts", "-1"], "--num-prompts"),
    ("bench_speculative", ["--num-dev-prompts", "0"], "--num-dev-prompts"),
    ("compare_defaults", ["--which", "-1"], "--which"),
    ("bench_streaming", ["--which", "-2"], "--which"),
    # lists, checked while parsing
    ("bench_lookup", ["--batch-sizes", "1,two"], "--batch-sizes"),
    ("bench_lookup", ["--batch-sizes", "1,0"], "--batch-sizes"),
    ("offline_acceptance", ["--corpus", "x", "--settings", "8x2,8y2"], "--settings"),
    ("offline_acceptance", ["--corpus", "x", "--agreement", "0.9,1.5"], "--agreement"),
    ("offline_acceptance", ["--corpus", "x", "--costs", "0.1,0.2"], "--costs"),
    ("bench_engine", ["--tree-nodes", "1,16,x"], "--tree-nodes"),
    ("bench_layer_layout", ["--num-prompts", "0"], "--num-prompts"),
    ("bench_layer_layout", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    ("eval_ssm", ["--ssm", "smollm2-ssm-a", "--batches", "1,2,,4"], "--batches"),
    ("eval_feature", ["--batch-sizes", "1,0"], "--batch-sizes"),
    ("eval_feature", ["--budget-nodes", "2,four"], "--budget-nodes"),
    ("bench_speculative", ["--expansions", "1,1,1;1,0"], "--expansions"),
    # a missing end-to-end prompts file
    ("bench_engine", ["--e2e", "/nonexistent/prompts.jsonl"], "--e2e"),
    # prompt files checked before the model loads
    ("bench_corpus", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    ("bench_greedy_head", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    ("bench_mesh", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    ("eval_feature", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    ("offline_acceptance", ["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
    # no repetitions
    ("compare_defaults", ["--repetitions", "0"], "--repetitions"),
    ("bench_streaming", ["--repetitions", "0"], "--repetitions"),
    # unknown names
    ("bench_lookup", ["--skip", "batch1,bach"], "--skip"),
    ("bench_serve", ["--settings", "speculation,foo"], "--settings"),
]


@pytest.mark.parametrize("script,args,flag", REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSED])
def test_a_bad_flag_is_refused_while_parsing_naming_the_flag(script, args, flag):
    done = _run(script, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"argument {flag}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_offline_acceptance_refuses_a_missing_corpus_or_a_part_without_shards(tmp_path):
    mod = load_script("offline_acceptance")
    with pytest.raises(SystemExit, match="--corpus: no such directory"):
        mod._corpus_shards(str(tmp_path / "nonexistent"), ["passages"])
    (tmp_path / "passages").mkdir()
    with pytest.raises(SystemExit, match="--parts: 'tasks-greedy' is not a folder"):
        mod._corpus_shards(str(tmp_path), ["tasks-greedy"])
    with pytest.raises(SystemExit, match="holds no shard"):  # until now: max() of an empty sequence, much later
        mod._corpus_shards(str(tmp_path), ["passages"])
    (tmp_path / "passages" / "shard-00000.npz").write_bytes(b"")
    assert mod._corpus_shards(str(tmp_path), ["passages"]) == {
        "passages": [str(tmp_path / "passages" / "shard-00000.npz")]}
    with pytest.raises(argparse.ArgumentTypeError, match="not DEPTHxBRANCHES"):
        mod._parse_settings("8x2,8")
    assert mod._parse_settings("8x1,16x2") == [(8, 1), (16, 2)]


def test_offline_acceptance_costs_help_names_the_lookup_ladder():
    from specjax.speculation.drafters.lookup import LookupDrafter

    ladder = ", ".join(map(str, LookupDrafter().budget_ladder()))
    done = _run("offline_acceptance", "--help")
    assert done.returncode == 0, done.stderr
    assert f"({ladder} nodes below the root)" in " ".join(done.stdout.split())


def test_eval_ssm_writes_under_bench_out_and_its_example_names_registered_ssms():
    from specjax.io.registry import registered_names

    done = _run("eval_ssm", "--help")
    assert done.returncode == 0, done.stderr
    assert "(default: bench_out/ssm_eval)" in " ".join(done.stdout.split())  # not the committed docs/ssm_eval.json
    example = [line for line in done.stdout.splitlines() if line.strip().startswith("python scripts/eval_ssm.py")]
    ssms = example[0].split("--ssm ")[1:]
    assert ssms and all(s.split()[0] in registered_names() for s in ssms), example


def test_shared_argument_types():
    common = load_script("_bench_common")
    assert common.positive_int("3") == 3 and common.nonnegative_int("0") == 0
    for bad in ("0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.positive_int(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        common.nonnegative_int("-1")
    assert common.int_list()("1, 2,4") == [1, 2, 4]
    for bad in ("1,,2", "1,0", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.int_list()(bad)
    assert common.name_list(("a", "b"))("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown \['c'\]"):
        common.name_list(("a", "b"))("a,c")
    with pytest.raises(argparse.ArgumentTypeError, match="empty"):
        common.name_list(("a", "b"))("")


def test_load_prompts_and_one_per_kind_refuse_counts_out_of_range():
    """load_prompts(n=0) returned every record and n=-1 all but the last; one_per_kind(-1) picked from the end."""
    common = load_script("_bench_common")
    for n, stride in ((0, 1), (-1, 1), (None, 0), (2, -1)):
        with pytest.raises(ValueError, match="n must be None or >= 1 and stride >= 1"):
            common.load_prompts(common.TASK_KINDS, n, stride)
    assert len(common.load_prompts(common.TASK_KINDS, 2, 3)) == 2
    with pytest.raises(ValueError, match="which must be >= 0"):
        common.one_per_kind(common.TASK_KINDS, -1)

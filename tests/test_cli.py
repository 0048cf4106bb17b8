"""The ``specjax`` command as a user meets it: streaming text, one stats line per prompt, --json
records per prompt, clean stdout, complete --help, and every refusal a clear error with status 2."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest

import specjax
from specjax.boost.feature_corpus import WRITTEN_ROUNDS
from specjax.cli import build_parser, main
from specjax.errors import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "specjax", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=dict(os.environ, **(env or {})))


def cli_here(capsys, *args) -> tuple[int, str]:
    """(status, stderr) of ``specjax ARGS`` run in this process (``specjax.cli.main``, what the command calls):
    for requests refused before any work, which a subprocess ran the same way after 3-6 s of start-up each.
    The suite's process already simulates the 8 CPU devices the mesh flags need. Loading a model fails the
    test at once (a refusal that regressed would otherwise go on to generate, or serve forever)."""
    import specjax
    from specjax.cli import main

    def loaded(*a, **kw):
        raise AssertionError(f"specjax {' '.join(args)}: not refused before loading the model")

    capsys.readouterr()
    real = specjax.load_model
    specjax.load_model = loaded
    try:
        code = main(list(args))
    finally:
        specjax.load_model = real
    return code, capsys.readouterr().err


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, action.choices


def test_help_of_every_subcommand_shows_every_option_with_help_and_default():
    parser, subs = _subparsers()
    assert set(subs) == {"generate", "serve", "launch", "convert", "boost-tune", "feature-tune", "tree-cost"}
    assert "`" not in parser.description  # plain text
    for name, sub in subs.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
            if action.option_strings:
                shown = sub._get_formatter()._get_help_string(action)
                assert "(default" in shown or action.required, \
                    f"{name} {action.option_strings}: no default shown ({shown!r})"
        assert "incremental decoding)" not in text
    assert "speculat" in subs["generate"].description


def test_help_goes_to_stdout(capfd):
    assert main(["generate", "--help"]) == 0
    out, err = capfd.readouterr()
    assert "--max-new-tokens" in out and "(default: 128)" in out and not err


def test_tiny_model_generate_streams_and_prints_one_stats_line(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n{"prompt": [4, 5]}\n')
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "6",
            "--ssm", "derived:1", "--expansion", "1,2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("### prompt") == 2  # no tokenizer: token ids, one block per prompt
    stats = [line for line in r.stderr.splitlines() if line.startswith("# ")]
    assert len(stats) == 2, r.stderr
    for line in stats:
        assert re.search(r"# 6 tokens in [\d.]+ s \(first token after [\d.]+ s\) = [\d.]+ tokens/s \| "
                         r"load [\d.]+ s, compile [\d.]+ s \| \d+ LLM "
                         r"passes, [\d.]+ tokens per pass \| tree, derived:1: ssm\(<1,2>, topk\)", line), line


def test_drafter_flag_builds_registered_drafters(tiny_llama_dir, tmp_path):
    """--drafter NAME:ARG goes through the drafters' FACTORIES: ssm:derived:1 drafts exactly what --ssm
    derived:1 drafts, and an unknown name is refused before the model loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    common = ("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "8",
              "--expansion", "1,1", "--json")
    via_flag, via_ssm = cli(*common, "--drafter", "ssm:derived:1"), cli(*common, "--ssm", "derived:1")
    assert via_flag.returncode == 0 and via_ssm.returncode == 0, via_flag.stderr + via_ssm.stderr
    a, b = json.loads(via_flag.stdout), json.loads(via_ssm.stdout)
    assert a["token_ids"] == b["token_ids"] and a["llm_passes"] == b["llm_passes"]
    bad = cli(*common, "--drafter", "nope:1")
    assert bad.returncode == 2
    assert "expected NAME:ARG with NAME one of ['corpus', 'feature', 'lookup', 'ssm']" in bad.stderr
    lookup = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "8",
                 "--drafter", "lookup:depth=4,branches=1", "--json", env={"SPECJAX_CACHE_DIR": str(tmp_path)})
    assert lookup.returncode == 0, lookup.stderr
    record = json.loads(lookup.stdout)
    budget = record["tree_budget"]
    assert budget["tree_nodes"] == [1, 3, 5] and len(budget["ms_per_pass"]) == 3
    assert sum(budget["passes_at_level"]) == record["llm_passes"] - 1  # every loop pass ran at some level
    assert record["prefill_seconds"] > 0  # the time to the first token, apart from the rate
    # what the step programs multiplied with (``programs.step_matmuls``): XLA:CPU's library, maybe after "kernel+"
    assert record["step_matmuls"].removeprefix("kernel+") in ("eigen", "ynnpack"), record["step_matmuls"]


def test_layers_flag_generates_the_same_tokens_with_its_own_cost_table(tiny_llama_dir, tmp_path):
    """--layers changes how the weights are laid out, never the tokens (the default on this CPU is
    split); the tree budget measures each layout's pass costs separately (they differ) instead of
    reusing one table for the other."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    runs = [cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "8",
                "--drafter", "lookup:depth=2,branches=1", "--json", *extra, env={"SPECJAX_CACHE_DIR": str(tmp_path)})
            for extra in (("--layers", "stacked"), ("--layers", "split"), ())]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    stacked, split, default = (json.loads(r.stdout) for r in runs)
    assert stacked["token_ids"] == split["token_ids"] == default["token_ids"]
    with open(tmp_path / "tree_costs.json") as f:
        keys = list(json.load(f))
    assert sorted(k.split("|layers=")[1].split("|")[0] for k in keys) == ["split", "stacked"], keys


def test_sequence_mode_without_ssm_drafts_with_the_default_ssm_and_a_fixed_tree(tiny_llama_dir, tmp_path):
    """--mode sequence names no SSM: it drafts with derived:auto, which does not estimate its acceptance,
    so the default budget is the fixed chain (no tree_budget in the record), not a refusal."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "6",
            "--mode", "sequence", "--expansion", "1,1,1", "--json")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert len(record["token_ids"]) == 6 and "tree_budget" not in record


def test_json_records_are_per_prompt_and_the_only_stdout(tiny_llama_dir, tmp_path):
    import specjax

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n{"prompt": [7, 8, 9, 10, 11]}\n')
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "9",
            "--batch-size", "2", "--ssm", "derived:1", "--expansion", "1,1", "--json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]  # every stdout line is JSON
    assert [rec["prompt"] for rec in records] == [[1, 2, 3], [7, 8, 9, 10, 11]]
    model = specjax.load_model(tiny_llama_dir, progress=False)
    for rec in records:
        alone = specjax.generate(model, [rec["prompt"]], max_new_tokens=9, ssms=[specjax.derive_ssm(model, 1)],
                                 expansion=(1, 1))
        assert rec["token_ids"] == alone.token_ids[0]
        # this request's own statistics, not the batch's
        assert rec["llm_passes"] == alone.stats["llm_passes"]
        assert rec["tokens_per_pass_histogram"] == alone.stats["tokens_per_pass_histogram"]
        assert sum(rec["tokens_per_pass_histogram"]) == rec["llm_passes"] - 1  # the prefill pass is apart
    assert records[0]["llm_passes"] != records[1]["llm_passes"] or \
        records[0]["tokens_per_pass_histogram"] != records[1]["tokens_per_pass_histogram"]


def test_stdout_is_protected_from_native_writes():
    """What C++ code writes to file descriptor 1 (gloo's connection lines) lands on stderr, while the
    command's own records reach the real stdout. Run in a child whose fd 1 is a pipe, as under a shell
    pipeline (pytest's capture replaces sys.stdout, where fd 1 is not the command's to move)."""
    code = ("import os\n"
            "from specjax.cli import _clean_stdout\n"
            "with _clean_stdout() as out:\n"
            "    os.write(1, b'[Gloo] Rank 0 is connected\\n')\n"
            "    out.write('record\\n')\n"
            "os.write(1, b'after\\n')\n")  # fd 1 is restored afterwards
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "record\nafter\n"
    assert "[Gloo] Rank 0 is connected" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-k", "1000000000000"], "top_k must be an int in [0, 2**31)"),
    (["--temperature", "1e-30"], "temperature must be 0 (greedy) or >= 1e-06"),
    (["--expansion=1,,2"], "expansion must be comma-separated positive ints like 1,1,3,1, got '1,,2'"),
    (["--ssm", "derived:1", "--expansion", "100,100,100"], "makes a token tree of 1010101 nodes; the limit is 64"),
    (["--expansion", "2,1"], "--expansion shapes SSM drafts, but no SSM drafts here"),
    (["--drafter", "lookup:deep=3"], "expected lookup:auto, lookup:D or comma-separated"),
    (["--drafter", "lookup:depth=40,branches=2"], "80 nodes, beyond the tree limit of 64"),
    (["--budget", "auto", "--ssm", "derived:1"], "--budget auto needs drafters that estimate their acceptance; SSM"),
    (["--mode", "incremental", "--budget", "off"], "--mode incremental drafts nothing, so it takes no --budget"),
    (["--mode", "sequence", "--budget", "auto"], "SSM derived:auto do not"),  # the default SSM estimates nothing
    (["--ssm", "derived:0"], "K must be in [1, 1] for this 2-layer LLM, got 0"),
    (["--ssm", "derived:x"], "expected derived:auto, derived:K or derived:i,j,..."),
    (["--ssm", "/nonexistent/ssm"], "'/nonexistent/ssm' is neither a registered model"),
    (["--mode", "incremental", "--ssm", "derived:1"], "--mode incremental drafts nothing"),
    (["--microbatches", "1000"], "--microbatches needs --mesh"),
    (["--mesh", "dp=8", "--layers", "split"], "--layers split keeps the weights on one device"),
    (["--mesh", "pp=2", "--microbatches", "1000"], "--microbatches 1000 exceeds --batch-size 1"),
    (["--mesh", "tp=4"], "mesh pp=1,dp=1,tp=4 uses 4 of the 8 devices; a mesh must use every device"),
    (["--mesh", "tp=3,dp=x"], "expected comma-separated AXIS=SIZE"),
    (["--mesh", "tp=8"], "--replicate-attention"),
    (["--mesh", "tp=8", "--replicate-attention", "--microbatches", "1"], "--microbatches needs --mesh with pp > 1"),
    (["--replicate-attention"], "--replicate-attention shapes how a --mesh splits attention"),
    (["--temperature", "0.5", "--verifier", "greedy"], "verifier 'greedy' decodes greedily"),
    (["--temperature", "0.5", "--verifier", "rrs", "--draft", "iid", "--ssm", "derived:1"],
     "verifier 'rrs' is not lossless"),
    (["--draft", "iid"], "--draft shapes SSM drafts, but no SSM drafts here"),
    (["--mode", "incremental", "--verifier", "mss"], "--mode incremental neither drafts nor verifies"),
    (["--mode", "incremental", "--draft", "iid"], "--mode incremental neither drafts nor verifies"),
    (["--drafter", "lookup:depth=4,depth=8"], "--drafter lookup:depth=4,depth=8: depth given twice"),
    (["--drafter", "feature:auto,beam=2,beam=3"], "--drafter feature:auto,beam=2,beam=3: beam given twice"),
    (["--max-new-tokens", "2000"], "exceeds the context window of 1024"),
])
def test_bad_generate_flags_fail_fast_with_status_2(tiny_llama_dir, args, message, capsys):
    import jax

    assert len(jax.devices()) == 8  # what the mesh flags are checked against
    code, err = cli_here(capsys, "generate", "--model", tiny_llama_dir, "--prompts-file",
                         os.path.join(ROOT, "tests", "data", "ids.jsonl"), *args)
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err
    assert "loading" not in err  # refused before the weights load


def test_a_model_without_a_chat_template_is_said_not_silent(tiny_llama_dir, tmp_path, capsys):
    """A base model's string prompt goes in as written; the command says so, unless --no-chat-template asked
    for it. (Each request is refused afterwards, before loading: the tiny model's 128-token vocabulary cannot
    hold SmolLM2's ids, and SmolLM2's context cannot hold the tokens asked for.)"""
    import shutil

    base = str(tmp_path / "base")
    shutil.copytree(tiny_llama_dir, base)
    tok = copy.deepcopy(specjax.describe_model("smollm2-135m-instruct").tokenizer)  # the process keeps its own
    assert tok.chat_template
    tok.chat_template = None
    tok.save_pretrained(base)
    assert not specjax.describe_model(base).tokenizer.chat_template
    note = "has no chat template: prompts are tokenized as written"
    for model, flags, said in ((base, (), True), (base, ("--no-chat-template",), False),
                               ("smollm2-135m-instruct", (), False)):
        code, err = cli_here(capsys, "generate", "--model", model, "--prompt", "Hi", "--max-new-tokens", "99999",
                             *flags)
        assert code == 2 and ("outside the model's vocabulary" in err or "exceeds the context window" in err), err
        assert (note in err) == said, (model, flags, err)
    code, err = cli_here(capsys, "generate", "--model", base, "--prompts-file",
                         os.path.join(ROOT, "tests", "data", "ids.jsonl"), "--max-new-tokens", "99999")
    assert code == 2 and "exceeds the context window" in err and note not in err, err  # ids take no template


def test_a_mesh_runs_an_ssm_loaded_by_path_and_a_short_last_batch_of_microbatches(tiny_llama_dir, tmp_path):
    """``--ssm PATH --mesh ...`` was always refused (an SSM loaded by path has split layers on one CPU
    device), and ``--microbatches`` equal to ``--batch-size`` failed on a shorter last batch."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": {p}}}\n' for p in ([1, 2, 3], [7, 8, 9, 10], [4, 4, 4])))
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts), "--max-new-tokens", "5",
            "--ssm", tiny_llama_dir, "--expansion", "1,2", "--mesh", "pp=2,tp=4", "--replicate-attention",
            "--batch-size", "2", "--microbatches", "2", "--json", "--compile-cache", "none",
            env={"JAX_NUM_CPU_DEVICES": "8"})
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines()]
    alone = specjax.generate(specjax.load_model(tiny_llama_dir, progress=False), [[1, 2, 3], [7, 8, 9, 10], [4, 4, 4]],
                             max_new_tokens=5, mode="incremental")
    assert [rec["token_ids"] for rec in records] == alone.token_ids


@pytest.mark.parametrize("ids,message", [
    ([5, 6, 99999], "c.jsonl:1 has token id 99999, not in [0, 128)"),
    ([5], "the corpus needs a document of at least two tokens"),
])
def test_corpus_documents_are_checked_before_the_weights_load(tiny_llama_dir, tmp_path, ids, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"token_ids": ids}) + "\n")
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", os.path.join(ROOT, "tests", "data", "ids.jsonl"),
            "--drafter", f"corpus:{corpus}")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr  # refused before the weights load


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": null}\n', "p.jsonl:1: expected a JSON object whose 'prompt' is"),
    (b'{"prompt": ""}\n', "p.jsonl:1: expected a JSON object whose 'prompt' is"),
    (b'{"prompt": [1, true]}\n', "p.jsonl:1: expected a JSON object whose 'prompt' is"),
    (b'{"prompt": [1, 2.5]}\n', "p.jsonl:1: expected a JSON object whose 'prompt' is"),
    (b'{"text": "no prompt"}\n', "it has no 'prompt' key"),
    (b'[1, 2]\n', "the line is not a JSON object"),
    (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "p.jsonl:2: not valid UTF-8"),
    (b"\n\n", "no prompts in the file"),
    (b'{"prompt": [1, 99999]}\n', "token id 99999 is not in [0, 128)"),
    # the prompt's own line, though each batch (--batch-size 1) is checked apart
    (b'{"prompt": [1]}\n{"prompt": [2]}\n{"prompt": [1, 99999]}\n', "p.jsonl:3: token id 99999 is not in [0, 128)"),
    (b'{"prompt": [1]}\n{"prompt": [' + b"1, " * 1000 + b'1]}\n', "p.jsonl:2: 1001 prompt tokens + max_new_tokens"),
    (b'{"prompt": "bad \\ud800 x"}\n', "p.jsonl:1: 'prompt' is not valid UTF-8 text (lone surrogate U+D800 at "
                                       "character 4)"),
    (b'{"prompt": [' + b"1" * 5000 + b']}\n', "p.jsonl:1: expected a JSON object whose 'prompt' is a non-empty string "
                                             "or a list of token ids (ints); the line is not valid JSON (Exceeds"),
    (b'{"prompt": "a",}\n', "the line is not valid JSON (Expecting property name"),
])
def test_bad_prompts_files(tiny_llama_dir, tmp_path, content, message, capsys):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    code, err = cli_here(capsys, "generate", "--model", tiny_llama_dir, "--prompts-file", str(path),
                         "--no-chat-template")
    assert code == 2 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags,unused", [
    (dict(top_k=50, seed=7), ["--top-k", "--seed"]),
    (dict(top_p=0.9), ["--top-p"]),
    (dict(top_p=0.9, temperature=0.7), []),
    (dict(seed=7, ssm=["derived:1"], draft="iid"), []),  # the seed draws the SSM's sampled children
    (dict(seed=7, ssm=["derived:1"]), ["--seed"]),  # greedy drafts: top-k children, nothing drawn
    (dict(seed=7, mode="sequence", verifier="seeded"), []),  # seeded's coupled drafts draw
    (dict(seed=7, mode="incremental"), ["--seed"]),
])
def test_sampling_flags_that_change_nothing_at_temperature_0_are_named(flags, unused):
    from specjax.cli import build_parser
    from specjax.cli.generate import _unused_sampling_flags

    args = build_parser().parse_args(["generate"])
    assert (args.top_k, args.top_p, args.seed) == (None, None, None)  # so that "given" can be told apart
    for k, v in flags.items():
        setattr(args, k, v)
    assert _unused_sampling_flags(args) == unused


def test_a_prompts_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows tools write one (Notepad, PowerShell's -Encoding utf8): it was refused as "not valid JSON"."""
    from specjax.io.prompts import read_prompt_records

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\r\n{"prompt": [1, 2]}\r\n')
    assert [r["prompt"] for r in read_prompt_records(str(path))] == ["hi", [1, 2]]
    (tmp_path / "p.txt").write_bytes(b"\xef\xbb\xbfone\ntwo\n")
    assert [r["prompt"] for r in read_prompt_records(str(tmp_path / "p.txt"), plain_lines=True)] == ["one", "two"]


def test_output_whose_reader_went_away_ends_quietly_and_an_interrupt_exits_130(tiny_llama_dir, tmp_path):
    """`specjax generate ... | head`: two BrokenPipeError tracebacks and status 120. Ctrl-C while XLA
    compiled: "specjax: interrupted", then a segfault at the interpreter's shutdown (status -11)."""
    import signal
    import time

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n' * 3)
    command = [sys.executable, "-m", "specjax", "generate", "--model", tiny_llama_dir, "--prompts-file", str(prompts),
               "--max-new-tokens", "200", "--mode", "incremental"]
    p = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # the reader is gone before the first token is written (head's after its lines)
    err = p.stderr.read().decode()
    assert p.wait(120) == 128 + signal.SIGPIPE and "Traceback" not in err and "Exception ignored" not in err, err
    p = subprocess.Popen([*command, "--compile-cache", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT)
    while b"loading" not in p.stderr.read1(4096):  # the model loads, then the programs compile
        assert p.poll() is None
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "specjax: interrupted" in err.decode(), err.decode()[-2000:]


def test_main_returns_its_status_in_process_also_in_a_cluster(monkeypatch, tmp_path):
    """Only the command (``entry``) leaves through os._exit in a cluster: main() called in-process (a driver
    that joined the cluster itself) ended the caller's interpreter on any error."""
    from specjax.sharding import distributed

    monkeypatch.setattr(distributed, "joined_cluster", lambda: True)
    assert main(["generate", "--prompts-file", str(tmp_path / "none.jsonl")]) == 2


@pytest.mark.parametrize("outcome,cluster,status", [(130, False, 130), (143, False, 143), (2, True, 2),
                                                    (RuntimeError("gloo"), True, 1), (2, False, None), (0, True, None)])
def test_the_command_leaves_at_once_after_an_interrupt_or_a_failure_in_a_cluster(monkeypatch, capsys, outcome, cluster,
                                                                                status):
    """``entry``: os._exit after an interrupt (the interpreter's shutdown after a Ctrl-C in XLA compilation
    segfaulted) and after a failure in a cluster (JAX's shutdown barrier waited 5 minutes, then aborted);
    sys.exit otherwise. ``status``: os._exit's, None where it must not be called."""
    import specjax.cli as cli_module
    from specjax.sharding import distributed

    def fake_main():
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    exits = []
    monkeypatch.setattr(cli_module, "main", fake_main)
    monkeypatch.setattr(distributed, "joined_cluster", lambda: cluster)
    monkeypatch.setattr(cli_module.os, "_exit", lambda code: exits.append(code) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit) as ended:
        cli_module.entry()
    assert exits == ([] if status is None else [status])
    if status is None:
        assert ended.value.code == outcome
    if isinstance(outcome, Exception):
        assert "in a cluster of" in capsys.readouterr().err


def test_prompts_file_that_is_a_directory_or_missing(tiny_llama_dir, tmp_path):
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr
    r = cli("generate", "--model", tiny_llama_dir, "--prompts-file", str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "prompts file not found" in r.stderr


def test_prompt_with_invalid_utf8_bytes(tiny_llama_dir):
    r = subprocess.run([sys.executable.encode(), b"-m", b"specjax", b"generate", b"--model", tiny_llama_dir.encode(),
                        b"--prompt", b"caf\xe9"], capture_output=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and b"--prompt is not valid UTF-8 text" in r.stderr, r.stderr


def test_convert_refuses_bad_destinations_before_loading(tiny_llama_dir, tmp_path):
    existing = tmp_path / "file"
    existing.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "a").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    cases = [(existing, "exists and is a file"), (existing / "sub", "which is a file"),
             (full, "exists and is not empty")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((locked / "ckpt", "is not writable"))
    for dst, message in cases:
        r = cli("convert", tiny_llama_dir, str(dst))
        assert r.returncode == 2 and message in r.stderr, (dst, r.stderr)


@pytest.mark.parametrize("nodes,message", [
    ("1,0", "--nodes '1,0': expected comma-separated ints >= 1"),
    ("1,1024", "--nodes 1024: a tree pass of that many nodes does not fit the model's context window of 1024"),
])
def test_bad_tree_cost_sizes_are_refused_before_loading(tiny_llama_dir, nodes, message):
    """A size past the context window loaded the model, then measured nonsense or ran out of memory."""
    r = cli("tree-cost", "--model", tiny_llama_dir, "--nodes", nodes)
    assert r.returncode == 2 and message in r.stderr and "loading" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,message", [
    (["--", "/nonexistent/cmd"], "command '/nonexistent/cmd' not found"),
    (["--port", "99999", "--", "true"], "--port must be in [1, 65535], got 99999"),
    (["--timeout", "-1", "--", "true"], "--timeout must be > 0 seconds"),
    (["--cpu-devices", "0", "--", "true"], "--cpu-devices must be >= 1"),
    ([], "no command given"),
])
def test_bad_launch_flags(args, message):
    r = cli("launch", "-n", "2", *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--num-prompts", "-3"], "--num-prompts must be >= 1, got -3"),
    (["--num-prompts", "100000"], "the templates give"),
    (["--epochs", "-1"], "--epochs must be a positive number"),
    (["--epochs", "nan"], "--epochs must be a positive number"),
    (["--learning-rate", "0"], "--learning-rate must be a positive number"),
    (["--member", "a:0", "--member", "a:1"], "members need distinct names"),
    (["--member", "a:0,5"], "layers must be increasing indices in 0..1"),
    (["--member", "a"], "expected NAME:LAYERS[:MLP[:VOCAB]]"),
    (["--member", "a:0:99999"], "MLP width must be in [1, 96]"),
    (["--temperatures", "0,x"], "--temperatures '0,x'"),
    (["--temperatures", "-1"], "temperature must be a finite number >= 0"),
    (["--num-prompts", "10", "--epochs", "1"], "not more than the 20 warm-up steps"),
    (["--boost-weight", "1"], "--boost-weight 1.0: must be in [0, 1)"),
    (["--exclude-prompts", "/nonexistent.jsonl"], "prompts file not found"),
])
def test_bad_boost_tune_flags_fail_before_any_work(tiny_llama_dir, tmp_path, args, message, capsys):
    members = [] if "--member" in args else ["--member", "m:0:32:64"]  # the default members fit SmolLM2 only
    code, err = cli_here(capsys, "boost-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"), "--out",
                         str(tmp_path / "o"), *members, *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()  # refused before any work


def test_sigterm_while_feature_tune_exports_leaves_no_partial_directory(tiny_llama_dir, tmp_path, monkeypatch,
                                                                        capsys):
    """SIGTERM (a scheduler's stop, ``timeout``) ended the process at once: the export's half-written
    ``.NAME.partial-*`` directory stayed beside it for good. It is now an interrupt (status 143), cleaned up
    as Ctrl-C is; boost-tune and convert likewise."""
    import signal
    import time

    import specjax.boost.feature_tune as feature_tune_module
    from specjax.io.checkpoint import written_aside

    def export_then_stopped(*args, **kwargs):
        with written_aside(str(tmp_path / "drafter")) as tmp:
            (tmp_path / tmp / "half").write_text("half an export")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the signal's handler raises here
        raise AssertionError("not interrupted")

    monkeypatch.setattr(feature_tune_module, "feature_tune", export_then_stopped)
    before = signal.getsignal(signal.SIGTERM)
    code = main(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"), "--out",
                 str(tmp_path / "o"), "--draft-vocab", "64", "--no-progress"])
    assert code == 128 + signal.SIGTERM, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # nothing was written but the export's part
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored


def test_feature_tune_evaluates_each_prompt_once(tiny_llama_dir, tmp_path):
    """A prompt repeated in an --eval-prompts file, or given in two, was generated and weighed in the reported
    agreement as often as it appeared."""
    from specjax.cli.feature import check_args

    prompts = tmp_path / "eval.txt"
    prompts.write_text("Name a river.\nName a river.\nName a star.\n")
    parsed = build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                        "--out", str(tmp_path / "o"), "--draft-vocab", "64",
                                        "--eval-prompts", str(prompts), "--eval-prompts", str(prompts)])
    evaluate = check_args(parsed)[4]
    assert evaluate == ["Name a river.", "Name a star."]


@pytest.mark.parametrize("args,message", [
    (["--held-out", "0.7"], "--held-out must be in (0, 0.5)"),
    (["--draft-vocab", "0"], "--draft-vocab must be >= 1"),
    (["--draft-vocab", "999999"], "exceeds the LLM's vocabulary (128)"),
    (["--epochs", "0"], "must be positive"),
    (["--nodes", "0"], "nodes must be a positive int, got 0"),
    (["--exclude-prompts", "/nonexistent.jsonl"], "prompts file not found"),
    (["--stop-after", "-1"], "--stop-after must be >= 0 steps"),
    (["--requests", "-1"], "requests must be >= 0"),
    (["--more-requests", "-2"], "more_requests must be >= 0, got 0, -2"),
    (["--time-budget", "0"], "--time-budget must be a positive number of seconds, got 0.0"),
    (["--time-budget", "nan"], "--time-budget must be a positive number of seconds, got nan"),
    (["--eval-prompts", "/nonexistent.jsonl"], "prompts file not found"),
    (["--init-from", "/nonexistent-drafter"], "not a registered name"),
    (["--fused", "1,final"], "--fused must be comma-separated LLM layer indices"),
    (["--fused", "2,1"], "--fused must list distinct layers in increasing order"),
    (["--fused", "0,3"], "fused must be increasing LLM layer indices in [0, 2] (2: the final feature)"),
    (["--fused", "2"], "is the final feature alone"),
    # found only after the corpus (hours) before: too few prompts in the templates, too few training steps
    (["--tasks", "100000"], "asked for 100000 training prompts, the templates give"),
    (["--passages", "100000"], "asked for 100000 training prompts, the templates give"),
    (["--passages", "3", "--grounded", "2", "--tasks", "2", "--epochs", "1"],
     "this corpus plan makes at most 7 sequences: at --batch-size 8 for 1 epochs they give at most 0 steps"),
    (["--batch-size", "100000"], "they give at most 0 steps, not more than the 50 warm-up steps"),
    # refused only after the passages were generated (and the corpus directory then kept them)
    (["--passages", "1"], "--grounded 2400 quotes two passages per prompt: it needs --passages >= 2, got 1"),
    (["--reg-weight", "-0.5"], "a finite reg_weight >= 0"),
    (["--reg-weight", "inf"], "a finite reg_weight >= 0"),
    (["--written-prompts", "/nonexistent.jsonl"], "--written-prompts /nonexistent.jsonl: prompts file not found"),
    (["--train-groups", "written"],  # a round is a group once its flag is given
     "--train-groups written: 'written' is not a split group of this corpus plan (its groups: templates;"),
    (["--requests", "8", "--train-groups", "templates,bogus"],
     "'bogus' is not a split group of this corpus plan (its groups: templates, requests;"),
    (["--train-groups", "templates,templates"], "--train-groups templates,templates: a group is named twice"),
    (["--written-prompts", "WRITTEN", "--eval-prompts", "WRITTEN"], "no prompt left (1 read, all held out"),
    (["--written-prompts", "WRITTEN", "--written-c-prompts", "WRITTEN"],  # a round skipped between them
     "--written-c-prompts WRITTEN: no prompt left (1 read, all held out or already in the corpus)"),
    # every later round refuses the prompts its previous round holds (one case per WRITTEN_ROUNDS entry)
    *[([earlier.flag, "WRITTEN", later.flag, "WRITTEN"],
       f"{later.flag} WRITTEN: no prompt left (1 read, all held out or already in the corpus)")
      for earlier, later in zip(list(WRITTEN_ROUNDS.values()), list(WRITTEN_ROUNDS.values())[1:])],
])
def test_bad_feature_tune_flags_fail_before_any_work(tiny_llama_dir, tmp_path, args, message):
    """Checked in-process (what the command runs before loading the LLM); one run through the CLI below."""
    from specjax.cli.feature import check_args

    written = tmp_path / "written.jsonl"  # WRITTEN: a prompts file of one prompt
    written.write_text(json.dumps({"prompt": "Plan a picnic for six."}) + "\n")
    args = [str(written) if a == "WRITTEN" else a for a in args]
    message = message.replace("WRITTEN", str(written))
    parsed = build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                        "--out", str(tmp_path / "o"), "--draft-vocab", "64", *args])
    with pytest.raises(InputError) as err:
        check_args(parsed)
    assert message in str(err.value)
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()


def test_feature_tune_training_flags_reach_the_training_config(tiny_llama_dir, tmp_path):
    from specjax.cli.feature import check_args

    def checked(*flags):  # (corpus plan, training config, ...) of feature-tune with these flags
        return check_args(build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus",
                                                     str(tmp_path / "c"), "--out", str(tmp_path / "o"),
                                                     "--draft-vocab", "64", *map(str, flags)]))

    assert checked()[1].reg_weight == 0.5  # the recipe every shipped drafter was trained with
    tc = checked("--reg-weight", "0", "--unrolled-steps", "3")[1]
    assert tc.reg_weight == 0.0 and tc.unrolled_steps == 3
    # the loss window: the longest continuation (passages, 160) + the unrolled steps + 8 (feature_tune.training_window,
    # which scripts/gpu_feature_check.py times with): 172 for every shipped drafter's 4 steps
    assert checked()[1].window == 172 and tc.window == 171
    written = tmp_path / "written.jsonl"
    written.write_text(json.dumps({"prompt": "Plan a picnic for six."}) + "\n")
    plan = checked("--written-prompts", written, "--written-prompts", written)[0]
    assert plan.written == (str(written), str(written))  # the corpus plan's written parts
    # every round's flag fills its own plan field and no other (the flags come from WRITTEN_ROUNDS)
    for n, written_round in enumerate(WRITTEN_ROUNDS.values()):
        mine = tmp_path / f"round{n}.txt"
        mine.write_text(f"Name a lake in country number {n}.\n")
        plan = checked(written_round.flag, mine)[0]
        assert {r.files_field: getattr(plan, r.files_field) for r in WRITTEN_ROUNDS.values()} == {
            r.files_field: (str(mine),) if r is written_round else () for r in WRITTEN_ROUNDS.values()}
    assert {"--written-f-prompts", "--written-g-prompts"} <= {r.flag for r in WRITTEN_ROUNDS.values()}
    parsed = build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                        "--out", str(tmp_path / "o"), "--draft-vocab", "64", "--written-f-prompts",
                                        str(written), "--train-groups", "written-f,templates"])
    check_args(parsed)
    assert parsed.train_group_names == ("written-f", "templates")  # what feature_tune is given
    parsed = build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                        "--out", str(tmp_path / "o"), "--draft-vocab", "64"])
    check_args(parsed)
    assert parsed.train_group_names == ()  # every group


def test_feature_tune_reports_step_0_and_the_end_on_the_same_sequences(tiny_llama_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """The closing line puts the final drafter on the sequences the history evaluated beside its first
    evaluation of them (stop 74 compared a 400-sequence step 0 with a 464-sequence end)."""
    import io

    import specjax.boost.feature_tune as tune
    from specjax.cli.feature import _cmd_feature_tune

    def agreement(d1, positions):
        return {"all": [d1] + [0.1] * 5, "positions": positions}

    summary = {"sequences": {"train": 90, "held_out": 464}, "held_out_agreement": agreement(0.573, 50000),
               "history_set_agreement": {"sequences": 400, **agreement(0.591, 43000)},
               "history": [{"step": 0, "loss": None, "held_out": agreement(0.583, 43000)}],
               "eval_prompts_agreement": None, "steps": {"done": 90, "planned": 90}}
    monkeypatch.setattr(tune, "feature_tune", lambda *a, **k: (k["log"]("resumed o at step 50/90"), summary)[1])
    args = build_parser().parse_args(["feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"),
                                      "--out", str(tmp_path / "o"), "--draft-vocab", "64", "--no-progress"])
    out = io.StringIO()
    capsys.readouterr()
    assert _cmd_feature_tune(args, out) == 0
    # stdout: the closing line and the JSON summary alone; progress lines went there too and broke its readers
    assert "resumed o at step 50/90" in capsys.readouterr().err
    line, record = out.getvalue().splitlines()
    assert json.loads(record)["steps"] == {"done": 90, "planned": 90}
    assert "0.573, 0.100" in line and "(464 sequences; on the 400 evaluated during training 0.591, " in line
    assert "at the history's first evaluation 0.583, " in line
    assert line.startswith("feature-tune done in ")
    summary["history"][0]["held_out"]["positions"] = 41000  # a history of another set (an older run resumed)
    out = io.StringIO()
    assert _cmd_feature_tune(args, out) == 0
    assert "first evaluation" not in out.getvalue()
    summary["steps"] = {"done": 2, "planned": 90}  # --stop-after, --time-budget: not "done"
    out = io.StringIO()
    assert _cmd_feature_tune(args, out) == 0
    assert out.getvalue().startswith("feature-tune stopped after 2 of 90 steps, ")
    assert "(the same command continues it)" in out.getvalue().splitlines()[0]


@pytest.mark.parametrize("flag", ["--out", "--corpus"])
def test_feature_tune_refuses_an_export_into_its_own_directories(tiny_llama_dir, tmp_path, flag):
    """Refused after the whole run before (the export found its destination not empty)."""
    r = cli("feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
            "--draft-vocab", "64", "--export", str(tmp_path / ("o" if flag == "--out" else "c")))
    assert r.returncode == 2 and f"is the {flag} directory" in r.stderr, r.stderr


def test_feature_tune_refuses_bad_flags_with_exit_2(tiny_llama_dir, tmp_path):
    r = cli("feature-tune", "--model", tiny_llama_dir, "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
            "--held-out", "0.7")
    assert r.returncode == 2 and "--held-out must be in (0, 0.5)" in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()

"""The README is what users run: its Quickstart is what CI runs (both commands, verbatim, each in a
fresh virtual environment) and every other snippet runs as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _section(title: str) -> str:
    section = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", _readme(), re.S | re.M)
    assert section, f"README.md has no '## {title}' section"
    return section.group(1)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(text: str) -> list[str]:
    """Command lines of the bash blocks, with trailing comments and continuations joined."""
    lines = []
    for block in _blocks(text, "bash"):
        pending = ""
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            lines.append((pending + line).strip())
            pending = ""
    return lines


def _quickstart_commands() -> list[str]:
    return _commands(_section("Quickstart"))


def _ci_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return [line.strip() for line in f]


def test_quickstart_has_exactly_two_commands():
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    assert "specjax generate" in commands[0] and ".[test]" not in commands[0]
    assert "pytest" in commands[1] and ".[test]" in commands[1]


def test_ci_runs_both_quickstart_commands_verbatim_each_in_a_fresh_venv():
    ci = _ci_lines()
    positions = []
    for command in _quickstart_commands():
        assert command in ci, f"{command!r} is not a line of .ci/run"
        positions.append(ci.index(command))
    assert positions == sorted(positions), "CI runs the main job first"
    venvs = [i for i, line in enumerate(ci) if re.match(r"python3 -m venv (\S+)$", line)]
    removed = {line.split()[-1] for line in ci if line.startswith("rm -rf ")}
    names = [ci[i].split()[-1] for i in venvs]
    assert len(set(names)) == 2 and set(names) <= removed, "two fresh environments, removed before creation"
    # each command runs after its own environment is created and activated, and after the previous command
    activations = [i for i, line in enumerate(ci) if line.startswith("source ") and "/bin/activate" in line]
    for venv, command in zip(venvs, positions):
        assert any(venv < a < command for a in activations)
    assert venvs[0] < positions[0] < venvs[1] < positions[1]


def test_readme_names_the_runtime_dependencies_that_pyproject_declares():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = " ".join(tomllib.load(f)["project"]["dependencies"])
    for needed in ("jinja2", "safetensors", "transformers", "gguf"):
        assert needed in deps, f"{needed} is used at run time but not declared"


def _run_shell(command: str, cwd: str, timeout: int = 900):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


USING_IT = _commands(_section("Using it")) if "## Using it" in _readme() else []


@requires_smollm2
@pytest.mark.slow
def test_using_it_commands_run_as_written(tmp_path):
    """Every command of "Using it", in order, in a scratch directory that sees the repo's scripts/."""
    os.symlink(os.path.join(ROOT, "scripts"), tmp_path / "scripts")
    assert len(USING_IT) >= 8
    claims = 0
    for command in USING_IT:
        r = _run_shell(command, str(tmp_path))
        assert r.returncode == 0, f"{command}\n{r.stderr[-3000:]}"
        if " generate " in command and "--json" not in command:
            assert r.stdout.strip(), command  # the text
            assert re.search(r"^# \d+ tokens in .* tokens/s \| load .* compile .* LLM passes", r.stderr, re.M), \
                f"{command}: no stats line\n{r.stderr[-2000:]}"
        if "same tokens as --mode incremental" in command:  # the README's claim, checked: the default drafters
            # and verifier on the filtered (temperature 0.8, top-p) sampling path, through the command line
            claims += 1
            reference = _run_shell(shlex.join(shlex.split(command, comments=True) + ["--mode", "incremental"]),
                                   str(tmp_path))
            assert reference.returncode == 0, reference.stderr[-3000:]
            assert r.stdout == reference.stdout, f"{command}: not incremental sampling's text"
    assert claims == 1


@requires_smollm2
@pytest.mark.slow
def test_scale_out_commands_run_or_parse(tmp_path):
    """The mesh commands run as written and print what one device decodes (greedy: the default drafters on a
    PP=2 x TP=4 mesh, in one process and across two); the srun line (needs SLURM) is parsed and its flags
    checked."""
    commands = _commands(_section("Scale-out: meshes and multi-host"))
    assert any(c.startswith("srun ") for c in commands)
    # what one device decodes for the mesh commands' request: each mesh must print the same text
    one_device = _run_shell('specjax generate --prompt "Hello" --max-new-tokens 32 --mode incremental', str(tmp_path))
    assert one_device.returncode == 0 and one_device.stdout.strip(), one_device.stderr[-3000:]
    for command in commands:
        if command.startswith("srun "):
            words = shlex.split(command, comments=True)
            from specjax.cli import build_parser
            from specjax.cli.generate import _check_generate_args

            args = build_parser().parse_args(words[words.index("specjax") + 1:])
            _check_generate_args(args)
            assert args.replicate_attention and args.distributed == "slurm"
            continue
        assert '--prompt "Hello" --max-new-tokens 32' in command, command
        r = _run_shell(command, str(tmp_path))
        assert r.returncode == 0, f"{command}\n{r.stderr[-3000:]}"
        assert r.stdout == one_device.stdout, f"{command}: not one device's text"


def _checked_training_commands(command_name: str, check_args) -> list:
    """Every README ``specjax <command_name>`` command parsed and run through ``check_args`` (what the
    command does before any work) from the repository root; prompt files not beside it are dropped.
    Returns the parsed arguments."""
    from specjax.cli import build_parser
    from specjax.io import registry

    commands = [c for c in _commands(_readme()) if c.startswith(f"specjax {command_name}")]
    assert commands
    parsed, exported = [], set()
    for command in commands:
        args = build_parser().parse_args(shlex.split(command.split(" && ")[0])[1:])
        args.exclude_prompts = [p for p in args.exclude_prompts if os.path.exists(os.path.join(ROOT, p))]
        if hasattr(args, "eval_prompts"):
            args.eval_prompts = [p for p in args.eval_prompts if os.path.exists(os.path.join(ROOT, p))]
        if getattr(args, "init_from", None) and not registry.is_feature_drafter(args.init_from) \
                and not os.path.exists(os.path.join(ROOT, args.init_from)):
            # a recipe in steps: it continues what an earlier README command exports (not made here)
            assert args.init_from in exported, f"--init-from {args.init_from}: no earlier README command exports it"
            args.init_from = None
        if getattr(args, "export", None):
            exported.add(args.export)
        cwd = os.getcwd()
        try:
            os.chdir(ROOT)
            check_args(args)
        finally:
            os.chdir(cwd)
        parsed.append(args)
    return parsed


@requires_smollm2
@pytest.mark.slow
def test_boost_tune_commands_are_valid():
    """The training recipe is an hour of CPU: its flags are parsed and checked (what runs before any work)."""
    from specjax.cli.boost import check_args

    _checked_training_commands("boost-tune", check_args)


@requires_smollm2
def test_feature_tune_commands_are_valid():
    """The feature drafter's recipe is hours of CPU: its README command is parsed and checked (what runs
    before any work), with the evaluation prompts held out."""
    from specjax.cli.feature import check_args

    for args in _checked_training_commands("feature-tune", check_args):
        assert any(p.endswith("task_kinds.jsonl") for p in args.exclude_prompts)
    # the recipe exports a drafter that drafts as the shipped one (its --depth once defaulted to 6, not 4)
    import specjax
    from specjax.cli import build_parser
    from specjax.cli.feature import SHIPPED_DRAFTING, resolve_drafting

    with open(os.path.join(ROOT, "models", "smollm2-feature", "feature_drafter.json")) as f:
        shipped = json.load(f)["drafting"]
    recipe = [c for c in _commands(_readme()) if c.startswith("specjax feature-tune")][0]
    args = build_parser().parse_args(shlex.split(recipe.split(" && ")[0])[1:])
    assert args.init_from is None
    drafting = resolve_drafting(specjax.describe_model(args.model), None,
                                {k: getattr(args, k) for k in SHIPPED_DRAFTING})
    assert drafting == {**shipped, "ladder": tuple(shipped["ladder"])}


@requires_smollm2
@pytest.mark.slow
def test_python_snippets_run_as_written():
    """The README's Python blocks, in order, in one namespace (later blocks use earlier names)."""
    import jax

    blocks = _blocks(_readme(), "python")
    assert len(blocks) >= 3
    namespace: dict = {}
    assert len(jax.devices()) == 8  # the mesh snippet's devices (tests/conftest.py simulates 8)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["out"].texts[0] and namespace["spec"].stats["mean_tokens_per_pass"] >= 1
    # the streamed text, whole characters at a time, is the final text (decoding each pass's ids alone
    # printed U+FFFD for a character split across passes, and <|im_end|>)
    assert namespace["text"].text == namespace["streamed"].texts[0]
    tokens = namespace["tokens"]
    assert tokens.shape == (2, 128)
    assert tokens[0, 0].tolist() == namespace["out"].token_ids[0][0]  # the jitted core == the API, greedy

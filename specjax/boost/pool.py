"""Collective boost-tuning (SpecInfer section 3): a pool of SSMs aligned with the LLM one after another.

Member 1 is distilled on every continuation token of the corpus. Each later member trains on the
tokens that no earlier member already predicts (teacher-forced top-1 == the LLM's token): the
"samples" here are (context, next token) pairs, so a long continuation that the first SSM mostly
gets right still teaches the next one its few hard tokens. ``boost_weight`` is the weight the
already-predicted tokens keep: 0 is the paper's rule (dropped); a small positive weight ("soft
boosting") keeps the next member a generalist whose chains stay good after it diverges, while it
still leans towards what the earlier members miss. Later members are evaluated on the held-out
positions the earlier members miss, the only place where a pool member can add accepted tokens.
Members whose architecture matches the previous one start from its weights (they begin as a copy
and move towards its mistakes), others from the LLM. Every stage is resumable: finished members
are reloaded, a member in training resumes from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.boost.corpus import read_shard
from specjax.boost.distill import (
    EVAL_TOP_K,
    Examples,
    TrainConfig,
    evaluate,
    predicted_mask,
    total_steps,
    train,
)
from specjax.boost.student import make_student, param_count
from specjax.boost.teacher import cached_teacher_targets
from specjax.errors import InputError
from specjax.io.checkpoint import save_checkpoint
from specjax.io.loader import load_model
from specjax.types import Model

EVAL_EVERY_NTH = 20  # every 20th corpus sequence is held out for the periodic evaluation


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    layers: tuple[int, ...] = (0, 1)
    mlp_size: int | None = None
    draft_vocab_size: int = 8192

    @classmethod
    def parse(cls, text: str) -> Member:
        """'NAME:LAYERS[:MLP[:VOCAB]]', e.g. 'ssm-a:0,1:768:8192'."""
        parts = text.split(":")
        try:
            if not 2 <= len(parts) <= 4 or not parts[0]:
                raise ValueError
            layers = tuple(int(x) for x in parts[1].split(","))
            mlp = int(parts[2]) if len(parts) > 2 and parts[2] else None
            vocab = int(parts[3]) if len(parts) > 3 else 8192
        except ValueError:
            raise InputError(f"--member {text!r}: expected NAME:LAYERS[:MLP[:VOCAB]], "
                             f"e.g. ssm-a:0,1:768:8192") from None
        return cls(parts[0], layers, mlp, vocab)


def check_members(members: list[Member], llm_cfg) -> None:
    """Distinct names and architectures the LLM can give (checked before any corpus is generated)."""
    names = [m.name for m in members]
    if not members or len(set(names)) != len(names):
        raise InputError(f"members need distinct names, got {names}")
    for m in members:
        if "/" in m.name or m.name in (".", "..", "train"):
            raise InputError(f"member name {m.name!r} cannot be a directory name of its own (no '/', '.', '..', "
                             f"'train')")
        layers = list(m.layers)
        if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= llm_cfg.num_layers:
            raise InputError(f"member {m.name}: layers must be increasing indices in 0..{llm_cfg.num_layers - 1}, "
                             f"got {m.layers}")
        if m.mlp_size is not None and not 1 <= m.mlp_size <= llm_cfg.intermediate_size:
            raise InputError(f"member {m.name}: MLP width must be in [1, {llm_cfg.intermediate_size}], "
                             f"got {m.mlp_size}")
        if not 1 <= m.draft_vocab_size <= llm_cfg.vocab_size - 1:
            raise InputError(f"member {m.name}: draft vocabulary size must be in [1, {llm_cfg.vocab_size - 1}], got "
                             f"{m.draft_vocab_size}")


def expected_steps(num_sequences: int, tc: TrainConfig) -> int:
    """Optimizer steps per member for a corpus of ``num_sequences`` (every EVAL_EVERY_NTH held out)."""
    held = -(-num_sequences // EVAL_EVERY_NTH)
    return total_steps(num_sequences - held, tc)


def read_corpus(corpus_dir: str) -> list[tuple[list[int], int]]:
    paths = sorted(glob.glob(os.path.join(corpus_dir, "shard-*.npz")))
    if not paths:
        raise InputError(f"{corpus_dir}: no corpus shards (shard-*.npz); generate them first")
    return [s for p in paths for s in read_shard(p)]


def corpus_digest(sequences) -> str:
    """A digest of a corpus's sequences (tokens and prompt lengths): what a finished member was trained on."""
    h = hashlib.sha256()
    for tokens, prompt_len in sequences:
        h.update(np.asarray([len(tokens), prompt_len], np.int64).tobytes())
        h.update(np.asarray(tokens, np.int64).tobytes())
    return h.hexdigest()[:16]


def _member_record(member: Member, corpus_dir: str, digest: str) -> dict:
    return {"layers": list(member.layers), "mlp_size": member.mlp_size, "draft_vocab_size": member.draft_vocab_size,
            "corpus": os.path.abspath(corpus_dir), "corpus_digest": digest}


def _check_finished(final: str, record_path: str, want: dict, log) -> None:
    """A member already in ``out_dir`` is reused only if it was trained as this run asks: its spec (the
    LLM layers it copies, MLP and vocabulary sizes) and its corpus. Otherwise the pool would mix members
    of different runs while the summary reported this run's spec and corpus for them."""
    if not os.path.exists(record_path):
        log("  (trained by an earlier specjax that did not record its spec and corpus: not checked against "
            "this run's)")
        return
    with open(record_path) as f:
        had = json.load(f)
    differ = [k for k in ("layers", "mlp_size", "draft_vocab_size", "corpus_digest") if had.get(k) != want[k]]
    if differ:
        said = ", ".join(f"{k} {had.get(k)!r} (this run: {want[k]!r})" for k in differ)
        raise InputError(f"{final}: this member was trained otherwise: {said}; use another --out, or remove {final} "
                         f"(and its training run) to train it again")


def save_ssm(model: Model, path: str, dtype=jnp.float16) -> None:
    """An SSM as a specjax checkpoint (no tokenizer: SSMs share the LLM's), stored in ``dtype``."""

    save_checkpoint(path, model.config, jax.tree.map(lambda a: jnp.asarray(a, dtype), model.params))


def restricted(examples: Examples, keep: np.ndarray, other_weight: float = 0.0) -> Examples:
    """``examples`` with weight 1 where ``keep``, ``other_weight`` at the other continuation positions."""
    base = examples.weights
    return dataclasses.replace(examples, weights=np.where(keep, base, other_weight * base).astype(np.float32))


def boost_tune(llm: Model, corpus_dir: str, out_dir: str, members: list[Member], tc: TrainConfig,
               boost_weight: float = 0.0, progress: bool = True, log=print) -> list[dict]:
    """Train the pool; writes ``out_dir/<name>`` (float16 checkpoint) per member and
    ``out_dir/boost_summary.json``. Returns one summary dict per member."""

    check_members(members, llm.config)
    if not 0.0 <= boost_weight < 1.0:
        raise InputError(f"boost_weight {boost_weight}: must be in [0, 1) (0 drops the tokens earlier members "
                         f"predict, as in SpecInfer; 1 would not boost at all)")
    sequences = read_corpus(corpus_dir)
    held = [s for i, s in enumerate(sequences) if i % EVAL_EVERY_NTH == 0]
    train_seqs = [s for i, s in enumerate(sequences) if i % EVAL_EVERY_NTH != 0]
    examples, eval_examples = Examples.build(train_seqs), Examples.build(held)
    active = examples.weights > 0  # tokens no earlier member predicts
    held_active = eval_examples.weights > 0
    log(f"corpus {corpus_dir}: {len(train_seqs)} training sequences ({int(active.sum())} continuation tokens), "
        f"{len(held)} held out for evaluation")
    digest = corpus_digest(sequences)
    summaries, previous = [], None
    for i, member in enumerate(members):
        final = os.path.join(out_dir, member.name)
        started = time.perf_counter()
        missed = restricted(eval_examples, held_active)  # == eval_examples for the first member
        record_path = os.path.join(out_dir, "train", member.name, "member.json")
        record = _member_record(member, corpus_dir, digest)
        if os.path.isdir(final):
            log(f"member {member.name}: already trained ({final})")
            _check_finished(final, record_path, record, log)
        else:
            if tc.loss == "kl" and examples.teacher is None:  # the LLM's top-k once, not an LLM pass per step
                cache = os.path.join(corpus_dir, f"teacher-top{tc.teacher_top_k}.npz")
                examples = examples.with_teacher(
                    train_seqs, cached_teacher_targets(llm, train_seqs, cache, tc.teacher_top_k, progress, log))
            student = make_student(llm, train_seqs, member.layers, member.draft_vocab_size, member.mlp_size)
            if previous is not None and previous.config == student.config:
                student = previous  # same architecture and draft vocabulary: start from the previous member
            weighted = restricted(examples, active, boost_weight)
            ssm, _ = train(student, weighted, dataclasses.replace(tc, seed=tc.seed + i),
                           os.path.join(out_dir, "train", member.name), llm=llm, eval_examples=missed,
                           progress=progress, log=log)
            with open(record_path, "w") as f:  # before the member: a member on disk always has its record
                json.dump(record, f, indent=1)
            save_ssm(ssm, final)
        # The member as it is on disk (float16, stacked layers) in every run: the next member starts from it
        # and the boosting mask comes from it, so a run resumed between members continues exactly as one
        # that never stopped (the in-memory float32 weights differed, and its checkpoints' layout did).
        ssm = load_model(final, progress=False, split_layers=False)
        history, train_config = _training_record(os.path.join(out_dir, "train", member.name),
                                                 dataclasses.replace(tc, seed=tc.seed + i))
        acc = evaluate(ssm.params, ssm.config, eval_examples)
        acc_missed = evaluate(ssm.params, ssm.config, missed)
        predicted = predicted_mask(ssm.params, ssm.config, examples) & (examples.weights > 0)
        newly = int((predicted & active).sum())
        summary = {"name": member.name, "layers": list(member.layers), "mlp_size": ssm.config.intermediate_size,
                   "draft_vocab_size": len(ssm.config.draft_vocab), "params": param_count(ssm),
                   "trained_on_tokens": int(active.sum()), "boost_weight": boost_weight if i else None,
                   "newly_predicted_tokens": newly,
                   "eval_top_k": {f"top{k + 1}": float(acc[k]) for k in range(EVAL_TOP_K)},
                   # held-out positions every earlier member misses: what this member adds to the pool
                   "eval_top_k_missed_by_earlier": {f"top{k + 1}": float(acc_missed[k]) for k in range(EVAL_TOP_K)},
                   "train_config": train_config,
                   "seconds_this_run": round(time.perf_counter() - started, 1), "history": history}
        active &= ~predicted
        held_active &= ~predicted_mask(ssm.params, ssm.config, eval_examples)
        log(f"member {member.name}: held-out top-1 {acc[0]:.3f} top-5 {acc[-1]:.3f} (top-1 {acc_missed[0]:.3f} where "
            f"earlier members miss); {newly} more tokens predicted, {int(active.sum())} left for the next member")
        summaries.append(summary)
        previous = ssm
    with open(os.path.join(out_dir, "boost_summary.json"), "w") as f:
        json.dump({"corpus": os.path.abspath(corpus_dir), "members": summaries}, f, indent=1)
    return summaries


def _training_record(train_dir: str, tc: TrainConfig) -> tuple[list, dict]:
    """(evaluation history, training recipe) of a member: what its run directory recorded (a member
    trained by an earlier run reports the recipe it was trained with, not this run's)."""
    history, train_config = [], dataclasses.asdict(tc)
    if os.path.exists(os.path.join(train_dir, "history.json")):
        with open(os.path.join(train_dir, "history.json")) as f:
            history = json.load(f)
    if os.path.exists(os.path.join(train_dir, "recipe.json")):
        with open(os.path.join(train_dir, "recipe.json")) as f:
            train_config = json.load(f)["train"]
    return history, train_config

"""Distilling an SSM from the LLM's continuations (optax), with resumable orbax checkpoints.

Examples are the corpus sequences, right-padded; position p is trained to predict token p + 1 of
the continuation (prompt tokens are context only). ``weights`` lets boosting drop the positions an
earlier SSM already predicts. Losses: ``tokens`` = cross-entropy on the LLM's own tokens (greedy
and sampled continuations: for sampled ones this is an unbiased estimate of KL(LLM || SSM));
``kl`` = KL against the LLM's top-k distribution: precomputed once per corpus (``Examples.with_teacher``,
``boost.cached_teacher_targets``) or, without that, recomputed per batch by the LLM (an LLM pass
per step: several times slower on a CPU).
The batch order is a pure function of (seed, epoch), so a resumed run takes the same steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention.meta import causal_meta
from specjax.boost.runfiles import differences, read_run_json
from specjax.boost.teacher import top_k_logprobs
from specjax.decoding.incremental import full_logits
from specjax.errors import CheckpointError, InputError
from specjax.models import llama
from specjax.models.cache import init_cache
from specjax.types import Model

WIDTH_MULTIPLE = 32  # batches are padded to a multiple of this: few shapes, few compiles
EVAL_TOP_K = 5


def _padded_width(length: int) -> int:
    return -(-int(length) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: float = 2.0
    batch_size: int = 16
    learning_rate: float = 3e-4
    warmup_steps: int = 20
    loss: str = "tokens"  # "tokens" | "kl"
    teacher_top_k: int = 16
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 50

    def __post_init__(self):
        if self.loss not in ("tokens", "kl"):
            raise InputError(f"loss must be 'tokens' or 'kl', got {self.loss!r}")
        if not math.isfinite(self.epochs) or self.epochs <= 0 or self.batch_size < 1 \
                or not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise InputError(f"epochs, batch_size and learning_rate must be positive, got {self}")
        if self.warmup_steps < 0 or self.teacher_top_k < 1 or self.eval_every < 1 or self.checkpoint_every < 1:
            raise InputError(f"warmup_steps must be >= 0 and teacher_top_k, eval_every, checkpoint_every >= 1, "
                             f"got {self}")


@dataclasses.dataclass
class Examples:
    """Padded training examples. tokens/targets [N, W] int32 (targets = next LLM token, -1 at padding);
    weights [N, W] float32 (1 at continuation positions, 0 at prompt and padding); teacher: None or
    the LLM's top-k (ids [N, W, k] int32, log-probabilities [N, W, k] float32) at every position."""

    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    lengths: np.ndarray
    teacher: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def build(cls, sequences) -> Examples:
        if not sequences:
            raise InputError("no training sequences")
        width = _padded_width(max(len(s) for s, _ in sequences))
        n = len(sequences)
        tokens = np.zeros((n, width), np.int32)
        targets = np.full((n, width), -1, np.int32)
        weights = np.zeros((n, width), np.float32)
        for i, (ids, prompt_len) in enumerate(sequences):
            if not 1 <= prompt_len <= len(ids):
                raise InputError(f"sequence {i}: prompt length {prompt_len} outside [1, {len(ids)}]")
            tokens[i, :len(ids)] = ids
            targets[i, :len(ids) - 1] = ids[1:]
            weights[i, prompt_len - 1:len(ids) - 1] = 1.0
        return cls(tokens, targets, weights, np.array([len(s) for s, _ in sequences], np.int32))

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, index: np.ndarray) -> tuple[np.ndarray, ...]:
        width = _padded_width(self.lengths[index].max())
        return self.tokens[index, :width], self.targets[index, :width], self.weights[index, :width]

    def teacher_batch(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        width = _padded_width(self.lengths[index].max())
        return self.teacher[0][index, :width], self.teacher[1][index, :width]

    def with_teacher(self, sequences, targets) -> Examples:
        """These examples (built from ``sequences``) with the LLM's top-k per continuation position,
        ``targets`` as ``boost.teacher_targets`` returns them for the same sequences, in order."""
        if len(targets) != len(self) or len(sequences) != len(self):
            raise InputError(f"teacher targets for {len(targets)} sequences, examples have {len(self)}")
        k = targets[0][0].shape[-1]
        # outside the continuation: a uniform, finite teacher (weight 0 there; -inf would make NaN * 0)
        ids = np.zeros(self.tokens.shape + (k,), np.int32)
        logp = np.zeros(self.tokens.shape + (k,), np.float32)
        for i, ((seq, prompt_len), (t_ids, t_logp)) in enumerate(zip(sequences, targets)):
            if t_ids.shape != (len(seq) - prompt_len, k):
                raise InputError(f"sequence {i}: teacher targets of shape {t_ids.shape}, expected "
                                 f"{(len(seq) - prompt_len, k)} (one row per continuation token)")
            ids[i, prompt_len - 1:len(seq) - 1] = t_ids
            logp[i, prompt_len - 1:len(seq) - 1] = t_logp
        return dataclasses.replace(self, teacher=(ids, logp))


def batches_per_epoch(num_examples: int, batch_size: int) -> int:
    """How many batches ``epoch_batches`` yields for this many examples (partial batches dropped)."""
    chunk = 8 * batch_size
    return sum(min(chunk, num_examples - start) // batch_size
               for start in range(0, num_examples - batch_size + 1, chunk))


def total_steps(num_examples: int, tc: "TrainConfig") -> int:
    return math.ceil(tc.epochs * batches_per_epoch(num_examples, tc.batch_size))


def epoch_batches(examples: Examples, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Shuffled batches with similar lengths together (sorted within chunks of 8 batches), in a
    shuffled order: deterministic in (seed, epoch). The last partial batch is dropped."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(examples))
    chunk = 8 * batch_size
    batches = []
    for start in range(0, len(order) - batch_size + 1, chunk):
        part = order[start:start + chunk]
        part = part[np.argsort(examples.lengths[part], kind="stable")]
        batches += [part[i:i + batch_size] for i in range(0, len(part) - batch_size + 1, batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def _row_logits(params, cfg, tokens):
    batch, width = tokens.shape
    cache = init_cache(cfg, batch, width, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    out = llama.forward(params, tokens, positions, cache,
                        causal_meta(jnp.zeros((batch,), jnp.int32), empty_prefix=True), cfg, row_logits=True)
    return out.logits  # [B, W, rows]: the draft vocabulary, then "other"


def _rows(cfg, ids):
    return jnp.asarray(llama.draft_rows(cfg))[jnp.maximum(ids, 0)]


def loss_fn(params, cfg, tokens, targets, weights, teacher=None):
    logp = jax.nn.log_softmax(_row_logits(params, cfg, tokens), axis=-1)
    if teacher is None:
        nll = -jnp.take_along_axis(logp, _rows(cfg, targets)[..., None], axis=-1)[..., 0]
    else:  # KL(teacher top-k, renormalised || SSM) up to the teacher's entropy
        ids, teacher_logp = teacher
        p = jax.nn.softmax(teacher_logp, axis=-1)
        nll = -jnp.sum(p * jnp.take_along_axis(logp, _rows(cfg, ids), axis=-1), axis=-1)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


@functools.partial(jax.jit, static_argnums=1)
def topk_hits(params, cfg, tokens, targets):
    """[B, W, EVAL_TOP_K] bool: is the LLM's token among the SSM's top-k proposals (the "other" row
    can never be proposed), for k = 1..EVAL_TOP_K."""
    logits = _row_logits(params, cfg, tokens)[..., :-1]
    top = jax.lax.top_k(logits, EVAL_TOP_K)[1]
    hit = top == _rows(cfg, targets)[..., None]
    return jnp.cumsum(hit, axis=-1) > 0


def make_optimizer(tc: TrainConfig, total_steps: int):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, min(tc.warmup_steps, total_steps),
                                                  max(total_steps, 1), end_value=tc.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


def _hits_in_order(params, cfg, examples: Examples, batch_size: int):
    """(example indices, hits [b, w, EVAL_TOP_K], weights [b, w]) batch by batch, in example order."""
    for start in range(0, len(examples), batch_size):
        index = np.arange(start, min(start + batch_size, len(examples)))
        tokens, targets, weights = examples.batch(index)
        yield index, np.asarray(topk_hits(params, cfg, tokens, targets)), weights


def evaluate(params, cfg, examples: Examples, batch_size: int = 16) -> np.ndarray:
    """Weighted top-k agreement [EVAL_TOP_K] on ``examples`` (teacher forcing)."""
    hits, total = np.zeros((EVAL_TOP_K,)), 0.0
    for _, h, weights in _hits_in_order(params, cfg, examples, batch_size):
        hits += (h * weights[..., None]).sum((0, 1))
        total += weights.sum()
    return hits / max(total, 1.0)


def predicted_mask(params, cfg, examples: Examples, batch_size: int = 16) -> np.ndarray:
    """[N, W] bool: positions where the SSM's top-1 proposal is the LLM's token (boosting drops them)."""
    out = np.zeros(examples.tokens.shape, bool)
    for index, h, _ in _hits_in_order(params, cfg, examples, batch_size):
        out[index, :h.shape[1]] = h[..., 0]
    return out


def train(student: Model, examples: Examples, tc: TrainConfig, checkpoint_dir: str, *, llm: Model | None = None,
          eval_examples: Examples | None = None, progress: bool = True, log=print,
          stop_after: int | None = None) -> tuple[Model, list[dict]]:
    """Train ``student`` on ``examples``; resumes from the newest checkpoint in ``checkpoint_dir``.
    Returns the trained model and the evaluation history [{step, top1, ..., loss}].
    ``stop_after``: return after this many steps of this call (a later call resumes)."""
    import optax  # the train extra: only training needs the optimiser
    from tqdm import tqdm

    cfg = student.config
    precomputed = examples.teacher is not None
    per_epoch, total = _check_training(student, examples, tc, llm)
    opt = make_optimizer(tc, total)
    params = jax.tree.map(jnp.asarray, student.params)
    opt_state = opt.init(params)
    recipe = {"train": dataclasses.asdict(tc), "examples": len(examples), "weighted": float(examples.weights.sum()),
              "config": cfg.to_dict()}
    if tc.loss == "kl":  # the same loss either way, but not the same float rounding: do not mix on resume
        recipe["teacher"] = "precomputed" if precomputed else "llm per batch"
    run = RunDir(checkpoint_dir, recipe)
    step, params, opt_state, history = run.resume(params, opt_state)
    if step:
        log(f"resumed {checkpoint_dir} at step {step}/{total}")

    teacher_fn = None
    if tc.loss == "kl" and not precomputed:
        # The LLM's weights are an argument, not captured: a jitted closure bakes them into the program
        # as constants, which XLA folds slowly (a test's SmolLM2 decode step compiled for 130 s that way).
        teacher_jit = jax.jit(lambda weights, tokens: top_k_logprobs(full_logits(weights, tokens, cfg=llm.config),
                                                                     tc.teacher_top_k))
        teacher_fn = functools.partial(teacher_jit, llm.params)

    @jax.jit
    def train_step(params, opt_state, tokens, targets, weights, teacher):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, tokens, targets, weights, teacher)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run_eval(step, loss):
        if eval_examples is None:
            return
        acc = evaluate(params, cfg, eval_examples, tc.batch_size)
        history.append({"step": step, "loss": loss, **{f"top{k + 1}": float(acc[k]) for k in range(EVAL_TOP_K)}})
        bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}", top1=f"{acc[0]:.3f}")

    bar = tqdm(total=total, initial=step, desc=f"distill {cfg.num_layers}-layer SSM", disable=not progress)
    if step == 0:
        run_eval(0, None)  # the starting point (no loss yet)
    end = total if stop_after is None else min(total, step + stop_after)
    order = (None, None)  # (epoch, its batches)
    while step < end:
        epoch, index = divmod(step, per_epoch)
        if order[0] != epoch:
            order = (epoch, epoch_batches(examples, tc.batch_size, tc.seed, epoch))
        tokens, targets, weights = examples.batch(order[1][index])
        teacher = None
        if tc.loss == "kl":
            teacher = examples.teacher_batch(order[1][index]) if precomputed else teacher_fn(jnp.asarray(tokens))
        params, opt_state, loss_value = train_step(params, opt_state, tokens, targets, weights, teacher)
        step += 1
        loss = float(loss_value)
        if not math.isfinite(loss):
            raise InputError(f"training diverged at step {step}: loss {loss}; lower the learning rate")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % tc.eval_every == 0 or step == total:
            run_eval(step, loss)
        if step % tc.checkpoint_every == 0 or step == end:
            run.save(step, params, opt_state, history)
    bar.close()
    run.close()
    return student._replace(params=params), history


def _check_training(student: Model, examples: Examples, tc: TrainConfig, llm: Model | None) -> tuple[int, int]:
    """(batches per epoch, total steps), refusing a run that cannot train before any work."""
    if student.config.draft_vocab is None:
        raise InputError("train() needs a student with a draft vocabulary (specjax.boost.student.make_student)")
    precomputed = examples.teacher is not None
    if tc.loss == "kl" and not precomputed and llm is None:
        raise InputError("loss='kl' needs a teacher: examples.with_teacher(...) or the LLM passed as llm=")
    if tc.loss == "kl" and precomputed and examples.teacher[0].shape[-1] != tc.teacher_top_k:
        raise InputError(f"precomputed teacher has top-{examples.teacher[0].shape[-1]}, "
                         f"TrainConfig.teacher_top_k is {tc.teacher_top_k}")
    per_epoch = batches_per_epoch(len(examples), tc.batch_size)
    if per_epoch == 0:
        raise InputError(f"{len(examples)} examples make no batch of {tc.batch_size}")
    total = math.ceil(tc.epochs * per_epoch)
    if total <= tc.warmup_steps:
        raise InputError(f"{len(examples)} examples at batch size {tc.batch_size} for {tc.epochs:g} epochs give "
                         f"{total} steps, not more than the {tc.warmup_steps} warm-up steps; train longer or on more "
                         f"data")
    return per_epoch, total


class RunDir:
    """A training run's directory: the recipe guard (resuming with another recipe is an error), orbax
    checkpoints of params + optimiser state (the newest two kept), and the evaluation history."""

    def __init__(self, directory: str, recipe: dict):
        import orbax.checkpoint as ocp  # checkpoints are written only by training runs

        self.ocp = ocp
        os.makedirs(directory, exist_ok=True)
        recipe_path = os.path.join(directory, "recipe.json")
        if os.path.exists(recipe_path):
            held = read_run_json(recipe_path, "remove the run directory to start afresh")
            changed = differences(held, json.loads(json.dumps(recipe))) if isinstance(held, dict) else ["all"]
            if changed:
                raise InputError(f"{directory}: holds a run with another recipe ({'; '.join(changed[:6])}); use a "
                                 f"fresh directory, or this run's settings")
        else:
            with open(recipe_path, "w") as f:
                json.dump(recipe, f)
        # absolute: orbax's OCDBT writer refuses a relative path (at the first save, after training began)
        self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(directory, "steps")),
                                             options=ocp.CheckpointManagerOptions(max_to_keep=2))
        self.history_path = os.path.join(directory, "history.json")

    def resume(self, params, opt_state):
        """(step, params, optimiser state, history) of the newest checkpoint, or the inputs at step 0."""
        step = self.manager.latest_step()
        if step is None:
            return 0, params, opt_state, []
        try:
            state = self.manager.restore(step, args=self.ocp.args.StandardRestore({"params": params,
                                                                                    "opt_state": opt_state}))
        except Exception as e:  # orbax's own errors name an OCDBT key or "args of type Composite"
            steps = os.path.join(os.path.dirname(self.history_path), "steps")
            raise CheckpointError(f"{steps}/{step}: the newest checkpoint cannot be restored ({type(e).__name__}: "
                                  f"{str(e)[:200]}); remove {steps}/{step} to resume from the one before it "
                                  f"({sorted(self.manager.all_steps())[:-1] or 'none: a fresh start'})") from None
        history = []
        if os.path.exists(self.history_path):
            history = [r for r in read_run_json(self.history_path, "remove it (the evaluations so far are lost)")
                       if r["step"] <= step]
        return step, state["params"], state["opt_state"], history

    def save(self, step: int, params, opt_state, history: list) -> None:
        self.manager.save(step, args=self.ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                          force=True)
        self.manager.wait_until_finished()
        self.write_history(history)

    def write_history(self, history: list) -> None:
        """The evaluations so far, also between checkpoints: a run stopped from outside (a watchdog) before
        its first checkpoint still leaves its baseline. ``resume`` keeps only rows up to the checkpoint."""
        with open(self.history_path + ".tmp", "w") as f:
            json.dump(history, f)
        os.replace(self.history_path + ".tmp", self.history_path)

    def close(self) -> None:
        self.manager.close()

"""Training the feature drafter with unrolled multi-step drafting ("training-time test").

A drafter fed its own features drifts: deep in a draft it reads f (its prediction) where training
showed it g (the LLM's feature). So every batch runs the drafter the way it drafts, several steps:

* step 1: every position p reads the true pair (token_p, g_{p-1}), causally over the sequence;
* step k > 1: position p reads (token_p, f^{k-1}_{p-1}), its own step k-1 output one position back,
  and attends to the true pairs up to p - k + 1 (the committed text of a draft rooted there) plus the
  step-2..k pairs on its own draft path (positions p - k + 2 .. p): exactly the tree attention the
  drafter sees at depth k - 1 below a root (``specjax.speculation.drafters.feature``).

Step k at position p predicts token p + 1: the loss is the cross-entropy against the LLM's
distribution over the draft vocabulary (softmax of g_p through the head) plus a smooth-L1 regression
of f^k_p on g_p, weighted ``step_decay ** (k - 1)``; uniform noise on the true input features makes
step 1 robust to imperfect features. Sequences are left-padded so every continuation ends at the last
column: steps k > 1 and the loss run only on the last ``window`` columns (the continuation and a few
positions before it), the true pairs of step 1 on all columns (they are the keys every step reads).

Held-out agreement by depth (``depth_agreement``) is the same unrolled computation without noise: the
share of positions where the drafter's top-1 at step k is the LLM's own greedy next token (greedy
continuations), i.e. the acceptance of depth k given the draft so far was right, features its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.boost.distill import RunDir, batches_per_epoch, epoch_batches, make_optimizer
from specjax.boost.feature_data import FeatureSet
from specjax.errors import InputError
from specjax.models.common import project_qkv, rms_norm, rope_inv_freq
from specjax.models.feature import FeatureConfig, fuse_features, logits_of, output_features, pair_inputs
from specjax.models.llama import mlp

WIDTH_MULTIPLE = 64
_now = time.monotonic  # the deadline's clock (a test steps it)


@dataclasses.dataclass(frozen=True)
class FeatureTrainConfig:
    epochs: float = 1.0
    batch_size: int = 8
    learning_rate: float = 5e-4
    warmup_steps: int = 50
    unrolled_steps: int = 4  # drafting steps run per batch (training-time test)
    step_decay: float = 0.8  # weight of step k: step_decay ** (k - 1)
    reg_weight: float = 0.5  # smooth-L1 feature regression, beside the distribution loss
    noise: float = 0.1  # uniform noise amplitude on the true input features (post-norm scale)
    window: int = 176  # right-most columns (the continuation) that steps > 1 and the loss cover
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 50

    def __post_init__(self):
        if not math.isfinite(self.epochs) or self.epochs <= 0 or self.batch_size < 1 \
                or not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise InputError(f"epochs, batch_size and learning_rate must be positive, got {self}")
        if self.unrolled_steps < 1 or self.window <= self.unrolled_steps or self.warmup_steps < 0 \
                or self.eval_every < 1 or self.checkpoint_every < 1:
            raise InputError(f"unrolled_steps >= 1, window > unrolled_steps, warmup_steps >= 0, eval_every and "
                             f"checkpoint_every >= 1 required, got {self}")
        if not (0 < self.step_decay <= 1 and math.isfinite(self.reg_weight) and self.reg_weight >= 0
                and self.noise >= 0):
            raise InputError(f"step_decay in (0, 1], a finite reg_weight >= 0 and noise >= 0 required, got {self}")


def batch_width(longest: int, window: int, width_multiple: int = WIDTH_MULTIPLE) -> int:
    """The columns of a training batch whose longest sequence has ``longest`` tokens (``make_batch``)."""
    width = max(-(-longest // width_multiple) * width_multiple, window + WIDTH_MULTIPLE)
    if width_multiple > WIDTH_MULTIPLE:  # the minimum rounded too: one shape for all short batches
        width = -(-width // width_multiple) * width_multiple
    return width


def make_batch(data: FeatureSet, index: np.ndarray, window: int,
               width_multiple: int = WIDTH_MULTIPLE) -> dict[str, np.ndarray]:
    """Left-padded arrays of sequences ``index``: every sequence ends at the last column; the width is a
    multiple of ``width_multiple`` (fewer shapes to compile; larger on a GPU, where compiles cost more).

    tokens/positions/top [B, W] int32 (top: the LLM's greedy next token after each position, -1 where
    unknown: ``FeatureSet.greedy``), features
    [B, W, D] float32 (0 at padding), start [B] (first real column), loss [B, W] float32 (1 where the
    next token is a continuation token)."""
    width = batch_width(int(data.lengths[index].max()), window, width_multiple)
    batch, dim = len(index), data.features.shape[1]
    tokens = np.zeros((batch, width), np.int32)
    top = np.full((batch, width), -1, np.int32)
    positions = np.zeros((batch, width), np.int32)
    feats = np.zeros((batch, width, dim), np.float32)
    inputs = None if data.inputs is None else np.zeros((batch, width) + data.inputs.shape[1:], np.float32)
    loss = np.zeros((batch, width), np.float32)
    start = np.zeros((batch,), np.int32)
    for row, i in enumerate(index):
        ids, f, t, prompt_len = data.sequence(int(i))
        s = width - len(ids)
        if len(ids) - prompt_len + 1 > window:
            raise InputError(f"sequence {i}: a continuation of {len(ids) - prompt_len} tokens does not fit the "
                             f"training window of {window} columns")
        tokens[row, s:], top[row, s:], feats[row, s:] = ids, t, f
        if inputs is not None:
            inputs[row, s:] = data.sequence_inputs(int(i))
        positions[row, s:] = np.arange(len(ids))
        loss[row, s + prompt_len - 1:width - 1] = 1.0  # position p predicts token p + 1
        start[row] = s
    out = {"tokens": tokens, "positions": positions, "features": feats, "top": top, "loss": loss, "start": start}
    return out if inputs is None else {**out, "inputs": inputs}


def _block(lp, x, positions, attention, cfg, inv_freq):
    """The drafter's layer with a given attention (q, k, v) -> [B, T, H, Dh]; returns (out, k, v)."""
    h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
    q, k, v = project_qkv(h, lp, positions, inv_freq, cfg.attention_bias, cfg.num_heads)
    a = jnp.einsum("bthk,hkd->btd", attention(q, k, v), lp["wo"])
    x = x + (a + lp["bo"] if cfg.attention_bias else a)
    return x + mlp(rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp, cfg), k, v


def _blocks(lps, x, positions, attention_of, cfg, inv_freq):
    """The drafter's layers in turn, layer i with attention ``attention_of(i)``; returns (out, [k], [v])."""
    ks, vs = [], []
    for i, lp in enumerate(lps):
        x, k, v = _block(lp, x, positions, attention_of(i), cfg, inv_freq)
        ks.append(k)
        vs.append(v)
    return x, ks, vs


def _attend(q, main_k, main_v, main_mask, diag):
    """Softmax attention of q [B, Q, H, Dh] over main keys [B, J, KVH, Dh] (mask [B, Q, J]) plus, per
    query, extra keys ``diag`` [(k [B, Q, KVH, Dh], v, ok [B, Q])] (its own draft path)."""
    batch, nq, heads, dh = q.shape
    kvh = main_k.shape[2]
    qg = q.reshape(batch, nq, kvh, heads // kvh, dh) * dh ** -0.5
    scores = [jnp.where(main_mask[:, None, None], jnp.einsum("bqkgd,bjkd->bkgqj", qg, main_k), -jnp.inf)]
    for k, _, ok in diag:
        s = jnp.einsum("bqkgd,bqkd->bkgq", qg, k)[..., None]
        scores.append(jnp.where(ok[:, None, None, :, None], s, -jnp.inf))
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    j = main_k.shape[1]
    out = jnp.einsum("bkgqj,bjkd->bqkgd", p[..., :j], main_v)
    for n, (_, v, _) in enumerate(diag):
        out = out + jnp.einsum("bkgq,bqkd->bqkgd", p[..., j + n], v)
    return out.reshape(batch, nq, heads, dh)


def unrolled(params: dict, batch: dict, cfg: FeatureConfig, steps: int, window: int, noise_key=None,
             noise: float = 0.0) -> list[jax.Array]:
    """The drafter's features f^k [B, window, D] on the last ``window`` columns for k = 1..steps."""
    lcfg = cfg.layer_config
    inv = rope_inv_freq(lcfg)
    lps = [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(cfg.layers)]
    tokens, g, positions, start = batch["tokens"], batch["features"], batch["positions"], batch["start"]
    width = tokens.shape[1]
    w0 = width - window
    col = jnp.arange(width)
    real = col[None, :] >= start[:, None]  # [B, W]
    # step 1's true input features (a fusion's stored inputs are its raw layers; g is stored apart)
    first = fuse_features(params, batch["inputs"], g if cfg.reads_final else None, cfg) if cfg.fused else g
    first = jnp.where(real[..., None], first, 0.0)
    prev = jnp.pad(first, ((0, 0), (1, 0), (0, 0)))[:, :width]  # feature of p - 1; 0 before the first position
    if noise_key is not None and noise > 0:
        prev = prev + jax.random.uniform(noise_key, prev.shape, prev.dtype, -noise, noise) * real[..., None]
    # Step 1: true pairs, causal (a padding query sees itself only, so no row is empty).
    causal = (col[None, None, :] <= col[None, :, None]) & real[:, None, :] | (col[None, None, :] == col[None, :, None])
    f1, k1, v1 = _blocks(lps, pair_inputs(params, tokens, prev), positions,
                         lambda layer: lambda q, k, v: _attend(q, k, v, causal, []), lcfg, inv)
    f1 = output_features(params, f1, cfg)
    outs = [f1[:, w0:]]
    path = []  # per step 2..: per layer (k, v) on the window columns
    wcol = col[w0:]
    for step in range(2, steps + 1):
        prev_f = f1[:, w0 - 1:width - 1] if step == 2 else jnp.pad(outs[-1], ((0, 0), (1, 0), (0, 0)))[:, :window]
        # committed text of the draft rooted at p - step + 1
        main = (col[None, None, :] <= wcol[None, :, None] - (step - 1)) & real[:, None, :]

        def attention(layer, main=main, step=step):
            def attend(q, k, v):
                diag = []
                for i, kv in enumerate(path, start=2):  # step i's pair on this query's path: column c - (step - i)
                    shift = step - i
                    ok = jnp.broadcast_to(jnp.arange(window) >= shift, q.shape[:2])
                    diag.append((_shift(kv[0][layer], shift), _shift(kv[1][layer], shift), ok))
                diag.append((k, v, jnp.ones(q.shape[:2], bool)))  # itself
                return _attend(q, k1[layer], v1[layer], main, diag)
            return attend

        f, k, v = _blocks(lps, pair_inputs(params, tokens[:, w0:], prev_f), positions[:, w0:], attention, lcfg, inv)
        path.append((k, v))
        outs.append(output_features(params, f, cfg))
    return outs


def _shift(x, n: int):
    """x [B, T, ...] moved n columns right (zeros in front)."""
    return x if n == 0 else jnp.pad(x, ((0, 0), (n, 0)) + ((0, 0),) * (x.ndim - 2))[:, :x.shape[1]]


def _step_masks(batch: dict, steps: int, window: int):
    """Per step, [B, window] float32: positions with a loss whose step-k inputs all exist in the window."""
    loss = batch["loss"][:, -window:]
    return [loss * (jnp.arange(window) >= k - 1)[None, :] for k in range(1, steps + 1)]


def losses(trained: dict, frozen: dict, batch: dict, cfg: FeatureConfig, tc: FeatureTrainConfig, key):
    """(total loss, per-step [cross-entropy, regression, top-1 agreement]) of one batch."""
    params = {**frozen, **trained}
    feats = unrolled(params, batch, cfg, tc.unrolled_steps, tc.window, key, tc.noise)
    g = batch["features"][:, -tc.window:]
    p = jax.nn.softmax(jax.lax.stop_gradient(logits_of(params, g)), axis=-1)
    vocab = jnp.asarray(cfg.draft_vocab, jnp.int32)
    top = batch["top"][:, -tc.window:]
    total, stats = 0.0, []
    for k, (f, mask) in enumerate(zip(feats, _step_masks(batch, tc.unrolled_steps, tc.window))):
        logq = jax.nn.log_softmax(logits_of(params, f), axis=-1)
        ce = -jnp.sum(p * logq, axis=-1)
        diff = jnp.abs(f - g)
        reg = jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)
        n = jnp.maximum(jnp.sum(mask), 1.0)
        ce_k, reg_k = jnp.sum(ce * mask) / n, jnp.sum(reg * mask) / n
        known = mask * (top >= 0)
        agree = jnp.sum((vocab[jnp.argmax(logq, axis=-1)] == top) * known) / jnp.maximum(jnp.sum(known), 1.0)
        total = total + tc.step_decay ** k * (ce_k + tc.reg_weight * reg_k)
        stats.append(jnp.stack([ce_k, reg_k, agree]))
    return total, jnp.stack(stats)


def split_params(params: dict, cfg: FeatureConfig) -> tuple[dict, dict]:
    """(trained, frozen) halves of bound drafter params."""
    keys = cfg.trained_keys
    return {k: params[k] for k in keys}, {k: v for k, v in params.items() if k not in keys}


def depth_agreement(params: dict, data: FeatureSet, cfg: FeatureConfig, steps: int = 6, window: int = 176,
                    batch_size: int = 8, width_multiple: int = WIDTH_MULTIPLE, full_batches: bool = False) -> dict:
    """Held-out top-1 agreement with the LLM's greedy token at draft depths 1..steps (the drafter fed its
    own features, no noise; positions of greedy continuations), overall and per corpus part:
    {"all": [steps], part: [steps], "positions": n}. ``width_multiple`` as in ``make_batch``; with
    ``full_batches`` the last batch is padded to ``batch_size`` rows (repeats, not counted): one shape fewer
    to compile, where compiles cost more than the padding (a GPU)."""
    hits, counts = sequence_agreement(params, data, cfg, steps, window, batch_size, width_multiple, full_batches)
    return summarise_agreement(hits, counts, data.parts, data.part_names)


def sequence_agreement(params: dict, data: FeatureSet, cfg: FeatureConfig, steps: int = 6, window: int = 176,
                       batch_size: int = 8, width_multiple: int = WIDTH_MULTIPLE,
                       full_batches: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(hits, counts) [sequences, steps] of ``depth_agreement``, per sequence: one pass over a set gives
    the agreement of any subset of it (``summarise_agreement``)."""
    fn = _agreement_fn(cfg, steps, window)
    hits = np.zeros((len(data), steps))
    counts = np.zeros((len(data), steps))
    order = np.argsort(data.lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        rows = np.pad(index, (0, batch_size - len(index)), mode="edge") if full_batches else index
        batch = make_batch(data, rows, window, width_multiple)
        h, c = (np.asarray(a)[:len(index)] for a in fn(params, {k: jnp.asarray(v) for k, v in batch.items()}))
        hits[index], counts[index] = h, c
    return hits, counts


def summarise_agreement(hits: np.ndarray, counts: np.ndarray, parts: np.ndarray, part_names) -> dict:
    """``depth_agreement``'s summary of per-sequence (hits, counts) whose corpus parts are ``parts``."""
    by_part_hits = np.zeros((len(part_names), hits.shape[1]))
    by_part_counts = np.zeros((len(part_names), hits.shape[1]))
    np.add.at(by_part_hits, parts, hits)
    np.add.at(by_part_counts, parts, counts)
    out = {"all": (by_part_hits.sum(0) / np.maximum(by_part_counts.sum(0), 1)).tolist(),
           "positions": int(by_part_counts[:, 0].sum())}
    for i, name in enumerate(part_names):
        if by_part_counts[i, 0]:
            out[name] = (by_part_hits[i] / by_part_counts[i]).tolist()
    return out


@functools.lru_cache(maxsize=8)
def _agreement_fn(cfg: FeatureConfig, steps: int, window: int):
    vocab = jnp.asarray(cfg.draft_vocab, jnp.int32)

    @jax.jit
    def fn(params, batch):
        feats = unrolled(params, batch, cfg, steps, window)
        top = batch["top"][:, -window:]
        hits, counts = [], []
        for f, mask in zip(feats, _step_masks(batch, steps, window)):
            mask = mask * (top >= 0)  # positions whose greedy next token the corpus shows
            right = vocab[jnp.argmax(logits_of(params, f), axis=-1)] == top
            hits.append(jnp.sum(right * mask, axis=1))
            counts.append(jnp.sum(mask, axis=1))
        return jnp.stack(hits, 1), jnp.stack(counts, 1)  # [B, steps] per sequence

    return fn


def train_feature(params: dict, data: FeatureSet, cfg: FeatureConfig, tc: FeatureTrainConfig, run_dir: str, *,
                  held_out: FeatureSet | None = None, eval_prompts: FeatureSet | None = None, eval_steps: int = 6,
                  progress: bool = True, log=print, stop_after: int | None = None, deadline: float | None = None,
                  start: str | None = None, width_multiple: int = WIDTH_MULTIPLE,
                  full_batches: bool = False, teacher_dots: str = "float32") -> tuple[dict, list[dict]]:
    """Train the drafter (bound params: ``specjax.models.feature.bind``) on ``data``; resumes from the
    newest checkpoint in ``run_dir``. Returns (trained bound params, evaluation history). History rows:
    {step, loss, per-step ce/reg/agreement of the last batch, held-out agreement by depth, and the same
    on ``eval_prompts`` (continuations of prompts from outside the corpus's generator)}.
    ``stop_after``: return after this many steps of this call (a later call resumes); ``deadline``: a
    ``time.monotonic()`` time at which no further step starts (the step under way finishes and is
    checkpointed, so a later call resumes; evaluations count; the learning-rate schedule stays the
    planned one). ``start``: what
    names the starting weights when they are not the seed's initialisation (a continued drafter's
    digest): part of the run's recipe, so a run directory is not resumed from other weights.
    ``width_multiple`` and ``full_batches``: how batches are padded (``make_batch``, ``depth_agreement``).
    ``teacher_dots``: how ``data``'s features were computed (``feature_data.TEACHER_DOTS``), part of the recipe."""
    import optax
    from tqdm import tqdm

    per_epoch = batches_per_epoch(len(data), tc.batch_size)
    total = math.ceil(tc.epochs * per_epoch)
    if total <= tc.warmup_steps:
        raise InputError(f"{len(data)} sequences at batch size {tc.batch_size} for {tc.epochs:g} epochs give {total} "
                         f"steps, not more than the {tc.warmup_steps} warm-up steps")
    trained, frozen = split_params(params, cfg)
    opt = make_optimizer(tc, total)
    opt_state = opt.init(trained)
    vocab_id = hashlib.sha256(np.asarray(cfg.draft_vocab, np.int64).tobytes()).hexdigest()[:16]
    recipe = {"train": dataclasses.asdict(tc), "sequences": len(data), "tokens": int(data.lengths.sum()),
              "draft_vocab": [len(cfg.draft_vocab), vocab_id]}
    if start is not None:  # absent for a fresh start, so the recipes of earlier fresh runs still resume
        recipe["start"] = start
    if cfg.fused:  # likewise: a run of another fusion (or none) is another recipe
        recipe["fused"] = list(cfg.fused)
    if cfg.layers != 1:  # likewise: a drafter of another depth is another recipe
        recipe["layers"] = cfg.layers
    if teacher_dots != "float32":  # likewise: features from another teacher pass are other training data
        recipe["teacher_dots"] = teacher_dots
    run = RunDir(run_dir, recipe)
    step, trained, opt_state, history = run.resume(trained, opt_state)
    if step:
        log(f"resumed {run_dir} at step {step}/{total}")

    @jax.jit
    def train_step(trained, opt_state, frozen, batch, key):
        (loss, stats), grads = jax.value_and_grad(losses, has_aux=True)(trained, frozen, batch, cfg, tc, key)
        updates, opt_state = opt.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state, loss, stats

    def run_eval(step, loss, stats):
        row = {"step": step, "loss": loss}
        if stats is not None:
            row.update(ce=stats[:, 0].tolist(), reg=stats[:, 1].tolist(), batch_agreement=stats[:, 2].tolist())
        if held_out is not None:
            agreement = depth_agreement({**frozen, **trained}, held_out, cfg, eval_steps, tc.window, tc.batch_size,
                                        width_multiple, full_batches)
            row["held_out"] = agreement
            bar.set_postfix(d1=f"{agreement['all'][0]:.3f}", d2=f"{agreement['all'][1]:.3f}")
        if eval_prompts is not None:
            row["eval_prompts"] = depth_agreement({**frozen, **trained}, eval_prompts, cfg, eval_steps, tc.window,
                                                  tc.batch_size, width_multiple, full_batches)
        history.append(row)
        run.write_history(history)

    bar = tqdm(total=total, initial=step, desc="train feature drafter", disable=not progress)
    if step == 0:
        run_eval(0, None, None)
    end = total if stop_after is None else min(total, step + stop_after)
    order = (None, None)
    saved = step
    while step < end:
        if deadline is not None and _now() >= deadline:
            if step != saved:
                run.save(step, trained, opt_state, history)
            log(f"time budget spent at step {step}/{total}; running again resumes")
            break
        epoch, index = divmod(step, per_epoch)
        if order[0] != epoch:
            order = (epoch, epoch_batches(data, tc.batch_size, tc.seed, epoch))
        batch = {k: jnp.asarray(v) for k, v in make_batch(data, order[1][index], tc.window, width_multiple).items()}
        key = jax.random.fold_in(jax.random.key(tc.seed), step)
        trained, opt_state, loss_value, stats = train_step(trained, opt_state, frozen, batch, key)
        step += 1
        loss = float(loss_value)
        if not math.isfinite(loss):
            raise InputError(f"training diverged at step {step}: loss {loss}; lower the learning rate")
        stats = np.asarray(stats)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", a1=f"{stats[0, 2]:.2f}", a2=f"{stats[min(1, len(stats) - 1), 2]:.2f}")
        if step % tc.eval_every == 0 or step == total:
            run_eval(step, loss, stats)
        if step % tc.checkpoint_every == 0 or step == end:
            run.save(step, trained, opt_state, history)
            saved = step
    bar.close()
    run.close()
    return {**frozen, **trained}, history

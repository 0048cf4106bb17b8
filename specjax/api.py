"""Host-side API: load a model by name or path; generate from strings or token ids; score logits."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import registry
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InputError, SpecjaxError
from specjax.generate import full_logits, generate_incremental_jit
from specjax.sampling import SamplingArrays, SamplingParams

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Model(NamedTuple):
    """What ``load_model`` returns; unpacks as ``cfg, params, tokenizer = load_model(...)``."""

    config: ModelConfig
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None


def load_model(name_or_path: str = registry.DEFAULT_MODEL, dtype: str = "float32", shardings=None,
               progress: bool = True, parallel=None) -> Model:
    """Load a registered model name, an HF directory, a .gguf file or a specjax orbax checkpoint.

    parallel: a ``specjax.sharding.Parallel``; the params are placed on its mesh under its rules
    (a checkpoint restores straight into that sharding, whatever mesh it was saved from).
    ``shardings``: an explicit pytree (or function cfg -> pytree) of shardings instead."""
    from specjax import checkpoint, tokenizer as tok_lib
    from specjax.weights.gguf_loader import load_gguf
    from specjax.weights.hf import load_hf_dir

    if dtype not in _DTYPES:
        raise InputError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if parallel is not None and shardings is not None:
        raise InputError("pass either shardings or parallel, not both")
    path = registry.resolve(name_or_path) if registry.is_registered(name_or_path) else name_or_path
    if not os.path.exists(path):
        raise CheckpointError(f"{name_or_path!r} is neither a registered model {registry.registered_names()} "
                              f"nor an existing file or directory")
    if os.path.isdir(path) and checkpoint.is_checkpoint(path):
        cfg, params, tok_dir = checkpoint.restore_checkpoint(
            path, shardings=parallel.param_shardings if parallel is not None else shardings, dtype=dtype)
        tokenizer = tok_lib.load_dir_tokenizer(tok_dir) if tok_dir else None
        return Model(cfg, params, tokenizer)
    if os.path.isdir(path):
        cfg, np_params = load_hf_dir(path, progress=progress)
        tokenizer = tok_lib.load_dir_tokenizer(path)
    elif path.endswith(".gguf"):
        cfg, np_params = load_gguf(path, progress=progress)
        tokenizer = tok_lib.load_gguf_tokenizer(path)
    else:
        raise CheckpointError(f"{path}: unsupported model file (expected an HF directory, a .gguf file "
                              f"or a specjax checkpoint directory)")
    cast = lambda a: a.astype(_DTYPES[dtype])  # noqa: E731
    if parallel is not None:
        params = parallel.put_params(jax.tree.map(lambda a: np.asarray(a).astype(_DTYPES[dtype]), np_params), cfg)
    elif shardings is None:
        params = jax.tree.map(lambda a: cast(jnp.asarray(a)), np_params)
    else:
        shardings = shardings(cfg) if callable(shardings) else shardings
        params = jax.tree.map(lambda a, s: jax.device_put(cast(jnp.asarray(a)), s), np_params, shardings)
    return Model(cfg, params, tokenizer)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per prompt, prompt excluded
    texts: list[str | None]  # decoded text per prompt (None without a tokenizer)
    prompt_token_ids: list[list[int]]
    stats: dict  # llm_passes, generated_tokens, seconds, tokens_per_s, ...


def _next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def encode_prompts(model: Model, prompts, chat_template: bool = True) -> list[list[int]]:
    """Strings (chat template applied by default) or token-id lists -> list of token-id lists."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and all(isinstance(t, (int, np.integer)) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InputError("prompts must be a non-empty list of strings or of token-id lists")
    out = []
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise InputError(f"prompt {i} is a string but the model has no tokenizer; pass token ids")
            if chat_template and getattr(tok, "chat_template", None):
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
            else:
                ids = tok(p)["input_ids"]
        else:
            ids = list(p)
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab]
            if bad:
                raise InputError(f"prompt {i}: token id {bad[0]!r} is not an int in [0, {vocab})")
        if len(ids) == 0:
            raise InputError(f"prompt {i} is empty")
        out.append([int(t) for t in ids])
    return out


def _sampling_list(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    sampling = list(sampling)
    if len(sampling) != n or not all(isinstance(s, SamplingParams) for s in sampling):
        raise InputError(f"sampling must be a SamplingParams or a list of {n} of them")
    return sampling


def _eos_ids(model: Model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))


MODES = ("incremental", "sequence", "tree")
MAX_TREE_NODES = 64
DEFAULT_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)  # the paper's default expansion configuration


def _check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def _prepare(model: Model, prompts, max_new_tokens: int, chat_template: bool):
    """Validate and tokenise; returns (ids, lengths [B], prompts right-padded to a pow2 bucket [B, W])."""
    _check_max_new_tokens(max_new_tokens)
    ids = encode_prompts(model, prompts, chat_template)
    limit = model.config.max_positions
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise InputError(f"prompt {i}: {len(p)} prompt tokens + max_new_tokens={max_new_tokens} = "
                             f"{len(p) + max_new_tokens} exceeds the context window of {limit}")
    lens = np.array([len(p) for p in ids], np.int32)
    padded = np.zeros((len(ids), _next_pow2(int(lens.max()))), np.int32)
    for i, p in enumerate(ids):
        padded[i, :len(p)] = p
    return ids, lens, padded


def generate(model: Model, prompts, max_new_tokens: int = 128, sampling=None, chat_template: bool = True,
             ignore_eos: bool = False, mode: str | None = None, ssms=(), expansion=None,
             impl: str = "auto", verifier: str = "auto", draft: str = "auto", parallel=None) -> GenerationResult:
    """Generate for a batch of prompts (strings or token-id lists).

    mode: "incremental" (the reference decoder), "sequence" (one SSM drafts a chain of
    ``len(expansion)`` tokens) or "tree" (expansion-based with one SSM, merge-based with several).
    Default: "tree" when SSMs are given, else "incremental". ssms: Models sharing the LLM's
    tokenizer. expansion: widths <k1, ..., km> (default <1,1,3,1,1,1,1,1>), or one per SSM.
    sampling: None (greedy), a SamplingParams for all prompts, or one per prompt (each carries its
    seed; a request's tokens depend only on its own seed and positions, not on its batch slot).
    verifier (speculative modes): "auto" = greedy for greedy requests, else "seeded" (the output
    equals incremental sampling with the same seed, token for token); "mss", "rrs", "naive" sample
    with the exact target distribution but other random numbers. draft: how SSMs draw children,
    "auto" = the verifier's natural drafting ("topk", "coupled", "iid" for mss, "wor" for rrs).
    A (draft, verifier) pair that would not be lossless is refused with an InputError.
    parallel: a ``specjax.sharding.Parallel`` to run on its mesh (LLM under its rules, pipelined
    when pp > 1; SSMs under its ssm_rules). The batch is padded with inert requests to a multiple of
    dp x microbatches; the output is the same as on one device.
    """
    mode = mode or ("tree" if ssms else "incremental")
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "incremental":
        return _generate_speculative(model, prompts, max_new_tokens, sampling, chat_template, ignore_eos, mode,
                                     list(ssms), expansion, impl, verifier, draft, parallel)
    ids, lens, padded = _prepare(model, prompts, max_new_tokens, chat_template)
    cfg = model.config
    samplings = _sampling_list(sampling, len(ids))
    width = padded.shape[1]
    max_out = _next_pow2(max_new_tokens)
    cache_len = width + max_out  # a function of the two buckets only, so it never forces a recompile
    params, _, inputs, host = _place(parallel, model, (), padded, lens, max_new_tokens, samplings)
    t0 = time.perf_counter()
    out = generate_incremental_jit(params, *inputs, cfg=cfg, cache_len=cache_len, max_out=max_out,
                                   eos_ids=() if ignore_eos else _eos_ids(model), parallel=parallel)
    tokens = host(out.tokens)
    seconds = time.perf_counter() - t0
    counts = host(out.num_generated)[:len(ids)]
    token_ids = [tokens[i, :counts[i]].tolist() for i in range(len(ids))]
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in token_ids]
    total = int(counts.sum())
    stats = {"mode": "incremental", "llm_passes": int(host(out.llm_passes)), "generated_tokens": total,
             "seconds": seconds,
             "tokens_per_s": total / seconds if seconds > 0 else float("inf"),
             "prompt_bucket": width, "cache_len": cache_len}
    return GenerationResult(token_ids=token_ids, texts=texts, prompt_token_ids=ids, stats=stats)


def _place(parallel, model: Model, ssms, padded, lens, max_new_tokens: int, samplings):
    """(LLM params, SSM params, per-request inputs, fetch-to-host function), on the mesh when given.

    On a mesh the batch is padded with inert copies of request 0 (budget of 1 token, dropped from the
    results) to a multiple of dp x microbatches, so any batch size runs."""
    n = len(lens)
    if parallel is None:
        inputs = (jnp.asarray(padded), jnp.asarray(lens), jnp.full((n,), max_new_tokens, jnp.int32),
                  SamplingArrays.from_params(samplings))
        return model.params, tuple(s.params for s in ssms), inputs, lambda x: np.asarray(jax.device_get(x))
    extra = (-n) % parallel.batch_multiple()
    padded = np.concatenate([padded, np.repeat(padded[:1], extra, axis=0)])
    lens = np.concatenate([lens, np.repeat(lens[:1], extra)]).astype(np.int32)
    budget = np.array([max_new_tokens] * n + [1] * extra, np.int32)
    parallel.validate(model.config, n + extra, [s.config for s in ssms])
    params = parallel.put_params(model.params, model.config)
    ssm_params = tuple(parallel.put_params(s.params, s.config, parallel.ssm_rules) for s in ssms)
    sampling = SamplingArrays.from_params(list(samplings) + [samplings[0]] * extra)
    inputs = parallel.put_batch((padded, lens, budget, sampling))
    return params, ssm_params, inputs, parallel.fetch


def logits(model: Model, token_ids) -> list[np.ndarray]:
    """Full-sequence logits for each token-id list: a list of float32 [len, V] arrays."""
    ids = encode_prompts(model, token_ids, chat_template=False)
    for i, p in enumerate(ids):
        if len(p) > model.config.max_positions:
            raise InputError(f"sequence {i} has {len(p)} tokens, beyond the context window "
                             f"{model.config.max_positions}")
    width = _next_pow2(max(len(p) for p in ids))
    padded = np.zeros((len(ids), width), np.int32)
    for i, p in enumerate(ids):
        padded[i, :len(p)] = p
    out = np.asarray(full_logits(model.params, jnp.asarray(padded), cfg=model.config))
    return [out[i, :len(p)] for i, p in enumerate(ids)]


def _expansions(mode: str, expansion, n_ssms: int):
    from specjax.speculate import Expansion

    if expansion is None:
        expansion = (1,) * 8 if mode == "sequence" else DEFAULT_EXPANSION
    if isinstance(expansion, str):
        expansion = Expansion.parse(expansion).widths
    per_ssm = (list(expansion) if expansion and isinstance(expansion[0], (tuple, list, Expansion))
               else [expansion] * n_ssms)
    if len(per_ssm) != n_ssms:
        raise InputError(f"{len(per_ssm)} expansion configs for {n_ssms} SSMs")
    exps = [e if isinstance(e, Expansion) else Expansion(tuple(e)) for e in per_ssm]
    if mode == "sequence" and any(set(e.widths) != {1} for e in exps):
        raise InputError(f"mode 'sequence' drafts a chain: widths must all be 1, got {[e.widths for e in exps]}")
    return exps


VERIFIER_CHOICES = ("auto", "greedy", "seeded", "mss", "rrs", "naive")
DRAFT_CHOICES = ("auto", "topk", "iid", "wor", "coupled")


def resolve_verifier(verifier: str, draft: str, sampled: bool) -> tuple[str, str]:
    """(verifier, draft) after resolving "auto"; lossy pairs are refused later by SpecConfig."""
    from specjax.speculative import DEFAULT_DRAFT

    if verifier not in VERIFIER_CHOICES:
        raise InputError(f"verifier must be one of {VERIFIER_CHOICES}, got {verifier!r}")
    if draft not in DRAFT_CHOICES:
        raise InputError(f"draft must be one of {DRAFT_CHOICES}, got {draft!r}")
    if verifier == "greedy" and sampled:
        raise InputError("verifier 'greedy' decodes greedily but a request has temperature > 0; use "
                         "verifier 'auto', 'seeded', 'mss', 'rrs' or 'naive' to sample")
    if verifier == "auto":
        if not sampled:
            verifier = "greedy" if draft in ("auto", "topk") else "seeded"
        else:
            verifier = {"iid": "mss", "wor": "rrs"}.get(draft, "seeded")
    if draft == "auto":
        draft = DEFAULT_DRAFT[verifier]
    return verifier, draft


def _generate_speculative(model, prompts, max_new_tokens, sampling, chat_template, ignore_eos, mode, ssms,
                          expansion, impl, verifier="auto", draft="auto", parallel=None) -> GenerationResult:
    from specjax.kernels.tree_attention import resolve_impl
    from specjax.speculative import SpecConfig, generate_speculative_jit
    from specjax.ssm import check_compatible

    _check_max_new_tokens(max_new_tokens)
    if not ssms:
        raise InputError(f"mode {mode!r} needs at least one SSM (ssms=[...])")
    if mode == "sequence" and len(ssms) != 1:
        raise InputError(f"mode 'sequence' takes exactly one SSM, got {len(ssms)}")
    for i, ssm in enumerate(ssms):
        check_compatible(model, ssm, name=f"SSM {i}")
    samplings_given = _sampling_list(sampling, 1 if not isinstance(sampling, list) else len(sampling))
    verifier, draft = resolve_verifier(verifier, draft, any(not s.greedy for s in samplings_given))
    exps = _expansions(mode, expansion, len(ssms))
    spec = SpecConfig(ssm_configs=tuple(s.config for s in ssms), expansions=tuple(exps), impl=resolve_impl(impl),
                      verifier=verifier, draft=draft)
    if spec.num_nodes > MAX_TREE_NODES:
        raise InputError(f"the speculated tree has {spec.num_nodes} nodes, more than N_max={MAX_TREE_NODES}")
    ids, lens, padded = _prepare(model, prompts, max_new_tokens, chat_template)
    cfg = model.config
    width = padded.shape[1]
    max_out = _next_pow2(max_new_tokens)
    cache_len = width + max_out + spec.num_nodes
    params, ssm_params, inputs, host = _place(parallel, model, ssms, padded, lens, max_new_tokens,
                                              _sampling_list(sampling, len(ids)))
    t0 = time.perf_counter()
    out = generate_speculative_jit(params, ssm_params, *inputs, cfg=cfg, spec=spec, cache_len=cache_len,
                                   max_out=max_out, eos_ids=() if ignore_eos else _eos_ids(model), parallel=parallel)
    tokens = host(out.tokens)
    seconds = time.perf_counter() - t0
    failed = np.flatnonzero(host(out.failed)[:len(ids)])
    if failed.size:
        raise SpecjaxError(f"requests {failed.tolist()}: the verifier met a distribution without probability mass "
                           f"(NaN or -inf logits); no token was invented")
    counts = host(out.num_generated)[:len(ids)]
    hist = host(out.tokens_per_pass)
    token_ids = [tokens[i, :counts[i]].tolist() for i in range(len(ids))]
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in token_ids]
    total = int(counts.sum())
    request_passes = int(hist.sum())
    stats = {"mode": mode, "llm_passes": int(host(out.llm_passes)), "generated_tokens": total, "seconds": seconds,
             "tokens_per_s": total / seconds if seconds > 0 else float("inf"),
             "tokens_per_pass_histogram": hist.tolist(),
             "mean_tokens_per_pass": float((hist * np.arange(len(hist))).sum() / max(request_passes, 1)),
             "accepted_at_depth": host(out.accepted_at_depth).tolist(),
             "tree_nodes": spec.num_nodes, "expansions": [e.widths for e in exps],
             "verifier": verifier, "draft": draft,
             "prompt_bucket": width, "cache_len": cache_len}
    return GenerationResult(token_ids=token_ids, texts=texts, prompt_token_ids=ids, stats=stats)

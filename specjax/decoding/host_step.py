"""Streaming: the host loop of ``specjax.generate(on_tokens=...)``, calling the decoding loop in chunks
of a few LLM passes.

Each call runs up to ``steps`` passes of the same ``lax.while_loop`` the one-program loop runs (its
carried caches updated in place, the state donated between calls) and reports the token count after
every pass, so the host still calls ``on_tokens`` once per LLM pass that emits. The chunks grow
1, 2, 4, then ``MAX_CHUNK_STEPS`` passes: the first tokens after the prefill show at once, and the
per-call costs are shared by several passes. Those costs, measured on 2 AMD EPYC cores (SmolLM2,
temperature 1, the default drafters with 15 budget levels): one call per pass took 28.5 ms per pass
against 20.3 ms in one program, because XLA:CPU allocates a program's temporary buffers on every call
(41 MB there: above glibc's mmap threshold, so each call mapped, faulted in and unmapped them).

Why not one program that hands each step's report to the host through an ``io_callback`` (stop 62):
JAX never writes a program with host callbacks to the persistent compilation cache, so every
``specjax generate`` run compiled its loop again (53 s for the default on that machine), and a
callback reaches one process only on a multi-host mesh. A chunk program is an ordinary program:
cached on disk, the same on one device and on a mesh.

The loop is pipelined: chunk k + 1 is dispatched before chunk k's report is fetched, so the device
goes on while the host fetches, calls ``on_tokens`` and dispatches (the chunk after the last tokens
finds every request done and runs no pass). That needs two things of the chunk:

- a report: copies of what the host reads (the counts, ``tokens``, ``done``) as outputs of their
  own, because the state itself is donated to the next chunk before the host reads it;
- nothing to do once every request is done: its ``while_loop`` runs the body zero times.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sharding.distributed import wait_for_peers

# The most passes one chunk runs: at ~20 ms per pass on 2 CPU cores, text shows ~6 times a second,
# and the per-call cost (~8 ms there) is shared by 8 passes.
MAX_CHUNK_STEPS = 8


class ChunkReport(NamedTuple):
    """What the host reads after a chunk (copies, not the donated state's buffers)."""

    counts: jax.Array  # [MAX_CHUNK_STEPS, B] int32: num_generated after each pass of the chunk
    ran: jax.Array  # [] int32: passes run (rows from ``ran`` on repeat the last counts)
    tokens: jax.Array  # [B, M] int32
    done: jax.Array  # [B] bool


def steps_while_active(step: Callable, state, steps: jax.Array):
    """Up to ``steps`` (an int32 operand, at most ``MAX_CHUNK_STEPS``) calls of ``step(state)`` while
    some request is not done: (state, ``ChunkReport``). ``steps`` is an operand, so every chunk size
    shares one compilation."""
    counts = jnp.zeros((MAX_CHUNK_STEPS,) + state.num_generated.shape, state.num_generated.dtype)

    def cond(carry):
        state, ran, _ = carry
        return (ran < jnp.minimum(steps, MAX_CHUNK_STEPS)) & jnp.any(~state.done)

    def body(carry):
        state, ran, counts = carry
        state = step(state)
        return state, ran + 1, counts.at[ran].set(state.num_generated)

    state, ran, counts = jax.lax.while_loop(cond, body, (state, jnp.int32(0), counts))
    counts = jnp.where((jnp.arange(MAX_CHUNK_STEPS) < ran)[:, None], counts, state.num_generated[None])
    return state, ChunkReport(counts=counts, ran=ran, tokens=state.tokens, done=state.done)


def chunk_sizes(most: int = MAX_CHUNK_STEPS):
    """Passes per chunk: 1, 2, 4, ... up to ``most``, then that for good."""
    return itertools.chain(itertools.takewhile(lambda k: k < most, (2 ** i for i in itertools.count())),
                           itertools.repeat(most))


def run_host_loop(init, chunk, host, n, on_tokens, timing, most: int = MAX_CHUNK_STEPS,
                  ahead: AheadCompile | None = None):
    """The streaming loop of ``specjax.generate(on_tokens=...)``: ``chunk(state, steps=k)`` (a partially
    applied jitted function built on ``steps_while_active``, its state donated) called with growing
    ``k`` (``chunk_sizes``) until every request is done, ``on_tokens(request, ids)`` called with each
    pass's newly accepted tokens. ``init()`` is the jitted prefill; ``host`` fetches an array to numpy
    (every process its part on a mesh); ``timing`` receives compile_seconds, prefill_seconds and
    seconds. Returns (final state, each request's finish time as the host saw it). Compilation is
    timed apart (AOT lower + compile, the prefill waited for first: ``prefill_then_compile``).
    ``most``: the largest chunk (1 where ``Parallel.one_pass_per_call``, see ``specjax.api.run_plan``);
    ``ahead``: ``init`` and ``chunk(state, steps=1)`` compiling already (``AheadCompile``)."""
    sizes = (np.int32(k) for k in chunk_sizes(most))  # numpy: replicated as it is on every process
    if ahead is not None:
        init, chunk = ahead.calls(init, chunk)
    state, compile_s, prefill_s = prefill_then_compile(init, chunk, ahead, steps=np.int32(1))
    loop_start = time.perf_counter()

    def elapsed():  # generation time: the prefill, then the loop so far (compilation excluded)
        return prefill_s + time.perf_counter() - loop_start

    def fetch(rep):
        return host(rep.counts)[:, :n], int(host(rep.ran)), host(rep.tokens), host(rep.done)[:n]

    shown = np.zeros(n, np.int64)
    finish = [None] * n
    # the prefill's tokens (one pass), read before the state is donated
    fetched = host(state.num_generated)[None, :n], 1, host(state.tokens), host(state.done)[:n]
    state, pending = chunk(state, steps=next(sizes))
    while True:
        counts, ran, tokens, done = fetched
        for k in range(ran):  # one on_tokens call per pass and request that emitted
            for b in range(n):
                if counts[k, b] > shown[b]:
                    on_tokens(b, tokens[b, shown[b]:counts[k, b]].tolist())
                    shown[b] = counts[k, b]
        now = elapsed()
        for b in range(n):
            if done[b] and finish[b] is None:
                finish[b] = now
        if bool(np.all(done)):
            break
        state, following = chunk(state, steps=next(sizes))  # queued behind the chunk fetched next
        fetched = fetch(pending)
        pending = following
    state = jax.block_until_ready(state)  # the chunk in flight: no pass, every request being done
    timing["compile_seconds"] = compile_s
    timing["prefill_seconds"] = prefill_s
    timing["seconds"] = elapsed()
    return state, finish


def run_two_programs(init, finish, host, timing, ahead: AheadCompile | None = None):
    """``specjax.generate`` without ``on_tokens``: the prefill program ``init()``, then the whole loop
    as one program ``finish(state)``, each compiled with its own options
    (``specjax.decoding.programs``). Compilation is timed apart as in ``run_host_loop``: the prefill
    is waited for before the loop is compiled (``prefill_then_compile``; ``ahead``: both compiling already,
    ``AheadCompile``). Returns the loop's output."""
    if ahead is not None:
        init, finish = ahead.calls(init, finish)
    state, compile_s, prefill_s = prefill_then_compile(init, finish, ahead)
    t0 = time.perf_counter()
    out = finish(state)
    host(out.tokens)  # blocks until done
    timing["compile_seconds"] = compile_s
    timing["prefill_seconds"] = prefill_s
    timing["seconds"] = prefill_s + time.perf_counter() - t0
    return out


class AheadCompile:
    """``init`` and ``then`` (as ``prefill_then_compile`` calls them) compiled while the host does other work,
    ``then`` for the state ``init`` will return: the tree budget's first measurement at a batch size, whose
    passes compile and are timed (~10 s on 2 AMD EPYC cores), does not depend on the loop's compilation
    (~20 s), since the measured costs reach the loop as an array argument. Both are traced and lowered
    here, in the caller's thread: JAX's thread-local settings (a caller's ``jax.default_matmul_precision``
    context, say) decide what a program computes, and a worker thread would not see them. Only XLA's
    compilation of the lowered programs, most of the time and free of Python, runs in a worker thread.
    The programs are then called as compiled (``calls``), not through ``jax.jit``'s dispatch: that keys
    its cache on whether the state's arrays are committed to a device (they are when weights were
    placed), which shapes do not say, and would compile the loop again. One device only: on a mesh the
    state a chunk outputs can be sharded otherwise than the prefill's (over dp, say), so a loop compiled for
    the prefill's state would not take the next chunk's."""

    def __init__(self, init, then, **kwargs):
        self._started = time.perf_counter()
        self._seconds = None
        self._error = None
        self._compiled = None
        self._fns = init, then
        lowered = lower_partial(init), lower_partial(then, _abstract_output(init), **kwargs)
        self._thread = threading.Thread(target=self._compile, args=lowered, daemon=True, name="specjax-compile-ahead")
        self._thread.start()

    def _compile(self, init, then):
        try:
            self._compiled = init.compile(), then.compile()
        except BaseException as e:  # raised where the result is read, in the caller's thread
            self._error = e
        self._seconds = time.perf_counter() - self._started

    def wait(self) -> None:
        """Wait for the compilation to end (an error it raised stays for ``result``)."""
        self._thread.join()

    def result(self) -> float:
        """The seconds the compilation took (waited for), or what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._seconds

    def calls(self, init: functools.partial, then: functools.partial):
        """``init`` and ``then`` (the programs compiled, with their real arguments: e.g. the pass costs
        measured meanwhile, where the compilation saw only their shape) calling the compiled executables.
        A call whose arguments do not match what was compiled raises instead of compiling again."""
        self.result()
        return tuple(_call_compiled(compiled, fn, ahead)
                     for compiled, fn, ahead in zip(self._compiled, (init, then), self._fns))


def _abstract_output(init: functools.partial):
    """What ``init`` returns, as the abstract values ``jax.jit`` will see when the real ones are passed on.
    A jitted program's outputs are committed to the device of its committed inputs (the placed weights)
    and are lowered with that sharding; ``jax.eval_shape`` has none. A loop lowered from it was another
    program than the one a later run, whose costs are cached, lowers from the real state: a first run
    wrote a persistent-cache entry no later run read, and the second run compiled the loop again (30 s
    for SmolLM2's greedy default on 2 AMD EPYC cores)."""
    shapes = jax.eval_shape(init)
    committed = [x.sharding for x in jax.tree.leaves((init.args, init.keywords))
                 if isinstance(x, jax.Array) and x.committed]
    if not committed:
        return shapes
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=committed[0]), shapes)


def _call_compiled(compiled, fn: functools.partial, ahead: functools.partial) -> functools.partial:
    """``fn`` (a partially applied jitted function) with its compiled executable in place of the function:
    the same bound arguments but its static ones, which a compiled executable is not given and which
    must be those ``ahead`` (the partial it was compiled from) had: else it is another program."""
    _, dynamic = jax.tree.unflatten(compiled.in_tree, [None] * compiled.in_tree.num_leaves)
    static = {k: v for k, v in fn.keywords.items() if k not in dynamic}
    if (fn.func is not ahead.func or len(fn.args) != len(ahead.args)
            or static != {k: v for k, v in ahead.keywords.items() if k not in dynamic}):
        raise RuntimeError(f"specjax: the program compiled ahead ({ahead.func}) is not the one to run: its static "
                           f"arguments changed since ({sorted(static)})")
    return functools.partial(compiled, *fn.args, **{k: v for k, v in fn.keywords.items() if k in dynamic})


def prefill_then_compile(init, then, ahead: AheadCompile | None = None, **kwargs):
    """Compile ``init``, run it, then compile ``then`` for the state it returned: (state, seconds of
    compilation, seconds of prefill). AOT lower + compile, so the calls that follow hit the same cache.
    The prefill is waited for before ``then`` is compiled: it runs asynchronously, and a compilation
    overlapping it had hidden the prefill's time inside ``compile_seconds`` (a cold batch of 16
    prompts reported 7.9 s of generation for 16.4 s of prefill + decoding). ``ahead``: both were
    compiled already (``AheadCompile``, its seconds reported), so the prefill runs once that ends."""
    if ahead is not None:
        compile_s = ahead.result()
        t0 = time.perf_counter()
        state = jax.block_until_ready(init())
        return state, compile_s, time.perf_counter() - t0
    t0 = time.perf_counter()
    lower_partial(init).compile()
    wait_for_peers("the prefill compiled")
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(init())
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lower_partial(then, state, **kwargs).compile()
    wait_for_peers("the decoding loop compiled")
    return state, compile_s + time.perf_counter() - t0, prefill_s


def lower_partial(fn: functools.partial, *args, **kwargs):
    """AOT-lower a partially applied jitted function with these extra arguments."""
    return fn.func.lower(*fn.args, *args, **fn.keywords, **kwargs)

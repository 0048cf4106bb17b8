"""Measured LLM pass costs by tree size and batch size: the cost table the tree budget decides with.

``measure_pass_costs`` times one LLM tree pass (the real model, the real weights, a chain tree of N
nodes over a committed prefix, the batch size being compiled) for each N, warm, median of a few
runs. ``cached_pass_costs`` keeps the table on disk (``~/.cache/specjax/tree_costs.json``, or
``$SPECJAX_CACHE_DIR``), keyed by the model's config and dtype, the machine (CPU model and core count
or accelerator kind), the mesh, the batch size and the attention implementation: it is measured once
per machine and reused. ``with_costs`` fills a ``Budget`` whose costs are not given yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
import warnings

try:
    import fcntl
except ImportError:  # not POSIX: measured without a lock
    fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, cache_root
from specjax.decoding.programs import step_compiler_options, step_library, step_params
from specjax.decoding.sampling import SamplingArrays, SamplingParams
from specjax.errors import InputError
from specjax.models.cache import init_cache
from specjax.models.output import SeededHead
from specjax.models.params import layers_split
from specjax.sharding.distributed import wait_for_peers
from specjax.speculation.budget import Budget
from specjax.speculation.commit import tree_forward
from specjax.speculation.tree import from_parents

PREFIX = 256  # committed tokens behind the measured tree: a typical short request mid-generation
# Passes timed per tree size (round-robin, median). The budget's choices turn on the ratios between
# sizes, and five passes did not pin them: the 2-node / 1-node ratio of SmolLM2 on 2 Xeon cores came
# out 1.12, 1.18, 1.21, 1.28 and 1.33 in five tables measured within an hour; with 15 it came out
# 1.23-1.25 three times (about 4 s of passes, once per machine).
REPEATS = 15
# ... but slow passes stop sooner: after MIN_REPEATS rounds, once the timed passes have taken
# MEASURE_SECONDS. Passes of half a second (the pp=2 x tp=4 mesh simulated on two CPU cores: 0.36-0.71 s
# over the default ladder's 10 sizes) are pinned by fewer samples, the scheduler's jitter that moved
# 40 ms passes being small beside them, and 15 rounds there took ~73 s before the first token.
MIN_REPEATS = 5
MEASURE_SECONDS = 10.0
_clock = time.perf_counter  # the passes' clock (a test's fake one times slow passes without running them)


def cache_path() -> str:
    return os.path.join(cache_root(), "tree_costs.json")


def machine_key() -> str:
    """What the pass time depends on besides the model: the processor and the cores this process may
    use, or the accelerator kind. A model name alone ("AMD EPYC") covers generations with and without
    AVX-512, whose kernels differ (``specjax.kernels.cpu.build`` compiles for the flags with
    -march=native), so the family, model, stepping and flags are in it too; and the cores are this
    process's affinity, not the machine's count (under ``taskset -c 0`` a one-core table was then read
    as a two-core machine's)."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}"
    return f"cpu:{cpu_name()}:{cpu_signature()}:{usable_cores()} cores"


def cpu_name() -> str:
    """The processor model (/proc/cpuinfo's model name where there is one)."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown CPU"


def cpu_signature() -> str:
    """The processor's family, model and stepping, and a digest of its feature flags (/proc/cpuinfo)."""
    info = _cpuinfo()
    ident = "-".join(info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    flags = info.get("flags") or info.get("Features") or ""
    return f"{ident}:flags={hashlib.sha256(' '.join(sorted(flags.split())).encode()).hexdigest()[:8]}"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                name, _, value = line.partition(":")
                out.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return out


# Bumped whenever the measured pass changes what it costs (2: block-only tree passes; 3: fused split
# layers, cache-layout prefix views; 4: 15 timed passes per size instead of 5), so a table cached by an
# older specjax is measured again instead of steering the budget with stale or noisy costs (a stale
# batch-2 table made the default 0.68x of incremental decoding; re-measured: 1.08x; 5: the pass compiled
# as the loop compiles it, with ``specjax.decoding.programs``' matmul library, and the tied head read
# from its transposed copy; 6: the step programs' attention in specjax's CPU attention kernel; 7: the
# matmul kernel prefetches the next chunk of a panel, 17-node passes ~13% cheaper; 8: the matmul kernel in
# intrinsics, a 17-node pass 189 -> 38 ms on a Xeon that GCC tunes as rocketlake; 9: the step attention
# kernel on AVX2 CPUs too, where XLA attended before; 10: the AVX2 matmul kernel's wide shape from 8 rows
# on, a 17-node pass 54-56 -> 49 ms on 2 AMD EPYC cores).
PASS_VERSION = 10


# What a verifier's tree pass computes in its head: "greedy" each node's argmax, "seeded" each node's
# seeded sample (with the CPU kernels both cheaper than the logits: ``specjax.kernels.cpu.greedy_head``),
# "logits" the logits (the sampled verifiers read whole laws).
HEADS = ("logits", "greedy", "seeded")


def pass_head(verifier: str) -> str:
    """The head a verifier's tree passes compute (``HEADS``)."""
    return verifier if verifier in ("greedy", "seeded") else "logits"


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise InputError(f"a tree pass's head is one of {list(HEADS)}, got {head!r}")


def table_key(cfg: ModelConfig, dtype, batch: int, impl: str, parallel=None, split: bool = False,
              head: str = "logits") -> str:
    """``split``: the layer weights' layout (``specjax.models.params``): split passes cost less.
    ``head``: what the pass computes in its head (``HEADS``; the greedy and seeded verifiers' passes
    decide each node's token, not its logits)."""
    _check_head(head)
    mesh = "none" if parallel is None else _mesh_key(parallel, batch)
    model = hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]
    return (f"{model}|{jnp.dtype(dtype).name}|{machine_key()}|mesh={mesh}|batch={batch}|impl={impl}"
            f"|layers={'split' if split else 'stacked'}|dots={step_library(batch)}|pass=v{PASS_VERSION}"
            + ("" if head == "logits" else f"|head={head}"))


def _mesh_key(parallel, batch: int) -> str:
    """What changes a pass's time on a mesh besides its shape: the sharding rules (replicated attention
    moves other bytes), the pipeline's schedule and request groups, and the processes it spans (one
    process of 8 devices is not two of 4 over gloo)."""
    rules = hashlib.sha256(repr((parallel.rules, parallel.ssm_rules)).encode()).hexdigest()[:8]
    return (f"{dict(parallel.mesh.shape)};rules={rules};schedule={parallel.schedule};"
            f"groups={parallel.groups_for(batch)};"
            f"processes={jax.process_count()}")


def _chain(batch: int, nodes: int):
    parents = [-1] + list(range(nodes - 1))
    return from_parents([[1 + i for i in range(nodes)]] * batch, [parents] * batch, n_max=nodes)


def measure_pass_costs(params, cfg: ModelConfig, batch: int, node_counts, impl: str = "xla", parallel=None,
                       prefix: int = PREFIX, repeats: int = REPEATS, progress=None,
                       head: str = "logits", beside=None) -> dict[int, float]:
    """{nodes: seconds per LLM tree pass}, measured warm on this machine (median of ``repeats`` rounds,
    or of fewer, at least ``MIN_REPEATS``, once the timed passes took ``MEASURE_SECONDS``);
    ``head``: the pass as that verifier has it (``HEADS``: "greedy" each node's argmax and finiteness,
    "seeded" its seeded sample at temperature 1 and finiteness); ``beside``: work to run beside the
    compiles (``specjax.api.run_plan``'s ``AheadCompile``): called before the first size compiles, it
    returns a callable that waits for that work, called once every size is compiled and before any is
    timed (on a CPU the work would take cores from the timed passes)."""
    _check_head(head)
    counts = sorted(set(int(n) for n in node_counts))
    if not counts or counts[0] < 1:
        raise InputError(f"tree sizes to measure must be >= 1 node, got {node_counts!r}")
    settle = None if beside is None else beside()
    dtype = jax.tree.leaves(params)[0].dtype

    def one_pass(params, tree, cache):
        if parallel is not None:
            cache = parallel.constrain_cache(cache, cfg)
        seeded = None
        if head == "seeded":  # temperature 1 (the kernel's case); the step makes the noise once, outside
            sampling = SamplingArrays.from_params([SamplingParams(temperature=1.0)] * batch)
            noise = jnp.zeros((batch, 1, cfg.vocab_size), jnp.float32)
            seeded = SeededHead(sampling, noise, jnp.zeros_like(tree.depth))
        out = tree_forward(params, tree, cache, cfg, impl, parallel, block_only=True, greedy=head == "greedy",
                           seeded=seeded)
        return out.logits if head == "logits" else (out.token, out.finite)  # as the loop runs it

    fwd = jax.jit(one_pass, compiler_options=step_compiler_options(batch))  # compiled as the loop's steps are
    params = step_params(params, parallel, head != "logits")  # and multiplying by the same weights
    inputs = {}
    for n in counts:
        if progress is not None:
            progress(n)
        cache = init_cache(cfg, batch, prefix + n, dtype)
        cache = cache.replace(k=jnp.zeros_like(cache.k), v=jnp.zeros_like(cache.v),
                              length=jnp.full((batch,), prefix, jnp.int32))
        tree = _chain(batch, n)
        if parallel is not None:
            tree = parallel.put_batch(tree)
        inputs[n] = (tree, cache)
        fwd.lower(params, tree, cache).compile()  # the call below hits this compilation
        wait_for_peers(f"the {n}-node pass compiled")  # gloo's first collective waits only 30 s
        jax.block_until_ready(fwd(params, tree, cache))  # warm
    if settle is not None:
        settle()
    # Round-robin over the sizes: a machine that slows down for a while (a shared CPU does) slows
    # every size alike instead of making one size look cheaper than a smaller one.
    samples = {n: [] for n in counts}
    for done in range(1, repeats + 1):
        for n in counts:
            t0 = _clock()
            jax.block_until_ready(fwd(params, *inputs[n]))
            samples[n].append(_clock() - t0)
        if MIN_REPEATS <= done < repeats and _process0_says(sum(map(sum, samples.values())) > MEASURE_SECONDS):
            break
    return {n: float(np.median(s)) for n, s in samples.items()}


def _process0_says(flag: bool) -> bool:
    """Process 0's ``flag`` on every process: its passes run over the whole mesh, so every process
    must time as many rounds as process 0 does, or the collectives deadlock."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """The costs made non-decreasing in the node count (a running maximum). A pass over more nodes
    does the work of a smaller one and more, but a measurement can say otherwise: noise (a noisy
    table measured 1 node at 111 ms and 2 nodes at 97 ms at batch 4 on this CPU), or a real dip
    (XLA:CPU's matmul strategy changes with the row count). Both are resolved upwards on purpose:
    the budget then never speculates on a cost it may not get, erring towards smaller trees."""
    out, top = {}, 0.0
    for n in sorted(costs):
        top = max(top, costs[n])
        out[n] = top
    return out


def cached_pass_costs(params, cfg: ModelConfig, batch: int, node_counts, impl: str = "xla", parallel=None,
                      progress=None, remeasure: bool = False, head: str = "logits",
                      beside=None) -> tuple[dict[int, float], str]:
    """({nodes: seconds}, where they came from): the on-disk table, measuring its row again, whole,
    where it lacks a size (one process at a time on a machine: ``_measuring_lock``).

    Several processes (one mesh across hosts) each read their own host's table, and the tables can
    differ (a fresh node, another run writing meanwhile); but measuring runs passes over the whole
    mesh, so every process must measure the same sizes or the collectives deadlock. Process 0's table
    decides whether they are measured (then all the sizes asked for), and its costs are everyone's:
    they decide every step's branch (the loop's ``pass_costs`` argument), so all processes must hold
    the same ones. ``beside``: as in ``measure_pass_costs`` (not called when nothing is measured)."""
    path = cache_path()
    dtype = jax.tree.leaves(params)[0].dtype
    key = table_key(cfg, dtype, batch, impl, parallel, layers_split(params), head)
    counts = [int(n) for n in node_counts]
    shared = jax.process_count() > 1
    cached = _cached_row(_read(path), key, path)
    row = {} if remeasure else cached
    need = any(n not in row for n in counts)
    if shared:
        need = _process0_says(need)
    measured = False
    if need:
        with _measuring_lock(path, shared):
            if not (remeasure or shared):  # another process may have measured it while this one waited
                cached = row = _cached_row(_read(path), key, path, report=False)
            if remeasure or shared or any(n not in row for n in counts):
                # The whole row in one round-robin measurement: sizes cached at another moment (another
                # load on a shared CPU) compared with these would steer the budget by that difference.
                sizes = counts if shared else sorted(set(counts) | set(cached))
                row = measure_pass_costs(params, cfg, batch, sizes, impl, parallel, progress=progress, head=head,
                                         beside=beside)
                measured = True
            if shared:  # every process steps by process 0's costs
                row = {**row, **_process0_costs(counts, row)}
            if measured:
                table = _read(path)  # another process may have written other rows meanwhile
                table[key] = {str(n): s for n, s in sorted(row.items())}
                _write(path, table)
    elif shared:  # process 0's cached costs (this host's table may lack them or differ)
        row = {**row, **_process0_costs(counts, row)}
    if measured:
        source = f"measured now on {machine_key()} (batch {batch}), cached in {path}"
    else:
        source = f"measured earlier on {machine_key()} (batch {batch}), from {path}"
    if shared:
        source += "; process 0's measurement, shared with every process"
    # Over the sizes asked for only: other sizes cached for the key (by `specjax tree-cost`) must not
    # change what a budget reads.
    return monotone({n: row[n] for n in counts}), source


@contextlib.contextmanager
def _measuring_lock(path: str, shared: bool):
    """One process at a time measures on this machine: two servers starting together each timed their
    passes on cores the other was using, and cached those costs for good. Not across the processes of
    one mesh (they measure together, over collectives: a lock would deadlock them where they share a
    cache directory), nor where no lock file can be made (the costs are then only measured unlocked)."""
    if shared or fcntl is None:
        yield
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(f"{path}.lock", "a")
    except OSError:
        yield
        return
    with f:  # the lock goes with the file's closing
        waited_from = None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if waited_from is None:
                    waited_from = now
                    print(f"specjax: waiting for another process measuring tree pass costs on this machine (it "
                          f"holds {path}.lock; waiting at most {LOCK_WAIT_S:g} s)", file=sys.stderr, flush=True)
                elif now - waited_from > LOCK_WAIT_S:  # a stopped process (Ctrl-Z) holds it: not forever
                    warnings.warn(f"specjax: {path}.lock still held after {LOCK_WAIT_S:g} s; measuring beside its "
                                  f"holder", stacklevel=3)
                    break
                time.sleep(0.2)
        yield


# The longest a measurement waits for another's: SmolLM2's default ladder takes ~10-20 s to measure on 2 CPU
# cores, a large model on a mesh a few minutes.
LOCK_WAIT_S = 300.0


def _process0_costs(counts: list[int], row: dict[int, float]) -> dict[int, float]:
    """Process 0's costs of ``counts``, on every process (a size another process lacks is NaN there
    until process 0's value replaces it)."""
    from jax.experimental import multihost_utils

    got = multihost_utils.broadcast_one_to_all(np.asarray([row.get(n, np.nan) for n in counts], np.float64))
    return {n: float(v) for n, v in zip(counts, got)}


def with_costs(budget: Budget, params, cfg: ModelConfig, batch: int, impl: str, parallel=None,
               progress=None, head: str = "logits", beside=None) -> Budget:
    """The budget with each level's measured seconds per pass (unchanged when it already has costs);
    ``head``: for that verifier's passes (``pass_head``); ``beside``: as in ``measure_pass_costs``."""
    if budget.costs is not None:
        return budget
    nodes = [budget.node_count(level) for level in range(len(budget.levels))]
    costs, source = cached_pass_costs(params, cfg, batch, nodes, impl, parallel, progress=progress, head=head,
                                      beside=beside)
    return dataclasses.replace(budget, costs=tuple(costs[n] for n in nodes), source=source)


def _read(path: str) -> dict:
    """The cost table, {} where there is none yet. A damaged one is moved aside (``.damaged``) with a
    warning, and every row it held is measured again as it is needed (the file is only a cache)."""
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            raise ValueError(f"a JSON {type(table).__name__}, not an object")
        return table
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        try:
            os.replace(path, f"{path}.damaged")
            aside = f"; kept as {path}.damaged"
        except OSError:
            aside = ""
        warnings.warn(f"specjax: the tree cost table {path} cannot be read ({e}); its rows are measured again"
                      f"{aside}", stacklevel=3)
        return {}


def _cached_row(table: dict, key: str, path: str, report: bool = True) -> dict[int, float]:
    """The table's {nodes: seconds} for ``key``: positive node counts, finite positive seconds. A row
    that is not (an edited or damaged file) is reported and measured again, never used: a NaN or negative
    cost would steer every step's tree size, and a wrong type crashed every later run."""
    entry = table.get(key, {})
    try:
        if not isinstance(entry, dict):
            raise ValueError(f"a {type(entry).__name__}, not an object")
        row = {}
        for n, seconds in entry.items():
            if not (isinstance(n, str) and n.isascii() and n.isdigit() and int(n) > 0):
                raise ValueError(f"node count {n!r} is not a positive integer")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ValueError(f"the cost of {n} nodes is {seconds!r}, not a finite positive number of seconds")
            row[int(n)] = float(seconds)
        return row
    except ValueError as e:
        if not report:  # reported at the first reading
            return {}
        warnings.warn(f"specjax: the tree cost table {path} has a damaged row {key!r} ({e}); measuring it again",
                      stacklevel=3)
        return {}


def _write(path: str, table: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # the costs are still used for this run, only measured again next time
        warnings.warn(f"specjax: could not write the tree cost table {path}: {e}", stacklevel=2)

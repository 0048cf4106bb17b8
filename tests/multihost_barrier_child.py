"""One process of tests/test_multihost.py's barrier test, started by ``specjax launch``: both
processes meet at one ``wait_for_peers`` point, process 1 arriving 2 s late (each prints how long it
waited there); then only process 0 waits at a second one (3 s) and prints the error it gets; process 1
stays away longer than that, then exits."""

import sys
import time

from specjax.errors import ShardingError
from specjax.sharding import distributed

distributed.initialize(distributed.detect_cluster(), timeout_s=60.0)

import jax  # noqa: E402

if jax.process_index() == 1:
    time.sleep(2)
t0 = time.monotonic()
distributed.wait_for_peers("both processes")
print(f"met after waiting {time.monotonic() - t0:.2f}s", file=sys.stderr, flush=True)
if jax.process_index() == 0:
    try:
        distributed.wait_for_peers("the program only process 0 compiled", timeout_s=3)
        print("no error", flush=True)
    except ShardingError as e:
        print(f"ShardingError: {e}", flush=True)
else:
    time.sleep(8)

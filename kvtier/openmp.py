"""torch loaded with its idle OpenMP workers asleep, not spinning: the engine's two thread teams share the cores.

The built-in engine runs its dense matmuls on torch's OpenMP workers and its
attention and quantized products on kvtier's own C team (``native/team.c``),
on the same cores. libgomp, by default, keeps a worker spinning for a while
after each parallel region in case another follows at once. A prefill
alternates the two every layer (matmuls, then attention over the whole
prefix), so through most of each attention call torch's idle worker holds a
core the C team is computing on: attention ran at about 0.6 of its speed in
the engine. ``OMP_WAIT_POLICY=PASSIVE`` puts those workers to sleep as soon as
a region ends; the price is a wake-up per matmul, far smaller (figures in
bench/README.md).

libgomp reads its environment once, when torch loads it, so this has to run
before anything imports torch: importing this module does it, and
``kvtier/__init__.py`` imports it first. It sets the variable only for that
moment and removes it again, so the processes kvtier starts (the peer engines
of ``kvtier bench peer``, the backends of ``kvtier route``) get the
environment they were given. A process that sets ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` itself keeps its choice, and one that imported torch before
kvtier keeps torch's defaults.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
OWN_CHOICE = (WAIT_POLICY, "GOMP_SPINCOUNT")

wait_policy: str | None = None
"""What torch's OpenMP runtime was given when it loaded: ``PASSIVE`` when kvtier chose,
the process's own ``OMP_WAIT_POLICY`` when it set one, None for the runtime's default."""


def load_torch() -> None:
    """Import torch with ``OMP_WAIT_POLICY=PASSIVE`` unless it is loaded already or the process chose."""
    global wait_policy
    ours = "torch" not in sys.modules and not any(name in os.environ for name in OWN_CHOICE)
    if ours:
        os.environ[WAIT_POLICY] = "PASSIVE"
    wait_policy = os.environ.get(WAIT_POLICY)
    try:
        import torch  # noqa: F401  (libgomp reads the variable here, once)
    finally:
        if ours:
            del os.environ[WAIT_POLICY]


load_torch()

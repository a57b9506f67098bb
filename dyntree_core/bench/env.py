"""A process environment variable set for the length of a block (the benches' switches: ``DYNTREE_KERNELS``,
``DYNTREE_ALPHAS``), restored after it, unset again if it was unset."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved

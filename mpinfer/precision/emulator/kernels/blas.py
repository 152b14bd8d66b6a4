"""numpy's BLAS on one thread for the emulator's small matrix products.

OpenBLAS splits even a [512, 64] x [64, 64] product over every core, and its threads wait for each other by
spinning: on a machine whose other cores are busy (ONNX Runtime's own threads, another process) such a product
took 1.8-4.8 ms instead of 0.04 ms, and the strict emulation of a deep narrow net (600 small nodes) ran 5x slower
than on one thread. One thread is faster at these sizes even on an idle machine. Each output element is summed in
the same order whichever thread computes it (OpenBLAS splits a product by rows and columns of the output), so the
results are the same bits. Without ``threadpoolctl`` the products run as numpy sets them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# Products of fewer multiply-adds than this run on one BLAS thread: below it a second thread's start-up and
# synchronisation cost more than the half of the work it takes (and much more on a busy machine).
ONE_THREAD_MACS = 1 << 24


@functools.lru_cache(maxsize=1)
def _blas() -> Any:
    """The threadpoolctl controller of the BLAS libraries numpy loaded, or None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        logger.debug("threadpoolctl is not installed: the emulator's products use numpy's BLAS threads as set")
        return None
    controller = ThreadpoolController().select(user_api="blas")
    return controller if controller.lib_controllers else None


@contextlib.contextmanager
def one_thread_below(macs: int) -> Iterator[None]:
    """Run the body on one BLAS thread when the product it computes takes fewer than ``ONE_THREAD_MACS``."""
    blas = _blas() if macs < ONE_THREAD_MACS else None
    if blas is None:
        yield
        return
    before = [lib.num_threads for lib in blas.lib_controllers]
    if all(n == 1 for n in before):
        yield
        return
    for lib in blas.lib_controllers:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(blas.lib_controllers, before, strict=True):
            lib.set_num_threads(n)

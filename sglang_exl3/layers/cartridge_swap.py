"""The scheduler side of a cartridge swap on one rank (seeds.md F28, in SGLang's terms): what runs between forward
steps once the server has drained, and how every failure returns to the base.

- `stage(path)`, before the drain: stage, verify and fold the cartridge into new weights (nothing live changes). With
  TP, the ranks agree: if any rank fails, every rank discards.
- `activate()`, drained: commit, drop the prefix cache (its KV came from the old weights), recapture the CUDA graphs
  (recapture mode). If any step fails on any rank, every rank restores the base (deactivate, flush, recapture) and
  the swap is reported failed; the served outputs are the base's, bit for bit. If the restore itself fails, the
  server cannot know what it serves: `CartridgeRestoreError` propagates out of the scheduler, which stops.
- `deactivate()`, drained: back to the base, flush, recapture.

`agree(ok)` is the TP vote (all ranks' ok, via all_gather on the CPU group); one rank alone votes for itself.
Faults can be injected at named points for the rollback evidence (SGLANG_EXL3_TEST_CARTRIDGE_FAULTS=1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime

logger = logging.getLogger(__name__)
FAULT_POINTS = ("prepare", "commit", "recapture")


class CartridgeSwapError(RuntimeError):
    """The swap failed and this rank serves the base (or what it served before)."""


class CartridgeRestoreError(RuntimeError):
    """A failed swap could not restore the base: the server must stop."""


class InjectedFault(RuntimeError):
    pass


@dataclass
class SwapSteps:
    runtime: CartridgeRuntime
    flush: Callable[[], None]  # drop the prefix cache
    recapture: Callable[[], None] | None  # recapture CUDA graphs (None: resident mode or no graphs)
    agree: Callable[[bool], bool] = lambda ok: ok


def _fault(fault: str | None, point: str) -> None:
    if fault == point:
        raise InjectedFault(f"injected fault at {point}")


def stage(steps: SwapSteps, path: str, fault: str | None = None) -> int:
    """Stage and prepare; the number of this rank's layers the cartridge will change."""
    error = None
    try:
        steps.runtime.stage(path)
        _fault(fault, "prepare")
        updated = steps.runtime.prepare()
    except Exception as e:  # any rank's failure must reach the vote before anything is raised
        error, updated = e, 0
    if not steps.agree(error is None):
        steps.runtime.discard()
        raise CartridgeSwapError(f"cartridge not staged: {error or 'another TP rank failed to stage it'}")
    return updated


def _restore(steps: SwapSteps) -> None:
    try:
        steps.runtime.deactivate()
        steps.flush()
        if steps.recapture is not None:
            steps.recapture()
    except Exception as e:
        logger.critical("EXL3 cartridge: restoring the base failed (%s); the server stops", e)
        raise CartridgeRestoreError(f"restoring the base after a failed cartridge swap failed: {e}") from e


def activate(steps: SwapSteps, fault: str | None = None) -> tuple[int, float]:
    """Commit the staged cartridge; (layers updated, milliseconds)."""
    t0, error, updated = time.perf_counter(), None, 0
    try:
        updated = steps.runtime.commit(after_layer=lambda _: _fault(fault, "commit"))
        steps.flush()
        _fault(fault, "recapture")
        if steps.recapture is not None:
            steps.recapture()
    except Exception as e:
        error = e
    finally:
        steps.runtime.discard()
    if not steps.agree(error is None):
        _restore(steps)
        raise CartridgeSwapError(f"cartridge swap rolled back to the base: {error or 'another TP rank failed'}")
    return updated, (time.perf_counter() - t0) * 1e3


def deactivate(steps: SwapSteps) -> tuple[int, float]:
    t0 = time.perf_counter()
    updated = steps.runtime.deactivate()
    try:
        steps.flush()
        if steps.recapture is not None:
            steps.recapture()
    except Exception as e:
        raise CartridgeRestoreError(f"recapturing the base's CUDA graphs failed: {e}") from e
    return updated, (time.perf_counter() - t0) * 1e3

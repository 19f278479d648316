"""Generated malformed inputs for every input surface (tests/fuzz_surfaces.py): 1,000 deterministic cases per
surface, each of which must load or raise the project's own named error, without another exception, a hang or a
file written. `pytest -m fuzz_long` runs 20,000 per surface."""

from __future__ import annotations

import fuzz_surfaces
import pytest

CI_CASES, LONG_CASES = 1000, 20000


def _check(surface: str, cases: int) -> None:
    tally = fuzz_surfaces.fuzz(surface, cases, raise_other=True)
    assert tally.cases >= cases, f"hypothesis ran only {tally.cases} cases"
    assert (tally.other_exceptions, tally.hangs, tally.wrote_files) == (0, 0, 0), tally.row(surface)
    assert tally.loaded + tally.named_errors == tally.cases
    assert tally.named_errors > 0  # the mutations do reach the rules


@pytest.mark.parametrize("surface", list(fuzz_surfaces.SURFACES))
def test_fuzz_surface(surface):
    _check(surface, CI_CASES)


@pytest.mark.fuzz_long
@pytest.mark.parametrize("surface", list(fuzz_surfaces.SURFACES))
def test_fuzz_surface_long(surface):
    _check(surface, LONG_CASES)

"""The planted-fault suite on real CUDA graphs (marked ``cuda``: run on the H200): every fault class
planted into a plain, a micro-batched and a piecewise graph is recorded in always-on mode and raises
in debug mode (a baked slot offset among them: the graph writes outside the region its step
declares), and the host values only a real graph bakes in (a float the model reads from itself, an
``.item()`` of a CPU tensor) are caught by the canary; clean steps record nothing."""

from __future__ import annotations

import pytest
import torch

from capture_core.events import ViolationKind
from tests.support.faults import (
    BAKED_ON_CUDA,
    CASES,
    FAULTS,
    IDS,
    KINDS,
    GraphUnderTest,
    checked_graph,
    outside_region_writers,
)

pytestmark = pytest.mark.cuda

def cuda_graph(kind: str, observer, mode: str, policy: str) -> GraphUnderTest:
    under_test = checked_graph(kind, observer, mode, policy, backend="cuda")
    assert all(e.backend == "cuda" for e in observer.captures)
    return under_test


@pytest.mark.parametrize(("kind", "fault"), CASES, ids=IDS)
def test_cuda_always_on_records_the_fault(kind, fault, observer) -> None:
    under_test = cuda_graph(kind, observer, "always_on", policy="eager")
    getattr(under_test, f"plant_{fault}")()
    torch.cuda.synchronize()
    violation_kind, name, _ = FAULTS[fault]
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (violation_kind, name)


@pytest.mark.parametrize(("kind", "fault"), CASES, ids=IDS)
def test_cuda_debug_mode_raises(kind, fault, observer) -> None:
    under_test = cuda_graph(kind, observer, "debug", policy="raise")
    violation_kind, name, error = FAULTS[fault]
    with pytest.raises(error):
        getattr(under_test, f"plant_{fault}")()
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (violation_kind, name)


@pytest.mark.parametrize("fault", BAKED_ON_CUDA)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_host_values_baked_at_capture_are_caught_by_the_canary(kind, fault, observer) -> None:
    under_test = cuda_graph(kind, observer, "always_on", policy="raise")
    replayed = getattr(under_test, f"plant_{fault}")().float().clone()
    torch.cuda.synchronize()
    [mismatch] = [v for v in observer.violations if v.input_name == "output"]
    assert mismatch.kind is ViolationKind.REPLAY_MISMATCH
    assert mismatch.max_abs_error > 0 and mismatch.max_rel_error == pytest.approx(0.5, rel=1e-2)
    assert replayed.abs().max() > 0  # the replay's own (wrong) result stands


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_clean_steps_with_every_check_record_nothing(kind, observer) -> None:
    for mode in ("always_on", "debug"):
        under_test = cuda_graph(kind, observer, mode, policy="raise")
        for _ in range(20):
            under_test.step()
    torch.cuda.synchronize()
    assert observer.violations == []
    assert len(observer.replays) == 2 * 22


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_a_graph_writing_other_slots_is_found_outside_the_region(kind, observer) -> None:
    under_test = cuda_graph(kind, observer, "always_on", policy="eager")
    under_test.plant_baked_slot()
    torch.cuda.synchronize()
    assert outside_region_writers(observer.violations) == {"the graph"}
    under_test.step()
    torch.cuda.synchronize()
    assert len([v for v in observer.violations if v.input_name == "kv_cache"]) == 2

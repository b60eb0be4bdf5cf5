"""The planted-fault suite on real CUDA graphs (marked ``cuda``: run on the H200): every fault class
planted into a plain, a micro-batched and a piecewise graph is recorded at the replay it is planted
in, always on at the default schedule (a per-step comparison is read back at the group's next replay:
``settle()`` reads it), and raises in debug mode; the legitimate pattern beside it records nothing;
a host value only a real graph bakes in (an ``.item()`` of a CPU tensor) and numbers drawn on the
host are caught by the canary, while sampling inside the graph is not; clean steps record nothing."""

from __future__ import annotations

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.events import ViolationKind
from capture_core.runtime import GraphRuntime
from tests.support.faults import (
    ALWAYS_ON_CASES,
    BAKED_ON_CUDA,
    DEBUG_CASES,
    FAULTS,
    KINDS,
    LEGIT,
    GraphUnderTest,
    case_ids,
    checked_graph,
    legit_ids,
    outside_region_writers,
    served,
)

pytestmark = pytest.mark.cuda

MISMATCH = [(ViolationKind.REPLAY_MISMATCH, "output")]


def cuda_graph(kind: str, observer, mode: str, policy: str, **options) -> GraphUnderTest:
    under_test = checked_graph(kind, observer, mode, policy, backend="cuda", **options)
    assert all(e.backend == "cuda" for e in observer.captures)
    return under_test


@pytest.mark.parametrize(("kind", "fault"), ALWAYS_ON_CASES, ids=case_ids(ALWAYS_ON_CASES))
def test_cuda_always_on_records_the_fault_at_the_replay_it_is_planted_in(kind, fault, observer) -> None:
    planted = FAULTS[fault]
    with served(planted.inference):
        under_test = cuda_graph(kind, observer, "always_on", policy="eager", sampling=Sampling())
        getattr(under_test, f"plant_{fault}")()
        under_test.settle()
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (planted.kind, planted.name)


@pytest.mark.parametrize(("kind", "fault"), DEBUG_CASES, ids=case_ids(DEBUG_CASES))
def test_cuda_debug_mode_raises(kind, fault, observer) -> None:
    planted = FAULTS[fault]
    with served(planted.inference):
        under_test = cuda_graph(kind, observer, "debug", policy="raise")
        with pytest.raises(planted.error):
            getattr(under_test, f"plant_{fault}")()
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (planted.kind, planted.name)


@pytest.mark.parametrize("mode", ["always_on", "debug"])
@pytest.mark.parametrize(("legit", "inference"), LEGIT, ids=legit_ids(LEGIT))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_the_legitimate_pattern_beside_each_fault_is_silent(kind, legit, inference, mode, observer):
    with served(inference):
        under_test = cuda_graph(kind, observer, mode, policy="raise")
        getattr(under_test, legit)()
        under_test.settle()
    assert observer.violations == [], [v.message for v in observer.violations]


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
def test_cuda_in_graph_sampling_is_silent_and_numbers_frozen_at_capture_are_not(kind, observer) -> None:
    for mode in ("always_on", "debug"):
        under_test = cuda_graph(kind, observer, mode, policy="raise", noise="torch")
        for _ in range(6):
            under_test.step()
        under_test.settle()
    assert observer.violations == []
    runtime = GraphRuntime("cuda", observer=observer, progress=False, warmup_iters=2, canary=True)
    frozen = GraphUnderTest.build(kind, runtime, device="cuda", noise="host")
    frozen.step()
    frozen.settle()
    assert [(v.kind, v.input_name) for v in observer.violations] == MISMATCH


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_clean_steps_with_every_check_record_nothing(kind, observer) -> None:
    for mode in ("always_on", "debug"):
        under_test = cuda_graph(kind, observer, mode, policy="raise")
        for _ in range(20):
            under_test.step()
        under_test.settle()
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

"""The planted-fault suite, on the eager backend: every fault class that makes a graph silently
wrong, planted through the public API into a plain, a micro-batched and a piecewise graph. In
always-on mode at the default schedule (each graph's first replay sampled, then one in 1,000) it is
recorded at the very replay it is planted in, with no sampled replay, and the step goes on; in debug
mode that replay raises; the legitimate pattern beside it records nothing in either mode, with every
check and the canary on every replay. Its CUDA twin is ``test_planted_faults_cuda.py``."""

from __future__ import annotations

import pytest

from capture_core.canary import Sampling
from capture_core.events import ViolationKind
from capture_core.runtime import GraphRuntime
from tests.support.faults import (
    ALWAYS_ON_CASES,
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

pytestmark = pytest.mark.usefixtures("single_thread_torch")

DEFAULT = Sampling()
"""The runtime's default schedule: after the two clean steps, no replay is sampled for a while."""
MISMATCH = [(ViolationKind.REPLAY_MISMATCH, "output")]


@pytest.mark.parametrize(("kind", "fault"), ALWAYS_ON_CASES, ids=case_ids(ALWAYS_ON_CASES))
def test_always_on_records_the_fault_at_the_replay_it_is_planted_in(kind, fault, observer) -> None:
    planted = FAULTS[fault]
    with served(planted.inference):
        under_test = checked_graph(kind, observer, "always_on", policy="eager", sampling=DEFAULT)
        getattr(under_test, f"plant_{fault}")()
        first = observer.violations[0]
        assert (first.kind, first.input_name) == (planted.kind, planted.name)
        assert "test_planted_faults.py" in first.stack  # where the faulty call came from
        under_test.step()  # the engine goes on


@pytest.mark.parametrize(("kind", "fault"), DEBUG_CASES, ids=case_ids(DEBUG_CASES))
def test_debug_mode_raises_at_the_replay_the_fault_is_planted_in(kind, fault, observer) -> None:
    planted = FAULTS[fault]
    with served(planted.inference):
        under_test = checked_graph(kind, observer, "debug", policy="raise")
        with pytest.raises(planted.error) as raised:
            getattr(under_test, f"plant_{fault}")()
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (planted.kind, planted.name)
    assert planted.name is None or repr(planted.name) in str(raised.value)


@pytest.mark.parametrize("mode", ["always_on", "debug"])
@pytest.mark.parametrize(("legit", "inference"), LEGIT, ids=legit_ids(LEGIT))
@pytest.mark.parametrize("kind", KINDS)
def test_the_legitimate_pattern_beside_each_fault_records_nothing(kind, legit, inference, mode, observer):
    with served(inference):
        under_test = checked_graph(kind, observer, mode, policy="raise")  # every replay sampled
        getattr(under_test, legit)()
        under_test.settle()
    assert observer.violations == [], [v.message for v in observer.violations]


@pytest.mark.parametrize("kind", KINDS)
def test_clean_steps_with_every_check_and_the_canary_on_every_replay_record_nothing(kind, observer) -> None:
    for mode in ("always_on", "debug"):
        under_test = checked_graph(kind, observer, mode, policy="raise")
        for _ in range(10):
            under_test.step()
    assert observer.violations == []
    assert len(observer.replays) == 2 * 12  # in each mode: two steps in checked_graph(), then ten


@pytest.mark.parametrize("kind", KINDS)
def test_in_graph_sampling_is_silent_and_numbers_drawn_on_the_host_are_a_mismatch(kind, observer) -> None:
    """Noise drawn from torch's generator compares equal (the canary replays and runs eagerly under
    one random state); noise drawn on the host, which a CUDA graph freezes at capture, does not."""
    for mode in ("always_on", "debug"):
        under_test = checked_graph(kind, observer, mode, policy="raise", noise="torch")
        for _ in range(6):
            under_test.step()
    assert observer.violations == []
    runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=1, canary=True)
    frozen = GraphUnderTest.build(kind, runtime, noise="host")
    frozen.step()  # the graph's first replay: sampled at the default schedule
    assert [(v.kind, v.input_name) for v in observer.violations] == MISMATCH


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_writing_other_slots_than_declared_is_found_outside_the_region(kind, observer) -> None:
    under_test = checked_graph(kind, observer, "always_on", policy="eager")
    under_test.plant_baked_slot()
    # The graph wrote elsewhere; the eager step only its declared region.
    assert outside_region_writers(observer.violations) == {"the graph"}
    under_test.step()  # the engine goes on, and its clean steps record nothing more
    assert len([v for v in observer.violations if v.input_name == "kv_cache"]) == 2

"""The planted-fault suite, on the eager backend: every fault class that makes a graph silently
wrong, planted through the public API into a plain, a micro-batched and a piecewise graph, is
recorded in always-on mode and raises in debug mode; clean steps around it record nothing.
Its CUDA twin is ``test_planted_faults_cuda.py``."""

from __future__ import annotations

import pytest

from tests.support.faults import CASES, FAULTS, IDS, KINDS, checked_graph, outside_region_writers

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.mark.parametrize(("kind", "fault"), CASES, ids=IDS)
def test_always_on_records_the_fault_and_the_step_goes_on(kind, fault, observer) -> None:
    under_test = checked_graph(kind, observer, "always_on", policy="eager")
    getattr(under_test, f"plant_{fault}")()
    violation_kind, name, _ = FAULTS[fault]
    first = observer.violations[0]
    assert (first.kind, first.input_name) == (violation_kind, name)
    assert "test_planted_faults.py" in first.stack  # where the faulty call came from
    under_test.step()  # the engine goes on


@pytest.mark.parametrize(("kind", "fault"), CASES, ids=IDS)
def test_debug_mode_raises_once_the_fault_is_recorded(kind, fault, observer) -> None:
    under_test = checked_graph(kind, observer, "debug", policy="raise")
    violation_kind, name, error = FAULTS[fault]
    with pytest.raises(error) as raised:
        getattr(under_test, f"plant_{fault}")()
    assert (observer.violations[0].kind, observer.violations[0].input_name) == (violation_kind, name)
    assert name is None or repr(name) in str(raised.value)


@pytest.mark.parametrize("kind", KINDS)
def test_clean_steps_with_every_check_and_the_canary_on_every_replay_record_nothing(kind, observer) -> None:
    for mode in ("always_on", "debug"):
        under_test = checked_graph(kind, observer, mode, policy="raise")
        for _ in range(10):
            under_test.step()
    assert observer.violations == []
    assert len(observer.replays) == 2 * 12  # in each mode: two steps in checked_graph(), then ten


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_writing_other_slots_than_declared_is_found_outside_the_region(kind, observer) -> None:
    under_test = checked_graph(kind, observer, "always_on", policy="eager")
    under_test.plant_baked_slot()
    # The graph wrote elsewhere; the eager step only its declared region.
    assert outside_region_writers(observer.violations) == {"the graph"}
    under_test.step()  # the engine goes on, and its clean steps record nothing more
    assert len([v for v in observer.violations if v.input_name == "kv_cache"]) == 2

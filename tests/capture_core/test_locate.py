"""Divergence located (eager backend, CPU): a host value baked into one layer of the reference decoder
is found at that layer, every module before it agreeing; clean steps locate nothing; the engine's
state is left as it was found. ``test_locate_cuda.py`` has the probe graph on the H200."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError, ReplayMismatchError
from capture_core.events import DivergenceEvent, ViolationKind
from capture_core.locate import PROBE_RERUN
from tests.capture_core.conftest import RecordingObserver
from tests.support.divergence import BAKED_LAYER, SIZE, BakedGraph

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@dataclass
class Observer(RecordingObserver):
    divergences: list[DivergenceEvent] = field(default_factory=list)

    def on_divergence(self, event: DivergenceEvent) -> None:
        self.divergences.append(event)


def test_a_value_baked_into_one_layer_is_located_at_that_layer() -> None:
    observer = Observer()
    graph = BakedGraph.build(observer)
    graph.step()
    graph.step()
    assert observer.violations == [] and observer.divergences == []
    with graph.runtime.injected_faults():
        graph.step(layer_scale=2.0)  # the graph keeps the captured 1.0
    last = observer.violations[-1]
    assert (last.kind, last.input_name) == (ViolationKind.REPLAY_MISMATCH, "output")
    (found,) = observer.divergences
    assert found.module == f"layers.{BAKED_LAYER}" and found.reproduced and found.injected
    assert found.agreeing == ("embed", "layers.0", "layers.1", f"layers.{BAKED_LAYER}.layer")
    assert found.max_abs_error > 0 and found.max_rel_error == pytest.approx(0.5)  # x1 against x2
    assert found.probe == PROBE_RERUN and found.descriptor == BatchDescriptor(SIZE, SIZE, True)
    assert f"first differs at module 'layers.{BAKED_LAYER}'" in found.message


@pytest.mark.parametrize("layer", [0, 1])
def test_the_first_layer_or_another_is_found_where_it_is(layer: int) -> None:
    observer = Observer()
    graph = BakedGraph.build(observer, baked_layer=layer)
    graph.step(layer_scale=0.5)
    (found,) = observer.divergences
    assert found.module == f"layers.{layer}"
    assert found.agreeing == ("embed", *(f"layers.{i}" for i in range(layer)), f"layers.{layer}.layer")


def test_locating_leaves_the_engine_state_and_the_replay_results_as_they_were() -> None:
    results, caches = [], []
    for locate in (True, False):
        graph = BakedGraph.build(Observer(), locate_divergence=locate)
        graph.step()
        results.append(graph.step(layer_scale=2.0).clone())
        caches.append(graph.kv_cache.clone())
        results.append(graph.step().clone())  # the next step reads the cache the faulty one wrote
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])
    assert torch.equal(caches[0], caches[1])


def test_on_demand_a_clean_graph_locates_nothing_and_says_why() -> None:
    observer = Observer()
    graph = BakedGraph.build(observer)
    graph.step()
    found = graph.wrapper.locate(BatchDescriptor(SIZE, SIZE, True), (*graph.tokens, graph.kv_cache))
    assert found == observer.divergences[-1]
    assert found.module is None and not found.reproduced and found.modules_compared > 0
    assert "computes what the eager step computes" in found.message
    # On demand with today's call other than the captured one: located too.
    moved = graph.wrapper.locate(BatchDescriptor(SIZE, SIZE, True), (*graph.tokens, graph.kv_cache),
                                 {"layer_scale": 3.0})
    assert moved.module == f"layers.{BAKED_LAYER}" and moved.reproduced
    with pytest.raises(GraphCacheError, match="holds no graph for tokens=4"):
        graph.wrapper.locate(BatchDescriptor(4, 4, True))


def test_debug_mode_locates_before_it_raises() -> None:
    observer = Observer()
    # Declared unread, the baked value passes the guard (debug mode would raise its finding first):
    # the canary's mismatch is what raises, once located.
    graph = BakedGraph.build(observer, address_check="debug", unread=("layer_scale",))
    graph.step()
    with pytest.raises(ReplayMismatchError):
        graph.step(layer_scale=2.0)
    (found,) = observer.divergences
    assert found.module == f"layers.{BAKED_LAYER}"


def test_locating_can_be_turned_off() -> None:
    observer = Observer()
    graph = BakedGraph.build(observer, locate_divergence=False)
    graph.step(layer_scale=2.0)
    assert observer.violations and observer.divergences == []

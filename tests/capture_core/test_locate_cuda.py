"""Divergence located on real CUDA graphs (marked ``cuda``: run on the H200): the probe graph of the
captured call, in a pool of its own, finds a host value baked into one layer at that layer, and is
never an unexpected capture: no capture is told, the cache holds the graphs it held, capture stays
locked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from capture_core.events import DivergenceEvent, ViolationKind
from capture_core.locate import PROBE_GRAPH
from tests.capture_core.conftest import RecordingObserver
from tests.support.divergence import BAKED_LAYER, BakedGraph

pytestmark = pytest.mark.cuda


@dataclass
class Observer(RecordingObserver):
    divergences: list[DivergenceEvent] = field(default_factory=list)

    def on_divergence(self, event: DivergenceEvent) -> None:
        self.divergences.append(event)


@pytest.mark.parametrize("layer", [0, BAKED_LAYER])
def test_a_value_baked_into_one_layer_is_located_there_by_a_probe_graph(layer: int) -> None:
    observer = Observer()
    graph = BakedGraph.build(observer, backend="cuda", baked_layer=layer)
    graph.step()
    graph.step()
    torch.cuda.synchronize()
    assert observer.violations == [] and observer.divergences == []
    held, captures = dict(graph.wrapper.graphs), len(observer.captures)
    graph.step(layer_scale=2.0)
    torch.cuda.synchronize()
    (found,) = observer.divergences
    assert found.module == f"layers.{layer}" and found.reproduced and found.probe == PROBE_GRAPH
    assert found.agreeing == ("embed", *(f"layers.{i}" for i in range(layer)), f"layers.{layer}.layer")
    kinds = {v.kind for v in observer.violations}  # the guard names the argument, the canary the output
    assert kinds == {ViolationKind.BAKED_VALUE_CHANGED, ViolationKind.REPLAY_MISMATCH}, (
        "the probe is no unexpected capture")
    assert len(observer.captures) == captures and graph.wrapper.graphs == held and graph.runtime.locked
    # The engine goes on: a clean step after it replays and records nothing more.
    graph.step()
    torch.cuda.synchronize()
    assert len(observer.divergences) == 1

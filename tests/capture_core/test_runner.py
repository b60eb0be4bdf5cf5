"""The decode runner on the reference decoder (CPU, eager backend): replay equals eager."""

from __future__ import annotations

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError, UnexpectedCaptureError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason
from capture_core.wrapper import CUDAGraphWrapper

pytestmark = pytest.mark.usefixtures("single_thread_torch")

SIZES = [1, 2, 4, 8]
CONFIG = ModelConfig.tiny(max_num_seqs=12, max_seq_len=32)
FULL = CUDAGraphMode.FULL


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, seed=1)


def make_runner(model, observer, mode=FULL, **runtime_options) -> DecodeRunner:
    runtime = GraphRuntime("eager", observer=observer, progress=False, **runtime_options)
    runner = DecodeRunner(model, runtime, SIZES, mode=mode)
    runner.capture()
    return runner


def batch(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, CONFIG.vocab_size, (num_tokens,), generator=generator)
    positions = torch.randint(0, CONFIG.max_seq_len, (num_tokens,), generator=generator)
    slot_ids = torch.randperm(CONFIG.max_num_seqs, generator=generator)[:num_tokens]
    return input_ids, positions, slot_ids


@pytest.mark.parametrize("mode", [FULL, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_replay_equals_eager_at_every_bucket_and_between(model, observer, mode):
    runner = make_runner(model, observer, mode)
    for num_tokens in range(1, SIZES[-1] + 1):
        inputs = batch(num_tokens, seed=num_tokens)
        replayed = runner.step(*inputs).clone()
        assert replayed.shape == (num_tokens, CONFIG.vocab_size)
        torch.testing.assert_close(replayed, runner.step_eager(*inputs))
    padded = [d.num_tokens for _, d, _ in observer.replays]
    assert padded == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [real for _, _, real in observer.replays] == list(range(1, 9))
    assert observer.eagers == [] and observer.violations == []


def test_capture_takes_every_bucket_largest_first_then_locks(model, observer):
    runner = make_runner(model, observer, CUDAGraphMode.FULL_AND_PIECEWISE)
    assert [e.descriptor for e in observer.captures] == [BatchDescriptor(n, n, True) for n in (8, 4, 2, 1)]
    assert all(e.input_names == ("input_ids", "positions", "slot_ids", "kv_cache") for e in observer.captures)
    assert all(e.backend == "eager" and e.wrapper == "decode" for e in observer.captures)
    assert runner.runtime.locked and len(runner.graphs) == 4
    assert "backend=eager" in repr(runner)


def test_a_greedy_decode_loop_on_graphs_matches_the_eager_loop(model, observer):
    graphed = make_runner(model, observer)
    eager = DecodeRunner(model, GraphRuntime("eager", progress=False), SIZES)
    slots = torch.tensor([4, 0, 7, 2, 9])
    tokens = torch.tensor([11, 22, 33, 44, 55])
    graph_tokens, eager_tokens = tokens.clone(), tokens.clone()
    for position in range(6):
        positions = torch.full((5,), position)
        graph_tokens = graphed.step(graph_tokens, positions, slots).argmax(-1)
        eager_tokens = eager.step_eager(eager_tokens, positions, slots).argmax(-1)
        assert torch.equal(graph_tokens, eager_tokens)
    assert len(observer.replays) == 6
    torch.testing.assert_close(graphed.kv_cache[:, :, : CONFIG.max_num_seqs], eager.kv_cache[:, :, :-1])


def test_padding_rows_write_only_the_spare_slot(model, observer):
    runner = make_runner(model, observer)
    runner.step(*batch(3, seed=0))  # padded to 4: one padding row
    used = set(batch(3, seed=0)[2].tolist())
    for slot in range(CONFIG.max_num_seqs):
        written = bool(runner.kv_cache[:, :, slot].abs().sum() > 0)
        assert written == (slot in used), slot
    assert runner.kv_cache[:, :, runner.padding_slot].abs().sum() > 0


def test_above_the_largest_size_runs_eagerly_with_the_reason(model, observer):
    runner = make_runner(model, observer)
    inputs = batch(11, seed=3)
    logits = runner.step(*inputs)
    torch.testing.assert_close(logits, runner.step_eager(*inputs))
    assert observer.eagers == [(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 11, FULL)]
    assert observer.replays == [] and observer.violations == []


def test_mode_none_runs_every_step_eagerly(model, observer):
    runner = make_runner(model, observer, CUDAGraphMode.NONE)
    runner.step(*batch(2, seed=0))
    assert runner.graphs == {} and observer.eagers == [(EagerReason.MODE_NONE, 2, CUDAGraphMode.NONE)]


def test_a_planted_address_drift_is_recorded_as_injected_and_gives_stale_logits(model, observer):
    runner = make_runner(model, observer)
    first, second = batch(4, seed=5), batch(4, seed=6)
    runner.step(*first)
    drifted = runner.inject_address_drift(second[0], first[1], first[2]).clone()
    (event,) = observer.violations
    assert event.kind is ViolationKind.ADDRESS_DRIFT and event.injected and event.input_name == "input_ids"
    assert "test_runner.py" in event.stack and "capture_core/runner.py" not in event.stack
    torch.testing.assert_close(drifted, runner.step_eager(*first))  # the previous step's tokens
    assert not torch.allclose(drifted, runner.step_eager(second[0], first[1], first[2]))


def test_a_planted_address_drift_raises_in_debug_mode(model, observer):
    runner = make_runner(model, observer, address_check="debug")
    with pytest.raises(AddressDriftError, match="'input_ids'"):
        runner.inject_address_drift(*batch(2, seed=0))
    assert observer.violations[0].injected


def test_a_planted_unexpected_capture_follows_the_policy(model, observer):
    runner = make_runner(model, observer, unexpected_capture="raise")
    with pytest.raises(UnexpectedCaptureError):
        runner.inject_unexpected_capture()
    eager_runner = make_runner(model, observer, unexpected_capture="eager")
    descriptor = eager_runner.inject_unexpected_capture()
    assert descriptor == BatchDescriptor(3, 3, True)  # no bucket of 3: start-up never captured it
    planted = [(ViolationKind.UNEXPECTED_CAPTURE, True)] * 2
    assert [(v.kind, v.injected) for v in observer.violations] == planted
    assert observer.eagers == [(EagerReason.UNEXPECTED_CAPTURE, 3, FULL)]
    assert not runner.kv_cache[:, :, : CONFIG.max_num_seqs].any()  # dummy inputs touch only the spare slot


def test_bad_configurations_and_inputs_are_refused_clearly(model, observer):
    runtime = GraphRuntime("eager", progress=False)
    with pytest.raises(ValueError, match="above max_num_seqs=12"):
        DecodeRunner(model, runtime, [1, 16])
    with pytest.raises(ValueError, match="decodes in PIECEWISE"):
        DecodeRunner(model, runtime, SIZES, mode=CUDAGraphMode.PIECEWISE)
    runner = make_runner(model, observer)
    with pytest.raises(ValueError, match="positive"):
        runner.route(0)
    with pytest.raises(ValueError, match="one length"):
        runner.step(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(3))


def test_capture_inside_an_outer_phase_leaves_the_lock_to_it(model, observer):
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    runner = DecodeRunner(model, runtime, [1, 2])
    with runtime.capture_phase():
        runner.capture()
        assert not runtime.locked
    assert runtime.locked and len(observer.captures) == 2


def test_an_observer_attached_after_construction_sees_every_event(model, observer):
    runtime = GraphRuntime("eager", progress=False)
    runner = DecodeRunner(model, runtime, [1, 2])
    runtime.observer = observer  # as the demo does once its recorder is up
    runner.capture()
    runner.step(*batch(2, seed=0))
    runner.step(*batch(5, seed=0))
    assert len(observer.captures) == 2 and len(observer.replays) == 1
    assert observer.eagers == [(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 5, FULL)]


class _NamedCuda:
    """Stands in for the CUDA backend's name only: the runner must refuse before any capture."""

    name = "cuda"

    def capture(self, fn, args, kwargs, warmup_iters):
        raise AssertionError("the runner should have refused first")


def test_a_cpu_model_on_the_cuda_backend_is_refused(model):
    with pytest.raises(ValueError, match="move it to the GPU"):
        DecodeRunner(model, GraphRuntime(_NamedCuda(), progress=False), SIZES)


@pytest.mark.parametrize("policy", ["raise", "eager", "capture"])
def test_a_second_runner_started_after_start_up_is_an_unexpected_capture_by_policy(model, observer, policy):
    runner = make_runner(model, observer, unexpected_capture=policy)
    draft = DecodeRunner(model, runner.runtime, [1, 2], name="draft")  # a lazily built draft model
    if policy == "raise":
        with pytest.raises(UnexpectedCaptureError, match="'draft'"):
            draft.capture()
    else:
        draft.capture()
    late = [v for v in observer.violations if v.wrapper == "draft"]
    assert late and all(v.kind is ViolationKind.UNEXPECTED_CAPTURE for v in late)
    assert all("test_runner.py" in v.stack for v in late)
    assert len(late) == (1 if policy == "raise" else 2)  # every capture attempt, on every bucket
    drafts = [e.unexpected for e in observer.captures if e.wrapper == "draft"]
    assert drafts == ([True, True] if policy == "capture" else [])


def test_weights_reloaded_by_assignment_are_caught_through_the_runner(model, observer):
    fresh = ReferenceDecoder(CONFIG, seed=1)
    runner = make_runner(fresh, observer)
    runner.step(*batch(4, seed=0))
    fresh.lm_head.weight = torch.nn.Parameter(fresh.lm_head.weight.detach().clone(), requires_grad=False)
    runner.step(*batch(4, seed=1))
    (event,) = observer.violations
    assert (event.kind, event.input_name, event.wrapper) == (
        ViolationKind.ADDRESS_DRIFT, "self.lm_head.weight", "decode"
    )


def test_a_replay_without_the_step_s_writes_is_stale_through_the_runner(model, observer):
    runner = make_runner(model, observer)
    runner.step(*batch(4, seed=0))
    views = runner.buffers.views(4)
    with torch.no_grad(), set_forward_context(FULL, runner.route(4).descriptor, 4):
        runner.graphed(views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    assert [(v.kind, v.input_name) for v in observer.violations] == [
        (ViolationKind.STALE_INPUT, name) for name in ("input_ids", "positions", "slot_ids")
    ]


def test_the_canary_confirms_a_planted_drift_computed_the_previous_step(model, observer):
    runner = make_runner(model, observer, canary=True, sampling=Sampling(first=0, every=1))
    first, second = batch(4, seed=5), batch(4, seed=6)
    runner.step(*first)
    runner.inject_address_drift(second[0], first[1], first[2])
    # The drift, then what the stale ids made the graph compute: the KV it wrote (a wrong write is
    # said first), then the logits.
    assert [(v.kind, v.input_name) for v in observer.violations][:3] == [
        (ViolationKind.ADDRESS_DRIFT, "input_ids"), (ViolationKind.REPLAY_MISMATCH, "kv_cache"),
        (ViolationKind.REPLAY_MISMATCH, "output"),
    ]


class NoisyPadding(ReferenceDecoder):
    """Fills the spare padding slot with fresh noise every step, as padding rows' scatters into one
    slot land in any order on a GPU (from a generator of its own, which the canary leaves alone:
    the replay and the eager step see different noise, as they would see different orders)."""

    def __init__(self, config, seed):
        super().__init__(config, seed)
        self.order = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, positions, slot_ids, kv_cache, attn_metadata=None):
        kv_cache[:, :, self.config.padding_slot].normal_(generator=self.order)
        return super().forward(input_ids, positions, slot_ids, kv_cache, attn_metadata)


def test_the_canary_compares_what_is_real_and_leaves_the_padding_out(observer):
    model = NoisyPadding(CONFIG, seed=1)
    runner = make_runner(model, observer, canary=True, sampling=Sampling(first=0, every=1))
    for seed in range(3):
        runner.step(*batch(3, seed=seed))  # padded to 4: one padding row, reading the noisy slot
    assert observer.violations == [] and len(observer.replays) == 3
    # A wrapper told nothing of the padding compares all of it, and the noise shows.
    runtime = GraphRuntime("eager", observer=observer, progress=False, canary=True, sampling=Sampling(0, 1))
    plain = CUDAGraphWrapper(model, runtime, FULL, name="plain", mutated_inputs=["kv_cache"])
    ids, positions, slots = batch(3, seed=9)
    views = runner.buffers.load(4, input_ids=ids, positions=positions, slot_ids=slots)
    args = (views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    descriptor = BatchDescriptor(4, 4, True)
    with torch.no_grad():
        with runtime.capture_phase(), set_forward_context(FULL, descriptor, 3):
            plain(*args)
        with set_forward_context(FULL, descriptor, 3):
            plain(*args)
    assert {v.input_name for v in observer.violations} == {"kv_cache"}

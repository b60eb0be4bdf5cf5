"""A graph output read after a later replay of the same graph wrote it again (debug mode)."""

from __future__ import annotations

import pytest
import torch

from capture_core.errors import StaleOutputError
from capture_core.events import ViolationKind
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime

pytestmark = pytest.mark.usefixtures("single_thread_torch")

CONFIG = ModelConfig.tiny(max_num_seqs=8, max_seq_len=32)


def runner(observer, mode: str = "debug", backend: str = "eager") -> DecodeRunner:
    device = "cuda" if backend == "cuda" else "cpu"
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=32, device=device)
    runtime = GraphRuntime(backend, observer=observer, progress=False, address_check=mode)
    decode = DecodeRunner(ReferenceDecoder(config, seed=2), runtime, [2, 4])
    decode.capture()
    return decode


def batch(token: int, count: int = 3, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    ids = torch.full((count,), token, device=device)
    return ids, torch.arange(count, device=device) + token, torch.arange(count, device=device)


def test_a_draft_s_logits_read_after_its_graph_ran_again_raise_in_debug_mode(observer) -> None:
    decode = runner(observer)
    draft = decode.step(*batch(1))  # a view of the 4-token graph's output
    kept = draft[:2]  # and a view of that view
    assert torch.isfinite(draft).all()  # read before the next replay: fine
    verified = decode.step(*batch(2))  # the same graph replays: draft's memory is written again
    with pytest.raises(StaleOutputError, match=r"output 'output' of replay 1 was read after replay 2"):
        kept.argmax(-1)
    [event] = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.STALE_OUTPUT, "output")
    assert verified.shape == (3, CONFIG.vocab_size) and torch.isfinite(verified).all()


def test_what_is_computed_or_copied_from_an_output_stays_good_and_so_do_other_graphs(observer) -> None:
    decode = runner(observer)
    logits = decode.step(*batch(1))
    tokens, copy = logits.argmax(-1), logits.clone()
    assert type(tokens) is torch.Tensor and type(copy) is torch.Tensor  # no marker goes further
    small = decode.step(*batch(1, count=2))  # another graph (2 tokens): logits' memory is untouched
    decode.step(*batch(3))  # the 4-token graph again
    assert logits.shape == (3, CONFIG.vocab_size) and logits.dtype is torch.float32  # metadata: no read
    assert torch.equal(tokens, copy.argmax(-1)) and torch.isfinite(small).all()
    assert observer.violations == []


def test_outside_debug_mode_outputs_are_handed_back_as_they_are(observer) -> None:
    decode = runner(observer, mode="always_on")
    logits = decode.step(*batch(1))
    decode.step(*batch(2))
    assert type(logits) is torch.Tensor and torch.isfinite(logits).all()  # the engine's own business
    assert observer.violations == []


@pytest.mark.cuda
def test_cuda_a_kept_output_read_after_the_next_replay_raises(observer) -> None:
    decode = runner(observer, backend="cuda")
    draft = decode.step(*batch(1, device="cuda"))
    decode.step(*batch(2, device="cuda"))
    with pytest.raises(StaleOutputError):
        draft.sum().item()
    fresh = decode.step(*batch(3, device="cuda")).clone()
    decode.step(*batch(4, device="cuda"))
    assert torch.isfinite(fresh).all() and len(observer.violations) == 1

"""The demo's traffic loops: the scheduled trace, step by step, through the runner, faults planted.

Decode-only runs feed uniform decode steps to the ``DecodeRunner``; mixed runs feed flattened
prefill/decode steps to the ``MixedBatchRunner``. Each feed keeps the greedy-decoding state (every
request feeds back its own last token). The two planted faults go through the runner's own
``inject_address_drift`` / ``inject_unexpected_capture``: the drift into the first step at or after
a third of the run that replays a graph, the unexpected capture after the step at two thirds.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dashboard.demo.options import RAMP_STEPS, STEP_SECONDS, is_decode_only, token_budget

if TYPE_CHECKING:
    import torch

    from capture_core.mixed_runner import MixedBatchRunner
    from capture_core.reference import FlatBatch, Step, Trace, TrafficConfig
    from capture_core.runner import DecodeRunner
    from dashboard.demo.workload import Runner


@dataclass
class DemoResult:
    """What the run did, for the summary."""

    steps: int
    seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    drift_step: int | None = None
    """The step that carried the planted address drift (None: none was planted)."""
    unexpected_step: int | None = None
    """The step after which the unexpected capture was planted (None: none was)."""
    drift_raised: bool = False
    """The drift raised (debug address checks), as it would in CI; it was recorded all the same."""
    skipped: list[str] = field(default_factory=list)
    """Why a planted fault could not be planted (mode none has no graph to drift)."""
    prefill_steps: int | None = None
    """Steps that carried prompt chunks (None for the decode-only demo)."""


class Feed(Protocol):
    """Builds each scheduled step's runner inputs and feeds the sampled tokens back."""

    label: str

    def prepare(self, step: Step) -> Any: ...

    def replays(self, prepared: Any) -> bool: ...

    def update(self, prepared: Any, logits: torch.Tensor) -> None: ...

    def postfix(self, step: Step) -> dict[str, int]: ...


def traffic_config(args: argparse.Namespace) -> TrafficConfig:
    from capture_core.reference import TrafficConfig

    common = {"max_num_seqs": args.max_batch, "speedup": args.speedup, "step_seconds": STEP_SECONDS,
              "seed": args.seed}
    if is_decode_only(args):
        return TrafficConfig(**common)
    return TrafficConfig(**common, ramp_steps=RAMP_STEPS, chunked_prefill=True,
                         max_num_batched_tokens=token_budget(args.max_batch))


def serve_traffic(runner: Runner, trace: Trace, args: argparse.Namespace) -> DemoResult:
    """Run ``args.steps`` scheduled steps through ``runner``, planting the faults unless told not to."""
    from capture_core.errors import AddressDriftError
    from capture_core.faults import FaultNotPlantable
    from capture_core.reference import ContinuousBatchScheduler

    feed = _feed_for(runner)
    scheduler = ContinuousBatchScheduler(trace, traffic_config(args))
    drift_due = None if args.no_faults else args.steps // 3
    capture_due = None if args.no_faults else (2 * args.steps) // 3
    result = DemoResult(args.steps, prefill_steps=None if is_decode_only(args) else 0)
    if drift_due is not None and runner.mode.name == "NONE":
        drift_due = None
        result.skipped.append("no drift planted: mode none captures no graphs, so there is no graph to drift")
    started = time.perf_counter()
    with _progress(feed.label, args.steps) as bar:
        for step in itertools.islice(scheduler.steps(), args.steps):
            prepared = feed.prepare(step)
            if drift_due is not None and step.index >= drift_due and feed.replays(prepared):
                drift_due, result.drift_step = None, step.index
                try:
                    logits = runner.inject_address_drift(*prepared.inputs)
                except AddressDriftError:  # GRAPH_INSPECTOR_DEBUG=1 makes drifts raise; recorded all the same
                    result.drift_raised = True
                    logits = runner.step(*prepared.inputs)
            else:
                logits = runner.step(*prepared.inputs)
            feed.update(prepared, logits)
            if step.index == capture_due:
                try:
                    runner.inject_unexpected_capture()
                    result.unexpected_step = step.index
                except FaultNotPlantable as why:
                    result.skipped.append(f"no unexpected capture planted: {why}")
            result.batch_sizes.append(step.num_real_tokens)
            if result.prefill_steps is not None:
                result.prefill_steps += bool(step.prefill_chunks)
            bar.set_postfix(feed.postfix(step), refresh=False)
            bar.update(1)
    result.seconds = time.perf_counter() - started
    return result


def _feed_for(runner: Runner) -> Feed:
    from capture_core.runner import DecodeRunner

    return DecodeFeed(runner) if isinstance(runner, DecodeRunner) else MixedFeed(runner)


@contextmanager
def _progress(label: str, total: int) -> Iterator[Any]:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # On a terminal the bar redraws often; in a log (CI, kubectl logs) a line every few seconds is enough.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    # A warning logged while the bar runs (the injected faults' messages) is written on a line of its
    # own above the bar, not onto the end of the bar's line.
    with logging_redirect_tqdm(), tqdm(total=total, desc=label, unit="step", file=sys.stderr,
                                       dynamic_ncols=True, mininterval=interval) as bar:
        yield bar


@dataclass
class DecodeStep:
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """``DecodeRunner.step``'s arguments: token ids, positions, KV slots."""


class _SlotOwners:
    """Which request holds each KV slot, and the model's sizes a feed keeps tokens within."""

    def __init__(self, runner: Runner) -> None:
        config = runner.model.config
        self.vocab: int = config.vocab_size
        self.max_seq_len: int = config.max_seq_len
        self.device = runner.device
        self.owner: dict[int, int] = {}

    def first_token(self, request_id: int) -> int:
        """A stand-in for a request's last prompt token: any fixed token per request will do."""
        return (request_id * 7919 + 1) % self.vocab


class DecodeFeed(_SlotOwners):
    """Greedy decoding state per KV slot: each request feeds back its own last token.

    Prompts are not prefilled (the demo shows decode graphs), so a request's position counts its
    generated tokens, wrapping at the model's ``max_seq_len``; its first token is seeded from its id.
    """

    label = "Decoding"

    def __init__(self, runner: DecodeRunner) -> None:
        import torch

        super().__init__(runner)
        self.runner = runner
        self.start: dict[int, int] = {}
        self.next_token = torch.zeros(runner.max_num_seqs + 1, dtype=torch.long, device=runner.device)

    def prepare(self, step: Step) -> DecodeStep:
        import torch

        positions = []
        for rid, slot, position in zip(step.decode_request_ids, step.decode_slots, step.decode_positions,
                                       strict=True):
            if self.owner.get(slot) != rid:  # a new request took this slot
                self.owner[slot] = rid
                self.start[slot] = position
                self.next_token[slot] = self.first_token(rid)
            positions.append((position - self.start[slot]) % self.max_seq_len)
        slots = torch.tensor(step.decode_slots, dtype=torch.long, device=self.device)
        positions_tensor = torch.tensor(positions, dtype=torch.long, device=self.device)
        return DecodeStep((self.next_token[slots], positions_tensor, slots))

    def replays(self, prepared: DecodeStep) -> bool:
        return self.runner.route(len(prepared.inputs[0])).eager_reason is None

    def update(self, prepared: DecodeStep, logits: torch.Tensor) -> None:
        self.next_token[prepared.inputs[2]] = logits.argmax(dim=-1)

    def postfix(self, step: Step) -> dict[str, int]:
        return {"batch": step.num_real_tokens, "queued": step.num_waiting}


@dataclass
class MixedStep:
    batch: FlatBatch
    rows: list[int]
    """The logits rows that sample a next token (a decode's, a prompt's last chunk's last token)."""
    sampled: list[int]
    """The KV slot each of those rows samples for."""

    @property
    def inputs(self) -> tuple[Any, ...]:
        """``MixedBatchRunner.step``'s arguments."""
        batch = self.batch
        return batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata


class MixedFeed(_SlotOwners):
    """Token ids, positions and KV rows for mixed steps: greedy decoding per KV slot.

    A request new to its slot starts the slot's row afresh. Prompt tokens are stand-ins derived
    from the request and position; the last prompt chunk's logits give the first generated token,
    each decode feeds back its own.
    A request whose context outgrows the model's row starts the row over (it keeps its later
    tokens' positions in range), as the decode-only demo wraps its positions.
    """

    label = "Serving"

    def __init__(self, runner: MixedBatchRunner) -> None:
        super().__init__(runner)
        self.runner = runner
        self.length: dict[int, int] = {}
        self.next_token: dict[int, int] = {}

    def _claim(self, request_id: int, slot: int, num_tokens: int) -> int:
        """The context already in ``slot`` for ``num_tokens`` new tokens of ``request_id``."""
        if self.owner.get(slot) != request_id:
            self.owner[slot] = request_id
            self.length[slot] = 0
            self.next_token[slot] = self.first_token(request_id)
        if self.length[slot] + num_tokens > self.max_seq_len:
            self.length[slot] = 0
        context = self.length[slot]
        self.length[slot] = context + num_tokens
        return context

    def prepare(self, step: Step) -> MixedStep:
        """The flattened step, and which logits rows sample which slot's next token."""
        from capture_core.reference import flatten_requests

        tokens: list[list[int]] = []
        contexts: list[int] = []
        slots: list[int] = []
        for rid, slot in zip(step.decode_request_ids, step.decode_slots, strict=True):
            contexts.append(self._claim(rid, slot, 1))
            tokens.append([self.next_token[slot]])
            slots.append(slot)
        for chunk in step.prefill_chunks:
            contexts.append(self._claim(chunk.request_id, chunk.slot, chunk.num_tokens))
            first = chunk.start
            tokens.append([(chunk.request_id * 7919 + (first + i) * 104729) % self.vocab
                           for i in range(chunk.num_tokens)])
            slots.append(chunk.slot)
        rows, sampled = [], []
        row = 0
        for r, slot in enumerate(slots):
            row += len(tokens[r])
            if r < step.num_decode_tokens or step.prefill_chunks[r - step.num_decode_tokens].final:
                rows.append(row - 1)
                sampled.append(slot)
        batch = flatten_requests(tokens, contexts, slots, device=self.device)
        return MixedStep(batch, rows, sampled)

    def replays(self, prepared: MixedStep) -> bool:
        return self.runner.route(prepared.batch.attn_metadata).eager_reason is None

    def update(self, prepared: MixedStep, logits: torch.Tensor) -> None:
        if prepared.rows:
            chosen = logits[prepared.rows].argmax(dim=-1).tolist()
            self.next_token.update(zip(prepared.sampled, chosen, strict=True))

    def postfix(self, step: Step) -> dict[str, int]:
        return {"tokens": step.num_real_tokens, "prefill": step.num_prefill_tokens}

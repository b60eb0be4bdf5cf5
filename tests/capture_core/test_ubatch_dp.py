"""coordinate_batch_across_dp with 2 and 4 real processes on gloo, plus the single-rank rules."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from capture_core.modes import CUDAGraphMode
from capture_core.ubatch.dp import DPCoordination, DPCoordinationError, DPRequest, coordinate_batch_across_dp
from capture_core.ubatch.slices import UBatchConfig

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
DBO = UBatchConfig(enabled=True, num_ubatches=2, decode_token_threshold=8, prefill_token_threshold=64)

# name -> per rank (real tokens, padded tokens, uniform decode, mode, micro-batching enabled),
# and the agreed (should_ubatch, mode, tokens per rank) every rank must return.
Rank = tuple[int, int, bool, CUDAGraphMode, bool]
Agreed = tuple[bool, CUDAGraphMode, tuple[int, ...]]

# name -> per rank (real tokens, padded tokens, uniform decode, mode, micro-batching enabled),
# and the agreed (should_ubatch, mode, tokens per rank) that every rank must return.
SCENARIOS: dict[int, dict[str, tuple[list[Rank], Agreed]]] = {
    2: {
        "all_agree": (
            [(20, 24, True, FULL, True), (30, 32, True, FULL, True)],
            (True, FULL, (32, 32)),
        ),
        "one_below_threshold": (
            [(20, 24, True, FULL, True), (6, 8, True, FULL, True)],
            (False, FULL, (24, 24)),
        ),
        "one_with_dbo_off": (
            [(20, 24, True, FULL, True), (30, 32, True, FULL, False)],
            (False, FULL, (32, 32)),
        ),
        "last_ubatch_empty": (
            # Rank 1 has 9 real tokens but rank 0 pads to 64: the split at 32 leaves rank 1 nothing.
            [(60, 64, True, FULL, True), (9, 16, True, FULL, True)],
            (False, FULL, (64, 64)),
        ),
        "lowest_mode_wins": (
            [(20, 24, True, FULL, True), (30, 32, False, PIECEWISE, False)],
            (False, PIECEWISE, (32, 32)),
        ),
        "eager_without_ubatch_keeps_own_sizes": (
            [(20, 20, True, NONE, False), (30, 30, True, FULL, False)],
            (False, NONE, (20, 30)),
        ),
        "eager_with_ubatch_still_pads": (
            [(100, 100, False, NONE, True), (70, 70, False, NONE, True)],
            (True, NONE, (100, 100)),
        ),
    },
    4: {
        "smallest_rank_would_have_empty_last_ubatch": (
            # Rank 0's 9 real tokens all sit below the split at 48 // 2 = 24.
            [(9, 16, True, FULL, True), (12, 16, True, FULL, True),
             (40, 48, True, FULL, True), (17, 24, True, FULL, True)],
            (False, FULL, (48, 48, 48, 48)),
        ),
        "all_agree": (
            [(30, 32, True, FULL, True), (28, 32, True, FULL, True),
             (40, 48, True, FULL, True), (33, 40, True, FULL, True)],
            (True, FULL, (48, 48, 48, 48)),
        ),
        "one_rank_piecewise": (
            [(130, 136, True, FULL, True), (140, 144, True, FULL, True),
             (200, 256, False, PIECEWISE, True), (150, 152, True, FULL, True)],
            (True, PIECEWISE, (256, 256, 256, 256)),
        ),
        "all_eager_keep_their_own_sizes": (
            [(3, 3, True, NONE, True), (5, 5, True, NONE, True),
             (7, 7, True, NONE, True), (2, 2, True, NONE, True)],
            (False, NONE, (3, 5, 7, 2)),
        ),
    },
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, timeout_case: bool) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        # Generous for start-up: ranks of a busy 2-core machine reach the rendezvous seconds apart.
        timeout=datetime.timedelta(seconds=60),
    )
    # The stuck-step case uses its own group with a short timeout, so it fails fast.
    impatient = dist.new_group(timeout=datetime.timedelta(seconds=2)) if timeout_case else None
    answers: dict[str, object] = {}
    try:
        for name, (inputs, _) in SCENARIOS[world].items():
            real, padded, uniform, mode, enabled = inputs[rank]
            config = dataclasses.replace(DBO, enabled=enabled)
            agreed = coordinate_batch_across_dp(
                real, num_tokens_padded=padded, ubatch_config=config, uniform_decode=uniform, mode=mode
            )
            across = list(agreed.num_tokens_across_dp)
            answers[name] = [agreed.should_ubatch, agreed.mode.name, across, agreed.num_tokens_after_padding]
            answers[f"{name} requests"] = [
                [r.num_tokens_unpadded, r.num_tokens_padded, r.mode.name] for r in agreed.requests
            ]
        if timeout_case:
            # Rank 1 skips this step's coordination: rank 0 must fail with a clear error, not hang.
            if rank == 0:
                started = time.monotonic()
                try:
                    coordinate_batch_across_dp(8, mode=FULL, group=impatient)
                except DPCoordinationError as exc:
                    answers["timeout"] = [str(exc), time.monotonic() - started]
            else:
                # Stay alive (without calling) until rank 0 has seen its error and written it down.
                deadline = time.monotonic() + 20
                while not Path(out_dir, "rank0.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(answers))
        if not timeout_case:
            dist.destroy_process_group()
    if timeout_case:
        # A gloo group whose collective timed out can abort the process (SIGABRT from its threads)
        # while the interpreter tears down: the answers are written, so leave without teardown.
        os._exit(0)


def _spawn(world: int, tmp_path: Path, timeout_case: bool = False) -> list[dict]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path), timeout_case), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_over_gloo(world: int, tmp_path: Path) -> None:
    answers = _spawn(world, tmp_path, timeout_case=(world == 2))
    for name, (inputs, (ubatch, mode, across)) in SCENARIOS[world].items():
        asked = [[real, padded, wanted.name] for real, padded, _, wanted, _ in inputs]
        for rank in range(world):
            assert answers[rank][name] == [ubatch, mode.name, list(across), across[rank]], (name, rank)
            assert answers[rank][f"{name} requests"] == asked, (name, rank)  # every rank hears every ask
    if world == 2:
        message, seconds = answers[0]["timeout"]
        assert "rank 0 of 2" in message and "every rank must call coordinate_batch_across_dp" in message
        assert seconds < 10


def test_single_rank_applies_the_same_rules_locally() -> None:
    assert not dist.is_initialized()
    agreed = coordinate_batch_across_dp(
        40, num_tokens_padded=48, ubatch_config=DBO, uniform_decode=True, mode=FULL
    )
    assert (agreed.should_ubatch, agreed.mode, agreed.num_tokens_across_dp, agreed.world_size) == (
        True, FULL, (48,), 1
    )
    # 20 real tokens in 48: the split at 24 leaves the last ubatch only padding.
    agreed = coordinate_batch_across_dp(
        20, num_tokens_padded=48, ubatch_config=DBO, uniform_decode=True, mode=FULL
    )
    assert not agreed.should_ubatch and agreed.num_tokens_after_padding == 48
    # One token cannot be split in two, even with thresholds that would allow it.
    tiny = UBatchConfig(enabled=True, decode_token_threshold=0)
    assert not coordinate_batch_across_dp(1, ubatch_config=tiny, uniform_decode=True, mode=FULL).should_ubatch
    assert coordinate_batch_across_dp(2, ubatch_config=tiny, uniform_decode=True, mode=FULL).should_ubatch
    # Off by default.
    assert not coordinate_batch_across_dp(400, mode=PIECEWISE).should_ubatch


def test_an_observer_hears_every_agreement_with_what_each_rank_asked() -> None:
    heard: list[DPCoordination] = []

    class Listener:
        def on_dp_coordination(self, coordination: DPCoordination) -> None:
            heard.append(coordination)

    agreed = coordinate_batch_across_dp(
        40, num_tokens_padded=48, ubatch_config=DBO, uniform_decode=True, mode=FULL, observer=Listener()
    )
    assert heard == [agreed]
    assert agreed.requests == (DPRequest(40, 48, True, FULL),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_tokens_unpadded": -1}, "num_tokens_unpadded must be >= 0"),
        ({"num_tokens_unpadded": 10, "num_tokens_padded": 8}, r"num_tokens_padded \(8\) is below"),
        ({"num_tokens_unpadded": 10, "mode": CUDAGraphMode.FULL_AND_PIECEWISE}, "runtime mode"),
    ],
)
def test_inconsistent_inputs_are_rejected_before_any_collective(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        coordinate_batch_across_dp(**kwargs)

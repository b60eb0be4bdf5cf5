"""The ranks of one job checked against each other, with 2 and 4 real gloo processes on CPU.

Every rank runs the reference decoder from graphs (eager backend), agrees on each step with the
others through ``coordinate_batch_across_dp(..., observer=recorder)`` and replays the agreed size,
as data-parallel ranks do; each rank's Recorder takes its rank from torch.distributed and the job
from its argument. Three jobs per launch: consistent ranks; one rank that captured another size;
one rank that, at one step, replayed its own padded size instead of the agreed one.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from capture_core.modes import CUDAGraphMode
from capture_core.ubatch.dp import coordinate_batch_across_dp
from inspector.reading.metrics import InspectorCollector
from inspector.storage.models import Run, Violation
from inspector.storage.store import open_store
from tests.support.cli import cli
from tests.support.engine import decode_engine, decode_step

SIZES = [1, 2, 4, 8, 16]
ODD_SIZES = [1, 2, 4, 12, 16]
# Real tokens per step, for up to 4 ranks. No step's largest padded size is 8 or 12, so a rank that
# captured 12 instead of 8 replays what the others replay: only its captures differ.
REAL_TOKENS = [(1, 1, 1, 1), (2, 1, 2, 2), (3, 4, 2, 1), (12, 9, 16, 14), (1, 2, 1, 1), (16, 16, 10, 9),
               (3, 3, 3, 4), (4, 2, 1, 1), (2, 2, 2, 2), (9, 16, 3, 1), (1, 1, 1, 1), (4, 4, 4, 4)]
DIVERGENT_STEP = 7
JOBS = ("consistent", "capture_differs", "replay_differs")


def odd_rank(world: int) -> int:
    """The rank made to differ: with 2 ranks rank 1 (a tie goes to rank 0), with 4 rank 2."""
    return world // 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, url: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for job in JOBS:
            _run_job(job, rank, world, url)
    finally:
        dist.destroy_process_group()


def _run_job(job: str, rank: int, world: int, url: str) -> None:
    from inspector.recording.recorder import Recorder

    odd = rank == odd_rank(world)
    sizes = ODD_SIZES if job == "capture_differs" and odd else SIZES
    recorder = Recorder(url, label=f"{job} rank {rank}", job=f"{job}-{world}", flush_interval=0.1).start()
    runner = decode_engine(sizes, recorder)
    for step, reals in enumerate(REAL_TOKENS):
        real = reals[rank]
        own = runner.route(real).descriptor.num_tokens
        agreed = coordinate_batch_across_dp(real, num_tokens_padded=own, mode=CUDAGraphMode.FULL,
                                            observer=recorder)
        padded = agreed.num_tokens_after_padding
        if job == "replay_differs" and odd and step == DIVERGENT_STEP:
            padded = own  # the bug: this rank ignores the agreement for one step
        decode_step(runner, padded)  # the rank pads its batch to the agreed size (dummy requests)
    # Rank 0 compares the ranks once more when it closes: let the others write their last steps first.
    if rank != 0:
        recorder.close()
    dist.barrier()
    if rank == 0:
        recorder.close()
    dist.barrier()


@pytest.fixture(scope="module", params=[2, 4])
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """(world size, database URL) after one launch of ``world`` gloo processes running every job."""
    world = request.param
    url = f"sqlite:///{tmp_path_factory.mktemp(f'ranks{world}') / 'ranks.db'}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(world, _free_port(), url), nprocs=world, join=True)
    return world, url


def _divergences(url: str, job: str) -> list[tuple[int, str, str, str]]:
    """(rank, what, descriptor key, message) of the job's rank_divergence violations."""
    store = open_store(url, upgrade=False)
    try:
        with store.session() as session:
            rows = session.execute(
                select(Run.rank, Violation.wrapper, Violation.descriptor_key, Violation.message)
                .join(Run, Run.id == Violation.run_id)
                .where(Run.job == job, Violation.kind == "rank_divergence")
                .order_by(Run.rank, Violation.id)
            ).all()
        return [tuple(row) for row in rows]
    finally:
        store.dispose()


@pytest.mark.slow
def test_the_job_and_rank_of_every_process_reach_its_run(launched: tuple[int, str]) -> None:
    world, url = launched
    store = open_store(url, upgrade=False)
    with store.session() as session:
        runs = session.execute(select(Run.job, Run.rank, Run.world_size).order_by(Run.job, Run.rank)).all()
    store.dispose()
    assert [tuple(r) for r in runs] == [(f"{job}-{world}", rank, world) for job in sorted(JOBS)
                                         for rank in range(world)]


@pytest.mark.slow
def test_consistent_ranks_pass(launched: tuple[int, str]) -> None:
    world, url = launched
    assert _divergences(url, f"consistent-{world}") == []


@pytest.mark.slow
def test_a_rank_that_captured_another_size_is_reported(launched: tuple[int, str]) -> None:
    world, url = launched
    odd, job = odd_rank(world), f"capture_differs-{world}"
    others = ", ".join(str(r) for r in range(world) if r != odd)
    ranks = f"rank{'s' if world > 2 else ''} {others}"
    assert _divergences(url, job) == [
        (odd, f"captured graphs of job {job}", "tokens=12,reqs=any,uniform=0",
         f"rank {odd} captured full tokens=12,reqs=any,uniform=0 (captured size 12), which {ranks} did not"),
        (odd, f"captured graphs of job {job}", "tokens=8,reqs=any,uniform=0",
         f"rank {odd} did not capture full tokens=8,reqs=any,uniform=0 (captured size 8), which {ranks} "
         "captured"),
    ]


@pytest.mark.slow
def test_a_rank_that_replayed_another_graph_for_a_step_is_reported_with_the_step(
    launched: tuple[int, str]
) -> None:
    world, url = launched
    odd, job = odd_rank(world), f"replay_differs-{world}"
    others = ", ".join(str(r) for r in range(world) if r != odd)
    ranks = f"rank{'s' if world > 2 else ''} {others}"
    own = {2: 2, 4: 1}[world]  # the odd rank's own padded size at that step
    assert _divergences(url, job) == [
        (odd, f"step sequence of job {job}", f"tokens={own},reqs=any,uniform=0",
         f"step {DIVERGENT_STEP}: rank {odd} ran full tokens={own},reqs=any,uniform=0, where {ranks} ran "
         "full tokens=4,reqs=any,uniform=0"),
    ]


@pytest.mark.slow
def test_divergences_are_in_the_metrics_and_fail_the_report(launched: tuple[int, str]) -> None:
    world, url = launched
    store = open_store(url, upgrade=False)
    registry = CollectorRegistry()
    registry.register(InspectorCollector(store))
    assert registry.get_sample_value("graph_inspector_violations_total", {"kind": "rank_divergence"}) == 3
    store.dispose()
    report = cli("report", "--db", url)
    assert report.returncode == 1
    assert report.stdout.count("FAIL rank_divergence") == 3
    assert f"rank {odd_rank(world)}, job replay_differs-{world}, pid" in report.stdout

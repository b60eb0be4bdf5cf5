"""`graph-inspector watch` under torchrun: every rank's run carries torchrun's job and its rank, and
rank 0's Recorder checks the ranks' graphs against each other (the eager stand-in for the GPU part
of torch.cuda.CUDAGraph, as in test_watch_command)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from test_watch_command import needs_standin, script, watch

from inspector.storage.models import Run, Violation
from inspector.storage.store import open_store


def _runs(db: Path) -> list[tuple[str | None, int, int, list[str]]]:
    """(job, rank, world size, its rank_divergence messages) per run, by rank."""
    store = open_store(f"sqlite:///{db}", upgrade=False)
    try:
        with store.session() as session:
            found = []
            for run in session.scalars(select(Run).order_by(Run.rank)):
                messages = session.scalars(
                    select(Violation.message)
                    .where(Violation.run_id == run.id, Violation.kind == "rank_divergence")
                    .order_by(Violation.id)
                ).all()
                found.append((run.job, run.rank, run.world_size, list(messages)))
            return found
    finally:
        store.dispose()


@needs_standin
@pytest.mark.slow
def test_ranks_under_torchrun_carry_its_job_and_a_rank_that_captured_another_size_is_reported(
    tmp_path: Path,
) -> None:
    worker = script(tmp_path, "worker.py", """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        graphs = [capture(torch.zeros(n, 4)) for n in ((4, 2) if rank == 0 else (4, 3))]
        for graph in graphs:
            graph.replay()
        dist.barrier()
        if rank == 0:
            time.sleep(3)  # rank 0's recorder compares the ranks once rank 1 has written its graphs
        dist.destroy_process_group()
    """)
    db = tmp_path / "torchrun.db"
    result = watch(tmp_path, "--db", f"sqlite:///{db}", "--", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node", "2", str(worker),
                   env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "violations: rank_divergence x2" in result.stderr
    (job0, rank0, world0, found0), (job1, rank1, world1, found1) = _runs(db)
    assert job0 == job1 and job0 is not None and job0.startswith("torchrun:")
    assert (rank0, world0, rank1, world1) == (0, 2, 1, 2)
    assert found0 == []
    assert len(found1) == 2
    assert found1[0].startswith("rank 1 did not capture full worker.py:") and "[2x4]" in found1[0]
    assert found1[1].startswith("rank 1 captured full worker.py:") and "[3x4]" in found1[1]


@needs_standin
def test_watch_job_names_the_job_of_every_watched_process(tmp_path: Path) -> None:
    alone = script(tmp_path, "alone.py", """
        capture(torch.zeros(2, 4)).replay()
    """)
    db = tmp_path / "job.db"
    result = watch(tmp_path, "--db", f"sqlite:///{db}", "--job", "nightly-7", "--", sys.executable,
                   str(alone), env={"TORCHELASTIC_RUN_ID": "ignored-when-given"})
    assert result.returncode == 0, result.stderr
    assert _runs(db) == [("nightly-7", 0, 1, [])]

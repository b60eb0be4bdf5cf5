"""The step sequence a rank keeps (inspector.ranks.steps), the job a run belongs to
(inspector.recording.process), and the ranks' comparison on hand-made sequences (inspector.ranks.check)."""

from __future__ import annotations

import threading

import pytest
from workers import FULL, PIECEWISE

from capture_core.descriptor import BatchDescriptor
from capture_core.sizes import EagerReason
from inspector.ranks.check import RankRun, StepDivergences
from inspector.ranks.steps import EAGER, IDLE, StepLog, StepSegment, stretches
from inspector.recording.process import detect_job
from inspector.recording.recorder import Recorder

D4, D8 = BatchDescriptor(4, 4, True), BatchDescriptor(8, None)
L4, L8 = "full tokens=4,reqs=4,uniform=1", "piecewise tokens=8,reqs=any,uniform=0"


def _recorder(**kwargs: object) -> Recorder:
    return Recorder("sqlite:///unused.db", job="j", rank=0, world_size=2, **kwargs)  # never started


def _pending(recorder: Recorder, final: bool = False) -> StepSegment | None:
    assert recorder.step_log is not None
    return recorder.step_log.pending(recorder._replays, recorder._eager, final=final)


def test_each_batch_is_a_step_run_length_encoded() -> None:
    recorder = _recorder()
    for _ in range(3):
        recorder.on_replay(FULL, BatchDescriptor(4, 4, True), 3)  # an equal descriptor, a new object
    recorder.on_replay(FULL, D4, 4)  # the same graph with other real tokens: the same label
    recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 300, FULL)
    recorder.on_replay(PIECEWISE, D8, 7)
    segment = _pending(recorder)
    assert segment is not None and (segment.first_step, segment.runs) == (0, [[L4, 4], [EAGER, 1], [L8, 1]])
    recorder.step_log.committed()
    recorder.on_replay(PIECEWISE, D8, 7)
    assert _pending(recorder).first_step == 6  # type: ignore[union-attr]


def test_what_was_not_written_is_kept_and_extended() -> None:
    recorder = _recorder()
    recorder.on_replay(FULL, D4, 4)
    assert _pending(recorder).runs == [[L4, 1]]  # type: ignore[union-attr]
    recorder.on_replay(FULL, D4, 4)  # the write failed: the next window covers both
    again = _pending(recorder)
    assert again is not None and (again.first_step, again.runs) == (0, [[L4, 2]])


def test_coordinated_steps_group_the_batches_between_agreements() -> None:
    recorder = _recorder()
    recorder.on_replay(FULL, D4, 4)  # before the first agreement: a step of its own
    recorder.on_dp_coordination(object())
    recorder.on_replay(FULL, D4, 4)
    recorder.on_dp_coordination(object())  # a step in which this rank ran nothing
    recorder.on_dp_coordination(object())
    recorder.on_replay(FULL, D4, 4)
    recorder.on_replay(PIECEWISE, D8, 8)  # still open: more batches of this step may come
    assert _pending(recorder).runs == [[L4, 2], [IDLE, 1]]  # type: ignore[union-attr]
    final = _pending(recorder, final=True)
    assert final is not None and final.runs == [[L4, 2], [IDLE, 1], [f"{L4} + {L8}", 1]]


def test_only_ranks_of_a_job_keep_the_order() -> None:
    assert Recorder("sqlite:///unused.db", job="", world_size=2).step_log is None
    assert Recorder("sqlite:///unused.db", job="j", rank=0, world_size=1).step_log is None
    assert Recorder("sqlite:///unused.db", job="", world_size=1, step_sequence=True).step_log is not None
    alone = Recorder("sqlite:///unused.db", job="")
    alone.on_replay(FULL, D4, 4)
    alone.on_dp_coordination(object())
    assert alone._steps is None and alone._replays  # counted, not ordered


def test_appends_racing_with_the_flush_thread_are_never_lost() -> None:
    log = StepLog()
    recorder = _recorder()
    cell = recorder._replays.setdefault((FULL.value, 4, 4, True, False, 0, 4), [0])
    total, taken = 200_000, []

    def engine() -> None:
        for _ in range(total):
            log.entries.append(cell)

    thread = threading.Thread(target=engine)
    thread.start()
    while thread.is_alive():
        segment = log.pending(recorder._replays, {})
        if segment is not None:
            taken.append(segment.steps)
            log.committed()
    thread.join()
    last = log.pending(recorder._replays, {})
    assert sum(taken) + (last.steps if last else 0) == total


def test_a_pending_sequence_beyond_its_limit_is_dropped_and_counted() -> None:
    log = StepLog(limit=2)
    replays = {(FULL.value, n, n, True, False, 0, n): [1] for n in (1, 2, 3, 4)}
    cells = list(replays.values())
    log.entries.extend(cells)  # 4 runs of one step each, never written
    assert log.pending(replays, {}).steps == 4  # type: ignore[union-attr]
    log.entries.extend(cells[:1])
    kept = log.pending(replays, {})
    assert kept is not None and (kept.first_step, kept.steps, log.dropped_steps) == (4, 1, 4)


def test_stretches_walk_the_ranks_together_and_skip_gaps() -> None:
    sequences = {
        0: [StepSegment(0, [["a", 5], ["b", 5]]), StepSegment(10, [["a", 10]])],
        1: [StepSegment(0, [["a", 3], ["c", 1], ["a", 1], ["b", 5]]),
            StepSegment(14, [["a", 6]])],  # steps 10 to 13 were dropped
    }
    found = [(s.start, s.stop, s.labels[0], s.labels[1]) for s in stretches(sequences, 0, 20)]
    assert found == [(0, 3, "a", "a"), (3, 4, "a", "c"), (4, 5, "a", "a"), (5, 10, "b", "b"),
                     (14, 20, "a", "a")]
    assert [s.start for s in stretches(sequences, 4, 12)] == [4, 5]


def test_a_rank_that_keeps_differing_is_one_divergence_from_its_first_step() -> None:
    l2 = "full tokens=2,reqs=2,uniform=1"
    runs = {rank: RankRun(rank + 10, rank, 3, False) for rank in range(3)}
    captured = {("full", "tokens=2,reqs=2,uniform=1"): (2, 2, True, False, 0),
                ("full", "tokens=4,reqs=4,uniform=1"): (4, 4, True, False, 0)}
    check = StepDivergences(runs, {run.run_id: captured for run in runs.values()})
    sequences = {0: [StepSegment(0, [[l2, 10]])], 1: [StepSegment(0, [[l2, 2], [L4, 5], [l2, 3]])],
                 2: [StepSegment(0, [[l2, 9], [EAGER, 1]])]}
    found = [d for stretch in stretches(sequences, 0, 10) for d in check.feed(stretch)]
    assert [(d.rank, d.run_id, d.descriptor.key, d.message) for d in found] == [
        (1, 11, "tokens=4,reqs=4,uniform=1", f"step 2: rank 1 ran {L4}, where ranks 0, 2 ran {l2}"),
        # No graph of its own: the divergence names the graph the others replayed.
        (2, 12, "tokens=2,reqs=2,uniform=1",
         f"step 9: rank 2 ran a batch eagerly, where ranks 0, 1 ran {l2}"),
    ]


@pytest.mark.parametrize(
    ("environment", "given", "job"),
    [
        ({}, None, None),
        ({"TORCHELASTIC_RUN_ID": "5f1c"}, None, "torchrun:5f1c"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None, None),  # torchrun without --rdzv-id: names no job
        ({"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3"}, None, "slurm:812.3"),
        ({"SLURM_JOB_ID": "812"}, None, "slurm:812"),
        ({"SLURM_JOB_ID": "812", "TORCHELASTIC_RUN_ID": "5f1c"}, None, "torchrun:5f1c"),
        ({"GRAPH_INSPECTOR_JOB": "nightly-42", "TORCHELASTIC_RUN_ID": "5f1c"}, None, "nightly-42"),
        ({"TORCHELASTIC_RUN_ID": "5f1c"}, "mine", "mine"),
        ({"TORCHELASTIC_RUN_ID": "5f1c"}, "", None),
    ],
)
def test_the_job_comes_from_the_argument_then_the_launchers_environment(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], given: str | None, job: str | None
) -> None:
    for name in ("GRAPH_INSPECTOR_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert detect_job(given) == job

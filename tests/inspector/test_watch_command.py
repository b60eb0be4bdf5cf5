"""`graph-inspector watch -- python script.py`: real processes, a real SQLite file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select
from test_watch_standin import standin_possible

from inspector.storage.models import Graph, Run, Violation
from inspector.storage.store import open_store

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# The watched scripts use the eager stand-in for the GPU part of torch.cuda.CUDAGraph.
PRELUDE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import torch
from test_watch_standin import EagerGraphBase
torch.cuda.CUDAGraph.__bases__ = (EagerGraphBase,)
model = torch.nn.Linear(4, 4)

def capture(x):
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    model(x)
    graph.capture_end()
    return graph
"""

needs_standin = pytest.mark.skipif(not standin_possible(), reason="the stand-in needs CPU-only torch")


def watch(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "watch", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


@needs_standin
@pytest.mark.slow
def test_watch_records_a_script_and_returns_its_exit_status(tmp_path: Path) -> None:
    decode = script(tmp_path, "decode.py", """
        graphs = [capture(torch.zeros(n, 4)) for n in (4, 2)]
        for _ in range(5):
            graphs[0].replay()
        capture(torch.zeros(1, 4))   # after 5 quiet replays: unexpected under --ready-after 3
        print("decode done", sys.argv[1:])
        sys.exit(3)
    """)
    db = tmp_path / "watch.db"
    result = watch(tmp_path, "--db", f"sqlite:///{db}", "--ready-after", "3", "--",
                   sys.executable, str(decode), "--steps", "5")
    assert result.returncode == 3, result.stderr
    assert "decode done ['--steps', '5']" in result.stdout
    assert "1 watched process(es), 3 graph(s), 5 replay(s)" in result.stderr
    assert "never replayed: 2 graph(s)" in result.stderr
    assert "violations: unexpected_capture x1" in result.stderr
    store = open_store(f"sqlite:///{db}", upgrade=False)
    with store.session() as session:
        (run,) = session.scalars(select(Run))
        assert run.label.startswith("watch decode.py #") and run.backend == "cuda"
        graphs = session.scalars(select(Graph).order_by(Graph.id))
        assert [g.unexpected for g in graphs] == [False, False, True]
        (violation,) = session.scalars(select(Violation))
        assert "capture(torch.zeros(1, 4))" in violation.stack
    store.dispose()


@needs_standin
@pytest.mark.slow
def test_every_python_process_of_the_command_is_watched_with_its_rank(tmp_path: Path) -> None:
    script(tmp_path, "worker.py", """
        import os
        graph = capture(torch.zeros(int(os.environ["RANK"]) + 1, 4))
        graph.replay()
    """)
    launcher = tmp_path / "launch.py"
    launcher.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        workers = [
            subprocess.Popen([sys.executable, {str(tmp_path / 'worker.py')!r}],
                             env={{**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}})
            for rank in (0, 1)
        ]
        assert [w.wait() for w in workers] == [0, 0]
        print("torch imported by the launcher:", "torch" in sys.modules)
    """))
    db = tmp_path / "ranks.db"
    result = watch(tmp_path, "--db", f"sqlite:///{db}", "--", sys.executable, str(launcher))
    assert result.returncode == 0, result.stderr
    assert "torch imported by the launcher: False" in result.stdout  # the watch never imports torch itself
    assert "2 watched process(es), 2 graph(s), 2 replay(s)" in result.stderr
    store = open_store(f"sqlite:///{db}", upgrade=False)
    with store.session() as session:
        runs = list(session.scalars(select(Run).order_by(Run.rank)))
        assert [(r.rank, r.world_size) for r in runs] == [(0, 2), (1, 2)]
        assert len({r.label for r in runs}) == 1  # one watch, one label
    store.dispose()


def test_the_environments_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n")
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('theirs:', os.environ.get('THEIR_SITECUSTOMIZE'))\n")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(theirs)])}
    db = f"sqlite:///{tmp_path / 'x.db'}"
    result = watch(tmp_path, "--db", db, "--", sys.executable, str(probe), env=env)
    assert result.returncode == 0, result.stderr
    assert "theirs: ran" in result.stdout
    assert "0 watched process(es), 0 graph(s)" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command to watch; put it after '--'"),
        (["--", "no-such-program-here"], "cannot run 'no-such-program-here'"),
        (["--ready-after", "0", "--", "true"], "--ready-after must be a positive number"),
        (["--db", "nosuchdialect://x", "--", "true"], "unsupported database URL"),
    ],
)
def test_usage_errors_are_clear_messages(tmp_path: Path, argv: list[str], message: str) -> None:
    result = watch(tmp_path, *argv)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_relative_sqlite_path_is_pinned_to_where_the_command_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector.commands.watch import absolute_sqlite_url

    monkeypatch.chdir(tmp_path)
    assert absolute_sqlite_url("sqlite:///sub/w.db?timeout=3") == f"sqlite:///{tmp_path}/sub/w.db?timeout=3"
    for unchanged in ("sqlite:////abs/w.db", "sqlite://", "postgresql+psycopg://u@h/db", "not a url"):
        assert absolute_sqlite_url(unchanged) == unchanged


def test_sigterm_to_the_watch_reaches_the_command(tmp_path: Path) -> None:
    import signal
    import time

    waiter = tmp_path / "waiter.py"
    waiter.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def stop(number, frame):
            pathlib.Path({str(tmp_path / 'got-term')!r}).write_text("yes")
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        pathlib.Path({str(tmp_path / 'ready')!r}).write_text("yes")
        time.sleep(60)
    """))
    process = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "watch", "--db", f"sqlite:///{tmp_path / 't.db'}", "--",
         sys.executable, str(waiter)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 7
    assert (tmp_path / "got-term").read_text() == "yes"


@pytest.mark.slow
def test_a_command_that_captured_nothing_is_told_why_nothing_was_recorded(tmp_path: Path) -> None:
    import torch

    done = watch(tmp_path, "--db", "sqlite:///nothing.db", "--", sys.executable, "-c", "import torch")
    assert done.returncode == 0, done.stderr
    assert "0 watched process(es)" in done.stderr
    if torch.cuda.is_available():
        assert "nothing recorded: no process of the command captured a CUDA graph" in done.stderr
    else:
        assert "nothing recorded: torch here sees no CUDA device" in done.stderr

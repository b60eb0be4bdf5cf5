"""Reliability: does the recorder lose events without saying so, or take the engine down with it?

Each scenario runs real processes against a real database and counts, for the events the engine
reported (captures, violation occurrences, replays, eager batches): those recorded in the database,
those the recorder counted as dropped (its run row and its sidecar file), and those unaccounted
for, which must be 0 everywhere. A killed process cannot count what it held in memory; for it the
check is that everything it had committed is there and that the file is sound.

- many writers: N processes recording into one SQLite file at once;
- kills: a recorder SIGKILLed at a random moment, again and again, into one file;
- faults, each in a child process: the database locked past ``close_timeout``; deleted while a flush
  waits on the lock; made immutable (``chattr +i``, root); on a full filesystem (a tmpfs, root);
  corrupt before the start; and hostile text (surrogates, NUL, a megabyte).

    python3 bench/reliability.py --out bench/results/reliability.json
    python3 bench/reliability.py --quick --out /tmp/reliability.json      # fewer writers and kills
    git worktree add /tmp/before <commit> && python3 bench/reliability.py --code /tmp/before \
        --out bench/results/reliability_before_fix.json      # the same scenarios, an older recorder

With ``--code DIR`` the recording processes import ``capture_core`` and ``inspector`` from another
checkout (the accounting stays this one's, and upgrades a copy of each database it reads).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, func, select

from bench.common import before_after_parser, print_table, print_targets, target, write_before_after
from inspector.recording.losses import Sidecar, run_losses
from inspector.storage import models
from inspector.storage.sqlite_file import quick_check
from inspector.storage.store import open_store
from tests.support.recording import SIZES

REPO = Path(__file__).resolve().parents[1]
KINDS = ("captures", "violations", "replays", "eager_batches")

# One child per fault: it records, meets the fault, closes, and prints what it reported (the events
# it handed the recorder), as JSON on its last line.
CHILD_PRELUDE = """
import json, logging, os, subprocess, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from capture_core.descriptor import BatchDescriptor
from capture_core.sizes import EagerReason
from inspector.recording.recorder import Recorder
from recording import FULL, capture, drift
url, path = sys.argv[1], sys.argv[2]
d = BatchDescriptor(8, 8, True)
reported = {"captures": 0, "violations": 0, "replays": 0, "eager_batches": 0}

def traffic(recorder, replays, violations, offset=0):
    for _ in range(replays):
        recorder.on_replay(FULL, d, 7)
    recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 300, FULL)
    for v in range(violations):
        recorder.on_violation(drift(d, actual=0x10000 + offset + v))
    reported["replays"] += replays
    reported["eager_batches"] += 1
    reported["violations"] += violations

def start(**kwargs):
    recorder = Recorder(url, flush_interval=0.05, close_timeout=1.0, **kwargs).start()
    recorder.on_capture(capture(d))
    reported["captures"] += 1
    return recorder
"""
FAULTS = {
    "database locked past close_timeout": """
import sqlite3
recorder = start()
traffic(recorder, 5000, 5)
assert recorder.flush(timeout=20)
locker = sqlite3.connect(path, timeout=0, isolation_level=None)
locker.execute("BEGIN EXCLUSIVE")
traffic(recorder, 42600, 3, offset=100)
recorder.close()
locker.execute("ROLLBACK")
""",
    "file deleted while a flush waits on the lock": """
import sqlite3
recorder = start()
assert recorder.flush(timeout=20)
locker = sqlite3.connect(path, timeout=0, isolation_level=None)
locker.execute("BEGIN EXCLUSIVE")
traffic(recorder, 10000, 5)
recorder.flush(timeout=0.5)
for suffix in ("", "-wal", "-shm"):
    if os.path.exists(path + suffix):
        os.unlink(path + suffix)
locker.execute("ROLLBACK")
locker.close()
assert recorder.flush(timeout=30)
recorder.close()
""",
    "files made immutable mid-run (root)": """
recorder = start()
traffic(recorder, 1000, 2)
assert recorder.flush(timeout=20)
files = [p for p in (path, path + "-wal", path + "-shm") if os.path.exists(p)]
subprocess.run(["chattr", "+i", *files], check=True)
for i in range(20):
    traffic(recorder, 500, 1, offset=1000 + i)
    time.sleep(0.01)
recorder.close()
""",
    "filesystem full mid-run (tmpfs, root)": """
from recording import fill_filesystem
filler = os.path.join(os.path.dirname(path), "filler")
fill = lambda: fill_filesystem(filler)
recorder = start()
assert recorder.flush(timeout=20)
fill()
traffic(recorder, 3000, 3)
recorder.flush(timeout=1.0)
os.unlink(filler)
assert recorder.flush(timeout=20)
fill()
traffic(recorder, 7000, 2, offset=100)
recorder.close()
""",
    "corrupt file at start": """
recorder = start()
traffic(recorder, 3000, 3)
recorder.close()
""",
    "hostile text (surrogates, NUL, 1 MB)": """
import dataclasses
recorder = start(label="caf\\udce9 \\x00", config={"argv": sys.argv + ["caf\\udce9.txt"]})
traffic(recorder, 2000, 0)
recorder.on_violation(dataclasses.replace(drift(d, actual=0x1), stack="File caf\\udce9.py\\n" * 10,
                                          message="m\\x00" * 500000))
reported["violations"] += 1
assert recorder.flush(timeout=20)
traffic(recorder, 2000, 2, offset=10)
recorder.close()
""",
}
NEEDS_ROOT = {"files made immutable mid-run (root)", "filesystem full mid-run (tmpfs, root)"}
EPILOGUE = """
counted = recorder.losses.as_dict() if hasattr(recorder, "losses") else {"events": recorder.dropped}
print(json.dumps({"reported": reported, "counted": counted}))
"""
WRITER = """
import json, sys
from recording import record_traffic
print(json.dumps(record_traffic(sys.argv[1], *map(int, sys.argv[2:]))))
"""


def child_env(code: Path) -> dict[str, str]:
    """A child that imports the recorder from ``code`` and the workloads (``recording``) from here.
    (Children run in ``code``: ``python -c`` puts its working directory first on the path.)"""
    path = [str(code), str(REPO / "tests" / "support"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def accounted(url: str, sqlite_path: Path | None) -> tuple[dict[str, int], dict[str, int]]:
    """What the database at ``url`` holds of the events, and what is counted as dropped (the run
    rows and the sidecar), summed over its runs. (Upgraded first: an older recorder's database.)"""
    open_store(url).dispose()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            recorded = {
                "captures": conn.scalar(select(func.count()).select_from(models.Graph)) or 0,
                "violations": conn.scalar(select(func.coalesce(func.sum(models.Violation.count), 0))),
                "replays": conn.scalar(select(func.coalesce(func.sum(models.ReplayTotal.replays), 0))),
                "eager_batches": conn.scalar(select(func.coalesce(func.sum(models.EagerTotal.batches), 0))),
            }
            dropped = run_losses(conn, Sidecar(sqlite_path)).total()
    finally:
        engine.dispose()
    return {k: int(v) for k, v in recorded.items()}, {kind: getattr(dropped, kind) for kind in KINDS}


def fault(name: str, folder: Path, code: Path) -> dict[str, Any]:
    """One fault scenario in a child process; its accounting."""
    folder.mkdir(parents=True)
    mounted = None
    if name in NEEDS_ROOT and os.geteuid() != 0:
        return {"skipped": "needs root"}
    if "immutable" in name and shutil.which("chattr") is None:
        return {"skipped": "no chattr"}
    if "tmpfs" in name:
        mounted = folder / "small"
        mounted.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mounted)]).returncode:
            return {"skipped": "cannot mount a tmpfs here"}
    path = (mounted or folder) / "fault.db"
    url = f"sqlite:///{path}"
    if name == "corrupt file at start":
        _create(url, code)
        _corrupt(path)
    digest = _digest(path) if path.exists() else None
    try:
        script = CHILD_PRELUDE + FAULTS[name] + EPILOGUE
        child = subprocess.run([sys.executable, "-c", script, url, str(path)], capture_output=True, text=True,
                               timeout=600, env=child_env(code), cwd=code)
    finally:
        subprocess.run(["chattr", "-i", *map(str, path.parent.glob(path.name + "*"))], capture_output=True)
        for filler in path.parent.glob("filler"):
            filler.unlink()
    survived = child.returncode == 0
    said = json.loads(child.stdout.strip().splitlines()[-1]) if survived else {"reported": {}, "counted": {}}
    result: dict[str, Any] = {"survived": survived, "returncode": child.returncode,
                              "stderr_tail": child.stderr[-2000:]}
    if name == "corrupt file at start":
        result["file_untouched"] = _digest(path) == digest
        recorded, dropped = {k: 0 for k in KINDS}, _sidecar_only(path)
    else:
        recorded, dropped = accounted(url, path)
    result |= _balance(said["reported"], recorded, dropped, said["counted"])
    if not survived:  # what it reported died with it: only what it had committed is known
        result["events"]["reported"] = result["events"]["unaccounted"] = None
    if mounted is not None:
        subprocess.run(["umount", "-l", str(mounted)], check=False)
    return result


def many_writers(folder: Path, writers: int, replays_per_size: int, violations: int, code: Path
                 ) -> dict[str, Any]:
    folder.mkdir(parents=True)
    url = f"sqlite:///{folder / 'writers.db'}"
    _create(url, code)
    began = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", WRITER, url, str(rank), str(replays_per_size),
                                  str(violations), str(writers)], stdout=subprocess.PIPE, text=True,
                                 env=child_env(code), cwd=code) for rank in range(writers)]
    results = [json.loads(child.communicate(timeout=600)[0].strip().splitlines()[-1]) for child in children]
    seconds = time.perf_counter() - began
    per_writer = {"captures": len(SIZES), "violations": violations, "replays": replays_per_size * len(SIZES),
                  "eager_batches": replays_per_size}
    reported = {kind: per_writer[kind] * writers for kind in KINDS}
    recorded, dropped = accounted(url, folder / "writers.db")
    counted = {"events": sum(r["dropped"] for r in results)}
    return {"writers": writers, "seconds": seconds, **_balance(reported, recorded, dropped, counted)}


def kills(folder: Path, count: int, code: Path, seed: int) -> dict[str, Any]:
    """``count`` recorders into one file, each SIGKILLed at a random moment of its recording (the
    moments drawn from ``seed``); after each, the file must be sound and hold everything the ledger
    says was committed."""
    folder.mkdir(parents=True)
    url = f"sqlite:///{folder / 'killed.db'}"
    rng = random.Random(seed)
    sound, kept, lost_committed = 0, 0, 0
    for n in range(count):
        ledger = folder / f"ledger-{n}.jsonl"
        recording = REPO / "tests" / "support" / "recording.py"
        child = subprocess.Popen([sys.executable, str(recording), url, str(ledger)],
                                 env=child_env(code), cwd=code, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (ledger.exists() and ledger.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.02)  # recording (the first flush committed), then a random moment
        time.sleep(rng.uniform(0.0, 2.0))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        lines = ledger.read_text().splitlines() if ledger.exists() else []
        committed = json.loads(lines[-1]) if lines else {"replays": 0, "violations": 0}
        conn = sqlite3.connect(folder / "killed.db")
        try:
            sound += quick_check(conn) == []
            (run_id,) = conn.execute("SELECT max(id) FROM runs").fetchone()
            replays = conn.execute("SELECT coalesce(sum(replays), 0) FROM replay_windows WHERE run_id = ?",
                                   (run_id,)).fetchone()[0]
            found = conn.execute("SELECT count(*) FROM violations WHERE run_id = ?", (run_id,)).fetchone()[0]
        finally:
            conn.close()
        ok = replays >= committed["replays"] and found >= committed["violations"]
        kept += ok
        lost_committed += max(0, committed["replays"] - replays) + max(0, committed["violations"] - found)
    return {"kills": count, "file_sound_after_kill": sound, "committed_events_all_kept": kept,
            "committed_events_lost": lost_committed}


def _balance(reported: dict[str, int], recorded: dict[str, int], dropped: dict[str, int],
             counted: dict[str, int]) -> dict[str, Any]:
    """Where every reported event went: recorded, counted as dropped on record (run rows, sidecar),
    counted in the log alone (the recorder's own count beyond the record: a full disk has no room
    for a sidecar), or nowhere."""
    events = {name: sum(values.get(kind, 0) for kind in KINDS)
              for name, values in (("reported", reported), ("recorded", recorded), ("dropped", dropped))}
    events["dropped, log only"] = max(0, counted.get("events", 0) - events["dropped"])
    events["unaccounted"] = (events["reported"] - events["recorded"] - events["dropped"]
                             - events["dropped, log only"])
    return {"reported": reported, "recorded": recorded, "dropped": dropped, "counted_by_recorder": counted,
            "events": events}


def _worst(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat that went worst (the engine died, or the most events unaccounted for), with what
    every repeat found, and the median time of those that are timed."""
    def badness(result: dict[str, Any]) -> tuple[int, int]:
        lost = result.get("events", {}).get("unaccounted", result.get("committed_events_lost", 0))
        return (not result.get("survived", True), abs(lost) if lost is not None else 1 << 62)

    worst = dict(max(repeats, key=badness))
    worst["repeats"] = [{key: result.get(key) for key in ("survived", "seconds", "file_sound_after_kill")
                         if key in result} | {"unaccounted": badness(result)[1] if not badness(result)[0]
                                              else None} for result in repeats]
    if "seconds" in worst:
        worst["seconds_median"] = statistics.median(result["seconds"] for result in repeats)
    return worst


def _shown(value: Any) -> Any:
    return "unknown" if value is None else value


def _sidecar_only(path: Path) -> dict[str, int]:
    """A corrupt file holds nothing readable: what its sidecar counts."""
    found = {kind: 0 for kind in KINDS}
    for _, losses in Sidecar(path).recorders():
        for kind in KINDS:
            found[kind] += getattr(losses, kind)
    return found


def _create(url: str, code: Path) -> None:
    """An empty database at ``url``, made by ``code``'s own ``db upgrade`` (its schema)."""
    subprocess.run([sys.executable, "-c", "import sys; from inspector.storage.store import open_store; "
                    "open_store(sys.argv[1]).dispose()", url], check=True, env=child_env(code), cwd=code)


def _corrupt(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    with open(path, "r+b") as f:
        f.seek(4096 + 8)  # the second page (a table's root), past its header
        f.write(b"\xde\xad\xbe\xef" * 64)


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    parser = before_after_parser(__doc__.splitlines()[0], runs="recorder",
                                 quick="4 writers, 3 kills, one repeat: a smoke run")
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    code = args.code.resolve()
    if args.quick:
        args.writers, args.kills, args.repeats = 4, 3, 1
    scratch = Path(tempfile.mkdtemp(prefix="reliability-"))
    scenarios: dict[str, Callable[[Path, int], dict[str, Any]]] = {
        f"{args.writers} writers, one SQLite file":
            lambda folder, _: many_writers(folder, args.writers, 2000, 50, code),
        f"{args.kills} SIGKILLs at random moments":
            lambda folder, seed: kills(folder, args.kills, code, seed),
    } | {name: (lambda folder, _, name=name: fault(name, folder, code)) for name in FAULTS}
    results = {}
    try:
        for index, (name, run) in enumerate(scenarios.items()):
            repeats = []
            for repeat in range(args.repeats):
                print(f"{name} ({repeat + 1} of {args.repeats}) ...", flush=True)
                repeats.append(run(scratch / f"{index}-{repeat}", 18 + repeat))
            results[name] = _worst(repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows, targets = [], []
    for name, result in results.items():
        events = result.get("events", {})
        rows.append((name, result.get("writers", 1), result.get("kills", 0),
                     "skipped: " + result["skipped"] if "skipped" in result else
                     "yes" if result.get("survived", True) else f"NO ({result.get('returncode')})",
                     *(_shown(events.get(column, "-")) for column in ("reported", "recorded", "dropped",
                                                                      "dropped, log only")),
                     _shown(events.get("unaccounted", result.get("committed_events_lost", "-")))))
        if "skipped" in result:
            continue
        lost = events.get("unaccounted", result.get("committed_events_lost"))
        if lost is not None:
            targets.append(target(f"{name}: events lost without a count", abs(lost), 1))
        if "kills" in result:
            targets.append(target(f"{name}: kills that left the file unsound",
                                  result["kills"] - result["file_sound_after_kill"], 1))
        if "survived" in result:
            targets.append(target(f"{name}: the engine died", 0 if result["survived"] else 1, 1))
    print_table("Reliability (events: reported by the engine, recorded, counted as dropped, unaccounted)",
                ("scenario", "writers", "kills", "engine lived", "reported", "recorded", "dropped",
                 "log only", "unaccounted"), rows)
    for name, result in results.items():
        if "kills" in result:
            print(f"{name}: the file sound after {result['file_sound_after_kill']} of {result['kills']}, "
                  f"every committed event there after {result['committed_events_all_kept']} of "
                  f"{result['kills']} ({result['committed_events_lost']} lost)")
    print_targets(targets)
    return write_before_after(args, "reliability", {"writers": args.writers, "kills": args.kills,
                                                    "root": os.geteuid() == 0}, results, targets)


if __name__ == "__main__":
    raise SystemExit(main())

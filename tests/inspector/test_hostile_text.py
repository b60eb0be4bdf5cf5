"""Text is never a reason to lose data or to raise: whatever string an engine hands the recorder
(lone surrogates, NUL, a megabyte) is stored, escaped and cut where it must be, on SQLite and on
PostgreSQL, and every later flush goes on."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select
from workers import FULL, capture, child_env, drift, fetch_rows

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationEvent
from inspector.recording.recorder import Recorder
from inspector.storage.models import CompileRecord, Graph, ReplayWindow, Run, Violation
from inspector.storage.store import open_store
from inspector.storage.text import TEXT_LIMIT, cut, storable, storable_json
from inspector.storage.writer import record_compile_event

ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=()), max_size=300)
"""Every code point, lone surrogates and NUL included."""


@given(text=ANY_TEXT, limit=st.integers(min_value=1, max_value=400))
def test_storable_text_encodes_has_no_nul_and_fits(text: str, limit: int) -> None:
    stored = storable(text, limit)
    stored.encode("utf-8")  # raises for a lone surrogate
    assert "\x00" not in stored and len(stored) <= limit
    clean = "\x00" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    if clean and len(text) <= limit:
        assert stored == text


def test_escapes_are_visible_and_a_cut_says_the_cap() -> None:
    assert storable("caf\udce9.txt") == "caf\\xe9.txt", "surrogateescape's byte comes back as Python shows it"
    assert storable("a\ud800b\x00c") == "a\\ud800b\\x00c"
    long = "x" * 3_000_000
    stored = storable(long)
    assert len(stored) == TEXT_LIMIT and stored.endswith(f"… [cut to 1,048,576 of {len(long):,} characters]")
    assert storable("y" * 1000, 32) == "y" * 22 + "…[32/1000]"
    assert cut("k" * 300, 128, digest=True) != cut("k" * 299 + "j", 128, digest=True)


def test_json_keeps_its_shape_with_hostile_strings_inside() -> None:
    value = {"k\udc80": ["v\ud800", b"raw", 3, None, True], "n": "\x00"}
    assert json.loads(storable_json(value)) == {"k\\x80": ["v\\ud800", "b'raw'", 3, None, True], "n": "\\x00"}


def test_a_surrogate_in_a_violation_stack_is_stored_escaped_and_later_flushes_go_on(db_url: str) -> None:
    descriptor = BatchDescriptor(4, 4, True)
    hostile = dataclasses.replace(
        drift(descriptor, actual=0x9000),
        stack='  File "caf\udce9.py", line 3, in step\n',
        message="moved \ud800 with a NUL \x00 in it",
    )
    with Recorder(db_url, flush_interval=0.05) as recorder:
        recorder.on_capture(capture(descriptor))
        recorder.on_violation(hostile)
        for _ in range(100):
            recorder.on_replay(FULL, descriptor, 3)
        assert recorder.flush(timeout=20), recorder.last_error
        for _ in range(50):
            recorder.on_replay(FULL, descriptor, 3)
        assert recorder.flush(timeout=20), recorder.last_error
    assert recorder.dropped == 0
    assert fetch_rows(db_url, select(Violation.stack, Violation.message))[0] == (
        '  File "caf\\xe9.py", line 3, in step\n', "moved \\ud800 with a NUL \\x00 in it"
    )
    assert sum(r[0] for r in fetch_rows(db_url, select(ReplayWindow.replays))) == 150
    assert fetch_rows(db_url, select(Run.dropped_events))[0][0] == 0


def test_megabyte_names_and_messages_are_cut_with_the_cap_said(db_url: str) -> None:
    descriptor = BatchDescriptor(2, 2, True)
    wrapper = "w" * 1000
    event = dataclasses.replace(capture(descriptor), wrapper=wrapper, input_names=("i" * 2_000_000, "ok"))
    finding = dataclasses.replace(drift(descriptor, actual=0x1), message="m" * 2_000_000,
                                  input_name="n" * 500)
    with Recorder(db_url, flush_interval=0.05, label="l" * 300, device="d\udcff") as recorder:
        recorder.on_capture(event)
        recorder.on_violation(finding)
        assert recorder.flush(timeout=30), recorder.last_error
    (names, stored_wrapper), = fetch_rows(db_url, select(Graph.input_names, Graph.wrapper))
    assert json.loads(names)[1] == "ok" and json.loads(names)[0].endswith("of 2,000,000 characters]")
    assert len(stored_wrapper) == 200 and stored_wrapper.endswith("… [cut to 200 of 1,000 characters]")
    (message, name), = fetch_rows(db_url, select(Violation.message, Violation.input_name))
    assert len(message) == TEXT_LIMIT and message.startswith("mmm") and len(name) == 200
    (label, device), = fetch_rows(db_url, select(Run.label, Run.device))
    assert label.endswith("of 300 characters]") and device == "d\\xff"


def test_compile_reasons_with_surrogates_are_stored_and_repeats_still_count(db_url: str) -> None:
    @dataclasses.dataclass
    class Kind:
        value: str = "compile_rerecord"

    @dataclasses.dataclass
    class Heard:
        kind: Kind
        function: str
        reason: str
        message: str
        seen_at: float

    store = open_store(db_url)
    try:
        with Recorder(db_url) as recorder:
            assert recorder.flush(timeout=20)
            run_id = recorder.run_id
        assert run_id is not None
        heard = Heard(Kind(), "forward\udcff", "shape changed \ud83d", "line \x00", 1.0)
        for _ in range(2):
            with store.writer() as conn:
                record_compile_event(conn, run_id, heard)  # type: ignore[arg-type]
    finally:
        store.dispose()
    rows = fetch_rows(db_url, select(CompileRecord.function, CompileRecord.reason, CompileRecord.count))
    assert rows == [("forward\\xff", "shape changed \\ud83d", 2)]


ENGINE = """
import sys
from inspector.recording.recorder import Recorder
recorder = Recorder(sys.argv[1], label="run of " + sys.argv[2], config={"trace": sys.argv[2]}).start()
assert recorder.flush(timeout=20), recorder.last_error
recorder.close()
print(recorder.run_id, recorder.dropped)
"""


def test_a_file_name_that_is_not_utf8_on_the_command_line_is_recorded(tmp_path: Path) -> None:
    """``python engine.py $'caf\\xe9.txt'``: Python hands the byte over as a lone surrogate in
    ``sys.argv``, which the command line, the label and the configuration all carry."""
    url = f"sqlite:///{tmp_path / 'argv.db'}"
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = child_env(LC_ALL="C.UTF-8")
    result = subprocess.run([sys.executable, str(script), url, b"caf\xe9.txt"], capture_output=True, env=env,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.split() == [b"1", b"0"]
    (process, label, config), = fetch_rows(url, select(Run.process, Run.label, Run.config))
    assert process.endswith("engine.py sqlite:///" + str(tmp_path / "argv.db") + " caf\\xe9.txt")
    assert label == "run of caf\\xe9.txt" and json.loads(config) == {"trace": "caf\\xe9.txt"}


def test_a_storable_event_is_unchanged_by_the_boundary(sqlite_url: str) -> None:
    descriptor = BatchDescriptor(8, 8, True)
    finding: ViolationEvent = drift(descriptor, actual=0x4000, name="kv_caches[3]")
    with Recorder(sqlite_url) as recorder:
        recorder.on_violation(finding)
        assert recorder.flush(timeout=20)
    row = fetch_rows(sqlite_url, select(Violation.input_name, Violation.message, Violation.wrapper))[0]
    assert tuple(row) == (finding.input_name, finding.message, finding.wrapper)


def _job_of_two_ranks(url: str, job: str, sizes: tuple[int, int]) -> list[tuple[str, str, int]]:
    """Rank 1 then rank 0 of ``job``, capturing one size each and replaying it; the rank
    divergences rank 0's check recorded, and the job as stored."""
    for rank in (1, 0):
        descriptor = BatchDescriptor(sizes[rank], sizes[rank], True)
        with Recorder(url, job=job, rank=rank, world_size=2, flush_interval=0.05) as recorder:
            recorder.on_capture(capture(descriptor))
            for _ in range(10):
                recorder.on_replay(FULL, descriptor, sizes[rank])
            assert recorder.flush(timeout=20), recorder.last_error
        assert recorder.dropped == 0
    return fetch_rows(url, select(Run.job, Violation.kind, Violation.count).join(Violation, isouter=True)
                      .order_by(Run.id))


def test_a_job_id_of_any_text_still_has_its_ranks_checked(db_url: str) -> None:
    job = "job caf\udce9 \x00" + "j" * 300
    rows = _job_of_two_ranks(db_url, job, (4, 8))
    stored = rows[0][0]
    assert stored.startswith("job caf\\xe9 \\x00j") and stored.endswith("characters]") and len(stored) == 200
    assert {job for job, _, _ in rows} == {stored}, "both ranks' runs name the same job"
    kinds = [kind for _, kind, _ in rows if kind]
    assert kinds and set(kinds) == {"rank_divergence"}, rows


def test_ranks_of_a_job_of_any_text_that_agree_have_no_divergence(db_url: str) -> None:
    rows = _job_of_two_ranks(db_url, "job caf\udce9 \x00" + "j" * 300, (4, 4))
    assert [kind for _, kind, _ in rows if kind] == [], rows

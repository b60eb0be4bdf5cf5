"""One record per kind of violation (``capture_core.events.ViolationKind``), read by every surface:
each record is complete, every surface shows every kind from it, and a kind planted as one record
(in a copy of the code, nothing else edited) is on every surface."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capture_core.errors import GraphCacheError
from capture_core.events import KindRecord, ViolationKind
from inspector.gating.pytest_plugin import _findings_from_exception

REPO = Path(__file__).resolve().parents[1]

SURFACES = """
import json, os, sys, tempfile
from markupsafe import escape
from capture_core.checks import Finding, finding_message
from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.modes import CUDAGraphMode
from dashboard.api import openapi_document
from dashboard.app import create_app
from inspector.reading.metrics import METRICS, PREFIX

app = create_app("sqlite:///" + os.path.join(tempfile.mkdtemp(), "kinds.db"))
client = app.test_client()
page = client.get("/violations").get_data(as_text=True)
overview = client.get("/").get_data(as_text=True)
metric_help = next(m.help for m in METRICS if m.name == PREFIX + "violations_total")
enum = openapi_document()["components"]["schemas"]["ViolationKind"]["enum"]
filtered = client.get("/api/violations?kind=" + ViolationKind(sys.argv[1]).value).status_code
shown = {}
for kind in ViolationKind:
    r = kind.record
    message = finding_message("w", CUDAGraphMode.FULL, BatchDescriptor(8), [Finding(kind, "x", "it moved")])
    shown[kind.value] = {
        "violations page: label, meaning, fix": all(str(escape(t)) in page for t in (r.label, r.meaning,
                                                                                     r.fix)),
        "violations page: kind filter": f'<option value="{kind.value}"' in page,
        "overview: no violation of it": str(escape(r.label)) in overview,
        "metric help": kind.value in metric_help,
        "OpenAPI enum": kind.value in enum,
        "message: label and fix": message.startswith(r.label) and message.endswith(r.fix + "."),
    }
shown["api filter " + sys.argv[1]] = filtered
print(json.dumps(shown))
"""


def surfaces(root: Path, kind: str) -> dict[str, object]:
    """What every surface shows of each kind, read in a fresh interpreter from the code at ``root``."""
    done = subprocess.run([sys.executable, "-c", SURFACES, kind], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("kind", list(ViolationKind), ids=lambda k: k.value)
def test_every_kind_has_a_complete_record(kind: ViolationKind) -> None:
    record = kind.record
    assert isinstance(record, KindRecord)
    assert record.label and record.label == record.label.lower() and "_" not in record.label
    assert record.meaning.endswith(".") and len(record.meaning) > len(record.label)
    assert record.fix and not record.fix.endswith(".")  # a message puts it last, then its full stop
    assert record.error is None or issubclass(record.error, GraphCacheError)


def test_labels_are_distinct() -> None:
    labels = [kind.record.label for kind in ViolationKind]
    assert len(set(labels)) == len(labels)


@pytest.mark.slow
def test_every_surface_shows_every_kind() -> None:
    shown = surfaces(REPO, "address_drift")
    assert shown.pop("api filter address_drift") == 200
    assert set(shown) == {kind.value for kind in ViolationKind}
    missing = [(kind, surface) for kind, seen in shown.items() for surface, ok in seen.items() if not ok]
    assert missing == []


@pytest.mark.parametrize("kind", [k for k in ViolationKind if k.record.error], ids=lambda k: k.value)
def test_the_pytest_plugin_names_the_kind_of_each_raised_error(kind: ViolationKind,
                                                              request: pytest.FixtureRequest) -> None:
    with pytest.raises(GraphCacheError) as raised:
        raise kind.record.error("planted")  # raised for no event: the plugin goes by the error's kind
    [finding] = _findings_from_exception(raised, request.node)
    assert (finding.kind, finding.message) == (kind.value, "planted")


PLANTED = '''    PLANTED_EXAMPLE = "planted_example", KindRecord(
        label="planted example",
        meaning="A planted kind: one record added to a copy of the code, and nothing else.",
        fix="Nothing: it exists only in this test's copy of the code",
    )
'''


@pytest.mark.slow
def test_a_kind_added_as_one_record_is_on_every_surface(tmp_path: Path) -> None:
    for package in ("capture_core", "inspector", "dashboard", "migrations"):
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "data", "node_modules"))
    events = tmp_path / "capture_core" / "events.py"
    source = events.read_text()
    anchor = '    RANK_DIVERGENCE = "rank_divergence", KindRecord('
    assert anchor in source
    events.write_text(source.replace(anchor, PLANTED + anchor))
    shown = surfaces(tmp_path, "planted_example")
    assert shown.pop("api filter planted_example") == 200
    assert shown["planted_example"] == dict.fromkeys(shown["address_drift"], True)

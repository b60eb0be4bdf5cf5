"""The real daemon (`graph-inspector serve` as a subprocess) in real headless Chromium: every page
opens, shows the seeded graphs and violations, draws its charts, runs no injected script, and
never asks anything of a host other than the loopback daemon."""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from capture_core import DecodeRunner, GraphRuntime
from capture_core.reference import ModelConfig, ReferenceDecoder
from inspector import Recorder
from inspector.storage.store import Store, open_store
from tests.support.browser import CHARTS_DRAWN
from tests.support.daemon import Daemon
from tests.support.sample import flush_eager_batch

pytestmark = pytest.mark.browser

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@pytest.fixture(scope="module")
def daemon(
    seeded_template: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    path = tmp_path_factory.mktemp("browser") / "inspector.db"
    shutil.copyfile(seeded_template[0], path)
    url = f"sqlite:///{path}"
    store = open_store(url, upgrade=False)
    stop = threading.Event()
    recorder = threading.Thread(target=_flush_like_a_recorder, args=(store, seeded_template[1], stop))
    recorder.start()
    try:
        with Daemon(url) as running:
            yield running
    finally:
        stop.set()
        recorder.join()
        store.dispose()


def _flush_like_a_recorder(store: Store, ids: dict[str, int], stop: threading.Event) -> None:
    """Keep the eager run live, as its recorder would: every second, one more eager batch."""
    while not stop.wait(1.0):
        flush_eager_batch(store, ids["eager_run"])


@pytest.fixture(scope="module")
def one_window(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon on one ended run that recorded a single window: one decode step of 3 tokens through
    graphs of 1, 2, 4 and 8 tokens, so the graph of 4 replayed once and the others never did."""
    url = f"sqlite:///{tmp_path_factory.mktemp('one-window') / 'inspector.db'}"
    with Recorder(url, label="one step", flush_interval=600) as recorder:
        runtime = GraphRuntime("eager", observer=recorder, progress=False)
        runner = DecodeRunner(ReferenceDecoder(ModelConfig.tiny(max_num_seqs=8, max_seq_len=32)), runtime,
                              sizes=[1, 2, 4, 8])
        runner.capture()
        runner.step(torch.tensor([17, 42, 7]), torch.zeros(3, dtype=torch.long), torch.tensor([0, 3, 5]))
    with Daemon(url) as running:
        yield running


@pytest.fixture(scope="module")
def ids(seeded_template: tuple[Path, dict[str, int]]) -> dict[str, int]:
    return seeded_template[1]


class Visit:
    """A browser page that records every request and every script error."""

    def __init__(self, browser: object, daemon: Daemon) -> None:
        self.daemon = daemon
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)

    def open(self, path: str) -> object:
        response = self.page.goto(self.daemon.url + path.lstrip("/"), wait_until="networkidle")
        assert response is not None and response.status == 200, f"{path}: {response and response.status}"
        return self.page

    def charts_drawn(self) -> dict[str, bool]:
        """Per canvas: a Chart.js chart is attached and has painted non-transparent pixels."""
        return self.page.evaluate(CHARTS_DRAWN)

    def close(self) -> None:
        self.page.close()
        hosts = {urlsplit(url).hostname for url in self.requests if not url.startswith(("data:", "blob:"))}
        assert hosts <= LOOPBACK, f"requests left loopback: {sorted(hosts - LOOPBACK)}"
        assert not self.errors, f"script errors: {self.errors}"


@pytest.fixture
def visit(browser: object, daemon: Daemon) -> Iterator[Visit]:
    opened = Visit(browser, daemon)
    yield opened
    opened.close()


def test_overview_draws_all_four_charts_and_refreshes_while_live(visit: Visit) -> None:
    page = visit.open("/")
    assert page.locator(".kpi-value").first.inner_text() == "77"
    assert visit.charts_drawn() == {
        "chart-series": True, "chart-waste": True, "chart-batches": True, "chart-memory": True,
    }
    assert page.locator("#live-label").is_visible()
    eager = page.locator("[data-kpi='traffic.eager_batches']")
    before = eager.inner_text()
    with page.expect_response(lambda r: "/api/summary" in r.url and r.status == 200, timeout=15_000):
        pass
    page.wait_for_function(
        "(before) => document.querySelector(\"[data-kpi='traffic.eager_batches']\").textContent !== before",
        arg=before, timeout=15_000,
    )
    assert int(eager.inner_text().replace(",", "")) > int(before.replace(",", ""))
    assert visit.charts_drawn()["chart-series"]


def test_graphs_page_lists_the_seeded_graphs_and_sorts(visit: Visit, ids: dict[str, int]) -> None:
    page = visit.open(f"/graphs?run={ids['eager_run']}")
    rows = page.locator("#graphs-table tbody tr")
    assert rows.count() == 7
    assert "eager backend" in rows.first.inner_text()
    page.get_by_role("link", name="Pool memory").click()
    page.wait_for_url("**/graphs?*sort=pool_bytes*")
    memory = page.locator("#graphs-table tbody tr td:nth-child(7)").all_inner_texts()
    assert len(memory) == 7 and memory[0].endswith("KiB") and memory[-1] == "96.0 MiB"  # ascending


def test_graph_page_shows_inputs_and_draws_its_history(visit: Visit, ids: dict[str, int]) -> None:
    page = visit.open(f"/graphs/{ids['eager_graph']}")
    assert "input_ids" in page.locator("#inputs-table").inner_text()
    assert "0x7f3a2c" in page.locator("#inputs-table").inner_text()
    assert visit.charts_drawn() == {"chart-history": True}


def test_violations_page_shows_findings_as_text_and_runs_no_injected_script(visit: Visit) -> None:
    page = visit.open("/violations")
    articles = page.locator("article.violation")
    assert articles.count() == 3
    text = page.locator("main").inner_text()
    assert "moved since capture" in text and "0x7f3a2c9f0400" in text
    assert '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> drift' in text
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("main img").count() == 0
    assert page.locator(".badge.injected").count() == 2
    page.locator("article.violation details summary").first.click()
    assert "Traceback" in page.locator("pre.stack").first.inner_text()
    page.select_option("select[name=kind]", "unexpected_capture")
    page.wait_for_url("**/violations?*kind=unexpected_capture*")
    assert page.locator("article.violation").count() == 1


def test_compile_page_lists_reasons_as_text_and_filters_by_kind(visit: Visit) -> None:
    page = visit.open("/")
    page.locator("#compile-note a", has_text="re-records").click()
    page.wait_for_url("**/compile?*kind=compile_rerecord*")
    page.wait_for_load_state("networkidle")
    rows = page.locator("#compile-table tbody tr")
    assert rows.count() == 2
    assert "static input data pointer changed" in rows.first.inner_text()
    assert "<script>window.__pwned = 3</script> changed" in rows.nth(1).inner_text()
    assert page.evaluate("() => window.__pwned") is None
    rows.first.locator("details summary").click()
    assert "torch.compile re-recorded forward" in rows.first.locator("pre").inner_text()
    page.select_option("select[name=kind]", "")
    page.wait_for_url(lambda url: "kind=compile_rerecord" not in url)
    page.wait_for_load_state("networkidle")
    assert page.locator("#compile-table tbody tr").count() == 3


@pytest.mark.parametrize("order", ["newer first", "older first"])
def test_runs_page_compares_the_newer_ticked_run_against_the_older(
    visit: Visit, ids: dict[str, int], order: str
) -> None:
    page = visit.open("/runs")
    assert page.locator("#runs-table tbody tr").count() == 2
    assert page.locator("#compare-button").is_disabled()
    boxes = page.locator(".compare-pick").all()  # newest run first, as the page lists them
    for box in boxes if order == "newer first" else reversed(boxes):
        box.check()
    page.locator("#compare-button").click()
    page.wait_for_url("**/runs/compare?**")
    page.wait_for_load_state("networkidle")
    older, newer = ids["cuda_run"], ids["eager_run"]
    assert page.url.endswith(f"/runs/compare?a={older}&b={newer}"), "A is the baseline: the older run"
    table = page.locator("#compare-table").inner_text()
    assert "llama-1b decode (H200)" in table and "ci smoke (eager backend)" in table


PAGES = ("/", "/graphs", "/violations", "/compile", "/runs", "/advice", "/jobs", "/runs/compare?a=1&b=2",
         "/graphs/1")
FITS = """() => ({
    overflow: document.documentElement.scrollWidth - window.innerWidth,
    links: [...document.querySelectorAll(".topbar nav a")].map((a) => {
        const box = a.getBoundingClientRect();
        return { text: a.textContent, left: box.left, right: box.right, width: box.width };
    }),
})"""


def test_every_page_fits_a_phone_screen_with_every_link_of_the_navigation_on_it(
    browser: object, daemon: Daemon
) -> None:
    visit = Visit(browser, daemon)
    visit.page.set_viewport_size({"width": 390, "height": 844})
    try:
        for path in PAGES:
            visit.open(path)
            fits = visit.page.evaluate(FITS)
            assert fits["overflow"] <= 0, f"{path} is {fits['overflow']} px wider than the screen"
            assert len(fits["links"]) == 7
            for link in fits["links"]:
                assert link["width"] > 0 and link["left"] >= 0 and link["right"] <= 390, (path, link)
    finally:
        visit.close()


BATCH_AXIS = """() => {
    const x = window.Chart.getChart(document.getElementById("chart-batches")).scales.x;
    return { type: x.type, gaps: [[1, 2], [2, 4], [4, 8], [128, 256]].map(([a, b]) =>
        x.getPixelForValue(b) - x.getPixelForValue(a)) };
}"""


def test_observed_batch_sizes_keep_small_sizes_apart(visit: Visit) -> None:
    # Batches from 1 to ~300 tokens: on a linear axis 1, 2, 4 and 8 are a pixel or two apart.
    visit.open("/")
    axis = visit.page.evaluate(BATCH_AXIS)
    assert axis["type"] == "logarithmic"
    assert min(axis["gaps"]) >= 25, axis
    assert max(axis["gaps"]) - min(axis["gaps"]) < 1, "each doubling as wide as the next"


ONE_LINE = """() => [...document.querySelectorAll("#gate-table td[class^='verdict-']")].map((cell) => {
    const range = document.createRange();
    range.selectNodeContents(cell);
    return { text: cell.textContent, lines: new Set([...range.getClientRects()].map((r) => r.top)).size };
})"""


def test_the_compare_pages_verdicts_are_never_broken_inside_a_word(
    browser: object, daemon: Daemon, ids: dict[str, int]
) -> None:
    visit = Visit(browser, daemon)
    visit.page.set_viewport_size({"width": 390, "height": 844})
    try:
        visit.open(f"/runs/compare?a={ids['cuda_run']}&b={ids['eager_run']}")
        verdicts = visit.page.evaluate(ONE_LINE)
        assert any(v["text"] == "regression" for v in verdicts)
        assert all(v["lines"] == 1 for v in verdicts), verdicts
    finally:
        visit.close()


def test_advice_page_draws_its_charts_and_copies_each_engine_s_line(visit: Visit) -> None:
    page = visit.open("/advice")
    assert visit.charts_drawn() == {"chart-advice-sizes": True, "chart-advice-curve": True}
    assert "%" in page.locator("#advised-waste").inner_text()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=visit.daemon.url.rstrip("/"))
    for engine in ("vllm", "sglang", "tensorrt_llm", "capture_core"):
        page.locator(f"button[data-copy=config-{engine}]").click()
        page.wait_for_function(
            f"() => document.querySelector('button[data-copy=config-{engine}]').textContent === 'Copied'")
        line = page.locator(f"#config-{engine}").inner_text()
        assert page.evaluate("() => navigator.clipboard.readText()") == line
    assert line.startswith("sizes=[")
    page.fill("input[name=max_graphs]", "3")
    page.get_by_role("button", name="Advise").click()
    page.wait_for_url("**/advice?*max_graphs=3*")
    page.wait_for_load_state("networkidle")
    assert page.locator("#advised-graphs").inner_text() == "3"
    assert visit.charts_drawn()["chart-advice-curve"]


def test_json_twins_and_health_answer_over_the_real_server(visit: Visit) -> None:
    for path in ("api/summary", "api/graphs", "api/violations", "api/compile", "api/runs", "api/advice",
                 "healthz"):
        body = visit.page.request.get(visit.daemon.url + path).json()
        assert body["ok"] is True, (path, body)
    metrics = visit.page.request.get(visit.daemon.url + "metrics")
    assert metrics.status == 200 and "# TYPE" in metrics.text()


AXIS_TICKS = """() => Object.fromEntries([...document.querySelectorAll("canvas")].map((canvas) => {
    const chart = window.Chart.getChart(canvas), ctx = chart.ctx;
    const scale = Object.values(chart.scales).find((s) => s.isHorizontal());
    ctx.save();
    ctx.font = window.Chart.helpers.toFont(scale.options.ticks.font).string;
    const ticks = scale.ticks.map((tick, i) => {
        const width = ctx.measureText(String(tick.label)).width, x = scale.getPixelForTick(i);
        return { value: tick.value, left: x - width / 2, right: x + width / 2 };
    });
    ctx.restore();
    return [canvas.id, { type: scale.type, ticks }];
}))"""


def test_overview_axes_tick_evenly_and_no_labels_collide(visit: Visit) -> None:
    visit.open("/")
    for chart, axis in visit.page.evaluate(AXIS_TICKS).items():
        ticks = axis["ticks"]
        assert len(ticks) >= 2, chart
        gaps = [b["left"] - a["right"] for a, b in itertools.pairwise(ticks)]
        assert min(gaps) >= 4, f"{chart}: tick labels collide: {ticks}"
        if axis["type"] == "linear":
            steps = {round(b["value"] - a["value"], 6) for a, b in itertools.pairwise(ticks)}
            assert len(steps) == 1, f"{chart}: an odd tick among even ones: {[t['value'] for t in ticks]}"


LONE_POINT = """(id) => {
    const chart = window.Chart.getChart(document.getElementById(id));
    return chart.data.datasets.map((dataset, d) => {
        const drawn = chart.getDatasetMeta(d).data.filter((point, i) => {
            const value = dataset.data[i];
            return (value !== null && typeof value === "object" ? value.y : value) !== null;
        });
        const ratio = chart.currentDevicePixelRatio;
        return drawn.map((point) => {
            const x = Math.round(point.x * ratio), y = Math.round(point.y * ratio);
            const pixel = [...chart.ctx.getImageData(x, y, 1, 1).data];
            return { radius: point.options.radius, pixel, color: dataset.borderColor };
        });
    });
}"""


def assert_one_dot_per_line(visit: Visit, canvas: str, lines: int) -> None:
    """Each line dataset of ``canvas`` has exactly one point, and it is drawn in the line's colour."""
    datasets = visit.page.evaluate(LONE_POINT, canvas)
    assert len(datasets) >= lines
    for points in datasets[-lines:]:
        [point] = points
        red, green, blue = (int(point["color"][i:i + 2], 16) for i in (1, 3, 5))
        assert point["radius"] > 0 and point["pixel"][3] > 128, point  # a dot, painted (anti-aliased)
        assert max(abs(a - b) for a, b in zip(point["pixel"], (red, green, blue), strict=False)) < 80, point


def test_a_one_window_series_draws_its_points(browser: object, one_window: Daemon) -> None:
    visit = Visit(browser, one_window)
    try:
        page = visit.open("/?run=1")
        assert page.evaluate("() => JSON.parse(document.getElementById('summary-data').textContent)"
                             ".charts.series.length") == 1
        assert_one_dot_per_line(visit, "chart-series", lines=2)
    finally:
        visit.close()


def test_an_ended_runs_graph_pages_say_what_happened(browser: object, one_window: Daemon) -> None:
    visit = Visit(browser, one_window)
    try:
        graphs = visit.page.request.get(one_window.url + "api/graphs?run=1").json()["data"]["items"]
        replayed = {g["traffic"]["replays"] > 0: g["id"] for g in graphs}
        page = visit.open(f"/graphs/{replayed[False]}")
        heading = page.locator("h2", has_text="Replay history").inner_text()
        assert heading == "Replay history"
        assert page.locator(".chart-empty").inner_text() == (
            "Never replayed: run #1 ended without a batch for this graph."
        )
        page = visit.open(f"/graphs/{replayed[True]}")
        assert page.locator("h2", has_text="Replay history").inner_text() == "Replay history (last 1 window)"
        assert page.locator(".chart-empty").count() == 0
        assert_one_dot_per_line(visit, "chart-history", lines=1)
    finally:
        visit.close()


# ------------------------------------------------------------------ what the pages promise (issue 27)


def _planted_faults_run(url: str) -> None:
    """A run like the demo's: decode graphs, an address drift and an unexpected capture planted on
    purpose (labelled injected), the unexpected size captured anyway."""
    with Recorder(url, label="planted faults", flush_interval=600, job="") as recorder:
        runtime = GraphRuntime("eager", observer=recorder, progress=False, unexpected_capture="capture")
        runner = DecodeRunner(ReferenceDecoder(ModelConfig.tiny(max_num_seqs=8, max_seq_len=32)), runtime,
                              sizes=[1, 2, 4, 8])
        runner.capture()
        tokens = (torch.tensor([17, 42, 7]), torch.zeros(3, dtype=torch.long), torch.tensor([0, 3, 5]))
        runner.step(*tokens)
        with runtime.injected_faults():
            runner.inject_address_drift(*tokens)
            runner.inject_unexpected_capture()


def _run_with_no_capture_phase(url: str) -> None:
    """A runtime configured to capture whose batches all came before any capture phase."""
    from capture_core import BatchDescriptor, CUDAGraphMode, CUDAGraphWrapper
    from capture_core.forward_context import set_forward_context

    with Recorder(url, label="no capture phase", flush_interval=600, job="") as recorder:
        wrapped = CUDAGraphWrapper(lambda x: x * 2, GraphRuntime("eager", observer=recorder, progress=False))
        static = torch.zeros(8)
        for size in (1, 2, 4, 8, 8):
            with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(size)):
                wrapped(static[:size])


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon on: the planted-faults run (1), the run with no capture phase (2), and a job of two
    ranks (3, 4) whose one divergence was seen five times."""
    from sqlalchemy import select

    from inspector.storage.models import Violation
    from inspector.storage.writer import add_to_violation
    from tests.support.sample import seed_job

    url = f"sqlite:///{tmp_path_factory.mktemp('faults') / 'inspector.db'}"
    _planted_faults_run(url)
    _run_with_no_capture_phase(url)
    seed_job(url, "torchrun:faults-job")
    store = open_store(url)
    with store.writer() as conn:
        divergences = select(Violation.id).where(Violation.kind == "rank_divergence")
        first = conn.scalar(divergences.order_by(Violation.id))
        add_to_violation(conn, first, 4, 1.0e9)
    store.dispose()
    with Daemon(url) as running:
        yield running


@pytest.fixture
def at(browser: object, faults: Daemon) -> Iterator[Visit]:
    opened = Visit(browser, faults)
    yield opened
    opened.close()


NEVER_CAPTURED = ("captured no graph: its 5 batch(es) ran eagerly, before any capture phase. Graphs are "
                  "captured only inside `with runtime.capture_phase():` (a runner's capture() opens one).")


def test_the_overview_says_which_run_captured_no_graph_and_marks_what_was_injected(at: Visit) -> None:
    page = at.open("/")
    notice = page.locator(".never-captured")
    assert notice.count() == 1 and notice.inner_text() == f"Run #2 no capture phase {NEVER_CAPTURED}"
    assert page.locator(".never-captured a").get_attribute("href") == "/?run=2"
    graphs_note = page.locator(".kpi", has_text="Graphs captured").locator(".kpi-note").inner_text()
    assert graphs_note.endswith("1 unexpected injected"), graphs_note
    violations_note = page.locator(".kpi", has_text="Violations").locator(".kpi-note").inner_text()
    assert "1 address drift injected" in violations_note
    assert "1 unexpected capture injected" in violations_note
    assert "rank divergence injected" not in violations_note
    assert at.open("/?run=1").locator(".never-captured").count() == 0


def test_the_graphs_list_marks_the_graph_an_injected_unexpected_capture_made(at: Visit) -> None:
    rows = at.open("/graphs?run=1").locator("#graphs-table tbody tr")
    marked = [row.inner_text() for row in rows.all() if row.locator(".badge.injected").count()]
    assert len(marked) == 1 and "unexpected" in marked[0]


def test_a_violation_links_to_its_graph_and_a_rank_divergence_to_its_job(at: Visit) -> None:
    page = at.open("/violations?kind=address_drift")
    link = page.locator(".violation .graph-link").first
    link.click()
    page.wait_for_url("**/graphs/*")
    assert page.locator("h1").inner_text().startswith("Graph ")
    assert "address drift" in page.locator("section.panel", has_text="Violations of this graph").inner_text()
    page = at.open("/violations?kind=rank_divergence")
    assert page.locator(".violation").count() == 3
    page.locator(".violation .job-link").first.click()
    page.wait_for_url("**/ranks?job=*")
    assert page.locator("h1").inner_text() == "Job torchrun:faults-job"


def test_jobs_count_divergences_as_the_ranks_page_does_and_say_when_a_job_ended(at: Visit) -> None:
    page = at.open("/jobs")
    row = page.locator("#jobs-table tbody tr", has_text="torchrun:faults-job")
    cells = row.locator("td").all_inner_texts()
    assert cells[3].startswith("ended ") and "last seen" not in cells[3], cells
    assert cells[4] == "3", "three distinct divergences, one of them seen five times"
    row.locator("td").nth(4).locator("a").click()
    page.wait_for_url("**/ranks?job=*")
    assert page.locator("#ranks-verdict").inner_text().startswith("3 rank divergence(s)")


SETTING_LINES = """() => [...document.querySelectorAll("tr.config-setting")].map((row) => ({
    key: row.querySelector("th").innerText, differs: row.classList.contains("differs"),
    lines: [...row.querySelectorAll("td")].map((cell) => {
        const range = document.createRange();
        range.selectNodeContents(cell);
        return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size;
    }),
}))"""


def test_the_compare_page_lists_each_setting_on_a_line_the_differing_ones_first_and_marked(at: Visit) -> None:
    from inspector.storage.models import Run

    store = open_store(at.daemon.command[at.daemon.command.index("--db") + 1])
    with store.writer() as conn:
        conn.execute(Run.__table__.update().where(Run.id == 1).values(
            config='{"sizes": [1, 2, 4, 8], "mode": "full", "checks": "always_on"}'))
        conn.execute(Run.__table__.update().where(Run.id == 2).values(
            config='{"sizes": [1, 2, 4, 8, 16], "mode": "full", "checks": "debug"}'))
    store.dispose()
    page = at.open("/runs/compare?a=1&b=2")
    settings = page.evaluate(SETTING_LINES)
    assert [(s["key"].split()[0], s["differs"]) for s in settings] == [
        ("checks", True), ("sizes", True), ("mode", False)]
    assert all(s["lines"] == [1, 1] for s in settings), settings
    assert page.locator("#config-verdict").inner_text() == "2 of 3 setting(s) differ, marked and listed first"
    assert "[1, 2, 4, 8, 16]" in page.locator("tr.config-setting.differs", has_text="sizes").inner_text()

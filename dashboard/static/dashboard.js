/* graph-inspector dashboard: draws the charts, refreshes live pages, picks runs to compare.
 * Data arrives as JSON (embedded <script type="application/json"> or /api/*) and is only ever
 * written into the page as text (textContent) or chart data, never as HTML: violation messages and
 * stacks come from the engine and are untrusted. */
(function () {
  "use strict";

  const COLORS = { full: "#3461d1", piecewise: "#7c4dff", waste: "#e8833a", hit: "#1f8a4c", replays: "#9db4ee",
                   capture: "rgba(197, 53, 43, 0.55)", grid: "#eceef3" };
  const REFRESH_MS = 5000;

  const fmt = {
    count: (v) => (v === null || v === undefined ? "\u2013" : Number(v).toLocaleString("en-US")),
    percent: (v) => (v === null || v === undefined ? "\u2013" : (v * 100).toFixed(1) + " %"),
    bytes: (v) => {
      if (v === null || v === undefined) return "\u2013";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let size = Number(v), unit = 0;
      while (Math.abs(size) >= 1024 && unit < units.length - 1) { size /= 1024; unit += 1; }
      return unit === 0 ? size + " B" : size.toFixed(1) + " " + units[unit];
    },
    seconds: (v) => {
      if (v === null || v === undefined) return "\u2013";
      if (Math.abs(v) < 1) return (v * 1000).toFixed(1) + " ms";
      if (Math.abs(v) < 120) return v.toFixed(2) + " s";
      return (v / 60).toFixed(1) + " min";
    },
    clock: (t, span) => {
      const d = new Date(t * 1000);
      const hm = d.toISOString().slice(11, span > 2 * 86400 ? 16 : 19);
      return span > 86400 ? d.toISOString().slice(5, 10) + " " + hm.slice(0, 5) : hm;
    },
  };

  function readJson(id) {
    const node = document.getElementById(id);
    return node ? JSON.parse(node.textContent) : null;
  }

  function pick(obj, path) {
    return path.split(".").reduce((o, key) => (o === null || o === undefined ? o : o[key]), obj);
  }

  function chartsAvailable() {
    if (window.Chart) return true;
    document.querySelectorAll(".chart-box").forEach((box) => {
      const note = document.createElement("div");
      note.className = "chart-empty";
      note.textContent = "Chart unavailable: the chart library is not installed.";
      box.appendChild(note);
    });
    return false;
  }

  function emptyNote(canvas, empty) {
    const box = canvas.parentElement;
    let note = box.querySelector(".chart-empty");
    if (empty && !note) {
      note = document.createElement("div");
      note.className = "chart-empty";
      note.textContent = canvas.dataset.empty || "No data yet.";
      box.appendChild(note);
    } else if (!empty && note) {
      note.remove();
    }
  }

  const baseOptions = () => ({
    responsive: true,
    maintainAspectRatio: false,
    animation: false,
    interaction: { mode: "nearest", intersect: false },
    plugins: { legend: { position: "bottom", labels: { boxWidth: 12, boxHeight: 12 } } },
  });

  /* Dashed vertical lines at the capture sizes, over the batch-size histogram. */
  const captureSizeLines = {
    id: "captureSizeLines",
    afterDatasetsDraw(chart, _args, options) {
      const sizes = options.sizes || [];
      const x = chart.scales.x, area = chart.chartArea, ctx = chart.ctx;
      ctx.save();
      ctx.strokeStyle = COLORS.capture;
      ctx.setLineDash([4, 3]);
      ctx.lineWidth = 1;
      sizes.forEach((size) => {
        const px = x.getPixelForValue(size);
        if (px < area.left || px > area.right) return;
        ctx.beginPath();
        ctx.moveTo(px, area.top);
        ctx.lineTo(px, area.bottom);
        ctx.stroke();
      });
      ctx.restore();
    },
  };

  /* Points on a time axis, with a break (null) wherever a stretch of buckets is missing, so that
   * the line does not bridge the hours between two runs. */
  function withGaps(points, value) {
    const data = [];
    const steps = points.slice(1).map((p, i) => p.t - points[i].t);
    const step = steps.length ? Math.min(...steps) : 0;
    points.forEach((p, i) => {
      if (i > 0 && p.t - points[i - 1].t > 2 * step) data.push({ x: points[i - 1].t + step, y: null });
      const v = value(p);
      data.push({ x: p.t, y: v === null ? null : v * 100 });
    });
    return data;
  }

  /* Lines hide their points, but a point with no neighbour to join (a single window, or one between
   * two gaps) has no line either: draw it as a dot, or it would not show at all. */
  function loneDotRadius(context) {
    const data = context.dataset.data;
    const y = (i) => { const d = data[i]; return (d !== null && typeof d === "object" ? d.y : d) ?? null; };
    const i = context.dataIndex;
    return y(i) !== null && y(i - 1) === null && y(i + 1) === null ? 3 : 0;
  }

  function seriesConfig(s) {
    const points = s.charts.series;
    const span = points.length ? points[points.length - 1].t - points[0].t : 0;
    const pad = points.length && span === 0 ? 30 : 0;  // one window: an axis a minute wide around it
    const line = (label, color, value) => ({
      label, data: withGaps(points, value), borderColor: color, backgroundColor: color,
      pointRadius: loneDotRadius, borderWidth: 2, spanGaps: false,
    });
    return {
      type: "line",
      data: {
        datasets: [
          line("hit ratio", COLORS.hit, (p) => p.hit_ratio),
          line("padding waste", COLORS.waste, (p) => p.padding_waste),
        ],
      },
      options: Object.assign(baseOptions(), {
        scales: { y: { min: 0, max: 100, ticks: { callback: (v) => v + " %" }, grid: { color: COLORS.grid } },
                  x: { type: "linear", min: points.length ? points[0].t - pad : undefined,
                       max: points.length ? points[points.length - 1].t + pad : undefined,
                       ticks: { maxTicksLimit: 7, maxRotation: 0, precision: 0, includeBounds: false,
                                callback: (v) => fmt.clock(v, span || 2 * pad) },
                       grid: { display: false }, title: { display: true, text: "time (UTC)" } } },
        plugins: Object.assign(baseOptions().plugins, {
          tooltip: { callbacks: {
            title: (items) => (items.length ? fmt.clock(items[0].parsed.x, span) : ""),
            label: (c) => c.dataset.label + ": " + (c.parsed.y === null ? "\u2013" : c.parsed.y.toFixed(1) + " %"),
          } },
        }),
      }),
    };
  }

  function wasteConfig(s) {
    const rows = s.charts.waste_by_size;
    const sizes = [...new Set(rows.map((r) => r.captured_size))].sort((a, b) => a - b);
    const modes = [...new Set(rows.map((r) => r.mode))].sort();
    return {
      type: "bar",
      data: {
        labels: sizes.map(String),
        datasets: modes.map((mode) => ({
          label: mode,
          backgroundColor: COLORS[mode] || COLORS.replays,
          data: sizes.map((size) => {
            const row = rows.find((r) => r.captured_size === size && r.mode === mode);
            return row && row.padding_waste !== null ? row.padding_waste * 100 : null;
          }),
        })),
      },
      options: Object.assign(baseOptions(), {
        scales: { y: { min: 0, ticks: { callback: (v) => v + " %" }, grid: { color: COLORS.grid },
                       title: { display: true, text: "padding waste" } },
                  x: { title: { display: true, text: "capture size (tokens)" }, grid: { display: false },
                       ticks: { maxRotation: 0, autoSkipPadding: 6 } } },
      }),
    };
  }

  /* Batch sizes on a log axis when they span more than a few doubling steps (small sizes 1, 2, 4, 8
   * are as far apart as 128, 256, 512, 1024: on a linear axis up to 300 they share one pixel column);
   * ticks at the powers of two, where capture sizes usually are. Linear for a narrow range. */
  function batchAxis(smallest, largest) {
    const title = { display: true, text: "real tokens per batch (dashed: capture sizes)" };
    if (largest / smallest < 16) {
      return { type: "linear", min: Math.max(0, smallest - 1), max: largest + 1, title: title,
               ticks: { includeBounds: false },  // no odd last tick (321) squeezed in beside 300
               grid: { display: false } };
    }
    return {
      type: "logarithmic", min: smallest / 1.25, max: largest * 1.25,
      title: { display: true, text: title.text + ", log scale" }, grid: { display: false },
      afterBuildTicks: (axis) => {
        const ticks = [];
        for (let v = 1; v <= axis.max; v *= 2) if (v >= axis.min) ticks.push({ value: v });
        axis.ticks = ticks;
      },
      ticks: { autoSkip: true, maxRotation: 0, callback: (v) => String(v) },
    };
  }

  /* Each size n as a column from n - 0.5 to n + 0.5 (one token wide on either axis), drawn as a
   * filled outline: Chart.js sizes bars by their closest neighbours, which on a log axis would make
   * the bar of 2 as wide as the gap up to 4. */
  function batchColumns(rows) {
    const points = [];
    rows.forEach((r) => {
      const n = r.num_real_tokens, size = { size: n, batches: r.batches };
      points.push({ x: n - 0.5, y: 0 }, { x: n - 0.5, y: r.batches, ...size },
                  { x: n + 0.5, y: r.batches, ...size }, { x: n + 0.5, y: 0 });
    });
    return points;
  }

  function batchesConfig(s) {
    const rows = s.charts.batch_sizes;
    const sizes = s.charts.capture_sizes;
    const values = [...rows.map((r) => r.num_real_tokens), ...sizes].filter((v) => v > 0);
    const smallest = values.length ? Math.min(...values) : 1, largest = Math.max(1, ...values);
    return {
      type: "line",
      data: { datasets: [{ label: "batches of this many tokens", backgroundColor: COLORS.replays,
                           borderColor: COLORS.replays, borderWidth: 1, pointRadius: 0, pointHitRadius: 4,
                           fill: "origin", data: batchColumns(rows) }] },
      options: Object.assign(baseOptions(), {
        scales: { x: batchAxis(smallest, largest),
                  y: { beginAtZero: true, grid: { color: COLORS.grid }, title: { display: true, text: "batches" } } },
        plugins: Object.assign(baseOptions().plugins, {
          captureSizeLines: { sizes: sizes },
          tooltip: { filter: (c) => c.raw.size !== undefined, callbacks: {
            title: () => "", label: (c) => c.raw.batches + " batch(es) of " + c.raw.size + " tokens" } },
        }),
      }),
      plugins: [captureSizeLines],
    };
  }

  /* Log scale when the sizes span decades (the first graph holds the shared pool, the rest little
   * of their own); linear when they do not, or when some graph holds nothing (log has no zero). */
  function memoryAxis(rows) {
    const mib = rows.map((r) => r.pool_bytes / 1048576);
    const smallest = Math.min(...mib), largest = Math.max(...mib);
    if (smallest > 0 && largest / smallest > 20) {
      return { type: "logarithmic", title: { display: true, text: "pool memory (MiB, log scale)" },
               grid: { color: COLORS.grid }, ticks: { callback: (v) => (String(v)[0] === "1" ? v : "") } };
    }
    return { type: "linear", beginAtZero: true, title: { display: true, text: "pool memory (MiB)" },
             grid: { color: COLORS.grid } };
  }

  function memoryConfig(s) {
    const rows = s.charts.graph_memory;
    const modes = [...new Set(rows.map((r) => r.mode))].sort();
    return {
      type: "scatter",
      data: {
        datasets: modes.map((mode, i) => ({
          label: mode,
          backgroundColor: COLORS[mode] || COLORS.replays,
          borderColor: COLORS[mode] || COLORS.replays,
          pointStyle: ["circle", "triangle", "rect"][i % 3],
          pointRadius: 4,
          data: rows.filter((r) => r.mode === mode).map((r) => ({ x: r.captured_size, y: r.pool_bytes / 1048576, id: r.id })),
        })),
      },
      options: Object.assign(baseOptions(), {
        scales: { x: { title: { display: true, text: "capture size (tokens)" }, grid: { color: COLORS.grid } },
                  y: memoryAxis(rows) },
        plugins: Object.assign(baseOptions().plugins, {
          tooltip: { callbacks: { label: (c) => "graph #" + c.raw.id + ": " + c.raw.x + " tokens, " + c.raw.y.toFixed(1) + " MiB" } },
        }),
        onClick: (_e, elements, chart) => {
          if (!elements.length) return;
          const point = chart.data.datasets[elements[0].datasetIndex].data[elements[0].index];
          window.location.href = "/graphs/" + encodeURIComponent(point.id);
        },
      }),
    };
  }

  const OVERVIEW_CHARTS = [
    ["chart-series", seriesConfig, (s) => s.charts.series.length === 0],
    ["chart-waste", wasteConfig, (s) => s.charts.waste_by_size.length === 0],
    ["chart-batches", batchesConfig, (s) => s.charts.batch_sizes.length === 0],
    ["chart-memory", memoryConfig, (s) => s.charts.graph_memory.every((r) => r.pool_bytes === 0)],
  ];

  function drawOverview(summary, charts) {
    OVERVIEW_CHARTS.forEach(([id, config, isEmpty]) => {
      const canvas = document.getElementById(id);
      if (!canvas) return;
      emptyNote(canvas, isEmpty(summary));
      const fresh = config(summary);
      if (charts[id]) {
        charts[id].data = fresh.data;
        charts[id].options = fresh.options;
        charts[id].update("none");
      } else {
        charts[id] = new window.Chart(canvas, fresh);
      }
    });
  }

  function updateKpis(summary) {
    document.querySelectorAll("[data-kpi]").forEach((node) => {
      const format = fmt[node.dataset.format] || fmt.count;
      node.textContent = format(pick(summary, node.dataset.kpi));
    });
  }

  function overview() {
    let summary = readJson("summary-data");
    if (!summary) return;
    const charts = {};
    const canDraw = chartsAvailable();
    if (canDraw) drawOverview(summary, charts);
    live(async () => {
      const response = await fetch("/api/summary" + window.location.search, { headers: { Accept: "application/json" } });
      const body = await response.json();
      if (!body.ok) throw new Error(body.error);
      summary = body.data;
      updateKpis(summary);
      if (canDraw) drawOverview(summary, charts);
      if (summary.runs.live.length === 0) stopLive();
    });
  }

  function graphPage() {
    const history = readJson("graph-data");
    const canvas = document.getElementById("chart-history");
    if (!history || !canvas || !chartsAvailable()) return;
    emptyNote(canvas, history.length === 0);
    const span = history.length ? history[history.length - 1].start - history[0].start : 0;
    new window.Chart(canvas, {
      type: "bar",
      data: {
        labels: history.map((w) => fmt.clock(w.start, span)),
        datasets: [
          // order 1: the bars are drawn first, under the waste line (a lone dot included)
          { label: "replays", data: history.map((w) => w.replays), backgroundColor: COLORS.replays, yAxisID: "y", order: 1 },
          { label: "padding waste", type: "line", data: history.map((w) => (w.padding_waste === null ? null : w.padding_waste * 100)),
            borderColor: COLORS.waste, backgroundColor: COLORS.waste, pointRadius: loneDotRadius, borderWidth: 2, yAxisID: "waste" },
        ],
      },
      options: Object.assign(baseOptions(), {
        scales: { y: { beginAtZero: true, title: { display: true, text: "replays" }, grid: { color: COLORS.grid } },
                  waste: { position: "right", min: 0, max: 100, ticks: { callback: (v) => v + " %" }, grid: { display: false } },
                  x: { ticks: { maxTicksLimit: 8, maxRotation: 0 }, grid: { display: false } } },
      }),
    });
  }

  /* Padding tokens per capture size: the current sizes' bars beside the advised sizes'. */
  function adviceSizesConfig(a) {
    const bars = (label, color, projection) => ({
      label, backgroundColor: color, barThickness: 6,
      data: projection.by_size.map((row) => ({ x: row.captured_size, y: row.traffic.padding_tokens,
                                                waste: row.traffic.padding_waste })),
    });
    return {
      type: "bar",
      data: { datasets: [bars("now (" + a.current.graphs + " sizes)", COLORS.capture, a.current),
                         bars("advised (" + a.graphs + " sizes)", COLORS.full, a.advised)] },
      options: Object.assign(baseOptions(), {
        scales: { x: { type: "linear", min: 0, title: { display: true, text: "capture size (tokens)" }, grid: { display: false } },
                  y: { beginAtZero: true, grid: { color: COLORS.grid }, title: { display: true, text: "padding tokens" } } },
        plugins: Object.assign(baseOptions().plugins, {
          tooltip: { callbacks: { label: (c) => c.dataset.label + ": size " + c.raw.x + ", " + fmt.count(c.raw.y) +
                                               " padding tokens (" + fmt.percent(c.raw.waste) + ")" } },
        }),
      }),
    };
  }

  /* The knee: the best sizes' waste for every number of graphs, and where now and the advice sit. */
  function adviceCurveConfig(a) {
    const point = (label, color, graphs, waste) => ({
      label, type: "scatter", backgroundColor: color, borderColor: color, pointRadius: 6,
      data: [{ x: graphs, y: waste === null ? null : waste * 100 }],
    });
    return {
      type: "line",
      data: { datasets: [
        { label: "best sizes for this many graphs", borderColor: COLORS.waste, backgroundColor: COLORS.waste,
          pointRadius: 0, borderWidth: 2,
          data: a.curve.map((p) => ({ x: p.graphs, y: p.padding_waste === null ? null : p.padding_waste * 100 })) },
        point("now", COLORS.capture, a.current.graphs, a.current.traffic.padding_waste),
        point("advised", COLORS.full, a.graphs, a.advised.traffic.padding_waste),
      ] },
      options: Object.assign(baseOptions(), {
        scales: { x: { type: "linear", min: 1, title: { display: true, text: "graphs (capture sizes)" }, grid: { display: false } },
                  y: { min: 0, ticks: { callback: (v) => v + " %" }, grid: { color: COLORS.grid },
                       title: { display: true, text: "padding waste" } } },
        plugins: Object.assign(baseOptions().plugins, {
          tooltip: { callbacks: { label: (c) => c.dataset.label + ": " + c.parsed.x + " graphs, " +
                                               (c.parsed.y === null ? "\u2013" : c.parsed.y.toFixed(1) + " %") } },
        }),
      }),
    };
  }

  /* Copy a config line: the clipboard API where the page may use it, else select it for the reader. */
  function copyButtons() {
    document.querySelectorAll("button[data-copy]").forEach((button) => {
      button.addEventListener("click", async () => {
        const source = document.getElementById(button.dataset.copy);
        try {
          await navigator.clipboard.writeText(source.textContent);
          button.textContent = "Copied";
        } catch (_error) {
          const range = document.createRange();
          range.selectNodeContents(source);
          const selection = window.getSelection();
          selection.removeAllRanges();
          selection.addRange(range);
          button.textContent = "Selected: press Ctrl+C";
        }
      });
    });
  }

  function advicePage() {
    copyButtons();
    const data = readJson("advice-data");
    if (!data || !data.advice || !chartsAvailable()) return;
    [["chart-advice-sizes", adviceSizesConfig], ["chart-advice-curve", adviceCurveConfig]].forEach(([id, config]) => {
      const canvas = document.getElementById(id);
      if (canvas) new window.Chart(canvas, config(data.advice));
    });
  }

  function runsPage() {
    const form = document.getElementById("compare-form");
    const button = document.getElementById("compare-button");
    if (!form || !button) return;
    const picks = () => [...document.querySelectorAll(".compare-pick:checked")].map((box) => box.value);
    const sync = () => { button.disabled = picks().length !== 2; };
    document.querySelectorAll(".compare-pick").forEach((box) => box.addEventListener("change", sync));
    sync();
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      // The older run is the baseline (A) and the newer the candidate (B), whichever is ticked first.
      const [a, b] = picks().sort((x, y) => Number(x) - Number(y));
      if (a && b) window.location.href = form.action + "?a=" + encodeURIComponent(a) + "&b=" + encodeURIComponent(b);
    });
  }

  let liveTimer = null;
  function stopLive() {
    if (liveTimer) clearInterval(liveTimer);
    liveTimer = null;
    const label = document.getElementById("live-label");
    if (label) label.textContent = "run ended · reload for the final numbers";
  }

  /* While a run is recording, refresh every few seconds (only while the tab is visible). */
  function live(refresh) {
    if (document.body.dataset.live !== "true") return;
    liveTimer = setInterval(() => {
      if (document.visibilityState !== "visible") return;
      refresh().catch((error) => {
        const label = document.getElementById("live-label");
        if (label) label.textContent = "refresh failed: " + error.message;
      });
    }, REFRESH_MS);
  }

  const PAGES = {
    "pages.overview": overview,
    "pages.graph": graphPage,
    "pages.runs": runsPage,
    "pages.advice": advicePage,
  };

  /* Filter drop-downs apply as soon as they change (no inline handlers: the CSP forbids them). */
  function autoSubmitFilters() {
    document.querySelectorAll("form.filters select").forEach((select) => {
      select.addEventListener("change", () => select.form.submit());
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    autoSubmitFilters();
    const page = document.body.dataset.page;
    (PAGES[page] || (() => {}))();
    // Other pages reload whole, unless the reader is in the middle of something (a ticked run, an
    // open stack, a focused filter).
    if (page !== "pages.overview") {
      live(async () => {
        if (!document.querySelector(".compare-pick:checked, details[open], input:focus, select:focus")) {
          window.location.reload();
        }
      });
    }
  });
})();

/* The tenx dashboard: draws the run views of tenx/monitor/dashboard/data.py with plotly.js.
 *
 * Live (`tenx dashboard`): the views are fetched from api/run/I and fetched again every `refresh_s`
 * seconds (every 30 s once every run has finished). Report (`tenx report`): the views are in the page.
 * Text from the run directories (names, event fields, errors) is set as text, or escaped before plotly
 * renders it, never parsed as HTML.
 */
(function () {
  "use strict";

  var config = JSON.parse(document.getElementById("tenx-config").textContent);
  var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22"];
  var SYMBOLS = ["circle", "diamond", "square", "triangle-up", "x", "star", "cross", "triangle-down"];
  var KIND_COLORS = {
    "fault": "#d62728", "rollback": "#9467bd", "skipped-step": "#ff7f0e", "off-prediction": "#e377c2",
    "on-prediction": "#2ca02c", "hang": "#8c564b", "restart": "#17becf", "stopped": "#7f7f7f",
  };
  var MARKED_KINDS = {"fault": true, "rollback": true, "off-prediction": true};
  var GOODPUT = [["productive_s", "productive", "#2ca02c"], ["startup_s", "startup", "#9ecae1"],
    ["restart_s", "restarts", "#d62728"], ["recompute_s", "recompute", "#ff7f0e"],
    ["checkpoint_s", "checkpoint", "#9467bd"], ["skipped_s", "skipped", "#e377c2"],
    ["other_s", "other", "#c7c7c7"]];
  var STAT_TITLES = {
    "logit_max": "largest output logit", "logit_entropy": "next-token entropy (nats)",
    "loss_source": "loss per data source (nats/token)", "memory_gib": "peak memory per rank (GiB)",
  };
  var PLOT_CONFIG = {displaylogo: false, responsive: true};
  var heatmapRun = 0;
  var latest = [];
  var syncing = false;
  var stepZoom = null;  /* the steps in view after a zoom, [first, last]; null: each chart's own steps */
  var LOG_TICKFORMAT = ",.3~r";  /* every tick of a log axis labelled with its value: 0.02, 0.5, 1, 2,000 */

  function esc(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;");
  }

  function rgba(hex, alpha) {
    var n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + alpha + ")";
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "-";
    if (typeof value !== "number") return String(value);
    return Math.abs(value) >= 1e5 ? value.toExponential(2) : value.toFixed(digits);
  }

  function percent(fraction) {
    var p = 100 * fraction;
    return (p >= 10 || p === 0 ? p.toFixed(1) : p.toPrecision(2)) + "%";
  }

  function color(i) { return COLORS[i % COLORS.length]; }

  function finite(v) { return typeof v === "number" && isFinite(v); }

  /* The curve's largest value after a 9-step running median: a few spiking steps do not count. */
  function robustMax(values) {
    var best = null;
    for (var i = 0; i < values.length; i++) {
      var w = values.slice(Math.max(0, i - 4), i + 5).filter(finite).sort(function (a, b) { return a - b; });
      if (w.length && (best === null || w[w.length >> 1] > best)) best = w[w.length >> 1];
    }
    return best;
  }

  /* A y range for the loss chart that leaves out spikes (a fault, a divergence) so the curve stays
   * readable; null when nothing is left out. `note` says how many points are above it. */
  function lossRange(runs) {
    var highs = [], lows = [], all = [];
    runs.forEach(function (run) {
      var loss = run.series.loss || [];
      var val = run.val.loss.filter(finite);
      if (loss.length) highs.push(robustMax(loss));
      if (val.length) highs.push(Math.max.apply(null, val));
      if (!loss.length && !val.length && run.prediction) highs.push(robustMax(run.prediction.upper));
      all = all.concat(loss.filter(finite), val);
      lows = lows.concat(loss.filter(finite), val, run.prediction ? run.prediction.lower.filter(finite) : []);
    });
    highs = highs.filter(finite);
    if (!highs.length || !lows.length) return null;
    var hi = Math.max.apply(null, highs);
    var lo = Math.min.apply(null, lows);
    var limit = hi + 0.25 * (hi - lo);
    var above = all.filter(function (v) { return v > limit; });
    if (!above.length) return null;
    var top = Math.max.apply(null, all.filter(function (v) { return v <= limit; }).concat([hi]));
    var pad = 0.05 * (top - lo || 1);
    return {range: [lo - pad, top + pad], note: above.length + " point(s) above the chart, up to " +
      fmt(Math.max.apply(null, above), 1) + " (autoscale shows them)"};
  }

  function kindColor(kind) {
    if (KIND_COLORS[kind]) return KIND_COLORS[kind];
    if (kind.indexOf("trend") === 0 || kind === "drift" || kind === "growth") return "#bcbd22";
    if (kind.indexOf("replica") === 0) return "#17becf";
    return "#555555";
  }

  function layout(title, extra) {
    var base = {
      title: {text: title, font: {size: 14}, x: 0.01, xanchor: "left"},
      margin: {l: 64, r: 16, t: 36, b: 60},
      height: 310,
      uirevision: "keep",
      hovermode: "closest",
      showlegend: true,
      legend: {orientation: "h", y: -0.3, font: {size: 11}},
      xaxis: {title: {text: "step"}, zeroline: false},
      yaxis: {zeroline: false},
      paper_bgcolor: "#fff",
      plot_bgcolor: "#fff",
    };
    return Object.assign(base, extra || {});
  }

  /* A chart without data: its note, and no axes (plotly's default range, -1 to 6, is no data's). */
  function empty(lay, text) {
    lay.annotations = [{text: text, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
      font: {color: "#889", size: 13}}];
    lay.xaxis = Object.assign({}, lay.xaxis, {visible: false});
    lay.yaxis = Object.assign({}, lay.yaxis, {visible: false});
    return lay;
  }

  /* The steps a chart's traces span, [first, last] (a heatmap's cells reach half a column further). */
  function stepRange(traces) {
    var lo = Infinity, hi = -Infinity;
    traces.forEach(function (t) {
      var xs = Array.prototype.filter.call(t.x || [], finite);
      if (!xs.length) return;
      var first = xs.reduce(function (a, b) { return Math.min(a, b); });
      var last = xs.reduce(function (a, b) { return Math.max(a, b); });
      var pad = t.type !== "heatmap" ? 0 : xs.length > 1 ? (last - first) / (xs.length - 1) / 2 : 0.5;
      lo = Math.min(lo, first - pad);
      hi = Math.max(hi, last + pad);
    });
    return hi >= lo ? [lo, hi] : null;
  }

  /* Ticks of a step axis showing `range`: whole steps. Below 10 steps in view plotly's own choice falls
   * between steps (a heatmap of one stats step: 99.6, 99.8, ...), so the ticks are then every step. */
  function stepTicks(range) {
    if (range && range[1] - range[0] < 10) return {tickmode: "linear", tick0: 0, dtick: 1};
    return {tickmode: "auto", tick0: null, dtick: null};
  }

  function draw(id, traces, lay, emptyText) {
    var div = document.getElementById(id);
    if (!traces.length) lay = empty(lay, emptyText || "no data yet");
    if (div.classList.contains("step-chart")) {
      lay.xaxis = Object.assign({}, lay.xaxis, stepTicks(stepZoom || stepRange(traces)));
    }
    return Plotly.react(div, traces, lay, PLOT_CONFIG).then(function () { linkAxes(div); });
  }

  /* Zooming the steps of one chart zooms every chart over steps, and sets each one's step ticks. */
  function linkAxes(div) {
    if (div.tenxLinked || !div.classList.contains("step-chart")) return;
    div.tenxLinked = true;
    div.on("plotly_relayout", function (ev) {
      if (syncing) return;
      var range = null;
      if (ev["xaxis.range[0]"] !== undefined) range = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
      else if (ev["xaxis.range"]) range = ev["xaxis.range"];
      else if (!ev["xaxis.autorange"]) return;
      stepZoom = range;
      syncing = true;
      var charts = Array.prototype.filter.call(document.querySelectorAll(".step-chart"), function (d) {
        return d.data;
      });
      Promise.all(charts.map(function (d) {
        var update = {};
        if (d !== div) update = range ? {"xaxis.range": range} : {"xaxis.autorange": true};
        var ticks = stepTicks(range || stepRange(d.data));
        Object.keys(ticks).forEach(function (key) { update["xaxis." + key] = ticks[key]; });
        return Plotly.relayout(d, update);
      })).then(function () { syncing = false; }, function () { syncing = false; });
    });
  }

  /* Colour bar ticks for colours that are log10 of the values, labelled with the values themselves: the
   * powers of ten in range, or where fewer than two are, 1, 2 and 5 times them, or every digit times
   * them; the ends and the middle when even those give fewer than two (a narrow range). */
  function logColorbar(logs) {
    var lo = logs.reduce(function (a, b) { return Math.min(a, b); });  /* no apply: a million values */
    var hi = logs.reduce(function (a, b) { return Math.max(a, b); });
    var vals = [];
    [[1], [1, 2, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]].forEach(function (multiples) {
      if (vals.length >= 2) return;
      vals = [];
      for (var e = Math.floor(lo); e <= Math.ceil(hi); e++) {
        multiples.forEach(function (m) {
          var v = e + Math.log10(m);
          if (v >= lo - 1e-9 && v <= hi + 1e-9) vals.push(v);
        });
      }
    });
    if (vals.length < 2) vals = hi > lo ? [lo, (lo + hi) / 2, hi] : [lo];
    return {tickvals: vals, ticktext: vals.map(function (v) {
      return Math.pow(10, v).toLocaleString("en-US", {maximumSignificantDigits: 3});
    })};
  }

  function describe(event) {
    var when = event.time ? new Date(event.time * 1000).toLocaleString() : "";
    var lines = ["<b>" + esc(event.kind) + "</b> at step " + event.step +
      (event.estimated ? " (placed by its time)" : "") + (when ? "  " + esc(when) : "")];
    Object.keys(event.fields).slice(0, 14).forEach(function (key) {
      var value = event.fields[key];
      var text = typeof value === "string" ? value : JSON.stringify(value);
      if (text.length > 90) text = text.slice(0, 87) + "...";
      lines.push(esc(key) + ": " + esc(text));
    });
    return lines.join("<br>");
  }

  function lossChart(runs) {
    var traces = [];
    var shapes = [];
    runs.forEach(function (run, i) {
      var c = color(i);
      var p = run.prediction;
      if (p) {
        var level = p.level ? Math.round(100 * p.level) + "% " : "";
        traces.push({x: p.step, y: p.upper, mode: "lines", line: {width: 0, color: c}, hoverinfo: "skip",
          showlegend: false, legendgroup: "band" + i, name: esc(run.name) + " band upper", meta: "band-upper"});
        traces.push({x: p.step, y: p.lower, customdata: p.upper, mode: "lines", line: {width: 0, color: c},
          fill: "tonexty", fillcolor: rgba(c, 0.16), legendgroup: "band" + i, meta: "band",
          name: esc(run.name) + " " + level + "band",
          hovertemplate: "band %{y:.4f} .. %{customdata:.4f}<extra>" + esc(run.name) + "</extra>"});
        traces.push({x: p.step, y: p.loss, mode: "lines", line: {width: 1.5, dash: "dash", color: c},
          name: esc(run.name) + " predicted", meta: "predicted"});
      }
      if (run.series.loss) {
        traces.push({x: run.steps, y: run.series.loss, mode: "lines", line: {width: 1.2, color: c},
          name: esc(run.name) + " train", meta: "train-loss"});
      }
      if (run.val.step.length) {
        traces.push({x: run.val.step, y: run.val.loss, mode: "lines+markers", line: {dash: "dot", color: c},
          marker: {size: 7, symbol: "diamond", color: c}, name: esc(run.name) + " validation",
          meta: "val-loss"});
      }
      run.events.forEach(function (e) {
        if (MARKED_KINDS[e.kind] && shapes.length < 300) {
          shapes.push({type: "line", xref: "x", yref: "paper", x0: e.step, x1: e.step, y0: 0, y1: 1,
            line: {color: kindColor(e.kind), width: 1, dash: "dot"}});
        }
      });
    });
    var lay = layout("loss (nats/token); dotted lines: faults, rollbacks, off-prediction",
      {height: 420, shapes: shapes, yaxis: {title: {text: "loss"}, zeroline: false}});
    var clipped = lossRange(runs);
    if (clipped) {
      lay.yaxis.range = clipped.range;
      lay.annotations = [{text: esc(clipped.note), showarrow: false, xref: "paper", yref: "paper", x: 1,
        y: 1, xanchor: "right", yanchor: "bottom", font: {size: 11, color: "#9a6a00"}}];
    }
    return draw("chart-loss", traces, lay);
  }

  function eventsChart(runs) {
    var kinds = {};
    var traces = runs.map(function (run, i) {
      run.events.forEach(function (e) { kinds[e.kind] = true; });
      return {x: run.events.map(function (e) { return e.step; }),
        y: run.events.map(function (e) { return e.kind; }),
        text: run.events.map(describe), mode: "markers", type: "scatter", meta: "events",
        marker: {size: 11, symbol: SYMBOLS[i % SYMBOLS.length], line: {width: 1, color: "#333"},
          color: run.events.map(function (e) { return kindColor(e.kind); })},
        name: esc(run.name), hovertemplate: "%{text}<extra>" + esc(run.name) + "</extra>"};
    }).filter(function (t) { return t.x.length; });
    var n = Object.keys(kinds).length;
    return draw("chart-events", traces, layout("events (hover for details)", {
      height: Math.max(180, 90 + 26 * n), margin: {l: 130, r: 16, t: 36, b: 44},
      yaxis: {type: "category", categoryorder: "category ascending", automargin: true},
    }), "no events");
  }

  function seriesChart(id, runs, key, title, opts) {
    opts = opts || {};
    var traces = [];
    runs.forEach(function (run, i) {
      var values = run.series[key];
      if (!values) return;
      if (opts.scale) values = values.map(function (v) { return v === null ? null : v * opts.scale; });
      traces.push({x: run.steps, y: values, mode: "lines", line: {width: 1.1, color: color(i)},
        name: esc(run.name), meta: key});
      (opts.extra ? opts.extra(run, i) : []).forEach(function (t) { traces.push(t); });
    });
    var lay = layout(title, {yaxis: {title: {text: opts.unit || ""}, type: opts.log ? "log" : "linear",
      tickformat: opts.log ? LOG_TICKFORMAT : ""}});
    if (opts.shapes) lay.shapes = opts.shapes;
    return draw(id, traces, lay);
  }

  function rankTraces(run, i) {
    var ranks = (run.lines.step_time_s) || {};
    return Object.keys(ranks).sort().map(function (rank, j) {
      return {x: ranks[rank].step, y: ranks[rank].value, mode: "lines",
        line: {width: 1, dash: j ? "dot" : "dashdot", color: color(i)},
        name: esc(run.name) + " " + esc(rank), meta: "rank-step-time"};
    });
  }

  function goodputChart(runs) {
    function label(r) { return esc(r.name) + "<br>goodput " + (100 * r.goodput.goodput).toFixed(1) + "%"; }
    var withLedger = runs.filter(function (r) { return r.goodput; });
    var traces = GOODPUT.map(function (g) {
      return {type: "bar", orientation: "h", name: g[1], marker: {color: g[2]}, meta: "goodput",
        y: withLedger.map(label),
        x: withLedger.map(function (r) { return Math.max(0, r.goodput[g[0]]); }),
        hovertemplate: g[1] + ": %{x:.1f} s<extra>%{y}</extra>"};
    });
    if (!withLedger.length) traces = [];
    return draw("chart-goodput", traces, layout("goodput: where the wall time went (seconds)", {
      barmode: "stack", margin: {l: 120, r: 16, t: 36, b: 44},
      xaxis: {zeroline: false}, yaxis: {automargin: true}, legend: {orientation: "h", y: -0.12},
    }), "no goodput ledger yet");
  }

  function heatmaps(runs) {
    var select = document.getElementById("heatmap-run");
    document.getElementById("heatmap-run-label").hidden = runs.length < 2;
    if (select.options.length !== runs.length) {
      select.textContent = "";
      runs.forEach(function (run, i) {
        var option = document.createElement("option");
        option.value = String(i);
        option.textContent = run.name;
        select.appendChild(option);
      });
      select.value = String(heatmapRun);
    }
    var run = runs[Math.min(heatmapRun, runs.length - 1)];
    var families = run ? Object.keys(run.heatmaps).sort() : [];
    var holder = document.getElementById("heatmaps");
    var wanted = {};
    var pending = families.map(function (name) {
      var id = "heatmap-" + name.replace(/[^\w-]/g, "_");
      wanted[id] = true;
      var div = document.getElementById(id);
      if (!div) {
        div = document.createElement("div");
        div.id = id;
        div.className = "chart step-chart heatmap";
        holder.appendChild(div);
      }
      var h = run.heatmaps[name];
      var finite = [].concat.apply([], h.z).filter(function (v) { return v !== null; });
      var log = finite.length > 0 && finite.every(function (v) { return v > 0; });
      var z = log ? h.z.map(function (row) {
        return row.map(function (v) { return v === null ? null : Math.log10(v); });
      }) : h.z;
      var colorbar = Object.assign({title: {text: log ? "log scale" : ""}, thickness: 12},
        log ? logColorbar(finite.map(Math.log10)) : {});
      var trace = {type: "heatmap", x: h.step, y: h.layers, z: z, customdata: h.z, colorscale: "Viridis",
        meta: "heatmap", name: name, colorbar: colorbar,
        hovertemplate: "step %{x}<br>layer %{y}<br>" + esc(name) + " %{customdata:.4g}<extra></extra>"};
      return draw(id, [trace], layout(esc(name) + " per layer: " + esc(run.name), {
        showlegend: false, yaxis: {type: "category", title: {text: "layer"}},
      }));
    });
    Array.prototype.slice.call(holder.children).forEach(function (div) {
      if (!wanted[div.id]) { Plotly.purge(div); holder.removeChild(div); }
    });
    return Promise.all(pending);
  }

  function statLines(runs) {
    var groups = {};
    runs.forEach(function (run) {
      Object.keys(run.lines).forEach(function (g) { if (g !== "step_time_s") groups[g] = true; });
    });
    var holder = document.getElementById("stat-lines");
    var names = Object.keys(groups).sort();
    var wanted = {};
    var pending = names.map(function (group) {
      var id = "stat-" + group.replace(/[^\w-]/g, "_");
      wanted[id] = true;
      if (!document.getElementById(id)) {
        var div = document.createElement("div");
        div.id = id;
        div.className = "chart step-chart";
        holder.appendChild(div);
      }
      var traces = [];
      runs.forEach(function (run, i) {
        var members = run.lines[group] || {};
        Object.keys(members).sort().forEach(function (m, j) {
          traces.push({x: members[m].step, y: members[m].value, mode: "lines",
            line: {width: 1.1, color: color(i), dash: ["solid", "dot", "dash", "dashdot"][j % 4]},
            name: esc(run.name) + (m === group ? "" : " " + esc(m)), meta: "stat-line"});
        });
      });
      return draw(id, traces, layout(esc(STAT_TITLES[group] || group)));
    });
    Array.prototype.slice.call(holder.children).forEach(function (div) {
      if (!wanted[div.id]) { Plotly.purge(div); holder.removeChild(div); }
    });
    var anyHeatmap = runs.some(function (r) { return Object.keys(r.heatmaps).length; });
    document.getElementById("no-stats").hidden = anyHeatmap || names.length > 0;
    return Promise.all(pending);
  }

  function stateOf(run) {
    if (!run.exists) return "waiting";
    if (run.finished) return "finished";
    if (!run.records) return "starting";
    if (config.mode === "live" && run.updated && Date.now() / 1000 - run.updated > 120) return "idle";
    return "training";
  }

  function cell(row, text, cls) {
    var td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    row.appendChild(td);
    return td;
  }

  function table(runs) {
    var body = document.querySelector("#runs tbody");
    body.textContent = "";
    runs.forEach(function (run, i) {
      var row = document.createElement("tr");
      var name = cell(row, "", "name");
      var swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = color(i);
      name.appendChild(swatch);
      name.appendChild(document.createTextNode(run.name));
      name.title = run.path;
      var state = stateOf(run);
      cell(row, state, "state-" + state);
      var last = run.last;
      cell(row, (last.step === undefined ? "-" : last.step) + (run.total_steps ? " / " + run.total_steps : ""));
      cell(row, fmt(last.loss, 4));
      cell(row, fmt(last.val_loss, 4));
      cell(row, last.pred_dev === undefined || last.pred_dev === null ? "-" :
        (last.pred_dev >= 0 ? "+" : "") + last.pred_dev.toFixed(1) + " band");
      cell(row, last.tokens_per_s ? Math.round(last.tokens_per_s).toLocaleString() : "-");
      cell(row, last.mfu === undefined || last.mfu === null ? "-" : percent(last.mfu));
      cell(row, run.goodput ? (100 * run.goodput.goodput).toFixed(1) + "%" : "-");
      cell(row, String(run.events.length));
      var files = cell(row, "", "files");
      if (config.mode === "live") {
        run.files.forEach(function (f) {
          var a = document.createElement("a");
          a.href = "run/" + i + "/" + f.split("/").map(encodeURIComponent).join("/");
          a.textContent = f;
          a.rel = "noreferrer";
          files.appendChild(a);
        });
      }
      body.appendChild(row);
    });
  }

  function showErrors(messages) {
    var box = document.getElementById("errors");
    box.hidden = !messages.length;
    box.textContent = messages.join("\n");
  }

  function render(runs) {
    latest = runs;
    table(runs);
    var errors = [];
    runs.forEach(function (run) {
      run.errors.forEach(function (e) { errors.push(run.name + ": " + e); });
    });
    showErrors(errors);
    var anyDev = runs.some(function (r) { return r.series.pred_dev; });
    var devDiv = document.getElementById("chart-pred-dev");
    devDiv.hidden = !anyDev;
    var band = [{type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: -1, y1: 1, line: {width: 0},
      fillcolor: "rgba(31,119,180,0.10)"}];
    return Promise.all([
      lossChart(runs),
      eventsChart(runs),
      seriesChart("chart-lr", runs, "lr", "learning rate"),
      seriesChart("chart-grad-norm", runs, "grad_norm", "gradient norm (before clipping)", {log: true}),
      seriesChart("chart-throughput", runs, "tokens_per_s", "throughput", {unit: "tokens/s"}),
      seriesChart("chart-mfu", runs, "mfu", "model FLOPs utilization", {unit: "%", scale: 100}),
      seriesChart("chart-step-time", runs, "step_time_s", "step time (dashed: per rank)",
        {unit: "s", extra: rankTraces}),
      anyDev ? seriesChart("chart-pred-dev", runs, "pred_dev", "deviation from the prediction (shaded: inside the band)",
        {unit: "band half-widths", shapes: band}) : Promise.resolve(),
      goodputChart(runs),
      heatmaps(runs),
      statLines(runs),
    ]).then(function () { document.body.setAttribute("data-rendered", String(Date.now())); });
  }

  document.getElementById("heatmap-run").addEventListener("change", function (ev) {
    heatmapRun = parseInt(ev.target.value, 10) || 0;
    heatmaps(latest);
  });

  function poll() {
    var requests = [];
    for (var i = 0; i < config.count; i++) {
      requests.push(fetch("api/run/" + i, {cache: "no-store"}).then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      }));
    }
    Promise.all(requests).then(function (runs) {
      document.getElementById("status-line").textContent = runs.length + " run(s), updated " +
        new Date().toLocaleTimeString() + ", refreshing every " + config.refresh_s + " s";
      return render(runs).then(function () {
        var done = runs.every(function (r) { return r.finished; });
        setTimeout(poll, 1000 * (done ? Math.max(30, config.refresh_s) : config.refresh_s));
      });
    }).catch(function (err) {
      showErrors(["the page could not update (" + err.message + "); trying again"]);
      setTimeout(poll, 1000 * Math.max(5, config.refresh_s));
    });
  }

  if (config.mode === "live") {
    poll();
  } else {
    document.getElementById("status-line").textContent = "report of " + config.runs.length +
      " run(s), written " + config.generated;
    render(config.runs);
  }
})();

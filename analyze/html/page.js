// Glue of the layerdiv HTML report: draws the Plotly figures embedded as JSON, makes tables
// sortable, and runs the per-instance explorer. Every number comes from the embedded data.
"use strict";
(function () {
  const CONFIG = JSON.parse(document.getElementById("plotly-config").textContent);
  const FIGURES = JSON.parse(document.getElementById("figures-data").textContent);

  function drawFigures() {
    document.querySelectorAll("div.plotly-figure[data-figure]").forEach((div) => {
      const spec = FIGURES[div.dataset.figure];
      Plotly.newPlot(div, spec.data, spec.layout, CONFIG);
    });
  }

  function cellValue(row, i) {
    const text = row.cells[i] ? row.cells[i].textContent.trim() : "";
    const number = parseFloat(text.replace("−", "-"));
    return isNaN(number) ? text : number;
  }

  function sortableTables() {
    document.querySelectorAll("main table").forEach((table) => {
      const body = table.tBodies[0];
      if (!body) return;
      table.querySelectorAll("th").forEach((th, i) => {
        th.title = "sort by this column";
        th.addEventListener("click", () => {
          const asc = !th.classList.contains("sorted-asc");
          table.querySelectorAll("th").forEach((h) => h.classList.remove("sorted-asc", "sorted-desc"));
          th.classList.add(asc ? "sorted-asc" : "sorted-desc");
          const rows = Array.from(body.rows);
          rows.sort((a, b) => {
            const x = cellValue(a, i), y = cellValue(b, i);
            const order = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === "number" ? -1 : 1);
            return asc ? order : -order;
          });
          rows.forEach((r) => body.appendChild(r));
        });
      });
    });
  }

  // --- explorer -------------------------------------------------------------------------------
  const node = document.getElementById("explorer-data");
  const DATA = node ? JSON.parse(node.textContent) : null;

  function floats(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    return new Float32Array(bytes.buffer);
  }

  function partition(i) {
    const p = DATA.partitions[i];
    if (!p._decoded) {
      p._logits = floats(p.logits);
      p._model = floats(p.model_logits);
      if (p.heads) p.heads._values = floats(p.heads.logits);
      if (p.skips) p.skips._values = floats(p.skips.logits);
      p._decoded = true;
    }
    return p;
  }

  const $ = (id) => document.getElementById(id);

  function isLate(p, r) { return p.settle[r] > DATA.late * p.components.length; }

  function matches(p, r, filter) {
    const correct = p.pred[r] === p.gold[r];
    return filter === "all" || (filter === "correct" && correct) ||
      (filter === "wrong" && !correct) || (filter === "late" && isLate(p, r));
  }

  function fillInstances() {
    const p = partition(+$("ex-part").value), filter = $("ex-filter").value;
    const select = $("ex-instance");
    select.innerHTML = "";
    p.instances.forEach((id, r) => {
      if (!matches(p, r, filter)) return;
      const o = document.createElement("option");
      o.value = r;
      o.textContent = `#${id} (${p.pred[r] === p.gold[r] ? "correct" : "wrong"}${isLate(p, r) ? ", late" : ""})`;
      select.appendChild(o);
    });
    $("ex-count").textContent = `${select.options.length} of ${p.instances.length} embedded ` +
      `(of ${p.n_total} in the store)`;
    const opt = $("ex-option");
    opt.innerHTML = "";
    [["pred", "predicted"], ["gold", "gold"]].concat(p.options.map((o, k) => [String(k), o]))
      .forEach(([v, t]) => { const o = document.createElement("option"); o.value = v; o.textContent = t; opt.appendChild(o); });
    drawInstance();
  }

  function centred(values, k) {  // values[0..k) minus their mean
    let mean = 0;
    for (let i = 0; i < k; i++) mean += values[i] / k;
    return Array.from(values, (v) => v - mean);
  }

  function drawInstance() {
    const p = partition(+$("ex-part").value);
    const select = $("ex-instance");
    if (!select.options.length) {
      $("ex-summary").textContent = "No embedded instance matches this filter.";
      ["ex-waterfall", "ex-running", "ex-heads", "ex-skips"].forEach((id) => Plotly.purge($(id)));
      $("ex-prompt").textContent = "";
      return;
    }
    const r = +select.value, K = p.options.length, C = p.components.length;
    const id = p.instances[r], gold = p.gold[r], pred = p.pred[r];
    const choice = $("ex-option").value;
    const k = choice === "pred" ? pred : choice === "gold" ? gold : +choice;
    const u = [];  // u[c] = centred option logits of component c
    for (let c = 0; c < C; c++) u.push(centred(p._logits.subarray((r * C + c) * K, (r * C + c + 1) * K), K));
    const where = `${p.model_id} · ${p.task} · instance ${id}`;
    const correct = pred === gold;
    $("ex-summary").innerHTML = "";
    const tag = document.createElement("span");
    tag.className = "tag " + (correct ? "correct" : "wrong");
    tag.textContent = correct ? "correct" : "wrong";
    $("ex-summary").append(tag, ` ${where}: gold ${p.options[gold]}, predicted ${p.options[pred]}; ` +
      `the running prediction settles at junction ${p.settle[r]} of ${C} ` +
      `(${p.components[p.settle[r] - 1]}).`);
    $("ex-prompt").textContent = p.prompts ? p.prompts[r] :
      `prompt not stored (extracted with schema v${p.schema_version}; re-extract with --overwrite to store it)`;
    // Waterfall of option k: each component's logit relative to the options' mean.
    Plotly.react($("ex-waterfall"), [{
      type: "waterfall", x: p.components.concat(["total"]),
      y: u.map((v) => v[k]).concat([null]),
      measure: p.components.map(() => "relative").concat(["total"]),
      customdata: p.components.map((name, c) => p._logits[(r * C + c) * K + k]).concat([null]),
      hovertemplate: `${where}<br>%{x}: %{y:.3f} logits (option ${p.options[k]} relative to the options' mean)` +
        "<br>raw u = %{customdata:.3f} logits<extra></extra>",
      increasing: { marker: { color: "#2ca02c" } }, decreasing: { marker: { color: "#d62728" } },
      totals: { marker: { color: "#1f4e8c" } }, connector: { line: { width: 0.5 } },
    }], {
      title: { text: `Components' logit for option ${p.options[k]} (relative to the mean of the ${K} options)` },
      yaxis: { title: { text: "logits" } }, xaxis: { tickangle: -60 }, height: 420, margin: { b: 110 },
    }, CONFIG);
    // Running option logits over junctions and the junctions where the prediction flips.
    const running = [], sums = new Array(K).fill(0), preds = [];
    for (let c = 0; c < C; c++) {
      for (let o = 0; o < K; o++) sums[o] += u[c][o];
      running.push(sums.slice());
      preds.push(sums.indexOf(Math.max(...sums)));
    }
    const junctions = p.components.map((_, c) => c + 1);
    const traces = p.options.map((name, o) => ({
      type: "scatter", mode: "lines", name: `${name}${o === gold ? " (gold)" : ""}`,
      x: junctions, y: running.map((s) => s[o]), customdata: p.components,
      line: { width: o === gold ? 3 : 1.5 },
      hovertemplate: `${where}<br>j = %{x} (after %{customdata})<br>${name}: %{y:.3f} logits<extra></extra>`,
    }));
    const flips = junctions.filter((j) => j > 1 && preds[j - 1] !== preds[j - 2]);
    traces.push({
      type: "scatter", mode: "markers", name: "prediction flips", x: flips,
      y: flips.map((j) => running[j - 1][preds[j - 1]]), marker: { symbol: "x", size: 9, color: "black" },
      customdata: flips.map((j) => `${p.options[preds[j - 2]]} → ${p.options[preds[j - 1]]} at ${p.components[j - 1]}`),
      hovertemplate: "flip: %{customdata}<extra></extra>",
    });
    Plotly.react($("ex-running"), traces, {
      title: { text: "Running option logits over junctions (relative to the options' mean; final scale frozen)" },
      xaxis: { title: { text: "junction j (components in the prefix)" } },
      yaxis: { title: { text: "logits" } }, height: 380,
      shapes: [{ type: "line", x0: p.settle[r], x1: p.settle[r], yref: "paper", y0: 0, y1: 1, line: { dash: "dot", color: "#888" } }],
    }, CONFIG);
    drawHeads(p, r, k, where);
    drawSkips(p, r, where);
  }

  // A figure without data is one line of text in its place, not a blank area.
  function absent(div, line) { Plotly.purge(div); div.classList.add("absent"); div.textContent = line; }
  function present(div) {
    if (div.classList.contains("absent")) { div.classList.remove("absent"); div.textContent = ""; }
  }

  function drawHeads(p, r, k, where) {
    const div = $("ex-heads");
    if (!p.heads) { absent(div, "Heads: not extracted for this partition (extract --heads)."); return; }
    present(div);
    const A = p.heads.components.length, G = p.heads.head_ids.length, K = p.options.length;
    const z = [];
    for (let a = 0; a < A; a++) {
      const row = [];
      for (let g = 0; g < G; g++) {
        const base = ((r * A + a) * G + g) * K;
        row.push(centred(p.heads._values.subarray(base, base + K), K)[k]);
      }
      z.push(row);
    }
    Plotly.react(div, [{
      type: "heatmap", z: z, x: p.heads.head_ids.map((h) => (h < 0 ? "bias" : String(h))),
      y: p.heads.components.map((c) => p.components[c]), colorscale: "RdBu", reversescale: true, zmid: 0,
      colorbar: { title: { text: "logits" } },
      hovertemplate: `${where}<br>%{y} head %{x}: %{z:.3f} logits for ${p.options[k]} (relative to the options' mean)<extra></extra>`,
    }], {
      title: { text: `Heads' logit for option ${p.options[k]} (relative to the options' mean)` },
      xaxis: { title: { text: "head" } }, yaxis: { autorange: "reversed" }, height: 120 + 14 * A,
    }, CONFIG);
  }

  function drawSkips(p, r, where) {
    const div = $("ex-skips");
    if (!p.skips) { absent(div, "Layer skips: not extracted for this partition (extract --skips)."); return; }
    present(div);
    const B = p.skips.n_blocks, K = p.options.length;
    const full = p._model.subarray(r * K, (r + 1) * K);
    const blocks = Array.from({ length: B }, (_, b) => b);
    Plotly.react(div, p.options.map((name, o) => ({
      type: "scatter", mode: "lines+markers", name: name, x: blocks,
      y: blocks.map((b) => p.skips._values[(r * B + b) * K + o] - full[o]),
      hovertemplate: `${where}<br>block %{x} skipped: ${name} changes by %{y:.3f} logits<extra></extra>`,
    })), {
      title: { text: "Skipping one block: change of each option's logit" }, height: 360,
      xaxis: { title: { text: "skipped block" } }, yaxis: { title: { text: "logits (skipped − full)" } },
    }, CONFIG);
  }

  function search() {
    const p = partition(+$("ex-part").value), want = +$("ex-search").value;
    const r = p.instances.indexOf(want);
    if (r < 0) { $("ex-count").textContent = `instance ${want} is not among the embedded ones`; return; }
    $("ex-filter").value = "all";
    fillInstances();
    $("ex-instance").value = r;
    drawInstance();
  }

  function explorer() {
    if (!DATA || !DATA.partitions.length) return;
    const part = $("ex-part");
    DATA.partitions.forEach((p, i) => {
      const o = document.createElement("option");
      o.value = i; o.textContent = `${p.model_id} · ${p.task}`; part.appendChild(o);
    });
    part.addEventListener("change", fillInstances);
    $("ex-filter").addEventListener("change", fillInstances);
    $("ex-instance").addEventListener("change", drawInstance);
    $("ex-option").addEventListener("change", drawInstance);
    $("ex-search").addEventListener("change", search);
    fillInstances();
  }

  drawFigures();
  sortableTables();
  explorer();
  document.body.dataset.ready = "true";
})();

/* posttrain run report: draw the embedded figures, open stage panels, move the rollout:update slider. */
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };

  function draw(div) {
    if (!div || div.dataset.rendered) return Promise.resolve();
    const fig = DATA.figures[div.dataset.fig];
    if (!fig) return Promise.resolve();
    div.dataset.rendered = "pending";
    return Plotly.newPlot(div, fig.data, fig.layout, CONFIG).then(function () { div.dataset.rendered = "1"; });
  }

  function visible(el) { return !el.closest("[hidden]"); }

  /* ---- 1. the pipeline: click a stage, see its panel ---- */
  function openPanel(id) {
    document.querySelectorAll(".panel").forEach(function (p) { p.hidden = p.id !== id; });
    document.querySelectorAll(".node").forEach(function (n) { n.classList.toggle("active", n.dataset.panel === id); });
    const panel = document.getElementById(id);
    if (!panel) return;
    panel.querySelectorAll(".chart[data-fig]").forEach(function (div) {
      if (div.dataset.rendered === "1") Plotly.Plots.resize(div); else draw(div);
    });
  }
  document.querySelectorAll(".node").forEach(function (n) {
    n.addEventListener("click", function () { openPanel(n.dataset.panel); });
  });

  /* ---- 2. the rollout:update projection: the formula of posttrain.telemetry.gap ----
     k = r · U0 / R0 scales the rollout phases; other phases keep their seconds;
     U(r) = Σ t'_p u_p / Σ t'_p and busy(r) likewise, each over the phases where the rate is known. */
  function weighted(pairs) {
    let total = 0, acc = 0, any = false;
    for (const [t, v] of pairs) { if (v === null || v === undefined) continue; any = true; total += t; acc += t * v; }
    return any && total > 0 ? acc / total : null;
  }
  function project(P, r) {
    const rollout = new Set(P.rollout), update = new Set(P.update);
    let R0 = 0, U0 = 0;
    for (const p of P.phases) { if (rollout.has(p.name)) R0 += p.seconds; if (update.has(p.name)) U0 += p.seconds; }
    if (!(R0 > 0 && U0 > 0)) return null;
    const k = r * U0 / R0;
    const scaled = P.phases.map(function (p) { return [p.seconds * (rollout.has(p.name) ? k : 1.0), p]; });
    return {
      seconds: scaled.map(function (s) { return s[0]; }),
      utilization: P.peak_known ? weighted(scaled.map(function (s) { return [s[0], s[1].u]; })) : null,
      busy: weighted(scaled.map(function (s) { return [s[0], s[1].busy]; })),
    };
  }
  window.posttrainProject = project;  // exposed for the browser test and for the curious

  function pct(v, digits) { return v === null ? "—" : (100 * v).toFixed(digits) + "%"; }

  function setRatio(j, r) {
    const P = DATA.projections[j];
    const res = project(P, r);
    document.getElementById("ratio-out-" + j).textContent = r + ":1";
    const u = document.getElementById("proj-u-" + j), b = document.getElementById("proj-busy-" + j);
    u.dataset.value = res && res.utilization !== null ? String(res.utilization) : "";
    b.dataset.value = res && res.busy !== null ? String(res.busy) : "";
    u.textContent = res ? (P.peak_known ? pct(res.utilization, 2) : "peak unknown") : "—";
    b.textContent = res ? pct(res.busy, 0) : "—";
    const bar = document.getElementById("proj-bar-" + j);
    if (res) {
      const total = res.seconds.reduce(function (a, b) { return a + b; }, 0);
      bar.innerHTML = "";
      P.phases.forEach(function (p, i) {
        const s = document.createElement("span");
        s.style.width = (100 * res.seconds[i] / total).toFixed(3) + "%";
        s.style.background = (DATA.colors || {})[p.name] || colorOf(p.name);
        s.title = p.name + " " + (100 * res.seconds[i] / total).toFixed(0) + "% of the cycle";
        bar.appendChild(s);
      });
    }
    const div = document.getElementById("projection-" + j);
    if (div && div.dataset.rendered === "1" && res) {
      const y = P.peak_known ? res.utilization : res.busy;
      Plotly.restyle(div, { x: [[r]], y: [[y === null ? null : 100 * y]] }, [div.data.length - 1]);
    }
  }
  const FALLBACK = { generate: "#e8590c", score: "#ae3ec9", reference: "#0c8599", update: "#1c7ed6", sync: "#5c940d", eval: "#868e96" };
  function colorOf(name) { return FALLBACK[name] || "#495057"; }

  /* ---- draw what is visible, then wire the sliders ---- */
  const first = Array.from(document.querySelectorAll(".chart[data-fig]")).filter(visible).map(draw);
  Promise.all(first).then(function () {
    document.querySelectorAll("input.ratio").forEach(function (input) {
      const j = Number(input.dataset.rl);
      input.addEventListener("input", function () { setRatio(j, Number(input.value)); });
      setRatio(j, Number(input.value));
    });
    const nodes = document.querySelectorAll(".node");
    if (nodes.length) openPanel(nodes[nodes.length - 1].dataset.panel);  // the last stage, open by default
    document.body.dataset.ready = "1";
  });
})();

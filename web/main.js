// The page's script: the engine (web/pkg, built by web/build) does the work, this draws it.
// Query parameters: ?steps=N trains N steps before the first heat map (default 400), then keeps
// training in the background unless ?background=0; ?repeats=N timing runs per kernel (default 5).
import init, { Demo } from "./pkg/wgpu_attention_web.js";

const params = new URLSearchParams(location.search);
const firstSteps = Number(params.get("steps") ?? 400);
const repeats = Number(params.get("repeats") ?? 5);
const background = params.get("background") !== "0";
const $ = (id) => document.getElementById(id);

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function table(head, rows) {
  const cells = (r, tag) => r.map((c) => `<${tag}>${c}</${tag}>`).join("");
  return `<table><tr>${cells(head, "th")}</tr>${rows.map((r) => `<tr>${cells(r, "td")}</tr>`).join("")}</table>`;
}

function showAdapter(demo) {
  const a = JSON.parse(demo.adapter());
  const rows = [
    ["adapter", a.name || "(unnamed)"],
    ["back end / type", `${a.backend} / ${a.device_type}`],
    ["driver", a.driver],
    ["kernel family", a.kernel_family],
    ["shader-f16 / subgroups / timestamp-query", [a.shader_f16, a.subgroups, a.timestamp_query].join(" / ")],
    ...a.limits.map(([k, v]) => [k, v.toLocaleString("en")]),
  ];
  $("adapter").innerHTML = table(["", ""], rows);
}

async function runAttention(demo) {
  const [len, dim, mask] = [Number($("len").value), Number($("dim").value), $("mask").value];
  $("attention").textContent = `running B1 L${len} H4 D${dim} ${mask} ...`;
  const r = JSON.parse(await demo.run_attention(len, dim, mask, repeats));
  const checks = r.checks.map((c) => [
    c.name,
    c.worst_abs.toExponential(2),
    `${(100 * c.worst_ratio).toFixed(1)}%`,
    c.passed ? '<span class="pass">pass</span>' : '<span class="fail">FAIL</span>',
  ]);
  const ms = (x) => x.toFixed(2);
  const timings = [
    ["forward", ms(r.fused_forward_ms), ms(r.unfused_forward_ms), (r.unfused_forward_ms / r.fused_forward_ms).toFixed(2)],
    ["backward", ms(r.fused_backward_ms), ms(r.unfused_backward_ms), (r.unfused_backward_ms / r.fused_backward_ms).toFixed(2)],
  ];
  $("attention").innerHTML =
    `<p>${r.shape}</p>` +
    table(["vs the f64 reference", "worst |err|", "of tolerance", ""], checks) +
    table([`median of ${r.repeats} (ms)`, "fused", "unfused", "unfused / fused"], timings);
  return r.checks.every((c) => c.passed);
}

// The loss curve, log scale.
const losses = [];
function drawLoss() {
  const c = $("loss"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.strokeStyle = "#999";
  g.strokeRect(40, 10, c.width - 50, c.height - 40);
  g.fillStyle = "#222";
  g.font = "12px system-ui";
  g.fillText("loss (log scale) over training steps", 44, 24);
  if (losses.length < 2) return;
  const logs = losses.map(([, l]) => Math.log10(Math.max(l, 1e-4)));
  const [lo, hi] = [Math.min(...logs), Math.max(...logs)];
  const last = losses[losses.length - 1][0];
  const x = (s) => 40 + ((c.width - 50) * s) / last;
  const y = (l) => 10 + (c.height - 40) * (hi - l) / Math.max(hi - lo, 1e-6);
  g.strokeStyle = "#08306b";
  g.beginPath();
  losses.forEach(([s], i) => (i ? g.lineTo(x(s), y(logs[i])) : g.moveTo(x(s), y(logs[i]))));
  g.stroke();
  g.fillText(`${losses[0][1].toFixed(3)}`, 2, y(logs[0]) + 4);
  g.fillText(`${losses[losses.length - 1][1].toFixed(3)} at step ${last}`, c.width - 170, c.height - 14);
}

// One heat map per head: rows the decoder's input tokens, columns the source digits.
function drawMaps(map) {
  const cell = 30, label = 34;
  $("maps").innerHTML = "";
  map.heads.forEach((values, h) => {
    const c = document.createElement("canvas");
    c.width = label + cell * map.cols.length + 4;
    c.height = label + cell * map.rows.length + 4;
    const g = c.getContext("2d");
    g.font = "13px monospace";
    g.textAlign = "center";
    g.textBaseline = "middle";
    g.fillStyle = "#222";
    map.cols.forEach((t, j) => g.fillText(t, label + cell * j + cell / 2, label / 2));
    map.rows.forEach((t, i) => g.fillText(t, label / 2, label + cell * i + cell / 2));
    values.forEach((row, i) =>
      row.forEach((p, j) => {
        const [r0, g0, b0] = [8, 48, 107].map((v) => Math.round(255 - p * (255 - v)));
        g.fillStyle = `rgb(${r0},${g0},${b0})`;
        g.fillRect(label + cell * j, label + cell * i, cell - 1, cell - 1);
        g.fillStyle = p > 0.5 ? "#fff" : "#222";
        g.font = "10px monospace";
        g.fillText(p.toFixed(2), label + cell * j + cell / 2, label + cell * i + cell / 2);
        g.font = "13px monospace";
      }),
    );
    const fig = document.createElement("figure");
    fig.appendChild(c);
    const cap = document.createElement("figcaption");
    cap.textContent = `head ${h} (after ${map.steps} steps)`;
    fig.appendChild(cap);
    $("maps").appendChild(fig);
  });
}

async function drawAttention(demo) {
  drawMaps(JSON.parse(await demo.cross_attention($("digits").value)));
}

async function trainChunk(demo, steps) {
  const loss = await demo.train(steps);
  losses.push([demo.steps(), loss]);
  drawLoss();
  $("train-state").textContent = `step ${demo.steps()}, loss ${loss.toFixed(4)}`;
}

async function main() {
  await init();
  setStatus("opening the adapter");
  const demo = await Demo.create();
  window.demo = demo; // for web/screenshot.py --bench
  showAdapter(demo);
  setStatus("running attention");
  const passed = await runAttention(demo);
  setStatus(`training ${firstSteps} steps`);
  while (demo.steps() < firstSteps) {
    await trainChunk(demo, Math.min(20, firstSteps - demo.steps()));
  }
  await drawAttention(demo);
  setStatus(passed ? "done: every check passed" : "done: a check FAILED", !passed);

  // Then the page keeps training in the background until paused, redrawing the maps now and then.
  let training = background;
  if (!training) $("train-toggle").textContent = "Resume training";
  $("train-toggle").onclick = () => {
    training = !training;
    $("train-toggle").textContent = training ? "Pause training" : "Resume training";
  };
  $("redraw").onclick = () => drawAttention(demo).catch(fail);
  $("attention-form").onsubmit = (e) => {
    e.preventDefault();
    runAttention(demo).catch(fail);
  };
  for (;;) {
    if (training && demo.steps() < 5000) {
      await trainChunk(demo, 20);
      if (demo.steps() % 200 === 0) await drawAttention(demo);
    } else {
      await new Promise((r) => setTimeout(r, 250));
    }
  }
}

function fail(e) {
  setStatus(`error: ${e.message ?? e}`, true);
  console.error(e);
}

main().catch(fail);

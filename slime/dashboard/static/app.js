// The dashboard page: live counters over Server-Sent Events, charts, the trajectory inspector.
// Everything shown from the API goes in as text (textContent, DOM nodes): never as HTML.
"use strict";
const TOKEN_KEY = "slime-dashboard-token";

// The token comes from the URL fragment (#token=..., which browsers never send to a server) or the
// token field; it is kept in sessionStorage (this tab only) and the fragment is cleared at once.
function readToken() {
  const fromFragment = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromFragment) {
    sessionStorage.setItem(TOKEN_KEY, fromFragment);
    window.history.replaceState(null, "", location.pathname + location.search);  // `history` is ours below
  }
  return sessionStorage.getItem(TOKEN_KEY);
}
const TOKEN = readToken();
let READ_ONLY = false;  // a finished run's copy (summary.read_only): no control buttons
const STATUSES = ["pending", "running", "aborted", "completed", "truncated", "failed"];
const history = { occupancy: [], throughput: [] };
const HISTORY_POINTS = 600;
let openTrajectory = null;

function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (TOKEN) headers["Authorization"] = `Bearer ${TOKEN}`;
  return fetch(path, Object.assign({}, options, { headers })).then(async r => {
    if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.json().catch(() => ({}))).detail || ""}`);
    return r.json();
  });
}
const $ = id => document.getElementById(id);
const text = (id, value) => { $(id).textContent = value; };
const versionColor = v => `hsl(${(v * 137.508) % 360}, 70%, 78%)`;

// el("td", {className: "x"}, "text", child, ...): strings become text nodes, never markup.
function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children.map(c => (c instanceof Node ? c : String(c))));
  return node;
}
const swatch = (color, label) => el("span", {}, el("i", { style: `background:${color}` }), label);

function buildCounters() {
  const box = $("counters");
  for (const s of STATUSES) {
    box.append(el("div", { className: "counter" }, el("b", { id: `count-${s}` }, "0"), s));
    $("filter-status").append(el("option", {}, s));
  }
  for (const g of ["open", "ready", "trained"]) {
    box.append(el("div", { className: "counter" }, el("b", { id: `groups-${g}` }, "0"), `groups ${g}`));
  }
  $("legend-occupancy").replaceChildren(...STATUSES.map((s, i) => swatch(Charts.PALETTE[i], s)));
}

function onSummary(s) {
  text("job", s.job);
  text("policy-version", s.policy_version);
  text("step", s.step === null ? "–" : `${s.step + 1}${s.total_steps ? "/" + s.total_steps : ""}`);
  text("tokens-per-s", Charts.fmt(s.tokens_per_s));
  text("generated-tokens", Math.round(s.generated_tokens));
  text("staleness-max", s.staleness_max);
  $("paused").hidden = !s.paused;
  if (s.read_only && !READ_ONLY) {
    READ_ONLY = true;
    $("read-only").hidden = false;
    $("controls").hidden = true;
    $("inspector-actions").hidden = true;
  }
  for (const st of STATUSES) text(`count-${st}`, s.samples_by_status[st]);
  for (const g of ["open", "ready", "trained"]) text(`groups-${g}`, s.groups[g]);
  if (s.oversample !== null && document.activeElement !== $("oversample")) $("oversample").value = s.oversample;
  history.occupancy.push([s.server_time, s.samples_by_status]);
  history.throughput.push([s.server_time, s.tokens_per_s]);
  for (const k in history) if (history[k].length > HISTORY_POINTS) history[k].shift();
  const t0 = history.occupancy[0][0];
  Charts.lines($("chart-occupancy"), STATUSES.map((st, i) => ({
    name: st, color: Charts.PALETTE[i], points: history.occupancy.map(([t, c]) => [t - t0, c[st]]) })),
    ["-" + Math.round(s.server_time - t0) + " s", "now"]);
  Charts.lines($("chart-throughput"), [{ name: "tok/s", points: history.throughput.map(([t, v]) => [t - t0, v]) }],
    ["-" + Math.round(s.server_time - t0) + " s", "now"]);
}

function addEvent(e) {
  const li = document.createElement("li");
  li.textContent = `${new Date(e.ts * 1000).toLocaleTimeString()} ${e.kind} ${JSON.stringify(e.detail)}`;
  $("events").prepend(li);
  while ($("events").children.length > 50) $("events").lastChild.remove();
}

function connect() {
  // The one place the token goes in a URL: an EventSource cannot send headers.
  const src = new EventSource("/api/stream" + (TOKEN ? `?token=${encodeURIComponent(TOKEN)}` : ""));
  src.addEventListener("open", () => { $("live").textContent = "live"; $("live").className = "badge on"; });
  src.addEventListener("error", () => { $("live").textContent = "reconnecting"; $("live").className = "badge off"; });
  src.addEventListener("summary", e => onSummary(JSON.parse(e.data)));
  src.addEventListener("step", () => refreshSteps());
  src.addEventListener("event", e => addEvent(JSON.parse(e.data)));
}

const steps = [];
async function refreshSteps() {  // only the steps this page has not seen yet
  const since = steps.length ? steps[steps.length - 1].step : -1;
  const fresh = await api(`/api/steps?limit=500&since_step=${since}`);
  const last = steps.length ? steps[steps.length - 1].step : -1;  // another refresh may have landed
  steps.push(...fresh.filter(s => s.step > last));
  if (steps.length > 500) steps.splice(0, steps.length - 500);
  Charts.lines($("chart-reward"), [{ name: "reward", points: steps.filter(s => s.reward_mean !== undefined)
    .map(s => [s.step, s.reward_mean]) }], steps.length ? [`step ${steps[0].step}`, `step ${steps[steps.length - 1].step}`] : null);
  // Fresh tokens: numerics only; resumed: after an APRIL resume; stale: sampled by an older policy.
  const kinds = ["fresh", "resumed", "stale"];
  Charts.lines($("chart-mismatch"), kinds.map(k => ({ name: k, points: steps
    .filter(s => typeof s[`mismatch_${k}_logp_abs_diff`] === "number").map(s => [s.step, s[`mismatch_${k}_logp_abs_diff`]]) })),
    steps.length ? [`step ${steps[0].step}`, `step ${steps[steps.length - 1].step}`] : null);
  $("legend-mismatch").replaceChildren(...kinds.map((k, i) => swatch(Charts.PALETTE[i], k)));
}

async function refreshDistributions() {
  const h = await api("/api/histograms?window=500&bins=20");
  Charts.histogram($("hist-length"), h.response_length, "#2980b9");
  Charts.histogram($("hist-staleness"), h.staleness, "#e67e22");
  Charts.histogram($("hist-span"), h.version_span, "#8e44ad");
  Charts.histogram($("hist-reward"), h.reward, "#27ae60");
  const engines = await api("/api/engines");
  Charts.bars($("chart-engines"), engines.map(e => ({ label: e.worker_id, value: e.busy_fraction })), "#16a085");
  const experts = await api("/api/experts");
  $("experts-note").textContent = experts.available ? "" : experts.reason;
  Charts.bars($("chart-experts"), experts.share.map((v, i) => ({ label: `e${i}`, value: v })), "#d35400");
}

async function refreshTable() {
  const status = $("filter-status").value;
  const page = await api("/api/trajectories?limit=50" + (status ? `&status=${encodeURIComponent(status)}` : ""));
  const rows = page.items.map(r => {
    const tr = el("tr", {},
      el("td", {}, r.id), el("td", { title: r.group_id }, r.group_id.slice(0, 8)), el("td", {}, r.status),
      el("td", {}, `${r.response_length}/${r.max_new_tokens}`),
      el("td", {}, r.min_version === null ? "–" : `${r.min_version}…${r.max_version}`),
      el("td", {}, r.reward === null ? "–" : r.reward.toFixed(3)), el("td", {}, `${r.age_s.toFixed(0)} s`));
    tr.dataset.id = r.id;
    return tr;
  });
  $("trajectory-table").tBodies[0].replaceChildren(...rows);
}

async function inspect(id) {
  const t = await api(`/api/trajectories/${encodeURIComponent(id)}`);
  openTrajectory = id;
  $("inspector").hidden = false;
  text("inspector-id", id);
  const r = t.row;
  $("inspector-meta").textContent = `${r.status}, ${r.response_length} tokens, versions ${r.min_version ?? "–"}…` +
    `${r.max_version ?? "–"} (policy now v${t.policy_version}), reward ${r.reward ?? "–"}` + (r.failure ? `, failure: ${r.failure}` : "");
  text("inspector-prompt", t.prompt_text);
  const versions = [...new Set(t.tokens.map(k => k.version))].sort((a, b) => a - b);
  $("version-legend").replaceChildren(...versions.map(v => swatch(versionColor(v), `v${v}`)),
    swatch("#d5d8dc", "loss-masked"));
  const box = $("inspector-tokens");
  box.replaceChildren(...t.tokens.map(k => {
    const span = document.createElement("span");
    span.className = "tok" + (k.loss_mask ? "" : " masked");
    span.dataset.version = k.version;
    span.style.background = versionColor(k.version);
    span.title = `token ${k.id}  logprob ${k.logprob.toFixed(3)}  version ${k.version}  mask ${k.loss_mask}`;
    span.textContent = k.text;
    return span;
  }));
  $("inspector-actions").hidden = !TOKEN || READ_ONLY;
  $("inspector").scrollIntoView();
}

function control(path, body) {
  return api(path, { method: "POST", body: body ? JSON.stringify(body) : undefined }).catch(e => alert(e.message));
}

function init() {
  buildCounters();
  $("controls").hidden = !TOKEN;
  $("btn-pause").onclick = () => control("/api/control/pause");
  $("btn-resume").onclick = () => control("/api/control/resume");
  $("btn-oversample").onclick = () => control("/api/control/oversample", { oversample: parseFloat($("oversample").value) });
  $("btn-requeue").onclick = () => control(`/api/trajectories/${encodeURIComponent(openTrajectory)}/requeue`);
  $("btn-drop").onclick = () => control(`/api/trajectories/${encodeURIComponent(openTrajectory)}/drop`,
    { reason: "dropped from the dashboard" });
  $("token-form").hidden = !!TOKEN;
  $("btn-forget-token").hidden = !TOKEN;
  $("token-form").onsubmit = e => {
    e.preventDefault();
    const value = $("token-input").value.trim();
    if (value) { sessionStorage.setItem(TOKEN_KEY, value); location.reload(); }
  };
  $("btn-forget-token").onclick = () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); };
  $("btn-close").onclick = () => { $("inspector").hidden = true; openTrajectory = null; };
  $("btn-refresh").onclick = refreshTable;
  $("filter-status").onchange = refreshTable;
  $("trajectory-table").tBodies[0].addEventListener("click", e => {
    const tr = e.target.closest("tr");
    if (tr) inspect(tr.dataset.id);
  });
  api("/api/events?limit=50").then(es => es.reverse().forEach(addEvent));
  connect();
  refreshSteps();  // then once per finished step, on the stream's `step` event
  const slow = () => Promise.allSettled([refreshDistributions(), refreshTable()]);
  slow();
  setInterval(slow, 3000);
}
init();

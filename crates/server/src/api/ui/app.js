// The kici-scaler console: reads the control API (every call with the
// bearer token when there is one), follows GET /v1/events, and draws the
// fleet, the scalers, the agents and the standalone jobs. No framework: the
// views are rebuilt from the state below, at most once per frame.
'use strict';

const TOKEN_KEY = 'kici-scaler-token';
const HOUR_MS = 3600 * 1000;
const SAMPLE_MS = 10 * 1000;
const TRANSITIONS_KEPT = 20;
// A pending request older than this is shown highlighted: the status does
// not carry the pending TTL, and by then an operator should look anyway.
const PENDING_WARN_S = 60;

const S = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  status: null,
  statusAt: 0,            // Date.now() when `status` was read
  pendingWarnS: PENDING_WARN_S,
  fleet: null,
  agents: new Map(),      // agentId -> agent (GET /v1/agents shape, plus `since` in ms)
  transitions: new Map(), // agentId -> [{at, from, to, cause, detail, failureReason}]
  jobs: new Map(),        // jobId -> JobView
  series: [],             // [{t, counts: {state: n}, pending}]
  sort: { key: 'agentId', dir: 1 },
  filter: '',
  selected: null,
  output: null,           // {jobId, abort}
  lastEventId: null,
  connected: false,
  ready: false,
};

const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? '').replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

// ------------------------------------------------------------------ token

function takeFragmentToken() {
  const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (!m) return;
  S.token = decodeURIComponent(m[1]);
  sessionStorage.setItem(TOKEN_KEY, S.token);
  // The token must not stay in the address bar, history or a bookmark.
  history.replaceState(null, '', location.pathname + location.search);
}

// ------------------------------------------------------------------ API

class ApiError extends Error {
  constructor(status, code, message, field) {
    super(message);
    this.status = status;
    this.code = code;
    this.field = field;
  }
  // As the API words it.
  toString() {
    return `${this.message}${this.field ? ` (field: ${this.field})` : ''} [${this.code || this.status}]`;
  }
}

function headers(extra) {
  const h = Object.assign({}, extra);
  if (S.token) h.Authorization = `Bearer ${S.token}`;
  return h;
}

async function errorOf(r) {
  const text = await r.text();
  try {
    const e = JSON.parse(text).error;
    return new ApiError(r.status, e.code, e.message, e.field);
  } catch (_) {
    return new ApiError(r.status, '', text || `HTTP ${r.status}`);
  }
}

async function api(method, path, body) {
  const init = { method, headers: headers(body ? { 'Content-Type': 'application/json' } : {}) };
  if (body) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (!r.ok) throw await errorOf(r);
  if (r.status === 204) return null;
  const type = r.headers.get('Content-Type') || '';
  return type.includes('json') ? r.json() : r.text();
}

// An SSE stream read with fetch (EventSource cannot send a token).
async function sse(path, extraHeaders, signal, onEvent, onOpen) {
  const r = await fetch(path, { headers: headers(extraHeaders), signal });
  if (!r.ok) throw await errorOf(r);
  if (onOpen) onOpen();
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r\n?/g, '\n');
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const ev = { id: null, event: 'message', data: '' };
      const data = [];
      for (const line of block.split('\n')) {
        if (!line || line.startsWith(':')) continue;
        const c = line.indexOf(':');
        const k = c < 0 ? line : line.slice(0, c);
        const v = c < 0 ? '' : line.slice(c + 1).replace(/^ /, '');
        if (k === 'id') ev.id = v;
        else if (k === 'event') ev.event = v;
        else if (k === 'data') data.push(v);
      }
      if (!data.length) continue;
      ev.data = data.join('\n');
      onEvent(ev);
    }
  }
}

function showError(e) {
  $('error-text').textContent = e instanceof ApiError ? e.toString() : String(e && e.message || e);
  $('error').hidden = false;
}

// ------------------------------------------------------------------ state

function agentFromApi(a) {
  a.since = Date.now() - (a.stateSeconds || 0) * 1000;
  return a;
}

async function loadAgents() {
  const list = await api('GET', '/v1/agents');
  const next = new Map();
  for (const a of list.agents) next.set(a.agentId, agentFromApi(a));
  S.agents = next;
  render();
}

async function loadStatus() {
  S.status = await api('GET', '/v1/status');
  S.statusAt = Date.now();
  $('instance').textContent = S.status.instanceId;
  sample();
  render();
}

async function loadFleet() {
  try {
    S.fleet = await api('GET', '/v1/fleet');
  } catch (e) {
    if (e.code === 'not-a-fleet') S.fleet = null;
    else throw e;
  }
  render();
}

async function loadJobs() {
  const list = await api('GET', '/v1/jobs');
  S.jobs = new Map(list.jobs.map((j) => [j.jobId, j]));
  render();
}

const later = {};
// Runs `f` once, `ms` from the first call since it last ran.
function debounce(name, ms, f) {
  if (later[name]) return;
  later[name] = setTimeout(() => { later[name] = null; f().catch(showError); }, ms);
}

function onEvent(ev) {
  if (ev.id) S.lastEventId = ev.id;
  if (ev.event === 'reset') { debounce('all', 0, loadAll); return; }
  let d;
  try { d = JSON.parse(ev.data); } catch (_) { return; }
  if (ev.event === 'agent-transition') {
    let a = S.agents.get(d.agentId);
    if (!a) {
      a = { agentId: d.agentId, scaler: d.scaler, backend: d.backend, labelSetIndex: null, resources: null, host: d.host };
      S.agents.set(d.agentId, a);
      // Its label set and resources come with the full list.
      debounce('agents', 300, loadAgents);
    }
    a.state = d.to;
    a.since = d.at || Date.now();
    if (d.jobId) a.jobId = d.jobId;
    if (d.failureReason) a.failureReason = d.failureReason;
    const t = S.transitions.get(d.agentId) || [];
    t.push({ at: d.at, from: d.from, to: d.to, cause: d.cause, detail: d.detail, failureReason: d.failureReason, jobId: d.jobId });
    if (t.length > TRANSITIONS_KEPT) t.shift();
    S.transitions.set(d.agentId, t);
    if (d.to === 'gone') S.agents.delete(d.agentId);
    if (d.jobId) debounce('jobs', 300, loadJobs);
  }
  debounce('status', 200, loadStatus);
  render();
}

async function follow() {
  for (let wait = 500; ; wait = Math.min(wait * 2, 10000)) {
    try {
      const h = S.lastEventId ? { 'Last-Event-ID': S.lastEventId } : {};
      await sse('/v1/events', h, undefined, (ev) => { wait = 500; onEvent(ev); }, () => setConnected(true));
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) { setConnected(false); needToken(e); return; }
    }
    setConnected(false);
    await new Promise((r) => setTimeout(r, wait));
    // What happened while away.
    loadAll().catch(() => {});
  }
}

function setConnected(on) {
  S.connected = on;
  $('conn').textContent = on ? 'live' : 'reconnecting';
  $('conn').className = `badge ${on ? 'on' : 'off'}`;
}

function loadAll() {
  return Promise.all([loadStatus(), loadAgents(), loadJobs(), loadFleet()]);
}

// ------------------------------------------------------------------ chart

const SERIES = [
  ['starting', '#a855f7', (c) => (c.requested || 0) + (c.provisioning || 0) + (c.booted || 0) + (c.registered || 0)],
  ['idle', '#16a34a', (c) => c.idle || 0],
  ['busy', '#2563eb', (c) => c.busy || 0],
  ['draining/destroying', '#9ca3af', (c) => (c.draining || 0) + (c.destroying || 0)],
];

function sample() {
  const now = Date.now();
  const last = S.series[S.series.length - 1];
  const counts = {};
  for (const a of S.agents.values()) counts[a.state] = (counts[a.state] || 0) + 1;
  const point = { t: now, counts, pending: S.status ? S.status.pending : 0 };
  if (last && now - last.t < SAMPLE_MS) S.series[S.series.length - 1] = Object.assign(point, { t: last.t });
  else S.series.push(point);
  while (S.series.length && now - S.series[0].t > HOUR_MS) S.series.shift();
}

function drawChart() {
  const cv = $('chart');
  const ctx = cv.getContext('2d');
  const W = cv.width, H = cv.height, pad = 24;
  ctx.clearRect(0, 0, W, H);
  const now = Date.now();
  const lines = SERIES.map(([name, color, f]) => [name, color, S.series.map((p) => [p.t, f(p.counts)])]);
  lines.push(['pending', '#dc2626', S.series.map((p) => [p.t, p.pending])]);
  let max = 1;
  for (const [, , pts] of lines) for (const [, v] of pts) max = Math.max(max, v);
  const x = (t) => pad + (W - 2 * pad) * (1 - (now - t) / HOUR_MS);
  const y = (v) => H - pad - (H - 2 * pad) * (v / max);
  ctx.strokeStyle = '#e5e7eb'; ctx.fillStyle = '#6b7280'; ctx.font = '11px sans-serif';
  for (const v of [0, max]) { ctx.beginPath(); ctx.moveTo(pad, y(v)); ctx.lineTo(W - pad, y(v)); ctx.stroke(); ctx.fillText(String(v), 2, y(v) + 4); }
  ctx.fillText('-60 min', pad, H - 6); ctx.fillText('now', W - pad - 18, H - 6);
  for (const [, color, pts] of lines) {
    ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
    pts.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    if (pts.length) ctx.lineTo(W - pad, y(pts[pts.length - 1][1]));
    ctx.stroke();
  }
  $('legend').innerHTML = lines.map(([n, c]) => `<span><i style="background:${c}"></i>${esc(n)}</span>`).join('');
}

// ------------------------------------------------------------------ views

function dur(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, '0')}m`;
}

// A pending count and, when some wait, the oldest one's age: the age read
// with the status plus the time since, so it moves between refreshes.
function pending(n, oldest) {
  if (!n || oldest == null) return String(n);
  const age = oldest + (Date.now() - S.statusAt) / 1000;
  const warn = age > S.pendingWarnS ? ' warn' : '';
  return `${n}, oldest <span class="age${warn}" data-age="${age.toFixed(1)}">${dur(age)}</span>`;
}

function bytes(n) {
  if (n == null) return '';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${Math.round(n * 10) / 10}${u[i]}`;
}

function capLine(name, used, max, free, fmt) {
  fmt = fmt || String;
  if (max == null) return `<dt>${name}</dt><dd>${esc(fmt(used))} (no cap)</dd>`;
  const pct = max > 0 ? Math.min(100, (100 * used) / max) : 100;
  return `<dt>${name}</dt><dd>${esc(fmt(used))} / ${esc(fmt(max))}, free ${esc(fmt(free))}<div class="bar"><i style="width:${pct}%"></i></div></dd>`;
}

function usage(u) {
  if (!u) return '';
  return capLine('agents', u.agents, u.maxAgents, u.free.agents)
    + capLine('cpus', u.used.cpus, u.maxCpus, u.free.cpus)
    + capLine('memory', u.used.memoryBytes, u.maxMemoryBytes, u.free.memoryBytes, bytes);
}

function renderGlobal() {
  const st = S.status;
  if (!st) return;
  $('global').innerHTML = `<dl class="kv">${usage(st.global)}<dt>global max agents</dt><dd>${st.globalMaxAgents || 'none'}</dd><dt>pending</dt><dd class="pending">${pending(st.pending, st.oldestPendingSeconds)}</dd></dl>`;
}

function renderScalers() {
  const st = S.status;
  if (!st) return;
  $('scalers').innerHTML = st.scalers.map((s) => {
    const c = s.agents;
    const flags = (s.cordoned ? '<span class="badge cordoned">cordoned</span>' : '') + (s.draining ? '<span class="badge draining">draining</span>' : '');
    const breakers = s.labelSets.map((l) => `<div>#${l.index} [${esc(l.labels.join(', '))}] <span class="badge ${esc(l.breaker)}" data-breaker="${l.index}">${esc(l.breaker)}</span>${l.consecutiveFailures ? ` ${l.consecutiveFailures} failures` : ''}</div>`).join('');
    const n = esc(s.name);
    return `<div class="card" data-scaler="${n}">
<h3>${n} <span class="muted">${esc(s.backend)}</span> <span class="flags">${flags}</span></h3>
<dl class="kv">
<dt>agents</dt><dd class="counts">${c.active} active: ${c.spawning} spawning, ${c.registered} registered, ${c.idle} idle, ${c.busy} busy, ${c.draining} draining, ${c.destroying} destroying</dd>
<dt>warm</dt><dd class="warm">${s.warmIdle} ready / ${s.warmTarget} target</dd>
<dt>pending</dt><dd class="pending">${pending(s.pending, s.oldestPendingSeconds)}</dd>
<dt>spawns</dt><dd>${s.spawns.inFlight} in flight / ${s.spawns.maxConcurrent} max, ${s.spawns.waiting} waiting</dd>
</dl>
<dl class="kv caps">${usage(s.usage)}</dl>
<div class="breakers">${breakers}</div>
<div class="actions">
${s.cordoned ? `<button data-action="uncordon" data-scaler="${n}">Uncordon</button>` : `<button data-action="cordon" data-scaler="${n}">Cordon</button>`}
<button data-action="drain" data-scaler="${n}" class="danger">Drain</button>
</div></div>`;
  }).join('');
}

function renderFleet() {
  const f = S.fleet;
  $('fleet-section').hidden = !f;
  if (!f) return;
  $('fleet-name').textContent = `${f.fleet}, answered by ${f.answeredBy}`;
  $('fleet-hosts').tBodies[0].innerHTML = f.hosts.map((h) => `<tr><td title="${esc(h.instanceId)}">${esc(h.hostname)}</td><td><span class="badge ${h.state === 'up' ? 'on' : 'off'}">${esc(h.state)}</span></td><td>${h.epoch}</td><td>${dur(h.leaseAgeSeconds)}</td><td>${h.leader ? 'leader' : ''}</td><td>${esc(h.pools.join(', '))}</td></tr>`).join('');
  $('fleet-pools').tBodies[0].innerHTML = f.pools.map((p) => `<tr><td>${esc(p.name)}</td><td>${p.hosts.length}</td><td>${p.agents}</td><td>${p.capacity ?? 'none'}</td><td>${p.free ?? ''}</td><td>${p.queueDepth}</td></tr>`).join('');
}

function labelsOf(a) {
  if (!S.status || a.labelSetIndex == null) return '';
  const s = S.status.scalers.find((x) => x.name === a.scaler);
  const l = s && s.labelSets[a.labelSetIndex];
  return l ? l.labels.join(',') : `#${a.labelSetIndex}`;
}

function resourcesOf(a) {
  return a.resources ? `${a.resources.cpus} cpu, ${bytes(a.resources.memoryBytes)}` : '';
}

const SORT_VALUE = {
  since: (a) => -a.since,
  labels: labelsOf,
  resources: (a) => (a.resources ? a.resources.cpus * 1e12 + a.resources.memoryBytes : -1),
};

function renderAgents() {
  const now = Date.now();
  const q = S.filter.toLowerCase();
  const rows = [];
  for (const a of S.agents.values()) {
    const r = {
      a,
      cells: [a.agentId, a.scaler, labelsOf(a), a.state, dur((now - a.since) / 1000), a.jobId || '', a.host || '', resourcesOf(a)],
    };
    if (q && !r.cells.some((c) => c.toLowerCase().includes(q))) continue;
    rows.push(r);
  }
  const { key, dir } = S.sort;
  const val = SORT_VALUE[key] || ((a) => a[key] ?? '');
  rows.sort((x, y) => {
    const p = val(x.a), q2 = val(y.a);
    return (p < q2 ? -1 : p > q2 ? 1 : x.a.agentId < y.a.agentId ? -1 : 1) * dir;
  });
  S.rows = rows;
  drawAgentRows();
  $('agent-count').textContent = `${rows.length} of ${S.agents.size}`;
  for (const th of $('agents').tHead.rows[0].cells) th.className = th.dataset.key === key ? (dir > 0 ? 'asc' : 'desc') : '';
}

// Only the rows in (and near) the scrolled view are in the document, with
// spacers for the rest: an update costs the same at 10 or 10,000 agents.
const ROW_H = 22;
const ROWS_AROUND = 15;

function drawAgentRows() {
  const rows = S.rows || [];
  const view = $('agents').parentElement;
  const first = Math.max(0, Math.floor(view.scrollTop / ROW_H) - ROWS_AROUND);
  const last = Math.min(rows.length, first + Math.ceil((view.clientHeight || 480) / ROW_H) + 2 * ROWS_AROUND);
  const html = [];
  if (first > 0) html.push(`<tr class="spacer" style="height:${first * ROW_H}px"></tr>`);
  for (let i = first; i < last; i++) {
    const c = rows[i].cells;
    html.push(`<tr data-id="${esc(c[0])}"${c[0] === S.selected ? ' class="sel"' : ''}><td>${esc(c[0])}</td><td>${esc(c[1])}</td><td>${esc(c[2])}</td><td class="s-${esc(c[3])}">${esc(c[3])}</td><td>${c[4]}</td><td>${esc(c[5])}</td><td>${esc(c[6])}</td><td>${esc(c[7])}</td></tr>`);
  }
  if (last < rows.length) html.push(`<tr class="spacer" style="height:${(rows.length - last) * ROW_H}px"></tr>`);
  $('agents').tBodies[0].innerHTML = html.join('');
}

function renderDetail() {
  const box = $('agent-detail');
  const id = S.selected;
  if (!id) { box.hidden = true; return; }
  box.hidden = false;
  const a = S.agents.get(id);
  const t = (S.transitions.get(id) || []).slice().reverse();
  box.innerHTML = `<h3>${esc(id)}</h3>
<dl class="kv"><dt>state</dt><dd>${esc(a ? a.state : 'gone')}</dd><dt>scaler</dt><dd>${esc(a ? a.scaler : '')}</dd><dt>job</dt><dd>${esc(a && a.jobId || '')}</dd>
${a && a.failureReason ? `<dt>failure</dt><dd>${esc(a.failureReason)}</dd>` : ''}</dl>
<h3>Last transitions</h3>
${t.length ? `<table class="transitions">${t.map((x) => `<tr><td>${new Date(x.at).toLocaleTimeString()}</td><td>${esc(x.from)} → ${esc(x.to)}</td><td>${esc([x.cause, x.failureReason, x.detail].filter(Boolean).join(': '))}</td></tr>`).join('')}</table>` : '<p class="muted">none seen since this page opened</p>'}
<div class="actions">${a ? `<button data-action="destroy" data-agent="${esc(id)}" class="danger">Destroy</button>` : ''}<button data-action="close-detail">Close</button></div>`;
}

function renderJobs() {
  const jobs = [...S.jobs.values()];
  $('jobs').tBodies[0].innerHTML = jobs.map((j) => {
    const done = ['succeeded', 'failed', 'cancelled'].includes(j.state);
    const id = esc(j.jobId);
    return `<tr data-job="${id}"><td>${id}</td><td class="state">${esc(j.state)}</td><td>${esc(j.agentId || '')}</td><td>${j.exitCode ?? ''}</td><td>${esc(j.command.join(' '))}</td><td>${done ? '' : `<button data-action="cancel-job" data-job="${id}" class="danger">Cancel</button>`}</td></tr>`;
  }).join('');
}

let renderQueued = false;
// Coalesces every change of a frame into one redraw.
function render() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => { renderQueued = false; renderNow(); });
}

function renderNow() {
  renderGlobal();
  renderFleet();
  renderScalers();
  renderAgents();
  renderDetail();
  renderJobs();
  drawChart();
}

// ------------------------------------------------------------------ job output

async function showOutput(jobId) {
  if (S.output) S.output.abort.abort();
  const abort = new AbortController();
  S.output = { jobId, abort };
  $('job-output-box').hidden = false;
  $('job-output-id').textContent = jobId;
  $('job-output-state').textContent = 'streaming';
  const pre = $('job-output');
  pre.textContent = '';
  const decoders = { stdout: new TextDecoder(), stderr: new TextDecoder() };
  try {
    await sse(`/v1/jobs/${encodeURIComponent(jobId)}/logs`, {}, abort.signal, (ev) => {
      const d = JSON.parse(ev.data);
      if (ev.event === 'output') {
        const raw = atob(d.data);
        const buf = new Uint8Array(raw.length);
        for (let i = 0; i < raw.length; i++) buf[i] = raw.charCodeAt(i);
        pre.textContent += (decoders[d.stream] || decoders.stdout).decode(buf, { stream: true });
        pre.scrollTop = pre.scrollHeight;
      } else if (ev.event === 'truncated') {
        pre.textContent += `\n[${d.reason}]\n`;
      } else if (ev.event === 'end') {
        S.jobs.set(d.jobId, d);
        $('job-output-state').textContent = `${d.state}${d.exitCode != null ? `, exit ${d.exitCode}` : ''}${d.reason ? `: ${d.reason}` : ''}`;
        render();
      }
    });
  } catch (e) {
    if (e.name !== 'AbortError') showError(e);
  }
}

// ------------------------------------------------------------------ actions

function confirmThen(text, action) {
  $('confirm-text').textContent = text;
  const dlg = $('confirm');
  dlg.returnValue = '';
  dlg.onclose = () => {
    if (dlg.returnValue === 'ok') action().catch(showError);
  };
  dlg.showModal();
}

const ACTIONS = {
  cordon: (b) => confirmThen(`Cordon scaler ${b.dataset.scaler}? No new job will be routed to it.`, () => api('POST', `/v1/scalers/${encodeURIComponent(b.dataset.scaler)}/cordon`).then(loadStatus)),
  uncordon: (b) => confirmThen(`Uncordon scaler ${b.dataset.scaler}? Jobs are routed to it again.`, () => api('POST', `/v1/scalers/${encodeURIComponent(b.dataset.scaler)}/uncordon`).then(loadStatus)),
  drain: (b) => confirmThen(`Drain scaler ${b.dataset.scaler}? It is cordoned, its pending requests are cancelled and its idle agents destroyed.`, () => api('POST', `/v1/scalers/${encodeURIComponent(b.dataset.scaler)}/drain`).then(loadStatus)),
  destroy: (b) => confirmThen(`Destroy agent ${b.dataset.agent} now (with its job, if any)?`, () => api('DELETE', `/v1/agents/${encodeURIComponent(b.dataset.agent)}`)),
  'cancel-job': (b) => confirmThen(`Cancel job ${b.dataset.job}?`, () => api('DELETE', `/v1/jobs/${encodeURIComponent(b.dataset.job)}`).then(loadJobs)),
  'close-detail': () => { S.selected = null; render(); },
};

function parseCommand(text) {
  text = text.trim();
  if (text.startsWith('[')) return JSON.parse(text);
  return text.split(/\s+/).filter(Boolean);
}

function wire() {
  document.addEventListener('click', (e) => {
    const b = e.target.closest('button[data-action]');
    if (b && ACTIONS[b.dataset.action]) { ACTIONS[b.dataset.action](b); return; }
    const th = e.target.closest('#agents th');
    if (th) {
      const k = th.dataset.key;
      S.sort = { key: k, dir: S.sort.key === k ? -S.sort.dir : 1 };
      render();
      return;
    }
    const tr = e.target.closest('#agents tbody tr');
    if (tr) { S.selected = tr.dataset.id; render(); return; }
    const jr = e.target.closest('#jobs tbody tr');
    if (jr) showOutput(jr.dataset.job);
  });
  $('agents').parentElement.addEventListener('scroll', drawAgentRows, { passive: true });
  $('filter').addEventListener('input', (e) => { S.filter = e.target.value; render(); });
  $('error-close').addEventListener('click', () => { $('error').hidden = true; });
  $('logout').addEventListener('click', () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); });
  $('login-form').addEventListener('submit', (e) => {
    e.preventDefault();
    S.token = $('token').value.trim();
    sessionStorage.setItem(TOKEN_KEY, S.token);
    $('error').hidden = true;
    start();
  });
  $('job-form').addEventListener('submit', (e) => {
    e.preventDefault();
    let command;
    try { command = parseCommand($('job-command').value); } catch (err) { showError(`command: ${err.message}`); return; }
    const labels = $('job-labels').value.split(',').map((l) => l.trim()).filter(Boolean);
    api('POST', '/v1/jobs', { labels, command })
      .then((j) => { S.jobs.set(j.jobId, Object.assign({ command, labels }, j)); render(); showOutput(j.jobId); return loadJobs(); })
      .catch(showError);
  });
}

function needToken(e) {
  sessionStorage.removeItem(TOKEN_KEY);
  $('main').hidden = true;
  $('login').hidden = false;
  $('logout').hidden = true;
  if (e) showError(e);
  $('token').focus();
}

async function start() {
  try {
    await loadStatus();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) { needToken(e); return; }
    showError(e);
    return;
  }
  $('login').hidden = true;
  $('main').hidden = false;
  $('logout').hidden = !S.token;
  await loadAll().catch(showError);
  S.ready = true;
  follow();
}

takeFragmentToken();
wire();
// Times in state and pending ages move on; the chart gets a point every
// SAMPLE_MS; the fleet and the status are polled too (lease ages are not
// events).
setInterval(() => { if (S.ready) { sample(); render(); } }, 1000);
setInterval(() => { if (S.ready) Promise.all([loadFleet(), loadStatus()]).catch(showError); }, 5000);
start();

// For tests and for the curious: the state, and a render-budget check.
window.kiciConsole = {
  state: S,
  // Renders `n` made-up agents, then again with every one changed;
  // returns both times in ms (layout included). The real agents return after.
  bench(n) {
    const real = S.agents;
    const states = ['idle', 'busy', 'provisioning', 'registered', 'draining'];
    const fake = new Map();
    for (let i = 0; i < n; i++) {
      const id = `scaler-bench-${String(i).padStart(8, '0')}`;
      fake.set(id, { agentId: id, scaler: 'bench', state: states[i % 5], since: Date.now() - i * 1000, labelSetIndex: 0, jobId: i % 2 ? `job-${i}` : null, resources: { cpus: 1, memoryBytes: 1 << 30 } });
    }
    S.agents = fake;
    const time = () => { const t0 = performance.now(); renderAgents(); void $('agents').offsetHeight; return performance.now() - t0; };
    const first = time();
    for (const a of fake.values()) { a.state = a.state === 'idle' ? 'busy' : 'idle'; a.since = Date.now(); }
    const update = time();
    S.agents = real;
    renderAgents();
    return { rows: n, firstMs: first, updateMs: update };
  },
};

// The trajectory viewer: batches, a batch's groups, an episode's transcript, tokens and timing.
// Plain JavaScript, no build step, nothing from a CDN. It reads the service's JSON API, sending
// the API key (kept in sessionStorage) as a bearer token; pages are routed by the URL's hash.
"use strict";

const KEY_NAME = "rollout-api-key";
const BATCHES_PER_PAGE = 50;
const GROUPS_PER_PAGE = 50;
const HISTOGRAM_BINS = 20;
const UNCERTAINTY_LEVELS = 10;
const STATUSES = ["queued", "running", "completed", "truncated", "aborted", "failed", "cancelled"];
// Each status has a symbol besides its colour (colour alone fails colour-blind readers), and what a
// trainer does with it (the records' `trainable`).
const STATUS_SYMBOLS = {
  queued: "○", running: "▶", completed: "✓", truncated: "✂", aborted: "⊘", failed: "✗", cancelled: "–",
};
const STATUS_MEANINGS = {
  queued: "waiting to run",
  running: "in progress",
  completed: "the env said done; trained on",
  truncated: "cut at a limit; trained on",
  aborted: "the policy's bad call or a refused request; not trained on",
  failed: "infrastructure failed; not trained on",
  cancelled: "its batch was cancelled; no tokens",
};

const main = document.getElementById("main");
const forgetKey = document.getElementById("forget-key");
const tokenInfo = document.getElementById("token-info");

class NeedKey extends Error {}

function apiKey() {
  return sessionStorage.getItem(KEY_NAME);
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: { Accept: "application/json", ...authHeaders() } });
  if (response.status === 401) {
    throw new NeedKey(apiKey() ? "That API key was refused." : "This service needs an API key.");
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    throw new Error(`${response.status}: ${(body && body.detail) || response.statusText}`);
  }
  return body;
}

function esc(value) {
  return String(value ?? "")
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;");
}

const enc = encodeURIComponent;

function fixed(value, digits = 3) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

function statusBadge(status) {
  return `<span class="status ${esc(status)}">${STATUS_SYMBOLS[status] || "?"} ${esc(status)}</span>`;
}

function statusLegend(counts) {
  const items = STATUSES.filter((status) => counts[status]).map(
    (status) => `<span>${statusBadge(status)} ${esc(STATUS_MEANINGS[status])}</span>`,
  );
  return `<div class="legend" id="status-legend">${items.join("")}</div>`;
}

function countChips(counts) {
  return STATUSES.filter((status) => counts[status])
    .map((status) => `${statusBadge(status)} ${counts[status]}`)
    .join(" ");
}

// ---- routing ----

function parseHash() {
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query) };
}

function link(path, params) {
  const query = params && params.toString();
  return `#${path}${query ? `?${query}` : ""}`;
}

async function route() {
  forgetKey.hidden = !apiKey();
  tokenInfo.hidden = true;
  const { parts, params } = parseHash();
  main.innerHTML = '<p class="loading">Loading…</p>';
  try {
    if (parts[0] === "batches" && parts[1]) {
      await batchPage(parts[1], params);
    } else if (parts[0] === "episodes" && parts[1]) {
      await episodePage(parts[1], params);
    } else {
      await batchesPage(params);
    }
  } catch (error) {
    if (error instanceof NeedKey) {
      keyForm(error.message);
    } else {
      main.innerHTML = `<div class="error-box">${esc(error.message)}</div>`;
    }
  }
}

function keyForm(message) {
  main.innerHTML = `
    <form class="key" id="key-form">
      <h1>API key</h1>
      <p>${esc(message)} It stays in this tab (sessionStorage) and goes to the API as a bearer token.</p>
      <input type="password" name="key" autocomplete="off" placeholder="one of the service's API_KEYS" required autofocus>
      <button type="submit">Open</button>
    </form>`;
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_NAME, new FormData(event.target).get("key").trim());
    route();
  });
}

forgetKey.addEventListener("click", () => {
  sessionStorage.removeItem(KEY_NAME);
  route();
});

// ---- batches, newest first ----

async function batchesPage(params) {
  const before = params.get("before");
  const page = await api(`/batches?limit=${BATCHES_PER_PAGE}${before ? `&before=${enc(before)}` : ""}`);
  const rows = page.batches.map((batch) => {
    const finished = STATUSES.slice(2).reduce((sum, status) => sum + (batch.counts[status] || 0), 0);
    return `<tr class="batch-row">
      <td><a href="${link(`/batches/${enc(batch.batch_id)}`)}">${esc(batch.batch_id)}</a></td>
      <td>${esc(batch.env)} <span class="muted">${esc(batch.task_split)}</span></td>
      <td>${esc(when(batch.created_at))}</td>
      <td class="num">${finished} / ${batch.total}</td>
      <td>${countChips(batch.counts)}${batch.cancelled_at ? ' <span class="muted">(cancelled)</span>' : ""}</td>
      <td class="num">${fixed(batch.reward_mean)}</td>
    </tr>`;
  });
  main.innerHTML = `
    <h1>Batches</h1>
    <table>
      <thead><tr><th>Batch</th><th>Environment</th><th>Created</th><th class="num">Finished</th>
        <th>Episodes by status</th><th class="num">Reward mean</th></tr></thead>
      <tbody>${rows.join("") || '<tr><td colspan="6" class="muted">No batches yet.</td></tr>'}</tbody>
    </table>
    <div class="pager">
      ${before ? `<a href="#/">Newest</a>` : ""}
      ${page.next ? `<a id="older" href="${link("/", new URLSearchParams({ before: page.next }))}">Older</a>` : ""}
    </div>`;
}

// ---- one batch: its groups ----

function histogram(rewards) {
  if (!rewards.length) {
    return '<p class="muted">No rewards yet.</p>';
  }
  let low = Math.min(...rewards);
  let high = Math.max(...rewards);
  if (low === high) {
    // One value: one bar, labelled with it (a made-up range around it would suggest a spread).
    return `<div class="histogram single" id="histogram"><div style="height:100%" title="${fixed(low, 2)}: ${rewards.length}"></div></div>
      <div class="histogram-axis"><span>every one of the ${rewards.length} rewards is ${fixed(low, 2)}: no spread, no GRPO signal</span></div>`;
  }
  const bins = new Array(HISTOGRAM_BINS).fill(0);
  for (const reward of rewards) {
    bins[Math.min(HISTOGRAM_BINS - 1, Math.floor(((reward - low) / (high - low)) * HISTOGRAM_BINS))] += 1;
  }
  const most = Math.max(...bins);
  const bars = bins
    .map((count, index) => {
      const from = low + ((high - low) * index) / HISTOGRAM_BINS;
      return `<div style="height:${(100 * count) / most}%" title="${fixed(from, 2)}…: ${count}"></div>`;
    })
    .join("");
  return `<div class="histogram" id="histogram">${bars}</div>
    <div class="histogram-axis"><span>${fixed(low, 2)}</span><span>${rewards.length} rewards</span><span>${fixed(high, 2)}</span></div>`;
}

function mean(values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
}

function sampleCell(episode) {
  const title = [
    `sample ${episode.sample_index}, ${episode.status}`,
    `reward ${fixed(episode.reward)}`,
    `turns ${episode.num_turns ?? "–"}`,
    `prompt ${episode.prompt_length ?? "–"} tokens, response ${episode.response_length ?? "–"}`,
    episode.error ? `error: ${episode.error}` : "",
  ]
    .filter(Boolean)
    .join("\n");
  return `<a class="sample ${esc(episode.status)}" href="${link(`/episodes/${enc(episode.id)}`)}" title="${esc(title)}">
    <span class="symbol" aria-label="${esc(episode.status)}">${STATUS_SYMBOLS[episode.status] || "?"}</span> <b>${fixed(episode.reward, 2)}</b> · ${episode.num_turns ?? "–"}t · ${episode.response_length ?? "–"}tok</a>`;
}

async function batchPage(batchId, params) {
  const batch = await api(`/batches/${enc(batchId)}/episodes`);
  const wanted = new Set(params.getAll("status"));
  const shown = wanted.size ? batch.episodes.filter((episode) => wanted.has(episode.status)) : batch.episodes;
  const counts = {};
  for (const episode of batch.episodes) {
    counts[episode.status] = (counts[episode.status] || 0) + 1;
  }
  const groups = new Map();
  for (const episode of shown) {
    if (!groups.has(episode.group_index)) {
      groups.set(episode.group_index, { task: episode.task_index, episodes: [] });
    }
    groups.get(episode.group_index).episodes.push(episode);
  }
  const pages = Math.max(1, Math.ceil(groups.size / GROUPS_PER_PAGE));
  const pageIndex = Math.min(pages - 1, Math.max(0, Number(params.get("page")) || 0));
  const pageGroups = [...groups.entries()].slice(pageIndex * GROUPS_PER_PAGE, (pageIndex + 1) * GROUPS_PER_PAGE);
  const rows = pageGroups.map(([index, group]) => {
    const rewards = group.episodes.map((episode) => episode.reward).filter((reward) => reward !== null);
    return `<tr class="group-row"><td class="num">${index}</td><td class="num">${group.task}</td>
      <td class="num">${fixed(mean(rewards))}</td>
      <td><div class="samples">${group.episodes.map(sampleCell).join("")}</div></td></tr>`;
  });
  const at = (changes) => {
    const next = new URLSearchParams(params);
    for (const [name, value] of Object.entries(changes)) {
      next.delete(name);
      for (const item of [].concat(value)) {
        if (item !== null) next.append(name, item);
      }
    }
    return link(`/batches/${enc(batchId)}`, next);
  };
  const chips = STATUSES.filter((status) => counts[status]).map((status) => {
    const on = wanted.has(status);
    const toggled = on ? [...wanted].filter((item) => item !== status) : [...wanted, status];
    return `<a class="chip" role="button" aria-pressed="${on}" data-status="${status}" href="${at({ status: toggled, page: null })}">${STATUS_SYMBOLS[status]} ${status} ${counts[status]}</a>`;
  });
  const rewards = shown.map((episode) => episode.reward).filter((reward) => reward !== null);
  main.innerHTML = `
    <p><a href="#/">Batches</a></p>
    <h1>Batch ${esc(batch.batch_id)}</h1>
    <dl class="facts">
      <dt>Environment</dt><dd>${esc(batch.env)} ${esc(batch.task_split)}</dd>
      <dt>Created</dt><dd>${esc(when(batch.created_at))}${batch.cancelled_at ? `, cancelled ${esc(when(batch.cancelled_at))}` : ""}</dd>
      <dt>Episodes</dt><dd>${batch.episodes.length} in ${new Set(batch.episodes.map((e) => e.group_index)).size} groups</dd>
      <dt>Reward mean</dt><dd>${fixed(mean(rewards))} <span class="muted">(shown episodes)</span></dd>
    </dl>
    ${batch.waiting_for_engine ? `<div class="warn-box" id="engine-waiting">${esc(batch.waiting_for_engine)}</div>` : ""}
    ${statusLegend(counts)}
    <div class="chips" id="status-filter">${chips.join("")}${wanted.size ? `<a class="chip" href="${at({ status: [], page: null })}">all</a>` : ""}</div>
    <h2>Rewards</h2>
    ${histogram(rewards)}
    <h2>Groups</h2>
    <table>
      <thead><tr><th class="num">Group</th><th class="num">Task</th><th class="num">Mean</th><th>Samples: reward · turns · response tokens</th></tr></thead>
      <tbody>${rows.join("") || '<tr><td colspan="4" class="muted">No episodes.</td></tr>'}</tbody>
    </table>
    <div class="pager">
      ${pageIndex > 0 ? `<a id="previous" href="${at({ page: String(pageIndex - 1) })}">Previous</a>` : ""}
      <span class="muted">groups page ${pageIndex + 1} of ${pages}</span>
      ${pageIndex + 1 < pages ? `<a id="next" href="${at({ page: String(pageIndex + 1) })}">Next</a>` : ""}
    </div>`;
}

// ---- one episode: transcript, tokens, timing ----

const CALL_MARKUP = /(<tool_call>[\s\S]*?<\/tool_call>|<\|python_tag\|>[\s\S]*|\[TOOL_CALLS\][\s\S]*|<\|tool_calls_section_begin\|>[\s\S]*|<｜tool▁calls▁begin｜>[\s\S]*)/;

function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function assistantContent(content) {
  let html = "";
  let rest = content || "";
  const thinking = rest.match(/^\s*<think>([\s\S]*?)<\/think>/);
  if (thinking) {
    html += `<div class="reasoning">${esc(thinking[1].trim())}</div>`;
    rest = rest.slice(thinking[0].length);
  }
  for (const piece of rest.split(CALL_MARKUP)) {
    if (!piece) continue;
    if (CALL_MARKUP.test(piece)) {
      const inner = piece.replace(/^<tool_call>|<\/tool_call>$/g, "").trim();
      html += `<div class="call"><pre>${esc(pretty(inner))}</pre></div>`;
    } else if (piece.trim()) {
      html += `<div class="content">${esc(piece.trim())}</div>`;
    }
  }
  return html;
}

function transcript(episode) {
  const calls = (episode.turns || []).filter((turn) => turn.resume === 0);
  let assistantTurn = 0;
  const toolNames = new Map(); // a tool call's id -> its tool: names the results stored without one
  return (episode.messages || [])
    .map((message) => {
      for (const call of message.tool_calls || []) {
        if (call && call.function) toolNames.set(call.id, call.function.name);
      }
      const role = message.role || "?";
      if (role === "system") {
        return `<details class="msg system"><summary class="role">system prompt (${(message.content || "").length} characters)</summary>
          <pre>${esc(message.content)}</pre></details>`;
      }
      if (role === "tools") {
        // An external agent's segment opens with the tools its prompt was rendered with.
        const tools = message.tools || [];
        return `<details class="msg system"><summary class="role">tools (${tools.length})</summary>
          <pre>${esc(JSON.stringify(tools, null, 2))}</pre></details>`;
      }
      if (role === "assistant") {
        const turn = calls[assistantTurn++];
        const names = turn ? turn.actions || (turn.action ? [turn.action] : []) : [];
        const label = names.length ? ` → ${names.map(esc).join(", ")}` : "";
        const reasoning = message.reasoning_content ? `<div class="reasoning">${esc(message.reasoning_content)}</div>` : "";
        const toolCalls = (message.tool_calls || [])
          .map((call) => `<div class="call"><span class="name">${esc(call.function && call.function.name)}</span><pre>${esc(pretty(call.function && call.function.arguments))}</pre></div>`)
          .join("");
        return `<div class="msg assistant"><div class="role">assistant${label}</div>${reasoning}${assistantContent(message.content)}${toolCalls}</div>`;
      }
      if (role === "tool") {
        const name = message.name || toolNames.get(message.tool_call_id) || "";
        return `<div class="msg tool"><div class="role">tool ${esc(name)}</div><pre>${esc(pretty(message.content))}</pre></div>`;
      }
      const extra = message.env_only ? " (environment)" : "";
      const body = message.content ? `<div class="content">${esc(message.content)}</div>` : "";
      const toolCalls = message.tool_calls
        ? `<div class="call"><pre>${esc(JSON.stringify(message.tool_calls, null, 2))}</pre></div>`
        : "";
      return `<div class="msg ${esc(role)}"><div class="role">${esc(role)}${extra}</div>${body}${toolCalls}</div>`;
    })
    .join("");
}

function timing(turns) {
  if (!turns || !turns.length) {
    return '<p class="muted">No generate calls.</p>';
  }
  const longest = Math.max(...turns.map((turn) => turn.engine_seconds + turn.env_seconds), 1e-9);
  const rows = turns.map((turn) => {
    const engine = (100 * turn.engine_seconds) / longest;
    const env = (100 * turn.env_seconds) / longest;
    const name = `turn ${turn.turn}${turn.resume ? ` resume ${turn.resume}` : ""}`;
    return `<span>${name}</span>
      <div class="bar" title="engine ${fixed(turn.engine_seconds)} s, env ${fixed(turn.env_seconds)} s">
        <div class="engine" style="width:${engine}%"></div><div class="env" style="width:${env}%"></div></div>
      <span class="muted">${fixed(turn.engine_seconds, 2)} s + ${fixed(turn.env_seconds, 2)} s · ${turn.output_tokens} tok · ${esc(turn.weight_version ?? "?")}</span>`;
  });
  return `<div class="legend"><span><span class="swatch" style="background:var(--engine)"></span>engine</span>
    <span><span class="swatch" style="background:var(--env)"></span>environment</span></div>
    <div class="bars" id="timing">${rows.join("")}</div>`;
}

function uncertaintyStyles() {
  const rules = [];
  for (let level = 0; level < UNCERTAINTY_LEVELS; level++) {
    rules.push(`.tokens .u${level}{background:rgba(var(--sampled),${(0.06 + (0.5 * level) / UNCERTAINTY_LEVELS).toFixed(2)})}`);
  }
  const style = document.createElement("style");
  style.textContent = rules.join("\n");
  document.head.appendChild(style);
}

// Where the context after the last sampled token starts (the length when nothing follows it).
function trailingContext(mask) {
  let end = mask.length;
  while (end > 0 && !mask[end - 1]) end -= 1;
  return end === 0 ? mask.length : end;
}

function tokenHtml(view) {
  const texts = view.response_tokens;
  const mask = view.loss_mask;
  const logprobs = view.rollout_logprobs;
  const marks = new Map();
  for (const turn of view.turns) {
    const label = `turn ${turn.turn}${turn.resume ? ` · resume ${turn.resume}` : ""} · weights ${turn.weight_version ?? "?"}`;
    const mark = `<span class="mark${turn.resume ? " resume" : ""}">${esc(label)}</span>`;
    marks.set(turn.start, (marks.get(turn.start) || "") + mark);
  }
  const parts = new Array(texts.length + 1);
  for (let index = 0; index < texts.length; index++) {
    const before = marks.get(index) || "";
    if (mask[index]) {
      const unsure = 1 - Math.exp(logprobs[index]);
      const level = Math.min(UNCERTAINTY_LEVELS - 1, Math.floor(unsure * UNCERTAINTY_LEVELS));
      parts[index] = `${before}<span class="t m1 u${level}" data-i="${index}">${esc(texts[index])}</span>`;
    } else {
      parts[index] = `${before}<span class="t m0" data-i="${index}">${esc(texts[index])}</span>`;
    }
  }
  parts[texts.length] = marks.get(texts.length) || "";
  const trailing = trailingContext(mask);
  if (trailing < texts.length) {
    parts[trailing] = `<span class="trailing-note" id="trailing-context">After the last sampled turn: context (mask 0, by design): what the environment answered and the next turn's header, as the model would see them if the episode went on; never trained on.</span>${parts[trailing]}`;
  }
  return parts.join("");
}

async function showTokens(episodeId, into) {
  const started = performance.now();
  const view = await api(`/episodes/${enc(episodeId)}/tokens`);
  const sampled = view.loss_mask.reduce((a, b) => a + b, 0);
  into.innerHTML = `
    <div class="legend">
      <span><span class="swatch" style="background:rgba(var(--sampled),0.1)"></span>sampled, sure</span>
      <span><span class="swatch" style="background:rgba(var(--sampled),0.55)"></span>sampled, unsure (low logprob)</span>
      <span style="color:#8c959f">grey: context (mask 0)</span>
      <span>${view.response_tokens.length} response tokens, ${sampled} trained on (mask 1)</span>
    </div>
    <details><summary>Prompt (${esc(view.prompt_text.length)} characters)</summary><pre class="tokens prompt-text">${esc(view.prompt_text)}</pre></details>
    <div class="tokens" id="tokens"></div>`;
  const container = document.getElementById("tokens");
  container.innerHTML = tokenHtml(view);
  container.addEventListener("mousemove", (event) => {
    const index = event.target.dataset ? event.target.dataset.i : undefined;
    if (index === undefined) {
      tokenInfo.hidden = true;
      return;
    }
    const i = Number(index);
    tokenInfo.textContent = [
      `#${i}  id ${view.response_ids[i]}  mask ${view.loss_mask[i]}`,
      view.loss_mask[i] ? `logprob ${view.rollout_logprobs[i].toFixed(4)}  p ${Math.exp(view.rollout_logprobs[i]).toFixed(3)}` : "context",
      JSON.stringify(view.response_tokens[i]),
    ].join("\n");
    tokenInfo.style.left = `${event.clientX + 12}px`;
    tokenInfo.style.top = `${event.clientY + 12}px`;
    tokenInfo.hidden = false;
  });
  container.addEventListener("mouseleave", () => {
    tokenInfo.hidden = true;
  });
  // Time from the request to the tokens laid out, for benchmarks and the curious.
  requestAnimationFrame(() => {
    container.dataset.renderMs = (performance.now() - started).toFixed(1);
  });
}

function openJson(event, path) {
  if (!apiKey()) return; // the plain link works
  event.preventDefault();
  fetch(path, { headers: authHeaders() })
    .then((response) => response.blob())
    .then((blob) => window.open(URL.createObjectURL(new Blob([blob], { type: "application/json" })), "_blank"));
}

// The env's `info`, for the trainer only (never in the prompt): the task's ground truth and the
// reward's breakdown (`reward_info`) first, then the rest, each value as JSON.
function infoPanel(info) {
  const entries = Object.entries(info || {});
  if (!entries.length) return "";
  entries.sort(([a], [b]) => (b === "reward_info") - (a === "reward_info"));
  const rows = entries.map(([name, value]) => {
    const text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
    return `<dt>${esc(name)}</dt><dd><pre>${esc(text)}</pre></dd>`;
  });
  return `<details class="panel" id="info-panel" open><summary>Task and reward (<code>info</code>: ground truth, reward breakdown; the trainer's, never the model's)</summary>
    <dl class="facts info">${rows.join("")}</dl></details>`;
}

async function episodePage(episodeId, params) {
  const episode = await api(`/episodes/${enc(episodeId)}`);
  const tab = params.get("tab") || "transcript";
  const tabs = [
    ["transcript", "Transcript"],
    ["tokens", "Tokens"],
    ["timing", "Timing"],
  ]
    .map(([name, label]) => `<a class="chip" role="tab" aria-pressed="${name === tab}" href="${link(`/episodes/${enc(episodeId)}`, new URLSearchParams({ tab: name }))}" id="tab-${name}">${label}</a>`)
    .join("");
  const jsonPath = `/episodes/${enc(episodeId)}`;
  main.innerHTML = `
    <p><a href="#/">Batches</a> / <a href="${link(`/batches/${enc(episode.batch_id)}`)}">${esc(episode.batch_id)}</a></p>
    <h1>Episode ${esc(episode.id)}</h1>
    <dl class="facts">
      <dt>Status</dt><dd>${statusBadge(episode.status)} attempt ${episode.attempt}</dd>
      <dt>Reward</dt><dd>${fixed(episode.reward)}</dd>
      <dt>Task</dt><dd>${esc(episode.env)} ${esc(episode.task_split)} #${episode.task_index} · group ${episode.group_index}, sample ${episode.sample_index}</dd>
      <dt>Turns</dt><dd>${episode.num_turns ?? "–"} (${(episode.turns || []).length} generate calls)</dd>
      <dt>Tokens</dt><dd>prompt ${episode.prompt_length ?? "–"}, response ${episode.response_length ?? "–"}</dd>
      ${episode.segments > 1 ? `<dt>Segments</dt><dd>${episode.segments}: an external agent rewrote its history; shown is the last, the earlier ones are in the JSON</dd>` : ""}
      <dt>Time</dt><dd>created ${esc(when(episode.created_at))}, finished ${esc(when(episode.finished_at))}</dd>
      <dt>Data</dt><dd><a id="json-link" href="${jsonPath}" target="_blank" rel="noopener">episode JSON</a></dd>
    </dl>
    ${episode.error ? `<div class="error-box" id="episode-error">${esc(episode.error)}</div>` : ""}
    ${infoPanel(episode.info)}
    <div class="chips">${tabs}</div>
    <section id="tab-body"></section>`;
  document.getElementById("json-link").addEventListener("click", (event) => openJson(event, jsonPath));
  const body = document.getElementById("tab-body");
  if (tab === "tokens") {
    if (episode.response_ids === null) {
      body.innerHTML = '<p class="muted">This episode stored no tokens.</p>';
    } else {
      await showTokens(episodeId, body);
    }
  } else if (tab === "timing") {
    body.innerHTML = timing(episode.turns);
  } else {
    body.innerHTML = `<div class="chat" id="transcript">${transcript(episode) || '<p class="muted">No transcript yet.</p>'}</div>`;
  }
}

uncertaintyStyles();
window.addEventListener("hashchange", route);
route();

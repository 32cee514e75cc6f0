// treeserve's web chat. Model output is only ever put in the page as text nodes (textContent, or the
// DOM that markdown.js builds from it), never parsed as markup, and the page's Content-Security-Policy
// allows no inline script: an answer that contains <script> or an onerror attribute is shown, not run.
/* global renderMarkdown */
"use strict";

const $ = (id) => document.getElementById(id);
const state = { me: null, csrf: "", conversation: null, controller: null, saving: null };
const FIELDS = {
  temperature: ["settings-temperature", Number], top_p: ["settings-top-p", Number],
  repetition_penalty: ["settings-repetition-penalty", Number], max_tokens: ["settings-max-tokens", Number],
  search_n: ["settings-search-n", Number], search_strategy: ["settings-search-strategy", String],
  system_prompt: ["settings-system-prompt", String],
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

async function api(method, path, body) {
  const headers = { "X-CSRF-Token": state.csrf };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

async function apiError(response) {
  let message = `HTTP ${response.status}`;
  try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
  const error = new Error(message);
  error.status = response.status;
  return error;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

// ---- signing in ------------------------------------------------------------------------------
async function start() {
  try {
    state.me = await api("GET", "/chat/api/me");
  } catch (error) {
    if (error.status === 401) return showLogin();
    throw error;
  }
  state.csrf = state.me.csrf_token;
  $("login").hidden = true;
  $("app").hidden = false;
  $("user-name").textContent = state.me.user_id;
  fillModels();
  showUsage(state.me.usage);
  await listConversations();
  await route();
}

function showLogin() {
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-username").focus();
}

async function login(event) {
  event.preventDefault();
  $("login-error").textContent = "";
  try {
    const me = await api("POST", "/chat/api/login",
      { user_id: $("login-username").value, password: $("login-password").value });
    state.csrf = me.csrf_token;
    $("login-password").value = "";
    await start();
  } catch (error) {
    $("login-error").textContent = error.message;
  }
}

async function logout() {
  await api("POST", "/chat/api/logout");
  state.conversation = null;
  history.pushState(null, "", "/chat");
  showLogin();
}

// ---- conversations -----------------------------------------------------------------------------
async function listConversations() {
  const { conversations } = await api("GET", "/chat/api/conversations");
  const current = state.conversation && conversations.find((c) => c.id === state.conversation.id);
  if (current && document.activeElement !== $("title")) $("title").value = current.title;  // named by its first message
  const list = $("conversations");
  list.replaceChildren(...conversations.map((c) => {
    const item = el("li", { "data-testid": "conversation-item", "data-id": c.id, text: c.title,
      class: state.conversation && state.conversation.id === c.id ? "active" : "" });
    item.addEventListener("click", () => navigate(c.id));
    return item;
  }));
}

async function route() {
  const match = location.pathname.match(/^\/chat\/c\/([^/]+)$/);
  if (match) return openConversation(match[1]);
  state.conversation = null;
  showConversation(null);
}

function navigate(id) {
  history.pushState(null, "", id ? `/chat/c/${encodeURIComponent(id)}` : "/chat");
  route();
}

async function openConversation(id) {
  notice("");
  try {
    state.conversation = await api("GET", `/chat/api/conversations/${encodeURIComponent(id)}`);
  } catch (error) {
    state.conversation = null;
    showConversation(null);
    notice(error.status === 404 ? "This conversation does not exist." : error.message);
    return;
  }
  showConversation(state.conversation);
  await listConversations();
}

function showConversation(conversation) {
  $("title").value = conversation ? conversation.title : "";
  for (const id of ["export-xlsx", "export-json"]) {
    const format = id.split("-")[1];
    if (conversation) $(id).href = `/chat/api/conversations/${conversation.id}/export?format=${format}`;
    else $(id).removeAttribute("href");
  }
  showSettings(conversation ? conversation.settings : state.me.defaults);
  $("messages").replaceChildren(...(conversation ? conversation.messages.map(renderMessage) : []));
  showExamples();
  scrollDown();
}

// An empty conversation offers the questions the selected model answers well (chat.examples in the
// gateway's configuration): a click picks the example's mode and sends it.
function showExamples() {
  const messages = $("messages");
  const old = messages.querySelector(".examples");
  if (old) old.remove();
  const examples = (state.me.examples || {})[$("settings-model").value] || [];
  if (messages.children.length || !examples.length) return;
  const buttons = examples.map((example) => {
    const button = el("button", { type: "button", class: "example", "data-testid": "example",
      "data-mode": example.mode, text: `${example.mode}: ${example.text}` });
    button.addEventListener("click", () => sendExample(example).catch((e) => notice(e.message)));
    return button;
  });
  messages.append(el("div", { class: "examples", "data-testid": "examples" },
    el("div", { class: "meta", text: "Try one of these:" }), ...buttons));
}

async function sendExample(example) {
  for (const radio of document.querySelectorAll('input[name="mode"]')) radio.checked = radio.value === example.mode;
  await saveSettings();
  $("message-input").value = example.text;
  $("composer").requestSubmit();
}

async function newConversation() {
  const conversation = await api("POST", "/chat/api/conversations", { settings: readSettings() });
  navigate(conversation.id);
  return conversation;
}

async function firstConversation() {
  // a message sent with no conversation open starts one, shown at once (no reload that could race)
  const conversation = await api("POST", "/chat/api/conversations", { settings: readSettings() });
  history.pushState(null, "", `/chat/c/${conversation.id}`);
  state.conversation = conversation;
  showConversation(conversation);
  return conversation;
}

async function renameConversation() {
  if (!state.conversation) return;
  state.conversation = { ...state.conversation,
    ...await api("PATCH", `/chat/api/conversations/${state.conversation.id}`, { title: $("title").value }) };
  await listConversations();
}

async function deleteConversation() {
  if (!state.conversation || !confirm(`Delete "${state.conversation.title}"?`)) return;
  await api("DELETE", `/chat/api/conversations/${state.conversation.id}`);
  navigate(null);
  await listConversations();
}

// ---- settings ----------------------------------------------------------------------------------
function fillModels() {
  $("settings-model").replaceChildren(...state.me.models.map((m) => el("option", { value: m, text: m })));
  const search = document.querySelector('[data-testid="mode-search"]');
  search.disabled = state.me.search_models.length === 0;
  search.parentElement.title = search.disabled ? "no model of this gateway has a verifier"
    : `models with a verifier: ${state.me.search_models.join(", ")}`;
}

function showSettings(settings) {
  const merged = { ...state.me.defaults, ...settings };
  $("settings-model").value = merged.model;
  for (const [name, [id]] of Object.entries(FIELDS)) $(id).value = merged[name];
  for (const radio of document.querySelectorAll('input[name="mode"]')) radio.checked = radio.value === merged.mode;
}

function readSettings() {
  const settings = { model: $("settings-model").value || null,
    mode: document.querySelector('input[name="mode"]:checked').value };
  const saved = { ...state.me.defaults, ...(state.conversation ? state.conversation.settings : {}) };
  for (const [name, [id, type]] of Object.entries(FIELDS)) {
    const input = $(id);
    settings[name] = input.value === "" && type === Number || !input.checkValidity() ? saved[name] : type(input.value);
  }
  return settings;
}

async function saveSettings(event) {
  if (!state.conversation) return;
  if (event && event.target.checkValidity && !event.target.checkValidity()) {
    notice(`${event.target.closest("label").firstChild.textContent.trim()}: ${event.target.validationMessage}`);
    return;  // (a field being retyped: nothing is saved until it holds a value the server takes)
  }
  try {
    state.saving = api("PATCH", `/chat/api/conversations/${state.conversation.id}`, { settings: readSettings() });
    state.conversation.settings = (await state.saving).settings;
    notice("");
  } catch (error) {
    notice(error.message);
  } finally {
    state.saving = null;
  }
}

// ---- messages ----------------------------------------------------------------------------------
function renderMessage(message) {
  const node = el("div", { class: `message ${message.role}`, "data-testid": `message-${message.role}` });
  const meta = el("div", { class: "meta", text: message.role === "user" ? "You" : metaText(message) });
  const content = message.role === "assistant"
    ? el("div", { class: "content markdown", "data-testid": "message-content" }, renderMarkdown(message.content))
    : el("div", { class: "content", "data-testid": "message-content", text: message.content });
  node.append(meta, content);
  const details = message.details || {};
  if (details.search) node.append(renderSearch(details.search));
  if (details.tool) node.append(renderTool(details.tool, details.router));
  if (details.status === "stopped") node.append(el("div", { class: "flag", text: "stopped" }));
  if (details.error) node.append(el("div", { class: "error", text: details.error }));
  return node;
}

function metaText(message) {
  const tokens = message.completion_tokens ? ` · ${message.prompt_tokens}+${message.completion_tokens} tokens` : "";
  return `${message.model || "assistant"} · ${message.mode}${tokens}`;
}

function renderSearch(search) {
  const box = el("div", { class: "search", "data-testid": "search-result" });
  box.append(el("div", { class: "search-summary", "data-testid": "search-summary",
    text: `answer ${search.answer ?? "?"} · score ${fmt(search.score)} · ${search.strategy}, n=${search.n} · ` +
      `tree size ${search.tree_size} steps · verifier ${search.verifier}` }));
  if (search.verifier_rejected_all) {
    box.append(el("div", { class: "flag", "data-testid": "search-rejected",
      text: "the verifier rejected every candidate: this answer is a guess" }));
  }
  const list = el("ol", { class: "candidates" });
  for (const candidate of search.candidates || []) {
    const item = el("li", { "data-testid": "search-candidate",
      class: candidate.index === search.chosen ? "chosen" : "" });
    item.append(el("span", { class: "answer", text: `answer ${candidate.answer ?? "?"}` }),
      el("span", { class: "score", "data-testid": "candidate-score", text: `score ${fmt(candidate.score)}` }),
      chart(candidate.step_scores || []),
      el("span", { class: "steps", text: `steps: ${(candidate.step_scores || []).map(fmt).join(", ")}` }));
    const text = el("details", {}, el("summary", { text: "text" }), el("pre", { text: candidate.text }));
    item.append(text);
    list.append(item);
  }
  box.append(list);
  return box;
}

function chart(scores) {
  const ns = "http://www.w3.org/2000/svg";
  const width = 120, height = 32, pad = 3;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "chart");
  svg.setAttribute("data-testid", "step-score-chart");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `step scores ${scores.map(fmt).join(", ")}`);
  const x = (i) => pad + (scores.length > 1 ? i * (width - 2 * pad) / (scores.length - 1) : (width - 2 * pad) / 2);
  const y = (s) => height - pad - Math.max(0, Math.min(1, s)) * (height - 2 * pad);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", scores.map((s, i) => `${x(i)},${y(s)}`).join(" "));
  svg.append(line);
  scores.forEach((s, i) => {
    const dot = document.createElementNS(ns, "circle");
    dot.setAttribute("cx", x(i));
    dot.setAttribute("cy", y(s));
    dot.setAttribute("r", 2.5);
    svg.append(dot);
  });
  return svg;
}

function renderTool(tool, router) {
  return el("div", { class: `tool ${tool.ok ? "" : "failed"}`, "data-testid": "tool-card",
    title: router ? `chosen by ${router}` : "" },
    el("div", { class: "tool-name", "data-testid": "tool-name", text: `tool: ${tool.name}` }),
    el("div", { class: "tool-input", "data-testid": "tool-input", text: `input: ${JSON.stringify(tool.input)}` }),
    el("div", { class: "tool-result", "data-testid": "tool-result", text: `result: ${tool.result}` }));
}

function fmt(value) {
  return typeof value === "number" ? value.toFixed(3) : String(value ?? "?");
}

function showUsage(usage) {
  if (!usage) return;
  const budget = usage.max_budget == null ? "" : ` of $${usage.max_budget}`;
  $("usage").textContent = `${usage.requests} request${usage.requests === 1 ? "" : "s"} · ${usage.prompt_tokens + usage.completion_tokens} tokens · ` +
    `$${usage.cost.toFixed(6)}${budget}`;
}

function scrollDown() {
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ---- sending and streaming ---------------------------------------------------------------------
async function send(event) {
  event.preventDefault();
  const content = $("message-input").value;
  if (!content.trim() || state.controller) return;
  notice("");
  if (state.saving) await state.saving;
  const conversation = state.conversation || await firstConversation();
  $("message-input").value = "";
  const examples = $("messages").querySelector(".examples");
  if (examples) examples.remove();
  const live = el("div", { class: "message assistant streaming", "data-testid": "message-assistant" },
    el("div", { class: "meta", text: `${readSettings().model} · ${readSettings().mode} …` }),
    el("div", { class: "content", "data-testid": "message-content" }));
  state.controller = new AbortController();
  setStreaming(true);
  try {
    const response = await fetch(`/chat/api/conversations/${conversation.id}/messages`, {
      method: "POST", credentials: "same-origin", signal: state.controller.signal,
      headers: { "Content-Type": "application/json", "X-CSRF-Token": state.csrf },
      body: JSON.stringify({ content, settings: readSettings() }) });
    if (!response.ok) throw await apiError(response);
    await readEvents(response, (e) => onEvent(e, live));
  } catch (error) {
    if (error.name === "AbortError") live.append(el("div", { class: "flag", text: "stopped" }));
    else {
      notice(error.message);
      live.append(el("div", { class: "error", text: error.message }));
    }
  } finally {
    live.classList.remove("streaming");
    state.controller = null;
    setStreaming(false);
    listConversations();
    api("GET", "/chat/api/me").then((me) => showUsage(me.usage)).catch(() => {});
  }
}

async function readEvents(response, handle) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) handle(JSON.parse(data));
    }
  }
}

function onEvent(event, live) {
  const content = live.querySelector(".content");
  if (event.type === "user") {
    $("messages").append(renderMessage(event.message), live);
  } else if (event.type === "delta") {
    content.textContent += event.text;
  } else if (event.type === "progress") {
    content.textContent = `searching… iteration ${event.iteration}, ${event.live_beams} live beams, ` +
      `best score ${fmt(event.best_score)}, ${event.completion_tokens} tokens generated, tree size ${event.tree_size}`;
  } else if (event.type === "routing") {
    content.textContent = `asking ${event.router} which tool fits…`;
  } else if (event.type === "routed" || event.type === "tool") {
    content.textContent = "";
  } else if (event.type === "error") {
    live.append(el("div", { class: "error", text: event.message }));
  } else if (event.type === "done" && event.message) {
    const done = renderMessage(event.message);
    live.replaceWith(done);
    if (state.conversation) state.conversation.messages.push(event.message);
  }
  scrollDown();
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// ---- wiring ------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("sign-out").addEventListener("click", logout);
  $("new-chat").addEventListener("click", () => newConversation().catch((e) => notice(e.message)));
  $("delete-chat").addEventListener("click", () => deleteConversation().catch((e) => notice(e.message)));
  $("title").addEventListener("change", () => renameConversation().catch((e) => notice(e.message)));
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("message-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  for (const node of document.querySelectorAll("#settings input, #settings select, #settings textarea")) {
    node.addEventListener("change", saveSettings);
  }
  $("settings-model").addEventListener("change", showExamples);
  window.addEventListener("popstate", () => route());
  start().catch((error) => notice(error.message));
});

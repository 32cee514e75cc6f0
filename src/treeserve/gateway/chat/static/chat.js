// treeserve's web chat. Model output is only ever put in the page as text nodes (textContent, or the
// DOM that markdown.js builds from it), never parsed as markup, and the page's Content-Security-Policy
// allows no inline script: an answer that contains <script> or an onerror attribute is shown, not run.
/* global renderMarkdown */
"use strict";

const $ = (id) => document.getElementById(id);
// streams: the answers in flight, by conversation id ({ controller, live, question, known }); each goes on
// streaming into its own conversation while another one is open and used (as ChatGPT's do)
const state = { me: null, csrf: "", conversation: null, streams: new Map(), saving: null };
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

// Any 401 (the session ended: signed out in another tab, expired) shows the sign-in form, and what the
// page held of the previous user goes.
async function apiError(response) {
  let message = `HTTP ${response.status}`;
  try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
  const error = new Error(message);
  error.status = response.status;
  if (response.status === 401 && !response.url.endsWith("/chat/api/login")) sessionEnded("Your session ended: sign in again.");
  return error;
}

function sessionEnded(why = "") {
  if (!state.me) return showLogin();  // (not signed in yet: the page's first visit)
  for (const stream of state.streams.values()) stream.controller.abort();
  Object.assign(state, { me: null, csrf: "", conversation: null });
  for (const id of ["messages", "conversations", "usage"]) $(id).replaceChildren();
  for (const id of ["message-input", "title"]) $(id).value = "";
  notice("");
  history.pushState(null, "", "/chat");
  showLogin(why);
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
    if (error.status === 401) return;  // (the sign-in form is shown)
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

function showLogin(why = "") {
  $("login-error").textContent = why;
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
  try {
    await api("POST", "/chat/api/logout");
  } catch (error) {
    if (error.status !== 401) return notice(error.message);  // (a 401: signed out already)
  }
  sessionEnded();
}

// ---- conversations -----------------------------------------------------------------------------
async function listConversations() {
  const { conversations } = await api("GET", "/chat/api/conversations");
  const current = state.conversation && conversations.find((c) => c.id === state.conversation.id);
  if (current && document.activeElement !== $("title")) $("title").value = current.title;  // named by its first message
  const list = $("conversations");
  list.replaceChildren(...conversations.map((c) => {
    const open = el("button", { type: "button", "data-testid": "conversation-item", "data-id": c.id, text: c.title,
      class: state.conversation && state.conversation.id === c.id ? "active" : "" });
    open.addEventListener("click", () => navigate(c.id));  // (a button: Enter and Space open it too)
    return el("li", {}, open);
  }));
}

async function route() {
  const match = location.pathname.match(/^\/chat\/c\/([^/]+)$/);
  if (match) return openConversation(match[1]);
  state.conversation = null;
  showConversation(null);
}

function showSidebar(open) {  // (narrow screens: the conversations over the chat)
  $("app").classList.toggle("show-sidebar", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}

function navigate(id) {
  showSidebar(false);
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
  const stream = conversation && state.streams.get(conversation.id);
  if (stream && stream.question) $("messages").append(stream.live);  // (its answer, still streaming)
  showExamples();
  showStreaming();
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

async function firstConversation() {
  // a message sent with no conversation open starts one, shown at once (no reload that could race)
  const conversation = await api("POST", "/chat/api/conversations", { settings: readSettings() });
  history.pushState(null, "", `/chat/c/${conversation.id}`);
  state.conversation = conversation;
  showConversation(conversation);
  return conversation;
}

async function renameConversation() {
  const conversation = state.conversation;
  if (!conversation) return;
  const stored = await api("PATCH", `/chat/api/conversations/${conversation.id}`, { title: $("title").value });
  if (isOpen(conversation)) {  // (another one opened meanwhile, by leaving the field for it, stays as it is)
    state.conversation = { ...state.conversation, ...stored };
    $("title").value = state.conversation.title;  // as stored (spaces collapsed; an empty one is "New chat")
  }
  await listConversations();
}

function isOpen(conversation) {
  return Boolean(state.conversation) && state.conversation.id === conversation.id;
}

async function deleteConversation() {
  const conversation = state.conversation;
  if (!conversation || !confirm(`Delete "${conversation.title}"?`)) return;
  stopStreamingIn(conversation.id);
  await api("DELETE", `/chat/api/conversations/${conversation.id}`);
  navigate(null);
  await listConversations();
}

// Deleting the conversation an answer streams into stops the answer (as Stop does: nothing more is
// generated or billed, and Send is free again at once).
function stopStreamingIn(id) {
  const stream = state.streams.get(id);
  if (!stream) return;
  stream.deleted = true;  // (nothing of it is left to show as stopped)
  stream.live.remove();
  stream.controller.abort();
}

function isOpenId(id) {
  return Boolean(state.conversation) && state.conversation.id === id;
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
  const conversation = state.conversation;  // (the one saved to, whichever is open once it is saved)
  try {
    state.saving = api("PATCH", `/chat/api/conversations/${conversation.id}`, { settings: readSettings() });
    const { settings } = await state.saving;
    if (isOpen(conversation)) state.conversation.settings = settings;
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
  if (message.role === "user" && message.id != null) {
    // (labelled by the style sheet: "Edit" is not part of the message's text, copied or read)
    const edit = el("button", { type: "button", class: "link edit", "data-testid": "edit-message",
      "aria-label": "Edit", title: "Edit this message and send it again" });
    edit.addEventListener("click", () => startEditing(node, message));
    meta.append(edit);
  }
  const details = message.details || {};
  if (details.search) node.append(renderSearch(details.search));
  if (details.tool) node.append(renderTool(details.tool, details.router));
  const leftOut = Number(details.left_out) || 0;
  if (leftOut > 0) {
    meta.append(el("span", { class: "left-out", "data-testid": "left-out", title: "left out so that the prompt and "
      + "max tokens fit the model's context",
      text: ` · ${leftOut} earlier message${leftOut === 1 ? "" : "s"} left out` }));
  }
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
    text: `answer ${search.answer ?? "?"} · score ${scoreText(search.score)} · ${search.strategy}, n=${search.n} · ` +
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
      el("span", { class: "score", "data-testid": "candidate-score", text: `score ${scoreText(candidate.score)}` }),
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

// greedy and majority read no verifier: their scores are null, shown as the CLI shows them
function scoreText(value) {
  return value === null ? "none" : fmt(value);
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
  const input = $("message-input");
  const content = input.value;
  if (!content.trim() || (state.conversation && state.streams.has(state.conversation.id))) return;
  notice("");
  if (state.saving) await state.saving;
  const started = !state.conversation;  // (this send makes the conversation: a refusal takes it back)
  const conversation = state.conversation || await firstConversation();
  await streamAnswer(conversation, "POST", `/chat/api/conversations/${conversation.id}/messages`,
    { content, settings: readSettings() }, {
      known: (conversation.messages || []).length,
      refused: async () => { if (started) await abandonConversation(conversation); },
      taken: () => { if (input.value === content) input.value = ""; },  // (kept until taken: a refusal loses nothing)
      // a message too long for the model's context stays in the conversation and is given back to shorten
      event: (e) => { if (e.type === "error" && e.code === "context_length_exceeded" && !input.value) input.value = content; },
    });
}

// Regenerate: the last answer replaced by a new one (an answer streaming is stopped first).
async function regenerate() {
  const conversation = state.conversation;
  if (!conversation) return;
  notice("");
  const replaced = await stopToReplace(conversation.id);
  if (state.saving) await state.saving;
  await restart(conversation, "POST", `/chat/api/conversations/${conversation.id}/regenerate`,
    { settings: readSettings() }, null, { refused: () => showStopped(replaced) });
}

// Edit: the user's message sent again as written; every message after it is replaced. `hooks`: taken
// (the gateway took the edit), as streamAnswer's.
async function resend(message, content, hooks = {}) {
  const conversation = state.conversation;
  notice("");
  const replaced = await stopToReplace(conversation.id);
  if (state.saving) await state.saving;
  await restart(conversation, "PUT", `/chat/api/conversations/${conversation.id}/messages/${message.id}`,
    { content, settings: readSettings() }, message.id, { ...hooks, refused: () => showStopped(replaced) });
}

// The conversation from the restarted message on is replaced once the gateway has taken the request.
function restart(conversation, method, path, body, messageId, hooks = {}) {
  return streamAnswer(conversation, method, path, body, { ...hooks,
    known: restartPoint(conversation.messages, messageId), restart: messageId === null ? "last" : messageId });
}

// Where a restart cuts the messages shown: at the message edited, or at the user's last one.
function restartPoint(messages, messageId) {
  const at = messageId === null || messageId === "last" ? messages.map((m) => m.role).lastIndexOf("user")
    : messages.findIndex((m) => m.id === messageId);
  return at < 0 ? messages.length : at;
}

// An answer streaming into `id` is stopped and its page element dropped: it is being replaced. (the
// stream stopped, if any)
async function stopToReplace(id) {
  const stream = state.streams.get(id);
  if (!stream) return null;
  stream.replaced = true;
  stream.live.remove();
  stream.controller.abort();
  await stream.finished;
  return stream;
}

// A restart the gateway refused after it had stopped an answer: nothing replaced that answer, so it is
// shown stopped, then as stored, as Stop shows it (it was left off the page until a reload).
function showStopped(stream) {
  if (!stream || !isOpenId(stream.id)) return;
  if (stream.question) $("messages").append(stream.live);
  stopped(stream);  // (not awaited: it reads the stored answer once the refused request has ended)
}

function startEditing(node, message) {
  if (node.querySelector(".editor")) return;
  const content = node.querySelector('[data-testid="message-content"]');
  const input = el("textarea", { class: "edit-input", "data-testid": "edit-input", rows: "3",
    "aria-label": "Edit your message" });
  input.value = message.content;  // (a value, never markup)
  const save = el("button", { type: "button", class: "primary", "data-testid": "edit-send", text: "Send" });
  const cancel = el("button", { type: "button", "data-testid": "edit-cancel", text: "Cancel" });
  const editor = el("div", { class: "editor" }, input, el("div", { class: "editor-actions" }, save, cancel));
  const close = () => { editor.remove(); content.hidden = false; };
  cancel.addEventListener("click", close);
  // the editor stays open until the gateway takes the edit: a refusal (a 4xx) loses nothing of what was typed
  save.addEventListener("click", () => {
    if (!input.value.trim() || save.disabled) return;
    save.disabled = true;
    resend(message, input.value, { taken: close }).catch((error) => error.status === 401 || notice(error.message))
      .finally(() => { save.disabled = false; });
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Escape") close();
    if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    save.click();
  });
  content.hidden = true;
  content.after(editor);
  input.focus();
}

// One answer streamed into `conversation` (a message sent, edited or regenerated): its events shown
// while the conversation is open, whatever ends it. `hooks`: known (where the question will stand in the
// stored messages), restart (the message id edited, or "last": the messages from it on are replaced
// once the gateway takes the request), refused, taken, event.
async function streamAnswer(conversation, method, path, body, hooks) {
  const live = el("div", { class: "message assistant streaming", "data-testid": "message-assistant" },
    el("div", { class: "meta", text: `${body.settings.model} · ${body.settings.mode} …` }),
    el("div", { class: "content", "data-testid": "message-content" }));
  let finish;
  const stream = { id: conversation.id, controller: new AbortController(), live, question: null, known: hooks.known,
    restart: hooks.restart ?? null, settings: body.settings, finished: new Promise((resolve) => { finish = resolve; }) };
  state.streams.set(conversation.id, stream);
  showStreaming();
  try {
    const response = await fetch(path, {
      method, credentials: "same-origin", signal: stream.controller.signal,
      headers: { "Content-Type": "application/json", "X-CSRF-Token": state.csrf }, body: JSON.stringify(body) });
    if (!response.ok) {
      const refusal = await apiError(response);
      if (hooks.refused) await hooks.refused();
      throw refusal;
    }
    if (hooks.taken) hooks.taken();
    await readEvents(response, (e) => {
      onEvent(e, stream);
      if (hooks.event) hooks.event(e);
    });
  } catch (error) {
    if (error.name === "AbortError") {
      if (!stream.deleted && !stream.replaced) stopped(stream);
    } else if (error.status !== 401) {
      if (!state.conversation || isOpenId(conversation.id)) notice(error.message);  // (not over another one)
      live.append(el("div", { class: "error", text: error.message }));
    }
  } finally {
    live.classList.remove("streaming");
    if (state.streams.get(conversation.id) === stream) state.streams.delete(conversation.id);
    showStreaming();
    if (state.me) refreshSidebar();
    finish();
  }
}

// A first message the gateway refuses leaves no empty conversation behind: it is deleted and the
// page is a new chat again, the message still in the box and the settings as chosen (as ChatGPT does).
async function abandonConversation(conversation) {
  await api("DELETE", `/chat/api/conversations/${conversation.id}`).catch(() => {});
  if (!state.conversation || state.conversation.id !== conversation.id) return;
  const settings = readSettings();
  state.conversation = null;
  history.replaceState(null, "", "/chat");
  showConversation(null);
  showSettings(settings);
  showExamples();
}

function refreshSidebar() {
  listConversations().catch(() => {});
  api("GET", "/chat/api/me").then((me) => showUsage(me.usage)).catch(() => {});
}

// A stopped answer is shown finished at once (Markdown, no streaming header), then as the gateway
// stored it (with the tokens it was billed for) once it is saved. Stopped before the stored question
// came back, nothing of it is on the page yet: the conversation is shown as stored once its answer
// is (or, when none is, as it stands after a while), as a reload would show it.
async function stopped(stream) {
  const { id, live, settings } = stream;
  const shown = renderMessage({ role: "assistant", content: live.querySelector(".content").textContent,
    model: settings.model, mode: settings.mode, details: { status: "stopped" } });
  if (live.isConnected) live.replaceWith(shown);
  let saved = null;
  for (let tries = 0; tries < 20 && state.me && (shown.isConnected || !stream.question); tries++) {
    await new Promise((resolve) => setTimeout(resolve, 250));
    saved = await api("GET", `/chat/api/conversations/${encodeURIComponent(id)}`).catch(() => null) || saved;
    const at = !saved ? -1 : stream.question ? saved.messages.findIndex((m) => String(m.id) === stream.question)
      : stream.known;
    if (at >= 0 && saved.messages[at + 1]) break;
  }
  if (!saved || !isOpenId(id) || state.streams.has(id)) return;  // (left, or another answer streams there now)
  if (stream.question && !shown.isConnected) return;  // (shown as stored already: opened again meanwhile)
  state.conversation = saved;
  showConversation(saved);
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

// The events of the answer streaming into `stream.id`; that conversation's page shows them only while
// it is open (opened again, it is shown as stored with the live answer after it).
function onEvent(event, stream) {
  const live = stream.live;
  const content = live.querySelector(".content");
  const open = isOpenId(stream.id);
  if (event.type === "user") {
    stream.question = String(event.message.id);
    if (open && stream.restart !== null) {  // (edited or regenerated: what followed the message goes)
      const messages = state.conversation.messages;
      state.conversation.messages = messages.slice(0, restartPoint(messages, stream.restart));
      $("messages").replaceChildren(...state.conversation.messages.map(renderMessage));
    }
    if (open) {
      const examples = $("messages").querySelector(".examples");
      if (examples) examples.remove();
      if (!state.conversation.messages.some((m) => m.id === event.message.id)) {  // (not shown already)
        state.conversation.messages.push(event.message);
        $("messages").append(renderMessage(event.message));
      }
      $("messages").append(live);
    }
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
    if (live.isConnected) live.replaceWith(renderMessage(event.message));
    if (open) state.conversation.messages.push(event.message);
  }
  if (open) {
    if (event.type === "user") showStreaming();
    scrollDown();
  }
}

// Send waits, and Stop stops, only while an answer streams into the open conversation.
function showStreaming() {
  const on = Boolean(state.conversation) && state.streams.has(state.conversation.id);
  $("send").disabled = on;
  $("stop").disabled = !on;
  // Regenerate (which stops an answer streaming first) once the conversation holds a message of the user's
  const asked = Boolean(state.conversation) && (state.conversation.messages || []).some((m) => m.role === "user");
  $("regenerate").disabled = !asked;
}

// ---- wiring ------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("sign-out").addEventListener("click", logout);
  $("new-chat").addEventListener("click", () => navigate(null));  // (made by its first message)
  $("delete-chat").addEventListener("click", () => deleteConversation().catch((e) => notice(e.message)));
  $("title").addEventListener("change", () => renameConversation().catch((e) => notice(e.message)));
  $("composer").addEventListener("submit", (e) => send(e).catch((error) => error.status === 401 || notice(error.message)));
  $("regenerate").addEventListener("click", () => regenerate().catch((error) => error.status === 401 || notice(error.message)));
  $("stop").addEventListener("click", () => {
    const stream = state.conversation && state.streams.get(state.conversation.id);
    if (stream) stream.controller.abort();
  });
  $("toggle-sidebar").addEventListener("click", () => showSidebar(!$("app").classList.contains("show-sidebar")));
  // the open list covers the header's ☰: Escape, or a tap beside it, closes it too
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") showSidebar(false); });
  document.addEventListener("click", (event) => {
    if (!event.target.closest(".sidebar, #toggle-sidebar")) showSidebar(false);
  });
  $("message-input").addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;  // (an IME's Enter picks a word)
    e.preventDefault();
    $("composer").requestSubmit();
  });
  for (const node of document.querySelectorAll("#settings input, #settings select, #settings textarea")) {
    node.addEventListener("change", saveSettings);
  }
  $("settings-model").addEventListener("change", showExamples);
  window.addEventListener("popstate", () => route());
  start().catch((error) => notice(error.message));
});

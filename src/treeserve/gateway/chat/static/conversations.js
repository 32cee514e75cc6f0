// The conversation list and the open conversation: routing by URL, opening, starting one with its first
// message, renaming, deleting (stopping an answer that streams into it), the examples of an empty one.
/* global $, el, isOpen, notice, scrollDown, state, api, readSettings, saveSettings, showSettings, renderMessage,
   showUsage, showStreaming */
"use strict";

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

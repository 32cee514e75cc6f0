// Regenerate and Edit: the conversation restarted from the user's last message, or from the message
// edited, an answer streaming into it stopped first.
/* global $, el, isOpenId, notice, state, readSettings, stopped, streamAnswer */
"use strict";

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

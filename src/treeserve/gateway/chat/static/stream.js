// An answer streamed from the gateway (its server-sent events read off a fetch body) into its own
// conversation, shown while that conversation is open; Send, and a stopped answer shown as stored.
/* global $, el, isOpenId, notice, scrollDown, state, api, apiError, readSettings, fmt, renderMessage,
   abandonConversation, firstConversation, refreshSidebar, showConversation, restartPoint */
"use strict";

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

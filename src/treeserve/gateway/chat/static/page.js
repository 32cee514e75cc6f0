// The chat page's shared state and DOM helpers: the signed-in user, the open conversation, the answers
// streaming; elements built with their text as text nodes (`el`), the notice line.
"use strict";

const $ = (id) => document.getElementById(id);
// streams: the answers in flight, by conversation id ({ controller, live, question, known }); each goes on
// streaming into its own conversation while another one is open and used (as ChatGPT's do)
const state = { me: null, csrf: "", conversation: null, streams: new Map(), saving: null };

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

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

function isOpen(conversation) {
  return Boolean(state.conversation) && state.conversation.id === conversation.id;
}

function isOpenId(id) {
  return Boolean(state.conversation) && state.conversation.id === id;
}

function scrollDown() {
  $("messages").scrollTop = $("messages").scrollHeight;
}

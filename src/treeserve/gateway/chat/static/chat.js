// treeserve's web chat. Model output is only ever put in the page as text nodes (textContent, or the
// DOM that markdown.js builds from it), never parsed as markup, and the page's Content-Security-Policy
// allows no inline script: an answer that contains <script> or an onerror attribute is shown, not run.
/* global $, notice, state, login, logout, start, saveSettings, deleteConversation, navigate, renameConversation,
   route, showExamples, showSidebar, send, regenerate */
"use strict";

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

// Signing in and out: the page shown once the gateway knows the user, the sign-in form otherwise.
/* global $, notice, state, api, fillModels, showUsage, listConversations, route */
"use strict";

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

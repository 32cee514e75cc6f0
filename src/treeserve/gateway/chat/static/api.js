// The gateway's JSON API as the page calls it: the CSRF token sent with every call, an error's message
// read from its body, a 401 taken as the session's end.
/* global state, sessionEnded */
"use strict";

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

// A conversation's settings (model, mode, sampling, search, system prompt): shown, read back from the
// form and saved as a field changes.
/* global $, el, isOpen, notice, state, api */
"use strict";

const FIELDS = {
  temperature: ["settings-temperature", Number], top_p: ["settings-top-p", Number],
  repetition_penalty: ["settings-repetition-penalty", Number], max_tokens: ["settings-max-tokens", Number],
  search_n: ["settings-search-n", Number], search_strategy: ["settings-search-strategy", String],
  system_prompt: ["settings-system-prompt", String],
};

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

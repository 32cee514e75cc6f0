// Stored messages shown in the page: Markdown answers (markdown.js), the user's text, search candidates
// with their step-score charts, tool cards, the usage line. Model output only ever becomes text nodes
// (textContent, or the DOM markdown.js builds around them), never markup.
/* global renderMarkdown, $, el, startEditing */
"use strict";

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

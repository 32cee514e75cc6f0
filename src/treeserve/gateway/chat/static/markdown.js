// A small Markdown renderer for model answers that builds DOM nodes and never parses HTML: every
// piece of the model's text becomes a text node, so markup in an answer is shown, not run. Covers
// what models write most: paragraphs, headings, lists, fenced code, `code`, **bold**, *italic* and
// links (http and https only; anything else stays text).
"use strict";

const FENCE = /^\s*```/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/;
const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\[[^\]\n]+\]\([^)\s]+\))|(\*[^*\s][^*\n]*\*)/g;

function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (FENCE.test(line)) {
      const code = [];
      for (i += 1; i < lines.length && !FENCE.test(lines[i]); i += 1) code.push(lines[i]);
      i += 1;
      const pre = document.createElement("pre");
      pre.append(node("code", code.join("\n")));
      root.append(pre);
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      root.append(inlineInto(document.createElement(`h${Math.min(6, hashes.length + 2)}`), title));
      i += 1;
    } else if (ITEM.test(line)) {
      const ordered = Boolean(line.match(ITEM)[2]);
      const list = document.createElement(ordered ? "ol" : "ul");
      for (; i < lines.length && ITEM.test(lines[i]) && Boolean(lines[i].match(ITEM)[2]) === ordered; i += 1) {
        list.append(inlineInto(document.createElement("li"), lines[i].match(ITEM)[3]));
      }
      root.append(list);
    } else if (!line.trim()) {
      i += 1;
    } else {
      const paragraph = document.createElement("p");
      for (let first = true; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
           && !ITEM.test(lines[i]); i += 1, first = false) {
        if (!first) paragraph.append(document.createElement("br"));
        inlineInto(paragraph, lines[i]);
      }
      root.append(paragraph);
    }
  }
  return root;
}

function inlineInto(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(document.createTextNode(text.slice(last, match.index)));
    parent.append(inlineNode(match[0]));
    last = match.index + match[0].length;
  }
  parent.append(document.createTextNode(text.slice(last)));
  return parent;
}

function inlineNode(token) {
  if (token.startsWith("`")) return node("code", token.slice(1, -1));
  if (token.startsWith("**")) return node("strong", token.slice(2, -2));
  if (token.startsWith("[")) {
    const [, label, url] = token.match(/^\[([^\]]+)\]\(([^)\s]+)\)$/);
    if (!/^https?:\/\//i.test(url)) return document.createTextNode(token);
    const link = node("a", label);
    link.href = url;
    link.rel = "noopener noreferrer nofollow";
    link.target = "_blank";
    return link;
  }
  return node("em", token.slice(1, -1));
}

function node(tag, text) {
  const element = document.createElement(tag);
  element.textContent = text;
  return element;
}

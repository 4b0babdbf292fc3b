// The audit log, newest first, a page at a time; each entry's change shown field by field.

import { api } from "./api.js";
import { $, clearError, formatTime, h, latestOnly, showError } from "./dom.js";

const PAGE_SIZE = 50;
const MAX_CHANGES_SHOWN = 12;

let oldestId = null;
const startLoad = latestOnly();

// {a: {b: 1}} -> {"a.b": 1}: quota fields compare one by one.
function flatten(value, prefix = "", into = {}) {
  if (value !== null && typeof value === "object" && !Array.isArray(value)) {
    for (const [key, inner] of Object.entries(value)) flatten(inner, prefix ? `${prefix}.${key}` : key, into);
  } else if (prefix) {
    into[prefix] = value;
  }
  return into;
}

function show(value) {
  return value === null || value === undefined ? "∅" : JSON.stringify(value);
}

function changeList(entry) {
  const before = flatten(entry.before ?? {});
  const after = flatten(entry.after ?? {});
  const fields = [...new Set([...Object.keys(before), ...Object.keys(after)])].filter(
    (field) => field !== "updated_at" && show(before[field]) !== show(after[field]),
  );
  const items = fields
    .slice(0, MAX_CHANGES_SHOWN)
    .map((field) =>
      h(
        "li",
        {},
        h("code", { text: field }),
        entry.before ? `: ${show(before[field])} → ${show(after[field])}` : `: ${show(after[field])}`,
      ),
    );
  if (fields.length > MAX_CHANGES_SHOWN)
    items.push(h("li", { class: "muted", text: `and ${fields.length - MAX_CHANGES_SHOWN} more` }));
  return h("ul", { class: "changes" }, items);
}

function target(entry) {
  const label = entry.after?.name ?? entry.before?.name ?? "";
  const prefix = entry.after?.prefix ? ` ${entry.after.prefix}` : "";
  return `${entry.target_type} #${entry.target_id} ${label}${prefix}`.trim();
}

function entryRow(entry) {
  return h(
    "tr",
    { dataset: { action: entry.action } },
    h("td", { text: formatTime(entry.occurred_at) }),
    h("td", { text: entry.actor }),
    h("th", { scope: "row" }, h("code", { text: entry.action })),
    h("td", { text: target(entry) }),
    h("td", {}, changeList(entry)),
  );
}

async function load(append) {
  const isCurrent = startLoad();
  const alert = $("audit-error");
  clearError(alert);
  const table = $("audit-table");
  try {
    const query = { limit: PAGE_SIZE, before: append ? oldestId : null };
    const entries = (await api("GET", "/audit", { query })).data;
    if (!isCurrent()) return;
    if (!append) {
      table.replaceChildren(
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["When", "Actor", "Action", "Target", "Change"].map((label) =>
              h("th", { scope: "col", text: label }),
            ),
          ),
        ),
        h("tbody", {}),
      );
    }
    const tbody = table.querySelector("tbody");
    tbody.append(...entries.map(entryRow));
    if (tbody.children.length === 0)
      tbody.append(h("tr", {}, h("td", { colspan: 5, class: "empty", text: "No changes recorded yet." })));
    oldestId = entries.length > 0 ? entries[entries.length - 1].id : oldestId;
    $("audit-more").hidden = entries.length < PAGE_SIZE;
  } catch (err) {
    showError(alert, err);
  }
}

$("audit-more").addEventListener("click", () => load(true));

export const auditView = {
  show() {
    oldestId = null;
    load(false);
  },
};

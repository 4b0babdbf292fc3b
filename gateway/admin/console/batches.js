// A tenant's batches (status, line counts, result files) and files (uploads and batch
// results), read-only: the latest of each, newest first.

import { api } from "./api.js";
import { formatBytes, formatInt, formatTime, h, showError } from "./dom.js";

function table(id, labels, rows, empty) {
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { id, class: "data" },
      h("thead", {}, h("tr", {}, labels.map((label) => h("th", { scope: "col", text: label })))),
      h(
        "tbody",
        {},
        ...(rows.length > 0
          ? rows
          : [h("tr", {}, h("td", { colspan: labels.length, class: "empty", text: empty }))]),
      ),
    ),
  );
}

function batchRow(batch) {
  const counts = batch.request_counts;
  return h(
    "tr",
    { dataset: { batch: batch.id } },
    h("td", { class: "mono", text: batch.id }),
    h("td", { text: batch.endpoint }),
    h("td", { text: batch.status }),
    h("td", { class: "num", text: `${formatInt(counts.completed)} / ${formatInt(counts.total)}` }),
    h("td", { class: "num", text: formatInt(counts.failed) }),
    h("td", { text: formatTime(batch.created_at) }),
    h("td", { class: "mono", text: [batch.output_file_id, batch.error_file_id].filter(Boolean).join(" ") || "—" }),
  );
}

function fileRow(file) {
  return h(
    "tr",
    { dataset: { file: file.id } },
    h("td", { class: "mono", text: file.id }),
    h("td", { text: file.filename }),
    h("td", { text: file.purpose }),
    h("td", { class: "num", text: formatBytes(file.bytes) }),
    h("td", { text: formatTime(file.created_at) }),
  );
}

// Fills container with the tenant's batches and files.
export async function renderBatches(container, tenant) {
  const base = `/tenants/${encodeURIComponent(tenant.name)}`;
  const alert = h("p", { id: "batches-error", class: "error", role: "alert" });
  container.replaceChildren(
    h("div", { class: "card", role: "group", "aria-labelledby": "batches-title" },
      h("h3", { id: "batches-title", text: "Batches and files" }), alert),
  );
  try {
    const [batches, files] = await Promise.all([
      api("GET", `${base}/batches`),
      api("GET", `${base}/files`),
    ]);
    container.firstChild.append(
      table("batches-table", ["Batch", "Endpoint", "Status", "Done", "Failed", "Created", "Result files"],
        batches.data.map(batchRow), "No batches yet."),
      table("files-table", ["File", "Name", "Purpose", "Size", "Created"],
        files.data.map(fileRow), "No files yet."),
    );
  } catch (err) {
    showError(alert, err);
  }
}

// Usage: tokens and GPU-seconds per tenant per day for a chosen period (charts and a table),
// and the billing export (CSV or JSON Lines) downloaded with the admin token.

import { api, apiFile } from "./api.js";
import { NUM_SERIES_COLOURS, stackedBarChart } from "./charts.js";
import {
  $,
  clearError,
  formatInt,
  formatSeconds,
  formatUsd,
  h,
  latestOnly,
  showError,
  todayUtc,
} from "./dom.js";
import { loadTenants } from "./tenants.js";

const DAY_MS = 86_400_000;
const MAX_CHART_DAYS = 366;
const startLoad = latestOnly();

const COLUMNS = [
  ["Date", (r) => r.date],
  ["Tenant", (r) => r.tenant_name ?? `#${r.tenant_id}`],
  ["Requests", (r) => formatInt(r.num_requests)],
  ["Prompt tokens", (r) => formatInt(r.num_prompt_tokens)],
  ["Cached prompt tokens", (r) => formatInt(r.num_cached_prompt_tokens)],
  ["Completion tokens", (r) => formatInt(r.num_completion_tokens)],
  ["GPU-seconds", (r) => formatSeconds(r.gpu_seconds, 3)],
  ["Recompute GPU-s charged", (r) => formatSeconds(r.recompute_gpu_seconds_charged, 3)],
  ["Amount", (r) => formatUsd(r.amount_usd)],
];

function daysBetween(start, end) {
  const days = [];
  for (
    let t = Date.parse(`${start}T00:00:00Z`);
    t <= Date.parse(`${end}T00:00:00Z`) && days.length < MAX_CHART_DAYS;
    t += DAY_MS
  ) {
    days.push(new Date(t).toISOString().slice(0, 10));
  }
  return days;
}

// One series per tenant (the largest first); past the palette, the rest are summed as "others".
function seriesOf(rows, days, pick) {
  const byTenant = new Map();
  for (const row of rows) {
    const name = row.tenant_name ?? `#${row.tenant_id}`;
    if (!byTenant.has(name)) byTenant.set(name, new Array(days.length).fill(0));
    const index = days.indexOf(row.date);
    if (index !== -1) byTenant.get(name)[index] += pick(row);
  }
  const total = (values) => values.reduce((a, b) => a + b, 0);
  const series = [...byTenant]
    .map(([name, values]) => ({ name, values }))
    .sort((a, b) => total(b.values) - total(a.values));
  if (series.length <= NUM_SERIES_COLOURS) return series;
  const kept = series.slice(0, NUM_SERIES_COLOURS - 1);
  const others = series.slice(NUM_SERIES_COLOURS - 1);
  kept.push({
    name: `${others.length} others`,
    values: days.map((_, i) => total(others.map((s) => s.values[i]))),
  });
  return kept;
}

function renderTable(rows) {
  const sum = (pick) => rows.reduce((total, row) => total + pick(row), 0);
  const totals = {
    date: "Total",
    tenant_name: "",
    num_requests: sum((r) => r.num_requests),
    num_prompt_tokens: sum((r) => r.num_prompt_tokens),
    num_cached_prompt_tokens: sum((r) => r.num_cached_prompt_tokens),
    num_completion_tokens: sum((r) => r.num_completion_tokens),
    gpu_seconds: sum((r) => r.gpu_seconds),
    recompute_gpu_seconds_charged: sum((r) => r.recompute_gpu_seconds_charged),
    amount_usd: sum((r) => r.amount_usd),
  };
  $("usage-table").replaceChildren(
    h("caption", { text: "Usage per tenant per day" }),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        COLUMNS.map(([label], i) => h("th", { scope: "col", class: i > 1 ? "num" : null, text: label })),
      ),
    ),
    h(
      "tbody",
      {},
      rows.map((row) =>
        h(
          "tr",
          { dataset: { tenant: row.tenant_name ?? "" } },
          COLUMNS.map(([, cell], i) => h("td", { class: i > 1 ? "num" : null, text: cell(row) })),
        ),
      ),
    ),
    h(
      "tfoot",
      {},
      h(
        "tr",
        {},
        COLUMNS.map(([, cell], i) =>
          h(i === 0 ? "th" : "td", { class: i > 1 ? "num" : null, text: cell(totals) }),
        ),
      ),
    ),
  );
}

function clearResults() {
  $("usage-charts").replaceChildren();
  $("usage-table").replaceChildren();
}

async function showUsage() {
  const isCurrent = startLoad();
  const form = $("usage-form");
  const alert = $("usage-error");
  clearError(alert, form);
  const start = $("usage-start").value;
  const end = $("usage-end").value;
  if (!start || !end) {
    clearResults();
    return showError(alert, { message: "Choose both dates.", param: start ? "end" : "start" }, form);
  }
  try {
    const { rows } = await api("GET", "/billing/usage", {
      query: { start, end, tenant_id: $("usage-tenant").value },
    });
    if (!isCurrent()) return;
    if (rows.length === 0) {
      clearResults();
      $("usage-charts").append(
        h("p", { class: "empty", text: `No usage recorded from ${start} to ${end}.` }),
      );
      return;
    }
    const days = daysBetween(start, end);
    $("usage-charts").replaceChildren(
      stackedBarChart({
        title: "Tokens (prompt + completion)",
        days,
        series: seriesOf(rows, days, (r) => r.num_prompt_tokens + r.num_completion_tokens),
        format: formatInt,
      }),
      stackedBarChart({
        title: "GPU-seconds",
        days,
        series: seriesOf(rows, days, (r) => r.gpu_seconds),
        format: (v) => formatSeconds(v, 2),
      }),
    );
    renderTable(rows);
  } catch (err) {
    if (!isCurrent()) return;
    clearResults();
    if (err.isMissingRoute)
      showError(alert, {
        message: "This gateway has no billing usage endpoint yet (GET /admin/v1/billing/usage).",
        code: "not_available",
      });
    else showError(alert, err, form);
  }
}

async function download(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const alert = $("export-error");
  const status = $("export-status");
  clearError(alert, form);
  const period = $("export-period").value;
  if (!period) return showError(alert, { message: "Choose a month.", param: "period" }, form);
  const format = $("export-format").value;
  status.textContent = "Preparing the export…";
  try {
    const query = {
      period,
      format,
      tenant_id: $("usage-tenant").value,
      detail: $("export-detail").checked ? "true" : null,
    };
    const { blob, filename } = await apiFile("/billing/export", query);
    // fetch() sent the token header; a Blob URL hands the body to the browser as a download.
    const href = URL.createObjectURL(blob);
    const link = h("a", { href, download: filename ?? `tiergate-usage-${period}.${format}`, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(href), 10_000);
    status.textContent = `Downloaded ${link.download} (${formatInt(blob.size)} bytes).`;
  } catch (err) {
    status.textContent = "";
    if (err.isMissingRoute)
      showError(alert, {
        message: "This gateway has no billing export endpoint yet (GET /admin/v1/billing/export).",
        code: "not_available",
      });
    else showError(alert, err, form);
  }
}

async function fillTenantChoice() {
  const select = $("usage-tenant");
  const chosen = select.value;
  const tenants = await loadTenants();
  select.replaceChildren(
    h("option", { value: "", text: "All tenants" }),
    ...tenants.map((t) => h("option", { value: t.id, selected: String(t.id) === chosen, text: t.name })),
  );
}

$("usage-form").addEventListener("submit", (event) => {
  event.preventDefault();
  showUsage();
});
$("export-form").addEventListener("submit", download);

export const usageView = {
  async show() {
    const today = todayUtc();
    if (!$("usage-start").value) $("usage-start").value = `${today.slice(0, 8)}01`;
    if (!$("usage-end").value) $("usage-end").value = today;
    if (!$("export-period").value) $("export-period").value = today.slice(0, 7);
    try {
      await fillTenantChoice();
    } catch (err) {
      return showError($("usage-error"), err);
    }
    await showUsage();
  },
};

// The tenants view: a sortable table (tier, status, quotas, today's usage, this month's
// spend against the budget) and the form that creates a tenant.

import { api } from "./api.js";
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

export const DEFAULT_TIERS = ["premium", "standard", "batch"];
const USD_MICROS = 1e6;

// Tenants with their usage figures, as the table shows them.
let rows = [];
let sort = { key: "name", direction: 1 };
const startLoad = latestOnly();

function tierRank(tier) {
  const index = DEFAULT_TIERS.indexOf(tier);
  return index === -1 ? DEFAULT_TIERS.length : index;
}

// Unlimited (null) quotas sort above every number.
function limit(value) {
  return value === null || value === undefined ? Infinity : value;
}

function quotaText(value) {
  return value === null || value === undefined ? "no limit" : formatInt(value);
}

function spendCell(row) {
  const budget = row.quota.monthly_spend_budget_usd_micros;
  if (budget === null || budget === undefined) {
    return h(
      "td",
      { class: "num" },
      `${formatUsd(row.spendMonthUsd)} `,
      h("span", { class: "muted", text: "no budget" }),
    );
  }
  const budgetUsd = budget / USD_MICROS;
  const label = `${formatUsd(row.spendMonthUsd)} of ${formatUsd(budgetUsd)}`;
  return h(
    "td",
    { class: "num" },
    label,
    h("meter", {
      min: 0,
      max: Math.max(budgetUsd, 1e-9),
      high: budgetUsd * 0.8,
      optimum: 0,
      value: Math.min(row.spendMonthUsd ?? 0, budgetUsd),
      "aria-label": `${row.name} spend this month: ${label}`,
    }),
  );
}

const COLUMNS = [
  {
    key: "name",
    label: "Name",
    value: (r) => r.name,
    cell: (r) =>
      h("th", { scope: "row" }, h("a", { href: `#tenant/${encodeURIComponent(r.name)}`, text: r.name })),
  },
  { key: "tier", label: "Tier", value: (r) => tierRank(r.tier), cell: (r) => h("td", { text: r.tier }) },
  {
    key: "weight",
    label: "Weight",
    num: true,
    value: (r) => r.weight,
    cell: (r) => h("td", { class: "num", text: r.weight }),
  },
  {
    key: "status",
    label: "Status",
    value: (r) => r.status,
    cell: (r) => h("td", {}, h("span", { class: `badge ${r.status}`, text: r.status })),
  },
  {
    key: "rpm",
    label: "Requests/min",
    num: true,
    value: (r) => limit(r.quota.requests_per_minute),
    cell: (r) => h("td", { class: "num", text: quotaText(r.quota.requests_per_minute) }),
  },
  {
    key: "tpm",
    label: "Tokens/min",
    num: true,
    value: (r) => limit(r.quota.tokens_per_minute),
    cell: (r) => h("td", { class: "num", text: quotaText(r.quota.tokens_per_minute) }),
  },
  {
    key: "concurrency",
    label: "Concurrent",
    num: true,
    value: (r) => limit(r.quota.max_concurrent_requests),
    cell: (r) => h("td", { class: "num", text: quotaText(r.quota.max_concurrent_requests) }),
  },
  {
    key: "tokensToday",
    label: "Tokens today",
    num: true,
    value: (r) => r.tokensToday ?? -1,
    cell: (r) => h("td", { class: "num", text: formatInt(r.tokensToday) }),
  },
  {
    key: "gpuToday",
    label: "GPU-seconds today",
    num: true,
    value: (r) => r.gpuSecondsToday ?? -1,
    cell: (r) =>
      h("td", { class: "num", text: r.gpuSecondsToday === null ? "—" : formatSeconds(r.gpuSecondsToday, 3) }),
  },
  {
    key: "spend",
    label: "Spend this month",
    num: true,
    value: (r) => r.spendMonthUsd ?? -1,
    cell: spendCell,
  },
];

function compare(a, b) {
  const column = COLUMNS.find((c) => c.key === sort.key);
  const [x, y] = [column.value(a), column.value(b)];
  const order = x < y ? -1 : x > y ? 1 : a.name.localeCompare(b.name);
  return order * sort.direction;
}

function sortBy(key) {
  sort = { key, direction: sort.key === key ? -sort.direction : 1 };
  renderTable();
  // Keep the focus on the header the user just pressed.
  $("tenants-table").querySelector(`th[data-key="${key}"] button`)?.focus();
}

function headerCell(column) {
  const active = sort.key === column.key;
  const direction = sort.direction === 1 ? "ascending" : "descending";
  return h(
    "th",
    {
      scope: "col",
      class: column.num ? "num" : null,
      "aria-sort": active ? direction : null,
      dataset: { key: column.key },
    },
    h(
      "button",
      { type: "button", class: "sort", onclick: () => sortBy(column.key) },
      column.label,
      h("span", {
        class: "sort-mark",
        "aria-hidden": "true",
        text: active ? (sort.direction === 1 ? " ▲" : " ▼") : "",
      }),
    ),
  );
}

function renderTable() {
  const table = $("tenants-table");
  const sorted = [...rows].sort(compare);
  table.replaceChildren(
    h("caption", { class: "visually-hidden", text: "Tenants; column headers sort the table" }),
    h("thead", {}, h("tr", {}, COLUMNS.map(headerCell))),
    h(
      "tbody",
      {},
      sorted.length === 0
        ? h(
            "tr",
            {},
            h("td", { colspan: COLUMNS.length, class: "empty", text: "No tenants yet: create one below." }),
          )
        : sorted.map((row) =>
            h(
              "tr",
              { dataset: { tenant: row.name } },
              COLUMNS.map((c) => c.cell(row)),
            ),
          ),
    ),
  );
}

// This month's usage rows (UTC), or a note saying why the usage columns are empty.
async function loadUsage() {
  const today = todayUtc();
  try {
    const body = await api("GET", "/billing/usage", {
      query: { start: `${today.slice(0, 8)}01`, end: today },
    });
    return { usage: body.rows, note: "" };
  } catch (err) {
    const reason = err.isMissingRoute ? "this gateway has no billing usage endpoint" : err.message;
    return { usage: null, note: `Usage and spend columns are empty: ${reason}.` };
  }
}

function withUsage(tenant, usage) {
  const today = todayUtc();
  const mine = (usage ?? []).filter((row) => row.tenant_id === tenant.id);
  const todays = mine.filter((row) => row.date === today);
  const sum = (list, pick) => list.reduce((total, row) => total + pick(row), 0);
  return {
    ...tenant,
    tokensToday: usage === null ? null : sum(todays, (r) => r.num_prompt_tokens + r.num_completion_tokens),
    gpuSecondsToday: usage === null ? null : sum(todays, (r) => r.gpu_seconds),
    spendMonthUsd: usage === null ? null : sum(mine, (r) => r.amount_usd),
  };
}

export async function loadTenants() {
  return (await api("GET", "/tenants")).data;
}

export function tierOptions(select, tenants, selected) {
  const tiers = [...new Set([...DEFAULT_TIERS, ...tenants.map((t) => t.tier)])];
  select.replaceChildren(
    ...tiers.map((tier) => h("option", { value: tier, selected: tier === selected, text: tier })),
  );
}

async function refresh() {
  const isCurrent = startLoad();
  const alert = $("tenants-error");
  clearError(alert);
  try {
    const [tenants, { usage, note }] = await Promise.all([loadTenants(), loadUsage()]);
    if (!isCurrent()) return;
    rows = tenants.map((tenant) => withUsage(tenant, usage));
    $("tenants-usage-note").textContent = note;
    renderTable();
    tierOptions($("create-tier"), tenants, $("create-tier").value || "standard");
  } catch (err) {
    showError(alert, err);
  }
}

async function createTenant(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const alert = $("create-tenant-error");
  clearError(alert, form);
  const body = { name: $("create-name").value.trim(), tier: $("create-tier").value };
  const weight = $("create-weight");
  if (weight.validity.badInput) {
    showError(alert, { message: "weight must be a number", param: "weight" }, form);
    return;
  }
  if (weight.value !== "") body.weight = Number(weight.value);
  try {
    const tenant = await api("POST", "/tenants", { body });
    form.reset();
    location.hash = `#tenant/${encodeURIComponent(tenant.name)}`;
  } catch (err) {
    showError(alert, err, form);
  }
}

$("create-tenant-form").addEventListener("submit", createTenant);
// The form is usable before the first load returns: the default tiers are there at once.
tierOptions($("create-tier"), [], "standard");

export const tenantsView = {
  show() {
    refresh();
  },
};

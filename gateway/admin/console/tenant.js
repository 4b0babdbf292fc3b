// One tenant: edit its tier, weight and every quota; disable or enable it; its API keys; the
// LoRA adapters it owns or was granted.

import { renderTenantAdapters } from "./adapters.js";
import { api } from "./api.js";
import { may } from "./grants.js";
import { $, clearError, formatTime, h, latestOnly, showError } from "./dom.js";
import { renderBatches } from "./batches.js";
import { renderKeys } from "./keys.js";
import { loadTenants, tierOptions } from "./tenants.js";

const USD_MICROS = 1e6;
const SPEND_BUDGET = "monthly_spend_budget_usd_micros";
const startLoad = latestOnly();

// Labels for the quota fields the API knows today; a field added later shows its raw name.
const QUOTA_LABELS = {
  requests_per_minute: "Requests per minute",
  tokens_per_minute: "Tokens per minute",
  burst_requests: "Burst requests",
  burst_tokens: "Burst tokens",
  max_concurrent_requests: "Max concurrent requests",
  max_queued_requests: "Max queued requests",
  monthly_token_budget: "Monthly token budget",
  [SPEND_BUDGET]: "Monthly spend budget (USD)",
  kv_cap_share: "KV cache cap (share of blocks, 0–1]",
  file_storage_bytes: "File storage (bytes)",
};

// The value a quota input shows for the stored value, and the value sent back for an input.
function toInput(field, value) {
  if (value === null || value === undefined) return "";
  return field === SPEND_BUDGET ? String(value / USD_MICROS) : String(value);
}

function fromInput(field, input) {
  if (input.value.trim() === "") return null;
  const number = Number(input.value);
  return field === SPEND_BUDGET ? Math.round(number * USD_MICROS) : number;
}

function quotaField(field, value) {
  const id = `quota-${field}`;
  const isShare = field === "kv_cap_share";
  return h(
    "div",
    { class: "field" },
    h("label", { for: id, text: QUOTA_LABELS[field] ?? field }),
    h("input", {
      id,
      name: field,
      type: "number",
      min: 0,
      max: isShare ? 1 : null,
      step: isShare || field === SPEND_BUDGET ? "any" : 1,
      value: toInput(field, value),
      placeholder: "no limit",
      "aria-describedby": "quota-hint",
      dataset: { param: `quota.${field}`, quota: field },
    }),
  );
}

// The fields of the form that differ from the tenant as loaded (PATCH sends only those).
function changes(form, tenant) {
  const body = {};
  const badInput = [...form.querySelectorAll("input")].find((input) => input.validity.badInput);
  if (badInput)
    return {
      error: { message: "enter a number, or leave it empty for no limit", param: badInput.dataset.param },
    };
  const tier = form.querySelector("#edit-tier").value;
  if (tier !== tenant.tier) body.tier = tier;
  const weight = Number(form.querySelector("#edit-weight").value);
  if (weight !== tenant.weight) body.weight = weight;
  const models = form.querySelector("#edit-models").value.trim();
  if (models !== modelsText(tenant)) body.allowed_models = parseModels(models);
  const quota = {};
  for (const input of form.querySelectorAll("input[data-quota]")) {
    const field = input.dataset.quota;
    const value = fromInput(field, input);
    if (value !== tenant.quota[field]) quota[field] = value;
  }
  if (Object.keys(quota).length > 0) body.quota = quota;
  return { body };
}

// The served models a tenant may use as the form shows them: comma-separated, empty for every
// model (an empty list, no model at all, is set with the API or the CLI).
function modelsText(tenant) {
  return tenant.allowed_models === null ? "" : tenant.allowed_models.join(", ");
}

function parseModels(text) {
  if (text === "") return null;
  return text.split(",").map((name) => name.trim()).filter((name) => name !== "");
}

function editForm(tenant, tenants) {
  const tierSelect = h("select", { id: "edit-tier", name: "tier", dataset: { param: "tier" } });
  tierOptions(tierSelect, tenants, tenant.tier);
  const alert = h("p", { id: "edit-error", class: "error", role: "alert" });
  const form = h(
    "form",
    { id: "edit-tenant-form", class: "card", novalidate: true, "aria-labelledby": "edit-title" },
    h("h3", { id: "edit-title", text: "Tier, weight, models and quotas" }),
    h(
      "div",
      { class: "row" },
      h("div", { class: "field" }, h("label", { for: "edit-tier", text: "Tier" }), tierSelect),
      h(
        "div",
        { class: "field" },
        h("label", { for: "edit-weight", text: "Fair-share weight" }),
        h("input", {
          id: "edit-weight",
          name: "weight",
          type: "number",
          min: 0,
          step: "any",
          value: tenant.weight,
          dataset: { param: "weight" },
        }),
      ),
      h(
        "div",
        { class: "field" },
        h("label", { for: "edit-models", text: "Allowed models" }),
        h("input", {
          id: "edit-models",
          name: "allowed_models",
          type: "text",
          placeholder: "every model",
          value: modelsText(tenant),
          "aria-describedby": "models-hint",
          dataset: { param: "allowed_models" },
        }),
      ),
    ),
    h("p", { id: "models-hint", class: "hint", text: "Served models, comma-separated; empty: every model." }),
    h("p", { id: "quota-hint", class: "hint", text: "Leave a quota empty for no limit." }),
    h(
      "div",
      { class: "grid" },
      Object.entries(tenant.quota).map(([field, value]) => quotaField(field, value)),
    ),
    alert,
    h("button", { type: "submit", text: "Save changes", dataset: { needs: "operator" } }),
  );
  // A role that may not change tenants still sees the values, in fields it cannot edit.
  if (!may("operator")) for (const field of form.elements) field.disabled = true;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearError(alert, form);
    $("tenant-status").textContent = "";
    const { body, error } = changes(form, tenant);
    if (error) return showError(alert, error, form);
    if (Object.keys(body).length === 0) {
      $("tenant-status").textContent = "Nothing changed.";
      return;
    }
    try {
      const updated = await api("PATCH", `/tenants/${encodeURIComponent(tenant.name)}`, { body });
      await render(updated, "Saved.");
    } catch (err) {
      showError(alert, err, form);
    }
  });
  return form;
}

function statusPanel(tenant) {
  const active = tenant.status === "active";
  const alert = h("p", { id: "status-error", class: "error", role: "alert" });
  const toggle = async () => {
    clearError(alert);
    try {
      const action = active ? "disable" : "enable";
      const updated = await api("POST", `/tenants/${encodeURIComponent(tenant.name)}/${action}`);
      await render(updated, active ? "Tenant disabled." : "Tenant enabled.");
    } catch (err) {
      showError(alert, err);
    }
  };
  return h(
    "div",
    { class: "card", "aria-labelledby": "status-title", role: "group" },
    h("h3", { id: "status-title", text: "Status" }),
    h(
      "p",
      {},
      "This tenant is ",
      h("span", { class: `badge ${tenant.status}`, text: tenant.status }),
      active ? ": its keys are accepted." : ": its keys get 403 until it is enabled again.",
    ),
    alert,
    h("button", {
      type: "button",
      id: "status-toggle",
      dataset: { needs: "operator" },
      class: active ? "danger" : null,
      onclick: toggle,
      text: active ? "Disable tenant" : "Enable tenant",
    }),
  );
}

function summary(tenant) {
  const item = (term, value) => [h("dt", { text: term }), h("dd", { text: value })];
  return h(
    "dl",
    { class: "summary" },
    item("ID", tenant.id),
    item("Status", tenant.status),
    item("Tier", tenant.tier),
    item("Created", formatTime(tenant.created_at)),
    item("Updated", formatTime(tenant.updated_at)),
  );
}

async function render(tenant, message = "", isCurrent = startLoad()) {
  const tenants = await loadTenants();
  if (!isCurrent()) return;
  $("tenant-title").textContent = `Tenant ${tenant.name}`;
  const body = $("tenant-body");
  body.replaceChildren(
    summary(tenant),
    editForm(tenant, tenants),
    statusPanel(tenant),
    h("div", { id: "keys-panel" }),
    h("div", { id: "tenant-adapters-panel" }),
    h("div", { id: "batches-panel" }),
  );
  $("tenant-status").textContent = message;
  await Promise.all([
    renderKeys($("keys-panel"), tenant),
    renderTenantAdapters($("tenant-adapters-panel"), tenant, tenants),
    renderBatches($("batches-panel"), tenant),
  ]);
}

export const tenantView = {
  async show(name) {
    const alert = $("tenant-error");
    clearError(alert);
    $("tenant-status").textContent = "";
    $("tenant-title").textContent = `Tenant ${name}`;
    $("tenant-body").replaceChildren();
    const isCurrent = startLoad();
    try {
      const tenant = await api("GET", `/tenants/${encodeURIComponent(name)}`);
      if (isCurrent()) await render(tenant, "", isCurrent);
    } catch (err) {
      if (isCurrent()) showError(alert, err);
    }
  },
};

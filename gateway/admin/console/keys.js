// A tenant's API keys: issue one (its plaintext is shown once, with a copy button), list
// them filtered by prefix with their expiry and own model list, rotate one (a new secret under the same id, the
// old one working for a grace given inline), revoke one after an inline confirmation.

import { api } from "./api.js";
import { clearError, formatTime, h, showError } from "./dom.js";

const DEFAULT_GRACE_S = 3600;

function newKeyPanel(created, onDone) {
  const copied = h("span", { class: "status", role: "status" });
  const value = h("input", {
    id: "new-key-value",
    readonly: true,
    value: created.key,
    class: "secret",
    spellcheck: "false",
  });
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(created.key);
      copied.textContent = "Copied.";
    } catch {
      value.select();
      copied.textContent = "Copying is blocked here: the key is selected, press Ctrl+C.";
    }
  };
  return h(
    "div",
    { id: "new-key", class: "card notice", role: "group", "aria-labelledby": "new-key-title" },
    h("h4", { id: "new-key-title", text: `New key ${created.name}` }),
    h("p", {}, h("strong", { text: "Copy it now: " }), "it is never shown again, only its prefix is kept."),
    h("label", { for: "new-key-value", text: "API key" }),
    h(
      "div",
      { class: "row" },
      value,
      h("button", { type: "button", id: "copy-key", onclick: copy, text: "Copy" }),
      h("button", { type: "button", class: "secondary", onclick: onDone, text: "Done" }),
    ),
    copied,
  );
}

function stateBadges(key) {
  if (key.revoked_at) return [h("span", { class: "badge revoked", text: `revoked ${formatTime(key.revoked_at)}` })];
  const now = Date.now();
  const expired = key.expires_at && Date.parse(key.expires_at) <= now;
  const badges = [
    expired
      ? h("span", { class: "badge revoked", text: `expired ${formatTime(key.expires_at)}` })
      : h("span", { class: "badge active", text: "active" }),
  ];
  if (key.expires_at && !expired)
    badges.push(h("span", { class: "muted", text: ` until ${formatTime(key.expires_at)}` }));
  if (key.previous_expires_at && Date.parse(key.previous_expires_at) > now)
    badges.push(h("span", { class: "muted", text: `; old secret until ${formatTime(key.previous_expires_at)}` }));
  // Its own list, within the tenant's (none: the tenant's).
  if (key.allowed_models)
    badges.push(h("span", { class: "muted", text: `; models: ${key.allowed_models.join(", ") || "none"}` }));
  // Its own limits, binding before the tenant's (none set: only the tenant's apply).
  const limits = keyLimitsText(key);
  if (limits) badges.push(h("span", { class: "muted key-limits", text: `; limits: ${limits}` }));
  return badges;
}

function keyLimitsText(key) {
  const parts = [];
  if (key.requests_per_minute != null) parts.push(`${key.requests_per_minute} RPM`);
  if (key.tokens_per_minute != null) parts.push(`${key.tokens_per_minute} TPM`);
  if (key.monthly_token_budget != null) parts.push(`${key.monthly_token_budget} tokens/month`);
  if (key.monthly_spend_budget_usd_micros != null)
    parts.push(`$${(key.monthly_spend_budget_usd_micros / 1e6).toFixed(2)}/month`);
  return parts.join(", ");
}

function keyRow(key, revoke, rotate) {
  const actions = h("td", {});
  const askRotation = () => {
    const id = `grace-${key.id}`;
    const grace = h("input", { id, type: "number", min: 0, step: 1, value: DEFAULT_GRACE_S });
    actions.replaceChildren(
      h("label", { for: id, text: "Old secret works for (s) " }),
      grace,
      " ",
      h("button", {
        type: "button",
        onclick: () => rotate(key, Number(grace.value)),
        text: "Rotate",
        "aria-label": `Confirm: rotate key ${key.prefix}`,
      }),
      " ",
      h("button", { type: "button", class: "secondary", onclick: reset, text: "Cancel" }),
    );
    grace.focus();
  };
  const confirm = () => {
    actions.replaceChildren(
      h("span", { text: "Revoke for good? " }),
      h("button", {
        type: "button",
        class: "danger",
        onclick: () => revoke(key),
        text: "Revoke",
        "aria-label": `Confirm: revoke key ${key.prefix}`,
      }),
      " ",
      h("button", { type: "button", class: "secondary", onclick: reset, text: "Cancel" }),
    );
    actions.querySelector("button").focus();
  };
  const reset = () => {
    actions.replaceChildren(
      key.revoked_at
        ? h("span", { class: "muted", text: "—" })
        : h(
            "span",
            { dataset: { needs: "operator" } },
            h("button", {
              type: "button",
              class: "secondary",
              onclick: askRotation,
              text: "Rotate…",
              "aria-label": `Rotate key ${key.prefix}`,
            }),
            " ",
            h("button", {
              type: "button",
              class: "secondary",
              onclick: confirm,
              text: "Revoke…",
              "aria-label": `Revoke key ${key.prefix}`,
            }),
          ),
    );
  };
  reset();
  return h(
    "tr",
    { dataset: { prefix: key.prefix } },
    h("th", { scope: "row" }, h("code", { text: key.prefix })),
    h("td", { text: key.name }),
    h("td", { text: formatTime(key.created_at) }),
    h("td", { text: formatTime(key.last_used_at) }),
    h("td", {}, ...stateBadges(key)),
    actions,
  );
}

// Fills container with the keys section of tenant.
export async function renderKeys(container, tenant) {
  const base = `/tenants/${encodeURIComponent(tenant.name)}/keys`;
  const alert = h("p", { id: "keys-error", class: "error", role: "alert" });
  const slot = h("div", {});
  const tbody = h("tbody", {});
  const filter = h("input", { id: "key-filter", type: "search", autocomplete: "off", placeholder: "tg-…" });
  let keys = [];

  const renderRows = () => {
    const prefix = filter.value.trim();
    const shown = keys.filter((key) => key.prefix.startsWith(prefix));
    tbody.replaceChildren(
      ...(shown.length > 0
        ? shown.map((key) => keyRow(key, revoke, rotate))
        : [
            h(
              "tr",
              {},
              h("td", {
                colspan: 6,
                class: "empty",
                text: keys.length ? "No key starts with that prefix." : "No keys yet.",
              }),
            ),
          ]),
    );
  };
  const reload = async () => {
    try {
      keys = (await api("GET", base)).data;
      renderRows();
    } catch (err) {
      showError(alert, err);
    }
  };
  async function revoke(key) {
    clearError(alert);
    try {
      await api("DELETE", `/keys/${key.id}`);
      await reload();
      filter.focus();
    } catch (err) {
      showError(alert, err);
    }
  }

  // The new secret is shown once, as an issued key is.
  async function rotate(key, graceSeconds) {
    clearError(alert);
    try {
      const rotated = await api("POST", `/keys/${key.id}/rotate`, { body: { grace_seconds: graceSeconds } });
      slot.replaceChildren(newKeyPanel(rotated, () => slot.replaceChildren()));
      document.getElementById("new-key-value").focus();
      await reload();
    } catch (err) {
      showError(alert, err);
    }
  }

  const nameInput = h("input", {
    id: "key-name",
    name: "name",
    autocomplete: "off",
    value: "default",
    dataset: { param: "name" },
  });
  const form = h(
    "form",
    { id: "issue-key-form", class: "row", novalidate: true, dataset: { needs: "operator" } },
    h("div", { class: "field" }, h("label", { for: "key-name", text: "Key name" }), nameInput),
    h("div", { class: "field actions" }, h("button", { type: "submit", text: "Issue key" })),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearError(alert, form);
    try {
      const created = await api("POST", base, { body: { name: nameInput.value.trim() } });
      // The plaintext lives only in this panel; Done (or leaving the page) drops it.
      const done = () => {
        slot.replaceChildren();
        nameInput.focus();
      };
      slot.replaceChildren(newKeyPanel(created, done));
      document.getElementById("new-key-value").focus();
      await reload();
    } catch (err) {
      showError(alert, err, form);
    }
  });
  filter.addEventListener("input", renderRows);

  container.replaceChildren(
    h(
      "div",
      { class: "card", role: "group", "aria-labelledby": "keys-title" },
      h("h3", { id: "keys-title", text: "API keys" }),
      form,
      alert,
      slot,
      h("div", { class: "field" }, h("label", { for: "key-filter", text: "Filter by prefix" }), filter),
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          { id: "keys-table", class: "data" },
          h(
            "thead",
            {},
            h(
              "tr",
              {},
              ["Prefix", "Name", "Created", "Last used", "State", "Action"].map((label) =>
                h("th", { scope: "col", text: label }),
              ),
            ),
          ),
          tbody,
        ),
      ),
    ),
  );
  await reload();
}

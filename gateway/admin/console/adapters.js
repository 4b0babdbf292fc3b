// LoRA adapters of the served models: the registered ones (base model, owner, sharing, rank, targets, size),
// registering one from an uploaded archive, changing who it is shared with, and removing one.
// Removing waits for the requests running on the adapter on this replica; when they outlast
// the server's wait (202), the adapter takes no new requests and stays listed here as
// "removing" until a later removal finishes it. A tenant's view lists the adapters it may use.

import { api } from "./api.js";
import { $, clearError, formatBytes, formatInt, formatTime, h, latestOnly, showError } from "./dom.js";
import { loadTenants } from "./tenants.js";

const COLUMNS = [
  "Name", "Base model", "Owner", "Shared with", "Rank", "Targets", "Size", "Pinned", "Created", "Action",
];
const NUMERIC = new Set(["Rank", "Size"]);
const startLoad = latestOnly();

// The last load: live adapters, and every tenant (owner and sharing are tenant ids).
let adapters = [];
let tenants = [];
// Adapters whose removal answered 202 in this tab, by name, with their last snapshot: the
// API lists them no more (they take no new requests), so each is read by name until a
// removal finishes it or it is gone.
const removing = new Map();

const byName = (a, b) => a.name.localeCompare(b.name);

function tenantOf(id, from = tenants) {
  return from.find((tenant) => tenant.id === id) ?? null;
}

function tenantName(id, from = tenants) {
  return tenantOf(id, from)?.name ?? `#${id}`;
}

function tenantLink(id, from = tenants) {
  const tenant = tenantOf(id, from);
  if (!tenant) return h("span", { text: `#${id}` });
  return h("a", { href: `#tenant/${encodeURIComponent(tenant.name)}`, text: tenant.name });
}

function sharedCell(adapter) {
  if (adapter.shared_with.length === 0) return h("td", {}, h("span", { class: "muted", text: "nobody" }));
  const ids = [...adapter.shared_with].sort((a, b) => tenantName(a).localeCompare(tenantName(b)));
  return h(
    "td",
    {},
    ids.flatMap((id, i) => (i === 0 ? [tenantLink(id)] : [", ", tenantLink(id)])),
  );
}

function setStatus(text, tone = null) {
  const status = $("adapters-status");
  status.textContent = text;
  status.classList.toggle("warn", tone === "warn");
}

function focusRowButton(name) {
  $("adapters-table").querySelector(`tr[data-adapter="${CSS.escape(name)}"] button`)?.focus();
}

// One checkbox per candidate tenant (its value is the tenant's name), checked when its id is in
// checkedIds.
function tenantPicks(idPrefix, candidates, checkedIds) {
  if (candidates.length === 0) return [h("p", { class: "hint", text: "There is no other tenant." })];
  return [...candidates].sort(byName).map((tenant) => {
    const id = `${idPrefix}-${tenant.id}`;
    return h(
      "div",
      { class: "field checkbox" },
      h("input", {
        id,
        type: "checkbox",
        value: tenant.name,
        checked: checkedIds.has(tenant.id),
        dataset: { tenantId: tenant.id },
      }),
      h("label", { for: id, text: tenant.name }),
    );
  });
}

function checkedBoxes(container) {
  return [...container.querySelectorAll("input[type=checkbox]:checked")];
}

// --- the table ------------------------------------------------------------------------------

function adapterRow(adapter) {
  const label = `adapter ${adapter.name}`;
  const actions = h("td", { class: "actions" });
  const confirm = () => {
    actions.replaceChildren(
      h("span", { text: "Remove for good? " }),
      h("button", {
        type: "button",
        class: "danger",
        onclick: () => remove(adapter.name, actions),
        text: "Remove",
        "aria-label": `Confirm: remove ${label}`,
      }),
      " ",
      h("button", {
        type: "button",
        class: "secondary",
        onclick: () => {
          reset();
          actions.querySelector("button").focus();
        },
        text: "Cancel",
      }),
    );
    actions.querySelector("button").focus();
  };
  const reset = () => {
    actions.replaceChildren(
      h("button", {
        type: "button",
        class: "secondary",
        onclick: () => openSharing(adapter),
        dataset: { needs: "operator" },
        text: "Sharing…",
        "aria-label": `Edit sharing of ${label}`,
      }),
      " ",
      h("button", {
        type: "button",
        class: "secondary",
        onclick: () => setPinned(adapter, !adapter.pinned),
        dataset: { needs: "operator" },
        text: adapter.pinned ? "Unpin" : "Pin",
        "aria-label": `${adapter.pinned ? "Unpin" : "Pin"} ${label}`,
      }),
      " ",
      h("button", {
        type: "button",
        class: "secondary",
        onclick: confirm,
        dataset: { needs: "operator" },
        text: "Remove…",
        "aria-label": `Remove ${label}`,
      }),
    );
  };
  reset();
  return h(
    "tr",
    { dataset: { adapter: adapter.name } },
    h("th", { scope: "row" }, h("code", { text: adapter.name })),
    ...detailCells(adapter),
    actions,
  );
}

// The cells every row of an adapter shows between its name and its actions.
function detailCells(adapter) {
  return [
    h("td", { text: adapter.base_model }),
    h("td", {}, tenantLink(adapter.owner_tenant_id)),
    sharedCell(adapter),
    h("td", { class: "num", text: formatInt(adapter.rank) }),
    h("td", { text: adapter.targets.join(", ") }),
    h("td", { class: "num", text: formatBytes(adapter.size_bytes) }),
    h("td", { text: adapter.pinned ? "pinned" : "" }),
    h("td", { text: formatTime(adapter.created_at) }),
  ];
}

// An adapter being removed: no sharing to edit (it takes no new requests), a removal to finish.
function removingRow(adapter) {
  const running = adapter.running_here ?? 0;
  const actions = h(
    "td",
    { class: "actions" },
    h("span", {
      class: "muted",
      text: `${formatInt(running)} request${running === 1 ? "" : "s"} running here `,
    }),
    h("button", {
      type: "button",
      class: "danger",
      onclick: () => remove(adapter.name, actions),
      dataset: { needs: "operator" },
      text: "Finish removing",
      "aria-label": `Finish removing adapter ${adapter.name}`,
    }),
  );
  return h(
    "tr",
    { dataset: { adapter: adapter.name, state: "removing" } },
    h(
      "th",
      { scope: "row" },
      h("code", { text: adapter.name }),
      " ",
      h("span", { class: "badge pending", text: "removing" }),
    ),
    ...detailCells(adapter),
    actions,
  );
}

function renderTable() {
  const rows = [
    ...[...adapters].sort(byName).map(adapterRow),
    ...[...removing.values()].sort(byName).map(removingRow),
  ];
  $("adapters-table").replaceChildren(
    h("caption", { class: "visually-hidden", text: "Registered LoRA adapters" }),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        COLUMNS.map((label) =>
          h("th", { scope: "col", class: NUMERIC.has(label) ? "num" : null, text: label }),
        ),
      ),
    ),
    h(
      "tbody",
      {},
      rows.length > 0
        ? rows
        : h(
            "tr",
            {},
            h("td", {
              colspan: COLUMNS.length,
              class: "empty",
              text: "No adapters yet: register one below.",
            }),
          ),
    ),
  );
}

// --- sharing --------------------------------------------------------------------------------

function openSharing(adapter) {
  const slot = $("adapters-share-slot");
  const alert = h("p", { id: "share-adapter-error", class: "error", role: "alert" });
  const candidates = tenants.filter((tenant) => tenant.id !== adapter.owner_tenant_id);
  const fieldset = h(
    "fieldset",
    { tabindex: -1, dataset: { param: "shared_with" } },
    h("legend", { text: "Shared with" }),
    h("div", { class: "picks" }, tenantPicks("share", candidates, new Set(adapter.shared_with))),
  );
  const close = () => {
    slot.replaceChildren();
    focusRowButton(adapter.name);
  };
  const form = h(
    "form",
    {
      id: "share-adapter-form",
      class: "card",
      novalidate: true,
      "aria-labelledby": "share-adapter-title",
      dataset: { adapter: adapter.name },
    },
    h("h3", { id: "share-adapter-title", text: `Sharing of adapter ${adapter.name}` }),
    h("p", {
      class: "hint",
      text:
        `Its owner ${tenantName(adapter.owner_tenant_id)} may always use it; ` +
        "so may the tenants checked here.",
    }),
    fieldset,
    alert,
    h(
      "div",
      { class: "row" },
      h("button", { type: "submit", text: "Save sharing" }),
      h("button", { type: "button", class: "secondary", onclick: close, text: "Cancel" }),
    ),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearError(alert, form);
    const sharedWith = checkedBoxes(fieldset).map((box) => box.value);
    try {
      await api("PATCH", `/adapters/${encodeURIComponent(adapter.name)}`, {
        body: { shared_with: sharedWith },
      });
      slot.replaceChildren();
      setStatus(`Sharing of adapter ${adapter.name} saved.`);
      await refresh();
      focusRowButton(adapter.name);
    } catch (err) {
      showError(alert, err, form);
    }
  });
  slot.replaceChildren(form);
  (form.querySelector("input") ?? form.querySelector("button")).focus();
}

// --- pinning --------------------------------------------------------------------------------

// A pinned adapter stays in the engines' host caches once loaded (at most --max-cpu-loras less
// --max-loras of a base model: past that, a 400 says to unpin one first).
async function setPinned(adapter, pinned) {
  const alert = $("adapters-error");
  clearError(alert);
  try {
    await api("PATCH", `/adapters/${encodeURIComponent(adapter.name)}`, { body: { pinned } });
    setStatus(`Adapter ${adapter.name} ${pinned ? "pinned" : "unpinned"}.`);
    await refresh();
  } catch (err) {
    showError(alert, err);
  }
}

// --- removing -------------------------------------------------------------------------------

async function remove(name, actions) {
  const alert = $("adapters-error");
  clearError(alert);
  for (const button of actions.querySelectorAll("button")) button.disabled = true;
  const slot = $("adapters-share-slot");
  if (slot.querySelector("form")?.dataset.adapter === name) slot.replaceChildren();
  setStatus(`Removing adapter ${name}: waiting for the requests running on it to end…`);
  try {
    const result = await api("DELETE", `/adapters/${encodeURIComponent(name)}`);
    if (result.deleted) {
      removing.delete(name);
      setStatus(`Adapter ${name} removed.`);
    } else {
      const running = result.running_here ?? 0;
      removing.set(name, result);
      setStatus(
        `Adapter ${name}: still running, takes no new requests (${formatInt(running)} ` +
          `request${running === 1 ? "" : "s"} on it here). Finish removing it once they end.`,
        "warn",
      );
    }
  } catch (err) {
    setStatus("");
    if (err.status === 404 && err.code === "not_found") removing.delete(name);
    showError(alert, err);
  }
  await refresh();
  $("adapters-title").focus();
}

// The adapter's snapshot while it is being removed; null once it is gone (or live again).
async function stillRemoving(name) {
  try {
    const adapter = await api("GET", `/adapters/${encodeURIComponent(name)}`);
    return adapter.deleted_at ? adapter : null;
  } catch (err) {
    if (err.status === 404) return null;
    throw err;
  }
}

// --- registering ----------------------------------------------------------------------------

function renderOwnerOptions() {
  const select = $("adapter-owner");
  const selected = select.value;
  select.replaceChildren(
    h("option", { value: "", text: tenants.length > 0 ? "Choose a tenant" : "No tenants yet" }),
    ...[...tenants]
      .sort(byName)
      .map((tenant) =>
        h("option", { value: tenant.name, selected: tenant.name === selected, text: tenant.name }),
      ),
  );
}

// The tenants to share with, the owner aside; checks survive a change of owner.
function renderRegisterPicks() {
  const picks = $("adapter-shared-picks");
  const checked = new Set(checkedBoxes(picks).map((box) => Number(box.dataset.tenantId)));
  const owner = $("adapter-owner").value;
  const candidates = tenants.filter((tenant) => tenant.name !== owner);
  picks.replaceChildren(...tenantPicks("adapter-share", candidates, checked));
}

async function register(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const alert = $("register-adapter-error");
  clearError(alert, form);
  const name = $("adapter-name").value.trim();
  const owner = $("adapter-owner").value;
  const file = $("adapter-file").files[0];
  if (!name) return showError(alert, { message: "Enter the adapter's name.", param: "name" }, form);
  if (!owner) return showError(alert, { message: "Choose the tenant that owns it.", param: "owner" }, form);
  if (!file) {
    const error = { message: "Choose the adapter's archive (zip or tar).", param: "adapter" };
    return showError(alert, error, form);
  }
  const sharedWith = checkedBoxes($("adapter-shared-picks")).map((box) => box.value);
  const baseModel = $("adapter-base").value.trim();
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  setStatus(`Uploading adapter ${name} (${formatBytes(file.size)}) to be checked…`);
  try {
    const adapter = await api("POST", "/adapters", {
      query: { name, owner, shared_with: sharedWith.join(","), ...(baseModel ? { base_model: baseModel } : {}) },
      file,
    });
    // The owner stays chosen: several adapters of one tenant come in a row.
    $("adapter-name").value = "";
    $("adapter-file").value = "";
    for (const box of checkedBoxes($("adapter-shared-picks"))) box.checked = false;
    setStatus(`Adapter ${adapter.name} registered: rank ${adapter.rank} on ${adapter.targets.join(", ")}.`);
    await refresh();
  } catch (err) {
    setStatus("");
    showError(alert, err, form);
  } finally {
    button.disabled = false;
  }
}

async function refresh() {
  const isCurrent = startLoad();
  const alert = $("adapters-error");
  clearError(alert);
  const pending = [...removing.keys()];
  try {
    const [list, allTenants, gone] = await Promise.all([
      api("GET", "/adapters"),
      loadTenants(),
      Promise.all(pending.map(stillRemoving)),
    ]);
    if (!isCurrent()) return;
    adapters = list.data;
    tenants = allTenants;
    pending.forEach((name, i) => (gone[i] ? removing.set(name, gone[i]) : removing.delete(name)));
    $("register-adapter-form").hidden = false;
    renderOwnerOptions();
    renderRegisterPicks();
    renderTable();
  } catch (err) {
    if (!isCurrent()) return;
    if (err.isMissingRoute) {
      $("adapters-table").replaceChildren();
      $("register-adapter-form").hidden = true;
      showError(alert, {
        message: "This gateway has no adapter registry (GET /admin/v1/adapters): it serves no LoRA adapters.",
        code: "not_available",
      });
    } else {
      showError(alert, err);
    }
  }
}

$("register-adapter-form").addEventListener("submit", register);
$("adapter-owner").addEventListener("change", renderRegisterPicks);

export const adaptersView = {
  show() {
    setStatus("");
    clearError($("register-adapter-error"), $("register-adapter-form"));
    $("adapters-share-slot").replaceChildren();
    refresh();
  },
};

// --- a tenant's adapters --------------------------------------------------------------------

function tenantAdapterRow(adapter, tenant, allTenants) {
  const owns = adapter.owner_tenant_id === tenant.id;
  return h(
    "tr",
    { dataset: { adapter: adapter.name } },
    h("th", { scope: "row" }, h("code", { text: adapter.name })),
    h("td", {}, owns ? "owner" : ["shared by ", tenantLink(adapter.owner_tenant_id, allTenants)]),
    h("td", { class: "num", text: formatInt(adapter.rank) }),
    h("td", { text: adapter.targets.join(", ") }),
    h("td", { class: "num", text: formatBytes(adapter.size_bytes) }),
    h("td", { text: formatTime(adapter.created_at) }),
  );
}

// Fills container with the adapters tenant owns or was granted; allTenants names the owners.
export async function renderTenantAdapters(container, tenant, allTenants) {
  const alert = h("p", { id: "tenant-adapters-error", class: "error", role: "alert" });
  const tbody = h("tbody", {});
  const card = h(
    "div",
    { class: "card", role: "group", "aria-labelledby": "tenant-adapters-title" },
    h("h3", { id: "tenant-adapters-title", text: "LoRA adapters" }),
    h(
      "p",
      { class: "hint" },
      "The adapters this tenant owns or that are shared with it: its requests may name them as their model. ",
      h("a", { href: "#adapters", text: "Manage adapters" }),
    ),
    alert,
  );
  container.replaceChildren(card);
  let list;
  try {
    list = (await api("GET", "/adapters", { query: { owner: tenant.name } })).data;
  } catch (err) {
    if (err.isMissingRoute) {
      card.replaceChildren(
        card.firstChild,
        h("p", { class: "empty", text: "This gateway has no adapter registry: it serves no LoRA adapters." }),
      );
    } else {
      showError(alert, err);
    }
    return;
  }
  tbody.replaceChildren(
    ...(list.length > 0
      ? [...list].sort(byName).map((adapter) => tenantAdapterRow(adapter, tenant, allTenants))
      : [h("tr", {}, h("td", { colspan: 6, class: "empty", text: "No adapters owned or shared." }))]),
  );
  card.append(
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { id: "tenant-adapters-table", class: "data" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["Name", "Access", "Rank", "Targets", "Size", "Created"].map((label) =>
              h("th", { scope: "col", class: NUMERIC.has(label) ? "num" : null, text: label }),
            ),
          ),
        ),
        tbody,
      ),
    ),
  );
}

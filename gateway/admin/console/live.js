// Live: KV usage, running and waiting requests and TTFT p99 against the SLO per tier, each
// served model's engine, and the alerts, polled every few seconds while the view is open and
// the tab is visible.

import { api } from "./api.js";
import { gauge } from "./charts.js";
import { $, clearError, formatInt, formatPercent, formatSeconds, formatTime, h, showError } from "./dom.js";

export const REFRESH_MS = 3000;
const STATE_ORDER = ["firing", "pending", "resolved", "inactive"];

let timer = null;
let active = false;

function ttftState(tier) {
  if (tier.ttft_p99_s === null || tier.ttft_slo_s === null) return "ok";
  if (tier.ttft_p99_s >= tier.ttft_slo_s) return "bad";
  if (tier.alert_threshold_s !== null && tier.ttft_p99_s >= tier.alert_threshold_s) return "warn";
  return "ok";
}

function ttftCell(tier) {
  if (tier.ttft_slo_s === null)
    return h("td", {}, formatSeconds(tier.ttft_p99_s), h("span", { class: "muted", text: " (no SLO)" }));
  const state = ttftState(tier);
  const text = `${formatSeconds(tier.ttft_p99_s)} of ${formatSeconds(tier.ttft_slo_s)} SLO`;
  const markers = [{ at: tier.ttft_slo_s, label: `SLO ${formatSeconds(tier.ttft_slo_s)}`, kind: "slo" }];
  if (tier.alert_threshold_s !== null)
    markers.push({
      at: tier.alert_threshold_s,
      label: `alert at ${formatSeconds(tier.alert_threshold_s)}`,
      kind: "threshold",
    });
  return h(
    "td",
    { class: `ttft ${state}`, dataset: { state } },
    gauge({
      label: `${tier.tier} TTFT p99 ${text}`,
      value: tier.ttft_p99_s ?? 0,
      max: tier.ttft_slo_s * 2,
      state,
      markers,
    }),
    h("span", { text: ` ${text}` }),
  );
}

function kvCell(tier, total) {
  const text = `${formatInt(tier.kv_blocks)} blocks (${formatInt(tier.kv_blocks_reserved)} reserved)`;
  return h(
    "td",
    {},
    gauge({
      label: `${tier.tier} KV ${text} of ${formatInt(total)}`,
      value: tier.kv_blocks,
      max: total,
      markers:
        tier.kv_blocks_reserved > 0
          ? [
              {
                at: tier.kv_blocks_reserved,
                label: `${formatInt(tier.kv_blocks_reserved)} reserved`,
                kind: "reserved",
              },
            ]
          : [],
    }),
    h("span", { text: ` ${text}` }),
  );
}

function tiersTable(live) {
  const headers = ["Tier", "Priority", "Running", "Waiting", "Estimated wait", "KV blocks", "TTFT p99"];
  return h(
    "table",
    { id: "live-tiers", class: "data" },
    h("caption", { text: "Per tier" }),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        headers.map((label) => h("th", { scope: "col", text: label })),
      ),
    ),
    h(
      "tbody",
      {},
      live.tiers.map((tier) =>
        h(
          "tr",
          { dataset: { tier: tier.tier } },
          h("th", { scope: "row", text: tier.tier }),
          h("td", { class: "num", text: tier.priority }),
          h("td", { class: "num", text: formatInt(tier.num_running) }),
          h("td", { class: "num", text: formatInt(tier.num_waiting) }),
          h("td", { class: "num", text: formatSeconds(tier.estimated_wait_s) }),
          kvCell(tier, live.kv_blocks_total),
          ttftCell(tier),
        ),
      ),
    ),
  );
}

// One row per served model: its engine's requests, KV pool and step time.
function modelsTable(models) {
  const headers = ["Model", "Running", "Waiting", "KV blocks used", "Mean step"];
  return h(
    "table",
    { id: "live-models", class: "data" },
    h("caption", { text: "Per model" }),
    h("thead", {}, h("tr", {}, headers.map((label) => h("th", { scope: "col", text: label })))),
    h(
      "tbody",
      {},
      models.map((model) =>
        h(
          "tr",
          { dataset: { model: model.model } },
          h("th", { scope: "row", text: model.model }),
          h("td", { class: "num", text: formatInt(model.num_running) }),
          h("td", { class: "num", text: formatInt(model.num_waiting) }),
          h("td", {
            class: "num",
            text: `${formatInt(model.kv_blocks_used)} of ${formatInt(model.kv_blocks_total)}`,
          }),
          h("td", { class: "num", text: formatSeconds(model.mean_step_time_s) }),
        ),
      ),
    ),
  );
}

function alertsSection(alerts) {
  const sorted = [...alerts].sort((a, b) => STATE_ORDER.indexOf(a.state) - STATE_ORDER.indexOf(b.state));
  const firing = alerts.filter((a) => a.state === "firing").length;
  return h(
    "div",
    { class: "card", role: "group", "aria-labelledby": "alerts-title" },
    h("h3", { id: "alerts-title", text: firing ? `Alerts: ${firing} firing` : "Alerts: none firing" }),
    sorted.length === 0
      ? h("p", { class: "empty", text: "No alert rules configured." })
      : h(
          "ul",
          { id: "live-alerts", class: "alerts" },
          sorted.map((alert) =>
            h(
              "li",
              { class: `alert ${alert.state}`, dataset: { state: alert.state } },
              h("span", { class: `badge ${alert.state}`, text: alert.state }),
              ` ${alert.name} (${alert.tier}): value ${alert.value ?? "—"}, threshold ${alert.threshold}`,
              alert.since ? h("span", { class: "muted", text: ` since ${formatTime(alert.since)}` }) : null,
            ),
          ),
        ),
  );
}

function render(live) {
  const usedRatio = live.kv_blocks_total > 0 ? live.kv_blocks_used / live.kv_blocks_total : 0;
  const blocks = `${formatInt(live.kv_blocks_used)} of ${formatInt(live.kv_blocks_total)} blocks used`;
  const hits = `prefix cache hit ratio ${formatPercent(live.prefix_cache_hit_ratio)}`;
  $("live-body").replaceChildren(
    h(
      "div",
      { class: "card", role: "group", "aria-labelledby": "kv-title" },
      h("h3", { id: "kv-title", text: "KV cache" }),
      h(
        "p",
        {},
        gauge({
          label: `KV cache ${formatPercent(usedRatio)} used`,
          value: live.kv_blocks_used,
          max: live.kv_blocks_total,
          state: usedRatio > 0.9 ? "warn" : "ok",
        }),
        ` ${blocks} (${formatPercent(usedRatio)}); ${hits}`,
      ),
    ),
    h("div", { class: "table-wrap" }, tiersTable(live)),
    live.models?.length ? h("div", { class: "table-wrap" }, modelsTable(live.models)) : null,
    alertsSection(live.alerts),
  );
  $("live-status").textContent = `Updated ${formatTime(live.time)}; refreshes every ${REFRESH_MS / 1000} s.`;
}

async function poll() {
  timer = null;
  if (!active || document.hidden) return;
  const alert = $("live-error");
  try {
    const live = await api("GET", "/live");
    clearError(alert);
    render(live);
  } catch (err) {
    if (err.isMissingRoute) {
      $("live-body").replaceChildren();
      $("live-status").textContent = "";
      showError(alert, {
        message: "This gateway has no live endpoint yet (GET /admin/v1/live).",
        code: "not_available",
      });
      return;
    }
    // Keep the last figures on screen, marked stale, and try again.
    showError(alert, { ...err, message: `Live data is stale: ${err.message}` });
  }
  if (active && timer === null) timer = setTimeout(poll, REFRESH_MS);
}

document.addEventListener("visibilitychange", () => {
  if (active && !document.hidden && timer === null) poll();
});

export const liveView = {
  show() {
    active = true;
    clearTimeout(timer);
    poll();
  },
  hide() {
    active = false;
    clearTimeout(timer);
    timer = null;
  },
};

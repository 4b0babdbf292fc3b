// Charts drawn as inline SVG: stacked bars per day (usage) and horizontal gauges (live).
// Colours come from CSS classes (series-0 … series-7, ok/warn/bad), not inline styles,
// so the strict Content-Security-Policy needs no 'unsafe-inline'.

import { h, svg } from "./dom.js";

export const NUM_SERIES_COLOURS = 8;

const WIDTH = 720;
const HEIGHT = 260;
const MARGIN = { top: 12, right: 12, bottom: 40, left: 64 };
const NUM_TICKS = 4;

let chartCount = 0;

// The smallest of 1, 2, 2.5, 5 × 10^k at or above value / NUM_TICKS: round tick steps.
function tickStep(maxValue) {
  const raw = maxValue / NUM_TICKS;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].find((m) => m * magnitude >= raw);
  return step * magnitude;
}

// days: ["2026-11-01", ...]; series: [{name, values: [one per day]}]; format(value) -> text.
export function stackedBarChart({ title, days, series, format }) {
  const id = `chart-${++chartCount}`;
  const totals = days.map((_, day) => series.reduce((sum, s) => sum + s.values[day], 0));
  const step = tickStep(Math.max(...totals, 1e-9));
  const top = step * NUM_TICKS;
  const plotWidth = WIDTH - MARGIN.left - MARGIN.right;
  const plotHeight = HEIGHT - MARGIN.top - MARGIN.bottom;
  const y = (value) => MARGIN.top + plotHeight * (1 - value / top);
  const slot = plotWidth / Math.max(days.length, 1);
  const barWidth = Math.max(slot * 0.7, 1);
  const labelEvery = Math.ceil(days.length / 12);

  const grid = [];
  for (let tick = 0; tick <= NUM_TICKS; tick++) {
    const value = tick * step;
    grid.push(
      svg("line", { class: "grid", x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(value), y2: y(value) }),
      svg("text", {
        class: "tick",
        x: MARGIN.left - 6,
        y: y(value) + 4,
        "text-anchor": "end",
        text: format(value),
      }),
    );
  }
  const bars = days.map((day, index) => {
    const x = MARGIN.left + slot * index + (slot - barWidth) / 2;
    let base = 0;
    const segments = series.map((s, seriesIndex) => {
      const value = s.values[index];
      const rect = svg(
        "rect",
        {
          class: `series-${seriesIndex % NUM_SERIES_COLOURS}`,
          x,
          width: barWidth,
          y: y(base + value),
          height: Math.max(y(base) - y(base + value), 0),
        },
        svg("title", { text: `${s.name}, ${day}: ${format(value)}` }),
      );
      base += value;
      return value > 0 ? rect : null;
    });
    const label =
      index % labelEvery === 0
        ? svg("text", {
            class: "tick day",
            x: x + barWidth / 2,
            y: HEIGHT - MARGIN.bottom + 16,
            "text-anchor": "middle",
            text: day.slice(5),
          })
        : null;
    return svg("g", {}, segments, label);
  });

  const chart = svg(
    "svg",
    { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, class: "chart", role: "img", "aria-labelledby": `${id}-title` },
    svg("title", { id: `${id}-title`, text: `${title}, per day, stacked by tenant` }),
    grid,
    bars,
  );
  const legend = h(
    "ul",
    { class: "legend" },
    series.map((s, index) =>
      h(
        "li",
        {},
        h("span", { class: `swatch series-${index % NUM_SERIES_COLOURS}`, "aria-hidden": "true" }),
        s.name,
      ),
    ),
  );
  return h("figure", { class: "card" }, h("figcaption", { text: title }), chart, legend);
}

// A horizontal bar for value out of max, with optional markers (e.g. the SLO, a reservation).
// state: "ok" | "warn" | "bad" colours the bar; markers: [{at, label, kind}].
export function gauge({ label, value, max, state = "ok", markers = [] }) {
  const width = 240;
  const height = 16;
  const scale = (v) => (max > 0 ? Math.min(Math.max(v / max, 0), 1) * width : 0);
  return svg(
    "svg",
    { viewBox: `0 0 ${width} ${height}`, class: "gauge", role: "img", "aria-label": label, width, height },
    svg("rect", { class: "track", x: 0, y: 0, width, height }),
    svg("rect", { class: `bar ${state}`, x: 0, y: 0, width: scale(value), height }),
    markers.map((marker) =>
      svg(
        "line",
        {
          class: `marker ${marker.kind ?? ""}`,
          x1: scale(marker.at),
          x2: scale(marker.at),
          y1: 0,
          y2: height,
        },
        svg("title", { text: marker.label }),
      ),
    ),
  );
}

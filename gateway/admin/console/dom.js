// Small DOM helpers: element builders (text nodes only, no HTML parsing, so no data can inject
// markup), number and time formatting, and inline errors tied to the fields they name.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(element, attrs, children) {
  for (const [name, value] of Object.entries(attrs ?? {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") element.textContent = String(value);
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

// h("td", {class: "num", text: "3"}) or h("tr", {}, h("td", ...), ...)
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function svg(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

export function $(id) {
  const element = document.getElementById(id);
  if (!element) throw new Error(`console page has no #${id}`);
  return element;
}

// Answers can arrive out of order (a view shown twice, a second click): each call of the
// returned function starts a load and gives back isCurrent(), false once a newer load began.
export function latestOnly() {
  let latest = 0;
  return () => {
    const mine = ++latest;
    return () => mine === latest;
  };
}

// --- formatting ---------------------------------------------------------------------------

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
// Up to 4 decimals: a day of a small tenant costs fractions of a cent.
const usd = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD", maximumFractionDigits: 4 });

export function formatInt(value) {
  return value === null || value === undefined ? "—" : integer.format(value);
}

export function formatSeconds(seconds, digits = 2) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds !== 0 && Math.abs(seconds) < 0.1) return `${(seconds * 1000).toFixed(0)} ms`;
  return `${seconds.toFixed(digits)} s`;
}

export function formatUsd(amount) {
  return amount === null || amount === undefined ? "—" : usd.format(amount);
}

const BYTE_UNITS = ["KiB", "MiB", "GiB", "TiB"];

// 512 bytes, 3.4 MiB: binary units, as the size limits of the settings are.
export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  if (bytes < 1024) return `${integer.format(bytes)} bytes`;
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < BYTE_UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(1)} ${BYTE_UNITS[unit]}`;
}

export function formatPercent(ratio) {
  return ratio === null || ratio === undefined ? "—" : `${(ratio * 100).toFixed(1)} %`;
}

// ISO timestamp or unix seconds, shown in UTC: the billing day boundaries are UTC too.
export function formatTime(value) {
  if (value === null || value === undefined) return "—";
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  return `${date.toISOString().slice(0, 19).replace("T", " ")} UTC`;
}

export function todayUtc() {
  return new Date().toISOString().slice(0, 10);
}

// --- inline errors ------------------------------------------------------------------------

// Shows err's message in the alert element of a form (or view) and, when the API named the
// offending field (param), marks that field invalid and moves the focus to it.
export function showError(alertElement, err, form = null) {
  clearError(alertElement, form);
  const code = err.code ? ` (${err.code})` : "";
  alertElement.textContent = `${err.message}${code}`;
  const field = form && err.param ? form.querySelector(`[data-param="${CSS.escape(err.param)}"]`) : null;
  if (field) {
    field.setAttribute("aria-invalid", "true");
    field.setAttribute("aria-errormessage", alertElement.id);
    field.focus();
  }
}

export function clearError(alertElement, form = null) {
  alertElement.textContent = "";
  for (const field of form?.querySelectorAll("[aria-invalid]") ?? []) {
    field.removeAttribute("aria-invalid");
    field.removeAttribute("aria-errormessage");
  }
}

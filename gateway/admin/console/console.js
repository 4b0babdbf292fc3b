// The console's entry point: sign in and out, and the hash router between views.
// Views: #tenants, #tenant/<name>, #adapters, #usage, #live, #audit; each view module exports
// show(argument) and optionally hide() (the live view stops polling there).

import { adaptersView } from "./adapters.js";
import { api, forgetToken, setUnauthorizedHandler, storedToken, storeToken } from "./api.js";
import { auditView } from "./audit.js";
import { $, clearError, showError } from "./dom.js";
import { setGrants } from "./grants.js";
import { liveView } from "./live.js";
import { tenantView } from "./tenant.js";
import { tenantsView } from "./tenants.js";
import { usageView } from "./usage.js";

const VIEWS = {
  tenants: tenantsView,
  tenant: tenantView,
  adapters: adaptersView,
  usage: usageView,
  live: liveView,
  audit: auditView,
};
// The nav entry highlighted for each view.
const NAV_OF = { tenant: "tenants" };
const SIGN_IN_MESSAGE_KEY = "tiergate.signInMessage";

let current = null;

function parseHash() {
  const [name, ...rest] = location.hash.replace(/^#/, "").split("/");
  const view = Object.hasOwn(VIEWS, name) ? name : "tenants";
  return { name: view, argument: decodeURIComponent(rest.join("/")) };
}

function showSection(id) {
  for (const section of document.querySelectorAll("main > .view")) {
    section.hidden = section.id !== id;
  }
}

function route() {
  current?.hide?.();
  current = null;
  const signedIn = storedToken() !== null;
  $("nav").hidden = !signedIn;
  $("sign-out").hidden = !signedIn;
  if (!signedIn) {
    showSection("view-signin");
    $("signin-token").focus();
    return;
  }
  const { name, argument } = parseHash();
  const navName = NAV_OF[name] ?? name;
  for (const link of $("nav").querySelectorAll("a")) {
    if (link.dataset.view === navName) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  showSection(`view-${name}`);
  current = VIEWS[name];
  current.show(argument);
  // Move the focus to the new view's heading so keyboard and screen reader users start there.
  document.querySelector(`#view-${name} h2`)?.focus();
}

async function signIn(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const input = $("signin-token");
  const alert = $("signin-error");
  clearError(alert, form);
  const token = input.value.trim();
  if (!token) {
    showError(alert, { message: "Enter the admin token.", param: "token" }, form);
    return;
  }
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  try {
    // Any read proves the token (whoami also says what its role may do); nothing is shown or
    // kept unless it succeeds.
    setGrants(await api("GET", "/whoami", { token }));
  } catch (err) {
    showError(alert, err);
    input.select();
    return;
  } finally {
    button.disabled = false;
  }
  storeToken(token);
  input.value = "";
  route();
}

// Reloading drops every piece of data the page holds, not only the token.
function signOut(message) {
  forgetToken();
  if (message) sessionStorage.setItem(SIGN_IN_MESSAGE_KEY, message);
  location.replace(location.pathname);
}

// The credential's role decides which controls the views show: known before the first one.
async function loadGrants() {
  try {
    setGrants(await api("GET", "/whoami"));
  } catch (err) {
    // 401 signs out (the unauthorized handler); otherwise the views show their own errors
    // and no change control until a reload succeeds.
    if (err.status !== 401) $("signin-error").textContent = err.message;
  }
}

async function start() {
  $("signin-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut(null));
  setUnauthorizedHandler((err) => signOut(`Signed out: ${err.message}`));
  const message = sessionStorage.getItem(SIGN_IN_MESSAGE_KEY);
  if (message) {
    sessionStorage.removeItem(SIGN_IN_MESSAGE_KEY);
    $("signin-error").textContent = message;
  }
  window.addEventListener("hashchange", route);
  if (storedToken() !== null) await loadGrants();
  route();
}

start();

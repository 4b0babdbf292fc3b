// What the signed-in credential may do, from GET /admin/v1/whoami: the page hides the
// controls its role may not use (the server refuses them anyway, with 403). Elements marked
// data-needs="operator" or data-needs="billing" are hidden by console.css unless the body's
// data-grants lists that role; views that show values in a form ask may() to make it
// read-only instead.

let granted = new Set();

export function setGrants(whoami) {
  granted = new Set(Object.entries(whoami.grants ?? {}).filter(([, ok]) => ok).map(([role]) => role));
  document.body.dataset.grants = [...granted].sort().join(" ");
  const label = document.getElementById("whoami");
  label.textContent = `${whoami.name} (${whoami.role})`;
  label.hidden = false;
}

// True when the credential may use routes that need role ("operator", "billing", ...).
export function may(role) {
  return granted.has(role);
}

// The dashboard's only script: refreshes the page's data section from the server every few
// seconds, draws the overview's charts (uPlot, vendored), sends the purge form and the
// keys page's forms.
"use strict";

const main = document.querySelector("main[data-page]");
const page = main.dataset.page;
const refreshMs = 1000 * Number(main.dataset.refreshS || 5);
const charts = [];
let chartWindow = "5m";

async function refreshData() {
  const url = new URL(location.href);
  url.searchParams.set("partial", "1");
  const answer = await fetch(url, { credentials: "same-origin" });
  if (answer.ok) {
    document.getElementById("data").innerHTML = await answer.text();
    document.getElementById("refreshed").textContent =
      "refreshed " + new Date().toLocaleTimeString();
  }
}

const COLOURS = ["#2f7ed8", "#e4572e", "#17803d", "#8e44ad"];

function chartOptions(el, names) {
  const labels = (el.dataset.labels || el.dataset.series).split(",");
  return {
    title: el.dataset.title,
    width: el.clientWidth - 10,
    height: 200,
    series: [{}, ...names.map((_, i) => ({ label: labels[i], stroke: COLOURS[i], width: 2, spanGaps: true }))],
    axes: [{}, { size: 60 }],
  };
}

async function refreshCharts() {
  const answer = await fetch(`/dashboard/api/series/${chartWindow}`, { credentials: "same-origin" });
  if (!answer.ok) return;
  const columns = await answer.json();
  document.querySelectorAll(".chart").forEach((el, i) => {
    const names = el.dataset.series.split(",");
    const data = [columns.time, ...names.map((n) => columns[n])];
    if (charts[i]) {
      charts[i].setData(data);
    } else {
      charts[i] = new uPlot(chartOptions(el, names), data, el);
    }
  });
}

function chooseWindow(button) {
  chartWindow = button.dataset.window;
  document.querySelectorAll("[data-window]").forEach((b) =>
    b.setAttribute("aria-pressed", b === button ? "true" : "false"));
  refreshCharts();
}

async function purge(event) {
  event.preventDefault();
  const form = event.target;
  const kind = form.kind.value;
  const target = form.target.value.trim();
  const what = kind === "all" ? "EVERY cached answer" : `the cached answers of ${kind} "${target}"`;
  const result = document.getElementById("purge-result");
  if (!confirm(`Purge ${what}? This cannot be undone.`)) {
    result.textContent = "purge cancelled";
    return;
  }
  const answer = await fetch("/dashboard/api/purge", {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json", "x-semcache-dashboard": "1" },
    body: JSON.stringify({ kind, target }),
  });
  const body = await answer.json();
  result.textContent = answer.ok
    ? `purged: ${body.kind} ${body.target}${body.propagated ? "" : " (not yet sent to the other gateways)"}`
    : `purge refused: ${body.error ? body.error.message : answer.status}`;
  await refreshData();
}

document.querySelectorAll("[data-window]").forEach((b) =>
  b.addEventListener("click", () => chooseWindow(b)));
const purgeForm = document.getElementById("purge");
if (purgeForm) purgeForm.addEventListener("submit", purge);
if (page === "overview") refreshCharts();
setInterval(() => {
  refreshData();
  if (page === "overview") refreshCharts();
}, refreshMs);

// The keys page: create (the secret is shown here once, never again) and revoke.
async function sendKeyChange(url, body) {
  const answer = await fetch(url, {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json", "x-semcache-dashboard": "1" },
    body: JSON.stringify(body),
  });
  return [answer.ok, await answer.json()];
}

async function createKey(event) {
  event.preventDefault();
  const form = event.target;
  const body = { tenant: form.tenant.value.trim(), name: form.name.value.trim() };
  const models = form.models.value.split(",").map((m) => m.trim()).filter((m) => m);
  if (models.length) body.models = models;
  if (form.expires_in_s.value) body.expires_in_s = Number(form.expires_in_s.value);
  const [ok, answer] = await sendKeyChange("/dashboard/api/actions/keys/new", body);
  document.getElementById("created-key").textContent = ok
    ? `key ${answer.key.id}: secret (shown once) ${answer.secret}`
    : `refused: ${answer.error ? answer.error.message : "error"}`;
  refreshData();
}

async function revokeKey(event) {
  const button = event.target.closest(".revoke-key");
  if (!button || !confirm(`Revoke the key ${button.dataset.key} on every gateway?`)) return;
  await sendKeyChange(`/dashboard/api/actions/keys/${encodeURIComponent(button.dataset.key)}/revoke`, {});
  refreshData();
}

const keyForm = document.getElementById("create-key");
if (keyForm) {
  keyForm.addEventListener("submit", createKey);
  document.addEventListener("click", revokeKey);
}

// egressd dashboard. Everything shown comes from the child's traffic (host names, paths), so the
// page only ever sets textContent, never HTML; the CSP forbids inline script anyway.
"use strict";

const csrf = document.querySelector('meta[name="egressd-csrf"]').content;
const MAX_ROWS = 200;
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function message(text, error) {
  const node = $("message");
  node.textContent = text || "";
  node.className = error ? "message error" : "message";
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
    body: JSON.stringify(body || {}),
    credentials: "same-origin",
  });
  let data = {};
  try { data = await response.json(); } catch (e) { data = {}; }
  if (!response.ok) throw new Error(data.error || ("HTTP " + response.status));
  return data;
}

function target(item) {
  const host = item.host && item.host.includes(":") ? "[" + item.host + "]" : item.host;
  let text = (host || "?") + (item.port ? ":" + item.port : "");
  if (item.method && item.path) text += "  " + item.method + " " + item.path;
  return text;
}

// -- state ------------------------------------------------------------------------------------------
let refreshing = null;
let again = false;

async function refresh() {
  if (refreshing) { again = true; return refreshing; }
  refreshing = (async () => {
    try {
      const response = await fetch("/api/state", { credentials: "same-origin" });
      if (response.ok) render(await response.json());
    } finally {
      refreshing = null;
      if (again) { again = false; refresh(); }
    }
  })();
  return refreshing;
}

function render(state) {
  const info = state.info || {};
  $("instance").textContent = "pid " + info.pid + " · mode " + info.mode + " · " + (info.command || []).join(" ");
  if (state.policy) lastPolicy = state.policy;
  renderAsks(state.asks || []);
  renderClients(info);
  renderGrants(state.grants || []);
  renderPolicy(state.policy);
}

function isAddress(host) {
  return /^[0-9.]+$/.test(host) || host.includes(":");
}

function words(list) {
  return (list || []).join(" ");
}

// What each answer covers, in the words the policy uses: a host rule matches its subdomains.
function scopes(ask, others, policy) {
  const where = (isAddress(ask.host) && ask.host.includes(":") ? "[" + ask.host + "]" : ask.host) + ":" + ask.port;
  const n = ask.waiting;
  const lines = [
    ["once", "Allow once", (n === 1 ? "this waiting request" : "these " + n + " waiting requests") +
      " only; the next one is asked again."],
  ];
  let run = "every request to " + where + " (this exact host, not its subdomains) until egressd exits";
  if (others.length) {
    run += " — the " + (others.length === 1 ? "other ask" : others.length + " other asks") + " to it waiting now too: " +
      others.map((o) => (o.method && o.path ? o.method + " " + o.path : "a tunnel")).join(", ");
  }
  lines.push(["run", "Allow for this run", run + "."]);
  if ((ask.answers || []).includes("always")) {
    const file = policy && policy.source ? policy.source : "the policy file";
    const matches = isAddress(ask.host)
      ? "it matches the address " + ask.host + " on port " + ask.port + " only"
      : "it matches " + ask.host + " and every name under it (*." + ask.host + ") on port " + ask.port;
    lines.push(["always", "Always allow", "adds the rule " + ask.rule + " to the allow list of " + file + ": " +
      matches + ", for every child, from now on."]);
  }
  lines.push(["deny", "Deny", (n === 1 ? "this waiting request is" : "these " + n + " waiting requests are") +
    " refused (ask_refused); the next one is asked again."]);
  return lines;
}

function timeLeft(node) {
  const left = Math.max(0, Math.round((Number(node.dataset.deadline) - Date.now()) / 1000));
  node.textContent = left > 0 ? "refused in " + left + " s unless answered" : "refused now (ask_timeout)";
}

let lastPolicy = null;

function renderAsks(asks) {
  const list = $("asks");
  list.replaceChildren();
  $("ask-count").textContent = asks.length;
  $("no-asks").hidden = asks.length > 0;
  for (const ask of asks) {
    const item = el("li", null, "ask");
    item.dataset.id = ask.id;
    item.appendChild(el("span", target(ask), "target"));
    const left = el("span", null, "left");
    left.dataset.deadline = String(Date.now() + Number(ask.expires_in || 0) * 1000);
    timeLeft(left);
    item.appendChild(left);
    item.appendChild(el("span", (ask.asker || "client " + (ask.client || "-")) + ", " + ask.waiting + " waiting", "muted"));
    const first = (ask.requests || [])[0] || {};
    const who = el("div", null, "who");
    who.append(el("span", first.cmdline && first.cmdline.length ? "asked by " : "egressd runs "),
      el("code", words(first.cmdline && first.cmdline.length ? first.cmdline : ask.command) || "?", "command"));
    item.appendChild(who);
    const requests = el("ul", null, "requests");
    for (const request of ask.requests || []) {
      const program = request.pid ? words(request.cmdline) + " (pid " + request.pid + ")" : "its program not looked up";
      requests.appendChild(el("li", "connection " + request.conn + ": " + program));
    }
    item.appendChild(requests);
    const others = asks.filter((o) => o.id !== ask.id && o.host === ask.host && o.port === ask.port);
    const help = el("dl", null, "scopes");
    for (const [answer, label, text] of scopes(ask, others, lastPolicy)) {
      const button = el("button", label, answer === "deny" ? "deny" : "allow");
      button.dataset.answer = answer;
      button.title = text;
      button.addEventListener("click", async () => {
        button.disabled = true;
        try {
          const done = await post("/api/asks/" + encodeURIComponent(ask.id), { answer });
          message(ask.host + ":" + ask.port + ": " + answer + " (" + done.released + " released)" +
            (done.written ? "; " + done.written : ""));
        } catch (e) {
          message(e.message, true);
        }
        refresh();
      });
      item.appendChild(button);
      const term = el("dt", label);
      const desc = el("dd", text);
      desc.dataset.answer = answer;
      help.append(term, desc);
    }
    item.appendChild(help);
    list.appendChild(item);
  }
}

setInterval(() => { for (const node of document.querySelectorAll("#asks .left")) timeLeft(node); }, 1000);

function renderClients(info) {
  const body = $("clients").tBodies[0];
  body.replaceChildren();
  for (const [name, counts] of Object.entries(info.clients || {})) {
    const row = el("tr");
    row.append(el("td", name), el("td", counts.allowed), el("td", counts.refused));
    body.appendChild(row);
  }
  const c = info.counts || {};
  $("totals").textContent = "decisions " + (c.decisions || 0) + " · allowed " + (c.allowed || 0) +
    " · refused " + (c.refused || 0) + " · open connections " + (c.connections || 0);
}

function renderGrants(grants) {
  const list = $("grants");
  list.replaceChildren();
  for (const grant of grants) {
    const item = el("li");
    item.appendChild(el("code", grant.target));
    item.appendChild(el("span", (grant.once ? "once" : "this run") +
      (grant.expires_in != null ? ", " + Math.round(grant.expires_in) + "s left" : ""), "muted"));
    const button = el("button", "Revoke", "deny");
    button.addEventListener("click", async () => {
      try { await post("/api/grants/" + encodeURIComponent(grant.id) + "/revoke"); message("revoked " + grant.target); }
      catch (e) { message(e.message, true); }
      refresh();
    });
    item.appendChild(button);
    list.appendChild(item);
  }
}

function renderPolicy(policy) {
  if (!policy) return;
  $("policy-source").textContent = policy.source + (policy.writable ? "" : " (read-only)");
  $("rule-form").hidden = !policy.writable;
  const own = policy.file || {};
  for (const which of ["allow", "deny"]) {
    const list = $(which);
    list.replaceChildren();
    const rules = (policy.effective || {})[which] || [];
    for (const rule of rules) {
      const text = typeof rule === "string" ? rule : JSON.stringify(rule);
      const item = el("li");
      item.appendChild(el("code", text));
      if (policy.writable && (own[which] || []).includes(text)) {
        const button = el("button", "Remove", "deny");
        button.addEventListener("click", async () => {
          try { const done = await post("/api/policy/rules", { op: "remove", list: which, rule: text }); message(done.done); }
          catch (e) { message(e.message, true); }
          setTimeout(refresh, 300);
        });
        item.appendChild(button);
      } else if (!(own[which] || []).includes(text)) {
        item.appendChild(el("span", "(not in the file)", "muted"));
      }
      list.appendChild(item);
    }
  }
}

// -- live decisions ---------------------------------------------------------------------------------
function program(event) {
  if (!event.exe && !event.pid) return "";
  return `${event.exe || "?"} (pid ${event.pid || "?"})`;
}

function addDecision(event) {
  const body = $("decisions").tBodies[0];
  const verdict = event.outcome || (event.allowed ? "allowed" : "refused");
  const row = el("tr", null, event.allowed ? "allowed" : "refused");
  const time = new Date((event.time || Date.now() / 1000) * 1000).toLocaleTimeString();
  row.append(
    el("td", time), el("td", event.client || "-"), el("td", event.stage), el("td", target(event)),
    el("td", verdict, "verdict"), el("td", event.reason), el("td", event.rule || ""),
    el("td", program(event)),
  );
  row.dataset.host = event.host || "";
  row.dataset.reason = event.reason || "";
  body.insertBefore(row, body.firstChild);
  while (body.rows.length > MAX_ROWS) body.deleteRow(body.rows.length - 1);
}

let counting = null;
function connect() {
  const source = new EventSource("/api/stream");
  source.onopen = () => {
    $("status").textContent = "live"; $("status").className = "status live";
    $("decisions").tBodies[0].replaceChildren();  // the stream starts with the recent decisions again
    refresh();
  };
  source.onerror = () => { $("status").textContent = "reconnecting…"; $("status").className = "status down"; };
  source.onmessage = (message) => {
    let event;
    try { event = JSON.parse(message.data); } catch (e) { return; }
    if (event.source === "asks") { refresh(); return; }
    if (event.event === "decision" && event.stage !== "connection") {
      addDecision(event);
      if (event.backlog) return;  // from before the page opened: the counters have it
      if (!counting) counting = setTimeout(() => { counting = null; refresh(); }, 500);
    } else if (event.event === "gone") {
      $("status").textContent = "egressd stopped"; $("status").className = "status down";
    }
  };
}

// -- forms --------------------------------------------------------------------------------------------
$("grant-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const targetText = $("grant-target").value.trim();
  try {
    const grant = await post("/api/grants", { target: targetText, ttl: Number($("grant-ttl").value) || 300 });
    message("granted one request: " + grant.target);
    $("grant-target").value = "";
  } catch (err) { message(err.message, true); }
  refresh();
});

$("rule-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  try {
    const done = await post("/api/policy/rules", { op: "add", list: $("rule-list").value, rule: $("rule-text").value });
    message(done.done);
    $("rule-text").value = "";
  } catch (err) { message(err.message, true); }
  setTimeout(refresh, 300);
});

refresh();
connect();

// The endpoint picker's status page: fetches api/status every second and updates the page in
// place (no reload, no framework, no build step). Every value is set as text, never as HTML.
"use strict";

(() => {
  const INTERVAL_MS = 1000;
  const $ = (id) => document.getElementById(id);
  let updates = 0;

  // -- formatting ---------------------------------------------------------------------------
  const dash = "\u2013";
  const integer = (n) => (n === null || n === undefined ? dash : n.toLocaleString("en-US"));
  const percent = (x) => (x === null || x === undefined ? dash : `${(x * 100).toFixed(1)}%`);
  const score = (x) => x.toFixed(2);
  function age(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }
  function clock(epochSeconds) {
    const d = new Date(epochSeconds * 1000);
    const pad = (n, w = 2) => String(n).padStart(w, "0");
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  }
  const shortScorer = (name) => name.replace(/-scorer$/, "");

  // -- DOM helpers: change only what changed --------------------------------------------------
  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }
  function cell(row, i) {
    while (row.cells.length <= i) row.insertCell();
    return row.cells[i];
  }
  function setCells(row, values, classes = []) {
    values.forEach((value, i) => {
      const td = cell(row, i);
      if (value !== null) setText(td, value); // null: the caller fills the cell itself
      const cls = classes[i] || "";
      if (td.className !== cls) td.className = cls;
    });
  }
  function setRows(tbody, count) {
    while (tbody.rows.length > count) tbody.deleteRow(-1);
    while (tbody.rows.length < count) tbody.insertRow();
  }

  // -- sections ---------------------------------------------------------------------------------
  function renderHeader(s) {
    setText($("pool-name"), s.pool ? `${s.pool.namespace}/${s.pool.name}` : "(no pool loaded)");
    const ready = $("ready");
    setText(ready, s.ready ? "ready" : "not ready");
    ready.className = `badge ${s.ready ? "ok" : "bad"}`;
    const note = $("note");
    note.hidden = !s.note;
    setText(note, s.note || "");
    const updated = $("updated");
    setText(updated, `updated ${clock(s.time)}`);
    updated.className = "muted";
  }

  function renderSummary(s) {
    const eps = s.endpoints;
    const sum = (key) => eps.reduce((total, e) => total + e[key], 0);
    const bad = eps.filter((e) => e.stale || e.unreachable || (e.outlier && e.outlier.state === "ejected")).length;
    setText($("sum-endpoints"), integer(eps.length));
    setText($("sum-stale"), integer(bad));
    $("sum-stale").classList.toggle("warn", bad > 0);
    setText($("sum-waiting"), integer(sum("waiting")));
    setText($("sum-running"), integer(sum("running")));
    setText($("sum-inflight"), integer(s.inFlight));
    setText($("sum-kv"), eps.length ? percent(sum("kvCacheUsage") / eps.length) : dash);
    const flow = s.flowControl;
    $("card-flow").hidden = !flow;
    if (flow) {
      setText($("sum-flow"), integer(flow.waiting));
      const bands = Object.entries(flow.byPriority)
        .map(([priority, n]) => `priority ${priority}: ${integer(n)}`)
        .join(", ");
      setText($("sum-flow-bands"), bands);
    }
  }

  function renderPool(s) {
    const p = s.pool;
    const detail = p
      ? `${p.apiVersion} \u00b7 target ports ${p.targetPorts.join(", ")} \u00b7 selector ` +
        (Object.entries(p.selector).map(([k, v]) => `${k}=${v}`).join(", ") || "(none)") +
        (s.refreshIntervalSeconds === null || s.refreshIntervalSeconds === undefined
          ? ""
          : ` \u00b7 scraped every ${age(s.refreshIntervalSeconds)}`) +
        ` \u00b7 metrics stale after ${age(s.stalenessThresholdSeconds)}`
      : "no pool loaded";
    setText($("pool-detail"), detail);
    const tbody = $("models").tBodies[0];
    setRows(tbody, Math.max(s.models.length, 1));
    if (!s.models.length) {
      setCells(tbody.rows[0], ["no InferenceModels: every model passes through", "", "", ""], ["muted"]);
      return;
    }
    s.models.forEach((m, i) => {
      const split = m.targets.length
        ? m.targets.map((t) => `${t.name} ${t.percent}% (weight ${t.weight})`).join(", ")
        : "none: sent as asked";
      const objective = m.objective
        ? `${(m.objective.perOutputTokenP95Seconds * 1000).toFixed(0)} ms per output token at P95`
        : dash;
      setCells(tbody.rows[i], [m.name, m.criticality, split, objective], ["", `crit-${m.criticality}`]);
    });
  }

  const endpointRows = new Map(); // address -> <tr>, so a row stays put while its endpoint does

  function endpointState(e) {
    if (e.unreachable) return ["unreachable", `unreachable: ${e.unreachable}`];
    const o = e.outlier;
    if (o && o.state === "ejected") {
      return ["ejected", `ejected until ${clock(o.ejectedUntil)} (${age(o.secondsLeft)} left): ` +
        `${o.consecutiveFailures} failures in a row, last ${o.lastFailure}; ejection ${o.ejections}`];
    }
    if (o && o.state === "probing") {
      return ["probing", `probing${o.probeInFlight ? ": a request is testing it" : ""} ` +
        `after ejection ${o.ejections}`];
    }
    if (e.metricsAgeSeconds === null) return ["stale", "stale: never scraped"];
    if (e.stale) return ["stale", "stale"];
    if (o && o.consecutiveFailures) return ["ok", `ok (${o.consecutiveFailures} failures in a row)`];
    return ["ok", "ok"];
  }

  function renderEndpoints(s) {
    const tbody = $("endpoints").tBodies[0];
    const seen = new Set();
    let previous = null;
    for (const e of s.endpoints) {
      seen.add(e.address);
      let row = endpointRows.get(e.address);
      if (!row) {
        row = document.createElement("tr");
        row.dataset.address = e.address;
        endpointRows.set(e.address, row);
      }
      const expected = previous ? previous.nextSibling : tbody.firstChild;
      if (expected !== row) tbody.insertBefore(row, expected); // new, or the order changed
      previous = row;
      const [state, stateText] = endpointState(e);
      row.className = state;
      const adapters = e.activeAdapters.join(", ") || (e.maxAdapters === null ? dash : "none");
      const slots = e.maxAdapters === null ? "" : ` (${e.activeAdapters.length}/${e.maxAdapters} slots)`;
      const waiting = e.waitingAdapters.length ? `; waiting: ${e.waitingAdapters.join(", ")}` : "";
      setCells(
        row,
        [
          e.name,
          e.address,
          e.engine,
          integer(e.waiting),
          integer(e.running),
          integer(e.inFlight),
          null,
          adapters + slots + waiting,
          age(e.metricsAgeSeconds),
          stateText,
          predictorError(e.predictor),
          kvEvents(e.kvEvents),
        ],
        ["", "mono", "", "num", "num", "num", "kv", "", "num", `state ${state}`, "num", ""],
      );
      kvCell(cell(row, 6), e.kvCacheUsage);
    }
    for (const [address, row] of endpointRows) {
      if (!seen.has(address)) {
        row.remove();
        endpointRows.delete(address);
      }
    }
  }

  // the latency predictor's recent TTFT error, with its sample count (no predictor: a dash)
  function predictorError(p) {
    if (!p || p.ttftRelativeError === null) return p ? `no samples` : dash;
    return `${Math.round(p.ttftRelativeError * 100)}% (${integer(p.ttftSamples)})`;
  }

  // the KV-event subscription: blocks indexed, events, repairs, the last event's age (none: a dash)
  function kvEvents(k) {
    if (!k) return dash;
    if (k.state === "waiting") return "no events yet";
    const repairs = [k.replays ? `${integer(k.replays)} replayed` : "", k.rebuilds ? `${integer(k.rebuilds)} rebuilt` : ""]
      .filter(Boolean).join(", ");
    const state = k.state === "live" ? "" : `${k.state}: `;
    return `${state}${integer(k.blocks)} blocks, ${integer(k.events)} events` +
      `${repairs ? ` (${repairs})` : ""}, last ${age(k.lastEventAgeSeconds)} ago`;
  }

  function kvCell(td, usage) {
    let meter = td.querySelector("meter");
    let label = td.querySelector("span");
    if (!meter) {
      td.textContent = "";
      meter = document.createElement("meter");
      Object.assign(meter, { min: 0, max: 1, low: 0.6, high: 0.85, optimum: 0 });
      label = document.createElement("span");
      td.append(meter, label);
    }
    if (meter.value !== usage) meter.value = usage;
    setText(label, ` ${percent(usage)}`);
  }

  function scoreText(scores) {
    if (!scores) return dash;
    const parts = Object.entries(scores.byScorer)
      .filter(([, value]) => Math.abs(value) >= 0.005)
      .map(([name, value]) => `${shortScorer(name)} ${score(value)}`);
    return `${score(scores.total)}${parts.length ? ` = ${parts.join(" + ")}` : ""}`;
  }

  function renderDecisions(s) {
    const tbody = $("decisions").tBodies[0];
    const decisions = s.decisions;
    setRows(tbody, Math.max(decisions.length, 1));
    if (!decisions.length) {
      setCells(tbody.rows[0], ["no request yet", "", "", "", "", ""], ["muted"]);
      return;
    }
    decisions.forEach((d, i) => {
      const model = d.targetModel && d.targetModel !== d.model ? `${d.model} \u2192 ${d.targetModel}` : d.model || dash;
      let routed;
      let chosen;
      let runnerUp;
      if (d.error) {
        routed = `${d.error.status} ${d.error.code}: ${d.error.message}`;
        chosen = "";
        runnerUp = "";
      } else {
        routed = d.endpoints.join(", ");
        if (d.chosen) {
          chosen = scoreText(d.chosen) + ` (${d.passedFilters} of ${d.candidates} passed the filters)`;
          runnerUp = d.runnerUp
            ? `${d.runnerUp.endpoint} ${scoreText(d.runnerUp)}`
            : "none: the only endpoint left";
        } else {
          chosen = "not sampled (one decision every 20 ms keeps its scores)";
          runnerUp = "";
        }
      }
      const row = tbody.rows[i];
      row.className = d.error ? "error" : "";
      setCells(
        row,
        [clock(d.time), d.requestId, model, routed, chosen, runnerUp],
        ["mono", "mono ellipsis", "", d.error ? "error" : "mono", "scores", "scores"],
      );
      const id = cell(row, 1);
      if (id.title !== d.requestId) id.title = d.requestId;
    });
  }

  // -- the loop -------------------------------------------------------------------------------
  function render(s) {
    renderHeader(s);
    renderSummary(s);
    renderPool(s);
    renderEndpoints(s);
    renderDecisions(s);
    updates += 1;
    document.body.dataset.updated = String(updates);
    document.body.dataset.state = "ok";
  }

  function showDisconnected(error) {
    const updated = $("updated");
    setText(updated, `no answer from the endpoint picker (${error}); retrying`);
    updated.className = "bad-text";
    document.body.dataset.state = "disconnected";
  }

  // -- the token: with --metrics-endpoint-auth the page's fetches carry a bearer token ---------
  // It comes from the address (http://localhost:9090/#token=...: a fragment never reaches a
  // server, a proxy log or a Referer) or from the form shown on a 401 or 403; it is kept in
  // sessionStorage (this tab and this origin only, gone when the tab closes) and removed from
  // the address bar at once, so it stays out of the history and of screenshots.
  const TOKEN_KEY = "endpoint-picker-token";
  let storedToken = readToken();
  let pending = null; // the next poll, while one is scheduled

  function storeToken(token) {
    try {
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      // storage disabled: the token lasts until the page is reloaded
    }
    storedToken = token;
  }
  function readToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (_) {
      return null;
    }
  }

  function takeTokenFromAddress() {
    // not URLSearchParams: it would read a "+" in a token as a space
    const match = /(?:^|&)token=([^&]*)/.exec(location.hash.slice(1));
    if (!match) return false;
    let token = match[1];
    try {
      token = decodeURIComponent(token);
    } catch (_) {
      // not percent-encoded after all: taken as written
    }
    storeToken(token.trim());
    history.replaceState(null, "", location.pathname + location.search);
    return true;
  }

  function showSignIn(status, message) {
    const form = $("auth");
    const why = storedToken
      ? `The token was not accepted (${status}): ${message}`
      : "This endpoint picker shows its status only to a bearer token allowed to read it.";
    setText($("auth-message"), why);
    const updated = $("updated");
    setText(updated, status === 403 ? "this token may not read the status (403)" : "token needed (401)");
    updated.className = "bad-text";
    if (form.hidden) {
      form.hidden = false;
      $("token-input").focus();
    }
    document.body.dataset.state = status === 403 ? "forbidden" : "unauthorized";
  }

  $("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("token-input");
    storeToken(input.value.trim());
    input.value = "";
    $("auth").hidden = true;
    schedule(0);
  });

  async function poll() {
    pending = null;
    try {
      const headers = storedToken ? { Authorization: `Bearer ${storedToken}` } : {};
      const response = await fetch("api/status", { cache: "no-store", headers });
      if (response.status === 401 || response.status === 403) {
        const answer = await response.json().catch(() => ({}));
        showSignIn(response.status, (answer.error && answer.error.message) || response.statusText);
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      $("auth").hidden = true;
      render(await response.json());
    } catch (error) {
      showDisconnected(error.message || String(error));
    } finally {
      schedule(INTERVAL_MS);
    }
  }

  function schedule(delay) {
    if (pending !== null) clearTimeout(pending);
    pending = setTimeout(poll, delay);
  }

  window.addEventListener("hashchange", () => {
    if (takeTokenFromAddress()) schedule(0); // a new #token= pasted into an open tab
  });
  takeTokenFromAddress();
  poll();
})();

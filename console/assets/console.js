// Strata's console: live updates over Server-Sent Events, times in the
// viewer's zone, the events tail, and the pool grid on a canvas. No
// framework, no build step: this file is served as written.
"use strict";

(function () {
  const state = document.getElementById("live-state");
  const say = (text) => { if (state) state.textContent = text; };

  // Times: the viewer's zone in the text, UTC on hover (the title).
  function localize(root) {
    for (const t of root.querySelectorAll("time[datetime]")) {
      const d = new Date(t.getAttribute("datetime"));
      if (!isNaN(d)) t.textContent = d.toLocaleString();
    }
  }

  function live(query, handlers) {
    const source = new EventSource("/live?" + query);
    source.addEventListener("open", () => say("live"));
    source.addEventListener("error", () => say("reconnecting…"));
    source.addEventListener("ended", (e) => {
      source.close();
      let why = "";
      try { why = JSON.parse(e.data); } catch (_) { why = e.data; }
      say("signed out");
      const main = document.getElementById("main");
      if (main) {
        main.innerHTML = "";
        const h = document.createElement("h1");
        h.textContent = "Signed out";
        const p = document.createElement("p");
        p.className = "error";
        p.setAttribute("role", "alert");
        p.id = "ended";
        p.textContent = why;
        main.append(h, p);
      }
    });
    for (const [name, f] of Object.entries(handlers)) source.addEventListener(name, f);
    return source;
  }

  // A page that follows the log fetches its new content once per change.
  let pending = false, inflight = false;
  async function refresh() {
    if (inflight) { pending = true; return; }
    const main = document.getElementById("main");
    if (main && main.contains(document.activeElement) && document.activeElement.matches("input, select, textarea")) {
      pending = true; // not while someone types; after they leave the field
      return;
    }
    inflight = true;
    try {
      const r = await fetch(location.href, { headers: { "X-Console-Fragment": "1" }, credentials: "same-origin" });
      if (r.ok) {
        const html = await r.text();
        const old = document.getElementById("main");
        const box = document.createElement("div");
        box.innerHTML = html;
        const fresh = box.firstElementChild;
        if (old && fresh) {
          old.replaceWith(fresh);
          localize(fresh);
          grid();
          document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
        }
      }
    } finally {
      inflight = false;
      if (pending) { pending = false; setTimeout(refresh, 50); }
    }
  }
  document.addEventListener("focusout", () => { if (pending && !inflight) { pending = false; refresh(); } });

  function follow() {
    const main = document.getElementById("main");
    if (!main) return;
    const watch = main.dataset.watch || "", mention = main.dataset.mention || "";
    const params = new URLSearchParams();
    if (watch) params.set("watch", watch);
    if (mention) params.set("mention", mention);
    live(params.toString(), {
      change: refresh,
      resync: refresh,
      // The log moved on between the page and its stream: fetch it again.
      hello: (e) => {
        const m = document.getElementById("main");
        if (m && JSON.parse(e.data).position > Number(m.dataset.position || 0)) refresh();
      },
    });
  }

  // The events tail: rows added as events commit, newest first.
  function tail() {
    const body = document.getElementById("tail");
    if (!body) return false;
    const kept = Number(body.dataset.kept || 200);
    let paused = false;
    const button = document.getElementById("tail-pause");
    if (button) button.addEventListener("click", () => {
      paused = !paused;
      button.setAttribute("aria-pressed", String(paused));
      button.textContent = paused ? "Resume" : "Pause";
    });
    const params = new URLSearchParams({ mode: "events", watch: body.dataset.watch || "*" });
    if (body.dataset.types) params.set("types", body.dataset.types);
    live(params.toString(), {
      events: (e) => {
        if (paused) return;
        for (const ev of JSON.parse(e.data)) {
          const tr = document.createElement("tr");
          const when = document.createElement("time");
          const d = new Date(ev.at_ms);
          when.dateTime = d.toISOString();
          when.title = d.toISOString();
          when.textContent = d.toLocaleString();
          const code = document.createElement("code");
          code.textContent = ev.brief;
          for (const v of [String(ev.position), when, ev.stream, ev.type, code]) {
            const td = document.createElement("td");
            if (typeof v === "string") td.textContent = v; else td.append(v);
            tr.append(td);
          }
          body.prepend(tr);
        }
        while (body.rows.length > kept) body.deleteRow(body.rows.length - 1);
        document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
      },
    });
    return true;
  }

  // The pool grid: one canvas, a cell per GPU, nodes grouped by rack.
  let zoom = 0;
  function grid() {
    const canvas = document.getElementById("grid");
    if (!canvas) return;
    const nodes = JSON.parse(canvas.dataset.nodes || "[]");
    if (!zoom) zoom = nodes.length < 100 ? 16 : nodes.length < 2000 ? 8 : 4;
    const find = document.getElementById("grid-find");
    const hover = document.getElementById("grid-hover");
    const needle = find ? find.value.trim() : "";
    const css = getComputedStyle(document.documentElement);
    const color = {
      f: css.getPropertyValue("--free").trim() || "#3a3",
      b: css.getPropertyValue("--booked").trim() || "#36c",
      o: css.getPropertyValue("--out").trim() || "#c33",
      h: css.getPropertyValue("--held").trim() || "#999",
    };
    const width = Math.max(320, canvas.parentElement.clientWidth - 8);
    const cell = zoom, gap = Math.max(1, Math.floor(zoom / 3));
    // Lay out: groups (racks) in order, nodes within wrapping by width.
    const layout = [], labels = [];
    let x = 0, y = 0, group = null, rowH = 0;
    for (const n of nodes) {
      const gpus = n[3].length || 1;
      const w = Math.min(gpus, 8) * cell, h = Math.ceil(gpus / 8) * cell;
      if (n[1] !== group) {
        if (group !== null) { y += rowH + 3 * gap; }
        x = 0; rowH = 0; group = n[1];
        if (group) { labels.push([group, y + 10]); y += 14; }
      }
      if (x + w > width) { x = 0; y += rowH + gap; rowH = 0; }
      layout.push([x, y, w, h, n]);
      x += w + gap; rowH = Math.max(rowH, h);
    }
    const ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio;
    canvas.height = (y + rowH + 2) * ratio;
    canvas.style.width = width + "px";
    canvas.style.height = (y + rowH + 2) + "px";
    const g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.fillStyle = css.getPropertyValue("--muted").trim() || "#666";
    g.font = "11px system-ui, sans-serif";
    for (const [name, ly] of labels) g.fillText(name, 0, ly);
    for (const [nx, ny, , , n] of layout) {
      const dim = needle && !(n[0].includes(needle) || n[1].includes(needle));
      g.globalAlpha = dim ? 0.15 : 1;
      for (let i = 0; i < n[3].length; i++) {
        g.fillStyle = color[n[3][i]] || color.h;
        g.fillRect(nx + (i % 8) * cell, ny + Math.floor(i / 8) * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
      }
    }
    const at = (e) => {
      const r = canvas.getBoundingClientRect();
      const px = e.clientX - r.left, py = e.clientY - r.top;
      return layout.find(([nx, ny, w, h]) => px >= nx && px < nx + w && py >= ny && py < ny + h);
    };
    canvas.onmousemove = (e) => {
      const hit = at(e);
      if (hover) hover.textContent = hit ? `${hit[4][0]} (${hit[4][1] || "no rack"}): ${hit[4][2]}, ${[...hit[4][3]].filter((c) => c === "f").length} of ${hit[4][3].length} free${hit[4][4] ? ", held by " + hit[4][4] : ""}` : "";
      canvas.style.cursor = hit ? "pointer" : "default";
    };
    canvas.onclick = (e) => { const hit = at(e); if (hit) location.href = "/nodes/" + encodeURIComponent(hit[4][0]); };
    if (find && !find.dataset.bound) { find.dataset.bound = "1"; find.addEventListener("input", grid); }
    for (const b of document.querySelectorAll("[data-zoom]")) {
      if (b.dataset.bound) continue;
      b.dataset.bound = "1";
      b.addEventListener("click", () => { zoom = Math.min(24, Math.max(2, zoom + 2 * Number(b.dataset.zoom))); grid(); });
    }
    document.body.dataset.gridCells = String(layout.length);
    if (!window.__gridDrawnAt) window.__gridDrawnAt = performance.now();
  }

  localize(document);
  grid();
  if (!tail()) follow();
})();

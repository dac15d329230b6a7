// attnkit report: the head grid, the per-head panel and sortable tables. Hand-written, no library; it reads the
// data embedded in the page as JSON (the element with id "attnkit-data"; docs/files.md, "report.html").
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("attnkit-data").textContent);
  var M = D.L * D.H;
  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) {
      if (k === "text") e.textContent = attrs[k]; else if (k === "html") e.innerHTML = attrs[k];
      else e.setAttribute(k, attrs[k]);
    }
    (children || []).forEach(function (c) { if (c) e.appendChild(typeof c === "string" ? document.createTextNode(c) : c); });
    return e;
  }
  function fmt(v, d) { return v === null || v === undefined || isNaN(v) ? "–" : Number(v).toFixed(d === undefined ? 3 : d); }
  function signed(v, d) { return v === null || isNaN(v) ? "–" : (v >= 0 ? "+" : "") + Number(v).toFixed(d === undefined ? 2 : d); }
  function name(m) { return D.heads[m]; }
  function feat(n) {  // a feature name linked to its definition in docs/
    var a = el("a", {href: D.features.docs[n] || "#glossary", title: D.features.defs[n] || "", text: n});
    return a;
  }
  function headLink(m) {
    var a = el("a", {href: "#" + name(m), "class": "head", text: name(m)});
    a.addEventListener("click", function (ev) { ev.preventDefault(); select(m); });
    return a;
  }
  function table(header, rows, cls) {
    var t = el("table", {"class": cls || ""});
    t.appendChild(el("thead", {}, [el("tr", {}, header.map(function (h) { return el("th", {text: h}); }))]));
    var b = el("tbody");
    rows.forEach(function (r) {
      b.appendChild(el("tr", {}, r.map(function (c) { return el("td", {}, [c === null ? "–" : (c.nodeType ? c : String(c))]); })));
    });
    t.appendChild(b);
    return t;
  }

  // --- the grid: one cell per head, coloured by type or by a feature ------------------------------------------
  var colourBy = $("grid-colour");
  function shade(t) {  // white → blue, as the notebook view
    return "rgb(" + Math.round(255 - 222 * t) + "," + Math.round(255 - 160 * t) + "," + Math.round(255 - 75 * t) + ")";
  }
  function paint() {
    var what = colourBy ? colourBy.value : "type";
    var values = D.features.mean, j = D.features.names.indexOf(what), lo = Infinity, hi = -Infinity;
    if (what.indexOf("detected:") === 0 && D.detected) {  // a detect-heads score per head
      values = D.detected.scores; j = D.detected.kinds.indexOf(what.slice(9));
    }
    if (j >= 0) values.forEach(function (v, m) {
      if (!D.removed[m] && v[j] !== null) { lo = Math.min(lo, v[j]); hi = Math.max(hi, v[j]); }
    });
    document.querySelectorAll("#grid td[data-m]").forEach(function (td) {
      var m = +td.getAttribute("data-m");
      td.classList.toggle("removed", !!D.removed[m]);
      if (D.removed[m]) {  // pruned: no attention, no features, no type
        td.style.background = "";
        td.style.color = "";
        td.textContent = "×";
        td.title = name(m) + ": removed (pruned)";
      } else if (j < 0) {
        td.style.background = D.types.colors[D.types.label[m]];
        td.style.color = "#fff";
        td.textContent = D.types.short[D.types.label[m]];
        td.title = name(m) + ": " + D.types.names[D.types.label[m]];
      } else {
        var v = values[m][j], t = v === null ? 0 : (hi > lo ? (v - lo) / (hi - lo) : 0);
        td.style.background = shade(t);
        td.style.color = t < 0.55 ? "#000" : "#fff";
        td.textContent = fmt(v, 2);
        td.title = name(m) + ": " + what + " " + fmt(v, 4);
      }
    });
    var legend = $("grid-legend"), types = $("type-legend");
    if (legend) legend.textContent = j < 0 ? "" : what + ": white " + lo.toFixed(3) + " … blue " + hi.toFixed(3);
    if (types) types.style.display = j < 0 ? "" : "none";  // the types' colours mean nothing then
  }
  if (colourBy) colourBy.addEventListener("change", paint);
  document.querySelectorAll("#grid td[data-m]").forEach(function (td) {
    td.addEventListener("click", function () { select(+td.getAttribute("data-m")); });
  });

  // --- the panel of one head --------------------------------------------------------------------------------------
  var exampleFeature = null;
  function section(title, body) { return el("div", {"class": "part"}, [el("h4", {text: title}), body]); }

  function barWidth(j, v) {  // each feature on its own scale: shares on 0..1, entropies (nats) against ln n
    var sc = D.features.scale[j];
    return v === null ? 0 : Math.max(0, Math.min(1, v / sc.max));
  }
  function featuresPart(m) {
    var names = D.features.names, rows = [];
    names.forEach(function (n, j) {
      var v = D.features.mean[m][j], s = D.features.std[m][j], sc = D.features.scale[j];
      var bar = el("span", {"class": "bar " + sc.kind,
        title: sc.kind === "nats" ? fmt(v) + " of " + fmt(sc.max) + " nats (ln n, uniform attention)" : fmt(v) + " of the weight"});
      bar.style.width = barWidth(j, v) * 60 + "px";
      rows.push([feat(n), fmt(v), fmt(s), bar]);
    });
    return section("Features (mean and standard deviation over samples; bars: shares of the weight on 0–1, entropies in nats against ln n)",
      table(["feature", "mean", "std", ""], rows, "panel-table"));
  }

  function nearPart(m) {
    var box = el("div");
    [["js", "by Jensen-Shannon divergence per token (" + (D.near.js_source || "distances.npz") + ")"], ["feat", "by distance of the clustered features"]].forEach(function (k) {
      var list = D.near[k[0]];
      if (!list) return;
      var p = el("p", {}, ["Nearest heads " + k[1] + ": "]);
      list[m].forEach(function (pair, i) {
        if (i) p.appendChild(document.createTextNode(", "));
        p.appendChild(headLink(pair[0]));
        p.appendChild(document.createTextNode(" (" + fmt(pair[1], 4) + ")"));
      });
      box.appendChild(p);
    });
    return section("Distance to the other heads", box);
  }

  function examplesPart(m) {
    var E = D.examples;
    if (!E) return section("Examples", el("p", {"class": "note", text: E === null ? D.notes.examples : ""}));
    if (exampleFeature === null || E.features.indexOf(exampleFeature) < 0) exampleFeature = E.features[0];
    var pick = el("select", {id: "example-feature"});
    E.features.forEach(function (f) { var o = el("option", {value: f, text: f}); if (f === exampleFeature) o.selected = true; pick.appendChild(o); });
    var body = el("div");
    function fill() {
      body.innerHTML = "";
      [["top", "highest"], ["bottom", "lowest"]].forEach(function (k) {
        var rows = E[k[0]][exampleFeature][m].map(function (p) {
          return [String(p[0]), fmt(p[1]), E.texts[String(p[0])] === undefined ? "–" : E.texts[String(p[0])]];
        });
        body.appendChild(el("p", {"class": "sub", text: "Samples where " + exampleFeature + " is " + k[1] + ":"}));
        body.appendChild(table(["row", exampleFeature, "text"], rows, "panel-table examples-" + k[0]));
      });
    }
    pick.addEventListener("change", function () { exampleFeature = pick.value; fill(); });
    fill();
    return section("Top and bottom examples (per_sample.npy)", el("div", {}, [el("label", {}, ["feature ", pick]), body]));
  }

  function drawMap(canvas, bytes, n, tokens) {
    var cell = Math.max(4, Math.min(14, Math.floor(420 / n))), font = Math.min(10, cell) + "px sans-serif";
    var g = canvas.getContext("2d"), labels = tokens.map(function (t) { return String(t).slice(0, 14); });
    g.font = font;
    var pad = 6 + Math.ceil(Math.max.apply(null, labels.map(function (t) { return g.measureText(t).width; }).concat([10])));
    canvas.width = pad + n * cell + 2; canvas.height = pad + n * cell + 2;
    canvas.setAttribute("data-pad", String(pad));
    g = canvas.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, canvas.width, canvas.height);
    for (var s = 0; s < n; s++) for (var t = 0; t < n; t++) {
      var v = bytes[s * n + t] / 255;
      g.fillStyle = "rgb(" + Math.round(255 - 255 * v) + "," + Math.round(255 - 200 * v) + "," + Math.round(255 - 120 * v) + ")";
      g.fillRect(pad + t * cell, pad + s * cell, cell, cell);
    }
    g.fillStyle = "#333"; g.font = font; g.textBaseline = "middle";
    for (var i = 0; i < n; i++) {  // the whole label fits in the margin measured above (rows and columns)
      g.textAlign = "right"; g.fillText(labels[i], pad - 3, pad + i * cell + cell / 2);  // rows: ends left of the map
      // columns: turned a quarter to the left, a label runs upwards from just above the map (left-aligned: it
      // starts there; right-aligned, it would run down over the first rows)
      g.save(); g.translate(pad + i * cell + cell / 2, pad - 3); g.rotate(-Math.PI / 2); g.textAlign = "left";
      g.fillText(labels[i], 0, 0); g.restore();
    }
  }
  function mapBytes(i, m) {  // the map of example input i and head m: n × n bytes (weight / max · 255)
    var raw = atob(D.maps.data[i][m]), bytes = new Uint8Array(raw.length);
    for (var k = 0; k < raw.length; k++) bytes[k] = raw.charCodeAt(k);
    return bytes;
  }
  function mapsPart(m) {
    var P = D.maps;
    if (!P) return section("Example maps", el("p", {"class": "note", text: D.notes.maps}));
    var box = el("div", {"class": "maps"});
    P.texts.forEach(function (t, i) {
      var n = t.tokens.length, bytes = mapBytes(i, m);
      var c = el("canvas", {"class": "map", "data-n": String(n)});
      drawMap(c, bytes, n, t.tokens);
      box.appendChild(el("figure", {}, [c, el("figcaption", {text: "rows: queries, columns: keys; darker = more weight (max " + fmt(P.max[i][m], 2) + ")"})]));
    });
    return section("Example maps", box);
  }

  function probePart(m) {
    var P = D.probe;
    if (!P) return null;
    var rows = P.relations.map(function (r, i) { return [r, P.acc[m][i], P.baseline[i], P.acc[m][i] - P.baseline[i]]; });
    rows.sort(function (a, b) { return b[3] - a[3]; });
    return section("Syntax probe: accuracy per relation (" + P.source + ")",
      table(["relation", "accuracy", "baseline", "over baseline"], rows.map(function (r) { return [r[0], fmt(r[1]), fmt(r[2]), signed(r[3], 3)]; }), "panel-table probe"));
  }
  function patternsPart(m) {
    var P = D.patterns;
    if (!P) return null;
    var bar = el("div", {"class": "stack"});
    P.classes.forEach(function (c, i) {
      var s = el("span", {title: c + " " + (100 * P.shares[m][i]).toFixed(1) + "%"});
      s.style.width = 100 * P.shares[m][i] + "%"; s.style.background = P.colors[i];
      bar.appendChild(s);
    });
    return section("Pattern classes (patterns.json)", el("div", {}, [bar,
      table(["class", "share of examples"], P.classes.map(function (c, i) { return [c, (100 * P.shares[m][i]).toFixed(1) + "%"]; }), "panel-table patterns")]));
  }
  function ablationPart(m) {
    if (!D.ablation.length) return null;
    var layer = Math.floor(m / D.H);
    var rows = D.ablation.map(function (a) {
      if (a.score) return [a.experiment + " (" + a.source + ")", "importance " + fmt(a.score[m], 3) + " (rank " + a.rank[m] + " of " + M + ")"];
      var i = a.per === "layer" ? layer : m, d = a.delta[i];
      var ci = a.lo && a.lo[i] !== null ? " [" + signed(a.lo[i]) + ", " + signed(a.hi[i]) + "]" : "";
      var what = a.per === "layer" ? "when its layer " + layer + " is disabled" : "when disabled alone";
      return [a.experiment + " (" + a.source + ")", "Δ " + a.metric + " " + what + ": " + signed(d) + ci];
    });
    return section("Ablation", table(["experiment", "effect of this head"], rows, "panel-table ablation"));
  }

  function detectedPart(m) {
    var P = D.detected;
    if (!P) return null;
    var rows = P.kinds.map(function (k, i) {
      var v = P.scores[m][i], rank = 1;
      P.scores.forEach(function (s, o) { if (o !== m && !D.removed[o] && s[i] !== null && s[i] > v) rank++; });
      return [k, fmt(v), v === null ? "–" : rank + " of " + D.removed.filter(function (r) { return !r; }).length];
    });
    return section("Detected head scores (" + P.source + ")", table(["kind", "score", "rank"], rows, "panel-table detected"));
  }

  var current = -1;
  function select(m) {
    if (m < 0 || m >= M) return;
    current = m;
    document.querySelectorAll("#grid td.selected").forEach(function (td) { td.classList.remove("selected"); });
    var cell = document.querySelector('#grid td[data-m="' + m + '"]');
    if (cell) cell.classList.add("selected");
    var p = $("panel");
    p.innerHTML = "";
    var t = D.types.label[m], agree = D.types.agreement ? D.types.agreement[m] : null;
    var sw = el("span", {"class": "swatch"}); sw.style.background = D.types.colors[t];
    p.appendChild(el("h3", {id: "panel-title"}, [name(m) + " · layer " + Math.floor(m / D.H) + ", head " + (m % D.H)]));
    p.appendChild(el("p", {"class": "type"}, [sw, "type " + D.types.names[t] + (agree === null || agree === undefined ? "" : " (agreement over the stability fits " + fmt(agree, 2) + ")")]));
    if (D.removed[m]) {
      p.lastChild.textContent = "removed (pruned)";
      p.appendChild(el("p", {"class": "note removed-note", text: D.notes.removed}));
      p.setAttribute("data-head", name(m));
      if (location.hash !== "#" + name(m)) history.replaceState(null, "", "#" + name(m));
      return;
    }
    [featuresPart, nearPart, examplesPart, mapsPart, detectedPart, probePart, patternsPart, ablationPart].forEach(function (f) {
      var part = f(m); if (part) p.appendChild(part);
    });
    p.setAttribute("data-head", name(m));
    if (location.hash !== "#" + name(m)) history.replaceState(null, "", "#" + name(m));
  }

  // --- the example inputs: where each head (or a layer's heads) attends from a token, as bertviz's head view ------
  var HV = {text: 0, layer: 0, head: "all", pinned: null};
  var SVG = (function () {  // the SVG namespace, as the HTML parser gives it (the page names no address)
    var d = document.createElement("div"); d.innerHTML = "<svg></svg>"; return d.firstChild.namespaceURI;
  })();
  function svg(tag, attrs) {
    var e = document.createElementNS(SVG, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }
  function headColor(h) { return "hsl(" + Math.round(360 * h / D.H) + ",70%,42%)"; }
  var hvRow = 18, hvColW = 150, hvGap = 160;
  function hvBuild() {  // the tokens of the chosen input, once per input; hvLines draws the links
    var box = $("hv-draw");
    if (!box || !D.maps) return;
    var t = D.maps.texts[HV.text], n = t.tokens.length;
    var s = svg("svg", {width: 2 * hvColW + hvGap, height: n * hvRow + 10});
    s.appendChild(svg("g", {"class": "lines"}));
    t.tokens.forEach(function (tok, i) {
      [["q", hvColW, "end"], ["k", hvColW + hvGap, "start"]].forEach(function (side) {
        var txt = svg("text", {x: side[1], y: 5 + i * hvRow + hvRow / 2 + 4, "text-anchor": side[2],
          "class": "tok tok-" + side[0], "data-i": i});
        txt.textContent = String(tok);
        if (side[0] === "q") {
          txt.addEventListener("mouseenter", function () { hvLines(i); });
          txt.addEventListener("mouseleave", function () { hvLines(null); });
          txt.addEventListener("click", function () { HV.pinned = HV.pinned === i ? null : i; hvLines(i); });
        }
        s.appendChild(txt);
      });
    });
    box.innerHTML = "";
    box.appendChild(s);
    box.appendChild(el("p", {"class": "note", id: "hv-note"}));
    var legend = el("p", {"class": "note", id: "hv-legend"});
    for (var h = 0; h < D.H; h++) {
      var sw = el("span", {"class": "swatch"}); sw.style.background = headColor(h);
      legend.appendChild(sw); legend.appendChild(document.createTextNode("H" + h + " "));
    }
    box.appendChild(legend);
    hvLines(null);
  }
  function hvLines(hover) {
    var box = $("hv-draw");
    if (!box || !D.maps) return;
    var s = box.querySelector("svg"), lines = s.querySelector("g.lines");
    var t = D.maps.texts[HV.text], n = t.tokens.length;
    var from = hover === undefined || hover === null ? HV.pinned : hover;
    var heads = HV.head === "all" ? Array.apply(null, Array(D.H)).map(function (_, h) { return h; }) : [+HV.head];
    while (lines.firstChild) lines.removeChild(lines.firstChild);
    heads.forEach(function (h) {
      var m = HV.layer * D.H + h;
      if (D.removed[m]) return;
      var bytes = mapBytes(HV.text, m), mx = D.maps.max[HV.text][m];
      for (var q = 0; q < n; q++) {
        if (from !== null && q !== from) continue;
        for (var k = 0; k < n; k++) {
          var w = bytes[q * n + k] / 255 * mx;
          if (w < (from === null ? 0.1 : 0.01)) continue;  // without a chosen token only the strong links show
          lines.appendChild(svg("line", {x1: hvColW + 4, y1: 5 + q * hvRow + hvRow / 2, x2: hvColW + hvGap - 4,
            y2: 5 + k * hvRow + hvRow / 2, stroke: headColor(h), "stroke-opacity": Math.min(1, w * (heads.length > 1 ? 1.5 : 1.2)),
            "stroke-width": 1 + 3 * w, "data-q": q, "data-k": k, "data-h": h, "data-w": w.toFixed(4)}));
        }
      }
    });
    s.setAttribute("data-from", from === null ? "" : String(from));
    s.querySelectorAll("text.tok-q").forEach(function (e) { e.classList.toggle("chosen", +e.getAttribute("data-i") === from); });
    var removed = heads.filter(function (h) { return D.removed[HV.layer * D.H + h]; }).length;
    $("hv-legend").style.display = HV.head === "all" ? "" : "none";
    $("hv-note").textContent = (from === null ? "Links of weight ≥ 0.1 from every token; hover or click a token on the left." :
      "From “" + t.tokens[from] + "” (" + (HV.pinned === from ? "clicked; click again to release" : "hovered") + "), links of weight ≥ 0.01.") +
      (removed ? " " + removed + " removed head(s) of this layer draw nothing." : "");
  }
  function hvSetup() {
    if (!D.maps || !$("headview")) return;
    function fill(sel, items, value) {
      items.forEach(function (it) { var o = el("option", {value: String(it[0]), text: it[1]}); if (String(it[0]) === String(value)) o.selected = true; sel.appendChild(o); });
    }
    fill($("hv-text"), D.maps.texts.map(function (t, i) { return [i, (i + 1) + ": " + t.tokens.slice(0, 8).join(" ") + (t.tokens.length > 8 ? " …" : "")]; }), HV.text);
    fill($("hv-layer"), Array.apply(null, Array(D.L)).map(function (_, l) { return [l, "L" + l]; }), HV.layer);
    fill($("hv-head"), [["all", "all heads"]].concat(Array.apply(null, Array(D.H)).map(function (_, h) { return [h, "H" + h]; })), HV.head);
    $("hv-text").addEventListener("change", function () { HV.text = +this.value; HV.pinned = null; hvBuild(); });
    $("hv-layer").addEventListener("change", function () { HV.layer = +this.value; hvLines(null); });
    $("hv-head").addEventListener("change", function () { HV.head = this.value; hvLines(null); });
    hvBuild();
  }
  hvSetup();

  // --- sortable tables: click a header to sort by it (numbers as numbers), again to reverse ------------------------
  function sortable(t) {
    var ths = t.querySelectorAll("thead th");
    ths.forEach(function (th, col) {
      th.classList.add("sort");
      th.addEventListener("click", function (ev) {
        if (ev.target.closest("a")) return;  // a link in the header (a feature's definition) is followed instead
        var body = t.tBodies[0], rows = Array.prototype.slice.call(body.rows);
        var dir = th.getAttribute("data-dir") === "asc" ? "desc" : "asc";
        ths.forEach(function (o) { o.removeAttribute("data-dir"); });
        th.setAttribute("data-dir", dir);
        function key(r) {
          var s = r.cells[col] ? r.cells[col].textContent.trim() : "", x = parseFloat(s.replace("−", "-"));
          return isNaN(x) || !/^[-−+]?[0-9.]/.test(s) ? s : x;
        }
        rows.sort(function (a, b) {
          var x = key(a), y = key(b), c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
          return dir === "asc" ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  }
  document.querySelectorAll("table.sortable").forEach(sortable);

  paint();
  var start = D.heads.indexOf(location.hash.slice(1));
  select(start >= 0 ? start : 0);
  window.addEventListener("hashchange", function () {  // a link or the address names another head
    var m = D.heads.indexOf(location.hash.slice(1));
    if (m >= 0 && m !== current) select(m);
  });
  window.attnkitSelect = function (head) { select(D.heads.indexOf(head)); };
})();

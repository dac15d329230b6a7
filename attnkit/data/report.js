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
    var j = D.features.names.indexOf(what), lo = Infinity, hi = -Infinity;
    if (j >= 0) D.features.mean.forEach(function (v) { lo = Math.min(lo, v[j]); hi = Math.max(hi, v[j]); });
    document.querySelectorAll("#grid td[data-m]").forEach(function (td) {
      var m = +td.getAttribute("data-m");
      if (j < 0) {
        td.style.background = D.types.colors[D.types.label[m]];
        td.style.color = "#fff";
        td.textContent = D.types.short[D.types.label[m]];
        td.title = name(m) + ": " + D.types.names[D.types.label[m]];
      } else {
        var v = D.features.mean[m][j], t = hi > lo ? (v - lo) / (hi - lo) : 0;
        td.style.background = shade(t);
        td.style.color = t < 0.55 ? "#000" : "#fff";
        td.textContent = v.toFixed(2);
        td.title = name(m) + ": " + what + " " + v.toFixed(4);
      }
    });
    var legend = $("grid-legend");
    if (legend) legend.textContent = j < 0 ? "" : what + ": white " + lo.toFixed(3) + " … blue " + hi.toFixed(3);
  }
  if (colourBy) colourBy.addEventListener("change", paint);
  document.querySelectorAll("#grid td[data-m]").forEach(function (td) {
    td.addEventListener("click", function () { select(+td.getAttribute("data-m")); });
  });

  // --- the panel of one head --------------------------------------------------------------------------------------
  var exampleFeature = null;
  function section(title, body) { return el("div", {"class": "part"}, [el("h4", {text: title}), body]); }

  function featuresPart(m) {
    var names = D.features.names, rows = [];
    names.forEach(function (n, j) {
      var v = D.features.mean[m][j], s = D.features.std[m][j];
      var bar = el("span", {"class": "bar"});
      bar.style.width = Math.max(0, Math.min(1, v)) * 60 + "px";
      rows.push([feat(n), fmt(v), fmt(s), bar]);
    });
    return section("Features (mean and standard deviation over samples)", table(["feature", "mean", "std", ""], rows, "panel-table"));
  }

  function nearPart(m) {
    var box = el("div");
    [["js", "by Jensen-Shannon divergence per token (distances.npz)"], ["feat", "by distance of the clustered features"]].forEach(function (k) {
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
    var cell = Math.max(4, Math.min(14, Math.floor(420 / n))), pad = 70;
    canvas.width = pad + n * cell; canvas.height = pad + n * cell;
    var g = canvas.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, canvas.width, canvas.height);
    for (var s = 0; s < n; s++) for (var t = 0; t < n; t++) {
      var v = bytes[s * n + t] / 255;
      g.fillStyle = "rgb(" + Math.round(255 - 255 * v) + "," + Math.round(255 - 200 * v) + "," + Math.round(255 - 120 * v) + ")";
      g.fillRect(pad + t * cell, pad + s * cell, cell, cell);
    }
    g.fillStyle = "#333"; g.font = Math.min(10, cell) + "px sans-serif"; g.textAlign = "right"; g.textBaseline = "middle";
    for (var i = 0; i < n; i++) {
      var tok = String(tokens[i]).slice(0, 10);
      g.fillText(tok, pad - 3, pad + i * cell + cell / 2);
      g.save(); g.translate(pad + i * cell + cell / 2, pad - 3); g.rotate(-Math.PI / 2); g.fillText(tok, 0, 0); g.restore();
    }
  }
  function mapsPart(m) {
    var P = D.maps;
    if (!P) return section("Example maps", el("p", {"class": "note", text: D.notes.maps}));
    var box = el("div", {"class": "maps"});
    P.texts.forEach(function (t, i) {
      var raw = atob(P.data[i][m]), n = t.tokens.length, bytes = new Uint8Array(raw.length);
      for (var k = 0; k < raw.length; k++) bytes[k] = raw.charCodeAt(k);
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
    var rows = D.ablation.map(function (a) {
      if (a.score) return [a.experiment + " (" + a.source + ")", "importance " + fmt(a.score[m], 3) + " (rank " + a.rank[m] + " of " + M + ")"];
      var d = a.delta[m];
      var ci = a.lo && a.lo[m] !== null ? " [" + signed(a.lo[m]) + ", " + signed(a.hi[m]) + "]" : "";
      return [a.experiment + " (" + a.source + ")", "Δ " + a.metric + " when disabled alone: " + signed(d) + ci];
    });
    return section("Ablation", table(["experiment", "effect of this head"], rows, "panel-table ablation"));
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
    [featuresPart, nearPart, examplesPart, mapsPart, probePart, patternsPart, ablationPart].forEach(function (f) {
      var part = f(m); if (part) p.appendChild(part);
    });
    p.setAttribute("data-head", name(m));
    if (location.hash !== "#" + name(m)) history.replaceState(null, "", "#" + name(m));
  }

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

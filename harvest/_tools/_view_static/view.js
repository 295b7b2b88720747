// Lays the graph out with dagre (a compound graph: open groups are clusters, a
// closed group is one node standing for everything inside it), draws it as SVG
// and redraws when a group opens or closes. Each drawn node and edge carries
// data- attributes (its id, ends and position), which the tests read.
var root = document.getElementById("__ID__");
var data = JSON.parse(root.querySelector("script.hv-data").textContent);
var svg = root.querySelector("svg.hv-canvas");
var NS = "http://www.w3.org/2000/svg";
var BUDGET = 250;  // open groups level by level while at most this many nodes show
var CHAR = 7.3, LINE = 15;
var groups = {}, members = {}, byId = {};
data.groups.forEach(function (g) { groups[g.id] = g; members[g.id] = 0; });
data.nodes.forEach(function (n) {
  byId[n.id] = n;
  for (var g = n.group; g; g = groups[g].parent) members[g] += 1;
});
var open = {};
function depth(g) { var d = 0; for (; groups[g].parent; g = groups[g].parent) d += 1; return d; }
function rep(id, group) {  // the drawn element standing for a node: it, or its outermost closed group
  var r = id;
  for (var g = group; g; g = groups[g].parent) if (!open[g]) r = g;
  return r;
}
function shownCount() {
  var seen = {};
  data.nodes.forEach(function (n) { seen[rep(n.id, n.group)] = 1; });
  return Object.keys(seen).length;
}
function moduleAbove(g) {  // the nearest module group holding group g, or null
  for (var p = groups[g].parent; p; p = groups[p].parent) if (groups[p].kind === "module") return p;
  return null;
}
(function () {  // the first view
  var modules = data.groups.filter(function (g) { return g.kind === "module" && members[g.id] > 0; });
  if (modules.length) {
    // A model: its top-level modules are the map. Those that hold modules open (their
    // parts show as closed boxes, a click away); the rest stay closed, unless no
    // top-level module holds any (then each opens on its ops). Loops and branches
    // open as they are met, named calls stay closed.
    var holds = {};
    modules.forEach(function (g) { var p = moduleAbove(g.id); if (p) holds[p] = true; });
    var top = modules.filter(function (g) { return !moduleAbove(g.id); });
    var any = top.some(function (g) { return holds[g.id]; });
    top.forEach(function (g) { open[g.id] = !any || !!holds[g.id]; });
    data.groups.forEach(function (g) {
      if (g.kind !== "module" && !g.closed && members[g.id] > 0) open[g.id] = true;
    });
    return;
  }
  // A program without modules: whole levels of groups open while small enough.
  var levels = [];
  data.groups.forEach(function (g) {
    var d = depth(g.id);
    (levels[d] = levels[d] || []).push(g.id);
  });
  for (var d = 0; d < levels.length; d++) {
    var opened = levels[d].filter(function (g) { return !groups[g].closed && members[g] > 0; });
    opened.forEach(function (g) { open[g] = true; });
    if (d > 0 && shownCount() > BUDGET) {
      opened.forEach(function (g) { open[g] = false; });
      break;
    }
  }
})();
function lines(n) {
  var out, s = n.sites || [];
  if (n.kind === "input") out = [n.label, n.aval];
  else if (n.kind === "site" && n.op && n.op !== n.label) out = [n.label, n.op + " · " + n.aval];
  else out = [n.label, n.aval];
  s.forEach(function (e) { if (e.stats) out.push(e.stats.text); });
  return out;
}
function describe(n) {
  var s = (n.sites || []).map(function (e) { return e.name + " (" + e.tag + ", " + e.mode + ")"; });
  return (n.op || n.kind) + " " + n.aval + (s.length ? " · sites: " + s.join(", ") : "");
}
function text(parent, x, y, str, cls) {
  var t = document.createElementNS(NS, "text");
  t.setAttribute("x", x); t.setAttribute("y", y);
  if (cls) t.setAttribute("class", cls);
  t.textContent = str;
  parent.appendChild(t);
  return t;
}
function el(name, attrs, parent) {
  var e = document.createElementNS(NS, name);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function draw() {
  var G = new dagre.graphlib.Graph({compound: true});
  G.setGraph({rankdir: "TB", nodesep: 16, ranksep: 28, edgesep: 8, marginx: 10, marginy: 10});
  G.setDefaultEdgeLabel(function () { return {}; });
  var cluster = function (g) { return g && open[g] ? "c" + g : null; };
  data.groups.forEach(function (g) {
    if (!open[g.id] || rep(g.id, g.id) !== g.id) return;  // closed, or inside a closed one
    G.setNode("c" + g.id, {label: g.label, cluster: g});
  });
  data.groups.forEach(function (g) {
    if (rep(g.id, g.parent) !== g.id || open[g.id]) return;
    var label = "▸ " + g.label;
    var ls = [label, g.kind === "module" ? members[g.id] + " nodes" : g.op];
    G.setNode(g.id, {width: Math.max(ls[0].length, ls[1].length) * CHAR + 16,
                     height: 2 * LINE + 8, lines: ls, group: g});
    if (cluster(g.parent)) G.setParent(g.id, cluster(g.parent));
  });
  data.groups.forEach(function (g) {
    if (G.hasNode("c" + g.id) && cluster(g.parent)) G.setParent("c" + g.id, cluster(g.parent));
  });
  data.nodes.forEach(function (n) {
    if (rep(n.id, n.group) !== n.id) return;
    var ls = lines(n), wide = 0;
    ls.forEach(function (l) { wide = Math.max(wide, l.length); });
    G.setNode(n.id, {width: wide * CHAR + 16, height: ls.length * LINE + 8, lines: ls, node: n});
    if (cluster(n.group)) G.setParent(n.id, cluster(n.group));
  });
  data.edges.forEach(function (e) {
    var a = rep(e[0], byId[e[0]].group), b = rep(e[1], byId[e[1]].group);
    if (a !== b && !G.hasEdge(a, b)) G.setEdge(a, b);
  });
  dagre.layout(G);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  var size = G.graph();
  svg.setAttribute("viewBox", "0 0 " + Math.ceil(size.width + 20) + " " + Math.ceil(size.height + 20));
  zoom(1);
  var defs = el("defs", {}, svg);
  var marker = el("marker", {id: "__ID__-arrow", viewBox: "0 0 8 8", refX: 8, refY: 4,
                             markerWidth: 7, markerHeight: 7, markerUnits: "userSpaceOnUse",
                             orient: "auto"}, defs);
  el("path", {d: "M0,0 L8,4 L0,8 z", fill: "#99a"}, marker);
  var layers = {clusters: el("g", {}, svg), edges: el("g", {}, svg), nodes: el("g", {}, svg)};
  G.nodes().forEach(function (id) {
    var v = G.node(id);
    if (!v.cluster) return;
    var g = v.cluster;
    var box = el("g", {"class": "hv-cluster hv-" + g.kind, "data-group": g.id}, layers.clusters);
    el("rect", {x: v.x - v.width / 2, y: v.y - v.height / 2, width: v.width, height: v.height,
                rx: 5}, box);
    var head = text(box, v.x - v.width / 2 + 6, v.y - v.height / 2 + 12, "▾ " + g.label, "hv-head");
    head.addEventListener("click", function () { open[g.id] = false; draw(); });
  });
  var drawn = {};
  G.edges().forEach(function (e) {
    var pts = G.edge(e).points, d = "M" + pts[0].x + "," + pts[0].y;
    for (var i = 1; i < pts.length - 1; i++) {
      var mx = (pts[i].x + pts[i + 1].x) / 2, my = (pts[i].y + pts[i + 1].y) / 2;
      d += " Q" + pts[i].x + "," + pts[i].y + " " + (i === pts.length - 2 ? pts[i + 1].x + "," +
        pts[i + 1].y : mx + "," + my);
    }
    if (pts.length === 2) d += " L" + pts[1].x + "," + pts[1].y;
    var path = el("path", {d: d, "class": "hv-edge", "data-from": e.v, "data-to": e.w,
                           "marker-end": "url(#__ID__-arrow)"}, layers.edges);
    (drawn[e.v] = drawn[e.v] || []).push(path);
    (drawn[e.w] = drawn[e.w] || []).push(path);
  });
  var shapes = {};
  G.nodes().forEach(function (id) {
    var v = G.node(id);
    if (v.cluster) return;
    var n = v.node, g = v.group;
    var cls = n ? "hv-node hv-" + n.kind : "hv-node hv-closed hv-" + g.kind;
    var shape = el("g", {"class": cls, "data-node": id, "data-x": v.x.toFixed(1),
                         "data-y": v.y.toFixed(1)}, layers.nodes);
    shapes[id] = shape;
    var x0 = v.x - v.width / 2, y0 = v.y - v.height / 2;
    el("rect", {x: x0, y: y0, width: v.width, height: v.height, rx: n ? 3 : 6}, shape);
    v.lines.forEach(function (l, i) {
      text(shape, x0 + 8, y0 + 4 + LINE * (i + 1) - 3, l, "hv-t" + Math.min(i, 2));
    });
    var hist = n && (n.sites || []).filter(function (e) { return e.stats && e.stats.hist; })[0];
    if (hist) {
      var counts = hist.stats.hist, peak = Math.max.apply(null, counts.concat([1]));
      var h = el("g", {"class": "hv-hist"}, shape);
      counts.forEach(function (c, i) {
        var t = 12 * c / peak;
        el("rect", {x: x0 + v.width - 70 + 5 * i, y: y0 + v.height - 6 - t, width: 4, height: t}, h);
      });
      v.width += 0;
    }
    var title = el("title", {}, shape);
    title.textContent = n ? describe(n) : g.label + ": click to open";
    if (!n) shape.addEventListener("click", function () { open[g.id] = true; draw(); });
    shape.addEventListener("mouseenter", function () { light(id, true); });
    shape.addEventListener("mouseleave", function () { light(id, false); });
  });
  function light(id, on) {
    shapes[id].classList.toggle("hv-hot", on);
    (drawn[id] || []).forEach(function (p) {
      var into = p.getAttribute("data-to") === id;
      p.classList.toggle(into ? "hv-in" : "hv-out", on);
      var other = shapes[p.getAttribute(into ? "data-from" : "data-to")];
      if (other) other.classList.toggle(into ? "hv-src" : "hv-dst", on);
    });
    var info = root.querySelector(".hv-info"), v = G.node(id);
    info.textContent = on ? (v.node ? v.node.label + ": " + describe(v.node) : v.group.label) : "";
  }
  find();
}
var scale = 1, READABLE = 0.5;
function zoom(by) {  // by: a factor, "fit" (the whole graph in the pane's width) or
  // "first" (fit, but never below a readable size); the pane is as tall as the graph
  var box = svg.viewBox.baseVal, pane = root.querySelector(".hv-scroll");
  if (by === "fit" || by === "first") {
    var room = pane.clientWidth - 4;
    scale = room > 0 ? Math.min(1, room / box.width) : 1;
    if (by === "first") scale = Math.max(scale, READABLE);
  } else scale = Math.max(0.05, Math.min(4, scale * by));
  svg.setAttribute("width", Math.ceil(box.width * scale));
  svg.setAttribute("height", Math.ceil(box.height * scale));
}
function onInput() {  // scrolls the pane sideways to the program's first input
  var pane = root.querySelector(".hv-scroll"), first = null;
  data.nodes.forEach(function (n) {
    if (!first && n.kind === "input" && !n.group) first = n;
  });
  var shape = first && root.querySelector('[data-node="' + first.id + '"]');
  if (!shape) return;
  pane.scrollLeft = Math.max(0, +shape.dataset.x * scale - pane.clientWidth / 2);
}
root.querySelectorAll(".hv-zoom").forEach(function (b) {
  b.addEventListener("click", function () {
    var by = b.getAttribute("data-by");
    zoom(by === "fit" ? by : Number(by));
  });
});
var search = root.querySelector(".hv-search"), found = root.querySelector(".hv-found");
var hits = [], at = -1;
function find() {
  var q = search.value.trim().toLowerCase(), marked = {};
  hits = [];
  root.querySelectorAll(".hv-match").forEach(function (s) { s.classList.remove("hv-match"); });
  if (q) {
    data.nodes.forEach(function (n) {
      var names = [n.label].concat((n.sites || []).map(function (e) { return e.name; }));
      if (!names.some(function (s) { return s.toLowerCase().indexOf(q) >= 0; })) return;
      var r = rep(n.id, n.group);
      if (!marked[r]) hits.push(r);
      marked[r] = 1;
    });
    hits.forEach(function (id) {
      var s = root.querySelector('[data-node="' + id + '"]');
      if (s) s.classList.add("hv-match");
    });
  }
  found.textContent = q ? hits.length + (hits.length === 1 ? " match" : " matches") : "";
}
search.addEventListener("input", function () { at = -1; find(); });
search.addEventListener("keydown", function (ev) {
  if (ev.key !== "Enter" || !hits.length) return;
  at = (at + 1) % hits.length;
  var s = root.querySelector('[data-node="' + hits[at] + '"]');
  if (s) s.scrollIntoView({block: "center", inline: "center"});
});
root.harvestOpen = function (all, kind) {  // every group (of `kind`) open or closed, for tests
  data.groups.forEach(function (g) {
    if (!kind || g.kind === kind) open[g.id] = all && members[g.id] > 0;
  });
  draw();
};
draw();
zoom("first");
onInput();

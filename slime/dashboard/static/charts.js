// Small hand-written canvas charts: lines over time, bar histograms. No dependencies.
"use strict";
const Charts = (() => {
  const PALETTE = ["#2980b9", "#27ae60", "#e67e22", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400"];

  function frame(canvas) {
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.font = "11px sans-serif";
    return { ctx, left: 44, right: canvas.width - 8, top: 8, bottom: canvas.height - 22 };
  }

  function axes(f, ymax, xlabels) {
    const { ctx, left, right, top, bottom } = f;
    ctx.strokeStyle = "#ccc"; ctx.fillStyle = "#555";
    ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, bottom); ctx.lineTo(right, bottom); ctx.stroke();
    for (let i = 0; i <= 4; i++) {
      const y = bottom - (bottom - top) * i / 4;
      ctx.fillText(fmt(ymax * i / 4), 2, y + 4);
    }
    if (xlabels) {
      ctx.fillText(xlabels[0], left, bottom + 14);
      const w = ctx.measureText(xlabels[1]).width;
      ctx.fillText(xlabels[1], right - w, bottom + 14);
    }
  }

  function fmt(v) {
    if (!isFinite(v)) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10 || Number.isInteger(v)) return v.toFixed(0);
    return v.toFixed(2);
  }

  // series: [{name, color, points: [[x, y], ...]}]
  function lines(canvas, series, xlabels) {
    const f = frame(canvas);
    const all = series.flatMap(s => s.points);
    if (!all.length) { f.ctx.fillText("no data yet", f.left + 10, f.top + 20); return; }
    const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), ymin = Math.min(0, ...ys);
    const ymax = Math.max(...ys, 1e-9);
    axes(f, ymax, xlabels);
    const sx = x => f.left + (f.right - f.left) * (x1 > x0 ? (x - x0) / (x1 - x0) : 1);
    const sy = y => f.bottom - (f.bottom - f.top) * (y - ymin) / (ymax - ymin);
    series.forEach((s, i) => {
      f.ctx.strokeStyle = s.color || PALETTE[i % PALETTE.length]; f.ctx.lineWidth = 1.6; f.ctx.beginPath();
      s.points.forEach((p, j) => (j ? f.ctx.lineTo(sx(p[0]), sy(p[1])) : f.ctx.moveTo(sx(p[0]), sy(p[1]))));
      f.ctx.stroke();
    });
  }

  // bars: [{label, value}]; xlabels: [left, right] (default: the first and last bar's label)
  function bars(canvas, items, color, xlabels) {
    const f = frame(canvas);
    if (!items.length) { f.ctx.fillText("no data yet", f.left + 10, f.top + 20); return; }
    const ymax = Math.max(...items.map(b => b.value), 1e-9);
    axes(f, ymax, xlabels || [items[0].label, items[items.length - 1].label]);
    const w = (f.right - f.left) / items.length;
    f.ctx.fillStyle = color || PALETTE[0];
    items.forEach((b, i) => {
      const h = (f.bottom - f.top) * b.value / ymax;
      f.ctx.fillRect(f.left + i * w + 1, f.bottom - h, Math.max(1, w - 2), h);
    });
  }

  // hist: {edges, counts}; the axis shows the outer bin edges
  function histogram(canvas, hist, color) {
    const items = hist.counts.map((c, i) => ({ label: fmt(hist.edges[i]), value: c }));
    bars(canvas, items, color, hist.edges.length ? [fmt(hist.edges[0]), fmt(hist.edges[hist.edges.length - 1])] : null);
  }

  return { PALETTE, lines, bars, histogram, fmt };
})();

// The README's picture of the MLflow UI (make screenshot): ./mlflow.db served on loopback, the experiment's
// training-runs table in headless Chromium with every pipeline run expanded to its stage runs, written as a PNG.
// Usage, from the project root with .venv/bin on PATH: node docs/screenshot.mjs EXPERIMENT OUT.png
// (env CHROMIUM: the browser, default /usr/bin/chromium; the server always stops, whatever happens.)
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { createServer } from "node:net";
import { chromium } from "playwright-core";

const [experiment, out] = process.argv.slice(2);
if (!experiment || !out) throw new Error("usage: node docs/screenshot.mjs EXPERIMENT OUT.png");
if (!existsSync("mlflow.db")) throw new Error("no mlflow.db here: run the pipeline (twice, for two pipeline runs) first");

const port = await new Promise((resolve) => {
  const probe = createServer().listen(0, "127.0.0.1", () => {
    const { port } = probe.address();
    probe.close(() => resolve(port));
  });
});
const base = `http://127.0.0.1:${port}`;
let log = "";
const server = spawn(
  "mlflow", ["server", "--backend-store-uri", "sqlite:///mlflow.db", "--host", "127.0.0.1", "--port", `${port}`],
  { detached: true, stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, MLFLOW_SERVER_ENABLE_JOB_EXECUTION: "false" } },
);
for (const stream of [server.stdout, server.stderr]) stream.on("data", (chunk) => { log = (log + chunk).slice(-4000); });
let exited = false;
server.on("exit", () => { exited = true; });
// The server and its workers are a process group of their own: stop the whole group on every way out.
const signalGroup = (signal) => { try { process.kill(-server.pid, signal); return true; } catch { return false; } };
process.on("exit", () => signalGroup("SIGKILL")); // a crash or a signal; a no-op once stop() has run
for (const signal of ["SIGINT", "SIGTERM", "SIGHUP"]) process.on(signal, () => process.exit(130));
const stop = async () => {
  signalGroup("SIGTERM");
  for (let i = 0; i < 100 && signalGroup(0); i++) await new Promise((r) => setTimeout(r, 100));
  signalGroup("SIGKILL");
};

const api = async (path, body) => {
  const response = await fetch(`${base}/api/2.0/mlflow/${path}`, body && {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status} ${await response.text()}`);
  return response.json();
};

try {
  for (let started = Date.now(); ; await new Promise((r) => setTimeout(r, 500))) {
    if (exited) throw new Error(`mlflow server exited:\n${log}`);
    if (Date.now() - started > 120_000) throw new Error(`mlflow server not answering at ${base} after 120 s:\n${log}`);
    if (await fetch(`${base}/health`).then((r) => r.ok, () => false)) break;
  }
  const id = (await api(`experiments/get-by-name?experiment_name=${encodeURIComponent(experiment)}`)).experiment.experiment_id;
  const { runs = [] } = await api("runs/search", { experiment_ids: [id], filter: "tags.stage = 'pipeline'", max_results: 100 });
  console.log(`experiment ${experiment} (id ${id}): ${runs.length} pipeline run(s) at ${base}`);
  if (runs.length < 2) console.warn("warning: fewer than two pipeline runs: the picture shows no grouping to compare");

  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium" });
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 900 } });
    // workflowType=machine_learning: the training-runs table, not the GenAI overview.
    await page.goto(`${base}/#/experiments/${id}/runs?workflowType=machine_learning`);
    const expanders = page.locator('button[data-component-id*="runnamecellrenderer"]'); // on parent runs only
    await expanders.first().waitFor({ timeout: 60_000 });
    const close = page.locator('button[data-component-id="mlflow.assistant.chat_panel.close"]');
    if (await close.isVisible()) await close.click(); // the assistant side panel takes a third of the width
    const parents = await expanders.count();
    for (let i = 0; i < parents; i++) await expanders.nth(i).click();
    const rows = page.locator('.ag-center-cols-container [role="row"]');
    await page.waitForFunction((n) => document.querySelectorAll('.ag-center-cols-container [role="row"]').length > n, parents);
    // Widen the run-name column (stage names such as "evaluate@pretrain (cached)" are cut at its default width).
    const handle = await page.locator('.ag-header-cell[col-id="attributes.`Run Name`"] .ag-header-cell-resize').boundingBox();
    if (handle) {
      const [x, y] = [handle.x + 2, handle.y + handle.height / 2]; // its left part: the next header overlaps the rest
      await page.mouse.move(x, y);
      await page.mouse.down();
      await page.mouse.move(x + 90, y, { steps: 5 });
      await page.mouse.up();
    }
    await page.mouse.move(0, 0); // no hover or focus decorations in the picture
    await page.evaluate(() => document.activeElement?.blur());
    await page.waitForTimeout(1000); // the expanded rows' cells settle
    await page.screenshot({ path: out });
    console.log(`${out}: ${parents} pipeline runs expanded, ${await rows.count()} rows shown`);
  } finally {
    await browser.close();
  }
} finally {
  await stop();
}

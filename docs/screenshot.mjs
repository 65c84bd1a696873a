// The README's picture of the MLflow UI (make screenshot): ./mlflow.db served on loopback, the experiment's
// training-runs table in headless Chromium with every pipeline run expanded to its stage runs and the metric and
// param columns to compare them by, written as a PNG.
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
    // What to compare, as columns of the runs table: the evaluate stages' top1, the training stages' last-epoch
    // val_top1 and the param the two pipeline runs differ in (Created and Duration cannot be hidden). The table reads
    // its columns, their order and widths and the expanded runs from the experiment page's state in localStorage,
    // which its Columns selector and expanders save: seed that state before the page loads.
    const col = (group, key) => `${group}.\`${key}\``;
    const [name, dataset, source] = ["Run Name", "Dataset", "Source"].map((key) => col("attributes", key));
    const [top1, valTop1] = ["top1", "val_top1"].map((key) => col("metrics", key));
    const lr = col("params", "finetune.optimizer.lr_base");
    const state = {
      selectedColumns: [top1, valTop1, lr, dataset, source],
      columnOrder: [name, "runDateAndNestInfo", top1, valTop1, lr, "duration", dataset, source],
      columnWidths: {
        [name]: 250, runDateAndNestInfo: 130, [top1]: 115, [valTop1]: 115, [lr]: 180, [dataset]: 270, [source]: 110,
      },
      runsExpanded: Object.fromEntries(runs.map((run) => [run.info.run_id, true])),
    };
    const key = `MLflowLocalStorage-1.1-ExperimentPage-${JSON.stringify([id])}-ReactComponentState`;
    const context = await browser.newContext({
      viewport: { width: 1600, height: 900 },
      storageState: {
        cookies: [], origins: [{ origin: base, localStorage: [{ name: key, value: JSON.stringify(state) }] }],
      },
    });
    const page = await context.newPage();
    // workflowType=machine_learning: the training-runs table, not the GenAI overview.
    await page.goto(`${base}/#/experiments/${id}/runs?workflowType=machine_learning`);
    const rows = page.locator('.ag-center-cols-container [role="row"]');
    await rows.nth(runs.length).waitFor({ timeout: 60_000 }).catch((cause) => { // more rows than pipeline runs
      throw new Error(`the runs table at ${page.url()} shows no stage rows under the pipeline runs`, { cause });
    });
    await page.locator(`.ag-header-cell[col-id="${top1}"]`).waitFor({ timeout: 10_000 }).catch((cause) => {
      throw new Error("no top1 column: the runs table ignored the seeded state (a changed MLflow UI?)", { cause });
    });
    const close = page.locator('button[data-component-id="mlflow.assistant.chat_panel.close"]');
    if (await close.isVisible()) await close.click(); // the assistant side panel takes a third of the width
    await page.mouse.move(0, 0); // no hover decorations in the picture
    await page.waitForTimeout(1000); // the expanded rows' cells settle
    await page.screenshot({ path: out });
    console.log(`${out}: ${runs.length} pipeline runs expanded, ${await rows.count()} rows shown`);
  } finally {
    await browser.close();
  }
} finally {
  await stop();
}

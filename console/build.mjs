// Builds the console into src/space/console/static/ (committed, shipped in the Python package):
// app-<hash>.js and app-<hash>.css bundled and minified by esbuild, index.html (a template the
// API fills with a fresh CSP nonce per answer) and manifest.json, which records the hash of
// every input (the sources, package.json, the lock file, this script) and output, so a test
// can tell without node that the committed bundle is what these sources build to.
import { createHash } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.resolve(here, process.argv[2] ?? "../src/space/console/static");
const sha256 = (data) => createHash("sha256").update(data).digest("hex");

function files(dir) {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    return entry.isDirectory() ? files(full) : [full];
  });
}

const result = await esbuild.build({
  entryPoints: { app: path.join(here, "src/main.jsx") },
  bundle: true,
  minify: true,
  format: "iife",
  target: ["chrome110", "firefox115", "safari16"],
  jsx: "automatic",
  jsxImportSource: "preact",
  entryNames: "[name]-[hash]",
  outdir: out,
  write: false,
  logLevel: "warning",
});

fs.mkdirSync(out, { recursive: true });
for (const name of fs.readdirSync(out)) fs.rmSync(path.join(out, name));
const outputs = {};
const written = {};
for (const file of result.outputFiles) {
  const name = path.basename(file.path);
  fs.writeFileSync(path.join(out, name), file.contents);
  outputs[name] = sha256(file.contents);
  written[path.extname(name)] = name;
}
const index = fs
  .readFileSync(path.join(here, "src/index.html"), "utf8")
  .replace("{{js}}", `assets/${written[".js"]}`)
  .replace("{{css}}", `assets/${written[".css"]}`);
fs.writeFileSync(path.join(out, "index.html"), index);
outputs["index.html"] = sha256(index);

const inputs = {};
for (const file of [...files(path.join(here, "src")), ...["package.json", "package-lock.json", "build.mjs"].map((f) => path.join(here, f))].sort()) {
  inputs[path.relative(here, file).split(path.sep).join("/")] = sha256(fs.readFileSync(file));
}
const manifest = { esbuild: esbuild.version, inputs, outputs: Object.fromEntries(Object.entries(outputs).sort()) };
fs.writeFileSync(path.join(out, "manifest.json"), JSON.stringify(manifest, null, 2) + "\n");
console.log(`console built into ${out}: ${Object.keys(outputs).join(", ")}`);

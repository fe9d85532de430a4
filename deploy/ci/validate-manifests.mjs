// Validates rendered Kubernetes manifests against the Kubernetes (kubernetes-models) and
// prometheus-operator (@kubernetes-models/prometheus-operator) JSON schemas.
//
//   node validate-manifests.mjs MODULES_DIR manifests.json
//
// manifests.json: [{"source": "specd/templates/x.yaml", "doc": {...}}, ...] (scripts/
// check-deploy.sh converts `helm template` output to it). MODULES_DIR is the node_modules folder
// the packages were installed into. Every document must have a known apiVersion and kind: an
// unknown kind fails rather than going unchecked.
import { pathToFileURL } from "node:url";
import { readFileSync } from "node:fs";
import path from "node:path";

const [modulesDir, input] = process.argv.slice(2);
if (!modulesDir || !input) {
  console.error("usage: node validate-manifests.mjs MODULES_DIR manifests.json");
  process.exit(2);
}

// apiVersion -> module folder below MODULES_DIR.
function modulePath(apiVersion) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return path.join(modulesDir, "@kubernetes-models/prometheus-operator", group, version, "index.js");
  }
  return path.join(modulesDir, "kubernetes-models", group === "" ? version : `${group}/${version}`, "index.js");
}

const manifests = JSON.parse(readFileSync(input, "utf8"));
let failures = 0;
const counts = {};
for (const { source, doc } of manifests) {
  const where = `${source}: ${doc?.kind ?? "?"} ${doc?.metadata?.name ?? "?"}`;
  if (!doc || typeof doc.apiVersion !== "string" || typeof doc.kind !== "string") {
    console.error(`FAIL ${where}: no apiVersion or kind`);
    failures++;
    continue;
  }
  let mod;
  try {
    mod = await import(pathToFileURL(modulePath(doc.apiVersion)).href);
  } catch (e) {
    console.error(`FAIL ${where}: no schema for apiVersion ${doc.apiVersion} (${e.code ?? e.message})`);
    failures++;
    continue;
  }
  const Model = mod[doc.kind];
  if (typeof Model !== "function" || Model.apiVersion !== doc.apiVersion) {
    console.error(`FAIL ${where}: no schema for ${doc.apiVersion} ${doc.kind}`);
    failures++;
    continue;
  }
  try {
    new Model(doc).validate();
    counts[doc.kind] = (counts[doc.kind] ?? 0) + 1;
  } catch (e) {
    console.error(`FAIL ${where}: ${e.message}`);
    failures++;
  }
}
const summary = Object.entries(counts).map(([k, n]) => `${n} ${k}`).join(", ");
if (failures) {
  console.error(`validate-manifests: ${failures} invalid of ${manifests.length} (${input})`);
  process.exit(1);
}
if (manifests.length === 0) {
  console.error(`validate-manifests: no manifests in ${input}`);
  process.exit(1);
}
console.log(`validate-manifests: ${manifests.length} valid (${summary})`);

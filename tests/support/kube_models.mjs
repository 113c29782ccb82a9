// Validate Kubernetes objects with the models of @kubernetes-models (generated from the CRDs and
// OpenAPI of Istio and Kubernetes, with their validation). Usage:
//   node kube_models.mjs NODE_MODULES_DIR < objects.json
// objects.json is a JSON array; prints one JSON line per object ({kind, name, errors}) and exits 1
// when any object is invalid or of a kind this script has no model for.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const MODELS = {
  "networking.istio.io/v1 ServiceEntry": "@kubernetes-models/istio/networking.istio.io/v1/ServiceEntry.js",
  "security.istio.io/v1 AuthorizationPolicy":
    "@kubernetes-models/istio/security.istio.io/v1/AuthorizationPolicy.js",
  "networking.k8s.io/v1 NetworkPolicy": "kubernetes-models/networking.k8s.io/v1/NetworkPolicy.js",
};

const modules = process.argv[2];
const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = false;
for (const object of objects) {
  const key = `${object.apiVersion} ${object.kind}`;
  const name = object.metadata?.name ?? "";
  const path = MODELS[key];
  if (!path) {
    failed = true;
    console.log(JSON.stringify({ kind: key, name, errors: ["no model for this kind"] }));
    continue;
  }
  const module = await import(pathToFileURL(join(modules, path)).href);
  const Model = module[object.kind];
  const errors = [];
  try {
    new Model(object).validate();
  } catch (err) {
    errors.push(String(err.message ?? err));
  }
  failed ||= errors.length > 0;
  console.log(JSON.stringify({ kind: key, name, errors }));
}
process.exit(failed ? 1 : 0);

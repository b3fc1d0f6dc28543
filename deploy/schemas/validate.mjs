// Validate custom resources against their CRDs' OpenAPI schemas (prometheus-operator's PodMonitor,
// ServiceMonitor, PrometheusRule and AlertmanagerConfig; KEDA's ScaledObject), as
// compiled by kubernetes-models. Reads a JSON array of manifests on stdin; prints one JSON line per
// manifest: {"kind", "name", "errors"} (errors empty when valid). Run from a directory where
// `npm ci` installed package-lock.json (scripts/crd-schemas does that).
import { readFileSync } from "node:fs";
import { PodMonitor, PrometheusRule, ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
import { AlertmanagerConfig } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1alpha1";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const models = { PodMonitor, PrometheusRule, ServiceMonitor, ScaledObject, AlertmanagerConfig };
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  const Model = models[doc.kind];
  let errors = [];
  if (!Model) {
    errors = [`no schema for kind ${doc.kind}`];
  } else {
    try {
      new Model(doc).validate();
    } catch (error) {
      errors = String(error.message).split(", ");
    }
  }
  console.log(JSON.stringify({ kind: doc.kind, name: doc.metadata?.name ?? "", errors }));
}

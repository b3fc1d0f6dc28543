"""Regenerate deploy/k8s/base/monitoring.yaml from deploy/prometheus/alerts.yml and
deploy/alertmanager/alertmanager.yml (tests/deploy keeps them equal): the PodMonitor, the
PrometheusRule carrying the alert groups, and the AlertmanagerConfig carrying the routes and
inhibit rules. Run after editing either file: `.venv/bin/python scripts/gen_monitoring.py`."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HEAD = """# PodMonitor (every pod labelled steadyrl.io/metrics: the services; the orchestrator exports Redis's memory),
# PrometheusRule (the same groups as deploy/prometheus/alerts.yml) and AlertmanagerConfig (the
# routes and inhibit rules of deploy/alertmanager/alertmanager.yml; its receivers are placeholders):
# tests keep them equal. Generated from those files by scripts/gen_monitoring.py.
# `release: kube-prometheus-stack` is the label kube-prometheus-stack selects them by (its default
# selectors): patch it to your release's name.
"""


# every target's `run` label (so `up` has it too) from its pod's steadyrl.io/run; the services'
# own samples carry the same one (honorLabels keeps theirs)
RUN = [{"sourceLabels": ["__meta_kubernetes_pod_label_steadyrl_io_run"], "targetLabel": "run"}]


class Dumper(yaml.SafeDumper):
    pass


Dumper.add_representer(
    str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None)
)


def matchers(texts: list[str]) -> list[dict]:
    """Alertmanager matchers (`name="value"`, `name=~"regex"`) as AlertmanagerConfig's; "=" is its default."""
    out = []
    for text in texts:
        name, op, value = re.fullmatch(r'(\w+)(=~|!=|!~|=)"(.*)"', text).groups()
        out.append({"name": name, "value": value, **({"matchType": op} if op != "=" else {})})
    return out


def main() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    am = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    route = am["route"]
    meta = {"name": "steadyrl", "labels": {"release": "kube-prometheus-stack"}}
    docs = [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": {"steadyrl.io/metrics": "true"}},
                "podMetricsEndpoints": [
                    {**endpoint, "interval": "10s", "honorLabels": True, "relabelings": RUN}
                    for endpoint in ({"port": "metrics"}, {"port": "http", "path": "/metrics"})
                ],
            },
        },
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta, "spec": rules},
        {
            "apiVersion": "monitoring.coreos.com/v1alpha1",
            "kind": "AlertmanagerConfig",
            "metadata": meta,
            "spec": {
                "route": {
                    "receiver": route["receiver"],
                    "groupBy": route["group_by"],
                    "groupWait": route["group_wait"],
                    "groupInterval": route["group_interval"],
                    "repeatInterval": route["repeat_interval"],
                    "routes": [
                        {"receiver": r["receiver"], "matchers": matchers(r["matchers"])} for r in route["routes"]
                    ],
                },
                "receivers": [{"name": r["name"]} for r in am["receivers"]],
                "inhibitRules": [
                    {
                        "sourceMatch": matchers(r["source_matchers"]),
                        "targetMatch": matchers(r["target_matchers"]),
                        "equal": r.get("equal", []),
                    }
                    for r in am["inhibit_rules"]
                ],
            },
        },
    ]
    text = HEAD + "---\n".join(
        yaml.dump(d, Dumper=Dumper, sort_keys=False, width=120, allow_unicode=True) for d in docs
    )
    (ROOT / "deploy" / "k8s" / "base" / "monitoring.yaml").write_text(text)


if __name__ == "__main__":
    main()

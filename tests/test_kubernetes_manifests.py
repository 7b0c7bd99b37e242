"""deploy/kubernetes/ (issue 17), checked offline: no cluster exists where infergate is
developed. `kubernetes-validate --strict` checks every manifest against the API schemas
of the oldest Kubernetes we support; the rest checks what the schemas cannot: the probes'
paths, that the grace period outlasts the preStop pause plus the drain, that the profile
in the ConfigMap loads and points at the Redis Service, that the HPA's metric exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from infergate.metrics import Metrics
from infergate.profile import load_profile

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
OLDEST_KUBERNETES = "1.27.0"


def _validate(*files: Path) -> subprocess.CompletedProcess[str]:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    return subprocess.run(
        [str(tool), "--strict", "--kubernetes-version", OLDEST_KUBERNETES, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_every_manifest_passes_strict_validation() -> None:
    files = sorted(MANIFESTS.glob("*.yaml"))
    assert len(files) >= 6
    result = _validate(*files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The check above would catch a misspelt field (so its pass means something)."""
    bad = tmp_path / "bad.yaml"
    text = (MANIFESTS / "deployment.yaml").read_text()
    bad.write_text(text.replace("terminationGracePeriodSeconds", "terminationGracePeriod"))
    assert _validate(bad).returncode != 0


def test_the_deployment_drains_before_it_is_killed(tmp_path: Path) -> None:
    docs = _documents()
    pod = docs[("Deployment", "infergate")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "startupProbe" in container
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"

    profile = tmp_path / "default.toml"
    profile.write_text(docs[("ConfigMap", "infergate-profile")]["data"]["default.toml"])
    loaded = load_profile(profile)
    assert pod["terminationGracePeriodSeconds"] > float(pause[1]) + loaded.server.drain_timeout_s
    redis = docs[("Service", "infergate-redis")]
    port = redis["spec"]["ports"][0]["port"]
    assert loaded.cluster.redis_url == f"redis://{redis['metadata']['name']}:{port}/0"
    assert docs[("Deployment", "infergate-redis")]


def test_the_autoscaler_reads_a_metric_infergate_exports() -> None:
    docs = _documents()
    hpa = docs[("HorizontalPodAutoscaler", "infergate")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert name in exported
    rules = docs[("ConfigMap", "infergate-adapter-rules")]["data"]["config.yaml"]
    assert yaml.safe_load(rules)["rules"][0]["name"]["as"] == name
    assert docs[("PodDisruptionBudget", "infergate")]["spec"]["maxUnavailable"] == 1

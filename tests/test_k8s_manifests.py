"""The Kubernetes manifests of ``deploy/k8s/``, checked without a cluster.

- Every object validates, strictly (unknown fields refused), against the Kubernetes OpenAPI schemas that
  ``kubernetes-validate`` bundles, and ``kustomization.yaml`` lists every manifest.
- The parts agree with each other and with the commands they run: every flag of a ``tilert decode`` /
  ``tilert router`` command is one its parser accepts and the config it makes validates (the cluster's paths
  aside); the prefill's command is one stock vLLM's server parser accepts, with TileRTConnector; the router's
  ``--decode`` entries name the StatefulSet's pods through its headless Service and the node's ports, its
  ``--prefill-url`` the prefill Service; Services, probes and scrape annotations name ports the containers
  serve; the shared secret is a mounted file named by ``TILERT_SECRET_FILE`` and never on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from tilert.auth import MIN_SECRET_BYTES, SECRET_ENV, SECRET_FILE_ENV
from tilert.cli import parser
from tilert.decode.config import DecodeConfig
from tilert.router.config import RouterConfig
from tilert.settings import build_config, cli_values

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# The oldest Kubernetes the manifests are meant for, and the newest the installed kubernetes-validate knows.
VERSIONS = sorted({"1.30", kubernetes_validate.latest_version()})
GPU = "nvidia.com/gpu"
PARTS = ("prefill", "decode", "router")  # app.kubernetes.io/component of each part's pods
TEST_SECRET = b"k" * 32

Obj = dict[str, Any]


def load(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


OBJECTS: list[tuple[str, Obj]] = [(p.name, obj) for p in MANIFESTS for obj in load(p)]


def find(kind: str, component: str | None = None) -> Obj:
    """The one object of ``kind`` (of the part ``component``, by its label)."""
    found = [
        obj
        for _, obj in OBJECTS
        if obj["kind"] == kind
        and (component is None or obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


def workload(component: str) -> Obj:
    """The Deployment or StatefulSet that runs the part ``component``."""
    kinds = {"prefill": "Deployment", "decode": "StatefulSet", "router": "Deployment"}
    return find(kinds[component], component)


def pod_spec(component: str) -> Obj:
    return workload(component)["spec"]["template"]["spec"]


def container(component: str) -> Obj:
    containers = pod_spec(component)["containers"]
    assert len(containers) == 1, f"{component}: one container per pod"
    return containers[0]


def command(component: str) -> list[str]:
    c = container(component)
    return [*c.get("command", []), *c.get("args", [])]


def flag(cmd: list[str], name: str) -> str:
    """The value of the flag ``name`` in ``cmd`` (given once)."""
    values = flags(cmd, name)
    assert len(values) == 1, f"{name} given {len(values)} times in {cmd}"
    return values[0]


def flags(cmd: list[str], name: str) -> list[str]:
    out = []
    for i, arg in enumerate(cmd):
        if arg == name:
            out.append(cmd[i + 1])
        elif arg.startswith(name + "="):
            out.append(arg.split("=", 1)[1])
    return out


def parse_tilert(cmd: list[str]) -> argparse.Namespace:
    """``cmd`` (``tilert SUBCOMMAND ...``) parsed by ``tilert``'s own parser; a refusal fails with its message."""
    assert cmd[0] == "tilert", cmd
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser().parse_args(cmd[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(cmd)}` is refused by tilert's parser: {err.getvalue().strip()}")


def container_port(c: Obj, port: int | str) -> int:
    """A probe's or Service's port (a number, or a container port's name) as the container port it names."""
    declared = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    numbers = {p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, str) and not port.isdigit():
        assert port in declared, f"container {c['name']} has no port named {port!r}: {sorted(declared)}"
        return declared[port]
    assert int(port) in numbers, f"container {c['name']} does not expose port {port}: {sorted(numbers)}"
    return int(port)


def serving_port(component: str) -> int:
    """The port the part's own server listens on (/health, /metrics), read from its command."""
    cmd = command(component)
    return int(flag(cmd, "--http-port" if component == "decode" else "--port"))


def service_port(service: Obj, component: str, port: int) -> int:
    """The container port that ``service``'s ``port`` reaches."""
    match = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert match, f"Service {service['metadata']['name']} has no port {port}"
    return container_port(container(component), match[0].get("targetPort", port))


def env(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def probes(c: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in c:
            yield kind, c[kind]


# ---------------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "obj"), OBJECTS, ids=[f"{n}:{o['kind']}" for n, o in OBJECTS])
def test_manifest_validates_strictly(name: str, obj: Obj, version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}")


def test_the_validation_refuses_an_unknown_field() -> None:
    """The strict schemas are in use: a misspelt field is an error, not ignored."""
    obj = json.loads(json.dumps(find("StatefulSet", "decode")))
    obj["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


def test_every_part_has_its_workload() -> None:
    for component in PARTS:
        assert workload(component)["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == (
            component
        )


# ---------------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------------


def test_decode_command_parses_and_its_config_validates(tmp_path: Path) -> None:
    cmd = command("decode")
    args = parse_tilert(cmd)
    assert args.command == "decode"
    values = cli_values(DecodeConfig, args)
    assert str(values["model"]).startswith("/models/")
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")  # the checkpoint exists only in the cluster
    pod_ip = {k: "10.1.2.3" for k, v in values.items() if v == "$(POD_IP)"}  # Kubernetes expands it in the pod
    build_config(DecodeConfig, {**values, **pod_ip, "model": tmp_path}, secret=TEST_SECRET).validate()


def test_router_command_parses_and_its_config_validates(tmp_path: Path) -> None:
    cmd = command("router")
    args = parse_tilert(cmd)
    assert args.command == "router"
    values = cli_values(RouterConfig, args)
    assert values["model_dir"].startswith("/models/")
    build_config(RouterConfig, {**values, "model_dir": str(tmp_path)}, secret=TEST_SECRET).validate()


@pytest.fixture(scope="module")
def prefill_args() -> argparse.Namespace:
    """The prefill's command parsed by stock vLLM's own server parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # lazy: vLLM takes seconds to import
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = command("prefill")
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"], cmd
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    except SystemExit:
        pytest.fail(f"vLLM's server refuses the prefill's command: {err.getvalue().strip()[-2000:]}")


def test_prefill_runs_stock_vllm_with_the_connector(prefill_args: argparse.Namespace) -> None:
    kv = prefill_args.kv_transfer_config
    assert kv.kv_connector == "TileRTConnector"
    assert kv.kv_connector_module_path == "tilert.connector"
    assert kv.kv_role == "kv_producer"
    assert prefill_args.host == "0.0.0.0"
    assert prefill_args.model.startswith("/models/")


def test_prefill_and_decode_agree(prefill_args: argparse.Namespace) -> None:
    decode = cli_values(DecodeConfig, parse_tilert(command("decode")))
    router = cli_values(RouterConfig, parse_tilert(command("router")))
    assert prefill_args.dtype == decode["dtype"], "vLLM's --dtype must be the decode nodes'"
    assert prefill_args.max_model_len == decode["max_seq_len"], "vLLM's --max-model-len: the nodes' --max-seq-len"
    assert prefill_args.model == str(decode["model"]) == router["model_dir"], "one checkpoint for the three parts"


def test_tensor_parallel_matches_the_gpus(prefill_args: argparse.Namespace) -> None:
    decode = cli_values(DecodeConfig, parse_tilert(command("decode")))
    decode_gpus = int(container("decode")["resources"]["limits"][GPU])
    assert decode.get("tp", 1) == decode_gpus, f"--tp {decode.get('tp', 1)} on a pod of {decode_gpus} GPUs"
    prefill_gpus = int(container("prefill")["resources"]["limits"][GPU])
    assert prefill_args.tensor_parallel_size == prefill_gpus
    assert GPU not in container("router")["resources"].get("limits", {}), "the router needs no GPU"


def test_decode_binds_an_address_the_prefill_can_reach() -> None:
    """The TCP transport gives the prefill the address it binds as the KV data's destination: not a wildcard."""
    c = container("decode")
    host = flag(command("decode"), "--host")
    assert host not in ("0.0.0.0", "::", ""), "a wildcard --host would send the KV data to the prefill's own pod"
    assert host == "$(POD_IP)"
    assert env(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_every_variable_a_command_expands_is_defined() -> None:
    for component in PARTS:
        c = container(component)
        for arg in command(component):
            for name in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert name in env(c), f"{component}: {arg!r} expands ${name}, which the container does not set"


# ---------------------------------------------------------------------------------------------------
# How the parts reach each other
# ---------------------------------------------------------------------------------------------------


def test_router_decode_entries_name_the_statefulset_pods() -> None:
    sts = find("StatefulSet", "decode")
    headless = find("Service", "decode")
    assert headless["spec"]["clusterIP"] == "None", "the decode Service must be headless (one DNS name a pod)"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    name, service = sts["metadata"]["name"], headless["metadata"]["name"]
    expected_hosts = [f"{name}-{i}.{service}" for i in range(sts["spec"]["replicas"])]
    decode = cli_values(DecodeConfig, parse_tilert(command("decode")))
    nodes = cli_values(RouterConfig, parse_tilert(command("router")))["decode_nodes"]
    hosts = [n.host for n in nodes]
    assert [h.removesuffix(".svc.cluster.local").split(".")[:2] for h in hosts] == [
        h.split(".") for h in expected_hosts
    ], f"--decode {hosts}: one per StatefulSet pod, {expected_hosts}"
    for node in nodes:
        assert node.ctrl_port == decode["ctrl_port"] and node.http_port == decode["http_port"], node
        assert service_port(headless, "decode", node.ctrl_port) == decode["ctrl_port"]
        assert service_port(headless, "decode", node.http_port) == decode["http_port"]


def test_router_prefill_url_names_the_prefill_service(prefill_args: argparse.Namespace) -> None:
    url = urlparse(flag(command("router"), "--prefill-url"))
    service = find("Service", "prefill")
    assert url.scheme == "http" and url.path in ("", "/")
    assert url.hostname == service["metadata"]["name"]
    assert url.port is not None
    assert service_port(service, "prefill", url.port) == prefill_args.port


def test_router_service_reaches_the_router() -> None:
    service = find("Service", "router")
    assert [service_port(service, "router", p["port"]) for p in service["spec"]["ports"]] == [serving_port("router")]


@pytest.mark.parametrize("component", PARTS)
def test_service_selects_the_pods(component: str) -> None:
    service = find("Service", component)
    spec = workload(component)["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    others = [c for c in PARTS if c != component]
    for other in others:
        other_labels = workload(other)["spec"]["template"]["metadata"]["labels"]
        assert not service["spec"]["selector"].items() <= other_labels.items(), f"also selects the {other} pods"


@pytest.mark.parametrize("component", PARTS)
def test_probes_hit_health_on_the_serving_port(component: str) -> None:
    c = container(component)
    http = [(kind, p["httpGet"]) for kind, p in probes(c) if "httpGet" in p]
    assert "readinessProbe" in [kind for kind, _ in http], f"{component}: no HTTP readiness probe"
    for kind, get in http:
        assert get["path"] == "/health", f"{component} {kind}: {get['path']}"
        assert container_port(c, get["port"]) == serving_port(component), f"{component} {kind}: port {get['port']}"
    for kind, probe in probes(c):
        if "tcpSocket" in probe:
            assert container_port(c, probe["tcpSocket"]["port"]) == serving_port(component), kind


@pytest.mark.parametrize("component", PARTS)
def test_scrape_annotations_name_an_exposed_port(component: str) -> None:
    annotations = workload(component)["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/path") == "/metrics"
    port = annotations.get("prometheus.io/port", "")
    assert port.isdigit(), f"prometheus.io/port {port!r}"
    assert container_port(container(component), int(port)) == serving_port(component)


def test_router_runs_replicated() -> None:
    assert find("Deployment", "router")["spec"].get("replicas", 1) >= 2


@pytest.mark.parametrize("component", PARTS)
def test_model_volume_is_mounted_read_only(component: str) -> None:
    pvc = find("PersistentVolumeClaim")
    volumes = {v["name"]: v for v in pod_spec(component)["volumes"]}
    mounts = {m["mountPath"]: m for m in container(component)["volumeMounts"]}
    mount = mounts.get("/models")
    assert mount is not None and mount.get("readOnly") is True, f"{component}: /models not mounted read-only"
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]


# ---------------------------------------------------------------------------------------------------
# The shared secret
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("component", PARTS)
def test_secret_is_a_mounted_file_named_by_the_environment(component: str) -> None:
    secret = find("Secret")
    keys = {*secret.get("data", {}), *secret.get("stringData", {})}
    c = container(component)
    volumes = {v["name"]: v for v in pod_spec(component)["volumes"]}
    path = env(c).get(SECRET_FILE_ENV, {}).get("value")
    assert path, f"{component}: {SECRET_FILE_ENV} is not set"
    for mount in c.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")
        if source is None or source["secretName"] != secret["metadata"]["name"]:
            continue
        assert mount.get("readOnly") is True
        files = {item["path"]: item["key"] for item in source.get("items", [])} or {k: k for k in keys}
        inside = {f"{mount['mountPath'].rstrip('/')}/{name}": key for name, key in files.items()}
        assert path in inside, f"{component}: {SECRET_FILE_ENV}={path} is none of the mounted files {sorted(inside)}"
        assert inside[path] in keys, f"{component}: the Secret has no key {inside[path]!r}"
        assert source.get("defaultMode", 0o644) & 0o077 == 0, f"{component}: the secret file is readable by others"
        return
    pytest.fail(f"{component}: the Secret {secret['metadata']['name']} is not mounted")


def test_no_secret_on_a_command_line_or_in_a_variable() -> None:
    secret = find("Secret")
    values = [str(v) for v in secret.get("stringData", {}).values()] + list(secret.get("data", {}).values())
    for component in PARTS:
        cmd = command(component)
        assert not [a for a in cmd if a.startswith("--secret")], f"{component}: {cmd}"
        assert not [v for v in values if any(v in a for a in cmd)], f"{component}: the secret's value in {cmd}"
        assert SECRET_ENV not in env(container(component)), f"{component}: ${SECRET_ENV} holds the secret itself"


def test_placeholder_secret_cannot_start_a_part() -> None:
    """The placeholder is shorter than the secret every part requires: nothing starts before the real one."""
    for value in find("Secret").get("stringData", {}).values():
        assert len(str(value).encode()) < MIN_SECRET_BYTES

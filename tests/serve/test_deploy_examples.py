"""examples/deploy/: the Dockerfile and Kubernetes manifests agree with `trtbuild serve` and with each other.

Nothing here runs docker or kubectl; the manifests are checked against toolchain.serve's public constants.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from toolchain import serve

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
K8S = DEPLOY / "kubernetes"


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.rglob("*.y*ml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def _one(kind: str) -> dict[str, Any]:
    found = [doc for doc in _manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {K8S}, found {len(found)}"
    return found[0]


def _pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """The Deployment's pod template and its only container."""
    template = _one("Deployment")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    return template, container


def _dockerfile() -> dict[str, str]:
    """Instruction -> its arguments (the last occurrence), continuation lines joined."""
    instructions = {}
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, rest = line.strip().partition(" ")
            instructions[name.upper()] = rest.strip()
    return instructions


def _image_argv() -> list[str]:
    df = _dockerfile()
    # Exec (JSON) form: in shell form /bin/sh is PID 1 and SIGTERM never reaches the server, so it would not drain.
    return json.loads(df.get("ENTRYPOINT", "[]")) + json.loads(df.get("CMD", "[]"))


def _pod_argv() -> list[str]:
    """What Kubernetes runs: `command` replaces ENTRYPOINT (and drops CMD), `args` replaces CMD."""
    _, c = _pod()
    df = _dockerfile()
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    return json.loads(df.get("ENTRYPOINT", "[]")) + c.get("args", json.loads(df.get("CMD", "[]")))


def _serve_args(argv: list[str]) -> tuple[str, dict[str, str]]:
    """`trtbuild serve ENGINE_DIR --opt value ...` -> (ENGINE_DIR, {--opt: value})."""
    assert argv[:2] == ["trtbuild", "serve"], argv
    positional, options = [], {}
    tokens = iter(argv[2:])
    for token in tokens:
        name, eq, value = token.partition("=")
        if token == "--log-requests":
            options[token] = "true"
        elif token.startswith("--"):
            options[name] = value if eq else next(tokens)
        else:
            positional.append(token)
    assert len(positional) == 1, f"one ENGINE_DIR expected: {positional}"
    return positional[0], options


def _resolve_port(ref: int | str, container: dict[str, Any]) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    return ref if isinstance(ref, int) else named[ref]


def _mount_holding(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (volumeMount, volume) whose mountPath contains `path`."""
    template, c = _pod()
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is in no volumeMount of the container"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, volumes[mount["name"]]


def test_every_manifest_parses() -> None:
    files = sorted(K8S.rglob("*.y*ml"))
    assert {"deployment.yaml", "service.yaml", "secret-example.yaml"} <= {f.name for f in files}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} has no document"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"]["name"], path


def test_port_and_probes_match_the_server() -> None:
    _, c = _pod()
    _, options = _serve_args(_pod_argv())
    assert int(options.get("--port", serve.DEFAULT_PORT)) == serve.DEFAULT_PORT
    assert serve.DEFAULT_PORT in [p["containerPort"] for p in c["ports"]]
    assert c["livenessProbe"]["httpGet"]["path"] == serve.HEALTH_PATH
    assert c["readinessProbe"]["httpGet"]["path"] == serve.READY_PATH
    if "startupProbe" in c:
        assert c["startupProbe"]["httpGet"]["path"] == serve.HEALTH_PATH
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in c:
            assert _resolve_port(c[probe]["httpGet"]["port"], c) == serve.DEFAULT_PORT, probe


def test_service_reaches_the_server_port() -> None:
    template, c = _pod()
    spec = _one("Service")["spec"]
    assert spec["selector"].items() <= template["metadata"]["labels"].items()
    (port,) = spec["ports"]
    assert _resolve_port(port["targetPort"], c) == serve.DEFAULT_PORT


def test_prometheus_scrapes_the_metrics_path() -> None:
    annotations = _pod()[0]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == serve.DEFAULT_PORT
    assert annotations["prometheus.io/path"] == serve.METRICS_PATH


def test_grace_period_outlasts_the_drain() -> None:
    template, c = _pod()
    _, options = _serve_args(_pod_argv())
    drain = float(options.get("--drain-timeout", serve.DEFAULT_DRAIN_TIMEOUT_S))
    # SIGTERM, and so the drain, starts only after the preStop hook; the grace period counts from before it.
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop_s + drain
    assert grace >= serve.DEFAULT_DRAIN_TIMEOUT_S


def test_keys_and_engine_come_from_their_volumes() -> None:
    engine, options = _serve_args(_pod_argv())
    # Anything but loopback needs --api-keys (the server refuses otherwise), and the kubelet probes the pod IP.
    assert options["--host"] == "0.0.0.0"
    keys = options["--api-keys"]

    mount, volume = _mount_holding(keys)
    assert "secret" in volume, f"{keys} must come from a Secret volume"
    relative = str(PurePosixPath(keys).relative_to(mount["mountPath"]))
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    assert not items or relative in items, f"{relative} is not among the Secret volume's items {sorted(items)}"
    secret = _one("Secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert items.get(relative, relative) in {**secret.get("data", {}), **secret.get("stringData", {})}

    mount, volume = _mount_holding(engine)
    assert mount.get("readOnly") is True, "the engine must be mounted read-only"
    assert "persistentVolumeClaim" in volume or "image" in volume


def test_dockerfile_matches_the_deployment() -> None:
    df = _dockerfile()
    assert [int(p.split("/")[0]) for p in df["EXPOSE"].split()] == [serve.DEFAULT_PORT]
    assert _image_argv() == _pod_argv()

"""examples/deploy/: the Dockerfile and Kubernetes manifests agree with `trtbuild serve` and with each other.
The LeaderWorkerSet (lws.yaml, a multi-rank engine over several pods) also with torchrun and with LWS.

Nothing here runs docker or kubectl; the manifests are checked against toolchain.serve's public constants.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml

import toolchain
from toolchain import serve

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
K8S = DEPLOY / "kubernetes"


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.rglob("*.y*ml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [doc for doc in _manifests() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {K8S}, found {len(found)}"
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


def _mount_holding(
    path: str, pod: tuple[dict[str, Any], dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (volumeMount, volume) whose mountPath contains `path`, in `pod` (template, container): the Deployment's
    by default."""
    template, c = pod or _pod()
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is in no volumeMount of the container"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, volumes[mount["name"]]


def test_every_manifest_parses() -> None:
    files = sorted(K8S.rglob("*.y*ml"))
    assert {"deployment.yaml", "service.yaml", "secret-example.yaml", "lws.yaml"} <= {f.name for f in files}
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
    spec = _one("Service", "trtbuild-serve")["spec"]
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


# -- lws.yaml: one multi-rank engine over a LeaderWorkerSet group --------------------------------------------------
# What the LWS controller sets in every container of a group (kubernetes-sigs/lws, api constants LwsLeaderAddress,
# LwsGroupSize, LwsWorkerIndex); $(NAME) in command/args expands from the container's environment.
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def _lws() -> dict[str, Any]:
    return dict(_one("LeaderWorkerSet")["spec"])


def _lws_pod(role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's or a worker's pod template and its only container."""
    template = _lws()["leaderWorkerTemplate"][f"{role}Template"]
    (container,) = template["spec"]["containers"]
    return template, container


def _torchrun(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """`torchrun --opt=value ... -m toolchain ARGS` -> ({--opt: value}, ["trtbuild", *ARGS])."""
    argv = [*container["command"], *container.get("args", [])]
    assert argv[0] == "torchrun", argv
    options: dict[str, str] = {}
    tokens = iter(argv[1:])
    for token in tokens:
        if token == "-m":
            assert next(tokens) == "toolchain"  # `python -m toolchain` is the `trtbuild` script (toolchain/__main__.py)
            assert (Path(toolchain.__file__).parent / "__main__.py").is_file()
            return options, ["trtbuild", *tokens]
        name, eq, value = token.partition("=")
        options[name.replace("_", "-")] = value if eq else next(tokens)
    raise AssertionError(f"no `-m toolchain` in {argv}")


def _env(container: dict[str, Any]) -> dict[str, str]:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"{container['name']}: an env name twice: {names}"
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}


def test_lws_recreates_the_whole_group_and_starts_workers_after_the_leader() -> None:
    doc = _one("LeaderWorkerSet")
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = _lws()
    assert spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert isinstance(group["size"], int) and group["size"] >= 2


def test_every_rank_runs_the_same_torchrun_command_sized_by_the_group() -> None:
    (leader_opts, leader_argv), (worker_opts, worker_argv) = (_torchrun(_lws_pod(r)[1]) for r in ("leader", "worker"))
    # the same command everywhere: rank 0 serves, the others stay inside open_engine (D10)
    assert (leader_opts, leader_argv) == (worker_opts, worker_argv)
    assert leader_opts["--nnodes"] == "$(LWS_GROUP_SIZE)"  # one torchrun node per pod of the group
    assert leader_opts["--node-rank"] == "$(LWS_WORKER_INDEX)"  # the leader (index 0) holds global rank 0
    assert leader_opts["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    _, leader = _lws_pod("leader")
    assert int(leader_opts["--master-port"]) == _resolve_port("rendezvous", leader)
    per_pod = int(leader_opts["--nproc-per-node"])
    for role in ("leader", "worker"):
        gpus = _lws_pod(role)[1].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is None and per_pod == 1) or (gpus is not None and int(gpus) == per_pod), role
    assert _lws()["leaderWorkerTemplate"]["size"] * per_pod >= 2  # a multi-rank engine: else use deployment.yaml
    engine, options = _serve_args(leader_argv)
    assert engine == "/engine" and options["--host"] == "0.0.0.0"
    assert int(options.get("--port", serve.DEFAULT_PORT)) == serve.DEFAULT_PORT


def _reads_env(name: str) -> bool:
    """Whether toolchain or torch.distributed (torchrun) reads environment variable `name`."""
    roots = [Path(toolchain.__file__).parent, Path(torch.__file__).parent / "distributed"]
    return any(f'"{name}"' in f.read_text(errors="replace") for root in roots for f in root.rglob("*.py"))


def test_lws_env_names_exist() -> None:
    for role in ("leader", "worker"):
        _, c = _lws_pod(role)
        env = _env(c)
        for word in [*c["command"], *c.get("args", [])]:
            for name in re.findall(r"\$\((\w+)\)", word):
                assert name in LWS_ENV | set(env), f"{role}: $({name}) is neither set by LWS nor in env"
        for name in env:
            assert _reads_env(name), f"{role}: nothing reads env {name}"
    leader, worker = (_env(_lws_pod(role)[1]) for role in ("leader", "worker"))
    assert leader == worker  # the collective timeout above all: both ends of a collective wait as long


def test_lws_probes_ports_and_metrics_on_the_leader_only() -> None:
    template, leader = _lws_pod("leader")
    assert serve.DEFAULT_PORT in [p["containerPort"] for p in leader["ports"]]
    assert leader["livenessProbe"]["httpGet"]["path"] == serve.HEALTH_PATH
    assert leader["readinessProbe"]["httpGet"]["path"] == serve.READY_PATH
    assert leader["startupProbe"]["httpGet"]["path"] == serve.HEALTH_PATH
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert _resolve_port(leader[probe]["httpGet"]["port"], leader) == serve.DEFAULT_PORT, probe
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == serve.DEFAULT_PORT
    assert annotations["prometheus.io/path"] == serve.METRICS_PATH
    _, worker = _lws_pod("worker")  # ranks > 0 never listen for HTTP: a probe there could only fail
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(worker)


def test_lws_grace_outlasts_the_drain_and_torchruns_shutdown() -> None:
    template, leader = _lws_pod("leader")
    _, options = _serve_args(_torchrun(leader)[1])
    drain = float(options.get("--drain-timeout", serve.DEFAULT_DRAIN_TIMEOUT_S))
    # torchrun passes SIGTERM on to rank 0 and kills its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later (default 30)
    shutdown = float(_env(leader).get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    assert shutdown > drain
    pre_stop = leader.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop_s + shutdown
    worker_template, worker = _lws_pod("worker")  # the workers' ranks must live until rank 0 stops them
    assert worker_template["spec"]["terminationGracePeriodSeconds"] >= grace
    assert float(_env(worker).get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)) >= shutdown


def test_lws_keys_on_the_leader_engine_read_only_everywhere() -> None:
    leader_pod, worker_pod = _lws_pod("leader"), _lws_pod("worker")
    engine, options = _serve_args(_torchrun(leader_pod[1])[1])
    keys = options["--api-keys"]
    mount, volume = _mount_holding(keys, leader_pod)
    assert volume["secret"]["secretName"] == _one("Secret")["metadata"]["name"]
    relative = str(PurePosixPath(keys).relative_to(mount["mountPath"]))
    assert relative in {i["path"] for i in volume["secret"]["items"]}
    for pod in (leader_pod, worker_pod):
        mount, volume = _mount_holding(engine, pod)
        assert mount.get("readOnly") is True, "the engine must be mounted read-only"
        assert volume["persistentVolumeClaim"]["readOnly"] is True
    # a rank > 0 never reads the keys (server.prepare), so the Secret stays on the leader
    assert not any("secret" in v for v in worker_pod[0]["spec"].get("volumes", []))


def test_lws_service_selects_the_leader_only() -> None:
    template, leader = _lws_pod("leader")
    service = _one("Service", "trtbuild-serve-tp")["spec"]
    selector = dict(service["selector"])
    assert selector.pop(LWS_WORKER_INDEX_LABEL) == "0"  # set by LWS on every pod: "0" is the leader
    assert selector.items() <= template["metadata"]["labels"].items()
    (port,) = service["ports"]
    assert _resolve_port(port["targetPort"], leader) == serve.DEFAULT_PORT


def test_lws_runs_the_deployments_image() -> None:
    image = _pod()[1]["image"]
    assert [_lws_pod(role)[1]["image"] for role in ("leader", "worker")] == [image, image]
    assert re.search(r"^RUN pip install .*\btorch\b", (DEPLOY / "Dockerfile").read_text(), re.M)  # and torchrun

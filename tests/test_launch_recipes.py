"""The launch recipes of examples/launch/, checked offline: every torchrun command line in them parses with torchrun's
own argument parser into an elastic job of the ``dynatrain`` rendezvous backend that the backend accepts; the
Kubeflow manifest builds the training SDK's PyTorchJob models with no field left over, and, with the ``PET_*``
variables its operator derives from the elastic policy, runs such a command; the shell scripts pass ``bash -n``
and run against stand-ins for torchrun and SLURM's commands (the joining allocation reaches the first one's
endpoint). `test_a_broken_recipe_is_caught` breaks each recipe in a few ways and expects these checks to fail."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "examples" / "launch"
SCRIPTS = ("torchrun.sh", "slurm-first.sbatch", "slurm-join.sbatch")
MANIFEST = "pytorchjob-elastic.yaml"
# The --rdzv-conf keys the dynatrain backend documents (torchrun itself always adds ``timeout``).
RDZV_CONF_KEYS = {"token_file", "last_call", "timeout"}
# Values a script computes at run time (command substitutions, the scheduler's variables), for the static parse.
RUNTIME = {"HOME": "/home/alice", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[001-002]", "HEAD": "node001"}
# slurm-join.sbatch takes its values from the job file slurm-first.sbatch writes: statically, from that script.
VALUES_FROM = {"slurm-join.sbatch": "slurm-first.sbatch"}
EXAMPLE_TOKEN = "0123456789abcdef"


# ---- shell text -----------------------------------------------------------------------------------------------------
def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash-newline continuations joined, as bash reads them."""
    return text.replace("\\\n", " ").splitlines()


_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::-([^}]*))?\}|\$([A-Za-z_]\w*)")


def expand(text: str, values: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced from ``values``; KeyError for a name without one."""
    if "$(" in text or "`" in text:
        raise ValueError(f"a command substitution cannot be checked offline: {text.strip()}")

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in values:
            return values[name]
        if m.group(2) is not None:
            return expand(m.group(2), values)
        raise KeyError(name)

    return _VAR.sub(one, text)


def script_values(text: str, runtime: dict[str, str]) -> dict[str, str]:
    """The variables a script assigns, in order, resolved where they do not depend on a command's output."""
    values = dict(runtime)
    for line in logical_lines(text):
        m = re.match(r"\s*(?:export\s+)?([A-Za-z_]\w*)=(\S.*)?$", line)
        if not m or line.lstrip().startswith("#"):
            continue
        with contextlib.suppress(ValueError, KeyError):
            words = shlex.split(expand(m.group(2) or "", values), comments=True)
            values[m.group(1)] = " ".join(words)
    return values


def torchrun_lines(text: str, values: dict[str, str]) -> list[tuple[list[str], list[str]]]:
    """Every command line that runs torchrun: (the words before torchrun, e.g. ``srun ...``; torchrun's arguments)."""
    found = []
    for line in logical_lines(text):
        if line.lstrip().startswith("#") or "torchrun" not in shlex.split(line, comments=True):
            continue
        words = shlex.split(expand(line, values), comments=True)
        at = words.index("torchrun")
        args = words[at + 1:]
        for i, w in enumerate(args):
            if w in {";", "&&", "||", "|", "&"}:
                args = args[:i]
                break
        found.append((words[:at], args))
    return found


def sbatch_options(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^#SBATCH\s+(--[\w-]+)(?:[= ](\S+))?", text, re.MULTILINE):
        out[m.group(1)] = m.group(2) or ""
    return out


# ---- torchrun -------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def environ(env: dict[str, str]):
    """os.environ without any PET_* or token variable, plus ``env``; restored afterwards."""
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith("PET_") or k == "DYNATRAIN_TOKEN"]:
            del os.environ[key]
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # config_from_args sets it otherwise
        os.environ.update(env)
        yield


def parse_torchrun(args: list[str], env: dict[str, str] | None = None):
    """torchrun's own parse of its arguments, under ``env`` (torchrun reads PET_* as its flags' defaults)."""
    from torch.distributed.run import config_from_args, get_args_parser

    with environ(env or {}):
        usage = io.StringIO()
        try:
            with contextlib.redirect_stderr(usage):
                parsed = get_args_parser().parse_args(args)
        except SystemExit:
            raise AssertionError(f"torchrun refuses {shlex.join(args)}: {usage.getvalue().splitlines()[-1]}") from None
        log_dir = parsed.log_dir
        if log_dir is None:
            parsed.log_dir = os.devnull  # torchrun would make a temporary directory for the logs here
        config, _, _ = config_from_args(parsed)
        parsed.log_dir = log_dir
    return parsed, config


def check_training_command(parsed, nproc: int, min_nodes: int, max_nodes: int, where: str) -> None:
    """`-m dynatrain.cli fit --config RECIPE ...` with a recipe that exists, a Trainer without num_nodes whose devices
    are the node's processes, parallel=auto, and a global batch that every world of MIN..MAX nodes keeps."""
    assert parsed.module and parsed.training_script == "dynatrain.cli", f"{where}: runs {parsed.training_script}"
    rest = list(parsed.training_script_args)
    assert rest[:1] == ["fit"], f"{where}: `dynatrain.cli {shlex.join(rest)}` is not fit"
    overrides, i = {}, 1
    while i < len(rest):
        key, eq, value = rest[i].partition("=")
        assert key.startswith("--"), f"{where}: stray argument {rest[i]!r}"
        if not eq:
            i, value = i + 1, rest[i + 1]
        overrides[key[2:]] = value
        i += 1
    recipe = REPO / overrides["config"]
    assert recipe.is_file(), f"{where}: --config {overrides['config']} is not a file of the repository"
    cfg = yaml.safe_load(recipe.read_text())

    def setting(dotted: str):
        if dotted in overrides:
            return overrides[dotted]
        node = cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    assert setting("trainer.num_nodes") in (None, 1, "1"), f"{where}: an elastic job's Trainer needs no num_nodes"
    assert int(setting("trainer.devices")) == nproc, f"{where}: trainer.devices is not --nproc-per-node {nproc}"
    assert setting("trainer.strategy.init_args.parallel") == "auto", \
        f"{where}: a fixed layout cannot cover worlds of {min_nodes} to {max_nodes} nodes; give parallel auto"
    batch, micro = int(setting("data.global_batch_size")), int(setting("data.micro_batch_size"))
    for nodes in range(min_nodes, max_nodes + 1):
        assert batch % (nodes * nproc * micro) == 0, \
            f"{where}: {nodes} nodes x {nproc} ranks x micro-batch {micro} do not divide the global batch {batch}"


def check_agent(args: list[str], where: str, env: dict[str, str] | None = None, token_in_env: bool = False):
    """One torchrun agent's command line: parsed by torchrun, an elastic dynatrain job, accepted by the backend."""
    parsed, config = parse_torchrun(args, env)
    assert parsed.rdzv_backend == "dynatrain", f"{where}: --rdzv-backend is {parsed.rdzv_backend!r}"
    assert re.fullmatch(r"\d+:\d+", parsed.nnodes), f"{where}: --nnodes {parsed.nnodes} is not MIN:MAX"
    assert 1 <= config.min_nodes < config.max_nodes, f"{where}: --nnodes {parsed.nnodes} leaves no room to grow"
    host, _, port = config.rdzv_endpoint.rpartition(":")
    assert host and port.isdigit() and int(port) > 0, f"{where}: --rdzv-endpoint {config.rdzv_endpoint!r}"
    assert config.run_id not in ("", "none"), f"{where}: give the job an --rdzv-id"
    unknown = set(config.rdzv_configs) - RDZV_CONF_KEYS
    assert not unknown, f"{where}: --rdzv-conf {sorted(unknown)} unknown to the backend"
    assert token_in_env or "token_file" in config.rdzv_configs, f"{where}: no token (token_file or $DYNATRAIN_TOKEN)"
    assert config.max_restarts >= 1, f"{where}: a failed worker should be restarted to rejoin (--max-restarts)"
    assert parsed.shutdown_timeout is not None, f"{where}: give --shutdown-timeout (a step plus a switch)"
    check_training_command(parsed, config.nproc_per_node, config.min_nodes, config.max_nodes, where)
    check_backend_accepts(config, token_in_env, where)
    return parsed, config


def check_backend_accepts(config, token_in_env: bool, where: str) -> None:
    """The backend's creator (what its ``torchrun.handlers`` entry point returns) makes a handler from these
    parameters, built as torchrun's `launch_agent` builds them; no connection is made. A token file is replaced by one
    holding an example token."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from dynatrain.elastic.rendezvous import handler_creator

    conf = dict(config.rdzv_configs)
    with contextlib.ExitStack() as stack:
        if "token_file" in conf:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            (tmp / "token").write_text(EXAMPLE_TOKEN + "\n")
            conf["token_file"] = str(tmp / "token")
        stack.enter_context(environ({"DYNATRAIN_TOKEN": EXAMPLE_TOKEN} if token_in_env else {}))
        params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes,
                                      max_nodes=config.max_nodes, local_addr=config.local_addr, **conf)
        try:
            handler = handler_creator()(params)
        except ValueError as e:
            raise AssertionError(f"{where}: the dynatrain backend refuses it: {e}") from None
    assert handler.get_run_id() == config.run_id


# ---- the shell recipes ----------------------------------------------------------------------------------------------
def check_script(name: str, text: str, values_text: str | None = None) -> list:
    """Every torchrun line of a shell recipe, with example values for its variables."""
    values = script_values(values_text, RUNTIME) if values_text else dict(RUNTIME)
    values = script_values(text, values)
    lines = torchrun_lines(text, values)
    assert lines, f"{name}: no torchrun command line"
    out = []
    for k, (before, args) in enumerate(lines):
        where = f"{name}, torchrun line {k + 1}"
        parsed, config = check_agent(args, where)
        if name.endswith(".sbatch"):
            check_sbatch(text, before, config, where)
        out.append((before, args, config))
    # Agents of one job: a first node and a later one disagree on nothing.
    assert len({shlex.join(args) for _, args, _ in out}) == 1, f"{name}: its torchrun lines differ"
    return out


def check_sbatch(text: str, before: list[str], config, where: str) -> None:
    opts = sbatch_options(text)
    assert before[:1] == ["srun"] and "--ntasks-per-node=1" in before, \
        f"{where}: one torchrun agent per node is `srun --ntasks-per-node=1 torchrun ...`"
    assert "--kill-on-bad-exit=0" in before, f"{where}: a node that ends must not end the others' tasks"
    assert opts.get("--ntasks-per-node") == "1", f"{where}: #SBATCH --ntasks-per-node=1"
    assert int(opts["--gpus-per-node"]) == config.nproc_per_node, f"{where}: --nproc-per-node is not the node's GPUs"
    assert int(opts["--nodes"]) <= config.max_nodes, f"{where}: the allocation has more nodes than MAX"


def test_examples_launch_holds_the_recipes():
    present = {p.name for p in LAUNCH.iterdir()}
    assert present == {*SCRIPTS, MANIFEST}, f"examples/launch/ holds {sorted(present)}: add checks for new recipes"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_valid_bash(name):
    result = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_torchrun_lines(name):
    source = VALUES_FROM.get(name)
    check_script(name, (LAUNCH / name).read_text(), (LAUNCH / source).read_text() if source else None)


def test_slurm_first_allocation_starts_the_job():
    text = (LAUNCH / "slurm-first.sbatch").read_text()
    ((_, _, config),) = check_script("slurm-first.sbatch", text)
    assert config.min_nodes <= int(sbatch_options(text)["--nodes"]), "MIN is more nodes than the first allocation has"
    assert config.rdzv_endpoint == f"{RUNTIME['HEAD']}:29400", "the endpoint is the allocation's first node"


def training_commands() -> set[tuple[str, ...]]:
    """The `dynatrain.cli` arguments of every recipe's torchrun line, once each."""
    commands = set()
    for name in SCRIPTS:
        source = VALUES_FROM.get(name)
        for _, args, _ in check_script(name, (LAUNCH / name).read_text(),
                                       (LAUNCH / source).read_text() if source else None):
            commands.add(tuple(args[args.index("dynatrain.cli") + 1:]))
    container = pytorch_container(load_manifest((LAUNCH / MANIFEST).read_text()))
    args = container["command"] + container["args"]
    commands.add(tuple(args[args.index("dynatrain.cli") + 1:]))
    return commands


def test_training_commands_parse_with_the_cli(capsys, monkeypatch):
    """The recipes' overrides are settings `dynatrain fit` knows (LightningCLI's --print_config; no training)."""
    from dynatrain.cli.train import run_lightning_cli

    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", ["dynatrain"])
    for command in training_commands():
        with pytest.raises(SystemExit) as exit_info:
            run_lightning_cli([*command, "--print_config"])
        assert exit_info.value.code in (0, None), command
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["trainer"]["strategy"]["init_args"]["parallel"] == "auto", command


# ---- running the scripts against stand-ins ------------------------------------------------------------------------
STUBS = {
    # Each records its arguments, NUL-separated, where the test reads them.
    "srun": 'printf "%s\\0" "$@" > "$RECORD/srun.$SLURM_JOB_ID"',
    "torchrun": 'printf "%s\\0" "$@" > "$RECORD/torchrun.$((++n)).$$"',
    "scontrol": '[[ "$1 $2" == "show hostnames" ]] && printf "%s\\n" $STUB_HOSTS',
    "squeue": '[[ -n "${STUB_RUNNING:-}" ]] && echo "$STUB_RUNNING RUNNING"; true',
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", RECORD=str(record), HOME=str(tmp_path / "home"))
    for key in ("JOB_DIR", "ENDPOINT", "RDZV_ID", "TOKEN_FILE", "NNODES", "NPROC_PER_NODE", "SHUTDOWN_TIMEOUT"):
        env.pop(key, None)
    return env, record


def run_script(name: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / name), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=30)


def recorded(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def test_slurm_join_reaches_the_first_allocation(stubs):
    env, record = stubs
    first = run_script("slurm-first.sbatch", {**env, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[001-002]",
                                              "STUB_HOSTS": "node001 node002"})
    assert first.returncode == 0, first.stderr
    job_dir = Path(env["HOME"]) / "dynatrain-jobs" / "llama-1b-elastic"
    token = job_dir / "token"
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text()), "the token file holds no token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(job_dir.stat().st_mode) == 0o700

    join_env = {**env, "SLURM_JOB_ID": "5151", "SLURM_JOB_NODELIST": "node[007-008]", "STUB_HOSTS": "node007 node008"}
    refused = run_script("slurm-join.sbatch", join_env)
    assert refused.returncode == 1 and "not running" in refused.stderr, "a join must not start without the first job"
    joined = run_script("slurm-join.sbatch", {**join_env, "STUB_RUNNING": "4242"})
    assert joined.returncode == 0, joined.stderr

    agents = {}
    for job in ("4242", "5151"):
        srun = recorded(record / f"srun.{job}")
        at = srun.index("torchrun")
        _, config = check_agent(srun[at + 1:], f"srun of job {job}")
        agents[job] = config
    first_agent, joiner = agents["4242"], agents["5151"]
    assert first_agent.rdzv_endpoint == joiner.rdzv_endpoint == "node001:29400"
    assert first_agent.run_id == joiner.run_id == "4242"
    assert (first_agent.min_nodes, first_agent.max_nodes) == (joiner.min_nodes, joiner.max_nodes)
    assert first_agent.rdzv_configs["token_file"] == joiner.rdzv_configs["token_file"] == str(token)


def test_slurm_join_without_a_first_job_says_so(stubs):
    env, _ = stubs
    result = run_script("slurm-join.sbatch", {**env, "SLURM_JOB_ID": "5151", "STUB_RUNNING": "4242"})
    assert result.returncode == 1 and "slurm-first.sbatch" in result.stderr


def test_torchrun_script_runs(stubs):
    env, record = stubs
    env = {**env, "TOKEN_FILE": str(Path(env["HOME"]) / "job" / "token")}
    assert run_script("torchrun.sh", env).returncode == 2
    assert run_script("torchrun.sh", env, "token").returncode == 0
    token = Path(env["TOKEN_FILE"])
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text()) and stat.S_IMODE(token.stat().st_mode) == 0o600
    for role in ("first", "join"):
        result = run_script("torchrun.sh", env, role)
        assert result.returncode == 0, result.stderr
    calls = [recorded(p) for p in sorted(record.glob("torchrun.*"))]
    assert len(calls) == 2 and calls[0] == calls[1], "a later node runs the first nodes' command line"
    _, config = check_agent(calls[0], "torchrun.sh")
    assert config.rdzv_configs["token_file"] == str(token)


# ---- the Kubeflow manifest ------------------------------------------------------------------------------------------
def load_manifest(text: str) -> dict:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert len(docs) == 1, f"{MANIFEST}: one PyTorchJob, got {len(docs)} documents"
    return docs[0]


_NATIVE = {"str": str, "int": int, "float": (int, float), "bool": bool}


def build_model(data, type_name: str, path: str = "PyTorchJob"):
    """The SDK's model of ``type_name`` built from ``data`` (a manifest's dict), field by field; an unknown field, a
    value of the wrong type or a missing required one (the models' own check) raises."""
    import datetime

    import kubeflow.training.models as models

    if type_name.startswith("list["):
        assert isinstance(data, list), f"{path}: a list expected, got {data!r}"
        return [build_model(v, type_name[5:-1], f"{path}[{i}]") for i, v in enumerate(data)]
    if type_name.startswith("dict("):
        assert isinstance(data, dict), f"{path}: a mapping expected, got {data!r}"
        value_type = re.fullmatch(r"dict\(([^,]*), (.*)\)", type_name).group(2)
        return {k: build_model(v, value_type, f"{path}.{k}") for k, v in data.items()}
    if type_name == "object":
        return data
    if type_name in ("date", "datetime"):
        assert isinstance(data, (str, datetime.date)), f"{path}: a {type_name} expected, got {data!r}"
        return data
    if type_name in _NATIVE:
        ok = isinstance(data, _NATIVE[type_name]) and not (type_name in ("int", "float") and isinstance(data, bool))
        assert ok, f"{path}: a {type_name} expected, got {data!r}"
        return data
    cls = getattr(models, type_name, None)
    if cls is None:  # the SDK names the autoscaling models by their API group; the kubernetes client by version only
        m = re.fullmatch(r"K8sIoApi[A-Z][a-z]+(V\d\w*)", type_name)
        cls = getattr(models, m.group(1)) if m else None
    assert cls is not None, f"{path}: no model {type_name}"
    assert isinstance(data, dict), f"{path}: a mapping expected for {type_name}, got {data!r}"
    known = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(known))
    assert not unknown, f"{path}: {unknown} not fields of {type_name} ({sorted(known)})"
    kwargs = {known[k]: build_model(v, cls.openapi_types[known[k]], f"{path}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise AssertionError(f"{path}: {e}") from None


def check_manifest_schema(doc: dict):
    pytest.importorskip("kubeflow.training")
    from kubeflow.training.api_client import ApiClient

    job = build_model(doc, "KubeflowOrgV1PyTorchJob")
    # Nothing was dropped or changed on the way into the models and back.
    assert ApiClient().sanitize_for_serialization(job) == doc
    return job


def operator_env(doc: dict) -> dict[str, str]:
    """The PET_* variables the training operator (v1) adds to the container for ``spec.elasticPolicy``
    (pkg/controller.v1/pytorch/elastic.go), and spec.nprocPerNode's PET_NPROC_PER_NODE."""
    spec, name = doc["spec"], doc["metadata"]["name"]
    policy = spec["elasticPolicy"]
    container = pytorch_container(doc)
    port = policy.get("rdzvPort")
    if port is None:
        port = next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == "pytorchjob-port")
    env = {"PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', f'{name}-worker-0')}:{port}",
           "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d")}
    if "minReplicas" in policy or "maxReplicas" in policy:
        env["PET_NNODES"] = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])
    for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_N_PROC_PER_NODE"),
                     ("rdzvId", "PET_RDZV_ID")):
        if key in policy:
            env[var] = str(policy[key])
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = str(spec["nprocPerNode"])
    return env


def pytorch_container(doc: dict) -> dict:
    containers = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    found = [c for c in containers if c.get("name") == "pytorch"]
    assert len(found) == 1, "the operator needs the Worker's container named 'pytorch'"
    return found[0]


def check_manifest(doc: dict) -> None:
    assert (doc.get("apiVersion"), doc.get("kind")) == ("kubeflow.org/v1", "PyTorchJob")
    spec = doc["spec"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, \
        "Workers only: with a Master the operator sets WORLD_SIZE/RANK itself, and worker-0 serves the store"
    policy = spec["elasticPolicy"]
    lo, hi, replicas = policy["minReplicas"], policy["maxReplicas"], spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert 1 <= lo <= replicas <= hi and lo < hi, f"minReplicas {lo} <= replicas {replicas} <= maxReplicas {hi}"
    assert policy.get("metrics"), "without metrics the operator creates no HPA"
    assert policy.get("maxRestarts", 0) >= 1

    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pytorch_container(doc)
    token = [e for e in container.get("env", []) if e["name"] == "DYNATRAIN_TOKEN"]
    assert token and "secretKeyRef" in token[0].get("valueFrom", {}), "the token comes from a Secret"
    assert container["command"][:1] == ["torchrun"], "the container runs torchrun"
    args = container["command"][1:] + container.get("args", [])
    literal_env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    parsed, config = check_agent(args, MANIFEST, env={**operator_env(doc), **literal_env}, token_in_env=True)
    # check_agent parsed it under the operator's PET_RDZV_BACKEND=c10d: the container's flag wins.
    assert "rdzvBackend" not in policy, "the operator knows c10d, etcd and etcd-v2: give --rdzv-backend=dynatrain"
    assert (config.min_nodes, config.max_nodes) == (lo, hi), "torchrun's MIN:MAX is not the HPA's range"
    assert config.rdzv_endpoint == f"{doc['metadata']['name']}-worker-0:{policy['rdzvPort']}"
    assert config.max_restarts == policy["maxRestarts"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert config.nproc_per_node == gpus, f"--nproc-per-node {config.nproc_per_node} for {gpus} GPUs"
    grace = pod.get("terminationGracePeriodSeconds", 30)
    assert grace > parsed.shutdown_timeout, \
        f"terminationGracePeriodSeconds {grace} must outlast --shutdown-timeout {parsed.shutdown_timeout}"


def test_manifest_is_a_pytorchjob():
    job = check_manifest_schema(load_manifest((LAUNCH / MANIFEST).read_text()))
    from kubeflow.training.models import KubeflowOrgV1ElasticPolicy, KubeflowOrgV1PyTorchJob, V2MetricSpec

    assert isinstance(job, KubeflowOrgV1PyTorchJob) and isinstance(job.spec.elastic_policy, KubeflowOrgV1ElasticPolicy)
    assert all(isinstance(m, V2MetricSpec) for m in job.spec.elastic_policy.metrics)


def test_manifest_runs_an_elastic_dynatrain_job():
    check_manifest(load_manifest((LAUNCH / MANIFEST).read_text()))


# ---- the checks catch broken recipes -------------------------------------------------------------------------------
def _check_text(name: str, text: str) -> None:
    if name == MANIFEST:
        doc = load_manifest(text)
        check_manifest_schema(doc)
        check_manifest(doc)
    else:
        source = VALUES_FROM.get(name)
        check_script(name, text, (LAUNCH / source).read_text() if source else None)


BREAKS = [
    ("torchrun.sh", "--rdzv-backend dynatrain", "--rdzv-backend c10d"),
    ("torchrun.sh", 'last_call=30" \\\n', 'last_call=30"\n'),            # a lost line continuation
    ("torchrun.sh", "NNODES=${NNODES:-2:4}", "NNODES=${NNODES:-2}"),       # not elastic
    ("torchrun.sh", "--data.global_batch_size 384", "--data.global_batch_size 256"),  # 3 nodes cannot keep it
    ("slurm-first.sbatch", "token_file=$TOKEN_FILE", "last_call=5"),       # no token
    ("slurm-first.sbatch", "--nproc-per-node 8", "--nproc-per-node 4"),   # not the node's GPUs
    ("slurm-join.sbatch", 'token_file=$TOKEN_FILE"', 'token_file=$TOKEN_FILE,bogus=1"'),  # unknown conf key
    (MANIFEST, "    maxReplicas: 4", "    maxReplica: 4"),                # not a field
    (MANIFEST, "                - --rdzv-backend=dynatrain\n", ""),       # the operator's c10d would win
    (MANIFEST, "terminationGracePeriodSeconds: 300", "terminationGracePeriodSeconds: 60"),
    (MANIFEST, "      replicas: 2", "      replicas: \"2\""),              # a string where an int belongs
]


@pytest.mark.parametrize("name,old,new", BREAKS, ids=[f"{n}:{i}" for i, (n, _, _) in enumerate(BREAKS)])
def test_a_broken_recipe_is_caught(name, old, new):
    text = (LAUNCH / name).read_text()
    assert old in text, f"{name} no longer holds {old!r}: update BREAKS"
    _check_text(name, text)  # the recipe as it is passes
    with pytest.raises((AssertionError, KeyError, ValueError)):
        _check_text(name, text.replace(old, new, 1))


def test_expand_refuses_what_it_cannot_know():
    with pytest.raises(KeyError):
        expand("--rdzv-endpoint $NOWHERE:1", {})
    with pytest.raises(ValueError):
        expand("--rdzv-endpoint $(hostname):1", {})
    assert expand("${A:-x}/${B}/$C", {"B": "b", "C": "c"}) == "x/b/c"
    assert logical_lines(textwrap.dedent("""\
        a \\
          b
        c""")) == ["a    b", "c"]

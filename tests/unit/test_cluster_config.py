"""The cluster config: the committed example and Serve config validate; bad settings are named."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tandem.deploy.cluster_config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_example_config_validates_and_flags_override_it() -> None:
    cfg = ClusterConfig.from_file(DEPLOY / "cluster.example.yaml", port=9000, transport="ucx")
    assert (cfg.port, cfg.transport, cfg.prefill.replicas) == (9000, "ucx", 1)
    assert cfg.admission.tenants["interactive"].deadline_ms == 2000
    assert cfg.routing.policy == "cache_affinity"
    assert cfg.engine_config("prefill", "/m").block_size == 16


def test_the_example_config_names_every_field() -> None:
    """README: every field has a line (with a comment) in deploy/cluster.example.yaml."""
    from pydantic import BaseModel

    from tandem.deploy import cluster_config, role_config
    from tandem.engine.config import EngineConfig

    text = (DEPLOY / "cluster.example.yaml").read_text()
    named = set(re.findall(r"^\s*#?\s*([a-z_]+):", text, re.MULTILINE))
    models = [EngineConfig] + [
        m
        for module in (cluster_config, role_config)
        for m in vars(module).values()
        if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == module.__name__
    ]
    missing = {m.__name__: sorted(set(m.model_fields) - named) for m in models}
    assert {name: fields for name, fields in missing.items() if fields} == {}
    assert len(models) >= 6  # (ClusterConfig, its roles, router, SLO and the engine's)


def test_the_serve_config_args_are_cluster_config_fields() -> None:
    serve = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    ClusterConfig.model_validate(serve["applications"][0]["args"])


@pytest.mark.parametrize(
    "bad",
    [
        {"transport": "local"},
        {"transport": "carrier-pigeon"},
        {"engine": {"block_sise": 16}},
        {"prefill": {"replicas": 0}},
        {"routing": {"policy": "random"}},
        {"admission": {"safety_factor": 0.5}},
        {"transport": "ucx", "engine": {"device": "cuda"}},
        {"transport": "ucx", "decode": {"engine": {"device": "cuda:1"}}},
        {"port": 9000, "grpc_port": 9000},
        {"port": 9000, "direct_port": 9000},
        {"grpc_port": 8001},  # (the default direct_port)
        {"transport": "torch", "transport_options": {"advertise": "10.0.0.5"}},
        {"transport_options": {"bogus": 1}},  # (shm's)
    ],
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate(bad)


def test_gpu_pools_need_a_transport_that_moves_them() -> None:
    """ucx moves host-memory pools only; shm and torch take CUDA pools, and a colocated
    deployment moves no pages."""
    gpus = {"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}}
    with pytest.raises(ValidationError, match="use transport 'torch'"):
        ClusterConfig.model_validate(
            {**gpus, "transport": "ucx", "prefill": {"num_gpus": 1, "engine": {"device": "cuda"}}}
        )
    for ok in (
        {**gpus, "transport": "shm", "engine": {"device": "cuda"}},
        {**gpus, "transport": "torch", "engine": {"device": "cuda"}},
        {"transport": "ucx", "engine": {"device": "auto"}},  # auto without GPUs: the CPU
        {**gpus, "transport": "ucx", "mode": "colocated", "engine": {"device": "cuda"}},
    ):
        ClusterConfig.model_validate(ok)


def test_a_role_on_cuda_asks_ray_for_a_gpu_and_auto_follows_the_gpus() -> None:
    """Ray does not hide GPUs from a replica that asked for none, so "cuda" without
    `num_gpus` is refused, and "auto" means CUDA exactly where the role asks for GPUs."""
    with pytest.raises(ValidationError, match=r"decode runs on 'cuda:1' but asks Ray for no GPU"):
        ClusterConfig.model_validate({"decode": {"engine": {"device": "cuda:1"}}})
    with pytest.raises(ValidationError, match="set decode.num_gpus"):  # colocated: decode only
        ClusterConfig.model_validate({"mode": "colocated", "engine": {"device": "cuda"}})
    config = ClusterConfig(engine={"device": "auto"}, prefill={"num_gpus": 0.5})
    assert config.engine_config("prefill", "m").device == "cuda"
    assert config.engine_config("decode", "m").device == "cpu"
    assert ClusterConfig().engine_config("decode", "m").device == "cpu"


def test_router_replicas_can_ask_for_custom_ray_resources() -> None:
    plain = ClusterConfig().router.ray_actor_options()
    assert plain == {"num_cpus": 0.1}
    pinned = ClusterConfig.model_validate({"router": {"resources": {"router": 1}, "num_cpus": 0.5}})
    assert pinned.router.ray_actor_options() == {"num_cpus": 0.5, "resources": {"router": 1}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--transport", "nope"],
            "Error: invalid configuration: transport: transport 'nope' is unknown (use shm, "
            "torch, ucx)",
        ),
        (
            ["--transport", "local"],
            "transport 'local' is in-process only: it cannot join processes (use shm, torch, ucx)",
        ),
        (["--config", "BAD_YAML"], "Error: invalid configuration: prefill.bogus: Extra inputs"),
        (
            ["--tool-call-parser", "pythonic"],
            "Error: invalid configuration: router.tool_call_parser: Input should be",
        ),
        (
            ["--reasoning-parser", "granite"],
            "Error: invalid configuration: router.reasoning_parser: Input should be",
        ),
        (["--chat-template", "{% for m in %}"], "Error: chat_template is not a Jinja template"),
        (["--chat-template", "/no/such/t.jinja"], "looks like a path, but there is no such file"),
        (["--config", "BROKEN_YAML"], "BROKEN_YAML: not valid YAML: while parsing"),
        (["--config", "BAD_ENGINE", "--model", "MODEL"], "engine settings (shared): block_size"),
        (["--config", "BAD_DECODE", "--model", "MODEL"], "engine settings for decode: block_size"),
        (["--model", "GPT2"], "Error: architecture 'GPT2LMHeadModel' is not supported"),
        (["--num-cpus", "-3"], "Invalid value for '--num-cpus'"),
    ],
)
def test_tandem_serve_names_a_bad_setting_in_one_line(
    tmp_path: Path, args: list[str], message: str, tiny_checkpoint: Any
) -> None:
    """Refused before Ray starts: exit code 2 and one line naming the field, without pydantic's
    URL or the input echoed back."""
    from typer.testing import CliRunner

    from tandem.deploy.cli import app

    files = {"BAD_YAML": "prefill:\n  replicas: 2\n  bogus: 1\n", "BROKEN_YAML": "port: [1,\n",
             "BAD_ENGINE": "engine:\n  block_size: -4\n",
             "BAD_DECODE": "decode:\n  engine:\n    block_size: -4\n"}  # fmt: skip
    paths = {name: tmp_path / f"{name}.yaml" for name in files}
    for name, text in files.items():
        paths[name].write_text(text)
    paths["MODEL"] = tiny_checkpoint()
    gpt2 = paths["GPT2"] = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_layer": 2}')
    res = CliRunner().invoke(app, ["serve", *[str(paths.get(a, a)) for a in args]])
    assert res.exit_code == 2, res.output
    assert message.replace("BROKEN_YAML", str(paths["BROKEN_YAML"])) in res.output, res.output
    assert "Traceback" not in res.output
    assert "pydantic.dev" not in res.output and "input_value" not in res.output


def test_checksums_and_the_chunk_publisher_reach_the_prefill_sender(
    tiny_checkpoint: object,
) -> None:
    from tandem import LLM
    from tandem.kv_transfer.fake import FakeTransport
    from tandem.kv_transfer.local import LocalHub
    from tandem.prefill_workers.prefill_service import PrefillService

    default = ClusterConfig(auth_token="t").worker_settings("prefill", "/m", "reg")
    assert (default.checksums, default.hand_off) == (False, True)
    cfg = ClusterConfig.model_validate(
        {"checksums": True, "chunk_publisher": False, "auth_token": "t"}
    )
    settings = cfg.worker_settings("prefill", "/m", "reg")
    assert (settings.checksums, settings.hand_off) == (True, False)
    engine = LLM(model=str(tiny_checkpoint()), num_kv_blocks=64).engine  # type: ignore[operator]
    for hand_off in (True, False):
        service = PrefillService(
            engine, FakeTransport("t", hub=LocalHub("t")), checksums=True, hand_off=hand_off
        )
        assert service.sender.checksums is True
        assert (service.sender._publisher is not None) is hand_off
        service.sender.close()


def test_tandem_serve_flags_land_in_the_config(tmp_path: Path) -> None:
    """Flags override the config file, nested ones in their section (keeping its other
    fields)."""
    from tandem.deploy.cluster_config_flags import cluster_config_from as _config

    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  num_kv_blocks: 64\nrouter:\n  replicas: 2\n")
    cfg = _config(
        path,
        {"served_model_name": "m", "chat_template": None},
        {"prefill": 3, "decode": None},
        {("engine", "max_model_len"): 512, ("router", "tool_call_parser"): "mistral"},
    )
    assert cfg.served_model_name == "m" and cfg.prefill.replicas == 3
    assert cfg.engine == {"num_kv_blocks": 64, "max_model_len": 512}
    assert (cfg.router.replicas, cfg.router.tool_call_parser) == (2, "mistral")
    assert _config(path, {}, {}, {("engine", "max_model_len"): None}).engine == {
        "num_kv_blocks": 64
    }


def test_the_cache_dir_environment_variable_yields_to_the_config_file(tmp_path: Path) -> None:
    """$TANDEM_CACHE_DIR (set in the image) is a default: a config file's cache_dir wins."""
    from tandem.deploy.cluster_config_flags import cluster_config_from as _config

    path = tmp_path / "c.yaml"
    path.write_text("cache_dir: /from/file\n")
    assert _config(path, {}, {}, defaults={"cache_dir": "/from/env"}).cache_dir == "/from/file"
    assert _config(None, {}, {}, defaults={"cache_dir": "/from/env"}).cache_dir == "/from/env"
    assert _config(None, {}, {}, defaults={"cache_dir": None}).cache_dir == "~/.cache/tandem"


def test_ray_resources_needed_sum_every_role_at_its_most_replicas() -> None:
    """What `tandem serve` sizes a local cluster by (and warns about when joining one short of
    it): router + prefill + decode, autoscaled roles at max_replicas, custom resources too."""
    from tandem.deploy.ray_cluster import resource_shortfall

    default = ClusterConfig()
    assert default.ray_resources_needed() == {"CPU": 1.1}
    two_by_two = ClusterConfig.model_validate(
        {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}
    )
    assert two_by_two.ray_resources_needed() == {"CPU": 2.1}
    assert resource_shortfall({"CPU": 2.1}, {"CPU": 2.0, "memory": 1e9}) == {"CPU": 0.1}
    gpu = ClusterConfig.model_validate(
        {
            "router": {"resources": {"router": 1}},
            "prefill": {"num_gpus": 1, "resources": {"prefill": 1}, "replicas": 1,
                        "autoscaling": {"min_replicas": 1, "max_replicas": 3}},
            "decode": {"num_gpus": 0.5, "num_cpus": 1, "replicas": 2, "resources": {"decode": 1}},
        }
    )  # fmt: skip
    assert gpu.ray_resources_needed() == {
        "CPU": 0.1 + 3 * 0.5 + 2 * 1,
        "GPU": 3 + 2 * 0.5,
        "router": 1,
        "prefill": 3,
        "decode": 2,
    }
    assert resource_shortfall(gpu.ray_resources_needed(), {"CPU": 8, "GPU": 4, "router": 1}) == {
        "prefill": 3,
        "decode": 2,
    }
    colocated = ClusterConfig.model_validate({"mode": "colocated", "decode": {"replicas": 3}})
    assert colocated.ray_resources_needed() == {"CPU": 1.6}


def test_a_redeploy_keeps_the_generated_cluster_token() -> None:
    """The registry keeps the first generated token, so a redeploy's router is let in by the
    workers still running (a fresh token was refused: 503 "wrong cluster token")."""
    from tandem.engine.worker_registry import WorkerRegistry

    registry = WorkerRegistry()
    first = registry.cluster_token("aaaa")
    assert first == "aaaa" and registry.cluster_token("bbbb") == "aaaa"
    assert ClusterConfig().with_auth_token(first).auth_token == "aaaa"
    assert ClusterConfig(auth_token="mine").with_auth_token(first).auth_token == "mine"
    assert len(ClusterConfig().with_auth_token().auth_token or "") == 32


@pytest.mark.parametrize("bad", [{"app_name": ""}, {"app_name": "a/b"}, {"host": ""}])
def test_names_and_hosts_that_serve_cannot_use_are_refused(bad: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate(bad)


def test_vllms_engine_flags_set_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-num-seqs`, `--max-num-batched-tokens`, `--block-size`, `--[no-]enable-prefix-
    caching`, `--seed`, `--generation-config` as `vllm serve` takes them (they were "No such
    option")."""
    from typer.testing import CliRunner

    import tandem.deploy.app_builder as app_builder
    from tandem.deploy.cli import app

    seen: list[ClusterConfig] = []

    def build_app(cfg: ClusterConfig) -> None:
        seen.append(cfg)
        raise ValueError("built")

    monkeypatch.setattr(app_builder, "build_app", build_app)
    flags = ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "32",
             "--no-enable-prefix-caching", "--seed", "3", "--generation-config", "vllm"]  # fmt: skip
    res = CliRunner().invoke(app, ["serve", *flags])
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert seen[0].engine == {
        "max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 32,
        "enable_prefix_caching": False, "seed": 3, "generation_config": "vllm",
    }  # fmt: skip


def test_an_empty_cache_dir_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Any
) -> None:
    """TANDEM_CACHE_DIR set to "" built the embedded model in ./models."""
    from typer.testing import CliRunner

    import tandem.deploy.app_builder as app_builder
    from tandem.deploy.cli import app

    seen: list[ClusterConfig] = []

    def build_app(cfg: ClusterConfig) -> None:
        seen.append(cfg)
        raise ValueError("built")

    monkeypatch.setattr(app_builder, "build_app", build_app)
    monkeypatch.setenv("TANDEM_CACHE_DIR", "")
    res = CliRunner().invoke(app, ["serve", "--model", str(tiny_checkpoint())])
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert seen[0].cache_dir == ClusterConfig().cache_dir

"""The vLLM connector's settings and keys, without vLLM: extra config over KVCLOUD_*
variables, clear errors, tenants folded with cache_salt, the checkpoint digest, and the rope
in the namespace (checked against vLLM itself, whose venv this suite's is not, by
tests/vllm/test_vllm_config_checks.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcloud import ConfigError, derive_tenant_key
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.keys import (
    check_supported,
    checkpoint_digest,
    request_tenant,
    vllm_namespace,
)
from scripts.checks.vllm_config_checks import LONGROPE


def test_extra_config_wins_over_environment() -> None:
    env = {"KVCLOUD_STORE": "file:///env", "KVCLOUD_CHUNK_TOKENS": "512", "KVCLOUD_TENANT": "t"}
    cfg = VLLMConnectorConfig.load({"chunk_tokens": 128}, env=env)
    assert (cfg.store, cfg.chunk_tokens, cfg.tenant) == ("file:///env", 128, "t")
    assert VLLMConnectorConfig.load({}, env={}).write_policy == "write-through"
    assert VLLMConnectorConfig.load({}, env={"KVCLOUD_UPLOAD_NICE": "0"}).upload_nice == 0
    auto = VLLMConnectorConfig.load({"load_mode": "auto"}, env={"KVCLOUD_SYNC_BUDGET_MS": "12.5"})
    assert (auto.load_mode, auto.sync_budget_ms) == ("auto", 12.5)


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({"chunk_size": 1}, {}, "unknown kv_connector_extra_config key 'chunk_size'"),
        ({"secret": "x"}, {}, "set KVCLOUD_SECRET"),
        ({"chunk_tokens": 0}, {}, "chunk_tokens must be a positive integer"),
        ({"write_policy": "write-back"}, {}, "write_policy 'write-back'"),
        ({}, {"KVCLOUD_LOAD_TIMEOUT": "soon"}, "KVCLOUD_LOAD_TIMEOUT"),
        ({"load_timeout": -1}, {}, "load_timeout must be a positive number"),
        ({"upload_nice": 20}, {}, "upload_nice must be an integer 0-19"),
        ({}, {"KVCLOUD_UPLOAD_NICE": "-5"}, "upload_nice must be an integer 0-19"),
        ({"load_mode": "eager"}, {}, "load_mode 'eager': use one of async, sync, auto"),
        ({"sync_budget_ms": 0}, {}, "sync_budget_ms must be > 0"),
        ({"head_parts": 0}, {}, "head_parts must be a positive integer"),
        ({}, {"KVCLOUD_HEAD_PARTS": "two"}, "KVCLOUD_HEAD_PARTS"),
        ({}, {"KVCLOUD_SYNC_BUDGET_MS": "-1"}, "sync_budget_ms must be > 0"),
    ],
)
def test_bad_settings_are_named(extra: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        VLLMConnectorConfig.load(extra, env=env)


def test_client_config_takes_secret_from_environment_only() -> None:
    cfg = VLLMConnectorConfig.load({"store": "file:///s", "index": "sqlite:///i.db"}, env={})
    client = cfg.client_config(env={"KVCLOUD_SECRET": "from-env"})
    assert client.secret == b"from-env"
    assert (client.store, client.index) == ("file:///s", "sqlite:///i.db")


def test_cache_salt_gives_another_tenant_key() -> None:
    base = request_tenant("acme", None)
    one, two = request_tenant("acme", "s1"), request_tenant("acme", "s2")
    assert base == "acme" and len({base, one, two}) == 3
    assert request_tenant("acme", "s1") == one  # deterministic across processes
    keys = {derive_tenant_key(b"secret", t) for t in (base, one, two)}
    assert len(keys) == 3


def test_checkpoint_digest_follows_content_not_folder(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(b"weights" * 100)
    (a / "config.json").write_text('{"model_type": "llama"}')
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(b))
    (b / "model.safetensors").write_bytes(b"weightz" * 100)
    assert checkpoint_digest(str(a)) != checkpoint_digest(str(b))
    before = checkpoint_digest(str(a))
    (a / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert checkpoint_digest(str(a)) != before  # the config changes the KV too
    with pytest.raises(ConfigError, match="no weight files"):
        checkpoint_digest(str(tmp_path))


def _hub_snapshot(cache: Path, repo: str, commit: str, weights: bytes) -> None:
    """A Hugging Face hub cache entry as huggingface_hub lays it out: refs/main names the
    commit, snapshots/<commit>/ holds the files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(weights)
    (snap / "config.json").write_text('{"model_type": "llama"}')
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def test_a_hub_model_is_pinned_to_the_snapshot_main_points_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    _hub_snapshot(tmp_path, "org/model", "a" * 40, b"old weights")
    old = checkpoint_digest("org/model", "main")
    assert old.startswith("sha256-")
    # main moves to a commit with other weights: another namespace
    _hub_snapshot(tmp_path, "org/model", "b" * 40, b"new weights")
    assert checkpoint_digest("org/model", "main") != old
    assert checkpoint_digest("org/model", "a" * 40) == old  # the pinned commit still reads
    with pytest.raises(ConfigError, match="weights_digest"):
        checkpoint_digest("org/never-downloaded", "main")


def _vllm_config(**over: object) -> SimpleNamespace:
    hf = SimpleNamespace(model_type="llama", to_json_string=lambda: '{"a": 1}')
    mc = SimpleNamespace(
        hf_config=hf,
        dtype="float32",
        quantization=None,
        hf_overrides={},
        model_impl="auto",
        model="/m",
        revision=None,
        use_mla=False,
        # the stage's layers under pipeline parallelism; the namespace takes the model's
        get_num_layers=lambda pc: 2 // pc.pipeline_parallel_size,
        get_total_num_hidden_layers=lambda: 2,
        get_num_kv_heads=lambda pc: 2,
        get_total_num_kv_heads=lambda: 2,
        get_head_size=lambda: 8,
    )
    for k, v in over.items():
        setattr(mc, k, v)
    return SimpleNamespace(
        model_config=mc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=None,
    )


def test_hf_overrides_and_model_impl_change_the_namespace() -> None:
    cfg = VLLMConnectorConfig(weights_digest="sha256-x")
    plain = vllm_namespace(_vllm_config(), cfg).id
    assert vllm_namespace(_vllm_config(), cfg).id == plain
    rope = vllm_namespace(_vllm_config(hf_overrides={"rope_theta": 20000}), cfg).id
    impl = vllm_namespace(_vllm_config(model_impl="transformers"), cfg).id
    assert len({plain, rope, impl}) == 3


def test_every_pipeline_split_has_the_whole_models_namespace() -> None:
    """A PP-2 vLLM's stages hold half the layers each; its namespace is the model's, so it
    shares with a PP-1 vLLM (and check_supported lets it start)."""
    cfg = VLLMConnectorConfig(weights_digest="sha256-x")
    groups = SimpleNamespace(kv_cache_groups=[object()])
    plain = vllm_namespace(_vllm_config(), cfg)
    staged = _vllm_config()
    staged.parallel_config.pipeline_parallel_size = 2
    check_supported(staged, groups)
    assert vllm_namespace(staged, cfg).id == plain.id and plain.num_layers == 2


def test_an_eagle_drafter_is_stored_with_the_target_and_named_in_the_namespace(
    tmp_path: Path,
) -> None:
    """EAGLE, EAGLE-3 and MTP drafters' layers follow the target's in the one cache group:
    stored in the same chunks (the namespace counts them), under a namespace naming the
    drafter (method and checkpoint digest); a separate draft model, and a drafter under
    pipeline parallelism, are refused at start."""
    from kvcloud.integrations.vllm.drafters import drafter_layers

    cfg = VLLMConnectorConfig(weights_digest="sha256-x")
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    plain_groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=layers)])
    groups = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=[*layers, "model.layers.2.self_attn.attn"])]
    )
    vc = _vllm_config()
    check_supported(vc, groups)
    plain = vllm_namespace(vc, cfg, plain_groups)
    vc.speculative_config = SimpleNamespace(method="ngram", uses_draft_kv_cache=lambda: False)
    check_supported(vc, groups)
    assert vllm_namespace(vc, cfg, plain_groups).id == plain.id  # ngram: no KV of its own
    head = tmp_path / "eagle"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"head one")

    def eagle(method: str = "eagle") -> SimpleNamespace:
        return SimpleNamespace(
            method=method,
            uses_draft_kv_cache=lambda: True,
            use_eagle=lambda: True,
            draft_model_config=SimpleNamespace(
                model=str(head),
                revision=None,
                get_total_num_hidden_layers=lambda: 1,
                get_total_num_kv_heads=lambda: 2,  # the target's shape (_vllm_config)
                get_head_size=lambda: 8,
            ),
        )

    vc.speculative_config = eagle()
    check_supported(vc, groups)
    assert drafter_layers(vc, groups) == 1 and drafter_layers(vc) == 1
    drafted = vllm_namespace(vc, cfg, groups)
    assert drafted.num_layers == 3 and '"drafter": "eagle:sha256-' in drafted.extra
    assert drafted.id != plain.id
    (head / "model.safetensors").write_bytes(b"head two")  # another drafter's weights
    assert vllm_namespace(vc, cfg, groups).id != drafted.id
    vc.speculative_config = eagle("eagle3")
    assert vllm_namespace(vc, cfg, groups).id != drafted.id
    # a separate draft model numbers its layers from 0 again; dflash and dspark, which
    # vLLM counts as EAGLE-like, are not causal or not numbered after the target
    for other in ("draft_model", "dflash", "dspark"):
        vc.speculative_config = eagle(other)
        with pytest.raises(ConfigError, match="not of a separate draft model"):
            check_supported(vc, groups)
    # a drafter whose KV heads differ from the target's
    vc.speculative_config = eagle()
    vc.speculative_config.draft_model_config.get_head_size = lambda: 16
    with pytest.raises(ConfigError, match="another shape"):
        check_supported(vc, groups)
    vc.speculative_config = eagle()
    vc.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        check_supported(vc, groups)


def test_an_mla_model_is_one_latent_head_in_its_own_namespace() -> None:
    """An MLA cache holds one latent row per token (kv_lora_rank + rope wide), the same on
    every TP rank: stored as one KV head of half that width, K and V the row's halves, with
    the latent's split pinned in the namespace; an odd width is refused at start."""
    from kvcloud.integrations.vllm.keys import mla_dims

    cfg = VLLMConnectorConfig(weights_digest="sha256-x")
    hf = SimpleNamespace(
        model_type="deepseek_v2", to_json_string=lambda: "{}", kv_lora_rank=512,
        qk_rope_head_dim=64,
    )  # fmt: skip
    vc = _vllm_config(use_mla=True, hf_config=hf, get_total_num_kv_heads=lambda: 4,
                      get_head_size=lambda: 576)  # fmt: skip
    # where vLLM itself keeps prefix caching off for MLA (its CPU backend), refused
    with pytest.raises(ConfigError, match="MLA model with vLLM's prefix caching off"):
        check_supported(vc, SimpleNamespace(kv_cache_groups=[object()]))
    vc.cache_config.enable_prefix_caching = True
    check_supported(vc, SimpleNamespace(kv_cache_groups=[object()]))
    ns = vllm_namespace(vc, cfg)
    assert (ns.num_kv_heads, ns.head_dim) == (1, 288) and "latent=512,rope=64" in ns.extra
    other = SimpleNamespace(**{**vars(hf), "kv_lora_rank": 448, "qk_rope_head_dim": 128})
    assert vllm_namespace(_vllm_config(use_mla=True, hf_config=other), cfg).id != ns.id
    assert mla_dims(_vllm_config().model_config) is None
    odd = SimpleNamespace(**{**vars(hf), "qk_rope_head_dim": 63})
    with pytest.raises(ConfigError, match="odd width"):
        vllm_namespace(_vllm_config(use_mla=True, hf_config=odd), cfg)


# -- the rotary embedding in the namespace -------------------------------------------------------


def _checkpoint_config(tmp_path: Path, config: dict, max_model_len: int, **over: object):
    """A vLLM config over a checkpoint folder whose config.json is ``config`` (the file the
    namespace reads the rope from, as both the scheduler and the worker processes can)."""
    folder = tmp_path / hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return _vllm_config(model=str(folder), max_model_len=max_model_len, **over)


def _ns_id(vc: SimpleNamespace) -> str:
    return vllm_namespace(vc, VLLMConnectorConfig(weights_digest="sha256-x")).id


def test_plain_rope_shares_across_max_model_len_and_keeps_its_namespace(tmp_path: Path) -> None:
    """Plain RoPE (and llama3 scaling) rotates each position alike whatever max_model_len:
    two vLLMs differing only in --max-model-len share, and a plain model's namespace is the
    one it had before the rope was pinned (no ``rope`` entry)."""
    before = _ns_id(_vllm_config())  # no config.json to read: the namespace as it always was
    for plain in (
        {"model_type": "llama", "rope_theta": 10000.0, "rope_scaling": None},
        {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    ):
        short, long = (_checkpoint_config(tmp_path, plain, n) for n in (2048, 8192))
        assert _ns_id(short) == _ns_id(long) == before
    llama3 = {
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    a, b = (_checkpoint_config(tmp_path, llama3, n) for n in (4096, 131072))
    assert _ns_id(a) == _ns_id(b) != before


def test_longrope_splits_where_max_model_len_crosses_original(tmp_path: Path) -> None:
    """vLLM's Phi-3 LongRoPE rotates with its long factors when max_model_len exceeds
    original_max_position_embeddings, with its short ones otherwise: the namespace follows
    that switch, and only it."""
    ids = {n: _ns_id(_checkpoint_config(tmp_path, LONGROPE, n)) for n in (2048, 4096, 4097, 131072)}
    assert ids[2048] == ids[4096] != ids[4097] == ids[131072]
    ns = vllm_namespace(
        _checkpoint_config(tmp_path, LONGROPE, 8192),
        VLLMConnectorConfig(weights_digest="sha256-x"),
    )
    assert '"rope": "longrope@long:' in ns.extra
    # the legacy name of the same scaling ("su") is the same rotation
    su = {**LONGROPE, "rope_scaling": {**LONGROPE["rope_scaling"], "type": "su"}}
    assert _ns_id(_checkpoint_config(tmp_path, su, 8192)) == ids[4097]
    # without a readable config.json, the switch still comes from vLLM's loaded config
    loaded = SimpleNamespace(
        model_type="phi3", to_json_string=lambda: "{}",
        rope_parameters={**LONGROPE["rope_scaling"], "rope_type": "longrope",
                         "original_max_position_embeddings": 4096},
    )  # fmt: skip
    short, long = (_ns_id(_vllm_config(hf_config=loaded, max_model_len=n)) for n in (4096, 8192))
    assert short != long


def test_rope_theta_and_scaling_never_share(tmp_path: Path) -> None:
    """The same weights (one weights_digest, which does not read config.json) under another
    rope theta or rope scaling compute other K: never one namespace. A number written as an
    int or a float is the same rotation."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    configs = [
        {"model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": yarn},
        {"model_type": "qwen2", "rope_theta": 500000.0, "rope_scaling": yarn},
        {"model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": {**yarn, "factor": 2.0}},
        {"model_type": "qwen2", "rope_theta": 1000000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"model_type": "qwen2", "rope_theta": 1000000.0,
         "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
        {"model_type": "qwen2", "rope_theta": 1000000.0,
         "rope_scaling": {**yarn, "factor": 4.0}, "partial_rotary_factor": 0.5},
        {"model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": None},
    ]  # fmt: skip
    ids = [_ns_id(_checkpoint_config(tmp_path, c, 32768)) for c in configs]
    assert len(set(ids)) == len(ids)
    as_int = {**configs[0], "rope_theta": 1000000, "rope_scaling": {**yarn, "factor": 4}}
    assert _ns_id(_checkpoint_config(tmp_path, as_int, 32768)) == ids[0]
    # hf_overrides that add a scaling are the rope vLLM runs: pinned as such
    plain = _checkpoint_config(tmp_path, configs[-1], 32768)
    overridden = _checkpoint_config(
        tmp_path, configs[-1], 32768, hf_overrides={"rope_scaling": yarn}
    )
    ns = vllm_namespace(overridden, VLLMConnectorConfig(weights_digest="sha256-x"))
    assert '"rope": "yarn:' in ns.extra and ns.id != _ns_id(plain)


def test_an_fp8_kv_cache_has_its_own_namespace() -> None:
    """fp8 caches store their bytes (float8 in the namespace, half of bf16's); fp8 and bf16
    never share, nor e4m3 and e5m2; what the connector cannot read is refused at start."""
    cfg = VLLMConnectorConfig(weights_digest="sha256-x")

    def ns(cache_dtype: str, **over: object):  # type: ignore[no-untyped-def]
        vc = _vllm_config(**over)
        vc.cache_config.cache_dtype = cache_dtype
        return vllm_namespace(vc, cfg)

    auto, e4m3, e4m3_too, e5m2 = ns("auto"), ns("fp8"), ns("fp8_e4m3"), ns("fp8_e5m2")
    assert (e4m3.dtype, e5m2.dtype) == ("float8_e4m3fn", "float8_e5m2")
    assert e4m3.id == e4m3_too.id  # vLLM's fp8 is e4m3
    assert len({auto.id, e4m3.id, e5m2.id}) == 3
    # the scales come with the checkpoint: another checkpoint, another namespace
    other = vllm_namespace(_fp8(_vllm_config()), VLLMConnectorConfig(weights_digest="sha256-y"))
    assert other.id != e4m3.id
    for bad in ("fp8_inc", "fp8_ds_mla", "fp8_per_token_head"):
        with pytest.raises(ConfigError, match="fp8, fp8_e4m3, fp8_e5m2"):
            ns(bad)
    vc = _fp8(_vllm_config())
    vc.cache_config.kv_cache_dtype_skip_layers = ["sliding_window"]
    with pytest.raises(ConfigError, match="skip_layers"):
        vllm_namespace(vc, cfg)
    hf = SimpleNamespace(
        model_type="deepseek_v2", to_json_string=lambda: "{}", kv_lora_rank=512,
        qk_rope_head_dim=64,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="MLA model with an fp8"):
        vllm_namespace(_fp8(_vllm_config(use_mla=True, hf_config=hf)), cfg)


def _fp8(vc: SimpleNamespace) -> SimpleNamespace:
    vc.cache_config.cache_dtype = "fp8"
    return vc


def test_mamba_and_linear_attention_are_refused_with_the_reason() -> None:
    """A recurrent state is not KV per token: refused at start with the sentence docs/VLLM.md
    gives, alone or inside vLLM's per-layer wrapper; and only vLLM's SlidingWindowSpec counts
    as a window that frees blocks (a FullAttentionSpec carrying a sliding_window, as vLLM
    makes when its hybrid allocator is off, keeps every block)."""
    from kvcloud.integrations.vllm.keys import MAMBA_REASON, sliding_window

    class MambaSpec:  # named as vLLM's (v1/kv_cache_interface.py)
        block_size = 16

    class Mamba2LikeSpec(MambaSpec):
        pass

    class FullAttentionSpec:
        def __init__(self, window: int | None = None) -> None:
            self.sliding_window = window

    class SlidingWindowSpec:
        sliding_window = 512

    class UniformTypeKVCacheSpecs:
        def __init__(self, **specs: object) -> None:
            self.kv_cache_specs = specs

    def groups(*specs: object) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    vc = _vllm_config()
    check_supported(vc, groups(FullAttentionSpec()))
    for state in (MambaSpec(), Mamba2LikeSpec(), UniformTypeKVCacheSpecs(a=MambaSpec())):
        with pytest.raises(ConfigError) as err:
            check_supported(vc, groups(FullAttentionSpec(), state))
        assert str(err.value) == MAMBA_REASON
    with pytest.raises(ConfigError, match="Mamba"):
        check_supported(vc, groups(MambaSpec()))  # a pure Mamba model, one group
    assert sliding_window(groups(SlidingWindowSpec())) == 512
    assert sliding_window(groups(FullAttentionSpec(4096))) is None
    assert sliding_window(groups(FullAttentionSpec())) is None

"""Mesh sharding on 8 simulated CPU devices: every preset gives the unsharded logits, every parameter
lands where the rules table says, and bad meshes / rules fail with messages that say what would work."""
import matplotlib

matplotlib.use("Agg")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from amdllm.io import checkpoint  # noqa: E402
from amdllm.parallel import sharding as S  # noqa: E402
from amdllm.course import plots  # noqa: E402
from amdllm.config import LlamaConfig  # noqa: E402
from amdllm.model.lora import apply_lora  # noqa: E402
from amdllm.model import Run, forward, param_table, to_pure  # noqa: E402
from tests.tiny import hf_logits, make_hf_checkpoint, random_tokens  # noqa: E402

CASES = [("fsdp", "fsdp=8"), ("tp", "data=4,tensor=2"), ("fsdp_tp", "data=2,fsdp=2,tensor=2"), ("dp", "data=8")]
# Written out by hand (not derived from S.RULES) so a wrong rules table cannot pass by agreeing with itself.
HAND = {
    "fsdp": {"embed_tokens": P(None, "fsdp"), "layers/q_proj": P(None, "fsdp", None),
             "layers/o_proj": P(None, None, "fsdp"), "layers/down_proj": P(None, None, "fsdp"),
             "lm_head": P("fsdp", None), "norm": P(), "layers/q_proj_lora_a": P(None, "fsdp", None)},
    "tp": {"embed_tokens": P("tensor", None), "layers/q_proj": P(None, None, "tensor"),
           "layers/k_proj": P(None, None, "tensor"), "layers/o_proj": P(None, "tensor", None),
           "layers/gate_proj": P(None, None, "tensor"), "layers/down_proj": P(None, "tensor", None),
           "layers/q_proj_lora_b": P(None, None, "tensor")},
    "fsdp_tp": {"layers/q_proj": P(None, "fsdp", "tensor"), "layers/o_proj": P(None, "tensor", "fsdp"),
                "embed_tokens": P("tensor", "fsdp"), "layers/input_layernorm": P()},
    "dp": {"embed_tokens": P(), "layers/q_proj": P(), "layers/v_proj_lora_a": P()},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, hf = make_hf_checkpoint(tmp_path_factory.mktemp("shard"), max_shard_size="60KB")
    tokens = random_tokens(8, 16)
    return path, hf_logits(hf, tokens), tokens


def _expected(axes, preset, mesh):
    out = []
    for a in axes:
        t = S.RULES[preset][a]
        t = () if t is None else ((t,) if isinstance(t, str) else tuple(t))
        t = tuple(x for x in t if mesh.shape[x] > 1)
        out.append(None if not t else (t[0] if len(t) == 1 else t))
    return NamedSharding(mesh, P(*out))


@pytest.mark.parametrize("preset,spec", CASES)
def test_sharded_load_and_forward_match_unsharded(ckpt, preset, spec):
    path, ref_logits, tokens = ckpt
    assert len(jax.devices()) == 8
    mesh = S.make_mesh(spec, cfg=LlamaConfig.from_json(path), rules=preset)
    model = checkpoint.load(path, mesh=mesh, rules=preset)  # make_array_from_callback path
    apply_lora(model, rank=4, targets="q,v,down", seed=1)
    for name in ("q_proj", "v_proj", "down_proj"):  # B=0 at init would hide a misplaced LoRA factor
        var = getattr(model.layers, name + "_lora_b")
        var.set_value(0.05 * jax.random.normal(jax.random.key(7), var.shape))
    plain = nnx.clone(model)
    plain_top, plain_layers = jax.device_put(to_pure(plain), jax.devices()[0])
    S.shard_model(model, mesh, preset)

    # every parameter (LoRA factors included) sits exactly where the rules table puts it
    axes = {n: a for n, (_, a) in param_table(model.cfg).items()}
    axes.update({f"layers/{p}_lora_a": ("layers", param_table(model.cfg)[f"layers/{p}"][1][1], "lora_rank")
                 for p in ("q_proj", "v_proj", "down_proj")})
    axes.update({f"layers/{p}_lora_b": ("layers", "lora_rank", param_table(model.cfg)[f"layers/{p}"][1][2])
                 for p in ("q_proj", "v_proj", "down_proj")})
    top, layers = to_pure(model)
    arrays = {**top, **{f"layers/{k}": v for k, v in layers.items()}}
    assert set(arrays) == set(axes)
    for name, arr in arrays.items():
        want = _expected(axes[name], preset, mesh)
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (preset, name, arr.sharding.spec, want.spec)
        if name in HAND[preset]:
            assert arr.sharding.is_equivalent_to(NamedSharding(mesh, HAND[preset][name]), arr.ndim), name
    assert arrays["layers/q_proj"].addressable_shards[0].data.size == \
        arrays["layers/q_proj"].size // {"fsdp": 8, "tp": 2, "fsdp_tp": 4, "dp": 1}[preset]

    assert model.act_sharding == S.activation_sharding(mesh, preset)  # set by checkpoint.load / shard_model
    fwd = jax.jit(lambda t, l, x, sh=None: forward(model.cfg, t, l, x, run=Run(lora_scale=model.lora_scale,
                                                                                act_sharding=sh))[0], static_argnums=3)
    x = S.shard_batch(tokens, mesh, preset)
    assert x.sharding.spec == P(("data", "fsdp") if preset == "fsdp_tp" else ("fsdp" if preset == "fsdp" else "data"))
    got = np.asarray(fwd(top, layers, x, model.act_sharding))
    want = np.asarray(fwd(plain_top, plain_layers, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    if preset == "fsdp":  # the base (no LoRA delta) checkpoint also matches transformers
        base = jax.jit(lambda t, l, x: forward(model.cfg, t, {k: v for k, v in l.items() if "lora" not in k},
                                               x)[0])
        np.testing.assert_allclose(np.asarray(base(top, layers, x)), ref_logits, atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(model(x)[0]), want, atol=1e-5, rtol=0)  # Llama.__call__ path


def test_mesh_specs():
    assert S.parse_mesh_spec("auto", 8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert S.parse_mesh_spec("data=2, fsdp=-1", 8) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert S.parse_mesh_spec({"tensor": 2, "data": 2, "fsdp": 2}, 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = S.make_mesh("data=2,fsdp=2,tensor=2")
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.shape == (2, 2, 2)
    assert S.make_mesh("fsdp=4").devices.size == 4  # a divisor of the device count: the first 4 devices


@pytest.mark.parametrize("spec,needle", [
    ("pipeline=8", "unknown mesh axis 'pipeline'; known axes: data, fsdp, tensor"),
    ("fsdp=16", "asks for 16 devices but only 8 are present"),
    ("fsdp=3", "does not divide the 8 devices"),
    ("fsdp:8", "is not axis=size"),
    ("fsdp=two", "must be an integer"),
    ("fsdp=0", "must be >= 1"),
    ("fsdp=4,fsdp=2", "given twice"),
])
def test_bad_mesh_specs(spec, needle):
    with pytest.raises(S.ShardingError, match=needle.replace("(", r"\(")):
        S.make_mesh(spec)


def test_mesh_checked_against_model():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(S.ShardingError, match=r"cannot split kv_heads: num_key_value_heads=2 is not divisible "
                                              r"by 4; sizes of 'tensor' that work for this model: 1, 2"):
        S.make_mesh("fsdp=2,tensor=4", cfg=cfg)
    with pytest.raises(S.ShardingError, match=r"cannot split mlp: intermediate_size=100 .* 1, 2, 4"):
        S.make_mesh("tensor=8", cfg=cfg.replace(intermediate_size=100, num_attention_heads=8,
                                                num_key_value_heads=8, head_dim=8), rules="tp")
    with pytest.raises(S.ShardingError, match=r"hidden_size=12 is not divisible by 8"):
        S.make_mesh("fsdp=8", cfg=cfg.replace(hidden_size=12, head_dim=3), rules="fsdp")
    S.make_mesh("fsdp=4,tensor=2", cfg=cfg)  # fine


def test_bad_rules_and_indivisible_params():
    mesh = S.make_mesh("fsdp=8")
    with pytest.raises(S.ShardingError, match="unknown mesh axis 'model'"):
        S.get_rules({**S.RULES["fsdp"], "embed": "model"})
    with pytest.raises(S.ShardingError, match="unknown rules preset 'zero3'"):
        S.get_rules("zero3")
    with pytest.raises(S.ShardingError, match=r"layers/q_proj: logical axis 'heads' has no entry"):
        S.param_shardings(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2),
                          mesh, {k: v for k, v in S.RULES["fsdp"].items() if k != "heads"})
    with pytest.raises(S.ShardingError, match="used by two dimensions"):
        S.logical_to_spec(("embed", "mlp"), {"embed": "fsdp", "mlp": "fsdp"})
    odd = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(S.ShardingError, match=r"embed_tokens: dimension 0 \('vocab', size 100\) does not split "
                                              r"over mesh axes tensor=8"):
        S.param_shardings(odd, S.make_mesh("tensor=8"), "tp")
    with pytest.warns(UserWarning, match="replicating that dimension"):
        sh = S.param_shardings(odd, S.make_mesh("tensor=8"), "tp", strict=False)
    assert sh["embed_tokens"].spec == P() and sh["layers/q_proj"].spec == P(None, None, "tensor")
    with pytest.raises(S.ShardingError, match="batch size 6 is not divisible by the 8 batch shards"):
        S.shard_batch(np.zeros((6, 4), np.int32), mesh)


def test_table_and_pictures(capsys):
    import matplotlib.figure
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    mesh = S.make_mesh("data=2,fsdp=2,tensor=2")
    rows = S.sharding_table(cfg, mesh, "fsdp_tp")
    byname = {r["name"]: r for r in rows}
    assert byname["layers/q_proj"]["shape"] == (2, 64, 64)
    assert byname["layers/q_proj"]["spec"] == "(None, 'fsdp', 'tensor')"
    assert byname["layers/q_proj"]["bytes_per_device"] == 2 * 64 * 64 * 4 // 4
    assert byname["norm"]["bytes_per_device"] == 64 * 4
    assert sum(r["bytes"] for r in rows) == cfg.num_params() * 4
    text = S.format_table(rows)
    assert "layers/q_proj" in text and "total" in text and "(None, 'fsdp', 'tensor')" in text
    fig = plots.layer_sharding(cfg, mesh, "fsdp_tp")
    assert isinstance(fig, matplotlib.figure.Figure)
    titled = [a for a in fig.axes if a.get_title()]
    assert len(titled) == 7  # q k v o gate up down (the norms are replicated; the figure's title says so)
    q_ax = next(a for a in titled if a.get_title().startswith("q_proj"))
    labels = sorted(t.get_text() for t in q_ax.texts)
    assert labels == ["d0,4", "d1,5", "d2,6", "d3,7"]  # 4 blocks, each held by the 2 data replicas
    matplotlib.pyplot.close(fig)
    arr = jax.device_put(jnp.zeros((2, 64, 64)), NamedSharding(mesh, P(None, "fsdp", "tensor")))
    plots.show_array_sharding(arr)
    out = capsys.readouterr().out
    assert "CPU 0,4" in out or "0,4" in out
    with pytest.raises(S.ShardingError, match="draws 2-D arrays"):
        plots.show_array_sharding(jnp.zeros((2, 2, 2, 2)))


def test_mesh_devices_on_any_device_count():
    """8 devices for a mesh: the accelerators where there are 8 (here: the 8 simulated CPU devices), else 8
    simulated CPU devices beside 1 or 2 (a stand-in list), with a line saying so; too few of both: an error."""
    from amdllm.parallel.sharding import ShardingError, mesh_devices
    devs, note = mesh_devices(8)
    assert devs == jax.devices()[:8] and note.startswith("8 devices: cpu")
    for n in (1, 2):
        devs, note = mesh_devices(8, jax.devices()[:n])
        assert devs == jax.devices("cpu")[:8] and f"only {n} cpu device(s)" in note
        assert S.make_mesh("fsdp=4,tensor=2", devices=devs).devices.size == 8
    with pytest.raises(ShardingError, match="jax_num_cpu_devices"):
        mesh_devices(16, jax.devices()[:1])

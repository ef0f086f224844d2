"""checkpoint.load / save against checkpoints written and read by `transformers` itself."""
import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.tiny import hf_logits, make_hf_checkpoint, random_tokens

from amdllm.io import checkpoint, safetensors
from amdllm.io.checkpoint import CheckpointError
from amdllm.config import ConfigError


def _state(model):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bit_equal(m1, m2):
    s1, s2 = _state(m1), _state(m2)
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].dtype == s2[k].dtype, k
        assert np.array_equal(s1[k].view(np.uint8), s2[k].view(np.uint8)), k


def _hf_from(path):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("f32"))


def test_bf16_sharded_checkpoint_loads(tmp_path):
    ckpt, hf = make_hf_checkpoint(tmp_path, dtype="bfloat16", max_shard_size="20KB")
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) > 3 and (ckpt / "model.safetensors.index.json").exists()
    model = checkpoint.load(ckpt, dtype=jnp.bfloat16)
    # exact values: HF layer 1 q_proj [out, in] is our stacked kernel [1].T
    q = np.asarray(model.layers.q_proj[...][1].astype(jnp.float32))
    assert np.array_equal(q.T, hf.model.layers[1].self_attn.q_proj.weight.detach().numpy())
    f32 = checkpoint.load(ckpt)  # bf16 on disk, float32 in memory: exact upcast
    tokens = random_tokens(2, 24)
    diff = np.abs(np.asarray(f32(jnp.asarray(tokens))[0]) - hf_logits(hf, tokens)).max()
    print(f"bf16 sharded checkpoint, float32 logits vs transformers: {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_every_stored_dtype_loads_hfs_exact_values(tmp_path, stored):
    """Every stored dtype into every parameter dtype, HF's exact values: the kernels [in, out] are HF's
    [out, in] transposed (`amdllm.io.transpose`, by bands), slab by slab across shards."""
    from amdllm.io import transpose
    a = np.arange(37 * 21, dtype=np.float32).reshape(37, 21)[:, 2:19]  # strided rows, not a multiple of BAND
    for dt in (np.float32, np.float16):
        out = np.empty((17, 37), dt)
        transpose.copy_transposed(out, a.astype(dt) if dt != np.float32 else a)
        np.testing.assert_array_equal(out, a.T.astype(dt))
    np.testing.assert_array_equal(transpose.transposed(a), a.T)
    ckpt, hf = make_hf_checkpoint(tmp_path, dtype=stored, max_shard_size="30KB")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        ours = checkpoint.load(ckpt, dtype=dtype)
        want = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()  # [out, in], the stored values
        got = np.asarray(ours.layers.down_proj[...][1].astype(jnp.float32)).T
        assert np.array_equal(got, np.asarray(jnp.asarray(want).astype(dtype).astype(jnp.float32))), dtype


@pytest.mark.parametrize("dtype,shard", [("float32", None), ("bfloat16", "30KB"), ("float32", 40_000)])
def test_saved_checkpoint_loads_in_transformers(tmp_path, f32, dtype, shard):
    ckpt, hf = f32
    model = checkpoint.load(ckpt)
    out = checkpoint.save(model, tmp_path / "ours", dtype=dtype, **({} if shard is None else {"max_shard_size": shard}))
    files = sorted(p.name for p in out.iterdir())
    assert ("model.safetensors.index.json" in files) == (shard is not None), files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == dtype
    back = _hf_from(out)
    ref = copy.deepcopy(hf)
    with torch.no_grad():  # round the parameters (not the RoPE buffers) the way the file did
        for p in ref.parameters():
            p.copy_(p.to(getattr(torch, dtype)).to(torch.float32))
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    tokens = random_tokens(2, 24)
    diff = np.abs(hf_logits(back, tokens) - hf_logits(ref, tokens)).max()
    print(f"save({dtype}, shards={shard}) -> transformers: logits diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_load_save_load_bit_exact(tmp_path, f32, dtype):
    m1 = checkpoint.load(f32[0], dtype=dtype)
    checkpoint.save(m1, tmp_path / "a", max_shard_size="25KB")
    m2 = checkpoint.load(tmp_path / "a", dtype=dtype)
    _assert_bit_equal(m1, m2)
    # saving again unsharded into the same directory leaves no stale shards behind
    checkpoint.save(m2, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").glob("model*")) == ["model.safetensors"]
    _assert_bit_equal(m1, checkpoint.load(tmp_path / "a", dtype=dtype))


def test_tied_embeddings_round_trip(tmp_path):
    ckpt, hf = make_hf_checkpoint(tmp_path, tie_word_embeddings=True)
    m1 = checkpoint.load(ckpt)
    assert not hasattr(m1, "lm_head")
    out = checkpoint.save(m1, tmp_path / "ours")
    assert "lm_head.weight" not in checkpoint.load_tensors(out / "model.safetensors")
    back = _hf_from(out)
    tokens = random_tokens(1, 16)
    assert np.abs(hf_logits(back, tokens) - hf_logits(hf, tokens)).max() == 0.0


def test_tokenizer_files_copied(tmp_path, f32):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    out = checkpoint.save(checkpoint.load(f32[0]), tmp_path / "out", tokenizer_from=tok)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out / "tokenizer_config.json").exists() and not (out / "special_tokens_map.json").exists()
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        checkpoint.save(checkpoint.load(f32[0]), tmp_path / "out2", tokenizer_from=tmp_path / "out2")


# ---- bad input: one clear line naming the culprit -------------------------------------------------
def _rewrite(ckpt, fn):
    """Apply fn to the tensor dict of a (single-file) checkpoint and write it back."""
    tensors = checkpoint.load_tensors(ckpt / "model.safetensors")
    checkpoint.save_tensors(ckpt / "model.safetensors", fn(tensors))


def _one_line_error(exc_type, ckpt, *fragments, **kw):
    with pytest.raises(exc_type) as e:
        checkpoint.load(ckpt, **kw)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


@pytest.fixture
def fresh(tmp_path):
    return make_hf_checkpoint(tmp_path)[0]


def test_missing_tensor(fresh):
    _rewrite(fresh, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    _one_line_error(CheckpointError, fresh, "missing tensors", "model.layers.1.mlp.up_proj.weight")


def test_extra_tensor(fresh):
    _rewrite(fresh, lambda t: {**t, "model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)})
    _one_line_error(CheckpointError, fresh, "unexpected tensors", "model.layers.0.mlp.extra.weight")


def test_wrong_shape(fresh):
    _rewrite(fresh, lambda t: {**t, "model.norm.weight": np.ones(63, np.float32)})
    _one_line_error(CheckpointError, fresh, "model.norm.weight expected [64] found [63]")


def test_all_problems_listed_at_once(fresh):
    def break_all(t):
        t = {k: v for k, v in t.items() if k != "lm_head.weight"}
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
        t["model.layers.0.self_attn.o_proj.weight"] = np.zeros((64, 32), np.float32)
        t["model.layers.2.mlp.up_proj.weight"] = np.zeros((128, 64), np.float32)
        return t
    _rewrite(fresh, break_all)
    _one_line_error(CheckpointError, fresh, "missing tensors: lm_head.weight",
                    "unexpected tensors: model.layers.2.mlp.up_proj.weight",
                    "model.layers.0.self_attn.k_proj.weight expected [32, 64] found [16, 64]",
                    "model.layers.0.self_attn.o_proj.weight expected [64, 64] found [64, 32]")


def test_truncated_safetensors(fresh):
    f = fresh / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _one_line_error(CheckpointError, fresh, str(f), "truncated")
    f.write_bytes(data[:100])  # cut inside the JSON header
    _one_line_error(CheckpointError, fresh, str(f), "truncated")


def test_missing_shard_file(tmp_path):
    ckpt, _ = make_hf_checkpoint(tmp_path, max_shard_size="20KB")
    victim = sorted(ckpt.glob("model-*.safetensors"))[1]
    victim.unlink()
    _one_line_error(CheckpointError, ckpt, "model.safetensors.index.json", victim.name, "missing")


def _edit_config(ckpt, fn):
    p = ckpt / "config.json"
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def test_unknown_model_type(fresh):
    _edit_config(fresh, lambda d: d.update(model_type="mistral"))
    _one_line_error(ConfigError, fresh, "config.json", "'mistral'")


def test_unsupported_rope_type(fresh):
    _edit_config(fresh, lambda d: d.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                            "rope_theta": 10000.0}))
    _one_line_error(ConfigError, fresh, "config.json", "'yarn'")


def test_missing_config(fresh):
    (fresh / "config.json").unlink()
    _one_line_error(CheckpointError, fresh, "config.json not found", str(fresh))


def test_not_a_directory_and_bad_dtype(fresh):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint.load(fresh / "model.safetensors")
    with pytest.raises(CheckpointError, match="dtype=int32"):
        checkpoint.load(fresh, dtype=jnp.int32)


def test_pickle_refused_unless_allowed(tmp_path):
    ckpt, hf = make_hf_checkpoint(tmp_path)
    torch.save(hf.state_dict(), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    _one_line_error(CheckpointError, ckpt, "pytorch_model.bin", "allow_pickle=True")
    model = checkpoint.load(ckpt, allow_pickle=True)
    tokens = random_tokens(1, 16)
    assert np.abs(np.asarray(model(jnp.asarray(tokens))[0]) - hf_logits(hf, tokens)).max() <= 1e-4


def test_bad_max_shard_size(f32, tmp_path):
    assert checkpoint.parse_size("2GB") == 2 * 10**9 and checkpoint.parse_size("1GiB") == 2**30
    assert checkpoint.parse_size("500MB") == 500 * 10**6 and checkpoint.parse_size(1234) == 1234
    with pytest.raises(CheckpointError, match="max_shard_size='lots'"):
        checkpoint.save(checkpoint.load(f32[0]), tmp_path / "x", max_shard_size="lots")


# ---- sharded loading ------------------------------------------------------------------------------
def test_shardings_by_hand(f32, tmp_path):
    assert len(jax.devices()) >= 4
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    wanted = {
        "embed_tokens": P("y", "x"),            # vocab over y, embed over x
        "layers/q_proj": P("x", None, "y"),     # layer axis split: each device reads one layer
        "layers/down_proj": P(None, "y", "x"),  # the transposed slice of every layer
        "layers/input_layernorm": P(None, "x"),
        "lm_head": P(("x", "y"), None),         # nested axis tuple over the embed dim
    }
    shardings = {k: NamedSharding(mesh, s) for k, s in wanted.items()}
    plain = _state(checkpoint.load(f32[0]))
    model = checkpoint.load(f32[0], shardings=shardings)
    got = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for name, sh in shardings.items():
        arr = got[name]
        assert arr.sharding == sh, name
        assert np.array_equal(np.asarray(arr), plain[name]), name
        # each device holds only its block, and that block is the matching slice of the full array
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), plain[name][shard.index]), name
    assert np.array_equal(np.asarray(got["layers/up_proj"]), plain["layers/up_proj"])  # unlisted: unsharded
    # saving gathers the sharded arrays tensor by tensor; the result equals the unsharded model
    checkpoint.save(model, tmp_path / "from_sharded", max_shard_size="40KB")
    again = _state(checkpoint.load(tmp_path / "from_sharded"))
    assert all(np.array_equal(again[k], plain[k]) for k in plain)


def test_mesh_and_rules(f32):
    from amdllm.parallel.sharding import make_mesh
    mesh = make_mesh("fsdp=4", devices=jax.devices()[:4])
    plain = _state(checkpoint.load(f32[0]))
    model = checkpoint.load(f32[0], mesh=mesh, rules="fsdp")
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, k))
        assert np.array_equal(np.asarray(v), plain[name]), name
        assert set(v.sharding.device_set) == set(jax.devices()[:4]), name


# ---- host memory at load (benchmarks/bench_load.py measures the peak) ------------------------------
def test_slab_by_slab_copy_is_exact(f32, monkeypatch):
    """Tensors copied (cast, transposed, column-sliced) a few HF rows at a time, each slab's file pages
    released after it: the same bits as one copy, sharded or not. (By default only tensors over
    SLAB_BYTES, 8 MB, are split, which no tiny checkpoint has.)"""
    plain = _state(checkpoint.load(f32[0]))
    plain16 = _state(checkpoint.load(f32[0], dtype=jnp.bfloat16))
    released = []
    release = checkpoint.SafetensorsFile.release
    monkeypatch.setattr(checkpoint, "SLAB_BYTES", 3 * 64 * 4 + 1)  # 3 rows of a [*, 64] float32 tensor
    monkeypatch.setattr(checkpoint.SafetensorsFile, "release",
                        lambda self, name, rows=None: (released.append((name, rows)), release(self, name, rows)))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    shardings = {"embed_tokens": NamedSharding(mesh, P("y", "x")),
                 "lm_head": NamedSharding(mesh, P("x", "y")),           # HF rows from the middle, transposed
                 "layers/down_proj": NamedSharding(mesh, P(None, "y", "x"))}
    for sh in (None, shardings):
        got = _state(checkpoint.load(f32[0], shardings=sh))
        assert all(np.array_equal(got[k], plain[k]) for k in plain), sh
    got16 = _state(checkpoint.load(f32[0], dtype=jnp.bfloat16))  # the cast happens slab by slab too
    assert all(np.array_equal(got16[k].view(np.uint16), plain16[k].view(np.uint16)) for k in plain16)
    assert ("model.embed_tokens.weight", (0, 3)) in released and ("lm_head.weight", (3, 6)) in released


def test_device_put_adopts_the_aligned_host_buffer():
    """load's peak (about the model itself, not the model plus a copy) relies on XLA's CPU client taking
    a 64-byte-aligned numpy buffer as the device buffer without copying it: fail loudly if a jax
    upgrade stops doing so. An unaligned buffer is copied (what numpy's own allocations usually are)."""
    a = safetensors.aligned_empty((300, 70), jnp.bfloat16)
    assert a.ctypes.data % safetensors.ALIGN == 0 and a.flags.c_contiguous and a.shape == (300, 70)
    a[...] = 1
    x = jax.device_put(a, may_alias=True)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    raw = np.empty(300 * 70 * 2 + 64, np.uint8)
    off = (16 - raw.ctypes.data) % 64
    b = raw[off:off + 300 * 70 * 2].view(jnp.bfloat16).reshape(300, 70)  # 16 bytes past a 64-byte boundary
    assert b.ctypes.data % 64 == 16
    assert jax.device_put(b, may_alias=True).unsafe_buffer_pointer() != b.ctypes.data
    assert np.array_equal(np.asarray(x, np.float32), np.ones((300, 70), np.float32))


def test_reader_errors_shared_with_gptq(tmp_path):
    """quant_format reads safetensors with the same reader: its checks, reported as QuantFormatError."""
    from amdllm.io.gptq_format import QuantFormatError, read_safetensors
    f = tmp_path / "x.safetensors"
    checkpoint.save_tensors(f, {"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
    assert np.array_equal(read_safetensors(f)["a"], np.arange(6).reshape(2, 3))
    data = f.read_bytes()
    f.write_bytes(data.replace(b'"I32"', b'"I99"'))
    with pytest.raises(QuantFormatError, match="tensor 'a' has unsupported dtype 'I99'"):
        read_safetensors(f)
    f.write_bytes(data[:-4])
    with pytest.raises(QuantFormatError, match="truncated"):
        read_safetensors(f)

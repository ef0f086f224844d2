"""Class "the loader accepts what it should refuse": corrupt safetensors headers (validated as the
`safetensors` library validates them), index entries outside the checkpoint directory, NaN/inf weights
in a base or an adapter, a truncated adapter, and a tokenizer whose ids the model does not have. Each
through the `amdllm` command; the refusal is one line naming the file and tensor, and `--json` never
prints a non-JSON value."""
import json
import shutil
import struct

import numpy as np
import pytest
import safetensors.numpy as stn

from tests.robustness.conftest import amdllm, copy_model, one_line_error
from tests.tiny import make_hf_checkpoint


def read_header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path, header, data):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def two_tensors(header):
    """Names of two tensors of the same byte size (first by offset)."""
    by_size = {}
    for k, v in header.items():
        if k != "__metadata__":
            by_size.setdefault(v["data_offsets"][1] - v["data_offsets"][0], []).append(k)
    pair = next(v for v in by_size.values() if len(v) >= 2)
    return sorted(pair, key=lambda k: header[k]["data_offsets"][0])[:2]


def corrupt(header, data, how):
    a, b = two_tensors(header)
    if how == "overlap":  # b reads a's bytes (what gave perplexity 1.869 instead of 1.685)
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    elif how == "gap":  # every tensor moved 8 bytes on: a gap at the start, the end past the data
        for k, v in header.items():
            if k != "__metadata__":
                v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
        data = data + bytes(8)
    elif how == "not an object":
        return [1, 2, 3], data
    elif how == "shape of strings":
        header[a]["shape"] = [str(x) for x in header[a]["shape"]]
    elif how == "negative offset":
        header[a]["data_offsets"] = [-4, header[a]["data_offsets"][1] - 4]
    elif how == "unknown dtype":
        header[a]["dtype"] = "F13"
    elif how == "trailing bytes":
        data = data + bytes(64)
    elif how == "truncated":
        data = data[:-100]
    return header, data


HOW = ["overlap", "gap", "not an object", "shape of strings", "negative offset", "unknown dtype", "trailing bytes",
       "truncated"]


@pytest.mark.parametrize("how", HOW)
def test_corrupt_safetensors_header_is_refused(how, tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    write_header(f, *corrupt(*read_header(f), how))
    with pytest.raises(Exception):  # the reference: the safetensors library refuses every one of these
        stn.load_file(str(f))
    one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"]), str(f))


def test_index_entry_outside_the_checkpoint_is_refused(tiny, tmp_path):
    d, _ = make_hf_checkpoint(tmp_path, name="sharded", max_shard_size="40KB", vocab_size=320)
    for f in [*tiny["model"].glob("tok*.json"), tiny["model"] / "special_tokens_map.json"]:
        shutil.copy(f, d / f.name)
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    name, shard = next(iter(idx["weight_map"].items()))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(d / shard, outside / shard)  # the file exists there: only where it lies is wrong
    for target in (f"../elsewhere/{shard}", str(outside / shard)):
        idx["weight_map"][name] = target
        index.write_text(json.dumps(idx))
        one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"]), str(index), name, target)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(bad_value, tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "m")
    t = stn.load_file(str(d / "model.safetensors"))
    t["model.layers.1.mlp.down_proj.weight"][3, 5] = bad_value
    stn.save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    for argv in (["eval", "--text", tiny["text"], "--json"], ["generate", "--prompt", "the cat", "--json"]):
        p = amdllm(*argv, "--model", d)
        one_line_error(p, "model.layers.1.mlp.down_proj.weight", "NaN or infinite")
        assert p.stdout == ""  # --json prints nothing rather than a non-JSON NaN


def test_convert_to_float16_refuses_weights_beyond_its_range(tiny, tmp_path):
    """float16 ends at 65504: a bf16 weight of 1e5 would be written as inf, so the tensor is named instead."""
    import ml_dtypes
    d = copy_model(tiny, tmp_path / "m")
    t = stn.load_file(str(d / "model.safetensors"))
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    t["model.layers.0.self_attn.o_proj.weight"][2, 7] = 1e5
    stn.save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    out = tmp_path / "f16"
    one_line_error(amdllm("convert", "--model", d, "--out", out, "--dtype", "float16"),
                   "model.layers.0.self_attn.o_proj.weight", "float16", "inf")
    assert not out.exists()
    ok = amdllm("convert", "--model", d, "--out", tmp_path / "f32", "--dtype", "float32")  # a wide dtype is fine
    assert ok.returncode == 0, ok.stderr[-1000:]


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    """A PEFT adapter of the tiny model, written by our save_adapter (peft's format)."""
    from amdllm.io.checkpoint import load
    from amdllm.io.peft import save_adapter
    from amdllm.model.lora import apply_lora
    model = apply_lora(load(tiny["model"]), rank=4, targets="q,v")
    out = tmp_path_factory.mktemp("adapter") / "a"
    save_adapter(model, out, base_model_dir=str(tiny["model"]))
    return out


def test_nan_adapter_is_refused(tiny, adapter, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(adapter, a)
    t = stn.load_file(str(a / "adapter_model.safetensors"))
    key = sorted(t)[0]
    t[key][0, 0] = np.nan
    stn.save_file(t, str(a / "adapter_model.safetensors"))
    one_line_error(amdllm("eval", "--model", tiny["model"], "--adapter", a, "--text", tiny["text"]), key, "NaN")


def test_truncated_adapter_is_refused(tiny, adapter, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(adapter, a)
    f = a / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-50])
    one_line_error(amdllm("eval", "--model", tiny["model"], "--adapter", a, "--text", tiny["text"]), str(f),
                   "truncated")


def test_tokenizer_with_ids_beyond_the_model_vocabulary_is_refused(tiny, tmp_path):
    """The tiny tokenizer has ~300 ids; a model with a 64-entry vocabulary cannot read them (an embedding
    lookup out of range would read a clamped row: garbage, silently)."""
    d, _ = make_hf_checkpoint(tmp_path, name="small_vocab", vocab_size=64, bos_token_id=0, eos_token_id=1,
                              pad_token_id=2, max_position_embeddings=128)
    for f in tiny["model"].glob("tok*.json"):
        shutil.copy(f, d / f.name)
    shutil.copy(tiny["model"] / "special_tokens_map.json", d)
    one_line_error(amdllm("generate", "--model", d, "--prompt", "the red fox met the blue owl"),
                   "outside the model's vocabulary [0, 64)")
    one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"]), "outside the model's vocabulary [0, 64)")
    one_line_error(amdllm("finetune", "--model", d, "--data", tiny["data"], "--out", tmp_path / "run",
                          "--steps", "1"), "training data", "outside the model's vocabulary [0, 64)")


@pytest.fixture(scope="module")
def gptq(tiny, tmp_path_factory):
    """The tiny model quantized by `amdllm quantize` (RTN: seconds): a GPTQ checkpoint to break."""
    out = tmp_path_factory.mktemp("gptq") / "q"
    p = amdllm("quantize", "--model", tiny["model"], "--out", out, "--method", "rtn", "--group-size", "32")
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def broken_gptq(gptq, tmp_path, edit):
    d = shutil.copytree(gptq, tmp_path / "q")
    t = stn.load_file(str(d / "model.safetensors"))
    edit(t)
    stn.save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


Q = "model.layers.0.self_attn.q_proj"
GPTQ_CASES = {  # the tensors edited -> what the line names
    "a float qweight (never cast)": (lambda t: t.__setitem__(f"{Q}.qweight", t[f"{Q}.qweight"].astype(np.float32)),
                                     [f"{Q}.qweight", "float32", "expected integers"]),
    "a float g_idx (never truncated)": (lambda t: t.__setitem__(f"{Q}.g_idx", t[f"{Q}.g_idx"] + np.float32(0.5)),
                                        [f"{Q}.g_idx", "expected integers"]),
    "a q_proj.bias the config lacks": (lambda t: t.__setitem__(f"{Q}.bias", np.zeros(64, np.float16)),
                                       [f"{Q}.bias", "unexpected tensors"]),
    "a layer the config lacks": (lambda t: t.__setitem__("model.layers.9.input_layernorm.weight",
                                                         np.ones(64, np.float16)),
                                 ["model.layers.9.input_layernorm.weight", "unexpected tensors"]),
    "NaN scales": (lambda t: t[f"{Q}.scales"].__setitem__((0, 0), np.nan), [f"{Q}.scales", "NaN"]),
    "NaN embeddings": (lambda t: t["model.embed_tokens.weight"].__setitem__((3, 3), np.nan),
                       ["model.embed_tokens.weight", "NaN"]),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_a_gptq_checkpoint_is_checked_as_a_dense_one(case, tiny, gptq, tmp_path):
    """The dense loader's rules (dtypes, shapes, finiteness, nothing the config does not name) hold for a
    GPTQ checkpoint too, where each had given a silently different model."""
    edit, named = GPTQ_CASES[case]
    d = broken_gptq(gptq, tmp_path, edit)
    one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"]), *named)


@pytest.mark.parametrize("what", ["dense", "gptq"])
def test_a_config_claiming_millions_of_layers_is_refused_at_once(what, tiny, gptq, tmp_path):
    """num_hidden_layers 2e7 over a file with 2 layers: the names decide, before any per-layer table."""
    d = shutil.copytree(tiny["model"] if what == "dense" else gptq, tmp_path / what)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 20_000_000}))
    one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"], timeout=60),
                   "num_hidden_layers=20000000", "layers 0-1")


def test_an_index_that_names_the_wrong_shard_is_refused(tiny, tmp_path):
    ckpt, _ = make_hf_checkpoint(tmp_path, max_shard_size="20KB", vocab_size=320)
    for f in tiny["model"].glob("tokenizer*"):
        shutil.copyfile(f, ckpt / f.name)
    index = ckpt / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    names = sorted(idx["weight_map"])
    a, b = names[0], next(n for n in names if idx["weight_map"][n] != idx["weight_map"][names[0]])
    idx["weight_map"][a] = idx["weight_map"][b]  # a's entry names b's shard, which does not hold a
    index.write_text(json.dumps(idx))
    one_line_error(amdllm("eval", "--model", ckpt, "--text", tiny["text"]), "model.safetensors.index.json", a,
                   "does not contain it")


def test_a_stray_second_safetensors_file_in_a_gptq_directory_is_refused(tiny, gptq, tmp_path):
    """A leftover copy with other values beside model.safetensors: neither may silently win."""
    d = shutil.copytree(gptq, tmp_path / "q")
    t = stn.load_file(str(d / "model.safetensors"))
    stray = {"model.norm.weight": t["model.norm.weight"] * 2}
    stn.save_file(stray, str(d / "zz-old.safetensors"), metadata={"format": "pt"})
    one_line_error(amdllm("eval", "--model", d, "--text", tiny["text"]), "model.norm.weight",
                   "model.safetensors", "zz-old.safetensors", "stray")

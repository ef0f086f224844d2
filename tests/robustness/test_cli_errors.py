"""Class "tracebacks where one line naming the culprit was expected": each case runs the `amdllm` command
in its own process and asserts a non-zero exit, no traceback, and one error line naming the file, flag or
field at fault. Values are refused by the parser or before any weights load, so most cases take seconds."""
import json
import os
import resource

import pytest

from tests.robustness.conftest import amdllm, copy_model, one_line_error


@pytest.fixture(scope="module")
def bad(tiny, tmp_path_factory):
    """Broken copies of the tiny checkpoint and broken input files, built once."""
    root = tmp_path_factory.mktemp("bad")
    cfg = json.loads((tiny["model"] / "config.json").read_text())
    made = {}
    for name, content in [("cfg_list", [1, 2]), ("cfg_kv0", {**cfg, "num_key_value_heads": 0}),
                          ("cfg_vocab", {**cfg, "vocab_size": "lots"}), ("cfg_layers", {**cfg, "num_hidden_layers": -2}),
                          ("cfg_heads", {**cfg, "num_attention_heads": 4, "num_key_value_heads": 3})]:
        d = copy_model(tiny, root / name)
        (d / "config.json").write_text(json.dumps(content))
        made[name] = d
    d = copy_model(tiny, root / "tok_bad")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    made["tok_bad"] = d
    d = copy_model(tiny, root / "cfg_eos")
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": "end"}))
    made["cfg_eos"] = d
    for name, content in [("adapter_list", [1]), ("adapter_rank", {"peft_type": "LORA", "r": "eight",
                                                                   "target_modules": ["q_proj"]})]:
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text(json.dumps(content))
        made[name] = root / name
    d = copy_model(tiny, root / "weights_dir")  # the weights file is not a readable file
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    made["weights_dir"] = d
    d = copy_model(tiny, root / "weights_perm")
    os.chmod(d / "model.safetensors", 0)
    made["weights_perm"] = d
    made["afile"] = root / "afile"
    made["afile"].write_text("not a directory")
    made["bad_jsonl"] = root / "bad.jsonl"
    made["bad_jsonl"].write_bytes(b'{"text": "the cat"}\n{"text": "caf\xe9"}\n')
    made["bad_txt"] = root / "bad.txt"
    made["bad_txt"].write_bytes(b"the cat sat.\nthe dog ran.\n\xff\xfe the end\n")
    made["root"] = root
    return made


def cases(tiny, bad):
    m, data, out = tiny["model"], tiny["data"], bad["root"] / "out"
    return {
        "config.json is a list": (["eval", "--model", bad["cfg_list"]], ["config.json", "JSON object"]),
        "num_key_value_heads 0": (["eval", "--model", bad["cfg_kv0"]], ["config.json", "num_key_value_heads"]),
        "vocab_size 'lots'": (["generate", "--model", bad["cfg_vocab"], "--prompt", "the"], ["vocab_size", "'lots'"]),
        "num_hidden_layers -2": (["eval", "--model", bad["cfg_layers"]], ["num_hidden_layers"]),
        "heads not a multiple of kv heads": (["eval", "--model", bad["cfg_heads"]], ["num_key_value_heads=3"]),
        "eos_token_id a string": (["eval", "--model", bad["cfg_eos"]], ["config.json", "eos_token_id"]),
        "tokenizer.json corrupt": (["eval", "--model", bad["tok_bad"]], ["tokenizer.json"]),
        "adapter_config.json a list": (["eval", "--model", m, "--adapter", bad["adapter_list"]],
                                       ["adapter_config.json", "JSON object"]),
        "adapter rank a string": (["eval", "--model", m, "--adapter", bad["adapter_rank"]],
                                  ["adapter_config.json", "r must be a positive integer"]),
        "finetune --rules unknown": (["finetune", "--model", m, "--data", data, "--out", out, "--rules", "nope"],
                                     ["--rules"]),
        "plan --model unknown preset": (["plan", "--model", "llama-9000"], ["llama-9000", "preset"]),
        "weights file is a directory": (["eval", "--model", bad["weights_dir"]], ["model.safetensors"]),
        "weights file unreadable (permission)": (["eval", "--model", bad["weights_perm"]], ["model.safetensors"]),
        "finetune --out is a file": (["finetune", "--model", m, "--data", data, "--out", bad["afile"]], ["--out"]),
        "quantize --out is a file": (["quantize", "--model", m, "--out", bad["afile"]], ["--out"]),
        "convert --out is a file": (["convert", "--model", m, "--out", bad["afile"]], ["--out"]),
        "non-UTF-8 training row": (["finetune", "--model", m, "--data", bad["bad_jsonl"], "--out", out],
                                   [f"{bad['bad_jsonl']}:2", "UTF-8"]),
        "non-UTF-8 --text": (["eval", "--model", m, "--text", bad["bad_txt"]], [f"{bad['bad_txt']}:3"]),
        "non-UTF-8 --calib": (["quantize", "--model", m, "--calib", bad["bad_txt"], "--out", out],
                              [f"{bad['bad_txt']}:3"]),
        "finetune --batch-size 0": (["finetune", "--model", m, "--data", data, "--out", out, "--batch-size", "0"],
                                    ["--batch-size"]),
        "finetune --grad-accum 0": (["finetune", "--model", m, "--data", data, "--out", out, "--grad-accum", "0"],
                                    ["--grad-accum"]),
        "finetune --steps 0": (["finetune", "--model", m, "--data", data, "--out", out, "--steps", "0"], ["--steps"]),
        "finetune --lr nan": (["finetune", "--model", m, "--data", data, "--out", out, "--lr", "nan"], ["--lr"]),
        "finetune --seq-len 1": (["finetune", "--model", m, "--data", data, "--out", out, "--seq-len", "1"],
                                 ["--seq-len"]),
        "eval --batch-size 0": (["eval", "--model", m, "--batch-size", "0"], ["--batch-size"]),
        "eval --seq-len beyond the context": (["eval", "--model", m, "--text", tiny["text"], "--seq-len", "1000000"],
                                              ["--seq-len", "max_position_embeddings=128"]),
        "plan --devices 0": (["plan", "--devices", "0"], ["--devices"]),
        "plan --devices -8": (["plan", "--devices", "-8"], ["--devices"]),
        "plan --batch-size -1": (["plan", "--batch-size", "-1"], ["--batch-size"]),
        "plan --seq-len 0": (["plan", "--seq-len", "0"], ["--seq-len"]),
        "generate --max-new-tokens -5": (["generate", "--model", m, "--prompt", "the", "--max-new-tokens", "-5"],
                                         ["--max-new-tokens"]),
        "generate --temperature nan": (["generate", "--model", m, "--prompt", "the", "--temperature", "nan"],
                                       ["--temperature"]),
        "generate --top-p 2": (["generate", "--model", m, "--prompt", "the", "--top-p", "2"], ["--top-p"]),
        "quantize --samples 0": (["quantize", "--model", m, "--out", out, "--samples", "0"], ["--samples"]),
        "quantize --bits 3": (["quantize", "--model", m, "--out", out, "--bits", "3"], ["--bits 3"]),
        "serve --port 99999": (["serve", "--model", m, "--port", "99999"], ["--port 99999"]),
        "serve --max-batch 0": (["serve", "--model", m, "--max-batch", "0"], ["--max-batch"]),
        "an unknown flag": (["eval", "--modle", m], ["--modle"]),
    }


CASES = ["config.json is a list", "num_key_value_heads 0", "vocab_size 'lots'", "num_hidden_layers -2",
         "heads not a multiple of kv heads", "eos_token_id a string", "tokenizer.json corrupt",
         "adapter_config.json a list", "adapter rank a string", "finetune --rules unknown",
         "plan --model unknown preset", "weights file is a directory", "weights file unreadable (permission)",
         "finetune --out is a file", "quantize --out is a file", "convert --out is a file",
         "non-UTF-8 training row", "non-UTF-8 --text", "non-UTF-8 --calib", "finetune --batch-size 0",
         "finetune --grad-accum 0", "finetune --steps 0", "finetune --lr nan", "finetune --seq-len 1",
         "eval --batch-size 0", "eval --seq-len beyond the context", "plan --devices 0", "plan --devices -8",
         "plan --batch-size -1", "plan --seq-len 0", "generate --max-new-tokens -5", "generate --temperature nan",
         "generate --top-p 2", "quantize --samples 0", "quantize --bits 3", "serve --port 99999",
         "serve --max-batch 0", "an unknown flag"]


@pytest.mark.parametrize("case", CASES)
def test_one_line_naming_the_culprit(case, tiny, bad):
    argv, culprits = cases(tiny, bad)[case]
    if case == "weights file unreadable (permission)" and os.geteuid() == 0:
        # root reads any file: the same OSError path is driven by a directory instead ("is a directory")
        argv = ["eval", "--model", bad["weights_dir"]]
    one_line_error(amdllm(*argv), *culprits)
    assert not (bad["root"] / "out").exists()  # refused before anything was written


def test_disk_full_while_saving_names_the_file_and_leaves_no_partial_file(tiny, tmp_path):
    """A file-size limit makes every write past it fail with EFBIG ("File too large"), as a full disk
    fails with ENOSPC: the error is one line naming the file, and no partial file is left in --out."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
    out = tmp_path / "converted"
    p = amdllm("convert", "--model", tiny["model"], "--out", out, preexec_fn=limit)
    line = one_line_error(p, "File too large", str(out / "model.safetensors"))
    assert [f.name for f in tmp_path.iterdir()] == [], line  # no half-written output, no staging left


def test_unknown_fields_and_empty_responses_are_warned_once_each(tiny, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "where is the cat?", "inptu": "park", "output": "the park."}\n'
                    '{"instruction": "where is the dog?", "output": ""}\n' * 4)
    p = amdllm("finetune", "--model", tiny["model"], "--data", rows, "--out", tmp_path / "run", "--steps", "1",
               "--batch-size", "2", "--seq-len", "32", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    warned = [ln for ln in p.stderr.splitlines() if ": warning: " in ln]
    assert any(f"{rows}:1: field 'inptu' is ignored (4 rows)" in ln for ln in warned), warned
    assert any(f"{rows}:2: empty response (4 rows)" in ln for ln in warned), warned
    assert len(warned) == 2, warned

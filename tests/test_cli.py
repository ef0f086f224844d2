"""The `amdllm doctor / eval / generate` contract (docs/cli.md): with --json exactly one JSON object on
stdout with the documented keys, numbers equal to transformers on a tiny HF checkpoint directory, clear
one-line errors; and the silent-CPU-fallback diagnosis on made-up machines."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import amdllm
from amdllm import cli, env
from amdllm.io.gptq_format import read_checkpoint_tensors
from tests.test_evaluate import reference_perplexity
from tests.test_generate import hf_greedy
from tests.tiny import make_hf_checkpoint

TEXT = ("Once upon a time, there was a little blue cat named Maya. Maya lived in the house. Maya could "
        "climb trees. One windy morning, Maya went to the field. There, Maya met a gold bear named Lucy.\n")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random tiny Llama over the course tokenizer's vocabulary, saved by transformers, tokenizer files
    beside it: a checkpoint directory exactly as `--model` expects."""
    from amdllm.io.tokenizer import load_tokenizer
    tok = load_tokenizer("data/tokenizer")
    d, hf = make_hf_checkpoint(tmp_path_factory.mktemp("cli"), seed=3, vocab_size=len(tok),
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"data/tokenizer/{f}", d / f)
    return d, hf, tok


def run_json(capfd, argv):
    rc = cli.main(argv + ["--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON line, got: {out!r}"
    return json.loads(lines[0])


def test_eval_json_equals_transformers(ckpt, tmp_path, capfd):
    d, hf, tok = ckpt
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 4)
    r = run_json(capfd, ["eval", "--model", str(d), "--text", str(text), "--seq-len", "32"])
    assert set(r) == {"perplexity", "nll", "tokens", "text", "protocol", "rule", "text_tokens", "windows",
                      "window_tokens", "dropped_tokens", "dtype"} and r["text"] == str(text)
    assert r["dtype"] == "float32"  # --dtype auto on a float32 checkpoint
    assert (r["protocol"], r["rule"], r["dropped_tokens"]) == ("amdllm", None, 0)  # the last window is kept
    ref = reference_perplexity(hf, tok(TEXT * 4)["input_ids"], 32)
    assert r["tokens"] == ref["tokens"]
    assert abs(r["perplexity"] / ref["perplexity"] - 1) < 1e-4
    # the weights loaded split over 8 devices (each reads its blocks) give the same perplexity
    for mesh in ("fsdp=8", "data=2,fsdp=4"):
        m = run_json(capfd, ["eval", "--model", str(d), "--text", str(text), "--seq-len", "32", "--mesh", mesh,
                             "--batch-size", "3"])
        assert abs(m["perplexity"] / ref["perplexity"] - 1) < 1e-4 and m["tokens"] == ref["tokens"], mesh


def test_eval_names_the_text_it_measured(ckpt, capfd):
    """A user's model without --text is measured on the course stories, and the command says so: a note on
    stderr and the text named in the result line."""
    d, _, _ = ckpt
    assert cli.main(["eval", "--model", str(d), "--seq-len", "32"]) == 0
    out, err = capfd.readouterr()
    assert "no --text given: measuring the course's held-out stories" in err
    assert "of the course's held-out stories (" in out and "corpus_heldout.txt" in out


def test_quantize_names_the_text_it_calibrated_on(ckpt, tmp_path, capfd):
    """As eval: a user's model quantized without --calib is calibrated on the course stories, and the
    command says so on stderr; the report names the file."""
    d, _, _ = ckpt
    assert cli.main(["quantize", "--model", str(d), "--out", str(tmp_path / "q"), "--bits", "4",
                     "--group-size", "32", "--samples", "8", "--seq-len", "32", "--json"]) == 0
    out, err = capfd.readouterr()
    assert "no --calib given: calibrating on the course's stories" in err and "corpus_train.txt" in err
    assert json.loads(out.strip().splitlines()[-1])["calibration"]["calib"].endswith("corpus_train.txt")


def test_quantize_searches_the_grid_by_default_and_says_so(ckpt, tmp_path, capfd):
    """The default searches each group's range (the reference's mse), --no-mse keeps the min-max grid;
    the JSON and quantize_config.json's meta.mse (GPTQModel's field: the norm, 0 for none) say which,
    and the two give different scales."""
    d, _, _ = ckpt
    common = ["--model", str(d), "--bits", "4", "--group-size", "32", "--samples", "8", "--seq-len", "32", "--json"]
    scales = {}
    for flags, norm in (([], 2.4), (["--no-mse"], 0.0)):
        out_dir = tmp_path / f"q{norm}"
        assert cli.main(["quantize", *common, "--out", str(out_dir), *flags]) == 0
        res = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
        assert res["mse"] is (norm > 0)
        assert json.loads((out_dir / "quantize_config.json").read_text())["meta"]["mse"] == norm
        t = read_checkpoint_tensors(out_dir)
        scales[norm] = np.concatenate([t[k].astype(np.float32).ravel() for k in sorted(t) if k.endswith(".scales")])
    assert scales[2.4].mean() < scales[0.0].mean()  # shrunk ranges: smaller scales on the whole


def test_eval_with_peft_adapter_and_bf16(ckpt, tmp_path, capfd):
    """--adapter applies a PEFT-written LoRA adapter: perplexity equals peft's model; --dtype bfloat16
    stays within 2% of float32."""
    import copy
    from peft import LoraConfig, get_peft_model
    d, hf, tok = ckpt
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      init_lora_weights=False, task_type="CAUSAL_LM")  # random A and B: not a no-op
    peft_model = get_peft_model(copy.deepcopy(hf), lcfg).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 2)
    ids = tok(TEXT * 2)["input_ids"]
    r = run_json(capfd, ["eval", "--model", str(d), "--adapter", str(tmp_path / "adapter"), "--text",
                         str(text), "--seq-len", "32"])
    ref = reference_perplexity(peft_model, ids, 32)
    assert abs(r["perplexity"] / ref["perplexity"] - 1) < 1e-4
    assert abs(r["perplexity"] / reference_perplexity(hf, ids, 32)["perplexity"] - 1) > 1e-3  # it mattered
    bf = run_json(capfd, ["eval", "--model", str(d), "--text", str(text), "--seq-len", "32", "--dtype", "bfloat16"])
    f32 = reference_perplexity(hf, ids, 32)["perplexity"]
    assert bf["tokens"] == r["tokens"] and abs(bf["perplexity"] / f32 - 1) < 0.02


def test_generate_json_equals_transformers(ckpt, capfd):
    d, hf, tok = ckpt
    prompt = "Once upon a time, there was"
    r = run_json(capfd, ["generate", "--model", str(d), "--prompt", prompt, "--max-new-tokens", "12"])
    assert set(r) == {"text", "token_ids", "prompt_tokens", "new_tokens", "tokens_per_second", "dtype"}
    assert r["dtype"] == "float32"  # --dtype auto on a float32 checkpoint
    ids = tok(prompt)["input_ids"]
    assert r["prompt_tokens"] == len(ids) and ids[0] == tok.bos_token_id
    ref = hf_greedy(hf, [ids], 12, eos=tok.eos_token_id, pad=tok.pad_token_id)[0]
    ref = ref[:ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref
    assert r["token_ids"] == ref and r["new_tokens"] == len(ref)
    assert r["text"] == tok.decode([t for t in ref if t != tok.eos_token_id], skip_special_tokens=True)
    assert r["tokens_per_second"] > 0
    # seeded sampling through the CLI is reproducible
    argv = ["generate", "--model", str(d), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "1",
            "--top-p", "0.9", "--seed", "7"]
    assert run_json(capfd, argv)["token_ids"] == run_json(capfd, argv)["token_ids"]


def test_cli_errors_are_one_line(ckpt, tmp_path, capfd):
    d, _, _ = ckpt
    rc = cli.main(["eval", "--model", str(d), "--text", str(tmp_path / "missing.txt"), "--json"])
    out, err = capfd.readouterr()
    assert rc == 2 and out == "" and "missing.txt" in err and len(err.strip().splitlines()) == 1
    rc = cli.main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"])
    out, err = capfd.readouterr()
    assert rc != 0 and "nowhere" in err
    # serve checks its port before it loads anything (the model below does not exist)
    rc = cli.main(["serve", "--model", str(tmp_path / "nowhere"), "--port", "99999"])
    out, err = capfd.readouterr()
    assert rc == 2 and err.strip() == "amdllm serve: error: --port 99999: expected 0 to 65535"



def test_flag_errors_and_help_answer_without_loading_jax():
    """Parsing a command line imports no JAX (`amdllm.cli.parser`): a flag error is one line, status 2, and
    `--help` prints, before any of the library is loaded."""
    code = ("import sys\nfrom amdllm.cli import main\n"
            "for argv in (['generate'], ['finetune', '--data', 'x.jsonl', '--out', 'o', '--steps', '0'],\n"
            "             ['eval', '--dtype', 'f16'], ['quantize', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        print('status', e.code)\n"
            "print('loaded', sorted(m for m in ('jax', 'flax', 'transformers', 'torch') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.count("status 2") == 3 and r.stdout.count("status 0") == 2 and "loaded []" in r.stdout, r
    assert "usage: amdllm quantize" in r.stdout and f"amdllm {amdllm.__version__}\n" in r.stdout
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 3, errors
    assert errors[0] == ("amdllm generate: error: the following arguments are required: --prompt "
                         "(see amdllm generate --help)")
    assert errors[1] == ("amdllm finetune: error: argument --steps: expected an integer >= 1, got 0 "
                         "(see amdllm finetune --help)")
    assert errors[2].startswith("amdllm eval: error: argument --dtype: invalid choice: 'f16'") and \
        errors[2].endswith("(see amdllm eval --help)")  # argparse quotes the choices or not, by version


def test_parser_vocabularies_are_the_library_tables():
    """The flags' choices, written out in `amdllm.cli.parser` so that parsing loads no JAX, equal the tables of
    the library that takes them."""
    from amdllm.cli import parser
    from amdllm.infer.generate import DTYPE_CHOICES
    from amdllm.infer.protocols import PROTOCOLS
    from amdllm.io.convert import DTYPES
    from amdllm.parallel import plan, sharding
    from amdllm.train.data import TOO_LONG
    assert parser.DTYPE_CHOICES == DTYPE_CHOICES and parser.PROTOCOLS == PROTOCOLS and parser.TOO_LONG == TOO_LONG
    assert parser.CONVERT_DTYPES == tuple(sorted(DTYPES))
    assert parser.RULES == tuple(sorted(sharding.RULES)) and parser.DEFAULT_RULES == sharding.DEFAULT_RULES
    assert parser.ACCELERATORS == tuple(plan.PEAK_BF16_TFLOPS) and parser.PLAN_DTYPES == tuple(plan.DTYPE_BYTES)
    assert set(parser.COMMANDS) == set(next(a for a in parser.build_parser()._actions if a.dest == "command").choices)

def test_doctor_json(capfd):
    r = run_json(capfd, ["doctor"])
    for key in ("backend", "jax", "versions", "torch", "system", "env", "warnings", "host_memory_bytes", "amdllm_backend"):
        assert key in r
    assert r["backend"] == "cpu" and r["jax"]["devices"][0]["platform"] == "cpu"
    assert r["versions"]["jax"] and r["versions"]["flax"] and isinstance(r["warnings"], list)


def facts(backend="cpu", platform_version="cpu", kfd=False, nvidia=(), torch=None, plugins=None, env_vars=None):
    """A made-up machine, in the shape `env.collect_facts()` returns."""
    return {"jax": {"backend": backend, "platform_version": platform_version, "devices": [], "error": None},
            "system": {"dev_kfd": kfd, "dev_kfd_rw": kfd, "dev_nvidia": list(nvidia), "dev_dri_render": []},
            "torch": torch or {"installed": True, "hip": None, "cuda": None, "gpu_available": False},
            "versions": {"jaxlib": "0.10.2"}, "jax_gpu_plugins": plugins or {}, "env": env_vars or {}}


def test_silent_cpu_fallback_is_diagnosed():
    rocm_torch = {"installed": True, "hip": "6.2.41133", "cuda": None, "gpu_available": True, "gpu_count": 8}
    w = env.diagnose(facts(kfd=True, torch=rocm_torch))
    assert len(w) == 1 and "JAX runs on the CPU" in w[0] and "/dev/kfd" in w[0] and "ROCm/HIP 6.2" in w[0]
    assert "jax[rocm]" in w[0] and "rocm/jax" in w[0]  # says how to fix it
    assert any("JAX runs on the CPU" in m for m in env.diagnose(facts(nvidia=["/dev/nvidia0"])))
    # a laptop without a GPU, and a machine where JAX does use the GPU: no fallback warning
    assert env.diagnose(facts()) == []
    ok = facts(backend="gpu", platform_version="rocm 6.2.41133", kfd=True, torch=rocm_torch,
               env_vars={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert env.diagnose(ok) == []
    assert env.backend_name(ok) == "gpu (rocm)"
    assert env.backend_name(facts(backend="gpu", platform_version="PJRT C API\ncuda 12030")) == "gpu (cuda)"


def test_other_setup_warnings():
    w = env.diagnose(facts(plugins={"jax-rocm7-plugin": "0.9.1"}))
    assert len(w) == 1 and "jax-rocm7-plugin 0.9.1 does not match jaxlib 0.10.2" in w[0]
    assert env.diagnose(facts(plugins={"jax-rocm7-plugin": "0.10.2"})) == []
    assert "hides every GPU" in env.diagnose(facts(env_vars={"HIP_VISIBLE_DEVICES": ""}))[0]
    broken = facts()
    broken["jax"]["error"] = "RuntimeError: Unable to initialize backend 'rocm'"
    assert "could not list its devices" in env.diagnose(broken)[0]
    gpu_torch = {"installed": True, "hip": "6.2", "cuda": None, "gpu_available": True, "gpu_count": 1}
    assert "PREALLOCATE" in env.diagnose(facts(backend="gpu", platform_version="rocm", torch=gpu_torch))[0]


def test_doctor_names_the_backend_and_no_command_re_executes_itself():
    """`amdllm doctor --json` reports the amdllm backend in use; the command runs as one process (no
    re-execution for a malloc setting): its pid is the one started."""
    root = Path(__file__).resolve().parents[1]
    code = ("import os, sys, runpy; print('pid', os.getpid(), file=sys.stderr); sys.argv = ['amdllm', 'doctor', '--json'];"
            " import amdllm.cli; sys.exit(amdllm.cli.main())")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=root)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"pid {p.pid}" in err
    b = json.loads(out)["amdllm_backend"]
    assert b["backend"] in ("cpu", "none") and (b["backend"] == "none") == (os.environ.get("AMDLLM_BACKEND") == "off")
    off = subprocess.run([sys.executable, "-m", "amdllm.cli", "doctor"], capture_output=True, text=True, timeout=300,
                         cwd=root, env={**os.environ, "AMDLLM_BACKEND": "off"})
    assert off.returncode == 0 and "amdllm backend: none" in off.stdout, off.stderr



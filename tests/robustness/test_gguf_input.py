"""Bad GGUF files: one line naming the file (and the tensor or field) at fault, and nothing written."""
import numpy as np
import pytest

from tests.gguf_maker import write_llama_gguf
from tests.robustness.conftest import amdllm, one_line_error


def _text(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_text("a text file\n")
    return f


def _truncated(tmp_path, keep):
    b = write_llama_gguf(tmp_path / "full.gguf").read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(b[:keep(len(b))])
    return f


CASES = {
    "not a GGUF file": (_text, ["not a GGUF file", "magic"]),
    "header cut short": (lambda t: _truncated(t, lambda n: 40), ["not a readable GGUF file"]),
    "tensors cut short": (lambda t: _truncated(t, lambda n: n // 2), ["not a readable GGUF file"]),
    "another architecture": (lambda t: write_llama_gguf(t / "q.gguf", arch="qwen2"),
                             ["general.architecture", "qwen2"]),
    "a tensor type not read": (lambda t: write_llama_gguf(t / "iq.gguf", types={"blk.1.ffn_up.weight": "IQ4_NL"}),
                               ["blk.1.ffn_up.weight", "IQ4_NL", "Q4_K"]),
    "llama3 rope as a tensor": (lambda t: write_llama_gguf(
        t / "r.gguf", extra={"rope_freqs.weight": (np.ones(32, np.float32), "F32")}), ["rope_freqs.weight"]),
    "a missing tensor": (lambda t: write_llama_gguf(t / "d.gguf", drop=("blk.1.ffn_up.weight",)),
                         ["model.layers.1.mlp.up_proj.weight", "missing", "GGUF metadata"]),
    "no tokenizer": (lambda t: write_llama_gguf(t / "n.gguf"), ["tokenizer"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_convert_refuses_a_bad_gguf_file(case, tmp_path):
    make, words = CASES[case]
    f = make(tmp_path)
    out = tmp_path / "out"
    line = one_line_error(amdllm("convert", "--model", f, "--out", out), str(f), *words)
    assert not out.exists(), line


@pytest.mark.parametrize("command", [["eval"], ["generate", "--prompt", "hi"], ["serve"]])
def test_commands_that_read_directories_name_the_convert_step_for_a_gguf_file(command, tmp_path):
    f = write_llama_gguf(tmp_path / "m.gguf")
    one_line_error(amdllm(command[0], "--model", f, *command[1:]), str(f), "amdllm convert")

"""Classes "bounded work" and "accepted without a word": work is bounded by the model and the data (the
context, the text's length, a template's steps), and a request that would give a wrong or useless result
is refused by name. Each case runs the `amdllm` command in its own process."""
import json

import pytest

from tests.robustness.conftest import amdllm, one_line_error


def test_finetune_and_quantize_refuse_a_seq_len_beyond_the_context(tiny, tmp_path):
    """max_position_embeddings 128: --seq-len 100000 was planned at 2.4 GB and OOM-killed at 22 GB."""
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", tmp_path / "a",
                          "--seq-len", "100000"), "--seq-len 100000", "max_position_embeddings=128")
    one_line_error(amdllm("quantize", "--model", tiny["model"], "--out", tmp_path / "q", "--seq-len", "100000",
                          "--group-size", "32"), "--seq-len 100000", "max_position_embeddings=128")
    assert not (tmp_path / "a").exists() and not (tmp_path / "q").exists()


def test_quantize_samples_are_bounded_by_the_text(tiny, tmp_path):
    """--samples 1000000 on a 6 KB text was OOM-killed at 15 GB: the text holds only so many windows."""
    for protocol in ("amdllm", "gptq"):
        one_line_error(amdllm("quantize", "--model", tiny["model"], "--out", tmp_path / "q", "--calib", tiny["text"],
                              "--samples", "1000000", "--seq-len", "64", "--protocol", protocol, "--group-size", "32"),
                       "--samples 1000000", "distinct windows of 64 tokens")


def test_a_seed_beyond_what_generators_take_is_refused_by_the_parser(tiny, tmp_path):
    for argv in (["generate", "--model", tiny["model"], "--prompt", "the"],
                 ["finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", tmp_path / "a"]):
        one_line_error(amdllm(*argv, "--seed", str(2**70)), "--seed", "<= 4294967295")


def test_plan_refuses_a_group_size_quantize_refuses(tiny):
    one_line_error(amdllm("plan", "--model", tiny["model"], "--bits", "4", "--group-size", "7"), "--group-size 7")
    one_line_error(amdllm("quantize", "--model", tiny["model"], "--out", "/nonexistent/q", "--group-size", "7"),
                   "group_size=7 is not supported")


def test_plan_json_with_stdout_closed_is_one_line(tiny):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "amdllm.cli", "plan", "--json"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=120, pass_fds=(),
                       preexec_fn=lambda: __import__("os").close(1))
    one_line_error(p, "stdout is closed")


def test_a_learning_rate_that_overflows_writes_no_adapter(tiny, tmp_path):
    """--lr 1e308 gave an all-NaN adapter and exit 0: the overflowing update is caught before it applies."""
    out = tmp_path / "a"
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", tiny["data"], "--out", out, "--steps", "3",
                          "--lr", "1e308", "--warmup", "0", "--seq-len", "32", "--no-progress"),
                   "update norm", "--lr 1e+308")
    assert not (out / "adapter_model.safetensors").exists()


def chat_rows(path, n=3):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_template_that_never_ends_is_stopped_naming_the_file_and_line(tiny, tmp_path):
    tpl = tmp_path / "loop.jinja"
    tpl.write_text("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")
    data = chat_rows(tmp_path / "chat.jsonl")
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", data, "--out", tmp_path / "a",
                          "--chat-template", tpl, timeout=120), f"{data}:1", f"--chat-template {tpl}",
                   "a loop without bound")


def test_an_empty_or_broken_template_is_refused_where_it_is_given(tiny, tmp_path):
    data = chat_rows(tmp_path / "chat.jsonl")
    empty, broken = tmp_path / "empty.jinja", tmp_path / "broken.jinja"
    empty.write_text("  \n")
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", data, "--out", tmp_path / "a",
                          "--chat-template", empty), str(empty), "empty")
    for argv in (["finetune", "--model", tiny["model"], "--data", data, "--out", tmp_path / "a"],
                 ["serve", "--model", tiny["model"], "--port", "0"]):
        one_line_error(amdllm(*argv, "--chat-template", broken, timeout=120), str(broken), "line 1",
                       "does not parse")


@pytest.mark.parametrize("row,named", [
    ('{"text": "\\ud800 alone"}', ["field 'text'", "lone surrogate", "U+D800"]),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\\udfff"}]}',
     ["messages[1].content", "lone surrogate"]),
    ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
])
def test_data_that_is_not_text_is_named_by_line(row, named, tiny, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "fine"}\n' + row + "\n")
    one_line_error(amdllm("finetune", "--model", tiny["model"], "--data", data, "--out", tmp_path / "a"),
                   f"{data}:2", *named)


def test_generate_ids_refuses_a_pad_id_outside_the_vocabulary(tiny):
    from amdllm.infer.generate import generate_ids
    from amdllm.io import checkpoint
    model = checkpoint.load(tiny["model"])
    with pytest.raises(ValueError, match=r"pad_id 1000000000 is outside the model's vocabulary \[0, 320\)"):
        generate_ids(model, [[5, 6, 7]], 2, pad_id=10**9)
    assert len(generate_ids(model, [[5, 6, 7], [5]], 2, pad_id=2)[1]) == 2  # an id inside is fine

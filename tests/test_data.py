"""Data: row shapes, templates, loss masks, packing, deterministic order, and clear errors."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from amdllm.io.templates import LLAMA3_SPECIALS
from amdllm.train import data
from amdllm.config import LlamaConfig
from amdllm.model import Llama
from amdllm.io.tokenizer import load_tokenizer

TOK_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOK_DIR)


@pytest.fixture(scope="module")
def tok3():
    t = load_tokenizer(TOK_DIR)
    t.add_special_tokens({"additional_special_tokens": list(LLAMA3_SPECIALS)})
    return t


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(l if isinstance(l, str) else json.dumps(l) + "\n" for l in lines))
    return p


def test_alpaca_plain_template_and_loss_mask_on_response_only(tok):
    row = {"instruction": "What color is the hen?", "input": "A blue hen.", "output": "blue"}
    ids, mask = data.encode_row(row, tok)
    text = tok.decode(ids)
    assert text == ("<|begin_of_text|>### Instruction:\nWhat color is the hen?\n\n### Input:\nA blue hen."
                    "\n\n### Response:\nblue<|end_of_text|>")
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "blue<|end_of_text|>"  # the response and its EOS, nothing of the prompt
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1 and mask[0] == 0
    assert tok.decode(data.prompt_ids(row, tok)).endswith("### Response:\n")
    no_input = tok.decode(data.encode_row({"instruction": "Say hi.", "output": "hi"}, tok)[0])
    assert "### Input" not in no_input


def test_llama3_chat_template_when_tokenizer_has_header_tokens(tok3):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                        {"role": "assistant", "content": "Bye now"}]}
    ids, mask = data.encode_row(row, tok3)
    assert tok3.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye now<|eot_id|>")
    trained = tok3.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "Hello<|eot_id|>Bye now<|eot_id|>"
    eot = tok3.convert_tokens_to_ids("<|eot_id|>")
    assert ids.count(eot) == 5 and ids[-1] == eot


def test_plain_text_rows_train_on_everything_but_bos(tok):
    ids, mask = data.encode_row({"text": "The cat sat."}, tok)
    assert mask == [0] + [1] * (len(ids) - 1) and ids[-1] == tok.eos_token_id


def test_packing_segments_positions_and_attention_separation(tok):
    ex = [([0, 5, 6, 7], [0, 0, 1, 1]), ([0, 8, 9], [0, 1, 1]), ([0, 10, 11, 12, 13], [0, 0, 0, 1, 1])]
    ds = data.build_dataset(ex, seq_len=6, pack=True)
    assert len(ds) == 2 and ds.stats["rows"] == 2
    np.testing.assert_array_equal(ds.tokens[0], [0, 5, 6, 0, 8, 0])
    np.testing.assert_array_equal(ds.targets[0], [5, 6, 7, 8, 9, 0])
    np.testing.assert_array_equal(ds.weights[0], [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(ds.segment_ids[0], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(ds.positions[0], [0, 1, 2, 0, 1, 0])
    # packed rows give each example exactly the logits it has alone (the model separates segments)
    cfg = LlamaConfig.from_dict(dict(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    m = Llama(cfg, rngs=nnx.Rngs(0))
    packed, _ = m(jnp.asarray(ds.tokens[:1]), positions=jnp.asarray(ds.positions[:1]),
                  segment_ids=jnp.asarray(ds.segment_ids[:1]))
    alone, _ = m(jnp.asarray([[0, 8]]))
    np.testing.assert_allclose(np.asarray(packed[0, 3:5]), np.asarray(alone[0]), atol=1e-5)
    padded = data.build_dataset(ex, seq_len=6, pack=False)
    assert len(padded) == 3 and padded.segment_ids[1].tolist() == [1, 1, 0, 0, 0, 0]


def test_too_long_truncated_or_dropped_and_counted():
    ex = [([0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 1, 1, 1, 1]), ([0, 1, 2], [0, 1, 1]),
          ([0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0, 1])]
    t = data.build_dataset(ex, seq_len=4, pack=False, too_long="truncate")
    # the third example's only response token is cut off: nothing left to learn, dropped
    assert t.stats["truncated"] == 2 and t.stats["dropped"] == 1 and len(t) == 2
    assert t.tokens[0].tolist() == [0, 1, 2, 3]
    assert t.stats["dropped_tokens"] == 3 + 1  # predictions cut: 3 of the first, the third's only one
    d = data.build_dataset(ex, seq_len=4, pack=False, too_long="drop")
    assert d.stats["truncated"] == 0 and d.stats["dropped"] == 2 and len(d) == 1
    assert d.stats["dropped_tokens"] == 6 + 1


def test_too_long_split_into_windows_by_default_every_prediction_kept():
    """A long document becomes consecutive seq_len windows (each its own segment, positions from 0) that
    predict each of its tokens exactly once; a window of prompt only is left out; nothing is dropped."""
    doc = list(range(3, 14))                       # 11 tokens: 10 predictions
    ex = [(doc, [1] * len(doc)), ([0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0, 1])]
    ds = data.build_dataset(ex, seq_len=4)
    assert ds.stats["split"] == 2 and ds.stats["dropped"] == 0 and ds.stats["dropped_tokens"] == 0
    seg = ds.segment_ids > 0
    pairs = list(zip(ds.tokens[seg].tolist(), ds.targets[seg].tolist()))
    assert pairs[:10] == list(zip(doc[:-1], doc[1:]))  # in order, none lost or repeated
    assert ds.weights[seg].sum() == 10 + 1            # the second example's [0..3] window is prompt only
    assert ds.positions[0].tolist() == [0, 1, 2, 3] and ds.positions[2].tolist()[:2] == [0, 1]


def test_batch_order_is_deterministic_and_covers_each_epoch():
    a = [data.batch_indices(10, s, 4, seed=3) for s in range(5)]
    b = [data.batch_indices(10, s, 4, seed=3) for s in range(5)]
    assert all((x == y).all() for x, y in zip(a, b))
    flat = np.concatenate(a)
    assert sorted(flat[:10].tolist()) == list(range(10))  # epoch 0 is a permutation
    assert not (data.batch_indices(10, 0, 4, seed=4) == a[0]).all()
    assert data.cursor(10, 3, 4) == {"epoch": 1, "offset": 2}


def test_load_dataset_reads_course_rows(tmp_path, tok):
    p = write(tmp_path, [{"instruction": "Q?", "input": "ctx", "output": "a"}, "\n", {"text": "hello"},
                         {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}])
    ds = data.load_dataset(p, tok, seq_len=256)
    assert ds.stats["examples"] == 3 and len(ds) == 1 and ds.segment_ids[0].max() == 3
    assert len(ds.rows) == 3


@pytest.mark.parametrize("lines, message", [
    ([{"text": "ok"}, '{"text": "broken"\n'], r"d\.jsonl:2: malformed JSON"),
    ([{"instruction": "x"}], r"d\.jsonl:1: missing field 'output'"),
    ([{"text": "ok"}, "\n", {"prompt": "x"}], r"d\.jsonl:3: missing field.*'instruction' and 'output'.*'prompt'"),
    ([{"messages": [{"role": "user", "content": "x"}]}], r"d\.jsonl:1: no assistant message"),
    ([{"text": 3}], r"d\.jsonl:1: field 'text' must be a string"),
    (["[1, 2]\n"], r"d\.jsonl:1: expected a JSON object"),
    (["\n", "  \n"], r"d\.jsonl: empty data file"),
    ([], r"d\.jsonl: empty data file"),
])
def test_bad_input_is_a_clear_error(tmp_path, tok, lines, message):
    p = write(tmp_path, lines)
    with pytest.raises(data.DataError, match=message):
        data.load_dataset(p, tok, seq_len=32)


def test_missing_file_and_nothing_usable(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such data file"):
        data.load_dataset(tmp_path / "nope.jsonl", tok, seq_len=32)
    p = write(tmp_path, [{"text": "a long text " * 20}])
    with pytest.raises(data.DataError, match="no usable examples: 1 dropped"):
        data.load_dataset(p, tok, seq_len=8, too_long="drop")
